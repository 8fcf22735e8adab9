"""Fit a reference-pool workload and deployment to one instance's window, from its own series.

What the series give, and what becomes of it:

* **arrivals**: requests that finished in each scrape interval (the request counter's reset-safe
  increase) plus the change in requests in the engine (running + waiting), bucketed and replayed
  as Poisson arrivals at each bucket's rate (``StepRate``); the requests in flight at the
  window's first sample arrive in the scrape interval before it (``Fit.scenario``);
* **lengths**: prompt and generated tokens per finished request, each a log-normal fitted to the
  engine's length histogram over the window (``lengths.from_histogram``: its mean, the sigma its
  bucket counts make most likely, capped at its highest non-empty bucket); where a window has no
  such histogram, from the means (the token counters over the request counter) with the spread
  assumed (the catalogue's chat load's sigmas), and the knobs say which;
* **prefix sharing**: the window's hit ratio (hit tokens over queried, or over prompt tokens)
  becomes the share of each prompt that is one of a few system prompts (how many is assumed);
* **the pool**: its capacity in tokens and block size as reported; the model from the
  ``model_name`` label where it names a preset; TP and the memory fraction inferred as the pair
  that gives the reported pool on the GPU assumed; the L2 tier from its capacity series;
* **step time**: a law fitted to the window's inter-token latency against its batch, context
  and prefill (``steptime``), where the model has no preset or the preset does not explain it;
  else the GPU preset's roofline;
* **limits**: a running count pinned at one value while requests waited and the pool had room
  is the engine's admission cap (inferred); otherwise the reference engine's default (assumed).

Every knob is listed with its basis (read, inferred or assumed), so a poor calibration can be
traced to what was guessed. ``FitError`` says which series are missing when a fit is impossible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from kvdiag import capacity
from kvdiag.model import hit_ratio
from kvdiag.refpool.scenarios import Scenario
from kvdiag.refpool.workload import SharedPrefix, Workload, exponential_draws
from kvdiag.whatif import lengths
from kvdiag.whatif.deployment import Sized
from kvdiag.whatif.lengths import LengthFit
from kvdiag.whatif.steptime import StepFit, choose
from kvdiag.window import Window, counter_steps

#: Assumed spread of prompt and output lengths (log-normal sigma) where no length histogram is
#: read: the catalogue's chat load.
PROMPT_SIGMA = 0.4
OUTPUT_SIGMA = 0.5
#: Assumed longest request, as a multiple of the median length (the chat load's clip), where no
#: histogram bounds it.
LENGTH_CLIP = 4.0
#: Assumed number of distinct shared prefixes (system prompts) behind the hit ratio.
PREFIX_GROUPS = 4
#: Hit ratios below this are replayed as no sharing.
MIN_SHARE = 0.02
#: At most this many arrival-rate buckets over the window, each at least one scrape interval
#: and ``MIN_BUCKET_S`` long: a bucket's count carries its own Poisson noise, which the replay's
#: Poisson draw would add to again (a 5 s bucket at 14 req/s is 70 +- 8 requests).
MAX_BUCKETS = 240
MIN_BUCKET_S = 15.0
#: A running count pinned at (within a request or 10 % of) its peak in at least ``CAP_SHARE`` of
#: the samples where requests waited with the pool under ``CAP_USAGE``, those being at least
#: ``CAP_SAMPLES`` of the window, reads as the engine's admission cap.
CAP_SHARE = 0.8
CAP_USAGE = 0.8
CAP_SAMPLES = 0.25
ASSUMED_MODEL = "llama-3-70b"
TYPICAL_FRACTION = 0.9  # the engines' usual static memory fraction: the TP whose fit is nearest wins
REFERENCE_BLOCK = 16  # the reference vLLM pool's block size


class FitError(ValueError):
    """The window lacks what a fit needs; the message names the series."""


@dataclass(frozen=True)
class StepRate:
    """Poisson arrivals at ``rates[i]`` per second over ``[edges[i], edges[i+1])``, none after
    the last edge (the replay ends with the window)."""

    edges: tuple[float, ...]
    rates: tuple[float, ...]

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        draws = exponential_draws(rng)
        for lo, hi, rate in zip(self.edges, self.edges[1:], self.rates):
            t = lo
            while rate > 0:  # memoryless: a fresh draw from each bucket's start is exact
                t += (1.0 / rate) * next(draws)
                if t >= hi:
                    break
                yield t

    def scaled(self, factor: float) -> StepRate:
        return StepRate(self.edges, tuple(r * factor for r in self.rates))

    @property
    def total(self) -> float:
        """Expected arrivals over the whole window."""
        return float(sum(r * (hi - lo) for lo, hi, r in zip(self.edges, self.edges[1:], self.rates)))


@dataclass(frozen=True)
class Knob:
    """One fitted input and where it came from: ``read`` (a series), ``inferred`` (from several),
    ``assumed`` (not in the series at all)."""

    name: str
    value: str
    basis: str
    note: str = ""


@dataclass(frozen=True)
class Fit:
    """An instance's window as a reference-pool scenario."""

    instance: str
    engine: str
    model: str | None
    start: float  # the window's first sample (unix seconds)
    duration: float
    interval: float  # median scrape interval
    arrivals: StepRate
    prompt: LengthFit  # per finished request
    output: LengthFit
    hit_ratio: float | None
    pool_tokens: int
    max_running: int | None
    l2_ratio: float | None
    deployment: Sized
    knobs: tuple[Knob, ...]
    step: StepFit | None = None  # the step-time law the replays run at, and why

    @property
    def rate(self) -> float:
        """Mean arrivals per second over the replay (the requests in flight at the start included)."""
        return self.arrivals.total / self.arrivals.edges[-1]

    @property
    def prompt_tokens(self) -> float:
        """Mean prompt tokens per finished request."""
        return self.prompt.mean

    @property
    def output_tokens(self) -> float:
        return self.output.mean

    @property
    def assumed(self) -> list[Knob]:
        return [k for k in self.knobs if k.basis == "assumed"]

    def workload(self, seed: int = 0) -> Workload:
        share = self.hit_ratio or 0.0
        prefix = SharedPrefix(PREFIX_GROUPS, min(share, 0.98)) if share >= MIN_SHARE else None
        return Workload(self.arrivals, self.prompt.dist, self.output.dist, prefix=prefix, seed=seed)

    def scenario(self, seed: int = 0) -> Scenario:
        """The replay: simulated t = 0 is one scrape interval before the window's first sample
        (the requests in flight then arrive in that interval), so the replay's scrapes, one
        interval apart from t = ``interval``, fall where the window's samples did."""
        return Scenario(
            f"whatif:{self.instance}", f"fitted to {self.instance}'s window", ("fitted",), (self.workload(seed),),
            duration=self.duration + self.interval, max_running=self.max_running, l2_ratio=self.l2_ratio, deployment=self.deployment,
        )  # fmt: skip

    def as_json(self) -> dict[str, object]:
        return {
            "instance": self.instance,
            "engine": self.engine,
            "duration_s": self.duration,
            "interval_s": self.interval,
            "arrival_rate": round(self.rate, 3),
            "peak_rate": round(max(self.arrivals.rates, default=0.0), 3),
            "prompt_tokens": round(self.prompt_tokens, 1),
            "output_tokens": round(self.output_tokens, 1),
            "prompt_lengths": self.prompt.as_json(),
            "output_lengths": self.output.as_json(),
            "hit_ratio": self.hit_ratio,
            "pool_tokens": self.pool_tokens,
            "max_running": self.max_running,
            "l2_ratio": self.l2_ratio,
            "knobs": [{"name": k.name, "value": k.value, "basis": k.basis, "note": k.note} for k in self.knobs],
            "step_time": None if self.step is None else self.step.as_json(),
        }


