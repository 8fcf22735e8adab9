"""Runs of identical decode steps taken at once on the vLLM reference scheduler.

A ``VLLMScheduler`` step in which every running request decodes one token, the queue admits
nobody (empty, at ``max_num_seqs``, or its head refused by ``allocate_slots``, which changes
nothing), nobody stops and every new block comes from the free queue without a preemption
only allocates a block where a request crosses a block boundary and caches a block where one
fills. Over ``k`` steps the free blocks only shrink and a waiting head's need cannot shrink
(a cached block it would hit can only be evicted, and counts as needed either way), so a head
refused at the first step is refused at every step. The block operations are replayed in the
normal order (step by step, running order within a step) through the manager's own methods, so
block ids, hashes and the cache's order are the same. Accounting-only runs without a CPU
offloading connector (whose stores follow full blocks); anything else takes the normal path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdiag.refpool.types import DecodeRun

if TYPE_CHECKING:
    from kvdiag.refpool.vllm.scheduler import VLLMScheduler


def _allocations(computed: list[int], steps: int, bs: int) -> int:
    """Blocks needed over ``steps`` decodes: request i allocates at step j iff
    ``(computed[i] + j) % bs == 0`` (its next token starts a new block)."""
    return sum((c + steps - 1) // bs - (c - 1) // bs for c in computed)


def decode_run(s: VLLMScheduler) -> DecodeRun | None:
    if s.debug or s.moves_bytes or s.connector is not None or s._pending is not None:
        return None
    running = s.running
    n = len(running)
    if n == 0 or n >= s.max_num_batched_tokens:
        return None
    # The run must stop before the first request does, and a run shorter than 2 steps is not
    # offered, so any request within 3 decodes of stopping refuses the run, as does any request
    # that prefills. Under load that is almost every step, so the scan returns at the first such
    # request, and goes from the tail of ``running``, where admitted (prefilling) requests are.
    k = max_model_len = s.max_model_len
    for r in reversed(running):
        sim = r.sim
        num_output = len(sim.output)
        if not num_output or r.num_computed_tokens != r.num_tokens - 1:
            return None  # someone prefills (or resumes) this step
        # _check_stop stops r after this many decodes (the last of them stops it).
        k = min(k, sim.max_new_tokens - num_output, sim.output_len - num_output, max_model_len - r.num_tokens)
        if k < 3:
            return None
    k -= 1
    blocked_on_kv = blocked_other = False
    if s.waiting:
        if n == s.max_num_seqs:
            blocked_other = True
        else:
            head = s.waiting.peek_request()
            adm = s._admission(head, s.max_num_batched_tokens - n, s._long_prefill_cap())
            if s.kv_cache_manager.fits(head, adm.num_new_tokens, **adm.slot_args):
                return None
            blocked_on_kv = True
    computed = [r.num_computed_tokens for r in running]
    free, bs = s.block_pool.get_num_free_blocks(), s.block_size
    lo, hi = 0, k  # the longest run whose allocations the free queue can serve
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _allocations(computed, mid, bs) <= free else (lo, mid - 1)
    if lo < 2:
        return None
    return DecodeRun(lo, n, sum(computed), blocked_on_kv, blocked_other)


def advance_decode(s: VLLMScheduler, steps: int) -> list[int]:
    kv, bs = s.kv_cache_manager, s.block_size
    running = list(s.running)
    computed = [r.num_computed_tokens for r in running]
    for r in running:  # tokens first: every block hash a step caches is then known
        for _ in range(steps):
            r.append_output_token_ids(r.sim.next_token())
    # Step 0 calls the manager for every request (it catches up any block left uncached);
    # later steps only where a request crosses a block boundary or fills a block.
    events = [(0, i) for i in range(len(running))]
    for i, c in enumerate(computed):
        for offset in (-c % bs, (-c - 1) % bs):
            events.extend((j, i) for j in range(offset or bs, steps, bs))
    events.sort()
    allocated = [0] * steps
    free0 = s.block_pool.get_num_free_blocks()
    for j, i in events:
        r, tokens = running[i], computed[i] + j + 1
        allocated[j] += len(kv._allocate_new_blocks(r.request_id, tokens))
        kv.cache_blocks(r, tokens)
    for r in running:
        r.num_computed_tokens += steps
    s.generation_tokens_total += len(running) * steps
    used, out = s.block_pool.num_gpu_blocks - 1 - free0, []
    for a in allocated:
        used += a
        out.append(used * bs)
    return out
