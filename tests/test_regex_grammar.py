"""Regex-constrained outputs (`openm3.engine.regex_grammar`): the grammar's states against the prefixes of the
pattern's (finite) language, written out, whole UTF-8 characters only, and decoding through `generate` with
`GrammarConstraint`, greedy and sampled under top-p (the full mask), ending in texts the pattern matches."""

from __future__ import annotations

import re
import time

import pytest
import torch

from openm3.engine import generate
from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
from openm3.engine.regex_grammar import RegexGrammar
from openm3.engine.sampling import SamplingParams

from test_serve import model, tok  # noqa: F401 - the fixtures

# Seconds a step that once took 8 s to minutes may take now (~0.5 s at most idle; CI's loaded 2 cores: ~1.4 s)
FAST = 5.0

PATTERN = r"(yes|no|maybe) [0-9]{2,3}(\.[0-9])?é?"
LANGUAGE = {f"{w} {n}{f}{e}" for w in ("yes", "no", "maybe") for n in [f"{k:02d}" for k in range(100)] +
            [f"{k:03d}" for k in range(1000)] for f in ["", *(f".{d}" for d in range(10))] for e in ("", "é")}
PREFIXES = {s[:i] for s in LANGUAGE for i in range(len(s) + 1)}


@pytest.mark.parametrize("text", ["yes 12", "maybe 123.4é", "no 999.0", "yes 1", "yes 1234", "nope", "maybe 12é!"])
def test_states_follow_the_pattern(text):
    """Character by character: a state exists exactly for the prefixes of the (finite) language, and is complete
    exactly for its members; half a character is refused."""
    g = RegexGrammar(PATTERN)
    state = g.start
    for i, char in enumerate(text):
        data = char.encode()
        if len(data) > 1:
            assert g.advance(state, data[:1]) is None
        state = g.advance(state, data)
        assert (state is not None) == (text[:i + 1] in PREFIXES), text[:i + 1]
        if state is None:
            break
        assert g.complete(state) == (text[:i + 1] in LANGUAGE)


@pytest.mark.parametrize("pattern", ["é+", "(?m)é+"], ids=["automaton", "regex-package"])  # (m: no automaton)
def test_multibyte_characters_and_bad_patterns(pattern):
    g = RegexGrammar(pattern)
    assert (g.nfa is None) == pattern.startswith("(?m)")
    assert g.advance(g.start, "é".encode()[:1]) is None
    assert g.complete(g.advance(g.start, "éé".encode())) and g.complete(g.advance(g.start, "é".encode()))
    assert not g.complete(g.start) and g.advance(g.start, b"e") is None
    with pytest.raises(ValueError, match="does not compile"):
        RegexGrammar("[a-")


@pytest.mark.parametrize("pattern", ["[^\x00-\U0010ffff]", "\\b", "(?!)", "\ud800", "[^\\d\\D]+x", "(?m)\\b",
                                     "[\ud800-\udfff]"])
def test_a_pattern_that_no_answer_can_match_is_refused(pattern):
    """No text matches: the grammar's start could neither end the answer nor take a character, and decoding would
    fail at its first token (a RuntimeError: a 500); refused when made instead, naming the pattern (a 400)."""
    with pytest.raises(ValueError, match="matches no text"):
        RegexGrammar(pattern)


@pytest.mark.parametrize("pattern", ["", "x{0}", "a|[^\\s\\S]", "(?m)^$", "\\bx"])
def test_patterns_that_match_the_empty_text_or_something_are_kept(pattern):
    g = RegexGrammar(pattern)
    assert g.complete(g.start) or any(g.advance(g.start, c.encode()) is not None for c in "ax")


@pytest.mark.parametrize("pattern", ["a{1000000000}", "(a{1000}){1000}", "(?m)x{100000}", "((a{256}){256}){2}"])
def test_counted_repeats_too_large_to_compile_are_refused_at_once(pattern):
    """The `regex` package writes counted repeats out (`a{1000000000}`: minutes of one thread); past
    `MAX_WRITTEN` items the pattern is refused at once instead."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match="counted repeats"):
        RegexGrammar(pattern)
    assert time.perf_counter() - started < FAST
    RegexGrammar("(?m)x{1000}")  # (smaller counts compile)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(1.0, top_p=0.9)], ids=["greedy", "top-p"])
def test_decoding_ends_in_a_match(model, tok, sampling):
    vocab = TokenBytes(TokenBytes.from_tokenizer(tok).pieces + [None] * (model.config.vocab_size - tok.vocab_size))
    transitions = TransitionCache(RegexGrammar(PATTERN), vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tok.vocab_size, (n,), generator=gen).tolist() for n in (12, 30, 7)]
    results, _ = generate(model, prompts, max_new_tokens=24, sampling=sampling, stop_tokens=[tok.eos_id], seed=4,
                          constraints=[GrammarConstraint(transitions, [tok.eos_id]) for _ in prompts])
    for r in results:
        assert r.tokens[-1] == tok.eos_id and r.finish_reason == "stop", r.tokens
        text = b"".join(vocab.pieces[t] for t in r.tokens[:-1]).decode()
        assert re.fullmatch(PATTERN, text), text


@pytest.mark.parametrize("flags", ["", "(?m)"], ids=["automaton", "regex-package"])  # (m: no automaton)
def test_full_masks_equal_checking_each_token(tok, flags):
    """The full mask (a walk of the sorted tokens by whole characters) equals checking each token whole, with
    tokens of non-ASCII characters and tokens that end inside one; a greedy pick takes a non-ASCII token the pattern
    allows."""
    cut = ["é".encode()[:1], "日".encode()[:2], "😀".encode()[:3], b"1" + "é".encode()[:1]]
    whole = ["é".encode(), "éb".encode(), "日".encode(), "日本".encode(), "b日".encode(), "😀".encode()]
    vocab = TokenBytes(TokenBytes.from_tokenizer(tok).pieces + cut + whole)
    g = RegexGrammar(flags + r"(yes|no|maybe) [0-9]{2,3}(\.[0-9])?(é|日本|😀)?")
    assert (g.nfa is None) == bool(flags)
    transitions = TransitionCache(g, vocab)
    for text in ["", "y", "yes", "yes ", "yes 12", "yes 12.5", "yes 123é", "maybe 12日", "no 99😀"]:
        state = g.advance(g.start, text.encode())
        assert state is not None, text
        want = torch.tensor([p is not None and g.advance(state, p) is not None for p in vocab.pieces])
        assert torch.equal(transitions.full_mask(state), want), text
    state = g.advance(g.start, b"yes 12")
    ids = {p: t for t, p in enumerate(vocab.pieces)}
    assert transitions.full_mask(state)[[ids["é".encode()], ids["日本".encode()]]].all()
    for piece in ("é", "日本"):
        c = GrammarConstraint(transitions, [tok.eos_id])
        c.read(b"yes 12")
        row = torch.zeros(len(vocab))
        row[ids[piece.encode()]] = 5.0
        assert c.pick(row, SamplingParams()) == ids[piece.encode()]
