"""Admission usage: the share of the pool an engine's admission counts as taken.

A waiting request is admitted only when the pool's free room (available + evictable) holds it,
so the pool is the limit as soon as the room left is smaller than what the next request needs,
which can happen well before the usage gauge reads 1:

- every engine must find room for the next request's uncached prompt;
- an engine whose admission reserves room for output (it reports a reserve ratio) also charges
  the next request its whole output, and holds back ``ratio x remaining output`` for every
  running request. Such an engine refuses a request while its usage gauge reads 0.93-0.97 (with
  long ``max_tokens``, far lower), and its usage is never pinned at 1.

- an engine whose usage gauge is read after a step's finished requests free their room (its
  adapter says so: ``engines.usage_after_frees``) shows that room as free, yet the next step's
  admission refills it at once. With short answers a step frees a large share of the pool, so
  the gauge reads 0.85-0.90 while admission is refused at every step. In steady state a request
  lives ``steps = output + chunks - 1`` steps (``chunks = ceil(uncached prompt / chunk)``: a
  prompt longer than the engine's default step budget, from its adapter, is prefilled over
  several steps, the last of which yields the first output token) and the running requests (the
  gauge, after the frees) hold ``usage x (steps - 1) / steps`` of what they held at the peak, so
  one step frees ``usage / (steps - 1)`` of the pool (``freed``; nothing where output <= 1: a
  request that lives one step is bounded by the step's token budget, not the pool). Counting
  the chunks only lowers the estimate (the budget is the smallest default, and decodes share
  it), so long chunked prompts are not read as a step freeing more than it does.

- a decode instance of a prefill/decode pair whose engine preallocates a transferred request's
  slots before its KV arrives, keeping a reserve per request (its adapter says how many tokens:
  ``engines.decode_reserved_tokens``), admits from its pre-allocation queue against the whole
  prompt (the KV comes by transfer: no local prefix hit lowers it) plus that reserve for every
  running and transferring request and for the one admitted, and charges no output reserve::

      need = prompt + reserved x (running + transferring + 1)

  (``transferring``: the deferred queues, the requests whose KV is on its way; requests the
  decode scheduler has received but not yet run also hold a reserve and are not counted, so
  the need is a lower bound).

At the evaluation instant (the newest sample)::

    need      = prompt x (1 - hit ratio)  [+ min(output, clip) x (1 + reserve_ratio x running)]
    admission = min(1, usage + need / capacity [+ usage / (output - 1 + chunks - 1)])

``prompt`` and ``output`` are tokens per finished request, ``rate(tokens[window]) /
rate(requests[window])``, and ``hit ratio`` is ``rate(hits[window]) / rate(queries[window])``
(an old engine without hit counters: the mean of its hit-rate gauge),
each rate computed exactly as PromQL does (``kvdiag.checks.stats``), so the recorded series
``instance:kvdiag_kv_admission_need:ratio*`` is this very figure. The running requests'
remaining output is estimated by the mean output of finished
requests: the engine reserves ``max_tokens - generated`` per request and does not export
``max_tokens``; clients ask for at least what they get, and a running request is on average
halfway through, so the estimate lies between the two (clients asking for far more than they
get make the real reserve larger, and the check can still miss it). ``clip`` is the most output
the engine charges one request (from its adapter). Where an input is missing (no request
finished in the window, no hit counters, a single sample: PromQL has no rate there either),
the need is 0 and admission usage is the usage gauge (``basis`` says which input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvdiag import engines
from kvdiag.checks.base import gauge_hit_ratio, rate_of, recent
from kvdiag.config import Config
from kvdiag.window import Window


@dataclass(frozen=True)
class AdmissionUsage:
    """The usage gauge over the check span, and what the next admission needs at its end."""

    ts: np.ndarray  # usage samples of the check span (absent usage dropped)
    usage: np.ndarray
    need_tokens: float  # the room counted as taken beyond the usage gauge, at the newest sample
    need_ratio: float  # need_tokens / capacity (0 where an input is missing)
    freed_ratio: float  # the share of the pool one step frees, where the gauge is read after frees (in need_ratio)
    admission: float  # min(1, usage + need_ratio) at the newest sample
    prompt_per_request: float | None
    output_per_request: float | None
    hit_ratio: float | None
    reserve_ratio: float | None  # at the newest sample
    basis: str  # "usage, uncached prompt and output reserve" | "usage and uncached prompt" | "usage only: ..."


def admission_usage(window: Window, config: Config) -> AdmissionUsage:
    """Admission usage at the window's newest sample (see the module docstring)."""
    w = recent(window, config)
    ts, usage = w.points("usage_ratio")
    prompt = _per_request(w, config, "prompt_tokens_total")
    output = _per_request(w, config, "generation_tokens_total")
    counters = w.has("prefix_hit_tokens_total") and w.has("prefix_query_tokens_total")
    hit = _ratio(w, config, "prefix_hit_tokens_total", "prefix_query_tokens_total") if counters else gauge_hit_ratio(w, config)
    last = w.last
    capacity, reserve, running = last.capacity_tokens, last.decode_reserve_ratio, last.running
    missing = [name for name, v in (("tokens per request", prompt), ("prefix hit ratio", hit)) if v is None]
    if not capacity:
        missing.insert(0, "pool capacity")
    usage_last = float(usage[-1]) if len(usage) else float("nan")
    per_request = _decode_reserved(window.engine) if last.role == "decode" else None
    if per_request is not None and prompt is not None and capacity and running is not None:
        # a decode instance that preallocates transferred prompts whole, with a reserve per request
        holders = running + (last.waiting_deferred or 0.0) + 1
        need = prompt + per_request * holders
        basis = f"usage, whole transferred prompt and {per_request:g} reserved tokens per running, transferring and next request"
        return AdmissionUsage(ts, usage, need, need / capacity, 0.0, min(1.0, usage_last + need / capacity), prompt, output, hit, reserve, basis)
    if missing or prompt is None or hit is None or not capacity:  # (the last three only narrow the types)
        basis = "usage only: no " + ", ".join(missing)
        return AdmissionUsage(ts, usage, 0.0, 0.0, 0.0, usage_last, prompt, output, hit, reserve, basis)
    need = prompt * (1 - hit)
    basis = "usage and uncached prompt"
    if output is not None and reserve is not None and running is not None:  # the engine reserves output
        clip = _output_clip(window.engine)
        charged = min(output, clip) if clip else output
        need = need + charged * (1 + reserve * running)
        basis = "usage, uncached prompt and output reserve"
    freed = 0.0
    if _usage_after_frees(window.engine) and output is not None and output > 1 and len(usage):
        chunk = _prefill_chunk(window.engine)
        chunks = math.ceil(prompt * (1 - hit) / chunk) if chunk else 1
        freed = usage_last / (output - 1 + max(0, chunks - 1))
        basis += " and the room one step frees"
    ratio = need / capacity + freed
    need = need + freed * capacity
    return AdmissionUsage(ts, usage, need, ratio, freed, min(1.0, usage_last + ratio), prompt, output, hit, reserve, basis)


