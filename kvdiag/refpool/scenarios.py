"""Labelled scenarios: one deployment, one workload per data-parallel engine, both engines.

Every verdict kvdiag gives needs a case where the answer is known from the mechanism, not
from the checks' thresholds. A ``Scenario`` fixes a model/GPU preset and a pool small enough to
simulate in seconds, the load, the engine knobs that matter to the story (admission caps, an L2
tier, a restart) and a duration; ``ScenarioRun`` runs it on either reference engine and renders
what a scrape of that server would show at any simulated moment. What the simulator knew (was
admission blocked on L1, evictions, TTFTs) is read back from each ``Simulation`` by
``validate.py``, which derives the expected verdict from it.

The pool is a real deployment's: Llama-3-70B bf16 on two H100s (TP 2) at a 0.9 memory fraction
leaves about 6 GB of KV per GPU, ~39k tokens. Small pools hold few requests, so a run is fast,
and the step time (one 70B decode step ≈ 16 ms) keeps the step count per simulated second low.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping

from kvdiag import capacity
from kvdiag.model import Scrape
from kvdiag.refpool import emit
from kvdiag.refpool.deployments import HybridSWA, LMCacheTier, PDPair, Topology, lmcache_text, unified_metrics
from kvdiag.refpool.emit import content_type
from kvdiag.refpool.roofline import Roofline
from kvdiag.refpool.sglang.scheduler import SGLangScheduler, default_max_running_requests
from kvdiag.refpool.sim import EPOCH, Simulation
from kvdiag.refpool.types import EngineScheduler, KVStore
from kvdiag.refpool.vllm.scheduler import VLLMScheduler
from kvdiag.refpool.workload import Arrivals, ClosedLoop, Fixed, LogNormal, Periodic, Poisson, Ramp, SharedPrefix, Uniform, Workload

ENGINES = ("sglang", "vllm")
TICK_S = 0.05  # wall seconds between advances of a live simulation
BLOCK_SIZE = 16  # vLLM's default


@dataclass(frozen=True)
class Deployment:
    """Model, GPU and TP of every scenario, and the KV pool that leaves per GPU."""

    model: str = "llama-3-70b"
    gpu: str = "h100"
    tp: int = 2
    mem_fraction: float = 0.9
    served_model: str = "meta-llama/Meta-Llama-3-70B-Instruct"  # the model_name label
    #: A scale model's k (``whatif.scale``; 1 for every catalogue scenario): the admission caps
    #: an engine sizes by default are divided by it, as its pool and arrivals are.
    scale: float = 1.0

    @property
    def pool_tokens(self) -> int:
        """Pool tokens per GPU as ``kvdiag capacity`` computes them (weights out of the static
        fraction), so the simulated pool is the one the capacity command predicts."""
        spec = capacity.model(self.model)
        gpu = capacity.GPUS[self.gpu]
        pool_bytes, _ = capacity.pool_from_memory(spec, self.tp, gpu.memory_bytes, self.mem_fraction, spec.weight_bytes(2))
        return pool_bytes // spec.kv_bytes_per_token_per_gpu(2, self.tp)

    def roofline(self) -> Roofline:
        return Roofline(self.model, self.gpu, tp=self.tp)


LLAMA70_TP2 = Deployment()


@dataclass(frozen=True)
class Scenario:
    """A story with its knobs. ``intent`` is the label the story is built to produce; the
    expected label itself is derived from the run's ground truth (``validate.truth``), and a
    test holds the two together so a scenario cannot silently stop telling its story (either
    L1 label for an L1 intent: whether one retraction falls in the last window decides which)."""

    name: str
    story: str
    intent: tuple[str, ...]  # per DP engine
    workloads: tuple[Workload, ...]  # one per DP engine (DP = len)
    duration: float
    intent_by_engine: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # where an engine's story ends differently
    workloads_by_engine: Mapping[str, tuple[Workload, ...]] = field(default_factory=dict)  # where an engine needs its own load
    max_running: int | None = None  # SGLang --max-running-requests / vLLM --max-num-seqs
    l2_ratio: float | None = None  # host tier = ratio x L1 (HiCache / CPU offloading); None: off
    sglang_write_policy: str = "write_through"
    sglang_conservativeness: float = 1.0  # --schedule-conservativeness (scales new_token_ratio)
    restart_at: float | None = None
    deployment: Deployment = LLAMA70_TP2
    topology: Topology | None = None  # a PD pair, a hybrid pool, an LMCache tier (deployments.py)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines the story exists for (a hybrid SWA pool is SGLang's, LMCache vLLM's)."""
        return self.topology.engines if self.topology is not None else ENGINES

    @property
    def dp(self) -> int:
        return len(self.workloads)

    def intent_for(self, engine: str) -> tuple[str, ...]:
        return self.intent_by_engine.get(engine, self.intent)

    def workloads_for(self, engine: str) -> tuple[Workload, ...]:
        return self.workloads_by_engine.get(engine, self.workloads)


