"""Load on a real engine's OpenAI endpoint, as its users would send it, with client-side TTFT.

Three shapes of traffic, because they overload an engine differently:
* an **open loop** (``OpenLoop``): Poisson arrivals at a rate per phase, whatever the engine
  does; in overload the waiting queue grows without bound;
* an **overload that follows the engine** (``Overload``): a light closed-loop opening, then an
  open loop whose overload is found, not fixed. The rate an engine serves depends on the machine it runs on (a 1.5 requests/s
  overload on a loaded 2-core machine was served with nothing waiting on the same 2 cores idle),
  so the driver reads what the engine's own scheduler decided (the truth hook, through a
  ``Limited`` callable) and raises the rate until admission is limited as the story needs (then
  to a multiple of the rate the engine serves), and holds the overload a set time from there: on any machine the story overloads, and lasts long
  enough after the overload began to judge how soon kvdiag named it;
* a **closed loop** (``ClosedLoop``): N clients, each sending its next request when the last
  answer returns (benchmarks, many gateways); the queue cannot exceed N minus running.

Prompts are ASCII, one token per byte with the tiny model's tokenizer (kvdiag/real/tiny_model.py),
so lengths are exact: ``Requests.prefix`` of each prompt is one shared string (the prefix cache
hits on it), the rest random. Every request streams and runs to its length (``ignore_eos``);
where ``max_tokens`` exceeds the output (``extra_max_tokens``), the client reads ``output``
tokens and closes the stream, which aborts the request on the server: what the engine reserves
for is ``max_tokens``, what it generates is the output. ``stop`` closes every open stream.
"""

from __future__ import annotations

import json
import random
import socket
import string
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import requests

from kvdiag.real.engines import MODEL_NAME


@dataclass(frozen=True)
class Phase:
    seconds: float
    rate: float  # requests per second (Poisson)


