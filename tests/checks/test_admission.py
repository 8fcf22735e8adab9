"""Admission usage where the gauge is read after a step's frees: a long prompt prefilled over
several steps makes its request live longer, so one step frees less of the pool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvdiag.checks import diagnose
from kvdiag.config import Config
from tests.checks.scenario import const, ramp, recording, window
from tests.checks.test_remedies import recorded

CFG = Config()
LOAD = dict(usage=const(0.8), waiting=ramp(1, 0.5), running=const(80))
CASES = (
    (3_000, 0.8, 0.8 / 4),  # 600 uncached tokens: one prefill step, five steps in all
    (9_000, 0.0, 0.8 / (4 + 4)),  # 9,000 uncached: five chunks of at most 2,048, four steps more
    (9_000, 0.9, 0.8 / 4),  # the cached part is not prefilled again: 900 uncached, one step
)


def test_a_chunked_prompt_lowers_the_room_one_step_frees(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """5-token answers on the engine that reads its gauge after the frees (vLLM): the Python
    check and the recording rule count the prefill chunks alike."""
    monkeypatch.setattr("tests.checks.scenario.OUTPUT", 5)
    expr = "round(max(instance:kvdiag_kv_admission_need:ratio5m), 0.000001)"
    rules = []
    for prompt, hit, freed in CASES:
        monkeypatch.setattr("tests.checks.scenario.PROMPT", prompt)
        scrapes = recording("vllm", steps=12, hit=hit, **LOAD)
        s = diagnose(window(scrapes), CFG).checks["kv_usage_saturated"].evidence.values
        assert s["freed_ratio_last"] == pytest.approx(freed), (prompt, hit)
        assert s["need_ratio_last"] == pytest.approx(prompt * (1 - hit) / 200_000 + freed), (prompt, hit)
        rules.append(("vllm", f"prompt {prompt} hit {hit}", scrapes, expr, round(float(s["need_ratio_last"]), 6)))
    recorded(tmp_path, rules)


def test_a_decode_instance_needs_the_whole_prompt_and_its_reserves(tmp_path: Path) -> None:
    """A PD decode instance (SGLang) preallocates a transferred prompt whole, whatever the hit
    ratio, and keeps 512 tokens per running, transferring and next request: usage 0.91 with a
    prealloc backlog is pinned there, not on the same pool read as a unified instance. Python
    and the recording rule alike, with the role read from engine_type and, where the label is
    missing, from the decode queue that holds work."""
    expr = "round(max(instance:kvdiag_kv_admission_need:ratio5m), 0.000001)"
    load = dict(usage=const(0.91), running=const(10), prealloc=ramp(20, 1), transfer=const(2))
    decode = recording("sglang", steps=12, role="decode", **load)
    unlabelled = [replace(s, body=s.body.replace('engine_type="decode",', "")) for s in decode]
    unified = recording("sglang", steps=12, **{**load, "prealloc": const(0), "transfer": const(0)})
    rules = []
    for name, scrapes in (("decode", decode), ("decode without engine_type", unlabelled), ("unified", unified)):
        w = window(scrapes)
        s = diagnose(w, CFG).checks["kv_usage_saturated"]
        need = s.evidence.values["need_ratio_last"]
        if name == "unified":
            assert w.last.role == "unified"
            assert need == pytest.approx((3_000 * 0.2 + 500 * (1 + 0.7 * 10)) / 200_000)
            assert s.status == "ok"
        else:
            assert w.last.role == "decode"
            assert need == pytest.approx((3_000 + 512 * (10 + 2 + 1)) / 200_000)
            assert s.status == "firing", s.evidence.summary
        rules.append(("sglang", name, scrapes, expr, round(float(need), 6)))
    recorded(tmp_path, rules)
