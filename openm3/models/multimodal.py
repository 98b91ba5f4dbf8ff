"""`M3ForConditionalGeneration`: M3's text decoder + vision tower + projector, and its checkpoints.

Visual tokens enter the text as embeddings: the prompt holds one image (video) placeholder token per
merged 2 x 2 patch group, and the projected vision features overwrite those positions in order
(``masked_scatter``), images first, then videos, exactly as ``transformers``'
``MiniMaxM3SparseForConditionalGeneration`` does. Everything else is the text model's business.

Checkpoints: ``from_pretrained`` reads the layout MiniMax publishes (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``patch_merge_mlp.*``; transformers also
writes this layout with ``save_pretrained``), transformers' in-memory layout (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.*``) and this model's own ``state_dict()``
names (transformers' without ``model.``); ``save_pretrained`` writes the
published one, through ``openm3.models.checkpoint.write_checkpoint`` (atomic). The text tensors go through
``openm3.models.checkpoint``; the vision tensors are mapped here, shard by shard.
``openm3.models.load_pretrained`` returns this model for a config.json with a ``vision_config``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from . import checkpoint as text_checkpoint
from .config import M3TextConfig
from .text import M3TextModel, M3TextOutput, check_input_ids
from .vision import M3VisionConfig, M3VisionModel, _check_grid
from ..layers.vision import VisionProjector, axial_rope_inv_freq


@dataclass
class M3VLConfig:
    """Text + vision configs and the placeholder token ids; field names follow ``MiniMaxM3VLConfig``."""

    text_config: M3TextConfig = field(default_factory=M3TextConfig)
    vision_config: M3VisionConfig = field(default_factory=M3VisionConfig)
    image_token_index: int = 200025
    video_token_index: int = 200026
    projector_hidden_size: int = 6144
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not isinstance(self.text_config, M3TextConfig) or not isinstance(self.vision_config, M3VisionConfig):
            raise ValueError("text_config / vision_config: expected M3TextConfig and M3VisionConfig instances "
                             "(use M3VLConfig.from_dict for dicts)")
        vocab = self.text_config.vocab_size
        for name in ("image_token_index", "video_token_index"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
                raise ValueError(f"{name}: expected a token id in [0, vocab_size={vocab}), got {value!r}")
        if self.image_token_index == self.video_token_index:
            raise ValueError(f"video_token_index: must differ from image_token_index {self.image_token_index}")
        if not isinstance(self.projector_hidden_size, int) or isinstance(self.projector_hidden_size, bool) \
                or self.projector_hidden_size <= 0:
            raise ValueError(f"projector_hidden_size: expected a positive int, got {self.projector_hidden_size!r}")

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text_config.tie_word_embeddings

    @classmethod
    def from_name(cls, name: str, image_token_index: int | None = None, video_token_index: int | None = None,
                  **text_overrides: Any) -> "M3VLConfig":
        """A preset (``m3``, ``m3-small``, ``m3-tiny``). Placeholder ids default to M3's only for ``m3``;
        the smaller presets use their own vocabulary, so take the ids from its tokenizer."""
        if name != "m3" and (image_token_index is None or video_token_index is None):
            raise ValueError(f"image_token_index / video_token_index: required for preset {name!r} "
                             "(the ids of the tokenizer's image and video placeholders)")
        text = M3TextConfig.from_name(name, **text_overrides)
        return cls(text, M3VisionConfig.from_name(name),
                   image_token_index=200025 if image_token_index is None else image_token_index,
                   video_token_index=200026 if video_token_index is None else video_token_index,
                   projector_hidden_size=6144 if name == "m3" else text.hidden_size)

    @classmethod
    def from_dict(cls, d: dict) -> "M3VLConfig":
        """Build from a Hugging Face ``minimax_m3_vl`` config.json dict, unchanged."""
        if not isinstance(d, dict) or "text_config" not in d or "vision_config" not in d:
            raise ValueError("config: expected a minimax_m3_vl dict with 'text_config' and 'vision_config'")
        text = M3TextConfig.from_dict(d)  # reads text_config and the outer tie_word_embeddings
        vision = M3VisionConfig.from_dict(d["vision_config"] or {})
        known = {"text_config", "vision_config", "image_token_index", "image_token_id", "video_token_index",
                 "video_token_id", "projector_hidden_size", "tie_word_embeddings", "model_type", "architectures",
                 "transformers_version", "dtype", "torch_dtype", "quantization_config"}
        return cls(text, vision,
                   image_token_index=d.get("image_token_index", d.get("image_token_id", 200025)),
                   video_token_index=d.get("video_token_index", d.get("video_token_id", 200026)),
                   projector_hidden_size=d.get("projector_hidden_size", 6144),
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        """The config.json that transformers and ``from_dict`` both read."""
        return {**self.extra, "model_type": "minimax_m3_vl",
                "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                "text_config": self.text_config.to_dict(), "vision_config": self.vision_config.to_dict(),
                "image_token_index": self.image_token_index, "video_token_index": self.video_token_index,
                "projector_hidden_size": self.projector_hidden_size,
                "tie_word_embeddings": self.tie_word_embeddings}


def _placeholder_error(kind: str, count: int, tokens: int | None):
    if tokens is None:
        raise ValueError(f"input_ids: {count} {kind} placeholder tokens but no "
                         f"{'pixel_values' if kind == 'image' else 'pixel_values_videos'}")
    raise ValueError(f"input_ids: {count} {kind} placeholder tokens but the {kind}s give {tokens} visual tokens")


class M3ForConditionalGeneration(nn.Module):
    """Text decoder (``language_model``, with its ``lm_head``), ``vision_tower`` and ``multi_modal_projector``."""

    def __init__(self, config: M3VLConfig):
        super().__init__()
        if not isinstance(config, M3VLConfig):
            raise ValueError(f"config: expected an M3VLConfig, got {type(config).__name__}")
        self.config = config
        self.language_model = M3TextModel(config.text_config)
        self.vision_tower = M3VisionModel(config.vision_config)
        self.multi_modal_projector = VisionProjector(config.vision_config.hidden_size, config.projector_hidden_size,
                                                     config.text_config.hidden_size,
                                                     config.vision_config.spatial_merge_size)
        if not any(p.is_meta for p in self.vision_tower.parameters()):
            self.reset_vision_parameters()

    @property
    def dtype(self) -> torch.dtype:
        """The text decoder's parameter dtype (`openm3.models.load_pretrained` loads the tower in the same one)."""
        return self.language_model.dtype

    @property
    def device(self) -> torch.device:
        """The device the text decoder's parameters are on."""
        return self.language_model.device

    def gradient_checkpointing_enable(self, keep_attention: bool = False) -> None:
        """Checkpoint the decoder layers and the tower's blocks (see `M3TextModel.gradient_checkpointing_enable`)."""
        self.language_model.gradient_checkpointing_enable(keep_attention)
        self.vision_tower.gradient_checkpointing_enable(keep_attention)

    def gradient_checkpointing_disable(self) -> None:
        self.language_model.gradient_checkpointing_disable()
        self.vision_tower.gradient_checkpointing_disable()

    @torch.no_grad()
    def reset_vision_parameters(self) -> None:
        """Random init of tower and projector as transformers does: normal(0, initializer_range) weights,
        zero biases, unit LayerNorms (the text model initialises itself)."""
        for module, std in ((self.vision_tower, self.config.vision_config.initializer_range),
                            (self.multi_modal_projector, self.config.text_config.initializer_range)):
            for m in module.modules():
                if isinstance(m, (nn.Linear, nn.Conv3d)):
                    nn.init.normal_(m.weight, 0.0, std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.LayerNorm):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------ vision -> text embeddings
    def visual_tokens(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                      frames_per_clip: int | None = None, *, name: str = "pixel_values") -> torch.Tensor:
        """Packed patches ``[N, C*2*14*14]`` with ``grid_thw: [G, 3]`` -> text-space tokens ``[N / 4, hidden]``.

        The patches are normalised pixels (floating, as ``M3Processor`` writes them); anything else is refused
        with a ``ValueError`` naming ``name`` (the argument they came in as)."""
        check_pixel_values(pixel_values, name)
        features = self.vision_tower(pixel_values, grid_thw, frames_per_clip=frames_per_clip)
        return self.multi_modal_projector(features)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
              video_grid_thw: torch.Tensor | None = None, frames_per_clip: int | None = None) -> torch.Tensor:
        """``input_ids: [T]`` -> ``[T, hidden]`` with image then video placeholders replaced by visual tokens.

        Raises ``ValueError`` when the number of placeholders differs from the number of visual tokens. Inside
        ``input_ids_checked_by_caller`` the counts are not read back from the device (a sync each): the caller
        checked them on the host with ``check_visual_placeholders``."""
        checked = self.language_model.input_ids_prechecked
        check_input_ids(input_ids, self.config.text_config.vocab_size, read_range=not checked)
        embeds = self.language_model.embed_tokens(input_ids)
        for kind, pixels, grid, token in (("image", pixel_values, image_grid_thw, self.config.image_token_index),
                                          ("video", pixel_values_videos, video_grid_thw,
                                           self.config.video_token_index)):
            slots = input_ids == token
            if pixels is None:
                if not checked and bool(slots.any()):
                    _placeholder_error(kind, int(slots.sum()), None)
                continue
            if grid is None:
                raise ValueError(f"{kind}_grid_thw: required with the {kind} pixels")
            tokens = self.visual_tokens(pixels, grid, frames_per_clip if kind == "video" else None,
                                        name="pixel_values" if kind == "image" else "pixel_values_videos")
            if not checked and int(slots.sum()) != tokens.shape[0]:
                _placeholder_error(kind, int(slots.sum()), tokens.shape[0])
            # The placeholder positions with their count known (from the grid): no device sync, and the backward
            # gathers (masked_scatter's backward is a masked_select, which reads its output size back).
            where = torch.nonzero_static(slots, size=tokens.shape[0]).squeeze(1)
            embeds = embeds.index_copy(0, where, tokens.to(embeds.dtype))
        return embeds

    def check_visual_placeholders(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                                  video_grid_thw: torch.Tensor | None = None) -> None:
        """What ``embed`` checks, from host tensors (no device read): each kind's placeholder count in
        ``input_ids`` equals the visual tokens its grid gives (``t * h * w / merge**2`` per row; splitting videos
        into clips does not change it). Raises ``ValueError`` as ``embed`` does."""
        merge = self.config.vision_config.spatial_merge_size
        for kind, grid, token in (("image", image_grid_thw, self.config.image_token_index),
                                  ("video", video_grid_thw, self.config.video_token_index)):
            count = int((input_ids == token).sum())
            patches = None if grid is None else sum(t * h * w for t, h, w in _check_grid(grid, merge))
            expected = None if patches is None else patches // merge ** 2
            if count != (expected or 0):
                _placeholder_error(kind, count, expected)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, *, frames_per_clip: int | None = None,
                labels: torch.Tensor | None = None, num_items_in_batch: torch.Tensor | int | float | None = None,
                **text_kwargs: Any) -> M3TextOutput:
        """Logits for packed ``input_ids: [T]`` (``cu_seqlens``, ``position_ids`` etc. go to the text model).

        Images are ``pixel_values: [N, 1176]`` with ``image_grid_thw: [I, 3]``; videos are
        ``pixel_values_videos: [M, 1176]`` with ``video_grid_thw: [K, 3]``, one row per clip, as the processor
        writes them (``M3Processor``'s ``VisionBatch``: ``model(ids, **vision.model_inputs())``).
        ``frames_per_clip`` splits video rows further (experiments; None keeps the rows). ``labels: [T]``
        (unshifted, -100 ignored, e.g. at the placeholders) and ``num_items_in_batch`` add ``loss`` as in
        ``M3TextModel.forward``."""
        embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                            frames_per_clip)
        return self.language_model(inputs_embeds=embeds, labels=labels, num_items_in_batch=num_items_in_batch,
                                   **text_kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path, *, max_shard_size: int | str = "5GB") -> Path:
        """Write config.json, safetensors shards and their index in the published MiniMax layout (atomically)."""
        return save_pretrained(self, path, max_shard_size=max_shard_size)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device=None
                        ) -> "M3ForConditionalGeneration":
        """The VL model of local checkpoint directory ``path`` (a config.json with a ``vision_config``; either
        layout, fp8 weights dequantized), in eval mode; ``load_pretrained`` below.

        dtype: torch.bfloat16 / float16 / float32 / float64, 'bfloat16' / 'float16' / 'float32', or None / 'auto'
        for config.json's ``dtype`` (float32 when it has none); the tower and projector take the text decoder's.
        device: where the weights are allocated (default CPU)."""
        return load_pretrained(path, dtype=dtype, device=device)


