"""The engine adapters' normalization, written as Prometheus recording rules.

Each rule produces one engine-neutral ``instance:kvdiag_*`` series from ``sglang:*`` /
``sglang_*`` / ``vllm:*`` / ``vllm_*`` series, choosing the same metric, the same fallbacks and
the same topology handling as ``kvdiag/engines/sglang.py`` and ``vllm.py`` (this module is the
PromQL twin of those two files; when an adapter changes, change the matching source here).
The checklist's series (``kvdiag.checks.catalog.SERIES``) are all produced here; the other
series feed the dashboards (the three pool states, capacity, the concurrency ceiling).
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
    counter_increase,
    counter_rate,
    counter_total,
    summed_rate,
    first,
    gauge,
    histogram_rate,
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


def _part_ratio(part: str, whole: str, w: str) -> str:
    """``rate(part) / rate(whole)`` over the scrapes where the part does not exceed its whole.

    The adapters drop both fields of a scrape whose part exceeds its whole (SGLang's tokenizer
    counts cached tokens at the first token and prompt tokens at the finish, so early on the
    cached count can be ahead), and rate the counters over the scrapes that remain: the same
    scrapes are kept here, by a subquery over the summed counters. Where the part rose more than
    its whole over the window (a ratio above 1), the window leaves the part out: no ratio here."""
    bad = f"({part}) > ({whole})"
    kept_part, kept_whole = f"(({part}) unless ({bad}))[{w}:]", f"(({whole}) unless ({bad}))[{w}:]"
    # a part that rose more than its whole over the window is no figure there (the window's rule;
    # max - min is the rise of a counter that did not restart in the window)
    outgrew = f"max_over_time({kept_part}) - min_over_time({kept_part}) > max_over_time({kept_whole}) - min_over_time({kept_whole})"
    return f"(rate({kept_part}) / rate({kept_whole})) unless ({outgrew})"


def latest_writer(lbl: Labels, family: str, w: str) -> str:
    """A gauge written per process (a ``pid`` label, no multiprocess mode) read as the process
    whose value changed most recently (``kvdiag.window.resolve_writers``): per pid, the last
    scrape in the window where ``idelta`` saw a change; the newest wins, ties take the max; where
    no process changed in the window, the max over processes (ambiguous, as in Python)."""
    series = sel(family)
    changed = f"max_over_time((timestamp({series}) and (idelta({series}[{w}]) != 0))[{w}:])"
    by = lbl.by()
    newest = f"{changed} == on ({', '.join(lbl.key)}) group_left () (max {by} ({changed}))"
    return first(f"max {by} ({series} and on ({', '.join(lbl.key)}, pid) ({newest}))", gauge(lbl, family))


#: The host part of a target's ``instance`` label (``host:port``, ``[v6]:port`` or a bare host).
HOST = ("instance", "(.*?)(?::[0-9]+)?")


def with_host(expr: str) -> str:
    """``expr`` with a ``host`` label: its ``instance``'s host part (``HOST``)."""
    return f'label_replace({expr}, "host", "$1", "{HOST[0]}", "{HOST[1]}")'


#: LMCache's hit share per tier target, with the target's host (``lmcache_target_share``).
LMCACHE_SHARE = "target:kvdiag_lmcache_hit:share{window}"


def lmcache_target_share(lbl: Labels, w: str) -> str:
    """LMCache's hit share per target and model, with a ``host`` label (``with_host``).

    Its series carry no engine label and reach Prometheus on the vLLM server's own /metrics (a
    shared multiprocess directory) or on a target of their own (another port). The model is the
    served name, else the model name; the share is the tokens it retrieved over every token
    looked up in it, else over the retrieve requests where a version counts no lookups
    (``lmcache.QUERIES``); workers (TP ranks) count the same tokens, so the max is taken."""
    by = "by (" + ", ".join(lbl.target + (lbl.model, "host")) + ")"

    def tier_rate(family: str) -> str:
        rate = f'label_replace(rate({sel(family, "_total")}[{w}]), "{lbl.model}", "$1", "served_model_name", "(.+)")'
        return f"max {by} ({with_host(rate)})"

    return f"{tier_rate(lmcache.HITS)} / ({first(*(tier_rate(name) for name, _ in lmcache.QUERIES))})"


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


