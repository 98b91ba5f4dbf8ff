"""Dense causal attention over a packed varlen batch, one `F.scaled_dot_product_attention` call per sequence.

Layout as in FlashAttention's varlen API: `q [T, Hq, D]`, `k, v [Tk, Hkv, D]`, `cu_seqlens int32 [B+1]` (query
offsets) and optionally `cu_seqlens_k int32 [B+1]` (key offsets; defaults to `cu_seqlens`). The queries of
sequence b are the LAST `q_len_b` of its `k_len_b` tokens (bottom-right causal alignment), so query i may see keys
`0 .. k_len_b - q_len_b + i`. GQA: query head h reads KV head `h // (Hq // Hkv)`. SDPA picks the fused backend
(flash / cuDNN / memory-efficient on CUDA, the CPU kernel otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..host import host_list


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens") -> list[int]:
    """Validate `cu_seqlens int32 [B+1]` (starts at 0, non-decreasing, ends at `total`); returns it as a list."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"{name} must be an int32 tensor [B+1] with B >= 1, got {shape}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu_seqlens.dtype}")
    offsets = host_list(cu_seqlens, name)
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at T={total}, got {offsets}")
    return offsets


def expand_kv_heads(device_type: str, dtype: torch.dtype, masked: bool) -> bool:
    """Whether SDPA gets K / V repeated to the query heads instead of `enable_gqa`: on CUDA only flash (fp16 /
    bf16, no mask) and cuDNN take `enable_gqa`; an fp32 sequence or one with a mask would fall back to the math
    kernel, which holds the [Hq, q_len, k_len] scores (and saves them for the backward): O(S^2) memory, 2 GiB per
    sequence of 8K tokens at 8 heads in fp32. The repeated K / V (O(S)) let the memory-efficient kernel run."""
    return device_type == "cuda" and (masked or dtype not in (torch.float16, torch.bfloat16))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                    scale: float | None = None, cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention per packed sequence.

    q: [T, Hq, D]; k, v: [Tk, Hkv, D]; cu_seqlens: int32 [B+1] over T; cu_seqlens_k: int32 [B+1] over Tk (None:
    same as cu_seqlens, which needs Tk == T). scale defaults to 1/sqrt(D). Returns o: [T, Hq, D] in q's dtype.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [T, H, D] tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of k heads ({hkv})")
    if k.shape[2] != d or v.shape != k.shape:
        raise ValueError(f"k, v must be [Tk, {hkv}, {d}] like each other, got {tuple(k.shape)}, {tuple(v.shape)}")
    q_offsets = check_cu_seqlens(cu_seqlens, q.shape[0], "cu_seqlens")
    if cu_seqlens_k is None:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens but q has {q.shape[0]}: pass cu_seqlens_k")
        k_offsets = q_offsets
    else:
        k_offsets = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        if len(k_offsets) != len(q_offsets):
            raise ValueError(f"cu_seqlens_k must have B+1={len(q_offsets)} entries, got {len(k_offsets)}")

    outs = []
    for b in range(len(q_offsets) - 1):
        qs, qe, ks, ke = q_offsets[b], q_offsets[b + 1], k_offsets[b], k_offsets[b + 1]
        q_len, k_len = qe - qs, ke - ks
        if q_len > k_len:
            raise ValueError(f"sequence {b} has {q_len} queries but only {k_len} keys (cu_seqlens_k too short)")
        if q_len == 0:
            continue
        qb = q[qs:qe].transpose(0, 1).unsqueeze(0)
        kb = k[ks:ke].transpose(0, 1).unsqueeze(0)
        vb = v[ks:ke].transpose(0, 1).unsqueeze(0)
        masked = 1 < q_len < k_len
        gqa = hq != hkv
        if gqa and expand_kv_heads(q.device.type, q.dtype, masked):
            kb, vb, gqa = kb.repeat_interleave(hq // hkv, 1), vb.repeat_interleave(hq // hkv, 1), False
        if q_len == k_len:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        elif not masked:  # one decode query sees every key: no mask
            ob = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=gqa)
        else:
            pos = torch.arange(k_len - q_len, k_len, device=q.device)
            mask = torch.arange(k_len, device=q.device)[None, :] <= pos[:, None]
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(ob[0].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else torch.empty_like(q)
