"""A fixed-size, columnar ring of one instance's samples: memory bounded by the window.

An exporter keeps every instance's window for days. PoolSample objects are convenient but
heavy (a dict of fields, boxed floats, provenance): thousands of instances times a 1 h window
of them would not fit in a gigabyte. The ring stores each numeric field the engine reports as
a preallocated float64 column (NaN = absent, as in ``Window.column``; fields the engine never
reports take no room), and only the histograms the checks read, so memory is flat from the
first full window on. When the checks run, the rows inside the window become a columnar
``Window`` directly; the newest scrape's own sample gives it identity, provenance and notes.
"""

from __future__ import annotations

from dataclasses import fields
from threading import Lock
from typing import Callable

import numpy as np

from kvdiag.checks.catalog import CHECKS
from kvdiag.model import HISTOGRAM_FIELDS, NUMERIC_FIELDS, Histogram, PoolSample
from kvdiag.window import Window, resolve_writers

_HISTOGRAMS = {f.name for f in fields(PoolSample) if f.name in HISTOGRAM_FIELDS}
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
            if sample.writers:  # per-process gauges: the most recent writer, against the last scrape
                resolve_writers(self.latest, sample)
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

    def window(self, instance: str, since: float | None = None, clock: Callable[[np.ndarray], np.ndarray] | None = None) -> Window | None:
        """The rows from ``since`` on as a columnar Window for the checks (no PoolSample per
        row); identity, provenance and notes come from the newest scrape's own sample.
        ``clock`` maps the scrape times onto another time base (the demo's simulated time)."""
        with self.lock:
            latest = self.latest
            if latest is None:
                return None
            rows = self._rows(since)
            ts = self.ts[rows] if clock is None else clock(self.ts[rows])
            columns = {name: col[rows] for name, col in self._columns.items()}
            hists = {}
            for name, hcol in self._hists.items():
                data = hcol.data[rows]
                present = ~np.isnan(data[:, -1])
                hists[name] = (hcol.bounds, ts[present], data[present, :-2], data[present, -2], data[present, -1])
        return Window.from_columns(instance, ts, columns, hists, latest)
