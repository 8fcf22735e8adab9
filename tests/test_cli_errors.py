"""Issue 30, item 8: what gave a traceback on the command line gives one clear line and a
documented exit code instead (the durations' part is in tests/server/test_quantities.py, the
recordings' in tests/test_recording_damage.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiag.cli import main
from kvdiag.refpool.emit import EngineState, render
from kvdiag.sources.dockerjson import unwrap


def test_output_to_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``kvdiag inspect --json | head``: the reader is gone before kvdiag writes."""
    body = tmp_path / "engine.prom"
    body.write_text(render("sglang", [EngineState(capacity_tokens=1000, used_tokens=500)]))
    proc = subprocess.Popen([sys.executable, "-m", "kvdiag", "inspect", str(body), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # every write kvdiag makes meets EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("where, words", [("/nonexistent-dir/x.html", "no such folder"), ("/etc", "is a folder")])
def test_a_bad_html_path_is_refused_before_the_analysis(tmp_path: Path, where: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "slow.prom"
    rec.write_text(render("sglang", [EngineState(capacity_tokens=1000, used_tokens=500)]))
    # a URL that never answers: reached only if the path check came after the sampling
    start = time.monotonic()
    assert main(["diagnose", str(rec), "http://10.255.255.1:9", "--timeout", "60s", "--duration", "0", "--html", where]) == 3
    assert time.monotonic() - start < 30  # the hang guard for a check made after a 60 s scrape
    err = capsys.readouterr().err
    assert f"kvdiag diagnose: --html {where}: {words}" in err


@pytest.mark.parametrize("flag", ["--pool-gib-per-gpu", "--gpu-mem-gib", "--weights-gib"])
@pytest.mark.parametrize("value", ["1e308", "inf", "nan"])
def test_capacity_refuses_impossible_sizes(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--gpu", "h100"] if flag == "--weights-gib" else []
    assert main(["capacity", "--model", "llama-3-70b", flag, value, *extra]) == 3
    assert f"{flag} must be more than 0 and at most 65536 GiB" in capsys.readouterr().err


def test_a_deeply_nested_docker_record_is_a_plain_line() -> None:
    nested = '{"log": ' + "[" * 100_000 + "]" * 100_000 + "}"
    good = json.dumps({"log": "hello\n", "stream": "stderr", "time": "2026-11-29T11:33:15Z"})
    assert list(unwrap([(1, nested), (2, good)])) == [(1, nested), (2, "2026-11-29T11:33:15Z hello\n")]


def test_diagnose_log_of_a_nested_docker_record(tmp_path: Path) -> None:
    log = tmp_path / "container-json.log"
    log.write_text('{"log": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "diagnose", "--log", str(log), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
