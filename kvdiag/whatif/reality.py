"""What-if against reality: each prediction checked by re-running the real engine under the remedy.

``kvdiag whatif`` predicts a remedy from an incident's metrics by replaying a fitted workload
through the reference engines. Here the incident is a real one: a real vLLM or SGLang server
(``kvdiag.real``) is loaded with a seeded open loop and scraped into a recording; ``whatif`` fits
that recording and predicts each remedy; then the real engine is started again under each
remedy (its own flags: ``real_change``) and loaded with the same arrivals (same seed, same
duration). Predicted and real runs are measured alike (``replay.measure`` over their windows:
verdict, usage, running, waiting, evictions), and the TTFTs compared are exact on both sides:
the simulated requests' against the clients' own measurements, over the requests whose first
token came between the window's first and last scrape.

A pair holds when the verdicts agree and the predicted P99 TTFT is within ``compare.TOLERANCE``
of the real one; the table says every error. The real engines run the tiny model on a shared
CPU, so a real run's speed is the machine's: the load average is recorded beside every run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.real import envs
from kvdiag.real.engines import Engine, EngineSpec
from kvdiag.real.load import Driver, OpenLoop, Phase, Requests
from kvdiag.real.stories import Scraper
from kvdiag.report.json import dumps
from kvdiag.report.terminal import Fitted
from kvdiag.sources.recording import write_recording
from kvdiag.whatif.compare import TOLERANCE, Errors, errors
from kvdiag.whatif.fit import Fit, fit
from kvdiag.whatif.levers import Lever
from kvdiag.whatif.replay import Job, Outcome, Run, measure, replay_all, with_ttfts
from kvdiag.window import Window

INTERVAL_S = 5.0  # scrape interval of every real run
#: Tokens FP8 KV stores in the bytes bf16 stores one in: the real re-run keeps the pool's bytes
#: and doubles its tokens (the tiny model's pool is set in tokens, not by memory).
FP8_FACTOR = 2
#: The engines' own FP8 KV flag values on their CPU builds.
FP8_FLAG = {"vllm": ("--kv-cache-dtype", "fp8"), "sglang": ("--kv-cache-dtype", "fp8_e4m3")}


@dataclass(frozen=True)
class RealStory:
    """An incident on a real engine: its pool and cap, the load (an open loop with a seed) and
    the remedies to check."""

    name: str
    engine: str
    pool_tokens: int
    max_running: int
    load: OpenLoop
    shape: Requests
    remedies: tuple[Lever, ...]
    seed: int = 0

    def spec(self) -> EngineSpec:
        return EngineSpec(self.engine, pool_tokens=self.pool_tokens, max_running=self.max_running)


def _story(engine: str, seconds: float, remedies: tuple[Lever, ...]) -> RealStory:
    """L1 saturation on the tiny model: a 2,048-token pool holds two or three requests of
    300-500 prompt (70 % a shared prefix) and 200-600 output tokens, under 0.7 req/s (about
    twice what three running requests generate on two loaded cores)."""
    return RealStory("l1-saturation", engine, 2048, 16, OpenLoop((Phase(seconds, 0.7),)),
                     Requests(prompt=(300, 500), prefix=0.7, output=(200, 600), min_tokens=True), remedies)  # fmt: skip


_COMMON = (Lever("pool", "8192", "four times the L1"), Lever("max-running", "2", "an admission limit"),
           Lever("dp", "2", "a second replica, the load split"), Lever("kv-dtype", "fp8", "FP8 KV: twice the tokens"))  # fmt: skip
#: The full comparison (docs/whatif-real.md), and the short one CI runs: a pair per engine.
STORIES = {
    "vllm": _story("vllm", 150.0, _COMMON),
    "sglang": _story("sglang", 150.0, _COMMON + (Lever("conservativeness", "0.3", "admission reserves less of the running output"),)),
}
CI_STORIES = {e: replace(s, load=OpenLoop((Phase(90.0, 0.7),)), remedies=s.remedies[:1]) for e, s in STORIES.items()}


def real_change(spec: EngineSpec, lever: Lever) -> tuple[EngineSpec, int]:
    """The engine spec a remedy runs the real engine with, and how many replicas (ValueError
    for a lever with no real counterpart on this machine)."""
    name, value = lever.name, lever.value
    if name == "pool":
        return replace(spec, pool_tokens=int(value)), 1
    if name == "max-running":
        return replace(spec, max_running=int(value)), 1
    if name == "dp":
        return spec, int(value)
    if name == "kv-dtype" and value == "fp8":
        return replace(spec, pool_tokens=spec.pool_tokens * FP8_FACTOR, args=spec.args + FP8_FLAG[spec.engine]), 1
    if name == "conservativeness" and spec.engine == "sglang":
        return replace(spec, args=spec.args + ("--schedule-conservativeness", value)), 1
    raise ValueError(f"{lever.label} has no real re-run on {spec.engine} here")


# ------------------------------------------------------------------ one real run
@dataclass
class RealRun:
    """What a real run left: every scrape of every replica, the clients' TTFTs over the window,
    the load average of the machine, and why it failed (empty when it did not)."""

    scrapes: list[Scrape] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    wall_s: float = 0.0
    error: str = ""

    def windows(self, engine: str) -> list[Window]:
        by_instance: dict[str, list[PoolSample]] = {}
        for scrape in self.scrapes:
            for s in normalize_scrape(scrape, engine):
                by_instance.setdefault(s.instance, []).append(s)
        return [Window(i, by_instance[i]) for i in sorted(by_instance)]

    def outcome(self, engine: str, config: Config) -> Outcome:
        return with_ttfts(measure(self.windows(engine), config), self.ttfts)


def run_real(story: RealStory, spec: EngineSpec, replicas: int, workdir: Path, interval: float = INTERVAL_S) -> RealRun:
    """Start ``replicas`` servers of ``spec`` (one at a time: the machine has two cores), drive
    the story's load split over them, scrape every ``interval`` s, stop everything."""
    run = RealRun()
    t0 = time.monotonic()
    engines = [Engine(spec, workdir / f"replica{i}") for i in range(replicas)]
    try:
        for e in engines:
            e.start()
        driver = Driver([e.url for e in engines], story.shape, seed=story.seed)
        scrapers = [Scraper(e.url, interval).start() for e in engines]
        try:
            driver.run(story.load)
        finally:
            for sc in scrapers:
                run.scrapes += sc.stop()
            driver.stop()
        run.scrapes.sort(key=lambda s: s.ts)
        write_recording(workdir / "recording.jsonl.gz", run.scrapes)  # what whatif reads, kept for `kvdiag whatif --replay`
        if len(run.scrapes) >= 2:
            lo, hi = run.scrapes[0].ts, run.scrapes[-1].ts
            run.ttfts = [r.ttft for r in driver.records if r.first_token is not None and r.ttft is not None and lo <= r.first_token <= hi]
        run.load_average = os.getloadavg()
    except Exception as exc:  # noqa: BLE001 (a remedy the engine refuses is its row, never the others')
        run.error = f"{type(exc).__name__}: {_why(str(exc))}"[:300]
    finally:
        for e in engines:
            e.stop()
    run.wall_s = time.monotonic() - t0
    return run


