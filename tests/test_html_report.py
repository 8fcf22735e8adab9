"""The HTML report: self-contained, opened in headless Chromium (renders, plots, no console errors)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvdiag import cli
from kvdiag.sources.recording import write_recording
from tests.checks.scenario import const, recording

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)  # fmt: skip

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium not installed")


def chromium(tmp_path: Path, page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def console_errors(stderr: str) -> list[str]:
    """Console messages and uncaught exceptions as Chromium logs them with --enable-logging."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pool that fills, then queues and evicts (checks start firing mid-span), and a second
    instance whose engine restarts mid-span."""
    tmp = tmp_path_factory.mktemp("html")
    usage = lambda i: 0.5 + 0.0075 * i if i < 60 else 0.97  # noqa: E731
    waiting = lambda i: 0 if i < 70 else i - 70  # noqa: E731
    evictions = lambda i: 0 if i < 80 else 1  # noqa: E731
    ttft = lambda i: 0.8 if i < 70 else 5 + (i - 70) * 0.5  # noqa: E731
    a = recording("sglang", steps=140, usage=usage, waiting=waiting, running=const(48), evictions=evictions, ttft=ttft, restart_at=100)
    b = recording("vllm", steps=140, usage=usage, waiting=waiting, running=const(48), evictions=evictions, ttft=ttft)
    for s in b:
        s.target = "http://10.0.0.9:8000"
    paths = []
    for name, scrapes in (("a", a), ("b", b)):
        paths += ["--replay", str(tmp / f"{name}.jsonl.gz")]
        write_recording(tmp / f"{name}.jsonl.gz", scrapes)
    out = tmp / "report.html"
    assert cli.main(["diagnose", "--json", *paths, "--html", str(out)]) == 2
    return out


def test_report_is_self_contained(report: Path) -> None:
    html = report.read_text()
    assert not re.search(r"""(?:src|href)\s*=\s*['"](?:https?:)?//""", html), "external resource"
    assert "@import" not in html and "url(" not in html and "<link" not in html
    assert "<script" not in html  # plots are inline SVG


def test_report_renders_in_chromium_with_plots_and_firing_marks(report: Path, tmp_path: Path) -> None:
    res = chromium(tmp_path, report, "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert dom.count("class=\"chart\"") == 14  # seven plots per instance
    assert dom.count("class=\"band\"") == 2  # the verdict over time
    assert dom.count("<polygon") > 2  # stacked used / evictable / available
    for title in ("KV pool (L1)", "KV admission usage", "queue", "evictions (retract / preempt) per minute", "P99 TTFT", "prefix hit ratio", "L2 (host tier) occupancy"):
        assert title in dom
    assert "SLO 10s" in dom
    marks = re.findall(r"<title>(\w+) started firing at", dom)
    assert {"kv_usage_saturated", "queue_growing", "evictions_growing", "ttft_p99_high"} <= set(marks)
    assert "1 counter reset (engine restart) handled" in dom
    assert console_errors(res.stderr) == []


def test_report_paints_more_than_a_blank_page(report: Path, tmp_path: Path) -> None:
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    sizes = []
    for page in (blank, report):
        shot = tmp_path / f"{page.stem}.png"
        res = chromium(tmp_path, page, "--window-size=1250,1600", f"--screenshot={shot}")
        assert res.returncode == 0 and shot.exists(), res.stderr[-2000:]
        assert console_errors(res.stderr) == []
        sizes.append(shot.stat().st_size)
    assert sizes[1] > 10 * sizes[0]


def test_console_error_detection_works(tmp_path: Path) -> None:
    """The harness would see a script error, so 'no console errors' above means something."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><script>undefinedFunction()</script></body></html>")
    res = chromium(tmp_path, page, "--dump-dom")
    assert any("undefinedFunction" in line for line in console_errors(res.stderr)), res.stderr[-2000:]


def test_single_sample_report_says_point_in_time(tmp_path: Path) -> None:
    rec = tmp_path / "one.jsonl.gz"
    write_recording(rec, recording("vllm", steps=1))
    out = tmp_path / "one.html"
    cli.main(["diagnose", "--json", "--replay", str(rec), "--html", str(out)])
    html = out.read_text()
    assert "point-in-time answers only" in html and "class='chart'" not in html
