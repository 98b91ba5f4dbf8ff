"""How often n-gram (prompt lookup) drafts are right on real text, with no model: speculative decoding replayed
over held-out documents, as if the model wrote each document exactly.

    python -m benchmarks.ngram_acceptance --out DIR
    python -m benchmarks.ngram_acceptance --task rewrite --corpora stdlib --out DIR
    python -m benchmarks.ngram_acceptance --corpora stdlib --docs 4 --drafts 4 --lookup-min 2   # smoke

Two tasks. `continue`: for each held-out document of a corpus (tokenized with openm3's local tokenizer, or a
checkpoint's), decoding starts after its first `--start` tokens. `rewrite` (what an agent does when it rewrites a
file it was shown): the prompt is the whole document, the answer the document again with one line in
`--edit-every` replaced by a line of another document. In both, at each step the drafts come from `ngram_drafts`
over the tokens so far,
the leading drafts equal to the document's next tokens are kept, and the step yields those plus one more token (as
`verify` does when the model's choice is the document's). Reported per corpus, number of drafts and shortest
lookup: tokens per step (what a step-bound decode gains at most, before the cost of the longer step), the share of
steps that had drafts, and the share of drafts kept. A real model's answers match its context less (or, in
repetition loops, more) than the document matches itself, so read these as what the lookup can give on this kind of
text, not as a measured speedup.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks._timing import write_result

RUNS_ON = "CPU"  # what `openm3 bench` lists beside it


def replay(tokens: np.ndarray, start: int, cfg) -> dict:
    """Speculative decoding of tokens[start:] with the document as the model's answers."""
    from openm3.engine.speculative import ngram_drafts

    k = cfg.num_speculative_tokens
    t, steps, drafted, kept_total, with_drafts = start, 0, 0, 0, 0
    while t < len(tokens):
        drafts = ngram_drafts(tokens[:t], k, cfg)
        kept = 0
        while kept < len(drafts) and t + kept < len(tokens) and drafts[kept] == tokens[t + kept]:
            kept += 1
        steps += 1
        drafted += len(drafts)
        kept_total += kept
        with_drafts += bool(drafts)
        t += kept + 1
    return dict(steps=steps, tokens=len(tokens) - start, drafted=drafted, kept=kept_total, with_drafts=with_drafts)


def edited(text: str, other: str, every: int) -> str:
    """`text` with its lines number every-1, 2*every-1, ... replaced by lines of `other` (in turn)."""
    lines, spare = text.split("\n"), [line for line in other.split("\n") if line.strip()] or ["pass"]
    for n, i in enumerate(range(every - 1, len(lines), every)):
        lines[i] = spare[n % len(spare)]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="continue", choices=["continue", "rewrite"])
    p.add_argument("--edit-every", type=int, default=10, help="rewrite: one line in this many is replaced")
    p.add_argument("--corpora", default="stdlib,topics,bible_web", help="comma-separated corpora (openm3.data)")
    p.add_argument("--docs", type=int, default=40, help="held-out documents per corpus")
    p.add_argument("--start", type=int, default=256, help="tokens of a document given as its prompt")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per document at most (prompt included)")
    p.add_argument("--drafts", default="2,4,7", help="comma-separated drafts per step")
    p.add_argument("--lookup-min", default="1,2,3", help="comma-separated prompt_lookup_min values")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: openm3's local tokenizer)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from openm3.data.corpora import available_corpora, load_corpus
    from openm3.data.tokenizer import M3Tokenizer, get_tokenizer
    from openm3.engine.speculative import SpeculativeConfig

    tok = M3Tokenizer.from_file(args.tokenizer) if args.tokenizer else get_tokenizer()
    have = set(available_corpora())
    res = {"task": args.task, "start": args.start, "max_tokens": args.max_tokens, "lookup_max": args.lookup_max,
           "edit_every": args.edit_every if args.task == "rewrite" else None, "corpora": {}}
    for corpus in args.corpora.split(","):
        if corpus not in have:
            print(f"{corpus}: not installed here, skipped")
            continue
        texts = [d.text for d in load_corpus(corpus, "heldout")]
        docs = []  # (tokens, where the answer starts)
        for i, text in enumerate(texts):
            if args.task == "continue":
                ids = tok.encode(text)[:args.max_tokens]
                if len(ids) >= 2 * args.start:
                    docs.append((np.asarray(ids, dtype=np.int32), args.start))
            else:
                text = tok.decode(tok.encode(text)[:args.max_tokens // 2])
                prompt, answer = tok.encode(text), tok.encode(edited(text, texts[i - 1], args.edit_every))
                if len(prompt) >= args.start:
                    docs.append((np.asarray(prompt + answer, dtype=np.int32), len(prompt)))
            if len(docs) == args.docs:
                break
        if not docs:
            print(f"{corpus}: no held-out document is long enough, skipped")
            continue
        rows = []
        for k in [int(x) for x in args.drafts.split(",")]:
            for low in [int(x) for x in args.lookup_min.split(",")]:
                cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=max(low, args.lookup_max),
                                        prompt_lookup_min=low)
                t0 = time.perf_counter()
                parts = [replay(d, start, cfg) for d, start in docs]
                total = {key: sum(r[key] for r in parts) for key in parts[0]}
                row = dict(drafts=k, lookup_min=low, docs=len(docs), **total,
                           tokens_per_step=total["tokens"] / total["steps"],
                           steps_with_drafts=total["with_drafts"] / total["steps"],
                           kept_share=total["kept"] / max(1, total["drafted"]), seconds=time.perf_counter() - t0)
                rows.append(row)
                print(f"{corpus:9s} K={k} min={low}: {row['tokens_per_step']:.2f} tokens/step, drafts in "
                      f"{row['steps_with_drafts']:.0%} of steps, {row['kept_share']:.0%} of drafts kept "
                      f"({len(docs)} documents, {total['tokens']} tokens)", flush=True)
        res["corpora"][corpus] = rows
    if args.out:
        print(f"wrote {write_result(args.out, f'ngram_acceptance_{args.task}', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
