"""Fast-forwarded decode runs (``types.FastForward``) change nothing: the same per-request
ground truth, the same per-step log, the same counters and the same expositions, byte for byte,
as the step-by-step loop, on both engines, through admission blocks, a restart and DP."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import pytest

from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sim import Simulation, StepLog
from kvdiag.refpool.types import SimRequest
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.whatif.scale import scaled

CASES = [("sequence-cap", 150.0), ("restart", 260.0), ("near-capacity", 60.0), ("l1-saturation", 100.0)]


def run(name: str, duration: float, engine: str, fast: bool) -> tuple[ScenarioRun, list[str]]:
    r = ScenarioRun(replace(SCENARIOS[name], duration=duration), engine, fast=fast)
    return r, [scrape.body for _, scrape in r.scrapes(5.0)]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize(("name", "duration"), CASES)
def test_fast_forward_is_exact(name: str, duration: float, engine: str) -> None:
    (slow, slow_bodies), (fast, fast_bodies) = run(name, duration, engine, False), run(name, duration, engine, True)
    assert fast_bodies == slow_bodies
    for a, b in zip(slow.sims, fast.sims):
        assert sorted(a.records, key=lambda r: r.rid) == sorted(b.records, key=lambda r: r.rid)
        sa, sb = a.steps.arrays(), b.steps.arrays()
        assert all(np.array_equal(sa[k], sb[k]) for k in sa)
        assert a.state() == b.state()
        sched_a, sched_b = a.scheduler, b.scheduler
        if isinstance(sched_a, SGLangScheduler) and isinstance(sched_b, SGLangScheduler):
            assert sched_a.stats() == sched_b.stats() and sched_a.ratio.current == sched_b.ratio.current
            assert sched_a.allocator._free[sched_a.allocator._head :] == sched_b.allocator._free[sched_b.allocator._head :]
        elif isinstance(sched_a, VLLMScheduler) and isinstance(sched_b, VLLMScheduler):
            assert sched_a.stats() == sched_b.stats()
            ids = lambda s: [b.block_id for b in s.block_pool.free_block_queue.get_all_free_blocks()]  # noqa: E731
            assert ids(sched_a) == ids(sched_b)
            cached = lambda s: {h: [b.block_id for b in e] for h, e in s.block_pool.cached_block_hash_to_block.entries()}  # noqa: E731
            assert cached(sched_a) == cached(sched_b)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_fast_forward_is_exact_on_a_scale_model(engine: str) -> None:
    """A scale model times its steps with a stateful roofline (``ScaledRoofline`` averages the
    prefill beside vLLM's decodes): the loop times exactly the steps it takes, so its runs leave
    the average, and every exposition, as step by step."""
    scenario = scaled(replace(SCENARIOS["noisy-healthy"], duration=120.0), 2.0)  # runs cut to one step by arrivals
    slow, fast = (ScenarioRun(scenario, engine, fast=f) for f in (False, True))
    assert [b.body for _, b in fast.scrapes(5.0)] == [b.body for _, b in slow.scrapes(5.0)]
    assert sorted(slow.sims[0].records, key=lambda r: r.rid) == sorted(fast.sims[0].records, key=lambda r: r.rid)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_fast_forward_takes_runs(engine: str) -> None:
    """It is not vacuous: on a capped batch most steps are taken in runs."""
    fast, _ = run("sequence-cap", 60.0, engine, True)
    sim = fast.sims[0]
    sim.scheduler = runs = RunCounter(sim.scheduler)  # type: ignore[assignment]
    before = len(sim.steps.start)
    fast.advance(90.0)
    assert sum(runs.steps) > 0.5 * (len(sim.steps.start) - before) > 0


class RunCounter:
    """The scheduler as the engine loop sees it, counting the steps it takes in runs (a
    compiled scheduler's methods cannot be patched)."""

    def __init__(self, inner: SGLangScheduler | VLLMScheduler, log: StepLog | None = None) -> None:
        self.inner = inner
        self.steps: list[int] = []
        self.log = log  # the loop's per-step log: where each run's steps go (``starts``)
        self.starts: list[int] = []

    def advance_decode(self, steps: int) -> list[int]:
        self.steps.append(steps)
        if self.log is not None:
            self.starts.append(len(self.log.start))
        return self.inner.advance_decode(steps)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def lockstep_runs(make: Callable[[], SGLangScheduler | VLLMScheduler], reqs: list[SimRequest], seconds: float) -> tuple[Simulation, RunCounter]:
    """``reqs`` through a step-by-step loop and one taking decode runs: the same records, the
    same per-step log and the same exported state. The latter, and the steps it took in runs."""
    roofline = Roofline("llama-3-8b", "h200")
    sims, counter = [], None
    for fast in (False, True):
        sim = Simulation(
            make, [SimRequest(r.rid, r.arrival, r.prompt, r.max_new_tokens, r.output_len) for r in reqs],
            roofline.step_time, batch_time=roofline.batch_seconds if fast else None,
        )  # fmt: skip
        if fast:
            sim.scheduler = counter = RunCounter(sim.scheduler, sim.steps)  # type: ignore[arg-type,assignment]
        sims.append(sim.run(seconds))
    slow, fast_sim = sims
    assert sorted(slow.records, key=lambda r: r.rid) == sorted(fast_sim.records, key=lambda r: r.rid)
    sa, sb = slow.steps.arrays(), fast_sim.steps.arrays()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert slow.state() == fast_sim.state()
    assert counter is not None
    return fast_sim, counter


def test_arrivals_join_a_latched_queue_exactly() -> None:
    """SGLang's ``batch_is_full`` latch: requests that arrive during a decode run join the queue
    without ending it, and one the scheduler rejects outright (a prompt past its input limit)
    withdraws the offer and is finished by its own step, exactly as step by step."""
    rng = np.random.default_rng(3)
    reqs, t = [], 0.0
    for i in range(60):
        t += float(rng.exponential(0.05))
        size = 20_500 if i % 7 == 3 else 200  # every 7th is past max_req_input_len (19,994)
        reqs.append(SimRequest(f"q{i}", t, tuple(range(i * 100_000, i * 100_000 + size)), 300, 300))
    fast, counter = lockstep_runs(lambda: SGLangScheduler(max_total_num_tokens=20_000, max_running_requests=6), reqs, 60.0)
    assert sum(r.finished is not None and r.first_token is None for r in fast.records) >= 5  # the rejected ones
    assert sum(counter.steps) > 0.5 * len(fast.steps.start)  # runs were taken, through arrivals


def test_arrivals_join_a_queue_held_by_max_num_seqs_exactly() -> None:
    """vLLM: with ``max_num_seqs`` requests running, the queue is refused before any lookup, so
    requests arriving during a decode run join it without ending it; requests that share a
    prompt hit the blocks the first ones cached."""
    rng = np.random.default_rng(5)
    reqs, t = [], 0.0
    for i in range(80):
        t += float(rng.exponential(0.03))
        prompt = tuple(range(7, 7 + 64)) + tuple(range(i * 1_000, i * 1_000 + int(rng.integers(1, 200))))
        reqs.append(SimRequest(f"q{i}", t, prompt, 200, int(rng.integers(20, 200))))
    fast, counter = lockstep_runs(lambda: VLLMScheduler(num_gpu_blocks=400, max_num_seqs=6), reqs, 60.0)
    assert len(fast.records) == len(reqs) and sum(counter.steps) > 0.5 * len(fast.steps.start)
    waiting = fast.steps.waiting
    joined = [k for i, n in zip(counter.starts, counter.steps) for k in range(i + 1, i + n) if waiting[k] > waiting[k - 1]]
    assert len(joined) >= 10  # steps inside runs that a request arrived at and joined the queue
