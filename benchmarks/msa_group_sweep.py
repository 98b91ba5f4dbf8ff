"""MSA kernels at a smaller attention shape (m3-small's training layer by default) under launch-config sweeps.

    python -m benchmarks.msa_group_sweep --out benchmarks/results/      # about 1-2 minutes on an H200

The M3 launch defaults (`triton_common.attention_launch`, `triton_kl.kl_launch`) were tuned at M3's 16 query heads
per KV head. m3-small trains with 16 query heads and 4 KV heads (G = 4 per group) on rows of 8K tokens, where a
forward tile of 16 rows holds 4 tokens and the KL's dots are 4x narrower. This times, at that shape (`--hq`, `--T`
tokens packed as sequences of `--seq-len`, drifting index queries), `select`, sparse attention forward+backward
(under each `--attn` override string, as `OPENM3_ATTN_LAUNCH`) and the indexer KL forward+backward (under each
`--kl` override string, as `OPENM3_KL_LAUNCH`; and with `--selkl`, selection + KL together under each
`OPENM3_SELECT_LAUNCH` string), medians in ms, and writes JSON with the hardware and versions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

from benchmarks import RESULTS
from benchmarks._inputs import REGIMES, m3_inputs
from benchmarks._timing import write_result
from benchmarks.msa_kernels import bench_ms

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

BLOCK, TOPK, LOCAL = 128, 16, 1
ATTN = ["", "block_n=128", "num_warps=8", "num_stages=2", "dkdv_block_m=16", "dkdv_block_m=64",
        "dkdv_num_warps=4", "dq_in_dkdv=0", "block_m=32", "dkdv_num_stages=3", "dkdv_num_stages=1", "dkdv_block_n=64",
        "dkdv_maxnreg=128", "dkdv_block_n=64,dkdv_maxnreg=128", "dkdv_split=1", "dkdv_split=1,dkdv_block_n=64",
        "dkdv_split=1,dkdv_block_n=64,dkdv_maxnreg=128"]
KL = ["", "block_q=32", "block_q=64", "block_q=32,num_warps=4", "heads_per_dot=2", "heads_per_dot=1",
      "block_n=64", "max_entries=1024", "prefetch=1", "dqi_buffer=1", "num_warps=4", "unroll_heads=0",
      "maxnreg=128", "unroll_heads=0,maxnreg=128"]


def _with_env(var: str, value: str, fn):
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        return fn()
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--attn", nargs="*", default=ATTN, help="OPENM3_ATTN_LAUNCH strings ('' = defaults)")
    p.add_argument("--kl", nargs="*", default=KL, help="OPENM3_KL_LAUNCH strings ('' = defaults)")
    p.add_argument("--selkl", nargs="*", default=[],
                   help="OPENM3_SELECT_LAUNCH strings under which to time selection + KL fwd+bwd together, the "
                        "selection's student normaliser handed to the KL when computed ('' = defaults; "
                        "'index_lse=1' computes it in the selection kernel)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every configuration this many times, interleaved (reports the median over rounds; "
                        "single timings of one configuration moved by up to ~10%% between runs)")
    p.add_argument("--regime", default="drift", choices=REGIMES,
                   help="index queries: drift (a trained indexer's, the default) or iid (a random indexer's: what "
                        "m3-small at random init selects, e.g. in benchmarks.train_throughput)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    from openm3.ops import msa

    x = m3_inputs(args.T, hq=args.hq, seq_len=args.seq_len, regime=args.regime)
    cu = x["cu"]
    q, k, v, qi, ki = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "qi", "ki"))
    do = torch.randn_like(x["q"])
    with torch.no_grad():
        block_idx = msa.select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
        _, lse = msa.sparse_attention(x["q"], x["k"], x["v"], block_idx, cu, block_size=BLOCK)

    def attn_fwd_bwd():
        q.grad = k.grad = v.grad = None
        o, _ = msa.sparse_attention(q, k, v, block_idx, cu, block_size=BLOCK)
        o.backward(do)

    def kl_fwd_bwd():
        qi.grad = ki.grad = None
        msa.indexer_kl(x["q"], x["k"], qi, ki, block_idx, cu, block_size=BLOCK, lse=lse).backward()

    def select_kl():
        qi.grad = ki.grad = None
        with torch.no_grad():
            sel, index_lse = msa.select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL,
                                               return_index_lse=True)
        msa.indexer_kl(x["q"], x["k"], qi, ki, sel, cu, block_size=BLOCK, lse=lse, index_lse=index_lse,
                       validate_block_idx=False).backward()

    rec = {"shape": dict(hq=args.hq, hkv=4, T=args.T, seq_len=args.seq_len), "regime": args.regime, "attn": {},
           "kl": {}, "selkl": {}}
    # one untimed round first: the first configuration timed on a fresh process measured 20-40% slow (clocks,
    # allocator, lazy initialisation), which once made the default look worse than it was
    bench_ms(attn_fwd_bwd)
    bench_ms(kl_fwd_bwd)
    with torch.no_grad():
        rec["select_ms"] = bench_ms(lambda: msa.select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK,
                                                              local_blocks=LOCAL))
    times: dict[tuple[str, str], list] = {}
    for _ in range(max(1, args.rounds)):
        for kind, env, fn, configs in (("attn", "OPENM3_ATTN_LAUNCH", attn_fwd_bwd, args.attn),
                                       ("kl", "OPENM3_KL_LAUNCH", kl_fwd_bwd, args.kl),
                                       ("selkl", "OPENM3_SELECT_LAUNCH", select_kl, args.selkl)):
            for cfg in configs:
                name = cfg or "default"
                try:
                    ms = _with_env(env, cfg, lambda: bench_ms(fn))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    ms = f"{type(exc).__name__}: {str(exc)[:200]}"
                times.setdefault((kind, name), []).append(ms)
                label = {"attn": "attention", "kl": "indexer KL", "selkl": "select + indexer KL"}[kind]
                print(f"{label} fwd+bwd [{name}]: {ms}", flush=True)
    for (kind, name), runs in times.items():
        ok = [r for r in runs if isinstance(r, float)]
        rec[kind][name] = statistics.median(ok) if len(ok) == len(runs) else runs[-1]
        if args.rounds > 1:
            rec.setdefault("rounds", {}).setdefault(kind, {})[name] = runs
    if args.rounds > 1:
        for (kind, name), _ in times.items():
            print(f"median of {args.rounds} rounds, {kind} [{name}]: {rec[kind][name]}")
    rec["env"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=__import__("triton").__version__,
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path = write_result(args.out, f"msa_group_sweep_hq{args.hq}_T{args.T}", rec)
    print(f"select {rec['select_ms']:.3f} ms; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
