"""UTF-8 for byte grammars whose tokens may end inside a character (a byte-level BPE splits rare characters, many
CJK ones and emoji, over several byte tokens).

    split_utf8("a中".encode()[:-1])   # ("a", b"\\xe4\\xb8"): the whole characters, and the first bytes of the next
    utf8_range(b"\\xe4\\xb8")          # (0x4E00, 0x4E3F): the characters that start with those bytes

A grammar that reads characters takes such a token by holding the incomplete character's bytes in its state and
asking whether SOME character of `utf8_range(held)` could come next: UTF-8 keeps the order of code points, so
the characters that share a first few bytes are one range, and the validity rules (no overlong forms, no
surrogates, nothing past U+10FFFF) are those of the lead byte's allowed second bytes (`UTF8_PENDING`), so a valid
prefix never stands for no character.
"""

from __future__ import annotations

import functools

__all__ = ["UTF8_LEAD", "UTF8_PENDING", "SplitCharacters", "split_utf8", "utf8_length", "utf8_prefix",
           "utf8_range"]


def utf8_length(data: bytes, i: int) -> int:
    """Bytes of the UTF-8 character that data[i] starts; 0 when data ends inside it (a byte that starts none counts
    as one: a grammar refuses it)."""
    b = data[i]
    n = 1 if b < 0xC0 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4 if b < 0xF8 else 1
    return n if i + n <= len(data) else 0


def _utf8_tables():
    """UTF-8 state for a multi-byte sequence cut by a token boundary. `lead[b]` is the state after lead byte b (0:
    b cannot start a sequence); `pending[s]` = (lo, hi, next): the next byte must lie in lo..hi, then state next."""
    pending = [None, (0x80, 0xBF, 0), (0x80, 0xBF, 1), (0x80, 0xBF, 2),
               (0xA0, 0xBF, 1), (0x80, 0x9F, 1), (0x90, 0xBF, 2), (0x80, 0x8F, 2)]
    lead = [0] * 256
    for b in range(0xC2, 0xE0):
        lead[b] = 1
    for b in range(0xE1, 0xF0):
        lead[b] = 2
    lead[0xE0], lead[0xED] = 4, 5
    for b in range(0xF1, 0xF4):
        lead[b] = 3
    lead[0xF0], lead[0xF4] = 6, 7
    return tuple(lead), tuple(pending)


UTF8_LEAD, UTF8_PENDING = _utf8_tables()
_LEAST = (0, 0, 0x80, 0x800, 0x10000)  # the least code point of a character of n bytes (shorter forms: overlong)


def utf8_prefix(data: bytes) -> bool:
    """Whether `data` is the first bytes of some valid UTF-8 character, not all of them (a lead byte, then the
    continuation bytes it allows)."""
    state = UTF8_LEAD[data[0]] if data else 0
    for b in data[1:]:
        if not state:
            return False
        lo, hi, state = UTF8_PENDING[state]
        if not lo <= b <= hi:
            return False
    return state != 0


def split_utf8(data: bytes, failed: int | None = None) -> tuple[str, bytes] | None:
    """(text, held): the whole characters of `data` and the bytes of an incomplete last one (b"": none; else a
    `utf8_prefix`); None where `data` is not UTF-8 that may go on (a bad byte, an overlong form, a surrogate).
    failed: where a strict decode of `data` failed (`UnicodeDecodeError.start`), when the caller tried one."""
    if failed is None:
        try:
            return data.decode("utf-8"), b""
        except UnicodeDecodeError as e:
            failed = e.start
    held = data[failed:]  # from the first byte the decoder could not take: valid text up to it
    if len(held) > 3 or not utf8_prefix(held):
        return None
    return data[:failed].decode("utf-8"), held


@functools.cache  # (at most the 17651 prefixes of characters)
def utf8_range(held: bytes) -> tuple[int, int]:
    """(lo, hi): the code points of the characters whose UTF-8 starts with `held` (a `utf8_prefix`), every one a
    valid character (surrogates and overlong forms are no characters: the lead byte's own range is cut to them)."""
    lead = held[0]
    n = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    value = lead & (0x7F >> n)
    for b in held[1:]:
        value = value << 6 | (b & 0x3F)
    free = 6 * (n - len(held))  # bits the bytes still to come fill in
    lo, hi = max(value << free, _LEAST[n]), min(value << free | ((1 << free) - 1), 0x10FFFF)
    if lo < 0xD800 <= hi:  # the lead byte ED alone: D000-DFFF, whose top half is surrogates
        hi = 0xD7FF
    return lo, hi


_UNSEEN = object()  # a memo's "not asked yet" (None is an answer)


class SplitCharacters:
    """A character grammar's `advance` where the data ends inside a character: `cut(state, data, failed)` steps
    the data's whole characters with `step(state, ch)` (None: refused), then takes the incomplete character's first
    bytes as `(state, held)` when `takes(state, lo, hi)` says some character of their range `utf8_range(held)` may
    come next; None where the data is not UTF-8. Memoised for data of up to 4 bytes (a token walk asks the same
    first bytes from the same states again and again; at most 2**16 answers, then cleared)."""

    def __init__(self, step, takes):
        self.step, self.takes, self._memo = step, takes, {}

    def cut(self, state, data: bytes, failed: int):
        """`failed`: where a strict decode of `data` failed (`UnicodeDecodeError.start`)."""
        key = (state, data)
        out = self._memo.get(key, _UNSEEN)
        if out is not _UNSEEN:
            return out
        out = split_utf8(data, failed)
        if out is not None:
            (text, held), out = out, state
            for ch in text:
                out = self.step(out, ch)
                if out is None:
                    break
            if out is not None:
                out = (out, held) if self.takes(out, *utf8_range(held)) else None
        if len(data) <= 4:
            if len(self._memo) >= 1 << 16:
                self._memo.clear()
            self._memo[key] = out
        return out
