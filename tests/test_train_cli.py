"""`openm3 train`'s settings: `--resume` takes the run's own settings from its checkpoint (changes to how it runs
applied, changes to what it trains refused by name, no checkpoint an error), a short run gets a warm-up that fits,
`--config` and `--seq-len` mistakes fail before any compute. (`tests/test_train_data.py` trains and resumes through
the CLI end to end.)"""

import json

import pytest
import torch

from openm3.train import cli
from openm3.train.config import TrainConfig


def fake_run(out, step: int = 5, **fields) -> TrainConfig:
    """A run folder holding one complete checkpoint (its meta and trainer state, no shards: enough for the
    settings) of a run made with `fields`."""
    cfg = TrainConfig(out_dir=str(out), **fields)
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": step}))
    torch.save({"step": step, "config": cfg.to_dict()}, ckpt / "trainer_state.pt")
    return cfg


def settings(argv):
    return cli.build_config(cli.parse_args(argv))


def test_resume_takes_the_runs_own_settings(tmp_path, capsys):
    made = fake_run(tmp_path / "run", recipe="text-only", seq_len=128, steps=40, lr=1e-3, seed=3)
    cfg = settings(["--out", str(tmp_path / "run"), "--resume"])
    assert cfg.to_dict() == made.to_dict()
    assert capsys.readouterr().out.strip() == f"resuming {tmp_path / 'run'} from step_00000005 (step 5 of 40)"


def test_resume_applies_changes_to_how_the_run_goes(tmp_path, capsys):
    made = fake_run(tmp_path / "run", steps=40)
    cfg = settings(["--out", str(tmp_path / "run"), "--resume", "--steps", "60", "--micro-batch", "1",
                    "--ckpt-every", "5", "--seq-len", str(made.seq_len)])  # a setting given as it was is no change
    assert (cfg.steps, cfg.micro_batch, cfg.ckpt_every, cfg.decay_start) == (60, 1, 5, made.decay_start)
    printed = capsys.readouterr().out
    assert "settings changed: steps=60, micro_batch=1, ckpt_every=5\n" in printed
    assert f"the learning-rate decay still starts at step {made.decay_start} (--decay-start moves it)" in printed
    cfg = settings(["--out", str(tmp_path / "run"), "--resume", "--steps", "60", "--decay-start", "50"])
    assert cfg.decay_start == 50 and "decay still starts" not in capsys.readouterr().out


def test_resume_refuses_changes_to_what_the_run_trains(tmp_path):
    fake_run(tmp_path / "run", recipe="native", seq_len=256)
    config = tmp_path / "more.json"
    config.write_text(json.dumps({"lr": 1e-2}))
    with pytest.raises(ValueError, match=r"^--resume: the run in .*run was made with recipe='native' \(given "
                                         r"'text-only'\), seq_len=256 \(given 128\), lr=0.003 \(given 0.01\); a "
                                         r"resumed run keeps what it trains \(see its train_config.json\)"):
        settings(["--out", str(tmp_path / "run"), "--resume", "--config", str(config), "--recipe", "text-only",
                  "--seq-len", "128"])


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    (tmp_path / "typo").mkdir()
    for out in (tmp_path / "typo", tmp_path / "nowhere"):
        with pytest.raises(ValueError, match=f"^--resume: no complete checkpoint under {out / 'checkpoints'}"):
            settings(["--out", str(out), "--resume"])


