"""Triton kernel of `openm3.ops.moe_experts` (imported only when it runs, so CPU installs need no Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .msa.triton_common import arrival_counters

_ROWS = 16  # rows of an expert per pass over its weights (the smallest tile `tl.dot` takes)
_BLOCK_K = 128  # input features per step


@triton.jit
def _store_rows(acc, acc_up, out_ptr, rows, row_ok, cols, col_ok, stride_o, alpha, limit, SWIGLU: tl.constexpr):
    """Stores a pass's sums (with SWIGLU: the SwiGLU-OAI of gate `acc` and up `acc_up`, in the sums' dtype: fp64
    for fp32 operands, fp32 for 16-bit ones) in out's dtype."""
    if SWIGLU:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, 0.0 - limit), limit)
        acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Program (expert e, block of output columns, split of the input features): rows [start, end) of expert e
# (end = offs[e], start = offs[e - 1]) times weight[e, cols, split's features].T; SWIGLU: the columns are the
# gate's, the same columns + n_out the up projection's. One split: the program stores the result (SwiGLU-OAI of
# the pair with SWIGLU, fp32 until the store). SPLITS > 1: each split stores its fp32 sums in part
# [SPLITS, M, out_features], and the last split of (e, block) to finish (counted in count_ptr, which it resets
# for the next launch) adds them up in split order, so the result does not depend on which finished first.
@triton.jit(do_not_specialize=["n_rows"])  # the row count changes step to step: one binary for all
def _expert_linear_kernel(x_ptr, w_ptr, offs_ptr, out_ptr, part_ptr, count_ptr, n_out, k_dim, k_split, n_rows,
                          stride_x, stride_we, stride_wn, stride_o, alpha, limit, SWIGLU: tl.constexpr,
                          SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    split = tl.program_id(2)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    w_gate = w_ptr + e.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + n_out * stride_wn
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k_dim)
    part_width = 2 * n_out if SWIGLU else n_out
    ACC: tl.constexpr = tl.float64 if PRECISION == "ieee" else tl.float32
    for m0 in range(start, end, ROWS):
        rows = m0 + tl.arange(0, ROWS)
        row_ok = rows < end
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        acc = tl.zeros([ROWS, BLOCK_N], ACC)
        acc_up = tl.zeros([ROWS, BLOCK_N], ACC)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            xt = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = col_ok[:, None] & k_ok[None, :]
            # fp32 operands: each step's dot (fp32, one feature after another) added in fp64, so the error grows
            # with BLOCK_K, not with every feature; bf16: `.to` is a no-op and the add folds into the MMA
            acc += tl.dot(xt, tl.trans(tl.load(w_gate + ks[None, :], mask=w_ok, other=0.0)),
                          input_precision=PRECISION).to(ACC)
            if SWIGLU:
                acc_up += tl.dot(xt, tl.trans(tl.load(w_up + ks[None, :], mask=w_ok, other=0.0)),
                                 input_precision=PRECISION).to(ACC)
        if SPLITS == 1:
            _store_rows(acc, acc_up, out_ptr, rows, row_ok, cols, col_ok, stride_o, alpha, limit, SWIGLU)
        else:
            at = part_ptr + (split * n_rows + rows[:, None]).to(tl.int64) * part_width + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            tl.store(at, acc, mask=ok)
            if SWIGLU:
                tl.store(at + n_out, acc_up, mask=ok)
    if SPLITS > 1:
        if end > start:
            tl.debug_barrier()  # every thread's partial stores come before the release below
            counter = count_ptr + e * tl.num_programs(1) + nb
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for m0 in range(start, end, ROWS):
                    rows = m0 + tl.arange(0, ROWS)
                    row_ok = rows < end
                    ok = row_ok[:, None] & col_ok[None, :]
                    acc = tl.zeros([ROWS, BLOCK_N], ACC)
                    acc_up = tl.zeros([ROWS, BLOCK_N], ACC)
                    for s in tl.static_range(SPLITS):
                        at = part_ptr + (s * n_rows + rows[:, None]).to(tl.int64) * part_width + cols[None, :]
                        acc += tl.load(at, mask=ok, other=0.0)
                        if SWIGLU:
                            acc_up += tl.load(at + n_out, mask=ok, other=0.0)
                    _store_rows(acc, acc_up, out_ptr, rows, row_ok, cols, col_ok, stride_o, alpha, limit, SWIGLU)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def launch(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, n_out: int,
           block_n: int, splits: int, swiglu: tuple[float, float] | None) -> None:
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    num_experts, out_features, k_dim = weight.shape
    col_blocks = triton.cdiv(n_out, block_n)
    k_split = triton.cdiv(triton.cdiv(k_dim, splits), _BLOCK_K) * _BLOCK_K  # whole feature steps per split
    splits = triton.cdiv(k_dim, k_split)
    if splits > 1:
        part = torch.empty(splits, x.shape[0], out_features, dtype=torch.float32, device=x.device)
        count = arrival_counters(num_experts * col_blocks, x.device, "moe_experts")
    else:
        part = count = out  # unused
    _expert_linear_kernel[(num_experts, col_blocks, splits)](
        x, weight, offs, out, part, count, n_out, k_dim, k_split, x.shape[0], x.stride(0), weight.stride(0),
        weight.stride(1), out.stride(0), float(alpha), float(limit), SWIGLU=swiglu is not None, SPLITS=splits,
        ROWS=_ROWS, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4)
