"""The device memory a training run needs, estimated from shapes before anything is built.

    est = estimate_training_memory(M3VLConfig.from_name("m3-small", ...), TrainConfig(...), world_size=1,
                                   device="cuda")
    print(est.summary())          # one line: the total and its biggest parts
    print(est.table())            # every part

`openm3 train` prints it before building the model and refuses a run whose estimate exceeds the GPU (on a CPU: the
host's memory and swap, `host_memory`) by a margin (`check_fits`); `Trainer.memory_estimate()` gives it for a built
trainer. Parts, in bytes per rank:

- parameters: fp32 weights (the trainer builds fp32 models: one GPU casts under a bf16 autocast, FSDP2 gathers bf16
  copies), sharded over the ranks by FSDP2.
- gradients: fp32, sharded; under FSDP2 with more than one micro-batch per rank plus the unsharded fp32 gradients
  FSDP2 accumulates while gradient sync is off (`FSDPParam.unsharded_accumulated_grad`, reduce dtype fp32).
- optimizer: AdamW's two fp32 moments per trained parameter, sharded.
- weight copies: the bf16 weights the compute uses. One GPU: autocast's casts of every matrix (and the MoE experts'
  explicit `.to`), which the matmuls save for the backward (under activation checkpointing only the
  non-checkpointed ones stay); FSDP2: the gathered root module (embeddings, lm_head: kept from forward to backward)
  and two gathered blocks (the running one and the prefetched one).
- activations: what the forward of the largest micro-batch leaves for its backward (the tensors autograd saves,
  the checkpoints' inputs, the logits), from the code's saved tensors (`_layer_items`; checked against what
  autograd saves on CPU by tests/test_train_memory.py).
- vision: the same for the vision tower and projector, on a micro-batch whose tokens carry `patches_per_token`
  patches each (the bundled image and video rows carried 0.5-0.75 at their default sizes; 4 is the most a row of
  visual tokens can).
- backward: the most the backward adds on top: the logits' gradient, or a decoder layer's gradients (with
  activation checkpointing: plus the layer recomputed), and a weight's gradient being cast and accumulated.
- workspace: CUDA context and kernel images, which `torch.cuda.max_memory_allocated` does not see, and the cuBLAS
  workspaces, which it does (0 on CPU).

Not modelled: `--compile` (Inductor saves fewer tensors inside a compiled layer: the estimate is then high) and
the allocator's fragmentation (the margin of `check_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

GIB = 2 ** 30
CUDA_CONTEXT = 1 << 30  # CUDA context, kernel images, cuBLAS / cuDNN handles: outside the caching allocator
# cuBLAS and cuBLASLt workspaces, 32 MiB each on Hopper per thread (forward, backward): from the caching allocator
CUBLAS_WORKSPACES = 128 << 20
REFUSE_ABOVE = 1.10  # check_fits refuses an estimate above this share of the device's memory
# ... and under --compile, whose fused kernels save less than the eager ones the estimate models (m3-small's
# compiled runs peaked at 0.83-0.92x of the estimate on an H200)
REFUSE_ABOVE_COMPILED = 1.25
PATCHES_PER_TOKEN = 1.0  # vision patches per token of a vision micro-batch (bundled rows: 0.5-0.75)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class MemoryEstimate:
    """A training run's device memory per rank, in bytes, by part (see the module docstring); `detail` splits
    activations + vision into what holds them, `tokens` is the micro-batch's size, `stage` the MSA stage whose
    step needs the most."""

    parameters: int
    gradients: int
    optimizer: int
    weight_copies: int
    activations: int
    vision: int
    backward: int
    workspace: int
    tokens: int
    device: str
    world_size: int
    stage: str
    detail: dict[str, int] = field(default_factory=dict, compare=False)

    PARTS = ("parameters", "gradients", "optimizer", "weight_copies", "activations", "vision", "backward",
             "workspace")

    def parts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.PARTS}

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    @property
    def allocated(self) -> int:
        """What the caching allocator should peak at (`torch.cuda.max_memory_allocated` on CUDA): the total less
        the CUDA context."""
        return self.total - (CUDA_CONTEXT if self.device == "cuda" else 0)

    def biggest(self, count: int = 3) -> str:
        """The `count` biggest parts: "activations 42.29, vision 12.82, optimizer 9.76 GiB"."""
        big = sorted(((v, k) for k, v in self.parts().items() if v), reverse=True)[:count]
        return ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for v, k in big) + " GiB"

    def summary(self, device_total: int | None = None) -> str:
        """One line: the total (of `device_total` bytes, when given) and its three biggest parts."""
        where = "per GPU" if self.device == "cuda" else "of host memory"
        of = f" of {device_total / GIB:.2f} GiB" if device_total else ""
        return (f"memory estimate: {self.total / GIB:.2f} GiB {where}{of} ({self.biggest()}; {self.tokens} tokens "
                "per forward)")

    def table(self) -> str:
        """Every part, and what holds the activations."""
        lines = [f"  {k.replace('_', ' '):<32}{v / GIB:9.3f} GiB" for k, v in self.parts().items()]
        lines += [f"    {k:<30}{v / GIB:9.3f} GiB" for k, v in self.detail.items()]
        return "\n".join(lines + [f"  {'total':<32}{self.total / GIB:9.3f} GiB ({self.world_size} rank(s), "
                                  f"{self.device}, MSA stage {self.stage})"])


@dataclass(frozen=True)
class _Run:
    """What the formulas read of the run: byte widths and which code paths it takes."""

    cpu: bool  # reference ops (MSA, MoE experts), eager losses, composite RMSNorm; else the CUDA kernels
    a: int  # bytes of a compute-dtype element (bf16 autocast or FSDP2 bf16 parameters: 2; fp32: 4)
    r: int  # bytes of a residual-stream element
    autocast: bool  # one process under a bf16 autocast over fp32 weights
    fsdp: bool
    ac: bool
    keep_attention: bool
    reuse_msa: bool
    kl: bool
    defer_kl: bool  # the sparse KL runs in the attention's backward (`kl_in_backward`)
    aux: bool
    stage: str  # "dense" (warm-up) | "sparse"


def _norm(s: _Run, width: int, rows: int = 1) -> int:
    """RMSNorm saves its fp32 input (`x.float()`) and rstd; on CPU the composite `F.rms_norm` also saves the
    normalised fp32 input (CUDA's `_fused_rms_norm` does not)."""
    return 4 * width * rows * (2 if s.cpu else 1) + 4 * rows


def _mlp(s: _Run, inner: int) -> int:
    """SwiGLU-OAI after `gate_up_proj`: its [., 2I] output (eager on CPU: its clamps, sigmoid and products too,
    4 more [., I]) and `down_proj`'s [., I] input."""
    return s.a * inner * (7 if s.cpu else 3)


def _attention(c, s: _Run, sparse_op: bool) -> dict[str, int]:
    """The attention op's saved tensors: q, k, v, o and the fp32 softmax statistics; the dense varlen path runs
    SDPA per sequence, so o is saved per sequence and again concatenated (o_proj's input); the MSA op also
    saves its selection (int32 [Hi, T, topk])."""
    q, kv = s.a * c.num_attention_heads * c.head_dim, s.a * c.num_key_value_heads * c.head_dim
    items = {"q": q, "k": kv, "v": kv, "o": q, "lse": 4 * c.num_attention_heads}
    if sparse_op:
        items["block_idx"] = 4 * c.index_n_heads * c.index_topk_blocks
    else:
        items["o_cat"] = q
    return items


def _indexer_kl(c, s: _Run, sparse: bool) -> dict[str, int]:
    """What the indexer KL keeps. Reference (CPU): qi, ki (q, k shared with the attention) and both fp32
    normalisers. Triton: the fp32 gradients of qi and ki it computed in the forward, or, run inside the sparse
    attention's backward (`kl_in_backward`), qi, ki and the selection's fp32 index normaliser."""
    hi, di = c.index_n_heads, c.index_head_dim
    if s.cpu:
        return {"q": s.a * c.num_attention_heads * c.head_dim, "k": s.a * c.num_key_value_heads * c.head_dim,
                "qi": s.a * hi * di, "ki": s.a * di, "lse_teacher": 4 * c.num_attention_heads, "lse_index": 4 * hi}
    if sparse and s.defer_kl:
        return {"qi": s.a * hi * di, "ki": s.a * di, "index_lse": 4 * hi}
    return {"dqi": 4 * hi * di, "dki": 4 * di}


def _layer_items(c, s: _Run, i: int) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per token that layer i's forward saves for its backward without checkpointing: (attention half: input
    norm to o_proj, MLP half: post-attention norm to the MLP / MoE). Names shared by two ops count once."""
    h, msa = c.hidden_size, c.layer_types[i] == "minimax_m3_sparse"
    # the projections' input, the norm's output in the residual dtype: one tensor unless autocast casts it per
    # projection (an fp32 residual stream: q, k, v and the two index projections each save a bf16 copy)
    copies = 1 if s.r == s.a else 3 + 2 * msa
    attn = {"input_norm": _norm(s, h), "proj_input": s.a * h * copies,
            "q_norm": _norm(s, c.head_dim, c.num_attention_heads),
            "k_norm": _norm(s, c.head_dim, c.num_key_value_heads)}
    sparse = msa and s.stage == "sparse"
    attn.update(_attention(c, s, sparse))
    if msa and s.kl:  # the index branch feeds the KL: its norms' inputs stay
        attn.update(index_norms=_norm(s, c.index_head_dim, c.index_n_heads) + _norm(s, c.index_head_dim))
        attn.update(_indexer_kl(c, s, sparse))
    moe = c.mlp_layer_types[i] == "sparse"  # its input read by the shared expert, the router and the experts
    mlp = {"post_norm": _norm(s, h), "mlp_input": s.a * h * (1 if s.r == s.a or not moe else 3)}
    if not moe:
        mlp["mlp"] = _mlp(s, c.dense_intermediate_size)
        return attn, mlp
    e, k, inner = c.num_local_experts, c.num_experts_per_tok, c.intermediate_size
    mlp["shared_expert"] = _mlp(s, c.shared_intermediate_size)
    # router: logits, ids (int64), mixing weights (fp32); its input is the layer's (`Router._input`: no copy of its
    # own under autocast)
    mlp["router"] = (4 * e + 12 * k + 4) if s.cpu else (s.a * e + 12 * k)
    if s.cpu or s.a == 4:  # reference experts (`Experts.resolved_impl`: grouped is CUDA bf16 only), per (token,
        # slot): the gathered rows, the eager SwiGLU's tensors, the weighted output
        mlp["experts"] = k * (s.a * (3 * h + 7 * inner) + 20)
    else:  # grouped: permuted rows, SwiGLU input, down input, expert outputs, two int64 permutations
        mlp["experts"] = k * (s.a * (2 * h + 3 * inner) + 16)
    return attn, mlp


def _kept_items(c, s: _Run, i: int, attn: dict[str, int]) -> dict[str, int]:
    """Bytes per token a checkpointed layer i holds from its forward to its backward: its input and, through
    `openm3.layers.recompute.reuse_contexts`, the MSA selection and indexer KL (`ac_reuse_msa`) and the
    attention's saved tensors (`ac_keep_attention`)."""
    kept = {"layer_input": s.r * c.hidden_size}
    msa = c.layer_types[i] == "minimax_m3_sparse"
    sparse = msa and s.stage == "sparse"
    # on CUDA the sparse KL inside the attention's backward is part of the attention op: recomputed with it
    kl_in_attention = msa and s.kl and sparse and s.defer_kl and not s.cpu
    if s.keep_attention:
        kept.update({k: attn[k] for k in _attention(c, s, sparse)})
        if kl_in_attention:
            kept.update(_indexer_kl(c, s, sparse))
    if msa and s.reuse_msa:
        if sparse:  # the selection (and the index normaliser the Triton selection computes for the KL)
            kept.update(block_idx=attn["block_idx"], index_lse=4 * c.index_n_heads if s.kl and not s.cpu else 0)
        if s.kl and not kl_in_attention:  # the KL run once, its saved tensors kept
            kept.update(_indexer_kl(c, s, sparse))
    return kept


