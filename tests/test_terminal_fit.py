"""Terminal output at 80 columns and through a pipe (where rich assumes 80): every verdict,
check, finding and alert name is drawn whole ("l1_kv_bottleneck", never "l1_kv_bottle…"), no
line is wider than the terminal, and a table that cannot fit drops the columns it names, in
its order, then falls back to one record per row."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from kvdiag.checks import catalog, diagnose
from kvdiag.commands.explain import checks_table, decision_table, findings_table, thresholds_table
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import Diagnosis, PoolSample, Scrape
from kvdiag.report.diagnosis import panel
from kvdiag.report.terminal import Fitted, inspect_table
from kvdiag.sources.recording import write_recording
from kvdiag.window import windows
from tests.checks.scenario import const, recording
from tests.conftest import hang_guard

VERDICTS = set(catalog.VERDICTS)
CHECKS = {c.name for c in catalog.CHECKS}
FINDINGS = set(catalog.FINDINGS)
ALERTS = {v.alert for v in catalog.VERDICTS.values() if v.alert} | {f.alert for f in catalog.FINDINGS.values() if f.alert}
NAMES = VERDICTS | CHECKS | FINDINGS | ALERTS


def draw(*renderables: object, width: int = 80) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, legacy_windows=False)
    for r in renderables:
        console.print(r)
    return out.getvalue()


def words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z0-9_]+", text))


def assert_fits(text: str, width: int = 80) -> None:
    assert "…" not in text  # rich's ellipsis: something was cut
    wide = [line for line in text.splitlines() if len(line) > width]
    assert not wide, wide[:3]


def test_explain_at_80_columns_shows_every_name_whole() -> None:
    config = Config()
    text = draw(*(Fitted(t) for t in (decision_table(), checks_table(config, False), findings_table(), thresholds_table(config, None))))
    assert_fits(text)
    assert NAMES <= words(text), NAMES - words(text)


def test_the_harness_sees_a_cut_name() -> None:
    """A plain rich table at 80 columns does cut names: the checks above can fail."""
    text = draw(decision_table())
    assert "…" in text and not ALERTS <= words(text)


def wide_table() -> Table:
    t = Table(title="t")
    for header in ("name", "a", "b", "prose"):
        t.add_column(header, no_wrap=header != "prose")
    t.add_row("kv_usage_saturated", "x" * 20, "y" * 20, "some words that can wrap anywhere")
    return t


def test_columns_drop_in_the_stated_order_and_the_caption_says_so() -> None:
    fitted = Fitted(wide_table(), drop=("b", "a"))
    assert "kv_usage_saturated" in draw(fitted, width=120) and "y" * 20 in draw(fitted, width=120)
    at_60 = draw(fitted, width=60)  # name 18 + a 20 + prose: b goes first
    assert "x" * 20 in at_60 and "y" * 20 not in at_60 and "not shown at 60 columns: b" in at_60
    at_40 = draw(fitted, width=40)
    assert "x" * 20 not in at_40 and "kv_usage_saturated" in at_40 and "not shown at 40 columns: b, a" in at_40
    assert_fits(at_60, 60)
    assert_fits(at_40, 40)


def test_past_the_stated_drops_each_row_is_a_record_with_every_field() -> None:
    text = draw(Fitted(wide_table()), width=40)
    assert_fits(text, 40)
    for field in ("name", "a", "b", "prose", "kv_usage_saturated", "x" * 20, "y" * 20):
        assert field in words(text)


def bottleneck_recording() -> list[Scrape]:
    """A vLLM engine whose pool pins, then queues and preempts, with P99 TTFT past the SLO."""
    usage = lambda i: 0.6 + 0.01 * i if i < 35 else 0.99  # noqa: E731
    return recording("vllm", steps=60, usage=usage, waiting=lambda i: max(0, i - 30), running=const(48),
                     evictions=lambda i: 1 if i > 35 else 0, ttft=lambda i: 0.5 if i < 30 else 30.0)  # fmt: skip


def bottleneck_diagnosis() -> tuple[Diagnosis, list[PoolSample]]:
    samples = [s for scrape in bottleneck_recording() for s in normalize_scrape(scrape)]
    (window,) = windows(samples).values()
    return diagnose(window, Config()), samples


def test_a_diagnosis_and_the_pool_table_at_80_columns() -> None:
    d, samples = bottleneck_diagnosis()
    assert d.verdict.name == "l1_kv_bottleneck"
    text = draw(panel(d), inspect_table(samples[-1:]))
    assert_fits(text)
    assert {"l1_kv_bottleneck", *CHECKS} <= words(text)
    assert samples[-1].model and samples[-1].model in text  # the model name, whole
    assert samples[-1].instance in text


def kvdiag(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "kvdiag", *args], capture_output=True, text=True, timeout=hang_guard(12), env=env)


def test_piped_explain_and_diagnose_keep_names_whole(tmp_path: Path) -> None:
    explain = kvdiag("explain")
    assert explain.returncode == 0, explain.stderr
    assert_fits(explain.stdout)
    assert NAMES <= words(explain.stdout), NAMES - words(explain.stdout)
    _, samples = bottleneck_diagnosis()
    write_recording(tmp_path / "r.jsonl.gz", bottleneck_recording())
    diag = kvdiag("diagnose", "--replay", str(tmp_path / "r.jsonl.gz"))
    assert diag.returncode == 2, diag.stderr
    assert_fits(diag.stdout)
    assert {"l1_kv_bottleneck", *CHECKS} <= words(diag.stdout)
    assert samples[-1].model in diag.stdout


@pytest.mark.parametrize("width", [60, 100])
def test_other_widths_fit_too(width: int) -> None:
    config = Config()
    text = draw(*(Fitted(t) for t in (decision_table(), checks_table(config, True), findings_table())), width=width)
    assert_fits(text, width)
    assert (VERDICTS | CHECKS | ALERTS) <= words(text)
