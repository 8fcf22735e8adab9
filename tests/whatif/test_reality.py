"""The real comparison's own logic, without a real engine: each remedy's real counterpart, a real
run read back as whatif reads a replay, and what makes a pair hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvdiag.config import Config
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun
from kvdiag.whatif import reality
from kvdiag.whatif.levers import Lever
from kvdiag.whatif.reality import RealPair, RealRun, real_change
from kvdiag.whatif.replay import Outcome, measure, replay


def test_each_remedy_runs_the_real_engine_with_its_own_flags() -> None:
    vllm, sglang = reality.STORIES["vllm"].spec(), reality.STORIES["sglang"].spec()
    assert real_change(vllm, Lever("pool", "8192")) == (replace(vllm, pool_tokens=8192), 1)
    assert real_change(sglang, Lever("max-running", "2")) == (replace(sglang, max_running=2), 1)
    assert real_change(vllm, Lever("dp", "2")) == (vllm, 2)  # two processes, the load split
    fp8, n = real_change(vllm, Lever("kv-dtype", "fp8"))
    assert n == 1 and fp8.pool_tokens == 2 * vllm.pool_tokens and fp8.args[-2:] == ("--kv-cache-dtype", "fp8")
    assert real_change(sglang, Lever("kv-dtype", "fp8"))[0].args[-2:] == ("--kv-cache-dtype", "fp8_e4m3")
    assert real_change(sglang, Lever("conservativeness", "0.3"))[0].args[-2:] == ("--schedule-conservativeness", "0.3")
    with pytest.raises(ValueError, match="no real re-run"):
        real_change(vllm, Lever("conservativeness", "0.3"))  # vLLM has no such flag
    with pytest.raises(ValueError, match="no real re-run"):
        real_change(vllm, Lever("tp", "2"))  # one CPU process: no tensor parallelism here
    for story in reality.STORIES.values():  # every remedy of the comparison has a real counterpart
        for lever in story.remedies:
            real_change(story.spec(), lever)
            lever.apply(SCENARIOS["noisy-healthy"])  # and a whatif lever


def test_a_real_run_is_read_back_as_a_replay_is() -> None:
    """A run's scrapes and its clients' TTFTs (here a reference engine's scrapes standing in for a
    real server's): the same windows, measure and exact P99 / median as the replay's."""
    sc = replace(SCENARIOS["l1-saturation"], duration=90.0)
    run = ScenarioRun(sc, "sglang", record_steps=False)
    scrapes = [s for _, s in run.scrapes(5.0)]
    ttfts = [r.ttft for sim in run.sims for r in sim.records if r.first_token is not None and r.first_token >= 5.0]
    real = RealRun(scrapes=scrapes, ttfts=ttfts)
    got = real.outcome("sglang", Config())
    want = replay(sc, "sglang", 5.0, Config())
    assert got == want
    assert got.running is not None and got.running > 0 and got.median_ttft_sim is not None
    assert measure(real.windows("sglang"), Config()).verdict == got.verdict


def _o(verdict: str, p99: float, median: float = 1.0) -> Outcome:
    return Outcome(0.9, 3.0, 1.0, p99, median, 100.0, verdict, p99_ttft_sim=p99, median_ttft_sim=median, running=3.0)


def test_a_pair_holds_on_the_verdict_and_the_p99() -> None:
    ok = RealPair("s", "vllm", "pool=8192", _o("healthy", 12.0), _o("healthy", 10.0), (1.0, 1.0, 1.0))
    assert ok.ok and ok.errors is not None and ok.errors.p99_ttft == pytest.approx(0.2)
    far = RealPair("s", "vllm", "pool=8192", _o("healthy", 13.0), _o("healthy", 10.0), (1.0, 1.0, 1.0))
    assert not far.ok  # +30 %
    other = RealPair("s", "vllm", "pool=8192", _o("l1_saturated", 10.0), _o("healthy", 10.0), (1.0, 1.0, 1.0))
    assert not other.ok
    failed = RealPair("s", "sglang", "kv-dtype=fp8", _o("healthy", 10.0), None, (1.0, 1.0, 1.0), "RuntimeError: refused")
    assert not failed.ok and failed.errors is None and failed.as_json()["error"] == "RuntimeError: refused"
    line = reality.summary([ok, far, other, failed, replace(ok, remedy="calibration")])
    assert "1/4 within the goal" in line and "median |P99 TTFT error| over the remedies 20%" in line and "vllm ok" in line


def test_a_failed_start_says_why() -> None:
    log = "RuntimeError: sglang exited with 1 while starting:\n[x] Scheduler hit an exception: Traceback\n" \
          "    raise ValueError(\"CPU FP8 KV cache requires Intel AMX support.\")\nValueError: CPU FP8 KV cache requires Intel AMX support.\n" \
          "[x] kill_process_tree called: parent_pid=1"
    assert reality._why(log) == "ValueError: CPU FP8 KV cache requires Intel AMX support."
    assert reality._why("one line") == "one line" and reality._why("") == ""
