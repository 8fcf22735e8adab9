"""``kvdiag whatif``: the incident replayed through the reference engine under each remedy.

The same inputs as ``diagnose`` (engine URLs sampled for a while, recordings, a Prometheus
range, files, logs). For each instance, a workload and deployment are fitted to the window
from the engine's own series (``kvdiag.whatif.fit``), replayed as observed (the calibration,
shown against the incident with its errors: a poor fit is said, never hidden), then replayed
under each remedy (``--remedy``, default: FP8 KV, twice the L1 by TP, one more DP replica,
the recommended admission limit, a higher memory fraction), each measured through the
engine's exposition, the adapters and the real checklist. Replays run in worker processes,
one per core, with a progress bar on a terminal and one plain line per replay when piped;
``--scale K`` replays a scale model (``kvdiag.whatif.scale``) and states its error, measured
against the calibration at full size over the window's first ``--scale-check`` minutes (an
hour at full size is what the scale model is there to avoid).
Exit 0 with the predictions, 3 when nothing could be fitted (the reason on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvdiag import config as cfg
from kvdiag.checks import diagnose
from kvdiag.commands.diagnose import add_source_arguments, add_threshold_arguments, collect, thresholds
from kvdiag.exposition import ExpositionError
from kvdiag.refpool.sim import tune_gc
from kvdiag.report.json import dumps
from kvdiag.report.output import check_writable
from kvdiag.sources.prometheus import PrometheusError
from kvdiag.sources.recording import RecordingError
from kvdiag.whatif.fit import Fit, FitError, fit
from kvdiag.whatif.levers import LeverError, parse, recommended_limit, resolve
from kvdiag.whatif.replay import Job, Run, measure, replay_all
from kvdiag.whatif.report import WhatIf, html_section, render
from kvdiag.whatif.scale import auto_scale, median_running
from kvdiag.window import Window, windows

EXIT_ERROR = 3


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "whatif",
        description="Exit code: 0 with the predictions, 3 when no instance could be fitted (the reason on stderr).",
    )
    add_source_arguments(p)
    add_threshold_arguments(p)
    p.add_argument("--remedy", action="append", default=[], metavar="NAME[=VALUE]",
                   help="a remedy to replay (repeatable): max-running=N, mem-fraction=F, kv-dtype=fp8, tp=N, dp=N, "
                   "l2-ratio=R, pool=TOKENS, conservativeness=F (SGLang); a bare name takes its default (default: fp8 KV, 2x TP, one more DP replica, the "
                   "recommended admission limit, a higher memory fraction)")  # fmt: skip
    p.add_argument("--scale", default="auto", metavar="K|auto",
                   help="replay a scale model: pool, arrivals and admission caps divided by K, step times as at full "
                   "size (about K times faster); the calibration also runs at full size and the model's error is "
                   "stated. auto (default): full size for a window of a few thousand requests, else a model that "
                   "keeps ~120 requests running through the window (at its median running count); 1: always full size")  # fmt: skip
    p.add_argument("--scale-check", type=float, default=5.0, metavar="MINUTES",
                   help="with --scale: the model's error is measured against full size over the window's first "
                   "MINUTES (default 5; 0: the whole window, which costs a full-size replay of all of it)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=0, help="replay worker processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--html", metavar="FILE", help="also write the HTML report with a what-if section per instance")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        config = thresholds(args)
        for text in args.remedy:
            parse(text)  # a misspelt remedy fails before any sampling
        if args.follow:
            raise ValueError("--follow does not apply to whatif (it replays a window that has ended)")
        if args.html:
            check_writable(args.html, "--html")
        if args.jobs < 0:
            raise ValueError("--jobs must be >= 0")
        scale = _scale(args.scale)
        if not args.scale_check >= 0:
            raise ValueError("--scale-check must be >= 0")
        collected = collect(args)
    except (cfg.ConfigError, ValueError, OSError, RecordingError, PrometheusError, ExpositionError) as exc:
        print(f"kvdiag whatif: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if collected is None:
        return EXIT_ERROR
    for target, why in collected.problems.items():
        print(f"kvdiag whatif: {target}: {why}", file=sys.stderr)
    by_instance = windows(collected.samples)
    results: list[WhatIf] = []
    jobs: list[Job] = []
    for instance, w in by_instance.items():
        try:
            f = fit(w)
            d = diagnose(w, config)
            levers = resolve(args.remedy, f.deployment, recommended_limit(d.figures))
            scenario = f.scenario()
            applied = [(lv, lv.apply(scenario)) for lv in levers]
        except (FitError, LeverError) as exc:
            print(f"kvdiag whatif: {exc}", file=sys.stderr)
            continue
        results.append(WhatIf(f, measure([w], config), Run(instance, None, None, "not run", 0.0)))
        k = _scale_for(scale, f, w, args.no_progress)
        jobs.append(Job(instance, None, scenario, f.engine, f.interval, config, k))
        jobs += [Job(instance, lv, sc, f.engine, f.interval, config, k) for lv, sc in applied]
        if k != 1:  # the scale model's own error, on this window: the calibration at full size too
            first = args.scale_check * 60 if 0 < args.scale_check * 60 < scenario.duration else None
            if first is not None:  # over the window's first minutes only: the model over them too
                jobs.append(Job(instance, None, scenario, f.engine, f.interval, config, k, first))
            jobs.append(Job(instance, None, scenario, f.engine, f.interval, config, first_s=first))
    if not results:
        print("kvdiag whatif: no instance could be fitted" + ("" if by_instance else " (no engine samples were read)"), file=sys.stderr)
        return EXIT_ERROR
    runs = _replay(jobs, args)
    for w in results:
        mine = [r for r in runs if r.key == w.fit.instance]
        if mine[0].scale != 1:
            w.full_calibration, mine = mine[-1], mine[:-1]
            if w.full_calibration.first_s is not None:
                w.scaled_check, mine = mine[-1], mine[:-1]
        w.calibration, w.remedies = mine[0], mine[1:]
    if args.json:
        print(dumps({"instances": [w.as_json() for w in results]}, indent=2))
    else:
        render(Console(width=None if sys.stdout.isatty() else 200), results)
    if args.html:
        from kvdiag.checks import diagnose_all
        from kvdiag.report.html import write_report

        shown = {w.fit.instance: by_instance[w.fit.instance] for w in results}
        write_report(args.html, diagnose_all(shown.values(), config), shown, config,
                     extra={w.fit.instance: html_section(w) for w in results})  # fmt: skip
        if not args.json:
            print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _scale(text: str) -> float | str:
    """``--scale``: "auto" or a factor of at least 1 (ValueError otherwise)."""
    if text == "auto":
        return text
    try:
        k = float(text)
    except ValueError:
        raise ValueError(f"--scale must be a number >= 1 or 'auto', not {text!r}") from None
    if not k >= 1:
        raise ValueError("--scale must be >= 1")
    return k


def _scale_for(scale: float | str, f: Fit, w: Window, quiet: bool) -> float:
    """The scale of an instance's replays: ``--scale``'s, or the one ``auto_scale`` picks from the
    fitted arrivals and the window's median running count (said on stderr when it is a model)."""
    if scale != "auto":
        return float(scale)
    median = median_running(w)
    k = auto_scale(f.arrivals.total, median)
    if k != 1 and not quiet:
        print(f"kvdiag whatif: {f.instance}: replaying a 1/{k:g} scale model (--scale auto: {f.arrivals.total:,.0f} "
              f"requests in the window, {median:,.0f} running at its median; --scale 1 for full size)", file=sys.stderr)  # fmt: skip
    return k


def _replay(jobs: list[Job], args: argparse.Namespace) -> list[Run]:
    """The replays, with a progress bar on a terminal, plain lines when piped."""
    workers = args.jobs or len(os.sched_getaffinity(0))
    tune_gc()
    err = Console(stderr=True)
    if args.no_progress:
        return replay_all(jobs, workers)
    if not err.is_terminal:
        return replay_all(jobs, workers, _plain(len(jobs)))
    with Progress(TextColumn("whatif"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:  # fmt: skip
        task = bar.add_task("replaying", total=len(jobs))
        return replay_all(jobs, workers, lambda r: bar.update(task, advance=1, description=f"{r.key}: {r.label} {_done(r)}"))


def _done(r: Run) -> str:
    return f"failed: {r.error}" if r.error else f"{r.wall_s:.0f}s"


def _plain(total: int) -> Callable[[Run], None]:
    count = 0

    def tick(r: Run) -> None:
        nonlocal count
        count += 1
        print(f"whatif [{count}/{total}] {r.key}: {r.label} {_done(r)}", file=sys.stderr, flush=True)

    return tick
