"""`kvdiag whatif` end to end: recordings, live engine URLs and a real Prometheus range, through
the same source plumbing as diagnose; predictions that follow the mechanism; clear errors."""

from __future__ import annotations

import json
import re
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from kvdiag.cli import main
from kvdiag.refpool import emit
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun
from kvdiag.refpool.serve import MetricsServer
from kvdiag.report.json import dumps
from tests.checks.scenario import recording
from tests.conftest import hang_guard
from tests.mixin.prom import Prometheus
from tests.whatif.conftest import record

L1 = ("l1_kv_bottleneck", "l1_kv_pressure")


def whatif(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code = main(["whatif", *args, "--json", "--jobs", "2"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else {}), out.err


@pytest.fixture(scope="module")
def saturated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ramp-slow on vLLM cut to 200 s: the load crosses the pool at ~140 s; preemptions, a queue."""
    return record("ramp-slow", "vllm", 200.0, tmp_path_factory.mktemp("whatif") / "saturated.jsonl.gz")


def test_saturated_twice_the_l1_predicts_lower_p99_and_fewer_evictions(saturated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FP8 KV holds twice the tokens in the same pool: against the calibration, lower P99 TTFT,
    fewer evictions, no L1 verdict. The bare ``max-running`` takes the checklist's ceiling."""
    code, out, err = whatif(capsys, "--replay", str(saturated), "--remedy", "kv-dtype=fp8", "--remedy", "max-running")
    assert code == 0, err
    [inst] = out["instances"]
    observed, calib = inst["observed"], inst["calibration"]["outcome"]
    assert observed["verdict"] in L1 and calib["verdict"] in L1
    fp8, capped = inst["remedies"]
    assert fp8["remedy"] == "kv-dtype=fp8" and fp8["flag"] and capped["remedy"].startswith("max-running=")
    assert fp8["outcome"]["p99_ttft"] < calib["p99_ttft"] and fp8["outcome"]["evictions_per_min"] < calib["evictions_per_min"]
    assert fp8["outcome"]["verdict"] not in L1
    errors = inst["fit_errors"]  # the fit's quality is stated with its errors, good or poor
    assert inst["fit_quality"].startswith("fit: good" if errors["good"] else "fit: POOR")
    assert f"P99 TTFT {errors['p99_ttft']:+.0%}" in inst["fit_quality"]
    assert err.count("whatif [") == 3  # piped: one plain progress line per replay


def test_garbage_and_absent_series_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "node.prom"
    other.write_text("# TYPE node_load1 gauge\nnode_load1 0.5\n")
    code, _, err = whatif(capsys, str(other))
    assert code == 3 and "no instance could be fitted" in err and "node.prom" in err
    idle = tmp_path / "idle.jsonl"
    idle.write_text("".join(dumps(s.__dict__) + "\n" for s in recording("vllm", steps=20, requests=0)))
    code, _, err = whatif(capsys, "--replay", str(idle))
    assert code == 3 and "no request finished" in err
    code, _, err = whatif(capsys, "--replay", str(idle), "--remedy", "swap=2")
    assert code == 3 and "unknown remedy 'swap'" in err
    code, _, err = whatif(capsys)
    assert code == 3 and "give engine URLs" in err


# ---------------------------------------------------------------- live: URLs and Prometheus
@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Prometheus]]:
    """noisy-healthy on vLLM at wall-clock speed on loopback, and a real Prometheus scraping it."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus (Debian package) not installed")
    run = ScenarioRun(replace(SCENARIOS["noisy-healthy"], duration=600.0), "vllm")
    server = MetricsServer(lambda om: (run.exposition(openmetrics=om), emit.content_type(om))).start()
    stop = threading.Event()
    thread = threading.Thread(target=run.follow_wall_clock, args=(1.0, 600.0, stop), daemon=True)
    thread.start()
    prom = Prometheus(binary, tmp_path_factory.mktemp("prom"), [], {"engine": server.url}).start()
    try:
        yield server.url + "/metrics", prom
    finally:
        prom.stop()
        stop.set()
        thread.join(timeout=30)
        server.stop()


def test_live_urls(live: tuple[str, Prometheus], capsys: pytest.CaptureFixture[str]) -> None:
    """Sampled for 6 s, shown as the terminal tables (piped: 200 columns, nothing cut)."""
    url, _ = live
    code = main(["whatif", url, "--interval", "0.5s", "--duration", "6s", "--remedy", "kv-dtype=fp8", "--jobs", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("fitted knobs", "observed", "calibration", "kv-dtype=fp8", "--kv-cache-dtype fp8", "fit: "):
        assert name in out
    assert "6s window" in out or "5s window" in out


def test_prometheus_range(live: tuple[str, Prometheus], capsys: pytest.CaptureFixture[str]) -> None:
    url, prom = live
    Prometheus.wait(lambda: prom.query('count_over_time(up{job="engine"}[30s]) >= 9'), hang_guard(20), "9 scrapes of the engine in Prometheus")
    code, out, err = whatif(capsys, "--prometheus", prom.url, "--since", "8s", "--step", "1s", "--remedy", "dp=2")
    assert code == 0, err
    [inst] = out["instances"]
    assert inst["fit"]["engine"] == "vllm" and inst["fit"]["interval_s"] == 1.0
    assert inst["remedies"][0]["outcome"]["replicas"] == 2


def test_a_scale_model_states_its_error(saturated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--scale 2`: the replays run at half the pool and load, the calibration at full size too,
    and the model's error against it is stated."""
    code, out, err = whatif(capsys, "--replay", str(saturated), "--remedy", "kv-dtype=fp8", "--scale", "2")
    assert code == 0, err
    [inst] = out["instances"]
    assert inst["calibration"]["remedy"] == "calibration (1/2 scale)" and inst["full_calibration"]["remedy"] == "calibration"
    e = inst["scale_errors"]
    assert inst["scale_model"].startswith("scale model 1/2: " + ("within" if e["good"] else "NOT within"))
    assert f"P99 TTFT {e['p99_ttft']:+.0%}" in inst["scale_model"]
    assert inst["remedies"][0]["remedy"] == "kv-dtype=fp8 (1/2 scale)"
    assert inst["scaled_check"] is None  # the window is shorter than --scale-check: compared whole
    code, _, err = whatif(capsys, "--replay", str(saturated), "--scale", "0.5")
    assert code == 3 and "--scale must be >= 1" in err


