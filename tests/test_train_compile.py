"""`TrainConfig(compile=True)`: per-layer torch.compile of the M3 decoder gives the eager losses, with activation
checkpointing too, and does not recompile once it has seen a change of packing and of token count.

CPU runs use the `aot_eager` backend (Dynamo capture, graph breaks, guards and AOTAutograd, without Inductor's C++
code generation, which takes minutes on two cores); the GPU benchmark (`benchmarks/train_throughput.py`) runs
Inductor.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from openm3.layers.moe import MoE
from openm3.models.config import M3TextConfig
from openm3.models.text import DecoderLayer, M3TextModel
from openm3.train.batches import Row
from openm3.train.config import TrainConfig
from openm3.train.distributed import apply_activation_checkpointing, apply_compile
from openm3.train.trainer import Trainer
from test_train_toy import ToyLM

SEQ = 48


@pytest.fixture(autouse=True)
def fresh_dynamo():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(before)


class PackedRows:
    """Random-token rows of SEQ tokens, packed from 1-3 documents whose lengths change from step to step."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def rows(self, kind, step, count):
        g = torch.Generator().manual_seed(1000 * step + count)
        out = []
        for r in range(count):
            cuts = sorted(torch.randperm(SEQ - 1, generator=g)[:(step + r) % 3].add(1).tolist())
            lens = [b - a for a, b in zip([0] + cuts, cuts + [SEQ])]
            ids = torch.randint(0, self.vocab, (SEQ + 1,), generator=g)
            out.append(Row(ids[:-1].clone(), ids[1:].clone(), lens, kind=kind))
        return out


def tiny_cfg(tmp_path, name, **kw):
    # 3 rows in micro-batches of 2: every step has a 96-token and a 48-token micro-batch; dense warm-up for
    # step 0, the sparse MSA stage after it.
    base = dict(model="m3-tiny", recipe="text-only", steps=3, seq_len=SEQ, text_rows=3, micro_batch=2, lr=3e-3,
                warmup_steps=1, msa_switch_step=1, out_dir=str(tmp_path / name), progress=False, tensorboard=False,
                compile_backend="aot_eager")
    return TrainConfig(**(base | kw))


