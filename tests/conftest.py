"""Shared test helpers: the engine fixtures in ../shared/fixtures, and loopback HTTP servers."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.scenario_recordings import Recording, newest, record_all

SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
SGLANG_FIXTURE = "sglang-0.5.23-midload.prom"
VLLM_FIXTURE = "vllm-0.33.0-midload.prom"


#: The six alerts and severities the monitoring issue names (the spec, written once for all tests).
EXPECTED_ALERTS = {
    "KvdiagL1KVPoolBottleneck": "critical",
    "KvdiagL1KVPoolPressure": "warning",
    "KvdiagKVPoolNearCapacity": "info",
    "KvdiagQueueWithoutKVPressure": "warning",
    "KvdiagCacheHealthyButTTFTBad": "warning",
    "KvdiagEngineMetricsAbsent": "warning",
}


def shared_fixture(name: str) -> Path:
    """A real engine sample from ../shared/fixtures, read in place (never copied here).

    Under CI (CI=true) a missing folder is a failure; elsewhere the test skips, saying why.
    """
    path = SHARED_FIXTURES / name
    if not path.exists():
        msg = f"engine fixture {path} is missing (the shared/ folder beside the checkout)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def scenario_recordings() -> list[Recording]:
    """The scenario catalogue on both engines in every dialect, simulated once per session."""
    return record_all()


@pytest.fixture(scope="session")
def newest_recordings(scenario_recordings: list[Recording]) -> list[Recording]:
    return newest(scenario_recordings)


@pytest.fixture
def sglang_fixture() -> str:
    return shared_fixture(SGLANG_FIXTURE).read_text()


@pytest.fixture
def vllm_fixture() -> str:
    return shared_fixture(VLLM_FIXTURE).read_text()


class Responder:
    """What a loopback server answers: a callable from (path, headers) to (status, headers, body)."""

    def __init__(self, fn: Callable[[str, dict[str, str]], tuple[int, dict[str, str], bytes]]) -> None:
        self.fn = fn
        self.requests: list[tuple[str, dict[str, str]]] = []


def serve(responder: Responder) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            headers = {k: v for k, v in self.headers.items()}
            responder.requests.append((self.path, headers))
            status, out_headers, body = responder.fn(self.path, headers)
            self.send_response(status)
            for k, v in out_headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def http_server() -> Iterator[Callable[[Responder], str]]:
    """Start loopback servers for a test; all are shut down afterwards."""
    started: list[ThreadingHTTPServer] = []

    def start(responder: Responder) -> str:
        server, url = serve(responder)
        started.append(server)
        return url

    yield start
    for s in started:
        s.shutdown()
        s.server_close()
