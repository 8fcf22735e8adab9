"""The demo's live view of an exporter, shared by ``kvdiag demo`` and ``kvdiag demo --real``.

An in-process exporter (``kvdiag serve``'s scrape loop and app on a loopback port), the clock that
maps its wall-time samples to each engine's story time, and the terminal view of its instances
(live, or a line per instance per tick). It sits below the commands, so that the simulated demo
and the real-engine one (``kvdiag.real.demo``) both read it without one command importing another.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.model import Diagnosis, PoolSample
from kvdiag.report.terminal import fmt, pool_bar
from kvdiag.server.settings import ScrapeSettings, Settings
from kvdiag.server.state import InstanceState
from kvdiag.server.targets import make_target

#: The checklist as the demo runs it: the default thresholds and window, in story time.
STORY = Config()


class StoryClock:
    """Wall time -> one engine's simulated time, from the (wall, simulated) pair taken each
    time the engine served a scrape: a scrape stamped at wall time t saw the story at
    ``story(t)``. Between pairs it interpolates; before the first and after the last it holds."""

    def __init__(self, origin: float) -> None:
        self.origin = origin  # the wall time the story started: simulated t=0 reads as this clock time
        self._wall: list[float] = []
        self._story: list[float] = []
        self._lock = threading.Lock()

    def mark(self, wall: float, story_seconds: float) -> None:
        with self._lock:
            if not self._wall or wall > self._wall[-1]:
                self._wall.append(wall)
                self._story.append(self.origin + story_seconds)

    def story(self, wall: np.ndarray) -> np.ndarray:
        with self._lock:
            if not self._wall:
                return np.asarray(wall, dtype=float)
            return np.interp(wall, self._wall, self._story)

    def shown(self) -> float:
        """How far into the story (simulated seconds) the engine's newest scrape was; 0 before one."""
        with self._lock:
            return self._story[-1] - self.origin if self._story else 0.0

    def reached(self, story_seconds: float) -> bool:
        """Whether the engine has served a scrape ``story_seconds`` or more into the story."""
        with self._lock:
            return bool(self._story) and self._story[-1] >= self.origin + story_seconds



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

    def instances(self) -> list[tuple[str, InstanceState]]:
        """(target URL, instance) for each of the exporter's instances that has reported."""
        return [(t.url, i) for t in self.loop.snapshot() for i in list(t.instances.values()) if i.latest is not None]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.loop.stop()



@dataclass
class Row:
    """What the demo shows of one instance, read from the exporter's window in story time:
    the newest sample, the checklist's diagnosis, and the figures it gives."""

    sample: PoolSample
    story_t: float  # simulated seconds since the story started
    diagnosis: Diagnosis
    evictions_per_min: float | None  # per simulated minute, over the window
    ttft_p99: float | None
    hit_ratio: float | None
    l2_occupancy: float | None

    @classmethod
    def of(cls, inst: InstanceState, clock: StoryClock) -> "Row | None":
        window = inst.ring.window(inst.key, clock=clock.story)
        if window is None:
            return None
        window = window.since(window.end - STORY.window)
        d = diagnose(window, STORY)
        rate = window.rate("evictions_total")
        return cls(
            inst.latest, window.end - clock.origin, d, None if rate is None else rate * 60,
            _value(d, "ttft_p99_high", "estimate_seconds"), _ratio(_value(d, "prefix_hit_high", "hit_ratio")),
            _ratio(_value(d, "l2_underused", "l2_occupancy")),
        )  # fmt: skip

    @property
    def verdict(self) -> str:
        return self.diagnosis.verdict.name


def _value(d: Diagnosis, check: str, key: str) -> float | None:
    """A figure of one check's evidence, or None where the check did not give it."""
    c = d.checks.get(check)
    v = c.evidence.values.get(key) if c is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _ratio(v: float | None) -> float | None:
    """A ratio only where it can be one: an impossible figure is shown as absent, not printed."""
    return v if v is not None and 0.0 <= v <= 1.0 else None


def _line(r: Row) -> str:
    """One instance at one tick, on one line (``--no-live``: logs, CI, a pipe)."""
    s = r.sample
    return (
        f"t={r.story_t:5.0f}s {s.engine:6s} usage={fmt(s.usage_ratio, '.2f')} running={fmt(s.running)} "
        f"waiting={fmt(s.waiting)} evictions={fmt(s.evictions_total)} ({fmt(r.evictions_per_min, '.1f')}/min) "
        f"hit={fmt(r.hit_ratio, '.2f')} L2={fmt(r.l2_occupancy, '.2f')} p99_ttft={fmt(r.ttft_p99, '.1f')}s "
        f"verdict={r.verdict}"
    )


def _view(rows: list[Row], header: str) -> Group:
    """The live view: a block per instance that wraps at words, so that at 80 columns every
    name (instance, model, verdict) is still whole. ``header`` is formatted with the story's
    time ``t`` in seconds."""
    story = max((r.story_t for r in rows), default=0.0)
    parts: list[Text] = [Text(header.format(t=story), style="bold")]
    for r in rows:
        s, d = r.sample, r.diagnosis
        parts.append(Text(""))
        head = Text(f"{s.engine} ", style="bold")
        head.append(f"{s.instance} ")
        head.append(s.model or "", style="dim")
        parts.append(head)
        bar = pool_bar(s)
        bar.append(f"  usage {fmt(s.usage_ratio, '.2f')} of {fmt(s.capacity_tokens)} tokens")
        parts.append(bar)
        parts.append(Text(f"running {fmt(s.running)}  waiting {fmt(s.waiting)}  evictions {fmt(r.evictions_per_min, '.1f')}/min"))
        parts.append(Text(f"hit ratio {fmt(r.hit_ratio, '.2f')}  L2 {fmt(r.l2_occupancy, '.2f')}  P99 TTFT {fmt(r.ttft_p99, '.1f')} s"))
        verdict = Text("verdict ")
        verdict.append(r.verdict, style="bold")
        verdict.append(f"  {d.verdict.reason}", style="dim")
        parts.append(verdict)
    return Group(*parts)


def deadline(seconds: float) -> Callable[[], bool]:
    """``watch``'s end after ``seconds`` of wall time from now."""
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def watch(console: Console, exporter: Exporter, clocks: dict[str, StoryClock], done: Callable[[], bool], interval: float,
          live_view: bool, header: str) -> list[Row]:  # fmt: skip
    """The exporter's instances every ``interval`` until ``done()`` (checked before each tick,
    so the tick after it turns true is the last), live (or one line per instance per tick);
    returns the last rows. A simulated story ends when every engine has served its end, however
    long a busy machine takes to get there; a real one after its wall time."""
    rows: list[Row] = []
    with Live(console=console, auto_refresh=False) if live_view else contextlib.nullcontext() as live:
        last = False
        while not last:
            last = done()
            time.sleep(interval)
            rows = [r for t, i in exporter.instances() if (r := Row.of(i, clocks[t])) is not None]
            if live is not None:
                live.update(_view(rows, header), refresh=True)
            else:
                for r in rows:
                    console.print(_line(r), highlight=False, soft_wrap=True)
    if live_view and not console.is_terminal:
        # rich ends a live view with a newline on a terminal only: in a pipe the last frame's
        # final line would run straight into whatever is printed next (the report's first panel)
        console.line()
    return rows
