"""M3 models: configs and presets, the text decoder, checkpoint I/O."""

from .checkpoint import CheckpointError, load_pretrained, read_config, save_pretrained
from .config import PRESETS, M3TextConfig
from .text import M3TextModel, M3TextOutput

__all__ = ["M3TextConfig", "PRESETS", "M3TextModel", "M3TextOutput", "load_pretrained", "save_pretrained",
           "read_config", "CheckpointError"]
