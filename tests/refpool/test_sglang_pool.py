"""Exact-number and property tests of the SGLang reference pool (facts/engine-mechanics.md §1)."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import fields, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.refpool.sglang.allocator import TokenToKVPoolAllocator
from kvdiag.refpool.sglang.hicache import HiRadixCache, HostKVCache
from kvdiag.refpool.sglang.invariants import check_tree_invariants
from kvdiag.refpool.sglang.prefill_budget import (
    AddReqResult,
    NewTokenRatioTracker,
    PrefillAdder,
    PrefillBudget,
)
from kvdiag.refpool.sglang.radix_cache import RadixCache, TreeNode
from kvdiag.refpool.sglang.schedule_batch import Req, alloc_decode, check_decode_mem, get_decode_retraction_order
from kvdiag.refpool.sglang.scheduler import SGLangScheduler, default_max_running_requests
from kvdiag.refpool.sglang.stats import SchedulerCounters
from kvdiag.refpool.types import SimRequest, StepPlan, prefix_keys
from tests.refpool.lockstep import lockstep_step


class RecordingStore:
    """KVStore remembering the key written to every slot of each tier; logs copies."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[int, int]] = {"device": {}, "host": {}}
        self.copies: list[tuple[str, str, int]] = []

    def write(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> None:
        assert len(slots) == len(keys)
        self.tiers[tier].update(zip(slots, keys))

    def copy(self, src_tier: str, src_slots: Sequence[int], dst_tier: str, dst_slots: Sequence[int]) -> None:
        assert len(src_slots) == len(dst_slots)
        vals = [self.tiers[src_tier][s] for s in src_slots]
        self.tiers[dst_tier].update(zip(dst_slots, vals))
        self.copies.append((src_tier, dst_tier, len(src_slots)))

    def verify(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> bool:
        return [self.tiers[tier].get(s) for s in slots] == list(keys)


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def put(tree: RadixCache, key: Sequence[int], store: RecordingStore | None = None) -> int:
    """Insert ``key`` with fresh slots the way the scheduler does (free the duplicate prefix)."""
    n = len(key) // tree.page_size * tree.page_size
    slots = tree.token_to_kv_pool_allocator.alloc(n)
    assert slots is not None
    if store is not None:
        store.write("device", slots, prefix_keys(key[:n]))
    prefix = tree.insert(key, slots)
    if prefix:
        tree.token_to_kv_pool_allocator.free(slots[:prefix])
    if isinstance(tree, HiRadixCache):
        tree.check_hicache_events()  # the write-through ack, polled at the scheduler's next iteration
    return prefix


def make_req(prompt: Sequence[int], max_new: int, output: Sequence[int] = (), ignore_eos: bool = False) -> Req:
    sim = SimRequest("r", 0.0, tuple(prompt), max_new, max_new, ignore_eos=ignore_eos, output=list(output))
    return Req(sim, max_new_tokens=max_new)


def step(s: SGLangScheduler, t: float = 0.0) -> tuple[StepPlan, list[SimRequest]]:
    plan = s.schedule(t)
    return plan, s.update_from_output(plan, t)


def kind(plan: StepPlan) -> str:
    if not plan.chunks:
        return "idle"
    return "prefill" if plan.chunks[0].is_prefill else "decode"


# ============================================================================ allocator
def test_allocator_slots_start_at_one_and_freed_slots_queue_at_the_back() -> None:
    """need_sort=False (every mode but PD disaggregation): freed slots go to the back of the
    free list in the order given, never sorted (0.5.23's oracle takes them in that order)."""
    a = TokenToKVPoolAllocator(6)
    assert a.available_size() == 6
    assert a.alloc(4) == [1, 2, 3, 4]  # slot 0 is the padding slot
    a.free([3, 1])
    assert a.available_size() == 4
    assert a.alloc(3) == [5, 6, 3]
    assert a.alloc(1) == [1]
    assert a.alloc(1) is None


def test_decode_takes_the_batch_slots_in_one_alloc_like_the_engine() -> None:
    """alloc_token_slots(bs): one take from the front of the free list for the whole batch."""
    a = TokenToKVPoolAllocator(6)
    tree = RadixCache(a)
    a.alloc(4)  # 1-4 taken; 5, 6 free
    a.free([3, 1])  # queued behind 5, 6
    reqs = [make_req([7, 8], 4), make_req([9], 4), make_req([10], 4)]
    assert alloc_decode(reqs, tree) == [5, 6, 3]
    assert [r.kv_indices for r in reqs] == [[5], [6], [3]] and a.available_size() == 1


def test_allocator_rejects_double_free_and_padding() -> None:
    a = TokenToKVPoolAllocator(8)
    slots = a.alloc(3)
    assert slots == [1, 2, 3]
    a.free(slots)
    with pytest.raises(ValueError, match="double free"):
        a.free([2])
    with pytest.raises(ValueError, match="double free"):
        a.free([5])  # never allocated
    with pytest.raises(ValueError, match="outside"):
        a.free([0])
    b = a.alloc(2)
    with pytest.raises(ValueError, match="double free"):
        a.free([b[0], b[0]])
    assert a.available_size() == 6  # the failed free changed nothing


def test_allocator_checks_large_frees_as_small_ones() -> None:
    """Hundreds of slots at once (a prefill, an eviction) take the vectorised ownership path:
    the same refusals, and a refused free changes nothing."""
    a = TokenToKVPoolAllocator(1000)
    held = a.alloc(300)
    assert held == list(range(1, 301)) and all(a.is_allocated(s) for s in held)
    for bad, match in ((held[:150] + [500] + held[150:], "double free: page 500"), (held + [held[7]], "named twice"),
                       (held + [0], "outside")):
        with pytest.raises(ValueError, match=match):
            a.free(bad)
        assert a.available_size() == 700 and all(a.is_allocated(s) for s in held)
    a.free(held)
    assert a.available_size() == 1000 and not any(a.is_allocated(s) for s in held)
    with pytest.raises(ValueError, match="double free: page 1 "):
        a.free(held)
    assert a.alloc(1000) is not None and a.available_size() == 0


def test_paged_allocator_hands_out_whole_pages() -> None:
    a = TokenToKVPoolAllocator(16, page_size=4)
    assert a.alloc(8) == [4, 5, 6, 7, 8, 9, 10, 11]  # pages 1 and 2 (page 0 is padding)
    with pytest.raises(ValueError, match="pages"):
        a.alloc(3)
    a.free([5])  # one slot names its whole page
    assert a.available_size() == 12
    with pytest.raises(ValueError, match="double free"):
        a.free([6])
    with pytest.raises(ValueError, match="multiple"):
        TokenToKVPoolAllocator(10, page_size=4)



def test_paged_free_group_returns_pages_first_released_first() -> None:
    """Outside a group each paged free goes to the front (the last freed is taken first); a
    batch's result processing is one free group, whose pages come back in release order."""
    a = TokenToKVPoolAllocator(16, page_size=4)
    a.alloc(16)
    a.free([4])
    a.free([8])
    assert a.alloc(4) == [8, 9, 10, 11] and a.alloc(4) == [4, 5, 6, 7]  # every page held again
    with a.free_group():
        a.free([4, 5])
        a.free([9])
        assert a.available_size() == 0  # held until the group ends, as SGLang's group holds them
    assert a.available_size() == 8
    assert a.alloc(4) == [4, 5, 6, 7] and a.alloc(4) == [8, 9, 10, 11]


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_numbering_agrees_with_a_plain_free_list(page_size: int) -> None:
    """The free-list numbering (no per-page work in ``alloc``) against a plain model, a list
    and an owned set: random takes, frees to the back (page 1) or front (paged), free groups,
    double frees inside and outside them, small and vectorised sizes. After every operation the
    same free list, the same owned pages, the same refusals; a refused free changes nothing.
    An allocator that stopped checking (``u``), given the same accepted operations, keeps the
    same free list."""
    rng = random.Random(page_size)
    num_pages = 300
    a = TokenToKVPoolAllocator(num_pages * page_size, page_size)
    u = TokenToKVPoolAllocator(num_pages * page_size, page_size)
    u.stop_checking()
    assert a.checking and not u.checking
    free, owned = list(range(1, num_pages + 1)), set()

    def release(pages: list[int], group: list[int] | None) -> None:
        slots = [p * page_size + rng.randrange(page_size) for p in pages]
        if page_size > 1:
            pages = list(dict.fromkeys(pages))  # any slot names its page, and a page is freed once
        bad = [p for p in pages if p not in owned]
        if bad or (page_size == 1 and len(set(pages)) != len(pages)):
            with pytest.raises(ValueError, match="double free"):
                a.free(slots)
            return
        a.free(slots)
        u.free(slots)
        owned.difference_update(pages)
        if page_size == 1:
            free.extend(pages)
        elif group is not None:
            group.extend(pages)
        else:
            free[:0] = pages

    for _ in range(150):
        if rng.random() < 0.5 and free:
            k = rng.choice([1, 3, 70, 150])
            got = a.alloc(k * page_size)
            assert u.alloc(k * page_size) == got
            if k > len(free):
                assert got is None
            else:
                taken, free[:k] = free[:k], []
                assert got == [p * page_size + o for p in taken for o in range(page_size)]
                owned.update(taken)
        elif owned:
            held = sorted(owned, key=lambda p: rng.random())
            picks = [held[: rng.choice([1, 5, 80])], held[:3] + [held[0]], held[:70] + [free[0]] if free else held[:1]]
            if page_size > 1 and rng.random() < 0.5:
                group: list[int] = []
                with a.free_group(), u.free_group():
                    for pages in rng.sample(picks, 2):
                        release(pages, group)
                free[:0] = group
            else:
                release(rng.choice(picks), None)
        assert a._free[a._head :] == free and a.available_size() == len(free) * page_size
        assert u._free[u._head :] == free and u.available_size() == len(free) * page_size
        assert [p for p in range(num_pages + 2) if a.is_allocated(p * page_size)] == sorted(owned)
    with pytest.raises(RuntimeError, match="keeps no page numbers"):
        u.is_allocated(page_size)

def test_paged_decode_evicts_a_page_per_request_before_it_allocates() -> None:
    """alloc_paged_token_slots_decode evicts for bs * page_size even when no row needs a new
    page: check_decode_mem spares the cached leaf, the decode allocation does not."""
    tree = RadixCache(TokenToKVPoolAllocator(16, page_size=4), page_size=4)
    put(tree, seq(1, 4))  # page 1, unlocked: evictable
    held = tree.token_to_kv_pool_allocator.alloc(8)  # pages 2 and 3
    assert held is not None
    reqs = [make_req((1,), 10), make_req((2,), 10)]
    reqs[0].kv_indices, reqs[1].kv_indices = held[0:2], held[4:6]  # both mid-page
    assert check_decode_mem(reqs, tree) and tree.evicted_tokens_total == 0
    assert alloc_decode(reqs, tree) == [10, 14]
    assert tree.evicted_tokens_total == 4 and tree.evictable_size() == 0
    assert tree.token_to_kv_pool_allocator.available_size() == 8

# ============================================================================ radix cache
def test_insert_counts_only_the_new_suffix_as_evictable() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    assert put(tree, seq(1, 6)) == 0
    assert tree.evictable_size() == 6 and tree.protected_size() == 0
    assert put(tree, (1, 2, 3, 9, 9)) == 3  # shares 3 tokens: split, 2 new
    assert tree.evictable_size() == 8 and tree.total_size() == 8
    assert tree.token_to_kv_pool_allocator.available_size() == 64 - 8
    check_tree_invariants(tree, [])


def test_match_prefix_splits_at_divergence_and_returns_the_slots() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    put(tree, seq(1, 6))
    (node,) = tree.root_node.children.values()
    slots = list(node.value)  # type: ignore[arg-type]
    m = tree.match_prefix((1, 2, 3, 4, 7))
    assert m.device_indices == slots[:4]
    assert m.last_device_node.key == (1, 2, 3, 4)
    assert m.host_hit_length == 0
    (upper,) = tree.root_node.children.values()
    assert upper is m.last_device_node and [c.key for c in upper.children.values()] == [(5, 6)]
    assert tree.evictable_size() == 6  # a split moves nothing between counters
    check_tree_invariants(tree, [])


def test_paged_tree_matches_and_stores_whole_pages_only() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64, page_size=4), page_size=4)
    assert put(tree, seq(1, 10)) == 0
    assert tree.evictable_size() == 8  # the 2-token tail is not cached
    assert len(tree.match_prefix(seq(1, 7)).device_indices) == 4
    assert len(tree.match_prefix((1, 2, 3, 4, 5, 6, 9, 9)).device_indices) == 4  # diverges inside page 2
    check_tree_invariants(tree, [])



