"""KV storage: bytes follow keys exactly through writes, copies and slot reuse; sizes match
``kvdiag capacity`` for real model shapes. Every test runs on both backends; without torch the
torch half is reported as skipped (with the reason), never as passing."""

from __future__ import annotations

import importlib.util

import pytest

from kvdiag.capacity import DTYPE_BYTES, MODELS
from kvdiag.refpool.storage import SMALL_LAYOUT, KVLayout, KVStorage, key_patterns
from kvdiag.refpool.types import prefix_keys

HAS_TORCH = importlib.util.find_spec("torch") is not None
BACKENDS = [
    "numpy",
    pytest.param("torch", marks=pytest.mark.skipif(not HAS_TORCH, reason="torch not installed: numpy path tested instead")),
]
MLA_LAYOUT = KVLayout(layers=3, latent_dim=12)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def make(backend: str, layout: KVLayout = SMALL_LAYOUT, device: int = 64, host: int = 32) -> KVStorage:
    # torch_device="cpu": the same torch code that runs on CUDA, on the CPU.
    store = KVStorage(layout, device, host, backend=backend, torch_device="cpu" if backend == "torch" else None)
    assert store.backend == backend
    return store


@pytest.mark.parametrize("layout", [SMALL_LAYOUT, MLA_LAYOUT, KVLayout(layers=2, kv_heads=1, head_dim=4, dtype_bytes=1)])
def test_write_then_verify_is_exact(backend: str, layout: KVLayout) -> None:
    store = make(backend, layout)
    keys = prefix_keys(range(20))
    slots = list(range(5, 25))
    store.write("device", slots, keys)
    assert store.verify("device", slots, keys)
    assert not store.verify("device", slots, keys[1:] + keys[:1])
    assert not store.verify("device", slots[:1], prefix_keys([7]))  # another prefix, same length
    assert not store.verify("device", [0], keys[:1])  # never written: zeros


def test_a_prefix_hit_reads_the_same_bytes_only_for_the_same_prefix(backend: str) -> None:
    """Two requests sharing a prefix share keys exactly over it and differ right after."""
    store = make(backend)
    a, b = prefix_keys([1, 2, 3, 4]), prefix_keys([1, 2, 9, 4])
    store.write("device", [10, 11, 12, 13], a)
    assert store.verify("device", [10, 11], b[:2])
    assert not store.verify("device", [12], b[2:3])
    assert not store.verify("device", [13], b[3:4])  # same token, different prefix


def test_demote_and_load_back_are_byte_exact(backend: str) -> None:
    store = make(backend)
    keys = prefix_keys(range(100, 116))
    dev, host = list(range(1, 17)), list(range(16, 32))
    store.write("device", dev, keys)
    store.copy("device", dev, "host", host)  # demote
    store.write("device", dev, prefix_keys(range(500, 516)))  # slots reused by another request
    assert not store.verify("device", dev, keys)
    assert store.verify("host", host, keys)
    back = list(range(40, 56))
    store.copy("host", host, "device", back)  # load back into different slots
    assert store.verify("device", back, keys)


def test_slot_reuse_overwrites_every_byte(backend: str) -> None:
    store = make(backend)
    old, new = prefix_keys([1, 2, 3]), prefix_keys([4, 5, 6])
    store.write("device", [3, 4, 5], old)
    store.write("device", [3, 4, 5], new)
    assert store.verify("device", [3, 4, 5], new)
    assert not store.verify("device", [3], old[:1])


def test_every_row_of_a_token_is_checked(backend: str) -> None:
    """Corrupting one element of one layer is caught, and K and V (and layers) hold different
    bytes, so a copy that moved the wrong part of a token would not verify."""
    store = make(backend)
    keys = prefix_keys([42])
    store.write("device", [7], keys)
    t = store._tensors["device"]
    assert not bool((t[7, 0, 0] == t[7, 0, 1]).all())  # K and V differ
    assert not bool((t[7, 0] == t[7, 1]).all())  # layers differ
    t[7, 1, 1, 1, 3] += 1
    assert not store.verify("device", [7], keys)


def test_bad_arguments_raise(backend: str) -> None:
    store = make(backend)
    with pytest.raises(IndexError):
        store.write("device", [64], prefix_keys([1]))
    with pytest.raises(IndexError):
        store.verify("host", [-1], prefix_keys([1]))
    with pytest.raises(ValueError):
        store.write("device", [1, 2], prefix_keys([1]))
    with pytest.raises(ValueError):
        store.copy("device", [1, 2], "host", [1])
    with pytest.raises(ValueError):
        store.write("disk", [1], prefix_keys([1]))


def test_large_writes_are_batched_without_changing_bytes(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvdiag.refpool.storage._CHUNK_BYTES", SMALL_LAYOUT.bytes_per_token * 3)
    store = make(backend)
    keys = prefix_keys(range(10))
    store.write("device", range(10), keys)
    store.copy("device", range(10), "host", range(20, 30))
    assert store.verify("host", range(20, 30), keys)
    monkeypatch.undo()
    assert make(backend).verify("device", [], [])


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("tp", [1, 8])
def test_nbytes_matches_capacity_presets(backend: str, name: str, kv_dtype: str, tp: int) -> None:
    """The tensors a real model shape allocates are exactly what ``kvdiag capacity`` charges."""
    spec = MODELS[name]
    layout = KVLayout.from_model(spec, kv_dtype, tp)
    store = make(backend, layout, device=3, host=2)
    per_token = spec.kv_bytes_per_token_per_gpu(DTYPE_BYTES[kv_dtype], tp)
    assert layout.bytes_per_token == per_token
    assert store.nbytes("device") == 3 * per_token
    assert store.nbytes("host") == 2 * per_token
    assert layout.is_mla == spec.mla


def test_seed_figures() -> None:
    """Llama-3-70B bf16 is 320 KiB per token; DeepSeek-V3's MLA latent is ~68.6 KiB, with its
    own [layers, latent] layout rather than heads."""
    assert KVLayout.from_model(MODELS["llama-3-70b"]).bytes_per_token == 320 * 1024
    mla = KVLayout.from_model(MODELS["deepseek-v3"])
    assert mla.token_shape == (61, 576)
    assert round(mla.bytes_per_token / 1024, 1) == 68.6


def test_layout_rejects_half_specified_shapes() -> None:
    with pytest.raises(ValueError):
        KVLayout(layers=2)
    with pytest.raises(ValueError):
        KVLayout(layers=2, kv_heads=2, head_dim=8, latent_dim=4)
    with pytest.raises(ValueError):
        KVLayout(layers=2, kv_heads=2, head_dim=8, dtype_bytes=3)


def test_auto_backend_prefers_torch_when_present() -> None:
    store = KVStorage(SMALL_LAYOUT, 4, 0)
    assert store.backend == ("torch" if HAS_TORCH else "numpy")


def test_key_patterns_are_deterministic_and_spread() -> None:
    p = key_patterns([1, 2, 3], 8)
    assert (p == key_patterns([1, 2, 3], 8)).all()
    assert len({tuple(row) for row in p.tolist()}) == 3
    assert len(set(p[0].tolist())) == 8
