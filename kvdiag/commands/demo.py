"""``kvdiag demo``: the main job on an embedded default, no GPU and no engine needed.

Two simulated engines (SGLang and vLLM dialects) play the seed's story on loopback: shared-
prefix load ramps until the KV pool is pinned while L2 stays mostly empty. kvdiag scrapes them
over HTTP exactly as it scrapes real engines, and shows what it reads as the story unfolds.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from rich.console import Console
from rich.live import Live

from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample
from kvdiag.refpool.emit import content_type, render
from kvdiag.refpool.scripted import SaturationStory
from kvdiag.refpool.serve import MetricsServer
from kvdiag.report.terminal import fmt, inspect_table
from kvdiag.sources.scrape import ScrapeError, scrape


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="watch kvdiag read simulated SGLang and vLLM engines saturating their KV pool")
    p.add_argument("--duration", type=float, default=20.0, help="wall seconds to run (default 20)")
    p.add_argument("--speed", type=float, default=8.0, help="simulated seconds per wall second (default 8)")
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


def _line(sim_t: float, s: PoolSample) -> str:
    return (
        f"t={sim_t:6.0f}s {s.engine:6s} usage={fmt(s.usage_ratio, '.2f')} running={fmt(s.running)} "
        f"waiting={fmt(s.waiting)} evictions={fmt(s.evictions_total)}"
    )


def run(args: argparse.Namespace) -> int:
    console = Console()
    story = SaturationStory()
    clock = SimClock(args.speed)
    servers = [_engine(e, story, clock) for e in ("sglang", "vllm")]
    console.print(f"simulated engines: sglang {servers[0].url}/metrics, vllm {servers[1].url}/metrics")
    latest: dict[str, PoolSample] = {}
    try:
        with contextlib.nullcontext() if args.no_live else Live(console=console, auto_refresh=False) as live:
            end = time.monotonic() + args.duration
            while time.monotonic() < end:
                for server in servers:
                    try:
                        for s in normalize_scrape(scrape(server.url)):
                            latest[s.instance] = s
                            if args.no_live:
                                console.print(_line(clock.now(), s), highlight=False)
                    except ScrapeError as exc:
                        console.print(f"[red]scrape failed[/red] {exc}")
                if live is not None:
                    live.update(inspect_table(list(latest.values())), refresh=True)
                time.sleep(args.interval)
    finally:
        for server in servers:
            server.stop()
    if args.no_live:
        console.print(inspect_table(list(latest.values())))
    return 0

