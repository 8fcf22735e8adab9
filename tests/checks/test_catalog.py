"""The catalog: a complete decision table, consistent names, valid PromQL, engine-free checks."""

from __future__ import annotations

import shutil
import subprocess
from itertools import product
from pathlib import Path

import pytest
import yaml

from kvdiag import checks, engines
from kvdiag.checks import catalog
from kvdiag.checks.verdict import decide
from kvdiag.config import Config
from kvdiag.model import CheckResult, Evidence
from tests.conftest import EXPECTED_ALERTS

CHECKS_DIR = Path(checks.__file__).parent


def result(name: str, status: str) -> CheckResult:
    return CheckResult(name, status, Evidence(0.0, 0.0, 1, {}, f"{name} {status}"))  # type: ignore[arg-type]


def signals(s: str, q: str, e: str) -> dict[str, CheckResult]:
    return {name: result(name, st) for name, st in zip(catalog.SIGNALS.values(), (s, q, e))}


def test_every_combination_has_exactly_one_answer() -> None:
    assert len(catalog.DECISION_TABLE) == 8
    seen = {row.signals for row in catalog.DECISION_TABLE}
    assert seen == set(product((True, False), repeat=3))


@pytest.mark.parametrize(
    ("s", "q", "e", "verdict"),
    [
        ("firing", "firing", "firing", "l1_kv_bottleneck"),
        ("firing", "firing", "ok", "l1_kv_pressure"),
        ("firing", "ok", "firing", "l1_kv_pressure"),
        ("ok", "firing", "firing", "l1_kv_pressure"),
        ("firing", "ok", "ok", "near_kv_capacity"),
        ("ok", "firing", "ok", "queue_without_kv_pressure"),
        ("ok", "ok", "firing", "healthy"),
        ("ok", "ok", "ok", "healthy"),
        # Unknown signals: decided when every way of filling them in agrees, or when every way
        # names the pool (the least of those verdicts: what the known signals prove).
        ("ok", "ok", "unknown", "healthy"),
        ("firing", "firing", "unknown", "l1_kv_pressure"),
        ("firing", "ok", "unknown", "near_kv_capacity"),
        ("firing", "unknown", "unknown", "near_kv_capacity"),
        ("unknown", "firing", "firing", "l1_kv_pressure"),
        ("ok", "firing", "unknown", "unknown"),
        ("unknown", "firing", "ok", "unknown"),
        ("unknown", "ok", "ok", "unknown"),
        ("unknown", "unknown", "unknown", "unknown"),
    ],
)
def test_decide(s: str, q: str, e: str, verdict: str) -> None:
    assert decide(signals(s, q, e), Config()).name == verdict


def test_unknown_verdict_names_the_deciding_signal() -> None:
    v = decide(signals("ok", "firing", "unknown"), Config())
    assert "evictions_growing unknown" in v.reason and "queue_without_kv_pressure" in v.reason and "l1_kv_pressure" in v.reason


def test_an_unknown_signal_does_not_unsettle_a_pool_verdict() -> None:
    """A pinned pool without its eviction counter (a log without preemptions) is about the pool
    whatever the counter would say: the verdict is the least pool verdict, and says what the
    missing signal could raise it to."""
    v = decide(signals("firing", "ok", "unknown"), Config())
    assert v.name == "near_kv_capacity"
    assert "evictions_growing unknown" in v.reason and "l1_kv_pressure if it fires" in v.reason


def test_alert_names_and_severities() -> None:
    alerts = {v.alert: v.severity for v in catalog.VERDICTS.values() if v.alert}
    alerts.update({f.alert: f.severity for f in catalog.FINDINGS.values() if f.alert})
    assert alerts == EXPECTED_ALERTS
    codes = {n: v.exit_code for n, v in catalog.VERDICTS.items()}
    assert codes == {"l1_kv_bottleneck": 2, "l1_kv_pressure": 1, "near_kv_capacity": 0, "queue_without_kv_pressure": 1, "healthy": 0, "unknown": 3}


