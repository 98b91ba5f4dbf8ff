"""Measured floors for the two MSA targets still missed, and the prefill with selection and attention overlapped.

    python -m benchmarks.msa_floors --out benchmarks/results/            # stream, gather, overlap
    python -m benchmarks.msa_floors --parts stream --decode-T 1048576    # one part
    python -m benchmarks.msa_floors --parts tail --compare benchmarks._decode_head   # A/B against a copy

Five parts, each timed in the same process as the openm3 kernel it bounds (M3 shape, bf16, one layer):

  stream   decode (issue 4): a kernel that only streams the 1M-token fp8 index-key cache (every byte loaded once,
           an integer max so nothing is dead code) with 1-8 programs per SM, CUDA-graph timed like
           `benchmarks/msa_decode.py`, against the decode scoring kernel, the whole decode step and cuDNN dense
           decode over the same cache. It is the bandwidth a kernel of this length reaches at all.
  gather   prefill (issue 3): a kernel that loads exactly the K/V tiles the one-token forward gathers (16 blocks per
           (token, KV head) of the benchmark's drifting selection at 128K, through the same TMA boxes), no dots,
           against the sparse forward on that selection: how much of the forward is the gather itself.
  overlap  prefill: the queries in chunks, the selection of chunk c + 1 on a second (high-priority) stream while
           the forward of chunk c runs: the selection is tensor-core bound (~670 TFLOP/s at 128K), the forward
           bound by the K/V gather, so the two may share the GPU. Against select + forward in sequence.
  bandwidth decode: how fast anything reads the same bytes: cuDNN dense decode over a KV cache of that size (and a
           fit of its fixed cost and rate over 1-16x it), torch's reduction and copy, Triton streams of several
           shapes, and the decode scoring kernel over a grid of its launch knobs.
  tail     decode: the kernel timeline of a 1M-token batch-1 fp8 step inside a CUDA graph (what runs after the
           scoring, and when), for a few knob settings and optionally another version of the module, and the
           latency of the top-k reductions the shrink and merge use.

Writes `msa_floors_<stamp>.json` with every figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks import RESULTS
from benchmarks._inputs import DI, HI, HKV, HQ, D, m3_inputs
from openm3.ops.msa.triton_decode import _token_scales

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

BLOCK, TOPK, LOCAL = 128, 16, 1


# ---------------------------------------------------------------------------------------------------------------
# Kernels (measurement only: they compute nothing anyone needs)


@triton.jit
def _stream_kernel(X, OUT, n_tiles, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr):
    """Grid-stride walk over [n_tiles * ROWS, COLS] uint8 (a tensor descriptor, one [ROWS, COLS] box per tile):
    the max byte of everything this program loaded -> OUT[pid]."""
    pid = tl.program_id(0)
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=STAGES):
        acc = tl.maximum(acc, X.load([t * ROWS, 0]).to(tl.int32))
    tl.store(OUT + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _stream_contig_kernel(X, OUT, n_tiles, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr):
    """As `_stream_kernel`, but each program walks one contiguous run of tiles (the scoring kernel's order)."""
    pid = tl.program_id(0)
    per = tl.cdiv(n_tiles, tl.num_programs(0))
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for t in tl.range(pid * per, tl.minimum(pid * per + per, n_tiles), num_stages=STAGES):
        acc = tl.maximum(acc, X.load([t * ROWS, 0]).to(tl.int32))
    tl.store(OUT + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _stream_ptr_kernel(X, OUT, n_tiles, ROWS: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr,
                       EVICT_FIRST: tl.constexpr):
    """Grid-stride walk over [n_tiles * ROWS, WORDS] int32 with plain (vectorised, cp.async-pipelined) loads,
    optionally marked evict-first in L2: the max word -> OUT[pid]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, ROWS)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    acc = tl.zeros([ROWS, WORDS], dtype=tl.int32)
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=STAGES):
        if EVICT_FIRST:
            x = tl.load(X + t * (ROWS * WORDS) + offs, eviction_policy="evict_first")
        else:
            x = tl.load(X + t * (ROWS * WORDS) + offs)
        acc = tl.maximum(acc, x)
    tl.store(OUT + pid, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _score_ladder_kernel(X, S, Qi, OUT, TABLE, CAND, n_blocks, SEG: tl.constexpr, ROWS: tl.constexpr,
                         DI_: tl.constexpr, BLOCK_M: tl.constexpr, LEVEL: tl.constexpr, STAGES: tl.constexpr,
                         LOOKUP: tl.constexpr, KP: tl.constexpr):
    """The decode scoring kernel's loop built up one piece at a time (program = SEG consecutive fp8 key blocks,
    as there): LEVEL 0 loads each [ROWS, DI] tile (TMA) and keeps a byte max; 1 widens e4m3 -> fp16 first; 2 also
    takes the dot with the [BLOCK_M, DI] fp16 queries; 3 also multiplies by the per-token scales; 4 also takes
    each row's block max into a [BLOCK_M, SEG] score tile; 5 also writes each row's KP best blocks as int64 sort
    keys, as the scoring kernel's epilogue does. LOOKUP: how a block's page id is found: 0 page = block (no
    table), 1 the segment's ids loaded once and picked by a masked sum per block (the scoring kernel's way), 2 a
    scalar load per block from the table."""
    seg = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, DI_)
    seg_cols = tl.arange(0, SEG)
    q = tl.load(Qi + rows[:, None] * DI_ + dims[None, :]).to(tl.float16)
    acc_b = tl.zeros([ROWS, DI_], dtype=tl.int32)
    acc_h = tl.full([ROWS, DI_], float("-inf"), dtype=tl.float16)
    acc_s = tl.full([BLOCK_M, ROWS], float("-inf"), dtype=tl.float32)
    scores = tl.full([BLOCK_M, SEG], float("-inf"), dtype=tl.float32)
    if LOOKUP == 1:
        pages = tl.load(TABLE + seg * SEG + seg_cols, mask=seg * SEG + seg_cols < n_blocks, other=0)
    for jj in tl.range(0, SEG, num_stages=STAGES):
        blk = seg * SEG + jj
        if LOOKUP == 0:
            page = tl.minimum(blk, n_blocks - 1)
        elif LOOKUP == 1:
            page = tl.sum(tl.where(seg_cols == jj, pages, 0))
        else:
            page = tl.load(TABLE + tl.minimum(blk, n_blocks - 1))
        raw = X.load([page * ROWS, 0])
        if LEVEL == 0:
            acc_b = tl.maximum(acc_b, raw.to(tl.int32))
        else:
            ki = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            if LEVEL == 1:
                acc_h = tl.maximum(acc_h, ki)
            else:
                s = tl.dot(q, tl.trans(ki))
                if LEVEL >= 3:
                    s = s * _token_scales(S, page * ROWS, ROWS)[None, :]
                if LEVEL >= 4:
                    best = tl.max(s, axis=1)
                    scores = tl.where(seg_cols[None, :] == jj, best[:, None], scores)
                else:
                    acc_s = tl.maximum(acc_s, s)
    if LEVEL == 0:
        tl.store(OUT + seg, tl.max(tl.max(acc_b, axis=1), axis=0).to(tl.float32))
    elif LEVEL == 1:
        tl.store(OUT + seg, tl.max(tl.max(acc_h.to(tl.float32), axis=1), axis=0))
    elif LEVEL <= 3:
        tl.store(OUT + seg, tl.max(tl.max(acc_s, axis=1), axis=0))
    elif LEVEL == 4:
        tl.store(OUT + seg, tl.max(tl.max(scores, axis=1), axis=0))
    else:
        bits = scores.to(tl.int32, bitcast=True)
        mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = (mono.to(tl.int64) << 32) | (4294967295 - (seg * SEG + seg_cols[None, :]).to(tl.int64))
        out = CAND + (rows * tl.num_programs(0) + seg) * KP
        for slot in tl.static_range(KP):
            top = tl.max(keys, axis=1)
            tl.store(out + slot, top)
            keys = tl.where(keys == top[:, None], -9223372036854775807, keys)


@triton.jit
def _chain_kernel(X, PDL: tl.constexpr):
    """One link of a chain of dependent launches: reads what the previous link wrote, writes one value."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    tl.store(X + pid, tl.load(X + pid) + 1.0)


