"""`write_checkpoint` (atomic, shared by the text and VL saves) and `load_pretrained`'s text / VL dispatch.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_checkpoint_write.py
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from openm3.models import (CheckpointError, M3ForConditionalGeneration, M3TextConfig, M3TextModel, M3VLConfig,
                           load_pretrained, load_text_model, write_checkpoint)


def _tiny_text(vocab: int = 64) -> M3TextModel:
    torch.manual_seed(0)
    return M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=vocab, hidden_size=64, intermediate_size=32,
                                              shared_intermediate_size=32, dense_intermediate_size=64))


@pytest.fixture(scope="module")
def vl_model() -> M3ForConditionalGeneration:
    torch.manual_seed(1)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=60, video_token_index=61, vocab_size=64,
                                  hidden_size=64, intermediate_size=32, shared_intermediate_size=32,
                                  dense_intermediate_size=64)
    return M3ForConditionalGeneration(config).eval()


def _hidden_entries(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("shard", ["1KB", "20KB", "1GB"], ids=["shard-1KB", "shard-20KB", "shard-1GB"])
def test_write_checkpoint_shards_and_index(tmp_path, shard):
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(64, 100, generator=gen)
    tensors = [("a.weight", torch.randn(30, 20, generator=gen)), ("b.gate", fused[:32]), ("b.up", fused[32:]),
               ("c.bias", torch.randn(7, generator=gen).bfloat16())]
    out = write_checkpoint(tensors, {"model_type": "minimax_m3_vl_text", "x": [1, 2]}, tmp_path / "ck", shard)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == {"1KB": 4, "20KB": 2, "1GB": 1}[shard]  # a tensor larger than the limit: own shard
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors)
    written = {}
    for f in files:
        written.update(load_file(str(out / f)))
    assert written.keys() == dict(tensors).keys()
    for name, tensor in tensors:
        assert torch.equal(written[name], tensor), name
    assert json.loads((out / "config.json").read_text()) == {"model_type": "minimax_m3_vl_text", "x": [1, 2]}
    assert _hidden_entries(out) == []  # no temporary directory left behind


def test_overwrite_replaces_checkpoint_keeps_other_files(tmp_path):
    out = tmp_path / "ck"
    write_checkpoint([(f"t{i}", torch.full((256,), float(i))) for i in range(4)], {"v": 1}, out, "1KB")
    assert len(list(out.glob("model-*.safetensors"))) == 4
    (out / "tokenizer.json").write_text("{}")
    write_checkpoint([("t0", torch.full((8,), 5.0))], {"v": 2}, out, "1KB")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                      "model.safetensors.index.json", "tokenizer.json"]
    assert torch.equal(load_file(str(out / "model-00001-of-00001.safetensors"))["t0"], torch.full((8,), 5.0))
    assert _hidden_entries(out) == []


def record_syncs(monkeypatch) -> list[tuple]:
    """Events in order: ("sync", path) for each os.fsync (the path its descriptor names), ("rename", src, dst) for
    each os.rename / os.replace."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to name a descriptor's file")
    events, fsync, rename, replace = [], os.fsync, os.rename, os.replace

    def synced(fd):
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def renamed(real):
        def call(src, dst, **kw):
            events.append(("rename", str(src), str(dst)))
            return real(src, dst, **kw)
        return call

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "rename", renamed(rename))
    monkeypatch.setattr(os, "replace", renamed(replace))
    return events


def assert_published_synced(events: list[tuple], out) -> None:
    """Every file and folder now under `out` was flushed before the rename that made it `out`, and `out`'s parent
    after it (so the new name is on disk too)."""
    out = str(out)
    at = max(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == out)
    src = events[at][1]
    before = set()  # flushed before that rename, under the names they had then (a flushed file keeps its data
    for event in events[:at]:  # through a rename: write_text_atomic's temporary file)
        if event[0] == "sync":
            before.add(event[1])
        else:
            before |= {event[2] + p[len(event[1]):] for p in before if p == event[1] or p.startswith(event[1] + "/")}
    for folder, _, files in os.walk(out):
        for name in files + [""]:
            written = os.path.join(folder, name).rstrip("/").replace(out, src, 1)
            assert written in before, f"{written} was not flushed before its rename to {out}"
    assert ("sync", os.path.dirname(out)) in events[at + 1:], f"{out}'s parent was not flushed after the rename"


