"""Wire forms of one exposition, written by prometheus_client itself (the engines' library).

An engine answers in whatever form the scraper negotiates: text 0.0.4 or OpenMetrics, and,
since prometheus_client 0.23, an ``escaping=`` scheme (Prometheus 3 asks for one). Tests
re-expose a real fixture in every such form through prometheus_client's own writers, so the
spellings are the library's, not ours.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

ESCAPINGS = ("underscores", "dots", "values", "allow-utf-8")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def reexpose(text: str, escaping: str, openmetrics: bool) -> tuple[str, str | None]:
    """(body, content type) of a 0.0.4 ``text`` written again in one wire form."""
    families = list(text_string_to_metric_families(text))

    class Fixed:
        def collect(self):  # noqa: ANN202 (prometheus_client collector API)
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    if openmetrics:
        return generate_openmetrics(registry, escaping=escaping).decode(), f"{OPENMETRICS}; escaping={escaping}"
    return generate_latest(registry, escaping=escaping).decode(), f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}"


# --- Deployments the reference engines do not emit (yet): exposition written with prometheus_client's
# own metric families and writer, under the engines' names and label sets (shared/facts/engine-metrics.md).

Labels = dict[str, str]
#: (name as the engine's code registers it, type, labels, value); a histogram's value is
#: ((upper bound, cumulative count), ...) ending in +Inf, with its sum as the last bound's pair.
Metric = tuple[str, str, Labels, object]


def expose(metrics: list[Metric]) -> str:
    """Text 0.0.4 of the given samples, one family per name, as prometheus_client writes it
    (a counter's ``_total``, sorted labels, float values; no ``_created``: a multiprocess registry)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString

    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
    families: dict[str, object] = {}
    for name, kind, labels, value in metrics:
        keys = sorted(labels)
        fam = families.get(name)
        if fam is None:
            fam = families[name] = kinds[kind](name, f"{name} as the engine registers it", labels=keys)
        if kind == "histogram":
            buckets, total = value  # type: ignore[misc]
            fam.add_metric([labels[k] for k in keys], buckets=[(floatToGoString(b), c) for b, c in buckets], sum_value=total)  # type: ignore[attr-defined]
        else:
            fam.add_metric([labels[k] for k in keys], float(value))  # type: ignore[attr-defined, arg-type]

    class Fixed:
        def collect(self):  # noqa: ANN202 (prometheus_client collector API)
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


SG_MODEL = "Qwen/Qwen3-32B"
VL_MODEL = "meta-llama/Llama-3.1-70B-Instruct"


def sglang_scheduler(engine_type: str) -> Labels:
    """SGLang 0.5.23's scheduler collector labels (metrics_collector.py init_new)."""
    return {"engine_type": engine_type, "model_name": SG_MODEL, "moe_ep_rank": "0", "pp_rank": "0", "tp_rank": "0"}


def sglang_pd_queues(lbl: Labels, bootstrap: float = 0, inflight: float = 0, prealloc: float = 0, transfer: float = 0) -> list[Metric]:
    """The PD queue gauges, exported on every role (0 outside their role, and in unified mode)."""
    return [
        ("sglang:num_prefill_bootstrap_queue_reqs", "gauge", lbl, bootstrap),
        ("sglang:num_prefill_inflight_queue_reqs", "gauge", lbl, inflight),
        ("sglang:num_decode_prealloc_queue_reqs", "gauge", lbl, prealloc),
        ("sglang:num_decode_transfer_queue_reqs", "gauge", lbl, transfer),
    ]


def sglang_decode(i: int) -> str:
    """Scrape ``i`` (15 s apart) of an SGLang decode instance of a PD pair whose pool is full: usage
    0.97-0.99, retractions 0 -> 101, the prealloc queue 0 -> 70, the waiting queue 0-2."""
    lbl = sglang_scheduler("decode")
    cap, usage = 200_000, 0.97 + 0.01 * (i % 3)
    retracted = round(101 * i / 20)
    return expose([
        ("sglang:num_running_reqs", "gauge", lbl, 48),
        ("sglang:num_queue_reqs", "gauge", lbl, i % 3),
        ("sglang:token_usage", "gauge", lbl, round(usage, 2)),
        ("sglang:full_token_usage", "gauge", lbl, usage),
        ("sglang:max_total_num_tokens", "gauge", lbl, cap),
        ("sglang:kv_used_tokens", "gauge", lbl, round(usage * cap)),
        ("sglang:kv_evictable_tokens", "gauge", lbl, 0),
        ("sglang:kv_available_tokens", "gauge", lbl, cap - round(usage * cap)),
        ("sglang:new_token_ratio", "gauge", lbl, 0.7),
        *sglang_pd_queues(lbl, prealloc=round(70 * i / 20), transfer=4),
        ("sglang:num_retracted_requests_total", "counter", lbl, retracted),
        ("sglang:num_retracted_input_tokens_total", "counter", lbl, 3_000 * retracted),
        ("sglang:num_retracted_output_tokens_total", "counter", lbl, 250 * retracted),
    ])


def sglang_swa(i: int) -> str:
    """A hybrid sliding-window model on SGLang: the SWA pool pinned at 0.97-0.99, the full pool at 0.61."""
    lbl = sglang_scheduler("unified")
    full, swa = 400_000, 80_000
    swa_usage = 0.97 + 0.01 * (i % 3)
    return expose([
        ("sglang:num_running_reqs", "gauge", lbl, 40),
        ("sglang:num_queue_reqs", "gauge", lbl, 1),
        ("sglang:token_usage", "gauge", lbl, round(swa_usage, 2)),
        ("sglang:full_token_usage", "gauge", lbl, 0.61),
        ("sglang:swa_token_usage", "gauge", lbl, swa_usage),
        ("sglang:mamba_usage", "gauge", lbl, 0.0),
        ("sglang:max_total_num_tokens", "gauge", lbl, full),
        ("sglang:max_total_num_tokens_swa", "gauge", lbl, swa),
        ("sglang:num_used_tokens", "gauge", lbl, round(swa_usage * swa)),
        ("sglang:kv_used_tokens", "gauge", lbl, 244_000),
        ("sglang:kv_evictable_tokens", "gauge", lbl, 100_000),
        ("sglang:kv_available_tokens", "gauge", lbl, 56_000),
        ("sglang:swa_used_tokens", "gauge", lbl, round(swa_usage * swa)),
        ("sglang:swa_evictable_tokens", "gauge", lbl, 600),
        ("sglang:swa_available_tokens", "gauge", lbl, swa - round(swa_usage * swa) - 600),
        *sglang_pd_queues(lbl),
        ("sglang:num_retracted_requests_total", "counter", lbl, 0),
    ])


def sglang_hicache(i: int) -> str:
    """SGLang with HiCache: L1 pinned, the host tier 20% occupied, load-back and backup traffic."""
    lbl = sglang_scheduler("unified")
    radix = {"cache_type": "HiRadixCache", "pp_rank": "0", "tp_rank": "0"}
    return expose([
        ("sglang:num_running_reqs", "gauge", lbl, 40),
        ("sglang:num_queue_reqs", "gauge", lbl, 0),
        ("sglang:token_usage", "gauge", lbl, 0.98),
        ("sglang:max_total_num_tokens", "gauge", lbl, 200_000),
        ("sglang:hicache_host_used_tokens", "gauge", lbl, 160_000),
        ("sglang:hicache_host_total_tokens", "gauge", lbl, 800_000),
        ("sglang:num_retracted_requests_total", "counter", lbl, 0),
        ("sglang:load_back_bytes_total", "counter", radix, 4e7 * i),
        ("sglang:hicache_backup_bytes_total", "counter", radix, 9e7 * i),
        ("sglang:hicache_dropped_tokens_total", "counter", {**radix, "pool": "kv", "reason": "host_full"}, 0),
    ])


def vllm_engine() -> Labels:
    return {"engine": "0", "model_name": VL_MODEL}


def vllm_core(lbl: Labels, usage: object, running: float, waiting: float, preemptions: float) -> list[Metric]:
    info = {"block_size": "16", "engine": lbl["engine"], "kv_cache_size_tokens": "196592", "num_gpu_blocks": "12288"}
    out: list[Metric] = [
        ("vllm:num_requests_running", "gauge", lbl, running),
        ("vllm:num_requests_waiting", "gauge", lbl, waiting),
        ("vllm:num_preemptions", "counter", lbl, preemptions),
        ("vllm:cache_config_info", "gauge", info, 1),
    ]
    if isinstance(usage, dict):  # per API-server process, each with its own pid (no multiprocess mode)
        out += [("vllm:kv_cache_usage_perc", "gauge", {**lbl, "pid": pid}, u) for pid, u in usage.items()]
    else:
        out.append(("vllm:kv_cache_usage_perc", "gauge", lbl, usage))
    return out


def vllm_decode(i: int) -> str:
    """A vLLM decode instance with a KV connector (consumer): waiting 1 -> 60, all deferred for
    their KV transfer, capacity 0; the pool at half."""
    lbl = vllm_engine()
    waiting = 1 + round(59 * i / 20)
    fetch = [("vllm:num_requests_kv_fetch_by_stage", "gauge", {**lbl, "stage": st}, v)
             for st, v in (("waiting_to_start", waiting - waiting // 2), ("in_progress", waiting // 2), ("completed_waiting", 0))]
    return expose(vllm_core(lbl, 0.5, 40, waiting, 0) + [
        ("vllm:num_requests_waiting_by_reason", "gauge", {**lbl, "reason": "capacity"}, 0),
        ("vllm:num_requests_waiting_by_reason", "gauge", {**lbl, "reason": "deferred"}, waiting),
        *fetch,
    ])


def vllm_lmcache(i: int) -> str:
    """vLLM with LMCache sharing its multiprocess /metrics: the pool pinned, preemptions with their
    histogram per finished request, LMCache holding 30% of what is looked up (the GPU's prefix hits
    mostly) and retrieving 2%."""
    lbl = vllm_engine()
    lm = {"model_name": VL_MODEL, "role": "worker", "served_model_name": VL_MODEL, "worker_id": "0"}
    done = 20 * i
    preempt = ((1.0, 0.8 * done), (2.0, 0.9 * done), (5.0, done), (float("inf"), done))
    return expose(vllm_core(lbl, 0.97 + 0.01 * (i % 2), 48, 0, 3 * i) + [
        ("vllm:num_requests_waiting_by_reason", "gauge", {**lbl, "reason": "capacity"}, 0),
        ("vllm:num_requests_waiting_by_reason", "gauge", {**lbl, "reason": "deferred"}, 0),
        ("vllm:request_num_preemptions", "histogram", lbl, (preempt, 0.45 * done)),
        ("vllm:admission_rejections", "counter", {"model_name": VL_MODEL, "reason": "max_num_queued_reqs"}, 2 * i),
        *lmcache_counters(lm, 100_000 * i, 30_000 * i, 2_000 * i),
        ("lmcache:local_cache_usage", "gauge", lm, 3e9),
    ])


def lmcache_counters(lm: dict[str, str], looked_up: float, found: float, retrieved: float) -> list[Metric]:
    """LMCache 0.5.6's token counters: ``looked_up`` tokens asked in lookups, ``found`` of them
    held (vLLM's own GPU prefix hits included), and the retrieve pair: vLLM asks it only for
    ``retrieved``, what it found beyond the GPU's hits, and gets all of it."""
    return [
        ("lmcache:num_lookup_tokens", "counter", lm, looked_up),
        ("lmcache:num_lookup_hits", "counter", lm, found),
        ("lmcache:num_requested_tokens", "counter", lm, retrieved),
        ("lmcache:num_hit_tokens", "counter", lm, retrieved),
    ]


def vllm_two_writers(i: int) -> str:
    """vLLM 0.10 with two API servers and no multiprocess mode for the usage gauge: pid 101 wrote
    0.97 once and stopped; pid 102 keeps writing the real usage, 0.30-0.34."""
    lbl = vllm_engine()
    return expose(vllm_core(lbl, {"101": 0.97, "102": 0.30 + 0.02 * (i % 3)}, 30, 0, 0))
