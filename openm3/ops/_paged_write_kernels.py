"""Triton kernel of `openm3.ops.paged_write` (imported only when it runs, so CPU installs need no Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .msa.triton_common import next_pow2


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to nearest even e4m3 value, still in fp32, so the cast after it is exact on any
    target (Triton's CPU interpreter casts to fp8 by rounding ties up without carrying into the exponent). Adding
    2^(e + 20) to |x| (e its exponent, at least -6, e4m3's smallest normal one) leaves the sum an ulp of 2^(e - 3),
    e4m3's spacing there, so the fp32 add rounds |x| to that spacing, ties to even."""
    a = tl.abs(x)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    m = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = ((a + m) - m).to(tl.int32, bitcast=True)
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31  # x's sign bit (a float minus is 0 - r: no -0.0)
    return (r | sign).to(tl.float32, bitcast=True)


# one program per new token: its key and value rows into their slot, and its index key (copied or quantized to
# fp8 e4m3 with an e8m0 scale, exactly `openm3.ops.msa.decode.quantize_index_keys`) into the index pool. The token
# count changes with every batch and chunk: not specialized.
@triton.jit(do_not_specialize=["n_tokens"])
def _write_kernel(slot_ptr, k_ptr, v_ptr, ki_ptr, kp_ptr, vp_ptr, kip_ptr, scale_ptr, n_tokens,
                  stride_k, stride_v, stride_ki, kv_width, ki_width,
                  BLOCK_KV: tl.constexpr, BLOCK_I: tl.constexpr, INDEX: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_KV)
    ok = cols < kv_width
    k = tl.load(k_ptr + t.to(tl.int64) * stride_k + cols, mask=ok)
    tl.store(kp_ptr + slot * kv_width + cols, k.to(kp_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_v + cols, mask=ok)
    tl.store(vp_ptr + slot * kv_width + cols, v.to(vp_ptr.dtype.element_ty), mask=ok)
    if INDEX:
        icols = tl.arange(0, BLOCK_I)
        iok = icols < ki_width
        x = tl.load(ki_ptr + t.to(tl.int64) * stride_ki + icols, mask=iok, other=0.0)
        if FP8:
            x = x.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
            bits = tl.math.div_rn(amax, 448.0).to(tl.int32, bitcast=True)  # r = amax / 448, a normal fp32
            # the smallest e with 2^e >= r: r's exponent, one less when r is a power of two
            e = ((bits >> 23) & 0xFF) - 126 - ((bits & 0x7FFFFF) == 0).to(tl.int32)
            e = tl.minimum(tl.maximum(e, -126), 127)
            inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e exactly
            q = _round_to_e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0))
            tl.store(kip_ptr + slot * ki_width + icols, q.to(kip_ptr.dtype.element_ty), mask=iok)
            tl.store(scale_ptr + slot, (e + 127).to(tl.uint8))
        else:
            tl.store(kip_ptr + slot * ki_width + icols, x.to(kip_ptr.dtype.element_ty), mask=iok)


def launch_write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ki: torch.Tensor | None,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, ki_pool: torch.Tensor | None,
                 ki_scale: torch.Tensor | None) -> None:
    """k, v: [N, width] rows (unit last stride); pools flat-indexable by slot * width; ki_scale only for fp8."""
    n, kv_width = k.shape
    index = ki is not None
    ki_width = ki.shape[1] if index else 1
    fp8 = index and ki_scale is not None
    block_kv = next_pow2(kv_width)
    _write_kernel[(n,)](slots, k, v, ki if index else k, k_pool, v_pool, ki_pool if index else k_pool,
                        ki_scale if fp8 else slots, n, k.stride(0), v.stride(0), ki.stride(0) if index else 0,
                        kv_width, ki_width, BLOCK_KV=block_kv, BLOCK_I=next_pow2(ki_width), INDEX=index, FP8=fp8,
                        num_warps=4 if block_kv >= 1024 else 2)
