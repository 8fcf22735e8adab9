"""SGLang 0.5.23's own ``Scheduler`` over request traces, one JSON line of state per step.

Run by the oracle environment's python (``scripts/oracle-env.sh``), never the main venv. Reads
``{"stories": [{"name", "config", "requests": [{"rid", "step", "prompt", "output"}]}]}`` on
stdin. The full Scheduler is a ZMQ process; like SGLang's CPU unit tests, this builds
``Scheduler.__new__`` and sets only the attributes the methods it runs read (values as
``Scheduler.__init__`` would set them from the published server args), over the real
``TokenToKVPoolAllocator`` (``PagedTokenToKVPoolAllocator`` for page_size > 1) on a small CPU
``MHATokenToKVPool``, ``ReqToTokenPool``, the ``UnifiedRadixCache`` 0.5.23 builds by default
(``mem_cache/registry.py``; full attention only), ``SchedulePolicy`` and real ``Req`` objects
(``init_req_max_new_tokens``, ``_add_request_to_queue``). A story with ``hicache_write_policy``
also runs the tree's own ``init_hicache``: the ``MHATokenToKVPoolHost`` host pool on CPU and the
``HybridCacheController`` (direct IO, layer-first layout), so backups, host eviction, load backs
and their acks (``check_hicache_events`` at the top of each iteration) are SGLang's. Each step is one iteration
of ``event_loop_normal`` (overlap off): ``get_next_batch_to_run`` (merge, filter,
``get_new_batch_prefill`` with ``PrefillAdder``, ``update_running_batch`` with
``check_decode_mem`` / ``retract_decode`` and the new_token_ratio update), then
``process_batch_result`` with the trace's next output token per request, or ``on_idle``.

Replaced: the forward (the trace's tokens), output streaming, load publishing and metrics
reporting (no-ops); for HiCache, the two byte-moving calls ``L2TransferEngine.submit_device_to_host``
/ ``submit_host_to_device`` (CUDA copies on streams: nothing is copied and each completion is
already done, so every ack is taken at the next poll) and ``cudaHostRegister`` of the host buffer. Stand-in modules (``stubs.py``), none of which take part in admission,
retraction or accounting: ``triton`` (kernels; no launch on this path), ``torchvision`` (its
wheel fails beside the CPU torch), ``setproctitle`` and ``uvicorn`` (process title, HTTP
server).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from array import array
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stubs  # noqa: E402
import tiny_model  # noqa: E402

stubs.install(("triton", "torchvision", "setproctitle", "uvicorn"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor  # noqa: E402
from sglang.srt.managers.scheduler_components.logprob_result_processor import SchedulerLogprobResultProcessor  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.managers import schedule_policy  # noqa: E402
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.l2_transfer import L2TransferEngine, TransferCompletion  # noqa: E402
from sglang.srt.mem_cache.pool_host import common as host_common  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_parallel, publish  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402


class HostTransfers:
    """Tokens each direction was asked to move (``sglang:hicache_backup_tokens_total``,
    ``sglang:load_back_tokens_total``) by the stand-ins below."""

    backup_tokens = 0
    load_back_tokens = 0


def _done() -> TransferCompletion:
    return TransferCompletion(torch.cpu.Event(), torch.cpu.Event(), False)


def device_to_host(engine: L2TransferEngine, transfers: list[Any]) -> TransferCompletion:
    """Stands for ``L2TransferEngine.submit_device_to_host``. With ``host_to_device``, the only
    HiCache code that moves bytes (CUDA copies on streams): nothing is copied and the completion's
    events are already done (``torch.cpu.Event``), so every ack is ready at the next
    ``check_hicache_events``. What is written, loaded, evicted and when each ack is taken stays
    SGLang's."""
    HostTransfers.backup_tokens += sum(len(t.device_indices) for t in transfers)
    return _done()


def host_to_device(
    engine: L2TransferEngine, transfers: list[Any], *, transfer_layer_id_max: int, start_event: Any = None,
    on_layer_done: Any = None,
) -> TransferCompletion:  # fmt: skip
    """Stands for ``L2TransferEngine.submit_host_to_device`` (see ``device_to_host``); every layer
    is reported loaded."""
    HostTransfers.load_back_tokens += sum(len(t.device_indices) for t in transfers)
    for layer in range(transfer_layer_id_max):
        if on_layer_done is not None:
            on_layer_done(layer)
    return _done()


