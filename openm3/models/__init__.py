"""M3 models: configs and presets, the text decoder, the vision tower, the vision-language model, checkpoint I/O.

`load_pretrained(path)` returns an `M3TextModel`, or an `M3ForConditionalGeneration` when the checkpoint's
config.json is a VL config (one with a `vision_config`); `load_text_model(path)` always returns the text decoder.
"""

from .checkpoint import (CheckpointError, load_pretrained, load_text_model, read_config, save_pretrained,
                         write_checkpoint)
from .config import PRESETS, M3TextConfig
from .multimodal import M3ForConditionalGeneration, M3VLConfig
from .processor import M3Processor
from .text import M3TextModel, M3TextOutput
from .vision import M3VisionConfig, M3VisionModel, attention_plan, format_plan

__all__ = ["M3TextConfig", "PRESETS", "M3TextModel", "M3TextOutput", "M3VisionConfig", "M3VisionModel", "M3VLConfig",
           "M3ForConditionalGeneration", "M3Processor", "attention_plan", "format_plan", "load_pretrained",
           "load_text_model", "save_pretrained", "write_checkpoint", "read_config", "CheckpointError"]
