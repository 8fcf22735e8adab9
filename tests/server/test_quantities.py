"""Issue 30, item 5 (and item 8's --timeout): durations and sizes are bounded, with one clear
error, in the config file and on the command line alike."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.cli import main
from kvdiag.config import ConfigError
from kvdiag.quantity import INTERVAL, MAX_BODY, TIMEOUT, parse_size
from tests.server.conftest import load_config


@pytest.mark.parametrize(
    "text, words",
    [
        ("scrape:\n  interval: 100000000d\n", r"scrape.interval: 100000000d is out of range for interval: from 10ms to 1d"),
        ("scrape:\n  interval: 0.0001\n", r"scrape.interval: 0.0001 is out of range for interval"),
        ("scrape:\n  interval: 1s\n  timeout: 0.000001\n", r"scrape.timeout: 1e-06 is out of range for timeout: from 10ms to 1h"),
        ("scrape:\n  max_body_bytes: 99999999999999999999999\n", r"scrape.max_body_bytes: 99999999999999999999999 is out of range for max_body_bytes: from 1KiB to 1GiB"),
        ("scrape:\n  max_body_bytes: 0\n", "out of range for max_body_bytes"),
        ("scrape:\n  max_body_bytes: 1.5\n", "is not a size in bytes"),
        ("scrape:\n  evaluate_every: inf\n", "is not a duration"),
        ("scrape:\n  interval: .inf\n", "is not a finite duration"),
        ("checks:\n  window: 100000000d\n", r"checks.window: 100000000d is out of range for window: from 1ms to 30d"),
        ("checks:\n  window: 20d\nscrape:\n  interval: 1s\n", "keeps 1728000 scrapes per instance; at most 20000"),
    ],
)
def test_config_bounds(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(tmp_path, text)


def test_sizes_and_durations_in_range(tmp_path: Path) -> None:
    s = load_config(tmp_path, "scrape:\n  interval: 15s\n  timeout: 500ms\n  max_body_bytes: 32MiB\nchecks:\n  window: 1d\n")
    assert (s.scrape.interval, s.scrape.timeout, s.scrape.max_bytes, s.checks.window) == (15.0, 0.5, 32 << 20, 86400.0)
    assert parse_size("64KB") == 64_000 and MAX_BODY.parse(16777216) == 16777216
    assert INTERVAL.parse("10ms") == 0.01 and TIMEOUT.parse(3600) == 3600.0
    with pytest.raises(ValueError, match="--timeout: 'inf' is not a finite duration"):
        TIMEOUT.parse(float("inf"), "--timeout")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--interval", "100000000d"], "--interval: 100000000d is out of range for interval"),  # killed the scheduler
        (["--window", "100000000d"], "window: 100000000d is out of range"),  # up: true beside kvdiag_up 0
        (["--interval", "100us"], "--interval: '100us' is not a duration"),
        (["--interval", "1s", "--window", "30d"], "keeps 2592000 scrapes per instance"),
    ],
)
def test_serve_refuses_before_listening(args: list[str], words: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvdiag", "serve", "--target", "http://127.0.0.1:9", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["inf", "1e300", "-1", "0", "nan"])
def test_inspect_timeout_is_a_bounded_duration(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "http://127.0.0.1:9", "--timeout", value]) == 3
    err = capsys.readouterr().err
    assert err.startswith("kvdiag inspect: --timeout: ") and "Traceback" not in err


@pytest.mark.parametrize("command", ["diagnose", "record"])
def test_sampling_commands_bound_their_durations(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = ["--out", str(tmp_path / "r.jsonl.gz")] if command == "record" else []
    for flag, value in (("--interval", "100000000d"), ("--timeout", "inf"), ("--duration", "1e300")):
        assert main([command, "http://127.0.0.1:9", flag, value, *extra]) == 3
        assert f"kvdiag {command}: {flag}: " in capsys.readouterr().err
