"""SGLang admission: the new-token ratio, ``PrefillBudget`` and ``PrefillAdder``.

Mirrors ``managers/scheduler_components/new_token_ratio_tracker.py``,
``mem_cache/prefill_budget.py: PrefillBudget`` and ``managers/schedule_policy.py: PrefillAdder``
as pinned in facts/engine-mechanics.md §1.3-1.4. SGLang admits against L1 counters only:

    remaining_total = available + evictable - total_offset
    total_offset    = sum over running requests of min(max_new - len(output), 4096) x ratio
                      + per admitted request: ceil_page(extend) + page + clip(max_new)

and a request is admitted only if ``extend + min(max_new - len(output), 4096) + page <
remaining_total`` (strict), with its matched prefix temporarily locked so that prefix does not
count as reclaimable. The ratio discounts only already-running requests' remaining output.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from kvdiag.refpool.sglang.hicache import HiRadixCache
from kvdiag.refpool.sglang.radix_cache import RadixCache, TreeNode
from kvdiag.refpool.sglang.schedule_batch import Req

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # keep adding requests
    NO_TOKEN = enum.auto()  # out of KV budget
    OTHER = enum.auto()  # another cap: prefill token budget, chunk budget


class NewTokenRatioTracker:
    """How much of running requests' remaining output admission reserves.

    Starts at ``init``, decays linearly to ``min`` over 600 non-retracting decode steps, jumps to
    an estimate after a retraction, and returns to ``init`` only when the engine is fully idle.
    """

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.current = self.init

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)

    @staticmethod
    def estimate_after_retract(kept_reqs: list[Req]) -> float:
        """``(sum len(output) + 20 x n) / (sum max_new_tokens + 1)``, capped at 1, over kept requests."""
        decoded = sum(len(r.output_ids) for r in kept_reqs)
        max_new = sum(r.max_new_tokens for r in kept_reqs)
        return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept_reqs)) / (max_new + 1))

    def reset(self) -> None:
        self.current = self.init


def running_output_offset(
    remaining: Sequence[int] | np.ndarray, in_full: Sequence[bool] | np.ndarray, ratio: float, clip: int = CLIP_MAX_NEW_TOKENS
) -> float:
    """``sum(_get_running_request_total_token_offset(r) for r in running)``: each running
    request's remaining output clipped at ``clip`` (4096 unless SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    says), times the ratio (in full with ignore_eos).

    It runs over the whole running batch on every prefill attempt, so the terms are computed
    at once (numpy's float64 products are Python's) and still added by ``sum()`` one by one in
    batch order, so the float is SGLang's on every Python (3.12's ``sum()`` compensates
    rounding, numpy's pairwise sum would not).
    """
    clipped = np.minimum(np.asarray(remaining, dtype=np.int64), clip)
    return sum((clipped * np.where(np.asarray(in_full, dtype=bool), 1.0, ratio)).tolist())


class PrefillBudget:
    """KV reservations of one scheduling pass against the live pool counters."""

    def __init__(self, tree_cache: RadixCache, num_mixed_decode_tokens: int = 0) -> None:
        self.tree_cache = tree_cache
        self.page_size = tree_cache.page_size
        self.total_offset = float(num_mixed_decode_tokens)
        self.current_offset = float(num_mixed_decode_tokens)

    def ceil_paged_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def _available_and_evictable(self) -> int:
        tree = self.tree_cache
        return tree.token_to_kv_pool_allocator.available_size() + tree.evictable_size()

    @property
    def remaining_total(self) -> float:
        """``rem_total_tokens``: room left once every reservation is honoured."""
        return self._available_and_evictable() - self.total_offset

    @property
    def remaining_current(self) -> float:
        """``cur_rem_tokens``: room left for this pass's immediate allocations."""
        return self._available_and_evictable() - self.current_offset

    def has_capacity(self) -> bool:
        return self.remaining_total > 0 and self.remaining_current > 0

    def reserve(self, extend_input_len: int, max_new_tokens: int) -> None:
        immediate = self.ceil_paged_tokens(extend_input_len) + self.page_size
        self.total_offset += immediate + max_new_tokens
        self.current_offset += immediate


