"""The forced tool-call grammar (`openm3.engine.tool_grammar`): the blocks `render_tool_calls` writes are accepted
(byte by byte, with the special tokens as marker bytes) and parse back; wrong names, unknown or repeated
parameters, missing required ones, values that break their schema and text after the block are refused; random
walks end in blocks that `parse_tool_calls` reads and whose arguments follow the schemas."""

from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest

from openm3.data.chat import parse_tool_calls, render_tool_calls
from openm3.data.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from openm3.engine.tool_grammar import END, START, ToolCallGrammar

# Seconds a step that once took 8 s to minutes may take now (~0.5 s at most idle; CI's loaded 2 cores: ~1.4 s)
FAST = 5.0

TOOLS = [
    {"name": "read_file", "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"}, "lines": {"type": "integer"}, "flags": {"type": "array", "items": {"enum": [
            "a", "b"]}, "maxItems": 2}, "tag": {"type": "string", "minLength": 2, "maxLength": 4}}}},
    {"name": "read", "parameters": {"type": "object", "properties": {"verbose": {"type": "boolean"}}}},
    {"name": "anything"},
]


def as_bytes(text: str) -> bytes:
    return text.replace(TOOL_CALL_START, "\x00S").replace(TOOL_CALL_END, "\x00E").encode() \
        .replace(b"\x00S", START).replace(b"\x00E", END)


def feed(g, data: bytes):
    state = g.start
    for k in range(len(data)):
        state = g.advance(state, data[k:k + 1])
        if state is None:
            return None, k
    return state, len(data)


CALLS = [
    [{"name": "read_file", "arguments": {"path": "src/a b.py", "lines": 20}}],
    [{"name": "read_file", "arguments": {"flags": ["a"], "path": "x</param"}}],
    [{"name": "read", "arguments": {}}, {"name": "anything", "arguments": {"q": "why?", "n": "3"}}],
    [{"name": "read", "arguments": {"verbose": True}}],
    [{"name": "read", "arguments": {}}, {"name": "read_file", "arguments": {"path": "b"}},
     {"name": "read", "arguments": {"verbose": False}}],
    [{"name": "read_file", "arguments": {"tag": "é<</", "path": "x"}}],  # 4 characters, the `<`s held then text
]


@pytest.mark.parametrize("calls", CALLS, ids=range(len(CALLS)))
def test_rendered_calls_are_accepted_and_parse_back(calls):
    text = render_tool_calls([{"function": c} for c in calls])
    g = ToolCallGrammar(TOOLS)
    state, at = feed(g, as_bytes(text))
    assert state is not None and g.complete(state) and not g.can_continue(state), at
    assert parse_tool_calls(text) == [{"name": c["name"], "arguments": {
        k: (json.loads(v) if isinstance(v, str) and v.isdigit() else v) for k, v in c["arguments"].items()}}
        for c in calls]
    single = ToolCallGrammar(TOOLS, name=calls[0]["name"])
    assert (feed(single, as_bytes(text))[0] is not None) == (len(calls) == 1)
    for bound in (1, 2):  # parallel_tool_calls false is 1
        g = ToolCallGrammar(TOOLS, max_calls=bound)
        state, _ = feed(g, as_bytes(text))
        assert (state is not None and g.complete(state)) == (len(calls) <= bound)


REFUSED = [
    ("too-long", '<invoke name="read_file">\n<parameter name="tag">ab<c/d</parameter>\n'),
    ("too-short", '<invoke name="read_file">\n<parameter name="tag">é</parameter>\n'),
    ("unknown-tool", '<invoke name="write">\n</invoke>\n'),
    ("missing-required", '<invoke name="read_file">\n<parameter name="lines">2</parameter>\n</invoke>\n'),
    ("unknown-parameter", '<invoke name="read_file">\n<parameter name="size">2</parameter>\n'),
    ("repeated-parameter", '<invoke name="read">\n<parameter name="verbose">true</parameter>\n'
                           '<parameter name="verbose">'),
    ("not-an-integer", '<invoke name="read_file">\n<parameter name="lines">2x'),
    ("json-then-text", '<invoke name="read_file">\n<parameter name="lines">2<b'),
    ("json-then-broken-end-tag", '<invoke name="read_file">\n<parameter name="lines">2 </paramX'),
    ("enum", '<invoke name="read_file">\n<parameter name="flags">["c"'),
    ("no-newline", '<invoke name="read">\n</invoke>' + TOOL_CALL_END),
]


