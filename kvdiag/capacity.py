"""KV bytes per token, pool tokens and the concurrency ceiling, from model and GPU facts.

A token's KV size is fixed by the model: ``2 x layers x kv_heads x head_dim x dtype_bytes`` for
MHA/GQA, and ``(kv_lora_rank + qk_rope_head_dim) x layers x dtype_bytes`` for MLA, which
stores one compressed latent per layer. Tensor parallelism splits KV heads across GPUs (an
MLA latent is replicated on every rank). The pool holds ``pool bytes per GPU / KV bytes per
token per GPU`` tokens, and at most ``pool tokens / sequence length`` requests fit at once:
the ceiling no scheduler setting can raise.

The presets are the models' published config numbers; the reference pool imports them for
real-shape KV tensors and its roofline model, so they are plain public dataclasses.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
MIB = 1024**2

#: Bytes per element of the KV cache dtypes the engines offer.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, as its HF ``config.json`` gives it."""

    name: str
    layers: int
    hidden: int
    intermediate: int  # dense MLP width (first_k_dense layers for DeepSeek)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: float | None = None  # published total parameters
    active_params: float | None = None  # published parameters per token (MoE)
    # MLA (DeepSeek-V2/V3): the KV cache is one latent of kv_lora_rank + qk_rope_head_dim per layer.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    # Mixture of experts.
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_intermediate: int | None = None  # expert width; None = intermediate
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    tie_embeddings: bool = False
    # Hybrid models: of ``layers``, how many attend over a sliding window (they hold at most
    # ``sliding_window`` tokens per request) and how many are Mamba / linear-attention layers
    # (no KV per token: one fixed state per request, ``mamba_state_bytes`` per layer).
    sliding_window: int | None = None
    swa_layers: int = 0
    mamba_layers: int = 0
    mamba_state_bytes: int = 0

    @property
    def hybrid(self) -> bool:
        return bool(self.swa_layers or self.mamba_layers)

    @property
    def full_layers(self) -> int:
        """Layers that keep the KV of every token of a request."""
        return self.layers - self.swa_layers - self.mamba_layers

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        """KV bytes one token occupies across the whole model (all attention layers, all ranks;
        a token inside every sliding window, so a hybrid model's short-request figure)."""
        return self.kv_bytes_per_token_per_layer(dtype_bytes) * self.attention_layers

    def kv_bytes_per_token_per_gpu(self, dtype_bytes: float, tp: int = 1) -> int:
        """KV bytes one token occupies on each GPU of a TP group: KV heads are split across
        ranks (replicated when TP exceeds them); an MLA latent is stored whole on every rank."""
        return self.kv_bytes_per_token_per_layer(dtype_bytes, tp) * self.attention_layers

    @property
    def attention_layers(self) -> int:
        return self.layers - self.mamba_layers

    def kv_bytes_per_token_per_layer(self, dtype_bytes: float, tp: int | None = None) -> int:
        """One token's KV in one attention layer: on each GPU of a TP group, or (``tp`` None)
        across all ranks."""
        if self.mla:
            return int((self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * dtype_bytes)  # type: ignore[operator]
        heads = self.kv_heads if tp is None else math.ceil(self.kv_heads / tp)
        return int(2 * heads * self.head_dim * dtype_bytes)

    def request_bytes(self, context: int, dtype_bytes: float, tp: int | None = None) -> int:
        """What one request of ``context`` tokens holds (per GPU of a TP group, or with ``tp``
        None across all ranks): every token in the full-attention layers, at most the window in
        the sliding-window layers, one recurrent state per Mamba layer, whatever its length."""
        per_layer = self.kv_bytes_per_token_per_layer(dtype_bytes, tp)
        window = min(context, self.sliding_window) if self.sliding_window else context
        state = self.mamba_state_bytes if tp is None else math.ceil(self.mamba_state_bytes / tp)
        return per_layer * (context * self.full_layers + window * self.swa_layers) + self.mamba_layers * state

    def estimated_params(self) -> float:
        """Parameters from the shapes (embeddings, attention, MLP/experts; norms ignored)."""
        h = self.hidden
        if self.mla:
            nope, rope, v = self.qk_nope_head_dim or 0, self.qk_rope_head_dim or 0, self.v_head_dim or self.head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * (nope + rope) if self.q_lora_rank else h * self.heads * (nope + rope)
            attn = q + h * (self.kv_lora_rank + rope) + self.kv_lora_rank * self.heads * (nope + v) + self.heads * v * h  # type: ignore[operator]
        else:
            attn = 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        dense_mlp = 3 * h * self.intermediate
        if self.experts:
            width = self.moe_intermediate or self.intermediate
            moe_mlp = (self.experts + self.shared_experts) * 3 * h * width + h * self.experts
            mlp = self.dense_layers * dense_mlp + (self.layers - self.dense_layers) * moe_mlp
        else:
            mlp = self.layers * dense_mlp
        embeddings = self.vocab * h * (1 if self.tie_embeddings else 2)
        return float(self.layers * attn + mlp + embeddings)

    def weight_bytes(self, dtype_bytes: float) -> float:
        return (self.params or self.estimated_params()) * dtype_bytes


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's datasheet figures; ``visible_mib`` is the total nvidia-smi reports."""

    name: str
    memory_gb: float  # datasheet
    visible_mib: int  # what the driver exposes (nvidia-smi memory.total)
    hbm_bytes_per_s: float
    bf16_dense_flops: float

    @property
    def memory_bytes(self) -> int:
        return self.visible_mib * MIB


MODELS: dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in (
        ModelSpec("Llama-3-8B", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, params=8.03e9),
        ModelSpec("Llama-3-70B", layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256, params=70.6e9),
        ModelSpec("Qwen2.5-72B", layers=80, hidden=8192, intermediate=29568, heads=64, kv_heads=8, head_dim=128, vocab=152064, params=72.7e9),
        ModelSpec(
            "Mixtral-8x7B", layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=32000,
            params=46.7e9, active_params=12.9e9, experts=8, experts_per_token=2,
        ),
        # Gemma 3: 5 sliding-window (1024) layers to 1 global; the language model alone (the
        # card's 27.4e9 adds the 0.4e9 SigLIP vision tower).
        ModelSpec(
            "Gemma-3-27B", layers=62, hidden=5376, intermediate=21504, heads=32, kv_heads=16, head_dim=128, vocab=262208,
            params=27.0e9, tie_embeddings=True, sliding_window=1024, swa_layers=52,
        ),
        ModelSpec(
            "DeepSeek-V3", layers=61, hidden=7168, intermediate=18432, heads=128, kv_heads=128, head_dim=192, vocab=129280,
            params=671e9, active_params=37e9, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
            q_lora_rank=1536, experts=256, experts_per_token=8, shared_experts=1, moe_intermediate=2048, dense_layers=3,
        ),
    )
}  # fmt: skip

GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100", memory_gb=80, visible_mib=81559, hbm_bytes_per_s=3.35e12, bf16_dense_flops=989e12),
    "h200": GPUSpec("H200", memory_gb=141, visible_mib=143771, hbm_bytes_per_s=4.8e12, bf16_dense_flops=989e12),
}


def from_hf_config(path: str | Path) -> ModelSpec:
    """A ModelSpec from a Hugging Face ``config.json`` (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model here

    def need(key: str) -> int:
        if key not in cfg:
            raise ValueError(f"{p}: no {key!r}; not a decoder config kvdiag understands")
        return int(cfg[key])

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    swa_layers, mamba_layers = _hybrid_layers(cfg, layers)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or p.parent.name or "model"),
        layers=layers,
        hidden=hidden,
        intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab=need("vocab_size"),
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
        v_head_dim=cfg.get("v_head_dim"),
        q_lora_rank=cfg.get("q_lora_rank"),
        experts=int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        shared_experts=int(cfg.get("n_shared_experts") or 0),
        moe_intermediate=cfg.get("moe_intermediate_size"),
        dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=int(cfg["sliding_window"]) if swa_layers and cfg.get("sliding_window") else None,
        swa_layers=swa_layers if cfg.get("sliding_window") else 0,
        mamba_layers=mamba_layers,
        mamba_state_bytes=_mamba_state_bytes(cfg) if mamba_layers else 0,
    )


def _hybrid_layers(cfg: dict, layers: int) -> tuple[int, int]:
    """(sliding-window layers, Mamba / linear-attention layers) from the config's layer map:
    ``layer_types`` (Gemma 3, gpt-oss, Qwen3-Next), ``sliding_window_pattern`` (every Nth layer
    global, Gemma 3's older configs) or ``hybrid_override_pattern`` (Nemotron-H: M = Mamba,
    * = attention, - = MLP only)."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return sum(t == "sliding_attention" for t in types), sum(t in ("linear_attention", "mamba") for t in types)
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        return 0, pattern.count("M")
    every = cfg.get("sliding_window_pattern")
    if isinstance(every, int) and every > 1 and cfg.get("sliding_window"):
        return layers - layers // every, 0
    return 0, 0


