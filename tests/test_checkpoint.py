"""Checkpoint I/O: both layouts load to the same model, save writes the published layout, failures are clear."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_utils import build_hf_causal_lm, build_hf_vl_from_text, pack, random_ids, save_hf
from openm3.cli import main
from openm3.models import (CheckpointError, M3TextConfig, M3TextModel, load_pretrained, load_text_model,
                           read_config)

LENGTHS = [45, 83]


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_causal_lm(seed=11)


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    """transformers' own layout (MiniMaxM3VLForCausalLM.save_pretrained), in several shards."""
    return save_hf(hf_model, tmp_path_factory.mktemp("hf_layout"))


@pytest.fixture(scope="module")
def published_dir(hf_model, tmp_path_factory):
    """The published layout, as transformers writes it for the VL model (vision tensors included)."""
    return save_hf(build_hf_vl_from_text(hf_model), tmp_path_factory.mktemp("published_layout"))


@pytest.fixture(scope="module")
def reference_logits(hf_model):
    seqs = random_ids(LENGTHS, hf_model.config.vocab_size, seed=5)
    with torch.no_grad():
        return seqs, [hf_model(s[None]).logits[0] for s in seqs]


def _logits(model: M3TextModel, seqs) -> list[torch.Tensor]:
    ids, cu = pack(seqs)
    with torch.no_grad():
        logits = model(ids, cu_seqlens=cu).logits
    return [logits[int(cu[b]):int(cu[b + 1])] for b in range(len(seqs))]


def _names(path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def test_published_layout_matches_transformers(published_dir, reference_logits):
    names = _names(published_dir)
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in names)
    assert any(n.startswith("vision_tower.") for n in names) and "language_model.lm_head.weight" in names
    model = load_text_model(published_dir)  # a VL checkpoint: its text decoder
    seqs, refs = reference_logits
    for ours, ref in zip(_logits(model, seqs), refs):
        assert (ours - ref).abs().max().item() < 1e-4


def test_both_layouts_load_identical_weights(hf_dir, published_dir):
    a = load_pretrained(hf_dir).state_dict()
    b = load_text_model(published_dir).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_save_writes_the_published_layout(hf_dir, published_dir, tmp_path, reference_logits):
    model = load_pretrained(hf_dir)
    out = tmp_path / "saved"
    model.save_pretrained(out, max_shard_size="100KB")
    ours = _names(out)
    assert len(set(ours.values())) > 1  # really sharded
    theirs = {n for n in _names(published_dir) if n.startswith("language_model.")}
    assert set(ours) == theirs
    for file in set(ours.values()):
        mine = load_file(str(out / file))
        for name, tensor in mine.items():
            hf_file = _names(published_dir)[name]
            with safe_open(str(published_dir / hf_file), framework="pt") as f:
                assert torch.equal(tensor, f.get_tensor(name)), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.state_dict().values())
    assert read_config(out) == model.config
    seqs, refs = reference_logits
    for got, ref in zip(_logits(load_pretrained(out), seqs), refs):
        assert (got - ref).abs().max().item() < 1e-4


def test_dtype_device_and_tied_embeddings(tmp_path):
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=64, tie_word_embeddings=True)
    model = M3TextModel(config)
    model.save_pretrained(tmp_path)
    assert not any("lm_head" in n for n in _names(tmp_path))
    loaded = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    torch.testing.assert_close(loaded.embed_tokens.weight.float(), model.embed_tokens.weight.bfloat16().float())
    assert load_pretrained(tmp_path).embed_tokens.weight.dtype == torch.float32  # config.json's dtype
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        load_pretrained(tmp_path, dtype=torch.int32)


def test_convert_command(hf_dir, tmp_path, capsys):
    import shutil

    from openm3.models.processor import VIDEO_PROCESSOR_CONFIG, save_video_processor_config, video_frames_per_clip

    out, src = tmp_path / "converted", shutil.copytree(hf_dir, tmp_path / "source")
    save_video_processor_config(src, 2)  # a release's video processor settings travel with its weights
    assert main(["convert", str(src), str(out), "--dtype", "bfloat16", "--max-shard-size", "50KB"]) == 0
    assert video_frames_per_clip(out) == 2 and (out / VIDEO_PROCESSOR_CONFIG).read_bytes() == \
        (src / VIDEO_PROCESSOR_CONFIG).read_bytes()
    assert "torch.bfloat16" in capsys.readouterr().out
    names = _names(out)
    assert all(n.startswith("language_model.") for n in names) and len(set(names.values())) > 2
    converted, source = load_pretrained(out), load_pretrained(hf_dir)
    assert next(converted.parameters()).dtype == torch.bfloat16
    for name, tensor in source.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor.bfloat16()), name
    assert main(["smoke", "--checkpoint", str(out), "--prompt", "hi"]) == 2  # vocab 97 cannot hold byte ids
    assert "vocab_size 97 < 256" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "elsewhere")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_convert_carries_the_files_the_weights_are_used_with(hf_dir, tmp_path, capsys, monkeypatch):
    """A tokenizer, chat template and generation config beside the weights are copied, into the directory that
    takes the target's name (a crash never leaves weights without them); a target holding files needs
    --overwrite, and the source itself is refused as the target."""
    from openm3.models import checkpoint as ck

    src = shutil.copytree(hf_dir, tmp_path / "source")
    side = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "chat_template.jinja": "{{ messages }}",
            "generation_config.json": '{"temperature": 0.7}'}
    for name, text in side.items():
        (src / name).write_text(text)
    out = tmp_path / "converted"
    placed = []
    real = ck.replace_directory
    monkeypatch.setattr(ck, "replace_directory", lambda tmp, dst, **kw: placed.append(
        (dst, sorted(p.name for p in tmp.iterdir()))) or real(tmp, dst, **kw))
    assert main(["convert", str(src), str(out)]) == 0
    assert placed[-1][0] == out and set(side) <= set(placed[-1][1]) and "config.json" in placed[-1][1]
    assert ck.leftover_copies(out) == []
    assert all((out / name).read_text() == text for name, text in side.items())
    assert "copied chat_template.jinja, generation_config.json, tokenizer.json, tokenizer_config.json" in \
        capsys.readouterr().out
    assert main(["convert", str(src), str(out)]) == 2
    assert f"target: {out} holds files already; pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(src), str(out), "--overwrite", "--dtype", "bf16"]) == 0  # generate's spelling too
    assert next(load_pretrained(out).parameters()).dtype == torch.bfloat16
    assert main(["convert", str(src), str(src), "--overwrite"]) == 2
    assert f"target: {src} is the source directory {src} itself" in capsys.readouterr().err


