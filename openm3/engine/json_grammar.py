"""Byte-level incremental matcher for JSON documents constrained by a JSON Schema, for constrained decoding
(structured outputs: OpenAI `response_format: {"type": "json_schema" | "json_object"}`).

    grammar = compile_schema(schema, strict=True)
    state = grammar.start
    for token in tokens:                       # each token: bytes
        state = grammar.advance(state, token)  # None: no valid document continues this way
    grammar.complete(state)                    # the bytes so far are a whole valid document

The decoder tries candidate tokens in order of probability and keeps the first one `advance` accepts, so `advance`
is the hot path: pure Python, with bulk paths for the common runs (string text, digits, whitespace, literal keys).
States are immutable and hashable, so a caller may memoize `(state, token) -> next state`.

States. A deterministic configuration is a tuple `(kind, ..., parent)`: the innermost thing being read (a value
about to start, a string, a number, a literal, an object, an array, a key) with its counters, and `parent`, the
configuration to return to when it is done (a linked stack; the outermost is `(_END, ws)`). Where the schema leaves
several readings open (anyOf, an enum, a type list) the state is a frozenset of configurations; `advance` returns a
single configuration again as soon as only one is left.

Every live configuration can still reach a complete document: `compile_schema` refuses schemas where some value
could be started but never finished (e.g. a property that requires itself forever, `minItems` beyond what `items:
false` allows), so a decoder steered by this matcher never paints itself into a corner.

Keywords
- Enforced: `type` (a name or a list), `enum`, `const`, `properties`, `required`, `additionalProperties`,
  `minProperties`, `maxProperties`, `items`, `prefixItems`, `minItems`, `maxItems`, `minLength`, `maxLength`,
  `anyOf`, `oneOf` (as anyOf: exclusivity between branches is NOT enforced), `allOf` (one subschema only), `$ref`
  (local JSON pointers: `#`, `#/$defs/NAME`, `#/definitions/NAME`, ...; resolved lazily, so recursive schemas
  work), and `pattern` (Python's `re` meaning, which `jsonschema` gives it and which agrees with ECMA-262 on the
  usual patterns; the text must contain a match, as JSON Schema says: anchor it with `^...$` for a whole-string
  form). The common syntax runs as an automaton (`openm3.engine.regex_nfa`: the state holds its state set and,
  beside `minLength` / `maxLength`, the characters so far: a character is taken only while a match can still end
  the string within the bounds); the rest through the `regex` package's partial search of the text so far, on
  strings without a length bound (counted repeats that `regex` would write out past `regex_nfa.MAX_WRITTEN` items,
  such as `a{1000000000}`, are refused). `$defs` / `definitions` hold subschemas. A pattern that no string
  matches is refused.
- Ignored annotations: `title`, `description`, `default`, `examples`, `$schema`, `$id`, `$comment`, `deprecated`,
  `readOnly`, `writeOnly`.
- Accepted but NOT enforced (documents may violate them): `format`, `minimum`, `maximum`, `exclusiveMinimum`,
  `exclusiveMaximum`, `multipleOf`, `uniqueItems`, and, on a string with a length bound, a `pattern` in syntax
  the automaton lacks (flags, lookaround, backreferences, counts nested past its size: a bound could leave a
  started string no way to a match, and that is not checked) or one whose lengths it cannot tabulate (a maxLength
  of 4096 or more over a pattern whose exact-length sets do not repeat within that many characters; fewer for an
  automaton of thousands of states, `Nfa.length_limit`).
- Refused (ValueError; honouring them by halves would accept invalid documents or block valid ones):
  `patternProperties`, `propertyNames`, `dependentRequired`, `dependentSchemas`, `dependencies`, `if`, `then`,
  `else`, `not`, `contains`, `minContains`, `maxContains`, `unevaluatedProperties`, `unevaluatedItems`,
  `additionalItems`, `items` as a list, `$anchor`, `$dynamicRef`, `$dynamicAnchor`, and any unknown keyword.
- Malformed (ValueError, before anything above): a `type` that names no type, `properties` that is not an object,
  counts that are not ints >= 0, a `$ref` that points nowhere, ...: `validate_schema`, which a forced tool call's
  parameters get too (it passes what is only refused above). Counts of any size (10**18) compile at once, and
  reading toward them costs the same per byte.

Spelling rules (what the matcher accepts beyond plain JSON syntax)
- `enum` / `const` values match only their compact serialization, `json.dumps(v, ensure_ascii=False,
  separators=(",", ":"))` in UTF-8: no escapes for characters that need none, no spaces inside objects/arrays,
  keys in the order given. A schema mixing `enum` with other keywords keeps only the values that satisfy them.
- Declared keys of an object without additional properties must be written exactly that way too (no escapes).
  Where additional properties are allowed a key may be any string; its decoded text picks the property schema.
- Strings must be valid UTF-8 (no control bytes, no lone continuation or invalid lead bytes, no surrogate code
  points); a `\\uD8xx` high-surrogate escape must be followed by a `\\uDCxx` low one (lone surrogates would not
  re-encode). Lengths count code points, an escape (or a surrogate pair) as one.
- Inside a string with a pattern the state after each character (an escape is one) is checked: some longer text
  must still contain a match (within the length bounds). Data may end inside a character or an escape where the
  pattern runs as an automaton: the configuration then holds its first bytes and takes them when some character
  that starts with them may come (a range of code points or two: `openm3.engine.utf8`, `_held_ranges`;
  `Nfa.step_range`); the character counts toward the lengths when whole. Under the `regex` package's partial
  search, which is asked about a text, the text grows by whole characters: data that ends inside one is refused
  there (`whole_characters_at` tells a token walk to step by characters in such states).
- Integers are `-?(0|[1-9][0-9]*)`; numbers JSON's full grammar. Duplicate keys are refused.
- Whitespace (space, \\n, \\r, \\t) comes in runs of at most `max_whitespace` bytes between tokens, before the
  top-level value and after it.
- `strict=True` (OpenAI strict mode): a schema that describes objects (it has `properties` or its `type` names
  "object") and says nothing of `additionalProperties` takes no keys beyond its `properties`. `True` / `{}`
  (any value) stays unrestricted.
"""

from __future__ import annotations

import bisect
import json
import re
from urllib.parse import unquote

from .regex_nfa import MAX_WRITTEN, Nfa, compile_nfa, written_size
from .utf8 import UTF8_LEAD, UTF8_PENDING, utf8_length, utf8_prefix, utf8_range

__all__ = ["JsonGrammar", "compile_schema", "validate_schema"]

# ---------------------------------------------------------------------------------------------------------------
# Keyword sets

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
_CONTAINERS = frozenset({"$defs", "definitions"})
_ENFORCED = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "minProperties",
                       "maxProperties", "items", "prefixItems", "minItems", "maxItems", "minLength", "maxLength",
                       "anyOf", "oneOf", "allOf", "$ref", "pattern"})
