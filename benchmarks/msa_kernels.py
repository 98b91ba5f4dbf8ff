"""Times the MSA Triton kernels against dense cuDNN attention and FlexAttention on one GPU (M3 shape, bf16).

    python -m benchmarks.msa_kernels --T 8192 32768 131072 1048576 --out benchmarks/results/
    python -m benchmarks.msa_kernels --T 131072 --skip-dense --sweep-T 131072    # tuning only

One layer of M3's attention: 64 query heads, 4 KV heads, head dim 128, index 4 x 128 + 1 key head, blocks of 128,
top-16 with 1 local block, one sequence of T tokens. Per T it times (medians, ms):
  select          openm3.ops.msa.select_blocks (Triton)
  sparse_fwd      sparse_attention forward          sparse_fwd_bwd   forward + backward (dq, dk, dv)
  kl_fwd_bwd      indexer_kl forward + backward (sparse, with the attention's lse)
  msa_prefill     select + sparse forward           msa_train_step   select + attention fwd/bwd + KL fwd/bwd
  msa_train_step_kl_bwd   the train step with the KL in the attention's backward (`sparse_attention_with_kl`:
                  the dk/dv kernel stores the KL's teacher, no teacher pass; the trainer's default since session 15)
  dense_fwd       cuDNN SDPA causal forward         dense_fwd_bwd    forward + backward (skipped at >= 1M)
  flex_fwd        FlexAttention over the union of the selected blocks of each 128-query tile (per KV group, so
                  the block mask stays [NQ, NKV]); flex_fwd_bwd forward + backward
and, at the largest T, the peak workspace of the MSA forward (select + attention) beyond q, k, v, o, lse, qi, ki
and block_idx. At the smallest T it first checks the kernels against the fp32 reference on the last queries.
Every case runs in its own try/except: a failure is reported and the run continues.

Two data regimes for the index queries (`m3_inputs(regime=...)` of benchmarks/_inputs.py): "drift" (the headline:
they drift slowly along the sequence, as a trained indexer's do, so neighbouring queries pick overlapping blocks)
and "iid" (independent random queries: neighbours share little but the local block, the worst case for kernels that
load a K/V tile once for several tokens). The main table is drift; `iid_*` columns repeat the sparse attention and
prefill on iid inputs, with the mean union of the blocks of 4 neighbouring tokens for both. `--sweep-T` times the
sparse attention under the launch configs of `DEFAULT_SWEEP` (or `--sweep`) in both regimes, with the dq / dk-dv
kernel times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import RESULTS
from benchmarks._inputs import D, DI, HI, HKV, HQ, REGIMES, m3_inputs
from benchmarks._timing import event_time_ms

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

BLOCK, TOPK, LOCAL = 128, 16, 1
GIB = 1024 ** 3


# ---------------------------------------------------------------------------------------------------------------
# Inputs and timing


def union_stats(block_idx: torch.Tensor, tokens=(1, 2, 4, 8)) -> dict:
    """Mean number of distinct blocks selected by n consecutive tokens (per KV group), over the second half of
    the sequence: the K/V loads a program of n tokens makes, against 16 n for one-token programs."""
    from openm3.ops.msa.triton_common import tile_candidates

    t = block_idx.shape[1]
    half = block_idx[:, t // 2:].contiguous()
    return {f"union_{n}": round(tile_candidates(half, n)[1].float().mean().item(), 2) for n in tokens}


def bench_ms(fn, *, warmup: bool = True, slow_ms: float = 200.0, slow_reps: int = 2) -> float:
    """Median time of `fn` in ms: triton's do_bench for fast ops, a few timed calls for slow ones."""
    import triton.testing

    first = event_time_ms(fn)  # compiles / warms up
    if first < slow_ms:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    if not warmup:
        return first
    return statistics.median(event_time_ms(fn) for _ in range(slow_reps))


# ---------------------------------------------------------------------------------------------------------------
# Cases