@pytest.mark.parametrize("body", [r[1] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_broken_calls_are_refused(body):
    g = ToolCallGrammar(TOOLS)
    state, _ = feed(g, as_bytes(TOOL_CALL_START + "\n" + body + "</invoke>\n" + TOOL_CALL_END))
    assert state is None
    g = ToolCallGrammar(TOOLS)
    done = as_bytes(render_tool_calls([{"function": {"name": "read", "arguments": {}}}]))
    assert g.advance(g.advance(g.start, done), b" ") is None  # nothing after the block


def test_random_walks_end_in_calls_that_follow_the_schemas():
    rng = random.Random(0)
    alphabet = [bytes([b]) for b in range(0x20, 0x7F)] + [b"\n", START, END, "é".encode()]
    schemas = {t["name"]: t.get("parameters") for t in TOOLS}
    for _ in range(150):
        g = ToolCallGrammar(TOOLS)
        state, out = g.start, b""
        for _ in range(3000):
            if g.complete(state):
                break
            options = [(a, s) for a in alphabet if (s := g.advance(state, a)) is not None]
            closing = [o for o in options if o[0] in (b"<", b"/", b"\n", b">", END, b'"', b"]", b"}")]
            if state[0] == "raw":  # raw text ends only with `</parameter>`: lean towards writing it
                closing = [o for o in options if o[0] == b"</parameter>"[state[4]:state[4] + 1]]
            lean = 0.9 if state[0] == "raw" else 0.5
            a, state = rng.choice(closing if closing and rng.random() < lean else options)
            out += a
        assert g.complete(state), out
        text = out.replace(START, TOOL_CALL_START.encode()).replace(END, TOOL_CALL_END.encode()).decode()
        for call in parse_tool_calls(text):
            schema = schemas[call["name"]]
            if schema:
                typed = {k: v for k, v in call["arguments"].items()
                         if schema["properties"][k].get("type") != "string"}
                jsonschema.validate(typed, {**schema, "required": []})
                assert set(schema.get("required", [])) <= set(call["arguments"])
                if "tag" in call["arguments"]:  # a raw string's length bounds (characters)
                    assert 2 <= len(call["arguments"]["tag"]) <= 4, call


def test_bad_tool_choices():
    with pytest.raises(ValueError, match="not among the tools"):
        ToolCallGrammar(TOOLS, name="write")
    with pytest.raises(ValueError, match="at least one tool"):
        ToolCallGrammar([])
    with pytest.raises(ValueError, match="max_calls must be a positive int"):
        ToolCallGrammar(TOOLS, max_calls=0)


BAD_PARAMETERS = [
    ({"type": "nonsense"}, "schema at #: 'type' must be one of"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "$ref '#/$defs/missing' not found"),
    ({"type": "object", "properties": 5}, "'properties' must be an object"),
    ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "schema at #/properties/a: 'type'"),
    ({"type": "object", "required": "a"}, "'required' must be a list of strings"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}},
     "'minLength' 3 exceeds 'maxLength' 2"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}, "does not compile"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "'required' names 'a', whose schema is false"),
]


@pytest.mark.parametrize("parameters,message", BAD_PARAMETERS, ids=[str(i) for i in range(len(BAD_PARAMETERS))])
def test_malformed_parameters_are_refused_naming_the_tool(parameters, message):
    """A tool's parameters get the checks a response_format schema gets (`validate_schema`): a malformed one is a
    ValueError naming the tool and the keyword (once the tool was simply called with free text there)."""
    tools = [TOOLS[1], {"name": "broken", "parameters": parameters}]
    for name in (None, "read"):  # (every tool is checked, the one forced or not)
        with pytest.raises(ValueError) as err:
            ToolCallGrammar(tools, name=name)
        assert str(err.value).startswith("tools: the parameters of tool 'broken': ") and message in str(err.value)


