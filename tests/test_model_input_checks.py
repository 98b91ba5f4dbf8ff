"""Input checks of the models, their configs and loaders, and of what runs them (the Triton MSA kernels' block
sizes, `generate`'s integer arguments): what is refused names the argument or field and what was expected, before
any heavy work; what is legal but unusual (no tokens, the model's own state_dict names, short dtype names in
config.json, numpy integers) works."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from openm3.engine import SamplingParams, generate
from openm3.layers.moe import load_balancing_loss
from openm3.models import (CheckpointError, M3ForConditionalGeneration, M3TextConfig, M3TextModel, M3VisionConfig,
                           M3VLConfig, load_pretrained)
from openm3.models.text import residual_stream_dtype
from openm3.ops import msa
from openm3.ops.host import host_list

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the `model` and `vl` fixtures (tests/conftest.py): m3-tiny with TINY's overrides, IMG / VID as placeholder ids
TINY = dict(num_hidden_layers=2, vocab_size=64, max_position_embeddings=512)
IMG, VID = 5, 6


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    return model.save_pretrained(tmp_path_factory.mktemp("tiny"))


def _with_config(src, dst, changes):
    """A copy of checkpoint `src` at `dst` whose config.json has `changes` (a None value drops the key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---------------------------------------------------------------------------------------------- 1. dtypes

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.int32, "half",
                                   "float8_e4m3fn"], ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_loaders_refuse_non_parameter_dtypes(checkpoint, vl, tmp_path, dtype):
    with pytest.raises(ValueError, match=r"dtype must be .*got .*torch.bfloat16, torch.float16, torch.float32 or "
                                         r"torch.float64; fp8 checkpoints are dequantized"):
        load_pretrained(checkpoint, dtype=dtype)
    with pytest.raises(ValueError, match="dtype must be"):
        M3TextModel.from_pretrained(checkpoint, dtype=dtype)
    with pytest.raises(ValueError, match="dtype must be"):
        M3ForConditionalGeneration.from_pretrained(vl.save_pretrained(tmp_path / "vl"), dtype=dtype)


def test_float64_loads_and_runs(checkpoint, model):
    loaded = load_pretrained(checkpoint, dtype=torch.float64)
    assert loaded.dtype == torch.float64
    ids = torch.arange(20) % 64
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits.float(), model(ids).logits)


@pytest.mark.parametrize("key,name,want", [
    ("dtype", "bf16", torch.bfloat16), ("dtype", "bfloat16", torch.bfloat16),
    ("dtype", "torch.bfloat16", torch.bfloat16), ("dtype", "fp16", torch.float16), ("dtype", "half", torch.float16),
    ("dtype", "fp32", torch.float32), ("dtype", "float", torch.float32), ("dtype", "float64", torch.float64),
    ("torch_dtype", "bf16", torch.bfloat16), ("torch_dtype", "Float16", torch.float16),
])
def test_config_dtype_spellings(checkpoint, tmp_path, key, name, want):
    path = _with_config(checkpoint, tmp_path / "c", {"dtype": None, key: name})
    assert load_pretrained(path).dtype == want
    assert load_pretrained(path, dtype="float32").dtype == torch.float32  # the argument wins, config unread


@pytest.mark.parametrize("key,name", [("dtype", "bf17"), ("dtype", "int8"), ("torch_dtype", "float8_e4m3fn"),
                                      ("dtype", 16)])
