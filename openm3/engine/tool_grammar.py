"""A byte grammar for M3's tool-call markup, for forced tool calls (OpenAI's `tool_choice: "required"` or a named
function, Anthropic's `any` / `tool`): the answer is one tool-call block as `openm3.data.chat.render_tool_calls`
writes it,

    <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n...</invoke>\\n</minimax:tool_call>

with NAME one of the allowed tools, KEY one of that tool's declared parameters (each at most once, the required
ones all present before `</invoke>`; any name when the tool has no `properties`), and VALUE, as `render_tool_calls`
writes it: one of the strings of an enum of strings, JSON that follows the parameter's schema for a single
non-string type or an enum of other values (`json_grammar`), else raw UTF-8 text that does not contain
`</parameter>` (strings, within their `minLength` / `maxLength` in characters; schemas of several types, schemas
the matcher cannot compile). A tool's parameters must be a valid JSON Schema, as a `response_format` schema must
(`json_grammar.validate_schema`: a ValueError naming the tool and the keyword); only keywords the matcher lacks
leave a value raw text. A tool may name a text grammar for one of its parameters (`"text_grammar":
{"parameter": KEY, "syntax": "lark" | "regex", "definition": ...}`: OpenAI's custom tools with a grammar format,
whose free-form input is that parameter); its VALUE is then a sentence of that grammar (`cfg_grammar` /
`regex_grammar`) without `</parameter>` in it. A token may end inside one of its characters (the grammar holds
the character's first bytes and takes them when some character that starts with them may come), except under a
regex left to the `regex` package, which takes whole characters only (`whole_characters_at`).
`<minimax:tool_call>` and `</minimax:tool_call>` are special tokens: the grammar reads them as the marker bytes
`START` and `END`, which `TokenBytes.from_tokenizer(..., markers=)` gives them (bytes 0xF8-0xFF never occur in
UTF-8 text, and `TokenBytes` leaves the byte tokens that hold them out of every grammar).

States are hashable tuples; `advance` reads byte by byte (tool calls are short next to the strings JSON allows).
"""

from __future__ import annotations

from typing import Sequence

from .cfg_grammar import CfgGrammar
from .constrained import ChoiceGrammar
from .json_grammar import compile_schema, validate_schema
from .regex_grammar import RegexGrammar
from .utf8 import UTF8_LEAD, UTF8_PENDING, utf8_length

START, END = b"\xff\x01", b"\xff\x02"
_END_TAG = b"</parameter>"
_NAME_BYTES = frozenset(range(0x20, 0x7F)) - frozenset(b'"<>')


class _Tool:
    """One tool: its parameters (a JSON Schema of an object, None: any) must be a valid schema (`validate_schema`,
    the checks a `response_format` schema gets; ValueError naming the tool, the field that holds its parameters,
    `field`, and the keyword); a parameter whose schema is false may not be given."""

    def __init__(self, name: str, parameters: dict | None, text_grammar: dict | None = None,
                 field: str = "parameters"):
        self.name = name
        try:
            validate_schema(True if parameters is None else parameters)
        except ValueError as e:
            raise ValueError(f"tools: the {field} of tool {name!r}: {e}") from None
        parameters = parameters if isinstance(parameters, dict) else {}
        # (checked where `type` allows an object, as a response_format's schema is; read as an object's here)
        props, required = parameters.get("properties"), parameters.get("required", [])
        props = props if isinstance(props, dict) else None
        required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
        self.free = props is None  # no `properties`: any parameter names
        self.props = {key: schema for key, schema in (props or {}).items() if schema is not False}
        for key in required:
            if props is not None and props.get(key) is False:
                raise ValueError(f"tools: the {field} of tool {name!r}: 'required' names {key!r}, whose schema is "
                                 f"false (no value can satisfy it)")
        self.required = frozenset(r for r in required if r in self.props)
        self.values = {}  # parameter -> JsonGrammar (None: raw text)
        self.lengths = {}  # raw-text parameter -> (minLength, maxLength or None) of a string schema
        self.texts = {}  # parameter -> the text grammar its value follows (a custom tool's input)
        self.whole = set()  # parameters whose text grammar takes whole characters only (`whole_characters_at`)
        for key, schema in self.props.items():
            self.values[key] = _value_grammar(schema, parameters)
            if self.values[key] is None:
                self.lengths[key] = _length_bounds(schema)
        if text_grammar is not None:
            key, syntax = text_grammar.get("parameter"), text_grammar.get("syntax")
            if key not in self.props:
                raise ValueError(f"tools: the text grammar of tool {name!r} is for {key!r}, which is not among its "
                                 f"parameters")
            if syntax not in ("lark", "regex"):
                raise ValueError(f"tools: the text grammar of tool {name!r}: its syntax is 'lark' or 'regex', got "
                                 f"{syntax!r}")
            definition = text_grammar.get("definition")
            try:
                self.texts[key] = CfgGrammar(definition) if syntax == "lark" else RegexGrammar(definition)
            except ValueError as e:
                raise ValueError(f"tools: the text grammar of tool {name!r}: {e}") from None
            if hasattr(self.texts[key], "whole_characters_at"):
                self.whole.add(key)


