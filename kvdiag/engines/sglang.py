"""SGLang: from an exposition (``sglang:*`` or underscore-escaped ``sglang_*``) to PoolSamples.

Version facts encoded here (shared/facts/engine-metrics.md §2):
- the pool is counted in tokens (page_size 1 by default); ``token_usage`` =
  (total - available - evictable) / total, rounded to 2 decimals, since 0.4.x;
- ``max_total_num_tokens`` exists since 0.5.6; before, capacity is ``num_used_tokens / token_usage``;
- used / evictable / available apart (``kv_*_tokens``) since 0.5.11;
- retractions: ``num_retracted_requests_total`` counter since 0.5.7, the cumulative gauge
  ``total_retracted_reqs`` in 0.4.10-0.5.2, and ``num_retracted_reqs``, a last-event gauge that is
  never rated;
- the multiprocess registry omits a counter until it is first incremented, so on a version
  that has the retraction counter its absence means "none yet";
- ``dp_rank`` splits a server into data-parallel engines; tokenizer series (TTFT, prompt tokens,
  cached tokens) carry no ``dp_rank`` and are server-wide.
"""

from __future__ import annotations

import math

from kvdiag.engines.base import (
    Instance,
    Knobs,
    first,
    instance_key,
    members,
    model_name,
    put,
    put_histogram,
    split_values,
    value,
)
from kvdiag.exposition import Exposition
from kvdiag.model import PoolSample, Provenance

NAME = "sglang"
P = "sglang:"

#: Families whose presence says "this is SGLang".
SIGNATURE = (P + "num_running_reqs", P + "num_queue_reqs", P + "token_usage")

#: Families that only SGLang >= 0.5.7 exports, i.e. versions that have the retraction counter.
HAS_RETRACT_COUNTER = (
    P + "realtime_tokens",
    P + "full_token_usage",
    P + "kv_used_tokens",
    P + "prefill_effective_tokens",
)

WANTED = (
    P + "num_running_reqs",
    P + "num_queue_reqs",
    P + "token_usage",
    P + "full_token_usage",
    P + "num_used_tokens",
    P + "max_total_num_tokens",
    P + "page_size",
    P + "kv_used_tokens",
    P + "kv_evictable_tokens",
    P + "kv_available_tokens",
    P + "num_retracted_requests",
    P + "total_retracted_reqs",
    P + "num_retracted_reqs",
    P + "new_token_ratio",
    P + "cached_tokens",
    P + "prompt_tokens",
    P + "generation_tokens",
    P + "num_requests",
    P + "prefill_effective_tokens",
    P + "realtime_tokens",
    P + "hicache_host_used_tokens",
    P + "hicache_host_total_tokens",
    P + "time_to_first_token_seconds",
    P + "queue_time_seconds",
)

KNOBS = Knobs(
    admission_limit="--max-running-requests",
    kv_dtype_fp8="--kv-cache-dtype fp8_e4m3",
    tensor_parallel="--tp-size",
    data_parallel="--dp-size",
    memory_fraction="--mem-fraction-static",
    enable_metrics="--enable-metrics",
)

ENABLE_HINT = "start SGLang with --enable-metrics (without it /metrics is a 404)"

#: Admission charges each request at most this much output (CLIP_MAX_NEW_TOKENS, env
#: SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION): the running requests' reserve and the next request's.
OUTPUT_RESERVE_CLIP = 4096

#: token_usage is read when a batch's results are processed (0.5.23 batch_result_processor:
#: report_prefill_stats / report_decode_stats), mostly for prefill batches (decode: every
#: decode_log_interval-th), right after that batch's admission: a prefill frees only the requests
#: that end at their first token, so the gauge is not one step's frees below the peak.
USAGE_AFTER_FREES = False

_STREAM = ("is_streaming",)


def detect(expo: Exposition) -> bool:
    return any(expo.get(name) is not None for name in SIGNATURE)


def instances(expo: Exposition, target: str) -> list[Instance]:
    core = [expo.get(n) for n in SIGNATURE]
    ranks = split_values(core, "dp_rank")
    splits = [{"dp_rank": r} for r in ranks] or [{}]
    return [Instance(instance_key(target, s), s, model_name(core, s)) for s in splits]


def normalize(expo: Exposition, target: str, ts: float) -> list[PoolSample]:
    """One PoolSample per data-parallel engine of the server."""
    return [_sample(expo, inst, ts) for inst in instances(expo, target)]


