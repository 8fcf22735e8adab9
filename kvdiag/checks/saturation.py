"""kv_usage_saturated (S): the pool pinned near full, as admission counts it.

Both engines' usage gauges exclude evictable prefix-cache entries, so usage near 1 means the
pool is held by running requests, however high the hit rate. What decides admission is the
room left against what the next request needs, so the check adds to the usage gauge the
share of the pool the next admission needs now (``checks/admission.py``: the uncached prompt
and, on an engine whose admission reserves output, the room held back for it).

Two windows, as in the multiwindow alerts of the SRE workbook, so that the check is right
early and a blip is not a pinned pool:

- **short** (``saturated_short_window``, 20 s): the usage gauge's minimum over it, plus the
  need, reaches ``saturated_usage``: pinned at every scrape of the last seconds. This names a
  pool that filled within a few scrapes of it filling;
- **long** (``window``, 5 m): the ``1 - saturated_fraction`` quantile of usage over it, plus the
  need, reaches ``saturated_usage`` (pinned in at least ``saturated_fraction`` of the span), and
  so does the newest sample: a pool that stays pinned with short dips.

A hybrid model has several pools (full attention, sliding window, Mamba states) and admission
runs out of the fullest first; the engine's usage gauge is already the largest of them, so the
check is the same, and the evidence names the binding pool beside the others and shows its
evictable / available split.

- **reserve** (an engine whose admission reserves output, i.e. that reports a reserve ratio):
  ``queue_min_growth`` or more requests wait (admission is refusing), and the least usage over
  ``saturated_short_window`` + need reaches ``saturated_usage`` once every running request is
  charged its whole remaining output (``reserve_gap``: ``(1 - ratio) x output x running /
  capacity``, running the most over the short window). The exported ratio is the floor of what the engine reserves, not what
  it reserves: a request that ignores EOS is reserved at 1 whatever the ratio, and one whose
  client asks for far more tokens than it gets is reserved on what it asked for, which no
  metric exports. A real engine of this kind at its defaults (outputs of hundreds of tokens run to their
  length, a 2,048-token pool) ran 2-3 of 16 requests with 21-22 waiting and its usage gauge at
  0.42-0.81: the reserve refused admission while the gauge never pinned.

- **storm**: the eviction counter rose ``evictions_storm`` (10) or more over
  ``evictions_recent_window`` while ``queue_min_growth`` or more requests waited (the most over
  ``saturated_short_window``). An engine evicts a running request only when the pool has no room
  for its next tokens, and the eviction frees the victim's KV at once, so the gauge a scrape reads
  drops after each one and climbs back: a real engine that preempts, under overload, saw-toothed between 0.57 and 1
  with 153 preemptions a minute, read as "a spike at the end" by the two windows above. Each
  eviction is a moment the pool was full that no scrape saw.

Any fires. PromQL, over the recorded ``instance:kvdiag_kv_usage:ratio`` and
``instance:kvdiag_kv_admission_need:ratio5m``::

    min_over_time(usage[20s]) + need >= 0.95
    or (quantile_over_time(0.2, usage[5m]) + need >= 0.95 and usage + need >= 0.95)
    or (waiting >= 5
        and min_over_time(usage[20s]) + need
            + (1 - reserve_ratio) * output_per_request * max_over_time(running[20s]) / capacity >= 0.95)
    or (evictions_rate1m * 60 >= 10 and max_over_time(waiting[20s]) >= 5)
"""

from __future__ import annotations

import math

from kvdiag.checks import evictions, stats
from kvdiag.checks.admission import AdmissionUsage, admission_usage
from kvdiag.checks.base import absent, result, span
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "kv_usage_saturated"


def quantile_level(config: Config) -> float:
    """The usage quantile the long window reads, as the rules write it (``1 - fraction``)."""
    return float(config.promql_params()["saturated_quantile"])


