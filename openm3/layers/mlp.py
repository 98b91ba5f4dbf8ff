"""Dense SwiGLU-OAI MLP (the dense layers' MLP and the MoE shared expert)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI on a fused projection: [..., 2I] (gate first, then up) -> [..., I].

    `gate` is clamped above at `limit`, `up` to [-limit, limit]; out = (up + 1) * gate * sigmoid(alpha * gate).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


COMPILE_ACTIVATION = True  # False: run the fused elementwise helpers eagerly on CUDA too (debugging)


def fused_on_cuda(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn(x, ...)` as one fused kernel forward and one backward (torch.compile, compiled at the first CUDA call)
    when x is a CUDA tensor, instead of one eager kernel per elementwise op each way. Eager on CPU, and plain
    inside an enclosing torch.compile (which fuses it anyway)."""
    compiled = None

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args):
        nonlocal compiled
        if not x.is_cuda or not COMPILE_ACTIVATION or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(x, *args)

    return run


# The fused kernel keeps its intermediates in fp32, so bf16 results can differ from eager by one rounding.
fused_swiglu_oai = fused_on_cuda(swiglu_oai)


class DenseMLP(nn.Module):
    """x [..., hidden] -> [..., hidden] through `gate_up_proj` [2I, hidden] and `down_proj` [hidden, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))