def _mamba_state_bytes(cfg: dict) -> int:
    """One request's recurrent state in one Mamba layer: the SSM state (heads x head_dim x
    d_state, fp32 as both engines keep it) plus the conv state ((kernel - 1) x channels, bf16).
    0 where the config does not give the shapes."""
    heads = cfg.get("mamba_num_heads") or cfg.get("linear_num_value_heads")
    head_dim = cfg.get("mamba_head_dim") or cfg.get("linear_value_head_dim")
    d_state = cfg.get("ssm_state_size") or cfg.get("linear_key_head_dim")
    if not (heads and head_dim and d_state):
        return 0
    kernel = int(cfg.get("conv_kernel") or cfg.get("linear_conv_kernel_dim") or 4)
    channels = int(heads) * int(head_dim) + 2 * int(cfg.get("n_groups") or 1) * int(d_state)
    return int(heads) * int(head_dim) * int(d_state) * 4 + (kernel - 1) * channels * 2


def model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive) or a HF config path."""
    key = name_or_path.lower()
    if key in MODELS:
        return MODELS[key]
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise ValueError(f"{name_or_path!r} is neither a preset ({', '.join(m.name for m in MODELS.values())}) nor a config.json path")


@dataclass(frozen=True)
class Plan:
    """A deployment's KV pool: per-GPU bytes, tokens, and the ceiling per context length."""

    model: ModelSpec
    kv_dtype: str
    tp: int
    pool_bytes_per_gpu: int
    weight_bytes_per_gpu: int | None = None
    # SGLang's --swa-full-tokens-ratio: a hybrid SWA model's pool is two fixed pools, the SWA
    # one this share of the full one in tokens. None: sized per request (no fixed split).
    swa_full_tokens_ratio: float | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(DTYPE_BYTES[self.kv_dtype])

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return self.model.kv_bytes_per_token_per_gpu(DTYPE_BYTES[self.kv_dtype], self.tp)

    @property
    def pool_tokens(self) -> int:
        return self.pool_bytes_per_gpu // self.kv_bytes_per_token_per_gpu

    def request_bytes_per_gpu(self, context: int) -> int:
        """The pool one request of ``context`` tokens holds on each GPU (``request_bytes``,
        heads split over TP)."""
        return self.model.request_bytes(context, DTYPE_BYTES[self.kv_dtype], self.tp)

    def request_bytes(self, context: int) -> int:
        """The KV and state one request of ``context`` tokens holds across the whole model."""
        return self.model.request_bytes(context, DTYPE_BYTES[self.kv_dtype])

    def swa_pools(self) -> tuple[int, int] | None:
        """(full-pool tokens, SWA-pool tokens) of a hybrid SWA model under
        ``swa_full_tokens_ratio`` (each pool's tokens hold one token's KV in its layers)."""
        m, ratio = self.model, self.swa_full_tokens_ratio
        if ratio is None or not m.swa_layers:
            return None
        per_layer = m.kv_bytes_per_token_per_layer(DTYPE_BYTES[self.kv_dtype], self.tp)
        full = int(self.pool_bytes_per_gpu // (per_layer * (m.full_layers + ratio * m.swa_layers)))
        return full, int(full * ratio)

    def concurrency(self, context: int) -> int:
        """Requests of ``context`` tokens (input + output) that fit in the pool at once; with
        fixed SWA pools, the tighter of the two."""
        pools = self.swa_pools()
        if pools is not None:
            full, swa = pools
            return min(full // context, swa // min(context, self.model.sliding_window or context))
        return self.pool_bytes_per_gpu // self.request_bytes_per_gpu(context)


def pool_from_memory(spec: ModelSpec, tp: int, gpu_bytes: float, mem_fraction: float, weight_bytes: float) -> tuple[int, int]:
    """(pool bytes per GPU, weight bytes per GPU): the engine's static fraction of GPU memory
    less this rank's share of the weights. An upper bound: activations and CUDA graphs also
    come out of that fraction in some engines."""
    weights_per_gpu = int(weight_bytes / tp)
    pool = int(gpu_bytes * mem_fraction) - weights_per_gpu
    if pool <= 0:
        raise ValueError(
            f"{spec.name}: {weights_per_gpu / GIB:.1f} GiB of weights per GPU leave no room in "
            f"{mem_fraction:g} x {gpu_bytes / GIB:.1f} GiB; raise --tp or the memory fraction"
        )
    return pool, weights_per_gpu
