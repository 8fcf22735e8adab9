"""What the compiled-build differential compares (test_native.py): each case's run, step by step.

Run as ``python -m tests.refpool.native_trace OUT`` in the build to trace (``KVDIAG_PURE=1``
for the sources): it writes, per case, the per-step log, every scrape's exposition, the
finished requests' ground truth and the scheduler's final counters, and which build ran.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import replace
from typing import Any

from kvdiag.refpool import native
from kvdiag.refpool.scenarios import SCENARIOS, ScenarioRun

# (scenario, engine, seconds, decode runs at once): retraction and HiCache (l1-saturation), the
# host tier helping (l2-helps), a restart, the running cap, two DP replicas, and the step-by-step
# loop once per engine.
CASES: list[tuple[str, str, float, bool]] = [
    (name, engine, seconds, fast)
    for engine in ("sglang", "vllm")
    for name, seconds, fast in (
        ("l1-saturation", 150.0, True),
        ("l1-saturation", 60.0, False),
        ("l2-helps", 120.0, True),
        ("restart", 240.0, True),
        ("sequence-cap", 90.0, True),
        ("dp2-one-hot", 90.0, True),
    )
]


def trace(name: str, engine: str, seconds: float, fast: bool) -> dict[str, Any]:
    run = ScenarioRun(replace(SCENARIOS[name], duration=seconds), engine, fast=fast)
    bodies = [scrape.body for _, scrape in run.scrapes(5.0)]
    return {
        "bodies": bodies,
        "steps": [{k: v.tolist() for k, v in sim.steps.arrays().items()} for sim in run.sims],
        "records": [sorted(map(repr, sim.records)) for sim in run.sims],
        "stats": [repr(sim.scheduler.stats()) for sim in run.sims],
    }


def main(out: str) -> None:
    traces = {case: trace(*case) for case in CASES}
    with open(out, "wb") as f:
        pickle.dump({"build": native.install(), "traces": traces}, f)


if __name__ == "__main__":
    main(sys.argv[1])
