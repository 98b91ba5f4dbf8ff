"""MSA decode and chunked prefill through the engine's paged cache vs dense attention, one H200, M3 shape, bf16 KV.

    python -m benchmarks.msa_decode --out benchmarks/results/        # about 3-4 minutes on an H200

One attention layer of M3: 64 query heads, 4 KV heads, head dim 128, index 4 x 128 + 1 key head, blocks (pages)
of 128 tokens, top-16 with 1 local block.

decode: one new query per sequence against T cached tokens (T = 128K and 1M), batch 1 and 32, index keys bf16 and
  fp8 (+ an e8m0 scale byte per token; variants `scale_fp32` / `tma_scale_fp32`: fp32 scales). `msa` =
  `triton_decode.decode_msa` with its defaults (index scores, candidate shrinking for long rows, top-k merge
  inside the attention splits, split-K sparse attention, combine);
  `4-launch` = `decode_select_blocks` then `decode_attention`; `select`, `score` (the scoring kernel alone) and
  `attn` (attention + combine on a given selection) place the time; `dense` = SDPA decode (cuDNN backend, else
  flash / efficient; the one used is recorded) over the same cache memory, `dense_triton` = the decode kernel
  walking every block. Each step is captured in a CUDA graph (20 steps per graph, so host launch overhead is not
  measured but the gaps between kernels are); times are medians. `msa_ms_<variant>` times `decode_msa` with the
  knobs of VARIANTS (segment sizes, merge by max rounds, no shrinking, fused combine, warps, stages, hoisted /
  TMA key loads, shrink folded into the scoring kernel, programmatic dependent launch, 2-launch step, ...);
  `best variant` names the fastest; `variant_selection_mismatch` lists variants whose block lists differ from
  `decode_select_blocks` (must be empty). `score TB/s` = index-key bytes / scoring time (HBM peak 4.8 TB/s);
  `score_ms_<name>` / `score_tb_per_s_<name>` time the scoring kernel with the knobs of SCORE_VARIANTS.
  `python -m benchmarks.msa_decode --T 131072 --batch 1 --index fp8 --variants rounds --prefill-T` runs one case.
  `--q-len 4`: 4 new queries per sequence (speculative / MTP drafts; the dense baseline leaves their causal tail
  unmasked).
  Batch-1 sweep (the variants of B1_SWEEP, about 2-3 minutes on an H200):
  `python -m benchmarks.msa_decode --T 131072 1048576 --batch 1 --index fp8 --variants b1 --prefill-T`
prefill: T tokens of one MSA layer through the engine (`PagedCache`, chunks of --chunk tokens, several sizes
  allowed: write the chunk's keys, select blocks with the chunk's index queries against every cached index key,
  sparse attention), against one cuDNN causal SDPA call over the whole sequence (for T above
  --no-dense-prefill-above, against a time from an earlier run given with --dense-prefill-s T=SECONDS, recorded as
  such).

Targets (issue "Long-context inference engine"): decode >= 12x dense at 1M with fp8 index keys (byte floor ~15.5x),
>= 5x at 128K; prefill of 1M tokens >= 20x dense. Every case runs in its own try/except; results go to
`<out>/msa_decode.json` with the hardware, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import RESULTS

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

HQ, HKV, D, HI, DI = 64, 4, 128, 4, 128
BLOCK, TOPK, LOCAL = 128, 16, 1
HBM_BYTES_PER_S = 4.8e12
# Scoring-kernel knobs (`triton_decode.SCORE_LOADS`): 'hoist' loads a segment's page ids once before the block
# loop, so the pipeliner keeps stages-1 16 KiB fp8 key tiles in flight per program (the default 'table' path
# loads the page id per block and ends up with ONE tile buffer whatever `stages` is); 'tma' also fetches each
# block with one TMA copy. fp8 smem per program: stages 3 -> 38 KiB (5 programs/SM), 4 -> 55 KiB (4/SM).
SCORE_VARIANTS = {  # name -> _score_candidates keyword arguments, timed as score_ms_<name> (`--score-variants`)
    "hoist": dict(score_loads="hoist"), "hoist_s4": dict(score_loads="hoist", stages=4),
    "hoist_seg16_s4": dict(score_loads="hoist", stages=4, segment_blocks=16),
    "tma": dict(score_loads="tma"), "tma_s4": dict(score_loads="tma", stages=4),
    "tma_seg32": dict(score_loads="tma", segment_blocks=32),
    "tma_seg32_s4": dict(score_loads="tma", segment_blocks=32, stages=4),
    "tma_keep_best": dict(score_loads="tma", keep_all=False),
    # fp8 keys quantised with fp32 per-token scales (the cache's format before session 21; now 1-byte e8m0)
    "tma_scale_fp32": dict(score_loads="tma", scale_fp32=True),
    # fp8 tensor-core scoring (fp8 keys only; with bf16 keys these equal 'tma'): query split into two fp8 terms
    **{f"split{sfx}": dict(score_loads="tma", fp8_math="split", **kw) for sfx, kw in (
        ("", {}), ("_s4", dict(stages=4)), ("_s2", dict(stages=2)), ("_seg4", dict(segment_blocks=4)),
        ("_seg16", dict(segment_blocks=16)), ("_seg32", dict(segment_blocks=32)),
        ("_seg32_s4", dict(segment_blocks=32, stages=4)))},
}
_FAST = dict(score_loads="hoist", stages=4)
VARIANTS = {  # name -> decode_msa keyword arguments timed beside the default (`--variants` picks some)
    "rounds": dict(merge_sort=False), "fuse_merge": dict(fuse_merge=True), "merge_kernel": dict(fuse_merge=False),
    "fused_combine": dict(fuse_combine=True), "noshrink": dict(merge_direct_max=1 << 30),
    "shrink256": dict(merge_direct_max=256), "slots2": dict(slots_per_split=2),
    **{f"seg{n}": dict(segment_blocks=n) for n in (2, 4, 8, 16, 32, 64)}, "seg32_s4": dict(segment_blocks=32, stages=4),
    "warps8": dict(num_warps=8), "stages2": dict(stages=2), "attn_warps8": dict(attention_warps=8),
    "attn_warps2": dict(attention_warps=2),
    # every block's key out of the scoring kernel (no per-segment top-k rounds): more candidates for the shrink
    # (the default since session 17; keep_best: each program's best topk - local keys, the default before);
    # shrinkN: N shrink groups per row (the default picks 16 or 32 by shape since session 20)
    "keep_best": dict(keep_all=False), "shrink8": dict(shrink_groups=8), "shrink16": dict(shrink_groups=16),
    "shrink32": dict(shrink_groups=32),
    "scale_fp32": dict(scale_fp32=True),  # fp8 keys with fp32 scales (the format before session 21)
    "default_again": {},  # the default timed again after the variants before it: the case's own noise
    **{f"keep_all{sfx}": dict(keep_all=True, **kw) for sfx, kw in (
        ("_seg16", dict(segment_blocks=16)), ("_seg32", dict(segment_blocks=32)), ("_seg64", dict(segment_blocks=64)),
        ("_s4", dict(stages=4)), ("_fold", dict(fold_shrink=True)), ("_seg64_s4", dict(segment_blocks=64, stages=4)))},
    # batch-1 work (bandwidth of the scoring kernel, fewer launches / gaps); 'noshrink' above is no-shrink with
    # the bitonic merge (the default merge) since merge_sort became the default
    **SCORE_VARIANTS,
    "fold_fused_combine": dict(fold_shrink=True, fuse_combine=True),  # the 2-launch step with the default loads
    "fold": dict(fold_shrink=True),  # shrink inside the scoring kernel (last program of each group): -1 launch
    "table": dict(score_loads="table"),  # the page id loaded per block (the default before session 2's TMA)
    "no_pdl": dict(pdl=False),  # without programmatic dependent launch (the default since it measured faster)
    # short rows (m3-small's 16K-64K, session 36: no_pdl and merge_kernel each faster there), combined
    "merge_kernel_no_pdl": dict(fuse_merge=False, pdl=False),
    "fused_combine_no_pdl": dict(fuse_combine=True, pdl=False),
    "noshrink_pdl": dict(merge_direct_max=1 << 30, pdl=True),
    "fold_pdl": dict(fold_shrink=True, pdl=True),
    "hoist_fold_pdl": dict(**_FAST, fold_shrink=True, pdl=True),  # 3 launches: score, attention, combine
    "tma_fold_pdl": dict(score_loads="tma", stages=4, fold_shrink=True, pdl=True),
    "two_launch": dict(**_FAST, fold_shrink=True, fuse_combine=True),  # score(+shrink), attention(+combine)
    "two_launch_pdl": dict(**_FAST, fold_shrink=True, fuse_combine=True, pdl=True),
}
VARIANTS.update({f"{name}_fold": dict(**kw, fold_shrink=True) for name, kw in SCORE_VARIANTS.items()
                 if name.startswith("split")})
VARIANTS["split_shrink256"] = dict(SCORE_VARIANTS["split"], merge_direct_max=256)
VARIANTS["split_fused_combine"] = dict(SCORE_VARIANTS["split"], fuse_combine=True)
B1_SWEEP = ["noshrink", "fused_combine", "fold", "no_pdl", "noshrink_pdl", "fold_pdl", *SCORE_VARIANTS,
            "hoist_fold_pdl", "tma_fold_pdl", "two_launch", "two_launch_pdl"]  # `--variants b1`
SPLIT_SWEEP = [n for n in VARIANTS if n.startswith("split")]  # `--variants split`


def graph_time_ms(fn, steps: int = 20, reps: int = 10, warm_ms: float = 100.0) -> float:
    """Median time per call of `fn` (ms), `steps` calls captured in one CUDA graph, replayed `reps` times after
    `warm_ms` of replays. Without them, the first configuration of a case was timed on a GPU that had just
    idled (compiles, host work): in session 17 the 128K batch-1 default step read 14.1 us and the same kernels
    timed next 12.8 us (the warm-up is for that; that clocks ramping up explains it is our guess)."""
    return replay_time_ms(capture_graph(fn, steps), steps, reps, warm_ms)


def capture_graph(fn, steps: int = 20, pool=None) -> torch.cuda.CUDAGraph:
    """`steps` calls of `fn` in a new CUDA graph (in memory pool `pool`; None: one of its own), after a
    compiling call and two warm-up calls on a side stream."""
    fn()  # compile / warm up
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        for _ in range(steps):
            fn()
    return graph


def replay_time_ms(graph, steps: int = 20, reps: int = 10, warm_ms: float = 100.0) -> float:
    """Median time per captured call (ms) of `reps` replays of `graph` (`steps` calls each), CUDA events, after
    `warm_ms` of replays."""
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < warm_ms:
        graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def events_time_ms(fn, steps: int = 20, reps: int = 10) -> float:
    """Median time per call (ms) of `steps` back-to-back eager calls, timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def time_ms(fn, record: dict, name: str) -> None:
    """record[name] = graph-replay time of fn; eager back-to-back time if fn cannot be captured (noted)."""
    try:
        record[name] = graph_time_ms(fn)
    except Exception as e:  # noqa: BLE001 - e.g. a library kernel that refuses stream capture
        torch.cuda.synchronize()
        record[name] = events_time_ms(fn)
        record[f"{name}_timing"] = f"eager (graph capture failed: {type(e).__name__}: {str(e)[:120]})"


