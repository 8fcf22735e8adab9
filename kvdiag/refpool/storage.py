"""Real KV bytes for the reference pool: one tensor per tier, written from each token's key.

The schedulers only count slots; this store is what makes their counting checkable. Every
written token's KV is a deterministic function of its prefix key (``types.token_key``), so a
prefix hit, a demote to host and load back, or a reused slot can be compared byte for byte
with what that token's KV must be (``verify``). A store for a real model shape allocates
exactly ``kv_bytes_per_token × slots`` per tier, which validates ``kvdiag capacity``'s figures.

Tensors are ``[slots, layers, 2, kv_heads, head_dim]`` (MHA/GQA) or ``[slots, layers, latent]``
(MLA: one compressed latent of ``kv_lora_rank + rope_dim`` per layer, no K/V split and no
heads). The element type is an integer of the KV dtype's width (bf16 → int16, fp8 → int8):
only the bytes matter, and integer comparison has no NaN ≠ NaN trap that a float pattern
would set. torch (CUDA when present, else CPU) is used when importable, numpy otherwise;
``backend=`` forces one. The accounting-only mode is ``types.NullStore``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from kvdiag.capacity import DTYPE_BYTES, ModelSpec

TIERS = ("device", "host")
_INT_DTYPES = {1: "int8", 2: "int16", 4: "int32"}  # signed: torch has no full uint16/uint32
_CHUNK_BYTES = 64 << 20  # bound on the temporary pattern built per write/verify batch
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class KVLayout:
    """Per-token KV shape of one model on one GPU (after tensor-parallel sharding)."""

    layers: int
    kv_heads: int = 0  # MHA/GQA heads on this GPU; 0 for MLA
    head_dim: int = 0
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim; 0 for MHA/GQA
    dtype_bytes: int = 2  # bf16/fp16 2, fp8 1, fp32 4

    def __post_init__(self) -> None:
        if self.dtype_bytes not in _INT_DTYPES:
            raise ValueError(f"dtype_bytes must be one of {sorted(_INT_DTYPES)}, got {self.dtype_bytes}")
        mha = self.kv_heads > 0 and self.head_dim > 0
        if self.layers < 1 or mha == (self.latent_dim > 0):
            raise ValueError("a layout is either MHA/GQA (kv_heads, head_dim) or MLA (latent_dim), with layers >= 1")

    @classmethod
    def from_model(cls, model: ModelSpec, kv_dtype: str = "bf16", tp: int = 1) -> KVLayout:
        """The layout one GPU of a TP group holds: KV heads split across ranks (at least one
        each), an MLA latent whole on every rank, as ``capacity`` counts them."""
        dtype_bytes = DTYPE_BYTES[kv_dtype]
        if model.mla:
            return cls(model.layers, latent_dim=model.kv_lora_rank + (model.qk_rope_head_dim or 0), dtype_bytes=dtype_bytes)  # type: ignore[operator]
        return cls(model.layers, kv_heads=math.ceil(model.kv_heads / tp), head_dim=model.head_dim, dtype_bytes=dtype_bytes)

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @property
    def token_shape(self) -> tuple[int, ...]:
        if self.is_mla:
            return (self.layers, self.latent_dim)
        return (self.layers, 2, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """MHA/GQA: 2·L·h_kv·d·bytes; MLA: L·(kv_lora_rank + rope_dim)·bytes."""
        return math.prod(self.token_shape) * self.dtype_bytes


#: Small shape used by default: tests and byte-checked simulations stay cheap.
SMALL_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8)


def key_patterns(keys: Sequence[int], width: int) -> np.ndarray:
    """``[len(keys), width]`` uint64 pattern, a splitmix64 mix of each key and the column.

    Vectorised over keys and columns; a single differing key bit changes every column."""
    z = np.asarray(keys, dtype=np.uint64)[:, None] + _GOLDEN * (np.arange(1, width + 1, dtype=np.uint64)[None, :])
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class KVStorage:
    """KV tensors for the "device" (L1) and "host" (L2) tiers, implementing ``types.KVStore``.

    ``device_slots`` / ``host_slots`` count token slots, indexed as the engine indexes them
    (SGLang: slot 0 is padding, so pass ``max_total_num_tokens + page_size``; vLLM:
    ``num_gpu_blocks × block_size``, slot = block_id × block_size + offset).
    """

    def __init__(
        self,
        layout: KVLayout = SMALL_LAYOUT,
        device_slots: int = 0,
        host_slots: int = 0,
        backend: Literal["auto", "torch", "numpy"] = "auto",
        torch_device: str | None = None,
    ) -> None:
        self.layout = layout
        self._torch = _import_torch(backend)
        self.backend = "torch" if self._torch is not None else "numpy"
        dtype = _INT_DTYPES[layout.dtype_bytes]
        self._np_dtype = np.dtype(dtype)
        self._np_udtype = np.dtype("u" + dtype)  # same width, for wrapping casts from uint64
        rows = math.prod(layout.token_shape[:-1])
        # Per-row salt so that layers, K and V, and heads of one token all hold different bytes:
        # a copy that moved the wrong layer or swapped K and V would not verify.
        salt = (np.arange(rows, dtype=np.uint64) * np.uint64(0x2545F4914F6CDD1D)).astype(self._np_udtype)
        self._salt_np = salt.view(self._np_dtype)[None, :, None]
        self._tensors: dict[str, Any] = {}
        if self._torch is not None:
            torch = self._torch
            dev = torch_device or ("cuda" if torch.cuda.is_available() else "cpu")
            self.torch_device = dev
            self._torch_dtype = getattr(torch, dtype)
            self._salt = torch.from_numpy(self._salt_np.copy()).to(dev)
            self._tensors["device"] = torch.zeros((device_slots, *layout.token_shape), dtype=self._torch_dtype, device=dev)
            self._tensors["host"] = torch.zeros((host_slots, *layout.token_shape), dtype=self._torch_dtype, device="cpu")
        else:
            self.torch_device = None
            self._tensors["device"] = np.zeros((device_slots, *layout.token_shape), dtype=self._np_dtype)
            self._tensors["host"] = np.zeros((host_slots, *layout.token_shape), dtype=self._np_dtype)

    # ------------------------------------------------------------------ sizes
    def num_slots(self, tier: str) -> int:
        return int(self._tier(tier).shape[0])

    def nbytes(self, tier: str = "device") -> int:
        """Bytes actually allocated for ``tier``: ``bytes_per_token × slots`` by construction,
        measured from the tensor so a layout mistake cannot hide."""
        t = self._tier(tier)
        return int(t.numel() * t.element_size()) if self._torch is not None else int(t.nbytes)

    # ------------------------------------------------------------------ KVStore
    def write(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> None:
        """Write each key's KV into its slot (a reused slot is simply overwritten)."""
        dst = self._tier(tier)
        idx = self._index(tier, slots)
        if len(keys) != len(idx):
            raise ValueError(f"{len(idx)} slots but {len(keys)} keys")
        for lo, hi in self._batches(len(idx)):
            dst[self._on(tier, idx[lo:hi])] = self._expected(tier, keys[lo:hi])

    def copy(self, src_tier: str, src_slots: Sequence[int], dst_tier: str, dst_slots: Sequence[int]) -> None:
        """Move KV between tiers or slots (demote D→H, load back H→D) without looking at keys."""
        src, dst = self._tier(src_tier), self._tier(dst_tier)
        s_idx, d_idx = self._index(src_tier, src_slots), self._index(dst_tier, dst_slots)
        if len(s_idx) != len(d_idx):
            raise ValueError(f"copy of {len(s_idx)} slots into {len(d_idx)}")
        for lo, hi in self._batches(len(s_idx)):
            block = src[self._on(src_tier, s_idx[lo:hi])]
            if self._torch is not None:
                block = block.to(dst.device)
            dst[self._on(dst_tier, d_idx[lo:hi])] = block

    def verify(self, tier: str, slots: Sequence[int], keys: Sequence[int]) -> bool:
        """True when every slot holds exactly the bytes its key's KV must have."""
        src = self._tier(tier)
        idx = self._index(tier, slots)
        if len(keys) != len(idx):
            raise ValueError(f"{len(idx)} slots but {len(keys)} keys")
        for lo, hi in self._batches(len(idx)):
            got = src[self._on(tier, idx[lo:hi])]
            want = self._expected(tier, keys[lo:hi])
            same = self._torch.equal(got, want) if self._torch is not None else np.array_equal(got, want)
            if not same:
                return False
        return True

    # ------------------------------------------------------------------ internals
    def _tier(self, tier: str) -> Any:
        try:
            return self._tensors[tier]
        except KeyError:
            raise ValueError(f"unknown tier {tier!r}; tiers are {TIERS}") from None

    def _index(self, tier: str, slots: Sequence[int]) -> np.ndarray:
        """Slots as an int64 array, bounds-checked on the CPU (a bad index on CUDA would be a
        device-side assert, not an exception)."""
        idx = np.asarray(slots, dtype=np.int64).reshape(-1)
        n = self.num_slots(tier)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"slot out of range for tier {tier!r} with {n} slots")
        return idx

    def _on(self, tier: str, idx: np.ndarray) -> Any:
        if self._torch is None:
            return idx
        return self._torch.from_numpy(idx).to(self._tier(tier).device)

    def _batches(self, n: int) -> list[tuple[int, int]]:
        step = max(1, _CHUNK_BYTES // self.layout.bytes_per_token)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _expected(self, tier: str, keys: Sequence[int]) -> Any:
        """The KV bytes of ``keys``: the key pattern broadcast over every row, salted per row."""
        shape = self.layout.token_shape
        width = shape[-1]
        pat = key_patterns(keys, width).astype(self._np_udtype).view(self._np_dtype)
        if self._torch is None:
            return (pat[:, None, :] ^ self._salt_np).reshape(len(keys), *shape)
        t = self._torch.from_numpy(pat).to(self._tier(tier).device)
        salt = self._salt if t.device == self._salt.device else self._salt.to(t.device)
        return (t[:, None, :] ^ salt).reshape(len(keys), *shape)


def _import_torch(backend: str) -> Any:
    """The torch module when the backend asks for (or allows) it, else None."""
    if backend not in ("auto", "torch", "numpy"):
        raise ValueError(f"backend must be auto, torch or numpy, got {backend!r}")
    if backend == "numpy":
        return None
    try:
        import torch
    except ImportError:
        if backend == "torch":
            raise
        return None
    return torch
