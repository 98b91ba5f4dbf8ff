"""MSA (MiniMax Sparse Attention) ops: public functions with backend dispatch.

Every function validates its inputs (ValueError naming the argument) and then runs the backend that
`pick_backend` chooses: `reference.py` (the spec, PyTorch) or the Triton kernels (`triton_*.py`). Each takes the
arguments of its `reference` namesake, with the same meaning and defaults. Semantics are in `reference.py`.

Choosing the backend (details in `backend.py`): automatic is `triton` for CUDA tensors and `reference` otherwise;
`OPENM3_MSA_BACKEND=reference|triton` or `set_backend("...")` force one for the whole process, and
`with use_backend("..."):` for a block of code (a plain `use_backend("...")` statement changes nothing, and warns).
The Triton kernels run on CPU tensors only with `TRITON_INTERPRET=1` set before openm3 or triton is imported, and
only in fp32/fp16 there (the interpreter's bf16 `tl.dot` is wrong); otherwise they raise ValueError. They also
refuse (ValueError) a `block_size` (a model's `index_block_size`) they cannot tile: the attention kernels take
multiples of 16, the selection kernel also powers of two below 16, the decode kernels powers of two >= 16
(`triton_common.check_block_size`); the reference takes any block size.

Layout (packed varlen): `q [T, Hq, D]`, `k, v [Tk, Hkv, D]`, `qi [T, Hi, Di]` (Hi == Hkv), `ki [Tk, Di]`,
`cu_seqlens` / `cu_seqlens_k` int32 [B + 1] (queries are the last tokens of their sequence: bottom-right causal
alignment), `block_idx int32 [Hi, T, topk]` (block numbers from each sequence's start, -1 in unused slots).
"""

from __future__ import annotations

import torch

from . import reference
from ._checks import check_workspace
from .backend import BACKENDS, pick_backend, set_backend, use_backend
from .reference import DEFAULT_WORKSPACE

__all__ = ["select_blocks", "sparse_attention", "indexer_kl", "sparse_attention_with_kl", "use_backend",
           "set_backend", "pick_backend", "BACKENDS", "DEFAULT_WORKSPACE"]

# `workspace` bounds the reference's chunk intermediates (elements); the Triton kernels work in fixed on-chip tiles
# and take no such bound, so there it is checked and unused (it never changes a result on either backend).


def select_blocks(qi, ki, cu_seqlens, *, block_size: int, topk: int, local_blocks: int = 1, cu_seqlens_k=None,
                  index_scale: float | None = None, workspace: int = DEFAULT_WORKSPACE,
                  return_index_lse: bool = False):
    """Top-k key blocks per (index head, query).

    Args:
        qi: [T, Hi, Di] index queries; ki: [Tk, Di] index keys (one head shared by every index head); one float
            dtype (fp16/bf16/fp32; fp64 on the reference only).
        cu_seqlens: int32 [B + 1] query offsets; cu_seqlens_k: int32 [B + 1] key offsets (default cu_seqlens).
        block_size: keys per block; topk: slots per query; local_blocks: forced blocks (own block and the ones
            before it), 0 <= local_blocks <= topk.
        index_scale: score scale (default 1/sqrt(Di)); a positive scale never changes the selection, only the
            index_lse below.
        workspace: the reference's memory bound (elements per chunk intermediate; unused by the Triton kernels).
        return_index_lse: also return the indexer KL's student normaliser (`reference.index_lse`, fp32 [Hi, T],
            for `indexer_kl(..., index_lse=)`) when this backend computes it on the way (the Triton kernel with
            the launch field `index_lse=1`), else None (the KL then computes it itself).

    Returns:
        block_idx int32 [Hi, T, topk]: local blocks first (own, own - 1, ...), then the other causal blocks by
        descending max score, -1 in unused trailing slots. With return_index_lse, `(block_idx, index_lse or None)`.
    """
    check_workspace(workspace)
    if pick_backend(qi) == "triton":
        from .triton_select import select_blocks as impl
        return impl(qi, ki, cu_seqlens, block_size=block_size, topk=topk, local_blocks=local_blocks,
                    cu_seqlens_k=cu_seqlens_k, index_scale=index_scale, return_index_lse=return_index_lse)
    block_idx = reference.select_blocks(qi, ki, cu_seqlens, block_size=block_size, topk=topk,
                                        local_blocks=local_blocks, cu_seqlens_k=cu_seqlens_k,
                                        index_scale=index_scale, workspace=workspace)
    return (block_idx, None) if return_index_lse else block_idx


