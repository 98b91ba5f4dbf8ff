"""Two ranks (FSDP2 over NCCL, or gloo on CPU) against one process: the same losses, step by step.

    python -m benchmarks.train_distributed --out benchmarks/results/      # on a machine with 2 GPUs (~1 minute)

Trains the m3-tiny text model (dense warm-up then MSA, MoE) on random tokens in fp32 (TF32 off) for a few steps,
once under `torchrun --nproc_per_node=2` and once in this process, one row per micro-batch in both, and writes
every step's loss, indexer KL and load-balancing loss of both runs and their largest difference to
`<out>/train_distributed.json` (with hardware, versions, date). The CPU acceptance test is
`tests/test_train_distributed.py`; this is its record on GPUs. The runs differ only in summation order, but the
model makes discrete choices (top-k experts, top-k key blocks): once a rounding difference flips one near-tie the
runs drift apart, which on CPU happens from the fourth step on (~1e-5 at step 3, ~1e-3 by step 6).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import RESULTS

RUNS_ON = "2 GPUs or CPU"  # what `openm3 bench` lists beside it

STEPS, CTX, ROWS = 4, 1024, 4


def run(out_dir: str) -> list[dict]:
    from benchmarks.train_throughput import RandomRows
    from openm3.models.config import M3TextConfig
    from openm3.models.text import M3TextModel
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import Trainer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mcfg = M3TextConfig.from_name("m3-tiny")
    cfg = TrainConfig(model="m3-tiny", recipe="text-only", steps=STEPS, seq_len=CTX, text_rows=ROWS, micro_batch=1,
                      warmup_steps=1, msa_switch_step=2, out_dir=out_dir, progress=False, tensorboard=False,
                      param_dtype="float32")
    trainer = Trainer(cfg, lambda: M3TextModel(mcfg), RandomRows(mcfg.vocab_size, CTX))
    history = trainer.fit()
    if trainer.info.is_main:
        Path(out_dir, f"history_{trainer.info.world_size}.json").write_text(json.dumps(history))
    return history


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run(args.worker)
        return 0
    work = args.out / "train_distributed_runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "benchmarks.train_distributed", "--worker", str(work / "two")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"torchrun failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    two = json.loads((work / "two" / "history_2.json").read_text())
    one = run(str(work / "one"))
    keys = ("loss", "indexer_kl", "aux_loss")
    diff = max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in keys)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
              "python": platform.python_version(),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "backend": "nccl" if torch.cuda.is_available() else "gloo", "steps": STEPS, "ctx": CTX, "rows": ROWS,
              "max_abs_diff": diff, "within_1e-5": diff <= 1e-5,
              "one_process": [{k: r[k] for k in ("step", *keys)} for r in one],
              "two_ranks": [{k: r[k] for k in ("step", *keys)} for r in two]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_distributed.json").write_text(json.dumps(result, indent=1))
    print(f"max |difference| {diff:.3g} over {STEPS} steps ({result['backend']}); "
          f"wrote {args.out}/train_distributed.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
