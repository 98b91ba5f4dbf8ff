"""MSA (MiniMax Sparse Attention) ops: public functions with backend dispatch.

Every function validates its inputs (ValueError naming the argument) and then runs the backend that
`backend.pick_backend` chooses: `reference.py` (the spec) or the Triton kernels (`triton_*.py`).
Shapes and semantics are documented in `reference.py`.
"""

from __future__ import annotations

import torch

from . import reference
from .backend import BACKENDS, pick_backend, use_backend

__all__ = ["select_blocks", "sparse_attention", "indexer_kl", "sparse_attention_with_kl", "use_backend",
           "pick_backend", "BACKENDS"]


def select_blocks(qi, ki, cu_seqlens, *, block_size: int, topk: int, local_blocks: int = 1, cu_seqlens_k=None,
                  return_index_lse: bool = False):
    """Top-k key blocks per (index head, query). See `reference.select_blocks`.

    return_index_lse: return `(block_idx, index_lse)`, where index_lse is the indexer KL's student normaliser
    (`reference.index_lse`, for `indexer_kl(..., index_lse=)`) when this backend computes it on the way (the Triton
    kernel with the launch field `index_lse=1`), else None (the KL then computes it itself)."""
    if pick_backend(qi) == "triton":
        from .triton_select import select_blocks as impl
        return impl(qi, ki, cu_seqlens, block_size=block_size, topk=topk, local_blocks=local_blocks,
                    cu_seqlens_k=cu_seqlens_k, return_index_lse=return_index_lse)
    block_idx = reference.select_blocks(qi, ki, cu_seqlens, block_size=block_size, topk=topk,
                                        local_blocks=local_blocks, cu_seqlens_k=cu_seqlens_k)
    return (block_idx, None) if return_index_lse else block_idx


def sparse_attention(q, k, v, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
                     cu_seqlens_k=None, validate_block_idx: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention over the selected key blocks. See `reference.sparse_attention`.

    validate_block_idx=False skips the value checks of `block_idx` (host syncs and a few sorts per call) for
    indices straight from `select_blocks`; shapes, dtypes and `cu_seqlens` are still checked."""
    if pick_backend(q) == "triton":
        from .triton_attention import sparse_attention as impl
    else:
        impl = reference.sparse_attention
    return impl(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale, cu_seqlens_k=cu_seqlens_k,
                validate_block_idx=validate_block_idx)


def indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
               index_scale: float | None = None, lse: torch.Tensor | None = None, cu_seqlens_k=None,
               validate_block_idx: bool = True, index_lse: torch.Tensor | None = None) -> torch.Tensor:
    """KL(main attention || index distribution); `block_idx=None` is the dense warm-up variant.
    See `reference.indexer_kl`; validate_block_idx as in `sparse_attention`; index_lse from
    `select_blocks(..., return_index_lse=True)` (or None)."""
    if pick_backend(qi) == "triton":
        from .triton_kl import indexer_kl as impl
    else:
        impl = reference.indexer_kl
    return impl(q, k, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale, index_scale=index_scale,
                lse=lse, cu_seqlens_k=cu_seqlens_k, validate_block_idx=validate_block_idx, index_lse=index_lse)


def sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_seqlens, *, block_size: int,
                             scale: float | None = None, index_scale: float | None = None, cu_seqlens_k=None,
                             validate_block_idx: bool = True, index_lse: torch.Tensor | None = None):
    """`sparse_attention` and the sparse `indexer_kl` (with the attention's lse) of one selection in one call:
    (o, lse, kl), with the gradients of the two calls (the KL's into qi and ki only).

    On the Triton backend the KL runs inside the attention's backward, on the teacher probabilities its dk/dv
    kernel computes anyway (one pass over the selected blocks fewer than the two calls), so when a backward is
    to come kl's *value* is written by that backward (0 before it): read it after `backward()`. The reference
    computes the KL at once."""
    if pick_backend(q) == "triton":
        from .triton_attention_kl import sparse_attention_with_kl as impl
        return impl(q, k, v, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                    index_scale=index_scale, cu_seqlens_k=cu_seqlens_k, validate_block_idx=validate_block_idx,
                    index_lse=index_lse)
    o, lse = reference.sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                                        cu_seqlens_k=cu_seqlens_k, validate_block_idx=validate_block_idx)
    kl = reference.indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, cu_seqlens, block_size=block_size,
                              scale=scale, index_scale=index_scale, lse=lse.detach(), cu_seqlens_k=cu_seqlens_k,
                              validate_block_idx=False, index_lse=index_lse)
    return o, lse, kl
