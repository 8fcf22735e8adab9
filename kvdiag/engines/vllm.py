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
  gauges left in "all" mode (``kv_cache_usage_perc`` in 0.9.2-0.11).
"""

from __future__ import annotations

from kvdiag.engines.base import Instance, Knobs, first, members, instance_key, model_name, put, put_histogram, split_values
from kvdiag.exposition import Exposition, Family
from kvdiag.model import PoolSample, Provenance

NAME = "vllm"
P = "vllm:"

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
)

KNOBS = Knobs(
    admission_limit="--max-num-seqs",
    kv_dtype_fp8="--kv-cache-dtype fp8",
    tensor_parallel="--tensor-parallel-size",
    data_parallel="--data-parallel-size",
    memory_fraction="--gpu-memory-utilization",
    enable_metrics="(drop --disable-log-stats)",
)

ENABLE_HINT = "vLLM serves vllm:* metrics unless started with --disable-log-stats; drop that flag"

#: Admission reserves no output (it allocates blocks as tokens come), so nothing to clip.
OUTPUT_RESERVE_CLIP: int | None = None

#: The usage gauge is read after the step's finished requests free their blocks
#: (Scheduler.update_from_output: _free_request, then make_stats), and the next step's admission
#: refills that room at once: under load the gauge reads one step's frees below the pool's peak.
USAGE_AFTER_FREES = True


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
    _capacity(expo, ps, split, n_engines)
    if ps.usage_ratio is not None and ps.capacity_tokens is not None:
        ps.set(
            "used_tokens",
            ps.usage_ratio * ps.capacity_tokens,
            Provenance(f"{usage_name} x capacity", True, "block granularity; evictable and free are not reported apart"),
        )
    put(ps, "running", P + "num_requests_running", expo.get(P + "num_requests_running"), split)
    put(ps, "waiting", P + "num_requests_waiting", expo.get(P + "num_requests_waiting"), split)
    put(ps, "evictions_total", P + "num_preemptions", expo.get(P + "num_preemptions"), split, suffix="_total", note="preemptions (recompute)")
    _prefix(expo, ps, split)
    put(ps, "prompt_tokens_total", P + "prompt_tokens", expo.get(P + "prompt_tokens"), split, suffix="_total")
    put(ps, "generation_tokens_total", P + "generation_tokens", expo.get(P + "generation_tokens"), split, suffix="_total")
    put(ps, "requests_total", P + "request_success", expo.get(P + "request_success"), split, suffix="_total", sum_over=("finished_reason",))
    put(ps, "external_hit_tokens_total", P + "external_prefix_cache_hits", expo.get(P + "external_prefix_cache_hits"), split, suffix="_total")
    put(ps, "external_query_tokens_total", P + "external_prefix_cache_queries", expo.get(P + "external_prefix_cache_queries"), split, suffix="_total")
    put(ps, "l2_hit_tokens_total", P + "prompt_tokens_cached_by_source", expo.get(P + "prompt_tokens_cached_by_source"), split, suffix="_total", select={"source": "host"})
    put_histogram(ps, "ttft", P + "time_to_first_token_seconds", expo.get(P + "time_to_first_token_seconds"), split)
    qname, qfam = first(expo, P + "request_queue_time_seconds", P + "time_in_queue_requests")
    put_histogram(ps, "queue_time", qname, qfam, split)
    ps.check_parts()
    return ps


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