@triton.jit
def _gather_kernel(K, V, SEL, OUT, T, Tk, BLOCK_SIZE: tl.constexpr, TOPK_: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    """Program (token, KV head g): loads the K and V tiles of the TOPK blocks the token selected (SEL [Hkv, T, TOPK]),
    BLOCK_N keys at a time through [Tk, Hkv * D] descriptors as the forward does, and stores the sum
    of what it loaded. No dots, no softmax: the forward's gather on its own."""
    tok = tl.program_id(0)
    g = tl.program_id(1)
    N_SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    sel = SEL + (g * T + tok).to(tl.int64) * TOPK_
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for step in tl.range(0, TOPK_ * N_SUB, num_stages=STAGES):
        blk = tl.load(sel + step // N_SUB)  # an unused slot (-1: early tokens only) loads block 0, unbranched
        row0 = tl.maximum(blk, 0) * BLOCK_SIZE + (step % N_SUB) * BLOCK_N
        acc += K.load([row0, g * BLOCK_D]).to(tl.float32) + V.load([row0, g * BLOCK_D]).to(tl.float32)
    tl.store(OUT + g * T + tok, tl.sum(tl.sum(acc, axis=1), axis=0))


_MIN_KEY = tl.constexpr(-9223372036854775807)  # below every key (as in triton_decode); kernels read constexprs


@triton.jit
def _topk_probe_kernel(KEYS, OUT, N: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr):
    """Program p: loads N int64 keys (its own), reduces them and stores 16 results: MODE 0 the max only (the
    load and store alone), 1 Triton's bitonic top-16 (the decode merge's way), 2 sixteen max-reduction rounds,
    3 the (p % 16)-th largest by rank counting (an N x N comparison), the one key an attention split needs."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    slots = tl.arange(0, 16)
    keys = tl.load(KEYS + pid * N + offs)
    if MODE == 0:
        top = tl.zeros([16], tl.int64) + tl.max(keys, axis=0)
    elif MODE == 1:
        top = tl.topk(keys, 16)
    elif MODE == 2:
        top = tl.full([16], _MIN_KEY, tl.int64)
        for slot in tl.static_range(16):
            best = tl.max(keys, axis=0)
            top = tl.where(slots == slot, best, top)
            keys = tl.where(keys == best, _MIN_KEY, keys)
    else:
        rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
        top = tl.zeros([16], tl.int64) + tl.sum(tl.where(rank == pid % 16, keys, 0), axis=0)
    tl.store(OUT + pid * 16 + slots, top)


# ---------------------------------------------------------------------------------------------------------------
# Parts


def _descriptor(x: torch.Tensor, block_shape):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, shape=list(x.shape), strides=list(x.stride()), block_shape=list(block_shape))


def _decode_cache(t: int, fp32_scales: bool = True):
    """One sequence of t cached tokens at M3's shape, batch 1: (nb blocks, generator, fp8 index keys and their
    e8m0 scales, K and V pages, the identity block table, lengths, the query, the index query, and the same keys
    quantised with fp32 scales as a pair (keys, scales): the format before session 21, which the decode module of
    an earlier session (`--compare`) needs; None without fp32_scales)."""
    from benchmarks.msa_decode import _quantised
    from openm3.ops.msa import decode

    nb = t // BLOCK
    gen = torch.Generator(device="cuda").manual_seed(0)
    ki = torch.empty(nb, BLOCK, DI, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    ki8, ki_scale = _quantised(ki, decode.SCALE_E8M0)
    fp32_scaled = _quantised(ki, torch.float32) if fp32_scales else None
    del ki
    k = torch.empty(nb, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    table = torch.arange(nb, device="cuda", dtype=torch.int32).view(1, nb)
    lens = torch.full((1,), t, device="cuda", dtype=torch.int32)
    q = torch.randn(1, HQ, D, device="cuda", generator=gen).bfloat16()
    qi = torch.randn(1, HI, DI, device="cuda", generator=gen).bfloat16()
    return nb, gen, ki8, ki_scale, k, v, table, lens, q, qi, fp32_scaled


def stream_part(t: int, programs_per_sm=(1, 2, 8), stages=(3, 4), compare: str | None = None) -> dict:
    """Streaming floor of the fp8 index-key cache at t tokens, batch 1, next to the real decode kernels."""
    from benchmarks.msa_decode import dense_sdpa, graph_time_ms, sdpa_backend
    from openm3.ops.msa import triton_decode

    nb, gen, ki8, ki_scale, k, v, table, lens, q, qi, fp32_scaled = _decode_cache(t)
    qi16 = torch.zeros(16, DI, device="cuda", dtype=torch.bfloat16)  # the kernel's 16 padded query rows
    qi16[:HI] = qi[0]
    key_bytes = ki8.numel() + ki_scale.numel() * ki_scale.element_size()
    rec: dict = {"T": t, "index_key_bytes": key_bytes}

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    desc = _descriptor(ki8.view(torch.uint8).view(-1, DI), [BLOCK, DI])
    out = torch.empty(max(8 * sms, nb), dtype=torch.int32, device="cuda")
    best = None
    for per_sm in programs_per_sm:
        for st in stages:
            grid = (min(per_sm * sms, nb),)
            ms = graph_time_ms(lambda: _stream_kernel[grid](desc, out, nb, ROWS=BLOCK, COLS=DI, STAGES=st,
                                                            num_warps=4))
            rec[f"stream_ms_p{per_sm}_s{st}"] = ms
            best = ms if best is None else min(best, ms)
            print(f"    stream {per_sm} programs/SM, {st} stages: {ms * 1e3:.1f} us "
                  f"({ki8.numel() / ms / 1e9:.2f} TB/s of fp8 keys; the scales are not read)", flush=True)
    rec["stream_best_ms"] = best
    rec["stream_best_tb_per_s"] = ki8.numel() / best / 1e9

    n_seg = triton.cdiv(nb, 32)
    out_f = torch.empty(n_seg, dtype=torch.float32, device="cuda")
    cand = torch.empty(16 * n_seg * 15, dtype=torch.int64, device="cuda")
    ladder = [(level, 0, 3) for level in range(6)] + [(4, 1, 3), (5, 1, 3), (4, 2, 3), (5, 2, 3), (5, 2, 4)]
    for level, lookup, st in ladder:
        rec[f"ladder_ms_l{level}_lookup{lookup}_s{st}"] = ms = graph_time_ms(
            lambda: _score_ladder_kernel[(n_seg,)](desc, ki_scale, qi16, out_f, table, cand, nb, SEG=32, ROWS=BLOCK,
                                                   DI_=DI, BLOCK_M=16, LEVEL=level, STAGES=st, LOOKUP=lookup, KP=15,
                                                   num_warps=4))
        print(f"    scoring ladder level {level}, page lookup {lookup}, {st} stages: {ms * 1e3:.1f} us", flush=True)
    chain = torch.zeros(64, device="cuda")
    for pdl in (False, True):
        for links in (1, 2, 4):
            def step():
                for _ in range(links):
                    _chain_kernel[(64,)](chain, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
            ms = rec[f"chain_ms_{links}_links{'_pdl' if pdl else ''}"] = graph_time_ms(step)
            print(f"    {links} dependent tiny launches{' with PDL' if pdl else ''}: {ms * 1e3:.2f} us per step",
                  flush=True)
    modules = {"": (triton_decode, ki8, ki_scale), "_scale_fp32": (triton_decode, *fp32_scaled)}
    if compare:  # another version of the decode module, timed in the same process (A/B), with fp32 scales
        modules["_" + compare.rsplit(".", 1)[-1]] = (importlib.import_module(compare), *fp32_scaled)
    for sfx, (mod, ki_, ks_) in modules.items():
        rec["score_ms" + sfx] = graph_time_ms(lambda: mod._score_candidates(
            qi, ki_, table, lens, q_len=1, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL, ki_scale=ks_,
            segment_blocks=None, stages=3, num_warps=4, fp8_math="fp16", score_loads="tma", pdl=True))
        rec["msa_step_ms" + sfx] = graph_time_ms(lambda: mod.decode_msa(
            q, qi, k, v, ki_, table, lens, q_len=1, topk=TOPK, local_blocks=LOCAL, ki_scale=ks_)[0])
        idx = mod.decode_select_blocks(qi, ki_, table, lens, q_len=1, block_size=BLOCK, topk=TOPK,
                                       local_blocks=LOCAL, ki_scale=ks_)
        rec["block_idx" + sfx] = idx.flatten().tolist()
        rec["attention_ms" + sfx] = graph_time_ms(lambda: mod.decode_attention(q, k, v, table, lens, idx,
                                                                                q_len=1)[0])
        print(f"    [{sfx or 'current'}] score {rec['score_ms' + sfx] * 1e3:.1f} us, step "
              f"{rec['msa_step_ms' + sfx] * 1e3:.1f} us, attention + combine on a given selection "
              f"{rec['attention_ms' + sfx] * 1e3:.1f} us", flush=True)
    if compare:
        rec["same_selection_as_compare"] = rec["block_idx"] == rec["block_idx" + sfx]
    kd, vd = (x.view(1, t, HKV, D).transpose(1, 2) for x in (k, v))
    qd = q.view(1, HQ, 1, D)
    backend = sdpa_backend(qd, kd, vd)
    rec["dense_ms"] = graph_time_ms(lambda: dense_sdpa(qd, kd, vd, backend))
    rec["dense_backend"] = str(backend)
    rec["speedup_vs_dense"] = rec["dense_ms"] / rec["msa_step_ms"]
    rec["budget_12x_ms"] = rec["dense_ms"] / 12
    rec["stream_share_of_12x_budget"] = best / rec["budget_12x_ms"]
    print(f"    score kernel {rec['score_ms'] * 1e3:.1f} us, whole step {rec['msa_step_ms'] * 1e3:.1f} us, dense "
          f"{rec['dense_ms'] * 1e3:.1f} us ({rec['speedup_vs_dense']:.2f}x); 12x budget "
          f"{rec['budget_12x_ms'] * 1e3:.1f} us, of which streaming the keys alone takes {best * 1e3:.1f} us",
          flush=True)
    return rec


def bandwidth_part(t: int) -> dict:
    """How fast anything on this GPU reads the fp8 index-key cache's bytes (issue 4: is the ~33 us stream floor
    at 1M the chip's, or that of one kernel shape?): cuDNN dense decode over a KV cache of the same size (t / 16
    tokens) and of 2-16x that (its fixed cost and its rate, by a straight-line fit), torch's own reduction and
    copy of the key bytes, Triton streams of several shapes (TMA boxes of 128 / 256 rows, contiguous runs,
    plain loads with and without evict-first, 4 / 8 warps, 1-4 programs per SM), and the real scoring kernel
    over a grid of its launch knobs (segment, stages, warps)."""
    from benchmarks.msa_decode import dense_sdpa, graph_time_ms, sdpa_backend
    from openm3.ops.msa import triton_decode

    nb, gen, ki8, ki_scale, k, v, table, lens, q, qi, _ = _decode_cache(t, fp32_scales=False)
    key_bytes = ki8.numel()
    rec: dict = {"T": t, "fp8_key_bytes": key_bytes}
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def show(name, ms, nbytes=key_bytes):
        rec[f"{name}_ms"] = ms
        print(f"    {name}: {ms * 1e3:.2f} us ({nbytes / ms / 1e9:.2f} TB/s)", flush=True)

    qd = q.view(1, HQ, 1, D)
    fit = []
    for div in (16, 8, 4, 2, 1):  # dense decode over t / div tokens: t / 16 holds the key cache's bytes
        n = t // div
        kd, vd = (x.view(1, t, HKV, D)[:, :n].transpose(1, 2) for x in (k, v))
        backend = sdpa_backend(qd, kd, vd)
        ms = graph_time_ms(lambda: dense_sdpa(qd, kd, vd, backend))
        nbytes = 2 * n * HKV * D * 2
        show(f"dense_T{n}", ms, nbytes)
        fit.append((nbytes, ms))
    xs, ys = zip(*fit)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in fit) / sum((x - mx) ** 2 for x in xs)
    rec["dense_fit_fixed_us"] = (my - slope * mx) * 1e3
    rec["dense_fit_tb_per_s"] = 1 / slope / 1e9
    print(f"    dense decode fit: {rec['dense_fit_fixed_us']:.2f} us + bytes at {rec['dense_fit_tb_per_s']:.2f} TB/s",
          flush=True)

    words = ki8.view(torch.int32).view(-1)
    show("torch_amax_int32", graph_time_ms(lambda: words.amax()))
    copy = torch.empty_like(words)
    show("torch_copy", graph_time_ms(lambda: copy.copy_(words)), 2 * key_bytes)

    out = torch.empty(8 * sms, dtype=torch.int32, device="cuda")
    flat = ki8.view(torch.uint8).view(-1, DI)
    for rows in (128, 256):
        desc = _descriptor(flat, [rows, DI])
        n_tiles = flat.shape[0] // rows
        for kernel, tag in ((_stream_kernel, "stride"), (_stream_contig_kernel, "contig")):
            for warps in (4, 8):
                for per_sm in (1, 2, 3, 4):
                    for st in (2, 3, 4):
                        if rows == 256 and st == 4:
                            continue  # 3 x 32 KiB boxes already fill a program's shared memory
                        grid = (min(per_sm * sms, n_tiles),)
                        try:
                            ms = graph_time_ms(lambda: kernel[grid](desc, out, n_tiles, ROWS=rows, COLS=DI, STAGES=st,
                                                                    num_warps=warps))
                        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
                            rec[f"tma_{tag}_r{rows}_w{warps}_p{per_sm}_s{st}_error"] = str(e)[:160]
                            continue
                        show(f"tma_{tag}_r{rows}_w{warps}_p{per_sm}_s{st}", ms)
    n_tiles = words.numel() // (64 * 32)
    for evict in (False, True):
        for warps in (4, 8):
            for per_sm in (2, 4):
                for st in (3, 4):
                    grid = (min(per_sm * sms, n_tiles),)
                    ms = graph_time_ms(lambda: _stream_ptr_kernel[grid](words, out, n_tiles, ROWS=64, WORDS=32,
                                                                        STAGES=st, EVICT_FIRST=evict,
                                                                        num_warps=warps))
                    show(f"ptr{'_evict' if evict else ''}_w{warps}_p{per_sm}_s{st}", ms)

    for loads in ("tma", "hoist"):
        for seg in (8, 16, 32):
            for st in (2, 3, 4):
                for warps in (4, 8):
                    if loads == "hoist" and (seg != 16 or warps != 4):
                        continue
                    try:
                        ms = graph_time_ms(lambda: triton_decode._score_candidates(
                            qi, ki8, table, lens, q_len=1, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL,
                            ki_scale=ki_scale, segment_blocks=seg, stages=st, num_warps=warps, fp8_math="fp16",
                            score_loads=loads, pdl=True))
                    except Exception as e:  # noqa: BLE001
                        rec[f"score_{loads}_seg{seg}_s{st}_w{warps}_error"] = str(e)[:160]
                        continue
                    show(f"score_{loads}_seg{seg}_s{st}_w{warps}", ms, key_bytes + ki_scale.numel())
    best = min((ms, name) for name, ms in rec.items()
               if name.endswith("_ms") and not name.startswith(("dense", "torch")))
    rec["best_stream_or_score"] = best[1]
    print(f"    fastest Triton read of the keys: {best[1]} {best[0] * 1e3:.2f} us", flush=True)
    return rec


def kernel_timeline(fn, steps: int = 20, reps: int = 5) -> list[dict]:
    """Kernels of one call of `fn` as the GPU ran them inside a CUDA graph of `steps` calls (profiled over `reps`
    replays): per kernel of the call, in launch order, its name and the median start, end and duration (us), times
    relative to the start of the call's first kernel. With PDL a kernel starts (is resident) before the previous
    one ends, so the ends are what place the time."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    per_call = len(spans) // (steps * reps)
    if per_call == 0 or len(spans) % (steps * reps):
        return [{"error": f"{len(spans)} kernels for {steps * reps} calls"}]
    rows = []
    for k in range(per_call):
        starts, ends = [], []
        for c in range(1, steps * reps):  # the first call of each trace has no predecessor in flight: skipped
            base = spans[c * per_call][0]
            starts.append(spans[c * per_call + k][0] - base)
            ends.append(spans[c * per_call + k][1] - base)
        rows.append({"kernel": spans[k][2][:60], "start_us": statistics.median(starts),
                     "end_us": statistics.median(ends),
                     "dur_us": statistics.median(e - s for s, e in zip(starts, ends))})
    return rows


