"""Exact-number and property tests of the vLLM V1 reference pool (facts §2.2-§2.6)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.refpool.types import NullStore, SimRequest, StepPlan
from tests.refpool.lockstep import lockstep_step
from kvdiag.refpool.vllm.block_pool import BlockHashToBlockMap, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from kvdiag.refpool.vllm.kv_cache_manager import KVCacheManager, cdiv
from kvdiag.refpool.vllm.offload import CPUOffloadingManager, OffloadingConnector
from kvdiag.refpool.vllm.request import Request, RequestStatus
from kvdiag.refpool.vllm.scheduler import VLLMScheduler


class RecordingStore:
    """KVStore that remembers the key written to every slot, per tier, and logs copies."""

    def __init__(self) -> None:
        self.tiers: dict[str, dict[int, int]] = {"device": {}, "host": {}}
        self.copies: list[tuple[str, str, int]] = []
        self.verified_slots = 0

    def write(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> None:
        assert len(slots) == len(keys)
        self.tiers[tier].update(zip(slots, keys))

    def copy(self, src_tier: str, src_slots: Sequence[int], dst_tier: str, dst_slots: Sequence[int]) -> None:
        assert len(src_slots) == len(dst_slots)
        src, dst = self.tiers[src_tier], self.tiers[dst_tier]
        for s, d in zip(src_slots, dst_slots):
            if s in src:
                dst[d] = src[s]
            else:
                dst.pop(d, None)
        self.copies.append((src_tier, dst_tier, len(src_slots)))

    def verify(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> bool:
        self.verified_slots += len(slots)
        t = self.tiers[tier]
        return all(t.get(s) == k for s, k in zip(slots, keys))


def toks(base: int, n: int) -> tuple[int, ...]:
    return tuple(range(base, base + n))


def sim(rid: str, prompt: Sequence[int], out: int = 1, max_new: int | None = None) -> SimRequest:
    return SimRequest(rid, 0.0, tuple(prompt), max_new if max_new is not None else out, out)


def req(rid: str, prompt: Sequence[int], block_size: int = 16) -> Request:
    return Request(sim(rid, prompt), block_size)


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def step(s: VLLMScheduler, t: float = 0.0) -> tuple[StepPlan, list[SimRequest]]:
    plan = s.schedule(t)
    return plan, s.update_from_output(plan, t)


def chunks(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    return [(c.req.rid, c.num_new_tokens, c.num_context_tokens, c.is_prefill) for c in plan.chunks]


def run_to_completion(s: VLLMScheduler, max_steps: int = 10_000) -> list[SimRequest]:
    done: list[SimRequest] = []
    for t in range(max_steps):
        if not s.has_work():
            return done
        done += step(s, float(t))[1]
    raise AssertionError("scheduler did not drain")


# ---------------------------------------------------------------- block pool


def test_free_queue_operations_keep_order_and_count() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    q.remove(blocks[3])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 4, 5]
    q.prepend_n([blocks[3], blocks[0]])
    q.append(KVCacheBlock(9))
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 0, 1, 2, 4, 5, 9]
    assert q.num_free_blocks == 7
    assert [b.block_id for b in q.popleft_n(2)] == [3, 0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])  # no longer in the queue
    with pytest.raises(ValueError):
        q.popleft_n(6)


def test_null_block_and_usage_formula() -> None:
    pool = BlockPool(10)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 9 and 0 not in queue_ids(pool)
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3]
    assert pool.get_usage() == pytest.approx(1 - 6 / 9)  # N - 1 = 9 in the denominator
    pool.free_blocks(got)
    assert pool.get_usage() == 0.0 and pool.get_num_free_blocks() == 9
    with pytest.raises(ValueError):
        pool.get_new_blocks(10)


def test_cached_free_blocks_count_as_free_and_a_hit_on_them_raises_usage() -> None:
    pool = BlockPool(10)
    r = req("a", toks(0, 32))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, 16)
    pool.free_blocks(reversed(blocks))
    assert pool.get_usage() == 0.0  # cached but unreferenced = free
    hit = pool.get_cached_block(r.block_hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_id not in queue_ids(pool)
    assert pool.get_usage() == pytest.approx(1 / 9)


def test_free_order_cached_to_tail_uncached_to_head_then_lazy_eviction() -> None:
    pool = BlockPool(10)
    r = req("a", toks(0, 64))
    blocks = pool.get_new_blocks(4)  # ids 1..4
    pool.cache_full_blocks(r, blocks, 0, 2, 16)  # blocks 1, 2 hashed; 3, 4 not
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    got = pool.get_new_blocks(8)
    assert ids(got) == [4, 3, 5, 6, 7, 8, 9, 2]
    assert pool.num_evicted_blocks == 1  # block 2 lost its hash only now, at reuse
    assert pool.get_cached_block(r.block_hashes[1]) is None and got[-1].block_hash is None
    assert pool.get_cached_block(r.block_hashes[0]) is blocks[0]  # block 1 still a hit


def test_hash_map_holds_one_block_or_several_in_caching_order() -> None:
    """A hash names one block, or several where requests cached the same content (vLLM keeps
    them all): a hit takes the first cached, evicting it hands hits to the next, a block id the
    hash does not hold evicts nothing, and a hash leaves the map with its last block."""
    m, b = BlockHashToBlockMap(), [KVCacheBlock(i) for i in range(4)]
    assert m.insert(7, b[1]) and not m.insert(7, b[2]) and not m.insert(7, b[3]) and m.insert(8, b[0])
    assert m.get_one_block(7) is b[1] and m.get_one_block(9) is None
    assert m.pop(7, 0) is None and m.get_one_block(7) is b[1]  # block 0 is not cached under 7
    assert m.pop(7, 1) is b[1] and m.get_one_block(7) is b[2]
    assert m.pop(8, 1) is None and m.get_one_block(8) is b[0]  # a single block kept as it was
    assert m.entries() == [(7, [b[2], b[3]]), (8, [b[0]])]  # a hash popped and kept goes last, as in vLLM
    assert m.pop(7, 2) is b[2] and m.pop(7, 3) is b[3] and 7 not in m and m.pop(7, 3) is None
    assert m.pop(8, 0) is b[0] and m.entries() == []


# ---------------------------------------------------------------- kv cache manager


def test_request_blocks_freed_tail_first() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool)
    a = req("a", toks(0, 40))
    assert ids(kv.allocate_slots(a, 40)) == [1, 2, 3]
    assert kv.num_cached_block["a"] == 2  # 40 tokens: 2 full blocks cached at allocation
    kv.free(a)
    # Reverse order: uncached tail block 3 reused first, then cached 2 before 1 (head of prompt).
    assert queue_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_prefix_hit_full_blocks_only_capped_at_num_tokens_minus_one() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool)
    a_prompt = toks(0, 40)
    a = req("a", a_prompt)
    kv.allocate_slots(a, 40)
    kv.free(a)
    b_blocks, b_hit = kv.get_computed_blocks(req("b", a_prompt))
    assert (ids(b_blocks), b_hit) == ([1, 2], 32)  # the 8-token partial block never hits
    assert ids(kv.get_computed_blocks(req("c", a_prompt[:32]))[0]) == [1]  # cap 31 -> 1 block
    assert kv.get_computed_blocks(req("c2", a_prompt[:32]))[1] == 16
    assert kv.get_computed_blocks(req("d", a_prompt[:33]))[1] == 32  # cap 32 -> 2 blocks
    assert kv.get_computed_blocks(req("e", a_prompt[:16] + toks(500, 20)))[1] == 16
    assert kv.get_computed_blocks(req("f", toks(100, 40)))[1] == 0
    off = KVCacheManager(BlockPool(10, enable_caching=False))
    g = req("g", a_prompt)
    off.allocate_slots(g, 40)
    off.free(g)
    assert off.get_computed_blocks(req("h", a_prompt)) == ([], 0)


def test_repeated_lookup_is_the_walk_through_evictions_and_new_copies() -> None:
    """A blocked head's lookup, repeated every step, is remembered (no second walk) and stays
    exactly the walk's answer: its last hit evicted, a first copy evicted behind a second one,
    another request looked up in between, the hash it missed on cached."""
    pool = BlockPool(16)
    kv = KVCacheManager(pool)
    a, twin, head = req("a", toks(0, 64)), req("twin", toks(0, 64)), req("head", toks(0, 64))
    kv.allocate_slots(a, 64)  # blocks 1-4, all cached
    kv.allocate_slots(twin, 32)  # blocks 5, 6: second copies of a's first two
    kv.free(a)  # a's blocks to the tail, last first: 7-15, 4, 3, 2, 1

    def walked() -> list[int]:  # get_cached_block hash by hash, up to the cap of 63 tokens
        hits = [pool.get_cached_block(h) for h in head.block_hashes[:3]]
        return ids(hits[: hits.index(None)] if None in hits else hits)  # type: ignore[arg-type]

    def lookup() -> list[int]:
        return ids(kv.get_computed_blocks(head)[0])

    assert lookup() == walked() == [1, 2, 3] and pool.walks == 1
    assert lookup() == [1, 2, 3] and pool.walks == 1  # remembered
    held = pool.get_new_blocks(10)  # 7-15 and 4 (cached, past the lookup's cap)
    assert lookup() == walked() == [1, 2, 3] and pool.walks == 1
    pool.get_new_blocks(1)  # block 3: no other copy of its hash, the walk stops there
    assert lookup() == walked() == [1, 2] and pool.walks == 1
    pool.get_new_blocks(1)  # block 2: the twin's copy comes first now
    assert lookup() == walked() == [1, 6] and pool.walks == 1
    assert ids(kv.get_computed_blocks(twin)[0]) == [1, 6] and pool.walks == 2  # another request
    assert lookup() == [1, 6] and pool.walks == 3
    pool.cache_full_blocks(head, held, 0, 3, 16)  # new copies, one of the hash it missed on
    assert lookup() == walked() == [1, 6, held[2].block_id] and pool.walks == 4
    pool.check_invariants()


def test_blocks_are_cached_at_allocation_so_same_step_admissions_hit() -> None:
    s = VLLMScheduler(100, debug=True)
    s.add_request(sim("a", toks(0, 40)))
    s.add_request(sim("b", toks(0, 40)))
    plan, _ = step(s)
    assert chunks(plan) == [("a", 40, 0, True), ("b", 8, 32, True)]
    assert (s.stats().prefix_cache_queries_total, s.stats().prefix_cache_hits_total) == (80, 32)


def test_hit_blocks_in_free_queue_count_toward_need_and_last_block_recompute_evicts() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool)
    a = req("a", toks(0, 64))
    kv.allocate_slots(a, 64)
    kv.free(a)
    assert queue_ids(pool) == [5, 6, 7, 8, 9, 4, 3, 2, 1]
    kv.allocate_slots(req("filler", toks(1000, 80)), 80)
    assert pool.get_num_free_blocks() == 4  # exactly a's four cached blocks
    b = req("b", toks(0, 64) + toks(200, 16))
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 64
    # 5 blocks - 4 hits = 1 new block, + 4 hits leaving the free queue = 5 > 4 free.
    assert kv.get_num_blocks_to_allocate("b", 80, hits) == 5
    assert kv.allocate_slots(b, 16, n_hit, hits) is None
    assert pool.get_num_free_blocks() == 4 and all(h.ref_cnt == 0 for h in hits)
    b2 = req("b2", toks(0, 64))
    hits, n_hit = kv.get_computed_blocks(b2)
    assert n_hit == 48  # cap 63 -> 3 blocks
    new = kv.allocate_slots(b2, 16, n_hit, hits)
    assert ids(new) == [4]  # a's 4th block: popped from the head, its hash evicted...
    assert pool.num_evicted_blocks == 1
    assert pool.get_cached_block(b2.block_hashes[3]) is new[0]  # ...and cached again by b2
    assert pool.get_usage() == 1.0


def test_watermark_applies_to_waiting_and_preempted_only_when_something_is_scheduled() -> None:
    pool = BlockPool(100)
    kv = KVCacheManager(pool, watermark=0.1)
    assert kv.watermark_blocks == 10
    kv.allocate_slots(req("filler", toks(1000, 85 * 16)), 85 * 16, has_scheduled_reqs=False)
    assert pool.get_num_free_blocks() == 14
    w = req("w", toks(0, 80))  # 5 blocks: 5 + 10 > 14
    assert kv.allocate_slots(w, 80, has_scheduled_reqs=True) is None
    w.status = RequestStatus.RUNNING  # running requests never see the watermark
    assert len(kv.allocate_slots(w, 80, has_scheduled_reqs=True)) == 5
    p = req("p", toks(300, 80))
    p.status = RequestStatus.PREEMPTED
    assert kv.allocate_slots(p, 80, has_scheduled_reqs=True) is None  # 5 + 10 > 9
    assert len(kv.allocate_slots(p, 80, has_scheduled_reqs=False)) == 5


def test_full_sequence_must_fit_checks_the_whole_prompt_not_the_chunk() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool)
    kv.allocate_slots(req("filler", toks(1000, 80)), 80)
    assert pool.get_num_free_blocks() == 4
    w = req("w", toks(0, 96))  # 6 blocks
    assert kv.allocate_slots(w, 32, full_sequence_must_fit=True) is None
    assert ids(kv.allocate_slots(w, 32, full_sequence_must_fit=False)) == [6, 7]


def test_scheduler_watermark_blocks_second_admission() -> None:
    kw = dict(num_gpu_blocks=21, block_size=4, max_model_len=80)
    s = VLLMScheduler(watermark=0.25, **kw)  # int(0.25 * 21) = 5 blocks
    s.add_request(sim("r0", toks(0, 40)))
    s.add_request(sim("r1", toks(100, 24)))  # 6 blocks + 5 > 10 free after r0
    plan, _ = step(s)
    assert [c.req.rid for c in plan.chunks] == ["r0"] and plan.blocked_on_kv
    s2 = VLLMScheduler(**kw)
    s2.add_request(sim("r0", toks(0, 40)))
    s2.add_request(sim("r1", toks(100, 24)))
    assert [c.req.rid for c in step(s2)[0].chunks] == ["r0", "r1"]


@pytest.mark.parametrize("reserve, admitted", [(True, False), (False, True)])
def test_scheduler_reserve_full_isl(reserve: bool, admitted: bool) -> None:
    s = VLLMScheduler(
        9, block_size=4, max_num_batched_tokens=8, max_model_len=32, scheduler_reserve_full_isl=reserve
    )
    s.add_request(sim("r0", toks(0, 4), out=20))
    s.add_request(sim("r1", toks(100, 31)))  # 8 blocks > 7 free; its first chunk (4) needs 1
    plan, _ = step(s)
    assert ("r1", 4, 0, True) in chunks(plan) if admitted else chunks(plan) == [("r0", 4, 0, True)]
    assert plan.blocked_on_kv is not admitted


# ---------------------------------------------------------------- scheduler


def test_fcfs_preemption_of_last_running_to_waiting_front_and_no_admission_that_step() -> None:
    s = VLLMScheduler(9, block_size=4, max_model_len=32, debug=True)
    for rid, prompt in (("r0", toks(0, 4)), ("r1", toks(100, 4)), ("r2", toks(200, 8))):
        s.add_request(sim(rid, prompt, out=20))
    plan, _ = step(s)
    assert chunks(plan) == [("r0", 4, 0, True), ("r1", 4, 0, True), ("r2", 8, 0, True)]
    assert s.block_pool.get_num_free_blocks() == 4
    for _ in range(4):
        plan, _ = step(s)
        assert [c.is_prefill for c in plan.chunks] == [False] * 3
    assert s.block_pool.get_num_free_blocks() == 1
    s.add_request(sim("r3", toks(300, 3)))  # 1 block: would fit after r2 is preempted
    plan, _ = step(s)
    r2 = s.requests["r2"]
    assert [r.rid for r in plan.evicted] == ["r2"]
    assert chunks(plan) == [("r0", 1, 8, False), ("r1", 1, 8, False)]  # r3 not admitted
    assert plan.blocked_on_kv
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0 and r2.num_preemptions == 1
    assert r2.sim.evictions == 1 and r2.sim.recomputed_tokens == 12 and s.num_preemptions_total == 1
    assert s.block_pool.get_num_free_blocks() == 2
    # Next step: r2 hits its 2 surviving blocks (its tail block was reused first) but needs
    # 4 - 2 + 2 = 4 > 2 free: refused, and r3 behind it is not tried (head-of-line).
    plan, _ = step(s)
    assert chunks(plan) == [("r0", 1, 9, False), ("r1", 1, 9, False)]
    assert plan.blocked_on_kv and not plan.evicted
    assert s.block_pool.num_evicted_blocks == 1
    done = run_to_completion(s)
    assert sorted(r.rid for r in done) == ["r0", "r1", "r2", "r3"]
    assert s.stats().num_preemptions_total == sum(r.evictions for r in done)


def test_preempting_itself_when_it_is_the_last_running_request() -> None:
    s = VLLMScheduler(4, block_size=4, max_model_len=12, debug=True)
    s.add_request(sim("r0", toks(0, 4), out=8))
    s.add_request(sim("r1", toks(100, 4), out=8))
    step(s)
    plan, _ = step(s)
    assert chunks(plan) == [("r0", 1, 4, False)]
    assert [r.rid for r in plan.evicted] == ["r1"] and [r.request_id for r in s.waiting] == ["r1"]
    assert len(run_to_completion(s)) == 2


def test_max_num_seqs_and_token_budget_block_other() -> None:
    s = VLLMScheduler(100, max_num_seqs=2)
    for i in range(3):
        s.add_request(sim(f"r{i}", toks(100 * i, 10)))
    plan, _ = step(s)
    assert [c.req.rid for c in plan.chunks] == ["r0", "r1"]
    assert plan.blocked_other and not plan.blocked_on_kv

    s = VLLMScheduler(100, max_num_batched_tokens=10)
    for i in range(3):
        s.add_request(sim(f"r{i}", toks(100 * i, 8), out=3))
    plan, _ = step(s)
    assert chunks(plan) == [("r0", 8, 0, True), ("r1", 2, 0, True)]
    assert plan.blocked_other and not plan.blocked_on_kv
    plan, _ = step(s)
    assert chunks(plan) == [("r0", 1, 8, False), ("r1", 6, 2, True), ("r2", 3, 0, True)]
    assert not plan.blocked_other


def test_long_prefill_token_threshold_chunks_prefill_only_beside_another_request() -> None:
    """vLLM 0.33.0 caps a prefill at the threshold only when another request is running or
    waiting: a lone request has nobody to starve and takes the whole budget."""
    s = VLLMScheduler(100, long_prefill_token_threshold=4)
    s.add_request(sim("r0", toks(0, 10), out=2))
    assert chunks(step(s, 0)[0]) == [("r0", 10, 0, True)]
    s.add_request(sim("r1", toks(50, 10), out=2))
    got = [chunks(step(s, t)[0]) for t in range(1, 4)]
    assert got == [
        [("r0", 1, 10, False), ("r1", 4, 0, True)],  # two requests: r1 capped
        [("r1", 6, 4, True)],  # r0 finished at its second token: r1 alone, uncapped
        [("r1", 1, 10, False)],
    ]
    assert s.requests == {}


def test_stats_counters() -> None:
    s = VLLMScheduler(100, debug=True)
    s.add_request(sim("a", toks(0, 40), out=3, max_new=10))  # EOS before max_tokens: "stop"
    step(s, 0.0)
    s.add_request(sim("b", toks(0, 40), out=2, max_new=2))
    run_to_completion(s)
    st_ = s.stats()
    assert (st_.prefix_cache_queries_total, st_.prefix_cache_hits_total) == (80, 32)
    assert st_.prompt_tokens_total == 80 and st_.generation_tokens_total == 5
    assert st_.request_success_total == {"stop": 1, "length": 1}
    assert st_.num_free_blocks == 99 and st_.kv_cache_usage == 0.0
    assert st_.cpu_offload_total_blocks == 0


def test_preempted_requests_excluded_from_prefix_cache_counters() -> None:
    s = VLLMScheduler(9, block_size=4, max_model_len=32, debug=True)
    for rid, prompt in (("r0", toks(0, 4)), ("r1", toks(100, 4)), ("r2", toks(200, 8))):
        s.add_request(sim(rid, prompt, out=20))
    done = run_to_completion(s)
    pcs = s.kv_cache_manager.prefix_cache_stats
    assert pcs.queries == 16 and pcs.requests == 3  # first admissions only
    assert pcs.preempted_requests == sum(r.evictions for r in done) > 0


def test_add_request_validation() -> None:
    with pytest.raises(ValueError):
        VLLMScheduler(4, block_size=4, max_model_len=13)  # 4 blocks > 3 usable
    s = VLLMScheduler(4, block_size=4)
    assert s.max_model_len == 12
    with pytest.raises(ValueError):
        s.add_request(sim("long", toks(0, 12)))
    s.add_request(sim("ok", toks(0, 11)))
    with pytest.raises(ValueError):
        s.add_request(sim("ok", toks(0, 3)))


def test_check_invariants_detects_corruption() -> None:
    s = VLLMScheduler(20, block_size=4)
    s.add_request(sim("r0", toks(0, 10), out=5))
    step(s)
    s.check_invariants()
    s.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt != 1 tables"):
        s.check_invariants()


# ---------------------------------------------------------------- CPU offloading


def test_offload_write_through_stores_full_blocks_after_each_step() -> None:
    store = RecordingStore()
    s = VLLMScheduler(20, block_size=4, max_model_len=76, kv_offloading_blocks=64, store=store, debug=True)
    s.add_request(sim("r0", toks(0, 10), out=3))
    stored = [step(s, t)[0].stored_tokens for t in range(3)]
    # 10 prompt tokens -> 2 full blocks; the 3rd fills at token 12, a decoded one: not stored
    # (offload_prompt_only, vLLM 0.33.0's default)
    assert stored == [8, 0, 0]
    assert s.stats().cpu_offload_used_blocks == 2 and not s.has_work()
    # GPU eviction of r0's cached blocks never copies anything: only r1's own blocks are stored.
    s.add_request(sim("r1", toks(100, 72)))
    plan, _ = step(s, 3)
    assert plan.stored_tokens == 72 and s.block_pool.num_evicted_blocks == 2
    assert sum(n for src, dst, n in store.copies if (src, dst) == ("device", "host")) == 80
    assert s.stats().cpu_offload_used_blocks == 20


def test_offload_cpu_pool_evicts_lru_when_full() -> None:
    s = VLLMScheduler(20, block_size=4, max_model_len=40, kv_offloading_blocks=4, debug=True)
    s.add_request(sim("r0", toks(0, 12)))
    step(s, 0)
    s.add_request(sim("r1", toks(100, 8)))
    plan, _ = step(s, 1)
    st_ = s.stats()
    assert plan.stored_tokens == 8
    assert st_.cpu_offload_used_blocks == st_.cpu_offload_total_blocks == 4
    assert st_.cpu_offload_evicted_blocks_total == 1
    r0_hashes = Request(sim("x", toks(0, 12)), 4).block_hashes
    # touch() left r0's prefix most recent, so its last block was the LRU victim.
    assert s.connector is not None and s.connector.manager.lookup(r0_hashes) == 2


def test_cpu_pool_lru_eviction_skips_in_flight_and_pinned_blocks() -> None:
    m = CPUOffloadingManager(3)
    assert m.prepare_store([1, 2]).store_block_ids == [0, 1]
    assert m.lookup([1, 2]) == 0  # store in flight: not readable yet
    assert m.prepare_store([3, 4]) is None  # 1 free, and in-flight blocks are not evictable
    m.complete_store([1, 2])
    assert m.lookup([1, 2, 3]) == 2
    out = m.prepare_store([3, 4])
    assert (out.block_hashes_evicted, out.store_block_ids) == ([1], [2, 0])
    m.complete_store([3, 4])
    m.touch([2, 3])  # prefix order: 2 becomes the most recent
    assert list(m.blocks) == [4, 3, 2]
    assert m.prepare_store([5]).block_hashes_evicted == [4]
    m.complete_store([5])
    m.prepare_load([3])  # pinned while loading
    assert m.prepare_store([6]).block_hashes_evicted == [2]
    assert m.prepare_store([7]).block_hashes_evicted == [5]  # 3 pinned, 6 in flight
    assert m.prepare_store([8]) is None  # nothing evictable left
    m.complete_load([3])
    m.complete_store([6, 7])
    assert m.prepare_store([3, 8]).block_hashes_evicted == [6]  # LRU 3 is protected: part of this store
    assert m.num_evicted_blocks == 5
    assert m.num_used_blocks == 3


def _offload_scheduler(store: RecordingStore) -> VLLMScheduler:
    """r0 (12 tokens) stored on CPU; r1 then reuses two of r0's three GPU blocks."""
    s = VLLMScheduler(6, block_size=4, max_model_len=20, kv_offloading_blocks=16, store=store, debug=True)
    s.add_request(sim("r0", toks(0, 12)))
    step(s, 0)
    s.add_request(sim("r1", toks(100, 16)))
    step(s, 1)
    assert s.block_pool.num_evicted_blocks == 2
    return s


