"""The window: reset-safe counters, Prometheus-exact histogram quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvdiag.model import Histogram, PoolSample
from kvdiag.window import Window, bucket_quantile, counter_increase, windows


def _sample(ts: float, **kw: object) -> PoolSample:
    return PoolSample("i", "x", ts, **kw)  # type: ignore[arg-type]


def test_counter_increase_is_reset_safe() -> None:
    assert counter_increase(np.array([10.0, 12.0, 15.0])) == 5.0
    # Restart after 15: the engine counts 0 -> 4 again; the increase is 5 + 4, never negative.
    assert counter_increase(np.array([10.0, 12.0, 15.0, 1.0, 4.0])) == 9.0
    assert counter_increase(np.array([7.0])) == 0.0


def test_restart_mid_window_is_not_a_spike_nor_negative() -> None:
    w = Window("i", [_sample(t, evictions_total=v) for t, v in [(0, 100.0), (5, 100.0), (10, 0.0), (15, 0.0)]])
    assert w.increase("evictions_total") == 0.0
    assert w.resets("evictions_total") == 1
    assert w.rate("evictions_total") == 0.0


def test_absent_field_is_none_not_zero() -> None:
    w = Window("i", [_sample(t, running=3.0) for t in range(3)])
    assert w.increase("evictions_total") is None and not w.has("evictions_total")
    assert w.has("running")


def test_bucket_quantile_matches_prometheus_algorithm() -> None:
    bounds = (0.1, 1.0, 10.0, math.inf)
    # 100 observations: 10 <= 0.1, 50 <= 1, 90 <= 10, 100 total.
    q = bucket_quantile(0.5, bounds, np.array([10, 50, 90, 100]))
    assert q.value == pytest.approx(0.1 + 0.9 * (50 - 10) / 40) and (q.lower, q.upper) == (0.1, 1.0)
    q99 = bucket_quantile(0.99, bounds, np.array([10, 50, 90, 100]))
    assert q99.value == 10.0 and q99.upper == math.inf  # rank in +Inf bucket: the last finite bound
    first = bucket_quantile(0.05, bounds, np.array([10, 50, 90, 100]))
    assert first.value == pytest.approx(0.05) and first.lower == 0.0
    assert bucket_quantile(0.5, bounds, np.array([0, 0, 0, 0])) is None


def test_window_quantile_over_increase_with_a_restart() -> None:
    bounds = (1.0, 10.0, math.inf)
    h = lambda c: Histogram(bounds, c, 0.0, c[-1])  # noqa: E731
    samples = [
        _sample(0, ttft=h((100.0, 100.0, 100.0))),
        _sample(5, ttft=h((100.0, 150.0, 150.0))),  # +50 slow-ish (1-10 s)
        _sample(10, ttft=h((0.0, 0.0, 0.0))),  # restart
        _sample(15, ttft=h((0.0, 0.0, 50.0))),  # +50 in +Inf
    ]
    w = Window("i", samples)
    inc = w.histogram_increase("ttft")
    assert inc.counts == (0.0, 50.0, 100.0) and inc.count == 100.0
    q = w.quantile(0.5, "ttft")
    assert q.value == 10.0 and (q.lower, q.upper) == (1.0, 10.0)


def test_windows_groups_and_trims() -> None:
    samples = [PoolSample(inst, "x", float(t)) for inst in ("a", "b") for t in range(0, 100, 10)]
    ws = windows(samples, seconds=30)
    assert set(ws) == {"a", "b"} and [s.ts for s in ws["a"].samples] == [60, 70, 80, 90]
    assert ws["a"].frame.shape == (4, ws["a"].frame.shape[1]) and ws["a"].duration == 30


def test_histogram_restart_where_a_bucket_refills_past_its_old_count() -> None:
    bounds = (1.0, math.inf)
    h = lambda c: Histogram(bounds, c, 0.0, c[-1])  # noqa: E731
    # Before: 5 fast of 100. After the restart: 10 fast of 10 (the fast bucket grew past 5).
    w = Window("i", [_sample(0, ttft=h((5.0, 100.0))), _sample(5, ttft=h((10.0, 10.0)))])
    inc = w.histogram_increase("ttft")
    assert inc.counts == (10.0, 10.0) and inc.count == 10.0


def _busy(ts: float, finished: float, running: float = 7.0, waiting: float = 17.0, usage: float = 0.97, **kw: object) -> PoolSample:
    kw.setdefault("generation_tokens_total", 300.0 * ts)  # generating all along
    return _sample(ts, running=running, waiting=waiting, usage_ratio=usage, requests_total=finished, **kw)


def test_an_empty_reading_of_a_busy_engine_is_absent() -> None:
    """Real vLLM 0.32 under a saturating closed loop, scraped by three readers at once, read
    running, waiting and KV usage all 0 in some scrapes while its counters kept rising. 24
    requests were in it; 5 finished before the next scrape: it cannot be empty."""
    w = Window("i", [_busy(0, 100), _busy(5, 103, 0.0, 0.0, 0.0), _busy(10, 105, 0.0, 0.0, 0.0), _busy(15, 108)])
    assert np.isnan(w.column("usage_ratio")[1:3]).all() and np.isnan(w.column("waiting")[1:3]).all()
    assert w.points("running")[1].tolist() == [7.0, 7.0]
    note = w.provenance("usage_ratio")[1]
    assert note is None or "2 scrapes read an empty engine" in note.note  # where the adapter recorded provenance
    assert w.column("requests_total").tolist() == [100, 103, 105, 108]  # counters stay as read


def test_an_empty_reading_milliseconds_after_another_is_absent() -> None:
    """A sampler that caught up after a stall scraped a saturated vLLM six times 20 ms apart
    (issue 31's loaded machine): no tokens came between those scrapes, yet the engine had
    generated since the last scrape a second or more before them, so it is not believed empty."""
    w = Window("i", [_busy(0, 100), _busy(5, 105, 0.0, 0.0, 0.0), _busy(5.02, 105, 0.0, 0.0, 0.0, generation_tokens_total=1500.0),
                     _busy(5.04, 105, 0.0, 0.0, 0.0, generation_tokens_total=1500.0), _busy(10, 110)])  # fmt: skip
    assert np.isnan(w.column("running")[1:4]).all()
    idle = Window("i", [_busy(0, 100), _busy(5, 105, 0.0, 0.0, 0.0), _busy(6.5, 105, 0.0, 0.0, 0.0, generation_tokens_total=1500.0)])
    assert np.isnan(idle.column("running")[1]) and idle.column("running")[2] == 0.0  # 1.5 s without a token: believed


@pytest.mark.parametrize(
    "samples",
    [
        # everything in it finished (24 requests) before the empty reading: a real lull
        [_busy(0, 100), _busy(5, 124, 0.0, 0.0, 0.0), _busy(10, 124, 2.0, 0.0)],
        # a restart between the readings (the counter fell): the requests were lost with it
        [_busy(0, 100), _busy(5, 3, 0.0, 0.0, 0.0)],
        # no finished-request counter: nothing says the reading is impossible
        [_sample(0, running=7.0, waiting=17.0), _sample(5, running=0.0, waiting=0.0)],
        # the pool still holds KV: not the empty snapshot
        [_busy(0, 100), _busy(5, 101, 0.0, 0.0, 0.4)],
        # nothing generated since: the clients went away (an engine that does not count aborts)
        [_busy(0, 100), _busy(5, 100, 0.0, 0.0, 0.0, generation_tokens_total=0.0)],
        # a prefill instance hands its requests on without finishing them
        [_busy(0, 100, role="prefill"), _busy(5, 100, 0.0, 0.0, 0.0, role="prefill")],
    ],
)
def test_a_believable_empty_reading_stays(samples: list[PoolSample]) -> None:
    w = Window("i", samples)
    assert not np.isnan(w.column("running")).any() and not np.isnan(w.column("waiting")).any()


def test_empty_readings_leave_a_pinned_pool_pinned() -> None:
    """The checklist over a saturated engine whose every third scrape reads empty names L1, as
    it does over the same scrapes without them."""
    from kvdiag.checks import diagnose
    from kvdiag.config import Config
    from kvdiag.refpool.validate import L1_VERDICTS

    def sample(k: int, empty: bool) -> PoolSample:
        running, waiting, usage = (0.0, 0.0, 0.0) if empty else (7.0, 17.0 + k % 2, 0.99)
        return PoolSample("i", "vllm", 5.0 * k, running=running, waiting=waiting, usage_ratio=usage, requests_total=100.0 + 4 * k,
                          evictions_total=30.0 * k, capacity_tokens=2048.0, generation_tokens_total=1500.0 * k,
                          prompt_tokens_total=2000.0 * k)  # fmt: skip

    clean = diagnose(Window("i", [sample(k, False) for k in range(60)]), Config())
    glitched = diagnose(Window("i", [sample(k, k % 3 == 1) for k in range(60)]), Config())
    assert clean.verdict.name in L1_VERDICTS
    assert glitched.verdict.name == clean.verdict.name, glitched.verdict.reason
