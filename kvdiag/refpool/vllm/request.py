"""The engine's view of one request, mirroring ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).

The loop hands the scheduler engine-neutral ``SimRequest`` records; vLLM's scheduler and KV cache
manager reason about a ``Request`` with a status, ``num_computed_tokens``, ``num_preemptions`` and
``block_hashes`` (one hash per *full* block of prompt + output, extended as tokens are appended).
This wrapper supplies exactly those fields so the pool code reads like vLLM's.
"""

from __future__ import annotations

import enum

from kvdiag.refpool.types import SimRequest, chain_key, token_key


class RequestStatus(enum.Enum):
    """The subset of ``vllm.v1.request.RequestStatus`` a single-engine run goes through."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # finished_reason "stop" (EOS)
    FINISHED_LENGTH_CAPPED = enum.auto()  # finished_reason "length" (max_tokens or max_model_len)


class Request:
    """A ``SimRequest`` plus the scheduler state vLLM keeps on ``Request``.

    ``token_keys[i]`` is the KV key of position i (it chains the whole prefix, see
    ``types.token_key``); the hash of full block b is the key of its last token, which chains the
    parent block hash and the block's tokens exactly like vLLM's ``hash_block_tokens``.

    ``track_keys=False`` (accounting-only runs, where no KV byte is written or verified) keeps no
    per-token keys: each block hash is folded from the parent hash over the block's tokens when
    the block fills (``types.chain_key``), the same values without a list of every position.
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
        self._append(sim.all_tokens)

    def _append(self, tokens: tuple[int, ...]) -> None:
        bs = self.block_size
        if self.track_keys:
            keys = self.token_keys
            for t in tokens:
                keys.append(token_key(keys[-1] if keys else 0, t))
                if len(keys) % bs == 0:
                    self.block_hashes.append(keys[-1])
            self.num_tokens = len(keys)
            return
        self.num_tokens += len(tokens)
        self._hash_full_blocks()

    def _hash_full_blocks(self) -> None:
        """Fold the hashes of blocks that became full (accounting-only: no per-token keys)."""
        bs, hashes = self.block_size, self.block_hashes
        while len(hashes) < self.num_tokens // bs:
            lo = len(hashes) * bs
            hashes.append(chain_key(hashes[-1] if hashes else 0, self._tokens(lo, lo + bs)))

    def _tokens(self, lo: int, hi: int) -> tuple[int, ...]:
        """Tokens ``lo..hi-1`` of prompt + output, without concatenating the whole sequence."""
        prompt, out = self.sim.prompt, self.sim.output
        p = len(prompt)
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
            self._append((token_id,))
            return
        self.num_tokens += 1  # one token fills at most one block: the only hash that can be due
        if self.num_tokens % self.block_size == 0:
            self._hash_full_blocks()

    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, computed={self.num_computed_tokens}, "
            f"tokens={self.num_tokens}, preemptions={self.num_preemptions})"
        )