@pytest.mark.parametrize("page_size", [1, 4])
def test_key_match_is_the_token_by_token_common_prefix(page_size: int) -> None:
    """The halving search finds the engine's answer (``_key_match_page_size1`` / ``_paged``: the
    first differing token, floored to a page) wherever the keys diverge: inside the first
    stride, past many, at the last token, nowhere, with either key the shorter."""
    tree = RadixCache(TokenToKVPoolAllocator(64, page_size=page_size), page_size=page_size)
    rng = random.Random(7)
    base = tuple(rng.randrange(50) for _ in range(700))
    for n0 in (0, 1, 5, 63, 64, 65, 300, 700):
        for diverge in (0, 1, 3, 64, 127, 128, 129, 299, 699, None):
            key1 = list(base)
            if diverge is not None:
                key1[diverge] += 100
            for a, b in ((base[:n0], tuple(key1)), (tuple(key1), base[:n0])):
                common = 0
                while common < min(len(a), len(b)) and a[common] == b[common]:
                    common += 1
                assert tree.key_match(a, b) == common // page_size * page_size, (n0, diverge)

def test_lock_ref_moves_tokens_exactly_on_zero_one_transitions() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    put(tree, seq(1, 6))
    put(tree, (1, 2, 3, 7, 8))
    x = tree.match_prefix((1, 2, 3)).last_device_node
    a = tree.match_prefix(seq(1, 6)).last_device_node
    b = tree.match_prefix((1, 2, 3, 7, 8)).last_device_node
    assert (len(x.key), len(a.key), len(b.key)) == (3, 3, 2)
    assert tree.inc_lock_ref(b) == -5  # x and b go 0 -> 1
    assert (tree.evictable_size(), tree.protected_size()) == (3, 5)
    assert tree.inc_lock_ref(a) == -3  # x is already locked: only a moves
    assert (tree.evictable_size(), tree.protected_size(), x.lock_ref) == (0, 8, 2)
    assert tree.dec_lock_ref(b) == 2  # b 1 -> 0; x 2 -> 1 stays protected
    assert (tree.evictable_size(), tree.protected_size()) == (2, 6)
    check_tree_invariants(tree, [a])
    tree.dec_lock_ref(a)
    assert (tree.evictable_size(), tree.protected_size()) == (8, 0)
    with pytest.raises(AssertionError, match="below zero"):
        tree.dec_lock_ref(a)