def test_resume_reads_a_checkpoint_of_an_older_version(tmp_path):
    """A field the code no longer has is not read; one added since takes its default."""
    made = fake_run(tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "step_00000005" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    state["config"]["retired_setting"] = 1
    del state["config"]["print_every"]
    torch.save(state, path)
    assert settings(["--out", str(tmp_path / "run"), "--resume"]).to_dict() == made.to_dict()


@pytest.mark.parametrize("steps,warmup,decay", [(1, 0, 0), (5, 2, 4), (19, 9, 15), (20, 10, 16), (100, 10, 80)])
def test_a_short_run_gets_a_warmup_that_fits(steps, warmup, decay):
    cfg = TrainConfig(steps=steps)
    assert (cfg.warmup_steps, cfg.decay_start) == (warmup, decay)
    assert TrainConfig(steps=steps, warmup_steps=0).warmup_steps == 0


def test_flag_spellings_shared_with_generate_and_serve():
    cfg = settings(["--preset", "m3-small", "--param-dtype", "bf16"])
    assert (cfg.model, cfg.param_dtype) == ("m3-small", "bfloat16")
    assert settings(["--param-dtype", "fp32"]).param_dtype == "float32"


def test_config_file_mistakes_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"^--config: cannot read '.*missing.json' \(No such file"):
        settings(["--config", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("{steps: 3}")
    with pytest.raises(ValueError, match=r"^--config: '.*bad.json' is not valid JSON"):
        settings(["--config", str(tmp_path / "bad.json")])


def test_a_context_longer_than_the_model_fails_before_the_model_is_built(monkeypatch):
    built = []
    monkeypatch.setattr("openm3.train.trainer.Trainer.__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match=r"^seq_len=9000 is longer than the context of model 'm3-tiny' "
                                         r"\(max_position_embeddings=8192\)"):
        cli.main(["--seq-len", "9000", "--device", "cpu"])
    assert built == []


def test_layers_trains_the_preset_at_another_depth(tmp_path, monkeypatch):
    """`--layers N` (TrainConfig.layers): the preset's model at N decoder layers, its pattern kept; part of what a
    run trains (a resume refuses a change); refused with --init-from and below 1."""
    from openm3.train import factory

    cfg = settings(["--model", "m3-small", "--layers", "2", "--out", str(tmp_path / "run")])
    assert cfg.layers == 2
    built = []
    real = factory.model_builder
    monkeypatch.setattr(factory, "model_builder", lambda *a, **k: built.append(k) or real(*a, **k))
    monkeypatch.setattr("openm3.train.trainer.Trainer.__init__", lambda self, *a, **k: (_ for _ in ()).throw(
        RuntimeError("built")))
    with pytest.raises(RuntimeError, match="built"):
        cli.main(["--model", "m3-tiny", "--layers", "3", "--recipe", "text-only", "--out", str(tmp_path / "x"),
                  "--device", "cpu"])
    assert built == [{"num_hidden_layers": 3}]
    config = factory.model_builder("m3-small", type("T", (), {"vocab_size": 4096, "image_id": 1, "video_id": 2})(),
                                   num_hidden_layers=2).text_config
    assert config.layer_types == ["full_attention", "minimax_m3_sparse"] and config.hidden_size == 2048
    fake_run(tmp_path / "made", model="m3-small", layers=2)
    with pytest.raises(ValueError, match=r"layers=2 \(given 4\)"):
        settings(["--out", str(tmp_path / "made"), "--resume", "--layers", "4"])
    for bad, message in ((["--layers", "0"], "layers must be a positive int"),
                         (["--layers", "2", "--init-from", str(tmp_path)], "layers: only for a preset model")):
        with pytest.raises(ValueError, match=message):
            settings(bad + ["--out", str(tmp_path / "bad")])


def test_a_runs_train_config_json_derives_the_schedule_again_for_other_steps(tmp_path):
    """`train_config.json` leaves the warm-up and decay start it derived from `steps` as null, so `--config` with
    another `--steps` derives them again (it kept the old run's: a shorter run failed, a longer one decayed early);
    ones given explicitly stay."""
    made = TrainConfig(steps=20, out_dir=str(tmp_path / "run"))
    assert (made.warmup_steps, made.decay_start) == (10, 16)
    assert made.settings()["warmup_steps"] is None and made.settings()["decay_start"] is None
    assert made.to_dict()["decay_start"] == 16  # checkpoints keep the resolved values
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(made.settings()))
    shorter = settings(["--config", str(path), "--steps", "2", "--out", str(tmp_path / "a")])
    longer = settings(["--config", str(path), "--steps", "40", "--out", str(tmp_path / "b")])
    assert (shorter.warmup_steps, shorter.decay_start) == (1, 1) and (longer.warmup_steps, longer.decay_start) == (
        10, 32)
    pinned = TrainConfig(steps=20, decay_start=12)
    assert pinned.settings()["decay_start"] == 12 and pinned.settings()["warmup_steps"] is None


def test_a_new_run_in_a_folder_with_checkpoints_is_refused(tmp_path):
    """Without --resume, an --out holding a run's checkpoints fails before anything is built (a new run there
    pruned the old checkpoints' neighbours, its own included, and a later --resume found the old run's)."""
    fake_run(tmp_path / "run")
    with pytest.raises(ValueError, match=r"--out .*run holds another run's checkpoints \(latest: step_00000005\): "
                                         r"--resume continues that run; a new run needs another --out"):
        settings(["--out", str(tmp_path / "run"), "--steps", "3"])
    assert settings(["--out", str(tmp_path / "run"), "--resume"]).steps == 100


def test_threads_below_one_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"^--threads must be >= 1, got 0$"):
        cli.main(["--out", str(tmp_path / "run"), "--steps", "2", "--threads", "0"])
    assert not (tmp_path / "run").exists()


def test_the_full_m3_preset_takes_the_tokenizers_special_ids_and_is_measured_against_the_host(tmp_path, monkeypatch):
    """`--model m3` with the bundled tokenizer: the preset's bos / eos ids (the published tokenizer's, 200034 /
    200020) become this tokenizer's (they failed M3TextConfig's check before), and its ~428B parameters are refused
    by the memory check before anything is built (the kernel's out-of-memory killer ended it before)."""
    from openm3.train import factory, memory

    fake = type("T", (), {"vocab_size": 4096, "image_id": 1, "video_id": 2, "bos_id": 3, "eos_id": 4})()
    config = factory.model_builder("m3", fake, num_hidden_layers=4).text_config
    assert (config.bos_token_id, config.eos_token_id, config.vocab_size) == (3, 4, 4096)
    small = factory.model_builder("m3-small", fake).text_config  # presets without them keep None
    assert (small.bos_token_id, small.eos_token_id) == (None, None)
    monkeypatch.setattr(memory, "host_memory", lambda: 24 << 30)
    monkeypatch.setattr("openm3.train.trainer.Trainer.__init__", lambda self, *a, **k: (_ for _ in ()).throw(
        RuntimeError("built")))
    with pytest.raises(ValueError, match=r"on this host by the memory estimate .* the host has 24\.0 GiB"):
        cli.main(["--model", "m3", "--steps", "1", "--device", "cpu", "--out", str(tmp_path / "m3")])
