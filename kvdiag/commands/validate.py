"""``kvdiag validate``: score the checklist against the reference pool's ground truth.

Runs every scenario on both reference engines (a deployment story on the engines it exists for), reads the emitted metrics back through kvdiag's
adapters, diagnoses them with the real checklist at every scrape (sliding windows, as the
exporter would), and scores each verdict against what the simulator's own state says limits
the engine at that instant (``kvdiag.refpool.validate``): instants right, misleading (pointing
away from a pool that limits) and false alarms (naming L1 while it does not), the first instant
L1 is named against the onset and the SLO breach, and the final verdict. Runs go to worker
processes, one per core; a progress bar on a terminal, one plain line per run when piped.
With the whole catalogue (or ``--whatif``), the what-if pairs run too (``kvdiag.whatif.pairs``:
a remedy predicted from a scenario's metrics against the scenario run with it).
Exit 0 when every final verdict and every scored instant is right (so no misleading and no
false-alarm instant) and every what-if pair run is within its goal, 1 otherwise, 3 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvdiag import config as cfg
from kvdiag.real.catalogue import STORIES as REAL_STORIES
from kvdiag.refpool.scenarios import CATALOGUE, ENGINES, get
from kvdiag.refpool.sim import tune_gc
from kvdiag.refpool.validate import GRACE_S, SCORED_FROM_S, TRUTH_SPAN_S, Report, Result, validate
from kvdiag.report.json import dumps
from kvdiag.whatif import pairs as whatif_pairs

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "validate",
        description="Exit code: 0 when every final verdict and every scored instant matches its ground truth "
        "(no misleading, no false-alarm instant), 1 otherwise, 3 on an error.",
    )
    p.add_argument("--scenario", action="append", choices=sorted(CATALOGUE) + sorted(REAL_STORIES), help="only this scenario (repeatable; with --real, a real story)")
    p.add_argument("--engine", action="append", choices=ENGINES, help="only this engine (repeatable)")
    p.add_argument("--interval", type=float, default=5.0, help="simulated seconds between scrapes (default 5)")
    p.add_argument("--mem-fraction", type=float, help="re-size every scenario's pool (deployment memory fraction, default 0.9)")
    p.add_argument("--config", metavar="YAML", help="thresholds file (its 'checks:' section)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a threshold (see `kvdiag explain`)")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="print the JSON scores only")
    p.add_argument("--real", action="store_true",
                   help="the real stories on real vLLM / SGLang servers on this machine's CPU (docs/real-engines.md; "
                   "needs `bash scripts/real-env.sh ENGINE` first, several GB): scored against the engines' own decisions")  # fmt: skip
    p.add_argument("--calibrate", action="store_true",
                   help="with --real: also tell each real run's requests to the reference engine of its kind with the same "
                   "pool and caps and print both engines' gauge shapes side by side (kvdiag.real.calibrate, "
                   "docs/real-engine-shapes.md); a shape out of its tolerance makes the exit code 1")  # fmt: skip
    p.add_argument("--whatif", action=argparse.BooleanOptionalAction,
                   help="also run the what-if pairs (kvdiag.whatif.pairs) of the scenarios and engines selected; with "
                   "--real, instead: record a real incident, predict each remedy from it and re-run the real engine "
                   "under each (kvdiag.whatif.reality, docs/whatif-real.md) "
                   "(default: only when no --scenario is given)")  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = cfg.resolve(args.config, args.set)
    except cfg.ConfigError as exc:
        print(f"kvdiag validate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    unknown = [n for n in args.scenario or () if (n in REAL_STORIES) != bool(args.real)]
    if unknown:
        print(f"kvdiag validate: {', '.join(unknown)}: {'not a real story' if args.real else 'a real story (use --real)'}", file=sys.stderr)
        return EXIT_ERROR
    if args.calibrate and (not args.real or args.whatif):
        print("kvdiag validate: --calibrate compares real runs: it needs --real (and no --whatif)", file=sys.stderr)
        return EXIT_ERROR
    if args.real and args.whatif:
        from kvdiag.whatif.reality import validate_real_whatif

        return validate_real_whatif(args, config)
    if args.real:
        from kvdiag.real.report import validate_real

        return validate_real(args, config, render)
    if args.interval <= 0:
        print("kvdiag validate: --interval must be > 0", file=sys.stderr)
        return EXIT_ERROR
    if args.jobs < 0:
        print("kvdiag validate: --jobs must be >= 0", file=sys.stderr)
        return EXIT_ERROR
    scenarios = [get(name, args.mem_fraction) for name in (args.scenario or CATALOGUE)]
    engines = args.engine or list(ENGINES)
    jobs = args.jobs or len(os.sched_getaffinity(0))
    tune_gc()
    total = sum(engine in sc.engines for sc in scenarios for engine in engines)  # a deployment runs on its engines only
    err = Console(stderr=True)
    if err.is_terminal:
        with Progress(TextColumn("validate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=err, transient=True) as bar:  # fmt: skip
            task = bar.add_task("", total=total)

            def tick(scenario: str, engine: str, results: list[Result]) -> None:
                bar.update(task, advance=1, description=f"{scenario} on {engine}: {_outcome(results)}")

            report = validate(scenarios, engines, config, args.interval, jobs, tick)
    else:
        report = validate(scenarios, engines, config, args.interval, jobs, _plain(total))
    wanted = args.whatif if args.whatif is not None else not args.scenario
    pairs = whatif_pairs.validate_pairs(whatif_pairs.select(args.scenario, args.engine), config, args.interval, jobs,
                                        whatif_pairs.progress_lines(), args.mem_fraction) if wanted else []  # fmt: skip
    if args.json:
        print(dumps(report.as_json() | ({"whatif": [p.as_json() for p in pairs]} if wanted else {}), indent=2))
    else:
        console = Console(width=None if sys.stdout.isatty() else 200)
        render(console, report)
        if pairs:
            whatif_pairs.render(console, pairs)
    return 0 if report.ok and all(p.ok for p in pairs) else 1


def _outcome(results: list[Result]) -> str:
    bad = sum(r.misleading + r.false_alarms for r in results)
    return "ok" if all(r.clean for r in results) else f"{bad} misleading/false-alarm instants" if bad else "wrong verdicts"


def _plain(total: int) -> Callable[[str, str, list[Result]], None]:
    """One line per finished run on stderr, for logs and pipes (no terminal control codes)."""
    count = 0

    def tick(scenario: str, engine: str, results: list[Result]) -> None:
        nonlocal count
        count += 1
        print(f"validate [{count}/{total}] {scenario} on {engine}: {_outcome(results)}", file=sys.stderr, flush=True)

    return tick


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0f}s"


def render(console: Console, report: Report) -> None:
    table = Table(title="kvdiag validate: checklist verdicts against reference-pool ground truth, instant by instant")
    cols = ("scenario", "engine", "final truth", "final verdict", "", "instants right", "misleading", "false alarms",
            "onset", "L1 named", "SLO breach", "KV-blocked", "evictions")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="right" if col in ("onset", "KV-blocked", "evictions", "instants right", "misleading", "false alarms") else "left", overflow="fold")
    for r in report.results:
        t = r.truth
        table.add_row(
            r.name, r.engine, r.expected, r.verdict,
            "[green]ok[/green]" if r.clean else "[red]WRONG[/red]",
            f"{r.right}/{len(r.scored)}", _n(r.misleading), _n(r.false_alarms),
            "-" if t.onset is None else f"{t.onset:.0f}s",
            _s(r.since_onset(r.detected)), _s(r.since_onset(t.slo_breach)),
            f"{t.kv_blocked_share:.0%}", str(t.evictions),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"instants: every scrape from {SCORED_FROM_S:g}s on, against the truth over the {TRUTH_SPAN_S:g}s before it, except "
        f"{GRACE_S:g}s after and {TRUTH_SPAN_S:g}s before each change of truth; onset: ground-truth start of the L1 bottleneck (simulated s); "
        "L1 named / SLO breach: seconds after it"
    )
    for r in report.results:
        wrong = [i for i in r.scored if not i.right]
        if wrong:
            shown = ", ".join(f"{i.t:.0f}s {i.verdict} (truth {i.truth})" for i in wrong[:4])
            console.print(f"[red]{r.name} on {r.engine}[/red]: {len(wrong)} wrong instants: {shown}{' ...' if len(wrong) > 4 else ''}")
    early = [r for r in report.results if r.truth.onset is not None]
    before = sum(bool(r.named_before_breach) for r in early)
    scored = sum(len(r.scored) for r in report.results)
    right = sum(r.right for r in report.results)
    console.print(
        f"{report.correct}/{len(report.results)} final verdicts right; {right}/{scored} scored instants right, "
        f"{report.misleading} misleading, {report.false_alarms} false alarms; "
        f"L1 named before the SLO breach in {before}/{len(early)} L1 scenarios"
    )


def _n(v: int) -> str:
    return "[red]" + str(v) + "[/red]" if v else "0"
