"""queue_growing (Q): the waiting queue grows, or a backlog does not drain.

The slope is Theil-Sen (the median of pairwise slopes) over the span: a single burst or one
odd scrape cannot fake a trend, unlike a difference of two points. A queue at least as long
as the running batch (``backlog_ratio``) that is not shrinking also fires: admission is not
keeping up even if the queue stopped growing.

PromQL has no robust slope; the rules use ``deriv()`` (least squares), which agrees on clear
trends: ``waiting > 0 and (deriv(waiting[5m]) > 0 or (waiting >= running and
deriv(waiting[5m]) >= 0))``.
"""

from __future__ import annotations

from kvdiag.checks.base import absent, needs_window, result, span, too_short
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window, theil_sen

NAME = "queue_growing"


def evaluate(window: Window, config: Config) -> CheckResult:
    ts, waiting = span(window, config, "waiting")
    if len(waiting) == 0:
        return absent(NAME, window, ("waiting",))
    _, running = span(window, config, "running")
    running_last = float(running[-1]) if len(running) else None
    if too_short(ts, config):
        return needs_window(NAME, ts, config, {"waiting_last": float(waiting[-1]), "running_last": running_last})
    slope = theil_sen(ts, waiting)
    per_min = 0.0 if slope is None else slope * 60.0
    last = float(waiting[-1])
    growing = last > 0 and per_min > config.queue_growth_per_min
    backlog = (
        last > 0
        and running_last is not None
        and last >= config.backlog_ratio * running_last
        and per_min >= 0
    )
    values = {
        "waiting_first": float(waiting[0]),
        "waiting_last": last,
        "waiting_max": float(waiting.max()),
        "slope_per_min": per_min,
        "running_last": running_last,
        "growing": growing,
        "backlog_not_draining": backlog,
        "decode_reserve_ratio": window.last.decode_reserve_ratio,
    }
    summary = f"waiting {waiting[0]:.0f} -> {last:.0f} over {ts[-1] - ts[0]:.0f}s, robust slope {per_min:+.2f}/min"
    if running_last is not None:
        summary += f", {running_last:.0f} running"
    if backlog and not growing:
        summary += f"; backlog >= {config.backlog_ratio:g} x running and not draining"
    return result(NAME, growing or backlog, ts, values, summary)
