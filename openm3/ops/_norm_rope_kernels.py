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


# the residual add before a norm: s = x + d rounded to x's dtype (as the torch add), stored; then s normed
@triton.jit(do_not_specialize=["n_rows"])
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_rows, dim, stride_x, stride_d, stride_s, stride_o,
                         eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < dim)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    d = tl.load(d_ptr + r64 * stride_d + cols[None, :], mask=mask, other=0.0)
    s = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + r64 * stride_s + cols[None, :], s, mask=mask)
    sf = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, axis=1) / dim + eps)
    scale = 1.0 + tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    y = sf * inv[:, None] * scale[None, :]
    tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_grid(n_rows: int, dim: int) -> tuple[int, int, int]:
    """(programs, rows per program, block width) of the norm kernels; rows per program shrink as dim grows."""
    block_d = next_pow2(dim)
    per = max(1, min(16, 4096 // block_d))
    return triton.cdiv(n_rows, per), per, block_d


def launch_rms_norm(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    n_rows, dim = rows.shape
    programs, per, block_d = _norm_grid(n_rows, dim)
    _rms_norm_kernel[(programs,)](rows, weight, out, n_rows, dim, rows.stride(0), out.stride(0), float(eps),
                                  ROWS=per, BLOCK_D=block_d, num_warps=4 if block_d * per >= 2048 else 1)


def launch_add_rms_norm(x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, total: torch.Tensor,
                        out: torch.Tensor, eps: float) -> None:
    n_rows, dim = x.shape
    programs, per, block_d = _norm_grid(n_rows, dim)
    _add_rms_norm_kernel[(programs,)](x, d, weight, total, out, n_rows, dim, x.stride(0), d.stride(0),
                                      total.stride(0), out.stride(0), float(eps), ROWS=per, BLOCK_D=block_d,
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


@triton.jit
def _norm_scales(w_ptr, cols, partner, col_ok, rotated):
    """A norm weight (zero-centred) at the columns and at their rotation partners, fp32."""
    return (tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32),
            tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32))


# A fused projection's heads: [T, sum(heads), D] in, one contiguous [T, H_g, D] block per group out (groups laid
# one after another in `out`); each group optionally RMS-normed (weight w_g) and then rotated. Program (tokens, head):
# the head picks its group, so each program loads one norm weight.
@triton.jit(do_not_specialize=["n_tokens"])
def _heads_norm_rope_kernel(y_ptr, out_ptr, cos_ptr, sin_ptr, w0, w1, w2, w3, w4, n_tokens, dim, half,
                            stride_yt, stride_ct, stride_st, eps,
                            E0: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                            E4: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    g = (h >= E0).to(tl.int32) + (h >= E1).to(tl.int32) + (h >= E2).to(tl.int32) + (h >= E3).to(tl.int32)
    first_head = tl.where(g == 0, 0, tl.where(g == 1, E0, tl.where(g == 2, E1, tl.where(g == 3, E2, E3))))
    last_head = tl.where(g == 0, E0, tl.where(g == 1, E1, tl.where(g == 2, E2, tl.where(g == 3, E3, E4))))
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    row_ok = t < n_tokens
    mask = row_ok[:, None] & col_ok[None, :]
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)
    rotated = cols < 2 * half
    x_row = y_ptr + t[:, None] * stride_yt + h * dim
    x_in = tl.load(x_row + cols[None, :], mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    xp = tl.load(x_row + partner[None, :], mask=row_ok[:, None] & rotated[None, :], other=0.0).to(tl.float32)
    if ((tl.full([], NORM, tl.int32) >> g) & 1) != 0:  # RMSNorm as `rms_norm` computes it, rounded as its output
        scale = tl.zeros([BLOCK_D], dtype=tl.float32)
        scale_p = tl.zeros([BLOCK_D], dtype=tl.float32)
        if g == 0:
            scale, scale_p = _norm_scales(w0, cols, partner, col_ok, rotated)
        elif g == 1:
            scale, scale_p = _norm_scales(w1, cols, partner, col_ok, rotated)
        elif g == 2:
            scale, scale_p = _norm_scales(w2, cols, partner, col_ok, rotated)
        elif g == 3:
            scale, scale_p = _norm_scales(w3, cols, partner, col_ok, rotated)
        else:
            scale, scale_p = _norm_scales(w4, cols, partner, col_ok, rotated)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
        x = (x * inv[:, None] * (1.0 + scale)[None, :]).to(x_in.dtype).to(tl.float32)
        xp = (xp * inv[:, None] * (1.0 + scale_p)[None, :]).to(x_in.dtype).to(tl.float32)
    y = x
    if ((tl.full([], ROPE, tl.int32) >> g) & 1) != 0:  # as `rope`: tables cast to y's dtype, fp32 inside, one rounding
        rot_mask = row_ok[:, None] & rotated[None, :]
        c = tl.load(cos_ptr + t[:, None] * stride_ct + cols[None, :], mask=rot_mask, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * stride_st + cols[None, :], mask=rot_mask, other=0.0)
        c = c.to(x_in.dtype).to(tl.float32)
        s = s.to(x_in.dtype).to(tl.float32)
        r = (x * c + tl.where(first[None, :], -xp, xp) * s).to(x_in.dtype).to(tl.float32)
        y = tl.where(rotated[None, :], r, x)
    heads_g = last_head - first_head
    base = first_head.to(tl.int64) * n_tokens * dim  # the group's block in `out`
    dst = out_ptr + base + (t[:, None] * heads_g + (h - first_head)) * dim + cols[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_heads_norm_rope(y: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           weights: list, ends: list[int], norm_mask: int, rope_mask: int, dim: int, n: int,
                           eps: float) -> None:
    """y: [T, ends[-1] * dim] (row stride free, unit column stride); out: flat, T * ends[-1] * dim; weights: 5
    tensors (a group without a norm passes any); ends: 5 cumulative head counts; n: the rotated width."""
    t = y.shape[0]
    block_d = next_pow2(dim)
    rows = max(1, min(16, 2048 // block_d, next_pow2(t)))
    _heads_norm_rope_kernel[(triton.cdiv(t, rows), ends[-1])](
        y, out, cos, sin, *weights, t, dim, n // 2, y.stride(0), cos.stride(0), sin.stride(0), float(eps),
        E0=ends[0], E1=ends[1], E2=ends[2], E3=ends[3], E4=ends[4], NORM=norm_mask, ROPE=rope_mask, ROWS=rows,
        BLOCK_D=block_d, num_warps=4 if rows * block_d >= 1024 else 1)