def synthetic_selection(t: int, device: str = "cuda", share: int = 16, seed: int = 1) -> torch.Tensor:
    """A valid block_idx [HKV, t, TOPK] without the indexer: own block, then distinct earlier blocks drawn per run
    of `share` tokens, -1 trailing. Used only when select_blocks fails, so attention can still be timed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    own = torch.arange(t, device=device) // BLOCK
    first_own = (torch.arange(t, device=device) // share * share) // BLOCK
    draws = torch.rand(HKV, -(-t // share), TOPK - 1, device=device, generator=gen).repeat_interleave(share, 1)
    picks = (draws[:, :t] * first_own.view(1, t, 1)).long()
    picks = torch.where(first_own.view(1, t, 1) > 0, picks, -1).sort(dim=-1, descending=True).values
    dup = torch.zeros_like(picks, dtype=torch.bool)
    dup[..., 1:] = picks[..., 1:] == picks[..., :-1]
    picks = torch.where(dup, -1, picks).sort(dim=-1, descending=True).values
    return torch.cat([own.view(1, t, 1).expand(HKV, t, 1), picks], dim=-1).to(torch.int32).contiguous()


def msa_fns(x: dict, res: dict):
    """Closures over the openm3 MSA ops for one input set; `block_idx` is computed once here (select_blocks, or a
    synthetic selection if it fails: then select, msa_prefill and msa_train_step are reported missing)."""
    from openm3.ops import msa

    cu = x["cu"]
    kw = dict(block_size=BLOCK)

    def select():
        return msa.select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)

    have_select = True
    try:
        with torch.no_grad():
            block_idx = select()
    except Exception as exc:
        have_select = False
        res.setdefault("errors", {})["select"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["selection"] = "synthetic (select_blocks failed)"
        print(f"    select_blocks FAILED ({type(exc).__name__}: {str(exc)[:300]}); timing attention on a "
              f"synthetic selection", flush=True)
        traceback.print_exc(limit=3)
        block_idx = synthetic_selection(x["q"].shape[0])
    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    qi, ki = (x[n].detach().requires_grad_(True) for n in ("qi", "ki"))
    do = torch.randn_like(x["q"])

    def sparse_fwd():
        with torch.no_grad():
            return msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, cu, **kw)

    def sparse_fwd_bwd():
        q.grad = k.grad = v.grad = None
        o, _ = msa.sparse_attention(q, k, v, block_idx, cu, **kw)
        o.backward(do)

    with torch.no_grad():
        _, lse = msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, cu, **kw)

    def kl_fwd_bwd():
        qi.grad = ki.grad = None
        msa.indexer_kl(x["q"], x["k"], qi, ki, block_idx, cu, lse=lse, **kw).backward()

    def prefill():
        with torch.no_grad():
            bi = select()
            return msa.sparse_attention(x["q"], x["k"], x["v"], bi, cu, **kw)

    def train_step():
        q.grad = k.grad = v.grad = qi.grad = ki.grad = None
        with torch.no_grad():
            bi = select()
        o, lse_t = msa.sparse_attention(q, k, v, bi, cu, **kw)
        kl = msa.indexer_kl(q.detach(), k.detach(), qi, ki, bi, cu, lse=lse_t.detach(), **kw)
        torch.autograd.backward([o, kl], [do, torch.ones_like(kl)])

    def train_step_kl_bwd():
        q.grad = k.grad = v.grad = qi.grad = ki.grad = None
        with torch.no_grad():
            bi = select()
        o, _, kl = msa.sparse_attention_with_kl(q, k, v, qi, ki, bi, cu, **kw)
        torch.autograd.backward([o, kl], [do, torch.ones_like(kl)])

    cases = dict(sparse_fwd=sparse_fwd, sparse_fwd_bwd=sparse_fwd_bwd, kl_fwd_bwd=kl_fwd_bwd)
    if have_select:
        cases.update(select=select, msa_prefill=prefill, msa_train_step=train_step,
                     msa_train_step_kl_bwd=train_step_kl_bwd)
    return cases, block_idx


def dense_fns(x: dict, with_bwd: bool):
    """cuDNN SDPA over [1, H, T, D] (layout change done once, outside the timing)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x[n].transpose(0, 1).unsqueeze(0).contiguous() for n in ("q", "k", "v"))

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns = dict(dense_fwd=fwd)
    if with_bwd:
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        do = torch.randn_like(q)

        def fwd_bwd():
            qg.grad = kg.grad = vg.grad = None
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True).backward(do)

        fns["dense_fwd_bwd"] = fwd_bwd
    return fns


