"""Input validation shared by every MSA backend.

Each check raises `ValueError` naming the offending argument and what was expected, so a wrong call fails before
any kernel runs instead of returning silently wrong numbers. Checks that read tensor *values* synchronise with
the device: `cu_seqlens` is read once per tensor (`openm3.ops.host.host_list`, shared by every op of a forward),
and `check_block_idx(..., values=False)` skips the value checks for hot paths that trust their producer (the
selection kernel).

Shapes follow the packed varlen layout of `reference.py`: `q [T, Hq, D]`, `k, v [Tk, Hkv, D]`, `qi [T, Hi, Di]`,
`ki [Tk, Di]`, `cu_seqlens int32 [B + 1]`, `cu_seqlens_k int32 [B + 1]`, `block_idx int32 [Hi, T, topk]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..host import host_list

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Segment:
    """One sequence of a packed batch.

    Queries `q[q_start : q_start + q_len]` are the last `q_len` tokens of a sequence whose keys are
    `k[k_start : k_start + k_len]`, so query `i` sits at absolute position `k_len - q_len + i` (bottom-right
    causal alignment). Block ids count from `k_start`.
    """

    q_start: int
    q_len: int
    k_start: int
    k_len: int

    @property
    def offset(self) -> int:
        """Absolute position of the segment's first query."""
        return self.k_len - self.q_len


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(t, name: str, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {_shape(t)}")


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {t.dtype}")


def _check_same_device(named: dict[str, torch.Tensor]) -> None:
    devices = {n: t.device for n, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def check_attention_inputs(q, k, v) -> tuple[int, int, int]:
    """Validate `q [T, Hq, D]`, `k, v [Tk, Hkv, D]`; returns `(Hq, Hkv, D)`."""
    _check_tensor(q, "q", 3, "[T, Hq, D]")
    _check_tensor(k, "k", 3, "[Tk, Hkv, D]")
    _check_tensor(v, "v", 3, "[Tk, Hkv, D]")
    _check_float(q, "q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _check_same_device({"q": q, "k": k, "v": v})
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q heads Hq={hq} must be a positive multiple of k heads Hkv={hkv} (q {_shape(q)}, "
                         f"k {_shape(k)})")
    if k.shape[2] != d:
        raise ValueError(f"k must have shape [Tk, Hkv, D] with D={d} (q's head dim), got {_shape(k)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape [Tk, Hkv, D] = {_shape(k)}, got {_shape(v)}")
    if d == 0:
        raise ValueError(f"q must have a nonzero head dim D, got {_shape(q)}")
    return hq, hkv, d


def check_index_inputs(qi, ki, *, num_kv_heads: int | None = None, num_queries: int | None = None,
                       num_keys: int | None = None) -> tuple[int, int]:
    """Validate `qi [T, Hi, Di]`, `ki [Tk, Di]`; returns `(Hi, Di)`.

    `num_kv_heads` (Hkv), `num_queries` (T) and `num_keys` (Tk), when given, must match.
    """
    _check_tensor(qi, "qi", 3, "[T, Hi, Di]")
    _check_tensor(ki, "ki", 2, "[Tk, Di]")
    _check_float(qi, "qi")
    if ki.dtype != qi.dtype:
        raise ValueError(f"qi and ki must share one dtype, got qi {qi.dtype}, ki {ki.dtype}")
    _check_same_device({"qi": qi, "ki": ki})
    hi, di = qi.shape[1], qi.shape[2]
    if hi == 0 or di == 0:
        raise ValueError(f"qi must have shape [T, Hi, Di] with Hi, Di > 0, got {_shape(qi)}")
    if ki.shape[1] != di:
        raise ValueError(f"ki must have shape [Tk, Di] with Di={di} (qi's index head dim), got {_shape(ki)}")
    if num_kv_heads is not None and hi != num_kv_heads:
        raise ValueError(f"qi must have shape [T, Hi, Di] with Hi == Hkv == {num_kv_heads}, got {_shape(qi)}")
    if num_queries is not None and qi.shape[0] != num_queries:
        raise ValueError(f"qi must have shape [T, Hi, Di] with T={num_queries} (q's tokens), got {_shape(qi)}")
    if num_keys is not None and ki.shape[0] != num_keys:
        raise ValueError(f"ki must have shape [Tk, Di] with Tk={num_keys} (k's tokens), got {_shape(ki)}")
    return hi, di


def check_block_params(*, block_size, topk=None, local_blocks=None) -> None:
    """`block_size >= 1`, `topk >= 1`, `0 <= local_blocks <= topk` (all Python ints)."""
    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if topk is not None and (not is_int(topk) or topk < 1):
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if local_blocks is not None:
        if not is_int(local_blocks) or local_blocks < 0:
            raise ValueError(f"local_blocks must be an int >= 0, got {local_blocks!r}")
        if topk is not None and local_blocks > topk:
            raise ValueError(f"local_blocks must be <= topk={topk}, got {local_blocks}")


def check_scale(scale, name: str = "scale") -> None:
    """`scale` is None or a finite positive number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be None or a finite positive float, got {scale!r}")


def _check_cu(cu, name: str, total: int) -> list[int]:
    _check_tensor(cu, name, 1, "[B + 1]")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor of shape [B + 1], got {cu.dtype}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must have shape [B + 1] with B >= 1, got {_shape(cu)}")
    values = host_list(cu, name)
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the number of tokens {total}, got {values[-1]}")
    return values


def check_workspace(workspace) -> None:
    """`workspace` (the reference's bound on elements per chunk intermediate) is an int >= 1."""
    if isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1:
        raise ValueError(f"workspace must be an int >= 1 (elements per chunk intermediate), got {workspace!r}")


def check_seqlens(cu_seqlens, num_queries: int, cu_seqlens_k=None, num_keys: int | None = None,
                  *, device: torch.device | None = None) -> list[Segment]:
    """Validate `cu_seqlens` (ends at `num_queries`) and `cu_seqlens_k` (ends at `num_keys`; defaults to
    `cu_seqlens`); returns one `Segment` per sequence. Each sequence needs `q_len <= k_len`."""
    num_keys = num_queries if num_keys is None else num_keys
    cu_q = _check_cu(cu_seqlens, "cu_seqlens", num_queries)
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on the inputs' device {device}, got {cu_seqlens.device}")
    if cu_seqlens_k is None:
        if num_keys != num_queries:
            raise ValueError(f"cu_seqlens_k is required when k has {num_keys} tokens and q has {num_queries}")
        cu_k = cu_q
    else:
        cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", num_keys)
        if device is not None and cu_seqlens_k.device != device:
            raise ValueError(f"cu_seqlens_k must be on the inputs' device {device}, got {cu_seqlens_k.device}")
        if len(cu_k) != len(cu_q):
            raise ValueError(f"cu_seqlens_k must have shape [B + 1] = [{len(cu_q)}] like cu_seqlens, "
                             f"got [{len(cu_k)}]")
    segments = []
    for b in range(len(cu_q) - 1):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if q_len > k_len:
            raise ValueError(f"cu_seqlens_k: sequence {b} has {q_len} queries but only {k_len} keys "
                             f"(queries must be the last tokens of their sequence)")
        segments.append(Segment(cu_q[b], q_len, cu_k[b], k_len))
    return segments


def query_positions(segments: list[Segment], device) -> torch.Tensor:
    """Absolute position of every query token inside its sequence, int64 `[T]`."""
    parts = [torch.arange(s.offset, s.k_len, device=device) for s in segments]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def check_block_idx(block_idx, *, num_heads: int, segments: list[Segment], block_size: int,
                    topk: int | None = None, values: bool = True) -> None:
    """Validate `block_idx int32 [Hi, T, topk]`.

    With `values=True` also checks every entry: `-1` or a block the query can see (`0 <= j` and
    `j * block_size <= position`, which implies `j` < the sequence's number of key blocks), each valid block at
    most once per (head, query), and `-1` only in trailing slots.
    """
    num_queries = sum(s.q_len for s in segments)
    layout = f"[Hi, T, topk] = [{num_heads}, {num_queries}, {'topk' if topk is None else topk}]"
    _check_tensor(block_idx, "block_idx", 3, layout)
    if block_idx.dtype != torch.int32:
        raise ValueError(f"block_idx must be an int32 tensor of shape {layout}, got {block_idx.dtype}")
    if block_idx.shape[0] != num_heads or block_idx.shape[1] != num_queries or block_idx.shape[2] == 0 or (
            topk is not None and block_idx.shape[2] != topk):
        raise ValueError(f"block_idx must have shape {layout} (topk >= 1), got {_shape(block_idx)}")
    if not values or num_queries == 0:
        return
    idx = block_idx.long()
    if bool((idx < -1).any()):
        raise ValueError(f"block_idx entries must be -1 or a block number >= 0, got min {int(idx.min())}")
    pos = query_positions(segments, block_idx.device)
    seq_blocks = torch.cat([torch.full((s.q_len,), -(-s.k_len // block_size), device=block_idx.device)
                            for s in segments])
    too_big = idx >= seq_blocks[None, :, None]
    if bool(too_big.any()):
        h, t, j = (int(x) for x in too_big.nonzero()[0])
        raise ValueError(f"block_idx[{h}, {t}, {j}] = {int(idx[h, t, j])} is out of range: the sequence has "
                         f"{int(seq_blocks[t])} blocks of {block_size} keys")
    future = idx * block_size > pos[None, :, None]
    if bool(future.any()):
        h, t, j = (int(x) for x in future.nonzero()[0])
        raise ValueError(f"block_idx[{h}, {t}, {j}] = {int(idx[h, t, j])} is causally invisible to query {t} at "
                         f"position {int(pos[t])} (block starts at {int(idx[h, t, j]) * block_size})")
    invalid = idx < 0
    if bool((invalid[..., :-1] & ~invalid[..., 1:]).any()):
        raise ValueError("block_idx must hold -1 only in trailing slots (valid blocks left-packed)")
    ordered = idx.sort(dim=-1).values
    if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
        raise ValueError("block_idx must list each valid block at most once per (head, query)")


def _check_normaliser(t, name: str, dims: str, shape: tuple[int, int], dtypes: tuple, device) -> None:
    """`t` (a log-sum-exp table) is a tensor of `shape` (named `dims`), one of `dtypes`, on `device`."""
    layout = f"[{dims}] = [{shape[0]}, {shape[1]}]"
    kinds = "float32" + (" (or float64)" if torch.float64 in dtypes else "")
    _check_tensor(t, name, 2, layout)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {layout}, got {_shape(t)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {kinds} of shape {layout}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {t.device}")


def check_lse(lse, num_queries: int, num_heads: int, device) -> None:
    """`lse` is None or fp32 `[T, Hq]`."""
    if lse is not None:
        _check_normaliser(lse, "lse", "T, Hq", (num_queries, num_heads), (torch.float32, torch.float64), device)


def check_indexer_kl_inputs(q, k, qi, ki, block_idx, cu_seqlens, cu_seqlens_k, lse, *, block_size, scale,
                            index_scale, block_idx_values: bool = True, index_lse=None
                            ) -> tuple[int, int, int, int, list[Segment]]:
    """Validate the arguments of `indexer_kl` (every backend); returns `(Hq, Hkv, D, Di, segments)`.

    `block_idx` may be None (dense warm-up); `block_idx_values=False` skips its value checks (see
    `check_block_idx`). `index_lse` is None or fp32 [Hi, T], and only with a block_idx.
    """
    hq, hkv, d = check_attention_inputs(q, k, k)
    _, di = check_index_inputs(qi, ki, num_kv_heads=hkv, num_queries=q.shape[0], num_keys=k.shape[0])
    if qi.device != q.device:
        raise ValueError(f"qi, ki must be on q's device {q.device}, got {qi.device}")
    check_block_params(block_size=block_size)
    check_scale(scale)
    check_scale(index_scale, "index_scale")
    segments = check_seqlens(cu_seqlens, q.shape[0], cu_seqlens_k, k.shape[0], device=q.device)
    if block_idx is not None:
        if block_idx.device != q.device:
            raise ValueError(f"block_idx must be on q's device {q.device}, got {block_idx.device}")
        check_block_idx(block_idx, num_heads=hkv, segments=segments, block_size=block_size,
                        values=block_idx_values)
    check_lse(lse, q.shape[0], hq, q.device)
    if index_lse is not None:
        if block_idx is None:
            raise ValueError("index_lse: only for the sparse KL (a block_idx); the dense warm-up computes its own")
        _check_normaliser(index_lse, "index_lse", "Hi, T", (hkv, q.shape[0]), (torch.float32,), q.device)
    return hq, hkv, d, di, segments
