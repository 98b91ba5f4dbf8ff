"""Triton sparse attention (forward, dq, dk/dv) against the reference, plus its torch-side bookkeeping.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (fp32); with one, the same tests run the
compiled kernels on CUDA tensors. Shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of a Triton kernel module

import pytest  # noqa: E402

from openm3.ops.msa import reference  # noqa: E402
from openm3.ops.msa import triton_attention, triton_common  # noqa: E402
from openm3.ops.msa.triton_attention import sparse_attention  # noqa: E402
from openm3.ops.msa.triton_common import (NO_BLOCK, absolute_block_starts, attention_launch,  # noqa: E402
                                          key_block_work, query_positions, tile_candidates)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def make_case(lens, hq, hkv, d, bs, topk, klens=None, seed=0, local_blocks=1):
    """Random q, k, v and a reference selection from random index vectors (tie-free)."""
    gen = torch.Generator().manual_seed(seed)
    klens = klens or lens
    cu_q, cu_k = cu(lens), cu(klens)
    t, tk = sum(lens), sum(klens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q, k, v = randn(t, hq, d), randn(tk, hkv, d), randn(tk, hkv, d)
    qi, ki = randn(t, hkv, 8), randn(tk, 8)
    block_idx = reference.select_blocks(qi, ki, cu_q, block_size=bs, topk=topk, local_blocks=local_blocks,
                                        cu_seqlens_k=cu_k)
    return q, k, v, block_idx, cu_q, cu_k


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def run_both(q, k, v, block_idx, cu_q, cu_k, bs, seed=1):
    """(o, lse, dq, dk, dv) of the kernel and of the reference for the same random dO."""
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out = []
    for fn in (sparse_attention, reference.sparse_attention):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        o, lse = fn(qq, kk, vv, block_idx, cu_q, block_size=bs, cu_seqlens_k=cu_k)
        o.backward(do)
        out.append((o.detach(), lse, qq.grad, kk.grad, vv.grad))
    return out


def assert_match(ours, ref, tol=1e-4):
    names = ("o", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, ours, ref):
        if name == "lse":
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), "lse: -inf rows differ"
            a, b = a[finite], b[finite]
        assert rel_err(a, b) <= tol, f"{name}: relative error {rel_err(a, b):.2e} > {tol}"


# lens, kv lens, Hq, Hkv, D, block, topk: group sizes 1, 4, 16; lengths not multiples of the block.
CASES = [
    ((40, 97, 66), None, 4, 4, 16, 16, 3),
    ((40, 97, 66), None, 16, 4, 16, 16, 3),
    ((40, 97, 66), None, 16, 1, 32, 32, 3),
    ((70, 25), (121, 25), 8, 2, 16, 16, 4),  # queries are the last tokens: cu_seqlens_k != cu_seqlens
]


def case_id(c):
    lens, klens, hq, hkv, d, bs, topk = c
    kv = f"-Tk{sum(klens)}" if klens else ""
    return f"B{len(lens)}-T{sum(lens)}{kv}-Hq{hq}-Hkv{hkv}-D{d}-bs{bs}-k{topk}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case):
    lens, klens, hq, hkv, d, bs, topk = case
    q, k, v, block_idx, cu_q, cu_k = make_case(lens, hq, hkv, d, bs, topk, klens)
    assert (block_idx >= 0).sum(-1).max() > 1, "selection must contain more than the own block"
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, bs)
    assert_match(ours, ref)


@pytest.mark.parametrize("launch, bs", [
    ("block_m=16,block_n=16,dkdv_block_m=16,dkdv_max_tokens=8", 16),
    ("block_m=32,block_n=16,dkdv_block_m=64,dkdv_max_tokens=1000", 32),
], ids=["B2-T105-Hq16-Hkv1-D16-bs16-k3-one-token-tiles-split-blocks",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-two-token-tiles-two-subtiles"])
def test_gpu_launch_shapes(launch, bs, monkeypatch):
    """The GPU tilings: one token per tile (no membership test), hot key blocks split over programs (atomics),
    key blocks walked in several sub-tiles."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    q, k, v, block_idx, cu_q, cu_k = make_case((45, 60), 16, 1, 16, bs, 3, seed=3)
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, bs)
    assert_match(ours, ref)


def test_all_blocks_is_dense_causal():
    """topk >= number of blocks: every query sees its whole causal prefix."""
    lens = (37, 50)
    q, k, v, block_idx, cu_q, cu_k = make_case(lens, 4, 2, 16, 16, 4)
    assert (block_idx >= 0).sum(-1).max() == 4
    o, lse = sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
    for b, (s, e) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        dense = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        assert rel_err(o[s:e], dense) <= 1e-5


