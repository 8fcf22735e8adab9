"""Admission usage: the share of the pool an engine's admission counts as taken.

A waiting request is admitted only when the pool's free room (available + evictable) holds it,
so the pool is the limit as soon as the room left is smaller than what the next request needs,
which can happen well before the usage gauge reads 1:

- every engine must find room for the next request's uncached prompt;
- an engine whose admission reserves room for output (it reports a reserve ratio) also charges
  the next request its whole output, and holds back ``ratio x remaining output`` for every
  running request. Such an engine refuses a request while its usage gauge reads 0.93-0.97 (with
  long ``max_tokens``, far lower), and its usage is never pinned at 1.

Per sample, over the check span::

    need      = prompt x (1 - hit ratio)  [+ min(output, clip) x (1 + reserve_ratio x running)]
    admission = min(1, usage + need / capacity)

``prompt`` and ``output`` are tokens per finished request over the span (over the engine's
lifetime when none finished in it), ``hit ratio`` the prefix-cache hit ratio over the span from
counters. The running requests' remaining output is estimated by the mean output of finished
requests: the engine reserves ``max_tokens - generated`` per request and does not export
``max_tokens``; clients ask for at least what they get, and a running request is on average
halfway through, so the estimate lies between the two (clients asking for far more than they
get make the real reserve larger, and the check can still miss it). ``clip`` is the most output
the engine charges one request (from its adapter). Where an input is
missing, admission usage is the usage gauge (``basis`` says which input). PromQL twin:
``instance:kvdiag_kv_admission_usage:ratio*`` in ``kvdiag.render.normalize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdiag import engines
from kvdiag.checks.base import counter_ratio, per_request, recent
from kvdiag.config import Config
from kvdiag.window import Window


@dataclass(frozen=True)
class AdmissionUsage:
    """Usage and admission usage per sample of the check span (absent usage dropped)."""

    ts: np.ndarray
    usage: np.ndarray
    admission: np.ndarray
    need_tokens: np.ndarray  # the room counted as taken beyond the usage gauge
    prompt_per_request: float | None
    output_per_request: float | None
    hit_ratio: float | None
    reserve_ratio: float | None  # at the newest sample
    basis: str  # "usage, uncached prompt and output reserve" | "usage and uncached prompt" | "usage only: ..."


def admission_usage(window: Window, config: Config) -> AdmissionUsage:
    """Admission usage over the check span (see the module docstring)."""
    w = recent(window, config)
    usage_all = w.column("usage_ratio")
    keep = ~np.isnan(usage_all)
    ts, usage = w.column("ts")[keep], usage_all[keep]
    capacity = w.column("capacity_tokens")[keep]
    reserve = w.column("decode_reserve_ratio")[keep]
    running = np.nan_to_num(w.column("running")[keep])
    prompt, _ = per_request(window, config, "prompt_tokens_total")
    output, _ = per_request(window, config, "generation_tokens_total")
    hit = _hit_ratio(window, config)
    clip = _output_clip(window.engine)
    reserve_last = float(reserve[-1]) if len(reserve) and not np.isnan(reserve[-1]) else None

    missing = [name for name, v in (("tokens per request", prompt), ("prefix hit ratio", hit)) if v is None]
    if np.isnan(capacity).all():
        missing.insert(0, "pool capacity")
    if missing or prompt is None or hit is None:  # (the last two only narrow the types)
        zeros = np.zeros(len(usage))
        return AdmissionUsage(ts, usage, usage, zeros, prompt, output, hit, reserve_last, "usage only: no " + ", ".join(missing))

    need = np.full(len(usage), prompt * (1.0 - hit))
    basis = "usage and uncached prompt"
    if output is not None and not np.isnan(reserve).all():  # the engine reserves output
        charged = min(output, clip) if clip else output
        need += np.nan_to_num(charged * (1.0 + reserve * running))
        basis = "usage, uncached prompt and output reserve"
    admission = np.where(np.isnan(capacity), usage, np.minimum(1.0, usage + need / capacity))
    return AdmissionUsage(ts, usage, admission, need, prompt, output, hit, reserve_last, basis)


def _hit_ratio(window: Window, config: Config) -> float | None:
    """The prefix hit ratio over the span, from counters only (as the PromQL twin reads it)."""
    if not (window.has("prefix_query_tokens_total") and window.has("prefix_hit_tokens_total")):
        return None
    return counter_ratio(window, config, "prefix_hit_tokens_total", "prefix_query_tokens_total")[1]


def _output_clip(engine: str) -> int | None:
    """The engine's cap on the output one request is charged (its adapter knows it)."""
    try:
        return engines.output_reserve_clip(engine)
    except KeyError:
        return None