def flex_block_masks(block_idx: torch.Tensor, t: int):
    """One BlockMask per KV group: the union of the selected blocks over each 128-query tile.

    Blocks strictly before the tile are `full` (no mask_mod); the tile's diagonal block is partial (causal).
    """
    from torch.nn.attention.flex_attention import BlockMask

    nq = nk = -(-t // BLOCK)
    masks = []
    for g in range(block_idx.shape[0]):
        sel = block_idx[g]
        pad = nq * BLOCK - t
        if pad:
            sel = torch.cat([sel, sel.new_full((pad, TOPK), -1)])
        sel = sel.view(nq, BLOCK * TOPK).long()
        dense = torch.zeros(nq, nk + 1, device=sel.device, dtype=torch.bool)
        dense.scatter_(1, torch.where(sel >= 0, sel, nk), True)
        dense = dense[:, :nk]
        diag = torch.eye(nq, nk, device=sel.device, dtype=torch.bool)
        full = dense & ~diag & torch.ones_like(dense).tril()
        partial = dense & diag

        def ordered(m):
            num = m.sum(-1, dtype=torch.int32)
            idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
            return num[None, None].contiguous(), idx[None, None].contiguous()

        kv_num, kv_idx = ordered(partial)
        full_num, full_idx = ordered(full)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        masks.append(BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                              mask_mod=causal, seq_lengths=(t, t)))
        del dense, full, partial
    return masks


def flex_fns(x: dict, block_idx: torch.Tensor):
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    t = x["q"].shape[0]
    g_size = HQ // HKV
    qs = [x["q"][:, g * g_size:(g + 1) * g_size].transpose(0, 1).unsqueeze(0).contiguous() for g in range(HKV)]
    ks = [x["k"][:, g:g + 1].transpose(0, 1).unsqueeze(0).contiguous() for g in range(HKV)]
    vs = [x["v"][:, g:g + 1].transpose(0, 1).unsqueeze(0).contiguous() for g in range(HKV)]
    masks = flex_block_masks(block_idx, t)
    qg = [a.detach().requires_grad_(True) for a in qs]
    kg = [a.detach().requires_grad_(True) for a in ks]
    vg = [a.detach().requires_grad_(True) for a in vs]
    do = torch.randn_like(qs[0])

    def fwd():
        with torch.no_grad():
            return [flex(qs[g], ks[g], vs[g], block_mask=masks[g], enable_gqa=True) for g in range(HKV)]

    def fwd_bwd():
        for g in range(HKV):
            qg[g].grad = kg[g].grad = vg[g].grad = None
            flex(qg[g], kg[g], vg[g], block_mask=masks[g], enable_gqa=True).backward(do)

    return dict(flex_fwd=fwd, flex_fwd_bwd=fwd_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Correctness self-check (fp32 reference on the last queries: bottom-right aligned sub-problem)


def check_against_reference(x: dict, block_idx: torch.Tensor, tail: int = 512) -> dict:
    """Max errors of the Triton kernels vs the fp32 reference for the last `tail` queries of the sequence."""
    from openm3.ops import msa
    from openm3.ops.msa import reference

    t = x["q"].shape[0]
    tail = min(tail, t)
    dev = x["q"].device
    cu_q = torch.tensor([0, tail], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, t], device=dev, dtype=torch.int32)
    sl = slice(t - tail, t)
    out = {}
    ref_sel = reference.select_blocks(x["qi"][sl].float(), x["ki"].float(), cu_q, block_size=BLOCK, topk=TOPK,
                                      local_blocks=LOCAL, cu_seqlens_k=cu_k)
    same = (ref_sel.sort(-1).values == block_idx[:, sl].sort(-1).values).all(-1)
    out["select_rows_identical_frac"] = same.float().mean().item()

    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    o, lse = msa.sparse_attention(q, k, v, block_idx, x["cu"], block_size=BLOCK)
    do = torch.zeros_like(o)
    do[sl] = torch.randn_like(o[sl])
    o.backward(do)
    qr, kr, vr = (x[n].float().detach().requires_grad_(True) for n in ("q", "k", "v"))
    o_r, lse_r = reference.sparse_attention(qr[sl], kr, vr, block_idx[:, sl].contiguous(), cu_q, block_size=BLOCK,
                                            cu_seqlens_k=cu_k)
    o_r.backward(do[sl].float())

    def rel(a, b):
        return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    out["o_max_abs"] = (o[sl].float() - o_r).abs().max().item()
    out["lse_max_abs"] = (lse[sl] - lse_r).abs().max().item()
    out["dq_rel"] = rel(q.grad[sl], qr.grad[sl])
    out["dk_rel"] = rel(k.grad, kr.grad)
    out["dv_rel"] = rel(v.grad, vr.grad)
    kl = msa.indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, x["cu"], block_size=BLOCK, lse=lse.detach())
    out["kl"] = kl.item()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Driver


