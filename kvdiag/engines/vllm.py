"""vLLM: from an exposition (V0 and V1, every name generation users still run) to PoolSamples.

Version facts encoded here (shared/facts/engine-metrics.md §1):
- usage is ``1 - free_blocks / (num_gpu_blocks - 1)`` with evictable prefix-cache blocks counted
  as free: an active ratio at block granularity; ``kv_cache_usage_perc`` since 0.9.2,
  ``gpu_cache_usage_perc`` before (hidden in 0.11, gone in 0.12);
- capacity lives in ``cache_config_info`` labels: ``kv_cache_size_tokens`` per engine (~0.25+),
  else ``num_gpu_blocks`` (summed over DP engines) x ``block_size``; ``"None"`` means unset;
- prefix hits: ``prefix_cache_{queries,hits}`` counters (0.9.2+), ``gpu_prefix_cache_*`` before
  (0.8.x counted blocks, the ratio still holds), V0 only a ``gpu_prefix_cache_hit_rate`` gauge;
- the evictable share is not exported by any version;
- ``engine`` is the data-parallel engine index (0.8+); multiprocess servers add ``pid`` to
  gauges left in "all" mode (``kv_cache_usage_perc`` in 0.9.2-0.11): read as the most recent
  writer by the window, not the max;
- ``num_requests_waiting`` is waiting + deferred; ``num_requests_waiting_by_reason`` (0.20+)
  splits it into capacity (waiting for scheduling room) and deferred (its KV transfer, a LoRA
  slot, blocked); ``num_requests_kv_fetch_by_stage`` (0.33) exists only where the KV connector
  consumes KV (a PD decode instance, or a kv_both connector), so it is the role where no local
  KV tier (offloading, LMCache) is configured;
- lengths per finished request: ``request_prompt_tokens`` / ``request_generation_tokens``
  histograms (1-2-5 buckets up to max_model_len);
- recompute: ``request_num_preemptions`` histogram (0.30+, per finished request) and
  ``admission_rejections_total{reason}`` (0.33, no ``engine`` label: server-wide);
- L2: native CPU offloading exports traffic (``kv_offload_{load,store}_bytes``; 
  ``kv_offload_cpu_cache_usage_perc`` is the share pinned by transfers, not occupancy) and hits
  by source (``prompt_tokens_cached_by_source{source="host"}``, ``"disk"`` for L3); LMCache
  exports its own ``lmcache:*`` series (tokens looked up and retrieved; no capacity), which join the vLLM
  instance by model name where they share its /metrics (multiprocess mode).
"""

from __future__ import annotations

from kvdiag.engines import lmcache
from kvdiag.engines.base import Instance, Knobs, first, instance_key, members, model_name, put, put_histogram
from kvdiag.engines.base import record_writers, split_values, value
from kvdiag.exposition import Exposition, Family
from kvdiag.model import KIND_ORDER, PoolSample, Provenance, Queue

NAME = "vllm"
P = "vllm:"
LMCACHE = lmcache.P

#: The KV-fetch stages of a consumer's connector, as the engine names them.
FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")

SIGNATURE = (
    P + "num_requests_running",
    P + "num_requests_waiting",
    P + "kv_cache_usage_perc",
    P + "gpu_cache_usage_perc",
)

WANTED = SIGNATURE + (
    P + "cache_config_info",
    P + "num_preemptions",
    P + "prefix_cache_queries",
    P + "prefix_cache_hits",
    P + "gpu_prefix_cache_queries",
    P + "gpu_prefix_cache_hits",
    P + "gpu_prefix_cache_hit_rate",
    P + "external_prefix_cache_queries",
    P + "external_prefix_cache_hits",
    P + "prompt_tokens_cached_by_source",
    P + "prompt_tokens",
    P + "generation_tokens",
    P + "request_success",
    P + "time_to_first_token_seconds",
    P + "request_queue_time_seconds",
    P + "time_in_queue_requests",
    P + "inter_token_latency_seconds",
    P + "num_requests_waiting_by_reason",
    P + "num_requests_kv_fetch_by_stage",
    P + "request_num_preemptions",
    P + "request_prompt_tokens",
    P + "request_generation_tokens",
    P + "admission_rejections",
    P + "kv_offload_load_bytes",
    P + "kv_offload_store_bytes",
    P + "kv_offload_total_bytes",
    P + "kv_offload_config_info",
) + lmcache.WANTED