def test_a_scale_model_is_checked_on_the_first_minutes(
    saturated: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--scale auto` on a window past its request threshold picks a model (here 1/2: ~1,330
    requests against a threshold of 700, 86 running at the peak against a floor of 40) and says
    so; `--scale-check M` shorter than the window: full size and the model both replay its first
    M minutes only (not a full-size replay of the whole window), and the error is theirs."""
    from kvdiag.whatif import scale

    monkeypatch.setattr(scale, "MAX_REQUESTS", 700)
    monkeypatch.setattr(scale, "MIN_RUNNING", 10)
    code, out, err = whatif(capsys, "--replay", str(saturated), "--remedy", "kv-dtype=fp8", "--scale-check", "1")
    assert code == 0, err
    assert re.search(r"replaying a 1/2 scale model \(--scale auto: 1,333 requests in the window, \d+ running at its median", err)
    [inst] = out["instances"]
    full, check = inst["full_calibration"], inst["scaled_check"]
    assert full["remedy"] == "calibration, first 1 min" and check["remedy"] == "calibration, first 1 min (1/2 scale)"
    assert inst["calibration"]["remedy"] == "calibration (1/2 scale)"
    e = inst["scale_errors"]
    assert inst["scale_model"].startswith("scale model 1/2: " + ("within" if e["good"] else "NOT within"))
    assert "over the window's first 1 min" in inst["scale_model"]
    assert full["outcome"]["throughput"] != inst["calibration"]["outcome"]["throughput"]  # a shorter span than the model's whole replay
    code, _, err = whatif(capsys, "--replay", str(saturated), "--scale", "2", "--scale-check", "-1")
    assert code == 3 and "--scale-check must be >= 0" in err


def test_healthy_keeps_its_verdict_on_a_terminal(tmp_path: Path) -> None:
    """noisy-healthy: more L1 or a higher memory fraction changes nothing that matters. On an
    80-column terminal: the rich progress bar (not the piped lines), every run's name and verdict
    whole (the tables are ``Fitted``); the HTML report gains a what-if section naming every run."""
    import os
    import re
    import shlex
    import subprocess
    import sys

    rec = record("noisy-healthy", "sglang", 60.0, tmp_path / "healthy.jsonl.gz")
    html = tmp_path / "report.html"
    cmd = [sys.executable, "-m", "kvdiag", "whatif", "--replay", str(rec), "--remedy", "kv-dtype", "--remedy", "mem-fraction=0.95",
           "--jobs", "2", "--html", str(html)]  # fmt: skip
    # util-linux's script runs the command on a pseudo-terminal and copies what it draws
    done = subprocess.run(["script", "-qec", shlex.join(cmd), "/dev/null"], capture_output=True, timeout=300,
                          env={**os.environ, "COLUMNS": "80", "LINES": "40"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    raw = done.stdout
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode("utf-8", "replace"))
    assert "━" in out and "3/3" in out and "whatif [1/3]" not in out  # the bar, not the piped lines
    tables = out[out.index("fitted knobs"):]  # after the (transient) bar
    for name in ("calibration", "kv-dtype=fp8", "mem-fraction=0.95", "healthy", "fit: "):
        assert name in tables
    assert "…" not in tables  # nothing cut
    # the tables fit; the closing "wrote PATH" line is as long as the temporary folder's path
    assert max(len(line) for line in tables.splitlines() if line != f"wrote {html}") <= 80
    page = html.read_text()
    assert "what if: the window replayed" in page and "fitted knobs" in page
    rows = re.findall(r"<tr><td>([^<]+)</td>(?:<td>[^<]*</td>){6}<td>([a-z_]+)</td>", page[page.index("what if:"):])
    assert rows == [("observed", "healthy"), ("calibration", "healthy"), ("kv-dtype=fp8", "healthy"), ("mem-fraction=0.95", "healthy")]