def _fit(tmp_path, name, **kw):
    mcfg = M3TextConfig.from_name("m3-tiny")
    trainer = Trainer(tiny_cfg(tmp_path, name, **kw), lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
    records, graphs = [], []
    for _ in range(trainer.cfg.steps):
        records.append(trainer.train_step())
        graphs.append(counters["stats"]["unique_graphs"])
    return trainer, records, graphs


def _graph_break_reasons() -> list[str]:
    return [reason for reason, n in counters["graph_break"].items() if n]


@pytest.mark.parametrize("ac", [False, True], ids=["plain", "activation_checkpointing"])
def test_compiled_training_matches_eager_without_recompiles(tmp_path, ac):
    _, eager, _ = _fit(tmp_path, "eager", activation_checkpointing=ac)
    assert counters["stats"]["unique_graphs"] == 0
    trainer, compiled, graphs = _fit(tmp_path, "compiled", compile=True, activation_checkpointing=ac)

    layers = list(trainer.model.layers)
    inner = [getattr(m, "_checkpoint_wrapped_module", m) for m in layers]
    assert all(isinstance(m, DecoderLayer) for m in inner)
    assert [type(m).__name__ for m in layers] == (["CheckpointWrapper"] * 4 if ac else ["DecoderLayer"] * 4)
    assert all(m._compiled_call_impl is not None for m in inner)  # compiled inside the checkpoint wrapper

    for key in ("loss", "indexer_kl", "aux_loss", "grad_norm"):
        got, want = [r[key] for r in compiled], [r[key] for r in eager]
        assert got == pytest.approx(want, abs=1e-5, rel=1e-5), key
    assert compiled[0]["msa_stage"] == "dense" and compiled[-1]["msa_stage"] == "sparse"
    # Step 0 saw two token counts and several packings, step 1 the sparse stage; after that nothing new compiles.
    assert graphs[0] > 0
    assert graphs[1] == graphs[2], f"recompiles after step 1: graphs per step {graphs}"
    # The only graph breaks are the deliberate eager regions (attention; the CPU reference experts).
    reasons = _graph_break_reasons()
    assert reasons and all("torch.compiler.disable" in r for r in reasons), reasons


def test_compile_needs_decoder_layers():
    with pytest.raises(ValueError, match="no openm3 decoder layers"):
        apply_compile(ToyLM())


def test_compile_after_checkpointing_compiles_the_inner_layer():
    model = M3TextModel(M3TextConfig.from_name("m3-tiny"))
    assert apply_activation_checkpointing(model) == 4
    assert apply_compile(model, backend="aot_eager") == 4
    for wrapper in model.layers:
        assert wrapper._compiled_call_impl is None
        assert wrapper._checkpoint_wrapped_module._compiled_call_impl is not None


def _small_moe(dtype):
    torch.manual_seed(0)
    moe = MoE(64, 32, 64, 8, 2, 2.0, 1.702, 7.0, impl="grouped")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    return moe.to(dtype)


def test_grouped_moe_traces_as_one_graph():
    """The GPU training path (bf16 grouped experts) compiles without graph breaks or host syncs and gives the
    eager numbers; a new token count recompiles once (dynamic), later ones reuse it."""
    moe = _small_moe(torch.bfloat16)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    for n in (40, 24, 56, 17):
        x = torch.randn(n, 64, dtype=torch.bfloat16, requires_grad=True)
        y, logits = moe(x)
        y.float().square().sum().backward()
        want = [x.grad, *(p.grad for p in moe.parameters())]
        x.grad = None
        moe.zero_grad(set_to_none=True)
        yc, logits_c = compiled(x)
        yc.float().square().sum().backward()
        got = [x.grad, *(p.grad for p in moe.parameters())]
        moe.zero_grad(set_to_none=True)
        assert torch.equal(yc, y) and torch.equal(logits_c, logits)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert counters["stats"]["unique_graphs"] == 2
    assert not _graph_break_reasons()


def test_grouped_moe_under_autocast_computes_in_bf16():
    """fp32 parameters under a bf16 autocast (the trainer's one-GPU mode): the grouped path casts to bf16 as
    F.linear would, equals the same experts with bf16 weights, and its gradients reach the fp32 parameters."""
    moe32, moe16 = _small_moe(torch.float32), _small_moe(torch.bfloat16)
    x = torch.randn(40, 64)
    with torch.no_grad():
        _, weights, experts = moe16.gate(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32 = moe32.experts(x, experts, weights)
    y16 = moe16.experts(x.bfloat16(), experts, weights)
    assert y32.dtype == torch.bfloat16
    assert torch.equal(y32, y16)
    y32.float().sum().backward()
    grad = moe32.experts.gate_up_proj.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0


def _dtypes_seen(trainer) -> list[torch.dtype]:
    """The dtype of the hidden states entering each decoder layer and the final norm, during the next step."""
    seen = []
    hook = lambda module, args: seen.append(args[0].dtype)  # noqa: E731
    handles = [m.register_forward_pre_hook(hook) for m in [*trainer.model.layers, trainer.model.norm]]
    trainer.train_step()
    for h in handles:
        h.remove()
    return seen


def test_bf16_autocast_carries_a_bf16_residual_stream(tmp_path):
    """The single-process trainer's bf16 mode (fp32 parameters under autocast) carries the hidden states between
    layers in bf16, as FSDP's bf16 parameters do on several GPUs; `residual_dtype='float32'` keeps them fp32.
    Parameters and their gradients stay fp32 either way, and the losses agree to bf16 rounding."""
    runs = {}
    for residual in ("auto", "float32"):
        mcfg = M3TextConfig.from_name("m3-tiny")
        trainer = Trainer(tiny_cfg(tmp_path, residual, param_dtype="bfloat16", residual_dtype=residual),
                          lambda: M3TextModel(mcfg), PackedRows(mcfg.vocab_size))
        first = trainer.train_step()  # dense warm-up step
        seen = _dtypes_seen(trainer)  # sparse stage
        want = torch.bfloat16 if residual == "auto" else torch.float32
        assert seen and set(seen) == {want}, (residual, seen)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert trainer.model.residual_dtype is None  # only set inside the trainer's autocast
        runs[residual] = first["loss"]
        trainer.close()
    auto, fp32 = runs["auto"], runs["float32"]
    assert auto == pytest.approx(fp32, rel=2e-2) and auto != fp32


def test_residual_dtype_is_checked():
    with pytest.raises(ValueError, match="residual_dtype must be auto|float32"):
        TrainConfig(residual_dtype="bf16")
    model = M3TextModel(M3TextConfig.from_name("m3-tiny"))
    from openm3.models.text import residual_stream_dtype
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        with residual_stream_dtype(model, torch.int32):
            pass
    seen = []
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16), residual_stream_dtype(model, torch.bfloat16) as n:
        assert n == 1 and model.residual_dtype == torch.bfloat16
        model(torch.arange(40))
    assert model.residual_dtype is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.arange(40))
    assert seen == [torch.bfloat16, torch.float32]


