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
  cached tokens, the prompt / generation length histograms, buckets 100...1,100,000, observed per
  finished request, no flag in 0.5.23) carry no ``dp_rank`` and are server-wide;
- the role is the scheduler series' ``engine_type`` label (unified | prefill | decode, 0.5.8+;
  always "unified" before); the PD queue gauges are exported as 0 in unified mode, so a non-zero
  one only backs the label up where it is missing. A decode instance's pre-allocation queue waits
  for room in its pool (its admission queue); its transfer queue and a prefill instance's
  bootstrap queue wait for the other instance; a prefill's inflight queue is prefilled work whose
  KV is being sent (``QUEUES``);
- hybrid models (sliding window, Mamba) report each pool apart (``swa_*``, ``mamba_*``);
  ``token_usage`` is the largest pool usage, rounded;
- recompute cost: ``num_retracted_input_tokens_total`` + ``num_retracted_output_tokens_total``;
- L2 (HiCache host memory): occupancy ``hicache_host_{used,total}_tokens``, hits
  ``cached_tokens_total{cache_source="host"}`` / ``prefill_effective_tokens_total{mode="host_hit"}``,
  traffic ``load_back_bytes_total`` / ``hicache_backup_bytes_total``, drops
  ``hicache_dropped_tokens_total``; L3 (storage) hits ``storage_prefetch_hit_tokens_total``.
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
    record_writers,
    split_values,
    value,
)
from kvdiag.exposition import Exposition
from kvdiag.model import Pool, PoolSample, Provenance, Queue, QueueKind

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

#: The scheduler's queues: (names, newest first; the role's term; what it waits for; the role
#: that fills it, None for every role). Each is a gauge of requests.
QUEUES: tuple[tuple[tuple[str, ...], str, QueueKind, str | None], ...] = (
    ((P + "num_queue_reqs",), "waiting queue", "capacity", None),
    ((P + "num_decode_prealloc_queue_reqs",), "decode prealloc queue (waiting for room in this pool)", "capacity", "decode"),
    ((P + "num_decode_transfer_queue_reqs",), "decode transfer queue (KV arriving from the prefill instance)", "deferred", "decode"),
    ((P + "num_prefill_bootstrap_queue_reqs", P + "num_prefill_prealloc_queue_reqs"),
     "prefill bootstrap queue (waiting for the decode instance's handshake)", "deferred", "prefill"),
    ((P + "num_prefill_inflight_queue_reqs", P + "num_prefill_infight_queue_reqs"),
     "prefill inflight queue (prefilled, KV being sent)", "in_flight", "prefill"),
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
    P + "inter_token_latency_seconds",
    P + "prompt_tokens_histogram",
    P + "generation_tokens_histogram",
    P + "num_retracted_input_tokens",
    P + "num_retracted_output_tokens",
    P + "swa_token_usage",
    P + "mamba_usage",
    P + "max_total_num_tokens_swa",
    P + "swa_used_tokens",
    P + "swa_evictable_tokens",
    P + "swa_available_tokens",
    P + "mamba_used_tokens",
    P + "mamba_evictable_tokens",
    P + "mamba_available_tokens",
    P + "load_back_bytes",
    P + "hicache_backup_bytes",
    P + "hicache_dropped_tokens",
    P + "storage_prefetch_hit_tokens",
) + tuple(name for q in QUEUES for name in q[0])

