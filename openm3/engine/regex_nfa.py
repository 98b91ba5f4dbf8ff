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
backreferences, lookaround, anchors elsewhere, repeat counts above 256, and automata of more than 16384 states, as
nested counts make: `(a{256}){256}`) gives None, and the caller keeps `regex`'s partial search. A pattern that
matches no text (`[^\\s\\S]`, a lone surrogate) gives an automaton whose start is not `live`: the caller refuses
it.
`search=True` is JSON Schema's rule (a match anywhere in the text), `search=False` a whole-text match.

A grammar that holds the first bytes of a character a token ended inside asks `step_range(states, lo, hi)`: the
states some character of code points lo..hi leads to (`openm3.engine.utf8`: the characters that share a UTF-8
prefix are such a range). Each edge's test knows the code points it passes as sorted ranges (`spans`), made when
first asked: from its literals and ranges, or, for a class with a category or ignoring case, by running `re`'s own
class over every character once (~15 ms a class), so a question costs a binary search per edge whatever the range
(a 4-byte lead byte's ~200K characters included).

The length questions (`completes`) cost the same whatever the numbers asked (a `minLength` of 10**18 included):
the longest match from every state comes from one pass over the automaton, and the table of exact lengths stops at
`_MAX_LENGTHS` lengths or a work budget, whichever comes first (`length_limit` says where).
"""

from __future__ import annotations

import array
import bisect
import functools
import math
import re
import sys
from typing import Callable

try:  # Python 3.11+
    from re import _constants as _c, _parser
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as _c
    import sre_parse as _parser

__all__ = ["MAX_WRITTEN", "Nfa", "compile_nfa", "strong_components", "written_size"]

_MAX_COUNT = 256  # a repeat bound above this is not expanded (None: the caller falls back)
_MAX_STATES = 1 << 14  # an automaton past this many states is not built (None: the caller falls back)
_MAX_LENGTHS = 4096  # exact-length sets computed before giving up on finding their period
_LENGTH_WORK = 1 << 19  # states those sets may hold in all (a large automaton gets fewer lengths: see `_exact`)
_MAX_SCANS = 16  # classes an automaton may test against every character (`_passes_some`)
MAX_WRITTEN = 1 << 16  # `written_size` a pattern may have for the `regex` package (~0.1 s to compile at most)
_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")  # a counted repeat, as Python's `re` and `regex` read it
_CATEGORIES = {_c.CATEGORY_DIGIT: r"\d", _c.CATEGORY_NOT_DIGIT: r"\D", _c.CATEGORY_SPACE: r"\s",
               _c.CATEGORY_NOT_SPACE: r"\S", _c.CATEGORY_WORD: r"\w", _c.CATEGORY_NOT_WORD: r"\W"}


_FOLLOWED = _c.SRE_FLAG_IGNORECASE | _c.SRE_FLAG_DOTALL  # flags that change what a character's test passes


class _Unsupported(Exception):
    pass


_DEAD = None  # the test of a class that no character passes: its edge is left out (`_edge`)


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
        self._range_steps: dict = {}  # (states, lo, hi) -> states: `step_range`'s memo
        self._by_length: list | None = None  # see `_exact`; made at the first length question
        self._seen_sets: dict = {}
        self._period: tuple[int, int] | None = None
        self._work = 0  # states in `_by_length` so far (`_LENGTH_WORK`)
        self._back_eps: list = []  # state -> the states with an empty move to it
        self._back_char: list = []  # state -> the states with a character edge to it
        self._masks: dict = {}
        self._longest: list | None = None  # see `_longest_paths`
        self._shortest: int | None = None  # see `_restart_least`
        self.scans = 0  # classes tested against every character while building (`_passes_some`)

    def new(self) -> int:
        if len(self.eps) >= _MAX_STATES:
            raise _Unsupported  # too large to build and question quickly
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def closure(self, states) -> frozenset:
        return _reachable(states, self.eps)

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

    def step_range(self, states: frozenset, lo: int, hi: int) -> frozenset:
        """The union of `step(states, c)` over the characters c of code points lo..hi (a range that holds some
        character, not only surrogates): the states that some character of the range leads to. Whether some
        character of the range keeps a match possible (`live`), or one within so many characters (`completes`),
        is then a question of that set, since both ask whether SOME state of a set can go on. Memoised (at most
        2**16 ranges, then cleared)."""
        key = (states, lo, hi)
        out = self._range_steps.get(key)
        if out is None:
            nxt = {t for s in states for test, t in self.edges[s] if _passes_in(test, lo, hi)}
            out = self.closure(nxt) | self._restart if (nxt or self._restart) else frozenset()
            if len(self._range_steps) >= 1 << 16:
                self._range_steps.clear()
            self._range_steps[key] = out
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
        `states` to a match. Exact for a `most` below `length_limit()` (lengths past it count as not matching)."""
        least = max(least, 0)
        if most is not None and most < least:
            return False
        shortest = self._restart_least() if self._restart else math.inf
        if shortest < math.inf and (most is None or most >= max(least, shortest)):
            return True  # a match may begin at every character: any length from the shortest match on
        if most is None:
            longest = self._longest_paths()
            return any(longest[s] >= least for s in states)
        mask = self._length_mask(states)
        horizon = self.length_horizon()
        top = min(most, (len(self._by_length) if horizon is None else horizon) - 1)
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
        k >= H (the lengths' table is then complete), or None when none was found within `_MAX_LENGTHS` lengths
        (or the work budget)."""
        self._exact(_MAX_LENGTHS)
        if self._period is None:
            return None
        j, p = self._period
        return j + p

    def length_limit(self) -> int | None:
        """`completes` is exact for every `most` below this; None: for any (`length_horizon()` is not None)."""
        return None if self.length_horizon() is not None else len(self._by_length)

    def _back_closure(self, states) -> frozenset:
        """The states from which an empty path leads into `states`."""
        return _reachable(states, self._back_eps)

    def _exact(self, k: int) -> None:
        """Extends `_by_length` (the states from which a match lies exactly 0, 1, ... characters ahead) to k, or
        until the sets hold `_LENGTH_WORK` states in all (each set costs time linear in its size: a large
        automaton gets fewer lengths, which `length_limit` tells)."""
        if self._by_length is None:
            self._back_eps, self._back_char = [[] for _ in self.eps], [[] for _ in self.eps]
            for s in range(len(self.eps)):
                for t in self.eps[s]:
                    self._back_eps[t].append(s)
                for _, t in self.edges[s]:
                    self._back_char[t].append(s)
            first = self._back_closure(self._final)
            self._by_length, self._seen_sets, self._period, self._work = [first], {first: 0}, None, len(first)
        sets = self._by_length
        while self._period is None and len(sets) <= k and self._work < _LENGTH_WORK:
            nxt = self._back_closure({u for t in sets[-1] for u in self._back_char[t]})
            if nxt in self._seen_sets:
                j = self._seen_sets[nxt]
                self._period = (j, len(sets) - j)
                return
            self._seen_sets[nxt] = len(sets)
            self._work += len(nxt) + 1
            sets.append(nxt)

    def _length_mask(self, states: frozenset) -> int:
        """Bit k set: a match lies exactly k characters ahead of `states`, for k below the horizon (or the lengths
        tabulated: `length_limit`); memoised per state set."""
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

    def _longest_paths(self) -> list:
        """state -> the most characters a match can still take from it (math.inf: no bound; -1: no match can
        come), for every state at once: over the live states' graph (empty moves weigh 0, character edges 1), a
        strongly connected component with a character edge inside is unbounded, any other takes the longest of
        its ways out (components taken in `strong_components`' order: those they lead to first)."""
        if self._longest is not None:
            return self._longest
        live = self._live
        out = [[(t, 0) for t in self.eps[s] if t in live] + [(t, 1) for _, t in self.edges[s] if t in live]
               if s in live else [] for s in range(len(self.eps))]
        component = strong_components([[t for t, _ in edges] for edges in out])
        members: list[list[int]] = [[] for _ in range(max(component, default=-1) + 1)]
        for s in live:
            members[component[s]].append(s)
        longest = [-1] * len(self.eps)
        for c, group in enumerate(members):
            best = 0 if not self._final.isdisjoint(group) else -1
            for u in group:
                for t, weight in out[u]:
                    if component[t] != c:
                        best = max(best, weight + longest[t])
                    elif weight:
                        best = math.inf  # a cycle that reads characters
            for u in group:
                longest[u] = best
        self._longest = longest
        return longest

    def _restart_least(self) -> int:
        """The fewest characters from the start states to a match (`search`: a match may begin anywhere): a
        breadth-first search, a character per layer (math.inf: none)."""
        if self._shortest is None:
            layer, seen, k = self.start, set(self.start), 0
            while layer and self._final.isdisjoint(layer):
                todo, layer = [t for s in layer for _, t in self.edges[s]], set()
                while todo:  # the closure of the states one character on, each state once in all
                    t = todo.pop()
                    if t not in seen:
                        seen.add(t)
                        layer.add(t)
                        todo += self.eps[t]
                k += 1
            self._shortest = k if layer else math.inf
        return self._shortest


def written_size(pattern: str) -> int:
    """How many items `pattern` holds once every counted repeat (`x{m,n}`) is written out max(m, n) times, a group
    with all it holds: what the `regex` package builds, in time linear in it (`a{1000000000}` takes it minutes, and
    `(a{1000}){1000}` most of a second). Read from the text alone, so any dialect's syntax is measured (escapes,
    classes and groups skipped as such); other quantifiers count as one repeat."""
    totals = [0]  # items so far in each open group, innermost last
    last = 0  # items in what a count would repeat (the atom just read)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        j = i + 1
        if c == "\\":
            j = i + 2
            if pattern[i + 1:i + 2] in ("p", "P", "N", "x", "u", "U", "g") and pattern[j:j + 1] == "{":
                j = pattern.find("}", j) + 1 or n  # \p{L}, \N{name}, \x{41}: one item, braces and all
        elif c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"  # a `]` first is a member
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            j += 1
        elif c == "(":
            totals.append(0)
            last = 0
            i = j
            continue
        elif c == ")" and len(totals) > 1:
            group = totals.pop()
            totals[-1] += group
            last = group
            i = j
            continue
        elif c == "{" and (m := _COUNT.match(pattern, i)) and (m.group(1) or m.group(3)):
            low, comma, high = int(m.group(1) or 0), m.group(2), m.group(3)
            times = max(int(high) if high else low + 1 if comma else low, low, 1)  # {m,}: m copies and a loop
            totals[-1] += last * (times - 1)
            last *= times
            i = m.end()
            continue
        totals[-1] += 1
        last = 1
        i = j
    return sum(totals)


def strong_components(out: list) -> list[int]:
    """The strongly connected components of a graph (`out`: node -> the nodes it leads to), by Tarjan's algorithm
    without recursion: node -> its component's number, numbered so that a component leads only to itself and to
    components numbered lower. Time linear in the graph."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    component = [-1] * len(out)
    stack: list[int] = []
    count = 0
    for root in range(len(out)):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, 0)]
        while work:
            s, i = work[-1]
            if i < len(out[s]):
                work[-1] = (s, i + 1)
                t = out[s][i]
                if t not in index:
                    index[t] = low[t] = len(index)
                    stack.append(t)
                    work.append((t, 0))
                elif component[t] < 0:  # on the stack: in the component being found
                    low[s] = min(low[s], index[t])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[s])
            if low[s] == index[s]:
                while True:
                    t = stack.pop()
                    component[t] = count
                    if t == s:
                        break
                count += 1
    return component


def compile_nfa(pattern: str, *, search: bool) -> Nfa | None:
    """The automaton of `pattern` (Python `re` syntax), or None where it uses syntax this module does not cover
    (or does not compile, or is too large). Where no text matches, its start is not `live`."""
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
    except (_Unsupported, RecursionError):
        return None
    begin = begin or not search  # a whole-text match starts at the start
    nfa.start = nfa.closure([first])
    nfa._restart = frozenset() if begin else nfa.start
    nfa._final = frozenset(final)
    nfa._live = _reaching(nfa, final)
    return nfa


def _reaching(nfa: Nfa, final) -> frozenset:
    """The states from which a final state can be reached (every edge passes some character: classes that pass
    none get no edge)."""
    back: list[list[int]] = [[] for _ in nfa.eps]
    for s in range(len(nfa.eps)):
        for t in nfa.eps[s]:
            back[t].append(s)
        for _, t in nfa.edges[s]:
            back[t].append(s)
    return _reachable(final, back)


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
        if op is _c.LITERAL and not flags & _c.SRE_FLAG_IGNORECASE:  # (a lone surrogate is in no text)
            return _edge(nfa, _DEAD if 0xD800 <= av <= 0xDFFF else _literal(chr(av)))
        ignore_case = bool(flags & _c.SRE_FLAG_IGNORECASE)
        return _edge(nfa, _in_class(items, ignore_case) if _passes_some(nfa, items, ignore_case) else _DEAD)
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
    """Two states and an edge between them that passes the characters `test` passes (none for _DEAD)."""
    a, b = nfa.new(), nfa.new()
    if test is not _DEAD:
        nfa.edges[a].append((test, b))
    return a, b


def _spanned(test, make):
    """`test` (a character's test) with `make`, which lists the (lo, hi) ranges of code points it passes, for
    `_passes_in`: kept as `test.spans` (sorted starts and ends, surrogates left out) when first asked."""
    test.make_spans = make
    return test


def _passes_in(test, lo: int, hi: int) -> bool:
    """Whether `test` passes some character of code points lo..hi: the last of its ranges that starts at or below
    hi ends at or above lo."""
    spans = test.__dict__.get("spans")
    if spans is None:
        spans = test.spans = _without_surrogates(test.make_spans())
    starts, ends = spans
    k = bisect.bisect_right(starts, hi) - 1
    return k >= 0 and ends[k] >= lo


def _without_surrogates(spans) -> tuple[list[int], list[int]]:
    starts, ends = [], []
    for lo, hi in spans:
        for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            if a <= b:
                starts.append(a)
                ends.append(b)
    return starts, ends


@functools.lru_cache(maxsize=4096)  # (a pattern's many edges of one character share one test)
def _literal(ch: str):
    def test(c: str) -> bool:
        return c == ch

    return _spanned(test, lambda: [(ord(ch), ord(ch))])


def _any_char(_c: str) -> bool:
    return True


def _not_newline(c: str) -> bool:
    return c != "\n"


_spanned(_any_char, lambda: [(0, 0x10FFFF)])
_spanned(_not_newline, lambda: [(0, 9), (11, 0x10FFFF)])


def _class_parts(items: tuple) -> tuple[bool, set, list, list]:
    """(negated, single characters, (low, high) ranges, category items) of a class's items; _Unsupported for an
    item it cannot hold."""
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
            categories.append(av)
        else:
            raise _Unsupported
    return negate, singles, ranges, categories


def _class_source(items: tuple, ignore_case: bool):
    """The class written out again, compiled by `re` (with the ignore-case flag where asked)."""
    negate, singles, ranges, categories = _class_parts(items)
    body = "".join(re.escape(c) for c in sorted(singles)) \
        + "".join(f"{re.escape(lo)}-{re.escape(hi)}" for lo, hi in ranges) \
        + "".join(_CATEGORIES[av] for av in categories)
    return re.compile(f"[{'^' if negate else ''}{body}]", re.IGNORECASE if ignore_case else 0)


_SCANNED: dict = {}  # (items, ignore_case) -> whether some character passes: `_passes_some`'s full scans


def _passes_some(nfa: Nfa, items: tuple, ignore_case: bool) -> bool:
    """Whether some character (not a surrogate: no text holds one) passes the class. First a few likely ones (its
    own, their neighbours, one of each category, the ends of Unicode: enough for a class that is not negated, or
    a negated one without categories whose complement holds more than surrogates), then, where none does, every
    character (`re` searching a text of them all: milliseconds), at most `_MAX_SCANS` classes per automaton
    (_Unsupported past them)."""
    compiled = _class_source(items, ignore_case)
    _, singles, ranges, _ = _class_parts(items)
    points = {ord(c) for c in singles} | {ord(c) for lo, hi in ranges for c in (lo, hi)}
    points |= {p + d for p in points for d in (-1, 1)} | {0, 0x10FFFF} | {ord(c) for c in "0a _!A\n"}
    likely = "".join(chr(p) for p in points if 0 <= p <= 0x10FFFF and not 0xD800 <= p <= 0xDFFF)
    if compiled.search(likely) is not None:
        return True
    key = (items, ignore_case)
    if key not in _SCANNED:
        nfa.scans += 1
        if nfa.scans > _MAX_SCANS:
            raise _Unsupported
        if len(_SCANNED) >= 1024:
            _SCANNED.clear()
        _SCANNED[key] = compiled.search(_every_character()) is not None
    return _SCANNED[key]


@functools.cache
def _every_character() -> str:
    """Every character but the surrogates, in order (made through UTF-32: ~0.1 s once)."""
    codes = array.array("I" if array.array("I").itemsize == 4 else "L", range(0xD800))
    codes.extend(range(0xE000, 0x110000))
    return codes.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")


@functools.lru_cache(maxsize=256)
def _in_class(items: tuple, ignore_case: bool = False):
    """A character class's test (a lone literal or a negated one is a class of one): its ranges, literals and
    categories, negated if it says so (`re`'s meaning; with `ignore_case`, `re`'s own test under `re.IGNORECASE`,
    so its case folding is `re`'s). It may pass no character (`[^\\d\\D]`; `_passes_some`, `_scan`)."""
    negate, singles, ranges, names = _class_parts(items)
    categories = [re.compile(_CATEGORIES[av]).fullmatch for av in names]
    if ignore_case:  # the same class written out again and compiled by `re` with the flag
        folded = _class_source(items, True).fullmatch

        @functools.lru_cache(maxsize=4096)
        def test(c: str) -> bool:
            return folded(c) is not None
    else:
        @functools.lru_cache(maxsize=4096)
        def test(c: str) -> bool:
            hit = c in singles or any(lo <= c <= hi for lo, hi in ranges) or any(f(c) for f in categories)
            return hit != negate

    return _spanned(test, lambda: _class_spans(items, ignore_case))


def _class_spans(items: tuple, ignore_case: bool) -> list[tuple[int, int]]:
    """The (lo, hi) code-point ranges a class passes, in order: from its literals and ranges, or, where a category
    or ignoring case decides (`re`'s own tables), the runs of characters that `re`'s class passes in the text of
    every character (~15 ms)."""
    negate, singles, ranges, names = _class_parts(items)
    if ignore_case or names:
        compiled = _class_source(items, ignore_case)
        runs = re.compile(compiled.pattern + "+", compiled.flags).finditer(_every_character())
        return [(_code_point(m.start()), _code_point(m.end() - 1)) for m in runs]
    spans: list[list[int]] = []
    for lo, hi in sorted([(ord(c), ord(c)) for c in singles] + [(ord(lo), ord(hi)) for lo, hi in ranges]):
        if spans and lo <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    if not negate:
        return [(lo, hi) for lo, hi in spans]
    out, low = [], 0
    for lo, hi in spans:
        if low < lo:
            out.append((low, lo - 1))
        low = hi + 1
    return out + [(low, 0x10FFFF)] if low <= 0x10FFFF else out


def _code_point(i: int) -> int:
    """The code point of `_every_character()[i]` (the surrogates are left out of it)."""
    return i if i < 0xD800 else i + 0x800


def _reachable(states, adjacency) -> frozenset:
    """`states` and every state reachable from them along `adjacency` (a list of successor lists)."""
    out, todo = set(states), list(states)
    while todo:
        for t in adjacency[todo.pop()]:
            if t not in out:
                out.add(t)
                todo.append(t)
    return frozenset(out)
