"""Partial rotary position embedding (rotate-half form) over the first `rotary_dim` channels of a head."""

from __future__ import annotations

import torch

from ..ops.norm_rope import inference_kernels, rope


def rope_cos_sin(position_ids: torch.Tensor, rotary_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for the given positions.

    position_ids: [T] integer positions. Returns (cos, sin), each [T, rotary_dim], laid out as
    `cat(freqs, freqs)` so that `apply_rope` pairs channel i with channel i + rotary_dim / 2.
    Frequencies are computed in fp32 (as transformers does) and cast to `dtype` at the end.
    """
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids must be [T], got shape {tuple(position_ids.shape)}")
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=position_ids.device)
                                / rotary_dim))
    freqs = position_ids[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `n = min(cos.shape[-1], x.shape[-1])` channels of every head; pass the rest through.

    x: [T, H, D]; cos, sin: [T, R] from `rope_cos_sin`. When R > D (an index head narrower than the rotary width)
    only the first D entries of the tables are used, exactly as transformers does for the M3 indexer.
    """
    if inference_kernels(x, cos, sin):  # one Triton kernel (CUDA, no gradient; `openm3.ops.norm_rope`)
        return rope(x, cos, sin)
    n = min(cos.shape[-1], x.shape[-1])
    c = cos[:, None, :n].to(x.dtype)
    s = sin[:, None, :n].to(x.dtype)
    x_rot, x_pass = x[..., :n], x[..., n:]
    return torch.cat((x_rot * c + _rotate_half(x_rot) * s, x_pass), dim=-1)
