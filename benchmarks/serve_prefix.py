"""Prefix caching in an agent's conversation: time to first token per turn, with the cache and without.

    python -m benchmarks.serve_prefix --preset m3-small --context 131072 --turn-tokens 2048 --new 64 --turns 4 --out DIR
    python -m benchmarks.serve_prefix --preset m3-tiny --device cpu --context 512 --turn-tokens 64 --new 8   # smoke

A coding agent resends its whole history each turn: turn 1 is a `--context`-token prompt (random ids), and every
later turn's prompt is the previous prompt, its answer (`--new` greedy tokens) and `--turn-tokens` new ones (a tool
result, a user message). The conversation runs twice on one `BatchedGenerator` each, with `prefix_caching` off and
on, after an untimed run of the same conversation (with the cache) that compiles the kernels; the report gives each
turn's prompt length, cached tokens and time to first token (the request's call to its first token), and the
ratio of the two runs' times per turn. `--parallel N` adds N requests sharing turn 1's prompt (sub-agents over
one repository), each with its own `--turn-tokens`, sent at once: the time to the last first token and to the
end, with the cache (one of them prefills the shared prompt, the others wait for it and read it) and without.
"""

from __future__ import annotations

import threading
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result

RUNS_ON = "GPU or CPU"  # what `openm3 bench` lists beside it


def conversation(batcher, first: list[int], extra: list[list[int]], new: int) -> list[dict]:
    """Runs the turns on `batcher`; returns per turn: prompt length, cached tokens, TTFT and total seconds."""
    prompt, turns = list(first), []
    for i in range(len(extra) + 1):
        answer, cached, stamps = [], [], []

        def on_token(tok, answer=answer, stamps=stamps):
            if not stamps:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())
            answer.append(tok)

        t0 = time.perf_counter()
        batcher(prompt, max_new_tokens=new, on_token=on_token, on_cached=cached.append)
        turns.append(dict(prompt_tokens=len(prompt), cached_tokens=cached[0], ttft_s=stamps[0] - t0,
                          total_s=time.perf_counter() - t0))
        if i < len(extra):
            prompt = prompt + answer + extra[i]
    return turns


def parallel(batcher, prompts: list[list[int]], new: int) -> dict:
    """Sends the prompts at once from one thread each; returns the seconds to the last first token and to the end,
    and the cached tokens of each request."""
    firsts, cached = [None] * len(prompts), [0] * len(prompts)

    def ask(i):
        batcher(prompts[i], max_new_tokens=new, on_cached=lambda n: cached.__setitem__(i, n),
                on_token=lambda _t: firsts[i] or firsts.__setitem__(i, time.perf_counter()))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(last_first_token_s=max(firsts) - t0, total_s=time.perf_counter() - t0, cached_tokens=cached)


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--context", type=int, default=131072, help="turn 1's prompt tokens")
    p.add_argument("--turn-tokens", type=int, default=2048, help="new prompt tokens of each later turn")
    p.add_argument("--new", type=int, default=64, help="answer tokens per turn")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--index-dtype", default=None)
    p.add_argument("--parallel", type=int, default=0, metavar="N",
                   help="also: N requests sharing turn 1's prompt, each with --turn-tokens of its own, sent at once")
    args = p.parse_args(argv)

    from openm3.engine.batching import BatchedGenerator

    model, device = random_text_model(args.preset, args.device)
    config = model.config
    gen = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()

    total = args.context + (args.turns - 1) * args.turn_tokens + args.turns * args.new
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "preset": args.preset, "context": args.context, "turn_tokens": args.turn_tokens, "new": args.new,
           "turns": args.turns, "chunk_size": args.chunk_size, "index_dtype": args.index_dtype, "runs": {}}
    # the warm-up is the whole conversation: Triton specialises kernels on their integer arguments (divisibility
    # by 16), so a shorter one leaves compilations to the first timed run
    runs = {"warm-up": (args.context, True), "uncached": (args.context, False), "cached": (args.context, True)}
    extra = [ids(args.turn_tokens) for _ in range(args.turns - 1)]
    first = ids(args.context)
    for name, (context, caching) in runs.items():
        batcher = BatchedGenerator(model, token_budget=total + args.new, max_batch=1, chunk_size=args.chunk_size,
                                   index_dtype=args.index_dtype, prefix_caching=caching)
        turns = conversation(batcher, first[:context], extra, args.new)
        batcher.close()
        del batcher
        if name == "warm-up":
            continue
        res["runs"][name] = turns
        for i, t in enumerate(turns, 1):
            print(f"{name:8s} turn {i}: prompt {t['prompt_tokens']:8d} tokens, cached {t['cached_tokens']:8d}, "
                  f"time to first token {t['ttft_s']:8.3f} s, turn {t['total_s']:8.3f} s", flush=True)
    res["ttft_ratio"] = [u["ttft_s"] / c["ttft_s"] for c, u in zip(res["runs"]["cached"], res["runs"]["uncached"])]
    print("uncached / cached time to first token per turn: " + ", ".join(f"{r:.2f}x" for r in res["ttft_ratio"]))
    if args.parallel:
        prompts = [first + ids(args.turn_tokens) for _ in range(args.parallel)]
        res["parallel"] = {}
        for name, caching in (("warm-up", True), ("uncached", False), ("cached", True)):
            batcher = BatchedGenerator(model, token_budget=args.parallel * (len(prompts[0]) + args.new),
                                       max_batch=args.parallel, chunk_size=args.chunk_size,
                                       index_dtype=args.index_dtype, prefix_caching=caching)
            r = parallel(batcher, prompts, args.new)
            batcher.close()
            del batcher
            if name != "warm-up":
                res["parallel"][name] = r
                print(f"{args.parallel} requests sharing {args.context} tokens, {name:8s}: last first token "
                      f"{r['last_first_token_s']:.3f} s, all done {r['total_s']:.3f} s, cached {r['cached_tokens']}",
                      flush=True)
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_prefix', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
