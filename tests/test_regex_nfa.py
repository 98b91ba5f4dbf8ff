"""Regular expressions as automata (`openm3.engine.regex_nfa`): over thousands of random texts, the automaton's
`live` equals the `regex` package's partial search (some longer text can still match) and its `matched` equals
`re.search` / `re.fullmatch` (the meaning `jsonschema` gives `pattern`), for search and whole-text matching; the
syntax it does not cover gives None; how many more characters a match can take (`completes`, for strings with a
length bound) agrees with every continuation Python's `re` matches."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import regex

from openm3.engine.regex_nfa import compile_nfa

PATTERNS = [r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", r"^[a-z0-9_]+(/[a-z0-9_]+)*\.py$", r"ab+c", r"^(yes|no)$", r"x|y\d",
            r"^a.?b$", r"[^\s]+@[a-z]+\.com$", r"\d{2,3}", r"^$", r"(a|b)*abb", r"^\w+\s\w+$", r"a$", r"a\Z",
            r"\Aab", r"(?:ab|a)+?c{0,2}", r"[^a-c]", r"^é[日😀]?\W", r"^\S*\D$", r""]
ALPHABET = "ab0123456789-_/.xyz@ \n\tcé日😀"


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("search", [True, False], ids=["search", "fullmatch"])
def test_the_automaton_agrees_with_python(pattern, search):
    nfa = compile_nfa(pattern, search=search)
    assert nfa is not None
    whole = pattern if search else f"(?:{pattern})\\Z"  # regex's partial fullmatch, written as a search
    partial = regex.compile(whole if search else "^" + whole)
    match = re.compile(pattern).search if search else re.compile(pattern).fullmatch
    rng = random.Random(pattern)
    for _ in range(1500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 10)))
        states = nfa.start
        for i, ch in enumerate(text):
            states = nfa.step(states, ch)
            assert nfa.live(states) == (partial.search(text[:i + 1], partial=True) is not None), text[:i + 1]
            if not nfa.live(states):
                break
        else:
            assert nfa.matched(states) == (match(text) is not None), text


@pytest.mark.parametrize("pattern", [r"(?m)^a", r"(?a)\w", r"(?m:a)", r"a(?=b)", r"(a)\1", r"a^b", r"a$b", r"x{300}",
                                     r"[^\d\D]", r"\p{L}", r"(?>a)"])
def test_syntax_outside_the_automaton_gives_none(pattern):
    assert compile_nfa(pattern, search=True) is None


FLAGGED = [r"(?i)ab+c", r"(?i)[a-c]x", r"(?s)a.b", r"(?i:k)s", r"(?x) a b  # a comment", r"(?i)\u017f", r"(?i)[^a]b",
           r"(?is)k.", r"(?i)x(?-i:a)", r"(?i)\w\s", r"(?i)[k-s]+", r"(?i)[^\d]", r"(?i)^(ab|c)$", r"(?s)^.+$"]
CASED = ["a", "A", "b", "B", "c", "k", "K", "\u212a", "s", "S", "\u017f", "x", "X", "1", " ", "\n"]


@pytest.mark.parametrize("pattern", FLAGGED)
@pytest.mark.parametrize("search", [True, False], ids=["search", "fullmatch"])
def test_flags_i_s_x_match_as_python_does(pattern, search):
    """Ignore-case (with `re`'s own folds: the Kelvin sign is a k, the long s an s), dot-all and verbose, for the
    whole pattern or a group: `matched` equals `re` on every text of up to 3 characters over letters of both cases,
    and a live state has some continuation of up to 3 characters that matches (enough for these patterns)."""
    nfa = compile_nfa(pattern, search=search)
    assert nfa is not None
    match = re.compile(pattern).search if search else re.compile(pattern).fullmatch
    texts = ["".join(t) for n in range(4) for t in itertools.product(CASED, repeat=n)]
    for text in texts:
        states = nfa.start
        for ch in text:
            states = nfa.step(states, ch)
        assert nfa.matched(states) == (match(text) is not None), (pattern, text)
        if len(text) <= 1:
            assert nfa.live(states) == any(match(text + more) for more in texts), (pattern, text)


LENGTH_CASES = [(r"^[a-c]+$", "ab-\n"), (r"^a(bc)*d$", "abcd\n"), (r"ab", "ab-"), (r"^[0-9]{2}-[0-9]$", "0-a\n"),
                (r"x$", "x\na"), (r"^(a|bb)+c?$", "abc\n"), (r"b.a", "ab\n"), (r"^$", "a\n"), (r"a{3}", "ab"),
                (r"^(aaa)*b$", "ab\n"), (r"(ab|ba)+$", "ab\n")]


@pytest.mark.parametrize("pattern,alphabet", LENGTH_CASES, ids=[c[0] for c in LENGTH_CASES])
@pytest.mark.parametrize("search", [True, False], ids=["search", "whole"])
def test_completion_lengths_agree_with_python(pattern, alphabet, search):
    """`completes(states, least, most)` after every text of up to 2 characters over a small alphabet against
    every continuation of up to 7 - len(text) characters that Python's `re` matches (the alphabet holds a newline
    where a `$` could match before one, and a character outside the pattern); unbounded questions against the
    lengths found."""
    nfa = compile_nfa(pattern, search=search)
    rx = re.compile(pattern)
    matches = (lambda t: rx.search(t) is not None) if search else (lambda t: rx.fullmatch(t) is not None)
    total, lengths = 7, {}
    for n in range(total + 1):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            if matches(text):
                for cut in range(min(2, n) + 1):
                    lengths.setdefault(text[:cut], set()).add(n - cut)
    checked = 0
    for n in range(3):
        for chars in itertools.product(alphabet, repeat=n):
            text, states = "".join(chars), nfa.start
            for ch in text:
                states = nfa.step(states, ch)
            found, room = lengths.get(text, set()), total - n
            for least in range(room + 1):
                for most in range(least, room + 1):
                    want = any(least <= k <= most for k in found)
                    assert nfa.completes(states, least, most) == want, (text, least, most, sorted(found))
                    checked += 1
                if any(k >= least for k in found):
                    assert nfa.completes(states, least, None), (text, least)
            if not found:
                assert not nfa.completes(states, 0, None) and not nfa.live(states), text
    assert checked > 150 and nfa.length_horizon() is not None


def test_completion_lengths_beyond_the_table_repeat():
    """Lengths far past the exact-length sets' horizon follow their period: `^(aaa)*b$` ends 1 + 3k characters on,
    `^a{0,300}$` only up to 300."""
    nfa = compile_nfa(r"^(aaa)*b$", search=False)
    assert [k for k in range(40) if nfa.completes(nfa.start, k, k)] == list(range(1, 40, 3))
    assert nfa.completes(nfa.start, 3001, 3001) and not nfa.completes(nfa.start, 3002, 3003)
    assert nfa.completes(nfa.start, 3002, 3004) and nfa.completes(nfa.start, 10 ** 6, None)
    nfa = compile_nfa(r"^a{0,200}$", search=False)
    assert nfa.completes(nfa.start, 200, 10 ** 5) and not nfa.completes(nfa.start, 201, 10 ** 5)
    assert not nfa.completes(nfa.start, 201, None) and nfa.completes(nfa.start, 0, 0)
