"""GPU self-check and timing of the MSA selection and indexer-KL Triton kernels (M3 shape, bf16, one layer).

    python -m benchmarks.msa_select_kl --out benchmarks/results/            # checks + timings, ~2-3 min on an H200
    python -m benchmarks.msa_select_kl --T 8192 131072 --skip-check          # timings only
    TRITON_DUMP_PTXAS_LOG=1 python -m benchmarks.msa_select_kl --compile-check   # sm_90 compile, no GPU needed
    python -m benchmarks.msa_select_kl --compile-check --sweep --dump-ptx /tmp/ptx  # + sweep variants, regs, PTX

Shape: index 4 heads x 128 + 1 key head, main 64 query heads / 4 KV heads x 128, blocks of 128, top-16, 1 local
block, one sequence of T tokens. The index queries drift slowly along the sequence (as a trained indexer's do), so
neighbouring queries pick overlapping blocks.

1. Checks (T in --check-T): the last `--tail` queries of a T-token sequence form a bottom-right aligned
   sub-problem (cu_seqlens_k), cheap for the fp32 reference at any T. Selection: rows identical to the reference
   (on the same bf16 values) and rows whose block *set* differs (only near-ties may differ). KL (sparse with the
   attention lse, sparse without, dense at the smallest T): loss, dqi, dki errors against the fp32 reference next
   to the error of a plain bf16 PyTorch computation (`kl_bf16_torch`); pass = kernel error <= 2x bf16 error.
2. Timings (median ms, CUDA): select; the value checks of block_idx (kl_chk, skipped in the KL timings); the KL
   inverse index; KL forward (no grad); KL forward+grad (what a training step runs; backward only scales); KL
   without lse (adds the teacher-normaliser pass; T <= 32K); the cuDNN dense causal forward in the same run
   (T <= 128K) for ratios. Achieved TFLOP/s against the FLOP counts.
3. Workspace: peak memory of select beyond its inputs and output at the largest T.
4. With --sweep [T ...]: select and KL timings for the launch variants in SELECT_SWEEP / KL_SWEEP; with
   --profile [T ...]: GPU time per kernel of select + KL forward/gradient (torch.profiler).

Each case runs in its own try/except: a failure is printed with its traceback and the run continues.
Writes JSON (GPU, versions, date, every figure) to --out/msa_select_kl.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import RESULTS
from benchmarks._inputs import D, DI, HI, HKV, HQ, m3_inputs
from benchmarks._timing import event_time_ms

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

BLOCK, TOPK, LOCAL = 128, 16, 1
GIB = 1024 ** 3
DEVICE = "cuda"  # the timing cases' device (a CPU smoke test of this script sets "cpu" under the interpreter)


# ---------------------------------------------------------------------------------------------------------------
# Inputs, timing, errors


def bench_ms(fn, reps: int = 5) -> float:
    """Median of `reps` timed calls after one warm-up call (compiles), CUDA events."""
    times = []
    for i in range(reps + 1):
        elapsed = event_time_ms(fn)
        if i:
            times.append(elapsed)
    return statistics.median(times)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (|x - ref| / |ref| for scalars)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def kl_bf16_torch(q, k, qi, ki, block_idx, *, scale, index_scale, lse=None, chunk: int = 32):
    """Sparse indexer KL in plain PyTorch in the inputs' dtype: the low-precision baseline of the checks.

    One sequence whose T queries are the last T of its Tk keys; block_idx [Hi, T, topk]. Returns
    (loss float, dqi [T, Hi, Di], dki [Tk, Di]) with gradients from autograd in the inputs' dtype.
    """
    t, hq, d = q.shape
    tk, hi, _ = k.shape
    group = hq // hi
    qi = qi.detach().clone().requires_grad_(True)
    ki = ki.detach().clone().requires_grad_(True)
    k_t = k.transpose(0, 1)
    heads = torch.arange(hi, device=q.device)[:, None, None]
    total = 0.0
    for c0 in range(0, t, chunk):
        rows = slice(c0, min(c0 + chunk, t))
        qpos = torch.arange(tk - t + c0, tk - t + rows.stop, device=q.device)
        blocks = block_idx[:, rows].long()  # [Hi, C, K]
        pos = (blocks[..., None] * BLOCK + torch.arange(BLOCK, device=q.device)).flatten(2)
        valid = (blocks[..., None] >= 0).expand(*blocks.shape, BLOCK).flatten(2) & (pos <= qpos[None, :, None])
        pos = pos.clamp(0, tk - 1)
        q_c = q[rows].unflatten(1, (hi, group)).transpose(0, 1)  # [Hi, C, G, D]
        s = (q_c @ k_t[heads, pos].transpose(-1, -2)) * scale  # [Hi, C, G, S]
        s = s.masked_fill(~valid[:, :, None], -math.inf)
        if lse is None:
            p = torch.softmax(s, -1).mean(2)
        else:
            lse_c = lse[rows].unflatten(1, (hi, group)).transpose(0, 1).to(s.dtype)
            p = (s - lse_c[..., None]).exp().mean(2)
        z = (qi[rows].transpose(0, 1)[:, :, None, :] @ ki[pos].transpose(-1, -2)).squeeze(-2) * index_scale
        log_r = torch.log_softmax(z.masked_fill(~valid, -math.inf), -1)
        term = torch.where(valid, torch.special.xlogy(p, p) - p * torch.where(valid, log_r, 0.0), 0.0)
        loss = term.sum() / (t * hi)
        loss.backward()
        total += loss.item()
    return total, qi.grad, ki.grad


# ---------------------------------------------------------------------------------------------------------------
# Checks


def check_select(x: dict, tail: int) -> dict:
    from openm3.ops.msa import reference
    from openm3.ops.msa.triton_select import select_blocks

    t, dev = x["ki"].shape[0], x["ki"].device
    qi = x["qi"][-tail:]
    cu_q = torch.tensor([0, qi.shape[0]], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, t], device=dev, dtype=torch.int32)
    kw = dict(block_size=BLOCK, topk=TOPK, local_blocks=LOCAL, cu_seqlens_k=cu_k)
    out = select_blocks(qi, x["ki"], cu_q, **kw)
    ref = reference.select_blocks(qi.float(), x["ki"].float(), cu_q, workspace=1 << 26, **kw)
    rows_equal = (out == ref).all(-1).float().mean().item()
    sets_equal = (out.sort(-1).values == ref.sort(-1).values).all(-1).float().mean().item()
    res = dict(rows_identical=rows_equal, sets_identical=sets_equal, passed=sets_equal >= 0.99)
    try:  # the TMA variant of the kernel (the default on Hopper) must agree with the pointer-load one exactly
        from openm3.ops.msa.triton_select import _select, select_launch

        launch = select_launch(HI, DI, BLOCK, qi.is_cuda, tma=1 - select_launch(HI, DI, BLOCK, qi.is_cuda).tma)
        res["tma_identical"] = bool(torch.equal(_select(qi, x["ki"], cu_q, cu_k, BLOCK, TOPK, LOCAL, launch=launch),
                                                out))
    except Exception as exc:  # noqa: BLE001 - reported, the pointer-load default is what the check covers
        res["tma_identical"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return res


def check_kl(x: dict, tail: int, sparse: bool, with_lse: bool, joint: bool = False) -> dict:
    """The KL kernel's loss, dqi and dki against the fp32 reference, and a bf16 PyTorch computation's errors.
    joint: the KL computed in the sparse attention's backward (`sparse_attention_with_kl`, with its own bf16 lse;
    `with_lse` must be False, so the reference and the bf16 baseline compute theirs too)."""
    from openm3.ops.msa import reference
    from openm3.ops.msa.triton_attention_kl import sparse_attention_with_kl
    from openm3.ops.msa.triton_kl import indexer_kl

    if joint and (with_lse or not sparse):
        raise ValueError("check_kl: joint=True is the sparse KL with the attention's own lse (with_lse=False)")

    t, dev = x["ki"].shape[0], x["ki"].device
    q, qi = x["q"][-tail:], x["qi"][-tail:]
    cu_q = torch.tensor([0, tail], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, t], device=dev, dtype=torch.int32)
    f32 = lambda y: y.detach().float().clone()  # noqa: E731 - a copy even for fp32 inputs
    if sparse:
        block_idx = reference.select_blocks(f32(qi), f32(x["ki"]), cu_q, block_size=BLOCK, topk=TOPK,
                                            local_blocks=LOCAL, cu_seqlens_k=cu_k, workspace=1 << 26)
    else:
        nb = -(-t // BLOCK)
        own = (torch.arange(t - tail, t, device=dev) // BLOCK)[:, None]
        j = torch.arange(nb, device=dev)
        block_idx = torch.where(j <= own, j, -1).to(torch.int32)[None].expand(HI, -1, -1).contiguous()
    lse = None
    if with_lse:
        _, lse = reference.sparse_attention(f32(q), f32(x["k"]), f32(x["k"]), block_idx, cu_q, block_size=BLOCK,
                                            cu_seqlens_k=cu_k, workspace=1 << 27)
    scale, index_scale = D ** -0.5, DI ** -0.5
    qi32, ki32 = f32(qi).requires_grad_(True), f32(x["ki"]).requires_grad_(True)
    ref = reference.indexer_kl(f32(q), f32(x["k"]), qi32, ki32, block_idx if sparse else None, cu_q,
                               block_size=BLOCK, lse=lse, cu_seqlens_k=cu_k, workspace=1 << 27)
    ref.backward()
    qi_k, ki_k = qi.detach().clone().requires_grad_(True), x["ki"].detach().clone().requires_grad_(True)
    if joint:  # the backward (from the KL alone: o's gradient is zero) writes the KL's value
        _, _, out = sparse_attention_with_kl(q, x["k"], x["k"], qi_k, ki_k, block_idx, cu_q, block_size=BLOCK,
                                             cu_seqlens_k=cu_k)
    else:
        out = indexer_kl(q, x["k"], qi_k, ki_k, block_idx if sparse else None, cu_q, block_size=BLOCK, lse=lse,
                         cu_seqlens_k=cu_k)
    out.backward()
    base_loss, base_dqi, base_dki = kl_bf16_torch(q, x["k"], qi, x["ki"], block_idx, scale=scale,
                                                  index_scale=index_scale, lse=lse)
    res = {}
    for name, mine, base, r in (("loss", out.detach(), torch.tensor(base_loss), ref.detach()),
                                ("dqi", qi_k.grad, base_dqi, qi32.grad), ("dki", ki_k.grad, base_dki, ki32.grad)):
        e_kernel, e_base = rel_err(mine.cpu(), r.cpu()), rel_err(base.cpu(), r.cpu())
        res[name] = dict(kernel=e_kernel, bf16_torch=e_base, ok=e_kernel <= 2 * e_base + 1e-6)
    res["loss_value"] = float(ref)
    res["passed"] = all(res[n]["ok"] for n in ("loss", "dqi", "dki"))
    return res


# ---------------------------------------------------------------------------------------------------------------
# Timings


def time_case(x: dict, t: int, with_dense: bool, no_lse: bool) -> dict:
    from openm3.ops.msa import triton_kl
    from openm3.ops.msa._checks import check_block_idx, check_seqlens
    from openm3.ops.msa.triton_common import query_positions
    from openm3.ops.msa.triton_kl import _entry_work, indexer_kl, kl_launch
    from openm3.ops.msa.triton_select import select_blocks

    cu = torch.tensor([0, t], device=DEVICE, dtype=torch.int32)
    res = {}

    def select():
        return select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)

    res["select_ms"] = bench_ms(select)
    res["select_tflops"] = HI * 2 * DI * t * (t + 1) / 2 / res["select_ms"] / 1e9
    block_idx = select()
    lse = _attention_lse(x, block_idx, cu)
    qi, ki = x["qi"].detach().requires_grad_(True), x["ki"].detach().requires_grad_(True)
    kw = dict(block_size=BLOCK, lse=lse)

    # The value checks of block_idx (host syncs + sorts) are timed on their own; the KL timings skip them.
    segments = check_seqlens(cu, t)
    res["kl_validate_ms"] = bench_ms(lambda: check_block_idx(block_idx, num_heads=HI, segments=segments,
                                                             block_size=BLOCK))
    launch = kl_launch(HQ // HKV, D, BLOCK, True)
    seq, _ = query_positions(cu, cu, t)
    res["kl_index_ms"] = bench_ms(lambda: _entry_work(block_idx, seq, cu, t, BLOCK, launch.max_entries))
    triton_kl.VALIDATE_BLOCK_IDX = False
    try:
        with torch.no_grad():
            res["kl_fwd_ms"] = bench_ms(lambda: indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, cu, **kw))

        def fwd_bwd():
            qi.grad = ki.grad = None
            indexer_kl(x["q"], x["k"], qi, ki, block_idx, cu, **kw).backward()

        res["kl_fwd_bwd_ms"] = bench_ms(fwd_bwd)
        if no_lse:
            with torch.no_grad():
                res["kl_fwd_no_lse_ms"] = bench_ms(
                    lambda: indexer_kl(x["q"], x["k"], x["qi"], x["ki"], block_idx, cu, block_size=BLOCK))
    finally:
        triton_kl.VALIDATE_BLOCK_IDX = True
    keys = (block_idx >= 0).sum().item() * BLOCK  # upper bound on (g, t, key) pairs (partial diagonals)
    teacher_flop = 2 * (HQ // HKV) * D * keys
    student_flop = 2 * DI * keys * 4  # z in both passes, dqi, dki
    res["kl_fwd_bwd_tflops"] = (teacher_flop + student_flop) / res["kl_fwd_bwd_ms"] / 1e9
    if with_dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (x[n].transpose(0, 1).unsqueeze(0).contiguous() for n in ("q", "k", "v"))

        def dense():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        res["dense_fwd_ms"] = bench_ms(dense, reps=3 if t < 100_000 else 2)
        res["dense_over_select"] = res["dense_fwd_ms"] / res["select_ms"]
    return res


# Launch variants tried by --sweep (fields of SelectLaunch / KLLaunch; {} is the default).
SELECT_SWEEP = [{}, dict(tma=0), dict(block_n=64), dict(num_stages=3, tma=0)]
KL_SWEEP = [{}, dict(block_n=64, heads_per_dot=16, num_stages=2),  # the default before session 2
            dict(prefetch=1), dict(dqi_buffer=1), dict(heads_per_dot=16), dict(block_q=32), dict(num_stages=2),
            dict(max_entries=1024), dict(compact_items=1)]


def sweep(x: dict, t: int) -> dict:
    """Median ms of select and of the KL forward+gradient pass for each launch variant (one T)."""
    from openm3.ops.msa.triton_kl import _kl_forward, kl_launch
    from openm3.ops.msa.triton_select import _select, select_launch

    cu = torch.tensor([0, t], device=DEVICE, dtype=torch.int32)
    res = {}
    for over in SELECT_SWEEP:
        name = "select " + (",".join(f"{k}={v}" for k, v in over.items()) or "default")
        try:
            launch = select_launch(HI, DI, BLOCK, True, **over)
            res[name] = bench_ms(lambda: _select(x["qi"], x["ki"], cu, cu, BLOCK, TOPK, LOCAL, launch=launch))
        except Exception as exc:  # noqa: BLE001 - a variant may not compile or fit; report and go on
            res[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"    {name}: {res[name]}", flush=True)
    block_idx = _select(x["qi"], x["ki"], cu, cu, BLOCK, TOPK, LOCAL)
    lse = _attention_lse(x, block_idx, cu)
    for over in KL_SWEEP:
        name = "kl " + (",".join(f"{k}={v}" for k, v in over.items()) or "default")
        try:
            launch = kl_launch(HQ // HKV, D, BLOCK, True, **over)
            res[name] = bench_ms(lambda: _kl_forward(x["q"], x["k"], x["qi"], x["ki"], block_idx, cu, cu, lse,
                                                     BLOCK, D ** -0.5, DI ** -0.5, True, launch=launch))
        except Exception as exc:  # noqa: BLE001
            res[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"    {name}: {res[name]}", flush=True)
    return res


def profile_case(x: dict, t: int, reps: int = 3) -> dict:
    """GPU time per call of every kernel that select and the KL forward+gradient launch (torch.profiler), ms."""
    from torch.profiler import ProfilerActivity, profile

    from openm3.ops.msa import triton_kl
    from openm3.ops.msa.triton_kl import indexer_kl
    from openm3.ops.msa.triton_select import select_blocks

    cu = torch.tensor([0, t], device=DEVICE, dtype=torch.int32)
    block_idx = select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    lse = _attention_lse(x, block_idx, cu)
    qi, ki = x["qi"].detach().requires_grad_(True), x["ki"].detach().requires_grad_(True)

    def step():
        select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
        qi.grad = ki.grad = None
        indexer_kl(x["q"], x["k"], qi, ki, block_idx, cu, block_size=BLOCK, lse=lse).backward()

    triton_kl.VALIDATE_BLOCK_IDX = False
    try:
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                step()
            torch.cuda.synchronize()
    finally:
        triton_kl.VALIDATE_BLOCK_IDX = True
    rows = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if total > 0:
            rows.append((evt.key[:60], total / reps / 1e3, evt.count // reps))
    rows.sort(key=lambda r: -r[1])
    for name, ms, n in rows[:14]:
        print(f"    {ms:9.3f} ms  x{n:<3d} {name}", flush=True)
    return {name: dict(ms=ms, calls=n) for name, ms, n in rows[:20]}


def time_select(x: dict, t: int) -> dict:
    from openm3.ops.msa.triton_select import select_blocks

    cu = torch.tensor([0, t], device=DEVICE, dtype=torch.int32)
    ms = bench_ms(lambda: select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL),
                  reps=2)
    return dict(select_ms=ms, select_tflops=HI * 2 * DI * t * (t + 1) / 2 / ms / 1e9)


def _attention_lse(x: dict, block_idx: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """lse of the sparse attention over block_idx (Triton kernel); a placeholder if that kernel fails."""
    try:
        from openm3.ops.msa.triton_attention import sparse_attention

        with torch.no_grad():
            return sparse_attention(x["q"], x["k"], x["v"], block_idx, cu, block_size=BLOCK)[1]
    except Exception:  # noqa: BLE001 - timings of the KL kernels do not depend on lse's values
        traceback.print_exc()
        print("  (sparse_attention failed: timing KL with a placeholder lse)")
        return torch.full(x["q"].shape[:2], 10.0, device=DEVICE)


def select_workspace(t: int) -> dict:
    """Peak memory of select beyond qi, ki and block_idx at T tokens."""
    from openm3.ops.msa.triton_select import select_blocks

    gen = torch.Generator(device="cuda").manual_seed(1)
    qi = torch.randn(t, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    ki = torch.randn(t, DI, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, t], device="cuda", dtype=torch.int32)
    out_bytes = HI * t * TOPK * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = select_blocks(qi, ki, cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    end.record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - out_bytes
    del out
    return dict(T=t, select_ms_single_call=start.elapsed_time(end), workspace_gib=peak / GIB)


# ---------------------------------------------------------------------------------------------------------------
# Compile check (no GPU needed)

_PTR_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
              torch.int64: "*i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.kernel, args, kw))


def compile_check(arch: int = 90, dump: str | None = None, select_variants=None, kl_variants=None) -> list[str]:
    """Compile every selection / KL kernel variant for `sm_<arch>` with ptxas, through the real host launch paths
    (M3 shape, bf16 CPU tensors; nothing runs). Needs TRITON_INTERPRET unset; no GPU. Returns one line per kernel.

    Catches what the interpreter accepts but a GPU compile rejects (tile minimums, layouts, loop-carried types);
    with TRITON_DUMP_PTXAS_LOG=1 ptxas also prints registers and spills per kernel. `dump`: a folder that receives
    each kernel's PTX (`<kernel>_<n>.ptx`), to read which instructions (wgmma, cp.async, red) the compiler chose.
    `select_variants` / `kl_variants`: launch overrides to compile as well (the KL ones on the training path: lse
    given, gradients on). Each line reports registers per thread and shared memory (cuobjdump), hence occupancy.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    from triton.tools.tensor_descriptor import TensorDescriptor

    from openm3.ops.msa import triton_kl, triton_select
    from openm3.ops.msa.triton_common import attention_launch

    launches: list = []
    originals = (triton_select._select_kernel, triton_kl._kl_stats_kernel, triton_kl._kl_main_kernel,
                 triton_kl._teacher_kernel)
    triton_select._select_kernel = _Recorder(originals[0], launches)
    triton_kl._kl_stats_kernel = _Recorder(originals[1], launches)
    triton_kl._kl_main_kernel = _Recorder(originals[2], launches)
    triton_kl._teacher_kernel = _Recorder(originals[3], launches)
    try:
        t, bf16 = 512, torch.bfloat16
        cu = torch.tensor([0, 300, t], dtype=torch.int32)
        q, k = torch.randn(t, HQ, D).to(bf16), torch.randn(t, HKV, D).to(bf16)
        qi, ki = torch.randn(t, HI, DI).to(bf16), torch.randn(t, DI).to(bf16)
        for over in [dict(tma=0), dict(tma=1)] + list(select_variants or []):
            launch = triton_select.select_launch(HI, DI, BLOCK, on_gpu=True, **over)
            triton_select._select(qi, ki, cu, cu, BLOCK, TOPK, LOCAL, launch=launch)
        # the opt-in student normaliser on the way (launch field index_lse=1)
        triton_select._select(qi, ki, cu, cu, BLOCK, TOPK, LOCAL, index_scale=DI ** -0.5,
                              launch=triton_select.select_launch(HI, DI, BLOCK, on_gpu=True, tma=1))
        pos = torch.arange(t) % 300  # position inside its sequence
        j = torch.arange(4, dtype=torch.int32).view(1, 1, 4)
        block_idx = torch.where(j * BLOCK <= pos.view(1, t, 1), j, -1).expand(HI, t, 4).to(torch.int32).contiguous()
        kl = triton_kl.kl_launch(HQ // HKV, D, BLOCK, on_gpu=True)
        scales = (D ** -0.5, DI ** -0.5)
        triton_kl._kl_forward(q, k, qi, ki, block_idx, cu, cu, None, BLOCK, *scales, True, launch=kl)
        triton_kl._kl_forward(q, k, qi, ki, block_idx, cu, cu, torch.zeros(t, HQ), BLOCK, *scales, False,
                              launch=kl)
        # (teacher_pass=0: the main pass recomputing the teacher, as for the dense warm-up)
        opt_in = [dict(dqi_buffer=1, prefetch=1), dict(unroll_heads=0), dict(unroll_heads=0, maxnreg=128),
                  dict(teacher_pass=0), dict(key_major=1)]
        for over in opt_in + list(kl_variants or []):  # the opt-in paths stay compilable
            kl = triton_kl.kl_launch(HQ // HKV, D, BLOCK, on_gpu=True, **over)
            triton_kl._kl_forward(q, k, qi, ki, block_idx, cu, cu, torch.zeros(t, HQ), BLOCK, *scales, True,
                                  launch=kl)
        # the teacher pass with the GPU's forward tiling (the calls above use the CPU tensors' one), K through TMA
        # descriptors as on a Hopper GPU: M3's group of 16 (one token per tile) and m3-small's 4 (16 tokens)
        key_operands = triton_kl._key_operands
        triton_kl._key_operands = lambda k, v, want, block_n: (
            TensorDescriptor(k, shape=[k.shape[0], k.shape[1] * k.shape[2]], strides=[k.stride(0), 1],
                             block_shape=[block_n, k.shape[2]]), None, True)
        try:
            for hq in (HQ, 4 * HKV):
                attn = attention_launch(hq // HKV, D, BLOCK, bf16, on_gpu=True)
                triton_kl._teacher_pass(torch.randn(t, hq, D).to(bf16), k, torch.zeros(t, hq), block_idx, cu, cu,
                                        BLOCK, scales[0], launch=attn)
        finally:
            triton_kl._key_operands = key_operands
    finally:
        triton_select._select_kernel = originals[0]
        triton_kl._kl_stats_kernel, triton_kl._kl_main_kernel, triton_kl._teacher_kernel = originals[1:]
    lines = []
    for kernel, args, kw in launches:
        # Specialised like a real launch: ints equal to 1 become constants, ints and pointers divisible by 16 carry
        # tt.divisibility (what lets the compiler vectorise loads).
        sig, consts, attrs = {}, {}, {}
        for i, (name, value) in enumerate(zip(kernel.arg_names, args)):
            if isinstance(value, TensorDescriptor):
                dtype = _PTR_TYPES[value.base.dtype][1:]
                sig[name] = f"tensordesc<{dtype}[{', '.join(str(b) for b in value.block_shape)}]>"
            elif isinstance(value, torch.Tensor):
                sig[name] = _PTR_TYPES[value.dtype]
                if value.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, int) and value == 1:
                sig[name], consts[name] = "constexpr", 1
            elif isinstance(value, int):
                sig[name] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "fp32"
        for name, value in kw.items():
            if name not in _LAUNCH_OPTIONS:
                sig[name], consts[name] = "constexpr", value
        options = {n: kw[n] for n in _LAUNCH_OPTIONS if n in kw}
        compiled = triton_compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        flags = {n: v for n, v in consts.items()
                 if n in ("TEACHER", "GRAD", "DQI_BUF", "USE_TMA", "BLOCK_M", "BLOCK_N", "BLOCK_Q", "HG", "WITH_LSE",
                          "HAS_TEACHER", "TOKENS")}
        lines.append(f"sm_{arch} {kernel.__name__} {flags} {options} shared={compiled.metadata.shared} "
                     f"regs={_registers(compiled.asm['cubin'])}")
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"{kernel.__name__}_{len(lines)}.ptx").write_text(compiled.asm["ptx"])
        print(lines[-1], flush=True)
    return lines


def _registers(cubin: bytes) -> str | None:
    """Registers per thread (and local-memory stack, where spills go) of a compiled kernel, read with the cuobjdump
    that ships with Triton (None if absent)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    if regs is None:
        return None
    return regs.group(1) + (f" stack={stack.group(1)}" if stack and stack.group(1) != "0" else "")


# ---------------------------------------------------------------------------------------------------------------
# Main


def _run(name: str, fn, results: dict):
    print(f"--- {name}", flush=True)
    try:
        out = fn()
        results[name] = out
        print("   ", json.dumps(out, default=float), flush=True)
    except Exception as exc:  # noqa: BLE001 - report and continue with the next case
        traceback.print_exc()
        results[name] = dict(error=f"{type(exc).__name__}: {exc}")
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072, 1048576])
    ap.add_argument("--check-T", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--sweep", type=int, nargs="*", default=None, metavar="T",
                    help="also time launch variants (SELECT_SWEEP, KL_SWEEP) at these T (default 32768)")
    ap.add_argument("--profile", type=int, nargs="*", default=None, metavar="T",
                    help="also list the GPU time of every kernel of select + KL fwd/grad (torch.profiler) at these T")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--compile-check", action="store_true",
                    help="only compile every kernel for sm_90 (no GPU needed; TRITON_INTERPRET must be unset)")
    ap.add_argument("--dump-ptx", default=None, metavar="DIR", help="with --compile-check: write each kernel's PTX")
    args = ap.parse_args(argv)
    if args.compile_check:
        sweep_too = args.sweep is not None  # --compile-check --sweep: the sweep's launch variants as well
        lines = compile_check(dump=args.dump_ptx, select_variants=SELECT_SWEEP if sweep_too else None,
                              kl_variants=KL_SWEEP if sweep_too else None)
        print(f"compiled {len(lines)} kernels")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton

    results: dict = {}
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                shape=dict(Hq=HQ, Hkv=HKV, D=D, Hi=HI, Di=DI, block=BLOCK, topk=TOPK, local=LOCAL), dtype="bf16")
    print(json.dumps(meta))
    if not args.skip_check:
        for t in args.check_T:
            x = m3_inputs(t)
            tail = min(args.tail, t)
            _run(f"check_select_T{t}", lambda: check_select(x, tail), results)
            _run(f"check_kl_sparse_lse_T{t}", lambda: check_kl(x, tail, True, True), results)
            if t == min(args.check_T):
                _run(f"check_kl_sparse_nolse_T{t}", lambda: check_kl(x, tail, True, False), results)
                _run(f"check_kl_dense_T{t}", lambda: check_kl(x, tail, False, False), results)
            x = None  # free the GPU memory (closures above hold these names)
    for t in args.T:
        x = m3_inputs(t, main=t <= 200_000)
        if t > 200_000:  # the KL is a training op; at 1M time the selection only
            _run(f"time_select_T{t}", lambda: time_select(x, t), results)
        else:
            _run(f"time_T{t}", lambda: time_case(x, t, with_dense=True, no_lse=t <= 32768), results)
        x = None  # free the GPU memory (closures above hold these names)
        torch.cuda.empty_cache()
    _run(f"workspace_select_T{max(args.T)}", lambda: select_workspace(max(args.T)), results)
    for t in args.profile or []:
        x = m3_inputs(t)
        _run(f"profile_T{t}", lambda: profile_case(x, t), results)
        x = None  # free the GPU memory (closures above hold these names)
    sweep_ts = [] if args.sweep is None else (args.sweep or [32768])
    for t in sweep_ts:
        x = m3_inputs(t)
        _run(f"sweep_T{t}", lambda: sweep(x, t), results)
        x = None  # free the GPU memory (closures above hold these names)

    print("\n=== summary (ms) ===")
    print(f"{'T':>9} {'select':>8} {'TF/s':>8} {'kl_chk':>8} {'kl_idx':>8} {'kl_fwd':>8} {'kl_f+b':>8} "
          f"{'kl_nolse':>8} {'dense_f':>8} {'dense/sel':>8}")
    for t in args.T:
        r = results.get(f"time_T{t}") or results.get(f"time_select_T{t}") or {}
        cells = [r.get(k) for k in ("select_ms", "select_tflops", "kl_validate_ms", "kl_index_ms", "kl_fwd_ms",
                                     "kl_fwd_bwd_ms", "kl_fwd_no_lse_ms", "dense_fwd_ms", "dense_over_select")]
        print(f"{t:>9} " + " ".join(f"{c:>8.2f}" if isinstance(c, float) else f"{'-':>8}" for c in cells))
    checks = {n: r.get("passed") for n, r in results.items() if n.startswith("check")}
    print("checks:", checks)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "msa_select_kl.json"
    path.write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=float))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
