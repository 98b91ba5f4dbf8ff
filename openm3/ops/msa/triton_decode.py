"""Triton MSA decode kernels over the paged cache (layout in `decode.py`, which is their spec).

Decode runs a few new queries per sequence (`q_len`: 1 for plain decode, a few for speculative / MTP drafts) of a
batch of sequences of different lengths. A decode step (`decode_msa`):

1. `_score_segment_kernel`: program (sequence, segment of SEG blocks) scores the sequence's `Q*Hi` query rows
   (padded to 16 rows for `tl.dot`, so each index-key page is read once per sequence) against the cached index
   keys and takes each block's max. fp8 e4m3 keys are widened to fp16 (one native conversion per pair of bytes,
   exact) and multiplied by the 16-bit queries converted to fp16 (widening to bf16 instead costs a slow
   fp16 -> bf16 conversion per key); the per-token scale multiplies the [rows, 128] score tile before the block
   max. Each segment writes every block's score per row as an int64 sort key (score bits made monotonic in the
   high word, complemented block number in the low word, so one comparison orders (score, lower block first);
   local and invisible blocks get -inf), or with keep_all=False only its best `min(SEG, topk - local_blocks)`,
   sorted out in its epilogue by one max-reduction round per slot (~5 us of a 40 us kernel at 1M tokens, batch
   1: the epilogues of every program run at the same time, after the last loads). Segments are sized so that
   about two programs run per SM: batch-1 decode streams the index keys with the whole GPU.
2. `_topk_partial_kernel` (long rows only): groups of a row's candidates -> their best `topk - local_blocks`,
   so the final merge sorts a few hundred keys instead of thousands (1M tokens at batch 1: 8192 -> 240).
3. The merge -> the row's block list: local blocks first (own block, then the one before, ...), then the others
   by descending score, `-1` in unused trailing slots. Triton's bitonic top-k, inside every split of the attention
   kernel (the repeated merges cost less than a launch) or in `_topk_merge_kernel` (`decode_select_blocks`).
4. `_attention_split_kernel`: split-K attention. Program (query row, KV head, split) walks `SLOTS` entries of the
   block list, loads each selected page's K and V once for all query heads of the group and keeps an online
   softmax -> partial outputs and log-sum-exps. With no list it walks every block (dense layers).
5. `_combine_kernel`: merges the splits of each (query row, head) -> `o [B*Q, Hq, D]`, `lse [B*Q, Hq]`.

`decode_select_blocks` (1-3) and `decode_attention` (4-5) expose the two halves separately.

Where a 1M-token batch-1 fp8 step goes (H200, session 19, `python -m benchmarks.msa_floors --parts tail`: kernel
ends inside a CUDA graph): scoring 35.4 us (streaming the keys alone: ~33), shrink 39.1, attention 44.9, combine
46.0; session 20, with 32 shrink groups there (`_default_shrink_groups`): scoring 34.8, shrink 36.9, attention
43.4, combine 44.5. All 512 scoring programs run in one wave (90 registers, 38 KB of shared memory: 5 fit per SM),
so every
group of candidates is complete only at the end and the tail is a chain of dependent latencies; the folded
shrink (16 programs each reducing 4 x 512 keys after the last loads) ends the scoring kernel at 46.0 instead.

Measured defaults (H200, session 17, `benchmarks/results/msa_decode_final_20261202T1806.json`): `keep_all` (every
block's key out of the scoring kernel, no per-segment top-k rounds) with ~2 scoring programs per SM: fp8 1M batch 1
49.1 -> 46.8 us, 128K batch 32 204.2 -> 191.3 us. Session 2 (`benchmarks/results/msa_decode_20261130T1121.json`):
`pdl` on, and `score_loads='tma'` for fp8 index keys on sm_90+ ('table' otherwise): fp8 128K batch 1 15.2 -> 13.3
us, 1M batch 32 1198 -> 1097 us; with bf16 keys TMA measured no better. Other batch-1 knobs
(`benchmarks/msa_decode.py --variants b1` times them; fold_shrink and the 2-launch step measured slower at batch 1):
`score_loads` 'hoist' loads a segment's page ids before the block loop (with the page id loaded per block, the
pipeliner spends a stage on that indirection and keeps a single key tile buffer, so each program has one 16 KiB tile
in flight and none while it computes; hoisted, `stages` - 1 tiles stay in flight), 'tma' also fetches each block
with one TMA copy; `fold_shrink` runs step 2 inside the scoring kernel (the last program of each group of segments
to finish, counted with an atomic, reduces the group), one launch fewer; `pdl` launches the kernels as programmatic
dependents (`griddepcontrol`: each kernel starts while the previous one drains and waits for it before touching its
outputs). With fold_shrink and fuse_combine a step is 2 launches. fp8_math='split' scores fp8 keys on the fp8 tensor
cores (`_split_query`): each key tile goes from its TMA buffer into a wgmma with the keys as M, no conversion in
registers. Measured (session 3): scoring alone at 1M batch 1 39.3 vs 41.1 us (the per-tile conversion was not what
bounded it), at batch 32 1.15 vs 1.04 ms; opt-in. Shapes depend only on (B, Q, max_blocks), all lengths and page ids
are read on the device, and nothing syncs with the host, so a decode step can be captured in a CUDA graph. Set
`TRITON_INTERPRET=1` before importing this module to run it on CPU tensors (fp32/fp16 only there: bf16 is
refused, `triton_common.check_triton_inputs`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from .decode import FP8_DTYPE, SCALE_DTYPES, SCALE_E8M0
from .triton_common import arrival_counters, check_block_size, check_triton_inputs, interpreting

_NEG_INF = tl.constexpr(float("-inf"))  # globals read by kernels must be constexpr
# decode_msa's default attention split: 2 selected blocks from this many sequences up (sequences, not query rows, so
# a query's output does not depend on how many drafts ride beside it in a step)
SLOTS2_FROM_SEQUENCES = 8
_MIN_KEY = tl.constexpr(-9223372036854775807)  # below every sort key: an empty / taken candidate
_NEG_INF_KEY = -2139095041  # high word of `_sort_key` for a -inf score (fp32 bits 0xFF800000, made monotonic)
_PROGRAMS_PER_SM = 4  # selection programs in flight per SM that keep HBM busy (H200: 132 SMs)
_MAX_ROW_CANDIDATES = 4096  # scoring segments grow until a row leaves at most this many candidates
_KEEP_ALL_PROGRAMS_PER_SM = 2  # the same with every block's key kept (no candidate cap)


@triton.jit
def _sort_key(score, blk):
    """int64 key ordering (score, then lower block first) for a single max-reduction per top-k round: the fp32
    bits made monotonic in the high word, the complemented block number in the low word."""
    bits = score.to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (4294967295 - blk.to(tl.int64))


@triton.jit
def _token_scales(ks_ptr, first, BS: tl.constexpr):
    """fp32 scales [BS] of tokens first .. first + BS - 1, stored as fp32 or as uint8 e8m0 exponents (2^(e - 127),
    e in [1, 254]). The bytes load as int32 words (first is a multiple of BS, a power of two >= 16) unpacked in
    registers: a 1-byte load per thread is no load the pipeliner can issue asynchronously (cp.async copies 4, 8 or
    16 bytes), so it waited in every loop iteration (sm_90 compile: no async copy; session 21 on the H200: the
    128K batch-1 step 13.6 us against 12.6 with fp32 scales; with the words 12.5 against 12.7)."""
    if ks_ptr.dtype.element_ty == tl.uint8:
        words = tl.load((ks_ptr + first).to(tl.pointer_type(tl.int32)) + tl.arange(0, BS // 4))
        e = (words[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF  # little-endian: byte j of word i = token 4i+j
        s = (tl.reshape(e, [BS]) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.load(ks_ptr + first + tl.arange(0, BS))
    return s


@triton.jit
def _split_query(q):
    """16-bit queries [M, K] -> (hi, lo, inv): two fp8 e4m3 tensors and an fp32 [M] with
    (hi + lo) * inv == q (exactly for bf16 q), for fp8 tensor-core dots against fp8 keys.

    Row r is scaled by a power of two s so that |q * s| < 16; t = e4m3(q * s) keeps its top 4 significant bits,
    hi = 16 t (exact: |16 t| <= 256 < 448) and lo = e4m3(16 (q s - t)). A bf16 value has 8 significant bits and
    the rounding residual q s - t at most the 4 below t's, so lo holds it exactly unless it falls below e4m3's
    normal range (elements 2^-10 below the row's largest: an absolute error under 2^-14 of q s's scale).
    dot(k, hi) + dot(k, lo) = 16 s (q . k), hence inv = 1 / (16 s)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), axis=1)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2^(biased - 126)
    biased = tl.where(amax > 0, tl.maximum(biased, 4), 127)  # a zero (padding) row: any scale
    s = ((257 - biased) << 23).to(tl.float32, bitcast=True)  # 2^(130 - biased): |q s| < 16
    u = qf * s[:, None]
    t = u.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)
    hi = (t * 16.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    lo = ((u - t) * 16.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return hi, lo, 1.0 / (16.0 * s)


@triton.jit
def _score_segment_kernel(qi_ptr, ki_ptr, ks_ptr, table_ptr, lens_ptr, cand_ptr, fold_ptr, count_ptr, max_blocks,
                          n_seg, n_groups, stride_table, stride_page,
                          Q: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr,
                          BLOCK_M: tl.constexpr, SEG: tl.constexpr, KP: tl.constexpr, LOCAL: tl.constexpr,
                          FP8: tl.constexpr, HALF: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr,
                          HOIST: tl.constexpr, TMA: tl.constexpr, FOLD_SEGS: tl.constexpr, FOLD_P2: tl.constexpr,
                          FOLD_ROWS: tl.constexpr,
                          KEEP: tl.constexpr, KEEP_P2: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr):
    """Program (sequence b, segment): scores SEG consecutive blocks for the Q*HI query rows of b and writes the
    KP best non-local blocks of each row, best first, as sort keys to cand[(b*Q*HI + row), segment, :] (with
    KP == SEG every block's key, in block order, without the rounds that sort them).

    HOIST: the segment's page ids are loaded once before the loop, so the key loads depend on no load inside it
    and the pipeliner keeps STAGES-1 key tiles in flight (with the page id loaded per block it uses one of the
    stages for that indirection and keeps a single 16 KiB tile buffer, whatever STAGES is). TMA (implies the
    hoisted page ids): ki_ptr is a tensor descriptor over ki_pages viewed as [P*BS, DI] and each block is one
    [BS, DI] TMA copy. FOLD_SEGS > 0: the shrink step folded in: the last program of each group of FOLD_SEGS
    segments to finish (arrival counter count_ptr[b, group], reset by that program) writes the KEEP best keys
    of the group's candidates per row to fold_ptr[row, group, :]. PDL: programmatic dependent launch (waits for
    the previous kernel before touching memory, then lets the next kernel start launching). SPLIT (fp8 keys through
    TMA, sm_90+): fp8 tensor-core scoring, see `_split_query`; the keys are the dot's M dimension, so each key
    tile goes from the TMA buffer straight into the MMA without passing through registers."""
    b = tl.program_id(0)
    seg = tl.program_id(1)
    if PDL:  # the previous kernel may be writing qi / ki / the table: nothing is read before it completes
        gdc_wait()
        gdc_launch_dependents()
    seq_len = tl.load(lens_ptr + b)
    rows = tl.arange(0, BLOCK_M)  # row r = query i * HI + head h
    row_ok = rows < Q * HI
    dims = tl.arange(0, DI)
    cols = tl.arange(0, BS)
    seg_cols = tl.arange(0, SEG)
    qi = tl.load(qi_ptr + (b * Q * HI + rows)[:, None] * DI + dims[None, :], mask=row_ok[:, None], other=0.0)
    if HALF:  # fp8 keys: fp16 products are exact and e4m3 -> fp16 is one conversion per pair
        qi = qi.to(tl.float16)
    if SPLIT:
        q_hi, q_lo, q_inv = _split_query(qi)
        q_hi = tl.trans(q_hi)  # [DI, BLOCK_M]: the dot's B operand, loaded once
        q_lo = tl.trans(q_lo)
    q_pos = seq_len - Q + rows // HI  # absolute position of each row's query
    q_block = q_pos // BS
    scores = tl.full([BLOCK_M, SEG], _NEG_INF, tl.float32)
    if HOIST or TMA:  # not masked by seq_len, so this load does not wait for that one
        seg_blk = seg * SEG + seg_cols
        pages = tl.load(table_ptr + b * stride_table + seg_blk, mask=seg_blk < max_blocks, other=0)
    for jj in tl.range(0, SEG, num_stages=STAGES):
        blk = seg * SEG + jj
        valid = (blk < max_blocks) & (blk * BS < seq_len)
        # Only blocks wholly before each row's forced local blocks are ranked: the own block (the one block a
        # row sees in part) is always local (LOCAL >= 1), later ones are invisible, so no per-token mask is
        # needed and an invalid block's scores (read from page 0) are never used.
        ranked = (blk <= q_block - LOCAL) & valid
        if HOIST or TMA:
            page = tl.where(valid, tl.sum(tl.where(seg_cols == jj, pages, 0)), 0).to(tl.int64)
        else:
            page = tl.load(table_ptr + b * stride_table + blk, mask=valid, other=0).to(tl.int64)
        if SPLIT:  # [BS, BLOCK_M] scores, keys along M
            ki = ki_ptr.load([(page * BS).to(tl.int32), 0])
            s_t = tl.dot(ki, q_hi, tl.dot(ki, q_lo))  # 16 * 2^e * q . k (exact split, fp32 accumulation)
            s_t = s_t * _token_scales(ks_ptr, page * BS, BS)[:, None] * q_inv[None, :]
            best = tl.max(s_t, axis=0)  # [BLOCK_M] block max
        elif TMA:
            raw = ki_ptr.load([(page * BS).to(tl.int32), 0])
            if FP8:
                ki = raw.to(tl.float8e4nv, bitcast=True).to(qi.dtype)
            else:
                ki = raw.to(qi.dtype)
        else:
            k_off = page * stride_page + cols[:, None] * DI + dims[None, :]
            if FP8:
                ki = tl.load(ki_ptr + k_off, mask=valid, other=0).to(tl.float8e4nv, bitcast=True).to(qi.dtype)
            else:
                ki = tl.load(ki_ptr + k_off, mask=valid, other=0.0).to(qi.dtype)
        if not SPLIT:
            s = tl.dot(qi, tl.trans(ki), input_precision=PRECISION)  # [BLOCK_M, BS] fp32
            if FP8:  # the scale is per token, so it must multiply before the block max
                s = s * _token_scales(ks_ptr, page * BS, BS)[None, :]
            best = tl.max(s, axis=1)  # [BLOCK_M] block max
        scores = tl.where(seg_cols[None, :] == jj, tl.where(ranked, best, _NEG_INF)[:, None], scores)
    keys = _sort_key(scores, seg * SEG + seg_cols[None, :])
    out = cand_ptr + ((b * Q * HI + rows) * n_seg + seg) * KP
    if KP >= SEG:  # every block's key, in block order: the top-k after this does not need them sorted
        tl.store(out[:, None] + seg_cols[None, :], keys, mask=row_ok[:, None])
    else:  # the KP best, best first: one max-reduction round per slot
        for slot in tl.static_range(KP):
            top = tl.max(keys, axis=1)
            tl.store(out + slot, top, mask=row_ok)
            keys = tl.where(keys == top[:, None], _MIN_KEY, keys)
    if FOLD_SEGS > 0:
        grp = seg // FOLD_SEGS
        in_grp = tl.minimum(n_seg - grp * FOLD_SEGS, FOLD_SEGS)
        tl.debug_barrier()  # every thread's candidate stores come before the release below
        done = tl.atomic_add(count_ptr + b * n_groups + grp, 1, sem="acq_rel", scope="gpu")
        if done == in_grp - 1:  # the group's other programs have all written their candidates
            # every row of the group at once, one [FOLD_ROWS, FOLD_P2] tile sorted along its rows (a loop over
            # the rows serialised Q*HI load + sort chains: the 1M batch-1 scoring kernel ended at 48.0 us with
            # it, 46.0 without, against 35.4 with the shrink launch instead)
            offs = tl.arange(0, FOLD_P2)
            slots = tl.arange(0, KEEP_P2)
            f_rows = tl.arange(0, FOLD_ROWS)
            f_ok = f_rows < Q * HI
            row = (b * Q * HI + f_rows).to(tl.int64)
            group_keys = tl.load(cand_ptr + ((row * n_seg + grp * FOLD_SEGS) * KP)[:, None] + offs[None, :],
                                 mask=f_ok[:, None] & (offs < in_grp * KP)[None, :], other=_MIN_KEY,
                                 cache_modifier=".cg")  # written by other programs: bypass L1
            top = tl.topk(group_keys, KEEP_P2, dim=1)  # [FOLD_ROWS, KEEP_P2], best first
            tl.store(fold_ptr + ((row * n_groups + grp) * KEEP)[:, None] + slots[None, :], top,
                     mask=f_ok[:, None] & (slots < KEEP)[None, :])
            tl.atomic_xchg(count_ptr + b * n_groups + grp, 0, sem="relaxed", scope="gpu")


@triton.jit
def _top_keys(keys, KEEP: tl.constexpr, KEEP_P2: tl.constexpr, SORT: tl.constexpr):
    """The KEEP largest of the int64 keys [N] (N >= KEEP_P2 = next power of two >= KEEP), best first, in a
    [KEEP_P2] tensor: KEEP rounds of one max-reduction each (SORT=False) or Triton's bitonic top-k (SORT=True)."""
    if SORT:
        top = tl.topk(keys, KEEP_P2)
    else:
        idx = tl.arange(0, KEEP_P2)
        top = tl.full([KEEP_P2], _MIN_KEY, tl.int64)
        for slot in tl.static_range(KEEP):
            best = tl.max(keys, axis=0)
            top = tl.where(idx == slot, best, top)
            keys = tl.where(keys == best, _MIN_KEY, keys)
    return top


@triton.jit
def _merge_row(cand_ptr, row, n_cand, q_block, slots, LOCAL: tl.constexpr, TOPK: tl.constexpr,
               TOPK_P2: tl.constexpr, NC: tl.constexpr, NEG_KEY: tl.constexpr, SORT: tl.constexpr):
    """Block list of candidate row `row` -> int32 [TOPK_P2] (slots = arange(TOPK_P2)): slot l < LOCAL holds block
    q_block - l (the forced local blocks), slots LOCAL.. the best candidates by descending score, -1 where there
    are none (and past TOPK)."""
    offs = tl.arange(0, NC)
    keys = tl.load(cand_ptr + row.to(tl.int64) * n_cand + offs, mask=offs < n_cand, other=_MIN_KEY)
    top = _top_keys(keys, TOPK - LOCAL, TOPK_P2, SORT)  # [TOPK_P2], best first; slot s takes top[s - LOCAL]
    picked = tl.sum(tl.where(slots[:, None] - LOCAL == slots[None, :], top[None, :], 0), axis=1)
    ranked = tl.where((picked >> 32) > NEG_KEY, (4294967295 - (picked & 4294967295)).to(tl.int32), -1)
    local = tl.where(q_block - slots >= 0, q_block - slots, -1)
    return tl.where(slots < LOCAL, local, tl.where(slots < TOPK, ranked, -1))


@triton.jit
def _topk_partial_kernel(cand_ptr, out_ptr, n_cand, n_groups,
                         GROUP: tl.constexpr, KEEP: tl.constexpr, KEEP_P2: tl.constexpr, SORT: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (candidate row, group): the KEEP best keys of cand[row, group*GROUP:(group+1)*GROUP], best first
    -> out[row, group, :]. Shrinks long candidate rows (batch-1 decode of long contexts) before the final merge."""
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = grp * GROUP + tl.arange(0, GROUP)
    keys = tl.load(cand_ptr + row * n_cand + offs, mask=offs < n_cand, other=_MIN_KEY)
    top = _top_keys(keys, KEEP, KEEP_P2, SORT)
    slots = tl.arange(0, KEEP_P2)
    tl.store(out_ptr + (row * n_groups + grp) * KEEP + slots, top, mask=slots < KEEP)


@triton.jit
def _topk_merge_kernel(cand_ptr, lens_ptr, out_ptr, n_cand, total_rows,
                       Q: tl.constexpr, HI: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr,
                       TOPK_P2: tl.constexpr, LOCAL: tl.constexpr, NC: tl.constexpr, NEG_KEY: tl.constexpr,
                       SORT: tl.constexpr, PDL: tl.constexpr):
    """Candidate row (b, i, h) -> block_idx[h, b*Q + i, :] (see `_merge_row`)."""
    row = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = row // (Q * HI)
    i = (row // HI) % Q
    h = row % HI
    q_block = (tl.load(lens_ptr + b) - Q + i) // BS
    slots = tl.arange(0, TOPK_P2)
    blocks = _merge_row(cand_ptr, row, n_cand, q_block, slots, LOCAL, TOPK, TOPK_P2, NC, NEG_KEY, SORT)
    tl.store(out_ptr + (h * total_rows + b * Q + i) * TOPK + slots, blocks, mask=slots < TOPK)


@triton.jit
def _combine_group(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, heads, head_ok, n_splits,
                   D: tl.constexpr, BLOCK_S: tl.constexpr):
    """o[heads], lse[heads] from the n_splits partial results of each head (rows `heads` of [rows*HQ, ...]);
    loads bypass L1 (`.cg`): the partials were written by other programs."""
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    ok = head_ok[:, None] & (splits < n_splits)[None, :]
    lse = tl.load(lse_part_ptr + heads[:, None] * n_splits + splits[None, :], mask=ok, other=_NEG_INF,
                  cache_modifier=".cg")  # [BLOCK_G, BLOCK_S]
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == _NEG_INF, 0.0, m)
    w = tl.exp(lse - m_safe[:, None])
    w_sum = tl.sum(w, axis=1)
    part = tl.load(o_part_ptr + ((heads[:, None] * n_splits + splits[None, :]) * D)[:, :, None] + dims[None, None, :],
                   mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # [BLOCK_G, BLOCK_S, D]
    acc = tl.sum(w[:, :, None] * part, axis=1)
    safe = tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(o_ptr + heads[:, None] * D + dims[None, :], (acc / safe[:, None]).to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None])
    tl.store(lse_ptr + heads, tl.where(w_sum > 0, m + tl.log(safe), _NEG_INF), mask=head_ok)


@triton.jit
def _attention_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, cand_ptr, table_ptr, lens_ptr, o_part_ptr, lse_part_ptr,
                            o_ptr, lse_ptr, count_ptr,
                            sm_scale, total_rows, n_slots, n_splits, n_cand, stride_table, stride_page, stride_tok,
                            Q: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_G: tl.constexpr, SLOTS: tl.constexpr, MODE: tl.constexpr, LOCAL: tl.constexpr,
                            TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NC: tl.constexpr, NEG_KEY: tl.constexpr,
                            SORT: tl.constexpr, FUSE: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                            PDL: tl.constexpr):
    """Program (query row t = b*Q + i, KV head g, split). MODE 0: dense (every block); 1: blocks from
    idx_ptr = block_idx [HKV, total_rows, n_slots]; 2: merge the candidates of row t*HKV + g first and write the
    merged list to idx_ptr from split 0. FUSE: the last split of (t, g) to finish (counted in count_ptr, which it
    resets for the next launch) combines the partial results into o and lse, saving the combine launch.
    PDL (only as the second or later kernel of a decode step): lengths and queries, written before the step's
    first kernel, are loaded while the previous kernel finishes; everything else waits for it."""
    t = tl.program_id(0)
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
    if PDL:
        q = tl.load(q_ptr + (t * HQ + g * G + heads)[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0)
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 2:
        slots = tl.arange(0, TOPK_P2)
        blocks = _merge_row(cand_ptr, t * HKV + g, n_cand, q_pos // BS, slots, LOCAL, TOPK, TOPK_P2, NC, NEG_KEY,
                            SORT)
        tl.store(idx_ptr + (g * total_rows + t) * n_slots + slots, blocks, mask=(slots < n_slots) & (split == 0))
    if not PDL:
        q = tl.load(q_ptr + (t * HQ + g * G + heads)[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # softmax in base 2
    m = tl.full([BLOCK_G], _NEG_INF, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for jj in tl.range(0, SLOTS):
        slot = split * SLOTS + jj
        if MODE == 0:
            blk = slot
        elif MODE == 1:
            blk = tl.load(idx_ptr + (g * total_rows + t) * n_slots + slot, mask=slot < n_slots, other=-1)
        else:
            blk = tl.sum(tl.where(slots == slot, blocks, 0))
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
    if FUSE:
        tl.debug_barrier()  # every thread's partial stores come before the release below
        done = tl.atomic_add(count_ptr + t * HKV + g, 1, sem="acq_rel", scope="gpu")
        if done == n_splits - 1:
            _combine_group(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, (t * HQ + g * G + heads), head_ok, n_splits,
                           D, BLOCK_S)
            tl.atomic_xchg(count_ptr + t * HKV + g, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr,
                    N_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # row = query row * HQ + head
    if PDL:
        gdc_wait()
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


def _pow2(name: str, n: int) -> None:
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two >= 16 for the decode kernels, got {n}")


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _default_segment_blocks(max_blocks: int, batch: int, device: torch.device, keep: int = 15,
                            keep_all: bool = True) -> int:
    """Blocks per scoring program, 2..128 (a power of two).

    keep_all (each program writes every block's key; the default): about `_KEEP_ALL_PROGRAMS_PER_SM` programs per
    SM at this batch size (a row's candidates are its blocks whatever the segment). Measured on an H200 (session
    17, fp8 keys, us per step, one run): 1M batch 1 16-block segments 46.5, 32: 46.9, 64: 62.9; 128K batch 32 64:
    191.3, 32: 198.2. Otherwise (each program writes its `keep` best): ~`_PROGRAMS_PER_SM` programs per SM, grown until
    a row's candidates (segments x min(segment, keep)) stay within `_MAX_ROW_CANDIDATES`, as the shrink and merge
    after the scoring grow with them (1M tokens at batch 1: 8-block segments leave 8192 candidates per row,
    32-block ones 3840; 52.7 vs 50.45 us per fp8 step, session 3)."""
    per_sm = _KEEP_ALL_PROGRAMS_PER_SM if keep_all else _PROGRAMS_PER_SM
    per_program = max_blocks * batch // (per_sm * _sm_count(device))
    seg = max(2, min(128, 1 << max(0, per_program.bit_length() - 1)))
    while not keep_all and seg < 128 and triton.cdiv(max_blocks, seg) * min(seg, keep) > _MAX_ROW_CANDIDATES:
        seg *= 2
    return seg


SCORE_LOADS = ("table", "hoist", "tma")
FP8_MATH = ("fp16", "query", "split")


def _compiled_sm90(device: torch.device) -> bool:
    """Compiled kernels on a Hopper-or-newer GPU (not the interpreter)."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl_on(pdl: bool, device: torch.device) -> bool:
    """Programmatic dependent launch where it exists (CUDA, sm_90+); it only changes when kernels start, so
    elsewhere (the interpreter, older GPUs) the knob is a no-op."""
    return bool(pdl) and _compiled_sm90(device)


def _launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def _index_key_operand(ki_pages: torch.Tensor, fp8: bool, score_loads: str, split: bool = False):
    """ki as the scoring kernel reads it: the (byte view of the) pages, or for score_loads='tma' a tensor
    descriptor over them as [P*block_size, Di] with one [block_size, Di] box per block (over the fp8 pages
    themselves for the fp8 tensor-core path `split`)."""
    keys = ki_pages.view(torch.uint8) if fp8 and not split else ki_pages
    if score_loads != "tma":
        return keys
    if ki_pages.is_cuda and torch.cuda.get_device_capability(ki_pages.device)[0] < 9:
        raise ValueError("score_loads='tma' needs a GPU with TMA (sm_90+); use 'hoist' or 'table'")
    _, bs, di = keys.shape
    if (di * keys.element_size()) % 16 or keys.data_ptr() % 16:
        raise ValueError("score_loads='tma' needs 16-byte aligned index-key rows")
    return TensorDescriptor(keys.view(-1, di), shape=[keys.shape[0] * bs, di], strides=[di, 1], block_shape=[bs, di])


def _score_candidates(qi, ki_pages, block_table, seq_lens, *, q_len, block_size, topk, local_blocks, ki_scale,
                      segment_blocks, stages, num_warps, fp8_math, score_loads="table", fold_max=None,
                      pdl=False, keep_all=True) -> tuple[torch.Tensor, int]:
    """Validates the index inputs and runs `_score_segment_kernel` -> (cand int64 [B*q_len*Hi, n_cand] sort keys,
    n_cand). Each segment's KP = min(topk - local_blocks, segment) keys are its best, best first, or with
    keep_all (or KP equal to the segment) all its blocks' keys, unsorted. fold_max (an int): candidate rows longer
    than this are shrunk inside the scoring kernel (groups of segments as `_shrink_candidates` groups keys; the
    last program of each group reduces it), and the shrunk rows are returned."""
    batch = _check_table(block_table, seq_lens, q_len)
    _check_decode("qi", qi, 3, q_len, batch)
    hi, di = qi.shape[1], qi.shape[2]
    if ki_pages.dim() != 3 or ki_pages.shape[1:] != (block_size, di):
        raise ValueError(f"ki_pages must be [P, block_size={block_size}, Di={di}], got {tuple(ki_pages.shape)}")
    fp8 = ki_pages.dtype == FP8_DTYPE
    if fp8 != (ki_scale is not None):
        raise ValueError("ki_scale must be given exactly when ki_pages is fp8 (float8_e4m3fn)")
    if fp8 and (ki_scale.shape != ki_pages.shape[:2] or ki_scale.dtype not in SCALE_DTYPES):
        raise ValueError(f"ki_scale must be uint8 (e8m0 exponents) or fp32 [P, block_size] = "
                         f"{tuple(ki_pages.shape[:2])}, got {ki_scale.dtype} {tuple(ki_scale.shape)}")
    if not ki_pages.is_contiguous() or (fp8 and not ki_scale.is_contiguous()):
        raise ValueError("ki_pages (and ki_scale) must be contiguous")
    if fp8 and ki_scale.dtype == SCALE_E8M0 and ki_scale.data_ptr() % 4:  # (block_size is a power of two >= 16)
        raise ValueError("e8m0 (uint8) ki_scale must be 4-byte aligned: its bytes load as int32 words")
    if not 1 <= local_blocks <= topk:
        raise ValueError(f"local_blocks must be in [1, topk={topk}], got {local_blocks}")
    if fp8_math not in FP8_MATH:
        raise ValueError(f"fp8_math must be one of {FP8_MATH}, got {fp8_math!r}")
    if score_loads not in SCORE_LOADS:
        raise ValueError(f"score_loads must be one of {SCORE_LOADS}, got {score_loads!r}")
    split = fp8 and fp8_math == "split"
    if split and (score_loads != "tma" or qi.dtype not in (torch.bfloat16, torch.float16)
                  or not _compiled_sm90(qi.device)):
        raise ValueError("fp8_math='split' (fp8 tensor-core scoring) needs score_loads='tma', 16-bit queries and a "
                         f"compiled sm_90+ GPU; got score_loads={score_loads!r}, qi {qi.dtype} on {qi.device}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    check_block_size(block_size, "the Triton decode kernels", power_of_two=True)
    _pow2("Di", di)
    max_blocks = block_table.shape[1]
    rows = q_len * hi
    k = topk - local_blocks
    if segment_blocks is None:
        segment_blocks = _default_segment_blocks(max_blocks, batch, qi.device, max(k, 1), keep_all)
    if segment_blocks < 1 or segment_blocks & (segment_blocks - 1):
        raise ValueError(f"segment_blocks must be a power of two >= 1, got {segment_blocks}")
    seg = min(segment_blocks, triton.next_power_of_2(max_blocks))
    n_seg = triton.cdiv(max_blocks, seg)
    kp = seg if keep_all and k > 0 else min(k, seg)
    cand = torch.empty(batch * rows, n_seg * max(kp, 1), dtype=torch.int64, device=qi.device)
    n_cand = n_seg * kp
    fold_segs, n_groups, out = 0, 1, cand
    if k > 0 and fold_max is not None and n_cand > fold_max:
        fold_segs = max(1, _shrink_group(n_cand, k) // kp)
        n_groups = triton.cdiv(n_seg, fold_segs)
        out = torch.empty(batch * rows, n_groups * k, dtype=torch.int64, device=qi.device)
    if k > 0:
        half = fp8 and fp8_math == "fp16" and qi.dtype in (torch.bfloat16, torch.float16)
        pdl = _pdl_on(pdl, qi.device)
        _score_segment_kernel[(batch, n_seg)](
            qi, _index_key_operand(ki_pages, fp8, score_loads, split), ki_scale if fp8 else cand, block_table, seq_lens,
            cand, out, arrival_counters(batch * n_groups, qi.device, "fold") if fold_segs else cand, max_blocks,
            n_seg, n_groups, block_table.stride(0), ki_pages.stride(0),
            Q=q_len, HI=hi, DI=di, BS=block_size, BLOCK_M=max(16, triton.next_power_of_2(rows)), SEG=seg, KP=kp,
            LOCAL=local_blocks, FP8=fp8, HALF=half, PRECISION=_precision(qi.dtype), STAGES=stages,
            HOIST=score_loads == "hoist", TMA=score_loads == "tma", FOLD_SEGS=fold_segs,
            FOLD_P2=triton.next_power_of_2(fold_segs * kp) if fold_segs else 1,
            FOLD_ROWS=triton.next_power_of_2(rows) if fold_segs else 1, KEEP=k,
            KEEP_P2=triton.next_power_of_2(k), PDL=pdl, SPLIT=split, num_warps=num_warps, **_launch(pdl))
    return (out, n_groups * k) if fold_segs else (cand, n_cand)


def _shrink_group(n_cand: int, keep: int, groups: int = 16) -> int:
    """Keys per shrink group: about `groups` groups per candidate row, each at least twice the kept width."""
    return max(2 * triton.next_power_of_2(keep), triton.next_power_of_2(triton.cdiv(n_cand, groups)))


def _default_shrink_groups(rows: int, n_cand: int, device: torch.device) -> int:
    """Shrink groups per candidate row: 32 when each of 32 groups still holds >= 256 keys and the shrink's
    rows x 16 programs would be at most ~8 per SM, else 16. Measured on an H200 (fp8 keys, us per step, 32 groups
    against 16 in the same process): session 20, 1M batch 1 45.02 vs 46.05 and 45.25 vs 45.77 (kernel timeline: the
    shrink ends 1.6 us earlier, the attention's merge of 480 keys instead of 240 takes ~0.6 back), bf16 keys 73.06
    vs 73.48; session 21, 1M batch 4 / 8 / 16 145.96 / 283.41 / 545.38 vs 147.00 / 289.03 / 550.00, 4 queries per
    sequence at 1M batch 1 51.86 vs 52.54. With 32 groups 128K batch 1 read 13.48 vs 12.68 and 128K batch 32 193.7
    vs 189.6 (rows of 1,024 keys), 1M batch 32 (128 rows) 1048.9 vs 1045.3: those keep 16."""
    return 32 if rows * 16 <= 8 * _sm_count(device) and n_cand >= 32 * 256 else 16


def _shrink_candidates(cand: torch.Tensor, n_cand: int, keep: int, *, direct_max: int,
                       sort: bool, pdl: bool = False, groups: int | None = None) -> tuple[torch.Tensor, int]:
    """Candidate rows longer than `direct_max` keys are cut to the best `keep` of each group of keys (about
    `groups` groups per row, `_default_shrink_groups` when None; `_topk_partial_kernel`), so the final merge
    reduces a few hundred keys instead of thousands."""
    if keep == 0 or n_cand <= direct_max:
        return cand, n_cand
    if groups is None:
        groups = _default_shrink_groups(cand.shape[0], n_cand, cand.device)
    keep_p2 = triton.next_power_of_2(keep)
    group = _shrink_group(n_cand, keep, groups)
    n_groups = triton.cdiv(n_cand, group)
    out = torch.empty(cand.shape[0], n_groups * keep, dtype=torch.int64, device=cand.device)
    pdl = _pdl_on(pdl, cand.device)
    _topk_partial_kernel[(cand.shape[0], n_groups)](cand, out, n_cand, n_groups, GROUP=group, KEEP=keep,
                                                    KEEP_P2=keep_p2, SORT=sort, PDL=pdl, **_launch(pdl))
    return out, n_groups * keep


def _select_candidates(qi, ki_pages, block_table, seq_lens, *, q_len, block_size, topk, local_blocks, ki_scale,
                       segment_blocks, stages, num_warps, fp8_math, score_loads, merge_direct_max, merge_sort,
                       fold_shrink, pdl, keep_all=True, shrink_groups=None) -> tuple[torch.Tensor, int]:
    """Scores, then candidate rows longer than merge_direct_max shrunk (a partial top-k launch, or folded into
    the scoring kernel with fold_shrink) -> (cand, n_cand) for the final merge."""
    if shrink_groups is not None and shrink_groups < 1:
        raise ValueError(f"shrink_groups must be >= 1, got {shrink_groups}")
    cand, n_cand = _score_candidates(qi, ki_pages, block_table, seq_lens, q_len=q_len, block_size=block_size,
                                     topk=topk, local_blocks=local_blocks, ki_scale=ki_scale,
                                     segment_blocks=segment_blocks, stages=stages, num_warps=num_warps,
                                     fp8_math=fp8_math, score_loads=score_loads,
                                     fold_max=merge_direct_max if fold_shrink else None, pdl=pdl,
                                     keep_all=keep_all)
    return _shrink_candidates(cand, n_cand, topk - local_blocks, direct_max=merge_direct_max, sort=merge_sort,
                              pdl=pdl, groups=shrink_groups)


def _nc(n_cand: int, topk: int) -> int:
    """Power-of-two width of the merge's key tile: every candidate, and at least the top-k's own width."""
    return max(triton.next_power_of_2(max(n_cand, 1)), triton.next_power_of_2(topk))


def decode_select_blocks(qi: torch.Tensor, ki_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         *, q_len: int, block_size: int, topk: int, local_blocks: int = 1,
                         ki_scale: torch.Tensor | None = None, segment_blocks: int | None = None,
                         stages: int = 3, num_warps: int = 4, merge_warps: int = 4,
                         fp8_math: str = "fp16", merge_direct_max: int = 512, merge_sort: bool = True,
                         score_loads: str = "table", fold_shrink: bool = False, pdl: bool = False,
                         keep_all: bool = True, shrink_groups: int | None = None) -> torch.Tensor:
    """Top-k cached blocks for the `q_len` newest queries of each sequence.

    qi: [B*q_len, Hi, Di] (the queries of sequence b are rows b*q_len..; query i sits at position
    seq_lens[b] - q_len + i); ki_pages: [P, block_size, Di] (fp8 e4m3 with ki_scale [P, block_size] fp32);
    block_table int32 [B, max_blocks]; seq_lens int32 [B] (cached tokens, the new ones included; each must be
    >= q_len). Returns block_idx int32 [Hi, B*q_len, topk]: the local blocks first (own block, then the one
    before, ...), then the others by descending score, -1 in unused trailing slots. Matches
    `decode.paged_select_blocks` as sets on tie-free input. segment_blocks (blocks per scoring program, a power of
    two), stages, num_warps, merge_warps, merge_direct_max (longer candidate rows are shrunk by a partial top-k
    launch first), merge_sort (Triton's bitonic top-k instead of one max-reduction round per slot): tuning knobs.
    fp8_math: 'fp16' (16-bit queries and fp8 keys multiply in fp16, exact for keys, and for queries whose
    magnitudes lie in fp16's normal range), 'query' (keys widened to the query dtype) or 'split' (fp8 tensor-core
    dots on the query split into two fp8 terms, `_split_query`; needs score_loads='tma' on sm_90+: block scores
    within 4e-4 of the fp16 path's, relative to the row's score scale, measured on an H200; not the default: it
    was 4% faster alone at 1M batch 1 and 10% slower at batch 32).
    score_loads: how the scoring kernel reaches the key pages: 'table' (the page id loaded per block, the
    default as measured), 'hoist' (the segment's page ids loaded once before the loop, so `stages` - 1 key tiles
    stay in flight per program), 'tma' (hoisted, and each block one TMA copy through a tensor descriptor; sm_90+).
    fold_shrink: the shrink step runs inside the scoring kernel (the last program of each group of segments to
    finish reduces the group) instead of its own launch. pdl: programmatic dependent launch between the kernels
    (sm_90+; a no-op elsewhere). keep_all (the default): each scoring program writes every block's key instead
    of sorting out its best `topk - local_blocks` (one max-reduction round per slot in its epilogue, ~5 us of a
    40 us scoring kernel at 1M tokens, batch 1), leaving more candidates for the shrink. Measured on an H200
    (session 17, fp8 index keys, us per decode step, against keep_all=False): 1M batch 1 46.8 vs 49.1, 128K
    batch 32 191.3 vs 204.2, 1M batch 32 and 128K batch 1 equal. shrink_groups: how many groups of a long
    candidate row the shrink launch reduces separately, each to its best `topk - local_blocks` (None: 32 for up to
    ~64 long rows, as at 1M tokens batch 1-16, else 16, `_default_shrink_groups`; fold_shrink sizes its own
    groups).
    """
    check_triton_inputs(qi=qi, ki_pages=ki_pages)
    cand, n_cand = _select_candidates(qi, ki_pages, block_table, seq_lens, q_len=q_len, block_size=block_size,
                                      topk=topk, local_blocks=local_blocks, ki_scale=ki_scale,
                                      segment_blocks=segment_blocks, stages=stages, num_warps=num_warps,
                                      fp8_math=fp8_math, score_loads=score_loads, merge_direct_max=merge_direct_max,
                                      merge_sort=merge_sort, fold_shrink=fold_shrink, pdl=pdl, keep_all=keep_all,
                                      shrink_groups=shrink_groups)
    block_idx = torch.empty(qi.shape[1], qi.shape[0], topk, dtype=torch.int32, device=qi.device)
    _merge_into(block_idx, cand, n_cand, seq_lens, q_len=q_len, block_size=block_size, local_blocks=local_blocks,
                merge_sort=merge_sort, pdl=pdl, num_warps=merge_warps)
    return block_idx


def _merge_into(block_idx: torch.Tensor, cand: torch.Tensor, n_cand: int, seq_lens: torch.Tensor, *, q_len: int,
                block_size: int, local_blocks: int, merge_sort: bool, pdl: bool, num_warps: int = 4) -> None:
    """The top-k merge launch: each (row, index head)'s local blocks and best candidates -> block_idx
    [Hi, rows, topk]."""
    hi, rows, topk = block_idx.shape
    pdl = _pdl_on(pdl, block_idx.device)
    _topk_merge_kernel[(rows * hi,)](
        cand, seq_lens, block_idx, n_cand, rows, Q=q_len, HI=hi, BS=block_size, TOPK=topk,
        TOPK_P2=triton.next_power_of_2(topk), LOCAL=local_blocks, NC=_nc(n_cand, topk), NEG_KEY=_NEG_INF_KEY,
        SORT=merge_sort and topk > local_blocks, PDL=pdl, num_warps=num_warps, **_launch(pdl))


def _check_kv(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[int, int]:
    """-> (block_size, Hkv) of the KV pages, checked against q [rows, Hq, D]."""
    d = q.shape[2]
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[3] != d:
        raise ValueError(f"k_pages and v_pages must both be [P, block_size, Hkv, D={d}], "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("k_pages and v_pages must be contiguous")
    block_size, hkv = k_pages.shape[1], k_pages.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of the cache's KV heads ({hkv})")
    check_block_size(block_size, "the Triton decode kernels", power_of_two=True)
    _pow2("D", d)
    return block_size, hkv


def _split_attention(q, k_pages, v_pages, block_table, seq_lens, *, q_len, mode, n_slots, idx, cand, n_cand,
                     local_blocks, scale, slots_per_split, num_warps, merge_sort=False, fuse_combine=False,
                     pdl=False):
    """Launches `_attention_split_kernel` (mode 0 dense / 1 block_idx / 2 merge candidates) and the combine
    (fused into the split kernel when `fuse_combine` and there are at most 64 splits). pdl: both launched as
    programmatic dependents; only when a kernel of the same step ran before the split kernel (it reads q and
    the lengths before waiting for its predecessor)."""
    rows, hq, d = q.shape
    hkv = k_pages.shape[2]
    n_splits = triton.cdiv(n_slots, slots_per_split)
    fuse = fuse_combine and n_splits <= 64
    o_part = torch.empty(rows, hq, n_splits, d, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(rows, hq, n_splits, dtype=torch.float32, device=q.device)
    o = torch.empty_like(q)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    counts = arrival_counters(rows * hkv, q.device, "combine") if fuse else lse
    pdl = _pdl_on(pdl, q.device)
    _attention_split_kernel[(rows, hkv, n_splits)](
        q, k_pages, v_pages, idx, cand, block_table, seq_lens, o_part, lse_part, o, lse, counts,
        scale if scale is not None else 1.0 / math.sqrt(d), rows, n_slots, n_splits, n_cand,
        block_table.stride(0), k_pages.stride(0), k_pages.stride(1),
        Q=q_len, HQ=hq, HKV=hkv, D=d, BS=k_pages.shape[1], BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),
        SLOTS=slots_per_split, MODE=mode, LOCAL=local_blocks, TOPK=n_slots if mode == 2 else 1,
        TOPK_P2=triton.next_power_of_2(n_slots) if mode == 2 else 1, NC=_nc(n_cand, n_slots if mode == 2 else 1),
        NEG_KEY=_NEG_INF_KEY, SORT=merge_sort and mode == 2 and n_slots > local_blocks, FUSE=fuse,
        BLOCK_S=triton.next_power_of_2(n_splits) if fuse else 1, PRECISION=_precision(q.dtype), PDL=pdl,
        num_warps=num_warps, **_launch(pdl))
    if not fuse:
        _combine_kernel[(rows * hq,)](o_part, lse_part, o, lse, N_SPLITS=n_splits, D=d,
                                      BLOCK_S=min(64, triton.next_power_of_2(n_splits)), PDL=pdl, **_launch(pdl))
    return o, lse


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, block_idx: torch.Tensor | None, *, q_len: int, scale: float | None = None,
                     slots_per_split: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K attention of the `q_len` newest queries of each sequence over cached pages.

    q: [B*q_len, Hq, D]; k_pages, v_pages: [P, block_size, Hkv, D]; block_table int32 [B, max_blocks];
    seq_lens int32 [B]; block_idx int32 [Hkv, B*q_len, topk] (from `decode_select_blocks`), or None for dense
    attention over every cached block. Returns (o [B*q_len, Hq, D] in q.dtype, lse [B*q_len, Hq] fp32).
    Matches `decode.paged_sparse_attention` / `decode.paged_dense_attention`.
    """
    check_triton_inputs(q=q, k_pages=k_pages, v_pages=v_pages)
    batch = _check_table(block_table, seq_lens, q_len)
    _check_decode("q", q, 3, q_len, batch)
    _, hkv = _check_kv(q, k_pages, v_pages)
    rows = q.shape[0]
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
    return _split_attention(q, k_pages, v_pages, block_table, seq_lens, q_len=q_len, mode=0 if dense else 1,
                            n_slots=n_slots, idx=idx, cand=block_table, n_cand=0, local_blocks=1, scale=scale,
                            slots_per_split=slots_per_split, num_warps=num_warps)


def decode_msa(q: torch.Tensor, qi: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
               ki_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *, q_len: int, topk: int,
               local_blocks: int = 1, ki_scale: torch.Tensor | None = None, scale: float | None = None,
               segment_blocks: int | None = None, slots_per_split: int | None = None, stages: int = 3,
               num_warps: int = 4, attention_warps: int = 4, fp8_math: str = "fp16", merge_direct_max: int = 512,
               merge_sort: bool = True, fuse_merge: bool = True, fuse_combine: bool = False,
               score_loads: str | None = None, fold_shrink: bool = False,
               pdl: bool = True, keep_all: bool = True,
               shrink_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One MSA decode step: index scores, (top-k merge,) split-K attention, combine.

    q: [B*q_len, Hq, D]; qi: [B*q_len, Hi, Di] with Hi == Hkv; k_pages, v_pages: [P, block_size, Hkv, D];
    ki_pages: [P, block_size, Di] (fp8 e4m3 with ki_scale [P, block_size] fp32); block_table int32
    [B, max_blocks]; seq_lens int32 [B]. Returns (o [B*q_len, Hq, D] in q.dtype, lse [B*q_len, Hq] fp32,
    block_idx int32 [Hi, B*q_len, topk]), equal to `decode_select_blocks` followed by `decode_attention`.
    fuse_merge: every attention split merges its row's candidates itself, one launch fewer (the fastest setting
    measured on an H200 at batch 1 and 32; with False the merge kernel runs once per row instead).
    fuse_combine: the last split of each (row, KV head) combines the partial results (an atomic arrival counter)
    instead of the combine launch (measured slower on an H200; kept as a knob). score_loads (None: 'tma' for fp8
    index keys on an sm_90+ GPU, else 'table'; see the module docstring), fold_shrink, pdl:
    as in `decode_select_blocks`; with fold_shrink and fuse_combine a step is 2 launches (scores with the shrink
    folded in, attention merging the candidates and combining), and pdl lets each launch overlap the previous
    one's tail (the attention kernel loads its queries before waiting; on by default: 128K batch 1 fp8 13.8 vs
    15.2 us on an H200, neutral at 1M; a no-op off sm_90+). slots_per_split: selected blocks per attention split
    (None: 2 from `SLOTS2_FROM_SEQUENCES` sequences up, else 1; m3-small's shape at 8 x 16K-64K: 1.5-3.5 us faster
    per layer on an H100, M3's: 2-4 us slower at batch 1, within 1% at 32; by sequences, so a step with drafts
    gives each query what a one-query step gives it, bit for bit). Other knobs as in
    `decode_select_blocks` / `decode_attention` (num_warps: scoring; attention_warps: attention).
    """
    check_triton_inputs(q=q, qi=qi, k_pages=k_pages, v_pages=v_pages, ki_pages=ki_pages)
    batch = _check_table(block_table, seq_lens, q_len)
    _check_decode("q", q, 3, q_len, batch)
    block_size, hkv = _check_kv(q, k_pages, v_pages)
    if qi.dim() != 3 or qi.shape[1] != hkv:
        raise ValueError(f"qi must be [B*q_len, Hi=Hkv={hkv}, Di] (index head g selects for KV head g), "
                         f"got {tuple(qi.shape)}")
    if slots_per_split is None:  # 2 from 8 sequences up: half the splits, each merging its row's candidates
        slots_per_split = 2 if batch >= SLOTS2_FROM_SEQUENCES else 1
    if slots_per_split < 1:
        raise ValueError(f"slots_per_split must be >= 1, got {slots_per_split}")
    if score_loads is None:
        score_loads = "tma" if ki_scale is not None and _compiled_sm90(q.device) else "table"
    cand, n_cand = _select_candidates(qi, ki_pages, block_table, seq_lens, q_len=q_len, block_size=block_size,
                                      topk=topk, local_blocks=local_blocks, ki_scale=ki_scale,
                                      segment_blocks=segment_blocks, stages=stages, num_warps=num_warps,
                                      fp8_math=fp8_math, score_loads=score_loads, merge_direct_max=merge_direct_max,
                                      merge_sort=merge_sort, fold_shrink=fold_shrink, pdl=pdl, keep_all=keep_all,
                                      shrink_groups=shrink_groups)
    block_idx = torch.empty(hkv, q.shape[0], topk, dtype=torch.int32, device=q.device)
    if not fuse_merge:
        _merge_into(block_idx, cand, n_cand, seq_lens, q_len=q_len, block_size=block_size, local_blocks=local_blocks,
                    merge_sort=merge_sort, pdl=pdl)
    # the split kernel reads q before its PDL wait: only safe behind a kernel of this step (none when topk ==
    # local_blocks and the merge is fused: then nothing is scored)
    o, lse = _split_attention(q, k_pages, v_pages, block_table, seq_lens, q_len=q_len, mode=2 if fuse_merge else 1,
                              n_slots=topk, idx=block_idx, cand=cand, n_cand=n_cand, local_blocks=local_blocks,
                              scale=scale, slots_per_split=slots_per_split, num_warps=attention_warps,
                              merge_sort=merge_sort, fuse_combine=fuse_combine,
                              pdl=pdl and (topk > local_blocks or not fuse_merge))
    return o, lse, block_idx
