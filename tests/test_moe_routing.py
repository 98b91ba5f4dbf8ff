"""`openm3.ops.moe_routing`: the MoE layer's routing bookkeeping for inference in two Triton kernels, against the
layer's torch code (their spec), under TRITON_INTERPRET=1 on CPU tensors (conftest sets it without a GPU); the
layer uses them without gradients; they compile for sm_90."""

from __future__ import annotations

import pytest
import torch

from hopper_compile import run_compile_script
from openm3.layers import moe
from openm3.ops.moe_routing import SORT_PAIRS_MAX, route_topk, sort_pairs
from openm3.ops.msa import use_backend
from test_moe import make_moe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests (tests/gpu on a GPU)")


@pytest.mark.parametrize("n, e, k", [(1, 16, 2), (37, 16, 2), (20, 128, 4), (9, 20, 3), (5, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_matches_route(n, e, k, dtype):
    """Experts non-power-of-2 in number, k = E; the ids in `route`'s order (largest first), the weights within
    an fp32 rounding or two (sigmoid's last bit may differ between libraries)."""
    torch.manual_seed(n * e + k)
    logits = (torch.randn(n, e) * 2).to(dtype)
    bias = torch.randn(e) * 0.3
    w, ids = route_topk(logits, bias, k)
    want_w, want_ids = moe.route.__wrapped__(logits, bias, k)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (n, k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


def test_route_topk_ties_go_to_the_lower_expert():
    """Equal scores + bias: the lower expert first, as k argmax passes (the CUDA path of top_k_ids) pick them."""
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.2, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    bias = torch.zeros(5)
    _, ids = route_topk(logits, bias, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.equal(ids, moe._top_k_by_passes(torch.sigmoid(logits) + bias, 3))


@pytest.mark.parametrize("n, k, e, hidden", [(1, 2, 16, 64), (8, 2, 16, 300), (37, 3, 6, 40), (250, 4, 128, 24)])
def test_sort_pairs_matches_the_radix_sort(n, k, e, hidden):
    """Pairs across several 128-pair chunks and 16-pair programs, hidden over several 256-wide column blocks, some
    experts empty: rows, offsets and places equal the stable sort's."""
    torch.manual_seed(n + k)
    experts = torch.randint(0, e, (n, k))
    x = torch.randn(n, hidden)
    rows, offs, pos = sort_pairs(experts, x, e)
    sorted_ids, order = torch.sort(experts.reshape(-1), stable=True)
    assert torch.equal(rows, x[order // k])
    assert torch.equal(offs, torch.searchsorted(sorted_ids, torch.arange(e), right=True, out_int32=True))
    assert torch.equal(order[pos], torch.arange(n * k))  # pos is order's inverse


def test_moe_layer_takes_the_kernels_without_gradients(monkeypatch):
    """With the Triton backend and no gradients a MoE layer routes with route_topk and sorts with sort_pairs; its
    output equals the torch path's given the same routing to fp32 rounding (the experts' projections run in
    `openm3.ops.moe_experts` at this size, summing in another order; the mix is the same) and end to end."""
    layer = make_moe(32, 24, 6, 2, seed=4)
    layer.routed_scaling_factor = 2.5
    layer.experts.impl = "grouped"
    x = torch.randn(19, 32)
    calls = []
    for name in ("route_topk", "sort_pairs"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    with torch.no_grad():
        want, want_logits = layer(x)
        _, weights, ids = layer.gate(x)
        want_experts = layer.experts(x, ids, weights, scale=2.5, add=x, residual=x * 0.5)
        assert calls == []
        with use_backend("triton"):
            got, logits = layer(x)
            assert calls == ["route_topk", "sort_pairs"]
            got_experts = layer.experts(x, ids, weights, scale=2.5, add=x, residual=x * 0.5)
    assert torch.equal(logits, want_logits)
    torch.testing.assert_close(got_experts, want_experts, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # weights an fp32 ulp or two apart too
    with use_backend("triton"):
        calls.clear()
        layer(x)  # parameters require grad: the training path
        assert calls == []


def test_joint_shared_and_router_gemm_keeps_the_layer(monkeypatch):
    """`MoE.fuse_projections`: the shared expert's gate_up weight and the router's become views of one matrix
    (names and values kept, idempotent); a no-grad layer under the Triton backend then runs one GEMM for both
    (two F.linear calls with the down projection, not three) and gives the separate ops' output and logits;
    with gradients, under the reference backend and after a `.to` (which undoes the layout) it runs the separate
    ops; a loaded state dict lands in the views."""
    layer = make_moe(32, 24, 6, 2, seed=5)
    layer.experts.impl = "grouped"
    x = torch.randn(7, 32)
    with use_backend("triton"), torch.no_grad():
        want, want_logits = layer(x, residual=x)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    assert moe.fuse_moe_projections(layer) == 1 and layer.fuse_projections()  # idempotent
    after = layer.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    gate_up = layer.shared_experts.gate_up_proj.weight
    assert layer.gate.weight.data_ptr() == gate_up.data_ptr() + gate_up.numel() * gate_up.element_size()
    linears = []
    real = moe.F.linear
    monkeypatch.setattr(moe.F, "linear", lambda *a, **kw: linears.append(a[1].shape) or real(*a, **kw))
    with use_backend("triton"), torch.no_grad():
        got, logits = layer(x, residual=x)
    assert linears == [(2 * 24 + 6, 32), (32, 24)]  # the joint GEMM, then the shared expert's down projection
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with use_backend("reference"), torch.no_grad():
        torch.testing.assert_close(layer(x, residual=x)[0], want, rtol=1e-5, atol=1e-5)
    linears.clear()
    with use_backend("triton"):
        layer(x)  # parameters require grad: the separate ops
    separate = [(2 * 24, 32), (32, 24), (6, 32)]  # the shared expert's two projections, the router's own GEMM
    assert linears == separate
    layer.load_state_dict({k: v + 1 for k, v in before.items()})
    assert torch.equal(layer.gate.weight, before["gate.weight"] + 1) and layer.fuse_projections()
    assert layer._joint_rows is not None and moe.rows_intact(layer._joint_weights(), layer._joint_rows)
    layer.double()
    assert not moe.rows_intact(layer._joint_weights(), layer._joint_rows)
    linears.clear()
    with use_backend("triton"), torch.no_grad():
        layer(x.double())
    assert linears[:3] == separate and (2 * 24 + 6, 32) not in linears  # (then the fp64 experts' own)
    assert layer.fuse_projections() and moe.rows_intact(layer._joint_weights(), layer._joint_rows)


def test_joint_gemm_keeps_the_models_logits():
    """A whole no-grad forward of m3-tiny under the Triton backend with the attention and MoE projections fused:
    the logits of the separate ops."""
    from openm3.layers.attention import fuse_projections
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(8)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    ids = torch.randint(0, model.config.vocab_size, (40,))
    with use_backend("triton"), torch.no_grad():
        want = model(ids).logits
        assert fuse_projections(model) > 0 and moe.fuse_moe_projections(model) > 0
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_fail_with_the_argument_named():
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        route_topk(torch.zeros(3, 4), torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\], got 5"):
        route_topk(torch.zeros(3, 4), torch.zeros(4), 5)
    with pytest.raises(ValueError, match="experts must be int64"):
        sort_pairs(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 8), 4)
    with pytest.raises(ValueError, match=r"x must be \[N=3, hidden\]"):
        sort_pairs(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(4, 8), 4)
    with pytest.raises(ValueError, match="at most SORT_PAIRS_MAX"):
        sort_pairs(torch.zeros(SORT_PAIRS_MAX, 2, dtype=torch.int64), torch.zeros(SORT_PAIRS_MAX, 1), 4)


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openm3.ops import _moe_routing_kernels as k


def compile_(fn, sig, consts):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    assert "cubin" in c.asm, fn


for e, kk in ((16, 2), (128, 4)):
    compile_(k._route_kernel, {"logit_ptr": "*bf16", "bias_ptr": "*fp32", "w_ptr": "*fp32", "id_ptr": "*i64",
                               "n_rows": "i32", "n_experts": "i32", "stride_l": "i32"},
             dict(K=kk, K_P2=kk, ROWS=16, BLOCK_E=e))
    compile_(k._sort_pairs_kernel, {"id_ptr": "*i64", "x_ptr": "*bf16", "rows_ptr": "*bf16", "pos_ptr": "*i64",
                                    "offs_ptr": "*i32", **{n: "i32" for n in ("n_pairs", "n_experts", "hidden",
                                                                               "stride_x")}},
             dict(K=kk, PAIRS=16, CHUNK=128, BLOCK_E=e, BLOCK_H=256))
print("compiled")
"""


def test_the_kernels_compile_for_hopper(tmp_path):
    run_compile_script(_COMPILE_SCRIPT, tmp_path)