def make_scheduler(scenario: Scenario, engine: str, store: KVStore | None = None) -> Callable[[], EngineScheduler]:
    """A factory of fresh engines for ``scenario`` (called again on restart), wrapped by its
    topology where it has one."""
    topo = scenario.topology
    if topo is None:
        return _make_engine(scenario, engine, scenario.deployment.pool_tokens, store)
    if engine not in topo.engines:
        raise ValueError(f"{scenario.name} exists for {', '.join(topo.engines)}, not {engine}")
    pool = topo.pool_tokens(scenario.deployment)
    make, roofline = _make_engine(scenario, engine, pool, store), scenario.deployment.roofline()
    return lambda: topo.wrap(make(), engine, roofline, pool)


#: The served context (``--context-length`` / ``max_model_len``) of every scenario's engine.
CONTEXT_LEN = 32768
#: vLLM's ``max_num_seqs`` where a scenario sets no cap (its default on the GPUs simulated).
VLLM_MAX_NUM_SEQS = 1024


def _make_engine(scenario: Scenario, engine: str, pool: int, store: KVStore | None) -> Callable[[], EngineScheduler]:
    k = scenario.deployment.scale
    if engine == "sglang":
        return lambda: SGLangScheduler(
            max_total_num_tokens=pool,
            max_running_requests=scenario.max_running or _scaled_cap(default_max_running_requests(round(pool * k), CONTEXT_LEN), k),
            context_len=CONTEXT_LEN,
            enable_hierarchical_cache=scenario.l2_ratio is not None,
            hicache_ratio=scenario.l2_ratio or 2.0,
            hicache_write_policy=scenario.sglang_write_policy,
            schedule_conservativeness=scenario.sglang_conservativeness,
            store=store,
        )
    if engine == "vllm":
        blocks = pool // BLOCK_SIZE + 1
        return lambda: VLLMScheduler(
            num_gpu_blocks=blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=scenario.max_running or _scaled_cap(VLLM_MAX_NUM_SEQS, k),
            kv_offloading_blocks=int((blocks - 1) * scenario.l2_ratio) if scenario.l2_ratio else 0,
            store=store,
        )
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")


def _scaled_cap(cap: int, k: float) -> int:
    """An engine's default admission cap in a scale model of 1/k (``cap`` itself at full size),
    so that a cap that binds at full size binds in the model too."""
    return max(1, math.ceil(cap / k))


