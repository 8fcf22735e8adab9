"""The generated mixin files: fresh, consistent with the catalog and the adapters, well formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvdiag.checks.catalog import FINDINGS, SERIES, VERDICTS
from kvdiag.cli import main
from kvdiag.config import Config
from kvdiag.engines import known_metrics
from kvdiag.render import GRAFANA_ALERTS, PROMETHEUS_RULE, RULES_ALERTS, RULES_RECORDING, RUNBOOKS, render_all
from kvdiag.render.normalize import series_name
from kvdiag.render.rules import FOR_DEFAULTS, for_durations
from tests.conftest import EXPECTED_ALERTS
from tests.mixin.conftest import ROOT

#: An engine family as a query names it: ``sglang:x``, ``vllm_x`` or the rules' ``sglang[:_]x``.
ENGINE_NAME = re.compile(r"\b(sglang|vllm)(?:\[:_\]|:|_)([A-Za-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def _alert_rules() -> list[dict]:
    return [r for g in _yaml(RULES_ALERTS)["groups"] for r in g["rules"]]


def _grafana_rules() -> list[dict]:
    return [r for g in _yaml(GRAFANA_ALERTS)["groups"] for r in g["rules"]]


def _dashboards() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((ROOT / "dashboards").glob("*.json"))]


def all_queries() -> list[str]:
    """Every PromQL expression in every generated file."""
    out = [r["expr"] for g in _yaml(RULES_RECORDING)["groups"] for r in g["rules"]]
    out += [r["expr"] for r in _alert_rules()]
    out += [d["model"]["expr"] for r in _grafana_rules() for d in r["data"] if "expr" in d["model"]]
    for dash in _dashboards():
        out += [t["expr"] for p in dash["panels"] for t in p["targets"]]
        out += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def engine_families(expr: str) -> set[str]:
    """The engine families an expression reads, suffixes (``_total``, ``_bucket``...) removed."""
    known = known_metrics()
    out = set()
    for prefix, rest in ENGINE_NAME.findall(expr):
        name = f"{prefix}:{rest}"
        for suffix in SUFFIXES:
            if name not in known and name.endswith(suffix):
                name = name[: -len(suffix)]
        out.add(name)
    return out


def test_committed_files_equal_a_fresh_render() -> None:
    stale = [p for p, text in render_all().items() if not (ROOT / p).exists() or (ROOT / p).read_text() != text]
    assert not stale, f"stale generated files (run `make generate`): {stale}"


def test_render_check_flags_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--out", str(tmp_path)]) == 0
    assert main(["render", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / RULES_ALERTS).write_text("groups: []\n")
    (tmp_path / RUNBOOKS).unlink()
    assert main(["render", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert f"stale: {RULES_ALERTS}" in err and f"stale: {RUNBOOKS}" in err


def test_every_engine_metric_in_any_query_is_known_to_the_adapters() -> None:
    known = known_metrics()
    used = set().union(*(engine_families(q) for q in all_queries()))
    assert used, "no engine metric found: the name pattern is broken"
    assert used <= known, f"queries name metrics the adapters do not read: {sorted(used - known)}"
    # the guard itself: a name the adapters never read is caught
    assert engine_families('rate({__name__=~"sglang[:_]num_waiting_reqs"}[5m])') - known


def test_the_last_event_gauge_is_never_read() -> None:
    assert not [q for q in all_queries() if re.search(r"num_retracted_reqs\b", q)]


def test_the_catalog_series_are_recorded_with_level_metric_operations_names() -> None:
    config = Config()
    recorded = [r["record"] for g in _yaml(RULES_RECORDING)["groups"] for r in g["rules"]]
    assert all(re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", r) for r in recorded), recorded
    assert {series_name(s.name, config) for s in SERIES.values()} <= set(recorded)
    for expected in ("instance:kvdiag_kv_usage:ratio", "instance:kvdiag_waiting:requests", "instance:kvdiag_evictions:rate5m",
                     "instance:kvdiag_ttft_seconds:p99_5m", "instance:kvdiag_prefix_hit:ratio5m"):
        assert expected in recorded


def test_six_alerts_with_severities_annotations_and_for() -> None:
    rules = _alert_rules()
    assert {r["alert"]: r["labels"]["severity"] for r in rules} == EXPECTED_ALERTS
    catalog = {v.alert: v.severity for v in VERDICTS.values() if v.alert} | {f.alert: f.severity for f in FINDINGS.values() if f.alert}
    assert catalog == EXPECTED_ALERTS
    for r in rules:
        ann = r["annotations"]
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}, r["alert"]
        assert ann["summary"].endswith(".")
        assert "{{ $labels.instance }}" in ann["description"]
        assert "query" not in ann["description"]  # figures from the alert's own value, no query per alert
        assert ("{{ $value" in ann["description"]) == (r["alert"] != "KvdiagEngineMetricsAbsent")
        assert re.fullmatch(r"\d+m", r["for"])
        assert "://" not in ann["runbook_url"] + ann["dashboard_url"]  # no host names baked in
    absent = next(r for r in rules if r["alert"] == "KvdiagEngineMetricsAbsent")
    assert "absent(instance:kvdiag_instance:info)" in absent["expr"]


def test_every_runbook_url_points_at_a_runbook_section() -> None:
    text = (ROOT / RUNBOOKS).read_text()
    anchors = {line[3:].strip().lower() for line in text.splitlines() if line.startswith("## ")}
    urls = [r["annotations"]["runbook_url"] for r in _alert_rules()] + [r["annotations"]["runbook_url"] for r in _grafana_rules()]
    assert len(urls) == 12
    for url in urls:
        path, anchor = url.split("#")
        assert path == RUNBOOKS and anchor in anchors, url
    for section in ("### What it means", "### How to confirm", "### What to do"):
        assert text.count(section) == 6


def test_grafana_provisioning_mirrors_the_prometheus_alerts() -> None:
    doc = _yaml(GRAFANA_ALERTS)
    assert doc["apiVersion"] == 1
    prom = {r["alert"]: r for r in _alert_rules()}
    rules = _grafana_rules()
    assert [r["title"] for r in rules] == list(prom)
    assert len({r["uid"] for r in rules}) == len(rules) and all(len(r["uid"]) <= 40 for r in rules)
    for r in rules:
        p = prom[r["title"]]
        assert r["for"] == p["for"] and r["labels"] == p["labels"]
        refs = {d["refId"] for d in r["data"]}
        assert r["condition"] in refs
        assert p["expr"] in r["data"][0]["model"]["expr"]
        assert r["annotations"]["summary"] == p["annotations"]["summary"]


def test_dashboards_are_grafana_10_with_the_variables_and_stable_ids() -> None:
    dashes = {d["title"]: d for d in _dashboards()}
    assert set(dashes) == {"KV pool overview", "KV pool instance"}
    for d in dashes.values():
        assert d["schemaVersion"] >= 38  # Grafana 10+
        assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "job", "instance", "model"]
        ids = [p["id"] for p in d["panels"]]
        assert ids == list(range(1, len(ids) + 1))
        for p in d["panels"]:
            assert p["datasource"]["uid"] == "${datasource}"
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
            assert p["targets"] and all(t["refId"] for t in p["targets"])
    text = (ROOT / "dashboards" / "kv-pool-instance.json").read_text()
    assert json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n" == text
    instance = {p["title"] for p in dashes["KV pool instance"]["panels"]}
    for title in ("KV pool: used / evictable / available", "P99 TTFT", "Prefix hit ratio", "L2 occupancy and hits", "Concurrency ceiling"):
        assert title in instance
    slo = next(p for p in dashes["KV pool instance"]["panels"] if p["title"] == "P99 TTFT")
    assert {"color": "red", "value": Config().ttft_slo} in slo["fieldConfig"]["defaults"]["thresholds"]["steps"]


def test_thresholds_from_the_config_reach_the_rules() -> None:
    files = render_all(Config(saturated_usage=0.9, window=600.0))
    assert ">= 0.9" in files[RULES_RECORDING] and "instance:kvdiag_evictions:rate10m" in files[RULES_RECORDING]


def test_for_overrides_reach_every_rendering_and_default_to_the_committed_ones() -> None:
    assert for_durations([]) == FOR_DEFAULTS
    files = render_all(for_by=for_durations(["critical=5s", "absent=90"]))
    fors = {r["alert"]: r["for"] for g in yaml.safe_load(files[RULES_ALERTS])["groups"] for r in g["rules"]}
    assert fors["KvdiagL1KVPoolBottleneck"] == "5s" and fors["KvdiagEngineMetricsAbsent"] == "90s"
    assert fors["KvdiagL1KVPoolPressure"] == FOR_DEFAULTS["warning"]
    grafana = {r["title"]: r["for"] for g in yaml.safe_load(files[GRAFANA_ALERTS])["groups"] for r in g["rules"]}
    assert grafana == fors
    assert "after `for: 5s`" in files[RUNBOOKS]
    rule = yaml.safe_load(files[PROMETHEUS_RULE])["spec"]["groups"]
    assert rule[-1] == yaml.safe_load(files[RULES_ALERTS])["groups"][0]
    for bad in ("page=5s", "critical", "critical=0s", "critical=soon"):
        with pytest.raises(ValueError):
            for_durations([bad])
    assert main(["render", "--out", "/nonexistent", "--check", "--for", "page=1m"]) == 3


def test_interval_reaches_every_group_and_the_growth_checks_history() -> None:
    """Every group carries the interval it is rendered for; a growth check is known where the
    queue series reaches back (min_samples - 1) intervals, so the offset follows the interval."""
    for interval, back in ((15.0, "30s"), (5.0, "10s")):
        files = render_all(interval=interval)
        groups = [g for p in (RULES_RECORDING, RULES_ALERTS) for g in yaml.safe_load(files[p])["groups"]]
        assert {g["interval"] for g in groups} == {f"{interval:g}s"}
        queue = next(r["expr"] for g in groups for r in g.get("rules", [])
                     if r.get("labels", {}).get("check") == "queue_growing")
        assert f"offset {back})" in queue and "count_over_time" not in queue
    assert main(["render", "--out", "/nonexistent", "--check", "--interval", "3m"]) == 3  # 2 x 3m leave no window


def test_no_rule_takes_a_subquery_or_a_window_over_an_engine_series() -> None:
    for g in _yaml(RULES_RECORDING)["groups"] + _yaml(RULES_ALERTS)["groups"]:
        for r in g["rules"]:
            assert not re.search(r"\[[0-9]+[smh]:[0-9]*[smh]?\]", r["expr"]), r.get("record", r.get("alert"))
            windows = re.findall(r"([a-zA-Z0-9_:]*)(\{[^{}]*\})?\[[0-9]+[smh]\]", r["expr"])
            # every window is over a recorded series (level:metric:operations), never a __name__ selector
            assert all(name.count(":") == 2 and "__name__" not in braces for name, braces in windows), (r.get("record"), windows)
