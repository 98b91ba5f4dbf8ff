"""Regex-constrained outputs (`openm3.engine.regex_grammar`): the grammar's states against the byte prefixes of the
pattern's (finite) language, written out, those that end inside a character included; the first bytes of a
character taken exactly when some character that starts with them could come (every lead byte, down to whole
characters), under classes, ignore-case, negation and categories; characters that no token holds whole written
through byte tokens by `GrammarConstraint.pick`; and decoding through `generate` with `GrammarConstraint`, greedy
and sampled under top-p (the full mask), ending in texts the pattern matches."""

from __future__ import annotations

import functools
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
ENCODED = {s.encode() for s in LANGUAGE}
BYTE_PREFIXES = {s[:i] for s in ENCODED for i in range(len(s) + 1)}


@pytest.mark.parametrize("text", ["yes 12", "maybe 123.4é", "no 999.0", "yes 1", "yes 1234", "nope", "maybe 12é!",
                                  "no 99è", "yes 10\xff"])
def test_states_follow_the_pattern(text):
    """Byte by byte: a state exists exactly for the byte prefixes of the (finite) language's UTF-8 texts, those that
    end inside a character included, and is complete exactly for its members (never inside a character); a
    character read in two pieces leads to the state it leads to whole (so they share the memoised masks)."""
    g = RegexGrammar(PATTERN)
    data = text.encode("utf-8", "surrogateescape")
    state = g.start
    for i in range(len(data)):
        state = g.advance(state, data[i:i + 1])
        assert (state is not None) == (data[:i + 1] in BYTE_PREFIXES), data[:i + 1]
        if state is None:
            break
        assert g.complete(state) == (data[:i + 1] in ENCODED), data[:i + 1]
        if data[i] >= 0x80 and data[i] < 0xC0:  # the character's last byte: the same state as read whole
            assert state == g.advance(g.advance(g.start, data[:i - 1]), data[i - 1:i + 1])


@pytest.mark.parametrize("pattern", ["é+", "(?m)é+"], ids=["automaton", "regex-package"])  # (m: no automaton)
def test_multibyte_characters_and_bad_patterns(pattern):
    """The automaton holds the first byte of a character it may take (not complete while it does); `regex`'s
    partial matching is asked about whole texts only and refuses it."""
    g = RegexGrammar(pattern)
    automaton = not pattern.startswith("(?m)")
    assert (g.nfa is not None) == automaton
    held = g.advance(g.start, "é".encode()[:1])
    assert (held is not None) == automaton and not (held is not None and g.complete(held))
    assert g.complete(g.advance(held, "é".encode()[1:])) if automaton else True
    assert g.advance(g.start, "è".encode()[:1]) is not None if automaton else True  # (è shares é's first byte)
    assert g.advance(g.start, "è".encode()) is None and g.advance(g.start, "日".encode()[:1]) is None
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
    """The full mask (a walk of the sorted tokens by characters; under the automaton, a token's first bytes of one
    where it ends inside it) equals checking each token whole, with tokens of non-ASCII characters and tokens that
    end inside one; a greedy pick takes a non-ASCII token the pattern allows."""
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


@functools.cache
def character_prefixes() -> frozenset:
    """Every proper prefix of every character's UTF-8 (from the characters themselves: an oracle independent of
    `openm3.engine.utf8`)."""
    out = set()
    for c in range(0x80, 0x110000):
        if not 0xD800 <= c <= 0xDFFF:
            data = chr(c).encode()
            out.update(data[:k] for k in range(1, len(data)))
    return frozenset(out)


DEEP = (b"\xe0", b"\xe2", b"\xe3", b"\xe4", b"\xe9", b"\xed", b"\xef", b"\xf0\x9f", b"\xf4\x8f")


def check_split_characters(advance, state, deep=DEEP) -> int:
    """That `advance(state, prefix)` takes the first bytes of a character exactly when it takes some character that
    starts with them: every lead byte and every longer prefix against the answers for the prefixes one byte
    longer, down to whole characters (stepped as whole characters always were) for the characters of 2 bytes and
    those of 3 and 4 under the prefixes `deep` (the overlong, surrogate and Unicode edges among them); the other
    prefixes one byte short of a character answer for themselves; bytes that start no character, or continue
    none, are refused. Returns how many whole characters were taken."""
    prefixes = character_prefixes()
    taken = 0

    def answer(p: bytes) -> bool:
        nonlocal taken
        got = advance(state, p) is not None
        n = 2 if p[0] < 0xE0 else 3 if p[0] < 0xF0 else 4
        if len(p) == n:
            taken += got
            return got
        if len(p) == n - 1 and n > 2 and p[:n - 2] not in deep:
            return got
        kids = [p + bytes((b,)) for b in range(0x80, 0xC0)]
        valid = [k for k in kids if (k in prefixes if len(k) < n else _decodes(k))]
        for k in set(kids) - set(valid):
            assert advance(state, k) is None, k
        assert advance(state, p + b"a") is None, p
        want = any([answer(k) for k in valid])  # (a list: every prefix checked)
        assert got == want, (p, got)
        return want

    for b in range(0x80, 0x100):
        p = bytes((b,))
        if p in prefixes:
            answer(p)
        else:
            assert advance(state, p) is None, p
    return taken


