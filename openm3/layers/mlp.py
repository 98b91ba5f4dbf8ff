"""Dense SwiGLU-OAI MLP (the dense layers' MLP and the MoE shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.fused import fused_on_cuda


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """SwiGLU-OAI on a fused projection: [..., 2I] (gate first, then up) -> [..., I].

    `gate` is clamped above at `limit`, `up` to [-limit, limit]; out = (up + 1) * gate * sigmoid(alpha * gate).
    """
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


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
        return self.from_gate_up(self.gate_up_proj(x))

    def from_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's output from `gate_up_proj`'s [..., 2I] (computed elsewhere, e.g. in a joint GEMM)."""
        return self.down_proj(fused_swiglu_oai(gate_up, self.alpha, self.limit))
