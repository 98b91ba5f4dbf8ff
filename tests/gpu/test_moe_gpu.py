"""Grouped MoE path on a CUDA GPU (an H200 here), m3-small's MoE layer shape (hidden 2048, 16 experts top-2,
expert intermediate 512, shared expert 1024), bf16.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_moe_gpu.py

Checks: `auto` picks the grouped path for bf16 on CUDA; its error against the fp32 reference is at most 2x the
error of the bf16 reference path (forward and every gradient); forward + backward make no host sync; and a timing
line (fwd+bwd ms and TFLOP/s, T=8192 tokens) is printed for the grouped and the reference path (written to
$OUT/moe_layer.json as well when OUT is set).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from openm3.layers.moe import MoE
from openm3.models import M3TextConfig
from test_moe import run

pytestmark = pytest.mark.gpu

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s of an H100/H200 SXM


def small_moe(dtype: torch.dtype, seed: int = 0) -> MoE:
    """m3-small's MoE layer with random weights (gate/up pre-activations of std ~4: the SwiGLU clamp is active)."""
    c = M3TextConfig.from_name("m3-small")
    layer = MoE(c.hidden_size, c.intermediate_size, c.shared_intermediate_size, c.num_local_experts,
                c.num_experts_per_tok, c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = (4.0 if "gate_up_proj" in name else 1.0) / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=gen)
    return layer.to(device="cuda", dtype=dtype)


