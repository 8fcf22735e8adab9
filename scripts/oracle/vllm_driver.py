"""vLLM 0.33.0's own ``Scheduler`` over request traces, one JSON line of state per step.

Run by the oracle environment's python (``scripts/oracle-env.sh``), never the main venv. Reads
``{"stories": [{"name", "config", "requests": [{"rid", "step", "prompt", "output"}]}]}`` on
stdin; for each story builds the scheduler the way vLLM's ``tests/v1/core/utils.py``
(``create_scheduler``) does, on CPU, with a tiny Llama ``config.json`` (no weights, no hub),
and drives it: before step ``n`` the requests whose ``step`` is ``n`` are added; then
``schedule()``, a ``ModelRunnerOutput`` with the trace's next output token for every request
whose prompt is computed, and ``update_from_output()``, until ``has_unfinished_requests()`` is
false. Requests carry ``SamplingParams(max_tokens=len(output), ignore_eos=True)``.

A story with ``cpu_blocks`` runs the native CPU offloading connector (``OffloadingConnector``,
``CPUOffloadingSpec``, ``kv_role`` kv_both, one CPU chunk per GPU block, LRU) on the scheduler
side unmodified. Its worker side, the only part that moves bytes (CUDA copies on streams), is
replaced by ``complete_transfers``: every job the step's metadata carries completes within that
step and is reported in its ``ModelRunnerOutput`` (``completed_jobs``, ``finished_recving`` for
asynchronous loads), which is when the reference pool completes them too.

Only the model forward (the trace's tokens) and the connector's worker are replaced. Prints one
line per step: running / waiting ids in order, free blocks, usage, cumulative preemptions,
prefix-cache queries and hits, scheduled tokens and block ids per request; with offloading also
the cumulative blocks loaded and stored, the connector's prefix-cache queries and hits, and the
CPU blocks in use.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model  # noqa: E402

CPU_CHUNK_BYTES = 4096  # one 128-byte block of the tiny KV spec, rounded up to mmap.PAGESIZE

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

def build(model_dir: str, cfg: dict[str, Any]) -> Scheduler:
    block_size = cfg["block_size"]
    model_config = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, max_model_len=cfg["max_model_len"], dtype="float16", seed=42
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], enable_chunked_prefill=True, is_encoder_decoder=False,
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
    )  # fmt: skip
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True, cache_dtype="auto")
    kv_transfer_config = None
    if cfg.get("cpu_blocks"):  # native CPU offloading: one CPU chunk per GPU block
        extra = {"cpu_bytes_to_use": cfg["cpu_blocks"] * CPU_CHUNK_BYTES, "sync_load_budget_bytes": cfg.get("sync_load_budget_bytes", 0)}
        kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    kv_cache_config = KVCacheConfig(
        num_blocks=cfg["num_gpu_blocks"], kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))],
    )  # fmt: skip
    cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
    sched = Scheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config, block_size=block_size, log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )  # fmt: skip
    got = (
        sched.scheduler_config.max_num_seqs, sched.scheduler_config.max_num_batched_tokens,
        sched.scheduler_config.long_prefill_token_threshold, sched.max_model_len,
        sched.kv_cache_manager.block_pool.num_gpu_blocks,
    )  # fmt: skip
    want = (
        cfg["max_num_seqs"], cfg["max_num_batched_tokens"], cfg["long_prefill_token_threshold"],
        cfg["max_model_len"], cfg["num_gpu_blocks"],
    )  # fmt: skip
    if cfg.get("cpu_blocks"):
        got += (sched.connector.connector_scheduler.manager._num_chunks,)
        want += (cfg["cpu_blocks"],)
    if got != want:  # vLLM resizes some limits on construction: the trace must run as asked
        raise SystemExit(f"vLLM changed the configuration: {got} != {want}")
    return sched


def complete_transfers(sched: Scheduler, meta: Any) -> tuple[KVConnectorOutput, int, int]:
    """The worker side of the offloading connector, deterministically: every load and store job
    of this step's metadata completes within the step (reported in this step's output, as the
    real worker reports a finished job at its next ``get_finished``); no bytes move. Returns the
    output and the blocks loaded and stored."""
    jobs = sched.connector.connector_scheduler._jobs
    done = {**meta.load_jobs, **meta.store_jobs}
    loaded = sum(len(jobs[j].keys) for j in meta.load_jobs)
    stored = sum(len(jobs[j].keys) for j in meta.store_jobs)
    recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
    worker = OffloadingWorkerMetadata(completed_jobs={j: 1 for j in done})
    return KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker), loaded, stored


def cpu_used_blocks(sched: Scheduler) -> int:
    """CPU blocks holding a stored (or being stored) block."""
    manager = sched.connector.connector_scheduler.manager
    return manager._num_chunks - manager._get_num_free_chunks()


def run_story(model_dir: str, story: dict[str, Any]) -> None:
    cfg = story["config"]
    sched = build(model_dir, cfg)
    hasher = get_request_block_hasher(cfg["block_size"], sha256)
    arrivals: dict[int, list[dict[str, Any]]] = {}
    for r in story["requests"]:
        arrivals.setdefault(r["step"], []).append(r)
    outputs = {r["rid"]: r["output"] for r in story["requests"]}
    live: dict[str, Request] = {}
    queries = hits = loads = stores = ext_queries = ext_hits = 0
    step = 0
    last_arrival = max(arrivals)
    while step <= last_arrival or sched.has_unfinished_requests():
        for r in arrivals.get(step, []):
            req = Request(
                r["rid"], list(r["prompt"]), SamplingParams(max_tokens=len(r["output"]), ignore_eos=True), None,
                arrival_time=float(step), block_hasher=hasher,
            )  # fmt: skip
            live[r["rid"]] = req
            sched.add_request(req)
        out = sched.schedule()
        stats = sched.kv_cache_manager.prefix_cache_stats
        queries, hits = queries + stats.queries, hits + stats.hits
        ext = sched.connector_prefix_cache_stats  # replaced by a fresh one in update_from_output
        if ext is not None:
            ext_queries, ext_hits = ext_queries + ext.queries, ext_hits + ext.hits
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = live[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([outputs[rid][len(req.output_token_ids)]] if done else [])
        kv_out = None
        if sched.connector is not None:
            kv_out, loaded, stored = complete_transfers(sched, out.kv_connector_metadata)
            loads, stores = loads + loaded, stores + stored
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )  # fmt: skip
        blocks = {rid: list(sched.kv_cache_manager.get_block_ids(rid)[0]) for rid in ids}
        sched.update_from_output(out, mro)
        pool = sched.kv_cache_manager.block_pool
        print(json.dumps({
            "story": story["name"], "step": step,
            "running": [r.request_id for r in sched.running], "waiting": [r.request_id for r in sched.waiting],
            "free_blocks": pool.get_num_free_blocks(), "usage": round(sched.kv_cache_manager.usage, 12),
            "preemptions": sum(r.num_preemptions for r in live.values()),
            "prefix_queries": queries, "prefix_hits": hits,
            "scheduled": {rid: out.num_scheduled_tokens[rid] for rid in ids}, "blocks": blocks,
            **({"offload_loaded_blocks": loads, "offload_stored_blocks": stores, "external_queries": ext_queries,
                "external_hits": ext_hits, "cpu_used_blocks": cpu_used_blocks(sched)} if sched.connector else {}),
        }))  # fmt: skip
        step += 1


def main() -> None:
    trace = json.load(sys.stdin)
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory() as model_dir:
        tiny_model.write(model_dir)
        for story in trace["stories"]:
            run_story(model_dir, story)


if __name__ == "__main__":
    main()
