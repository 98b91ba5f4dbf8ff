"""RMSNorm as M3 uses it: zero-centred weight (the scale is `1 + weight`), computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.norm_rope import add_rms_norm, inference_kernels, rms_norm


class RMSNorm(nn.Module):
    """`y = x / rms(x) * (1 + weight)` over the last dim, in fp32, cast back to x's dtype.

    x: [..., dim] -> [..., dim]. The weight is stored zero-centred, as in the published checkpoints, so a freshly
    initialised norm (weight 0) is the identity scale.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if inference_kernels(x, self.weight):  # one Triton kernel (CUDA, no gradient; `openm3.ops.norm_rope`)
            return rms_norm(x, self.weight, self.eps)
        # x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32: `F.rms_norm` is one fused kernel on CUDA (five
        # elementwise and reduction kernels written out) and the same arithmetic elsewhere
        xf = x.float()
        return F.rms_norm(xf, (xf.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add, then this norm: (x + delta, self(x + delta)); one kernel where the inference kernels
        run (`openm3.ops.norm_rope.add_rms_norm`), the torch ops elsewhere."""
        if delta.dtype == x.dtype and delta.shape == x.shape and inference_kernels(x, delta, self.weight):
            return add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