def _decodes(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("pattern,text,taken", [
    ("[a-z\u4e00]x", "", 1), ("(?i)[a-zé]+", "a", 6), ("[^a-z\u0100-\U0010ffff]", "", 128),
    ("\\d", "", None), ("\\w+", "x", None), ("a\\s", "a", 18), ("[^\\w\\s]", "", None), (".", "", None),
    ("😀|中文|\U0010ffff", "", 3), ("(?i)k\u212a?", "k", 1), ("a(?s:.)", "a", None), ("[\U0001f600-\U0001f64f]", "", 80),
], ids=["class", "ignore-case", "negated", "digits", "word", "space", "negated-categories", "dot", "literals",
        "kelvin", "dotall", "emoji-range"])
def test_a_character_s_first_bytes_are_taken_when_some_completion_is(pattern, text, taken):
    """Every lead byte and longer prefix, down to whole characters (`check_split_characters`): classes with
    ranges and literals, ignore-case (`re`'s own folds: É for é, ſ İ ı, the Kelvin sign for k), negated classes,
    categories with non-ASCII members, `.`, literals of 3 and 4 bytes; `taken`: how many of the whole characters
    checked (those of 2 bytes, and those of 3 and 4 under `DEEP`) the pattern takes there (None: many)."""
    g = RegexGrammar(pattern)
    assert g.nfa is not None
    got = check_split_characters(g.advance, g.advance(g.start, text.encode()))
    assert got == taken if taken is not None else got > 100


def test_a_class_refuses_every_byte_no_completion_of_which_it_takes():
    """`[a-z\u4e00]` (U+4E00 is E4 B8 80): of the lead bytes only E4, then only B8, then only 80; the 4-byte lead
    F0 is refused at once; an answer cannot end inside the character."""
    g = RegexGrammar("[a-z\u4e00]")
    leads = [b for b in range(0x80, 0x100) if g.advance(g.start, bytes((b,))) is not None]
    assert leads == [0xE4] and g.advance(g.start, b"\xf0") is None
    held = g.advance(g.start, b"\xe4")
    assert [b for b in range(256) if g.advance(held, bytes((b,))) is not None] == [0xB8]
    held = g.advance(held, b"\xb8")
    assert [b for b in range(256) if g.advance(held, bytes((b,))) is not None] == [0x80]
    assert not g.complete(held) and g.complete(g.advance(held, b"\x80"))
    assert g.advance(g.start, "丁".encode()) is None and g.advance(g.start, "乀".encode()[:2]) is None  # E4 B9


BYTES_ONLY = [None] + [bytes((b,)) for b in range(0xF8)] + [b"ab", b"12", b" ok"]  # no token holds a character of 2+


def write(transitions, data: bytes, stop: int = 0) -> None:
    """Greedy picks that must write `data` byte by byte (token 1 + b is byte b), then stop: each step's logits
    favour the byte, and inside a character the stop token even more: it must be refused there, and `complete`
    false; at the end the stop token must be picked."""
    c = GrammarConstraint(transitions, [stop])
    width = len(transitions.vocab)
    for i in range(len(data)):
        inside = 0x80 <= data[i] < 0xC0  # the text so far ends inside a character
        row = torch.full((width,), -5.0)
        row[stop] = 10.0 if inside else -10.0
        row[1 + data[i]] = 5.0
        assert not (inside and c.complete), data[:i]
        assert c.pick(row, SamplingParams()) == 1 + data[i], data[:i + 1]
    row = torch.zeros(width)
    row[stop] = 1.0
    assert c.complete and c.pick(row, SamplingParams()) == stop


@pytest.mark.parametrize("pattern,text", [("[\u4e00-\u9fff]+", "中文"), (".*", "a😀b"), ("😀!?", "😀"),
                                          ("(\\w+ )*\\w+", "été 中 ok"), ("(?i)É+", "éÉ")])
def test_characters_no_token_holds_are_written_through_byte_tokens(pattern, text):
    """A vocabulary whose only tokens of non-ASCII text are single bytes: greedy picks write the characters byte by
    byte under classes, `.`, literals, categories and ignore-case, the stop token refused inside a character."""
    transitions = TransitionCache(RegexGrammar(pattern), TokenBytes(BYTES_ONLY))
    write(transitions, text.encode())