L2TransferEngine.submit_device_to_host = device_to_host  # type: ignore[method-assign]
L2TransferEngine.submit_host_to_device = host_to_device  # type: ignore[method-assign]
# Page-locking the host pool (cudaHostRegister) needs CUDA; an unpinned CPU buffer holds the same slots.
host_common._cuda_host_register = lambda buffer, granularity=None: None


class OracleScheduler(Scheduler):
    """The real Scheduler's methods; a missing attribute names itself instead of hiding."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"oracle scheduler lacks attribute {name!r}")


ARGS: list[ServerArgs] = []  # the args published for the story being run


def hicache_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """HiCache server args for a story with ``hicache_write_policy`` (host pool in cache mode,
    ``hicache_ratio`` x L1; direct IO over a layer-first host layout, the CPU-indexable pair)."""
    if not cfg.get("hicache_write_policy"):
        return {}
    return {
        "enable_hierarchical_cache": True, "hicache_ratio": cfg["hicache_ratio"],
        "hicache_write_policy": cfg["hicache_write_policy"], "hicache_io_backend": "direct",
        "hicache_mem_layout": "layer_first",
    }  # fmt: skip


def publish_args(model_dir: str, cfg: dict[str, Any]) -> None:
    """The published server args the scheduler's config bags read (``runtime_context``)."""
    args = ServerArgs(
        model_path=model_dir, device="cpu", skip_tokenizer_init=True, page_size=cfg["page_size"],
        chunked_prefill_size=cfg["chunked_prefill_size"], max_prefill_tokens=cfg["max_prefill_tokens"],
        schedule_conservativeness=cfg["schedule_conservativeness"], max_running_requests=cfg["max_running_requests"],
        max_total_tokens=cfg["max_total_num_tokens"], context_length=cfg["context_len"], schedule_policy="fcfs",
        **hicache_args(cfg),
    )  # fmt: skip
    publish(args, role="scheduler")
    ARGS[:] = [args]
    get_parallel().override_permanently(pp_max_micro_batch_size=cfg["max_running_requests"])


