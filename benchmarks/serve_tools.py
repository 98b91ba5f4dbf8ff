"""What `openm3 serve --constrain-tool-calls` costs: the same concurrent Chat Completions requests with tools
(`tool_choice` auto) through the app `openm3 serve` builds, without the flag and with it, in one process.

    python -m benchmarks.serve_tools --out DIR                       # m3-small on the GPU, 8 requests
    python -m benchmarks.serve_tools --preset m3-tiny --device cpu --new 8 --requests 2   # smoke

With the flag every such request carries a grammar constraint that watches for the tool-call start token, so its
tokens are picked on the host (a logits row copied back per token) and its batch leaves the overlapped,
graph-sampled decode path; without it the tools only shape the prompt. A random model seldom opens a call, so this
times the flag's cost on the answers' text, which is what most tokens of an agent's turn are. Each case runs a
`--warmup` untimed rounds (kernel compilation, CUDA-graph captures) and then `--rounds` timed rounds; tokens/s is
the median round's completion tokens over its wall time (prefill included). Every round sends the same prompts
(only the sampling seeds change): with new prompts each round, the rounds of one case ranged over 4x on an H100
in session 47, even after two warm-up rounds; hence also the median, and the plain case run again last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import torch

from benchmarks._timing import write_result

RUNS_ON = "GPU (CPU: smoke)"  # what `openm3 bench` lists beside it

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command.",
        "parameters": {"type": "object", "required": ["command"], "properties": {"command": {"type": "string"}}}}}]


def run_round(client, model: str, requests: int, new: int, prompt_words: int, seed: int) -> tuple[float, int]:
    """Sends `requests` chat requests at once; returns (wall seconds, completion tokens)."""
    def one(k: int) -> int:
        text = " ".join(f"word{(k * 7919 + i * 31) % 997}" for i in range(prompt_words))  # the same each round
        r = client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "tools": TOOLS, "tool_choice": "auto",
            "max_tokens": new, "temperature": 1.0, "seed": seed * 1000 + k})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return time.perf_counter() - start, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="m3-small")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests per round (= the max batch)")
    p.add_argument("--new", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--prompt-words", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per case (their median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first, per case")
    p.add_argument("--tokenizer", default=None, help="serve's --tokenizer (default: the locally trained one)")
    p.add_argument("--out", default=None, help="directory for the JSON result")
    args = p.parse_args(argv)
    if min(args.requests, args.new, args.prompt_words, args.rounds) < 1:
        p.error("--requests, --new, --prompt-words and --rounds must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")

    from fastapi.testclient import TestClient

    from openm3.serve.cli import build_app, build_parser

    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "preset": args.preset, "requests": args.requests, "new": args.new, "prompt_words": args.prompt_words,
           "cases": {}}
    # plain again last: the first case of a process may still pay for warm-up the second does not
    for name, flag in (("plain", False), ("constrained", True), ("plain_again", False)):
        argv_serve = ["--preset", args.preset, "--device", args.device, "--max-batch", str(args.requests),
                      "--max-total-tokens", "4096"] + (
            ["--tokenizer", args.tokenizer] if args.tokenizer else []) + (["--constrain-tool-calls"] if flag else [])
        app = build_app(build_parser().parse_args(argv_serve))
        with TestClient(app) as client:
            for w in range(args.warmup):  # compilation, graph captures, allocator growth
                run_round(client, args.preset, args.requests, args.new, args.prompt_words, seed=-1 - w)
            rounds = [run_round(client, args.preset, args.requests, args.new, args.prompt_words, seed=r + 1)
                      for r in range(args.rounds)]
        wall, tokens = sum(w for w, _ in rounds), sum(t for _, t in rounds)
        rates = sorted(t / w for w, t in rounds)
        median = statistics.median(rates)
        res["cases"][name] = {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": median,
                              "mean_tokens_per_s": tokens / wall,
                              "rounds": [{"wall_s": w, "tokens": t} for w, t in rounds]}
        print(f"{name:12s} median round {median:9.1f} tokens/s (rounds {rates[0]:.1f} to {rates[-1]:.1f}; "
              f"{tokens} tokens in {wall:.3f} s; {args.requests} requests at once)", flush=True)
        del app, client
        if args.device == "cuda":
            torch.cuda.empty_cache()
    plain = max(res["cases"][n]["tokens_per_s"] for n in ("plain", "plain_again"))
    constrained = res["cases"]["constrained"]["tokens_per_s"]
    res["constrained_over_plain"] = constrained / plain
    print(f"--constrain-tool-calls: {constrained / plain:.3f}x the tokens/s without it (the faster plain case)")
    if args.out:
        print(f"wrote {write_result(args.out, 'serve_tools', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