def _per_request(w: Window, config: Config, field: str) -> float | None:
    """Tokens per finished request, ``rate(tokens) / (rate(requests) > 0)``."""
    requests = rate_of(w, config, "requests_total")
    tokens = rate_of(w, config, field)
    return tokens / requests if requests and tokens is not None else None


def _ratio(w: Window, config: Config, num: str, den: str) -> float | None:
    """``rate(num) / rate(den)``; None where PromQL has no number (absent, or 0 / 0)."""
    n, d = rate_of(w, config, num), rate_of(w, config, den)
    if n is None or d is None or (n == 0 and d == 0):
        return None
    return n / d if d else None


def _usage_after_frees(engine: str) -> bool:
    """Whether the engine's usage gauge is read after the step's frees (its adapter knows it)."""
    try:
        return engines.usage_after_frees(engine)
    except KeyError:
        return False


def _decode_reserved(engine: str) -> int | None:
    """Tokens a decode instance keeps out per request (its adapter knows it; None: classic)."""
    try:
        return engines.decode_reserved_tokens(engine)
    except KeyError:
        return None


def _prefill_chunk(engine: str) -> int | None:
    """The most prompt tokens the engine prefills in one step by default (its adapter knows it)."""
    try:
        return engines.prefill_chunk_tokens(engine)
    except KeyError:
        return None


def _output_clip(engine: str) -> int | None:
    """The engine's cap on the output one request is charged (its adapter knows it)."""
    try:
        return engines.output_reserve_clip(engine)
    except KeyError:
        return None