class MetricsReporter:
    """Stands for ``SchedulerMetricsReporter``: reports nothing (every method a no-op)."""

    num_retracted_reqs = 0
    num_generated_tokens = 0
    forward_ct_decode = 0
    enable_metrics = False

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def build(cfg: dict[str, Any]) -> OracleScheduler:
    s = OracleScheduler.__new__(OracleScheduler)
    size, page = cfg["max_total_num_tokens"], cfg["page_size"]
    s.page_size = page
    s.max_total_num_tokens = size
    s.max_running_requests = cfg["max_running_requests"]
    s.req_to_token_pool = ReqToTokenPool(cfg["max_running_requests"], cfg["context_len"] + 4, "cpu", False)
    kv = MHATokenToKVPool(size, page, torch.float16, 1, 1, 1, "cpu", False)
    alloc_cls = TokenToKVPoolAllocator if page == 1 else PagedTokenToKVPoolAllocator
    s.token_to_kv_pool_allocator = (
        alloc_cls(size, torch.float16, "cpu", kv, False) if page == 1 else alloc_cls(size, page, torch.float16, "cpu", kv, False)
    )
    # 0.5.23's default tree (registry.create_unified_radix_cache): the unified tree, full attention only
    params = CacheInitParams(False, s.req_to_token_pool, s.token_to_kv_pool_allocator, page, tree_components=(ComponentType.FULL,))
    s.tree_cache = UnifiedRadixCache(params)
    s.enable_hierarchical_cache = bool(cfg.get("hicache_write_policy"))
    if s.enable_hierarchical_cache:  # host pool and HybridCacheController, as create_unified_radix_cache does
        s.tree_cache.init_hicache(ARGS[0], params)
    s.policy = SchedulePolicy("fcfs", s.tree_cache, False, False, False)
    s.waiting_queue = []
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    s.last_batch = None
    s.chunked_req = None
    s.chunked_prefill_size = cfg["chunked_prefill_size"]
    s.max_prefill_tokens = cfg["max_prefill_tokens"]
    s.max_req_len = min(cfg["context_len"] - 1, size - 1)
    s.max_req_input_len = s.max_req_len - 5
    s.server_args = ARGS[0]
    s.model_config = ModelConfig.from_server_args(s.server_args)
    s.device = "cpu"
    s.max_new_tokens_limit = None
    s.kv_shard_widening = 1
    s.max_queued_requests = None
    s.disaggregation_mode = DisaggregationMode.NULL
    s.disagg_prefill_bootstrap_queue = s.disagg_decode_prealloc_queue = s.disagg_decode_transfer_queue = None
    s.enable_overlap = s.enable_overlap_mlx = False
    s.enable_skip_finishing_decode = False
    s.enable_priority_scheduling = s.enable_priority_preemption = False
    s.abort_on_priority_when_disabled = False
    s.schedule_low_priority_values_first = False
    s.priority_scheduling_preemption_threshold = 10
    s.enable_hicache_storage = s.enable_lmcache = s.enable_hisparse = False
    s.enable_unified_cache_external_linker = s.enable_unified_memory = s.enable_lora = False
    s.is_hybrid_swa = False
    s.sliding_window_size = None
    s.is_mixed_chunk = False
    s.is_generation = True
    s.dllm_config = None
    s.hisparse_coordinator = None
    s.decode_offload_manager = None
    s.dynamic_chunk_sizer = None
    s.min_free_slots_delayer = None
    s.prefill_delayer = None
    s.prefill_decode_interval = 0
    s._prefill_decode_interval_remaining = 0
    s.truncation_align_size = None
    s._pending_chunked_abort_req = None
    s.processed_tokens_counter = 0
    s.forward_ct = 0
    s.max_prefill_bs = 0
    s.result_queue = deque()
    s.require_mlp_sync = False
    s.spec_algorithm = SpeculativeAlgorithm.from_string(None)
    s.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
    s.grammar_manager = SimpleNamespace(has_waiting_grammars=lambda: False, grammar_queue=[])
    s._engine_paused = False
    s.dp_attn_adapter = SimpleNamespace(
        maybe_prepare_mlp_sync_batch=lambda batch, need_sync=False: batch,
        maybe_convert_decode_to_extend=lambda batch: batch,
        drop_sync_wait_carry=lambda: None,
    )
    s.ngram_embedding_manager = SimpleNamespace(prepare_for_forward=lambda batch, chunked_req=None: batch)
    s.beam_coordinator = SimpleNamespace(pending_member_rows=lambda batch: 0, retire_group=lambda req: None)
    s.load_inquirer = SimpleNamespace(_get_num_pending_tokens=lambda chunk_deduct=0: 0, get_loads=None)
    s.load_publisher = SimpleNamespace(publish_load_stat=lambda *a, **k: None)
    s.publish_load_snapshot = lambda force=False: None
    s._record_step_counters = lambda batch, result: None  # step-time metrics
    s.maybe_send_health_check_signal = lambda: None
    s.enable_fpm = False
    s.dllm_manager = SimpleNamespace(any_staging_reqs=lambda: False)
    s._pp_microbatches_drained = lambda: True
    s._last_stall_publish_ts = 0.0
    s.metrics_reporter = MetricsReporter()
    s.scheduler_stage_metrics = None
    s.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)
    s.batch_result_processor = SchedulerBatchResultProcessor(
        is_generation=True, disaggregation_mode=s.disaggregation_mode, enable_overlap=False, enable_overlap_mlx=False,
        model_config=s.model_config, token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, tree_cache=s.tree_cache,
        hisparse_coordinator=None, req_to_token_pool=s.req_to_token_pool, decode_offload_manager=None,
        metrics_collector=None, metrics_reporter=s.metrics_reporter, draft_worker=None, model_worker=None,
        logprob_result_processor=SchedulerLogprobResultProcessor(model_config=s.model_config),
        output_streamer=s.output_streamer, beam_coordinator=s.beam_coordinator, abort_request=s.abort_request,
    )  # fmt: skip
    s.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=None, prefill_aware_swa=False))
    return s


