"""One engine step on two schedulers in lockstep: one accounting decodes batch-wise, one step by
step (the batch-decode tests of both engines hold the fast path to the step-by-step one)."""

from __future__ import annotations

from typing import Any, Callable

from kvdiag.refpool.types import EngineScheduler, StepPlan


def lockstep_step(
    fast: EngineScheduler, slow: EngineScheduler, t: int, state: Callable[[Any], tuple], done: dict[str, list]
) -> tuple[StepPlan, StepPlan]:
    """Step both at ``t``; record their finished requests (rid, evictions, output) in ``done``;
    require the same plan totals (a batch-wise decode counts as a one-token chunk) and the same
    ``state`` after the step."""
    plans = []
    for name, s in (("fast", fast), ("slow", slow)):
        plan = s.schedule(float(t))
        plans.append(plan)
        done[name] += [(r.rid, r.evictions, list(r.output)) for r in s.update_from_output(plan, float(t))]
    pf, ps = plans
    assert pf.decode_batch + len(pf.chunks) == len(ps.chunks) and pf.idle == ps.idle
    assert pf.decode_context + sum(c.num_context_tokens for c in pf.chunks) == sum(c.num_context_tokens for c in ps.chunks)
    assert [r.rid for r in pf.evicted] == [r.rid for r in ps.evicted]
    assert state(fast) == state(slow), f"step {t}"
    return pf, ps
