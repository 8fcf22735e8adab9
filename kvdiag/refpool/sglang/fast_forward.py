"""Runs of identical decode steps taken at once on the SGLang reference scheduler.

A decode iteration of ``SGLangScheduler`` with no prefill to form (empty queue, or the
``batch_is_full`` latch refusing it before any radix match), no request finishing, no report
due and enough free slots (no eviction, no free-list merge) only appends one token and one slot
per running request and decays the new-token ratio. ``k`` such iterations are that, ``k`` times,
in the same order: slots are popped step by step, request by request, so request ``i`` of ``n``
gets slots ``i, i + n, i + 2n, ...`` of one ``alloc(n * k)``. Accounting-only runs with page size 1
(no KV bytes to write, no page tails to fill); anything else takes the normal path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdiag.refpool.types import DecodeRun

if TYPE_CHECKING:
    from kvdiag.refpool.sglang.scheduler import SGLangScheduler


def decode_run(s: SGLangScheduler) -> DecodeRun | None:
    if s.debug or s.moves_bytes or s.page_size != 1 or s.chunked_req is not None or s.last_batch or s._aborted:
        return None
    queued = bool(s.waiting_queue)
    if queued and not s.batch_is_full:
        return None  # the next step tries admission (radix matches move LRU times)
    batch = s.running_batch
    if not batch:
        return None
    n = len(batch)
    steps_to_report = s.decode_log_interval - s.forward_ct_decode % s.decode_log_interval
    k = min(steps_to_report, s.allocator.num_free_pages() // n + 1)
    if k < 3:
        return None  # too short a run
    # One pass over the batch (this runs before nearly every step): the run ends before the step
    # that finishes a request, and at least 2 steps must be left. A request already released is
    # still listed with no tokens left, so it ends the scan too: the next step filters the batch
    # (and may reset the latch).
    context_tokens = 0
    for r in batch:
        sim = r.sim
        stop = sim.output_len  # should_finish holds from min(output_len, max_new_tokens) tokens
        if r.max_new_tokens < stop:
            stop = r.max_new_tokens  # (compared, not min(): a builtin call per request costs more)
        left = stop - len(sim.output)
        if left < 3:
            return None
        if left < k:
            k = left
        context_tokens += len(r.kv_indices)
    on_kv = queued and s._batch_full_on_kv
    # The k-th step is not a plain one: it publishes a report, merges the free list or finishes a request.
    return DecodeRun(k - 1, n, context_tokens, on_kv, queued and not on_kv)


def advance_decode(s: SGLangScheduler, steps: int) -> list[int]:
    batch = s.running_batch
    n = len(batch)
    used = s.max_total_num_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
    slots = s.allocator.alloc(n * steps)  # page size 1: the same slots as n * steps alloc(1) calls
    assert slots is not None, "decode_run promised free slots"
    for i, req in enumerate(batch):
        req.kv_indices.extend(slots[i::n])
        sim = req.sim
        for _ in range(steps):
            sim.output.append(sim.next_token())
    for _ in range(steps):
        s.ratio.decay_step()
    s.forward_ct_decode += steps
    return [used + n * (j + 1) for j in range(steps)]
