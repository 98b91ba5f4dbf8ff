"""Vision transformer building blocks of M3: patch embedding, axial 3D RoPE, clip attention, projector.

All tensors are *packed*: the patches of every image and every video clip are concatenated along one
axis, ``x: [N, hidden]``, and ``cu_seqlens: int [S+1]`` marks the attention segments (one per image or
per video clip). Attention is bidirectional inside a segment and absent between segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.host import host_list
from . import recompute
from .rope import apply_rope

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str):
    """The pointwise activation called ``name`` in Hugging Face configs (``gelu`` is the exact erf GELU)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act: expected one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


class VisionPatchEmbed(nn.Module):
    """Conv3d patch embedding without bias; kernel = stride = (temporal_patch, patch, patch).

    Input ``pixel_values: [N, C * temporal_patch * patch * patch]`` (one flattened patch per row, channel
    major, as the processor writes it); output ``[N, hidden]``.
    """

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int, temporal_patch_size: int):
        super().__init__()
        self.in_channels = in_channels
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.patch_dim:
            raise ValueError(f"pixel_values: expected [N, {self.patch_dim}], got {tuple(pixel_values.shape)}")
        weight = self.proj.weight
        x = pixel_values.to(weight.dtype).view(-1, self.in_channels, self.temporal_patch_size,
                                               self.patch_size, self.patch_size)
        return self.proj(x).view(x.shape[0], -1)


