"""FP8 block-quantized checkpoints (the format of MiniMax's releases): dequantized on load, in both layouts, for
the text decoder and the vision tower, equal to what transformers 5.24.0 loads from the same files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_utils import build_hf_causal_lm, build_hf_vl_from_text, pack, random_ids, save_hf
from openm3.models import CheckpointError, load_pretrained, load_text_model
from openm3.models.fp8 import Fp8Scheme, scale_name

# The tensors MiniMax quantizes: attention projections and every MLP / expert matrix (not the router, the norms,
# the embeddings, lm_head, the indexer, or, in this first fixture, the vision tower).
TEXT_LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|experts\.\d+\.w[123]|shared_experts\.\w+_proj|mlp\.\w+_proj)"
                         r"\.weight$|mlp\.experts\.(gate_up|down)_proj$")
VISION_LINEAR = re.compile(r"vision_model\.encoder\.layers\.\d+\.(self_attn\.\w+_proj|mlp\.fc\d)\.weight$")


def quantize_checkpoint(src: Path, dst: Path, pattern: re.Pattern, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Copy checkpoint `src` to `dst` with the tensors matching `pattern` stored as fp8 (e4m3) with power-of-two
    float32 block scales (`X.weight_scale_inv` / `X_scale_inv` in the same shard) and an fp8 quantization_config.
    Returns {name: the weight its fp8 values and scales stand for, in float32}."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    files: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, []).append(name)
    scheme, meant = Fp8Scheme(block), {}
    for file, names in files.items():
        tensors = load_file(str(dst / file))
        for name in names:
            w = tensors[name]
            if not pattern.search(name):
                continue
            rows, cols = w.shape[-2:]
            grid = scheme.scale_shape(tuple(w.shape))
            padded = w.new_zeros(*w.shape[:-2], grid[-2] * block[0], grid[-1] * block[1])
            padded[..., :rows, :cols] = w
            amax = padded.unflatten(-1, (grid[-1], block[1])).unflatten(-3, (grid[-2], block[0]))
            amax = amax.abs().amax(dim=(-3, -1)).clamp_min(1e-12)
            scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0))).float()  # powers of two: exact in any dtype
            full = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
            q = (w / full).to(torch.float8_e4m3fn)
            tensors[name], tensors[scale_name(name)] = q, scale
            index["weight_map"][scale_name(name)] = file
            meant[name] = q.float() * full
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index, indent=2))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "ignored_layers": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return meant


@pytest.fixture(scope="module")
def hf_model():
    # every dim a multiple of the 8 x 8 blocks, as M3's are of 128 x 128 (transformers infers the block from the
    # scale grid, so it needs that)
    return build_hf_causal_lm(seed=21, shared_intermediate_size=16)


@pytest.fixture(scope="module")
def published(hf_model, tmp_path_factory):
    return save_hf(build_hf_vl_from_text(hf_model), tmp_path_factory.mktemp("fp8_published"))


@pytest.fixture(scope="module")
def fp8_published(published, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    return path, quantize_checkpoint(published, path, TEXT_LINEAR, (8, 8))


def _logits(model, seqs) -> torch.Tensor:
    ids, cu = pack(seqs)
    with torch.no_grad():
        return model(ids, cu_seqlens=cu).logits


def test_dequantize_blocks_of_any_shape():
    """Blocks that do not divide the weight (ragged last row / column of blocks), and stacked experts."""
    scheme = Fp8Scheme((4, 3))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 10, 7, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, 3, generator=g) + 0.5
    want = torch.empty(2, 10, 7)
    for e in range(2):
        for r in range(10):
            for c in range(7):
                want[e, r, c] = w[e, r, c].float() * scale[e, r // 4, c // 3]
    assert torch.equal(scheme.dequantize(w, scale), want)
    assert scheme.scale_shape((10, 7)) == (3, 3)
    with pytest.raises(ValueError, match=r"scale must be \[2, 3, 3\]"):
        scheme.dequantize(w, scale[:, :2])
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        scheme.dequantize(w.float(), scale)


def test_fp8_checkpoint_loads_as_transformers_loads_it(hf_model, published, fp8_published):
    """openm3 and transformers (which dequantizes on a CPU) read the same fp8 files to the same model: logits
    within fp32 rounding; openm3's weights are exactly the fp8 values times their scales; and the quantization
    shows (the logits moved away from the unquantized model's)."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    path, meant = fp8_published
    assert any(name.endswith(".w1.weight") for name in meant) and any("self_attn.q_proj" in n for n in meant)
    ours = load_text_model(path)
    theirs = MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    layer = ours.layers[1]
    assert torch.equal(layer.self_attn.q_proj.weight, meant["language_model.model.layers.1.self_attn.q_proj.weight"])
    w1 = meant["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    assert torch.equal(layer.mlp.experts.gate_up_proj[3][:w1.shape[0]], w1)
    seqs = random_ids([37, 60], hf_model.config.vocab_size, seed=3)
    got = _logits(ours, seqs)
    with torch.no_grad():
        want = torch.cat([theirs(input_ids=s[None]).logits[0] for s in seqs])
        plain = torch.cat([hf_model(s[None]).logits[0] for s in seqs])
    assert (got - want).abs().max().item() < 1e-5
    assert (got - plain).abs().max().item() > 1e-3
    reloaded = load_text_model(path, dtype=torch.bfloat16)  # config.json asks for nothing: the model's dtype rules
    assert reloaded.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_fp8_vision_tower_and_transformers_layout(hf_model, published, tmp_path):
    """Quantized vision weights load dequantized too, and so do transformers' own layout's stacked expert tensors
    (`mlp.experts.gate_up_proj` [E, 2I, H] with `mlp.experts.gate_up_proj_scale_inv`), in blocks that leave
    ragged edges (32 x 12 blocks over [48, 32] expert matrices)."""
    meant = quantize_checkpoint(published, tmp_path / "vis", VISION_LINEAR, (16, 16))
    assert len(meant) == 6  # q, k, v, out_proj, fc1, fc2 of the one vision block
    _edit_config(tmp_path / "vis", lambda c: c.update(image_token_index=95, video_token_index=96))  # tiny vocab
    model = load_pretrained(tmp_path / "vis")
    assert torch.equal(model.vision_tower.layers[0].mlp.fc1.weight,
                       meant["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"])

    hf_dir = save_hf(hf_model, tmp_path / "hf_layout")
    meant = quantize_checkpoint(hf_dir, tmp_path / "hf_fp8", TEXT_LINEAR, (32, 12))
    stacked = meant["model.layers.1.mlp.experts.gate_up_proj"]
    assert stacked.dim() == 3 and stacked.shape[1] % 32 and stacked.shape[2] % 12  # ragged blocks
    model = load_text_model(tmp_path / "hf_fp8")
    assert torch.equal(model.layers[1].mlp.experts.gate_up_proj, stacked)
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, meant["model.layers.0.self_attn.o_proj.weight"])


def test_saving_an_fp8_loaded_model_writes_plain_weights(fp8_published, tmp_path):
    path, _ = fp8_published
    model = load_text_model(path)
    out = tmp_path / "plain"
    model.save_pretrained(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    again = load_text_model(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.fixture
def damaged(fp8_published, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(fp8_published[0], path)
    return path


def _edit_tensors(path: Path, name: str, edit) -> None:
    file = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(path / file))
    edit(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def _edit_index(path: Path, edit) -> None:
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))


def _edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


Q = "language_model.model.layers.1.self_attn.q_proj.weight"


def _drop_scale(path):
    _edit_tensors(path, Q, lambda t: t.pop(scale_name(Q)))
    _edit_index(path, lambda m: m.pop(scale_name(Q)))


def _orphan_scale(path):
    def edit(t):
        t["language_model.model.layers.1.self_attn.ghost.weight_scale_inv"] = t[scale_name(Q)].clone()
    _edit_tensors(path, Q, edit)
    _edit_index(path, lambda m: m.update({"language_model.model.layers.1.self_attn.ghost.weight_scale_inv": m[Q]}))


@pytest.mark.parametrize("damage,match", [
    (_drop_scale, r"q_proj\.weight is float8_e4m3fn but .*q_proj\.weight_scale_inv is missing"),
    (_orphan_scale, r"scale tensors without their weight: .*ghost\.weight_scale_inv"),
    (lambda p: _edit_tensors(p, Q, lambda t: t.update({scale_name(Q): t[scale_name(Q)][:1]})),
     r"q_proj\.weight_scale_inv: shape \[1, 4\], expected \[8, 4\]"),
    (lambda p: _edit_tensors(p, Q, lambda t: t.update({Q: t[Q].float()})),
     r"q_proj\.weight_scale_inv scales .*q_proj\.weight, which is F32, not fp8"),
    (lambda p: _edit_tensors(p, Q, lambda t: t.update({Q: t[Q].float().to(torch.float8_e5m2)})),
     r"q_proj\.weight is F8_E5M2; openm3 reads float8_e4m3fn weights only"),
    (lambda p: _edit_config(p, lambda c: c.pop("quantization_config")),
     r"tensors of an fp8 checkpoint .* but config.json has no fp8 quantization_config"),
    (lambda p: _edit_config(p, lambda c: c["quantization_config"].update(scale_fmt="ue8m0")),
     r"scale_fmt 'ue8m0' is not supported"),
    (lambda p: _edit_config(p, lambda c: c["quantization_config"].update(fmt="e5m2")),
     r"fmt 'e5m2' is not supported"),
], ids=["missing-scale", "orphan-scale", "scale-shape", "scale-on-plain-weight", "e5m2", "no-config", "ue8m0",
        "fmt"])
def test_damaged_fp8_checkpoints_fail_clearly(damaged, damage, match):
    damage(damaged)
    with pytest.raises(CheckpointError, match=match):
        load_text_model(damaged)


def test_fp8_weights_need_the_quantization_config(published, tmp_path):
    """An fp8 weight in a checkpoint whose config.json declares no quantization (and has no scale tensors)."""
    path = tmp_path / "ckpt"
    shutil.copytree(published, path)
    _edit_tensors(path, Q, lambda t: t.update({Q: t[Q].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight is float8_e4m3fn but config.json has no fp8"):
        load_text_model(path)
    with safe_open(str(path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][Q]),
                   "pt") as f:
        assert f.get_slice(Q).get_dtype() == "F8_E4M3"
