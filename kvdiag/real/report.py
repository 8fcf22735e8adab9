"""``kvdiag validate --real``: the real stories, scored and shown as ``kvdiag validate`` shows
the simulated ones (its table and JSON, kvdiag/commands/validate.py), plus what only a real run
has: the first step the engine refused a waiting request for KV, against the first L1 verdict,
and what the clients measured. ``--json`` adds each story's per-second truth timeline.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from rich.console import Console

from kvdiag.config import Config
from kvdiag.real import envs
from kvdiag.real.calibrate import calibrate
from kvdiag.real.stories import StoryRun, run_catalogue, select
from kvdiag.refpool.validate import Report
from kvdiag.report.json import dumps

EXIT_ERROR = 3


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}s"


def line(run: StoryRun) -> str:
    """One story on one plain line: the scores and what the engine and the clients saw."""
    r = run.result
    clients = run.as_json()["clients"]
    assert isinstance(clients, dict)
    return (
        f"{run.story.name} on {run.engine}: final truth {r.expected}, verdict {r.verdict}; instants right {r.right}/{len(r.scored)}, "
        f"misleading {r.misleading}, false alarms {r.false_alarms}; first KV refusal {_s(run.first_kv_refusal)}, "
        f"first L1 verdict {_s(r.detected)}; client P99 TTFT {clients['p99_ttft_s']} s over {clients['first_token']} requests"
        + _load(run)
    )


def _load(run: StoryRun) -> str:
    """An open loop's arrival rates as the story set them, and (an ``Overload``) when it found
    the engine limited: the load that machine needed."""
    if not run.rates:
        return ""
    rates = ", ".join(f"{r:.2f}/s from {t:.0f}s" for t, r in run.rates)
    found = "" if run.limited_at is None else f", admission limited from {run.limited_at:.0f}s"
    return f"; arrivals {rates}{found}; {run.seconds:.0f}s in all"


def validate_real(args: argparse.Namespace, config: Config, render: Callable[[Console, Report], None]) -> int:
    stories, engines = select(args.scenario, args.engine)
    for engine in engines:
        try:
            envs.python(engine)
        except envs.EnvMissing as exc:
            print(f"kvdiag validate --real: {exc}", file=sys.stderr)
            return EXIT_ERROR

    def progress(run: StoryRun) -> None:
        print(f"validate --real: {line(run)}", file=sys.stderr, flush=True)

    report, runs = run_catalogue(stories, engines, config, progress=progress)
    cals = [calibrate(run.story, run.engine, run.steps, run.records, run.seconds) for run in runs] if args.calibrate else []
    if args.json:
        out = report.as_json()
        out["scenarios"] = [run.as_json() | ({"calibration": cals[i].as_json()} if cals else {}) for i, run in enumerate(runs)]
        print(dumps(out, indent=2))
    else:
        console = Console(width=None if sys.stdout.isatty() else 200)
        render(console, report)
        for run in runs:
            console.print(line(run), highlight=False, soft_wrap=True)
        for cal in cals:
            console.print(cal.table(), highlight=False, soft_wrap=True)
    return 0 if report.ok and all(c.ok for c in cals) else 1
