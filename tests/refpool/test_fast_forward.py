"""Fast-forwarded decode runs (``types.FastForward``) change nothing: the same per-request
ground truth, the same per-step log, the same counters and the same expositions, byte for byte,
as the step-by-step loop, on both engines, through admission blocks, a restart and DP."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sim import Simulation
from kvdiag.refpool.types import SimRequest
from kvdiag.refpool.vllm.scheduler import VLLMScheduler

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


def test_fast_forward_takes_runs() -> None:
    """It is not vacuous: on a capped batch most steps are taken in runs."""
    fast, _ = run("sequence-cap", 60.0, "sglang", True)
    sim = fast.sims[0]
    assert isinstance(sim.scheduler, SGLangScheduler)
    sim.scheduler = runs = RunCounter(sim.scheduler)  # type: ignore[assignment]
    before = len(sim.steps.start)
    fast.advance(90.0)
    assert sum(runs.steps) > 0.5 * (len(sim.steps.start) - before) > 0


class RunCounter:
    """The scheduler as the engine loop sees it, counting the steps it takes in runs (a
    compiled scheduler's methods cannot be patched)."""

    def __init__(self, inner: SGLangScheduler) -> None:
        self.inner = inner
        self.steps: list[int] = []

    def advance_decode(self, steps: int) -> list[int]:
        self.steps.append(steps)
        return self.inner.advance_decode(steps)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_arrivals_join_a_latched_queue_exactly() -> None:
    """SGLang's ``batch_is_full`` latch: requests that arrive during a decode run join the queue
    without ending it, and one the scheduler rejects outright (a prompt past its input limit)
    withdraws the offer and is finished by its own step, exactly as step by step."""
    roofline = Roofline("llama-3-8b", "h200")
    rng = np.random.default_rng(3)

    def requests() -> list[SimRequest]:
        out, t = [], 0.0
        for i in range(60):
            t += float(rng.exponential(0.05))
            size = 20_500 if i % 7 == 3 else 200  # every 7th is past max_req_input_len (19,994)
            out.append(SimRequest(f"q{i}", t, tuple(range(i * 100_000, i * 100_000 + size)), 300, 300))
        return out

    reqs = requests()
    sims = []
    for fast in (False, True):
        sim = Simulation(
            lambda: SGLangScheduler(max_total_num_tokens=20_000, max_running_requests=6),
            [SimRequest(r.rid, r.arrival, r.prompt, r.max_new_tokens, r.output_len) for r in reqs],
            roofline.step_time, batch_time=roofline.batch_seconds if fast else None,
        )  # fmt: skip
        if fast:
            assert isinstance(sim.scheduler, SGLangScheduler)
            sim.scheduler = counter = RunCounter(sim.scheduler)  # type: ignore[assignment]
        sims.append(sim.run(60.0))
    slow, fast_sim = sims
    assert sorted(slow.records, key=lambda r: r.rid) == sorted(fast_sim.records, key=lambda r: r.rid)
    assert sum(r.finished is not None and r.first_token is None for r in fast_sim.records) >= 5  # the rejected ones
    sa, sb = slow.steps.arrays(), fast_sim.steps.arrays()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    assert slow.state() == fast_sim.state()
    assert sum(counter.steps) > 0.5 * len(sb["start"])  # runs were taken, through arrivals
