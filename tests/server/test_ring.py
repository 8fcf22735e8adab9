"""The ring keeps exactly the last N samples, gives them back as the checks need them, and the
exported eviction counter survives an engine restart without going backwards."""

from __future__ import annotations

import math

import numpy as np

from kvdiag.model import Histogram, PoolSample
from kvdiag.server.ring import Ring
from kvdiag.server.state import InstanceState
from kvdiag.window import Window

BOUNDS = (0.5, 1.0, math.inf)


def sample(ts: float, waiting: float | None = None, evictions: float | None = None, bounds: tuple[float, ...] = BOUNDS) -> PoolSample:
    s = PoolSample(instance="i", engine="sglang", ts=ts, usage_ratio=0.5, waiting=waiting, evictions_total=evictions)
    s.ttft = Histogram(bounds, tuple(float(ts * k) for k in range(1, len(bounds) + 1)), ts, ts * len(bounds))
    return s


def test_the_ring_keeps_the_last_capacity_samples_oldest_first() -> None:
    ring = Ring(4)
    for t in range(10):
        ring.append(sample(float(t), waiting=float(t)))
    assert len(ring) == 4
    ts, waiting = ring.column("waiting")
    assert ts.tolist() == [6.0, 7.0, 8.0, 9.0] and waiting.tolist() == [6.0, 7.0, 8.0, 9.0]
    assert ring.window("i", since=7.5).column("ts").tolist() == [8.0, 9.0]


def test_the_window_has_absent_fields_absent_and_histograms_intact() -> None:
    ring = Ring(3)
    originals = [sample(1.0, waiting=None), sample(2.0, waiting=3.0)]
    for s in originals:
        ring.append(s)
    back = ring.window("i")
    assert back.last is originals[-1] and len(back) == 2
    assert math.isnan(back.column("waiting")[0]) and back.column("waiting")[1] == 3.0
    assert back.column("usage_ratio").tolist() == [0.5, 0.5]
    assert np.isnan(back.column("running")).all()  # never reported: absent, not 0
    # The same histogram arithmetic as a window of the PoolSamples themselves.
    assert back.histogram_increase("ttft") == Window("i", originals).histogram_increase("ttft")


def test_a_new_bucket_layout_starts_the_histogram_afresh() -> None:
    ring = Ring(3)
    ring.append(sample(1.0))
    ring.append(sample(2.0, bounds=(1.0, math.inf)))
    w = ring.window("i")
    bounds, ts, _, _, _ = w._histograms("ttft")
    assert ts.tolist() == [2.0] and bounds == w.histogram_increase("ttft").bounds == (1.0, math.inf)


def test_memory_is_preallocated_and_flat() -> None:
    ring = Ring(100)
    for t in range(50):
        ring.append(sample(float(t)))
    size = ring.nbytes
    for t in range(50, 10_000):
        ring.append(sample(float(t)))
    assert ring.nbytes == size and len(ring) == 100


def test_restarts_are_counter_resets_in_the_exported_eviction_counter() -> None:
    inst = InstanceState("i", Ring(10))
    for t, ev in enumerate([5, 7, 9, 1, 2, 0, 3]):  # restarts after 9 and after 2
        inst.ingest(sample(float(t), evictions=float(ev)))
    assert inst.evictions_total == 5 + 2 + 2 + 1 + 1 + 0 + 3
