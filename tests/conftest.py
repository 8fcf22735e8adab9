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



# ---------------------------------------------------------------- parallel runs (pytest-xdist)
#: `make test` runs the suite on two workers with `--dist loadfile --no-loadscope-reorder`: a file
#: is one unit of work (its module-scoped servers and simulations are set up once, in one worker),
#: handed out in the order sorted here. These are the longest files on two cores (`--durations`),
#: started first so that a minutes-long file handed out last does not leave one worker idle while
#: the other runs it alone; the remedies precede the rules differential so that both land in one
#: worker and share its `scenario_recordings`. Files not named here follow in collection order.
#: (Not `loadgroup`: xdist 3.8 marks groups through a node attribute pytest 9 no longer reads.)
LONGEST_FIRST = (
    "tests/real/test_real_engines.py",  # real vLLM and SGLang servers: 10-15 minutes in one worker
    "tests/refpool/test_validate.py",
    "tests/checks/test_remedies.py",
    "tests/mixin/test_differential.py",
    "tests/refpool/test_differential.py",
    "tests/refpool/test_emit_monotone.py",
    "tests/refpool/test_oracles.py",
    "tests/deploy/test_native_stack.py",
    "tests/test_demo.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in LONGEST_FIRST first, in that order; each file's tests stay together."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: collection order within a file and among the rest
