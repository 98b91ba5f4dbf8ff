"""`fused_on_cuda`: a function of torch ops as a few fused kernels on CUDA (torch.compile), eager elsewhere.

Many small torch ops cost one kernel launch each, and in a training step the host's launches, not the GPU, set
the pace (session 4: ~15K launches per m3-small step). Wrapping a pure tensor function compiles it once, at its
first CUDA call, into the fused kernels inductor generates (shapes dynamic); on CPU, under the Triton interpreter
and inside an enclosing torch.compile it runs as written. If compiling fails (an older torch, a missing
compiler), it warns once and runs eagerly from then on.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, TypeVar

import torch

__all__ = ["fused_on_cuda", "COMPILE"]

COMPILE = True  # False: run every fused_on_cuda function eagerly on CUDA too (debugging)

F = TypeVar("F", bound=Callable)


def _compile_errors() -> tuple[type, ...]:
    """The exception types a failed torch.compile raises (those this torch version has)."""
    from torch._dynamo import exc as dynamo_exc
    from torch._inductor import exc as inductor_exc

    found = (getattr(dynamo_exc, "TorchDynamoException", None), getattr(dynamo_exc, "BackendCompilerFailed", None),
             getattr(inductor_exc, "InductorError", None))
    return tuple(e for e in found if e is not None)


def fused_on_cuda(fn: F) -> F:
    """`fn(x, ...)` compiled (dynamic shapes, one graph) for a CUDA tensor `x`. The result's `__wrapped__` is the
    plain function and `fallback` says why compiling failed (None while it has not)."""
    compiled = None

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        nonlocal compiled
        if not (isinstance(x, torch.Tensor) and x.is_cuda) or not COMPILE or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(x, *args, **kwargs)
        except _compile_errors() as e:
            run.fallback = f"{type(e).__name__}: {str(e)[:200]}"
            warnings.warn(f"torch.compile of {fn.__qualname__} failed ({run.fallback}); running it eagerly")
            compiled = fn
            return fn(x, *args, **kwargs)

    run.fallback = None  # why compiling failed, once it has
    return run  # type: ignore[return-value]