def test_config_dtype_unknown_is_refused(checkpoint, tmp_path, key, name):
    path = _with_config(checkpoint, tmp_path / "c", {"dtype": None, key: name})
    with pytest.raises(CheckpointError, match=rf"config.json: {key}={name!r} is not a parameter dtype: expected one "
                                              rf"of \[.*'bf16'.*\] \(or pass dtype= to the loader\)"):
        load_pretrained(path)
    assert load_pretrained(path, dtype=torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- 2. no tokens

def test_empty_input_gives_empty_logits(model):
    ids = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        out = model(ids, return_block_idx=True, return_router_logits=True)
    assert out.logits.shape == (0, 64)
    assert [b.shape for b in out.block_idx if b is not None] == [(2, 0, model.config.index_topk_blocks)]
    assert all(r.shape == (0, model.config.num_local_experts) for r in out.router_logits)
    with torch.no_grad():
        out = model(ids, cu_seqlens=torch.tensor([0, 0, 0], dtype=torch.int32),
                    position_ids=torch.zeros(0, dtype=torch.long))
    assert out.logits.shape == (0, 64)


def test_empty_input_trains(model):
    model.train()
    try:
        for stage in ("sparse", "dense"):
            out = model(torch.zeros(0, dtype=torch.long), msa_stage=stage)
            assert out.logits.shape == (0, 64) and out.indexer_kl.item() == 0
            (out.logits.sum() + out.indexer_kl).backward()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)


def test_the_load_balancing_loss_of_no_tokens_is_zero(model):
    """Transformers' mean over no rows is NaN, which would poison a training step that met an empty batch."""
    logits = torch.zeros(0, 8, requires_grad=True)
    loss = load_balancing_loss([logits], 8, 2)
    loss.backward()
    assert loss.item() == 0 and logits.grad.shape == (0, 8)
    try:
        out = model(torch.zeros(0, dtype=torch.long), return_aux=True)
        assert out.aux_loss.item() == 0
        out.aux_loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert any(".gate." in name for name in grads) and all(bool(g.isfinite().all()) for g in grads.values())
    finally:
        model.zero_grad(set_to_none=True)


def test_an_empty_sequence_beside_others(model):
    ids = torch.arange(30) % 64
    with torch.no_grad():
        alone = model(ids).logits
        packed = model(ids, cu_seqlens=torch.tensor([0, 0, 30], dtype=torch.int32)).logits
    torch.testing.assert_close(packed, alone)


# ---------------------------------------------------------------------------------------------- 3. positions, embeds

@pytest.mark.parametrize("positions,match", [
    (torch.ones(20, dtype=torch.bool), r"position_ids must be an int tensor \[T=20\], got torch.bool"),
    (torch.arange(20.0), r"position_ids must be an int tensor \[T=20\], got torch.float32"),
    (list(range(20)), r"position_ids must be an int tensor \[T=20\], got list"),
    (torch.arange(20) - 5, r"position_ids must lie in \[0, max_position_embeddings=512\), got \[-5, 14\]"),
    (torch.arange(20) + 500, r"position_ids must lie in \[0, max_position_embeddings=512\), got \[500, 519\]"),
], ids=["bool", "float", "list", "negative", "beyond-max"])
def test_bad_position_ids(model, positions, match):
    with pytest.raises(ValueError, match=match):
        model(torch.arange(20), position_ids=positions)


def test_position_ids_up_to_the_last_position(model):
    with torch.no_grad():
        model(torch.arange(20), position_ids=(torch.arange(20) + 492).int())


def test_default_positions_past_the_last_position(model):
    """Explicit positions past max_position_embeddings were refused and the same positions by default were not
    (a 513-token sequence ran silently): both are refused now, the way to run it anyway said."""
    with torch.no_grad():
        model(torch.arange(1024) % 64, cu_seqlens=torch.tensor([0, 512, 1024], dtype=torch.int32))  # 2 x 512: fine
        with pytest.raises(ValueError, match=r"a sequence of 513 tokens \(cu_seqlens\) is longer than the model's "
                                             r"max_position_embeddings=512 .*raise config.max_position_embeddings"):
            model(torch.arange(1024) % 64, cu_seqlens=torch.tensor([0, 511, 1024], dtype=torch.int32))


def test_inputs_embeds_in_another_dtype(model):
    ids = torch.arange(20)
    embeds = model.embed_tokens(ids).detach()
    with pytest.raises(ValueError, match=r"inputs_embeds must have the model's dtype torch.float32 \(or run under "
                                         r"torch.autocast\), got torch.bfloat16"):
        model(inputs_embeds=embeds.bfloat16())
    with pytest.raises(ValueError, match=r"inputs_embeds must be a floating tensor \[T, hidden=128\], "
                                         r"got torch.int64 \(20, 128\)"):
        model(inputs_embeds=embeds.long())
    with torch.no_grad():
        want = model(inputs_embeds=embeds).logits
        torch.testing.assert_close(model(ids).logits, want)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller asks for the cast
            assert model(inputs_embeds=embeds.bfloat16()).logits.shape == want.shape
        with residual_stream_dtype(model, torch.float32):  # casts the embeddings itself
            torch.testing.assert_close(model(inputs_embeds=embeds.double()).logits, want)


