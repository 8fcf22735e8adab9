"""validate's what-if pairs: each prediction from a scenario's own metrics against the scenario
run with the remedy, within the goal (the same verdict, P99 TTFT within 25 %), every error stated."""

from __future__ import annotations

import json

import pytest

from kvdiag.cli import main
from kvdiag.whatif.compare import TOLERANCE
from kvdiag.whatif.pairs import PAIRS, select, validate_pairs


def test_every_pair_is_within_the_goal() -> None:
    results = validate_pairs(PAIRS, jobs=2)
    assert [r.pair for r in results] == list(PAIRS)
    for r in results:
        e = r.errors
        assert e.same_verdict and e.p99_ttft is not None and abs(e.p99_ttft) <= TOLERANCE, (r.pair.name, e.describe())
        assert r.ok
    saturated = [r for r in results if r.observed.verdict in ("l1_kv_bottleneck", "l1_kv_pressure")]
    assert saturated and {r.pair.engine for r in saturated} == {"sglang", "vllm"}  # the pairs cover a saturated story on both
    assert any(r.truth.verdict == "healthy" for r in results)


def test_validate_runs_the_selected_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    """`--whatif` with a scenario runs that scenario's pairs on the engines asked for; the JSON
    and the plain progress lines carry each pair and its errors."""
    assert [p.engine for p in select(["noisy-healthy"], ["sglang"])] == ["sglang"]
    code = main(["validate", "--json", "--jobs", "1", "--scenario", "noisy-healthy", "--engine", "sglang", "--whatif"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    [pair] = out["whatif"]
    assert (pair["scenario"], pair["engine"], pair["remedy"]) == ("noisy-healthy", "sglang", "dp=2")
    assert pair["ok"] is True and code == 0 and pair["errors"]["problems"] == []
    assert "validate whatif [1] noisy-healthy on sglang: dp=2: ok" in captured.err.splitlines()


def test_mem_fraction_resizes_the_pairs_stories() -> None:
    """`validate --mem-fraction` re-sizes the pairs' scenarios as it re-sizes every other's."""
    pair = select(["l1-saturation"], ["sglang"])[0]
    default, tight = pair.story(), pair.story(0.85)
    assert default.duration == tight.duration == pair.duration
    assert default.deployment.mem_fraction != 0.85 and tight.deployment.mem_fraction == 0.85
    assert tight.deployment.pool_tokens < default.deployment.pool_tokens
