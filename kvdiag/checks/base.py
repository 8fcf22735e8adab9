"""What every check shares: the span it looks at, and how it states firing / ok / unknown.

A check sees the last ``config.window`` seconds of an instance's Window. It answers
``unknown`` rather than guess when a field it needs is absent (naming the field and how to get
it), or, for a check about growth, when the span holds too few samples to show any.
"""

from __future__ import annotations

import numpy as np

from kvdiag import engines
from kvdiag.checks import stats
from kvdiag.config import Config
from kvdiag.model import CheckResult, Evidence
from kvdiag.window import Window

Values = dict[str, float | int | str | bool | None]


def since(window: Window, config: Config) -> float:
    """Start of the span the checks look at: ``config.window`` back from the newest sample."""
    return window.end - config.window


def recent(window: Window, config: Config) -> Window:
    """The window cut to the check span, so nothing older is ever read (the same Window
    object when it holds no older samples, keeping its cached columns)."""
    return window.since(since(window, config))


def span(window: Window, config: Config, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(timestamps, values) of ``field`` inside the check span, absent samples dropped."""
    return window.points(field, since(window, config))


def evidence(ts: np.ndarray, values: Values, summary: str) -> Evidence:
    start, end = (float(ts[0]), float(ts[-1])) if len(ts) else (float("nan"), float("nan"))
    return Evidence(start, end, int(len(ts)), {k: _plain(v) for k, v in values.items()}, summary)


def result(check: str, firing: bool, ts: np.ndarray, values: Values, summary: str) -> CheckResult:
    return CheckResult(check, "firing" if firing else "ok", evidence(ts, values, summary))


def absent(check: str, window: Window, missing: tuple[str, ...], why: str = "", hint: str | None = None) -> CheckResult:
    """Unknown because the instance never reported ``missing`` in the span.

    The default hint carries what the adapter noted about this engine's version (e.g. a
    counter that only newer releases export) and how to turn metrics on.
    """
    reason = why or f"{', '.join(missing)} not reported by this instance"
    if hint is None:
        notes = "; ".join(dict.fromkeys(window.last.notes))
        hint = "; ".join(x for x in (notes, _enable_hint(window.engine)) if x)
    ts = window.column("ts")
    return CheckResult(check, "unknown", evidence(ts, {}, reason), missing, hint)


def needs_window(check: str, ts: np.ndarray, config: Config, values: Values | None = None) -> CheckResult:
    """Unknown because growth cannot be seen in fewer than ``min_samples`` samples."""
    n = _instants(ts)
    reason = (
        f"needs a window: growth cannot be measured from {n} sample{'s' if n != 1 else ''} "
        f"(at least {int(config.min_samples)} over time; record or sample the engine for a while)"
    )
    return CheckResult(check, "unknown", evidence(ts, values or {}, reason), ("window",), "diagnose a recording, --prometheus, or sample URLs with --duration")


def too_short(ts: np.ndarray, config: Config) -> bool:
    return _instants(ts) < max(2, int(config.min_samples))


def _instants(ts: np.ndarray) -> int:
    """Samples as Prometheus counts them: those sharing a millisecond are one (``stats``)."""
    return len(np.unique(stats.millis(ts)))


def _enable_hint(engine: str) -> str:
    try:
        return "if metrics are partly off: " + engines.enable_hint(engine)
    except KeyError:
        return ""


def _plain(v: object) -> float | int | str | bool | None:
    """numpy scalars to plain Python, NaN to None (JSON has no NaN)."""
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return None if f != f else f
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v  # type: ignore[return-value]


def rate_of(window: Window, config: Config, field: str) -> float | None:
    """``rate(field[window])`` at the window's newest sample, as PromQL computes it."""
    ts, vals = span(window, config, field)
    return stats.rate(ts, vals, window.end, config.window)


def counter_ratio(window: Window, config: Config, num: str, den: str) -> tuple[np.ndarray, float | None, float, float, str]:
    """``rate(num[window]) / rate(den[window])``, each rate PromQL's own (``stats.rate``).

    Returns (timestamps, ratio or None when nothing was counted, numerator, denominator,
    basis), the two figures as PromQL's (extrapolated) increases over the window. On a single
    scrape the ratio is over the engine's lifetime (the counters as they stand): a point-in-time
    answer PromQL cannot give, labelled ``lifetime``. A counter with fewer than two valid readings
    in a longer window has no rate: ratio None.
    """
    ts, den_vals = span(window, config, den)
    _, num_vals = span(window, config, num)
    if len(window.column("ts")) == 1 and len(den_vals) == 1:
        n, d = float(num_vals[-1]) if len(num_vals) else 0.0, float(den_vals[-1])
        return ts, (n / d if d > 0 else None), n, d, "lifetime"
    rn, rd = rate_of(window, config, num), rate_of(window, config, den)
    n, d = (rn or 0.0) * config.window, (rd or 0.0) * config.window
    return ts, (rn / rd if rn is not None and rd else None), n, d, "window"


def gauge_hit_ratio(window: Window, config: Config) -> float | None:
    """The mean of an old engine's hit-rate gauge over the span (``avg_over_time``): the hit
    ratio of an engine that exports no hit counters; None where it exports no gauge either."""
    _, gauge = span(window, config, "prefix_hit_ratio_gauge")
    return float(gauge.mean()) if len(gauge) else None


def hit_ratio(window: Window, config: Config) -> float | None:
    """The span's prefix hit ratio (``model.hit_ratio``'s fallback): the hit counter's rate over
    the queried counter's (``counter_ratio``) where the instance reports both, else the mean of
    its hit-rate gauge; None where it reports neither or nothing was queried."""
    if window.has("prefix_hit_tokens_total") and window.has("prefix_query_tokens_total"):
        return counter_ratio(window, config, "prefix_hit_tokens_total", "prefix_query_tokens_total")[1]
    return gauge_hit_ratio(window, config)


def per_request(window: Window, config: Config, field: str) -> tuple[float | None, str]:
    """Tokens per finished request of a token counter, and the basis: the increases over the
    span, or the engine's lifetime totals when no request finished in it (a single scrape)."""
    requests = window.increase("requests_total", since(window, config))
    if requests:
        tokens = window.increase(field, since(window, config))
        if tokens is not None:
            return tokens / requests, "window"
    last = window.last
    total = getattr(last, field)
    if last.requests_total and total is not None:
        return total / last.requests_total, "lifetime"
    return None, "unknown"