def test_offload_load_allocates_gpu_blocks_before_the_copy() -> None:
    store = RecordingStore()
    s = _offload_scheduler(store)
    s.add_request(sim("r2", toks(0, 12)))
    n_copies = len(store.copies)
    plan = s.schedule(2)
    r2 = s.requests["r2"]
    # local hit 4 (block 1), CPU hit 8: the whole prompt, which never loads synchronously (a token
    # must be left to compute), so r2 waits for the load with 3 GPU blocks held, scheduled nothing...
    assert chunks(plan) == [] and plan.loaded_tokens == 8 and r2.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ids(s.kv_cache_manager.get_blocks("r2")) == [1, 2, 3] and s.kv_cache_manager.num_cached_block["r2"] == 1
    assert s.block_pool.get_num_free_blocks() == 2 and s.block_pool.num_evicted_blocks == 4
    assert len(store.copies) == n_copies  # ...and nothing copied yet
    s.update_from_output(plan, 2)
    assert store.copies[n_copies] == ("host", "device", 8)
    assert (r2.sim.device_hit_tokens, r2.sim.host_hit_tokens) == (4, 8)
    st_ = s.stats()
    # Queries are the tokens past the local hit: r0 12 + r1 16 + r2 (12 - 4); only r2 hits.
    assert (st_.external_prefix_cache_queries_total, st_.external_prefix_cache_hits_total) == (36, 8)
    assert plan.stored_tokens == 0  # already on CPU
    assert s.stats().num_requests_waiting == 1 and not s.waiting
    # Landed: its blocks are cached and the last token is recomputed to sample the next one.
    plan, _ = step(s, 3)
    assert chunks(plan) == [("r2", 1, 11, True)] and plan.loaded_tokens == 0
    assert store.verified_slots >= 12


