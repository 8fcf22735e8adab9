"""What every check shares: the span it looks at, and how it states firing / ok / unknown.

A check sees the last ``config.window`` seconds of an instance's Window. It answers
``unknown`` rather than guess when a field it needs is absent (naming the field and how to get
it), or, for a check about growth, when the span holds too few samples to show any.
"""

from __future__ import annotations

import numpy as np

from kvdiag import engines
from kvdiag.config import Config
from kvdiag.model import CheckResult, Evidence
from kvdiag.window import Window, counter_increase

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
    n = len(ts)
    reason = (
        f"needs a window: growth cannot be measured from {n} sample{'s' if n != 1 else ''} "
        f"(at least {int(config.min_samples)} over time; record or sample the engine for a while)"
    )
    return CheckResult(check, "unknown", evidence(ts, values or {}, reason), ("window",), "diagnose a recording, --prometheus, or sample URLs with --duration")


def too_short(ts: np.ndarray, config: Config) -> bool:
    return len(ts) < max(2, int(config.min_samples))


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


def counter_ratio(window: Window, config: Config, num: str, den: str) -> tuple[np.ndarray, float | None, float, float, str]:
    """increase(num) / increase(den) over the span, as PromQL's ``rate(a)/rate(b)``.

    Returns (timestamps, ratio or None when nothing was counted, numerator, denominator,
    basis). With a single sample in the span the ratio is over the engine's lifetime (the
    counters as they stand): a point-in-time answer, labelled ``lifetime``.
    """
    ts, den_vals = span(window, config, den)
    _, num_vals = span(window, config, num)
    if len(den_vals) == 1 or len(num_vals) == 1:
        n, d, basis = float(num_vals[-1]) if len(num_vals) else 0.0, float(den_vals[-1]), "lifetime"
    else:
        n, d, basis = counter_increase(num_vals), counter_increase(den_vals), "window"
    return ts, (n / d if d > 0 else None), n, d, basis


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
