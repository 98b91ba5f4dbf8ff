"""`openm3.ops.moe_routing` on CUDA: the routing kernel against `route` (compiled and as torch ops), the pair sort
against torch's radix sort, at m3-small's (16 experts, top-2) and M3's (128, top-4) router shapes; a no-grad MoE
layer of a decode step launches them and no sort / searchsorted / gather kernels.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_moe_routing_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("e, k", [(16, 2), (128, 4)])
def test_routing_kernels_on_cuda(e, k):
    from openm3.layers.moe import route
    from openm3.ops.moe_routing import SORT_PAIRS_MAX, route_topk, sort_pairs

    gen = torch.Generator(device="cuda").manual_seed(e)
    bias = torch.randn(e, device="cuda", generator=gen) * 0.1
    for rows in (1, 8, 256, 8192):
        logits = torch.randn(rows, e, device="cuda", generator=gen, dtype=torch.bfloat16)
        w, ids = route_topk(logits, bias, k)
        for want_w, want_ids in (route(logits, bias, k), route.__wrapped__(logits, bias, k)):
            assert torch.equal(ids, want_ids), rows
            torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)
        if rows * k <= SORT_PAIRS_MAX:
            x = torch.randn(rows, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
            got_rows, offs, pos = sort_pairs(ids, x, e)
            sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
            assert torch.equal(got_rows, x[order // k])
            assert torch.equal(offs, torch.searchsorted(sorted_ids, torch.arange(e, device="cuda"), right=True,
                                                        out_int32=True))
            assert torch.equal(order[pos], torch.arange(rows * k, device="cuda"))


def test_decode_moe_layer_kernels():
    """m3-small's MoE layer without gradients at 8 tokens: both routing kernels, no radix sort, searchsorted,
    gather or index_copy; the experts through `openm3.ops.moe_experts` (its kernel twice, no cutlass grouped GEMM
    or its argument kernel, one SwiGLU kernel: the shared expert's)."""
    from test_moe_gpu import small_moe

    layer = small_moe(torch.bfloat16)
    x = torch.randn(8, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)  # compile the fused functions first
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            layer(x)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_route_kernel" in n for n in names) and any("_sort_pairs_kernel" in n for n in names), names
    for banned in ("radixSort", "searchsorted", "index_copy", "gather_kernel", "prepare_grouped_gemm",
                   "GroupProblemShape"):
        assert not any(banned in n for n in names), (banned, names)
    assert sum("_expert_linear_kernel" in n for n in names) == 2, names
    assert sum("sigmoid" in n for n in names) == 1, names


def test_joint_shared_and_router_gemm_on_cuda():
    """m3-small's MoE layer in bf16 after `fuse_projections`, 8 tokens, no gradients: one GEMM fewer than without
    (the router's); logits and output within twice the separate ops' bf16 error against an fp32 run of the same
    weights (where the routing agrees); and a row alone gives the bits it gets among 4 (a draft step's rows equal
    one-token steps' bit for bit in bf16)."""
    from test_moe_gpu import small_moe

    from openm3.layers.moe import fuse_moe_projections

    layer = small_moe(torch.bfloat16)
    exact = small_moe(torch.bfloat16).float()  # the same bf16 weights, computed in fp32
    x = torch.randn(8, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)

    def gemms(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return out, sum(any(g in n for g in ("nvjet", "gemm", "gemv", "xmma")) and "prepare" not in n for n in names)

    with torch.no_grad():
        layer(x)
        (want, want_logits), separate = gemms(lambda: layer(x))
        ref, ref_logits = exact(x.float())
        assert fuse_moe_projections(layer) == 1
        layer(x)  # the fused SwiGLU meets a strided input: compile it first
        (got, logits), joint = gemms(lambda: layer(x))
        alone = [layer(x[i:i + 1])[0] for i in range(4)]
        four = layer(x[:4])[0]
    assert joint == separate - 1, (joint, separate)
    assert (logits.float() - ref_logits).abs().max() <= 2 * (want_logits.float() - ref_logits).abs().max() + 1e-6
    with torch.no_grad():  # the rows routed alike in all three runs (a near tie may flip one)
        ids = [gate.pick(lg)[1].sort(-1).values for gate, lg in
               ((layer.gate, logits), (layer.gate, want_logits), (exact.gate, ref_logits))]
    same = (ids[0] == ids[2]).all(-1) & (ids[1] == ids[2]).all(-1)
    assert same.sum() >= 6, same
    err = (got.float() - ref)[same].abs().max()
    base = (want.float() - ref)[same].abs().max()
    assert err <= 2 * base, (err, base)
    for i in range(4):
        assert torch.equal(alone[i][0], four[i]), i