# ---------------------------------------------------------------------------------------------- 4. meta tensors

def test_meta_inputs_are_named(model, vl):
    ids = torch.arange(20)
    cases = {
        "input_ids": lambda: model(ids.to("meta")),
        "inputs_embeds": lambda: model(inputs_embeds=torch.zeros(20, 128, device="meta")),
        "cu_seqlens": lambda: model(ids, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32, device="meta")),
        "position_ids": lambda: model(ids, position_ids=ids.to("meta")),
        "grid_thw": lambda: vl(torch.tensor([IMG] * 4), pixel_values=torch.zeros(16, 1176),
                               image_grid_thw=torch.tensor([[1, 4, 4]], device="meta")),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=rf"^{name} is a meta tensor \(torch\.\w+ \[[\d, ]+\]\), which holds no "
                                             r"values"):
            call()
    with pytest.raises(ValueError, match=r"^cu_seqlens is a meta tensor"):
        host_list(torch.zeros(2, dtype=torch.int32, device="meta"), "cu_seqlens")


def test_meta_cu_seqlens_of_the_msa_ops_are_named():
    q, k = torch.zeros(20, 4, 16), torch.zeros(20, 2, 16)
    qi, ki = torch.zeros(20, 2, 16), torch.zeros(20, 16)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    meta = cu.to("meta")
    block_idx = msa.select_blocks(qi, ki, cu, block_size=16, topk=2)
    calls = [("cu_seqlens", lambda: msa.select_blocks(qi, ki, meta, block_size=16, topk=2)),
             ("cu_seqlens", lambda: msa.indexer_kl(q, k, qi, ki, None, meta, block_size=16)),
             ("cu_seqlens_k", lambda: msa.sparse_attention(q, k, k, block_idx, cu, block_size=16, cu_seqlens_k=meta))]
    for name, call in calls:
        with pytest.raises(ValueError, match=rf"^{name} is a meta tensor \(torch.int32 \[2\]\), which holds no "
                                             r"values"):
            call()


def test_a_model_on_the_meta_device(model):
    with torch.device("meta"):
        empty = M3TextModel(model.config)
    with pytest.raises(ValueError, match="the model's parameters are on the meta device"):
        empty(torch.arange(20))


# ---------------------------------------------------------------------------------------------- 5. configs

def _ids(cases):
    return ["-".join(f"{k}={v}" for k, v in overrides.items()) for overrides, _ in cases]


TEXT_CONFIG_CASES = [
    (dict(eos_token_id="x"), r"eos_token_id must be None, a token id or a list of token ids \(ints in \[0, "
                             r"vocab_size=64\)\), got 'x'"),
    (dict(eos_token_id=64), r"eos_token_id .* got 64"),
    (dict(eos_token_id=[1, 64]), r"eos_token_id .* got \[1, 64\]"),
    (dict(eos_token_id=True), r"eos_token_id .* got True"),
    (dict(bos_token_id=1.0), r"bos_token_id must be None or a token id \(an int in \[0, vocab_size=64\)\), got 1.0"),
    (dict(pad_token_id=-3), r"pad_token_id must be None or a token id .* got -3"),
    (dict(pad_token_id=[1]), r"pad_token_id must be None or a token id .* got \[1\]"),
    (dict(rms_norm_eps=math.nan), r"rms_norm_eps must be a finite number > 0, got nan"),
    (dict(rms_norm_eps=0.0), r"rms_norm_eps must be a finite number > 0, got 0.0"),
    (dict(rope_theta=math.inf), r"rope_theta must be a finite number > 0, got inf"),
    (dict(rope_theta=-1.0), r"rope_theta must be a finite number > 0"),
    (dict(swiglu_limit=math.nan), r"swiglu_limit must be a finite number > 0"),
    (dict(initializer_range=-1.0), r"initializer_range must be a finite number >= 0, got -1.0"),
    (dict(router_aux_loss_coef=math.nan), r"router_aux_loss_coef must be a finite number >= 0"),
    (dict(num_hidden_layers=True), r"num_hidden_layers must be a positive int, got True"),
    (dict(rotary_dim=False), r"rotary_dim must be an even int"),
]


