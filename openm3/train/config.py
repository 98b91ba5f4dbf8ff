"""`TrainConfig`: every setting of a training run, validated before any compute happens."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip
from .recipes import RecipePlan, make_plan

MSA_STAGES = ("dense", "sparse")


@dataclass
class TrainConfig:
    """A training run. Batch sizes count packed rows of `seq_len` tokens.

    Each optimizer step takes the recipe's global rows (`text_rows` text rows plus the vision rows of the mixture
    while vision is on); rank r of `world_size` gets every world_size-th row (the global row count must divide by
    the world size), and runs them `micro_batch` rows at a time, accumulating gradients. The LM loss is the sum of
    token losses divided by the global number of loss tokens of the step, so any world size and micro-batch size
    gives the same update (the indexer KL and MoE load-balancing terms are weighted by each micro-batch's share
    of the step's tokens; the latter is a batch statistic, so it matches only for the same row grouping).

    MSA protocol: steps `< msa_switch_step` are the dense warm-up (dense main attention, index branch trained by
    the dense KL); later steps are the sparse stage (MSA attention, sparse KL, indexer input detached).
    """

    model: str = "m3-tiny"
    layers: int | None = None  # the preset at this many decoder layers (its pattern kept); None: the preset's
    # a checkpoint directory whose weights start the run (an earlier run's export, `save_pretrained`, a release;
    # either layout, fp8 too): its config.json then decides the model instead of `model`, and the tokenizer.json
    # beside it (if any) tokenizes the data (`openm3 train`; the `Trainer` takes its model from its caller)
    init_from: str | None = None
    recipe: str = "native"
    steps: int = 100
    seq_len: int = 256
    text_rows: int = 4
    micro_batch: int = 2
    mixture: dict[str, float] | None = None
    vision_start_step: int | None = None
    cpt_steps: int | None = None
    cpt_lr_ratio: float = 0.3

    # temporal patches (2 frames each) per video clip, the span of the vision tower's attention (M3: 4; None: each
    # video one clip). The data source and evaluator take it from here (`openm3 train`, the demo, experiments);
    # exports record it as the video processor's `vision_segment_max_frames`, which generate / serve / eval read
    video_frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP

    lr: float = 3e-3
    vision_lr_scale: float = 1.0  # learning rate of the vision tower and projector, relative to `lr`
    warmup_steps: int | None = None  # None: 10, or half the steps of a run shorter than 20 steps
    decay_start: int | None = None  # None: 80% of steps (at least the warm-up)
    min_lr_ratio: float = 0.1
    decay_shape: str = "linear"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0

    msa_switch_step: int = 0
    kl_weight: float = 1.0
    # the dense warm-up's indexer KL also trains the backbone through the indexer's input (DESIGN.md detaches that
    # input in the sparse stage only); False: the warm-up's KL trains the index branch alone, as DeepSeek's sparse
    # attention does in its warm-up (docs/experiments.md measured it at m3-tiny scale)
    warmup_kl_to_backbone: bool = True
    aux_loss_weight: float = 0.01

    seed: int = 0
    out_dir: str = "runs/train"
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: only at the end
    log_every: int = 1
    print_every: int = 0  # rank 0 prints a plain line every N steps (logs without the progress bar); 0: never
    progress: bool = True
    tensorboard: bool = True

    device: str = "auto"  # auto | cpu | cuda
    param_dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16
    # auto | float32: the residual stream's dtype. auto: the compute dtype (bf16 with bf16 compute, on one GPU as
    # under FSDP); float32: fp32 hidden states between layers under the single-process bf16 autocast (slower)
    residual_dtype: str = "auto"
    activation_checkpointing: bool = False
    # with activation checkpointing, the backward's recomputation of an MSA layer takes the forward's block
    # selection and indexer KL instead of running them again (read at every step; costs the selections held until
    # the backward, and with kl_in_backward off the KL's fp32 gradients too: 2.4 GB for m3-small at 64K)
    ac_reuse_msa: bool = True
    # with activation checkpointing, every layer's attention (dense, MSA, vision) keeps its saved tensors (q, k, v,
    # output, softmax statistics: ~0.6 GB per m3-small layer at 64K) and the recomputation reuses its output
    # instead of running it again (a selective checkpoint; read at every step)
    ac_keep_attention: bool = False
    # The sparse-stage MSA layers run the indexer KL inside the attention's backward
    # (`openm3.layers.attention.kl_in_backward`: the dk/dv kernel computes the KL's teacher on the way, so the
    # forward's teacher pass goes; the logged KL is read after the backward); with activation checkpointing only
    # together with ac_reuse_msa (the recomputation replays the forward's choice). Read at every step.
    kl_in_backward: bool = True
    compile: bool = False  # torch.compile each decoder layer (openm3.train.distributed.apply_compile)
    compile_backend: str = "inductor"  # any torch.compile backend ("aot_eager": trace without code generation)
    # auto | on | off: build the next step's rows (data reading, tokenising, image preprocessing) in a background
    # thread while this step runs; auto = on when training on a GPU (on a CPU it would take cores from compute)
    prefetch: str = "auto"
    # `fit` queues each next step before it reads this step's logged values (loss, norms: one device sync per
    # step), so the GPU does not idle while the host starts the next step; a non-finite loss then stops the run
    # one step later. False: read every step's values before the next starts
    overlap_steps: bool = True
    extra: dict = field(default_factory=dict)  # free-form settings for data/model factories

    def __post_init__(self):
        self.betas = tuple(self.betas)
        # the fields derived from `steps` here (None given): `settings()` gives them back as None
        self._derived = tuple(name for name in ("warmup_steps", "decay_start") if getattr(self, name) is None)
        if self.warmup_steps is None:
            self.warmup_steps = min(10, self.steps // 2)
        if self.decay_start is None:
            self.decay_start = max(self.warmup_steps, int(0.8 * self.steps))
        if self.layers is not None and (not isinstance(self.layers, int) or self.layers <= 0):
            raise ValueError(f"layers must be a positive int or None, got {self.layers!r}")
        if self.layers is not None and self.init_from:
            raise ValueError("layers: only for a preset model; init_from's checkpoint has the layers of its weights")
        for name in ("seq_len", "micro_batch", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("ckpt_every", "eval_every", "log_every", "print_every", "msa_switch_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_frames_per_clip(self.video_frames_per_clip, "video_frames_per_clip")
        if self.lr <= 0 or self.vision_lr_scale <= 0:
            raise ValueError(f"lr and vision_lr_scale must be > 0, got {self.lr}, {self.vision_lr_scale}")
        if self.kl_weight < 0 or self.aux_loss_weight < 0:
            raise ValueError(f"kl_weight and aux_loss_weight must be >= 0, got {self.kl_weight}, "
                             f"{self.aux_loss_weight}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.prefetch not in ("auto", "on", "off"):
            raise ValueError(f"prefetch must be auto|on|off, got {self.prefetch!r}")
        if self.param_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"param_dtype must be auto|float32|bfloat16, got {self.param_dtype!r}")
        if self.residual_dtype not in ("auto", "float32"):
            raise ValueError(f"residual_dtype must be auto|float32, got {self.residual_dtype!r}")
        self.plan()  # validates recipe, schedule (decay before warmup) and mixture

    def plan(self) -> RecipePlan:
        """The recipe's plan: rows of each data kind per step and the learning-rate schedule."""
        return make_plan(self.recipe, steps=self.steps, text_rows=self.text_rows, warmup_steps=self.warmup_steps,
                         decay_start=self.decay_start, min_lr_ratio=self.min_lr_ratio,
                         decay_shape=self.decay_shape, mixture=self.mixture,
                         vision_start_step=self.vision_start_step, cpt_steps=self.cpt_steps,
                         cpt_lr_ratio=self.cpt_lr_ratio)

    def msa_stage(self, step: int) -> str:
        return "dense" if step < self.msa_switch_step else "sparse"

    def check_world(self, world_size: int) -> None:
        """Every step's global rows must split evenly over `world_size` ranks (the last micro-batch of a rank
        may be smaller than `micro_batch`)."""
        plan = self.plan()
        for step in sorted({0, self.steps - 1, plan.vision_start_step or 0}):
            total = sum(plan.rows(step).values())
            if total % world_size:
                raise ValueError(f"global batch of {total} rows at step {step} ({plan.rows(step)}) is not divisible "
                                 f"by world_size={world_size}")

    def to_dict(self) -> dict:
        """Every field, as plain Python values, the derived ones resolved (what checkpoints hold)."""
        return dataclasses.asdict(self)

    def settings(self) -> dict:
        """`to_dict()` with the fields derived from `steps` (`warmup_steps`, `decay_start` left at None) as None:
        what `train_config.json` holds, so that `--config` with another `--steps` derives them again."""
        return {**self.to_dict(), **{name: None for name in self._derived}}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A config from a dict of fields (missing ones at their defaults); ValueError naming unknown fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "TrainConfig":
        """A config from a JSON file of fields, e.g. a run's `train_config.json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


# Fields a resumed run may change: how it runs (length, cadences, memory and speed options), not what it trains
RESUMABLE = frozenset({
    "steps", "decay_start", "ckpt_every", "keep_checkpoints", "eval_every", "log_every", "print_every", "progress",
    "tensorboard", "device", "micro_batch", "activation_checkpointing", "ac_reuse_msa", "ac_keep_attention",
    "kl_in_backward", "compile", "compile_backend", "prefetch", "overlap_steps", "out_dir"})


def known_fields(saved: dict) -> dict:
    """A stored config's fields this version has (one since removed is dropped; one added since takes its default
    in `TrainConfig.from_dict`)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: v for k, v in saved.items() if k in names}


def resume_conflicts(saved: dict, cfg: TrainConfig) -> list[tuple[str, object, object]]:
    """(field, the run's value, cfg's value) for every field outside RESUMABLE where `cfg` differs from the
    settings a run was made with (`saved`, as its checkpoint stores them)."""
    before, now = TrainConfig.from_dict(known_fields(saved)).to_dict(), cfg.to_dict()
    return [(k, before[k], now[k]) for k in now if k not in RESUMABLE and now[k] != before[k]]
