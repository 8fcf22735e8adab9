"""`kvdiag capacity`: the seed's figures, the presets' facts, HF configs and the JSON shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiag import cli
from kvdiag.capacity import DTYPE_BYTES, GIB, GPUS, MODELS, Plan, from_hf_config, model

LLAMA70 = MODELS["llama-3-70b"]
DSV3 = MODELS["deepseek-v3"]


def test_llama3_70b_bf16_is_320_kib_per_token() -> None:
    assert LLAMA70.kv_bytes_per_token(2) == 327_680 == 320 * 1024
    assert LLAMA70.kv_bytes_per_token(DTYPE_BYTES["fp8"]) == 163_840


def test_60_gib_per_gpu_at_tp8_is_1_57m_tokens_48_at_32k_12_at_128k() -> None:
    p = Plan(LLAMA70, "bf16", 8, 60 * GIB)
    assert p.kv_bytes_per_token_per_gpu == 40_960  # one KV head per GPU
    assert p.pool_tokens == 1_572_864
    assert (p.concurrency(32_768), p.concurrency(131_072)) == (48, 12)


def test_deepseek_v3_mla_is_68_6_kib_and_9_gb_per_128k_request() -> None:
    per_token = DSV3.kv_bytes_per_token(2)
    assert per_token == (512 + 64) * 61 * 2 == 70_272
    assert round(per_token / 1024, 1) == 68.6
    assert round(131_072 * per_token / 1e9) == 9
    # An MLA latent is replicated on every TP rank, not sharded.
    assert DSV3.kv_bytes_per_token_per_gpu(2, tp=8) == per_token


def test_tp_beyond_kv_heads_replicates_heads() -> None:
    assert LLAMA70.kv_bytes_per_token_per_gpu(2, tp=16) == LLAMA70.kv_bytes_per_token_per_gpu(2, tp=8)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_preset_shapes_reproduce_their_published_parameter_counts(name: str) -> None:
    """The shapes are the facts; the parameter count they imply must match the model card."""
    m = MODELS[name]
    assert m.estimated_params() == pytest.approx(m.params, rel=0.01)


def test_moe_active_parameters() -> None:
    for m in (MODELS["mixtral-8x7b"], DSV3):
        assert m.active_params < m.params and m.experts_per_token > 0


def test_gpu_presets() -> None:
    h100, h200 = GPUS["h100"], GPUS["h200"]
    assert (h100.memory_gb, h100.hbm_bytes_per_s, h100.bf16_dense_flops) == (80, 3.35e12, 989e12)
    assert (h200.memory_gb, h200.hbm_bytes_per_s, h200.bf16_dense_flops) == (141, 4.8e12, 989e12)
    assert h200.memory_bytes == 143_771 * 1024**2  # nvidia-smi's total on an H200


def _hf(tmp_path: Path, cfg: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_from_hf_config_gqa_and_mla(tmp_path: Path) -> None:
    llama = _hf(tmp_path, {
        "num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "_name_or_path": "meta-llama/Meta-Llama-3-70B",
    })  # fmt: skip
    m = from_hf_config(llama)
    assert m.kv_bytes_per_token(2) == 327_680 and m.head_dim == 128 and m.name == "meta-llama/Meta-Llama-3-70B"
    assert m.estimated_params() == pytest.approx(70.6e9, rel=0.01)
    ds = tmp_path / "ds"
    ds.mkdir()
    _hf(ds, {
        "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128,
        "num_key_value_heads": 128, "vocab_size": 129280, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "q_lora_rank": 1536, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
    })  # fmt: skip
    d = from_hf_config(ds / "config.json")
    assert d.mla and d.kv_bytes_per_token(2) == 70_272
    assert d.estimated_params() == pytest.approx(671e9, rel=0.01)


def test_from_hf_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no 'num_attention_heads'; not a decoder config"):
        from_hf_config(_hf(tmp_path, {"hidden_size": 1}))
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="neither a preset"):
        model("llama-9")


def test_cli_json_reproduces_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--model", "llama-3-70b", "--kv-dtype", "bf16", "--tp", "8", "--pool-gib-per-gpu", "60",
            "--context", "32768", "--context", "131072", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 327_680 and out["kv_bytes_per_token_per_gpu"] == 40_960
    assert out["pool_tokens"] == 1_572_864
    assert out["concurrency"] == {"32768": 48, "131072": 12}


def test_cli_from_gpu_memory_subtracts_weights(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--model", "Llama-3-70B", "--tp", "8", "--gpu", "h100", "--mem-fraction", "0.9", "--context", "32768", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    weights = int(70.6e9 * 2 / 8)
    assert out["weight_bytes_per_gpu"] == weights
    assert out["pool_bytes_per_gpu"] == int(81_559 * 1024**2 * 0.9) - weights
    assert out["pool_tokens"] == out["pool_bytes_per_gpu"] // 40_960


def test_cli_fp8_doubles_the_pool_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["capacity", "--model", "llama-3-70b", "--tp", "8", "--pool-gib-per-gpu", "60", "--json"]
    cli.main(base)
    bf16 = json.loads(capsys.readouterr().out)["pool_tokens"]
    cli.main(base + ["--kv-dtype", "fp8"])
    assert json.loads(capsys.readouterr().out)["pool_tokens"] == 2 * bf16


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["capacity", "--model", "llama-3-70b"]) == 3
    assert "--pool-gib-per-gpu" in capsys.readouterr().err
    assert cli.main(["capacity", "--model", "llama-3-70b", "--gpu", "h100", "--tp", "1"]) == 3
    assert "leave no room" in capsys.readouterr().err


def test_cli_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["capacity", "--model", "deepseek-v3", "--tp", "8", "--pool-gib-per-gpu", "40", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "70,272 bytes (68.6 KiB) per token" in out and "MLA latent" in out and "9.21 GB" in out


def test_weights_that_do_not_fit_name_the_weight_dtype_that_does(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["capacity", "--model", "deepseek-v3", "--kv-dtype", "fp8", "--tp", "8", "--gpu", "h200"]
    assert cli.main(base) == 3
    err = capsys.readouterr().err
    assert "156.2 GiB of weights per GPU leave no room" in err and "add --weight-dtype fp8" in err
    # the hint is what it says: with that flag the same deployment has a pool
    assert cli.main(base + ["--weight-dtype", "fp8", "--json"]) == 0
    pool_gib = json.loads(capsys.readouterr().out)["pool_bytes_per_gpu"] / 1024**3
    assert f"leave {pool_gib:.1f} GiB per GPU for the pool" in err
    # no narrower dtype fits, or the weight size was given: no hint to follow
    assert cli.main(["capacity", "--model", "deepseek-v3", "--tp", "2", "--gpu", "h100"]) == 3
    assert "--weight-dtype" not in capsys.readouterr().err
    assert cli.main(["capacity", "--model", "llama-3-70b", "--gpu", "h100", "--weights-gib", "200"]) == 3
    assert "--weight-dtype" not in capsys.readouterr().err


# ---------------------------------------------------------------- hybrid models (issue 17)
GEMMA3 = MODELS["gemma-3-27b"]
PER_LAYER = 2 * 16 * 128 * 2  # Gemma 3 27B: 16 KV heads x 128, bf16


def test_sliding_window_layers_hold_at_most_the_window_per_request() -> None:
    """Gemma 3 27B: 10 global layers keep every token, 52 sliding-window layers at most 1,024."""
    assert (GEMMA3.full_layers, GEMMA3.swa_layers, GEMMA3.sliding_window) == (10, 52, 1024)
    p = Plan(GEMMA3, "bf16", 1, 20 * GIB)
    assert p.request_bytes(800) == 800 * 62 * PER_LAYER  # inside the window: every layer
    assert p.request_bytes(32_768) == (32_768 * 10 + 1024 * 52) * PER_LAYER
    assert p.concurrency(32_768) == 20 * GIB // ((32_768 * 10 + 1024 * 52) * PER_LAYER) == 6
    assert p.concurrency(32_768) > p.pool_tokens // 32_768  # not every layer's KV: more requests fit


def test_sglang_fixed_swa_pools_bind_on_the_tighter_one() -> None:
    """Under --swa-full-tokens-ratio the pool is two fixed pools (full F, SWA = ratio x F, in
    tokens of their own layers): short requests bind on the SWA pool, long ones on the full."""
    p = Plan(GEMMA3, "bf16", 1, 20 * GIB, swa_full_tokens_ratio=0.6)
    full, swa = p.swa_pools()
    assert full == int(20 * GIB // (PER_LAYER * (10 + 0.6 * 52))) and swa == int(full * 0.6)
    assert (full * 10 + swa * 52) * PER_LAYER <= 20 * GIB
    assert p.concurrency(800) == swa // 800 < full // 800
    assert p.concurrency(32_768) == full // 32_768 < swa // 1024
    assert Plan(LLAMA70, "bf16", 8, 60 * GIB, swa_full_tokens_ratio=0.6).swa_pools() is None


def test_mamba_layers_hold_one_state_per_request(tmp_path: Path) -> None:
    """A Nemotron-H-style config: Mamba layers have no per-token KV, one recurrent state per
    request (SSM state in fp32 plus the conv state), whatever its length."""
    cfg = {"num_hidden_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "vocab_size": 32000, "hybrid_override_pattern": "M-M*M-M*", "mamba_num_heads": 64,
           "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(tmp_path)
    state = 64 * 64 * 128 * 4 + 3 * (64 * 64 + 2 * 8 * 128) * 2
    assert (m.mamba_layers, m.full_layers, m.mamba_state_bytes) == (4, 4, state)
    assert m.kv_bytes_per_token(2) == 4 * 2 * 8 * 128 * 2  # attention layers only
    p = Plan(m, "bf16", 1, 4 * GIB)
    assert p.request_bytes(1000) == 1000 * 4 * 4096 + 4 * state
    assert p.concurrency(1000) == 4 * GIB // (1000 * 4 * 4096 + 4 * state) < p.pool_tokens // 1000


def test_layer_types_in_the_config(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 4, "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "vocab_size": 201088, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_hf_config(tmp_path)
    assert (m.swa_layers, m.full_layers, m.sliding_window, m.mamba_layers) == (2, 2, 128, 0)


def test_cli_sizes_hybrid_models(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["capacity", "--model", "gemma-3-27b", "--pool-gib-per-gpu", "20", "--swa-full-tokens-ratio", "0.6",
            "--context", "800", "--context", "32768", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    p = Plan(GEMMA3, "bf16", 1, 20 * GIB, swa_full_tokens_ratio=0.6)
    assert out["hybrid"]["sliding_window_layers"] == 52 and out["hybrid"]["swa_pool_tokens"] == p.swa_pools()[1]
    assert out["concurrency"] == {"800": p.concurrency(800), "32768": p.concurrency(32_768)}
    assert out["kv_bytes_per_request"]["32768"] == (32_768 * 10 + 1024 * 52) * PER_LAYER
    assert cli.main(["capacity", "--model", "llama-3-70b", "--pool-gib-per-gpu", "20", "--swa-full-tokens-ratio", "0.6"]) == 3
    assert "no sliding-window layers" in capsys.readouterr().err
    assert "hybrid" not in json.loads((cli.main(["capacity", "--model", "llama-3-70b", "--pool-gib-per-gpu", "20", "--json"]),
                                       capsys.readouterr().out)[1])  # fmt: skip
