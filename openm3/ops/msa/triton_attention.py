"""MSA sparse attention in Triton: forward, and backward (dk/dv key-block-outer, dq fused into it or query-outer).

Public entry: `sparse_attention(q, k, v, block_idx, cu_seqlens, *, block_size, scale=None, cu_seqlens_k=None)
-> (o [T, Hq, D], lse fp32 [T, Hq])`, the same contract as `reference.sparse_attention`; and
`sparse_attention_kl(q, k, v, qi, ki, block_idx, cu_seqlens, ...) -> (o, lse, kl)` (kl written by the backward).

Schedule (details, measurements and cost floors in docs/kernels_attention.md):
- Query tiles. A program owns `tokens_per_tile` consecutive query tokens times the `G = Hq // Hkv` query heads of
  one KV group: a [block_m, D] tile, rows ordered (token, head). With M3's G = 16 the GPU default is one token's
  16 heads. With several tokens per tile (smaller groups, or a larger block_m) their selections differ, so the
  program walks the *union* of their blocks (sorted, deduplicated with torch ops beforehand, with an int64 bit set
  per block of the tile's tokens that chose it) and masks each row to the blocks its own token chose (one shift
  per row and key tile). Blocks are addressed by absolute key row, so a tile may straddle a sequence boundary;
  causality is `key_row <= qpos[row]`. K/V tiles come through TMA tensor descriptors where possible.
- Forward: online softmax (exp2 domain) over the candidate blocks, fp32 accumulators, writes o and lse.
- Backward: delta = rowsum(dO * O) (a small kernel); dk/dv key-block-outer: one program per (group, key block
  tile, chunk of at most `dkdv_max_tokens` queries that selected that block), walking those queries (from an
  inverse index built with one sort) in steps of whole tokens, with key-major dots. Only hot blocks split into
  several chunks need atomics for dk/dv. dq either inside that kernel (fp32 atomic adds of dS K into a [T, Hq, D]
  buffer, the GPU default) or in a query-outer kernel with the forward's tiling, recomputing P from lse.
- Indexer KL fused into the backward (`sparse_attention_kl`): the dk/dv step already holds P^T of a key tile for
  all heads of its queries, i.e. the KL's teacher; the student's normaliser comes from triton_kl's stats pass,
  and the KL's loss terms, dqi and dki come out of the same program (no second gather of q, no teacher dots).

Launch parameters come from `triton_common.attention_launch` (one place, overridable for tuning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import (check_attention_inputs, check_block_idx, check_block_params, check_index_inputs,
                      check_scale, check_seqlens)
from .triton_common import (absolute_block_starts, attention_launch, interpreting, key_block_work, next_pow2,
                            query_positions, tile_candidates)

__all__ = ["sparse_attention", "sparse_attention_kl"]

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
def _fwd_step(q, qpos, row_token, m_i, l_i, acc, K, V, cand_base, memb_base, step, g, d, d_ok, Tk,
              stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
              N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """One [BLOCK_N] key tile of the online softmax (exp2 domain)."""
    start = tl.load(cand_base + step // N_SUB)
    row0 = start + (step % N_SUB) * BLOCK_N
    kpos = row0 + tl.arange(0, BLOCK_N)
    k_ok = kpos < Tk
    k = _key_tile(K, kpos, row0, k_ok, g, d, d_ok, stride_kt, stride_kh, BLOCK_D, USE_TMA)
    members = tl.load(memb_base + step // N_SUB) if TOKENS > 1 else 0
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(_visible(kpos, k_ok, qpos, row_token, members, TOKENS), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _key_tile(V, kpos, row0, k_ok, g, d, d_ok, stride_vt, stride_vh, BLOCK_D, USE_TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


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
    Q, K, V, O, LSE, QPOS, MEMB, CAND, NCAND,
    T, Tk, n_tiles, cand_stride,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, USE_TMA: tl.constexpr,
):
    """o, lse of one query tile (grid: n_tiles x Hkv). LSE is [T, Hq] fp32 contiguous. With USE_TMA, K and V are
    [Tk, Hkv * D] tensor descriptors with [BLOCK_N, BLOCK_D] boxes."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    tok, head, row_ok, d, d_ok, q, qpos, row_token = _load_tile_rows(
        Q, QPOS, tile, g, T, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, TOKENS)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cand_base = CAND + (g * n_tiles + tile).to(tl.int64) * cand_stride
    memb_base = MEMB + (g * n_tiles + tile).to(tl.int64) * cand_stride
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    n_steps = tl.load(NCAND + g * n_tiles + tile) * N_SUB
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
    start = tl.load(cand_base + step // N_SUB)
    row0 = start + (step % N_SUB) * BLOCK_N
    kpos = row0 + tl.arange(0, BLOCK_N)
    k_ok = kpos < Tk
    k = _key_tile(K, kpos, row0, k_ok, g, d, d_ok, stride_kt, stride_kh, BLOCK_D, USE_TMA)
    v = _key_tile(V, kpos, row0, k_ok, g, d, d_ok, stride_vt, stride_vh, BLOCK_D, USE_TMA)
    members = tl.load(memb_base + step // N_SUB) if TOKENS > 1 else 0
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(_visible(kpos, k_ok, qpos, row_token, members, TOKENS), tl.math.exp2(s - lse2[:, None]), 0.0)
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
    cand_base = CAND + (g * n_tiles + tile).to(tl.int64) * cand_stride
    memb_base = MEMB + (g * n_tiles + tile).to(tl.int64) * cand_stride
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    n_steps = tl.load(NCAND + g * n_tiles + tile) * N_SUB
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
               stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok,
               ki, dki, kl_acc, QI, LSE_Z, DQI, T, stride_qit, stride_qih, index_scale, grad_coef, di, di_ok,
               NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSE_DQ: tl.constexpr,
               KL: tl.constexpr, INDEX_DIM: tl.constexpr, TQ: tl.constexpr, P_PRECISION: tl.constexpr,
               INDEX_PRECISION: tl.constexpr):
    """Accumulate dk, dv of one key tile over the next TOKENS queries `TOKENS_LIST[j : j + TOKENS]`; with FUSE_DQ
    also add this tile's dq = scale * dS K into the fp32 [T, Hq, D] buffer DQ (atomics: a query's blocks are
    handled by different programs); with KL also the indexer KL of these queries on this key tile (`_kl_step`).

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
    delta = tl.load(DELTA + tok.to(tl.int64) * NUM_HEADS + head, mask=row_ok, other=0.0)
    qpos = tl.load(QPOS + tok, mask=row_ok, other=-1)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    visible = (kpos[:, None] <= qpos[None, :]) & k_ok[:, None] & row_ok[None, :]
    p_t = tl.where(visible, tl.math.exp2(s_t - lse2[None, :]), 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    if FUSE_DQ:
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_M, BLOCK_D]
        offs = (tok[:, None].to(tl.int64) * NUM_HEADS + head[:, None]) * HEAD_DIM + d[None, :]
        tl.atomic_add(DQ + offs, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    if KL:
        dki, kl_acc = _kl_step(p_t, ki, kpos, k_ok, dki, kl_acc, QI, LSE_Z, QPOS, DQI, TOKENS_LIST, j, hi, g, T,
                               stride_qit, stride_qih, index_scale, grad_coef, di, di_ok,
                               NUM_HEADS // GROUP, GROUP, INDEX_DIM, BLOCK_M, TOKENS, TQ, P_PRECISION,
                               INDEX_PRECISION)
    return dk, dv, dki, kl_acc


@triton.jit
def _kl_step(p_t, ki, kpos, k_ok, dki, kl_acc, QI, LSE_Z, QPOS, DQI, TOKENS_LIST, j, hi, g, T,
             stride_qit, stride_qih, index_scale, grad_coef, di, di_ok,
             NUM_INDEX_HEADS: tl.constexpr, GROUP: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
             TOKENS: tl.constexpr, TQ: tl.constexpr, P_PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr):
    """Indexer KL of the step's TOKENS queries (index head g) on this key tile, from the attention's P^T.

    Token columns are padded to TQ = max(16, TOKENS) (tl.dot's minimum): column c < TOKENS is query
    TOKENS_LIST[j + c], the others are zero. Teacher p [BLOCK_N, TQ] = mean over the group's heads of min(P^T, 1)
    (as triton_kl: p_h <= 1 even if a low-precision lse is slightly low), summed per token by one small dot with
    the 0/1 matrix sel [BLOCK_M, TQ] (P^T's columns are (token, head)). Student z = ki qi^T * index_scale,
    r = exp(z - lse_z). Adds the loss terms sum_n p (log p - z + lse_z) into kl_acc [BLOCK_N, TQ], dL/dki (unscaled:
    sum over tokens of (r - p) qi) into the dki registers, and grad_coef * (r - p)^T ki into the fp32 [T, Hi, Di]
    buffer DQI (atomics: a query's blocks are handled by different programs).

    Padded dots, not elementwise multiply-reduces: with TOKENS = 2 (the GPU default) z, dqi and dki are wgmmas of
    [BLOCK_N x 16 x Di], [16 x BLOCK_N x Di] and [BLOCK_N x Di x 16] (~1/8 of the step's attention dots each in
    tensor-core time), while an elementwise z = sum_d ki * qi needs a [BLOCK_N, Di] product and a cross-thread
    reduction per token, and dki += dz qi a [BLOCK_N, TOKENS, Di] fp32 broadcast (128 more registers per thread
    at BLOCK_N = Di = 128, 8 warps) on top of the dk, dv, dki accumulators."""
    cols = tl.arange(0, TQ)
    c = tl.arange(0, BLOCK_M)
    sel = ((c[:, None] // GROUP) == cols[None, :]) & (c < TOKENS * GROUP)[:, None]
    p = tl.dot(tl.minimum(p_t, 1.0), sel.to(tl.float32), input_precision=P_PRECISION) * (1.0 / GROUP)
    idx = j + cols
    ok = (cols < TOKENS) & (idx < hi)
    tok = tl.load(TOKENS_LIST + idx, mask=ok, other=0)
    qpos = tl.load(QPOS + tok, mask=ok, other=-1)
    qi = tl.load(QI + tok[:, None].to(tl.int64) * stride_qit + g * stride_qih + di[None, :],
                 mask=ok[:, None] & di_ok[None, :], other=0.0)  # [TQ, BLOCK_DI]
    lse_z = tl.load(LSE_Z + g * T + tok, mask=ok, other=0.0)
    z = tl.dot(ki, tl.trans(qi), input_precision=INDEX_PRECISION) * index_scale  # [BLOCK_N, TQ]
    vis = (kpos[:, None] <= qpos[None, :]) & k_ok[:, None] & ok[None, :]
    log_r = z - lse_z[None, :]
    # p > 0 only where visible (P^T is 0 elsewhere), where lse_z is finite.
    kl_acc += tl.where(p > 0, p * (tl.log(tl.where(p > 0, p, 1.0)) - log_r), 0.0)
    r = tl.where(vis, tl.exp(log_r), 0.0)
    dz = (r - p).to(qi.dtype)  # scaled after the dots (grad_coef), to keep low-precision dz in range
    dqi = tl.dot(tl.trans(dz), ki, input_precision=INDEX_PRECISION)  # [TQ, BLOCK_DI]
    dqi_ptrs = DQI + (tok[:, None].to(tl.int64) * NUM_INDEX_HEADS + g) * INDEX_DIM + di[None, :]
    tl.atomic_add(dqi_ptrs, dqi * grad_coef, mask=ok[:, None] & di_ok[None, :], sem="relaxed")
    dki += tl.dot(dz, qi, input_precision=INDEX_PRECISION)  # [BLOCK_N, BLOCK_DI]
    return dki, kl_acc


@triton.jit
def _dkdv_program(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
    TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END,
    num_block_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
    qk_scale, sm_scale,
    QI, KI, LSE_Z, DQI, DKI, LOSS, T, stride_qit, stride_qih, stride_kit, index_scale, grad_coef,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, FUSE_DQ: tl.constexpr,
    KL: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_DI: tl.constexpr, TQ: tl.constexpr,
    P_PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr,
):
    """The dk/dv program (see `_attn_dkdv_kernel`); with KL also the indexer KL of the same (key tile, queries)
    pairs (see `_attn_dkdv_kernel_kl`)."""
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
        v = _load_key_tile(V, kpos, k_ok, g, d, d_ok, stride_vt, stride_vh)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        # Without KL these stay untouched (loop-carried constants the compiler drops).
        di = tl.arange(0, BLOCK_DI)
        di_ok = di < INDEX_DIM
        dki = tl.zeros([BLOCK_N, BLOCK_DI], dtype=tl.float32)
        kl_acc = tl.zeros([BLOCK_N, TQ], dtype=tl.float32)
        if KL:
            ki = tl.load(KI + kpos[:, None].to(tl.int64) * stride_kit + di[None, :],
                         mask=k_ok[:, None] & di_ok[None, :], other=0.0)
        else:
            ki = 0
        if WHILE_LOOPS:
            j = lo
            while j < hi:
                dk, dv, dki, kl_acc = _dkdv_step(
                    k, v, kpos, k_ok, dk, dv, Q, DO, LSE, DELTA, QPOS, DQ, TOKENS_LIST, j, hi, g,
                    stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok,
                    ki, dki, kl_acc, QI, LSE_Z, DQI, T, stride_qit, stride_qih, index_scale, grad_coef, di, di_ok,
                    NUM_HEADS, GROUP, HEAD_DIM, BLOCK_M, TOKENS, DOT_PRECISION, FUSE_DQ,
                    KL, INDEX_DIM, TQ, P_PRECISION, INDEX_PRECISION)
                j += TOKENS
        else:
            for j in range(lo, hi, TOKENS):
                dk, dv, dki, kl_acc = _dkdv_step(
                    k, v, kpos, k_ok, dk, dv, Q, DO, LSE, DELTA, QPOS, DQ, TOKENS_LIST, j, hi, g,
                    stride_qt, stride_qh, qk_scale, sm_scale, d, d_ok,
                    ki, dki, kl_acc, QI, LSE_Z, DQI, T, stride_qit, stride_qih, index_scale, grad_coef, di, di_ok,
                    NUM_HEADS, GROUP, HEAD_DIM, BLOCK_M, TOKENS, DOT_PRECISION, FUSE_DQ,
                    KL, INDEX_DIM, TQ, P_PRECISION, INDEX_PRECISION)
        offs = kpos[:, None].to(tl.int64) * stride_dt + g * stride_dh + d[None, :]
        out_ok = k_ok[:, None] & d_ok[None, :]
        split = tl.load(ITEM_SPLIT + item) != 0
        if split:  # a hot block split over several programs: sum their parts
            tl.atomic_add(DK + offs, dk * sm_scale, mask=out_ok, sem="relaxed")
            tl.atomic_add(DV + offs, dv, mask=out_ok, sem="relaxed")
        else:
            tl.store(DK + offs, dk * sm_scale, mask=out_ok)
            tl.store(DV + offs, dv, mask=out_ok)
        if KL:
            # ki is shared by the Hi index heads, whose programs cover the same key rows: always an atomic add
            # (one [BLOCK_N, Di] tile per program, Hi-way contention at most outside split blocks).
            dki_offs = kpos[:, None].to(tl.int64) * INDEX_DIM + di[None, :]
            tl.atomic_add(DKI + dki_offs, dki * grad_coef, mask=k_ok[:, None] & di_ok[None, :], sem="relaxed")
            # one partial sum per program (deterministic; the host adds them up)
            tl.store(LOSS + item * tl.num_programs(1) + sub, tl.sum(tl.sum(kl_acc, 1), 0))


@triton.jit
def _attn_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
    TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END,
    num_block_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
    qk_scale, sm_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, FUSE_DQ: tl.constexpr,
):
    """dk, dv of one [BLOCK_N] key sub-block of one group over one chunk of the queries that selected it
    (grid: work items x sub-blocks per selection block). DO shares q's strides; DK/DV are fp32 [Tk, Hkv, D];
    with FUSE_DQ, dq is accumulated into the fp32 [T, Hq, D] buffer DQ too."""
    _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
                  TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END, num_block_slots,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
                  qk_scale, sm_scale,
                  Q, K, LSE, DQ, DK, DK, 0, 0, 0, 0, 1.0, 1.0,  # KL operands: placeholders, never touched
                  NUM_HEADS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, TOKENS, DOT_PRECISION, WHILE_LOOPS,
                  FUSE_DQ, False, 16, 16, 16, DOT_PRECISION, DOT_PRECISION)


@triton.jit
def _attn_dkdv_kernel_kl(
    Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
    TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END,
    num_block_slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
    qk_scale, sm_scale,
    QI, KI, LSE_Z, DQI, DKI, LOSS, T, stride_qit, stride_qih, stride_kit, index_scale, grad_coef,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, FUSE_DQ: tl.constexpr,
    INDEX_DIM: tl.constexpr, BLOCK_DI: tl.constexpr, TQ: tl.constexpr, P_PRECISION: tl.constexpr,
    INDEX_PRECISION: tl.constexpr,
):
    """`_attn_dkdv_kernel` with the indexer KL fused in (KL=1): the teacher is the mean over the group's heads of
    the P^T the dk/dv step already holds, so the KL costs three small dots per step and no second q gather.

    QI [T, Hi, Di] (strides stride_qit, stride_qih), KI [Tk, Di] (stride_kit); LSE_Z fp32 [Hi, T] the student's
    log-sum-exp over each query's key set (triton_kl's stats pass). Adds into DQI fp32 [T, Hi, Di] and DKI fp32
    [Tk, Di] (atomics; DKI once per program), both times grad_coef = index_scale / (Hi T), and writes
    LOSS[item * n_sub + sub] = this program's sum of the loss terms (unnormalised)."""
    _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, QPOS, DQ,
                  TOKENS_LIST, ITEM_BUCKET, ITEM_LO, ITEM_HI, ITEM_SPLIT, BLOCK_START, BLOCK_END, num_block_slots,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dt, stride_dh,
                  qk_scale, sm_scale,
                  QI, KI, LSE_Z, DQI, DKI, LOSS, T, stride_qit, stride_qih, stride_kit, index_scale, grad_coef,
                  NUM_HEADS, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, TOKENS, DOT_PRECISION, WHILE_LOOPS,
                  FUSE_DQ, True, INDEX_DIM, BLOCK_DI, TQ, P_PRECISION, INDEX_PRECISION)


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


def _query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, block_size, tokens):
    seq, qpos = query_positions(cu_seqlens, cu_seqlens_k, t)
    sel = absolute_block_starts(block_idx, seq, cu_seqlens_k, block_size).contiguous()
    cand, ncand, members = tile_candidates(sel, tokens)
    # one-token tiles never read the membership bits: cand stands in as a placeholder pointer
    return seq, qpos, cand, ncand, cand if members is None else members


def _forward(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size: int, scale: float):
    t, hq, hkv, group, dim, launch = _launch_common(q, k, block_size)
    tokens = launch.tokens_per_tile(group)
    _, qpos, cand, ncand, members = _query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, block_size, tokens)
    o = torch.empty_like(q)
    lse = torch.empty((t, hq), device=q.device, dtype=torch.float32)
    n_tiles = cand.shape[1]
    if t == 0:
        return o, lse
    kd, vd, use_tma = _key_operands(k, v, launch.tma, launch.block_n)
    args = (q, kd, vd, o, lse, qpos, members, cand, ncand,
            t, k.shape[0], n_tiles, cand.shape[2],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
            scale * _LOG2E)
    common = dict(GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_SIZE=block_size, TOKENS=tokens,
                  DOT_PRECISION=_dot_precision(q.dtype), WHILE_LOOPS=interpreting(), USE_TMA=use_tma,
                  num_stages=launch.num_stages)
    _attn_fwd_kernel[(n_tiles, hkv)](*args, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                                     num_warps=launch.num_warps, **common)
    return o, lse


