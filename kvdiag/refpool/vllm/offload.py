"""Native CPU KV offloading (L2) with the ``OffloadingConnector`` semantics (facts §2.6).

Mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``
(``OffloadingConnectorScheduler``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta`` / ``_get_reqs_to_store``, ``request_finished``), its worker side
(``start_load_kv``, ``wait_for_save``) and ``vllm/v1/kv_offload/cpu/manager.py`` with the default
LRU policy (``cpu/policies/lru.py``), for one offloaded block per GPU block (``blocks_per_chunk`` 1).

What matters for the diagnosis, and is modelled exactly:

* write-through: every scheduled request's newly completed full *prompt* blocks are stored D->H
  after the forward of the step that completed them (``offload_prompt_only``, default True in
  0.33.0: blocks of decoded tokens are never offloaded); GPU eviction never triggers a copy;
* the CPU pool evicts LRU ready blocks only when a store needs room; blocks being loaded are pinned;
* a CPU hit never helps admission: ``allocate_slots`` must first allocate GPU blocks for the hit
  tokens, and only then are they copied H->D into those blocks;
* loads are asynchronous unless they fit the step's sync-load budget (``sync_load_budget_bytes``,
  0 by default: every load asynchronous), as ``_reserve_sync_load`` decides. A synchronous load is
  copied before the forward of the step that admitted the request, which computes its first chunk
  in that step. An asynchronous one parks the request in ``WAITING_FOR_REMOTE_KVS`` with its GPU
  blocks held and not cached; the worker completes it within the step (``start_load_kv`` reports
  it, ``finished_recving``) and the scheduler schedules the request from the next step on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvdiag.refpool.types import KVStore
from kvdiag.refpool.vllm.block_pool import KVCacheBlock
from kvdiag.refpool.vllm.request import Request


@dataclass
class CPUBlockStatus:
    """One CPU block. ref_cnt -1: store in flight (not readable, not evictable); 0: ready and
    evictable; > 0: pinned by that many loads."""

    block_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


@dataclass
class PrepareStoreOutput:
    block_hashes_to_store: list[int]
    store_block_ids: list[int]  # CPU block ids, parallel to block_hashes_to_store
    block_hashes_evicted: list[int]


class CPUOffloadingManager:
    """CPU block pool with LRU eviction (``CPUOffloadingManager`` + ``LRUCachePolicy``)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._num_allocated_blocks = 0
        self._free_list: list[int] = []
        # Oldest first; touch() moves to the end.
        self.blocks: OrderedDict[int, CPUBlockStatus] = OrderedDict()
        self.num_evicted_blocks = 0

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        return len(self._free_list) + self.num_blocks - self._num_allocated_blocks

    def lookup(self, block_hashes: list[int]) -> int:
        """Number of leading ``block_hashes`` present and ready on CPU."""
        hits = 0
        for block_hash in block_hashes:
            block = self.blocks.get(block_hash)
            if block is None or not block.is_ready:
                break
            hits += 1
        return hits

    def touch(self, block_hashes: list[int]) -> None:
        """Mark as most recently used; the first block ends up most recent (evicted last)."""
        for block_hash in reversed(block_hashes):
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)

    def prepare_load(self, block_hashes: list[int]) -> list[int]:
        """Pin the blocks for a load and return their CPU block ids."""
        ids = []
        for block_hash in block_hashes:
            block = self.blocks[block_hash]
            assert block.is_ready, f"CPU block {block_hash:#x} is not ready for reading"
            block.ref_cnt += 1
            ids.append(block.block_id)
        return ids

    def complete_load(self, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            block = self.blocks[block_hash]
            assert block.ref_cnt > 0
            block.ref_cnt -= 1

    def prepare_store(self, block_hashes: list[int]) -> PrepareStoreOutput | None:
        """Allocate CPU blocks for the hashes not stored yet, evicting LRU ready blocks (never one
        of ``block_hashes``) if the pool is short; None if not enough blocks can be evicted."""
        to_store = [h for h in block_hashes if h not in self.blocks]
        num_to_evict = len(to_store) - self.get_num_free_blocks()
        evicted: list[int] = []
        if num_to_evict > 0:
            protected = set(block_hashes)
            for block_hash, block in self.blocks.items():
                if block.ref_cnt == 0 and block_hash not in protected:
                    evicted.append(block_hash)
                    if len(evicted) == num_to_evict:
                        break
            if len(evicted) < num_to_evict:
                return None
            for block_hash in evicted:
                self._free_list.append(self.blocks.pop(block_hash).block_id)
            self.num_evicted_blocks += len(evicted)
        ids = []
        for block_hash in to_store:
            if self._num_allocated_blocks < self.num_blocks:
                block_id = self._num_allocated_blocks
                self._num_allocated_blocks += 1
            else:
                block_id = self._free_list.pop()
            self.blocks[block_hash] = CPUBlockStatus(block_id)
            ids.append(block_id)
        return PrepareStoreOutput(to_store, ids, evicted)

    def complete_store(self, block_hashes: list[int]) -> None:
        for block_hash in block_hashes:
            block = self.blocks.get(block_hash)
            if block is not None and not block.is_ready:
                block.ref_cnt = 0

    def check_invariants(self, idle: bool) -> None:
        """CPU block ids are distinct and account for the whole pool; ``idle`` (between steps,
        every transfer completed): nothing pinned or in flight."""
        block_ids = [b.block_id for b in self.blocks.values()]
        assert len(block_ids) == len(set(block_ids)), "CPU block id used twice"
        assert len(block_ids) + self.get_num_free_blocks() == self.num_blocks, "CPU pool accounting broken"
        if idle:
            assert all(b.ref_cnt == 0 for b in self.blocks.values()), "CPU block pinned/in flight when idle"


@dataclass
class TransferJob:
    """One request's blocks moving between GPU and CPU (parallel lists)."""

    request_id: str
    block_hashes: list[int]
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    is_async: bool = False  # a load the request waits for in WAITING_FOR_REMOTE_KVS


@dataclass
class OffloadingConnectorMetadata:
    """What the scheduler hands the worker for one step."""

    reqs_to_load: list[TransferJob] = field(default_factory=list)
    reqs_to_store: list[TransferJob] = field(default_factory=list)

    @property
    def num_load_blocks(self) -> int:
        return sum(len(j.block_hashes) for j in self.reqs_to_load)

    @property
    def num_store_blocks(self) -> int:
        return sum(len(j.block_hashes) for j in self.reqs_to_store)


class LookupObserver(Protocol):
    """Told of the connector's scheduler-side calls before it acts on them: a request's lookup
    (``get_num_new_matched_tokens``) and the allocation that follows it
    (``update_state_after_alloc``). An LMCache worker counts its lookups so
    (``deployments.LMCacheWorker``); an observer, not wrapped methods, because a compiled
    connector's methods cannot be replaced."""

    def looked_up(self, request: Request) -> None: ...

    def allocated(self, request: Request) -> None: ...


class OffloadingConnector:
    """Scheduler- and worker-side halves of the native CPU offloading connector."""

    def __init__(
        self, num_cpu_blocks: int, block_size: int, store: KVStore, sync_load_tokens: int | None = None
    ) -> None:
        """``sync_load_tokens``: the step's sync-load budget in tokens (vLLM's
        ``sync_load_budget_bytes`` over the KV bytes per token); 0, vLLM's default: every load
        asynchronous; None: no limit (every load that leaves a token to compute is synchronous)."""
        if sync_load_tokens is not None and sync_load_tokens < 0:
            raise ValueError("sync_load_tokens must be non-negative")
        self.manager = CPUOffloadingManager(num_cpu_blocks)
        self.block_size = block_size
        self.store = store
        self.sync_load_tokens = sync_load_tokens
        # This step's synchronous loads and the tokens they reserved (reset by build_connector_meta).
        self._sync_loads: set[str] = set()
        self._sync_load_tokens_used = 0
        self._reqs_to_load: list[TransferJob] = []
        # Index of the next block of each request to offload; survives preemption (already
        # stored blocks are not stored again), dropped when the request finishes.
        self._next_stored_block_idx: dict[str, int] = {}
        self.observer: LookupObserver | None = None

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the (block-aligned) local GPU hit that are ready on CPU, and whether
        they load asynchronously."""
        if self.observer is not None:
            self.observer.looked_up(request)
        block_hashes = request.block_hashes
        self.manager.touch(block_hashes)
        full_block_tokens = len(block_hashes) * self.block_size
        if full_block_tokens - num_computed_tokens < self.block_size:
            return 0, False
        start_block_idx = num_computed_tokens // self.block_size
        hits = self.manager.lookup(block_hashes[start_block_idx:])
        if hits == 0:
            return 0, False
        num_hit_tokens = (start_block_idx + hits) * self.block_size - num_computed_tokens
        return num_hit_tokens, not self._reserve_sync_load(request, num_computed_tokens, num_hit_tokens)

    def _reserve_sync_load(self, request: Request, num_computed_tokens: int, num_hit_tokens: int) -> bool:
        """Take the hit out of the step's sync-load budget if it fits. A full hit never loads
        synchronously (one token must be left to compute), and a reservation stays taken for the
        step even if the allocation then fails, as in vLLM."""
        self._sync_loads.discard(request.request_id)
        if self.sync_load_tokens == 0 or num_computed_tokens + num_hit_tokens >= request.num_tokens:
            return False
        if self.sync_load_tokens is not None and self._sync_load_tokens_used + num_hit_tokens > self.sync_load_tokens:
            return False
        self._sync_load_tokens_used += num_hit_tokens
        self._sync_loads.add(request.request_id)
        return True

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Queue the H->D copy into the GPU blocks ``allocate_slots`` just allocated and pin the
        CPU source blocks: those past the local hit (vLLM finds them by position, or as the blocks
        not hashed yet for an asynchronous load, whose caching is delayed: the same blocks)."""
        if self.observer is not None:
            self.observer.allocated(request)
        if num_external_tokens == 0:
            return
        start = num_local_computed_tokens // self.block_size
        end = (num_local_computed_tokens + num_external_tokens) // self.block_size
        hashes = request.block_hashes[start:end]
        self._reqs_to_load.append(
            TransferJob(
                request.request_id,
                hashes,
                [b.block_id for b in blocks[start:end]],
                self.manager.prepare_load(hashes),
                is_async=request.request_id not in self._sync_loads,
            )
        )
        self._next_stored_block_idx[request.request_id] = end

    def build_connector_meta(
        self, scheduled: list[tuple[Request, int, list[KVCacheBlock]]]
    ) -> OffloadingConnectorMetadata:
        """Loads queued this step plus store jobs (``_get_reqs_to_store``) for every scheduled
        ``(request, num_scheduled_tokens, request_blocks)``: the full blocks completed by the end
        of this step and not stored yet."""
        meta = OffloadingConnectorMetadata(reqs_to_load=self._reqs_to_load)
        self._reqs_to_load = []
        self._sync_loads = set()
        self._sync_load_tokens_used = 0
        for request, num_new_tokens, blocks in scheduled:
            rid = request.request_id
            # offload_prompt_only (default True in 0.33.0): decoded tokens' blocks are never stored
            total_tokens = min(request.num_computed_tokens + num_new_tokens, request.num_prompt_tokens)
            num_blocks = total_tokens // self.block_size
            start = self._next_stored_block_idx.get(rid, 0)
            if num_blocks <= start:
                continue
            out = self.manager.prepare_store(request.block_hashes[start:num_blocks])
            if out is None:  # CPU pool full of pinned/in-flight blocks: retried next step
                continue
            self._next_stored_block_idx[rid] = num_blocks
            if not out.block_hashes_to_store:
                continue
            self.manager.touch(request.block_hashes[:num_blocks])
            index = {h: start + i for i, h in enumerate(request.block_hashes[start:num_blocks])}
            meta.reqs_to_store.append(
                TransferJob(
                    rid,
                    out.block_hashes_to_store,
                    [blocks[index[h]].block_id for h in out.block_hashes_to_store],
                    out.store_block_ids,
                )
            )
        return meta

    def request_finished(self, request: Request) -> None:
        self._next_stored_block_idx.pop(request.request_id, None)

    # ---- worker side ----

    def _slots(self, block_ids: list[int]) -> list[int]:
        bs = self.block_size
        return [b * bs + off for b in block_ids for off in range(bs)]

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> list[str]:
        """Copy CPU blocks into the GPU blocks allocated for them, then unpin (before the forward).
        Every load completes within its step; returns the requests whose asynchronous load did
        (the step's ``finished_recving``)."""
        for job in meta.reqs_to_load:
            self.store.copy("host", self._slots(job.cpu_block_ids), "device", self._slots(job.gpu_block_ids))
            self.manager.complete_load(job.block_hashes)
        return [job.request_id for job in meta.reqs_to_load if job.is_async]

    def wait_for_save(self, meta: OffloadingConnectorMetadata) -> None:
        """Copy this step's completed GPU blocks to CPU (after the forward) and mark them ready."""
        for job in meta.reqs_to_store:
            self.store.copy("device", self._slots(job.gpu_block_ids), "host", self._slots(job.cpu_block_ids))
            self.manager.complete_store(job.block_hashes)
