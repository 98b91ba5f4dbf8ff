"""Triton block selection and indexer KL against the reference, plus their torch-side bookkeeping.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (fp32); with one, the same tests run the
compiled kernels on CUDA tensors. Shapes are tiny because the interpreter is slow (its cost is per operation).
Random fp32 inputs are tie-free, so selections must be identical to the reference's, slot by slot.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of a Triton kernel module

import pytest  # noqa: E402

from openm3.ops import msa  # noqa: E402
from openm3.ops.msa import reference  # noqa: E402
from openm3.ops.msa.triton_common import query_positions  # noqa: E402
from openm3.ops.msa.triton_kl import _entry_work, _kl_forward, indexer_kl, kl_launch  # noqa: E402
from openm3.ops.msa.triton_select import _select, _tiles, select_blocks, select_launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# Triton 3.6's interpreter converts 1-element arrays to loop bounds (NumPy deprecates it; NumPy >= 2.4 refuses).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def randn(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------------------------------------------
# Selection

# (query lens, key lens or None, Hi, Di, block, topk, local, launch overrides)
SELECT_CASES = [
    ([100, 37, 163], None, 4, 16, 16, 4, 1, {}),
    ([100, 37, 163], None, 1, 32, 32, 3, 1, {}),
    ([100, 37, 163], None, 16, 16, 16, 4, 2, {}),
    ([70, 129], None, 4, 16, 32, 4, 1, dict(block_n=16)),  # a block spans 2 key tiles
    ([70, 129], None, 4, 16, 16, 5, 1, dict(block_n=64)),  # 4 blocks per key tile
    ([70, 129], None, 4, 16, 8, 6, 2, {}),  # block below tl.dot's minimum width
    ([70, 129], None, 4, 16, 16, 3, 0, {}),  # no forced block
    ([70, 129], None, 4, 16, 16, 16, 16, {}),  # only forced blocks, -1 beyond the prefix
    ([20, 37, 50], [100, 37, 163], 4, 16, 16, 4, 1, {}),  # bottom-right aligned queries
    ([0, 45], [10, 45], 4, 16, 16, 4, 1, {}),  # an empty sequence
    ([100, 37, 163], None, 4, 16, 32, 4, 1, dict(tma=1, block_n=16)),  # ki through a TMA descriptor
    ([20, 37, 50], [100, 37, 163], 4, 16, 8, 5, 1, dict(tma=1)),
]


def select_id(case) -> str:
    lens, klens, hi, di, bs, topk, local, ov = case
    s = f"B{len(lens)}-T{sum(lens)}" + (f"-Tk{sum(klens)}" if klens else "")
    s += f"-Hi{hi}-Di{di}-bs{bs}-top{topk}-loc{local}"
    return s + "".join(f"-{k}{v}" for k, v in ov.items())


@pytest.mark.parametrize("case", SELECT_CASES, ids=select_id)
def test_select_matches_reference(case):
    lens, klens, hi, di, bs, topk, local, overrides = case
    gen = torch.Generator().manual_seed(sum(lens) + bs)
    cu_q = cu(lens)
    cu_k = cu(klens) if klens else cu_q
    qi, ki = randn(gen, sum(lens), hi, di), randn(gen, int(cu_k[-1]), di)
    kw = dict(block_size=bs, topk=topk, local_blocks=local, cu_seqlens_k=cu_k if klens else None)
    ref = reference.select_blocks(qi, ki, cu_q, **kw)
    launch = select_launch(hi, di, bs, ON_GPU, **overrides)
    out = _select(qi, ki, cu_q, cu_k, bs, topk, local, launch=launch)
    assert out.dtype == torch.int32 and out.shape == ref.shape
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case", SELECT_CASES, ids=select_id)
def test_select_index_lse_matches_reference(case):
    """With an index scale the kernel also returns the KL's student normaliser over the selected causal keys (from
    the scores it has on chip): equal to `reference.index_lse`, and the selection is unchanged."""
    lens, klens, hi, di, bs, topk, local, overrides = case
    gen = torch.Generator().manual_seed(sum(lens) + bs)
    cu_q = cu(lens)
    cu_k = cu(klens) if klens else cu_q
    qi, ki = randn(gen, sum(lens), hi, di), randn(gen, int(cu_k[-1]), di)
    launch = select_launch(hi, di, bs, ON_GPU, **overrides)
    plain = _select(qi, ki, cu_q, cu_k, bs, topk, local, launch=launch)
    out, lse = _select(qi, ki, cu_q, cu_k, bs, topk, local, launch=launch, index_scale=0.3)
    assert torch.equal(out, plain)
    want = reference.index_lse(qi, ki, plain, cu_q, block_size=bs, index_scale=0.3,
                               cu_seqlens_k=cu_k if klens else None)
    assert lse.dtype == torch.float32 and lse.shape == (hi, sum(lens))
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    finite = torch.isfinite(want)
    assert (lse[finite] - want[finite]).abs().max().item() <= 1e-4 * max(1.0, want[finite].abs().max().item())


def test_reference_index_lse_is_the_students_normaliser():
    """`reference.index_lse` by brute force: log-sum-exp of index_scale * qi . ki over each row's selected causal
    keys (here with a forced empty row: -inf)."""
    gen = torch.Generator().manual_seed(5)
    cu_q = cu([23, 18])
    qi, ki = randn(gen, 41, 2, 8), randn(gen, 41, 8)
    block_idx = reference.select_blocks(qi, ki, cu_q, block_size=4, topk=3, local_blocks=1)
    block_idx[1, 30] = -1  # a row that selected nothing
    got = reference.index_lse(qi, ki, block_idx, cu_q, block_size=4, index_scale=0.5)
    starts = [0, 23]
    for g in range(2):
        for t in range(41):
            b = 0 if t < 23 else 1
            pos = t - starts[b]
            keys = [starts[b] + j for blk in block_idx[g, t].tolist() if blk >= 0
                    for j in range(blk * 4, blk * 4 + 4) if j <= pos]
            if not keys:
                assert got[g, t] == float("-inf")
                continue
            z = (ki[keys].double() @ qi[t, g].double()) * 0.5
            assert abs(got[g, t].item() - torch.logsumexp(z, 0).item()) < 1e-5


def test_kl_takes_the_index_lse_from_the_selection(monkeypatch):
    """`select_blocks(..., return_index_lse=True)` returns the normaliser only when the launch config computes it
    (`index_lse=1`, else None), and the KL given it (first pass skipped) equals the KL without it."""
    gen = torch.Generator().manual_seed(6)
    cu_q = cu([70, 129])
    q, k = randn(gen, 199, 16, 16), randn(gen, 199, 4, 16)
    qi, ki = randn(gen, 199, 4, 16), randn(gen, 199, 16)
    kw = dict(block_size=16, topk=3, local_blocks=1)
    with msa.use_backend("triton"):
        block_idx, none = msa.select_blocks(qi, ki, cu_q, return_index_lse=True, **kw)
        assert none is None
        monkeypatch.setenv("OPENM3_SELECT_LAUNCH", "index_lse=1")
        same, index_lse = msa.select_blocks(qi, ki, cu_q, return_index_lse=True, **kw)
        assert torch.equal(same, block_idx) and index_lse.shape == (4, 199)
        o, lse = msa.sparse_attention(q, k, k, block_idx, cu_q, block_size=16)
        losses, grads = [], []
        for kl_launch_env in ("", "teacher_pass=1"):  # with the teacher pass too (no first pass, no head loop)
            monkeypatch.setenv("OPENM3_KL_LAUNCH", kl_launch_env)
            for given in (None, index_lse):
                qi_g, ki_g = qi.clone().requires_grad_(True), ki.clone().requires_grad_(True)
                loss = msa.indexer_kl(q, k, qi_g, ki_g, block_idx, cu_q, block_size=16, lse=lse, index_lse=given)
                loss.backward()
                losses.append(loss.detach())
                grads.append((qi_g.grad, ki_g.grad))
    for i in range(1, 4):
        assert rel_err(losses[i], losses[0]) < 1e-5, i
        assert rel_err(grads[i][0], grads[0][0]) < 1e-4 and rel_err(grads[i][1], grads[0][1]) < 1e-4, i
    with msa.use_backend("reference"):  # the reference checks it and recomputes
        block_ref, none = msa.select_blocks(qi, ki, cu_q, return_index_lse=True, **kw)
        assert none is None and torch.equal(block_ref, block_idx)
        ref = msa.indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse, index_lse=index_lse)
    assert rel_err(ref, losses[0]) < 1e-4


def test_index_lse_by_sequence_length(monkeypatch):
    """index_lse=-1 (the GPU default) computes the normaliser in the selection for sequences of at most
    INDEX_LSE_MAX_KEYS keys on average (weighted by queries), else leaves it to the KL."""
    from openm3.ops.msa import triton_select as ts
    from openm3.ops.msa._checks import check_seqlens

    def segs(lens, klens=None):
        kl = None if klens is None else cu(klens)
        return check_seqlens(cu(lens), sum(lens), kl, sum(klens or lens))

    auto = ts.select_launch(4, 128, 128, on_gpu=True)
    assert auto.index_lse == -1 and ts.select_launch(4, 128, 128, on_gpu=False).index_lse == 0
    limit = ts.INDEX_LSE_MAX_KEYS
    assert ts.index_lse_on_the_way(auto, segs([limit] * 8))  # m3-small's 8K training rows
    assert not ts.index_lse_on_the_way(auto, segs([16 * limit]))  # M3 at 128K
    # weighted by queries: one long sequence among short ones tips it
    assert ts.index_lse_on_the_way(auto, segs([limit, limit // 2]))
    assert not ts.index_lse_on_the_way(auto, segs([100, 4 * limit]))
    # chunked prefill: few queries against many cached keys count their keys
    assert not ts.index_lse_on_the_way(auto, segs([64], [2 * limit]))
    for fixed in (0, 1):
        launch = ts.select_launch(4, 128, 128, on_gpu=True, index_lse=fixed)
        assert ts.index_lse_on_the_way(launch, segs([16 * limit])) == bool(fixed)
    with pytest.raises(ValueError, match="index_lse=2 must be -1"):
        ts.select_launch(4, 128, 128, on_gpu=True, index_lse=2)

    gen = torch.Generator().manual_seed(6)
    cu_q = cu([70, 129])
    qi, ki = randn(gen, 199, 4, 16), randn(gen, 199, 16)
    kw = dict(block_size=16, topk=3, local_blocks=1)
    with msa.use_backend("triton"):
        monkeypatch.setenv("OPENM3_SELECT_LAUNCH", "index_lse=-1")
        _, index_lse = msa.select_blocks(qi, ki, cu_q, return_index_lse=True, **kw)
        assert index_lse is not None and index_lse.shape == (4, 199)
        monkeypatch.setattr(ts, "INDEX_LSE_MAX_KEYS", 100)
        _, none = msa.select_blocks(qi, ki, cu_q, return_index_lse=True, **kw)
        assert none is None


def test_select_public_dispatch_and_fp16():
    gen = torch.Generator().manual_seed(3)
    cu_q = cu([90, 61])
    qi, ki = randn(gen, 151, 4, 16), randn(gen, 151, 16)
    ref = reference.select_blocks(qi, ki, cu_q, block_size=16, topk=4, local_blocks=1)
    with msa.use_backend("triton"):
        out = msa.select_blocks(qi, ki, cu_q, block_size=16, topk=4, local_blocks=1)
    assert torch.equal(out, ref)
    # fp16 inputs: products are exact in fp32, so only near-ties could differ; these inputs have none.
    out16 = select_blocks(qi.half(), ki.half(), cu_q, block_size=16, topk=4, local_blocks=1)
    ref16 = reference.select_blocks(qi.half().float(), ki.half().float(), cu_q, block_size=16, topk=4)
    assert (out16 == ref16).all(-1).float().mean().item() > 0.98


def test_select_tiles_cover_each_query_once_longest_first():
    cu_q, cu_k = cu([5, 0, 17, 9]), cu([5, 3, 40, 9])
    seq, q0 = _tiles(cu_q, cu_k, num_tokens=31, tokens_per_tile=4)
    assert seq.numel() == -(-31 // 4) + 4
    covered = []
    for s, start in zip(seq.tolist(), q0.tolist()):
        if start < 0:
            continue
        q_len = int(cu_q[s + 1] - cu_q[s])
        covered += [(s, i) for i in range(start, min(start + 4, q_len))]
    expected = [(s, i) for s in range(4) for i in range(int(cu_q[s + 1] - cu_q[s]))]
    assert sorted(covered) == expected
    work = [int(cu_k[s + 1] - cu_k[s] - cu_q[s + 1] + cu_q[s]) + st for s, st in zip(seq.tolist(), q0.tolist())
            if st >= 0]
    assert work == sorted(work, reverse=True)


def test_select_launch_and_input_checks():
    with pytest.raises(NotImplementedError, match="block_size"):
        select_launch(4, 16, 24, ON_GPU)
    with pytest.raises(ValueError, match="block_m"):
        select_launch(32, 16, 16, ON_GPU, block_m=16)
    with pytest.raises(ValueError, match="block_n"):
        select_launch(4, 16, 48, ON_GPU, block_n=32)
    qi, ki = torch.zeros(10, 4, 16, device=DEVICE), torch.zeros(10, 16, device=DEVICE)
    with pytest.raises(ValueError, match="qi"):
        select_blocks(qi[0], ki, cu([10]), block_size=16, topk=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        select_blocks(qi, ki, cu([4, 5]), block_size=16, topk=2)
    with pytest.raises(ValueError, match="local_blocks"):
        select_blocks(qi, ki, cu([10]), block_size=16, topk=2, local_blocks=3)
    with pytest.raises(ValueError, match="qi"):
        select_blocks(qi.double(), ki.double(), cu([10]), block_size=16, topk=2)


# ---------------------------------------------------------------------------------------------------------------
# Indexer KL

# (query lens, key lens or None, Hq, Hkv, D, Di, block, topk, sparse, with lse, launch overrides)
KL_CASES = [
    ([100, 37, 163], None, 4, 4, 16, 16, 16, 4, True, True, {}),  # G = 1
    ([100, 37, 163], None, 16, 4, 16, 32, 16, 4, True, True, {}),  # G = 4
    ([100, 37, 163], None, 16, 1, 32, 16, 16, 4, True, True, {}),  # G = 16
    ([100, 37, 163], None, 16, 4, 16, 16, 32, 3, True, False, {}),  # teacher normaliser computed here
    ([70, 129], None, 8, 2, 16, 16, 32, 3, True, True, dict(block_n=16, block_q=16, max_entries=16,
                                                             heads_per_dot=2)),  # GPU-like tiling, split buckets
    ([70, 129], None, 16, 4, 16, 16, 32, 3, True, True, dict(block_n=16, block_q=16, heads_per_dot=1)),  # small G, GPU
    ([70, 129], None, 16, 4, 16, 16, 32, 3, True, True, dict(block_n=16, dqi_buffer=1)),  # dqi partial buffer
    ([70, 129], None, 16, 4, 16, 16, 16, 0, False, False, {}),  # dense warm-up
    ([20, 37, 50], [100, 37, 163], 16, 4, 16, 16, 16, 4, True, True, {}),  # bottom-right aligned queries
    ([20, 37, 50], [100, 37, 163], 16, 4, 16, 16, 16, 0, False, False, {}),
    # every work item launched, the empty ones too (no host sync): split buckets, then the dense warm-up
    ([70, 129], None, 8, 2, 16, 16, 32, 3, True, True, dict(block_n=16, block_q=16, max_entries=16,
                                                             compact_items=0)),
    ([20, 37, 50], [100, 37, 163], 16, 4, 16, 16, 16, 0, False, False, dict(compact_items=0)),
    # the teacher heads as a kept loop: one head per dot (m3-small's GPU default), then two per dot
    ([70, 129], None, 16, 4, 16, 16, 32, 3, True, True, dict(block_n=16, heads_per_dot=1, unroll_heads=0)),
    ([100, 37, 163], None, 16, 2, 16, 16, 16, 4, True, False, dict(heads_per_dot=2, unroll_heads=0, maxnreg=128)),
    # teacher probabilities from their own query-outer pass (union tiles of several tokens on CPU), read by the
    # main pass: G = 1, 4, 16, without the attention's lse, bottom-right aligned queries, sub-tiles, split buckets
    ([100, 37, 163], None, 4, 4, 16, 16, 16, 4, True, True, dict(teacher_pass=1)),
    ([100, 37, 163], None, 16, 4, 16, 32, 16, 4, True, True, dict(teacher_pass=1)),
    ([100, 37, 163], None, 16, 1, 32, 16, 16, 4, True, True, dict(teacher_pass=1)),
    ([100, 37, 163], None, 16, 4, 16, 16, 32, 3, True, False, dict(teacher_pass=1)),
    ([20, 37, 50], [100, 37, 163], 16, 4, 16, 16, 16, 4, True, True, dict(teacher_pass=1)),
    ([70, 129], None, 8, 2, 16, 16, 32, 3, True, True, dict(teacher_pass=1, block_n=16, block_q=16, max_entries=16)),
    # ... with the main pass key-major (opt-in): G = 4 and 16, without lse, bottom-right aligned, split buckets,
    # and with dqi_buffer asked for (key-major adds dL/dqi by atomics)
    ([100, 37, 163], None, 16, 4, 16, 32, 16, 4, True, True, dict(teacher_pass=1, key_major=1)),
    ([100, 37, 163], None, 16, 1, 32, 16, 16, 4, True, False, dict(teacher_pass=1, key_major=1)),
    ([20, 37, 50], [100, 37, 163], 16, 4, 16, 16, 16, 4, True, True, dict(teacher_pass=1, key_major=1)),
    ([70, 129], None, 8, 2, 16, 16, 32, 3, True, True, dict(teacher_pass=1, key_major=1, block_n=16, block_q=16,
                                                             max_entries=16, dqi_buffer=1)),
    # ... and where it does not apply (a group of 3 heads, the dense warm-up): the main pass recomputes
    ([70, 129], None, 6, 2, 16, 16, 32, 3, True, True, dict(teacher_pass=1)),
    ([70, 129], None, 16, 4, 16, 16, 16, 0, False, False, dict(teacher_pass=1)),
    # the first pass taller than the main pass (student logits only with lse given; teachers too without it)
    ([70, 129], None, 16, 4, 16, 16, 32, 3, True, True, dict(block_n=16, block_q=16, stats_block_q=64,
                                                             stats_num_warps=2)),
    ([70, 129], None, 16, 4, 16, 16, 32, 3, True, False, dict(block_n=16, block_q=16, stats_block_q=32)),
]


def kl_id(case) -> str:
    lens, klens, hq, hkv, d, di, bs, topk, sparse, with_lse, ov = case
    s = f"B{len(lens)}-T{sum(lens)}" + (f"-Tk{sum(klens)}" if klens else "")
    s += f"-Hq{hq}-Hkv{hkv}-D{d}-Di{di}-bs{bs}" + (f"-top{topk}" if sparse else "-dense")
    s += "-lse" if with_lse else "-nolse"
    return s + "".join(f"-{k}{v}" for k, v in ov.items())


def make_kl_case(lens, klens, hq, hkv, d, di, bs, topk, sparse, with_lse, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q = cu(lens)
    cu_k = cu(klens) if klens else None
    t, tk = sum(lens), sum(klens or lens)
    q, k, v = randn(gen, t, hq, d), randn(gen, tk, hkv, d), randn(gen, tk, hkv, d)
    qi, ki = randn(gen, t, hkv, di), randn(gen, tk, di)
    block_idx = None
    if sparse:
        block_idx = reference.select_blocks(qi, ki, cu_q, block_size=bs, topk=topk, local_blocks=1,
                                            cu_seqlens_k=cu_k)
    lse = None
    if with_lse:
        _, lse = reference.sparse_attention(q, k, v, block_idx, cu_q, block_size=bs, cu_seqlens_k=cu_k)
    return q, k, qi, ki, block_idx, cu_q, cu_k, lse


def reference_kl(q, k, qi, ki, block_idx, cu_q, cu_k, lse, bs):
    qi, ki = qi.clone().requires_grad_(True), ki.clone().requires_grad_(True)
    loss = reference.indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=bs, lse=lse, cu_seqlens_k=cu_k)
    loss.backward()
    return loss.detach(), qi.grad, ki.grad


@pytest.mark.parametrize("case", KL_CASES, ids=kl_id)
def test_kl_matches_reference(case):
    *shape, overrides = case
    q, k, qi, ki, block_idx, cu_q, cu_k, lse = make_kl_case(*shape)
    bs = shape[6]
    ref_loss, ref_dqi, ref_dki = reference_kl(q, k, qi, ki, block_idx, cu_q, cu_k, lse, bs)
    launch = kl_launch(q.shape[1] // k.shape[1], max(q.shape[2], qi.shape[2]), bs, ON_GPU, **overrides)
    loss, dqi, dki = _kl_forward(q, k, qi, ki, block_idx, cu_q, cu_q if cu_k is None else cu_k, lse, bs,
                                 q.shape[2] ** -0.5, qi.shape[2] ** -0.5, True, launch=launch)
    assert ref_loss.item() > 1e-3  # a non-trivial KL
    assert rel_err(loss, ref_loss) < 1e-4
    assert rel_err(dqi, ref_dqi) < 1e-4
    assert rel_err(dki, ref_dki) < 1e-4


@pytest.mark.parametrize("lens,klens,hq,hkv", [([100, 37, 163], None, 16, 4), ([20, 37, 50], [100, 37, 163], 16, 1)])
def test_teacher_pass_writes_each_entrys_probabilities(lens, klens, hq, hkv):
    """`_teacher_pass` (query-outer, several tokens per tile on CPU) against the explicit mean over the group's
    heads of exp(q.k * scale - lse) on the keys of each selected block, 0 beyond causality and the sequence."""
    from openm3.ops.msa.triton_kl import _teacher_pass

    bs, topk = 16, 4
    q, k, _, _, block_idx, cu_q, cu_k, lse = make_kl_case(lens, klens, hq, hkv, 16, 16, bs, topk, True, True, 3)
    cu_k = cu_q if cu_k is None else cu_k
    teacher = _teacher_pass(q, k, lse, block_idx, cu_q, cu_k, bs, 0.25)
    seq, qpos = query_positions(cu_q, cu_k, q.shape[0])
    group, checked = hq // hkv, 0
    for g in range(hkv):
        for t in range(q.shape[0]):
            k0, k1 = int(cu_k[seq[t]]), int(cu_k[seq[t] + 1])
            for slot, b in enumerate(block_idx[g, t].tolist()):
                if b < 0:
                    continue
                rows = torch.arange(k0 + b * bs, k0 + b * bs + bs)
                ok = (rows < k1) & (rows <= qpos[t])
                s = q[t, g * group:(g + 1) * group] @ k[rows.clamp_max(k.shape[0] - 1), g].T * 0.25
                want = torch.where(ok, (s - lse[t, g * group:(g + 1) * group, None]).exp(), 0.0).mean(0)
                torch.testing.assert_close(teacher[g, t, slot], want, rtol=1e-5, atol=1e-6)
                checked += 1
    assert checked == int((block_idx >= 0).sum()) > 0


def test_kl_teacher_pass_runs_where_it_applies(monkeypatch):
    """teacher_pass=1 takes the teacher pass for a sparse KL with a power-of-two group, and not for a group of 3
    heads or the dense warm-up (whose results the KL cases above check either way)."""
    from openm3.ops.msa import triton_kl

    real = triton_kl._teacher_pass
    for hq, sparse, runs in ((8, True, True), (6, True, False), (8, False, False)):
        calls = []
        monkeypatch.setattr(triton_kl, "_teacher_pass", lambda *a: calls.append(1) or real(*a))
        q, k, qi, ki, block_idx, cu_q, _, lse = make_kl_case([40, 30], None, hq, 2, 16, 16, 16, 3, sparse, sparse)
        launch = kl_launch(hq // 2, 16, 16, ON_GPU, teacher_pass=1)
        _kl_forward(q, k, qi, ki, block_idx, cu_q, cu_q, lse, 16, 0.25, 0.25, True, launch=launch)
        assert calls == ([1] if runs else []), (hq, sparse)


def test_teacher_pass_reuses_the_forwards_tiling(monkeypatch):
    """The attention forward and then the KL's teacher pass over the same selection build the tiles' candidate
    blocks once; a selection changed in place, another selection object, or inference-mode tensors (no version
    counter) build them again, and the KL's values never change."""
    from openm3.ops.msa import triton_attention, triton_common

    q, k, qi, ki, block_idx, cu_q, _, _ = make_kl_case([70, 129], None, 8, 2, 16, 16, 16, 3, True, False, seed=4)
    builds = []
    real = triton_common.tile_candidates
    monkeypatch.setattr(triton_common, "tile_candidates", lambda *a: builds.append(1) or real(*a))
    monkeypatch.setattr(triton_common, "_last_tiling", None)
    launch = kl_launch(4, 16, 16, ON_GPU, teacher_pass=1)

    def forward_then_kl(sel):
        _, lse = triton_attention.sparse_attention(q, k, k, sel, cu_q, block_size=16)
        return _kl_forward(q, k, qi, ki, sel, cu_q, cu_q, lse, 16, 0.25, 0.25, True, launch=launch)

    first = forward_then_kl(block_idx)
    assert len(builds) == 1
    # through the public ops as the model calls them (autograd Functions, torch.library custom ops): reused too
    monkeypatch.setenv("OPENM3_KL_LAUNCH", "teacher_pass=1")
    fresh = block_idx.clone()
    with msa.use_backend("triton"):
        _, lse = msa.sparse_attention(q, k, k, fresh, cu_q, block_size=16)
        public = msa.indexer_kl(q, k, qi, ki, fresh, cu_q, block_size=16, lse=lse)
    assert len(builds) == 2 and torch.equal(public, first[0])
    again = forward_then_kl(block_idx.clone())  # another object: built again
    assert len(builds) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))
    changed = block_idx.clone()
    _, lse = triton_attention.sparse_attention(q, k, k, changed, cu_q, block_size=16)
    changed += 0  # written in place (same values, new version): built again
    swapped = _kl_forward(q, k, qi, ki, changed, cu_q, cu_q, lse, 16, 0.25, 0.25, True, launch=launch)
    assert len(builds) == 5 and all(torch.equal(a, b) for a, b in zip(first, swapped))
    with torch.inference_mode():
        infer = _kl_forward(q, k, qi, ki, block_idx, cu_q, cu_q, lse, 16, 0.25, 0.25, False, launch=launch)
    assert len(builds) == 6 and torch.equal(infer[0], first[0])


