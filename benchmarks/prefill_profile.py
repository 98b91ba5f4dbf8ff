"""Where the time of a chunked prefill through the engine goes (m3-small, random weights, one GPU).

    python -m benchmarks.prefill_profile --T 131072 --chunk 32768 --out benchmarks/results/

Runs one prefill to warm up (kernel compilation), then a second one on a fresh cache under torch.profiler: wall
time, GPU kernel time by category and the top kernels (as `benchmarks.train_throughput` groups them), and the host
operators with the most self CPU time (a prefill that is much slower than its kernels is bound by them).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch

from benchmarks._timing import profiled_times, top_host_ops, write_result
from benchmarks.train_throughput import kernel_breakdown

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="m3-small")
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=32768)
    p.add_argument("--index-dtype", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_profile needs a CUDA GPU")

    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache
    from openm3.engine.scheduler import prefill
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    config = M3TextConfig.from_name(args.preset)
    with torch.device("cuda"):
        model = M3TextModel(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (args.T,))
    layout = CacheLayout.from_config(config)

    def run() -> float:
        cache = PagedCache(plan_cache(layout, args.T, kv_dtype=torch.bfloat16, index_dtype=args.index_dtype), "cuda")
        cache.admit({0: args.T})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill(model, cache, [0], [prompt], chunk_size=args.chunk)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    warm_s = run()
    plain_s = run()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = run()
    kernels, host = profiled_times(prof)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "preset": args.preset, "T": args.T, "chunk": args.chunk, "index_dtype": args.index_dtype,
           "first_prefill_s": warm_s, "prefill_s": plain_s, "profiled_prefill_s": wall_s,
           "tokens_per_s": args.T / plain_s,
           "breakdown": kernel_breakdown(kernels, wall_s * 1e3, top=30), "host_self_ms": top_host_ops(host)}
    b = res["breakdown"]
    print(f"prefill {args.T} tokens in chunks of {args.chunk}: first {warm_s:.3f} s, then {plain_s:.3f} s "
          f"({args.T / plain_s:.0f} tokens/s); profiled {wall_s:.3f} s, GPU kernels {b['kernel_ms']:.1f} ms "
          f"({b['gpu_busy_share']:.0%} busy)")
    for cat, ms in b["ms_by_category"].items():
        print(f"  {cat:20s} {ms:10.1f} ms")
    print("top kernels:")
    for k in b["top_kernels"][:20]:
        print(f"  {k['ms']:9.1f} ms {k['launches']:6d}x  {k['name'][:100]}")
    print("host ops by self CPU time:")
    for h in res["host_self_ms"][:15]:
        print(f"  {h['ms']:9.1f} ms {h['calls']:6d}x  {h['op']}")
    if args.out:
        print(f"wrote {write_result(args.out, 'prefill_profile', res)}")


if __name__ == "__main__":
    main()
