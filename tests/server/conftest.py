"""Helpers for the exporter's tests: simulated engines on loopback, and a running loop."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvdiag.config import Config
from kvdiag.refpool.emit import content_type, render
from kvdiag.refpool.scripted import SaturationStory
from kvdiag.refpool.serve import MetricsServer
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.settings import ScrapeSettings, Settings, load
from kvdiag.server.targets import Target
from tests.conftest import hang_guard


#: Every wait here ends when what it waits for happens; this bounds only a hang.
HANG_GUARD_S = hang_guard(12)
#: The scrape deadline of the tests' loops unless a test sets its own: a hang guard too, so a good
#: target's scrape never races a busy machine (tests of deadlines give theirs, with targets that
#: never answer or answer after it).
SCRAPE_DEADLINE_S = 10.0


def wait_for(predicate: Callable[[], bool], timeout: float = HANG_GUARD_S, step: float = 0.05) -> bool:
    """Poll until ``predicate`` holds; False on timeout (the test then asserts on it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def story_engine(engine: str, speed: float = 30.0, start: float = 60.0) -> MetricsServer:
    """A simulated engine playing the saturation story from ``start`` s on, ``speed``x fast:
    pool pinned, queue and evictions growing (the l1_kv_bottleneck story)."""
    story = SaturationStory()
    t0 = time.monotonic()

    def body(wants_om: bool) -> tuple[str, str]:
        t = start + (time.monotonic() - t0) * speed
        return render(engine, [story.state(t)], openmetrics=wants_om, escape=wants_om), content_type(wants_om)

    return MetricsServer(body).start()


def settings_for(urls: list[str], interval: float = 0.3, timeout: float = SCRAPE_DEADLINE_S, window: float = 30.0, **kw: object) -> Settings:
    return Settings(
        targets=tuple(Target(u) for u in urls),
        scrape=ScrapeSettings(interval=interval, timeout=timeout, concurrency=8, evaluate_every=0.0),
        checks=Config(window=window),
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def engines() -> Iterator[dict[str, MetricsServer]]:
    servers = {e: story_engine(e) for e in ("sglang", "vllm")}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture
def start_loop() -> Iterator[Callable[[Settings], ScrapeLoop]]:
    """Start scrape loops for a test; all are stopped afterwards."""
    loops: list[ScrapeLoop] = []

    def start(settings: Settings) -> ScrapeLoop:
        loop = ScrapeLoop(settings).start()
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.stop()


Handle = Callable[[BaseHTTPRequestHandler], None]


@pytest.fixture
def raw_server() -> Iterator[Callable[[Handle], str]]:
    """Loopback servers whose GET handler is written by the test (hangs, trickles, floods); a
    POST (a Prometheus API call) is answered by the same handler once its body is read."""
    started: list[ThreadingHTTPServer] = []

    def start(handle: Handle) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                try:
                    handle(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the scraper hung up (cap or timeout): expected

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.do_GET()

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def load_config(folder: Path, text: str) -> Settings:
    """The exporter's settings from ``text`` written as ``folder/kvdiag.yaml``."""
    path = folder / "kvdiag.yaml"
    path.write_text(text)
    return load(path)


def reply(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "text/plain; version=0.0.4") -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)
