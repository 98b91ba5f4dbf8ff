"""A running request's token gaps while a long prompt prefills, with prefill chunks interleaved with decode steps
(`BatchedGenerator(interleave_prefill=True)`, the default) and without.

    python -m benchmarks.serve_interleave --preset m3-small --long 131072 --out DIR
    python -m benchmarks.serve_interleave --preset m3-tiny --device cpu --short 32 --long 512 --chunk-size 64  # smoke

Request A (`--short` prompt tokens, `--new` greedy tokens) decodes; after its 16th token request B arrives with a
`--long` prompt. The report gives, per setting: A's largest gap between two tokens while B prefills (from B's
admission to its first token) and its median gap, B's time to first token (from its call), and the whole run's
time. Each setting runs once untimed first (compilation).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result


def run(batcher, short: list[int], long: list[int], new: int) -> dict:
    stamps, arrived, first_long, admitted = [], threading.Event(), [], []

    def on_short(_tok):
        stamps.append(time.perf_counter())
        if len(stamps) == 16:
            arrived.set()

    def send_long():
        arrived.wait()
        t0 = time.perf_counter()
        batcher(long, max_new_tokens=8, on_token=lambda _t: first_long.append(time.perf_counter()),
                on_cached=lambda _n: admitted.append(time.perf_counter()))
        return t0

    sender = threading.Thread(target=lambda: out.append(send_long()))
    out: list[float] = []
    t_start = time.perf_counter()
    sender.start()
    batcher(short, max_new_tokens=new, on_token=on_short)
    sender.join()
    sent, first = out[0], first_long[0]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b > admitted[0] and a < first]  # B admitted .. first
    return dict(max_gap_during_prefill_s=max(during, default=0.0), median_gap_s=statistics.median(gaps),
                long_ttft_s=first - sent, wall_s=time.perf_counter() - t_start, short_tokens=len(stamps),
                gaps_during_prefill=len(during))


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--short", type=int, default=8192, help="request A's prompt tokens")
    p.add_argument("--new", type=int, default=256, help="request A's new tokens")
    p.add_argument("--long", type=int, default=131072, help="request B's prompt tokens")
    p.add_argument("--chunk-size", type=int, default=8192)
    args = p.parse_args(argv)

    from openm3.engine.batching import BatchedGenerator

    model, device = random_text_model(args.preset, args.device)
    gen = torch.Generator().manual_seed(1)
    short, long = (torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
                   for n in (args.short, args.long))
    res = {"preset": args.preset, "short": args.short, "new": args.new, "long": args.long,
           "chunk_size": args.chunk_size, "settings": {}}
    for interleave in (True, False):
        for timed in (False, True):
            batcher = BatchedGenerator(model, token_budget=args.short + args.new + args.long + 8, max_batch=2,
                                       chunk_size=args.chunk_size, interleave_prefill=interleave,
                                       prefix_caching=False)
            r = run(batcher, short, long, args.new)
            batcher.close()
            del batcher
        name = "interleaved" if interleave else "whole prefill"
        res["settings"][name] = r
        print(f"{name:13s}: A's largest gap during B's prefill {r['max_gap_during_prefill_s']:.3f} s "
              f"(median gap {r['median_gap_s'] * 1e3:.1f} ms), B's time to first token {r['long_ttft_s']:.3f} s, "
              f"run {r['wall_s']:.2f} s", flush=True)
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_interleave', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
