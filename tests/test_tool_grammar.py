"""The forced tool-call grammar (`openm3.engine.tool_grammar`): the blocks `render_tool_calls` writes are accepted
(byte by byte, with the special tokens as marker bytes) and parse back; wrong names, unknown or repeated
parameters, missing required ones, values that break their schema and text after the block are refused; random
walks end in blocks that `parse_tool_calls` reads and whose arguments follow the schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from openm3.data.chat import parse_tool_calls, render_tool_calls
from openm3.data.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from openm3.engine.tool_grammar import END, START, ToolCallGrammar

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


def test_text_grammar_values_full_masks_equal_checking_each_token():
    """A custom tool's input under a text grammar (`text_grammar`): the full mask (walked by whole characters
    there, by bytes elsewhere) equals checking each token whole, with non-ASCII tokens and tokens that end inside a
    character (refused inside the value); the value ends only where the grammar has a sentence."""
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
    for text in [b"", b"a", "é".encode(), "日a<".encode(), b"ab</", b"ab</param"]:
        state = g.advance(g.start, head + text)
        assert state is not None, text
        want = torch.tensor([g.advance(state, p) is not None for p in pieces])
        assert torch.equal(transitions.full_mask(state), want), text
    state = g.advance(g.start, head + b"ab")
    allowed = {p for p, ok in zip(pieces, transitions.full_mask(state)) if ok}
    assert {"é".encode(), "éa".encode(), "日".encode(), b"</parameter>", b"<"} <= allowed
    assert not {"é".encode()[:1], "日".encode()[:2], b"a" + "é".encode()[:1], b" ", b"\n"} & allowed
    assert g.advance(g.start, head + b"</parameter>") is None  # an empty value is no sentence
    assert g.advance(g.start, head + b"a<</parameter>") is None
