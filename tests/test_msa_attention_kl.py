"""`sparse_attention_kl` (Triton: indexer KL fused into the attention backward) against the reference composition
`reference.sparse_attention` + `reference.indexer_kl(q.detach(), k.detach(), qi, ki, ..., lse=lse.detach())`.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors in fp32; shapes are tiny
because the interpreter is slow. The Triton kl is written by the backward when qi / ki need gradients, so it is
read after backward here (that is the documented contract).
"""

from __future__ import annotations

import os

import pytest
import torch

from openm3.ops import msa
from openm3.ops.msa import reference, triton_attention
from openm3.ops.msa.backend import use_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def make_case(lens, hq, hkv, d, di, bs, topk, klens=None, seed=0):
    """Random q, k, v, qi, ki and the reference selection of qi, ki (tie-free)."""
    gen = torch.Generator().manual_seed(seed)
    klens = klens or lens
    cu_q, cu_k = cu(lens), cu(klens)
    t, tk = sum(lens), sum(klens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q, k, v = randn(t, hq, d), randn(tk, hkv, d), randn(tk, hkv, d)
    qi, ki = randn(t, hkv, di), randn(tk, di)
    block_idx = reference.select_blocks(qi, ki, cu_q, block_size=bs, topk=topk, cu_seqlens_k=cu_k)
    return dict(q=q, k=k, v=v, qi=qi, ki=ki, block_idx=block_idx, cu_q=cu_q, cu_k=cu_k, bs=bs)


def run(case, backend: str, kl_coef: float = 1.0, seed: int = 1, index_scale=None):
    """(o, lse, kl, dq, dk, dv, dqi, dki) for loss = sum(o * dO) + kl_coef * kl, kl read after backward."""
    do = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    x = {n: case[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "qi", "ki")}
    with use_backend(backend):
        o, lse, kl = msa.sparse_attention_kl(x["q"], x["k"], x["v"], x["qi"], x["ki"], case["block_idx"],
                                             case["cu_q"], block_size=case["bs"], cu_seqlens_k=case["cu_k"],
                                             index_scale=index_scale)
        ((o * do).sum() + kl_coef * kl).backward()
    return (o.detach(), lse, kl.detach()) + tuple(x[n].grad for n in ("q", "k", "v", "qi", "ki"))


NAMES = ("o", "lse", "kl", "dq", "dk", "dv", "dqi", "dki")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_match(ours, ref, tol=1e-4):
    for name, a, b in zip(NAMES, ours, ref):
        if name == "lse":
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), "lse: -inf rows differ"
            a, b = a[finite], b[finite]
        assert rel_err(a, b) <= tol, f"{name}: relative error {rel_err(a, b):.2e} > {tol}"


# lens, kv lens, Hq, Hkv, D, Di, block, topk: group sizes 1, 3 (not a power of two), 4, 16; lengths not multiples
# of the block; the last case has cu_seqlens_k != cu_seqlens (queries are the last tokens of their sequences).
CASES = [
    ((40, 97, 66), None, 4, 4, 16, 8, 16, 3),
    ((40, 97, 66), None, 6, 2, 16, 24, 16, 3),
    ((40, 97, 66), None, 16, 4, 16, 8, 16, 3),
    ((40, 97, 66), None, 16, 1, 32, 16, 32, 3),
    ((70, 25), (121, 25), 8, 2, 16, 8, 16, 4),
]


def case_id(c):
    lens, klens, hq, hkv, d, di, bs, topk = c
    kv = f"-Tk{sum(klens)}" if klens else ""
    return f"B{len(lens)}-T{sum(lens)}{kv}-Hq{hq}-Hkv{hkv}-D{d}-Di{di}-bs{bs}-k{topk}"


@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_matches_reference_composition(c):
    lens, klens, hq, hkv, d, di, bs, topk = c
    case = make_case(lens, hq, hkv, d, di, bs, topk, klens)
    assert (case["block_idx"] >= 0).sum(-1).max() > 1, "selection must contain more than the own block"
    ours, ref = run(case, "triton"), run(case, "reference")
    assert ref[2] > 0.01, "the KL must not be trivially 0"
    assert_match(ours, ref)


