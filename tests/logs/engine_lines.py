"""Server logs written by the engines' own logging code, from their unpacked wheels.

Run as ``python -m tests.logs.engine_lines vllm|sglang SRC TRUTH.json`` (``SRC`` =
``KVDIAG_ENGINE_SRC``, see ``scripts/engine-src.sh``); the log goes where the engine writes it
(vLLM: stdout, SGLang: stderr), the story's ground truth to ``TRUTH.json``. A subprocess, so that
the engines' logging configuration and stubs never touch the test process. ``TZ`` should be UTC.

The story, for both engines: a healthy stretch, then the pool pins near 1, the waiting queue
grows and the engine recomputes running requests (vLLM preempts, SGLang retracts).

What is the engine's own code, and what stands in for the rest:

* vLLM 0.33.0, imported from ``SRC``: ``vllm.logger`` (its logging config, formatter and
  ``(APIServer pid=N)`` record factory, set up by ``_configure_vllm_root_logger``),
  ``vllm.envs``, ``vllm.logging_utils``, ``vllm.v1.metrics.loggers`` (``LoggingStatLogger``:
  ``record`` then ``log`` every 10 s), ``vllm.v1.metrics.stats`` (``SchedulerStats``,
  ``IterationStats``, ``PrefixCacheStats``), ``vllm.entrypoints.common.startup``
  (``log_version_and_model``, the start-up logo with the version). Every other ``vllm`` module
  is a stub (``_Anything``): they build Prometheus metrics, connectors, CUDA graphs, configs.
  The ``VllmConfig`` is a namespace with the five attributes the logger reads (CUDA device, no
  connectors, no cudagraph/MFU metrics).
* SGLang 0.5.23, executed from the wheel's source (``ast``: the named definitions only, the
  modules import torch and the whole runtime): ``utils/common.py: configure_logger``,
  ``managers/scheduler.py: configure_scheduler_process`` (the ``[time TP0]`` prefix) and
  ``Scheduler.update_running_batch`` (the retract warning), ``scheduler_components/
  metrics_reporter.py: PrefillStats, SchedulerMetricsReporter.report_prefill_stats,
  report_decode_stats`` (Decode / Prefill batch lines), ``pool_stats_observer.py: PoolStats``
  (the usage parts of those lines). Stand-ins: the scheduler and batch (namespaces holding the
  story's counts; ``retract_decode`` returns the story's victims), the reporter's fields that
  its ``_init_metrics`` would set (``cuda graph`` label, ``decode_log_interval`` 40, metrics
  off), ``get_parallel`` (TP size 2, rank 0), ``envs`` (defaults: no ms stamps, no test
  retraction, no CPU affinity), ``get_disagg`` (no disaggregation), ``setproctitle``/
  ``faulthandler``/hub logger/flashinfer/NUMA binding (no-ops).

Both engines' clocks are the story's: a logging filter stamps each record with it (the
formatters then print it as they would), and the modules' ``time`` reads it.
"""

from __future__ import annotations

import __future__

import ast
import dataclasses
import enum
import importlib
import importlib.abc
import importlib.util
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

#: The story (both engines): seconds healthy, seconds saturated, from this Unix time.
START = 1_795_950_000.0  # 2026-11-29 11:00:00 UTC
HEALTHY_S = 180
SATURATED_S = 420
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class _Anything:
    """Any object of a module that takes no part in formatting: callable, subclassable, usable
    in ``X | None`` and as a decorator; its attributes are more of the same; falsy, empty."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())


class _StubModule(types.ModuleType):
    """A package whose every name is an ``_Anything`` class, made on first use."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules are stubs as well

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Anything,), {})
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: Any) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing runs: the stub's names appear as they are asked for."""


