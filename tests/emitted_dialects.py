"""The reference engines' expositions of the deployments of issue 17, saved as dialect fixtures.

Each deployment story of ``scenarios.DEPLOYMENTS`` ends in a state its /metrics bodies show: the
judged instance (a PD pair's decode instance, a hybrid model's server, vLLM with LMCache) and
the deployment's other targets (the prefill instance; LMCache's own exporter). Written by the
emitter, so names, labels and types are the engines' own (``refpool/emit.py``); saved under
``fixtures/deployments/`` for readers that want a real-shaped body without running the
simulator. ``python -m tests.emitted_dialects`` rewrites them; a test fails when a saved body's
series (names and label sets) differ from a fresh emission's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.refpool.scenarios import DEPLOYMENTS, ScenarioRun

DIR = Path(__file__).resolve().parent / "fixtures" / "deployments"
SCRAPE_S = 5.0  # validate's scrape interval


def bodies(runs: dict[tuple[str, str], ScenarioRun]) -> dict[str, str]:
    """File name -> body, from runs left at their story's end: ``<story>-<engine>.prom`` for the
    judged instance, ``<story>-<engine>-<target>.prom`` for each side target."""
    out = {}
    for (name, engine), run in sorted(runs.items()):
        out[f"{name}-{engine}.prom"] = run.exposition()
        for target, body in run.side_targets().items():
            out[f"{name}-{engine}-{target}.prom"] = body
    return out


def series(body: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """A body's dialect: every sample's name and label set, values aside (the simulated numbers
    move whenever a reference scheduler is refined; the names and labels are the engine's)."""
    return {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(body) for s in f.samples}


def read(name: str) -> str:
    """A saved body by file name (see ``bodies``)."""
    return (DIR / name).read_text(encoding="utf-8")


def _runs() -> dict[tuple[str, str], ScenarioRun]:
    """Each story advanced as validate scrapes it (every 5 simulated seconds: where the engine
    loop stops matters to an instance idle until a transfer lands)."""
    runs = {}
    for name, sc in DEPLOYMENTS.items():
        for engine in sc.engines:
            run = ScenarioRun(sc, engine)
            for _ in run.scrapes(SCRAPE_S):
                pass
            runs[name, engine] = run
    return runs


if __name__ == "__main__":
    DIR.mkdir(parents=True, exist_ok=True)
    for file, body in bodies(_runs()).items():
        (DIR / file).write_text(body, encoding="utf-8")
        print(f"wrote {DIR / file}", file=sys.stderr)
