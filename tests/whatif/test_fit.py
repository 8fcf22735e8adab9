"""The fit reads a scenario's own load back from its emitted metrics, and levers change exactly
the knob they name."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from kvdiag.refpool.scenarios import LLAMA70_TP2, SCENARIOS
from kvdiag.whatif.fit import FitError, StepRate, fit
from kvdiag.whatif.deployment import sized
from kvdiag.whatif.levers import Lever, LeverError, recommended_limit, resolve
from kvdiag.window import Window
from tests.checks.scenario import recording, window
from tests.whatif.conftest import story


def test_fit_reads_the_load_the_scenario_ran() -> None:
    """noisy-healthy: Poisson 6 req/s, ~340-token prompts, ~90-token answers, no shared prefix,
    on the catalogue's Llama-3-70B / 2 x H100 / 0.9 pool."""
    w, run = story("noisy-healthy", "vllm", 120.0)
    f = fit(w)
    done = [r for r in run.sims[0].records if r.finished is not None and r.finished >= 5.0]
    assert abs(f.rate - 6.0) / 6.0 < 0.15
    assert abs(f.prompt_tokens - np.mean([r.prompt_tokens for r in done])) / f.prompt_tokens < 0.1
    assert abs(f.output_tokens - np.mean([r.output_tokens for r in done])) / f.output_tokens < 0.1
    assert f.hit_ratio is not None and f.hit_ratio < 0.02 and f.workload().prefix is None  # no sharing, none invented
    assert f.pool_tokens == LLAMA70_TP2.pool_tokens // 16 * 16  # the pool as reported, in whole blocks
    knobs = {k.name: k for k in f.knobs}
    assert (knobs["TP"].value, knobs["TP"].basis, knobs["memory fraction"].value) == ("2", "inferred", "0.9")
    assert knobs["model"].basis == "read" and knobs["GPU"].basis == "assumed"
    assert {k.name for k in f.assumed} >= {"GPU", "KV dtype", "admission cap"}
    assert knobs["prompt lengths"].basis == knobs["output lengths"].basis == "read"  # the length histograms
    assert f.scenario().deployment.pool_tokens == f.pool_tokens  # the calibration replays the reported pool exactly


#: How close the fit comes to the scenario's own log-normal from ~600 requests in coarse buckets
#: (SGLang's 100 / 300 / 500 / 700 / 1000 / 1500 ..., vLLM's 1-2-5 series): the median within
#: 10 %, sigma within 0.1.
MEDIAN_TOLERANCE, SIGMA_TOLERANCE = 0.10, 0.1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_fit_recovers_each_length_distribution_from_its_histogram(engine: str) -> None:
    """noisy-healthy's prompts are LogNormal(300, 0.5), its answers LogNormal(80, 0.5): read back
    from the emitted length histograms, each capped at the highest bucket that holds a request."""
    w, run = story("noisy-healthy", engine, 120.0)
    f = fit(w)
    load = SCENARIOS["noisy-healthy"].workloads[0]
    h = {name: w.histogram_increase(name) for name in ("prompt_lengths", "output_lengths")}
    for got, truth, name, longest in ((f.prompt, load.input_len, "prompt_lengths", "prompt_tokens"),
                                      (f.output, load.output_len, "output_lengths", "output_tokens")):  # fmt: skip
        assert abs(got.median - truth.median) / truth.median < MEDIAN_TOLERANCE, (name, got)
        assert abs(got.sigma - truth.sigma) < SIGMA_TOLERANCE, (name, got)
        assert got.mean == pytest.approx(h[name].sum / h[name].count)  # the mean is the histogram's own
        seen = max(getattr(r, longest) for r in run.sims[0].records if r.finished is not None and r.finished > 5.0)
        assert got.hi == min(b for b in h[name].bounds if b >= seen)  # the bucket holding the longest request
        assert (f.workload().input_len if name == "prompt_lengths" else f.workload().output_len) == got.dist
    knobs = {k.name: k for k in f.knobs}
    metric = {"sglang": "sglang:prompt_tokens_histogram", "vllm": "vllm:request_prompt_tokens"}[engine]
    assert knobs["prompt lengths"].basis == "read" and knobs["prompt lengths"].note.startswith(metric)
    assert not any(k.value.startswith("from the means") for k in f.knobs)


