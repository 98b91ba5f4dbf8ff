"""What a bf16 autocast over fp32 weights (the trainer's one-GPU mode) makes autograd save: no copy of a tensor
that is saved anyway. The MoE router reads the layer's bf16 input itself (`x.to(fp32)`, which autocast cast back
to a new bf16 copy, saved 2 * hidden bytes per token per MoE layer), and a vision block casts its fp32 LayerNorm
output once for q, k and v (each projection saved its own copy: 4 * hidden bytes per patch per block more). Each
against the code before it, on CPU (whose autocast casts linear inputs as CUDA's does): the saved bytes drop by
exactly that, the outputs and gradients are bitwise the same.

    .venv/bin/python -m pytest -q -p no:logging tests/test_autocast_saves.py
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from openm3.layers.moe import Router
from openm3.layers.vision import VisionAttention, apply_axial_rope
from openm3.models.config import M3TextConfig
from openm3.models.text import M3TextModel, residual_stream_dtype
from openm3.models.vision import M3VisionConfig, M3VisionModel
from test_moe import make_moe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BF16 = torch.bfloat16


def old_router_forward(self: Router, x: torch.Tensor):
    """`Router.forward` before: transformers' `x.to(weight.dtype)` whatever autocast does with it."""
    logits = F.linear(x.to(self.weight.dtype), self.weight)
    return (logits, *self.pick(logits))


def old_vision_attention_forward(self: VisionAttention, x, cos, sin, cu_seqlens):
    """`VisionAttention.forward` before: each projection casts x under autocast."""
    n = x.shape[0]
    q = apply_axial_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
    k = apply_axial_rope(self.k_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
    v = self.v_proj(x).view(n, self.num_heads, self.head_dim)
    return self.out_proj(self.attend(q, k, v, cu_seqlens).reshape(n, -1))


def run(module: torch.nn.Module, inputs: tuple, autocast: bool, seed: int = 0):
    """(bytes of the unique storages autograd saves in module(*inputs)'s forward, the parameters' and inputs'
    excluded; the outputs; the inputs' and parameters' gradients for random output gradients)."""
    inputs = tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
    module.zero_grad(set_to_none=True)
    exclude = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *inputs)}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in exclude:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=BF16, enabled=autocast), torch.autograd.graph.saved_tensors_hooks(
            pack, lambda t: t):
        out = module(*inputs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    g = torch.Generator().manual_seed(seed)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
    grads = [t.grad for t in inputs if t.requires_grad] + [p.grad for p in module.parameters()]
    return sum(saved.values()), [o.detach() for o in outs], grads


def assert_bitwise(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i}: max diff {(a - b).abs().max()}"


# ---- the MoE router ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype, autocast, weights, drop", [
    (BF16, True, torch.float32, 1),  # the trainer's one GPU: bf16 residual stream, fp32 weights, bf16 autocast
    (torch.float32, True, torch.float32, 0),  # residual_dtype=float32: autocast casts x for the router as before
    (torch.float32, False, torch.float32, 0),
    (BF16, False, BF16, 0),
], ids=["bf16-autocast-fp32w", "fp32-autocast-fp32w", "fp32", "bf16"])
def test_moe_router_saves_no_copy_of_its_input(monkeypatch, x_dtype, autocast, weights, drop):
    """Per MoE layer, 2 * hidden bytes per token less saved under the bf16 autocast; the router's matmul was and is
    bf16 there (autocast casts the `x.to(fp32)` back), so logits, outputs and gradients are bitwise the old ones."""
    n, hidden = 40, 32
    layer = make_moe(hidden, 24, 8, 2, dtype=weights)
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    new = run(layer, (x,), autocast)
    monkeypatch.setattr(Router, "forward", old_router_forward)
    old = run(layer, (x,), autocast)
    assert old[0] - new[0] == drop * 2 * hidden * n
    assert_bitwise(new[1], old[1])  # the output and the router logits
    assert new[1][1].dtype == (BF16 if autocast or weights == BF16 else torch.float32)
    assert_bitwise(new[2], old[2])


def test_router_reads_the_layers_input_itself_under_autocast():
    """The router's linear saves x's own storage (shared with the shared expert and the experts), not a copy."""
    router = Router(16, 4, 2)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(8, 16).to(BF16).requires_grad_()
    saved = []
    with torch.autocast("cpu", dtype=BF16), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        router(x)
    rows = [t for t in saved if t.shape == x.shape]
    assert len(rows) == 1 and rows[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


class Logits(torch.nn.Module):
    """`model(ids).logits`, in the trainer's bf16 residual stream when under autocast (`residual_stream_dtype`)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        bf16 = torch.is_autocast_enabled("cpu")
        with residual_stream_dtype(self.model, BF16) if bf16 else contextlib.nullcontext():
            return self.model(ids).logits


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_text_model_saves_one_copy_less_per_moe_layer(monkeypatch, autocast):
    """m3-tiny as the one-GPU trainer runs it (fp32 weights, bf16 autocast, bf16 residual stream): 2 * hidden bytes
    per token per MoE layer less saved, the same logits and gradients."""
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny")
    model = Logits(M3TextModel(config).train())
    ids = torch.randint(0, config.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    new = run(model, (ids,), autocast)
    monkeypatch.setattr(Router, "forward", old_router_forward)
    old = run(model, (ids,), autocast)
    moe_layers = config.mlp_layer_types.count("sparse")
    assert moe_layers > 0 and old[0] - new[0] == (2 * config.hidden_size * len(ids) * moe_layers if autocast else 0)
    assert_bitwise(new[1], old[1])
    assert_bitwise(new[2], old[2])


# ---- the vision tower ---------------------------------------------------------------------------------------------
TOWER = M3VisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_vision_blocks_cast_the_norm_output_once_for_q_k_v(monkeypatch, autocast):
    """Per block 2 bf16 copies of the LayerNorm output fewer under autocast (4 * hidden bytes per patch), the
    same tower output and gradients; nothing changes without autocast."""
    torch.manual_seed(0)
    tower = M3VisionModel(TOWER).train()
    grid = torch.tensor([[1, 4, 6], [2, 2, 4]])
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(2))
    new = run(tower, (pixels, grid), autocast)
    monkeypatch.setattr(VisionAttention, "forward", old_vision_attention_forward)
    old = run(tower, (pixels, grid), autocast)
    assert old[0] - new[0] == (4 * TOWER.hidden_size * patches * TOWER.num_hidden_layers if autocast else 0)
    assert_bitwise(new[1], old[1])
    assert_bitwise(new[2], old[2])