def test_valid_parameters_the_matcher_lacks_keywords_for_are_written_raw():
    """Valid JSON Schema the JSON matcher does not support (OpenAPI's nullable, draft 3's required, `not`, refs to
    other documents) still makes a grammar: those values are raw text, as before. A `$ref` into the parameters'
    `$defs` is followed (the value is then JSON that follows it), and a parameter whose schema is false cannot be
    given."""
    parameters = {"type": "object", "$defs": {"point": {"type": "object", "required": ["x"], "additionalProperties":
                                                        False, "properties": {"x": {"type": "integer"}}}},
                  "properties": {"a": {"type": "string", "nullable": True, "required": True},
                                 "b": {"type": "integer", "not": {"const": 3}},
                                 "c": {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}},
                                 "d": {"$ref": "https://example.com/d.json"}, "e": False}}
    g = ToolCallGrammar([{"name": "t", "parameters": parameters}])
    head = START + b'\n<invoke name="t">\n<parameter name="'
    for key, value in (("a", "free text"), ("b", "x3"), ("d", "{anything")):
        assert g.advance(g.start, head + f'{key}">{value}</parameter>\n</invoke>\n'.encode() + END) is not None
    assert g.advance(g.start, head + b'c">{"p":{"x":1}}</parameter>\n') is not None
    assert g.advance(g.start, head + b'c">{"p":{"x":"1"') is None and g.advance(g.start, head + b'c">{"p":{"y"') is None
    assert g.advance(g.start, head + b'e">') is None


@pytest.mark.parametrize("n", [10 ** 9, 10 ** 18])
def test_huge_counts_in_parameters_compile_at_once(n):
    """minItems / maxLength / minProperties of 10**9 or 10**18 in a forced call's parameters (minItems once cost
    minutes of one thread here), and the call's values still grow toward them."""
    parameters = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "array", "minItems": n}, "b": {"type": "string", "minLength": n, "maxLength": n},
        "c": {"type": "object", "minProperties": n}, "d": {"type": "array", "maxItems": n, "items": {"type": "array",
                                                                                              "minItems": n}}}}
    started = time.perf_counter()
    g = ToolCallGrammar([{"name": "f", "parameters": parameters}])
    assert time.perf_counter() - started < FAST
    state = g.advance(g.start, START + b'\n<invoke name="f">\n<parameter name="a">[1,[],{},"x"')
    assert state is not None and g.advance(state, b"]") is None


def test_text_grammar_values_full_masks_equal_checking_each_token():
    """A custom tool's input under a text grammar (`text_grammar`): the full mask (walked by bytes) equals checking
    each token whole, with non-ASCII tokens and tokens that end inside a character (taken inside the value where
    some character that starts so may come); the value ends only where the grammar has a sentence."""
    import torch

    from openm3.engine.constrained import TokenBytes, TransitionCache

    tool = {"name": "t", "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
            "text_grammar": {"parameter": "input", "syntax": "lark",
                             "definition": 'start: WORD ("<" WORD)*\nWORD: /[a-zé日]+/'}}
    pieces = [bytes([b]) for b in range(0x20, 0x7F)] + [b"\n", b"</", b"</parameter>", b"</parameter>\n</invoke>\n",
                                                       START, END, b'<invoke name="t">\n', b'<parameter name="input">']
    pieces += ["é".encode(), "éa".encode(), "日".encode(), "é".encode()[:1], "日".encode()[:2],
               b"a" + "é".encode()[:1]]
    vocab = TokenBytes(pieces)
    g = ToolCallGrammar([tool], "t")
    transitions = TransitionCache(g, vocab)
    head = START + b'\n<invoke name="t">\n<parameter name="input">'
    for text in [b"", b"a", "é".encode(), "日a<".encode(), b"ab</", b"ab</param", "日".encode()[:1], b"\xc3"]:
        state = g.advance(g.start, head + text)
        assert state is not None, text
        want = torch.tensor([g.advance(state, p) is not None for p in pieces])
        assert torch.equal(transitions.full_mask(state), want), text
    state = g.advance(g.start, head + b"ab")
    allowed = {p for p, ok in zip(pieces, transitions.full_mask(state)) if ok}
    assert {"é".encode(), "éa".encode(), "日".encode(), b"</parameter>", b"<", "é".encode()[:1], "日".encode()[:2],
            b"a" + "é".encode()[:1]} <= allowed
    assert not {b" ", b"\n"} & allowed
    held = g.advance(state, "日".encode()[:2])  # inside a character: only its last byte, no tag, no end
    assert [b for b in range(256) if g.advance(held, bytes((b,))) is not None] == ["日".encode()[2]]
    assert g.advance(g.start, head + b"</parameter>") is None  # an empty value is no sentence
    assert g.advance(g.start, head + b"a<</parameter>") is None