@pytest.mark.parametrize("launch, bs", [
    ("dq_in_dkdv=1,dkdv_block_m=16,dkdv_max_tokens=8", 16),
    ("dq_in_dkdv=1,dkdv_block_m=32,dkdv_block_n=16", 32),
    ("dkdv_block_m=32,dkdv_block_n=16,dkdv_max_tokens=5", 32),
], ids=["B2-T105-Hq16-Hkv2-bs16-one-token-steps-fused-dq-split-blocks",
        "B2-T105-Hq16-Hkv2-bs32-two-token-steps-fused-dq-two-subtiles",
        "B2-T105-Hq16-Hkv2-bs32-two-token-steps-dq-pass-subtiles-split-blocks"])
def test_gpu_launch_shapes(launch, bs, monkeypatch):
    """The GPU tilings: 1 or 2 tokens per step (token columns padded to 16), dq fused into dk/dv (atomics) or in
    its own pass, key blocks in several sub-tiles, hot blocks split over programs (dki, dk, dv atomics)."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    case = make_case((45, 60), 32, 2, 16, 16, bs, 3, seed=3)
    assert_match(run(case, "triton"), run(case, "reference"))


def test_fused_dq_falls_back_to_the_dq_pass_above_its_workspace_limit(monkeypatch):
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", "dq_in_dkdv=1,dkdv_block_m=16")
    monkeypatch.setattr(triton_attention, "FUSED_DQ_MAX_BYTES", 0)
    called, real_dq_pass = [], triton_attention._dq_pass
    monkeypatch.setattr(triton_attention, "_dq_pass", lambda *a: called.append(1) or real_dq_pass(*a))
    case = make_case((45, 60), 16, 1, 16, 8, 16, 3, seed=5)
    ours = run(case, "triton")
    assert called, "the separate dq pass must run above the workspace limit"
    assert_match(ours, run(case, "reference"))


def test_kl_gradients_scale_with_its_incoming_gradient():
    """loss = sum(o * dO) + 0.3 kl: dqi, dki are 0.3 x those of kl alone, the attention's gradients unchanged;
    an explicit index_scale is honoured too."""
    case = make_case((50, 37), 8, 2, 16, 8, 16, 3, seed=7)
    ours, ref = run(case, "triton", kl_coef=0.3, index_scale=0.2), run(case, "reference", kl_coef=0.3,
                                                                       index_scale=0.2)
    assert_match(ours, ref)
    unit = run(case, "triton", kl_coef=1.0, index_scale=0.2)
    for name, a, b in zip(NAMES[6:], ours[6:], unit[6:]):
        assert rel_err(a, 0.3 * b) <= 1e-5, name
    for name, a, b in zip(NAMES[:6], ours[:6], unit[:6]):
        assert torch.equal(a, b) or rel_err(a, b) <= 1e-6, name


def test_kl_is_written_by_the_backward():
    """With gradients into qi / ki the forward returns kl = 0 and the backward writes the value, even when only
    the attention output is in the loss (kl's incoming gradient 0: dqi = dki = 0)."""
    case = make_case((50, 37), 8, 2, 16, 8, 16, 3, seed=8)
    ref_kl = run(case, "reference")[2]
    x = {n: case[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "qi", "ki")}
    with use_backend("triton"):
        o, _, kl = msa.sparse_attention_kl(x["q"], x["k"], x["v"], x["qi"], x["ki"], case["block_idx"],
                                           case["cu_q"], block_size=16)
    assert kl.item() == 0.0
    o.sum().backward()
    assert rel_err(kl, ref_kl) <= 1e-4
    assert torch.all(x["qi"].grad == 0) and torch.all(x["ki"].grad == 0)


@pytest.mark.parametrize("mode", ["no_grad", "index_frozen"])
def test_kl_value_without_index_gradients(mode):
    """No gradient into qi / ki: kl is computed in the forward (triton_kl) and valid at once; with q, k, v still
    requiring grad their gradients are the attention's."""
    case = make_case((40, 97, 66), 16, 4, 16, 8, 16, 3, seed=9)
    ref = run(case, "reference")
    x = {n: case[n].detach().clone().requires_grad_(mode == "index_frozen" and n in "qkv") for n in
         ("q", "k", "v", "qi", "ki")}
    with use_backend("triton"), torch.set_grad_enabled(mode != "no_grad"):
        o, lse, kl = msa.sparse_attention_kl(x["q"], x["k"], x["v"], x["qi"], x["ki"], case["block_idx"],
                                             case["cu_q"], block_size=16)
    assert not kl.requires_grad
    assert rel_err(kl, ref[2]) <= 1e-4
    assert rel_err(o.detach(), ref[0]) <= 1e-4
    if mode == "index_frozen":
        do = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        ((o * do).sum() + kl).backward()
        for name, a, b in zip(("dq", "dk", "dv"), (x["q"].grad, x["k"].grad, x["v"].grad), ref[3:6]):
            assert rel_err(a, b) <= 1e-4, name


def test_bad_index_inputs_raise_value_error():
    case = make_case((20, 20), 4, 2, 16, 8, 16, 2)
    args = lambda **kw: {**{n: case[n] for n in ("q", "k", "v", "qi", "ki", "block_idx")}, **kw}  # noqa: E731
    with use_backend("triton"):
        for bad, match in ((args(qi=case["qi"][:, :1]), "Hi"), (args(ki=case["ki"][:, :4]), "ki"),
                           (args(qi=case["qi"].double(), ki=case["ki"].double()), "qi")):
            with pytest.raises(ValueError, match=match):
                msa.sparse_attention_kl(bad["q"], bad["k"], bad["v"], bad["qi"], bad["ki"], bad["block_idx"],
                                        case["cu_q"], block_size=16)
        with pytest.raises(ValueError, match="index_scale"):
            msa.sparse_attention_kl(*(case[n] for n in ("q", "k", "v", "qi", "ki", "block_idx")), case["cu_q"],
                                    block_size=16, index_scale=-1.0)


def test_backward_op_passes_opcheck():
    """Schema (the kl buffer is the one mutated argument) and fake implementation are consistent."""
    case = make_case((20, 13), 4, 2, 16, 8, 16, 2)
    q, k, v, qi, ki = (case[n] for n in ("q", "k", "v", "qi", "ki"))
    o, lse = torch.ops.openm3.msa_sparse_attn_fwd(q, k, v, case["block_idx"], case["cu_q"], case["cu_k"], 16, 0.25)
    kl = torch.zeros((), dtype=torch.float32, device=DEVICE)
    torch.library.opcheck(torch.ops.openm3.msa_sparse_attn_kl_bwd.default,
                          (torch.randn_like(o), q, k, v, o, lse, qi, ki, case["block_idx"], case["cu_q"],
                           case["cu_k"], kl, 16, 0.25, 0.3),
                          test_utils=("test_schema", "test_faketensor"))


_SM90_COMPILE = r'''
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from openm3.ops.msa import triton_attention as ta
from openm3.ops.msa.triton_common import attention_launch

BF16 = {"Q", "K", "V", "DO", "QI", "KI"}
FP32 = {"LSE", "DELTA", "DK", "DV", "DQ", "LSE_Z", "DQI", "DKI", "LOSS"}

def signature(fn, consts):
    def kind(name):
        if name in BF16:
            return "*bf16"
        if name in FP32:
            return "*fp32"
        if name.isupper() and name != "T":
            return "*i32"
        return "fp32" if name in ("qk_scale", "sm_scale", "index_scale", "grad_coef") else "i32"
    sig = {n: "constexpr" if n in consts else kind(n) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    return sig, attrs

def usage(cubin):
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+)", text))

for group, over in ((16, ""), (16, "dkdv_block_n=64"), (16, "dq_in_dkdv=0"), (4, ""), (1, "")):
    launch = attention_launch(group, 128, 128, torch.bfloat16, on_gpu=True,
                              **{k: int(v) for k, v in (x.split("=") for x in over.split(",") if x)})
    tokens = launch.dkdv_tokens(group)
    consts = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32", WHILE_LOOPS=False,
                  NUM_HEADS=4 * group, FUSE_DQ=bool(launch.dq_in_dkdv), BLOCK_M=launch.dkdv_block_m,
                  BLOCK_N=launch.dkdv_block_n, TOKENS=tokens, INDEX_DIM=128, BLOCK_DI=128,
                  TQ=max(16, triton.next_power_of_2(tokens)), P_PRECISION="tf32x3", INDEX_PRECISION="tf32")
    fn = ta._attn_dkdv_kernel_kl
    sig, attrs = signature(fn, consts)
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=launch.dkdv_num_warps, num_stages=launch.dkdv_num_stages))
    assert k.asm["cubin"]
    print(fn.__name__, group, over or "default", usage(k.asm["cubin"]), "ok")
'''


def test_kl_kernel_compiles_for_sm90():
    """The interpreter accepts programs a GPU compiler rejects (tl.dot below 16 rows, layouts): compile the KL
    dk/dv kernel for an H100/H200 (sm_90) with the GPU launch configs, without a GPU (Triton's bundled ptxas).
    Prints registers / spill stack per variant (pytest -s)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert proc.stdout.count(" ok") == 5, proc.stdout
