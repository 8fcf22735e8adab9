"""``kvdiag demo``: the main job on an embedded default, no GPU and no engine needed.

Two reference engines (``kvdiag/refpool/``: SGLang's and vLLM's schedulers and KV pools, each
serving its own release's exposition) run the ``l1-saturation`` scenario on loopback:
shared-prefix load ramps until the KV pool is the limit while L2 stays mostly empty. The real
exporter (``kvdiag serve``'s scrape loop and HTTP app) scrapes them, keeps a window per instance
and runs the checklist; the terminal shows the pool and the verdict as they move from healthy
to L1: vLLM preempts and recomputes (``l1_kv_bottleneck``), SGLang's admission blocks on its
output reserve without retracting (``l1_kv_pressure``). Then the full diagnosis with remedies.

The engines run ``--speed`` times faster than the wall clock, so the exporter's window is the
checklist's default window (5 minutes of the story) divided by the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvdiag.config import Config
from kvdiag.model import Diagnosis, PoolSample
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.scenarios import ENGINES, ScenarioRun, get
from kvdiag.refpool.serve import MetricsServer
from kvdiag.refpool.sim import tune_gc
from kvdiag.report.diagnosis import render as render_diagnoses
from kvdiag.report.terminal import fmt, inspect_table
from kvdiag.server.settings import ScrapeSettings, Settings
from kvdiag.server.state import InstanceState
from kvdiag.server.targets import make_target


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="watch kvdiag read simulated SGLang and vLLM engines saturating their KV pool")
    p.add_argument("--duration", type=float, default=40.0, help="wall seconds to run (default 40)")
    p.add_argument("--speed", type=float, default=12.0, help="simulated seconds per wall second (default 12)")
    p.add_argument("--interval", type=float, default=1.0, help="wall seconds between scrapes (default 1)")
    p.add_argument("--no-live", action="store_true", help="plain timestamped lines instead of a live view")
    return p


SCENARIO = "l1-saturation"


def _engine(sim: ScenarioRun) -> MetricsServer:
    def body(wants_om: bool) -> tuple[str, str]:
        return sim.exposition(openmetrics=wants_om), content_type(wants_om)

    return MetricsServer(body).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Exporter:
    """``kvdiag serve`` in-process: the scrape loop and its HTTP app on a loopback port."""

    def __init__(self, targets: list[str], interval: float, config: Config) -> None:
        import uvicorn

        from kvdiag.server.app import create_app
        from kvdiag.server.loop import ScrapeLoop

        settings = Settings(
            port=_free_port(),
            targets=tuple(make_target(url, None, "demo") for url in targets),
            scrape=ScrapeSettings(interval=interval, evaluate_every=interval),
            checks=config,
        )
        self.url = f"http://{settings.host}:{settings.port}"
        self.loop = ScrapeLoop(settings).start()
        config = uvicorn.Config(create_app(self.loop), host=settings.host, port=settings.port, log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()

    def instances(self) -> list[InstanceState]:
        """The exporter's instances that have reported."""
        return [i for t in self.loop.snapshot() for i in list(t.instances.values()) if i.latest is not None]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.loop.stop()


@dataclass
class Row:
    """What the demo shows of one instance: the exporter's latest sample and answers."""

    sample: PoolSample
    diagnosis: Diagnosis | None
    evictions_per_min: float | None  # in story time
    ttft_p99: float | None
    hit_ratio: float | None

    @classmethod
    def of(cls, inst: InstanceState, config: Config, speed: float) -> "Row":
        window = inst.window(config)
        rate = window.rate("evictions_total") if window is not None else None
        d = inst.diagnosis
        hit = d.checks["prefix_hit_high"].evidence.values.get("hit_ratio") if d else None
        return cls(inst.latest, d, None if rate is None else rate * 60 / speed, inst.ttft_p99, hit if isinstance(hit, float) else None)

    @property
    def verdict(self) -> str:
        return self.diagnosis.verdict.name if self.diagnosis else "-"


def _line(sim_t: float, r: Row) -> str:
    s = r.sample
    return (
        f"t={sim_t:6.0f}s {s.engine:6s} usage={fmt(s.usage_ratio, '.2f')} running={fmt(s.running)} "
        f"waiting={fmt(s.waiting)} evictions={fmt(s.evictions_total)} ({fmt(r.evictions_per_min, '.1f')}/min) "
        f"p99_ttft={fmt(r.ttft_p99, '.1f')}s verdict={r.verdict}"
    )


def _verdicts(rows: list[Row], speed: float) -> Table:
    table = Table(title=f"verdict per instance (window: 5 minutes of the story = {300 / speed:g} s of wall time)")
    for col in ("instance", "evictions/min", "P99 TTFT", "hit ratio", "verdict", "why"):
        table.add_column(col)
    for r in rows:
        d = r.diagnosis
        table.add_row(
            r.sample.instance, fmt(r.evictions_per_min, ".1f"), f"{fmt(r.ttft_p99, '.1f')} s", fmt(r.hit_ratio, ".2f"),
            r.verdict, d.verdict.reason if d else "waiting for a window",
        )
    return table


def run(args: argparse.Namespace) -> int:
    console = Console()
    tune_gc()
    sims = [ScenarioRun(get(SCENARIO), engine) for engine in ENGINES]
    engines = [_engine(sim) for sim in sims]
    config = Config(window=Config().window / args.speed)
    exporter = Exporter([f"{e.url}/metrics" for e in engines], args.interval, config)
    console.print(", ".join(f"{sim.engine} {server.url}/metrics" for sim, server in zip(sims, engines)), highlight=False)
    console.print(
        f"exporter: {exporter.url}/ (page), {exporter.url}/api/v1/verdicts (API), {exporter.url}/metrics, {exporter.url}/docs"
    )
    rows: list[Row] = []
    stop = threading.Event()
    # the story starts once the exporter is up, so its healthy opening is seen
    drivers = [
        threading.Thread(target=sim.follow_wall_clock, args=(args.speed, args.duration * args.speed, stop), daemon=True)
        for sim in sims
    ]
    for driver in drivers:
        driver.start()
    try:
        with contextlib.nullcontext() if args.no_live else Live(console=console, auto_refresh=False) as live:
            end = time.monotonic() + args.duration
            while time.monotonic() < end:
                time.sleep(args.interval)
                rows = [Row.of(i, config, args.speed) for i in exporter.instances()]
                if live is not None:
                    live.update(Group(inspect_table([r.sample for r in rows]), _verdicts(rows, args.speed)), refresh=True)
                else:
                    now = min(sim.now for sim in sims)
                    for r in rows:
                        console.print(_line(now, r), highlight=False)
    finally:
        stop.set()
        for driver in drivers:
            driver.join(timeout=5)
        exporter.stop()
        for server in engines:
            server.stop()
    render_diagnoses(console, [r.diagnosis for r in rows if r.diagnosis is not None])
    return 0
