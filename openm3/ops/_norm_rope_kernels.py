"""Triton kernels of `openm3.ops.norm_rope` (imported only when they run, so CPU installs need no Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .msa.triton_common import next_pow2

_ROWS = 16  # rows of x per rope program; the norm's rows per program shrink as its width grows


# the row counts change with every batch and prefill chunk: not specialized (no new binary when one is divisible
# by 16); widths and strides are (aligned vector loads)
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, dim, stride_x, stride_o, eps,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    scale = 1.0 + tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    y = x * inv[:, None] * scale[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def launch_rms_norm(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    n_rows, dim = rows.shape
    block_d = next_pow2(dim)
    per = max(1, min(16, 4096 // block_d))
    _rms_norm_kernel[(triton.cdiv(n_rows, per),)](rows, weight, out, n_rows, dim, rows.stride(0), out.stride(0),
                                                  float(eps), ROWS=per, BLOCK_D=block_d,
                                                  num_warps=4 if block_d * per >= 2048 else 1)


@triton.jit(do_not_specialize=["n_rows", "heads"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, heads, dim, half,
                 stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # rows (token, head), token-major
    t = (r // heads).to(tl.int64)
    h = (r % heads).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = r < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dim)
    x_row = x_ptr + t[:, None] * stride_xt + h[:, None] * stride_xh
    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0)
    rotated = cols < 2 * half
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)
    rot_mask = row_ok[:, None] & rotated[None, :]
    xp = tl.load(x_row + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t[:, None] * stride_ct + cols[None, :], mask=rot_mask, other=0.0)
    s = tl.load(sin_ptr + t[:, None] * stride_st + cols[None, :], mask=rot_mask, other=0.0)
    # the tables cast to x's dtype first, as the torch ops do; then fp32 and one rounding at the end
    c = c.to(x.dtype).to(tl.float32)
    s = s.to(x.dtype).to(tl.float32)
    y = x.to(tl.float32) * c + tl.where(first[None, :], -xp, xp) * s
    y = tl.where(rotated[None, :], y.to(x.dtype), x)
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + cols[None, :], y, mask=mask)


def launch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, n: int) -> None:
    t, heads, dim = x.shape
    n_rows = t * heads
    _rope_kernel[(triton.cdiv(n_rows, _ROWS),)](x, cos, sin, out, n_rows, heads, dim, n // 2,
                                                x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                                out.stride(0), out.stride(1), ROWS=_ROWS,
                                                BLOCK_D=next_pow2(dim), num_warps=4)
