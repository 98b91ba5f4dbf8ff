"""`sparse_attention_kl` (indexer KL fused into the attention backward) on a CUDA GPU, M3 shape, bf16.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_msa_attention_kl_gpu.py -s

1. Accuracy: the last `TAIL` queries of a T-token sequence as a bottom-right aligned sub-problem (cu_seqlens_k =
   [0, T]: every key of the sequence, the queries' real positions), cheap for the fp32 reference at any T. o, lse,
   dq, dk, dv, kl, dqi, dki against the fp32 reference composition (`reference.sparse_attention` +
   `reference.indexer_kl(..., lse=lse)`) must stay within 2x the error of the same computation in bf16 PyTorch
   (`bf16_attention` of tests/gpu/test_msa_attention_gpu.py, `benchmarks.msa_select_kl.kl_bf16_torch`), the
   flash-attention test bound. Also under the launch variants the KL path is tuned with.
2. Consistency on a whole 32K sequence (hot blocks split over programs, fused dq): the fused op against the unfused
   pair `sparse_attention` + `triton_kl.indexer_kl` on the same inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks`
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the attention GPU test's bf16 baseline and selections

pytestmark = pytest.mark.gpu

HQ, HKV, D, DI, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
TAIL = 512


def m3_inputs(t: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    return randn(t, HQ, D), randn(t, HKV, D), randn(t, HKV, D), randn(t, HKV, DI), randn(t, DI)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_tail(t: int) -> None:
    from test_msa_attention_gpu import bf16_attention, random_selection

    from benchmarks.msa_select_kl import kl_bf16_torch
    from openm3.ops import msa
    from openm3.ops.msa.backend import use_backend

    q, k, v, qi, ki = m3_inputs(t)
    tail = slice(t - TAIL, t)
    sub_idx = random_selection(t, seed=1)[:, tail].contiguous()
    cu_q = torch.tensor([0, TAIL], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, t], device="cuda", dtype=torch.int32)
    do = torch.randn(TAIL, HQ, D, device="cuda", dtype=torch.bfloat16)
    kw = dict(block_size=BLOCK, cu_seqlens_k=cu_k)

    def fused(dtype, backend):
        x = [a.detach().to(dtype).requires_grad_(True) for a in (q[tail], k, v, qi[tail], ki)]
        with use_backend(backend):
            o, lse, kl = msa.sparse_attention_kl(*x, sub_idx, cu_q, **kw)
            ((o.float() * do.float()).sum() + kl).backward()
        return dict(o=o.detach(), lse=lse, kl=kl.detach(), dq=x[0].grad, dk=x[1].grad, dv=x[2].grad, dqi=x[3].grad,
                    dki=x[4].grad)

    ours, ref = fused(torch.bfloat16, "triton"), fused(torch.float32, "reference")
    # bf16 PyTorch: attention through gathered keys, KL with its own (bf16) lse
    qb, kb, vb = (a.detach().clone().requires_grad_(True) for a in (q[tail], k, v))
    o_pt, lse_pt = bf16_attention(qb, kb, vb, sub_idx, torch.arange(t - TAIL, t, device="cuda"))
    o_pt.backward(do)
    kl_pt, dqi_pt, dki_pt = kl_bf16_torch(q[tail], k, qi[tail], ki, sub_idx, scale=D ** -0.5,
                                          index_scale=DI ** -0.5, lse=lse_pt.detach())
    base = dict(o=o_pt, lse=lse_pt, kl=torch.tensor(kl_pt), dq=qb.grad, dk=kb.grad, dv=vb.grad, dqi=dqi_pt,
                dki=dki_pt)
    report = {n: (rel_err(ours[n].cpu(), ref[n].cpu()), rel_err(base[n].cpu(), ref[n].cpu())) for n in ref}
    print(f"T={t}", {n: f"ours {a:.2e} / bf16 torch {b:.2e}" for n, (a, b) in report.items()})
    for name, (ours_err, pt_err) in report.items():
        assert ours_err <= 2 * pt_err + 1e-6, f"{name}: kernel error {ours_err:.3e} > 2 x bf16 error {pt_err:.3e}"


@pytest.mark.parametrize("t", [4096, 32768], ids=lambda t: f"T{t}-Hq64-Hkv4-D128-Di128-bs128-top16")
def test_m3_bf16_within_twice_torch_bf16_error(t):
    check_tail(t)


# The launch variants the KL path is tuned with (registers: the default spills ~330 B per thread at 255
# registers; 64-key sub-tiles ~64 B; 64-key sub-tiles with one-token steps none), and dq in its own pass.
LAUNCH_VARIANTS = ["dkdv_block_n=64", "dkdv_block_n=64,dkdv_block_m=16", "dq_in_dkdv=0",
                   "dkdv_max_tokens=64"]


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS, ids=lambda c: "T8192-" + c.replace(",", "-"))
def test_launch_variants_within_twice_torch_bf16_error(launch, monkeypatch):
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    check_tail(8192)


def test_whole_sequence_matches_the_unfused_ops():
    """At 32K on the whole sequence (hot early blocks split over programs): fused vs `sparse_attention` +
    `triton_kl.indexer_kl` with the kernel's lse. Same arithmetic for o, dq, dk, dv (up to atomic-add order); the KL
    gradients differ by where each kernel rounds dz = r - p to bf16 before its dots."""
    from openm3.ops.msa.triton_attention import sparse_attention, sparse_attention_kl
    from openm3.ops.msa.triton_kl import indexer_kl
    from test_msa_attention_gpu import random_selection

    t = 32768
    q, k, v, qi, ki = m3_inputs(t, seed=3)
    block_idx = random_selection(t, seed=4)
    cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
    do = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fused in (True, False):
        x = [a.detach().clone().requires_grad_(True) for a in (q, k, v, qi, ki)]
        if fused:
            o, lse, kl = sparse_attention_kl(*x, block_idx, cu, block_size=BLOCK)
        else:
            o, lse = sparse_attention(*x[:3], block_idx, cu, block_size=BLOCK)
            kl = indexer_kl(x[0].detach(), x[1].detach(), x[3], x[4], block_idx, cu, block_size=BLOCK,
                            lse=lse.detach())
        torch.autograd.backward([o, kl], [do, torch.ones_like(kl)])
        outs.append([o.detach(), lse, kl.detach()] + [a.grad for a in x])
    names = ("o", "lse", "kl", "dq", "dk", "dv", "dqi", "dki")
    tol = dict(o=0.0, lse=0.0, kl=1e-4, dq=1e-3, dk=1e-3, dv=1e-3, dqi=2e-2, dki=2e-2)
    errs = {n: rel_err(a, b) for n, a, b in zip(names, *outs)}
    print("fused vs unfused, T=32768:", {n: f"{e:.2e}" for n, e in errs.items()})
    for name, err in errs.items():
        assert err <= tol[name], f"{name}: fused vs unfused relative error {err:.3e} > {tol[name]}"
