"""The calibration's parts that need no engine (kvdiag/real/calibrate.py; the real engines judge
the reference in test_real_engines.py): a run the reference engine itself told stands in for a
real one, so the right reference must match it and a wrong one must not."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from kvdiag.real.calibrate import Replay, calibrate, fit_steps, reference_scheduler, requests_of, simulate
from kvdiag.real.catalogue import CI_STORY, STORIES
from kvdiag.real.load import ClosedLoop, Record, Requests
from kvdiag.refpool.roofline import StepLaw
from kvdiag.refpool.workload import ClosedStream

STORY = STORIES[CI_STORY]
LAW = StepLaw(fixed=0.003, per_decode=0.0004, per_context=0.0, per_prefill=7e-5)  # what real vLLM's steps fitted (docs)


def _records(seconds: float, rate: float, seed: int = 0) -> list[Record]:
    """Poisson sends of the CI story's request shape (above what the pool serves at ``LAW``)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(Record(t, rng.randint(*STORY.shape.prompt), rng.randint(*STORY.shape.output)))
    return out


@pytest.fixture(scope="module")
def told() -> tuple[list[Record], object]:
    """A 'real' run: the CI story's requests told by the reference vLLM at ``LAW``."""
    records = _records(90.0, 4.0)
    return records, simulate(STORY.spec("vllm"), requests_of(records, STORY.shape, 0.0, STORY.load), LAW, 100.0)


def test_replayed_prompts_share_the_real_drivers_prefix() -> None:
    """The first int(n x prefix) tokens are one string for every request (real Driver._prompt),
    the rest unique; max_tokens is the output plus the shape's extra."""
    shape = Requests(prompt=(300, 500), prefix=0.7, output=(10, 20), extra_max_tokens=5)
    a, b = requests_of([Record(1.0, 400, 12), Record(0.5, 300, 15)], shape, 0.0, STORY.load)
    assert (a.arrival, b.arrival) == (0.5, 1.0)  # in send order
    assert a.prompt[:210] == b.prompt[:210] and a.prompt[210] != b.prompt[210] and len(b.prompt) == 400
    assert (a.max_new_tokens, a.output_len, a.ignore_eos) == (20, 15, True)


def test_a_closed_loop_is_replayed_by_as_many_clients() -> None:
    recs = [Record(0.01 * k, 300, 10) for k in range(6)]
    stream = requests_of(recs, STORY.shape, 0.0, ClosedLoop(3, 60))
    assert isinstance(stream, ClosedStream)
    first = [next(stream) for _ in range(3)]
    with pytest.raises(StopIteration):  # every client waits for its answer
        next(stream)
    stream.returned(first[0], 2.0)
    assert next(stream).arrival == 2.0
    assert Replay(recs, STORY.shape).request("x", 0.0).output_len == 10


def test_the_step_law_is_read_back_from_the_steps(told: tuple) -> None:
    """Fitted from the steps alone (running counts and usage jumps, no plan), the law gives the
    run's busy time to within 10 %."""
    _, steps = told
    law = fit_steps(steps, STORY.pool_tokens)
    c = steps.columns
    busy = (c["running"] > 0) & (c["duration"] < 0.99)
    predicted = law.fixed * busy.sum() + law.per_decode * c["running"][busy].sum()
    assert predicted == pytest.approx(c["duration"][busy].sum(), rel=0.1)
    assert law.per_decode > 0


def test_the_same_reference_matches_and_a_wrong_one_does_not(told: tuple) -> None:
    records, steps = told
    right = calibrate(STORY, "vllm", steps, records, 100.0)
    assert right.ok, right.table()
    assert right.real.preemptions_per_min > 0 and right.real.first_kv_refusal is not None  # a saw-tooth to match
    for wrong in (replace(STORY.spec("vllm"), pool_tokens=2 * STORY.pool_tokens), replace(STORY.spec("vllm"), max_running=2)):
        cal = calibrate(STORY, "vllm", steps, records, 100.0, make=reference_scheduler(wrong))
        assert not cal.ok, cal.table()
    assert "preemptions_per_min" in right.table() and right.as_json()["ok"] is True
    assert np.isfinite(right.real.usage_median)
