"""l2_underused: L2 (the host-memory KV tier) has room or barely hits while L1 is saturated.

Admission counts L1 only, and an L2 hit needs free L1 slots before its copy back: when L1 is
pinned, L2 sits mostly empty or unused. Only where the newest sample reports an L2 tier (its
occupancy now, or L2 hit counters that counted something); otherwise unknown.

PromQL: ``(l2_usage < 0.5 or l2_hit_share < 0.1) and <kv_usage_saturated>``.
"""

from __future__ import annotations

from kvdiag.checks import saturation
from kvdiag.checks.base import absent, counter_ratio, result, span
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "l2_underused"


def evaluate(window: Window, config: Config) -> CheckResult:
    last = window.last  # occupancy now; an L2 the newest sample does not report is not there
    occupancy = last.l2_used_tokens / last.l2_capacity_tokens if last.l2_capacity_tokens and last.l2_used_tokens is not None else None
    share = None
    if last.l2_hit_tokens_total is not None:
        den = "prefix_query_tokens_total" if last.prefix_query_tokens_total is not None else "prompt_tokens_total"
        _, share, hits, _, _ = counter_ratio(window, config, "l2_hit_tokens_total", den)
        if occupancy is None and not hits:
            share = None  # a hit counter that never counted: no sign an L2 tier exists
    if occupancy is None and share is None:
        return absent(
            NAME,
            window,
            ("l2_capacity_tokens", "l2_hit_tokens_total"),
            "no L2 tier reported (no L2 occupancy series, and no L2 hits counted)",
            "only judged where a host-memory KV tier (L2) is configured and exported",
        )
    l1 = saturation.evaluate(window, config)
    if l1.status == "unknown":
        return absent(NAME, window, l1.missing, "L1 usage not reported, so L2's role cannot be judged")
    has_room = occupancy is not None and occupancy < config.l2_low_occupancy
    barely_hits = share is not None and share < config.l2_low_hit_share
    saturated = l1.status == "firing"
    values = {
        "l2_occupancy": occupancy,
        "l2_hit_share": share,
        "l2_has_room": has_room or barely_hits,
        "l1_saturated": saturated,
        "occupancy_threshold": config.l2_low_occupancy,
        "hit_share_threshold": config.l2_low_hit_share,
    }
    parts = []
    if occupancy is not None:
        parts.append(f"L2 {occupancy:.0%} occupied")
    if share is not None:
        parts.append(f"L2 hits {share:.1%} of prompt tokens")
    summary = ", ".join(parts) + f"; L1 {'saturated' if saturated else 'not saturated'}"
    ts = span(window, config, "l2_capacity_tokens" if occupancy is not None else "l2_hit_tokens_total")[0]
    return result(NAME, (has_room or barely_hits) and saturated, ts, values, summary)
