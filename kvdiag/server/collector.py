"""``/metrics`` (and ``/probe``): kvdiag's answers as Prometheus series, built per scrape.

A prometheus_client custom collector: every Prometheus scrape reads the current target states
and writes fresh families, with no timers and no timestamps (the exporter guidelines). Names
follow the guidelines: ``kvdiag_`` prefix, no colons, base units (tokens, requests, seconds),
ratios 0-1. Instantaneous figures come from the newest sample and appear only while the
target is up; figures computed over the window (verdict, checks, hit ratio, P99, ceiling) are
refreshed by the background loop after scrapes, not at /metrics time, as their HELP says.
Every per-instance series carries ``instance``, ``engine``, ``model`` and the target's extra
labels. Each target is rendered on its own: one whose data cannot be rendered shows
``kvdiag_up 0`` and the ``unknown`` verdict (the API says why), and the others are unaffected.
What a deployment beyond one unified pool needs is there too: the role and the KV tier below L1
(``kvdiag_instance_info``), every queue by what it waits for, each pool of a hybrid model and
the one that binds, the tier's occupancy and hits. A KV tier's own exporter that an engine
instance joined shows only its health: its figures are on that instance.
"""

from __future__ import annotations

import platform
import time
from typing import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvdiag import __version__
from kvdiag.checks.catalog import CHECKS, VERDICTS
from kvdiag.config import Config
from kvdiag.server.state import InstanceState, TargetState, fresh_instances, internal_error

#: (name, type, help) of every kvdiag family, in exposition order.
FAMILIES = (
    ("kvdiag_up", "gauge", "1 if the last scrape of the engine succeeded and held engine metrics, else 0."),
    ("kvdiag_scrape_duration_seconds", "gauge", "Seconds the last scrape of the engine took."),
    ("kvdiag_kv_pool_tokens", "gauge", "KV pool (L1) tokens by state, only the states the engine reports apart."),
    ("kvdiag_kv_usage_ratio", "gauge", "Active (non-evictable) share of the KV pool as the engine reports it, 0-1."),
    ("kvdiag_kv_admission_usage_ratio", "gauge", "Share of the KV pool admission counts as taken: active usage + the room the next admission needs (uncached prompt; output and the running requests' output reserve where the engine reserves it), 0-1; computed by the background loop after scrapes."),
    ("kvdiag_kv_capacity_tokens", "gauge", "KV pool (L1) capacity in tokens."),
    ("kvdiag_instance", "info", "The instance's disaggregation role (prefill | decode | unified; empty where its series do not say) and the KV tier below its L1 (l2_tier; empty where none is exported), as labels; the value is 1."),
    ("kvdiag_waiting_requests", "gauge", "Requests in the engine's waiting queues (every queue of its role, those deferred for something other than room included)."),
    ("kvdiag_queue_requests", "gauge", "Requests in each of the instance's queues as its engine names it (queue, without the explanation the API gives), by what they wait for (kind: capacity = room in this pool or batch; deferred = something else first, e.g. their KV transfer; in_flight = KV on the wire, not waiting)."),
    ("kvdiag_kv_pool_usage_ratio", "gauge", "Usage of each KV pool of a hybrid model (pool: full | swa | mamba), 0-1; a model with one pool has none."),
    ("kvdiag_kv_binding_pool", "gauge", "1 for the pool of a hybrid model that admission runs out of first (the fullest), 0 for its other pools."),
    ("kvdiag_l2_usage_ratio", "gauge", "The KV tier below L1 (L2): used / capacity, where the tier exports both, 0-1."),
    ("kvdiag_l2_hit_ratio", "gauge", "L2 hit tokens / the tier's own lookups (else queried tokens) over the checks' window, where the tier exports hits; computed by the background loop after scrapes."),
    ("kvdiag_running_requests", "gauge", "Requests the engine is running."),
    ("kvdiag_evictions", "counter", "Running requests retracted (SGLang) or preempted (vLLM) and recomputed; engine restarts are corrected, the counter never decreases."),
    ("kvdiag_prefix_hit_ratio", "gauge", "Prefix-cache hit tokens / queried tokens over the checks' window; computed by the background loop after scrapes."),
    ("kvdiag_ttft_p99_seconds", "gauge", "P99 time to first token over the checks' window from the engine's histogram; computed by the background loop after scrapes."),
    ("kvdiag_concurrency_ceiling", "gauge", "Requests the KV pool can hold: pool tokens / average tokens per request; computed by the background loop after scrapes."),
    ("kvdiag_check_status", "gauge", "1 if the check fires, 0 if it does not; absent when unknown. Computed by the background loop after scrapes."),
    ("kvdiag_verdict", "gauge", "1 for the instance's current verdict, 0 for the others. Computed by the background loop after scrapes."),
)
POOL_STATES = ("used", "evictable", "available")


