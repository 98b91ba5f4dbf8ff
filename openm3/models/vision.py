"""M3's vision tower: config, clip splitting, attention-pattern report and the ViT itself.

Vocabulary. A *grid* row ``(t, h, w)`` describes one image (``t = 1``) or one video clip in units of
patches: ``t`` temporal patches (each ``temporal_patch_size`` = 2 input frames), ``h x w`` spatial
patches of 14 x 14 pixels. Attention is joint over all ``t * h * w`` patches of a row and absent between
rows, exactly like ``transformers``' ``MiniMaxM3VLVisionModel`` (``merge_temporal=True``). How long a
clip is, is therefore decided by how a video's grid is split into rows: :func:`split_clips`, whose
``frames_per_clip`` counts temporal patches like HF's ``vision_segment_max_frames`` (default 4, i.e. 8
input frames per clip). RoPE positions restart at 0 in every clip, as in HF; because RoPE only sees
position differences and attention never crosses a clip, that restart changes nothing numerically.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from openm3.layers.recompute import CheckpointSwitch
from openm3.layers.vision import VisionBlock, VisionPatchEmbed, axial_rope_cos_sin, axial_rope_inv_freq
from openm3.ops.host import host_list, to_device

DEFAULT_FRAMES_PER_CLIP = 4  # HF MiniMaxM3VLVideoProcessor.vision_segment_max_frames (temporal patches)

# Keys that Hugging Face writes into every sub-config and that carry no meaning for the tower.
_HF_BOOKKEEPING = {"model_type", "transformers_version", "dtype", "torch_dtype", "architectures",
                   "_name_or_path", "base_config_key", "output_hidden_states", "output_attentions",
                   "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
                   "is_encoder_decoder", "_attn_implementation_autoset", "tie_word_embeddings"}


@dataclass
class M3VisionConfig:
    """Vision tower hyper-parameters; field names follow ``MiniMaxM3VLVisionConfig``."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 2016
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_channels", "image_size", "patch_size", "temporal_patch_size", "spatial_merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name, low in (("layer_norm_eps", "> 0"), ("rope_theta", "> 0"), ("initializer_range", ">= 0"),
                          ("attention_dropout", ">= 0")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (isinstance(value, float) and not math.isfinite(value)) or value < 0 \
                    or (low == "> 0" and value == 0):
                raise ValueError(f"{name}: expected a finite number {low}, got {value!r}")
        if self.attention_dropout >= 1:
            raise ValueError(f"attention_dropout: expected a probability in [0, 1), got {self.attention_dropout!r}")
        if not isinstance(self.hidden_act, str):
            raise ValueError(f"hidden_act: expected an activation name, got {self.hidden_act!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads: must divide hidden_size {self.hidden_size}, "
                             f"got {self.num_attention_heads}")
        if self.head_dim < 6:
            raise ValueError(f"hidden_size / num_attention_heads: expected >= 6 for 3D RoPE, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "M3VisionConfig":
        """Build from a Hugging Face ``vision_config`` dict (unchanged); unknown keys land in ``extra``."""
        if not isinstance(d, dict):
            raise ValueError(f"vision_config: expected a dict, got {type(d).__name__}")
        d = dict(d)
        rope = d.pop("rope_parameters", None) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters: expected a dict, got {rope!r}")
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ValueError(f"rope_parameters.rope_type: expected 'axial', got {rope_type!r}")
        theta = rope.get("rope_theta", d.pop("rope_theta", 10000.0))
        d.pop("rope_theta", None)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_theta"}
        kwargs = {k: d.pop(k) for k in list(d) if k in names}
        extra = {k: v for k, v in d.items() if k not in _HF_BOOKKEEPING}
        if isinstance(theta, int) and not isinstance(theta, bool):
            theta = float(theta)  # (any other type: __post_init__ names it)
        return cls(**kwargs, rope_theta=theta, extra=extra)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "M3VisionConfig":
        """A preset matching the text presets: ``m3`` (the real tower), ``m3-small``, ``m3-tiny``."""
        if name not in VISION_PRESETS:
            raise ValueError(f"name: expected one of {sorted(VISION_PRESETS)}, got {name!r}")
        return cls(**{**VISION_PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        """The Hugging Face ``vision_config`` form."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "rope_theta")}
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        d["model_type"] = "minimax_m3_vl_vision"
        return {**self.extra, **d}


VISION_PRESETS = {
    "m3": {},  # 1280 wide, 32 layers, 16 heads: M3's published tower
    "m3-small": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
    "m3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}


def _check_grid(grid_thw: torch.Tensor, merge: int) -> list[list[int]]:
    if not isinstance(grid_thw, torch.Tensor):
        raise ValueError(f"grid_thw: expected an integer tensor [G, 3] (t, h, w), got {type(grid_thw).__name__}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.dtype.is_floating_point \
            or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
        raise ValueError(f"grid_thw: expected an integer tensor [G, 3] (t, h, w), got "
                         f"{grid_thw.dtype} {tuple(grid_thw.shape)}")
    # a CUDA grid the trainer copied comes with its host values: no device read
    rows = host_list(grid_thw, "grid_thw")
    for t, h, w in rows:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid_thw: expected positive t, h, w with h and w divisible by {merge}, "
                             f"got {(t, h, w)}")
    return rows


def check_frames_per_clip(value, name: str = "frames_per_clip") -> int | None:
    """``value`` if it is a clip length in temporal patches (a positive int) or None (a whole video per clip);
    else ``ValueError`` naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}: expected a positive int (temporal patches per clip) or None (whole videos), "
                         f"got {value!r}")
    return value


def split_clips(grid_thw: torch.Tensor, frames_per_clip: int | None) -> tuple[torch.Tensor, list[int]]:
    """Split each grid row into clips of at most ``frames_per_clip`` temporal patches (HF's chunking).

    ``grid_thw: int [G, 3]`` -> ``(clips: int [C, 3], clips_per_row: list[int] of length G)``.
    ``None`` keeps every row whole (attention over the whole video). Patches of a row are stored frame
    after frame, so the clips of a row are consecutive slices of its patches and the packed
    ``pixel_values`` need no reordering.
    """
    check_frames_per_clip(frames_per_clip)
    rows = _check_grid(grid_thw, 1)
    clips, counts = [], []
    for t, h, w in rows:
        step = t if frames_per_clip is None else frames_per_clip
        row = [[min(step, t - s), h, w] for s in range(0, t, step)]
        clips.extend(row)
        counts.append(len(row))
    return torch.tensor(clips, dtype=torch.long), counts


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """One attention segment per grid row: ``int32 [G+1]`` cumulative ``t * h * w``, on the host."""
    bounds = [0]
    for t, h, w in _check_grid(grid_thw, 1):
        bounds.append(bounds[-1] + t * h * w)
    return torch.tensor(bounds, dtype=torch.int32)


def vision_position_ids(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(t, h, w) position of every patch, ``long [N, 3]`` on the host, in the processor's patch order.

    Within a frame, patches are ordered block by block over ``merge x merge`` blocks (row-major blocks,
    row-major inside a block), so each group of ``merge**2`` consecutive patches is one merged token.
    """
    m = spatial_merge_size
    out = []
    for t, h, w in _check_grid(grid_thw, m):
        hh = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        ww = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        hh, ww = hh.permute(0, 2, 1, 3).flatten(), ww.permute(0, 2, 1, 3).flatten()
        tt = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([tt, hh.repeat(t), ww.repeat(t)], dim=-1))
    return torch.cat(out)


@dataclass(frozen=True)
class ClipCost:
    """One attention segment: which grid row it came from, its frames and its cost per layer."""

    row: int              # index into the caller's grid_thw
    first_frame: int      # first temporal patch of the clip within its row
    frames: int           # temporal patches in the clip
    start: int            # offset of its first patch in the packed sequence
    patches: int          # t * h * w
    pairs: int            # query-key pairs attended: patches ** 2
    flops: int            # attention matmul FLOPs per layer: 4 * patches**2 * hidden (QK^T and PV)


def attention_plan(grid_thw: torch.Tensor, frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP,
                   hidden_size: int = 1280) -> list[ClipCost]:
    """Report the attention pattern and its cost for ``grid_thw: int [G, 3]`` split into clips.

    Each entry is one segment: every patch in ``[start, start + patches)`` attends to every patch of the
    same range and to nothing else. Summing ``pairs`` or ``flops`` gives the cost of the whole input.
    """
    clips, counts = split_clips(grid_thw, frames_per_clip)
    plan, start, k = [], 0, 0
    for row, n in enumerate(counts):
        first = 0
        for _ in range(n):
            t, h, w = clips[k].tolist()
            size = t * h * w
            plan.append(ClipCost(row, first, t, start, size, size * size, 4 * size * size * hidden_size))
            start, first, k = start + size, first + t, k + 1
    return plan


def format_plan(plan: list[ClipCost]) -> str:
    """A plain-text table of :func:`attention_plan`'s segments and their total cost."""
    lines = ["row  frames      patches        pairs   GFLOP/layer"]
    for c in plan:
        frames = f"{c.first_frame}-{c.first_frame + c.frames - 1}"
        lines.append(f"{c.row:>3}  {frames:>6}  {c.patches:>11,}  {c.pairs:>11,}  {c.flops / 1e9:>12.3f}")
    lines.append(f"total {len(plan)} segments, {sum(c.patches for c in plan):,} patches, "
                 f"{sum(c.pairs for c in plan):,} pairs, {sum(c.flops for c in plan) / 1e9:.3f} GFLOP/layer")
    return "\n".join(lines)


def segment_ids(plan: list[ClipCost]) -> torch.Tensor:
    """``long [N]``: the index of the segment each packed patch belongs to (patches i, j attend iff equal)."""
    return torch.cat([torch.full((c.patches,), i, dtype=torch.long) for i, c in enumerate(plan)])


def attention_mask(plan: list[ClipCost]) -> torch.Tensor:
    """``bool [N, N]``: ``mask[i, j]`` is True when patch i attends to patch j (small inputs only)."""
    seg = segment_ids(plan)
    return seg[:, None] == seg[None, :]


class M3VisionModel(CheckpointSwitch, nn.Module):
    """The ViT: patch embed -> pre-LayerNorm -> blocks with 3D RoPE and per-segment attention.

    ``pixel_values: [N, C * 2 * 14 * 14]`` packed patches, ``grid_thw: int [G, 3]`` one row per image or
    video clip -> ``[N, hidden]`` (no final norm, as in M3). ``frames_per_clip`` (temporal patches) splits
    rows further; ``None`` uses the rows as given, which is what HF does with the processor's chunks.
    """

    # dtype of the hidden states between blocks inside `openm3.models.text.residual_stream_dtype`; None: the
    # pre-LayerNorm's output dtype (fp32 under a bf16 autocast, which runs layer norms in fp32)
    residual_dtype: torch.dtype | None = None

    def __init__(self, config: M3VisionConfig):
        super().__init__()
        self.config = config
        c = config
        self.embeddings = VisionPatchEmbed(c.num_channels, c.hidden_size, c.patch_size, c.temporal_patch_size)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(
            VisionBlock(c.hidden_size, c.num_attention_heads, c.intermediate_size, c.hidden_act, c.layer_norm_eps)
            for _ in range(c.num_hidden_layers))
        self.register_buffer("inv_freq", axial_rope_inv_freq(c.head_dim, c.rope_theta), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                frames_per_clip: int | None = None) -> torch.Tensor:
        if frames_per_clip is not None:
            grid_thw, _ = split_clips(grid_thw, frames_per_clip)
        # Built on the host from the grid's host values and copied without waiting for the device's queued work;
        # the attention reads cu_seqlens' remembered host values.
        positions = to_device(vision_position_ids(grid_thw, self.config.spatial_merge_size), pixel_values.device)
        if positions.shape[0] != pixel_values.shape[0]:
            raise ValueError(f"pixel_values: grid_thw describes {positions.shape[0]} patches, "
                             f"got {pixel_values.shape[0]} rows")
        cu_seqlens = to_device(vision_cu_seqlens(grid_thw), pixel_values.device, remember=True)
        x = self.embeddings(pixel_values).to(self.pre_layrnorm.weight.dtype)
        cos, sin = axial_rope_cos_sin(positions, self.inv_freq)
        x = self.pre_layrnorm(x)
        if self.residual_dtype is not None:
            x = x.to(self.residual_dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, cu_seqlens, use_reentrant=False,
                               context_fn=self.checkpoint_contexts)
            else:
                x = layer(x, cos, sin, cu_seqlens)
        return x
