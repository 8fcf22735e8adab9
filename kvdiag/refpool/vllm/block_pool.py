"""vLLM V1 GPU block pool: ``KVCacheBlock``, ``FreeKVCacheBlockQueue`` and ``BlockPool``.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (block, free queue) and ``vllm/v1/core/block_pool.py``
(pool) of vLLM 0.33.0 for one full-attention KV cache group (facts §2.4):

* block 0 is the null block, taken from the queue at init and never freed;
* the free queue is a doubly linked list in eviction order; ``get_new_blocks`` pops the head and
  lazily evicts the popped block's hash from the prefix cache (a "free" block is still a cache hit
  until it is reused);
* ``free_blocks`` puts blocks that reach ref_cnt 0 *with* a hash at the tail (LRU) and blocks
  *without* a hash at the head (reused first);
* ``get_usage() = 1 - free / (num_gpu_blocks - 1)``: cached-but-unreferenced blocks count as free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class HashedRequest(Protocol):
    """What ``cache_full_blocks`` reads of a request: its id and its blocks' chained hashes
    (vLLM's ``Request``, or a stand-in with these two attributes: a protocol, not the class,
    so that a compiled pool does not refuse one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> list[int]: ...


@dataclass(eq=False, repr=False, slots=True)
class KVCacheBlock:
    """One GPU block (``kv_cache_utils.KVCacheBlock``; slotted as in vLLM: the pool holds one per
    block, ~100k at a 1.5 M-token pool, touched every time a block is allocated or cached).

    ``block_hash`` is set once the block is full and cached (``cache_full_blocks``) and reset when
    the block is evicted at reuse time. ``prev_free_block`` / ``next_free_block`` link the block
    into the free queue while its ref_cnt is 0.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    is_null: bool = False
    # ``BlockPool``'s lookup memo holds this block while this equals the pool's ``_memo_gen``.
    memo_gen: int = -1

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with fake head/tail sentinels (O(1) remove from the middle).

    The head is evicted (reused) first. Initially all blocks are in id order, so fresh allocations
    hand out ids 1, 2, 3, ... once the null block has been popped.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Pop the first (next to evict) free block."""
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first n free blocks, in queue order: one walk from the head, relinking the
        head once (as vLLM does), rather than n ``popleft`` calls."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        if n == 0:
            return []
        self.num_free_blocks -= n
        head = self.fake_free_list_head
        curr_block = head.next_free_block
        ret = []
        for _ in range(n):
            assert curr_block is not None
            ret.append(curr_block)
            last_block = curr_block
            curr_block = curr_block.next_free_block
            last_block.prev_free_block = last_block.next_free_block = None
        assert curr_block is not None  # the fake tail at least
        head.next_free_block = curr_block
        curr_block.prev_free_block = head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a prefix hit on a free cached block)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks to the tail in the given order (linked in one pass, as vLLM does)."""
        tail = self.fake_free_list_tail
        if blocks:
            self._link_between(tail.prev_free_block, blocks, tail)  # type: ignore[arg-type]

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, keeping their order (``blocks[0]`` becomes the new head)."""
        head = self.fake_free_list_head
        if blocks:
            self._link_between(head, blocks, head.next_free_block)  # type: ignore[arg-type]

    def _link_between(self, prev: KVCacheBlock, blocks: list[KVCacheBlock], nxt: KVCacheBlock) -> None:
        """Link ``blocks`` in order between the adjacent ``prev`` and ``nxt``."""
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head to tail (used by invariant checks and tests)."""
        out = []
        cur = self.fake_free_list_head.next_free_block
        while cur is not None and cur is not self.fake_free_list_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockHashToBlockMap:
    """The prefix cache's index: a block hash to the cached blocks holding it (vLLM's
    ``BlockHashToBlockMap``, ``block_pool.py``).

    vLLM does not de-duplicate (two requests that compute the same block concurrently both cache
    it, so block tables stay append-only), so a hash can name several blocks; mostly it names
    one, held as itself, and a dict keyed by block id (in caching order) only where there are
    more. vLLM chose the union to spare the collector an inner dict per cached block; here it
    also spares the allocations and a lookup per block cached and per block evicted, which ran
    per block taken or filled. ``pop`` puts a hash whose dict keeps blocks back at the end of
    the map, as vLLM's does; which block a hit returns (the first cached) is unchanged.
    """

    def __init__(self) -> None:
        self._cache: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: int) -> KVCacheBlock | None:
        """The first cached block holding ``key``, or None on a miss."""
        blocks = self._cache.get(key)
        if blocks is None or isinstance(blocks, KVCacheBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: int, block: KVCacheBlock) -> bool:
        """Index ``block`` under ``key``; True where ``key`` was not cached before."""
        cache = self._cache
        blocks = cache.get(key)
        if blocks is None:
            cache[key] = block
            return True
        if isinstance(blocks, KVCacheBlock):
            cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block
        return False

    def pop(self, key: int, block_id: int) -> KVCacheBlock | None:
        """Drop block ``block_id`` from ``key``'s blocks; the block, or None where it was not
        indexed there."""
        cache = self._cache
        blocks = cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            cache[key] = blocks
        return block

    def __contains__(self, key: int) -> bool:
        return key in self._cache

    def entries(self) -> list[tuple[int, list[KVCacheBlock]]]:
        """Every hash with its blocks in caching order, in the map's order (checks and tests)."""
        return [(h, [b] if isinstance(b, KVCacheBlock) else list(b.values())) for h, b in self._cache.items()]


