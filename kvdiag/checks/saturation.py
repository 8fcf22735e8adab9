"""kv_usage_saturated (S): the pool pinned near full, as admission counts it.

Both engines' usage gauges exclude evictable prefix-cache entries, so usage near 1 means the
pool is held by running requests, however high the hit rate. What decides admission is the
room left against what the next request needs, so the check reads *admission usage*
(``checks/admission.py``): the usage gauge plus the next request's uncached prompt and, on an
engine whose admission reserves output, the room held back for it. On an engine without such a
reserve this is the usage gauge within a prompt's share of the pool.

"Pinned" is a share of samples, not one reading: admission usage >= ``saturated_usage`` in at
least ``saturated_fraction`` of the span's samples and at its end. A spike at the end of the
window is therefore not a pinned pool.

PromQL: ``avg_over_time((admission >= bool 0.95)[5m:]) >= 0.8 and admission >= 0.95`` over
``instance:kvdiag_kv_admission_usage:ratio5m``. On a single exposition the share is that one
reading (a point-in-time answer).
"""

from __future__ import annotations

import numpy as np

from kvdiag.checks.admission import admission_usage
from kvdiag.checks.base import absent, result
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "kv_usage_saturated"


def evaluate(window: Window, config: Config) -> CheckResult:
    adm = admission_usage(window, config)
    ts, usage = adm.ts, adm.admission
    if len(usage) == 0:
        return absent(NAME, window, ("usage_ratio",))
    at_or_above = usage >= config.saturated_usage
    share = float(at_or_above.mean())
    last = float(usage[-1])
    firing = share >= config.saturated_fraction and last >= config.saturated_usage
    first_hit = float(ts[np.argmax(at_or_above)]) if at_or_above.any() else None
    values = {
        "admission_usage_last": last,
        "admission_usage_mean": float(usage.mean()),
        "admission_usage_max": float(usage.max()),
        "usage_last": float(adm.usage[-1]),
        "usage_mean": float(adm.usage.mean()),
        "usage_max": float(adm.usage.max()),
        "need_tokens_last": float(adm.need_tokens[-1]),
        "prompt_per_request": adm.prompt_per_request,
        "output_per_request": adm.output_per_request,
        "hit_ratio": adm.hit_ratio,
        "reserve_ratio_last": adm.reserve_ratio,
        "admission_basis": adm.basis,
        "share_at_or_above": share,
        "threshold": config.saturated_usage,
        "required_share": config.saturated_fraction,
        "first_at_or_above": first_hit,
        "granularity": window.last.usage_granularity,
    }
    point = " (one sample: a point-in-time reading)" if len(usage) == 1 else ""
    summary = (
        f"admission usage >= {config.saturated_usage:g} in {share:.0%} of {len(usage)} samples "
        f"(>= {config.saturated_fraction:.0%} needed), {last:.2f} at the end{point}"
    )
    if adm.need_tokens[-1] > 0:
        summary += f" (usage gauge {adm.usage[-1]:.2f} + {adm.need_tokens[-1]:,.0f} tokens the next admission needs)"
    if not firing and last >= config.saturated_usage:
        summary += "; a spike at the end, not a pinned pool"
    return result(NAME, firing, ts, values, summary)