# A raw string value with length bounds (characters, not bytes), and one without; `free` takes any parameter name.
BOUNDED = [{"name": "weather", "parameters": {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "minLength": 2, "maxLength": 10}, "note": {"type": "string"}}}}, {"name": "free"}]
HEADS = {"city": b'<invoke name="weather">\n<parameter name="city">',
         "note": b'<invoke name="weather">\n<parameter name="note">',
         "free": b'<invoke name="free">\n<parameter name="q">'}


def in_value(which: str, text: bytes):
    """The state after `text` inside the raw value `which` of `BOUNDED` (None: refused)."""
    g = ToolCallGrammar(BOUNDED)
    return g, g.advance(g.start, START + b"\n" + HEADS[which] + text)


NOT_UTF8 = [
    ("continuation-after-max", b"abcdefghij\x80"),
    ("continuations-after-max", b"'pesith\x05ra" + b"\xbf" * 8),
    ("stray-continuation", b"ab\x80"),
    ("continuation-after-whole", "é".encode() + b"\xa9"),
    ("lead-then-tag", b"a\xc3</parameter>"),
    ("lead-then-ascii", b"a\xe2\x82a"),
    ("overlong-c0", b"a\xc0\x80"),
    ("overlong-e0", b"a\xe0\x80\x80"),
    ("surrogate", b"a\xed\xa0\x80"),
    ("above-u10ffff", b"a\xf4\x90\x80\x80"),
    ("f5", b"a\xf5"),
    ("marker", b"a" + END),
]


@pytest.mark.parametrize("which", ["city", "note", "free"])
@pytest.mark.parametrize("text", [r[1] for r in NOT_UTF8], ids=[r[0] for r in NOT_UTF8])
def test_raw_values_refuse_invalid_utf8(which, text):
    """A raw value stays UTF-8: a continuation byte only where a character's lead opened one (within the range
    that lead allows), no byte that starts no character, and the value ends only between characters."""
    assert in_value(which, text)[1] is None
    assert in_value(which, b"ab")[1] is not None


@pytest.mark.parametrize("value, ok", [
    ("é€😀", True), ("é€😀😀é€😀😀é€", True), ("é€😀😀é€😀😀é€a", False), ("aaaaaaaaa😀", True),
    ("aaaaaaaaaa😀", False), ("😀", False), ("😀é", True), ("", False), ("a", False), ("é<</", True)])
def test_raw_string_lengths_count_characters(value, ok):
    """minLength / maxLength count characters: 'é', '€' and '😀' (2, 3 and 4 bytes) are one each."""
    g, state = in_value("city", value.encode() + b"</parameter>")
    assert (state is not None) == ok, value
    if ok:
        state = g.advance(state, b'\n</invoke>\n' + END)
        assert state is not None and g.complete(state)


@pytest.mark.parametrize("value", ["abcdefghij", "é€😀😀é€😀😀é€", "aaaaaaaa<x"],
                         ids=["ascii", "multi-byte", "broken-tag"])
def test_after_max_length_only_the_end_tag_follows(value):
    """With maxLength characters written, each next byte must be the next one of `</parameter>`."""
    g, state = in_value("city", value.encode())
    for k in range(len(b"</parameter>")):
        allowed = [b for b in range(256) if g.advance(state, bytes((b,))) is not None]
        assert allowed == [b"</parameter>"[k]], (value, k, allowed)
        state = g.advance(state, b"</parameter>"[k:k + 1])


@pytest.mark.parametrize("start, follow", [("é", range(0x80, 0xC0)), ("€", range(0x80, 0xC0)),
                                           ("😀", range(0x80, 0xC0)), (b"\xe0", range(0xA0, 0xC0)),
                                           (b"\xed", range(0x80, 0xA0)), (b"\xf0", range(0x90, 0xC0)),
                                           (b"\xf4", range(0x80, 0x90))],
                         ids=["c3", "e2", "f0-9f", "e0", "ed", "f0", "f4"])
