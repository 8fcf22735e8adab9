"""Axis ticks a reader can read: round values in 1-2-5 steps, clock times on round seconds.

A chart whose grid lines fall on 660 or 161, or whose flat zero series gets a 1.1e-09 axis,
makes the reader do arithmetic (or doubt the data) before seeing the shape. The y axis runs
from 0 to the first round tick at or above the data; a series with nothing above zero gets a
unit axis, so "no evictions" reads as a line on 0 of 1, not as noise around a billionth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Steps of a clock axis, in seconds: round for a person reading a time of day.
TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
_UNITS = ((1e9, "G"), (1e6, "M"), (1e3, "k"))


@dataclass(frozen=True)
class Axis:
    """A value axis: its ticks from 0 up (the last is the axis top) and their common step."""

    ticks: tuple[float, ...]
    step: float

    @property
    def top(self) -> float:
        return self.ticks[-1]

    def label(self, v: float) -> str:
        """The tick's value as ``tick_label`` writes it for this axis's step."""
        return tick_label(v, self.step)


def round_axis(top: float, target: int = 5) -> Axis:
    """Ticks 0, s, 2s, ... up to the first multiple of a 1-2-5 step ``s`` at or above ``top``,
    about ``target`` intervals. Nothing above zero (or not finite) gets the unit axis."""
    if not math.isfinite(top) or top <= 0:
        top = 1.0
    raw = top / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    n = max(1, math.ceil(top / step - 1e-9))
    return Axis(tuple(_clean(i * step) for i in range(n + 1)), _clean(step))


def tick_label(v: float, step: float) -> str:
    """``v`` in the largest unit (k, M, G) the step reaches, with the decimals the step needs:
    200k, 1M, 800, 0.2, 0.005; zero is always "0"."""
    if v == 0:
        return "0"
    div, suffix = next(((d, s) for d, s in _UNITS if step >= d), (1.0, ""))
    decimals = max(0, -math.floor(math.log10(step / div) + 1e-9))
    return f"{v / div:.{decimals}f}{suffix}" if decimals <= 4 else f"{v:.1e}"


def time_ticks(t0: float, t1: float, target: int = 6) -> tuple[list[float], int]:
    """Round clock times inside [t0, t1] (multiples of a step from ``TIME_STEPS`` that gives at
    most about ``target`` intervals) and that step; an empty span has no ticks."""
    span = t1 - t0
    if not span > 0:
        return [], TIME_STEPS[0]
    step = next((s for s in TIME_STEPS if span / s <= target), TIME_STEPS[-1])
    first = math.ceil(t0 / step) * step
    return [float(t) for t in range(int(first), int(math.floor(t1)) + 1, step)], step


def _clean(v: float) -> float:
    """Strip binary noise (0.30000000000000004) so labels and comparisons see the round value."""
    return float(f"{v:.12g}")
