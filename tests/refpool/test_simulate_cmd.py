"""`kvdiag simulate`: a recording replays through inspect/diagnose, and the live server answers
/metrics on loopback while simulated time advances."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from kvdiag.cli import main
from kvdiag.engines import normalize_scrape
from kvdiag.sources.recording import read_recording
from kvdiag.sources.scrape import ScrapeError, scrape
from tests.conftest import hang_guard


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("l1-saturation", "near-capacity", "sequence-cap", "cold-compute", "l2-helps", "restart", "dp2-one-hot"):
        assert name in out


def test_recording_replays_through_inspect_and_diagnose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "seq.jsonl.gz"
    assert main(["simulate", "--engine", "sglang", "--scenario", "sequence-cap", "--duration", "120", "--out", str(rec)]) == 0
    scrapes = list(read_recording(rec))
    assert len(scrapes) == 24 and scrapes[1].ts - scrapes[0].ts == 5.0
    capsys.readouterr()
    assert main(["inspect", "--replay", str(rec), "--json"]) == 0
    (inst,) = json.loads(capsys.readouterr().out)["instances"]
    assert inst["engine"] == "sglang" and inst["ts"] == scrapes[-1].ts and inst["capacity_tokens"] == 38_871
    assert main(["diagnose", "--replay", str(rec), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (d,) = report["instances"]
    assert d["engine"] == "sglang" and d["verdict"] == "queue_without_kv_pressure"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serves_metrics_on_loopback_while_time_advances() -> None:
    port = _free_port()
    # The server lives 20 wall seconds (120 simulated at 6x), whatever the machine: a loaded one
    # (load average 50 beside this suite) scraped it once in the 6 s it lived at 20x and lost the
    # race. Two scrapes fit in 20 s on a machine ten times slower than that; each scrape's timeout
    # is a hang guard, so a slow answer is waited for rather than counted as none.
    args = ["simulate", "--engine", "vllm", "--scenario", "l1-saturation", "--port", str(port), "--speed", "6", "--duration", "120"]
    worker = threading.Thread(target=main, args=(args,), daemon=True)
    worker.start()
    url = f"http://127.0.0.1:{port}/metrics"
    seen = []
    deadline = time.monotonic() + hang_guard(2)
    while len(seen) < 2 and time.monotonic() < deadline:
        try:
            (sample,) = normalize_scrape(scrape(url, timeout=hang_guard(2)))
            if not seen or sample.requests_total != seen[-1].requests_total:
                seen.append(sample)
        except ScrapeError:
            pass
        time.sleep(0.3)
    worker.join(timeout=hang_guard(10))
    assert len(seen) == 2 and seen[0].engine == "vllm" and seen[1].requests_total > seen[0].requests_total
    assert not worker.is_alive()  # it stops once the simulated duration is reached