@pytest.mark.parametrize("overrides,match", TEXT_CONFIG_CASES, ids=_ids(TEXT_CONFIG_CASES))
def test_text_config_fields(overrides, match):
    with pytest.raises(ValueError, match=rf"M3TextConfig\.{match}"):
        M3TextConfig.from_name("m3-tiny", **{**TINY, **overrides})


def test_text_config_legal_values():
    for overrides in (dict(eos_token_id=[1, 2]), dict(eos_token_id=(63,)), dict(eos_token_id=None),
                      dict(bos_token_id=0, eos_token_id=63, pad_token_id=3), dict(initializer_range=0.0),
                      dict(rope_theta=10000)):
        M3TextConfig.from_name("m3-tiny", **{**TINY, **overrides})
    for name in ("m3", "m3-small", "m3-tiny"):
        M3TextConfig.from_name(name)
        M3VisionConfig.from_name(name)
    assert M3VLConfig.from_name("m3").text_config.eos_token_id == 200020


def test_from_dict_of_a_small_vocabulary_without_token_ids():
    """M3's default bos / eos ids do not fit a smaller vocabulary: a config.json that names none gets none; one that
    names them gets them, checked."""
    small = M3TextConfig.from_name("m3-tiny", **TINY).to_dict()
    del small["bos_token_id"], small["eos_token_id"]
    config = M3TextConfig.from_dict(small)
    assert (config.bos_token_id, config.eos_token_id) == (None, None)
    assert M3TextConfig.from_dict({**small, "eos_token_id": [3, 4]}).eos_token_id == [3, 4]
    with pytest.raises(ValueError, match="bos_token_id must be None or a token id"):
        M3TextConfig.from_dict({**small, "bos_token_id": 200034})
    assert M3TextConfig.from_dict({}).bos_token_id == 200034  # M3's vocabulary: M3's ids


VISION_CONFIG_CASES = [
    (dict(num_hidden_layers=True), r"num_hidden_layers: expected a positive int, got True"),
    (dict(image_size=0), r"image_size: expected a positive int, got 0"),
    (dict(layer_norm_eps=-1.0), r"layer_norm_eps: expected a finite number > 0, got -1.0"),
    (dict(layer_norm_eps=0.0), r"layer_norm_eps: expected a finite number > 0, got 0.0"),
    (dict(layer_norm_eps=math.nan), r"layer_norm_eps: expected a finite number > 0, got nan"),
    (dict(rope_theta=math.inf), r"rope_theta: expected a finite number > 0, got inf"),
    (dict(initializer_range=-0.1), r"initializer_range: expected a finite number >= 0, got -0.1"),
    (dict(attention_dropout=1.0), r"attention_dropout: expected a probability in \[0, 1\), got 1.0"),
    (dict(hidden_act=None), r"hidden_act: expected an activation name, got None"),
]


@pytest.mark.parametrize("overrides,match", VISION_CONFIG_CASES, ids=_ids(VISION_CONFIG_CASES))
def test_vision_config_fields(overrides, match):
    with pytest.raises(ValueError, match=match):
        M3VisionConfig.from_name("m3-tiny", **overrides)


def test_vision_config_from_dict_names_rope_theta():
    with pytest.raises(ValueError, match=r"rope_theta: expected a finite number > 0, got 'x'"):
        M3VisionConfig.from_dict({"rope_theta": "x"})
    assert M3VisionConfig.from_dict({"rope_parameters": {"rope_type": "axial", "rope_theta": 500}}).rope_theta == 500


