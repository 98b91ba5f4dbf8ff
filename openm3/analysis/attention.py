"""What attention does inside an openm3 model: captured queries/keys, attention maps and indexer recall.

`capture_attention(model)` hooks every `openm3.layers.attention.Attention` module and records, per layer and per
forward, the main-branch `q [T, Hq, D]`, `k [T, Hkv, D]` (after QK-norm and RoPE) and, for MSA layers, the
index-branch `qi [T, Hi, Di]`, `ki [T, Di]`, recomputed from the layer's own projections on its input.

**Indexer recall** of an MSA layer = for each query and head, the share of its *dense* causal softmax attention
mass that falls on keys inside the blocks the indexer selected for the head's group; averaged over queries and
heads. 1.0 means the sparse layer sees everything dense attention would have looked at.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass
class CapturedLayer:
    layer_idx: int
    is_sparse: bool
    q: torch.Tensor
    k: torch.Tensor
    qi: torch.Tensor | None
    ki: torch.Tensor | None
    cu_seqlens: torch.Tensor


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from ..layers.attention import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[list[CapturedLayer]]:
    """Record q, k (and qi, ki) of every attention layer for forwards run inside the block."""
    from ..layers.rope import apply_rope

    records: list[CapturedLayer] = []

    def hook(module, args, output):
        x, cos, sin, cu_seqlens = args[:4]
        t = x.shape[0]
        with torch.no_grad():
            q = apply_rope(module.q_norm(module.q_proj(x).view(t, module.num_heads, module.head_dim)), cos, sin)
            k = apply_rope(module.k_norm(module.k_proj(x).view(t, module.num_kv_heads, module.head_dim)), cos, sin)
            qi = ki = None
            if module.is_sparse:
                qi, ki = module.indexer(x, cos, sin)
        records.append(CapturedLayer(module.layer_idx, module.is_sparse, q.float(), k.float(),
                                     None if qi is None else qi.float(), None if ki is None else ki.float(),
                                     cu_seqlens))

    handles = [m.register_forward_hook(hook) for m in _attention_modules(model)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


def dense_probs(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention of one sequence. `q [T, Hq, D]`, `k [T, Hkv, D]` -> probs `[Hq, T, T]`."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kk.float()) * (scale if scale is not None else d ** -0.5)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~causal, float("-inf")).softmax(-1)


def block_mask(block_idx: torch.Tensor, t: int, block_size: int) -> torch.Tensor:
    """Selected-key mask of one sequence: `block_idx int32 [Hi, T, topk]` (-1 unused) -> bool `[Hi, T, T]`."""
    n_blocks = (t + block_size - 1) // block_size
    chosen = torch.zeros(block_idx.shape[0], t, n_blocks + 1, dtype=torch.bool, device=block_idx.device)
    idx = block_idx.long().clone()
    idx[idx < 0] = n_blocks  # a spare column for unused slots
    chosen.scatter_(2, idx, True)
    key_block = torch.arange(t, device=block_idx.device) // block_size
    return chosen[:, :, key_block]


def sparse_probs(q: torch.Tensor, k: torch.Tensor, block_idx: torch.Tensor, block_size: int) -> torch.Tensor:
    """The attention an MSA layer computes on one sequence: causal softmax over the selected blocks only.
    `q [T, Hq, D]`, `k [T, Hkv, D]`, `block_idx [Hi, T, topk]` -> `[Hq, T, T]`."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    mask = block_mask(block_idx, t, block_size).repeat_interleave(group, dim=0)
    kk = k.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kk.float()) * d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~(causal & mask), float("-inf")).softmax(-1)


def indexer_recall(q: torch.Tensor, k: torch.Tensor, block_idx: torch.Tensor, cu_seqlens: torch.Tensor,
                   block_size: int) -> tuple[float, int]:
    """Summed recall over (query, head) pairs and their count, for a packed batch of one MSA layer.

    `q [T, Hq, D]`, `k [T, Hkv, D]`, `block_idx int32 [Hi, T, topk]` (block numbers from each sequence's start),
    `cu_seqlens int32 [B+1]`."""
    if block_idx.shape[1] != q.shape[0]:
        raise ValueError(f"block_idx must be [Hi, T={q.shape[0]}, topk], got {tuple(block_idx.shape)}")
    total, count = 0.0, 0
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        p = dense_probs(q[a:b], k[a:b])
        mask = block_mask(block_idx[:, a:b], b - a, block_size).repeat_interleave(group, dim=0)
        mass = (p * mask).sum(-1)  # [Hq, Tb]
        total += float(mass.sum())
        count += mass.numel()
    return total, count
