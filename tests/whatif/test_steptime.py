"""The step-time law read back from an engine's own histograms: the reference engines run at a
law we chose, and the fit must recover it from their emitted metrics alone."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from kvdiag.refpool.roofline import LinearStep, StepLaw
from kvdiag.refpool.scenarios import SCENARIOS, Deployment
from kvdiag.whatif import steptime
from kvdiag.whatif.deployment import Sized
from kvdiag.whatif.fit import fit
from kvdiag.whatif.replay import emitted
from kvdiag.window import Window
from tests.whatif.conftest import story

#: A CPU-like law: 12 ms a step, 1.5 ms per decoding request, 0.2 us per context token read,
#: 40 us per prompt token prefilled (the tiny model's order of magnitude on two cores).
CPU_LAW = StepLaw(0.012, 0.0015, 2e-7, 4e-5)
#: The recovered law's decode step at each interval's batch, against the true one: on vLLM the
#: preempted requests' recompute is estimated from the preemption count (its prefix-cache
#: counters skip them), which moves up to a tenth of the step from decode to prefill.
DECODE_TOLERANCE = 0.12
DECODE_MEDIAN = 0.10
#: Per prompt token, within this factor: the prefill share of a step is small, and SGLang's
#: prefill steps' own overhead lands on it (the ITL cannot tell the two apart).
PREFILL_FACTOR = 2.5


@lru_cache(maxsize=None)
def at_law(engine: str, deployment: Deployment, name: str = "l1-saturation", duration: float = 180.0) -> Window:
    """``name`` on ``engine`` with its steps timed by ``deployment`` (whose model label is no
    preset's), read back as a window."""
    return emitted(replace(SCENARIOS[name], duration=duration, deployment=deployment), engine, 5.0)[0][0]


def _decode_errors(w: Window, truth: LinearStep | object, law: StepLaw) -> np.ndarray:
    pts = steptime.points(w)
    assert pts is not None
    want = np.array([truth.batch_seconds(round(b), round(c), c + b) for b, c in zip(pts.decodes, pts.context)])  # type: ignore[attr-defined]
    got = np.array([law.seconds(b, c, 0) for b, c in zip(pts.decodes, pts.context)])
    return np.abs(got - want) / want


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_fit_recovers_a_linear_law(engine: str) -> None:
    """l1-saturation (batch 4 -> 80, 70 % shared prefixes) run at CPU_LAW: the fitted law is
    used (no preset for the model), explains the window's ITL within a few percent, and its
    decode step matches the true law's at every interval's batch."""
    d = Sized(served_model="tiny-cpu", step_law=CPU_LAW)
    w = at_law(engine, d)
    f = fit(w)
    assert f.step is not None and f.step.used == "fitted" and f.step.law is not None
    assert "no preset" in f.step.why
    assert f.step.intervals >= 30 and f.step.error is not None and f.step.error < 0.05
    assert f.step.preset_error is not None and f.step.preset_error > 0.5  # the GPU preset is far off: the law matters
    assert _decode_errors(w, d.roofline(), f.step.law).max() < DECODE_TOLERANCE
    assert 1 / PREFILL_FACTOR < f.step.law.per_prefill / CPU_LAW.per_prefill < PREFILL_FACTOR
    assert f.deployment.step_law == f.step.law  # the replay runs at it
    assert isinstance(f.scenario().deployment.roofline(), LinearStep)
    assert {k.name: k.basis for k in f.knobs}["step time"] == "read"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_fit_recovers_a_gpu_roofline_for_an_unknown_model(engine: str) -> None:
    """The catalogue's Llama-3-70B on 2 x H100, served under a name no preset matches: the law
    fitted to its ITL reproduces the roofline's decode steps (memory-bound, linear in context)."""
    d = Deployment(served_model="acme/unlisted-model")
    w = at_law(engine, d)
    f = fit(w)
    assert f.step is not None and f.step.used == "fitted" and f.step.law is not None
    assert np.median(_decode_errors(w, d.roofline(), f.step.law)) < DECODE_MEDIAN
    assert _decode_errors(w, d.roofline(), f.step.law).max() < DECODE_TOLERANCE


def test_a_known_model_keeps_its_preset() -> None:
    """The catalogue's own label (a preset): the preset explains the window, so the replay keeps it."""
    w, _ = story("l1-saturation", "vllm", 180.0)
    f = fit(w)
    assert f.step is not None and f.step.used == "preset" and "preset explains" in f.step.why
    assert f.step.preset_error is not None and f.step.preset_error <= steptime.PRESET_ERROR
    assert f.deployment.step_law is None


def test_thin_data_falls_back_to_the_preset() -> None:
    """Too few intervals with tokens decoded: the preset, as a prior, and the reason."""
    w = at_law("vllm", Sized(served_model="tiny-cpu", step_law=CPU_LAW), duration=30.0)
    f = fit(w)
    assert f.step is not None and f.step.used == "preset" and f.step.law is None
    assert "thin data" in f.step.why and f.deployment.step_law is None


def test_no_itl_histogram_keeps_the_preset() -> None:
    """A window whose engine exports no inter-token latency (vLLM before 0.10)."""
    w = at_law("vllm", Sized(served_model="tiny-cpu", step_law=CPU_LAW))
    bare = Window(w.instance, [replace(s, itl=None) for s in w.samples])
    f = fit(bare)
    assert f.step is not None and f.step.used == "preset" and "no inter-token latency" in f.step.why


def test_fit_law_finds_no_negative_term() -> None:
    """A law with no context cost, from points whose context varies: the context term is 0,
    never negative, and the others exact."""
    rng = np.random.default_rng(1)
    b = rng.uniform(2, 60, 40)
    c = rng.uniform(1e3, 4e4, 40)
    p = rng.uniform(0, 200, 40)
    itl = 0.01 + 0.002 * b + 5e-5 * p
    law = steptime.fit_law(steptime.Points(itl, np.full(40, 100.0), b, c, p))
    assert law.per_context == 0.0
    assert (law.fixed, law.per_decode, law.per_prefill) == pytest.approx((0.01, 0.002, 5e-5), rel=1e-6)
