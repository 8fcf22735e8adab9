"""A request-length distribution fitted to an engine's length histogram over a window.

Both engines observe each finished request's prompt and generated tokens in a histogram (vLLM
``request_prompt_tokens`` / ``request_generation_tokens``, SGLang ``prompt_tokens_histogram`` /
``generation_tokens_histogram``). Their buckets are coarse (vLLM's 1-2-5 series, SGLang's
100 / 300 / 500 / ...), so a quantile interpolated inside a bucket is a poor estimate of a
spread. What a histogram's increase gives exactly is its sum over its count (the mean), and how
many requests fell in each bucket. The fit keeps the mean exact and takes the log-normal sigma
that makes those bucket counts most likely (the median follows from the two), with the longest
request capped at the highest non-empty bucket's bound: the replay never draws a length the
window did not see, and everything the cap clips falls in that bucket, as its count says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvdiag.model import Histogram
from kvdiag.refpool.workload import Fixed, LengthDist, LogNormal

#: The sigmas searched (log-normal spread): from nearly fixed lengths to a very long tail.
SIGMA_RANGE = (0.02, 2.5)
#: Requests in a window below which the histogram says too little to fit a spread.
MIN_REQUESTS = 20
#: Means below this many tokens replay as a fixed length (a log-normal that short is all rounding).
MIN_MEAN = 4.0


@dataclass(frozen=True)
class LengthFit:
    """A fitted length distribution: the mean per request, and its log-normal median, sigma and
    cap (None for a fixed length)."""

    mean: float
    median: float | None
    sigma: float | None
    hi: int | None

    @property
    def dist(self) -> LengthDist:
        """The replay's distribution (the workload generator's)."""
        if self.median is None or self.sigma is None or self.hi is None:
            return Fixed(max(1, round(self.mean)))
        return LogNormal(self.median, self.sigma, lo=1, hi=self.hi)

    def describe(self) -> str:
        if self.median is None:
            return f"fixed {max(1, round(self.mean)):,}"
        return f"log-normal median {self.median:,.0f}, sigma {self.sigma:.2f}, up to {self.hi:,}"

    def as_json(self) -> dict[str, float | int | None]:
        return {"mean": round(self.mean, 1), "median": None if self.median is None else round(self.median, 1),
                "sigma": None if self.sigma is None else round(self.sigma, 3), "hi": self.hi}  # fmt: skip


def from_mean(mean: float, sigma: float, clip: float) -> LengthFit:
    """A log-normal of this mean with an assumed sigma, capped at ``clip`` times its median: what
    the token counters alone allow."""
    if mean < MIN_MEAN:
        return LengthFit(mean, None, None, None)
    median = mean / math.exp(sigma**2 / 2)  # LogNormal's mean is median * exp(sigma^2 / 2)
    return LengthFit(mean, median, sigma, max(2, round(clip * median)))


def from_histogram(h: Histogram, clip: float) -> LengthFit | None:
    """The log-normal that keeps the histogram's mean and makes its bucket counts most likely
    (module docstring); None where it holds fewer than ``MIN_REQUESTS`` observations. ``clip``
    times the median caps it only where the highest non-empty bucket is the +Inf one."""
    if h.count < MIN_REQUESTS or not h.sum > 0:
        return None
    mean = h.sum / h.count
    cumulative = np.maximum.accumulate(np.asarray(h.counts, dtype=float))  # as Prometheus' ensureMonotonic
    per_bucket = np.diff(np.concatenate(([0.0], cumulative)))
    filled = np.flatnonzero(per_bucket > 0)
    if mean < MIN_MEAN or len(filled) == 0:
        return LengthFit(mean, None, None, None)
    lowers = np.concatenate(([0.0], np.asarray(h.bounds[:-1], dtype=float)))[filled]
    uppers = np.asarray(h.bounds, dtype=float)[filled]
    uppers[-1] = math.inf  # the cap sits at the top bucket's bound: all its tail lands there
    sigma = _most_likely_sigma(mean, per_bucket[filled], lowers, uppers)
    median = mean / math.exp(sigma**2 / 2)
    top = h.bounds[int(filled[-1])]
    hi = round(top) if math.isfinite(top) else round(clip * median)
    return LengthFit(mean, median, sigma, max(2, hi))


def _most_likely_sigma(mean: float, counts: np.ndarray, lowers: np.ndarray, uppers: np.ndarray) -> float:
    """The sigma in ``SIGMA_RANGE`` of the highest bucket likelihood at a fixed mean: a grid,
    then a golden-section search between the best point's neighbours."""

    def loglik(sigma: float) -> float:
        mu = math.log(mean) - sigma**2 / 2
        total = 0.0
        for n, lo, up in zip(counts, lowers, uppers):
            p = _cdf(up, mu, sigma) - _cdf(lo, mu, sigma)
            total += n * math.log(max(p, 1e-300))
        return total

    grid = np.geomspace(*SIGMA_RANGE, 60)
    values = [loglik(float(s)) for s in grid]
    best = int(np.argmax(values))
    a, b = float(grid[max(0, best - 1)]), float(grid[min(len(grid) - 1, best + 1)])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if loglik(c) >= loglik(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def _cdf(x: float, mu: float, sigma: float) -> float:
    """The log-normal's CDF at ``x`` (0 at 0, 1 at +Inf)."""
    if x <= 0:
        return 0.0
    if math.isinf(x):
        return 1.0
    return 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2.0))))