@pytest.mark.parametrize("budget", [8, 0, None])
def test_offload_sync_load_budget_decides_which_loads_are_asynchronous(budget: int | None) -> None:
    """A hit loads synchronously while the step's budget (tokens) holds it and a token is left to
    compute; the budget is the step's, reset when the step's metadata is built."""
    c = OffloadingConnector(16, 4, NullStore(), sync_load_tokens=budget)
    stored = Request(sim("s", toks(0, 12)), 4).block_hashes
    c.manager.prepare_store(stored)
    c.manager.complete_store(stored)

    def lookup(rid: str, prompt: tuple[int, ...]) -> tuple[int, bool]:
        return c.get_num_new_matched_tokens(Request(sim(rid, prompt), 4), 0)

    always_async = budget == 0  # vLLM's default
    assert lookup("a", toks(0, 13)) == (12, budget is not None)  # 12 > 8: over the budget
    assert lookup("b", toks(0, 8) + toks(50, 5)) == (8, always_async)
    assert lookup("c", toks(0, 8) + toks(60, 5)) == (8, budget is not None)  # the step's budget is spent
    assert lookup("d", toks(0, 12)) == (12, True)  # a full hit leaves nothing to compute
    c.build_connector_meta([])
    assert lookup("e", toks(0, 8) + toks(70, 5)) == (8, always_async)


