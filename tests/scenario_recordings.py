"""The scenario catalogue recorded once per test session: every scenario on both reference
engines, scraped every 15 s, each scrape rendered in every dialect of that engine.

The simulations are the costly part (~30-40 s of CPU for the catalogue), and several tests
judge the same recordings (the rules/Python differential, the remedies), so the session
fixture ``scenario_recordings`` (tests/conftest.py) makes them once, two at a time.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvdiag.refpool import emit
from kvdiag.refpool.scenarios import ENGINES, SCENARIOS, ScenarioRun

INTERVAL = 15.0
DIALECTS = {"sglang": emit.SGLANG_DIALECTS, "vllm": emit.VLLM_DIALECTS}


@dataclass(frozen=True)
class Recording:
    name: str  # "<scenario> <engine> <dialect>"
    engine: str
    dialect: str
    bodies: tuple[str, ...]  # one exposition per scrape, INTERVAL apart, the first at INTERVAL


def dialects(name: str, engine: str) -> tuple[str, ...]:
    """The releases that can serve the scenario: vLLM V0 (before 0.8) has no engine label, so no
    data-parallel engines."""
    if engine == "vllm" and SCENARIOS[name].dp > 1:
        return tuple(d for d in DIALECTS[engine] if tuple(map(int, d.split("."))) >= (0, 8))
    return DIALECTS[engine]


def record(job: tuple[str, str]) -> list[Recording]:
    """One scenario on one engine, rendered in every dialect of that engine at every scrape."""
    name, engine = job
    run = ScenarioRun(SCENARIOS[name], engine)
    bodies: dict[str, list[str]] = {d: [] for d in dialects(name, engine)}
    k = 1
    while k * INTERVAL <= run.scenario.duration + 1e-9:
        run.advance(k * INTERVAL)
        for d in bodies:
            bodies[d].append(run.exposition(d))
        k += 1
    return [Recording(f"{name} {engine} {d}", engine, d, tuple(b)) for d, b in bodies.items()]


def record_all(workers: int = 2) -> list[Recording]:
    """Every (scenario, engine, dialect) recording, in catalogue order."""
    jobs = [(name, engine) for name in SCENARIOS for engine in ENGINES]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [rec for recs in pool.map(record, jobs) for rec in recs]


def newest(recordings: list[Recording]) -> list[Recording]:
    """Each scenario on each engine in that engine's newest dialect."""
    return [r for r in recordings if r.dialect == DIALECTS[r.engine][0]]
