"""The public MSA API (`openm3.ops.msa`): backend choice (`pick_backend`, `set_backend`, `use_backend`), the Triton
entry points' refusals where they cannot run or would return wrong numbers (CPU tensors without Triton's
interpreter, TRITON_INTERPRET set after triton was imported, bf16 under the interpreter), the wrappers' signatures
against the reference's, their docstrings, and the module names the kernel docs cite.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest sets it); the cases without the
interpreter run in subprocesses, since Triton reads the variable once, at its first import.
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of a Triton kernel module

import pytest  # noqa: E402

from openm3.ops import msa  # noqa: E402
from openm3.ops.msa import backend, reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ("select_blocks", "sparse_attention", "indexer_kl", "sparse_attention_with_kl")
# Triton 3.6's interpreter converts 1-element arrays to loop bounds (NumPy deprecates it).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
interpreter_only = pytest.mark.skipif(not backend.interpreting(), reason="needs Triton's CPU interpreter")


@pytest.fixture(autouse=True)
def no_process_backend():
    """Every test starts and ends without a `set_backend` choice."""
    msa.set_backend(None)
    yield
    msa.set_backend(None)


def case(dtype=torch.float32, lens=(40, 30), heads=2, dim=16, seed=0):
    """Inputs of every op: q [T, 2*heads, dim], k, v [T, heads, dim], qi [T, heads, dim], ki [T, dim], cu_seqlens,
    and the reference selection (block 16, top-2)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, dim, generator=gen) for h in (2 * heads, heads, heads))
    qi, ki = torch.randn(t, heads, dim, generator=gen), torch.randn(t, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    block_idx = reference.select_blocks(qi, ki, cu, block_size=16, topk=2)
    out = dict(q=q, k=k, v=v, qi=qi, ki=ki)
    out = {name: x.to(device=DEVICE, dtype=dtype) for name, x in out.items()}
    return out | dict(cu=cu.to(DEVICE), block_idx=block_idx.to(DEVICE))


# ---------------------------------------------------------------------------------------------------------------
# Choosing the backend


def test_backend_order_of_choice(monkeypatch):
    """use_backend block > set_backend > OPENM3_MSA_BACKEND > automatic; blocks nest and restore; None lifts."""
    x = torch.zeros(1, device=DEVICE)
    auto = "triton" if x.is_cuda else "reference"
    monkeypatch.delenv("OPENM3_MSA_BACKEND", raising=False)
    assert msa.pick_backend(x) == auto
    monkeypatch.setenv("OPENM3_MSA_BACKEND", "triton")
    assert msa.pick_backend(x) == "triton"
    msa.set_backend("reference")
    assert msa.pick_backend(x) == "reference"
    with msa.use_backend("triton"):
        assert msa.pick_backend(x) == "triton"
        msa.set_backend("reference")  # the block still wins; the process choice holds after it
        with msa.use_backend(None):
            assert msa.pick_backend(x) == "reference"
        with msa.use_backend("reference"):
            assert msa.pick_backend(x) == "reference"
        assert msa.pick_backend(x) == "triton"
    assert msa.pick_backend(x) == "reference"
    msa.set_backend(None)
    assert msa.pick_backend(x) == "triton"
    monkeypatch.delenv("OPENM3_MSA_BACKEND")
    assert msa.pick_backend(x) == auto


def test_backend_names_are_checked(monkeypatch):
    with pytest.raises(ValueError, match=r"set_backend: the MSA backend must be one of \('reference', 'triton'\)"):
        msa.set_backend("cuda")
    with pytest.raises(ValueError, match="use_backend: the MSA backend must be one of"):
        msa.use_backend("Triton")
    monkeypatch.setenv("OPENM3_MSA_BACKEND", "fast")
    with pytest.raises(ValueError, match="environment variable OPENM3_MSA_BACKEND: .* got 'fast'"):
        msa.pick_backend(torch.zeros(1))


def test_use_backend_as_a_plain_statement_warns_and_changes_nothing():
    x = torch.zeros(1)
    with pytest.warns(RuntimeWarning, match=r"use_backend\('triton'\) was never entered.*set_backend\('triton'\)"):
        msa.use_backend("triton")
        gc.collect()
    assert msa.pick_backend(x) == "reference"


def test_use_backend_entered_or_decorating_does_not_warn():
    seen = []

    @msa.use_backend("reference")
    def depth(n: int) -> None:  # re-enters the same object while it is entered
        seen.append(msa.pick_backend(torch.zeros(1, device=DEVICE)))
        if n:
            depth(n - 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with msa.use_backend("reference"):
            pass
        depth(2)
        depth = None  # the decorating object goes with the function: no warning either
        gc.collect()
    assert seen == ["reference"] * 3 and backend._scoped is None


# ---------------------------------------------------------------------------------------------------------------
# Where the Triton kernels cannot run


_NO_INTERPRETER = r'''
import os, sys
import torch
late = sys.argv[1] == "late"
import openm3.models  # imports triton (through the fused kernels) without the interpreter
if late:
    os.environ["TRITON_INTERPRET"] = "1"
from openm3.ops import msa
from openm3.ops.msa import reference, triton_decode, triton_select
gen = torch.Generator().manual_seed(0)
q, k = torch.randn(48, 4, 16, generator=gen), torch.randn(48, 2, 16, generator=gen)
qi, ki, cu = torch.randn(48, 2, 16, generator=gen), torch.randn(48, 16, generator=gen), torch.tensor([0, 48]).int()
block_idx = reference.select_blocks(qi, ki, cu, block_size=16, topk=2)
pages, table, lens = torch.randn(3, 16, 2, 16), torch.arange(3).int()[None], torch.tensor([48]).int()

def run(label, fn):
    try:
        fn()
        print(label, "| ok")
    except Exception as e:
        print(label, "|", type(e).__name__, "|", str(e).replace("\n", " "))

run("auto", lambda: msa.select_blocks(qi, ki, cu, block_size=16, topk=2))  # CPU: the reference
def scoped():
    with msa.use_backend("triton"):
        msa.select_blocks(qi, ki, cu, block_size=16, topk=2)
run("use_backend", scoped)
msa.set_backend("triton")
run("set_backend", lambda: msa.sparse_attention(q, k, k, block_idx, cu, block_size=16))
msa.set_backend(None)
os.environ["OPENM3_MSA_BACKEND"] = "triton"
run("env", lambda: msa.indexer_kl(q, k, qi, ki, block_idx, cu, block_size=16))
del os.environ["OPENM3_MSA_BACKEND"]
run("select_kernel", lambda: triton_select.select_blocks(qi, ki, cu, block_size=16, topk=2))
run("decode_kernel", lambda: triton_decode.decode_attention(q[:1], pages, pages, table, lens, None, q_len=1))
from openm3.ops.moe_experts import expert_linear
from openm3.ops.moe_routing import route_topk, sort_pairs
run("expert_linear", lambda: expert_linear(torch.randn(3, 16), torch.randn(2, 8, 16), torch.tensor([1, 3]).int()))
run("route_topk", lambda: route_topk(torch.randn(3, 4), torch.zeros(4), 2))
run("sort_pairs", lambda: sort_pairs(torch.zeros(3, 2, dtype=torch.long), torch.randn(3, 8), 4))
'''


def _no_interpreter_run(mode: str) -> dict[str, tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OPENM3_MSA_BACKEND")}
    if mode == "off":
        env["TRITON_INTERPRET"] = "0"
    out = subprocess.run([sys.executable, "-c", _NO_INTERPRETER, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if " | " in line]
    return {row[0]: (row[1], row[-1]) for row in rows}


def test_triton_on_cpu_without_the_interpreter_raises_valueerror():
    """Forcing Triton for CPU tensors without TRITON_INTERPRET: a ValueError that names what forced it and how to
    fix it (not Triton's '0 active drivers'); the automatic choice still runs the reference."""
    got = _no_interpreter_run("off")
    assert got.pop("auto") == ("ok", "ok")
    forced = {"use_backend": "use_backend('triton')", "set_backend": "set_backend('triton')",
              "env": "OPENM3_MSA_BACKEND=triton"}
    for label, (kind, msg) in got.items():
        assert kind == "ValueError", (label, kind, msg)
        assert "TRITON_INTERPRET=1 before openm3 or triton is first imported" in msg, (label, msg)
        assert "OPENM3_MSA_BACKEND=reference" in msg and "use_backend('reference')" in msg, (label, msg)
        assert "CPU interpreter, which is off (TRITON_INTERPRET='0')" in msg, (label, msg)
        if label in forced:
            assert msg.startswith(f"{forced[label]} picks the Triton MSA backend for a tensor on cpu"), msg
    assert got["select_kernel"][1].startswith("the Triton MSA kernels got qi on cpu, ki on cpu, but")
    assert got["expert_linear"][1].startswith("the Triton expert_linear kernel got rows on cpu, weight on cpu, but")
    assert got["sort_pairs"][1].startswith("the Triton sort_pairs kernel got x on cpu, but")
    assert set(got) == set(forced) | {"select_kernel", "decode_kernel", "expert_linear", "route_topk", "sort_pairs"}


def test_triton_interpret_set_after_import_raises_valueerror():
    """TRITON_INTERPRET=1 set after `import openm3.models` (which imports triton): a ValueError saying so, not
    Triton's 'Cannot call @triton.jit'd outside of the scope of a kernel'."""
    got = _no_interpreter_run("late")
    assert got.pop("auto") == ("ok", "ok")
    for label, (kind, msg) in got.items():
        assert kind == "ValueError", (label, kind, msg)
        assert "TRITON_INTERPRET changed after triton was imported: it is '1' now, while triton was imported " \
               "without its CPU interpreter" in msg, (label, msg)
        assert "Set TRITON_INTERPRET=1 before openm3 or triton is first imported" in msg, (label, msg)


def _decode_inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    pages = torch.randn(3, 16, 1, 16, generator=gen).to(dtype)
    return dict(q=torch.randn(1, 2, 16, generator=gen).to(dtype), qi=torch.randn(1, 1, 16, generator=gen).to(dtype),
                k_pages=pages, v_pages=pages.clone(), ki_pages=torch.randn(3, 16, 16, generator=gen).to(dtype),
                block_table=torch.arange(3, dtype=torch.int32)[None], seq_lens=torch.tensor([40], dtype=torch.int32))


def _call(entry: str, x: dict, **extra):
    from openm3.ops.msa import triton_decode as td
    kw = dict(block_size=16, **extra)
    if entry == "select_blocks":
        return msa.select_blocks(x["qi"], x["ki"], x["cu"], topk=2, **kw)
    if entry == "sparse_attention":
        return msa.sparse_attention(x["q"], x["k"], x["v"], x["block_idx"], x["cu"], **kw)
    if entry == "indexer_kl":
        return msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], x["block_idx"], x["cu"], **kw)
    if entry == "sparse_attention_with_kl":
        return msa.sparse_attention_with_kl(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["block_idx"], x["cu"], **kw)
    paged = (x["block_table"], x["seq_lens"])
    if entry == "decode_select_blocks":
        return td.decode_select_blocks(x["qi"], x["ki_pages"], *paged, q_len=1, topk=2, **kw)
    if entry == "decode_attention":
        return td.decode_attention(x["q"], x["k_pages"], x["v_pages"], *paged, None, q_len=1)
    return td.decode_msa(x["q"], x["qi"], x["k_pages"], x["v_pages"], x["ki_pages"], *paged, q_len=1, topk=2)


BF16_CASES = {  # entry point -> the bf16 arguments its error names
    "select_blocks": "qi, ki", "sparse_attention": "q, k, v", "indexer_kl": "q, k, qi, ki",
    "sparse_attention_with_kl": "q, k, v", "decode_select_blocks": "qi, ki_pages",
    "decode_attention": "q, k_pages, v_pages", "decode_msa": "q, qi, k_pages, v_pages, ki_pages"}


@interpreter_only
@pytest.mark.parametrize("entry", list(BF16_CASES))
def test_bf16_under_the_interpreter_is_refused(entry):
    """Triton 3.6's interpreter computes tl.dot of bf16 operands wrong (scripts/triton_interpreter_bugs.py):
    every Triton entry point refuses bf16 there instead of returning garbage."""
    x = _decode_inputs(torch.bfloat16) if entry.startswith("decode") else case(torch.bfloat16)
    with msa.use_backend("triton"), pytest.raises(ValueError) as err:
        _call(entry, x)
    msg = str(err.value)
    assert msg.startswith(f"{BF16_CASES[entry]}: bfloat16 is refused by the Triton MSA kernels under Triton's CPU "
                          f"interpreter"), msg
    assert "float32 or float16" in msg and "use_backend('reference')" in msg


@interpreter_only
def test_bf16_inputs_run_on_the_reference_under_the_interpreter():
    """The advice of that error works: the same bf16 call on the reference backend runs and matches fp32."""
    x = case(torch.bfloat16)
    with msa.use_backend("reference"):
        got = _call("select_blocks", x)
    want = reference.select_blocks(x["qi"].float(), x["ki"].float(), x["cu"], block_size=16, topk=2)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# Signatures and docstrings


@pytest.mark.parametrize("name", ["select_blocks", "sparse_attention", "indexer_kl"])
def test_public_signatures_take_every_reference_argument(name):
    public = inspect.signature(getattr(msa, name)).parameters
    for p in inspect.signature(getattr(reference, name)).parameters.values():
        assert p.name in public, f"msa.{name} lacks {p.name!r}"
        assert (public[p.name].kind, public[p.name].default) == (p.kind, p.default), (name, p.name)
    combined = inspect.signature(msa.sparse_attention_with_kl).parameters
    assert {"index_scale", "workspace", "cu_seqlens_k", "validate_block_idx", "index_lse"} <= set(combined)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_select_blocks_takes_index_scale_and_workspace(backend_name, monkeypatch):
    """index_scale reaches the Triton kernel (its index_lse uses it) and workspace is checked on both backends;
    neither changes the selection."""
    x = case()
    kw = dict(block_size=16, topk=2)
    monkeypatch.setenv("OPENM3_SELECT_LAUNCH", "index_lse=1")
    with msa.use_backend(backend_name):
        got, index_lse = msa.select_blocks(x["qi"], x["ki"], x["cu"], index_scale=0.5, workspace=256,
                                           return_index_lse=True, **kw)
        for bad in (0, 2.5, True):
            with pytest.raises(ValueError, match="workspace must be an int >= 1"):
                msa.select_blocks(x["qi"], x["ki"], x["cu"], workspace=bad, **kw)
    assert torch.equal(got, x["block_idx"])
    if backend_name == "reference":
        assert index_lse is None
    else:
        want = reference.index_lse(x["qi"], x["ki"], got, x["cu"], block_size=16, index_scale=0.5)
        torch.testing.assert_close(index_lse, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_workspace_reaches_the_reference(name, monkeypatch):
    """The wrappers hand `workspace` to every reference function they call."""
    x, seen = case(), []
    for fn in ("select_blocks", "sparse_attention", "indexer_kl"):
        def spy(*args, _real=getattr(reference, fn), **kwargs):
            seen.append(kwargs.get("workspace"))
            return _real(*args, **kwargs)
        monkeypatch.setattr(reference, fn, spy)
    with msa.use_backend("reference"):
        _call(name, x, workspace=512)
    assert seen == [512] * (2 if name == "sparse_attention_with_kl" else 1)


def test_public_functions_document_arguments_and_returns():
    for name in msa.__all__:
        obj = getattr(msa, name)
        if callable(obj):
            assert obj.__doc__ and len(obj.__doc__) > 80, name
    for name in OPS:
        doc = getattr(msa, name).__doc__
        assert "Args" in doc and "Returns:" in doc and "[T, " in doc, name


# ---------------------------------------------------------------------------------------------------------------
# Docs


_MODULES = ("triton_common", "triton_select", "triton_attention_kl", "triton_attention", "triton_kl",
            "triton_decode", "reference", "decode", "backend")


def test_kernel_docs_cite_names_where_they_live():
    """`module.name` in docs/kernels_*.md resolves (e.g. select_launch lives in triton_select, not triton_common),
    and the launch-config functions are cited with their module."""
    import importlib
    pattern = re.compile(rf"\b({'|'.join(_MODULES)})\.([A-Za-z_]\w*)")
    cited = 0
    for path in sorted((ROOT / "docs").glob("kernels_*.md")):
        text = path.read_text()
        for mod, attr in pattern.findall(text):
            if attr in ("py", "md"):
                continue
            cited += 1
            assert hasattr(importlib.import_module(f"openm3.ops.msa.{mod}"), attr), f"{path.name}: {mod}.{attr}"
        for fn, mod in (("select_launch", "triton_select"), ("kl_launch", "triton_kl")):
            assert not re.search(rf"(?<![\w.]){fn}\b", text), f"{path.name}: cite {fn} as {mod}.{fn}"
    assert cited >= 4