def eager_time_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sdpa_backend(q, k, v, **kw):
    """The first fused SDPA backend (cuDNN, flash, memory-efficient) that runs these inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    last = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            torch.cuda.synchronize()
            return backend
        except RuntimeError as e:
            last = e
    raise RuntimeError(f"no fused SDPA backend ran: {last}")


def dense_sdpa(q, k, v, backend, **kw):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


def _quantised(ki: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 index-key pages [P, BLOCK, DI] and their per-token scales [P, BLOCK] in `scale_dtype`, quantised a
    range of pages at a time to keep the fp32 temporaries small."""
    from openm3.ops.msa import decode

    ki8 = torch.empty(ki.shape, device=ki.device, dtype=decode.FP8_DTYPE)
    scale = torch.empty(ki.shape[:2], device=ki.device, dtype=scale_dtype)
    for p0 in range(0, ki.shape[0], 4096):
        flat, s = decode.quantize_index_keys(ki[p0:p0 + 4096].reshape(-1, DI), scale_dtype)
        ki8[p0:p0 + 4096] = flat.view(-1, BLOCK, DI)
        scale[p0:p0 + 4096] = s.view(-1, BLOCK)
    return ki8, scale


def decode_case(t: int, batch: int, index: str, record: dict, variants=tuple(VARIANTS),
                score_variants=tuple(SCORE_VARIANTS), q_len: int = 1) -> None:
    """One decode configuration (q_len new queries per sequence: 1, or a few for speculative / MTP drafts); fills
    `record` with timings (ms), ratios and bandwidths. The dense baseline attends each new query to every cached
    token (no mask: for q_len > 1 the causal tail of the drafts, q_len - 1 of T keys, is not masked)."""
    from openm3.ops.msa import decode, triton_decode

    nb = t // BLOCK
    pages = nb * batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    # one pool; sequence b owns pages [b*nb, (b+1)*nb) so SDPA can read the same memory as [B, Hkv, T, D]
    k = torch.empty(pages, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    ki = torch.empty(pages, BLOCK, DI, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    ki_scale, fp32_scaled = None, None
    if index == "fp8":  # e8m0 scales (the cache's format) and, for the `scale_fp32` variants, fp32 ones
        ki8, ki_scale = _quantised(ki, decode.SCALE_E8M0)
        fp32_scaled = _quantised(ki, torch.float32)
        ki = ki8
    table = torch.arange(pages, device="cuda", dtype=torch.int32).view(batch, nb)
    lens = torch.full((batch,), t, device="cuda", dtype=torch.int32)
    q = torch.randn(batch * q_len, HQ, D, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(batch * q_len, HI, DI, device="cuda", generator=gen).bfloat16()

    def index_keys(kw: dict):  # (keys, scales, knobs): `scale_fp32` picks the keys quantised with fp32 scales
        kw = dict(kw)
        if kw.pop("scale_fp32", False) and fp32_scaled is not None:
            return (*fp32_scaled, kw)
        return ki, ki_scale, kw

    def msa_run(**kw):  # (o, lse, block_idx)
        ki_, ks_, kw = index_keys(kw)
        return triton_decode.decode_msa(q, qi, k, v, ki_, table, lens, q_len=q_len, topk=TOPK,
                                        local_blocks=LOCAL, ki_scale=ks_, **kw)

    def msa_step(**kw):  # 3 launches: scores, attention merging each row's candidates, combine
        return msa_run(**kw)[0]

    def select_only(**kw):
        return triton_decode.decode_select_blocks(qi, ki, table, lens, q_len=q_len, block_size=BLOCK,
                                                  topk=TOPK, local_blocks=LOCAL, ki_scale=ki_scale, **kw)

    def unfused_step():  # 4 launches: scores, top-k merge, attention, combine
        return triton_decode.decode_attention(q, k, v, table, lens, select_only(), q_len=q_len)[0]

    def score_only(**kw):
        ki_, ks_, kw = index_keys(kw)
        return triton_decode._score_candidates(qi, ki_, table, lens, q_len=q_len, block_size=BLOCK,
                                               topk=TOPK, local_blocks=LOCAL, ki_scale=ks_, num_warps=4,
                                               **{"segment_blocks": None, "fp8_math": "fp16", "stages": 3, **kw})[0]

    kd = k.view(batch, t, HKV, D).transpose(1, 2)  # [B, Hkv, T, D] view of the pool
    vd = v.view(batch, t, HKV, D).transpose(1, 2)
    qd = q.view(batch, q_len, HQ, D).transpose(1, 2)  # [B, HQ, q_len, D]
    backend = sdpa_backend(qd, kd, vd)

    def dense_step():
        return dense_sdpa(qd, kd, vd, backend)

    def dense_triton():
        return triton_decode.decode_attention(q, k, v, table, lens, None, q_len=q_len)[0]

    record["msa_ms"] = graph_time_ms(msa_step)
    record["msa_unfused_ms"] = graph_time_ms(unfused_step)
    record["select_ms"] = graph_time_ms(select_only)
    record["score_ms"] = graph_time_ms(score_only)
    idx = select_only()
    record["attention_ms"] = graph_time_ms(lambda: triton_decode.decode_attention(q, k, v, table, lens, idx,
                                                                                  q_len=q_len))
    # knobs: blocks per scoring program (the default aims at 4 programs per SM), candidate shrinking, bitonic
    # top-k, combine fused into the attention kernel, warps, pipeline stages, attention splits
    for name in variants:
        record[f"msa_ms_{name}"] = graph_time_ms(lambda: msa_step(**VARIANTS[name]))
    sel = select_only()
    record["variant_selection_mismatch"] = [
        name for name in variants if "scale_fp32" not in VARIANTS[name] and not torch.equal(
            msa_run(**VARIANTS[name])[2], sel)]
    if fp32_scaled is not None:  # other quantised keys: near-ties may go either way
        other = msa_run(scale_fp32=True)[2]
        same = (other.sort(-1).values == sel.sort(-1).values).all(-1)
        record["scale_fp32_same_block_sets"] = same.float().mean().item()  # whole (row, head) lists
        shared = (other[..., :, None] == sel[..., None, :]).any(-1) & (other >= 0)
        record["scale_fp32_shared_blocks"] = shared.sum().item() / max((sel >= 0).sum().item(), 1)
    if ki_scale is not None:  # the previous fp8 path: keys widened to bf16 (a slow fp16 -> bf16 step per key)
        record["score_ms_fp8_as_bf16"] = graph_time_ms(lambda: score_only(fp8_math="query"))
    record["msa_default_segment_blocks"] = triton_decode._default_segment_blocks(nb, batch, q.device)  # keep_all
    record["msa_eager_ms"] = eager_time_ms(msa_step)
    time_ms(dense_step, record, "dense_ms")
    record["dense_backend"] = backend.name
    time_ms(dense_triton, record, "dense_triton_ms")
    record["speedup_vs_dense"] = record["dense_ms"] / record["msa_ms"]
    index_bytes = batch * t * (DI * ki.element_size() + (ki_scale.element_size() if ki_scale is not None else 0))
    kv_bytes_msa = batch * q_len * HKV * TOPK * BLOCK * D * 2 * 2  # q_len > 1: at most this (blocks shared)
    dense_bytes = batch * t * HKV * D * 2 * 2
    record["byte_floor_speedup"] = dense_bytes / (index_bytes + kv_bytes_msa)
    record["msa_tb_per_s"] = (index_bytes + kv_bytes_msa) / (record["msa_ms"] * 1e-3) / 1e12
    record["score_tb_per_s"] = index_bytes / (record["score_ms"] * 1e-3) / 1e12
    for name in score_variants:
        ms = record[f"score_ms_{name}"] = graph_time_ms(lambda: score_only(**SCORE_VARIANTS[name]))
        record[f"score_tb_per_s_{name}"] = index_bytes / (ms * 1e-3) / 1e12
    best = min((v, k) for k, v in record.items() if k.startswith("msa_ms"))
    record["best_variant"], record["best_variant_ms"] = best[1], best[0]
    record["best_speedup_vs_dense"] = record["dense_ms"] / best[0]
    record["dense_tb_per_s"] = dense_bytes / (record["dense_ms"] * 1e-3) / 1e12
    # the kernel must agree with the spec on these inputs: compare one sequence's selection sets
    want = decode.paged_select_blocks(qi[:q_len], ki, table[:1], torch.tensor([0, q_len], dtype=torch.int32,
                                                                              device="cuda"),
                                      [t], block_size=BLOCK, topk=TOPK, local_blocks=LOCAL,
                                      ki_scale=ki_scale) if t <= 131072 else None
    if want is not None:
        got = select_only()[:, :q_len]
        record["selection_agrees_with_reference"] = bool(torch.equal(got.sort(-1).values, want.sort(-1).values))
        fused = msa_run()[2]
        record["fused_selection_equals_select"] = bool(torch.equal(fused, select_only()))
    k = v = ki = kd = vd = None  # free the GPU memory (closures above hold these names)


def prefill_case(t: int, chunk: int, index: str, record: dict, dense: bool) -> None:
    """T tokens of one MSA layer through the engine's cache in chunks, vs one dense causal SDPA call."""
    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache

    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.empty(t, HQ, D, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    k = torch.empty(t, HKV, D, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    # slowly drifting index queries, as a trained indexer's
    anchors = torch.randn(t // 512 + 2, HI, DI, device="cuda", generator=gen)
    pos = torch.arange(t, device="cuda", dtype=torch.float32) / 512
    lo = pos.floor().long()
    w = (pos - lo).view(t, 1, 1)
    qi = (anchors[lo] * (1 - w) + anchors[lo + 1] * w).bfloat16()
    del anchors, pos, lo, w
    ki = torch.empty(t, DI, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    layout = CacheLayout(sparse=(True,), num_kv_heads=HKV, head_dim=D, index_head_dim=DI, page_size=BLOCK)

    def run_engine(total):
        cache = PagedCache(plan_cache(layout, total, kv_dtype=torch.bfloat16, index_dtype=index), "cuda")
        cache.admit({0: total})
        for s in range(0, total, chunk):
            n = min(chunk, total - s)
            sl = slice(s, s + n)
            with cache.step([0], [n]):
                cache.attend(0, q[sl], k[sl], v[sl], qi[sl], ki[sl], cu_seqlens=torch.tensor([0, n], device="cuda",
                             dtype=torch.int32), scale=D ** -0.5, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
        return cache

    run_engine(min(t, 2 * chunk))  # compile the kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cache = run_engine(t)
    torch.cuda.synchronize()
    record["engine_prefill_s"] = time.perf_counter() - t0
    record["cache_plan_gib"] = cache.plan.total_bytes / 2 ** 30
    del cache
    if dense:
        qd, kd, vd = (x.transpose(0, 1)[None] for x in (q, k, v))
        backend = sdpa_backend(qd[:, :, :4096], kd[:, :, :4096], vd[:, :, :4096], is_causal=True)  # + warm-up
        t0 = time.perf_counter()
        dense_sdpa(qd, kd, vd, backend, is_causal=True)
        torch.cuda.synchronize()
        record["dense_prefill_s"] = time.perf_counter() - t0
        record["dense_backend"] = backend.name
        record["speedup_vs_dense"] = record["dense_prefill_s"] / record["engine_prefill_s"]


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": props.total_memory / 2 ** 30, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _print_rows(records: list[dict], key, figures) -> None:
    """One table row per record: `key(r)` (the case), then `figures(r)`, or the start of the case's error."""
    for r in records:
        print(key(r) + (f"  error: {r['error'][:60]}" if "error" in r else figures(r)))


def main(argv=None) -> int:
    global HQ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[131072, 1048576], help="cached tokens")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--q-len", type=int, default=1, help="new queries per sequence (a few: speculative / MTP drafts)")
    p.add_argument("--index", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=[*VARIANTS, "b1", "split"],
                   help="decode_msa knob settings timed beside the default ('b1': the batch-1 sweep B1_SWEEP)")
    p.add_argument("--score-variants", nargs="*", default=list(SCORE_VARIANTS), choices=list(SCORE_VARIANTS),
                   help="scoring-kernel knob settings timed beside the default scoring kernel")
    p.add_argument("--prefill-T", type=int, nargs="*", default=[131072, 1048576])
    p.add_argument("--chunk", type=int, nargs="+", default=[32768], help="prefill chunks (queries per forward)")
    p.add_argument("--dense-prefill-s", nargs="*", default=[], metavar="T=SECONDS",
                   help="dense prefill times measured in an earlier run, used for T above --no-dense-prefill-above")
    p.add_argument("--no-dense-prefill-above", type=int, default=1 << 21,
                   help="skip the dense prefill baseline above this many tokens")
    p.add_argument("--hq", type=int, default=HQ, help="query heads (M3: 64; m3-small: 16), over 4 KV heads")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if args.hq < HKV or args.hq % HKV:
        p.error(f"--hq must be a positive multiple of the {HKV} KV heads, got {args.hq}")
    HQ = args.hq
    sweeps = {"b1": B1_SWEEP, "split": SPLIT_SWEEP}
    args.variants = list(dict.fromkeys(v for name in args.variants for v in sweeps.get(name, [name])))
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    results = {"env": environment(), "shape": dict(hq=HQ, hkv=HKV, d=D, hi=HI, di=DI, block=BLOCK, topk=TOPK,
                                                   local=LOCAL), "decode": [], "prefill": []}
    for t in args.T:
        for batch in args.batch:
            for index in args.index:
                rec = {"T": t, "batch": batch, "q_len": args.q_len, "index": index}
                try:
                    decode_case(t, batch, index, rec, args.variants, args.score_variants, args.q_len)
                except Exception as e:  # noqa: BLE001 - report and continue with the next case
                    rec["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                torch.cuda.empty_cache()
                results["decode"].append(rec)
                print(json.dumps(rec), flush=True)
    known = {int(kv.split("=")[0]): float(kv.split("=")[1]) for kv in args.dense_prefill_s}
    for t in args.prefill_T:
        for n, chunk in enumerate(args.chunk):
            rec = {"T": t, "chunk": chunk, "index": "bf16"}
            try:
                prefill_case(t, chunk, "bf16", rec, dense=n == 0 and t <= args.no_dense_prefill_above)
                dense_s = rec.get("dense_prefill_s") or next((r["dense_prefill_s"] for r in results["prefill"]
                                                              if r["T"] == t and "dense_prefill_s" in r), None)
                if dense_s is None and t in known:
                    dense_s = rec["dense_prefill_s_earlier_run"] = known[t]
                if dense_s is not None:
                    rec["speedup_vs_dense"] = dense_s / rec["engine_prefill_s"]
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            torch.cuda.empty_cache()
            results["prefill"].append(rec)
            print(json.dumps(rec), flush=True)

    print(f"\n{'decode':<7}{'T':>8}{'B':>3}{'Q':>2}{'index':>6}{'msa ms':>8}{'4-launch':>9}{'select':>8}{'score':>8}"
          f"{'attn':>7}{'dense':>8}{'x dense':>8}{'floor x':>8}{'score TB/s':>11}  best variant")
    _print_rows(results["decode"], lambda r: f"{'':<7}{r['T']:>8}{r['batch']:>3}{r.get('q_len', 1):>2}{r['index']:>6}",
                lambda r: (f"{r['msa_ms']:>8.4f}{r['msa_unfused_ms']:>9.4f}{r['select_ms']:>8.4f}"
                           f"{r['score_ms']:>8.4f}{r['attention_ms']:>7.4f}{r['dense_ms']:>8.4f}"
                           f"{r['speedup_vs_dense']:>8.2f}{r['byte_floor_speedup']:>8.2f}{r['score_tb_per_s']:>11.2f}  "
                           f"{r['best_variant']} {r['best_variant_ms']:.4f} ({r['best_speedup_vs_dense']:.2f}x)"))
    print(f"\n{'prefill':<8}{'T':>9}{'chunk':>7}{'engine s':>10}{'dense s':>9}{'x dense':>9}")
    _print_rows(results["prefill"], lambda r: f"{'':<8}{r['T']:>9}{r['chunk']:>7}",
                lambda r: (f"{r['engine_prefill_s']:>10.3f}"
                           f"{r.get('dense_prefill_s', r.get('dense_prefill_s_earlier_run', float('nan'))):>9.3f}"
                           f"{r.get('speedup_vs_dense', float('nan')):>9.2f}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "msa_decode.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'msa_decode.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
