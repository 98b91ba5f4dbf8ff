"""A running request's token gaps while long prompts prefill, with prefill chunks interleaved with decode steps
(`BatchedGenerator(interleave_prefill=True)`, the default; one chunk forward per decode step however many prompts
prefill, or `--longs` of them: a chunk of each) and without (each prompt's whole prefill first).

    python -m benchmarks.serve_interleave --preset m3-small --long 131072 --out DIR
    python -m benchmarks.serve_interleave --preset m3-small --long 32768 --longs 4 --out DIR   # 4 groups at once
    python -m benchmarks.serve_interleave --preset m3-tiny --device cpu --short 32 --long 512 --chunk-size 64  # smoke

Request A (`--short` prompt tokens, `--new` greedy tokens) decodes; from its 16th token on, `--longs` requests with
`--long`-token prompts arrive, one per A token (each admitted as its own prefill group). The report gives, per
setting: A's largest gap between two tokens while they prefill (from the first one's admission to the last one's
first token) and its median gap, the long requests' times to first token (from each call), and the whole run's
time. Each setting runs once untimed first (compilation).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result

RUNS_ON = "CPU"  # what `openm3 bench` lists beside it


def run(batcher, short: list[int], longs: list[list[int]], new: int) -> dict:
    stamps, admitted, firsts, sent = [], [], {}, {}
    senders: list[threading.Thread] = []

    def send(i):
        sent[i] = time.perf_counter()
        batcher(longs[i], max_new_tokens=8, on_token=lambda _t: firsts.setdefault(i, time.perf_counter()),
                on_cached=lambda _n: admitted.append(time.perf_counter()))

    def on_short(_tok):
        stamps.append(time.perf_counter())
        i = len(stamps) - 16
        if 0 <= i < len(longs):  # one arrival per token of A, held until it is queued: its own prefill group
            senders.append(threading.Thread(target=send, args=(i,)))
            senders[-1].start()
            deadline = time.monotonic() + 60
            while batcher._inbox.qsize() < 1 and time.monotonic() < deadline:
                time.sleep(0.001)

    t_start = time.perf_counter()
    batcher(short, max_new_tokens=new, on_token=on_short)
    for t in senders:
        t.join()
    first, last = min(admitted), max(firsts.values())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b > first and a < last]
    ttfts = [firsts[i] - sent[i] for i in range(len(longs))]
    return dict(max_gap_during_prefill_s=max(during, default=0.0), median_gap_s=statistics.median(gaps),
                long_ttft_s=ttfts[0] if len(ttfts) == 1 else ttfts, wall_s=time.perf_counter() - t_start,
                short_tokens=len(stamps), gaps_during_prefill=len(during))


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--short", type=int, default=8192, help="request A's prompt tokens")
    p.add_argument("--new", type=int, default=256, help="request A's new tokens")
    p.add_argument("--long", type=int, default=131072, help="the long requests' prompt tokens")
    p.add_argument("--longs", type=int, default=1, help="long requests, arriving one per token of A")
    p.add_argument("--chunk-size", type=int, default=8192)
    args = p.parse_args(argv)

    from openm3.engine.batching import BatchedGenerator

    model, device = random_text_model(args.preset, args.device)
    gen = torch.Generator().manual_seed(1)
    short, *longs = (torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
                     for n in [args.short] + [args.long] * args.longs)
    res = {"preset": args.preset, "short": args.short, "new": args.new, "long": args.long, "longs": args.longs,
           "chunk_size": args.chunk_size, "settings": {}}
    settings = [("interleaved", True, 1)]
    if args.longs > 1:
        settings.append(("a chunk per group", True, args.longs))
    settings.append(("whole prefill", False, 1))
    for name, interleave, per_step in settings:
        for timed in (False, True):
            batcher = BatchedGenerator(model, token_budget=args.short + args.new + args.longs * (args.long + 8) + 8,
                                       max_batch=1 + args.longs, chunk_size=args.chunk_size,
                                       interleave_prefill=interleave, prefill_chunks_per_step=per_step,
                                       prefix_caching=False)
            r = run(batcher, short, longs, args.new)
            batcher.close()
            del batcher
        res["settings"][name] = r
        ttft = r["long_ttft_s"]
        ttft = f"{ttft:.3f} s" if args.longs == 1 else ", ".join(f"{t:.3f}" for t in ttft) + " s"
        print(f"{name:17s}: A's largest gap during the prefill {r['max_gap_during_prefill_s']:.3f} s "
              f"(median gap {r['median_gap_s'] * 1e3:.1f} ms), long requests' time to first token {ttft}, "
              f"run {r['wall_s']:.2f} s", flush=True)
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_interleave', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