def test_offload_cpu_hit_does_not_help_admission() -> None:
    s = VLLMScheduler(6, block_size=4, max_model_len=20, kv_offloading_blocks=16, debug=True)
    s.add_request(sim("r0", toks(0, 12)))
    step(s, 0)
    s.add_request(sim("r1", toks(100, 12), out=8))
    step(s, 1)
    s.add_request(sim("r2", toks(0, 12)))  # all 12 tokens on CPU, only 4 on GPU
    plan, _ = step(s, 2)
    assert [c.req.rid for c in plan.chunks] == ["r1"]
    assert plan.blocked_on_kv and plan.loaded_tokens == 0
    assert s.connector is not None and s.connector.manager.lookup(s.requests["r2"].block_hashes) == 3


# ---------------------------------------------------------------- byte-exact KV


def test_corrupted_device_prefix_is_detected_on_hit() -> None:
    for corrupt in (False, True):
        store = RecordingStore()
        s = VLLMScheduler(20, block_size=4, max_model_len=64, store=store)
        s.add_request(sim("r0", toks(0, 8)))
        step(s)
        x = Request(sim("x", toks(0, 8)), 4)
        blk = s.block_pool.get_cached_block(x.block_hashes[0])
        assert blk is not None and store.tiers["device"][blk.block_id * 4 + 3] == x.token_keys[3]
        if corrupt:
            store.tiers["device"][blk.block_id * 4] = 12345
        s.add_request(sim("r1", toks(0, 8) + toks(50, 4)))
        plan = s.schedule(1)
        assert chunks(plan) == [("r1", 4, 8, True)]
        if corrupt:
            with pytest.raises(AssertionError, match="does not match"):
                s.update_from_output(plan, 1)
        else:
            s.update_from_output(plan, 1)


