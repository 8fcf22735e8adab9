"""ttft_p99_high: the TTFT quantile over the window, from the engine's histogram, above the SLO.

The estimate is ``histogram_quantile(0.99, rate(ttft_bucket[5m]))`` computed the way
Prometheus computes it, and the evidence states the bucket bounds it lies between: a bucket
estimate is only as fine as the buckets. The check fires at or above the SLO, not only above
it: when the quantile falls in the +Inf bucket the estimate is the last finite bound, and old
engines' buckets stop at the SLO itself (some end at 10 s), where "at least the SLO" is all the
buckets can say. The rule is the same comparison, ``p99 >= slo``.

Below ``min_ttft_observations`` first tokens in the window the check is ok with the count in
the evidence: an idle engine never alerts. On a single exposition the quantile is over the
engine's lifetime (the cumulative histogram), a point-in-time answer.
"""

from __future__ import annotations

import math

import numpy as np

from kvdiag.checks.base import absent, result, since
from kvdiag.config import Config
from kvdiag.model import CheckResult
from kvdiag.window import Window, bucket_quantile

NAME = "ttft_p99_high"


def evaluate(window: Window, config: Config) -> CheckResult:
    start = since(window, config)
    hist = window.histogram_increase("ttft", start)
    if hist is None:
        return absent(NAME, window, ("ttft",))
    ts = window.points("ts", start)[0]
    basis = "window"
    if len(ts) == 1:
        hist, basis = window.last.ttft, "lifetime"
    assert hist is not None
    observed = float(hist.counts[-1])
    values = {
        "quantile": config.ttft_quantile,
        "slo_seconds": config.ttft_slo,
        "observations": observed,
        "basis": basis,
    }
    where = "over the engine's lifetime (one sample)" if basis == "lifetime" else f"over {ts[-1] - ts[0]:.0f}s"
    if observed < config.min_ttft_observations:
        summary = f"{observed:.0f} first tokens {where}: below the traffic floor of {config.min_ttft_observations:.0f}"
        return result(NAME, False, ts, values, summary)
    q = bucket_quantile(config.ttft_quantile, hist.bounds, np.array(hist.counts))
    assert q is not None  # observed > 0
    capped = math.isinf(q.upper)
    firing = q.value >= config.ttft_slo
    values.update({"estimate_seconds": q.value, "bucket_lower": q.lower, "bucket_upper": None if capped else q.upper})
    bounds = f"> {q.lower:g}s (last bucket)" if capped else f"between {q.lower:g}s and {q.upper:g}s"
    summary = (
        f"P{config.ttft_quantile * 100:g} TTFT ~ {q.value:.2f}s ({bounds}) {where}, "
        f"{observed:.0f} first tokens; SLO {config.ttft_slo:g}s"
    )
    return result(NAME, firing, ts, values, summary)