class _Finder(importlib.abc.MetaPathFinder):
    """``real`` modules of ``package`` from ``root``; a stub for every other one."""

    def __init__(self, package: str, root: str, real: tuple[str, ...]) -> None:
        self.package, self.root, self.real = package, Path(root), real

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] != self.package:
            return None
        if fullname not in self.real:
            return importlib.util.spec_from_loader(fullname, _StubLoader(), is_package=True)
        base = self.root / fullname.replace(".", "/")
        if (base / "__init__.py").exists():
            return importlib.util.spec_from_file_location(fullname, base / "__init__.py",
                                                          submodule_search_locations=[str(base)])
        return importlib.util.spec_from_file_location(fullname, f"{base}.py")


class Clock:
    """The story's time: ``monotonic``/``perf_counter``/``time`` for the engines' modules, and a
    logging filter that stamps records with it."""

    def __init__(self, start: float) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    perf_counter = time = monotonic

    def stamp(self, record: logging.LogRecord) -> bool:
        record.created = self.now
        record.msecs = (self.now % 1) * 1000
        return True


def _stamp_handlers(logger: logging.Logger, clock: Clock) -> None:
    for handler in logger.handlers:
        handler.addFilter(clock.stamp)


def saturated(t: float) -> bool:
    return t - START >= HEALTHY_S


# ---------------------------------------------------------------- vLLM


def vllm_log(root: str) -> dict[str, Any]:
    real = ("vllm.envs", "vllm.logger", "vllm.logging_utils", "vllm.logging_utils.formatter",
            "vllm.v1.metrics.loggers", "vllm.v1.metrics.stats", "vllm.v1.metrics.cache_hit_source",
            "vllm.entrypoints.common.startup", "vllm._version")
    sys.meta_path.insert(0, _Finder("vllm", root, real))
    import vllm.envs  # noqa: F401  (before startup's `from vllm import envs`)
    import vllm.logger as vllm_logger  # type: ignore[import-not-found]
    from vllm._version import __version__  # type: ignore[import-not-found]

    vllm_logger._configure_vllm_root_logger()
    vllm_logger.set_vllm_process_name("APIServer")
    clock = Clock(START)
    _stamp_handlers(logging.getLogger("vllm"), clock)
    startup = importlib.import_module("vllm.entrypoints.common.startup")
    loggers = importlib.import_module("vllm.v1.metrics.loggers")
    stats = importlib.import_module("vllm.v1.metrics.stats")

    loggers.time = clock
    startup.log_version_and_model(startup.logger, __version__, MODEL)
    config = types.SimpleNamespace(
        device_config=types.SimpleNamespace(device_type="cuda"), model_config=None, kv_transfer_config=None,
        ec_transfer_config=None, observability_config=types.SimpleNamespace(cudagraph_metrics=False, enable_mfu_metrics=False),
    )
    stat_logger = loggers.LoggingStatLogger(config, engine_index=0)
    preemptions, waiting = 0, 0
    stat_logger.last_log_time = clock.now
    end = START + HEALTHY_S + SATURATED_S
    while clock.now < end:
        for _ in range(10):  # one engine step a second, a stats line every 10 s
            clock.now += 1.0
            full = saturated(clock.now)
            frac = min(1.0, (clock.now - START) / HEALTHY_S)
            waiting = waiting + 1 if full else 0
            preempted = 1 + int(clock.now) % 2 if full else 0
            preemptions += preempted
            it = stats.IterationStats()
            it.num_generation_tokens = 64 if full else 20
            it.prompt_token_stats.computed = 512
            it.num_preempted_reqs = preempted
            sched = stats.SchedulerStats(
                num_running_reqs=64 if full else int(10 + 30 * frac), num_waiting_reqs=waiting,
                kv_cache_usage=(0.995 + 0.005 * (int(clock.now) % 2)) if full else 0.30 + 0.40 * frac,
                prefix_cache_stats=stats.PrefixCacheStats(requests=2, queries=4096, hits=3584),
            )
            stat_logger.record(sched, it)
        stat_logger.log()
    return {"version": __version__, "start": START, "saturated_from": START + HEALTHY_S, "end": clock.now,
            "evictions": preemptions}


# ---------------------------------------------------------------- SGLang


