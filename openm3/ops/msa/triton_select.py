"""MSA block selection in Triton: index scores, block max, forced local blocks and top-k, fused on chip.

Public entry: `select_blocks(qi, ki, cu_seqlens, *, block_size, topk, local_blocks=1, cu_seqlens_k=None,
index_scale=None) -> block_idx int32 [Hi, T, topk]`, the same contract (and slot order) as
`reference.select_blocks`.

Schedule (cost floors in docs/kernels_select_kl.md):
- One program owns `BLOCK_M // Hi` consecutive query tokens of one sequence times ALL `Hi` index heads: a
  `[BLOCK_M, Di]` tile, rows ordered (token, head). The index key head is shared by every index head, so one key
  tile feeds all of them (M3: 32 tokens x 4 heads = 128 rows, one tl.dot per 128 keys).
- It walks the causally visible keys of the tile in tiles of `BLOCK_N` keys: `S = qi_tile @ ki_tile^T` on tensor
  cores, causal mask, block max per row. A block larger than `BLOCK_N` is the running max over its sub-tiles; a
  power-of-two block smaller than `BLOCK_N` is a `[BLOCK_M, NB, block]` reshape-max (`NB` blocks per key tile).
- Each block score updates a running top-k held in registers per row (`[BLOCK_M, KPAD]` values + block ids): it
  replaces the row's current minimum when larger (one min-reduction and two selects per block). The forced local
  blocks never enter it; padding slots (`topk < KPAD`) hold +inf so they are never the minimum.
- At the end each row writes its local blocks (own, own - 1, ...) then its kept blocks by descending score
  (selection sort in registers), -1 in the remaining slots. The `[Hi, T, T / block]` score tensor never exists:
  the workspace per program is the tile plus `[BLOCK_M, KPAD]`, whatever T.
- Tiles are listed (with torch ops, no host synchronisation) per sequence and launched longest key range first,
  since the causal work of a tile grows with its position.
- Only the last key steps of a tile (those reaching past its first query) are masked; ki tiles come through masked
  pointer loads or, with `tma=1`, a TMA tensor descriptor (fewer registers: no pointer tensors).

Launch parameters come from `select_launch` (one place; `OPENM3_SELECT_LAUNCH="block_m=128,block_n=64,..."`
overrides single fields for tuning on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._checks import Segment, check_block_params, check_index_inputs, check_scale, check_seqlens
from .triton_common import (check_block_size, check_triton_inputs, interpreting, largest_pow2_divisor, next_pow2,
                            with_overrides)

__all__ = ["select_blocks", "select_launch", "SelectLaunch"]


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration


@dataclass(frozen=True)
class SelectLaunch:
    """Launch parameters of the selection kernel.

    block_m: rows of a tile = (query tokens) x (index heads), a power of two >= 16 and >= Hi.
    block_n: keys per `tl.dot`, a power of two >= 16. When `block_size >= block_n` it must divide block_size;
        when smaller, block_size must be a power of two (several blocks per key tile).
    tma: 1 loads the ki tiles through a TMA tensor descriptor (the default on Hopper+; falls back to pointer loads
        when ki's row stride is not 16-byte aligned), 0 through masked pointer loads.
    index_lse: 1 makes `select_blocks(..., return_index_lse=True)` also return the indexer KL's student normaliser
        (`reference.index_lse`), from the scores the kernel has on chip: one exponential per score more here, and
        the KL skips its first pass. 0 returns None for it and leaves it to the KL. -1 (the GPU default) decides
        per call: 1 when the queries' sequences hold at most `INDEX_LSE_MAX_KEYS` keys on average (weighted by
        queries), else 0. The exponentials cost the selection O(T^2) and save the KL O(T * topk * block): measured
        on the H200, m3-small's 8K training step is 0.9% faster with it (interleaved A/B, session 9) and M3's
        selection + KL at 128K 7% slower (78.1 -> 83.5 ms, session 8).
    lse_maxnreg: register cap of the kernel when it computes that normaliser (compiled GPUs; 0 = none): without it
        sm_90 takes 137 registers at M3's shape and two 8-warp programs no longer share an SM.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: int = 0
    index_lse: int = 0
    lse_maxnreg: int = 128


_ENV_OVERRIDE = "OPENM3_SELECT_LAUNCH"

# index_lse=-1 computes the normaliser in the selection for sequences of at most this many keys (the longest
# measured win: 8K-token rows; the loss at 128K suggests the break-even lies between them).
INDEX_LSE_MAX_KEYS = 8192


