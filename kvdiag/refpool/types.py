"""Records shared by both engines' reference schedulers, the KV store and the engine loop.

The engine loop (``sim.py``) drives either engine's reference scheduler through the same
small protocol, so one workload can run on both and the emitted metrics can be compared with
what the pool really did. Everything here is engine-neutral; the engine sides live in
``refpool/sglang/`` and ``refpool/vllm/`` and use their engine's own vocabulary.
"""

from __future__ import annotations

import copyreg
import zlib
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, Sequence, cast

import numpy as np

_MASK = (1 << 61) - 1


def token_key(prev_key: int, token: int) -> int:
    """Key of a token's KV given the key of the token before it.

    A token's KV depends on every token before it (attention), so the key chains the whole
    prefix: two slots hold equal KV exactly when their keys are equal. The store writes bytes
    derived from the key, which makes prefix hits, demote/load-back and slot reuse checkable
    byte for byte.
    """
    return ((prev_key * 1_000_003) ^ (token + 0x9E3779B97F4A7C15)) & _MASK


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's multipliers


def output_ids(rid: str, n: int) -> list[int]:
    """The first ``n`` output token ids of request ``rid`` (see ``SimRequest.next_token``):
    splitmix64 of ``crc32(rid) << 32 | position``, 24 bits of it, moved above the prompt
    vocabulary. Vectorised over the answer: a run generates tens of thousands of tokens per
    simulated second, and a Python-level hash per token cost more than the scheduling."""
    x = np.arange(n, dtype=np.uint64) + np.uint64(zlib.crc32(rid.encode()) << 32)
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return ((x & np.uint64(0xFFFFFF)) + np.uint64(1_000_000)).tolist()


def pickle_by_fields(*classes: type) -> None:
    """Pickle these frozen dataclasses as a call of their constructor on their fields.

    Worker processes (validate's scenarios, whatif's replays) receive workloads and return
    records pickled. A mypyc-compiled class restores a pickled instance by setting its
    attributes one by one, which a frozen dataclass's ``__setattr__`` refuses; registered with
    ``copyreg``, the pure and the compiled build pickle alike."""
    for cls in classes:
        copyreg.pickle(cls, _by_fields)


def _by_fields(obj: Any) -> tuple[type, tuple[object, ...]]:
    return type(obj), tuple(getattr(obj, f.name) for f in fields(obj))


def prefix_keys(tokens: Sequence[int], start_key: int = 0) -> list[int]:
    """Keys of every position of ``tokens`` (position i covers tokens[0..i])."""
    out = []
    k = start_key
    for t in tokens:
        k = token_key(k, t)
        out.append(k)
    return out


@dataclass(eq=False)
class SimRequest:
    """One request as the simulated engine sees it, with its ground-truth timeline."""

    rid: str
    arrival: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    output_len: int  # tokens it generates before EOS (ground truth, <= max_new_tokens)
    ignore_eos: bool = False
    output: list[int] = field(default_factory=list)
    # Ground truth, filled by the loop and the schedulers.
    first_scheduled: float | None = None  # first forward: end of the queue time
    first_token: float | None = None
    finished: float | None = None
    evictions: int = 0  # times retracted (SGLang) or preempted (vLLM)
    recomputed_tokens: int = 0  # KV thrown away by those evictions
    device_hit_tokens: int = 0  # L1 prefix hit at first admission
    host_hit_tokens: int = 0  # L2 hit loaded back at first admission
    _output_ids: list[int] = field(default_factory=list, init=False, repr=False)  # next_token's answers, computed ahead

    def next_token(self) -> int:
        """Deterministic id of the next output token, a function of the request id and the
        position, stable across processes (``hash()`` of a string is salted per process), so
        replays are identical.

        The ids of the whole answer are computed at the first call (``output_ids``), not one
        per request per decode step, which dominated the engine loop.
        """
        n = len(self.output)
        ids = self._output_ids
        if n >= len(ids):
            ids = self._output_ids = output_ids(self.rid, max(n + 1, self.output_len, 2 * n))  # past EOS: doubling
        return ids[n]

    def next_tokens(self, n: int) -> list[int]:
        """The ids of the next ``n`` output tokens, as ``n`` calls of ``next_token`` would give
        them (a request advanced several decode steps at once)."""
        k = len(self.output)
        return self.answer(k + n)[k : k + n]

    def answer(self, n: int) -> list[int]:
        """The output ids computed ahead, at least ``n`` of them (``output`` is always their
        prefix); the list is shared, not a copy."""
        ids = self._output_ids
        if n > len(ids):
            ids = self._output_ids = output_ids(self.rid, max(n, self.output_len, 2 * len(self.output)))
        return ids

    @property
    def all_tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.output_len


@dataclass(slots=True)
class ScheduledChunk:
    """Work for one request in one engine step (slots: one is built per running request per step)."""

    req: SimRequest
    num_new_tokens: int  # tokens whose KV is computed this step (prefill chunk, or 1 for decode)
    num_context_tokens: int  # tokens already in L1 for this request before the step
    is_prefill: bool


