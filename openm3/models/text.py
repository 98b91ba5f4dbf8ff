"""The M3 text decoder over packed varlen batches.

Tokens of B sequences are packed into one dimension: `input_ids [T]`, `cu_seqlens int32 [B+1]` (sequence b is
`cu_seqlens[b]:cu_seqlens[b+1]`), `position_ids [T]` restarting at 0 for each sequence. Each layer is pre-RMSNorm
attention (dense or MSA, `openm3.layers.attention`) then pre-RMSNorm MLP (dense SwiGLU-OAI or MoE); a final norm
and `lm_head` give logits.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers.attention import Attention
from ..layers.mlp import DenseMLP
from ..layers.moe import MoE, Router, Experts, load_balancing_loss
from ..layers.norm import RMSNorm
from ..layers.recompute import CheckpointSwitch
from ..layers.rope import rope_cos_sin
from ..ops.attention import check_cu_seqlens
from ..ops.host import check_not_meta
from ..ops.losses import IGNORE_INDEX, causal_lm_loss
from .config import M3TextConfig


@dataclass
class M3TextOutput:
    """What `M3TextModel.forward` returns.

    logits: [T, V] (or [N, V] for `logits_index [N]`).
    indexer_kl: scalar, the indexer KL averaged over MSA layers (when asked for; 0 without MSA layers).
    aux_loss: scalar load-balancing loss over MoE layers (when asked for).
    router_logits: per MoE layer [T, E] (when asked for).
    block_idx: per layer, int32 [Hi, T, topk] for MSA layers and None for dense ones (when asked for).
    loss: scalar fp32 next-token cross-entropy of `labels` (when given; `openm3.ops.losses.causal_lm_loss`). It is
    the language-model loss alone: `indexer_kl` and `aux_loss` are not added to it.
    """

    logits: torch.Tensor
    indexer_kl: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    block_idx: tuple[torch.Tensor | None, ...] | None = None
    loss: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """x [T, hidden] -> (x, indexer KL or None, router logits [T, E] or None, block_idx or None)."""

    def __init__(self, config: M3TextConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        if self.is_moe:
            self.mlp = MoE(config.hidden_size, config.intermediate_size, config.shared_intermediate_size,
                           config.num_local_experts, config.num_experts_per_tok, config.routed_scaling_factor,
                           config.swiglu_alpha, config.swiglu_limit)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.dense_intermediate_size, config.swiglu_alpha,
                                config.swiglu_limit)

    # Under `torch.compile` of the layer (openm3.train.distributed.apply_compile) all of it is traced except
    # `Attention.attend`: the q/k/v projections, QK-norm, partial RoPE, the indexer's projections, norms and RoPE,
    # o_proj, the norms, residuals and the MLP or the MoE are compiled; only the attention ops themselves (dense
    # varlen, MSA select/attend/KL, or the inference cache), which read `cu_seqlens` on the host, run eagerly.
    def forward(self, x, cos, sin, cu_seqlens, compute_kl, dense_warmup, index_input_grad, return_block_idx, cache):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, compute_kl=compute_kl,
                              dense_warmup=dense_warmup, index_input_grad=index_input_grad,
                              return_block_idx=return_block_idx, cache=cache)
        x, h = self.post_attention_layernorm.add_forward(x, attn.out)  # the residual add and the norm
        if self.is_moe:  # the residual add inside the MoE's last kernel in inference
            x, router_logits = self.mlp(h, residual=x)
        else:
            x, router_logits = x + self.mlp(h), None
        return x, attn.kl, router_logits, attn.block_idx


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, *, read_range: bool = True) -> None:
    """`input_ids` must be a 1-D int tensor [T] with ids in [0, vocab_size). The range check reads the ids' minimum
    and maximum back (one device sync for a GPU tensor; free on the host); `read_range=False` skips it."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a 1-D int tensor [T], got {type(input_ids).__name__}")
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be an int tensor [T] of one dimension (a batch's sequences packed end to "
                         f"end, their boundaries in cu_seqlens), got shape {tuple(input_ids.shape)}"
                         + ("; for B rows of length T pass input_ids.flatten() and "
                            "cu_seqlens=torch.arange(B + 1, dtype=torch.int32) * T" if input_ids.dim() == 2 else ""))
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    check_not_meta(input_ids, "input_ids")
    if read_range and input_ids.numel():
        lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got [{lo}, {hi}]")


