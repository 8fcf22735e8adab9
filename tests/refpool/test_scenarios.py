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


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_emitted_metrics_read_back_as_the_pool_counts(engine: str) -> None:
    """What kvdiag's adapters read equals the pool's own numbers through the engine's convention:
    SGLang token_usage = (total - available - evictable) / total rounded to 2 decimals, from the
    last published report; vLLM usage = 1 - free / (N - 1), evictable blocks counted as free."""
    run = ScenarioRun(replace(get("l1-saturation"), duration=120.0), engine)
    sched = run.sims[0].scheduler
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
            assert isinstance(sched, SGLangScheduler)
            rep = sched.last_report  # what its gauges were last set from
            assert rep is not None
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


# ---------------------------------------------------------------- deployments (issue 17)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvdiag.refpool.scenarios import DEPLOYMENTS  # noqa: E402
from kvdiag.refpool.validate import L1_VERDICTS, Result, score_run  # noqa: E402
from kvdiag.model import Scrape  # noqa: E402
from kvdiag.refpool.emit import content_type  # noqa: E402
from kvdiag.refpool.sim import EPOCH  # noqa: E402
from tests import emitted_dialects  # noqa: E402


def _families(text: str) -> dict[str, list]:
    """Samples by name, parsed by prometheus_client (the engines' own library)."""
    return {s.name: [x for f in text_string_to_metric_families(text) for x in f.samples if x.name == s.name]
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def _one(samples: dict[str, list], name: str, **labels: str) -> float:
    (value,) = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return value


@pytest.fixture(scope="module")
def deployment_scored() -> dict[tuple[str, str], tuple[ScenarioRun, Result]]:
    """Every deployment story on each engine it exists for, scored by validate and left at its
    end (five runs, about 20 s on 2 cores)."""
    out = {}
    for name, sc in DEPLOYMENTS.items():
        for engine in sc.engines:
            run = ScenarioRun(sc, engine)
            (result,) = score_run(run, Config(), interval=emitted_dialects.SCRAPE_S)
            out[name, engine] = run, result
    return out


@pytest.fixture(scope="module")
def deployment_runs(deployment_scored: dict) -> dict[tuple[str, str], ScenarioRun]:
    return {k: run for k, (run, _) in deployment_scored.items()}


@pytest.fixture(scope="module")
def deployment_results(deployment_scored: dict) -> dict[tuple[str, str], Result]:
    return {k: result for k, (_, result) in deployment_scored.items()}


def test_deployment_stories_are_told_and_scored(deployment_results: dict[tuple[str, str], Result]) -> None:
    """The simulator's ground truth is the label each deployment was built for (so a story cannot
    silently stop telling itself), and the checklist names it, at the end and at every scored
    instant: the decode pool behind SGLang's prealloc queue, the deferred KV transfer, the
    binding SWA pool, L1 under an LMCache tier."""
    assert set(deployment_results) == {("pd-decode-pool", "sglang"), ("pd-decode-pool", "vllm"), ("pd-kv-transfer", "vllm"),
                                       ("hybrid-swa", "sglang"), ("lmcache-underused", "vllm")}  # fmt: skip
    for (name, engine), r in deployment_results.items():
        intent = DEPLOYMENTS[name].intent_for(engine)[0]
        assert (r.expected in L1_VERDICTS) if intent in L1_VERDICTS else r.expected == intent, (name, engine, r.truth)
        wrong = [(i.t, i.truth, i.verdict) for i in r.scored if not i.right]
        assert r.correct and not wrong, (name, engine, r.expected, r.verdict, wrong)
        assert len(r.scored) >= 10, (name, engine)


def test_sglang_decode_instance_backlog_is_in_the_prealloc_queue(deployment_runs: dict) -> None:
    """The decode instance labels itself decode, its backlog waits in the prealloc queue while
    num_queue_reqs stays small, its pool is near full (preallocated slots count as used) and it
    retracted; the prefill instance's bootstrap queue holds the same requests."""
    run = deployment_runs["pd-decode-pool", "sglang"]
    sched = run.sims[0].scheduler
    dec = _families(run.exposition())
    assert {s.labels["engine_type"] for s in dec["sglang:num_running_reqs"]} == {"decode"}
    prealloc, queue = _one(dec, "sglang:num_decode_prealloc_queue_reqs"), _one(dec, "sglang:num_queue_reqs")
    assert prealloc >= 50 and queue <= 5 and prealloc > 10 * max(queue, 1)
    assert _one(dec, "sglang:token_usage") >= 0.8 and run.sims[0].steps.arrays()["evicted"].sum() > 0
    assert _one(dec, "sglang:num_retracted_input_tokens_total") > 0
    pre = _families(run.side_targets()["prefill"])
    assert {s.labels["engine_type"] for s in pre["sglang:num_running_reqs"]} == {"prefill"}
    assert _one(pre, "sglang:num_prefill_bootstrap_queue_reqs") == len(sched.prealloc)
    assert _one(pre, "sglang:num_decode_prealloc_queue_reqs") == 0  # a prefill instance's decode gauges stay 0


def test_unified_sglang_exports_the_pd_gauges_as_zero() -> None:
    run = ScenarioRun(replace(get("noisy-healthy"), duration=10.0), "sglang")
    run.advance(10.0)
    out = _families(run.exposition())
    for name in ("num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs", "num_decode_prealloc_queue_reqs",
                 "num_decode_transfer_queue_reqs", "prealloc_full_token_usage", "swa_token_usage"):  # fmt: skip
        assert _one(out, f"sglang:{name}") == 0, name
    assert {s.labels["engine_type"] for s in out["sglang:num_running_reqs"]} == {"unified"}
    assert "sglang:max_total_num_tokens_swa" not in out


def test_vllm_decode_waits_on_the_kv_transfer_deferred(deployment_runs: dict) -> None:
    """vLLM's decode instance behind a slow link: the waiting requests are all deferred (their
    blocks allocated, the KV on the wire), by_reason adds up to num_requests_waiting, the fetch
    stages cover them, and the transferred prompts count as external prefix-cache hits."""
    run = deployment_runs["pd-kv-transfer", "vllm"]
    out = _families(run.exposition())
    waiting = _one(out, "vllm:num_requests_waiting")
    deferred = _one(out, "vllm:num_requests_waiting_by_reason", reason="deferred")
    capacity = _one(out, "vllm:num_requests_waiting_by_reason", reason="capacity")
    assert waiting >= 50 and deferred + capacity == waiting and capacity <= 0.1 * waiting
    stages = {s.labels["stage"]: s.value for s in out["vllm:num_requests_kv_fetch_by_stage"]}
    assert stages["waiting_to_start"] + stages["in_progress"] == deferred and stages["completed_waiting"] == 0
    hits = _one(out, "vllm:external_prefix_cache_hits_total")
    assert hits > 0 and hits <= _one(out, "vllm:external_prefix_cache_queries_total")


def test_hybrid_swa_pool_binds_while_the_full_pool_has_room(deployment_runs: dict) -> None:
    """SGLang's gauges of a hybrid model: the SWA pool pinned, the full pool at ratio x that,
    token_usage = round(max(full, swa), 2), num_used_tokens the larger used count, and both
    pools' capacities exported."""
    run = deployment_runs["hybrid-swa", "sglang"]
    state = run.sims[0].state()
    steps = run.sims[0].steps.arrays()
    late = steps["start"] >= 90.0
    assert np.quantile(steps["usage"][late], 0.9) >= 0.97  # the truth: the SWA pool, where admission binds
    out = _families(run.exposition())
    full, swa = _one(out, "sglang:full_token_usage"), _one(out, "sglang:swa_token_usage")
    assert _one(out, "sglang:token_usage") == round(max(full, swa), 2)
    assert full == pytest.approx(0.6 * swa, rel=0.02) and full < 0.65
    assert _one(out, "sglang:max_total_num_tokens_swa") == state.swa_capacity_tokens
    assert _one(out, "sglang:max_total_num_tokens") == state.capacity_tokens > state.swa_capacity_tokens
    assert _one(out, "sglang:num_used_tokens") == _one(out, "sglang:swa_used_tokens") == _one(out, "sglang:kv_used_tokens")


def test_lmcache_exporter_on_its_own_target_and_shared(deployment_runs: dict) -> None:
    """LMCache's own /metrics: its names and labels (observability.py@0.5.6); its lookups cover
    every scheduling of a request (vLLM's external prefix-cache counters leave out resumed ones),
    hits within lookups; retrieves, the loads the connector ran; a mostly empty local cache; the
    same families in a shared multiprocess vLLM body, without _created series."""
    run = deployment_runs["lmcache-underused", "vllm"]
    lm = _families(run.side_targets()["lmcache"])
    labels = lm["lmcache:num_lookup_tokens_total"][0].labels
    assert labels == {"model_name": run.scenario.deployment.served_model, "worker_id": "0", "role": "worker",
                      "served_model_name": run.scenario.deployment.served_model}  # fmt: skip
    vllm = _families(run.exposition())
    lookups, hits = _one(lm, "lmcache:num_lookup_tokens_total"), _one(lm, "lmcache:num_lookup_hits_total")
    assert lookups >= _one(vllm, "vllm:external_prefix_cache_queries_total") > 0 and 0 < hits <= lookups
    assert _one(lm, "lmcache:num_hit_tokens_total") == _one(lm, "lmcache:num_requested_tokens_total") > 0
    # underused: its lookups find the shared prefixes the GPU pool holds too, but it serves little
    assert _one(lm, "lmcache:num_hit_tokens_total") < 0.05 * _one(lm, "lmcache:num_prompt_tokens_total") < hits
    state = run.sims[0].state()
    per_token = run.scenario.deployment.roofline().kv_bytes_per_token  # worker 0's shard
    assert 0 < _one(lm, "lmcache:local_cache_usage") < 0.5 * state.l2_capacity_tokens * per_token
    assert 0 <= _one(lm, "lmcache:lookup_hit_rate") <= 1
    from kvdiag.refpool import emit

    shared = emit.render("vllm", [state], lmcache=[run.sims[0].scheduler.lmcache])
    both = _families(shared)
    assert "lmcache:num_hit_tokens_total" in both and not any(n.endswith("_created") for n in both)
    with pytest.raises(ValueError, match="multiprocess"):
        emit.render("vllm", [state], lmcache=[run.sims[0].scheduler.lmcache], multiprocess=False)


def test_a_deployment_refuses_an_engine_it_does_not_exist_for() -> None:
    with pytest.raises(ValueError, match="exists for sglang"):
        ScenarioRun(DEPLOYMENTS["hybrid-swa"], "vllm")


def test_saved_deployment_dialects_are_what_the_emitter_writes(deployment_runs: dict) -> None:
    """The dialect fixtures of the deployments have the series (names, label sets) of a fresh
    emission (rewrite them with ``python -m tests.emitted_dialects``), and each reads back
    through kvdiag's adapters."""
    fresh = emitted_dialects.bodies(deployment_runs)
    saved = {p.name for p in emitted_dialects.DIR.glob("*.prom")}
    assert saved == set(fresh), "run `python -m tests.emitted_dialects`"
    stale = {name: emitted_dialects.series(body) ^ emitted_dialects.series(emitted_dialects.read(name))
             for name, body in fresh.items()}  # fmt: skip
    assert not any(stale.values()), f"stale: { {k: sorted(v)[:3] for k, v in stale.items() if v} }; run `python -m tests.emitted_dialects`"
    body = fresh["pd-kv-transfer-vllm.prom"]  # the comparison itself: a renamed label value is caught
    assert emitted_dialects.series(body.replace('reason="deferred"', 'reason="transfer"')) != emitted_dialects.series(body)
    for (name, engine), run in deployment_runs.items():
        scrape = Scrape(EPOCH + run.now, run.target, content_type(False), emitted_dialects.read(f"{name}-{engine}.prom"))
        (sample,) = normalize_scrape(scrape, engine)
        assert sample.usage_ratio is not None and sample.waiting is not None, (name, engine)


def _read(name: str, engine: str):  # noqa: ANN202 (the PoolSamples of one saved body)
    return normalize_scrape(Scrape(EPOCH, "http://engine:8000", content_type(False), emitted_dialects.read(name)), engine)


def test_saved_deployment_dialects_read_as_their_deployment() -> None:
    """What kvdiag's adapters make of the emitter's bodies: each role, its queues split by what
    they wait for, the hybrid model's binding pool, LMCache's exporter as a tier of its own."""
    (dec,) = _read("pd-decode-pool-sglang.prom", "sglang")
    assert dec.role == "decode" and dec.waiting_capacity == dec.waiting >= 50 and dec.recompute_tokens_total
    (pre,) = _read("pd-decode-pool-sglang-prefill.prom", "sglang")
    assert pre.role == "prefill" and pre.waiting_deferred == dec.waiting  # its bootstrap queue: the decode's prealloc
    (vdec,) = _read("pd-decode-pool-vllm.prom", "vllm")
    assert vdec.role == "decode" and vdec.waiting_capacity == vdec.waiting >= 50
    (xfer,) = _read("pd-kv-transfer-vllm.prom", "vllm")
    assert xfer.role == "decode" and xfer.waiting_deferred == xfer.waiting >= 50 and xfer.waiting_capacity == 0
    (swa,) = _read("hybrid-swa-sglang.prom", "sglang")
    assert swa.binding_pool is not None and swa.binding_pool.kind == "swa" and swa.binding_pool.usage_ratio >= 0.95
    assert {p.kind: p.usage_ratio for p in swa.pools}["full"] < 0.65
    (tier,) = _read("lmcache-underused-vllm-lmcache.prom", "vllm")
    assert tier.tier_only and tier.l2_hit_tokens_total


def _serve_in_thread(args: list[str]):  # noqa: ANN202
    import threading

    from kvdiag.cli import main

    worker = threading.Thread(target=main, args=(args,), daemon=True)
    worker.start()
    return worker


def _get(url: str, deadline_s: float = 60.0) -> str:
    """The body at ``url`` once it answers (a hang guard, not a timing assertion)."""
    import time
    import urllib.error
    import urllib.request

    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.read().decode()
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the side target binds the next port)."""
    import socket

    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports on loopback")


def test_simulate_serves_lmcache_as_its_own_target_or_shared() -> None:
    """``kvdiag simulate`` serves LMCache's exporter on the next port, as users scrape it, and with
    --lmcache-shared in vLLM's own /metrics instead."""
    port = _two_free_ports()
    base = ["simulate", "--engine", "vllm", "--scenario", "lmcache-underused", "--speed", "40", "--duration", "20"]
    worker = _serve_in_thread(base + ["--port", str(port)])
    main_body, side_body = _get(f"http://127.0.0.1:{port}/metrics"), _get(f"http://127.0.0.1:{port + 1}/metrics")
    assert "vllm:num_requests_running" in main_body and "lmcache:" not in main_body
    assert "lmcache:num_lookup_tokens_total" in side_body and "vllm:" not in side_body
    worker.join(timeout=120)
    assert not worker.is_alive()
    worker = _serve_in_thread(base + ["--port", str(port), "--lmcache-shared"])
    shared = _get(f"http://127.0.0.1:{port}/metrics")
    assert "lmcache:num_lookup_tokens_total" in shared and "vllm:num_requests_running" in shared
    assert "_created" not in shared  # a multiprocess registry
    worker.join(timeout=120)
    assert not worker.is_alive()
