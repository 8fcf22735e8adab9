"""What-if pairs for ``kvdiag validate``: is a prediction what the remedy really does?

A pair is a scenario, an engine and a remedy. The scenario runs on the reference engine and its
emitted metrics are read back as an incident's would be; ``whatif`` fits a workload to that
window and predicts the remedy (the prediction); the scenario itself then runs with the remedy
applied (the truth: the mechanism's own answer, the fit's guesses out of it). Both are measured
through the same exposition, adapters and checklist (``replay.measure``), and compared by
``compare.errors``: a pair holds when the verdicts agree and the P99 TTFT is within
``compare.TOLERANCE``. Both sides are simulations, so the P99 compared is each side's exact
one over its simulated requests (a histogram's P99 moves by half a 10-20 s bucket when a
percent of the requests cross its edge). The pairs are few and short (two saturated stories and a healthy one, SGLang and vLLM
each, 120-180 simulated seconds), so validate's CI test stays in seconds.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from rich.console import Console
from rich.table import Table

from kvdiag.config import Config
from kvdiag.refpool.scenarios import Scenario, get
from kvdiag.refpool.workers import in_workers
from kvdiag.report.terminal import Fitted
from kvdiag.whatif.compare import FLOORS, TOLERANCE, Errors, errors
from kvdiag.whatif.fit import fit
from kvdiag.whatif.levers import Lever
from kvdiag.whatif.replay import Outcome, emitted, measure, replay


@dataclass(frozen=True)
class Pair:
    """A scenario (cut to ``duration`` simulated seconds), an engine and a remedy."""

    scenario: str
    engine: str
    lever: Lever
    duration: float

    @property
    def name(self) -> str:
        return f"{self.scenario} on {self.engine}: {self.lever.label}"

    def story(self, mem_fraction: float | None = None) -> Scenario:
        """The scenario cut to the pair's duration, its pool re-sized as ``validate --mem-fraction``
        re-sizes every scenario's (``scenarios.get``)."""
        return replace(get(self.scenario, mem_fraction), duration=self.duration)


PAIRS: tuple[Pair, ...] = (
    Pair("l1-saturation", "sglang", Lever("mem-fraction", "0.95"), 180.0),
    Pair("ramp-fast", "vllm", Lever("kv-dtype", "fp8"), 120.0),
    Pair("noisy-healthy", "vllm", Lever("kv-dtype", "fp8"), 150.0),
    Pair("noisy-healthy", "sglang", Lever("dp", "2"), 150.0),
)


def select(scenarios: Iterable[str] | None = None, engines: Iterable[str] | None = None) -> list[Pair]:
    """The pairs of these scenarios on these engines (None: all)."""
    names, kinds = set(scenarios or ()), set(engines or ())
    return [p for p in PAIRS if (not names or p.scenario in names) and (not kinds or p.engine in kinds)]


@dataclass(frozen=True)
class PairResult:
    """One pair: what the scenario's metrics showed, the prediction against the truth, and their errors."""

    pair: Pair
    observed: Outcome
    predicted: Outcome
    truth: Outcome
    wall_s: float

    @property
    def errors(self) -> Errors:
        return errors(self.truth, self.predicted, exact=True)

    @property
    def ok(self) -> bool:
        return self.errors.good

    def as_json(self) -> dict[str, object]:
        return {
            "scenario": self.pair.scenario, "engine": self.pair.engine, "remedy": self.pair.lever.label,
            "duration_s": self.pair.duration, "observed": self.observed.as_json(),
            "predicted": self.predicted.as_json(), "truth": self.truth.as_json(), "errors": self.errors.as_json(),
            "ok": self.ok, "wall_s": round(self.wall_s, 1),
        }  # fmt: skip


def run_pair(pair: Pair, config: Config, interval: float = 5.0, mem_fraction: float | None = None) -> PairResult:
    """Fit from the scenario's emitted metrics, predict the remedy, run it for the truth."""
    t0 = time.perf_counter()
    scenario = pair.story(mem_fraction)
    window = emitted(scenario, pair.engine, interval)[0][0]
    fitted = fit(window).scenario()
    return PairResult(
        pair,
        observed=measure([window], config),
        predicted=replay(pair.lever.apply(fitted), pair.engine, interval, config),
        truth=replay(pair.lever.apply(scenario), pair.engine, interval, config),
        wall_s=time.perf_counter() - t0,
    )


def _job(args: tuple[Pair, Config, float, float | None]) -> PairResult:
    return run_pair(*args)


def validate_pairs(
    pairs: Iterable[Pair] = PAIRS,
    config: Config | None = None,
    interval: float = 5.0,
    jobs: int = 1,
    progress: Callable[[PairResult], None] | None = None,
    mem_fraction: float | None = None,
) -> list[PairResult]:
    """Every pair (its pool re-sized by ``mem_fraction`` where given), ``jobs`` at a time in
    worker processes; results in the order given."""
    config = config or Config()
    return in_workers(_job, [(p, config, interval, mem_fraction) for p in pairs], jobs, progress)


def render(console: Console, results: list[PairResult]) -> None:
    """The pairs' table: each prediction beside its truth, and every error."""
    table = Table(title="kvdiag validate: what-if pairs, the prediction from the fitted metrics against the scenario run with the remedy")
    for col in ("pair", "observed", "predicted", "truth", "", "errors (predicted vs truth)"):
        table.add_column(col, no_wrap=col in ("pair", ""), overflow="fold")

    def cell(o: Outcome, exact: bool = True) -> str:
        p99 = o.p99_ttft_sim if exact else o.p99_ttft
        return f"{o.verdict}\nP99 TTFT {'-' if p99 is None else f'{p99:.2f}s'}"

    for r in results:
        table.add_row(r.pair.name, cell(r.observed, exact=False), cell(r.predicted), cell(r.truth),
                      "[green]ok[/green]" if r.ok else "[red]OFF[/red]", r.errors.describe())  # fmt: skip
    console.print(Fitted(table, drop=("observed",)))
    held = sum(r.ok for r in results)
    console.print(
        f"what-if pairs: {held}/{len(results)} within the goal (the same verdict, P99 TTFT within {TOLERANCE:.0%}; "
        f"P99s under {FLOORS['p99_ttft']:g}s compared against {FLOORS['p99_ttft']:g}s). Predicted and truth P99s are "
        "the simulated requests' own; observed is the histogram's, as an engine's metrics show it"
    )


def progress_lines() -> Callable[[PairResult], None]:
    """One plain line per finished pair on stderr."""
    count = 0

    def tick(r: PairResult) -> None:
        nonlocal count
        count += 1
        print(f"validate whatif [{count}] {r.pair.name}: {'ok' if r.ok else 'OFF: ' + '; '.join(r.errors.problems)}",
              file=sys.stderr, flush=True)  # fmt: skip

    return tick