def check_position_ids(position_ids: torch.Tensor, num_tokens: int, max_positions: int) -> None:
    """`position_ids` must be an int tensor [T] (not bool). On the host their values must also lie in
    [0, max_positions) (one min/max over T ints); a GPU tensor's values are not read (that would wait for the
    device on every forward)."""
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"position_ids must be an int tensor [T={num_tokens}], got {type(position_ids).__name__}")
    dtype = position_ids.dtype
    if position_ids.shape != (num_tokens,) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"position_ids must be an int tensor [T={num_tokens}], got {dtype} "
                         f"{tuple(position_ids.shape)}")
    check_not_meta(position_ids, "position_ids")
    if position_ids.device.type == "cpu" and num_tokens:
        lo, hi = torch.stack(torch.aminmax(position_ids)).tolist()
        if lo < 0 or hi >= max_positions:
            raise ValueError(f"position_ids must lie in [0, max_position_embeddings={max_positions}), "
                             f"got [{lo}, {hi}]" + ("; raise config.max_position_embeddings to go past it (the "
                                                    "rotary embedding extrapolates, untrained)" if lo >= 0 else ""))


def check_labels(labels: torch.Tensor, num_tokens: int, device: torch.device, vocab_size: int) -> None:
    """`labels` must be an int tensor [T] on `device` (the inputs'), each a token id in [0, vocab_size) or -100
    (ignored). The range check reads the labels' minimum and maximum back (one device sync for a GPU tensor, as
    for `input_ids`: an id out of range would stop a GPU's cross-entropy kernel with a device-side assert)."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be an int tensor [T={num_tokens}], got {type(labels).__name__}")
    dtype = labels.dtype
    if labels.shape != (num_tokens,) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"labels must be an int tensor [T={num_tokens}] packed as input_ids / inputs_embeds rows "
                         f"(unshifted: the model shifts them inside each sequence of cu_seqlens), got {dtype} "
                         f"{tuple(labels.shape)}" + ("; for B rows of length T pass labels.flatten()"
                                                     if labels.dim() == 2 else ""))
    check_not_meta(labels, "labels")
    if labels.device != device:
        raise ValueError(f"labels must be on the inputs' device {device}, got {labels.device}")
    if num_tokens:
        lo, hi = torch.stack(torch.aminmax(torch.where(labels == IGNORE_INDEX, 0, labels))).tolist()
        if lo < 0 or hi >= vocab_size:
            bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))]
            raise ValueError(f"labels must be token ids in [0, vocab_size={vocab_size}) or {IGNORE_INDEX} (ignored), "
                             f"got {bad[:5].tolist()}")


def check_num_items_in_batch(num_items_in_batch: Any) -> None:
    """`num_items_in_batch` must be a positive number or a one-element real tensor; a host tensor's value is
    checked, a GPU tensor's is not read (that would wait for the device)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        n = num_items_in_batch
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise ValueError(f"num_items_in_batch must be a positive number or a one-element tensor (the count of "
                             f"targets over the accumulated micro-batches), got {n.dtype} {tuple(n.shape)}")
        check_not_meta(n, "num_items_in_batch")
        if n.device.type != "cpu" or n.item() > 0:
            return
    elif isinstance(num_items_in_batch, numbers.Real) and not isinstance(num_items_in_batch, bool) \
            and num_items_in_batch > 0:
        return
    raise ValueError(f"num_items_in_batch must be a positive number (the count of targets over the accumulated "
                     f"micro-batches), got {num_items_in_batch!r}")


@contextmanager
def _models_set(model: nn.Module, name: str, value: Any) -> Iterator[list[nn.Module]]:
    """Within this block attribute `name` of every module inside `model` whose class declares it (the openm3 text
    models; for `residual_dtype` the vision tower too) is `value`; yields those modules. Their own values come
    back afterwards."""
    flagged = [m for m in model.modules() if hasattr(type(m), name)]
    saved = [getattr(m, name) for m in flagged]
    for m in flagged:
        setattr(m, name, value)
    try:
        yield flagged
    finally:
        for m, before in zip(flagged, saved):
            setattr(m, name, before)


@contextmanager
def input_ids_checked_by_caller(model: nn.Module) -> Iterator[int | None]:
    """Within this block the openm3 models inside `model` skip their range check of `input_ids` (a device sync
    per forward on a GPU): the caller checks its ids on the host before copying them (`check_input_ids` with the
    vocabulary size this yields; None when `model` holds no openm3 model)."""
    with _models_set(model, "input_ids_prechecked", True) as flagged:
        yield flagged[0].config.vocab_size if flagged else None


@contextmanager
def residual_stream_dtype(model: nn.Module, dtype: torch.dtype | None) -> Iterator[int]:
    """Within this block every openm3 text model and vision tower inside `model` carries its residual stream (the
    hidden states between layers) in `dtype`: the text embeddings and the vision tower's normalised patch
    embeddings are cast to it, and the norms, attention and MLP outputs keep it. The single-GPU trainer passes
    bf16 under its bf16 autocast, so its activations are bf16 as FSDP's bf16 parameters make them on several GPUs
    (with fp32 parameters alone they would stay fp32: the norms and residual adds promote to their fp32 weights).
    None: the embeddings' dtype. Yields how many models it set."""
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"residual_stream_dtype: dtype must be a floating dtype or None, got {dtype}")
    with _models_set(model, "residual_dtype", dtype) as flagged:
        yield len(flagged)