def test_a_checkpoint_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """Power loss: each shard, the index, the config and the kept tokenizer are fsynced, then the directory is
    renamed into place and the parent's names fsynced."""
    out = tmp_path / "ck"
    write_checkpoint([("t0", torch.ones(4))], {"v": 1}, out)
    (out / "tokenizer.json").write_text("{}")
    events = record_syncs(monkeypatch)
    write_checkpoint([(f"t{i}", torch.full((256,), float(i))) for i in range(3)], {"v": 2}, out, "1KB")
    assert len(list(out.glob("model-*.safetensors"))) == 3 and (out / "tokenizer.json").is_file()
    assert_published_synced(events, out)


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    out = tmp_path / "ck"
    write_checkpoint([("t0", torch.ones(4))], {"v": 1}, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def tensors():
        yield "t0", torch.zeros(4)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        write_checkpoint(tensors(), {"v": 2}, out)
    with pytest.raises(ValueError, match="appears twice"):
        write_checkpoint([("t0", torch.zeros(4)), ("t0", torch.zeros(4))], {"v": 2}, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _hidden_entries(out) == []


def test_a_write_cut_short_between_the_renames_is_named_and_cleaned_up(tmp_path, monkeypatch):
    """The swap keeps the other files in the new directory before it renames (a crash never exposes weights
    without their tokenizer); a crash between the two renames (the target absent, both copies hidden beside it)
    makes the loader's error name them, and the next write removes them."""
    import os

    from openm3.models import checkpoint as ck

    out = tmp_path / "ck"
    _tiny_text().save_pretrained(out)
    (out / "tokenizer.json").write_text("{}")
    seen = []
    real_rename = os.rename

    def rename(src, dst):  # what the new directory holds when it takes the target's name
        if str(dst) == str(out):
            seen.append(sorted(p.name for p in ck.Path(src).iterdir()))
        return real_rename(src, dst)

    monkeypatch.setattr(ck.os, "rename", rename)
    _tiny_text().save_pretrained(out)
    assert "tokenizer.json" in seen[-1] and (out / "tokenizer.json").read_text() == "{}"

    def killed(src, dst):  # the process dies once the old directory is out of the way
        if str(dst) == str(out):
            raise KeyboardInterrupt  # (not caught as an error: the restore below it is what a kill skips)
        return real_rename(src, dst)

    monkeypatch.setattr(ck.os, "rename", killed)
    monkeypatch.setattr(ck.shutil, "rmtree", lambda *a, **k: None)  # the kill skips the clean-up too
    with pytest.raises(KeyboardInterrupt):
        _tiny_text().save_pretrained(out)
    monkeypatch.undo()
    if out.exists():  # the swap's own restore ran (it catches BaseException): take it away as a kill would
        real_rename(out, tmp_path / f".ck.{'0' * 12}.old")
    left = ck.leftover_copies(out)
    assert left and all(p.name.endswith((".old", ".partial")) for p in left)
    with pytest.raises(CheckpointError, match=r"checkpoint directory not found \(a write to it was cut short; "
                                              r"beside it: \.ck\."):
        load_text_model(out)
    _tiny_text().save_pretrained(out)
    assert ck.leftover_copies(out) == [] and load_text_model(out) is not None


def test_write_checkpoint_bad_inputs(tmp_path):
    good = [("t", torch.zeros(2))]
    with pytest.raises(ValueError, match="named_tensors must hold at least one tensor"):
        write_checkpoint([], {}, tmp_path / "a")
    with pytest.raises(ValueError, match="named_tensors must yield"):
        write_checkpoint([("t", [1.0])], {}, tmp_path / "a")
    with pytest.raises(ValueError, match="config_dict must be a dict"):
        write_checkpoint(good, [("a", 1)], tmp_path / "a")
    with pytest.raises(ValueError, match="config_dict must be JSON-serialisable"):
        write_checkpoint(good, {"dtype": torch.float32}, tmp_path / "a")
    with pytest.raises(ValueError, match="max_shard_size must be"):
        write_checkpoint(good, {}, tmp_path / "a", "lots")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="path must be a directory"):
        write_checkpoint(good, {}, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_text_checkpoint_loads_as_text_model(tmp_path):
    model = _tiny_text()
    model.save_pretrained(tmp_path / "text", max_shard_size="50KB")
    loaded = load_pretrained(tmp_path / "text")
    assert type(loaded) is M3TextModel
    state = model.state_dict()
    assert all(torch.equal(t, state[n]) for n, t in loaded.state_dict().items())


def test_vl_checkpoint_dispatches_to_vl_model(vl_model, tmp_path):
    path = vl_model.save_pretrained(tmp_path / "vl", max_shard_size="50KB")
    assert json.loads((path / "config.json").read_text())["vision_config"]["hidden_size"] == 64
    loaded = load_pretrained(path)
    assert type(loaded) is M3ForConditionalGeneration and not loaded.training
    state = vl_model.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(t, state[n]) for n, t in loaded.state_dict().items())
    text = load_text_model(path, dtype=torch.bfloat16)
    assert type(text) is M3TextModel and next(text.parameters()).dtype == torch.bfloat16
    for name, tensor in text.state_dict().items():
        assert torch.equal(tensor, state["language_model." + name].bfloat16()), name


def test_vl_dispatch_errors(vl_model, tmp_path):
    path = vl_model.save_pretrained(tmp_path / "vl")
    config = json.loads((path / "config.json").read_text())
    config["image_token_index"] = 10_000  # outside the 64-token vocabulary
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported config: image_token_index"):
        load_pretrained(path)
    config["model_type"] = "llava"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llava'"):
        load_pretrained(path)
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_pretrained(tmp_path / "nowhere")