def _why(message: str) -> str:
    """The line of an engine's failure that says why: its last exception line (a start that
    failed carries the server log's tail, whose last line is the launcher killing its children)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
    return (errors or lines or [""])[-1]


# ------------------------------------------------------------------ the comparison
@dataclass(frozen=True)
class RealPair:
    """One remedy of a story: whatif's prediction from the incident's recording against the
    real engine re-run under it."""

    story: str
    engine: str
    remedy: str
    predicted: Outcome | None
    real: Outcome | None
    load_average: tuple[float, float, float]
    error: str = ""

    @property
    def errors(self) -> Errors | None:
        return None if self.predicted is None or self.real is None else errors(self.real, self.predicted, exact=True)

    @property
    def ok(self) -> bool:
        """The issue's goal: the same verdict, and the P99 TTFT within ``TOLERANCE``."""
        e = self.errors
        return e is not None and e.same_verdict and e.p99_ttft is not None and abs(e.p99_ttft) <= TOLERANCE

    def as_json(self) -> dict[str, object]:
        e = self.errors
        return {"story": self.story, "engine": self.engine, "remedy": self.remedy,
                "predicted": None if self.predicted is None else self.predicted.as_json(),
                "real": None if self.real is None else self.real.as_json(),
                "errors": None if e is None else e.as_json(), "ok": self.ok,
                "load_average": [round(x, 2) for x in self.load_average], "error": self.error or None}  # fmt: skip


@dataclass
class RealComparison:
    """A story's incident, its fit, and one pair per run (the incident itself as ``calibration``)."""

    story: RealStory
    fit: Fit | None
    pairs: list[RealPair]

    def as_json(self) -> dict[str, object]:
        return {"story": self.story.name, "engine": self.story.engine, "seed": self.story.seed,
                "seconds": self.story.load.seconds, "fit": None if self.fit is None else self.fit.as_json(),
                "pairs": [p.as_json() for p in self.pairs]}  # fmt: skip


def predict(story: RealStory, window: Window, config: Config) -> tuple[Fit, list[Run]]:
    """whatif on the incident's window: the fit, then the calibration and each remedy replayed."""
    f = fit(window)
    scenario = f.scenario(story.seed)
    jobs = [Job(story.name, None, scenario, story.engine, f.interval, config)]
    jobs += [Job(story.name, lv, lv.apply(scenario), story.engine, f.interval, config) for lv in story.remedies]
    return f, replay_all(jobs, workers=len(os.sched_getaffinity(0)))