KNOBS = Knobs(
    admission_limit="--max-num-seqs",
    kv_dtype_fp8="--kv-cache-dtype fp8",
    tensor_parallel="--tensor-parallel-size",
    data_parallel="--data-parallel-size",
    memory_fraction="--gpu-memory-utilization",
    enable_metrics="(drop --disable-log-stats)",
    kv_pool_size="--num-gpu-blocks-override (tokens / --block-size)",
    reserve_conservativeness="",
)

ENABLE_HINT = "vLLM serves vllm:* metrics unless started with --disable-log-stats; drop that flag"

#: Admission reserves no output (it allocates blocks as tokens come), so nothing to clip.
OUTPUT_RESERVE_CLIP: int | None = None

#: The usage gauge is read after the step's finished requests free their blocks
#: (Scheduler.update_from_output: _free_request, then make_stats), and the next step's admission
#: refills that room at once: under load the gauge reads one step's frees below the pool's peak.
USAGE_AFTER_FREES = True

#: The smallest default token budget of one step (the OpenAI server's max_num_batched_tokens:
#: 2048 below 70 GiB of GPU memory, 8192 on H100/H200, 16384 from 160 GiB): an uncached prompt
#: longer than this is prefilled over several steps, so its request lives that many steps more
#: and one step frees less of the pool (the admission check's freed room).
PREFILL_CHUNK_TOKENS: int | None = 2048

#: A decode instance allocates the blocks of a transferred prompt beyond its local prefix hits,
#: as any admission does: no per-request decode reserve, so its need is the classic one.
DECODE_RESERVED_TOKENS: int | None = None


def detect(expo: Exposition) -> bool:
    return any(expo.get(name) is not None for name in SIGNATURE)


def instances(expo: Exposition, target: str) -> list[Instance]:
    core = [expo.get(n) for n in SIGNATURE]
    engines = split_values(core, "engine")
    splits = [{"engine": e} for e in engines] or [{}]
    return [Instance(instance_key(target, s), s, model_name(core, s)) for s in splits]


def normalize(expo: Exposition, target: str, ts: float) -> list[PoolSample]:
    """One PoolSample per data-parallel engine (``engine`` label) of the server."""
    insts = instances(expo, target)
    return [_sample(expo, inst, ts, len(insts)) for inst in insts]