def test_evict_lru_whole_leaves_overshoots_and_returns_slots() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    put(tree, seq(1, 5))  # a: 5 tokens
    put(tree, seq(10, 3))  # b: 3 tokens
    put(tree, seq(20, 8))  # c: 8 tokens
    tree.match_prefix(seq(1, 5))  # a becomes most recently used
    assert tree.evict(2) == 3  # LRU leaf b, whole: overshoot 1
    assert tree.evict(4) == 8  # next LRU c: overshoot 4
    assert tree.evictable_size() == 5 and tree.evicted_tokens_total == 11
    assert tree.token_to_kv_pool_allocator.available_size() == 64 - 5
    assert tree.match_prefix(seq(1, 5)).device_indices  # a survived
    check_tree_invariants(tree, [])


def test_evict_pushes_the_parent_once_its_children_are_gone_and_spares_locked_nodes() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(64))
    put(tree, (1, 2, 3, 4))
    put(tree, (1, 2, 5, 6))  # x=(1,2) with leaves (3,4) and (5,6)
    assert tree.evict(5) == 6  # both leaves (4), then x (2)
    assert tree.total_size() == 0
    put(tree, (1, 2, 3, 4))
    put(tree, (1, 2, 5, 6))
    leaf = tree.match_prefix((1, 2, 3, 4)).last_device_node
    tree.inc_lock_ref(leaf)
    assert tree.evict(100) == 2  # only (5,6): x has a locked child
    assert (tree.evictable_size(), tree.protected_size()) == (0, 4)
    check_tree_invariants(tree, [leaf])


def test_evict_to_free_tokens_evicts_only_the_shortfall() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(20))
    put(tree, seq(1, 4))
    put(tree, seq(10, 6))
    tree.match_prefix(seq(10, 6))  # the 4-token leaf is the LRU one
    held = tree.token_to_kv_pool_allocator.alloc(8)
    assert held is not None and tree.token_to_kv_pool_allocator.available_size() == 2
    assert tree.evict_to_free_tokens(2) == 0  # already enough room
    assert tree.evict_to_free_tokens(5) == 4  # shortfall 3 -> one whole 4-token leaf
    assert tree.token_to_kv_pool_allocator.available_size() == 6


# ============================================================================ HiCache
def test_host_pool_size_formula() -> None:
    assert HostKVCache(100, 2.0, 1).size == 201  # int(100*2) // 1 + 1 pages
    assert HostKVCache(100, 2.0, 4).size == 204  # (200 // 4 + 1) * 4
    assert HostKVCache(100, 0.5, 1).size == 51


def test_write_through_backs_up_at_insert_and_eviction_demotes() -> None:
    store = RecordingStore()
    tree = HiRadixCache(TokenToKVPoolAllocator(64), store=store, hicache_write_policy="write_through")
    put(tree, seq(1, 12), store)
    assert tree.backup_tokens_total == 12 and tree.host_used_tokens() == 12
    assert store.copies == [("device", "host", 12)]
    assert tree.evict(1) == 12  # demote: device slots freed, node kept host-only
    assert tree.evictable_size() == 0 and tree.total_size() == 0 and tree.host_used_tokens() == 12
    assert tree.token_to_kv_pool_allocator.available_size() == 64
    m = tree.match_prefix(seq(1, 12))
    assert (m.device_indices, m.last_device_node, m.host_hit_length) == ([], tree.root_node, 12)
    assert store.verify("host", m.last_host_node.host_value, prefix_keys(seq(1, 12)))  # type: ignore[arg-type]
    check_tree_invariants(tree, [])


def test_write_through_selective_backs_up_on_the_second_insert_hit() -> None:
    tree = HiRadixCache(TokenToKVPoolAllocator(64), hicache_write_policy="write_through_selective")
    put(tree, seq(1, 12))
    assert tree.backup_tokens_total == 0
    assert tree.evict(1) == 12 and tree.dropped_tokens_total == 12  # no host copy: dropped
    put(tree, seq(1, 12))
    put(tree, seq(1, 12))  # hit count 2
    assert tree.backup_tokens_total == 12
    check_tree_invariants(tree, [])


def test_write_back_copies_at_eviction_then_host_lru_then_drops() -> None:
    store = RecordingStore()
    # device 30 tokens, host int(30*0.5)+1 = 16 slots
    tree = HiRadixCache(TokenToKVPoolAllocator(30), store=store, hicache_ratio=0.5, hicache_write_policy="write_back")
    put(tree, seq(1, 10), store)  # a
    put(tree, seq(100, 8), store)  # b
    assert tree.backup_tokens_total == 0  # nothing copied at insert
    assert tree.evict(1) == 10  # a (LRU): written back, then demoted
    assert tree.backup_tokens_total == 10 and tree.host_used_tokens() == 10
    assert tree.evict(1) == 8  # b: host has 6 free -> host LRU evicts a's copy, then b is backed up
    assert tree.host_used_tokens() == 8 and tree.match_prefix(seq(1, 10)).host_hit_length == 0
    assert tree.dropped_tokens_total == 0
    put(tree, seq(200, 20), store)  # c: larger than the whole host pool
    # Host LRU gives up b's copy for room, the backup still fails (20 > 16 slots): c is dropped.
    assert tree.evict(1) == 20 and tree.dropped_tokens_total == 20
    assert tree.match_prefix(seq(200, 20)).host_hit_length == 0
    assert tree.match_prefix(seq(100, 8)).host_hit_length == 0 and tree.host_used_tokens() == 0
    check_tree_invariants(tree, [])


def test_load_back_needs_device_slots_first_and_is_all_or_nothing() -> None:
    store = RecordingStore()
    tree = HiRadixCache(TokenToKVPoolAllocator(32), store=store)
    put(tree, seq(1, 20), store)
    tree.evict(1)  # demoted to host
    m = tree.match_prefix(seq(1, 20))
    assert m.host_hit_length == 20
    held = tree.token_to_kv_pool_allocator.alloc(15)  # leaves 17 free < 20 needed
    assert held is not None
    assert tree.load_back(m.last_host_node) is None  # not a partial load
    assert tree.token_to_kv_pool_allocator.available_size() == 17 and tree.load_back_tokens_total == 0
    assert tree.match_prefix(seq(1, 20)).host_hit_length == 20
    tree.token_to_kv_pool_allocator.free(held[:5])
    loaded = tree.load_back(tree.match_prefix(seq(1, 20)).last_host_node)
    assert loaded is not None and len(loaded) == 20
    assert tree.token_to_kv_pool_allocator.available_size() == 2
    assert store.copies[-1] == ("host", "device", 20)
    assert store.verify("device", loaded, prefix_keys(seq(1, 20)))
    m2 = tree.match_prefix(seq(1, 20))
    assert (m2.device_indices, m2.host_hit_length) == (loaded, 0)
    assert tree.protected_size() == 20  # locked until the load ack is polled
    tree.check_hicache_events()
    assert tree.evictable_size() == 20 and tree.load_back_tokens_total == 20
    check_tree_invariants(tree, [])


