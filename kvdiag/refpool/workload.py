"""Request streams for the engine loop: arrivals, lengths and shared prefixes, under a seed.

A scenario needs load whose shape is known exactly (ground truth), identical on both engines
and reproducible: a ``Workload`` is a pure function of its parameters and seed. It yields
``SimRequest`` lazily in arrival order, so hour-long runs hold only what is in flight.
Arrivals are open-loop (they never depend on how the engine is doing), which is what makes the
stream the same whatever engine consumes it, except under ``ClosedLoop`` clients: N clients, each
sending its next request when its last one returns (benchmarks, many gateways), whose stream is
told of every finished request (``ClosedStream.returned``) and so depends on the engine. Each random aspect (arrival times, lengths,
prefix choice, token ids) draws from its own child seed, so changing one does not reshuffle the
others.

Prefix sharing is what makes L1 pressure interesting: a shared system prompt is cached once
and hit by many requests; a conversation's next turn extends the previous prompt and its
output. ``prefix_share`` below measures the fraction of prompt tokens an infinite cache would
serve, the ground-truth counterpart of a hit ratio.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

from kvdiag.refpool.types import SimRequest, output_ids, pickle_by_fields, prefix_keys

_VOCAB = 1 << 17  # token ids drawn in [0, _VOCAB); user-visible tokens stay below the output ids
_DRAWS = 1 << 14  # random numbers drawn at a time by the block draws below


# ---------------------------------------------------------------- lengths
class LengthDist(Protocol):
    """A token-length distribution (always ≥ 1)."""

    @property
    def mean(self) -> float: ...

    def sample(self, rng: np.random.Generator) -> int: ...


@dataclass(frozen=True)
class Fixed:
    value: int

    @property
    def mean(self) -> float:
        return float(self.value)

    def sample(self, rng: np.random.Generator) -> int:
        return self.value


@dataclass(frozen=True)
class Uniform:
    """Integers in [lo, hi], inclusive."""

    lo: int
    hi: int

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.lo, self.hi + 1))


@dataclass(frozen=True)
class LogNormal:
    """Heavy-tailed lengths as seen in chat traces: ``median·exp(sigma·N(0,1))``, clipped."""

    median: float
    sigma: float
    lo: int = 1
    hi: int = 1 << 20

    @property
    def mean(self) -> float:
        """Mean of the unclipped distribution (the clip rarely binds for sensible bounds)."""
        return self.median * math.exp(self.sigma**2 / 2)

    def sample(self, rng: np.random.Generator) -> int:
        return int(min(max(round(self.median * math.exp(self.sigma * rng.standard_normal())), self.lo), self.hi))


# ---------------------------------------------------------------- arrivals
class Arrivals(Protocol):
    """An arrival process: increasing times from ``t = 0``."""

    def times(self, rng: np.random.Generator) -> Iterator[float]: ...


@dataclass(frozen=True)
class Poisson:
    rate: float  # requests per second

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        t, scale = 0.0, 1.0 / self.rate
        for e in exponential_draws(rng):
            t += scale * e
            yield t


def exponential_draws(rng: np.random.Generator) -> Iterator[float]:
    """``rng``'s standard exponential draws one by one, drawn a block at a time: ``scale * e``
    is exactly what ``rng.exponential(scale)`` returns in its place (numpy scales a standard
    draw), so arrivals come out as one call per gap gave them, without a numpy call per gap.
    ``rng`` serves nothing else: a block draws past the last gap used."""
    while True:
        yield from rng.standard_exponential(_DRAWS).tolist()


@dataclass(frozen=True)
class Periodic:
    """One arrival every ``1/rate`` seconds (a load generator at a fixed rate): with fixed
    lengths the engine reaches a steady state with no queueing noise, so a pool can be held
    at a known level."""

    rate: float  # requests per second

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        # A generator function, not a returned generator expression: mypyc builds such an
        # expression as a list, which over an endless count never returns (and fills memory).
        for k in itertools.count(1):
            yield k / self.rate


@dataclass(frozen=True)
class Bursty:
    """Two-state Markov-modulated Poisson process: bursts at ``burst_rate`` lasting
    ``mean_burst_s`` on average, separated by ``mean_calm_s`` at ``calm_rate`` (on/off when 0).

    Starts calm. Exponential dwell times make the state switch exact without thinning."""

    burst_rate: float
    calm_rate: float
    mean_burst_s: float
    mean_calm_s: float

    def __post_init__(self) -> None:
        if self.burst_rate <= 0 or self.calm_rate < 0 or self.mean_burst_s <= 0 or self.mean_calm_s <= 0:
            raise ValueError("Bursty needs burst_rate > 0, calm_rate >= 0 and positive mean durations")

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        t, burst = 0.0, False
        switch = rng.exponential(self.mean_calm_s)
        while True:
            rate = self.burst_rate if burst else self.calm_rate
            gap = rng.exponential(1.0 / rate) if rate > 0 else math.inf
            if t + gap < switch:
                t += gap
                yield t
            else:  # memoryless: restart the draw from the switch time in the new state
                t, burst = switch, not burst
                switch = t + rng.exponential(self.mean_burst_s if burst else self.mean_calm_s)


@dataclass(frozen=True)
class EveryKth:
    """Every ``k``-th arrival of ``arrivals`` from one draw of it (the 1st, then each time the
    count passes the next multiple of ``k``; ``k`` may be fractional).

    A scale model's arrivals (``whatif.scale``): over any span they count a k-th of the full
    stream's within one, so the load's relative burstiness stays the full size's. A process
    thinned at random (each rate divided by k) is sqrt(k) times burstier relative to its mean,
    and a queue near or past capacity turns that into tens of percent more waiting."""

    arrivals: Arrivals
    k: float

    def __post_init__(self) -> None:
        if not self.k >= 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        kept = 0
        for i, t in enumerate(self.arrivals.times(rng)):
            if i >= kept * self.k:
                kept += 1
                yield t


@dataclass(frozen=True)
class Ramp:
    """Poisson arrivals whose rate follows straight lines between ``(time_s, rate)`` points and
    stays at the last rate afterwards: a load rising past capacity over a known time.

    Non-homogeneous Poisson by thinning against the peak rate."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        times = [t for t, _ in self.points]
        if not self.points or times != sorted(set(times)) or max(r for _, r in self.points) <= 0:
            raise ValueError("ramp points need strictly increasing times and a positive peak rate")

    def rate_at(self, t: float) -> float:
        pts = self.points
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
            if t <= t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
        return pts[-1][1]

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        peak = max(r for _, r in self.points)
        t = 0.0
        while True:
            t += rng.exponential(1.0 / peak)
            if rng.random() * peak < self.rate_at(t):
                yield t


