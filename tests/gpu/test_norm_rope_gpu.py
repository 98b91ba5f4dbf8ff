"""The one-kernel RMSNorm and rotary embedding (`openm3.ops.norm_rope`) on CUDA in bf16, at m3-small's shapes:
the error of each against fp32 within 2x that of the torch ops in bf16, and one kernel each in a no-grad
forward.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_norm_rope_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_rope_and_norm_kernels_in_bf16_on_cuda():
    """rope, rms_norm and add_rms_norm at 1, 8 and 16K rows."""
    from openm3.layers.norm import RMSNorm
    from openm3.layers.rope import apply_rope, rope_cos_sin
    from openm3.ops.msa import use_backend
    from openm3.ops.norm_rope import add_rms_norm, rms_norm, rope

    torch.manual_seed(0)
    dev = "cuda"
    for t in (1, 8, 16384):
        cos, sin = rope_cos_sin(torch.arange(t, device=dev) * 7, 64, 5e6, torch.bfloat16)
        for heads in (16, 4, 1):  # query, key, index key heads
            x = torch.randn(t, heads, 128, device=dev, dtype=torch.bfloat16) * 2
            with use_backend("reference"):
                want = apply_rope(x, cos, sin)
                exact = apply_rope(x.float(), cos.float(), sin.float())
            err = (rope(x, cos, sin).float() - exact).abs().max().item()
            assert err <= 2 * (want.float() - exact).abs().max().item() + 1e-6, (t, heads, err)
        for dim in (128, 2048):
            norm = RMSNorm(dim).to(dev)
            with torch.no_grad():
                norm.weight.normal_(0, 0.3)
            x = torch.randn(t, dim, device=dev, dtype=torch.bfloat16) * 3
            exact = norm(x.float())  # fp32 reference (no grad needed: parameters require grad, so torch ops)
            with use_backend("reference"), torch.no_grad():
                torch_bf16 = norm(x)
            got = rms_norm(x, norm.weight, norm.eps)
            err = (got.float() - exact).abs().max().item()
            base = (torch_bf16.float() - exact).abs().max().item()
            assert err <= 2 * base + 1e-6, (t, dim, err, base)
        # the residual add and the norm in one kernel: the sum exactly torch's, the norm rms_norm's of it
        xs, ds = (torch.randn(t, 2048, device=dev, dtype=torch.bfloat16) for _ in range(2))
        total, normed = add_rms_norm(xs, ds, norm.weight, norm.eps)
        assert torch.equal(total, xs + ds) and torch.equal(normed, rms_norm(xs + ds, norm.weight, norm.eps))
    # a no-grad forward of the layers launches one kernel each
    norm = RMSNorm(2048).to(dev, torch.bfloat16)
    x = torch.randn(8, 2048, device=dev, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(8, device=dev), 64, 5e6, torch.bfloat16)
    q = x.view(8, 16, 128)
    with torch.no_grad():
        norm(x), apply_rope(q, cos, sin)  # compile first
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            norm(x)
            apply_rope(q, cos, sin)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Activity" not in e.name]
    assert len(kernels) == 2 and "_rms_norm_kernel" in kernels[0] and "_rope_kernel" in kernels[1], kernels


def test_fused_projections_in_bf16_on_cuda():
    """An m3-small MSA layer's `project` after `fuse_projections`, bf16 on CUDA: q, k, v, qi, ki within 2x the
    torch ops' bf16 error against fp32 (the same bf16 weights and input), and two kernels per call (one GEMM,
    one `heads_norm_rope`) where the separate path runs five GEMMs and eight norm / rotate kernels."""
    from openm3.layers.attention import Attention
    from openm3.layers.rope import rope_cos_sin
    from openm3.models import M3TextConfig
    from openm3.ops.msa import use_backend

    torch.manual_seed(1)
    dev = "cuda"
    config = M3TextConfig.from_name("m3-small")
    layer = Attention(config, 1).to(dev)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    exact_layer = Attention(config, 1).to(dev)
    layer.to(torch.bfloat16)
    exact_layer.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    for t in (8, 4096):
        x = torch.randn(t, config.hidden_size, device=dev, dtype=torch.bfloat16)
        cos, sin = rope_cos_sin(torch.arange(t, device=dev) * 3, config.rotary_dim, 5e6, torch.bfloat16)
        with torch.no_grad():
            exact = exact_layer.project(x.float(), cos.float(), sin.float())
            with use_backend("reference"):
                torch_bf16 = layer.project(x, cos, sin)
            assert layer.fuse_projections() and layer._fused_intact()
            got = layer.project(x, cos, sin)
        for name, e, b, g in zip("q k v qi ki".split(), exact, torch_bf16, got):
            assert g.shape == e.shape and g.dtype == torch.bfloat16 and g.is_contiguous(), name
            err = (g.float() - e).abs().max().item()
            base = (b.float() - e).abs().max().item()
            assert err <= 2 * base + 1e-6, (t, name, err, base)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer.project(x[:8], cos[:8], sin[:8])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Activity" not in e.name]
    assert len(kernels) == 2 and "_heads_norm_rope_kernel" in kernels[1], kernels