class BlockPool:
    """Allocates, frees and caches GPU blocks (``vllm/v1/core/block_pool.py: BlockPool``).

    ``cached_block_hash_to_block`` maps a block hash to the blocks holding it
    (``BlockHashToBlockMap``); ``get_cached_block`` returns the first one.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Placeholder block (block_id 0) for skipped sliding-window blocks; its ref_cnt is not
        # maintained and it never returns to the free queue.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Cached blocks whose hash was dropped because the block was reused (lazy eviction).
        self.num_evicted_blocks = 0
        # The last ``longest_cache_hit``: (owner, its hashes, how many walked, hit blocks, hash it
        # missed on). Its blocks carry ``memo_gen == _memo_gen``.
        self._memo: tuple[object, list[int], int, list[KVCacheBlock], int | None] | None = None
        self._memo_gen = 0
        self._memo_miss: int | None = None
        self.walks = 0  # lookups that walked the cache map (the rest answered from the memo)

    def longest_cache_hit(self, owner: object, block_hashes: list[int], n: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest cached prefix of ``block_hashes[:n]`` (the walk of
        ``get_cached_block`` up to the first miss, vLLM's ``find_longest_cache_hit``).

        The head of a waiting queue blocked on KV is looked up again every step, as vLLM does,
        and at a thousand running requests it was a tenth of a run. The walk's answer depends
        only on the hashes (``owner``'s, append-only) and on two things in the map: which block
        comes first for each hash hit (it changes only when that block is evicted: later copies
        are appended behind it) and whether the hash it missed on is cached since. So the last
        walk is kept, keyed by ``owner`` and ``n``; an eviction of a block it hit patches it as
        the walk would see it (``_memo_evicted``: the hash's next copy, or the walk stops there;
        a preempted head loses its freed tail a block at a time as the free queue is reused) and
        caching the hash it missed on drops it: a repeated lookup returns exactly what the walk
        would.
        """
        memo = self._memo
        if memo is not None and memo[0] is owner and memo[2] == n:
            return list(memo[3])
        hits, miss = self._walk(block_hashes, n)
        self._memo_gen = gen = self._memo_gen + 1
        for blk in hits:
            blk.memo_gen = gen
        self._memo, self._memo_miss = (owner, block_hashes, n, hits, miss), miss
        return list(hits)

    def _memo_evicted(self, block: KVCacheBlock) -> None:
        """``block``, flagged by the memo, has just left the map: where the walk still hits it,
        it now finds its hash's next copy there, or stops there where none is left (the blocks
        cut off keep a stale flag: their own eviction finds them absent and changes nothing)."""
        assert self._memo is not None
        owner, block_hashes, n, hits, miss = self._memo
        try:
            i = hits.index(block)
        except ValueError:
            return
        first = self.cached_block_hash_to_block.get_one_block(block_hashes[i])
        if first is not None:
            first.memo_gen = self._memo_gen
            for k in range(i, len(hits)):
                if hits[k] is block:
                    hits[k] = first
        else:
            del hits[i:]  # the memo's own list: lookups return copies
            self._memo, self._memo_miss = (owner, block_hashes, n, hits, block_hashes[i]), block_hashes[i]

    def _walk(self, block_hashes: list[int], n: int) -> tuple[list[KVCacheBlock], int | None]:
        """``get_cached_block`` along ``block_hashes[:n]`` up to the first miss: (hits, the hash
        missed on, None where all n hit)."""
        self.walks += 1
        cached_map = self.cached_block_hash_to_block
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:n]:
            cached = cached_map.get_one_block(block_hash)
            if cached is None:
                return hits, block_hash
            hits.append(cached)
        return hits, None

    def _drop_memo(self) -> None:
        """Forget the last walk (the hash it missed on is cached now)."""
        self._memo = self._memo_miss = None
        self._memo_gen += 1

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The first cached block holding ``block_hash``, or None on a miss."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(
        self,
        request: HashedRequest,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and index them.

        The hashes come from ``request.block_hashes`` (already chained over the prefix), as in
        vLLM where the request's block hasher computes them when tokens are appended.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"{request.request_id}: {len(request.block_hashes)} hashes < {num_full_blocks} full blocks "
            f"(block_size {block_size})"
        )
        self.cache_hashed(blocks[num_cached_blocks:num_full_blocks], request.block_hashes[num_cached_blocks:num_full_blocks])

    def cache_hashed(self, blocks: list[KVCacheBlock], hashes: list[int]) -> None:
        """Give each of ``blocks`` its hash in ``hashes`` and index it (``cache_full_blocks``'
        loop; batch-level decode caches the blocks a step fills, one per request, in one call)."""
        cached_map = self.cached_block_hash_to_block
        for blk, block_hash in zip(blocks, hashes):
            if blk.is_null:
                continue
            assert blk.block_hash is None, f"{blk} is already cached"
            blk.block_hash = block_hash
            if cached_map.insert(block_hash, blk) and block_hash == self._memo_miss:  # a new hash: the memo's miss, perhaps
                self._drop_memo()

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue, evicting their stale hashes (lazy
        eviction: a reused cached block leaves the prefix cache; ``_maybe_evict_cached_block``
        of vLLM, inlined: it runs per block taken)."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        cached_map, evicted, caching = self.cached_block_hash_to_block, 0, self.enable_caching
        for block in ret:
            assert block.ref_cnt == 0, f"{block} in the free queue with ref_cnt > 0"
            block.ref_cnt = 1
            block_hash = block.block_hash
            if block_hash is None or not caching or cached_map.pop(block_hash, block.block_id) is None:
                continue
            block.block_hash = None
            evicted += 1
            if block.memo_gen == self._memo_gen:
                self._memo_evicted(block)
        self.num_evicted_blocks += evicted
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt++ on prefix-hit blocks, taking free (ref_cnt 0) ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt-- on blocks given in eviction order (first = evicted first).

        Blocks reaching 0 without a hash can never be a prefix hit, so they go to the head
        (``prepend_n``, order kept) and are reused first; cached ones go to the tail (LRU).
        """
        blocks_with_hash: list[KVCacheBlock] = []
        blocks_without_hash: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None:
                    blocks_without_hash.append(block)
                else:
                    blocks_with_hash.append(block)
        self.free_block_queue.prepend_n(blocks_without_hash)
        self.free_block_queue.append_n(blocks_with_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """KV usage as ``vllm:kv_cache_usage_perc`` reports it: the null block is excluded and
        cached-but-unreferenced blocks count as free."""
        total_gpu_blocks = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total_gpu_blocks

    def check_invariants(self) -> None:
        """Free queue = exactly the non-null blocks with ref_cnt 0, correctly linked; the hash map
        indexes exactly the blocks that carry a hash. Raises AssertionError."""
        q = self.free_block_queue
        free = q.get_all_free_blocks()
        prev = q.fake_free_list_head
        for blk in free:
            assert blk.prev_free_block is prev, f"free queue back-link broken at {blk}"
            prev = blk
        assert q.fake_free_list_tail.prev_free_block is prev, "free queue tail link broken"
        assert len(free) == q.num_free_blocks, f"queue holds {len(free)} != {q.num_free_blocks}"
        assert {b.block_id for b in free} == {
            b.block_id for b in self.blocks if b.ref_cnt == 0 and not b.is_null
        }, "free queue != blocks with ref_cnt 0 (null block excluded)"
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        indexed = set()
        for h, entries in self.cached_block_hash_to_block.entries():
            assert entries, f"empty entry for hash {h:#x}"
            for blk in entries:
                assert blk is self.blocks[blk.block_id] and blk.block_hash == h, f"hash map {h:#x} -> {blk}"
                assert blk.block_id not in indexed, f"{blk} indexed twice"
                indexed.add(blk.block_id)
        assert hashed == indexed, f"blocks {sorted(hashed ^ indexed)} hashed but not indexed, or vice versa"
        if self._memo is not None:
            _, hashes, n, hits, miss = self._memo
            assert self._walk(hashes, n) == (hits, miss), "the lookup memo differs from a fresh walk"
            assert all(b.memo_gen == self._memo_gen for b in hits), "a block the memo hit is not flagged"
        assert self.enable_caching or not hashed, "blocks cached with prefix caching off"