# ---------------------------------------------------------------- prefixes
@dataclass(frozen=True)
class SharedPrefix:
    """System prompts: each request starts with one of ``groups`` fixed prefixes.

    ``share`` is the fraction of prompt tokens that are the group prefix: the prefix is
    ``share × mean input`` tokens and the unique rest is ``(1 − share) × sampled input``, so the
    mean prompt length is unchanged. ``zipf`` > 0 makes low-numbered groups more popular
    (weight ∝ 1/(g+1)^zipf); 0 picks uniformly."""

    groups: int
    share: float
    zipf: float = 0.0

    def __post_init__(self) -> None:
        if self.groups < 1 or not 0 < self.share < 1:
            raise ValueError("SharedPrefix needs groups >= 1 and 0 < share < 1")


@dataclass(frozen=True)
class Conversations:
    """Multi-turn sessions: each arrival opens a session of ``turns`` requests; turn k+1 comes
    ``think_s`` (exponential mean) after turn k's arrival and its prompt is turn k's prompt, its
    output, and ``turn_input`` new tokens (a user message or a tool result).

    The output a turn will have is known in advance (``SimRequest.next_token`` is
    deterministic), which keeps the stream open-loop and identical for every engine."""

    turns: LengthDist
    think_s: float
    turn_input: LengthDist

    @staticmethod
    def chat() -> Conversations:
        """A person chatting: a few turns, tens of seconds apart, short messages."""
        return Conversations(turns=Uniform(2, 8), think_s=20.0, turn_input=LogNormal(80, 0.8, lo=4, hi=2000))

    @staticmethod
    def agent() -> Conversations:
        """An agent loop: many steps, each appending a tool result within a second or two."""
        return Conversations(turns=Uniform(5, 20), think_s=1.5, turn_input=LogNormal(300, 1.0, lo=8, hi=8000))