def _sample(expo: Exposition, inst: Instance, ts: float) -> PoolSample:
    split = inst.split
    ps = PoolSample(inst.key, NAME, ts, model=inst.model, labels=dict(split))

    def fam(name: str):  # a family by its short name
        return P + name, expo.get(P + name)

    usage = put(ps, "usage_ratio", *fam("token_usage"), split, note="rounded to 2 decimals by the engine")
    if usage is not None:
        ps.usage_granularity = "token"
    capacity = put(ps, "capacity_tokens", *fam("max_total_num_tokens"), split)
    put(ps, "used_tokens", *fam("kv_used_tokens"), split)
    put(ps, "evictable_tokens", *fam("kv_evictable_tokens"), split)
    put(ps, "available_tokens", *fam("kv_available_tokens"), split)
    if ps.used_tokens is None:
        put(ps, "used_tokens", *fam("num_used_tokens"), split, note="total - available - evictable")
    # The fallback is for versions without the gauge; a gauge that was refused stays refused.
    if "capacity_tokens" not in ps.provenance and usage and ps.used_tokens is not None:
        derived = ps.used_tokens / usage  # a usage below the engine's 0.01 step can overflow
        ps.set(
            "capacity_tokens",
            round(derived) if math.isfinite(derived) else derived,
            Provenance(P + "num_used_tokens / " + P + "token_usage", True, "inherits the 2-decimal rounding"),
        )
    put(ps, "running", *fam("num_running_reqs"), split)
    put(ps, "waiting", *fam("num_queue_reqs"), split)
    put(ps, "decode_reserve_ratio", *fam("new_token_ratio"), split)
    _evictions(expo, ps, split)
    _prefix(expo, ps, split)
    put(ps, "prompt_tokens_total", *fam("prompt_tokens"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "generation_tokens_total", *fam("generation_tokens"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "requests_total", *fam("num_requests"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "l2_used_tokens", *fam("hicache_host_used_tokens"), split)
    put(ps, "l2_capacity_tokens", *fam("hicache_host_total_tokens"), split)
    put_histogram(ps, "ttft", *fam("time_to_first_token_seconds"), split, sum_over=_STREAM)
    put_histogram(ps, "queue_time", *fam("queue_time_seconds"), split, sum_over=_STREAM)
    ps.check_parts()
    return ps


def _evictions(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """The retraction counter, else the legacy cumulative gauge, else "none yet" where the
    version has the counter; a series that is there but unreadable (NaN, negative) stays absent."""
    counter = expo.get(P + "num_retracted_requests")
    legacy = expo.get(P + "total_retracted_reqs")
    if counter is not None and members(counter, split, "_total"):
        put(ps, "evictions_total", P + "num_retracted_requests", counter, split, suffix="_total")
    elif legacy is not None and members(legacy, split, ""):
        put(ps, "evictions_total", P + "total_retracted_reqs", legacy, split, note="cumulative gauge (0.4.10-0.5.2)")
    elif any(expo.get(n) is not None for n in HAS_RETRACT_COUNTER):
        ps.set(
            "evictions_total",
            0.0,
            Provenance(
                P + "num_retracted_requests_total",
                True,
                "not created until the first retraction (multiprocess registry); none yet",
            ),
        )
    else:
        ps.notes.append(
            "this SGLang version exports retractions only as the last-event gauge "
            "sglang:num_retracted_reqs, which cannot be rated; SGLang >= 0.5.7 has the counter"
        )
    put(ps, "last_eviction_event", P + "num_retracted_reqs", expo.get(P + "num_retracted_reqs"), split)


def _prefix(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """L1 prefix hits from counters: the scheduler's per-engine split when it exists (0.5.20+),
    else the tokenizer's cached / prompt tokens. Never the per-batch ``cache_hit_rate`` gauge."""
    eff_name, eff = first(expo, P + "prefill_effective_tokens")
    if eff is not None:
        hit = put(ps, "prefix_hit_tokens_total", eff_name, eff, split, suffix="_total", select={"mode": "device_hit"})
        total = value(eff, split, "_total", sum_over=("mode",))
        if hit is not None and total is not None:
            ps.set(
                "prefix_query_tokens_total",
                total,
                Provenance(eff_name + "_total (sum over mode)", True, "retracted re-prefills excluded"),
            )
        put(ps, "l2_hit_tokens_total", eff_name, eff, split, suffix="_total", select={"mode": "host_hit"})
        if ps.prefix_hit_tokens_total is not None:
            return
    cached = expo.get(P + "cached_tokens")
    if cached is None:
        return
    sources = {s.labels.get("cache_source") for s in cached.samples}
    if "device" in sources:
        hit = put(ps, "prefix_hit_tokens_total", P + "cached_tokens", cached, split, suffix="_total", select={"cache_source": "device"}, sum_over=_STREAM)
        put(ps, "l2_hit_tokens_total", P + "cached_tokens", cached, split, suffix="_total", select={"cache_source": "host"}, sum_over=_STREAM)
    else:
        hit = put(ps, "prefix_hit_tokens_total", P + "cached_tokens", cached, split, suffix="_total", sum_over=_STREAM + ("cache_source",))
    if hit is not None:
        put(ps, "prefix_query_tokens_total", P + "prompt_tokens", expo.get(P + "prompt_tokens"), split, suffix="_total", sum_over=_STREAM)
