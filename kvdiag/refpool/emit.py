"""Metric emission in each engine's own exposition, per release dialect.

The reference pool, the tests and the demo all need engine expositions that kvdiag has to
read exactly as it reads a real engine's: the same names, label sets, bucket bounds, HELP/TYPE
layout and number formatting that each release's prometheus_client code produces
(shared/facts/engine-metrics.md). ``EngineState`` holds the numbers of one engine instance;
``render`` writes a whole server (several data-parallel instances, optionally every TP rank)
in the chosen dialect and wire format.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.utils import floatToGoString

# Histogram bounds, as facts (engine-metrics.md §1.4, §2.6).
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
SGLANG_QUEUE_BUCKETS = (
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 70.0, 80.0, 90.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0,
    1400.0, 1600.0, 1800.0, 2000.0, 2500.0, 3000.0,
)  # fmt: skip
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_V0_TTFT_BUCKETS = VLLM_TTFT_BUCKETS[:16]  # V0 0.6/0.7 stopped at 10 s
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_V0_LATENCY_BUCKETS = VLLM_LATENCY_BUCKETS[:15]  # V0 0.6/0.7 stopped at 60 s

#: Inter-token latency: vLLM's ``inter_token_latency`` family (buckets.py@0.33.0) and SGLang's
#: ``bucket_inter_token_latency`` (metrics_collector.py@0.5.23, 23 bounds).
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6,
    0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip

#: SGLang's token-length buckets (metrics_collector.py@0.5.23 ``default_bucket_prompt_tokens``),
#: used by its prompt, uncached-prompt and generation histograms alike.
SGLANG_LENGTH_BUCKETS = (
    100.0, 300.0, 500.0, 700.0, 1000.0, 1500.0, 2000.0, 3000.0, 4000.0, 5000.0, 6000.0, 7000.0, 8000.0, 9000.0,
    10000.0, 12500.0, 15000.0, 17500.0, 20000.0, 22500.0, 25000.0, 27500.0, 30000.0, 35000.0, 40000.0, 60000.0,
    80000.0, 100000.0, 200000.0, 300000.0, 400000.0, 600000.0, 800000.0, 1000000.0, 1100000.0,
)  # fmt: skip


#: The served context of an ``EngineState`` that names none: the reference vLLM scheduler's
#: default (a module constant, not read off the dataclass: a compiled one has no class default).
DEFAULT_MAX_MODEL_LEN = 32768


def vllm_length_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's ``request_tokens`` family: the 1-2-5 series up to ``max_model_len``
    (buckets.py ``build_1_2_5_buckets``@0.33.0), so its bounds move with the model's length."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


_ALL_BOUNDS = tuple(
    sorted(set(SGLANG_TTFT_BUCKETS + SGLANG_QUEUE_BUCKETS + VLLM_TTFT_BUCKETS + VLLM_LATENCY_BUCKETS))
)
#: Every bound an inter-token latency histogram can have.
_ITL_BOUNDS = tuple(sorted(set(VLLM_ITL_BUCKETS + SGLANG_ITL_BUCKETS)))
#: Every bound a length histogram can have: SGLang's list and vLLM's series for any model length.
_LENGTH_BOUNDS = tuple(sorted(set(SGLANG_LENGTH_BUCKETS + vllm_length_buckets(10**9))))

#: Dialects each engine can be rendered in, newest first.
SGLANG_DIALECTS = ("0.5.23", "0.5.9", "0.5.3", "0.4.10")
VLLM_DIALECTS = ("0.33.0", "0.10", "0.8", "0.6")


@dataclass
class Binned:
    """Observations binned on the union of every engine's bounds for one quantity (``union``:
    latencies by default, ``_LENGTH_BOUNDS`` for token lengths), so a cumulative count at any
    engine bound is exact whichever dialect renders it."""

    union: tuple[float, ...] = _ALL_BOUNDS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.union) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.union, v)] += 1
        self.total += v
        self.n += 1

    def observe_n(self, v: float, n: int) -> None:
        """``n`` observations of the same value (one decode step's inter-token latency for each
        of its ``n`` decoding requests)."""
        self.counts[bisect.bisect_left(self.union, v)] += n
        self.total += v * n
        self.n += n

    def add(self, other: Binned) -> None:
        """Fold in another instance's observations of the same quantity (a server's total)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.n += other.n

    def cumulative(self, bounds: tuple[float, ...]) -> list[int]:
        """Cumulative counts at each of ``bounds`` (all in the union) and at +Inf."""
        out, acc, i = [], 0, 0
        for b in bounds:
            j = self.union.index(b) + 1
            acc += sum(self.counts[i:j])
            i = j
            out.append(acc)
        out.append(self.n)
        return out


def _lengths() -> Binned:
    return Binned(_LENGTH_BOUNDS)


def _itl() -> Binned:
    return Binned(_ITL_BOUNDS)


