"""vLLM 0.33.0's own ``Scheduler`` over request traces, one JSON line of state per step.

Run by the oracle environment's python (``scripts/oracle-env.sh``), never the main venv. Reads
``{"stories": [{"name", "config", "requests": [{"rid", "step", "prompt", "output"}]}]}`` on
stdin; for each story builds the scheduler the way vLLM's ``tests/v1/core/utils.py``
(``create_scheduler``) does, on CPU, with a tiny Llama ``config.json`` (no weights, no hub),
and drives it: before step ``n`` the requests whose ``step`` is ``n`` are added; then
``schedule()``, a ``ModelRunnerOutput`` with the trace's next output token for every request
whose prompt is computed, and ``update_from_output()``, until ``has_unfinished_requests()`` is
false. Requests carry ``SamplingParams(max_tokens=len(output), ignore_eos=True)``.

Only the model forward is replaced (by the trace's tokens). Nothing of vLLM is stubbed.
Prints one line per step: running / waiting ids in order, free blocks, usage, cumulative
preemptions, prefix-cache queries and hits, scheduled tokens and block ids per request.
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

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
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
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config)
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
    if got != want:  # vLLM resizes some limits on construction: the trace must run as asked
        raise SystemExit(f"vLLM changed the configuration: {got} != {want}")
    return sched


def run_story(model_dir: str, story: dict[str, Any]) -> None:
    cfg = story["config"]
    sched = build(model_dir, cfg)
    hasher = get_request_block_hasher(cfg["block_size"], sha256)
    arrivals: dict[int, list[dict[str, Any]]] = {}
    for r in story["requests"]:
        arrivals.setdefault(r["step"], []).append(r)
    outputs = {r["rid"]: r["output"] for r in story["requests"]}
    live: dict[str, Request] = {}
    queries = hits = 0
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
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = live[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([outputs[rid][len(req.output_token_ids)]] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)
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
