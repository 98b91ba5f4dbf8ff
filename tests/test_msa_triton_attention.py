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
    ("block_m=64,block_n=32,dq_block_m=16,dq_block_n=16,dkdv_block_n=16,dkdv_block_m=32", 32),
    ("tma=1,block_m=16,block_n=16,dq_in_dkdv=1,dkdv_block_n=16,dkdv_block_m=16,dkdv_max_tokens=8", 32),
    ("tma=1,block_m=64,block_n=32,dq_block_m=32,dq_block_n=16,dkdv_block_m=32,dkdv_block_n=32", 32),
    ("dq_in_dkdv=1,dkdv_block_n=16,dkdv_block_m=16,dkdv_maxnreg=128", 32),
    ("dq_in_dkdv=1,dkdv_split=1,dkdv_block_n=16,dkdv_block_m=16,dkdv_max_tokens=8", 32),
    ("dq_in_dkdv=0,dkdv_split=1,dkdv_block_m=32", 32),
    ("dq_in_dkdv=1,dq_transposed=1,dkdv_block_n=16,dkdv_block_m=16,dkdv_max_tokens=8", 32),
    ("dq_in_dkdv=1,dq_transposed=1,dkdv_block_n=32,dkdv_block_m=32", 32),
], ids=["B2-T105-Hq16-Hkv1-D16-bs16-k3-one-token-tiles-split-blocks",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-two-token-tiles-two-subtiles",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-four-token-fwd-one-token-dq-dkdv-subtiles",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-tma-one-token-dq-fused-into-dkdv-split-blocks",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-tma-four-token-fwd-two-token-dq",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-dq-fused-register-cap",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-dkdv-split-passes-dq-fused-split-blocks",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-dkdv-split-passes-dq-apart",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-dq-transposed-split-blocks",
        "B2-T105-Hq16-Hkv1-D16-bs32-k3-dq-transposed-whole-blocks"])
def test_gpu_launch_shapes(launch, bs, monkeypatch):
    """The GPU tilings: one token per tile (no membership test), hot key blocks split over programs (atomics),
    key blocks walked in several sub-tiles, K/V through tensor descriptors (TMA), dq fused into dk/dv (also as
    dq^T = K^T dS^T), dk and dv in two passes."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", launch)
    q, k, v, block_idx, cu_q, cu_k = make_case((45, 60), 16, 1, 16, bs, 3, seed=3)
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, bs)
    assert_match(ours, ref)


@pytest.mark.parametrize("union_max", [1, 3, 64], ids=["all-tiles-per-token", "mixed", "all-tiles-union"])
def test_hybrid_forward_walks_wide_unions_per_token(union_max, monkeypatch):
    """The hybrid forward: 4-token tiles (G = 16) whose union exceeds union_max are left to a second launch that
    walks each of their tokens' own blocks in one-token tiles; the first walks the other tiles' unions. Same
    results as the reference either way, and the mixed case has tiles of both kinds; varlen, a partial last
    tile."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", f"block_m=64,block_n=16,union_max={union_max}")
    q, k, v, block_idx, cu_q, cu_k = make_case((45, 100), 16, 1, 16, 16, 3, klens=(60, 100), seed=5)
    if union_max == 3:
        seq, _ = query_positions(cu_q, cu_k, q.shape[0])
        _, ncand, _ = tile_candidates(absolute_block_starts(block_idx, seq, cu_k, 16), 4)
        assert (ncand <= union_max).any() and (ncand > union_max).any()
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, 16)
    assert_match(ours, ref)


def test_small_group_gpu_default_tiling(monkeypatch):
    """The GPU default for groups of 4 (m3-small): 64-row tiles of 16 tokens over their union, TMA, 2 stages, dq in
    dk/dv (`attention_launch(4, ..., on_gpu=True)`), run here under the interpreter with its key tile width."""
    gpu = attention_launch(4, 16, 32, torch.float32, True)
    fields = ("block_m", "num_stages", "tma", "dq_in_dkdv", "dkdv_block_m", "dq_transposed")
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", ",".join(f"{f}={getattr(gpu, f)}" for f in fields) + ",block_n=16")
    q, k, v, block_idx, cu_q, cu_k = make_case((45, 60), 16, 4, 16, 32, 3, seed=7)
    ours, ref = run_both(q, k, v, block_idx, cu_q, cu_k, 32)
    assert_match(ours, ref)


