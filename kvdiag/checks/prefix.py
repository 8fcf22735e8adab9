"""prefix_hit_high: the prefix-cache hit ratio over the window, from counters.

hit tokens / queried tokens, both as reset-safe increases over the span
(``rate(hits[5m]) / rate(queries[5m])``), never an engine's per-batch hit-rate gauge; only an
engine with no counters at all (old releases) falls back to its hit-rate gauge, said so in the
evidence. A high ratio beside a bad P99 is the seed's tell: the cache works, concurrency is the
problem.
"""

from __future__ import annotations

from kvdiag.checks.base import absent, counter_ratio, gauge_hit_ratio, result, span
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window

NAME = "prefix_hit_high"


def evaluate(window: Window, config: Config) -> CheckResult:
    if window.has("prefix_query_tokens_total") and window.has("prefix_hit_tokens_total"):
        ts, ratio, hits, queried, basis = counter_ratio(window, config, "prefix_hit_tokens_total", "prefix_query_tokens_total")
        if len(ts) == 0:
            return absent(NAME, window, ("prefix_query_tokens_total",))
        if basis == "window" and min(len(span(window, config, f)[1]) for f in ("prefix_hit_tokens_total", "prefix_query_tokens_total")) < 2:
            # the window has scrapes but fewer than two valid counter readings: no rate (as in PromQL)
            return absent(NAME, window, ("prefix_hit_tokens_total",), "fewer than two valid hit-counter readings in the window")
        values = {"hit_ratio": ratio, "hit_tokens": hits, "queried_tokens": queried, "threshold": config.prefix_hit_high, "basis": basis}
        where = "over the engine's lifetime (one sample)" if basis == "lifetime" else f"over {ts[-1] - ts[0]:.0f}s"
        if ratio is None:
            return result(NAME, False, ts, values, f"no prompt tokens queried the cache {where}")
        summary = f"hit ratio {ratio:.2f} ({hits:,.0f} of {queried:,.0f} prompt tokens) {where}"
        return result(NAME, ratio >= config.prefix_hit_high, ts, values, summary)
    ts, gauge = span(window, config, "prefix_hit_ratio_gauge")
    ratio = gauge_hit_ratio(window, config)
    if ratio is None:
        return absent(NAME, window, ("prefix_hit_tokens_total", "prefix_query_tokens_total"))
    values = {"hit_ratio": ratio, "threshold": config.prefix_hit_high, "basis": "gauge"}
    summary = f"hit ratio {ratio:.2f} (mean of the engine's hit-rate gauge: this version has no hit counters)"
    return result(NAME, ratio >= config.prefix_hit_high, ts, values, summary)
