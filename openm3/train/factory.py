"""Model constructors for training: the M3 text model or the vision-language model, sized to the tokenizer."""

from __future__ import annotations

from typing import Callable

from torch import nn


def model_builder(name: str, tokenizer, *, multimodal: bool = True, **overrides) -> Callable[[], nn.Module]:
    """A zero-argument constructor of preset `name` (`m3-tiny`, `m3-small`, `m3`) whose vocabulary and
    placeholder ids are the tokenizer's. `overrides` are `M3TextConfig` fields."""
    from ..models.config import PRESETS, M3TextConfig

    if name not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}, got {name!r}")
    overrides = {"vocab_size": tokenizer.vocab_size, **overrides}
    if not multimodal:
        from ..models.text import M3TextModel

        config = M3TextConfig.from_name(name, **overrides)
        return lambda: M3TextModel(config)

    from ..models.multimodal import M3ForConditionalGeneration, M3VLConfig

    config = M3VLConfig.from_name(name, image_token_index=tokenizer.image_id, video_token_index=tokenizer.video_id,
                                  **overrides)
    return lambda: M3ForConditionalGeneration(config)
