"""Triton selection and indexer KL on a CUDA GPU.

    .venv/bin/python -m pytest -q tests/gpu/test_msa_select_kl_gpu.py

1. M3 shape, bf16, T in {4K, 32K, 128K}: the last `TAIL` queries of a T-token sequence form a bottom-right aligned
   sub-problem (cu_seqlens_k), cheap for the fp32 reference at any T. Selection: at least 99% of the rows choose
   the reference's block set (the kernel sums bf16 products in another order, so near-ties may flip). KL: loss,
   dqi, dki errors against the fp32 reference within 2x the error of a plain bf16 PyTorch computation
   (`benchmarks.msa_select_kl.kl_bf16_torch`), the flash-attention test bound.
2. Small varlen fp32 shapes with group sizes 1, 4, 16 compiled for the GPU (tl.dot tile minimums, register
   layouts) against the reference, like the CPU tests under the interpreter; also the pointer-load selection and
   the KL's opt-in launch paths (dqi partial buffer, L2 prefetch: inline PTX, which the interpreter cannot run;
   the teacher pass, also in bf16 at M3's and m3-small's groups).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `benchmarks`

pytestmark = pytest.mark.gpu

TAIL = 512


@pytest.fixture(scope="module")
def bench():
    from benchmarks import msa_select_kl

    return msa_select_kl


@pytest.mark.parametrize("t", [4096, 32768, 131072], ids=lambda t: f"T{t}-Hq64-Hkv4-D128-Di128-bs128-top16")
def test_m3_bf16_select_and_kl(bench, t):
    x = bench.m3_inputs(t)
    sel = bench.check_select(x, TAIL)
    assert sel["sets_identical"] >= 0.99, sel
    kl = bench.check_kl(x, TAIL, sparse=True, with_lse=True)
    assert kl["passed"], kl


def test_m3_bf16_kl_without_lse_and_dense(bench):
    x = bench.m3_inputs(4096)
    for sparse in (True, False):
        res = bench.check_kl(x, TAIL, sparse=sparse, with_lse=False)
        assert res["passed"], (sparse, res)


@pytest.mark.parametrize("t, hq, launch", [(4096, 64, ""), (131072, 64, ""), (16384, 16, ""),
                                           (4096, 64, "key_major=1"), (16384, 16, "key_major=1")],
                         ids=["T4096-G16", "T131072-G16", "T16384-G4", "T4096-G16-key-major", "T16384-G4-key-major"])
def test_bf16_kl_with_the_teacher_pass(bench, monkeypatch, t, hq, launch):
    """The teacher pass (`teacher_pass=1`, the GPU default: fp16 teacher probabilities from a query-outer pass, read
    by the main pass; also with the main pass key-major) within 2x the bf16 PyTorch error, at M3's group of 16 and
    m3-small's 4."""
    from openm3.ops.msa import triton_kl

    calls = []
    real = triton_kl._teacher_pass
    monkeypatch.setattr(triton_kl, "_teacher_pass", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("OPENM3_KL_LAUNCH", ",".join(["teacher_pass=1"] + ([launch] if launch else [])))
    kl = bench.check_kl(bench.m3_inputs(t, hq=hq), TAIL, sparse=True, with_lse=True)
    assert calls and kl["passed"], kl


@pytest.mark.parametrize("t, hq", [(4096, 64), (131072, 64), (16384, 16)],
                         ids=["T4096-G16", "T131072-G16", "T16384-G4"])
def test_bf16_kl_in_the_attention_backward(bench, monkeypatch, t, hq):
    """`sparse_attention_with_kl`: the teacher from the dk/dv kernel (not the teacher pass), the KL's value written
    by the backward, within 2x the bf16 PyTorch error at M3's group of 16 and m3-small's 4."""
    from openm3.ops.msa import triton_kl

    calls = []
    monkeypatch.setattr(triton_kl, "_teacher_pass", lambda *a: calls.append(1))
    kl = bench.check_kl(bench.m3_inputs(t, hq=hq), TAIL, sparse=True, with_lse=False, joint=True)
    assert not calls and kl["passed"], kl


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("hq, hkv", [(4, 4), (16, 4), (16, 1)], ids=["G1", "G4", "G16"])
@pytest.mark.parametrize("bs", [16, 48, 64], ids=["bs16", "bs48", "bs64"])
def test_varlen_fp32_matches_reference(hq, hkv, bs):
    from openm3.ops.msa import reference
    from openm3.ops.msa.triton_kl import _kl_forward, indexer_kl, kl_launch
    from openm3.ops.msa.triton_select import _select, select_blocks, select_launch

    gen = torch.Generator(device="cuda").manual_seed(hq + bs)
    lens = [300, 77, 513]
    cu_q = _cu(lens)
    t, d, di = sum(lens), 32, 64
    q = torch.randn(t, hq, d, device="cuda", generator=gen)
    k, v = (torch.randn(t, hkv, d, device="cuda", generator=gen) for _ in range(2))
    qi = torch.randn(t, hkv, di, device="cuda", generator=gen)
    ki = torch.randn(t, di, device="cuda", generator=gen)
    kw = dict(block_size=bs, topk=5, local_blocks=1)
    block_idx = select_blocks(qi, ki, cu_q, **kw)
    assert torch.equal(block_idx, reference.select_blocks(qi, ki, cu_q, **kw))
    launch = select_launch(hkv, di, bs, True, tma=0)  # pointer loads; the default uses TMA on Hopper
    assert torch.equal(_select(qi, ki, cu_q, cu_q, bs, 5, 1, launch=launch), block_idx)
    _, lse = reference.sparse_attention(q, k, v, block_idx, cu_q, block_size=bs)
    for sel, lse_in in ((block_idx, lse), (block_idx, None), (None, None)):
        grads = []
        for fn in (indexer_kl, reference.indexer_kl):
            qi_g, ki_g = qi.clone().requires_grad_(True), ki.clone().requires_grad_(True)
            loss = fn(q, k, qi_g, ki_g, sel, cu_q, block_size=bs, lse=lse_in)
            loss.backward()
            grads.append((loss.detach(), qi_g.grad, ki_g.grad))
        for mine, ref in zip(*grads):
            err = ((mine - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, (sel is None, lse_in is None, err)
        # The opt-in launch paths (dL/dqi partial buffer, L2 prefetch of q rows; the teacher pass, with the main
        # pass key-major) give the same values.
        for over in (dict(dqi_buffer=1, prefetch=1), dict(teacher_pass=1), dict(teacher_pass=1, key_major=1)):
            launch = kl_launch(hq // hkv, max(d, di), bs, True, **over)
            opt = _kl_forward(q, k, qi, ki, sel, cu_q, cu_q, lse_in, bs, d ** -0.5, di ** -0.5, True, launch=launch)
            for mine, ref in zip(opt, grads[1]):
                err = ((mine - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-4, (over, sel is None, lse_in is None, err)


def test_index_lse_from_the_selection_bf16(monkeypatch):
    """The opt-in student normaliser of the selection kernel (`OPENM3_SELECT_LAUNCH=index_lse=1`, register-capped)
    at m3-small's training shape in bf16: the same selection as without it, the normaliser within fp32 rounding of
    `reference.index_lse` on the same bf16 values, and the KL given it equal to the KL's own first pass."""
    from openm3.ops import msa
    from openm3.ops.msa import reference

    torch.manual_seed(0)
    t, hi, di, bs = 16384, 4, 128, 128
    cu = _cu([8192, 8192])
    qi = torch.randn(t, hi, di, device="cuda", dtype=torch.bfloat16)
    ki = torch.randn(t, di, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hi, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(block_size=bs, topk=16, local_blocks=1)
    plain = msa.select_blocks(qi, ki, cu, **kw)
    monkeypatch.setenv("OPENM3_SELECT_LAUNCH", "index_lse=1")
    block_idx, index_lse = msa.select_blocks(qi, ki, cu, return_index_lse=True, **kw)
    assert torch.equal(block_idx, plain)
    # the last 256 queries of each sequence: a bottom-right aligned sub-problem, cheap for the reference
    rows = torch.cat([torch.arange(8192 - 256, 8192), torch.arange(16384 - 256, 16384)]).cuda()
    sub_cu = torch.tensor([0, 256, 512], dtype=torch.int32, device="cuda")
    sub_k = torch.tensor([0, 8192, 16384], dtype=torch.int32, device="cuda")
    want = reference.index_lse(qi[rows].float(), ki.float(), block_idx[:, rows], sub_cu, block_size=bs,
                               cu_seqlens_k=sub_k)
    assert (index_lse[:, rows] - want).abs().max().item() < 1e-3
    _, lse = msa.sparse_attention(q, k, k, block_idx, cu, block_size=bs, validate_block_idx=False)
    losses = []
    for given in (None, index_lse):
        qi_g = qi.clone().requires_grad_(True)
        loss = msa.indexer_kl(q, k, qi_g, ki, block_idx, cu, block_size=bs, lse=lse, index_lse=given,
                              validate_block_idx=False)
        loss.backward()
        losses.append((loss.item(), qi_g.grad.float()))
    assert abs(losses[1][0] - losses[0][0]) <= 1e-4 * abs(losses[0][0])
    assert (losses[1][1] - losses[0][1]).abs().max().item() <= 1e-2 * losses[0][1].abs().max().item()


def test_teacher_pass_reuses_the_forwards_tiling_on_cuda(monkeypatch):
    """On CUDA tensors through the public ops (autograd Functions, torch.library custom ops), as the model calls
    them: the attention forward and the KL's teacher pass build the tiles' candidate blocks once, and the KL equals
    the one without the teacher pass."""
    from openm3.ops import msa
    from openm3.ops.msa import triton_common

    torch.manual_seed(0)
    t, cu = 16384, _cu([8192, 8192])
    q, k = (torch.randn(t, h, 128, device="cuda", dtype=torch.bfloat16) for h in (16, 4))
    qi, ki = torch.randn(t, 4, 128, device="cuda", dtype=torch.bfloat16), torch.randn(t, 128, device="cuda",
                                                                                      dtype=torch.bfloat16)
    kw = dict(block_size=128)
    block_idx = msa.select_blocks(qi, ki, cu, topk=16, **kw)
    builds = []
    real = triton_common.tile_candidates
    monkeypatch.setattr(triton_common, "tile_candidates", lambda *a: builds.append(1) or real(*a))
    monkeypatch.setattr(triton_common, "_last_tiling", None)
    monkeypatch.setenv("OPENM3_KL_LAUNCH", "teacher_pass=1")
    _, lse = msa.sparse_attention(q, k, k, block_idx, cu, validate_block_idx=False, **kw)
    with_pass = msa.indexer_kl(q, k, qi, ki, block_idx, cu, lse=lse, validate_block_idx=False, **kw)
    assert len(builds) == 1
    monkeypatch.setenv("OPENM3_KL_LAUNCH", "teacher_pass=0")
    without = msa.indexer_kl(q, k, qi, ki, block_idx, cu, lse=lse, validate_block_idx=False, **kw)
    assert abs(with_pass.item() - without.item()) <= 1e-3 * abs(without.item())
