"""Per-instance time series of PoolSamples: resets, increases, rates and quantiles.

The checks never look at raw counters: they ask a Window for the increase of a counter over
a span (reset-safe: a restarted engine starts again from zero, and the new value counts as
the increase since the restart, exactly as Prometheus' ``increase()`` without extrapolation),
for the points of a gauge, or for a histogram quantile computed as
``histogram_quantile(q, rate(h_bucket[w]))`` computes it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Iterable
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

from kvdiag.model import COUNTER_FIELDS, HISTOGRAM_FIELDS, NUMERIC_FIELDS, PARTS, Histogram, PoolSample, Provenance

#: Each part counter to its whole (hits to queries), from the model's (part, whole) pairs.
_WHOLE = {part: whole for part, whole in PARTS if part in COUNTER_FIELDS and whole in COUNTER_FIELDS}

#: The scheduler's gauges, which an engine publishes together from one snapshot of its state.
#: A scrape in which they read an empty engine that its own request counter says cannot be
#: empty (``empty_readings``) is a snapshot of nothing: these fields are absent at it.
SCHEDULER_GAUGES = ("usage_ratio", "used_tokens", "evictable_tokens", "available_tokens", "running", "waiting",
                    "waiting_capacity", "waiting_deferred", "transfers_in_flight")  # fmt: skip


#: An engine is believed empty only where it generated nothing for at least this long: two
#: scrapes milliseconds apart (a late scrape and the next, a sampler catching up) see no tokens
#: between them from an engine that is generating hundreds a second.
QUIET_S = 1.0


def empty_readings(ts: np.ndarray, running: np.ndarray, waiting: np.ndarray, usage: np.ndarray, finished: np.ndarray,
                   generated: np.ndarray) -> np.ndarray:  # fmt: skip
    """Scrapes whose scheduler gauges read an empty engine (nothing running or waiting, the
    pool's usage 0 or absent) although the engine generated tokens since the scrape before and
    the requests in it at the last believable scrape have not all finished since (``finished``,
    the finished-request counter, rose by less than their number, and did not restart).
    Requests leave an engine only by finishing, so such a reading is impossible. Seen on real
    vLLM 0.32 under a saturating closed loop scraped by Prometheus, an exporter and ``diagnose``
    at once: running, waiting and KV usage all 0 in 7 of 24 scrapes while its counters kept
    rising, which otherwise reads a pinned pool as idle. An engine that generated nothing since
    the latest scrape at least ``QUIET_S`` before (the one before, where none is that old) is
    believed empty (clients that all went away, where an engine does not count aborts)."""
    out = np.zeros(len(running), dtype=bool)
    if not ((running == 0) & (waiting == 0)).any():
        return out  # the common case, and the window is re-read at every evaluation: no loop
    held: float | None = None  # requests in the engine at the last believable scrape
    done_then = math.nan  # the finished counter then
    made = pd.Series(generated).ffill().to_numpy()  # the generated-token counter as last read
    before = -1  # the latest scrape at least QUIET_S before this one
    for i in range(len(running)):
        r, w, u, f, g = float(running[i]), float(waiting[i]), float(usage[i]), float(finished[i]), float(generated[i])
        while before + 1 < i and ts[before + 1] <= ts[i] - QUIET_S:
            before += 1
        ref = before if before >= 0 else i - 1
        working = ref >= 0 and made[ref] < g
        if math.isnan(r) or math.isnan(w):
            continue
        empty = r == 0 and w == 0 and (math.isnan(u) or u == 0)
        if empty and working and held and not math.isnan(done_then) and done_then <= f < done_then + held:
            out[i] = True
            continue
        held, done_then = r + w, f
    return out


@dataclass(frozen=True)
class QuantileEstimate:
    """A histogram quantile and the bucket bounds it was interpolated between."""

    value: float
    lower: float  # the bucket's lower bound (0 for the first bucket)
    upper: float  # the bucket's upper bound (+Inf when the rank falls in the last bucket)
    observations: float  # observations in the window


#: A counter that drops to at most this fraction of its last value restarted: the engine came
#: back from zero and counted for at most one scrape interval since. A smaller drop is no
#: restart (counters only grow) but an impossible sample, left out of every increase.
RESTART_FRACTION = 0.5


def counter_step(prev: float | None, value: float) -> float | None:
    """What a counter's new sample adds after ``prev``, its last valid sample.

    The difference; the whole value after a restart (a drop to a small value) or for the
    first sample; None when the sample is impossible (a decrease that is no restart).
    """
    if prev is None:
        return value
    if value >= prev:
        return value - prev
    if value <= prev * RESTART_FRACTION:
        return value
    return None


def counter_steps(values: np.ndarray, bridge: bool = False) -> np.ndarray:
    """What a counter column added over each interval ending at a scrape (``counter_step``):
    element ``i`` is the interval ending at scrape ``i``; NaN at the first reading, at an absent
    or impossible one, and at the interval after a gap, unless ``bridge``: then that interval
    counts the rise since the last possible reading (a missed scrape loses nothing)."""
    out = np.full(len(values), np.nan)
    prev: float | None = None
    for i, v in enumerate(values):
        if math.isnan(v):
            prev = prev if bridge else None
            continue
        step = counter_step(prev, float(v)) if prev is not None else None
        if step is not None:
            out[i] = step
        if not bridge or prev is None or step is not None:  # a bridge skips an impossible reading
            prev = float(v)
    return out


def counter_valid(values: np.ndarray) -> np.ndarray:
    """Which samples of a cumulative series (NaNs already removed) are possible values."""
    keep = np.ones(len(values), dtype=bool)
    if len(values) < 2 or not (np.diff(values) < 0).any():
        return keep  # the common case: a counter that only grew
    prev = float(values[0])
    for i in range(1, len(values)):
        v = float(values[i])
        if counter_step(prev, v) is None:
            keep[i] = False
        else:
            prev = v
    return keep


def counter_increase(values: np.ndarray) -> float:
    """Reset-safe increase of a cumulative series (NaNs already removed).

    A restart (``counter_step``) counts the value after it as the increase since the restart;
    an impossible sample is left out; so neither yields a negative or an inflated increase.
    """
    return _increase(values[counter_valid(values)])


def _increase(values: np.ndarray) -> float:
    """``counter_increase`` of a series whose samples are all possible (a Window's column)."""
    if len(values) < 2:
        return 0.0
    deltas = np.diff(values)
    return float(np.where(deltas < 0, values[1:], deltas).sum())


def count_resets(values: np.ndarray) -> int:
    """Restarts in a cumulative series (impossible samples are no restarts)."""
    if len(values) < 2:
        return 0
    return int((np.diff(values[counter_valid(values)]) < 0).sum())


def bucket_quantile(q: float, bounds: tuple[float, ...], counts: np.ndarray) -> QuantileEstimate | None:
    """Prometheus' bucketQuantile over cumulative bucket counts (the last bound is +Inf)."""
    if len(bounds) < 2:
        return None
    counts = np.maximum.accumulate(np.asarray(counts, dtype=float))  # Prometheus' ensureMonotonic
    total = float(counts[-1])
    if total <= 0 or math.isnan(total):
        return None
    if q < 0:
        return QuantileEstimate(-math.inf, -math.inf, -math.inf, total)
    if q > 1:
        return QuantileEstimate(math.inf, math.inf, math.inf, total)
    rank = q * total
    b = int(np.searchsorted(counts[:-1], rank, side="left"))
    if b == len(bounds) - 1:
        return QuantileEstimate(bounds[-2], bounds[-2], math.inf, total)
    if b == 0 and bounds[0] <= 0:
        return QuantileEstimate(bounds[0], bounds[0], bounds[0], total)
    start, end, in_bucket = 0.0, bounds[b], float(counts[b])
    if b > 0:
        start = bounds[b - 1]
        in_bucket -= float(counts[b - 1])
        rank -= float(counts[b - 1])
    return QuantileEstimate(start + (end - start) * (rank / in_bucket), start, end, total)


#: A histogram field over a window: (bounds, ts, bucket counts per row, sums, counts).
HistogramColumns = tuple[tuple[float, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def resolve_writers(prev: PoolSample | None, sample: PoolSample) -> None:
    """Read a per-process gauge (``PoolSample.writers``) as its most recent writer.

    Without a multiprocess mode each process keeps its own series, and one that stopped
    writing (idle, or dead: its file stays) keeps its last value, so the max over processes can
    be any old value. A scrape carries no write times; what history shows is when a process's
    value changed, so the pid whose value changed most recently (or that appeared most recently)
    is the writer, and ties (processes that wrote together) take the max. Before any change is
    seen (a single scrape, or processes that all stand still) the figure is ambiguous: the max
    stays, and the provenance says so. A sample is resolved once, against the one before it
    (``prev``, itself resolved), so windows over parts of a series agree.
    """
    for name, values in sample.writers.items():
        if name in sample.writer_changed:
            continue
        before = prev.writers.get(name) if prev is not None else None
        changed = dict(prev.writer_changed.get(name, {})) if prev is not None else {}
        changed = {pid: t for pid, t in changed.items() if pid in values}
        if before is not None or (prev is not None and getattr(prev, name) is not None):
            for pid, v in values.items():
                if before is None or pid not in before or before[pid] != v:
                    changed[pid] = sample.ts
        sample.writer_changed[name] = changed
        src = sample.provenance.get(name)
        if src is None:
            continue
        spread = ", ".join(f"pid {pid}={v:g}" for pid, v in sorted(values.items()))
        if changed:
            newest = max(changed.values())
            pid, v = max(((p, values[p]) for p, t in changed.items() if t == newest), key=lambda x: x[1])
            how = f"written per process ({spread}); pid {pid} changed its value most recently: taken"
            setattr(sample, name, v)
            _rescale(sample, name, v, f"pid {pid}'s {name} (most recent writer)")
        else:
            how = (f"written per process ({spread}); no process has changed its value yet, so which wrote last is "
                   "ambiguous: the max is taken")
        sample.provenance[name] = replace(src, note="; ".join(x for x in (src.note, how) if x))


def _rescale(sample: PoolSample, name: str, value: float, whose: str) -> None:
    """Re-derive the fields ``sample.scaled`` derives from gauge ``name``, now ``value``, so
    that they say what the gauge says (not what the max over processes said)."""
    for derived, (source, factor) in sample.scaled.items():
        src = sample.provenance.get(derived)
        if source == name and src is not None and not src.invalid:
            sample.set(derived, value * factor, replace(src, note="; ".join(x for x in (src.note, "from " + whose) if x)))


class Window:
    """One instance's samples over a span, oldest first.

    Built from PoolSamples (the CLI's sources), or from columns an exporter already keeps
    (``from_columns``: no object per sample, so re-evaluating a long window stays cheap).
    Either way the checks read the same columns.
    """

    def __init__(self, instance: str, samples: Iterable[PoolSample]) -> None:
        self.instance = instance
        self._samples: list[PoolSample] | None = sorted(samples, key=lambda s: s.ts)
        if not self._samples:
            raise ValueError(f"window for {instance} has no samples")
        for prev, sample in zip([None, *self._samples[:-1]], self._samples):
            if sample.writers:
                resolve_writers(prev, sample)
        self._last = self._samples[-1]
        self._frame: pd.DataFrame | None = None
        self._columns: dict[str, np.ndarray] = {}
        self._hists: dict[str, HistogramColumns | None] = {}
        self._valid: dict[str, np.ndarray] = {}  # columns with impossible counter samples absent
        self._outgrown: dict[str, str] = {}  # part counters that outgrew their whole, and how
        self._empty: np.ndarray | None = None  # scrapes whose scheduler gauges read an impossible empty engine

    @classmethod
    def from_columns(
        cls,
        instance: str,
        ts: np.ndarray,
        columns: dict[str, np.ndarray],
        histograms: dict[str, HistogramColumns],
        last: PoolSample,
    ) -> "Window":
        """A window over columns (oldest first, NaN = absent; fields not given are absent).

        ``last`` is the newest scrape's own sample: identity, provenance and notes come from
        it, so the oldest and newest provenance are the same in such a window.
        """
        if len(ts) == 0:
            raise ValueError(f"window for {instance} has no samples")
        w = cls.__new__(cls)
        w.instance = instance
        w._samples = None
        w._last = last
        w._frame = None
        w._columns = {"ts": np.asarray(ts, dtype=float), **columns}
        w._valid = {}
        w._outgrown = {}
        w._empty = None
        w._hists = dict(histograms)
        return w

    @property
    def samples(self) -> list[PoolSample]:
        """The PoolSamples of a window built from them (a columnar window has none)."""
        if self._samples is None:
            raise TypeError("a window built from columns holds no PoolSample objects")
        return self._samples

    @property
    def last(self) -> PoolSample:
        return self._last

    @property
    def engine(self) -> str:
        return self.last.engine

    @property
    def start(self) -> float:
        return float(self.column("ts")[0])

    @property
    def end(self) -> float:
        return float(self.column("ts")[-1])

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __len__(self) -> int:
        return len(self.column("ts"))

    def since(self, start: float) -> "Window":
        """The samples from ``start`` on (the same object when none is older)."""
        if self.start >= start:
            return self
        if self._samples is not None:
            first = bisect.bisect_left(self._samples, start, key=lambda s: s.ts)
            return Window(self.instance, self._samples[first:])
        keep = self.column("ts") >= start
        columns = {name: col[keep] for name, col in self._columns.items() if name != "ts"}
        hists = {}
        for name, h in self._hists.items():
            if h is not None:
                bounds, hts, counts, sums, totals = h
                k = hts >= start
                hists[name] = (bounds, hts[k], counts[k], sums[k], totals[k])
        return Window.from_columns(self.instance, self.column("ts")[keep], columns, hists, self._last)

    def provenance(self, name: str) -> tuple[Provenance | None, Provenance | None]:
        """Where a field came from at the start and at the end of the window; a counter with
        impossible samples in the window says how many were left out."""
        last = self._last.provenance.get(name)
        if self._samples is None:
            first = last
        else:
            first = next((s.provenance[name] for s in self._samples if name in s.provenance), None)
        dropped = self.invalid_samples(name)
        whys = [f"{dropped} sample{'s' if dropped > 1 else ''} in the window decreased without a restart; left out"] if dropped else []
        empty = int(self._empty_readings().sum()) if name in SCHEDULER_GAUGES else 0
        if empty:
            whys.append(f"{empty} scrape{'s' if empty > 1 else ''} read an empty engine while its requests had not finished; left out")
        if name in _WHOLE:
            self.column(name)  # finds whether the part outgrew its whole
        if name in self._outgrown:
            whys.append(self._outgrown[name])
        if whys and last is not None:
            last = replace(last, note="; ".join([last.note] + whys if last.note else whys), invalid=name in self._outgrown)
        return first, last

    def invalid_samples(self, name: str) -> int:
        """Samples of a counter (or of a histogram's count) that decreased without a restart."""
        if name in COUNTER_FIELDS:
            reported = self._reported(name)
            vals = reported[~np.isnan(reported)]
        elif name in HISTOGRAM_FIELDS:
            built = self._histograms(name)
            vals = built[4] if built is not None else np.empty(0)
        else:
            return 0
        return int((~counter_valid(vals)).sum())

    @property
    def frame(self) -> pd.DataFrame:
        """The numeric fields as a DataFrame indexed by scrape time (absent = NaN)."""
        if self._frame is None:
            self._frame = pd.DataFrame(
                {name: self.column(name) for name in NUMERIC_FIELDS},
                index=pd.Index(self.column("ts"), name="ts"),
            )
        return self._frame

    def column(self, name: str) -> np.ndarray:
        """One field over the window as floats; absent values are NaN.

        A counter's impossible samples (``counter_valid``: a decrease that is no restart) are
        absent here too, so no statistic over the window ever counts one as a reset.
        """
        col = self._valid.get(name)
        if col is None:
            col = self._reported(name)
            if name in COUNTER_FIELDS and len(col) > 1:
                absent = np.isnan(col)
                if absent.any() or (np.diff(col) < 0).any():  # else: no gap, no drop, all possible
                    present = ~absent
                    keep = counter_valid(col[present])
                    if not keep.all():
                        col = col.copy()
                        col[np.flatnonzero(present)[~keep]] = np.nan
            whole = _WHOLE.get(name)
            if whole is not None:
                col = self._within(name, col, whole)
            if name in SCHEDULER_GAUGES and self._empty_readings().any():
                col = np.where(self._empty_readings(), np.nan, col)
            self._valid[name] = col
        return col

    def _empty_readings(self) -> np.ndarray:
        """``empty_readings`` over this window (computed once). Not judged where requests
        leave an instance without finishing there (a prefill or decode role hands them on)."""
        if self._empty is None:
            if self._last.role in ("prefill", "decode"):
                self._empty = np.zeros(len(self.column("ts")), dtype=bool)
            else:
                self._empty = empty_readings(self.column("ts"), *(self._reported(n) for n in ("running", "waiting", "usage_ratio")),
                                             self.column("requests_total"), self.column("generation_tokens_total"))  # fmt: skip
        return self._empty

    def _within(self, part: str, col: np.ndarray, whole: str) -> np.ndarray:
        """A part counter (hits) whose increase over the window exceeds its whole's (queries)
        would make a ratio above 1: the part is absent over the whole window, and says why."""
        part_vals, whole_vals = col[~np.isnan(col)], self.column(whole)
        whole_vals = whole_vals[~np.isnan(whole_vals)]
        if len(part_vals) < 2 or len(whole_vals) < 2:
            return col
        grew, of = _increase(part_vals), _increase(whole_vals)
        if grew <= of:
            return col
        self._outgrown[part] = f"rose by {grew:g} over the window while {whole} rose by {of:g}: a ratio above 1; not used"
        return np.full(len(col), np.nan)

    def _reported(self, name: str) -> np.ndarray:
        """One field as the samples reported it (impossible values included)."""
        col = self._columns.get(name)
        if col is None:
            if self._samples is None:
                col = np.full(len(self._columns["ts"]), np.nan)
            else:
                col = np.array([_num(getattr(s, name)) for s in self._samples], dtype=float)
            self._columns[name] = col
        return col

    def points(self, name: str, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(timestamps, values) of a field where it is present, optionally from ``since`` on."""
        ts, vals = self.column("ts"), self.column(name)
        keep = ~np.isnan(vals)
        if since is not None:
            keep &= ts >= since
        return ts[keep], vals[keep]

    def has(self, name: str) -> bool:
        return bool((~np.isnan(self.column(name))).any())

    def increase(self, name: str, since: float | None = None) -> float | None:
        """Reset-safe increase of a counter field; None when it was never reported."""
        _, vals = self.points(name, since)
        if len(vals) == 0:
            return None
        return _increase(vals)  # the column holds possible samples only

    def resets(self, name: str) -> int:
        return count_resets(self.points(name)[1])

    def rate(self, name: str, since: float | None = None) -> float | None:
        ts, vals = self.points(name, since)
        if len(vals) < 2 or ts[-1] <= ts[0]:
            return None
        return _increase(vals) / float(ts[-1] - ts[0])

    def _histograms(self, name: str) -> HistogramColumns | None:
        """(bounds, ts, bucket counts, sums, counts) of a histogram field, built once per window.

        Only samples with the newest sample's bucket layout take part (an upgrade may change
        the bounds)."""
        cached = self._hists.get(name)
        if cached is not None or name in self._hists or self._samples is None:
            return cached
        hists = [(s.ts, getattr(s, name)) for s in self._samples if getattr(s, name) is not None]
        out = None
        if hists:
            bounds = hists[-1][1].bounds
            same = [(t, h) for t, h in hists if h.bounds == bounds]
            out = (
                bounds,
                np.array([t for t, _ in same], dtype=float),
                np.array([h.counts for _, h in same], dtype=float),
                np.array([h.sum for _, h in same], dtype=float),
                np.array([h.count for _, h in same], dtype=float),
            )
        self._hists[name] = out
        return out

    def histogram_increase(self, name: str, since: float | None = None) -> Histogram | None:
        """Reset-safe increase of a cumulative histogram field over the window.

        A restart is an interval where the observation count or any bucket dropped; every
        bucket then counts its value after the restart, so a bucket that refilled past its old
        count is not undercounted.
        """
        built = self._histograms(name)
        if built is None:
            return None
        bounds, ts, counts, sums, totals = built
        keep = counter_valid(totals)
        if since is not None:
            keep &= ts >= since
        counts, sums, totals = counts[keep], sums[keep], totals[keep]
        if len(totals) == 0:
            return None
        if len(totals) == 1:
            return Histogram(bounds, tuple(0.0 for _ in bounds), 0.0, 0.0)
        deltas = np.diff(counts, axis=0)
        reset = (np.diff(totals) < 0) | (deltas < 0).any(axis=1)
        inc = np.where(reset[:, None], counts[1:], deltas).sum(axis=0)
        total_inc = float(np.where(reset, totals[1:], np.diff(totals)).sum())
        sum_inc = float(np.where(reset, sums[1:], np.diff(sums)).sum())
        return Histogram(bounds, tuple(float(x) for x in inc), sum_inc, total_inc)

    def histogram_steps(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(end time, sum added, count added) of a histogram field over each interval between
        its samples; an interval with a restart counts what came after it. None: never reported
        or a single sample."""
        built = self._histograms(name)
        if built is None:
            return None
        _, ts, _, sums, totals = built
        keep = counter_valid(totals)
        ts, sums, totals = ts[keep], sums[keep], totals[keep]
        if len(ts) < 2:
            return None
        reset = np.diff(totals) < 0
        return ts[1:], np.where(reset, sums[1:], np.diff(sums)), np.where(reset, totals[1:], np.diff(totals))

    def quantile(self, q: float, name: str, since: float | None = None) -> QuantileEstimate | None:
        """``histogram_quantile(q, rate(name_bucket[window]))`` for this instance."""
        h = self.histogram_increase(name, since)
        if h is None:
            return None
        return bucket_quantile(q, h.bounds, np.array(h.counts))


def _num(v: object) -> float:
    if v is None:
        return math.nan
    return float(v)  # type: ignore[arg-type]


#: What a KV tier's own exporter (a ``tier_only`` sample) brings to the engine instance it joins;
#: its hits and lookups are the tier's own count, so they replace what the engine attributes to
#: host memory, and the rest fills what the engine does not report.
TIER_COUNTS = ("l2_hit_tokens_total", "l2_query_tokens_total")
TIER_FIELDS = TIER_COUNTS + ("l2_used_tokens", "l2_capacity_tokens", "l2_load_bytes_total", "l2_store_bytes_total",
                             "l2_dropped_tokens_total", "l3_hit_tokens_total")
#: A tier sample joins an engine scrape at most this far apart in time (one sampling round).
JOIN_SECONDS = 60.0


def join_tiers(samples: Iterable[PoolSample]) -> list[PoolSample]:
    """Fold each tier-only sample into the engine samples of the same model (``join_tier``); a
    tier no engine instance serves stays its own instance, so that it is reported (unknown: it
    has no pool) rather than lost."""
    samples = list(samples)
    tiers: dict[str | None, list[PoolSample]] = {}
    for s in samples:
        if s.tier_only:
            tiers.setdefault(s.model, []).append(s)
    if not tiers:
        return samples
    joined: set[int] = set()
    for s in samples:
        if not s.tier_only and s.model in tiers:
            t = join_tier(s, tiers[s.model])
            if t is not None:
                joined.add(id(t))
    return [s for s in samples if not s.tier_only or id(s) not in joined]


def join_tier(engine: PoolSample, tiers: Iterable[PoolSample]) -> PoolSample | None:
    """Fold into one engine sample the tier-only sample that belongs to it: same model, same
    host (``_same_host``), the nearest in time within ``JOIN_SECONDS``; the one joined, or None.
    The CLI joins a recording's samples with it, the exporter each scrape with the newest
    sample of every tier target it scrapes."""
    candidates = _same_host(engine, [t for t in tiers if t.tier_only and t.model == engine.model])
    if not candidates:
        return None
    t = min(candidates, key=lambda x: abs(x.ts - engine.ts))
    if abs(t.ts - engine.ts) > JOIN_SECONDS:
        return None
    for name in TIER_FIELDS:
        v = getattr(t, name)
        if v is not None and (name in TIER_COUNTS or getattr(engine, name) is None):
            src = t.provenance[name]
            engine.set(name, v, replace(src, note="; ".join(x for x in (src.note, f"joined by model from {t.instance.split(' ')[0]}") if x)))
    engine.l2_tier = t.l2_tier or engine.l2_tier
    return t


def _host(instance: str) -> str | None:
    return urlsplit(instance.split(" ")[0]).hostname


def _same_host(engine: PoolSample, tiers: list[PoolSample]) -> list[PoolSample]:
    """The tier samples that belong to this engine: those on its host; where none is, those of
    the one tier target serving the model (several replicas' tiers elsewhere cannot be paired)."""
    host = _host(engine.instance)
    local = [t for t in tiers if _host(t.instance) == host]
    if local:
        return local
    return tiers if len({t.instance for t in tiers}) == 1 else []


def windows(samples: Iterable[PoolSample], seconds: float | None = None) -> dict[str, Window]:
    """Group samples by instance (a KV tier's own samples joined to their engine instance,
    ``join_tiers``); keep only the last ``seconds`` of each when given."""
    by_instance: dict[str, list[PoolSample]] = {}
    for s in join_tiers(samples):
        by_instance.setdefault(s.instance, []).append(s)
    out = {}
    for inst, group in by_instance.items():
        if seconds is not None:
            newest = max(s.ts for s in group)
            group = [s for s in group if s.ts >= newest - seconds]
        out[inst] = Window(inst, group)
    return out
