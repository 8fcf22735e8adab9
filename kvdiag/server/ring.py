"""A fixed-size, columnar ring of one instance's samples: memory bounded by the window.

An exporter keeps every instance's window for days. PoolSample objects are convenient but
heavy (a dict of fields, boxed floats, provenance): thousands of instances times a 1 h window
of them would not fit in a gigabyte. The ring stores each numeric field the engine reports as
a preallocated float64 column (NaN = absent, as in ``Window.column``; fields the engine never
reports take no room), and only the histograms the checks read, so memory is flat from the
first full window on. When the checks run, the rows inside the window are turned back into
PoolSamples; the newest one is the scrape's own object, with its provenance and notes.
"""

from __future__ import annotations

from dataclasses import fields
from threading import Lock

import numpy as np

from kvdiag.checks.catalog import CHECKS
from kvdiag.model import NUMERIC_FIELDS, Histogram, PoolSample

_HISTOGRAMS = {f.name for f in fields(PoolSample) if f.name in ("ttft", "queue_time")}
#: The histogram fields some check reads; the others are not kept (each costs ~25 columns).
CHECKED_HISTOGRAMS = tuple(dict.fromkeys(f for c in CHECKS for f in c.needs if f in _HISTOGRAMS))


class _HistogramColumn:
    """One histogram field over the ring: bucket counts per row for one bucket layout.

    A new layout (an engine upgrade changing its buckets) starts the column afresh, as
    ``Window.histogram_increase`` ignores samples with other bounds anyway.
    """

    def __init__(self, capacity: int, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.data = np.full((capacity, len(bounds) + 2), np.nan)  # counts..., sum, count

    def put(self, row: int, h: Histogram | None) -> None:
        if h is None:
            self.data[row] = np.nan
        else:
            self.data[row, :-2] = h.counts
            self.data[row, -2:] = (h.sum, h.count)


class Ring:
    """The last ``capacity`` samples of one instance, oldest overwritten first. Thread-safe."""

    def __init__(self, capacity: int, histograms: tuple[str, ...] = CHECKED_HISTOGRAMS) -> None:
        if capacity < 1:
            raise ValueError("a ring needs room for at least one sample")
        self.capacity = capacity
        self.histogram_fields = tuple(h for h in histograms if h in _HISTOGRAMS)
        self.ts = np.full(capacity, np.nan)
        self._columns: dict[str, np.ndarray] = {}  # allocated when a field is first reported
        self._hists: dict[str, _HistogramColumn] = {}
        self.appended = 0  # samples ever appended; the next row is appended % capacity
        self.latest: PoolSample | None = None
        self.lock = Lock()

    def __len__(self) -> int:
        return min(self.appended, self.capacity)

    @property
    def nbytes(self) -> int:
        """Bytes held by the columns (fixed once the engine's fields and layouts are known)."""
        cols = sum(c.nbytes for c in self._columns.values())
        return self.ts.nbytes + cols + sum(h.data.nbytes for h in self._hists.values())

    def append(self, sample: PoolSample) -> None:
        with self.lock:
            row = self.appended % self.capacity
            self.ts[row] = sample.ts
            for name in NUMERIC_FIELDS:
                v = getattr(sample, name)
                col = self._columns.get(name)
                if col is None and v is not None:
                    col = self._columns[name] = np.full(self.capacity, np.nan)
                if col is not None:
                    col[row] = np.nan if v is None else v
            for name in self.histogram_fields:
                h: Histogram | None = getattr(sample, name)
                hcol = self._hists.get(name)
                if h is not None and (hcol is None or hcol.bounds != h.bounds):
                    hcol = self._hists[name] = _HistogramColumn(self.capacity, h.bounds)
                if hcol is not None:
                    hcol.put(row, h)
            self.appended += 1
            self.latest = sample

    def _rows(self, since: float | None) -> np.ndarray:
        """Row indexes oldest first, from ``since`` on."""
        n = len(self)
        rows = np.arange(self.appended - n, self.appended) % self.capacity
        if since is not None:
            rows = rows[self.ts[rows] >= since]
        return rows

    def column(self, name: str, since: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(timestamps, values) of one numeric field, oldest first, absent values NaN."""
        ts, values = self.series([name], since)
        return ts, values[name]

    def series(self, names: list[str], since: float | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Timestamps and several numeric fields over the same rows (one consistent read)."""
        unknown = [n for n in names if n not in NUMERIC_FIELDS]
        if unknown:
            raise KeyError(unknown[0])
        with self.lock:
            rows = self._rows(since)
            absent = np.full(len(rows), np.nan)
            return self.ts[rows], {n: self._columns[n][rows] if n in self._columns else absent for n in names}

    def samples(self, since: float | None = None) -> list[PoolSample]:
        """The samples from ``since`` on as PoolSamples, for the checks.

        Older rows share the newest sample's identity, provenance and notes: the checks read
        those from ``Window.last`` only.
        """
        with self.lock:
            latest = self.latest
            if latest is None:
                return []
            rows = self._rows(since)[:-1]
            names = ["ts", *self._columns]
            block = np.column_stack([self.ts[rows], *(c[rows] for c in self._columns.values())])
            hists = [(name, col.bounds, col.data[rows].tolist()) for name, col in self._hists.items()]
        # Columns present in every row are passed as they are; only the few columns that come
        # and go are looked at row by row (this loop is most of the checks' cost).
        present = ~np.isnan(block)
        full = np.flatnonzero(present.all(axis=0))
        mixed = np.flatnonzero(present.any(axis=0) & ~present.all(axis=0))
        full_names, mixed_names = [names[j] for j in full], [names[j] for j in mixed]
        full_rows, mixed_rows = block[:, full].tolist(), block[:, mixed].tolist()
        shared = {
            "instance": latest.instance,
            "engine": latest.engine,
            "model": latest.model,
            "usage_granularity": latest.usage_granularity,
            "labels": latest.labels,
            "provenance": latest.provenance,
            "notes": latest.notes,
        }
        out = []
        for i, values in enumerate(full_rows):
            kwargs = dict(zip(full_names, values))
            for name, v in zip(mixed_names, mixed_rows[i]):
                if v == v:  # not NaN
                    kwargs[name] = v
            for name, bounds, data in hists:
                h = data[i]
                if h[-1] == h[-1]:  # not NaN: the histogram was present
                    kwargs[name] = Histogram(bounds, tuple(h[:-2]), h[-2], h[-1])
            out.append(PoolSample(**shared, **kwargs))
        return out + [latest]
