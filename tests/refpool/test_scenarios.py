"""Scenarios tell their stories on both reference engines, and what they emit reads back
through kvdiag's adapters as each engine's own convention says it must."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun, get
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sglang.stats import SGLangStats
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.window import Window

LIGHT_END = 20.0  # the seed ramp's light phase


def samples_of(run: ScenarioRun, interval: float = 5.0, until: float | None = None) -> list[PoolSample]:
    return [s for _, scrape in run.scrapes(interval, until=until) for s in normalize_scrape(scrape, run.engine)]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_seed_timeline_on_a_tight_pool(engine: str) -> None:
    """The seed's story on Llama-3-70B TP2 at a 0.86 memory fraction (an 18k-token L1): usage
    pinned at 1, admission blocked on KV, the queue growing, running requests evicted and
    recomputed, the big L2 tier nearly empty and unused, and P99 TTFT tenfold the light phase's."""
    scenario = replace(get("l1-saturation", mem_fraction=0.86), duration=150.0)
    run = ScenarioRun(scenario, engine)
    run.advance(scenario.duration)
    sim = run.sims[0]
    steps = sim.steps.arrays()
    late = steps["start"] >= 90.0
    assert steps["usage"][late].max() >= 0.99
    assert steps["blocked_on_kv"][late].mean() > 0.9
    waiting = steps["waiting"][late]
    assert steps["waiting"][steps["start"] < LIGHT_END].max() == 0
    assert waiting[-len(waiting) // 4 :].mean() > 1.5 * waiting[: len(waiting) // 4].mean() > 0
    assert steps["evicted"].sum() > 0 and sim.state().evictions_total == steps["evicted"].sum()
    state = sim.state()
    assert state.l2_capacity_tokens and state.l2_used_tokens < 0.5 * state.l2_capacity_tokens
    assert state.l2_hit_tokens_total < 0.01 * state.prompt_tokens_total < state.prefix_hit_tokens_total
    light = sim.ttft_quantile(0.99, 0.0, LIGHT_END)
    heavy = sim.ttft_quantile(0.99, 120.0, 150.0)
    assert light is not None and heavy is not None and heavy > 10 * light


def _spy_reports(scheduler: SGLangScheduler, into: list[SGLangStats]) -> None:
    """Keep every report SGLang publishes (what its gauges were set from)."""
    take = scheduler.take_report

    def spy() -> SGLangStats | None:
        report = take()
        if report is not None:
            into.append(report)
        return report

    scheduler.take_report = spy  # type: ignore[method-assign]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_emitted_metrics_read_back_as_the_pool_counts(engine: str) -> None:
    """What kvdiag's adapters read equals the pool's own numbers through the engine's convention:
    SGLang token_usage = (total - available - evictable) / total rounded to 2 decimals, from the
    last published report; vLLM usage = 1 - free / (N - 1), evictable blocks counted as free."""
    run = ScenarioRun(replace(get("l1-saturation"), duration=120.0), engine)
    sched = run.sims[0].scheduler
    reports: list[SGLangStats] = []
    if isinstance(sched, SGLangScheduler):
        _spy_reports(sched, reports)
    checked = 0
    for t, scrape in run.scrapes(5.0):
        (sample,) = normalize_scrape(scrape, engine)
        if isinstance(sched, VLLMScheduler):
            st = sched.stats()
            assert sample.usage_ratio == pytest.approx(1 - st.num_free_blocks / (st.num_gpu_blocks - 1))
            assert sample.capacity_tokens == (st.num_gpu_blocks - 1) * st.block_size
            # Gauges as of the last step (a request that arrived since is not counted yet).
            steps = run.sims[0].steps
            assert (sample.running, sample.waiting) == (steps.running[-1], steps.waiting[-1])
            assert sample.evictions_total == st.num_preemptions_total
            assert sample.prefix_hit_tokens_total == st.prefix_cache_hits_total
        else:
            rep = reports[-1]
            total = rep.max_total_num_tokens
            assert sample.usage_ratio == round((total - rep.kv_available_tokens - rep.kv_evictable_tokens) / total, 2)
            assert (sample.used_tokens, sample.evictable_tokens) == (rep.kv_used_tokens, rep.kv_evictable_tokens)
            assert sample.available_tokens == rep.kv_available_tokens and sample.capacity_tokens == total
            assert (sample.running, sample.waiting) == (rep.num_running_reqs, rep.num_queue_reqs)
            assert (sample.evictions_total or 0) == sched.stats().num_retracted_requests_total
        checked += sample.usage_ratio > 0.9
    assert checked > 5  # read back while the pool was busy, not only when idle


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_restart_resets_counters_without_false_evictions(engine: str) -> None:
    scenario = get("restart")
    run = ScenarioRun(scenario, engine)
    samples = samples_of(run)
    before = [s.evictions_total or 0 for s in samples if s.ts - samples[0].ts < scenario.restart_at - 10]
    after = [s.requests_total for s in samples if s.ts - samples[0].ts > scenario.restart_at + 10]
    assert run.sims[0].restarts == [pytest.approx(scenario.restart_at, abs=0.1)]
    assert after[0] < max(s.requests_total for s in samples)  # the counters started again
    d = diagnose(Window(samples[0].instance, samples), Config())
    ev = d.checks["evictions_growing"]
    assert ev.status == "ok" and ev.evidence.values["increase"] == 0
    assert d.verdict.name == "healthy"
    if engine == "vllm":  # vLLM preempted during the early burst: a real counter dropped to 0
        assert max(before) > 0 and ev.evidence.values["resets"] >= 1


def test_dp2_is_two_instances_with_two_verdicts() -> None:
    run = ScenarioRun(replace(SCENARIOS["dp2-one-hot"], duration=150.0), "vllm")
    by_instance: dict[str, list[PoolSample]] = {}
    for s in samples_of(run):
        by_instance.setdefault(s.instance, []).append(s)
    assert sorted(by_instance) == ["sim://vllm/dp2-one-hot engine=0", "sim://vllm/dp2-one-hot engine=1"]
    hot, cold = (diagnose(Window(i, by_instance[i]), Config()).verdict.name for i in sorted(by_instance))
    assert hot in ("l1_kv_bottleneck", "l1_kv_pressure") and cold == "healthy"


def test_every_scenario_is_runnable_and_its_pool_is_the_capacity_commands() -> None:
    from kvdiag import capacity

    for s in SCENARIOS.values():
        assert s.dp == len(s.intent_for("sglang")) == len(s.intent_for("vllm"))
        spec = capacity.model(s.deployment.model)
        per_token = spec.kv_bytes_per_token_per_gpu(2, s.deployment.tp)
        assert 30_000 < s.deployment.pool_tokens < 50_000 and per_token == 160 * 1024
    with pytest.raises(KeyError, match="unknown scenario"):
        get("nope")
    assert np.isclose(get("l1-saturation", mem_fraction=0.86).deployment.pool_tokens, 18_000, rtol=0.01)
