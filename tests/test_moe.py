"""MoE experts: the grouped (training) path equals the reference path, forward and backward; bad input fails fast.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_moe.py
"""

from __future__ import annotations

import pytest
import torch

from openm3.layers import moe
from openm3.layers.moe import MoE, Experts, grouped_linear, set_experts_impl
from openm3.models import M3TextConfig, M3TextModel

ALPHA, LIMIT = 1.702, 7.0

# (N tokens, hidden, intermediate, experts, top-k)
SHAPES = [(1, 16, 8, 4, 1), (37, 32, 24, 6, 2), (64, 48, 40, 16, 2), (50, 64, 32, 8, 4)]
SHAPE_IDS = [f"N{n}-H{h}-I{i}-E{e}-k{k}" for n, h, i, e, k in SHAPES]


def make_moe(hidden, inter, experts, top_k, seed=0, dtype=torch.float32) -> MoE:
    """A random MoE layer whose gate/up pre-activations (std 4) often pass the SwiGLU clamp (|x| > 7)."""
    gen = torch.Generator().manual_seed(seed)
    layer = MoE(hidden, inter, inter, experts, top_k, 2.0, ALPHA, LIMIT)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = (4.0 if "gate_up_proj" in name else 1.0) / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        layer.gate.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.2)
    return layer.to(dtype)


def run(layer: MoE, x: torch.Tensor, grad: torch.Tensor, impl: str) -> dict[str, torch.Tensor]:
    """Output ("output"), input gradient ("dx") and parameter gradients (by parameter name) of `layer` run with
    `impl` (tests/gpu/test_moe_gpu.py uses it too)."""
    layer.experts.impl = impl
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, _ = layer(x)
    y.backward(grad)
    return {"output": y.detach(), "dx": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


def assert_same(got, ref, tol):
    """Every tensor of `got` within `tol` times the largest magnitude (at least 1) of its `ref` counterpart."""
    assert got.keys() == ref.keys()
    for name, b in ref.items():
        bound = tol * max(1.0, b.abs().max().item())
        err = (got[name] - b).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "sliced"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_grouped_equals_reference_fp32(shape, grouped_mm, monkeypatch):
    if grouped_mm and not moe._HAS_GROUPED_MM:
        pytest.fail("torch._grouped_mm is missing from this torch build")
    monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped_mm)
    n, hidden, inter, experts, top_k = shape
    layer = make_moe(hidden, inter, experts, top_k, seed=n)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, hidden, generator=gen)
    grad = torch.randn(n, hidden, generator=gen)
    ref = run(layer, x, grad, "reference")
    fast = run(layer, x, grad, "grouped")
    # every parameter gets a gradient (the router's is zero only with top-1: its weights are then always 1)
    assert all(ref[name].abs().sum() > 0 for name, _ in layer.named_parameters()
               if top_k > 1 or name != "gate.weight")
    assert_same(fast, ref, 1e-5)


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "sliced"])
def test_grouped_inference_equals_the_grouped_path(grouped_mm, monkeypatch):
    """Without gradients the grouped experts take `_grouped_inference` (rows gathered by the sort's order, outputs
    put back with one index_copy, mix + scale + shared add in one function): the same numbers as the path with
    gradients, bit for bit in fp32 on CPU, for the MoE layer and for `Experts` with and without scale / add."""
    monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped_mm)
    calls = []
    real = moe.Experts._grouped_inference
    monkeypatch.setattr(moe.Experts, "_grouped_inference", lambda *a: calls.append(1) or real(*a))
    layer = make_moe(32, 24, 6, 2, seed=4)
    layer.routed_scaling_factor = 2.5
    layer.experts.impl = "grouped"
    x = torch.randn(19, 32)
    want, want_logits = layer(x)  # parameters require grad: the training path
    assert calls == []
    with torch.no_grad():
        got, logits = layer(x)
    assert calls == [1] and torch.equal(got, want) and torch.equal(logits, want_logits)
    _, weights, ids = layer.gate(x)
    shared = torch.randn(19, 32)
    resid = torch.randn(19, 32)
    for scale, add, residual in ((1.0, None, None), (0.5, None, None), (1.0, shared, None), (3.0, shared, None),
                                 (2.0, shared, resid), (1.0, None, resid)):
        ref = layer.experts(x, ids, weights)
        ref = ref * scale if scale != 1.0 else ref
        ref = ref if add is None else ref + add
        ref = ref if residual is None else ref + residual
        with torch.no_grad():
            out = layer.experts(x, ids, weights, scale=scale, add=add, residual=residual)
        assert torch.equal(out, ref), (scale, add is None, residual is None)
    with torch.no_grad():  # the decoder layer's residual add, last
        assert torch.equal(layer(x, residual=resid)[0], layer(x)[0] + resid)
    with pytest.raises(ValueError, match=r"add must be \[N, hidden\] like x \(19, 32\), got \(3, 32\)"):
        layer.experts(x, ids, weights, add=shared[:3])
    with pytest.raises(ValueError, match=r"residual must be \[N, hidden\] like x \(19, 32\), got \(3, 32\)"):
        layer.experts(x, ids, weights, residual=shared[:3])