def check_pixel_values(pixels, name: str) -> None:
    """ValueError naming `name` unless `pixels` is a floating tensor: raw pixels (uint8 0-255) would run through the
    tower unnormalised and give wrong visual tokens without any error."""
    if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
        got = pixels.dtype if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(f"{name}: expected normalised pixels (a floating tensor), got {got}: raw images and videos "
                         f"go through openm3.models.M3Processor (or M3ImageProcessor / M3VideoProcessor in "
                         f"openm3.models.processor), which rescales them and normalises them with the CLIP mean and "
                         f"std")


# ---------------------------------------------------------------------------------------------- vision names
# (checkpoint name pattern, our name template), published layout first, then transformers' layout.
_VISION_LOAD = tuple((re.compile(p), t) for p, t in (
    (r"vision_tower\.vision_model\.embeddings\.patch_embedding\.(.+)", "vision_tower.embeddings.proj.{0}"),
    (r"vision_tower\.vision_model\.encoder\.layers\.(.+)", "vision_tower.layers.{0}"),
    (r"vision_tower\.vision_model\.pre_layrnorm\.(.+)", "vision_tower.pre_layrnorm.{0}"),
    (r"multi_modal_projector\.(linear_[12]\..+)", "multi_modal_projector.{0}"),
    (r"patch_merge_mlp\.linear_([12])\.(.+)", "multi_modal_projector.merge_linear_{0}.{1}"),
    (r"model\.(vision_tower\..+)", "{0}"),
    (r"model\.(multi_modal_projector\..+)", "{0}"),
    # the model's own state_dict() names (transformers' without `model.`)
    (r"(vision_tower\.(?:embeddings|layers|pre_layrnorm)\..+)", "{0}"),
    (r"(multi_modal_projector\.merge_linear_[12]\..+)", "{0}"),
))
_VISION_NAME = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.")


