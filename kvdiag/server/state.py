"""One target's state and one scrape of it: fetch, normalize, keep, evaluate (no scheduling).

Everything a scrape can go wrong with (timeout, HTTP error, a body over the cap, a body that
does not parse, a server that is no engine, and a bug of kvdiag's own at any stage: reading,
normalizing, checking) ends in this target's state as ``up = False`` or an ``unknown``
verdict, with the reason; nothing propagates to other targets, and an unexpected error's
traceback is logged once per target and kind, not on every scrape. A restarted engine is seen as counters that
dropped: the window's increases are reset-safe, and the exported eviction counter adds the
post-restart value instead of going backwards (what Prometheus' ``increase()`` assumes).

A KV tier's own exporter (LMCache's /metrics) is a target of its own with no pool: each engine
scrape takes the newest sample of the tier serving its model on its host (``join``, the CLI's
``kvdiag.window.join_tier``), so the tier shows on the engine instance's verdict, and the
tier's own instance is shown through it (``InstanceState.joined``) rather than as an unknown.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from threading import Lock
from typing import Callable

from kvdiag.config import Config
from kvdiag.engines import TooManyInstances, UnknownEngine, normalize_scrape
from kvdiag.exposition import ExpositionError
from kvdiag.model import Diagnosis, PoolSample
from kvdiag.server.ring import Ring
from kvdiag.server.targets import Target
from kvdiag.sources.scrape import MAX_REDIRECTS, Auth, ScrapeError, Vet, scrape
from kvdiag.window import JOIN_SECONDS, Window, counter_step, join_tier

log = logging.getLogger("kvdiag.serve")

Diagnose = Callable[[Window, Config], Diagnosis]
Undiagnosable = Callable[[str, str, float], Diagnosis]
#: The instances of a KV tier's own exporter an engine scrape may join (the loop's other targets').
Tiers = Callable[[], list["InstanceState"]]

#: The TTFT quantile published as kvdiag_ttft_p99_seconds (the checks' own quantile is a setting).
P99 = 0.99


@dataclass(frozen=True)
class ScrapeOptions:
    """What every scrape of this exporter shares."""

    timeout: float
    max_bytes: int
    auth: Auth | None
    config: Config  # the checks' thresholds and window
    capacity: int  # ring rows per instance
    evaluate_every: float  # seconds between two evaluations of one instance
    redirects: int = MAX_REDIRECTS
    vet: Vet | None = None  # /probe: the allowlist vets every hop and pins its addresses


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
    joined_to: str | None = None  # a KV tier's instance: the engine instance that took its last sample
    joined_at: float = float("-inf")  # that engine sample's time

    def joined(self, now: float) -> bool:
        """A KV tier's instance whose samples an engine instance took within ``JOIN_SECONDS``:
        its figures are on that instance's verdict, so it has no verdict of its own."""
        return self.joined_to is not None and now - self.joined_at <= JOIN_SECONDS

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
    up: bool = False
    error: str | None = None
    duration: float | None = None  # seconds the last scrape took
    last_scrape: float | None = None  # unix time the last finished attempt started
    last_success: float | None = None
    failure: Diagnosis | None = None  # the answer while no instance could be read
    instances: dict[str, InstanceState] = field(default_factory=dict)
    busy: bool = False  # a scrape is in flight (at most one per target)
    lock: Lock = field(default_factory=Lock)
    logged: set[str] = field(default_factory=set)  # unexpected errors whose traceback was logged

    @property
    def url(self) -> str:
        return self.target.url


def scrape_into(state: TargetState, opts: ScrapeOptions, diagnose: Diagnose, undiagnosable: Undiagnosable, tiers: Tiers | None = None) -> None:
    """Scrape one target once and update its state; never raises for a target's fault. Its
    engine samples join the KV tiers ``tiers`` returns (``join``)."""
    start, started_at = time.monotonic(), time.time()
    try:
        auth = Auth.with_userinfo(opts.auth, state.target.basic)
        got = scrape(state.url, opts.timeout, opts.max_bytes, auth=auth, redirects=opts.redirects, vet=opts.vet)
        samples = normalize_scrape(got, state.engine)  # at most engines.MAX_INSTANCES instances
        if tiers is not None:
            join(samples, tiers())
    except (ScrapeError, ExpositionError, UnknownEngine, TooManyInstances) as exc:
        _fail(state, str(exc), start, started_at, undiagnosable)
        return
    except Exception as exc:  # a bug in kvdiag must not stop the loop; say so, once
        _fail(state, internal_error(state, "reading the scrape", exc), start, started_at, undiagnosable)
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
            evaluate(state, inst, opts.config, diagnose, undiagnosable)
    for gone in set(state.instances) - seen:  # e.g. a restart with fewer data-parallel ranks
        del state.instances[gone]


def join(samples: list[PoolSample], tiers: list[InstanceState]) -> None:
    """Fold into each engine sample the newest sample of the KV tier instance that belongs to it
    (``kvdiag.window.join_tier``: same model, same host, within ``JOIN_SECONDS``) and mark that
    instance joined to it."""
    newest = [(inst, inst.latest) for inst in tiers]
    owners = {id(sample): inst for inst, sample in newest if sample is not None and sample.tier_only}
    candidates = [sample for inst, sample in newest if sample is not None and id(sample) in owners]
    for s in samples:
        if s.tier_only:
            continue
        t = join_tier(s, candidates)
        if t is not None:
            owners[id(t)].joined_to, owners[id(t)].joined_at = s.instance, s.ts


def evaluate(state: TargetState, inst: InstanceState, config: Config, diagnose: Diagnose, undiagnosable: Undiagnosable) -> None:
    """Run the checks on the instance's window; a check that fails makes the instance
    ``unknown`` with the reason (not a stale verdict that looks current)."""
    window = inst.window(config)
    if window is None:
        return
    try:
        inst.diagnosis = diagnose(window, config)
        q = window.quantile(P99, "ttft", window.end - config.window)
        inst.ttft_p99 = q.value if q is not None else None
    except Exception as exc:
        inst.diagnosis = undiagnosable(inst.key, internal_error(state, "running the checks", exc), window.end)
        inst.ttft_p99 = None
    inst.evaluated_at = window.end


def internal_error(state: TargetState, stage: str, exc: BaseException) -> str:
    """The reason shown for a bug of kvdiag's own at ``stage`` of one target; its traceback is
    logged the first time this target meets this kind of error, a one-line debug after."""
    reason = f"internal error {stage}: {type(exc).__name__}: {exc}"
    key = f"{stage}:{type(exc).__name__}"
    if key in state.logged:
        log.debug("%s: %s", state.url, reason)
    else:
        state.logged.add(key)
        log.error("%s: %s (traceback logged once per target and kind)", state.url, reason, exc_info=exc)
    return reason


def _fail(state: TargetState, reason: str, start: float, started_at: float, undiagnosable: Undiagnosable) -> None:
    changed = reason != state.error
    state.duration, state.last_scrape = time.monotonic() - start, started_at
    state.up, state.error = False, reason
    state.failure = undiagnosable(state.url, reason, started_at)
    log.log(logging.INFO if changed else logging.DEBUG, "scrape of %s failed: %s", state.url, reason)


def fresh_instances(state: TargetState, config: Config, now: float) -> list[InstanceState]:
    """The target's instances whose newest sample is still inside the window: their verdicts
    stand while a scrape or two fails, and go once the window holds nothing of them."""
    return [i for i in list(state.instances.values()) if i.latest is not None and now - i.latest.ts <= config.window]
