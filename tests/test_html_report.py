"""The HTML report: self-contained, opened in headless Chromium (renders, plots, no console errors)."""

from __future__ import annotations

import html as html_lib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvdiag import cli
from kvdiag.report.ticks import TIME_STEPS
from kvdiag.sources.recording import write_recording
from tests.checks.scenario import const, recording
from tests.test_ticks import is_1_2_5
from tests.conftest import hang_guard

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
        capture_output=True, text=True, timeout=hang_guard(12),
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


@pytest.fixture(scope="module")
def flat_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pool that fills and queues but never evicts: the eviction series is flat at zero."""
    tmp = tmp_path_factory.mktemp("flat")
    usage = lambda i: 0.5 + 0.01 * i if i < 45 else 0.97  # noqa: E731
    rec = recording("sglang", steps=80, usage=usage, waiting=lambda i: max(0, i - 50), running=const(48), evictions=const(0))
    write_recording(tmp / "flat.jsonl.gz", rec)
    out = tmp / "flat.html"
    cli.main(["diagnose", "--json", "--replay", str(tmp / "flat.jsonl.gz"), "--html", str(out)])
    return out


def charts(html: str) -> dict[str, str]:
    """Each chart's SVG by its title."""
    return {m.group(1): m.group(0) for m in re.finditer(r"<svg class='chart'.*?<text [^>]*class='t'>([^<]*)</text>.*?</svg>", html, re.S)}


def y_labels(svg: str) -> list[str]:
    return re.findall(r"class='ax yt'[^>]*>([^<]*)</text>", svg)


def label_value(label: str) -> float:
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(label[:-1]) * scale[label[-1]] if label[-1] in scale else float(label)


def test_a_flat_zero_series_gets_a_unit_axis_not_a_billionth(flat_report: Path) -> None:
    evictions = charts(flat_report.read_text())["evictions (retract / preempt) per minute"]
    assert y_labels(evictions) == ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]


def test_every_axis_ticks_on_round_1_2_5_steps(report: Path, flat_report: Path) -> None:
    seen = 0
    for page in (report, flat_report):
        for title, svg in charts(page.read_text()).items():
            labels = y_labels(svg)
            if not labels:
                continue  # "no L2 occupancy reported": nothing plotted
            assert not any("e-" in label or "e+" in label for label in labels), (title, labels)
            values = [label_value(label) for label in labels]
            steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
            assert values[0] == 0 and len(steps) == 1 and is_1_2_5(steps.pop()), (title, labels)
            clock = re.findall(r"class='ax xt'[^>]*>([^<]*)</text>", svg)
            secs = [sum(int(part) * m for part, m in zip(c.split(":"), (3600, 60, 1))) for c in clock]
            step = secs[1] - secs[0]
            assert step in TIME_STEPS and all(t % step == 0 for t in secs), (title, clock)  # round clock times
            seen += 1
    assert seen >= 12


# In the browser: the real text boxes of every chart's title, legend and plot area. The last
# SVG is the old layout (legend drawn on the title's row) and must be reported: the check can fail.
GEOMETRY = """<script>
const box = b => ({x: b.x, y: b.y, r: b.x + b.width, b: b.y + b.height});
const meet = (a, b) => a.x < b.r && b.x < a.r && a.y < b.b && b.y < a.b;
const bad = [];
const svgs = [...document.querySelectorAll("svg.chart")].filter(s => s.querySelector("rect.bg"));
for (const svg of svgs) {
  const name = svg.querySelector("text.t").textContent, title = box(svg.querySelector("text.t").getBBox());
  const plot = box(svg.querySelector("rect.bg").getBBox()), width = svg.viewBox.baseVal.width;
  const items = [...svg.querySelectorAll("rect.lg")].map(r => {
    const sw = box(r.getBBox()), t = box(r.nextElementSibling.getBBox());
    return {x: sw.x, y: Math.min(sw.y, t.y), r: t.r, b: Math.max(sw.b, t.b), label: r.nextElementSibling.textContent};
  });
  if (title.r > width) bad.push(`${name}: title wider than the chart`);
  items.forEach((it, i) => {
    if (meet(it, title)) bad.push(`${name}: legend "${it.label}" over the title`);
    if (it.b > plot.y) bad.push(`${name}: legend "${it.label}" over the plot`);
    if (it.r > width) bad.push(`${name}: legend "${it.label}" cut at the edge`);
    items.slice(i + 1).forEach(o => { if (meet(it, o)) bad.push(`${name}: legends "${it.label}" and "${o.label}" overlap`); });
  });
}
document.getElementById("geometry").textContent = JSON.stringify({charts: svgs.length, bad});
</script>"""
OLD_LAYOUT = (
    "<svg class='chart' viewBox='0 0 560 190' width='560' height='190' xmlns='http://www.w3.org/2000/svg'>"
    "<text x='56' y='14' class='t'>KV admission usage (usage + the room the next admission needs)</text>"
    "<rect class='lg' x='420' y='6' width='10' height='10'/><text x='433' y='15' class='ax'>admission usage</text>"
    "<rect x='56' y='22' width='492' height='142' class='bg'/></svg>"
)


def test_titles_and_legends_do_not_overlap_in_the_browser(report: Path, flat_report: Path, tmp_path: Path) -> None:
    for page in (report, flat_report):
        probe = tmp_path / f"{page.stem}-geometry.html"
        probe.write_text(page.read_text().replace("</body>", f"{OLD_LAYOUT}<pre id='geometry'></pre>{GEOMETRY}</body>"))
        res = chromium(tmp_path, probe, "--dump-dom")
        found = re.search(r"<pre id=\"geometry\">(.*?)</pre>", res.stdout, re.S)
        assert found, res.stderr[-2000:]
        result = json.loads(html_lib.unescape(found.group(1)))
        expected = len(re.findall(r"class='bg'", page.read_text())) + 1
        assert result["charts"] == expected
        assert result["bad"] == ["KV admission usage (usage + the room the next admission needs): legend \"admission usage\" over the title"]
