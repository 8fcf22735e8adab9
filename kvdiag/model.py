"""The normalized record: one engine instance's KV pool and queue at one scrape.

Both engines account for the GPU KV pool (L1) differently: SGLang counts tokens and reports
used / evictable / available apart (recent versions), vLLM counts blocks and folds evictable
prefix-cache blocks into "free". A ``PoolSample`` keeps each figure in one unit (tokens,
requests, seconds), says where every figure came from (``provenance``), and keeps "absent"
(``None``) apart from zero: a missing metric must never read as an idle pool.
Nothing downstream of this module knows which engine produced a sample except through the
``engine`` string it carries for display and for the adapters' remedy knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

Granularity = Literal["token", "block"]
#: What an instance does in prefill/decode disaggregation ("unified" serves both phases).
Role = Literal["prefill", "decode", "unified"]
#: Why a queued request waits: for room in the pool / batch ("capacity"), for something else
#: first (its KV transfer, a bootstrap handshake, a LoRA slot: "deferred"), or it is no longer
#: queued but its KV is in flight ("in_flight", shown, never counted as waiting).
QueueKind = Literal["capacity", "deferred", "in_flight"]
KIND_ORDER: dict[str, int] = {"capacity": 0, "deferred": 1, "in_flight": 2}


@dataclass(frozen=True)
class Provenance:
    """Where a field came from: the metric (or metrics) and whether it was read or derived.

    ``invalid`` marks a field the source did report but with an impossible value (non-finite,
    out of range, a ratio above 1): the field is absent, and this says why, so evidence can
    name the metric that was refused instead of calling it missing.
    """

    metric: str
    derived: bool = False
    note: str = ""
    invalid: bool = False

    def describe(self) -> str:
        how = "derived from " if self.derived else ""
        return ("INVALID, not used: " if self.invalid else "") + f"{how}{self.metric}" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram as exposed: upper bounds (ending in +Inf), counts, sum, count."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts):
            raise ValueError("histogram bounds and counts differ in length")
        if not self.bounds or not math.isinf(self.bounds[-1]):
            raise ValueError("histogram has no +Inf bucket")


@dataclass(frozen=True)
class Queue:
    """One of an instance's request queues as its engine names it, with what it waits for.

    A disaggregated deployment splits "waiting" over several queues, and only some of them wait
    for the pool: a decode instance's pre-allocation queue is its pool's admission queue, while
    its transfer queue (and a vLLM request deferred for its KV) waits for the other instance."""

    name: str  # the role's own term, e.g. "decode prealloc queue"
    kind: QueueKind
    requests: float
    metric: str


@dataclass(frozen=True)
class Pool:
    """One KV pool of a hybrid model (full attention, sliding window, Mamba states), in its own
    unit; a classic model has none of these (its one pool is the PoolSample's own fields)."""

    kind: str  # "full" | "swa" | "mamba"
    usage_ratio: float
    used: float | None = None
    evictable: float | None = None
    available: float | None = None
    capacity: float | None = None
    unit: str = "tokens"  # Mamba pools count request states
    metric: str = ""

    @property
    def title(self) -> str:
        return POOL_TITLES.get(self.kind, self.kind)


POOL_TITLES = {"full": "full-attention pool", "swa": "sliding-window pool", "mamba": "Mamba state pool"}


#: Scalar fields of a PoolSample that hold numbers (everything but identity and histograms).
NUMERIC_FIELDS = (
    "capacity_tokens",
    "block_size",
    "num_blocks",
    "usage_ratio",
    "used_tokens",
    "evictable_tokens",
    "available_tokens",
    "running",
    "waiting",
    "waiting_capacity",
    "waiting_deferred",
    "transfers_in_flight",
    "evictions_total",
    "last_eviction_event",
    "recompute_tokens_total",
    "admission_rejections_total",
    "prefix_hit_tokens_total",
    "prefix_query_tokens_total",
    "prefix_hit_ratio_gauge",
    "prompt_tokens_total",
    "generation_tokens_total",
    "requests_total",
    "l2_used_tokens",
    "l2_capacity_tokens",
    "l2_hit_tokens_total",
    "l2_query_tokens_total",
    "l2_load_bytes_total",
    "l2_store_bytes_total",
    "l2_dropped_tokens_total",
    "l3_hit_tokens_total",
    "external_hit_tokens_total",
    "external_query_tokens_total",
    "decode_reserve_ratio",
)

#: Fields that hold a cumulative ``Histogram``.
HISTOGRAM_FIELDS = ("ttft", "queue_time", "itl", "preemptions_per_request", "prompt_lengths", "output_lengths")

#: (part, whole) counter pairs: hits are a subset of queries, so a part above its whole makes
#: the ratio above 1 and both figures suspect.
PARTS = (
    ("prefix_hit_tokens_total", "prefix_query_tokens_total"),
    ("external_hit_tokens_total", "external_query_tokens_total"),
    ("l2_used_tokens", "l2_capacity_tokens"),
    ("l2_hit_tokens_total", "l2_query_tokens_total"),
)

#: The largest integer a float holds exactly: a token or request count beyond it is no count.
MAX_COUNT = float(2**53)


@dataclass(frozen=True)
class Limits:
    """The closed range a numeric field can take; a value outside it is invalid, not a figure."""

    low: float = 0.0
    high: float = MAX_COUNT

    def violation(self, v: float) -> str | None:
        """Why ``v`` cannot be this field's value, or None when it can."""
        if math.isnan(v) or math.isinf(v):
            return f"{v} is not a finite number"
        if v < self.low:
            return f"{v!r} is below {self.low:g}" + (" (counts are never negative)" if self.low == 0 else "")
        if v > self.high:
            return f"{v!r} is above {self.high:g}"
        return None


#: Every numeric field's range; fields not named are counts in [0, MAX_COUNT]. A pool needs
#: at least one slot, and the engines' ratios are fractions of something.
LIMITS: dict[str, Limits] = {
    "capacity_tokens": Limits(1.0),
    "block_size": Limits(1.0),
    "num_blocks": Limits(1.0),
    "usage_ratio": Limits(0.0, 1.0),
    "prefix_hit_ratio_gauge": Limits(0.0, 1.0),
    "decode_reserve_ratio": Limits(0.0, 1.0),
}
_COUNT = Limits()


def violation(name: str, v: float) -> str | None:
    """Why ``v`` is impossible for field ``name`` (None when it is a possible value)."""
    return LIMITS.get(name, _COUNT).violation(v)


#: Fields that are cumulative counters: windows take reset-safe increases of these.
COUNTER_FIELDS = (
    "evictions_total",
    "prefix_hit_tokens_total",
    "prefix_query_tokens_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "requests_total",
    "recompute_tokens_total",
    "admission_rejections_total",
    "l2_hit_tokens_total",
    "l2_query_tokens_total",
    "l2_load_bytes_total",
    "l2_store_bytes_total",
    "l2_dropped_tokens_total",
    "l3_hit_tokens_total",
    "external_hit_tokens_total",
    "external_query_tokens_total",
)


@dataclass
class PoolSample:
    """One engine instance (a DP rank of one server) at one scrape, in engine-neutral terms."""

    instance: str
    engine: str
    ts: float
    model: str | None = None
    role: Role | None = None  # prefill / decode / unified where the series say it
    # A KV tier's own exporter (no pool of its own): joins the engine instance of its model.
    tier_only: bool = False
    # The pool. capacity in tokens; block_size/num_blocks where blocks are the source.
    capacity_tokens: float | None = None
    block_size: float | None = None
    num_blocks: float | None = None
    # Active (non-evictable) share of the pool, as the engine reports it.
    usage_ratio: float | None = None
    usage_granularity: Granularity | None = None
    # The three states, only where the engine reports them apart.
    used_tokens: float | None = None
    evictable_tokens: float | None = None
    available_tokens: float | None = None
    # Scheduler. ``waiting`` is every queued request (capacity + deferred), split below where
    # the engine says why; ``queues`` names each queue as the engine does.
    running: float | None = None
    waiting: float | None = None
    waiting_capacity: float | None = None
    waiting_deferred: float | None = None
    transfers_in_flight: float | None = None  # requests whose KV is being sent or fetched
    queues: tuple[Queue, ...] = ()
    # Running requests thrown out of L1 and recomputed (retract / preempt), cumulative.
    evictions_total: float | None = None
    # Size of the last eviction event (a gauge some versions export); never rated.
    last_eviction_event: float | None = None
    # Tokens thrown away by evictions (to be computed again), and requests refused at the door.
    recompute_tokens_total: float | None = None
    admission_rejections_total: float | None = None
    preemptions_per_request: Histogram | None = None  # per finished request
    # Every pool of a hybrid model; the classic fields above are the binding pool's split.
    pools: tuple[Pool, ...] = ()
    # Prefix cache (L1) from counters; the gauge only where no counter exists.
    prefix_hit_tokens_total: float | None = None
    prefix_query_tokens_total: float | None = None
    prefix_hit_ratio_gauge: float | None = None
    # Traffic, for the average sequence length behind the concurrency ceiling.
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_total: float | None = None
    # L2 (host memory tier) and external caches.
    l2_used_tokens: float | None = None
    l2_capacity_tokens: float | None = None
    l2_hit_tokens_total: float | None = None
    l2_query_tokens_total: float | None = None  # where the tier counts its own lookups
    l2_tier: str | None = None  # what the L2 is, in words ("host-memory tier", "LMCache", ...)
    # L2 traffic (L1 <-> L2 bytes), tokens the L2 dropped, L3 (storage) hit tokens.
    l2_load_bytes_total: float | None = None
    l2_store_bytes_total: float | None = None
    l2_dropped_tokens_total: float | None = None
    l3_hit_tokens_total: float | None = None
    external_hit_tokens_total: float | None = None
    external_query_tokens_total: float | None = None
    # Admission's reservation ratio for running requests' future output, where exported.
    decode_reserve_ratio: float | None = None
    # Latency histograms (cumulative).
    ttft: Histogram | None = None
    queue_time: Histogram | None = None
    # Time between a request's consecutive output tokens (the decode step time it saw): the
    # step-time model's evidence (``whatif.steptime``).
    itl: Histogram | None = None
    # Prompt and generated tokens per finished request (cumulative histograms): the lengths'
    # spread, which the token counters (their sums) cannot give.
    prompt_lengths: Histogram | None = None
    output_lengths: Histogram | None = None
    labels: dict[str, str] = field(default_factory=dict)  # the labels that split this instance
    # Gauges written per process (a ``pid`` label without a multiprocess mode): field -> pid ->
    # value, for the window to pick the most recent writer (``kvdiag.window.resolve_writers``).
    writers: dict[str, dict[str, float]] = field(default_factory=dict)
    # pid -> ts of the scrape where that pid's value last changed, per field (set by the window).
    writer_changed: dict[str, dict[str, float]] = field(default_factory=dict)
    # Fields an adapter derived from such a gauge as its value times a factor (vLLM's used tokens
    # = usage x capacity): field -> (gauge field, factor), re-derived from the writer picked.
    scaled: dict[str, tuple[str, float]] = field(default_factory=dict)
    provenance: dict[str, Provenance] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, name: str, value: float | Histogram | None, source: Provenance) -> bool:
        """Set a field with its provenance; ``None`` leaves it absent and unrecorded.

        An impossible number (``violation``) is never stored: the field stays absent and is
        marked invalid with the reason, whichever source (scrape, log) produced it. Returns
        whether the value was stored.
        """
        if value is None:
            return False
        if not isinstance(value, Histogram):
            why = violation(name, float(value))
            if why is not None:
                self.invalidate(name, source, why)
                return False
        setattr(self, name, value)
        self.provenance[name] = source
        return True

    def invalidate(self, name: str, source: Provenance, why: str) -> None:
        """Drop a field's value as impossible: absent, with the reason in provenance and notes."""
        setattr(self, name, None)
        note = "; ".join(x for x in (source.note, why) if x)
        self.provenance[name] = Provenance(source.metric, source.derived, note, invalid=True)
        self.notes.append(f"{source.metric}: {why}; {name} treated as absent")

    def check_parts(self) -> None:
        """Invalidate both fields of a (part, whole) pair whose part exceeds its whole: the
        ratio would be above 1, and which of the two is wrong cannot be known."""
        for part, whole in PARTS:
            p, w = getattr(self, part), getattr(self, whole)
            if p is not None and w is not None and p > w:
                why = f"{part} {p:g} exceeds {whole} {w:g} (a ratio of {p / w if w else math.inf:.2f})"
                for name in (part, whole):
                    self.invalidate(name, self.provenance[name], why)

    @property
    def prefix_hit_ratio(self) -> float | None:
        """Hit ratio at this scrape (``hit_ratio``): the counters over the engine's lifetime.
        Windows rate the counters instead."""
        return hit_ratio(self.prefix_hit_tokens_total, self.prefix_query_tokens_total, self.prefix_hit_ratio_gauge)

    @property
    def binding_pool(self) -> Pool | None:
        """The fullest pool of a hybrid model (the one admission runs out of first)."""
        return max(self.pools, key=lambda p: p.usage_ratio) if self.pools else None

    def present(self) -> list[str]:
        return [f.name for f in fields(self) if f.name in self.provenance and not self.provenance[f.name].invalid]