@dataclass
class EngineState:
    """What one engine instance would export. Counters are cumulative since its start."""

    capacity_tokens: int
    used_tokens: int = 0  # held by requests (locked prompt + private decode tokens)
    evictable_tokens: int = 0  # cached, unreferenced
    running: int = 0
    waiting: int = 0
    evictions_total: int = 0  # retractions / preemptions
    last_eviction_event: int = 0
    prefix_hit_tokens_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_total: int = 0
    l2_capacity_tokens: int | None = None  # None: no L2 tier configured
    l2_used_tokens: int = 0
    l2_hit_tokens_total: int = 0
    # SGLang's prefill token counters, bumped when a prefill batch is formed (all over one span,
    # so input and hits never disagree): effective input (recomputes excluded), and the
    # realtime computed / cached split (recomputes included).
    prefill_input_tokens_total: int = 0
    prefill_compute_tokens_total: int = 0
    prefill_cache_tokens_total: int = 0
    new_token_ratio: float = 0.7
    block_size: int = 16
    # Tokens thrown away by retractions (SGLang >= 0.5.7 counts them apart).
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0
    # Prefill/decode disaggregation (refpool/deployments.py). SGLang's role is its engine_type
    # label; its PD queue gauges are exported as 0 by a unified instance. vLLM's ``waiting``
    # includes ``deferred`` (num_requests_waiting = capacity + deferred).
    role: str = "unified"  # "unified" | "prefill" | "decode"
    bootstrap_queue: int = 0  # prefill: waiting for the decode instance's preallocation
    inflight_queue: int = 0  # prefill: KV computed, being sent
    prealloc_queue: int = 0  # decode: waiting for room in the decode pool
    transfer_queue: int = 0  # decode: preallocated, KV not yet arrived
    prealloc_tokens: int = 0  # decode: slots preallocated for the transfer queue
    deferred: int = 0  # vLLM: waiting on their KV transfer (reason="deferred")
    kv_consumer: bool = False  # vLLM: the KV connector receives KV (num_requests_kv_fetch_by_stage)
    kv_fetch_waiting: int = 0  # stage="waiting_to_start"
    kv_fetch_in_progress: int = 0  # stage="in_progress"
    # Hybrid sliding-window model (SGLang): the SWA pool beside the full one; None: not hybrid.
    swa_capacity_tokens: int | None = None
    swa_used_tokens: int = 0
    swa_evictable_tokens: int = 0
    # SGLang's radix-cache collector (facts §2.5): device slots freed by eviction, HiCache
    # load-back (L2 -> L1) and backup (L1 -> L2) tokens, tokens dropped without a backup; bytes
    # are these tokens' KV on one rank (None: unknown, the byte counters are not written).
    # vLLM's CPU offloading loads / stores fill the same two token counts.
    evicted_tokens_total: int = 0
    load_back_tokens_total: int = 0
    backup_tokens_total: int = 0
    dropped_tokens_total: int = 0
    kv_bytes_per_token_per_rank: int | None = None
    # KV connector lookups (vLLM external_prefix_cache_*): tokens asked of it, tokens it had.
    external_query_tokens_total: int = 0
    external_hit_tokens_total: int = 0
    ttft: Binned = field(default_factory=Binned)
    queue_time: Binned = field(default_factory=Binned)
    # Time between a request's consecutive output tokens, once per token after its first (both
    # engines' inter_token_latency_seconds): the decode step time as the requests saw it.
    itl: Binned = field(default_factory=_itl)
    # Tokens per finished request, observed when it finishes (vLLM's request_prompt_tokens /
    # request_generation_tokens, SGLang's prompt / uncached prompt / generation histograms).
    prompt_lengths: Binned = field(default_factory=_lengths)
    uncached_prompt_lengths: Binned = field(default_factory=_lengths)
    output_lengths: Binned = field(default_factory=_lengths)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # vLLM's length buckets run up to it
    created: float = 1_795_952_340.0  # process start, for _created series

    def observe_finished(self, prompt: int, output: int, cached: int) -> None:
        """A request finished with ``prompt`` tokens (``cached`` of them prefix hits) and
        ``output`` generated: the length histograms observe it, as both engines do at finish."""
        self.prompt_lengths.observe(prompt)
        self.uncached_prompt_lengths.observe(prompt - cached)
        self.output_lengths.observe(output)

    @property
    def available_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens - self.evictable_tokens

    @property
    def usage(self) -> float:
        return self.used_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def swa_usage(self) -> float:
        return self.swa_used_tokens / self.swa_capacity_tokens if self.swa_capacity_tokens else 0.0

    @property
    def swa_available_tokens(self) -> int:
        return (self.swa_capacity_tokens or 0) - self.swa_used_tokens - self.swa_evictable_tokens


