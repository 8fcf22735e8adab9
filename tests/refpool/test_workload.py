"""Workloads: reproducible under a seed, arrival processes with the rates they promise, and
prefix sharing at the ratio asked for."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from kvdiag.refpool.types import SimRequest
from kvdiag.refpool.workload import (
    Bursty,
    Conversations,
    Fixed,
    LogNormal,
    Poisson,
    Ramp,
    SharedPrefix,
    TokenDraws,
    Uniform,
    Workload,
    expected_output,
    exponential_draws,
    prefix_share,
)
from kvdiag.refpool.workload import _DRAWS, _VOCAB


def take(w: Workload, n: int) -> list[SimRequest]:
    return list(itertools.islice(w.requests(), n))


def fingerprint(reqs: list[SimRequest]) -> list[tuple]:
    return [(r.rid, r.arrival, r.prompt, r.max_new_tokens, r.output_len) for r in reqs]


def until(times, t_end: float) -> np.ndarray:
    return np.fromiter(itertools.takewhile(lambda t: t < t_end, times), dtype=float)


RICH = Workload(
    Poisson(20),
    LogNormal(400, 0.6, hi=4000),
    Uniform(10, 60),
    prefix=SharedPrefix(groups=3, share=0.5, zipf=1.0),
    conversations=Conversations.chat(),
    max_new_tokens=128,
    seed=7,
)


def test_same_seed_same_stream_other_seed_other_stream() -> None:
    a, b = take(RICH, 300), take(RICH, 300)
    assert fingerprint(a) == fingerprint(b)
    other = replace(RICH, seed=8)
    assert fingerprint(take(other, 300)) != fingerprint(a)


def test_streams_are_independent_per_aspect() -> None:
    """Changing the output lengths must not move arrivals or prompts (separate child seeds)."""
    base = Workload(Poisson(5), Fixed(50), Fixed(10), prefix=SharedPrefix(2, 0.4), seed=3)
    longer = Workload(Poisson(5), Fixed(50), Fixed(99), prefix=SharedPrefix(2, 0.4), seed=3)
    a, b = take(base, 100), take(longer, 100)
    assert [(r.arrival, r.prompt) for r in a] == [(r.arrival, r.prompt) for r in b]
    assert {r.output_len for r in b} == {99}


def test_arrival_order_and_lengths() -> None:
    reqs = take(RICH, 500)
    assert all(x.arrival <= y.arrival for x, y in zip(reqs, reqs[1:]))
    assert all(1 <= r.output_len <= r.max_new_tokens == 128 for r in reqs)
    assert len({r.rid for r in reqs}) == len(reqs)


def test_poisson_rate() -> None:
    t = until(Poisson(50).times(np.random.default_rng(1)), 200)
    assert len(t) == pytest.approx(50 * 200, rel=0.03)


def test_bursty_is_burstier_than_poisson_at_the_same_mean() -> None:
    """Counts per second of an on/off MMPP are overdispersed (variance ≫ mean)."""
    proc = Bursty(burst_rate=40, calm_rate=2, mean_burst_s=5, mean_calm_s=15)
    t = until(proc.times(np.random.default_rng(2)), 4000)
    expected_mean = (40 * 5 + 2 * 15) / 20
    assert len(t) / 4000 == pytest.approx(expected_mean, rel=0.15)
    counts = np.bincount(t.astype(int), minlength=4000)
    assert counts.var() / counts.mean() > 5
    poisson = np.bincount(until(Poisson(expected_mean).times(np.random.default_rng(2)), 4000).astype(int))
    assert poisson.var() / poisson.mean() == pytest.approx(1, abs=0.15)


def test_ramp_follows_its_rate_schedule() -> None:
    ramp = Ramp(((0.0, 2.0), (100.0, 22.0), (200.0, 22.0)))
    assert ramp.rate_at(50) == pytest.approx(12)
    assert ramp.rate_at(500) == 22
    t = until(ramp.times(np.random.default_rng(3)), 200)
    assert np.sum(t < 100) == pytest.approx(1200, rel=0.08)  # integral of 2 -> 22 over 100 s
    assert np.sum(t >= 100) == pytest.approx(2200, rel=0.08)


def test_length_distributions() -> None:
    rng = np.random.default_rng(4)
    assert {Fixed(7).sample(rng) for _ in range(10)} == {7}
    u = [Uniform(3, 5).sample(rng) for _ in range(300)]
    assert set(u) == {3, 4, 5}
    ln = LogNormal(200, 1.0, lo=10, hi=1000)
    v = np.array([ln.sample(rng) for _ in range(4000)])
    assert v.min() >= 10 and v.max() <= 1000
    assert np.median(v) == pytest.approx(200, rel=0.1)


@pytest.mark.parametrize("share", [0.3, 0.7, 0.9])
def test_prefix_share_ratio(share: float) -> None:
    w = Workload(Poisson(10), LogNormal(500, 0.5, hi=3000), Fixed(16), prefix=SharedPrefix(4, share), seed=5)
    reqs = take(w, 400)
    assert prefix_share(reqs) == pytest.approx(share, abs=0.04)
    assert np.mean([len(r.prompt) for r in reqs]) == pytest.approx(LogNormal(500, 0.5).mean, rel=0.08)


def test_no_prefix_means_no_sharing() -> None:
    reqs = take(Workload(Poisson(10), Fixed(300), Fixed(8), seed=6), 200)
    assert prefix_share(reqs) < 0.01


def test_uniform_prefix_pick_draws_what_choice_draws() -> None:
    """The uniform group pick uses ``integers(0, n)``, which is what ``choice(n)`` draws: the
    streams (and every recording made from them) stay as they were."""
    a, b = np.random.default_rng(3), np.random.default_rng(3)
    assert [int(a.integers(0, 8)) for _ in range(500)] == [int(b.choice(8)) for _ in range(500)]


def test_block_draws_are_the_per_call_draws() -> None:
    """Prompt tokens and arrival gaps drawn a block at a time are the ones a numpy call per
    prompt or gap gives, in order: odd prompt lengths (a 64-bit draw split over two calls),
    prompts across a block's end and one longer than a block."""
    lengths = [1, 2, 3, 517, 1000, 7, _DRAWS - 1500, 3000, 2 * _DRAWS + 5, 1, 999]
    per_call, blocks = np.random.default_rng(11), TokenDraws(np.random.default_rng(11))
    for n in lengths:
        assert blocks.take(n) == tuple(per_call.integers(0, _VOCAB, size=n).tolist())
    scales = [1 / 47.9, 0.02, 1 / 53.0, 3.0] * (_DRAWS // 2)  # past a block's end
    per_call, gaps = np.random.default_rng(12), exponential_draws(np.random.default_rng(12))
    assert [s * next(gaps) for s in scales] == [per_call.exponential(s) for s in scales]


def test_zipf_popularity_favours_the_first_group() -> None:
    w = Workload(Poisson(10), Fixed(100), Fixed(4), prefix=SharedPrefix(5, 0.5, zipf=1.5), seed=9)
    reqs = take(w, 600)
    heads = [r.prompt[:50] for r in reqs]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert len(counts) == 5 and counts[0] > 2 * counts[-1]


def test_a_turn_extends_the_previous_prompt_and_output() -> None:
    w = Workload(Poisson(2), Fixed(64), Fixed(12), conversations=Conversations.agent(), seed=10)
    reqs = take(w, 200)
    by_rid = {r.rid: r for r in reqs}
    followups = [r for r in reqs if not r.rid.endswith(".t0") and "." in r.rid]
    assert followups
    for r in followups:
        session, turn = r.rid.rsplit(".t", 1)
        prev = by_rid.get(f"{session}.t{int(turn) - 1}")
        if prev is None:
            continue  # previous turn beyond the slice
        head = prev.prompt + expected_output(prev)
        assert r.prompt[: len(head)] == head and len(r.prompt) > len(head)
        assert r.arrival >= prev.arrival
    assert prefix_share(reqs) > 0.6  # agent loops re-send their whole, growing context


def test_expected_output_is_what_the_engine_generates() -> None:
    r = SimRequest("x", 0.0, (1, 2), max_new_tokens=5, output_len=5)
    want = expected_output(r)
    assert r.output == []
    while not r.done:
        r.output.append(r.next_token())
    assert tuple(r.output) == want


def test_invalid_parameters_raise() -> None:
    with pytest.raises(ValueError):
        Poisson(0)
    with pytest.raises(ValueError):
        Ramp(((10.0, 1.0), (5.0, 2.0)))
    with pytest.raises(ValueError):
        SharedPrefix(2, 1.0)
    with pytest.raises(ValueError):
        Bursty(0, 1, 1, 1)


def test_every_kth_keeps_a_kth_of_one_draw() -> None:
    """A fractional k keeps the arrivals where the count passes each multiple of k (0, 3, 5, 8,
    10, ... for 2.5): a k-th of the stream within one, from the same draw; k < 1 is refused."""
    from kvdiag.refpool.workload import EveryKth, Poisson

    full = list(itertools.islice(Poisson(10.0).times(np.random.default_rng(1)), 100))
    kept = list(itertools.takewhile(lambda t: t <= full[-1], EveryKth(Poisson(10.0), 2.5).times(np.random.default_rng(1))))
    assert kept[:5] == [full[i] for i in (0, 3, 5, 8, 10)] and set(kept) <= set(full)
    assert len(kept) == 40
    with pytest.raises(ValueError, match="k must be >= 1"):
        EveryKth(Poisson(10.0), 0.5)