def hicache_state(s: OracleScheduler) -> dict[str, int]:
    """Host tokens in use, and the cumulative tokens backed up (D->H) and loaded back (H->D)."""
    host = s.tree_cache.cache_controller.mem_pool_host
    return {
        "host_used": host.size - host.available_size(), "backup_tokens": HostTransfers.backup_tokens,
        "load_back_tokens": HostTransfers.load_back_tokens,
    }  # fmt: skip


def run_story(story: dict[str, Any]) -> None:
    cfg = story["config"]
    # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: schedule_policy reads it once, at import, into this global
    schedule_policy.CLIP_MAX_NEW_TOKENS = cfg.get("clip_max_new_tokens", 4096)
    s = build(cfg)
    HostTransfers.backup_tokens = HostTransfers.load_back_tokens = 0
    arrivals: dict[int, list[dict[str, Any]]] = {}
    for r in story["requests"]:
        arrivals.setdefault(r["step"], []).append(r)
    outputs = {r["rid"]: r["output"] for r in story["requests"]}
    step, last_arrival = 0, max(arrivals)
    retractions = hits = inputs = 0
    def unfinished() -> bool:
        held = s.running_batch.reqs + (s.last_batch.reqs if s.last_batch else [])
        return bool(s.waiting_queue or s.chunked_req or any(not r.finished() for r in held))

    while step <= last_arrival or unfinished():
        for r in arrivals.get(step, []):
            params = SamplingParams(max_new_tokens=len(r["output"]), ignore_eos=cfg["ignore_eos"])
            params.normalize(None)
            req = Req(r["rid"], "", array("q", r["prompt"]), params, vocab_size=1 << 30)
            s.init_req_max_new_tokens(req)
            s._add_request_to_queue(req)
        s.metrics_reporter.num_retracted_reqs = 0
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        retractions += s.metrics_reporter.num_retracted_reqs
        scheduled: dict[str, int] = {}
        slots: dict[str, list[int]] = {}
        if batch:
            extend = batch.forward_mode.is_extend()
            if extend:
                hits += batch.prefill_stats.log_hit_tokens
                inputs += batch.prefill_stats.log_input_tokens
            rows = s.req_to_token_pool.req_to_token
            for i, r in enumerate(batch.reqs):
                scheduled[r.rid] = batch.extend_lens[i] if extend else 1
                slots[r.rid] = rows[int(batch.req_pool_indices[i]), : int(batch.seq_lens[i])].tolist()
            ids = [outputs[r.rid][min(len(r.output_ids), len(outputs[r.rid]) - 1)] for r in batch.reqs]
            s.process_batch_result(batch, GenerationBatchResult(next_token_ids=torch.tensor(ids)))
        elif s.is_fully_idle():
            s.new_token_ratio_tracker.reset()  # on_idle's only scheduling effect; its self-checks need
            # the stats observer and the invariant checker, which this driver does not build
        s.last_batch = batch  # the state as the loop holds it after this iteration: a step that finishes the
        # last request still has the decayed ratio; on_idle resets it at the next iteration that finds no batch
        tree = s.tree_cache
        print(json.dumps({
            "story": story["name"], "step": step,
            "waiting": [r.rid for r in s.waiting_queue],
            "available": s.token_to_kv_pool_allocator.available_size(), "evictable": tree.evictable_size(),
            "protected": tree.protected_size(), "retractions": retractions,
            "new_token_ratio": round(s.new_token_ratio_tracker.current, 12),
            "prefix_hits": hits, "prefill_inputs": inputs, "scheduled": scheduled, "slots": slots,
            **(hicache_state(s) if s.enable_hierarchical_cache else {}),
        }))  # fmt: skip
        step += 1


def main() -> None:
    trace = json.load(sys.stdin)
    with tempfile.TemporaryDirectory() as model_dir:
        tiny_model.write(model_dir)
        for story in trace["stories"]:
            publish_args(model_dir, story["config"])
            run_story(story)


if __name__ == "__main__":
    main()
