"""The engine adapters' normalization, written as Prometheus recording rules.

Each rule produces one engine-neutral ``instance:kvdiag_*`` series from ``sglang:*`` /
``sglang_*`` / ``vllm:*`` / ``vllm_*`` series, choosing the same metric, the same fallbacks and
the same topology handling as ``kvdiag/engines/sglang.py`` and ``vllm.py`` (this module is the
PromQL twin of those two files; when an adapter changes, change the matching source here).
The checklist's series (``kvdiag.checks.catalog.SERIES``) are all produced here; the other
series feed the dashboards (the three pool states, capacity, the concurrency ceiling).

The rules come in layers, as the monitoring mixins layer theirs, one rule group each:

1. ``kvdiag-instance``, ``kvdiag-instance-tokens``, ``kvdiag-instance-ttft``: what one scrape
   says, per instance, from instant selectors and aggregations only: gauges, and the totals of
   counters and histogram buckets as the adapters read them (max over duplicates, sum over
   partitions), in three groups that Prometheus evaluates concurrently;
2. ``kvdiag-rates``: windows (``rate``, ``increase``, ``*_over_time``) over those recorded
   totals, and what follows from them at the same instant;
3. ``kvdiag-usage``: the usage gauge as its most recent writer (a window over the second
   layer's change times), and the admission usage built on it.

No rule takes a subquery, and no window reads an engine series: an engine series is read
once per evaluation, by an instant selector, whatever the window. The windowed rules read
the recorded totals, which is also what the Python window does (it rates the figure an
adapter read from each scrape, not each duplicate apart).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.checks.catalog import SERIES
from kvdiag.config import Config
from kvdiag.engines import lmcache, sglang, vllm
from kvdiag.render.promql import (
    INSTANCE_INFO,
    Labels,
    broadcast,
    counter_total,
    first,
    gauge,
    label_value,
    sel,
    with_model,
)

S = sglang.P  # "sglang:"
V = vllm.P  # "vllm:"
STREAM = ("is_streaming",)  # SGLang tokenizer series split requests in two partitions


@dataclass(frozen=True)
class Recording:
    """One recording rule: the series it records, its PromQL, and what it means."""

    record: str
    expr: str
    meaning: str
    labels: tuple[tuple[str, str], ...] = ()


def tagged(expr: str, **labels: str) -> str:
    """``expr`` with constant labels added (``label_replace`` on a label every series has)."""
    for name, value in labels.items():
        expr = f'label_replace({expr}, "{name}", "{value}", "__name__", ".*")'
    return expr


def series_name(template: str, config: Config) -> str:
    """A catalog series name with its durations filled in (``rate{window}`` -> ``rate5m``)."""
    return template.format(**config.promql_params())


def _catalog(name: str, config: Config) -> tuple[str, str]:
    spec = SERIES[name]
    return series_name(spec.name, config), spec.meaning


#: The host part of a target's ``instance`` label (``host:port``, ``[v6]:port`` or a bare host).
HOST = ("instance", "(.*?)(?::[0-9]+)?")


def with_host(expr: str) -> str:
    """``expr`` with a ``host`` label: its ``instance``'s host part (``HOST``)."""
    return f'label_replace({expr}, "host", "$1", "{HOST[0]}", "{HOST[1]}")'


#: LMCache's hit share per tier target, with the target's host (the rates layer).
LMCACHE_SHARE = "target:kvdiag_lmcache_hit:share{window}"


def lmcache_joined(lbl: Labels, share: str) -> str:
    """The per-target ``share`` on the engine instances it belongs to: on the engine's own
    /metrics, the engine's (the adapter reads it there); else as ``kvdiag.window.join_tier``
    joins a tier target, the instances serving its model on its host, and where no tier is on an
    instance's host, the one tier target of that model (a target of its own)."""
    key = "by (" + ", ".join(lbl.key) + ")"
    server = ", ".join(lbl.server)
    on_host = f"max by (host, {lbl.model}) ({share})"
    own = f"{share} unless on ({', '.join(lbl.target)}) {INSTANCE_INFO}"
    lone = f"max by ({lbl.model}) ({own}) and on ({lbl.model}) (count by ({lbl.model}) ({own}) == 1)"
    return first(
        f"max {key} ({share} + on ({server}) group_right () (0 * {INSTANCE_INFO}))",
        f"max {key} (({on_host}) + on (host, {lbl.model}) group_right () (0 * {with_host(INSTANCE_INFO)}))",
        f"max {key} (({lone}) + on ({lbl.model}) group_right () (0 * {INSTANCE_INFO}))",
    )


