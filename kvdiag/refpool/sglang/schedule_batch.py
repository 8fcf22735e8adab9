"""Per-request KV bookkeeping: SGLang's ``Req`` row and the cache entry points it goes through.

* ``Req`` mirrors ``managers/schedule_batch.py: Req``: its ``req_to_token`` row (``kv_indices``:
  the device slot of every position whose KV exists), the radix node it holds locked
  (``last_node``) and ``cache_protected_len`` (the leading part of the row owned by the tree).
  Everything in the row past ``cache_protected_len`` is *request-private*.
* ``checkpoint_kv_cache`` / ``release_kv_cache`` mirror ``mem_cache/common.py`` (the radix
  ``cache_unfinished_req`` / ``cache_finished_req``): after a prefill pass the computed prompt goes
  into the tree and the lock moves to its last node (prompt -> protected); on finish the whole
  sequence is inserted and unlocked (-> evictable); on retract/abort the private part is freed
  and the prompt left in the tree unlocked.
* ``alloc_extend`` / ``alloc_decode`` mirror the allocators' ``alloc_extend`` / ``alloc_decode``:
  a request first fills the free tail of its last page, then takes new pages; a decode step
  allocates for the whole batch at once.
* ``check_decode_mem`` and ``get_decode_retraction_order`` mirror ``ScheduleBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass, field

from kvdiag.refpool.sglang.radix_cache import RadixCache, TreeNode
from kvdiag.refpool.types import SimRequest, token_key


@dataclass(eq=False)
class Req:
    """One request's SGLang-side state; ``sim`` is the engine-neutral request it serves."""

    sim: SimRequest
    max_new_tokens: int  # after the scheduler's clamp to max_req_len (handle_generate_request)
    kv_indices: list[int] = field(default_factory=list)  # req_to_token row
    keys: list[int] = field(default_factory=list)  # KV key of each position of prompt + output
    prefix_indices: list[int] = field(default_factory=list)  # L1 prefix found for this round
    extend_input_len: int = 0  # tokens computed by this round's (chunk of) prefill
    cache_protected_len: int = 0
    cache_inserted_len: int = 0  # how much of its row this request has inserted into the tree
    last_node: TreeNode | None = None  # node locked by this request (None: holds no lock)
    last_host_node: TreeNode | None = None
    host_hit_length: int = 0
    host_loaded_length: int = 0  # part of prefix_indices that was loaded back from host
    retraction_count: int = 0
    finished: bool = False  # released; still listed in the running batch until filtered
    aborted: bool = False
    # Batch-level decode (``SGLangScheduler.enable_batch_decode``): the decode step its output is
    # exact at, the one it stops at, and its order in the running batch.
    synced_at: int = 0
    stop_at: int = 0
    batch_order: int = 0
    reserve_left: int = 0  # max_new_tokens - output length + decode step (constant while running)

    @property
    def origin_input_ids(self) -> tuple[int, ...]:
        return self.sim.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.sim.output

    @property
    def fill_len(self) -> int:
        """``len(fill_ids)``: a (re-)prefill computes prompt + every output token so far."""
        return len(self.sim.prompt) + len(self.sim.output)

    @property
    def retracted_stain(self) -> bool:
        return self.retraction_count > 0

    def token_at(self, pos: int) -> int:
        prompt = self.sim.prompt
        return prompt[pos] if pos < len(prompt) else self.sim.output[pos - len(prompt)]

    def tokens(self, n: int) -> tuple[int, ...]:
        """First ``n`` tokens of prompt + output."""
        prompt = self.sim.prompt
        if n <= len(prompt):
            return prompt[:n]
        return prompt + tuple(self.sim.output[: n - len(prompt)])

    def kv_keys(self, start: int, end: int) -> list[int]:
        """KV keys of positions ``start..end-1`` (as ``types.prefix_keys`` of the tokens).

        The chain is extended incrementally, so a decode step costs O(1), not O(length).
        """
        keys = self.keys
        while len(keys) < end:
            keys.append(token_key(keys[-1] if keys else 0, self.token_at(len(keys))))
        return keys[start:end]

    def should_finish(self) -> bool:
        """``check_finished``: FINISH_LENGTH at max_new_tokens, or EOS (ground-truth output_len)."""
        n = len(self.sim.output)
        return n >= self.max_new_tokens or n >= self.sim.output_len

    def private_tokens(self, page_size: int) -> int:
        """Slots this request owns outside the tree: row past cache_protected_len, whole pages."""
        n = len(self.kv_indices)
        return -(-n // page_size) * page_size - self.cache_protected_len if n else 0

    def owned_private_slots(self, page_size: int) -> list[int]:
        """Every slot counted by ``private_tokens`` (incl. the unused tail of the last page)."""
        row = self.kv_indices[self.cache_protected_len :]
        if not row or page_size == 1:
            return list(row)
        pages = sorted({s // page_size for s in row})
        return [p * page_size + o for p in pages for o in range(page_size)]

    def init_next_round_input(self, tree: RadixCache) -> None:
        """Match the radix tree for this admission attempt (``Req.init_next_round_input``).

        The match is capped at ``len(fill_ids) - 1``: at least one token is always computed so
        the forward pass yields logits (``_compute_max_prefix_len``).
        """
        max_prefix_len = max(self.fill_len - 1, 0)
        match = tree.match_prefix(self.tokens(max_prefix_len))
        self.prefix_indices = match.device_indices
        self.last_node = match.last_device_node
        self.last_host_node = match.last_host_node
        self.host_hit_length = match.host_hit_length
        self.host_loaded_length = 0
        self.extend_input_len = self.fill_len - len(self.prefix_indices)

    def reset_for_retract(self) -> None:
        self.kv_indices = []
        self.prefix_indices = []
        self.extend_input_len = 0
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.last_node = None
        self.last_host_node = None
        self.host_hit_length = 0
        self.host_loaded_length = 0
        self.retraction_count += 1


def alloc_extend(req: Req, tree: RadixCache, num_tokens: int) -> list[int]:
    """Append ``num_tokens`` slots to ``req``'s row; raises if the pool cannot serve them."""
    allocator = tree.token_to_kv_pool_allocator
    ps = allocator.page_size
    row = req.kv_indices
    take = min((-len(row)) % ps, num_tokens) if row else 0
    slots = [row[-1] + 1 + i for i in range(take)]
    rest = num_tokens - take
    if rest:
        new = allocator.alloc(-(-rest // ps) * ps)
        if new is None:
            raise RuntimeError(f"out of memory: cannot allocate {rest} KV slots for {req.sim.rid}")
        slots += new[:rest]
    row.extend(slots)
    return slots


def alloc_decode(reqs: list[Req], tree: RadixCache) -> list[int]:
    """One slot appended to each request's row for a decode step; returns the slots in order.

    Page size 1 takes the whole batch's slots in one ``alloc(len(reqs))``, as the engine's
    ``alloc_token_slots`` does (so released slots are merged and sorted before the take when the
    free list is short). Paged pools fill each row's last page first (``alloc_extend``).

    Both first evict for the engine's over-estimate, not for what the step needs: one slot per
    request (``alloc_token_slots(bs)``), or a whole page per request, full last page or not
    (``alloc_paged_token_slots_decode``: "assume each request needs a new page"). With pages that
    evicts cached KV that ``check_decode_mem`` left alone, and the freed pages go to the front of
    the free list, where this step's new pages come from.
    """
    allocator = tree.token_to_kv_pool_allocator
    tree.evict_to_free_tokens(len(reqs) * allocator.page_size)
    if allocator.page_size != 1:
        return [alloc_extend(req, tree, 1)[0] for req in reqs]
    slots = allocator.alloc(len(reqs))
    if slots is None:
        raise RuntimeError(f"out of memory: cannot allocate {len(reqs)} decode slots")
    for req, slot in zip(reqs, slots):
        req.kv_indices.append(slot)
    return slots


def new_tokens_required_next_decode(reqs: list[Req], page_size: int) -> int:
    """Slots the next decode step needs: a page for each request whose last page is full."""
    if page_size == 1:
        return len(reqs)  # every row's last page is full
    return page_size * sum(1 for r in reqs if len(r.kv_indices) % page_size == 0)


def check_decode_mem(reqs: list[Req], tree: RadixCache) -> bool:
    """``ScheduleBatch.check_decode_mem``: evict the shortfall, then test ``available >= need``."""
    need = new_tokens_required_next_decode(reqs, tree.page_size)
    tree.evict_to_free_tokens(need)
    return tree.token_to_kv_pool_allocator.available_size() >= need


def get_decode_retraction_order(reqs: list[Req]) -> list[int]:
    """Indices sorted so that popping from the end retracts fewest-output, longest-prompt first."""
    order = list(range(len(reqs)))
    order.sort(key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)), reverse=True)
    return order


def checkpoint_kv_cache(req: Req, tree: RadixCache) -> None:
    """Publish the computed row into the tree and move the lock (``cache_unfinished_req``)."""
    allocator = tree.token_to_kv_pool_allocator
    n = len(req.kv_indices) // tree.page_size * tree.page_size
    key = req.tokens(n)
    new_prefix_len = _insert_row(req, tree, key)
    if new_prefix_len > req.cache_protected_len:
        allocator.free(req.kv_indices[req.cache_protected_len : new_prefix_len])
    match = tree.match_prefix(key)
    assert len(match.device_indices) == n, "checkpointed prefix must be fully device-resident"
    req.kv_indices[req.cache_protected_len : n] = match.device_indices[req.cache_protected_len :]
    req.cache_protected_len = n
    assert req.last_node is not None
    tree.dec_lock_ref(req.last_node)
    tree.inc_lock_ref(match.last_device_node)
    req.last_node = match.last_device_node


def _insert_row(req: Req, tree: RadixCache, key: Sequence[int]) -> int:
    """``RadixCache._insert_cache(split_prompt=True)`` of ``checkpoint``: insert the row under
    ``key``, then re-insert the prompt so the leaf splits at the prompt boundary ("so eviction can
    drop the output KV without the prompt"). Returns the first insert's cached prefix length."""
    n = len(key)
    new_prefix_len = tree.insert(key, req.kv_indices, req.cache_inserted_len)  # reads the row's first n
    req.cache_inserted_len = max(req.cache_inserted_len, n)
    p = len(req.origin_input_ids) // tree.page_size * tree.page_size
    if 0 < p < n:
        tree.insert(key[:p], req.kv_indices, p)
    return new_prefix_len


def release_kv_cache(req: Req, tree: RadixCache, checkpoint: bool) -> None:
    """Give back a request's KV (``release_kv_cache``).

    ``checkpoint=True`` (finish): insert prompt + output (page-aligned), free the slots the tree
    already had (duplicates) and the unaligned tail, unlock -> all of it becomes evictable.
    ``checkpoint=False`` (retract/abort): free the private part; the tree-owned prompt stays,
    unlocked. Either way the request ends up holding no slot and no lock.
    """
    allocator = tree.token_to_kv_pool_allocator
    row, cpl = req.kv_indices, req.cache_protected_len
    if checkpoint:
        n = len(row) // tree.page_size * tree.page_size
        new_prefix_len = _insert_row(req, tree, req.tokens(n))
        if new_prefix_len > cpl:
            allocator.free(row[cpl:new_prefix_len])
        if len(row) > n:
            allocator.free(row[n:])
    elif len(row) > cpl:
        allocator.free(row[cpl:])
    if req.last_node is not None:
        tree.dec_lock_ref(req.last_node)
    req.kv_indices = []
    req.cache_protected_len = 0
    req.last_node = None