@dataclass
class ScenarioRun:
    """One scenario on one engine: a ``Simulation`` per DP engine, advanced together.

    ``advance(t)`` runs every engine to simulated ``t`` (restarting them when the scenario
    says); ``exposition()`` is the server's /metrics body (DP engines in one body, as both
    engines serve them); ``scrape()`` wraps it as a recording line stamped in simulated epoch
    seconds."""

    scenario: Scenario
    engine: str
    store: KVStore | None = None
    target: str = ""
    fast: bool = True  # take runs of identical decode steps at once (exact; see types.DecodeRun)
    record_steps: bool = True  # keep each engine's per-step log (validate's ground truth reads it)
    sims: list[Simulation] = field(init=False)

    def __post_init__(self) -> None:
        make = make_scheduler(self.scenario, self.engine, self.store)
        topo = self.scenario.topology
        fast = self.fast and (topo is None or topo.fast_forward)

        def engine_loop(wl: Workload) -> Simulation:
            roofline = self.scenario.deployment.roofline()  # one per loop: a scale model's keeps state
            step_time = roofline.step_time if topo is None else topo.step_time(roofline.step_time)
            metrics = unified_metrics(roofline.kv_bytes_per_token) if topo is None else topo.metrics(self.engine)
            return Simulation(
                make, wl.requests(), step_time, metrics=metrics, record_steps=self.record_steps,
                batch_time=roofline.batch_seconds if fast else None,
            )  # fmt: skip

        self.sims = [engine_loop(wl) for wl in self.scenario.workloads_for(self.engine)]
        self.target = self.target or f"sim://{self.engine}/{self.scenario.name}"
        self._restart_pending = self.scenario.restart_at

    @property
    def now(self) -> float:
        return min(s.now for s in self.sims)

    def advance(self, t: float) -> None:
        if self._restart_pending is not None and t >= self._restart_pending:
            for sim in self.sims:
                sim.run_until(self._restart_pending)
                sim.restart()
            self._restart_pending = None
        for sim in self.sims:
            sim.run_until(t)

    def exposition(self, dialect: str | None = None, openmetrics: bool = False, shared_lmcache: bool = False) -> str:
        """The server's /metrics body; ``shared_lmcache`` adds an LMCache tier's families, as when
        vLLM and LMCache share one multiprocess directory."""
        if shared_lmcache and not isinstance(self.scenario.topology, LMCacheTier):
            raise ValueError(f"{self.scenario.name} has no LMCache tier to share vLLM's /metrics with")
        with contextlib.ExitStack() as stack:
            for sim in self.sims:
                stack.enter_context(sim.lock)
            states = [sim.state() for sim in self.sims]
            lmcache = [sim.scheduler.lmcache for sim in self.sims] if shared_lmcache else None  # type: ignore[attr-defined]
            return emit.render(
                self.engine, states, dialect=dialect, openmetrics=openmetrics, escape=openmetrics,
                model=self.scenario.deployment.served_model, lmcache=lmcache,
            )  # fmt: skip

    def side_targets(self, openmetrics: bool = False) -> dict[str, str]:
        """The deployment's other /metrics bodies, by role: a PD pair's prefill instance
        (``prefill``), LMCache's own exporter (``lmcache``). Empty for a unified server."""
        topo = self.scenario.topology
        model = self.scenario.deployment.served_model
        with contextlib.ExitStack() as stack:
            for sim in self.sims:
                stack.enter_context(sim.lock)
            if isinstance(topo, PDPair):
                states = [sim.scheduler.prefill_state(sim.state().created) for sim in self.sims]  # type: ignore[attr-defined]
                return {"prefill": emit.render(self.engine, states, openmetrics=openmetrics, model=model)}
            if isinstance(topo, LMCacheTier):
                return {"lmcache": lmcache_text(self.sims, model, openmetrics)}
            return {}

    def follow_wall_clock(
        self,
        speed: float,
        duration: float,
        stop: threading.Event,
        lagging: Callable[[float], None] | None = None,
        ahead: Callable[[], float] | None = None,
    ) -> None:
        """Advance simulated time in step with wall time x ``speed`` from now until ``duration``
        (or ``stop``), for a live server. Calls ``lagging(seconds behind)`` once when the
        simulator cannot keep up (simulated time then lags behind). ``ahead()``, where given, is
        the furthest the story may be now: the demo holds each engine one scrape ahead of what
        its exporter has read, so that an exporter starved on a busy machine slows the story
        instead of reading it in jumps; held time is not caught up afterwards."""
        last = time.monotonic()
        story = 0.0  # where wall time x speed, less the holds, has taken the story
        warned = False
        while not stop.is_set():
            now = time.monotonic()
            story += (now - last) * speed
            last = now
            if ahead is not None:
                story = min(story, ahead())
            target = min(story, duration)
            self.advance(target)
            if target >= duration:
                return
            behind = story + (time.monotonic() - last) * speed - self.now
            if behind > 10 * speed * TICK_S and not warned and lagging is not None:
                lagging(behind)
                warned = True
            stop.wait(TICK_S)

    def scrapes(self, interval: float, dialect: str | None = None, until: float | None = None) -> Iterator[tuple[float, Scrape]]:
        """(simulated t, scrape) every ``interval`` simulated seconds up to ``until`` (default:
        the scenario's duration)."""
        end = self.scenario.duration if until is None else until
        k = 1
        while k * interval <= end + 1e-9:
            t = k * interval
            self.advance(t)
            yield t, Scrape(EPOCH + t, self.target, content_type(False), self.exposition(dialect))
            k += 1


