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

Either fires. PromQL, over the recorded ``instance:kvdiag_kv_usage:ratio`` and
``instance:kvdiag_kv_admission_need:ratio5m``::

    min_over_time(usage[20s]) + need >= 0.95
    or (quantile_over_time(0.2, usage[5m]) + need >= 0.95 and usage + need >= 0.95)
"""

from __future__ import annotations

from kvdiag.checks import stats
from kvdiag.checks.admission import admission_usage
from kvdiag.checks.base import absent, result
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
        "threshold": u,
        "required_share": config.saturated_fraction,
        "granularity": window.last.usage_granularity,
    }
    point = " (one sample: a point-in-time reading)" if len(usage) == 1 else ""
    summary = (
        f"admission usage {adm.admission:.2f} now{point}; usage + need >= {u:g} at every sample of the last "
        f"{config.saturated_short_window:g}s: {'yes' if fast else 'no'} (min {short_min + adm.need_ratio:.2f}), in "
        f"{share:.0%} of the {config.window:g}s window ({config.saturated_fraction:.0%} needed)"
    )
    if adm.need_tokens > 0:
        summary += f" (usage gauge {last:.2f} + {adm.need_tokens:,.0f} tokens the next admission needs)"
    if not (fast or slow) and adm.admission >= u:
        summary += "; a spike at the end, not a pinned pool"
    values.update(pool_values(window))
    if values["pools"]:
        summary += f"; {values['pools']}"
    return result(NAME, fast or slow, ts, values, summary)


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