def test_a_window_without_length_histograms_fits_the_means_and_says_so() -> None:
    """The same window with the histograms gone (an older release): the counters' means, the
    spread assumed, and the knobs say so."""
    from kvdiag.whatif.fit import LENGTH_CLIP, OUTPUT_SIGMA, PROMPT_SIGMA

    w, _ = story("noisy-healthy", "vllm", 120.0)
    strip = ("prompt_lengths", "output_lengths")
    bare = Window(w.instance, [replace(s, prompt_lengths=None, output_lengths=None,
                                       provenance={k: v for k, v in s.provenance.items() if k not in strip}) for s in w.samples])  # fmt: skip
    f, read = fit(bare), fit(w)
    requests = bare.increase("requests_total")
    assert f.prompt.mean == pytest.approx(bare.increase("prompt_tokens_total") / requests)
    assert (f.prompt.sigma, f.output.sigma) == (PROMPT_SIGMA, OUTPUT_SIGMA)
    assert f.prompt.hi == round(LENGTH_CLIP * f.prompt.median)
    knobs = {k.name: k for k in f.knobs}
    for name in ("prompt lengths", "output lengths"):
        assert knobs[name].basis == "assumed" and knobs[name].value.startswith("from the means: log-normal")
        assert "no length histogram in the window" in knobs[name].note
        assert name in {k.name for k in f.assumed}
    assert f.prompt != read.prompt and f.hit_ratio == read.hit_ratio  # only the lengths changed


def test_a_pinned_running_count_is_the_admission_cap() -> None:
    """sequence-cap: max_running_requests 8 while the pool has room and requests wait."""
    f = fit(story("sequence-cap", "sglang", 120.0)[0])
    cap = next(k for k in f.knobs if k.name == "admission cap")
    assert f.max_running == 8 and cap.basis == "inferred" and "pinned at 8" in cap.note
    assert f.scenario().max_running == 8


def test_prefix_sharing_from_the_hit_ratio() -> None:
    f = fit(story("l1-saturation", "sglang", 90.0)[0])
    assert f.hit_ratio is not None and 0.6 < f.hit_ratio < 0.75  # 70 % of each prompt is one of 4 system prompts
    assert f.workload().prefix is not None and f.workload().prefix.share == pytest.approx(f.hit_ratio)
    assert f.l2_ratio == pytest.approx(64.0, rel=0.01)  # the HiCache tier, read from its capacity series


def test_step_rate_arrivals() -> None:
    arrivals = StepRate((0.0, 10.0, 20.0), (5.0, 0.0))
    times = list(arrivals.times(np.random.default_rng(0)))
    assert all(0 <= t < 10 for t in times) and 30 < len(times) < 75  # 50 expected; none in the empty bucket, none after
    assert arrivals.total == 50 and arrivals.scaled(0.5).total == 25


def test_a_window_without_what_a_fit_needs_is_an_error() -> None:
    one = window(recording("sglang", steps=1))
    with pytest.raises(FitError, match="at least 2 samples"):
        fit(one)
    idle = window(recording("vllm", steps=30, requests=0))  # counters present, but no request ever finishes
    with pytest.raises(FitError, match="no request finished"):
        fit(idle)
    w, _ = story("noisy-healthy", "vllm", 120.0)
    bare = Window(w.instance, [replace(s, requests_total=None, provenance={}) for s in w.samples])
    with pytest.raises(FitError, match="requests_total"):
        fit(bare)
    # scrapes mostly at one timestamp (a frozen source): no per-second rate, said so, never a crash
    busy = window(recording("vllm", steps=6))
    stamped = busy.samples
    frozen = Window(busy.instance, [replace(s, ts=stamped[0].ts if i < 4 else s.ts) for i, s in enumerate(stamped)])
    with pytest.raises(FitError, match="share a timestamp"):
        fit(frozen)


def test_levers_change_the_knob_they_name() -> None:
    sc = replace(SCENARIOS["noisy-healthy"], duration=60.0)
    base = sc.deployment.pool_tokens
    assert sized(sc.deployment).pool_tokens == base  # a plain deployment keeps the capacity model's pool
    assert Lever("kv-dtype", "fp8").apply(sc).deployment.pool_tokens == pytest.approx(2 * base, abs=2)
    assert Lever("tp", "4").apply(sc).deployment.pool_tokens > 2 * base  # weights split too
    assert Lever("mem-fraction", "0.95").apply(sc).deployment.pool_tokens > base
    assert Lever("max-running", "16").apply(sc).max_running == 16
    assert Lever("l2-ratio", "2").apply(sc).l2_ratio == 2.0
    two = Lever("dp", "2").apply(sc)
    assert two.dp == 2 and all(w.arrivals.rate == 3.0 for w in two.workloads) and two.workloads[0].seed != two.workloads[1].seed
    for bad, why in (("tp=0", "at least 1"), ("kv-dtype=int3", "expected one of"), ("mem-fraction=1.5", r"\(0, 1\]"), ("mem-fraction=0.5", "no room")):
        name, value = bad.split("=")
        with pytest.raises(LeverError, match=why):
            Lever(name, value).apply(sc)
    with pytest.raises(LeverError, match="unknown remedy"):
        resolve(["swap=1"], sc.deployment, None)
    with pytest.raises(LeverError, match="give a value"):
        resolve(["max-running"], sc.deployment, None)  # no ceiling known: no default
    assert [lv.label for lv in resolve(["max-running", "tp"], sc.deployment, 31)] == ["max-running=31", "tp=4"]
    assert recommended_limit({"limit": 40, "ceiling": 31}) == 40 and recommended_limit({"ceiling": 31}) == 31
    assert recommended_limit({"limit": None}) is None and recommended_limit({}) is None
    defaults = [lv.name for lv in resolve([], sc.deployment, 31)]
    assert defaults == ["kv-dtype", "tp", "dp", "max-running", "mem-fraction"]