def test_kl_public_autograd_scales_gradients():
    q, k, qi, ki, block_idx, cu_q, _, lse = make_kl_case([60, 45], None, 8, 2, 16, 16, 16, 3, True, True, seed=5)
    ref_loss, ref_dqi, ref_dki = reference_kl(q, k, qi, ki, block_idx, cu_q, None, lse, 16)
    qi_g, ki_g = qi.clone().requires_grad_(True), ki.clone().requires_grad_(True)
    with msa.use_backend("triton"):
        loss = msa.indexer_kl(q, k, qi_g, ki_g, block_idx, cu_q, block_size=16, lse=lse)
    (3.0 * loss).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_err(loss.detach(), ref_loss) < 1e-4
    assert rel_err(qi_g.grad, 3.0 * ref_dqi) < 1e-4
    assert rel_err(ki_g.grad, 3.0 * ref_dki) < 1e-4
    # Without a gradient the forward skips the gradient work but returns the same loss.
    with torch.no_grad():
        again = indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse)
    assert rel_err(again, ref_loss) < 1e-4


def test_kl_fp16_partial_buffer_and_atomics_agree():
    """fp16 inputs: the dL/dqi partials are stored in fp16 (dqi_buffer=1) or added in fp32 (dqi_buffer=0); both
    stay within fp16 rounding of the fp32 reference computed on the same fp16 values."""
    q, k, qi, ki, block_idx, cu_q, _, lse = make_kl_case([60, 45], None, 8, 2, 16, 16, 16, 3, True, True, seed=9)
    q, k, qi, ki = (x.half() for x in (q, k, qi, ki))
    ref_loss, ref_dqi, ref_dki = reference_kl(q.float(), k.float(), qi.float(), ki.float(), block_idx, cu_q, None,
                                              lse, 16)
    for dqi_buffer in (1, 0):
        launch = kl_launch(4, 16, 16, ON_GPU, dqi_buffer=dqi_buffer)
        loss, dqi, dki = _kl_forward(q, k, qi, ki, block_idx, cu_q, cu_q, lse, 16, 0.25, 0.25, True, launch=launch)
        assert dqi.dtype == torch.float32 and dqi.shape == qi.shape
        assert rel_err(loss, ref_loss) < 1e-3, dqi_buffer
        assert rel_err(dqi, ref_dqi) < 5e-3, dqi_buffer
        assert rel_err(dki, ref_dki) < 5e-3, dqi_buffer


