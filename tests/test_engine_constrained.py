"""Constrained decoding through the engine: `generate(constraints=)` and `BatchedGenerator(constraint=)` on a tiny
random model, against an oracle that runs the full forward at every step and masks every token the grammar
refuses; constrained and plain requests decoded in one batch; speculative steps verifying a constrained request's
drafts against its picks (the tokens of plain constrained decoding, greedy and sampled with a seed)."""

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
from test_engine_speculative import _oracle as scripted_drafts  # the drafts from known answers, some wrong
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


SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
TOP_P = SamplingParams(1.0, top_p=0.9)


def words_state(tok, vocab, tokens):
    """The toy grammar's state after `tokens` (the end token aside)."""
    return sum(len(vocab.pieces[t]) for t in tokens if t != tok.eos_id)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1e-3, top_p=0.9)], ids=["greedy", "top_p"])
def test_generate_speculation_on_a_constrained_request_gives_plain_constrained_tokens(model, tok, monkeypatch,
                                                                                       sampling):
    """Drafts scripted from the plain constrained answer (some wrong, a made-up tail past its end) are verified
    against the constraint's picks: greedy, the same tokens as plain constrained decoding; sampled, answers the
    grammar allows (`generate` shares one generator across the batch and draws a plain sample for every row
    first, so its random stream differs: the BatchedGenerator test below compares sampled tokens; a low
    temperature here, as the random model's logits are flat, so that drafts from a plain run are often right);
    drafts kept;
    the constraint's state where the kept tokens leave it (no pick past `max_new_tokens` or the end advanced
    it)."""
    vocab = TokenBytes.from_tokenizer(tok)
    prompts = [tok.encode("The answer, in words:"), tok.encode("def f(x):")]
    for max_new in (30, 7):
        plain, _ = generate(model, prompts, max_new_tokens=max_new, stop_tokens=[tok.eos_id], sampling=sampling,
                            seed=3, constraints=[make(tok, vocab), make(tok, vocab)])
        calls = scripted_drafts(monkeypatch, {tuple(p): r.tokens for p, r in zip(prompts, plain)})
        spec_cs = [make(tok, vocab), make(tok, vocab)]
        spec, stats = generate(model, prompts, max_new_tokens=max_new, stop_tokens=[tok.eos_id], sampling=sampling,
                               seed=3, constraints=spec_cs, speculative=SPEC)
        monkeypatch.undo()
        if sampling.greedy:
            assert [r.tokens for r in spec] == [r.tokens for r in plain]
        for r in spec:
            assert re.fullmatch(r"[a-z ]{1,24}", tok.decode([t for t in r.tokens if t != tok.eos_id]))
        assert calls and stats.spec_steps > 0 and stats.accepted_tokens > 0
        assert stats.decode_steps < sum(len(r.tokens) for r in spec) - 1
        for c, r in zip(spec_cs, spec):
            assert c.state == words_state(tok, vocab, r.tokens)
        if max_new == 30:
            assert all(r.tokens[-1] == tok.eos_id for r in spec)  # 24 bytes at most: the end came inside a step


def test_batched_speculation_on_constrained_requests(model, tok, monkeypatch):
    """BatchedGenerator with scripted drafts: a greedy constrained request gives the masked full forward's
    tokens, a sampled one with a seed the tokens it gives without speculation, a plain request beside them its
    own; drafts were kept."""
    vocab = TokenBytes.from_tokenizer(tok)
    prompts = [tok.encode("one two"), tok.encode("def f(x):"), tok.encode("Three words:")]
    asks = [dict(max_new_tokens=30, constraint=make(tok, vocab)), dict(max_new_tokens=12),
            dict(max_new_tokens=30, constraint=make(tok, vocab), sampling=TOP_P, seed=5)]
    results = {}
    for spec in (None, SPEC):
        if spec is not None:
            scripted_drafts(monkeypatch, {tuple(p): out for p, out in zip(prompts, results[None])})
            asks = [dict(a, constraint=make(tok, vocab)) if "constraint" in a else a for a in asks]
        batcher = BatchedGenerator(model, token_budget=512, max_batch=4, chunk_size=8, speculative=spec)
        outs = [[] for _ in prompts]
        finishes = run_concurrently([
            lambda p=p, out=out, ask=ask: batcher(p, stop_tokens=[tok.eos_id], on_token=out.append, **ask)
            for p, out, ask in zip(prompts, outs, asks)])
        batcher.close()
        assert all(f in ("stop", "length") for f in finishes), finishes
        results[spec] = outs
        if spec is not None:
            assert batcher.accepted_tokens > 0
    assert results[SPEC] == results[None]
    assert results[None][0] == oracle(model, tok, vocab, prompts[0], 30)
    assert re.fullmatch(r"[a-z ]{1,24}", tok.decode([t for t in results[SPEC][2] if t != tok.eos_id]))


def test_verify_constrained_picks_only_the_tokens_kept():
    """`verify_constrained` on made-up rows: drafts kept while they equal the picks (a refused draft never is),
    no pick past `room` or after the end token, and the constraint advanced over exactly the returned tokens."""
    from openm3.engine.speculative import verify_constrained

    vocab = TokenBytes([None, b"ab", b"c", b"1", b"d e"])  # 0: the end token; b"1" the grammar refuses
    rows = torch.zeros(4, len(vocab))
    for r, best in enumerate([1, 2, 4, 0]):
        rows[r, best] = 5.0
    rows[:, 3] = 9.0  # the most likely token everywhere, always refused

    def run(drafts, room):
        c = GrammarConstraint(TransitionCache(Words(), vocab), [0])
        out = verify_constrained(rows[:len(drafts) + 1], drafts, c, SamplingParams(), None, [0], room)
        assert c.state == sum(len(vocab.pieces[t]) for t in out if t != 0)
        return out

    assert run([1, 2, 4], room=9) == [1, 2, 4, 0]  # all kept, then the end
    assert run([1, 2, 4], room=2) == [1, 2]  # the room ends it: the third pick is never made
    assert run([1, 3, 4], room=9) == [1, 2]  # the refused draft is replaced by the pick
    assert run([1, 2], room=9) == [1, 2, 4]  # one more pick after the last draft
    assert run([1, 2, 4], room=9)[-1] == 0
    with pytest.raises(ValueError, match="len\\(drafts\\) \\+ 1"):
        run([1, 2, 4, 0], room=9)


def test_logits_wider_than_the_vocabulary_table_never_pick_past_it(tok):
    """A model may have more logits than its tokenizer has tokens (m3-small: 32768 over 4096): a constraint built
    on the tokenizer's table picks among the table's tokens however likely the ids past it are, greedy and
    sampled; logits narrower than the table are refused."""
    vocab = TokenBytes.from_tokenizer(tok)
    width = len(vocab) + 50
    letters = [t for t, p in enumerate(vocab.pieces) if p and all(b in Words.ALLOWED for b in p)]
    logits = torch.zeros(width)
    logits[len(vocab):] = 50.0  # far the most likely, and never allowed
    logits[letters[7]] = 5.0
    assert make(tok, vocab).pick(logits, SamplingParams(0.0)) == letters[7]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert make(tok, vocab).pick(logits, SamplingParams(1.0, top_p=0.9), generator) < len(vocab)
        assert make(tok, vocab).pick(logits, SamplingParams(1.0), generator) < len(vocab)
    with pytest.raises(ValueError, match="fewer than the vocabulary"):
        make(tok, vocab).pick(torch.zeros(len(vocab) - 1), SamplingParams(0.0))
