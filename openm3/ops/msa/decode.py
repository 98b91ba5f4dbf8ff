"""MSA over a paged KV / index-key cache: the reference path (the spec the Triton decode kernels must match).

Cache layout (one pool per layer, pages of `block_size` tokens, so one page is one MSA key block):

- `k_pages, v_pages [P, block_size, Hkv, D]`: the main-branch keys and values.
- `ki_pages [P, block_size, Di]`: the index keys, in the model dtype, bf16, or fp8 (e4m3) with
  `ki_scale [P, block_size]` holding one dequantisation scale per token (`ki = ki_pages * scale`): uint8 e8m0
  (the biased exponent e of the power of two `2^(e - 127)`, one byte per token, what the engine's cache stores)
  or fp32.
- `block_table int32 [B, max_blocks]`: page id of logical block j of sequence b (entries past the sequence's
  last block are ignored).
- `seq_lens [B]`: cached tokens per sequence, the new tokens included (they are written before attending).

Queries are packed varlen `q [Tq, Hq, D]`, `qi [Tq, Hi, Di]` with `cu_seqlens_q int32 [B+1]`: the queries of
sequence b are its LAST `q_len_b` tokens (bottom-right causal alignment), so query i of sequence b sits at
absolute position `seq_lens[b] - q_len_b + i`. Block ids are counted from each sequence's start.

Each function here gathers the pages of every sequence into packed contiguous tensors and calls the functions of
`openm3.ops.msa.reference` with `cu_seqlens_k`; it is slow on purpose and exact by construction.
"""

from __future__ import annotations

import torch

from ..fused import fused_on_cuda
from ..host import check_not_meta
from . import reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_E8M0 = torch.uint8  # a per-token scale 2^(e - 127) stored as its biased exponent e
SCALE_DTYPES = (SCALE_E8M0, torch.float32)


