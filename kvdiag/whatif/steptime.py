"""The step-time law a replay runs at: fitted from the incident's own histograms, or a GPU preset.

A replay needs each engine step's duration. The GPU presets (``refpool.roofline.Roofline``)
describe a known model on a known GPU; an engine on anything else (a CPU, a GPU kvdiag does not
list, a model with no preset) would be replayed at a guessed speed. Both engines export what a
step-time law can be read from: the inter-token latency histogram (every token after a
request's first waited one decode step, or a prefill step beside it), the running count, the
tokens the running requests hold, and the prefix-cache query and hit token counters (the prompt
tokens scheduled, and how many of them were cached).

Over each scrape interval the ITL histogram's increase gives the mean time a decoding request
waited per token. Every step in the interval delays each of the B running requests, so

    mean ITL ≈ fixed + per_decode·B + per_context·C + per_prefill·(P / steps)

with B the mean running count, C the context they read (the tokens they hold, plus the shared
prefix each reads that the pool holds once: the hit ratio times the mean prompt, per request), P the prompt tokens
prefilled (queried minus hit, plus what preempted or retracted requests prefill again) and steps ≈ decoded tokens / B. The coefficients are the
``StepLaw``, fitted by least squares over the intervals, each weighted by its tokens (so the
law's time over the window's tokens is the time they took), none negative. The law's error is its ITL against the observed one over the same intervals (a
weighted relative RMS); the preset's is measured the same way.

Which one a replay uses (``choose``): the preset where the model is a preset's and the preset
explains the window's ITL within 25 % (the GPU presets stay); else the fitted law where the
model has no preset (the preset would be an assumed model on an assumed GPU) or the law is
nearer than the preset; the preset, as a prior, where the data is too thin to fit (few intervals
with tokens) or the law fits a known model no better than its preset. ``whatif`` states the choice and both errors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvdiag.refpool.roofline import Roofline, StepLaw
from kvdiag.window import Window, counter_steps

#: Intervals with at least this many inter-token observations count (fewer: one request's
#: tokens, whose mean says more about it than about the step).
MIN_TOKENS = 20
#: Intervals a law needs; fewer is thin data, and the preset stays.
MIN_INTERVALS = 8
#: A fitted law over this weighted relative RMS error of the observed ITL is said to be noisy
#: (a loaded machine, few tokens an interval); it is used all the same where the model has no
#: preset: a preset of an assumed model on an assumed GPU is no evidence about the hardware.
GOOD_ERROR = 0.15
#: A preset is kept over a fitted law where its error is within this (it is the law of a known
#: model on a known GPU: a small error is the window's noise, not a wrong law).
PRESET_ERROR = 0.25


@dataclass(frozen=True)
class Points:
    """Per-interval observations: mean ITL (s), its token weight, mean running count, mean
    context tokens held, and prompt tokens prefilled per decode step."""

    itl: np.ndarray
    weight: np.ndarray
    decodes: np.ndarray
    context: np.ndarray
    prefill: np.ndarray

    def __len__(self) -> int:
        return len(self.itl)

    def error(self, predicted: np.ndarray) -> float:
        """Weighted relative RMS error of ``predicted`` against the observed ITL."""
        rel = (predicted - self.itl) / self.itl
        return float(np.sqrt(np.sum(self.weight * rel**2) / np.sum(self.weight)))

    def law_itl(self, law: StepLaw) -> np.ndarray:
        return law.fixed + law.per_decode * self.decodes + law.per_context * self.context + law.per_prefill * self.prefill

    def preset_itl(self, roofline: Roofline) -> np.ndarray:
        """The preset's step for each interval's batch: B decodes over C context, with the
        interval's prefill per step beside them (as one prompt's chunk)."""
        out = []
        for b, c, p in zip(self.decodes, self.context, self.prefill):
            n, ctx = round(b + p), round(c)
            out.append(roofline.batch_seconds(n, ctx, float(ctx + b) + p * (p + 1) / 2))
        return np.array(out)


@dataclass(frozen=True)
class StepFit:
    """The law a replay runs at and why: ``used`` is "fitted" or "preset"; ``law`` the fitted
    law (None where the window gave too little to fit one); errors as ``Points.error``."""

    used: str
    law: StepLaw | None
    intervals: int
    error: float | None
    preset_error: float | None
    why: str

    def describe(self) -> str:
        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.0%}"

        law = "" if self.law is None else (
            f"; fitted: {self.law.fixed * 1e3:.2f} ms + {self.law.per_decode * 1e3:.3f} ms/request + "
            f"{self.law.per_context * 1e6:.3f} us/context token + {self.law.per_prefill * 1e3:.3f} ms/prompt token"
        )  # fmt: skip
        return (f"{self.used} ({self.why}){law}; ITL error over {self.intervals} intervals: fitted {pct(self.error)}, "
                f"preset {pct(self.preset_error)}")  # fmt: skip

    def as_json(self) -> dict[str, object]:
        law = None if self.law is None else {k: getattr(self.law, k) for k in ("fixed", "per_decode", "per_context", "per_prefill")}
        return {"used": self.used, "law": law, "intervals": self.intervals, "error": self.error,
                "preset_error": self.preset_error, "why": self.why}  # fmt: skip


def points(window: Window) -> Points | None:
    """The window's intervals with enough decoding to read a step from (None: no ITL histogram,
    or no running count)."""
    steps = window.histogram_steps("itl")
    if steps is None or not window.has("running"):
        return None
    ts_end, sums, counts = steps
    ts = window.column("ts")
    index = {float(t): i for i, t in enumerate(ts)}
    running = window.column("running")
    used = window.column("used_tokens") if window.has("used_tokens") else np.zeros(len(ts))
    prompt, hits = (_steps(window, name, len(ts)) for name in (_prompt_counter(window), "prefix_hit_tokens_total"))
    shared = _shared_prefix(window)
    recompute = _recomputed(window, len(ts), shared)
    rows = []
    for t, s, n in zip(ts_end, sums, counts):
        i = index.get(float(t))
        if i is None or i == 0 or n < MIN_TOKENS or s <= 0:
            continue
        b = float(np.nanmean(running[i - 1 : i + 1]))
        c = float(np.nanmean(used[i - 1 : i + 1])) + shared * b
        if not b > 0 or np.isnan(c):
            continue
        p = max(0.0, float(np.nan_to_num(prompt[i]) - np.nan_to_num(hits[i]))) + float(np.nan_to_num(recompute[i]))
        rows.append((s / n, n, b, c, p * b / n))  # P over steps, steps = tokens / B
    if not rows:
        return Points(*(np.empty(0) for _ in range(5)))
    a = np.array(rows)
    return Points(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


def _shared_prefix(window: Window) -> float:
    """Cached prefix tokens per request (the window's hit ratio times its mean prompt): a step
    reads each running request's whole context, shared prefix included, where the pool holds a
    shared prefix once; the tokens held plus this per running request is the context read."""
    hits, queried = window.increase("prefix_hit_tokens_total"), window.increase(_prompt_counter(window))
    prompt, requests = window.increase("prompt_tokens_total"), window.increase("requests_total")
    if not hits or not queried or not prompt or not requests:
        return 0.0
    return min(1.0, hits / queried) * prompt / requests


def _recomputed(window: Window, n: int, shared: float) -> np.ndarray:
    """Tokens prefilled again for requests preempted or retracted, per interval: neither
    engine's prefix-cache counters count a resumed request's lookup, yet its prefill takes the
    step's time. SGLang counts the tokens retraction threw away; where only the evictions are
    counted (vLLM), each victim is taken to recompute a mean request at half its output, less the
    shared prefix the cache still holds."""
    if window.has("recompute_tokens_total"):
        return _steps(window, "recompute_tokens_total", n)
    prompt, output, requests = (window.increase(k) for k in ("prompt_tokens_total", "generation_tokens_total", "requests_total"))
    if not requests or prompt is None or output is None or not window.has("evictions_total"):
        return np.zeros(n)
    victim = max(0.0, prompt / requests - shared) + output / requests / 2
    return _steps(window, "evictions_total", n) * victim


def _prompt_counter(window: Window) -> str:
    """The prompt tokens looked up in the prefix cache, counted when they are scheduled (both
    engines' query counters), else the prompt tokens (SGLang counts those at a request's finish,
    a request's lifetime late)."""
    return "prefix_query_tokens_total" if window.has("prefix_query_tokens_total") else "prompt_tokens_total"


def _steps(window: Window, name: str, n: int) -> np.ndarray:
    return counter_steps(window.column(name), bridge=True) if window.has(name) else np.zeros(n)


def fit_law(pts: Points) -> StepLaw:
    """The non-negative law with the least squared error, each interval weighted by its tokens
    (every subset of the four terms solved, the best one with no negative coefficient kept): the
    law's time over the window's tokens is then the time they took. A relative error would
    favour the short intervals: on a noisy window (a loaded machine) it fitted a law half as
    slow as the engine ran."""
    x = np.column_stack([np.ones(len(pts)), pts.decodes, pts.context, pts.prefill])
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    w = np.sqrt(pts.weight)
    xs, ys = x / scale * w[:, None], pts.itl * w
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            sub = list(cols)
            coef, *_ = np.linalg.lstsq(xs[:, sub], ys, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[sub] = coef
            sse = float(np.sum((xs @ full - ys) ** 2))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, full)
    assert best is not None, "the intercept alone is a non-negative fit"
    c = best[1] / scale
    return StepLaw(float(c[0]), float(c[1]), float(c[2]), float(c[3]))


def choose(window: Window, preset: Roofline, preset_known: bool) -> StepFit:
    """The law a replay of ``window`` runs at (module docstring): ``preset_known`` says the
    model is a preset's (read from its label), so the preset is trusted where it fits."""
    pts = points(window)
    if pts is None:
        return StepFit("preset", None, 0, None, None, "no inter-token latency histogram in the window")
    if len(pts) < MIN_INTERVALS:
        return StepFit("preset", None, len(pts), None, None,
                       f"thin data: {len(pts)} intervals with {MIN_TOKENS}+ tokens decoded, {MIN_INTERVALS} needed")  # fmt: skip
    law = fit_law(pts)
    error = pts.error(pts.law_itl(law))
    preset_error = pts.error(pts.preset_itl(preset))
    if preset_known and preset_error <= PRESET_ERROR:
        return StepFit("preset", law, len(pts), error, preset_error, "the model's preset explains the window's ITL")
    if not preset_known or error < preset_error:
        why = "the window's model has no preset" if not preset_known else "the preset does not explain the window's ITL"
        noisy = f"; a noisy window (over {GOOD_ERROR:.0%})" if error > GOOD_ERROR else ""
        return StepFit("fitted", law, len(pts), error, preset_error, why + noisy)
    return StepFit("preset", law, len(pts), error, preset_error, "the fitted law explains the window's ITL no better than the preset")
