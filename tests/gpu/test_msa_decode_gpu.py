"""Triton MSA decode kernels on a CUDA GPU at M3's attention shape, bf16 KV, bf16 and fp8 index keys.

    .venv/bin/python -m pytest -q tests/gpu/test_msa_decode_gpu.py

Selection is compared with the reference path on the same cached keys as sets per (query, head) (scores are
accumulated in another order, so exact near-ties may flip: at least 99% must agree, on data with a drifting
query as a trained indexer's); attention is compared on the reference's own selection, and its error against the
fp32 reference must stay within 2x the error of a bf16 PyTorch computation of the same attention (+ a small
floor). The last test captures a whole decode step (select + attention) in a CUDA graph and replays it.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

HQ, HKV, D, HI, DI, BLOCK, TOPK = 64, 4, 128, 4, 128, 128, 16


def paged_inputs(seq_lens, q_len, *, index_fp8, seed=0, hq=HQ):
    """A shuffled page pool holding sequences of `seq_lens` tokens and the new queries."""
    from openm3.ops.msa import decode

    gen = torch.Generator(device="cuda").manual_seed(seed)
    nblocks = [-(-n // BLOCK) for n in seq_lens]
    pages = sum(nblocks) + 5
    k = torch.randn(pages, BLOCK, HKV, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(pages, BLOCK, HKV, D, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(pages, BLOCK, DI, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(nblocks):
        table[b, :n] = perm[start:start + n]
        start += n
    rows = len(seq_lens) * q_len
    q = torch.randn(rows, hq, D, device="cuda", generator=gen).bfloat16()
    # index queries correlated with a few cached keys so selections are not a sea of near-ties
    qi = torch.randn(rows, HI, DI, device="cuda", generator=gen)
    for r in range(rows):
        b = r // q_len
        picks = torch.randint(0, seq_lens[b], (HI,), device="cuda", generator=gen)
        page = table[b, picks // BLOCK].long()
        qi[r] += 0.3 * ki[page, picks % BLOCK].float()
    qi = qi.bfloat16()
    scale = None
    if index_fp8:
        flat, s = decode.quantize_index_keys(ki.flatten(0, 1))
        ki, scale = flat.view(ki.shape), s.view(ki.shape[:2])
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return dict(q=q, qi=qi, k=k, v=v, ki=ki, ki_scale=scale, table=table, lens=lens)


def cu(lengths):
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device="cuda")
    out[1:] = torch.tensor(lengths, device="cuda").cumsum(0)
    return out


def bf16_reference_error(x, want_o, seq_lens, q_len, block_idx):
    """Max error of a plain bf16 PyTorch attention over the same selection (the 2x bound's yardstick)."""
    from openm3.ops.msa import decode

    lens = list(seq_lens)
    k = decode.gather_pages(x["k"], x["table"], lens, BLOCK)
    v = decode.gather_pages(x["v"], x["table"], lens, BLOCK)
    errs, start = [], 0
    g = x["q"].shape[1] // HKV
    for b, n in enumerate(lens):
        for i in range(q_len):
            r = b * q_len + i
            pos = n - q_len + i
            for h in range(HKV):
                blocks = [j for j in block_idx[h, r].tolist() if j >= 0]
                keys = torch.cat([torch.arange(j * BLOCK, min((j + 1) * BLOCK, pos + 1), device="cuda")
                                  for j in blocks])
                kk, vv = k[start + keys, h], v[start + keys, h]  # bf16
                s = (x["q"][r, h * g:(h + 1) * g] @ kk.T) * (1 / math.sqrt(D))
                o = torch.softmax(s.float(), -1).bfloat16() @ vv
                errs.append((o.float() - want_o[r, h * g:(h + 1) * g].float()).abs().max())
        start += n
    return torch.stack(errs).max().item()


CASES = [([131072], 1, HQ), ([300, 9000, 70000], 1, HQ), ([5000, 20000], 2, HQ),
         ([16384] * 8, 5, HQ), ([16384] * 8, 5, 16)]  # speculative steps: 4 drafts per sequence at batch 8, M3's
# 16 query heads per KV head and m3-small's 4
# the batch-1 knobs (benchmarks/msa_decode.py times them): hoisted page ids / TMA key loads, the shrink folded
# into the scoring kernel, programmatic dependent launch, the 2-launch step; merge_direct_max=16 makes every row
# here fold or shrink
BATCH1_KNOBS = {
    "hoist-s4": dict(score_loads="hoist", stages=4),
    "tma-s4-fold-pdl": dict(score_loads="tma", stages=4, fold_shrink=True, merge_direct_max=16, pdl=True),
    "hoist-fold-pdl-merge-kernel": dict(score_loads="hoist", fold_shrink=True, merge_direct_max=16, pdl=True,
                                        fuse_merge=False),
    "two-launch-pdl": dict(score_loads="hoist", stages=4, fold_shrink=True, merge_direct_max=16, fuse_combine=True,
                           pdl=True),
    # each scoring program's best keys only, sorted in its epilogue (the default before session 17)
    "keep-best-tma": dict(score_loads="tma", keep_all=False),
    "keep-best-fold": dict(keep_all=False, fold_shrink=True, merge_direct_max=16),
    "shrink-32-groups": dict(merge_direct_max=16, shrink_groups=32),
    "shrink-16-groups": dict(merge_direct_max=16, shrink_groups=16),
}


@pytest.mark.parametrize("index_fp8", [False, True], ids=["idx-bf16", "idx-fp8"])
@pytest.mark.parametrize("seq_lens,q_len,hq", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}-Q{c[1]}-Hq{c[2]}-Hkv4-D128-bs128-k16" for c in CASES])
def test_decode_kernels_match_reference(seq_lens, q_len, hq, index_fp8):
    from openm3.ops.msa import decode, triton_decode

    x = paged_inputs(seq_lens, q_len, index_fp8=index_fp8, hq=hq)
    cu_q = cu([q_len] * len(seq_lens))
    want_idx = decode.paged_select_blocks(x["qi"], x["ki"], x["table"], cu_q, seq_lens, block_size=BLOCK, topk=TOPK,
                                          ki_scale=x["ki_scale"])
    idx = triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], q_len=q_len, block_size=BLOCK,
                                             topk=TOPK, ki_scale=x["ki_scale"])
    same = (idx.sort(-1).values == want_idx.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.99, same
    # the shrink folded into the scoring kernel keeps the same keys as its own launch (keys are unique: identical)
    select = dict(q_len=q_len, block_size=BLOCK, topk=TOPK, ki_scale=x["ki_scale"], merge_direct_max=16)
    assert torch.equal(triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], **select),
                       triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], fold_shrink=True,
                                                          score_loads="tma" if index_fp8 else "table", **select))
    o, lse = triton_decode.decode_attention(x["q"], x["k"], x["v"], x["table"], x["lens"], want_idx, q_len=q_len)
    want_o, want_lse = decode.paged_sparse_attention(x["q"].float(), x["k"], x["v"], x["table"], want_idx, cu_q,
                                                     seq_lens, block_size=BLOCK)
    bound = 2 * bf16_reference_error(x, want_o, seq_lens, q_len, want_idx) + 1e-3
    assert (o.float() - want_o).abs().max().item() <= bound
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=0)
    # the one-call step: its selection is select's, its attention decode_attention's on that selection
    for knobs in ({}, dict(merge_direct_max=16, fuse_combine=True, segment_blocks=2, fuse_merge=True),
                  dict(merge_sort=False, fuse_merge=False), *BATCH1_KNOBS.values()):
        o2, lse2, idx2 = triton_decode.decode_msa(x["q"], x["qi"], x["k"], x["v"], x["ki"], x["table"], x["lens"],
                                                  q_len=q_len, topk=TOPK, ki_scale=x["ki_scale"], **knobs)
        merge = {k: v for k, v in knobs.items() if k not in ("fuse_combine", "fuse_merge")}
        assert torch.equal(idx2, triton_decode.decode_select_blocks(
            x["qi"], x["ki"], x["table"], x["lens"], q_len=q_len, block_size=BLOCK, topk=TOPK,
            ki_scale=x["ki_scale"], **merge))
        o3, lse3 = triton_decode.decode_attention(x["q"], x["k"], x["v"], x["table"], x["lens"], idx2, q_len=q_len)
        torch.testing.assert_close(o2.float(), o3.float(), atol=4e-3, rtol=0)  # a bf16 rounding of the same sum
        torch.testing.assert_close(lse2, lse3, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seq_lens,q_len", [([4000, 70000], 1), ([16384] * 8, 5)], ids=["Q1", "B8-Q5"])
def test_dense_decode_matches_sdpa(seq_lens, q_len):
    from openm3.ops.msa import decode, triton_decode

    x = paged_inputs(seq_lens, q_len, index_fp8=False)
    o, _ = triton_decode.decode_attention(x["q"], x["k"], x["v"], x["table"], x["lens"], None, q_len=q_len)
    k = decode.gather_pages(x["k"], x["table"], seq_lens, BLOCK)
    v = decode.gather_pages(x["v"], x["table"], seq_lens, BLOCK)
    start = 0
    for b, n in enumerate(seq_lens):
        for i in range(q_len):  # query i sits at position n - q_len + i: it sees the keys up to there
            r, pos = b * q_len + i, n - q_len + i
            kk = k[start:start + pos + 1].transpose(0, 1)[None]
            vv = v[start:start + pos + 1].transpose(0, 1)[None]
            want = torch.nn.functional.scaled_dot_product_attention(x["q"][r][None, :, None].float(), kk.float(),
                                                                    vv.float(), enable_gqa=True)[0, :, 0]
            assert (o[r].float() - want).abs().max().item() < 2e-2, (b, i)
        start += n


GRAPH_STEPS = {"select-then-attend": None, "msa-step-default": {},
               "msa-step-fused-combine": dict(merge_direct_max=16, fuse_combine=True),
               **{f"msa-step-{name}": knobs for name, knobs in BATCH1_KNOBS.items()}}


@pytest.mark.parametrize("knobs", list(GRAPH_STEPS.values()), ids=list(GRAPH_STEPS))
def test_decode_step_captures_in_a_cuda_graph(knobs):
    """Replays follow in-place updates; the arrival counters of the fused combine and of the folded shrink are
    back at zero after every launch (a stale counter would skip the combine / the group's shrink and leave old
    outputs); PDL launches keep their order inside the graph."""
    from openm3.ops.msa import triton_decode

    x = paged_inputs([20000, 3000], 1, index_fp8=True)

    def step():
        if knobs is not None:
            return triton_decode.decode_msa(x["q"], x["qi"], x["k"], x["v"], x["ki"], x["table"], x["lens"], q_len=1,
                                            topk=TOPK, ki_scale=x["ki_scale"], **knobs)[0]
        idx = triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], q_len=1, block_size=BLOCK,
                                                 topk=TOPK, ki_scale=x["ki_scale"])
        return triton_decode.decode_attention(x["q"], x["k"], x["v"], x["table"], x["lens"], idx, q_len=1)[0]

    eager = step()  # also compiles the kernels before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new token: lengths grow and queries change in place; the replay follows them
    x["lens"].add_(1)
    x["q"].copy_(torch.randn_like(x["q"]))
    x["qi"].copy_(torch.randn_like(x["qi"]))
    want = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for _ in range(3):  # replays keep agreeing (counters reset)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def _quantise_index_keys_like_the_cache(model):
    """Forward hooks making every indexer return its keys fp8-quantised then dequantised exactly as the fp8 cache
    stores them (`decode.quantize_index_keys`): a full forward with them is the fp8 engine's exact spec."""
    from openm3.ops.msa import decode

    def hook(_module, _inputs, out):
        qi, ki = out
        return qi, decode.dequantize_index_keys(*decode.quantize_index_keys(ki)).to(ki.dtype)

    return [layer.self_attn.indexer.register_forward_hook(hook) for layer in model.layers
            if layer.self_attn.indexer is not None]


