"""Constrained decoding through the engine: `generate(constraints=)` and `BatchedGenerator(constraint=)` on a tiny
random model, against an oracle that runs the full forward at every step and masks every token the grammar
refuses; constrained and plain requests decoded in one batch; speculation pausing for a constrained request."""

from __future__ import annotations

import re

import pytest
import torch

from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
from openm3.engine.sampling import SamplingParams
from openm3.engine.speculative import SpeculativeConfig

from batching_utils import run_concurrently
from test_serve import model, tok  # noqa: F401 - the fixtures: the same tokenizer and model


class Words:
    """A toy grammar: 1 to `most` bytes of lowercase letters and spaces. State: the bytes read."""

    ALLOWED = frozenset(b"abcdefghijklmnopqrstuvwxyz ")

    def __init__(self, most: int = 24):
        self.most, self.start = most, 0

    def advance(self, state, data):
        n = state + len(data)
        return n if n <= self.most and all(b in self.ALLOWED for b in data) else None

    def complete(self, state):
        return state >= 1

    def can_continue(self, state):
        return state < self.most


def make(tok, vocab):
    return GrammarConstraint(TransitionCache(Words(), vocab), [tok.eos_id])


def oracle(model, tok, vocab, prompt, steps):
    """Greedy tokens with every refused token masked, each step a full forward over prompt + answer."""
    c, out = make(tok, vocab), []
    for _ in range(steps):
        ids = torch.tensor(prompt + out)
        with torch.no_grad():
            row = model(ids, cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32)).logits[-1].float()
        ok = torch.tensor([(t == tok.eos_id and c.complete) or
                           (p is not None and c.grammar.advance(c.state, p) is not None)
                           for t, p in enumerate(vocab.pieces)])
        token = int(row.masked_fill(~ok, float("-inf")).argmax())
        out.append(token)
        if token == tok.eos_id:
            break
        c.state = c.grammar.advance(c.state, vocab.pieces[token])
    return out


def test_generate_greedy_equals_the_masked_full_forward(model, tok):
    vocab = TokenBytes.from_tokenizer(tok)
    prompt = tok.encode("The answer, in words:")
    results, _ = generate(model, [prompt, prompt], max_new_tokens=30, stop_tokens=[tok.eos_id],
                          constraints=[make(tok, vocab), None])
    constrained, plain = results[0].tokens, results[1].tokens
    assert constrained == oracle(model, tok, vocab, prompt, 30)
    assert re.fullmatch(r"[a-z ]{1,24}", tok.decode([t for t in constrained if t != tok.eos_id]))
    assert constrained[-1] == tok.eos_id  # 24 bytes at most: the end must come
    alone, _ = generate(model, [prompt], max_new_tokens=30, stop_tokens=[tok.eos_id])
    assert plain == alone[0].tokens and plain != constrained


def test_batched_constrained_and_plain_requests_decode_together(model, tok):
    vocab = TokenBytes.from_tokenizer(tok)
    prompts = [tok.encode("one two"), tok.encode("def f(x):"), tok.encode("Three words:")]
    want_plain = generate(model, [prompts[1]], max_new_tokens=12, stop_tokens=[tok.eos_id])[0][0].tokens
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)):
        batcher = BatchedGenerator(model, token_budget=512, max_batch=4, chunk_size=8, speculative=spec)
        outs = [[] for _ in prompts]
        asks = [dict(constraint=make(tok, vocab)), {},
                dict(constraint=make(tok, vocab), sampling=SamplingParams(1.0, top_p=0.9), seed=5)]
        finishes = run_concurrently([
            lambda p=p, out=out, ask=ask: batcher(p, max_new_tokens=30 if ask else 12, stop_tokens=[tok.eos_id],
                                                  on_token=out.append, **ask)
            for p, out, ask in zip(prompts, outs, asks)])
        assert all(f in ("stop", "length") for f in finishes), finishes
        batcher.close()
        assert outs[0] == oracle(model, tok, vocab, prompts[0], 30)
        assert outs[1] == want_plain
        assert re.fullmatch(r"[a-z ]{1,24}", tok.decode([t for t in outs[2] if t != tok.eos_id]))
        assert batcher.cache.free_pages == batcher.plan.num_pages


def test_a_constraint_must_end_on_a_stop_token_of_the_generation(model, tok):
    vocab = TokenBytes.from_tokenizer(tok)
    with pytest.raises(ValueError, match="must be among stop_tokens"):
        generate(model, [[5, 6]], max_new_tokens=4, stop_tokens=[], constraints=[make(tok, vocab)])
    with pytest.raises(ValueError, match="expected None or 1 entries"):
        generate(model, [[5, 6]], max_new_tokens=4, stop_tokens=[tok.eos_id], constraints=["json"])
