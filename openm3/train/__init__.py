"""Training: the trainer (one process or torchrun + FSDP2), recipes, WSD schedule, checkpoints, evaluation.

`Trainer`, `Row`, `RowSource`, `MixtureRows` and `Evaluator` are importable from here too, but load their modules
(`openm3.train.trainer`, `.batches`, `.data`, `.eval`) only when first used, so `import openm3.train` stays light.
"""

from __future__ import annotations

import importlib

from .config import TrainConfig
from .recipes import RECIPES, make_plan
from .schedule import WSDSchedule

_LAZY = {"Trainer": ".trainer", "Row": ".batches", "RowSource": ".batches", "MixtureRows": ".data",
         "Evaluator": ".eval"}

__all__ = ["TrainConfig", "RECIPES", "make_plan", "WSDSchedule", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