def _length_bounds(schema) -> tuple[int, int | None]:
    """(minLength, maxLength or None) of a raw-text parameter whose schema is a plain string one; (0, None)
    otherwise (bad or absent bounds, or other types in the schema: not enforced)."""
    if not isinstance(schema, dict) or schema.get("type") != "string":
        return 0, None
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    valid = isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0 and (
        hi is None or (isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo))
    return (lo, hi) if valid else (0, None)


def _value_grammar(schema, parameters: dict):
    """How a parameter's value is written (`render_tool_calls`: strings raw, anything else as JSON): one of its
    strings for an enum of strings, JSON for a schema of one non-string type or an enum of other values (its local
    `$ref`s point into the tool's `parameters`), raw text (None) otherwise or when the schema does not compile
    (keywords the matcher lacks: the call is still well formed)."""
    if not isinstance(schema, dict):
        return None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) and v for v in enum):
        return ChoiceGrammar(enum)
    kind = schema.get("type")
    if (isinstance(kind, str) and kind != "string") or (isinstance(enum, list) and enum and not any(
            isinstance(v, str) for v in enum)):
        try:
            return compile_schema(schema, root=parameters)
        except ValueError:
            return None  # left raw text: the call is still well formed
    return None


class ToolCallGrammar:
    """Tool-call blocks for `tools` ([{"name", "parameters"}], parameters a JSON Schema object; Anthropic's tools
    give them as "input_schema", which a malformed one's error names then); `name`: only that tool (one call), else
    one or more calls of any of them, at most `max_calls` (None: no bound; 1 is OpenAI's
    `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`)."""

    def __init__(self, tools: Sequence[dict], name: str | None = None, max_calls: int | None = None):
        self.tools = {}
        for t in tools:
            field = "input_schema" if "input_schema" in t else "parameters"
            self.tools[t["name"]] = _Tool(t["name"], t.get(field), t.get("text_grammar"), field)
        if not self.tools:
            raise ValueError("tools: a forced tool call needs at least one tool")
        if name is not None and name not in self.tools:
            raise ValueError(f"tool_choice: {name!r} is not among the tools ({sorted(self.tools)})")
        if max_calls is not None and (not isinstance(max_calls, int) or max_calls < 1):
            raise ValueError(f"max_calls must be a positive int or None, got {max_calls!r}")
        self.allowed = [name] if name is not None else sorted(self.tools)
        self.max_calls = 1 if name is not None else max_calls
        self.start = ("lits", b"", ("start",))
        self._cache: dict = {}

    # -- the grammar's interface ----------------------------------------------------------------------------

    def advance(self, state, data: bytes):
        for b in data:
            state = self._step(state, b)
            if state is None:
                return None
        if state[0] == "text" and state[-1][:1] >= b"\x80":  # ends inside a character of a text grammar's value
            return None
        return state

    def complete(self, state) -> bool:
        return state[0] == "done"

    def whole_characters_at(self, state) -> bool:
        """Inside the value of a text grammar that takes whole characters only (no character's first bytes held)
        `TransitionCache` walks tokens a character at a time, since a token may not end inside one there;
        elsewhere a byte at a time."""
        return state[0] == "text" and state[-1][:1] < b"\x80" and state[5] in self.tools[state[1]].whole

    character_length = staticmethod(utf8_length)  # a character's bytes at data[i] (0: data ends inside it)

    def can_continue(self, state) -> bool:
        return state[0] != "done"

    # -- internals ------------------------------------------------------------------------------------------

    def _literals(self, ctx) -> dict[bytes, tuple]:
        """The literals that may come in `ctx`, each with the state after it (computed once per ctx)."""
        out = self._cache.get(ctx)
        if out is None:
            out = self._cache[ctx] = self._make_literals(ctx)
        return out

    def _make_literals(self, ctx) -> dict[bytes, tuple]:
        kind = ctx[0]
        if kind in ("start", "after"):
            count = 0 if kind == "start" else ctx[1]
            out = {}
            if kind == "start" or self.max_calls is None or count < self.max_calls:
                head = START + b"\n" if kind == "start" else b""
                for name in self.allowed:
                    out[head + b'<invoke name="' + name.encode() + b'">\n'] = ("lits", b"", ("params", name,
                                                                                             frozenset(), count))
            if kind == "after":
                out[END] = ("done",)
            return out
        _, name, seen, count = ctx[:4]
        lead = b"\n" if kind == "nlparams" else b""
        tool = self.tools[name]
        out = {}
        if tool.free:
            out[lead + b'<parameter name="'] = ("pname", name, seen, count, b"")
        for key in tool.props:
            if key not in seen:
                grammar = tool.values[key]
                if key in tool.texts:
                    after = ("text", name, seen | {key}, count, tool.texts[key].start, key, b"")
                elif grammar is None:
                    after = ("raw", name, seen | {key}, count, 0, 0, 0, key)
                else:
                    after = ("json", name, seen | {key}, count, grammar.start, key)
                out[lead + b'<parameter name="' + key.encode() + b'">'] = after
        if tool.required <= seen:
            out[lead + b"</invoke>\n"] = ("lits", b"", ("after", count + 1))
        return out

    def _step(self, state, b: int):
        kind = state[0]
        if kind == "lits":
            _, prefix, ctx = state
            prefix += bytes((b,))
            literals = self._literals(ctx)
            done = literals.get(prefix)  # no literal is a prefix of another (names hold no `"`)
            if done is not None:
                return done
            return ("lits", prefix, ctx) if any(lit.startswith(prefix) for lit in literals) else None
        if kind == "pname":  # a free parameter name, then `">`
            _, name, seen, count, key = state
            if b == 0x22 and key:
                return ("pclose", name, seen, count, key)
            return ("pname", name, seen, count, key + bytes((b,))) if b in _NAME_BYTES else None
        if kind == "pclose":
            _, name, seen, count, key = state
            return ("raw", name, seen | {key.decode()}, count, 0, 0, 0, None) if b == 0x3E else None
        if kind == "raw":
            _, name, seen, count, k, chars, utf8, key = state
            lo, hi = self.tools[name].lengths.get(key, (0, None))
            return self._raw_step(name, seen, count, k, chars, utf8, key, b, lo, hi)
        if kind == "json":
            _, name, seen, count, inner, key = state
            grammar = self.tools[name].values[key]
            if b == 0x3C and grammar.complete(inner):  # JSON has no `<` outside strings: the end tag begins
                return ("jend", name, seen, count, 1)
            inner = grammar.advance(inner, bytes((b,)))
            return None if inner is None else ("json", name, seen, count, inner, key)
        if kind == "text":
            return self._text_step(state, b)
        if kind == "jend":  # after a JSON value only the end tag may come
            _, name, seen, count, k = state
            if b != _END_TAG[k]:
                return None
            return ("lits", b"", ("nlparams", name, seen, count)) if k + 1 == len(_END_TAG) else \
                ("jend", name, seen, count, k + 1)
        return None  # done: nothing may follow

    def _text_step(self, state, b: int):
        """A text grammar's value: `held` bytes not yet given to the grammar are the start of `</parameter>` (which
        ends the value where the grammar has a whole sentence) or, for a grammar that takes whole characters only,
        of a multi-byte character (other grammars hold a character's first bytes themselves)."""
        _, name, seen, count, inner, key, held = state
        tool = self.tools[name]
        grammar = tool.texts[key]
        if held[:1] >= b"\x80":  # a character's first bytes: it goes to the grammar once whole
            if not 0x80 <= b <= 0xBF:
                return None
            held += bytes((b,))
            if utf8_length(held, 0):
                inner, held = grammar.advance(inner, held), b""
            return None if inner is None else ("text", name, seen, count, inner, key, held)
        tag = held + bytes((b,))
        if _END_TAG.startswith(tag):
            if tag == _END_TAG:  # the value holds no `</parameter>`: the tag ends it
                return ("lits", b"", ("nlparams", name, seen, count)) if grammar.complete(inner) else None
            if grammar.complete(inner) or grammar.advance(inner, tag) is not None:
                return ("text", name, seen, count, inner, key, tag)
            return None
        if held:  # the tag broke off: its bytes were text
            inner = grammar.advance(inner, held)
            if inner is None:
                return None
        if b == 0x3C:  # a new `<` may begin the tag
            return self._text_step(("text", name, seen, count, inner, key, b""), b)
        if b >= 0x80 and key in tool.whole:  # a character for a grammar that takes whole ones: held till whole
            if b >= 0xF5 or b <= 0xBF:  # not UTF-8 (the marker bytes among them), or a stray continuation
                return None
            return ("text", name, seen, count, inner, key, bytes((b,)))
        inner = grammar.advance(inner, bytes((b,)))
        return None if inner is None else ("text", name, seen, count, inner, key, b"")

    @staticmethod
    def _raw_step(name, seen, count, k: int, chars: int, utf8: int, key, b: int, lo: int, hi: int | None):
        """Raw text with `chars` characters, then `k` bytes of `</parameter>` (held: they are text if the tag breaks
        off) or, where `utf8` is not 0, the first bytes of a multi-byte character (`UTF8_PENDING` state), then
        byte b. The text stays valid UTF-8 (a byte-level vocabulary may split a character across tokens, so the
        walk goes a byte at a time) and its length in characters lies in lo..hi: a character counts at its first
        byte, so a lead byte needs room for one more character and its continuation bytes count for nothing."""
        if utf8:  # inside a character: only the continuation byte its lead allows (no tag byte is held here)
            low, high, utf8 = UTF8_PENDING[utf8]
            return ("raw", name, seen, count, 0, chars, utf8, key) if low <= b <= high else None
        if b == _END_TAG[k]:
            k += 1
            if k == len(_END_TAG):
                return ("lits", b"", ("nlparams", name, seen, count)) if chars >= lo else None
            pending = k
        else:
            chars += k  # the held bytes were text after all
            if b == 0x3C:  # a new `<` may begin the tag
                pending = 1
            else:
                pending, chars = 0, chars + 1
                if b >= 0x80:
                    utf8 = UTF8_LEAD[b]
                    if not utf8:  # a stray continuation byte or one no character starts with (the markers' 0xFF)
                        return None
        if hi is None:
            chars = min(chars, lo)  # counts above the minimum behave alike: fewer states, better memoization
        elif chars + (pending if chars < lo else 0) > hi:
            # too long, or held bytes that cannot end the text yet (too short) and would make it too long as text
            return None
        return ("raw", name, seen, count, pending, chars, utf8, key)
