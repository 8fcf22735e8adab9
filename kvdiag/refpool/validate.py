"""Score the checklist against ground truth: every scenario, both engines, sliding windows.

Each scenario runs on a reference engine; the server's exposition is scraped every
``interval`` simulated seconds and read back through kvdiag's own adapters, exactly as a real
engine's would be. The real checklist then judges each instance over sliding windows (one per
scrape, ``Config.window`` long, as the exporter would), which gives both the final verdict and
*when* the verdict first named L1.

What the expected verdict is comes from the simulator alone (``truth``), by this rule, over the
span the final verdict is judged on (the last ``Config.window`` seconds of the run):

* **L1 binds**: admission refused a waiting request for lack of KV (``StepPlan.blocked_on_kv``)
  during at least half of the span's time.
* **backlog**: requests wait and the wait does not drain: the true waiting count averages at least
  one request over the span's last third, and no less than over its first third.
* **recompute**: at least one running request was retracted / preempted in the span.
* **full**: the free room (available + evictable) holds less than 10 % more requests of the
  span's mean size (prompt + output) than are running, during at least half of the span's time
  (the rule's own line: "10 % more load would hit L1").

L1 binds: backlog and recompute -> ``l1_kv_bottleneck``; one of them -> ``l1_kv_pressure``;
neither -> ``near_kv_capacity``. Otherwise: backlog and recompute -> ``l1_kv_pressure`` (the pool
ran out often enough to evict); backlog -> ``queue_without_kv_pressure``; full ->
``near_kv_capacity``; else ``healthy``.

The **onset** of an L1 verdict is the first 5 s bin in which admission was blocked on KV at least
half of the time and that stays blocked on average until the end. The **SLO breach** is the first
scrape time at which the true P99 TTFT of the requests whose first token came in the preceding
60 s (at least 10 of them) exceeds ``Config.ttft_slo``. The **detection** is the first scrape
whose window the checklist judged ``l1_kv_bottleneck`` or ``l1_kv_pressure``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample
from kvdiag.refpool.scenarios import ENGINES, SCENARIOS, Scenario, ScenarioRun
from kvdiag.refpool.sim import EPOCH, Simulation
from kvdiag.window import Window

L1_VERDICTS = ("l1_kv_bottleneck", "l1_kv_pressure")
LABELS = ("l1_kv_bottleneck", "l1_kv_pressure", "near_kv_capacity", "queue_without_kv_pressure", "healthy", "unknown")
BIN_S = 5.0  # onset resolution
P99_SPAN_S = 60.0  # the ground-truth P99's sliding span
P99_MIN_REQUESTS = 10
HEADROOM = 0.10  # "full": less than 10 % more requests would fit


@dataclass(frozen=True)
class Truth:
    """What the simulator knew about one engine instance, and the label it implies."""

    label: str
    kv_blocked_share: float  # of the final span's time
    evictions: int  # in the final span
    backlog: bool
    full_share: float  # of the final span's time
    onset: float | None  # simulated seconds; None unless the label is an L1 one
    slo_breach: float | None  # simulated seconds; None if P99 never crossed the SLO


@dataclass(frozen=True)
class Result:
    """One instance of one scenario on one engine: truth against the checklist."""

    name: str
    engine: str
    expected: str
    verdict: str
    truth: Truth
    detected: float | None  # first L1 verdict, simulated seconds
    exact: float | None  # first window judged exactly ``expected``
    wall_s: float

    @property
    def correct(self) -> bool:
        return self.verdict == self.expected

    def since_onset(self, t: float | None) -> float | None:
        return None if t is None or self.truth.onset is None else round(t - self.truth.onset, 1)

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "engine": self.engine,
            "expected": self.expected,
            "verdict": self.verdict,
            "correct": self.correct,
            "detection_delay_s": self.since_onset(self.detected),
            "slo_breach_s": self.since_onset(self.truth.slo_breach),
        }


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)

    @property
    def correct(self) -> int:
        return sum(r.correct for r in self.results)

    def as_json(self) -> dict[str, object]:
        return {"scenarios": [r.as_json() for r in self.results], "correct": self.correct, "total": len(self.results)}

    def confusion(self) -> dict[str, dict[str, int]]:
        """expected -> verdict -> count, over the labels that occur."""
        seen = [x for x in LABELS if any(x in (r.expected, r.verdict) for r in self.results)]
        matrix = {e: {v: 0 for v in seen} for e in seen}
        for r in self.results:
            matrix[r.expected][r.verdict] += 1
        return matrix


# ---------------------------------------------------------------- ground truth
def _weighted_share(flags: np.ndarray, weights: np.ndarray) -> float:
    total = float(weights.sum())
    return float((flags * weights).sum() / total) if total > 0 else 0.0


def truth(sim: Simulation, end: float, config: Config) -> Truth:
    """The label the simulator's own records imply for the span ending at ``end`` (module doc)."""
    steps = sim.steps.arrays()
    start = end - config.window
    span = (steps["start"] >= start) & (steps["start"] < end)
    dur = steps["duration"][span]
    kv_blocked = _weighted_share(steps["blocked_on_kv"][span], dur)
    evictions = int(steps["evicted"][span].sum())
    waiting = steps["waiting"][span].astype(float)
    third = max(1, len(waiting) // 3)
    backlog = bool(len(waiting)) and waiting[-third:].mean() >= max(1.0, waiting[:third].mean())
    done = [r for r in sim.records if r.finished is not None and start <= r.finished < end]
    mean_size = float(np.mean([r.prompt_tokens + r.output_tokens for r in done])) if done else 0.0
    capacity = sim.state().capacity_tokens
    free_requests = (1.0 - steps["usage"][span]) * capacity / max(mean_size, 1.0)
    full = free_requests < HEADROOM * np.maximum(steps["running"][span], 1)
    full_share = _weighted_share(full, dur)
    label = _label(kv_blocked >= 0.5, backlog, evictions > 0, full_share >= 0.5)
    onset = _onset(steps, end) if label in L1_VERDICTS else None
    return Truth(label, kv_blocked, evictions, backlog, full_share, onset, _slo_breach(sim, end, config.ttft_slo))


def _label(l1_binds: bool, backlog: bool, recompute: bool, full: bool) -> str:
    if l1_binds:
        if backlog and recompute:
            return "l1_kv_bottleneck"
        return "l1_kv_pressure" if backlog or recompute else "near_kv_capacity"
    if backlog:
        return "l1_kv_pressure" if recompute else "queue_without_kv_pressure"
    return "near_kv_capacity" if full else "healthy"


def _onset(steps: dict[str, np.ndarray], end: float) -> float | None:
    edges = np.arange(0.0, end + BIN_S, BIN_S)
    idx = np.digitize(steps["start"], edges) - 1
    nbins = len(edges) - 1
    blocked = np.bincount(idx, weights=steps["duration"] * steps["blocked_on_kv"], minlength=nbins)[:nbins]
    busy = np.bincount(idx, weights=steps["duration"], minlength=nbins)[:nbins]
    share = np.divide(blocked, busy, out=np.zeros(nbins), where=busy > 0)
    for i in range(nbins):
        if share[i] >= 0.5 and share[i:].mean() >= 0.5:
            return float(edges[i])
    return None


def _slo_breach(sim: Simulation, end: float, slo: float) -> float | None:
    firsts = sorted((r.first_token, r.ttft) for r in sim.records if r.first_token is not None)
    if not firsts:
        return None
    ts = np.array([f for f, _ in firsts])
    ttft = np.array([v for _, v in firsts])
    for t in np.arange(BIN_S, end + 1e-9, BIN_S):
        lo, hi = np.searchsorted(ts, t - P99_SPAN_S), np.searchsorted(ts, t)
        if hi - lo >= P99_MIN_REQUESTS and np.quantile(ttft[lo:hi], 0.99) > slo:
            return float(t)
    return None


# ---------------------------------------------------------------- the checklist over time
def verdicts_over_time(samples: list[PoolSample], config: Config) -> list[tuple[float, str]]:
    """(simulated t, verdict) for the window ending at each sample, as a live exporter sees it."""
    out = []
    for k in range(1, len(samples) + 1):
        d = diagnose(Window(samples[0].instance, samples[:k]), config)
        out.append((samples[k - 1].ts - EPOCH, d.verdict.name))
    return out


def _first(timeline: list[tuple[float, str]], names: Iterable[str]) -> float | None:
    wanted = set(names)
    return next((t for t, v in timeline if v in wanted), None)


def run_one(scenario: Scenario, engine: str, config: Config, interval: float = 5.0) -> list[Result]:
    """One scenario on one engine: a Result per DP instance, in DP rank order."""
    t0 = time.perf_counter()
    run = ScenarioRun(scenario, engine)
    by_instance: dict[str, list[PoolSample]] = {}
    for _, scrape in run.scrapes(interval):
        for s in normalize_scrape(scrape, engine):
            by_instance.setdefault(s.instance, []).append(s)
    if len(by_instance) != scenario.dp:
        raise AssertionError(f"{scenario.name}/{engine}: {len(by_instance)} instances read back, {scenario.dp} simulated")
    wall = time.perf_counter() - t0
    results = []
    for i, instance in enumerate(sorted(by_instance)):
        timeline = verdicts_over_time(by_instance[instance], config)
        tr = truth(run.sims[i], scenario.duration, config)
        name = scenario.name if scenario.dp == 1 else f"{scenario.name}/dp{i}"
        results.append(
            Result(name, engine, tr.label, timeline[-1][1], tr, _first(timeline, L1_VERDICTS), _first(timeline, [tr.label]), wall)
        )
    return results


def validate(
    scenarios: Iterable[Scenario] | None = None,
    engines: Iterable[str] = ENGINES,
    config: Config | None = None,
    interval: float = 5.0,
) -> Report:
    """Every scenario (default: the whole catalogue) on every engine."""
    config = config or Config()
    report = Report()
    for scenario in scenarios or SCENARIOS.values():
        for engine in engines:
            report.results.extend(run_one(scenario, engine, config, interval))
    return report
