"""Compiling Triton kernels for sm_90 without a GPU (shared by the kernel tests; not a test module).

The CPU interpreter runs code that a GPU compile may reject, so the kernel tests also compile their kernels for
Hopper: Triton's front end and the ptxas bundled with its wheel, in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_compile_script(script: str, tmp_path) -> None:
    """Run `script` (Python that compiles kernels and prints "compiled") in a fresh interpreter with its own
    Triton cache; skips when Triton has no bundled ptxas; fails with the script's stderr."""
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