def test_corrupted_host_copy_is_detected_on_load() -> None:
    store = RecordingStore()
    s = _offload_scheduler(store)
    last_of_block_1 = Request(sim("x", toks(0, 8)), 4).token_keys[7]
    host_slot = next(slot for slot, key in store.tiers["host"].items() if key == last_of_block_1)
    store.tiers["host"][host_slot] = 999
    s.add_request(sim("r2", toks(0, 12)))
    plan, _ = step(s, 2)  # a full hit: loaded asynchronously, read by the next step's forward
    assert plan.loaded_tokens == 8
    plan = s.schedule(3)
    with pytest.raises(AssertionError, match="does not match"):
        s.update_from_output(plan, 3)


# ---------------------------------------------------------------- properties


class _Hashes:
    """Stand-in request for ``cache_full_blocks``: one hash per call."""

    def __init__(self, h: int) -> None:
        self.request_id = f"h{h}"
        self.block_hashes = [h]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 10),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "touch", "cache"]), st.integers(0, 50), st.integers(1, 4)
        ),
        max_size=60,
    ),
)
def test_block_pool_matches_a_list_model(n: int, ops: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(n)
    model_queue = list(range(1, n))
    ref = [0] * n
    model_hash: dict[int, list[int]] = {}  # hash -> block ids in insertion order
    held: list[KVCacheBlock] = []
    for op, a, b in ops:
        if op == "alloc":
            k = a % (len(model_queue) + 1)
            got = pool.get_new_blocks(k)
            assert ids(got) == model_queue[:k]
            for bid in model_queue[:k]:
                for h, lst in list(model_hash.items()):
                    if bid in lst:
                        lst.remove(bid)
                        if not lst:
                            del model_hash[h]
                ref[bid] += 1
            model_queue = model_queue[k:]
            held += got
        elif op == "free" and held:
            chosen = [held.pop((a + i) % len(held)) for i in range(min(b, len(held)))]
            pool.free_blocks(chosen)
            head, tail = [], []
            for blk in chosen:
                ref[blk.block_id] -= 1
                if ref[blk.block_id] == 0:
                    (tail if blk.block_hash is not None else head).append(blk.block_id)
            model_queue = head + model_queue + tail
        elif op == "touch":
            candidates = [pool.blocks[lst[0]] for lst in model_hash.values()] + held
            if candidates:
                blk = candidates[a % len(candidates)]
                pool.touch([blk])
                if ref[blk.block_id] == 0:
                    model_queue.remove(blk.block_id)
                ref[blk.block_id] += 1
                held.append(blk)
        elif op == "cache":
            uncached = [blk for blk in held if blk.block_hash is None]
            if uncached:
                blk = uncached[a % len(uncached)]
                pool.cache_full_blocks(_Hashes(b), [blk], 0, 1, 16)
                model_hash.setdefault(b, []).append(blk.block_id)
        assert queue_ids(pool) == model_queue
        assert pool.get_num_free_blocks() == len(model_queue)
        assert [blk.ref_cnt for blk in pool.blocks[1:]] == ref[1:]
        assert pool.get_usage() == pytest.approx(1 - len(model_queue) / (n - 1))
        for h, lst in model_hash.items():
            assert pool.get_cached_block(h) is pool.blocks[lst[0]]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[tuple[int, SimRequest]]]:
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 64))
    min_blocks = cdiv(max_model_len, bs) + 1
    cfg = dict(
        num_gpu_blocks=draw(st.integers(min_blocks, min_blocks + 8)),
        block_size=bs,
        max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 6)),
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.05, 0.2])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 3, 8])),
        kv_offloading_blocks=draw(st.sampled_from([0, 0, 2, 8, 40])),
        kv_offloading_sync_load_tokens=draw(st.sampled_from([None, 0, 16])),  # 0: every load asynchronous
    )
    prefixes = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=3))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        suffix = draw(st.lists(st.integers(0, 40), max_size=16))
        prompt = (draw(st.sampled_from(prefixes)) + suffix)[: max_model_len - 1]
        out = draw(st.integers(1, 12))
        max_new = out + draw(st.sampled_from([0, 0, 5]))
        reqs.append((draw(st.integers(0, 15)), SimRequest(f"q{i}", 0.0, tuple(prompt), max_new, out)))
    return cfg, reqs


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_streams_keep_invariants_and_bytes(w: tuple[dict, list[tuple[int, SimRequest]]]) -> None:
    cfg, reqs = w
    store = RecordingStore()
    s = VLLMScheduler(store=store, debug=True, **cfg)
    pending = sorted(reqs, key=lambda x: x[0])
    finished: list[SimRequest] = []
    for t in range(5000):
        while pending and pending[0][0] <= t:
            s.add_request(pending.pop(0)[1])
        if not pending and not s.has_work():
            break
        if s.has_work():
            waiting_before = {r.request_id for r in s.waiting}
            plan = s.schedule(float(t))
            scheduled = [c.req.rid for c in plan.chunks]
            assert sum(c.num_new_tokens for c in plan.chunks) <= cfg["max_num_batched_tokens"]
            assert len(set(scheduled)) == len(scheduled) <= cfg["max_num_seqs"]
            assert not {r.rid for r in plan.evicted} & set(scheduled)
            if plan.evicted:  # no admission on a preempting step
                assert not waiting_before & set(scheduled)
            done = s.update_from_output(plan, float(t))
            finished += done
    else:
        raise AssertionError("did not drain")
    assert sorted(r.rid for r in finished) == sorted(r.rid for _, r in reqs)
    for r in finished:
        assert len(r.output) == r.output_len or len(r.prompt) + len(r.output) == cfg["max_model_len"]
    st_ = s.stats()
    assert st_.num_free_blocks == cfg["num_gpu_blocks"] - 1 and st_.kv_cache_usage == 0.0
    assert st_.num_preemptions_total == sum(r.evictions for r in finished)
    assert st_.generation_tokens_total == sum(len(r.output) for r in finished)
    assert sum(st_.request_success_total.values()) == len(finished)
    assert st_.cpu_offload_used_blocks <= st_.cpu_offload_total_blocks
    bs = cfg["block_size"]
    # Every cached block holds the KV its hash names: the key of the last token of the prefix
    # that hash chains (every cached prefix is a prefix of some finished request's sequence).
    last_key = {}
    for r in finished:
        x = Request(r, bs)
        last_key.update((h, x.token_keys[(i + 1) * bs - 1]) for i, h in enumerate(x.block_hashes))
    for blk in s.block_pool.blocks:
        if blk.block_hash is not None:
            assert store.tiers["device"][blk.block_id * bs + bs - 1] == last_key[blk.block_hash]
    if s.connector is not None:
        for h, cpu_blk in s.connector.manager.blocks.items():
            assert store.tiers["host"][cpu_blk.block_id * bs + bs - 1] == last_key[h]