def test_auto_picks_grouped_for_bf16():
    layer = small_moe(torch.bfloat16)
    x = torch.randn(4, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    assert layer.experts.resolved_impl(x) == "grouped"
    assert layer.experts.resolved_impl(x.float()) == "reference"


@pytest.mark.parametrize("tokens,draws", [(1, 16), (2048, 1)], ids=["T1x16", "T2048"])
def test_grouped_bf16_error_within_twice_reference_error(tokens, draws):
    """Errors are summed (in quadrature) over `draws` independent inputs: with one token a single rounding event
    decides a gradient's error, so one draw says nothing about the method's precision."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    exact_layer, layer = small_moe(torch.float32), small_moe(torch.bfloat16)
    hidden = layer.gate.weight.shape[1]
    err_ref, err_fast, scale = {}, {}, {}
    for _ in range(draws):
        x = torch.randn(tokens, hidden, device="cuda", generator=gen)
        grad = torch.randn(tokens, hidden, device="cuda", generator=gen)
        exact = run(exact_layer, x, grad, "reference")
        ref16 = run(layer, x.bfloat16(), grad.bfloat16(), "reference")
        fast16 = run(layer, x.bfloat16(), grad.bfloat16(), "grouped")
        for name, want in exact.items():
            err_ref[name] = err_ref.get(name, 0.0) + (ref16[name].float() - want).norm().item() ** 2
            err_fast[name] = err_fast.get(name, 0.0) + (fast16[name].float() - want).norm().item() ** 2
            scale[name] = scale.get(name, 0.0) + want.norm().item() ** 2
    for name in err_ref:
        e_ref, e_fast, norm = err_ref[name] ** 0.5, err_fast[name] ** 0.5, scale[name] ** 0.5
        assert e_fast <= 2 * e_ref + 1e-3 * norm, f"{name}: {e_fast:.3g} vs bf16 ref {e_ref:.3g}"


def test_grouped_fp32_equals_reference():
    gen = torch.Generator(device="cuda").manual_seed(2)
    layer = small_moe(torch.float32)
    x = torch.randn(512, layer.gate.weight.shape[1], device="cuda", generator=gen)
    grad = torch.randn_like(x)
    assert not torch.backends.cuda.matmul.allow_tf32  # fp32 matmuls are exact fp32 (the default)
    ref, fast = run(layer, x, grad, "reference"), run(layer, x, grad, "grouped")
    for name, want in ref.items():
        err = (fast[name] - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), f"{name}: max error {err:.3g}"


def test_grouped_makes_no_host_sync():
    layer = small_moe(torch.bfloat16)
    x = torch.randn(1024, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    run(layer, x, grad, "grouped")  # warm-up: compiles the fused activation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.zero_grad(set_to_none=True)
        xg = x.detach().requires_grad_()
        y, _ = layer(xg)
        y.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _fwd_bwd_ms(forward, inputs: list[torch.Tensor], grad: torch.Tensor, params) -> float:
    """Median ms of forward(*inputs) + backward(grad), gradients reset between runs."""
    from triton.testing import do_bench

    def step():
        forward(*inputs).backward(grad)

    return do_bench(step, warmup=50, rep=300, grad_to_none=[*inputs, *params])


def test_timing_m3_small_layer(capsys):
    """Prints fwd+bwd ms and TFLOP/s at T=8192 for both paths; the grouped path must beat the reference."""
    tokens = 8192
    layer = small_moe(torch.bfloat16)
    c = M3TextConfig.from_name("m3-small")
    h, i, si, e, k = (c.hidden_size, c.intermediate_size, c.shared_intermediate_size, c.num_local_experts,
                      c.num_experts_per_tok)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn_like(x)
    # matmul FLOPs, forward = 2 * m * n * k per matmul, backward = 2x forward
    routed = 3 * 2 * tokens * k * h * 3 * i
    layer_flops = routed + 3 * 2 * tokens * h * 3 * si + 3 * 2 * tokens * h * e
    with torch.no_grad():
        _, weights, ids = layer.gate(x)
    weights.requires_grad_()
    xg = x.detach().requires_grad_()
    results = {}
    for impl in ("grouped", "reference"):
        layer.experts.impl = impl
        ms = _fwd_bwd_ms(lambda a: layer(a)[0], [xg], grad, layer.parameters())
        routed_ms = _fwd_bwd_ms(lambda a, w: layer.experts(a, ids, w), [xg, weights], grad,
                                layer.experts.parameters())
        torch.cuda.reset_peak_memory_stats()
        layer(xg)[0].backward(grad)
        results[impl] = {"fwd_bwd_ms": ms, "layer_tflops": layer_flops / ms / 1e9,
                         "mfu": layer_flops / ms / 1e-3 / H200_BF16_PEAK, "routed_fwd_bwd_ms": routed_ms,
                         "routed_tflops": routed / routed_ms / 1e9,
                         "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    with capsys.disabled():
        print(f"\nMoE layer m3-small bf16 T={tokens} (hidden {h}, {e} experts top-{k}, I={i}, shared {si}); "
              f"{layer_flops / 1e9:.0f} GFLOP fwd+bwd ({routed / 1e9:.0f} routed)")
        for impl, r in results.items():
            print(f"  {impl:9s}: layer fwd+bwd {r['fwd_bwd_ms']:.3f} ms, {r['layer_tflops']:.0f} TFLOP/s "
                  f"({100 * r['mfu']:.1f}% of {H200_BF16_PEAK / 1e12:.0f}); routed experts alone "
                  f"{r['routed_fwd_bwd_ms']:.3f} ms, {r['routed_tflops']:.0f} TFLOP/s; "
                  f"peak {r['peak_mem_gib']:.2f} GiB")
    out = os.environ.get("OUT")
    if out:
        record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens,
                  "hidden": h, "experts": e, "top_k": k, "intermediate": i, "shared_intermediate": si,
                  "gflop_fwd_bwd": layer_flops / 1e9, **results}
        with open(os.path.join(out, "moe_layer.json"), "w") as f:
            json.dump(record, f, indent=2)
    assert results["grouped"]["fwd_bwd_ms"] < results["reference"]["fwd_bwd_ms"]


def test_router_top_k_on_cuda_equals_topk():
    """The CUDA router's k argmax passes (eager and compiled) pick torch.topk's experts at m3-small's shape."""
    from openm3.layers.moe import top_k_ids
    from openm3.ops.fused import fused_on_cuda

    gen = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.sigmoid(torch.randn(65536, 16, device="cuda", generator=gen))
    want = torch.topk(scores, 2, dim=-1).indices
    assert torch.equal(top_k_ids(scores, 2), want)
    assert torch.equal(fused_on_cuda(top_k_ids)(scores, 2), want)


def test_load_balancing_loss_on_cuda_matches_cpu():
    """The compiled per-layer terms on CUDA against the CPU computation (loss and logits' gradients)."""
    from openm3.layers.moe import load_balancing_loss

    gen = torch.Generator().manual_seed(1)
    cpu = [torch.randn(8192, 16, generator=gen, requires_grad=True) for _ in range(3)]
    gpu = [t.detach().cuda().requires_grad_() for t in cpu]
    want, got = load_balancing_loss(cpu, 16, 2), load_balancing_loss(gpu, 16, 2)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=0)
    for a, b in zip(torch.autograd.grad(got, gpu), torch.autograd.grad(want, cpu)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-9)