def test_a_scale_model_divides_the_pool_the_load_and_the_cap_not_the_step_times() -> None:
    from kvdiag.refpool.types import ScheduledChunk, SimRequest, StepPlan
    from kvdiag.whatif.scale import scaled

    sc = replace(SCENARIOS["noisy-healthy"], max_running=9)
    small = scaled(sc, 4.0)
    assert small.deployment.pool_tokens == round(sc.deployment.pool_tokens / 4)
    assert small.max_running == 3  # 9 / 4, rounded up
    full_times = list(itertools.islice(sc.workloads[0].arrivals.times(np.random.default_rng(5)), 400))
    model_times = list(itertools.islice(small.workloads[0].arrivals.times(np.random.default_rng(5)), 100))
    assert model_times == full_times[::4]  # every 4th arrival of the same draw: its count tracks the full stream's
    req = SimRequest("r", 0.0, (1,) * 100, 10, 10)
    quarter, full = StepPlan([ScheduledChunk(req, 1, 500, False)] * 10), StepPlan([ScheduledChunk(req, 1, 500, False)] * 40)
    assert small.deployment.roofline().step_time(quarter) == pytest.approx(sc.deployment.roofline().step_time(full))
    assert scaled(sc, 1.0) is sc


def test_a_scale_models_prefill_beside_decodes_is_timed_at_its_average() -> None:
    """A scale model's mixed steps carry a whole prompt or none; each is timed with the prefill
    averaged over recent decoding steps, which charges as many prefill tokens in the long run,
    spread as the full-size engine spreads them. Prefill-only steps are timed as they come."""
    from kvdiag.refpool.types import ScheduledChunk, SimRequest, StepPlan
    from kvdiag.whatif.deployment import ScaledRoofline

    req = SimRequest("r", 0.0, (1,) * 1000, 10, 10)
    prompt = ScheduledChunk(req, 1000, 0, True)
    decodes = StepPlan(decode_batch=128, decode_context=128 * 1400)
    mixed = StepPlan([prompt], decode_batch=128, decode_context=128 * 1400)
    smooth, plain = ScaledRoofline(8.0, "llama-3-8b", "h200", tp=2), ScaledRoofline(8.0, "llama-3-8b", "h200", tp=2)
    assert smooth.step_time(StepPlan([prompt])) == plain.batch_cost(1000, 0, 1000 * 1001 / 2).seconds  # prefill alone: as it comes
    lumpy = plain.batch_cost(128 + 1000, 128 * 1400, 128 * 1401 + 1000 * 1001 / 2).seconds
    times = [smooth.step_time(mixed if i % 8 == 0 else decodes) for i in range(4000)]
    assert max(times[-800:]) < lumpy  # no step pays a whole prompt times k
    spread = plain.batch_cost(128 + 125, 128 * 1400, 128 * 1401 + 1000 * 1001 / 2 / 8).seconds  # a prompt per 8 steps, evenly
    assert np.mean(times[-800:]) == pytest.approx(spread, rel=0.02)


