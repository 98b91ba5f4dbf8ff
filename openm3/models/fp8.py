"""FP8 block-quantized checkpoints, the format MiniMax publishes its weights in: dequantized when loaded.

config.json then carries a `quantization_config` such as

    {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
     "activation_scheme": "dynamic", "ignored_layers": ["...gate", "lm_head", ...]}

and every quantized weight comes with its block scales: `X.weight` (float8_e4m3fn, `[..., rows, cols]`) with
`X.weight_scale_inv` (float32, `[..., ceil(rows / b0), ceil(cols / b1)]` for blocks of `b0 x b1`), and a stacked
expert tensor `X` (transformers' layout) with `X_scale_inv`. The real weight is the fp8 value times its block's
scale (transformers' `Fp8Dequantize`, DeepSeek-V3's `weight_dequant`). Tensors left in high precision (the
`ignored_layers`: router, norms, embeddings, lm_head, the vision tower) are read as they are; which ones are
quantized is read off each tensor's dtype, so the skip-list itself is not needed.

openm3 computes in bf16/fp32: `dequantize` gives the float32 weight, which the loader casts to the model's dtype.
Activation scales of a `static` scheme (`X.input_scale`) do not apply then and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale")
_FORMATS = (None, "e4m3", "float8_e4m3fn")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 weights are quantized: blocks of `block = (rows, cols)` with one float32 scale each."""

    block: tuple[int, int]

    @classmethod
    def from_config(cls, config: dict, where: str | Path) -> "Fp8Scheme | None":
        """The scheme of config.json's `quantization_config` (None without one). Raises ValueError naming `where`
        for a quantization openm3 cannot read (another method, format, scale encoding or block shape)."""
        q = config.get("quantization_config")
        if q is None and isinstance(config.get("text_config"), dict):
            q = config["text_config"].get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ValueError(f"{where}: quantization_config must be a JSON object, got {type(q).__name__}")
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported (openm3 reads "
                             "'fp8' block-quantized checkpoints, as MiniMax publishes them, or unquantized ones)")
        fmt = q.get("fmt")
        if fmt not in _FORMATS:
            raise ValueError(f"{where}: quantization_config.fmt {fmt!r} is not supported (expected e4m3 / "
                             "float8_e4m3fn)")
        scale_fmt = q.get("scale_fmt", "float")
        if scale_fmt not in (None, "float"):
            raise ValueError(f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not supported (expected "
                             "float32 scales)")
        block = q.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive ints "
                             f"[rows, cols], got {block!r}")
        return cls((block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale grid of a weight of `shape` (leading dims, e.g. experts, kept)."""
        if len(shape) < 2:
            raise ValueError(f"an fp8 weight must have at least 2 dims, got shape {list(shape)}")
        rows, cols = shape[-2:]
        return (*shape[:-2], -(-rows // self.block[0]), -(-cols // self.block[1]))

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 `weight * scale` per block of an fp8 `weight [..., rows, cols]` and its float32 `scale` grid."""
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
        want = self.scale_shape(tuple(weight.shape))
        if tuple(scale.shape) != want:
            raise ValueError(f"scale must be {list(want)} for a weight of {list(weight.shape)} in blocks of "
                             f"{list(self.block)}, got {list(scale.shape)}")
        if not scale.dtype.is_floating_point or scale.dtype.itemsize < 2:
            raise ValueError(f"scale must be a float16/bfloat16/float32 tensor, got {scale.dtype}")
        rows, cols = weight.shape[-2:]
        full = scale.float().repeat_interleave(self.block[0], dim=-2)[..., :rows, :]
        full = full.repeat_interleave(self.block[1], dim=-1)[..., :cols]
        return weight.float() * full


def scale_name(weight_name: str) -> str:
    """The name of the scale tensor of quantized weight `weight_name` (`X.weight` -> `X.weight_scale_inv`, a stacked
    expert tensor `X` -> `X_scale_inv`)."""
    return weight_name + SCALE_SUFFIX


def weight_name(scale: str) -> str:
    """The weight a scale tensor belongs to (the inverse of `scale_name`)."""
    if not scale.endswith(SCALE_SUFFIX):
        raise ValueError(f"{scale!r} is not a scale tensor name (it does not end in {SCALE_SUFFIX!r})")
    return scale[:-len(SCALE_SUFFIX)]


def is_scale(name: str) -> bool:
    """A weight's block scales, or an activation scale: tensors that dequantisation uses or drops, never loads."""
    return name.endswith(SCALE_SUFFIX) or name.endswith(ACTIVATION_SCALE_SUFFIXES)
