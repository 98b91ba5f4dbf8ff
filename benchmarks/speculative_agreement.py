"""Where greedy speculative decoding leaves plain greedy decoding, and why: float rounding on a near-tie, or a step
that computes something else.

    python -m benchmarks.speculative_agreement --prompt 16384 --batch 8 --out DIR
    python -m benchmarks.speculative_agreement --preset m3-tiny --device cpu --prompt 300 --batch 3 --new 12  # smoke

Plain greedy `generate` runs first, recording each token's log probability and its two most likely tokens. Then
speculative `generate` runs with every draft right (each sequence's next tokens of the plain answer, K per step),
recording the same. Per sequence: the first token where the two answers differ, the plain run's margin there
(top-1 minus top-2 log probability: a rounding flip needs a margin near the logits' rounding error), and the
largest difference of the chosen tokens' log probabilities before it (how closely a K + 1-token step agrees
with K + 1 one-token steps). A step that computed something else shows as an early divergence with a wide margin,
or as large log-probability differences before any divergence. Both runs are repeated once and the second kept
(the first compiles), and `--eager` runs them without CUDA graphs.
"""

from __future__ import annotations

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result
from benchmarks.speculative_decode import scripted_drafts

RUNS_ON = "CPU"  # what `openm3 bench` lists beside it


def run(model, prompts, new: int, drafts_from=None, k: int = 4, eager: bool = False):
    """generate (greedy) twice, the second kept: each sequence's tokens and, per token, (logprob, top-2)."""
    import openm3.engine.speculative as speculative
    from openm3.engine.generate import generate
    from openm3.engine.speculative import SpeculativeConfig

    real = speculative.ngram_drafts
    cfg = None
    if drafts_from is not None:  # the speculative benchmark's scripted drafts, every one right
        answers = {tuple(p): a for p, a in zip(prompts, drafts_from)}
        speculative.ngram_drafts = scripted_drafts(answers, len(prompts[0]), 1.0, model.config.vocab_size, seed=0)
        cfg = SpeculativeConfig(num_speculative_tokens=k)
    try:
        for _ in range(2):
            entries = [[] for _ in prompts]
            results, stats = generate(model, prompts, max_new_tokens=new, speculative=cfg, logprobs=2,
                                      on_logprobs=lambda b, lp, top: entries[b].append((lp, top)),
                                      cuda_graphs=False if eager else None)
    finally:
        speculative.ngram_drafts = real
    return [r.tokens for r in results], entries, stats


def compare(plain, plain_lp, spec, spec_lp) -> list[dict]:
    rows = []
    for b, (a, s) in enumerate(zip(plain, spec)):
        j = next((i for i, (x, y) in enumerate(zip(a, s)) if x != y), None)
        upto = len(a) if j is None else j
        diffs = [abs(plain_lp[b][i][0] - spec_lp[b][i][0]) for i in range(upto)]
        row = dict(seq=b, tokens=len(a), first_divergence=j, max_logprob_diff_before=max(diffs, default=0.0))
        if j is not None:
            top = plain_lp[b][j][1]
            row["plain_margin_at_divergence"] = top[0][1] - top[1][1] if len(top) > 1 else None
            row["plain_token"], row["spec_token"] = a[j], s[j]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--prompt", type=int, default=16384, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--eager", action="store_true", help="also run both without CUDA graphs")
    args = p.parse_args(argv)
    model, _ = random_text_model(args.preset, args.device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt,), generator=gen).tolist()
               for _ in range(args.batch)]
    result = dict(args=vars(args), runs={})
    for mode in ("graphs", "eager") if args.eager else ("graphs",):
        eager = mode == "eager"
        plain, plain_lp, _ = run(model, prompts, args.new, eager=eager)
        spec, spec_lp, stats = run(model, prompts, args.new, drafts_from=plain, k=args.drafts, eager=eager)
        rows = compare(plain, plain_lp, spec, spec_lp)
        result["runs"][mode] = dict(rows=rows, accepted=stats.accepted_tokens, drafted=stats.draft_tokens)
        print(f"{mode}: drafts kept {stats.accepted_tokens}/{stats.draft_tokens}", flush=True)
        for r in rows:
            print(f"  seq {r['seq']}: first divergence {r['first_divergence']}, max |dlogprob| before "
                  f"{r['max_logprob_diff_before']:.4f}, plain margin there {r.get('plain_margin_at_divergence')}",
                  flush=True)
    if args.out:
        print("wrote", write_result(args.out, "speculative_agreement", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