@pytest.mark.parametrize("index_dtype", [None, "fp8"], ids=["idx-model-dtype", "idx-fp8"])
def test_engine_on_cuda_matches_full_forward(index_dtype, monkeypatch):
    """m3-tiny in fp32 on the GPU: chunked prefill (Triton MSA prefill ops over the pages) + decode steps (Triton
    decode kernels) against one full forward over the whole sequence. With fp8 index keys the full forward's
    indexer keys are fp8-quantised-then-dequantised the same way, so the engine must select exactly the same
    blocks in every decode step and MSA layer, and its logits must agree within fp32 rounding, as without fp8."""
    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache
    from openm3.engine.scheduler import decode_step, prefill
    from openm3.models import M3TextConfig, M3TextModel
    from openm3.ops.msa import triton_decode

    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)
    model = M3TextModel(config).cuda().eval()
    lens, steps = [70, 33], 4
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    cache = PagedCache(plan_cache(CacheLayout.from_config(config), 256, kv_dtype=torch.float32,
                                  index_dtype=index_dtype), "cuda")
    cache.admit({0: len(seqs[0]), 1: len(seqs[1])})
    got = [[lg] for lg in prefill(model, cache, [0, 1], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)],
                                  chunk_size=24)]
    selections = []  # block_idx [Hi, 2, topk] of every MSA layer, decode step by decode step
    real_msa = triton_decode.decode_msa

    def spy(*args, **kwargs):
        out = real_msa(*args, **kwargs)
        selections.append(out[2].clone())
        return out

    monkeypatch.setattr(triton_decode, "decode_msa", spy)
    for s in range(steps):
        feed = torch.tensor([seqs[b][lens[b] + s] for b in (0, 1)], device="cuda")
        for b, lg in enumerate(decode_step(model, cache, [0, 1], feed)):
            got[b].append(lg)
    n_msa = sum(t == "minimax_m3_sparse" for t in config.layer_types)
    assert n_msa > 0 and len(selections) == steps * n_msa
    hooks = _quantise_index_keys_like_the_cache(model) if index_dtype == "fp8" else []
    try:
        for b in (0, 1):
            with torch.no_grad():
                full = model(torch.tensor(seqs[b], device="cuda"), return_block_idx=True)
            g = torch.stack(got[b])
            assert (g - full.logits[lens[b] - 1:lens[b] + steps]).abs().max().item() < 2e-3
            msa_idx = [x for x in full.block_idx if x is not None]
            for s in range(steps):
                for layer, want in enumerate(msa_idx):
                    sel = selections[s * n_msa + layer][:, b]  # [Hi, topk] for position lens[b] + s
                    assert torch.equal(sel.sort(-1).values, want[:, lens[b] + s].sort(-1).values), (b, s, layer)
    finally:
        for h in hooks:
            h.remove()


