"""Triton sparse attention on a CUDA GPU, M3 shape, bf16: errors against the fp32 reference must stay within 2x the
error of a bf16 PyTorch computation of the same attention (the flash-attention test bound).

    .venv/bin/python -m pytest -q tests/gpu/test_msa_attention_gpu.py

To keep the fp32 reference cheap at 128K tokens, the reference and the bf16 computation handle only the last
`TAIL` queries (a bottom-right aligned sub-problem via cu_seqlens_k); the kernel runs on the whole sequence with
dO zero outside the tail, so its dk, dv must equal the sub-problem's too.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
TAIL = 1024


def random_selection(t: int, seed: int, share: int = 16) -> torch.Tensor:
    """A valid block_idx [HKV, t, TOPK]: own block first, then distinct earlier blocks drawn per run of `share`
    consecutive tokens (neighbouring queries pick overlapping blocks), -1 trailing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    own = torch.arange(t, device="cuda") // BLOCK
    first_own = (torch.arange(t, device="cuda") // share * share) // BLOCK
    draws = torch.rand(HKV, -(-t // share), TOPK - 1, device="cuda", generator=gen)
    draws = draws.repeat_interleave(share, dim=1)[:, :t]
    picks = (draws * first_own.view(1, t, 1)).long()  # in [0, first_own): strictly before own block
    picks = torch.where(first_own.view(1, t, 1) > 0, picks, -1)
    picks = picks.sort(dim=-1, descending=True).values
    dup = torch.zeros_like(picks, dtype=torch.bool)
    dup[..., 1:] = picks[..., 1:] == picks[..., :-1]
    picks = torch.where(dup | (picks == own.view(1, t, 1)), -1, picks).sort(dim=-1, descending=True).values
    return torch.cat([own.view(1, t, 1).expand(HKV, t, 1), picks], dim=-1).to(torch.int32).contiguous()


def bf16_attention(q, k, v, block_idx, positions):
    """Sparse attention computed with bf16 PyTorch ops (gathered keys). q: [n, Hq, D] bf16 at key positions
    `positions` [n]; k, v: [Tk, Hkv, D]; block_idx: [Hkv, n, topk]. Returns o [n, Hq, D], lse [n, Hq] fp32."""
    n, g = q.shape[0], q.shape[1] // HKV
    offs = torch.arange(BLOCK, device=q.device)
    keys = (block_idx.clamp_min(0).long().unsqueeze(-1) * BLOCK + offs).flatten(2)  # [Hkv, n, topk * BLOCK]
    ok = (block_idx >= 0).repeat_interleave(BLOCK, dim=-1) & (keys <= positions.view(1, n, 1))
    outs, lses = [], []
    for h in range(HKV):
        kk = k[:, h][keys[h].clamp_max(k.shape[0] - 1)]  # [n, L, D]
        vv = v[:, h][keys[h].clamp_max(k.shape[0] - 1)]
        qq = q[:, h * g:(h + 1) * g]  # [n, g, D]
        s = torch.einsum("ngd,nld->ngl", qq, kk) * (1 / math.sqrt(D))
        s = s.masked_fill(~ok[h].unsqueeze(1), float("-inf"))
        lses.append(torch.logsumexp(s.float(), dim=-1))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("ngl,nld->ngd", p, vv))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@pytest.mark.parametrize("t", [4096, 32768, 131072], ids=lambda t: f"B1-T{t}-Hq64-Hkv4-D128-bs128-k16")
def test_bf16_within_twice_torch_bf16_error(t):
    check_bf16_bound(t)


# Every kernel layout the launch config can pick (triton_common.AttentionLaunch), at one mid-size shape.
LAUNCH_VARIANTS = [
    "tma=1,block_m=16,block_n=64,dkdv_block_n=128,dkdv_block_m=32",
    "tma=1,block_m=64,block_n=64,num_warps=4,num_stages=3,dq_block_m=16,dkdv_block_m=16,dkdv_num_warps=4",
    "dq_in_dkdv=1,dkdv_block_n=128,dkdv_block_m=16",
    "dq_in_dkdv=1,dkdv_block_n=64,dkdv_block_m=32,dkdv_max_tokens=64",
    "tma=0,block_m=128,block_n=64,num_warps=8,dq_block_m=32,dkdv_block_m=64",
    "dq_in_dkdv=1,dq_transposed=0,dkdv_block_n=128,dkdv_block_m=32",
    # the hybrid forward with every tile's union too wide (its one-token pass only; the default walks unions here)
    "block_m=64,union_max=1",
    "block_m=16,union_max=0",  # the one-token forward (the G = 16 default before session 16)
]


@pytest.mark.parametrize("launch", ["", "dq_transposed=0"], ids=["defaults", "dq-not-transposed"])
def test_small_group_defaults_within_twice_torch_bf16_error(launch, monkeypatch):
    """m3-small's attention shape (16 query heads, 4 KV heads): its GPU default tiles 16 tokens over their union."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    check_bf16_bound(16384, hq=16)


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS, ids=lambda c: "B1-T8192-Hq64-Hkv4-D128-" + c.replace(",", "-"))
def test_launch_variants_within_twice_torch_bf16_error(launch, monkeypatch):
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    check_bf16_bound(8192)


def check_bf16_bound(t: int, hq: int = HQ) -> None:
    """Kernel vs fp32 reference error <= 2x (bf16 PyTorch vs fp32 reference) for o, lse, dq, dk, dv."""
    from openm3.ops.msa import reference
    from openm3.ops.msa.triton_attention import sparse_attention

    torch.manual_seed(0)
    q = torch.randn(t, hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block_idx = random_selection(t, seed=1)
    cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
    o, lse = sparse_attention(q, k, v, block_idx, cu, block_size=BLOCK)
    tail = slice(t - TAIL, t)
    do = torch.zeros_like(o)
    do[tail] = torch.randn(TAIL, hq, D, device="cuda", dtype=torch.bfloat16)
    o.backward(do)

    cu_q = torch.tensor([0, TAIL], device="cuda", dtype=torch.int32)
    sub_idx = block_idx[:, tail].contiguous()
    qr, kr, vr = (x.detach().float().requires_grad_(True) for x in (q, k, v))
    o_ref, lse_ref = reference.sparse_attention(qr[tail], kr, vr, sub_idx, cu_q, block_size=BLOCK, cu_seqlens_k=cu)
    o_ref.backward(do[tail].float())

    qb, kb, vb = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    positions = torch.arange(t - TAIL, t, device="cuda")
    o_pt, lse_pt = bf16_attention(qb[tail], kb, vb, sub_idx, positions)
    o_pt.backward(do[tail])

    def err(a, b):
        return (a.float() - b.float()).abs().max().item()

    pairs = {
        "o": (o[tail], o_pt, o_ref), "lse": (lse[tail], lse_pt, lse_ref),
        "dq": (q.grad[tail], qb.grad[tail], qr.grad[tail]), "dk": (k.grad, kb.grad, kr.grad),
        "dv": (v.grad, vb.grad, vr.grad),
    }
    report = {name: (err(ours, ref), err(pt, ref)) for name, (ours, pt, ref) in pairs.items()}
    print(f"T={t}", {n: f"ours {a:.2e} / bf16 torch {b:.2e}" for n, (a, b) in report.items()})
    for name, (ours_err, pt_err) in report.items():
        assert ours_err <= 2 * pt_err + 1e-5, f"{name}: kernel error {ours_err:.3e} > 2 x bf16 error {pt_err:.3e}"


def test_compiles_under_torch_compile():
    """The op traces through torch.compile (custom_op + fake) and gives the eager result."""
    from openm3.ops.msa.triton_attention import sparse_attention

    t = 1000
    torch.manual_seed(0)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block_idx = random_selection(t, seed=2)
    cu = torch.tensor([0, 600, t], device="cuda", dtype=torch.int32)
    block_idx = _relative_to_sequences(block_idx, cu)

    def f(q, k, v):
        o, lse = sparse_attention(q, k, v, block_idx, cu, block_size=BLOCK)
        return (o.float() * 2).sum() + lse.sum()

    eager = f(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(f)(q, k, v)
    g_comp = torch.autograd.grad(compiled, (q, k, v))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


def _relative_to_sequences(block_idx: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Rebuild a selection valid for each sequence of `cu`: own block (relative) plus earlier blocks of the same
    sequence."""
    t = block_idx.shape[1]
    pos = torch.arange(t, device=cu.device)
    seq = torch.searchsorted(cu.long(), pos, right=True) - 1
    rel = pos - cu.long()[seq]
    own = (rel // BLOCK).view(1, t, 1)
    shifted = block_idx.long() - (cu.long()[seq] // BLOCK).view(1, t, 1)
    keep = (shifted >= 0) & (shifted < own)
    picks = torch.where(keep, shifted, -1)[..., 1:]
    picks = picks.sort(dim=-1, descending=True).values
    dup = torch.zeros_like(picks, dtype=torch.bool)
    dup[..., 1:] = picks[..., 1:] == picks[..., :-1]
    picks = torch.where(dup, -1, picks).sort(dim=-1, descending=True).values
    return torch.cat([own.expand(block_idx.shape[0], t, 1), picks], dim=-1).to(torch.int32).contiguous()
