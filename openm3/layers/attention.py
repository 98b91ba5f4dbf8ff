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

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..ops import msa
from ..ops.attention import dense_attention
from ..ops.norm_rope import heads_norm_rope, inference_kernels
from .indexer import Indexer
from .joint_weights import join_rows, joint_matrix, rows_intact
from . import recompute
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
        self._fused_rows: tuple[int, ...] | None = None  # set by `fuse_projections`

    def _projections(self) -> list[nn.Linear]:
        index = [self.indexer.q_proj, self.indexer.k_proj] if self.indexer is not None else []
        return [self.q_proj, self.k_proj, self.v_proj, *index]

    def _norms(self) -> list[RMSNorm | None]:  # per head group of `_projections`: v has none
        index = [self.indexer.q_norm, self.indexer.k_norm] if self.indexer is not None else []
        return [self.q_norm, self.k_norm, None, *index]

    def fuse_projections(self) -> bool:
        """Inference layout: the q, k, v (and index q, k) projection weights become consecutive row blocks of one
        [N, hidden] matrix, so that `project` runs one GEMM and one norm-and-rotate kernel (`heads_norm_rope`)
        instead of five GEMMs, four norms and four rotations where the inference kernels run (CUDA, no gradient).

        The parameters keep their names, shapes and values (each is a view of the new matrix; no memory is added),
        so checkpoints load into them as before. Moving the module (`.to`) or replacing a weight undoes the layout
        and `project` falls back to the separate ops. Returns whether the layout was made (it needs one dtype and
        device, no biases, and index heads as wide as the main ones)."""
        projs = self._projections()
        if self._fused_intact():
            return True
        if any(p.bias is not None for p in projs) \
                or (self.indexer is not None and self.indexer.head_dim != self.head_dim) \
                or len({n.eps for n in self._norms() if n is not None}) != 1:
            return False
        rows = join_rows([p.weight for p in projs])
        if rows is not None:
            self._fused_rows = rows
        return rows is not None

    def _fused_intact(self) -> bool:
        """Whether the projection weights still lie back to back in one storage, as `fuse_projections` left
        them."""
        return rows_intact([p.weight for p in self._projections()], self._fused_rows)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor, *,
                compute_kl: bool = False, dense_warmup: bool = False, index_input_grad: bool | None = None,
                return_block_idx: bool = False, cache: Any = None) -> AttentionOutput:
        """x: [T, hidden]; cos, sin: [T, rotary_dim]; cu_seqlens: int32 [B+1].

        compute_kl: also return the indexer KL (MSA layers). In the sparse stage the indexer then reads a detached
        copy of x, so the KL trains only the index branch (DESIGN.md); in the dense warm-up its gradient also
        reaches the backbone through x. index_input_grad: whether it does (None: that default of the stage; False
        in the warm-up: the KL trains the index branch only there too). dense_warmup: MSA layers attend densely
        and the KL is the dense warm-up variant (over all causal tokens). cache: see the module docstring.

        Under `torch.compile` the projections, norms and RoPE (`project`) and `o_proj` are traced; only `attend`,
        which reads `cu_seqlens` on the host and runs the varlen/MSA ops, is left to run eagerly.
        """
        grad_to_x = dense_warmup if index_input_grad is None else index_input_grad
        q, k, v, qi, ki = self.project(x, cos, sin, detach_index_input=compute_kl and not grad_to_x)
        o, kl, block_idx = self.attend(q, k, v, qi, ki, cu_seqlens, compute_kl=compute_kl, dense_warmup=dense_warmup,
                                       return_block_idx=return_block_idx, cache=cache)
        # the width spelt out: with T = 0 tokens, -1 would be ambiguous
        return AttentionOutput(self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim)), kl, block_idx)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, detach_index_input: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """x: [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] (q, k normed and rotated) and, for MSA layers,
        qi [T, Hi, Di], ki [T, Di] (None for dense layers). detach_index_input: the indexer reads `x.detach()`."""
        t = x.shape[0]
        if self._fused_rows is not None and inference_kernels(x, self.q_proj.weight) \
                and x.dtype == self.q_proj.weight.dtype and self._fused_intact():
            return self._project_fused(x, cos, sin)
        q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        qi = ki = None
        if self.is_sparse:
            qi, ki = self.indexer(x.detach() if detach_index_input else x, cos, sin)
        return q, k, v, qi, ki

    def _project_fused(self, x, cos, sin):
        """`project` after `fuse_projections`: one GEMM over the weights' joint matrix, one kernel for the heads."""
        whole = joint_matrix(self.q_proj.weight, self._fused_rows)
        heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        if self.indexer is not None:
            heads += [self.indexer.num_heads, 1]
        norms = self._norms()
        parts = heads_norm_rope(nn.functional.linear(x, whole), heads, self.head_dim,
                                [n.weight if n is not None else None for n in norms],
                                [n is not None for n in norms], cos, sin, self.q_norm.eps)
        q, k, v = parts[:3]
        qi, ki = (parts[3], parts[4][:, 0]) if self.indexer is not None else (None, None)
        return q, k, v, qi, ki

    # Dynamo does not trace this: the varlen dense path, the MSA ops' input checks and the cache read `cu_seqlens`
    # on the host and loop over sequences, which would break the graph at data-dependent points and recompile for
    # every new packing. The ops are opaque calls with their own backward either way, so nothing fusable is lost.
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qi: torch.Tensor | None,
               ki: torch.Tensor | None, cu_seqlens: torch.Tensor, *, compute_kl: bool = False,
               dense_warmup: bool = False, return_block_idx: bool = False, cache: Any = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The attention itself on `project`'s outputs: (o [T, Hq, D], kl or None, block_idx or None); the
        arguments mean what they mean in `forward`."""
        if cache is not None:
            sparse = dict(block_size=self.block_size, topk=self.topk, local_blocks=self.local_blocks) \
                if self.is_sparse else dict(block_size=None, topk=None, local_blocks=None)
            return cache.attend(self.layer_idx, q, k, v, qi, ki, cu_seqlens=cu_seqlens, scale=self.scale,
                                **sparse), None, None

        # Under activation checkpointing with `recompute.reuse_contexts`, the backward's recomputation of this layer
        # takes the forward's selection back and skips the KL, and with `keep_attention` the attention too (see
        # openm3.layers.recompute).
        once = recompute.kept_attention
        reuse = recompute.current_msa()
        if not self.is_sparse:
            return once(lambda: (dense_attention(q, k, v, cu_seqlens, scale=self.scale),))[0], None, None

        block_idx = kl = index_lse = None
        if not dense_warmup or return_block_idx:
            if reuse is not None and reuse.replaying:
                block_idx, index_lse = reuse.take()
            else:
                # The sparse KL's student normaliser comes with the selection when the backend computes it on the
                # way (else None and the KL computes it).
                want_lse = compute_kl and not dense_warmup
                selected = msa.select_blocks(qi.detach(), ki.detach(), cu_seqlens, block_size=self.block_size,
                                             topk=self.topk, local_blocks=self.local_blocks,
                                             return_index_lse=want_lse)
                block_idx, index_lse = selected if want_lse else (selected, None)
                if reuse is not None:
                    reuse.put((block_idx, index_lse))
        if dense_warmup:
            o, = once(lambda: (dense_attention(q, k, v, cu_seqlens, scale=self.scale),))
            if compute_kl:
                kl = _kl_once(reuse, lambda: msa.indexer_kl(q.detach(), k.detach(), qi, ki, None, cu_seqlens,
                                                            block_size=self.block_size, scale=self.scale))
        elif compute_kl and _kl_in_backward(reuse, q):
            # inside `kl_in_backward`: the KL runs in the attention's backward (its value is written there)
            o, _, kl = once(lambda: msa.sparse_attention_with_kl(
                q, k, v, qi, ki, block_idx, cu_seqlens, block_size=self.block_size, scale=self.scale,
                validate_block_idx=False, index_lse=index_lse))
        else:
            # block_idx comes from select_blocks just above: its value checks (host syncs) are skipped
            o, lse = once(lambda: msa.sparse_attention(q, k, v, block_idx, cu_seqlens, block_size=self.block_size,
                                                       scale=self.scale, validate_block_idx=False))
            if compute_kl:
                kl = _kl_once(reuse, lambda: msa.indexer_kl(q.detach(), k.detach(), qi, ki, block_idx, cu_seqlens,
                                                            block_size=self.block_size, scale=self.scale,
                                                            lse=lse.detach(), validate_block_idx=False,
                                                            index_lse=index_lse))
        values = _KL_VALUES.get()
        if kl is not None and values is not None:
            values.append(kl.detach())  # shares kl's storage: a value the backward writes shows here after it
        return o, kl, block_idx if return_block_idx else None


# The list `kl_in_backward` collects the MSA layers' KL values into (None outside it).
_KL_VALUES: ContextVar[list | None] = ContextVar("openm3_kl_values", default=None)


@contextmanager
def kl_in_backward() -> Iterator[list[torch.Tensor]]:
    """Inside this context, the sparse-stage MSA layers that compute the indexer KL (without activation
    checkpointing, or with it through `recompute.reuse_contexts`) run it inside the attention's backward
    (`msa.sparse_attention_with_kl`: on the Triton backend the dk/dv kernel computes the KL's teacher on the way,
    so the forward's teacher pass goes), and every MSA layer's KL appends its value tensor to the yielded list.
    The KL's gradients are unchanged; its value is written by the backward: the model output's `indexer_kl` is 0
    in a forward run here on the Triton backend, and `torch.stack(values).mean()` after the backward is the value.
    The training loop uses it (`TrainConfig.kl_in_backward`)."""
    values: list[torch.Tensor] = []
    token = _KL_VALUES.set(values)
    try:
        yield values
    finally:
        _KL_VALUES.reset(token)


def _kl_in_backward(reuse: "recompute.CheckpointReuse | None", q: torch.Tensor) -> bool:
    """Whether this layer's KL runs in the attention's backward: inside `kl_in_backward`. A checkpointed call's
    forward records the answer and its recomputation (which runs in the backward, outside that context) replays
    it, so both build the same autograd node (`sparse_attention_with_kl`); the KL value the backward writes lands
    in the forward's output, which the context's list holds. Checkpointed on the reference backend, no: its
    `sparse_attention_with_kl` computes the KL in the forward, which the recomputation would then run again
    (`_kl_once` runs it once)."""
    if reuse is not None and reuse.replaying:
        return reuse.take()
    on = _KL_VALUES.get() is not None and (reuse is None or msa.pick_backend(q) == "triton")
    if reuse is not None:
        reuse.put(on)
    return on


def _kl_once(reuse: "recompute.CheckpointReuse | None", run) -> torch.Tensor:
    """The indexer KL, computed once under activation checkpointing: the forward's KL node keeps its saved tensors
    (its gradients, for the Triton kernel) and the recomputation gets the forward's loss value back instead of
    running it again."""
    if reuse is None:
        return run()
    if reuse.replaying:
        return reuse.take()
    with reuse.keep_saved():
        kl = run()
    reuse.put(kl.detach())
    return kl


def fuse_projections(model: nn.Module) -> int:
    """`Attention.fuse_projections` on every attention layer of `model` (an inference set-up step: `openm3
    generate` and `openm3 serve` call it on the models they load). Returns how many layers took the layout."""
    return sum(m.fuse_projections() for m in model.modules() if isinstance(m, Attention))