_UNENFORCED = frozenset({"format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "multipleOf", "uniqueItems"})
_REFUSED = frozenset({"patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                      "if", "then", "else", "not", "contains", "minContains", "maxContains",
                      "unevaluatedProperties", "unevaluatedItems", "additionalItems", "$anchor", "$dynamicRef",
                      "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"})
_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")

# ---------------------------------------------------------------------------------------------------------------
# Configuration kinds (the first element of every configuration tuple) and their layouts:
#   (_VAL, node, ws, parent)                               a value of `node` is about to start, after ws blanks
#   (_STR, (min_len, max_len), count, utf8, esc, parent)   inside a string value; count = code points (capped)
#   (_NUM, integer_only, phase, parent)                    inside a number (phases below)
#   (_LIT, literal_info, prefix, parent)                   inside an enum/const/true/false/null literal
#   (_OBJ, obj_info, phase, seen, ws, value_node, parent)  inside an object; seen = frozenset of keys so far
#   (_ARR, arr_info, phase, count, ws, parent)             inside an array; count = items so far (capped)
#   (_KEYX, obj_info, prefix, seen, parent)                inside a key that must be one declared name, exactly
#   (_KEYA, obj_info, raw, utf8, esc, seen, parent)        inside a key that may be any string
#   (_END, ws)                                             after the top-level value
#   (_PSTR, pattern, text, parent)                         inside a string value with a `pattern`: its text so far
#   (_NSTR, nfa, states, parent)                           the same, the pattern as an automaton: its state set
#   (_LSTR, (nfa, min_len, max_len), states, count, parent)  the same with a length bound: count = characters
#                                                          (capped at min_len without a max_len)
#   (_HSTR, spec, states, count, held, parent)             inside a character of an _NSTR (spec: its nfa, count 0)
#                                                          or _LSTR (spec: its triple) string: its first bytes held
_VAL, _STR, _NUM, _LIT, _OBJ, _ARR, _KEYX, _KEYA, _END, _PSTR, _NSTR, _LSTR, _HSTR = range(13)

_OBJ_OPEN, _OBJ_COMMA, _OBJ_KEY, _OBJ_VALUE = range(4)  # after `{`, after `,`, after a key, after a value
_ARR_OPEN, _ARR_VALUE = range(2)  # after `[`, after an item
_EMPTY = frozenset()
_NO_LIMIT = 1 << 62

_QUOTE, _BACKSLASH, _COMMA, _COLON = 0x22, 0x5C, 0x2C, 0x3A
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 0x7B, 0x7D, 0x5B, 0x5D

_IS_WS = tuple(b in b" \t\n\r" for b in range(256))
_WS_RUN = re.compile(rb"[ \t\n\r]*").match

# String text that needs no state: printable ASCII other than `"` and `\`, and whole well-formed UTF-8 sequences
# (no overlongs, no surrogates, nothing above U+10FFFF).
_PLAIN_RUN = re.compile(
    rb"(?:[\x20\x21\x23-\x5b\x5d-\x7f]"
    rb"|[\xc2-\xdf][\x80-\xbf]"
    rb"|\xe0[\xa0-\xbf][\x80-\xbf]"
    rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}"
    rb"|\xed[\x80-\x9f][\x80-\xbf]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}"
    rb"|[\xf1-\xf3][\x80-\xbf]{3}"
    rb"|\xf4[\x80-\x8f][\x80-\xbf]{2})*").match
_CONTINUATION = bytes(range(0x80, 0xC0))


def _pattern_admits(pattern, value: str) -> bool:
    """Whether a string value holds a match of a node's pattern (an `Nfa` or a `regex` pattern)."""
    if not isinstance(pattern, Nfa):
        return pattern.search(value) is not None
    states = pattern.start
    for ch in value:
        states = pattern.step(states, ch)
        if not states:
            return False
    return pattern.matched(states)


def _escape_table():
    """Escape states inside a string: esc -> {next byte: next esc state}; 0 = not in an escape. After `\\u` the
    first two hex digits tell a surrogate: a high one (D800-DBFF) must be followed by `\\u` and a low one."""
    def any_hex(nxt):
        return {b: nxt for b in b"0123456789abcdefABCDEF"}

    return {
        1: {**{b: 0 for b in b'"\\/bfnrt'}, ord("u"): 14},
        14: {**any_hex(13), ord("d"): 23, ord("D"): 23},
        13: any_hex(12), 12: any_hex(11), 11: any_hex(0),
        23: {**{b: 12 for b in b"01234567"}, **{b: 32 for b in b"89abAB"}},
        32: any_hex(31), 31: any_hex(40),
        40: {_BACKSLASH: 41}, 41: {ord("u"): 42}, 42: {ord("d"): 43, ord("D"): 43},
        43: {b: 12 for b in b"cdefCDEF"},
    }


_ESCAPES = _escape_table()


def _lex_string(data: bytes, i: int, utf8: int, esc: int):
    """Read string bytes from data[i:] -> (j, utf8, esc, chars, closed): j is where reading stopped (just after the
    closing quote when closed), chars the code points started; j = -1 when a byte is not allowed."""
    n = len(data)
    chars = 0
    while i < n:
        if utf8:
            lo, hi, utf8 = UTF8_PENDING[utf8]
            if not lo <= data[i] <= hi:
                return -1, 0, 0, 0, False
            i += 1
            continue
        if esc:
            esc = _ESCAPES[esc].get(data[i], -1)
            if esc < 0:
                return -1, 0, 0, 0, False
            i += 1
            continue
        j = _PLAIN_RUN(data, i).end()
        if j > i:
            chunk = data[i:j]
            chars += j - i if chunk.isascii() else len(chunk.translate(None, _CONTINUATION))
            i = j
            if i == n:
                break
        b = data[i]
        i += 1
        if b == _QUOTE:
            return i, 0, 0, chars, True
        if b == _BACKSLASH:
            esc = 1
        else:
            utf8 = UTF8_LEAD[b]  # a control byte, a lone continuation byte or a bad lead byte gives 0
            if not utf8:
                return -1, 0, 0, 0, False
        chars += 1
    return i, utf8, esc, chars, False


def _held_ranges(held: bytes) -> tuple[tuple[int, int], ...] | None:
    """The code points of the string characters (UTF-8 characters, and escapes: what they stand for) that start
    with `held`, the first bytes of one, as one or two (lo, hi) ranges; None where `held` starts no character (or
    is one whole). An escape's hex digits give a range of UTF-16 units: those below or above the surrogates stand
    for themselves, high surrogates for the supplementary characters their pairs make (a low one alone is no
    character: `_ESCAPES` refuses it)."""
    if held[0] != _BACKSLASH:
        return (utf8_range(held),) if utf8_prefix(held) else None
    j, _, esc, _, _ = _lex_string(held, 0, 0, 0)
    if j != len(held) or not esc:
        return None
    if len(held) <= 2:  # `\` or `\u`: any character
        return ((0, 0x10FFFF),)
    if len(held) <= 6:  # `\u` and hex digits of the first unit (all four: a high surrogate, its pair to come)
        digits = held[2:]
        free = 4 * (4 - len(digits))
        lo = int(digits, 16) << free
        hi = lo | ((1 << free) - 1)
        out = [(a, b) for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)) if a <= b]
        a, b = max(lo, 0xD800), min(hi, 0xDBFF)
        if a <= b:
            out.append((0x10000 + ((a - 0xD800) << 10), 0x10000 + ((b - 0xD800) << 10) + 0x3FF))
        return tuple(out)
    base = 0x10000 + ((int(held[2:6], 16) - 0xD800) << 10)  # a high surrogate, then `\`, `\u`, low digits
    digits = held[8:]
    if not digits:
        return ((base, base + 0x3FF),)
    free = 4 * (4 - len(digits))
    lo = max(int(digits, 16) << free, 0xDC00)
    hi = min((int(digits, 16) << free) | ((1 << free) - 1), 0xDFFF)
    return ((base + lo - 0xDC00, base + hi - 0xDC00),)


def _number_tables():
    """Number phases: 0 after `-`, 1 after a leading `0`, 2 int digits, 3 after `.`, 4 fraction digits, 5 after
    e/E, 6 after the exponent sign, 7 exponent digits. table[phase][byte] -> next phase, -1 = not part of it."""
    def build(integer: bool):
        table = [[-1] * 256 for _ in range(8)]
        digits, nonzero = b"0123456789", b"123456789"
        table[0][ord("0")] = 1
        for b in nonzero:
            table[0][b] = 2
        for b in digits:
            table[2][b] = 2
        if not integer:
            for phase in (1, 2):
                table[phase][ord(".")] = 3
            for phase in (1, 2, 4):
                table[phase][ord("e")] = table[phase][ord("E")] = 5
            for b in digits:
                table[3][b] = table[4][b] = 4
                table[5][b] = table[6][b] = table[7][b] = 7
            table[5][ord("+")] = table[5][ord("-")] = 6
        return tuple(tuple(row) for row in table)
    return build(False), build(True)


_NUMBER_TABLE, _INTEGER_TABLE = _number_tables()
_NUMBER_DONE = frozenset({1, 2, 4, 7})  # phases where a number may end


def _compact(value, where: str) -> bytes:
    """The spelling an enum/const value must take: compact JSON, UTF-8."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"schema at {where}: {value!r} is not a JSON value ({e})") from None


def _canonical(value) -> str:
    """A key for JSON equality of enum/const values (object key order does not matter)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


# ---------------------------------------------------------------------------------------------------------------
# Compiled schema


