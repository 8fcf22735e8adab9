"""Deployments beyond one unified pool: a prefill/decode pair, a hybrid sliding-window model,
an LMCache CPU tier.

Production fleets disaggregate prefill and decode, serve hybrid-attention models and add
external KV tiers, and each exports its own series (facts/engine-metrics.md §1.7, §2.3). These
topologies wrap the reference schedulers (never change them): a wrapper is itself an
``EngineScheduler`` the engine loop drives, and a metrics hook turns the wrapped scheduler's
stats plus the topology's own state into an ``emit.EngineState``.

* ``PDPair``: the decode instance of a PD pair, judged, and its prefill instance. A request
  reaches the decode instance from the router and waits there until the decode pool has room
  for its prompt (SGLang's prealloc queue; vLLM's waiting for capacity), the slots are
  allocated *first*, then the prefill instance computes the prompt (a FIFO of roofline prefill
  times) and the KV crosses the link (bytes / bandwidth): SGLang's transfer queue, vLLM's
  requests ``deferred`` in WAITING_FOR_REMOTE_KVS. Then the request joins the decode
  scheduler, which admits it against the slots freed for it, without computing the prompt
  again (its prefill chunk costs no step time), and decodes; decode growth can still retract
  or preempt it (a recompute is costed in full).
* ``HybridSWA``: SGLang's two pools of a sliding-window model. Every request of the scenario
  fits the window (checked), so each of its tokens holds one slot in both pools; the reference
  scheduler runs on the SWA pool, which is smaller (``--swa-full-tokens-ratio``) and therefore
  binds, and the full pool is the same tokens over a larger capacity.
* ``LMCacheTier``: vLLM with a CPU KV tier behind the connector (the reference offloading
  mechanics: lookups at admission, GPU blocks allocated before the load) and LMCache's own
  exporter, on its own /metrics target or in vLLM's shared multiprocess /metrics.

Approximation: the engine loop idles to the next arrival when nothing can run, so a KV
transfer that completes while the decode instance is idle is taken up at the next arrival.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from kvdiag import capacity
from kvdiag.refpool import emit
from kvdiag.refpool.emit import EngineState, LMCacheState
from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sim import EngineMetrics, MetricsFactory, PoolTruth, SGLangMetrics, VLLMMetrics, default_metrics
from kvdiag.refpool.types import EngineScheduler, SimRequest, StepPlan
from kvdiag.refpool.vllm.request import Request
from kvdiag.refpool.vllm.scheduler import VLLMScheduler

if TYPE_CHECKING:  # scenarios.py imports this module
    from kvdiag.refpool.scenarios import Deployment

#: SGLang decode keeps this many tokens per running or incoming request out of preallocation
#: (``--num-reserved-decode-tokens``, default 512).
RESERVED_DECODE_TOKENS = 512
LMCACHE_LOG_INTERVAL_S = 10.0  # LMCache's hit-rate gauges cover the interval since its last log


class Topology(Protocol):
    """What a scenario's deployment changes in the engine loop and in what is scraped."""

    engines: tuple[str, ...]  # the engines this deployment exists for

    def pool_tokens(self, deployment: Deployment) -> int:
        """The pool the reference scheduler runs on (the binding one)."""
        ...

    def wrap(self, inner: EngineScheduler, engine: str, roofline: Roofline, pool_tokens: int) -> EngineScheduler: ...

    def metrics(self, engine: str) -> MetricsFactory: ...

    def step_time(self, base: Callable[[StepPlan], float]) -> Callable[[StepPlan], float]: ...

    fast_forward: bool  # whether the wrapped scheduler may take decode runs at once


