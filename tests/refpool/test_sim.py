"""The engine loop and its step-time model: ground truth recorded exactly on a scheduler whose
every step is known, the engines' metric cadence, and the seed's story on both reference
engines (usage pinned at 1, evictions, a growing queue, P99 TTFT up tenfold)."""

from __future__ import annotations

from collections import deque

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvdiag.capacity import MODELS
from kvdiag.refpool.emit import EngineState
from kvdiag.refpool.roofline import IDEAL, Calibration, Roofline
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sim import EPOCH, PoolTruth, Simulation
from kvdiag.refpool.storage import SMALL_LAYOUT, KVStorage
from kvdiag.refpool.types import ScheduledChunk, SimRequest, StepPlan
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.refpool.workload import ClosedLoop, Fixed, LogNormal, Poisson, SharedPrefix, Workload


# ---------------------------------------------------------------- a scheduler whose steps are known
class FakeScheduler:
    """Runs at most ``slots`` requests; a prompt is one prefill chunk, then one token a step."""

    def __init__(self, slots: int = 1) -> None:
        self.slots = slots
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished = 0

    def add_request(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def idle(self) -> None:
        pass

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        plan.chunks = [ScheduledChunk(r, 1, len(r.all_tokens), False) for r in self.running]
        while self.waiting and len(self.running) < self.slots:
            r = self.waiting.popleft()
            r.first_scheduled = now if r.first_scheduled is None else r.first_scheduled
            self.running.append(r)
            plan.chunks.append(ScheduledChunk(r, len(r.prompt), 0, True))
        plan.blocked_on_kv = bool(self.waiting)
        return plan

    def update_from_output(self, plan: StepPlan, now: float) -> list[SimRequest]:
        done = []
        for c in plan.chunks:
            r = c.req
            r.output.append(r.next_token())
            r.first_token = now if r.first_token is None else r.first_token
            if r.done:
                r.finished = now
                self.running.remove(r)
                done.append(r)
        self.finished += len(done)
        return done

    def check_invariants(self) -> None:
        pass


class FakeMetrics:
    engine = "vllm"

    def __init__(self, scheduler: FakeScheduler, created: float) -> None:
        self.scheduler = scheduler
        self.state = EngineState(capacity_tokens=160, created=created)

    def on_step(self) -> PoolTruth:
        s, sched = self.state, self.scheduler
        s.running, s.waiting, s.requests_total = len(sched.running), len(sched.waiting), sched.finished
        s.used_tokens = 16 * len(sched.running)
        return PoolTruth(160, s.used_tokens, 0, s.running, s.waiting)


def req(rid: str, arrival: float, prompt: int = 4, out: int = 3) -> SimRequest:
    return SimRequest(rid, arrival, tuple(range(prompt)), out, out)


def fake_sim(reqs: list[SimRequest], slots: int = 1, dt: float = 1.0) -> Simulation:
    return Simulation(lambda: FakeScheduler(slots), reqs, lambda plan: dt, metrics=FakeMetrics)


# ---------------------------------------------------------------- the loop on the fake
def test_ground_truth_is_exact_on_known_steps() -> None:
    sim = fake_sim([req("a", 0.0), req("b", 0.0)])
    sim.run_until(100)
    a, b = sorted(sim.records, key=lambda r: r.rid)
    assert (a.queue_time, a.ttft, a.finished) == (0.0, 1.0, 3.0)  # prefill [0,1], decode to 3
    assert (b.queue_time, b.ttft, b.finished) == (3.0, 4.0, 6.0)  # waited for the only slot
    st = sim.state()
    assert (st.ttft.n, st.ttft.total, st.queue_time.n, st.queue_time.total) == (2, 5.0, 2, 3.0)
    steps = sim.steps.arrays()
    assert len({len(v) for v in steps.values()}) == 1
    assert steps["blocked_on_kv"].tolist() == [True, True, True, False, False, False]
    assert steps["prefill"].tolist() == [True, False, False, True, False, False]
    assert st.requests_total == 2 and sim.ttft_quantile(1.0) == 4.0


def test_idle_time_is_skipped_and_run_until_stops_within_a_step() -> None:
    sim = fake_sim([req("late", 100.0, out=2)], dt=0.3)
    sim.run_until(50)
    assert sim.now == 50 and not sim.steps.start
    sim.run_until(100.4)
    assert sim.steps.start[0] == 100.0
    assert 100.4 <= sim.now < 100.4 + 0.3
    sim.run(10)
    assert sim.records[0].finished == pytest.approx(100.6)


def test_restart_loses_in_flight_requests_and_zeroes_counters() -> None:
    sim = fake_sim([req("a", 0.0, out=10), req("b", 0.5), req("c", 20.0)])
    sim.run_until(5)
    before = sim.state()
    assert before.ttft.n == 1
    sim.restart()
    lost = {r.rid: r for r in sim.records}
    assert lost["a"].finished is None and lost["a"].first_token == 1.0
    assert lost["b"].first_scheduled is None
    after = sim.state()
    assert after is not before and after.ttft.n == 0 and after.requests_total == 0
    assert after.created == EPOCH + sim.now and sim.restarts == [sim.now]
    sim.run_until(30)
    assert [r.rid for r in sim.records if r.finished is not None] == ["c"]
    assert sim.state().requests_total == 1


def test_exposition_renders_the_hook_state() -> None:
    sim = fake_sim([req("a", 0.0, out=50)])
    sim.run_until(3)
    fams = {f.name: f for f in text_string_to_metric_families(sim.exposition())}
    assert fams["vllm:num_requests_running"].samples[0].value == 1


# ---------------------------------------------------------------- roofline
def one(n: int, ctx: int) -> StepPlan:
    return StepPlan([ScheduledChunk(SimRequest("x", 0, (1,), 1, 1), n, ctx, n > 1)])


@pytest.mark.parametrize(("gpu", "floor_ms"), [("h100", 4.8), ("h200", 3.3)])
def test_decode_floor_worked_numbers(gpu: str, floor_ms: float) -> None:
    """Llama-3-8B bf16 reads its 16.1 GB of weights every decode step (facts §4)."""
    cost = Roofline("llama-3-8b", gpu, calibration=IDEAL).cost(one(1, 0))
    assert cost.seconds * 1e3 == pytest.approx(floor_ms, abs=0.05)
    assert not cost.compute_bound


def test_prefill_worked_numbers() -> None:
    """8192 tokens ≈ 1.32e14 linear + 1.8e13 attention FLOPs ≈ 0.15 s at 989 TF."""
    cost = Roofline("llama-3-8b", "h100", calibration=IDEAL).cost(one(8192, 0))
    assert cost.flops == pytest.approx(1.32e14 + 1.8e13, rel=0.02)
    assert cost.seconds == pytest.approx(0.15, rel=0.02)
    assert cost.compute_bound


def test_calibration_tp_and_moe() -> None:
    plan = StepPlan([ScheduledChunk(SimRequest("x", 0, (1,), 1, 1), 1, 2000, False)] * 64)
    ideal = Roofline("llama-3-70b", "h100", calibration=IDEAL)
    real = Roofline("llama-3-70b", "h100", calibration=Calibration(0.5, 0.5, 0.003))
    assert real.step_time(plan) == pytest.approx(2 * ideal.step_time(plan) + 0.003)
    tp8 = Roofline("llama-3-70b", "h100", tp=8, calibration=IDEAL).cost(plan)
    assert tp8.t_comm > 0 and tp8.seconds < ideal.step_time(plan) / 4
    # A single decode token of Mixtral reads 2 of 8 experts, a large batch reads them all.
    mixtral = Roofline("mixtral-8x7b", "h200", calibration=IDEAL)
    full = MODELS["mixtral-8x7b"].weight_bytes(2)
    assert mixtral.cost(one(1, 0)).bytes < 0.35 * full
    assert mixtral.cost(plan).bytes > 0.99 * full
    # MLA's latent is replicated across TP ranks: TP8 reads the same KV bytes per GPU.
    ds1, ds8 = Roofline("deepseek-v3", tp=1), Roofline("deepseek-v3", tp=8)
    assert ds1.kv_bytes_per_token == ds8.kv_bytes_per_token == MODELS["deepseek-v3"].kv_bytes_per_token(2)
    assert Roofline("llama-3-8b").step_time(StepPlan()) == 0.0


# ---------------------------------------------------------------- the reference engines
POOL = 20_000


def make_engine(engine: str) -> SGLangScheduler | VLLMScheduler:
    if engine == "sglang":
        return SGLangScheduler(max_total_num_tokens=POOL)
    return VLLMScheduler(num_gpu_blocks=POOL // 16 + 1)


def shared_prefix_sim(engine: str, rate: float, seed: int = 1) -> Simulation:
    wl = Workload(Poisson(rate), LogNormal(1000, 0.4, hi=4000), LogNormal(150, 0.5, hi=600), prefix=SharedPrefix(4, 0.7), seed=seed)
    return Simulation(lambda: make_engine(engine), wl.requests(), Roofline("llama-3-8b", "h100").step_time)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_shared_prefix_overload_pins_l1_and_p99_explodes(engine: str) -> None:
    """The seed's timeline: under load the pool is pinned at 1, admission blocks on KV, the queue
    grows, requests are evicted and recomputed, and P99 TTFT rises tenfold over a light load."""
    light = shared_prefix_sim(engine, rate=1.0).run(40)
    heavy = shared_prefix_sim(engine, rate=30.0).run(40)
    lt, hv = light.steps.arrays(), heavy.steps.arrays()
    assert lt["usage"].max() < 0.5 and not lt["blocked_on_kv"].any() and lt["evicted"].sum() == 0
    assert hv["usage"].max() >= 0.99
    assert hv["blocked_on_kv"].mean() > 0.5
    assert hv["evicted"].sum() > 0 and sum(r.evictions for r in heavy.records) > 0
    n = len(hv["waiting"])
    assert hv["waiting"][-n // 4 :].mean() > 4 * hv["waiting"][: n // 4].mean() > 0
    assert heavy.ttft_quantile(0.99) > 10 * light.ttft_quantile(0.99)
    state = heavy.state()
    assert state.evictions_total == int(hv["evicted"].sum())
    assert state.ttft.n >= sum(r.first_token is not None for r in heavy.records) > 0


def step_once(sim: Simulation) -> None:
    sim.run_until(sim.now + 1e-9)


def test_sglang_gauges_refresh_on_prefill_every_40_decodes_and_idle() -> None:
    sim = Simulation(
        lambda: SGLangScheduler(max_total_num_tokens=4096),
        [SimRequest("a", 0.0, tuple(range(32)), 100, 100)],
        lambda plan: 0.01,
    )
    stale = 0
    for _ in range(200):
        before = sim.state().used_tokens
        step_once(sim)
        truth = sim.steps.usage[-1] * 4096
        decodes = sim.scheduler.forward_ct_decode
        if sim.state().used_tokens != before:
            assert sim.steps.prefill[-1] or decodes % 40 == 0 or not sim.scheduler.has_work()
        stale += sim.state().used_tokens != round(truth)
        if not sim.scheduler.has_work():
            break
    assert stale > 50  # between refreshes the gauge lags the pool, as on a real SGLang
    assert sim.state().used_tokens == 0 and sim.state().running == 0  # idle publish


def test_vllm_gauges_follow_every_step_and_render_its_usage_convention() -> None:
    sim = shared_prefix_sim("vllm", rate=20.0)
    for _ in range(300):
        step_once(sim)
        st = sim.scheduler.stats()
        assert sim.state().used_tokens == (st.num_gpu_blocks - 1 - st.num_free_blocks) * st.block_size
    fams = {f.name: f for f in text_string_to_metric_families(sim.exposition())}
    st = sim.scheduler.stats()
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == pytest.approx(1 - st.num_free_blocks / (st.num_gpu_blocks - 1))
    assert fams["vllm:num_requests_waiting"].samples[0].value == st.num_requests_waiting


def test_sglang_exposition_rounds_token_usage_like_the_engine() -> None:
    sim = shared_prefix_sim("sglang", rate=20.0).run(10)
    st = sim.state()
    fams = {f.name: f for f in text_string_to_metric_families(sim.exposition())}
    assert fams["sglang:token_usage"].samples[0].value == round(st.used_tokens / POOL, 2)
    assert fams["sglang:num_queue_reqs"].samples[0].value == st.waiting


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_runs_on_real_kv_bytes_with_l2(engine: str) -> None:
    """Every write, prefix hit, demote and load back moves real bytes that the schedulers verify
    (debug mode, which also recounts the pool after every call: hence the small pool) while a
    shared-prefix load runs past L1."""
    pool, blocks = 3000, 3000 // 16 + 1
    store = KVStorage(SMALL_LAYOUT, blocks * 16, pool * 2 + 2, backend="numpy")
    if engine == "sglang":
        make = lambda: SGLangScheduler(max_total_num_tokens=pool, enable_hierarchical_cache=True, store=store, debug=True)  # noqa: E731
    else:
        make = lambda: VLLMScheduler(num_gpu_blocks=blocks, kv_offloading_blocks=blocks, store=store, debug=True)  # noqa: E731
    wl = Workload(Poisson(10), Fixed(300), Fixed(40), prefix=SharedPrefix(12, 0.8), seed=4)
    sim = Simulation(make, wl.requests(), Roofline("llama-3-8b").step_time).run(8)
    done = [r for r in sim.records if r.finished is not None]
    assert len(done) > 40
    assert sum(r.device_hit_tokens for r in done) > 0
    steps = sim.steps.arrays()
    assert steps["stored_tokens"].sum() > 0 and steps["loaded_tokens"].sum() > 0  # demoted and loaded back
    assert sum(r.host_hit_tokens for r in done) > 0


# ---------------------------------------------------------------- closed-loop clients
def test_closed_loop_clients_send_when_their_answer_returns() -> None:
    """Three clients, one slot, answers of 3 tokens (3 steps of 1 s), think 0.5 s: never more
    than three requests in flight, the queue stands at clients minus running, and each client's
    next request goes exactly think_s after its last one finished."""
    w = Workload(ClosedLoop(3, think_s=0.5, stagger_s=0.0), Fixed(4), Fixed(3), seed=1)
    sim = Simulation(lambda: FakeScheduler(1), w.requests(), lambda plan: 1.0, metrics=FakeMetrics)
    sim.run_until(60)
    steps = sim.steps.arrays()
    assert max(steps["running"] + steps["waiting"]) == 3 and max(steps["waiting"]) == 2
    by_client: dict[str, list] = {}
    for r in sim.records:
        by_client.setdefault(r.rid.split(".")[0], []).append(r)
    assert set(by_client) == {"c0", "c1", "c2"}
    for recs in by_client.values():
        recs.sort(key=lambda r: r.arrival)
        assert all(b.arrival == a.finished + 0.5 for a, b in zip(recs, recs[1:]) if a.finished is not None)
    assert len(sim.records) >= 15  # the loop keeps going: one slot, a request per 3 s


def test_a_restart_sends_the_lost_requests_clients_again() -> None:
    w = Workload(ClosedLoop(2, stagger_s=0.0), Fixed(4), Fixed(3), seed=1)
    sim = Simulation(lambda: FakeScheduler(1), w.requests(), lambda plan: 1.0, metrics=FakeMetrics)
    sim.run_until(4.5)
    sim.restart()
    sim.run_until(30)
    assert sum(r.finished is not None and r.arrival >= 4.5 for r in sim.records) >= 5
