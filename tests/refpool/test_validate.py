"""`kvdiag validate`: the ground-truth rule, the JSON contract, and the checklist scored on
the seed's story (where the known SGLang gap is pinned as a strict xfail)."""

from __future__ import annotations

import json

import pytest

from kvdiag.cli import main
from kvdiag.config import Config
from kvdiag.refpool.scenarios import get
from kvdiag.refpool.validate import Result, _label, run_one

KEYS = {"name", "engine", "expected", "verdict", "correct", "detection_delay_s", "slo_breach_s"}


@pytest.mark.parametrize(
    ("l1_binds", "backlog", "recompute", "full", "label"),
    [
        (True, True, True, False, "l1_kv_bottleneck"),
        (True, True, False, True, "l1_kv_pressure"),
        (True, False, True, True, "l1_kv_pressure"),
        (True, False, False, True, "near_kv_capacity"),
        (False, True, True, False, "l1_kv_pressure"),
        (False, True, False, True, "queue_without_kv_pressure"),
        (False, False, True, True, "near_kv_capacity"),
        (False, False, True, False, "healthy"),
        (False, False, False, False, "healthy"),
    ],
)
def test_truth_rule(l1_binds: bool, backlog: bool, recompute: bool, full: bool, label: str) -> None:
    assert _label(l1_binds, backlog, recompute, full) == label


def test_json_contract_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", "--json", "--scenario", "sequence-cap", "--scenario", "cold-compute"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"scenarios", "correct", "total"}
    assert out["total"] == 4 and out["correct"] == 4 and code == 0
    for row in out["scenarios"]:
        assert set(row) == KEYS
        assert row["expected"] == row["verdict"] == "queue_without_kv_pressure" and row["correct"] is True
        assert row["detection_delay_s"] is None and row["slo_breach_s"] is None  # no L1 onset


def saturation(engine: str) -> Result:
    (result,) = run_one(get("l1-saturation"), engine, Config())
    return result


def test_vllm_saturation_is_named_before_the_slo_breach() -> None:
    r = saturation("vllm")
    assert r.expected == r.verdict == "l1_kv_bottleneck"
    assert r.truth.kv_blocked_share > 0.8 and r.truth.evictions > 0 and r.truth.onset is not None
    delay, breach = r.as_json()["detection_delay_s"], r.as_json()["slo_breach_s"]
    assert isinstance(delay, float) and isinstance(breach, float) and 0 < delay < breach


@pytest.mark.xfail(
    strict=True,
    reason="checklist gap (reported): SGLang's admission reserve keeps token_usage at 0.93-0.97 while "
    "admission is blocked on KV >90% of the time, so kv_usage_saturated (>= 0.95 in 80% of samples) "
    "does not fire and the verdict is queue_without_kv_pressure",
)
def test_sglang_saturation_is_named_l1() -> None:
    r = saturation("sglang")
    assert r.expected == "l1_kv_pressure" and r.truth.kv_blocked_share > 0.8
    assert r.verdict == r.expected
