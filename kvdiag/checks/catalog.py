"""The checklist as data: checks, the verdict decision table, findings, alerts and remedies.

This module is the one definition every surface renders: the Python evaluation (the check
modules beside it read their thresholds from ``kvdiag.config.Config`` by the names listed
here), the Prometheus recording/alerting rules and the Grafana dashboards (``kvdiag render``),
`kvdiag explain`, and the runbooks. Nothing here names an engine.

Shape, for renderers:

- ``SERIES``: the engine-neutral series the PromQL below reads, ``name -> Series``; recording
  rules produce them from the engines' own series, in every spelling (names may contain ``{window}``).
- ``CHECKS``: ``CheckSpec`` per check, in evaluation order. ``signal`` is the decision-table
  column ("S", "Q", "E") or None. ``promql`` is a template over ``SERIES`` whose ``{key}``
  placeholders are ``Config.promql_params()`` keys (and ``{S}`` etc. for other signals);
  ``check_expr(name, config)`` fills it in.
- ``DECISION_TABLE``: eight ``Row``s, one per (S, Q, E) combination, each naming its verdict.
- ``VERDICTS``: ``VerdictSpec`` per verdict (severity, alert name, exit code, remedies);
  ``verdict_expr(name, config, checks=None)`` composes the alert expression from the rows
  (``checks`` maps check names to recorded series to use in place of the inline PromQL).
- ``FINDINGS``: ``FindingSpec`` per finding: checks that must fire (``all_of``), checks that
  must be known not to fire (``none_of``), verdicts it accompanies (``verdicts``, empty = any);
  ``finding_expr(name, config)`` composes its expression.
- ``REMEDIES``: ``RemedySpec`` per remedy: a text with ``{figure}``/``{knob}`` placeholders and
  a plain text for when the figures are not known.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Mapping

from kvdiag.config import Config
from kvdiag.model import Severity


@dataclass(frozen=True)
class Series:
    """An engine-neutral series the rules record and the checks' PromQL reads."""

    name: str
    field: str  # the PoolSample field it corresponds to
    meaning: str


@dataclass(frozen=True)
class CheckSpec:
    name: str
    signal: str | None  # decision-table column, or None for checks that only feed findings
    title: str
    fires_when: str  # with {key} placeholders from Config.describe() keys
    params: tuple[str, ...]  # Config keys it reads
    needs: tuple[str, ...]  # PoolSample fields it reads
    growth: bool  # needs a window of samples; unknown on a single exposition
    promql: str
    known: str = ""  # PromQL for "the check can be judged" where its primary series does not say it


@dataclass(frozen=True)
class Row:
    """One line of the decision table: the three capacity signals and the answer."""

    s: bool
    q: bool
    e: bool
    verdict: str
    meaning: str

    @property
    def signals(self) -> tuple[bool, bool, bool]:
        return (self.s, self.q, self.e)


@dataclass(frozen=True)
class VerdictSpec:
    name: str
    severity: Severity
    exit_code: int
    alert: str | None  # Prometheus alert name; None for healthy
    summary: str
    remedies: tuple[str, ...]
    names_pool: bool = False  # the verdict says the KV pool is at or near its limit


@dataclass(frozen=True)
class FindingSpec:
    name: str
    severity: Severity
    alert: str | None
    summary: str
    all_of: tuple[str, ...]  # checks that must be firing
    none_of: tuple[str, ...] = ()  # checks that must be ok (known, not firing)
    verdicts: tuple[str, ...] = ()  # verdicts it may accompany; empty means any
    remedies: tuple[str, ...] = ()


@dataclass(frozen=True)
class RemedySpec:
    name: str
    text: str  # placeholders: figures (pool_tokens, avg_len, ceiling, ...) and knobs (admission_limit, ...)
    plain: str  # the same advice without numbers


#: Exit codes from best to worst, for "the worst over instances": a bottleneck outranks an
#: instance that cannot be judged, which outranks a warning (it may hide a bottleneck).
EXIT_ORDER = (0, 1, 3, 2)

