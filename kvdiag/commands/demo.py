"""``kvdiag demo``: the main job on an embedded default, no GPU and no engine needed.

Two simulated engines (SGLang and vLLM dialects) play the seed's story on loopback: shared-
prefix load ramps until the KV pool is pinned while L2 stays mostly empty. kvdiag scrapes them
over HTTP exactly as it scrapes real engines, keeps a window per instance in simulated time,
and shows the pool and the verdict as they move from healthy to the L1 bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from rich.console import Console
from rich.live import Live

from rich.console import Group
from rich.table import Table

from kvdiag.checks import diagnose_all
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import Diagnosis, PoolSample
from kvdiag.report.diagnosis import render as render_diagnoses
from kvdiag.window import windows
from kvdiag.refpool.emit import content_type, render
from kvdiag.refpool.scripted import SaturationStory
from kvdiag.refpool.serve import MetricsServer
from kvdiag.report.terminal import fmt, inspect_table
from kvdiag.sources.scrape import ScrapeError, scrape


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="watch kvdiag read simulated SGLang and vLLM engines saturating their KV pool")
    p.add_argument("--duration", type=float, default=30.0, help="wall seconds to run (default 30)")
    p.add_argument("--speed", type=float, default=12.0, help="simulated seconds per wall second (default 12)")
    p.add_argument("--interval", type=float, default=1.0, help="wall seconds between scrapes (default 1)")
    p.add_argument("--no-live", action="store_true", help="plain timestamped lines instead of a live view")
    return p


def _engine(engine: str, story: SaturationStory, clock: "SimClock") -> MetricsServer:
    def body(wants_om: bool) -> tuple[str, str]:
        return render(engine, [story.state(clock.now())], openmetrics=wants_om, escape=wants_om), content_type(wants_om)

    return MetricsServer(body).start()


class SimClock:
    """Simulated time: wall time since start times the speed."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.speed


EPOCH = 1_795_952_340.0  # simulated wall clock of the story's start


def _line(s: PoolSample, d: Diagnosis | None) -> str:
    verdict = d.verdict.name if d else "-"
    return (
        f"t={s.ts - EPOCH:6.0f}s {s.engine:6s} usage={fmt(s.usage_ratio, '.2f')} running={fmt(s.running)} "
        f"waiting={fmt(s.waiting)} evictions={fmt(s.evictions_total)} verdict={verdict}"
    )


def _verdicts(diagnoses: list[Diagnosis]) -> Table:
    table = Table(title="verdict per instance (5-minute window of simulated time)")
    for col in ("instance", "verdict", "why"):
        table.add_column(col)
    for d in diagnoses:
        table.add_row(d.instance, d.verdict.name, d.verdict.reason)
    return table


def run(args: argparse.Namespace) -> int:
    console = Console()
    story = SaturationStory()
    clock = SimClock(args.speed)
    servers = [_engine(e, story, clock) for e in ("sglang", "vllm")]
    console.print(f"simulated engines: sglang {servers[0].url}/metrics, vllm {servers[1].url}/metrics")
    config = Config()
    samples: list[PoolSample] = []
    diagnoses: list[Diagnosis] = []
    try:
        with contextlib.nullcontext() if args.no_live else Live(console=console, auto_refresh=False) as live:
            end = time.monotonic() + args.duration
            while time.monotonic() < end:
                fresh = []
                for server in servers:
                    try:
                        got = scrape(server.url)
                    except ScrapeError as exc:
                        console.print(f"[red]scrape failed[/red] {exc}")
                        continue
                    got.ts = EPOCH + clock.now()  # windows run on simulated time
                    fresh += normalize_scrape(got)
                samples = [s for s in samples + fresh if s.ts >= EPOCH + clock.now() - config.window]
                diagnoses = diagnose_all(windows(samples).values(), config)
                by_instance = {d.instance: d for d in diagnoses}
                if live is not None:
                    live.update(Group(inspect_table(fresh), _verdicts(diagnoses)), refresh=True)
                else:
                    for s in fresh:
                        console.print(_line(s, by_instance.get(s.instance)), highlight=False)
                time.sleep(args.interval)
    finally:
        for server in servers:
            server.stop()
    render_diagnoses(console, diagnoses)
    return 0

