"""Regular expressions as automata (`openm3.engine.regex_nfa`): over thousands of random texts, the automaton's
`live` equals the `regex` package's partial search (some longer text can still match) and its `matched` equals
`re.search` / `re.fullmatch` (the meaning `jsonschema` gives `pattern`), for search and whole-text matching; the
syntax it does not cover gives None; how many more characters a match can take (`completes`, for strings with a
length bound) agrees with every continuation Python's `re` matches."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest
import regex

from openm3.engine.regex_nfa import compile_nfa

# Seconds a step that once took 8 s to minutes may take now (~0.5 s at most idle; CI's loaded 2 cores: ~1.4 s)
FAST = 5.0

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
                                     r"\p{L}", r"(?>a)", r"(a{256}){64}", r"((a{100}){100}){100}"])
def test_syntax_outside_the_automaton_gives_none(pattern):
    """(Nested counts past the automaton's size bound are left to `regex` too, and fast: no million states.)"""
    started = time.perf_counter()
    assert compile_nfa(pattern, search=True) is None
    assert time.perf_counter() - started < FAST


@pytest.mark.parametrize("pattern", [r"[^\d\D]", "[^\x00-\U0010ffff]", r"a[^\s\S]|[^\w\W]b", "\ud800",
                                     "[\ud800-\udfff]+", r"(?i)[^\d\D]x"])
@pytest.mark.parametrize("search", [True, False], ids=["search", "fullmatch"])
def test_patterns_that_match_nothing_have_a_dead_start(pattern, search):
    """A class no character passes, or a surrogate (no text holds one), gives an automaton whose start is not live
    (its caller refuses the pattern), not None (which would leave it to `regex`, whose partial matching says that
    the empty text could still grow into a match of `[^\x00-\U0010ffff]`)."""
    nfa = compile_nfa(pattern, search=search)
    assert nfa is not None and not nfa.live(nfa.start) and not nfa.completes(nfa.start, 0, None)
    assert not nfa.live(nfa.step(nfa.start, "a"))


def test_many_classes_that_need_every_character_checked_stay_fast():
    """A negated class with a category may need every character checked to know it passes one: a few
    milliseconds each, and past `_MAX_SCANS` such classes in one pattern it is left to `regex`."""
    started = time.perf_counter()
    many = "".join(f"[^\\d\\x00-/:-\\U0010ffff{chr(0x4e00 + k)}]?" for k in range(200))
    assert compile_nfa(many, search=False) is None
    assert time.perf_counter() - started < FAST
    few = compile_nfa(r"[^\D\x00-/:-\U0010ffff]", search=False)  # the digits 0-9 and no more
    assert few is not None and few.matched(few.step(few.start, "7")) and not few.live(few.step(few.start, "a"))


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


@pytest.mark.parametrize("search", [True, False], ids=["search", "whole"])
def test_huge_lengths_are_answered_at_once(search):
    """`completes` with bounds of 10**18, on small automata and on ones of thousands of states (nested counts):
    the longest match a state can still take comes from one pass over the automaton, not a step per character.
    (A search's `$` also matches before a final newline: one character more.)"""
    cases = [(r"^a{0,200}$", 200), (r"^(ab)+c?$", None), (r"^((a?){64}){16}$", 1024), (r"^(a{256}){16}$", 4096),
             (r"^[0-9]{4}$", 4)]
    for pattern, longest in cases:
        started = time.perf_counter()
        nfa = compile_nfa(pattern, search=search)
        assert nfa is not None
        longest = None if longest is None else longest + search
        assert nfa.completes(nfa.start, 10 ** 18, None) == (longest is None), pattern
        assert nfa.completes(nfa.start, 0, 10 ** 18)
        if longest is not None:
            assert nfa.completes(nfa.start, longest, None) and not nfa.completes(nfa.start, longest + 1, None)
            if nfa.length_limit() is None:  # (a bounded question past a cut table is not answered: see below)
                assert nfa.completes(nfa.start, longest, 10 ** 18)
                assert not nfa.completes(nfa.start, longest + 1, 10 ** 18)
        assert time.perf_counter() - started < FAST, pattern


def test_large_automata_tabulate_fewer_lengths_and_say_so():
    """The exact-length sets of an automaton of thousands of states stop at a work budget: `length_limit` says up
    to where `completes` is exact (a caller leaves a pattern with a longer maximum unenforced), and below it the
    answers agree with the language (`^((a?){64}){16}$`: runs of 0 to 1024 a's)."""
    started = time.perf_counter()
    nfa = compile_nfa(r"^((a?){64}){16}$", search=False)
    limit = nfa.length_limit()
    assert limit is not None and 64 <= limit < 1024
    assert all(nfa.completes(nfa.start, k, k) for k in range(0, limit, 7))
    assert not nfa.completes(nfa.step(nfa.start, "b"), 0, limit - 1)
    assert compile_nfa(r"^[a-z]{2,8}$", search=False).length_limit() is None  # small: the table is complete
    assert time.perf_counter() - started < FAST


@pytest.mark.parametrize("pattern,size", [("a", 1), ("a{5}", 5), ("x{2,}", 3), ("x{,7}", 7), ("(ab){3}c", 7),
                                          (r"\d{3}-\d{4}", 8), (r"\p{L}{10}", 10), ("[{]{5}", 5), (r"\{5}", 3),
                                          ("a{b}", 4), ("[]a]{4}", 4), ("a{1000000000}", 10 ** 9),
                                          ("((a{100}){100}){100}", 10 ** 6), ("(?:a|b){10}", 50)])
def test_written_size_counts_what_repeats_write_out(pattern, size):
    """What the `regex` package writes out for counted repeats (it takes minutes over `a{1000000000}`), measured
    from the text: escapes, classes (a `{` inside one, `\\p{L}`) and groups as such."""
    from openm3.engine.regex_nfa import written_size

    assert written_size(pattern) == size


RANGED = PATTERNS + [r"[a-z\u4e00-\u9fff]+", r"(?i)[a-zé]\w*", r"[^\d\s]", r"\W\D?", r"(?s)x.y", r"😀|中文|\U0010ffff",
                     r"[^a-z\u0100-\U0010ffff]", r"(?i)k+s", r"[\U0001f600-\U0001f64f]+"]


@pytest.mark.parametrize("pattern", RANGED)
@pytest.mark.parametrize("search", [True, False], ids=["search", "fullmatch"])
def test_step_range_is_the_union_of_the_steps(pattern, search):
    """`step_range(states, lo, hi)`, the states some character of lo..hi leads to, equals the union of `step` over
    every character of the range (surrogates are no characters), for states after random texts and ranges of
    every size up to the 4096 characters of a 3-byte lead byte: small ranges anywhere, and the ranges of the
    first bytes of random characters."""
    from openm3.engine.utf8 import utf8_range

    nfa = compile_nfa(pattern, search=search)
    assert nfa is not None
    rng = random.Random(pattern)
    alphabet = ALPHABET + "Éſ\u212a中文丁\U0010ffff\u0660"
    for trial in range(6):
        states = nfa.start
        for ch in "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3))):
            states = nfa.step(states, ch)
        for _ in range(5):
            if rng.random() < 0.5:
                lo = rng.choice([0, 0x60, 0xC0, 0x4E00, 0xD7F0, 0x1F600, 0x10FFF0, rng.randrange(0x110000)])
                hi = min(lo + rng.choice([0, 1, 20, 300]), 0x10FFFF)
            else:
                data = chr(rng.choice([rng.randrange(0x80, 0xD800), ord(rng.choice(alphabet[-9:]))])).encode()
                lo, hi = utf8_range(data[:rng.randint(1, len(data) - 1)] if len(data) > 1 else data)
            chars = [chr(c) for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF]
            if not chars or len(chars) > 4096:
                continue
            union = frozenset().union(*(nfa.step(states, ch) for ch in chars))
            assert nfa.step_range(states, lo, hi) == union, (trial, hex(lo), hex(hi))


@pytest.mark.parametrize("pattern,ranges", [
    (r"\w", [(0x10000, 0x3FFFF, True), (0x1F600, 0x1F64F, False), (0xE0000, 0xEFFFF, False)]),
    (r"(?i)[^\W\d_a-z]", [(0x10000, 0x3FFFF, True), (0x100000, 0x10FFFF, False), (0xC0, 0xFF, True)]),
    (r"[^\x00-\U0001ffff]", [(0x10000, 0x3FFFF, True), (0x1F000, 0x1FFFF, False), (0x80, 0x7FF, False)]),
    (r"[\ud800-\udfff\u4e00]", [(0xD000, 0xD7FF, False), (0x4E00, 0x4E3F, True), (0xE000, 0xFFFF, False)]),
    (r"(?s).", [(0x10FFFF, 0x10FFFF, True)]), (r".", [(0x0A, 0x0A, False), (0x0A, 0x0B, True)]),
])
def test_the_widest_ranges_are_answered_exactly_and_fast(pattern, ranges):
    """The 4-byte lead byte F0 stands for ~196K characters: whether a class (with categories, ignore-case,
    negation, surrogates among its members) passes some character of such a range is a search of the class's own
    ranges, made once (`re`'s class run over every character); exact at the edges."""
    nfa = compile_nfa(pattern, search=False)
    started = time.perf_counter()
    for lo, hi, some in ranges:
        assert nfa.live(nfa.step_range(nfa.start, lo, hi)) == some, (hex(lo), hex(hi))
    assert time.perf_counter() - started < FAST
    rx = re.compile(pattern)
    for lo, hi, some in ranges:
        if hi - lo < 300_000:
            assert any(rx.fullmatch(chr(c)) for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF) == some
