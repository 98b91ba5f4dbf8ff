"""Regular expressions as automata over characters, for constrained decoding: the state after a text is a set of
automaton states, a character moves it in a few set operations, and whether some longer text can still match is
a table lookup, so a grammar's state inside a pattern no longer holds (and re-searches) the whole text.

    nfa = compile_nfa(r"^[0-9]{4}-[0-9]{2}$", search=True)   # None: syntax this module does not cover
    states = nfa.start
    for ch in "2024-":
        states = nfa.step(states, ch)                        # the empty set: no match can come any more
    nfa.live(states), nfa.matched(states)                    # True, False

Python's `re` syntax and meaning (what `jsonschema` checks a `pattern` with), for the common part of it: literals,
`.`, classes (ranges, negation, `\\d` `\\w` `\\s` and their negations), groups, alternation, `? * + {m,n}` (greedy or
lazy: the same set of matches), `^` / `\\A` first and `$` / `\\Z` last, and the flags `i` (ignore case), `s` (`.`
takes a newline too) and `x` (verbose), for the whole pattern (`(?i)`) or a group (`(?i:...)`); a character's test
under a flag is `re`'s own, so case folding follows `re` exactly. Anything else (the flags `m`, `a` and `L`,
backreferences, lookaround, anchors elsewhere, repeat counts above 256) gives None, and the caller keeps `regex`'s
partial search.
`search=True` is JSON Schema's rule (a match anywhere in the text), `search=False` a whole-text match.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

try:  # Python 3.11+
    from re import _constants as _c, _parser
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _c
    import sre_parse as _parser

__all__ = ["Nfa", "compile_nfa", "nfa_lengths_limit"]

_MAX_COUNT = 256  # a repeat bound above this is not expanded (None: the caller falls back)
_MAX_LENGTHS = 4096  # exact-length sets computed before giving up on finding their period
_CATEGORIES = {_c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_SPACE: r"\s",
               _c.CATEGORY_NOT_SPACE: r"\S", _c.CATEGORY_WORD: r"\w", _c.CATEGORY_NOT_WORD: r"\W"}


_FOLLOWED = _c.SRE_FLAG_IGNORECASE | _c.SRE_FLAG_DOTALL  # flags that change what a character's test passes


class _Unsupported(Exception):
    pass


class Nfa:
    """A Thompson automaton (see the module docstring). States are ints; `start` and the results of `step` are
    frozensets of them, closed under empty moves."""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[Callable[[str], bool], int]]] = []
        self.start: frozenset = frozenset()
        self._final: frozenset = frozenset()
        self._live: frozenset = frozenset()
        self._restart: frozenset = frozenset()  # search: a match may begin at every character
        self._steps: dict = {}  # (states, character) -> states: a token walk asks the same steps again and again
        self._by_length: list | None = None  # see `_exact`; made at the first length question
        self._seen_sets: dict = {}
        self._period: tuple[int, int] | None = None
        self._succ: list = []
        self._masks: dict = {}
        self._least: list | None = None  # see `_at_least`

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def closure(self, states) -> frozenset:
        out, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in out:
                    out.add(t)
                    todo.append(t)
        return frozenset(out)

    def step(self, states: frozenset, ch: str) -> frozenset:
        """The states after one more character (the empty set: no match can come any more); memoised (at most
        2**16 steps, then cleared)."""
        key = (states, ch)
        out = self._steps.get(key)
        if out is None:
            nxt = {t for s in states for test, t in self.edges[s] if test(ch)}
            out = self.closure(nxt) | self._restart if (nxt or self._restart) else frozenset()
            if len(self._steps) >= 1 << 16:
                self._steps.clear()
            self._steps[key] = out
        return out

    def live(self, states: frozenset) -> bool:
        """Whether some text that starts with the text read so far matches."""
        return not self._live.isdisjoint(states)

    def matched(self, states: frozenset) -> bool:
        """Whether the text read so far matches."""
        return not self._final.isdisjoint(states)

    # -- lengths: whether a match can come within so many more characters (strings with minLength / maxLength)

    def completes(self, states: frozenset, least: int, most: int | None) -> bool:
        """Whether some text of k more characters, least <= k <= most (most None: no upper bound), leads from
        `states` to a match. Needs `length_horizon()` not None when most is over `_MAX_LENGTHS`."""
        least = max(least, 0)
        if most is not None and most < least:
            return False
        if self._restart and (most is None or most >= max(least, self._restart_least())):
            return True  # a match may begin at every character: any length from the shortest match on
        if most is None:
            return not self._at_least(least).isdisjoint(states)
        mask = self._length_mask(states)
        horizon = self.length_horizon()
        top = most if horizon is None else min(most, horizon - 1)
        if least <= top and mask >> least & ((1 << (top - least + 1)) - 1):
            return True
        if horizon is None or most < horizon:
            return False
        j, p = self._period  # from the horizon on, the exact-length sets repeat with period p
        first = max(least, horizon)
        for k in range(first, min(most, first + p - 1) + 1):
            if mask >> (j + (k - j) % p) & 1:
                return True
        return False

    def length_horizon(self) -> int | None:
        """H such that the states from which a match lies exactly k characters ahead repeat with some period for
        k >= H (the lengths' table is then complete), or None when none was found within `_MAX_LENGTHS`."""
        self._exact(_MAX_LENGTHS)
        if self._period is None:
            return None
        j, p = self._period
        return j + p

    def _exact(self, k: int) -> None:
        """Extends `_by_length` (the states from which a match lies exactly 0, 1, ... characters ahead) to k."""
        if self._by_length is None:
            closures = [self.closure([s]) for s in range(len(self.eps))]
            self._succ = [frozenset(t for u in c for _, t in self.edges[u]) for c in closures]
            first = frozenset(s for s, c in enumerate(closures) if not c.isdisjoint(self._final))
            self._by_length, self._seen_sets, self._period = [first], {first: 0}, None
        sets = self._by_length
        while self._period is None and len(sets) <= k:
            last = sets[-1]
            nxt = frozenset(s for s, succ in enumerate(self._succ) if not succ.isdisjoint(last))
            if nxt in self._seen_sets:
                j = self._seen_sets[nxt]
                self._period = (j, len(sets) - j)
                return
            self._seen_sets[nxt] = len(sets)
            sets.append(nxt)

    def _length_mask(self, states: frozenset) -> int:
        """Bit k set: a match lies exactly k characters ahead of `states`, for k below the horizon (or
        `_MAX_LENGTHS`); memoised per state set."""
        mask = self._masks.get(states)
        if mask is None:
            self._exact(_MAX_LENGTHS)
            mask = 0
            for k, at in enumerate(self._by_length):
                if not at.isdisjoint(states):
                    mask |= 1 << k
            if len(self._masks) >= 1 << 16:
                self._masks.clear()
            self._masks[states] = mask
        return mask

    def _at_least(self, least: int) -> frozenset:
        """The states from which a match lies `least` or more characters ahead: `least` steps back from the live
        states (a shrinking sequence: once two agree it stays)."""
        self._exact(0)
        if self._least is None:
            self._least = [self._live]
        sets = self._least
        while len(sets) <= least and (len(sets) < 2 or sets[-1] != sets[-2]):
            last = sets[-1]
            sets.append(frozenset(s for s, succ in enumerate(self._succ) if not succ.isdisjoint(last)))
        return sets[min(least, len(sets) - 1)]

    def _restart_least(self) -> int:
        """The fewest characters from the start states to a match (`search`: a match may begin anywhere)."""
        mask = self._length_mask(self.start)
        return (mask & -mask).bit_length() - 1 if mask else _MAX_LENGTHS


def nfa_lengths_limit() -> int:
    """Lengths `Nfa.completes` answers for any automaton: below this; above it, where `length_horizon()` is
    not None."""
    return _MAX_LENGTHS


def compile_nfa(pattern: str, *, search: bool) -> Nfa | None:
    """The automaton of `pattern` (Python `re` syntax), or None where it uses syntax this module does not cover
    (or does not compile)."""
    try:
        tree = _parser.parse(pattern)
    except (re.error, TypeError, OverflowError, RecursionError):
        return None
    flags = tree.state.flags & ~(_c.SRE_FLAG_UNICODE | _c.SRE_FLAG_VERBOSE)  # (verbose: the parser's alone)
    if flags & ~_FOLLOWED:
        return None
    items = list(tree)
    begin = bool(items) and items[0] == (_c.AT, _c.AT_BEGINNING) or items[:1] == [(_c.AT, _c.AT_BEGINNING_STRING)]
    if begin:
        items = items[1:]
    end = None
    if items and items[-1][0] is _c.AT and items[-1][1] in (_c.AT_END, _c.AT_END_STRING):
        end = items.pop()[1]
    nfa = Nfa()
    try:
        first, last = _sequence(nfa, items, flags)
    except (_Unsupported, RecursionError):
        return None
    final = {last}
    if end is _c.AT_END and search:  # `$`: at the end, or before a newline that ends the text
        after_newline = nfa.new()
        nfa.edges[last].append((_literal("\n"), after_newline))
        final.add(after_newline)
    elif end is None and search:  # once a match is found, it stays found whatever follows
        found = nfa.new()
        nfa.edges[found].append((_any_char, found))
        nfa.eps[last].append(found)
        final = {found}
    begin = begin or not search  # a whole-text match starts at the start
    nfa.start = nfa.closure([first])
    nfa._restart = frozenset() if begin else nfa.start
    nfa._final = frozenset(final)
    nfa._live = _reaching(nfa, final)
    if not nfa.live(nfa.start):
        return None  # nothing matches (the caller's own check reports it)
    return nfa


def _reaching(nfa: Nfa, final) -> frozenset:
    """The states from which a final state can be reached (every edge passes some character: classes that pass
    none are not built)."""
    back: list[list[int]] = [[] for _ in nfa.eps]
    for s in range(len(nfa.eps)):
        for t in nfa.eps[s]:
            back[t].append(s)
        for _, t in nfa.edges[s]:
            back[t].append(s)
    seen, todo = set(final), list(final)
    while todo:
        for s in back[todo.pop()]:
            if s not in seen:
                seen.add(s)
                todo.append(s)
    return frozenset(seen)


def _sequence(nfa: Nfa, items, flags: int) -> tuple[int, int]:
    first = cur = nfa.new()
    for op, av in items:
        a, b = _item(nfa, op, av, flags)
        nfa.eps[cur].append(a)
        cur = b
    return first, cur


def _item(nfa: Nfa, op, av, flags: int) -> tuple[int, int]:
    if op in (_c.LITERAL, _c.NOT_LITERAL, _c.IN):
        items = ((op, av),) if op is not _c.IN else tuple(av)
        if op is _c.LITERAL and not flags & _c.SRE_FLAG_IGNORECASE:
            return _edge(nfa, _literal(chr(av)))
        return _edge(nfa, _in_class(items, bool(flags & _c.SRE_FLAG_IGNORECASE)))
    if op is _c.ANY:
        return _edge(nfa, _any_char if flags & _c.SRE_FLAG_DOTALL else _not_newline)
    if op is _c.SUBPATTERN:
        _, add_flags, del_flags, sub = av
        add_flags &= ~(_c.SRE_FLAG_UNICODE | _c.SRE_FLAG_VERBOSE)
        del_flags &= ~_c.SRE_FLAG_VERBOSE
        if (add_flags | del_flags) & ~_FOLLOWED:
            raise _Unsupported
        return _sequence(nfa, sub, (flags | add_flags) & ~del_flags)
    if op is _c.BRANCH:
        first, last = nfa.new(), nfa.new()
        for alt in av[1]:
            a, b = _sequence(nfa, alt, flags)
            nfa.eps[first].append(a)
            nfa.eps[b].append(last)
        return first, last
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
        low, high, sub = av
        unbounded = high is _c.MAXREPEAT
        if low > _MAX_COUNT or (not unbounded and high > _MAX_COUNT):
            raise _Unsupported
        first = cur = nfa.new()
        for _ in range(low):
            a, b = _sequence(nfa, sub, flags)
            nfa.eps[cur].append(a)
            cur = b
        if unbounded:
            a, b = _sequence(nfa, sub, flags)
            nfa.eps[cur].append(a)
            nfa.eps[b].append(cur)
            return first, cur
        last = nfa.new()
        nfa.eps[cur].append(last)
        for _ in range(high - low):
            a, b = _sequence(nfa, sub, flags)
            nfa.eps[cur].append(a)
            nfa.eps[b].append(last)
            cur = b
        return first, last
    raise _Unsupported  # anchors inside, backreferences, lookaround, atomic groups, ...


def _edge(nfa: Nfa, test) -> tuple[int, int]:
    a, b = nfa.new(), nfa.new()
    nfa.edges[a].append((test, b))
    return a, b


def _literal(ch: str):
    return lambda c: c == ch


def _any_char(_c: str) -> bool:
    return True


def _not_newline(c: str) -> bool:
    return c != "\n"


@functools.lru_cache(maxsize=256)
def _in_class(items: tuple, ignore_case: bool = False):
    """A character class's test (a lone literal or a negated one is a class of one): its ranges, literals and
    categories, negated if it says so (`re`'s meaning; with `ignore_case`, `re`'s own test under `re.IGNORECASE`,
    so its case folding is `re`'s); _Unsupported for a class that no character passes (`[^\\d\\D]`: an automaton
    edge must lead somewhere)."""
    negate, singles, ranges, categories = False, set(), [], []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            singles.add(chr(av))
        elif op is _c.NOT_LITERAL:
            negate = True
            singles.add(chr(av))
        elif op is _c.RANGE:
            ranges.append((chr(av[0]), chr(av[1])))
        elif op is _c.CATEGORY and av in _CATEGORIES:
            categories.append(re.compile(_CATEGORIES[av]).fullmatch)
        else:
            raise _Unsupported
    if ignore_case:  # the same class written out again and compiled by `re` with the flag
        body = "".join(re.escape(c) for c in sorted(singles)) \
            + "".join(f"{re.escape(lo)}-{re.escape(hi)}" for lo, hi in ranges) \
            + "".join(_CATEGORIES[av] for op, av in items if op is _c.CATEGORY)
        folded = re.compile(f"[{'^' if negate else ''}{body}]", re.IGNORECASE).fullmatch

        @functools.lru_cache(maxsize=4096)
        def test(c: str) -> bool:
            return folded(c) is not None
    else:
        @functools.lru_cache(maxsize=4096)
        def test(c: str) -> bool:
            hit = c in singles or any(lo <= c <= hi for lo, hi in ranges) or any(f(c) for f in categories)
            return hit != negate

    if not any(test(chr(c)) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF):
        raise _Unsupported
    return test
