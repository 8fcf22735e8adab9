"""One target's state and one scrape of it: fetch, normalize, keep, evaluate (no scheduling).

Everything a scrape can go wrong with (timeout, HTTP error, a body over the cap, a body that
does not parse, a server that is no engine) ends in this target's state as ``up = False`` and
a reason; nothing propagates to other targets. A restarted engine is seen as counters that
dropped: the window's increases are reset-safe, and the exported eviction counter adds the
post-restart value instead of going backwards (what Prometheus' ``increase()`` assumes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from threading import Lock
from typing import Callable

import requests

from kvdiag.config import Config
from kvdiag.engines import TooManyInstances, UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError
from kvdiag.model import Diagnosis, PoolSample
from kvdiag.server.ring import Ring
from kvdiag.server.targets import Target
from kvdiag.sources.scrape import Auth, ScrapeError, scrape
from kvdiag.window import Window, counter_step

log = logging.getLogger("kvdiag.serve")

Diagnose = Callable[[Window, Config], Diagnosis]
Undiagnosable = Callable[[str, str, float], Diagnosis]

#: The TTFT quantile published as kvdiag_ttft_p99_seconds (the checks' own quantile is a setting).
P99 = 0.99
#: Instances (data-parallel ranks) one target may hold; each costs a window of memory, so a
#: body with thousands of label values is refused rather than allowed to exhaust it.
MAX_INSTANCES_PER_TARGET = 256


@dataclass(frozen=True)
class ScrapeOptions:
    """What every scrape of this exporter shares."""

    timeout: float
    max_bytes: int
    auth: Auth | None
    config: Config  # the checks' thresholds and window
    capacity: int  # ring rows per instance
    evaluate_every: float  # seconds between two evaluations of one instance


@dataclass
class InstanceState:
    """One engine instance (a DP rank of a target): its window and its latest answers."""

    key: str
    ring: Ring
    evictions_total: float | None = None  # reset-corrected: never decreases while kvdiag runs
    _evictions_seen: float | None = None
    diagnosis: Diagnosis | None = None
    ttft_p99: float | None = None
    evaluated_at: float = float("-inf")

    @property
    def latest(self) -> PoolSample | None:
        return self.ring.latest

    def ingest(self, sample: PoolSample) -> None:
        self.ring.append(sample)
        seen = sample.evictions_total
        if seen is None:
            return
        step = counter_step(self._evictions_seen, seen)
        if step is None:  # decreased without a restart: an impossible sample, not counted
            return
        self.evictions_total = (self.evictions_total or 0.0) + step
        self._evictions_seen = seen

    def window(self, config: Config) -> Window | None:
        latest = self.ring.latest
        if latest is None:
            return None
        return self.ring.window(self.key, since=latest.ts - config.window)


@dataclass
class TargetState:
    """One scraped URL: health of its last scrape and the instances it serves."""

    target: Target
    engine: str = "auto"
    session: requests.Session = field(default_factory=requests.Session)
    up: bool = False
    error: str | None = None
    duration: float | None = None  # seconds the last scrape took
    last_scrape: float | None = None  # unix time the last finished attempt started
    last_success: float | None = None
    failure: Diagnosis | None = None  # the answer while no instance could be read
    instances: dict[str, InstanceState] = field(default_factory=dict)
    busy: bool = False  # a scrape is in flight (at most one per target)
    lock: Lock = field(default_factory=Lock)

    @property
    def url(self) -> str:
        return self.target.url


def scrape_into(state: TargetState, opts: ScrapeOptions, diagnose: Diagnose, undiagnosable: Undiagnosable) -> None:
    """Scrape one target once and update its state; never raises for a target's fault."""
    start, started_at = time.monotonic(), time.time()
    try:
        got = scrape(state.url, opts.timeout, opts.max_bytes, session=state.session, auth=opts.auth)
        samples = normalize_scrape(got, state.engine, MAX_INSTANCES_PER_TARGET)
    except (ScrapeError, ExpositionError, UnknownEngine, TooManyInstances) as exc:
        _fail(state, str(exc), start, started_at, undiagnosable)
        return
    except Exception as exc:  # a bug in kvdiag must not stop the loop; say so loudly
        log.exception("scrape of %s failed unexpectedly", state.url)
        _fail(state, f"internal error: {type(exc).__name__}: {exc}", start, started_at, undiagnosable)
        return
    state.duration, state.last_scrape = time.monotonic() - start, started_at
    state.up, state.error, state.failure, state.last_success = True, None, None, got.ts
    seen = set()
    for sample in samples:
        inst = state.instances.get(sample.instance)
        if inst is None:
            inst = state.instances[sample.instance] = InstanceState(sample.instance, Ring(opts.capacity))
        inst.ingest(sample)
        seen.add(sample.instance)
        if got.ts - inst.evaluated_at >= opts.evaluate_every:
            evaluate(inst, opts.config, diagnose)
    for gone in set(state.instances) - seen:  # e.g. a restart with fewer data-parallel ranks
        del state.instances[gone]


def evaluate(inst: InstanceState, config: Config, diagnose: Diagnose) -> None:
    """Run the checks on the instance's window; a failing check keeps the previous answer."""
    window = inst.window(config)
    if window is None:
        return
    try:
        inst.diagnosis = diagnose(window, config)
        q = window.quantile(P99, "ttft", window.end - config.window)
        inst.ttft_p99 = q.value if q is not None else None
    except Exception:
        log.exception("checks failed on %s", inst.key)
    inst.evaluated_at = window.end


def _fail(state: TargetState, reason: str, start: float, started_at: float, undiagnosable: Undiagnosable) -> None:
    state.duration, state.last_scrape = time.monotonic() - start, started_at
    state.up, state.error = False, reason
    state.failure = undiagnosable(state.url, reason, started_at)
    log.info("scrape of %s failed: %s", state.url, reason)


def fresh_instances(state: TargetState, config: Config, now: float) -> list[InstanceState]:
    """The target's instances whose newest sample is still inside the window: their verdicts
    stand while a scrape or two fails, and go once the window holds nothing of them."""
    return [i for i in list(state.instances.values()) if i.latest is not None and now - i.latest.ts <= config.window]
