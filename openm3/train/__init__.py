"""Training: the trainer (one process or torchrun + FSDP2), recipes, WSD schedule, checkpoints, evaluation.

Heavy pieces are imported from their modules (`openm3.train.trainer.Trainer`, `openm3.train.data.MixtureRows`,
`openm3.train.eval.Evaluator`) so `import openm3.train` stays light.
"""

from .config import TrainConfig
from .recipes import RECIPES, make_plan
from .schedule import WSDSchedule

__all__ = ["TrainConfig", "RECIPES", "make_plan", "WSDSchedule"]