class _Spellings:
    """Byte strings, sorted: those that start with a given prefix lie side by side, found by binary search (a table
    of every prefix would take memory quadratic in their lengths: gigabytes for a 100 KB enum string)."""

    __slots__ = ("sorted",)

    def __init__(self, spellings):
        self.sorted = sorted(set(spellings))

    def span(self, prefix: bytes) -> range:
        """The indices in `sorted` of the strings that start with `prefix`."""
        lo = bisect.bisect_left(self.sorted, prefix)
        end = prefix.rstrip(b"\xff")  # the least string past every one that starts with prefix: end, one up
        hi = len(self.sorted) if not end else bisect.bisect_left(self.sorted, end[:-1] + bytes((end[-1] + 1,)), lo)
        return range(lo, hi)

    def extends(self, prefix: bytes) -> bool:
        """Whether some string starts with `prefix`."""
        lo = bisect.bisect_left(self.sorted, prefix)
        return lo < len(self.sorted) and self.sorted[lo].startswith(prefix)


class _Literals:
    """A set of literal spellings being matched byte by byte: the whole ones (`values`), what they start with
    (`extends`), and the whole ones no other one extends (`final`: reading one of those ends the value at once; `1`
    among [1, 12] waits a byte)."""

    __slots__ = ("values", "extends", "final")

    def __init__(self, spellings):
        self.values = frozenset(spellings)
        ordered = _Spellings(self.values)
        self.extends = ordered.extends
        # a spelling another one extends comes right before one that extends it
        self.final = frozenset(s for s, t in zip(ordered.sorted, ordered.sorted[1:] + [b""]) if not t.startswith(s))


_TRUE, _FALSE, _NULL = _Literals([b"true"]), _Literals([b"false"]), _Literals([b"null"])


class _Object:
    """The object side of a schema: what keys may appear, what each key's value must be, when `}` may come."""

    __slots__ = ("pointer", "props", "forbidden", "required", "additional", "min_props", "max_props", "exact",
                 "key_limit", "key_full", "key_spellings")

    def __init__(self, pointer, props, forbidden, required, additional, min_props, max_props):
        self.pointer = pointer
        self.props = props                  # name -> node
        self.forbidden = forbidden          # names whose schema is false
        self.required = required            # frozenset of names
        self.additional = additional        # node for undeclared keys, None: not allowed
        self.min_props = min_props
        self.max_props = max_props          # None: no limit
        self.exact = additional is None     # keys must be declared names, spelled exactly
        limit = _NO_LIMIT if max_props is None else max_props
        self.key_limit = min(limit, len(props)) if self.exact else limit
        # Exact spellings of the names a key may have to match (declared ones, and required ones that fall to
        # additionalProperties): `"name"` -> name, and the spellings sorted, for the names a prefix may become.
        names = set(props) | (set(required) if additional is not None else set())
        self.key_full = {json.dumps(k, ensure_ascii=False).encode(): k for k in names}
        self.key_spellings = _Spellings(self.key_full)

    def names_from(self, prefix: bytes) -> frozenset:
        """The names whose spelling starts with `prefix`."""
        spellings = self.key_spellings.sorted
        return frozenset(self.key_full[spellings[k]] for k in self.key_spellings.span(prefix))

    def value_node(self, name):
        return self.props.get(name, self.additional)

    def only_required_left(self, seen) -> bool:
        """Whether maxProperties leaves room only for the required keys not yet seen."""
        return self.max_props is not None and len(seen) + 1 + len(self.required - seen) > self.max_props

    def may_become(self, names, seen) -> bool:
        """Whether a key that may still become one of `names` can lead somewhere, given the keys seen."""
        left = names - seen
        if not left:
            return False
        return not self.only_required_left(seen) or not left.isdisjoint(self.required)


class _Array:
    """The array side of a schema: the node of each item and how many items there may be."""

    __slots__ = ("pointer", "prefix", "items", "min_items", "max_items", "cap")

    def __init__(self, pointer, prefix, items, min_items, max_items):
        self.pointer = pointer
        self.prefix = prefix          # tuple of nodes for the first items
        self.items = items            # node for the items after them, None: no more
        self.min_items = min_items
        self.max_items = max_items    # None: no limit
        # Item counts above cap behave alike; capping them keeps states few (better memoization).
        self.cap = max_items if max_items is not None else max(len(prefix), min_items)

    def item(self, k: int):
        """The node of item k (0-based), None when the array may not have it."""
        if self.max_items is not None and k >= self.max_items:
            return None
        return self.prefix[k] if k < len(self.prefix) else self.items


class _Node:
    """One compiled subschema. A union (anyOf/oneOf) has `branches`; every node ends up with `basics`, the non-union
    nodes it stands for, and `starts`: first byte of a value -> the configuration heads it opens (a head plus the
    parent makes the configuration; a None head means that one byte was the whole value)."""

    __slots__ = ("pointer", "branches", "basics", "types", "literals", "string", "pattern", "obj", "arr", "starts")

    def __init__(self, pointer):
        self.pointer = pointer
        self.branches = None
        self.basics = None
        self.types = frozenset(_TYPES)
        self.literals = None   # enum/const: [(value, compact spelling)]
        self.string = None     # (min_len, max_len or None)
        self.pattern = None    # the string's `pattern`: an `Nfa`, or compiled by `regex` (syntax the Nfa lacks)
        self.obj = None
        self.arr = None
        self.starts = None

    def admits(self, value) -> bool:
        """Whether the Python value satisfies this schema's enforced keywords (used to filter enum values)."""
        return any(b.admits_basic(value, check_literals=True) for b in self.basics)

    def admits_basic(self, value, check_literals: bool) -> bool:
        """`admits` for this non-union node; check_literals=False skips its own enum/const (to filter them)."""
        if check_literals and self.literals is not None:
            key = _canonical(value)
            if not any(_canonical(v) == key for v, _ in self.literals):
                return False
        if value is None:
            return "null" in self.types
        if isinstance(value, bool):
            return "boolean" in self.types
        if isinstance(value, int):
            return "integer" in self.types or "number" in self.types
        if isinstance(value, float):
            return "number" in self.types
        if isinstance(value, str):
            return self.string is not None and self.string[0] <= len(value) and (
                self.string[1] is None or len(value) <= self.string[1]) and (
                self.pattern is None or _pattern_admits(self.pattern, value))
        if isinstance(value, list):
            arr = self.arr
            if arr is None or len(value) < arr.min_items:
                return False
            return all(arr.item(k) is not None and arr.item(k).admits(v) for k, v in enumerate(value))
        if isinstance(value, dict):
            obj = self.obj
            if obj is None or not obj.min_props <= len(value) <= (obj.max_props or _NO_LIMIT):
                return False
            if not obj.required <= value.keys():
                return False
            return all(k not in obj.forbidden and obj.value_node(k) is not None and obj.value_node(k).admits(v)
                       for k, v in value.items())
        return False

    def build_starts(self):
        """Fill `starts` for a non-union node from its literals or its types."""
        starts = {}

        def add(byte, head):
            starts.setdefault(byte, []).append(head)

        if self.literals is not None:
            info = _Literals([s for _, s in self.literals])
            for first in sorted({s[:1] for s in info.values}):
                add(first[0], None if first in info.final else (_LIT, info, first))
        else:
            if self.obj is not None:
                add(_LBRACE, (_OBJ, self.obj, _OBJ_OPEN, _EMPTY, 0, None))
            if self.arr is not None:
                add(_LBRACKET, (_ARR, self.arr, _ARR_OPEN, 0, 0))
            if self.string is not None and isinstance(self.pattern, Nfa) and self.string != (0, None):
                add(_QUOTE, (_LSTR, (self.pattern,) + self.string, self.pattern.start, 0))
            elif self.string is not None and isinstance(self.pattern, Nfa):
                add(_QUOTE, (_NSTR, self.pattern, self.pattern.start))
            elif self.string is not None and self.pattern is not None:
                add(_QUOTE, (_PSTR, self.pattern, ""))
            elif self.string is not None:
                add(_QUOTE, (_STR, self.string, 0, 0, 0))
            if "number" in self.types or "integer" in self.types:
                integer_only = "number" not in self.types
                add(ord("-"), (_NUM, integer_only, 0))
                add(ord("0"), (_NUM, integer_only, 1))
                for b in b"123456789":
                    add(b, (_NUM, integer_only, 2))
            if "boolean" in self.types:
                add(ord("t"), (_LIT, _TRUE, b"t"))
                add(ord("f"), (_LIT, _FALSE, b"f"))
            if "null" in self.types:
                add(ord("n"), (_LIT, _NULL, b"n"))
        self.starts = {b: tuple(heads) for b, heads in starts.items()}


