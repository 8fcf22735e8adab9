"""evictions_growing (E): running requests thrown out of L1 and recomputed (retract/preempt).

Read from the cumulative counter only, reset-safe (a restarted engine starts again from zero
and the new value counts as evictions since the restart), never from the last-event gauge
some versions export: that gauge holds the size of the most recent event and cannot be rated.
A counter an engine only creates on first use arrives from the adapter as a derived zero.

Its evidence carries what the evictions cost where the engine reports it: the tokens thrown
away and computed again (retracted input + output tokens), the preemptions per finished request
(a histogram some engines export), never part of the status.

It fires on the evictions of the recent span (``evictions_recent_window``, 1 m), and on those
of the whole window only while the pool stayed full since: usage + the room the next admission
needs (``checks/admission.py``) at least ``evictions_held_usage`` at every sample of the recent
span. An eviction proves the pool ran out *then*: one retraction two minutes ago with a
compute-bound queue since, the pool swinging well below full, does not make the pool the limit
now (counted over the 5-minute window it would hold ``l1_kv_pressure`` for five minutes), while
a pool that has stayed at the edge since still runs out between the samples the gauge shows.
The window's count is in the evidence (``increase``) beside the recent one (``increase_recent``).

Each increase is PromQL's (``kvdiag.checks.stats``: every drop a reset, extrapolated to the
range's edges), so the rule ``instance:kvdiag_evictions:rate1m * 60 >= 1 or (instance:kvdiag_evictions:rate5m
* 300 >= 1 and min_over_time(usage[1m]) + need >= 0.85)`` is this check.
"""

from __future__ import annotations

import numpy as np

from kvdiag.checks import stats
from kvdiag.checks.admission import admission_usage
from kvdiag.checks.base import absent, needs_window, result, since, span, too_short
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window, count_resets

NAME = "evictions_growing"


def evaluate(window: Window, config: Config) -> CheckResult:
    ts, total = span(window, config, "evictions_total")
    if len(total) == 0:
        if window.has("last_eviction_event"):
            return absent(
                NAME,
                window,
                ("evictions_total",),
                "only the last-event eviction gauge is reported; it holds the size of the most recent "
                "event and cannot be rated, so growth is unknown",
            )
        # A source that knows why the counter cannot exist says so in a note naming the field.
        why = next((n for n in window.last.notes if n.startswith("evictions_total absent")), "")
        return absent(NAME, window, ("evictions_total",), why)
    if too_short(ts, config):
        return needs_window(NAME, ts, config, {"evictions_total": float(total[-1])})
    increase = stats.rise(ts, total, window.end, config.window)
    recent = _rise_over(ts, total, window.end, config.evictions_recent_window)
    held = _held_usage(window, config)
    resets = count_resets(total)
    minutes = (ts[-1] - ts[0]) / 60.0
    values = {
        "increase": increase,
        "increase_recent": recent,
        "recent_window_s": config.evictions_recent_window,
        "held_admission_usage": held,
        "held_threshold": config.evictions_held_usage,
        "per_minute": increase / minutes if minutes > 0 else None,
        "counter_first": float(total[0]),
        "counter_last": float(total[-1]),
        "resets": resets,
        "threshold": config.min_evictions,
        "source": window.last.provenance["evictions_total"].describe() if "evictions_total" in window.last.provenance else None,
    }
    summary = (f"{increase:.0f} evictions (retract/preempt) in {ts[-1] - ts[0]:.0f}s, "
               f"{recent:.0f} in the last {config.evictions_recent_window:g}s")
    if resets:
        summary += f"; {resets} counter reset{'s' if resets > 1 else ''} (engine restart) handled"
    cost = recompute_cost(window, config)
    values.update(cost)
    if cost["recompute_tokens"] is not None:
        per = cost["recompute_tokens_per_eviction"]
        summary += f"; {cost['recompute_tokens']:,.0f} tokens thrown away to be computed again" + (f" ({per:,.0f} per eviction)" if per else "")
    if cost["preemptions_per_finished_request"] is not None:
        summary += (f"; {cost['preemptions_per_finished_request']:.2f} preemptions per finished request, "
                    f"{cost['finished_preempted_twice_or_more']:.0%} of them preempted twice or more")
    held_full = held is not None and held >= config.evictions_held_usage
    if recent < config.min_evictions and increase >= config.min_evictions:
        summary += (f"; the pool stayed full since (usage + next admission >= {held:.2f} over the last "
                    f"{config.evictions_recent_window:g}s)" if held_full else
                    "; the pool has not stayed full since" + (f" (usage + next admission down to {held:.2f})" if held is not None else ""))
    firing = recent >= config.min_evictions or (increase >= config.min_evictions and held_full)
    return result(NAME, firing, ts, values, summary)


def recent_rise(window: Window, config: Config) -> float | None:
    """The counter's rise over ``evictions_recent_window``, as the rules read it
    (``instance:kvdiag_evictions:rate1m * 60``); None where the engine reports no counter."""
    ts, total = span(window, config, "evictions_total")
    return _rise_over(ts, total, window.end, config.evictions_recent_window) if len(total) else None


def _rise_over(ts: np.ndarray, total: np.ndarray, end: float, seconds: float) -> float:
    short = stats.select(ts, end, seconds)
    return stats.rise(ts[short], total[short], end, seconds)


def _held_usage(window: Window, config: Config) -> float | None:
    """The lowest usage + next admission's need over the recent span (the need at its end, as
    the rule's ``min_over_time(usage[recent]) + need``); None without a usage sample there."""
    adm = admission_usage(window, config)
    short = stats.select(adm.ts, window.end, config.evictions_recent_window)
    return float(adm.usage[short].min()) + adm.need_ratio if short.any() else None


def recompute_cost(window: Window, config: Config) -> dict[str, float | None]:
    """Tokens thrown away by evictions over the span (and per eviction), and from a histogram of
    preemptions per finished request: their mean, and the share preempted twice or more (the
    engine's first bucket, le=1, holds the requests preempted once and those never preempted)."""
    start = since(window, config)
    tokens = window.increase("recompute_tokens_total", start)
    evictions = window.increase("evictions_total", start)
    h = window.histogram_increase("preemptions_per_request", start)
    mean = twice = None
    if h is not None and h.count > 0:
        mean = h.sum / h.count if h.sum == h.sum else None
        once = next((c for b, c in zip(h.bounds, h.counts) if b >= 1), h.count)
        twice = (h.count - once) / h.count
    return {
        "recompute_tokens": tokens,
        "recompute_tokens_per_eviction": tokens / evictions if tokens is not None and evictions else None,
        "preemptions_per_finished_request": mean,
        "finished_preempted_twice_or_more": twice,
    }
