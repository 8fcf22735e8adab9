"""Real stories: a load on a real engine, scraped as an exporter would, each verdict scored
against what the engine's own scheduler decided (kvdiag/real/truth.py), exactly as ``kvdiag
validate`` scores a simulated run (kvdiag.refpool.validate: the same truth rule over the same
spans, the same instants, grace and Result).

A story names its load and the pool and caps it needs; stories that need the same server share
one (``run_catalogue`` starts each distinct server once, in catalogue order). Times are seconds
from the story's start; the scrape interval is the exporter's (5 s).
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from kvdiag.config import Config
from kvdiag.engines import normalize_scrape
from kvdiag.model import PoolSample, Scrape
from kvdiag.real import truth as truth_log
from kvdiag.real.catalogue import STORIES, Story
from kvdiag.real.engines import Engine, EngineSpec
from kvdiag.real.load import Driver, Record
from kvdiag.refpool.sim import EPOCH
from kvdiag.refpool.validate import Report, Result, TruthReader, judge, read_truth, slo_breach, verdicts_over_time
from kvdiag.sources.recording import RecordingWriter
from kvdiag.sources.scrape import ScrapeError, next_due, scrape

INTERVAL_S = 5.0
IDLE_TIMEOUT_S = 300.0  # a hang guard for the engine to drain between stories


@dataclass
class StoryRun:
    """One story on one engine: what the clients saw, what the engine decided, and the score."""

    story: Story
    engine: str
    result: Result
    steps: truth_log.Steps
    records: list[Record]
    scrapes: list[Scrape] = field(repr=False)
    #: (seconds, arrivals per second) at each change of an open loop's rate, and when an
    #: ``Overload`` found admission limited (kvdiag/real/load.py): the load the engine was given
    rates: list[tuple[float, float]] = field(default_factory=list)
    limited_at: float | None = None
    seconds: float = 0.0  # how long the story ran (an Overload's length follows the engine)

    @property
    def first_kv_refusal(self) -> float | None:
        return self.steps.first_kv_refusal()

    def as_json(self) -> dict[str, object]:
        done = [r for r in self.records if r.ttft is not None]
        ttfts = sorted(r.ttft for r in done if r.ttft is not None)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
        return self.result.as_json() | {
            "story": self.story.about,
            "first_kv_refusal_s": None if self.first_kv_refusal is None else round(self.first_kv_refusal, 1),
            "clients": {"sent": len(self.records), "first_token": len(done), "p99_ttft_s": None if p99 is None else round(p99, 2),
                        "errors": sum(bool(r.error) and r.error != "stopped" for r in self.records)},
            "load": {"seconds": round(self.seconds, 1), "rates": [(round(t, 1), round(r, 3)) for t, r in self.rates],
                     "limited_at_s": None if self.limited_at is None else round(self.limited_at, 1)},
            "truth_per_second": self.steps.per_second(),
        }  # fmt: skip


class Scraper:
    """Scrapes ``url``/metrics every ``interval`` seconds from its start until stopped, skipping
    the slots a slow scrape or a starved process missed (``next_due``), as the exporter does."""

    def __init__(self, url: str, interval: float = INTERVAL_S, writer: RecordingWriter | None = None) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.interval = interval
        self.writer = writer
        self.scrapes: list[Scrape] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Scraper":
        self._thread.start()
        return self

    def _loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                s = scrape(self.url, timeout=self.interval)
                self.scrapes.append(s)
                if self.writer is not None:
                    self.writer.write(s)
            except ScrapeError as exc:
                self.failures.append(str(exc))
            due = next_due(due, time.monotonic(), self.interval)
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return

    def stop(self) -> list[Scrape]:
        self._stop.set()
        self._thread.join(timeout=60)
        return self.scrapes


def wait_idle(engine: Engine, timeout: float = IDLE_TIMEOUT_S) -> None:
    """Until the server runs and queues nothing (the last story's aborted requests are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = normalize_scrape(scrape(engine.url + "/metrics", timeout=10), engine.spec.engine)
        if all(not s.running and not s.waiting for s in samples):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{engine.spec.engine} still busy {timeout:.0f} s after the load stopped")
        time.sleep(1.0)


def run_story(story: Story, engine: Engine, config: Config | None = None, recording: Path | None = None, seed: int = 0) -> StoryRun:
    """``story`` on a running ``engine`` (idle at the start, left idle at the end)."""
    config = config or Config()
    name = engine.spec.engine
    wait_idle(engine)
    writer = RecordingWriter(recording) if recording is not None else None
    driver = Driver(engine.url, story.shape, seed)
    tail = truth_log.Tail(engine.truth_path)
    t0 = time.time()
    scraper = Scraper(engine.url, writer=writer).start()
    try:
        end = driver.run(story.load, tail.limited)
        time.sleep(max(0.0, t0 + end - time.time()))
    finally:
        scrapes = scraper.stop()
        driver.stop()
        if writer is not None:
            writer.close()
    wait_idle(engine)
    steps = truth_log.read(engine.truth_path, t0, t0 + end)
    if not scrapes:
        raise RuntimeError(f"{story.name} on {name}: no scrape of {engine.url}/metrics succeeded ({scraper.failures[:1]})")
    result = score(story, name, engine.spec.pool_tokens, scrapes, steps, driver.records, end, config)
    return StoryRun(story, name, result, steps, driver.records, scrapes, driver.rates, driver.limited_at, end)


def score(story: Story, engine: str, pool_tokens: int, scrapes: list[Scrape], steps: truth_log.Steps, records: list[Record],
          end: float, config: Config) -> Result:
    """The story's verdicts at each scrape (until ``end`` seconds from the steps' ``t0``) scored
    against the engine's steps and what its clients saw: a run told once can be scored again
    (a recording, the truth file and the records of the clients keep it all)."""
    t0 = steps.t0
    samples: list[PoolSample] = [s for sc in scrapes if sc.ts - t0 <= end + 1e-6 for s in normalize_scrape(sc, engine)]
    timeline = [(round(t + EPOCH - t0, 3), v) for t, v in verdicts_over_time(samples, config)]
    done = sorted((r.finished - t0, r.prompt_tokens + r.received) for r in records if r.finished is not None and not r.error)
    firsts = sorted((r.first_token - t0, r.ttft) for r in records if r.first_token is not None and r.ttft is not None)
    reader = TruthReader.of(steps.columns, done, pool_tokens)
    tr = read_truth(reader, end, config, slo_breach(firsts, end, config.ttft_slo))
    return judge(story.name, engine, reader, tr, timeline, time.time() - t0)


def run_catalogue(
    stories: Iterable[Story],
    engines: Iterable[str],
    config: Config | None = None,
    workdir: Path | None = None,
    progress: Callable[[StoryRun], None] | None = None,
) -> tuple[Report, list[StoryRun]]:
    """Each story on each of ``engines`` it exists for, one server per distinct pool/caps at a
    time (stories needing the same one share it), stopped before the next starts."""
    work = [(s, e) for e in engines for s in stories if e in s.engines]
    runs: list[StoryRun] = []
    with tempfile.TemporaryDirectory(prefix="kvdiag-real-") as tmp:
        root = workdir or Path(tmp)
        specs: list[EngineSpec] = list(dict.fromkeys(s.spec(e) for s, e in work))
        for i, spec in enumerate(specs):
            with Engine(spec, root / f"{spec.engine}-{i}") as engine:
                for story, e in work:
                    if story.spec(e) == spec:
                        run = run_story(story, engine, config)
                        runs.append(run)
                        if progress is not None:
                            progress(run)
    order = {(s.name, e): k for k, (s, e) in enumerate(work)}
    runs.sort(key=lambda r: order[(r.story.name, r.engine)])
    return Report([r.result for r in runs]), runs


def select(names: Iterable[str] | None, engines: Iterable[str] | None) -> tuple[list[Story], list[str]]:
    stories = [STORIES[n] for n in names] if names else list(STORIES.values())
    return stories, list(engines) if engines else ["vllm", "sglang"]