# ============================================================================ batch decode
def pool_state(s: VLLMScheduler) -> tuple:
    """What batch-level decode must keep exactly as step by step after every step: the queues,
    the block tables, the free queue's order, the cache's contents with each hash's blocks in
    order (which one a hit takes; the order of hashes in the map is no part of the pool's
    behaviour, and vLLM's map reorders a hash when one of its several blocks is evicted), the
    counters."""
    kv, pool = s.kv_cache_manager, s.block_pool
    return (
        [r.request_id for r in s.running], [r.request_id for r in s.waiting],
        {rid: ids(blocks) for rid, blocks in kv.req_to_blocks.items()}, dict(kv.num_cached_block),
        queue_ids(pool), {h: ids(e) for h, e in pool.cached_block_hash_to_block.entries()},
        [b.block_hash for b in pool.blocks], s.stats(),
    )  # fmt: skip


def assert_batch_decode_exact(
    cfg: dict, stream: list[tuple[int, str, tuple[int, ...], int, int]], always_in_order: bool = False, hash_order: bool = False
) -> int:
    """``stream`` ((step, rid, prompt, output_len, max_new), by step) through two schedulers, one
    accounting steady decodes batch-wise: after every step the same pool, block tables, free-queue
    and cache order and counters, the same plan totals; at the end (after ``sync``) the same
    finished requests. Returns the decodes taken batch-wise. ``always_in_order``: every step's
    block events one at a time; ``hash_order``: some step must take them so because a block
    cached shares a hash taken."""
    fast, slow = VLLMScheduler(**cfg), VLLMScheduler(**cfg)
    fast.enable_batch_decode()
    assert fast.batch is not None
    fast.batch.always_in_order = always_in_order
    done: dict[str, list] = {"fast": [], "slow": []}
    aggregated = 0
    pending, t = list(stream), 0
    while pending or fast.has_work() or slow.has_work():
        for when, rid, prompt, out, max_new in [x for x in pending if x[0] <= t]:
            if rid in slow.requests:
                continue  # a repeated id still live: it comes back later
            pending.remove((when, rid, prompt, out, max_new))
            for s in (fast, slow):
                s.add_request(SimRequest(rid, float(t), prompt, max_new, out))
        aggregated += lockstep_step(fast, slow, t, pool_state, done)[0].decode_batch
        t += 1
        assert t < 5000
    fast.sync()
    assert done["fast"] == done["slow"] and len(done["slow"]) == len(stream)
    assert fast.batch.hash_order_steps > 0 or not hash_order
    return aggregated