#: The rule groups of the normalization, in layer order (the first layer in three groups that
#: read only engine series): each later layer takes windows only over what an earlier one
#: recorded (never a subquery), so Prometheus can evaluate each group on its own clock and a
#: group's cost does not grow with the window.
INSTANT, TOKENS, TTFT = "kvdiag-instance", "kvdiag-instance-tokens", "kvdiag-instance-ttft"
RATES, USAGE = "kvdiag-rates", "kvdiag-usage"


def _part_ratio(part: str, whole: str, w: str) -> str:
    """``rate(part) / rate(whole)`` over recorded totals from which the first layer already
    left out the scrapes where the part exceeds its whole (``_kept``), and no figure where the
    part rose more than its whole over the window (the window's rule, ``Window._within``;
    max - min is the rise of a counter that did not restart in the window)."""
    def rise(x: str) -> str:
        return f"(max_over_time({x}[{w}]) - min_over_time({x}[{w}]))"
    return f"(rate({part}[{w}]) / rate({whole}[{w}])) unless ({rise(part)} > {rise(whole)})"


def _kept(lbl: Labels, part: str, whole: str) -> tuple[str, str]:
    """The (part, whole) totals of one scrape, both left out where the part exceeds its whole
    (the adapters drop both fields of such a scrape: SGLang's tokenizer counts cached tokens
    at the first token and prompt tokens at the finish, so early on the cached count is ahead)."""
    on = f"on ({', '.join(lbl.key)})"
    bad = f"(({part}) > {on} ({whole}))"
    return f"({part}) unless {on} {bad}", f"({whole}) unless {on} {bad}"


