"""Run by tests/test_train_distributed.py under torchrun (not a test module itself):

    torchrun --standalone --nproc_per_node=2 tests/test_train_dist_run.py OUT_DIR STEPS UNTIL

trains the toy model of a STEPS-step run up to step UNTIL (checkpointing every 2 steps) and writes its history.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from openm3.train.config import TrainConfig  # noqa: E402
from openm3.train.distributed import shutdown_distributed  # noqa: E402
from openm3.train.trainer import Trainer  # noqa: E402
from test_train_toy import ToyLM, ToySource  # noqa: E402


def dist_cfg(out_dir: str, steps: int, micro_batch: int) -> TrainConfig:
    return TrainConfig(recipe="text-only", steps=steps, seq_len=24, text_rows=4, micro_batch=micro_batch, lr=1e-2,
                       warmup_steps=2, msa_switch_step=2, out_dir=out_dir, ckpt_every=2, progress=False,
                       tensorboard=False)


if __name__ == "__main__":
    out, steps, until = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trainer = Trainer(dist_cfg(out, steps, micro_batch=1), ToyLM, ToySource())
    history = trainer.fit(until=until)
    if trainer.info.is_main:
        Path(out, f"history_{trainer.info.world_size}.json").write_text(json.dumps(history))
    trainer.close()
    shutdown_distributed()
