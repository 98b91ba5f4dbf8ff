"""M3 self-attention: per-head QK RMSNorm, partial RoPE, and dense or MSA (block-sparse) attention.

Inference cache protocol (implemented by `openm3.engine`, which models never import)
------------------------------------------------------------------------------------
`M3TextModel.forward(..., cache=obj)` passes `obj` down to every attention layer. A layer then computes, for the
NEW tokens only (`x [T_new, hidden]`, `position_ids` = their absolute positions, `cu_seqlens` over the new tokens
of each sequence):

- `q [T_new, Hq, D]`, `k, v [T_new, Hkv, D]`, after QK-norm and RoPE;
- for MSA layers, `qi [T_new, Hi, Di]` and `ki [T_new, Di]`, after norm and RoPE (`None` for dense layers);

and calls

    o = cache.attend(layer_idx, q, k, v, qi, ki, cu_seqlens=cu_seqlens, scale=scale,
                     block_size=block_size, topk=topk, local_blocks=local_blocks)

where `scale = 1/sqrt(D)` and `block_size`, `topk`, `local_blocks` are the layer's MSA settings (`None` for dense
layers). The cache stores k, v (and ki) of the new tokens, attends each new query to its sequence's cached
history plus the new tokens (causal, bottom-right aligned; MSA layers select blocks with qi against all cached
index keys, exactly as `openm3.ops.msa`), and returns `o [T_new, Hq, D]`, which the layer uses in place of its
own attention output. No indexer KL and no block selections are produced on this path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ops import msa
from ..ops.attention import dense_attention
from .indexer import Indexer
from .norm import RMSNorm
from .rope import apply_rope


@dataclass
class AttentionOutput:
    """out: [T, hidden]; kl: scalar indexer KL (MSA layers asked for it) or None;
    block_idx: int32 [Hi, T, topk] (MSA layers asked for it) or None."""

    out: torch.Tensor
    kl: torch.Tensor | None = None
    block_idx: torch.Tensor | None = None


class Attention(nn.Module):
    """x [T, hidden] -> AttentionOutput; dense causal attention or MSA depending on `config.layer_types`."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.is_sparse = config.layer_types[layer_idx] == "minimax_m3_sparse"
        self.indexer = None
        if self.is_sparse:
            self.block_size = config.index_block_size
            self.topk = config.index_topk_blocks
            self.local_blocks = config.index_local_blocks
            self.indexer = Indexer(h, config.index_n_heads, config.index_head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, *,
                compute_kl: bool = False, dense_warmup: bool = False, return_block_idx: bool = False,
                cache: Any = None) -> AttentionOutput:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]; cu_seqlens: int32 [B+1].

        compute_kl: also return the indexer KL (MSA layers). In the sparse stage the indexer then reads a detached
        copy of x, so the KL trains only the index branch (DESIGN.md); in the dense warm-up its gradient also
        reaches the backbone through x. dense_warmup: MSA layers attend densely and the KL is the dense warm-up
        variant (over all causal tokens). cache: see the module docstring.
        """
        t = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        qi = ki = None
        if self.is_sparse:
            qi, ki = self.indexer(x.detach() if compute_kl and not dense_warmup else x, cos, sin)

        if cache is not None:
            sparse = dict(block_size=self.block_size, topk=self.topk, local_blocks=self.local_blocks) \
                if self.is_sparse else dict(block_size=None, topk=None, local_blocks=None)
            o = cache.attend(self.layer_idx, q, k, v, qi, ki, cu_seqlens=cu_seqlens, scale=self.scale, **sparse)
            return AttentionOutput(self.o_proj(o.reshape(t, -1)))

        if not self.is_sparse:
            o = dense_attention(q, k, v, cu_seqlens, scale=self.scale)
            return AttentionOutput(self.o_proj(o.reshape(t, -1)))

        block_idx = kl = None
        if not dense_warmup or return_block_idx:
            block_idx = msa.select_blocks(qi.detach(), ki.detach(), cu_seqlens, block_size=self.block_size,
                                          topk=self.topk, local_blocks=self.local_blocks)
        if dense_warmup:
            o = dense_attention(q, k, v, cu_seqlens, scale=self.scale)
            if compute_kl:
                kl = msa.indexer_kl(q.detach(), k.detach(), qi, ki, None, cu_seqlens, block_size=self.block_size,
                                    scale=self.scale)
        else:
            o, lse = msa.sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=self.block_size,
                                          scale=self.scale)
            if compute_kl:
                kl = msa.indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, cu_seqlens,
                                    block_size=self.block_size, scale=self.scale, lse=lse.detach())
        return AttentionOutput(self.o_proj(o.reshape(t, -1)), kl, block_idx if return_block_idx else None)