@dataclass(frozen=True)
class ClosedLoop:
    """``clients`` clients, each sending a request, waiting for its answer, thinking
    ``think_s`` seconds and sending the next: the load follows the engine. Client k's first
    request goes at ``k x stagger_s``. Its queue cannot grow past ``clients - running``: under an
    overload it stands there, which real engines showed (24 clients, 18-22 waiting)."""

    clients: int
    think_s: float = 0.0
    stagger_s: float = 0.1

    def __post_init__(self) -> None:
        if self.clients < 1 or self.think_s < 0 or self.stagger_s < 0:
            raise ValueError("ClosedLoop needs clients >= 1, think_s >= 0 and stagger_s >= 0")

    def times(self, rng: np.random.Generator) -> Iterator[float]:
        """The clients' first sends (the rest follow their answers: ``ClosedStream``)."""
        return iter([k * self.stagger_s for k in range(self.clients)])


# ---------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """Arrivals × lengths × prefix structure; ``requests()`` is a fresh, identical stream."""

    arrivals: Arrivals
    input_len: LengthDist
    output_len: LengthDist
    prefix: SharedPrefix | None = None
    conversations: Conversations | None = None
    max_new_tokens: int | None = None  # what clients ask for; None: exactly the output length
    ignore_eos: bool = False
    seed: int = 0

    def requests(self) -> Iterator[SimRequest]:
        """Requests in arrival order, generated lazily (follow-up turns wait in a small heap);
        under ``ClosedLoop`` arrivals a ``ClosedStream``, which the engine loop tells of each
        finished request."""
        if isinstance(self.arrivals, ClosedLoop):
            return ClosedStream(self, self.arrivals)
        return _Stream(self).run()


pickle_by_fields(Fixed, Uniform, LogNormal, Poisson, Periodic, Bursty, EveryKth, Ramp, SharedPrefix, Conversations,
                 ClosedLoop, Workload)


class _Stream:
    """One pass over a workload: its random streams and the sessions still to come."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.arr_rng, self.len_rng, self.pick_rng, tok_rng, self.conv_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(w.seed).spawn(5)
        )
        self.tokens = TokenDraws(tok_rng)
        self.prefixes: list[tuple[int, ...]] = []
        self.weights: np.ndarray | None = None
        if w.prefix is not None:
            length = max(1, round(w.prefix.share * w.input_len.mean))
            self.prefixes = [self.tokens.take(length) for _ in range(w.prefix.groups)]
            if w.prefix.zipf > 0:
                weights = 1.0 / np.arange(1, w.prefix.groups + 1) ** w.prefix.zipf
                self.weights = weights / weights.sum()
        # Follow-up turns: (arrival, tie-break, previous turn, turns left after this one).
        self.pending: list[tuple[float, int, SimRequest, int]] = []
        self.seq = itertools.count()

    def run(self) -> Iterator[SimRequest]:
        for n, t in enumerate(self.w.arrivals.times(self.arr_rng)):
            while self.pending and self.pending[0][0] <= t:
                yield self._next_turn(*heapq.heappop(self.pending))
            turns = self.w.conversations.turns.sample(self.conv_rng) if self.w.conversations else 1
            req = self._request(f"r{n}.t0" if turns > 1 else f"r{n}", t, self._first_prompt())
            self._follow(req, turns - 1)
            yield req

    def request(self, rid: str, t: float) -> SimRequest:
        """A fresh (first-turn) request sent at ``t``."""
        return self._request(rid, t, self._first_prompt())

    def _first_prompt(self) -> tuple[int, ...]:
        n = self.w.input_len.sample(self.len_rng)
        if not self.prefixes:
            return self.tokens.take(n)
        prefix = self.w.prefix
        assert prefix is not None, "shared prefixes come from a SharedPrefix"
        if self.weights is None:  # uniform: what choice(n) draws, without its argument checks
            group = int(self.pick_rng.integers(0, len(self.prefixes)))
        else:
            group = int(self.pick_rng.choice(len(self.prefixes), p=self.weights))
        return self.prefixes[group] + self.tokens.take(max(1, round(n * (1 - prefix.share))))

    def _request(self, rid: str, t: float, prompt: tuple[int, ...]) -> SimRequest:
        out = self.w.output_len.sample(self.len_rng)
        max_new = self.w.max_new_tokens or out
        return SimRequest(rid, t, prompt, max_new, min(out, max_new), ignore_eos=self.w.ignore_eos)

    def _follow(self, req: SimRequest, left: int) -> None:
        if left > 0:
            conv = self.w.conversations
            assert conv is not None, "only a conversation has turns left"
            t = req.arrival + float(self.conv_rng.exponential(conv.think_s))
            heapq.heappush(self.pending, (t, next(self.seq), req, left))

    def _next_turn(self, t: float, _seq: int, prev: SimRequest, left: int) -> SimRequest:
        conv = self.w.conversations
        assert conv is not None, "only a conversation has a next turn"
        session, turn = prev.rid.rsplit(".t", 1)
        new_input = self.tokens.take(conv.turn_input.sample(self.len_rng))
        req = self._request(f"{session}.t{int(turn) + 1}", t, prev.prompt + expected_output(prev) + new_input)
        self._follow(req, left - 1)
        return req


class RequestSource(Protocol):
    """What makes a closed-loop client's next request: its id and send time in, the request out."""

    def request(self, rid: str, t: float) -> SimRequest: ...


