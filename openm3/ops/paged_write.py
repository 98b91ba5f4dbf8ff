"""A step's new keys, values and index keys written into a paged cache: one kernel per layer.

The engine's cache (`openm3.engine.cache`) stores each token's key and value rows and, in MSA layers, its index
key (in the KV dtype or fp8 e4m3 with a one-byte e8m0 scale per token) at the token's slot. Written out in torch
ops that is two `index_copy_` per layer plus, for fp8 index keys, the quantizer and two more: ~5 kernels in each
MSA layer of every decode step, each tiny. `write_paged` does it all in one Triton kernel where the backend switch
(`openm3.ops.msa.backend.pick_backend`) picks Triton; elsewhere, and inside a `torch.compile` trace or with a
gradient asked for, it runs the torch ops, which stay the spec. The kernel's writes equal theirs bit for bit: rows
in another dtype than their pool's are cast by torch first (as the spec does), and the fp8 quantizer is
`decode.quantize_index_keys` in the same fp32 ops with an exact round to e4m3 before the cast.

Set `TRITON_INTERPRET=1` before importing Triton to run it on CPU tensors (`use_backend("triton")`, tests).
"""

from __future__ import annotations

import torch

from .msa import decode
from .norm_rope import inference_kernels

__all__ = ["write_paged"]


def write_paged(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, ki: torch.Tensor | None = None, ki_pool: torch.Tensor | None = None,
                ki_scale: torch.Tensor | None = None) -> None:
    """Writes token i's rows at slot `slots[i]` of each pool.

    slots: int64 [N] (distinct, within the pools); k, v: [N, Hkv, D]; k_pool, v_pool: [..., Hkv, D] contiguous,
    one slot per `Hkv * D` elements (a page of `page_size` slots is `[page_size, Hkv, D]`). MSA layers also give
    ki: [N, Di] and ki_pool: [..., Di] contiguous, in a float dtype (ki cast to it) or float8_e4m3fn, which needs
    ki_scale: uint8 [...] contiguous (one e8m0 exponent per slot; `decode.quantize_index_keys`)."""
    n = slots.shape[0]
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 [N], got {slots.dtype} {tuple(slots.shape)}")
    _check_pool("k", k, k_pool, n, k.shape[1:])
    _check_pool("v", v, v_pool, n, k.shape[1:])
    if (ki is None) != (ki_pool is None):
        raise ValueError("ki and ki_pool must be given together (MSA layers) or not at all")
    fp8 = ki_pool is not None and ki_pool.dtype == decode.FP8_DTYPE
    if ki is not None:
        if ki.dim() != 2:
            raise ValueError(f"ki must be [N, Di], got shape {tuple(ki.shape)}")
        _check_pool("ki", ki, ki_pool, n, ki.shape[1:])
        if fp8 and (ki_scale is None or ki_scale.dtype != decode.SCALE_E8M0 or not ki_scale.is_contiguous()
                    or ki_scale.numel() != ki_pool.numel() // ki.shape[1]):
            raise ValueError(f"an fp8 ki_pool needs ki_scale: contiguous uint8 with one entry per slot "
                             f"({ki_pool.numel() // ki.shape[1]}), got "
                             f"{None if ki_scale is None else (ki_scale.dtype, tuple(ki_scale.shape))}")
    if n == 0:
        return
    if not inference_kernels(k, v, *(() if ki is None else (ki,))):
        _write_torch(slots, k, v, k_pool, v_pool, ki, ki_pool, ki_scale if fp8 else None)
        return
    from . import _paged_write_kernels as kern

    # casts as torch's (the kernel only copies rows, or quantizes fp8 index keys from fp32)
    rows = [_rows(t.to(p.dtype), n) for t, p in ((k, k_pool), (v, v_pool))]
    kr = None if ki is None else _rows(ki if fp8 else ki.to(ki_pool.dtype), n)
    kern.launch_write(slots, rows[0], rows[1], kr, k_pool, v_pool, ki_pool, ki_scale if fp8 else None)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(n, -1)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_pool(name: str, x: torch.Tensor, pool: torch.Tensor, n: int, row: torch.Size) -> None:
    if x.shape[0] != n:
        raise ValueError(f"{name} must have one row per slot ({n}), got shape {tuple(x.shape)}")
    if pool.shape[-len(row):] != row or not pool.is_contiguous():
        raise ValueError(f"{name}_pool must be contiguous [..., {', '.join(map(str, row))}] ({name}'s row shape), "
                         f"got {tuple(pool.shape)}")
    if x.device != pool.device:
        raise ValueError(f"{name} must be on {name}_pool's device {pool.device}, got {x.device}")


def _write_torch(slots, k, v, k_pool, v_pool, ki, ki_pool, ki_scale) -> None:
    """The spec: index_copy_ of each row (cast to the pool's dtype; fp8 index keys quantized first)."""
    k_pool.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_pool.dtype))
    if ki is None:
        return
    if ki_scale is not None:
        q8, scale = decode.quantize_index_keys(ki)
        ki_pool.view(torch.uint8).view(-1, ki.shape[1]).index_copy_(0, slots, q8.view(torch.uint8))
        ki_scale.view(-1).index_copy_(0, slots, scale)
    else:
        ki_pool.view(-1, ki.shape[1]).index_copy_(0, slots, ki.to(ki_pool.dtype))
