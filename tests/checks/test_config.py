"""The thresholds config: defaults, the YAML section, errors naming the line, CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag import cli
from kvdiag.config import Config, ConfigError, load, parse_duration, prom_duration, resolve, with_overrides


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvdiag.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_issue_numbers() -> None:
    c = Config()
    assert (c.window, c.saturated_usage, c.saturated_fraction, c.ttft_slo, c.ttft_quantile, c.prefix_hit_high) == (300, 0.95, 0.8, 10, 0.99, 0.5)


def test_load_reads_the_checks_section_and_leaves_others(tmp_path: Path) -> None:
    p = write(tmp_path, "targets:\n  - http://a:8000\nchecks:\n  window: 10m\n  ttft_slo: 2.5s\n  saturated_usage: 0.9\n")
    c = load(p)
    assert (c.window, c.ttft_slo, c.saturated_usage, c.saturated_fraction) == (600, 2.5, 0.9, 0.8)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("checks:\n  window: 5m\n  saturated_usag: 0.9\n", "kvdiag.yaml:3: checks.saturated_usag: unknown threshold"),
        ("checks:\n  saturated_usage: 1.5\n", "kvdiag.yaml:2: checks.saturated_usage: 1.5 is not a ratio"),
        ("checks:\n  window: soon\n", "kvdiag.yaml:2: checks.window: 'soon' is not a duration"),
        ("checks:\n  min_samples: 2.5\n", "not a whole number"),
        ("checks:\n  window: [1, 2]\n", "kvdiag.yaml:2: checks.window: expected a single value"),
        ("checks:\n  window: 5m\n  window: 6m\n", "kvdiag.yaml:3: checks.window is given twice"),
        ("window: 5m\n", "kvdiag.yaml:1: 'window' belongs under 'checks:'"),
        ("checks: [1]\n", "kvdiag.yaml:1: 'checks' must be a mapping"),
        ("checks:\n  window: 5m\n bad: [\n", "not valid YAML"),
    ],
)
def test_bad_config_names_file_line_and_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, text))
    assert needle in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.yaml")


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, "checks:\n  window: 10m\n")
    c = resolve(str(p), ["window=2m", "ttft-slo=500ms"])
    assert (c.window, c.ttft_slo) == (120, 0.5)
    with pytest.raises(ConfigError, match="--set nope=1: checks.nope: unknown threshold"):
        with_overrides(Config(), ["nope=1"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        with_overrides(Config(), ["window"])


def test_durations() -> None:
    assert [parse_duration(x) for x in (90, "90", "90s", "1.5m", "1h", "250ms")] == [90, 90, 90, 90, 3600, 0.25]
    assert [prom_duration(x) for x in (300, 3600, 90, 0.25)] == ["5m", "1h", "90s", "250ms"]


def test_explain_prints_the_table_and_the_thresholds_in_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    p = write(tmp_path, "checks:\n  ttft_slo: 3s\n")
    assert cli.main(["explain", "--config", str(p), "--set", "saturated_usage=0.9"]) == 0
    out = capsys.readouterr().out
    for needle in ("l1_kv_bottleneck", "KvdiagL1KVPoolBottleneck", "queue_without_kv_pressure", "transient_evictions", "3s", "0.9"):
        assert needle in out
    assert "usage + the room the next admission needs >= 0.9: at every sample of the last 20s" in out  # the condition shown with the value in force
    for key in ("saturated_short_window", "queue_short_window", "queue_min_growth", "queue_growth_ratio"):
        assert key in out  # every threshold of the redesigned checks is shown


def test_explain_json_carries_promql_with_thresholds(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert cli.main(["explain", "--json", "--set", "window=10m"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["thresholds"]["window"] == "10m"
    s = next(c for c in data["checks"] if c["name"] == "kv_usage_saturated")
    assert "quantile_over_time(0.2, instance:kvdiag_kv_usage:ratio[10m])" in s["promql"]
    assert data["verdicts"]["l1_kv_bottleneck"]["alert"] == "KvdiagL1KVPoolBottleneck"
    assert len(data["decision_table"]) == 8


def test_explain_refuses_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, "checks:\n  nope: 1\n")
    assert cli.main(["explain", "--config", str(p)]) == 3
    assert "kvdiag.yaml:2" in capsys.readouterr().err


def test_explain_yaml_reads_back_to_the_same_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "--yaml", "--set", "window=7m", "--set", "ttft_slo=2.5s"]) == 0
    p = write(tmp_path, capsys.readouterr().out)
    assert load(p) == Config(window=420, ttft_slo=2.5)