def test_fused_dq_falls_back_to_the_dq_pass_above_its_workspace_limit(monkeypatch):
    """dq_in_dkdv=1 with an fp32 dq buffer over FUSED_DQ_MAX_BYTES takes the separate dq pass: same result."""
    monkeypatch.setenv("OPENM3_ATTN_LAUNCH", "dq_in_dkdv=1,block_m=16,block_n=16,dkdv_block_m=16")
    q, k, v, block_idx, cu_q, cu_k = make_case((45, 60), 16, 1, 16, 16, 3, seed=5)
    fused, ref = run_both(q, k, v, block_idx, cu_q, cu_k, 16)
    monkeypatch.setattr(triton_attention, "FUSED_DQ_MAX_BYTES", 0)
    called, real_dq_pass = [], triton_attention._dq_pass
    monkeypatch.setattr(triton_attention, "_dq_pass", lambda *a: called.append(1) or real_dq_pass(*a))
    unfused, _ = run_both(q, k, v, block_idx, cu_q, cu_k, 16)
    assert called, "the separate dq pass must run above the workspace limit"
    assert_match(fused, ref)
    assert_match(unfused, ref)


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


@pytest.mark.parametrize("num_keys", [None, 640, 1 << 25], ids=["int64-keys", "int32-keys", "too-many-for-int32"])
@pytest.mark.parametrize("tokens", [3, 64], ids=["T130-topk3-tile3", "T130-topk3-tile64"])
def test_tile_candidates_is_sorted_union_with_members(tokens, num_keys, monkeypatch):
    """Each tile's distinct blocks ascending, and bit j of a block's member set iff token j of the tile chose it
    (also bit 63, the int64 sign bit, and a block listed twice by one token), with int32 or int64 sort keys."""
    monkeypatch.setattr(triton_common, "_TILES_PER_SORT", 2)  # exercise the chunked sort
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 40, (2, 130, 3), generator=gen, dtype=torch.int32) * 16
    starts[0, 2, 2] = -1
    starts[1, 5, 1] = starts[1, 5, 0]
    if num_keys == 1 << 25:
        starts[0, 7, 0] = num_keys - 16  # a key row that int32 keys could not hold
    keys = triton_common._union_keys(starts, tokens, num_keys is not None and num_keys < 1 << 25)
    assert keys.dtype == (torch.int32 if num_keys == 640 else torch.int64)
    cand, ncand, members = tile_candidates(starts, tokens_per_tile=tokens, num_keys=num_keys)
    n_tiles = -(-130 // tokens)
    assert cand.shape == members.shape == (2, n_tiles, 3 * tokens)
    for h in range(2):
        for tile in range(n_tiles):
            toks = starts[h, tile * tokens:(tile + 1) * tokens]
            want = sorted(set(x for x in toks.flatten().tolist() if x >= 0))
            n = int(ncand[h, tile])
            assert cand[h, tile, :n].tolist() == want
            assert torch.all(cand[h, tile, n:] == NO_BLOCK) and torch.all(members[h, tile, n:] == 0)
            for u, block in enumerate(want):
                bits = [(int(members[h, tile, u]) >> j) & 1 for j in range(tokens)]
                assert bits == [int(j < len(toks) and block in toks[j].tolist()) for j in range(tokens)]


def test_tile_candidates_one_token_is_the_selection():
    starts = torch.tensor([[[32, 0, -1], [16, -1, -1]]], dtype=torch.int32)
    cand, ncand, members = tile_candidates(starts, tokens_per_tile=1)
    assert ncand.tolist() == [[2, 1]] and members is None
    assert cand[0, 0, :2].tolist() == [32, 0] and cand[0, 1, :1].tolist() == [16]


@pytest.mark.parametrize("payload_range", [40, 1 << 28], ids=["int32-keys", "int64-keys"])
def test_bucket_runs_groups_and_splits(payload_range):
    """Every payload lands in exactly one item of its bucket, ascending, at most max_per_item per item; a bucket
    with more is split (chunks > 1); unused positions (bucket == num_buckets) are in no item; int32 and int64 sort
    keys (chosen from the shapes) give the same items; `order` maps each sorted position to its input position."""
    from openm3.ops.msa.triton_common import bucket_runs

    gen = torch.Generator().manual_seed(3)
    n, num_buckets, cap = 40, 5, 3
    bucket = torch.randint(0, num_buckets + 1, (n,), generator=gen)
    bucket[:9] = 2  # a hot bucket
    payload = torch.randperm(40, generator=gen)  # distinct, < 40 <= payload_range
    sorted_payload, sorted_bucket, b, lo, hi, live, chunks, order = bucket_runs(bucket, payload, payload_range,
                                                                               num_buckets, cap)
    assert torch.equal(payload[order].int(), sorted_payload) and torch.equal(bucket[order], sorted_bucket)
    got = {}
    for i in range(b.numel()):
        if not live[i]:
            assert lo[i] == hi[i]
            continue
        part = sorted_payload[lo[i]:hi[i]].tolist()
        assert 0 < len(part) <= cap and part == sorted(part)
        assert torch.all(sorted_bucket[lo[i]:hi[i]] == b[i])
        assert bool(chunks[i] > 1) == (int((bucket == b[i]).sum()) > cap)
        got.setdefault(int(b[i]), []).extend(part)
    want = {k: sorted(payload[bucket == k].tolist()) for k in range(num_buckets) if (bucket == k).any()}
    assert got == want


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
    with pytest.raises(ValueError, match="64 tokens"):
        attention_launch(1, 16, 16, torch.float32, False, block_m=128)
    with pytest.raises(ValueError, match="dkdv_maxnreg"):
        attention_launch(4, 16, 16, torch.float32, False, dkdv_maxnreg=-1)
    # on CPU the dq kernel follows the forward's tiling unless set
    assert attention_launch(16, 16, 16, torch.float32, False, block_m=32).dq_block_m == 32
    assert attention_launch(16, 16, 16, torch.float32, False, block_m=32, dq_block_m=16).dq_block_m == 16
    # the GPU default for M3: the hybrid forward (4-token tiles over unions of at most 40 blocks, the rest one token
    # per program), TMA, dq fused into whole-block dk/dv programs
    gpu = attention_launch(16, 128, 128, torch.bfloat16, True)
    assert (gpu.block_m, gpu.union_max, gpu.tma, gpu.dq_in_dkdv, gpu.dkdv_block_n, gpu.dkdv_block_m,
            gpu.dq_transposed) == (64, 40, 1, 1, 128, 64, 1)
    # groups of 4 (m3-small): 64-row wgmma tiles of 16 tokens over the union of their blocks, 2 stages
    small = attention_launch(4, 128, 128, torch.bfloat16, True)
    assert (small.block_m, small.tokens_per_tile(4), small.num_stages) == (64, 16, 2)


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
        if name in ("K", "V") and consts.get("USE_TMA"):
            return "tensordesc<bf16[%d, %d]>" % (consts["BLOCK_N"], consts["BLOCK_D"])
        if name == "DQ" and "dkdv" in fn.__name__:
            return "*fp32"
        if name in ("Q", "K", "V", "O", "DO", "DQ"):
            return "*bf16"
        if name in ("LSE", "DELTA", "DK", "DV"):
            return "*fp32"
        if name == "MEMB":
            return "*i64"
        if name == "TEACH":
            return "*fp16"
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
    base = dict(GROUP=group, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=128, DOT_PRECISION="tf32", WHILE_LOOPS=False,
                NUM_HEADS=4 * group, USE_TMA=bool(launch.tma), FUSE_DQ=bool(launch.dq_in_dkdv), PASS=0,
                DQ_T=bool(launch.dq_transposed), TEACHER=False, TEACHER_MEAN=0, HYBRID=0,
                UNION_TOKENS=1)
    jobs = [(ta._attn_fwd_kernel, dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                                       TOKENS=launch.tokens_per_tile(group)), launch.num_warps, launch.num_stages),
            (ta._attn_fwd_kernel, dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, USE_TMA=False,
                                       TOKENS=launch.tokens_per_tile(group)), launch.num_warps, launch.num_stages),
            (ta._attn_dq_kernel, dict(BLOCK_M=launch.dq_block_m, BLOCK_N=launch.dq_block_n,
                                      TOKENS=launch.dq_tokens_per_tile(group)), launch.dq_num_warps,
             launch.num_stages),
            (ta._attn_dkdv_kernel, dict(BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n,
                                        TOKENS=launch.dkdv_tokens(group)), launch.dkdv_num_warps,
             launch.dkdv_num_stages),
            (ta._attn_dkdv_kernel, dict(BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n, FUSE_DQ=False,
                                        TOKENS=launch.dkdv_tokens(group)), launch.dkdv_num_warps,
             launch.dkdv_num_stages),
            (ta._attn_dkdv_kernel, dict(BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n, FUSE_DQ=True,
                                        DQ_T=not launch.dq_transposed, TOKENS=launch.dkdv_tokens(group)),
             launch.dkdv_num_warps, launch.dkdv_num_stages),
            # the indexer KL's teacher stored on the way (sparse_attention_with_kl)
            (ta._attn_dkdv_kernel, dict(BLOCK_M=launch.dkdv_block_m, BLOCK_N=launch.dkdv_block_n, TEACHER=True,
                                        TEACHER_MEAN=launch.teacher_mean, TOKENS=launch.dkdv_tokens(group)),
             launch.dkdv_num_warps, launch.dkdv_num_stages),
            # the hybrid forward's two passes: 64-row tiles over narrow unions, then the other tiles' tokens alone
            (ta._attn_fwd_kernel, dict(BLOCK_M=64, BLOCK_N=launch.block_n, HYBRID=1, TOKENS=max(1, 64 // group),
                                       UNION_TOKENS=max(1, 64 // group)), launch.num_warps, launch.num_stages),
            (ta._attn_fwd_kernel, dict(BLOCK_M=max(16, group), BLOCK_N=launch.block_n, HYBRID=2, TOKENS=1,
                                       UNION_TOKENS=max(1, 64 // group)), launch.num_warps, launch.num_stages)]
    for fn, extra, warps, stages in jobs:
        consts = {k: v for k, v in {**base, **extra}.items() if k in fn.arg_names}
        sig, attrs = signature(fn, consts)
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        assert k.asm["cubin"], fn.__name__
        print(fn.__name__, group, "ok")

# the opt-in register cap of dk/dv (two 8-warp CTAs per SM), at m3-small's group of 4 with 64-key tiles
launch = attention_launch(4, 128, 128, torch.bfloat16, on_gpu=True, dkdv_block_n=64, dkdv_maxnreg=128)
consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32", WHILE_LOOPS=False, NUM_HEADS=16,
              FUSE_DQ=True, BLOCK_M=launch.dkdv_block_m, BLOCK_N=64, TOKENS=launch.dkdv_tokens(4), PASS=0,
              DQ_T=False, TEACHER=False, TEACHER_MEAN=0, BLOCK_SIZE=128)
sig, attrs = signature(ta._attn_dkdv_kernel, consts)
k = triton.compile(ASTSource(ta._attn_dkdv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=launch.dkdv_num_warps, num_stages=launch.dkdv_num_stages,
                                maxnreg=launch.dkdv_maxnreg))
assert k.asm["cubin"] and k.metadata.num_warps == 8
print("_attn_dkdv_kernel maxnreg ok")

# the opt-in split dk/dv passes (dv, then dk + dq), at m3-small's group of 4 with 64-key tiles
launch = attention_launch(4, 128, 128, torch.bfloat16, on_gpu=True, dkdv_block_n=64, dkdv_split=1)
for dkdv_pass in (1, 2):
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32", WHILE_LOOPS=False, NUM_HEADS=16,
                  FUSE_DQ=True, BLOCK_M=launch.dkdv_block_m, BLOCK_N=64, TOKENS=launch.dkdv_tokens(4),
                  PASS=dkdv_pass, DQ_T=False, TEACHER=dkdv_pass == 1, TEACHER_MEAN=0, BLOCK_SIZE=128)
    sig, attrs = signature(ta._attn_dkdv_kernel, consts)
    k = triton.compile(ASTSource(ta._attn_dkdv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=launch.dkdv_num_warps, num_stages=launch.dkdv_num_stages))
    assert k.asm["cubin"]
    print("_attn_dkdv_kernel pass", dkdv_pass, "ok")

consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16)
sig = {"DO": "*bf16", "O": "*bf16", "DELTA": "*fp32", "n_rows": "i32", "num_heads": "i32", "stride_dt": "i32",
       "stride_dh": "i32", "stride_ot": "i32", "stride_oh": "i32", **{k: "constexpr" for k in consts}}
k = triton.compile(ASTSource(ta._delta_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
assert k.asm["cubin"]
print("_delta_kernel ok")
'''


def test_kernels_compile_for_sm90():
    """The interpreter accepts programs a GPU compiler rejects (e.g. tl.dot below 16 rows): compile every kernel
    for an H100/H200 (sm_90) with the default GPU launch configs (TMA and pointer loads, dq fused into dk/dv or
    not), without a GPU (Triton's bundled ptxas)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 31, proc.stdout  # 3 groups x 9 kernels, dk/dv capped and split, delta


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
