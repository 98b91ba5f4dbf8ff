"""`openm3 eval`: a tiny checkpoint's table and JSON equal `Evaluator.evaluate` run directly; bad arguments fail
before any compute, naming the argument (exit code 2 through `openm3 eval`)."""

import json

import pytest
import torch

import openm3.models
import openm3.train.eval
from openm3.cli import main as cli_main
from openm3.data import get_tokenizer
from openm3.eval_cli import main
from openm3.train.eval import BASELINE_SAMPLES
from openm3.train.factory import model_builder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMALL = ["--seq-len", "128", "--windows", "1"]


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer()


@pytest.fixture(scope="module")
def vl_checkpoint(tokenizer, tmp_path_factory):
    """A random m3-tiny vision-language model saved with its tokenizer (as `openm3 train --export` writes it)."""
    path = tmp_path_factory.mktemp("vl")
    torch.manual_seed(0)
    model_builder("m3-tiny", tokenizer)().save_pretrained(path)
    tokenizer.save(path)
    return path


@pytest.fixture(scope="module")
def text_checkpoint(tokenizer, tmp_path_factory):
    """A random m3-tiny text-only model without a tokenizer.json (the bundled one is used)."""
    path = tmp_path_factory.mktemp("text")
    torch.manual_seed(1)
    model_builder("m3-tiny", tokenizer, multimodal=False)().save_pretrained(path)
    return path


def test_vl_checkpoint_results_equal_the_evaluator(vl_checkpoint, tokenizer, tmp_path, capsys):
    out = tmp_path / "res" / "eval.json"
    argv = ["--checkpoint", str(vl_checkpoint), *SMALL, "--corpora", "stdlib", "topics", "--image-qa", "3",
            "--video-qa", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [p.name for p in out.parent.iterdir()] == ["eval.json"]  # no temporary file left behind
    r = data["results"]
    assert {k for k in r if k.startswith("bpb/")} == {"bpb/stdlib", "bpb/topics"}
    for task in ("colour_qa", "video_qa"):
        assert 0.0 <= r[f"{task}/accuracy"] <= 1.0 and 0.0 <= r[f"{task}/text_only_baseline"] <= 1.0
    layers = [k for k in r if k.startswith("indexer_recall/layer")]
    assert layers and 0.0 < r["indexer_recall"] <= 1.0 + 1e-6
    assert data["vision_language"] and data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["tokenizer"] == str(vl_checkpoint / "tokenizer.json")
    assert data["settings"]["qa"] == {"colour_qa": 3, "video_qa": 2} and data["settings"]["seq_len"] == 128
    assert data["torch"] == torch.__version__ and data["date"] and data["parameters"] > 0

    model = openm3.models.load_pretrained(vl_checkpoint, dtype=torch.float32, device="cpu")
    direct = openm3.train.eval.Evaluator(tokenizer, seq_len=128, corpora=["stdlib", "topics"], windows=1,
                                         qa={"colour_qa": 3, "video_qa": 2}, image_size=84, video_size=56,
                                         baseline_samples=BASELINE_SAMPLES).evaluate(model)
    assert r == direct  # every number, exactly (JSON keeps a float's repr)
    assert f"{r['bpb/stdlib']:7.4f}" in printed and f"{r['indexer_recall']:.3f}" in printed
    assert "colour_qa" in printed and "video_qa" in printed and "text-only" in printed
    kinds = [k for k in r if k.startswith("video_qa/") and k.count("/") == 2]
    assert kinds and all(f"    {k.split('/')[1]:<12}{r[k]:5.3f}" in printed for k in kinds)  # each kind's line


def test_text_checkpoint_scores_text_and_refuses_qa(text_checkpoint, tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval.json"
    assert main(["--checkpoint", str(text_checkpoint), *SMALL, "--corpora", "topics", "--no-recall",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"bpb/topics"}  # no QA by default, no recall with --no-recall
    assert data["settings"]["qa"] == {"colour_qa": 0, "video_qa": 0} and not data["vision_language"]
    assert data["tokenizer"].startswith("bundled")
    assert "text-only" in capsys.readouterr().out

    def no_compute(*args, **kwargs):
        raise AssertionError("computed before the arguments were checked")

    monkeypatch.setattr(openm3.models, "load_pretrained", no_compute)
    monkeypatch.setattr(openm3.train.eval, "Evaluator", no_compute)
    with pytest.raises(ValueError, match="--image-qa 5: .* text-only checkpoint"):
        main(["--checkpoint", str(text_checkpoint), *SMALL, "--image-qa", "5"])
    with pytest.raises(ValueError, match="--video-qa 1: .* text-only checkpoint"):
        main(["--checkpoint", str(text_checkpoint), *SMALL, "--video-qa", "1"])


@pytest.mark.parametrize("extra, named", [
    (["--corpora", "stdlib", "wikipedia"], "--corpora: unknown corpus 'wikipedia'"),
    (["--seq-len", "0"], "--seq-len must be > 0"),
    (["--windows", "-1"], "--windows must be > 0"),
    (["--image-qa", "-2"], "--image-qa must be >= 0"),
    (["--seq-len", "100000000"], "--seq-len 100000000 exceeds the model's max_position_embeddings"),
    (["--tokenizer", "no/such/dir"], "--tokenizer: 'no/such/dir' is neither"),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
], ids=["corpus", "seq-len", "windows", "image-qa", "seq-len-too-long", "tokenizer", "cuda"])
def test_bad_arguments_exit_2_naming_them(vl_checkpoint, extra, named, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["eval", "--checkpoint", str(vl_checkpoint), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("openm3 eval: error: ") and named in err


def test_missing_checkpoint_and_larger_tokenizer_exit_2(tokenizer, tmp_path, capsys):
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "--checkpoint: directory" in capsys.readouterr().err

    small = tmp_path / "small_vocab"  # a model with fewer tokens than the bundled tokenizer
    model_builder("m3-tiny", tokenizer, multimodal=False, vocab_size=1024)().save_pretrained(small)
    assert cli_main(["eval", "--checkpoint", str(small), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer: {tokenizer.vocab_size} tokens, more than the checkpoint's vocab_size=1024" in err