def _escape_pointer(part) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def _strip(schema: dict) -> dict:
    """The schema without annotations and subschema containers (a fresh dict)."""
    return {k: v for k, v in schema.items() if k not in _ANNOTATIONS and k not in _CONTAINERS}


def _type_set(value, where: str) -> set:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(t, str) and t in _TYPES for t in names):
        raise ValueError(f"schema at {where}: 'type' must be one of {list(_TYPES)} or a non-empty list of them, "
                         f"got {value!r}")
    return set(names)


def _merge_types(a, b, where: str):
    """Both `type` keywords hold: their intersection (an integer is a number)."""
    sa, sb = _type_set(a, where), _type_set(b, where)
    both = (sa & sb) | ({"integer"} if ("integer" in sa and "number" in sb) or ("number" in sa and "integer" in sb)
                        else set())
    if not both:
        raise ValueError(f"schema at {where}: 'type' {a!r} and {b!r} have no type in common")
    return [t for t in _TYPES if t in both]


class _Compiler:
    """Turns a schema into a graph of `_Node`s (cycles allowed: `$ref` recursion), then checks and finishes it."""

    def __init__(self, root, strict: bool):
        self.root = root
        self.strict = strict
        self.memo = {}          # id(schema dict) -> node
        self.keep = []          # merged dicts, kept alive so their ids stay unique
        self.nodes = []         # every node made, for the finishing passes
        self.resolving = set()  # ids of pure-$ref schemas being resolved (a cycle of those has no value)
        self.patterns = False   # some string has a `pattern` left to the `regex` package (whole characters)
        self.any = self._any_node()

    def _any_node(self) -> _Node:
        node = _Node("#")
        node.string = (0, None)
        node.obj = _Object("#", {}, _EMPTY, _EMPTY, node, 0, None)
        node.arr = _Array("#", (), node, 0, None)
        self.nodes.append(node)
        return node

    def object_root(self) -> _Node:
        """Any JSON object (json_object mode)."""
        node = _Node("#")
        node.types = frozenset({"object"})
        node.obj = _Object("#", {}, _EMPTY, _EMPTY, self.any, 0, None)
        self.nodes.append(node)
        return node

    # -- references ------------------------------------------------------------------------------------------

    def resolve(self, ref, where: str):
        """The subschema a local `$ref` points to, and its pointer."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"schema at {where}: $ref {ref!r} is not supported (only local refs such as "
                             f"'#/$defs/NAME')")
        if ref in ("#", "#/"):
            return self.root, "#"
        if not ref.startswith("#/"):
            raise ValueError(f"schema at {where}: $ref {ref!r} is not supported (anchors are not)")
        target = self.root
        for part in ref[2:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise ValueError(f"schema at {where}: $ref {ref!r} not found")
        return target, ref

    def merge(self, a: dict, b: dict, where: str, keyword: str) -> dict:
        """Both schemas hold (their keywords side by side): `type` intersects, `required` unites, any other
        keyword given twice must be equal."""
        out = dict(a)
        for k, v in b.items():
            if k not in out or out[k] == v:
                out[k] = v
            elif k == "type":
                out[k] = _merge_types(out[k], v, where)
            elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
                out[k] = list(dict.fromkeys(out[k] + v))
            else:
                raise ValueError(f"schema at {where}: keyword {k!r} appears both beside and inside '{keyword}' "
                                 f"with different values; combining them is not supported")
        return out

    def normalize(self, schema: dict, where: str) -> dict:
        """The schema's keywords with one-subschema `allOf` and `$ref`-with-siblings folded in."""
        body = _strip(schema)
        for _ in range(64):
            if "allOf" in body:
                subs = body.pop("allOf")
                if not isinstance(subs, list) or len(subs) != 1:
                    count = len(subs) if isinstance(subs, list) else type(subs).__name__
                    raise ValueError(f"schema at {where}: 'allOf' with {count} subschemas is not supported "
                                     f"(only one)")
                sub = self.check_schema(subs[0], f"{where}/allOf/0")
                if sub is not True:
                    body = self.merge(body, _strip(sub), where, "allOf")
            elif "$ref" in body and len(body) > 1:
                target, _ = self.resolve(body.pop("$ref"), where)
                target = self.check_schema(target, where)
                if target is not True:
                    body = self.merge(body, _strip(target), where, "$ref")
            else:
                return body
        raise ValueError(f"schema at {where}: '$ref'/'allOf' beside other keywords nest too deep (a cycle?)")

    @staticmethod
    def check_schema(schema, where: str):
        """A subschema must be a dict or a boolean; False admits nothing, so it cannot be honoured here."""
        if schema is True or isinstance(schema, dict):
            return schema
        if schema is False:
            raise ValueError(f"schema at {where} is false: no value can satisfy it")
        raise ValueError(f"schema at {where} must be an object or a boolean, got {type(schema).__name__}")

    # -- compiling -------------------------------------------------------------------------------------------

    def compile(self, schema, where: str) -> _Node:
        schema = self.check_schema(schema, where)
        if schema is True:
            return self.any
        node = self.memo.get(id(schema))
        if node is not None:
            return node
        body = self.normalize(schema, where)
        if not body:
            node = self.any
        elif set(body) == {"$ref"}:
            if id(schema) in self.resolving:
                raise ValueError(f"schema at {where}: $ref {body['$ref']!r} refers back to itself through $refs "
                                 f"alone, so no value can satisfy it")
            self.resolving.add(id(schema))
            node = self.compile(*self.resolve(body["$ref"], where))
            self.resolving.discard(id(schema))
        else:
            node = _Node(where)
            self.memo[id(schema)] = node  # before filling: a recursive $ref finds it
            self.nodes.append(node)
            outer, self.resolving = self.resolving, set()
            if "anyOf" in body or "oneOf" in body:
                self.fill_union(node, body, where)
            else:
                self.fill_basic(node, body, where)
            self.resolving = outer
        self.memo[id(schema)] = node
        return node

    def fill_union(self, node: _Node, body: dict, where: str):
        """anyOf/oneOf: one branch per subschema, each with the sibling keywords folded in."""
        keyword = "anyOf" if "anyOf" in body else "oneOf"
        subs = body.pop(keyword)
        if not isinstance(subs, list) or not subs:
            raise ValueError(f"schema at {where}: '{keyword}' must be a non-empty list of schemas")
        branches = []
        for k, sub in enumerate(subs):
            sub_where = f"{where}/{keyword}/{k}"
            if sub is False:
                continue
            sub = {} if sub is True else self.check_schema(sub, sub_where)
            if body:  # the siblings hold in every branch
                sub = self.merge(body, _strip(sub), sub_where, keyword)
                self.keep.append(sub)
            branches.append(self.compile(sub, sub_where))
        if not branches:
            raise ValueError(f"schema at {where}: '{keyword}' has no satisfiable subschema")
        node.branches = branches

    def fill_basic(self, node: _Node, body: dict, where: str):
        for k in body:
            if k in _REFUSED:
                raise ValueError(f"schema at {where}: keyword {k!r} is not supported")
            if k not in _ENFORCED and k not in _UNENFORCED:
                raise ValueError(f"schema at {where}: unknown keyword {k!r}")
        types = _type_set(body["type"], where) if "type" in body else set(_TYPES)
        node.types = frozenset(types)
        if "enum" in body or "const" in body:
            node.literals = self.literals(body, where)
        if "string" in types:
            node.string = self.string_side(body, where)
            node.pattern = self.pattern(body, node.string, where)
        if "object" in types:
            strict = self.strict and ("properties" in body or "type" in body)
            node.obj = self.object_side(body, where, strict)
        if "array" in types:
            node.arr = self.array_side(body, where)

    def literals(self, body: dict, where: str):
        if "enum" in body:
            values = body["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"schema at {where}: 'enum' must be a non-empty list, got {values!r}")
            if "const" in body:
                key = _canonical(body["const"])
                values = [v for v in values if _canonical(v) == key]
                if not values:
                    raise ValueError(f"schema at {where}: 'const' is not among the 'enum' values")
        else:
            values = [body["const"]]
        out = {}
        for v in values:
            out.setdefault(_compact(v, where), v)
        return [(v, s) for s, v in out.items()]

    @staticmethod
    def count(body: dict, keyword: str, where: str, default):
        value = body.get(keyword, default)
        if value is not default and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"schema at {where}: '{keyword}' must be an int >= 0, got {value!r}")
        return value

    @staticmethod
    def check_range(lo: int, hi, lo_name: str, hi_name: str, where: str):
        if hi is not None and lo > hi:
            raise ValueError(f"schema at {where}: '{lo_name}' {lo} exceeds '{hi_name}' {hi}")

    def string_side(self, body: dict, where: str):
        lo = self.count(body, "minLength", where, 0)
        hi = self.count(body, "maxLength", where, None)
        self.check_range(lo, hi, "minLength", "maxLength", where)
        return (lo, hi)

    def pattern(self, body: dict, bounds, where: str):
        """A string's `pattern` as an automaton (`regex_nfa`, Python `re`'s meaning), or compiled by the `regex`
        package where it uses syntax the automaton lacks; the text must contain a match (JSON Schema's unanchored
        rule). With minLength / maxLength only the automaton enforces it (it knows how long a match can still
        take); a pattern it lacks stays unenforced there (None: a length bound could leave a started string no way
        to a match, which this matcher must never allow), as does one whose lengths it cannot tabulate."""
        if "pattern" not in body:
            return None
        source = body["pattern"]
        if not isinstance(source, str):
            raise ValueError(f"schema at {where}: 'pattern' must be a string, got {source!r}")
        nfa = compile_nfa(source, search=True)  # the common syntax, as an automaton
        if nfa is not None and not nfa.live(nfa.start):
            raise ValueError(f"schema at {where}: 'pattern' {source!r} matches no string")
        if nfa is not None and bounds != (0, None):
            lo, hi = bounds
            limit = nfa.length_limit()
            if hi is not None and limit is not None and hi >= limit:
                return None
            if not nfa.completes(nfa.start, lo, hi):
                raise ValueError(f"schema at {where}: 'pattern' {source!r} matches no string of {lo} to "
                                 f"{'any number of' if hi is None else hi} characters")
        if nfa is not None:
            return nfa
        compiled = self.regex_pattern(source, where)
        if compiled.search("", partial=True) is None:
            raise ValueError(f"schema at {where}: 'pattern' {source!r} matches no string")
        if bounds != (0, None):
            return None
        self.patterns = True
        return compiled

    @staticmethod
    def regex_pattern(source: str, where: str):
        """A `pattern` compiled by the `regex` package (syntax the automaton lacks); ValueError where it does not
        compile, or where its counted repeats would take `regex` long to write out (`regex_nfa.written_size`)."""
        if written_size(source) > MAX_WRITTEN:
            raise ValueError(f"schema at {where}: 'pattern' {source[:100]!r}: its counted repeats ({{m,n}}) write "
                             f"out more than {MAX_WRITTEN} items; expected smaller counts (or * and +)")
        try:
            import regex
        except ImportError:
            raise ValueError(f"schema at {where}: 'pattern' {source!r} needs the regex package (pip install regex, "
                             f"or the serve extra)") from None
        try:
            return regex.compile(source)
        except regex.error as e:
            raise ValueError(f"schema at {where}: 'pattern' {source!r} does not compile: {e}") from None

    def object_side(self, body: dict, where: str, strict: bool) -> _Object:
        declared = body.get("properties", {})
        if not isinstance(declared, dict):
            raise ValueError(f"schema at {where}: 'properties' must be an object, got {type(declared).__name__}")
        props, forbidden = {}, set()
        for name, sub in declared.items():
            if sub is False:
                forbidden.add(name)
            else:
                props[name] = self.compile(sub, f"{where}/properties/{_escape_pointer(name)}")
        required = body.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError(f"schema at {where}: 'required' must be a list of strings, got {required!r}")
        if "additionalProperties" not in body:
            additional = None if strict else self.any
        elif body["additionalProperties"] is False:
            additional = None
        else:
            additional = self.compile(body["additionalProperties"], f"{where}/additionalProperties")
        for name in required:
            if name in forbidden:
                raise ValueError(f"schema at {where}: 'required' names {name!r}, whose schema is false")
            if name not in props and additional is None:
                raise ValueError(f"schema at {where}: 'required' names {name!r}, which is not in 'properties' "
                                 f"and additional properties are not allowed")
        lo = self.count(body, "minProperties", where, 0)
        hi = self.count(body, "maxProperties", where, None)
        self.check_range(lo, hi, "minProperties", "maxProperties", where)
        if hi is not None and len(set(required)) > hi:
            raise ValueError(f"schema at {where}: 'required' names {len(set(required))} keys but 'maxProperties' "
                             f"is {hi}")
        return _Object(where, props, frozenset(forbidden), frozenset(required), additional, lo, hi)

    def array_side(self, body: dict, where: str) -> _Array:
        lo = self.count(body, "minItems", where, 0)
        hi = self.count(body, "maxItems", where, None)
        self.check_range(lo, hi, "minItems", "maxItems", where)
        first = body.get("prefixItems", [])
        if not isinstance(first, list):
            raise ValueError(f"schema at {where}: 'prefixItems' must be a list of schemas")
        prefix = []
        for k, sub in enumerate(first):
            if sub is False:  # no item k: the array stops before it
                hi = k if hi is None else min(hi, k)
                break
            prefix.append(self.compile(sub, f"{where}/prefixItems/{k}"))
        items = body.get("items", True)
        if isinstance(items, list):
            raise ValueError(f"schema at {where}: 'items' as a list is not supported (use 'prefixItems')")
        items = None if items is False else self.compile(items, f"{where}/items")
        most = hi if items is not None else min(len(prefix), _NO_LIMIT if hi is None else hi)
        if most is not None and lo > most:
            raise ValueError(f"schema at {where}: 'minItems' {lo} exceeds the {most} items the array may hold")
        return _Array(where, tuple(prefix), items, lo, hi)

    # -- finishing -------------------------------------------------------------------------------------------

    def finish(self, root: _Node):
        """Flatten unions, filter enum values by their sibling keywords, check every value can end, fill starts."""
        for node in self.nodes:
            self.flatten(node)
        for node in self.nodes:
            if node.literals is not None:
                kept = [(v, s) for v, s in node.literals if node.admits_basic(v, check_literals=False)]
                if not kept:
                    raise ValueError(f"schema at {node.pointer}: no 'enum'/'const' value satisfies the other "
                                     f"keywords")
                node.literals = kept
        self.check_finite(root)
        for node in self.nodes:
            if node.branches is None:
                node.build_starts()
        for node in self.nodes:
            if node.branches is not None:
                merged = {}
                for basic in node.basics:
                    for b, heads in basic.starts.items():
                        merged.setdefault(b, {}).update(dict.fromkeys(heads))
                node.starts = {b: tuple(heads) for b, heads in merged.items()}

    @staticmethod
    def flatten(node: _Node):
        """Set `basics`: the non-union nodes a union stands for, through nested and recursive unions."""
        if node.branches is None:
            node.basics = (node,)
            return
        found, seen, todo = {}, {node}, list(node.branches)
        while todo:
            n = todo.pop(0)
            if n in seen:
                continue
            seen.add(n)
            if n.branches is None:
                found[n] = None
            else:
                todo.extend(n.branches)
        if not found:
            raise ValueError(f"schema at {node.pointer}: 'anyOf'/'oneOf' refers only to itself, so no value can "
                             f"satisfy it")
        node.basics = tuple(found)

    def check_finite(self, root: _Node):
        """Refuse schemas where a reachable kind of value can never be finished (e.g. an object that requires a
        property of its own type): a decoder could start such a value and then never end the document."""
        finishable = set()  # basic nodes with some finite value

        def can_end(node):
            return any(b in finishable for b in node.basics)

        def side_ends(basic, side):
            if side == "object":
                obj = basic.obj
                if not all(can_end(obj.value_node(r)) for r in obj.required):
                    return False
                optional = sum(1 for k, n in obj.props.items() if k not in obj.required and can_end(n))
                unlimited = not obj.exact and can_end(obj.additional)
                return unlimited or len(obj.required) + optional >= obj.min_props
            if side == "array":  # the items a shortest array needs: those past the prefix share one node
                arr = basic.arr
                return all(can_end(arr.item(k)) for k in range(min(arr.min_items, len(arr.prefix) + 1)))
            return True

        def sides(basic):
            return ["literal"] if basic.literals is not None else sorted(basic.types)

        basics = [n for n in self.nodes if n.branches is None]
        changed = True
        while changed:
            changed = False
            for b in basics:
                if b not in finishable and any(side_ends(b, s) for s in sides(b)):
                    finishable.add(b)
                    changed = True
        seen, todo = set(), [root]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.branches is not None:
                todo.extend(node.branches)
                continue
            for side in sides(node):
                if not side_ends(node, side):
                    raise ValueError(f"schema at {node.pointer}: no finite {side} satisfies it (a required "
                                     f"property or minItems recurses forever)")
            if node.literals is None and node.obj is not None:
                todo.extend(node.obj.props.values())
                if node.obj.additional is not None:
                    todo.append(node.obj.additional)
            if node.literals is None and node.arr is not None:
                todo.extend(node.arr.prefix)
                if node.arr.items is not None:
                    todo.append(node.arr.items)

    # -- validating -----------------------------------------------------------------------------------------

    def validate(self, schema, where: str):
        """`validate_schema`: the checks `compile` makes of what its keywords hold, over every subschema it would
        read (and the targets of local `$ref`s), without its refusals of what it cannot honour."""
        seen, todo = set(), [(schema, where)]
        while todo:
            sub, where = todo.pop()
            if isinstance(sub, bool) or id(sub) in seen:
                continue
            if not isinstance(sub, dict):
                raise ValueError(f"schema at {where} must be an object or a boolean, got {type(sub).__name__}")
            seen.add(id(sub))
            todo += self.validate_keywords(sub, where)

    def validate_keywords(self, body: dict, where: str) -> list:
        """One subschema's keywords checked as `compile` checks them -> its subschemas, (schema, pointer). As there,
        a string's, an object's or an array's keywords count only where `type` allows that type (a draft-3
        `"required": true` inside a string property is not read)."""
        types = _type_set(body["type"], where) if "type" in body else set(_TYPES)
        if "enum" in body and (not isinstance(body["enum"], list) or not body["enum"]):
            raise ValueError(f"schema at {where}: 'enum' must be a non-empty list, got {body['enum']!r}")
        subs = []
        if "string" in types:
            self.string_side(body, where)
            if "pattern" in body:
                source = body["pattern"]
                if not isinstance(source, str):
                    raise ValueError(f"schema at {where}: 'pattern' must be a string, got {source!r}")
                try:
                    re.compile(source)  # (no counted repeat written out)
                except (re.error, OverflowError, RecursionError):
                    self.regex_pattern(source, where)  # syntax of the `regex` package's own, or an error
        if "object" in types:
            declared = body.get("properties", {})
            if not isinstance(declared, dict):
                raise ValueError(f"schema at {where}: 'properties' must be an object, got "
                                 f"{type(declared).__name__}")
            subs += [(sub, f"{where}/properties/{_escape_pointer(name)}") for name, sub in declared.items()]
            required = body.get("required", [])
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise ValueError(f"schema at {where}: 'required' must be a list of strings, got {required!r}")
            lo, hi = self.count(body, "minProperties", where, 0), self.count(body, "maxProperties", where, None)
            self.check_range(lo, hi, "minProperties", "maxProperties", where)
            if "additionalProperties" in body:
                subs.append((body["additionalProperties"], f"{where}/additionalProperties"))
        listed = {k: body[k] for k in ("anyOf", "oneOf", "allOf") if k in body}
        if "array" in types:
            lo, hi = self.count(body, "minItems", where, 0), self.count(body, "maxItems", where, None)
            self.check_range(lo, hi, "minItems", "maxItems", where)
            listed.update((k, body[k]) for k in ("prefixItems", "items") if k in body)
            if isinstance(listed.get("items", []), list):  # (a list: older drafts' form, valid if not read)
                subs += [(sub, f"{where}/items/{k}") for k, sub in enumerate(listed.pop("items", []))]
            else:
                subs.append((listed.pop("items"), f"{where}/items"))
        for keyword, schemas in listed.items():
            if not isinstance(schemas, list) or (not schemas and keyword != "prefixItems"):
                kind = "list" if keyword == "prefixItems" else "non-empty list"
                raise ValueError(f"schema at {where}: '{keyword}' must be a {kind} of schemas, got {schemas!r}")
            subs += [(sub, f"{where}/{keyword}/{k}") for k, sub in enumerate(schemas)]
        if "$ref" in body:
            ref = body["$ref"]
            if not isinstance(ref, str):
                raise ValueError(f"schema at {where}: $ref must be a string, got {ref!r}")
            if ref == "#" or ref.startswith("#/"):  # (other refs, not local ones, are not followed)
                subs.append(self.resolve(ref, where))
        return subs


