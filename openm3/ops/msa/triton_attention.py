"""MSA sparse attention in Triton: forward, and backward (dk/dv key-block-outer, dq fused into it or query-outer).

Public entry: `sparse_attention(q, k, v, block_idx, cu_seqlens, *, block_size, scale=None, cu_seqlens_k=None)
-> (o [T, Hq, D], lse fp32 [T, Hq])`, the same contract as `reference.sparse_attention`.

Schedule (details, measurements and cost floors in docs/kernels_attention.md):
- Query tiles. A program owns `tokens_per_tile` consecutive query tokens times the `G = Hq // Hkv` query heads of
  one KV group: a [block_m, D] tile, rows ordered (token, head). With M3's G = 16 the GPU default is one token's
  16 heads. With several tokens per tile (smaller groups, or a larger block_m) their selections differ, so the
  program walks the *union* of their blocks (sorted, deduplicated with torch ops beforehand, with an int64 bit set
  per block of the tile's tokens that chose it) and masks each row to the blocks its own token chose (one shift
  per row and key tile). Blocks are addressed by absolute key row, so a tile may straddle a sequence boundary;
  causality is `key_row <= qpos[row]`. K/V tiles come through TMA tensor descriptors where possible.
- Hybrid forward (`union_max` > 0, the GPU default at M3's G = 16): the multi-token tiles whose union holds at
  most `union_max` blocks walk it; the tokens of the others are handled one per program by a second launch, so K/V
  loads are shared only where the tokens' selections overlap enough to pay for the masked rows.
- Forward: online softmax (exp2 domain) over the candidate blocks, fp32 accumulators, writes o and lse.
- Backward: delta = rowsum(dO * O) (a small kernel); dk/dv key-block-outer: one program per (group, key block
  tile, chunk of at most `dkdv_max_tokens` queries that selected that block), walking those queries (from an
  inverse index built with one sort) in steps of whole tokens, with key-major dots. Only hot blocks split into
  several chunks need atomics for dk/dv. dq either inside that kernel (fp32 atomic adds of dS K into a [T, Hq, D]
  buffer, the GPU default) or in a query-outer kernel with the forward's tiling, recomputing P from lse.

Launch parameters come from `triton_common.attention_launch` (one place, overridable for tuning).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import (check_attention_inputs, check_block_idx, check_block_params, check_scale,
                      check_seqlens)
from .triton_common import (attention_launch, check_block_size, check_triton_inputs, interpreting, key_block_work,
                            next_pow2, query_positions, query_tiling, tile_candidates)

__all__ = ["sparse_attention"]

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _load_query_tile(X, tok, head, row_ok, d, d_ok, stride_t, stride_h):
    """[BLOCK_M, BLOCK_D] rows (tok, head) of a [T, H, D] tensor."""
    ptrs = X + tok[:, None].to(tl.int64) * stride_t + head[:, None] * stride_h + d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _load_key_tile(X, kpos, k_ok, g, d, d_ok, stride_t, stride_h):
    """[BLOCK_N, BLOCK_D] rows kpos of head g of a [Tk, Hkv, D] tensor."""
    ptrs = X + kpos[:, None].to(tl.int64) * stride_t + g * stride_h + d[None, :]
    return tl.load(ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _key_tile(X, kpos, row0, k_ok, g, d, d_ok, stride_t, stride_h, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """[BLOCK_N, BLOCK_D] keys kpos = row0 + arange(BLOCK_N) of head g: through the tensor-memory accelerator when
    X is a [Tk, Hkv * D] tensor descriptor (rows past Tk read as 0), else with masked pointer loads."""
    if USE_TMA:
        return X.load([row0, g * BLOCK_D])
    else:
        return _load_key_tile(X, kpos, k_ok, g, d, d_ok, stride_t, stride_h)


@triton.jit
def _visible(kpos, k_ok, qpos, row_token, members, TOKENS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] mask: causal, inside the key tensor and, for multi-token tiles, a block the row's own
    token selected (`members`: the block's int64 bit set of the tile's tokens that chose it; `row_token`: each
    row's token index within the tile)."""
    visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
    if TOKENS > 1:
        member = ((members >> row_token) & 1) != 0
        visible = visible & member[:, None]
    return visible