class M3TextModel(CheckpointSwitch, nn.Module):
    """The M3 decoder: `embed_tokens`, `layers`, `norm`, `lm_head` (parameter names as in transformers, without
    its `model.` prefix, so transformers' checkpoints map by prefix)."""

    # True while a caller that checked the ids on the host runs the model (`input_ids_checked_by_caller`)
    input_ids_prechecked = False
    # dtype of the hidden states between layers (the residual stream) inside `residual_stream_dtype`; None: the
    # embeddings' dtype (fp32 parameters under a bf16 autocast then keep an fp32 residual stream)
    residual_dtype: torch.dtype | None = None

    def __init__(self, config: M3TextConfig):
        super().__init__()
        if not isinstance(config, M3TextConfig):
            raise ValueError(f"config must be an M3TextConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    # ------------------------------------------------------------------ init / io
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init as transformers does: normal(0, initializer_range) weights, zero norms and router bias."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, 0.0, std)
                nn.init.normal_(module.down_proj, 0.0, std)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, 0.0, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype (the embedding's; `.to(dtype)` casts them all)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device the parameters are on (the embedding's)."""
        return self.embed_tokens.weight.device

    def save_pretrained(self, path, *, max_shard_size: int | str = "5GB") -> Path:
        """Write config.json, safetensors shards and their index in the published MiniMax layout (atomically,
        `openm3.models.checkpoint.write_checkpoint`); returns `path` as a Path."""
        from .checkpoint import save_pretrained
        return save_pretrained(self, path, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device=None) -> "M3TextModel":
        """The text decoder of local checkpoint directory `path` (text-only or VL, either published layout; fp8
        weights dequantized), in eval mode; `openm3.models.checkpoint.load_text_model`.

        dtype: torch.bfloat16 / float16 / float32 / float64, 'bfloat16' / 'float16' / 'float32', or None / 'auto'
        for config.json's `dtype` (float32 when it has none). device: where the weights are allocated (default
        CPU)."""
        from .checkpoint import load_text_model
        return load_text_model(path, dtype=dtype, device=device)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None, *,
                msa_stage: str = "sparse", return_kl: bool | None = None, index_input_grad: bool | None = None,
                return_aux: bool = False,
                return_router_logits: bool = False, return_block_idx: bool = False,
                logits_index: torch.Tensor | None = None, cache: Any = None, labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | float | None = None) -> M3TextOutput:
        """Logits for a packed batch.

        input_ids: int [T], or inputs_embeds: [T, hidden] (exactly one). cu_seqlens: int32 [B+1] (default: one
        sequence). position_ids: int [T] (default: 0.. per sequence; required with a cache, where they are the
        absolute positions of the new tokens). msa_stage: "sparse" (MSA layers attend to their selected blocks)
        or "dense" (the warm-up stage: MSA layers attend densely and the KL uses all causal tokens).
        return_kl: add the indexer KL (default: `self.training`). index_input_grad: whether the KL's gradient
        reaches the backbone through the indexer's input (default: in the dense warm-up only; False there makes
        the warm-up's KL train the index branch alone, as the sparse stage's does). return_aux: add the MoE
        load-balancing loss;
        return_router_logits / return_block_idx: add those per layer. logits_index: int [N], compute logits only
        for these token rows. cache: an inference cache (protocol in `openm3.layers.attention`).
        labels: int [T] packed as the inputs and unshifted, as transformers' (the target of token i is
        `labels[i + 1]` of its sequence; -100 ignored): adds `loss`, the fp32 cross-entropy averaged over the
        targets, or summed and divided by `num_items_in_batch` when given (`openm3.ops.losses.causal_lm_loss`).
        """
        x = self._embed(input_ids, inputs_embeds)
        t = x.shape[0]
        if x.is_meta:  # (meta inputs are refused by `_embed`)
            raise ValueError("the model's parameters are on the meta device (no values): load weights first "
                             "(openm3.models.load_pretrained, or to_empty + reset_parameters)")
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, t], dtype=torch.int32, device=x.device)
        elif isinstance(cu_seqlens, torch.Tensor):
            check_not_meta(cu_seqlens, "cu_seqlens")
        offsets = check_cu_seqlens(cu_seqlens, t, "cu_seqlens")
        if position_ids is None:
            if cache is not None:
                raise ValueError("position_ids are required with a cache (absolute positions of the new tokens)")
            longest = max(b - a for a, b in zip(offsets, offsets[1:]))
            if longest > self.config.max_position_embeddings:  # as explicit positions past it are refused
                raise ValueError(f"a sequence of {longest} tokens (cu_seqlens) is longer than the model's "
                                 f"max_position_embeddings={self.config.max_position_embeddings} (its default "
                                 f"positions run past it); raise config.max_position_embeddings to run it anyway "
                                 f"(the rotary embedding extrapolates, untrained)")
            position_ids = _positions(offsets, x.device)
        else:
            check_position_ids(position_ids, t, self.config.max_position_embeddings)
        if labels is not None:
            check_labels(labels, t, x.device, self.config.vocab_size)
            if logits_index is not None:
                raise ValueError("labels and logits_index: pass one (the loss needs the logits of every token)")
            if num_items_in_batch is not None:
                check_num_items_in_batch(num_items_in_batch)
        elif num_items_in_batch is not None:
            raise ValueError("num_items_in_batch: only used with labels (it divides their summed loss)")
        if msa_stage not in ("sparse", "dense"):
            raise ValueError(f"msa_stage must be 'sparse' or 'dense', got {msa_stage!r}")
        dense_warmup = msa_stage == "dense"
        compute_kl = self.training if return_kl is None else return_kl
        if cache is not None and return_kl is None and self.training:
            raise ValueError("cache: the model is in training mode (where the indexer KL is computed by default): "
                             "call model.eval() first (or openm3.engine.for_inference(model))")
        if cache is not None and (compute_kl or return_block_idx or dense_warmup):
            raise ValueError("cache: return_kl, msa_stage='dense' and return_block_idx are not available with a "
                             "cache")

        cos, sin = rope_cos_sin(position_ids, self.config.rotary_dim, self.config.rope_theta, x.dtype)
        kls, routers, blocks = [], [], []
        for layer in self.layers:
            args = (x, cos, sin, cu_seqlens, compute_kl, dense_warmup, index_input_grad, return_block_idx, cache)
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, kl, router_logits, block_idx = checkpoint(layer, *args, use_reentrant=False,
                                                             context_fn=self.checkpoint_contexts)
            else:
                x, kl, router_logits, block_idx = layer(*args)
            if kl is not None:
                kls.append(kl)
            if router_logits is not None:
                routers.append(router_logits)
            blocks.append(block_idx)

        x = self.norm(x)
        if logits_index is not None:
            x = x[logits_index]
        out = M3TextOutput(logits=self.lm_head(x))
        if labels is not None:
            out.loss = causal_lm_loss(out.logits, labels, cu_seqlens, num_items_in_batch)
        if compute_kl:
            out.indexer_kl = torch.stack(kls).mean() if kls else x.new_zeros((), dtype=torch.float32)
        if return_router_logits:
            out.router_logits = tuple(routers)
        if return_aux and routers:
            out.aux_loss = load_balancing_loss(routers, self.config.num_local_experts,
                                               self.config.num_experts_per_tok)
        if return_block_idx:
            out.block_idx = tuple(blocks)
        return out

    def _embed(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [T] or inputs_embeds [T, hidden]")
        if inputs_embeds is not None:
            if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 2 \
                    or inputs_embeds.shape[1] != self.config.hidden_size or not inputs_embeds.is_floating_point():
                got = (f"{inputs_embeds.dtype} {tuple(inputs_embeds.shape)}" if isinstance(inputs_embeds, torch.Tensor)
                       else type(inputs_embeds).__name__)
                raise ValueError(f"inputs_embeds must be a floating tensor [T, hidden={self.config.hidden_size}], "
                                 f"got {got}")
            check_not_meta(inputs_embeds, "inputs_embeds")
            # Another dtype would reach the first projection as is and fail there; under an autocast (or inside
            # `residual_stream_dtype`, which casts it) it is what the caller means.
            if inputs_embeds.dtype != self.dtype and self.residual_dtype is None \
                    and not torch.is_autocast_enabled(inputs_embeds.device.type):
                raise ValueError(f"inputs_embeds must have the model's dtype {self.dtype} (or run under "
                                 f"torch.autocast), got {inputs_embeds.dtype}")
            return self._to_residual(inputs_embeds)
        check_input_ids(input_ids, self.config.vocab_size, read_range=not self.input_ids_prechecked)
        return self._to_residual(self.embed_tokens(input_ids))

    def _to_residual(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_dtype is None else x.to(self.residual_dtype)


def _positions(offsets: list[int], device) -> torch.Tensor:
    """Positions restarting at 0 for each packed sequence: [T] int64."""
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], device=device)
    starts = torch.tensor(offsets[:-1], device=device)
    t = offsets[-1]
    return torch.arange(t, device=device) - torch.repeat_interleave(starts, lengths, output_size=t)
