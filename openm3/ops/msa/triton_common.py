"""Helpers shared by the MSA Triton kernels: token/block bookkeeping built with torch ops, and launch configs.

Everything here is plain PyTorch on the kernels' device (no Triton import), so it can be unit-tested anywhere.

Conventions (packed varlen, see `reference.py`):
- `cu_seqlens` int32 [B+1] delimits the queries of each sequence, `cu_seqlens_k` int32 [B+1] its keys. Query `i`
  of sequence `b` sits at key position `kv_len_b - q_len_b + i` of its sequence (bottom-right causal alignment).
- Kernels address keys by **absolute** row in the packed key tensor, so a block is identified by its first key
  row `cu_seqlens_k[b] + block * block_size`; this is unique across sequences, which lets one tile of queries
  span a sequence boundary.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..fused import fused_on_cuda
from .backend import interpreting, triton_unavailable

# Sentinel for "no block" after sorting (sorts after every real key row).
NO_BLOCK = torch.iinfo(torch.int32).max


def check_triton_inputs(kernel: str = "the Triton MSA kernels", /, *, dots: bool = True,
                        **tensors: torch.Tensor | None) -> None:
    """Fail fast (ValueError) where the Triton kernels cannot run on these tensors or would return wrong numbers;
    every Triton entry point calls it with its floating inputs (None entries are skipped):

    - the process cannot run Triton kernels on the tensors' device (CPU tensors without Triton's CPU interpreter,
      or `TRITON_INTERPRET` changed after triton was imported: `backend.triton_unavailable`);
    - bf16 under the interpreter: Triton 3.6's interpreter computes `tl.dot` of bf16 operands wrong (errors ~1e9,
      `scripts/triton_interpreter_bugs.py`), so the kernels take fp32/fp16 there (`dots=False`: a kernel that
      multiplies none of them, which may take bf16).

    `kernel` names the caller in the messages (the other ops' Triton kernels use it too)."""
    given = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    reason = triton_unavailable(on_cpu=any(not t.is_cuda for t in given.values()))
    if reason is not None:
        where = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"{kernel} got {where}, but {reason}")
    bf16 = [name for name, t in given.items() if t.dtype == torch.bfloat16]
    if dots and bf16 and interpreting():
        raise ValueError(f"{', '.join(bf16)}: bfloat16 is refused by {kernel} under Triton's CPU "
                         f"interpreter (TRITON_INTERPRET=1), whose tl.dot of bf16 operands returns wrong numbers "
                         f"(scripts/triton_interpreter_bugs.py). Under the interpreter pass float32 or float16 "
                         f"tensors, or run the reference backend (msa.use_backend('reference'), "
                         f"msa.set_backend('reference') or OPENM3_MSA_BACKEND=reference); bf16 runs on a CUDA GPU "
                         f"without the interpreter.")


def check_block_size(block_size: int, kernel: str, /, *, small_powers: bool = False,
                     power_of_two: bool = False) -> None:
    """ValueError naming `block_size` (a model's `index_block_size`, the engine's page size) where `kernel` cannot
    tile key blocks of that many keys; `block_size` is an int >= 1 (`check_block_params`). Each Triton entry point
    calls it before any launch: a GPU would otherwise fail inside Triton's compiler.

    Default (the attention kernels): a multiple of 16. They walk a block in key tiles that divide it, and a GPU's
    `tl.dot` sums over at least 16 keys of a tile (p @ v). `small_powers` (the selection kernel): also a power of
    two below 16, as several such blocks share one key tile. `power_of_two` (the decode kernels): a power of two
    >= 16, as their tiles span a whole page (`tl.arange` over it). The CPU interpreter runs narrower tiles than a
    GPU does, so it is held to the GPU's rule."""
    pow2 = block_size & (block_size - 1) == 0
    if power_of_two:
        ok, allowed = pow2 and block_size >= 16, "a power of two >= 16"
    elif small_powers:
        ok, allowed = block_size % 16 == 0 or pow2, "a multiple of 16 or a power of two below 16"
    else:
        ok, allowed = block_size % 16 == 0, "a multiple of 16"
    if not ok:
        every = "" if power_of_two else (" (a power of two >= 16 suits every Triton MSA kernel: prefill, training "
                                         "and decoding)")
        raise ValueError(f"block_size={block_size} (a model's index_block_size) must be {allowed} for {kernel}"
                         f"{every}; the reference backend takes any block size (msa.use_backend('reference'), "
                         f"msa.set_backend('reference') or OPENM3_MSA_BACKEND=reference)")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