def fit(window: Window) -> Fit:
    """The scenario the window's own series describe (module docstring); ``FitError`` when a
    series it needs is absent or says nothing (no finished request, one sample)."""
    if len(window) < 2:
        raise FitError(f"{window.instance}: needs a window of at least 2 samples (got {len(window)}); "
                       "give a recording, --prometheus, or sample URLs with --duration")  # fmt: skip
    last = window.last
    read = {hist: _read(window, hist) for hist, _ in LENGTHS}
    missing = [f for f in ("capacity_tokens", "requests_total") if not window.has(f)]
    missing += [counter for hist, counter in LENGTHS if read[hist] is None and not window.has(counter)]
    if missing:
        raise FitError(f"{window.instance}: {', '.join(missing)} not reported; a workload cannot be fitted without them")
    requests = window.increase("requests_total") or 0.0
    if requests <= 0:
        raise FitError(f"{window.instance}: no request finished in the window (requests_total did not grow): lengths cannot be fitted")
    (prompt, prompt_knob), (output, output_knob) = (
        _length(window, hist, counter, read[hist], requests, sigma) for (hist, counter), sigma in zip(LENGTHS, (PROMPT_SIGMA, OUTPUT_SIGMA))
    )
    if output.mean <= 0:
        raise FitError(f"{window.instance}: generation_tokens_total did not grow while {requests:g} requests finished")
    ts = window.column("ts")
    duration = float(ts[-1] - ts[0])
    interval = float(np.median(np.diff(ts)))
    if interval <= 0:
        raise FitError(f"{window.instance}: most of its scrapes share a timestamp; arrivals per second cannot be fitted")
    knobs: list[Knob] = []
    pool = int(np.nanmax(window.column("capacity_tokens")))
    knobs.append(Knob("pool", f"{pool:,} tokens", "read", _source(window, "capacity_tokens")))
    block = last.block_size
    if block is not None and int(block) != REFERENCE_BLOCK:
        knobs.append(Knob("block size", f"{REFERENCE_BLOCK}", "assumed", f"the engine reports {block:g}; the reference pool uses {REFERENCE_BLOCK}"))
    arrivals = _arrivals(window, interval)
    hit, hit_basis = _hit_ratio(window)
    knobs.append(Knob("prefix sharing", "none" if not hit or hit < MIN_SHARE else f"{hit:.2f} of each prompt", "read" if hit is not None else "assumed", hit_basis))
    if hit is not None and hit >= MIN_SHARE:
        knobs.append(Knob("prefix groups", str(PREFIX_GROUPS), "assumed", "the series give the hit ratio, not how many prompts share it"))
    knobs += [prompt_knob, output_knob]
    knobs.append(Knob("max_new_tokens", "the output length", "assumed", "what clients ask for is not in the series"))
    cap, cap_note = _admission_cap(window)
    knobs.append(Knob("admission cap", str(cap) if cap else "engine default", "inferred" if cap else "assumed", cap_note))
    l2 = None
    if window.has("l2_capacity_tokens"):
        l2 = float(np.nanmax(window.column("l2_capacity_tokens"))) / pool
        knobs.append(Knob("L2 tier", f"{l2:.2f} x L1", "read", _source(window, "l2_capacity_tokens")))
    deployment, dep_knobs = _deployment(last.model, pool)
    knobs.extend(dep_knobs)
    step = choose(window, deployment.roofline(), preset_known=dep_knobs[0].basis == "read")
    if step.used == "fitted":
        deployment = replace(deployment, step_law=step.law)
        knobs = [replace(k, note="not in the series; the fitted step law times the replay, not this GPU") if k.name == "GPU" else k
                 for k in knobs]  # fmt: skip
    knobs.append(Knob("step time", "fitted law" if step.used == "fitted" else f"{deployment.gpu} preset",
                      "read" if step.used == "fitted" else "assumed", step.describe()))  # fmt: skip
    return Fit(window.instance, window.engine, last.model, float(ts[0]), duration, interval, arrivals, prompt, output, hit,
               pool, cap, l2, deployment, tuple(knobs), step)  # fmt: skip


