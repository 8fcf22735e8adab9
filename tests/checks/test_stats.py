"""PromQL's statistics on samples that share a timestamp: a frozen engine scraped twice on a
story clock (the demo), or a target that repeats its exposition's timestamps."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvdiag.checks import diagnose, stats
from kvdiag.config import Config
from kvdiag.window import Window
from tests.checks.scenario import T0, recording, ramp, samples


@pytest.mark.parametrize("fn", [stats.increase, stats.rate])
def test_counter_samples_at_one_millisecond_have_no_rate(fn) -> None:
    ts = np.array([T0, T0, T0 + 0.0004])  # one millisecond once stored
    assert fn(ts, np.array([1.0, 5.0, 9.0]), T0 + 60, 60.0) is None


def test_counter_samples_at_distinct_times_still_extrapolate() -> None:
    # the control: the same values 5 s apart give PromQL's extrapolated increase
    ts = np.array([T0, T0 + 5, T0 + 10])
    assert stats.increase(ts, np.array([1.0, 5.0, 9.0]), T0 + 10, 10.0) == pytest.approx(8.0 * 10 / 10)


def test_gauge_samples_at_one_millisecond_have_no_slope() -> None:
    ts = np.array([T0, T0, T0])
    assert stats.deriv(ts, np.array([0.0, 3.0, 6.0])) is None
    assert stats.deriv(np.array([T0, T0 + 1, T0 + 2]), np.array([0.0, 3.0, 6.0])) == pytest.approx(3.0)


def test_checklist_on_a_window_whose_scrapes_share_a_timestamp() -> None:
    """Six scrapes at one instant are one sample: the growth checks need a window (as on a
    single scrape) instead of dividing by a zero span or reading growth into no time at all."""
    scrapes = recording("vllm", steps=6, usage=ramp(0.5, 0.1), evictions=ramp(0, 2), waiting=ramp(0, 3))
    frozen = [replace(s, ts=T0) for s in samples(scrapes)]
    d = diagnose(Window(frozen[0].instance, frozen), Config())
    for name in ("queue_growing", "evictions_growing"):
        assert d.checks[name].status == "unknown", name
        assert "from 1 sample " in d.checks[name].evidence.summary
    # the control: the same scrapes 5 s apart show both growing
    spread = diagnose(Window(frozen[0].instance, samples(scrapes)), Config())
    assert spread.checks["evictions_growing"].status == "firing"