def test_vl_config_token_ids_are_not_bools():
    text, vision = M3TextConfig.from_name("m3-tiny", **TINY), M3VisionConfig.from_name("m3-tiny")
    with pytest.raises(ValueError, match=r"image_token_index: expected a token id in \[0, vocab_size=64\), got True"):
        M3VLConfig(text, vision, image_token_index=True, video_token_index=VID)
    with pytest.raises(ValueError, match=r"projector_hidden_size: expected a positive int, got True"):
        M3VLConfig(text, vision, image_token_index=IMG, video_token_index=VID, projector_hidden_size=True)


# ---------------------------------------------------------------------------------------------- 6. own names

def _own_names_checkpoint(model, path):
    """config.json beside `save_file(model.state_dict())` (cloned: tied or fused weights share storage)."""
    model.save_pretrained(path / "published")
    (path / "own").mkdir()
    shutil.copy(path / "published" / "config.json", path / "own")
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "own" / "model.safetensors"))
    return path / "own"


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_models_own_state_dict_names_load(tmp_path, tied):
    torch.manual_seed(1)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", **TINY, tie_word_embeddings=tied))
    loaded = load_pretrained(_own_names_checkpoint(model, tmp_path))
    _same_state(model, loaded)
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied


def test_the_vl_models_own_state_dict_names_load(vl, tmp_path):
    _same_state(vl, load_pretrained(_own_names_checkpoint(vl, tmp_path)))