class ClosedStream:
    """The requests of ``ClosedLoop`` clients in send order: each client's next request exists
    once its last one returned (``returned``). ``next()`` raises StopIteration while every
    client waits for an answer, and yields again after a return, so the engine loop asks again
    after each step that finished requests (``Simulation``). Prompts and lengths are drawn as
    the open-loop stream draws them, in send order; a request the loop took but has not yet
    handed to the engine can be given back (``give_back``) when an earlier one appears."""

    def __init__(self, w: Workload, loop: ClosedLoop, source: RequestSource | None = None) -> None:
        """``source`` makes each client's next request in place of ``w``'s lengths and prefixes
        (a real run's requests told again: kvdiag/real/calibrate.py); ``w`` still seeds the sends."""
        self.stream = _Stream(w)
        self.source: RequestSource = self.stream if source is None else source
        self.think_s = loop.think_s
        self.client: dict[SimRequest, int] = {}
        self.sent = itertools.count()
        self.pending: list[tuple[float, int, int, SimRequest | None]] = [  # (send time, order, client, request)
            (t, next(self.sent), k, None) for k, t in enumerate(loop.times(self.stream.arr_rng))]

    def __iter__(self) -> ClosedStream:
        return self

    def __next__(self) -> SimRequest:
        if not self.pending:
            raise StopIteration
        t, _, k, req = heapq.heappop(self.pending)
        if req is None:
            req = self.source.request(f"c{k}.{len(self.client)}", t)
            self.client[req] = k
        return req

    def returned(self, req: SimRequest, t: float) -> None:
        """``req`` finished at ``t``: its client sends its next request ``think_s`` later."""
        k = self.client.pop(req, None)
        if k is not None:
            heapq.heappush(self.pending, (t + self.think_s, next(self.sent), k, None))

    def give_back(self, req: SimRequest) -> None:
        """A request taken from ``next()`` and not yet sent goes back to its place."""
        heapq.heappush(self.pending, (req.arrival, next(self.sent), self.client[req], req))


class TokenDraws:
    """Prompt token ids from one random stream, drawn a block at a time.

    The ids are those of one ``rng.integers(0, _VOCAB, size=n)`` call per prompt, in order
    (numpy's generator keeps the unused half of a 64-bit draw for its next call, so draws do
    not depend on how they are split; test_workload checks it): each such call cost more in
    numpy's argument handling than its ids did."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.block: list[int] = []
        self.pos = 0

    def take(self, n: int) -> tuple[int, ...]:
        pos, block = self.pos, self.block
        if pos + n <= len(block):
            self.pos = pos + n
            return tuple(block[pos : pos + n])
        ids = block[pos:]
        while len(ids) < n:
            block = self.block = self.rng.integers(0, _VOCAB, size=max(_DRAWS, n - len(ids))).tolist()
            self.pos = min(len(block), n - len(ids))
            ids += block[: self.pos]
        return tuple(ids)


def expected_output(req: SimRequest) -> tuple[int, ...]:
    """The tokens ``req`` will have generated when it finishes (at EOS), from the same
    deterministic ids ``SimRequest.next_token`` gives the schedulers."""
    return tuple(output_ids(req.rid, req.output_len))


def prefix_share(requests: list[SimRequest]) -> float:
    """Fraction of prompt tokens that an unbounded prefix cache would serve: for each request,
    the longest prefix it shares with any earlier request's prompt plus output (a finished turn
    is cached with its output). The ground-truth ceiling of any engine's hit ratio."""
    seen: set[int] = set()  # chained prefix keys: key i present <=> that i+1-token prefix was seen
    shared = total = 0
    for r in requests:
        keys = prefix_keys(r.prompt + expected_output(r))
        hit = 0
        while hit < len(r.prompt) and keys[hit] in seen:
            hit += 1
        shared += hit
        total += len(r.prompt)
        seen.update(keys)
    return shared / total if total else 0.0
