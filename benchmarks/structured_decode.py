"""What constrained decoding (structured outputs) costs per token on the host, with no model: `GrammarConstraint.pick`
over logits rows of an M3-sized vocabulary (200,064 tokens), for a JSON schema, the same with a `pattern` on one
string (and with a `maxLength` beside it), `json_object`, and the schema's documents as a context-free grammar.

    python -m benchmarks.structured_decode --out DIR
    python -m benchmarks.structured_decode --docs 2 --vocab 50000   # smoke
    python -m benchmarks.structured_decode --formats json_pattern json_pattern_bounded
    python -m benchmarks.structured_decode --formats json_schema grammar

The vocabulary: openm3's locally trained tokenizer (4,096 byte-level tokens) extended with tokens made of 2-3 of
its tokens joined (M3's own tokenizer is not shipped here). Two kinds of logits rows per step:
- `teacher`: N(0, 1) noise plus a bonus on the token that continues a target document (a valid instance, written
  the way `json.dumps` writes it) that gives it `--confidence` of the probability on average: a model that knows
  what it wants to write, as a trained one mostly does;
- `random`: N(0, 3) noise alone: nothing favours valid tokens, so the lazy checks walk furthest (the worst case
  of the method; strings then run until the whitespace and length rules end them or `--max-steps`).
For each, greedy and sampled (temperature 1, top-p 0.9 and temperature 1 alone) picks are timed per token, cold
(a fresh transition memo per document) and warm (the memo of the documents before), beside what the plain
sampler (`sample`) takes over the same rows on the host. The decode step of a model takes ~5 ms (m3-small on an
H200, CUDA graphs) to ~30 ms and more; this is the time added on the host. Here the logits are host tensors, so
the filtered draws that the full mask decides (a sort of the allowed tokens) run on the host too; in the engine
they run on the logits' device.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from benchmarks._timing import write_result

RUNS_ON = "CPU"  # what `openm3 bench` lists beside it

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["path", "line", "mode"],
          "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                         "mode": {"enum": ["read", "write", "append"]},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}


# the same schema with the path's form as a pattern (a string whose every step is checked against it)
PATTERNED = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                      "path": {"type": "string", "pattern": "^[a-z0-9_]+(/[a-z0-9_]+)*\\.py$"}}}
BOUNDED = {**PATTERNED, "properties": {**PATTERNED["properties"],
                                       "path": {**PATTERNED["properties"]["path"], "maxLength": 64}}}
# the same documents as a context-free grammar (vLLM's guided_grammar; keys in the order json.dumps writes them)
CFG = r"""start: "{\"path\": " STR ", \"line\": " INT ", \"mode\": " MODE ", \"tags\": [" [STR (", " STR)*] "]}"
STR: /"[a-z0-9_\/.]*"/
INT: /[1-9][0-9]*/
MODE: "\"read\"" | "\"write\"" | "\"append\""
"""
FORMATS = {"json_schema": SCHEMA, "json_object": None, "json_pattern": PATTERNED, "json_pattern_bounded": BOUNDED,
           "grammar": CFG}


def target(rng: random.Random) -> dict:
    words = ["src", "openm3", "engine", "tests", "data", "main", "util", "model", "serve", "docs"]
    return {"path": "/".join(rng.choice(words) for _ in range(rng.randint(1, 4))) + ".py",
            "line": rng.randint(1, 5000), "mode": rng.choice(["read", "write", "append"]),
            "tags": [rng.choice(words) for _ in range(rng.randint(0, 3))]}


def vocabulary(size: int, seed: int):
    """TokenBytes of `size` tokens: the trained tokenizer's, then joins of 2-3 of them."""
    from openm3.data.tokenizer import get_tokenizer
    from openm3.engine.constrained import TokenBytes

    tok = get_tokenizer()
    base = TokenBytes.from_tokenizer(tok)
    plain = [p for p in base.pieces if p]
    rng = random.Random(seed)
    pieces = list(base.pieces)
    while len(pieces) < size:
        pieces.append(b"".join(rng.choice(plain) for _ in range(rng.randint(2, 3))))
    return TokenBytes(pieces[:size]), tok.eos_id


def longest_piece(vocab, data: bytes, index: dict) -> int:
    """The token of the longest piece that starts `data` (what a tokenizer-like model would write next)."""
    for n in range(min(len(data), index["longest"]), 0, -1):
        t = index["pieces"].get(data[:n])
        if t is not None:
            return t
    raise ValueError(f"no token starts {data[:8]!r}")