@triton.jit
def _tile_scores(q, qpos, row_token, K, cand_base, memb_base, step, g, d, d_ok, Tk, stride_kt, stride_kh, qk_scale,
                 N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tile `step` of a query tile's candidate blocks (N_SUB tiles of BLOCK_N keys per block): its first key
    row, key positions and in-range mask, K tile, scores s = q K^T * qk_scale and the [BLOCK_M, BLOCK_N] mask of
    what each row may see (`_visible`). Shared by the forward and the query-outer dq pass."""
    start = tl.load(cand_base + step // N_SUB)
    row0 = start + (step % N_SUB) * BLOCK_N
    kpos = row0 + tl.arange(0, BLOCK_N)
    k_ok = kpos < Tk
    k = _key_tile(K, kpos, row0, k_ok, g, d, d_ok, stride_kt, stride_kh, BLOCK_D, USE_TMA)
    members = tl.load(memb_base + step // N_SUB) if TOKENS > 1 else 0
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    return row0, kpos, k_ok, k, s, _visible(kpos, k_ok, qpos, row_token, members, TOKENS)


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One key tile of an exp2-domain online softmax: s [M, N] masked scores (-inf where invisible), running max
    m_i and sum l_i [M] -> (m_new, alpha, p, l_new); rows with nothing visible yet stay at m = -inf, NaN-free.
    The caller rescales its accumulator by alpha and adds p @ V."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _fwd_step(q, qpos, row_token, m_i, l_i, acc, K, V, cand_base, memb_base, step, g, d, d_ok, Tk,
              stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
              N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """One [BLOCK_N] key tile of the online softmax (exp2 domain)."""
    row0, kpos, k_ok, k, s, visible = _tile_scores(q, qpos, row_token, K, cand_base, memb_base, step, g, d, d_ok,
                                                   Tk, stride_kt, stride_kh, qk_scale, N_SUB, BLOCK_N, BLOCK_D,
                                                   TOKENS, DOT_PRECISION, USE_TMA)
    m_new, alpha, p, l_i = _online_softmax(tl.where(visible, s, float("-inf")), m_i, l_i)
    v = _key_tile(V, kpos, row0, k_ok, g, d, d_ok, stride_vt, stride_vh, BLOCK_D, USE_TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile_walk(CAND, MEMB, NCAND, tile, g, n_tiles, cand_stride, N_SUB: tl.constexpr):
    """Where query tile `tile` of group g finds its candidate blocks and membership bits, and how many key
    tiles (N_SUB per block) it walks."""
    cand_base = CAND + (g * n_tiles + tile).to(tl.int64) * cand_stride
    memb_base = MEMB + (g * n_tiles + tile).to(tl.int64) * cand_stride
    return cand_base, memb_base, tl.load(NCAND + g * n_tiles + tile) * N_SUB


@triton.jit
def _load_tile_rows(Q, QPOS, tile, g, T, stride_qt, stride_qh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    TOKENS: tl.constexpr):
    """Row bookkeeping of a query tile: rows are (token, head) = (tile * TOKENS + r // GROUP, g * GROUP + r % GROUP)."""
    rows = tl.arange(0, BLOCK_M)
    tok = tile * TOKENS + rows // GROUP
    head = g * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = _load_query_tile(Q, tok, head, row_ok, d, d_ok, stride_qt, stride_qh)
    qpos = tl.load(QPOS + tok, mask=row_ok, other=-1)
    row_token = (rows // GROUP).to(tl.int64)
    return tok, head, row_ok, d, d_ok, q, qpos, row_token


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, QPOS, MEMB, CAND, NCAND, UNION_NCAND,
    T, Tk, n_tiles, cand_stride, n_union_tiles, union_max,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, USE_TMA: tl.constexpr, HYBRID: tl.constexpr, UNION_TOKENS: tl.constexpr,
):
    """o, lse of one query tile (grid: n_tiles x Hkv). LSE is [T, Hq] fp32 contiguous. With USE_TMA, K and V are
    [Tk, Hkv * D] tensor descriptors with [BLOCK_N, BLOCK_D] boxes.

    HYBRID splits the forward into two launches by the union sizes UNION_NCAND [Hkv, n_union_tiles] of tiles of
    UNION_TOKENS tokens: 1, the union pass, handles only the tiles whose union holds at most `union_max` blocks
    (TOKENS = UNION_TOKENS); 2, the one-token pass (TOKENS = 1, CAND the selection itself), only the tokens of
    the other tiles. 0: every tile."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    cand_base, memb_base, n_steps = _tile_walk(CAND, MEMB, NCAND, tile, g, n_tiles, cand_stride, N_SUB)
    run = True
    if HYBRID == 1:
        run = n_steps <= union_max * N_SUB
    if HYBRID == 2:
        run = tl.load(UNION_NCAND + g * n_union_tiles + tile // UNION_TOKENS) > union_max
    if run:
        tok, head, row_ok, d, d_ok, q, qpos, row_token = _load_tile_rows(
            Q, QPOS, tile, g, T, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, TOKENS)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if WHILE_LOOPS:  # the CPU interpreter cannot use a loaded scalar as a range() bound
            step = 0
            while step < n_steps:
                m_i, l_i, acc = _fwd_step(q, qpos, row_token, m_i, l_i, acc, K, V, cand_base, memb_base, step, g,
                                          d, d_ok, Tk, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                                          N_SUB, BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)
                step += 1
        else:
            for step in range(0, n_steps):
                m_i, l_i, acc = _fwd_step(q, qpos, row_token, m_i, l_i, acc, K, V, cand_base, memb_base, step, g,
                                          d, d_ok, Tk, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                                          N_SUB, BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)

        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # x ln 2
        o_ptrs = O + tok[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + tok.to(tl.int64) * (GROUP * tl.num_programs(1)) + head, lse, mask=row_ok)


@triton.jit
def _dq_step(q, do, lse2, delta, qpos, row_token, dq, K, V, cand_base, memb_base, step, g, d, d_ok, Tk,
             stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
             N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
             DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """dq += dS @ K over one [BLOCK_N] key tile, P recomputed from lse (log2 domain)."""
    row0, kpos, k_ok, k, s, visible = _tile_scores(q, qpos, row_token, K, cand_base, memb_base, step, g, d, d_ok,
                                                   Tk, stride_kt, stride_kh, qk_scale, N_SUB, BLOCK_N, BLOCK_D,
                                                   TOKENS, DOT_PRECISION, USE_TMA)
    v = _key_tile(V, kpos, row0, k_ok, g, d, d_ok, stride_vt, stride_vh, BLOCK_D, USE_TMA)
    p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _attn_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPOS, MEMB, CAND, NCAND,
    T, Tk, n_tiles, cand_stride,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dq of one query tile (grid: n_tiles x Hkv). DO and DQ share q's strides; LSE, DELTA are [T, Hq] fp32.
    K, V as in the forward kernel."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    num_heads = GROUP * tl.num_programs(1)
    tok, head, row_ok, d, d_ok, q, qpos, row_token = _load_tile_rows(
        Q, QPOS, tile, g, T, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, TOKENS)
    do = _load_query_tile(DO, tok, head, row_ok, d, d_ok, stride_qt, stride_qh)
    lse = tl.load(LSE + tok.to(tl.int64) * num_heads + head, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # no keys: P = 0
    delta = tl.load(DELTA + tok.to(tl.int64) * num_heads + head, mask=row_ok, other=0.0)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    cand_base, memb_base, n_steps = _tile_walk(CAND, MEMB, NCAND, tile, g, n_tiles, cand_stride, N_SUB)
    if WHILE_LOOPS:
        step = 0
        while step < n_steps:
            dq = _dq_step(q, do, lse2, delta, qpos, row_token, dq, K, V, cand_base, memb_base, step, g, d, d_ok,
                          Tk, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                          N_SUB, BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)
            step += 1
    else:
        for step in range(0, n_steps):
            dq = _dq_step(q, do, lse2, delta, qpos, row_token, dq, K, V, cand_base, memb_base, step, g, d, d_ok,
                          Tk, stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                          N_SUB, BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)

    dq_ptrs = DQ + tok[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkdv_step(k, v, kpos, k_ok, dk, dv, Q, DO, LSE, DELTA, QPOS, DQ, TOKENS_LIST, j, hi, g,
               stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok, TEACH, ENTRY_LIST, key0,
               NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSE_DQ: tl.constexpr, PASS: tl.constexpr,
               DQ_T: tl.constexpr, TEACHER: tl.constexpr, TEACHER_MEAN: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Accumulate dk, dv of one key tile over the next TOKENS queries `TOKENS_LIST[j : j + TOKENS]`; with FUSE_DQ
    also add this tile's dq = scale * dS K into the fp32 [T, Hq, D] buffer DQ (atomics: a query's blocks are
    handled by different programs). PASS 0 does all of it, 1 only dv, 2 only dk (and dq): a split pass keeps one
    fp32 accumulator live instead of two, for fewer registers per thread. With TEACHER (passes 0 and 1) the
    indexer KL's teacher is stored on the way: the mean over the group's heads of P = exp(s - lse) (capped at 1,
    as `_teacher_step`'s) of each token, at TEACH[entry, key0 + key] for the entry `ENTRY_LIST[j + token]`.

    Key-major: S^T = K Q^T is [BLOCK_N, BLOCK_M], so every dot has the key tile as its M dimension (a wgmma on
    Hopper) and P^T / dS^T feed dV += P^T dO and dK += dS^T Q straight from registers."""
    rows = tl.arange(0, BLOCK_M)
    head = g * GROUP + rows % GROUP
    idx = j + rows // GROUP
    row_ok = (rows < TOKENS * GROUP) & (idx < hi)
    tok = tl.load(TOKENS_LIST + idx, mask=row_ok, other=0)
    q = _load_query_tile(Q, tok, head, row_ok, d, d_ok, stride_qt, stride_qh)
    do = _load_query_tile(DO, tok, head, row_ok, d, d_ok, stride_qt, stride_qh)
    lse = tl.load(LSE + tok.to(tl.int64) * NUM_HEADS + head, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    qpos = tl.load(QPOS + tok, mask=row_ok, other=-1)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    visible = (kpos[:, None] <= qpos[None, :]) & k_ok[:, None] & row_ok[None, :]
    p_t = tl.where(visible, tl.math.exp2(s_t - lse2[None, :]), 0.0)
    if PASS != 2:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        if TEACHER:  # rows are (token, head) with the head fastest: the mean of each token's GROUP rows
            # token columns (a dot's N: at least 16 when the mean is a dot)
            TOK: tl.constexpr = max(16, BLOCK_M // GROUP) if TEACHER_MEAN == 2 else BLOCK_M // GROUP
            t_local = tl.arange(0, TOK)
            t_ok = (t_local < TOKENS) & (j + t_local < hi)
            entry = tl.load(ENTRY_LIST + j + t_local, mask=t_ok, other=0).to(tl.int64)
            key = key0 + tl.arange(0, p_t.shape[0])
            if TEACHER_MEAN == 2:  # P [keys, rows] @ A [rows, tokens], A = 1/G on each token's head rows
                avg = tl.where(tl.arange(0, BLOCK_M)[:, None] // GROUP == t_local[None, :], 1.0 / GROUP, 0.0)
                p_mean = tl.dot(tl.minimum(p_t, 1.0).to(TEACH.dtype.element_ty), avg.to(TEACH.dtype.element_ty),
                                input_precision=DOT_PRECISION)
            else:  # a sum over each token's GROUP columns in P's layout
                p_mean = tl.sum(tl.reshape(tl.minimum(p_t, 1.0), [p_t.shape[0], TOK, GROUP]), 2) * (1.0 / GROUP)
            tl.store(TEACH + entry[None, :] * BLOCK_SIZE + key[:, None], p_mean.to(TEACH.dtype.element_ty),
                     mask=t_ok[None, :] & (key < BLOCK_SIZE)[:, None])
    if PASS != 1:
        delta = tl.load(DELTA + tok.to(tl.int64) * NUM_HEADS + head, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        if FUSE_DQ:
            if DQ_T:
                dq_t = tl.dot(tl.trans(k), ds_t.to(k.dtype), input_precision=DOT_PRECISION) * sm_scale  # [D, M]
                offs = (tok[None, :].to(tl.int64) * NUM_HEADS + head[None, :]) * HEAD_DIM + d[:, None]
                tl.atomic_add(DQ + offs, dq_t, mask=row_ok[None, :] & d_ok[:, None], sem="relaxed")
            else:
                dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_M, D]
                offs = (tok[:, None].to(tl.int64) * NUM_HEADS + head[:, None]) * HEAD_DIM + d[None, :]
                tl.atomic_add(DQ + offs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _attn_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
    TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END, TEACH, ENTRY_LIST,
    num_block_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
    qk_scale, sm_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, FUSE_DQ: tl.constexpr, PASS: tl.constexpr, DQ_T: tl.constexpr,
    TEACHER: tl.constexpr, TEACHER_MEAN: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """dk, dv of one [BLOCK_N] key sub-block of one group over one chunk of the queries that selected it
    (grid: work items x sub-blocks per selection block). DO shares q's strides; DK/DV are fp32 [Tk, Hkv, D];
    with FUSE_DQ, dq is accumulated into the fp32 [T, Hq, D] buffer DQ too (by the pass that computes dk).
    PASS 0 computes dk and dv, 1 only dv, 2 only dk (see `_dkdv_step`). With TEACHER also the indexer KL's
    teacher rows TEACH [Hkv * T * topk, BLOCK_SIZE] of the positions' entries ENTRY_LIST (see `_dkdv_step`)."""
    item = tl.program_id(0)
    sub = tl.program_id(1)
    lo = tl.load(ITEM_LO + item)
    hi = tl.load(ITEM_HI + item)
    bucket = tl.load(ITEM_BUCKET + item)
    g = bucket // num_block_slots
    gb = bucket % num_block_slots
    kstart = tl.load(BLOCK_START + gb) + sub * BLOCK_N
    kend = tl.load(BLOCK_END + gb)
    if (hi > lo) & (kstart < kend):
        kpos = kstart + tl.arange(0, BLOCK_N)
        k_ok = kpos < kend  # a partial last block must not touch the next sequence's keys
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        k = _load_key_tile(K, kpos, k_ok, g, d, d_ok, stride_kt, stride_kh)
        v = k  # the dv pass never reads v
        if PASS != 1:
            v = _load_key_tile(V, kpos, k_ok, g, d, d_ok, stride_vt, stride_vh)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        if WHILE_LOOPS:
            j = lo
            while j < hi:
                dk, dv = _dkdv_step(k, v, kpos, k_ok, dk, dv, Q, DO, LSE, DELTA, QPOS, DQ, TOKENS_LIST, j, hi, g,
                                    stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok, TEACH, ENTRY_LIST,
                                    sub * BLOCK_N, NUM_HEADS, GROUP, HEAD_DIM, BLOCK_M, TOKENS, DOT_PRECISION,
                                    FUSE_DQ, PASS, DQ_T, TEACHER, TEACHER_MEAN, BLOCK_SIZE)
                j += TOKENS
        else:
            for j in range(lo, hi, TOKENS):
                dk, dv = _dkdv_step(k, v, kpos, k_ok, dk, dv, Q, DO, LSE, DELTA, QPOS, DQ, TOKENS_LIST, j, hi, g,
                                    stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok, TEACH, ENTRY_LIST,
                                    sub * BLOCK_N, NUM_HEADS, GROUP, HEAD_DIM, BLOCK_M, TOKENS, DOT_PRECISION,
                                    FUSE_DQ, PASS, DQ_T, TEACHER, TEACHER_MEAN, BLOCK_SIZE)
        offs = kpos[:, None].to(tl.int64) * stride_dt + g * stride_dh + d[None, :]
        out_ok = k_ok[:, None] & d_ok[None, :]
        if tl.load(ITEM_SPLIT + item) != 0:  # a hot block split over several programs: sum their parts
            if PASS != 1:
                tl.atomic_add(DK + offs, dk * sm_scale, mask=out_ok, sem="relaxed")
            if PASS != 2:
                tl.atomic_add(DV + offs, dv, mask=out_ok, sem="relaxed")
        else:
            if PASS != 1:
                tl.store(DK + offs, dk * sm_scale, mask=out_ok)
            if PASS != 2:
                tl.store(DV + offs, dv, mask=out_ok)


@triton.jit
def _delta_kernel(DO, O, DELTA, n_rows, num_heads, stride_dt, stride_dh, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[t, h] = sum_d dO[t, h, d] * O[t, h, d] in fp32 for BLOCK_R rows (t, h) (grid: rows / BLOCK_R), without
    materialising fp32 copies of dO and O."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    t = (r // num_heads).to(tl.int64)
    h = r % num_heads
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    do = tl.load(DO + t[:, None] * stride_dt + h[:, None] * stride_dh + d[None, :], mask=mask, other=0.0)
    o = tl.load(O + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + r, tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1), mask=r_ok)


# ---------------------------------------------------------------------------------------------------------------
# Launchers


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are compared against the fp32 reference: no TF32 rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


def _key_operands(k, v, want_tma: int, block_n: int):
    """(K, V, use_tma) for the query-outer kernels: [Tk, Hkv * D] tensor descriptors with [block_n, D] boxes when
    asked for and the layout allows it (heads of one row adjacent, power-of-two D, 16-byte aligned rows, a GPU
    with TMA or the interpreter), else the tensors themselves for pointer loads."""
    tk, hkv, dim = k.shape
    tma_ok = bool(want_tma) and (interpreting() or (k.is_cuda and torch.cuda.get_device_capability(k.device)[0] >= 9))
    if not tma_ok or dim != next_pow2(dim) or tk == 0:
        return k, v, False
    descs = []
    for x in (k, v):
        if x.stride(1) != dim or x.stride(2) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
            return k, v, False
        descs.append(TensorDescriptor(x, shape=[tk, hkv * dim], strides=[x.stride(0), 1], block_shape=[block_n, dim]))
    return descs[0], descs[1], True


def _launch_common(q, k, block_size):
    t, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    launch = attention_launch(group, dim, block_size, q.dtype, q.is_cuda)
    return t, hq, hkv, group, dim, launch


def _forward(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size: int, scale: float):
    t, hq, hkv, group, dim, launch = _launch_common(q, k, block_size)
    tokens = launch.tokens_per_tile(group)
    _, qpos, sel, cand, ncand, members = query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, k.shape[0],
                                                      block_size, tokens)
    o = torch.empty_like(q)
    lse = torch.empty((t, hq), device=q.device, dtype=torch.float32)
    n_tiles = cand.shape[1]
    if t == 0:
        return o, lse
    kd, vd, use_tma = _key_operands(k, v, launch.tma, launch.block_n)
    common = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_SIZE=block_size,
                  DOT_PRECISION=_dot_precision(q.dtype), WHILE_LOOPS=interpreting(), USE_TMA=use_tma,
                  UNION_TOKENS=tokens, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
                  num_stages=launch.num_stages)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
               o.stride(1), scale * _LOG2E)
    hybrid = tokens > 1 and launch.union_max > 0
    _attn_fwd_kernel[(n_tiles, hkv)](q, kd, vd, o, lse, qpos, members, cand, ncand, ncand,
                                     t, k.shape[0], n_tiles, cand.shape[2], n_tiles, launch.union_max, *strides,
                                     BLOCK_M=launch.block_m, TOKENS=tokens, HYBRID=1 if hybrid else 0, **common)
    if hybrid:  # the tokens of the tiles whose union was too wide, one per program, walking their own blocks
        _, ncand_one, _ = tile_candidates(sel, 1)
        _attn_fwd_kernel[(t, hkv)](q, kd, vd, o, lse, qpos, sel, sel, ncand_one, ncand,
                                   t, k.shape[0], t, sel.shape[2], n_tiles, launch.union_max, *strides,
                                   BLOCK_M=next_pow2(max(16, group)), TOKENS=1, HYBRID=2, **common)
    return o, lse


def _dq_pass(q, k, v, do, lse, delta, dq, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, launch,
             precision):
    """dq with the query-outer kernel (tiling and candidate lists as the forward's). Returns (seq, qpos)."""
    t, tk, hkv, dim = q.shape[0], k.shape[0], k.shape[1], q.shape[2]
    group = q.shape[1] // hkv
    tokens = launch.dq_tokens_per_tile(group)
    seq, qpos, _, cand, ncand, members = query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, tk, block_size, tokens)
    n_tiles = cand.shape[1]
    kd, vd, use_tma = _key_operands(k, v, launch.tma, launch.dq_block_n)
    args = (q, kd, vd, do, lse, delta, dq, qpos, members, cand, ncand,
            t, tk, n_tiles, cand.shape[2],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            scale * _LOG2E, scale)
    common = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_SIZE=block_size, TOKENS=tokens,
                  DOT_PRECISION=precision, WHILE_LOOPS=interpreting(), USE_TMA=use_tma,
                  num_stages=launch.num_stages)
    _attn_dq_kernel[(n_tiles, hkv)](*args, BLOCK_M=launch.dq_block_m, BLOCK_N=launch.dq_block_n,
                                    num_warps=launch.dq_num_warps, **common)
    return seq, qpos


# dq fused into the dk/dv kernel accumulates in an fp32 [T, Hq, D] buffer (2x the size of q in bf16); above this
# size (256K tokens of M3) the backward uses the separate dq pass instead, which needs no workspace.
FUSED_DQ_MAX_BYTES = 8 << 30


def _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size: int, scale: float,
              teacher_dtype: torch.dtype | None = None):
    """(dq, dk, dv) of the sparse attention, plus with `teacher_dtype` the indexer KL's teacher probabilities
    [Hkv, T, topk, block_size] in that dtype, computed by the dk/dv kernel on the way (as `triton_kl._teacher_pass`
    computes them: rows of unused slots left unwritten). The teacher needs a power-of-two group."""
    t, hq, hkv, group, dim, launch = _launch_common(q, k, block_size)
    tk = k.shape[0]
    topk = block_idx.shape[2]
    teacher = None
    if teacher_dtype is not None:
        if group & (group - 1):
            raise ValueError(f"the teacher from the dk/dv kernel needs a power-of-two group, got {group}")
        if hkv * t * topk >= 2 ** 31:
            raise ValueError(f"the teacher from the dk/dv kernel numbers entries in int32: {hkv} x {t} x {topk} "
                             f"entries are too many")
        teacher = torch.empty((hkv, t, topk, block_size), device=q.device, dtype=teacher_dtype)
    # The kernels index dO and dq with q's strides: give all three one dense layout (a copy only for a q that is
    # a strided view, e.g. a slice of a fused qkv projection).
    dq = torch.empty_like(q)
    if dq.stride() != q.stride():
        q = q.contiguous()
    if do.stride() != q.stride():
        do = torch.empty_like(q).copy_(do)
    dk = torch.zeros((tk, hkv, dim), device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    if t == 0:
        return dq, dk.to(k.dtype), dv.to(v.dtype), teacher
    delta = torch.empty((t, hq), device=q.device, dtype=torch.float32)
    rows_per_program = 64 if interpreting() else 16
    _delta_kernel[(triton.cdiv(t * hq, rows_per_program),)](
        do, o, delta, t * hq, hq, do.stride(0), do.stride(1), o.stride(0), o.stride(1),
        HEAD_DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_R=rows_per_program)
    lse = lse.contiguous()
    precision = _dot_precision(q.dtype)

    fuse_dq = bool(launch.dq_in_dkdv) and t * hq * dim * 4 <= FUSED_DQ_MAX_BYTES
    if fuse_dq:
        seq, qpos = query_positions(cu_seqlens, cu_seqlens_k, t)
        dq32 = torch.zeros((t, hq, dim), device=q.device, dtype=torch.float32)
    else:
        seq, qpos = _dq_pass(q, k, v, do, lse, delta, dq, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale,
                             launch, precision)
        dq32 = dk  # placeholder pointer, never touched without FUSE_DQ

    work = key_block_work(block_idx, seq, cu_seqlens_k, tk, block_size, launch.dkdv_max_tokens,
                          with_entries=teacher is not None)
    n_sub = block_size // launch.dkdv_block_n
    for dkdv_pass in ((1, 2) if launch.dkdv_split else (0,)):  # split: dv, then dk (+ dq), one accumulator each
        _attn_dkdv_kernel[(work.lo.numel(), n_sub)](
            q, k, v, do, lse, delta, dk, dv, qpos, dq32,
            work.tokens, work.bucket, work.lo, work.hi, work.split, work.block_start, work.block_end,
            dk if teacher is None else teacher, work.tokens if teacher is None else work.entries,
            work.num_block_slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dk.stride(0), dk.stride(1),
            scale * _LOG2E, scale,
            NUM_HEADS=hq, GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim),
            BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n, TOKENS=launch.dkdv_tokens(group),
            DOT_PRECISION=precision, WHILE_LOOPS=interpreting(), FUSE_DQ=fuse_dq, PASS=dkdv_pass,
            DQ_T=bool(launch.dq_transposed), TEACHER=teacher is not None, TEACHER_MEAN=launch.teacher_mean,
            BLOCK_SIZE=block_size,
            num_warps=launch.dkdv_num_warps, num_stages=launch.dkdv_num_stages,
            **({"maxnreg": launch.dkdv_maxnreg} if launch.dkdv_maxnreg and not interpreting() else {}),
        )
    if fuse_dq:
        dq.copy_(dq32)
    return dq, dk.to(k.dtype), dv.to(v.dtype), teacher