#: (length histogram, token counter) of the prompt and of the output, per finished request.
LENGTHS = (("prompt_lengths", "prompt_tokens_total"), ("output_lengths", "generation_tokens_total"))


def _read(window: Window, hist: str) -> LengthFit | None:
    """The length distribution the window's histogram gives (None: no histogram, or too few
    requests in it to show a spread)."""
    h = window.histogram_increase(hist)
    return lengths.from_histogram(h, LENGTH_CLIP) if h is not None else None


def _length(window: Window, hist: str, counter: str, read: LengthFit | None, requests: float, sigma: float) -> tuple[LengthFit, Knob]:
    """One length distribution and its knob: ``read`` from the histogram, else from the mean."""
    what = "prompt" if hist == "prompt_lengths" else "output"
    h = window.histogram_increase(hist)
    if h is not None and read is not None:
        return read, Knob(f"{what} lengths", read.describe(), "read",
                          f"{_source(window, hist)}: {h.count:,.0f} requests in the window")  # fmt: skip
    mean = (window.increase(counter) or 0.0) / requests
    fitted = lengths.from_mean(mean, sigma, LENGTH_CLIP)
    why = f"{h.count:,.0f} requests in the length histogram, too few" if h is not None else "no length histogram in the window"
    return fitted, Knob(f"{what} lengths", f"from the means: {fitted.describe()}", "assumed",
                        f"{why}: {_source(window, counter)} per finished request; the sigma "
                        f"and a cap at {LENGTH_CLIP:g}x the median assumed")  # fmt: skip


def _source(window: Window, name: str) -> str:
    _, prov = window.provenance(name)
    return prov.describe() if prov is not None else ""


