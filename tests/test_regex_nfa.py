"""Regular expressions as automata (`openm3.engine.regex_nfa`): over thousands of random texts, the automaton's
`live` equals the `regex` package's partial search (some longer text can still match) and its `matched` equals
`re.search` / `re.fullmatch` (the meaning `jsonschema` gives `pattern`), for search and whole-text matching; the
syntax it does not cover gives None."""

from __future__ import annotations

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


@pytest.mark.parametrize("pattern", [r"(?i)abc", r"a(?=b)", r"(a)\1", r"a^b", r"a$b", r"x{300}", r"[^\d\D]",
                                     r"(?s).", r"\p{L}", r"(?>a)"])
def test_syntax_outside_the_automaton_gives_none(pattern):
    assert compile_nfa(pattern, search=True) is None
