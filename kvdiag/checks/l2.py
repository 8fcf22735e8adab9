"""l2_underused: the KV tiers below L1 (host memory, LMCache, L3 storage) have room or barely
hit while L1 is saturated.

Admission counts L1 only, and an L2 hit needs free L1 slots before its copy back: when L1 is
pinned, L2 sits mostly empty or unused. Each tier is judged on what it exports, never on what it
does not (absent is not zero):

- **occupancy** where the tier reports its used and total room (a host-memory tier);
- **hits** otherwise: L2 hit tokens over the tier's own lookups where it counts them (LMCache),
  else over the tokens queried against the prefix cache;
- **traffic** where a tier exports only its copies (CPU offloading before hits by source):
  stores into L2 with nothing loaded back over the window.

Only where the newest sample reports a tier (its occupancy, or hits or traffic that counted
something); otherwise unknown. L3 (storage) hits are shown beside, not judged.

PromQL: ``(l2_usage < 0.5 or l2_hit_share < 0.1 or (l2_load == 0 and l2_store > 0)) and <S>``.
"""

from __future__ import annotations

from kvdiag.checks import saturation
from kvdiag.checks.base import absent, counter_ratio, rate_of, result, since, span
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "l2_underused"


def evaluate(window: Window, config: Config) -> CheckResult:
    last = window.last  # occupancy now; an L2 the newest sample does not report is not there
    occupancy = last.l2_used_tokens / last.l2_capacity_tokens if last.l2_capacity_tokens and last.l2_used_tokens is not None else None
    share, hits_basis = None, None
    if last.l2_hit_tokens_total is not None:
        den = next(f for f in ("l2_query_tokens_total", "prefix_query_tokens_total", "prompt_tokens_total")
                   if getattr(last, f) is not None or f == "prompt_tokens_total")
        _, share, hits, _, _ = counter_ratio(window, config, "l2_hit_tokens_total", den)
        hits_basis = {"l2_query_tokens_total": "the tier's own lookups", "prefix_query_tokens_total": "queried tokens",
                      "prompt_tokens_total": "prompt tokens"}[den]
    load, store = rate_of(window, config, "l2_load_bytes_total"), rate_of(window, config, "l2_store_bytes_total")
    traffic = load is not None and store is not None and (load > 0 or store > 0)
    if share is not None and occupancy is None and not traffic and not hits:
        share = None  # a hit counter that never counted, and nothing else: no sign an L2 tier exists
    if occupancy is None and share is None and not traffic:
        return absent(
            NAME,
            window,
            ("l2_capacity_tokens", "l2_hit_tokens_total"),
            "no L2 tier reported (no L2 occupancy series, no L2 hits and no L2 traffic counted)",
            "only judged where a KV tier below L1 (host memory, offloading, LMCache) is configured and exported",
        )
    l1 = saturation.evaluate(window, config)
    if l1.status == "unknown":
        return absent(NAME, window, l1.missing, "L1 usage not reported, so L2's role cannot be judged")
    has_room = occupancy is not None and occupancy < config.l2_low_occupancy
    barely_hits = share is not None and share < config.l2_low_hit_share
    never_read = traffic and load == 0 and (store or 0) > 0
    saturated = l1.status == "firing"
    judged_on = "occupancy" if occupancy is not None else "hits" if share is not None else "traffic"
    values = {
        "l2_tier": last.l2_tier,
        "judged_on": judged_on,
        "l2_occupancy": occupancy,
        "l2_hit_share": share,
        "l2_hit_share_of": hits_basis,
        "l2_load_bytes_per_s": load,
        "l2_store_bytes_per_s": store,
        "l2_dropped_tokens": window.increase("l2_dropped_tokens_total", since(window, config)),
        "l3_hit_tokens": window.increase("l3_hit_tokens_total", since(window, config)),
        "l2_has_room": has_room or barely_hits or never_read,
        "l1_saturated": saturated,
        "occupancy_threshold": config.l2_low_occupancy,
        "hit_share_threshold": config.l2_low_hit_share,
    }
    parts = [last.l2_tier or "L2"]
    if occupancy is not None:
        parts.append(f"{occupancy:.0%} occupied")
    else:
        parts.append("exports no occupancy, judged from its " + ("hits" if share is not None else "traffic"))
    if share is not None:
        parts.append(f"hits {share:.1%} of {hits_basis}")
    if traffic:
        parts.append(f"loads {load / 1e6:,.1f} MB/s back, stores {(store or 0) / 1e6:,.1f} MB/s")
    if values["l2_dropped_tokens"]:
        parts.append(f"dropped {values['l2_dropped_tokens']:,.0f} tokens")
    if values["l3_hit_tokens"]:
        parts.append(f"L3 (storage) hit {values['l3_hit_tokens']:,.0f} tokens")
    summary = ", ".join(parts) + f"; L1 {'saturated' if saturated else 'not saturated'}"
    field = "l2_capacity_tokens" if occupancy is not None else "l2_hit_tokens_total" if share is not None else "l2_store_bytes_total"
    ts = span(window, config, field)[0]
    return result(NAME, (has_room or barely_hits or never_read) and saturated, ts, values, summary)