def test_load_back_skips_runs_below_the_threshold() -> None:
    tree = HiRadixCache(TokenToKVPoolAllocator(32))
    put(tree, seq(1, 9))
    tree.evict(1)
    assert tree.load_back(tree.match_prefix(seq(1, 9)).last_host_node) is None
    assert tree.token_to_kv_pool_allocator.available_size() == 32


def test_insert_over_a_host_only_node_revives_it_with_the_new_slots() -> None:
    store = RecordingStore()
    tree = HiRadixCache(TokenToKVPoolAllocator(64), store=store)
    put(tree, seq(1, 12), store)
    tree.evict(1)
    # Recomputed prefix: insert reports 0 cached tokens, so the caller keeps (gives) its slots.
    assert put(tree, seq(1, 16), store) == 0
    m = tree.match_prefix(seq(1, 16))
    assert len(m.device_indices) == 16 and m.host_hit_length == 0
    assert store.verify("device", m.device_indices, prefix_keys(seq(1, 16)))
    assert tree.evictable_size() == 16 and tree.host_used_tokens() == 16
    check_tree_invariants(tree, [])


# ============================================================================ admission budget
def test_new_token_ratio_schedule() -> None:
    t = NewTokenRatioTracker()
    assert (t.init, t.min) == (0.7, pytest.approx(0.098))
    assert t.decay == pytest.approx((0.7 - 0.098) / 600)
    for _ in range(300):
        t.decay_step()
    assert t.current == pytest.approx(0.7 - 300 * t.decay)
    for _ in range(400):
        t.decay_step()
    assert t.current == t.min
    t.reset()
    assert t.current == 0.7
    hi = NewTokenRatioTracker(schedule_conservativeness=2.0)
    assert (hi.init, hi.min) == (1.0, pytest.approx(0.14))


def test_ratio_estimate_after_retract_formula() -> None:
    kept = [make_req((1,), 100, output=range(5)), make_req((2,), 200, output=range(10))]
    assert NewTokenRatioTracker.estimate_after_retract(kept) == pytest.approx((15 + 40) / 301)
    assert NewTokenRatioTracker.estimate_after_retract([make_req((1,), 10, output=range(5))]) == 1.0


def test_prefill_budget_reserve_is_page_rounded() -> None:
    b = PrefillBudget(RadixCache(TokenToKVPoolAllocator(64)))
    b.reserve(10, 50)
    assert (b.total_offset, b.current_offset) == (61, 11)
    b4 = PrefillBudget(RadixCache(TokenToKVPoolAllocator(64, page_size=4), page_size=4))
    b4.reserve(10, 50)
    assert (b4.total_offset, b4.current_offset) == (66, 16)  # ceil_page(10)=12, +4


def adder_for(tree: RadixCache, running: list[Req] | None = None, ratio: float = 0.7, rem_input: int = 16384, chunk: int | None = None) -> PrefillAdder:
    return PrefillAdder(tree, running or [], ratio, rem_input, chunk)


def test_admission_test_is_strict() -> None:
    for max_new, expected in ((48, AddReqResult.CONTINUE), (49, AddReqResult.NO_TOKEN)):
        tree = RadixCache(TokenToKVPoolAllocator(100))
        req = make_req(seq(1, 50), max_new)
        req.init_next_round_input(tree)
        adder = adder_for(tree)
        # total = 50 + max_new + 1 page; admitted only if total < 100 (avail + evictable)
        assert adder.add_one_req(req) is expected
        assert len(adder.can_run_list) == (expected is AddReqResult.CONTINUE)


def test_admission_locks_the_matched_prefix_during_the_check() -> None:
    for max_new, expected in ((48, AddReqResult.CONTINUE), (49, AddReqResult.NO_TOKEN)):
        tree = RadixCache(TokenToKVPoolAllocator(100))
        put(tree, seq(1, 40))  # 40 cached evictable tokens
        req = make_req(seq(1, 50), max_new)
        req.init_next_round_input(tree)
        assert (len(req.prefix_indices), req.extend_input_len) == (40, 10)
        # While locked the prefix is not reclaimable: remaining = 60 avail + 0 evictable.
        assert adder_for(tree).add_one_req(req) is expected
        if expected is AddReqResult.CONTINUE:
            assert (tree.evictable_size(), tree.protected_size()) == (0, 40)  # committed lock
        else:
            assert (tree.evictable_size(), tree.protected_size()) == (40, 0)  # temp lock released


def test_running_requests_reserve_ratio_of_remaining_output() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(1000))
    running = [make_req((1,), 100, output=range(10)), make_req((2,), 100, output=range(10), ignore_eos=True)]
    adder = adder_for(tree, running, ratio=0.5)
    assert adder.memory_budget.total_offset == pytest.approx(90 * 0.5 + 90 * 1.0)
    big = make_req((1,), 5000)
    assert PrefillAdder(tree, [big], 0.5, 16384, None).memory_budget.total_offset == 4096 * 0.5  # clipped


def test_the_clip_setting_bounds_every_output_admission_charges() -> None:
    """SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (``clip_max_new_tokens``): the running requests'
    reserve and the next request's output are charged at most the clip; at 64 a request asking
    500 tokens is admitted where the default charges all 500 and refuses it."""
    tree = RadixCache(TokenToKVPoolAllocator(1000))
    running = [make_req((1,), 500, output=range(10), ignore_eos=True)]
    assert PrefillAdder(tree, running, 0.5, 16384, None, clip_max_new_tokens=64).memory_budget.total_offset == 64
    for clip, expected in ((64, AddReqResult.CONTINUE), (4096, AddReqResult.NO_TOKEN)):
        req = make_req(seq(100, 300), 500)
        req.init_next_round_input(tree)
        adder = PrefillAdder(tree, running, 0.5, 16384, None, clip_max_new_tokens=clip)
        assert adder.add_one_req(req) is expected  # 300 + min(500, clip) + 1 against 1000 - min(490, clip)


def test_max_prefill_tokens_cap_lets_the_first_request_through() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(1000))
    adder = adder_for(tree, rem_input=100)
    first, second = make_req(seq(1, 150), 10), make_req(seq(500, 30), 10)
    for r in (first, second):
        r.init_next_round_input(tree)
    assert adder.add_one_req(first) is AddReqResult.OTHER  # admitted; rem_input now <= 0
    assert adder.can_run_list == [first]
    adder2 = adder_for(tree, rem_input=100)
    small = make_req(seq(900, 60), 10)
    small.init_next_round_input(tree)
    assert adder2.add_one_req(small) is AddReqResult.CONTINUE  # rem_input 40 left
    assert adder2.add_one_req(second) is AddReqResult.CONTINUE  # 30 < 40
    third = make_req(seq(700, 20), 10)
    third.init_next_round_input(tree)
    assert adder2.add_one_req(third) is AddReqResult.OTHER  # 20 >= 10 left, not first
    assert third not in adder2.can_run_list