def test_entry_work_inverts_the_selection():
    gen = torch.Generator().manual_seed(2)
    lens = [50, 0, 77]
    cu_q = cu(lens)
    qi, ki = randn(gen, 127, 2, 8), randn(gen, 127, 8)
    block_idx = reference.select_blocks(qi, ki, cu_q, block_size=16, topk=3, local_blocks=1)
    seq, _ = query_positions(cu_q, cu_q, 127)
    work = _entry_work(block_idx, seq, cu_q, 127, 16, max_entries=7)
    heads, t, topk = block_idx.shape
    seen = []
    for lo, hi, g, k0, k1 in zip(*(x.tolist() for x in (work.lo, work.hi, work.g, work.k0, work.k1))):
        assert 0 < hi - lo <= 7 and k1 - k0 <= 16
        assert work.entries[lo:hi].tolist() == sorted(work.entries[lo:hi].tolist())  # by query, for locality
        for e in work.entries[lo:hi].tolist():
            gg, tt, slot = e // (t * topk), e // topk % t, e % topk
            start = int(cu_q[seq[tt]]) + int(block_idx[gg, tt, slot]) * 16
            assert gg == g and start == k0 and k1 == min(start + 16, int(cu_q[seq[tt] + 1]))
            seen.append(e)
    valid = (block_idx >= 0).flatten().nonzero().flatten().tolist()
    assert sorted(seen) == valid


