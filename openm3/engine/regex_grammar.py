"""A byte grammar for outputs that match a regular expression (vLLM's `guided_regex` /
`structured_outputs.regex`), for `GrammarConstraint`:

    grammar = RegexGrammar(r"\\d{3}-\\d{4}")
    state = grammar.advance(grammar.start, b"555-")   # not None: some match still begins this way
    grammar.advance(state, b"x")                      # None

The pattern is Python's `regex` syntax and must match the whole output. Where it keeps to the syntax
`openm3.engine.regex_nfa` covers, a state is the automaton's state set after the output (a step costs a few set
operations, and texts that lead to the same set share it, and the masks memoised for it); otherwise the output's
bytes, and `advance` asks `regex`'s partial matching whether some match starts with the text so far (each check
reads the whole text). With the automaton every live state can still be completed and decoding never paints
itself into a corner; `regex`'s partial matching can take a text no match continues where lookaround decides
(`a(?=b)` takes `a`), and decoding may then find no token to go on with (`dead_ends`; `GrammarConstraint` raises
`GrammarDeadEnd` there). A pattern that no text matches is refused (ValueError) where the automaton, or `regex` on
the empty text, can tell.

With the automaton a token may end inside a multi-byte character (a byte-level tokenizer splits rare characters,
many CJK ones and emoji, over byte tokens): the state then holds the character's first bytes beside the state set
before it, and takes them when some character that starts with them (a range of code points,
`openm3.engine.utf8`) keeps a match possible (`Nfa.step_range`); the character is stepped once whole, and the
text is not `complete` while one is open. On `regex`'s partial matching, which can only be asked about a text, the
text grows by whole UTF-8 characters (`whole_characters_at`): a token that ends inside one is refused there, so a
character the tokenizer splits over tokens cannot be written under such a pattern.
"""

from __future__ import annotations

import regex

from .regex_nfa import MAX_WRITTEN, compile_nfa, written_size
from .utf8 import SplitCharacters, utf8_length

__all__ = ["RegexGrammar"]


class RegexGrammar:
    """Outputs that `pattern` matches whole (see the module docstring); ValueError naming the problem for a pattern
    that does not compile, that no text matches, or whose counted repeats are too large to compile quickly."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"regex: expected a pattern string, got {type(pattern).__name__}")
        if written_size(pattern) > MAX_WRITTEN:  # `regex` would write every repeat out (minutes for a{10**9})
            raise ValueError(f"regex {pattern[:100]!r}: its counted repeats ({{m,n}}) write out more than "
                             f"{MAX_WRITTEN} items; expected smaller counts (or * and +)")
        try:
            self.pattern = regex.compile(pattern)
        except regex.error as e:
            raise ValueError(f"regex {pattern!r} does not compile: {e}") from None
        # the common syntax as an automaton: a state is then its state set (texts that lead to the same set share
        # it, and with it the memoised masks); otherwise the text's bytes, searched anew at each step
        self.nfa = compile_nfa(pattern, search=False)
        self.start = b"" if self.nfa is None else self.nfa.start
        # An answer must be able to start: the empty text matches or grows into a match. Exact for the automaton;
        # `regex`'s partial match only knows what the pattern's start alone rules out (`\b`, `(?!)`).
        if not (self.nfa.live(self.start) if self.nfa is not None else
                self.pattern.fullmatch("", partial=True) is not None):
            raise ValueError(f"regex {pattern!r} matches no text: expected a pattern that some answer can match")
        self._split = SplitCharacters(self._step, lambda states, lo, hi: self.nfa.live(
            self.nfa.step_range(states, lo, hi)))  # data that ends inside a character
        self.character_length = utf8_length  # a character's bytes at data[i] (0: data ends inside it)
        # whether a state may lead nowhere (`regex`'s partial matching: lookaround); the automaton's never do
        self.dead_ends = self.nfa is None
        if self.nfa is None:  # `regex` is asked about whole texts: tokens are walked a character at a time
            self.whole_characters_at = self._between_characters
        else:  # split characters are taken: `TransitionCache` walks a character per edge where a token holds it
            self.character_steps = True

    def advance(self, state, data: bytes):
        """The state after `data` (None: no match starts with the text then). With the automaton a state is its
        state set, or (state set, held) inside a character whose first bytes `held` are; with `regex`, the
        text's bytes (whole characters)."""
        nfa = self.nfa
        if nfa is None:
            out = state + data
            try:
                text = out.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return out if self.pattern.fullmatch(text, partial=True) is not None else None
        if type(state) is tuple:  # inside a character: its first bytes come first
            state, held = state
            data = held + data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:  # it ends inside a character (or is not UTF-8)
            return self._split.cut(state, data, e.start)
        for ch in text:
            state = nfa.step(state, ch)
            if not nfa.live(state):
                return None
        return state

    def _step(self, states: frozenset, ch: str):
        """The automaton's states after `ch` (None: no match can come any more)."""
        states = self.nfa.step(states, ch)
        return states if self.nfa.live(states) else None

    def complete(self, state) -> bool:
        if self.nfa is not None:
            return type(state) is not tuple and self.nfa.matched(state)
        return self.pattern.fullmatch(state.decode("utf-8")) is not None

    @staticmethod
    def _between_characters(state: bytes) -> bool:
        """On `regex`'s partial matching every state lies between whole UTF-8 characters (`TransitionCache`
        walks tokens a character at a time there)."""
        return True

    def can_continue(self, state: bytes) -> bool:
        """True: whether some longer match exists is not asked (where none does, every token is refused and the
        stop token, allowed once the text matches, is the one choice left)."""
        return True