def evaluate(window: Window, config: Config) -> CheckResult:
    adm = admission_usage(window, config)
    ts, usage = adm.ts, adm.usage
    if len(usage) == 0:
        return absent(NAME, window, ("usage_ratio",))
    u = config.saturated_usage
    short = usage[stats.select(ts, float(ts[-1]), config.saturated_short_window)]
    short_min = float(short.min())
    long_q = stats.quantile(quantile_level(config), usage)
    assert long_q is not None  # usage is not empty
    last = float(usage[-1])
    fast = short_min + adm.need_ratio >= u
    slow = long_q + adm.need_ratio >= u and last + adm.need_ratio >= u
    gap, waiting = reserve_gap(window, config, adm), queue_waiting(window, config)
    reserved = gap is not None and waiting and short_min + adm.need_ratio + gap >= u
    # The storm reads the most waiting over the short window: an open loop reaches a real engine
    # in clumps, and a scrape between two of them can find the queue empty inside an overload
    # (a real engine read 0 running, 0 waiting at a scrape while its scheduler refused for KV).
    evicted, most_waiting = evictions.recent_rise(window, config), short_max(window, config, "waiting")
    storm = (evicted is not None and evicted >= config.evictions_storm
             and most_waiting is not None and most_waiting >= config.queue_min_growth)
    share = float((usage + adm.need_ratio >= u).mean())
    values = {
        "admission_usage_last": adm.admission,
        "usage_last": last,
        "usage_mean": float(usage.mean()),
        "usage_max": float(usage.max()),
        "usage_short_min": short_min,
        "usage_long_quantile": long_q,
        "need_ratio_last": adm.need_ratio,
        "need_tokens_last": adm.need_tokens,
        "freed_ratio_last": adm.freed_ratio,
        "prompt_per_request": adm.prompt_per_request,
        "output_per_request": adm.output_per_request,
        "hit_ratio": adm.hit_ratio,
        "reserve_ratio_last": adm.reserve_ratio,
        "admission_basis": adm.basis,
        "share_at_or_above": share,
        "short_window_pinned": fast,
        "long_window_pinned": slow,
        "reserve_gap_last": gap,
        "reserve_running": reserve_running(window, config),
        "queue_waiting": waiting,
        "reserve_blocked": reserved,
        "evictions_recent": evicted,
        "waiting_short_max": most_waiting,
        "eviction_storm": storm,
        "threshold": u,
        "required_share": config.saturated_fraction,
        "granularity": window.last.usage_granularity,
    }
    point = " (one sample: a point-in-time reading)" if len(usage) == 1 else ""
    summary = (
        f"admission usage {against(adm.admission, u)} now{point}; usage + need >= {u:g} at every sample of the last "
        f"{config.saturated_short_window:g}s: {'yes' if fast else 'no'} (min {against(short_min + adm.need_ratio, u)}), in "
        f"{share:.0%} of the {config.window:g}s window ({config.saturated_fraction:.0%} needed)"
    )
    if adm.need_tokens > 0:
        summary += f" (usage gauge {last:.2f} + {adm.need_tokens:,.0f} tokens the next admission needs)"
    earlier = (usage + adm.need_ratio >= u) & ~stats.select(ts, float(ts[-1]), config.saturated_short_window)
    values["reached_before_short_window"] = bool(earlier.any())
    if gap is not None and waiting:
        at_full = short_min + adm.need_ratio + gap
        summary += (f"; {config.queue_min_growth:g} or more requests wait while "
                    f"the engine reserves output: usage (its least over the last {config.saturated_short_window:g}s) + need with every running request reserved its whole remaining "
                    f"output (ratio 1, not {adm.reserve_ratio:.3g}) is {against(at_full, u)}"
                    + (": the reserve can be what refuses admission" if reserved else ""))
    if storm and not (fast or slow or reserved):  # the gauge missed what the evictions show
        summary += (f"; {evicted:.0f} evictions in the last {config.evictions_recent_window:g}s "
                    f"({config.evictions_storm:g} needed) with up to {most_waiting:,.0f} requests waiting: the pool runs out "
                    "again and again, and the gauge saw-tooths between the evictions (each frees its victim's KV at once)")
    elif not (fast or slow or reserved) and adm.admission >= u:
        summary += ("; a spike at the end, not a pinned pool" if not earlier.any() else
                    f"; at {u:g} now and at times before, below it in {1 - share:.0%} of the window: the gauge "
                    "saw-tooths (each eviction frees its victim's KV at once), it is not pinned")
    values.update(pool_values(window))
    if values["pools"]:
        summary += f"; {values['pools']}"
    return result(NAME, fast or slow or reserved or storm, ts, values, summary)


