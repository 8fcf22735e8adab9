"""Run scenarios through the reference engine and measure them as the engine's metrics show.

A replay is measured exactly as the incident was: the reference engine's exposition is scraped
at the incident's interval, read back through the same adapters into windows, and ``measure``
takes the same figures from both (usage, waiting, evictions per minute, P99 and mean TTFT from
the TTFT histogram, generated tokens per second), while the verdict comes from the real
checklist. So observed and replayed numbers differ by the fit and the engine model, never by
how they were read. Replays are independent and go to worker processes, one per core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from kvdiag.checks import diagnose
from kvdiag.checks.catalog import EXIT_ORDER
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample
from kvdiag.refpool.scenarios import Scenario, ScenarioRun
from kvdiag.refpool.workers import in_workers
from kvdiag.whatif.levers import Lever
from kvdiag.whatif.scale import scaled
from kvdiag.window import Window, bucket_quantile

CALIBRATION = "calibration"


@dataclass(frozen=True)
class Outcome:
    """What the metrics say about a span: one instance, or DP replicas taken together (usage
    averaged, queues, evictions and throughput summed, TTFT over every replica's requests,
    the worst replica's verdict)."""

    usage: float | None  # mean reported usage ratio
    waiting: float | None  # mean waiting requests
    evictions_per_min: float | None
    p99_ttft: float | None  # seconds, histogram_quantile over the span
    mean_ttft: float | None
    throughput: float | None  # generated tokens per second
    verdict: str
    replicas: int = 1
    #: P99 over the requests' own TTFTs, exact where the histogram's P99 is interpolated inside
    #: buckets as wide as 10-20 s: the simulated requests' in a replay, the clients' measured ones
    #: on a real engine (``whatif.reality``); None where only the metrics are known.
    p99_ttft_sim: float | None = None
    median_ttft_sim: float | None = None  # the same requests' median TTFT
    running: float | None = None  # mean running requests (summed over replicas)

    def as_json(self) -> dict[str, object]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}

    def upscaled(self, k: float) -> Outcome:
        """A scale model's outcome in full-size units (``whatif.scale``): the counts of requests
        and tokens times ``k``; usage and latencies as they are."""
        if k == 1:
            return self
        waiting, evictions, tput = (None if v is None else v * k for v in (self.waiting, self.evictions_per_min, self.throughput))
        return replace(self, waiting=waiting, evictions_per_min=evictions, throughput=tput)


def measure(windows: Sequence[Window], config: Config) -> Outcome:
    """``Outcome`` of whole windows (the incident, or a replay of it)."""
    def mean(name: str) -> list[float]:
        return [float(np.nanmean(w.column(name))) for w in windows if w.has(name)]

    minutes = max(w.duration for w in windows) / 60.0
    usage, waiting, running = mean("usage_ratio"), mean("waiting"), mean("running")
    evictions = [w.increase("evictions_total") for w in windows]
    generated = [w.increase("generation_tokens_total") for w in windows]
    hists = [h for h in (w.histogram_increase("ttft") for w in windows) if h is not None and h.count > 0]
    p99 = mean_ttft = None
    if hists and all(h.bounds == hists[0].bounds for h in hists):
        counts = np.sum([h.counts for h in hists], axis=0)
        q = bucket_quantile(0.99, hists[0].bounds, counts)
        p99 = None if q is None else q.value
        mean_ttft = sum(h.sum for h in hists) / sum(h.count for h in hists)
    verdicts = [diagnose(w, config).verdict for w in windows]
    worst = max(verdicts, key=lambda v: EXIT_ORDER.index(v.exit_code))
    return Outcome(
        usage=float(np.mean(usage)) if usage else None,
        waiting=float(np.sum(waiting)) if waiting else None,
        evictions_per_min=sum(evictions) / minutes if minutes > 0 and None not in evictions else None,  # type: ignore[arg-type]
        p99_ttft=p99,
        mean_ttft=mean_ttft,
        throughput=sum(generated) / (minutes * 60) if minutes > 0 and None not in generated else None,  # type: ignore[arg-type]
        verdict=worst.name,
        replicas=len(windows),
        running=float(np.sum(running)) if running else None,
    )


def emitted(scenario: Scenario, engine: str, interval: float) -> tuple[list[Window], ScenarioRun]:
    """Run ``scenario`` on the reference ``engine`` and read its exposition back, scraped every
    ``interval`` simulated seconds: a window per instance, in instance order, and the run
    (without the per-step log: the windows and the requests' records are what is read)."""
    run = ScenarioRun(scenario, engine, record_steps=False)
    by_instance: dict[str, list[PoolSample]] = {}
    for _, scrape in run.scrapes(interval):
        for s in normalize_scrape(scrape, engine):
            by_instance.setdefault(s.instance, []).append(s)
    return [Window(i, by_instance[i]) for i in sorted(by_instance)], run


def replay(scenario: Scenario, engine: str, interval: float, config: Config) -> Outcome:
    """``measure`` of what ``scenario``'s metrics show on the reference ``engine``, with the
    exact P99 TTFT of the requests whose first token came within the scraped span."""
    windows, run = emitted(scenario, engine, interval)
    ttfts = [r.ttft for sim in run.sims for r in sim.records if r.first_token is not None and r.first_token >= interval]
    return with_ttfts(measure(windows, config), ttfts)


def with_ttfts(outcome: Outcome, ttfts: Sequence[float]) -> Outcome:
    """``outcome`` with the exact P99 and median of these requests' TTFTs (None: no request)."""
    if not ttfts:
        return outcome
    return replace(outcome, p99_ttft_sim=float(np.quantile(ttfts, 0.99)), median_ttft_sim=float(np.median(ttfts)))


@dataclass(frozen=True)
class Job:
    """One replay to run: an instance's fitted scenario (``lever`` None: the calibration) or the
    catalogue's, with a remedy applied or not."""

    key: str  # whose replay (an instance), for progress lines and grouping
    lever: Lever | None
    scenario: Scenario
    engine: str
    interval: float
    config: Config
    scale: float = 1.0  # run as a scale model at 1/scale (``whatif.scale``)
    first_s: float | None = None  # only the window's first seconds (None: all of it)


@dataclass(frozen=True)
class Run:
    """A job's outcome, or why it failed."""

    key: str
    lever: Lever | None
    outcome: Outcome | None
    error: str
    wall_s: float
    scale: float = 1.0
    first_s: float | None = None

    @property
    def label(self) -> str:
        name = CALIBRATION if self.lever is None else self.lever.label
        if self.first_s is not None:
            name += f", first {self.first_s / 60:g} min"
        return name if self.scale == 1 else f"{name} (1/{self.scale:g} scale)"


def _run(job: Job) -> Run:
    t0 = time.perf_counter()
    scenario = job.scenario if job.first_s is None else replace(job.scenario, duration=min(job.first_s, job.scenario.duration))
    try:
        outcome = replay(scaled(scenario, job.scale), job.engine, job.interval, job.config).upscaled(job.scale)
        return Run(job.key, job.lever, outcome, "", time.perf_counter() - t0, job.scale, job.first_s)
    except Exception as exc:  # noqa: BLE001 (one remedy's failure is its row, never the others')
        return Run(job.key, job.lever, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0, job.scale, job.first_s)


def replay_all(jobs: Sequence[Job], workers: int = 1, progress: Callable[[Run], None] | None = None) -> list[Run]:
    """Every job (``in_workers``)."""
    return in_workers(_run, jobs, workers, progress)
