"""Aggregate decode throughput of continuous batching (`openm3.engine.batching.BatchedGenerator`) against the
number of concurrent requests, on one device.

    python -m benchmarks.serve_batching --preset m3-small --prompt-len 8192 --new 128 --batch 1 4 8 16 --out DIR
    python -m benchmarks.serve_batching --preset m3-tiny --device cpu --prompt-len 64 --new 8 --batch 1 2   # smoke

For each max batch B it submits B requests at once from B threads (random prompts of `--prompt-len` tokens, greedy,
`--new` tokens each) and reports the wall time, the aggregate tokens/s over the whole run (prefill included) and the
decode steps per batch size the generator ran. One untimed round at the largest B compiles the kernels first.
"""

from __future__ import annotations

import threading
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result


def run_round(gen, prompts, new: int) -> float:
    threads = [threading.Thread(target=lambda p=p: gen(p, max_new_tokens=new)) for p in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--index-dtype", default=None)
    p.add_argument("--whole-prefill", action="store_true",
                   help="prefill each admitted group whole before decoding (interleave_prefill=False)")
    args = p.parse_args(argv)

    from openm3.engine.batching import BatchedGenerator

    model, device = random_text_model(args.preset, args.device)
    config = model.config
    gen = torch.Generator().manual_seed(1)
    most = max(args.batch)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(most)]
    budget = most * (args.prompt_len + args.new)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "preset": args.preset, "prompt_len": args.prompt_len, "new": args.new, "index_dtype": args.index_dtype,
           "interleave_prefill": not args.whole_prefill,
           "rounds": {}}
    options = dict(index_dtype=args.index_dtype, interleave_prefill=not args.whole_prefill)
    warm = BatchedGenerator(model, token_budget=budget, max_batch=most, **options)
    run_round(warm, prompts, args.new)  # compiles the kernels for these shapes
    warm.close()
    del warm
    for b in args.batch:
        batcher = BatchedGenerator(model, token_budget=budget, max_batch=b, **options)
        wall = run_round(batcher, prompts[:b], args.new)
        batcher.close()
        tokens = b * args.new
        res["rounds"][b] = dict(wall_s=wall, tokens_per_s=tokens / wall, decode_steps=batcher.steps,
                                batch_sizes=dict(batcher.batch_sizes),
                                graph_captures=batcher.graphs.captures if batcher.graphs else None)
        print(f"max batch {b:3d}: {tokens} new tokens in {wall:.3f} s = {tokens / wall:9.1f} tokens/s "
              f"(prefill included; {batcher.steps} decode steps, batch sizes {dict(batcher.batch_sizes)})", flush=True)
        del batcher
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_batching', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
