"""vLLM V1 scheduler over the reference block pool (facts §2.2), driven through ``EngineScheduler``.

Mirrors ``vllm/v1/core/sched/scheduler.py: Scheduler.schedule / update_from_output /
_preempt_request`` with the FCFS policy, chunked prefill on, no speculative decoding, and the
optional native CPU offloading connector (``offload.py``). The engine loop only sees
``add_request / schedule / update_from_output / has_work / check_invariants`` and ``stats()``.

The model runner's part of a step (KV writes, H->D loads, D->H stores) runs at the start of
``update_from_output``: it is "the forward" that happened between the two calls. Every KV write
goes through the ``KVStore`` at slot ``block_id * block_size + offset`` with the position's
prefix key, and every reused KV (local prefix hit, CPU load-back) is verified byte for byte when
it is first used and again over the whole sequence when the request finishes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvdiag.refpool.types import DecodeRun, KVStore, NullStore, ScheduledChunk, SimRequest, StepPlan
from kvdiag.refpool.vllm.batch_decode import BatchDecode
from kvdiag.refpool.vllm.block_pool import BlockPool
from kvdiag.refpool.vllm.kv_cache_manager import KVCacheManager, PrefixCacheStats, cdiv
from kvdiag.refpool.vllm.offload import OffloadingConnector, OffloadingConnectorMetadata
from kvdiag.refpool.vllm.request import Request, RequestStatus


@dataclass(slots=True)
class VLLMStats:
    """Everything the metric emitter needs for vLLM's exposition, sampled after a step (slotted:
    the loop builds one after every step, twice)."""

    num_gpu_blocks: int
    block_size: int
    num_free_blocks: int
    kv_cache_usage: float  # vllm:kv_cache_usage_perc = 1 - free/(num_gpu_blocks - 1)
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens; requests resumed after preemption excluded
    prefix_cache_hits_total: int
    external_prefix_cache_queries_total: int  # connector (CPU offload) lookups, tokens
    external_prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success_total: dict[str, int]  # by finished_reason: "stop", "length"
    cpu_offload_used_blocks: int
    cpu_offload_total_blocks: int  # 0 when offloading is off
    cpu_offload_evicted_blocks_total: int  # CPU blocks dropped (LRU) to make room for stores
    cpu_offload_loaded_tokens_total: int  # CPU -> GPU tokens the connector's loads copied
    cpu_offload_stored_tokens_total: int  # GPU -> CPU tokens its stores copied
    evicted_blocks_total: int  # cached GPU blocks whose hash was dropped at reuse


@dataclass
class _Admission:
    """The head request's prefix hits and tokens to compute, as ``allocate_slots`` takes them.
    ``looked_up``: a fresh admission (prefix lookup, hit counters); not for a request whose
    asynchronous load has landed (it holds its blocks and computed tokens already)."""

    num_local: int
    num_external: int
    load_async: bool
    num_new_tokens: int
    slot_args: dict[str, Any]
    looked_up: bool = True


@dataclass
class _SchedulerOutput:
    """What ``schedule`` decided, kept for the forward in ``update_from_output``."""

    plan: StepPlan
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num tokens)
    new_reqs: list[Request] = field(default_factory=list)  # admitted from waiting this step
    connector_meta: OffloadingConnectorMetadata | None = None


class VLLMScheduler:
    """FCFS vLLM V1 scheduler with prefix caching, chunked prefill and optional CPU offloading."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        watermark: float = 0.0,
        scheduler_reserve_full_isl: bool = True,
        long_prefill_token_threshold: int = 0,
        kv_offloading_blocks: int = 0,
        kv_offloading_sync_load_tokens: int | None = None,
        store: KVStore | None = None,
        debug: bool = False,
    ) -> None:
        # vLLM refuses to start when one max_model_len sequence cannot fit the pool (startup
        # check "max seq len ... is larger than the maximum number of tokens that can be stored
        # in KV cache"); it is what lets a request running alone always grow, so the engine
        # cannot livelock. None: the model's 32768, capped to what the pool holds.
        max_blocks = num_gpu_blocks - 1
        if max_model_len is None:
            max_model_len = min(32768, max_blocks * block_size)
        elif cdiv(max_model_len, block_size) > max_blocks:
            raise ValueError(
                f"max_model_len {max_model_len} needs {cdiv(max_model_len, block_size)} blocks; "
                f"the pool has {max_blocks} (num_gpu_blocks - 1 null block)"
            )
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.scheduler_reserve_full_isl = scheduler_reserve_full_isl
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.store: KVStore = store if store is not None else NullStore()
        self.moves_bytes = not isinstance(self.store, NullStore)  # accounting-only: no keys, no writes
        self.debug = debug
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool, block_size, watermark, max_model_len)
        self.connector = (
            OffloadingConnector(kv_offloading_blocks, block_size, self.store, kv_offloading_sync_load_tokens)
            if kv_offloading_blocks > 0
            else None
        )
        self.connector_prefix_cache_stats = PrefixCacheStats()
        self.requests: dict[str, Request] = {}
        # vLLM's FCFSRequestQueue (sched/request_queue.py) is a deque of requests: add_request
        # appends, peek_request is [0], pop_request popleft, prepend_request appendleft. A plain
        # deque here, not a subclass: a mypyc-compiled subclass of deque is allocated at the
        # size of a plain object, and deque's own fields then overwrite the heap.
        self.waiting: deque[Request] = deque()
        # Waiting requests that hold blocks (an asynchronous load in flight or landed): vLLM's
        # kv_holding_waiting, drained before ``waiting``; the loads reported done, not yet seen.
        self.kv_holding_waiting: deque[Request] = deque()
        self.finished_recving: set[str] = set()
        # Prefills whose remaining blocks an asynchronous load may not take (``_inflight_prefills``;
        # kept only with a connector, the only source of asynchronous loads).
        self._inflight_prefills: set[Request] = set()
        self.running: list[Request] = []
        self._pending: _SchedulerOutput | None = None
        self.batch: BatchDecode | None = None  # batch-level decode accounting (enable_batch_decode)
        self.num_preemptions_total = 0
        self.cpu_offload_loaded_tokens_total = self.cpu_offload_stored_tokens_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success_total = {"stop": 0, "length": 0}

    # ---- EngineScheduler protocol ----

    def add_request(self, req: SimRequest) -> None:
        if req.rid in self.requests:
            raise ValueError(f"duplicate request id {req.rid}")
        if not req.prompt or len(req.prompt) >= self.max_model_len:
            raise ValueError(f"{req.rid}: prompt length {len(req.prompt)} not in [1, max_model_len)")
        if req.output_len < 1:
            raise ValueError(f"{req.rid}: output_len must be >= 1 (vLLM always samples a token)")
        request = Request(req, self.block_size, track_keys=self.moves_bytes)
        self.requests[req.rid] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.kv_holding_waiting)

    def idle(self) -> None:
        """Nothing to run: vLLM's engine core just waits for input; no scheduler state moves."""

    def schedule(self, now: float) -> StepPlan:
        """One scheduling pass: running requests first (preempting from the back of the running
        list when blocks run out), then waiting requests in FCFS order unless this step preempted."""
        assert self._pending is None, "schedule() called twice without update_from_output()"
        kv = self.kv_cache_manager
        out = _SchedulerOutput(plan=StepPlan())
        plan = out.plan
        token_budget = self.max_num_batched_tokens
        preempted: list[Request] = []

        # Phase A: RUNNING requests, in order. This loop runs per running request per step, so
        # ``allocate_slots`` is bound to a local.
        running, threshold = self.running, self._long_prefill_cap()
        allocate_slots = kv.allocate_slots
        req_index = 0
        if self.batch is not None:
            taken = self.batch.schedule_running(out, token_budget, threshold, now)
            if taken is not None:  # every running request taken batch-wise
                token_budget, req_index = taken[0], len(running)
                preempted += taken[1]
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed_tokens = request.num_computed_tokens
            num_new_tokens = request.num_tokens - num_computed_tokens  # 1 for a decode
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            assert num_new_tokens > 0, f"running request with nothing to compute: {request}"
            while True:
                new_blocks = allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                preempted_req = running.pop()  # FCFS: the last running request
                self._preempt_request(preempted_req)
                preempted.append(preempted_req)
                if preempted_req is request:
                    break  # nothing left to preempt but itself
            if new_blocks is None:
                break
            # vLLM does not label chunks; a decode is the one new token of a request that has
            # sampled before (a resumed request recomputing its last token counts as one too).
            is_decode = num_computed_tokens == request.num_tokens - 1 and bool(request.sim.output)
            self._add_chunk(out, request, num_new_tokens, not is_decode, now)
            token_budget -= num_new_tokens
            req_index += 1

        # Phase B: WAITING requests, only if nothing was preempted this step; those holding
        # blocks first (kv_holding_waiting). A request whose asynchronous load is in flight is
        # passed over; one just admitted with an asynchronous load joins them, scheduled nothing.
        if preempted:
            plan.blocked_on_kv = bool(self.waiting)
        else:
            passed_over: deque[Request] = deque()
            while token_budget > 0:
                queue = self.kv_holding_waiting or self.waiting
                if not queue or len(self.running) == self.max_num_seqs:
                    break
                request = queue[0]
                if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if request.request_id not in self.finished_recving:
                        passed_over.appendleft(queue.popleft())
                        continue
                    self._finish_remote_load(request)
                # Landed (vLLM tests num_computed_tokens > 0, the same but for a one-token prompt
                # loaded whole at block_size 1, which would rewind to 0 and be looked up again).
                if request.request_id in kv.req_to_blocks:
                    adm = self._landed(request, token_budget, threshold)
                else:
                    adm = self._admission(request, token_budget, threshold)
                num_local, num_external, num_new_tokens = adm.num_local, adm.num_external, adm.num_new_tokens
                new_blocks = kv.allocate_slots(request, num_new_tokens, **adm.slot_args)
                if new_blocks is None:
                    plan.blocked_on_kv = True  # head-of-line: nothing behind it is tried
                    break
                if adm.looked_up:
                    if self.connector is not None:
                        self.connector.update_state_after_alloc(
                            request, kv.get_blocks(request.request_id), num_local, num_external
                        )
                        self.connector_prefix_cache_stats.record(
                            num_tokens=request.num_tokens - num_local,
                            num_hits=num_external,
                            preempted=request.num_preemptions > 0,
                        )
                    kv.record_prefix_cache_stats(request, num_local)
                    if request.num_preemptions == 0:
                        request.sim.device_hit_tokens = num_local
                        request.sim.host_hit_tokens = num_external
                    request.num_computed_tokens = num_local + num_external
                    if adm.load_async:
                        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                        self._inflight_prefills.add(request)
                        passed_over.appendleft(queue.popleft())
                        continue
                queue.popleft()
                self.running.append(request)
                if self.batch is not None:
                    self.batch.admitted(request)
                request.status = RequestStatus.RUNNING
                if self.connector is not None and request.num_computed_tokens + num_new_tokens < request.num_tokens:
                    self._inflight_prefills.add(request)
                out.new_reqs.append(request)
                self._add_chunk(out, request, num_new_tokens, is_prefill=True, now=now)
                token_budget -= num_new_tokens
            self.kv_holding_waiting.extendleft(passed_over)  # ahead of the rest, in their order
            if self.waiting and (token_budget == 0 or len(self.running) == self.max_num_seqs):
                plan.blocked_other = True

        plan.evicted = [r.sim for r in preempted]
        if self.connector is not None:
            out.connector_meta = self.connector.build_connector_meta(
                [(r, n, kv.get_blocks(r.request_id)) for r, n in out.scheduled]
            )
            for r, n in out.scheduled:  # its last prefill chunk is scheduled: no longer in flight
                if r.num_computed_tokens + n >= r.num_tokens:
                    self._inflight_prefills.discard(r)
            plan.loaded_tokens = out.connector_meta.num_load_blocks * self.block_size
            plan.stored_tokens = out.connector_meta.num_store_blocks * self.block_size
            self.cpu_offload_loaded_tokens_total += plan.loaded_tokens
            self.cpu_offload_stored_tokens_total += plan.stored_tokens
        self._pending = out
        if self.debug:
            self.check_invariants()
        return plan

    def update_from_output(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Run the step's KV traffic, advance every scheduled request, sample a token for each
        that reached the end of its sequence, and release finished requests."""
        out = self._pending
        assert out is not None and out.plan is plan, "update_from_output() for a plan not just scheduled"
        self._pending = None
        meta = out.connector_meta
        if self.connector is not None and meta is not None:
            self.finished_recving.update(self.connector.start_load_kv(meta))
        if self.moves_bytes:
            for request, n in out.scheduled:
                self._write_kv(request, request.num_computed_tokens, n)
            for request in out.new_reqs:  # prefix hits and loads, read by this forward
                self._verify_kv(request, request.num_computed_tokens)
        if self.connector is not None and meta is not None:
            self.connector.wait_for_save(meta)

        finished: list[SimRequest] = []
        sampled = 0
        check_stop = self._check_stop  # bound once: the loop runs per scheduled request
        scheduled = out.scheduled if self.batch is None else self.batch.with_stops(out.scheduled)
        for request, n in scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                continue  # partial prefill chunk: its sample is discarded
            sim = request.sim
            request.append_output_token_ids(sim.next_token())
            sampled += 1
            if sim.first_token is None:
                sim.first_token = now
                self.prompt_tokens_total += request.num_prompt_tokens
            if check_stop(request):
                self._verify_kv(request, request.num_computed_tokens)
                self.running.remove(request)
                self._free_request(request)
                request.sim.finished = now
                finished.append(request.sim)
        self.generation_tokens_total += sampled
        if self.batch is not None:
            self.batch.after_update(scheduled)
        if self.debug:
            self.check_invariants()
        return finished

    # ---- internals ----

    def _long_prefill_cap(self) -> int:
        """``long_prefill_token_threshold`` for this pass, fixed at its start: 0 (no cap) when
        one request is running or waiting in all, "since there is no other request for it to
        starve" (``config/scheduler.py``)."""
        if len(self.running) + len(self.waiting) > 1:
            return self.long_prefill_token_threshold
        return 0

    def _admission(self, request: Request, token_budget: int, threshold: int) -> _Admission:
        """What admitting the head of the queue would ask of the pool (no change to the pool;
        the connector's lookup is its only side effect)."""
        new_computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.connector is not None:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        slot_args = {
            "num_new_computed_tokens": num_local,
            "new_computed_blocks": new_computed_blocks,
            "num_external_computed_tokens": num_external,
            "full_sequence_must_fit": self.scheduler_reserve_full_isl,
            "has_scheduled_reqs": bool(self.running),
        }
        if load_async:  # blocks for the hit only, delayed caching, in-flight prefills' blocks kept free
            slot_args["delay_cache_blocks"] = True
            slot_args["reserved_blocks"] = self._inflight_reserved_blocks()
            return _Admission(num_local, num_external, True, 0, slot_args)
        num_new_tokens = request.num_tokens - num_local - num_external
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return _Admission(num_local, num_external, False, min(num_new_tokens, token_budget), slot_args)

    def _landed(self, request: Request, token_budget: int, threshold: int) -> _Admission:
        """A request whose asynchronous load has landed: it holds its blocks and computed tokens,
        nothing is looked up; it asks for the rest of its sequence like a running one."""
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        slot_args = {"full_sequence_must_fit": self.scheduler_reserve_full_isl, "has_scheduled_reqs": bool(self.running)}
        return _Admission(0, 0, False, min(num_new_tokens, token_budget), slot_args, looked_up=False)

    def _finish_remote_load(self, request: Request) -> None:
        """``_update_waiting_for_remote_kv`` and the promotion back to WAITING / PREEMPTED: the
        loaded blocks are cached now that their KV is there, and a full hit recomputes its last
        token so that the next one can be sampled."""
        self.finished_recving.remove(request.request_id)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING

    def _inflight_reserved_blocks(self) -> int:
        """Blocks the in-flight prefills still need to hold their whole sequence."""
        kv = self.kv_cache_manager
        return sum(
            max(kv.get_num_blocks_to_allocate(r.request_id, min(r.num_tokens, self.max_model_len), []), 0)
            for r in self._inflight_prefills
        )

    def _add_chunk(
        self, out: _SchedulerOutput, request: Request, n: int, is_prefill: bool, now: float
    ) -> None:
        out.scheduled.append((request, n))
        out.plan.chunks.append(ScheduledChunk(request.sim, n, request.num_computed_tokens, is_prefill))
        if request.sim.first_scheduled is None:
            request.sim.first_scheduled = now

    def _preempt_request(self, request: Request) -> None:
        """Free all of the request's blocks and send it to the *front* of the waiting queue; it
        recomputes from scratch (minus whatever prefix is still cached) when re-admitted."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        self._inflight_prefills.discard(request)
        request.status = RequestStatus.PREEMPTED
        request.sim.evictions += 1
        request.sim.recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)  # a preempted request keeps its FCFS position

    def _check_stop(self, request: Request) -> bool:
        """``sched/utils.py: check_stop``: EOS (ground-truth output_len) or a length cap."""
        sim = request.sim
        if request.num_tokens >= self.max_model_len or len(sim.output) >= sim.max_new_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.request_success_total["length"] += 1
            return True
        if sim.done:
            request.status = RequestStatus.FINISHED_STOPPED
            self.request_success_total["stop"] += 1
            return True
        return False  # still RUNNING

    def _free_request(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_finished(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        bs = self.block_size
        blocks = self.kv_cache_manager.get_blocks(request.request_id)
        return [blocks[p // bs].block_id * bs + p % bs for p in range(start, end)]

    def _write_kv(self, request: Request, start: int, n: int) -> None:
        keys = request.token_keys[start : start + n]
        self.store.write("device", self._slots(request, start, start + n), keys)

    def _verify_kv(self, request: Request, end: int) -> None:
        if end and self.moves_bytes and not self.store.verify("device", self._slots(request, 0, end), request.token_keys[:end]):
            raise AssertionError(f"{request.request_id}: device KV of tokens [0, {end}) does not match")

    # ---- types.BatchDecoding (vllm/batch_decode.py)

    def enable_batch_decode(self) -> None:
        """Account steady decodes batch-wise from now on, where it is exact without per-request
        work: accounting-only, no connector, not debug (KV writes, offloading stores and the
        invariant checks follow every request every step). Elsewhere nothing changes."""
        if not (self.debug or self.moves_bytes or self.connector is not None):
            self.batch = BatchDecode(self)

    def sync(self) -> None:
        if self.batch is not None:
            self.batch.sync_all()

    # ---- types.FastForward (vllm/batch_decode.py)

    def decode_run(self) -> DecodeRun | None:
        return None if self.batch is None else self.batch.decode_run()

    def advance_decode(self, steps: int) -> list[int]:
        assert self.batch is not None, "decode runs are offered with batch decode only"
        return self.batch.advance_decode(steps)

    # ---- observability ----

    def stats(self) -> VLLMStats:
        manager = self.connector.manager if self.connector is not None else None
        local = self.kv_cache_manager.prefix_cache_stats
        return VLLMStats(
            num_gpu_blocks=self.block_pool.num_gpu_blocks,
            block_size=self.block_size,
            num_free_blocks=self.block_pool.get_num_free_blocks(),
            kv_cache_usage=self.block_pool.get_usage(),
            num_requests_running=len(self.running),
            num_requests_waiting=len(self.waiting) + len(self.kv_holding_waiting),
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=local.queries,
            prefix_cache_hits_total=local.hits,
            external_prefix_cache_queries_total=self.connector_prefix_cache_stats.queries,
            external_prefix_cache_hits_total=self.connector_prefix_cache_stats.hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            request_success_total=dict(self.request_success_total),
            cpu_offload_used_blocks=manager.num_used_blocks if manager is not None else 0,
            cpu_offload_total_blocks=manager.num_blocks if manager is not None else 0,
            cpu_offload_evicted_blocks_total=manager.num_evicted_blocks if manager is not None else 0,
            cpu_offload_loaded_tokens_total=self.cpu_offload_loaded_tokens_total,
            cpu_offload_stored_tokens_total=self.cpu_offload_stored_tokens_total,
            evicted_blocks_total=self.block_pool.num_evicted_blocks,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool, the block tables, the queues or the CPU pool are
        inconsistent (each component checks its own structure)."""
        self.kv_cache_manager.check_invariants(self.requests)
        assert len(self.running) <= self.max_num_seqs, "more running requests than max_num_seqs"
        run_ids = [r.request_id for r in self.running]
        wait_ids = [r.request_id for r in self.waiting] + [r.request_id for r in self.kv_holding_waiting]
        assert len(set(run_ids + wait_ids)) == len(run_ids) + len(wait_ids) == len(self.requests), (
            "running/waiting are not a partition of the live requests"
        )
        assert all(r.status == RequestStatus.RUNNING for r in self.running), "non-running request in running"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{r} in waiting"
            assert r.num_computed_tokens == 0, f"waiting {r} has computed tokens"
            assert r.request_id not in self.kv_cache_manager.req_to_blocks, f"waiting {r} holds blocks"
        for r in self.kv_holding_waiting:
            assert r.status is not RequestStatus.RUNNING, f"{r} in kv_holding_waiting"
            assert r.request_id in self.kv_cache_manager.req_to_blocks, f"{r} in kv_holding_waiting without blocks"
        assert self.finished_recving <= {r.request_id for r in self.kv_holding_waiting}, "a landed load for no request"
        if self.connector is not None:
            self.connector.manager.check_invariants(idle=self._pending is None)