def quantize_index_keys(ki: torch.Tensor, scale_dtype: torch.dtype = SCALE_E8M0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 index keys with one scale per token.

    ki: [T, Di] (any float dtype). Returns (ki_fp8 [T, Di] float8_e4m3fn, scale [T]) such that
    `dequantize_index_keys(ki_fp8, scale)` approximates `ki`. scale_dtype uint8 (e8m0, the default): the smallest
    power of two that maps the token's largest entry to at most 448, stored as its biased exponent (1 byte per
    token instead of 4); e4m3 is a float format, so a power-of-two scale keeps its relative precision (3 mantissa
    bits) and only shifts where its subnormals start. float32: the token's largest entry maps to 448 exactly.
    """
    if ki.dim() != 2:
        raise ValueError(f"ki must be [T, Di], got shape {tuple(ki.shape)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}")
    if scale_dtype == torch.float32:
        amax = ki.detach().float().abs().amax(dim=-1).clamp_min(1e-30)
        scale = amax / FP8_MAX
        q = (ki.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    return _quantize_e8m0(ki.detach())


@fused_on_cuda(grad=False)
def _quantize_e8m0(ki: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_index_keys` with e8m0 scales, in integer and float ops that fuse (one kernel on CUDA where the
    written-out ops were ~17: a decode step writes every MSA layer's new index keys)."""
    amax = ki.float().abs().amax(dim=-1).clamp_min(1e-30)
    bits = (amax / FP8_MAX).view(torch.int32)  # r = amax / 448, a normal fp32 (amax >= 1e-30)
    # frexp(r)'s exponent ((bits >> 23) - 126), one less when r is a power of two: the smallest e with 2^e >= r
    e = (((bits >> 23) & 0xFF) - 126 - ((bits & 0x7FFFFF) == 0).to(torch.int32)).clamp(-126, 127)
    # 2^-e exactly (e <= 120 for any finite fp32 amax, so the power is a normal number): exact scaling
    inv = ((127 - e) << 23).view(torch.float32)
    q = (ki.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, (e + 127).to(torch.uint8)


def index_key_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 per-token scales from their stored form (uint8 e8m0 exponents or fp32)."""
    if scale.dtype == SCALE_E8M0:
        return (scale.to(torch.int32) << 23).view(torch.float32)  # 2^(e - 127) for e in [1, 254]
    return scale.float()


def dequantize_index_keys(ki: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 index keys from a cache slice: ki [..., Di], scale [...] (None when ki is not fp8)."""
    if scale is None:
        return ki.float()
    return ki.float() * index_key_scales(scale)[..., None]


def _lengths(name: str, x, batch: int) -> list[int]:
    if torch.is_tensor(x):
        check_not_meta(x, name)
    values = x.tolist() if torch.is_tensor(x) else list(x)
    if len(values) != batch:
        raise ValueError(f"{name} must have one entry per sequence ({batch}), got {len(values)}")
    return [int(n) for n in values]


def _check_paged(block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens, block_size: int,
                 num_pages: int) -> tuple[list[int], list[int]]:
    """Validates the paging arguments; returns host lists (q_lens, seq_lens)."""
    check_not_meta(block_table, "block_table")
    check_not_meta(cu_seqlens_q, "cu_seqlens_q")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [B, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() != block_table.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must be [B+1] = [{block_table.shape[0] + 1}], got {tuple(cu_seqlens_q.shape)}")
    batch = block_table.shape[0]
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    q_lens = [cu[b + 1] - cu[b] for b in range(batch)]
    lens = _lengths("seq_lens", seq_lens, batch)
    table = block_table.tolist()
    for b in range(batch):
        if q_lens[b] < 0 or q_lens[b] > lens[b]:
            raise ValueError(f"cu_seqlens_q: sequence {b} has {q_lens[b]} queries but seq_lens[{b}] = {lens[b]} keys")
        nblocks = -(-lens[b] // block_size)
        if nblocks > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns, sequence {b} needs {nblocks}")
        pages = table[b][:nblocks]
        if any(p < 0 or p >= num_pages for p in pages):
            raise ValueError(f"block_table row {b} holds page ids outside [0, {num_pages}): {pages}")
    return q_lens, lens


def gather_pages(pages: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int], block_size: int) -> torch.Tensor:
    """Packs the cached tokens of every sequence: pages [P, block_size, ...] -> [sum(seq_lens), ...]."""
    parts = []
    for b, n in enumerate(seq_lens):
        nblocks = -(-n // block_size)
        ids = block_table[b, :nblocks].long()
        parts.append(pages.index_select(0, ids).flatten(0, 1)[:n])
    return torch.cat(parts, dim=0)


def _cu(lengths: list[int], device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lengths, dtype=torch.int32, device=device).cumsum(0)
    return out


def paged_select_blocks(qi: torch.Tensor, ki_pages: torch.Tensor, block_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens, *, block_size: int, topk: int, local_blocks: int = 1,
                        ki_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k key blocks of each new query against the cached index keys.

    qi: [Tq, Hi, Di]; ki_pages: [P, block_size, Di] (fp8 needs ki_scale [P, block_size]);
    block_table int32 [B, max_blocks]; cu_seqlens_q int32 [B+1]; seq_lens [B] (ints or a tensor).
    Returns block_idx int32 [Hi, Tq, topk] exactly as `reference.select_blocks` with `cu_seqlens_k`.
    """
    if ki_pages.dim() != 3 or ki_pages.shape[1] != block_size:
        raise ValueError(f"ki_pages must be [P, block_size={block_size}, Di], got {tuple(ki_pages.shape)}")
    if (ki_pages.dtype == FP8_DTYPE) != (ki_scale is not None):
        raise ValueError("ki_scale must be given exactly when ki_pages is fp8 (float8_e4m3fn)")
    if ki_scale is not None and ki_scale.shape != ki_pages.shape[:2]:
        raise ValueError(f"ki_scale must be [P, block_size] = {tuple(ki_pages.shape[:2])}, got {tuple(ki_scale.shape)}")
    if ki_scale is not None and ki_scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"ki_scale must be uint8 (e8m0 exponents) or float32, got {ki_scale.dtype}")
    _, lens = _check_paged(block_table, cu_seqlens_q, seq_lens, block_size, ki_pages.shape[0])
    ki = gather_pages(ki_pages, block_table, lens, block_size)
    scale = None if ki_scale is None else gather_pages(ki_scale, block_table, lens, block_size)
    ki = dequantize_index_keys(ki, scale)
    return reference.select_blocks(qi.float(), ki, cu_seqlens_q, block_size=block_size, topk=topk,
                                   local_blocks=local_blocks, cu_seqlens_k=_cu(lens, qi.device))


def paged_sparse_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                           block_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens, *, block_size: int,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of the new queries over the selected cached blocks.

    q: [Tq, Hq, D]; k_pages, v_pages: [P, block_size, Hkv, D]; block_idx int32 [Hkv, Tq, topk] (block numbers
    from the sequence start, -1 = unused). Returns (o [Tq, Hq, D] in q.dtype, lse [Tq, Hq] fp32).
    """
    if k_pages.dim() != 4 or k_pages.shape[1] != block_size or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, block_size={block_size}, Hkv, D], "
                         f"got {tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    _, lens = _check_paged(block_table, cu_seqlens_q, seq_lens, block_size, k_pages.shape[0])
    k = gather_pages(k_pages, block_table, lens, block_size)
    v = gather_pages(v_pages, block_table, lens, block_size)
    return reference.sparse_attention(q, k.to(q.dtype), v.to(q.dtype), block_idx, cu_seqlens_q,
                                      block_size=block_size, scale=scale, cu_seqlens_k=_cu(lens, q.device))


def all_blocks(cu_seqlens_q: torch.Tensor, seq_lens, num_heads: int, block_size: int) -> torch.Tensor:
    """block_idx int32 [num_heads, Tq, max_blocks] naming every causally visible block of each query (dense
    attention expressed as MSA with every block selected)."""
    batch = cu_seqlens_q.numel() - 1
    lens = _lengths("seq_lens", seq_lens, batch)
    cu = [int(c) for c in cu_seqlens_q.tolist()]
    width = max([-(-n // block_size) for n in lens] + [1])
    rows = []
    for b in range(batch):
        pos = torch.arange(lens[b] - (cu[b + 1] - cu[b]), lens[b], device=cu_seqlens_q.device)
        cols = torch.arange(width, device=cu_seqlens_q.device)
        visible = cols[None, :] <= (pos // block_size)[:, None]
        rows.append(torch.where(visible, cols[None, :], torch.full_like(cols[None, :], -1)))
    idx = torch.cat(rows, dim=0).to(torch.int32)
    return idx[None].expand(num_heads, -1, -1).contiguous()


def paged_dense_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens, *, block_size: int,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention of the new queries over every cached token (the dense layers' cache path).

    Same shapes as `paged_sparse_attention`; equals it with every visible block selected.
    """
    block_idx = all_blocks(cu_seqlens_q, seq_lens, k_pages.shape[2], block_size)
    return paged_sparse_attention(q, k_pages, v_pages, block_table, block_idx, cu_seqlens_q, seq_lens,
                                  block_size=block_size, scale=scale)