def test_own_and_published_names_of_one_weight(model, tmp_path):
    path = _own_names_checkpoint(model, tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = state["norm.weight"].clone()
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensors that fill the same weight twice: norm.weight"):
        load_pretrained(path)


def test_a_tied_checkpoint_that_still_holds_lm_head(tmp_path):
    """With tied embeddings a published checkpoint's lm_head copy is skipped (it used to be an unknown name)."""
    torch.manual_seed(2)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", **TINY, tie_word_embeddings=True))
    path = model.save_pretrained(tmp_path / "tied")
    save_file({"language_model.lm_head.weight": model.embed_tokens.weight.detach().clone()},
              str(path / "model-extra.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.lm_head.weight"] = "model-extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _same_state(model, load_pretrained(path))


# ---------------------------------------------------------------------------------------------- 7. pixel values

@pytest.mark.parametrize("kind", ["image", "video"])
def test_raw_pixels_are_refused_with_the_processor_to_use(vl, kind):
    """uint8 pixels ran through the tower unnormalised (wrong visual tokens, no error)."""
    name, token = {"image": ("pixel_values", IMG), "video": ("pixel_values_videos", VID)}[kind]
    raw = torch.randint(0, 256, (16, 1176), dtype=torch.uint8)
    inputs = {name: raw, f"{kind}_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=rf"^{name}: expected normalised pixels \(a floating tensor\), got "
                                         r"torch.uint8: raw images and videos go through openm3.models.M3Processor"):
        vl(torch.tensor([token] * 4), **inputs)
    with torch.no_grad():
        assert vl(torch.tensor([token] * 4), **{**inputs, name: raw.float() / 255}).logits.shape == (4, 64)


# ---------------------------------------------------------------------------------------------- 8. Triton block sizes

# Triton 3.6's interpreter converts 1-element arrays to loop bounds (NumPy deprecates it; NumPy >= 2.4 refuses).
_INTERPRETER_WARNING = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _with_block_size(block: int) -> M3TextModel:
    torch.manual_seed(0)
    return M3TextModel(M3TextConfig.from_name("m3-tiny", **{**TINY, "index_block_size": block})).eval()


@_INTERPRETER_WARNING
@pytest.mark.parametrize("block,allowed,kernel", [
    (8, "a multiple of 16", "sparse-attention kernels"),
    (24, "a multiple of 16 or a power of two below 16", "selection kernel"),
], ids=["bs8-power-of-two-below-16", "bs24"])
def test_the_triton_backend_refuses_index_block_sizes_it_cannot_tile(block, allowed, kernel):
    """The reference takes any block size; the Triton kernels used to accept these and fail inside Triton's compiler
    on a GPU (the CPU interpreter runs them: it takes tiles a GPU refuses)."""
    lm = _with_block_size(block)
    ids = torch.arange(40) % 64
    with torch.no_grad():
        assert lm(ids).logits.shape == (40, 64)  # the reference backend (CPU)
        with msa.use_backend("triton"), pytest.raises(
                ValueError, match=rf"^block_size={block} \(a model's index_block_size\) must be {allowed} for the "
                                  rf"Triton {kernel} \(a power of two >= 16 suits every Triton MSA kernel.*\); the "
                                  r"reference backend takes any block size"):
            lm(ids)


@_INTERPRETER_WARNING
def test_the_triton_decode_kernels_refuse_a_page_size_that_is_not_a_power_of_two():
    """The decode kernels tile a whole page: 48 is refused naming the block size and the reference backend; the
    engine then decodes such pages through the prefill ops (session 50), with the reference backend's tokens."""
    from openm3.ops.msa.triton_common import check_block_size

    lm = _with_block_size(48)  # a multiple of 16: prefill and training run on the Triton kernels
    with pytest.raises(ValueError, match=r"^block_size=48 \(a model's index_block_size\) must be a power of two "
                                         r">= 16 for the Triton decode kernels; the reference backend takes any"):
        check_block_size(48, "the Triton decode kernels", power_of_two=True)
    with msa.use_backend("triton"):
        with torch.no_grad():
            assert lm(torch.arange(40) % 64).logits.shape == (40, 64)
        (fast,), _ = generate(lm, [[1, 2, 3]], max_new_tokens=2)
    (result,), _ = generate(lm, [[1, 2, 3]], max_new_tokens=2)  # the reference backend
    assert len(result.tokens) == 2 and fast.tokens == result.tokens


# ---------------------------------------------------------------------------------------------- 9. numpy integers

def test_numpy_integers_are_taken_wherever_ints_are(model):
    """Prompts took numpy ints but max_new_tokens, seed, chunk_size, token_budget, logprobs and top_k refused them
    (or, for seed, failed later with a TypeError)."""
    def run(cast):
        seen = []
        results, _ = generate(model, [np.array([5, 6, 7])], max_new_tokens=cast(3), seed=cast(7),
                              chunk_size=cast(16), token_budget=cast(64), max_total_tokens=cast(64),
                              sampling=SamplingParams(temperature=1.0, top_k=cast(5)), stop_tokens=cast(63),
                              logprobs=cast(2), on_logprobs=lambda b, lp, top: seen.append(len(top)),
                              prompt_logprobs=cast(1), on_prompt_logprobs=lambda b, entries: seen.append(entries))
        return results[0].tokens, seen

    assert run(np.int64) == run(int)
    assert type(SamplingParams(top_k=np.int32(5)).top_k) is int
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 2.0"):
        generate(model, [[5, 6, 7]], max_new_tokens=2.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        SamplingParams(top_k=np.float64(5))


def test_numpy_numbers_in_the_batched_generator_and_sampling(model):
    """`BatchedGenerator` refused numpy ints (token_budget, max_batch, chunk_size, max_new_tokens, seed,
    logprobs, priority) and `SamplingParams` numpy float32 temperatures / top_p (np.float32 is no float)."""
    from openm3.engine import BatchedGenerator

    def run(cast, real):
        gen = BatchedGenerator(model, token_budget=cast(64), max_batch=cast(2), chunk_size=cast(16),
                               cuda_graphs=False, scheduling="priority")
        try:
            tokens, seen = [], []
            sampling = SamplingParams(temperature=real(0.5), top_p=real(0.75), top_k=cast(5))
            gen(np.array([5, 6, 7]), max_new_tokens=cast(3), seed=cast(7), sampling=sampling, priority=cast(1),
                logprobs=cast(2), on_logprobs=lambda lp, top: seen.append(len(top)), on_token=tokens.append)
            return tokens, seen
        finally:
            gen.close()

    assert run(np.int64, np.float32) == run(int, float)
    assert type(SamplingParams(temperature=np.float32(0.5)).temperature) is float
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=np.float32("nan"))
