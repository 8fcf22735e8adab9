"""The landing page a person keeps open, in headless Chromium: per instance the three-state
bar, the hit ratio, L2 occupancy, evictions per minute and P99 TTFT exactly as the API's
diagnosis gives them, and sparklines of usage and waiting over the window; a screenshot shows
it painted. The loop is stopped before the browser loads the page, so the page and the API
answer from the same state and every figure can be compared exactly."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
import requests
import uvicorn

from kvdiag.refpool.serve import MetricsServer
from kvdiag.server.app import create_app
from kvdiag.server.loop import ScrapeLoop
from kvdiag.server.page import landing_page
from kvdiag.server.settings import Settings
from tests.conftest import hang_guard
from tests.server.conftest import settings_for, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)  # fmt: skip
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/system-deps.sh)")


@pytest.fixture
def frozen_exporter(engines: dict[str, MetricsServer], start_loop: Callable[[Settings], ScrapeLoop]) -> Iterator[str]:
    """The exporter on a real loopback port after a dozen scrapes of the saturation story,
    its loop stopped: what the page shows is what the API says, to the digit."""
    loop = start_loop(settings_for([engines["sglang"].url, engines["vllm"].url], interval=0.25))
    diagnosed = lambda: all(i.diagnosis and i.diagnosis.samples >= 12 for s in loop.snapshot() for i in s.instances.values())  # noqa: E731
    assert wait_for(lambda: loop.ready and diagnosed())
    loop.stop()
    server = uvicorn.Server(uvicorn.Config(create_app(loop), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def cells(row: str) -> dict[str, str]:
    return {k: html.unescape(v) for k, v in re.findall(r'<td class="num (\w+)"[^>]*>([^<]*)</td>', row)}


def test_the_page_shows_the_diagnosis_figures_and_trends(frozen_exporter: str, tmp_path: Path) -> None:
    url = frozen_exporter
    dump = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'dom'}", "--virtual-time-budget=8000", "--dump-dom", url + "/"],
        capture_output=True, text=True, timeout=hang_guard(12),
    )  # fmt: skip
    body = re.search(r'<tbody id="rows">(.*?)</tbody>', dump.stdout, re.S)
    assert body, dump.stderr[-2000:]
    rows = dict(re.findall(r'<tr data-instance="([^"]+)">(.*?)</tr>', body.group(1), re.S))
    verdicts = {d["instance"]: d for d in requests.get(url + "/api/v1/verdicts", timeout=10).json()["instances"]}
    instances = {r["instance"]: r for r in requests.get(url + "/api/v1/instances", timeout=10).json()["instances"]}
    assert len(rows) == 2 and set(rows) == set(verdicts) == set(instances), dump.stdout[-3000:]
    engines = set()
    for inst, row in rows.items():
        d, r = verdicts[inst], instances[inst]
        ev = {name: c["evidence"] for name, c in d["checks"].items()}
        shown = cells(row)
        assert shown["hit"] == f"{ev['prefix_hit_high']['hit_ratio']:.2f}"
        assert 0 < float(shown["hit"]) <= 1
        assert shown["evictions"] == f"{ev['evictions_growing']['per_minute']:.1f}" and float(shown["evictions"]) > 0  # the story evicts
        assert shown["ttft"] == f"{r['ttft_p99_seconds']:.2f} s"
        l2 = ev["l2_underused"].get("l2_occupancy")
        assert shown["l2"] == (f"{100 * l2:.0f}%" if l2 is not None else "–")
        assert d["verdict"] in row and 'class="bar"' in row
        # the sparkline: usage and waiting over the window, every scrape in it
        series = requests.get(f"{url}/api/v1/instances/{requests.utils.quote(inst, safe='')}/series?fields=usage_ratio,waiting", timeout=10).json()
        end = series["ts"][-1]
        inside = [i for i, t in enumerate(series["ts"]) if t >= end - series["window_seconds"]]
        spark = re.search(r'<svg class="spark"[^>]*data-points="(\d+)" data-waiting-max="([\d.]+)">(.*?)</svg>', row, re.S)
        assert spark, row
        assert int(spark.group(1)) == len(inside) >= 12
        assert float(spark.group(2)) == max(1, max(series["series"]["waiting"][i] for i in inside))
        usage_line, waiting_line = (re.findall(rf'<polyline class="{k}" points="([^"]+)"', spark.group(3)) for k in ("u", "w"))
        assert sum(len(p.split()) for p in usage_line) == len(inside) == sum(len(p.split()) for p in waiting_line)
        engines.add(r["latest"]["engine"])
    assert engines == {"sglang", "vllm"}
    assert re.search(r"2 instance\(s\), window 30(\.0)? s; updated", dump.stdout)
    # painted: the page with its rows draws well beyond the same page with none (its API out of
    # reach: headers, "loading…"), which draws well beyond a blank one. Sizes of the same page in
    # two states, not a figure a busy machine's slower fetches could miss.
    (tmp_path / "loading.html").write_text(landing_page(False))
    shots = []
    for name, page in (("blank", "about:blank"), ("loading", (tmp_path / "loading.html").as_uri()), ("page", url + "/")):
        shot = tmp_path / f"{name}.png"
        res = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / name}", "--virtual-time-budget=8000", "--window-size=1600,700", f"--screenshot={shot}", page],
            capture_output=True, text=True, timeout=hang_guard(12),
        )  # fmt: skip
        assert shot.exists(), res.stderr[-2000:]
        shots.append(shot.stat().st_size)
    blank, loading, painted = shots
    assert loading > 3 * blank and painted > 1.2 * loading, shots