def vision_checkpoint_name(name: str) -> str | None:
    """Our parameter name for a vision/projector checkpoint tensor (either layout); None for other tensors."""
    if not _VISION_NAME.match(name):
        return None
    for pattern, template in _VISION_LOAD:
        m = pattern.fullmatch(name)
        if m:
            return template.format(*m.groups())
    raise text_checkpoint.CheckpointError(f"{name}: unknown vision tensor name")


# our prefix -> published prefix (first match wins)
_VISION_SAVE = (
    ("vision_tower.embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
    ("vision_tower.layers.", "vision_tower.vision_model.encoder.layers."),
    ("vision_tower.pre_layrnorm.", "vision_tower.vision_model.pre_layrnorm."),
    ("multi_modal_projector.merge_linear_", "patch_merge_mlp.linear_"),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def published_vision_name(name: str) -> str:
    """The published name of our vision/projector parameter ``name``."""
    for prefix, published in _VISION_SAVE:
        if name.startswith(prefix):
            return published + name[len(prefix):]
    raise ValueError(f"name: not a vision tower or projector parameter: {name}")


def published_tensors(model: M3ForConditionalGeneration):
    """(published name, tensor) for every weight of ``model``."""
    yield from text_checkpoint.published_tensors(model.language_model)
    for name, tensor in model.state_dict().items():
        if not name.startswith("language_model."):
            yield published_vision_name(name), tensor


def save_pretrained(model: M3ForConditionalGeneration, path, *, max_shard_size: int | str = "5GB") -> Path:
    """Write ``path/config.json``, the safetensors shards and their index in the published layout, atomically
    (``openm3.models.checkpoint.write_checkpoint``); returns the path."""
    if not isinstance(model, M3ForConditionalGeneration):
        raise ValueError(f"model: expected an M3ForConditionalGeneration, got {type(model).__name__}")
    config = model.config.to_dict()
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return text_checkpoint.write_checkpoint(published_tensors(model), config, path, max_shard_size)


def read_config(path) -> M3VLConfig:
    """The ``M3VLConfig`` of a checkpoint directory."""
    data = text_checkpoint.config_json(path)
    try:
        return M3VLConfig.from_dict(data)
    except ValueError as err:
        raise text_checkpoint.CheckpointError(f"{Path(path) / text_checkpoint.CONFIG_FILE}: unsupported config: "
                                              f"{err}") from None


def load_pretrained(path, dtype: torch.dtype | str | None = None, device=None) -> M3ForConditionalGeneration:
    """Load the VL model from a local checkpoint directory in either layout; returns it in eval mode. dtype: as
    ``openm3.models.checkpoint.load_text_model``'s.

    The text model is loaded by ``openm3.models.checkpoint`` (which skips vision tensors); the vision tower
    and projector are then filled shard by shard here. Every vision weight must be present exactly once."""
    root = Path(path)
    if not root.is_dir():
        raise text_checkpoint.CheckpointError(f"{root}: checkpoint directory not found")
    dtype = text_checkpoint.check_dtype(dtype)
    config = read_config(root)
    source = text_checkpoint.TensorSource(root)  # dequantizes fp8 weights, hides their scales
    language_model = text_checkpoint.load_text_model(root, dtype=dtype, device=device, source=source)
    dtype = next(language_model.parameters()).dtype
    device = next(language_model.parameters()).device
    with torch.device("meta"):
        model = M3ForConditionalGeneration(dataclasses.replace(config, text_config=language_model.config))
    model.language_model = language_model
    model.vision_tower.to(dtype=dtype).to_empty(device=device)
    model.multi_modal_projector.to(dtype=dtype).to_empty(device=device)
    model.vision_tower.inv_freq = axial_rope_inv_freq(config.vision_config.head_dim,
                                                      config.vision_config.rope_theta).to(device)
    params = {n: p for n, p in model.state_dict(keep_vars=True).items() if not n.startswith("language_model.")}
    filled: set[str] = set()
    with torch.no_grad():
        for file, names in source.files.items():
            with safe_open(str(root / file), framework="pt", device="cpu") as f:
                for name in names:
                    ours = vision_checkpoint_name(name)
                    if ours is None:
                        continue
                    if ours not in params:
                        raise text_checkpoint.CheckpointError(f"{root / file}: {name}: no such vision weight "
                                                              f"({ours}) in this config")
                    if ours in filled:
                        raise text_checkpoint.CheckpointError(f"{root}: {name} fills {ours} a second time")
                    source.check(f, name)
                    tensor = source.get(f, name, device)
                    if tuple(tensor.shape) != tuple(params[ours].shape):
                        raise text_checkpoint.CheckpointError(
                            f"{root / file}: {name}: shape {list(tensor.shape)} vs model {list(params[ours].shape)}")
                    params[ours].copy_(tensor)
                    filled.add(ours)
    missing = sorted(set(params) - filled)
    if missing:
        raise text_checkpoint.CheckpointError(f"{root}: checkpoint lacks vision tensors: {missing[:5]}")
    return model.eval()
