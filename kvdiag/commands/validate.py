"""``kvdiag validate``: score the checklist against the reference pool's ground truth.

Runs every scenario on both reference engines, reads the emitted metrics back through kvdiag's
adapters, diagnoses them with the real checklist over sliding windows, and compares each final
verdict with the label the simulator's own records imply (``kvdiag.refpool.validate``). Prints a
confusion matrix and, for L1 scenarios, how long after the ground-truth onset the checklist
first named L1 and how long after it P99 TTFT crossed the SLO. Exit 0 when every verdict is
right, 1 otherwise, 3 on a usage error.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from kvdiag import config as cfg
from kvdiag.refpool.scenarios import ENGINES, SCENARIOS, get
from kvdiag.refpool.sim import tune_gc
from kvdiag.refpool.validate import Report, validate
from kvdiag.report.json import dumps

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "validate",
        help="run every scenario on both reference engines and score the verdicts against ground truth",
        description="Exit code: 0 when every verdict matches its ground truth, 1 otherwise, 3 on an error.",
    )
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="only this scenario (repeatable)")
    p.add_argument("--engine", action="append", choices=ENGINES, help="only this engine (repeatable)")
    p.add_argument("--interval", type=float, default=5.0, help="simulated seconds between scrapes (default 5)")
    p.add_argument("--mem-fraction", type=float, help="re-size every scenario's pool (deployment memory fraction, default 0.9)")
    p.add_argument("--config", metavar="YAML", help="thresholds file (its 'checks:' section)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a threshold (see `kvdiag explain`)")
    p.add_argument("--json", action="store_true", help="print the JSON scores only")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = cfg.resolve(args.config, args.set)
    except cfg.ConfigError as exc:
        print(f"kvdiag validate: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.interval <= 0:
        print("kvdiag validate: --interval must be > 0", file=sys.stderr)
        return EXIT_ERROR
    scenarios = [get(name, args.mem_fraction) for name in (args.scenario or SCENARIOS)]
    tune_gc()
    report = validate(scenarios, args.engine or ENGINES, config, args.interval)
    if args.json:
        print(dumps(report.as_json(), indent=2))
    else:
        render(Console(width=None if sys.stdout.isatty() else 200), report)
    return 0 if report.correct == len(report.results) else 1


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0f}s"


def render(console: Console, report: Report) -> None:
    table = Table(title="kvdiag validate: checklist verdicts against reference-pool ground truth")
    for col in ("scenario", "engine", "expected (truth)", "verdict", "", "onset", "L1 named", "SLO breach", "exact verdict", "KV-blocked", "evictions"):
        table.add_column(col, justify="right" if col in ("onset", "KV-blocked", "evictions") else "left", overflow="fold")
    for r in report.results:
        t = r.truth
        table.add_row(
            r.name, r.engine, r.expected, r.verdict,
            "[green]ok[/green]" if r.correct else "[red]WRONG[/red]",
            "-" if t.onset is None else f"{t.onset:.0f}s",
            _s(r.since_onset(r.detected)), _s(r.since_onset(t.slo_breach)), _s(r.since_onset(r.exact)),
            f"{t.kv_blocked_share:.0%}", str(t.evictions),
        )  # fmt: skip
    console.print(table)
    console.print("onset: ground-truth start of the L1 bottleneck (simulated s); L1 named / SLO breach / exact verdict: seconds after it")
    matrix = report.confusion()
    cm = Table(title="confusion matrix (rows: expected, columns: verdict)")
    cm.add_column("expected \\ verdict", overflow="fold")
    for v in matrix:
        cm.add_column(v, justify="right", overflow="fold")
    for e, row in matrix.items():
        cm.add_row(e, *(str(n) if n else "." for n in row.values()))
    console.print(cm)
    early = [r for r in report.results if r.truth.onset is not None]
    before = sum(1 for r in early if r.detected is not None and (r.truth.slo_breach is None or r.detected <= r.truth.slo_breach))
    console.print(f"{report.correct}/{len(report.results)} verdicts right; L1 named before the SLO breach in {before}/{len(early)} L1 scenarios")
