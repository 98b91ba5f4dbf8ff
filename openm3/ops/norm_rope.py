"""One-kernel RMSNorm and rotary embedding for inference (Triton), the two small ops every decoder layer runs
several times.

Written out in torch ops, M3's RMSNorm is about five kernels (casts to and from fp32, `1 + weight`, the fused
norm) and the rotary embedding five (a negation, two products, a sum and two concatenations); in a CUDA-graph
decode step of m3-small these ~70 rotary and ~100 norm calls were about a third of the graph's ~2700 nodes, and a
step of tiny kernels costs per node (~1.5 us each on an H100). Here each call is one kernel: the step's replay
went 4.50 -> 3.21 ms (session 34, `docs/perf_notes.md`).

`inference_kernels(x, *params)` says when they run: the backend switch (`openm3.ops.msa.backend.pick_backend`,
the project's one) picks Triton for `x`, no gradient is needed (training keeps the torch ops and their autograd),
and no enclosing `torch.compile` traces the call (Inductor fuses the torch ops itself). The layers call them
(`openm3.layers.norm`, `openm3.layers.rope`); their torch code stays the spec.

- `rope(x, cos, sin)` computes `x * cos + rotate_half(x) * sin` in fp32 and rounds once to x's dtype, where the
  torch ops round each product and the sum (three roundings in bf16): its error against an fp32 computation is at
  most theirs. In fp32 without contraction (the CPU interpreter) it is bit-identical to them; on a GPU the
  compiler may fuse a product into the sum (one fp32 rounding fewer).
- `rms_norm(x, weight, eps)` computes in fp32 as `RMSNorm` does; only the sum of squares is reduced in another
  order (fp32 rounding of the mean square, then one rounding to x's dtype).
- `add_rms_norm(x, delta, weight, eps)` is the residual add and the norm after it in one kernel: `x + delta`
  (rounded to x's dtype, as torch's add) and `rms_norm` of that sum.
- `heads_norm_rope(y, heads, ...)` takes a fused projection's output (the q, k, v and index heads of one GEMM,
  `openm3.layers.attention.fuse_projections`) and gives each group of heads its own contiguous tensor, normed and
  rotated as the group asks, in one kernel: what `rms_norm` then `rope` give, group by group (the norm's output
  rounded to y's dtype before the rotation, as between the two kernels).

Set `TRITON_INTERPRET=1` before importing Triton to run them on CPU tensors (`use_backend("triton")`, tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .msa.backend import pick_backend

__all__ = ["add_rms_norm", "heads_norm_rope", "inference_kernels", "rms_norm", "rope"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def inference_kernels(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether `rms_norm` / `rope` should replace the torch ops for a call on `x` (and `params`): Triton picked for
    x by the backend switch, a floating dtype they take, no gradient asked for, no torch.compile tracing."""
    if torch.compiler.is_compiling() or x.dtype not in _DTYPES or pick_backend(x) != "triton":
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)))


