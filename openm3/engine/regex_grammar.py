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
(`a(?=b)` takes `a`), and decoding may then find no token to go on with. A pattern that no text matches is refused
(ValueError) where the automaton, or `regex` on the empty text, can tell. The text grows by whole UTF-8
characters (`whole_characters_at`): a token that ends inside a multi-byte character is refused (whether some
completion of it could match is not asked), so a character the tokenizer splits over tokens cannot be written;
tokens of whole characters, non-ASCII ones included, can.
"""

from __future__ import annotations

import regex

from .json_grammar import utf8_length
from .regex_nfa import MAX_WRITTEN, compile_nfa, written_size

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

    def advance(self, state, data: bytes):
        if self.nfa is not None:
            try:
                text = data.decode("utf-8")  # strict: an incomplete or invalid character is refused
            except UnicodeDecodeError:
                return None
            for ch in text:
                state = self.nfa.step(state, ch)
                if not self.nfa.live(state):
                    return None
            return state
        out = state + data
        try:
            text = out.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return out if self.pattern.fullmatch(text, partial=True) is not None else None

    def complete(self, state) -> bool:
        if self.nfa is not None:
            return self.nfa.matched(state)
        return self.pattern.fullmatch(state.decode("utf-8")) is not None

    @staticmethod
    def whole_characters_at(state: bytes) -> bool:
        """Every state lies between whole UTF-8 characters (`TransitionCache` walks tokens a character at a time)."""
        return True

    character_length = staticmethod(utf8_length)  # a character's bytes at data[i] (0: data ends inside it)

    def can_continue(self, state: bytes) -> bool:
        """True: whether some longer match exists is not asked (where none does, every token is refused and the
        stop token, allowed once the text matches, is the one choice left)."""
        return True
