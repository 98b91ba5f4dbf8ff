"""Per-block `torch.compile` (`apply_compile`) of the vision tower: everything but the segment attention
(`VisionAttention.attend`, which reads `cu_seqlens` on the host) is traced, and the numbers stay the eager ones.
CPU runs use the `aot_eager` backend (see tests/test_train_compile.py)."""

import copy

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from openm3.layers.vision import VisionAttention, VisionBlock
from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
from openm3.train.distributed import apply_compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def vl_model():
    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=7, video_token_index=8)
    return M3ForConditionalGeneration(config)


def images(seed):
    """Two images of different grids (two attention segments of different lengths)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 6], [1, 2, 4]])
    return torch.randn(24 + 8, 3 * 2 * 14 * 14, generator=g), grid


def test_compiled_tower_matches_eager_and_traces_all_but_the_attention(monkeypatch):
    eager = vl_model()
    compiled = copy.deepcopy(eager)
    graphs, events = [], []

    def record(gm, example_inputs):
        graphs.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
        inner = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

        def run(*args):
            events.append("graph")
            return inner(*args)
        return run

    original = VisionAttention.attend

    @torch.compiler.disable
    def attend(self, *args):
        events.append("attend")
        return original(self, *args)

    monkeypatch.setattr(VisionAttention, "attend", attend)
    blocks = len(compiled.vision_tower.layers)
    text_layers = len(compiled.language_model.layers)
    assert apply_compile(compiled, backend=record) == blocks + text_layers
    assert all(isinstance(b, VisionBlock) for b in compiled.vision_tower.layers)
    for seed in (0, 1):
        pixels, grid = images(seed)
        want = eager.visual_tokens(pixels, grid)
        pixels_c = pixels.clone().requires_grad_(True)
        got = compiled.visual_tokens(pixels_c, grid)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.square().sum().backward()
        pixels_e = pixels.clone().requires_grad_(True)
        eager.visual_tokens(pixels_e, grid).square().sum().backward()
        torch.testing.assert_close(pixels_c.grad, pixels_e.grad, rtol=1e-4, atol=1e-6)
        for (name, p), q in zip(compiled.vision_tower.named_parameters(), eager.vision_tower.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # once compiled, per block (Dynamo breaks at the call of `self_attn` and inside it at `attend`, as in the text
    # layers): layer norm | projections + RoPE | eager attention | out_proj | residual, norm, MLP, residual
    events.clear()
    with torch.no_grad():
        compiled.visual_tokens(*images(1))
    assert events == ["graph", "graph", "attend", "graph", "graph"] * blocks
    ops = set().union(*graphs)
    assert torch.ops.aten.layer_norm.default in ops or any("layer_norm" in str(o) for o in ops)
    assert not any("scaled_dot_product" in str(o) for o in ops)  # the attention itself stays eager
