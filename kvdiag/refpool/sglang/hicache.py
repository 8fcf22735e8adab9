"""SGLang HiCache: a host-memory (L2) tier behind the radix tree.

Mirrors the classic ``mem_cache/hiradix_cache.py: HiRadixCache`` and the 0.5.23 write policies
(``unified_radix_cache.py``), as pinned in facts/engine-mechanics.md §1.6:

* ``HostKVCache`` (``mem_cache/pool_host/base.py``): ``size = int(device_capacity x
  hicache_ratio)``, then ``page_num = size // page_size + 1`` and ``size = page_num x page_size``.
* Write policies. ``write_through``: every node inserted is copied D->H at once (hit threshold
  1). ``write_through_selective``: copied when the node's insert hit count reaches 2; an insert
  counts a hit only on nodes ending past what the same request inserted before (its own
  finish-time insert does not re-count the prompt it checkpointed), so only a prefix another
  request reuses is copied.
  ``write_back``: nothing is copied at insert; a leaf is copied when the device evicts it.
  A device eviction of a backed-up node *demotes* it (device slots freed, node kept host-only);
  of a node with no host copy, write_back first backs it up (evicting host LRU leaves for room)
  and otherwise the node is *dropped*.
* Load back (``load_back``): host-only nodes continuing a device hit are copied H->D only if at
  least ``load_back_threshold`` (10) tokens, and only all together: device slots for *all* of
  them are allocated first (evicting the device shortfall) or nothing is loaded.

* Host duplicates (write_back): a node on device *and* host (loaded back, recomputed over its
  host copy, or split from one) holds its host copy only as a spare. Host pressure under
  write_back first reclaims those copies (``unified_tree_core._reclaim_full_host_duplicates``),
  in the order they became duplicates, sparing evictable device leaves in a first pass (they are
  about to be demoted onto that copy), and only then deletes host-only leaves.
* Acknowledgements. SGLang copies asynchronously and a copy's node stays locked (protected) until
  its ack is polled (``check_hicache_events``, at the top of every scheduler iteration): a
  write-through backup from the node's insert, a load back from its admission. Here the bytes
  move at once and every ack is ready by the next poll, so ``check_hicache_events`` releases
  all those locks, as 0.5.23 does when each transfer completes within its step. write_back's
  eviction-time backup is synchronous in SGLang too (``backup_node_for_write_back`` waits for
  its ack) and holds no lock.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from mypy_extensions import mypyc_attr

from kvdiag.refpool.sglang.allocator import TokenToKVPoolAllocator
from kvdiag.refpool.sglang.radix_cache import RadixCache, TreeNode
from kvdiag.refpool.types import KVStore

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LOAD_BACK_THRESHOLD = 10


class HostKVCache:
    """Host slot pool (no padding slot); allocation in whole pages, smallest slots first."""

    def __init__(self, device_capacity: int, hicache_ratio: float = 2.0, page_size: int = 1) -> None:
        size = int(device_capacity * hicache_ratio)
        self.page_size = page_size
        self.size = (size // page_size + 1) * page_size
        self.free_slots: list[int] = list(range(self.size - 1, -1, -1))  # pop() yields lowest
        self._owned = bytearray(self.size)

    def available_size(self) -> int:
        return len(self.free_slots)

    def used_size(self) -> int:
        """``sglang:hicache_host_used_tokens`` = host total - host available."""
        return self.size - len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size % self.page_size:
            raise ValueError(f"host alloc({need_size}) is not page-aligned")
        if need_size > len(self.free_slots):
            return None
        out = self.free_slots[len(self.free_slots) - need_size :][::-1]
        del self.free_slots[len(self.free_slots) - need_size :]
        for s in out:
            self._owned[s] = 1
        return out

    def free(self, indices: Sequence[int]) -> None:
        for s in indices:
            if not self._owned[s]:
                raise ValueError(f"double free of host slot {s}")
            self._owned[s] = 0
        self.free_slots.extend(indices)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.size and bool(self._owned[slot])


# Compiled (refpool/native.py), a class is closed to subclasses outside the compiled modules
# unless it says otherwise: the eviction-heap test subclasses this one with SGLang's own evict.
@mypyc_attr(allow_interpreted_subclasses=True)
class HiRadixCache(RadixCache):
    """Radix tree whose nodes can be backed up to, demoted to, and loaded back from host."""

    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
        store: KVStore | None = None,
        hicache_ratio: float = 2.0,
        hicache_write_policy: str = "write_through",
        load_back_threshold: int = LOAD_BACK_THRESHOLD,
    ) -> None:
        if hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown hicache_write_policy {hicache_write_policy!r}")
        super().__init__(allocator, page_size, store)
        self.token_to_kv_pool_host = HostKVCache(allocator.size, hicache_ratio, page_size)
        self.write_policy = hicache_write_policy
        # unified_tree_core: threshold 1 for write_through, 2 otherwise (unused by write_back).
        self.write_through_threshold = 1 if hicache_write_policy == "write_through" else 2
        self.load_back_threshold = load_back_threshold
        self.evictable_host_leaves: set[TreeNode] = set()
        self.backup_tokens_total = 0  # sglang:hicache_backup_tokens_total
        self.load_back_tokens_total = 0  # sglang:load_back_tokens_total
        self.dropped_tokens_total = 0  # sglang:hicache_dropped_tokens_total (device tokens lost)
        self.ongoing_write_through: list[TreeNode] = []  # locked until their ack is polled
        self.ongoing_load_back: list[TreeNode] = []  # anchors (deepest loaded node)
        self._loading: dict[TreeNode, TreeNode] = {}  # node -> anchor of its load awaiting the ack
        # write_back's reclaimable host copies, in registration order; entries go stale lazily
        # (a demoted or released node stays listed until a reclaim walk sweeps it)
        self.host_duplicates: dict[int, TreeNode] = {}

    def check_hicache_events(self) -> None:
        """Poll the acks (``writing_check`` / ``loading_check``): every copy issued so far has
        completed, so each node locked for one is unlocked; a loaded node becomes a host
        duplicate, deepest first (``finish_load_back`` walks from the anchor to the root)."""
        for written in self.ongoing_write_through:
            self.dec_lock_ref(written)
        for anchor in self.ongoing_load_back:
            self.dec_lock_ref(anchor)
            node: TreeNode | None = anchor
            while node is not None and node is not self.root_node:
                if self._loading.get(node) is anchor:
                    del self._loading[node]
                    self._track_duplicate(node)
                node = node.parent
        self.ongoing_write_through = []
        self.ongoing_load_back = []

    # ----------------------------------------------------------------- host duplicates
    def _track_duplicate(self, node: TreeNode) -> None:
        """``_update_duplicate_tracking``: register a settled duplicate (kept in its first place),
        drop anything else."""
        if self.write_policy != "write_back":
            return  # only write_back reclaims them
        if not node.evicted and node.backuped and node not in self._loading:
            self.host_duplicates.setdefault(node.id, node)
        else:
            self.host_duplicates.pop(node.id, None)

    def _reclaim_host_duplicates(self, num_tokens: int) -> int:
        """Free up to ``num_tokens`` host slots from duplicates (whole nodes, so it may overshoot)."""
        freed = 0
        swept: list[int] = []
        for spare_device_leaves in (True, False):
            for node in list(self.host_duplicates.values()):
                if freed >= num_tokens:
                    break
                if node.evicted or not node.backuped:
                    swept.append(node.id)  # stale
                    continue
                if spare_device_leaves and node in self.evictable_leaves:
                    continue
                if node in self._loading or node.host_ref_counter > 0:
                    continue
                self.token_to_kv_pool_host.free(node.host_value)  # type: ignore[arg-type]
                freed += len(node.host_value)  # type: ignore[arg-type]
                node.host_value = None
                swept.append(node.id)
            if freed >= num_tokens:
                break
        for node_id in swept:
            self.host_duplicates.pop(node_id, None)
        return freed

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(child, split_len)
        if child in self._loading:
            self._loading[new_node] = self._loading[child]
        self._track_duplicate(new_node)
        return new_node

    # ----------------------------------------------------------------- write (D -> H)
    def write_backup(self, node: TreeNode) -> bool:
        """Copy a device node to host; make room by host LRU eviction if needed."""
        assert node.value is not None and node.host_value is None
        n = len(node.value)
        host_indices = self.token_to_kv_pool_host.alloc(n)
        if host_indices is None:  # evict only the host shortfall (_execute_kv_backup)
            self.evict_host(n - self.token_to_kv_pool_host.available_size())
            host_indices = self.token_to_kv_pool_host.alloc(n)
        if host_indices is None:
            return False
        self.store.copy("device", node.value, "host", host_indices)
        node.host_value = host_indices
        self.backup_tokens_total += n
        return True

    def _inc_hit_count(self, node: TreeNode) -> None:
        """Insert-time hit counting (``_inc_hit_count_and_check``); write_back counts nothing."""
        if self.write_policy == "write_back":
            return
        node.hit_count += 1
        if not node.backuped and node.hit_count >= self.write_through_threshold and self.write_backup(node):
            self.inc_lock_ref(node)  # protected until the write ack is polled
            self.ongoing_write_through.append(node)

    def _insert_matched(self, node: TreeNode, value: list[int], new_hit: bool) -> int:
        """A host-only node on an insert path takes the inserting request's fresh slots.

        That is KV recomputation of an evicted prefix: the node is device-resident again, the
        slots now belong to the tree, and they are *not* reported as an already-cached prefix
        (the caller must not free them).
        """
        if node.evicted:
            node.value = list(value)
            self.evictable_size_ += len(value)
            self._update_leaf_status(node)
            self._update_leaf_status(node.parent)  # type: ignore[arg-type]
            self._track_duplicate(node)  # recomputed over its host copy
            return 0
        if new_hit:
            self._inc_hit_count(node)
        return len(node.key)

    def _insert_new(self, node: TreeNode, new_hit: bool) -> None:
        if new_hit:
            self._inc_hit_count(node)

    # ----------------------------------------------------------------- eviction
    def _evict_leaf(self, x: TreeNode) -> int:
        """Device eviction of one leaf: demote if backed up (write_back backs up first), else drop."""
        if not x.backuped and self.write_policy == "write_back" and self.write_backup(x):
            self._track_duplicate(x)  # at its (immediate) ack; stale once demoted below
        if x.backuped:
            return self._demote(x)
        return self._drop_subtree(x)

    def _demote(self, x: TreeNode) -> int:
        assert x.value is not None
        self.token_to_kv_pool_allocator.free(x.value)
        freed = len(x.value)
        x.value = None
        self.evictable_size_ -= freed
        self._update_leaf_status(x)
        self._update_leaf_status(x.parent)  # type: ignore[arg-type]
        return freed

    def _drop_subtree(self, x: TreeNode) -> int:
        """Lose a device leaf with no host copy, and the host-only nodes below it."""
        assert x.value is not None
        stack = list(x.children.values())
        while stack:
            d = stack.pop()
            stack.extend(d.children.values())
            self.token_to_kv_pool_host.free(d.host_value)  # type: ignore[arg-type]
            self.evictable_host_leaves.discard(d)
        x.children = {}
        self.dropped_tokens_total += len(x.value)
        return super()._evict_leaf(x)

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots (write_back: duplicates first), then delete host-only leaves, least
        recently used first."""
        num_evicted = self._reclaim_host_duplicates(num_tokens) if self.write_policy == "write_back" else 0
        heap = [(n.last_access_time, n.id, n) for n in self.evictable_host_leaves]
        heapq.heapify(heap)
        while num_evicted < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x.host_ref_counter > 0:
                continue
            parent = x.parent
            self.token_to_kv_pool_host.free(x.host_value)  # type: ignore[arg-type]
            num_evicted += len(x.host_value)  # type: ignore[arg-type]
            self._delete_leaf(x)
            if parent in self.evictable_host_leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))  # type: ignore[union-attr]
        return num_evicted

    def _delete_leaf(self, x: TreeNode) -> None:
        self.evictable_host_leaves.discard(x)
        self.host_duplicates.pop(x.id, None)
        super()._delete_leaf(x)

    def _update_leaf_status(self, node: TreeNode) -> None:
        super()._update_leaf_status(node)
        if node.evicted and not node.children:
            self.evictable_host_leaves.add(node)
        else:
            self.evictable_host_leaves.discard(node)

    # ----------------------------------------------------------------- load back (H -> D)
    def load_back(self, last_host_node: TreeNode) -> list[int] | None:
        """Load the host-only run ending at ``last_host_node`` into L1, all of it or nothing.

        Device slots are allocated *before* the copy, evicting the device shortfall with the
        device ancestor locked; if the pool still cannot serve every token, nothing is loaded.
        """
        nodes_to_load: list[TreeNode] = []
        node = last_host_node
        while node.evicted:
            nodes_to_load.insert(0, node)
            node = node.parent  # type: ignore[assignment]
        ancestor = node
        host_indices = [s for n in nodes_to_load for s in n.host_value]  # type: ignore[union-attr]
        if len(host_indices) < self.load_back_threshold:
            return None
        self.inc_lock_ref(ancestor)
        for n in nodes_to_load:
            n.host_ref_counter += 1
        self.evict_to_free_tokens(len(host_indices))
        device_indices = self.token_to_kv_pool_allocator.alloc(len(host_indices))
        for n in nodes_to_load:
            n.host_ref_counter -= 1
        self.dec_lock_ref(ancestor)
        if device_indices is None:
            return None
        self.store.copy("host", host_indices, "device", device_indices)
        offset = 0
        for n in nodes_to_load:
            n.value = device_indices[offset : offset + len(n.host_value)]  # type: ignore[arg-type]
            offset += len(n.value)
            self.evictable_size_ += len(n.value)
        for n in (ancestor, *nodes_to_load):
            self._update_leaf_status(n)
        self.inc_lock_ref(last_host_node)  # protected until the load ack is polled
        self.ongoing_load_back.append(last_host_node)
        for n in nodes_to_load:
            self._loading[n] = last_host_node
        self.load_back_tokens_total += len(device_indices)
        return device_indices

    def host_used_tokens(self) -> int:
        return self.token_to_kv_pool_host.used_size()

    def host_total_tokens(self) -> int:
        return self.token_to_kv_pool_host.size