@pytest.mark.parametrize(
    ("cfg", "seed"),
    [
        (dict(num_gpu_blocks=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=16), 0),  # preemptions
        (dict(num_gpu_blocks=400, block_size=4, max_num_batched_tokens=24, max_num_seqs=32), 1),  # budget binds, chunks
        (dict(num_gpu_blocks=300, block_size=2, max_num_batched_tokens=64, max_num_seqs=64, max_model_len=40), 2),
        (dict(num_gpu_blocks=200, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False), 3),
    ],
)
@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_batch_decode_keeps_the_pool_exactly_as_step_by_step(cfg: dict, seed: int, one_at_a_time: bool) -> None:
    """Random streams that share prompts and answers (requests caching blocks another one
    frees), preempt, chunk and hit max_model_len. ``one_at_a_time`` holds the path that applies
    a step's block events request by request (taken where a block cached shares its hash with
    one taken) to the same standard."""
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(50) for _ in range(rng.randint(1, 30))) for _ in range(4)]
    stream = []
    for i in range(60):
        n = rng.randint(1, 30)
        prompt = (prompts[i % 4] + tuple(rng.randrange(50) for _ in range(rng.randint(0, 12))))[:30]
        rid = f"q{i}"
        if i % 3 == 0:  # a repeated request: the same blocks cached again as the old ones are reused
            rid, prompt = f"r{i % 5}", prompts[i % 5 % 4]
        stream.append((rng.randint(0, 150), rid, prompt, n, n + rng.choice([0, 3])))
    stream.sort(key=lambda x: x[0])
    assert assert_batch_decode_exact(cfg, stream, always_in_order=one_at_a_time) > 0  # not vacuous