# ---------------------------------------------------------------------------------------------------------------
# torch.library ops (traceable by torch.compile) and autograd


@torch.library.custom_op("openm3::msa_sparse_attn_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor,
            cu_seqlens_k: torch.Tensor, block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("openm3::msa_sparse_attn_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor,
            block_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)[:3]


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale):
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op("openm3::msa_sparse_attn_bwd_teacher", mutates_args=())
def _bwd_teacher_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    block_size: int, scale: float, teacher_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, teacher_dtype)


@_bwd_teacher_op.register_fake
def _bwd_teacher_fake(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, teacher_dtype):
    teacher = q.new_empty((k.shape[1], q.shape[0], block_idx.shape[2], block_size), dtype=teacher_dtype)
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape), teacher


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale):
        o, lse = torch.ops.openm3.msa_sparse_attn_fwd(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size,
                                                      scale)
        ctx.save_for_backward(q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k)
        ctx.block_size = block_size
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = torch.ops.openm3.msa_sparse_attn_bwd(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k,
                                                          ctx.block_size, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public function


# Value checks of block_idx synchronise with the device and cost a few sorts of [Hkv, T, topk]; benchmarks of the
# kernels alone may switch them off (`triton_attention.VALIDATE_BLOCK_IDX = False`).
VALIDATE_BLOCK_IDX = True


def _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, values=True) -> None:
    """The reference's validation plus what the kernels additionally need."""
    _, hkv, _ = check_attention_inputs(q, k, v)
    check_triton_inputs(q=q, k=k, v=v)
    check_block_params(block_size=block_size)
    check_block_size(block_size, "the Triton sparse-attention kernels")
    check_scale(scale)
    segments = check_seqlens(cu_seqlens, q.shape[0], cu_seqlens_k, k.shape[0], device=q.device)
    if block_idx is None or not isinstance(block_idx, torch.Tensor):
        raise ValueError("block_idx must be an int32 tensor of shape [Hi, T, topk]")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx must be on q's device {q.device}, got {block_idx.device}")
    check_block_idx(block_idx, num_heads=hkv, segments=segments, block_size=block_size,
                    values=values and VALIDATE_BLOCK_IDX)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q: the Triton kernels take float16, bfloat16 or float32, got {q.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the Triton kernels need a contiguous last (head_dim) dimension, "
                             f"got strides {x.stride()}")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                     cu_seqlens: torch.Tensor, *, block_size: int, scale: float | None = None,
                     cu_seqlens_k: torch.Tensor | None = None,
                     validate_block_idx: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of each query over the keys of its selected blocks (Triton).

    q: [T, Hq, D]; k, v: [Tk, Hkv, D]; block_idx: int32 [Hkv, T, topk] block numbers relative to each sequence
    start, -1 in unused slots; cu_seqlens: int32 [B+1] query offsets; cu_seqlens_k: int32 [B+1] key offsets
    (default cu_seqlens; queries are the last tokens of their sequence). block_size: a multiple of 16 (ValueError
    otherwise; the reference takes any). scale defaults to 1/sqrt(D).
    Returns o [T, Hq, D] in q.dtype and lse fp32 [T, Hq] (natural log; -inf for a query with no visible key).
    Differentiable in q, k, v.
    """
    _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, validate_block_idx)
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _SparseAttention.apply(q, k, v, block_idx.contiguous(), cu_seqlens, cu_seqlens_k, block_size,
                                  float(scale))
