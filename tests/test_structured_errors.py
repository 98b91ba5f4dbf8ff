"""Structured outputs that cannot be honoured, or only slowly: refused when the grammar is made (a ValueError, which
the server answers with a 400 naming the field) instead of failing mid-generation (a 500) or pinning a thread, and
huge counts compiled at once. Through the Lark / GBNF grammars' limits, `StructuredOutputs` (what the server calls
per request), and the HTTP API for the cases an audit reproduced: an empty `guided_regex`, a malformed forced
tool's parameters, `minItems: 10**9`. Dead ends only decoding finds (a `regex`-package pattern's lookaround, the
request's own `allowed_token_ids`) are the request's 400 naming the field, or a stream's error event; never a 500."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from openm3.engine.batching import BatchedGenerator
from openm3.engine.cfg_grammar import CfgGrammar
from openm3.serve import ModelBackend, create_app
from openm3.serve.schemas import OutputSpec
from openm3.serve.structured import StructuredOutputs

from test_serve import NAME, events, named_events, tiny_model, tok  # noqa: F401 - the fixture, helpers

# Seconds a step that once took 8 s to minutes may take now (~0.5 s at most idle; CI's loaded 2 cores: ~1.4 s)
FAST = 5.0

ASK = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
HUGE = {"type": "object", "required": ["a"], "properties": {"a": {"type": "array", "minItems": 10 ** 9}}}


def timed(make):
    started = time.perf_counter()
    out = make()
    return out, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------------------
# Grammars that no answer can follow, or too large to build quickly

@pytest.mark.parametrize("text,message", [
    ("start: /[^\\x00-\\U0010ffff]/", "matches no text"),
    ('start: "a" | /[^\\s\\S]+/', "matches no text"),
    ('root ::= [^\\x00-\\U0010ffff] "x"', "matches no text"),
    ('start: "\\ud800"', "lone surrogate"),
    ('start: a\na: a "x"', "derive no text"),
])
def test_a_grammar_that_no_answer_can_follow_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        CfgGrammar(text)


@pytest.mark.parametrize("text", ['root ::= "a"{1000000000}', 'start: "a" ~ 5..1000000000000000000',
                                  'root ::= ("ab"{10000} "c"{0,10000})'])
def test_counted_repetitions_past_the_budget_are_refused_at_once(text):
    """`x{m,n}` writes x out n times (a rule per optional copy): `"a"{1000000000}` once took a list of a billion
    elements; past `_MAX_REPEATED` in all the grammar is refused."""
    started = time.perf_counter()
    with pytest.raises(ValueError, match="grammar: repetition .* counted repetitions"):
        CfgGrammar(text)
    assert time.perf_counter() - started < FAST
    _, seconds = timed(lambda: CfgGrammar('root ::= "a"{0,8000} "b"'))
    assert seconds < FAST


def test_repetition_keeps_states_the_same_depth():
    """A rule that ends an alternative returns straight to its parent (a tail call), so `x*`, `x+` and `x{0,n}`
    keep their stacks as deep as they were: a state repeats after each x (memoised steps; 3,000 characters took
    most of a minute when each one pushed a frame) and long rule chains compile at once."""
    for text in ('root ::= "a"*', 'start: ("a" | "b")+ "c"?', 'root ::= "a"{0,3000} "b"'):
        g = CfgGrammar(text)
        state, states = g.start, set()
        started = time.perf_counter()
        for _ in range(3000):
            state = g.advance(state, b"a")
            states.add(state)
        assert time.perf_counter() - started < FAST and None not in states, text
        assert len(states) <= (3000 if "3000" in text else 2), (text, len(states))
    chain = "\n".join([f"r{k} ::= r{k + 1} \"x\"" for k in range(1500)] + ['r1500 ::= "y"']).replace("r0", "root")
    g, seconds = timed(lambda: CfgGrammar(chain))
    assert seconds < FAST and g.complete(g.advance(g.start, b"y" + b"x" * 1500))


# ---------------------------------------------------------------------------------------------------------------
# What the server asks for: StructuredOutputs.factory raises the ValueError it answers with a 400

BAD_SPECS = [
    ("regex-no-character", OutputSpec(regex="[^\\x00-\\U0010ffff]"), "matches no text"),
    ("regex-boundary-alone", OutputSpec(regex="\\b"), "matches no text"),
    ("regex-lookahead-no-start", OutputSpec(regex="(?=x)y"), "no token of the vocabulary starts a match"),
    ("regex-huge-count", OutputSpec(regex="(?m)a{1000000000}"), "counted repeats"),
    ("grammar-no-character", OutputSpec(grammar="root ::= [^\\x00-\\U0010ffff]"), "matches no text"),
    ("schema-pattern-no-character", OutputSpec({"type": "string", "pattern": "[^\\x00-\\U0010ffff]"}),
     "matches no string"),
    ("forced-call-bad-type", OutputSpec.forced_call([{"name": "f", "parameters": {"type": "nonsense"}}], None),
     "tools: the parameters of tool 'f': schema at #: 'type'"),
    ("forced-call-missing-ref", OutputSpec.forced_call([{"name": "ok", "parameters": {}}, {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}], "ok"), "tool 'g'"),
    ("auto-calls-properties-5", OutputSpec.auto_calls([{"name": "f", "parameters": {"properties": 5}}]),
     "'properties' must be an object"),
    ("custom-tool-empty-regex", OutputSpec.forced_call([{"name": "c", "parameters": {"type": "object", "properties": {
        "input": {"type": "string"}}}, "text_grammar": {"parameter": "input", "syntax": "regex",
                                                        "definition": "(?!)"}}], None), "matches no text"),
]


@pytest.mark.parametrize("spec,message", [b[1:] for b in BAD_SPECS], ids=[b[0] for b in BAD_SPECS])
def test_specs_that_cannot_be_honoured_raise_value_error(tok, spec, message):
    with pytest.raises(ValueError, match=message.replace("[", "\\[").replace("$", "\\$")):
        StructuredOutputs(tok).factory(spec)


def test_huge_counts_make_constraints_at_once(tok):
    structured = StructuredOutputs(tok)
    structured.factory(OutputSpec({"type": "string"}))  # (the vocabulary's bytes are read once, first)
    for spec in (OutputSpec({"type": "array", "minItems": 10 ** 18}), OutputSpec(HUGE),
                 OutputSpec.forced_call([{"name": "f", "parameters": HUGE}], None)):
        make, seconds = timed(lambda: structured.factory(spec))
        assert seconds < FAST and make() is not None


# ---------------------------------------------------------------------------------------------------------------
# Through the HTTP API: 400s naming the field, not 500s; no pinned thread

def test_the_audited_requests_are_answered_at_once(tok):
    """(A model with room for the tools' descriptions in its prompts.)"""
    client = TestClient(create_app(ModelBackend(tiny_model(tok, 1024)), tok, model_name=NAME, max_total_tokens=1024,
                                   reasoning_parser="none"))
    for pattern in ("[^\\x00-\\U0010ffff]", "\\b", "a{1000000000}"):
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3,
                                                 "guided_regex": pattern})
        assert r.status_code == 400 and "regex" in r.json()["error"]["message"], r.text
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
    r = client.post("/v1/chat/completions", json={**ASK, "tools": [bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text  # the tool is at fault
    assert r.json()["error"]["message"].startswith("tools: the parameters of tool 'f'")
    r = client.post("/v1/messages", json={**ASK, "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}],
                                          "tool_choice": {"type": "any"}})
    assert r.status_code == 400 and "tools: the input_schema of tool 'f'" in r.text, r.text  # (Anthropic's name)
    constrained = TestClient(create_app(ModelBackend(tiny_model(tok, 1024)), tok, model_name=NAME,
                                        max_total_tokens=1024, reasoning_parser="none", constrain_tool_calls=True))
    r = constrained.post("/v1/chat/completions", json={**ASK, "tools": [bad]})  # auto: the same grammar, checked
    assert r.status_code == 400 and "tools: the parameters of tool 'f'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "tools" and r.json()["error"]["message"].startswith("tools: the")
    assert client.post("/v1/chat/completions", json={**ASK, "tools": [bad]}).status_code == 200  # (no grammar)
    r, seconds = timed(lambda: client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3,
                                                                    "guided_json": HUGE}))
    assert r.status_code == 200 and seconds < 30, r.text
    good = {"type": "function", "function": {"name": "f", "parameters": HUGE}}
    r, seconds = timed(lambda: client.post("/v1/chat/completions", json={**ASK, "tools": [good],
                                                                         "tool_choice": "required"}))
    assert r.status_code == 200 and seconds < 30, r.text


# ---------------------------------------------------------------------------------------------------------------
# Dead ends that only decoding finds: the request's 400 naming the field (a stream: its error event), not a 500

LOOKAHEAD = {"type": "string", "pattern": "^a(?=b)$"}  # `regex` takes `"a`, which no string continues


@pytest.fixture(scope="module", params=["model", "batched"])
def dead_ends(request, tok):
    """A client on the one-request backend and on the batching one (the dead end is raised on its worker)."""
    model = tiny_model(tok)
    backend = ModelBackend(model) if request.param == "model" else BatchedGenerator(model, token_budget=1024,
                                                                                    max_batch=4, chunk_size=64)
    yield TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=256, reasoning_parser="none"))
    if request.param == "batched":
        backend.close()