_COUNTERS: dict = {}
_OUTGROWN: list = []  # counters replaced by larger ones: CUDA graphs captured with them may still replay


def arrival_counters(n: int, device: torch.device, kind: str) -> torch.Tensor:
    """Zeroed int32 [>= n] arrival counters for kernels whose last program to finish a piece of work does its
    final step (the decode attention's fused combine: kind 'combine', the folded shrink: 'fold', the MoE experts'
    split reduction: 'moe_experts'), kept per device and kind: every launch leaves them at zero again, so they are
    allocated once (outside CUDA-graph capture, at the first eager call) and reused. One launch of a kind at a
    time per device (launches on concurrent streams would share them)."""
    buf = _COUNTERS.get((device, kind))
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)  # kept alive: a graph that captured it would otherwise count in freed memory
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, kind)] = buf
    return buf


def with_overrides(cfg: dict, env_var: str, overrides: dict) -> dict:
    """Launch fields `cfg` with single fields replaced by the environment variable `env_var` ("key=value,...",
    integers; for tuning on the GPU), then by `overrides`."""
    cfg = dict(cfg)
    for item in filter(None, (s.strip() for s in os.environ.get(env_var, "").split(","))):
        key, _, value = item.partition("=")
        cfg[key.strip()] = int(value)
    return cfg | overrides


def largest_pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap (>= 1)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


@fused_on_cuda(grad=False)
def query_positions(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, num_tokens: int):
    """Sequence and absolute key-space position of every packed query.

    Returns `(seq [T] int64, qpos [T] int32)`: `seq[t]` is the sequence of query t and `qpos[t]` the absolute key
    row of its own position, so key row `j` is causally visible to query t iff `cu_seqlens_k[seq[t]] <= j <=
    qpos[t]`.
    """
    cu_q = cu_seqlens.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    t = torch.arange(num_tokens, device=cu_q.device, dtype=torch.int64)
    seq = torch.searchsorted(cu_q, t, right=True) - 1
    q_len = cu_q[1:] - cu_q[:-1]
    k_len = cu_k[1:] - cu_k[:-1]
    qpos = cu_k[seq] + (k_len - q_len)[seq] + (t - cu_q[seq])
    return seq, qpos.to(torch.int32)


@fused_on_cuda(grad=False)
def absolute_block_starts(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          block_size: int) -> torch.Tensor:
    """First absolute key row of every selected block.

    block_idx: int32 [H, T, topk] (block numbers relative to each sequence, -1 unused); seq: [T] from
    `query_positions`. Returns int32 [H, T, topk], -1 where block_idx is -1. Computed in int32 (key rows < 2^31)
    so the transient workspace stays at the size of block_idx.
    """
    base = cu_seqlens_k.to(torch.int32)[seq].view(1, -1, 1)
    return torch.where(block_idx >= 0, block_idx * block_size + base, -1).to(torch.int32)


class QueryTiling(NamedTuple):
    """The query-outer kernels' bookkeeping for one `block_idx`: each query's sequence `seq` and key position
    `qpos` ([T], from `query_positions`), its selected blocks' absolute first key rows `sel` (int32 [H, T, topk],
    `absolute_block_starts`) and the tiles' candidate blocks `cand`, `ncand`, `members` (`tile_candidates`;
    `members` is `cand` itself for one-token tiles, which never read it: a placeholder pointer)."""

    seq: torch.Tensor
    qpos: torch.Tensor
    sel: torch.Tensor
    cand: torch.Tensor
    ncand: torch.Tensor
    members: torch.Tensor


# The last `query_tiling` result and what it was computed from (weak references: the cache never keeps a
# selection alive, and a tensor changed in place has a new version).
_last_tiling: tuple | None = None


def query_tiling(block_idx: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor, num_tokens: int,
                 num_keys: int, block_size: int, tokens_per_tile: int) -> QueryTiling:
    """`QueryTiling` of a selection for tiles of `tokens_per_tile` queries. The attention forward and the indexer
    KL's teacher pass tile the same selection the same way, one after the other: the second call reuses the first
    one's tensors (the same `block_idx` and `cu_seqlens` objects, unchanged since, and the same sizes)."""
    global _last_tiling
    inputs = (block_idx, cu_seqlens, cu_seqlens_k)
    # inference-mode tensors have no version counter: never cached
    key = None if any(x.is_inference() for x in inputs) else (
        num_tokens, num_keys, block_size, tokens_per_tile, *(x._version for x in inputs))
    if key is not None and _last_tiling is not None:
        refs, last_key, tiling = _last_tiling
        if last_key == key and all(r() is x for r, x in zip(refs, inputs)):
            return tiling
    seq, qpos = query_positions(cu_seqlens, cu_seqlens_k, num_tokens)
    sel = absolute_block_starts(block_idx, seq, cu_seqlens_k, block_size).contiguous()
    cand, ncand, members = tile_candidates(sel, tokens_per_tile, num_keys)
    tiling = QueryTiling(seq, qpos, sel, cand, ncand, cand if members is None else members)
    _last_tiling = None if key is None else (tuple(weakref.ref(x) for x in inputs), key, tiling)
    return tiling