@dataclass
class StepPlan:
    """What a scheduler decided for one engine iteration."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    evicted: list[SimRequest] = field(default_factory=list)  # retracted / preempted this step
    loaded_tokens: int = 0  # L2 -> L1 tokens copied for this step
    stored_tokens: int = 0  # L1 -> L2 tokens copied for this step
    blocked_on_kv: bool = False  # a waiting request was refused for lack of KV (ground truth)
    blocked_other: bool = False  # a waiting request was refused for another cap (seqs, budget)
    # One-token decodes not listed in ``chunks`` (a scheduler's batch-level decode accounting):
    # how many, and their requests' tokens already in L1 before the step, summed.
    decode_batch: int = 0
    decode_context: int = 0

    @property
    def idle(self) -> bool:
        return not self.chunks and not self.decode_batch


@dataclass(frozen=True)
class DecodeRun:
    """Upcoming iterations that are identical one-token decodes of the same ``batch`` requests.

    A scheduler offers one (``FastForward.decode_run``) only when, for each of ``max_steps``
    steps, the normal ``schedule`` / ``update_from_output`` pair would admit nobody (the queue is
    empty, or refused without side effects), finish, retract or preempt nobody, publish no
    report, and serve every allocation from free slots without a merge or an eviction. Then the
    steps differ only in each request's context (+1 per step), which the engine loop's step-time
    model takes in aggregate, and they can be taken at once, exactly.
    """

    max_steps: int
    batch: int  # requests decoding each step
    context_tokens: int  # sum of their tokens already in L1 before the first step
    blocked_on_kv: bool  # the same on every step (see StepPlan)
    blocked_other: bool
    waiting: int  # requests queued, as the metrics hook's truth counts them
    #: The queue is refused by a latch that a new request does not lift (SGLang's
    #: ``batch_is_full``): requests arriving during the run join it and change nothing else,
    #: unless ``add_request`` rejects one, which withdraws the offer.
    queue_latched: bool = False


pickle_by_fields(DecodeRun)


class FastForward(Protocol):
    """Optional extension of ``EngineScheduler``: take a ``DecodeRun`` in one call."""

    def decode_run(self) -> DecodeRun | None: ...

    def advance_decode(self, steps: int) -> list[int]:
        """Apply ``steps`` (at most the offered ``max_steps``) exactly as that many schedule /
        update_from_output pairs would; return the used tokens of the pool after each step, in
        the convention of the engine's metrics hook."""
        ...


class BatchDecoding(Protocol):
    """Optional extension of ``EngineScheduler``: one-token decodes accounted for the batch at
    once (``StepPlan.decode_batch``), each request's own fields brought up to date only where
    the scheduler needs them. The pool, the counters and every step's plan totals stay exactly
    the step-by-step loop's; the requests' fields are only up to date after ``sync``."""

    def enable_batch_decode(self) -> None:
        """Switch it on where the scheduler's configuration allows (before the first request)."""
        ...

    def sync(self) -> None:
        """Bring every live request's fields (tokens, output) up to date, for a reader outside."""
        ...


def batch_decoding(scheduler: object) -> BatchDecoding | None:
    """``scheduler`` as a ``BatchDecoding`` where it has the protocol's methods, else None.

    Asked of the methods, not by ``isinstance`` against a ``runtime_checkable`` protocol: mypyc
    compiles a protocol class to a plain class, which ``typing`` then refuses to check against."""
    if hasattr(scheduler, "enable_batch_decode") and hasattr(scheduler, "sync"):
        return cast(BatchDecoding, scheduler)
    return None


class KVStore(Protocol):
    """Where KV bytes live. ``tier`` is "device" (L1) or "host" (L2)."""

    def write(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> None: ...

    def copy(self, src_tier: str, src_slots: Sequence[int], dst_tier: str, dst_slots: Sequence[int]) -> None: ...

    def verify(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> bool: ...


class NullStore:
    """Accounting-only mode: no bytes move, every verify passes."""

    def write(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> None:
        return None

    def copy(self, src_tier: str, src_slots: Sequence[int], dst_tier: str, dst_slots: Sequence[int]) -> None:
        return None

    def verify(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> bool:
        return True


class EngineScheduler(Protocol):
    """The protocol the engine loop drives; both engine sides implement it."""

    def add_request(self, req: SimRequest) -> None: ...

    def schedule(self, now: float) -> StepPlan: ...

    def update_from_output(self, plan: StepPlan, now: float) -> list[SimRequest]:
        """Append one output token to every request whose prefill completed or that decoded
        this step, release finished requests, and return them."""
        ...

    def has_work(self) -> bool: ...

    def idle(self) -> None:
        """An iteration of the engine's loop with nothing to run (the loop polls while idle:
        SGLang resets its new_token_ratio there)."""
        ...

    def check_invariants(self) -> None: ...