def axial_rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies shared by the t, h and w axes: ``[F]`` with ``F = ((head_dim // 3) // 2)``.

    Each axis rotates ``2F`` channels; ``3 * 2F <= head_dim`` channels are rotated in total and the few
    channels left over pass through unchanged.
    """
    axis_dim = 2 * ((head_dim // 3) // 2)
    if axis_dim == 0:
        raise ValueError(f"head_dim: expected >= 6 for axial 3D RoPE, got {head_dim}")
    return 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim))


def axial_rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, 6F]`` for positions ``position_ids: int [N, 3]`` (t, h, w).

    Layout of the ``6F`` rotated channels: ``[t freqs | h freqs | w freqs]`` twice (rotate-half pairing).
    """
    if position_ids.dim() != 2 or position_ids.shape[1] != 3:
        raise ValueError(f"position_ids: expected [N, 3] (t, h, w), got {tuple(position_ids.shape)}")
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device, torch.float32)  # [N, 3, F]
    freqs = freqs.flatten(1)
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x: [N, H, D]`` (rotate-half convention): the text model's
    `apply_rope` (the tables' 6F channels fit the head), with its one-kernel path in inference."""
    if cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"cos/sin: expected at most {x.shape[-1]} rotated channels (head_dim), got {cos.shape[-1]}")
    return apply_rope(x, cos, sin)


def autocast_inputs(t: torch.Tensor, readers: int) -> tuple[torch.Tensor, ...]:
    """t for `readers` ops that autocast runs in its lower precision (linear, matmul): while autocast is on for t's
    device, an fp32 t cast to the autocast dtype once, which all of them save, where each would have cast, and
    saved, a copy of its own; else t itself. The same values, and the same gradient: each reader's comes back to
    t in t's dtype on its own, summed there as when each op cast t itself."""
    device = t.device.type
    if t.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return (t,) * readers
    cast = t.detach().to(torch.get_autocast_dtype(device))
    if not (t.requires_grad and torch.is_grad_enabled()):
        return (cast,) * readers
    return tuple(_SharedCast.apply(t, cast) for _ in range(readers))


class _SharedCast(torch.autograd.Function):
    """`x.to(cast.dtype)` for one reader of `cast` (x cast once, outside autograd): a view of `cast`, and a
    gradient cast back to x's dtype (as `.to`'s own backward does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """Validate ``cu_seqlens: int [S+1]`` (0, strictly increasing, ends at ``total``); return segment lengths."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens: expected an integer tensor [S+1] with S >= 1, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    bounds = host_list(cu_seqlens, "cu_seqlens")  # read once per tensor, not once per block (a device sync on CUDA)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != total or min(lengths) <= 0:
        raise ValueError(f"cu_seqlens: expected strictly increasing from 0 to {total}, got {bounds}")
    return lengths


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention inside each segment of a packed sequence.

    ``x: [N, hidden]``, ``cos/sin: [N, 6F]``, ``cu_seqlens: int [S+1]`` -> ``[N, hidden]``. Segments are
    attended one at a time with dense SDPA (clips are a few thousand patches, so a varlen kernel buys
    little here); segments of equal length are batched together.
    """

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"num_attention_heads: must divide hidden_size {hidden_size}, got {num_heads}")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        xq, xk, xv = autocast_inputs(x, 3)  # under autocast the fp32 LayerNorm output cast once, saved once
        q = apply_axial_rope(self.q_proj(xq).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_axial_rope(self.k_proj(xk).view(n, self.num_heads, self.head_dim), cos, sin)
        v = self.v_proj(xv).view(n, self.num_heads, self.head_dim)
        return self.out_proj(self.attend(q, k, v, cu_seqlens).reshape(n, -1))

    # Dynamo does not trace this (the segments come from `cu_seqlens`' host values, a loop over runs of equal
    # lengths): under a compiled block the projections, RoPE, norms, MLP and residuals compile around it.
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q, k, v: [N, H, D]`` inside each segment -> ``[N, H, D]`` (under activation
        checkpointing with `keep_attention`, the recomputation reuses the forward's output)."""
        return recompute.kept_attention(lambda: (self._segments(q, k, v, cu_seqlens),))[0]

    def _segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        lengths = check_cu_seqlens(cu_seqlens, q.shape[0])
        out = torch.empty_like(q)
        start = 0
        for length, count in _runs(lengths):
            stop = start + length * count
            # [count, H, length, D]: equal-length segments side by side in one SDPA call.
            qs, ks, vs = (t[start:stop].view(count, length, self.num_heads, self.head_dim).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out[start:stop] = o.transpose(1, 2).reshape(stop - start, self.num_heads, self.head_dim)
            start = stop
        return out


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Run-length encoding of consecutive equal segment lengths: ``[(length, count), ...]``."""
    runs: list[list[int]] = []
    for length in lengths:
        if runs and runs[-1][0] == length:
            runs[-1][1] += 1
        else:
            runs.append([length, 1])
    return [(a, b) for a, b in runs]


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``: ``[N, hidden] -> [N, hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str):
        super().__init__()
        self.act = activation(hidden_act)
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; ``[N, hidden]``."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, hidden_act: str, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.self_attn = VisionAttention(hidden_size, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = VisionMLP(hidden_size, intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.layer_norm2(x))


class VisionProjector(nn.Module):
    """M3's projector: a GELU MLP per patch, then a GELU MLP over each ``merge x merge`` group of patches.

    ``features: [N, vision_hidden]`` with each group of ``merge**2`` spatial neighbours stored consecutively
    (the processor's patch order guarantees it) -> ``[N / merge**2, text_hidden]``.
    """

    def __init__(self, vision_hidden: int, projector_hidden: int, text_hidden: int, spatial_merge_size: int):
        super().__init__()
        self.group = spatial_merge_size**2
        self.linear_1 = nn.Linear(vision_hidden, projector_hidden)
        self.linear_2 = nn.Linear(projector_hidden, text_hidden)
        self.merge_linear_1 = nn.Linear(text_hidden * self.group, projector_hidden)
        self.merge_linear_2 = nn.Linear(projector_hidden, text_hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() != 2 or features.shape[0] % self.group:
            raise ValueError(f"features: expected [N, hidden] with N divisible by {self.group}, "
                             f"got {tuple(features.shape)}")
        x = self.linear_2(F.gelu(self.linear_1(features)))
        x = x.reshape(x.shape[0] // self.group, -1)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))