def _sample(expo: Exposition, inst: Instance, ts: float, n_engines: int) -> PoolSample:
    split = inst.split
    ps = PoolSample(inst.key, NAME, ts, model=inst.model, labels=dict(split))
    usage_name, usage_fam = first(expo, P + "kv_cache_usage_perc", P + "gpu_cache_usage_perc")
    if put(ps, "usage_ratio", usage_name, usage_fam, split, note="fraction 0-1; evictable cached blocks count as free") is not None:
        ps.usage_granularity = "block"
        record_writers(ps, "usage_ratio", usage_fam, split)
    _capacity(expo, ps, split, n_engines)
    if ps.usage_ratio is not None and ps.capacity_tokens is not None:
        ps.set(
            "used_tokens",
            ps.usage_ratio * ps.capacity_tokens,
            Provenance(f"{usage_name} x capacity", True, "block granularity; evictable and free are not reported apart"),
        )
        ps.scaled["used_tokens"] = ("usage_ratio", ps.capacity_tokens)
    put(ps, "running", P + "num_requests_running", expo.get(P + "num_requests_running"), split)
    put(ps, "waiting", P + "num_requests_waiting", expo.get(P + "num_requests_waiting"), split, note="waiting + deferred")
    _queues(expo, ps, split)
    put(ps, "evictions_total", P + "num_preemptions", expo.get(P + "num_preemptions"), split, suffix="_total", note="preemptions (recompute)")
    put_histogram(ps, "preemptions_per_request", P + "request_num_preemptions", expo.get(P + "request_num_preemptions"), split)
    put(ps, "admission_rejections_total", P + "admission_rejections", expo.get(P + "admission_rejections"), split,
        suffix="_total", sum_over=("reason",))
    _prefix(expo, ps, split)
    put(ps, "prompt_tokens_total", P + "prompt_tokens", expo.get(P + "prompt_tokens"), split, suffix="_total")
    put(ps, "generation_tokens_total", P + "generation_tokens", expo.get(P + "generation_tokens"), split, suffix="_total")
    put(ps, "requests_total", P + "request_success", expo.get(P + "request_success"), split, suffix="_total", sum_over=("finished_reason",))
    put(ps, "external_hit_tokens_total", P + "external_prefix_cache_hits", expo.get(P + "external_prefix_cache_hits"), split, suffix="_total")
    put(ps, "external_query_tokens_total", P + "external_prefix_cache_queries", expo.get(P + "external_prefix_cache_queries"), split, suffix="_total")
    _tiers(expo, ps, split)
    put_histogram(ps, "ttft", P + "time_to_first_token_seconds", expo.get(P + "time_to_first_token_seconds"), split)
    qname, qfam = first(expo, P + "request_queue_time_seconds", P + "time_in_queue_requests")
    put_histogram(ps, "queue_time", qname, qfam, split)
    put_histogram(ps, "itl", P + "inter_token_latency_seconds", expo.get(P + "inter_token_latency_seconds"), split)
    put_histogram(ps, "prompt_lengths", P + "request_prompt_tokens", expo.get(P + "request_prompt_tokens"), split)
    put_histogram(ps, "output_lengths", P + "request_generation_tokens", expo.get(P + "request_generation_tokens"), split)
    ps.check_parts()
    return ps


