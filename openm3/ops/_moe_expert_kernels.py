"""Triton kernel of `openm3.ops.moe_experts` (imported only when it runs, so CPU installs need no Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 16  # rows of an expert per pass over its weights (the smallest tile `tl.dot` takes)
_BLOCK_K = 128  # input features per step


# rows [start, end) of expert e (end = offs[e], start = offs[e - 1]) times weight[e, cols].T for one block of
# output columns; SWIGLU: the columns are the gate's, the same columns + n_out the up projection's, and the
# SwiGLU-OAI of the pair is stored (fp32 until the store)
@triton.jit
def _expert_linear_kernel(x_ptr, w_ptr, offs_ptr, out_ptr, n_out, k_dim, stride_x, stride_we, stride_wn, stride_o,
                          alpha, limit, SWIGLU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    w_gate = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + n_out * stride_wn
    for m0 in range(start, end, ROWS):
        rows = m0 + tl.arange(0, ROWS)
        row_ok = rows < end
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        acc_up = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for k0 in range(0, k_dim, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_dim
            xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = col_ok[:, None] & k_ok[None, :]
            # each step's dot summed apart, then added: fp32 error grows with the steps, not with every feature
            acc += tl.dot(xt, tl.trans(tl.load(w_gate + ks[None, :], mask=w_ok, other=0.0)),
                          input_precision=PRECISION)
            if SWIGLU:
                acc_up += tl.dot(xt, tl.trans(tl.load(w_up + ks[None, :], mask=w_ok, other=0.0)),
                                 input_precision=PRECISION)
        if SWIGLU:
            if PRECISION == "ieee":  # fp32 operands: the SwiGLU in fp64 (Triton's fp32 exp is an approximation)
                gate, up = acc.to(tl.float64), acc_up.to(tl.float64)
            else:
                gate, up = acc, acc_up
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, 0.0 - limit), limit)
            acc = ((up + 1.0) * (gate * tl.sigmoid(gate * alpha))).to(tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, n_out: int,
           block_n: int, swiglu: tuple[float, float] | None) -> None:
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    grid = (weight.shape[0], triton.cdiv(n_out, block_n))
    _expert_linear_kernel[grid](
        x, weight, offs, out, n_out, x.shape[1], x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        float(alpha), float(limit), SWIGLU=swiglu is not None, ROWS=_ROWS, BLOCK_N=block_n, BLOCK_K=_BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=4)