def compare_story(story: RealStory, workdir: Path, config: Config, progress: Callable[[str], None] | None = None) -> RealComparison:
    """Record the incident, predict every remedy from it, re-run each on the real engine."""
    say = progress or (lambda _: None)
    say(f"{story.engine}: recording the incident ({story.load.seconds:.0f}s of load)")
    base = run_real(story, story.spec(), 1, workdir / "incident")
    if base.error:
        return RealComparison(story, None, [RealPair(story.name, story.engine, "calibration", None, None, base.load_average, base.error)])
    say(f"{story.engine}: whatif on the recording ({1 + len(story.remedies)} replays)")
    f, predicted = predict(story, base.windows(story.engine)[0], config)
    pairs = [RealPair(story.name, story.engine, "calibration", predicted[0].outcome, base.outcome(story.engine, config),
                      base.load_average, predicted[0].error)]  # fmt: skip
    for lever, pred in zip(story.remedies, predicted[1:]):
        try:
            spec, replicas = real_change(story.spec(), lever)
        except ValueError as exc:
            pairs.append(RealPair(story.name, story.engine, lever.label, pred.outcome, None, (0.0, 0.0, 0.0), str(exc)))
            continue
        say(f"{story.engine}: re-running the real engine with {lever.label}")
        real = run_real(story, spec, replicas, workdir / lever.label.replace("=", "-"))
        pairs.append(RealPair(story.name, story.engine, lever.label, pred.outcome,
                              None if real.error else real.outcome(story.engine, config), real.load_average,
                              real.error or pred.error))  # fmt: skip
    return RealComparison(story, f, pairs)


# ------------------------------------------------------------------ rendering
def _cell(o: Outcome | None) -> str:
    if o is None:
        return "—"

    def s(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f}s"

    ev = "—" if o.evictions_per_min is None else f"{o.evictions_per_min:.1f}"
    running = "—" if o.running is None else f"{o.running:.1f}"
    return f"{o.verdict}\nP99 {s(o.p99_ttft_sim)} median {s(o.median_ttft_sim)}\nrunning {running}, evictions/min {ev}"


def render(console: Console, results: list[RealComparison]) -> None:
    table = Table(title="kvdiag validate --real --whatif: whatif's prediction from the real incident against the real engine re-run")
    for col in ("engine: remedy", "predicted", "real", "", "errors (predicted vs real)", "load avg"):
        table.add_column(col, overflow="fold", no_wrap=col in ("", "load avg"))
    pairs = [p for r in results for p in r.pairs]
    for p in pairs:
        e = p.errors
        mark = "[green]ok[/green]" if p.ok else "[red]OFF[/red]"
        table.add_row(f"{p.engine}: {p.remedy}", _cell(p.predicted), _cell(p.real), mark,
                      p.error if e is None else e.describe(), " ".join(f"{x:.1f}" for x in p.load_average))  # fmt: skip
    console.print(Fitted(table, drop=("load avg",)))
    for r in results:
        if r.fit is not None and r.fit.step is not None:
            console.print(f"{r.story.engine} step time: {r.fit.step.describe()}", highlight=False)
    console.print(summary(pairs), highlight=False)


def summary(pairs: list[RealPair]) -> str:
    """How many pairs hold, and the median P99 TTFT error over the remedies."""
    remedies = [p for p in pairs if p.remedy != "calibration"]
    errs = [abs(p.errors.p99_ttft) for p in remedies if p.errors is not None and p.errors.p99_ttft is not None]
    median = f"{float(np.median(errs)):.0%}" if errs else "n/a"
    return (f"real what-if pairs: {sum(p.ok for p in remedies)}/{len(remedies)} within the goal (the same verdict, P99 TTFT "
            f"within {TOLERANCE:.0%}); median |P99 TTFT error| over the remedies {median}; calibration "
            + ", ".join(f"{p.engine} {'ok' if p.ok else 'OFF'}" for p in pairs if p.remedy == "calibration"))  # fmt: skip


def progress_line(text: str) -> None:
    print(f"validate --real --whatif: {text}", file=sys.stderr, flush=True)


def validate_real_whatif(args: argparse.Namespace, config: Config) -> int:
    """``kvdiag validate --real --whatif [--engine E] [--json]``: every engine's story; exit 0
    when every pair holds, 1 otherwise, 3 when an engine's environment is missing."""
    engines = args.engine or list(STORIES)
    for engine in engines:
        try:
            envs.python(engine)
        except envs.EnvMissing as exc:
            print(f"kvdiag validate --real --whatif: {exc}", file=sys.stderr)
            return 3
    with tempfile.TemporaryDirectory(prefix="kvdiag-whatif-real-") as tmp:
        results = [compare_story(STORIES[e], Path(tmp) / e, config, progress_line) for e in engines]
    pairs = [p for r in results for p in r.pairs]
    if args.json:
        print(dumps({"stories": [r.as_json() for r in results], "summary": summary(pairs)}, indent=2))
    else:
        render(Console(width=None if sys.stdout.isatty() else 200), results)
    return 0 if all(p.ok for p in pairs) else 1