class _Wrapped:
    """Forwards the engine-loop protocol to the reference scheduler it wraps."""

    def __init__(self, inner: EngineScheduler) -> None:
        self.inner = inner

    def add_request(self, req: SimRequest) -> None:
        self.inner.add_request(req)

    def schedule(self, now: float) -> StepPlan:
        return self.inner.schedule(now)

    def update_from_output(self, plan: StepPlan, now: float) -> list[SimRequest]:
        return self.inner.update_from_output(plan, now)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def idle(self) -> None:
        self.inner.idle()

    def check_invariants(self) -> None:
        self.inner.check_invariants()

    def stats(self):  # noqa: ANN201 (the wrapped engine's own stats record)
        return self.inner.stats()  # type: ignore[attr-defined]

    def take_report(self):  # noqa: ANN201 (SGLang only)
        return self.inner.take_report()  # type: ignore[attr-defined]


# ------------------------------------------------------------------ prefill/decode pair
@dataclass(frozen=True)
class PDPair:
    """The decode instance of a PD pair (judged) fed by one prefill instance."""

    link_bytes_per_s: float = 25e9  # KV transfer bandwidth per GPU (its RDMA NIC), each rank sending its shard
    engines: tuple[str, ...] = ("sglang", "vllm")
    fast_forward: bool = False  # stage transitions happen between steps: no decode runs at once

    def pool_tokens(self, deployment: Deployment) -> int:
        return deployment.pool_tokens

    def wrap(self, inner: EngineScheduler, engine: str, roofline: Roofline, pool_tokens: int) -> EngineScheduler:
        def prefill_seconds(n: int) -> float:
            return roofline.batch_seconds(n, 0, n * (n + 1) / 2)

        per_token = roofline.kv_bytes_per_token  # one rank's shard: every rank's link carries its own
        return PDDecode(inner, engine, prefill_seconds, lambda n: n * per_token / self.link_bytes_per_s, pool_tokens)

    def metrics(self, engine: str) -> MetricsFactory:
        return lambda sched, created: PDDecodeMetrics(sched, created)  # type: ignore[arg-type]

    def step_time(self, base: Callable[[StepPlan], float]) -> Callable[[StepPlan], float]:
        """A transferred prompt's first prefill is not computed on the decode instance."""

        def step(plan: StepPlan) -> float:
            chunks = [c for c in plan.chunks if not (c.is_prefill and c.req.evictions == 0)]
            return base(replace(plan, chunks=chunks)) if len(chunks) < len(plan.chunks) else base(plan)

        return step


@dataclass(eq=False)
class _InFlight:
    req: SimRequest
    tokens: int  # slots preallocated on the decode instance
    prefill_start: float
    prefill_end: float
    arrives: float  # the KV is on the decode instance

    def __lt__(self, other: _InFlight) -> bool:
        return self.arrives < other.arrives