class ExporterCollector(Collector):
    """The kvdiag families for the target states ``source`` returns at collect time."""

    def __init__(self, source: Callable[[], list[TargetState]], config: Config, build_info: bool = True) -> None:
        self.source = source
        self.config = config
        self.build_info = build_info

    def collect(self) -> Iterator[Metric]:
        fams = {name: Metric(name, doc, kind) for name, kind, doc in FAMILIES}
        now = time.time()
        for state in self.source():
            mark = {name: len(f.samples) for name, f in fams.items()}
            try:
                instances = fresh_instances(state, self.config, now)
                if instances:
                    for inst in instances:
                        _instance(fams, state, inst, now)
                else:
                    _unreached(fams, state)
            except Exception as exc:
                internal_error(state, "rendering /metrics", exc)
                for name, f in fams.items():
                    del f.samples[mark[name] :]
                _unreached(fams, state, force=True)
        yield from fams.values()
        if self.build_info:
            info = Metric("kvdiag_build", "kvdiag's version, as labels; the value is 1.", "info")
            info.add_sample("kvdiag_build_info", {"version": __version__, "python_version": platform.python_version()}, 1.0)
            yield info


def _labels(state: TargetState, instance: str, engine: str, model: str | None) -> dict[str, str]:
    return {"instance": instance, "engine": engine, "model": model or "", **state.target.label_dict}


def _put(fams: dict[str, Metric], name: str, labels: dict[str, str], value: float | int | None, sample: str | None = None) -> None:
    if value is not None:
        fams[name].add_sample(sample or name, labels, float(value))


def _instance(fams: dict[str, Metric], state: TargetState, inst: InstanceState, now: float) -> None:
    latest = inst.latest
    assert latest is not None  # fresh_instances only returns instances with samples
    labels = _labels(state, inst.key, latest.engine, latest.model)
    _put(fams, "kvdiag_up", labels, 1 if state.up else 0)
    _put(fams, "kvdiag_scrape_duration_seconds", labels, state.duration)
    if inst.joined(now):
        return  # a KV tier's own exporter: its figures are on the engine instance that joined it
    _put(fams, "kvdiag_instance", {**labels, "role": latest.role or "", "l2_tier": latest.l2_tier or ""}, 1, "kvdiag_instance_info")
    if state.up:
        for pool_state in POOL_STATES:
            _put(fams, "kvdiag_kv_pool_tokens", {**labels, "state": pool_state}, getattr(latest, f"{pool_state}_tokens"))
        _put(fams, "kvdiag_kv_usage_ratio", labels, latest.usage_ratio)
        _put(fams, "kvdiag_kv_capacity_tokens", labels, latest.capacity_tokens)
        _put(fams, "kvdiag_waiting_requests", labels, latest.waiting)
        _put(fams, "kvdiag_running_requests", labels, latest.running)
        _put(fams, "kvdiag_evictions", labels, inst.evictions_total, "kvdiag_evictions_total")
        for queue in latest.queues:
            _put(fams, "kvdiag_queue_requests", {**labels, "queue": queue.name.split(" (")[0], "kind": queue.kind}, queue.requests)
        binding = latest.binding_pool
        for pool in latest.pools:
            _put(fams, "kvdiag_kv_pool_usage_ratio", {**labels, "pool": pool.kind}, pool.usage_ratio)
            _put(fams, "kvdiag_kv_binding_pool", {**labels, "pool": pool.kind}, 1 if pool is binding else 0)
        if latest.l2_used_tokens is not None and latest.l2_capacity_tokens:
            _put(fams, "kvdiag_l2_usage_ratio", labels, latest.l2_used_tokens / latest.l2_capacity_tokens)
    diagnosis = inst.diagnosis
    if diagnosis is None:
        return
    saturated = diagnosis.checks.get("kv_usage_saturated")
    _put(fams, "kvdiag_kv_admission_usage_ratio", labels, _number(saturated.evidence.values.get("admission_usage_last")) if saturated else None)
    prefix = diagnosis.checks.get("prefix_hit_high")
    _put(fams, "kvdiag_prefix_hit_ratio", labels, _number(prefix.evidence.values.get("hit_ratio")) if prefix else None)
    l2 = diagnosis.checks.get("l2_underused")
    _put(fams, "kvdiag_l2_hit_ratio", labels, _number(l2.evidence.values.get("l2_hit_share")) if l2 else None)
    _put(fams, "kvdiag_ttft_p99_seconds", labels, inst.ttft_p99)
    _put(fams, "kvdiag_concurrency_ceiling", labels, _number(diagnosis.figures.get("ceiling")))
    for check in CHECKS:
        result = diagnosis.checks.get(check.name)
        if result is not None and result.status != "unknown":
            _put(fams, "kvdiag_check_status", {**labels, "check": check.name}, 1 if result.status == "firing" else 0)
    _verdict(fams, labels, diagnosis.verdict.name)


def _unreached(fams: dict[str, Metric], state: TargetState, force: bool = False) -> None:
    """A target with no instance in the window (down, or never an engine) or one that cannot
    be rendered (``force``): up 0, verdict unknown."""
    if state.last_scrape is None and not force:
        return  # not scraped yet: no answer rather than a false "down"
    labels = _labels(state, state.url, "", None)
    _put(fams, "kvdiag_up", labels, 0)
    _put(fams, "kvdiag_scrape_duration_seconds", labels, state.duration)
    _verdict(fams, labels, "unknown")


def _verdict(fams: dict[str, Metric], labels: dict[str, str], current: str) -> None:
    for name in VERDICTS:
        _put(fams, "kvdiag_verdict", {**labels, "verdict": name}, 1 if name == current else 0)


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