def run_doc(constraint, vocab, eos: int, sampling, kind: str, doc: bytes | None, bias: float, max_steps: int,
            gen: torch.Generator, index: dict) -> tuple[list[float], bool]:
    """Decodes one document; per-token pick times (ms) and whether it ended with the end token."""
    times, written = [], b""
    for _ in range(max_steps):
        if kind == "teacher":
            row = torch.randn(len(vocab), generator=gen)
            rest = doc[len(written):] if doc.startswith(written) else b""
            row[longest_piece(vocab, rest, index) if rest else eos] += bias
        else:
            row = torch.randn(len(vocab), generator=gen) * 3
        t0 = time.perf_counter()
        token = constraint.pick(row, sampling, gen)
        times.append((time.perf_counter() - t0) * 1e3)
        if token == eos:
            return times, True
        written += vocab.pieces[token]
    return times, False


def main(argv=None) -> int:
    from openm3.engine.cfg_grammar import CfgGrammar
    from openm3.engine.constrained import GrammarConstraint, TransitionCache
    from openm3.engine.json_grammar import compile_schema
    from openm3.engine.sampling import SamplingParams, sample

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--docs", type=int, default=8, help="documents per case")
    p.add_argument("--confidence", type=float, default=0.8,
                   help="teacher: the target's next token's share of the probability (on average)")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=list(FORMATS))
    p.add_argument("--out", default=None, help="directory for the JSON result")
    args = p.parse_args(argv)
    if not 0 < args.confidence < 1:
        p.error(f"--confidence must lie in (0, 1), got {args.confidence}")

    torch.set_num_threads(1)
    vocab, eos = vocabulary(args.vocab, args.seed)
    # E[exp(N(0, 1))] = exp(1/2): the bonus b with e^b / (e^b + V e^(1/2)) = confidence
    bias = math.log(args.confidence / (1 - args.confidence) * len(vocab)) + 0.5
    index = {"pieces": {}, "longest": max(len(p) for p in vocab.pieces if p)}
    for t, piece in enumerate(vocab.pieces):
        if piece:
            index["pieces"].setdefault(piece, t)
    modes = {"greedy": SamplingParams(), "top_p-0.9": SamplingParams(1.0, top_p=0.9),
             "temperature-1": SamplingParams(1.0)}
    rows, baseline = [], {}
    gen = torch.Generator().manual_seed(args.seed)
    for mode, sampling in modes.items():  # what the unconstrained sampler costs on the same rows (host)
        times = []
        for _ in range(30):
            row = torch.randn(len(vocab), generator=gen) * 3
            t0 = time.perf_counter()
            sample(row[None], sampling, gen)
            times.append((time.perf_counter() - t0) * 1e3)
        baseline[mode] = statistics.median(times)
        print(f"unconstrained {mode:13s} sample(): median {baseline[mode]:6.2f} ms", flush=True)
    for fmt in args.formats:
        grammar = CfgGrammar(FORMATS[fmt]) if fmt == "grammar" else compile_schema(FORMATS[fmt], strict=True)
        for kind in ("teacher", "random"):
            for mode, sampling in modes.items():
                rng = random.Random(args.seed)
                warm = TransitionCache(grammar, vocab)
                cold_ms, warm_ms, ended, tokens, full_masks = [], [], 0, 0, 0
                for d in range(args.docs):
                    doc = json.dumps(target(rng)).encode()
                    for memo, out in ((TransitionCache(grammar, vocab), cold_ms), (warm, warm_ms)):
                        c = GrammarConstraint(memo, [eos])
                        g = torch.Generator().manual_seed(args.seed * 1000 + d)
                        times, done = run_doc(c, vocab, eos, sampling, kind, doc, bias, args.max_steps, g, index)
                        out.extend(times)
                        if memo is warm:
                            full_masks += c.full_masks
                            ended += done
                            tokens += len(times)
                row = dict(format=fmt, logits=kind, sampling=mode, docs=args.docs, tokens=tokens, ended=ended,
                           full_masks=full_masks,
                           cold_ms_mean=statistics.fmean(cold_ms),
                           cold_ms_p99=sorted(cold_ms)[int(0.99 * len(cold_ms))],
                           warm_ms_mean=statistics.fmean(warm_ms), warm_ms_median=statistics.median(warm_ms),
                           warm_ms_p99=sorted(warm_ms)[int(0.99 * len(warm_ms))])
                rows.append(row)
                print(f"{fmt:11s} {kind:7s} {mode:13s} tokens {tokens:5d} ended {ended}/{args.docs} full masks "
                      f"{full_masks:4d}  cold "
                      f"{row['cold_ms_mean']:6.2f} ms (p99 {row['cold_ms_p99']:6.2f})  warm {row['warm_ms_mean']:6.2f} "
                      f"ms (median {row['warm_ms_median']:5.2f}, p99 {row['warm_ms_p99']:6.2f})", flush=True)
    result = dict(args=vars(args), unconstrained_sample_ms_median=baseline, rows=rows)
    if args.out:
        print("wrote", write_result(args.out, "structured_decode", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