def _run_case(results: dict, name: str, fn, **kw) -> None:
    try:
        ms = bench_ms(fn, **kw)
        results[name] = round(ms, 3)
        print(f"    {name:16s} {ms:10.2f} ms", flush=True)
    except Exception as exc:  # one failing case must not lose the others
        results[name] = None
        results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"    {name:16s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        traceback.print_exc(limit=3)
    finally:
        torch.cuda.empty_cache()


def _profile_case(name: str, fn, top: int = 14) -> dict:
    """CUDA kernel time of one warm call of `fn` under torch.profiler, by kernel (where a case's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks._timing import idle_gaps, profiled_times
    from benchmarks.train_throughput import kernel_breakdown, sync_sites

    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1e3
        out = kernel_breakdown(profiled_times(prof)[0], wall_ms, top=40)
        out["idle"] = idle_gaps(prof)
        out["sync_sites"] = sync_sites(fn)
    except Exception as exc:
        print(f"    profile {name} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}
    idle = out["idle"]
    print(f"    profile {name}: wall {wall_ms:.2f} ms, kernels {out['kernel_ms']:.2f} ms, kernel span "
          f"{idle.get('span_ms')} ms, gaps {idle.get('gaps_ms_total')} ms, host syncs {out['sync_sites'][-1]}",
          flush=True)
    for gap in idle.get("largest", [])[:5]:
        print(f"      gap {gap['ms']:.3f} ms at {gap['at_ms']} ms: {gap['after'][:40]} -> {gap['before'][:40]}")
    for site in out["sync_sites"][:-1][:5]:
        print(f"      sync x{site['count']}: {site['site'][:150]}")
    for k in out["top_kernels"][:top]:
        print(f"      {k['ms']:9.3f} ms {k['launches']:5d}x  {k['name'][:90]}", flush=True)
    return out


def _workspace(x: dict, msa_cases: dict) -> dict:
    """Peak memory of select + sparse forward beyond inputs and outputs."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, lse = msa_cases.get("msa_prefill", msa_cases["sparse_fwd"])()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t = x["q"].shape[0]
    outputs = o.numel() * o.element_size() + lse.numel() * lse.element_size() + HKV * t * TOPK * 4
    del o, lse
    return {"workspace_gib": round((peak - base - outputs) / GIB, 3), "peak_gib": round(peak / GIB, 2),
            "workspace_includes_select": "msa_prefill" in msa_cases}