def _dq_pass(q, k, v, do, lse, delta, dq, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, launch,
             precision):
    """dq with the query-outer kernel (tiling and candidate lists as the forward's). Returns (seq, qpos)."""
    t, tk, hkv, dim = q.shape[0], k.shape[0], k.shape[1], q.shape[2]
    group = q.shape[1] // hkv
    tokens = launch.dq_tokens_per_tile(group)
    seq, qpos, cand, ncand, members = _query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, block_size, tokens)
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


@dataclass(frozen=True)
class _KLOperands:
    """What the backward needs to fuse the indexer KL into the dk/dv kernel: index queries qi [T, Hi, Di] and keys
    ki [Tk, Di], the student's scale, and `out`, the 0-dim fp32 tensor that receives the KL value."""

    qi: torch.Tensor
    ki: torch.Tensor
    index_scale: float
    out: torch.Tensor


def _student_lse(q, k, qi, ki, block_idx, seq, qpos, cu_seqlens_k, block_size: int, scale: float,
                 index_scale: float) -> torch.Tensor:
    """lse_z fp32 [Hi, T]: log-sum-exp of the student logits qi[t, g] . ki[j] * index_scale over each query's key
    set, by triton_kl's stats pass (student only: the teacher's normaliser is the attention's lse)."""
    from . import triton_kl

    t, hq, d = q.shape
    tk, hkv, _ = k.shape
    di, topk = qi.shape[2], block_idx.shape[2]
    launch = triton_kl.kl_launch(hq // hkv, max(d, di), block_size, q.is_cuda)
    n_sub = -(-block_size // launch.block_n)
    work = triton_kl._entry_work(block_idx, seq, cu_seqlens_k, tk, block_size, launch.max_entries)
    z_part = torch.full((hkv, t, topk * n_sub), -math.inf, dtype=torch.float32, device=q.device)
    grid = (work.lo.numel() * n_sub,)
    if grid[0]:
        triton_kl._kl_stats_kernel[grid](
            q, k, qi, ki, work.entries, work.lo, work.hi, work.g, work.k0, work.k1, qpos, z_part, z_part,
            t, q.stride(0), q.stride(1), k.stride(0), k.stride(1), qi.stride(0), qi.stride(1), ki.stride(0),
            scale, index_scale,
            GROUP=hq // hkv, TOPK=topk, N_SUB=n_sub, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), INDEX_DIM=di,
            BLOCK_DI=max(16, next_pow2(di)), BLOCK_N=launch.block_n, BLOCK_Q=launch.block_q,
            HG=launch.heads_per_dot, TEACHER=False, DOT_PRECISION=_dot_precision(q.dtype),
            INDEX_PRECISION=_dot_precision(qi.dtype), num_warps=launch.num_warps, num_stages=launch.num_stages)
    return torch.logsumexp(z_part, dim=-1).contiguous()


def _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size: int, scale: float,
              kl: _KLOperands | None = None):
    """(dq, dk, dv) in the inputs' dtypes. With `kl`, the indexer KL is fused into the dk/dv kernel: its value is
    written into kl.out and the result is (dq, dk, dv, dqi, dki), dqi fp32 [T, Hi, Di] and dki fp32 [Tk, Di] being
    dKL/dqi and dKL/dki (for an incoming gradient of 1)."""
    t, hq, hkv, group, dim, launch = _launch_common(q, k, block_size)
    tk = k.shape[0]
    # The kernels index dO and dq with q's strides: give all three one dense layout (a copy only for a q that is
    # a strided view, e.g. a slice of a fused qkv projection).
    dq = torch.empty_like(q)
    if dq.stride() != q.stride():
        q = q.contiguous()
    if do.stride() != q.stride():
        do = torch.empty_like(q).copy_(do)
    dk = torch.zeros((tk, hkv, dim), device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    kl_grads = ()
    if kl is not None:
        qi, ki = (x if x.stride(-1) == 1 else x.contiguous() for x in (kl.qi, kl.ki))
        dqi = torch.zeros((t, hkv, qi.shape[2]), device=q.device, dtype=torch.float32)
        dki = torch.zeros(ki.shape, device=q.device, dtype=torch.float32)
        kl_grads = (dqi, dki)
        kl.out.zero_()
    if t == 0:
        return (dq, dk.to(k.dtype), dv.to(v.dtype)) + kl_grads
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

    work = key_block_work(block_idx, seq, cu_seqlens_k, tk, block_size, launch.dkdv_max_tokens)
    n_sub = block_size // launch.dkdv_block_n
    grid = (work.lo.numel(), n_sub)
    args = (q, k, v, do, lse, delta, dk, dv, qpos, dq32,
            work.tokens, work.bucket, work.lo, work.hi, work.split, work.block_start, work.block_end,
            work.num_block_slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dk.stride(0), dk.stride(1),
            scale * _LOG2E, scale)
    tokens = launch.dkdv_tokens(group)
    common = dict(NUM_HEADS=hq, GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim),
                  BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n, TOKENS=tokens,
                  DOT_PRECISION=precision, WHILE_LOOPS=interpreting(), FUSE_DQ=fuse_dq,
                  num_warps=launch.dkdv_num_warps, num_stages=launch.dkdv_num_stages)
    if kl is None:
        _attn_dkdv_kernel[grid](*args, **common)
    else:
        lse_z = _student_lse(q, k, qi, ki, block_idx, seq, qpos, cu_seqlens_k, block_size, scale, kl.index_scale)
        loss = torch.zeros(grid[0] * grid[1], device=q.device, dtype=torch.float32)
        count = t * hkv
        _attn_dkdv_kernel_kl[grid](
            *args, qi, ki, lse_z, dqi, dki, loss, t, qi.stride(0), qi.stride(1), ki.stride(0),
            kl.index_scale, kl.index_scale / count,
            INDEX_DIM=qi.shape[2], BLOCK_DI=max(16, next_pow2(qi.shape[2])), TQ=max(16, next_pow2(tokens)),
            # the teacher's per-token sum of P^T: exact in fp32 (3 tf32 passes) for 16-bit inputs too
            P_PRECISION="ieee" if q.dtype == torch.float32 else "tf32x3",
            INDEX_PRECISION=_dot_precision(qi.dtype), **common)
        kl.out.copy_(loss.sum() / count)
    if fuse_dq:
        dq.copy_(dq32)
    return (dq, dk.to(k.dtype), dv.to(v.dtype)) + kl_grads


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
    return _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale):
    return torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape)


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