def test_grouped_path_uses_grouped_mm(monkeypatch):
    """The aligned fp32 case really goes through torch._grouped_mm (not the sliced fallback)."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = make_moe(32, 24, 6, 2)
    layer.experts.impl = "grouped"
    layer(torch.randn(20, 32))
    assert len(calls) == 2  # gate_up and down projections


def test_unused_experts_and_empty_input():
    """Experts that receive no token (and an empty batch) are handled by both paths alike."""
    layer = make_moe(32, 16, 8, 2, seed=3)
    with torch.no_grad():
        layer.gate.e_score_correction_bias[:5] = -100.0  # only experts 5, 6, 7 can be chosen
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(25, 32, generator=gen), torch.randn(25, 32, generator=gen)
    ref, fast = run(layer, x, grad, "reference"), run(layer, x, grad, "grouped")
    assert_same(fast, ref, 1e-5)
    assert ref["experts.gate_up_proj"][:5].abs().sum() == 0
    for impl in ("reference", "grouped"):
        layer.experts.impl = impl
        y, logits = layer(torch.zeros(0, 32))
        assert y.shape == (0, 32) and logits.shape == (0, 8)


@pytest.mark.parametrize("ends", [[3, 3, 9, 12], [0, 0, 0, 12], [12, 12, 12, 12]],
                         ids=["one-empty", "last-only", "first-only"])
@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "sliced"])
def test_grouped_linear(ends, grouped_mm, monkeypatch):
    monkeypatch.setattr(moe, "USE_GROUPED_MM", grouped_mm)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    out = grouped_linear(x, w, torch.tensor(ends, dtype=torch.int32))
    starts = [0] + ends[:-1]
    expected = torch.cat([x[s:e] @ w[g].T for g, (s, e) in enumerate(zip(starts, ends))])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bf16_grouped_error_within_twice_reference_error():
    """In bf16 the grouped path may round differently, but it must be no worse than the bf16 reference path
    (both measured against the fp32 reference)."""
    layer = make_moe(64, 32, 8, 2, seed=5)
    gen = torch.Generator().manual_seed(4)
    x, grad = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    exact = run(layer, x, grad, "reference")
    layer16 = make_moe(64, 32, 8, 2, seed=5, dtype=torch.bfloat16)
    ref16 = run(layer16, x.bfloat16(), grad.bfloat16(), "reference")
    fast16 = run(layer16, x.bfloat16(), grad.bfloat16(), "grouped")
    for name in ("output", "dx"):
        err_ref = (ref16[name].float() - exact[name]).abs().max().item()
        err_fast = (fast16[name].float() - exact[name]).abs().max().item()
        assert err_fast <= 2 * err_ref + 1e-3 * exact[name].abs().max().item(), (name, err_fast, err_ref)
    for name, _ in layer.named_parameters():
        g = exact[name]
        err_ref = (ref16[name].float() - g).norm().item()
        err_fast = (fast16[name].float() - g).norm().item()
        assert err_fast <= 2 * err_ref + 1e-3 * g.norm().item(), (name, err_fast, err_ref)


def test_whole_model_paths_agree():
    """Logits, aux loss and every parameter gradient of a tiny M3 model match between the two paths."""
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=256, hidden_size=64, intermediate_size=32,
                                    shared_intermediate_size=32, dense_intermediate_size=64)
    model = M3TextModel(config)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    results = []
    for impl in ("reference", "grouped"):
        assert set_experts_impl(model, impl) == config.mlp_layer_types.count("sparse")
        model.zero_grad(set_to_none=True)
        out = model(ids, cu_seqlens=cu, return_aux=True)
        (out.logits.square().mean() + out.aux_loss).backward()
        results.append({"logits": out.logits.detach(),
                        **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}})
    ref, fast = results
    assert any(".experts." in n for n in ref)
    assert_same(fast, ref, 1e-5)  # same keys, then values


def test_auto_is_reference_on_cpu():
    layer = Experts(4, 16, 8, ALPHA, LIMIT)
    assert layer.impl == "auto"
    assert layer.resolved_impl(torch.zeros(1, 16)) == "reference"
    assert layer.resolved_impl(torch.zeros(1, 16, dtype=torch.bfloat16)) == "reference"
    layer.impl = "grouped"
    assert layer.resolved_impl(torch.zeros(1, 16)) == "grouped"


def test_bad_inputs():
    layer = Experts(4, 16, 8, ALPHA, LIMIT)
    nn_init = torch.nn.init
    nn_init.normal_(layer.gate_up_proj)
    nn_init.normal_(layer.down_proj)
    x, ids, w = torch.randn(5, 16), torch.zeros(5, 2, dtype=torch.long), torch.full((5, 2), 0.5)
    with pytest.raises(ValueError, match=r"x must be \[N, 16\]"):
        layer(torch.randn(5, 12), ids, w)
    with pytest.raises(ValueError, match="x must have the experts' dtype"):
        layer(x.double(), ids, w)
    with pytest.raises(ValueError, match="experts must be an integer tensor"):
        layer(x, ids.float(), w)
    with pytest.raises(ValueError, match="experts must be an integer tensor"):
        layer(x, ids[:4], w)
    with pytest.raises(ValueError, match="weights must be a float tensor"):
        layer(x, ids, w[:, :1])
    for impl in ("reference", "grouped"):
        layer.impl = impl
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\), got \[0, 4\]"):
            layer(x, ids.index_fill(0, torch.tensor([2]), 4), w)
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\), got \[-1, 0\]"):
            layer(x, ids.index_fill(0, torch.tensor([0]), -1), w)
        # check_ids=False (MoE's call with its router's ids) skips only the range check
        torch.testing.assert_close(layer(x, ids, w, check_ids=False), layer(x, ids, w))
        with pytest.raises(ValueError, match="weights must be a float tensor"):
            layer(x, ids, w[:, :1], check_ids=False)
    with pytest.raises(ValueError, match="impl must be one of"):
        layer.impl = "fast"
    with pytest.raises(ValueError, match="impl must be one of"):
        set_experts_impl(layer, "cuda")


@pytest.mark.parametrize("experts,k", [(4, 1), (7, 2), (16, 2), (16, 4), (9, 3)])
def test_top_k_by_passes_equals_topk(experts, k):
    """CUDA's top-k of the router (k argmax passes) picks torch.topk's columns, largest first, on tie-free rows."""
    x = torch.randn(300, experts, generator=torch.Generator().manual_seed(experts * 10 + k))
    assert torch.equal(moe._top_k_by_passes(x, k), torch.topk(x, k, dim=-1).indices)


def test_top_k_by_passes_ties_take_the_lower_column_first():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    assert moe._top_k_by_passes(x, 2).tolist() == [[1, 2], [0, 1], [2, 3]]
    assert moe._top_k_by_passes(x, 3).tolist() == [[1, 2, 0], [0, 1, 2], [2, 3, 0]]


def test_load_balancing_loss_counts_the_top_k_of_the_softmax():
    """E * sum_e f_e * mean(p_e) over the layers pooled, against the formula written out with index_add counts."""
    gen = torch.Generator().manual_seed(3)
    layers = [torch.randn(n, 8, generator=gen, requires_grad=True) for n in (40, 17)]
    got = moe.load_balancing_loss(layers, 8, 2)
    counts = torch.zeros(8)
    prob_sum = torch.zeros(8)
    for logits in layers:
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, 2, dim=-1).indices.reshape(-1)
        counts = counts.index_add(0, chosen, torch.ones(chosen.numel()))
        prob_sum = prob_sum + probs.sum(dim=0)
    want = 8 * torch.sum((counts / 57) * (prob_sum / 57))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    g_got = torch.autograd.grad(got, layers, retain_graph=True)
    g_want = torch.autograd.grad(want, layers)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
