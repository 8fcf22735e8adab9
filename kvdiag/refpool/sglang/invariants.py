"""Invariants of the SGLang reference pool, checked by recounting from scratch.

The counters SGLang keeps incrementally (``evictable_size_``, ``protected_size_``, lock_ref,
the evictable-leaf sets, the free lists) are recomputed here from the tree and the request rows,
and compared. The pool identity (facts §1.2, page_size 1 generalised to pages):

    max_total = available + evictable + protected + sum(request-private slots)

Every failure raises ``AssertionError`` naming what disagrees.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvdiag.refpool.sglang.hicache import HiRadixCache
from kvdiag.refpool.sglang.radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from kvdiag.refpool.sglang.scheduler import SGLangScheduler


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def check_tree_invariants(tree: RadixCache, lock_holders: list[TreeNode] | None = None) -> Counter[int]:
    """Check the tree's structure and counters; return the device slots it owns (slot -> count).

    With ``lock_holders`` (one entry per lock taken, the node locked), every node's lock_ref must
    equal the number of holders whose path runs through it.
    """
    root = tree.root_node
    _require(root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, not 1")
    evictable = protected = 0
    leaves: set[TreeNode] = set()
    host_leaves: set[TreeNode] = set()
    device_slots: Counter[int] = Counter()
    host_slots: Counter[int] = Counter()
    for n in tree.iter_nodes():
        p = n.parent
        _require(p is not None and p.children.get(tree.get_child_key(n.key)) is n, f"node {n.id} detached")
        _require(len(n.key) > 0 and len(n.key) % tree.page_size == 0, f"node {n.id} key length {len(n.key)}")
        _require(n.lock_ref >= 0, f"node {n.id} lock_ref {n.lock_ref} < 0")
        if n.host_value is not None:
            _require(len(n.host_value) == len(n.key), f"node {n.id} host_value length")
            host_slots.update(n.host_value)
        if n.evicted:
            _require(n.lock_ref == 0, f"host-only node {n.id} is locked")
            _require(n.backuped, f"node {n.id} lost both device and host copies")
            _require(all(c.evicted for c in n.children.values()), f"host-only node {n.id} has a device child")
            if not n.children:
                host_leaves.add(n)
            continue
        assert n.value is not None
        _require(len(n.value) == len(n.key), f"node {n.id} value length {len(n.value)} != key {len(n.key)}")
        device_slots.update(n.value)
        if n.lock_ref:
            protected += len(n.key)
        else:
            evictable += len(n.key)
            if all(c.evicted for c in n.children.values()):
                leaves.add(n)
    _require(evictable == tree.evictable_size_, f"evictable_size_ {tree.evictable_size_} != recount {evictable}")
    _require(protected == tree.protected_size_, f"protected_size_ {tree.protected_size_} != recount {protected}")
    _require(leaves == tree.evictable_leaves, "evictable_leaves out of sync with the tree")
    if isinstance(tree, HiRadixCache):
        _require(host_leaves == tree.evictable_host_leaves, "evictable_host_leaves out of sync")
        host = tree.token_to_kv_pool_host
        _require(all(c == 1 for c in host_slots.values()), "a host slot is owned by two nodes")
        _require(all(host.is_allocated(s) for s in host_slots), "a node holds an unallocated host slot")
        _require(len(host_slots) == host.used_size(), f"host pool used {host.used_size()} != {len(host_slots)}")
    else:
        _require(not host_slots, "plain radix tree holds host slots")
    if lock_holders is not None:
        expected: Counter[int] = Counter()
        for node in lock_holders:
            while node is not root:
                expected[node.id] += 1
                node = node.parent  # type: ignore[assignment]
        for n in tree.iter_nodes():
            _require(n.lock_ref == expected[n.id], f"node {n.id} lock_ref {n.lock_ref} but {expected[n.id]} holders")
    return device_slots


def check_scheduler_invariants(s: SGLangScheduler) -> None:
    """Pool identity, slot ownership, lock accounting and request rows of a scheduler."""
    tree, allocator, ps = s.tree_cache, s.allocator, s.page_size
    holders = [r for r in s.running_batch if not r.finished]
    _require(not set(holders) & set(s.last_batch), "a request is both running and being prefilled")
    holders += [r for r in s.last_batch if not r.finished]
    if s.chunked_req is not None and s.chunked_req not in holders:
        holders.append(s.chunked_req)
    locks = [r.last_node for r in holders if r.last_node is not None]
    if isinstance(tree, HiRadixCache):  # copies awaiting their ack hold a lock too
        locks += tree.ongoing_write_through + tree.ongoing_load_back
    slots = check_tree_invariants(tree, locks)
    private = 0
    for r in holders:
        _require(r.last_node is not None, f"{r.sim.rid} holds KV but no lock")
        _require(r.cache_protected_len % ps == 0, f"{r.sim.rid} cache_protected_len not page-aligned")
        path: list[int] = []
        node = r.last_node
        while node is not None and node is not tree.root_node:
            assert node.value is not None, "a locked path is device-resident"
            path[:0] = node.value
            node = node.parent
        _require(path == r.kv_indices[: r.cache_protected_len], f"{r.sim.rid} row disagrees with its tree path")
        own = r.owned_private_slots(ps)
        _require(len(own) == r.private_tokens(ps), f"{r.sim.rid} private slot count")
        private += len(own)
        slots.update(own)
    for r in s.waiting_queue + [r for r in s.running_batch if r.finished]:
        _require(not r.kv_indices, f"{r.sim.rid} holds KV slots while not running")
    _require(all(c == 1 for c in slots.values()), "a device slot is owned twice")
    _require(all(allocator.is_allocated(x) for x in slots), "an owned slot is free in the allocator")
    available = allocator.available_size()
    _require(len(slots) + available == s.max_total_num_tokens, f"slot leak: owned {len(slots)} + free {available}")
    total = available + tree.evictable_size() + tree.protected_size() + private
    _require(
        total == s.max_total_num_tokens,
        f"pool identity: {available} avail + {tree.evictable_size()} evictable + {tree.protected_size()} "
        f"protected + {private} private = {total} != {s.max_total_num_tokens}",
    )
    _require(len(s.running_batch) <= s.max_running_requests, "running batch exceeds max_running_requests")