# ---------------------------------------------------------------- the catalogue
def _chat(arrivals: Arrivals, seed: int = 1) -> Workload:
    """Chat-like requests (~1k-token prompts, 70 % of them one of 4 system prompts, ~150-token
    answers, max_new_tokens = the answer's length): the seed's load."""
    return Workload(arrivals, LogNormal(1000, 0.4, hi=4000), LogNormal(150, 0.5, hi=600), prefix=SharedPrefix(4, 0.7), seed=seed)


def _short_answers(peak: float) -> Workload:
    """The seed's prompts with 5-token answers, ramping from 1 to ``peak`` req/s (20-60 s)."""
    return Workload(Ramp(((0.0, 1.0), (20.0, 1.0), (60.0, peak))), LogNormal(1000, 0.4, hi=4000), Fixed(5),
                    prefix=SharedPrefix(4, 0.7), seed=31)


SATURATION_RAMP = Ramp(((0.0, 1.0), (20.0, 1.0), (60.0, 14.0)))

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "l1-saturation",
            "The seed's story: chat load (~1k-token prompts, 70 % of each one of 4 system prompts; answers with a "
            "long tail, median ~250 tokens, a few past 1k, max_new_tokens = the answer) ramps from 1 to 14 req/s "
            "(20-60 s) until L1 saturates: admission blocks on KV, the queue grows, running requests are evicted and "
            "recomputed (vLLM preempts; SGLang retracts whenever the long answers' decode growth outruns the output "
            "reserve its decayed new_token_ratio keeps, then re-estimates the ratio and decays again), P99 TTFT "
            "collapses, the hit ratio stays high and the big L2 tier stays mostly empty (host memory at 64x L1, "
            "room for every prompt vLLM's write-through offloading stores over the run; SGLang copies only prefixes "
            "a second request reuses). Right after a retraction SGLang's raised reserve unpins the pool for a while "
            "(l1_kv_pressure), and it pins again.",
            ("l1_kv_bottleneck",),
            (Workload(SATURATION_RAMP, LogNormal(1000, 0.4, hi=4000), LogNormal(250, 0.7, hi=2000),
                      prefix=SharedPrefix(4, 0.7), seed=1),),
            duration=330.0,
            l2_ratio=64.0,
            sglang_write_policy="write_through_selective",
        ),
        Scenario(
            "long-answers",
            "The seed's story with long answers (~400-token prompts, ~1k-token answers, max_new_tokens = the "
            "answer): decode grows the running requests faster than finishing ones free the pool, so SGLang, "
            "admitting against its decayed new_token_ratio, retracts and recomputes, as vLLM preempts. The "
            "queue grows and P99 TTFT collapses on both engines.",
            ("l1_kv_bottleneck",),
            (Workload(Ramp(((0.0, 0.3), (20.0, 0.3), (60.0, 4.0))), LogNormal(400, 0.4, hi=1600), LogNormal(1000, 0.5, hi=4000),
                      prefix=SharedPrefix(4, 0.7), seed=1),),
            duration=330.0,
        ),
        Scenario(
            "near-capacity",
            "Fixed-size requests arriving like clockwork hold the pool at ~97 % with no backlog and no "
            "eviction: at capacity, not yet limiting. SGLang cannot be held there: its admission keeps "
            "room for the running requests' reserved output (new_token_ratio) and for the next request's "
            "whole max_new_tokens, so its highest stable load leaves the pool ~20 % free and is healthy.",
            ("near_kv_capacity",),
            (Workload(Periodic(9.75), Fixed(100), Fixed(400), seed=3),),
            duration=330.0,
            intent_by_engine={"sglang": ("healthy",)},
            workloads_by_engine={"sglang": (Workload(Periodic(6.5), Uniform(50, 150), Uniform(300, 500), seed=3),)},
        ),
        Scenario(
            "sequence-cap",
            "max_running_requests / max_num_seqs = 8 caps concurrency while the pool has room: the queue "
            "grows with L1 mostly free.",
            ("queue_without_kv_pressure",),
            (_chat(Poisson(4.0)),),
            duration=300.0,
            max_running=8,
        ),
        Scenario(
            "cold-compute",
            "Unique ~3k-token prompts with one-token answers (scoring, classification) arrive faster than "
            "prefill compute can process them: a cold cache, a compute-bound queue, and a pool with room.",
            ("queue_without_kv_pressure",),
            (Workload(Poisson(3.2), LogNormal(3000, 0.3, hi=8000), Fixed(1), seed=5),),
            duration=300.0,
        ),
        Scenario(
            "l2-helps",
            "24 long system prompts that do not all fit L1 beside the running requests: the L2 tier keeps "
            "the evicted ones and loads them back (against the same run without L2: mean TTFT -35 % in the "
            "light phase, -11 % overall), but admission still counts L1 only, so under overload P99 TTFT "
            "stays ~15x the SLO (L2 trims it by ~10 %): L1 is the bottleneck.",
            ("l1_kv_bottleneck",),
            (Workload(Ramp(((0.0, 2.0), (40.0, 2.0), (100.0, 12.0))), LogNormal(2000, 0.3, hi=6000), LogNormal(120, 0.5, hi=500),
                      prefix=SharedPrefix(24, 0.8), seed=7),),
            duration=330.0,
            l2_ratio=2.0,
        ),
        Scenario(
            "restart",
            "A burst evicts requests early, the load then drops, and the engine restarts mid-run: every "
            "counter restarts from zero, which must not read as new evictions.",
            ("healthy",),
            (_chat(Ramp(((0.0, 16.0), (25.0, 16.0), (26.0, 2.0)))),),
            duration=360.0,
            restart_at=220.0,
        ),
        Scenario(
            "dp2-one-hot",
            "Data parallelism 2 with an unbalanced router: engine 0 takes an overload and saturates its L1, "
            "engine 1 idles along. Two instances, two verdicts.",
            ("l1_kv_bottleneck", "healthy"),
            (_chat(SATURATION_RAMP), _chat(Poisson(1.0), seed=12)),
            duration=330.0,
        ),
        Scenario(
            "ramp-slow",
            "The seed's load ramping slowly, 1 to 10 req/s over two minutes: L1 fills late and gradually; "
            "the checks must name it once admission blocks, not before (no false alarm on the way up).",
            ("l1_kv_bottleneck",),
            (_chat(Ramp(((0.0, 1.0), (20.0, 1.0), (140.0, 10.0))), seed=21),),
            duration=330.0,
        ),
        Scenario(
            "ramp-fast",
            "A flash crowd: 1 req/s jumps to 40 req/s within five seconds at +30 s. L1 pins at once and the queue "
            "explodes, so P99 TTFT breaches the SLO within seconds of the pool pinning: L1 must be named within "
            "a few scrapes. Even SGLang's admission reserve cannot keep up: it retracts too.",
            ("l1_kv_bottleneck",),
            (_chat(Ramp(((0.0, 1.0), (30.0, 1.0), (35.0, 40.0))), seed=22),),
            duration=240.0,
        ),
        Scenario(
            "short-answers",
            "Shared-prefix ~1k-token prompts with 5-token answers (extraction, routing) ramping to 30 req/s: vLLM's "
            "pool binds without a single preemption (a request lives a few steps, so none outgrows its blocks), "
            "admission is refused at most steps and the queue grows, yet the usage gauge reads 0.77-0.85: vLLM "
            "reads it after the step's finished requests free their blocks, which the next admission refills at "
            "once (admission usage adds that room). SGLang, whose admission reserve keeps room, is compute-bound at "
            "the same 30 req/s: a queue without KV pressure; it retracts once at ~90 s, which proves the pool ran out "
            "then, not that it limits the minutes after.",
            ("l1_kv_pressure",),
            (_short_answers(30.0),),
            duration=330.0,
            intent_by_engine={"sglang": ("queue_without_kv_pressure",)},
        ),
        Scenario(
            "noisy-healthy",
            "Short requests arriving in Poisson bursts at a moderate load: the queue wanders between 0 and a few "
            "requests and the pool has room. Jitter, not a trend: healthy at every instant.",
            ("healthy",),
            (Workload(Poisson(6.0), LogNormal(300, 0.5, hi=1500), LogNormal(80, 0.5, hi=400), seed=24),),
            duration=300.0,
        ),
        Scenario(
            "restart-light",
            "A light load (1 req/s) and an engine restart at +150 s: counters and gauges start again from zero, "
            "which must read as neither evictions nor a queue.",
            ("healthy",),
            (_chat(Poisson(1.0), seed=25),),
            duration=300.0,
            restart_at=150.0,
        ),
        Scenario(
            "closed-loop",
            "120 clients in a closed loop (each sends its next request the moment its answer returns, as benchmarks "
            "and many gateways do) with the seed's prompts and 150-450-token answers run to their length (ignore_eos, "
            "the real engines' stories): the "
            "pool holds ~60 of them, so the queue stands at 120 minus running for the whole run, wandering a few "
            "requests up and down, never growing. vLLM admits against the requests' real lengths and preempts as "
            "they grow. SGLang reserves every running request's whole remaining output (ignore_eos: ratio 1, "
            "whatever its exported new_token_ratio says) and the next one's whole answer: admission is refused "
            "while its usage gauge reads 0.82-0.97.",
            ("l1_kv_bottleneck",),
            (Workload(ClosedLoop(120), LogNormal(1000, 0.4, hi=4000), Uniform(150, 450),
                      prefix=SharedPrefix(4, 0.7), ignore_eos=True, seed=51),),
            duration=240.0,
            intent_by_engine={"sglang": ("l1_kv_pressure",)},
        ),
        Scenario(
            "eos-answers",
            "Clients ask for max_tokens 2,048 and get chat answers of ~250 tokens (they stop at EOS), 100 clients in a "
            "closed loop. vLLM allocates what requests hold, not what they ask for. SGLang charges each admitted "
            "request its whole max_new_tokens and keeps new_token_ratio x the rest for every running one: the "
            "reserve, not the requests, fills its pool.",
            ("l1_kv_bottleneck",),
            (Workload(ClosedLoop(100), LogNormal(1000, 0.4, hi=4000), LogNormal(250, 0.7, hi=1500),
                      prefix=SharedPrefix(4, 0.7), max_new_tokens=2048, seed=52),),
            duration=240.0,
        ),
        Scenario(
            "recovery",
            "The seed's overload (1 to 14 req/s, 20-60 s) held until +120 s, then the load falls to 0.5 req/s: the "
            "queue drains and the pool empties. L1 while it binds, healthy again within a minute of the recovery "
            "(the evictions still in the window are transient by then).",
            ("healthy",),
            (_chat(Ramp(((0.0, 1.0), (20.0, 1.0), (60.0, 14.0), (120.0, 14.0), (130.0, 0.5))), seed=26),),
            duration=360.0,
        ),
    )
}


