"""`fused_on_cuda`: a function of torch ops as a few fused kernels on CUDA (torch.compile), eager elsewhere.

Many small torch ops cost one kernel launch each, and in a training step the host's launches, not the GPU, set
the pace (session 4: ~15K launches per m3-small step). Wrapping a pure tensor function compiles it once, at its
first CUDA call, into the fused kernels inductor generates (shapes dynamic); on CPU, under the Triton interpreter
and inside an enclosing torch.compile it runs as written. If compiling fails (an older torch, a missing
compiler), it warns once and runs eagerly from then on. A call that would need more recompilations than Dynamo's
`recompile_limit` (many shapes, constants or grad modes in one process: the GPU test suite hit it) runs eagerly,
with one warning; the graphs already compiled keep serving the calls they fit.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, TypeVar

import torch

__all__ = ["fused_on_cuda", "COMPILE"]

COMPILE = True  # False: run every fused_on_cuda function eagerly on CUDA too (debugging)
BACKEND = "inductor"  # the torch.compile backend (CPU tests of the wrapper use "eager")


def _compiles(x) -> bool:
    """Whether a call whose first argument is `x` takes the compiled path (CUDA tensors)."""
    return isinstance(x, torch.Tensor) and x.is_cuda


F = TypeVar("F", bound=Callable)


def _compile_errors() -> tuple[type, ...]:
    """The exception types a failed torch.compile raises (those this torch version has)."""
    from torch._dynamo import exc as dynamo_exc
    from torch._inductor import exc as inductor_exc

    found = (getattr(dynamo_exc, "TorchDynamoException", None), getattr(dynamo_exc, "BackendCompilerFailed", None),
             getattr(inductor_exc, "InductorError", None))
    return tuple(e for e in found if e is not None)


def _recompile_limit_errors() -> tuple[type, ...]:
    """What Dynamo raises when a `fullgraph=True` function needs more recompilations than `recompile_limit` (not a
    TorchDynamoException)."""
    from torch._dynamo import exc as dynamo_exc

    return tuple(e for e in (getattr(dynamo_exc, "FailOnRecompileLimitHit", None),) if e is not None)


def fused_on_cuda(fn: F | None = None, *, grad: bool = True) -> F:
    """`fn(x, ...)` compiled (dynamic shapes, one graph) for a CUDA tensor `x`. The result's `__wrapped__` is the
    plain function and `fallback` says why compiling failed (None while it has not).

    `grad=False` (as `@fused_on_cuda(grad=False)`) is for functions whose outputs never need gradients (index
    bookkeeping): the compiled call runs under `torch.no_grad()`, so forward and backward passes share one graph
    instead of compiling one per grad mode."""
    if fn is None:
        return functools.partial(fused_on_cuda, grad=grad)  # type: ignore[return-value]
    compiled = None
    warned_limit = False

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        nonlocal compiled, warned_limit
        if not _compiles(x) or not COMPILE or torch.compiler.is_compiling():
            return fn(x, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=BACKEND)
        try:
            if grad:
                return compiled(x, *args, **kwargs)
            with torch.no_grad():
                return compiled(x, *args, **kwargs)
        except (*_compile_errors(), *_recompile_limit_errors()) as e:
            if isinstance(e, _recompile_limit_errors()):  # this call's variant only; the compiled graphs stay
                if not warned_limit:
                    warned_limit = True
                    warnings.warn(f"torch.compile of {fn.__qualname__} reached Dynamo's recompile limit; calls "
                                  f"that fit no compiled graph run eagerly")
                return fn(x, *args, **kwargs)
            run.fallback = f"{type(e).__name__}: {str(e)[:200]}"
            warnings.warn(f"torch.compile of {fn.__qualname__} failed ({run.fallback}); running it eagerly")
            compiled = fn
            return fn(x, *args, **kwargs)

    run.fallback = None  # why compiling failed, once it has
    return run  # type: ignore[return-value]