#: The decision-table columns, in order, and the checks that decide them.
SIGNALS = {"S": "kv_usage_saturated", "Q": "queue_growing", "E": "evictions_growing"}

SERIES = {
    s.name: s
    for s in (
        Series("instance:kvdiag_kv_usage:ratio", "usage_ratio", "active (non-evictable) KV usage 0-1; max over TP ranks"),
        Series("instance:kvdiag_kv_admission_need:ratio{window}", "usage_ratio",
               "the room the next admission needs beyond the usage gauge (uncached prompt; output and the running "
               "requests' output reserve where the engine reserves it; the room one step frees where the gauge is "
               "read after the frees; a decode instance that preallocates transferred prompts: the whole prompt and "
               "its reserve per running, transferring and next request) over capacity; 0 where an input is missing"),
        Series("instance:kvdiag_kv_admission_usage:ratio{window}", "usage_ratio",
               "usage + admission need, at most 1 (what admission counts as taken now)"),
        Series("instance:kvdiag_waiting:requests", "waiting",
               "requests in the waiting queues (the scheduler's, plus a disaggregated role's bootstrap / prealloc / "
               "transfer queues; requests deferred for their KV included); max over TP ranks"),
        Series("instance:kvdiag_running:requests", "running", "running requests; max over TP ranks"),
        Series("instance:kvdiag_kv_capacity:tokens", "capacity_tokens", "KV pool (L1) capacity in tokens"),
        Series("instance:kvdiag_decode_reserve:ratio", "decode_reserve_ratio",
               "share of running requests' remaining output that admission holds back, where reported"),
        Series("instance:kvdiag_output_tokens:avg{window}", "generation_tokens_total", "output tokens per finished request"),
        Series("instance:kvdiag_evictions:rate{window}", "evictions_total", "retract/preempt per second: rate() of the counter, never the last-event gauge"),
        Series("instance:kvdiag_evictions:rate{evictions_recent_window}", "evictions_total",
               "retract/preempt per second over the recent span the eviction check fires on"),
        Series("instance:kvdiag_ttft_seconds:p99_{window}", "ttft", "histogram_quantile of the TTFT buckets' rate()"),
        Series("instance:kvdiag_ttft_requests:increase{window}", "ttft", "first tokens observed in the window (traffic floor)"),
        Series("instance:kvdiag_prefix_hit:ratio{window}", "prefix_hit_tokens_total", "rate(hit tokens) / rate(queried tokens)"),
        Series("instance:kvdiag_l2_usage:ratio", "l2_used_tokens", "L2 (host tier) used / capacity, where reported"),
        Series("instance:kvdiag_l2_hit:share{window}", "l2_hit_tokens_total",
               "rate(L2 hit tokens) / rate(the tier's own lookups (LMCache), else queried tokens)"),
        Series("instance:kvdiag_l2_load_bytes:rate{window}", "l2_load_bytes_total", "bytes copied back from L2 into L1 per second"),
        Series("instance:kvdiag_l2_store_bytes:rate{window}", "l2_store_bytes_total", "bytes copied from L1 into L2 per second"),
    )
}