def sparse_attention(q, k, v, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
                     cu_seqlens_k=None, workspace: int = DEFAULT_WORKSPACE,
                     validate_block_idx: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of each query over the keys of its selected blocks.

    Args:
        q: [T, Hq, D]; k, v: [Tk, Hkv, D] (Hq a multiple of Hkv; one float dtype: fp16/bf16/fp32, fp64 on the
            reference only). block_idx: int32 [Hkv, T, topk] as `select_blocks` returns it.
        cu_seqlens / cu_seqlens_k: int32 [B + 1] (cu_seqlens_k defaults to cu_seqlens). block_size: keys per
            block. scale: default 1/sqrt(D). workspace: as in `select_blocks`.
        validate_block_idx: False skips the value checks of block_idx (host syncs and a few sorts per call) for
            indices straight from `select_blocks`; shapes, dtypes and cu_seqlens are still checked.

    Returns:
        (o [T, Hq, D] in q.dtype, lse fp32 [T, Hq]): query t, head h attends to its causal keys inside the blocks
        block_idx[h // (Hq // Hkv), t]; a query with no selected block gets o = 0, lse = -inf. Differentiable in
        q, k, v (lse is not).
    """
    check_workspace(workspace)
    if pick_backend(q) == "triton":
        from .triton_attention import sparse_attention as impl
        return impl(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale, cu_seqlens_k=cu_seqlens_k,
                    validate_block_idx=validate_block_idx)
    return reference.sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                                      cu_seqlens_k=cu_seqlens_k, workspace=workspace,
                                      validate_block_idx=validate_block_idx)


def indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
               index_scale: float | None = None, lse: torch.Tensor | None = None, cu_seqlens_k=None,
               workspace: int = DEFAULT_WORKSPACE, validate_block_idx: bool = True,
               index_lse: torch.Tensor | None = None) -> torch.Tensor:
    """KL(main attention || index distribution), the loss that trains the index branch.

    Args:
        q: [T, Hq, D], k: [Tk, Hkv, D] main-branch queries and keys (constants: no gradient); qi: [T, Hi, Di],
            ki: [Tk, Di] index queries and keys (Hi == Hkv; gradients flow into these only). One float dtype for
            q, k and one for qi, ki (fp16/bf16/fp32; fp64 on the reference only).
        block_idx: int32 [Hi, T, topk] selected blocks, or None for the dense warm-up over all causal keys.
        cu_seqlens / cu_seqlens_k: int32 [B + 1]. block_size: keys per block. scale: default 1/sqrt(D);
            index_scale: default 1/sqrt(Di).
        lse: optional fp32 [T, Hq] from `sparse_attention` over the same keys (the teacher's normaliser).
        workspace, validate_block_idx: as in `sparse_attention`.
        index_lse: optional fp32 [Hi, T] from `select_blocks(..., return_index_lse=True)` (or None).

    Returns:
        fp32 scalar (fp64 for fp64 inputs on the reference): mean over (index head g, query t) of KL(p || r) over
        the key set of (g, t), p the mean over g's query heads of softmax(q . k * scale), r = softmax(qi . ki *
        index_scale); queries with an empty key set contribute 0.
    """
    check_workspace(workspace)
    if pick_backend(qi) == "triton":
        from .triton_kl import indexer_kl as impl
        return impl(q, k, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale, index_scale=index_scale,
                    lse=lse, cu_seqlens_k=cu_seqlens_k, validate_block_idx=validate_block_idx, index_lse=index_lse)
    return reference.indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                                index_scale=index_scale, lse=lse, cu_seqlens_k=cu_seqlens_k, workspace=workspace,
                                validate_block_idx=validate_block_idx, index_lse=index_lse)


def sparse_attention_with_kl(q, k, v, qi, ki, block_idx, cu_seqlens, *, block_size: int,
                             scale: float | None = None, index_scale: float | None = None, cu_seqlens_k=None,
                             workspace: int = DEFAULT_WORKSPACE, validate_block_idx: bool = True,
                             index_lse: torch.Tensor | None = None):
    """`sparse_attention` and the sparse `indexer_kl` (with the attention's lse) of one selection in one call.

    Args: those of `sparse_attention(q, k, v, block_idx, ...)` and `indexer_kl(q, k, qi, ki, block_idx, ...)`
    (block_idx int32 [Hkv, T, topk], not None).

    Returns:
        (o [T, Hq, D] in q.dtype, lse fp32 [T, Hq], kl fp32 scalar), with the gradients of the two calls (o's into
        q, k, v; kl's into qi and ki only). On the Triton backend the KL runs inside the attention's backward, on
        the teacher probabilities its dk/dv kernel computes anyway (one pass over the selected blocks fewer than
        the two calls), so when a backward is to come kl's *value* is written by that backward (0 before it):
        read it after `backward()`. The reference computes the KL at once.
    """
    check_workspace(workspace)
    if pick_backend(q) == "triton":
        from .triton_attention_kl import sparse_attention_with_kl as impl
        return impl(q, k, v, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                    index_scale=index_scale, cu_seqlens_k=cu_seqlens_k, validate_block_idx=validate_block_idx,
                    index_lse=index_lse)
    o, lse = reference.sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                                        cu_seqlens_k=cu_seqlens_k, workspace=workspace,
                                        validate_block_idx=validate_block_idx)
    kl = reference.indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, cu_seqlens, block_size=block_size,
                              scale=scale, index_scale=index_scale, lse=lse.detach(), cu_seqlens_k=cu_seqlens_k,
                              workspace=workspace, validate_block_idx=False, index_lse=index_lse)
    return o, lse, kl