@torch.library.custom_op("openm3::msa_sparse_attn_kl_bwd", mutates_args=("kl",))
def _bwd_kl_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor, block_idx: torch.Tensor,
               cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, kl: torch.Tensor, block_size: int, scale: float,
               index_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward with the indexer KL fused in: (dq, dk, dv, dqi fp32, dki fp32); writes the KL into kl."""
    return _backward(do, q, k, v, o, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale,
                     _KLOperands(qi, ki, index_scale, kl))


@_bwd_kl_op.register_fake
def _bwd_kl_fake(do, q, k, v, o, lse, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, kl, block_size, scale,
                 index_scale):
    return (torch.empty_like(q), k.new_empty(k.shape), v.new_empty(v.shape),
            qi.new_empty(qi.shape, dtype=torch.float32), ki.new_empty(ki.shape, dtype=torch.float32))


class _SparseAttentionKL(torch.autograd.Function):
    """Sparse attention and the indexer KL in one Function; see `sparse_attention_kl` for when kl gets its value."""

    @staticmethod
    def forward(ctx, q, k, v, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale, index_scale):
        o, lse = torch.ops.openm3.msa_sparse_attn_fwd(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size,
                                                      scale)
        # Inside forward grad mode is off; needs_input_grad tells whether qi / ki will receive gradients.
        ctx.fused = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        if ctx.fused:
            kl = torch.zeros((), device=q.device, dtype=torch.float32)  # filled in by backward
        else:
            from . import triton_kl  # noqa: F401 - registers openm3::msa_indexer_kl

            kl = torch.ops.openm3.msa_indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse,
                                                 block_size, scale, index_scale, False)[0]
        ctx.save_for_backward(q, k, v, o, lse, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, kl)
        ctx.block_size, ctx.scale, ctx.index_scale = block_size, scale, index_scale
        # One call (each replaces the last): kl has no gradient path unless qi or ki needs one.
        if ctx.fused:
            ctx.mark_non_differentiable(lse)
        else:
            ctx.mark_non_differentiable(lse, kl)
        return o, lse, kl

    @staticmethod
    def backward(ctx, do, dlse, dkl):
        q, k, v, o, lse, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, kl = ctx.saved_tensors
        none = (None,) * 6
        if not ctx.fused:
            dq, dk, dv = torch.ops.openm3.msa_sparse_attn_bwd(do, q, k, v, o, lse, block_idx, cu_seqlens,
                                                              cu_seqlens_k, ctx.block_size, ctx.scale)
            return dq, dk, dv, None, None, *none
        dq, dk, dv, dqi, dki = torch.ops.openm3.msa_sparse_attn_kl_bwd(
            do, q, k, v, o, lse, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, kl, ctx.block_size, ctx.scale,
            ctx.index_scale)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                (dqi * dkl).to(qi.dtype) if need[3] else None, (dki * dkl).to(ki.dtype) if need[4] else None, *none)


# ---------------------------------------------------------------------------------------------------------------
# Public function


# Value checks of block_idx synchronise with the device and cost a few sorts of [Hkv, T, topk]; benchmarks of the
# kernels alone may switch them off (`triton_attention.VALIDATE_BLOCK_IDX = False`).
VALIDATE_BLOCK_IDX = True


def _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale) -> None:
    """The reference's validation plus what the kernels additionally need."""
    _, hkv, _ = check_attention_inputs(q, k, v)
    check_block_params(block_size=block_size)
    check_scale(scale)
    segments = check_seqlens(cu_seqlens, q.shape[0], cu_seqlens_k, k.shape[0], device=q.device)
    if block_idx is None or not isinstance(block_idx, torch.Tensor):
        raise ValueError("block_idx must be an int32 tensor of shape [Hi, T, topk]")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx must be on q's device {q.device}, got {block_idx.device}")
    check_block_idx(block_idx, num_heads=hkv, segments=segments, block_size=block_size, values=VALIDATE_BLOCK_IDX)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q: the Triton kernels take float16, bfloat16 or float32, got {q.dtype}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the Triton kernels need a contiguous last (head_dim) dimension, "
                             f"got strides {x.stride()}")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                     cu_seqlens: torch.Tensor, *, block_size: int, scale: float | None = None,
                     cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of each query over the keys of its selected blocks (Triton).

    q: [T, Hq, D]; k, v: [Tk, Hkv, D]; block_idx: int32 [Hkv, T, topk] block numbers relative to each sequence
    start, -1 in unused slots; cu_seqlens: int32 [B+1] query offsets; cu_seqlens_k: int32 [B+1] key offsets
    (default cu_seqlens; queries are the last tokens of their sequence). scale defaults to 1/sqrt(D).
    Returns o [T, Hq, D] in q.dtype and lse fp32 [T, Hq] (natural log; -inf for a query with no visible key).
    Differentiable in q, k, v.
    """
    _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _SparseAttention.apply(q, k, v, block_idx.contiguous(), cu_seqlens, cu_seqlens_k, block_size,
                                  float(scale))


def sparse_attention_kl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor,
                        block_idx: torch.Tensor, cu_seqlens: torch.Tensor, *, block_size: int,
                        scale: float | None = None, index_scale: float | None = None,
                        cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sparse_attention` and the sparse indexer KL in one op (Triton): the KL is computed inside the attention
    backward's dk/dv kernel, which already holds the teacher's probabilities.

    q: [T, Hq, D]; k, v: [Tk, Hkv, D]; qi: [T, Hi, Di], ki: [Tk, Di] (Hi == Hkv; one dtype for qi, ki);
    block_idx, cu_seqlens, cu_seqlens_k, block_size, scale: as `sparse_attention`; index_scale defaults to
    1/sqrt(Di). Returns (o, lse, kl):
    - o [T, Hq, D], lse fp32 [T, Hq]: exactly `sparse_attention`'s, differentiable in q, k, v.
    - kl: 0-dim fp32, `indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, ..., lse=lse.detach())`: the teacher
      comes from the attention (no gradient into q, k), the gradient flows into qi and ki only.

    !!! WHEN KL HOLDS ITS VALUE !!! If a gradient will flow into qi or ki (grad mode on and qi or ki requires
    grad), the forward computes only the attention and returns kl = 0: **its value is written by the backward**
    (the same kernel produces dq, dk, dv, dqi, dki and the loss). Read kl (e.g. for logging) after
    `backward()`, never before; the gradients into qi, ki are those of kl times its incoming gradient (so
    `loss = lm_loss + coef * kl` works as usual). If no gradient is needed (`torch.no_grad()`, or qi and ki do
    not require grad), kl is computed in the forward by `triton_kl.indexer_kl` and is valid at once.
    """
    _check_inputs(q, k, v, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)
    check_index_inputs(qi, ki, num_kv_heads=k.shape[1], num_queries=q.shape[0], num_keys=k.shape[0])
    if qi.device != q.device:
        raise ValueError(f"qi, ki must be on q's device {q.device}, got {qi.device}")
    if qi.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qi: the Triton kernels take float16, bfloat16 or float32, got {qi.dtype}")
    check_scale(index_scale, "index_scale")
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    index_scale = 1.0 / math.sqrt(qi.shape[-1]) if index_scale is None else float(index_scale)
    return _SparseAttentionKL.apply(q, k, v, qi, ki, block_idx.contiguous(), cu_seqlens, cu_seqlens_k, block_size,
                                    scale, index_scale)