def test_chunked_prefill_truncates_reserves_no_output_then_continues() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(1000))
    req = make_req(seq(1, 150), 20)
    req.init_next_round_input(tree)
    adder = adder_for(tree, chunk=64)
    assert adder.add_one_req(req) is AddReqResult.OTHER  # chunk budget used up
    assert adder.new_chunked_req is req and req.extend_input_len == 64
    assert adder.memory_budget.total_offset == 64 + 1  # no output reserved for a partial chunk
    req.kv_indices = tree.token_to_kv_pool_allocator.alloc(64)  # type: ignore[assignment]
    nxt = adder_for(tree, chunk=64)
    assert nxt.add_chunked_req(req) is req and req.extend_input_len == 64
    req.kv_indices += tree.token_to_kv_pool_allocator.alloc(64)  # type: ignore[operator]
    last = adder_for(tree, chunk=64)
    assert last.add_chunked_req(req) is None and req.extend_input_len == 22
    assert last.memory_budget.total_offset == 22 + 1 + 20  # final chunk reserves max_new


def test_chunked_continuation_uses_a_full_chunk_when_budget_is_gone() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(100))
    req = make_req(seq(1, 90), 5)
    req.kv_indices = tree.token_to_kv_pool_allocator.alloc(20)  # type: ignore[assignment]
    running = [make_req((1,), 4000)]  # reserves 4000 * 0.7: remaining_total < 0
    adder = PrefillAdder(tree, running, 0.7, 16384, 32)
    assert adder.memory_budget.remaining_total < 0
    assert adder.add_chunked_req(req) is req and req.extend_input_len == 32


# ============================================================================ decode check / retraction order
def test_check_decode_mem_evicts_exactly_the_shortfall_at_leaf_granularity() -> None:
    tree = RadixCache(TokenToKVPoolAllocator(20))
    put(tree, seq(1, 5))
    held = tree.token_to_kv_pool_allocator.alloc(14)
    assert held is not None and tree.token_to_kv_pool_allocator.available_size() == 1
    reqs = [make_req((1,), 10) for _ in range(3)]  # page 1: need = bs = 3
    assert check_decode_mem(reqs, tree)
    assert tree.evicted_tokens_total == 5  # shortfall 2, one whole 5-token leaf
    assert tree.token_to_kv_pool_allocator.available_size() == 6
    assert not check_decode_mem([make_req((1,), 10) for _ in range(7)], tree)


def test_retraction_order_fewest_output_then_longest_prompt() -> None:
    reqs = [
        make_req(seq(0, 10), 50, output=range(3)),
        make_req(seq(0, 20), 50, output=range(1)),
        make_req(seq(0, 30), 50, output=range(1)),
        make_req(seq(0, 5), 50, output=range(5)),
    ]
    order = get_decode_retraction_order(reqs)
    assert [order.pop() for _ in range(4)] == [2, 1, 0, 3]


# ============================================================================ scheduler
def test_default_max_running_requests() -> None:
    assert default_max_running_requests(500_000, 32768) == 4096  # int(500000/32768*512)=7812 -> 4096
    assert default_max_running_requests(100_000, 32768) == 2048
    assert default_max_running_requests(1000, 32768) == 500  # max_total // 2


def test_retract_decode_scenario_exact() -> None:
    """Pool 200: A (prompt 30) and B (prompt 20) over-commit through the 0.7 ratio."""
    s = SGLangScheduler(200, context_len=1000, debug=True)
    a = SimRequest("A", 0.0, seq(1, 30), 100, 100)
    b = SimRequest("B", 0.0, seq(100, 20), 79, 79)
    c = SimRequest("C", 0.0, seq(200, 10), 20, 20)
    s.add_request(a)
    assert kind(step(s)[0]) == "prefill"
    s.add_request(b)  # 20 + 79 + 1 = 100 < 170 - 99*0.7 = 100.7: admitted
    assert [ch.req.rid for ch in step(s)[0].chunks] == ["B"]
    s.add_request(c)  # refused: the latch is set while A and B decode
    plan, _ = step(s)
    assert kind(plan) == "decode" and plan.blocked_on_kv and s.batch_is_full
    for _ in range(200):
        plan = s.schedule(0.0)
        if plan.evicted:
            break
        s.update_from_output(plan, 0.0)
    # Pool full at 76 outputs each (30+75 + 20+75 = 200). Tie on outputs -> longest prompt: A.
    assert [r.rid for r in plan.evicted] == ["A"]
    assert (len(a.output), len(b.output), a.evictions) == (76, 76, 1)
    assert [r.sim.rid for r in s.waiting_queue] == ["C", "A"]  # re-queued at the tail
    assert s.ratio.current == min(1.0, (76 + 20) / (79 + 1))  # estimate over kept B, not init
    assert not s.batch_is_full
    st = s.stats()
    assert (st.num_retracted_requests_total, st.num_retracted_input_tokens_total, st.num_retracted_output_tokens_total) == (1, 30, 76)
    assert st.num_retracted_reqs == 1
    # A's 75 decode tokens freed; its 30-token prompt stays cached, unlocked; B decoded one slot.
    assert (st.kv_available_tokens, st.kv_evictable_tokens, st.kv_protected_tokens) == (74, 30, 20)
    s.update_from_output(plan, 0.0)
    while s.has_work():
        plan, _ = step(s)
        if any(ch.req is a for ch in plan.chunks if ch.is_prefill):
            (ch,) = [ch for ch in plan.chunks if ch.req is a]
            assert (ch.num_context_tokens, ch.num_new_tokens) == (30, 76)  # prompt re-hit, outputs recomputed
    assert a.recomputed_tokens == 76 and a.device_hit_tokens == 0
    assert len(a.output) == 100 and len(b.output) == 79 and len(c.output) == 20
    st = s.stats()
    # A's re-prefill (30 hit + 76 recomputed) is excluded from the hit-rate counters.
    assert (st.cached_tokens_device_total, st.prefill_effective_input_tokens_total) == (0, 30 + 20 + 10)


def two_running(steps: int) -> tuple[SGLangScheduler, SimRequest, SimRequest]:
    """R1, R2 (prompt 10, max_new 20 each) admitted together, then ``steps`` decode steps."""
    s = SGLangScheduler(100, context_len=1000)
    r1 = SimRequest("R1", 0.0, seq(1, 10), 20, 20)
    r2 = SimRequest("R2", 0.0, seq(50, 10), 20, 20)
    s.add_request(r1)
    s.add_request(r2)
    for _ in range(1 + steps):
        step(s)
    return s, r1, r2


def test_retracted_request_frees_private_kv_then_evicts_20_per_remaining_request() -> None:
    s, r1, r2 = two_running(2)  # outputs 3 each: 10 prompt (tree) + 2 private decode tokens each
    held = s.allocator.alloc(s.allocator.available_size())  # memory held elsewhere: pool full
    assert held is not None and s.allocator.available_size() == 0
    plan = s.schedule(0.0)
    assert [r.rid for r in plan.evicted] == ["R2"]  # tie on output and prompt: last in batch order
    # R2's 2 private tokens freed (available 2 < 20 x 1 remaining), so its now-unlocked 10-token
    # prompt was evicted too; R1 then took one slot for its decode.
    assert s.tree_cache.evicted_tokens_total == 10 and s.tree_cache.evictable_size() == 0
    assert s.allocator.available_size() == 2 + 10 - 1
    assert [ch.req for ch in plan.chunks] == [r1]


