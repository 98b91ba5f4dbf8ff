"""Aggregate decode throughput of continuous batching (`openm3.engine.batching.BatchedGenerator`) against the
number of concurrent requests, on one device.

    python -m benchmarks.serve_batching --preset m3-small --prompt-len 8192 --new 128 --batch 1 4 8 16 --out DIR
    python -m benchmarks.serve_batching --preset m3-tiny --device cpu --prompt-len 64 --new 8 --batch 1 2   # smoke

For each max batch B it submits B requests at once from B threads (random prompts of `--prompt-len` tokens, greedy,
`--new` tokens each) and reports the wall time, the aggregate tokens/s over the whole run (prefill included) and the
decode steps per batch size the generator ran. One untimed round at the largest B compiles the kernels first.

`--requests-per-batch R --new-min N` makes the batch change often, as a server's does: R x B requests at once,
each with its own number of new tokens drawn from [N, --new], so requests finish one by one and queued ones join
(`--prompt-len-min` also varies the prompts' lengths, hence the batches' page-table widths)
(each change is a new batch of sequences for the decode step's CUDA graphs; the report counts the graphs'
captures, eager steps and replays of a graph recorded for other sequences). `--rounds K` runs each max batch's
round K times through one generator, as a server that stays up would (other prompts of the same lengths): the
first round pays for what compiles or captures at new shapes, the later ones show the steady state (the headline
figure stays the first round's).
"""

from __future__ import annotations

import threading
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result

RUNS_ON = "GPU or CPU"  # what `openm3 bench` lists beside it


def run_round(gen, prompts, news: list[int]) -> float:
    threads = [threading.Thread(target=lambda p=p, n=n: gen(p, max_new_tokens=n)) for p, n in zip(prompts, news)]
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
    p.add_argument("--requests-per-batch", type=int, default=1, help="requests per round = this x the max batch")
    p.add_argument("--prompt-len-min", type=int, default=None,
                   help="each prompt's length drawn from [prompt-len-min, prompt-len] (default: all --prompt-len)")
    p.add_argument("--new-min", type=int, default=None,
                   help="each request's new tokens drawn from [new-min, new] (default: all --new)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per max batch, one generator for them all (as a server that stays up); each timed")
    p.add_argument("--compile", action="store_true", help="the decoder layers under torch.compile, warmed up as "
                   "`openm3 serve --compile` does (untimed)")
    p.add_argument("--overlap", choices=["default", "off", "on", "both"], default="default",
                   help="BatchedGenerator(overlap=...): decode steps launched ahead of the host (default: the "
                   "engine's, on a GPU); both: each max batch timed without, then with it, in this process")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.requests_per_batch < 1 or not 1 <= (args.new_min or args.new) <= args.new \
            or not 1 <= (args.prompt_len_min or args.prompt_len) <= args.prompt_len:
        p.error("--requests-per-batch must be >= 1, --new-min in [1, --new], --prompt-len-min in [1, --prompt-len]")

    from openm3.engine.batching import BatchedGenerator

    model, device = random_text_model(args.preset, args.device)
    if args.compile:
        from openm3.engine.generate import compile_layers
        compile_layers(model)
    config = model.config
    gen = torch.Generator().manual_seed(1)
    most = max(args.batch) * args.requests_per_batch
    lengths = torch.randint(args.prompt_len_min or args.prompt_len, args.prompt_len + 1, (most,), generator=gen)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths.tolist()]
    news = torch.randint(args.new_min or args.new, args.new + 1, (most,), generator=gen).tolist()
    # later rounds: prompts of the same lengths but other tokens (the same ones would hit the prefix cache)
    later = [[torch.randint(0, config.vocab_size, (len(q),), generator=gen).tolist() for q in prompts]
             for _ in range(args.rounds - 1)]
    budget = max(args.batch) * (args.prompt_len + args.new)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "preset": args.preset, "prompt_len": args.prompt_len, "prompt_len_min": args.prompt_len_min,
           "new": args.new, "new_min": args.new_min,
           "requests_per_batch": args.requests_per_batch, "index_dtype": args.index_dtype,
           "interleave_prefill": not args.whole_prefill, "compile": args.compile, "rounds": {}}
    options = dict(index_dtype=args.index_dtype, interleave_prefill=not args.whole_prefill)
    warm = BatchedGenerator(model, token_budget=budget, max_batch=max(args.batch), **options)
    if args.compile:  # as `openm3 serve --compile` does before it listens
        from openm3.engine.warmup import warm_up
        res["warm_up_s"] = warm_up(warm, config.vocab_size, max(args.batch))
        print(f"warm-up (compilation) {res['warm_up_s']:.1f} s", flush=True)
    run_round(warm, prompts[:max(args.batch)], [args.new] * max(args.batch))  # compiles the kernels first
    warm.close()
    del warm
    overlaps = {"default": [None], "off": [False], "on": [True], "both": [False, True]}[args.overlap]
    for b, overlap in [(b, o) for b in args.batch for o in overlaps]:
        batcher = BatchedGenerator(model, token_budget=budget, max_batch=b, overlap=overlap, **options)
        n = b * args.requests_per_batch
        tokens = sum(news[:n])
        walls = [run_round(batcher, texts[:n], news[:n]) for texts in [prompts] + later]
        batcher.close()
        graphs = batcher.graphs
        counts = {k: getattr(graphs, k, None) if graphs else None
                  for k in ("captures", "eager_steps", "replays", "rebinds")}
        key = f"{b}_overlap" if overlap else b
        res["rounds"][key] = dict(wall_s=walls[0], tokens_per_s=tokens / walls[0], requests=n, new_tokens=tokens,
                                decode_steps=batcher.steps, batch_sizes=dict(batcher.batch_sizes),
                                prefix_cached_tokens=batcher.cached_tokens,
                                graph_captures=counts["captures"], graphs=counts)
        if args.rounds > 1:
            res["rounds"][key].update(walls_s=walls, tokens_per_s_each=[tokens / w for w in walls])
        each = "" if args.rounds == 1 else " (rounds: " + ", ".join(f"{tokens / w:.1f}" for w in walls) + ")"
        label = f"max batch {b:3d}{' overlap' if overlap else ''}"
        print(f"{label}: {n} requests, {tokens} new tokens in {walls[0]:.3f} s = "
              f"{tokens / walls[0]:9.1f} tokens/s{each} (prefill included; {batcher.steps} decode steps, batch sizes "
              f"{dict(batcher.batch_sizes)}; graphs {counts})", flush=True)
        del batcher
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_batching', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