KNOBS = Knobs(
    admission_limit="--max-running-requests",
    kv_dtype_fp8="--kv-cache-dtype fp8_e4m3",
    tensor_parallel="--tp-size",
    data_parallel="--dp-size",
    memory_fraction="--mem-fraction-static",
    enable_metrics="--enable-metrics",
    kv_pool_size="--max-total-tokens",
    reserve_conservativeness="--schedule-conservativeness",
    reserve_clip="SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION",
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

#: Only the freed-room estimate of an engine whose gauge is read after the frees reads this.
PREFILL_CHUNK_TOKENS: int | None = None

#: A decode instance (PD) preallocates a transferred request's whole prompt (no decode radix
#: cache by default) and keeps --num-reserved-decode-tokens (default 512) per running,
#: transferring and waiting request out of its free room, plus one for the request admitted
#: (DecodePreallocQueue._allocatable_tokens, pop_preallocated); it charges no output reserve.
DECODE_RESERVED_TOKENS: int | None = 512

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
    put(ps, "capacity_tokens", *fam("max_total_num_tokens"), split)
    _pools(expo, ps, split)
    binding = ps.binding_pool
    state = "kv" if binding is None or binding.kind == "full" else binding.kind
    put(ps, "used_tokens", *fam(state + "_used_tokens"), split)
    put(ps, "evictable_tokens", *fam(state + "_evictable_tokens"), split)
    put(ps, "available_tokens", *fam(state + "_available_tokens"), split)
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
    _queues(expo, ps, split)
    put(ps, "decode_reserve_ratio", *fam("new_token_ratio"), split)
    _evictions(expo, ps, split)
    _recompute(expo, ps, split)
    _prefix(expo, ps, split)
    put(ps, "prompt_tokens_total", *fam("prompt_tokens"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "generation_tokens_total", *fam("generation_tokens"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "requests_total", *fam("num_requests"), split, suffix="_total", sum_over=_STREAM)
    put(ps, "l2_used_tokens", *fam("hicache_host_used_tokens"), split)
    put(ps, "l2_capacity_tokens", *fam("hicache_host_total_tokens"), split)
    put(ps, "l2_load_bytes_total", *fam("load_back_bytes"), split, suffix="_total")
    put(ps, "l2_store_bytes_total", *fam("hicache_backup_bytes"), split, suffix="_total")
    put(ps, "l2_dropped_tokens_total", *fam("hicache_dropped_tokens"), split, suffix="_total", sum_over=("reason", "pool"))
    if put(ps, "l3_hit_tokens_total", *fam("storage_prefetch_hit_tokens"), split, suffix="_total") is None:
        put(ps, "l3_hit_tokens_total", *fam("prefill_effective_tokens"), split, suffix="_total", select={"mode": "storage_hit"})
    if ps.l2_capacity_tokens is not None or any((getattr(ps, f) or 0) > 0 for f in ("l2_load_bytes_total", "l2_store_bytes_total")):
        ps.l2_tier = "HiCache host-memory tier"
    put_histogram(ps, "ttft", *fam("time_to_first_token_seconds"), split, sum_over=_STREAM)
    put_histogram(ps, "queue_time", *fam("queue_time_seconds"), split, sum_over=_STREAM)
    put_histogram(ps, "itl", *fam("inter_token_latency_seconds"), split)
    put_histogram(ps, "prompt_lengths", *fam("prompt_tokens_histogram"), split)
    put_histogram(ps, "output_lengths", *fam("generation_tokens_histogram"), split)
    ps.check_parts()
    return ps


def _role(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """The scheduler's ``engine_type`` label; where it is missing, a PD queue that holds work."""
    fam = expo.get(P + "num_running_reqs") or expo.get(P + "num_queue_reqs")
    types = {s.labels.get("engine_type") for s in members(fam, split, "")} if fam is not None else set()
    types.discard(None)
    if len(types) == 1:
        (role,) = types
        if role in ("prefill", "decode", "unified"):
            ps.role = role  # type: ignore[assignment]
            ps.provenance["role"] = Provenance(P + "num_running_reqs{engine_type}")
            return
    busy = {r for names, _, _, r in QUEUES if r for n in names if (value(expo.get(n), split) or 0) > 0}
    if len(busy) == 1:
        ps.role = busy.pop()  # type: ignore[assignment]
        ps.provenance["role"] = Provenance(P + "num_*_queue_reqs", True, "no engine_type label; its PD queues hold work")


def _queues(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """Every queue the scheduler reports (``QUEUES``); waiting is the capacity and deferred ones.

    PD queues are exported as 0 outside their role, so they are listed only on their role (or
    where they hold work) but always added: the sum is the same either way, as in the rules."""
    _role(expo, ps, split)
    queues, found = [], False
    for names, title, kind, role in QUEUES:
        name, fam = first(expo, *names)
        v = value(fam, split) if fam is not None else None
        if v is None or math.isnan(v):
            continue
        if role is not None:
            found = True
        if role is None or role == ps.role or v > 0:
            queues.append(Queue(title, kind, v, name or ""))
    ps.queues = tuple(queues)
    waiting = [q for q in queues if q.kind != "in_flight"]
    main = next((q for q in queues if q.metric == P + "num_queue_reqs"), None)
    if main is None:
        return
    src = Provenance(P + "num_queue_reqs" + (" + PD queues" if len(waiting) > 1 else ""), len(waiting) > 1)
    ps.set("waiting", sum(q.requests for q in waiting), src)
    if found:
        for field, kind in (("waiting_capacity", "capacity"), ("waiting_deferred", "deferred"), ("transfers_in_flight", "in_flight")):
            ps.set(field, sum(q.requests for q in queues if q.kind == kind), Provenance(P + f"num_*_queue_reqs ({kind})", True))


def _pools(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """Each pool of a hybrid model: full attention, and the sliding-window or Mamba pool where
    the model has one (its capacity or a figure above 0; the gauges read 0 otherwise)."""
    pools = []
    for kind, usage_name, cap_name in (("full", "full_token_usage", "max_total_num_tokens"),
                                       ("swa", "swa_token_usage", "max_total_num_tokens_swa"),
                                       ("mamba", "mamba_usage", None)):
        prefix = "kv" if kind == "full" else kind
        states = {st: value(expo.get(P + f"{prefix}_{st}_tokens"), split) for st in ("used", "evictable", "available")}
        usage = value(expo.get(P + usage_name), split)
        cap = value(expo.get(P + cap_name), split) if cap_name else None
        if cap is None and all(v is not None for v in states.values()):
            cap = sum(states.values())  # type: ignore[arg-type]
        if usage is None or math.isnan(usage):
            continue
        if kind != "full" and not (usage > 0 or (cap or 0) > 0):
            continue
        unit = "states" if kind == "mamba" else "tokens"
        pools.append(Pool(kind, usage, states["used"], states["evictable"], states["available"], cap, unit, P + usage_name))
    if len(pools) > 1:
        ps.pools = tuple(pools)


def _recompute(expo: Exposition, ps: PoolSample, split: dict[str, str]) -> None:
    """Tokens retraction threw away (input + output), from the two counters (0.5.7+)."""
    parts = [value(expo.get(P + f"num_retracted_{k}_tokens"), split, "_total") for k in ("input", "output")]
    if any(v is not None for v in parts):
        ps.set("recompute_tokens_total", sum(v for v in parts if v is not None),
               Provenance(P + "num_retracted_input_tokens_total + " + P + "num_retracted_output_tokens_total", True))
    elif ps.provenance.get("evictions_total") is not None and ps.provenance["evictions_total"].derived:
        ps.set("recompute_tokens_total", 0.0, Provenance(P + "num_retracted_input_tokens_total", True, "not created until the first retraction; none yet"))


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
    record_writers(ps, "last_eviction_event", expo.get(P + "num_retracted_reqs"), split)


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