CHECKS = (
    CheckSpec(
        "kv_usage_saturated",
        "S",
        "KV pool pinned near full, as admission counts it",
        "usage + the room the next admission needs >= {saturated_usage}: at every sample of the last "
        "{saturated_short_window} (short window), or in >= {saturated_fraction} of the {window} window "
        "(its 1 - saturated_fraction quantile) and at its end (long window), or, on an engine that reserves output, "
        "with >= {queue_min_growth} requests waiting and every running "
        "request (the most over {saturated_short_window}) reserved its whole remaining output (reserve ratio 1) (reserve), "
        "or the eviction counter rose >= {evictions_storm} over the last {evictions_recent_window} with >= "
        "{queue_min_growth} requests waiting (the most over {saturated_short_window}): the pool ran out again and again "
        "between the samples (storm)",
        ("window", "saturated_usage", "saturated_fraction", "saturated_short_window", "queue_min_growth",
         "evictions_storm", "evictions_recent_window"),
        ("usage_ratio", "capacity_tokens", "decode_reserve_ratio", "running", "prompt_tokens_total",
         "generation_tokens_total", "requests_total", "prefix_hit_tokens_total", "prefix_query_tokens_total",
         "waiting_deferred", "waiting", "evictions_total"),
        False,
        "min_over_time(instance:kvdiag_kv_usage:ratio[{saturated_short_window}])"
        " + instance:kvdiag_kv_admission_need:ratio{window} >= {saturated_usage}"
        " or (quantile_over_time({saturated_quantile}, instance:kvdiag_kv_usage:ratio[{window}])"
        " + instance:kvdiag_kv_admission_need:ratio{window} >= {saturated_usage}"
        " and instance:kvdiag_kv_usage:ratio + instance:kvdiag_kv_admission_need:ratio{window} >= {saturated_usage})"
        " or (min_over_time(instance:kvdiag_kv_usage:ratio[{saturated_short_window}]) + instance:kvdiag_kv_admission_need:ratio{window}"
        " + (1 - instance:kvdiag_decode_reserve:ratio) * instance:kvdiag_output_tokens:avg{window}"
        " * max_over_time(instance:kvdiag_running:requests[{saturated_short_window}]) / instance:kvdiag_kv_capacity:tokens"
        " >= {saturated_usage}"
        " and instance:kvdiag_waiting:requests >= {queue_min_growth})"
        " or (instance:kvdiag_evictions:rate{evictions_recent_window} * {evictions_recent_window_seconds} >= {evictions_storm}"
        " and max_over_time(instance:kvdiag_waiting:requests[{saturated_short_window}]) >= {queue_min_growth})",
    ),
    CheckSpec(
        "queue_growing",
        "Q",
        "waiting queue growing",
        "waiting > 0 and either it stands >= max({queue_min_growth}, {queue_growth_ratio} x running) above its "
        "minimum of the last {queue_short_window} with a positive least-squares slope over {window}, or that much "
        "above its minimum of the {window} window with a positive slope over {window} and a slope >= 0 over "
        "{queue_short_window} (slow, steady growth), or it is >= max({queue_min_growth}, {backlog_ratio} x running) "
        "with a slope >= 0 over {queue_short_window} (a backlog not draining), or it stayed >= max({queue_min_growth}, "
        "{queue_growth_ratio} x running) at every sample of the last {queue_short_window} (a standing backlog: a "
        "closed loop's queue stands, it cannot grow)",
        ("window", "queue_short_window", "queue_min_growth", "queue_growth_ratio", "backlog_ratio", "min_samples"),
        ("waiting", "running", "waiting_capacity", "waiting_deferred", "transfers_in_flight", "admission_rejections_total"),
        True,
        "instance:kvdiag_waiting:requests > 0 and ("
        "(instance:kvdiag_waiting:requests - min_over_time(instance:kvdiag_waiting:requests[{queue_short_window}])"
        " >= clamp_min({queue_growth_ratio} * instance:kvdiag_running:requests, {queue_min_growth})"
        " and deriv(instance:kvdiag_waiting:requests[{window}]) > 0)"
        " or (instance:kvdiag_waiting:requests - min_over_time(instance:kvdiag_waiting:requests[{window}])"
        " >= clamp_min({queue_growth_ratio} * instance:kvdiag_running:requests, {queue_min_growth})"
        " and deriv(instance:kvdiag_waiting:requests[{window}]) > 0"
        " and deriv(instance:kvdiag_waiting:requests[{queue_short_window}]) >= 0)"
        " or (instance:kvdiag_waiting:requests >= clamp_min({backlog_ratio} * instance:kvdiag_running:requests, {queue_min_growth})"
        " and deriv(instance:kvdiag_waiting:requests[{queue_short_window}]) >= 0)"
        " or min_over_time(instance:kvdiag_waiting:requests[{queue_short_window}])"
        " >= clamp_min({queue_growth_ratio} * instance:kvdiag_running:requests, {queue_min_growth}))",
    ),
    CheckSpec(
        "evictions_growing",
        "E",
        "retract/preempt counter growing",
        "the eviction (retract/preempt) counter rose by >= {min_evictions} over the last "
        "{evictions_recent_window}, or over the {window} window while usage + the room the next admission "
        "needs stayed >= {evictions_held_usage} at every sample of that last {evictions_recent_window} "
        "(the pool that ran out is still that full), reset-safe",
        ("window", "evictions_recent_window", "evictions_held_usage", "min_evictions", "min_samples"),
        ("evictions_total", "recompute_tokens_total", "preemptions_per_request"),
        True,
        "instance:kvdiag_evictions:rate{evictions_recent_window} * {evictions_recent_window_seconds} >= {min_evictions}"
        " or (instance:kvdiag_evictions:rate{window} * {window_seconds} >= {min_evictions}"
        " and min_over_time(instance:kvdiag_kv_usage:ratio[{evictions_recent_window}])"
        " + instance:kvdiag_kv_admission_need:ratio{window} >= {evictions_held_usage})",
    ),
    CheckSpec(
        "ttft_p99_high",
        None,
        "P99 TTFT above the SLO",
        "the {ttft_quantile} quantile of TTFT over the window, from the histogram, >= {ttft_slo} "
        "(with >= {min_ttft_observations} first tokens)",
        ("window", "ttft_slo", "ttft_quantile", "min_ttft_observations"),
        ("ttft",),
        False,
        "instance:kvdiag_ttft_seconds:p99_{window} >= {ttft_slo_seconds}"
        " and instance:kvdiag_ttft_requests:increase{window} >= {min_ttft_observations}",
    ),
    CheckSpec(
        "prefix_hit_high",
        None,
        "prefix-cache hit ratio high",
        "hit tokens / queried tokens over the window, from counters, >= {prefix_hit_high}",
        ("window", "prefix_hit_high"),
        ("prefix_hit_tokens_total", "prefix_query_tokens_total"),
        False,
        "instance:kvdiag_prefix_hit:ratio{window} >= {prefix_hit_high}",
    ),
    CheckSpec(
        "l2_underused",
        None,
        "L2 underused while L1 is saturated",
        "L2 occupancy < {l2_low_occupancy}, or L2 hits < {l2_low_hit_share} of the tier's lookups (else of queried "
        "tokens), or L2 stored into with nothing loaded back, while kv_usage_saturated fires (only where an L2 tier "
        "is reported; each tier judged on what it exports)",
        ("window", "l2_low_occupancy", "l2_low_hit_share", "saturated_usage", "saturated_fraction", "saturated_short_window"),
        ("l2_capacity_tokens", "l2_used_tokens", "l2_hit_tokens_total", "usage_ratio", "l2_query_tokens_total",
         "l2_load_bytes_total", "l2_store_bytes_total", "l2_dropped_tokens_total", "l3_hit_tokens_total"),
        False,
        "(instance:kvdiag_l2_usage:ratio < {l2_low_occupancy}"
        " or instance:kvdiag_l2_hit:share{window} < {l2_low_hit_share}"
        " or (instance:kvdiag_l2_load_bytes:rate{window} == 0 and instance:kvdiag_l2_store_bytes:rate{window} > 0))"
        " and ({S})",
        # an L2 tier is there when its occupancy is reported, or its hits or traffic counted something
        "instance:kvdiag_l2_usage:ratio or instance:kvdiag_l2_hit:share{window} > 0"
        " or (instance:kvdiag_l2_load_bytes:rate{window} + instance:kvdiag_l2_store_bytes:rate{window} > 0)",
    ),
)

