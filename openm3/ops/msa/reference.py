"""MSA reference: the executable spec of DESIGN.md "MSA semantics", in PyTorch.

Layout (packed varlen, as FlashAttention's varlen API):
  q [T, Hq, D], k, v [Tk, Hkv, D]      main branch; query head h belongs to group g = h // (Hq // Hkv)
  qi [T, Hi, Di], ki [Tk, Di]          index branch; Hi == Hkv, index head g chooses blocks for KV head g
  cu_seqlens int32 [B + 1]             query offsets; cu_seqlens_k int32 [B + 1] key offsets (default: the same)
  block_idx int32 [Hi, T, topk]        selected key blocks, numbered from each sequence's start, -1 = unused

Causal alignment is bottom-right: the queries of sequence b are its last q_len_b tokens, so query i sits at
absolute position kv_len_b - q_len_b + i and sees keys 0..position (with cu_seqlens_k == cu_seqlens every query
sits at its own index). Key block j of a sequence holds keys [j * block_size, (j + 1) * block_size).

Everything is computed in fp32 (fp64 when the inputs are fp64, so `gradcheck` works). Memory is bounded by
working one chunk of queries (and, for dense scans, one tile of keys) at a time: no intermediate tensor is larger
than about `workspace` elements plus the inputs and outputs themselves, whatever the sequence length.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._checks import (Segment, check_attention_inputs, check_block_idx, check_block_params, check_index_inputs,
                      check_indexer_kl_inputs, check_scale, check_seqlens, check_workspace)

__all__ = ["select_blocks", "index_lse", "sparse_attention", "indexer_kl", "DEFAULT_WORKSPACE"]

DEFAULT_WORKSPACE = 1 << 22  # elements (16 MiB in fp32) per chunk intermediate
# Sparse attention's queries scan one key range shared by their chunk (masked to their blocks) while it holds at
# most this many times topk * block_size keys, and gather their own blocks' keys beyond. Copying each query's keys
# costs more than dots over keys it does not attend to, up to a point (CPU, m3-small's shape, one 8,000-token
# prefill: 162 s at 2, 93 s at 4, 99 s at 8; a 4,000-token one: 68.5 s at 1, 27-29 s at 2-4).
SHARED_RANGE_MAX = 4


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows_per_chunk(workspace: int, per_row: int) -> int:
    """Queries per chunk so that a `[chunk, per_row]` intermediate stays within `workspace` elements."""
    return max(1, workspace // max(1, per_row))


def _key_tile(workspace: int, block_size: int, key_len: int) -> int:
    """Keys per tile of a dense scan: about sqrt(workspace), a whole number of blocks, at most the sequence."""
    blocks = max(1, math.isqrt(workspace) // block_size)
    return block_size * min(blocks, max(1, -(-key_len // block_size)))


# --- key tiles ------------------------------------------------------------------------------------------------
# A tile is a set of key positions per (head, query): `pos [Hi, C or 1, S]` (int64, relative to the sequence's
# start, clamped to a valid index where unused) and `valid [Hi or 1, C, S]` (bool: selected and causal).
# Sparse tiles hold the selected blocks of each query; dense tiles hold a key range shared by the whole chunk.


def _sparse_tile(blocks: torch.Tensor, qpos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of the selected blocks. blocks: int32 [Hi, C, K]; qpos: [C] -> pos [Hi, C, K*bs], valid."""
    offs = torch.arange(block_size, device=blocks.device)
    pos = (blocks.long()[..., None] * block_size + offs).flatten(2)
    valid = (blocks[..., None] >= 0).expand(*blocks.shape, block_size).flatten(2) & (pos <= qpos[None, :, None])
    return pos.masked_fill(~valid, 0), valid