def definitions(path: Path, names: tuple[str, ...], module: str, **env: Any) -> dict[str, Any]:
    """The named top-level definitions (``Class.method`` for a method, ``name`` for an
    assignment) of a wheel's source file, executed in a namespace holding ``env``, annotations
    left unevaluated. Nothing else of the file runs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    picked: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            picked.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            picked.append(node)
        if isinstance(node, ast.ClassDef):
            picked += [m for m in node.body if isinstance(m, ast.FunctionDef) and f"{node.name}.{m.name}" in names]
    found = {getattr(n, "name", None) or n.targets[0].id for n in picked}  # type: ignore[attr-defined]
    missing = {n.split(".")[-1] for n in names} - found
    assert not missing, f"{path}: no {sorted(missing)}"
    mod = sys.modules[module] = types.ModuleType(module)  # dataclasses look their module up
    mod.__dict__.update(env)
    code = compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, mod.__dict__)
    return mod.__dict__


class _Env:
    """``envs.NAME.get()`` as SGLang reads its environment, with the defaults."""

    def __getattr__(self, name: str) -> Any:
        return types.SimpleNamespace(get=lambda: False)


class _DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def sglang_log(root: str) -> dict[str, Any]:
    srt = Path(root) / "sglang/srt"
    clock = Clock(START)
    nothing = _Anything()
    common = definitions(srt / "utils/common.py", ("configure_logger",), "sglang.srt.utils.common",
                         os=os, logging=logging, envs=_Env(), configure_hf_hub_logger=nothing,
                         parent_process=lambda: None, is_flashinfer_available=lambda: False)
    parallel = types.SimpleNamespace(dp_rank=None, tp_rank=0, moe_ep_rank=0, pp_size=1, attn_cp_size=1,
                                     moe_dp_size=1, tp_size=2, ep_size=1)
    sched = definitions(
        srt / "managers/scheduler.py", ("configure_scheduler_process", "Scheduler.update_running_batch", "logger"),
        "sglang.srt.managers.scheduler", logging=logging, get_parallel=lambda: parallel,
        kill_itself_when_parent_died=nothing, setproctitle=nothing, faulthandler=nothing,
        configure_logger=common["configure_logger"], suppress_other_loggers=nothing,
        TEST_RETRACT=False, TEST_RETRACT_INTERVAL=3, _make_abort_req=nothing, envs=_Env(),
        get_numa_node_if_available=lambda *args: None,
    )
    sched["configure_scheduler_process"](types.SimpleNamespace(log_level="info"), 0)
    _stamp_handlers(logging.getLogger(), clock)
    pools = definitions(srt / "managers/scheduler_components/pool_stats_observer.py", ("PoolStats",),
                        "sglang.srt.managers.scheduler_components.pool_stats_observer", dataclasses=dataclasses)
    rep = definitions(
        srt / "managers/scheduler_components/metrics_reporter.py",
        ("PrefillStats", "SchedulerMetricsReporter.report_prefill_stats", "SchedulerMetricsReporter.report_decode_stats",
         "logger"),
        "sglang.srt.managers.scheduler_components.metrics_reporter", logging=logging, dataclasses=dataclasses,
        time=clock, LOG_FORWARD_ITERS=False, RECORD_STEP_TIME=False, ENABLE_METRICS_DEVICE_TIMER=False,
        DisaggregationMode=_DisaggregationMode, get_disagg=lambda: types.SimpleNamespace(language_only=False),
    )
    capacity = 200_000
    scheduler = types.SimpleNamespace(
        waiting_queue=[], forward_ct=0, disaggregation_mode=_DisaggregationMode.NULL, kv_events_publisher=nothing,
        spec_algorithm=types.SimpleNamespace(is_none=lambda: True), pool_stats_observer=None,
    )
    reporter = types.SimpleNamespace(
        scheduler=scheduler, is_stats_logging_rank=True, current_scheduler_metrics_enabled=False,
        last_prefill_stats_tic=clock.now, last_decode_stats_tic=clock.now, last_input_throughput=0.0,
        last_gen_throughput=0.0, num_generated_tokens=0, forward_ct_decode=0, decode_log_interval=40,
        enable_mfu_metrics=False, _graph_backend_label="cuda graph", stats=types.SimpleNamespace(),
        enable_metrics=False, num_retracted_reqs=0,
    )
    used = [0]
    scheduler.pool_stats_observer = types.SimpleNamespace(get_pool_stats=lambda: pools["PoolStats"](
        full_num_used=used[0], full_token_usage=used[0] / capacity, full_available_size=capacity - used[0],
        full_evictable_size=0, full_capacity=capacity))
    running = types.SimpleNamespace(reqs=[], forward_iter=None)
    retracted_total = 0
    ratio = types.SimpleNamespace(current=0.3)
    end = START + HEALTHY_S + SATURATED_S
    step = 0
    while clock.now < end:
        step += 1
        clock.now += 0.05  # a decode step every 50 ms: a Decode batch line every 2 s
        full = saturated(clock.now)
        frac = min(1.0, (clock.now - START) / HEALTHY_S)
        used[0] = int(capacity * ((0.985 + 0.01 * (step % 2)) if full else 0.40 + 0.45 * frac))
        running.reqs = [None] * (60 if full else int(10 + 40 * frac))
        if full and step % 40 == 0:
            scheduler.waiting_queue.append(None)
        if step % 60 == 0:  # a prefill batch every 3 s
            rep["report_prefill_stats"](
                reporter, None,
                rep["PrefillStats"](log_input_tokens=512, log_hit_tokens=3584, new_token_ratio=ratio.current,
                                    num_running_reqs=types.SimpleNamespace(total=len(running.reqs)), num_new_seqs=1),
                False,
            )
        if full and step % 240 == 0:  # the pool runs out every 12 s
            victims = 1 + (step // 240) % 3
            retracted_total += victims
            _retract(sched["update_running_batch"], running, victims, ratio, used, capacity)
        reporter.forward_ct_decode += 1
        reporter.num_generated_tokens += len(running.reqs)
        rep["report_decode_stats"](reporter, True, running)
    return {"version": _sglang_version(root), "start": START, "saturated_from": START + HEALTHY_S, "end": clock.now,
            "evictions": retracted_total}


def _retract(update_running_batch: Any, running: Any, victims: int, ratio: Any, used: list[int], capacity: int) -> None:
    """One decode step that finds the pool full: the Scheduler's own method, on a batch whose
    memory check fails and whose ``retract_decode`` frees ``victims`` requests."""
    freed = 646 * victims

    def retract_decode() -> tuple[list[Any], float, list[Any]]:
        used[0] -= freed
        return [types.SimpleNamespace()] * victims, min(1.0, ratio.current + 0.2), []

    batch = types.SimpleNamespace(
        batch_size=lambda: len(running.reqs), filter_batch=lambda **kw: None, is_empty=lambda: False,
        check_decode_mem=lambda: False, retract_decode=retract_decode, prepare_for_decode=lambda: None,
        batch_is_full=True,
    )
    scheduler = types.SimpleNamespace(
        _reqs_finishing_inflight=lambda b: [], decode_offload_manager=None, new_token_ratio_tracker=ratio,
        token_to_kv_pool_allocator=types.SimpleNamespace(available_size=lambda: capacity - used[0]),
        tree_cache=types.SimpleNamespace(req_to_token_pool=types.SimpleNamespace()),
        metrics_reporter=types.SimpleNamespace(enable_metrics=False, num_retracted_reqs=0),
        _add_request_to_queue=lambda req, is_retracted: None, forward_ct=0,
    )
    update_running_batch(scheduler, batch)


def _sglang_version(root: str) -> str:
    return definitions(Path(root) / "sglang/_version.py", ("__version__",), "sglang._version")["__version__"]


if __name__ == "__main__":
    engine, src, truth = sys.argv[1:4]
    story = vllm_log(src) if engine == "vllm" else sglang_log(src)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    Path(truth).write_text(json.dumps(story))