DECISION_TABLE = (
    Row(True, True, True, "l1_kv_bottleneck", "pool pinned, queue growing, requests recomputed: L1 caps concurrency and the queueing and recompute land in TTFT"),
    Row(True, True, False, "l1_kv_pressure", "pool pinned and queue growing without evictions: admission is blocked on L1 before any recompute"),
    Row(True, False, True, "l1_kv_pressure", "pool pinned and requests recomputed without a backlog yet"),
    Row(False, True, True, "l1_kv_pressure", "evictions prove the pool ran out while the sampled usage gauge missed the peaks"),
    Row(True, False, False, "near_kv_capacity", "pool pinned, but nobody waits and nothing is recomputed: at capacity, not yet limiting"),
    Row(False, True, False, "queue_without_kv_pressure", "requests wait while the pool has room: the cap is the admission limit, the token budget or compute"),
    Row(False, False, True, "healthy", "evictions alone, without a pinned pool or a queue (reported as the finding transient_evictions)"),
    Row(False, False, False, "healthy", "no capacity signal fires"),
)

VERDICTS = {
    v.name: v
    for v in (
        VerdictSpec("l1_kv_bottleneck", "critical", 2, "KvdiagL1KVPoolBottleneck",
                    "The GPU KV pool (L1) caps concurrency; queueing and recompute drive TTFT up.",
                    ("output_reserve", "ceiling", "admission_limit", "fp8_kv", "more_l1", "l2_not_p99"), names_pool=True),
        VerdictSpec("l1_kv_pressure", "warning", 1, "KvdiagL1KVPoolPressure",
                    "The GPU KV pool (L1) is under pressure: two of the three bottleneck signals.",
                    ("output_reserve", "ceiling", "admission_limit", "fp8_kv", "more_l1", "l2_not_p99"), names_pool=True),
        VerdictSpec("near_kv_capacity", "info", 0, "KvdiagKVPoolNearCapacity",
                    "The KV pool is pinned near full but not yet limiting.",
                    ("ceiling", "fp8_kv"), names_pool=True),
        VerdictSpec("queue_without_kv_pressure", "warning", 1, "KvdiagQueueWithoutKVPressure",
                    "Requests queue while the KV pool has room: something other than L1 caps concurrency.",
                    ("ceiling", "raise_admission")),
        VerdictSpec("healthy", "none", 0, None, "No KV-pool capacity signal fires.", ()),
        VerdictSpec("unknown", "warning", 3, "KvdiagEngineMetricsAbsent",
                    "A signal the decision table needs is absent; the verdict cannot be decided.",
                    ("decide_unknown",)),
    )
}