# ---------------------------------------------------------------- deployments (issue 17)
GEMMA3_27B_H100 = Deployment(model="gemma-3-27b", gpu="h100", tp=1, served_model="google/gemma-3-27b-it")
_HYBRID_PROMPT, _HYBRID_OUTPUT = LogNormal(500, 0.3, hi=700), LogNormal(150, 0.5, hi=300)
HybridSWA.check(GEMMA3_27B_H100.model, _HYBRID_PROMPT.hi + _HYBRID_OUTPUT.hi)

#: Stories of the deployments beyond one unified pool (refpool/deployments.py), each on the
#: engines it exists for. Kept apart from ``SCENARIOS`` (the unified-pool catalogue every
#: engine runs) so that catalogue-wide suites keep their shape; ``get`` and the commands take both.
DEPLOYMENTS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "pd-decode-pool",
            "The decode instance of a PD pair under long requests (~4k-token prompts, ~1.5k-token answers): decode "
            "growth fills its pool, requests the prefill instance would compute wait for decode room (SGLang's "
            "prealloc queue, vLLM's waiting for capacity) and running requests are retracted / preempted. SGLang's "
            "num_queue_reqs stays near 0 (the backlog is in num_decode_prealloc_queue_reqs), and its usage reads "
            "~0.9 while preallocation is refused: it keeps 512 tokens per running, transferring and waiting request "
            "out of it. The answer is decode capacity, not prefill.",
            ("l1_kv_bottleneck",),
            (Workload(Ramp(((0.0, 0.1), (20.0, 0.1), (60.0, 1.0))), LogNormal(4000, 0.3, hi=8000), LogNormal(1500, 0.5, hi=4000),
                      prefix=SharedPrefix(4, 0.5), seed=41),),
            duration=180.0,
            topology=PDPair(),
        ),
        Scenario(
            "pd-kv-transfer",
            "A vLLM decode instance (TP 2) whose KV links have degraded to 0.15 GB/s per GPU (a TCP fallback): "
            "prompts' KV arrives slower than requests do, so they wait in WAITING_FOR_REMOTE_KVS (reason=deferred) holding their "
            "blocks, the capacity queue stays empty and the pool keeps room. A queue without KV pressure whose "
            "cause is the transfer, not the admission limit.",
            ("queue_without_kv_pressure",),
            (Workload(Ramp(((0.0, 1.0), (20.0, 1.0), (40.0, 5.5))), LogNormal(200, 0.3, hi=600), LogNormal(100, 0.5, hi=400), seed=42),),
            duration=135.0,
            topology=PDPair(link_bytes_per_s=0.15e9, engines=("vllm",)),
        ),
        Scenario(
            "hybrid-swa",
            "Gemma 3 27B (5 sliding-window layers to 1 global) on SGLang with --swa-full-tokens-ratio 0.6: the "
            "SWA pool is the smaller one, so under a ramp it pins at ~0.98 while the full-attention pool sits "
            "near 0.6. token_usage (the larger of the two) names L1; the pool that binds is the SWA one.",
            ("l1_kv_bottleneck",),
            (Workload(Ramp(((0.0, 1.0), (20.0, 1.0), (60.0, 16.0))), _HYBRID_PROMPT, _HYBRID_OUTPUT, seed=43),),
            duration=180.0,
            deployment=GEMMA3_27B_H100,
            topology=HybridSWA(swa_full_tokens_ratio=0.6),
        ),
        Scenario(
            "lmcache-underused",
            "vLLM with LMCache's CPU tier (64x the GPU pool) under the seed's saturation ramp: admission counts "
            "GPU blocks only, so L1 binds while LMCache's lookups find mostly the shared prefixes the GPU pool "
            "holds too: it retrieves a few percent of the prompt tokens and its local cache stays mostly empty. "
            "The tier cannot fix P99: L1 is the bottleneck.",
            ("l1_kv_bottleneck",),
            (_chat(SATURATION_RAMP, seed=44),),
            duration=180.0,
            l2_ratio=64.0,
            topology=LMCacheTier(),
        ),
    )
}

#: Every story, by name.
CATALOGUE: dict[str, Scenario] = {**SCENARIOS, **DEPLOYMENTS}


def get(name: str, mem_fraction: float | None = None) -> Scenario:
    """A scenario by name; ``mem_fraction`` re-sizes its pool (the deployment's static memory
    fraction), to replay a story on a tighter or roomier L1."""
    try:
        scenario = CATALOGUE[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(CATALOGUE)}") from None
    if mem_fraction is None:
        return scenario
    return replace(scenario, deployment=replace(scenario.deployment, mem_fraction=mem_fraction))