def test_a_dead_end_while_decoding_is_a_400_naming_the_field(dead_ends, tok):
    """`a(?=b)` (left to the `regex` package) takes `a`, then nothing: a 400 naming the field, through every API;
    a grammar the automaton follows behaves the same where the request's `allowed_token_ids` leave it no token."""
    words = tok.encode("hello there")  # no digit among them
    cases = [("/v1/completions", {"prompt": "hi", "guided_regex": "a(?=b)"}, "guided_regex", "'a'"),
             ("/v1/chat/completions", {"messages": ASK["messages"], "structured_outputs": {"regex": "[0-9]+"},
                                       "allowed_token_ids": words}, "structured_outputs", "-inf"),
             ("/v1/chat/completions", {"messages": ASK["messages"], "guided_grammar": "start: /[0-9]+/",
                                       "allowed_token_ids": words}, "guided_grammar", "-inf"),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "text": {"format": {
                 "type": "json_schema", "name": "x", "schema": LOOKAHEAD}}}, "text", "no token continues")]
    for path, body, field, why in cases:
        r = dead_ends.post(path, json={"model": NAME, "max_tokens": 16, **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
        assert error["param"] == field and error["message"].startswith(field), r.text
        assert "the answer cannot be finished" in error["message"] and why in error["message"], r.text
    r = dead_ends.post("/v1/messages", json={**ASK, "max_tokens": 16, "output_config": {"format": {
        "type": "json_schema", "schema": LOOKAHEAD}}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith("output_config.format: the answer cannot be finished"), r.text


def test_a_dead_end_ends_a_stream_with_its_error(dead_ends):
    """Streamed, the text so far has gone out: the stream ends with the request's error event (OpenAI's error
    body, Anthropic's `error` event, the Responses API's `response.failed`) and closes as usual."""
    chunks = events(dead_ends.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 16,
                                                            "stream": True, "guided_regex": "a(?=b)"}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "a"
    error = chunks[-1]["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_regex", chunks[-1]
    assert error["message"].startswith("guided_regex: the answer cannot be finished"), chunks[-1]
    chunks = named_events(dead_ends.post("/v1/messages", json={**ASK, "max_tokens": 16, "stream": True,
                                                               "output_format": {"type": "json_schema",
                                                                                 "schema": LOOKAHEAD}}))
    assert chunks[-1]["type"] == "error" and chunks[-1]["error"]["type"] == "invalid_request_error", chunks[-1]
    assert chunks[-1]["error"]["message"].startswith("output_format: the answer cannot be finished")
    chunks = named_events(dead_ends.post("/v1/responses", json={
        "model": NAME, "input": "hi", "max_output_tokens": 16, "stream": True,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": LOOKAHEAD}}}))
    assert chunks[-1]["type"] == "response.failed", chunks[-1]
    assert chunks[-1]["response"]["error"]["message"].startswith("text: the answer cannot be finished")


def test_dead_ends_found_up_front_and_whole_documents_under_min_tokens(dead_ends):
    """A `regex`-package pattern that no token can start is refused before the stream opens; `min_tokens` that
    would hold back the stop after a whole document gives way (vLLM's too): the answer ends there."""
    for stream in (False, True):
        r = dead_ends.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 8,
                                                    "stream": stream, "guided_regex": "(?=x)y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        assert "no token of the vocabulary starts a match" in r.json()["error"]["message"]
    r = dead_ends.post("/v1/chat/completions", json={**ASK, "max_tokens": 8, "min_tokens": 5,
                                                     "guided_choice": ["a"]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "a" and choice["finish_reason"] == "stop", choice