def _instant(config: Config, lbl: Labels) -> list[tuple[str, list[Recording]]]:
    """Layer 1: each instance's figures from one scrape (instant selectors and aggregations):
    gauges, and counters' and histogram buckets' totals, as the adapters read a scrape.
    SGLang's tokenizer series are server-wide: they are recorded per server (``server:``)
    and the rates layer copies their figures onto the server's instances.

    Three groups, which Prometheus evaluates concurrently (a group's rules run one after the
    other): the pool and queue figures (``INSTANT``; its later rules read its earlier ones at
    the same instant), the token and byte counters (``TOKENS``) and the TTFT histograms
    (``TTFT``), the two largest reads of a fleet's series."""
    out: dict[str, list[Recording]] = {INSTANT: [], TOKENS: [], TTFT: []}
    group = INSTANT

    def add(record: str, expr: str, meaning: str = "") -> str:
        """Record ``expr`` in ``group``; a catalog series takes its name and meaning from the catalog."""
        if record in SERIES:
            record, meaning = _catalog(record, config)
        out[group].append(Recording(record, expr, meaning))
        return record

    # The instance list: one per data-parallel engine that reports scheduler metrics (the
    # adapters' SIGNATURE families). Everything server-wide is copied onto these.
    signature = " or ".join(sel(f) for f in sglang.SIGNATURE + vllm.SIGNATURE)
    add(INSTANCE_INFO, f"group {lbl.by()} ({signature})",
        "1 per engine instance (data-parallel engine) that reports scheduler metrics")
    # vLLM writes its usage gauge per process (a pid label) without a multiprocess mode: kept
    # per writer here, and read as the writer that changed last by the usage layer.
    vllm_usage = [f"max {lbl.by('pid')} ({sel(V + name)})" for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc")]
    add(USAGE_BY_WRITER, first(
        f"max {lbl.by('pid')} ({sel(S + 'token_usage')})",
        vllm_usage[0],
        f"{vllm_usage[1]} unless on ({', '.join(lbl.key)}) {vllm_usage[0]}",
    ), "KV usage 0-1 per writing process (pid), max over TP ranks; a single series where the engine has one writer")
    # Every queued request of the role: SGLang's waiting queue plus the PD queues (exported as 0
    # outside their role, so adding them all is the role's sum; a prefill's inflight queue is
    # prefilled work, not waiting); vLLM's gauge already holds waiting + deferred.
    main_queue = gauge(lbl, S + "num_queue_reqs")
    pd_queues = [
        first(*(gauge(lbl, name) for name in names))
        for names, _, kind, role in sglang.QUEUES
        if role is not None and kind != "in_flight"
    ]
    add("instance:kvdiag_waiting:requests", first(
        " + ".join([main_queue] + [f"({q}\nor 0 * {main_queue})" for q in pd_queues]),
        gauge(lbl, V + "num_requests_waiting"),
    ))
    running = add("instance:kvdiag_running:requests",
                  first(gauge(lbl, S + "num_running_reqs"), gauge(lbl, V + "num_requests_running")))

    # Evictions. SGLang's counter is only created at the first retraction (multiprocess
    # registry), so on versions that have it (>= 0.5.7, told by families only they export)
    # its absence reads as 0 and the first retraction counts: "counter, else the 0.4.10-0.5.2
    # cumulative gauge, else 0". The last-event gauge sglang:num_retracted_reqs is never read.
    # (those families are gauges and counters alike: match the sample name with or without _total)
    has_counter = " or ".join(sel(f, "(_total)?") for f in sglang.HAS_RETRACT_COUNTER)
    add(EVICTIONS_TOTAL, first(
        counter_total(lbl, S + "num_retracted_requests"),
        gauge(lbl, S + "total_retracted_reqs"),
        f"0 * group {lbl.by()} ({has_counter})",
        counter_total(lbl, V + "num_preemptions"),
    ), "retracted / preempted requests so far (the counter the eviction rates are taken over)")

    # TTFT buckets: SGLang's from the tokenizer process (server-wide), vLLM's per engine.
    group = TTFT
    ttft = S + "time_to_first_token_seconds"
    add(server(TTFT_BUCKETS), counter_total(lbl, ttft, partitions=STREAM, suffix="_bucket", extra=("le",)),
        "first tokens so far by TTFT bucket (le), per server (SGLang's tokenizer)")
    add(TTFT_BUCKETS, counter_total(lbl, V + "time_to_first_token_seconds", suffix="_bucket", extra=("le",)),
        "first tokens so far by TTFT bucket (le), per engine")

    group = TOKENS
    # Prefix hits (L1) from counters, never the per-batch cache_hit_rate gauge. SGLang: the
    # scheduler's per-engine split when present (0.5.20+), else the tokenizer's cached tokens
    # (device source where labelled) over prompt tokens. vLLM: prefix_cache_* (0.9.2+), else
    # the legacy gpu_prefix_cache_* (0.8.x counted blocks; the ratio holds).
    eff = S + "prefill_effective_tokens"
    eff_all = counter_total(lbl, eff, partitions=("mode",))
    hits, queries = _kept(lbl, first(
        counter_total(lbl, eff, 'mode="device_hit"'),
        counter_total(lbl, V + "prefix_cache_hits"),
        counter_total(lbl, V + "gpu_prefix_cache_hits"),
    ), first(eff_all, counter_total(lbl, V + "prefix_cache_queries"), counter_total(lbl, V + "gpu_prefix_cache_queries")))
    add(PREFIX_HITS, hits, "prefix-cache hit tokens so far (where they exceed the queried tokens, neither is recorded)")
    add(PREFIX_QUERIES, queries, "prefix-cache queried tokens so far")
    cached, prompt = S + "cached_tokens", counter_total(lbl, S + "prompt_tokens", partitions=STREAM)
    device, host = 'cache_source="device"', 'cache_source="host"'
    hits, queries = _kept(lbl, first(
        counter_total(lbl, cached, device, STREAM),
        counter_total(lbl, cached, "", STREAM + ("cache_source",)),
    ), prompt)
    add(server(PREFIX_HITS), hits, "cached prompt tokens so far, per server (SGLang's tokenizer; device source where labelled)")
    add(server(PREFIX_QUERIES), queries, "prompt tokens so far, per server, where the cached ones do not exceed them")
    # vLLM V0 has only a hit-rate gauge: the rates layer takes its mean over the window
    add(PREFIX_HIT_GAUGE, gauge(lbl, V + "gpu_prefix_cache_hit_rate"), "the hit-rate gauge of an engine without hit counters")

    # L2 (SGLang HiCache host tier; vLLM exports no L2 occupancy: kv_offload_cpu_cache_usage_perc
    # is the share pinned by transfers).
    add("instance:kvdiag_l2_usage:ratio", f"{gauge(lbl, S + 'hicache_host_used_tokens')} / {gauge(lbl, S + 'hicache_host_total_tokens')}")
    add(L2_HITS, first(
        counter_total(lbl, eff, 'mode="host_hit"'),
        counter_total(lbl, V + "prompt_tokens_cached_by_source", 'source="host"'),
    ), "prompt tokens served from the host tier (L2) so far (a share of the queried tokens)")
    add(server(L2_HITS), counter_total(lbl, cached, host, STREAM),
        "prompt tokens served from the host tier (L2) so far, per server (a share of the prompt tokens)")
    # LMCache's own series, per target (they carry no engine label and reach Prometheus on the
    # vLLM server's /metrics or on a target of their own); the model is the served name, else
    # the model name; workers (TP ranks) count the same tokens, so the max is taken.
    by = "by (" + ", ".join(lbl.target + (lbl.model, "host")) + ")"

    def tier_total(family: str) -> str:
        total = f'label_replace({sel(family, "_total")}, "{lbl.model}", "$1", "served_model_name", "(.+)")'
        return f"max {by} ({with_host(total)})"

    add(LMCACHE_HITS, tier_total(lmcache.HITS), "LMCache's retrieved tokens so far, per target, with the target's host")
    add(LMCACHE_LOOKUPS, first(*(tier_total(name) for name, _ in lmcache.QUERIES)),
        "tokens looked up in LMCache so far (else its retrieve requests' tokens), per target")

    # L2 traffic: SGLang HiCache load-back / backup bytes (radix-cache series: no model label),
    # vLLM offloading's load / store bytes, else the deprecated total_bytes by transfer_type.
    # SGLang's radix-cache series carry dp_rank="0" even without data parallelism, where its
    # scheduler series (hence the instance) have no dp_rank: such a server's instance takes
    # them by target alone, as the adapter gives an unsplit instance every sample.
    split_by = "by (" + ", ".join(lbl.target + lbl.split) + ")"
    target_by = "by (" + ", ".join(lbl.target) + ")"
    for name, sglang_family, vllm_family, legacy, what in (
        (L2_LOAD_BYTES, "load_back_bytes", "kv_offload_load_bytes", "CPU_to_GPU", "copied back from L2 into L1"),
        (L2_STORE_BYTES, "hicache_backup_bytes", "kv_offload_store_bytes", "GPU_to_CPU", "copied from L1 into L2"),
    ):
        radix = sel(S + sglang_family, "_total")
        add(name, first(
            with_model(lbl, f"max {split_by} ({radix})"),
            with_model(lbl, f"max {target_by} ({radix})"),
            counter_total(lbl, V + vllm_family),
            counter_total(lbl, V + "kv_offload_total_bytes", f'transfer_type="{legacy}"'),
        ), f"bytes {what} so far")

    group = INSTANT
    # Capacity in tokens. SGLang: max_total_num_tokens (0.5.6+), else num_used / token_usage.
    # vLLM: cache_config_info labels: kv_cache_size_tokens per engine (~0.25+), else
    # (num_gpu_blocks / engines of the server - the null block) x block_size, since
    # num_gpu_blocks is summed over the server's DP engines.
    info = V + "cache_config_info"
    per_server = "count by (" + ", ".join(lbl.target) + f") ({sel(info)})"
    blocks = f"({label_value(lbl, info, 'num_gpu_blocks')}) / on ({', '.join(lbl.target)}) group_left () {per_server}"
    capacity = add(CAPACITY, first(
        gauge(lbl, S + "max_total_num_tokens"),
        f"{gauge(lbl, S + 'num_used_tokens')} / ({gauge(lbl, S + 'token_usage')} > 0)",
        with_model(lbl, first(
            label_value(lbl, info, "kv_cache_size_tokens"),
            f"({blocks} - 1) * on ({', '.join(lbl.target + lbl.split)}) ({label_value(lbl, info, 'block_size')})",
        )),
    ), "KV pool (L1) capacity in tokens")

    # The three pool states where the engine reports them apart (SGLang 0.5.11+); vLLM folds
    # evictable into free, so only "used" (usage x capacity, block granularity; usage as the
    # max over writing processes) exists there.
    states = [
        f'label_replace({gauge(lbl, S + "kv_" + state + "_tokens")}, "state", "{state}", "__name__", ".*")'
        for state in ("used", "evictable", "available")
    ]
    add("instance:kvdiag_kv_pool:tokens", first(
        " or ".join(states),
        f'label_replace({gauge(lbl, S + "num_used_tokens")}, "state", "used", "__name__", ".*")',
        f'label_replace(max {lbl.by()} ({USAGE_BY_WRITER}) * on ({", ".join(lbl.key)}) {capacity}, "state", "used", "__name__", ".*")',
    ), "KV pool tokens by state (used | evictable | available), as reported")

    # Every queue apart (the exporter's kvdiag_queue_requests): SGLang's waiting queue and PD
    # queues (0 outside their role), vLLM's waiting by reason and its KV-fetch stages, each
    # named as the adapters name it and tagged with what it waits for.
    queues = [tagged(first(*(gauge(lbl, n) for n in names)), queue=title.split(" (")[0], kind=kind)
              for names, title, kind, _ in sglang.QUEUES]
    queues += [tagged(gauge(lbl, V + "num_requests_waiting_by_reason", f'reason="{kind}"'), queue=title, kind=kind)
               for kind, title in (("capacity", "waiting for scheduling capacity"), ("deferred", "deferred"))]
    queues += [tagged(gauge(lbl, V + "num_requests_kv_fetch_by_stage", f'stage="{st}"'), queue=f"KV fetch {st.replace('_', ' ')}", kind="in_flight")
               for st in vllm.FETCH_STAGES]
    add("instance:kvdiag_queue:requests", "\nor ".join(queues),
        "requests in each queue (queue: the adapters' name) by what they wait for (kind: capacity | deferred | in_flight)")
    # Each pool of a hybrid model with its own usage (SGLang: full attention, sliding window,
    # Mamba states; the engine exports each as 0 where the model has no such pool).
    add("instance:kvdiag_kv_pool_usage:ratio", "\nor ".join(tagged(gauge(lbl, S + family), pool=kind) for family, kind in
                                                          (("full_token_usage", "full"), ("swa_token_usage", "swa"), ("mamba_usage", "mamba"))),
        "usage of each KV pool (pool: full | swa | mamba), 0 where the model has no such pool")

    group = TOKENS
    # Tokens and finished requests so far, for the per-request averages.
    for name, family, what in ((PROMPT_TOKENS, "prompt_tokens", "input tokens"), (OUTPUT_TOKENS, "generation_tokens", "output tokens")):
        add(server(name), counter_total(lbl, S + family, partitions=STREAM), f"{what} so far, per server (SGLang's tokenizer)")
        add(name, counter_total(lbl, V + family), f"{what} so far, per engine")
    add(server(REQUESTS), counter_total(lbl, S + "num_requests", partitions=STREAM), "finished requests so far, per server (SGLang's tokenizer)")
    add(REQUESTS, counter_total(lbl, V + "request_success", partitions=("finished_reason",)), "finished requests so far, per engine")

    group = INSTANT
    # What admission holds back (kvdiag/checks/admission.py): SGLang's output reserve ratio, the
    # decode role and the requests a decode instance is receiving.
    add(DECODE_RESERVE, gauge(lbl, S + "new_token_ratio"),
        "share of running requests' remaining output that admission holds back, where reported")

    # A decode instance (SGLang's engine_type="decode"; where the label is missing, a decode PD
    # queue holding work and no prefill one) preallocates a transferred prompt whole.
    def pd_queues_busy(role: str) -> str:
        return " or ".join(f"{gauge(lbl, n)} > 0" for names, _, _, r in sglang.QUEUES if r == role for n in names)

    def scheduler(matchers: str) -> str:
        return f"group {lbl.by()} ({sel(S + 'num_running_reqs', '', matchers)} or {sel(S + 'num_queue_reqs', '', matchers)})"

    labelled = scheduler('engine_type!=""')
    add(DECODE_ROLE, first(
        scheduler('engine_type="decode"'),
        f"group {lbl.by()} ({pd_queues_busy('decode')}) unless {labelled}"
        f" unless group {lbl.by()} ({pd_queues_busy('prefill')})",
    ), "1 per instance in SGLang's decode role (disaggregated serving)")
    add(TRANSFERRING, " + ".join(f"({first(*(gauge(lbl, n) for n in names))} or 0 * {running})"
                                 for names, _, kind, r in sglang.QUEUES if r is not None and kind == "deferred"),
        "requests whose KV is being transferred to the instance (SGLang's PD queues), 0 outside disaggregation")
    return list(out.items())


def _rates(config: Config, lbl: Labels) -> list[Recording]:
    """Layer 2: windows (rate, increase, *_over_time) over the first layer's series, and what
    follows from them at the same instant (per-request averages, the concurrency ceiling)."""
    p = config.promql_params()
    w, q = p["window"], f"{config.ttft_quantile:g}"
    out: list[Recording] = []

    def add(catalog_name: str | None, expr: str, record: str = "", meaning: str = "") -> str:
        if catalog_name is not None:
            record, meaning = _catalog(catalog_name, config)
        out.append(Recording(record, expr, meaning))
        return record

    # When each writing process last changed its usage (the usage layer picks the newest).
    add(None, f"timestamp({USAGE_BY_WRITER}) and (idelta({USAGE_BY_WRITER}[{w}]) != 0)", USAGE_CHANGED,
        "when a writing process's usage changed (the evaluation that saw the change)")
    # The window's rate (dashboards, evidence) and the recent span's, which E fires on.
    for name, span in (("{window}", w), ("{evictions_recent_window}", p["evictions_recent_window"])):
        if name == "{window}" or span != w:
            add("instance:kvdiag_evictions:rate" + name, f"rate({EVICTIONS_TOTAL}[{span}])")

    def per_server(instance_expr: str, server_expr: str) -> str:
        """The engine's own figure, else its server's copied onto it (``broadcast``)."""
        return first(instance_expr, broadcast(lbl, server_expr))

    def buckets(name: str) -> str:
        return f"histogram_quantile({q}, rate({name}[{w}]))"

    def count(name: str) -> str:
        return f'max {lbl.by()} (increase({name}{{le="+Inf"}}[{w}]))'

    add("instance:kvdiag_ttft_seconds:p99_{window}", per_server(buckets(TTFT_BUCKETS), buckets(server(TTFT_BUCKETS))))
    add("instance:kvdiag_ttft_requests:increase{window}", per_server(count(TTFT_BUCKETS), count(server(TTFT_BUCKETS))))
    hit = add("instance:kvdiag_prefix_hit:ratio{window}", first(
        _part_ratio(PREFIX_HITS, PREFIX_QUERIES, w),
        broadcast(lbl, _part_ratio(server(PREFIX_HITS), server(PREFIX_QUERIES), w)),
        # vLLM V0 has only a hit-rate gauge: its mean over the window (the Python check's fallback)
        f"avg_over_time({PREFIX_HIT_GAUGE}[{w}])",
    ))
    # LMCache's share per target, then joined to the vLLM instances it belongs to.
    tier_share = add(None, f"rate({LMCACHE_HITS}[{w}]) / rate({LMCACHE_LOOKUPS}[{w}])", series_name(LMCACHE_SHARE, config),
                     "LMCache's hit share (tokens retrieved over tokens looked up) per target, with the target's host")
    add("instance:kvdiag_l2_hit:share{window}", first(
        lmcache_joined(lbl, tier_share),
        per_server(f"rate({L2_HITS}[{w}]) / rate({PREFIX_QUERIES}[{w}])",
                   f"rate({server(L2_HITS)}[{w}]) / rate({server(PROMPT_TOKENS)}[{w}])"),
    ))
    add("instance:kvdiag_l2_load_bytes:rate{window}", f"rate({L2_LOAD_BYTES}[{w}])")
    add("instance:kvdiag_l2_store_bytes:rate{window}", f"rate({L2_STORE_BYTES}[{w}])")

    # Tokens per finished request (input, output, their sum) and the concurrency ceiling of the
    # private footprint (kvdiag/checks/remedies.py): the cached share of the prompt is a shared
    # prefix, held once, so (pool - shared) / (input + output - shared).
    def per_request(name: str) -> str:
        return per_server(_per_request(name, w), _per_request(server(name), w, server(REQUESTS)))

    prompt_avg = add(None, per_request(PROMPT_TOKENS), f"instance:kvdiag_prompt_tokens:avg{w}", "input tokens per finished request")
    output_avg = add(None, per_request(OUTPUT_TOKENS), f"instance:kvdiag_output_tokens:avg{w}", "output tokens per finished request")
    seq = add(None, f"{prompt_avg} + {output_avg}", f"instance:kvdiag_sequence_tokens:avg{w}",
              "average input + output tokens per finished request")
    shared = add(None, f"({prompt_avg} * {hit} or 0 * {prompt_avg})", f"instance:kvdiag_shared_prefix_tokens:avg{w}",
                 "cached prompt tokens per finished request (prompt x hit ratio): a shared prefix, held once")
    add(None, f"floor(clamp_min({CAPACITY} - {shared}, 0) / (({seq} - {shared}) > 0))",
        f"instance:kvdiag_concurrency_ceiling:requests{w}",
        "concurrency ceiling: (pool tokens - the shared prefix) / private tokens per request (uncached input + output)")
    return out


def _per_request(tokens: str, w: str, requests: str = "") -> str:
    """Tokens per finished request over the window (nothing where no request finished)."""
    return f"rate({tokens}[{w}]) / (rate({requests or REQUESTS}[{w}]) > 0)"


def _usage(config: Config, lbl: Labels) -> list[Recording]:
    """Layer 3: the usage gauge as its most recent writer, and what admission counts as taken."""
    w = config.promql_params()["window"]
    key = ", ".join(lbl.key)
    out: list[Recording] = []

    def add(catalog_name: str, expr: str) -> str:
        record, meaning = _catalog(catalog_name, config)
        out.append(Recording(record, expr, meaning))
        return record

    # A gauge written per process read as the process whose value changed most recently
    # (``kvdiag.window.resolve_writers``): the newest change in the window wins, ties take the
    # max; where no process changed in the window, the max over processes (ambiguous, as in Python).
    changed = f"max_over_time({USAGE_CHANGED}[{w}])"
    newest = f"{changed} == on ({key}) group_left () (max {lbl.by()} ({changed}))"
    usage = add("instance:kvdiag_kv_usage:ratio", first(
        f"max {lbl.by()} ({USAGE_BY_WRITER} and on ({key}, pid) ({newest}))",
        f"max {lbl.by()} ({USAGE_BY_WRITER})",
    ))

    # Admission usage (kvdiag/checks/admission.py): usage + what the next admission needs, the
    # uncached prompt, and where the engine reserves output (SGLang's new_token_ratio) the next
    # request's output plus ratio x output for every running request, output clipped as the
    # engine clips it; usage where an input is missing.
    running = _catalog("instance:kvdiag_running:requests", config)[0]
    hit = _catalog("instance:kvdiag_prefix_hit:ratio{window}", config)[0]
    prompt_avg, output_avg = f"instance:kvdiag_prompt_tokens:avg{w}", f"instance:kvdiag_output_tokens:avg{w}"
    prompt_need = f"{prompt_avg} * (1 - {hit})"
    charged = f"clamp_max({output_avg}, {sglang.OUTPUT_RESERVE_CLIP})"
    output_need = f"({charged} * (1 + {DECODE_RESERVE} * {running}) or 0 * {prompt_need})"
    # vLLM reads its usage gauge after the step's frees, which the next admission refills: one
    # step frees usage / (output - 1 + chunks - 1) of the pool, chunks = the steps its uncached
    # prompt takes at the default step budget (nothing where a request lives one step). The
    # output is the engine's own (per-engine counters: vLLM's; SGLang's are server-wide).
    chunks = f"clamp_min(ceil({prompt_need} / {vllm.PREFILL_CHUNK_TOKENS}) - 1, 0)"
    freed = f"({usage} / ((({_per_request(OUTPUT_TOKENS, w)}) - 1 > 0) + {chunks}) or 0 * {prompt_need})"
    # A decode instance preallocates a transferred prompt whole and keeps DECODE_RESERVED_TOKENS
    # per running, transferring and next request, no output reserve.
    decode_need = (f"({prompt_avg} + {sglang.DECODE_RESERVED_TOKENS} * ({running} + {TRANSFERRING} + 1)) / {CAPACITY}"
                   f" and on ({key}) {DECODE_ROLE}")
    need = add("instance:kvdiag_kv_admission_need:ratio{window}", first(
        decode_need,
        f"(({prompt_need} + {output_need}) / {CAPACITY} + {freed}) >= 0",  # >= 0 drops NaN (0/0) and -Inf
        f"0 * {usage}",
    ))
    add("instance:kvdiag_kv_admission_usage:ratio{window}", f"clamp_max({usage} + {need}, 1)")
    return out


def layers(config: Config, lbl: Labels = Labels()) -> list[tuple[str, list[Recording]]]:
    """The normalization's rule groups, in layer order (the first layer's ``INSTANT``, ``TOKENS``
    and ``TTFT``, then ``RATES``, ``USAGE``)."""
    return _instant(config, lbl) + [(RATES, _rates(config, lbl)), (USAGE, _usage(config, lbl))]


def server(record: str) -> str:
    """The server-level twin of an instance-level recorded name (SGLang's tokenizer series)."""
    return "server:" + record.split(":", 1)[1]


# First-layer series that only later layers read (the catalog's series are named in SERIES).
USAGE_BY_WRITER = "instance_pid:kvdiag_kv_usage:ratio"
USAGE_CHANGED = "instance_pid:kvdiag_kv_usage:changed_timestamp"
EVICTIONS_TOTAL = "instance:kvdiag_evictions:total"
TTFT_BUCKETS = "instance:kvdiag_ttft_seconds_bucket:total"
PREFIX_HITS = "instance:kvdiag_prefix_hit_tokens:total"
PREFIX_QUERIES = "instance:kvdiag_prefix_query_tokens:total"
PREFIX_HIT_GAUGE = "instance:kvdiag_prefix_hit_gauge:ratio"
L2_HITS = "instance:kvdiag_l2_hit_tokens:total"
LMCACHE_HITS = "target:kvdiag_lmcache_hit_tokens:total"
LMCACHE_LOOKUPS = "target:kvdiag_lmcache_lookup_tokens:total"
L2_LOAD_BYTES = "instance:kvdiag_l2_load_bytes:total"
L2_STORE_BYTES = "instance:kvdiag_l2_store_bytes:total"
CAPACITY = "instance:kvdiag_kv_capacity:tokens"
PROMPT_TOKENS = "instance:kvdiag_prompt_tokens:total"
OUTPUT_TOKENS = "instance:kvdiag_output_tokens:total"
REQUESTS = "instance:kvdiag_requests:total"
DECODE_RESERVE = "instance:kvdiag_decode_reserve:ratio"
DECODE_ROLE = "instance:kvdiag_decode_role:info"
TRANSFERRING = "instance:kvdiag_transferring:requests"
