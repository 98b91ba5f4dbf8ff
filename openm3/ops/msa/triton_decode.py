"""Triton MSA decode kernels over the paged cache (layout in `decode.py`, which is their spec).

Decode runs a few new queries per sequence (`q_len`: 1 for plain decode, a few for speculative / MTP drafts) of a
batch of sequences of different lengths in one launch each:

1. `_score_segment_kernel`: program (sequence, segment of SEG blocks) scores the sequence's `Q*Hi` query rows
   (padded to 16 rows for `tl.dot`, so each index-key page is read once per sequence) against the cached index
   keys (bf16/fp16/fp32, or fp8 e4m3 with one scale per token), takes each block's max, and keeps the best
   `topk - local_blocks` non-local blocks of its segment per row as int64 sort keys (score bits made monotonic
   in the high word, complemented block number in the low word, so each top-k round is one max-reduction and
   ties go to the lower block). The segment size adapts so that about two programs run per SM.
2. `_topk_merge_kernel`: per (sequence, query, index head), the forced local blocks, then the best candidates of
   all segments -> `block_idx [Hi, B*Q, topk]`: local blocks first (own block, then the one before, ...), then the
   others by descending score, `-1` in unused trailing slots.
3. `_attention_split_kernel`: split-K attention. Program (query row, KV head, split) walks `SLOTS` entries of the
   query's block list, loads each selected page's K and V once for all query heads of the group, and keeps an
   online softmax -> partial outputs and log-sum-exps. With `block_idx=None` it walks every block (dense layers).
4. `_combine_kernel`: merges the splits of each (query row, head) -> `o [B*Q, Hq, D]`, `lse [B*Q, Hq]`.

Shapes depend only on (B, Q, max_blocks), all lengths and page ids are read on the device, and nothing syncs
with the host, so a decode step can be captured in a CUDA graph. Set `TRITON_INTERPRET=1` before importing this
module to run it on CPU tensors (fp32/fp16 only there).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode import FP8_DTYPE

_NEG_INF = tl.constexpr(float("-inf"))  # globals read by kernels must be constexpr
_NEG_INF_KEY = -2139095041  # high word of `_sort_key` for a -inf score (fp32 bits 0xFF800000, made monotonic)


@triton.jit
def _sort_key(score, blk):
    """int64 key ordering (score, then lower block first) for a single max-reduction per top-k round: the fp32
    bits made monotonic in the high word, the complemented block number in the low word."""
    bits = score.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (4294967295 - blk.to(tl.int64))


@triton.jit
def _score_segment_kernel(qi_ptr, ki_ptr, ks_ptr, table_ptr, lens_ptr, cand_ptr, max_blocks, n_seg,
                          stride_table, stride_page,
                          Q: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr,
                          BLOCK_M: tl.constexpr, SEG: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr,
                          FP8: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """Program (sequence b, segment): scores SEG consecutive blocks for the Q*HI query rows of b and writes the
    K best non-local blocks of each row as sort keys to cand[(b*Q*HI + row), segment, :]."""
    b = tl.program_id(0)
    seg = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    rows = tl.arange(0, BLOCK_M)  # row r = query i * HI + head h
    row_ok = rows < Q * HI
    dims = tl.arange(0, DI)
    cols = tl.arange(0, BS)
    seg_cols = tl.arange(0, SEG)
    qi = tl.load(qi_ptr + (b * Q * HI + rows)[:, None] * DI + dims[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = seq_len - Q + rows // HI  # absolute position of each row's query
    q_block = q_pos // BS
    scores = tl.full([BLOCK_M, SEG], _NEG_INF, tl.float32)
    for jj in tl.range(0, SEG, num_stages=STAGES):
        blk = seg * SEG + jj
        valid = (blk < max_blocks) & (blk * BS < seq_len)
        page = tl.load(table_ptr + b * stride_table + blk, mask=valid, other=0).to(tl.int64)
        k_off = page * stride_page + cols[:, None] * DI + dims[None, :]
        if FP8:
            ki = tl.load(ki_ptr + k_off, mask=valid, other=0).to(tl.float8e4nv, bitcast=True).to(qi.dtype)
        else:
            ki = tl.load(ki_ptr + k_off, mask=valid, other=0.0).to(qi.dtype)
        s = tl.dot(qi, tl.trans(ki), input_precision=PRECISION)  # [BLOCK_M, BS] fp32
        if FP8:
            s = s * tl.load(ks_ptr + page * BS + cols, mask=valid, other=0.0)[None, :]
        visible = ((blk * BS + cols)[None, :] <= q_pos[:, None]) & valid
        best = tl.max(tl.where(visible, s, _NEG_INF), axis=1)  # [BLOCK_M] block max
        local = (blk <= q_block) & (blk > q_block - LOCAL)  # forced by the merge, not ranked here
        scores = tl.where(seg_cols[None, :] == jj, tl.where(local, _NEG_INF, best)[:, None], scores)
    keys = _sort_key(scores, seg * SEG + seg_cols[None, :])
    out = cand_ptr + ((b * Q * HI + rows) * n_seg + seg) * K
    for slot in tl.static_range(K):
        top = tl.max(keys, axis=1)
        tl.store(out + slot, top, mask=row_ok)
        keys = tl.where(keys == top[:, None], -9223372036854775807, keys)


@triton.jit
def _topk_merge_kernel(cand_ptr, lens_ptr, out_ptr, n_cand, total_rows,
                       Q: tl.constexpr, HI: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr,
                       LOCAL: tl.constexpr, NC: tl.constexpr, NEG_KEY: tl.constexpr):
    """Local blocks first, then the best TOPK - LOCAL candidates of the row -> block_idx[h, b*Q + i, :]."""
    row = tl.program_id(0)
    b = row // (Q * HI)
    i = (row // HI) % Q
    h = row % HI
    q_block = (tl.load(lens_ptr + b) - Q + i) // BS
    out = out_ptr + h * total_rows * TOPK + (b * Q + i) * TOPK
    for l in tl.static_range(LOCAL):
        tl.store(out + l, tl.where(q_block - l >= 0, q_block - l, -1).to(tl.int32))
    offs = tl.arange(0, NC)
    keys = tl.load(cand_ptr + row * n_cand + offs, mask=offs < n_cand, other=-9223372036854775807)
    for slot in tl.static_range(LOCAL, TOPK):
        best = tl.max(keys, axis=0)
        blk = (4294967295 - (best & 4294967295)).to(tl.int32)
        tl.store(out + slot, tl.where((best >> 32) > NEG_KEY, blk, -1))
        keys = tl.where(keys == best, -9223372036854775807, keys)


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, table_ptr, lens_ptr, o_part_ptr, lse_part_ptr,
                            sm_scale, total_rows, n_slots, n_splits, stride_table, stride_page, stride_tok,
                            Q: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_G: tl.constexpr, SLOTS: tl.constexpr, DENSE: tl.constexpr,
                            PRECISION: tl.constexpr):
    t = tl.program_id(0)  # query row = b * Q + i
    g = tl.program_id(1)
    split = tl.program_id(2)
    b = t // Q
    i = t % Q
    G: tl.constexpr = HQ // HKV
    seq_len = tl.load(lens_ptr + b)
    q_pos = seq_len - Q + i
    heads = tl.arange(0, BLOCK_G)
    head_ok = heads < G
    dims = tl.arange(0, D)
    cols = tl.arange(0, BS)
    q = tl.load(q_ptr + (t * HQ + g * G + heads)[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m = tl.full([BLOCK_G], _NEG_INF, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for jj in tl.range(0, SLOTS):
        slot = split * SLOTS + jj
        if DENSE:
            blk = slot
        else:
            blk = tl.load(idx_ptr + (g * total_rows + t) * n_slots + slot, mask=slot < n_slots, other=-1)
        if (slot < n_slots) & (blk >= 0) & (blk * BS <= q_pos):
            page = tl.load(table_ptr + b * stride_table + blk).to(tl.int64)
            kv_off = page * stride_page + cols[:, None] * stride_tok + g * D + dims[None, :]
            k = tl.load(k_ptr + kv_off).to(q.dtype)
            v = tl.load(v_ptr + kv_off).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BS]
            s = tl.where((blk * BS + cols)[None, :] <= q_pos, s, _NEG_INF)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
    safe_l = tl.where(l > 0, l, 1.0)
    lse = tl.where(l > 0, (m + tl.log2(safe_l)) * 0.6931471805599453, _NEG_INF)  # natural log
    part = (t * HQ + g * G + heads) * n_splits + split
    tl.store(lse_part_ptr + part, lse, mask=head_ok)
    tl.store(o_part_ptr + part[:, None] * D + dims[None, :], acc / safe_l[:, None], mask=head_ok[:, None])


@triton.jit
def _combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr,
                    N_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)  # row = query row * HQ + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    m = tl.full([], _NEG_INF, tl.float32)
    w_sum = tl.zeros([], tl.float32)
    for start in tl.static_range(0, N_SPLITS, BLOCK_S):
        idx = start + splits
        ok = idx < N_SPLITS
        lse = tl.load(lse_part_ptr + row * N_SPLITS + idx, mask=ok, other=_NEG_INF)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        part = tl.load(o_part_ptr + (row * N_SPLITS + idx)[:, None] * D + dims[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        w_sum = w_sum * alpha + tl.sum(w, axis=0)
        m = m_new
    safe = tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(o_ptr + row * D + dims, (acc / safe).to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, tl.where(w_sum > 0, m + tl.log(safe), _NEG_INF))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_decode(name: str, x: torch.Tensor, rank: int, q_len: int, batch: int) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if x.shape[0] != batch * q_len:
        raise ValueError(f"{name} must hold q_len={q_len} rows per sequence ({batch * q_len} rows), got {x.shape[0]}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_table(block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> int:
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or not block_table.is_contiguous():
        raise ValueError(f"block_table must be a contiguous int32 [B, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.shape != (block_table.shape[0],) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={block_table.shape[0]}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if q_len < 1:
        raise ValueError(f"q_len must be >= 1, got {q_len}")
    return block_table.shape[0]


def decode_select_blocks(qi: torch.Tensor, ki_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         *, q_len: int, block_size: int, topk: int, local_blocks: int = 1,
                         ki_scale: torch.Tensor | None = None, segment_blocks: int | None = None,
                         stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    """Top-k cached blocks for the `q_len` newest queries of each sequence.

    qi: [B*q_len, Hi, Di] (the queries of sequence b are rows b*q_len..; query i sits at position
    seq_lens[b] - q_len + i); ki_pages: [P, block_size, Di] (fp8 e4m3 with ki_scale [P, block_size] fp32);
    block_table int32 [B, max_blocks]; seq_lens int32 [B] (cached tokens, the new ones included; each must be
    >= q_len). Returns block_idx int32 [Hi, B*q_len, topk]. Matches `decode.paged_select_blocks` on tie-free input.
    """
    batch = _check_table(block_table, seq_lens, q_len)
    _check_decode("qi", qi, 3, q_len, batch)
    hi, di = qi.shape[1], qi.shape[2]
    if ki_pages.dim() != 3 or ki_pages.shape[1:] != (block_size, di):
        raise ValueError(f"ki_pages must be [P, block_size={block_size}, Di={di}], got {tuple(ki_pages.shape)}")
    fp8 = ki_pages.dtype == FP8_DTYPE
    if fp8 != (ki_scale is not None):
        raise ValueError("ki_scale must be given exactly when ki_pages is fp8 (float8_e4m3fn)")
    if fp8 and (ki_scale.shape != ki_pages.shape[:2] or ki_scale.dtype != torch.float32):
        raise ValueError(f"ki_scale must be fp32 [P, block_size] = {tuple(ki_pages.shape[:2])}, "
                         f"got {ki_scale.dtype} {tuple(ki_scale.shape)}")
    if not ki_pages.is_contiguous() or (fp8 and not ki_scale.is_contiguous()):
        raise ValueError("ki_pages (and ki_scale) must be contiguous")
    if not 1 <= local_blocks <= topk:
        raise ValueError(f"local_blocks must be in [1, topk={topk}], got {local_blocks}")
    for name, n in (("block_size", block_size), ("Di", di)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the decode kernels, got {n}")
    max_blocks = block_table.shape[1]
    rows = q_len * hi
    k = topk - local_blocks
    if segment_blocks is None:  # about two programs per SM at this batch size, 16..128 blocks each
        segment_blocks = max(16, min(128, triton.next_power_of_2(max(1, max_blocks * batch // 264))))
    seg = min(segment_blocks, triton.next_power_of_2(max_blocks))
    n_seg = triton.cdiv(max_blocks, seg)
    cand = torch.empty(batch * rows, n_seg, max(k, 1), dtype=torch.int64, device=qi.device)
    if k > 0:
        _score_segment_kernel[(batch, n_seg)](
            qi, ki_pages.view(torch.uint8) if fp8 else ki_pages, ki_scale if fp8 else cand, block_table, seq_lens,
            cand, max_blocks, n_seg, block_table.stride(0), ki_pages.stride(0),
            Q=q_len, HI=hi, DI=di, BS=block_size, BLOCK_M=max(16, triton.next_power_of_2(rows)), SEG=seg, K=k,
            LOCAL=local_blocks, FP8=fp8, PRECISION=_precision(qi.dtype), STAGES=stages, num_warps=num_warps)
    block_idx = torch.empty(hi, batch * q_len, topk, dtype=torch.int32, device=qi.device)
    _topk_merge_kernel[(batch * rows,)](
        cand, seq_lens, block_idx, n_seg * k, batch * q_len, Q=q_len, HI=hi, BS=block_size, TOPK=topk,
        LOCAL=local_blocks, NC=triton.next_power_of_2(max(n_seg * k, 1)), NEG_KEY=_NEG_INF_KEY)
    return block_idx


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, block_idx: torch.Tensor | None, *, q_len: int, scale: float | None = None,
                     slots_per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K attention of the `q_len` newest queries of each sequence over cached pages.

    q: [B*q_len, Hq, D]; k_pages, v_pages: [P, block_size, Hkv, D]; block_table int32 [B, max_blocks];
    seq_lens int32 [B]; block_idx int32 [Hkv, B*q_len, topk] (from `decode_select_blocks`), or None for dense
    attention over every cached block. Returns (o [B*q_len, Hq, D] in q.dtype, lse [B*q_len, Hq] fp32).
    Matches `decode.paged_sparse_attention` / `decode.paged_dense_attention`.
    """
    batch = _check_table(block_table, seq_lens, q_len)
    _check_decode("q", q, 3, q_len, batch)
    rows, hq, d = q.shape
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[3] != d:
        raise ValueError(f"k_pages and v_pages must both be [P, block_size, Hkv, D={d}], "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("k_pages and v_pages must be contiguous")
    block_size, hkv = k_pages.shape[1], k_pages.shape[2]
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of the cache's KV heads ({hkv})")
    for name, n in (("block_size", block_size), ("D", d)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the decode kernels, got {n}")
    dense = block_idx is None
    if dense:
        n_slots = block_table.shape[1]
        idx = block_table  # unused by the kernel
    else:
        if block_idx.dtype != torch.int32 or block_idx.dim() != 3 or block_idx.shape[:2] != (hkv, rows):
            raise ValueError(f"block_idx must be int32 [Hkv={hkv}, B*q_len={rows}, topk], "
                             f"got {block_idx.dtype} {tuple(block_idx.shape)}")
        n_slots = block_idx.shape[2]
        idx = block_idx.contiguous()
    if slots_per_split is None:
        slots_per_split = 1 if not dense else max(1, min(16, n_slots // 128))
    n_splits = triton.cdiv(n_slots, slots_per_split)
    o_part = torch.empty(rows, hq, n_splits, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(rows, hq, n_splits, dtype=torch.float32, device=q.device)
    _attention_split_kernel[(rows, hkv, n_splits)](
        q, k_pages, v_pages, idx, block_table, seq_lens, o_part, lse_part,
        scale if scale is not None else 1.0 / math.sqrt(d), rows, n_slots, n_splits,
        block_table.stride(0), k_pages.stride(0), k_pages.stride(1),
        Q=q_len, HQ=hq, HKV=hkv, D=d, BS=block_size, BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
        SLOTS=slots_per_split, DENSE=dense, PRECISION=_precision(q.dtype))
    o = torch.empty_like(q)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    _combine_kernel[(rows * hq,)](o_part, lse_part, o, lse, N_SPLITS=n_splits, D=d,
                                  BLOCK_S=min(64, triton.next_power_of_2(n_splits)))
    return o, lse