class PrefillAdder:
    """Builds one prefill batch in queue order (``schedule_policy.PrefillAdder``)."""

    def __init__(
        self,
        tree_cache: RadixCache,
        running_reqs: list[Req],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        running_offset: float | None = None,
        clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS,
    ) -> None:
        """``running_offset``: the running requests' reservation (``running_output_offset``),
        where the caller knows it better than their outputs do (batch-level decode appends
        them late). ``clip_max_new_tokens``: the most output any request is charged
        (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, read once by SGLang's schedule_policy)."""
        self.clip = clip_max_new_tokens
        self.tree_cache = tree_cache
        self.page_size = tree_cache.page_size
        self.rem_input_tokens = rem_input_tokens
        self.rem_chunk_tokens = rem_chunk_tokens
        self.memory_budget = PrefillBudget(tree_cache)
        if running_offset is None:
            remaining = [r.max_new_tokens - len(r.sim.output) for r in running_reqs]
            running_offset = running_output_offset(remaining, [r.sim.ignore_eos for r in running_reqs], new_token_ratio, self.clip)
        self.memory_budget.total_offset += running_offset
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        # Hit accounting of this batch (cache_hit_rate, prefill_effective_tokens_total).
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        self.reprocessed_log_hit_tokens = 0
        self.reprocessed_log_input_tokens = 0
        self.log_device_hit_tokens = 0
        self.log_host_hit_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        return self.memory_budget.remaining_total

    def ceil_paged_tokens(self, tokens: int) -> int:
        return self.memory_budget.ceil_paged_tokens(tokens)

    def budget_state(self) -> AddReqResult:
        if not self.memory_budget.has_capacity():
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _update_prefill_budget(self, req: Req, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        paged = self.ceil_paged_tokens(extend_input_len)
        self.memory_budget.reserve(paged, max_new_tokens)
        self.rem_input_tokens -= paged
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= paged
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len
        if req.retracted_stain:
            self.reprocessed_log_hit_tokens += prefix_len
            self.reprocessed_log_input_tokens += extend_input_len
        elif prefix_len:
            self.log_device_hit_tokens += prefix_len - req.host_loaded_length
            self.log_host_hit_tokens += req.host_loaded_length

    def add_chunked_req(self, req: Req) -> Req | None:
        """Next chunk of the in-flight chunked request; runs before the waiting queue.

        Returns the request while its prompt is still unfinished, else None. With no budget left
        it still takes a full chunk, so the request can finish and release its KV.
        """
        assert self.rem_chunk_tokens is not None
        rem_tokens = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        if rem_tokens <= 0:
            rem_tokens = self.rem_chunk_tokens
        req.prefix_indices = list(req.kv_indices)
        cand = req.fill_len - len(req.prefix_indices)
        truncated = cand > rem_tokens
        req.extend_input_len = min(cand, rem_tokens)
        self.can_run_list.append(req)
        max_new = 0 if truncated else min(req.max_new_tokens, self.clip)
        self._update_prefill_budget(req, 0, req.extend_input_len, max_new)
        return req if truncated else None

    @contextmanager
    def _lock_node(self, node: TreeNode) -> Iterator[None]:
        """Pin a matched prefix during the check so it stops counting as evictable."""
        self.tree_cache.inc_lock_ref(node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(node)

    def add_one_req(self, req: Req) -> AddReqResult:
        """Try to admit ``req`` (already matched by ``init_next_round_input``)."""
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        # Host-hit tokens are not subtracted: a load back needs device slots too.
        total_tokens = req.extend_input_len + max_new + self.page_size
        assert req.last_node is not None
        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if req.host_hit_length > 0 and isinstance(self.tree_cache, HiRadixCache):
                assert req.last_host_node is not None
                loaded = self.tree_cache.load_back(req.last_host_node)
                if loaded is not None:
                    req.prefix_indices = req.prefix_indices + loaded
                    req.last_node = req.last_host_node
                    req.host_loaded_length = len(loaded)
                    req.extend_input_len = req.fill_len - len(req.prefix_indices)
            prefix_len = len(req.prefix_indices)
            input_tokens = self.ceil_paged_tokens(req.extend_input_len)
            if self.rem_chunk_tokens is None:
                # Without chunking the first request may exceed max_prefill_tokens.
                if self.can_run_list and input_tokens >= self.rem_input_tokens:
                    return AddReqResult.OTHER
                max_new_reserved = min(req.max_new_tokens, self.clip)
            elif input_tokens <= self.rem_chunk_tokens:
                max_new_reserved = min(req.max_new_tokens, self.clip)
            else:
                trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
                end = (prefix_len + trunc_len) // self.page_size * self.page_size
                if end - prefix_len <= 0:
                    return AddReqResult.OTHER
                req.extend_input_len = end - prefix_len
                self.new_chunked_req = req
                max_new_reserved = 0  # a chunk that does not finish the prompt reserves no output
            self.tree_cache.inc_lock_ref(req.last_node)
            self.can_run_list.append(req)
            self._update_prefill_budget(req, prefix_len, req.extend_input_len, max_new_reserved)
        return self.budget_state()
