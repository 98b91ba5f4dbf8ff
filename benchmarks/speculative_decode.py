"""Speculative decoding (n-gram drafts, `openm3.engine.speculative`) against plain decoding, by how many drafts
are right.

    python -m benchmarks.speculative_decode --preset m3-small --prompt 131072 --out DIR
    python -m benchmarks.speculative_decode --preset m3-small --prompt 16384 --batch 8 --out DIR
    python -m benchmarks.speculative_decode --preset m3-tiny --device cpu --prompt 256 --new 12 --drafts 2 \\
        --alphas 1.0   # smoke
    python -m benchmarks.speculative_decode --preset m3-small --prompt 131072 --drafts 4 --alphas 0,0.25,0.5,1 \\
        --adaptive --out DIR   # each setting also with the adaptive gate
    python -m benchmarks.speculative_decode --checkpoint DIR --corpus stdlib --prompt 512 --batch 8 --new 128 \\
        --device cpu   # a trained model on held-out text: how often the real lookup's drafts are right

What speculation gains depends on how often the drafts are right, and a random model's answers copy nothing from
their prompts (an agent's copy a lot). So besides the real n-gram lookup, whose drafts are rarely right here and
which shows the lookup's overhead, the benchmark scripts the drafts: the plain greedy run's own next tokens, each
right with probability `alpha` (a wrong one is replaced by another token), for every alpha of --alphas and number
of drafts of --drafts. Each setting runs `generate` (CUDA graphs on a GPU) twice on the same prompts and keeps the
second run (the first compiles the kernels of its step shape). Reported per setting: decode tokens/s after the
first step (graph captures excluded) and its ratio to plain decoding's (run again last: a process's first run
decodes ~10% faster than its later ones), drafts kept, tokens per sequence per step,
and whether the greedy tokens equal plain decoding's (bf16 rounding on a near-tie may flip one: reported, not
hidden). Also the lookup's own time per call over the prompt's length. With `--checkpoint` (a local checkpoint
directory, e.g. `openm3 train --export`'s) and `--corpus` the prompts are the first `--prompt` tokens of held-out
documents of that corpus (its tokenizer.json encodes them), so the real lookup's share of kept drafts is that of a
trained model on real text.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result

RUNS_ON = "GPU or CPU"  # what `openm3 bench` lists beside it


KEY_TOKENS = 64  # a prompt is found by its first tokens (random prompts: distinct); hashing a whole 128K-token
# prompt per call took ~8 ms of host time per step, which the step waits for (sessions before 28 timed that too)


def scripted_drafts(answers: dict[tuple, list[int]], prompt_len: int, alpha: float, vocab: int, seed: int):
    """An `ngram_drafts` stand-in: a sequence's next tokens of its plain answer, each right with probability
    alpha (seeded)."""
    if len({p[:KEY_TOKENS] for p in answers}) < len(answers):
        raise ValueError(f"prompts must differ in their first {KEY_TOKENS} tokens")
    rng = np.random.default_rng(seed)
    by_start = {prompt[:KEY_TOKENS]: answer for prompt, answer in answers.items()}

    def drafts(tokens, k, _config):
        answer = by_start[tuple(tokens[:KEY_TOKENS].tolist())]
        done = len(tokens) - prompt_len
        d = list(answer[done:done + k])
        d += [answer[-1]] * (k - len(d))
        return [t if rng.random() < alpha else (t + 1) % vocab for t in d]

    return drafts


def run(model, prompts, new: int, cfg=None, lookup=None) -> tuple[list[list[int]], dict]:
    """generate twice (the first compiles), returns the second's tokens and figures."""
    import openm3.engine.speculative as speculative
    from openm3.engine.generate import generate

    real = speculative.ngram_drafts
    if lookup is not None:
        speculative.ngram_drafts = lookup
    try:
        for _ in range(2):
            results, stats = generate(model, prompts, max_new_tokens=new, speculative=cfg)
    finally:
        speculative.ngram_drafts = real
    figures = dict(tokens_per_s=stats.steady_decode_tokens_per_s, decode_s=stats.decode_s,
                   decode_steps=stats.decode_steps, decode_tokens=stats.decode_tokens,
                   spec_steps=stats.spec_steps, draft_tokens=stats.draft_tokens,
                   accepted_tokens=stats.accepted_tokens,
                   tokens_per_step=stats.decode_tokens / max(1, stats.decode_steps) / len(prompts),
                   graph_captures=stats.graph_captures, spec_gate=stats.spec_gate)
    return [r.tokens for r in results], figures


def checkpoint_model(path: str, device: str | None):
    from openm3.models import load_text_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_text_model(path, dtype=dtype, device=device).eval(), device


def corpus_prompts(checkpoint: str, corpus: str, length: int, count: int) -> list[list[int]]:
    """The first `length` tokens of the first `count` held-out documents of `corpus` that are that long."""
    import os

    from openm3.data.corpora import load_corpus
    from openm3.data.tokenizer import M3Tokenizer

    tok = M3Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    prompts = []
    for doc in load_corpus(corpus, "heldout"):
        ids = tok.encode(doc.text)
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"error: {corpus} has only {len(prompts)} held-out documents of >= {length} tokens")


