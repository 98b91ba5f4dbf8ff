"""The one place that picks the MSA backend.

`reference` (PyTorch, fp32, the executable spec) runs anywhere; `triton` runs the fused kernels. The default is
`triton` for CUDA tensors and `reference` otherwise. Override it for a whole process with the environment
variable `OPENM3_MSA_BACKEND=reference|triton`, or for a block of code with `use_backend("...")` (tests use this to
run the Triton kernels on CPU tensors under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

BACKENDS = ("reference", "triton")
_override: str | None = None


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"MSA backend must be one of {BACKENDS}, got {name!r}")
    return name


def pick_backend(x: torch.Tensor) -> str:
    """Backend for an op whose main input is `x`."""
    if _override is not None:
        return _override
    env = os.environ.get("OPENM3_MSA_BACKEND")
    if env:
        return _check_name(env)
    return "triton" if x.is_cuda else "reference"


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend inside the block (`None` restores automatic choice)."""
    global _override
    previous = _override
    _override = None if name is None else _check_name(name)
    try:
        yield
    finally:
        _override = previous
