"""queue_growing (Q): the waiting queue grows by an amount that means something, or a backlog
does not drain.

A queue that wanders 0-3 on a healthy engine is not a queue growing, so every growth has a
floor: at least ``queue_min_growth`` requests, and at least ``queue_growth_ratio`` of the
running batch (a queue of 3 beside 200 running requests is noise; beside 2 it is not yet a
trend). Two windows, as in the SRE workbook's multiwindow alerts:

- **growth**: the queue now stands that much above its minimum over the short window
  (``queue_short_window``, 1 m), which reacts within a minute, and the least-squares slope
  over the long window (``window``) is positive, which confirms the queue is not just back
  where it was;
- **slow growth**: the queue stands that much above its minimum over the long window, its
  least-squares slope over the long window is positive and over the short one not negative: a
  queue that climbs a few requests a minute for minutes (24 -> 60 in five minutes beside 128
  running) never rises enough within one minute, yet it grows;
- **backlog**: the queue is at least ``backlog_ratio`` x the running batch (and the floor) and
  its least-squares slope over the short window is not negative: admission is not keeping up
  even if the queue stopped growing;
- **standing backlog**: the queue stayed at least the rise's floor (``queue_min_growth``, and
  ``queue_growth_ratio`` x running) at every sample of the short window, whatever its slope: a
  queue that never once emptied for a minute. A closed loop (N clients, each sending its next request when the
  last returns: benchmarks, many gateways) cannot grow its queue: it stands at N minus running
  for as long as the overload lasts, wandering a request or two up and down, so its slope is
  negative about half the time; the backlog is no less a queue the engine does not admit.

``waiting`` is every queued request of the instance's role: on a disaggregated deployment the
queues of that role are added (a decode instance's pre-allocation queue is its pool's admission
queue; its transfer queue, a prefill's bootstrap queue and requests deferred for their KV wait for
their KV transfer or the other instance). The evidence keeps the capacity queue apart from
deferred work and names each queue as the engine does; requests refused at admission (a queue
cap) are their own evidence, since a capped queue cannot grow.

Every statistic is PromQL's own (``kvdiag.checks.stats``), so the rule is the same check::

    waiting > 0 and (
      (waiting - min_over_time(waiting[1m]) >= clamp_min(0.05 * running, 5) and deriv(waiting[5m]) > 0)
      or (waiting - min_over_time(waiting[5m]) >= clamp_min(0.05 * running, 5) and deriv(waiting[5m]) > 0
          and deriv(waiting[1m]) >= 0)
      or (waiting >= clamp_min(1 * running, 5) and deriv(waiting[1m]) >= 0)
      or min_over_time(waiting[1m]) >= clamp_min(0.05 * running, 5))
"""

from __future__ import annotations

from kvdiag.checks import stats
from kvdiag.checks.base import absent, needs_window, result, since, span, too_short
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "queue_growing"


