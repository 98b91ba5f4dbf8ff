"""Two wrong results of Triton's CPU interpreter (TRITON_INTERPRET=1) that the project's kernels work around, as a
self-contained repro for an upstream report (Triton 3.6.0: both wrong; a GPU gives the expected values).

    .venv/bin/python scripts/triton_interpreter_bugs.py

1. fp32 -> fp8 e4m3 casts round ties up without carrying into the exponent: 124.0 (halfway between 120 and 128)
   becomes 64 instead of 128 (`openm3.ops._paged_write_kernels` rounds to e4m3's spacing in fp32 first).
2. `tl.dot` of bf16 operands returns garbage (errors ~1e10): the MoE expert kernels' CPU tests run fp32 operands
   and their bf16 tests run on the GPU (`tests/gpu/test_moe_experts_gpu.py`).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _cast_fp8(x_ptr, y_ptr):
    i = tl.arange(0, 4)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv))


@triton.jit
def _dot16(a_ptr, b_ptr, c_ptr, CAST: tl.constexpr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    if CAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))


def main() -> None:
    print("triton", triton.__version__)
    x = torch.tensor([124.0, 1.0, 120.0, 0.5])
    y = torch.empty(4, dtype=torch.float8_e4m3fn)
    _cast_fp8[(1,)](x, y)
    print("fp8 cast of", x.tolist(), "-> interpreter", y.float().tolist(), "| torch", x.to(y.dtype).float().tolist())
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=gen).bfloat16(), torch.randn(16, 16, generator=gen).bfloat16()
    for cast in (False, True):
        c = torch.empty(16, 16)
        _dot16[(1,)](a, b, c, CAST=cast)
        err = (c - a.float() @ b.float()).abs().max().item()
        print(f"tl.dot, bf16 operands{' cast to fp32 first' if cast else ''}: max error {err:.3g}")


if __name__ == "__main__":
    main()