class _Writer:
    """Writes families the way prometheus_client's generators do, in 0.0.4 or OpenMetrics."""

    def __init__(self, openmetrics: bool, escape: bool, created: bool) -> None:
        self.openmetrics = openmetrics
        self.escape = escape and openmetrics
        self.created = created
        self.lines: list[str] = []

    def _name(self, name: str) -> str:
        return name.replace(":", "_") if self.escape else name

    def _sample(self, name: str, labels: dict[str, str], value: float) -> None:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        self.lines.append(f"{self._name(name)}{{{inner}}} {floatToGoString(value)}" if inner else f"{self._name(name)} {floatToGoString(value)}")

    def _head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, help_text: str, series: list[tuple[dict[str, str], float]]) -> None:
        if not series:
            return
        self._head(name, "gauge", help_text)
        for labels, v in series:
            self._sample(name, labels, v)

    def counter(self, name: str, help_text: str, series: list[tuple[dict[str, str], float, float]]) -> None:
        """``name`` without ``_total``; series are (labels, value, created)."""
        if not series:
            return
        self._head(name if self.openmetrics else name + "_total", "counter", help_text)
        for labels, v, _ in series:
            self._sample(name + "_total", labels, v)
        if self.created:
            if not self.openmetrics:
                self._head(name + "_created", "gauge", help_text)
            for labels, _, created in series:
                self._sample(name + "_created", labels, created)

    def histogram(self, name: str, help_text: str, bounds: tuple[float, ...], series: list[tuple[dict[str, str], Binned, float]]) -> None:
        if not series:
            return
        self._head(name, "histogram", help_text)
        for labels, lat, _ in series:
            for b, c in zip(bounds + (math.inf,), lat.cumulative(bounds)):
                self._sample(name + "_bucket", {**labels, "le": floatToGoString(b)}, c)
            self._sample(name + "_count", labels, lat.n)
            self._sample(name + "_sum", labels, lat.total)
        if self.created:
            if not self.openmetrics:
                self._head(name + "_created", "gauge", help_text)
            for labels, _, created in series:
                self._sample(name + "_created", labels, created)

    def text(self) -> str:
        if self.openmetrics:
            self.lines.append("# EOF")
        return "\n".join(self.lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def content_type(openmetrics: bool) -> str:
    if openmetrics:
        return "application/openmetrics-text; version=1.0.0; charset=utf-8"
    return "text/plain; version=0.0.4; charset=utf-8"


def render(
    engine: str,
    states: list[EngineState],
    dialect: str | None = None,
    openmetrics: bool = False,
    escape: bool = False,
    tp: int = 1,
    model: str = "meta-llama/Llama-3.1-8B-Instruct",
    multiprocess: bool | None = None,
    lmcache: list[LMCacheState] | None = None,
) -> str:
    """One server's exposition: ``states`` are its data-parallel instances.

    ``tp`` > 1 repeats SGLang's scheduler series per TP rank (as with
    ``--enable-metrics-for-all-schedulers``). ``escape`` writes OpenMetrics sample names
    underscore-escaped, as prometheus_client >= 0.23 does for a Prometheus 2.x scraper.
    ``lmcache`` adds LMCache's families to a multiprocess vLLM body, as when the user points
    vLLM's and LMCache's PROMETHEUS_MULTIPROC_DIR at one directory (facts §1.7).
    """
    if engine == "sglang":
        return _sglang(states, dialect or SGLANG_DIALECTS[0], openmetrics, escape, tp, model)
    if engine == "vllm":
        mp = len(states) > 1 or lmcache is not None if multiprocess is None else multiprocess
        if lmcache is not None and not mp:
            raise ValueError("LMCache's series reach vLLM's /metrics only through a shared multiprocess directory")
        return _vllm(states, dialect or VLLM_DIALECTS[0], openmetrics, escape, model, mp, lmcache)
    raise ValueError(f"unknown engine {engine!r}")


def _version(dialect: str) -> tuple[int, ...]:
    return tuple(int(x) for x in dialect.split("."))


def _sglang(states: list[EngineState], dialect: str, om: bool, escape: bool, tp: int, model: str) -> str:
    if dialect not in SGLANG_DIALECTS:
        raise ValueError(f"unknown SGLang dialect {dialect!r}; known: {SGLANG_DIALECTS}")
    v = _version(dialect)
    w = _Writer(om, escape, created=False)  # SGLang always serves a multiprocess registry
    dp = len(states) > 1
    streaming = v >= (0, 5, 20)

    def sched(i: int, rank: int) -> dict[str, str]:
        # engine_type says the PD role since 0.5.8 (unified before; facts §2.2).
        role = states[i].role if v >= (0, 5, 8) else "unified"
        labels = {"engine_type": role, "model_name": model}
        if v >= (0, 4, 10):
            labels.update(tp_rank=str(rank), pp_rank="0")
        if v >= (0, 5, 8):
            labels["moe_ep_rank"] = "0"
        if dp:
            labels["dp_rank"] = str(i)
        return labels

    def per_rank(fn) -> list[tuple[dict[str, str], float]]:
        return [(sched(i, r), fn(s)) for i, s in enumerate(states) for r in range(tp)]

    def by_mode(modes) -> list[tuple[dict[str, str], float, float]]:
        """A counter split by ``mode`` on every rank: ``modes(state)`` gives (mode, value) pairs."""
        return [({**sched(i, r), "mode": m}, val, s.created) for i, s in enumerate(states) for r in range(tp) for m, val in modes(s)]

    P = "sglang:"
    if v >= (0, 5, 6):
        w.gauge(P + "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", per_rank(lambda s: s.capacity_tokens))
    w.gauge(P + "num_running_reqs", "The number of running requests.", per_rank(lambda s: s.running))
    w.gauge(P + "num_queue_reqs", "The number of requests in the waiting queue.", per_rank(lambda s: s.waiting))
    # token_usage = round(max of the pools' usages, 2); num_used_tokens = max(full, swa) used
    # (pool_stats_observer.update_scheduler_stats@0.5.23): the SWA pool can be the full one.
    w.gauge(P + "token_usage", "The token usage.", per_rank(lambda s: round(max(s.usage, s.swa_usage), 2)))
    if v >= (0, 5, 10):
        w.gauge(P + "full_token_usage", "The token usage for full attention layers.", per_rank(lambda s: s.usage))
    if v >= (0, 5, 2):
        w.gauge(P + "swa_token_usage", "The token usage for SWA layers.", per_rank(lambda s: s.swa_usage))
    if v >= (0, 5, 5):
        w.gauge(P + "mamba_usage", "The token usage for Mamba layers.", per_rank(lambda s: 0.0))
    w.gauge(P + "num_used_tokens", "The number of used tokens.", per_rank(lambda s: max(s.used_tokens, s.swa_used_tokens)))
    if v >= (0, 5, 11):
        w.gauge(P + "kv_available_tokens", "Number of free token slots in the KV cache pool.", per_rank(lambda s: s.available_tokens))
        w.gauge(P + "kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool.", per_rank(lambda s: s.evictable_tokens))
        w.gauge(P + "kv_used_tokens", "Number of actively used token slots in the KV cache pool.", per_rank(lambda s: s.used_tokens))
        # The SchedulerStats defaults: 0 unless the model is hybrid (facts §2.3).
        w.gauge(P + "swa_available_tokens", "Number of free token slots in the SWA KV cache pool.", per_rank(lambda s: max(s.swa_available_tokens, 0)))
        w.gauge(P + "swa_evictable_tokens", "Number of evictable token slots in the SWA KV cache pool.", per_rank(lambda s: s.swa_evictable_tokens))
        w.gauge(P + "swa_used_tokens", "Number of actively used token slots in the SWA KV cache pool.", per_rank(lambda s: s.swa_used_tokens))
        w.gauge(
            P + "max_total_num_tokens_swa",
            "Maximum total number of tokens in the SWA KV cache pool.",
            [(sched(i, r), s.swa_capacity_tokens) for i, s in enumerate(states) for r in range(tp) if s.swa_capacity_tokens is not None],
        )
    if v >= (0, 5, 3):
        _sglang_pd_queues(w, states, v, tp, sched)
    w.gauge(P + "new_token_ratio", "The new token ratio.", per_rank(lambda s: s.new_token_ratio))
    if (0, 4, 10) <= v < (0, 5, 3):
        w.gauge(P + "total_retracted_reqs", "The total number of retracted requests.", per_rank(lambda s: s.evictions_total))
    if v >= (0, 5, 2):
        w.gauge(
            P + "num_retracted_reqs",
            "The number of retracted requests.",
            [({**sched(i, r), "pid": str(16321 + i * tp + r)}, s.last_eviction_event) for i, s in enumerate(states) for r in range(tp)],
        )
    if v >= (0, 5, 7):
        # The multiprocess registry has no series for a counter never incremented.
        w.counter(
            P + "num_retracted_requests",
            "Total number of retracted requests.",
            [(sched(i, r), s.evictions_total, s.created) for i, s in enumerate(states) for r in range(tp) if s.evictions_total > 0],
        )
        for name, help_text, fn in (
            ("num_retracted_input_tokens", "Total number of retracted input tokens.", lambda s: s.retracted_input_tokens_total),
            ("num_retracted_output_tokens", "Total number of retracted output tokens.", lambda s: s.retracted_output_tokens_total),
        ):
            w.counter(P + name, help_text, [(sched(i, r), fn(s), s.created) for i, s in enumerate(states) for r in range(tp) if s.evictions_total > 0])
        w.counter(
            P + "realtime_tokens",
            "Total number of tokens processed (updated on each log interval). mode: prefill_compute, prefill_cache, decode.",
            by_mode(lambda s: (
                ("prefill_compute", s.prefill_compute_tokens_total),
                ("prefill_cache", s.prefill_cache_tokens_total),
                ("decode", s.generation_tokens_total),
            )),
        )
    if v >= (0, 5, 20):
        w.counter(
            P + "prefill_effective_tokens",
            "Effective prefill tokens with retracted-request re-counts excluded, updated on each log interval.",
            by_mode(lambda s: (
                ("input", s.prefill_input_tokens_total),
                ("device_hit", s.prefix_hit_tokens_total),
                ("host_hit", s.l2_hit_tokens_total),
                ("storage_hit", 0),
            )),
        )
    if v >= (0, 5, 10):
        for name, help_text, fn in (
            ("hicache_host_used_tokens", "Host KV cache used tokens.", lambda s: s.l2_used_tokens),
            ("hicache_host_total_tokens", "Host KV cache total tokens.", lambda s: s.l2_capacity_tokens),
        ):
            w.gauge(P + name, help_text, [(sched(i, r), fn(s)) for i, s in enumerate(states) for r in range(tp) if s.l2_capacity_tokens is not None])
    if v >= (0, 5, 3):
        w.histogram(
            P + "queue_time_seconds",
            "Histogram of queueing time in seconds.",
            SGLANG_QUEUE_BUCKETS,
            [(sched(i, r), s.queue_time, s.created) for i, s in enumerate(states) for r in range(tp)],
        )
    if v >= (0, 5, 6):
        _sglang_radix(w, states, v, tp)
    _sglang_tokenizer(w, states, v, model, streaming)
    return w.text()


#: The radix collector's ``cache_type``: SGLang 0.5.23 builds ``UnifiedRadixCache`` unless told
#: otherwise (mem_cache/registry.py).
SGLANG_CACHE_TYPE = "UnifiedRadixCache"


def _sglang_radix(w: _Writer, states: list[EngineState], v: tuple[int, ...], tp: int) -> None:
    """The radix-cache collector (metrics_collector.py@0.5.23): labels ``cache_type, tp_rank,
    pp_rank, dp_rank`` and no model_name; every replica reports ``dp_rank="0"`` (so DP engines
    add up under one label set, as Prometheus sees them); a counter appears at its first
    increment. Load-back and backup tokens carry ``pool`` ("kv": the main pool), drops also a
    ``reason``; these and the byte counters are written for 0.5.23, the release the facts read."""
    P = "sglang:"
    total = _sum_states(states)

    def series(fn, extra: dict[str, str] | None = None) -> list[tuple[dict[str, str], float, float]]:
        value = fn(total)
        if not value:
            return []
        return [({"cache_type": SGLANG_CACHE_TYPE, "dp_rank": "0", "pp_rank": "0", "tp_rank": str(r), **(extra or {})}, value, total.created)
                for r in range(tp)]  # fmt: skip

    w.counter(P + "evicted_tokens", "The number of device KV token slots freed by eviction.", series(lambda s: s.evicted_tokens_total))
    if v < (0, 5, 23):
        return
    w.counter(P + "load_back_tokens", "The number of tokens loaded back from local host DRAM (L2) to GPU, by host pool.",
              series(lambda s: s.load_back_tokens_total, {"pool": "kv"}))
    w.counter(P + "hicache_backup_tokens", "The number of tokens backed up from GPU to local host DRAM (L2), by host pool.",
              series(lambda s: s.backup_tokens_total, {"pool": "kv"}))
    w.counter(P + "hicache_dropped_tokens", "The number of logical device KV tokens destroyed without a host backup.",
              series(lambda s: s.dropped_tokens_total, {"pool": "kv", "reason": "host_pressure"}))
    if total.kv_bytes_per_token_per_rank is not None:
        per = total.kv_bytes_per_token_per_rank
        w.counter(P + "load_back_bytes", "Bytes loaded back from local host DRAM (L2) to GPU, all pools combined.",
                  series(lambda s: s.load_back_tokens_total * per))
        w.counter(P + "hicache_backup_bytes", "Bytes backed up from GPU to local host DRAM (L2), all pools combined.",
                  series(lambda s: s.backup_tokens_total * per))


def _sglang_pd_queues(
    w: _Writer, states: list[EngineState], v: tuple[int, ...], tp: int, sched: Callable[[int, int], dict[str, str]]
) -> None:
    """The PD disaggregation gauges, exported as 0 by a unified instance (facts §2.3). The
    prefill bootstrap queue was ``num_prefill_prealloc_queue_reqs`` up to 0.5.11; the rest of
    the family is written only for 0.5.23, the release the facts list it for."""
    P = "sglang:"

    def g(name: str, help_text: str, fn) -> None:
        w.gauge(P + name, help_text, [(sched(i, r), fn(s)) for i, s in enumerate(states) for r in range(tp)])

    bootstrap = "num_prefill_bootstrap_queue_reqs" if v >= (0, 5, 12) else "num_prefill_prealloc_queue_reqs"
    g(bootstrap, "The number of requests in the prefill bootstrap queue.", lambda s: s.bootstrap_queue)
    g("num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.", lambda s: s.inflight_queue)
    g("num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.", lambda s: s.prealloc_queue)
    g("num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.", lambda s: s.transfer_queue)
    if v >= (0, 5, 23):
        g("num_decode_host_receive_queue_reqs", "The number of requests in the decode host receive queue.", lambda s: 0)
        g("num_decode_deferred_kv_release_reqs", "The number of requests with a deferred KV release.", lambda s: 0)
        # Tokens preallocated for requests whose KV has not arrived, over each pool's capacity
        # (metrics_reporter._update_decode_queue_stats@0.5.23).
        g("prealloc_full_token_usage", "The full-pool token usage of preallocated requests.",
          lambda s: s.prealloc_tokens / s.capacity_tokens if s.capacity_tokens else 0.0)
        g("prealloc_swa_token_usage", "The SWA-pool token usage of preallocated requests.",
          lambda s: s.prealloc_tokens / s.swa_capacity_tokens if s.swa_capacity_tokens else 0.0)


def _sglang_tokenizer(w: _Writer, states: list[EngineState], v: tuple[int, ...], model: str, streaming: bool) -> None:
    """Tokenizer-process series: one per server (no dp_rank), summed over its DP engines."""
    P = "sglang:"
    base = {"model_name": model}
    if v >= (0, 4, 10):
        base["engine_type"] = states[0].role if v >= (0, 5, 8) else "unified"
    total = _sum_states(states)
    # Streaming splits requests in two partitions; put them all under "true" and an empty "false".
    parts = [({**base, "is_streaming": "true"}, 1.0), ({**base, "is_streaming": "false"}, 0.0)] if streaming else [(base, 1.0)]

    def series(fn) -> list[tuple[dict[str, str], float, float]]:
        return [(labels, fn(total) * share, total.created) for labels, share in parts]

    w.histogram(
        P + "time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        SGLANG_TTFT_BUCKETS,
        [(labels, total.ttft if share else Binned(), total.created) for labels, share in parts],
    )
    w.histogram(P + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", SGLANG_ITL_BUCKETS,
                [(base, total.itl, total.created)])  # fmt: skip
    w.counter(P + "prompt_tokens", "Number of prefill tokens processed.", series(lambda s: s.prompt_tokens_total))
    w.counter(P + "generation_tokens", "Number of generation tokens processed.", series(lambda s: s.generation_tokens_total))
    if v >= (0, 5, 23) and total.prompt_lengths.n:
        # Written for 0.5.23, the release the facts read; the multiprocess registry has no series
        # before the first finished request. Labels: the collector's own, no is_streaming.
        for name, help_text, lengths in (
            ("prompt_tokens_histogram", "Histogram of prompt token length.", total.prompt_lengths),
            ("uncached_prompt_tokens_histogram", "Histogram of uncached (compute) prompt token length.", total.uncached_prompt_lengths),
            ("generation_tokens_histogram", "Histogram of generation token length.", total.output_lengths),
        ):
            w.histogram(P + name, help_text, SGLANG_LENGTH_BUCKETS, [(base, lengths, total.created)])
    cached: list[tuple[dict[str, str], float, float]]
    if v >= (0, 5, 10):
        cached = [({**base, "cache_source": "device"}, total.prefix_hit_tokens_total, total.created)]
        if total.l2_capacity_tokens is not None:
            cached.append(({**base, "cache_source": "host"}, total.l2_hit_tokens_total, total.created))
    else:
        cached = [(base, total.prefix_hit_tokens_total, total.created)]
    w.counter(P + "cached_tokens", "Number of cached prompt tokens by source (device/host/storage).", cached)
    w.counter(P + "num_requests", "Number of requests processed.", series(lambda s: s.requests_total))


#: EngineState's histograms, which a server's tokenizer process sees summed over its engines.
BINNED_FIELDS = ("ttft", "queue_time", "itl", "prompt_lengths", "uncached_prompt_lengths", "output_lengths")


def _sum_states(states: list[EngineState]) -> EngineState:
    """Server-wide totals of the counters and latencies (what the tokenizer process sees)."""
    out = EngineState(capacity_tokens=sum(s.capacity_tokens for s in states), created=states[0].created)
    for s in states:
        out.prefix_hit_tokens_total += s.prefix_hit_tokens_total
        out.prompt_tokens_total += s.prompt_tokens_total
        out.generation_tokens_total += s.generation_tokens_total
        out.requests_total += s.requests_total
        out.l2_hit_tokens_total += s.l2_hit_tokens_total
        out.evicted_tokens_total += s.evicted_tokens_total
        out.load_back_tokens_total += s.load_back_tokens_total
        out.backup_tokens_total += s.backup_tokens_total
        out.dropped_tokens_total += s.dropped_tokens_total
        out.kv_bytes_per_token_per_rank = s.kv_bytes_per_token_per_rank
        if s.l2_capacity_tokens is not None:
            out.l2_capacity_tokens = (out.l2_capacity_tokens or 0) + s.l2_capacity_tokens
        for name in BINNED_FIELDS:
            getattr(out, name).add(getattr(s, name))
    return out


def _vllm(
    states: list[EngineState], dialect: str, om: bool, escape: bool, model: str, multiprocess: bool,
    lmcache: list[LMCacheState] | None = None,
) -> str:
    if dialect not in VLLM_DIALECTS:
        raise ValueError(f"unknown vLLM dialect {dialect!r}; known: {VLLM_DIALECTS}")
    v = _version(dialect)
    v0 = v < (0, 8)
    if v0 and len(states) > 1:
        raise ValueError("vLLM V0 metrics carry no engine label: one instance per server")
    w = _Writer(om, escape, created=not multiprocess)
    P = "vllm:"

    def labels(i: int) -> dict[str, str]:
        return {"model_name": model} if v0 else {"engine": str(i), "model_name": model}

    def gauge(fn, extra: dict[str, str] | None = None) -> list[tuple[dict[str, str], float]]:
        return [({**labels(i), **(extra or {})}, fn(s)) for i, s in enumerate(states)]

    def counter(fn) -> list[tuple[dict[str, str], float, float]]:
        return [(labels(i), fn(s), s.created) for i, s in enumerate(states)]

    # The pool as vLLM sees it: blocks; evictable cached blocks are free.
    def usage(s: EngineState) -> float:
        blocks = s.capacity_tokens // s.block_size
        used = math.ceil(s.used_tokens / s.block_size)
        return used / blocks if blocks else 0.0

    pid = {"pid": "4242"} if multiprocess and (0, 9, 2) <= v < (0, 12) else None
    w.gauge(P + "num_requests_running", "Number of requests in model execution batches.", gauge(lambda s: s.running))
    w.gauge(P + "num_requests_waiting", "Number of requests waiting to be processed.", gauge(lambda s: s.waiting))
    if v >= (0, 20):
        w.gauge(
            P + "num_requests_waiting_by_reason",
            "Number of requests waiting, by reason: capacity (waiting for scheduling capacity) or deferred (LoRA budget, KV transfer, blocked).",
            [({**labels(i), "reason": r}, n) for i, s in enumerate(states) for r, n in (("capacity", s.waiting - s.deferred), ("deferred", s.deferred))],
        )
    if v >= (0, 33) and any(s.kv_consumer for s in states):
        w.gauge(
            P + "num_requests_kv_fetch_by_stage",
            "Number of requests fetching KV from a remote instance, by stage.",
            [({**labels(i), "stage": st}, n) for i, s in enumerate(states) if s.kv_consumer
             for st, n in (("waiting_to_start", s.kv_fetch_waiting), ("in_progress", s.kv_fetch_in_progress), ("completed_waiting", 0))],
        )
    if v >= (0, 9, 2):
        w.gauge(P + "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", gauge(usage, pid))
    if v < (0, 11):
        w.gauge(P + "gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", gauge(usage, pid))
    if v0:
        w.gauge(P + "num_requests_swapped", "Number of requests swapped to CPU.", gauge(lambda s: 0))
        w.gauge(
            P + "gpu_prefix_cache_hit_rate",
            "GPU prefix cache block hit rate.",
            gauge(lambda s: s.prefix_hit_tokens_total / s.prompt_tokens_total if s.prompt_tokens_total else 0.0),
        )
    else:
        if v >= (0, 9, 2):
            w.counter(P + "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", counter(lambda s: s.prompt_tokens_total))
            w.counter(P + "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", counter(lambda s: s.prefix_hit_tokens_total))
        if v < (0, 12):
            # 0.8.x counted these in blocks.
            div = (lambda s: s.block_size) if v < (0, 9) else (lambda s: 1)
            w.counter(P + "gpu_prefix_cache_queries", "GPU prefix cache queries.", counter(lambda s: s.prompt_tokens_total // div(s)))
            w.counter(P + "gpu_prefix_cache_hits", "GPU prefix cache hits.", counter(lambda s: s.prefix_hit_tokens_total // div(s)))
    if v >= (0, 11, 1):
        w.counter(P + "external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", counter(lambda s: s.external_query_tokens_total))
        w.counter(P + "external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", counter(lambda s: s.external_hit_tokens_total))
    if v >= (0, 33) and any(s.l2_capacity_tokens is not None and s.kv_bytes_per_token_per_rank for s in states):
        # the OffloadingConnector's own counters (offloading/metrics.py): bytes = tokens x KV per rank
        w.counter(P + "kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.",
                  counter(lambda s: s.load_back_tokens_total * (s.kv_bytes_per_token_per_rank or 0)))
        w.counter(P + "kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.",
                  counter(lambda s: s.backup_tokens_total * (s.kv_bytes_per_token_per_rank or 0)))
    w.counter(P + "num_preemptions", "Cumulative number of preemption from the engine.", counter(lambda s: s.evictions_total))
    w.counter(P + "prompt_tokens", "Number of prefill tokens processed.", counter(lambda s: s.prompt_tokens_total))
    w.counter(P + "generation_tokens", "Number of generation tokens processed.", counter(lambda s: s.generation_tokens_total))
    if v >= (0, 33):
        w.counter(
            P + "prompt_tokens_cached_by_source",
            "Number of cached prompt tokens, by cache tier.",
            [({**labels(i), "source": src}, val, s.created) for i, s in enumerate(states) for src, val in (("device", s.prefix_hit_tokens_total), ("host", s.l2_hit_tokens_total))],
        )
    w.counter(
        P + "request_success",
        "Count of successfully processed requests.",
        [({**labels(i), "finished_reason": r}, s.requests_total if r == "stop" else 0, s.created) for i, s in enumerate(states) for r in ("stop", "length")],
    )
    if v >= (0, 33):
        # Registered per engine at start (written for 0.33.0, the release the facts read).
        lengths = vllm_length_buckets(states[0].max_model_len)
        w.histogram(P + "request_prompt_tokens", "Number of prefill tokens processed.", lengths,
                    [(labels(i), s.prompt_lengths, s.created) for i, s in enumerate(states)])
        w.histogram(P + "request_generation_tokens", "Number of generation tokens processed.", lengths,
                    [(labels(i), s.output_lengths, s.created) for i, s in enumerate(states)])
    ttft_bounds = VLLM_V0_TTFT_BUCKETS if v0 else VLLM_TTFT_BUCKETS
    lat_bounds = VLLM_V0_LATENCY_BUCKETS if v0 else VLLM_LATENCY_BUCKETS
    w.histogram(P + "time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft_bounds, [(labels(i), s.ttft, s.created) for i, s in enumerate(states)])
    if v >= (0, 10):
        w.histogram(P + "inter_token_latency_seconds", "Histogram of inter-token latency.", VLLM_ITL_BUCKETS,
                    [(labels(i), s.itl, s.created) for i, s in enumerate(states)])  # fmt: skip
    queue_name = P + ("time_in_queue_requests" if v0 else "request_queue_time_seconds")
    w.histogram(queue_name, "Histogram of time spent in WAITING phase for request.", lat_bounds, [(labels(i), s.queue_time, s.created) for i, s in enumerate(states)])
    total_blocks = sum(s.capacity_tokens // s.block_size + 1 for s in states)  # + the null block each
    infos = []
    for i, s in enumerate(states):
        info = {"block_size": str(s.block_size), "num_gpu_blocks": str(total_blocks), "cache_dtype": "auto", "enable_prefix_caching": "True"}
        if not v0:
            info["engine"] = str(i)
        if v >= (0, 25):
            info["kv_cache_size_tokens"] = str(s.capacity_tokens)
        infos.append((info, 1.0))
    w.gauge(P + "cache_config_info", "Information of the LLMEngine CacheConfig", infos)
    if lmcache is not None:
        _lmcache_families(w, lmcache, model, model)
    return w.text()


@dataclass
class LMCacheState:
    """What LMCache's own exporter shows for one vLLM worker (lmcache/observability.py@0.5.6):
    token counters since start, the hit-rate gauges of the last log interval, and the bytes
    its local CPU tier holds."""

    lookup_tokens_total: int = 0  # tokens asked in lookups (all of a request's tokens, once per scheduling)
    lookup_hits_total: int = 0  # of those, the leading tokens the tier holds
    requested_tokens_total: int = 0  # tokens asked of retrieve (the lookup hits scheduled for load)
    hit_tokens_total: int = 0  # tokens retrieved
    stored_tokens_total: int = 0
    vllm_hit_tokens_total: int = 0  # vLLM's own (GPU) prefix hits
    prompt_tokens_total: int = 0
    local_cache_usage_bytes: int = 0
    retrieve_hit_rate: float = 0.0
    lookup_hit_rate: float = 0.0


LMCACHE_ROLE = "worker"


def render_lmcache(workers: list[LMCacheState], model: str, served_model: str, openmetrics: bool = False) -> str:
    """LMCache's /metrics: its PrometheusLogger families for each worker (``worker_id`` = TP
    rank), labels ``model_name, worker_id, role, served_model_name``. LMCache writes to a
    multiprocess directory, so no ``_created`` series; its gauges use livemostrecent / sum, so
    no ``pid`` label."""
    w = _Writer(openmetrics, escape=False, created=False)
    _lmcache_families(w, workers, model, served_model)
    return w.text()


def _lmcache_families(w: _Writer, workers: list[LMCacheState], model: str, served_model: str) -> None:
    P = "lmcache:"

    def labels(i: int) -> dict[str, str]:
        return {"model_name": model, "role": LMCACHE_ROLE, "served_model_name": served_model, "worker_id": str(i)}

    for name, help_text, fn in (
        ("num_requested_tokens", "Total number of tokens requested from lmcache", lambda s: s.requested_tokens_total),
        ("num_hit_tokens", "Total number of tokens hit in lmcache", lambda s: s.hit_tokens_total),
        ("num_stored_tokens", "Total number of tokens stored in lmcache including evicted ones", lambda s: s.stored_tokens_total),
        ("num_lookup_tokens", "Total number of tokens requested in lookup from lmcache", lambda s: s.lookup_tokens_total),
        ("num_lookup_hits", "Total number of tokens hit in lookup from lmcache", lambda s: s.lookup_hits_total),
        ("num_vllm_hit_tokens", "Number of hit tokens in vllm", lambda s: s.vllm_hit_tokens_total),
        ("num_prompt_tokens", "Number of prompt tokens in lmcache", lambda s: s.prompt_tokens_total),
    ):
        w.counter(P + name, help_text, [(labels(i), fn(s), 0.0) for i, s in enumerate(workers)])
    for name, help_text, fn in (
        ("retrieve_hit_rate", "Hit rate of lmcache retrieve requests since last log", lambda s: s.retrieve_hit_rate),
        ("lookup_hit_rate", "Hit rate of lmcache lookup requests since last log", lambda s: s.lookup_hit_rate),
        ("local_cache_usage", "Local cache usage (bytes) of lmcache", lambda s: s.local_cache_usage_bytes),
    ):
        w.gauge(P + name, help_text, [(labels(i), fn(s)) for i, s in enumerate(workers)])