def test_kl_input_checks():
    gen = torch.Generator().manual_seed(0)
    q, k = randn(gen, 20, 8, 16), randn(gen, 20, 2, 16)
    qi, ki = randn(gen, 20, 2, 16), randn(gen, 20, 16)
    cu_q = cu([20])
    good = torch.tensor([0, -1], dtype=torch.int32, device=DEVICE).expand(2, 20, 2).contiguous()
    with pytest.raises(ValueError, match="qi"):
        indexer_kl(q, k, qi[:, :1], ki, good, cu_q, block_size=16)
    with pytest.raises(ValueError, match="block_idx"):
        indexer_kl(q, k, qi, ki, good + 5, cu_q, block_size=16)
    with pytest.raises(ValueError, match="lse"):
        indexer_kl(q, k, qi, ki, good, cu_q, block_size=16, lse=torch.zeros(20, 3, device=DEVICE))
    with pytest.raises(ValueError, match="index_scale"):
        indexer_kl(q, k, qi, ki, good, cu_q, block_size=16, index_scale=-1.0)
    for field, value, match in (("heads_per_dot", 8, "kl launch"), ("maxnreg", 300, "maxnreg"),
                                ("unroll_heads", 2, "unroll_heads"), ("stats_block_q", 48, "stats_block_q"),
                                ("stats_num_warps", 3, "stats_num_warps"), ("teacher_pass", 2, "teacher_pass")):
        with pytest.raises(ValueError, match=match):
            kl_launch(4, 16, 16, ON_GPU, **{field: value})
    for bad, match in ((torch.zeros(3, 20, device=DEVICE), r"index_lse must have shape \[Hi, T\] = \[2, 20\]"),
                       (torch.zeros(2, 20, dtype=torch.float64, device=DEVICE),
                        r"index_lse must be float32 of shape \[Hi, T\] = \[2, 20\]")):
        with pytest.raises(ValueError, match=match):
            indexer_kl(q, k, qi, ki, good, cu_q, block_size=16, index_lse=bad)
    with pytest.raises(ValueError, match="index_lse: only for the sparse KL"):
        indexer_kl(q, k, qi, ki, None, cu_q, block_size=16, index_lse=torch.zeros(2, 20, device=DEVICE))
    with pytest.raises(ValueError, match="index_lse"):
        select_launch(4, 16, 16, ON_GPU, index_lse=2)


