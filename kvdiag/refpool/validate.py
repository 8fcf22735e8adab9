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
  ``QUEUE_FLOOR`` (5) requests over the span (fewer is the jitter of arrivals), and its last third
  holds no fewer than its first, less ``QUEUE_FLOOR`` or 10 % (a closed loop's queue stands at
  clients minus running, a few requests up and down: it stands, it does not drain), or it never
  fell below ``QUEUE_FLOOR`` in the span (a queue of a hundred draining by a quarter in 30 s
  behind a real SGLang's KV refusals still holds requests back: the pool limits there).
* **recompute**: at least one running request was retracted / preempted in the span's last
  ``Config.evictions_recent_window`` seconds, or earlier in the span while L1 bound (admission
  blocked on KV at least half of the time) over those last seconds: the spans the eviction check
  fires on. An eviction proved the pool ran out then; with the pool no longer binding at the
  end it does not make the pool the limit there.
* **full**: the free room (available + evictable) holds less than 10 % more requests of the
  span's mean size (prompt + output) than are running, during at least half of the span's time
  (the rule's own line: "10 % more load would hit L1").

L1 binds: backlog and recompute -> ``l1_kv_bottleneck``; one of them -> ``l1_kv_pressure``;
neither -> ``near_kv_capacity``. Otherwise: backlog and recompute -> ``l1_kv_pressure`` (the pool
ran out often enough to evict); backlog -> ``queue_without_kv_pressure``; full ->
``near_kv_capacity``; else ``healthy``.

**The timeline.** The final verdict is one instant; an operator opens kvdiag in the first minutes
of an incident. So every scrape after the first minute (``SCORED_FROM_S``) is also an evaluation
instant, scored against the truth *at that instant*, read from the simulator's own step log over
the trailing ``TRUTH_SPAN_S`` seconds by the same rule as above. The **pool
limits** at an instant when the truth label there is an L1 one (L1 binds, or requests were
recomputed while a backlog waits; a recompute with nobody waiting is transient: healthy, with the
``transient_evictions`` finding). Instants in the ``GRACE_S`` seconds after a change of truth are
not scored (a check needs a few scrapes to see a change), nor those in the ``TRUTH_SPAN_S``
before one (the trailing truth lags the mechanism by up to its span).
At a scored instant the verdict is

* **right** when it is one the truth accepts: either L1 verdict for an L1 label (which of the two
  depends on whether an eviction fell in the checks' 5-minute window, not on what limits the
  engine now), ``queue_without_kv_pressure`` for a queue without KV pressure, and ``healthy`` or
  ``near_kv_capacity`` where nothing limits the engine (both say the pool is not the limit; they
  differ by a headroom threshold);
* **misleading** when the pool limits and the verdict is ``healthy`` or
  ``queue_without_kv_pressure`` (it points away from the pool);
* a **false alarm** when the pool does not limit and the verdict names L1.

The **onset** of an L1 verdict is the first 5 s bin in which admission was blocked on KV at least
half of the time and that stays blocked on average until the end. The **SLO breach** is the first
scrape time at which the true P99 TTFT of the requests whose first token came in the preceding
60 s (at least 10 of them) exceeds ``Config.ttft_slo``. The **detection** is the first scrape
whose window the checklist judged ``l1_kv_bottleneck`` or ``l1_kv_pressure``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from kvdiag.checks import diagnose
from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample
from kvdiag.refpool.scenarios import ENGINES, SCENARIOS, Scenario, ScenarioRun
from kvdiag.refpool.sim import EPOCH, Simulation
from kvdiag.refpool.workers import in_workers
from kvdiag.window import Window

L1_VERDICTS = ("l1_kv_bottleneck", "l1_kv_pressure")
LABELS = ("l1_kv_bottleneck", "l1_kv_pressure", "near_kv_capacity", "queue_without_kv_pressure", "healthy", "unknown")
BIN_S = 5.0  # onset resolution
P99_SPAN_S = 60.0  # the ground-truth P99's sliding span
P99_MIN_REQUESTS = 10
HEADROOM = 0.10  # "full": less than 10 % more requests would fit
SCORED_FROM_S = 60.0  # instants before this are not scored (the checks' windows are filling)
TRUTH_SPAN_S = 30.0  # the trailing span the truth at an instant is read over
GRACE_S = 30.0  # after a change of truth, instants are not scored for this long
QUEUE_FLOOR = 5.0  # a true queue averaging fewer requests is jitter, not a backlog
#: Verdicts each truth label accepts at an instant (module docstring).
ACCEPTS = {
    "l1_kv_bottleneck": frozenset(L1_VERDICTS),
    "l1_kv_pressure": frozenset(L1_VERDICTS),
    "near_kv_capacity": frozenset({"near_kv_capacity", "healthy"}),
    "queue_without_kv_pressure": frozenset({"queue_without_kv_pressure"}),
    "healthy": frozenset({"healthy", "near_kv_capacity"}),
}
MISLEADING = frozenset({"healthy", "queue_without_kv_pressure"})


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
class Instant:
    """One evaluation instant: the truth then, and the verdict of the window ending then."""

    t: float  # simulated seconds
    truth: str
    pool_limits: bool  # the truth label is an L1 one
    verdict: str
    scored: bool  # after the first minute and outside the grace after a change of truth

    @property
    def right(self) -> bool:
        return self.verdict in ACCEPTS[self.truth]

    @property
    def misleading(self) -> bool:
        return self.scored and self.pool_limits and self.verdict in MISLEADING

    @property
    def false_alarm(self) -> bool:
        return self.scored and not self.pool_limits and self.verdict in L1_VERDICTS


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
    instants: tuple[Instant, ...] = ()

    @property
    def correct(self) -> bool:
        return self.verdict == self.expected

    @property
    def scored(self) -> list[Instant]:
        return [i for i in self.instants if i.scored]

    @property
    def right(self) -> int:
        return sum(i.right for i in self.scored)

    @property
    def misleading(self) -> int:
        return sum(i.misleading for i in self.instants)

    @property
    def false_alarms(self) -> int:
        return sum(i.false_alarm for i in self.instants)

    @property
    def clean(self) -> bool:
        """Right at the end and at every scored instant."""
        return self.correct and self.right == len(self.scored)

    @property
    def named_before_breach(self) -> bool | None:
        """L1 named no later than the SLO breach (None where the truth has no L1 onset)."""
        if self.truth.onset is None:
            return None
        return self.detected is not None and (self.truth.slo_breach is None or self.detected <= self.truth.slo_breach)

    def since_onset(self, t: float | None) -> float | None:
        return None if t is None or self.truth.onset is None else round(t - self.truth.onset, 1)

    @property
    def l1_from(self) -> float | None:
        """The first instant from which the truth names L1 at no fewer than half of the
        instants (the onset's rule, read off the instants' labels rather than KV refusals
        alone). A real engine at the edge of its capacity refuses a waiting request for KV now
        and then with one or two waiting: the truth there is ``near_kv_capacity``, and a verdict
        that does not name L1 is right; the pool limits from where a backlog or a recompute
        joins the refusals."""
        k = _first_sustained(np.array([float(i.pool_limits) for i in self.instants]))
        return None if k is None else self.instants[k].t

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "engine": self.engine,
            "expected": self.expected,
            "verdict": self.verdict,
            "correct": self.correct,
            "detection_delay_s": self.since_onset(self.detected),
            "slo_breach_s": self.since_onset(self.truth.slo_breach),
            "onset_s": self.truth.onset,
            "truth_l1_from_s": self.l1_from,
            "first_l1_s": self.detected,
            "slo_breach_at_s": self.truth.slo_breach,
            "named_before_breach": self.named_before_breach,
            "instants": {
                "scored": len(self.scored),
                "right": self.right,
                "misleading": self.misleading,
                "false_alarms": self.false_alarms,
                "wrong": [{"t": i.t, "truth": i.truth, "verdict": i.verdict} for i in self.scored if not i.right],
            },
        }


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)

    @property
    def correct(self) -> int:
        return sum(r.correct for r in self.results)

    @property
    def misleading(self) -> int:
        return sum(r.misleading for r in self.results)

    @property
    def false_alarms(self) -> int:
        return sum(r.false_alarms for r in self.results)

    @property
    def ok(self) -> bool:
        """What the exit code says: every final verdict and every scored instant right, so no
        misleading and no false-alarm instant."""
        return all(r.clean for r in self.results)

    def as_json(self) -> dict[str, object]:
        scored = sum(len(r.scored) for r in self.results)
        return {
            "scenarios": [r.as_json() for r in self.results],
            "correct": self.correct,
            "total": len(self.results),
            "instants": {
                "scored": scored,
                "right": sum(r.right for r in self.results),
                "misleading": self.misleading,
                "false_alarms": self.false_alarms,
            },
            "scoring": {"scored_from_s": SCORED_FROM_S, "truth_span_s": TRUTH_SPAN_S, "grace_s": GRACE_S},
            "ok": self.ok,
        }

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