def validate_schema(schema, *, root=None) -> None:
    """Raises ValueError, naming the JSON pointer of the subschema and the keyword, where `schema` is not a valid
    JSON Schema in what `compile_schema` reads: a subschema that is neither an object nor a boolean, a `type` that
    names no type, an `enum` that is not a non-empty list, counts (`minItems`, `maxLength`, ...) that are not ints
    >= 0 or whose minimum exceeds their maximum, a `pattern` that does not compile, `properties` / `required` /
    `prefixItems` / `anyOf` / `oneOf` / `allOf` of the wrong kind, a local `$ref` that points nowhere: the checks
    `compile_schema` makes too, so a schema it refuses as malformed is refused here. What it refuses for want of
    support (keywords it lacks, unknown keywords, an `allOf` of several subschemas, `items` as a list, refs to
    other documents) passes, as do schemas that no value satisfies. As there, a string's, an object's or an array's
    keywords are read only where `type` allows that type (draft 3's `"required": true` inside a string property
    passes). root: the document local `$ref`s point into (default: the schema itself)."""
    _Compiler(schema if root is None else root, strict=False).validate(schema, "#")


def compile_schema(schema, *, strict: bool = False, max_whitespace: int = 20, root=None) -> "JsonGrammar":
    """Compile a JSON Schema into a byte-level matcher.

    schema: a JSON Schema dict, or True / {} for any JSON value, or None for any JSON object (OpenAI json_object
    mode). strict: OpenAI `strict: true` (see the module docstring). max_whitespace: the longest whitespace run
    allowed between tokens, before the value and after it. root: the document local `$ref`s point into (default:
    the schema itself; a tool's parameters for one parameter's schema). Raises ValueError naming the JSON pointer
    of the subschema and the keyword when the schema cannot be honoured.
    """
    if not isinstance(max_whitespace, int) or isinstance(max_whitespace, bool) or max_whitespace < 0:
        raise ValueError(f"max_whitespace must be an int >= 0, got {max_whitespace!r}")
    compiler = _Compiler(schema if root is None else root, bool(strict))
    if schema is None:
        node = compiler.object_root()
    else:
        compiler.validate(schema, "#")  # malformed first, as `validate_schema` (a tool's parameters) says it
        node = compiler.compile(schema, "#")
    compiler.finish(node)
    return JsonGrammar(node, max_whitespace, compiler.patterns)