def test_catalog_and_evaluators_agree() -> None:
    assert list(checks.EVALUATORS) == [c.name for c in catalog.CHECKS]
    names = set(checks.EVALUATORS)
    for f in catalog.FINDINGS.values():
        assert set(f.all_of + f.none_of) <= names and set(f.verdicts) <= set(catalog.VERDICTS)
        assert set(f.remedies) <= set(catalog.REMEDIES)
    for v in catalog.VERDICTS.values():
        assert set(v.remedies) <= set(catalog.REMEDIES)
    params = set(Config.__dataclass_fields__)
    for c in catalog.CHECKS:
        assert set(c.params) <= params
        c.fires_when.format(**{k: v for k, v, _ in Config().describe()})


def test_checks_never_name_an_engine() -> None:
    for path in CHECKS_DIR.glob("*.py"):
        text = path.read_text().lower()
        for name in engines.ADAPTERS:
            assert name not in text, f"{path.name} names {name}"


@pytest.mark.parametrize("engine", sorted(engines.ADAPTERS))
def test_every_remedy_renders_with_and_without_figures(engine: str) -> None:
    from dataclasses import asdict

    knobs = asdict(engines.knobs(engine))
    figs = dict(pool_tokens=1, shared_tokens=1, private_len=1, ceiling=1, running_peak=1, running_note="; x", limit=1,
                limit_reason="x", fp8_pool_tokens=1, fp8_ceiling=1, double_ceiling=1, unknown_hints="x",
                reserve_usage=0.7, reserve_running=3, reserve_ratio=0.098, reserve_tokens=1, reserve_share=0.1,
                reserve_output=400.0)
    for r in catalog.REMEDIES.values():
        assert "{" not in r.text.format(**figs, **knobs, enable_hint="h")
        assert "{" not in r.plain.format(**knobs, enable_hint="h")


def test_expressions_can_use_recorded_checks() -> None:
    recorded = {c.name: f"kvdiag:check_{c.name}:firing" for c in catalog.CHECKS}
    expr = catalog.verdict_expr("l1_kv_pressure", Config(), recorded)
    assert expr.startswith("((kvdiag:check_kv_usage_saturated:firing) and (kvdiag:check_queue_growing:firing) unless")
    assert "avg_over_time" not in expr
    assert catalog.finding_expr("concurrency_not_cache", Config(), recorded) == (
        "(kvdiag:check_prefix_hit_high:firing) and (kvdiag:check_ttft_p99_high:firing)"
    )


def test_series_names_follow_the_recording_rule_convention() -> None:
    for name, s in catalog.SERIES.items():
        level, metric, ops = name.split(":")
        assert level == "instance" and metric.startswith("kvdiag_") and ops
        assert s.field in {"usage_ratio", "waiting", "running", "evictions_total", "ttft", "prefix_hit_tokens_total", "l2_used_tokens", "l2_hit_tokens_total",
                           "l2_load_bytes_total", "l2_store_bytes_total", "capacity_tokens", "decode_reserve_ratio",
                           "generation_tokens_total"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    """Render every check, verdict and finding expression as an alerting rule and let
    promtool parse it, with default and with changed thresholds."""
    rules = []
    for i, config in enumerate((Config(), Config(window=600, ttft_slo=2.5, queue_min_growth=3, saturated_short_window=30))):
        exprs = {f"check_{c.name}": catalog.check_expr(c.name, config) for c in catalog.CHECKS}
        exprs.update({f"verdict_{n}": catalog.verdict_expr(n, config) for n in catalog.VERDICTS if catalog.verdict_expr(n, config)})
        exprs.update({f"finding_{n}": catalog.finding_expr(n, config) for n in catalog.FINDINGS})
        recorded = {c.name: f"kvdiag:check_{c.name}:firing" for c in catalog.CHECKS}
        exprs.update({f"recorded_{n}": catalog.verdict_expr(n, config, recorded) for n in catalog.VERDICTS if catalog.verdict_expr(n, config)})
        rules += [{"alert": f"Test{i}_{name}", "expr": expr} for name, expr in exprs.items()]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "kvdiag", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout
