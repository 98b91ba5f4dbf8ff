"""`torchrun --nproc_per_node=2` (gloo, FSDP2) matches the single-process run within 1e-5."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from openm3.train.trainer import Trainer
from test_train_dist_run import dist_cfg
from test_train_toy import ToyLM, ToySource

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def torchrun(*args, timeout=300):
    """Run `args` (a script and its arguments, or `-m module ...`) on two gloo ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *map(str, args)]
    # own process group, so a hang is cleaned up with every rank rather than leaving workers behind
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout}s:\n{out[-2000:]}\n{err[-2000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-3000:]


@pytest.mark.parametrize("steps,until", [(6, 4)], ids=["gloo-2ranks-steps4of6-rows4-seq24"])
def test_two_ranks_match_one_process(tmp_path, steps, until):
    torchrun(HERE / "test_train_dist_run.py", tmp_path / "dist", steps, until)
    two = json.loads((tmp_path / "dist" / "history_2.json").read_text())
    # one process, one row per micro-batch: the same row groups the two ranks see, so the batch-level MoE
    # load-balancing term is computed over the same rows
    one = Trainer(dist_cfg(str(tmp_path / "single"), steps, micro_batch=1), ToyLM, ToySource()).fit()
    assert [r["step"] for r in two] == list(range(until))
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["loss"], b["loss"])
        assert abs(a["indexer_kl"] - b["indexer_kl"]) <= 1e-5
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5
    assert two[-1]["loss"] < two[0]["loss"]

    # the sharded checkpoint the two ranks wrote at step 4 resumes in one process (DCP reshards) and continues
    # like the single-process run
    resumed = Trainer(dist_cfg(str(tmp_path / "dist"), steps, micro_batch=1), ToyLM, ToySource())
    assert resumed.resume() and resumed.step == until
    more = resumed.fit()
    assert [r["loss"] for r in more] == pytest.approx([r["loss"] for r in one[until:]], abs=1e-5)


REAL_CONFIG = {"extra": {"weights": {"text:stdlib": 1.0, "colour_qa": 1.0}, "image_size": 56,
                         "eval": {"windows": 1, "qa": {"colour_qa": 2}}},
               "mixture": {"text": 1.0, "image": 1.0, "video": 0.0}, "steps": 3, "seq_len": 256, "text_rows": 2,
               "micro_batch": 1, "warmup_steps": 1, "msa_switch_step": 1, "progress": False, "tensorboard": False,
               "device": "cpu"}


def test_real_model_two_ranks_match_one_process(tmp_path):
    """`openm3 train` under torchrun: the m3-tiny vision-language model (dense warm-up then MSA, MoE) on text
    and image rows, FSDP2 over two gloo ranks, against the same run in one process."""
    from openm3.train import cli
    from openm3.train.metrics import read_jsonl

    config = tmp_path / "run.json"
    config.write_text(json.dumps(REAL_CONFIG))
    torchrun("-m", "openm3.train.cli", "--config", config, "--out", tmp_path / "two", "--export", tmp_path / "model")
    assert cli.main(["--config", str(config), "--out", str(tmp_path / "one")]) == 0
    two = [r for r in read_jsonl(tmp_path / "two" / "metrics.jsonl") if "loss" in r]
    one = [r for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    assert len(two) == len(one) == 3
    for a, b in zip(one, two):
        for key in ("loss", "indexer_kl", "aux_loss", "loss/image"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert (tmp_path / "model" / "config.json").is_file()