def test_inside_a_character_only_its_continuation_bytes_follow(start, follow):
    """A token may end inside a character (a byte-level vocabulary splits them); the next byte is then one of the
    continuation bytes its lead allows and nothing else, not even the end tag's `<`."""
    head = start if isinstance(start, bytes) else start.encode()[:-1]
    for which in ("city", "note", "free"):
        g, state = in_value(which, b"a" + head)
        assert [b for b in range(256) if g.advance(state, bytes((b,))) is not None] == list(follow), (start, which)


def test_sampled_bounded_values_are_utf8_within_their_lengths():
    """Random walks over a byte-level vocabulary (every byte a token, as a model's byte fallback allows, plus
    characters whole and split): every value the mask lets through decodes as UTF-8 and holds minLength to
    maxLength characters. Before values were checked as UTF-8, the walks ran into stray continuation bytes."""
    from openm3.engine.constrained import TokenBytes, TransitionCache

    pieces = [bytes([b]) for b in range(0xF8)] + [b"</parameter>", b"</", b"ab", b"a<", b"\n</invoke>\n"]
    for ch in "é€😀日":
        data = ch.encode()
        pieces += [data] + [data[:i] for i in range(2, len(data))] + [data[i:] for i in range(1, len(data))]
    pieces += ["aé".encode(), "é😀".encode()[:-1]]
    vocab = TokenBytes(pieces)
    close = pieces.index(b"</parameter>")
    rng = random.Random(0)
    for which in ("city", "note"):
        g = ToolCallGrammar(BOUNDED, "weather")
        transitions = TransitionCache(g, vocab)
        head = g.advance(g.start, START + b"\n" + HEADS[which])
        for _ in range(200):
            state, out = head, b""
            while state[0] == "raw":
                allowed = transitions.full_mask(state).nonzero().flatten().tolist()
                assert allowed, out
                pick = close if close in allowed and rng.random() < 0.15 else rng.choice(allowed)
                out += pieces[pick]
                state = transitions.next(state, pick)
            value = out[:out.index(b"</parameter>")].decode("utf-8")  # raises on invalid UTF-8
            assert state[0] == "lits" and out.endswith(b"</parameter>"), out
            if which == "city":
                assert 2 <= len(value) <= 10, value


@pytest.mark.parametrize("syntax,definition,whole", [("regex", "[\u4e00-\u9fff]+", False),
                                                     ("lark", 'start: "😀" /[\u4e00-\u9fff]/+', False),
                                                     ("regex", "(?=.)[\u4e00-\u9fff😀]+", True)],
                         ids=["regex", "lark", "regex-package"])
def test_text_grammar_characters_no_token_holds(syntax, definition, whole):
    """A vocabulary whose only tokens of non-ASCII text are single bytes: inside a call, greedy picks write a text
    grammar's characters byte by byte (an automaton's regex, a Lark grammar), then the end tag. Under a regex left
    to the `regex` package (lookahead), which is asked about whole texts, a token may not end inside a character:
    refused, and the full mask (walked a character at a time there) agrees."""
    import torch

    from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
    from openm3.engine.sampling import SamplingParams

    tool = {"name": "t", "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
            "text_grammar": {"parameter": "input", "syntax": syntax, "definition": definition}}
    pieces = [None] + [bytes((b,)) for b in range(0xF8)] + [START, END, "中".encode(), "😀".encode()]
    g = ToolCallGrammar([tool], "t")
    transitions = TransitionCache(g, TokenBytes(pieces))
    head = START + b'\n<invoke name="t">\n<parameter name="input">'
    value = ("😀中文" if syntax == "lark" else "中文").encode()
    state = g.advance(g.start, head)
    want = torch.tensor([p is not None and g.advance(state, p) is not None for p in pieces])
    assert torch.equal(transitions.full_mask(state), want)
    assert bool(want[1 + value[0]]) != whole  # a lead byte alone
    if whole:
        assert g.advance(g.start, head + value + b"</parameter>") is not None
        return
    c = GrammarConstraint(transitions, [0])
    c.read(head)
    for b in value + b"</parameter>\n</invoke>\n":
        row = torch.zeros(len(pieces))
        row[1 + b] = 5.0
        assert c.pick(row, SamplingParams()) == 1 + b, bytes((b,))
    row = torch.zeros(len(pieces))
    row[pieces.index(END)] = 5.0
    assert c.pick(row, SamplingParams()) == pieces.index(END) and c.complete