def lookup_us(tokens: np.ndarray, cfg, calls: int = 50) -> float:
    from openm3.engine.speculative import ngram_drafts

    t0 = time.perf_counter()
    for _ in range(calls):
        ngram_drafts(tokens, cfg.num_speculative_tokens, cfg)
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--prompt", type=int, default=131072, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    p.add_argument("--drafts", default="2,4,7", help="comma-separated drafts per step")
    p.add_argument("--alphas", default="0.5,0.8,1.0", help="comma-separated shares of right scripted drafts")
    p.add_argument("--adaptive", action="store_true", help="also run every setting with the adaptive gate "
                   "(`SpeculativeConfig(adaptive=True)`: speculate only where the drafts pay for the step)")
    p.add_argument("--checkpoint", default=None, help="a local checkpoint directory instead of --preset's random "
                   "weights (its text decoder; bf16 on CUDA, fp32 on a CPU)")
    p.add_argument("--corpus", default=None, help="with --checkpoint: prompts from this corpus's held-out "
                   "documents (openm3.data.corpora) instead of random ids")
    args = p.parse_args(argv)

    from openm3.engine.speculative import SpeculativeConfig

    if args.checkpoint:
        model, device = checkpoint_model(args.checkpoint, args.device)
    else:
        model, device = random_text_model(args.preset, args.device)
    vocab = model.config.vocab_size
    if args.corpus:
        if not args.checkpoint:
            raise SystemExit("error: --corpus needs --checkpoint (its tokenizer.json)")
        prompts = corpus_prompts(args.checkpoint, args.corpus, args.prompt, args.batch)
    else:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    res = {"preset": None if args.checkpoint else args.preset, "checkpoint": args.checkpoint, "corpus": args.corpus,
           "prompt": args.prompt, "batch": args.batch, "new": args.new, "settings": []}

    plain_tokens, plain = run(model, prompts, args.new)
    base = plain["tokens_per_s"]
    res["plain"] = plain
    print(f"plain: {base:.1f} tokens/s ({plain['decode_steps']} steps)", flush=True)
    answers = {tuple(pr): t for pr, t in zip(prompts, plain_tokens)}

    def record(name, k, alpha, tokens, fig):
        fig.update(name=name, drafts=k, alpha=alpha, speedup=fig["tokens_per_s"] / base,
                   same_tokens=tokens == plain_tokens,
                   kept_share=fig["accepted_tokens"] / fig["draft_tokens"] if fig["draft_tokens"] else 0.0)
        res["settings"].append(fig)
        print(f"{name:14s} K={k} alpha={alpha if alpha is not None else '-':>4}: {fig['tokens_per_s']:8.1f} tokens/s "
              f"= {fig['speedup']:.2f}x plain, {fig['accepted_tokens']}/{fig['draft_tokens']} drafts kept, "
              f"{fig['tokens_per_step']:.2f} tokens/step, {fig['spec_steps']}/{fig['decode_steps']} speculative "
              f"steps, same tokens: {fig['same_tokens']}", flush=True)
        if fig["spec_gate"]:
            print(f"    {fig['spec_gate']}", flush=True)

    for k in [int(x) for x in args.drafts.split(",")]:
        for adaptive in [False, True] if args.adaptive else [False]:
            cfg = SpeculativeConfig(num_speculative_tokens=k, adaptive=adaptive)
            tag = "+gate" if adaptive else ""
            tokens, fig = run(model, prompts, args.new, cfg)
            record("ngram" + tag, k, None, tokens, fig)
            for alpha in [float(x) for x in args.alphas.split(",")]:
                lookup = scripted_drafts(answers, args.prompt, alpha, vocab, seed=k)
                tokens, fig = run(model, prompts, args.new, cfg, lookup)
                record("scripted" + tag, k, alpha, tokens, fig)
    # The process's first run decodes faster than every later one (H100, session 31: plain 200.1 tokens/s first,
    # 182.0 and 179.8 when run again after other settings), so the ratios are taken against plain decoding run
    # again last; the first run's figure stays in the result as plain_first.
    _, last = run(model, prompts, args.new)
    res["plain_first"], res["plain"] = plain, last
    print(f"plain again: {last['tokens_per_s']:.1f} tokens/s (first {base:.1f}); ratios against it:", flush=True)
    for fig in res["settings"]:
        fig["speedup_vs_first"], fig["speedup"] = fig["speedup"], fig["tokens_per_s"] / last["tokens_per_s"]
        print(f"  {fig['name']:14s} K={fig['drafts']} alpha={fig['alpha'] if fig['alpha'] is not None else '-':>4}: "
              f"{fig['speedup']:.2f}x", flush=True)
    cfg = SpeculativeConfig(num_speculative_tokens=4)
    res["lookup_us_per_call"] = lookup_us(np.asarray(prompts[0] + plain_tokens[0], dtype=np.int64), cfg)
    print(f"n-gram lookup over {args.prompt + args.new} tokens: {res['lookup_us_per_call']:.1f} us per call")
    if args.out:
        stem = f"speculative_decode_{args.corpus}_b{args.batch}" if args.corpus else f"speculative_decode_b{args.batch}"
        print(f"wrote {write_result(args.out, stem, res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