FINDINGS = {
    f.name: f
    for f in (
        FindingSpec("transient_evictions", "info", None,
                    "Running requests were evicted and recomputed without a pinned pool or a queue.",
                    all_of=("evictions_growing",), none_of=("kv_usage_saturated", "queue_growing"),
                    remedies=("watch_evictions",)),
        FindingSpec("concurrency_not_cache", "warning", "KvdiagCacheHealthyButTTFTBad",
                    "Prefix-cache hit ratio is high and P99 TTFT is bad: the concurrency account, not the cache, is the problem.",
                    all_of=("prefix_hit_high", "ttft_p99_high"), remedies=("l2_not_p99",)),
        FindingSpec("l2_irrelevant_to_p99", "info", None,
                    "L1 is the limit while L2 has room: L2 raises hit rate, it cannot raise concurrency.",
                    all_of=("l2_underused",), verdicts=("l1_kv_bottleneck", "l1_kv_pressure"), remedies=("l2_not_p99",)),
        FindingSpec("p99_high_without_kv_pressure", "warning", None,
                    "P99 TTFT is above the SLO while the KV pool is fine: look at prefill compute.",
                    all_of=("ttft_p99_high",), none_of=("kv_usage_saturated", "evictions_growing"), remedies=("prefill_compute",)),
    )
}

