"""SGLang's scheduler loop over the reference pool, driven through ``EngineScheduler``.

One ``schedule()`` call is one iteration of ``scheduler.get_next_batch_to_run``: a prefill batch
if ``PrefillAdder`` can form one (FCFS, the in-flight chunked request first), else one decode
step of the running batch (``update_running_batch``: capacity check, retraction, ratio decay).
``update_from_output()`` is ``process_batch_result`` (its ``_prefill`` and ``_decode`` halves): one
token per request whose prefill completed or that decoded, checkpoint of prefilled prompts into
the tree, release of finished requests, the chunked request stashed, and the prefill batch
merged into the running batch.

Every KV write goes to ``store.write("device", slots, keys)`` with the positions' chained keys,
so any later prefix hit or load back can be verified byte for byte (``debug=True`` does so, and
checks the pool invariants after every call).
"""

from __future__ import annotations

import heapq
import itertools
import operator

import numpy as np

from kvdiag.refpool.sglang import fast_forward
from kvdiag.refpool.sglang.allocator import TokenToKVPoolAllocator
from kvdiag.refpool.sglang.hicache import HiRadixCache
from kvdiag.refpool.sglang.invariants import check_scheduler_invariants
from kvdiag.refpool.sglang.prefill_budget import (
    CLIP_MAX_NEW_TOKENS,
    RETRACT_DECODE_STEPS,
    AddReqResult,
    NewTokenRatioTracker,
    PrefillAdder,
    running_output_offset,
)
from kvdiag.refpool.sglang.radix_cache import RadixCache
from kvdiag.refpool.sglang.schedule_batch import (
    Req,
    alloc_decode,
    alloc_extend,
    check_decode_mem,
    checkpoint_kv_cache,
    get_decode_retraction_order,
    release_kv_cache,
)
from kvdiag.refpool.sglang.stats import SchedulerCounters, SGLangStats
from kvdiag.refpool.types import DecodeRun, KVStore, NullStore, ScheduledChunk, SimRequest, StepPlan


WAITING_PREFIX_REFRESH_INTERVAL = 32  # schedule_policy.py
WAITING_QUEUE_PREFIX_MATCH_MAX = 128
_RESERVE_LEFT = operator.attrgetter("reserve_left")


