"""Runs of identical decode steps taken at once on the SGLang reference scheduler.

A decode iteration of ``SGLangScheduler`` with no prefill to form (empty queue, or the
``batch_is_full`` latch refusing it before any radix match), no request finishing, no report
due and enough free slots (no eviction, no free-list merge) only appends one token and one slot
per running request and decays the new-token ratio. ``k`` such iterations are that, ``k`` times,
in the same order: slots are popped step by step, request by request, so request ``i`` of ``n``
gets slots ``i, i + n, i + 2n, ...`` of one ``alloc(n * k)``. It needs the batch-level decode
accounting (``enable_batch_decode``: accounting-only, page size 1), whose stop heap says when the
first request finishes and whose outputs are appended where they are read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdiag.refpool.types import DecodeRun

if TYPE_CHECKING:
    from kvdiag.refpool.sglang.scheduler import SGLangScheduler


def decode_run(s: SGLangScheduler) -> DecodeRun | None:
    if not s.batch_decode or s.chunked_req is not None or s.last_batch or s._aborted or s._filter_due:
        return None  # (a request released is still listed: the next step filters the batch)
    queued = bool(s.waiting_queue)
    if queued and not s.batch_is_full:
        return None  # the next step tries admission (radix matches move LRU times)
    batch = s.running_batch
    if not batch:
        return None
    n = len(batch)
    steps_to_report = s.decode_log_interval - s.forward_ct_decode % s.decode_log_interval
    k = min(steps_to_report, s.allocator.num_free_pages() // n + 1)
    stop = s.next_stop()
    if stop is not None:
        k = min(k, stop - s.forward_ct_decode)  # the run ends before the step that finishes a request
    if k < 3:
        return None  # too short a run
    on_kv = queued and s._batch_full_on_kv
    # The k-th step is not a plain one: it publishes a report, merges the free list or finishes a request.
    return DecodeRun(k - 1, n, s._decode_context, on_kv, queued and not on_kv, len(s.waiting_queue), queued and s.batch_is_full)


def advance_decode(s: SGLangScheduler, steps: int) -> list[int]:
    batch = s.running_batch
    n = len(batch)
    used = s.max_total_num_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
    slots = s.allocator.alloc(n * steps)  # page size 1: the same slots as n * steps alloc(1) calls
    assert slots is not None, "decode_run promised free slots"
    for i, req in enumerate(batch):
        req.kv_indices.extend(slots[i::n])
    for _ in range(steps):
        s.ratio.decay_step()
    s.forward_ct_decode += steps
    s._decode_context += n * steps
    return [used + n * (j + 1) for j in range(steps)]
