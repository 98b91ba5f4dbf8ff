"""The one place that picks the MSA backend.

`reference` (PyTorch, fp32, the executable spec) runs anywhere; `triton` runs the fused kernels. `pick_backend`
takes the first of:

1. `with use_backend(name):` for a block of code (also a function decorator; blocks nest, and each restores the
   choice it found on exit; `use_backend(None)` lifts an outer block's choice inside the block);
2. `set_backend(name)` for the whole process, until the next call (`set_backend(None)` clears it);
3. the environment variable `OPENM3_MSA_BACKEND=reference|triton`, read at every call;
4. automatic: `triton` for CUDA tensors, `reference` otherwise.

`use_backend(...)` does nothing until entered: called as a plain statement it changes nothing, and it warns
(RuntimeWarning) when the never-entered object is discarded. `set_backend` is the statement form.

The Triton kernels run on CPU tensors only under Triton's CPU interpreter (tests use this), which Triton switches
on when it is *first imported* with `TRITON_INTERPRET=1`; setting the variable later changes nothing but breaks
the kernels. Forcing `triton` for a CPU tensor without the interpreter raises ValueError here, before any kernel
runs. The interpreter computes `tl.dot` of bf16 operands wrong, so the kernels refuse bf16 there
(`triton_common.check_triton_inputs`, which every Triton entry point calls).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

BACKENDS = ("reference", "triton")
ENV_VAR = "OPENM3_MSA_BACKEND"
_process: str | None = None  # set_backend
_scoped: str | None = None  # the innermost entered use_backend block
_interpreted: bool | None = None  # triton's interpreter state, fixed once triton is imported


def _check_name(name: str | None, where: str) -> str | None:
    if name is not None and name not in BACKENDS:
        raise ValueError(f"{where}: the MSA backend must be one of {BACKENDS} (or None for the automatic choice), "
                         f"got {name!r}")
    return name


def interpreting() -> bool:
    """True when `TRITON_INTERPRET` asks for Triton's CPU interpreter (what it holds now; Triton itself read it when
    first imported, `triton_interpreted`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_interpreted() -> bool | None:
    """Whether the imported Triton runs kernels on its CPU interpreter: fixed by `TRITON_INTERPRET` when `triton` was
    first imported (its own library functions are built then), whatever the variable says now. None while
    Triton is not imported yet (its first import will read the variable as it is then)."""
    global _interpreted
    if _interpreted is None:
        standard = sys.modules.get("triton.language.standard")
        if standard is None:
            return None
        from triton.runtime.interpreter import InterpretedFunction
        probe = getattr(standard, "zeros_like", None)  # a @triton.jit function of Triton's standard library
        _interpreted = isinstance(probe, InterpretedFunction) if probe is not None else interpreting()
    return _interpreted


_FIX = ("Set TRITON_INTERPRET=1 before openm3 or triton is first imported (in the shell, or at the top of the "
        "script), or run the reference backend (OPENM3_MSA_BACKEND=reference, msa.set_backend('reference') or "
        "`with msa.use_backend('reference'):`)")


def triton_unavailable(on_cpu: bool) -> str | None:
    """Why the Triton kernels cannot run on tensors on the CPU (`on_cpu`) or on a GPU in this process, or None when
    they can."""
    imported, wanted = triton_interpreted(), interpreting()
    value = os.environ.get("TRITON_INTERPRET")
    if imported is not None and imported != wanted:
        return (f"TRITON_INTERPRET changed after triton was imported: it is {value!r} now, while triton was "
                f"imported {'with' if imported else 'without'} its CPU interpreter (Triton reads the variable only "
                f"at its first import, so the kernels would fail inside Triton). {_FIX}.")
    if on_cpu and not wanted:
        return ("the Triton kernels run on CPU tensors only under Triton's CPU interpreter, which is off "
                f"(TRITON_INTERPRET={value!r}). {_FIX}, or move the tensors to a CUDA GPU.")
    return None


def _on_cuda(x) -> bool:
    # (not a tensor: the op's own checks reject it, naming the argument)
    return isinstance(x, torch.Tensor) and x.is_cuda


def _choice(x: torch.Tensor) -> tuple[str, str]:
    """(backend, what chose it)."""
    if _scoped is not None:
        return _scoped, f"use_backend({_scoped!r})"
    if _process is not None:
        return _process, f"set_backend({_process!r})"
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_name(env, f"environment variable {ENV_VAR}"), f"{ENV_VAR}={env}"
    return ("triton" if _on_cuda(x) else "reference"), "the automatic choice"


def pick_backend(x: torch.Tensor) -> str:
    """Backend ('reference' or 'triton') for an op whose main input is `x` (the order of choice is in the module
    docstring). Raises ValueError when the choice is 'triton' for a CPU tensor and Triton's CPU interpreter is not
    active."""
    name, source = _choice(x)
    if name == "triton" and isinstance(x, torch.Tensor) and not x.is_cuda:
        reason = triton_unavailable(on_cpu=True)
        if reason is not None:
            raise ValueError(f"{source} picks the Triton MSA backend for a tensor on {x.device}, but {reason}")
    return name


def set_backend(name: str | None) -> None:
    """Force the MSA backend ('reference' or 'triton') for the whole process, until the next call; None returns to
    `OPENM3_MSA_BACKEND` or the automatic choice. An entered `use_backend` block still wins inside it."""
    global _process
    _process = _check_name(name, "set_backend")


class use_backend(contextlib.ContextDecorator):
    """Force the MSA backend ('reference' or 'triton') inside a `with` block or a decorated function; None lifts
    an outer block's choice there (then `set_backend`, `OPENM3_MSA_BACKEND` or the automatic choice apply).

        with msa.use_backend("reference"):
            o, lse = msa.sparse_attention(...)

    Nothing changes until the object is entered: a plain `msa.use_backend("triton")` statement has no effect (it
    warns when the object is discarded unentered); use `set_backend` for that. Reentrant: one object may be
    entered again while entered (a decorated function calling itself)."""

    def __init__(self, name: str | None):
        self._entered = True  # no warning for an object whose name was refused
        self.name = _check_name(name, "use_backend")
        self._entered = False
        self._saved: list[str | None] = []

    def __enter__(self) -> "use_backend":
        global _scoped
        self._entered = True
        self._saved.append(_scoped)
        _scoped = self.name
        return self

    def __exit__(self, *exc) -> bool:
        global _scoped
        _scoped = self._saved.pop()
        return False

    def __call__(self, func):
        self._entered = True  # a decorator enters it at every call of the function
        return super().__call__(func)

    def __del__(self):
        if not self._entered and warnings is not None:  # (module globals may be gone at interpreter exit)
            warnings.warn(f"msa.use_backend({self.name!r}) was never entered, so it changed nothing: use it as "
                          f"`with msa.use_backend({self.name!r}):` or call msa.set_backend({self.name!r}) to "
                          f"switch the whole process", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"