def test_compiled_route_equals_the_torch_ops_on_cuda():
    """`route` (the router after its matmul) compiled on CUDA against its torch ops: the same experts, weights and
    logits' gradient within fp32 rounding, for a decode step's rows (1, 8) and a training chunk's; no grad too."""
    from openm3.layers.moe import route

    gen = torch.Generator(device="cuda").manual_seed(2)
    bias = torch.randn(16, device="cuda", generator=gen) * 0.1
    for rows in (1, 8, 8192):
        logits = torch.randn(rows, 16, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        weights, experts = route(logits, bias, 2)
        want_w, want_e = route.__wrapped__(logits, bias, 2)
        assert torch.equal(experts, want_e), rows
        torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=1e-7)
        probe = torch.randn(rows, 2, device="cuda", generator=gen)
        (got_g,) = torch.autograd.grad((weights * probe).sum(), logits)
        (want_g,) = torch.autograd.grad((want_w * probe).sum(), logits)
        torch.testing.assert_close(got_g.float(), want_g.float(), rtol=1e-2, atol=1e-3)  # bf16 gradients
        with torch.no_grad():
            w2, e2 = route(logits, bias, 2)
        assert torch.equal(e2, want_e) and torch.allclose(w2, want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [8, 4096])
def test_grouped_inference_on_cuda(tokens):
    """No-grad bf16 MoE (the decode step's path: outputs put back by one index_copy, the mix, routed scaling and
    shared expert as one compiled kernel): its error against the fp32 reference at most 2x the grad path's."""
    torch.manual_seed(tokens)
    layer = small_moe(torch.bfloat16)
    exact_layer = small_moe(torch.float32)
    x = torch.randn(tokens, layer.gate.weight.shape[1], device="cuda")
    exact, _ = exact_layer(x)
    train, _ = layer(x.bfloat16())  # parameters require grad: the training path
    with torch.no_grad():
        infer, _ = layer(x.bfloat16())
    err = (infer.float() - exact).abs().max().item()
    base = (train.float() - exact.detach()).abs().max().item()
    assert err <= 2 * base + 1e-6, (tokens, err, base)


@pytest.mark.parametrize("tokens", [1, 8, 64, 65])
def test_fp32_decode_takes_the_expert_kernels_and_a_graph_captures_it(monkeypatch, tokens):
    """fp32 on CUDA without gradients, up to `expert_linear_max_pairs(E)` pairs (a decode step): `auto` runs the expert
    kernels, not the reference (whose per-expert counts read on the host broke CUDA-graph capture of fp32 decode,
    session 40); outputs equal the reference's to fp32 rounding, and a CUDA graph replays them."""
    from openm3.layers import moe

    calls = []
    real = moe.expert_linear
    monkeypatch.setattr(moe, "expert_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = small_moe(torch.float32)
    x = torch.randn(tokens, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).cuda()
    want, _ = layer(x)  # parameters require grad: the reference path
    assert calls == []
    with torch.no_grad():
        got, _ = layer(x)
        assert len(calls) == (2 if 2 * tokens <= moe.expert_linear_max_pairs(16) else 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        if not calls:
            return
        graph, xs = torch.cuda.CUDAGraph(), x.clone()
        layer(xs)  # warm (compiled mix kernel)
        with torch.cuda.graph(graph):
            out, _ = layer(xs)
        xs.copy_(x.flip(0))
        graph.replay()
        ref, _ = layer(x.flip(0))
        assert torch.equal(out, ref)
