"""`openm3.ops.norm_rope`: the one-kernel RMSNorm and rotary embedding against the layers' torch code (their spec),
under TRITON_INTERPRET=1 on CPU tensors (conftest sets it without a GPU), and when the layers use them."""

from __future__ import annotations

import pytest
import torch

from hopper_compile import run_compile_script
from openm3.layers.norm import RMSNorm
from openm3.layers.rope import apply_rope, rope_cos_sin
from openm3.ops import _norm_rope_kernels as kernels
from openm3.ops.msa import use_backend
from openm3.ops.norm_rope import add_rms_norm, heads_norm_rope, inference_kernels, rms_norm, rope

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests (tests/gpu on a GPU)")


def _reference_rope(x, cos, sin):
    with use_backend("reference"):
        return apply_rope(x, cos, sin)


def _assert_rope_matches(x, cos, sin):
    """fp32: bit-identical to the torch ops (no contraction in the interpreter); 16-bit: its error against the fp32
    computation (from the same 16-bit inputs) at most that of the torch ops, which round three times."""
    got = rope(x, cos, sin)
    want = _reference_rope(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    if x.dtype == torch.float32:
        assert torch.equal(got, want)
        return
    exact = _reference_rope(x.float(), cos.to(x.dtype).float(), sin.to(x.dtype).float())
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max()
    assert ((got.float() - exact).abs() <= exact.abs() * 2 ** -11 + 1e-7).all()  # rounded once: half an ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, dim, rotary", [(3, 16, 8), (4, 16, 16), (1, 16, 32), (2, 24, 8)])
def test_rope_kernel_matches_the_torch_ops(dtype, heads, dim, rotary):
    """Partial (R < D), whole (R = D) and narrower-than-table (R > D, the M3 indexer) heads; D not a power of 2."""
    torch.manual_seed(0)
    t = 7
    x = (torch.randn(t, heads, dim) * 3).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(100, 100 + t), rotary, 10000.0, dtype)
    _assert_rope_matches(x, cos, sin)
    # fp32 tables with 16-bit x: cast first, as the torch ops do
    cos32, sin32 = rope_cos_sin(torch.arange(100, 100 + t), rotary, 10000.0)
    _assert_rope_matches(x, cos32, sin32)


def test_rope_kernel_takes_strided_views():
    """x a view with gaps between heads and tokens (a slice of a fused projection), tables sliced from wider ones."""
    torch.manual_seed(1)
    big = torch.randn(5, 6, 40)
    x = big[:, 1:4, 4:36]  # [5, 3, 32], strides (240, 40, 1)
    cos, sin = rope_cos_sin(torch.arange(5), 48, 500.0)
    cos, sin = cos[:, :16], sin[:, :16]  # row stride 48
    assert torch.equal(rope(x, cos, sin), _reference_rope(x, cos, sin))
    xt = torch.randn(5, 3, 32).transpose(0, 1).contiguous().transpose(0, 1)  # token stride < head stride
    assert torch.equal(rope(xt, cos, sin), _reference_rope(xt, cos, sin))
    assert rope(x[:0], cos[:0], sin[:0]).shape == (0, 3, 32)


@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 128), (1, 2048), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_kernel_matches_the_module(shape, dtype):
    torch.manual_seed(2)
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = (torch.randn(shape) * 4).to(dtype)
    with use_backend("reference"):
        want = norm(x)
    got = rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    else:  # one rounding to fp16 of fp32 values that differ in the last bits: at most one fp16 ulp
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -10 + 1e-7).all()
    strided = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() == 3 else x
    torch.testing.assert_close(rms_norm(strided, norm.weight, norm.eps), got, rtol=2e-6, atol=1e-7)