def _candidate_scores(cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort keys of `_score_candidates` -> (score fp32, block int64), both [rows, n]."""
    high = (cand >> 32).to(torch.int32)  # the monotonic fp32 bits
    bits = high ^ ((high >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), 4294967295 - (cand & 4294967295)


@pytest.mark.parametrize("seq_lens,q_len", [([131072], 1), ([300, 9000, 70000], 1), ([5000, 20000], 2)])
def test_split_fp8_scoring_matches_fp16_scoring(seq_lens, q_len):
    """fp8_math='split' (fp8 tensor cores, the query as two fp8 terms) scores every block as the fp16 path does
    (which is exact up to fp32 accumulation): segments of 8 blocks keep all their non-local blocks, so the
    candidates hold every block score; the largest difference is printed and must stay within 1e-3 of the row's
    score scale; then the selected blocks must agree on >= 99.9% of (query, head) rows."""
    from openm3.ops.msa import triton_decode

    x = paged_inputs(seq_lens, q_len, index_fp8=True)
    common = dict(q_len=q_len, block_size=BLOCK, topk=TOPK, local_blocks=1, ki_scale=x["ki_scale"],
                  segment_blocks=8, stages=3, num_warps=4, score_loads="tma")
    ref, n = triton_decode._score_candidates(x["qi"], x["ki"], x["table"], x["lens"], fp8_math="fp16", **common)
    got, n2 = triton_decode._score_candidates(x["qi"], x["ki"], x["table"], x["lens"], fp8_math="split", **common)
    assert n == n2
    s_ref, b_ref = _candidate_scores(ref[:, :n])
    s_got, b_got = _candidate_scores(got[:, :n])
    order_ref, order_got = b_ref.argsort(-1), b_got.argsort(-1)
    assert torch.equal(b_ref.gather(-1, order_ref), b_got.gather(-1, order_got))  # the same blocks scored
    s_ref, s_got = s_ref.gather(-1, order_ref), s_got.gather(-1, order_got)
    real = torch.isfinite(s_ref)
    assert torch.equal(real, torch.isfinite(s_got))
    scale = s_ref.where(real, 0).abs().amax(-1, keepdim=True)
    err = ((s_got - s_ref).where(real, 0).abs() / scale).max().item()
    print(f"split fp8 scoring: max |score difference| / row scale = {err:.2e}")
    assert err <= 1e-3, err
    idx = triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], q_len=q_len,
                                             block_size=BLOCK, topk=TOPK, ki_scale=x["ki_scale"], score_loads="tma")
    idx_split = triton_decode.decode_select_blocks(x["qi"], x["ki"], x["table"], x["lens"], q_len=q_len,
                                                   block_size=BLOCK, topk=TOPK, ki_scale=x["ki_scale"],
                                                   score_loads="tma", fp8_math="split")
    same = (idx.sort(-1).values == idx_split.sort(-1).values).all(-1).float().mean().item()
    assert same >= 0.999, same
    o, lse, idx_msa = triton_decode.decode_msa(x["q"], x["qi"], x["k"], x["v"], x["ki"], x["table"], x["lens"],
                                               q_len=q_len, topk=TOPK, ki_scale=x["ki_scale"], fp8_math="split",
                                               score_loads="tma")
    assert torch.equal(idx_msa, idx_split)
    o2, lse2 = triton_decode.decode_attention(x["q"], x["k"], x["v"], x["table"], x["lens"], idx_split, q_len=q_len)
    torch.testing.assert_close(o.float(), o2.float(), atol=4e-3, rtol=0)
    torch.testing.assert_close(lse, lse2, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 8, 4096])
def test_compiled_e8m0_quantizer_equals_the_eager_ops(rows):
    """`quantize_index_keys` with e8m0 scales runs compiled on CUDA (one fused kernel): bit-identical to its eager
    ops on the same GPU and to the CPU's result, bf16 keys over a wide range of magnitudes."""
    from openm3.ops.msa import decode

    gen = torch.Generator(device="cuda").manual_seed(rows)
    ki = (torch.randn(rows, DI, device="cuda", generator=gen)
          * torch.logspace(-20, 20, rows, device="cuda")[:, None]).to(torch.bfloat16)
    q8, scale = decode.quantize_index_keys(ki)
    eager_q8, eager_scale = decode._quantize_e8m0.__wrapped__(ki)
    cpu_q8, cpu_scale = decode.quantize_index_keys(ki.cpu())
    for want_q8, want_scale in ((eager_q8, eager_scale), (cpu_q8.cuda(), cpu_scale.cuda())):
        assert torch.equal(q8.view(torch.uint8), want_q8.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert decode._quantize_e8m0.fallback is None  # it compiled