def test_vision_tower_carries_the_residual_stream_dtype_too():
    """A VL model inside `residual_stream_dtype(bf16)` under a bf16 autocast: the vision tower's blocks take bf16
    hidden states as the text layers do (fp32 without: its pre-LayerNorm runs in fp32 under autocast). The tower's
    output stays within bf16 rounding of fp32 (the logits of a random tiny model are not compared: its MSA
    selections and expert choices flip under any bf16 rounding)."""
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    from openm3.models.text import residual_stream_dtype

    text = M3TextConfig.from_name("m3-tiny")
    cfg = M3VLConfig.from_name("m3-tiny", image_token_index=text.vocab_size - 2, video_token_index=text.vocab_size - 1)
    torch.manual_seed(0)
    model = M3ForConditionalGeneration(cfg)
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, 4 visual tokens after the 2 x 2 merge
    ids = torch.cat([torch.arange(5), torch.full((4,), cfg.image_token_index), torch.arange(5, 12)])
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    seen = {"vision": [], "text": []}
    for name, layers in (("vision", model.vision_tower.layers), ("text", model.language_model.layers)):
        for layer in layers:
            layer.register_forward_pre_hook(lambda module, args, name=name: seen[name].append(args[0].dtype))
    with torch.no_grad():
        exact = model.vision_tower(pixels, grid)
    tower = {}
    for dtype in (torch.bfloat16, None):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), residual_stream_dtype(model, dtype) as n:
            assert n == 2  # the text model and the vision tower
            seen["vision"].clear(), seen["text"].clear()
            model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
            want = dtype or torch.float32
            assert set(seen["vision"]) == {want} and set(seen["text"]) == {want}, (dtype, seen)
            tower[dtype] = model.vision_tower(pixels, grid).float()
    assert model.vision_tower.residual_dtype is None
    err = {k: ((v - exact).norm() / exact.norm()).item() for k, v in tower.items()}
    assert 0 < err[torch.bfloat16] < 1e-2 and err[torch.bfloat16] != err[None], err


def test_compiled_bf16_checkpointed_training_matches_eager(tmp_path):
    """The 64K benchmark's combination on CPU: compiled layers, bf16 autocast with a bf16 residual stream,
    activation checkpointing whose recomputation reuses the MSA selection and KL. Same losses as eager (to bf16
    rounding: the compiled graphs fuse differently) and no recompilation after step 1."""
    kw = dict(param_dtype="bfloat16", activation_checkpointing=True)
    _, eager, _ = _fit(tmp_path, "eager_bf16", **kw)
    _, compiled, graphs = _fit(tmp_path, "compiled_bf16", compile=True, **kw)
    for key in ("loss", "indexer_kl", "aux_loss"):
        got, want = [r[key] for r in compiled], [r[key] for r in eager]
        assert got == pytest.approx(want, rel=2e-2, abs=1e-3), key
    assert graphs[1] == graphs[2], f"recompiles after step 1: graphs per step {graphs}"
