"""The background scrape loop: every target once per interval, at its own phase, bounded.

One scheduler thread keeps a heap of due times and hands due targets to a fixed pool of
``concurrency`` worker threads; the network wait is where scraping spends its time, and the
GIL is released there. Each target is due at the same phase of every interval (a stable hash
of its URL spreads the fleet evenly over the interval, as Prometheus spreads its scrapes), so
samples are evenly spaced and load is smooth. A target whose previous scrape is still running
is skipped, not queued: a hung target holds at most one worker until its deadline (the whole
scrape, connect to last byte, see ``kvdiag.sources.scrape``), and everyone else keeps their
schedule. ``/probe`` targets live in a separate, size-bounded table with their own windows,
scraped when Prometheus asks, on a worker pool of their own (``probe.concurrency``): a flood
of probes of a target that never answers fills that pool and is turned away (503), and never
reaches the scrape workers or the threads that serve /healthz, /metrics and the API. A KV
tier's own exporter joins the engines of the same table (configured with configured, probed with
probed; ``kvdiag.server.state.join``).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Iterable
from urllib.parse import urlsplit

from kvdiag import checks
from kvdiag.server.settings import Settings
from kvdiag.server.state import Diagnose, InstanceState, ScrapeOptions, TargetState, Undiagnosable, scrape_into
from kvdiag.server.targets import FileSD, Target, combine
from kvdiag.sources.scrape import next_due

log = logging.getLogger("kvdiag.serve")

#: How often file_sd files are checked for changes (Prometheus' default refresh is 5 m; a
#: stat() per file is cheap, so kvdiag looks more often).
FILE_SD_REFRESH_S = 10.0
#: Distinct /probe targets remembered at once; the least recently probed is forgotten first,
#: and any not probed for a whole window (its window would be empty anyway).
MAX_PROBES = 2_000
#: Extra ring rows beyond window / interval, for jitter in scrape times.
RING_SLACK = 2
#: Each instance is evaluated at least this many times per window. The checks' cost grows
#: with the window's length while a verdict over a long window moves slowly, so a 1 h window
#: is evaluated every 150 s rather than every 15 s (see bench/bench_serve.py).
EVALUATIONS_PER_WINDOW = 24


def phase(url: str) -> float:
    """A stable fraction in [0, 1) per URL: where in each interval the target is scraped."""
    digest = hashlib.blake2b(url.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def options(settings: Settings) -> ScrapeOptions:
    """The per-scrape options implied by the settings (ring rows cover the checks' window)."""
    s = settings.scrape
    return ScrapeOptions(
        timeout=s.effective_timeout,
        max_bytes=s.max_bytes,
        auth=s.auth,
        config=settings.checks,
        capacity=math.ceil(settings.checks.window / s.interval) + RING_SLACK,
        evaluate_every=max(s.evaluate_every, settings.checks.window / EVALUATIONS_PER_WINDOW),
    )


class ProbeBusy(RuntimeError):
    """Every probe worker is taken: the caller is told to come back (HTTP 503)."""


class ScrapeLoop:
    """Configured targets scraped in the background, plus on-demand probe targets."""

    def __init__(
        self,
        settings: Settings,
        diagnose: Diagnose = checks.diagnose,
        undiagnosable: Undiagnosable = checks.undiagnosable,
    ) -> None:
        self.settings = settings
        self.opts = options(settings)
        # probes: evaluated on every probe, no scrape.auth, every redirect hop vetted
        self.probe_opts = replace(self.opts, evaluate_every=0.0, auth=None, vet=settings.probe.allowlist.addresses)
        self.diagnose = diagnose
        self.undiagnosable = undiagnosable
        self.targets: dict[str, TargetState] = {}
        self.probes: OrderedDict[str, TargetState] = OrderedDict()
        self.file_sd = [FileSD(p) for p in settings.file_sd]
        self._heap: list[tuple[float, int, TargetState]] = []  # (due, tie-breaker, target)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # guards targets, probes and the heap
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(settings.scrape.concurrency, thread_name_prefix="kvdiag-scrape")
        self._probe_pool = ThreadPoolExecutor(settings.probe.concurrency, thread_name_prefix="kvdiag-probe")
        self._probe_slots = threading.BoundedSemaphore(settings.probe.concurrency)
        self._thread = threading.Thread(target=self._run, name="kvdiag-scheduler", daemon=True)
        self._next_sd = 0.0
        # The targets whose last scrape was a KV tier's own exporter, per table (False: configured,
        # True: probed), so that an engine scrape's join looks at those alone, not the whole fleet.
        self._tier_states: dict[bool, dict[str, TargetState]] = {False: {}, True: {}}
        self.refresh_targets()

    # --- targets -------------------------------------------------------------------------

    def refresh_targets(self) -> None:
        """Re-read changed file_sd files and bring the scraped set in line with the config."""
        for f in self.file_sd:
            f.refresh()
            if f.error:
                log.warning("file_sd: %s (keeping its previous targets)", f.error)
        self.set_targets(combine(self.settings.targets, self.file_sd, self.settings.shard))

    def set_targets(self, targets: Iterable[Target]) -> None:
        wanted = {t.url: t for t in targets}
        now = time.monotonic()
        interval = self.settings.scrape.interval
        with self._lock:
            for url in set(self.targets) - set(wanted):
                del self.targets[url]
            for url, target in wanted.items():
                state = self.targets.get(url)
                if state is None:
                    state = self.targets[url] = TargetState(target)
                    heapq.heappush(self._heap, (now + phase(url) * interval, next(self._seq), state))
                elif state.target != target:
                    state.target = target  # new labels, same URL: keep the window
        self._wake.set()

    @property
    def ready(self) -> bool:
        """Every configured target has finished at least one scrape (successful or not)."""
        with self._lock:
            return all(s.last_scrape is not None for s in self.targets.values())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def snapshot(self, probes: bool = False) -> list[TargetState]:
        """The configured targets' states (or the probed ones), safe to iterate."""
        with self._lock:
            return list((self.probes if probes else self.targets).values())

    def tiers(self, probes: bool = False) -> list[InstanceState]:
        """The instances of KV tiers' own exporters among the configured targets (or the probed
        ones): what an engine scrape of the same table joins."""
        with self._lock:
            table = self.probes if probes else self.targets
            live = self._tier_states[probes] = {u: s for u, s in self._tier_states[probes].items() if table.get(u) is s}
            states = list(live.values())
        return [i for s in states for i in list(s.instances.values()) if i.latest is not None and i.latest.tier_only]

    def _index_tier(self, state: TargetState, probes: bool) -> None:
        """Keep ``state`` among the tiers' exporters while its scrapes are a tier's, not after."""
        tier = any(i.latest is not None and i.latest.tier_only for i in list(state.instances.values()))
        with self._lock:
            if tier:
                self._tier_states[probes][state.url] = state
            else:
                self._tier_states[probes].pop(state.url, None)

    # --- running -------------------------------------------------------------------------

    def start(self) -> "ScrapeLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            self._schedule()
        except Exception:  # /healthz then answers 503; say why once, with the traceback
            log.exception("the scrape loop stopped")
            raise

    def _schedule(self) -> None:
        interval = self.settings.scrape.interval
        while not self._stop.is_set():
            now = time.monotonic()
            if self.file_sd and now >= self._next_sd:
                self._next_sd = now + FILE_SD_REFRESH_S
                self.refresh_targets()
            with self._lock:
                while self._heap and self._heap[0][0] <= now:
                    due, _, state = heapq.heappop(self._heap)
                    if self.targets.get(state.url) is not state:
                        continue  # removed from the config (perhaps added again since: a new state)
                    if not state.busy:
                        state.busy = True
                        self._pool.submit(self._job, state)
                    heapq.heappush(self._heap, (next_due(due, now, interval), next(self._seq), state))
                wait = (self._heap[0][0] - now) if self._heap else FILE_SD_REFRESH_S
            if self.file_sd:
                wait = min(wait, self._next_sd - now)
            self._wake.wait(max(0.0, wait))
            self._wake.clear()

    def _job(self, state: TargetState) -> None:
        try:
            with state.lock:
                scrape_into(state, self.opts, self.diagnose, self.undiagnosable, self.tiers)
                self._index_tier(state, probes=False)
        finally:
            state.busy = False

    # --- /probe --------------------------------------------------------------------------

    @property
    def probe_deadline(self) -> float:
        """Seconds a probe may take in all: waiting for an earlier probe of the same URL,
        then its own scrape."""
        return 2 * self.opts.timeout

    def submit_probe(self, target: str, engine: str = "auto", timeout: float | None = None) -> "Future[TargetState]":
        """Check and scrape ``target`` on a probe worker; ProbeBusy when every worker is taken.
        The future raises ProbeInvalid / ProbeRefused for a target the allowlist refuses (the
        check resolves names, so it runs on the worker too, never on the caller's thread)."""
        if not self._probe_slots.acquire(blocking=False):
            raise ProbeBusy(f"all {self.settings.probe.concurrency} probe workers are busy (probe.concurrency)")
        try:
            future = self._probe_pool.submit(self.probe, target, engine, timeout)
        except RuntimeError:  # shut down
            self._probe_slots.release()
            raise ProbeBusy("the exporter is stopping") from None
        future.add_done_callback(lambda _: self._probe_slots.release())
        return future

    def probe(self, target: str, engine: str = "auto", timeout: float | None = None) -> TargetState:
        """Check ``target`` against the allowlist, scrape it now and return its state; the
        scrape's deadline is ``timeout`` when the caller (Prometheus) gives a shorter one.

        Each probed URL keeps its own window, evaluated on every probe since each probe is a
        Prometheus scrape; probes of the same URL take turns, and one that cannot get its
        turn within the scrape timeout returns the state as the previous probe left it.
        Credentials go only to hosts a ``probe.auth`` entry names; every redirect hop is
        vetted by the allowlist like the target itself.
        """
        url = self.settings.probe.allowlist.check(target)
        now = time.time()
        with self._lock:
            state = self.probes.get(url)
            if state is None:
                state = self.probes[url] = TargetState(Target(url))
            self.probes.move_to_end(url)
            while self.probes:
                oldest = next(iter(self.probes.values()))
                stale = oldest.last_scrape is not None and now - oldest.last_scrape > self.settings.checks.window
                if len(self.probes) <= MAX_PROBES and not stale:
                    break
                self.probes.popitem(last=False)
        deadline = min(self.opts.timeout, timeout) if timeout is not None else self.opts.timeout
        if not state.lock.acquire(timeout=deadline):
            return state
        try:
            state.engine = engine
            opts = replace(self.probe_opts, timeout=deadline, auth=self.settings.probe.auth_for(urlsplit(url).hostname or ""))
            scrape_into(state, opts, self.diagnose, self.undiagnosable, lambda: self.tiers(probes=True))
            self._index_tier(state, probes=True)
        finally:
            state.lock.release()
        return state