def hit_ratio(hits: float | None, queried: float | None, gauge: float | None) -> float | None:
    """The prefix hit ratio from what an engine reports, whatever the span: hit tokens over
    queried tokens where both were counted and some were queried, else the engine's own hit-rate
    gauge (old engines count nothing; None where it has none either). Callers give lifetime
    totals, a window's increases or PromQL rates; the fallback is the same."""
    if hits is not None and queried:
        return hits / queried
    return gauge


@dataclass
class Scrape:
    """One exposition as a source delivered it: the unit of recordings and replays."""

    ts: float
    target: str
    content_type: str | None
    body: str


# --- The diagnosis: what the checks conclude about one instance -----------------------------

Status = Literal["firing", "ok", "unknown"]
Severity = Literal["critical", "warning", "info", "none"]


@dataclass(frozen=True)
class Evidence:
    """The numbers a check looked at and the span they came from, so every answer can be
    checked by hand against the engine's own series."""

    start: float  # first sample used (unix seconds)
    end: float  # last sample used
    samples: int  # samples in the span
    values: dict[str, float | int | str | bool | None] = field(default_factory=dict)
    summary: str = ""  # one sentence a person reads first
    # Where the inputs came from: the metric per field, or for logs the lines (file:line).
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class CheckResult:
    """One check on one instance: firing / ok / unknown, why, and on which numbers.

    ``missing`` names the PoolSample fields that were absent when the status is unknown (or
    the reason a window is needed); ``hint`` says how to get them.
    """

    check: str
    status: Status
    evidence: Evidence
    missing: tuple[str, ...] = ()
    hint: str = ""


@dataclass(frozen=True)
class Verdict:
    """The decision table's answer for one instance."""

    name: str
    severity: Severity
    exit_code: int
    alert: str | None  # the Prometheus alert that carries the same answer
    reason: str  # which signals fired, which were missing


@dataclass(frozen=True)
class Finding:
    """A remark that may accompany any verdict (e.g. a high hit ratio beside a bad P99)."""

    name: str
    severity: Severity
    alert: str | None
    text: str


@dataclass
class Diagnosis:
    """Everything kvdiag says about one instance: verdict, checks, findings, remedies."""

    instance: str
    engine: str
    model: str | None
    verdict: Verdict
    checks: dict[str, CheckResult]
    findings: list[Finding] = field(default_factory=list)
    remedies: list[str] = field(default_factory=list)
    # The numbers behind the remedies: pool tokens, tokens per request, the concurrency ceiling.
    figures: dict[str, float | int | str | None] = field(default_factory=dict)
    start: float = math.nan
    end: float = math.nan
    samples: int = 0
    notes: list[str] = field(default_factory=list)
    role: Role | None = None  # prefill / decode / unified, where the engine's series say it