def test_cli_version(capsys):
    from openm3 import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"openm3 {__version__}"


# ------------------------------------------------------------------------------------------------ failures
@pytest.fixture
def broken(published_dir, tmp_path):
    """A writable copy of the published checkpoint to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(published_dir, path)
    return path


def _rewrite_shard(path, file, edit):
    tensors = load_file(str(path / file))
    edit(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def test_missing_shard(broken):
    victim = sorted(set(_names(broken).values()))[-1]
    (broken / victim).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard file.*{victim}"):
        load_text_model(broken)


def test_shape_mismatch(broken):
    config = json.loads((broken / "config.json").read_text())
    config["text_config"]["dense_intermediate_size"] = 48
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"shape mismatch .*layers\.[02]\.mlp\.(down|gate|up)_proj\.weight: "
                                              r"checkpoint \[\d+, \d+\] vs model \[\d+, \d+\]"):
        load_text_model(broken)


def test_unknown_tensor(broken):
    weight_map = _names(broken)
    file = weight_map["language_model.model.norm.weight"]
    _rewrite_shard(broken, file, lambda t: t.update({"language_model.model.layers.0.self_attn.bogus.weight":
                                                      torch.zeros(3)}))
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.0.self_attn.bogus.weight"] = file
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"unknown tensor names.*self_attn\.bogus\.weight"):
        load_text_model(broken)


def test_missing_tensor(broken):
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    file = index["weight_map"].pop(name)
    _rewrite_shard(broken, file, lambda t: t.pop(name))
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lacks tensors for: layers\.1\.mlp\.experts\.gate_up_proj"):
        load_text_model(broken)


def test_index_lists_a_tensor_its_shard_lacks(broken):
    name = "language_model.model.norm.weight"
    file = _names(broken)[name]
    _rewrite_shard(broken, file, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"tensors listed in the index are missing: language_model\.model\.norm"):
        load_text_model(broken)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(model_type="llama"), "unsupported model_type 'llama'"),
    (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}), "quant_method 'awq' is not supported"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "weight_block_size must be two positive ints"),
    (lambda c: c["text_config"].update(index_n_heads=1), "unsupported config.*index_n_heads"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
     "unsupported config.*rope_type='yarn'"),
], ids=["model-type", "quantized-awq", "fp8-no-blocks", "index-heads", "rope-type"])
def test_unsupported_config(broken, edit, match):
    config = json.loads((broken / "config.json").read_text())
    edit(config)
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_text_model(broken)


def test_missing_files(broken, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_text_model(tmp_path / "nowhere")
    (broken / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_text_model(broken)
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config.json there, so not a model checkpoint$"):
        load_text_model(broken)


def test_a_training_run_folder_is_named_as_one(tmp_path):
    """Pointing a loader (eval, serve, generate, convert) at an `openm3 train` run folder, its checkpoints folder
    or one of its sharded checkpoints says what it is and how to export the model from it."""
    from openm3.models import load_pretrained

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "LATEST").write_text(step.name)
    export = f"`openm3 train --out {run} --resume --export DIR` writes the run's latest model to DIR"
    for path, what in ((run, "folder"), (run / "checkpoints", "checkpoints folder"), (step, "sharded checkpoint")):
        with pytest.raises(CheckpointError, match=re.escape(f"{path}: no config.json there, so not a model "
                                                            f"checkpoint but a training run's {what}: {export}")):
            load_pretrained(path)
    (run / "model").mkdir()  # a run that exported into its folder (`openm3 demo`): that is the way
    (run / "model" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=re.escape(f"a training run's folder; its exported model is "
                                                        f"{run / 'model'}")):
        load_pretrained(run)


def test_large_loads_show_progress(published_dir, monkeypatch, capsys):
    """A load of at least `PROGRESS_BYTES` of weights draws a progress bar on stderr (a real M3 checkpoint loads for
    minutes); a small one prints nothing."""
    from openm3.models import checkpoint

    load_text_model(published_dir)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(checkpoint, "PROGRESS_BYTES", 0)
    load_text_model(published_dir)
    err = capsys.readouterr().err
    assert f"loading {published_dir.name}" in err and "100%" in err


def test_saved_files_follow_the_umask(hf_dir, tmp_path):
    """safetensors writes its files 0600; a saved checkpoint's shards are readable as its other files are (a
    checkpoint shared with another user or a container of another UID)."""
    import os
    import stat

    mask = os.umask(0o022)
    try:
        out = load_pretrained(hf_dir).save_pretrained(tmp_path / "saved", max_shard_size="50KB")
    finally:
        os.umask(mask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o644}, modes
