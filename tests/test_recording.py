"""record against a live loopback server, replay byte for byte, and inspect's JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

from kvdiag.cli import main
from kvdiag.refpool.emit import EngineState, content_type, render
from kvdiag.sources.recording import read_recording
from kvdiag.sources.scrape import ACCEPT
from tests.conftest import Responder, hang_guard


def _kvdiag(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, timeout=hang_guard(12))


def test_record_then_replay_roundtrips_bytes(http_server, tmp_path) -> None:
    served: list[str] = []

    def answer(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        st = EngineState(capacity_tokens=1000, used_tokens=100 * (len(served) + 1), running=len(served), evictions_total=len(served))
        body = render("sglang", [st], openmetrics=True, escape=True)
        served.append(body)
        return 200, {"Content-Type": content_type(True)}, body.encode()

    responder = Responder(answer)
    url = http_server(responder)
    out = tmp_path / "rec.jsonl.gz"
    proc = _kvdiag("record", url, "--interval", "0.2", "--duration", "0.5", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    scrapes = list(read_recording(out))
    assert len(scrapes) == 3 == len(served)
    assert [s.body for s in scrapes] == served  # byte for byte
    assert all(s.content_type.startswith("application/openmetrics-text") for s in scrapes)
    assert responder.requests[0][0] == "/metrics" and responder.requests[0][1]["Accept"] == ACCEPT

    proc = _kvdiag("inspect", "--replay", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    [inst] = json.loads(proc.stdout)["instances"]
    assert inst["samples"] == 3 and inst["engine"] == "sglang" and inst["instance"] == url
    assert inst["used_tokens"] == 300 and inst["evictions_total"] == 2
    for key in ("kv_usage", "capacity_tokens", "evictable_tokens", "available_tokens", "running", "waiting", "prefix_hit_ratio", "provenance"):
        assert key in inst


def test_inspect_live_url_and_errors(http_server, tmp_path, capsys) -> None:
    body = render("vllm", [EngineState(capacity_tokens=1600, used_tokens=800)]).encode()
    url = http_server(Responder(lambda p, h: (200, {"Content-Type": content_type(False)}, body)))
    assert main(["inspect", url, "--json"]) == 0
    [inst] = json.loads(capsys.readouterr().out)["instances"]
    assert inst["kv_usage"] == 0.5 and inst["instance"].endswith("engine=0") and "samples" not in inst

    junk = tmp_path / "junk.prom"
    junk.write_text("node_cpu_seconds_total{cpu=\"0\"} 1\n")
    assert main(["inspect", str(junk)]) == 3
    assert "unknown engine" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing.prom")]) == 3
    failing = http_server(Responder(lambda p, h: (500, {}, b"boom")))
    assert main(["inspect", failing]) == 3
    assert "HTTP 500" in capsys.readouterr().err
