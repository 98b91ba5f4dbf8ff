"""The MSA index branch: small index queries and one shared index key head, normalised and rotated."""

from __future__ import annotations

import torch
from torch import nn

from .norm import RMSNorm
from .rope import apply_rope


class Indexer(nn.Module):
    """x [T, hidden] -> (qi [T, Hi, Di], ki [T, Di]).

    `q_proj` gives Hi index-query heads and `k_proj` one index-key head; each gets a per-head RMSNorm and then the
    same partial RoPE as the main branch (the first `min(rotary_dim, Di)` channels). Scoring and block selection
    happen in `openm3.ops.msa.select_blocks`; the branch has no value path and no output of its own.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        qi = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        ki = self.k_norm(self.k_proj(x).view(t, 1, self.head_dim))
        return apply_rope(qi, cos, sin), apply_rope(ki, cos, sin)[:, 0]
