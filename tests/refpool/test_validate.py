"""`kvdiag validate`: the ground-truth rule, the JSON contract, and the checklist scored on the
whole scenario catalogue on both engines."""

from __future__ import annotations

import json

import pytest

from kvdiag.cli import main
from kvdiag.config import Config
from kvdiag.refpool.scenarios import SCENARIOS
from kvdiag.refpool.validate import Report, Result, _label, validate

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


@pytest.fixture(scope="module")
def report() -> Report:
    """The whole catalogue on both engines, once (about 25 s)."""
    return validate(config=Config())


def result(report: Report, name: str, engine: str) -> Result:
    return next(r for r in report.results if r.name == name and r.engine == engine)


def test_every_scenario_tells_its_story_and_every_verdict_is_right(report: Report) -> None:
    """The label the simulator's ground truth implies is the one each scenario was built for (so a
    scenario cannot silently stop telling its story), and the checklist names it."""
    for r in report.results:
        scenario, _, rank = r.name.partition("/dp")
        intent = SCENARIOS[scenario].intent_for(r.engine)[int(rank or 0)]
        assert r.expected == intent, (r.name, r.engine, r.truth)
    wrong = [(r.name, r.engine, r.expected, r.verdict) for r in report.results if not r.correct]
    assert not wrong and report.correct == len(report.results) == 18


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_recompute_is_named_before_the_slo_breach(report: Report, engine: str) -> None:
    """Where the engine evicts (vLLM preempting in the seed's story; both engines with long answers),
    E joins S and Q and the L1 verdict comes before P99 TTFT crosses the SLO."""
    for name in ("l1-saturation", "long-answers") if engine == "vllm" else ("long-answers",):
        r = result(report, name, engine)
        assert r.expected == r.verdict == "l1_kv_bottleneck"
        assert r.truth.kv_blocked_share > 0.8 and r.truth.evictions > 0 and r.truth.onset is not None
        delay, breach = r.as_json()["detection_delay_s"], r.as_json()["slo_breach_s"]
        assert isinstance(delay, float) and isinstance(breach, float) and 0 < delay < breach, (name, delay, breach)


def test_sglang_saturation_is_named_l1_by_admission_usage(report: Report) -> None:
    """SGLang's admission reserve keeps token_usage at 0.93-0.97 while admission is blocked on KV
    and nothing is retracted: the usage gauge is not pinned, admission usage is. S and Q name
    L1 pressure within a window (S needs 80 % of the window's samples, so later than the SLO breach
    in this fast ramp)."""
    r = result(report, "l1-saturation", "sglang")
    assert r.expected == r.verdict == "l1_kv_pressure"
    assert r.truth.kv_blocked_share > 0.8 and r.truth.evictions == 0 and r.truth.onset is not None
    delay = r.as_json()["detection_delay_s"]
    assert isinstance(delay, float) and 0 < delay <= Config().window
