"""A byte grammar for outputs that match a regular expression (vLLM's `guided_regex` /
`structured_outputs.regex`), for `GrammarConstraint`:

    grammar = RegexGrammar(r"\\d{3}-\\d{4}")
    grammar.advance(grammar.start, b"555-")   # b"555-": some match still begins this way
    grammar.advance(b"555-", b"x")            # None

The pattern is Python's `regex` syntax and must match the whole output. A state is the output's bytes; `advance`
asks `regex`'s partial matching whether some match starts with the text so far, so every live state can still be
completed and decoding never paints itself into a corner. The text grows by whole UTF-8 characters
(`whole_characters_at`): a token that ends inside a multi-byte character is refused (whether some completion of it
could match is not asked), so a character the tokenizer splits over tokens cannot be written; tokens of whole
characters, non-ASCII ones included, can. Each check reads the whole text: meant for short outputs (ids, dates,
phone numbers, a choice of forms), as regex-constrained outputs usually are.
"""

from __future__ import annotations

import regex

from .json_grammar import utf8_length

__all__ = ["RegexGrammar"]


class RegexGrammar:
    """Outputs that `pattern` matches whole (see the module docstring); ValueError naming the problem for a pattern
    that does not compile."""

    def __init__(self, pattern: str):
        if not isinstance(pattern, str):
            raise ValueError(f"regex: expected a pattern string, got {type(pattern).__name__}")
        try:
            self.pattern = regex.compile(pattern)
        except regex.error as e:
            raise ValueError(f"regex {pattern!r} does not compile: {e}") from None
        self.start = b""

    def advance(self, state: bytes, data: bytes) -> bytes | None:
        out = state + data
        try:
            text = out.decode("utf-8")  # strict: an incomplete or invalid character is refused
        except UnicodeDecodeError:
            return None
        return out if self.pattern.fullmatch(text, partial=True) is not None else None

    def complete(self, state: bytes) -> bool:
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
