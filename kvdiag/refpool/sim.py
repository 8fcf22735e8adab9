"""Discrete-event loop of one engine instance, with ground truth and the engine's exposition.

Every verdict kvdiag gives needs a case where the truth is known. This loop drives either
reference scheduler through ``types.EngineScheduler`` only: requests arrive from a workload,
``schedule`` plans an iteration, the roofline gives its duration, ``update_from_output`` ends it.
What the simulator knows and no metric shows is recorded as ground truth: per request (TTFT,
queue time, evictions, recomputed tokens) and per step (was admission blocked on L1, how many
requests were evicted, the true pool usage). An ``EngineMetrics`` hook turns the scheduler's own
``stats()`` into an ``emit.EngineState`` at the engine's update cadence, so ``exposition()``
shows what a scrape of the real engine would show at that simulated moment.

A live server advances ``run_until(t)`` in step with wall time × speed and renders
``exposition()`` between calls (both hold ``lock``); ``restart()`` replaces the engine by a
fresh process, whose counters start again from zero.
"""

from __future__ import annotations

import gc
import threading
from array import array
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np

from kvdiag.refpool import emit
from kvdiag.refpool.emit import EngineState
from kvdiag.refpool.sglang.scheduler import SGLangScheduler
from kvdiag.refpool.sglang.stats import SGLangStats
from kvdiag.refpool.types import DecodeRun, EngineScheduler, SimRequest, StepPlan, batch_decoding, pickle_by_fields
from kvdiag.refpool.vllm.scheduler import VLLMScheduler, VLLMStats
from kvdiag.refpool.workload import ClosedStream

EPOCH = 1_795_952_340.0  # simulated t = 0 as a Unix time, for _created series and recordings


#: Young-generation threshold for a simulation process (CPython's default is 700).
GC_THRESHOLD = (50_000, 20, 100)


def tune_gc() -> None:
    """Collect cyclic garbage less often, for a process that runs simulations.

    A step allocates a short-lived object per running request while the heap holds thousands of
    long-lived ones (requests, tree nodes, blocks); at CPython's default thresholds the collector
    re-walks that heap every few steps, a quarter of an SGLang run's time. The simulation makes
    little cyclic garbage, so fewer passes cost nothing in memory. Process-wide, so only the
    commands and the benchmark that run simulations call it, never the library.
    """
    gc.set_threshold(*GC_THRESHOLD)


# ------------------------------------------------------------------ ground truth records
@dataclass
class RequestRecord:
    """One request's ground truth, kept after its tokens are dropped (long runs stay small)."""

    rid: str
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None  # None: lost in a restart
    prompt_tokens: int
    output_tokens: int
    evictions: int
    recomputed_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int

    @classmethod
    def of(cls, r: SimRequest) -> RequestRecord:
        return cls(
            r.rid, r.arrival, r.first_scheduled, r.first_token, r.finished, len(r.prompt), len(r.output),
            r.evictions, r.recomputed_tokens, r.device_hit_tokens, r.host_hit_tokens,
        )  # fmt: skip

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival


def _column(typecode: str) -> array:
    return field(default_factory=lambda: array(typecode))


