"""MSA decode over a paged cache: the reference path (`decode.py`) against the unpaged spec, and the Triton decode
kernels (under TRITON_INTERPRET=1 on CPU, fp32) against the reference path."""

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from openm3.ops.msa import decode, reference  # noqa: E402


def make_paged(seq_lens, *, block_size, hkv, d, di, spare_pages=3, seed=0):
    """Random cache contents for sequences of `seq_lens` tokens, pages scattered in a shuffled pool.

    Returns dict with k, v [sum, Hkv, D], ki [sum, Di] (packed contiguous truth), the pools and block_table.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    ki = torch.randn(total, di, generator=gen)
    nblocks = [-(-n // block_size) for n in seq_lens]
    num_pages = sum(nblocks) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k_pages = torch.randn(num_pages, block_size, hkv, d, generator=gen)  # garbage outside the sequences
    v_pages = torch.randn(num_pages, block_size, hkv, d, generator=gen)
    ki_pages = torch.randn(num_pages, block_size, di, generator=gen)
    table = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(seq_lens):
        for j in range(nblocks[b]):
            page = perm.pop()
            table[b, j] = page
            lo, hi = start + j * block_size, start + min(n, (j + 1) * block_size)
            k_pages[page, : hi - lo] = k[lo:hi]
            v_pages[page, : hi - lo] = v[lo:hi]
            ki_pages[page, : hi - lo] = ki[lo:hi]
        start += n
    return dict(k=k, v=v, ki=ki, k_pages=k_pages, v_pages=v_pages, ki_pages=ki_pages, block_table=table)


def cu(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out


def sorted_sets(block_idx):
    return torch.sort(block_idx, dim=-1).values


REF_CASES = [
    # seq_lens, q_lens, block_size, topk, local
    ([40], [1], 8, 3, 1),
    ([33, 70, 9], [3, 1, 9], 8, 4, 2),
    ([64, 17], [16, 5], 16, 2, 1),
]


@pytest.mark.parametrize("seq_lens,q_lens,bs,topk,local", REF_CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-Q{'-'.join(map(str, c[1]))}-bs{c[2]}-k{c[3]}-loc{c[4]}"
                              for c in REF_CASES])
def test_paged_reference_matches_unpaged_spec(seq_lens, q_lens, bs, topk, local):
    hq, hkv, d, di = 4, 2, 16, 16
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=di)
    gen = torch.Generator().manual_seed(1)
    tq = sum(q_lens)
    q = torch.randn(tq, hq, d, generator=gen)
    qi = torch.randn(tq, hkv, di, generator=gen)
    cu_q, cu_k = cu(q_lens), cu(seq_lens)
    idx = decode.paged_select_blocks(qi, c["ki_pages"], c["block_table"], cu_q, seq_lens,
                                     block_size=bs, topk=topk, local_blocks=local)
    want_idx = reference.select_blocks(qi, c["ki"], cu_q, block_size=bs, topk=topk, local_blocks=local,
                                       cu_seqlens_k=cu_k)
    assert torch.equal(idx, want_idx)
    o, lse = decode.paged_sparse_attention(q, c["k_pages"], c["v_pages"], c["block_table"], idx, cu_q, seq_lens,
                                           block_size=bs)
    want_o, want_lse = reference.sparse_attention(q, c["k"], c["v"], idx, cu_q, block_size=bs, cu_seqlens_k=cu_k)
    torch.testing.assert_close(o, want_o, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)


def test_paged_dense_equals_sdpa():
    seq_lens, q_lens, bs, hq, hkv, d = [37, 20], [5, 20], 8, 4, 2, 16
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=16)
    q = torch.randn(sum(q_lens), hq, d)
    o, _ = decode.paged_dense_attention(q, c["k_pages"], c["v_pages"], c["block_table"], cu(q_lens), seq_lens,
                                        block_size=bs)
    start_k, start_q = 0, 0
    for n, m in zip(seq_lens, q_lens):
        k = c["k"][start_k:start_k + n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        v = c["v"][start_k:start_k + n].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qq = q[start_q:start_q + m].transpose(0, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(o[start_q:start_q + m], want, atol=1e-5, rtol=1e-5)
        start_k, start_q = start_k + n, start_q + m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_e8m0_quantization_is_frexp_and_ldexp(dtype):
    """The e8m0 quantizer (integer and float ops that fuse into one kernel on CUDA) equals its definition with
    torch.frexp / torch.ldexp bit for bit: magnitudes from 1e-35 to 1e35, zero rows, rows whose largest entry is
    448 times an exact power of two (where the exponent steps)."""
    def spec(ki):
        amax = ki.float().abs().amax(dim=-1).clamp_min(1e-30)
        mant, exp = torch.frexp(amax / 448.0)  # amax / 448 = mant * 2^exp, mant in [0.5, 1)
        e = (exp - (mant == 0.5).to(exp.dtype)).clamp(-126, 127)  # the smallest e with 2^e >= amax / 448
        return torch.ldexp(ki.float(), -e[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), (e + 127).byte()

    gen = torch.Generator().manual_seed(3)
    ki = torch.cat([torch.randn(600, 64, generator=gen) * torch.logspace(-35, 35, 600)[:, None], torch.zeros(2, 64),
                    2.0 ** torch.arange(-100, 100, dtype=torch.float32)[:, None] * 448 * torch.ones(1, 64)])
    ki[-50:, 7] *= -1
    ki = ki.to(dtype)
    q8, scale = decode.quantize_index_keys(ki)
    want_q8, want_scale = spec(ki)
    assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_fp8_roundtrip_and_bad_inputs():
    ki = torch.randn(10, 32) * 3
    ki[3] = 0.0  # a zero key: any scale, zero entries
    ki[4] *= 1e-30
    for scale_dtype in (torch.uint8, torch.float32):
        q8, scale = decode.quantize_index_keys(ki, scale_dtype)
        assert q8.dtype == torch.float8_e4m3fn and scale.shape == (10,) and scale.dtype == scale_dtype
        back = decode.dequantize_index_keys(q8, scale)
        amax = ki.abs().amax(-1, keepdim=True)
        assert ((back - ki).abs() <= amax / 16).all()  # e4m3: 3 mantissa bits
        assert (back[3] == 0).all()
        top = q8.float().abs().amax(-1)[amax[:, 0] > 0]
        assert (top <= 448).all() and (top >= (224 if scale_dtype == torch.uint8 else 448)).all()  # after rounding
    # e8m0: powers of two, so dequantising is exact scaling and the scale of a power-of-two row is exact too
    q8, scale = decode.quantize_index_keys(torch.tensor([[448.0, -1.0], [224.0, 3.0], [449.0, 0.0]]))
    assert scale.tolist() == [127, 126, 128]
    assert decode.index_key_scales(scale).tolist() == [1.0, 0.5, 2.0]
    assert decode.dequantize_index_keys(q8, scale)[:2].tolist() == [[448.0, -1.0], [224.0, 3.0]]
    with pytest.raises(ValueError, match="scale_dtype"):
        decode.quantize_index_keys(ki, torch.float16)
    with pytest.raises(ValueError, match="ki must be"):
        decode.quantize_index_keys(ki[None])
    c = make_paged([20], block_size=8, hkv=1, d=16, di=16)
    qi = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="ki_scale"):
        decode.paged_select_blocks(qi, q8.new_zeros(5, 8, 16), c["block_table"], cu([1]), [20], block_size=8, topk=2)
    with pytest.raises(ValueError, match="ki_scale must be uint8"):
        decode.paged_select_blocks(qi, q8.new_zeros(5, 8, 16), c["block_table"], cu([1]), [20], block_size=8, topk=2,
                                   ki_scale=torch.ones(5, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_table"):
        decode.paged_select_blocks(qi, c["ki_pages"], c["block_table"].long(), cu([1]), [20], block_size=8, topk=2)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        decode.paged_select_blocks(qi, c["ki_pages"], c["block_table"], cu([21]), [20], block_size=8, topk=2)
    bad = c["block_table"].clone()
    bad[0, 0] = 999
    with pytest.raises(ValueError, match="page ids"):
        decode.paged_select_blocks(qi, c["ki_pages"], bad, cu([1]), [20], block_size=8, topk=2)


# ---------------------------------------------------------------- Triton decode kernels (interpreter on CPU)

def _triton():
    return pytest.importorskip("openm3.ops.msa.triton_decode")


DECODE_CASES = [
    # seq_lens, q_len, block_size, Hq, Hkv, D, Di, topk, local
    ([50], 1, 16, 4, 2, 16, 16, 2, 1),
    ([16, 70, 33], 1, 16, 8, 2, 16, 32, 3, 1),
    ([40, 97], 3, 16, 4, 1, 32, 16, 4, 2),
]


def _decode_id(c):
    return f"L{'-'.join(map(str, c[0]))}-Q{c[1]}-bs{c[2]}-Hq{c[3]}-Hkv{c[4]}-D{c[5]}-Di{c[6]}-k{c[7]}-loc{c[8]}"


@pytest.mark.parametrize("fp8", [None, torch.uint8, torch.float32], ids=["idx-fp32", "idx-fp8", "idx-fp8-fp32-scale"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[_decode_id(c) for c in DECODE_CASES])
def test_triton_decode_matches_reference(case, fp8):
    td = _triton()
    seq_lens, q_len, bs, hq, hkv, d, di, topk, local = case
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=di)
    gen = torch.Generator().manual_seed(2)
    rows = q_len * len(seq_lens)
    q = torch.randn(rows, hq, d, generator=gen)
    qi = torch.randn(rows, hkv, di, generator=gen)
    table, lens = c["block_table"], torch.tensor(seq_lens, dtype=torch.int32)
    cu_q = cu([q_len] * len(seq_lens))
    ki_pages, ki_scale = c["ki_pages"], None
    if fp8:  # the scale's storage dtype: uint8 e8m0 exponents (the cache's) or fp32
        flat, scale = decode.quantize_index_keys(ki_pages.flatten(0, 1), fp8)
        assert scale.dtype == fp8
        ki_pages, ki_scale = flat.view(ki_pages.shape), scale.view(ki_pages.shape[:2])
    want_idx = decode.paged_select_blocks(qi, ki_pages, table, cu_q, seq_lens, block_size=bs, topk=topk,
                                          local_blocks=local, ki_scale=ki_scale)
    idx = td.decode_select_blocks(qi, ki_pages, table, lens, q_len=q_len, block_size=bs, topk=topk,
                                  local_blocks=local, ki_scale=ki_scale,
                                  segment_blocks=None if fp8 else 2)  # several segments, or the default
    assert torch.equal(sorted_sets(idx), sorted_sets(want_idx))
    # forced local blocks come first, in the documented order
    pos = torch.cat([torch.arange(n - q_len, n) for n in seq_lens])
    for l in range(local):
        own = pos // bs - l
        assert torch.equal(idx[:, :, l], torch.where(own >= 0, own, -1).to(torch.int32)[None].expand(hkv, -1))
    o, lse = td.decode_attention(q, c["k_pages"], c["v_pages"], table, lens, idx, q_len=q_len)
    want_o, want_lse = decode.paged_sparse_attention(q, c["k_pages"], c["v_pages"], table, want_idx, cu_q,
                                                     seq_lens, block_size=bs)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score_loads", ["table", "hoist"])
@pytest.mark.parametrize("fp8", [None, torch.uint8, torch.float32], ids=["idx-fp32", "idx-fp8", "idx-fp8-fp32-scale"])
def test_triton_decode_selection_ignores_what_lies_outside_the_sequences(fp8, score_loads):
    """The scoring kernel ranks only blocks wholly before each row's forced local blocks, so nothing it reads
    for other blocks may matter: NaN / inf in the unused tail of each sequence's last page and in spare pages,
    and garbage page ids past each sequence's blocks in the table, give the reference's selection. Several
    queries per sequence, so the last page is a later (invisible) block for the earlier rows."""
    td = _triton()
    seq_lens, q_len, bs, hkv, di, topk, local = [37, 70, 100], 3, 16, 2, 16, 4, 1
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=16, di=di)
    table, lens = c["block_table"].clone(), torch.tensor(seq_lens, dtype=torch.int32)
    poison = torch.ones(c["ki_pages"].shape[:2], dtype=torch.bool)  # [P, bs]: slots no sequence owns
    for b, n in enumerate(seq_lens):
        nb = -(-n // bs)
        for j in range(nb):
            poison[table[b, j], : min(bs, n - j * bs)] = False
        table[b, nb:] = 1 << 30  # never to be read: past the sequence
    assert poison.any() and table.max() == 1 << 30
    ki_pages, ki_scale, want_scale = c["ki_pages"].clone(), None, None
    if fp8:
        flat, want_scale = decode.quantize_index_keys(ki_pages.flatten(0, 1), fp8)
        ki_pages, want_scale = flat.view(ki_pages.shape), want_scale.view(poison.shape)
        bad = float("nan") if fp8 == torch.float32 else 255  # e8m0's NaN code; it reads as +inf here
        ki_scale = torch.where(poison, torch.tensor(bad, dtype=fp8), want_scale)
    else:
        ki_pages[poison] = float("nan")
        ki_pages[poison.all(-1)] = float("inf")  # the spare pages
    gen = torch.Generator().manual_seed(3)
    qi = torch.randn(q_len * len(seq_lens), hkv, di, generator=gen)
    want = decode.paged_select_blocks(qi, c["ki_pages"] if not fp8 else ki_pages, c["block_table"],
                                      cu([q_len] * len(seq_lens)), seq_lens, block_size=bs, topk=topk,
                                      local_blocks=local, ki_scale=want_scale)
    got = td.decode_select_blocks(qi, ki_pages, table, lens, q_len=q_len, block_size=bs, topk=topk,
                                  local_blocks=local, ki_scale=ki_scale, segment_blocks=2, score_loads=score_loads)
    assert torch.equal(got, want)


MSA_CASES = [
    # seq_lens, q_len, block_size, Hq, Hkv, D, Di, topk, local, segment_blocks, slots_per_split
    ([50, 130], 1, 16, 4, 2, 16, 16, 3, 1, 2, 1),
    ([16, 70, 33], 2, 16, 8, 2, 16, 32, 4, 2, 1, 3),
    ([97], 1, 16, 4, 1, 32, 16, 5, 1, None, 2),
]


MSA_VARIANTS = {"default": {}, "shrink-rounds-merge-kernel": dict(merge_direct_max=4, merge_sort=False,
                                                                   fuse_merge=False),
                "shrink-sort-fused-combine": dict(merge_direct_max=4, fuse_combine=True),
                "rounds-fused-merge": dict(merge_sort=False, fuse_merge=True),
                # batch-1 knobs: hoisted page ids / TMA key loads, the shrink folded into the scoring kernel (with
                # several groups, the last one partial), PDL (a no-op under the interpreter), the 2-launch step
                "hoist-s4-fold-pdl": dict(score_loads="hoist", stages=4, fold_shrink=True, merge_direct_max=4,
                                          pdl=True),
                "tma-fold-merge-kernel": dict(score_loads="tma", fold_shrink=True, merge_direct_max=4,
                                              fuse_merge=False),
                "two-launch": dict(score_loads="hoist", fold_shrink=True, merge_direct_max=4, fuse_combine=True),
                # each scoring program's best keys only (sorted in its epilogue: the default before session 17)
                "keep-best": dict(keep_all=False), "shrink-3-groups": dict(merge_direct_max=4, shrink_groups=3),
                "keep-best-fold": dict(keep_all=False, fold_shrink=True, merge_direct_max=4),
                "fold-tma-fused-combine": dict(score_loads="tma", fold_shrink=True, merge_direct_max=4,
                                               fuse_combine=True)}


@pytest.mark.parametrize("variant", list(MSA_VARIANTS))
@pytest.mark.parametrize("index", ["fp32", "fp8-fp32q", "fp8-fp16q"])
@pytest.mark.parametrize("case", MSA_CASES, ids=[_decode_id(c) + f"-seg{c[9]}-slots{c[10]}" for c in MSA_CASES])
def test_triton_decode_msa_equals_select_then_attend(case, index, variant):
    """The fused step (each attention split merges its row's candidates; optionally candidate rows shrunk first,
    bitonic top-k, combine fused into the last split) equals select + attend, and the spec."""
    td = _triton()
    seq_lens, q_len, bs, hq, hkv, d, di, topk, local, seg, slots = case
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=di, seed=3)
    gen = torch.Generator().manual_seed(4)
    rows = q_len * len(seq_lens)
    q = torch.randn(rows, hq, d, generator=gen)
    qi = torch.randn(rows, hkv, di, generator=gen)
    if index == "fp8-fp16q":  # fp16 queries times fp8 keys: the fp16 product path
        qi = qi.half()
    table, lens = c["block_table"], torch.tensor(seq_lens, dtype=torch.int32)
    ki_pages, ki_scale = c["ki_pages"], None
    if index != "fp32":
        flat, scale = decode.quantize_index_keys(ki_pages.flatten(0, 1))
        ki_pages, ki_scale = flat.view(ki_pages.shape), scale.view(ki_pages.shape[:2])
    knobs = MSA_VARIANTS[variant]
    o, lse, idx = td.decode_msa(q, qi, c["k_pages"], c["v_pages"], ki_pages, table, lens, q_len=q_len, topk=topk,
                                local_blocks=local, ki_scale=ki_scale, segment_blocks=seg, slots_per_split=slots,
                                **knobs)
    merge = {k: v for k, v in knobs.items() if k not in ("fuse_combine", "fuse_merge")}
    sel = td.decode_select_blocks(qi, ki_pages, table, lens, q_len=q_len, block_size=bs, topk=topk,
                                  local_blocks=local, ki_scale=ki_scale, segment_blocks=seg, **merge)
    assert torch.equal(idx, sel)  # same candidates, same merge: identical lists, order included
    want_idx = decode.paged_select_blocks(qi, ki_pages, table, cu([q_len] * len(seq_lens)), seq_lens, block_size=bs,
                                          topk=topk, local_blocks=local, ki_scale=ki_scale)
    assert torch.equal(sorted_sets(idx), sorted_sets(want_idx))
    want_o, want_lse = decode.paged_sparse_attention(q, c["k_pages"], c["v_pages"], table, want_idx,
                                                     cu([q_len] * len(seq_lens)), seq_lens, block_size=bs)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["idx-fp32", "idx-fp8"])
def test_decode_msa_rows_do_not_depend_on_the_drafts_beside_them(fp8):
    """A step of q_len = 4 queries per sequence (a token and 3 drafts: 12 rows) gives each query bit for bit what
    a one-query step over the same keys gives it: the default split of the attention follows the sequences, not
    the rows, so speculative decoding's greedy tokens are plain decoding's in any precision."""
    td = _triton()
    seq_lens, q_len, bs, hq, hkv, d, di, topk = [70, 45, 100], 4, 16, 4, 2, 16, 16, 3
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=di, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(seq_lens), q_len, hq, d, generator=gen)
    qi = torch.randn(len(seq_lens), q_len, hkv, di, generator=gen)
    ki_pages, ki_scale = c["ki_pages"], None
    if fp8:
        flat, scale = decode.quantize_index_keys(ki_pages.flatten(0, 1))
        ki_pages, ki_scale = flat.view(ki_pages.shape), scale.view(ki_pages.shape[:2])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (c["k_pages"], c["v_pages"], ki_pages, c["block_table"])
    o, lse, idx = td.decode_msa(q.flatten(0, 1), qi.flatten(0, 1), *args, lens, q_len=q_len, topk=topk,
                                ki_scale=ki_scale)
    for j in range(q_len):  # query j of each sequence sees its first len - (q_len - 1 - j) tokens
        o1, lse1, idx1 = td.decode_msa(q[:, j].contiguous(), qi[:, j].contiguous(), *args, lens - (q_len - 1 - j),
                                       q_len=1, topk=topk, ki_scale=ki_scale)
        assert torch.equal(idx[:, j::q_len], idx1)
        assert torch.equal(o.view(len(seq_lens), q_len, hq, d)[:, j], o1), j
        assert torch.equal(lse.view(len(seq_lens), q_len, hq)[:, j], lse1), j


# One argument broken at a time in an otherwise valid call (one 40-token sequence, blocks of 16, 2 KV heads, head
# dims 16): (entry point, {argument: bad value, or a function of the valid one}, the ValueError's message).
BAD_DECODE_CALLS = [
    ("decode_msa", dict(qi=lambda qi: qi[:, :1]), "qi must be"),
    ("decode_msa", dict(segment_blocks=3), "segment_blocks"),
    ("decode_msa", dict(stages=0), "stages"),
    ("decode_msa", dict(k_pages=lambda k: k[..., :8]), "k_pages"),
    ("decode_select_blocks", dict(fp8_math="bf16"), "fp8_math"),
    ("decode_select_blocks", dict(score_loads="cp.async"), "score_loads"),
    ("decode_select_blocks", dict(q_len=2), "q_len"),
    ("decode_select_blocks", dict(seq_lens=lambda lens: lens.long()), "seq_lens"),
    ("decode_select_blocks", dict(local_blocks=3), "local_blocks"),
    ("decode_attention", dict(block_idx=torch.zeros(2, 1, 2, dtype=torch.int64)), "block_idx"),
    ("decode_msa", dict(shrink_groups=0), "shrink_groups"),
]


@pytest.mark.parametrize("fn, bad, match", BAD_DECODE_CALLS,
                         ids=[f"{fn}-{match.split()[0]}" for fn, _, match in BAD_DECODE_CALLS])
def test_triton_decode_bad_inputs(fn, bad, match):
    td = _triton()
    c = make_paged([40], block_size=16, hkv=2, d=16, di=16)
    valid = dict(q=torch.randn(1, 4, 16), qi=torch.randn(1, 2, 16), k_pages=c["k_pages"], v_pages=c["v_pages"],
                 ki_pages=c["ki_pages"], block_table=c["block_table"], seq_lens=torch.tensor([40], dtype=torch.int32),
                 block_idx=None, q_len=1, block_size=16, topk=2)
    entry = getattr(td, fn)
    args = {name: valid[name] for name in inspect.signature(entry).parameters if name in valid}
    args.update({name: change(args[name]) if callable(change) else change for name, change in bad.items()})
    with pytest.raises(ValueError, match=match):
        entry(**args)


@pytest.mark.parametrize("slots", [1, 3], ids=["split1", "split3"])
def test_triton_dense_decode_matches_reference(slots):
    td = _triton()
    seq_lens, q_len, bs, hq, hkv, d = [16, 75, 40], 2, 16, 4, 2, 16
    c = make_paged(seq_lens, block_size=bs, hkv=hkv, d=d, di=16)
    q = torch.randn(q_len * len(seq_lens), hq, d)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    o, lse = td.decode_attention(q, c["k_pages"], c["v_pages"], c["block_table"], lens, None, q_len=q_len,
                                 slots_per_split=slots)
    want_o, want_lse = decode.paged_dense_attention(q, c["k_pages"], c["v_pages"], c["block_table"],
                                                    cu([q_len] * 3), seq_lens, block_size=bs)
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


_COMPILE_SCRIPT = r'''
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openm3.ops.msa import triton_decode as td

def compile_(fn, sig, consts, warps=4, stages=3):
    # pointers and strides 16-divisible, as the JIT specialises them at run time (this is what vectorises loads)
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n.startswith("stride")}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})

table = {"table_ptr": "*i32", "lens_ptr": "*i32"}
merge = dict(LOCAL=1, TOPK=16, TOPK_P2=16, NC=256, NEG_KEY=td._NEG_INF_KEY)
score = {"ks_ptr": "*u8", **table, "cand_ptr": "*i64", "fold_ptr": "*i64", "count_ptr": "*i32", "max_blocks": "i32",
         "n_seg": "i32", "n_groups": "i32", "stride_table": "i32", "stride_page": "i32"}
for dt, prec, fp8 in (("bf16", "tf32", False), ("bf16", "tf32", True), ("fp32", "ieee", False), ("fp32", "ieee", True)):
    key_t = "u8" if fp8 else dt
    # (page loads, fold, pdl, stages, seg, keep_all): the default at every segment size; hoisted page ids (4
    # stages), TMA, and the shrink folded in + PDL at the bf16 query shapes the H200 runs; the 1M-token batch-1
    # step (TMA, 16-block segments, every block's key), with the shrink folded in and without
    variants = [("table", 0, False, 3, seg, False) for seg in (2, 16, 128)]
    if dt == "bf16":
        variants += [("hoist", 0, False, 4, 16, False), ("tma", 0, False, 3, 16, False),
                     ("hoist", 64, True, 3, 8, False), ("tma", 0, True, 3, 16, True), ("tma", 32, True, 3, 16, True)]
    shared = {}
    for loads, fold, pdl, stages, seg, keep_all in variants:
        ki = f"tensordesc<{key_t}[128, 128]>" if loads == "tma" else f"*{key_t}"
        kp = seg if keep_all else min(seg, 15)
        # fp8 keys' per-token scales: e8m0 bytes (the cache's), fp32 at the 2-block segments (also accepted)
        ks = {"ks_ptr": "*fp32"} if seg == 2 else {}
        consts = dict(Q=1, HI=4, DI=128, BS=128, BLOCK_M=16, SEG=seg, KP=kp, LOCAL=1, FP8=fp8,
                      HALF=fp8 and dt == "bf16", PRECISION=prec, STAGES=stages, HOIST=loads == "hoist",
                      TMA=loads == "tma", FOLD_SEGS=fold, FOLD_P2=triton.next_power_of_2(fold * kp) if fold else 1,
                      FOLD_ROWS=4 if fold else 1, KEEP=15, KEEP_P2=16, PDL=pdl, SPLIT=False)
        k = compile_(td._score_segment_kernel, {"qi_ptr": f"*{dt}", "ki_ptr": ki, **score, **ks}, consts,
                     stages=stages)
        if fp8 and loads == "tma" and keep_all and not fold:
            # the e8m0 bytes load as words the pipeliner copies asynchronously, as fp32 scales do (a 1-byte load per
            # thread is not a cp.async: it waited in every iteration; the 128K batch-1 step read 13.6 us against
            # 12.6 with fp32 scales, session 21). One twin, the GPU default's: the scale load is the same code
            # (`_token_scales`) whatever the key loads.
            f32 = compile_(td._score_segment_kernel, {"qi_ptr": f"*{dt}", "ki_ptr": ki, **score, "ks_ptr": "*fp32"},
                           consts, stages=stages)
            n_async = k.asm["ttgir"].count("async_copy_global_to_local")
            assert n_async == f32.asm["ttgir"].count("async_copy_global_to_local") > 0, (loads, seg, n_async)
        if loads == "hoist":  # the point of hoisting the page ids: stages - 1 key tiles buffered, not one
            buffers = re.findall(r"local_alloc.*memdesc<(\d+)x128x128xi8", k.asm["ttgir"]) if fp8 else None
            assert buffers is None or buffers == [str(stages - 1)], buffers
        if keep_all:
            shared[fold] = k.metadata.shared
        if pdl:
            assert "griddepcontrol.wait" in k.asm["ptx"]
    if shared:  # the default sizes segments for ~_KEEP_ALL_PROGRAMS_PER_SM scoring programs per SM: they must
        # fit (228 KiB per sm_90 SM, 1 KiB of it reserved per program); the folded shrink's sort may not add
        # shared memory (session 18: a variant whose second copy of the key loop doubled it took the scoring
        # kernel from 35 to 45 us at 1M tokens; the default's is ~38 KB with fp8 keys)
        assert td._KEEP_ALL_PROGRAMS_PER_SM * (shared[0] + 1024) <= 228 * 1024, shared
        assert shared[32] == shared[0], shared
    if fp8 and dt == "bf16":  # fp8 tensor-core scoring: keys straight from the TMA buffer into the MMA
        for seg, stages in ((8, 3), (32, 4)):
            k = compile_(td._score_segment_kernel, {"qi_ptr": "*bf16", "ki_ptr": "tensordesc<fp8e4nv[128, 128]>",
                                                    **score},
                         dict(Q=1, HI=4, DI=128, BS=128, BLOCK_M=16, SEG=seg, KP=min(seg, 15), LOCAL=1, FP8=True,
                              HALF=False, PRECISION=prec, STAGES=stages, HOIST=False, TMA=True, FOLD_SEGS=0,
                              FOLD_P2=1, FOLD_ROWS=1, KEEP=15, KEEP_P2=16, PDL=True, SPLIT=True),
                         stages=stages)
            assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in k.asm["ptx"]
            # the key tiles feed the MMA from shared memory, the query terms are staged once, before the loop
            loop = k.asm["ttgir"].split("scf.for")[1]
            assert "local_alloc %" not in loop and loop.count("warp_group_dot ") == 2
    for mode, sort, fuse, pdl in ((0, False, False, False), (1, False, True, False), (2, False, False, False),
                                  (2, True, True, False), (2, True, False, dt == "bf16")):
        compile_(td._attention_split_kernel,
                 {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "idx_ptr": "*i32", "cand_ptr": "*i64",
                  **table, "o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "o_ptr": f"*{dt}", "lse_ptr": "*fp32",
                  "count_ptr": "*i32", "sm_scale": "fp32", "total_rows": "i32",
                  "n_slots": "i32", "n_splits": "i32", "n_cand": "i32", "stride_table": "i32",
                  "stride_page": "i32", "stride_tok": "i32"},
                 dict(Q=1, HQ=64, HKV=4, D=128, BS=128, BLOCK_G=16, SLOTS=4 if mode == 0 else 1, MODE=mode,
                      PRECISION=prec, SORT=sort, FUSE=fuse, BLOCK_S=16, PDL=pdl, **merge))
    for pdl in (False, True) if dt == "bf16" else (False,):
        compile_(td._combine_kernel, {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "o_ptr": f"*{dt}",
                                      "lse_ptr": "*fp32"}, dict(N_SPLITS=16, D=128, BLOCK_S=16, PDL=pdl))
for sort, pdl in ((False, False), (True, True)):
    compile_(td._topk_merge_kernel, {"cand_ptr": "*i64", "lens_ptr": "*i32", "out_ptr": "*i32", "n_cand": "i32",
                                     "total_rows": "i32"}, dict(Q=1, HI=4, BS=128, SORT=sort, PDL=pdl, **merge))
    compile_(td._topk_partial_kernel, {"cand_ptr": "*i64", "out_ptr": "*i64", "n_cand": "i32", "n_groups": "i32"},
             dict(GROUP=512, KEEP=15, KEEP_P2=16, SORT=sort, PDL=pdl))
print("compiled")
'''


def test_decode_kernels_compile_for_hopper(tmp_path):
    """The interpreter accepts code a GPU compile rejects (e.g. non-constexpr globals), so compile every decode
    kernel for sm_90 (Triton front end + the bundled ptxas, no GPU needed) at M3's shapes, bf16/fp8/fp32."""
    from hopper_compile import run_compile_script

    run_compile_script(_COMPILE_SCRIPT, tmp_path)