def tail_part(t: int, variants: dict | None = None, compare: str | None = None) -> dict:
    """Where the decode step's time after the scoring goes (issue 4), at t tokens, batch 1, fp8 index keys: the
    kernel timeline of the step (and of a few knob settings, and of another module's, `compare`), whether each
    step selects the same blocks as the default, and the latency of the top-k reductions the shrink
    and merge run (a chain of dependent launches of `_topk_probe_kernel` against the same chain that only loads
    and stores)."""
    from benchmarks.msa_decode import graph_time_ms
    from openm3.ops.msa import triton_decode

    nb, gen, ki8, ki_scale, k, v, table, lens, q, qi, fp32_scaled = _decode_cache(t)
    rec: dict = {"T": t}
    # the same cache with its pages shuffled (block j in page perm[j]), as a long-running engine's pool may be
    perm = torch.randperm(nb, device="cuda", generator=gen)
    shuffled = [torch.empty_like(x) for x in (k, v, ki8, ki_scale)]
    for dst, src in zip(shuffled, (k, v, ki8, ki_scale)):
        dst[perm] = src
    cache = (k, v, ki8, ki_scale, table)
    cache_fp32_scales = (k, v, *fp32_scaled, table)
    cache_shuffled = (*shuffled, perm.to(torch.int32).view(1, nb))
    variants = variants or {"default": (triton_decode, {}, cache),
                            "fold_shrink": (triton_decode, dict(fold_shrink=True), cache),
                            "fused_combine": (triton_decode, dict(fuse_combine=True), cache),
                            "two_launch": (triton_decode, dict(fold_shrink=True, fuse_combine=True), cache),
                            "shrink16": (triton_decode, dict(shrink_groups=16), cache),
                            "scale_fp32": (triton_decode, {}, cache_fp32_scales),
                            "shuffled_pages": (triton_decode, {}, cache_shuffled)}
    if compare:  # another version of the decode module, its default step timed in the same process (A/B)
        variants[compare.rsplit(".", 1)[-1]] = (importlib.import_module(compare), {}, cache_fp32_scales)
    for name, (mod, kw, (k_, v_, ki_, ks_, table_)) in variants.items():
        def run():  # (o, lse, block_idx)
            return mod.decode_msa(q, qi, k_, v_, ki_, table_, lens, q_len=1, topk=TOPK, local_blocks=LOCAL,
                                  ki_scale=ks_, **kw)

        def step():
            return run()[0]
        rec[f"step_ms_{name}"] = graph_time_ms(step)
        rec[f"timeline_{name}"] = rows = kernel_timeline(step)
        sel = run()[2]
        first = rec.setdefault("block_idx_default", sel.flatten().tolist())
        rec[f"same_selection_{name}"] = sel.flatten().tolist() == first
        print(f"    {name}: step {rec[f'step_ms_{name}'] * 1e3:.1f} us; " + "; ".join(
            f"{r.get('kernel', r.get('error'))[:24]} {r.get('start_us', 0):.1f}-{r.get('end_us', 0):.1f}"
            for r in rows), flush=True)
    programs = 64
    for n in (256, 512, 1024):
        keys = torch.randint(-2 ** 62, 2 ** 62, (programs * n,), device="cuda", dtype=torch.int64)
        out = torch.empty(programs * 16, dtype=torch.int64, device="cuda")
        for mode in range(4):
            if mode == 3 and n > 512:
                continue
            def chain():
                for _ in range(4):
                    _topk_probe_kernel[(programs,)](keys, out, N=n, MODE=mode, PDL=True, launch_pdl=True)
            rec[f"topk_chain4_ms_n{n}_mode{mode}"] = graph_time_ms(chain)
        base = rec[f"topk_chain4_ms_n{n}_mode0"]
        print(f"    top-16 of {n} int64 keys per program, us per link over load + store alone "
              f"({base / 4 * 1e3:.2f} us): bitonic "
              f"{(rec[f'topk_chain4_ms_n{n}_mode1'] - base) / 4 * 1e3:.2f}, 16 max rounds "
              f"{(rec[f'topk_chain4_ms_n{n}_mode2'] - base) / 4 * 1e3:.2f}" + (
                  f", rank count {(rec[f'topk_chain4_ms_n{n}_mode3'] - base) / 4 * 1e3:.2f}" if n <= 512 else ""),
              flush=True)
    return rec