class JsonGrammar:
    """A compiled schema: feed bytes to `advance` from `start`. States are hashable; see the module docstring."""

    def __init__(self, root: _Node, max_whitespace: int, patterns: bool = False):
        """patterns: some string's `pattern` is left to the `regex` package (its text grows by whole
        characters)."""
        self._root = root
        self._max_ws = max_whitespace
        self.start = (_VAL, root, 0, (_END, 0))
        self._steps = (self._value, self._string, self._number, self._literal, self._object, self._array,
                       self._exact_key, self._any_key, self._end, self._pattern_string, self._nfa_string,
                       self._bounded_nfa_string, self._held_string)
        if patterns:  # where a walk over tokens must step by whole characters (`whole_characters_at`)
            self.whole_characters_at = self._in_pattern

    # -- public ----------------------------------------------------------------------------------------------

    def advance(self, state, data: bytes):
        """The state after `data` (bytes) from `state`, or None when no valid document continues that way."""
        out = []
        if type(state) is frozenset:
            for config in state:
                self._run(config, data, 0, out)
        else:
            self._run(state, data, 0, out)
        if len(out) == 1:
            return out[0]
        if not out:
            return None
        states = frozenset(out)
        return states if len(states) > 1 else out[0]

    def complete(self, state) -> bool:
        """Whether the bytes read so far form a whole valid document."""
        for config in state if type(state) is frozenset else (state,):
            kind = config[0]
            if kind == _END:
                return True
            if kind == _NUM and config[2] in _NUMBER_DONE and config[3][0] == _END:
                return True
            if kind == _LIT and config[2] in config[1].values and config[3][0] == _END:
                return True
        return False

    def can_continue(self, state) -> bool:
        """Whether some byte may still follow (False: the document is complete and nothing more fits)."""
        for config in state if type(state) is frozenset else (state,):
            if config[0] != _END or config[1] < self._max_ws:
                return True
        return False

    def takes_plain_text(self, state) -> bool:
        """Whether every run of plain string text (`is_plain_text`) may follow `state`: it is inside a string value
        without a length limit, or inside a key that may be any string, between characters (not in an escape or a
        multi-byte character). A decoder may then accept such tokens without advancing over each."""
        if type(state) is frozenset:
            return False
        kind = state[0]
        if kind == _STR:
            return state[1][1] is None and state[3] == 0 and state[4] == 0
        return kind == _KEYA and state[3] == 0 and state[4] == 0

    def quote_free_twin(self, state):
        """A state that accepts exactly the byte strings without a `"` that `state` accepts, shared by every string
        value (or any-string key) in the same lexing position: inside one, what lies outside the string (the keys
        read so far, the parents) matters only once a `"` closes it. None where no such twin is known (outside
        strings; several configurations at once)."""
        if type(state) is frozenset:
            return None
        kind = state[0]
        if kind == _STR:
            return state[:5] + (None,)
        if kind == _KEYA:
            return (_KEYA, None, b'"', state[3], state[4], _EMPTY, None)
        return None

    def length_twin(self, state):
        """(twin, room) for a bounded pattern string (`_LSTR`) past its minimum: every token of at most `room`
        bytes is accepted from `state` exactly when it is from `twin`, a state shared by all such positions (no
        such token reaches either bound, and whether a match can still end the string within the maximum is
        whether one can end it at all: the lengths a match can take repeat below the automaton's horizon, so
        room = maximum - count - horizon). None elsewhere (room < 0 included)."""
        if type(state) is not tuple or state[0] != _LSTR:
            return None
        _, (nfa, lo, hi), states, count, parent = state
        if hi is None or count < lo:
            return None
        horizon = nfa.length_horizon()
        if horizon is None or hi - count < horizon:
            return None
        return (_LSTR, (nfa, lo, None), states, lo, parent), hi - count - horizon

    def quote_close(self, state):
        """(after, tails) for a string value without a length limit or an any-string key, between characters: for
        every plain text A (`is_plain_text`) whose bytes are not in `tails` and every B without a `"`,
        `advance(state, A + b'"' + B)` is None exactly when `advance(after, B)` is (after None: it always is).
        Tokens written A `"` B then share one check of B for every string (or key) closing into `after`. A key
        closed by A is read as a name, and `tails` are the A that make a name this rule cannot stand for (one seen
        already, forbidden, declared, or required); their tokens are checked on their own. None where no such rule
        is known (see `quote_free_twin`; also where a length limit or minimum counts A's characters)."""
        if type(state) is frozenset:
            return None
        kind = state[0]
        if kind == _STR:
            _, (lo, hi), count, utf8, esc, parent = state
            if hi is not None or count < lo or utf8 or esc:
                return None
            return parent, frozenset()
        if kind != _KEYA or state[3] or state[4]:
            return None
        _, obj, raw, _, _, seen, parent = state
        text = json.loads(raw + b'"') if b"\\" in raw else raw[1:].decode()
        special = set(seen) | set(obj.forbidden) | set(obj.props) | set(obj.required)
        tails = frozenset(name[len(text):].encode() for name in special if name.startswith(text))
        stand_in = "\x00"  # any name outside `special` stands for them all
        while stand_in in special:
            stand_in += "\x00"
        return self._key_read(obj, stand_in, seen, parent), tails

    @staticmethod
    def _in_pattern(state) -> bool:
        """Whether `state` is inside a string whose pattern the `regex` package searches, whose states lie between
        whole characters (an escape is one): a token that ends inside one is refused there."""
        return type(state) is tuple and state[0] == _PSTR

    @staticmethod
    def character_length(data: bytes, i: int) -> int:
        """Bytes of the string character at data[i] (a UTF-8 character, or an escape: `\\x`, `\\uXXXX`, a
        surrogate pair as one); 0 when data ends inside it. An invalid byte counts as one (it is refused)."""
        if data[i] != _BACKSLASH:
            return utf8_length(data, i)
        if i + 1 >= len(data):
            return 0
        if data[i + 1] != ord("u"):
            return 2
        if i + 6 > len(data):
            return 0
        high = data[i + 2:i + 4].lower() in (b"d8", b"d9", b"da", b"db")
        return (12 if i + 12 <= len(data) else 0) if high else 6

    @staticmethod
    def is_plain_text(data: bytes) -> bool:
        """Whether `data` is plain string text: printable ASCII other than `"` and `\\`, and whole UTF-8
        characters."""
        return _PLAIN_RUN(data).end() == len(data)

    # -- driving ---------------------------------------------------------------------------------------------

    def _run(self, config, data: bytes, i: int, out: list):
        """Feed data[i:] to one configuration; append what it becomes (several where it forks) to out."""
        n = len(data)
        steps = self._steps
        while i < n:
            config, i = steps[config[0]](config, data, i)
            if config is None:
                return
            if type(config) is list:
                for alternative in config:
                    self._run(alternative, data, i, out)
                return
        out.append(config)

    def _blanks(self, data: bytes, i: int, ws: int):
        """Skip the whitespace at data[i:] -> (j, ws) with ws the run length so far; j = -1 past the limit."""
        j = _WS_RUN(data, i).end()
        ws += j - i
        return (-1 if ws > self._max_ws else j), ws

    # Each step reads from data[i] (i < len(data)) and returns (configuration, j): the next configuration and
    # where reading goes on, (None, i) to reject, or (list of configurations, j) to fork.

    def _value(self, config, data, i):
        _, node, ws, parent = config
        b = data[i]
        if _IS_WS[b]:
            i, ws = self._blanks(data, i, ws)
            if i < 0:
                return None, 0
            if i == len(data):
                return (_VAL, node, ws, parent), i
            b = data[i]
        heads = node.starts.get(b)
        if heads is None:
            return None, i
        if len(heads) == 1:
            head = heads[0]
            return (parent if head is None else head + (parent,)), i + 1
        return [parent if head is None else head + (parent,) for head in heads], i + 1

    def _string(self, config, data, i):
        _, bounds, count, utf8, esc, parent = config
        j, utf8, esc, chars, closed = _lex_string(data, i, utf8, esc)
        if j < 0:
            return None, i
        if chars:
            lo, hi = bounds
            count += chars
            if hi is not None:
                if count > hi:
                    return None, i
            elif count > lo:
                count = lo
        if closed:
            return (parent if count >= bounds[0] else None), j
        return (_STR, bounds, count, utf8, esc, parent), j

    @staticmethod
    def _nfa_string(config, data, i):
        """`_pattern_string` with the pattern as an automaton: the state set moves a character at a time."""
        _, nfa, states, parent = config
        n = len(data)
        while i < n:
            if data[i] == _QUOTE:
                return (parent if nfa.matched(states) else None), i + 1
            k, char = JsonGrammar._string_character(data, i)
            if k == 0:  # the data ends inside a character (or the character is not valid)
                return JsonGrammar._held_character(nfa, states, 0, data[i:], parent), n
            states = nfa.step(states, char)
            if not nfa.live(states):
                return None, i
            i += k
        return (_NSTR, nfa, states, parent), i

    @staticmethod
    def _bounded_nfa_string(config, data, i):
        """`_nfa_string` with minLength / maxLength: a character is taken only while some match can still end
        the string within the bounds (`Nfa.completes`), and the closing quote needs a match of at least the
        minimum."""
        _, spec, states, count, parent = config
        nfa, lo, hi = spec
        n = len(data)
        while i < n:
            if data[i] == _QUOTE:
                return (parent if count >= lo and nfa.matched(states) else None), i + 1
            k, char = JsonGrammar._string_character(data, i)
            if k == 0:  # the data ends inside a character (or the character is not valid)
                return JsonGrammar._held_character(spec, states, count, data[i:], parent), n
            states = nfa.step(states, char)
            count += 1
            if hi is None and count >= lo:  # past the minimum only "some match ahead" matters
                count = lo
                if not nfa.live(states):
                    return None, i
            elif (hi is not None and count > hi) or not nfa.completes(states, lo - count,
                                                                     None if hi is None else hi - count):
                return None, i
            i += k
        return (_LSTR, spec, states, count, parent), i

    @staticmethod
    def _held_character(spec, states, count, held, parent):
        """The configuration (`_HSTR`) inside a character of an automaton's pattern string (`spec`: the _NSTR's
        automaton, or the _LSTR's (nfa, min_len, max_len) with `count` characters before it) whose first bytes
        `held` are; None where no character that starts with them could come: they start none (invalid, or more
        than a character), or no character of their ranges keeps a match possible (within the length bounds,
        the character counted)."""
        ranges = _held_ranges(held)
        if ranges is None:
            return None
        nfa = spec if type(spec) is Nfa else spec[0]
        after = nfa.step_range(states, *ranges[0])
        for lo, hi in ranges[1:]:
            after = after | nfa.step_range(states, lo, hi)
        if type(spec) is Nfa:
            ok = nfa.live(after)
        else:  # as `_bounded_nfa_string` takes a character (both ask whether SOME state of the set goes on)
            _, lo, hi = spec
            more = count + 1
            if hi is None and more >= lo:
                ok = nfa.live(after)
            else:
                ok = not (hi is not None and more > hi) and nfa.completes(after, lo - more,
                                                                          None if hi is None else hi - more)
        return (_HSTR, spec, states, count, held, parent) if ok else None

    def _held_string(self, config, data, i):
        """Inside a pattern string's character (`_HSTR`): its held first bytes and the data read on as its string
        reads them (the character taken once whole, or held further)."""
        _, spec, states, count, held, parent = config
        if type(spec) is Nfa:
            config, j = self._nfa_string((_NSTR, spec, states, parent), held + data[i:], 0)
        else:
            config, j = self._bounded_nfa_string((_LSTR, spec, states, count, parent), held + data[i:], 0)
        return config, i + j - len(held)

    @staticmethod
    def _string_character(data, i) -> tuple[int, str]:
        """(bytes, text) of the string character (a UTF-8 character or an escape) at data[i] (not the closing
        quote); (0, "") when it is not a whole, valid one."""
        b = data[i]
        if 0x20 <= b < 0x7F and b != _BACKSLASH:  # printable ASCII: the common case, no lexing needed
            return 1, chr(b)
        k = JsonGrammar.character_length(data, i)
        if k == 0:
            return 0, ""
        j, utf8, esc, _, closed = _lex_string(data[i:i + k], 0, 0, 0)
        if j != k or utf8 or esc or closed:
            return 0, ""
        raw = data[i:i + k]
        return k, (json.loads(b'"' + raw + b'"') if raw[0] == _BACKSLASH else raw.decode())

    @staticmethod
    def _pattern_string(config, data, i):
        """A string with a pattern: its text grows by whole characters (escapes decoded), each time some extension
        must still contain a match (partial search); the closing quote needs a match. Data that ends inside a
        character (or an escape) is refused."""
        _, pattern, text, parent = config
        n = len(data)
        while i < n:
            if data[i] == _QUOTE:
                return (parent if pattern.search(text) is not None else None), i + 1
            k, char = JsonGrammar._string_character(data, i)
            if k == 0:
                return None, i
            text += char
            if pattern.search(text, partial=True) is None:
                return None, i
            i += k
        return (_PSTR, pattern, text, parent), i

    def _number(self, config, data, i):
        _, integer_only, phase, parent = config
        table = _INTEGER_TABLE if integer_only else _NUMBER_TABLE
        n = len(data)
        while i < n:
            nxt = table[phase][data[i]]
            if nxt < 0:  # the number ends here, if it may; the byte goes to the parent
                return (parent if phase in _NUMBER_DONE else None), i
            phase = nxt
            i += 1
        return (_NUM, integer_only, phase, parent), i

    def _literal(self, config, data, i):
        _, info, prefix, parent = config
        whole = prefix + data[i:]
        if info.extends(whole):
            return (parent if whole in info.final else (_LIT, info, whole, parent)), len(data)
        n = len(data)
        while i < n:
            p = prefix + data[i:i + 1]
            if not info.extends(p):
                return (parent if prefix in info.values else None), i
            prefix = p
            i += 1
            if p in info.final:
                return parent, i
        return (_LIT, info, prefix, parent), i

    def _object(self, config, data, i):
        _, obj, phase, seen, ws, value_node, parent = config
        b = data[i]
        if _IS_WS[b]:
            i, ws = self._blanks(data, i, ws)
            if i < 0:
                return None, 0
            if i == len(data):
                return (_OBJ, obj, phase, seen, ws, value_node, parent), i
            b = data[i]
        if phase == _OBJ_VALUE:
            if b == _COMMA:
                if len(seen) < obj.key_limit:
                    return (_OBJ, obj, _OBJ_COMMA, seen, 0, None, parent), i + 1
            elif b == _RBRACE:
                if len(seen) >= obj.min_props and obj.required <= seen:
                    return parent, i + 1
            return None, i
        if phase == _OBJ_KEY:
            if b == _COLON:
                return (_VAL, value_node, 0, (_OBJ, obj, _OBJ_VALUE, seen, 0, None, parent)), i + 1
            return None, i
        if b == _QUOTE and len(seen) < obj.key_limit:
            if obj.exact or obj.only_required_left(seen):
                return (_KEYX, obj, b'"', seen, parent), i + 1
            return (_KEYA, obj, b'"', 0, 0, seen, parent), i + 1
        if b == _RBRACE and phase == _OBJ_OPEN and obj.min_props == 0 and not obj.required:
            return parent, i + 1
        return None, i

    @staticmethod
    def _key_read(obj: _Object, name: str, seen, parent):
        """The configuration after a whole key: wait for `:`, then a value of the key's schema."""
        if name in seen or name in obj.forbidden:
            return None
        seen = seen.union((name,))
        if obj.max_props is not None and len(seen) + len(obj.required - seen) > obj.max_props:
            return None
        node = obj.value_node(name)
        if node is None:
            return None
        return (_OBJ, obj, _OBJ_KEY, seen, 0, node, parent)

    def _exact_key(self, config, data, i):
        _, obj, prefix, seen, parent = config
        quote = data.find(b'"', i)
        if quote >= 0:  # the likely end of the key: try it whole
            name = obj.key_full.get(prefix + data[i:quote + 1])
            if name is not None:
                return self._key_read(obj, name, seen, parent), quote + 1
        n = len(data)
        check_seen = bool(seen) or obj.max_props is not None
        while i < n:
            p = prefix + data[i:i + 1]
            if not (obj.may_become(obj.names_from(p), seen) if check_seen else obj.key_spellings.extends(p)):
                return None, i
            prefix = p
            i += 1
            name = obj.key_full.get(p)
            if name is not None:
                return self._key_read(obj, name, seen, parent), i
        return (_KEYX, obj, prefix, seen, parent), i

    def _any_key(self, config, data, i):
        _, obj, raw, utf8, esc, seen, parent = config
        j, utf8, esc, _, closed = _lex_string(data, i, utf8, esc)
        if j < 0:
            return None, i
        raw += data[i:j]
        if not closed:
            return (_KEYA, obj, raw, utf8, esc, seen, parent), j
        name = json.loads(raw) if b"\\" in raw else raw[1:-1].decode()
        return self._key_read(obj, name, seen, parent), j

    def _array(self, config, data, i):
        _, arr, phase, count, ws, parent = config
        b = data[i]
        if _IS_WS[b]:
            i, ws = self._blanks(data, i, ws)
            if i < 0:
                return None, 0
            if i == len(data):
                return (_ARR, arr, phase, count, ws, parent), i
            b = data[i]
        if b == _RBRACKET:
            return (parent if count >= arr.min_items else None), i + 1
        if phase == _ARR_OPEN:  # the first item starts here: hand the byte (and the blanks so far) to it
            node = arr.item(0)
            if node is None:
                return None, i
            return (_VAL, node, ws, (_ARR, arr, _ARR_VALUE, min(1, arr.cap), 0, parent)), i
        if b == _COMMA:
            node = arr.item(count)
            if node is None:
                return None, i
            return (_VAL, node, 0, (_ARR, arr, _ARR_VALUE, min(count + 1, arr.cap), 0, parent)), i + 1
        return None, i

    def _end(self, config, data, i):
        j, ws = self._blanks(data, i, config[1])
        if j != len(data):
            return None, i
        return (_END, ws), j