def run_T(t: int, args, results_all: list) -> None:
    res: dict = {"T": t}
    results_all.append(res)
    print(f"\n== T = {t} ==", flush=True)
    t0 = time.time()
    try:
        x = m3_inputs(t)
    except Exception as exc:
        res["errors"] = {"inputs": f"{type(exc).__name__}: {exc}"}
        print(f"    inputs FAILED: {exc}")
        return
    big = t >= 1 << 20
    block_idx = None
    try:
        msa_cases, block_idx = msa_fns(x, res)
    except Exception as exc:
        res.setdefault("errors", {})["msa_setup"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"    MSA setup FAILED (select/sparse_attention missing or broken): {exc}", flush=True)
        traceback.print_exc(limit=5)
        msa_cases = {}
    if block_idx is not None and t == min(args.T) and not args.skip_check:
        try:
            res["check"] = check_against_reference(x, block_idx)
            print("    check vs fp32 reference (last 512 queries):",
                  {k: (round(v, 6) if isinstance(v, float) else v) for k, v in res["check"].items()}, flush=True)
        except Exception as exc:
            res.setdefault("errors", {})["check"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"    check FAILED: {exc}", flush=True)
            traceback.print_exc(limit=5)
    slow_reps = 1 if big else 2
    names = ("select", "sparse_fwd", "msa_prefill", "sparse_fwd_bwd", "kl_fwd_bwd", "msa_train_step",
             "msa_train_step_kl_bwd")
    for name in names[:3] if args.prefill_only else names:
        if name in msa_cases and (not args.cases or name in args.cases):
            _run_case(res, name, msa_cases[name], slow_reps=slow_reps)
    for name in args.profile:
        if name in msa_cases:
            res.setdefault("profile", {})[name] = _profile_case(name, msa_cases[name])
    if block_idx is not None:
        res["union_drift"] = union_stats(block_idx)
    if not args.skip_iid:
        _iid_cases(t, res, slow_reps)
    if big and msa_cases:
        try:
            res.update(_workspace(x, msa_cases))
            print(f"    workspace        {res['workspace_gib']:.3f} GiB (peak {res['peak_gib']} GiB)", flush=True)
        except Exception as exc:
            res.setdefault("errors", {})["workspace"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"    workspace FAILED: {exc}", flush=True)
    msa_cases = None
    torch.cuda.empty_cache()

    if not args.skip_dense:
        try:
            dense = dense_fns(x, with_bwd=not big)
            # dense forward at 1M takes ~35 s: time it once, without a warm-up call
            _run_case(res, "dense_fwd", dense["dense_fwd"], warmup=not big, slow_reps=1 if big else 2)
            if "dense_fwd_bwd" in dense:
                _run_case(res, "dense_fwd_bwd", dense["dense_fwd_bwd"])
            else:
                res["dense_fwd_bwd_note"] = "skipped at 1M (about 64x the 128K figure, minutes)"
            del dense
        except Exception as exc:
            res.setdefault("errors", {})["dense"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"    dense FAILED: {exc}", flush=True)
        torch.cuda.empty_cache()

    if not args.skip_flex and block_idx is not None:
        try:
            flex = flex_fns(x, block_idx)
            _run_case(res, "flex_fwd", flex["flex_fwd"], slow_reps=slow_reps)
            if not args.prefill_only:
                _run_case(res, "flex_fwd_bwd", flex["flex_fwd_bwd"], slow_reps=slow_reps)
            del flex
        except Exception as exc:
            res.setdefault("errors", {})["flex"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"    flex FAILED: {exc}", flush=True)
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
    _ratios(res)
    res["wall_s"] = round(time.time() - t0, 1)
    x = None  # free the GPU memory (closures above hold these names)
    torch.cuda.empty_cache()