def _loss_items(c, s: _Run) -> dict[str, int]:
    """Bytes per token outside the decoder layers: ids, RoPE tables, final norm, lm_head's input, the logits (the
    step holds them), the cross-entropy's saved tensors (CPU: the fp32 log-softmax; CUDA's fused kernel: the
    logits themselves, the labels and two fp32 statistics) and the load-balancing loss's over every MoE layer's
    router logits (the fp32 softmax, and on CPU the top-k ids)."""
    v, e, k = c.vocab_size, c.num_local_experts, c.num_experts_per_tok
    balance = (4 * e + (8 * k if s.cpu else 0)) * c.mlp_layer_types.count("sparse") if s.aux else 0
    return {"inputs": 24, "rope": 2 * c.rotary_dim * s.r, "final_norm": _norm(s, c.hidden_size),
            "lm_head_input": s.a * c.hidden_size, "logits": s.a * v, "loss": (4 * v + 8) if s.cpu else 16,
            "aux_loss": balance}


def _vision_items(vc, projector_hidden: int, text_hidden: int, s: _Run) -> tuple[dict[str, int], int, int]:
    """Bytes per patch the vision tower and projector save: (items, one block's, a checkpointed block's input).
    A block saves its two LayerNorms' fp32 inputs and statistics (autocast runs LayerNorm in fp32), the
    projections' input (under autocast the fp32 LayerNorm output cast once for q, k and v: `autocast_inputs`), q, k,
    v, the SDPA output and statistics, out_proj's, fc1's and fc2's inputs, GELU's input, and under autocast bf16
    copies of the fp32 RoPE tables (two per rotation)."""
    hv, iv, a = vc.hidden_size, vc.intermediate_size, s.a
    rope = 6 * ((vc.head_dim // 3) // 2)  # rotated channels per head
    block = (8 * hv + 7 * a * hv + 2 * a * iv + 4 * vc.num_attention_heads + 16
             + (4 * rope * a if s.autocast else 0))
    patch = vc.num_channels * vc.temporal_patch_size * vc.patch_size ** 2
    group = vc.spatial_merge_size ** 2
    # the fp32 pixels (+ the conv's bf16 cast) and the placeholders' int64 positions (one per merged group)
    items = {"vision_inputs": 4 * patch + 8 // group + (a * patch if s.autocast else 0),
             "vision_pre_norm": 4 * hv + 8, "vision_rope": 8 * rope,
             "vision_blocks": block * vc.num_hidden_layers,
             # projector: per-patch MLP (input, GELU input, output), then the merged groups' MLP
             "projector": a * (hv + 2 * projector_hidden + text_hidden + 2 * projector_hidden // group)}
    return items, block, s.r * hv


def _run(cfg, world_size: int, device: str, stage: str) -> _Run:
    cpu = device != "cuda"
    bf16 = cfg.param_dtype == "bfloat16" or (cfg.param_dtype == "auto" and not cpu)
    fsdp = world_size > 1
    autocast = bf16 and not fsdp
    a = 2 if bf16 else 4
    r = 4 if autocast and cfg.residual_dtype == "float32" else a
    ac = cfg.activation_checkpointing
    return _Run(cpu=cpu, a=a, r=r, autocast=autocast, fsdp=fsdp, ac=ac, keep_attention=ac and cfg.ac_keep_attention,
                reuse_msa=ac and cfg.ac_reuse_msa, kl=cfg.kl_weight > 0,
                defer_kl=cfg.kl_in_backward and (not ac or cfg.ac_reuse_msa), aux=cfg.aux_loss_weight > 0,
                stage=stage)


@dataclass
class _Weights:
    """Parameter counts of a model: all, vision tower + projector, bf16-cast matrices (all / vision / outside the
    repeated blocks), the root FSDP2 group (outside the blocks), the largest block, the largest single tensor."""

    total: int = 0
    vision: int = 0
    cast: int = 0
    cast_vision: int = 0
    cast_root: int = 0
    root: int = 0
    block: int = 0
    largest: int = 0


def _weights(model: nn.Module) -> _Weights:
    from . import distributed as D

    w = _Weights()
    in_block = {id(p) for b in D.find_blocks(model) for p in b.parameters()}
    w.block = max((sum(p.numel() for p in b.parameters()) for b in D.find_blocks(model)), default=0)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, p in model.named_parameters():
        n, vision = p.numel(), any(prefix in name for prefix in VISION_PREFIXES)
        w.total += n
        w.vision += n * vision
        w.largest = max(w.largest, n)
        if id(p) not in in_block:
            w.root += n
        if p.dim() >= 2 and id(p) not in embeddings:  # what a bf16 autocast casts (and the experts' `.to`)
            w.cast += n
            w.cast_vision += n * vision
            w.cast_root += n * (id(p) not in in_block)
    return w


def _model_parts(model) -> tuple[nn.Module, object, object, int]:
    """(module, text config, vision config or None, projector width) of a model or an M3 text / VL config (built on
    the meta device: shapes only)."""
    from ..models.config import M3TextConfig
    from ..models.text import M3TextModel
    from ..models.vision import M3VisionModel

    if not isinstance(model, nn.Module):
        from ..models.multimodal import M3ForConditionalGeneration, M3VLConfig

        if not isinstance(model, (M3TextConfig, M3VLConfig)):
            raise ValueError(f"model: expected an nn.Module, M3TextConfig or M3VLConfig, got {type(model).__name__}")
        with torch.device("meta"):
            model = M3TextModel(model) if isinstance(model, M3TextConfig) else M3ForConditionalGeneration(model)
    text = next((m.config for m in model.modules() if isinstance(m, M3TextModel)), None)
    if text is None:
        raise ValueError(f"model: {type(model).__name__} holds no openm3 text decoder (M3TextModel)")
    tower = next((m for m in model.modules() if isinstance(m, M3VisionModel)), None)
    projector = next((m for name, m in model.named_modules() if name.endswith("multi_modal_projector")), None)
    width = projector.linear_1.out_features if projector is not None else 0
    return model, text, (tower.config if tower is not None else None), width


def estimate_training_memory(model, cfg, world_size: int = 1, device: str = "cuda", *,
                             patches_per_token: float = PATCHES_PER_TOKEN) -> MemoryEstimate:
    """The device memory per rank of training `model` (an nn.Module on any device, the meta device included, or an
    `M3TextConfig` / `M3VLConfig`) with `TrainConfig` `cfg` on `world_size` ranks of `device` ("cuda" | "cpu":
    which kernels run and, with `cfg.param_dtype`, the compute dtype). The step of the MSA stage (dense warm-up
    or sparse) that needs more is the one estimated."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    module, c, vc, projector_hidden = _model_parts(model)
    w = _weights(module)
    plan = cfg.plan()
    steps = sorted({0, cfg.steps - 1, plan.vision_start_step or 0} & set(range(cfg.steps)))
    rows = max(sum(plan.rows(step).values()) for step in steps) // world_size
    vision_rows = vc is not None and any(plan.rows(step)["image"] + plan.rows(step)["video"] for step in steps)
    tokens = min(cfg.micro_batch, max(rows, 1)) * cfg.seq_len
    patches = int(patches_per_token * tokens) if vision_rows else 0
    stages = {cfg.msa_stage(0), cfg.msa_stage(cfg.steps - 1)}
    best = max((_estimate(c, vc, projector_hidden, w, cfg, _run(cfg, world_size, device, stage), world_size,
                          rows, tokens, patches, vision_rows) for stage in stages), key=lambda e: e.total)
    return best


def _estimate(c, vc, projector_hidden, w: _Weights, cfg, s: _Run, world: int, rows: int, tokens: int,
              patches: int, vision_rows: bool) -> MemoryEstimate:
    seq_len = cfg.seq_len
    layers = [_layer_items(c, s, i) for i in range(c.num_hidden_layers)]
    full = [sum({**attn, **mlp}.values()) for attn, mlp in layers]
    kept = [sum(_kept_items(c, s, i, attn).values()) for i, (attn, _) in enumerate(layers)]
    loss = _loss_items(c, s)
    held_layers = sum(kept if s.ac else full)
    detail = {f"decoder layers ({'checkpointed' if s.ac else 'saved'})": held_layers * tokens,
              "logits and losses": (loss["logits"] + loss["loss"] + loss["aux_loss"]) * tokens,
              "norm, lm_head, inputs": (sum(loss.values()) - loss["logits"] - loss["loss"] - loss["aux_loss"])
              * tokens}
    activations = sum(detail.values())

    vision = vision_block = 0
    if patches:
        items, block, block_input = _vision_items(vc, projector_hidden, c.hidden_size, s)
        if s.ac:  # a checkpointed block keeps its input (and with ac_keep_attention q, k, v, o, out and lse)
            attention = s.a * 5 * vc.hidden_size + 4 * vc.num_attention_heads if s.keep_attention else 0
            items["vision_blocks"] = (block_input + attention) * vc.num_hidden_layers
        vision = sum(items.values()) * patches
        vision_block = block * patches
        detail["vision tower and projector"] = vision

    # weights: fp32, sharded by FSDP2; gradients and AdamW moments only where a gradient comes
    trained = w.total - (0 if vision_rows else w.vision)
    micro_batches = -(-rows // cfg.micro_batch)
    parameters, optimizer = 4 * w.total // world, 8 * trained // world
    gradients = 4 * trained // world + (4 * trained if s.fsdp and micro_batches > 1 else 0)
    cast = w.cast - (0 if patches else w.cast_vision)
    if s.fsdp:  # the root group stays gathered from forward to backward; a block runs while the next is gathered
        copies = s.a * (w.root + 2 * w.block)
    elif s.autocast:
        copies = 2 * ((w.cast_root - (0 if patches else w.cast_vision)) if s.ac else cast)
    else:
        copies = 0

    # the backward's peak on top: the logits' gradient (CPU: also the log-softmax's), or a decoder layer's backward,
    # its gradients about as large as what the half running (MLP, or attention with its workspace) saved, on top
    # of the layer recomputed when checkpointed; the loss's saved tensors are freed by then, the logits not (the
    # step holds them until the backward returns)
    logits_grad = (8 if s.cpu else s.a) * c.vocab_size * tokens
    workspace = 0
    if s.cpu and s.kl and s.stage == "dense" and "minimax_m3_sparse" in c.layer_types:
        # the reference dense KL's backward works on key tiles of up to DEFAULT_WORKSPACE fp32 elements: teacher
        # logits, probabilities, masks, about four at once (measured on CPU)
        from ..ops.msa.reference import DEFAULT_WORKSPACE

        workspace = 4 * 4 * min(DEFAULT_WORKSPACE, c.num_attention_heads * seq_len * seq_len)
    msa = [t == "minimax_m3_sparse" for t in c.layer_types]
    layer = max((f - k if s.ac else 0) * tokens
                + max(sum(mlp.values()) * tokens, sum(attn.values()) * tokens + workspace * sparse)
                for f, k, (attn, mlp), sparse in zip(full, kept, layers, msa))
    if s.ac:
        layer += 2 * w.block if s.autocast else 0  # the recomputed layer's bf16 weight copies
        layer = max(layer, vision_block)
    layer -= (loss["loss"] + loss["aux_loss"]) * tokens
    weight_grad = w.largest * (4 + (s.a if s.autocast or s.fsdp else 0))
    if s.fsdp:
        weight_grad = max(weight_grad, w.block * (s.a + 4))  # a block's unsharded gradients, cast for the reduce
    backward = max(logits_grad, layer, 0) + weight_grad
    return MemoryEstimate(parameters=parameters, gradients=gradients, optimizer=optimizer, weight_copies=copies,
                          activations=activations, vision=vision, backward=backward,
                          workspace=0 if s.cpu else CUDA_CONTEXT + CUBLAS_WORKSPACES, tokens=tokens,
                          device="cpu" if s.cpu else "cuda", world_size=world, stage=s.stage, detail=detail)


def memory_advice(cfg, world_size: int, *, gpu: bool = True) -> str:
    """What to change for a run that does not fit: "try a smaller --micro-batch (now 4; ...), ... or more GPUs
    (...)" (the trainer's out-of-memory error and `check_fits` both say it)."""
    tips = []
    if cfg.micro_batch > 1:
        tips.append(f"a smaller --micro-batch (now {cfg.micro_batch}; the step keeps its rows through gradient "
                    "accumulation)")
    if not cfg.activation_checkpointing:
        tips.append("--activation-checkpointing")
    elif cfg.ac_keep_attention:
        tips.append("without --ac-keep-attention")
    tips.append(f"a shorter --seq-len (now {cfg.seq_len})")
    if gpu:
        tips.append(f"more GPUs (torchrun --nproc_per_node N shards the model; now {world_size})")
    return "try " + (", ".join(tips[:-1]) + " or " if len(tips) > 1 else "") + tips[-1]


def check_fits(estimate: MemoryEstimate, device_total: int, cfg, ranks_here: int = 1) -> str | None:
    """ValueError when `estimate.total` exceeds `REFUSE_ABOVE` (`REFUSE_ABOVE_COMPILED` with `cfg.compile`) times
    `device_total` (bytes of the GPU; for a CPU run the host's memory, which its `ranks_here` ranks share), naming
    both and what to change; a warning line when it exceeds 90% of it; None when it fits."""
    gpu = estimate.device == "cuda"
    need, have = estimate.total * (1 if gpu else ranks_here) / GIB, device_total / GIB
    where = "per GPU" if gpu else ("on this host" if ranks_here == 1 else f"on this host for its {ranks_here} ranks")
    memory = f"the GPU has {have:.1f} GiB" if gpu else f"the host has {have:.1f} GiB of memory and swap"
    if need > (REFUSE_ABOVE_COMPILED if getattr(cfg, "compile", False) else REFUSE_ABOVE) * have:
        raise ValueError(f"training needs about {need:.1f} GiB {where} by the memory estimate "
                         f"({estimate.biggest()}; {estimate.tokens} tokens per forward) but {memory}: "
                         + memory_advice(cfg, estimate.world_size, gpu=gpu)
                         + " (--skip-memory-check runs it anyway)")
    if need > 0.9 * have:
        return (f"the memory estimate ({need:.1f} GiB) is near the {'GPU' if gpu else 'host'}'s {have:.1f} GiB: "
                f"the run may run out of memory")
    return None


def host_memory() -> int | None:
    """Bytes of this machine's memory and swap (Linux: /proc/meminfo's MemTotal + SwapTotal), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "SwapTotal") if key in fields) or None
    except (OSError, ValueError):
        return None