def select_launch(num_heads: int, head_dim: int, block_size: int, on_gpu: bool, **overrides) -> SelectLaunch:
    """Launch parameters for `num_heads` index heads of dim `head_dim` and blocks of `block_size` keys.

    `overrides` (or `OPENM3_SELECT_LAUNCH="key=value,..."`) replace single fields. Raises NotImplementedError for a
    block size that is neither a multiple of 16 nor a power of two (no valid key tiling on tensor cores).
    """
    if block_size % 16 and block_size & (block_size - 1):
        raise NotImplementedError(f"triton select_blocks needs block_size a multiple of 16 or a power of two, "
                                  f"got {block_size}")
    cap_n = 128 if on_gpu else 32
    if block_size % 16 == 0:
        block_n = largest_pow2_divisor(block_size, cap_n)
    else:  # power of two below 16: several blocks per key tile
        block_n = 16 if not on_gpu else 64
    block_m = max(next_pow2(num_heads), 128) if on_gpu else max(128, 16 * next_pow2(num_heads))
    # Two pipeline stages (not three) fit two programs per SM (~100 KiB of shared memory and <= 128 registers each),
    # so one program's block-max / top-k work overlaps the other's MMAs; TMA loads (Hopper+) save the pointer
    # registers. Measured on the H200 at 128K (M3 shape): 14.5 ms against 19.5 ms with three stages and pointers.
    tma = int(on_gpu and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    cfg = dict(block_m=block_m, block_n=block_n, num_warps=8 if on_gpu and head_dim >= 128 else 4,
               num_stages=2 if on_gpu else 1, tma=tma, index_lse=-1 if on_gpu else 0)
    cfg = with_overrides(cfg, _ENV_OVERRIDE, overrides)
    launch = SelectLaunch(**cfg)
    _check_launch(launch, num_heads, block_size)
    return launch


def _check_launch(launch: SelectLaunch, num_heads: int, block_size: int) -> None:
    for name in ("block_m", "block_n"):
        value = getattr(launch, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"select launch: {name}={value} must be a power of two >= 16")
    if launch.tma not in (0, 1):
        raise ValueError(f"select launch: tma={launch.tma} must be 0 or 1")
    if launch.index_lse not in (-1, 0, 1):
        raise ValueError(f"select launch: index_lse={launch.index_lse} must be -1 (by sequence length), 0 or 1")
    if not 0 <= launch.lse_maxnreg <= 255:
        raise ValueError(f"select launch: lse_maxnreg={launch.lse_maxnreg} must be 0 (none) or a register count "
                         f"in [1, 255]")
    if launch.block_m < num_heads:
        raise ValueError(f"select launch: block_m={launch.block_m} must hold all {num_heads} index heads")
    if block_size >= launch.block_n and block_size % launch.block_n:
        raise ValueError(f"select launch: block_n={launch.block_n} must divide block_size={block_size}")
    if block_size < launch.block_n and block_size & (block_size - 1):
        raise ValueError(f"select launch: block_size={block_size} < block_n={launch.block_n} must be a power of two")


# ---------------------------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _tile_scores(qi, KI, KI_DESC, k_start, kpos, qpos, n_keys, d, d_ok, stride_kt, CAUSAL: tl.constexpr,
                 USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Unscaled scores [BLOCK_M, BLOCK_N] of the tile's rows against keys kpos (positions in the sequence).

    CAUSAL masks each row's future keys with -inf (and skips loading keys past n_keys); otherwise every key of
    the tile precedes every row. With USE_TMA the ki rows come through a TMA descriptor (rows past the tensor's
    end read as zeros), else through masked pointer loads."""
    if USE_TMA:
        ki = KI_DESC.load([k_start + tl.min(kpos, 0), 0])  # [BLOCK_N, BLOCK_D]
        s = tl.dot(qi, tl.trans(ki), input_precision=DOT_PRECISION)
    else:
        k_ptrs = KI + (k_start + kpos)[None, :].to(tl.int64) * stride_kt + d[:, None]
        if CAUSAL:
            ki = tl.load(k_ptrs, mask=(kpos < n_keys)[None, :] & d_ok[:, None], other=0.0)
        else:
            ki = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        s = tl.dot(qi, ki, input_precision=DOT_PRECISION)
    if CAUSAL:
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    return s


@triton.jit
def _logaddexp(a, b):
    m = tl.maximum(a, b)
    ref = tl.where(m > float("-inf"), m, 0.0)
    total = tl.exp(a - ref) + tl.exp(b - ref)
    return tl.where(total > 0, ref + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit
def _scan(vals, ids, lses, loc, qi, KI, KI_DESC, k_start, stride_kt, qpos, own, row_ok, d, d_ok, step_lo, step_hi,
          n_keys, index_scale, LOCAL: tl.constexpr, KPAD: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr, CAUSAL: tl.constexpr, USE_TMA: tl.constexpr,
          DOT_PRECISION: tl.constexpr, WITH_LSE: tl.constexpr):
    """Offer the blocks of key steps [step_lo, step_hi) to the running top-k `vals, ids [BLOCK_M, KPAD]`.

    A step covers BLOCK_N * SUB keys: NB whole blocks (block_size < BLOCK_N) or one block of SUB key tiles.
    Scores are left unscaled (a positive scale never changes the ranking). CAUSAL masks keys after each row's
    position and past `n_keys`; steps entirely before every row's position skip it. WITH_LSE also keeps each
    block's log-sum-exp of the scaled scores: in `lses` beside its slot of the top-k, and summed into `loc [BLOCK_M]`
    for the forced local blocks.
    """
    n = tl.arange(0, BLOCK_N)
    slot = tl.arange(0, KPAD)
    KEYS_PER_STEP: tl.constexpr = BLOCK_N * SUB
    c = index_scale * 1.4426950408889634  # exp(index_scale * x) = exp2(c * x)
    for step in range(step_lo, step_hi):
        if NB == 1:  # one block per step, the running max over its SUB key tiles (and its sum of exponentials)
            best = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_b = tl.zeros([BLOCK_M], tl.float32)
            for sub in tl.static_range(SUB):
                kpos = step * KEYS_PER_STEP + sub * BLOCK_N + n
                s = _tile_scores(qi, KI, KI_DESC, k_start, kpos, qpos, n_keys, d, d_ok, stride_kt, CAUSAL, USE_TMA,
                                 DOT_PRECISION)
                new_best = tl.maximum(best, tl.max(s, 1))
                if WITH_LSE:
                    ref = tl.where(new_best > float("-inf"), new_best, 0.0)
                    l_b = l_b * tl.math.exp2((best - ref) * c) + tl.sum(tl.math.exp2((s - ref[:, None]) * c), 1)
                best = new_best
            if WITH_LSE:
                blse = tl.where(l_b > 0, best * index_scale + tl.log(tl.where(l_b > 0, l_b, 1.0)), float("-inf"))
        else:  # NB whole blocks per key tile
            kpos = step * BLOCK_N + n
            s = _tile_scores(qi, KI, KI_DESC, k_start, kpos, qpos, n_keys, d, d_ok, stride_kt, CAUSAL, USE_TMA,
                             DOT_PRECISION)
            s3 = tl.reshape(s, [BLOCK_M, NB, BLOCK_N // NB])
            block_max = tl.max(s3, 2)  # [BLOCK_M, NB]
            col = tl.arange(0, NB)
            if WITH_LSE:
                ref = tl.where(block_max > float("-inf"), block_max, 0.0)
                l_all = tl.sum(tl.math.exp2((s3 - ref[:, :, None]) * c), 2)
                lse_all = tl.where(l_all > 0, block_max * index_scale + tl.log(tl.where(l_all > 0, l_all, 1.0)),
                                   float("-inf"))
        # Each block replaces the row's current minimum (the first one) when larger. Forced local blocks are
        # written separately and do not compete.
        for j in tl.static_range(NB):
            blk = step * NB + j
            if NB == 1:
                score = best
            else:
                score = tl.max(tl.where(col[None, :] == j, block_max, float("-inf")), 1)
                if WITH_LSE:
                    blse = tl.max(tl.where(col[None, :] == j, lse_all, float("-inf")), 1)
            forced = (blk <= own) & (blk > own - LOCAL)
            if WITH_LSE:
                loc = tl.where(forced, _logaddexp(loc, blse), loc)
            score = tl.where(forced | (row_ok == 0), float("-inf"), score)
            low = tl.min(vals, 1)
            first = tl.min(tl.where(vals == low[:, None], slot[None, :], KPAD), 1)
            hit = (score > low)[:, None] & (slot[None, :] == first[:, None])
            vals = tl.where(hit, score[:, None], vals)
            ids = tl.where(hit, blk, ids)
            if WITH_LSE:
                lses = tl.where(hit, blse[:, None], lses)
    return vals, ids, lses, loc


@triton.jit
def _select_kernel(
    QI, KI, KI_DESC, OUT, LSE_OUT, TILE_SEQ, TILE_Q0, CU_Q, CU_K,
    T, stride_qt, stride_qh, stride_kt, index_scale,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, KEEP: tl.constexpr, KPAD: tl.constexpr, LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WITH_LSE: tl.constexpr = False,
):
    # WITH_LSE: also LSE_OUT[head, t] = log-sum-exp of index_scale * score over the row's selected causal keys.
    # NB key blocks per key tile (block_size < BLOCK_N) or SUB key tiles per block (block_size >= BLOCK_N).
    pid = tl.program_id(0)
    b = tl.load(TILE_SEQ + pid)
    q0 = tl.load(TILE_Q0 + pid)  # first query of the tile within its sequence; -1 for an unused tile slot
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    k_start = tl.load(CU_K + b)
    k_len = tl.load(CU_K + b + 1) - k_start
    TOKENS: tl.constexpr = BLOCK_M // HEADS

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // HEADS
    head = rows % HEADS
    row_ok = (rows < TOKENS * HEADS) & (tok < q_len) & (q0 >= 0)
    qpos = tok + (k_len - q_len)  # position of the query inside its sequence (bottom-right alignment)
    own = qpos // BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = QI + (q_start + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :]
    qi = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys [0, n_keys) are visible to at least one row of the tile.
    n_keys = (k_len - q_len + tl.minimum(q0 + TOKENS, q_len)) * (q0 >= 0).to(tl.int32)
    slot = tl.arange(0, KPAD)
    vals = tl.where(slot[None, :] < KEEP, float("-inf"), float("inf")) + tl.zeros([BLOCK_M, KPAD], tl.float32)
    ids = tl.full([BLOCK_M, KPAD], -1, tl.int32)
    lses = tl.full([BLOCK_M, KPAD], float("-inf"), tl.float32)
    loc = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # Steps whose keys all precede the tile's first query need no mask; the last ones (the diagonal) do.
    KEYS_PER_STEP: tl.constexpr = BLOCK_N * SUB
    n_steps = tl.cdiv(n_keys, KEYS_PER_STEP)
    n_full = tl.minimum((k_len - q_len + q0 + 1) // KEYS_PER_STEP, n_steps) * (q0 >= 0).to(tl.int32)
    vals, ids, lses, loc = _scan(vals, ids, lses, loc, qi, KI, KI_DESC, k_start, stride_kt, qpos, own, row_ok, d,
                                 d_ok, 0, n_full, n_keys, index_scale, LOCAL, KPAD, BLOCK_M, BLOCK_N, NB, SUB, False,
                                 USE_TMA, DOT_PRECISION, WITH_LSE)
    vals, ids, lses, loc = _scan(vals, ids, lses, loc, qi, KI, KI_DESC, k_start, stride_kt, qpos, own, row_ok, d,
                                 d_ok, n_full, n_steps, n_keys, index_scale, LOCAL, KPAD, BLOCK_M, BLOCK_N, NB, SUB,
                                 True, USE_TMA, DOT_PRECISION, WITH_LSE)
    if WITH_LSE:  # the kept blocks (the first TOPK - LOCAL slots that hold one) and the local ones
        kept = (slot[None, :] < TOPK - LOCAL) & (vals > float("-inf")) & (vals < float("inf"))
        ls = tl.where(kept, lses, float("-inf"))
        m = tl.maximum(tl.max(ls, 1), loc)
        ref = tl.where(m > float("-inf"), m, 0.0)
        total = tl.sum(tl.exp(ls - ref[:, None]), 1) + tl.exp(loc - ref)
        lse = tl.where(total > 0, ref + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(LSE_OUT + head.to(tl.int64) * T + q_start + tok, lse, mask=row_ok)

    # Slots: forced local blocks first (own, own - 1, ... those >= 0), then the kept blocks by descending score.
    # A row with fewer than LOCAL local blocks (own < LOCAL - 1) has no other causal block at all, so past its
    # n_local + TOPK - LOCAL written slots only -1 remains.
    out = OUT + head.to(tl.int64) * T * TOPK + (q_start + tok).to(tl.int64) * TOPK
    n_local = tl.minimum(own + 1, LOCAL)
    for j in tl.static_range(LOCAL):
        tl.store(out + j, own - j, mask=row_ok & (j < n_local))
    vals = tl.where(slot[None, :] < KEEP, vals, float("-inf"))
    for j in tl.static_range(TOPK - LOCAL):
        top = tl.max(vals, 1)
        first = tl.min(tl.where(vals == top[:, None], slot[None, :], KPAD), 1)
        pick = slot[None, :] == first[:, None]
        blk = tl.sum(tl.where(pick, ids, 0), 1)
        tl.store(out + n_local + j, tl.where(top > float("-inf"), blk, -1), mask=row_ok)
        vals = tl.where(pick, float("-inf"), vals)
    for j in tl.static_range(LOCAL):
        dst = TOPK - LOCAL + n_local + j
        tl.store(out + dst, -1, mask=row_ok & (dst < TOPK))


# ---------------------------------------------------------------------------------------------------------------
# Host side


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) need exact products to reproduce the reference's ranking; tf32 would round them.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tiles(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, num_tokens: int, tokens_per_tile: int):
    """Query tiles, longest key range first, built with torch ops (no host synchronisation).

    Returns `(tile_seq, tile_q0)` int32 [n_slots]: tile i covers queries tile_q0[i] .. + tokens_per_tile - 1 of
    sequence tile_seq[i] (clipped to the sequence); tile_q0 = -1 marks an unused slot. `n_slots = ceil(T / tokens)
    + B` bounds the number of tiles from shapes alone.
    """
    cu_q = cu_seqlens.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    num_seqs = cu_q.numel() - 1
    q_len = cu_q[1:] - cu_q[:-1]
    k_len = cu_k[1:] - cu_k[:-1]
    n_tiles = (q_len + tokens_per_tile - 1) // tokens_per_tile
    tile_end = torch.cumsum(n_tiles, 0)
    n_slots = -(-num_tokens // tokens_per_tile) + num_seqs
    i = torch.arange(n_slots, device=cu_q.device)
    seq = torch.searchsorted(tile_end, i, right=True)
    live = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    q0 = (i - (tile_end[seq] - n_tiles[seq])) * tokens_per_tile
    work = torch.where(live, (k_len - q_len)[seq] + q0, -1)  # keys the tile scans, minus a constant
    order = torch.argsort(work, descending=True)
    tile_q0 = torch.where(live, q0, -1)[order]
    return seq[order].to(torch.int32).contiguous(), tile_q0.to(torch.int32).contiguous()


def _select(qi: torch.Tensor, ki: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor,
            block_size: int, topk: int, local_blocks: int, launch: SelectLaunch | None = None,
            index_scale: float | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """block_idx; with `index_scale` given also the student normaliser fp32 [Hi, T] (`reference.index_lse`)."""
    t, heads, head_dim = qi.shape
    out = torch.empty((heads, t, topk), dtype=torch.int32, device=qi.device)
    lse = None if index_scale is None else torch.empty((heads, t), dtype=torch.float32, device=qi.device)
    if t == 0:
        return out if lse is None else (out, lse)
    if launch is None:
        launch = select_launch(heads, head_dim, block_size, qi.is_cuda)
    qi = qi.contiguous() if qi.stride(-1) != 1 else qi
    ki = ki.contiguous()
    tokens = launch.block_m // heads
    tile_seq, tile_q0 = _tiles(cu_seqlens, cu_seqlens_k, t, tokens)
    keep = max(topk - local_blocks, 1)
    if block_size >= launch.block_n:
        nb, sub = 1, block_size // launch.block_n
    else:
        nb, sub = launch.block_n // block_size, 1
    block_d = max(16, next_pow2(head_dim))
    use_tma = bool(launch.tma) and (ki.stride(0) * ki.element_size()) % 16 == 0 and ki.data_ptr() % 16 == 0
    ki_desc = TensorDescriptor.from_tensor(ki, [launch.block_n, block_d]) if use_tma else ki
    _select_kernel[(tile_seq.numel(),)](
        qi, ki, ki_desc, out, out if lse is None else lse, tile_seq, tile_q0, cu_seqlens, cu_seqlens_k,
        t, qi.stride(0), qi.stride(1), ki.stride(0), 1.0 if index_scale is None else float(index_scale),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TOPK=topk, KEEP=keep, KPAD=next_pow2(keep), LOCAL=local_blocks,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, NB=nb, SUB=sub, USE_TMA=use_tma,
        DOT_PRECISION=_dot_precision(qi.dtype), WITH_LSE=lse is not None, num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **({"maxnreg": launch.lse_maxnreg} if lse is not None and launch.lse_maxnreg and not interpreting() else {}),
    )
    return out if lse is None else (out, lse)


@torch.library.custom_op("openm3::msa_select_blocks", mutates_args=())
def _select_op(qi: torch.Tensor, ki: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
               block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    return _select(qi, ki, cu_seqlens, cu_k, block_size, topk, local_blocks)


@_select_op.register_fake
def _select_fake(qi, ki, cu_seqlens, cu_seqlens_k, block_size, topk, local_blocks):
    return qi.new_empty((qi.shape[1], qi.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("openm3::msa_select_blocks_lse", mutates_args=())
def _select_lse_op(qi: torch.Tensor, ki: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None,
                   block_size: int, topk: int, local_blocks: int, index_scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    return _select(qi, ki, cu_seqlens, cu_k, block_size, topk, local_blocks, index_scale=index_scale)


@_select_lse_op.register_fake
def _select_lse_fake(qi, ki, cu_seqlens, cu_seqlens_k, block_size, topk, local_blocks, index_scale):
    t, heads = qi.shape[0], qi.shape[1]
    return (qi.new_empty((heads, t, topk), dtype=torch.int32), qi.new_empty((heads, t), dtype=torch.float32))


def index_lse_on_the_way(launch: SelectLaunch, segments: Sequence[Segment]) -> bool:
    """Whether the selection computes the KL's student normaliser: `launch.index_lse`, where -1 means when the
    queries' sequences (`check_seqlens`' segments) hold at most `INDEX_LSE_MAX_KEYS` keys on average, weighted by
    queries."""
    if launch.index_lse >= 0:
        return bool(launch.index_lse)
    queries = sum(s.q_len for s in segments)
    return queries > 0 and sum(s.q_len * s.k_len for s in segments) <= INDEX_LSE_MAX_KEYS * queries


def select_blocks(qi: torch.Tensor, ki: torch.Tensor, cu_seqlens: torch.Tensor, *, block_size: int, topk: int,
                  local_blocks: int = 1, cu_seqlens_k: torch.Tensor | None = None,
                  index_scale: float | None = None, return_index_lse: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """Top-k key blocks per (index head, query), streamed on chip.

    Args:
        qi: [T, Hi, Di] index queries (fp16/bf16/fp32). ki: [Tk, Di] index keys, shared by all index heads.
        cu_seqlens: int32 [B + 1] query offsets; cu_seqlens_k: int32 [B + 1] key offsets (default cu_seqlens).
            Queries are the last q_len_b tokens of their sequence (bottom-right causal alignment).
        block_size: keys per block (a multiple of 16 or a power of two). topk: slots per query.
        local_blocks: forced blocks (own block and the ones before it), 0 <= local_blocks <= topk.
        index_scale: score scale (default 1/sqrt(Di)); a positive scale never changes the selection, so the kernel
            ranks unscaled scores (the scale only enters the log-sum-exp below).
        return_index_lse: also return the indexer KL's student normaliser (`reference.index_lse`, fp32 [Hi, T])
            when the launch config computes it on the way (`index_lse=1`), else None (the KL computes it).

    Returns:
        block_idx int32 [Hi, T, topk]: block numbers from each sequence's start; local blocks first (own, own - 1,
        ...), then the other causal blocks by descending max score, -1 in unused trailing slots. With
        return_index_lse, `(block_idx, index_lse or None)`.
    """
    check_index_inputs(qi, ki)
    check_triton_inputs(qi=qi, ki=ki)
    check_block_params(block_size=block_size, topk=topk, local_blocks=local_blocks)
    check_block_size(block_size, "the Triton selection kernel", small_powers=True)
    check_scale(index_scale, "index_scale")
    segments = check_seqlens(cu_seqlens, qi.shape[0], cu_seqlens_k, ki.shape[0], device=qi.device)
    if qi.dtype == torch.float64:
        raise ValueError("qi must be fp16, bf16 or fp32 for the Triton backend (use the reference for fp64)")
    if not return_index_lse:
        return _select_op(qi.detach(), ki.detach(), cu_seqlens, cu_seqlens_k, block_size, topk, local_blocks)
    if not index_lse_on_the_way(select_launch(qi.shape[1], qi.shape[2], block_size, qi.is_cuda), segments):
        return _select_op(qi.detach(), ki.detach(), cu_seqlens, cu_seqlens_k, block_size, topk, local_blocks), None
    scale = qi.shape[2] ** -0.5 if index_scale is None else float(index_scale)
    return _select_lse_op(qi.detach(), ki.detach(), cu_seqlens, cu_seqlens_k, block_size, topk, local_blocks, scale)
