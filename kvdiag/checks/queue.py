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
- **backlog**: the queue is at least ``backlog_ratio`` x the running batch (and the floor) and
  its least-squares slope over the short window is not negative: admission is not keeping up
  even if the queue stopped growing.

Every statistic is PromQL's own (``kvdiag.checks.stats``), so the rule is the same check::

    waiting > 0 and (
      (waiting - min_over_time(waiting[1m]) >= clamp_min(0.1 * running, 5) and deriv(waiting[5m]) > 0)
      or (waiting >= clamp_min(1 * running, 5) and deriv(waiting[1m]) >= 0))
"""

from __future__ import annotations

from kvdiag.checks import stats
from kvdiag.checks.base import absent, needs_window, result, span, too_short
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
    rise = last - float(waiting[short].min())
    long_slope = stats.deriv(ts, waiting)
    short_slope = stats.deriv(ts[short], waiting[short])
    floor = config.queue_min_growth
    need_rise = max(config.queue_growth_ratio * running, floor) if running is not None else None
    need_backlog = max(config.backlog_ratio * running, floor) if running is not None else None
    growing = last > 0 and need_rise is not None and rise >= need_rise and long_slope is not None and long_slope > 0
    backlog = (
        last > 0 and need_backlog is not None and last >= need_backlog and short_slope is not None and short_slope >= 0
    )
    values = {
        "waiting_first": float(waiting[0]),
        "waiting_last": last,
        "waiting_max": float(waiting.max()),
        "rise_short": rise,
        "rise_needed": need_rise,
        "slope_per_min": None if long_slope is None else long_slope * 60.0,
        "short_slope_per_min": None if short_slope is None else short_slope * 60.0,
        "running_last": running,
        "growing": growing,
        "backlog_not_draining": backlog,
        "decode_reserve_ratio": window.last.decode_reserve_ratio,
    }
    slope = f"{long_slope * 60:+.2f}/min" if long_slope is not None else "n/a"
    summary = (
        f"waiting {waiting[0]:.0f} -> {last:.0f} over {ts[-1] - ts[0]:.0f}s (slope {slope}); "
        f"+{rise:.0f} over the last {config.queue_short_window:g}s"
    )
    if need_rise is not None:
        summary += f" (>= {need_rise:g} needed), {running:.0f} running"
    if backlog and not growing:
        summary += f"; backlog >= {config.backlog_ratio:g} x running and not draining"
    return result(NAME, growing or backlog, ts, values, summary)