def test_the_layers_use_the_kernels_only_without_gradients(monkeypatch):
    """Under the Triton backend a no-grad call runs one kernel; a call that needs gradients runs the torch ops (and
    its gradients flow); the reference backend never runs them."""
    calls = {"rope": 0, "norm": 0}
    for name, key in (("launch_rope", "rope"), ("launch_rms_norm", "norm")):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _k=key: calls.__setitem__(_k, calls[_k] + 1) or _r(*a))
    torch.manual_seed(3)
    norm = RMSNorm(32)
    x = torch.randn(4, 2, 32)
    cos, sin = rope_cos_sin(torch.arange(4), 16, 100.0)
    with use_backend("triton"):
        with torch.no_grad():
            y = apply_rope(norm(x), cos, sin)
        assert calls == {"rope": 1, "norm": 1}
        xg = x.clone().requires_grad_()
        yg = apply_rope(norm(xg), cos, sin)
        assert calls == {"rope": 1, "norm": 1}  # gradients asked for: the torch ops
        yg.sum().backward()
        assert xg.grad is not None and norm.weight.grad is not None
        with torch.inference_mode():
            apply_rope(norm(x), cos, sin)
        assert calls == {"rope": 2, "norm": 2}
        compiled = torch.compile(lambda v: apply_rope(norm(v), cos, sin), backend="eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), y, rtol=2e-6, atol=1e-6)
        assert calls == {"rope": 2, "norm": 2}  # traced by torch.compile: the torch ops, for Inductor to fuse
    with use_backend("reference"), torch.no_grad():
        torch.testing.assert_close(apply_rope(norm(x), cos, sin), y, rtol=2e-6, atol=1e-6)
    assert calls == {"rope": 2, "norm": 2}


def test_inference_kernels_and_arguments_are_checked():
    x = torch.randn(3, 2, 8)
    with use_backend("triton"):
        assert inference_kernels(x) and not inference_kernels(x.long())
        assert not inference_kernels(x.requires_grad_())
        with torch.no_grad():
            assert inference_kernels(x)
    with pytest.raises(ValueError, match=r"weight must be \[8\] \(x's last dim\), got \(4,\)"):
        rms_norm(x, torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match=r"rope takes x \[T, H, D\] and cos, sin \[T, R\]"):
        rope(x[0], torch.ones(3, 4), torch.ones(3, 4))
    with pytest.raises(ValueError, match="the rotated width min"):
        rope(x.detach(), torch.ones(3, 5), torch.ones(3, 5))


def test_the_vision_towers_axial_rope_is_the_same_op():
    """`apply_axial_rope` (3D positions, 6F rotated channels) goes through `apply_rope`, kernel included; tables
    wider than the head are refused (the text rope would rotate only the head's width)."""
    from openm3.layers.vision import apply_axial_rope, axial_rope_cos_sin, axial_rope_inv_freq

    torch.manual_seed(4)
    x = torch.randn(6, 2, 16)
    cos, sin = axial_rope_cos_sin(torch.randint(0, 9, (6, 3)), axial_rope_inv_freq(16, 100.0))
    want = _reference_rope(x, cos, sin)
    assert torch.equal(apply_axial_rope(x, cos, sin), want)
    with use_backend("triton"), torch.no_grad():
        assert torch.equal(apply_axial_rope(x, cos, sin), want)
    with pytest.raises(ValueError, match="expected at most 16 rotated channels"):
        apply_axial_rope(x, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim, rotary", [(16, 8), (24, 32)])
def test_heads_norm_rope_is_the_norm_then_the_rope_per_group(dtype, dim, rotary):
    """A fused projection's five groups (normed and rotated, passed through, a single head) in one kernel give what
    `rms_norm` then `rope` give group by group, bit for bit under the interpreter; y may have a row stride."""
    torch.manual_seed(5)
    t, heads = 5, [4, 2, 2, 3, 1]
    weights = [torch.randn(dim) * 0.3, torch.randn(dim) * 0.3, None, torch.randn(dim) * 0.3, torch.randn(dim) * 0.3]
    rotate = [True, True, False, True, True]
    wide = (torch.randn(t, sum(heads) * dim + 8) * 3).to(dtype)
    y = wide[:, 8:]
    cos, sin = rope_cos_sin(torch.arange(t) + 50, rotary, 1e4, dtype)
    got = heads_norm_rope(y, heads, dim, weights, rotate, cos, sin, 1e-6)
    start = 0
    for g, h in enumerate(heads):
        want = y[:, start * dim:(start + h) * dim].reshape(t, h, dim)
        start += h
        if weights[g] is not None:
            want = rms_norm(want, weights[g], 1e-6)
        if rotate[g]:
            want = rope(want, cos, sin)
        assert got[g].shape == (t, h, dim) and got[g].dtype == dtype and got[g].is_contiguous()
        assert torch.equal(got[g], want), g
    one = heads_norm_rope(y[:, :4 * dim], [4], dim, [None], [True], cos, sin, 1e-6)[0]  # rotated, not normed
    assert torch.equal(one, rope(y[:, :4 * dim].reshape(t, 4, dim), cos, sin))
    assert [p.shape for p in heads_norm_rope(y[:0], heads, dim, weights, rotate, cos[:0], sin[:0], 1e-6)] == \
        [(0, h, dim) for h in heads]


def test_heads_norm_rope_checks_its_arguments():
    y, cos = torch.randn(3, 4 * 8), torch.ones(3, 4)
    with pytest.raises(ValueError, match="heads, weights and rotate must have 1-5 entries each"):
        heads_norm_rope(y, [1] * 6, 8, [None] * 6, [False] * 6, cos, cos, 1e-6)
    with pytest.raises(ValueError, match=r"y must be \[T, 40\] \(sum\(heads\) \* head_dim\)"):
        heads_norm_rope(y, [2, 3], 8, [None, None], [False, False], cos, cos, 1e-6)
    with pytest.raises(ValueError, match="every group needs at least one head"):
        heads_norm_rope(y, [4, 0], 8, [None, None], [False, False], cos, cos, 1e-6)
    with pytest.raises(ValueError, match=r"weights\[1\] must be \[8\] \(head_dim\), got \(4,\)"):
        heads_norm_rope(y, [2, 2], 8, [None, torch.ones(4)], [False, True], cos, cos, 1e-6)
    with pytest.raises(ValueError, match=r"cos, sin must be \[T=3, R\]"):
        heads_norm_rope(y, [4], 8, [None], [True], cos[:2], cos[:2], 1e-6)
    with pytest.raises(ValueError, match="the rotated width min"):
        heads_norm_rope(y, [4], 8, [None], [True], torch.ones(3, 5), torch.ones(3, 5), 1e-6)


def _tiny_attention_layers():
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(6)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # the norms' zero-centred weights away from 0
                p.normal_(0, 0.3)
    return model, [m for m in model.modules() if type(m).__name__ == "Attention"]


def test_fused_projections_project_as_the_separate_ops(monkeypatch):
    """`fuse_projections`: the weights keep their names and values as views of one matrix; a no-grad `project`
    under the Triton backend then runs one GEMM and `heads_norm_rope` and gives the separate ops' q, k, v, qi, ki;
    gradients, the reference backend, a loaded state dict and a `.to` behave as before the fusion."""
    from openm3.layers.attention import fuse_projections

    model, layers = _tiny_attention_layers()
    cfg = model.config
    x = torch.randn(6, cfg.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(6) + 3, cfg.rotary_dim, 1e4)
    with use_backend("triton"), torch.no_grad():
        want = [layer.project(x, cos, sin) for layer in layers]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == len(layers) and fuse_projections(model) == len(layers)  # idempotent
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    calls = []
    real = kernels.launch_heads_norm_rope
    monkeypatch.setattr(kernels, "launch_heads_norm_rope", lambda *a: calls.append(1) or real(*a))
    with use_backend("triton"), torch.no_grad():
        got = [layer.project(x, cos, sin) for layer in layers]
    assert len(calls) == len(layers)
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert (a is None and b is None) or (a.shape == b.shape and b.is_contiguous() and torch.equal(a, b))
    assert got[0][3] is None and got[1][4].shape == (6, cfg.index_head_dim)
    layer = layers[1]
    with use_backend("reference"), torch.no_grad():  # the torch ops (the spec)
        ref = layer.project(x, cos, sin)
    with use_backend("triton"):
        grad = layer.project(x, cos, sin)  # gradients asked for: the separate torch ops
    assert len(calls) == len(layers)
    for a, b in zip(ref, grad):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    grad[0].sum().backward()
    assert layer.q_proj.weight.grad is not None and layer.indexer.k_proj.weight.grad is None
    model.load_state_dict({k: v + 1 for k, v in before.items()})  # copied into the views: still fused
    assert layer._fused_intact() and torch.equal(layer.v_proj.weight, before["layers.1.self_attn.v_proj.weight"] + 1)
    model.double()  # a move gives each weight its own tensor: the separate ops again
    assert not layer._fused_intact()
    with use_backend("triton"), torch.no_grad():
        layer.project(x.double(), cos.double(), sin.double())
    assert len(calls) == len(layers)
    assert fuse_projections(model) == len(layers) and layer._fused_intact()


def test_fused_projections_keep_the_models_logits():
    """A whole no-grad forward of m3-tiny (dense and MSA layers) under the Triton backend, before and after the
    fusion: the same logits."""
    from openm3.layers.attention import fuse_projections

    model, _ = _tiny_attention_layers()
    ids = torch.randint(0, model.config.vocab_size, (40,))
    with use_backend("triton"), torch.no_grad():
        want = model(ids).logits
        fuse_projections(model)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 48), (2, 3, 128), (0, 16)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, shape):
    """The residual add and the norm in one kernel: the sum as torch's add rounds it, and the norm kernel's output
    of that sum, bit for bit (same program shape); inputs with a row stride are taken."""
    torch.manual_seed(7)
    weight = torch.randn(shape[-1]) * 0.3
    x, d = ((torch.randn(shape) * 3).to(dtype) for _ in range(2))
    total, normed = add_rms_norm(x, d, weight, 1e-6)
    assert torch.equal(total, x + d) and torch.equal(normed, rms_norm(x + d, weight, 1e-6))
    assert total.shape == normed.shape == x.shape and normed.dtype == dtype
    wide = torch.randn(shape[0], shape[-1] + 4).to(dtype)[:, 4:]
    if len(shape) == 2:
        t2, n2 = add_rms_norm(wide, d, weight, 1e-6)
        assert torch.equal(t2, wide + d) and torch.equal(n2, rms_norm(wide + d, weight, 1e-6))


