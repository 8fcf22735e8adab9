"""The engine's view of one request, mirroring ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).

The loop hands the scheduler engine-neutral ``SimRequest`` records; vLLM's scheduler and KV cache
manager reason about a ``Request`` with a status, ``num_computed_tokens``, ``num_preemptions`` and
``block_hashes`` (one hash per *full* block of prompt + output, extended as tokens are appended).
This wrapper supplies exactly those fields so the pool code reads like vLLM's.
"""

from __future__ import annotations

import enum

from kvdiag.refpool.types import SimRequest, token_key


class RequestStatus(enum.Enum):
    """The subset of ``vllm.v1.request.RequestStatus`` a single-engine run goes through."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks held while an asynchronous CPU load runs
    FINISHED_STOPPED = enum.auto()  # finished_reason "stop" (EOS)
    FINISHED_LENGTH_CAPPED = enum.auto()  # finished_reason "length" (max_tokens or max_model_len)


def hash_block_tokens(parent_block_hash: int, curr_block_token_ids: tuple[int, ...]) -> int:
    """vLLM's ``kv_cache_utils.hash_block_tokens``: the parent's hash and this block's tokens,
    so a block hash names its whole prefix.

    vLLM hashes with sha256 by default (earlier releases used the builtin ``hash``, as here). The
    pool only compares hashes for equality, so one C-level tuple hash per block serves: hashing
    every prompt's blocks at arrival by folding a key over each token was a fifth of an
    accounting-only run. ``hash`` of ints and tuples is not salted per process (only str and
    bytes are), so runs replay identically; the first block's parent is 0, not None, whose hash
    is an address before Python 3.12.
    """
    return hash((parent_block_hash, curr_block_token_ids))


class Request:
    """A ``SimRequest`` plus the scheduler state vLLM keeps on ``Request``.

    ``block_hashes`` holds one ``hash_block_tokens`` per full block of prompt + output, extended
    as tokens are appended. ``token_keys[i]`` is the KV key of position i (it chains the whole
    prefix, see ``types.token_key``): what the store writes and verifies. Accounting-only runs
    (``track_keys=False``: no KV byte is written or verified) keep no per-token keys.
    """

    def __init__(self, sim: SimRequest, block_size: int, track_keys: bool = True) -> None:
        self.sim = sim
        self.request_id = sim.rid
        self.block_size = block_size
        self.track_keys = track_keys
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_tokens = 0
        self.token_keys: list[int] = []
        self.block_hashes: list[int] = []
        # Batch-level decode (``batch_decode.py``): admission order in the running list, and
        # while ``steady``, the step its fields are exact at and the step it stops at.
        self.seq = self.anchor = self.stop_step = 0
        self.steady = False
        self._append(sim.all_tokens)

    def _append(self, tokens: tuple[int, ...]) -> None:
        if self.track_keys:
            keys = self.token_keys
            k = keys[-1] if keys else 0
            for t in tokens:
                k = token_key(k, t)
                keys.append(k)
        self.num_tokens += len(tokens)
        self._hash_full_blocks()

    def _hash_full_blocks(self) -> None:
        """Hash the blocks that became full."""
        self.hash_blocks_to(self.num_tokens)

    def hash_blocks_to(self, num_tokens: int) -> None:
        """Hash every full block of the first ``num_tokens`` tokens; a steady request
        (``batch_decode.py``) hashes its answer up to its stop this way, ahead of its output. The blocks' tokens are sliced out of one run (a prompt's ~60
        blocks at arrival were most of a request's cost)."""
        bs, hashes = self.block_size, self.block_hashes
        lo, hi = len(hashes) * bs, num_tokens // bs * bs
        if lo >= hi:
            return
        tokens = self._tokens(lo, hi)
        h = hashes[-1] if hashes else 0
        for i in range(0, hi - lo, bs):
            h = hash_block_tokens(h, tokens[i : i + bs])
            hashes.append(h)

    def _tokens(self, lo: int, hi: int) -> tuple[int, ...]:
        """Tokens ``lo..hi-1`` of prompt + output, without concatenating the whole sequence;
        output tokens not appended yet are the ones ``next_token`` will give."""
        prompt, out = self.sim.prompt, self.sim.output
        p = len(prompt)
        if hi - p > len(out):
            out = self.sim.answer(hi - p)
        if hi <= p:
            return prompt[lo:hi]
        if lo >= p:
            return tuple(out[lo - p : hi - p])
        return prompt[lo:] + tuple(out[: hi - p])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.sim.prompt)

    def append_output_token_ids(self, token_id: int) -> None:
        """Append a sampled token and extend ``block_hashes`` when a block becomes full."""
        self.sim.output.append(token_id)
        if self.track_keys:
            keys = self.token_keys
            keys.append(token_key(keys[-1] if keys else 0, token_id))
        self.num_tokens += 1  # one token fills at most one block: the only hash that can be due
        if self.num_tokens % self.block_size == 0:
            self._hash_full_blocks()

    def append_output_tokens(self, n: int) -> None:
        """``n`` sampled tokens at once (a steady request brought up to date), as ``n`` calls
        of ``append_output_token_ids``; accounting-only (no per-token keys)."""
        assert not self.track_keys
        self.sim.output.extend(self.sim.next_tokens(n))
        self.num_tokens += n
        self._hash_full_blocks()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, computed={self.num_computed_tokens}, "
            f"tokens={self.num_tokens}, preemptions={self.num_preemptions})"
        )
