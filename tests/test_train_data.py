"""The trainer on the real stack: openm3.data rows, the m3-tiny vision-language model, evaluation and analysis."""

import math

import numpy as np
import pytest
import torch

from openm3.analysis.attention import block_mask, dense_probs, indexer_recall
from openm3.train.batches import IGNORE, collate
from openm3.train.config import TrainConfig
from openm3.train.data import MixtureRows, check_data_extra, processor_layout
from openm3.train.eval import Evaluator
from openm3.train.factory import model_builder
from openm3.train.tasks import QASample, qa_samples, text_only_baseline
from openm3.train.trainer import Trainer

WEIGHTS = {"text:stdlib": 1.0, "text:bible_kjv": 1.0, "colour_qa": 1.0, "video_qa": 1.0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer():
    from openm3.data import get_tokenizer

    return get_tokenizer()


@pytest.fixture(scope="module")
def source(tokenizer):
    return MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56)


# ---- data ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "image", "video"])
def test_rows_are_deterministic_and_aligned(source, tokenizer, kind):
    a, b = source.rows(kind, 5, 2), source.rows(kind, 5, 2)
    other = source.rows(kind, 6, 2)
    for r, s in zip(a, b):
        assert torch.equal(r.input_ids, s.input_ids) and torch.equal(r.labels, s.labels)
        assert r.vision.keys() == s.vision.keys()
        for key in r.vision:
            assert torch.equal(r.vision[key], s.vision[key])
    assert not torch.equal(a[0].input_ids, other[0].input_ids)
    for r in a:
        assert r.input_ids.shape == (256,) and sum(r.doc_lens) == 256
        trained = (r.labels != IGNORE).nonzero()[:, 0]
        assert len(trained) > 0
        assert torch.equal(r.labels[trained], r.input_ids[trained + 1])  # labels are the next tokens
        placeholders = {tokenizer.image_id, tokenizer.video_id}
        assert not any(int(t) in placeholders for t in r.labels[trained])  # no loss on visual tokens
    if kind == "image":
        grid = a[0].vision["image_grid_thw"]
        assert int((a[0].input_ids == tokenizer.image_id).sum()) == int((grid.prod(1) // 4).sum())
    if kind == "video":
        grid = a[0].vision["video_grid_thw"]
        assert int((a[0].input_ids == tokenizer.video_id).sum()) == int((grid.prod(1) // 4).sum())


@pytest.mark.parametrize("kind", ["image", "video"])
def test_blind_rows_keep_the_text_and_drop_the_pixels(tokenizer, kind):
    """The experiments' control: the same examples as the default source, without pixels, placeholders or their
    markers; the trained tokens (the answers) are the same."""
    seeing = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56)
    blind = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56, control="blind")
    example, text = next(seeing.examples(kind, 3)), next(blind.examples(kind, 3))
    assert example.images or example.videos
    assert not text.images and not text.videos and text.source == example.source
    assert text.segments == [seg for seg in example.segments if seg.kind == "text"]
    media = {tokenizer.image_id, tokenizer.video_id, tokenizer.vision_start_id, tokenizer.vision_end_id}
    for row in blind.rows(kind, 3, 2):
        assert not row.vision and not any(int(t) in media for t in row.input_ids)
    assert blind.rows("text", 3, 1)[0].input_ids.equal(seeing.rows("text", 3, 1)[0].input_ids)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_mismatched_rows_keep_the_text_and_carry_other_pixels(tokenizer, kind):
    """The second control: every example keeps its segments (so its tokens and trained answers) but carries the
    pixels of the example before it of the same shape; the stream's first example only seeds the pool, so no
    example keeps its own pixels."""
    seeing = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56)
    other = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56, control="mismatched")
    own = _take(seeing.examples(kind, 3), 12)
    swapped = _take(other.examples(kind, 3), 4)
    pixels = (lambda ex: ex.images) if kind == "image" else (lambda ex: [v.frames for v in ex.videos])
    same = lambda a, b: len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))
    k = 0
    for ex in swapped:  # a subsequence of the same stream (the first of each shape only seeds the pool)
        k = next(i for i in range(k + 1, len(own)) if own[i].segments == ex.segments)
        assert ex.source == own[k].source and not same(pixels(ex), pixels(own[k]))
        assert any(same(pixels(ex), pixels(own[i])) for i in range(k))  # an earlier example's pixels
    for row in other.rows(kind, 3, 2):
        assert row.vision  # the visual tokens stay
    with pytest.raises(ValueError, match="control: expected None or one of"):
        MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, control="shuffled")


