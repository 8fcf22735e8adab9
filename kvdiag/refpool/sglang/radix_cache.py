"""SGLang's radix prefix tree over the L1 pool (``mem_cache/radix_cache.py: RadixCache``).

The tree is where SGLang's three pool states come from:

* a node's ``value`` is the list of device slots holding its tokens' KV;
* ``lock_ref > 0`` (some running request's path) -> its tokens count in ``protected_size_``;
* ``lock_ref == 0`` -> ``evictable_size_``: cached, reclaimable on demand, reported as free;
* every slot the allocator has not handed out is ``available``.

Eviction is on demand only: ``evict(n)`` pops least-recently-used *evictable leaves* (unlocked,
no device-resident child) and frees whole leaves until at least ``n`` tokens are freed, so it can
overshoot by up to one leaf. Access times come from a logical clock (SGLang uses
``time.monotonic()``) so runs are reproducible; only their order matters to LRU.

Nodes also carry ``host_value`` (HiCache L2 slots). A node whose ``value`` is None is *evicted*:
host-only, counted in neither ``evictable`` nor ``protected``. The plain tree never produces such
nodes; ``hicache.HiRadixCache`` does, and reuses the matching/splitting code here unchanged.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from collections.abc import Hashable, Sequence

from mypy_extensions import mypyc_attr

from kvdiag.refpool.sglang.allocator import TokenToKVPoolAllocator
from kvdiag.refpool.types import KVStore, NullStore

_node_ids = itertools.count()
_STRIDE = 64  # tokens compared per slice in key_match (page size 1)


@dataclass(eq=False)
class TreeNode:
    """One radix node (SGLang ``TreeNode``); ``key`` is the token run it adds to its parent."""

    key: tuple[int, ...]
    value: list[int] | None  # device slots; None once demoted to host only
    parent: TreeNode | None = None
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    hit_count: int = 0
    host_value: list[int] | None = None  # HiCache host slots (None: not backed up)
    host_ref_counter: int = 0  # pins host_value against host eviction while it is being loaded
    id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None


@dataclass
class MatchResult:
    """``base_prefix_cache.MatchResult``: device hit, the node ending it, and the host tail."""

    device_indices: list[int]
    last_device_node: TreeNode
    last_host_node: TreeNode  # deepest matched node; host-only when host_hit_length > 0
    host_hit_length: int = 0


@mypyc_attr(allow_interpreted_subclasses=True)  # as HiRadixCache, its subclass (hicache.py)
class RadixCache:
    """Prefix tree with lock_ref and the protected / evictable counters."""

    def __init__(
        self, allocator: TokenToKVPoolAllocator, page_size: int = 1, store: KVStore | None = None
    ) -> None:
        if allocator.page_size != page_size:
            raise ValueError("tree and allocator must use the same page_size")
        self.token_to_kv_pool_allocator = allocator
        self.page_size = page_size
        self.store: KVStore = store if store is not None else NullStore()
        self.root_node = TreeNode(key=(), value=[], lock_ref=1, host_value=[])
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        # (last_access_time, id, node) of every evictable leaf, kept across ``evict`` calls;
        # entries go stale (the node left the set or was touched since) and are skipped lazily.
        self._leaf_heap: list[tuple[int, int, TreeNode]] = []
        self.evicted_tokens_total = 0  # sglang:evicted_tokens_total
        self._clock = 0

    # ----------------------------------------------------------------- keys and time
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _page_align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def get_child_key(self, key: Sequence[int]) -> Hashable:
        """Children are keyed by their first token (page_size 1) or first page."""
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _child_key_at(self, key: tuple[int, ...], pos: int) -> Hashable:
        """``get_child_key(key[pos:])`` without copying the rest of the key."""
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def key_match(self, key0: Sequence[int], key1: Sequence[int]) -> int:
        """Length of the common prefix, in whole pages (``_key_match_paged``); both are tuples.

        The engine compares token by token. Here the shorter length is compared at once (C-speed
        tuple equality: a walk matches most nodes' keys in full), and a divergence is found by
        halving the differing range down to a stride, then walked. Same answer, a few Python
        steps instead of one per token of a 2k-token prompt.
        """
        n = min(len(key0), len(key1))
        if key0[:n] == key1[:n]:
            i = n
        else:
            lo, hi = 0, n  # key0[:lo] == key1[:lo], and they differ before hi
            while hi - lo > _STRIDE:
                mid = (lo + hi) // 2
                if key0[lo:mid] == key1[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            while key0[lo] == key1[lo]:
                lo += 1
            i = lo
        ps = self.page_size
        return i if ps == 1 else i // ps * ps

    def _match_len(self, node_key: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """``key_match(node_key, key[pos:])``, copying no more of ``key`` than ``node_key`` is long."""
        return self.key_match(node_key, key[pos : pos + len(node_key)])

    # ----------------------------------------------------------------- public API
    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``key`` (page-aligned), splitting a node at the divergence.

        Device-resident nodes form the hit; host-only nodes continuing it are the host hit
        (HiCache ``match_prefix``: walk up from the deepest match while it is evicted).
        """
        key = tuple(key[: self._page_align(len(key))])
        path = self._match_path(key)
        last_host_node = path[-1] if path else self.root_node
        node, host_hit_length = last_host_node, 0
        while node.evicted:
            host_hit_length += len(node.key)
            node = node.parent  # type: ignore[assignment]
        device_indices = list(itertools.chain.from_iterable(n.value for n in path if not n.evicted))  # type: ignore[misc]
        return MatchResult(device_indices, node, last_host_node, host_hit_length)

    def touch_prefix(self, key: Sequence[int]) -> None:
        """``match_prefix`` for what it does to the tree (access times, a split at the
        divergence) when its result is not read, as a waiting-queue refresh does."""
        self._match_path(tuple(key[: self._page_align(len(key))]))

    def insert(self, key: Sequence[int], value: Sequence[int], inserted_len: int = 0) -> int:
        """Insert ``key`` -> ``value``; return how many leading tokens were already cached.
        (``value`` may run on past ``key``: only its first ``len(key)`` slots are read.)

        The caller frees its own slots for that already-cached prefix (they are duplicates).
        The new suffix becomes one node and adds to ``evictable_size_`` (``_insert_helper``).
        ``inserted_len``: how much of ``key`` the inserting request inserted before; a node
        ending within it is not a new hit (HiCache's hit count: "Nodes this request already
        inserted were counted back then").
        """
        n = self._page_align(len(key))
        key = tuple(key[:n])
        value = value if isinstance(value, list) else list(value)  # sliced below, never kept whole
        t = self._tick()
        node = self.root_node
        node.last_access_time = t
        total_prefix_length = pos = 0
        while pos < n and (child := node.children.get(self._child_key_at(key, pos))) is not None:
            node = child
            node.last_access_time = t
            prefix_len = self._match_len(node.key, key, pos)
            if prefix_len < len(node.key):
                node = self._split_node(node, prefix_len)
            end = pos + prefix_len
            total_prefix_length += self._insert_matched(node, value[pos:end], end > inserted_len)
            pos = end
        if pos < n:
            # A new node is stamped when it is created, after the walk's access time
            # (``TreeNode.__init__``: time.monotonic()), so it is younger than its path.
            rest = key[pos:]
            new_node = TreeNode(key=rest, value=value[pos:n], parent=node, last_access_time=self._tick())
            node.children[self.get_child_key(rest)] = new_node
            self.evictable_size_ += len(rest)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            self._insert_new(new_node, n > inserted_len)
        return total_prefix_length

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node``'s path; nodes going 0 -> 1 move from evictable to protected.

        Returns the change of ``evictable_size_`` (<= 0), like SGLang's ``delta``.
        """
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Mirror of ``inc_lock_ref``: nodes going 1 -> 0 move back to evictable."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref below zero on node {node.id}")
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent  # type: ignore[assignment]
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (if that many are evictable), LRU leaf first.

        Whole leaves only, so the result can exceed ``num_tokens`` by up to one leaf. A parent
        joins the heap once its last device child is gone and it is unlocked.

        SGLang heapifies every evictable leaf on each call; with thousands of cached leaves
        that is most of a full pool's time. The heap here persists instead (``_leaf_heap``) and
        pops the same leaves in the same order: each pop is the least (access time, id) among
        the evictable leaves as they are now, because every leaf has an entry no later than
        its access time (pushed when it became a leaf; times only grow), and an entry whose
        leaf has gone or been touched since is dropped or pushed again with the new time.
        """
        heap, leaves = self._leaf_heap, self.evictable_leaves
        if len(heap) > 2 * len(leaves) + 64:  # mostly stale entries: rebuild
            heap[:] = [(n.last_access_time, n.id, n) for n in leaves]
            heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            t, _, x = heapq.heappop(heap)
            if x not in leaves:
                continue
            if x.last_access_time != t:
                heapq.heappush(heap, (x.last_access_time, x.id, x))
                continue
            num_evicted += self._evict_leaf(x)  # a parent left evictable is pushed by _update_leaf_status
        self.evicted_tokens_total += num_evicted
        return num_evicted

    def evict_to_free_tokens(self, num_tokens: int) -> int:
        """``allocator/base.py: evict_to_free_tokens``: evict only the shortfall.

        ``shortfall = num_tokens - available``; nothing is evicted when the pool already has room.
        """
        shortfall = num_tokens - self.token_to_kv_pool_allocator.available_size()
        return self.evict(shortfall) if shortfall > 0 else 0

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Device tokens held by the tree (recounted by walking it)."""
        return sum(len(n.value) for n in self.iter_nodes() if n.value is not None)

    def iter_nodes(self) -> list[TreeNode]:
        """Every node except the root."""
        out: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    # ----------------------------------------------------------------- internals
    def _match_path(self, key: tuple[int, ...]) -> list[TreeNode]:
        """Nodes matched by ``key`` from the root down (``_match_prefix_helper``)."""
        t = self._tick()
        node = self.root_node
        node.last_access_time = t
        path: list[TreeNode] = []
        pos, n = 0, len(key)
        while pos < n and (child := node.children.get(self._child_key_at(key, pos))) is not None:
            child.last_access_time = t
            prefix_len = self._match_len(child.key, key, pos)
            if prefix_len < len(child.key):
                path.append(self._split_node(child, prefix_len))
                break
            path.append(child)
            node = child
            pos += prefix_len
        return path

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Turn ``parent -> child`` into ``parent -> new_node -> child`` at ``split_len``.

        The new upper segment copies ``lock_ref`` (same requests hold it), so the counters do
        not move; device and host slot lists are split alike.
        """
        parent = child.parent
        assert parent is not None
        new_node = TreeNode(
            key=child.key[:split_len],
            value=None if child.evicted else child.value[:split_len],  # type: ignore[index]
            parent=parent,
            lock_ref=child.lock_ref,
            last_access_time=self._tick(),  # created now (``TreeNode.__init__``), not the child's time
            hit_count=child.hit_count,
            host_value=None if child.host_value is None else child.host_value[:split_len],
        )
        parent.children[self.get_child_key(child.key)] = new_node
        child.key = child.key[split_len:]
        if child.value is not None:
            child.value = child.value[split_len:]
        if child.host_value is not None:
            child.host_value = child.host_value[split_len:]
        child.parent = new_node
        new_node.children[self.get_child_key(child.key)] = child
        self._update_leaf_status(new_node)
        return new_node

    def _insert_matched(self, node: TreeNode, value: list[int], new_hit: bool) -> int:
        """An existing node fully covered by an insert: its tokens count as already cached.
        ``new_hit``: the node ends past what the inserting request inserted before."""
        return len(node.key)

    def _insert_new(self, node: TreeNode, new_hit: bool) -> None:
        """Hook for a node just created by ``insert`` (HiCache write-through starts here)."""

    def _evict_leaf(self, x: TreeNode) -> int:
        """Free a leaf's device slots and delete it; return tokens freed."""
        assert x.value is not None
        self.token_to_kv_pool_allocator.free(x.value)
        freed = len(x.value)
        self._delete_leaf(x)
        return freed

    def _delete_leaf(self, x: TreeNode) -> None:
        parent = x.parent
        assert parent is not None
        del parent.children[self.get_child_key(x.key)]
        if not x.evicted:
            self.evictable_size_ -= len(x.key)
        self.evictable_leaves.discard(x)
        self._update_leaf_status(parent)

    def _update_leaf_status(self, node: TreeNode) -> None:
        """Keep ``evictable_leaves`` = unlocked device nodes with no device-resident child."""
        children = node.children
        evictable = (
            not node.evicted
            and node.lock_ref == 0
            and (not children or all(c.evicted for c in children.values()))  # a leaf skips the scan
        )
        if evictable:
            if node not in self.evictable_leaves:
                self.evictable_leaves.add(node)
                heapq.heappush(self._leaf_heap, (node.last_access_time, node.id, node))
        else:
            self.evictable_leaves.discard(node)