def _arrivals(window: Window, interval: float) -> StepRate:
    ts = window.column("ts")
    finished = np.nan_to_num(counter_steps(window.column("requests_total"), bridge=True)[1:])
    inflight = np.nan_to_num(window.column("running")) + np.nan_to_num(window.column("waiting"))
    per_interval = np.maximum(0.0, finished + np.diff(inflight))
    width = max(interval, MIN_BUCKET_S, float(ts[-1] - ts[0]) / MAX_BUCKETS)
    edges, rates = [0.0, interval], [float(inflight[0]) / interval]  # in flight at the first sample: arrived before it
    count = 0.0
    for i, n in enumerate(per_interval):
        count += n
        end = interval + float(ts[i + 1] - ts[0])
        if end - edges[-1] >= width - 1e-9 or i == len(per_interval) - 1:
            rates.append(count / (end - edges[-1]) if end > edges[-1] else 0.0)
            edges.append(end)
            count = 0.0
    return StepRate(tuple(edges), tuple(rates))


def _hit_ratio(window: Window) -> tuple[float | None, str]:
    """The window's hit ratio (``model.hit_ratio``) from the counters' increases: over the
    queried tokens, else over the prompt tokens, else the gauge's mean."""
    hits = window.increase("prefix_hit_tokens_total")
    for whole, basis in (("prefix_query_tokens_total", "prefix hit tokens over queried tokens"),
                         ("prompt_tokens_total", "prefix hit tokens over prompt tokens")):  # fmt: skip
        ratio = hit_ratio(hits, window.increase(whole), None)
        if ratio is not None:
            return min(1.0, ratio), basis
    gauge = float(np.nanmean(window.column("prefix_hit_ratio_gauge"))) if window.has("prefix_hit_ratio_gauge") else None
    if gauge is not None:
        return gauge, "the engine's hit-rate gauge (mean)"
    return None, "no prefix-cache series: replayed without sharing"


def _admission_cap(window: Window) -> tuple[int | None, str]:
    running, waiting, usage = (window.column(f) for f in ("running", "waiting", "usage_ratio"))
    room = (waiting > 0) & (usage < CAP_USAGE)
    if room.sum() < max(3, CAP_SAMPLES * len(running)):
        return None, "the reference engine's default (no sign of a cap in the series)"
    peak = float(np.nanmax(running[room]))
    near = running[room] >= peak - max(1.0, 0.1 * peak)  # a request that just finished is not yet replaced
    if peak > 0 and near.mean() >= CAP_SHARE:
        return int(peak), f"running pinned at {peak:g} while requests waited and the pool had room"
    return None, "the reference engine's default (no sign of a cap in the series)"


def _deployment(model_label: str | None, pool: int) -> tuple[Sized, list[Knob]]:
    """The preset the model label names (else the assumed one) and the (GPU, TP, memory
    fraction) that give the reported pool, the fraction nearest the engines' usual 0.9."""
    label = (model_label or "").lower()
    preset = next((k for k in sorted(capacity.MODELS, key=len, reverse=True) if k in label), None)
    knobs = [Knob("model", preset or ASSUMED_MODEL, "read" if preset else "assumed",
                  f"from model_name {model_label!r}" if preset else f"no preset matches model_name {model_label!r}")]  # fmt: skip
    spec = capacity.model(preset or ASSUMED_MODEL)
    best: tuple[float, str, int, float] | None = None
    for gpu_name, gpu in capacity.GPUS.items():
        for tp in (1, 2, 4, 8):
            kv = spec.kv_bytes_per_token_per_gpu(2, tp)
            fraction = (pool * kv + spec.weight_bytes(2) / tp) / gpu.memory_bytes
            if 0.3 <= fraction <= 0.98 and (best is None or abs(fraction - TYPICAL_FRACTION) < best[0] - 1e-6):
                best = (abs(fraction - TYPICAL_FRACTION), gpu_name, tp, fraction)
    if best is None:
        gpu_name, tp, fraction, note = "h100", 8, TYPICAL_FRACTION, "no GPU preset and TP give this pool"
        basis = "assumed"
    else:
        _, gpu_name, tp, fraction = best
        note, basis = "the GPU, TP and memory fraction that give the reported pool (bf16 KV)", "inferred"
    fraction = round(fraction, 3)
    knobs += [
        Knob("GPU", gpu_name, "assumed", "not in the series; sets the replay's step times"),
        Knob("TP", str(tp), basis, note),
        Knob("memory fraction", f"{fraction:g}", basis, note),
        Knob("KV dtype", "bf16", "assumed", "not in the series"),
    ]
    base = Sized(model=preset or ASSUMED_MODEL, gpu=gpu_name, tp=tp, mem_fraction=fraction, served_model=model_label or "")
    return Sized(model=base.model, gpu=gpu_name, tp=tp, mem_fraction=fraction, served_model=base.served_model,
                 reported_pool=pool, reported_as=base), knobs  # fmt: skip