def _check(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) * (1 + weight)` over the last dim in fp32, cast to x's dtype. x: [..., dim], weight: [dim]
    (zero-centred, any float dtype)."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (x's last dim), got {tuple(weight.shape)}")
    _check("weight", weight, x)
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        from . import _norm_rope_kernels as k

        k.launch_rms_norm(rows, weight, out, eps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the norm after it in one kernel: (s, rms_norm(s)) with s = x + delta rounded to x's
    dtype, as `x + delta` then `rms_norm` give them. x, delta: [..., dim] of one dtype; weight: [dim]."""
    dim = x.shape[-1]
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta must match x ({x.dtype} {tuple(x.shape)}), got {delta.dtype} {tuple(delta.shape)}")
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (x's last dim), got {tuple(weight.shape)}")
    _check("delta", delta, x)
    _check("weight", weight, x)
    rows, drows = (t.reshape(-1, dim) for t in (x, delta))
    rows, drows = (t if t.stride(-1) == 1 else t.contiguous() for t in (rows, drows))
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(total)
    if rows.shape[0]:
        from . import _norm_rope_kernels as k

        k.launch_add_rms_norm(rows, drows, weight, total, out, eps)
    return total.view(x.shape), out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`openm3.layers.rope.apply_rope` in one kernel (fp32 inside, one rounding): the first `n = min(R, D)` channels
    of every head rotated (rotate-half pairs i and i + n/2), the rest passed through. x: [T, H, D]; cos, sin:
    [T, R]."""
    if x.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
        raise ValueError(f"rope takes x [T, H, D] and cos, sin [T, R] of equal shapes, got x {tuple(x.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    _check("cos", cos, x)
    _check("sin", sin, x)
    n = min(cos.shape[-1], x.shape[-1])
    if n % 2:
        raise ValueError(f"the rotated width min(R, D) must be even, got {n}")
    x, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, cos, sin))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        from . import _norm_rope_kernels as k

        k.launch_rope(x, cos, sin, out, n)
    return out


MAX_GROUPS = 5  # q, k, v and the index branch's q and k


def heads_norm_rope(y: torch.Tensor, heads: Sequence[int], head_dim: int, weights: Sequence[torch.Tensor | None],
                    rotate: Sequence[bool], cos: torch.Tensor, sin: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """Split a fused projection's output into its head groups, each normed and rotated in one kernel.

    y: [T, sum(heads) * head_dim], the groups' heads one after another (unit column stride). Group g has `heads[g]`
    heads; `weights[g]` is its RMSNorm weight [head_dim] (zero-centred, as `rms_norm`) or None for no norm;
    `rotate[g]` rotates its first `min(R, head_dim)` channels with cos, sin [T, R] as `rope` does. Returns one
    contiguous [T, heads[g], head_dim] tensor per group (views of one buffer), in y's dtype.
    """
    groups = len(heads)
    if not 1 <= groups <= MAX_GROUPS or len(weights) != groups or len(rotate) != groups:
        raise ValueError(f"heads, weights and rotate must have 1-{MAX_GROUPS} entries each, got {len(heads)}, "
                         f"{len(weights)}, {len(rotate)}")
    if any(h < 1 for h in heads):
        raise ValueError(f"every group needs at least one head, got heads={list(heads)}")
    total = sum(heads)
    if y.dim() != 2 or y.shape[1] != total * head_dim or (y.shape[0] and y.stride(1) != 1):
        raise ValueError(f"y must be [T, {total * head_dim}] (sum(heads) * head_dim) with unit column stride, got "
                         f"{tuple(y.shape)} strides {y.stride()}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != y.shape[0]:
        raise ValueError(f"cos, sin must be [T={y.shape[0]}, R], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t, y)
    n = min(cos.shape[-1], head_dim)
    if any(rotate) and n % 2:
        raise ValueError(f"the rotated width min(R, head_dim) must be even, got {n}")
    for g, w in enumerate(weights):
        if w is not None:
            if w.shape != (head_dim,):
                raise ValueError(f"weights[{g}] must be [{head_dim}] (head_dim), got {tuple(w.shape)}")
            _check(f"weights[{g}]", w, y)
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    out = torch.empty(y.shape[0] * total * head_dim, dtype=y.dtype, device=y.device)
    t = y.shape[0]
    if t:
        from . import _norm_rope_kernels as k

        ends = [sum(heads[:g + 1]) for g in range(groups)] + [total] * (MAX_GROUPS - groups)
        filled = [w if w is not None else y for w in weights] + [y] * (MAX_GROUPS - groups)
        norm_mask = sum(1 << g for g, w in enumerate(weights) if w is not None)
        rope_mask = sum(1 << g for g, r in enumerate(rotate) if r)
        k.launch_heads_norm_rope(y, out, cos, sin, filled, ends, norm_mask, rope_mask, head_dim, n, eps)
    parts, start = [], 0
    for h in heads:
        parts.append(out[start:start + t * h * head_dim].view(t, h, head_dim))
        start += t * h * head_dim
    return parts