def reserve_gap(window: Window, config: Config, adm: AdmissionUsage) -> float | None:
    """What admission would count beyond ``need`` if every running request were reserved its
    whole remaining output: ``(1 - ratio) x output x running / capacity``, running as
    ``reserve_running`` counts them (module docstring); None on an engine that reserves no
    output, or where an input is missing."""
    ratio, output, capacity = adm.reserve_ratio, adm.output_per_request, window.last.capacity_tokens
    running = reserve_running(window, config)
    if ratio is None or output is None or running is None or not capacity:
        return None
    return (1 - ratio) * output * running / capacity


def reserve_running(window: Window, config: Config) -> float | None:
    """The most requests running over ``saturated_short_window``, not the newest reading: an
    engine that publishes its gauges as it schedules a prefill counts the requests that batch
    admits among the waiting no more and among the running not yet. A real engine of this kind whose reserve
    held 2-3 requests running beside 20 waiting read 1 running at such scrapes (its usage just
    after a request finished, 0.26-0.41), which put the reserve bound at 0.75-0.90 for a scrape."""
    return short_max(window, config, "running")


def short_max(window: Window, config: Config, field: str) -> float | None:
    """The most of ``field`` over ``saturated_short_window``, as ``max_over_time`` reads it;
    None without a sample there."""
    ts, values = span(window, config, field)
    short = values[stats.select(ts, window.end, config.saturated_short_window)]
    return float(short.max()) if len(short) else None


def queue_waiting(window: Window, config: Config) -> bool:
    """Admission is refusing: ``queue_min_growth`` or more requests wait now. The reserve branch
    asks no more of the queue: its usage term is already the least over
    ``saturated_short_window``, and an L1 verdict also needs the queue check (a rise within a
    minute, a backlog or a standing queue). Asking the queue to have stood at the floor for the
    whole short window as well named a real engine's reserve-bound pool 20-31 s after its first
    sustained refusal (the queue grows from 1 to the floor first), and 10 s sooner without it."""
    _, waiting = span(window, config, "waiting")
    return len(waiting) > 0 and float(waiting[-1]) >= config.queue_min_growth


def against(value: float, threshold: float) -> str:
    """``value`` with two decimals, or as many more as it takes to show which side of
    ``threshold`` it is on (0.949 against 0.95 is not "0.95")."""
    for digits in (2, 3, 4):
        text = f"{value:.{digits}f}"
        if (float(text) >= threshold) == (value >= threshold):
            return text
    return f"{math.floor(value * 1000) / 1000:.3f}"  # just below: cut, never round up to it


def pool_values(window: Window) -> dict[str, float | str | None]:
    """A hybrid model's pools at the newest sample, the binding (fullest) one first, with its
    split: "the sliding-window pool is at 0.98; the full-attention pool at 0.61"."""
    last = window.last
    binding = last.binding_pool
    if binding is None:
        return {"binding_pool": None, "pools": None}
    others = sorted((p for p in last.pools if p is not binding), key=lambda p: -p.usage_ratio)
    text = f"the {binding.title} is at {binding.usage_ratio:.2f} (binding)" + "".join(
        f"; the {p.title} at {p.usage_ratio:.2f}" for p in others)
    split = [f"{name} {v:,.0f}" for name, v in (("used", binding.used), ("evictable", binding.evictable),
                                                 ("available", binding.available)) if v is not None]
    if split:
        text += f"; {binding.title}: " + ", ".join(split) + f" {binding.unit}"
    out: dict[str, float | str | None] = {"binding_pool": binding.kind, "pools": text}
    for p in last.pools:
        out[f"{p.kind}_pool_usage"] = p.usage_ratio
    return out