def recordings(config: Config, lbl: Labels = Labels()) -> list[Recording]:
    """Every normalization rule, in dependency order (Prometheus evaluates a group in order)."""
    w = config.promql_params()["window"]
    q = f"{config.ttft_quantile:g}"
    out: list[Recording] = []

    def add(catalog_name: str | None, expr: str, record: str = "", meaning: str = "") -> str:
        if catalog_name is not None:
            record, meaning = _catalog(catalog_name, config)
        out.append(Recording(record, expr, meaning))
        return record

    # The instance list: one per data-parallel engine that reports scheduler metrics (the
    # adapters' SIGNATURE families). Everything server-wide is copied onto these.
    signature = " or ".join(sel(f) for f in sglang.SIGNATURE + vllm.SIGNATURE)
    add(None, f"group {lbl.by()} ({signature})", INSTANCE_INFO,
        "1 per engine instance (data-parallel engine) that reports scheduler metrics")

    usage = add("instance:kvdiag_kv_usage:ratio", first(
        gauge(lbl, S + "token_usage"),
        latest_writer(lbl, V + "kv_cache_usage_perc", w),
        latest_writer(lbl, V + "gpu_cache_usage_perc", w),
    ))
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
    add("instance:kvdiag_running:requests", first(gauge(lbl, S + "num_running_reqs"), gauge(lbl, V + "num_requests_running")))

    # Evictions. SGLang's counter is only created at the first retraction (multiprocess
    # registry), so on versions that have it (>= 0.5.7, told by families only they export)
    # its absence reads as 0 and the first retraction counts: the rate runs over a subquery of
    # "counter, else the 0.4.10-0.5.2 cumulative gauge, else 0". The last-event gauge
    # sglang:num_retracted_reqs is never read.
    # (those families are gauges and counters alike: match the sample name with or without _total)
    has_counter = " or ".join(sel(f, "(_total)?") for f in sglang.HAS_RETRACT_COUNTER)
    sglang_evictions = first(
        f"max {lbl.by()} ({sel(S + 'num_retracted_requests', '_total')})",
        f"max {lbl.by()} ({sel(S + 'total_retracted_reqs')})",
        f"0 * group {lbl.by()} ({has_counter})",
    )
    # The window's rate (dashboards, evidence) and the recent span's, which E fires on.
    for name, span in (("{window}", w), ("{evictions_recent_window}", config.promql_params()["evictions_recent_window"])):
        if name == "{window}" or span != w:
            add("instance:kvdiag_evictions:rate" + name, first(
                f"rate(({sglang_evictions})[{span}:])",
                counter_rate(lbl, V + "num_preemptions", span),
            ))

    # TTFT: SGLang's comes from the tokenizer process (server-wide), vLLM's per engine.
    ttft_buckets = f"{histogram_rate(lbl, S + 'time_to_first_token_seconds', w, STREAM)}"
    add("instance:kvdiag_ttft_seconds:p99_{window}", first(
        broadcast(lbl, f"histogram_quantile({q}, {ttft_buckets})"),
        f"histogram_quantile({q}, {histogram_rate(lbl, V + 'time_to_first_token_seconds', w)})",
    ))
    add("instance:kvdiag_ttft_requests:increase{window}", first(
        broadcast(lbl, counter_increase(lbl, S + "time_to_first_token_seconds", w, "_count", STREAM)),
        counter_increase(lbl, V + "time_to_first_token_seconds", w, "_count"),
    ))

    # Prefix hits (L1) from counters, never the per-batch cache_hit_rate gauge. SGLang: the
    # scheduler's per-engine split when present (0.5.20+), else the tokenizer's cached tokens
    # (device source where labelled) over prompt tokens. vLLM: prefix_cache_* (0.9.2+), else
    # the legacy gpu_prefix_cache_* (0.8.x counted blocks; the ratio holds).
    eff = S + "prefill_effective_tokens"
    eff_all = summed_rate(lbl, eff, w, partitions=("mode",))
    prompt = counter_rate(lbl, S + "prompt_tokens", w, partitions=STREAM)
    cached = S + "cached_tokens"
    device, host = 'cache_source="device"', 'cache_source="host"'
    eff_device = counter_rate(lbl, eff, w, 'mode="device_hit"')
    eff_host = counter_rate(lbl, eff, w, 'mode="host_hit"')
    add("instance:kvdiag_prefix_hit:ratio{window}", first(
        f"{eff_device} / {eff_all}",
        broadcast(lbl, first(
            _part_ratio(counter_total(lbl, cached, device, STREAM), counter_total(lbl, S + "prompt_tokens", "", STREAM), w),
            _part_ratio(counter_total(lbl, cached, "", STREAM + ("cache_source",)),
                        counter_total(lbl, S + "prompt_tokens", "", STREAM), w),
        )),
        f"{counter_rate(lbl, V + 'prefix_cache_hits', w)} / {counter_rate(lbl, V + 'prefix_cache_queries', w)}",
        f"{counter_rate(lbl, V + 'gpu_prefix_cache_hits', w)} / {counter_rate(lbl, V + 'gpu_prefix_cache_queries', w)}",
        # vLLM V0 has only a hit-rate gauge: its mean over the window (the Python check's fallback)
        f"avg_over_time(({gauge(lbl, V + 'gpu_prefix_cache_hit_rate')})[{w}:])",
    ))

    # L2 (SGLang HiCache host tier; vLLM exports no L2 occupancy: kv_offload_cpu_cache_usage_perc
    # is the share pinned by transfers).
    add("instance:kvdiag_l2_usage:ratio", f"{gauge(lbl, S + 'hicache_host_used_tokens')} / {gauge(lbl, S + 'hicache_host_total_tokens')}")
    vllm_host = counter_rate(lbl, V + "prompt_tokens_cached_by_source", w, 'source="host"')
    # LMCache's own series joined to the vLLM instances they belong to (same host, same model).
    tier_share = add(None, lmcache_target_share(lbl, w), series_name(LMCACHE_SHARE, config),
                     "LMCache's hit share (tokens retrieved over tokens looked up) per target, with the target's host")
    add("instance:kvdiag_l2_hit:share{window}", first(
        lmcache_joined(lbl, tier_share),
        f"{eff_host} / {eff_all}",
        broadcast(lbl, f"{counter_rate(lbl, cached, w, host, STREAM)} / {prompt}"),
        f"{vllm_host}"
        f" / ({first(counter_rate(lbl, V + 'prefix_cache_queries', w), counter_rate(lbl, V + 'gpu_prefix_cache_queries', w))})",
    ))

    # L2 traffic: SGLang HiCache load-back / backup bytes (radix-cache series: no model label),
    # vLLM offloading's load / store bytes, else the deprecated total_bytes by transfer_type.
    # SGLang's radix-cache series carry dp_rank="0" even without data parallelism, where its
    # scheduler series (hence the instance) have no dp_rank: such a server's instance takes
    # them by target alone, as the adapter gives an unsplit instance every sample.
    split_by = "by (" + ", ".join(lbl.target + lbl.split) + ")"
    target_by = "by (" + ", ".join(lbl.target) + ")"
    for name, sglang_family, vllm_family, legacy in (
        ("instance:kvdiag_l2_load_bytes:rate{window}", "load_back_bytes", "kv_offload_load_bytes", "CPU_to_GPU"),
        ("instance:kvdiag_l2_store_bytes:rate{window}", "hicache_backup_bytes", "kv_offload_store_bytes", "GPU_to_CPU"),
    ):
        radix = f"rate({sel(S + sglang_family, '_total')}[{w}])"
        add(name, first(
            with_model(lbl, f"max {split_by} ({radix})"),
            with_model(lbl, f"max {target_by} ({radix})"),
            counter_rate(lbl, V + vllm_family, w),
            counter_rate(lbl, V + "kv_offload_total_bytes", w, f'transfer_type="{legacy}"'),
        ))

    # Capacity in tokens. SGLang: max_total_num_tokens (0.5.6+), else num_used / token_usage.
    # vLLM: cache_config_info labels: kv_cache_size_tokens per engine (~0.25+), else
    # (num_gpu_blocks / engines of the server - the null block) x block_size, since
    # num_gpu_blocks is summed over the server's DP engines.
    info = V + "cache_config_info"
    per_server = "count by (" + ", ".join(lbl.target) + f") ({sel(info)})"
    blocks = f"({label_value(lbl, info, 'num_gpu_blocks')}) / on ({', '.join(lbl.target)}) group_left () {per_server}"
    capacity = add(None, first(
        gauge(lbl, S + "max_total_num_tokens"),
        f"{gauge(lbl, S + 'num_used_tokens')} / ({gauge(lbl, S + 'token_usage')} > 0)",
        with_model(lbl, first(
            label_value(lbl, info, "kv_cache_size_tokens"),
            f"({blocks} - 1) * on ({', '.join(lbl.target + lbl.split)}) ({label_value(lbl, info, 'block_size')})",
        )),
    ), "instance:kvdiag_kv_capacity:tokens", "KV pool (L1) capacity in tokens")

    # The three pool states where the engine reports them apart (SGLang 0.5.11+); vLLM folds
    # evictable into free, so only "used" (usage x capacity, block granularity) exists there.
    states = [
        f'label_replace({gauge(lbl, S + "kv_" + state + "_tokens")}, "state", "{state}", "__name__", ".*")'
        for state in ("used", "evictable", "available")
    ]
    add(None, first(
        " or ".join(states),
        f'label_replace({gauge(lbl, S + "num_used_tokens")}, "state", "used", "__name__", ".*")',
        f'label_replace({usage} * on ({", ".join(lbl.key)}) {capacity}, "state", "used", "__name__", ".*")',
    ), "instance:kvdiag_kv_pool:tokens", "KV pool tokens by state (used | evictable | available), as reported")

    # Every queue apart (the exporter's kvdiag_queue_requests): SGLang's waiting queue and PD
    # queues (0 outside their role), vLLM's waiting by reason and its KV-fetch stages, each
    # named as the adapters name it and tagged with what it waits for.
    queues = [tagged(first(*(gauge(lbl, n) for n in names)), queue=title.split(" (")[0], kind=kind)
              for names, title, kind, _ in sglang.QUEUES]
    queues += [tagged(gauge(lbl, V + "num_requests_waiting_by_reason", f'reason="{kind}"'), queue=title, kind=kind)
               for kind, title in (("capacity", "waiting for scheduling capacity"), ("deferred", "deferred"))]
    queues += [tagged(gauge(lbl, V + "num_requests_kv_fetch_by_stage", f'stage="{st}"'), queue=f"KV fetch {st.replace('_', ' ')}", kind="in_flight")
               for st in vllm.FETCH_STAGES]
    add(None, "\nor ".join(queues), "instance:kvdiag_queue:requests",
        "requests in each queue (queue: the adapters' name) by what they wait for (kind: capacity | deferred | in_flight)")
    # Each pool of a hybrid model with its own usage (SGLang: full attention, sliding window,
    # Mamba states; the engine exports each as 0 where the model has no such pool).
    add(None, "\nor ".join(tagged(gauge(lbl, S + family), pool=kind) for family, kind in
                           (("full_token_usage", "full"), ("swa_token_usage", "swa"), ("mamba_usage", "mamba"))),
        "instance:kvdiag_kv_pool_usage:ratio", "usage of each KV pool (pool: full | swa | mamba), 0 where the model has no such pool")

    # Tokens per finished request (input, output, their sum) and the concurrency ceiling of the
    # private footprint (kvdiag/checks/remedies.py): the cached share of the prompt is a shared
    # prefix, held once, so (pool - shared) / (input + output - shared).
    def per_request(family: str) -> str:
        return first(
            broadcast(lbl, f"{summed_rate(lbl, S + family, w, partitions=STREAM)}"
                           f" / ({summed_rate(lbl, S + 'num_requests', w, partitions=STREAM)} > 0)"),
            f"{counter_rate(lbl, V + family, w)}"
            f" / ({summed_rate(lbl, V + 'request_success', w, partitions=('finished_reason',))} > 0)",
        )

    prompt_avg = add(None, per_request("prompt_tokens"), f"instance:kvdiag_prompt_tokens:avg{w}",
                     "input tokens per finished request")
    output_avg = add(None, per_request("generation_tokens"), f"instance:kvdiag_output_tokens:avg{w}",
                     "output tokens per finished request")
    seq = add(None, f"{prompt_avg} + {output_avg}", f"instance:kvdiag_sequence_tokens:avg{w}",
              "average input + output tokens per finished request")
    hit = _catalog("instance:kvdiag_prefix_hit:ratio{window}", config)[0]
    shared = add(None, f"({prompt_avg} * {hit} or 0 * {prompt_avg})", f"instance:kvdiag_shared_prefix_tokens:avg{w}",
                 "cached prompt tokens per finished request (prompt x hit ratio): a shared prefix, held once")
    add(None, f"floor(clamp_min({capacity} - {shared}, 0) / (({seq} - {shared}) > 0))",
        f"instance:kvdiag_concurrency_ceiling:requests{w}",
        "concurrency ceiling: (pool tokens - the shared prefix) / private tokens per request (uncached input + output)")

    # Admission usage (kvdiag/checks/admission.py): usage + what the next admission needs, the
    # uncached prompt, and where the engine reserves output (SGLang's new_token_ratio) the next
    # request's output plus ratio x output for every running request, output clipped as the
    # engine clips it; usage where an input is missing.
    reserve = add(None, gauge(lbl, S + "new_token_ratio"), "instance:kvdiag_decode_reserve:ratio",
                  "share of running requests' remaining output that admission holds back, where reported")
    running = _catalog("instance:kvdiag_running:requests", config)[0]
    prompt_need = f"{prompt_avg} * (1 - {hit})"
    charged = f"clamp_max({output_avg}, {sglang.OUTPUT_RESERVE_CLIP})"
    output_need = f"({charged} * (1 + {reserve} * {running}) or 0 * {prompt_need})"
    # vLLM reads its usage gauge after the step's frees, which the next admission refills: one
    # step frees usage / (output - 1 + chunks - 1) of the pool, chunks = the steps its uncached
    # prompt takes at the default step budget (nothing where a request lives one step).
    vllm_output = (f"{counter_rate(lbl, V + 'generation_tokens', w)}"
                   f" / ({summed_rate(lbl, V + 'request_success', w, partitions=('finished_reason',))} > 0)")
    chunks = f"clamp_min(ceil({prompt_need} / {vllm.PREFILL_CHUNK_TOKENS}) - 1, 0)"
    freed = f"({usage} / ((({vllm_output}) - 1 > 0) + {chunks}) or 0 * {prompt_need})"
    # A decode instance (SGLang's engine_type="decode"; where the label is missing, a decode PD
    # queue holding work and no prefill one) preallocates a transferred prompt whole and keeps
    # DECODE_RESERVED_TOKENS per running, transferring and next request, no output reserve.
    def pd_queues_busy(role: str) -> str:
        return " or ".join(f"{gauge(lbl, n)} > 0" for names, _, _, r in sglang.QUEUES if r == role for n in names)

    def scheduler(matchers: str) -> str:
        return f"group {lbl.by()} ({sel(S + 'num_running_reqs', '', matchers)} or {sel(S + 'num_queue_reqs', '', matchers)})"

    labelled = scheduler('engine_type!=""')
    decode = first(
        scheduler('engine_type="decode"'),
        f"group {lbl.by()} ({pd_queues_busy('decode')}) unless {labelled}"
        f" unless group {lbl.by()} ({pd_queues_busy('prefill')})",
    )
    transferring = " + ".join(f"({first(*(gauge(lbl, n) for n in names))} or 0 * {running})"
                              for names, _, kind, r in sglang.QUEUES if r is not None and kind == "deferred")
    decode_need = (f"({prompt_avg} + {sglang.DECODE_RESERVED_TOKENS} * ({running} + {transferring} + 1)) / {capacity}"
                   f" and on ({', '.join(lbl.key)}) ({decode})")
    need = add("instance:kvdiag_kv_admission_need:ratio{window}", first(
        decode_need,
        f"(({prompt_need} + {output_need}) / {capacity} + {freed}) >= 0",  # >= 0 drops NaN (0/0) and -Inf
        f"0 * {usage}",
    ))
    add("instance:kvdiag_kv_admission_usage:ratio{window}", f"clamp_max({usage} + {need}, 1)")
    return out