@dataclass
class StepLog:
    """Per-iteration ground truth, stored in typed columns (8 bytes or less per value) so
    hour-long runs at a hundred steps a second stay small."""

    start: array = _column("d")
    duration: array = _column("d")
    prefill: array = _column("b")  # the step ran at least one prefill chunk
    batch: array = _column("q")  # requests in the step
    new_tokens: array = _column("q")
    blocked_on_kv: array = _column("b")  # a waiting request was refused for lack of KV
    blocked_other: array = _column("b")  # ... for another cap (sequences, token budget)
    evicted: array = _column("q")  # retracted / preempted this step
    running: array = _column("q")  # after the step
    waiting: array = _column("q")
    usage: array = _column("d")  # true used / capacity after the step
    evictable: array = _column("d")  # true evictable / capacity
    loaded_tokens: array = _column("q")  # L2 -> L1
    stored_tokens: array = _column("q")  # L1 -> L2

    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of the columns as numpy arrays (flags as bool), for slicing by time."""
        out = {}
        for f in fields(self):
            col = getattr(self, f.name)
            out[f.name] = np.array(col, dtype=bool if col.typecode == "b" else col.typecode)
        return out


# ------------------------------------------------------------------ metrics hook
@dataclass(slots=True)
class PoolTruth:
    """The pool as it really is after a step (every engine's usage gauge is derived from it).
    Built after every step, so not frozen (a frozen dataclass's ``__init__`` costs several
    plain ones); never changed once built."""

    capacity_tokens: int
    used_tokens: int  # held by requests
    evictable_tokens: int  # cached, unreferenced (0 where the engine cannot tell, see adapters)
    running: int
    waiting: int


pickle_by_fields(PoolTruth)


class EngineMetrics(Protocol):
    """Keeps one ``EngineState`` as the engine would export it, from the scheduler's stats."""

    engine: str  # "sglang" | "vllm": which exposition ``emit.render`` writes
    state: EngineState

    def on_step(self) -> PoolTruth:
        """Called after every iteration: refresh what the engine refreshes now; return the truth."""
        ...


MetricsFactory = Callable[[EngineScheduler, float], EngineMetrics]  # (scheduler, created) -> hook


class SGLangReporting(Protocol):
    """What ``SGLangMetrics`` reads of a scheduler: the reference SGLang scheduler's, or those of
    a wrapper that reports for one (a PD decode instance). A protocol, not the class, so that a
    compiled hook takes a wrapper too (mypyc checks a class-typed argument's type)."""

    def stats(self) -> SGLangStats: ...

    def take_report(self) -> SGLangStats | None: ...

    def has_work(self) -> bool: ...


class VLLMReporting(Protocol):
    """What ``VLLMMetrics`` reads of a scheduler (``SGLangReporting`` says why a protocol)."""

    def stats(self) -> VLLMStats: ...


class SGLangMetrics:
    """SGLang's cadence: scheduler gauges only when a prefill batch is formed, every
    ``decode_log_interval`` decode steps and when idle (the scheduler's ``take_report``);
    counters and histograms as they happen."""

    engine = "sglang"

    def __init__(self, scheduler: SGLangReporting, created: float) -> None:
        self.scheduler = scheduler
        st = self.stats = scheduler.stats()  # as the last on_step read them (hooks beside it reuse them)
        self.state = EngineState(
            capacity_tokens=st.max_total_num_tokens, l2_capacity_tokens=st.hicache_host_total_tokens, created=created
        )

    def on_step(self) -> PoolTruth:
        sched, s = self.scheduler, self.state
        st = self.stats = sched.stats()
        s.evictions_total = st.num_retracted_requests_total
        s.prefix_hit_tokens_total = st.cached_tokens_device_total
        s.l2_hit_tokens_total = st.cached_tokens_host_total
        s.prefill_input_tokens_total = st.prefill_effective_input_tokens_total
        s.prefill_compute_tokens_total = st.prefill_compute_tokens_total
        s.prefill_cache_tokens_total = st.prefill_cache_tokens_total
        s.prompt_tokens_total = st.prompt_tokens_total
        s.generation_tokens_total = st.generation_tokens_total
        s.requests_total = st.num_requests_total
        report = sched.take_report()
        if report is None and not sched.has_work():
            report = st  # idle publish: the gauges drain to zero
        if report is not None:
            s.used_tokens = report.kv_used_tokens
            s.evictable_tokens = report.kv_evictable_tokens
            s.running = report.num_running_reqs
            s.waiting = report.num_queue_reqs
            s.new_token_ratio = report.new_token_ratio
            s.last_eviction_event = report.num_retracted_reqs
            s.l2_used_tokens = report.hicache_host_used_tokens or 0
        return PoolTruth(st.max_total_num_tokens, st.kv_used_tokens, st.kv_evictable_tokens, st.num_running_reqs, st.num_queue_reqs)


class VLLMMetrics:
    """vLLM's cadence: every engine step (``make_stats``). The pool is counted in blocks with
    the null block excluded, and cached unreferenced blocks count as free: usage is
    ``1 − free/(N − 1)``, and the evictable part is not reported (0 here, never invented)."""

    engine = "vllm"

    def __init__(self, scheduler: VLLMReporting, created: float) -> None:
        self.scheduler = scheduler
        st = self.stats = scheduler.stats()  # as the last on_step read them (hooks beside it reuse them)
        bs = st.block_size
        self.state = EngineState(
            capacity_tokens=(st.num_gpu_blocks - 1) * bs,
            block_size=bs,
            l2_capacity_tokens=st.cpu_offload_total_blocks * bs if st.cpu_offload_total_blocks else None,
            max_model_len=getattr(scheduler, "max_model_len", emit.DEFAULT_MAX_MODEL_LEN),  # a PD wrapper: the default
            created=created,
        )

    def on_step(self) -> PoolTruth:
        st = self.stats = self.scheduler.stats()
        s = self.state
        bs = st.block_size
        s.used_tokens = (st.num_gpu_blocks - 1 - st.num_free_blocks) * bs
        s.running = st.num_requests_running
        s.waiting = st.num_requests_waiting
        s.evictions_total = st.num_preemptions_total
        s.prefix_hit_tokens_total = st.prefix_cache_hits_total
        s.prompt_tokens_total = st.prompt_tokens_total
        s.generation_tokens_total = st.generation_tokens_total
        s.requests_total = sum(st.request_success_total.values())
        s.l2_used_tokens = st.cpu_offload_used_blocks * bs
        s.l2_hit_tokens_total = st.external_prefix_cache_hits_total
        return PoolTruth(s.capacity_tokens, s.used_tokens, 0, s.running, s.waiting)


def default_metrics(scheduler: EngineScheduler, created: float) -> EngineMetrics:
    """The adapter for a reference scheduler, by its type."""
    if isinstance(scheduler, SGLangScheduler):
        return SGLangMetrics(scheduler, created)
    if isinstance(scheduler, VLLMScheduler):
        return VLLMMetrics(scheduler, created)
    raise TypeError(f"no metrics adapter for {type(scheduler).__name__}; pass metrics=")


# ------------------------------------------------------------------ the loop
class Simulation:
    """One engine instance under one workload, advanced in simulated seconds.

    ``make_scheduler`` builds a fresh engine (at start and on ``restart``); ``step_time`` maps a
    plan to seconds (``roofline.Roofline.step_time``); ``requests`` is any arrival-ordered
    iterable (``workload.Workload.requests()``), consumed lazily.

    ``batch_time(tokens, context, pairs)`` is the same step-time model on a batch's aggregates
    (``Roofline.batch_seconds``). Given it, runs of identical decode steps that a scheduler
    offers (``types.FastForward``) are taken at once, and a scheduler that can account its
    decodes batch-wise (``types.BatchDecoding``) does, with every step's duration, ground truth
    and final metrics exactly as step by step.
    """

    def __init__(
        self,
        make_scheduler: Callable[[], EngineScheduler],
        requests: Iterable[SimRequest],
        step_time: Callable[[StepPlan], float],
        metrics: MetricsFactory = default_metrics,
        epoch: float = EPOCH,
        record_steps: bool = True,
        batch_time: Callable[[int, int, float], float] | None = None,
    ) -> None:
        self.make_scheduler = make_scheduler
        self.step_time = step_time
        self.batch_time = batch_time
        self.metrics_factory = metrics
        self.epoch = epoch
        self.record_steps = record_steps
        self.now = 0.0
        self.steps = StepLog()
        self.records: list[RequestRecord] = []
        self.restarts: list[float] = []
        self.lock = threading.Lock()
        self._arrivals: Iterator[SimRequest] = iter(requests)
        self._next: SimRequest | None = next(self._arrivals, None)
        self._start_engine()

    def _start_engine(self) -> None:
        self.scheduler = self.make_scheduler()
        batch = batch_decoding(self.scheduler)
        if self.batch_time is not None and batch is not None:
            batch.enable_batch_decode()
        self.metrics = self.metrics_factory(self.scheduler, self.epoch + self.now)
        self._live: dict[SimRequest, None] = {}  # admitted, unfinished (ordered, for restart)
        self._unscheduled: set[SimRequest] = set()  # queue time not yet observed
        self._no_token: set[SimRequest] = set()  # TTFT not yet observed
        self._idle = False  # the idle iteration has run since the last step
        self._itl_from: float | None = None  # when the running requests' last tokens came (None: none running)

    # -------------------------------------------------------------- driving
    def run_until(self, t: float) -> None:
        """Advance to simulated time ``t``. A step that starts before ``t`` runs to its end (an
        engine iteration is atomic), so ``now`` may pass ``t`` by less than one step."""
        with self.lock:
            while True:
                self._admit_arrivals()
                idle = not self.scheduler.has_work()
                if idle:  # the loop's next iteration finds nothing: it idles at once
                    self._go_idle()
                if self.now >= t:
                    return
                if idle:
                    self._idle_until(t)
                    continue
                if self._fast_forward(t):
                    continue
                plan = self.scheduler.schedule(self.now)
                if plan.idle:  # work exists but nothing can run (e.g. waiting on a transfer)
                    self._finish_step(plan, self.now, 0.0)
                    self._idle_until(t)
                    continue
                self._finish_step(plan, self.now, self.step_time(plan))

    def run(self, duration: float) -> Simulation:
        """Run ``duration`` more simulated seconds; returns self for chaining."""
        self.run_until(self.now + duration)
        return self

    def restart(self) -> None:
        """The engine process dies and a new one starts now: in-flight requests are lost
        (recorded with ``finished=None``), the pool is empty and every counter restarts at zero."""
        with self.lock:
            batch = batch_decoding(self.scheduler)
            if batch is not None:
                batch.sync()
            self.records.extend(RequestRecord.of(r) for r in self._live)
            if self._live and isinstance(self._arrivals, ClosedStream):  # their clients see an error and send again
                self._clients_return(list(self._live), self.now)
            self.restarts.append(self.now)
            self._start_engine()

    # -------------------------------------------------------------- reading
    @property
    def engine(self) -> str:
        return self.metrics.engine

    def state(self) -> EngineState:
        """The instance's exported numbers right now (at the engine's own cadence)."""
        return self.metrics.state

    def exposition(self, dialect: str | None = None, openmetrics: bool = False) -> str:
        """This instance rendered alone as its engine's /metrics body (see ``emit.render``;
        DP servers render several simulations' ``state()`` together)."""
        with self.lock:
            return emit.render(self.engine, [self.state()], dialect=dialect, openmetrics=openmetrics)

    def ttft_quantile(self, q: float, since: float = 0.0, until: float = float("inf")) -> float | None:
        """Ground-truth TTFT quantile over requests whose first token came in [since, until)."""
        v = [r.first_token - r.arrival for r in self.records if r.first_token is not None and since <= r.first_token < until]
        return float(np.quantile(v, q)) if v else None

    # -------------------------------------------------------------- internals
    def _admit_arrivals(self, now: float | None = None) -> int:
        """Hand the scheduler every request that has arrived by ``now`` (default: the loop's
        clock); how many."""
        now = self.now if now is None else now
        n = 0
        while self._next is not None and self._next.arrival <= now:
            req = self._next
            self.scheduler.add_request(req)
            self._live[req] = None
            self._unscheduled.add(req)
            self._no_token.add(req)
            self._next = next(self._arrivals, None)
            n += 1
        return n

    def _clients_return(self, finished: list[SimRequest], t: float) -> None:
        """Closed-loop clients whose answers came back send their next requests: the stream's
        next send may now come before the one the loop already holds."""
        stream = self._arrivals
        assert isinstance(stream, ClosedStream)
        for r in finished:
            stream.returned(r, t)
        if self._next is not None:
            stream.give_back(self._next)
        self._next = next(stream, None)

    def _go_idle(self) -> None:
        """The engine's loop found nothing to run: its idle iteration (SGLang resets
        new_token_ratio there), once per idle spell, and what that iteration publishes."""
        if self._idle:
            return
        self.scheduler.idle()
        self.metrics.on_step()
        self._idle = True

    def _idle_until(self, t: float) -> None:
        """Nothing can run: jump to the next arrival (or to ``t``)."""
        nxt = self._next.arrival if self._next is not None else t
        self.now = max(self.now, min(nxt, t))

    def _finish_step(self, plan: StepPlan, start: float, dt: float) -> None:
        self._idle = False
        end = start + dt
        finished = self.scheduler.update_from_output(plan, end)
        self.now = end
        new_tokens, prefill, decodes = plan.decode_batch, False, plan.decode_batch
        for c in plan.chunks:  # one pass: this runs every step over the whole batch
            new_tokens += c.num_new_tokens
            if c.is_prefill:
                prefill = True
                self._observe_first(c.req)
            else:
                decodes += 1
        self._observe_itl(end, decodes, prefill)
        if finished and isinstance(self._arrivals, ClosedStream):
            self._clients_return(finished, end)
        for r in finished:
            self._live.pop(r, None)
            self._unscheduled.discard(r)  # aborted before it ever ran
            self._no_token.discard(r)
            self.records.append(RequestRecord.of(r))
            if r.first_token is not None:  # one aborted at the door is no finished request to either reference engine
                self.metrics.state.observe_finished(len(r.prompt), len(r.output), r.device_hit_tokens + r.host_hit_tokens)
        truth = self.metrics.on_step()
        if truth.running == 0:
            self._itl_from = None
        if self.record_steps:
            self._log(plan, start, dt, new_tokens, prefill, truth)

    def _observe_itl(self, end: float, decodes: int, prefill: bool) -> None:
        """Inter-token latency as the engines observe it, once per token after a request's
        first: each of a step's ``decodes`` waited since the last step that gave the running
        requests a token (an SGLang prefill step between two decode steps delays them all), or
        since the first token where the batch has just started."""
        if decodes:
            if self._itl_from is not None:
                self.metrics.state.itl.observe_n(end - self._itl_from, decodes)
            self._itl_from = end
        elif prefill and self._itl_from is None:
            self._itl_from = end

    def _fast_forward(self, t: float) -> bool:
        """Take the decode run the scheduler offers, up to the step that starts at or after
        ``t`` or the next arrival (exactly where the step-by-step loop would stop or admit).

        Where the run's queue is latched (``DecodeRun.queue_latched``), arrivals join it at the
        top of the step they precede, as step by step, without ending the run: the offer is asked
        again after each, and the run ends before that step if it is withdrawn (an arrival the
        scheduler rejects outright is finished by a step of its own)."""
        offer = getattr(self.scheduler, "decode_run", None)
        if self.batch_time is None or offer is None:
            return False
        run: DecodeRun | None = offer()
        if run is None:
            return False
        latched = run.queue_latched
        limit = t if latched or self._next is None else min(t, self._next.arrival)
        starts: list[float] = []
        durations: list[float] = []
        waiting: list[int] = []
        now, context, n = self.now, run.context_tokens, run.batch
        current = run
        while len(starts) < run.max_steps and now < limit:
            if latched and starts and self._admit_arrivals(now):
                renewed = offer()
                if renewed is None:
                    break
                current = renewed
            dt = self.batch_time(n, context, float(context + n))  # n one-token decodes: pairs = context + n
            starts.append(now)
            durations.append(dt)
            waiting.append(current.waiting)
            now, context = now + dt, context + n
            self._observe_itl(now, n, False)
        if not starts:
            return False
        used = self.scheduler.advance_decode(len(starts))  # type: ignore[attr-defined]
        self._idle = False
        self.now = now
        truth = self.metrics.on_step()  # nothing reads the hook inside a run: once, after it, is every step
        if self.record_steps:
            plan = StepPlan(blocked_on_kv=run.blocked_on_kv, blocked_other=run.blocked_other)
            for start, dt, u, w in zip(starts, durations, used, waiting):
                step_truth = PoolTruth(truth.capacity_tokens, u, truth.evictable_tokens, truth.running, w)
                self._log(plan, start, dt, n, False, step_truth, batch=n)
        return True

    def _observe_first(self, r: SimRequest) -> None:
        """Histograms as the engines observe them: queue time once, at a request's first
        forward; TTFT once, at its first token. Both can only happen in a prefill chunk."""
        state = self.metrics.state
        if r in self._unscheduled:
            self._unscheduled.discard(r)
            assert r.first_scheduled is not None, "a request in a prefill chunk has been scheduled"
            state.queue_time.observe(r.first_scheduled - r.arrival)
        if r.first_token is not None and r in self._no_token:
            self._no_token.discard(r)
            state.ttft.observe(r.first_token - r.arrival)

    def _log(
        self, plan: StepPlan, start: float, dt: float, new_tokens: int, prefill: bool, truth: PoolTruth, batch: int | None = None
    ) -> None:
        s = self.steps
        cap = truth.capacity_tokens or 1
        s.start.append(start)
        s.duration.append(dt)
        s.prefill.append(prefill)
        s.batch.append(len(plan.chunks) + plan.decode_batch if batch is None else batch)
        s.new_tokens.append(new_tokens)
        s.blocked_on_kv.append(plan.blocked_on_kv)
        s.blocked_other.append(plan.blocked_other)
        s.evicted.append(len(plan.evicted))
        s.running.append(truth.running)
        s.waiting.append(truth.waiting)
        s.usage.append(truth.used_tokens / cap)
        s.evictable.append(truth.evictable_tokens / cap)
        s.loaded_tokens.append(plan.loaded_tokens)
        s.stored_tokens.append(plan.stored_tokens)
