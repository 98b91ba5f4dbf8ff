"""A minimal driver for Nsight Compute: the MSA training kernels at m3-small's layer shape, `--reps` times.

    ncu -k regex:"_kl_main_kernel|_attn_dkdv_kernel" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats python3 -m benchmarks.ncu_msa

Each rep runs sparse attention forward + backward and the indexer KL forward + gradient once (16 query heads, 4
KV heads, head dim 128, index 4 x 128, blocks of 128, top-16, `--T` tokens in rows of `--seq-len`, drifting index
queries), so with `--launch-skip` one rep's worth of launches the profiled kernels are warm (compiled, tuned).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._inputs import m3_inputs

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

BLOCK, TOPK, LOCAL = 128, 16, 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.ncu_msa needs a CUDA GPU")
    from openm3.ops import msa

    x = m3_inputs(args.T, hq=args.hq, seq_len=args.seq_len)
    cu = x["cu"]
    q, k, v, qi, ki = (x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "qi", "ki"))
    with torch.no_grad():
        block_idx = msa.select_blocks(x["qi"], x["ki"], cu, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    do = torch.randn_like(x["q"])
    for _ in range(args.reps):
        o, lse = msa.sparse_attention(q, k, v, block_idx, cu, block_size=BLOCK)
        o.backward(do)
        msa.indexer_kl(x["q"], x["k"], qi, ki, block_idx, cu, block_size=BLOCK, lse=lse.detach()).backward()
        torch.cuda.synchronize()
    print(f"ran {args.reps} reps at T={args.T}, Hq={args.hq}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