def _iid_cases(t: int, res: dict, slow_reps: int) -> None:
    """Sparse attention (and prefill = select + forward) on i.i.d. random index queries: neighbouring queries
    share little, so multi-token tiles save no K/V traffic there (worst case for the default launch)."""
    from openm3.ops import msa

    try:
        x = m3_inputs(t, regime="iid")
        with torch.no_grad():
            block_idx = msa.select_blocks(x["qi"], x["ki"], x["cu"], block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
        res["union_iid"] = union_stats(block_idx)
        cases = attention_fns(x, block_idx)

        def prefill():
            with torch.no_grad():
                bi = msa.select_blocks(x["qi"], x["ki"], x["cu"], block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
                return msa.sparse_attention(x["q"], x["k"], x["v"], bi, x["cu"], block_size=BLOCK)

        for name, fn in (("iid_sparse_fwd", cases["sparse_fwd"]), ("iid_msa_prefill", prefill),
                         ("iid_sparse_fwd_bwd", cases["sparse_fwd_bwd"])):
            _run_case(res, name, fn, slow_reps=slow_reps)
        x = block_idx = cases = None  # free the GPU memory (closures above hold these names)
    except Exception as exc:
        res.setdefault("errors", {})["iid"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"    iid cases FAILED: {exc}", flush=True)
    torch.cuda.empty_cache()


def _ratios(res: dict) -> None:
    def ratio(a, b):
        return round(res[a] / res[b], 2) if res.get(a) and res.get(b) else None

    res["ratios"] = {
        "prefill_speedup_vs_dense": ratio("dense_fwd", "msa_prefill"),
        "train_speedup_vs_dense": ratio("dense_fwd_bwd", "msa_train_step"),
        "train_kl_bwd_speedup_vs_dense": ratio("dense_fwd_bwd", "msa_train_step_kl_bwd"),
        "sparse_fwd_speedup_vs_flex": ratio("flex_fwd", "sparse_fwd"),
        "sparse_fwd_bwd_speedup_vs_flex": ratio("flex_fwd_bwd", "sparse_fwd_bwd"),
        "sparse_fwd_speedup_vs_dense": ratio("dense_fwd", "sparse_fwd"),
        "iid_prefill_speedup_vs_dense": ratio("dense_fwd", "iid_msa_prefill"),
    }


def sweep(t: int, configs: list[str], results: list) -> None:
    """Sparse fwd and fwd+bwd under several launch configs (OPENM3_ATTN_LAUNCH overrides), in both data regimes
    (the selection is computed once per regime; configs only change the attention kernels)."""
    from openm3.ops import msa

    print(f"\n== launch sweep at T = {t} ==", flush=True)
    saved = os.environ.get("OPENM3_ATTN_LAUNCH")
    try:
        for regime in REGIMES:
            x = m3_inputs(t, regime=regime)
            block_idx = msa.select_blocks(x["qi"], x["ki"], x["cu"], block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
            stats = union_stats(block_idx)
            print(f"  [{regime}] mean union of the blocks of n consecutive tokens: {stats}", flush=True)
            for cfg in configs:
                os.environ["OPENM3_ATTN_LAUNCH"] = cfg
                res = {"T": t, "launch": cfg, "regime": regime, **stats}
                try:
                    cases = attention_fns(x, block_idx)
                    for name in ("sparse_fwd", "sparse_fwd_bwd"):
                        _run_case(res, name, cases[name])
                    res["kernels_ms"] = kernel_breakdown(cases["sparse_fwd_bwd"])
                except Exception as exc:
                    res["errors"] = {"setup": f"{type(exc).__name__}: {exc}"[:1000]}
                print(f"    [{regime}] [{cfg or 'default'}] fwd {res.get('sparse_fwd')} ms, "
                      f"fwd+bwd {res.get('sparse_fwd_bwd')} ms, kernels {res.get('kernels_ms')}", flush=True)
                results.append(res)
            x = block_idx = None  # free the GPU memory (closures above hold these names)
            torch.cuda.empty_cache()
    finally:
        if saved is None:
            os.environ.pop("OPENM3_ATTN_LAUNCH", None)
        else:
            os.environ["OPENM3_ATTN_LAUNCH"] = saved


def attention_fns(x: dict, block_idx: torch.Tensor) -> dict:
    """sparse_fwd and sparse_fwd_bwd closures on a fixed selection."""
    from openm3.ops import msa

    q, k, v = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    do = torch.randn_like(x["q"])

    def sparse_fwd():
        with torch.no_grad():
            return msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu"], block_size=BLOCK)

    def sparse_fwd_bwd():
        q.grad = k.grad = v.grad = None
        o, _ = msa.sparse_attention(q, k, v, block_idx, x["cu"], block_size=BLOCK)
        o.backward(do)

    return dict(sparse_fwd=sparse_fwd, sparse_fwd_bwd=sparse_fwd_bwd)


def sweep_table(rows: list[dict]) -> None:
    """fwd / fwd+bwd per launch config, one column pair per regime."""
    sweeps = [r for r in rows if "launch" in r]
    if not sweeps:
        return
    configs = list(dict.fromkeys(r["launch"] for r in sweeps))
    print("\nlaunch sweep, ms (dq, dkdv: those kernels' GPU time inside the fwd+bwd)")
    print(" " * 41 + "".join(f"{reg + ' fwd':>11}{reg + ' f+b':>11}{'dq':>7}{'dkdv':>7}" for reg in REGIMES))
    for cfg in configs:
        line = " " * 41
        for reg in REGIMES:
            r = next((r for r in sweeps if r["launch"] == cfg and r.get("regime") == reg), {})
            line += "".join((f"{r[c]:.2f}" if isinstance(r.get(c), float) else "-").rjust(11)
                            for c in ("sparse_fwd", "sparse_fwd_bwd"))
            kern = r.get("kernels_ms") or {}
            line += "".join((f"{kern[c]:.1f}" if c in kern else "-").rjust(7) for c in ("dq", "dkdv"))
        print(f"{line}  {cfg or 'default'}")


# The default launch (see triton_common.attention_launch) is timed first; the others vary one idea each against
# it: 4- and 8-token forward tiles over the union of their blocks (one K/V load for all of them, masked rows: wins
# when neighbouring queries overlap a lot), fewer pipeline stages, dq as a separate query-outer pass instead of
# fused into dk/dv, pointer loads instead of TMA, and smaller dk/dv work items (load balance over hot blocks).
DEFAULT_SWEEP = [
    "",
    "block_m=64",
    "block_m=128,num_warps=8,num_stages=2",
    "num_stages=2",
    "dq_in_dkdv=0",
    "tma=0",
    "dkdv_max_tokens=512",
]


def kernel_breakdown(fn) -> dict:
    """GPU time (ms) of each attention kernel in one call of `fn`, from the PyTorch profiler; `other` is the rest
    (torch bookkeeping: candidate lists, inverse index, delta, casts)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {"other": 0.0}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        name = next((n for n in ("_attn_fwd_kernel", "_attn_dq_kernel", "_attn_dkdv_kernel") if n in evt.key),
                    "other")
        out[name] = out.get(name, 0.0) + us / 1000
    return {k.strip("_").replace("attn_", "").replace("_kernel", ""): round(v, 3) for k, v in out.items()}


def print_table(rows: list[dict]) -> None:
    cols = ["select", "sparse_fwd", "msa_prefill", "sparse_fwd_bwd", "kl_fwd_bwd", "msa_train_step",
            "msa_train_step_kl_bwd", "dense_fwd", "dense_fwd_bwd", "flex_fwd", "flex_fwd_bwd"]
    print("\n" + "T".rjust(8) + "".join(c.rjust(16) for c in cols))
    for r in rows:
        if "launch" in r:
            continue
        print(str(r["T"]).rjust(8) + "".join(
            (f"{r[c]:.2f}" if isinstance(r.get(c), float) else "-").rjust(16) for c in cols))
    print("\nboth regimes (ms; union_4: mean distinct blocks of 4 consecutive tokens, of 64 selections; headline = "
          "drift, the behaviour of a trained indexer)")
    print("T".rjust(8) + "".join(c.rjust(14) for c in ("drift fwd", "drift f+b", "drift union4", "iid fwd",
                                                         "iid prefill", "iid f+b", "iid union4")))
    for r in rows:
        if "launch" in r:
            continue
        vals = [r.get("sparse_fwd"), r.get("sparse_fwd_bwd"), (r.get("union_drift") or {}).get("union_4"),
                r.get("iid_sparse_fwd"), r.get("iid_msa_prefill"), r.get("iid_sparse_fwd_bwd"),
                (r.get("union_iid") or {}).get("union_4")]
        print(str(r["T"]).rjust(8) + "".join((f"{v:.2f}" if isinstance(v, float) else "-").rjust(14) for v in vals))
    print("\nratios (higher is better; targets: prefill >= 12x at 128K and >= 20x at 1M, train >= 10x at 128K, "
          "sparse vs flex > 1)")
    names = ["prefill_speedup_vs_dense", "train_speedup_vs_dense", "train_kl_bwd_speedup_vs_dense",
             "sparse_fwd_speedup_vs_flex",
             "sparse_fwd_bwd_speedup_vs_flex", "sparse_fwd_speedup_vs_dense", "iid_prefill_speedup_vs_dense"]
    print("T".rjust(8) + "".join(n.replace("_speedup", "").rjust(26) for n in names))
    for r in rows:
        if "ratios" in r:
            print(str(r["T"]).rjust(8) + "".join(str(r["ratios"].get(n)).rjust(26) for n in names))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument("--skip-flex", action="store_true")
    parser.add_argument("--skip-check", action="store_true", help="no fp32 reference check at the smallest T")
    parser.add_argument("--prefill-only", action="store_true",
                        help="time select, sparse forward and prefill only (no backward, KL or train step: 1M runs)")
    parser.add_argument("--skip-iid", action="store_true", help="time the sparse attention on drifting index "
                        "queries only (by default also on i.i.d. ones)")
    parser.add_argument("--sweep-T", type=int, default=32768,
                        help="also time sparse fwd and fwd+bwd under several launch configs at this T (0: off)")
    parser.add_argument("--sweep", nargs="*", default=None, help="launch configs for the sweep (key=v,...)")
    parser.add_argument("--cases", nargs="*", default=[], metavar="CASE",
                        help="time only these MSA cases (e.g. msa_prefill msa_train_step_kl_bwd; default: all)")
    parser.add_argument("--profile", nargs="*", default=[], metavar="CASE",
                        help="also profile these cases (e.g. msa_train_step_kl_bwd): CUDA time per kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("msa_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "shape": dict(Hq=HQ, Hkv=HKV, D=D, Hi=HI, Di=DI, block=BLOCK, topk=TOPK, local_blocks=LOCAL),
            "dtype": "bfloat16", "attn_launch_env": os.environ.get("OPENM3_ATTN_LAUNCH"),
            "select_launch_env": os.environ.get("OPENM3_SELECT_LAUNCH")}
    # Time the kernels, not the O(T * topk) value checks of block_idx (select_blocks' output is trusted).
    from openm3.ops.msa import triton_attention
    triton_attention.VALIDATE_BLOCK_IDX = False
    meta["note"] = "block_idx value validation off while timing (triton_attention.VALIDATE_BLOCK_IDX = False)"
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    for t in sorted(args.T):
        run_T(t, args, rows)
    if args.sweep_T:
        sweep(args.sweep_T, args.sweep or DEFAULT_SWEEP, rows)
    print_table(rows)
    sweep_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"msa_kernels_{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
