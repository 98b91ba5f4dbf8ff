"""Sparse attention with the sparse indexer KL computed in its backward (Triton).

The KL's teacher is the mean over a group's heads of P = exp(s - lse) over each query's selected blocks, and the
attention backward's dk/dv kernel computes exactly that P for every selected (token, key block). So instead of
`indexer_kl`'s teacher pass in the forward (a second Q K^T over the selection), the backward's dk/dv kernel
stores the teacher on the way (`triton_attention._backward(teacher_dtype=)`) and the KL's main pass then runs on
it (`triton_kl._kl_forward(teacher=)`), giving the loss and dL/dqi, dL/dki.

The price is when the KL's value exists: `sparse_attention_with_kl` returns a KL scalar whose storage the backward
fills (0 until then). Gradients are exact either way; a caller that logs the value reads it after the backward.
Without a backward to come (no grad mode, or qi and ki not requiring grad) the KL is computed at once, as
`indexer_kl` does.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_indexer_kl_inputs
from .triton_attention import _check_inputs, sparse_attention
from .triton_common import check_triton_inputs
from .triton_kl import _teacher_dtype, indexer_kl, teacher_fits


class _SparseAttentionKL(torch.autograd.Function):
    """Outputs (o, lse, kl); the backward runs the attention backward (with the teacher) and then the KL."""

    @staticmethod
    def forward(ctx, q, k, v, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, index_scale,
                index_lse):
        o, lse = torch.ops.openm3.msa_sparse_attn_fwd(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size,
                                                      scale)
        kl = torch.zeros((), device=q.device, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, qi, ki, index_lse)
        ctx.kl_value = kl.detach()  # kl's storage, without a reference cycle through kl's grad_fn
        ctx.params = (block_size, scale, index_scale)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return o, lse, kl

    @staticmethod
    def backward(ctx, do, dlse, dkl):
        q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, qi, ki, index_lse = ctx.saved_tensors
        block_size, scale, index_scale = ctx.params
        if do is None:  # only the KL was used: the attention's gradients are zero, its P still gives the teacher
            do = torch.zeros_like(o)
        want_kl = dkl is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        hkv, _, topk = block_idx.shape
        teacher = None
        if want_kl and teacher_fits(q, hkv, topk, block_size):
            dq, dk, dv, teacher = torch.ops.openm3.msa_sparse_attn_bwd_teacher(
                do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, _teacher_dtype(q.dtype))
        else:
            dq, dk, dv = torch.ops.openm3.msa_sparse_attn_bwd(do, q, k, v, o, lse, block_idx, cu_seqlens,
                                                              cu_seqlens_k, block_size, scale)
        dqi = dki = None
        if want_kl:  # without the teacher from dk/dv (odd group, too large), the KL makes its own
            loss, dqi, dki = torch.ops.openm3.msa_indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse,
                                                             block_size, scale, index_scale, True, index_lse,
                                                             teacher)
            ctx.kl_value.copy_(loss)
            dqi, dki = (dkl * dqi).to(qi.dtype), (dkl * dki).to(ki.dtype)
        return dq, dk, dv, dqi, dki, None, None, None, None, None, None, None


def sparse_attention_with_kl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor,
                             block_idx: torch.Tensor, cu_seqlens: torch.Tensor, *, block_size: int,
                             scale: float | None = None, index_scale: float | None = None,
                             cu_seqlens_k: torch.Tensor | None = None, validate_block_idx: bool = True,
                             index_lse: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sparse_attention(q, k, v, block_idx, ...)` and the sparse `indexer_kl(q, k, qi, ki, block_idx, ...,
    lse=lse)` of the same selection: (o [T, Hq, D], lse fp32 [T, Hq], kl fp32 scalar).

    Arguments as those two functions'. Differentiable in q, k, v (through o) and in qi, ki (through kl; q and k
    are the KL's constants). When a backward is to come, kl's value is written by it (0 before): read it after
    `backward()`."""
    _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, validate_block_idx)
    check_triton_inputs(qi=qi, ki=ki)
    check_indexer_kl_inputs(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, None, block_size=block_size,
                            scale=scale, index_scale=index_scale, block_idx_values=False, index_lse=index_lse)
    if not (torch.is_grad_enabled() and (qi.requires_grad or ki.requires_grad)):
        o, lse = sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                                  cu_seqlens_k=cu_seqlens_k, validate_block_idx=False)
        kl = indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, block_size=block_size, scale=scale,
                        index_scale=index_scale, lse=lse.detach(), cu_seqlens_k=cu_seqlens_k,
                        validate_block_idx=False, index_lse=index_lse)
        return o, lse, kl
    if torch.float64 in (q.dtype, qi.dtype):
        raise ValueError("q and qi must be fp16, bf16 or fp32 for the Triton backend (use the reference for fp64)")
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    index_scale = 1.0 / math.sqrt(qi.shape[-1]) if index_scale is None else float(index_scale)
    return _SparseAttentionKL.apply(q, k, v, qi, ki, block_idx.contiguous(), cu_seqlens, cu_seqlens_k, block_size,
                                    scale, index_scale, None if index_lse is None else index_lse.detach())