def _selection(x: dict) -> torch.Tensor:
    from openm3.ops import msa

    with torch.no_grad():
        return msa.select_blocks(x["qi"], x["ki"], x["cu"], block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)


def gather_part(x: dict, block_idx: torch.Tensor, stages=(2, 3, 4)) -> dict:
    """The one-token forward's K/V gather alone against the forward, on the same selection."""
    from benchmarks.msa_group_sweep import _with_env
    from benchmarks.msa_kernels import bench_ms
    from openm3.ops import msa

    t = x["q"].shape[0]
    kd = _descriptor(x["k"].view(t, HKV * D), [64, D])
    vd = _descriptor(x["v"].view(t, HKV * D), [64, D])
    out = torch.empty(HKV, t, dtype=torch.float32, device="cuda")
    sel = block_idx.contiguous()
    rec: dict = {"T": t, "gathered_gib": t * HKV * TOPK * BLOCK * D * 2 * 2 / 2 ** 30}
    for st in stages:
        rec[f"gather_ms_s{st}"] = bench_ms(lambda: _gather_kernel[(t, HKV)](
            kd, vd, sel, out, t, t, BLOCK_SIZE=BLOCK, TOPK_=TOPK, BLOCK_N=64, BLOCK_D=D, STAGES=st, num_warps=4))
    rec["gather_best_ms"] = min(rec[f"gather_ms_s{st}"] for st in stages)
    rec["gather_tb_per_s"] = rec["gathered_gib"] * 2 ** 30 / rec["gather_best_ms"] / 1e9

    def fwd():
        with torch.no_grad():
            return msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, x["cu"], block_size=BLOCK,
                                        validate_block_idx=False)

    rec["sparse_fwd_ms"] = bench_ms(fwd)
    rec["sparse_fwd_one_token_ms"] = _with_env("OPENM3_ATTN_LAUNCH", "union_max=0,block_m=16", lambda: bench_ms(fwd))
    print(f"    gather alone {rec['gather_best_ms']:.2f} ms ({rec['gathered_gib']:.0f} GiB, "
          f"{rec['gather_tb_per_s']:.2f} TB/s) vs forward {rec['sparse_fwd_ms']:.2f} ms (hybrid default), "
          f"{rec['sparse_fwd_one_token_ms']:.2f} ms (one-token tiles)", flush=True)
    return rec


