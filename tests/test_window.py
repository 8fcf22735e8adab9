"""The window: reset-safe counters, Prometheus-exact histogram quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvdiag.model import Histogram, PoolSample
from kvdiag.window import Window, bucket_quantile, counter_increase, windows


def _sample(ts: float, **kw: object) -> PoolSample:
    return PoolSample("i", "x", ts, **kw)  # type: ignore[arg-type]


def test_counter_increase_is_reset_safe() -> None:
    assert counter_increase(np.array([10.0, 12.0, 15.0])) == 5.0
    # Restart after 15: the engine counts 0 -> 4 again; the increase is 5 + 4, never negative.
    assert counter_increase(np.array([10.0, 12.0, 15.0, 1.0, 4.0])) == 9.0
    assert counter_increase(np.array([7.0])) == 0.0


def test_restart_mid_window_is_not_a_spike_nor_negative() -> None:
    w = Window("i", [_sample(t, evictions_total=v) for t, v in [(0, 100.0), (5, 100.0), (10, 0.0), (15, 0.0)]])
    assert w.increase("evictions_total") == 0.0
    assert w.resets("evictions_total") == 1
    assert w.rate("evictions_total") == 0.0


def test_absent_field_is_none_not_zero() -> None:
    w = Window("i", [_sample(t, running=3.0) for t in range(3)])
    assert w.increase("evictions_total") is None and not w.has("evictions_total")
    assert w.has("running")


def test_bucket_quantile_matches_prometheus_algorithm() -> None:
    bounds = (0.1, 1.0, 10.0, math.inf)
    # 100 observations: 10 <= 0.1, 50 <= 1, 90 <= 10, 100 total.
    q = bucket_quantile(0.5, bounds, np.array([10, 50, 90, 100]))
    assert q.value == pytest.approx(0.1 + 0.9 * (50 - 10) / 40) and (q.lower, q.upper) == (0.1, 1.0)
    q99 = bucket_quantile(0.99, bounds, np.array([10, 50, 90, 100]))
    assert q99.value == 10.0 and q99.upper == math.inf  # rank in +Inf bucket: the last finite bound
    first = bucket_quantile(0.05, bounds, np.array([10, 50, 90, 100]))
    assert first.value == pytest.approx(0.05) and first.lower == 0.0
    assert bucket_quantile(0.5, bounds, np.array([0, 0, 0, 0])) is None


def test_window_quantile_over_increase_with_a_restart() -> None:
    bounds = (1.0, 10.0, math.inf)
    h = lambda c: Histogram(bounds, c, 0.0, c[-1])  # noqa: E731
    samples = [
        _sample(0, ttft=h((100.0, 100.0, 100.0))),
        _sample(5, ttft=h((100.0, 150.0, 150.0))),  # +50 slow-ish (1-10 s)
        _sample(10, ttft=h((0.0, 0.0, 0.0))),  # restart
        _sample(15, ttft=h((0.0, 0.0, 50.0))),  # +50 in +Inf
    ]
    w = Window("i", samples)
    inc = w.histogram_increase("ttft")
    assert inc.counts == (0.0, 50.0, 100.0) and inc.count == 100.0
    q = w.quantile(0.5, "ttft")
    assert q.value == 10.0 and (q.lower, q.upper) == (1.0, 10.0)


def test_windows_groups_and_trims() -> None:
    samples = [PoolSample(inst, "x", float(t)) for inst in ("a", "b") for t in range(0, 100, 10)]
    ws = windows(samples, seconds=30)
    assert set(ws) == {"a", "b"} and [s.ts for s in ws["a"].samples] == [60, 70, 80, 90]
    assert ws["a"].frame.shape == (4, ws["a"].frame.shape[1]) and ws["a"].duration == 30


def test_histogram_restart_where_a_bucket_refills_past_its_old_count() -> None:
    bounds = (1.0, math.inf)
    h = lambda c: Histogram(bounds, c, 0.0, c[-1])  # noqa: E731
    # Before: 5 fast of 100. After the restart: 10 fast of 10 (the fast bucket grew past 5).
    w = Window("i", [_sample(0, ttft=h((5.0, 100.0))), _sample(5, ttft=h((10.0, 10.0)))])
    inc = w.histogram_increase("ttft")
    assert inc.counts == (10.0, 10.0) and inc.count == 10.0