def test_custom_ops_pass_opcheck():
    gen = torch.Generator().manual_seed(1)
    cu_q = cu([21, 19])
    q, k = randn(gen, 40, 4, 16), randn(gen, 40, 2, 16)
    qi, ki = randn(gen, 40, 2, 16), randn(gen, 40, 16)
    torch.library.opcheck(torch.ops.openm3.msa_select_blocks.default, (qi, ki, cu_q, cu_q, 16, 2, 1),
                          test_utils=("test_schema", "test_faketensor"))
    block_idx = select_blocks(qi, ki, cu_q, block_size=16, topk=2)
    torch.library.opcheck(torch.ops.openm3.msa_indexer_kl.default,
                          (q, k, qi, ki, block_idx, cu_q, cu_q, None, 16, 0.25, 0.25, True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.openm3.msa_select_blocks_lse.default, (qi, ki, cu_q, cu_q, 16, 2, 1, 0.25),
                          test_utils=("test_schema", "test_faketensor"))
    index_lse = reference.index_lse(qi, ki, block_idx, cu_q, block_size=16, index_scale=0.25)
    lse = reference.sparse_attention(q, k, k, block_idx, cu_q, block_size=16)[1]
    torch.library.opcheck(torch.ops.openm3.msa_indexer_kl.default,
                          (q, k, qi, ki, block_idx, cu_q, cu_q, lse, 16, 0.25, 0.25, True, index_lse),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Every kernel variant compiles for an H100/H200 (sm_90) through ptxas, no GPU needed: catches what the
    interpreter accepts but a GPU compile rejects (tl.dot tile minimums, layouts, loop-carried types)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.msa_select_kl", "--compile-check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled 25 kernels" in proc.stdout, proc.stdout


def test_torch_compile_traces_the_ops():
    """The custom ops and the autograd.Function trace under torch.compile (the kernels stay opaque calls)."""
    q, k, qi, ki, block_idx, cu_q, _, lse = make_kl_case([40, 30], None, 8, 2, 16, 16, 16, 3, True, True, seed=7)
    ref_loss, ref_dqi, _ = reference_kl(q, k, qi, ki, block_idx, cu_q, None, lse, 16)

    def step(q, k, qi, ki, lse):
        sel = torch.ops.openm3.msa_select_blocks(qi.detach(), ki.detach(), cu_q, None, 16, 3, 1)
        return sel, indexer_kl(q, k, qi, ki, block_idx, cu_q, block_size=16, lse=lse)

    qi_g = qi.clone().requires_grad_(True)
    sel, loss = torch.compile(step, backend="aot_eager")(q, k, qi_g, ki, lse)
    loss.backward()
    assert torch.equal(sel, block_idx)
    assert rel_err(loss.detach(), ref_loss) < 1e-4
    assert rel_err(qi_g.grad, ref_dqi) < 1e-4


def test_kl_with_no_selected_block_is_zero_like_the_reference():
    gen = torch.Generator().manual_seed(4)
    cu_q = cu([20])
    q, k = randn(gen, 20, 4, 16), randn(gen, 20, 2, 16)
    qi, ki = randn(gen, 20, 2, 16).requires_grad_(True), randn(gen, 20, 16)
    empty = torch.full((2, 20, 2), -1, dtype=torch.int32, device=DEVICE)
    loss = indexer_kl(q, k, qi, ki, empty, cu_q, block_size=16)
    ref = reference.indexer_kl(q, k, qi, ki, empty, cu_q, block_size=16)
    loss.backward()
    assert loss.item() == ref.item() == 0.0
    assert torch.count_nonzero(qi.grad) == 0
