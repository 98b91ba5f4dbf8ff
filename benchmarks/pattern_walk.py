"""The first full mask of a state inside a pattern (what top-p pays the first time a string with a `pattern`, or a
`guided_regex` answer, reaches a new automaton state): a walk of the vocabulary's tokens by characters, timed on
fresh grammars (nothing memoised), for the `structured_decode` benchmark's path pattern as a JSON string (also with
a maxLength, where each character position is a state of its own) and as a regex.

    python -m benchmarks.pattern_walk --out DIR
    python -m benchmarks.pattern_walk --vocab 20000 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._timing import write_result
from benchmarks.structured_decode import PATTERNED, vocabulary

RUNS_ON = "CPU"  # what `openm3 bench` lists beside it


def main(argv=None) -> int:
    from openm3.engine.constrained import TransitionCache
    from openm3.engine.json_grammar import compile_schema
    from openm3.engine.regex_grammar import RegexGrammar

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--repeats", type=int, default=3, help="fresh grammars timed per case (the median is kept)")
    p.add_argument("--out", default=None, help="directory for the JSON result")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    vocab, _ = vocabulary(args.vocab, 0)
    pattern = PATTERNED["properties"]["path"]["pattern"]
    bounded = {**PATTERNED, "properties": {**PATTERNED["properties"],
                                           "path": {**PATTERNED["properties"]["path"], "maxLength": 64}}}
    cases = {"json_string_pattern": (lambda: compile_schema(PATTERNED, strict=True), b'{"path": "src/op'),
             "json_string_pattern_maxlength": (lambda: compile_schema(bounded, strict=True), b'{"path": "src/op'),
             "guided_regex": (lambda: RegexGrammar(pattern.strip("^$")), b"src/op")}
    rows = {}
    for name, (make, prefix) in cases.items():
        times = []
        for _ in range(args.repeats):
            grammar = make()
            transitions = TransitionCache(grammar, vocab)
            transitions._sorted("all")  # the vocabulary's sort is paid once per grammar, not per state
            state = grammar.advance(grammar.start, prefix)
            t0 = time.perf_counter()
            mask = transitions.full_mask(state)
            times.append((time.perf_counter() - t0) * 1e3)
        rows[name] = {"first_full_mask_ms_median": statistics.median(times), "times_ms": times,
                      "allowed_tokens": int(mask.sum())}
        print(f"{name:20s} first full mask: median {rows[name]['first_full_mask_ms_median']:7.1f} ms "
              f"({rows[name]['allowed_tokens']} tokens allowed)", flush=True)
    result = dict(args=vars(args), pattern=pattern, rows=rows)
    if args.out:
        print("wrote", write_result(args.out, "pattern_walk", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