def test_last_request_that_cannot_decode_is_aborted_not_retracted() -> None:
    s = SGLangScheduler(100, context_len=1000)
    r = SimRequest("R", 0.0, seq(1, 10), 20, 20)
    s.add_request(r)
    step(s)
    s.allocator.alloc(s.allocator.available_size())  # nothing left, nothing evictable
    plan = s.schedule(0.0)
    assert plan.evicted == [] and plan.chunks == []
    assert s.update_from_output(plan, 0.0) == [r] and len(r.output) == 1
    assert s.stats().num_aborted_requests_total == 1 and not s.waiting_queue


def test_batch_is_full_latch_clears_at_the_next_iteration_after_a_request_leaves() -> None:
    """0.5.23 filters finished requests at the top of every iteration and clears the latch
    there, before it tries to admit ("Every step, not only after a merge")."""
    s = SGLangScheduler(200, context_len=1000, debug=True)
    r1 = SimRequest("R1", 0.0, seq(1, 40), 60, 60)
    r3 = SimRequest("R3", 0.0, seq(100, 20), 30, 3)
    s.add_request(r1)
    s.add_request(r3)
    plan, _ = step(s)  # both fit: 101 < 200, then 51 < 99
    assert [ch.req.rid for ch in plan.chunks] == ["R1", "R3"]
    r2 = SimRequest("R2", 0.0, seq(300, 40), 50, 5)
    s.add_request(r2)
    # remaining = 140 - (59 + 29) * 0.7 = 78.4 <= 40 + 50 + 1: NO_TOKEN, latched
    plan, _ = step(s)
    assert kind(plan) == "decode" and plan.blocked_on_kv and s.batch_is_full
    plan, finished = step(s)
    assert kind(plan) == "decode" and finished == [r3]
    assert s.batch_is_full  # R3 is released but still listed: the flag holds until the filter
    # The next iteration filters R3 out first, clears the latch, and the budget (about 99 > 91)
    # admits R2 at once.
    plan, _ = step(s)
    assert [ch.req.rid for ch in plan.chunks] == ["R2"] and not plan.blocked_on_kv
    assert not s.batch_is_full


def test_prefill_batch_that_becomes_the_running_batch_is_not_latched() -> None:
    """The latch belongs to the batch object: when the running batch is empty, the prefill
    batch becomes the running batch, and its flag was never set."""
    s = SGLangScheduler(100, context_len=1000, debug=True)
    a = SimRequest("A", 0.0, seq(1, 30), 30, 30)
    b = SimRequest("B", 0.0, seq(100, 30), 30, 30)
    s.add_request(a)
    s.add_request(b)  # A fits (30+30+1 < 100); B then does not (remaining 100-61=39 <= 61)
    plan, _ = step(s)
    assert [ch.req.rid for ch in plan.chunks] == ["A"] and plan.blocked_on_kv
    assert not s.batch_is_full  # set on the empty running batch, which A's batch replaced


def test_chunked_prefill_through_the_scheduler() -> None:
    s = SGLangScheduler(1000, context_len=2000, chunked_prefill_size=64, debug=True)
    long_a = SimRequest("A", 0.0, seq(1, 150), 10, 2)
    long_b = SimRequest("B", 0.0, seq(500, 100), 10, 2)
    s.add_request(long_a)
    s.add_request(long_b)
    shapes = []
    for _ in range(4):
        plan, _ = step(s)
        shapes.append([(ch.req.rid, ch.num_context_tokens, ch.num_new_tokens) for ch in plan.chunks])
        if len(shapes) == 1:
            assert plan.blocked_other  # chunk budget spent: B waits
            # the chunk is committed to the tree at the top of the next iteration (0.5.23):
            assert s.tree_cache.protected_size() == 0 and not long_a.output  # the chunk: still private
    assert shapes[:3] == [[("A", 0, 64)], [("A", 64, 64)], [("A", 128, 22), ("B", 0, 42)]]
    assert shapes[3] == [("B", 42, 58)]  # B's continuation: a prefill step, so A does not decode
    assert len(long_a.output) == 1


def test_reports_follow_sglang_cadence() -> None:
    s = SGLangScheduler(1000, context_len=2000, decode_log_interval=3, debug=True)
    s.add_request(SimRequest("A", 0.0, seq(1, 10), 20, 20))
    plan = s.schedule(0.0)
    report = s.take_report()
    assert report is not None and report.kv_available_tokens == 1000  # taken before allocation
    assert s.stats().kv_available_tokens == 990
    s.update_from_output(plan, 0.0)
    assert s.take_report() is None
    for i in range(3):
        step(s)
        assert (s.take_report() is not None) == (i == 2)
    assert s.stats().forward_ct_decode == 3


def test_prefix_hit_is_byte_exact_and_counted() -> None:
    store = RecordingStore()
    s = SGLangScheduler(1000, context_len=2000, store=store, debug=True)
    a = SimRequest("A", 0.0, seq(1, 50), 3, 3)
    s.add_request(a)
    while s.has_work():
        step(s)
    b = SimRequest("B", 0.0, seq(1, 50) + (7, 7), 3, 3)
    s.add_request(b)
    plan = s.schedule(0.0)
    (ch,) = plan.chunks
    assert (ch.num_context_tokens, ch.num_new_tokens) == (50, 2)
    row = s.reqs[b].kv_indices
    assert store.verify("device", row, prefix_keys(b.prompt))
    assert b.device_hit_tokens == 50
    assert s.stats().cached_tokens_device_total == 50
    assert s.stats().cache_hit_rate == pytest.approx(50 / 52)


def test_hicache_load_back_through_admission_is_byte_exact() -> None:
    store = RecordingStore()
    s = SGLangScheduler(100, context_len=1000, enable_hierarchical_cache=True, store=store, debug=True)
    a = SimRequest("A", 0.0, seq(1, 40), 2, 2)
    s.add_request(a)
    while s.has_work():
        step(s)
    tree = s.tree_cache
    assert isinstance(tree, HiRadixCache) and tree.backup_tokens_total == 41  # write_through
    filler = SimRequest("F", 0.0, seq(500, 90), 2, 1)  # needs 90 slots: A's cache is demoted
    s.add_request(filler)
    step(s)
    assert tree.match_prefix(seq(1, 40)).host_hit_length == 40
    b = SimRequest("B", 0.0, seq(1, 40) + (9,) * 5, 2, 2)
    s.add_request(b)
    plan = s.schedule(0.0)
    (ch,) = plan.chunks
    assert (ch.num_context_tokens, ch.num_new_tokens, plan.loaded_tokens) == (40, 5, 40)
    assert store.copies[-1] == ("host", "device", 40)
    assert store.verify("device", s.reqs[b].kv_indices, prefix_keys(b.prompt))
    assert (b.host_hit_tokens, b.device_hit_tokens) == (40, 0)
    assert s.stats().cached_tokens_host_total == 40 and s.stats().load_back_tokens_total == 40


def test_oversized_prompt_is_aborted_and_max_new_is_clamped() -> None:
    s = SGLangScheduler(100, context_len=1000, debug=True)
    huge = SimRequest("H", 0.0, seq(1, 95), 10, 10)  # > max_req_input_len = 99 - 5
    ok = SimRequest("O", 0.0, seq(1, 80), 50, 50)  # max_new clamped to 99 - 80 - 1 = 18
    s.add_request(huge)
    s.add_request(ok)
    finished: list[SimRequest] = []
    while s.has_work():
        finished += step(s)[1]
    assert finished[0] is huge and not huge.output
    assert len(ok.output) == 18
    assert s.stats().num_aborted_requests_total == 1 and s.stats().num_requests_total == 1


