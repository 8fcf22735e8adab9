"""vLLM V1 ``KVCacheManager`` for one full-attention group (facts §2.3).

Mirrors ``vllm/v1/core/kv_cache_manager.py`` together with the full-attention
``SingleTypeKVCacheManager`` in ``vllm/v1/core/single_type_kv_cache_manager.py`` (which owns
``req_to_blocks`` / ``num_cached_block``); with a single group the coordinator layer in between
is a pass-through and is folded in here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.refpool.vllm.block_pool import BlockPool, KVCacheBlock
from kvdiag.refpool.vllm.request import Request, RequestStatus


_RUNNING = RequestStatus.RUNNING  # a module global: read per running request per step


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counters behind ``vllm:prefix_cache_queries/hits`` (``vllm/v1/metrics/stats.py``).

    Requests resumed after a preemption are tallied apart (``preempted_*``) and are not part of the
    exported counters, so a recompute storm does not inflate the hit rate.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """Prefix lookup, slot allocation and freeing on top of a ``BlockPool``."""

    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int = 16,
        watermark: float = 0.0,
        max_model_len: int = 32768,
    ) -> None:
        if watermark < 0.0:
            raise ValueError("watermark must be non-negative")
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = block_pool.enable_caching
        self.max_model_len = max_model_len
        # Minimum free blocks kept when admitting waiting/preempted requests (default 0: off).
        self.watermark_blocks = int(watermark * block_pool.num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request that are already cached (hashed).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix hit over full blocks, walking the block-hash chain.

        The hit is capped at ``num_tokens - 1``: the last token is always recomputed to get
        logits, which can cost a whole block when the prompt is block aligned.
        """
        if not self.enable_caching:
            return [], 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = self.block_pool.longest_cache_hit(
            request, request.block_hashes, max_cache_hit_length // self.block_size
        )
        return computed_blocks, len(computed_blocks) * self.block_size

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count a lookup in ``vllm:prefix_cache_*``; the scheduler calls this at admission, so a
        head-of-line request retried every step is counted once ("Record at admission so
        unscheduled lookups are not counted", ``sched/scheduler.py``)."""
        if not self.enable_caching:
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: list[KVCacheBlock]
    ) -> int:
        """Blocks the free pool must supply to hold ``num_tokens``.

        A prefix-hit block that is currently free (ref_cnt 0, in the free queue) leaves the free
        pool when touched, so it counts toward the need exactly like a new block.
        """
        return -(-num_tokens // self.block_size) - self._blocks_in_hand(request_id, new_computed_blocks)  # cdiv

    def _blocks_in_hand(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> int:
        """The blocks toward a request's need that the free pool does not supply: those it holds
        and its hits that someone else holds (``get_num_blocks_to_allocate``'s subtrahend, once
        for both of admission's checks: it walks every hit)."""
        held = len(new_computed_blocks) + len(self.req_to_blocks.get(request_id, ()))
        if not new_computed_blocks:  # a running request's step: no hits to adopt
            return held
        return held - sum(1 for blk in new_computed_blocks if blk.ref_cnt == 0 and not blk.is_null)

    def fits(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed (it changes nothing)."""
        _, _, num_tokens_need_slot = self._layout(
            request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens
        )
        return self._fits(request, num_tokens_need_slot, new_computed_blocks or [], full_sequence_must_fit, has_scheduled_reqs)

    def _layout(
        self, request: Request, num_new_tokens: int, num_new_computed_tokens: int, num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> tuple[int, int, int]:
        """(local computed, total computed, tokens that need a slot) along ``allocate_slots``'
        layout, each capped at ``max_model_len``."""
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens + num_external_computed_tokens, self.max_model_len)
        num_tokens_need_slot = min(total_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        return num_local_computed_tokens, total_computed_tokens, num_tokens_need_slot

    def _fits(
        self,
        request: Request,
        num_tokens_need_slot: int,
        hits: list[KVCacheBlock],
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
        reserved_blocks: int = 0,
    ) -> bool:
        """``fits`` once the slots needed are known (``allocate_slots`` derives them only once).
        ``reserved_blocks`` stay free for in-flight prefills (the slots themselves, not the full
        sequence gate)."""
        # The watermark applies to waiting/preempted requests only, and only when something is
        # already scheduled (so an empty engine can always admit its first request).
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        free, bs = self.block_pool.get_num_free_blocks(), self.block_size
        in_hand = self._blocks_in_hand(request.request_id, hits)
        if full_sequence_must_fit:
            # Admission gate (scheduler_reserve_full_isl): the whole current sequence must fit,
            # not just the first chunk.
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            if -(-full_num_tokens // bs) - in_hand + watermark_blocks > free:
                return False
        need = -(-num_tokens_need_slot // bs) - in_hand  # get_num_blocks_to_allocate
        return need + watermark_blocks <= free - reserved_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
        has_scheduled_reqs: bool = True,
        reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Reserve slots for ``num_new_tokens`` (plus prefix hits and external tokens); None if
        the pool cannot supply them (``fits``). Returns the newly allocated blocks.

        Layout: | comp | new_comp (local hits) | ext_comp (connector) | new | lookahead |.
        Blocks for ext_comp are allocated here, *before* the connector copies into them.
        ``reserved_blocks`` must stay free beside the new slots: an asynchronous load holds its
        blocks with no progress, so it may not take what in-flight prefills still need.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no external computed tokens")
        # Fast path for a running request's step whose tokens fit in the blocks it already holds
        # (every decode step but one per block): the general path below would find the step fits
        # (nothing to allocate, and a RUNNING request is not held to the watermark) and allocate
        # nothing, so only its caching remains. Same result and side effects, a fraction of the
        # work; it runs per running request per step.
        if (
            request.status is _RUNNING
            and not new_computed_blocks
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
            and num_lookahead_tokens == 0
            and not full_sequence_must_fit
        ):
            req_blocks = self.req_to_blocks.get(request.request_id)
            end = request.num_computed_tokens + num_new_tokens
            if req_blocks is not None and end <= len(req_blocks) * self.block_size and end <= self.max_model_len:
                if self.enable_caching and not delay_cache_blocks:
                    self.cache_blocks(request, min(end, request.num_tokens))
                return []
        hits = new_computed_blocks or []
        num_local_computed_tokens, total_computed_tokens, num_tokens_need_slot = self._layout(
            request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens
        )
        if not self._fits(
            request, num_tokens_need_slot, hits, full_sequence_must_fit, has_scheduled_reqs, reserved_blocks
        ):
            return None
        if hits or num_external_computed_tokens > 0:
            self._allocate_new_computed_blocks(
                request.request_id, hits, num_local_computed_tokens, num_external_computed_tokens
            )
        new_blocks = self._allocate_new_blocks(request.request_id, num_tokens_need_slot)

        if not self.enable_caching or delay_cache_blocks:
            return new_blocks
        # Cache full blocks up to the tokens computed by the end of this step; never beyond
        # num_tokens (unverified draft tokens are not committed).
        self.cache_blocks(request, min(total_computed_tokens + num_new_tokens, request.num_tokens))
        return new_blocks

    def _allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: list[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt the hit blocks (touch) and allocate GPU blocks for the external tokens."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"{request_id}: prefix hits for a request that already holds blocks"
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        if num_external_computed_tokens > 0:
            num_total = num_local_computed_tokens + num_external_computed_tokens
            num_new_blocks = cdiv(num_total, self.block_size) - len(req_blocks)
            req_blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))

    def _allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)  # cdiv, inlined: runs per request per step
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and index the request's blocks that are full within ``num_tokens``."""
        num_full_blocks = num_tokens // self.block_size
        if not self.enable_caching or num_full_blocks == 0:
            return
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        if num_cached_blocks >= num_full_blocks:
            return
        blocks, bs = self.req_to_blocks[request.request_id], self.block_size
        self.block_pool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, bs)
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, in reverse order so that its tail blocks are
        evicted before its head blocks (heads are the likelier shared prefix)."""
        req_blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request.request_id, None)

    def check_invariants(self, requests: dict[str, Request]) -> None:
        """Each block's ref_cnt equals the number of block tables holding it; tables hold no block
        twice and never the null block; a running request's table covers its computed tokens and
        no more than its sequence; cached leading blocks carry the request's own hashes."""
        self.block_pool.check_invariants()
        bs = self.block_size
        holders: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            block_ids = [b.block_id for b in blocks]
            assert len(set(block_ids)) == len(block_ids), f"{rid} holds a block twice: {block_ids}"
            assert not any(b.is_null for b in blocks), f"{rid} holds the null block"
            for i in block_ids:
                holders[i] = holders.get(i, 0) + 1
            request = requests.get(rid)
            # Running, or waiting with its blocks held for an asynchronous load (the scheduler
            # checks which queue may hold blocks).
            assert request is not None, f"{rid} holds blocks and is not live"
            assert cdiv(request.num_computed_tokens, bs) <= len(blocks) <= cdiv(request.num_tokens, bs), (
                f"{request}: {len(blocks)} blocks"
            )
            n_cached = self.num_cached_block.get(rid, 0)
            assert n_cached <= len(blocks), f"{rid}: num_cached_block {n_cached} > {len(blocks)} blocks"
            if self.enable_caching:
                for i in range(n_cached):
                    assert blocks[i].block_hash == request.block_hashes[i], f"{rid}: block {i} hash differs"
        for b in self.block_pool.blocks[1:]:
            n = holders.get(b.block_id, 0)
            assert b.ref_cnt == n, f"{b}: ref_cnt != {n} tables holding it"