def test_add_forward_uses_the_kernel_only_in_inference(monkeypatch):
    calls = []
    real = kernels.launch_add_rms_norm
    monkeypatch.setattr(kernels, "launch_add_rms_norm", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(8)
    norm = RMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    x, d = torch.randn(4, 32), torch.randn(4, 32)
    with use_backend("reference"), torch.no_grad():
        want = (x + d, norm(x + d))
    with use_backend("triton"):
        with torch.no_grad():
            got = norm.add_forward(x, d)
        assert len(calls) == 1
        grad = norm.add_forward(x, d.clone().requires_grad_())  # gradients asked for: the torch ops
        assert len(calls) == 1 and grad[1].requires_grad
        with torch.no_grad():
            norm.add_forward(x, d.double())  # mixed dtypes: the torch ops (and their promotion)
        assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"delta must match x \(torch.float32 \(4, 32\)\)"):
        add_rms_norm(x, d[:2], norm.weight, 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[32\]"):
        add_rms_norm(x, d, torch.zeros(8), 1e-6)



_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openm3.ops import _norm_rope_kernels as k


def compile_(fn, sig, consts, warps):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": 3})
    assert "cubin" in c.asm, fn


def ints(*names):
    return {n: "i32" for n in names}


for dt in ("bf16", "fp32"):
    for rows, block in ((1, 128), (8, 128), (16, 128), (2, 2048)):
        warps = 4 if rows * block >= 1024 else 1
        if block == 128:  # m3-small's and M3's heads: q 16, k 4, v 4, index q 4, index k 1
            sig = {n: "*" + dt for n in ("y_ptr", "out_ptr", "cos_ptr", "sin_ptr", "w0", "w1", "w2", "w3", "w4")}
            compile_(k._heads_norm_rope_kernel, {**sig, **ints("n_tokens", "dim", "half", "stride_yt", "stride_ct",
                                                              "stride_st"), "eps": "fp32"},
                     dict(E0=16, E1=20, E2=24, E3=28, E4=29, NORM=0b11011, ROPE=0b11011, ROWS=rows, BLOCK_D=block),
                     warps)
            compile_(k._rope_kernel, {**{n: "*" + dt for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")},
                                      **ints("n_rows", "heads", "dim", "half", "stride_xt", "stride_xh", "stride_ct",
                                             "stride_st", "stride_ot", "stride_oh")},
                     dict(ROWS=16, BLOCK_D=block), 4)
        compile_(k._rms_norm_kernel, {**{n: "*" + dt for n in ("x_ptr", "w_ptr", "out_ptr")},
                                      **ints("n_rows", "dim", "stride_x", "stride_o"), "eps": "fp32"},
                 dict(ROWS=rows, BLOCK_D=block), warps)
        compile_(k._add_rms_norm_kernel, {**{n: "*" + dt for n in ("x_ptr", "d_ptr", "w_ptr", "sum_ptr", "out_ptr")},
                                          **ints("n_rows", "dim", "stride_x", "stride_d", "stride_s", "stride_o"),
                                          "eps": "fp32"},
                 dict(ROWS=rows, BLOCK_D=block), warps)
print("compiled")
"""


def test_the_kernels_compile_for_hopper(tmp_path):
    """The interpreter runs code a GPU compile may reject (runtime branches picking a group's weight, say), so
    compile each kernel for sm_90 (no GPU needed), bf16 and fp32."""
    run_compile_script(_COMPILE_SCRIPT, tmp_path)
