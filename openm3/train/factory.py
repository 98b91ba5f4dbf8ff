"""Model constructors for training: the M3 text model or the vision-language model, sized to the tokenizer, or a
checkpoint's weights as a run's starting point."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch import nn


def model_builder(name: str, tokenizer, *, multimodal: bool = True, **overrides) -> Callable[[], nn.Module]:
    """A zero-argument constructor of preset `name` (`m3-tiny`, `m3-small`, `m3`) whose vocabulary and
    placeholder ids are the tokenizer's. `overrides` are `M3TextConfig` fields. Its `text_config` attribute is the
    text decoder's config (read before anything is built), its `multimodal` whether it builds the vision-language
    model."""
    from ..models.config import PRESETS, M3TextConfig

    if name not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}, got {name!r}")
    overrides = {"vocab_size": tokenizer.vocab_size, **overrides}
    # a preset that names the published tokenizer's bos / eos ids (`m3`: 200034 / 200020) takes this tokenizer's
    base = PRESETS[name]()
    for key, own in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        if base.get(key, getattr(M3TextConfig, key)) is not None and key not in overrides:
            overrides[key] = getattr(tokenizer, own)
    if not multimodal:
        from ..models.text import M3TextModel

        config = M3TextConfig.from_name(name, **overrides)
        build, build.text_config = (lambda: M3TextModel(config)), config
        build.multimodal = False
        return build

    from ..models.multimodal import M3ForConditionalGeneration, M3VLConfig

    config = M3VLConfig.from_name(name, image_token_index=tokenizer.image_id, video_token_index=tokenizer.video_id,
                                  **overrides)
    build, build.text_config = (lambda: M3ForConditionalGeneration(config)), config.text_config
    build.multimodal = True
    return build


def checkpoint_tokenizer(path: str | Path):
    """The `M3Tokenizer` stored beside checkpoint `path` (its `tokenizer.json`, as `--export` writes it), or None.
    Raises ValueError naming `init_from` when `path` is no checkpoint directory (config.json is read and checked,
    nothing else): a run fails there before any compute."""
    from ..models.checkpoint import CheckpointError, config_json

    root = Path(path)
    try:
        if not root.is_dir():
            raise CheckpointError(f"{root}: checkpoint directory not found")
        config_json(root)
    except CheckpointError as err:
        raise ValueError(f"init_from: {err}") from None
    if not (root / "tokenizer.json").is_file():
        return None
    from ..data.tokenizer import M3Tokenizer

    return M3Tokenizer.from_file(root)


def checkpoint_builder(path: str | Path, tokenizer, *, multimodal: bool) -> Callable[[], nn.Module]:
    """A zero-argument constructor of the model in checkpoint directory `path` with its weights (any layout
    `load_pretrained` reads, fp8 releases dequantized) in float32: a training run's starting point. Checks first,
    without reading weights, that it suits the run: a vision-language checkpoint when `multimodal` (the recipe has
    image or video rows), the tokenizer's ids inside its vocabulary, and the tokenizer's image / video
    placeholder ids for a VL checkpoint. Raises ValueError naming `init_from`. Its `text_config` attribute is the
    text decoder's config, its `multimodal` whether the checkpoint is a vision-language one, and its `skeleton`
    builds the architecture without reading weights."""
    import torch

    from ..models.checkpoint import CheckpointError, load_pretrained, read_configs

    root = Path(path)
    try:
        config, text = read_configs(root)
        is_vl = config is not None
    except CheckpointError as err:
        raise ValueError(f"init_from: {err}") from None
    if multimodal and not is_vl:
        raise ValueError(f"init_from: {root} holds a text-only M3 model, but the recipe trains on images or videos "
                         "(use a vision-language checkpoint, or recipe text-only)")
    if tokenizer.vocab_size > text.vocab_size:
        raise ValueError(f"init_from: the tokenizer has {tokenizer.vocab_size} tokens, more than the checkpoint's "
                         f"vocab_size={text.vocab_size} (train with the tokenizer.json saved beside it)")
    if is_vl and (tokenizer.image_id, tokenizer.video_id) != (config.image_token_index, config.video_token_index):
        raise ValueError(f"init_from: the tokenizer's image / video ids {tokenizer.image_id} / {tokenizer.video_id} "
                         f"differ from the checkpoint's image_token_index / video_token_index "
                         f"{config.image_token_index} / {config.video_token_index}")
    def build() -> nn.Module:
        return load_pretrained(root, dtype=torch.float32).train()

    build.text_config, build.multimodal = text, is_vl

    # the same architecture without reading the weights (an export needs only its structure to save into)
    if is_vl:
        from ..models.multimodal import M3ForConditionalGeneration

        build.skeleton = lambda: M3ForConditionalGeneration(config)
    else:
        from ..models.text import M3TextModel

        build.skeleton = lambda: M3TextModel(text)
    return build