def test_query_without_blocks_gets_zero():
    """A query whose slots are all -1 sees nothing: o = 0, lse = -inf, no gradient; others are unaffected."""
    q, k, v, block_idx, cu_q, cu_k = make_case((40,), 4, 1, 16, 16, 2)
    block_idx = block_idx.clone()
    block_idx[:, 5] = -1
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, 16)
    assert torch.all(ours[0][5] == 0) and torch.all(ours[1][5] == float("-inf"))
    assert torch.all(ours[2][5] == 0)
    assert_match(ours, ref)


def test_query_positions_bottom_right():
    cu_q, cu_k = cu((3, 2)), cu((5, 4))
    seq, qpos = query_positions(cu_q, cu_k, 5)
    assert seq.tolist() == [0, 0, 0, 1, 1]
    assert qpos.tolist() == [2, 3, 4, 7, 8]  # last 3 of keys 0..4, last 2 of keys 5..8


def test_tile_candidates_is_sorted_union(monkeypatch):
    monkeypatch.setattr(triton_common, "_TILES_PER_SORT", 2)  # exercise the chunked sort
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 6, (2, 7, 3), generator=gen, dtype=torch.int32) * 16
    starts[0, 2, 2] = -1
    cand, ncand = tile_candidates(starts, tokens_per_tile=3)
    assert cand.shape == (2, 3, 9)
    for h in range(2):
        for tile in range(3):
            toks = starts[h, tile * 3:(tile + 1) * 3].flatten().tolist()
            want = sorted(set(x for x in toks if x >= 0))
            n = int(ncand[h, tile])
            assert cand[h, tile, :n].tolist() == want
            assert torch.all(cand[h, tile, n:] == NO_BLOCK)


def test_tile_candidates_one_token_is_the_selection():
    starts = torch.tensor([[[32, 0, -1], [16, -1, -1]]], dtype=torch.int32)
    cand, ncand = tile_candidates(starts, tokens_per_tile=1)
    assert ncand.tolist() == [[2, 1]]
    assert cand[0, 0, :2].tolist() == [32, 0] and cand[0, 1, :1].tolist() == [16]


def test_key_block_work_inverts_the_selection():
    """Every (head, block, query) of block_idx appears in exactly one work item; hot blocks split."""
    lens = (50, 30)
    _, _, _, block_idx, cu_q, cu_k = make_case(lens, 2, 2, 8, 16, 3)
    block_idx = block_idx.cpu()
    seq, _ = query_positions(cu_q.cpu(), cu_k.cpu(), sum(lens))
    work = key_block_work(block_idx, seq, cu_k.cpu(), sum(lens), 16, max_tokens=7)
    got = []
    for i in range(work.lo.numel()):
        lo, hi = int(work.lo[i]), int(work.hi[i])
        if hi == lo:
            continue
        assert hi - lo <= 7
        bucket = int(work.bucket[i])
        head, gb = divmod(bucket, work.num_block_slots)
        start = int(work.block_start[gb])
        for tok in work.tokens[lo:hi].tolist():
            got.append((head, start, tok))
    want = []
    starts = absolute_block_starts(block_idx, seq, cu_k.cpu(), 16)
    for h, t, s in (starts >= 0).nonzero().tolist():
        want.append((h, int(starts[h, t, s]), t))
    assert sorted(got) == sorted(want)
    assert bool(work.split.any()), "a block chosen by more than 7 queries must be split"
    # block ranges stop at their sequence's end
    assert work.block_end.tolist()[:6] == [16, 32, 48, 50, 66, 80]


def test_launch_config_checks():
    with pytest.raises(ValueError, match="block_n"):
        attention_launch(4, 16, 48, torch.float32, False, block_n=32)
    with pytest.raises(ValueError, match="group"):
        attention_launch(32, 16, 16, torch.float32, False, block_m=16)
    with pytest.raises(ValueError, match="unknown"):
        attention_launch(4, 16, 16, torch.float32, False, block_q=16)