def test_a_scale_model_divides_the_engines_own_default_caps() -> None:
    """Where the scenario sets no cap, each engine's default (SGLang's by pool, vLLM's
    max_num_seqs) is the full-size one divided by k: a cap that binds at full size binds in the
    model, and none is left k times too loose."""
    from math import ceil

    from kvdiag.refpool.scenarios import CONTEXT_LEN, VLLM_MAX_NUM_SEQS, make_scheduler
    from kvdiag.refpool.sglang.scheduler import default_max_running_requests
    from kvdiag.whatif.scale import scaled

    sc = replace(SCENARIOS["noisy-healthy"], deployment=replace(SCENARIOS["noisy-healthy"].deployment, mem_fraction=0.95))
    full_sglang, full_vllm = make_scheduler(sc, "sglang")(), make_scheduler(sc, "vllm")()
    assert full_vllm.max_num_seqs == VLLM_MAX_NUM_SEQS
    assert full_sglang.max_running_requests == default_max_running_requests(sc.deployment.pool_tokens, CONTEXT_LEN)
    small = scaled(sc, 8.0)
    model_sglang, model_vllm = make_scheduler(small, "sglang")(), make_scheduler(small, "vllm")()
    assert model_vllm.max_num_seqs == ceil(VLLM_MAX_NUM_SEQS / 8)
    assert model_sglang.max_running_requests == min(ceil(full_sglang.max_running_requests / 8), small.deployment.pool_tokens // 2)


def test_a_length_fit_from_coarse_buckets() -> None:
    """The histogram's mean kept exactly and the sigma its buckets make most likely, on both
    engines' bucket layouts; too few requests is no fit; a top bucket of +Inf caps at the clip."""
    from kvdiag.model import Histogram
    from kvdiag.refpool.emit import SGLANG_LENGTH_BUCKETS, vllm_length_buckets
    from kvdiag.whatif.lengths import MIN_REQUESTS, from_histogram

    rng = np.random.default_rng(7)
    drawn = np.round(1000 * np.exp(0.6 * rng.standard_normal(5000)))

    def binned(values: np.ndarray, bounds: tuple[float, ...]) -> Histogram:
        edges = bounds + (float("inf"),)
        return Histogram(edges, tuple(float((values <= b).sum()) for b in edges), float(values.sum()), float(len(values)))

    for bounds in (SGLANG_LENGTH_BUCKETS, vllm_length_buckets(32768)):
        got = from_histogram(binned(drawn, bounds), clip=4.0)
        assert got is not None and got.mean == pytest.approx(drawn.mean())
        assert abs(got.median - 1000) / 1000 < 0.05 and abs(got.sigma - 0.6) < 0.05, (bounds[:3], got)
        assert got.hi == min(b for b in bounds if b >= drawn.max())
    assert from_histogram(binned(drawn[: MIN_REQUESTS - 1], SGLANG_LENGTH_BUCKETS), clip=4.0) is None
    beyond = from_histogram(binned(drawn * 100, (100.0, 1000.0)), clip=4.0)  # everything above the last finite bound
    assert beyond is not None and beyond.hi == round(4.0 * beyond.median)


def test_auto_scale_keeps_small_windows_at_full_size_and_a_busy_batch_in_the_model() -> None:
    from kvdiag.whatif.scale import MAX_REQUESTS, MIN_RUNNING, auto_scale

    assert auto_scale(MAX_REQUESTS, 5_000) == 1.0  # a few thousand requests: full size
    assert auto_scale(180_000, 1_023) == 8.0  # bench_whatif's vLLM hour: held at ~125 running, not 36x
    assert auto_scale(180_000, 1_288) == 10.0  # its SGLang hour (a peak of 1,586 would give 13)
    assert auto_scale(20_000, 2_000) == 4.0  # brought to MAX_REQUESTS
    assert auto_scale(100_000, MIN_RUNNING - 1) == 1.0  # too few running for any model
    assert auto_scale(100_000, None) == 1.0  # running unknown: no guess


def test_the_pool_and_conservativeness_levers() -> None:
    """``pool`` sets L1 to the tokens given whatever the deployment (FP8 then doubles that), and
    ``conservativeness`` reaches SGLang's new-token ratio as SGLang sets it (init 0.7 x c, at most 1)."""
    from kvdiag.refpool.scenarios import make_scheduler

    sc = replace(SCENARIOS["noisy-healthy"], duration=60.0)
    assert Lever("pool", "5000").apply(sc).deployment.pool_tokens == 5000
    assert Lever("kv-dtype", "fp8").apply(Lever("pool", "5000").apply(sc)).deployment.pool_tokens == pytest.approx(10000, abs=2)
    fitted = fit(story("noisy-healthy", "vllm", 120.0)[0]).scenario()  # a reported pool: replaced, not scaled
    assert Lever("pool", "2048").apply(fitted).deployment.pool_tokens == 2048
    loose = Lever("conservativeness", "0.5").apply(sc)
    assert loose.sglang_conservativeness == 0.5
    ratio = make_scheduler(loose, "sglang")().ratio  # type: ignore[attr-defined]
    assert ratio.init == pytest.approx(0.35) and ratio.min == pytest.approx(0.35 * 0.14)
    assert make_scheduler(Lever("conservativeness", "2").apply(sc), "sglang")().ratio.init == 1.0  # type: ignore[attr-defined]
    for bad, why in (("pool=0", "at least 1"), ("conservativeness=-1", "at least 0"), ("conservativeness=x", "a number")):
        name, value = bad.split("=")
        with pytest.raises(LeverError, match=why):
            Lever(name, value).apply(sc)
    assert Lever("pool", "1").flag("sglang") == "--max-total-tokens"
    assert Lever("conservativeness", "1").flag("sglang") == "--schedule-conservativeness"
    assert Lever("conservativeness", "1").flag("vllm") == ""