def test_default_segments_cap_the_candidates_per_row():
    """Scoring segments. keep_all=False: ~4 programs per SM, grown until a row keeps <= 4096 candidates (long
    batch-1 rows). keep_all (the default): ~2 programs per SM, every block a candidate."""
    td = _triton()
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU, as on an H200
    sizes = {(1024, 1): 2, (1024, 32): 32, (8192, 1): 32, (8192, 32): 128, (16384, 1): 64, (32, 1): 2}
    for (blocks, batch), want in sizes.items():
        seg = td._default_segment_blocks(blocks, batch, cpu, keep_all=False)
        assert seg == want, (blocks, batch, seg)
        assert -(-blocks // seg) * min(seg, 15) <= td._MAX_ROW_CANDIDATES
    sizes = {(1024, 1): 2, (1024, 32): 64, (8192, 1): 16, (8192, 32): 128, (16384, 1): 32, (32, 1): 2}
    for (blocks, batch), want in sizes.items():
        assert td._default_segment_blocks(blocks, batch, cpu) == want, (blocks, batch)


def test_default_shrink_groups():
    """32 shrink groups where each group keeps >= 256 keys and the shrink runs at most ~8 programs per SM (1M
    tokens at batch 1-16: 4-64 rows of 8,192 candidates); 16 at batch 32 and for 128K-token rows (1,024)."""
    td = _triton()
    cpu = torch.device("cpu")  # 132 SMs assumed off-GPU, as on an H200
    sizes = {(4, 8192): 32, (4, 16384): 32, (128, 8192): 16, (4, 1024): 16, (16, 8192): 32, (64, 8192): 32,
             (72, 8192): 16, (8, 4096): 16}
    for (rows, n_cand), want in sizes.items():
        assert td._default_shrink_groups(rows, n_cand, cpu) == want, (rows, n_cand)


def test_triton_decode_e8m0_scales_need_word_loads():
    """e8m0 scales load as int32 words: the same selection as the same scales in fp32, and a tensor that is not
    4-byte aligned is refused up front."""
    td = _triton()
    ki = torch.randn(3 * 16, 16)
    q8, scale = decode.quantize_index_keys(ki)
    table, lens, qi = torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.tensor([48], dtype=torch.int32), ki[:1, None]
    common = dict(q_len=1, block_size=16, topk=2, local_blocks=1)
    got = td.decode_select_blocks(qi, q8.view(3, 16, 16), table, lens, ki_scale=scale.view(3, 16), **common)
    want = td.decode_select_blocks(qi, q8.view(3, 16, 16), table, lens,
                                   ki_scale=decode.index_key_scales(scale).view(3, 16), **common)
    assert torch.equal(got, want)
    odd = torch.empty(3 * 16 + 1, dtype=torch.uint8)[1:].view(3, 16)
    odd.copy_(scale.view(3, 16))
    with pytest.raises(ValueError, match="4-byte aligned"):
        td.decode_select_blocks(qi, q8.view(3, 16, 16), table, lens, ki_scale=odd, **common)
