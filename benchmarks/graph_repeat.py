"""The same workloads captured as CUDA graphs again and again in one process: does a graph captured after the
first few replay slower?

    python -m benchmarks.graph_repeat --out DIR                 # 8 rounds, each capture in a pool of its own
    python -m benchmarks.graph_repeat --shared-pool --out DIR   # every capture in one pool

Session 32 found that `generate`'s decode graph replays ~14% slower from a process's fourth `generate` call on
(5.15 -> 5.88 ms, m3-small on an H100; `benchmarks/generate_repeat.py`), with clocks, memory and the GPU alone
unchanged. The kernel benchmarks (`msa_decode.graph_time_ms`) also capture a new graph, in a new pool, for every
figure, so if the effect is a property of the process's n-th capture rather than of the engine, their later
figures (and the ratios between an MSA figure and a dense one) carry it too. Each round here captures, in this
order and each in a fresh graph: the MSA decode step (1 sequence, `--t` cached tokens, M3's shape, fp8 index keys),
cuDNN's dense decode over the same cache and a memory-bound bf16 matmul chain, then times each graph's replays
(median of `--reps`, after 50 ms of warm replays). Rounds that differ only in when they ran should time alike.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._timing import write_result
from benchmarks.msa_decode import capture_graph, replay_time_ms

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it


def launch_chain(n: int = 150):
    """`n` dependent tiny kernels: a graph of this is bound by the time between its nodes, not by their work
    (the engine's decode step is ~3000 nodes of ~1.7 us each)."""
    x = torch.zeros(256, device="cuda")

    def chain():
        for _ in range(n):
            x.add_(1.0)
        return x

    return chain


def cat_chain(n: int = 150, parts: int = 64):
    """`n` concatenations of `parts` small tensors: tiny kernels with large parameter blocks (each carries every
    part's pointer), as the engine's graph has (cutlass grouped GEMMs, concatenations)."""
    xs = [torch.randn(32, device="cuda") for _ in range(parts)]
    out = torch.empty(32 * parts, device="cuda")

    def chain():
        for _ in range(n):
            torch.cat(xs, out=out)
        return out

    return chain


LIGHT = {"launch_chain": launch_chain, "cat_chain": cat_chain}


def workloads(t: int, names) -> dict:
    """name -> a no-argument function launching it, for the `names` asked for."""
    if set(names) <= set(LIGHT):
        return {name: LIGHT[name]() for name in names}
    from benchmarks._inputs import D, HKV, HQ
    from benchmarks.msa_decode import dense_sdpa, sdpa_backend  # (imports triton: a GPU machine's)
    from benchmarks.msa_floors import LOCAL, TOPK, _decode_cache
    from openm3.ops.msa import triton_decode

    _, _, ki8, ki_scale, k, v, table, lens, q, qi, _ = _decode_cache(t, fp32_scales=False)
    kd, vd = (x.view(1, t, HKV, D).transpose(1, 2) for x in (k, v))
    qd = q.view(1, 1, HQ, D).transpose(1, 2)
    backend = sdpa_backend(qd, kd, vd)
    weights = [torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(8, 8192, device="cuda", dtype=torch.bfloat16)

    def chain():
        y = x
        for w in weights:
            y = y @ w
        return y

    fns = {"msa_decode": lambda: triton_decode.decode_msa(q, qi, k, v, ki8, table, lens, q_len=1, topk=TOPK,
                                                          local_blocks=LOCAL, ki_scale=ki_scale),
           "dense_cudnn": lambda: dense_sdpa(qd, kd, vd, backend),
           "matmul_chain": chain, **{name: LIGHT[name]() for name in names if name in LIGHT}}
    return {name: fns[name] for name in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--t", type=int, default=1 << 20, help="cached tokens of the decode workloads")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shared-pool", action="store_true", help="every capture in one memory pool")
    p.add_argument("--workloads", nargs="+", default=["msa_decode", "dense_cudnn", "matmul_chain"],
                   choices=["msa_decode", "dense_cudnn", "matmul_chain", *LIGHT])
    p.add_argument("--free", action="store_true", help="free each graph once timed (default: all stay alive)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: graph_repeat needs a CUDA GPU")
    if args.rounds < 1 or args.reps < 1:
        raise SystemExit("error: --rounds and --reps must be >= 1")
    fns = workloads(args.t, args.workloads)
    pool = torch.cuda.graph_pool_handle() if args.shared_pool else None
    res = {"t": args.t, "shared_pool": args.shared_pool, "free": args.free, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rounds": []}
    kept = []  # the graphs stay alive, as the benchmarks' do until their case ends
    for r in range(args.rounds):
        row = {}
        for name, fn in fns.items():
            graph = capture_graph(fn, pool=pool)
            row[name] = replay_time_ms(graph, reps=args.reps, warm_ms=50.0)
            if not args.free:
                kept.append(graph)
            del graph
        res["rounds"].append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v * 1e3:8.2f} us" for k, v in row.items()), flush=True)
    if args.out:
        print(f"wrote {write_result(args.out, 'graph_repeat', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