@pytest.mark.parametrize("kind", ["image", "video"])
def test_noise_rows_keep_the_text_and_carry_noise(tokenizer, kind):
    """The third control: the same examples, each image or video replaced by uniform noise of its shape."""
    seeing = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56)
    noisy = MixtureRows(tokenizer, 256, seed=0, weights=WEIGHTS, image_size=56, video_size=56, control="noise")
    pixels = (lambda ex: ex.images) if kind == "image" else (lambda ex: [v.frames for v in ex.videos])
    for own, noise in zip(_take(seeing.examples(kind, 3), 3), _take(noisy.examples(kind, 3), 3)):
        assert noise.segments == own.segments and [p.shape for p in pixels(noise)] == [p.shape for p in pixels(own)]
        for p in pixels(noise):  # uniform over 0..255, unlike the rendered scenes
            assert p.dtype == np.uint8 and abs(float(p.mean()) - 127.5) < 8 and p.std() > 65


def _take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def test_processor_layout_matches_processor():
    from openm3.models.processor import M3ImageProcessor

    for h, w in [(56, 56), (84, 112), (100, 60)]:
        _, grid = M3ImageProcessor()([np.zeros((h, w, 3), np.uint8)])
        assert processor_layout("image", (h, w, 3)) == [(0, int(grid.prod()) // 4)]


def test_missing_data_extra_fails_clearly(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a))
    with pytest.raises(ValueError, match="pillow"):
        check_data_extra()


def test_unknown_source_fails(tokenizer):
    with pytest.raises(ValueError, match="unknown sources"):
        MixtureRows(tokenizer, 128, weights={"text:stdlib": 1.0, "audio_qa": 1.0})


def test_recipe_without_sources_of_a_kind_fails(tokenizer):
    src = MixtureRows(tokenizer, 128, weights={"text:stdlib": 1.0})
    with pytest.raises(ValueError, match="no 'image' sources"):
        src.rows("image", 0, 1)


# ---- tasks ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["colour_qa", "video_qa"])
def test_qa_samples(task):
    samples = qa_samples(task, 6, seed=3)
    again = qa_samples(task, 6, seed=3)
    for s, t in zip(samples, again):
        assert s.answer in s.candidates and s.question == t.question and s.answer == t.answer
    media = samples[0].images or [v.frames for v in samples[0].videos]
    assert media and media[0].dtype == np.uint8


def test_text_only_baseline_is_the_per_question_majority():
    def s(q, a):
        return QASample("t", q, a, ("x", "y", "z"))

    train = [s("q1", "x"), s("q1", "x"), s("q1", "y"), s("q2", "z")]
    test = [s("q1", "x"), s("q1", "y"), s("q2", "z"), s("q3", "x")]
    # q1 -> x (right, wrong), q2 -> z (right), unseen q3 -> most frequent overall: x (right)
    assert text_only_baseline(train, test) == 0.75


# ---- analysis ------------------------------------------------------------------------------------------------
def test_indexer_recall_is_one_with_every_block_and_matches_brute_force():
    torch.manual_seed(0)
    t, bs = 40, 8
    q, k = torch.randn(t, 4, 16), torch.randn(t, 2, 16)
    cu = torch.tensor([0, t], dtype=torch.int32)
    n_blocks = math.ceil(t / bs)
    every = torch.full((2, t, n_blocks), -1, dtype=torch.int32)
    for i in range(t):
        every[:, i, : i // bs + 1] = torch.arange(i // bs + 1, dtype=torch.int32)
    s, n = indexer_recall(q, k, every, cu, bs)
    assert s / n == pytest.approx(1.0, abs=1e-5)
    own = torch.full((2, t, 2), -1, dtype=torch.int32)
    own[:, :, 0] = (torch.arange(t) // bs).int()
    s, n = indexer_recall(q, k, own, cu, bs)
    p = dense_probs(q, k)
    expected = sum(float(p[h, i, (i // bs) * bs: i + 1].sum()) for h in range(4) for i in range(t)) / (4 * t)
    assert s / n == pytest.approx(expected, rel=1e-5)
    assert block_mask(own, t, bs).shape == (2, t, t)


class UniformLM(torch.nn.Module):
    """Logits all zero: cross-entropy log(V) per token, so bits per byte are known exactly."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **_):
        from openm3.models.text import M3TextOutput

        return M3TextOutput(logits=torch.zeros(len(input_ids), self.vocab) * self.w)


def test_bits_per_byte_of_a_uniform_model(tokenizer):
    ev = Evaluator(tokenizer, seq_len=64, corpora=["stdlib", "bible_kjv"], windows=2, recall=False)
    got = ev.evaluate(UniformLM(tokenizer.vocab_size))
    for corpus in ("stdlib", "bible_kjv"):
        ws = [w for w in ev.windows if w.corpus == corpus]
        bits = sum(len(w.ids) - 1 for w in ws) * math.log2(tokenizer.vocab_size)
        assert got[f"bpb/{corpus}"] == pytest.approx(bits / sum(w.n_bytes for w in ws), rel=1e-6)


# ---- the real model ------------------------------------------------------------------------------------------
def real_cfg(tmp_path, name, **kw):
    base = dict(model="m3-tiny", recipe="native", steps=4, seq_len=256, text_rows=1, micro_batch=2,
                mixture={"text": 1.0, "image": 1.0, "video": 1.0}, warmup_steps=1, msa_switch_step=2,
                out_dir=str(tmp_path / name), progress=False, tensorboard=False, device="cpu")
    return TrainConfig(**(base | kw))


def test_real_model_trains_resumes_exactly_evaluates_and_exports(tmp_path, tokenizer, source):
    build = model_builder("m3-tiny", tokenizer)
    full = Trainer(real_cfg(tmp_path, "full"), build, source).fit()
    assert [r["msa_stage"] for r in full] == ["dense", "dense", "sparse", "sparse"]
    assert all(r["indexer_kl"] > 0 and r["aux_loss"] > 0 for r in full)

    cut = Trainer(real_cfg(tmp_path, "cut", ckpt_every=2), build, source)
    cut.fit(until=3)
    del cut
    resumed = Trainer(real_cfg(tmp_path, "cut", ckpt_every=2), build, source)
    assert resumed.resume() and resumed.step == 2
    rest = resumed.fit()
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[2:]]

    ev = Evaluator(tokenizer, seq_len=64, corpora=["stdlib"], windows=1, qa={"colour_qa": 2, "video_qa": 1},
                   baseline_samples=20)
    result = ev.evaluate(resumed.model)
    assert 0 < result["indexer_recall"] <= 1.0 + 1e-6 and result["bpb/stdlib"] > 0
    assert 0 <= result["colour_qa/accuracy"] <= 1 and "video_qa/text_only_baseline" in result

    from openm3.models.multimodal import load_pretrained

    from openm3.models.processor import VIDEO_PROCESSOR_CONFIG, video_frames_per_clip

    resumed.export(tmp_path / "export")
    assert (tmp_path / "export" / VIDEO_PROCESSOR_CONFIG).is_file()  # the clip length travels with the weights
    assert video_frames_per_clip(tmp_path / "export") == resumed.cfg.video_frames_per_clip == 4
    loaded = load_pretrained(tmp_path / "export")
    batch = collate(source.rows("image", 0, 1))
    with torch.no_grad():
        a = resumed.model.eval()(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, **batch.vision).logits
        b = loaded.eval()(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, **batch.vision).logits
    assert torch.equal(a, b)


# ---- openm3 train --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--recipe", "vision-first"], "recipe must be one of"),
    (["--steps", "20", "--warmup-steps", "10", "--decay-start", "5"], "decay_start"),
    (["--recipe", "mid", "--steps", "20", "--vision-start-step", "19"], "vision_start_step"),
], ids=["unknown-recipe", "decay-before-warmup", "mid-after-decay"])
def test_train_cli_bad_config_fails_before_compute(argv, message, monkeypatch):
    from openm3.train import cli

    called = []
    monkeypatch.setattr("openm3.data.get_tokenizer", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match=message):
        cli.main(argv)
    assert called == []


def test_train_cli_world_size_checked_before_compute(monkeypatch):
    from openm3.train import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    called = []
    monkeypatch.setattr("openm3.data.get_tokenizer", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match="not divisible by world_size=2"):
        cli.main(["--recipe", "text-only", "--text-rows", "3"])
    assert called == []


@pytest.mark.parametrize("recipe", ["text-only", "mid"])
def test_a_run_whose_vision_tower_has_no_optimizer_state_yet_resumes_exactly(tmp_path, tokenizer, source, recipe):
    """The vision-language model trained on text rows only (recipe text-only; mid before its vision starts): the
    vision tower gets no gradient, so its checkpoint holds no optimizer state for it; the resume loads the state
    the checkpoint holds (it asked for every parameter's and failed: no text-only run could resume) and goes on
    exactly as the run that was not cut, across the start of vision for `mid`."""
    build = model_builder("m3-tiny", tokenizer)
    kw = dict(recipe=recipe, steps=5, ckpt_every=2, **({"vision_start_step": 3} if recipe == "mid" else {}))
    full = Trainer(real_cfg(tmp_path, "full", **kw), build, source).fit()
    cut = Trainer(real_cfg(tmp_path, "cut", **kw), build, source)
    cut.fit(until=3)
    del cut
    resumed = Trainer(real_cfg(tmp_path, "cut", **kw), build, source)
    assert resumed.resume() and resumed.step == 2
    assert not any(resumed.optimizer.state.get(p) for n, p in resumed.model.named_parameters()
                   if n.startswith("vision_tower."))
    rest = resumed.fit()
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[2:]]
    assert [r["vision"] for r in full] == ([0] * 5 if recipe == "text-only" else [0, 0, 0, 1, 1])
    if recipe == "mid":  # an export over an earlier one swaps whole directories (it deleted the old one first)
        from openm3.models.checkpoint import leftover_copies

        out = tmp_path / "export"
        resumed.export(out, tokenizer)
        (out / "stale.txt").write_text("from the export before")
        resumed.export(out, tokenizer)
        assert (out / "tokenizer.json").is_file() and not (out / "stale.txt").exists()
        assert leftover_copies(out) == [] and not out.with_name("export.tmp").exists()


def test_train_cli_runs_and_resumes(tmp_path, tokenizer, capsys):
    import json

    from openm3.train import cli
    from openm3.train.config import TrainConfig
    from openm3.train.metrics import read_jsonl

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"extra": {"weights": WEIGHTS, "image_size": 56,
                                            "eval": {"windows": 1, "qa": {"colour_qa": 2}}},
                                  "mixture": {"text": 1.0, "image": 1.0, "video": 0.0}}))
    out = tmp_path / "run"
    base = ["--config", str(config), "--model", "m3-tiny", "--recipe", "native", "--seq-len", "256",
            "--text-rows", "1", "--warmup-steps", "1", "--out", str(out), "--no-progress", "--device", "cpu"]
    assert cli.main(base + ["--steps", "1", "--print-every", "1"]) == 0
    printed = capsys.readouterr().out
    assert "step 1/1: loss " in printed and "done: step 1/1, loss " in printed and "eval: bpb/stdlib " in printed
    made = TrainConfig.from_json(out / "train_config.json")  # the run's settings, which --config takes back
    assert (made.steps, made.seq_len, made.text_rows, made.print_every) == (1, 256, 1, 1)
    assert cli.main(["--out", str(out), "--resume", "--steps", "2", "--export", str(tmp_path / "model")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"resuming {out} from step_00000001 (step 1 of 2); settings changed: steps=2\n")
    assert "step 2/2: loss " in printed and f"exported to {tmp_path / 'model'}" in printed
    assert TrainConfig.from_json(out / "train_config.json").to_dict() == {**made.to_dict(), "steps": 2}
    assert cli.main(["--out", str(out), "--resume"]) == 0
    assert "done: the run was at step 2 of 2 already (--steps N trains it further)" in capsys.readouterr().out
    log = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in log if "loss" in r] == [0, 1]
    assert any("eval/bpb/stdlib" in r for r in log)
    assert (tmp_path / "model" / "config.json").is_file()
    from openm3.data.tokenizer import M3Tokenizer  # the export carries its tokenizer for generate / serve
    assert M3Tokenizer.from_file(tmp_path / "model").vocab_size == tokenizer.vocab_size


def test_train_starts_from_a_checkpoint(tmp_path, tokenizer, source, monkeypatch):
    """`init_from`: the run's model is the checkpoint's (its config and weights; here an earlier run's export,
    whose tokenizer.json then tokenizes the data) and training goes on from there, through the CLI too."""
    import json

    from openm3.train import cli
    from openm3.train.factory import checkpoint_builder, checkpoint_tokenizer
    from openm3.train.metrics import read_jsonl

    first = Trainer(real_cfg(tmp_path, "first", steps=2), model_builder("m3-tiny", tokenizer), source)
    first.fit()
    export = first.export(tmp_path / "export", tokenizer)
    saved = checkpoint_tokenizer(export)
    assert saved.vocab_size == tokenizer.vocab_size and saved.image_id == tokenizer.image_id
    from openm3.models import checkpoint as model_checkpoint

    loads = []
    real_load = model_checkpoint.load_pretrained
    monkeypatch.setattr(model_checkpoint, "load_pretrained", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    second = Trainer(real_cfg(tmp_path, "second", steps=2), checkpoint_builder(export, saved, multimodal=True), source)
    want = first.model.state_dict()
    got = second.model.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert all(p.dtype == torch.float32 for p in second.model.parameters()) and second.model.training
    # its export saves from the architecture alone: the checkpoint is not read a second time
    again = second.export(tmp_path / "again")
    assert loads == [export]
    monkeypatch.setattr(model_checkpoint, "load_pretrained", real_load)
    exported = real_load(again).state_dict()
    assert list(exported) == list(want) and all(torch.equal(exported[n], want[n]) for n in want)

    config = tmp_path / "run.json"
    config.write_text(json.dumps({"extra": {"weights": WEIGHTS, "image_size": 56, "eval": {"windows": 1, "qa": {}}},
                                  "mixture": {"text": 1.0, "image": 1.0, "video": 0.0}}))
    out = tmp_path / "cli"
    from openm3.train import factory
    built = []
    real = factory.checkpoint_builder
    monkeypatch.setattr(factory, "checkpoint_builder", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(factory, "model_builder", lambda *a, **k: pytest.fail("built a preset, not the checkpoint"))
    assert cli.main(["--config", str(config), "--init-from", str(export), "--recipe", "native", "--seq-len", "256",
                     "--text-rows", "1", "--warmup-steps", "1", "--steps", "1", "--out", str(out), "--no-progress",
                     "--device", "cpu"]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == [0]
    assert built == [str(export)]


def test_train_from_a_text_only_checkpoint_evaluates_without_questions(tmp_path, monkeypatch, tokenizer):
    """`--init-from` a text-only checkpoint: the run's evaluation asks no image / video questions (the model has
    no vision tower; it crashed at the last evaluation, with no checkpoint written, before session 47), and a
    config that asks for them fails before training."""
    import json

    from openm3.models import M3TextConfig, M3TextModel
    from openm3.train import cli
    from openm3.train.metrics import read_jsonl

    path = tmp_path / "ckpt"
    M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=tokenizer.vocab_size, num_hidden_layers=2)
                ).save_pretrained(path)
    monkeypatch.setattr("openm3.data.get_tokenizer", lambda *a, **k: tokenizer)
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"extra": {"eval": {"windows": 1}}}))
    argv = ["--init-from", str(path), "--recipe", "text-only", "--steps", "2", "--seq-len", "64", "--text-rows", "1",
            "--micro-batch", "1", "--no-progress", "--device", "cpu", "--config", str(config)]
    assert cli.main([*argv, "--out", str(tmp_path / "run")]) == 0
    evals = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]
    assert evals and not any("qa" in k for r in evals for k in r) and "eval/bpb/stdlib" in evals[-1]
    assert (tmp_path / "run" / "checkpoints").is_dir()
    config.write_text(json.dumps({"extra": {"eval": {"windows": 1, "qa": {"colour_qa": 4}}}}))
    with pytest.raises(ValueError, match="extra.eval.qa asks for .*colour_qa.* but the model is text-only"):
        cli.main([*argv, "--out", str(tmp_path / "asks")])


@pytest.mark.parametrize("case,message", [
    ("missing", "init_from: .*checkpoint directory not found"),
    ("text-only", "init_from: .* holds a text-only M3 model, but the recipe trains on images or videos"),
    ("small-vocab", "init_from: the tokenizer has 4096 tokens, more than the checkpoint's vocab_size=100"),
])
def test_train_init_from_a_checkpoint_that_does_not_fit_fails_before_training(case, message, tmp_path, monkeypatch,
                                                                               tokenizer):
    from openm3.models import M3TextConfig, M3TextModel
    from openm3.train import cli

    path = tmp_path / "ckpt"
    if case != "missing":
        vocab = 100 if case == "small-vocab" else tokenizer.vocab_size
        M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=vocab)).save_pretrained(path)
    monkeypatch.setattr("openm3.data.get_tokenizer", lambda *a, **k: tokenizer)
    trained = []
    monkeypatch.setattr("openm3.train.trainer.Trainer.fit", lambda self, *a, **k: trained.append(1))
    recipe = ["--recipe", "text-only"] if case == "small-vocab" else ["--recipe", "native"]
    with pytest.raises(ValueError, match=message):
        cli.main(["--init-from", str(path), "--steps", "2", "--warmup-steps", "1", "--out", str(tmp_path / "run"),
                  "--no-progress", "--device", "cpu", *recipe])
    assert trained == []


def test_vision_parameters_get_their_own_learning_rate(tmp_path, tokenizer, source):
    cfg = real_cfg(tmp_path, "lr", lr=1e-3, vision_lr_scale=0.1)
    trainer = Trainer(cfg, model_builder("m3-tiny", tokenizer), source)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        params = [names[id(p)] for p in group["params"]]
        vision = {n.startswith(("vision_tower.", "multi_modal_projector.")) for n in params}
        assert len(vision) == 1
        assert group["lr"] == pytest.approx((1e-4 if vision.pop() else 1e-3) * trainer.plan.lr_multiplier(0))
    with pytest.raises(ValueError, match="vision_lr_scale"):
        real_cfg(tmp_path, "bad", vision_lr_scale=0.0)