def default_max_running_requests(max_total_num_tokens: int, context_len: int) -> int:
    """``kv_cache_configurator.resolve_max_num_reqs`` default."""
    by_pool = min(max(int(max_total_num_tokens / context_len * 512), 2048), 4096)
    return min(by_pool, max_total_num_tokens // 2)


class SGLangScheduler:
    """Reference SGLang 0.5.23 scheduler (non-overlap event loop, FCFS, radix cache on)."""

    def __init__(
        self,
        max_total_num_tokens: int,
        page_size: int = 1,
        max_running_requests: int | None = None,
        context_len: int = 32768,
        chunked_prefill_size: int | None = 8192,
        max_prefill_tokens: int = 16384,
        schedule_conservativeness: float = 1.0,
        enable_hierarchical_cache: bool = False,
        hicache_ratio: float = 2.0,
        hicache_write_policy: str = "write_through",
        decode_log_interval: int = 40,
        store: KVStore | None = None,
        debug: bool = False,
        clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS,
    ) -> None:
        self.max_total_num_tokens = max_total_num_tokens
        self.clip_max_new_tokens = clip_max_new_tokens  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
        self.page_size = page_size
        self.store: KVStore = store if store is not None else NullStore()
        self.moves_bytes = not isinstance(self.store, NullStore)  # accounting-only: no keys, no writes
        self.allocator = TokenToKVPoolAllocator(max_total_num_tokens, page_size)
        self.tree_cache: RadixCache
        if enable_hierarchical_cache:
            self.tree_cache = HiRadixCache(
                self.allocator, page_size, self.store, hicache_ratio, hicache_write_policy
            )
        else:
            self.tree_cache = RadixCache(self.allocator, page_size, self.store)
        cap = max_total_num_tokens // 2
        self.max_running_requests = min(
            max_running_requests or default_max_running_requests(max_total_num_tokens, context_len), cap
        )
        self.max_req_len = min(context_len - 1, max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.chunked_prefill_size = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_log_interval = decode_log_interval
        self.debug = debug
        self.ratio = NewTokenRatioTracker(schedule_conservativeness)

        self.waiting_queue: list[Req] = []
        self.running_batch: list[Req] = []
        self.batch_is_full = False
        self._batch_full_on_kv = False  # why the latch was set (ground truth only)
        self.chunked_req: Req | None = None
        self._stash_chunked = False  # the chunked request's last chunk is still to commit
        self._prefix_refresh_calls = 0  # SchedulePolicy._waiting_prefix_refresh_calls
        self.last_batch: list[Req] = []  # prefill batch scheduled, not yet merged into running
        self.reqs: dict[SimRequest, Req] = {}  # live requests by their SimRequest (for callers)
        self._aborted: list[Req] = []
        self._report: SGLangStats | None = None
        self.last_report: SGLangStats | None = None  # the gauges as last published (kept past take_report)
        self.counters = SchedulerCounters()
        self.num_retracted_reqs = 0  # gauge: size of the last retraction since the last report
        self.cache_hit_rate = 0.0
        self.forward_ct_decode = 0
        self._filter_due = False  # a request was released since the last filter
        self._left: list[Req] = []  # running requests released since the last filter
        # Batch-level decode accounting (enable_batch_decode): a running request's output is
        # exact as of decode step ``synced_at`` and one token longer per decode step since;
        # it is brought up to date where it stops (``_stops``, in batch order) or is read.
        self.batch_decode = False
        self._stops: list[tuple[int, int, Req]] = []  # (decode step it stops at, batch order, request)
        self._batch_order = itertools.count()
        self._decode_context = 0  # the running batch's tokens in L1 (batch mode)
        self._in_full = 0  # running requests with ignore_eos, reserved in full (batch mode)
        self._reserve = np.zeros(0, np.int64)  # each running request's reserve_left, in batch order

    # ================================================================= protocol
    def add_request(self, req: SimRequest) -> None:
        """``handle_generate_request``: reject prompts past max_req_input_len, clamp max_new.

        A request whose admission test could not pass even on an idle pool (possible only
        with page_size > 1, where the page reserve exceeds the clamp's slack) is aborted too:
        SGLang would leave it waiting forever.
        """
        r = Req(req, max_new_tokens=min(req.max_new_tokens, self.max_req_len - len(req.prompt) - 1))
        self.reqs[req] = r
        never_fits = len(req.prompt) + min(r.max_new_tokens, self.clip_max_new_tokens) + self.page_size
        if len(req.prompt) > self.max_req_input_len or r.max_new_tokens < 1 or never_fits >= self.max_total_num_tokens:
            r.aborted = r.finished = True
            self._aborted.append(r)
            return
        self.waiting_queue.append(r)

    def has_work(self) -> bool:
        return bool(
            self.waiting_queue
            or self.chunked_req
            or self._aborted
            or any(not r.finished for r in self.running_batch)
        )

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        before = self._l2_counters()
        for _ in range(2):  # an idle iteration costs no forward time: retry admission once
            plan.blocked_on_kv = plan.blocked_other = False
            if isinstance(self.tree_cache, HiRadixCache):  # _process_hicache_events, before the stash
                self.tree_cache.check_hicache_events()
            if self._stash_chunked:  # stash_chunked_request, first thing of get_next_batch_to_run
                assert self.chunked_req is not None
                checkpoint_kv_cache(self.chunked_req, self.tree_cache)
                self._stash_chunked = False
            self._filter_running_batch()
            batch = self._get_new_batch_prefill(plan)
            if batch:
                self._prepare_for_extend(batch, plan, now)
                self.last_batch = batch
                break
            if self._update_running_batch(plan):
                break
            self._on_idle()
            if not self.waiting_queue:
                break
        after = self._l2_counters()
        plan.loaded_tokens += after[0] - before[0]
        plan.stored_tokens += after[1] - before[1]
        if self.debug:
            self.check_invariants()
        return plan

    def update_from_output(self, plan: StepPlan, now: float) -> list[SimRequest]:
        before = self._l2_counters()
        finished: list[SimRequest] = []
        # The plan's chunks are the scheduled batch's requests in order; like SGLang, the
        # results are processed over the batch itself (``batch.reqs``), not looked up per chunk.
        with self.allocator.free_group():  # as process_batch_result_prefill / _decode do
            if plan.chunks and plan.chunks[0].is_prefill:  # a batch is all prefill or all decode
                self._process_batch_result_prefill(now, finished)
            elif plan.chunks or plan.decode_batch:
                self._process_batch_result_decode(finished)
        for req in self._aborted:
            finished.append(req.sim)
            self.counters.num_aborted_requests_total += 1
            del self.reqs[req.sim]
        self._aborted = []
        for sim in finished:
            sim.finished = now
        after = self._l2_counters()
        plan.loaded_tokens += after[0] - before[0]
        plan.stored_tokens += after[1] - before[1]
        if self.debug:
            self.check_invariants()
        return finished

    def _process_batch_result_prefill(self, now: float, finished: list[SimRequest]) -> None:
        """First token of every request whose prompt is done; checkpoint; merge into running."""
        batch = self.last_batch
        for req in batch:
            if req is self.chunked_req:
                self._stash_chunked = True  # committed at the top of the next iteration
                continue
            sim = req.sim
            sim.output.append(sim.next_token())
            if sim.first_token is None:
                sim.first_token = now
            if req.should_finish():
                self._release_finished_req(req, finished)
            else:
                checkpoint_kv_cache(req, self.tree_cache)
        self._merge_prefill_batch(batch)
        self.last_batch = []

    def _process_batch_result_decode(self, finished: list[SimRequest]) -> None:
        """One token for every running request (each already has its first token from prefill).

        The hot loop of a run: it executes once per running request per decode step, unless
        decodes are accounted batch-wise, where only the requests that stop are touched.
        """
        if self.batch_decode:
            step = self.forward_ct_decode + 1
            for req in self._due_stops(step):
                self._sync(req, step)
                assert req.should_finish()
                self._decode_context -= len(req.kv_indices)
                self._in_full -= req.sim.ignore_eos
                self._release_finished_req(req, finished, running=True)
        else:
            for req in self.running_batch:
                sim = req.sim
                sim.output.append(sim.next_token())
                if req.should_finish():
                    self._release_finished_req(req, finished, running=True)
        self.forward_ct_decode += 1
        if self.forward_ct_decode % self.decode_log_interval == 0:
            self._snapshot_report()

    def _release_finished_req(self, req: Req, finished: list[SimRequest], running: bool = False) -> None:
        """Finished: insert its KV into the tree and unlock it, count it (``running``: it leaves
        the running batch at the next filter)."""
        release_kv_cache(req, self.tree_cache, checkpoint=True)
        req.finished = True
        self._filter_due = True
        if running:
            self._left.append(req)
        finished.append(req.sim)
        c = self.counters
        c.num_requests_total += 1
        c.prompt_tokens_total += len(req.origin_input_ids)
        c.generation_tokens_total += len(req.output_ids)
        del self.reqs[req.sim]

    # ================================================================= prefill
    def _get_new_batch_prefill(self, plan: StepPlan) -> list[Req] | None:
        """``scheduler._get_new_batch_prefill_raw`` under FCFS."""
        if (self.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            if self.batch_is_full and self.waiting_queue:
                self._mark_blocked(plan, self._batch_full_on_kv)
            return None
        running_bs = len(self.running_batch)
        if running_bs >= self.max_running_requests and self.chunked_req is None:
            self._set_batch_full(on_kv=False)
            self._mark_blocked(plan, on_kv=False)
            return None
        self._touch_waiting_prefixes()
        adder = PrefillAdder(
            self.tree_cache, self.running_batch, self.ratio.current, self.max_prefill_tokens, self.chunked_prefill_size,
            self._running_output_offset() if self.batch_decode else None, self.clip_max_new_tokens,
        )  # fmt: skip
        continuing = self.chunked_req is not None  # its chunk heads can_run_list; it is not queued
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        blocked_on_kv: bool | None = None  # why the queue stopped, if it did
        for req in self.waiting_queue:
            if len(adder.can_run_list) >= self.max_running_requests - running_bs:
                self._set_batch_full(on_kv=False)
            if self.batch_is_full:
                blocked_on_kv = self._batch_full_on_kv
                break
            res = adder.budget_state()
            if res is AddReqResult.CONTINUE:
                req.init_next_round_input(self.tree_cache)
                res = adder.add_one_req(req)
            if res is not AddReqResult.CONTINUE:
                blocked_on_kv = res is AddReqResult.NO_TOKEN
                if blocked_on_kv and (adder.can_run_list or self.running_batch):
                    self._set_batch_full(on_kv=True)
                break
        # FCFS admits the head of the queue, in order, and stops at the first refusal.
        del self.waiting_queue[: len(adder.can_run_list) - continuing]
        if blocked_on_kv is not None and self.waiting_queue:
            self._mark_blocked(plan, blocked_on_kv)
        if not adder.can_run_list:
            return None
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None, "one chunked request at a time"
            self.chunked_req = adder.new_chunked_req
        fresh_input = adder.log_input_tokens - adder.reprocessed_log_input_tokens
        fresh_hit = adder.log_hit_tokens - adder.reprocessed_log_hit_tokens
        self.cache_hit_rate = fresh_hit / (fresh_hit + fresh_input) if fresh_hit + fresh_input else 0.0
        c = self.counters
        c.prefill_effective_input_tokens_total += fresh_input
        c.prefill_compute_tokens_total += adder.log_input_tokens
        c.prefill_cache_tokens_total += adder.log_hit_tokens
        c.cached_tokens_device_total += adder.log_device_hit_tokens
        c.cached_tokens_host_total += adder.log_host_hit_tokens
        c.num_prefill_batches += 1
        self._snapshot_report()  # log_prefill_stats runs before the batch allocates
        return adder.can_run_list

    def _touch_waiting_prefixes(self) -> None:
        """``SchedulePolicy._touch_waiting_prefixes`` (FCFS, LRU; in ``calc_priority``): every
        32nd pass with a queue, the cached prefixes of its first 128 requests are matched again,
        head last, so LRU evicts them in reverse admission order. Matching splits nodes at the
        divergence and refreshes their access time, which decides later evictions."""
        if not self.waiting_queue:
            return
        refresh = self._prefix_refresh_calls % WAITING_PREFIX_REFRESH_INTERVAL == 0
        self._prefix_refresh_calls += 1
        if refresh:
            for req in reversed(self.waiting_queue[:WAITING_QUEUE_PREFIX_MATCH_MAX]):
                self.tree_cache.touch_prefix(req.origin_input_ids + tuple(req.output_ids))

    def _prepare_for_extend(self, batch: list[Req], plan: StepPlan, now: float) -> None:
        """Allocate every extend (``alloc_token_slots`` evicts the shortfall first) and write KV."""
        extend_num_tokens = sum(r.extend_input_len for r in batch)
        over_ask = len(batch) * self.page_size if self.page_size > 1 else 0
        self.tree_cache.evict_to_free_tokens(extend_num_tokens + over_ask)
        for req in batch:
            fresh = not req.kv_indices
            if fresh:
                req.kv_indices = list(req.prefix_indices)
                req.cache_protected_len = len(req.prefix_indices)
                self._on_admitted(req, now)
            start = len(req.kv_indices)
            if self.debug:
                self._verify_device(req.kv_indices, req.kv_keys(0, start), f"prefix hit of {req.sim.rid}")
            slots = alloc_extend(req, self.tree_cache, req.extend_input_len)
            if self.moves_bytes:
                self.store.write("device", slots, req.kv_keys(start, start + len(slots)))
            plan.chunks.append(ScheduledChunk(req.sim, len(slots), start, is_prefill=True))

    def _on_admitted(self, req: Req, now: float) -> None:
        sim = req.sim
        if sim.first_scheduled is None:
            sim.first_scheduled = now
        if req.retracted_stain:
            sim.recomputed_tokens += req.fill_len - len(req.prefix_indices)
        else:
            sim.device_hit_tokens = len(req.prefix_indices) - req.host_loaded_length
            sim.host_hit_tokens = req.host_loaded_length

    def _merge_prefill_batch(self, batch: list[Req]) -> None:
        """Filter finished and chunked requests out of the last prefill batch, merge the rest.

        ``batch_is_full`` belongs to the running batch object: a shrunken prefill batch clears
        it, and when the running batch is empty the prefill batch *becomes* the running batch,
        whose flag was never set.
        """
        kept = [r for r in batch if not r.finished and r is not self.chunked_req]
        if len(kept) < len(batch) or (kept and not self.running_batch):
            self.batch_is_full = False
        self.running_batch.extend(kept)
        if self.batch_decode:
            for r in kept:
                self._track(r)
            self._reserve = np.concatenate((self._reserve, np.fromiter(map(_RESERVE_LEFT, kept), np.int64, len(kept))))

    def _filter_running_batch(self) -> None:
        """Top of every ``get_next_batch_to_run`` ("Every step, not only after a merge"):
        finished requests leave the running batch, which clears the latch if any did; an empty
        batch never stays latched (``_get_new_batch_prefill_raw``)."""
        if not self._filter_due and self.running_batch:
            return  # nobody finished since the last filter: it would change nothing
        self._filter_due = False
        before = len(self.running_batch)
        if self._left:  # cut out where they are (a scan in C each), not a pass over every request
            batch, gone = self.running_batch, sorted(map(self.running_batch.index, self._left))
            self._left = []
            kept: list[Req] = []
            start = 0
            for i in gone:
                kept += batch[start:i]
                start = i + 1
            self.running_batch = kept + batch[start:]
            if self.batch_decode:
                keep = np.ones(len(batch), dtype=bool)
                keep[gone] = False
                self._reserve = self._reserve[keep]
        if self.debug:
            assert not any(r.finished for r in self.running_batch), "a released request is still running"
        if len(self.running_batch) < before or not self.running_batch:
            self.batch_is_full = False

    # ================================================================= decode
    def _update_running_batch(self, plan: StepPlan) -> bool:
        """One decode step of the running batch; False when nothing is left to decode."""
        initial_bs = len(self.running_batch)
        if not self.running_batch:
            return False
        if not check_decode_mem(self.running_batch, self.tree_cache):
            self.sync()  # retraction reads every request's output, and reorders the batch
            plan.evicted.extend(r.sim for r in self._retract_decode())
            if self.batch_decode:
                self._track_batch()
        else:
            self.ratio.decay_step()
        if len(self.running_batch) < initial_bs:
            self.batch_is_full = False
        if not self.running_batch:  # its last request was aborted
            return False
        batch = self.running_batch
        if self.batch_decode:  # the step's decodes as one aggregate
            plan.decode_batch, plan.decode_context = len(batch), self._decode_context
            alloc_decode(batch, self.tree_cache)
            self._decode_context += len(batch)
            return True
        chunks = [ScheduledChunk(req.sim, 1, len(req.kv_indices), False) for req in batch]
        slots = alloc_decode(batch, self.tree_cache)
        if self.moves_bytes:
            for req, chunk, slot in zip(batch, chunks, slots):
                pos = chunk.num_context_tokens
                self.store.write("device", [slot], req.kv_keys(pos, pos + 1))
        plan.chunks.extend(chunks)
        return True

    def _retract_decode(self) -> list[Req]:
        """``ScheduleBatch.retract_decode``: retract until the rest can decode; keep at least one."""
        batch = self.running_batch
        sorted_indices = get_decode_retraction_order(batch)
        retracted: list[Req] = []
        first_iter = True
        while first_iter or not check_decode_mem([batch[i] for i in sorted_indices], self.tree_cache):
            if len(sorted_indices) == 1:
                # Always keep one request; if even it alone cannot decode, it is aborted (500).
                last = batch[sorted_indices.pop()]
                release_kv_cache(last, self.tree_cache, checkpoint=False)
                last.aborted = last.finished = True
                self._aborted.append(last)
                break
            first_iter = False
            req = batch[sorted_indices.pop()]
            retracted.append(req)
            release_kv_cache(req, self.tree_cache, checkpoint=False)
            self.tree_cache.evict_to_free_tokens(len(sorted_indices) * RETRACT_DECODE_STEPS)
            c = self.counters
            c.num_retracted_requests_total += 1
            c.num_retracted_input_tokens_total += len(req.origin_input_ids)
            c.num_retracted_output_tokens_total += len(req.output_ids)
            req.reset_for_retract()
            req.sim.evictions += 1
        # filter_batch(keep_indices=sorted_indices): the kept requests stay in retraction order
        self.running_batch = [batch[i] for i in sorted_indices]
        self.ratio.current = NewTokenRatioTracker.estimate_after_retract(self.running_batch)
        self.waiting_queue.extend(retracted)  # _add_request_to_queue: appended at the tail
        if retracted:
            self.num_retracted_reqs = len(retracted)
        return retracted

    # ================================================================= idle, flags, stats
    def idle(self) -> None:
        """The loop's iteration that finds nothing to run (``types.EngineScheduler.idle``).

        SGLang resets new_token_ratio there (``on_idle``), not in the step whose result
        finishes the last request: that step still reports the decayed ratio, and a request
        that arrived during it is admitted by the next iteration against the decayed ratio,
        before the loop is ever idle."""
        self._on_idle()

    def _on_idle(self) -> None:
        """Fully idle: drop released requests, reset the ratio (``on_idle``) and self-check."""
        if self.waiting_queue or self.chunked_req or any(not r.finished for r in self.running_batch):
            return
        self.running_batch, self._left = [], []
        self._reserve = self._reserve[:0]
        self.batch_is_full = False
        self.ratio.reset()
        if isinstance(self.tree_cache, HiRadixCache):  # the idle iteration polls the acks too
            self.tree_cache.check_hicache_events()
        if self.debug:
            idle_total = self.allocator.available_size() + self.tree_cache.evictable_size()
            assert idle_total == self.max_total_num_tokens, f"idle pool leak: {idle_total}"

    def _set_batch_full(self, on_kv: bool) -> None:
        self.batch_is_full = True
        self._batch_full_on_kv = on_kv

    @staticmethod
    def _mark_blocked(plan: StepPlan, on_kv: bool) -> None:
        if on_kv:
            plan.blocked_on_kv = True
        else:
            plan.blocked_other = True

    def _l2_counters(self) -> tuple[int, int]:
        tree = self.tree_cache
        if isinstance(tree, HiRadixCache):
            return tree.load_back_tokens_total, tree.backup_tokens_total
        return 0, 0

    def _verify_device(self, slots: list[int], keys: list[int], what: str) -> None:
        if slots and not self.store.verify("device", slots, keys):
            raise AssertionError(f"KV bytes do not match for {what}")

    def stats(self) -> SGLangStats:
        """Live counters and gauges, named after the ``sglang:*`` metrics they feed."""
        tree = self.tree_cache
        hi = tree if isinstance(tree, HiRadixCache) else None
        c = self.counters  # by name, not **: the loop reads stats twice a step, and ** is a slow call
        return SGLangStats(
            max_total_num_tokens=self.max_total_num_tokens,
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            kv_available_tokens=self.allocator.available_size(),
            kv_evictable_tokens=tree.evictable_size(),
            kv_protected_tokens=tree.protected_size(),
            num_running_reqs=len(self.running_batch),
            num_queue_reqs=len(self.waiting_queue),
            new_token_ratio=self.ratio.current,
            cache_hit_rate=self.cache_hit_rate,
            num_retracted_reqs=self.num_retracted_reqs,
            evicted_tokens_total=tree.evicted_tokens_total,
            forward_ct_decode=self.forward_ct_decode,
            hicache_host_used_tokens=hi.host_used_tokens() if hi else None,
            hicache_host_total_tokens=hi.host_total_tokens() if hi else None,
            load_back_tokens_total=hi.load_back_tokens_total if hi else None,
            hicache_backup_tokens_total=hi.backup_tokens_total if hi else None,
            hicache_dropped_tokens_total=hi.dropped_tokens_total if hi else None,
            num_retracted_requests_total=c.num_retracted_requests_total,
            num_retracted_input_tokens_total=c.num_retracted_input_tokens_total,
            num_retracted_output_tokens_total=c.num_retracted_output_tokens_total,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            num_requests_total=c.num_requests_total,
            num_aborted_requests_total=c.num_aborted_requests_total,
            cached_tokens_device_total=c.cached_tokens_device_total,
            cached_tokens_host_total=c.cached_tokens_host_total,
            prefill_effective_input_tokens_total=c.prefill_effective_input_tokens_total,
            prefill_compute_tokens_total=c.prefill_compute_tokens_total,
            prefill_cache_tokens_total=c.prefill_cache_tokens_total,
            num_prefill_batches=c.num_prefill_batches,
        )

    def _snapshot_report(self) -> None:
        self._report = self.last_report = self.stats()
        self.num_retracted_reqs = 0  # the last-retraction gauge is reset after each report

    def take_report(self) -> SGLangStats | None:
        """The gauges SGLang published since the last call, if any.

        SGLang refreshes its scheduler gauges only when a prefill batch is formed (before it
        allocates) and every ``decode_log_interval`` decode steps; the emitter should publish
        exactly these snapshots, not ``stats()`` at arbitrary times.
        """
        report, self._report = self._report, None
        return report

    def check_invariants(self) -> None:
        """Recount the pool from scratch; raise ``AssertionError`` on any disagreement."""
        check_scheduler_invariants(self)

    # types.FastForward: runs of identical decode steps at once (sglang/fast_forward.py)
    def decode_run(self) -> DecodeRun | None:
        return fast_forward.decode_run(self)

    def advance_decode(self, steps: int) -> list[int]:
        return fast_forward.advance_decode(self, steps)

    # ---- types.BatchDecoding
    def enable_batch_decode(self) -> None:
        """Account decodes batch-wise from now on where that is exact without per-request work
        (accounting-only, page size 1, not debug: KV writes and the invariant checks read every
        request every step). A decode step then appends each request's slot, and nothing else
        per request: outputs are appended where a request stops or is read (``sync``). The
        allocator stops checking its frees (``stop_checking``): the fast-forward tests hold this
        mode equal, slot for slot, to the step-by-step one, which checks them."""
        if not (self.debug or self.moves_bytes or self.page_size != 1):
            assert not self.reqs, "enable batch decode before the first request"
            self.batch_decode = True
            self.allocator.stop_checking()

    def sync(self) -> None:
        """Bring every running request's output up to date (batch mode; else nothing to do)."""
        if self.batch_decode:
            for r in self.running_batch:
                self._sync(r, self.forward_ct_decode)

    def _sync(self, r: Req, step: int) -> None:
        """``r``'s output as the step-by-step loop has it after decode step ``step``."""
        n = step - r.synced_at
        if n:
            r.sim.output.extend(r.sim.next_tokens(n))
            r.synced_at = step

    def _track(self, r: Req) -> None:
        """``r`` (output up to date) joins the batch's decodes: it stops at the decode step
        where ``should_finish`` first holds."""
        sim, now = r.sim, self.forward_ct_decode
        r.synced_at, r.batch_order = now, next(self._batch_order)
        r.stop_at = now + min(r.max_new_tokens, sim.output_len) - len(sim.output)
        r.reserve_left = r.max_new_tokens - len(sim.output) + now  # less the decode step: left to generate
        heapq.heappush(self._stops, (r.stop_at, r.batch_order, r))
        self._decode_context += len(r.kv_indices)
        self._in_full += sim.ignore_eos

    def _running_output_offset(self) -> float:
        """``PrefillAdder``'s reservation for the running batch's remaining output, in batch mode
        (each request's outputs not appended yet count as generated)."""
        batch = self.running_batch
        assert len(self._reserve) == len(batch), "the reserve array follows the running batch"
        remaining = self._reserve - self.forward_ct_decode
        in_full = [r.sim.ignore_eos for r in batch] if self._in_full else np.zeros(len(batch), dtype=bool)
        return running_output_offset(remaining, in_full, self.ratio.current, self.clip_max_new_tokens)

    def _track_batch(self) -> None:
        """After a retraction (which reorders the batch): every running request anew."""
        self._stops, self._decode_context, self._in_full = [], 0, 0
        for r in self.running_batch:
            self._track(r)
        self._reserve = np.fromiter(map(_RESERVE_LEFT, self.running_batch), np.int64, len(self.running_batch))

    def _due_stops(self, step: int) -> list[Req]:
        """Pop the running requests that stop at decode step ``step``, in batch order (entries
        of requests retracted or released since are stale and dropped)."""
        due, heap = [], self._stops
        while heap and heap[0][0] <= step:
            at, order, r = heapq.heappop(heap)
            if r.batch_order == order and r.stop_at == at and not r.finished:
                due.append(r)
        return due

    def next_stop(self) -> int | None:
        """The earliest decode step at which a running request stops (batch mode)."""
        heap = self._stops
        while heap:
            at, order, r = heap[0]
            if r.batch_order == order and r.stop_at == at and not r.finished:
                return at
            heapq.heappop(heap)
        return None
