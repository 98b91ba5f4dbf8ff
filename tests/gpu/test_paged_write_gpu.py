"""`openm3.ops.paged_write` on CUDA at m3-small's cache shapes: the kernel writes bit for bit what the torch ops
write (bf16 keys and values; index keys in bf16 or fp8 with e8m0 scales), in one kernel per call.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_paged_write_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("index_dtype", [torch.float8_e4m3fn, torch.bfloat16, None])
def test_paged_write_kernel_matches_the_torch_ops(index_dtype):
    from openm3.ops.msa import use_backend
    from openm3.ops.paged_write import write_paged

    torch.manual_seed(0)
    dev, pages, page, hkv, d, di = "cuda", 160, 128, 4, 128, 128
    fp8 = index_dtype == torch.float8_e4m3fn
    pools = [torch.randn(pages, page, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    pools.append(None if index_dtype is None else torch.randn(pages, page, di, device=dev).to(index_dtype))
    pools.append(torch.randint(0, 255, (pages, page), device=dev, dtype=torch.uint8) if fp8 else None)
    for n in (1, 8, 16384):
        slots = torch.randperm(pages * page, device=dev)[:n]
        fused = torch.randn(n, 2 * hkv * d + di, device=dev, dtype=torch.bfloat16) * 3
        fused[: n // 2, -di:] *= 1e-3  # index keys of other magnitudes, some entries into fp8's subnormals
        k, v = (fused[:, i * hkv * d:(i + 1) * hkv * d].view(n, hkv, d) for i in range(2))
        ki = None if index_dtype is None else fused[:, -di:]
        out = []
        for backend in ("triton", "reference"):
            copies = [None if p is None else p.clone() for p in pools]
            with use_backend(backend), torch.no_grad():
                write_paged(slots, k, v, copies[0], copies[1], ki, copies[2], copies[3])
            out.append(copies)
        for got, want in zip(*out):
            if got is not None:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, index_dtype)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        write_paged(slots[:8], k[:8], v[:8], pools[0], pools[1], None if ki is None else ki[:8], pools[2], pools[3])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and "Activity" not in e.name]
    assert kernels == [k for k in kernels if "_write_kernel" in k] and len(kernels) == 1, kernels