def overlapped_prefill(x: dict, chunks: int, priority: int = -1):
    """select + sparse forward over query chunks: chunk c + 1's selection on a second stream while chunk c's
    forward runs on the current one. Returns a closure (its cu_seqlens are made up front, host values known)."""
    from openm3.ops import msa
    from openm3.ops.host import to_device

    t = x["q"].shape[0]
    bounds = [min(t, -(-t * i // chunks) // BLOCK * BLOCK) for i in range(chunks + 1)]
    bounds[-1] = t
    parts = []
    for c0, c1 in zip(bounds, bounds[1:]):
        cu_q = to_device(torch.tensor([0, c1 - c0], dtype=torch.int32), "cuda", remember=True)
        cu_k = to_device(torch.tensor([0, c1], dtype=torch.int32), "cuda", remember=True)
        parts.append((c0, c1, cu_q, cu_k))
    side = torch.cuda.Stream(priority=priority)
    o = torch.empty_like(x["q"])
    lse = torch.empty(t, HQ, dtype=torch.float32, device="cuda")

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.no_grad():
            for c0, c1, cu_q, cu_k in parts:
                with torch.cuda.stream(side):
                    bi = msa.select_blocks(x["qi"][c0:c1], x["ki"][:c1], cu_q, block_size=BLOCK, topk=TOPK,
                                           local_blocks=LOCAL, cu_seqlens_k=cu_k)
                main.wait_stream(side)
                bi.record_stream(main)
                oc, lc = msa.sparse_attention(x["q"][c0:c1], x["k"][:c1], x["v"][:c1], bi, cu_q, block_size=BLOCK,
                                              cu_seqlens_k=cu_k, validate_block_idx=False)
                o[c0:c1].copy_(oc)
                lse[c0:c1].copy_(lc)
        return o, lse

    return run


def overlap_part(x: dict, chunk_counts=(1, 2, 4, 8)) -> dict:
    """Chunked prefill with and without the second stream, against select + forward in sequence."""
    from benchmarks.msa_kernels import bench_ms
    from openm3.ops import msa

    t = x["q"].shape[0]
    rec: dict = {"T": t}

    def sequential():
        with torch.no_grad():
            bi = _selection(x)
            return msa.sparse_attention(x["q"], x["k"], x["v"], bi, x["cu"], block_size=BLOCK,
                                        validate_block_idx=False)

    rec["select_ms"] = bench_ms(lambda: _selection(x))
    rec["prefill_ms"] = bench_ms(sequential)
    ref_o, _ = sequential()
    for n in chunk_counts:
        for prio, name in ((-1, "high"), (0, "same")):
            run = overlapped_prefill(x, n, prio)
            ms = rec[f"prefill_chunks{n}_{name}_ms"] = bench_ms(run)
            err = (run()[0].float() - ref_o.float()).abs().max().item()
            rec[f"prefill_chunks{n}_{name}_max_abs_diff"] = err
            print(f"    prefill in {n} chunks, side stream priority {name}: {ms:.2f} ms (sequential "
                  f"{rec['prefill_ms']:.2f}; select alone {rec['select_ms']:.2f}); max |o - o_seq| {err:.2e}",
                  flush=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["stream", "gather", "overlap"],
                   choices=["stream", "gather", "overlap", "tail", "bandwidth"])
    p.add_argument("--decode-T", type=int, default=1 << 20, help="cached tokens of the stream part")
    p.add_argument("--prefill-T", type=int, default=1 << 17, help="tokens of the gather and overlap parts")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--compare", default=None, help="module path of another triton_decode version to time beside "
                   "the current one in the stream and tail parts (e.g. a copy of the file before a change)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("msa_floors needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.msa_decode import environment

    result = environment()
    t0 = time.time()
    if "stream" in args.parts:
        print(f"== stream floor, decode at {args.decode_T} tokens ==", flush=True)
        result["stream"] = stream_part(args.decode_T, compare=args.compare)
        torch.cuda.empty_cache()
    if "bandwidth" in args.parts:
        print(f"== read bandwidth of the fp8 key cache's bytes at {args.decode_T} tokens ==", flush=True)
        result["bandwidth"] = bandwidth_part(args.decode_T)
        torch.cuda.empty_cache()
    if "tail" in args.parts:
        print(f"== decode tail (after the scoring) at {args.decode_T} tokens ==", flush=True)
        result["tail"] = tail_part(args.decode_T, compare=args.compare)
        torch.cuda.empty_cache()
    if "gather" in args.parts or "overlap" in args.parts:
        x = m3_inputs(args.prefill_T)
        if "gather" in args.parts:
            print(f"== gather floor, forward at {args.prefill_T} tokens ==", flush=True)
            result["gather"] = gather_part(x, _selection(x))
        if "overlap" in args.parts:
            print(f"== overlapped prefill at {args.prefill_T} tokens ==", flush=True)
            result["overlap"] = overlap_part(x, tuple(args.chunks))
    result["wall_s"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    path = out / f"msa_floors_{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
