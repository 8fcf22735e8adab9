"""The tiny model both real engines serve: ``python tiny_model.py DIR`` writes it into DIR.

Run by the engine environment's Python (it needs ``tokenizers``, which kvdiag does not), so it
imports nothing from kvdiag. No weights: both servers start with ``--load-format dummy`` and
fill them at random. What matters is the KV it stores, and that is fixed by the config:
2 layers x 2 (K and V) x 2 KV heads x head_dim 32 x 2 bytes (bf16) = 512 bytes per token.

The tokenizer is byte-level BPE with no merges: the three specials (``<unk>`` 0, ``<s>`` 1,
``</s>`` 2 = eos), then one token per byte, so an ASCII prompt of N characters is N tokens and
the load generator controls prompt lengths and shared prefixes exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
}  # fmt: skip
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
    "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 4096, "add_bos_token": False,
}  # fmt: skip


def write(model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1))
    (model_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


if __name__ == "__main__":
    write(Path(sys.argv[1]))