# Tiles per sort in `tile_candidates`: bounds the sort's transient int64 indices to ~tiles * width * 8 bytes.
_TILES_PER_SORT = 1 << 16


def tile_candidates(block_starts: torch.Tensor, tokens_per_tile: int, num_keys: int | None = None):
    """Union of the selected blocks of each tile of `tokens_per_tile` consecutive queries, with membership bits.

    block_starts: int32 [H, T, topk] from `absolute_block_starts`; num_keys: an upper bound on the key rows (None:
    unknown). Returns `(cand, ncand, members)`: cand int32 [H, n_tiles, tokens_per_tile * topk] holds each tile's
    distinct block starts, ascending, padded with `NO_BLOCK`; ncand int32 [H, n_tiles] counts them; members int64
    (same shape as cand) has bit j set when token j of the tile selected that block, so a kernel tests membership
    with one shift per row. One sort per chunk of tiles (bounding the workspace), then a scatter of each run of
    equal starts to its rank. For one token per tile the selection is its own candidate list (valid blocks are
    distinct and left-packed by contract) and members is None. No host synchronisation.
    """
    if tokens_per_tile > 64:
        raise ValueError(f"tokens_per_tile={tokens_per_tile}: membership bits hold at most 64 tokens per tile")
    if tokens_per_tile == 1:
        ncand = (block_starts >= 0).sum(dim=-1, dtype=torch.int32)
        return block_starts.contiguous(), ncand, None
    return _tile_union(block_starts, tokens_per_tile, num_keys)


# Sort keys `start << 6 | token` fit int32 (half the bytes to sort) while every key row is below this.
_NARROW_KEY_ROWS = (1 << 25) - 1


def _tile_union(block_starts: torch.Tensor, tokens_per_tile: int, num_keys: int | None = None):
    """`tile_candidates` for 2-64 tokens per tile: sort keys, then per chunk of tiles a sort and the runs.

    The sort runs outside the compiled graphs: inductor lowers a short int32 row sort to its own Triton sort, which
    failed (`CantSplit`) under dynamic shapes on CUDA; torch's segmented sort takes int32 keys in about half the
    time of int64 ones (session 6: 5.0 vs 9.6 ms per m3-small 8K step)."""
    narrow = num_keys is not None and num_keys < _NARROW_KEY_ROWS
    keys = _union_keys(block_starts, tokens_per_tile, narrow)
    parts = [_union_runs(keys[:, lo:lo + _TILES_PER_SORT].sort(dim=-1).values)
             for lo in range(0, max(keys.shape[1], 1), _TILES_PER_SORT)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(xs, dim=1) for xs in zip(*parts))