REMEDIES = {
    r.name: r
    for r in (
        RemedySpec("output_reserve",
                   "Admission is refused by the output reserve, not by what requests hold: the usage gauge reads "
                   "{reserve_usage:.2f} while {reserve_running:,} running requests, each reserved its whole remaining output "
                   "(the engine exports a reserve ratio of {reserve_ratio:.3g}, the floor of what it reserves: a request "
                   "with ignore_eos is reserved at 1, and one whose max_tokens exceeds its answer on what it asked for), "
                   "hold about {reserve_tokens:,} more tokens ({reserve_share:.0%} of the pool). Finished requests got "
                   "{reserve_output:,.0f} output tokens each: clients' max_tokens closer to that frees the reserve. "
                   "{reserve_conservativeness} below 1 scales the reserve ratio down and {reserve_clip}=N caps the output charged "
                   "per request (set to 64, a real engine over-committed its pool to 0.99-1.00): both admit more and both risk "
                   "retracting and recomputing running requests when their outputs do run long.",
                   ""),
        RemedySpec("ceiling",
                   "Concurrency ceiling: ({pool_tokens:,} pool tokens - {shared_tokens:,} shared prefix tokens, held once) / "
                   "{private_len:,} private tokens per request (uncached input + output) = {ceiling:,} requests at their "
                   "full length; {running_peak:,} ran at the window's peak{running_note}.",
                   "Concurrency ceiling = (pool tokens - the shared prefix, held once) / private tokens per request "
                   "(uncached input + output); compare it with the running count."),
        RemedySpec("admission_limit",
                   "Admission limit: {admission_limit} {limit}, {limit_reason}.",
                   "Admission limit: cap {admission_limit} at (pool tokens - the shared prefix) / private tokens per "
                   "request, and never below the running count seen without evictions, so requests queue instead of "
                   "being evicted and recomputed."),
        RemedySpec("fp8_kv",
                   "FP8 KV cache ({kv_dtype_fp8}): half the bytes per token of a bf16/fp16 KV cache, about "
                   "{fp8_pool_tokens:,} pool tokens and a ceiling of {fp8_ceiling:,} at the observed lengths.",
                   "FP8 KV cache ({kv_dtype_fp8}): half the bytes per token of a bf16/fp16 KV cache, twice the tokens."),
        RemedySpec("more_l1",
                   "More L1: doubling tensor parallelism ({tensor_parallel}) at least doubles the pool per instance for "
                   "GQA/MHA models with enough KV heads (ceiling >= {double_ceiling:,}; MLA latents do not shard); doubling "
                   "data parallelism ({data_parallel}) adds a second pool of {pool_tokens:,} tokens.",
                   "More L1: more tensor parallelism ({tensor_parallel}) or data parallelism ({data_parallel}); "
                   "a smaller KV per token (MLA, sparse attention) does the same."),
        RemedySpec("l2_not_p99",
                   "L2 (host-memory KV tier, offloading, LMCache) raises the hit rate but cannot fix P99 here: admission "
                   "counts L1 slots only, and an L2 hit needs L1 slots before its copy back.",
                   "L2 (host-memory KV tier, offloading, LMCache) raises the hit rate but cannot fix P99 here: admission "
                   "counts L1 slots only, and an L2 hit needs L1 slots before its copy back."),
        RemedySpec("raise_admission",
                   "The pool is not the cap: {running_peak:,} running at peak against a KV ceiling of {ceiling:,}; the "
                   "limit is the admission cap ({admission_limit}), the token budget or compute. Raising "
                   "{admission_limit} toward {ceiling:,} would use the room in the pool.",
                   "The pool is not the cap: look at the admission cap ({admission_limit}), the token budget or compute."),
        RemedySpec("prefill_compute",
                   "P99 TTFT is high with the pool fine: look at prefill compute (prompt lengths, chunked-prefill size, "
                   "the batch token budget), not at the KV cache.",
                   "P99 TTFT is high with the pool fine: look at prefill compute (prompt lengths, chunked-prefill size, "
                   "the batch token budget), not at the KV cache."),
        RemedySpec("watch_evictions",
                   "Evictions without a pinned pool: if they recur, cap {admission_limit} at {limit:,}, {limit_reason}.",
                   "Evictions without a pinned pool: if they recur, cap {admission_limit} at (pool tokens - the shared "
                   "prefix) / private tokens per request."),
        RemedySpec("decide_unknown",
                   "Get the signals the verdict needs: {unknown_hints}",
                   "Get the signals the verdict needs: turn the engine's metrics on ({enable_hint}) and diagnose "
                   "over a window of samples (a recording, --prometheus, or engine URLs with --duration), not one exposition."),
    )
}


