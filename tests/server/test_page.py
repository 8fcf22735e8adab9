"""The landing page in headless Chromium: after its script ran, the DOM lists every instance
with its verdict and a three-state bar, and links to /metrics and the API."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import uvicorn

from kvdiag.refpool.serve import MetricsServer
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.settings import Settings
from tests.conftest import hang_guard
from tests.server.conftest import settings_for, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)  # fmt: skip


@pytest.fixture
def exporter_url(engines: dict[str, MetricsServer], start_loop: Callable[[Settings], ScrapeLoop]) -> Iterator[str]:
    """The exporter on a real loopback port (a browser needs one), its targets diagnosed."""
    loop = start_loop(settings_for([engines["sglang"].url, engines["vllm"].url], interval=0.25))
    diagnosed = lambda: all(i.diagnosis and i.diagnosis.samples >= 4 for s in loop.snapshot() for i in s.instances.values())  # noqa: E731
    assert wait_for(lambda: loop.ready and diagnosed())
    server = uvicorn.Server(uvicorn.Config(create_app(loop), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/system-deps.sh)")
def test_the_landing_page_shows_instances_verdicts_and_bars(exporter_url: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path}", "--virtual-time-budget=8000", "--dump-dom", exporter_url + "/"],
        capture_output=True, text=True, timeout=hang_guard(12),
    )  # fmt: skip
    dom = out.stdout
    body = re.search(r'<tbody id="rows">(.*?)</tbody>', dom, re.S)
    assert body, out.stderr[-2000:]
    rows = re.findall(r'<tr data-instance="([^"]+)">(.*?)</tr>', body.group(1), re.S)
    assert len(rows) == 2, dom[-3000:]
    for _, html in rows:
        assert "l1_kv_bottleneck" in html
        assert 'class="bar"' in html and 'class="used"' in html
    sglang = next(html for _, html in rows if "sglang" in html)
    assert 'class="evictable"' in sglang and 'class="available"' in sglang  # the split SGLang reports
    vllm = next(html for _, html in rows if "vllm" in html)
    assert "evictable not reported apart" in vllm  # no invented split for vLLM
    assert 'href="/metrics"' in dom and 'href="/api/v1/verdicts"' in dom
    assert re.search(r"2 instance\(s\), window 30(\.0)? s; updated", dom)