@dataclass(frozen=True)
class SpanTruth:
    """What the simulator's step log says about one span of time."""

    label: str
    pool_limits: bool  # an L1 label: L1 binds, or requests were recomputed while a backlog waits
    kv_blocked_share: float
    evictions: int
    backlog: bool
    full_share: float


class TruthReader:
    """The simulator's step log and finished requests as arrays, read span by span."""

    def __init__(self, sim: Simulation) -> None:
        done = sorted((r.finished, r.prompt_tokens + r.output_tokens) for r in sim.records if r.finished is not None)
        state = sim.state()
        # The pool that binds: a hybrid model's SWA pool is the smaller one (deployments.py).
        self._set(sim.steps.arrays(), done, min(c for c in (state.capacity_tokens, state.swa_capacity_tokens) if c))

    @classmethod
    def of(cls, steps: dict[str, np.ndarray], done: list[tuple[float, int]], capacity: int) -> "TruthReader":
        """A reader of any engine's step log (the columns ``span`` reads: start, duration,
        blocked_on_kv, evicted, waiting, running, usage), its finished requests as sorted
        (finish time, prompt + output tokens) and its pool's size in tokens: a real engine's
        (kvdiag.real.truth) as the simulator's."""
        reader = cls.__new__(cls)
        reader._set(steps, done, capacity)
        return reader

    def _set(self, steps: dict[str, np.ndarray], done: list[tuple[float, int]], capacity: int) -> None:
        self.steps = steps
        self.finished = np.array([f for f, _ in done], dtype=float)
        self.sizes = np.array([n for _, n in done], dtype=float)
        self.capacity = capacity

    def span(self, start: float, end: float, recompute_from: float | None = None) -> SpanTruth:
        """The truth over the steps that started in ``[start, end)`` (module docstring); where
        ``recompute_from`` is given, an eviction before it is a recompute only if L1 bound from
        it on (``evictions`` counts the whole span)."""
        st = self.steps
        lo, hi = np.searchsorted(st["start"], [start, end], side="left")
        dur = st["duration"][lo:hi]
        kv_blocked = _weighted_share(st["blocked_on_kv"][lo:hi], dur)
        evictions = int(st["evicted"][lo:hi].sum())
        rlo = lo if recompute_from is None else max(lo, int(np.searchsorted(st["start"], recompute_from, side="left")))
        recompute = int(st["evicted"][rlo:hi].sum()) > 0 or (evictions > 0 and _weighted_share(st["blocked_on_kv"][rlo:hi], st["duration"][rlo:hi]) >= 0.5)
        waiting = st["waiting"][lo:hi].astype(float)
        third = max(1, len(waiting) // 3)
        first, last = (float(waiting[:third].mean()), float(waiting[-third:].mean())) if len(waiting) else (0.0, 0.0)
        standing = bool(len(waiting)) and float(waiting.min()) >= QUEUE_FLOOR
        backlog = bool(len(waiting)) and waiting.mean() >= QUEUE_FLOOR and (last >= first - max(QUEUE_FLOOR, 0.1 * first) or standing)
        a, b = np.searchsorted(self.finished, [start, end], side="left")
        mean_size = float(self.sizes[a:b].mean()) if b > a else 0.0
        free_requests = (1.0 - st["usage"][lo:hi]) * self.capacity / max(mean_size, 1.0)
        full = free_requests < HEADROOM * np.maximum(st["running"][lo:hi], 1)
        full_share = _weighted_share(full, dur)
        label = _label(kv_blocked >= 0.5, backlog, recompute, full_share >= 0.5)
        return SpanTruth(label, label in L1_VERDICTS, kv_blocked, evictions, backlog, full_share)


def truth(sim: Simulation, end: float, config: Config) -> Truth:
    """The label the simulator's own records imply for the span ending at ``end`` (module doc)."""
    return read_truth(TruthReader(sim), end, config, _slo_breach(sim, end, config.ttft_slo))


def read_truth(reader: TruthReader, end: float, config: Config, slo_breach: float | None) -> Truth:
    """``truth`` from any engine's step log (``TruthReader.of``) and its SLO breach."""
    span = reader.span(end - config.window, end, recompute_from=end - config.evictions_recent_window)
    onset = _onset(reader.steps, end) if span.label in L1_VERDICTS else None
    return Truth(span.label, span.kv_blocked_share, span.evictions, span.backlog, span.full_share, onset, slo_breach)


def score(reader: TruthReader, timeline: list[tuple[float, str]]) -> tuple[Instant, ...]:
    """Each (t, verdict) against the truth over the ``TRUTH_SPAN_S`` before ``t``. Instants in
    the first minute, within ``GRACE_S`` after a change of truth (to a label that accepts other
    verdicts: bottleneck <-> pressure is no change), or within ``TRUTH_SPAN_S`` before one (the trailing truth lags the mechanism by up to its span: a verdict that already
    names the coming truth is early, not wrong) are kept but not scored."""
    spans = [reader.span(t - TRUTH_SPAN_S, t) for t, _ in timeline]
    changes = [t for (t, _), a, b in zip(timeline[1:], spans, spans[1:]) if ACCEPTS[a.label] != ACCEPTS[b.label]]
    out = []
    for (t, verdict), span in zip(timeline, spans):
        near = any(-TRUTH_SPAN_S <= t - c < GRACE_S for c in changes)
        out.append(Instant(t, span.label, span.pool_limits, verdict, t >= SCORED_FROM_S and not near))
    return tuple(out)


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
    i = _first_sustained(share)
    return None if i is None else float(edges[i])


def _first_sustained(share: np.ndarray) -> int | None:
    """The first index at least half whose mean from there on is at least half too: where a
    condition begins and then holds most of the time (a lone early spike does not count)."""
    for i in range(len(share)):
        if share[i] >= 0.5 and share[i:].mean() >= 0.5:
            return i
    return None


def _slo_breach(sim: Simulation, end: float, slo: float) -> float | None:
    return slo_breach(sorted((r.first_token, r.ttft) for r in sim.records if r.first_token is not None), end, slo)


def slo_breach(firsts: list[tuple[float, float]], end: float, slo: float) -> float | None:
    """The first ``BIN_S`` step at which the P99 TTFT of the requests whose first token came in
    the ``P99_SPAN_S`` before it exceeds ``slo``; ``firsts``: sorted (first-token time, TTFT)."""
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
    return score_run(ScenarioRun(scenario, engine), config, interval)


def score_run(run: ScenarioRun, config: Config, interval: float = 5.0) -> list[Result]:
    """``run_one`` on a fresh ``run``, which is left at the scenario's end for the caller to
    inspect (what it serves, what its simulations know)."""
    t0 = time.perf_counter()
    scenario, engine = run.scenario, run.engine
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
        sim = run.sims[i]
        name = scenario.name if scenario.dp == 1 else f"{scenario.name}/dp{i}"
        results.append(judge(name, engine, TruthReader(sim), truth(sim, scenario.duration, config), timeline, wall))
    return results


def judge(name: str, engine: str, reader: TruthReader, tr: Truth, timeline: list[tuple[float, str]], wall: float) -> Result:
    """The Result of one instance: its verdict ``timeline`` (t from the run's start) scored
    against the truth the reader holds, ``tr`` being the truth over the final window."""
    return Result(name, engine, tr.label, timeline[-1][1], tr, _first(timeline, L1_VERDICTS), _first(timeline, [tr.label]),
                  wall, score(reader, timeline))


def _job(args: tuple[Scenario, str, Config, float]) -> tuple[str, str, list[Result]]:
    """``run_one`` in a worker, named by its scenario and engine for the progress callback."""
    return args[0].name, args[1], run_one(*args)


def validate(
    scenarios: Iterable[Scenario] | None = None,
    engines: Iterable[str] = ENGINES,
    config: Config | None = None,
    interval: float = 5.0,
    jobs: int = 1,
    progress: Callable[[str, str, list[Result]], None] | None = None,
) -> Report:
    """Every scenario (default: the whole catalogue) on every engine, ``jobs`` at a time in
    worker processes (each run is independent); ``progress(scenario, engine, results)`` is
    called as each finishes. Results keep the catalogue's order whatever finishes first."""
    config = config or Config()
    work = [(sc, engine, config, interval) for sc in (scenarios or SCENARIOS.values()) for engine in engines if engine in sc.engines]

    def tick(named: tuple[str, str, list[Result]]) -> None:
        if progress is not None:
            progress(*named)

    done = in_workers(_job, work, jobs, tick)
    return Report([r for _, _, results in done for r in results])
