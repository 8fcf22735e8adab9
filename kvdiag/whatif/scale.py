"""The scale model: a k-th of the pool and of the load, each step as long as at full size.

An hour of a 1.5 M-token pool at 50 req/s costs minutes of the reference pool's time per replay;
most of that is per running request, so a model with a k-th of the pool (``Sized.scale``),
a k-th of the arrivals and a k-th of any admission cap (the engine's default caps too:
``scenarios._make_engine``) runs about k times faster. Each step of
it holds a k-th of the full-size batch and is timed as the full-size batch would be
(``ScaledRoofline``), so usage and TTFT keep their magnitudes; queues, evictions and throughput
count a k-th and are multiplied back (``Outcome.upscaled``). What does not scale (the shared prefixes,
which take the same tokens of a smaller pool; per-step token budgets; the randomness of a k-th
of the requests) is the model's error, which ``kvdiag whatif --scale`` measures on the window
itself (the calibration at both sizes) and ``bench/bench_whatif.py`` on an hour.

``auto_scale`` is what ``--scale auto`` picks: full size for a window whose replays are short
anyway, else a model small enough to replay quickly that still runs a busy engine's batch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from kvdiag.refpool.scenarios import Scenario
from kvdiag.refpool.workload import EveryKth
from kvdiag.whatif.deployment import sized
from kvdiag.window import Window


def scaled(scenario: Scenario, k: float) -> Scenario:
    """``scenario`` at 1/k: pool, arrivals (every k-th of the same stream, ``EveryKth``) and
    admission cap divided by ``k``."""
    if k == 1:
        return scenario

    def thin(wls: tuple) -> tuple:  # type: ignore[type-arg]
        return tuple(replace(w, arrivals=EveryKth(w.arrivals, k)) for w in wls)

    return replace(
        scenario,
        deployment=replace(sized(scenario.deployment), scale=k),
        workloads=thin(scenario.workloads),
        workloads_by_engine={e: thin(w) for e, w in scenario.workloads_by_engine.items()},
        max_running=None if scenario.max_running is None else max(1, math.ceil(scenario.max_running / k)),
    )



#: Concurrent requests a scale model keeps at least through the window (at its median running
#: count), so its batches and queue stay a busy engine's: bench_whatif's hour gets 1/8 on vLLM
#: (median 1,023 running) and 1/10 on SGLang (1,288), both within the goal on its 5-minute
#: baseline. By the peak instead (SGLang's 1,586, a transient), SGLang got 1/13, where one more DP
#: replica's P99 TTFT was off by +31 %.
MIN_RUNNING = 120
#: Requests in a window below which a full-size replay is quick (seconds each here) and no
#: scale model is worth its error.
MAX_REQUESTS = 5_000


def median_running(window: Window) -> float | None:
    """The window's median running count, the one ``auto_scale`` reads (None: not reported)."""
    running = window.column("running") if window.has("running") else None
    return float(np.nanmedian(running)) if running is not None and np.isfinite(running).any() else None


def auto_scale(requests: float, running: float | None) -> float:
    """``--scale auto``: 1 where the window holds at most ``MAX_REQUESTS`` requests (or its running
    count is unknown), else the whole k that brings it to ``MAX_REQUESTS``, at most the one that
    leaves ``MIN_RUNNING`` requests running at the window's median ``running`` count."""
    if requests <= MAX_REQUESTS or not running:
        return 1.0
    return float(max(1, min(math.ceil(requests / MAX_REQUESTS), math.floor(running / MIN_RUNNING))))
