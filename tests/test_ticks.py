"""Axis ticks of the HTML report: 1-2-5 steps from 0 to the first round value at or above the
data, labels with the decimals the step needs, a unit axis for a series with nothing above 0,
and clock ticks on round seconds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdiag.report.ticks import TIME_STEPS, round_axis, tick_label, time_ticks


def is_1_2_5(step: float) -> bool:
    mantissa = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mantissa, m) for m in (1, 2, 5))


@pytest.mark.parametrize(
    ("top", "ticks"),
    [
        (660, (0, 200, 400, 600, 800)),  # the report's odd grid values: now round
        (161, (0, 50, 100, 150, 200)),
        (832, (0, 200, 400, 600, 800, 1000)),
        (1.0, (0, 0.2, 0.4, 0.6, 0.8, 1.0)),
        (0.97, (0, 0.2, 0.4, 0.6, 0.8, 1.0)),
        (220_000, (0, 50_000, 100_000, 150_000, 200_000, 250_000)),
    ],
)
def test_round_axis_known_values(top: float, ticks: tuple[float, ...]) -> None:
    assert round_axis(top).ticks == ticks


@pytest.mark.parametrize("flat", [0.0, -3.0, math.nan, math.inf])
def test_nothing_above_zero_gets_the_unit_axis(flat: float) -> None:
    axis = round_axis(flat)
    assert axis.ticks == (0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert [axis.label(v) for v in axis.ticks] == ["0", "0.2", "0.4", "0.6", "0.8", "1.0"]


@given(st.floats(min_value=1e-6, max_value=1e12, allow_nan=False))
def test_any_top_gets_a_1_2_5_step_that_covers_it_without_waste(top: float) -> None:
    axis = round_axis(top)
    assert axis.ticks[0] == 0 and axis.top >= top * (1 - 1e-9)  # float noise aside
    assert is_1_2_5(axis.step)
    assert all(math.isclose(b - a, axis.step, rel_tol=1e-9) for a, b in zip(axis.ticks, axis.ticks[1:]))
    assert axis.top - axis.step < top  # the top tick is the first at or above the data
    assert 2 <= len(axis.ticks) - 1 <= 5


@pytest.mark.parametrize(
    ("v", "step", "label"),
    [(0, 50_000, "0"), (150_000, 50_000, "150k"), (3e6, 1e6, "3M"), (800, 200, "800"), (0.4, 0.2, "0.4"), (0.005, 0.001, "0.005"), (2e9, 1e9, "2G")],
)
def test_tick_labels(v: float, step: float, label: str) -> None:
    assert tick_label(v, step) == label


def test_time_ticks_fall_on_round_clock_times() -> None:
    ticks, step = time_ticks(1_000_000_003.4, 1_000_000_703.9)  # 700 s
    assert step == 120 and all(t % 120 == 0 for t in ticks)
    assert ticks[0] >= 1_000_000_003.4 and ticks[-1] <= 1_000_000_703.9 and len(ticks) == 6
    assert time_ticks(5.0, 5.0) == ([], TIME_STEPS[0])  # one instant: nothing to mark
    short, step = time_ticks(10.2, 13.9)
    assert step == 1 and short == [11.0, 12.0, 13.0]
