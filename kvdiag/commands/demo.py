"""``kvdiag demo``: the main job on an embedded default, no GPU and no engine needed.

Two reference engines (``kvdiag/refpool/``: SGLang's and vLLM's schedulers and KV pools, each
serving its own release's exposition) run the ``l1-saturation`` scenario on loopback:
shared-prefix load ramps until the KV pool is the limit while L2 stays mostly empty. The real
exporter (``kvdiag serve``'s scrape loop and HTTP app) scrapes them, keeps a window per instance
and runs the checklist; the terminal shows the pool and the verdict as they move from healthy
to L1: vLLM preempts and recomputes, SGLang's admission blocks on its output reserve and then
retracts as the long answers outgrow it (both ``l1_kv_bottleneck``). Then the full diagnosis with
remedies.

The engines run ``--speed`` times faster than the wall clock. Everything the demo shows is in
the story's own (simulated) time: the demo reads the exporter's window of each instance on the
simulated clock of the engine it scraped (each scrape's wall time mapped to the simulated time
the engine served it at) and runs the checklist over the default window, 5 minutes of the
story. Rates are per simulated minute and the evidence says simulated seconds; the exporter's
own page and API keep wall time (their window is the same 5 minutes divided by the speed).
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import fields, replace

from rich.console import Console

from kvdiag.config import Config
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.scenarios import ENGINES, ScenarioRun, get
from kvdiag.refpool.serve import MetricsServer
from kvdiag.refpool.sim import tune_gc
from kvdiag.report.diagnosis import render as render_diagnoses
from kvdiag.report.live import STORY, Exporter, StoryClock, watch


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo")
    p.add_argument("--duration", type=float,
                   help="wall seconds of story at --speed (default 40; with --real 240); a busy machine takes longer to tell it")  # fmt: skip
    p.add_argument("--speed", type=float, default=12.0, help="simulated seconds per wall second (default 12)")
    p.add_argument("--interval", type=float, default=1.0, help="wall seconds between scrapes (default 1; with --real 5)")
    p.add_argument("--no-live", action="store_true", help="plain timestamped lines instead of a live view")
    p.add_argument("--real", action="store_true",
                   help="the same story on real vLLM and SGLang servers on this machine's CPU, a tiny model with random "
                   "weights (installs both engines first: about 7 GB on first use; docs/real-engines.md)")  # fmt: skip
    return p


SCENARIO = "l1-saturation"


def wall_config(story: Config, speed: float) -> Config:
    """The exporter's thresholds for the same story read on the wall clock: every span the
    checks look back over (the window and its short windows) divided by the speed, so that its
    page and API give the verdicts the terminal shows. TTFT is the engine's own latency, in
    story seconds already: the SLO stays."""
    spans = {
        f.name: getattr(story, f.name) / speed
        for f in fields(Config)
        if f.metadata.get("kind") == "duration" and f.name.endswith("window")
    }
    return replace(story, **spans)


def _engine(sim: ScenarioRun, clock: StoryClock) -> MetricsServer:
    def body(wants_om: bool) -> tuple[str, str]:
        story = sim.now  # before rendering: the exposition shows at least this much of the story
        text = sim.exposition(openmetrics=wants_om)
        clock.mark(time.time(), story)
        return text, content_type(wants_om)

    return MetricsServer(body).start()


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.real:
        from kvdiag.real.demo import run_real

        return run_real(args, console)
    args.duration = 40.0 if args.duration is None else args.duration
    tune_gc()
    sims = [ScenarioRun(get(SCENARIO), engine) for engine in ENGINES]
    clocks = {}
    engines = []
    for sim in sims:
        clock = StoryClock(time.time())
        server = _engine(sim, clock)
        clocks[f"{server.url}/metrics"] = clock
        engines.append(server)
    exporter = Exporter(list(clocks), args.interval, wall_config(STORY, args.speed))
    # soft_wrap: a URL is never broken across lines, at any width
    console.print(", ".join(f"{sim.engine} {server.url}/metrics" for sim, server in zip(sims, engines)), highlight=False, soft_wrap=True)
    console.print(
        f"exporter: {exporter.url}/ (page), {exporter.url}/api/v1/verdicts (API), {exporter.url}/metrics, {exporter.url}/docs",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    stop = threading.Event()
    # the story starts once the exporter is up, so its healthy opening is seen; each engine runs
    # at most one scrape interval of story ahead of what the exporter has read from it
    step = args.interval * args.speed
    drivers = [
        threading.Thread(target=sim.follow_wall_clock, args=(args.speed, args.duration * args.speed, stop),
                         kwargs={"ahead": lambda c=clock: c.shown() + step}, daemon=True)  # fmt: skip
        for sim, clock in zip(sims, clocks.values())
    ]
    for driver in drivers:
        driver.start()
    header = (f"story t={{t:.0f}}s (simulated, {args.speed:g}x the wall clock); checks over the last "
              f"{STORY.window:g}s of the story; rates per simulated minute")  # fmt: skip
    try:
        story_end = args.duration * args.speed
        rows = watch(console, exporter, clocks, lambda: all(c.reached(story_end) for c in clocks.values()), args.interval,
                     not args.no_live, header)  # fmt: skip
    finally:
        stop.set()
        for driver in drivers:
            driver.join(timeout=5)
        exporter.stop()
        for server in engines:
            server.stop()
    render_diagnoses(console, [r.diagnosis for r in rows])
    return 0