def _queues(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """Waiting by reason (capacity vs deferred) and the KV-fetch stages, where exported; the
    fetch gauge exists only on a KV consumer, which is the role (decode) where no local tier is."""
    reasons, fetch = expo.get(P + "num_requests_waiting_by_reason"), expo.get(P + "num_requests_kv_fetch_by_stage")
    queues = []
    if fetch is not None and members(fetch, split, ""):
        stages = [(st, value(fetch, split, select={"stage": st})) for st in FETCH_STAGES]
        for st, v in stages:
            if v is not None:
                queues.append(Queue(f"KV fetch {st.replace('_', ' ')}", "in_flight", v, P + f'num_requests_kv_fetch_by_stage{{stage="{st}"}}'))
        ps.set("transfers_in_flight", sum(v for _, v in stages if v is not None), Provenance(P + "num_requests_kv_fetch_by_stage (sum over stage)", True))
        local_tier = any(expo.get(n) is not None for n in (P + "kv_offload_load_bytes", P + "kv_offload_total_bytes", LMCACHE + "num_hit_tokens"))
        if not local_tier:
            ps.role = "decode"
            ps.provenance["role"] = Provenance(P + "num_requests_kv_fetch_by_stage", True, "registered only where the KV connector consumes KV")
    deferred = "deferred (waiting for their KV transfer)" if ps.role == "decode" else "deferred (their KV transfer, a LoRA slot, or blocked)"
    for field, reason, title in (("waiting_capacity", "capacity", "waiting for scheduling capacity"), ("waiting_deferred", "deferred", deferred)):
        v = put(ps, field, P + "num_requests_waiting_by_reason", reasons, split, select={"reason": reason})
        if v is not None:
            queues.append(Queue(title, reason, v, P + f'num_requests_waiting_by_reason{{reason="{reason}"}}'))  # type: ignore[arg-type]
    ps.queues = tuple(sorted(queues, key=lambda q: KIND_ORDER[q.kind]))


def _tiers(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """L2 and L3 below the GPU pool: native CPU offloading (traffic, host hits), LMCache's own
    series on the same /metrics (hits over its own lookups, joined by model name), disk hits."""
    cached = expo.get(P + "prompt_tokens_cached_by_source")
    put(ps, "l2_hit_tokens_total", P + "prompt_tokens_cached_by_source", cached, split, suffix="_total", select={"source": "host"})
    put(ps, "l3_hit_tokens_total", P + "prompt_tokens_cached_by_source", cached, split, suffix="_total", select={"source": "disk"})
    load = put(ps, "l2_load_bytes_total", P + "kv_offload_load_bytes", expo.get(P + "kv_offload_load_bytes"), split, suffix="_total")
    store = put(ps, "l2_store_bytes_total", P + "kv_offload_store_bytes", expo.get(P + "kv_offload_store_bytes"), split, suffix="_total")
    legacy = expo.get(P + "kv_offload_total_bytes")
    if load is None and store is None and legacy is not None:
        put(ps, "l2_load_bytes_total", P + "kv_offload_total_bytes", legacy, split, suffix="_total", select={"transfer_type": "CPU_to_GPU"})
        put(ps, "l2_store_bytes_total", P + "kv_offload_total_bytes", legacy, split, suffix="_total", select={"transfer_type": "GPU_to_CPU"})
    if ps.l2_load_bytes_total is not None or ps.l2_store_bytes_total is not None:
        ps.l2_tier = "vLLM CPU offloading"
    lmcache.read(expo, ps)


def _label_number(fam: Family, split: dict[str, str], label: str) -> float | None:
    for s in members(fam, split, ""):
        raw = s.labels.get(label)
        if raw in (None, "None", ""):
            return None
        try:
            return float(raw)
        except ValueError:
            return None
    return None


def _capacity(expo: Exposition, ps: PoolSample, split: dict[str, str], n_engines: int) -> None:
    info = expo.get(P + "cache_config_info")
    if info is None:
        return
    block_size = _label_number(info, split, "block_size")
    blocks_all = _label_number(info, split, "num_gpu_blocks")
    size_tokens = _label_number(info, split, "kv_cache_size_tokens")
    src = P + "cache_config_info"
    if block_size is not None:
        ps.set("block_size", block_size, Provenance(src + "{block_size}"))
    if blocks_all is not None:
        ps.set(
            "num_blocks",
            blocks_all / n_engines,
            Provenance(src + "{num_gpu_blocks}", n_engines > 1, "summed over DP engines; divided by their count" if n_engines > 1 else ""),
        )
    if size_tokens is not None:
        ps.set("capacity_tokens", size_tokens, Provenance(src + "{kv_cache_size_tokens}"))
    elif ps.num_blocks is not None and ps.block_size is not None:
        ps.set(
            "capacity_tokens",
            (ps.num_blocks - 1) * ps.block_size,
            Provenance(src + "{num_gpu_blocks,block_size}", True, "(blocks - null block) x block_size"),
        )


def _prefix(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """L1 prefix hits from counters; the V0 rate gauge only when no counter exists."""
    for queries, hits, note in (
        (P + "prefix_cache_queries", P + "prefix_cache_hits", "tokens; resumed preempted requests excluded"),
        (P + "gpu_prefix_cache_queries", P + "gpu_prefix_cache_hits", "legacy name; 0.8.x counted blocks"),
    ):
        q = put(ps, "prefix_query_tokens_total", queries, expo.get(queries), split, suffix="_total", note=note)
        if q is not None:
            put(ps, "prefix_hit_tokens_total", hits, expo.get(hits), split, suffix="_total", note=note)
            return
    put(ps, "prefix_hit_ratio_gauge", P + "gpu_prefix_cache_hit_rate", expo.get(P + "gpu_prefix_cache_hit_rate"), split, note="V0 gauge")
