"""Stand-in for ``sgl_kernel`` in the SGLang environment (on the launched server's PYTHONPATH).

PyPI's ``sglang-kernel`` / ``sgl-kernel`` carry CUDA operators only; SGLang's CPU backend expects
sgl-kernel built from source. Without it every CPU layer takes its native torch path (the AMX
probe, ``torch.ops.sgl_kernel.convert_weight_packed``, stays absent: this module registers no
operator), which is what a tiny model needs. But a few CPU modules import names from it at top
level; those are the names here. The one the KV pool writes through on every prefill and decode
(``assign_req_to_token_pool_cpu``) is written in torch with the kernel's meaning; the others
(cache moves, speculative decoding) are never reached by the stories and raise if they are.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``[start[i], end[i])``, takes the
    next ``end[i] - start[i]`` slots of ``out_cache_loc`` (requests in order)."""
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _absent(name: str):  # type: ignore[no-untyped-def]
    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: kvdiag's stand-in has no CPU kernel for it")

    missing.__name__ = name
    return missing


for _name in (
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
):
    globals()[_name] = _absent(_name)