def _selected_range(blocks: torch.Tensor, qpos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys [0, qpos[-1]] as one range shared by the chunk, masked to each query's selected blocks: pos [Hi, 1,
    L] and valid [Hi, C, L]. The same key sets as `_sparse_tile` (blocks int32 [Hi, C, K]) without gathering each
    query's own copy of them: cheaper while L is a few times K * block_size at most (`SHARED_RANGE_MAX`)."""
    length = int(qpos[-1]) + 1
    num_blocks = -(-length // block_size)
    chosen = torch.zeros(*blocks.shape[:2], num_blocks + 1, dtype=torch.bool, device=blocks.device)
    chosen.scatter_(2, torch.where(blocks >= 0, blocks.long(), num_blocks), True)  # -1 slots land in a spare column
    pos = torch.arange(length, device=blocks.device)
    valid = chosen[:, :, pos // block_size] & (pos[None, None, :] <= qpos[None, :, None])
    return pos[None, None, :].expand(blocks.shape[0], 1, -1), valid


def _dense_tiles(qpos: torch.Tensor, num_heads: int, tile: int):
    """Key ranges [start, start + tile) covering every key causal for the chunk's queries qpos [C]."""
    last = int(qpos[-1])
    for start in range(0, last + 1, tile):
        pos = torch.arange(start, min(start + tile, last + 1), device=qpos.device)
        valid = pos[None, None, :] <= qpos[None, :, None]
        yield pos[None, None, :].expand(num_heads, 1, -1), valid


def _gather(x_t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x_t [Hi, L, D] (per-head rows) or [1, L, D] (shared rows) at pos [Hi, C, S] -> [Hi, C, S, D]."""
    heads = torch.arange(pos.shape[0], device=pos.device)[:, None, None]
    return x_t[heads if x_t.shape[0] > 1 else 0, pos]


def _masked_lse(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of s where valid; -inf for rows with nothing valid."""
    return s.masked_fill(~valid, -math.inf).logsumexp(-1)


def _probs(s: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) where valid, 0 elsewhere (also for empty rows whose lse is -inf)."""
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.where(valid, (s - safe[..., None]).exp(), torch.zeros_like(s))


# --- select ---------------------------------------------------------------------------------------------------


@torch.no_grad()  # integer output; no graph should hold every chunk's score tiles
def select_blocks(qi, ki, cu_seqlens, *, block_size: int, topk: int, local_blocks: int = 1, cu_seqlens_k=None,
                  index_scale: float | None = None, workspace: int = DEFAULT_WORKSPACE) -> torch.Tensor:
    """Top-k key blocks per (index head, query).

    Args:
        qi: [T, Hi, Di] index queries. ki: [Tk, Di] index keys (one head shared by all index heads).
        cu_seqlens: int32 [B + 1] query offsets; cu_seqlens_k: int32 [B + 1] key offsets (default cu_seqlens).
        block_size: keys per block. topk: slots per query. local_blocks: 0 <= local_blocks <= topk.
        index_scale: score scale (default 1/sqrt(Di)); a positive scale never changes the selection.
        workspace: elements allowed per chunk intermediate (bounds memory, not the result).

    Returns:
        block_idx int32 [Hi, T, topk]. Score s[g, t, j] = qi[t, g] . ki[j] * index_scale over causal keys j;
        a block's score is the max over its causal keys. Order of the slots: first the forced local blocks
        (own block, then own - 1, ... down to own - local_blocks + 1, those >= 0), then the other causal blocks
        by descending score; -1 fills the trailing slots when fewer blocks exist. Ties break arbitrarily.
    """
    hi, di = check_index_inputs(qi, ki)
    check_block_params(block_size=block_size, topk=topk, local_blocks=local_blocks)
    check_scale(index_scale, "index_scale")
    check_workspace(workspace)
    segments = check_seqlens(cu_seqlens, qi.shape[0], cu_seqlens_k, ki.shape[0], device=qi.device)
    cdt = _compute_dtype(qi)
    index_scale = di ** -0.5 if index_scale is None else float(index_scale)

    out = torch.full((hi, qi.shape[0], topk), -1, dtype=torch.int32, device=qi.device)
    for seg in segments:
        if seg.q_len == 0:
            continue
        q_t = qi[seg.q_start:seg.q_start + seg.q_len].to(cdt).transpose(0, 1)  # [Hi, Lq, Di]
        k_t = ki[seg.k_start:seg.k_start + seg.k_len].to(cdt)[None]  # [1, Lk, Di]
        tile = _key_tile(workspace, block_size, seg.k_len)
        num_blocks = -(-seg.k_len // block_size)
        rows = _rows_per_chunk(workspace, hi * max(tile, num_blocks + 2 * topk))
        for c0 in range(0, seg.q_len, rows):
            c1 = min(c0 + rows, seg.q_len)
            qpos = torch.arange(seg.offset + c0, seg.offset + c1, device=qi.device)
            scores = _block_scores(q_t[:, c0:c1], k_t, qpos, block_size, tile, index_scale)
            out[:, seg.q_start + c0:seg.q_start + c1] = _top_blocks(scores, qpos // block_size, topk, local_blocks)
    return out


def _block_scores(q_c: torch.Tensor, k_t: torch.Tensor, qpos: torch.Tensor, block_size: int, tile: int,
                  index_scale: float) -> torch.Tensor:
    """Max causal score per key block. q_c [Hi, C, Di], k_t [1, Lk, Di] -> [Hi, C, nb] (-inf: no causal key),
    nb = number of blocks that hold a key causal for the chunk's last query."""
    hi, c = q_c.shape[:2]
    nb = int(qpos[-1]) // block_size + 1
    first = int(qpos[0])
    scores = q_c.new_full((hi, c, nb), -math.inf)
    for pos, valid in _dense_tiles(qpos, hi, tile):
        s = (q_c @ k_t[0, pos[0, 0]].T) * index_scale  # [Hi, C, S]
        if int(pos[0, 0, -1]) > first:  # only tiles crossing the diagonal hold future keys
            s = s.masked_fill(~valid, -math.inf)
        pad = (-s.shape[-1]) % block_size
        if pad:
            s = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
        b0 = int(pos[0, 0, 0]) // block_size
        scores[..., b0:b0 + s.shape[-1] // block_size] = s.unflatten(-1, (-1, block_size)).amax(-1)
    return scores


def _top_blocks(scores: torch.Tensor, own: torch.Tensor, topk: int, local_blocks: int) -> torch.Tensor:
    """scores [Hi, C, nb], own block per query [C] -> int32 [Hi, C, topk] (locals first, then by score)."""
    hi, c, nb = scores.shape
    local = own[:, None] - torch.arange(local_blocks, device=own.device)  # [C, L]; < 0 means no such block
    local = local.expand(hi, c, local_blocks)
    scores = scores.scatter(-1, local.clamp(min=0), -math.inf)  # forced blocks do not compete for the others
    top_s, top_i = scores.topk(min(topk, nb), dim=-1)  # sorted, descending
    top_i = top_i.masked_fill(top_s == -math.inf, -1)
    cand = torch.cat([local.masked_fill(local < 0, -1), top_i], dim=-1)
    # Left-pack the valid entries, keeping their order (a stable sort on "is unused").
    order = (cand < 0).to(torch.int8).argsort(dim=-1, stable=True)
    cand = cand.gather(-1, order)[..., :topk]
    if cand.shape[-1] < topk:
        cand = torch.nn.functional.pad(cand, (0, topk - cand.shape[-1]), value=-1)
    return cand.to(torch.int32)


@torch.no_grad()
def index_lse(qi, ki, block_idx, cu_seqlens, *, block_size: int, index_scale: float | None = None,
              cu_seqlens_k=None, workspace: int = DEFAULT_WORKSPACE) -> torch.Tensor:
    """The indexer KL's student normaliser: fp32 [Hi, T], at (g, t) the log-sum-exp over the selected causal keys j
    of (g, t) (block_idx as `select_blocks` returns it) of qi[t, g] . ki[j] * index_scale; -inf for an empty key
    set. `indexer_kl(..., index_lse=)` takes it instead of computing it (the selection kernel can produce it on
    the way, from scores it has on chip)."""
    hi, di = check_index_inputs(qi, ki)
    check_block_params(block_size=block_size)
    check_scale(index_scale, "index_scale")
    check_workspace(workspace)
    segments = check_seqlens(cu_seqlens, qi.shape[0], cu_seqlens_k, ki.shape[0], device=qi.device)
    check_block_idx(block_idx, num_heads=hi, segments=segments, block_size=block_size)
    cdt = _compute_dtype(qi)
    index_scale = di ** -0.5 if index_scale is None else float(index_scale)
    out = torch.full((hi, qi.shape[0]), -math.inf, dtype=torch.float32, device=qi.device)
    for seg in segments:
        if seg.q_len == 0:
            continue
        k_t = ki[seg.k_start:seg.k_start + seg.k_len].to(cdt)[None]
        rows = _rows_per_chunk(workspace, hi * block_idx.shape[-1] * block_size * di)
        for c0 in range(0, seg.q_len, rows):
            c1 = min(c0 + rows, seg.q_len)
            sl = slice(seg.q_start + c0, seg.q_start + c1)
            qpos = torch.arange(seg.offset + c0, seg.offset + c1, device=qi.device)
            pos, valid = _sparse_tile(block_idx[:, sl], qpos, block_size)
            z = (qi[sl].to(cdt).transpose(0, 1)[:, :, None, :] @ _gather(k_t, pos).transpose(-1, -2)).squeeze(-2)
            out[:, sl] = _masked_lse(z * index_scale, valid).float()
    return out


# --- sparse attention ---------------------------------------------------------------------------------------


def sparse_attention(q, k, v, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
                     cu_seqlens_k=None, workspace: int = DEFAULT_WORKSPACE,
                     validate_block_idx: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention over the keys of the selected blocks.

    Args:
        q: [T, Hq, D]; k, v: [Tk, Hkv, D]; block_idx: int32 [Hi = Hkv, T, topk] (see `select_blocks`; each valid
            block once, -1 only in trailing slots, only causally visible blocks).
        cu_seqlens / cu_seqlens_k: int32 [B + 1]. scale: default 1/sqrt(D).
        workspace: elements allowed per chunk intermediate.
        validate_block_idx: False skips the value checks of block_idx (host syncs) for indices straight from
            `select_blocks`; its shape and dtype are still checked.

    Returns:
        o [T, Hq, D] in q.dtype and lse fp32 [T, Hq] (natural-log sum-exp of the scaled scores). Query t, head h
        attends to keys j <= position(t) inside the blocks block_idx[h // (Hq // Hkv), t]. A query with no
        selected block gets o = 0, lse = -inf. Differentiable in q, k, v through an explicit FlashAttention-style
        backward; lse is not differentiable.
    """
    hq, hkv, d = check_attention_inputs(q, k, v)
    check_block_params(block_size=block_size)
    check_scale(scale)
    check_workspace(workspace)
    segments = check_seqlens(cu_seqlens, q.shape[0], cu_seqlens_k, k.shape[0], device=q.device)
    if block_idx is None:
        raise ValueError("block_idx must be an int32 tensor of shape [Hi, T, topk], got None")
    if block_idx.device != q.device:
        raise ValueError(f"block_idx must be on q's device {q.device}, got {block_idx.device}")
    check_block_idx(block_idx, num_heads=hkv, segments=segments, block_size=block_size, values=validate_block_idx)
    scale = d ** -0.5 if scale is None else float(scale)
    return _SparseAttention.apply(q, k, v, block_idx, segments, block_size, scale, workspace)


class _NoSecondDerivative(torch.autograd.Function):
    """`count` gradients that a reference backward computed, passed through unchanged but tied to the tensors they
    depend on (the op's inputs, the incoming gradients), so that differentiating them again raises instead of
    coming out wrong: the backwards' formulas use the forward's saved o / lse as constants."""

    @staticmethod
    def forward(ctx, op: str, count: int, *tensors):
        ctx.op = op
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"{ctx.op}: its gradient cannot be differentiated again (a second derivative, "
                           f"create_graph=True): the reference's backward treats the forward's softmax statistics "
                           f"as constants, and the Triton kernels have no double backward either")


def _first_order(op: str):
    """A Function's backward decorator: the backward runs without building a graph and, under create_graph,
    returns its gradients through `_NoSecondDerivative` tied to the incoming gradients and to the saved tensors
    the backward leaves in `ctx.unpacked` (saved tensors may be unpacked once only, under activation
    checkpointing). Not `torch.autograd.function.once_differentiable`, whose error node hangs off detached
    copies: the engine never reaches it, so a second derivative through the op came out as 0 or as an "unused
    tensor" error."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                out = backward(ctx, *grads)
            unpacked = ctx.__dict__.pop("unpacked", ())
            deps = [t for t in (*unpacked, *grads) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not torch.is_grad_enabled() or not deps:
                return out
            present = [g for g in out if g is not None]
            tied = iter(_NoSecondDerivative.apply(op, len(present), *present, *deps))
            return tuple(None if g is None else next(tied) for g in out)
        return wrapper
    return decorate


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_idx, segments, block_size, scale, workspace):
        cdt = _compute_dtype(q)
        o = q.new_zeros(q.shape, dtype=cdt)
        lse = q.new_full(q.shape[:2], -math.inf, dtype=cdt)
        for c in _attention_chunks(q, k, v, block_idx, segments, block_size, workspace):
            s = _matmul(c.q, c.k.transpose(-1, -2)) * scale  # [Hi, C, G, S] (S = L for a shared range)
            lse_c = _masked_lse(s, c.valid[:, :, None])  # [Hi, C, G]
            p = _probs(s, lse_c, c.valid[:, :, None])
            o[c.rows] = _matmul(p, c.v).permute(1, 0, 2, 3).flatten(1, 2)
            lse[c.rows] = lse_c.permute(1, 0, 2).flatten(1)
        ctx.save_for_backward(q, k, v, block_idx, o, lse)
        ctx.meta = (segments, block_size, scale, workspace)
        lse_out = lse.float()
        ctx.mark_non_differentiable(lse_out)
        return o.to(q.dtype), lse_out

    @staticmethod
    @_first_order("sparse_attention")
    def backward(ctx, do, _dlse):
        q, k, v, block_idx, o, lse = ctx.unpacked = ctx.saved_tensors
        segments, block_size, scale, workspace = ctx.meta
        cdt = o.dtype
        dq = torch.zeros_like(o)
        dk_t = k.new_zeros((k.shape[1], k.shape[0], k.shape[2]), dtype=cdt)  # [Hkv, Tk, D]
        dv_t = torch.zeros_like(dk_t)
        do = do.to(cdt)
        for c in _attention_chunks(q, k, v, block_idx, segments, block_size, workspace):
            do_c = _heads_first(do[c.rows], c.q.shape[0])  # [Hi, C, G, D]
            o_c = _heads_first(o[c.rows], c.q.shape[0])
            lse_c = lse[c.rows].unflatten(1, (c.q.shape[0], -1)).transpose(0, 1)  # [Hi, C, G]
            s = _matmul(c.q, c.k.transpose(-1, -2)) * scale
            p = _probs(s, lse_c, c.valid[:, :, None])  # [Hi, C, G, S]
            dp = _matmul(do_c, c.v.transpose(-1, -2))
            ds = p * (dp - (do_c * o_c).sum(-1, keepdim=True)) * scale
            dq[c.rows] = _matmul(ds, c.k).permute(1, 0, 2, 3).flatten(1, 2)
            if c.shared:  # one key range for the whole chunk: p and ds are 0 off each query's blocks
                keys = slice(c.k_start, c.k_start + c.pos.shape[-1])
                dk_t[:, keys] += torch.einsum("hcgs,hcgd->hsd", ds, c.q)
                dv_t[:, keys] += torch.einsum("hcgs,hcgd->hsd", p, do_c)
                continue
            dk_c = ds.transpose(-1, -2) @ c.q  # [Hi, C, S, D]
            dv_c = p.transpose(-1, -2) @ do_c
            keep = c.valid[..., None]
            heads = torch.arange(c.q.shape[0], device=q.device)[:, None, None]
            dk_t.index_put_((heads, c.pos + c.k_start), torch.where(keep, dk_c, 0.0), accumulate=True)
            dv_t.index_put_((heads, c.pos + c.k_start), torch.where(keep, dv_c, 0.0), accumulate=True)
        dk = dk_t.transpose(0, 1).to(k.dtype)
        dv = dv_t.transpose(0, 1).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Hi, C, G, X] @ b [Hi, C or 1, X, Y] -> [Hi, C, G, Y]; a b shared by the chunk's queries (C = 1) as one
    matmul per head (broadcasting would copy it for every query)."""
    if b.shape[1] == 1 and a.shape[1] > 1:
        return (a.flatten(1, 2) @ b[:, 0]).unflatten(1, a.shape[1:3])
    return a @ b


def _heads_first(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[C, Hq, D] -> [Hi, C, G, D] (query head h = g * G + j)."""
    return x.unflatten(1, (num_groups, -1)).transpose(0, 1)


@dataclass
class _Chunk:
    """One query chunk of one sequence with its gathered keys, in the compute dtype."""

    rows: slice  # the chunk's queries in the packed [T] axis
    q: torch.Tensor  # [Hi, C, G, D]
    k: torch.Tensor  # [Hi, C, S, D] keys of the selected blocks, or [Hi, 1, L, D]: the shared range [0, L)
    v: torch.Tensor  # [Hi, C, S, D] or [Hi, 1, L, D]
    pos: torch.Tensor  # [Hi, C, S] key positions relative to k_start (0 where not valid), or [Hi, 1, L]
    valid: torch.Tensor  # [Hi, C, S or L] selected and causal
    k_start: int  # the sequence's first key in the packed [Tk] axis
    shared: bool  # k, v, pos: one key range for the whole chunk


def _attention_chunks(q, k, v, block_idx, segments: list[Segment], block_size: int, workspace: int):
    """Yield one `_Chunk` per query chunk of every sequence; S = topk * block_size. Queries at positions below
    SHARED_RANGE_MAX * S scan their causal keys as one range shared by the chunk, masked to each query's blocks
    (`_selected_range`); the later ones gather each query's selected blocks (`_sparse_tile`). The key sets, and so
    the results, are the same."""
    cdt = _compute_dtype(q)
    hkv, topk, d = k.shape[1], block_idx.shape[-1], q.shape[-1]
    groups = q.shape[1] // hkv
    span = topk * block_size
    shared_rows = _rows_per_chunk(workspace, hkv * SHARED_RANGE_MAX * span * groups)  # [Hi, C, G, L] scores
    sparse_rows = _rows_per_chunk(workspace, hkv * span * max(d, groups))  # and [Hi, C, S, D] gathered keys
    for seg in segments:
        k_t = k[seg.k_start:seg.k_start + seg.k_len].transpose(0, 1)  # [Hkv, Lk, D]
        v_t = v[seg.k_start:seg.k_start + seg.k_len].transpose(0, 1)
        for c0, c1, shared in _query_chunks(seg, span, shared_rows, sparse_rows):
            rows = slice(seg.q_start + c0, seg.q_start + c1)
            qpos = torch.arange(seg.offset + c0, seg.offset + c1, device=q.device)
            if shared:
                pos, valid = _selected_range(block_idx[:, rows], qpos, block_size)
                keys, values = (x[:, None, :pos.shape[-1]].to(cdt) for x in (k_t, v_t))
            else:
                pos, valid = _sparse_tile(block_idx[:, rows], qpos, block_size)
                keys, values = _gather(k_t, pos).to(cdt), _gather(v_t, pos).to(cdt)
            yield _Chunk(rows, _heads_first(q[rows].to(cdt), hkv), keys, values, pos, valid, seg.k_start, shared)


def _query_chunks(seg: Segment, span: int, shared_rows: int, rows: int):
    """(c0, c1, shared) over a sequence's queries: chunks of `shared_rows` while their positions stay below
    SHARED_RANGE_MAX * span (scanned as a shared key range), then chunks of `rows` (gathering their own keys); a
    span of 0: only the latter."""
    boundary = min(max(SHARED_RANGE_MAX * span - seg.offset, 0), seg.q_len)
    c0 = 0
    while c0 < seg.q_len:
        shared = c0 < boundary
        c1 = min(c0 + shared_rows, boundary) if shared else min(c0 + rows, seg.q_len)
        yield c0, c1, shared
        c0 = c1


# --- indexer KL ---------------------------------------------------------------------------------------------


def indexer_kl(q, k, qi, ki, block_idx, cu_seqlens, *, block_size: int, scale: float | None = None,
               index_scale: float | None = None, lse: torch.Tensor | None = None, cu_seqlens_k=None,
               workspace: int = DEFAULT_WORKSPACE, validate_block_idx: bool = True,
               index_lse: torch.Tensor | None = None) -> torch.Tensor:
    """KL(main attention || index distribution), the loss that trains the index branch.

    Args:
        q: [T, Hq, D], k: [Tk, Hkv, D] main-branch queries and keys (treated as constants: no gradient).
        qi: [T, Hi, Di], ki: [Tk, Di] index queries and keys (Hi == Hkv); gradients flow into these only.
        block_idx: int32 [Hi, T, topk] selected blocks, or None for the dense warm-up (all causal keys).
        cu_seqlens / cu_seqlens_k: int32 [B + 1]. scale: main scale (default 1/sqrt(D)); index_scale: default
            1/sqrt(Di). lse: optional fp32 [T, Hq] from `sparse_attention` over the same keys; used as the
            teacher's normaliser instead of recomputing it.
        workspace: elements allowed per chunk intermediate.
        validate_block_idx: as in `sparse_attention`.
        index_lse: optional fp32 [Hi, T], `index_lse(qi, ki, block_idx, ...)` of the same inputs (the student's
            normaliser, which a fast backend may take from the selection instead of a pass of its own); checked
            here, and recomputed.

    Returns:
        Scalar loss (compute dtype): mean over (index head g, query t) of KL(p || r) = sum_j p_j (log p_j - log r_j)
        where, over the key set of (g, t) (its selected causal keys, or all causal keys),
        p = mean over the heads of group g of softmax(q[t, h] . k[j, g] * scale) and
        r = softmax(qi[t, g] . ki[j] * index_scale). Queries with an empty key set contribute 0.
    """
    _, _, d, di, segments = check_indexer_kl_inputs(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse,
                                                    block_size=block_size, scale=scale, index_scale=index_scale,
                                                    block_idx_values=validate_block_idx, index_lse=index_lse)
    check_workspace(workspace)
    scale = d ** -0.5 if scale is None else float(scale)
    index_scale = di ** -0.5 if index_scale is None else float(index_scale)
    cfg = _KLConfig(segments, block_size, scale, index_scale, workspace)
    return _IndexerKL.apply(qi, ki, q.detach(), k.detach(), block_idx,
                            None if lse is None else lse.detach(), cfg)


@dataclass(frozen=True)
class _KLConfig:
    segments: list[Segment]
    block_size: int
    scale: float
    index_scale: float
    workspace: int


@dataclass
class _KLChunk:
    """One query chunk of one sequence, in the compute dtype."""

    rows: slice  # the chunk's queries in the packed [T] axis
    k_start: int  # the sequence's first key in the packed [Tk] axis
    qpos: torch.Tensor  # [C] absolute query positions
    q: torch.Tensor  # [Hi, C, G, D]
    qi: torch.Tensor  # [Hi, C, Di]
    k_t: torch.Tensor  # [Hkv, Lk, D] the sequence's keys
    ki_t: torch.Tensor  # [1, Lk, Di] the sequence's index keys
    shared: bool  # selected blocks scanned as one key range shared by the chunk (as in `_attention_chunks`)


def _kl_chunks(q, k, qi, ki, block_idx, cfg: _KLConfig):
    cdt = _compute_dtype(qi)
    hkv, d, di = k.shape[1], q.shape[-1], qi.shape[-1]
    groups = q.shape[1] // hkv
    for seg in cfg.segments:
        if seg.q_len == 0:
            continue
        k_t = k[seg.k_start:seg.k_start + seg.k_len].transpose(0, 1).to(cdt)
        ki_t = ki[seg.k_start:seg.k_start + seg.k_len].to(cdt)[None]
        span, shared_rows = 0, 1  # the dense warm-up scans key tiles, not selected blocks
        if block_idx is None:
            tile = _key_tile(cfg.workspace, cfg.block_size, seg.k_len)
            per_row = hkv * tile * groups
        else:
            span = block_idx.shape[-1] * cfg.block_size
            per_row = hkv * span * max(d, di, groups)
            shared_rows = _rows_per_chunk(cfg.workspace, hkv * SHARED_RANGE_MAX * span * groups)
        rows_per_chunk = _rows_per_chunk(cfg.workspace, per_row)
        for c0, c1, shared in _query_chunks(seg, span, shared_rows, rows_per_chunk):
            rows = slice(seg.q_start + c0, seg.q_start + c1)
            qpos = torch.arange(seg.offset + c0, seg.offset + c1, device=q.device)
            yield _KLChunk(rows, seg.k_start, qpos, _heads_first(q[rows].to(cdt), hkv),
                           qi[rows].to(cdt).transpose(0, 1), k_t, ki_t, shared)


def _kl_tiles(c: _KLChunk, block_idx, cfg: _KLConfig):
    """Key tiles of a chunk: the selected blocks (one tile: gathered, or a shared range masked to them) or dense key
    ranges."""
    if block_idx is not None:
        tile = _selected_range if c.shared else _sparse_tile
        yield tile(block_idx[:, c.rows], c.qpos, cfg.block_size)
    else:
        tile = _key_tile(cfg.workspace, cfg.block_size, c.k_t.shape[1])
        yield from _dense_tiles(c.qpos, c.q.shape[0], tile)


def _kl_logits(c: _KLChunk, pos, cfg: _KLConfig):
    """Teacher logits [Hi, C, G, S] and student logits [Hi, C, S] of one tile, plus the gathered index keys."""
    kg = _gather(c.k_t, pos)  # [Hi, C or 1, S, D]
    kig = _gather(c.ki_t, pos)  # [Hi, C or 1, S, Di]
    a = _matmul(c.q, kg.transpose(-1, -2)) * cfg.scale
    z = _matmul(c.qi[:, :, None, :], kig.transpose(-1, -2)).squeeze(-2) * cfg.index_scale
    return a, z, kig


def _kl_normalisers(c: _KLChunk, block_idx, cfg: _KLConfig, need_teacher: bool):
    """Teacher lse [Hi, C, G] (None unless need_teacher) and student lse [Hi, C] over the chunk's key sets."""
    hi, n, g = c.q.shape[:3]
    lse_a = c.q.new_full((hi, n, g), -math.inf) if need_teacher else None
    lse_z = c.q.new_full((hi, n), -math.inf)
    for pos, valid in _kl_tiles(c, block_idx, cfg):
        a, z, _ = _kl_logits(c, pos, cfg)
        if need_teacher:
            lse_a = torch.logaddexp(lse_a, _masked_lse(a, valid[:, :, None]))
        lse_z = torch.logaddexp(lse_z, _masked_lse(z, valid))
    return lse_a, lse_z


def _teacher_student(c, pos, valid, lse_a, lse_z, cfg):
    """p, r [Hi, C, S] (0 outside the key set) and the student's log r and gathered index keys."""
    a, z, kig = _kl_logits(c, pos, cfg)
    valid = valid.expand(z.shape)
    p = _probs(a, lse_a, valid[:, :, None]).mean(2)
    r = _probs(z, lse_z, valid)
    log_r = torch.where(valid, z - torch.where(torch.isfinite(lse_z), lse_z, 0.0)[..., None], 0.0)
    return p, r, log_r, kig


class _IndexerKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qi, ki, q, k, block_idx, lse, cfg: _KLConfig):
        cdt = _compute_dtype(qi)
        total = qi.new_zeros((), dtype=cdt)
        lse_a_all = q.new_full(q.shape[:2], -math.inf, dtype=cdt)  # [T, Hq]
        lse_z_all = qi.new_full(qi.shape[:2], -math.inf, dtype=cdt)  # [T, Hi]
        for c in _kl_chunks(q, k, qi, ki, block_idx, cfg):
            lse_a, lse_z = _kl_normalisers(c, block_idx, cfg, need_teacher=lse is None)
            if lse is not None:
                lse_a = lse[c.rows].to(cdt).unflatten(1, (c.q.shape[0], -1)).transpose(0, 1)
            lse_a_all[c.rows] = lse_a.transpose(0, 1).flatten(1)
            lse_z_all[c.rows] = lse_z.transpose(0, 1)
            for pos, valid in _kl_tiles(c, block_idx, cfg):
                p, _, log_r, _ = _teacher_student(c, pos, valid, lse_a, lse_z, cfg)
                total = total + (torch.special.xlogy(p, p) - p * log_r).sum()
        count = qi.shape[0] * qi.shape[1]
        ctx.save_for_backward(qi, ki, q, k, block_idx, lse_a_all, lse_z_all)
        ctx.cfg = cfg
        return total / max(count, 1)

    @staticmethod
    @_first_order("indexer_kl")
    def backward(ctx, grad):
        qi, ki, q, k, block_idx, lse_a_all, lse_z_all = ctx.unpacked = ctx.saved_tensors
        cfg = ctx.cfg
        cdt = lse_z_all.dtype
        dqi = qi.new_zeros(qi.shape, dtype=cdt)
        dki = ki.new_zeros(ki.shape, dtype=cdt)
        # d KL / d z_j = r_j - p_j (p sums to 1 over the key set); z = qi . ki * index_scale.
        coef = grad.to(cdt) * cfg.index_scale / max(qi.shape[0] * qi.shape[1], 1)
        for c in _kl_chunks(q, k, qi, ki, block_idx, cfg):
            lse_a = lse_a_all[c.rows].unflatten(1, (c.q.shape[0], -1)).transpose(0, 1)
            lse_z = lse_z_all[c.rows].transpose(0, 1)
            dqi_c = torch.zeros_like(c.qi)
            for pos, valid in _kl_tiles(c, block_idx, cfg):
                p, r, _, kig = _teacher_student(c, pos, valid, lse_a, lse_z, cfg)
                dz = (r - p) * coef  # [Hi, C, S]
                dqi_c += _matmul(dz[:, :, None, :], kig).squeeze(-2)
                if block_idx is None or c.shared:  # keys shared by the whole chunk (dz is 0 off each key set)
                    dki[c.k_start + pos[0, 0]] += (dz.transpose(-1, -2) @ c.qi).sum(0)
                else:
                    dki.index_put_((c.k_start + pos,), dz[..., None] * c.qi[:, :, None, :], accumulate=True)
            dqi[c.rows] = dqi_c.transpose(0, 1)
        return dqi.to(qi.dtype), dki.to(ki.dtype), None, None, None, None, None