def check_spec(name: str) -> CheckSpec:
    return next(c for c in CHECKS if c.name == name)


def verdict_for(signals: tuple[bool, bool, bool]) -> Row:
    """The decision-table row for (S, Q, E)."""
    return _TABLE[signals]


def check_expr(name: str, config: Config) -> str:
    """A check's PromQL with the thresholds in force (other signals' expressions inlined)."""
    params = dict(config.promql_params())
    spec = check_spec(name)
    if "{S}" in spec.promql:
        params.update({sig: check_expr(check, config) for sig, check in SIGNALS.items()})
    return spec.promql.format(**params)


def verdict_expr(name: str, config: Config, checks: Mapping[str, str] | None = None) -> str | None:
    """The alert expression of a verdict: its decision-table rows as ``and``/``unless``/``or``.

    ``checks`` may map check names to expressions to use instead of the inline ones (e.g. the
    names of recording rules that hold each check). ``unless`` reads an absent signal as "not
    firing"; the ``unknown`` verdict is the rules' absent()-style guard and has no expression
    here. Healthy raises no alert.
    """
    rows = [r for r in DECISION_TABLE if r.verdict == name]
    if name in ("unknown", "healthy") or not rows:
        return None
    exprs = {sig: f"({_expr(check, config, checks)})" for sig, check in SIGNALS.items()}
    terms = []
    for row in rows:
        on = [exprs[s] for s, v in zip(SIGNALS, row.signals) if v]
        off = [exprs[s] for s, v in zip(SIGNALS, row.signals) if not v]
        terms.append(" and ".join(on) + "".join(f" unless {x}" for x in off))
    return " or ".join(f"({t})" for t in terms) if len(terms) > 1 else terms[0]


def finding_expr(name: str, config: Config, checks: Mapping[str, str] | None = None) -> str:
    """A finding's PromQL: its checks (and verdicts) combined as the Python evaluation does."""
    spec = FINDINGS[name]
    expr = " and ".join(f"({_expr(c, config, checks)})" for c in spec.all_of)
    expr += "".join(f" unless ({_expr(c, config, checks)})" for c in spec.none_of)
    if spec.verdicts:
        expr = f"({expr}) and (" + " or ".join(f"({verdict_expr(v, config, checks)})" for v in spec.verdicts) + ")"
    return expr


def _expr(check: str, config: Config, checks: Mapping[str, str] | None) -> str:
    return checks[check] if checks and check in checks else check_expr(check, config)


def _build_table() -> dict[tuple[bool, bool, bool], Row]:
    """Index the table, refusing a table with a missing or doubled combination."""
    table: dict[tuple[bool, bool, bool], Row] = {}
    for row in DECISION_TABLE:
        if row.signals in table:
            raise AssertionError(f"decision table answers {row.signals} twice")
        if row.verdict not in VERDICTS:
            raise AssertionError(f"decision table names unknown verdict {row.verdict}")
        table[row.signals] = row
    missing = [c for c in product((True, False), repeat=3) if c not in table]
    if missing:
        raise AssertionError(f"decision table has no answer for {missing}")
    return table


_TABLE = _build_table()
