"""The tiny Llama ``config.json`` both engines' configs are built from: no weights, no hub,
only what ``ModelConfig`` reads (the schedulers never run the model)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 131072,
    "torch_dtype": "float16", "rms_norm_eps": 1e-5,
}  # fmt: skip


def write(model_dir: str) -> None:
    (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
