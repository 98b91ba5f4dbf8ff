"""Triton kernels of `openm3.ops.moe_routing` (imported only when they run, so CPU installs need no Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .msa.triton_common import next_pow2

_ROUTE_ROWS = 16  # router rows per program
_PAIRS = 16  # (token, slot) pairs per sorting program
_CHUNK = 128  # pairs compared per step when counting a pair's place
_COLUMNS = 256  # columns of x each sorting program copies


# sigmoid scores, the top-k of scores + bias by k argmax passes (lowest column first among equals, as torch's
# argmax), the chosen plain scores normalised to sum 1
@triton.jit(do_not_specialize=["n_rows"])
def _route_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, n_rows, n_experts, stride_l,
                  K: tl.constexpr, K_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < n_rows
    col_ok = cols < n_experts
    x = tl.load(logit_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    scores = tl.sigmoid(x)
    sel = tl.where(col_ok[None, :], scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :],
                   float("-inf"))
    slots = tl.arange(0, K_P2)
    ids = tl.zeros([ROWS, K_P2], tl.int64)
    picked = tl.zeros([ROWS, K_P2], tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(sel, axis=1, tie_break_left=True)  # [ROWS]
        hit = cols[None, :] == best[:, None]
        ids = tl.where(slots[None, :] == j, best[:, None].to(tl.int64), ids)
        picked = tl.where(slots[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], picked)
        sel = tl.where(hit, float("-inf"), sel)
    total = tl.sum(picked, axis=1)
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    ok = row_ok[:, None] & (slots < K)[None, :]
    tl.store(w_ptr + out, picked / total[:, None], mask=ok)
    tl.store(id_ptr + out, ids, mask=ok)


# pair p = (token p // K, slot p % K) goes to place pos[p] = #pairs with a lower expert + #earlier pairs with the
# same one (a stable sort by expert); its token's row is copied there, each program (pairs, column block) copying
# one block of columns; programs of column block 0 write the places and program (0, 0) offs[e] = #pairs with
# expert <= e
@triton.jit(do_not_specialize=["n_pairs"])
def _sort_pairs_kernel(id_ptr, x_ptr, rows_ptr, pos_ptr, offs_ptr, n_pairs, n_experts, hidden, stride_x,
                       K: tl.constexpr, PAIRS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    col = tl.program_id(1)
    p = pid * PAIRS + tl.arange(0, PAIRS)
    p_ok = p < n_pairs
    e = tl.load(id_ptr + p, mask=p_ok, other=0).to(tl.int32)
    place = tl.zeros([PAIRS], tl.int32)
    for start in range(0, n_pairs, CHUNK):
        q = start + tl.arange(0, CHUNK)
        eq = tl.load(id_ptr + q, mask=q < n_pairs, other=n_experts).to(tl.int32)  # padding sorts last
        before = (eq[None, :] < e[:, None]) | ((eq[None, :] == e[:, None]) & (q[None, :] < p[:, None]))
        place += tl.sum(before.to(tl.int32), axis=1)
    cols = col * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = p_ok[:, None] & (cols < hidden)[None, :]
    row = tl.load(x_ptr + ((p // K).to(tl.int64) * stride_x)[:, None] + cols[None, :], mask=ok)
    tl.store(rows_ptr + (place.to(tl.int64) * hidden)[:, None] + cols[None, :], row, mask=ok)
    if col == 0:
        tl.store(pos_ptr + p, place.to(tl.int64), mask=p_ok)
        if pid == 0:
            experts = tl.arange(0, BLOCK_E)
            count = tl.zeros([BLOCK_E], tl.int32)
            for start in range(0, n_pairs, CHUNK):
                q = start + tl.arange(0, CHUNK)
                eq = tl.load(id_ptr + q, mask=q < n_pairs, other=n_experts).to(tl.int32)
                count += tl.sum((eq[None, :] <= experts[:, None]).to(tl.int32), axis=1)
            tl.store(offs_ptr + experts, count, mask=experts < n_experts)


def launch_route(logits: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    n, e = logits.shape
    block_e = next_pow2(e)
    rows = max(1, min(_ROUTE_ROWS, 4096 // block_e))
    _route_kernel[(triton.cdiv(n, rows),)](logits, bias, weights, ids, n, e, logits.stride(0), K=k, K_P2=next_pow2(k),
                                           ROWS=rows, BLOCK_E=block_e, num_warps=4 if rows * block_e >= 1024 else 1)


def launch_sort_pairs(ids: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, offs: torch.Tensor,
                      k: int) -> None:
    n_pairs = ids.numel()
    hidden = x.shape[1]
    block_h = min(_COLUMNS, next_pow2(hidden))
    _sort_pairs_kernel[(triton.cdiv(n_pairs, _PAIRS), triton.cdiv(hidden, block_h))](
        ids, x, rows, pos, offs, n_pairs, offs.numel(), hidden, x.stride(0), K=k, PAIRS=_PAIRS, CHUNK=_CHUNK,
        BLOCK_E=next_pow2(offs.numel()), BLOCK_H=block_h, num_warps=4)
