"""openm3 as a library, with transformers habits: what a user's first calls do. A flat prompt or a model still in
training mode is refused with what to do; batched [1, T] input_ids name the packed layout; models have `.dtype` and
`.device`; loaders take torch's dtype names; one stop token may be an int; presets take another depth; every
`save_pretrained` returns its Path; the processor's `VisionBatch` feeds the model and `generate`."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import openm3.models
from openm3.data.tokenizer import M3Tokenizer
from openm3.engine import BatchedGenerator, for_inference, generate
from openm3.models import (M3ForConditionalGeneration, M3Processor, M3TextConfig, M3TextModel, M3VLConfig,
                           load_pretrained)
from openm3.models.processor import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN, VisionBatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the `model` and `vl` fixtures (tests/conftest.py): m3-tiny with TINY's overrides, IMG / VID as placeholder ids
IMG, VID, START, END = 5, 6, 7, 8
TINY = dict(num_hidden_layers=2, index_topk_blocks=2, max_position_embeddings=512)


# ---------------------------------------------------------------------------------------------- 1. prompts

@pytest.mark.parametrize("prompts,got", [([5, 6, 7], "a flat list of ints"), (torch.tensor([5, 6, 7]), "a 1-D tensor"),
                                         (np.array([5, 6, 7]), "a flat list of ints")],
                         ids=["list", "tensor", "numpy"])
def test_a_flat_prompt_is_refused_and_wrapping_it_runs_one_prompt(model, prompts, got):
    with pytest.raises(ValueError, match=re.escape(f"prompts: expected a list of prompts, each a list / 1-D tensor "
                                                   f"of token ids; got {got}: wrap it as [ids]")):
        generate(model, prompts, max_new_tokens=2)
    results, stats = generate(model, [prompts], max_new_tokens=2)
    assert len(results) == 1 and results[0].prompt_len == 3 and len(results[0].tokens) == 2
    assert stats.prompt_tokens == 3


def test_prompts_of_text_or_floats_are_refused_and_a_2d_tensor_is_a_batch(model):
    with pytest.raises(ValueError, match="prompts: .*got text: tokenize it first"):
        generate(model, "hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1: expected token ids, got text"):
        generate(model, [[1, 2], "hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0: expected a list / 1-D tensor of int token ids, got torch.float32"):
        generate(model, [[1.5, 2.0]], max_new_tokens=2)
    rows, _ = generate(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=2)
    lists, _ = generate(model, [[5, 6, 7], [8, 9, 10]], max_new_tokens=2)
    assert [r.tokens for r in rows] == [r.tokens for r in lists] and len(rows) == 2


# ---------------------------------------------------------------------------------------------- 2. training mode

def test_a_model_in_training_mode_is_refused_before_any_work():
    torch.manual_seed(0)
    fresh = M3TextModel(M3TextConfig.from_name("m3-tiny", **TINY))  # nn.Modules start in training mode
    calls = []
    with pytest.raises(ValueError, match=re.escape("model is in training mode: call model.eval() (or "
                                                   "openm3.engine.for_inference(model))")):
        generate(fresh, [[1, 2, 3]], max_new_tokens=2, on_prefill=calls.append)
    assert fresh.training and calls == []  # left as it was, nothing prefilled
    results, _ = generate(for_inference(fresh), [[1, 2, 3]], max_new_tokens=2)
    assert len(results[0].tokens) == 2


def test_a_vl_model_whose_decoder_is_training_is_refused(vl):
    vl.language_model.train()
    try:
        with pytest.raises(ValueError, match="model is in training mode: .* M3ForConditionalGeneration"):
            generate(vl, [[1, 2, 3]], max_new_tokens=2)
    finally:
        vl.eval()


def test_batched_generator_and_a_cached_forward_name_training_mode():
    torch.manual_seed(0)
    fresh = M3TextModel(M3TextConfig.from_name("m3-tiny", **TINY))
    with pytest.raises(ValueError, match="model is in training mode"):
        BatchedGenerator(fresh, token_budget=64, cuda_graphs=False)
    with pytest.raises(ValueError, match=r"cache: the model is in training mode .*call model\.eval\(\)"):
        fresh(torch.tensor([1, 2]), position_ids=torch.arange(2), cache=object())


# ---------------------------------------------------------------------------------------------- 3. inputs, dtype

def test_batched_input_ids_name_the_packed_layout(model):
    ids = torch.randint(0, 4096, (40,))
    with pytest.raises(ValueError, match=re.escape("input_ids must be an int tensor [T] of one dimension (a batch's "
                                                   "sequences packed end to end, their boundaries in cu_seqlens), got "
                                                   "shape (1, 40)")):
        model(ids[None])
    with pytest.raises(ValueError, match="input_ids must hold integer token ids, got dtype torch.float32"):
        model(ids.float())
    with torch.no_grad():  # the hint the message gives for B rows of one length
        rows = torch.stack([ids, ids.flip(0)])
        packed = model(rows.flatten(), cu_seqlens=torch.arange(3, dtype=torch.int32) * 40).logits
        torch.testing.assert_close(packed[:40], model(ids).logits)


def test_models_have_dtype_and_device(vl):
    torch.manual_seed(0)
    text = M3TextModel(M3TextConfig.from_name("m3-tiny", **TINY)).to(torch.bfloat16)
    assert text.dtype == torch.bfloat16 and text.device == torch.device("cpu")
    assert vl.dtype == torch.float32 and vl.device == torch.device("cpu")


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", vocab_size=64, **TINY)).to(torch.float16)
    return model.save_pretrained(tmp_path_factory.mktemp("fp16"))


@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                        ("torch.float16", torch.float16), ("auto", torch.float16),
                                        (None, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_loaders_take_torch_dtype_names(fp16_checkpoint, dtype, want):
    assert load_pretrained(fp16_checkpoint, dtype=dtype).dtype == want  # auto, None: config.json's float16
    assert M3TextModel.from_pretrained(fp16_checkpoint, dtype=dtype).dtype == want


@pytest.mark.parametrize("dtype", ["int8", "bf16x", torch.int32, 3])
def test_loaders_refuse_other_dtypes(fp16_checkpoint, dtype):
    with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype, one of \['auto', 'bfloat16', "
                                         r"'float16', 'float32'\] or None, got"):
        load_pretrained(fp16_checkpoint, dtype=dtype)


def test_the_vl_loader_takes_dtype_names(vl, tmp_path):
    path = vl.save_pretrained(tmp_path / "vl")
    loaded = M3ForConditionalGeneration.from_pretrained(path, dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16 and next(loaded.vision_tower.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        openm3.models.multimodal.load_pretrained(path, dtype="half")


# ---------------------------------------------------------------------------------------------- 4. stop tokens

def test_one_stop_token_may_be_an_int(model):
    (plain,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4)
    first = plain.tokens[0]
    (as_int,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4, stop_tokens=first)
    (as_list,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4, stop_tokens=[first])
    (as_tensor,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4, stop_tokens=torch.tensor([first]))
    assert as_int.tokens == as_list.tokens == as_tensor.tokens == [first] and as_int.finish_reason == "stop"
    (none,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4, stop_tokens=None)
    assert none.tokens == plain.tokens


def test_batched_generator_takes_one_stop_token_as_an_int(model):
    (plain,), _ = generate(model, [[5, 17, 300]], max_new_tokens=4)
    gen = BatchedGenerator(model, token_budget=64, cuda_graphs=False)
    try:
        tokens = []
        finish = gen([5, 17, 300], max_new_tokens=4, stop_tokens=plain.tokens[0], on_token=tokens.append)
    finally:
        gen.close()
    assert tokens == [plain.tokens[0]] and finish == "stop"


@pytest.mark.parametrize("stop", ["5", 2.0, [1, "2"], object()], ids=["str", "float", "mixed", "object"])
def test_stop_tokens_of_other_types_are_refused(model, stop):
    with pytest.raises(ValueError, match="stop_tokens: expected a token id or a sequence of token ids"):
        generate(model, [[5, 17, 300]], max_new_tokens=4, stop_tokens=stop)


@pytest.mark.parametrize("kw,message", [
    ({"sampling": {"temperature": 0.7}}, "sampling must be an openm3.engine.SamplingParams"),
    ({"sampling": None}, "sampling must be an openm3.engine.SamplingParams"),
    ({"seed": None}, "seed must be an int"), ({"seed": 2**64}, "seed must be an int"),
    ({"on_token": 5}, "on_token must be callable or None"),
    ({"cuda_graphs": True}, "cuda_graphs=True needs a model on a CUDA device"),
], ids=["dict", "none", "seed-none", "seed-big", "on-token", "graphs-on-cpu"])
def test_generate_refuses_bad_arguments_before_any_work(model, monkeypatch, kw, message):
    import importlib

    monkeypatch.setattr(importlib.import_module("openm3.engine.generate"), "PagedCache", lambda *a, **k: pytest.fail("a cache was made"))
    with pytest.raises(ValueError, match=message):
        generate(model, [[5, 17, 300]], max_new_tokens=2, **kw)


def test_one_callers_bad_sampling_fails_only_its_own_call(model):
    """A dict as `sampling` reached the worker and ended every request decoding beside it with an AttributeError."""
    gen = BatchedGenerator(model, token_budget=256, cuda_graphs=False)
    try:
        with pytest.raises(ValueError, match=r"sampling must be an openm3.engine.SamplingParams\(.*\), got dict"):
            gen([5, 17, 300], max_new_tokens=4, sampling={"temperature": 0.7})
        tokens = []
        assert gen([5, 17, 300], max_new_tokens=4, on_token=tokens.append) == "length" and len(tokens) == 4
    finally:
        gen.close()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_a_temperature_that_is_not_finite_is_refused(temperature):
    from openm3.engine import SamplingParams

    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature)


# ---------------------------------------------------------------------------------------------- 5. presets

@pytest.mark.parametrize("name,layers,dense", [("m3-tiny", 2, 1), ("m3-tiny", 7, 1), ("m3-small", 3, 1),
                                               ("m3", 5, 3), ("m3", 2, 2)])
def test_a_preset_at_another_depth_keeps_its_layer_pattern(name, layers, dense):
    config = M3TextConfig.from_name(name, num_hidden_layers=layers)
    assert config.num_hidden_layers == layers
    assert config.layer_types == ["full_attention"] * dense + ["minimax_m3_sparse"] * (layers - dense)
    assert config.mlp_layer_types == ["dense"] * dense + ["sparse"] * (layers - dense)


def test_depth_overrides_keep_explicit_layer_types_and_reach_the_vl_config():
    config = M3TextConfig.from_name("m3-tiny", num_hidden_layers=3, layer_types=["full_attention"] * 3)
    assert config.layer_types == ["full_attention"] * 3 and config.mlp_layer_types == ["dense", "sparse", "sparse"]
    vl = M3VLConfig.from_name("m3-tiny", image_token_index=IMG, video_token_index=VID, num_hidden_layers=2)
    assert vl.text_config.layer_types == ["full_attention", "minimax_m3_sparse"]
    assert len(M3TextModel(M3TextConfig.from_name("m3-tiny", num_hidden_layers=2)).layers) == 2
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive int, got 0"):
        M3TextConfig.from_name("m3-tiny", num_hidden_layers=0)


# ---------------------------------------------------------------------------------------------- 6. save_pretrained

def test_every_save_pretrained_returns_its_path(model, vl, tmp_path):
    assert model.save_pretrained(str(tmp_path / "a")) == tmp_path / "a"
    assert openm3.models.save_pretrained(model, tmp_path / "b") == tmp_path / "b"
    out = vl.save_pretrained(tmp_path / "c")
    assert isinstance(out, Path) and out == tmp_path / "c" and (out / "config.json").is_file()


# ---------------------------------------------------------------------------------------------- 7. the processor

_MARKERS = {IMAGE_TOKEN: IMG, VIDEO_TOKEN: VID, VISION_START_TOKEN: START, VISION_END_TOKEN: END}


def _encode(text: str) -> list[int]:
    """A stand-in tokenizer: the four vision markers are their special ids, every other character one token."""
    parts = re.split("(" + "|".join(map(re.escape, _MARKERS)) + ")", text)
    return [i for p in parts for i in ([_MARKERS[p]] if p in _MARKERS else [10 + ord(c) % 1000 for c in p])]


def test_the_processors_vision_batch_feeds_the_model_and_generate(vl):
    rng = np.random.default_rng(0)
    processor = M3Processor(encode=_encode)
    prompt, ids, vision = processor(f"look {IMAGE_TOKEN} then {VIDEO_TOKEN} and say",
                                    images=[rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)],
                                    videos=[rng.integers(0, 256, (4, 28, 56, 3), dtype=np.uint8)])
    assert isinstance(vision, VisionBatch) and vision.num_chunks_per_video == [1] and ids == _encode(prompt)
    with torch.no_grad():
        logits = vl(torch.tensor(ids), **vision.model_inputs()).logits
    (got,), _ = generate(vl, [ids], max_new_tokens=3, images=[vision])
    tuple_form = (vision.pixel_values, vision.image_grid_thw, vision.pixel_values_videos, vision.video_grid_thw)
    (want,), _ = generate(vl, [ids], max_new_tokens=3, images=[tuple_form])
    assert got.tokens == want.tokens and got.tokens[0] == int(logits[-1].argmax())
    _, text_ids, empty = processor("no images")  # a VisionBatch without pixels is a prompt without images
    (plain,), _ = generate(vl, [text_ids], max_new_tokens=2, images=[empty])
    assert len(plain.tokens) == 2
    with pytest.raises(ValueError, match=r"prompt 0: input_ids: \d+ image placeholder tokens but no pixel_values"):
        generate(vl, [ids], max_new_tokens=2, images=[empty])


# ---------------------------------------------------------------------------------------------- 8. docstrings

@pytest.mark.parametrize("fn,words", [(M3TextModel.from_pretrained, ("dtype", "auto", "eval")),
                                      (M3ForConditionalGeneration.from_pretrained, ("dtype", "auto", "eval")),
                                      (M3Tokenizer.encode, ("ids", "special")),
                                      (M3Tokenizer.decode, ("skip_special_tokens",)),
                                      (M3Processor.__call__, ("VisionBatch", "model_inputs", "generate"))],
                         ids=["text-from_pretrained", "vl-from_pretrained", "encode", "decode", "processor"])
def test_the_public_entry_points_say_what_they_take_and_return(fn, words):
    doc = inspect.getdoc(fn) or ""
    assert all(w in doc for w in words), (fn.__qualname__, doc)


def test_zero_budgets_are_refused_not_read_as_unset(model):
    """`token_budget=0` and `max_total_tokens=0` read as "not given" (`or` defaults): refused now."""
    for name in ("token_budget", "max_total_tokens"):
        for value in (0, -5, 2.0, True):
            with pytest.raises(ValueError, match=rf"{name} must be an int >= 1 or None .*got {value!r}"):
                generate(model, [[5, 6, 7]], max_new_tokens=2, **{name: value})
    results, _ = generate(model, [[5, 6, 7]], max_new_tokens=2, token_budget=64, max_total_tokens=64)
    assert len(results[0].tokens) == 2