def test_kvstorage_end_to_end_with_real_bytes() -> None:
    from kvdiag.refpool.storage import KVStorage

    s0 = SGLangScheduler(128, context_len=1000, enable_hierarchical_cache=True, hicache_write_policy="write_back")
    store = KVStorage(device_slots=128 + 1, host_slots=s0.tree_cache.host_total_tokens(), backend="numpy")  # type: ignore[attr-defined]
    s = SGLangScheduler(128, context_len=1000, enable_hierarchical_cache=True, hicache_write_policy="write_back", store=store, debug=True)
    shared = seq(1, 30)
    for i in range(8):
        s.add_request(SimRequest(f"r{i}", 0.0, shared + seq(100 * (i + 1), 20 + 5 * i), 30, 10 + i))
        while s.has_work():
            step(s)
    assert s.stats().cached_tokens_device_total + s.stats().cached_tokens_host_total > 0


# ============================================================================ properties
tree_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 2), min_size=0, max_size=12), st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(0, 30)),
        st.tuples(st.just("load"), st.lists(st.integers(0, 2), min_size=1, max_size=12)),
        st.tuples(st.just("evict_host"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=tree_ops,
    page_size=st.sampled_from([1, 2]),
    policy=st.sampled_from([None, "write_through", "write_through_selective", "write_back"]),
)
def test_tree_invariants_under_random_operations(ops: list[tuple], page_size: int, policy: str | None) -> None:
    store = RecordingStore()
    allocator = TokenToKVPoolAllocator(32, page_size)
    tree: RadixCache
    if policy is None:
        tree = RadixCache(allocator, page_size, store)
    else:
        tree = HiRadixCache(allocator, page_size, store, hicache_ratio=0.5, hicache_write_policy=policy, load_back_threshold=2)
    locks: list[TreeNode] = []
    for op in ops:
        name = op[0]
        if name == "insert":
            key = tuple(op[1])
            n = len(key) // page_size * page_size
            tree.evict_to_free_tokens(n)
            slots = allocator.alloc(n)
            if slots is not None:
                store.write("device", slots, prefix_keys(key[:n]))
                prefix = tree.insert(key, slots)
                if prefix:
                    allocator.free(slots[:prefix])
        elif name == "match":
            key = tuple(op[1])
            m = tree.match_prefix(key)
            assert len(m.device_indices) % page_size == 0
            assert len(m.device_indices) + m.host_hit_length <= len(key)
            assert store.verify("device", m.device_indices, prefix_keys(key[: len(m.device_indices)]))
            if op[2]:
                tree.inc_lock_ref(m.last_device_node)
                locks.append(m.last_device_node)
        elif name == "unlock" and locks:
            tree.dec_lock_ref(locks.pop(op[1] % len(locks)))
            if isinstance(tree, HiRadixCache):
                tree.check_hicache_events()
        elif name == "evict":
            ev, avail = tree.evictable_size(), allocator.available_size()
            freed = tree.evict(op[1])
            assert freed >= min(op[1], ev)  # leaf granularity may only overshoot
            assert allocator.available_size() - avail == freed == ev - tree.evictable_size()
        elif name == "load" and isinstance(tree, HiRadixCache):
            key = tuple(op[1])
            m = tree.match_prefix(key)
            if m.host_hit_length:
                loaded = tree.load_back(m.last_host_node)
                after = tree.match_prefix(key)
                if loaded is None:
                    assert after.host_hit_length == m.host_hit_length  # nothing partially loaded
                else:
                    assert len(loaded) == m.host_hit_length and after.host_hit_length == 0
                    n = len(after.device_indices)
                    assert store.verify("device", after.device_indices, prefix_keys(key[:n]))
        elif name == "evict_host" and isinstance(tree, HiRadixCache):
            tree.evict_host(op[1])
        pending = tree.ongoing_write_through + tree.ongoing_load_back if isinstance(tree, HiRadixCache) else []
        slots_owned = check_tree_invariants(tree, locks + pending)  # a copy awaiting its ack holds a lock
        assert all(c == 1 for c in slots_owned.values())
        assert len(slots_owned) + allocator.available_size() == 32
        assert tree.evictable_size() + tree.protected_size() == tree.total_size()


class SnapshotEvictTree(HiRadixCache):
    """SGLang's ``evict`` as written: a heap of every evictable leaf, built at each call."""

    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            parent = x.parent
            num_evicted += self._evict_leaf(x)
            if parent in self.evictable_leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self.evicted_tokens_total += num_evicted
        return num_evicted


def tree_shape(tree: RadixCache) -> list[tuple]:
    """Every node's path key, device and host slots and lock: equal trees, equal shapes."""
    out, stack = [], [((), tree.root_node)]
    while stack:
        path, node = stack.pop()
        out.append((path, node.value, node.host_value, node.lock_ref, node.last_access_time))
        stack.extend((path + child.key, child) for child in node.children.values())
    return sorted(out, key=lambda row: row[0])


@settings(max_examples=100, deadline=None)
@given(ops=tree_ops, policy=st.sampled_from(["write_through", "write_back"]))
def test_persistent_eviction_heap_evicts_as_sglang_heapify_per_call(ops: list[tuple], policy: str) -> None:
    """The tree's eviction heap kept across calls evicts the same leaves in the same order as
    SGLang's heap rebuilt at every call, through matches that re-time leaves, locks, demotes,
    load-backs and host evictions (the same operations on both trees, compared after each)."""
    trees = []
    for cls in (HiRadixCache, SnapshotEvictTree):
        alloc = TokenToKVPoolAllocator(24)
        trees.append((cls(alloc, 1, None, hicache_ratio=0.5, hicache_write_policy=policy, load_back_threshold=2), alloc, []))
    for op in ops:
        results = []
        for tree, alloc, locks in trees:
            name, r = op[0], None
            if name == "insert":
                tree.evict_to_free_tokens(len(op[1]))
                slots = alloc.alloc(len(op[1]))
                if slots is not None:
                    r = tree.insert(tuple(op[1]), slots)
                    if r:
                        alloc.free(slots[:r])
            elif name in ("match", "load"):
                m = tree.match_prefix(tuple(op[1]))
                if name == "match" and op[2]:
                    tree.inc_lock_ref(m.last_device_node)
                    locks.append(m.last_device_node)
                elif name == "load" and m.host_hit_length:
                    r = tree.load_back(m.last_host_node)
            elif name == "unlock" and locks:
                tree.dec_lock_ref(locks.pop(op[1] % len(locks)))
            elif name == "evict":
                r = tree.evict(op[1])
            elif name == "evict_host":
                r = tree.evict_host(op[1])
            results.append((r, alloc._free[alloc._head :], tree_shape(tree), tree.evictable_size(), tree.evicted_tokens_total))
        assert results[0] == results[1]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[tuple[int, SimRequest]]]:
    """Random configs and request streams in three shapes. "pressure" trickles in requests that
    run to max_new, sized to the pool: each is admitted while others decode, against their
    remaining output discounted by the ratio, so the pool over-commits and retracts. "reuse"
    spaces out requests on one long prefix so it is evicted (demoted) and loaded back."""
    page_size = draw(st.sampled_from([1, 4]))
    policy = draw(st.sampled_from([None, "write_through", "write_through_selective", "write_back"]))
    pool = draw(st.sampled_from([96, 160, 256]))
    config = dict(
        max_total_num_tokens=pool,
        page_size=page_size,
        context_len=400,
        chunked_prefill_size=draw(st.sampled_from([None, 16, 48])),
        max_prefill_tokens=draw(st.sampled_from([64, 16384])),
        max_running_requests=draw(st.sampled_from([None, 3])),
        enable_hierarchical_cache=policy is not None,
        hicache_write_policy=policy or "write_through",
        hicache_ratio=draw(st.sampled_from([0.5, 2.0])),
    )
    mode = draw(st.sampled_from(["mixed", "pressure", "reuse"]))
    # Two shared prefixes; the second is long enough to be loaded back from host (>= 10 tokens).
    prefixes = [tuple(draw(st.lists(st.integers(0, 3), min_size=n, max_size=40))) for n in (0, 12)]
    reqs = []
    clock = 0
    for i in range(draw(st.integers(1 if mode == "mixed" else 4, 14))):
        suffix = draw(st.lists(st.integers(0, 3), min_size=1, max_size=30 if draw(st.integers(0, 9)) else 100))
        prompt = draw(st.sampled_from(prefixes)) + tuple(suffix)
        ignore_eos = False
        if mode == "pressure":
            max_new = out = draw(st.integers(pool // 6, pool // 3))
            clock += draw(st.integers(0, 6))  # trickling in: admitted against a discounted ratio
        elif mode == "reuse":
            # Alone in the pool, alternating with a filler that pushes the prefix out (demote);
            # the next request re-hits it from host.
            prompt = prefixes[1] + tuple(suffix[:20]) if i % 2 == 0 else seq(1000 * (i + 1), pool // 2)
            max_new = out = draw(st.integers(1, 30))
            clock += draw(st.integers(20, 60))
        else:
            max_new = draw(st.integers(1, 150))
            out = draw(st.integers(max(1, max_new // 2), max_new))
            clock = draw(st.integers(0, 150))
            ignore_eos = draw(st.booleans())  # reserved at ratio 1.0
        reqs.append((clock, SimRequest(f"q{i}", 0.0, prompt, max_new, out, ignore_eos=ignore_eos)))
    return config, sorted(reqs, key=lambda x: x[0])


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_scheduler_invariants_under_random_request_streams(wl: tuple[dict, list[tuple[int, SimRequest]]]) -> None:
    config, arrivals = wl
    s = SGLangScheduler(**config, store=RecordingStore(), debug=True)  # debug: invariants + byte checks
    pending = list(arrivals)
    finished: list[SimRequest] = []
    for t in range(3000):
        while pending and pending[0][0] <= t:
            s.add_request(pending.pop(0)[1])
        if not pending and not s.has_work():
            break
        plan = s.schedule(float(t))
        if plan.chunks:
            assert len({ch.is_prefill for ch in plan.chunks}) == 1  # prefill or decode, never mixed
            assert all(ch.num_new_tokens >= 1 for ch in plan.chunks)
            assert all(ch.num_new_tokens == 1 for ch in plan.chunks if not ch.is_prefill)
        if plan.blocked_on_kv or plan.blocked_other:
            assert s.waiting_queue
        finished += s.update_from_output(plan, float(t))
    else:
        pytest.fail("scheduler did not drain its work")
    assert Counter(id(r) for r in finished) == Counter(id(r) for _, r in arrivals)
    s.idle()  # the loop's next iteration finds nothing to run (idle invariants are checked there)
    stats = s.stats()
    assert stats.num_requests_total + stats.num_aborted_requests_total == len(arrivals)
    assert stats.kv_protected_tokens == 0
    assert stats.kv_available_tokens + stats.kv_evictable_tokens == s.max_total_num_tokens
    done = [r for r in finished if r.output]
    assert stats.generation_tokens_total == sum(len(r.output) for r in done)
    for r in done:
        assert len(r.output) == min(r.output_len, r.max_new_tokens, s.max_req_len - len(r.prompt) - 1)
        assert r.first_token is not None and r.finished is not None


# ============================================================================ batch decode
def pool_state(s: SGLangScheduler) -> tuple:
    """What batch-level decode must keep exactly as step by step after every step: the queues,
    every running row's slots, the free list, the tree, the counters and the published report."""
    return (
        [r.sim.rid for r in s.running_batch], [r.sim.rid for r in s.waiting_queue],
        [list(r.kv_indices) for r in s.running_batch], s.allocator._free[s.allocator._head :],
        tree_shape(s.tree_cache), s.stats(), s.take_report(), s.batch_is_full,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "seed"),
    [
        (dict(max_total_num_tokens=1200, schedule_conservativeness=0.1), 0),  # retractions
        (dict(max_total_num_tokens=3000, max_running_requests=6, chunked_prefill_size=32), 1),  # latch, chunks
        (dict(max_total_num_tokens=2000, context_len=60, decode_log_interval=7), 2),  # max_new clamp, reports
    ],
)
def test_batch_decode_keeps_the_pool_exactly_as_step_by_step(cfg: dict, seed: int) -> None:
    """The same streams (shared prefixes, ignore_eos mixed in) through two schedulers, one
    accounting decodes batch-wise: after every step the same queues, rows, free list, tree,
    counters and report, the same plan totals; at the end (after ``sync``) the same outputs."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(50) for _ in range(rng.randint(0, 30))) for _ in range(3)]
    span, longest = (30, 250) if seed == 0 else (200, 60)  # seed 0: a burst of long answers
    stream = []
    for i in range(50):
        prompt = prefixes[i % 3] + tuple(rng.randrange(50) for _ in range(rng.randint(1, 25)))
        out = rng.randint(1, longest)
        stream.append((rng.randint(0, span), SimRequest(f"q{i}", 0.0, prompt, out + rng.choice([0, 4]), out, i % 5 == 0)))
    stream.sort(key=lambda x: x[0])
    fast, slow = SGLangScheduler(**cfg), SGLangScheduler(**cfg)
    fast.enable_batch_decode()
    assert fast.batch_decode
    done: dict[str, list] = {"fast": [], "slow": []}
    aggregated, retracted, t = 0, 0, 0
    pending = list(stream)
    while pending or fast.has_work() or slow.has_work():
        while pending and pending[0][0] <= t:
            r = pending.pop(0)[1]
            for s in (fast, slow):
                s.add_request(replace(r, output=[]))
        pf, ps = lockstep_step(fast, slow, t, pool_state, done)
        aggregated += pf.decode_batch
        retracted += len(ps.evicted)
        t += 1
        assert t < 5000
    fast.sync()
    assert done["fast"] == done["slow"] and len(done["slow"]) == len(stream)
    assert aggregated > 0 and (retracted > 0 or seed != 0)  # not vacuous


def test_every_scheduler_counter_reaches_the_stats() -> None:
    """``stats()`` copies the counters field by field: each one, set to its own value, reads
    back under its name (a counter added to the scheduler but not copied fails here)."""
    s = SGLangScheduler(max_total_num_tokens=100)
    names = [f.name for f in fields(SchedulerCounters)]
    for i, name in enumerate(names):
        setattr(s.counters, name, 1000 + i)
    st_ = s.stats()
    assert [getattr(st_, name) for name in names] == [1000 + i for i in range(len(names))]