def evaluate(window: Window, config: Config) -> CheckResult:
    ts, waiting = span(window, config, "waiting")
    if len(waiting) == 0:
        return absent(NAME, window, ("waiting",))
    running_last = window.last.running
    running = float(running_last) if running_last is not None else None
    if too_short(ts, config):
        return needs_window(NAME, ts, config, {"waiting_last": float(waiting[-1]), "running_last": running})
    t = float(ts[-1])
    short = stats.select(ts, t, config.queue_short_window)
    last = float(waiting[-1])
    short_min = float(waiting[short].min())
    rise = last - short_min
    rise_long = last - float(waiting.min())
    long_slope = stats.deriv(ts, waiting)
    short_slope = stats.deriv(ts[short], waiting[short])
    floor = config.queue_min_growth
    need_rise = max(config.queue_growth_ratio * running, floor) if running is not None else None
    need_backlog = max(config.backlog_ratio * running, floor) if running is not None else None
    rising = long_slope is not None and long_slope > 0
    not_draining = short_slope is not None and short_slope >= 0
    growing = last > 0 and need_rise is not None and rise >= need_rise and rising
    slow = last > 0 and need_rise is not None and rise_long >= need_rise and rising and not_draining
    backlog = last > 0 and need_backlog is not None and last >= need_backlog and not_draining
    standing = last > 0 and need_rise is not None and short_min >= need_rise
    values = {
        "waiting_first": float(waiting[0]),
        "waiting_last": last,
        "waiting_max": float(waiting.max()),
        "rise_short": rise,
        "rise_long": rise_long,
        "rise_needed": need_rise,
        "waiting_short_min": short_min,
        "slope_per_min": None if long_slope is None else long_slope * 60.0,
        "short_slope_per_min": None if short_slope is None else short_slope * 60.0,
        "running_last": running,
        "growing": growing,
        "growing_slowly": slow,
        "backlog_not_draining": backlog,
        "backlog_standing": standing,
        "decode_reserve_ratio": window.last.decode_reserve_ratio,
        **queue_split(window, config),
    }
    slope = f"{long_slope * 60:+.2f}/min" if long_slope is not None else "n/a"
    summary = (
        f"waiting {waiting[0]:.0f} -> {last:.0f} over {ts[-1] - ts[0]:.0f}s (slope {slope}); "
        f"+{rise:.0f} over the last {config.queue_short_window:g}s"
    )
    if need_rise is not None:
        summary += f" (>= {need_rise:g} needed), {running:.0f} running"
    if slow and not growing:
        summary += f"; +{rise_long:.0f} over the {config.window:g}s window and still rising: slow, steady growth"
    if (backlog or standing) and not (growing or slow):
        summary += (f"; backlog >= {config.backlog_ratio:g} x running and not draining" if backlog else
                    f"; the queue stood >= {need_rise:g} at every sample of the last {config.queue_short_window:g}s "
                    f"(min {short_min:.0f}): it stands, it does not drain")
    summary += _queues_text(window, values)
    return result(NAME, growing or slow or backlog or standing, ts, values, summary)


def queue_split(window: Window, config: Config) -> dict[str, float | str | None]:
    """The role, the capacity and deferred parts of the queue (first and last in the span), KV
    transfers in flight, each queue by its engine's name now, and admission rejections."""
    out: dict[str, float | str | None] = {"role": window.last.role}
    for field in ("waiting_capacity", "waiting_deferred"):
        _, vals = span(window, config, field)
        out[field + "_first"] = float(vals[0]) if len(vals) else None
        out[field + "_last"] = float(vals[-1]) if len(vals) else None
    out["transfers_in_flight_last"] = window.last.transfers_in_flight
    out["deferred_queues"] = ", ".join(q.name for q in window.last.queues if q.kind == "deferred" and q.requests > 0) or None
    out["queues"] = ", ".join(f"{q.name} {q.requests:.0f} [{q.kind}; {q.metric}]" for q in window.last.queues) or None
    out["admission_rejections"] = window.increase("admission_rejections_total", since(window, config))
    return out


def _queues_text(window: Window, values: dict) -> str:
    """The queues behind ``waiting`` in words, where the engine reports more than one."""
    text = ""
    queues = window.last.queues
    cap_first, cap_last = values["waiting_capacity_first"], values["waiting_capacity_last"]
    def_last = values["waiting_deferred_last"]
    if cap_last is not None and def_last is not None:
        text += f"; waiting for pool/scheduling room {cap_first:.0f} -> {cap_last:.0f}, deferred {def_last:.0f}"
    if len(queues) > 1 or window.last.role in ("prefill", "decode"):
        role = f"{window.last.role} instance; " if window.last.role else ""
        text += "; " + role + "now: " + ", ".join(f"{q.name} {q.requests:.0f}" for q in queues)
    if values["admission_rejections"]:
        text += f"; {values['admission_rejections']:.0f} requests rejected at admission (queue cap) in the window"
    return text
