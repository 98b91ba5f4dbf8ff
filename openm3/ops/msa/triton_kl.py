"""MSA indexer KL in Triton: sparse (over `block_idx`) and dense warm-up, forward and backward into qi, ki.

Public entry: `indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, *, block_size, scale=None, index_scale=None,
lse=None, cu_seqlens_k=None) -> loss`, the same contract as `reference.indexer_kl`.

For index head (group) g and query t, over its key set J (keys of the selected blocks that are causal; all causal
keys when `block_idx` is None): teacher p_j = mean over the G heads h of g of exp(q[t,h].k[j,g] * scale - lse[t,h]),
student z_j = qi[t,g].ki[j] * index_scale, lse_z = logsumexp_J z and

    loss = 1 / (Hi T) sum_{g,t} sum_J p_j (log p_j - z_j + lse_z),     dL/dz_j = (r_j - p_j) / (Hi T),

with r = exp(z - lse_z) (p sums to 1 over J, as in the reference).

Schedule: everything is key-block-outer, driven by an inverse index of `block_idx` (`_entry_work`): every
(g, t, slot) with a valid block is an *entry*; entries are sorted by (g, global key block) with one torch sort,
and each bucket is cut into work items of at most `max_entries` entries (hot blocks such as the first block of a
sequence are selected by nearly every query, so they are split for load balance). A program owns one work item
and one key sub-tile of `block_n` keys of that block: it loads the block's k (group g) and ki rows once and
streams its entries in steps of `block_q` queries, gathering only their q rows (G*D values per entry, 8x less
traffic than gathering 16 blocks of k per query for M3). Two passes:

1. stats: per (entry, sub-tile) the partial log-sum-exp of z (and, only when `lse` is not given, of every
   teacher head), written to `[Hi, T, topk * n_sub]` buffers; torch's logsumexp over the last axis combines them.
2. main: recomputes z and the teacher p (the one pass over the teacher's q.k: it costs as much as half a sparse
   attention forward), writes each entry's loss term, and, when a gradient is needed, the gradients too: the
   loss is a scalar, so dL/dqi and dL/dki are computed here once and only scaled by the incoming gradient in
   backward. dki accumulates in registers over the item's entries and is added once per item (an fp32 atomic
   add of one [block_n, Di] tile; only split buckets collide). dqi gets one [block_q, Di] atomic add per
   (entry, sub-tile): Hi*T*topk*Di adds in all, spread over distinct addresses (or, with `dqi_buffer=1`, one
   plain-stored partial row per (entry, sub-tile) that torch sums over the slots).

The dense warm-up variant builds the all-causal-blocks `block_idx` and runs the same passes (short sequences:
its index has T * T / block_size entries).

Launch parameters come from `kl_launch` (one place; `OPENM3_KL_LAUNCH="block_n=64,block_q=16,..."` overrides).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fused import fused_on_cuda
from ._checks import check_indexer_kl_inputs
from .triton_attention import _LOG2E, _key_operands, _load_tile_rows, _tile_scores, _tile_walk
from .triton_common import (attention_launch, block_rows, check_triton_inputs, interpreting, largest_pow2_divisor,
                            next_pow2, query_positions, query_tiling, token_runs, with_overrides)

__all__ = ["indexer_kl", "kl_launch", "KLLaunch"]


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True)
class KLLaunch:
    """Launch parameters of the KL kernels.

    block_n: keys per program (a block is split into ceil(block_size / block_n) sub-tiles), power of two >= 16.
    block_q: entries (queries) per step, power of two >= 16 (it is the K dim of the dki dot).
    heads_per_dot: teacher heads per q.k^T dot (rows = block_q * heads_per_dot); power of two dividing G.
    max_entries: entries per work item before a hot key block is split over several programs.
    dqi_buffer: 1 writes dL/dqi as one partial row per (entry, key sub-tile) into a `[Hi, T, topk * n_sub, Di]`
        buffer in qi's dtype that torch sums (plain stores; falls back to atomics when the buffer would exceed
        `DQI_BUFFER_MAX_BYTES`), 0 adds into dL/dqi with fp32 atomics (no buffer).
    prefetch: steps ahead (0 = off) at which the main pass asks L2 for the q rows of coming entries
        (`prefetch.global.L2`; compiled GPUs only, the interpreter has no inline assembly). Triton's pipeliner
        issues a step's q gather only at the end of the previous step, so without it every step waits on HBM.
    compact_items: 1 drops the empty work items before the launch (one host sync per call: the item count is read
        back), 0 launches every item the shapes allow (at most one empty item per (head, key block): their
        programs load one key tile and exit) and never syncs. GPU default 0 (session 5, one H200 call each): at
        m3-small's shape (G = 4, 2 x 8K tokens) the KL took 4.34 ms against 4.66 ms compacted, at M3's (G = 16,
        128K) 71.0 against 71.8 ms, and the m3-small 8K training step went from 83% to 95% GPU-busy (58.7K ->
        65.5K tokens/s; the compaction's read-back stalled the launch queue). The CPU interpreter pays per
        program, so it compacts.
    unroll_heads: 1 unrolls the main pass's loop over teacher head groups (the compiler may hoist every head's q
        gather), 0 keeps it a loop: at G = 4 on sm_90, 215 registers instead of 255 with 24 bytes of spills
        (compile-level, session 5). GPU default 0 (session 6, median of 3 interleaved rounds on an H200: M3's
        G = 16 at 128K 67.3 vs 70.8 ms; at G = 4 only with the register cap below).
    maxnreg: 0 lets the compiler pick the main pass's registers per thread; n > 0 caps them (spilling the rest),
        e.g. 128 so two 8-warp CTAs fit an SM (one CTA at 255 registers: 12.5% occupancy, latency-bound; ncu,
        session 5). Compiled GPUs only. GPU default 128 for groups below 16 (session 6: m3-small's G = 4 at
        2 x 8K tokens 3.90 ms with the loop kept and the cap, 4.92 without either, 4.82 loop only, 5.49 cap only;
        the 8K training step 75.3K -> 77.4K tokens/s); at G = 16 the cap spills 760 bytes (97 vs 71 ms).
    stats_block_q, stats_num_warps, stats_num_stages: entries per step, warps and software-pipeline stages of the
        first pass (partial log-sum-exps), 0 = the main pass's block_q / num_warps / num_stages. With the
        attention's lse given it only computes student logits (one [stats_block_q, Di] x [Di, block_n] dot per
        step after gathering the entries' qi rows), so it may want taller or pipelined steps.
    teacher_pass: 1 computes the teacher probabilities before the main pass, query-outer with the attention
        forward's tiling (`_teacher_kernel`: K loaded once per tile of queries, all G heads of a token in one
        dot), into a `[Hi, T, topk, block_size]` buffer (fp16; fp32 for fp32 inputs) that the main pass reads per
        entry instead of gathering G q rows per entry and recomputing the scores; 0 recomputes them in the main
        pass. Sparse KL with a power-of-two group only (else, or when the buffer would exceed
        `TEACHER_MAX_BYTES`, the main pass recomputes). GPU default 1 (session 8, H200): M3's G = 16 at 128K, KL
        fwd+bwd 66.9 -> 53.8 ms (2 rounds); the m3-small 8K training step's KL 140.3 -> 109.7 ms (main pass 121.1
        -> 57.2, teacher pass 33.2), kernel time 808-814 -> 792 ms, 80.2-80.8K -> 81.1K tokens/s; but the isolated
        G = 4 case at 2 x 8K drifting selections measured 4.15 -> 4.93 ms (rounds 4.0-4.7 vs 4.7-5.8). The
        interpreter keeps 0 (the CPU tests run both). Training no longer runs this pass by default: since session 15
        the attention's dk/dv kernel stores the same teacher in the backward (`sparse_attention_with_kl`).
    key_major: 1 runs the main pass's steps key-major when the teacher pass ran (`_student_step_key_major`: every
        dot with the key tile's 128 rows as M, wgmma on sm_90, where the entry-major step's two 16-row dots compile
        to mma.sync; dL/dqi by atomics, never the dqi_buffer). Session 5's key-major main pass (which recomputed
        the teacher, one head per dot) measured 5-17% slower and was removed; this one only does the student's
        three dots. Opt-in: slower at m3-small's G = 4 with its default register cap of 128 (211 registers
        uncapped; 8 x 8K tokens iid, 2 rounds: 11.80 -> 12.54 ms, session 9); without the cap and at M3's G = 16
        untimed (`gpu_all.sh kmsweep`).
    """

    block_n: int
    block_q: int
    heads_per_dot: int
    max_entries: int
    num_warps: int
    num_stages: int
    dqi_buffer: int = 0
    prefetch: int = 0
    compact_items: int = 1
    unroll_heads: int = 1
    maxnreg: int = 0
    stats_block_q: int = 0
    stats_num_warps: int = 0
    stats_num_stages: int = 0
    teacher_pass: int = 0
    key_major: int = 0


_ENV_OVERRIDE = "OPENM3_KL_LAUNCH"
# Largest dL/dqi partial buffer (dqi_buffer=1): 4.3 GB at 128K tokens for M3 (bf16, 2 sub-tiles per block).
DQI_BUFFER_MAX_BYTES = 8 << 30
# Largest teacher buffer (teacher_pass=1): 2.1 GB at 128K tokens for M3 (fp16), 1.1 GB for m3-small's 8K step.
TEACHER_MAX_BYTES = 8 << 30


def kl_launch(group: int, head_dim: int, block_size: int, on_gpu: bool, **overrides) -> KLLaunch:
    """Launch parameters for `group` teacher heads per index head, head dim `head_dim`, blocks of `block_size`.

    `overrides` (or `OPENM3_KL_LAUNCH="key=value,..."`) replace single fields.
    """
    # GPU: whole 128-key blocks per program (each entry's q rows are gathered once, not once per sub-tile), 8
    # teacher heads per dot, no pipelining: 70.3 ms at 128K for M3 on an H200 against 79.1 ms for 64-key
    # sub-tiles, 16 heads per dot and 2 stages (docs/perf_notes.md, session 2). Smaller groups (m3-small: G = 4,
    # rows of 8K) run one head per dot: 5.7-5.9 ms against 7.5-8.3 ms with 4 per dot at 16K tokens (G = 16
    # measured the other way: 79.9 ms with 1 per dot, 71.9 ms with 8; session 3, `benchmarks/msa_group_sweep.py`).
    block_n = max(16, min(next_pow2(block_size), 128 if on_gpu else 32))
    heads_per_dot = largest_pow2_divisor(group, 8) if group >= 16 else 1
    # The interpreter's cost is per operation, not per element: big steps on CPU.
    cfg = dict(block_n=block_n, block_q=16 if on_gpu else 64,
               heads_per_dot=heads_per_dot if on_gpu else largest_pow2_divisor(group, 16),
               max_entries=256, num_warps=8 if on_gpu and head_dim >= 128 else 4,
               num_stages=1, compact_items=0 if on_gpu else 1, unroll_heads=0 if on_gpu else 1,
               maxnreg=128 if on_gpu and group < 16 else 0, teacher_pass=1 if on_gpu else 0)
    cfg = with_overrides(cfg, _ENV_OVERRIDE, overrides)
    launch = KLLaunch(**cfg)
    for name in ("block_n", "block_q", "stats_block_q"):
        value = getattr(launch, name)
        if (value < 16 or value & (value - 1)) and not (name == "stats_block_q" and value == 0):
            raise ValueError(f"kl launch: {name}={value} must be a power of two >= 16"
                             + (" (or 0: block_q's)" if name == "stats_block_q" else ""))
    if launch.stats_num_stages < 0:
        raise ValueError(f"kl launch: stats_num_stages={launch.stats_num_stages} must be >= 0")
    if launch.stats_num_warps not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"kl launch: stats_num_warps={launch.stats_num_warps} must be 0 (num_warps') or a power "
                         f"of two <= 16")
    hg = launch.heads_per_dot
    if hg < 1 or hg & (hg - 1) or group % hg:
        raise ValueError(f"kl launch: heads_per_dot={hg} must be a power of two dividing the group size {group}")
    if launch.max_entries < 1:
        raise ValueError(f"kl launch: max_entries={launch.max_entries} must be >= 1")
    for name in ("dqi_buffer", "compact_items", "teacher_pass", "unroll_heads", "key_major"):
        if getattr(launch, name) not in (0, 1):
            raise ValueError(f"kl launch: {name}={getattr(launch, name)} must be 0 or 1")
    if launch.prefetch < 0:
        raise ValueError(f"kl launch: prefetch={launch.prefetch} must be >= 0")
    if launch.maxnreg < 0 or launch.maxnreg > 255:
        raise ValueError(f"kl launch: maxnreg={launch.maxnreg} must be 0 (compiler's choice) or a register count "
                         f"in [1, 255]")
    return launch


# ---------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _entry_rows(QI, ENTRIES, start, hi, g, di, di_ok, T, stride_qit, stride_qih, TOPK: tl.constexpr,
                BLOCK_Q: tl.constexpr):
    """The entries [start, min(start + BLOCK_Q, hi)): entry numbers e, their mask e_ok, their tokens t and their
    qi rows [BLOCK_Q, BLOCK_DI] of index head g."""
    idx = start + tl.arange(0, BLOCK_Q)
    e_ok = idx < hi
    e = tl.load(ENTRIES + idx, mask=e_ok, other=0)
    t = (e // TOPK) % T
    qi = tl.load(QI + t[:, None].to(tl.int64) * stride_qit + g * stride_qih + di[None, :],
                 mask=e_ok[:, None] & di_ok[None, :], other=0.0)
    return e, e_ok, t, qi


@triton.jit
def _student_step(QI, ENTRIES, QPOS, ki, start, hi, g, kpos, k_ok, di, di_ok, T, stride_qit, stride_qih,
                  index_scale, TOPK: tl.constexpr, BLOCK_Q: tl.constexpr, INDEX_PRECISION: tl.constexpr):
    """One step over the entries [start, min(start + BLOCK_Q, hi)): the entries e and their mask e_ok, their
    tokens t and qi rows [BLOCK_Q, BLOCK_DI], the student logits z [BLOCK_Q, BLOCK_N] against the key sub-tile's
    ki rows [BLOCK_N, BLOCK_DI] and the causal visibility vis [BLOCK_Q, BLOCK_N] of its keys."""
    e, e_ok, t, qi = _entry_rows(QI, ENTRIES, start, hi, g, di, di_ok, T, stride_qit, stride_qih, TOPK, BLOCK_Q)
    z = tl.dot(qi, tl.trans(ki), input_precision=INDEX_PRECISION) * index_scale
    qp = tl.load(QPOS + t, mask=e_ok, other=-1)
    vis = k_ok[None, :] & (kpos[None, :] <= qp[:, None])
    return e, e_ok, t, qi, z, vis


@triton.jit
def _teacher_logits(Q, k_t, ENTRIES, start, end, hs, g, d, d_ok, T, stride_qt, stride_qh, scale,
                    GROUP: tl.constexpr, TOPK: tl.constexpr, BLOCK_Q: tl.constexpr, HG: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Scaled scores [BLOCK_Q * HG, BLOCK_N] of heads g*G + hs*HG + (0..HG-1) of the entries in [start, end)
    against the key sub-tile's k rows (transposed, k_t [BLOCK_D, BLOCK_N]).

    Row r is entry r // HG, head hs*HG + r % HG; also returns the rows' token and absolute head."""
    rows = tl.arange(0, BLOCK_Q * HG)
    idx = start + rows // HG
    row_ok = idx < end
    e = tl.load(ENTRIES + idx, mask=row_ok, other=0)
    t = (e // TOPK) % T
    head = g * GROUP + hs * HG + rows % HG
    q = tl.load(Q + t[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale
    return s, t, head, row_ok


@triton.jit
def _item_tiles(K, KI, ITEM_LO, ITEM_HI, ITEM_G, ITEM_K0, ITEM_K1, stride_kt, stride_kh, stride_kit,
                N_SUB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INDEX_DIM: tl.constexpr,
                BLOCK_DI: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's work item and key sub-tile, set up once per program: the sub-tile number, the item's entry
    range [lo, hi) (empty for a sub-tile past the block's end, which has no keys), its head g, the sub-tile's
    absolute key rows kpos and their mask k_ok, the head-dim ranges d, di and masks, and the key tiles: k rows of
    head g transposed k_t [BLOCK_D, BLOCK_N] and ki rows [BLOCK_N, BLOCK_DI]."""
    # The sub-tiles of one item are neighbouring programs, so their q gathers share L2.
    item = tl.program_id(0) // N_SUB
    sub = tl.program_id(0) % N_SUB
    lo = tl.load(ITEM_LO + item)
    hi = tl.load(ITEM_HI + item)
    g = tl.load(ITEM_G + item)
    k0 = tl.load(ITEM_K0 + item)
    k1 = tl.load(ITEM_K1 + item)
    kpos = k0 + sub * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kpos < k1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    di = tl.arange(0, BLOCK_DI)
    di_ok = di < INDEX_DIM
    k_t = tl.load(K + kpos[None, :].to(tl.int64) * stride_kt + g * stride_kh + d[:, None],
                  mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    ki = tl.load(KI + kpos[:, None].to(tl.int64) * stride_kit + di[None, :],
                 mask=k_ok[:, None] & di_ok[None, :], other=0.0)
    hi = tl.where(sub * BLOCK_N < k1 - k0, hi, lo)
    return sub, lo, hi, g, kpos, k_ok, d, d_ok, di, di_ok, k_t, ki


@triton.jit
def _prefetch_q_rows(Q, ENTRIES, start, end, g, T, stride_qt, stride_qh, GROUP: tl.constexpr, TOPK: tl.constexpr,
                     BLOCK_Q: tl.constexpr, LINES: tl.constexpr, ROW_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Ask L2 for the q rows (all GROUP heads of group g, ROW_LINES cache lines of 128 B each) of the entries in
    [start, min(start + BLOCK_Q, end)); no result, no effect on values. LINES = next_pow2(ROW_LINES)."""
    idx = start + tl.arange(0, BLOCK_Q)
    ok = idx < end
    e = tl.load(ENTRIES + idx, mask=ok, other=0)
    t = (e // TOPK) % T
    c = tl.arange(0, GROUP * LINES)
    line = c % LINES
    ptrs = (Q + t[:, None].to(tl.int64) * stride_qt + (g * GROUP + c // LINES)[None, :] * stride_qh
            + line[None, :] * LINE_ELEMS)
    ptrs = tl.where(ok[:, None] & (line < ROW_LINES)[None, :], ptrs, Q)  # others ask for q's first line again
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _kl_stats_kernel(
    Q, K, QI, KI, ENTRIES, ITEM_LO, ITEM_HI, ITEM_G, ITEM_K0, ITEM_K1, QPOS, ZL, AL,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_qit, stride_qih, stride_kit, scale, index_scale,
    GROUP: tl.constexpr, TOPK: tl.constexpr, N_SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, HG: tl.constexpr, TEACHER: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr,
):
    """Partial log-sum-exp per (entry, key sub-tile): student into ZL[e * N_SUB + sub] and, if TEACHER, each
    teacher head h of the group into AL[(e * N_SUB + sub) * GROUP + h]."""
    # A sub-tile past the block's end has no keys (hi = lo): its entries keep the buffers' -inf.
    sub, lo, hi, g, kpos, k_ok, d, d_ok, di, di_ok, k_t, ki = _item_tiles(
        K, KI, ITEM_LO, ITEM_HI, ITEM_G, ITEM_K0, ITEM_K1, stride_kt, stride_kh, stride_kit,
        N_SUB, HEAD_DIM, BLOCK_D, INDEX_DIM, BLOCK_DI, BLOCK_N)
    for start in range(lo, hi, BLOCK_Q):
        e, e_ok, t, qi, z, vis = _student_step(QI, ENTRIES, QPOS, ki, start, hi, g, kpos, k_ok, di, di_ok, T,
                                               stride_qit, stride_qih, index_scale, TOPK, BLOCK_Q, INDEX_PRECISION)
        z = tl.where(vis, z, float("-inf"))
        m = tl.max(z, 1)
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        l = tl.sum(tl.exp(z - m_safe[:, None]), 1)
        zl = tl.where(l > 0, m_safe + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(ZL + e.to(tl.int64) * N_SUB + sub, zl, mask=e_ok)
        if TEACHER:
            for hs in tl.static_range(GROUP // HG):
                s, t_r, head, row_ok = _teacher_logits(Q, k_t, ENTRIES, start, hi, hs, g, d, d_ok, T, stride_qt,
                                                       stride_qh, scale, GROUP, TOPK, BLOCK_Q, HG, DOT_PRECISION)
                qp_r = tl.load(QPOS + t_r, mask=row_ok, other=-1)
                s = tl.where(k_ok[None, :] & (kpos[None, :] <= qp_r[:, None]), s, float("-inf"))
                m_a = tl.max(s, 1)
                m_a = tl.where(m_a > float("-inf"), m_a, 0.0)
                l_a = tl.sum(tl.exp(s - m_a[:, None]), 1)
                e_r = tl.load(ENTRIES + start + tl.arange(0, BLOCK_Q * HG) // HG, mask=row_ok, other=0)
                dst = (e_r.to(tl.int64) * N_SUB + sub) * GROUP + head - g * GROUP
                al = tl.where(l_a > 0, m_a + tl.log(tl.where(l_a > 0, l_a, 1.0)), float("-inf"))
                tl.store(AL + dst, al, mask=row_ok)


@triton.jit
def _teacher_add(p, Q, k_t, LSE, ENTRIES, start, hi, hs, g, d, d_ok, T, stride_qt, stride_qh, stride_lt, scale,
                 GROUP: tl.constexpr, TOPK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                 HG: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """p [BLOCK_Q, BLOCK_N] plus exp(s - lse) of teacher heads hs*HG .. hs*HG + HG - 1 of the entries' group."""
    s, t_r, head, row_ok = _teacher_logits(Q, k_t, ENTRIES, start, hi, hs, g, d, d_ok, T, stride_qt, stride_qh,
                                           scale, GROUP, TOPK, BLOCK_Q, HG, DOT_PRECISION)
    lse = tl.load(LSE + t_r.to(tl.int64) * stride_lt + head, mask=row_ok, other=0.0)
    a = tl.exp(tl.minimum(s - lse[:, None], 0.0))  # p_h <= 1 even if lse is slightly low (bf16 attention)
    return p + tl.sum(tl.reshape(a, [BLOCK_Q, HG, BLOCK_N]), 1)


@triton.jit
def _teacher_kernel(
    Q, K, LSE, QPOS, MEMB, CAND, NCAND, SEL, TEACH,
    T, Tk, n_tiles, cand_stride, stride_qt, stride_qh, stride_kt, stride_kh, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, DOT_PRECISION: tl.constexpr, WHILE_LOOPS: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Teacher probabilities of one query tile of the attention forward's tiling (grid: n_tiles x Hkv): for each
    of the tile's candidate key tiles, p = exp(s - lse) of all BLOCK_M rows (token, head) in one dot, the mean over
    each token's GROUP heads, stored for the tokens that selected the block at TEACH[g, t, slot, key in block].
    SEL [Hkv, T, TOPK] holds the absolute first key row of each slot's block (-1 unused), so a token finds the
    slot of a candidate block by comparing; LSE is [T, Hq] fp32 (natural log)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    num_heads = GROUP * tl.num_programs(1)
    tok, head, row_ok, d, d_ok, q, qpos, row_token = _load_tile_rows(
        Q, QPOS, tile, g, T, stride_qt, stride_qh, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, TOKENS)
    lse = tl.load(LSE + tok.to(tl.int64) * num_heads + head, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # no keys: p = 0
    # the tile's tokens (BLOCK_M // GROUP rows, TOKENS of them real) and their slots' block starts
    TM: tl.constexpr = BLOCK_M // GROUP
    r = tl.arange(0, TM)
    t_tok = tile * TOKENS + r
    t_ok = (r < TOKENS) & (t_tok < T)
    slots = tl.arange(0, BLOCK_TOPK)
    sel_rows = (g * T + t_tok).to(tl.int64) * TOPK
    sel = tl.load(SEL + sel_rows[:, None] + slots[None, :], mask=t_ok[:, None] & (slots < TOPK)[None, :], other=-2)
    col = tl.arange(0, BLOCK_N)
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    cand_base, memb_base, n_steps = _tile_walk(CAND, MEMB, NCAND, tile, g, n_tiles, cand_stride, N_SUB)
    if WHILE_LOOPS:  # the CPU interpreter cannot use a loaded scalar as a range() bound
        step = 0
        while step < n_steps:
            _teacher_step(q, qpos, row_token, lse2, sel, sel_rows, t_ok, slots, col, K, TEACH, cand_base, memb_base,
                          step, g, d, d_ok, Tk, stride_kt, stride_kh, qk_scale, GROUP, BLOCK_SIZE, BLOCK_M, N_SUB,
                          BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)
            step += 1
    else:
        for step in range(0, n_steps):
            _teacher_step(q, qpos, row_token, lse2, sel, sel_rows, t_ok, slots, col, K, TEACH, cand_base, memb_base,
                          step, g, d, d_ok, Tk, stride_kt, stride_kh, qk_scale, GROUP, BLOCK_SIZE, BLOCK_M, N_SUB,
                          BLOCK_N, BLOCK_D, TOKENS, DOT_PRECISION, USE_TMA)


@triton.jit
def _teacher_step(q, qpos, row_token, lse2, sel, sel_rows, t_ok, slots, col, K, TEACH, cand_base, memb_base, step,
                  g, d, d_ok, Tk, stride_kt, stride_kh, qk_scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  TOKENS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    """One candidate key tile of `_teacher_kernel`."""
    row0, kpos, k_ok, k, s, visible = _tile_scores(q, qpos, row_token, K, cand_base, memb_base, step, g, d, d_ok,
                                                   Tk, stride_kt, stride_kh, qk_scale, N_SUB, BLOCK_N, BLOCK_D,
                                                   TOKENS, DOT_PRECISION, USE_TMA)
    p = tl.where(visible, tl.math.exp2(tl.minimum(s - lse2[:, None], 0.0)), 0.0)  # p <= 1 (lse from bf16 runs)
    p = tl.sum(tl.reshape(p, [BLOCK_M // GROUP, GROUP, BLOCK_N]), 1) * (1.0 / GROUP)
    start = tl.load(cand_base + step // N_SUB)
    hit = sel == start
    slot = tl.sum(tl.where(hit, slots[None, :], 0), 1)
    chosen = t_ok & (tl.max(hit.to(tl.int32), 1) > 0)
    key = (step % N_SUB) * BLOCK_N + col
    ptrs = TEACH + (sel_rows + slot)[:, None] * BLOCK_SIZE + key[None, :]
    tl.store(ptrs, p.to(TEACH.dtype.element_ty), mask=chosen[:, None] & (key < BLOCK_SIZE)[None, :])


@triton.jit
def _kl_terms(p, log_r):
    """KL(teacher || student) terms p (log p - log r) per (entry, key), 0 where the teacher has no mass."""
    return tl.where(p > 0, p * (tl.log(tl.where(p > 0, p, 1.0)) - log_r), 0.0)


@triton.jit
def _student_step_key_major(dki, QI, ENTRIES, QPOS, LSE_Z, TEACH, LOSS, DQI, ki, kpos, k_ok, di, di_ok, start, hi, g,
                            sub, T, stride_qit, stride_qih, stride_dqt, stride_dqh, index_scale, grad_coef,
                            TOPK: tl.constexpr, N_SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, INDEX_PRECISION: tl.constexpr, GRAD: tl.constexpr):
    """One step of the main pass with the teacher read from TEACH, key-major: every tile is [BLOCK_N keys,
    BLOCK_Q entries], so each dot has 128 rows as its M (a wgmma on sm_90) where the entry-major step's student
    logits z = qi ki^T and dL/dqi = dz ki have BLOCK_Q = 16 (mma.sync): z^T = ki qi^T, dL/dqi^T = ki^T dz^T,
    dL/dki += dz^T qi. Returns dki [BLOCK_N, BLOCK_DI] (fp32, unscaled). dL/dqi goes by fp32 atomics."""
    e, e_ok, t, qi = _entry_rows(QI, ENTRIES, start, hi, g, di, di_ok, T, stride_qit, stride_qih, TOPK, BLOCK_Q)
    z_t = tl.dot(ki, tl.trans(qi), input_precision=INDEX_PRECISION) * index_scale  # [BLOCK_N, BLOCK_Q]
    qp = tl.load(QPOS + t, mask=e_ok, other=-1)
    vis_t = k_ok[:, None] & (kpos[:, None] <= qp[None, :])
    lse_z = tl.load(LSE_Z + g * T + t, mask=e_ok, other=0.0)
    key = sub * BLOCK_N + tl.arange(0, BLOCK_N)
    p_t = tl.load(TEACH + e[None, :].to(tl.int64) * BLOCK_SIZE + key[:, None],
                  mask=e_ok[None, :] & (key < BLOCK_SIZE)[:, None], other=0.0).to(tl.float32)
    p_t = tl.where(vis_t, p_t, 0.0)
    log_r = z_t - lse_z[None, :]
    tl.store(LOSS + e.to(tl.int64) * N_SUB + sub, tl.sum(_kl_terms(p_t, log_r), 0), mask=e_ok)
    if GRAD:
        dz_t = (tl.where(vis_t, tl.exp(log_r), 0.0) - p_t).to(qi.dtype)  # scaled by grad_coef after the dots
        dqi_t = tl.dot(tl.trans(ki), dz_t, input_precision=INDEX_PRECISION)  # [BLOCK_DI, BLOCK_Q]
        dq_ptrs = DQI + t[None, :].to(tl.int64) * stride_dqt + g * stride_dqh + di[:, None]
        tl.atomic_add(dq_ptrs, dqi_t * grad_coef, mask=e_ok[None, :] & di_ok[:, None], sem="relaxed")
        dki += tl.dot(dz_t, qi, input_precision=INDEX_PRECISION)
    return dki


@triton.jit
def _kl_main_kernel(
    Q, K, QI, KI, ENTRIES, ITEM_LO, ITEM_HI, ITEM_G, ITEM_K0, ITEM_K1, QPOS, LSE, LSE_Z, LOSS, DQI, DQB, DKI, TEACH,
    T, stride_qt, stride_qh, stride_kt, stride_kh, stride_qit, stride_qih, stride_kit, stride_lt,
    stride_dqt, stride_dqh, stride_dkt, scale, index_scale, grad_coef,
    GROUP: tl.constexpr, TOPK: tl.constexpr, N_SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr, HG: tl.constexpr, GRAD: tl.constexpr, DQI_BUF: tl.constexpr,
    PREFETCH: tl.constexpr, LINES: tl.constexpr, ROW_LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
    UNROLL_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr,
    HAS_TEACHER: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEY_MAJOR: tl.constexpr,
):
    """Loss term per (entry, key sub-tile) into LOSS[e * N_SUB + sub]. If GRAD: dL/dki into DKI [Tk, Di] (fp32
    atomic adds, scaled by grad_coef = index_scale / (Hi T)) and dL/dqi either into DQI [T, Hi, Di] (fp32 atomic
    adds, scaled) or, with DQI_BUF, as unscaled partial rows DQB[e * N_SUB + sub, :] (plain stores; the host sums
    them over the slots and scales). With HAS_TEACHER the teacher probabilities are read from TEACH [E, BLOCK_SIZE]
    (`_teacher_kernel`; row e is entry e's block) instead of recomputed from Q, K and LSE; with KEY_MAJOR too, each
    step runs key-major (`_student_step_key_major`)."""
    sub, lo, hi, g, kpos, k_ok, d, d_ok, di, di_ok, k_t, ki = _item_tiles(
        K, KI, ITEM_LO, ITEM_HI, ITEM_G, ITEM_K0, ITEM_K1, stride_kt, stride_kh, stride_kit,
        N_SUB, HEAD_DIM, BLOCK_D, INDEX_DIM, BLOCK_DI, BLOCK_N)
    dki = tl.zeros([BLOCK_N, BLOCK_DI], dtype=tl.float32)
    if PREFETCH > 0:
        for ahead in tl.static_range(PREFETCH):
            _prefetch_q_rows(Q, ENTRIES, lo + ahead * BLOCK_Q, hi, g, T, stride_qt, stride_qh, GROUP, TOPK, BLOCK_Q,
                             LINES, ROW_LINES, LINE_ELEMS)
    if HAS_TEACHER and KEY_MAJOR:
        for start in range(lo, hi, BLOCK_Q):
            dki = _student_step_key_major(dki, QI, ENTRIES, QPOS, LSE_Z, TEACH, LOSS, DQI, ki, kpos, k_ok, di, di_ok,
                                          start, hi, g, sub, T, stride_qit, stride_qih, stride_dqt, stride_dqh,
                                          index_scale, grad_coef, TOPK, N_SUB, BLOCK_N, BLOCK_Q, BLOCK_SIZE,
                                          INDEX_PRECISION, GRAD)
    else:
        for start in range(lo, hi, BLOCK_Q):
            if PREFETCH > 0:
                _prefetch_q_rows(Q, ENTRIES, start + PREFETCH * BLOCK_Q, hi, g, T, stride_qt, stride_qh, GROUP, TOPK,
                                 BLOCK_Q, LINES, ROW_LINES, LINE_ELEMS)
            e, e_ok, t, qi, z, vis = _student_step(QI, ENTRIES, QPOS, ki, start, hi, g, kpos, k_ok, di, di_ok, T,
                                                   stride_qit, stride_qih, index_scale, TOPK, BLOCK_Q, INDEX_PRECISION)
            lse_z = tl.load(LSE_Z + g * T + t, mask=e_ok, other=0.0)
            if HAS_TEACHER:
                key = sub * BLOCK_N + tl.arange(0, BLOCK_N)
                p = tl.load(TEACH + e[:, None].to(tl.int64) * BLOCK_SIZE + key[None, :],
                            mask=e_ok[:, None] & (key < BLOCK_SIZE)[None, :], other=0.0).to(tl.float32)
                p = tl.where(vis, p, 0.0)
            else:
                # Teacher: mean over the group's heads of exp(s - lse), HG heads per dot.
                p = tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32)
                if UNROLL_HEADS:
                    for hs in tl.static_range(GROUP // HG):
                        p = _teacher_add(p, Q, k_t, LSE, ENTRIES, start, hi, hs, g, d, d_ok, T, stride_qt, stride_qh,
                                         stride_lt, scale, GROUP, TOPK, BLOCK_Q, BLOCK_N, HG, DOT_PRECISION)
                else:  # a loop the compiler keeps: fewer registers live (G = 4: 215 instead of 255 + spills)
                    for hs in tl.range(0, GROUP // HG, num_stages=1):
                        p = _teacher_add(p, Q, k_t, LSE, ENTRIES, start, hi, hs, g, d, d_ok, T, stride_qt, stride_qh,
                                         stride_lt, scale, GROUP, TOPK, BLOCK_Q, BLOCK_N, HG, DOT_PRECISION)
                p = tl.where(vis, p * (1.0 / GROUP), 0.0)
            log_r = z - lse_z[:, None]
            tl.store(LOSS + e.to(tl.int64) * N_SUB + sub, tl.sum(_kl_terms(p, log_r), 1), mask=e_ok)
            if GRAD:
                r = tl.where(vis, tl.exp(log_r), 0.0)
                dz = (r - p).to(qi.dtype)  # scaled by grad_coef after the dots, to keep low-precision dz in range
                dqi = tl.dot(dz, ki, input_precision=INDEX_PRECISION)  # [BLOCK_Q, BLOCK_DI]
                if DQI_BUF:  # every (entry, sub-tile) owns its row: no read-modify-write traffic in L2
                    dq_ptrs = DQB + (e.to(tl.int64) * N_SUB + sub)[:, None] * INDEX_DIM + di[None, :]
                    tl.store(dq_ptrs, dqi.to(DQB.dtype.element_ty), mask=e_ok[:, None] & di_ok[None, :])
                else:
                    dq_ptrs = DQI + t[:, None].to(tl.int64) * stride_dqt + g * stride_dqh + di[None, :]
                    tl.atomic_add(dq_ptrs, dqi * grad_coef, mask=e_ok[:, None] & di_ok[None, :], sem="relaxed")
                dki += tl.dot(tl.trans(dz), qi, input_precision=INDEX_PRECISION)
    if GRAD:
        dk_ptrs = DKI + kpos[:, None].to(tl.int64) * stride_dkt + di[None, :]
        tl.atomic_add(dk_ptrs, dki * grad_coef, mask=k_ok[:, None] & di_ok[None, :] & (hi > lo), sem="relaxed")


# ---------------------------------------------------------------------------------------------------------------
# Inverse index


@dataclass(frozen=True)
class EntryWork:
    """Key-block-outer work list over the entries of `block_idx [Hi, T, topk]`.

    Entry e = (g * T + t) * topk + slot is one valid (head, query, slot). `entries` int32 [E] holds the valid
    entries sorted by bucket = (g, global key block), then by e (so by query, for locality). Work item i handles
    `entries[lo[i]:hi[i]]` (empty when lo == hi) of head `g[i]`, whose block covers absolute key rows
    `[k0[i], k1[i])`. A bucket with more than `max_entries` entries spans several items; no item is empty unless
    `compact_items=0` kept them (lo == hi: the kernel skips them).
    """

    entries: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    g: torch.Tensor
    k0: torch.Tensor
    k1: torch.Tensor


def _entry_work(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
                block_size: int, max_entries: int, compact: bool = True) -> EntryWork:
    """Build the inverse index of `block_idx` with one sort; sizes come from shapes but for the final
    compaction of the item list (`compact`: drop the empty items, one host sync; else keep them, the kernel
    skips them).

    Global key block numbers run over all sequences' blocks in order; `slots = ceil(Tk / block_size) + B`
    bounds their count.
    """
    entries, live, lo, hi, g, k0, k1 = _entry_tensors(block_idx, seq, cu_seqlens_k, num_keys, block_size, max_entries)
    if compact:  # their programs would only load and exit
        i32 = lambda x: x[live].to(torch.int32).contiguous()  # noqa: E731
    else:
        i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return EntryWork(entries=entries, lo=i32(lo), hi=i32(hi), g=i32(g), k0=i32(k0), k1=i32(k1))


@fused_on_cuda(grad=False)
def _entry_tensors(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
                   block_size: int, max_entries: int) -> tuple[torch.Tensor, ...]:
    """`_entry_work` up to the compaction (~35 torch ops: one fused graph on CUDA)."""
    # Sorted by (bucket, query token), the entry numbers are the sort's indices (with entry numbers as the sort's
    # payload, topk times larger than tokens, m3-small's 8 x 8K tokens needed int64 keys: twice the radix passes).
    sel, (_, _, b, lo, hi, _, _, order) = token_runs(block_idx, seq, cu_seqlens_k, num_keys, block_size, max_entries)
    slots = sel.slots
    entries = order.to(torch.int32)
    k0, k1, _ = block_rows(b % slots, sel.cu_k, sel.seq_block_off, sel.seq_block_end, block_size)
    return entries, hi > lo, lo, hi, b // slots, k0, k1


def _dense_block_idx(qpos_rel: torch.Tensor, heads: int, block_size: int, num_blocks: int) -> torch.Tensor:
    """All causal blocks of every query: int32 [heads, T, num_blocks] (0..own block, then -1)."""
    j = torch.arange(num_blocks, device=qpos_rel.device)
    own = (qpos_rel // block_size)[:, None]
    idx = torch.where(j[None, :] <= own, j[None, :], -1).to(torch.int32)
    return idx[None].expand(heads, -1, -1).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Host side


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _kl_forward(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse, block_size: int, scale: float,
                index_scale: float, need_grad: bool, launch: KLLaunch | None = None, index_lse=None, teacher=None):
    """Loss (fp32 scalar) and, if need_grad, dL/dqi [T, Hi, Di], dL/dki [Tk, Di] (fp32; zeros otherwise). With
    both `lse` and `index_lse` given the first pass is skipped (it only computes normalisers). `teacher`: the
    teacher probabilities [Hi, T, topk, block_size] of a sparse KL computed elsewhere (the attention backward's
    dk/dv kernel, `triton_attention._backward`), read instead of running the teacher pass."""
    t, hq, d = q.shape
    tk, hkv, _ = k.shape
    di = qi.shape[2]
    group = hq // hkv
    device = q.device
    dqi = torch.zeros((t, hkv, di), dtype=torch.float32, device=device)
    dki = torch.zeros((tk, di), dtype=torch.float32, device=device)
    if t == 0:
        return q.new_zeros((), dtype=torch.float32), dqi, dki
    if launch is None:
        launch = kl_launch(group, max(d, di), block_size, q.is_cuda)
    seq, qpos = query_positions(cu_seqlens, cu_seqlens_k, t)
    sparse = block_idx is not None
    if block_idx is None:
        cu_k = cu_seqlens_k.to(torch.int64)
        qpos_rel = qpos.to(torch.int64) - cu_k[seq]
        num_blocks = -(-int((cu_k[1:] - cu_k[:-1]).max()) // block_size)
        block_idx = _dense_block_idx(qpos_rel, hkv, block_size, max(num_blocks, 1))
    topk = block_idx.shape[2]
    n_sub = -(-block_size // launch.block_n)
    work = _entry_work(block_idx, seq, cu_seqlens_k, tk, block_size, launch.max_entries, bool(launch.compact_items))
    q, k, qi, ki = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, qi, ki))
    common = dict(GROUP=group, TOPK=topk, N_SUB=n_sub, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
                  INDEX_DIM=di, BLOCK_DI=max(16, next_pow2(di)), BLOCK_N=launch.block_n, BLOCK_Q=launch.block_q,
                  HG=launch.heads_per_dot, DOT_PRECISION=_dot_precision(q.dtype),
                  INDEX_PRECISION=_dot_precision(qi.dtype), num_warps=launch.num_warps,
                  num_stages=launch.num_stages)
    grid = (work.lo.numel() * n_sub,)
    if grid[0] == 0:  # no query selected any block: every key set is empty and contributes 0
        return q.new_zeros((), dtype=torch.float32), dqi, dki
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), qi.stride(0), qi.stride(1), ki.stride(0))
    items = (work.entries, work.lo, work.hi, work.g, work.k0, work.k1, qpos)

    if lse is not None and index_lse is not None:  # both normalisers known: no first pass
        lse_z = index_lse.contiguous()
    else:  # Pass 1: partial log-sum-exps, combined per (g, t) over slots and sub-tiles.
        z_part = torch.full((hkv, t, topk * n_sub), -math.inf, dtype=torch.float32, device=device)
        a_part = None
        if lse is None:
            a_part = torch.full((hkv, t, topk * n_sub, group), -math.inf, dtype=torch.float32, device=device)
        stats = dict(common, BLOCK_Q=launch.stats_block_q or launch.block_q,
                     num_warps=launch.stats_num_warps or launch.num_warps,
                     num_stages=launch.stats_num_stages or launch.num_stages)
        _kl_stats_kernel[grid](q, k, qi, ki, *items, z_part, z_part if a_part is None else a_part,
                               t, *strides, scale, index_scale, TEACHER=a_part is not None, **stats)
        lse_z = torch.logsumexp(z_part, dim=-1).contiguous()  # [Hi, T]
        if lse is None:
            lse = torch.logsumexp(a_part, dim=2).transpose(0, 1).reshape(t, hq)
            del a_part
    lse = lse.to(torch.float32).contiguous()

    if teacher is not None and not sparse:
        raise ValueError("a precomputed teacher is for the sparse KL (block_idx given)")
    if teacher is None and launch.teacher_pass and sparse and teacher_fits(q, hkv, topk, block_size):
        teacher = _teacher_pass(q, k, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size, scale)

    # Pass 2: loss terms and gradients.
    loss_part = torch.zeros((hkv, t, topk * n_sub), dtype=torch.float32, device=device)
    count = t * hkv
    row_lines = -(-d * q.element_size() // 128)  # 128-byte cache lines per q row
    dq_part = None
    key_major = bool(launch.key_major) and teacher is not None  # (its dL/dqi goes by atomics)
    if need_grad and launch.dqi_buffer and not key_major and \
            hkv * t * topk * n_sub * di * qi.element_size() <= DQI_BUFFER_MAX_BYTES:
        dq_part = torch.zeros((hkv, t, topk * n_sub, di), dtype=qi.dtype, device=device)
    _kl_main_kernel[grid](q, k, qi, ki, *items, lse, lse_z, loss_part, dqi, dqi if dq_part is None else dq_part,
                          dki, dki if teacher is None else teacher,
                          t, *strides, lse.stride(0), dqi.stride(0), dqi.stride(1), dki.stride(0),
                          scale, index_scale, index_scale / count, GRAD=need_grad, DQI_BUF=dq_part is not None,
                          PREFETCH=0 if interpreting() else launch.prefetch,
                          LINES=next_pow2(row_lines), ROW_LINES=row_lines, LINE_ELEMS=128 // q.element_size(),
                          UNROLL_HEADS=bool(launch.unroll_heads), HAS_TEACHER=teacher is not None,
                          BLOCK_SIZE=block_size, KEY_MAJOR=key_major, **common,
                          **({"maxnreg": launch.maxnreg} if launch.maxnreg and not interpreting() else {}))
    if dq_part is not None:
        dqi = (dq_part.sum(2, dtype=torch.float32) * (index_scale / count)).transpose(0, 1).contiguous()
    return loss_part.sum() / count, dqi, dki


def teacher_fits(q: torch.Tensor, hkv: int, topk: int, block_size: int) -> bool:
    """Whether the KL can read its teacher from a `[Hkv, T, topk, block_size]` buffer for queries q [T, Hq, D]:
    a power-of-two group (the head mean's tile shapes) and a buffer within `TEACHER_MAX_BYTES`."""
    group = q.shape[1] // hkv
    nbytes = hkv * q.shape[0] * topk * block_size * _teacher_dtype(q.dtype).itemsize
    return group & (group - 1) == 0 and nbytes <= TEACHER_MAX_BYTES


def _teacher_dtype(dtype: torch.dtype) -> torch.dtype:
    """The teacher buffer's dtype: fp16 (probabilities in [0, 1]) for low-precision inputs, fp32 for fp32 ones."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _teacher_pass(q, k, lse, block_idx, cu_seqlens, cu_seqlens_k, block_size: int, scale: float,
                  launch=None) -> torch.Tensor:
    """Teacher probabilities [Hkv, T, topk, block_size] (`_teacher_kernel`; fp16, fp32 for fp32 inputs): entry
    (g, t, slot)'s row holds the mean over g's heads of exp(q.k * scale - lse) over the keys of its block, 0 for
    keys it cannot see. Rows of unused slots are left unwritten (the main pass reads valid entries only).
    `launch`: the attention forward's `AttentionLaunch` (default: the one the forward uses for these tensors)."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    topk = block_idx.shape[2]
    if launch is None:
        launch = attention_launch(group, dim, block_size, q.dtype, q.is_cuda)
    tokens = launch.tokens_per_tile(group)
    # the attention forward's tiling of the same selection, usually still cached from it
    _, qpos, sel, cand, ncand, members = query_tiling(block_idx, cu_seqlens, cu_seqlens_k, t, k.shape[0], block_size,
                                                      tokens)
    teacher = torch.empty((hkv, t, topk, block_size), device=q.device, dtype=_teacher_dtype(q.dtype))
    kd, _, use_tma = _key_operands(k, k, launch.tma, launch.block_n)
    _teacher_kernel[(cand.shape[1], hkv)](
        q, kd, lse, qpos, members, cand, ncand, sel, teacher,
        t, k.shape[0], cand.shape[1], cand.shape[2], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=dim, BLOCK_D=next_pow2(dim), BLOCK_SIZE=block_size, BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, TOKENS=tokens, TOPK=topk, BLOCK_TOPK=next_pow2(topk),
        DOT_PRECISION=_dot_precision(q.dtype), WHILE_LOOPS=interpreting(), USE_TMA=use_tma,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return teacher


@torch.library.custom_op("openm3::msa_indexer_kl", mutates_args=())
def _kl_op(q: torch.Tensor, k: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor, block_idx: torch.Tensor | None,
           cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None, lse: torch.Tensor | None, block_size: int,
           scale: float, index_scale: float, need_grad: bool, index_lse: torch.Tensor | None = None,
           teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # cu_seqlens_k None means cu_seqlens (not passed twice: Dynamo rejects one tensor in two Function inputs).
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    return _kl_forward(q, k, qi, ki, block_idx, cu_seqlens, cu_k, lse, block_size, scale, index_scale, need_grad,
                       index_lse=index_lse, teacher=teacher)


@_kl_op.register_fake
def _kl_fake(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse, block_size, scale, index_scale, need_grad,
             index_lse=None, teacher=None):
    return (q.new_empty((), dtype=torch.float32), qi.new_empty(qi.shape, dtype=torch.float32),
            ki.new_empty(ki.shape, dtype=torch.float32))


class _IndexerKL(torch.autograd.Function):
    """Gradients are computed in the forward (the loss is a scalar); backward only scales them."""

    @staticmethod
    def forward(ctx, qi, ki, q, k, block_idx, cu_seqlens, cu_seqlens_k, lse, block_size, scale, index_scale,
                index_lse):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, dqi, dki = _kl_op(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse, block_size, scale,
                                index_scale, need_grad, index_lse)
        ctx.save_for_backward(dqi, dki)
        ctx.dtypes = (qi.dtype, ki.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dqi, dki = ctx.saved_tensors
        qi_dtype, ki_dtype = ctx.dtypes
        return ((grad * dqi).to(qi_dtype), (grad * dki).to(ki_dtype), None, None, None, None, None, None, None,
                None, None, None)


# Value checks of block_idx synchronise with the device and cost a few sorts of [Hi, T, topk]; benchmarks of the
# kernels alone may switch them off (`triton_kl.VALIDATE_BLOCK_IDX = False`).
VALIDATE_BLOCK_IDX = True


def indexer_kl(q: torch.Tensor, k: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor, block_idx: torch.Tensor | None,
               cu_seqlens: torch.Tensor, *, block_size: int, scale: float | None = None,
               index_scale: float | None = None, lse: torch.Tensor | None = None,
               cu_seqlens_k: torch.Tensor | None = None, validate_block_idx: bool = True,
               index_lse: torch.Tensor | None = None) -> torch.Tensor:
    """KL(main attention || index distribution), differentiable in qi and ki only.

    Args:
        q: [T, Hq, D], k: [Tk, Hkv, D] main-branch queries and keys (constants). qi: [T, Hi, Di], ki: [Tk, Di]
            index queries and keys (Hi == Hkv). fp16/bf16/fp32, one dtype for q, k and one for qi, ki.
        block_idx: int32 [Hi, T, topk] selected blocks, or None for the dense warm-up over all causal keys.
        cu_seqlens / cu_seqlens_k: int32 [B + 1] (bottom-right causal alignment). scale: default 1/sqrt(D);
            index_scale: default 1/sqrt(Di). lse: optional fp32 [T, Hq] from `sparse_attention` over the same
            keys (saves the teacher normaliser pass and its [Hi, T, topk * n_sub, G] buffer). index_lse: optional
            fp32 [Hi, T] from `select_blocks(..., return_index_lse=True)` (the student normaliser); with lse given
            too, the first pass is skipped.

    Returns:
        fp32 scalar: mean over (g, t) of KL(p || r) over the key set of (g, t); see the module docstring.
    """
    _, _, d, di, _ = check_indexer_kl_inputs(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse,
                                             block_size=block_size, scale=scale, index_scale=index_scale,
                                             block_idx_values=validate_block_idx and VALIDATE_BLOCK_IDX,
                                             index_lse=index_lse)
    check_triton_inputs(q=q, k=k, qi=qi, ki=ki)
    if block_idx is not None:
        block_idx = block_idx.contiguous()
    if torch.float64 in (q.dtype, qi.dtype):
        raise ValueError("q and qi must be fp16, bf16 or fp32 for the Triton backend (use the reference for fp64)")
    scale = d ** -0.5 if scale is None else float(scale)
    index_scale = di ** -0.5 if index_scale is None else float(index_scale)
    return _IndexerKL.apply(qi, ki, q.detach(), k.detach(), block_idx, cu_seqlens, cu_seqlens_k,
                            None if lse is None else lse.detach(), block_size, scale, index_scale,
                            None if index_lse is None else index_lse.detach())
