"""The statistics the checks compute, each exactly as PromQL computes it.

The rules in ``rules/`` and the Python checks must agree at every evaluation instant, so every
statistic a check uses is one PromQL has, computed here with PromQL's own arithmetic (Prometheus
2.x's ``promql/functions.go``, the Prometheus the tests run: Debian's 2.42) rather than a robust
statistic PromQL lacks:

- **range selection** ``x[r]`` at instant ``t``: the samples in the closed interval
  ``[t - r, t]``. Prometheus 3 made it left-open, ``(t - r, t]``: there a sample exactly ``r``
  old is left out (``LEFT_OPEN`` switches the Python side to match such a server);
- ``increase`` / ``rate``: the counter's rise over the selected samples with every reset
  counted (a value below its predecessor adds the predecessor), then *extrapolated* to the
  range's edges as ``extrapolatedRate`` does: the start edge first moved no earlier than the
  counter's zero point, then either edge reached when it is closer than 1.1 average sample
  intervals, else half an interval past the first/last sample (Prometheus 3 tests the
  threshold before the zero point). Fewer than two samples: no value; samples that all share
  one millisecond count as one (Prometheus refuses a second sample at a timestamp it holds),
  so they give no value either, never a division by a zero span;
- ``deriv``: the least-squares slope over the samples' timestamps (seconds relative to the
  first sample, Kahan-compensated sums; a constant series is exactly 0);
- ``quantile_over_time``: linear interpolation at rank ``q x (n - 1)`` of the sorted values;
- ``min_over_time`` / ``count_over_time``: as their names say.

Timestamps are taken to whole milliseconds first, as Prometheus stores them.
"""

from __future__ import annotations

import math

import numpy as np

#: Prometheus 3 range selection (``(t - r, t]``) instead of 2.x's ``[t - r, t]``.
LEFT_OPEN = False


def millis(ts: np.ndarray) -> np.ndarray:
    """Timestamps as Prometheus stores them: integer milliseconds."""
    return np.round(np.asarray(ts, dtype=float) * 1000.0).astype(np.int64)


def select(ts: np.ndarray, t: float, seconds: float) -> np.ndarray:
    """Boolean mask of the samples a range selector ``[seconds]`` at instant ``t`` reads, in
    milliseconds (module docstring: closed, or left-open with ``LEFT_OPEN``)."""
    ms = millis(ts)
    end = int(round(t * 1000.0))
    start = end - int(round(seconds * 1000.0))
    return ((ms > start) if LEFT_OPEN else (ms >= start)) & (ms <= end)


def increase(ts: np.ndarray, values: np.ndarray, t: float, seconds: float) -> float | None:
    """``increase(x[seconds])`` at ``t`` over already-selected samples (``extrapolatedRate``
    with ``isRate`` false); None with fewer than two samples."""
    return _extrapolated(ts, values, t, seconds, is_rate=False)


def rate(ts: np.ndarray, values: np.ndarray, t: float, seconds: float) -> float | None:
    """``rate(x[seconds])`` at ``t``, per second: the extrapolated increase divided by the range."""
    return _extrapolated(ts, values, t, seconds, is_rate=True)


def rise(ts: np.ndarray, values: np.ndarray, t: float, seconds: float) -> float:
    """``rate(x[seconds]) * seconds`` at ``t``: a counter's rise as the rules compare it with a
    count (a recorded rate times its range, which may differ from ``increase`` in the last bit),
    0 where PromQL has no rate (fewer than two samples in the range: nothing rose there)."""
    r = rate(ts, values, t, seconds)
    return 0.0 if r is None else r * seconds


def _extrapolated(ts: np.ndarray, values: np.ndarray, t: float, seconds: float, is_rate: bool) -> float | None:
    if len(values) < 2:
        return None
    ms = millis(ts)
    if ms[-1] == ms[0]:
        return None  # one sample to Prometheus (module docstring)
    vals = [float(v) for v in values]
    result = vals[-1] - vals[0]
    prev = vals[0]
    for cur in vals[1:]:
        if cur < prev:
            result += prev
        prev = cur
    range_end = int(round(t * 1000.0))
    range_start = range_end - int(round(seconds * 1000.0))
    duration_to_start = float(int(ms[0]) - range_start) / 1000
    duration_to_end = float(range_end - int(ms[-1])) / 1000
    sampled = float(int(ms[-1]) - int(ms[0])) / 1000
    average = sampled / float(len(vals) - 1)
    if result > 0 and vals[0] >= 0:
        duration_to_zero = sampled * (vals[0] / result)
        if duration_to_zero < duration_to_start:
            duration_to_start = duration_to_zero
    threshold = average * 1.1
    interval = sampled
    interval += duration_to_start if duration_to_start < threshold else average / 2
    interval += duration_to_end if duration_to_end < threshold else average / 2
    result = result * (interval / sampled)
    return result / seconds if is_rate else result


def _kahan_inc(inc: float, total: float, c: float) -> tuple[float, float]:
    t = total + inc
    if math.isinf(t):
        c = 0.0
    elif abs(total) >= abs(inc):
        c += (total - t) + inc
    else:
        c += (inc - t) + total
    return t, c


def deriv(ts: np.ndarray, values: np.ndarray) -> float | None:
    """``deriv(x[r])`` over already-selected samples, per second; None with fewer than two
    (samples at one millisecond count as one)."""
    if len(values) < 2:
        return None
    ms = millis(ts)
    if ms[-1] == ms[0]:
        return None
    first = int(ms[0])
    vals = [float(v) for v in values]
    if all(v == vals[0] for v in vals):
        return 0.0
    n = sum_x = c_x = sum_y = c_y = sum_xy = c_xy = sum_x2 = c_x2 = 0.0
    for m, y in zip(ms, vals):
        n += 1.0
        x = float(int(m) - first) / 1e3
        sum_x, c_x = _kahan_inc(x, sum_x, c_x)
        sum_y, c_y = _kahan_inc(y, sum_y, c_y)
        sum_xy, c_xy = _kahan_inc(x * y, sum_xy, c_xy)
        sum_x2, c_x2 = _kahan_inc(x * x, sum_x2, c_x2)
    sum_x += c_x
    sum_y += c_y
    sum_xy += c_xy
    sum_x2 += c_x2
    cov_xy = sum_xy - sum_x * sum_y / n
    var_x = sum_x2 - sum_x * sum_x / n
    return cov_xy / var_x


def quantile(q: float, values: np.ndarray) -> float | None:
    """``quantile_over_time(q, x[r])`` over already-selected samples; None when empty."""
    if len(values) == 0:
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    vals = sorted(float(v) for v in values)
    n = float(len(vals))
    rank = q * (n - 1)
    lower = max(0.0, math.floor(rank))
    upper = min(n - 1, lower + 1)
    weight = rank - math.floor(rank)
    return vals[int(lower)] * (1 - weight) + vals[int(upper)] * weight