def test_batch_decode_orders_steady_blocks_between_older_prefills() -> None:
    """Capped chunks keep older requests prefilling while newer short ones decode steadily: a
    step's blocks go to both in running order, not steady ones first."""
    rng = random.Random(4)
    stream = [(0, f"q{i}", tuple(rng.randrange(50) for _ in range(30 if i % 3 == 0 else 3)), 20, 20) for i in range(8)]
    cfg = dict(num_gpu_blocks=300, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=6)
    assert assert_batch_decode_exact(cfg, stream) > 0


def test_batch_decode_orders_a_step_that_caches_a_hash_it_takes() -> None:
    """Repeated requests (the same id and prompt: the same answer) cache blocks whose hashes the
    earlier copies' freed blocks, next in the free queue, still carry: such a step applies its
    events one at a time (``_shares_hash``; taken batch-wise, this stream's cache order departs
    at step 40), and the pool stays exactly as step by step."""
    arrivals = [(9, 1, 1), (12, 1, 3), (23, 1, 3), (25, 0, 3), (30, 0, 3), (30, 1, 2), (30, 0, 3), (34, 0, 1),
                (35, 0, 1), (35, 1, 2), (37, 1, 1), (38, 0, 1)]  # (step, r0 or r1, prompt length)  # fmt: skip
    stream = [(t, f"r{r}", (1, 2, 3)[:n], 10, 10) for t, r, n in arrivals]
    cfg = dict(num_gpu_blocks=26, block_size=1, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=16)
    assert assert_batch_decode_exact(cfg, stream, hash_order=True) > 0