def test_bad_inputs_raise_value_error():
    q, k, v, block_idx, cu_q, cu_k = make_case((20, 20), 4, 2, 16, 16, 2)
    kw = dict(block_size=16)
    with pytest.raises(ValueError, match="block_idx"):
        sparse_attention(q, k, v, block_idx.long(), cu_q, **kw)
    bad = block_idx.clone()
    bad[0, 3, 1] = 2  # a future block of the first sequence
    with pytest.raises(ValueError, match="block_idx"):
        sparse_attention(q, k, v, bad, cu_q, **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sparse_attention(q, k, v, block_idx, cu_q.flip(0), **kw)
    with pytest.raises(ValueError, match="Hq"):
        sparse_attention(q[:, :3], k, v, block_idx, cu_q, **kw)
    with pytest.raises(ValueError, match="q"):
        sparse_attention(q.double(), k.double(), v.double(), block_idx, cu_q, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        sparse_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, block_idx, cu_q, **kw)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations and autograd registration are consistent (torch.compile relies on it)."""
    q, k, v, block_idx, cu_q, cu_k = make_case((20, 13), 4, 2, 16, 16, 2)
    scale = 0.25
    torch.library.opcheck(torch.ops.openm3.msa_sparse_attn_fwd.default,
                          (q, k, v, block_idx, cu_q, cu_k, 16, scale),
                          test_utils=("test_schema", "test_faketensor"))
    o, lse = torch.ops.openm3.msa_sparse_attn_fwd(q, k, v, block_idx, cu_q, cu_k, 16, scale)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.openm3.msa_sparse_attn_bwd.default,
                          (do, q, k, v, o, lse, block_idx, cu_q, cu_k, 16, scale),
                          test_utils=("test_schema", "test_faketensor"))


def test_validation_can_be_skipped_for_trusted_selections(monkeypatch):
    """With value checks off, a trusted selection gives the same result (the switch only skips checks)."""
    q, k, v, block_idx, cu_q, cu_k = make_case((30,), 4, 1, 16, 16, 2)
    o1, _ = sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
    monkeypatch.setattr(triton_attention, "VALIDATE_BLOCK_IDX", False)
    o2, _ = sparse_attention(q, k, v, block_idx, cu_q, block_size=16)
    assert torch.equal(o1, o2)


_SM90_COMPILE = r'''
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from openm3.ops.msa import triton_attention as ta
from openm3.ops.msa.triton_common import attention_launch

def signature(fn, consts):
    def kind(name):
        if name in ("Q", "K", "V", "O", "DO", "DQ"):
            return "*bf16"
        if name in ("LSE", "DELTA", "DK", "DV"):
            return "*fp32"
        if name.isupper() and name != "T":
            return "*i32"
        return "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    sig = {n: "constexpr" if n in consts else kind(n) for n in fn.arg_names}
    # what the launcher's specialisation sees on a GPU: aligned pointers, strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride")}
    return sig, attrs

for group in (16, 4, 1):
    launch = attention_launch(group, 128, 128, torch.bfloat16, on_gpu=True)
    base = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, TOPK=16, BLOCK_TOPK=16, BLOCK_SIZE=128,
                BLOCK_N=launch.block_n, DOT_PRECISION="tf32", WHILE_LOOPS=False, NUM_HEADS=4 * group)
    jobs = [(ta._attn_fwd_kernel, dict(BLOCK_M=launch.block_m, TOKENS=launch.tokens_per_tile(group)), launch.num_warps),
            (ta._attn_dq_kernel, dict(BLOCK_M=launch.block_m, TOKENS=launch.tokens_per_tile(group)), launch.num_warps),
            (ta._attn_dkdv_kernel, dict(BLOCK_M=launch.dkdv_block_m, TOKENS=launch.dkdv_tokens(group)),
             launch.dkdv_num_warps)]
    for fn, extra, warps in jobs:
        consts = {k: v for k, v in {**base, **extra}.items() if k in fn.arg_names}
        sig, attrs = signature(fn, consts)
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=launch.num_stages))
        assert k.asm["cubin"], fn.__name__
        print(fn.__name__, group, "ok")
'''


def test_kernels_compile_for_sm90():
    """The interpreter accepts programs a GPU compiler rejects (e.g. tl.dot below 16 rows): compile every kernel
    for an H100/H200 (sm_90) with the default GPU launch configs, without a GPU (Triton's bundled ptxas)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 9, proc.stdout


def test_strided_views_of_fused_projections():
    """q, k, v as slices of one fused [T, Hq + 2 Hkv, D] tensor (not dense): same result as contiguous inputs."""
    q, k, v, block_idx, cu_q, cu_k = make_case((30, 21), 4, 2, 16, 16, 2)
    fused = torch.cat([q, k, v], dim=1).requires_grad_(True)
    o, lse = sparse_attention(fused[:, :4], fused[:, 4:6], fused[:, 6:], block_idx, cu_q, block_size=16)
    do = torch.randn_like(o)
    (dfused,) = torch.autograd.grad(o, fused, do)
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o_ref, _ = reference.sparse_attention(qq, kk, vv, block_idx, cu_q, block_size=16)
    want = torch.cat(torch.autograd.grad(o_ref, (qq, kk, vv), do), dim=1)
    assert rel_err(o, o_ref) <= 1e-4
    assert rel_err(dfused, want) <= 1e-4
