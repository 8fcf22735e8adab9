"""kv_usage_saturated (S): the pool pinned near 1.

Both engines' usage gauges exclude evictable prefix-cache entries, so usage near 1 means the
pool is held by running requests, however high the hit rate. "Pinned" is a share of samples,
not one reading: usage >= ``saturated_usage`` in at least ``saturated_fraction`` of the span's
samples and at its end. A spike at the end of the window is therefore not a pinned pool.

PromQL: ``avg_over_time((usage >= bool 0.95)[5m:]) >= 0.8 and usage >= 0.95``. On a single
exposition the share is that one reading (a point-in-time answer).
"""

from __future__ import annotations

import numpy as np

from kvdiag.checks.base import absent, result, span
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "kv_usage_saturated"


def evaluate(window: Window, config: Config) -> CheckResult:
    ts, usage = span(window, config, "usage_ratio")
    if len(usage) == 0:
        return absent(NAME, window, ("usage_ratio",))
    at_or_above = usage >= config.saturated_usage
    share = float(at_or_above.mean())
    last = float(usage[-1])
    firing = share >= config.saturated_fraction and last >= config.saturated_usage
    first_hit = float(ts[np.argmax(at_or_above)]) if at_or_above.any() else None
    values = {
        "usage_last": last,
        "usage_mean": float(usage.mean()),
        "usage_max": float(usage.max()),
        "share_at_or_above": share,
        "threshold": config.saturated_usage,
        "required_share": config.saturated_fraction,
        "first_at_or_above": first_hit,
        "granularity": window.last.usage_granularity,
    }
    point = " (one sample: a point-in-time reading)" if len(usage) == 1 else ""
    summary = (
        f"usage >= {config.saturated_usage:g} in {share:.0%} of {len(usage)} samples "
        f"(>= {config.saturated_fraction:.0%} needed), {last:.2f} at the end{point}"
    )
    if not firing and last >= config.saturated_usage:
        summary += "; a spike at the end, not a pinned pool"
    return result(NAME, firing, ts, values, summary)