@fused_on_cuda(grad=False)
def _union_keys(block_starts: torch.Tensor, tokens_per_tile: int, narrow: bool) -> torch.Tensor:
    """[H, n_tiles, tokens_per_tile * topk] keys `start << 6 | token` of every (token, selected block) of each tile
    (int32 when `narrow`, else int64); unused slots get the dtype's largest value, which sorts last."""
    h, t, topk = block_starts.shape
    n_tiles = -(-t // tokens_per_tile)
    pad = n_tiles * tokens_per_tile - t
    x = block_starts
    if pad:
        x = torch.cat([x, x.new_full((h, pad, topk), -1)], dim=1)
    dtype = torch.int32 if narrow else torch.int64
    token = (torch.arange(tokens_per_tile * topk, device=x.device, dtype=dtype) // topk).view(1, 1, -1)
    x = x.view(h, n_tiles, tokens_per_tile * topk).to(dtype)
    return torch.where(x >= 0, (x << 6) | token, torch.iinfo(dtype).max)


@fused_on_cuda(grad=False)
def _union_runs(keys: torch.Tensor):
    """(cand, ncand, members) of `tile_candidates` from each tile's sorted keys (see `_union_keys`)."""
    part = keys >> 6
    valid = part != (torch.iinfo(keys.dtype).max >> 6)
    first = torch.ones_like(valid)
    first[..., 1:] = part[..., 1:] != part[..., :-1]
    repeat = torch.zeros_like(valid)  # a token that listed one block twice: its bit is counted once
    repeat[..., 1:] = keys[..., 1:] == keys[..., :-1]
    rank = first.cumsum(dim=-1) - 1  # index of each entry's run of equal starts; every entry of a run carries it
    cand = torch.full(keys.shape, NO_BLOCK, device=keys.device, dtype=torch.int32)
    cand.scatter_(-1, rank, torch.where(valid, part, NO_BLOCK).to(torch.int32))
    one = torch.ones(keys.shape, device=keys.device, dtype=torch.int64)
    bits = torch.where(repeat | ~valid, 0, one << (keys & 63).to(torch.int64))
    members = torch.zeros(keys.shape, device=keys.device, dtype=torch.int64)
    members.scatter_add_(-1, rank, bits)  # distinct bits: the sum is their union
    ncand = valid.logical_and(first).sum(dim=-1, dtype=torch.int32)
    return cand, ncand, members


@dataclass(frozen=True)
class KeyBlockWork:
    """Inverse index for key-block-outer kernels: for each (head, key block), the queries that selected it.

    `tokens` int32 [N]: query tokens grouped by bucket (bucket = head * num_block_slots + global block).
    Work item `i` handles `tokens[lo[i]:hi[i]]` of bucket `bucket[i]` (empty when `lo == hi`); a bucket with more
    queries than `max_tokens` is split into several items, flagged `split` (their results must be summed).
    `block_start` / `block_end` int32 [num_block_slots]: absolute key rows [start, end) of each global block
    (start == end for unused slots). `entries` (when asked for) int32 [N]: the selection entry of each position
    of `tokens`, `(head * T + token) * topk + slot` (a row of the KL's teacher buffer), else None.
    """

    tokens: torch.Tensor
    bucket: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    split: torch.Tensor
    block_start: torch.Tensor
    block_end: torch.Tensor
    num_block_slots: int
    entries: torch.Tensor | None = None


def global_block_numbering(cu_seqlens_k: torch.Tensor, num_keys: int,
                           block_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Number the key blocks of all sequences in order: (slots, seq_block_off, seq_block_end).

    `seq_block_off[b]` is the global number of sequence b's block 0 and `seq_block_end[b]` one past its last block
    (int64 [B]); `slots = ceil(Tk / block_size) + B` bounds the number of blocks from shapes alone (no host sync).
    """
    cu_k = cu_seqlens_k.to(torch.int64)
    slots = -(-num_keys // block_size) + cu_k.numel() - 1
    blocks_per_seq = (cu_k[1:] - cu_k[:-1] + block_size - 1) // block_size
    seq_block_end = torch.cumsum(blocks_per_seq, 0)
    return slots, seq_block_end - blocks_per_seq, seq_block_end


def key_block_work(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
                   block_size: int, max_tokens: int, with_entries: bool = False) -> KeyBlockWork:
    """Build the inverse index of `block_idx` (int32 [H, T, topk]) with torch sort ops, without host syncs.

    Global block numbers run over all sequences' blocks in order; `num_block_slots = ceil(Tk / block_size) + B`
    bounds their count, so every size here is known from shapes alone. with_entries: also each position's
    selection entry (`KeyBlockWork.entries`).
    """
    slots = -(-num_keys // block_size) + cu_seqlens_k.numel() - 1  # as global_block_numbering's
    tensors = _key_block_tensors(block_idx, seq, cu_seqlens_k, num_keys, block_size, max_tokens, with_entries)
    return KeyBlockWork(*tensors[:7], num_block_slots=slots, entries=tensors[7] if with_entries else None)


def bucket_runs(bucket: torch.Tensor, payload: torch.Tensor, payload_range: int, num_buckets: int,
                max_per_item: int) -> tuple[torch.Tensor, ...]:
    """Group `payload` values by `bucket` with one sort and cut every bucket's run into work items.

    bucket, payload: int64 [N]; buckets 0..num_buckets-1 are real, `num_buckets` marks unused positions (sorted
    last, covered by no item); payload values lie in [0, payload_range) and are distinct within a bucket.
    Returns `(payload_sorted, bucket_sorted, b, lo, hi, live, chunks_b, order)`: payload_sorted int32 [N]
    (ascending within each bucket), bucket_sorted [N] the bucket of each of its positions and order int64 [N] the
    input position each came from (the sort's indices: free, torch's sort returns them anyway); item i covers
    `payload_sorted[lo[i]:hi[i]]` of bucket `b[i]` (int64; `live` False and lo == hi for the padding items of the
    shape-derived item count), and `chunks_b[i]` is the number of items of its bucket (> 1: a hot bucket split
    across items). Run starts come from a binary search over the sorted buckets, not a scatter of counts (atomics
    on a few hot buckets were 13 ms of m3-small's 8K step). No host sync.
    """
    n = bucket.numel()
    keys = bucket * payload_range + payload  # < (num_buckets + 1) * payload_range
    if (num_buckets + 1) * payload_range <= torch.iinfo(torch.int32).max:  # from shapes: half the radix passes
        keys = keys.to(torch.int32)
    ordered, order = torch.sort(keys)
    payload_sorted = (ordered % payload_range).to(torch.int32)
    bucket_sorted = ordered // payload_range
    run_start = torch.searchsorted(bucket_sorted,
                                   torch.arange(num_buckets + 1, device=bucket.device, dtype=ordered.dtype))
    offsets = run_start[:-1].to(torch.int64)
    counts = run_start[1:].to(torch.int64) - offsets
    chunks = (counts + max_per_item - 1) // max_per_item
    chunk_end = torch.cumsum(chunks, 0)
    num_items = num_buckets + -(-n // max_per_item)  # bounds sum(chunks)
    item = torch.arange(num_items, device=bucket.device, dtype=torch.int64)
    b = torch.searchsorted(chunk_end, item, right=True)
    live = b < num_buckets
    b = b.clamp(max=num_buckets - 1)
    lo = offsets[b] + (item - (chunk_end[b] - chunks[b])) * max_per_item
    hi = torch.where(live, torch.minimum(lo + max_per_item, offsets[b] + counts[b]), lo)
    return payload_sorted, bucket_sorted, b, lo, hi, live, chunks[b], order


def block_rows(gb: torch.Tensor, cu_k: torch.Tensor, seq_block_off: torch.Tensor, seq_block_end: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Absolute key rows [start, end) of global blocks `gb` (int64) and whether each is a used slot."""
    num_seqs = cu_k.numel() - 1
    sb = torch.searchsorted(seq_block_end, gb, right=True)
    used = sb < num_seqs
    sb = sb.clamp(max=num_seqs - 1)
    start = cu_k[sb] + (gb - seq_block_off[sb]) * block_size
    return start, torch.minimum(start + block_size, cu_k[sb + 1]), used


class SelectionBuckets(NamedTuple):
    """Every (head, token, slot) of a selection numbered by its (head, global key block) bucket.

    `bucket` int64 [H * T * topk] (flattened block_idx order) is `head * slots + global block`, or `unused` (=
    H * slots, sorted after every real bucket) for a -1 slot; the rest is `global_block_numbering`'s."""

    bucket: torch.Tensor
    unused: int
    slots: int
    seq_block_off: torch.Tensor
    seq_block_end: torch.Tensor
    cu_k: torch.Tensor


def selection_buckets(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
                      block_size: int) -> SelectionBuckets:
    """Bucket every selected block of `block_idx` (int32 [H, T, topk]; `seq` from `query_positions`)."""
    h, t, _ = block_idx.shape
    slots, seq_block_off, seq_block_end = global_block_numbering(cu_seqlens_k, num_keys, block_size)
    heads = torch.arange(h, device=block_idx.device, dtype=torch.int64).view(h, 1, 1)
    gblock = seq_block_off[seq].view(1, t, 1) + block_idx.to(torch.int64)
    unused = h * slots
    bucket = torch.where(block_idx >= 0, heads * slots + gblock, unused).flatten()
    return SelectionBuckets(bucket, unused, slots, seq_block_off, seq_block_end, cu_seqlens_k.to(torch.int64))


def token_runs(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
               block_size: int, max_per_item: int) -> tuple[SelectionBuckets, tuple[torch.Tensor, ...]]:
    """Every (head, token, slot) of `block_idx` grouped by its (head, global key block) bucket, tokens ascending
    within a bucket, cut into work items of at most `max_per_item`: `(sel, bucket_runs(...))` with the tokens as
    the payload. A token selects a block at most once per head, so the (bucket, token) pairs are distinct and the
    sort keys stay int32 up to T * buckets < 2^31; the sort's indices (`order`) are each pair's position in the
    flattened selection, i.e. its entry number (g * T + t) * topk + slot. The -1 slots go to the `sel.unused`
    bucket, which no work item covers."""
    h, t, topk = block_idx.shape
    sel = selection_buckets(block_idx, seq, cu_seqlens_k, num_keys, block_size)
    token = torch.arange(t, device=block_idx.device, dtype=torch.int64).view(1, t, 1).expand(h, t, topk).flatten()
    return sel, bucket_runs(sel.bucket, token, t, sel.unused, max_per_item)


@fused_on_cuda(grad=False)
def _key_block_tensors(block_idx: torch.Tensor, seq: torch.Tensor, cu_seqlens_k: torch.Tensor, num_keys: int,
                       block_size: int, max_tokens: int, with_entries: bool = False) -> tuple[torch.Tensor, ...]:
    """The tensors of `key_block_work` (~35 torch ops: one fused graph on CUDA)."""
    device = block_idx.device
    sel, (tokens, _, b, lo, hi, _, chunks, order) = token_runs(block_idx, seq, cu_seqlens_k, num_keys, block_size,
                                                              max_tokens)
    slots = sel.slots

    start, end, used = block_rows(torch.arange(slots, device=device, dtype=torch.int64), sel.cu_k, sel.seq_block_off,
                                  sel.seq_block_end, block_size)
    start = torch.where(used, start, num_keys)
    end = torch.where(used, end, num_keys)
    out = (tokens, b.to(torch.int32), lo.to(torch.int32), hi.to(torch.int32), (chunks > 1).to(torch.int32),
           start.to(torch.int32), end.to(torch.int32))
    # the sort's indices are the entry numbers (see token_runs); int32 while H * T * topk < 2^31
    return out + (order.to(torch.int32),) if with_entries else out


# ---------------------------------------------------------------------------------------------------------------
# Launch configuration: the one place to tune the attention kernels.


@dataclass(frozen=True)
class AttentionLaunch:
    """Launch parameters of the sparse-attention kernels.

    block_m: rows of a forward query tile = tokens_per_tile * group heads (a power of two >= 16 for tl.dot);
      several tokens per tile walk the union of their blocks with per-row masks (each K/V tile is loaded once for
      all of them, but masked rows still cost dot work). block_n: keys per inner tile; divides the block size.
    dq_block_m, dq_block_n, dq_num_warps: the same for the dq kernel (it does 3 dots per key tile, not 2, so its
      best trade-off between shared loads and masked work can differ); unset, they follow the forward's.
    dkdv_block_m: query rows per step of the key-block-outer dk/dv kernel (whole tokens of group heads);
    dkdv_block_n: keys per dk/dv program (divides the block size: a smaller one re-reads q, dO per sub-block).
    dkdv_num_warps, dkdv_num_stages: the dk/dv kernel's (num_warps, num_stages are the forward's and dq's).
    dkdv_max_tokens: queries handled by one dk/dv work item before a hot block is split across programs.
    tma: 1 loads the forward's and dq's K/V tiles through tensor descriptors (Hopper's TMA), 0 with pointers.
    dq_in_dkdv: 1 computes dq inside the dk/dv kernel (one more dot per step, fp32 atomic adds into a [T, Hq, D]
      buffer) instead of a separate query-outer pass that gathers K and V again.
    dkdv_maxnreg: 0 lets the compiler pick the dk/dv kernel's registers per thread; n > 0 caps them (spilling the
      rest), e.g. 128 so two 8-warp CTAs fit an SM: the kernel is latency-bound at one CTA (ncu, session 5: 222
      registers, 12.5% occupancy). With dkdv_block_n=64 the cap spills 104 bytes per thread on sm_90 and shared
      memory allows two CTAs (90.5 KB each). Compiled GPUs only. Timed in session 6: slower (11.5 vs 7.15 ms at
      G = 4, 276 vs 166 ms at M3's 128K; the spills cost more than the second CTA gains).
    dkdv_split: 1 runs dk/dv as two passes, dv then dk (+ dq), each holding one fp32 [BLOCK_N, D] accumulator
      instead of two (fewer registers per thread, so more warps per SM) at the price of recomputing P and
      gathering q and dO twice; 0 one pass. Opt-in, not timed yet.
    dq_transposed: with dq_in_dkdv, 1 computes each step's dq transposed, dq^T = K^T dS^T ([D, rows]: the key
      tile's head dim as the dot's M, a wgmma on Hopper) instead of dq = dS K ([rows, D], whose M of 32 rows is
      below a warpgroup's 64 and compiles to mma.sync on sm_90); the atomic adds stay 16-byte vectors. The GPU
      default since session 9 (3-4% faster fwd+bwd at G = 4 and 16).
    teacher_mean: how dk/dv takes the mean over each token's group heads of P [keys, rows] when it stores the
      indexer KL's teacher (`sparse_attention_with_kl`): 0 sums in P's layout; 2 multiplies P by a [rows, tokens]
      matrix of 1/G (a dot instead of a cross-lane reduction; at least 16 token columns). Session 15, m3-small's
      8K step interleaved: 2 against 0, dk/dv 163.1 -> 157.4 ms, steps 724.3 -> 708.4 ms (medians of 3, every
      step of 2 faster than every step of 0): the GPU default. (A transposed sum storing along the keys, timed as
      1, took the same 162.1 ms as 0 and was removed.)
    union_max: with several tokens per forward tile, n > 0 makes the forward hybrid: a tile whose tokens chose
      more than n distinct blocks between them walks each token's own blocks in one-token tiles instead of the
      union (whose masked rows cost dot work in proportion to the union), so the shared K/V loads are taken only
      where the tokens' selections overlap; 0 always walks the union.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_num_warps: int
    dkdv_num_stages: int
    dkdv_max_tokens: int
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    tma: int
    dq_in_dkdv: int
    dkdv_maxnreg: int = 0
    dkdv_split: int = 0
    dq_transposed: int = 0
    teacher_mean: int = 0
    union_max: int = 0

    def tokens_per_tile(self, group: int) -> int:
        return max(1, self.block_m // group)

    def dq_tokens_per_tile(self, group: int) -> int:
        return max(1, self.dq_block_m // group)

    def dkdv_tokens(self, group: int) -> int:
        return max(1, self.dkdv_block_m // group)


# Overrides for tuning on the GPU: OPENM3_ATTN_LAUNCH="block_m=32,block_n=64,num_warps=4".
_ENV_OVERRIDE = "OPENM3_ATTN_LAUNCH"


def attention_launch(group: int, head_dim: int, block_size: int, dtype: torch.dtype, on_gpu: bool,
                     **overrides) -> AttentionLaunch:
    """Pick launch parameters for a (group size, head dim, block size, dtype) problem.

    `overrides` (or the `OPENM3_ATTN_LAUNCH` environment variable, `key=value,...`) replace single fields.
    """
    min_rows = 16  # tl.dot's minimum M on GPUs
    if on_gpu:
        # Measured on an H200 (M3 shape, docs/kernels_attention.md): forward tiles are bound by gathering K/V from
        # L2/HBM. Tiles of 4 tokens (block_m = 4 * G) over the union of their blocks cut that traffic when
        # neighbouring queries select overlapping blocks (-22% at 32K) but cost masked dot work otherwise (+32% at
        # 128K with i.i.d. selections, and only -4% left for overlapping ones there): one token per tile is the
        # robust default where nothing better was measured (at G = 16 the hybrid below picks per tile; its K/V
        # gather alone takes 50.5 ms of its 51.9 at 128K, session 17). TMA loads beat pointer loads; whole-block
        # dk/dv programs read q and dO once per block,
        # and fusing dq into them (atomics) beats a second K/V gather.
        # dk/dv work items of at most 512 queries: a hot block (the first, the own blocks of a dense stretch) is
        # split over more programs, which add their parts with fp32 atomics. At G = 4, 2 x 8K tokens: fwd+bwd
        # 5.52 ms against 5.91 with 2048 (6.81 with 8192); M3 at 128K: 163.9 against 163.5 (session 7).
        # Groups of 4-8 heads (m3-small: 4) fill a wgmma tile of 64 rows with 16 (8) tokens over the union of
        # their blocks: at G = 4 fwd+bwd 7.3 vs 9.6 ms at 2 x 8K tokens and 29.3 vs 35.8 ms at 64K (drifting
        # selections; session 3, benchmarks/msa_group_sweep.py; G = 8 not measured).
        # dq inside dk/dv as dq^T = K^T dS^T (a wgmma; dS K with 32 rows compiles to mma.sync): fwd+bwd -3.0% at
        # G = 4 (2 x 8K drift), -3.6% (8 x 8K iid), -3.2% at M3's 128K (162.2 -> 157.1 ms; session 9).
        # Three pipeline stages in dk/dv (the token list one step ahead of the q / dO gathers it addresses):
        # fwd+bwd 17.86 -> 17.65 ms at G = 4 (8 x 8K iid, medians of 3; session 9), 157.38 -> 155.66 ms at M3's
        # 128K (medians of 2; session 10). At G = 16, dk/dv steps of 4 tokens (dkdv_block_m=64): M3's 128K train
        # step 189.10 -> 179.04 ms (16 rows: 226.89; session 16).
        # M3's G = 16: a hybrid forward (session 16, 128K, ms drift / iid): tiles of 4 tokens over the union of
        # their blocks where it holds at most 40 blocks, the other tiles' tokens alone in a second launch: 52.9 /
        # 64.8 against one-token tiles' 58.2 / 66.9 and the union everywhere's 52.7 / 83.7 (union_max 44-56:
        # 53.4-55.9 / 65.8-69.4; benchmarks/results/msa_kernels_128k_union_sweep_20261202T1520.json).
        one_token = next_pow2(max(min_rows, group))
        small_group = 4 <= group < 16
        m3_group = group == 16  # the hybrid forward and 4-token dk/dv steps: measured at this group size only
        block_m = 64 if small_group or m3_group else one_token
        block_n = largest_pow2_divisor(block_size, 128 if head_dim <= 64 else 64)
        cfg = dict(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2 if small_group else 3,
                   dq_block_m=one_token, dq_block_n=block_n, dq_num_warps=4,
                   dkdv_block_m=64 if m3_group else max(one_token, 32),
                   dkdv_block_n=largest_pow2_divisor(block_size, 128),
                   dkdv_num_warps=8, dkdv_num_stages=3, dkdv_max_tokens=512, tma=1, dq_in_dkdv=1, dq_transposed=1,
                   teacher_mean=2, union_max=40 if m3_group else 0)
    else:
        # The CPU interpreter pays per operation, not per element: few programs with large tiles run fastest.
        block_m = next_pow2(max(64, group))
        block_n = largest_pow2_divisor(block_size, 64)
        cfg = dict(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1,
                   dq_block_m=None, dq_block_n=None, dq_num_warps=None,
                   dkdv_block_m=block_m, dkdv_block_n=block_n, dkdv_num_warps=4, dkdv_num_stages=1,
                   dkdv_max_tokens=64, tma=0, dq_in_dkdv=0)
    cfg = with_overrides(cfg, _ENV_OVERRIDE, overrides)
    for name in ("block_m", "block_n", "num_warps"):  # dq follows the forward's tiling unless set
        if cfg.get("dq_" + name) is None:
            cfg["dq_" + name] = cfg[name]
    unknown = set(cfg) - set(AttentionLaunch.__dataclass_fields__)
    if unknown:
        raise ValueError(f"attention launch: unknown fields {sorted(unknown)}; known: "
                         f"{sorted(AttentionLaunch.__dataclass_fields__)}")
    launch = AttentionLaunch(**cfg)
    if min(launch.block_m, launch.dq_block_m, launch.dkdv_block_m) < group:
        raise ValueError(f"attention launch: block_m={launch.block_m} / dq_block_m={launch.dq_block_m} / "
                         f"dkdv_block_m={launch.dkdv_block_m} must hold a whole group of {group} query heads")
    if max(launch.tokens_per_tile(group), launch.dq_tokens_per_tile(group)) > 64:
        raise ValueError(f"attention launch: block_m={launch.block_m} / dq_block_m={launch.dq_block_m} hold more "
                         f"than 64 tokens of {group} heads (membership bits are int64)")
    for name in ("dkdv_split", "dq_transposed"):
        if getattr(launch, name) not in (0, 1):
            raise ValueError(f"attention launch: {name}={getattr(launch, name)} must be 0 or 1")
    if launch.teacher_mean not in (0, 2):
        raise ValueError(f"attention launch: teacher_mean={launch.teacher_mean} must be 0 or 2")
    if launch.dkdv_maxnreg < 0 or launch.dkdv_maxnreg > 255:
        raise ValueError(f"attention launch: dkdv_maxnreg={launch.dkdv_maxnreg} must be 0 (compiler's choice) or "
                         f"a register count in [1, 255]")
    for name in ("block_n", "dq_block_n", "dkdv_block_n"):
        if block_size % getattr(launch, name):
            raise ValueError(f"attention launch: {name}={getattr(launch, name)} must divide "
                             f"block_size={block_size}")
    for name in ("block_m", "block_n", "dq_block_m", "dq_block_n", "dkdv_block_m", "dkdv_block_n"):
        value = getattr(launch, name)
        if value & (value - 1):
            raise ValueError(f"attention launch: {name}={value} must be a power of two")
    return launch