class PDDecode(_Wrapped):
    """The decode instance: preallocation, the prefill instance's FIFO, the transfer, then the
    reference decode scheduler (module docstring)."""

    def __init__(
        self, inner: EngineScheduler, engine: str, prefill_seconds: Callable[[int], float],
        transfer_seconds: Callable[[int], float], prefill_pool_tokens: int,
    ) -> None:  # fmt: skip
        super().__init__(inner)
        self.engine = engine
        self.prefill_seconds = prefill_seconds
        self.transfer_seconds = transfer_seconds
        self.prefill_pool_tokens = prefill_pool_tokens
        self.prealloc: deque[SimRequest] = deque()
        self.inflight: list[_InFlight] = []  # heap by arrival
        self.reserved = 0  # tokens preallocated for in-flight requests
        self.prefill_free_at = 0.0
        self.link_free_at = 0.0  # the link carries one prompt's KV at a time
        self.refused = False  # the head of the prealloc queue did not fit at the last pass
        self.now = 0.0
        self.transferred_tokens_total = 0
        self.prefilled_requests_total = 0
        self.prefilled_tokens_total = 0

    def add_request(self, req: SimRequest) -> None:
        self.prealloc.append(req)

    def has_work(self) -> bool:
        return bool(self.prealloc or self.inflight) or self.inner.has_work()

    def schedule(self, now: float) -> StepPlan:
        self.now = now
        self._receive(now)
        self._preallocate(now)
        plan = self.inner.schedule(now)
        if self.refused:
            plan.blocked_on_kv = True
        return plan

    def _receive(self, now: float) -> None:
        while self.inflight and self.inflight[0].arrives <= now:
            job = heapq.heappop(self.inflight)
            self.reserved -= job.tokens
            self.transferred_tokens_total += len(job.req.prompt)
            self.inner.add_request(job.req)

    def _room(self) -> tuple[int, int, int]:
        """(free slots after what is preallocated, allocation granularity, room a request needs
        beyond its slots). SGLang (``DecodePreallocQueue._allocatable_token_budgets``@0.5.23)
        keeps ``num_reserved_decode_tokens`` per running, transferring and waiting request out
        of the free slots and admits a request only if its slots plus one such reserve fit;
        vLLM allocates the blocks of the prompt from its free blocks. Cached evictable slots
        count as free: without a decode radix cache (SGLang's default) they would be."""
        st = self.inner.stats()  # type: ignore[attr-defined]
        if self.engine == "sglang":
            requests = st.num_running_reqs + st.num_queue_reqs + len(self.inflight)
            free = st.kv_available_tokens + st.kv_evictable_tokens - self.reserved - RESERVED_DECODE_TOKENS * requests
            return free, 1, RESERVED_DECODE_TOKENS
        return st.num_free_blocks * st.block_size - self.reserved, st.block_size, 0

    def _preallocate(self, now: float) -> None:
        room, grain, reserve = self._room()
        self.refused = False
        while self.prealloc:
            req = self.prealloc[0]
            need = math.ceil((len(req.prompt) + 1) / grain) * grain
            if need + reserve > room:
                self.refused = True
                return
            self.prealloc.popleft()
            room -= need + reserve  # the next request also keeps this one's decode reserve
            self.reserved += need
            start = max(now, self.prefill_free_at)
            end = self.prefill_free_at = start + self.prefill_seconds(len(req.prompt))
            arrives = self.link_free_at = max(end, self.link_free_at) + self.transfer_seconds(len(req.prompt))
            self.prefilled_requests_total += 1
            self.prefilled_tokens_total += len(req.prompt)
            heapq.heappush(self.inflight, _InFlight(req, need, start, end, arrives))

    def stats(self):  # noqa: ANN201
        """The decode scheduler's stats with the preallocated slots taken (they are allocated)."""
        st = self.inner.stats()  # type: ignore[attr-defined]
        if self.engine == "sglang":
            return replace(st, kv_available_tokens=st.kv_available_tokens - self.reserved)
        return replace(st, num_free_blocks=st.num_free_blocks - self.reserved // st.block_size)

    def take_report(self):  # noqa: ANN201
        report = self.inner.take_report()  # type: ignore[attr-defined]
        self.reported = report is not None
        return None if report is None else replace(report, kv_available_tokens=report.kv_available_tokens - self.reserved)

    def stages(self) -> tuple[int, int, int]:
        """(waiting for the prefill instance, being prefilled, KV on the wire) now."""
        now = self.now
        waiting = sum(j.prefill_start > now for j in self.inflight)
        running = sum(j.prefill_start <= now < j.prefill_end for j in self.inflight)
        return waiting, running, len(self.inflight) - waiting - running

    def prefill_state(self, created: float) -> EngineState:
        """The prefill instance as its own /metrics shows it: the requests waiting for the
        decode instance's preallocation are its bootstrap queue, the prompts it has not started
        its waiting queue, the one it computes its running batch, the KV it sends its inflight
        queue (and its pool holds the KV of those until sent)."""
        waiting, running, wire = self.stages()
        held = sum(len(j.req.prompt) for j in self.inflight if j.prefill_start <= self.now)
        return EngineState(
            capacity_tokens=self.prefill_pool_tokens, used_tokens=min(held, self.prefill_pool_tokens), running=running,
            waiting=waiting, role="prefill", bootstrap_queue=len(self.prealloc), inflight_queue=wire,
            prompt_tokens_total=self.prefilled_tokens_total, requests_total=self.prefilled_requests_total, created=created,
        )  # fmt: skip


class PDDecodeMetrics:
    """The decode instance's exposition: the engine's own hook over the wrapper's stats (the
    preallocated slots counted as used), plus the role's queues. SGLang refreshes the PD gauges
    with the rest of its scheduler gauges (at a report); vLLM every step. The ground truth's
    waiting count holds every request the decode instance has not admitted yet."""

    def __init__(self, sched: PDDecode, created: float) -> None:
        self.sched = sched
        self.base: EngineMetrics = SGLangMetrics(sched, created) if sched.engine == "sglang" else VLLMMetrics(sched, created)  # type: ignore[arg-type]
        self.engine = self.base.engine
        self.state = self.base.state
        self.state.role = "decode"
        self.state.kv_consumer = True
        sched.reported = False

    def on_step(self) -> PoolTruth:
        sched, s = self.sched, self.sched.inner
        truth = self.base.on_step()
        waiting, running, wire = sched.stages()
        st = s.stats()  # type: ignore[attr-defined]
        if self.engine == "sglang":
            if sched.reported or not sched.has_work():
                self._sglang_queues()
        else:
            self.state.waiting = st.num_requests_waiting + len(sched.prealloc) + len(sched.inflight)
            self.state.deferred = len(sched.inflight)
            self.state.kv_fetch_waiting = waiting + running
            self.state.kv_fetch_in_progress = wire
            self.state.external_query_tokens_total = st.external_prefix_cache_queries_total + sched.transferred_tokens_total
            self.state.external_hit_tokens_total = st.external_prefix_cache_hits_total + sched.transferred_tokens_total
        return replace(truth, waiting=truth.waiting + len(sched.prealloc) + len(sched.inflight))

    def _sglang_queues(self) -> None:
        s, sched = self.state, self.sched
        s.prealloc_queue = len(sched.prealloc)
        s.transfer_queue = len(sched.inflight)
        s.prealloc_tokens = sched.reserved
        _sglang_counters(s, sched.inner.stats())  # type: ignore[attr-defined]


# ------------------------------------------------------------------ hybrid sliding window
@dataclass(frozen=True)
class HybridSWA:
    """SGLang serving a sliding-window model with ``--swa-full-tokens-ratio`` (module doc)."""

    swa_full_tokens_ratio: float
    engines: tuple[str, ...] = ("sglang",)
    fast_forward: bool = True

    def pool_tokens(self, deployment: Deployment) -> int:
        d = deployment
        return hybrid_pools(d.model, d.gpu, d.tp, d.mem_fraction, self.swa_full_tokens_ratio)[1]

    def wrap(self, inner: EngineScheduler, engine: str, roofline: Roofline, pool_tokens: int) -> EngineScheduler:
        return inner

    def metrics(self, engine: str) -> MetricsFactory:
        full = lambda swa: int(swa / self.swa_full_tokens_ratio)  # noqa: E731
        return lambda sched, created: HybridSWAMetrics(sched, created, full)  # type: ignore[arg-type]

    def step_time(self, base: Callable[[StepPlan], float]) -> Callable[[StepPlan], float]:
        return base

    @staticmethod
    def check(model: str, longest_request: int) -> None:
        """The model holds only while every request fits the window (each token in both pools)."""
        window = capacity.model(model).sliding_window
        if window is None or longest_request > window:
            raise ValueError(f"requests up to {longest_request} tokens exceed {model}'s sliding window ({window}), which this model assumes")


class HybridSWAMetrics:
    """SGLang's hook on the SWA pool the scheduler runs on, with the full pool beside it: the
    same tokens (all inside the window) over ``full(swa capacity)`` slots."""

    engine = "sglang"

    def __init__(self, sched: SGLangScheduler, created: float, full: Callable[[int], int]) -> None:
        self.base = SGLangMetrics(sched, created)
        self.state = self.base.state
        swa = self.state.capacity_tokens
        self.state.swa_capacity_tokens = swa
        self.state.capacity_tokens = full(swa)

    def on_step(self) -> PoolTruth:
        truth = self.base.on_step()
        s = self.state
        s.swa_used_tokens, s.swa_evictable_tokens = s.used_tokens, s.evictable_tokens
        _sglang_counters(s, self.base.scheduler.stats())
        return truth  # over the SWA pool: the one that binds


# ------------------------------------------------------------------ LMCache tier
@dataclass(frozen=True)
class LMCacheTier:
    """vLLM with LMCache's CPU tier (the scenario's ``l2_ratio`` x the GPU pool) behind its
    connector."""

    engines: tuple[str, ...] = ("vllm",)
    fast_forward: bool = False  # the connector path never takes decode runs at once

    def pool_tokens(self, deployment: Deployment) -> int:
        return deployment.pool_tokens

    def wrap(self, inner: EngineScheduler, engine: str, roofline: Roofline, pool_tokens: int) -> EngineScheduler:
        return LMCacheWorker(inner, roofline.kv_bytes_per_token)

    def metrics(self, engine: str) -> MetricsFactory:
        """vLLM's hook, with the connector's lookups as its external prefix-cache counters."""
        return lambda sched, created: CounterMetrics(VLLMMetrics(sched, created), _external)  # type: ignore[arg-type]

    def step_time(self, base: Callable[[StepPlan], float]) -> Callable[[StepPlan], float]:
        return base


class LMCacheWorker(_Wrapped):
    """Counts the connector's work as LMCache does (lmcache/observability.py@0.5.6): a lookup
    per request the scheduler considers, over all its tokens (a resumed request's output too),
    its hits the leading tokens the tier holds, cached per request until it is scheduled
    (``vllm_v1_adapter.get_num_new_matched_tokens``), so a request blocked at the queue's head
    is looked up once; retrieves and stores as the connector schedules them. The hit-rate gauges
    cover the interval since the last ``LMCACHE_LOG_INTERVAL_S`` log."""

    def __init__(self, inner: EngineScheduler, kv_bytes_per_token: int) -> None:
        super().__init__(inner)
        self.kv_bytes_per_token = kv_bytes_per_token  # one worker's (TP rank's) shard
        self.lmcache = LMCacheState()
        self._last_log = 0.0
        self._at_log = (0, 0, 0, 0)  # lookup tokens, lookup hits, requested, hit at the last log
        self._looked_up: set[str] = set()
        self.connector = inner.connector  # type: ignore[attr-defined]
        self.connector.observer = self  # vllm.offload.LookupObserver

    def looked_up(self, request: Request) -> None:
        """LMCache's lookup: counted once per request until it is allocated (see the class)."""
        if request.request_id not in self._looked_up:
            self._looked_up.add(request.request_id)
            self.lmcache.lookup_tokens_total += request.num_tokens
            self.lmcache.lookup_hits_total += self.connector.manager.lookup(request.block_hashes) * self.connector.block_size

    def allocated(self, request: Request) -> None:
        """Scheduled: its next lookup (after a preemption) counts again."""
        self._looked_up.discard(request.request_id)

    def schedule(self, now: float) -> StepPlan:
        plan = self.inner.schedule(now)
        c = self.lmcache
        c.stored_tokens_total += plan.stored_tokens
        c.requested_tokens_total += plan.loaded_tokens
        c.hit_tokens_total += plan.loaded_tokens  # a scheduled load is retrieved whole
        st = self.inner.stats()  # type: ignore[attr-defined]
        c.vllm_hit_tokens_total = st.prefix_cache_hits_total
        c.prompt_tokens_total = st.prompt_tokens_total
        c.local_cache_usage_bytes = st.cpu_offload_used_blocks * st.block_size * self.kv_bytes_per_token
        if now - self._last_log >= LMCACHE_LOG_INTERVAL_S:
            lt, lh, rq, ht = self._at_log
            c.lookup_hit_rate = _ratio(c.lookup_hits_total - lh, c.lookup_tokens_total - lt)
            c.retrieve_hit_rate = _ratio(c.hit_tokens_total - ht, c.requested_tokens_total - rq)
            self._at_log = (c.lookup_tokens_total, c.lookup_hits_total, c.requested_tokens_total, c.hit_tokens_total)
            self._last_log = now
        return plan


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _external(state: EngineState, st: object) -> None:
    state.external_query_tokens_total = st.external_prefix_cache_queries_total  # type: ignore[attr-defined]
    state.external_hit_tokens_total = st.external_prefix_cache_hits_total  # type: ignore[attr-defined]


class CounterMetrics:
    """An engine's own hook plus the counters it exports beside the scheduler gauges (``counters``
    copies them from the scheduler's stats after every step); ``kv_bytes_per_token_per_rank``
    turns the L2 token counts into the byte counters."""

    def __init__(self, base: EngineMetrics, counters: Callable[[EngineState, object], None],
                 kv_bytes_per_token_per_rank: int | None = None) -> None:  # fmt: skip
        self.base, self.counters = base, counters
        self.engine = base.engine
        self.state = base.state
        self.state.kv_bytes_per_token_per_rank = kv_bytes_per_token_per_rank

    def on_step(self) -> PoolTruth:
        truth = self.base.on_step()
        self.counters(self.state, self.base.stats)  # type: ignore[attr-defined] (the stats that step read)
        return truth


def _vllm_counters(state: EngineState, st: object) -> None:
    """The connector's external prefix-cache counters (0 without one) and CPU offloading's
    loaded / stored tokens."""
    _external(state, st)
    state.load_back_tokens_total = st.cpu_offload_loaded_tokens_total  # type: ignore[attr-defined]
    state.backup_tokens_total = st.cpu_offload_stored_tokens_total  # type: ignore[attr-defined]


def _sglang_counters(state: EngineState, st: object) -> None:
    """The tokens retractions threw away (apart since 0.5.7) and the radix cache's eviction,
    load-back, backup and drop counts."""
    state.retracted_input_tokens_total = st.num_retracted_input_tokens_total  # type: ignore[attr-defined]
    state.retracted_output_tokens_total = st.num_retracted_output_tokens_total  # type: ignore[attr-defined]
    state.evicted_tokens_total = st.evicted_tokens_total  # type: ignore[attr-defined]
    state.load_back_tokens_total = st.load_back_tokens_total or 0  # type: ignore[attr-defined]
    state.backup_tokens_total = st.hicache_backup_tokens_total or 0  # type: ignore[attr-defined]
    state.dropped_tokens_total = st.hicache_dropped_tokens_total or 0  # type: ignore[attr-defined]


def unified_metrics(kv_bytes_per_token_per_rank: int | None = None) -> MetricsFactory:
    """The metrics hook of a unified instance of either engine (``kv_bytes_per_token_per_rank``
    turns either engine's L2 token counts into its byte counters)."""

    def make(sched: EngineScheduler, created: float) -> EngineMetrics:
        if isinstance(sched, VLLMScheduler):
            return CounterMetrics(VLLMMetrics(sched, created), _vllm_counters, kv_bytes_per_token_per_rank)
        if isinstance(sched, SGLangScheduler):
            return CounterMetrics(SGLangMetrics(sched, created), _sglang_counters, kv_bytes_per_token_per_rank)
        return default_metrics(sched, created)

    return make


def lmcache_text(sims: Iterable[object], model: str, openmetrics: bool = False) -> str:
    """LMCache's own /metrics for the vLLM workers of ``sims`` (one worker per DP engine)."""
    workers = [sim.scheduler.lmcache for sim in sims]  # type: ignore[attr-defined]
    return emit.render_lmcache(workers, model, model, openmetrics)


def hybrid_pools(model: str, gpu: str, tp: int, mem_fraction: float, ratio: float) -> tuple[int, int]:
    """(full, SWA) pool tokens per GPU of a hybrid model, as ``kvdiag capacity`` sizes them."""
    spec = capacity.model(model)
    pool, _ = capacity.pool_from_memory(spec, tp, capacity.GPUS[gpu].memory_bytes, mem_fraction, spec.weight_bytes(2))
    pools = capacity.Plan(spec, "bf16", tp, pool, swa_full_tokens_ratio=ratio).swa_pools()
    if pools is None:
        raise ValueError(f"{spec.name} has no sliding-window layers")
    return pools