@dataclass(frozen=True)
class OpenLoop:
    phases: tuple[Phase, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


@dataclass(frozen=True)
class ClosedLoop:
    clients: int
    seconds: float


@dataclass(frozen=True)
class Overload:
    """An ``opening`` of a few closed-loop clients (light on a machine of any speed: one or two
    requests fit the smallest pool), then Poisson arrivals from ``rate`` on, multiplied by
    ``factor`` (``raises`` times at most) whenever admission was limited ``by`` ("kv", or a cap
    of kvdiag/real/truth.py ``CAPS``) in less than half of the last ``patience`` seconds. Once it
    is limited, the rate goes up by ``factor`` once more (the rate that first limits it is about
    what it serves: a real vLLM found limited at 2.25 requests/s drained to idle 5 s later) and
    is at least ``over_service`` x the requests the engine finished per second over the last
    ``lookback`` seconds (its service rate while limited), so the queue grows at a pace of the
    engine's own, and at most ``factor`` x the rate it went to (a client process starved on a
    loaded machine reads a burst of answers at once: 103 in 10 s from a server that serves 3 a
    second, which set the arrivals to 21 a second). The overload lasts ``hold`` seconds from the first
    check that found admission limited (``longest`` at most, a bound for an engine that never
    is), then ``drain`` seconds pass without arrivals (fewer: the drain ends ``settle`` seconds
    after admission stopped being limited, so that a story does not end on minutes of an idle
    engine). The engine is asked every ``check`` seconds about the last ``lookback``."""

    opening: ClosedLoop
    rate: float
    hold: float
    drain: float = 0.0
    settle: float = 20.0
    by: str = "kv"
    patience: float = 15.0
    factor: float = 1.5
    raises: int = 4
    over_service: float = 2.0
    longest: float = 300.0
    check: float = 5.0
    lookback: float = 10.0

    @property
    def seconds(self) -> float:
        """The longest the load can last (its length is the engine's to decide)."""
        return self.opening.seconds + self.longest + self.drain


#: The share of the last ``seconds`` of the engine's steps that admission was limited ``by``.
Limited = Callable[[str, float], float]


@dataclass(frozen=True)
class Requests:
    """What each request looks like: lengths drawn uniformly from the ranges (inclusive)."""

    prompt: tuple[int, int] = (300, 500)
    prefix: float = 0.7  # share of each prompt that is the common prefix
    output: tuple[int, int] = (200, 600)
    extra_max_tokens: int = 0  # max_tokens = output + this (the client stops reading at output)
    #: Run to the length by ``min_tokens`` = ``max_tokens`` instead of ``ignore_eos``: SGLang then
    #: reserves a running request's remaining output times its new-token ratio (with ignore_eos,
    #: all of it), as for a client that lets the model stop.
    min_tokens: bool = False


@dataclass
class Record:
    """One request as its client saw it (wall-clock seconds; None where it never happened)."""

    sent: float
    prompt_tokens: int
    output_tokens: int  # asked for (read up to)
    first_token: float | None = None
    finished: float | None = None
    received: int = 0  # streamed chunks read (one token each)
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def _abort(r: requests.Response) -> None:
    """Close a stream another thread is blocked reading: shut its socket down first (a plain
    close leaves the reader's recv waiting for the server's next chunk, and waits for it). A
    response that closes its connection at its end (no length, not chunked) holds the socket
    only in its file: the connection gave it up when the response began."""
    sock = getattr(getattr(r.raw, "_connection", None), "sock", None)
    if sock is None:
        fp = getattr(getattr(r.raw, "_fp", None), "fp", None)
        sock = getattr(getattr(fp, "raw", None), "_sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    r.close()


class Driver:
    """Sends a load to ``url`` from threads; ``records`` grow as requests are sent."""

    def __init__(self, url: str | list[str], shape: Requests, seed: int = 0) -> None:
        """``url``: one server, or several that take the requests in turn (replicas behind a
        round-robin router)."""
        urls = [url] if isinstance(url, str) else url
        self.urls = [u.rstrip("/") + "/v1/completions" for u in urls]
        self.url = self.urls[0]
        self._sent = 0
        self.shape = shape
        self.rng = random.Random(seed)
        letters = string.ascii_letters + string.digits + " "
        self._letters = letters
        self.common = "".join(self.rng.choice(letters) for _ in range(shape.prompt[1]))
        self.records: list[Record] = []
        self._stop = threading.Event()
        self._open: set[requests.Response] = set()
        self._lock = threading.Lock()
        self._began = time.monotonic()
        self._threads: list[threading.Thread] = []
        #: (seconds from the load's start, arrivals per second) at each change of rate
        self.rates: list[tuple[float, float]] = []
        #: seconds from the load's start to the first check that found admission limited
        self.limited_at: float | None = None

    # ------------------------------------------------------------------ one request
    def _prompt(self, rng: random.Random) -> tuple[str, int, int]:
        n = rng.randint(*self.shape.prompt)
        shared = int(n * self.shape.prefix)
        text = self.common[:shared] + "".join(rng.choice(self._letters) for _ in range(n - shared))
        return text, n, rng.randint(*self.shape.output)

    def _send(self, rng: random.Random) -> None:
        prompt, n, output = self._prompt(rng)
        rec = Record(time.time(), n, output)
        with self._lock:
            self.records.append(rec)
        with self._lock:
            url = self.urls[self._sent % len(self.urls)]
            self._sent += 1
        max_tokens = output + self.shape.extra_max_tokens
        to_length = {"min_tokens": max_tokens} if self.shape.min_tokens else {"ignore_eos": True}
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **to_length, "stream": True, "temperature": 1.0}
        try:
            with requests.post(url, json=body, stream=True, timeout=(10, 3600)) as r:
                with self._lock:
                    if self._stop.is_set():
                        rec.error = "stopped"
                        return
                    self._open.add(r)
                try:
                    r.raise_for_status()
                    for _ in self._chunks(r):
                        if rec.first_token is None:
                            rec.first_token = time.time()
                        rec.received += 1
                        if rec.received >= output or self._stop.is_set():
                            break
                    if rec.received < output and self._stop.is_set():
                        rec.error = "stopped"  # cut short by ``stop`` (its stream shut down), not answered
                    else:
                        rec.finished = time.time()
                finally:
                    with self._lock:
                        self._open.discard(r)
        except (requests.RequestException, OSError, ValueError, AttributeError) as exc:
            rec.error = "stopped" if self._stop.is_set() else f"{type(exc).__name__}: {exc}"[:200]

    @staticmethod
    def _chunks(r: requests.Response) -> Iterator[dict]:
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            chunk = json.loads(data)
            if chunk.get("choices"):
                yield chunk

    def _spawn(self, seed: int) -> None:
        t = threading.Thread(target=self._send, args=(random.Random(seed),), daemon=True)
        t.start()
        self._threads.append(t)

    # ------------------------------------------------------------------ shapes
    def open_loop(self, load: OpenLoop) -> None:
        """Arrivals for the phases' total time (blocks until the last is sent)."""
        t = time.monotonic()
        for phase in load.phases:
            t = self._arrivals(t, phase.rate, t + phase.seconds)
            if self._stop.wait(max(0.0, t - time.monotonic())):
                return

    def _arrivals(self, t: float, rate: float, end: float) -> float:
        """Poisson arrivals at ``rate`` from monotonic time ``t`` until ``end``; returns ``end``
        (or where ``stop`` cut them short)."""
        if not self.rates or self.rates[-1][1] != rate:
            self.rates.append((t - self._began, rate))
        while rate > 0:
            t += self.rng.expovariate(rate)
            if t >= end:
                break
            if self._stop.wait(max(0.0, t - time.monotonic())):
                return t
            self._spawn(self.rng.getrandbits(32))
        return end

    def overload(self, load: Overload, limited: Limited) -> float:
        """``load`` (class docstring); blocks until its end and returns its length in seconds.
        Its decisions depend on ``limited``'s answers and the requests finished alone, not on
        how late the checks run."""
        self.closed_loop(load.opening)
        t = self._began + load.opening.seconds
        rate, raised, raises = load.rate, t, 0
        over, ceiling = t + load.longest, float("inf")
        while t < over and not self._stop.is_set():
            t = self._arrivals(t, rate, min(t + load.check, over))
            if self._stop.wait(max(0.0, t - time.monotonic())):
                break
            if limited(load.by, load.lookback) >= 0.5:
                if self.limited_at is None:  # the rate found is at the engine's service rate: go clearly above it
                    self.limited_at = t - self._began
                    over = min(over, t + load.hold)
                    rate *= load.factor
                    ceiling = rate * load.factor
                rate = min(max(rate, load.over_service * self.served(load.lookback)), ceiling)
            elif t - raised >= load.patience and limited(load.by, load.patience) < 0.5 and raises < load.raises:
                rate, raised, raises = rate * load.factor, t, raises + 1
        return self._drain(load, limited, t) - self._began

    def _drain(self, load: Overload, limited: Limited, t: float) -> float:
        """No arrivals from ``t`` until ``settle`` seconds after admission stopped being limited
        (or ``drain`` seconds); returns where the drain ended (monotonic seconds)."""
        end, free_since = t + load.drain, None
        self._arrivals(t, 0.0, t)  # logs the rate's end
        while t < end and not self._stop.is_set():
            t = self._arrivals(t, 0.0, min(t + load.check, end))
            if self._stop.wait(max(0.0, t - time.monotonic())):
                break
            if limited(load.by, load.lookback) >= 0.5:
                free_since = None
            else:
                free_since = t if free_since is None else free_since
                if t - free_since >= load.settle:
                    break
        return t

    def served(self, seconds: float) -> float:
        """Requests answered to their end per second over the last ``seconds``."""
        since = time.time() - seconds
        with self._lock:
            return sum(r.finished is not None and r.finished >= since and not r.error for r in self.records) / seconds

    def closed_loop(self, load: ClosedLoop) -> None:
        """``clients`` loops until ``seconds`` have passed (blocks that long)."""
        end = time.monotonic() + load.seconds

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end and not self._stop.is_set():
                self._send(rng)

        clients = [threading.Thread(target=client, args=(self.rng.getrandbits(32),), daemon=True) for _ in range(load.clients)]
        for c in clients:
            c.start()
            self._threads.append(c)
        self._stop.wait(max(0.0, end - time.monotonic()))

    def run(self, load: OpenLoop | ClosedLoop | Overload, limited: Limited | None = None) -> float:
        """``load`` from now on (blocks until its end); returns its length in seconds. An
        ``Overload`` needs ``limited``: what the engine's scheduler decided lately."""
        self._began = time.monotonic()
        if isinstance(load, Overload):
            if limited is None:
                raise ValueError("an Overload follows the engine: it needs what limited its admission (limited=)")
            return self.overload(load, limited)
        if isinstance(load, OpenLoop):
            self.open_loop(load)
        else:
            self.closed_loop(load)
        return load.seconds

    def stop(self, wait: float = 30.0) -> None:
        """Close every open stream (the server aborts those requests) and join the clients."""
        self._stop.set()
        with self._lock:
            for r in list(self._open):
                _abort(r)
        deadline = time.monotonic() + wait
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
