"""Structured outputs through `openm3 serve`: Chat Completions' and Completions' `response_format`, the Responses
API's `text.format` and Anthropic's `output_format` / `output_config.format` make a random model's answers JSON
that follows the schema (checked with `jsonschema`), greedy and sampled, streamed and not, on the one-request and
the batching backends; a bad schema or a backend that cannot constrain is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from openm3.engine.batching import BatchedGenerator
from openm3.engine.tool_grammar import END, START
from openm3.models import M3TextConfig, M3TextModel
from openm3.serve import ModelBackend, create_app
from openm3.serve.responses import ResponsesRequest, _output_spec
from openm3.serve.schemas import ChatCompletionRequest
from openm3.serve.structured import StructuredOutputs

from test_serve import NAME, Slow, events, model, named_events, tok  # noqa: F401 - fixtures and helpers

# Every document it allows is short (a boolean, one of three words, a small array of them), so a random model
# must finish within the token limit.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "tags"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}
LIMIT = 256


@pytest.fixture(scope="module", params=["model", "batched"])
def client(request, model, tok):
    if request.param == "model":
        yield TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))
        return
    backend = BatchedGenerator(model, token_budget=8 * LIMIT, max_batch=8, chunk_size=64)
    yield TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT))
    backend.close()


def valid(text: str) -> dict:
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
ASK = {"model": NAME, "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 200}


def test_chat_answers_follow_the_schema(client):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 4, "n": 3}):
        r = client.post("/v1/chat/completions", json={**ASK, **sampling, "response_format": FORMAT})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            valid(choice["message"]["content"])
    free = client.post("/v1/chat/completions", json={**ASK, "temperature": 0, "max_tokens": 20}).json()
    with pytest.raises(ValueError):  # unconstrained, the random model writes no JSON
        valid(free["choices"][0]["message"]["content"])


def test_streamed_chat_equals_the_plain_answer(client):
    body = {**ASK, "temperature": 0, "response_format": FORMAT}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    chunks = events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain
    valid(plain)


def test_completions_responses_and_messages_follow_the_schema(client):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "JSON:", "max_tokens": 200, "temperature": 0.8,
                                             "seed": 1, "response_format": FORMAT})
    valid(r.json()["choices"][0]["text"])

    flat = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r = client.post("/v1/responses", json={"model": NAME, "input": "Reply in JSON.", "max_output_tokens": 200,
                                           "temperature": 0, "text": {"format": flat}})
    message = [item for item in r.json()["output"] if item["type"] == "message"][0]
    valid(message["content"][0]["text"])
    chunks = named_events(client.post("/v1/responses", json={"model": NAME, "input": "Reply in JSON.",
                                                             "max_output_tokens": 200, "temperature": 0,
                                                             "stream": True, "text": {"format": flat}}))
    streamed = chunks[-1]["response"]["output"][-1]["content"][0]["text"]
    assert streamed == message["content"][0]["text"]

    ask = {"model": NAME, "max_tokens": 200, "temperature": 0,
           "messages": [{"role": "user", "content": "Reply in JSON."}]}
    for field in ({"output_format": {"type": "json_schema", "schema": SCHEMA}},
                  {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}):
        r = client.post("/v1/messages", json={**ask, **field})
        assert r.status_code == 200, r.text
        valid(r.json()["content"][-1]["text"])
    prefill = '{"ok": false, "color": "'
    r = client.post("/v1/messages", json={**ask, "output_format": {"type": "json_schema", "schema": SCHEMA},
                                          "messages": ask["messages"] + [{"role": "assistant", "content": prefill}]})
    assert r.status_code == 200, r.text
    assert valid(prefill + r.json()["content"][-1]["text"])["ok"] is False
    # a given start the grammar refuses: a 400 naming messages, as Anthropic's prefill and as vLLM's
    # continue_final_message
    r = client.post("/v1/messages", json={**ask, "output_format": {"type": "json_schema", "schema": SCHEMA},
                                          "messages": ask["messages"] + [{"role": "assistant", "content": "[1"}]})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"], r.text
    r = client.post("/v1/chat/completions", json={
        **ask, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        "messages": ask["messages"] + [{"role": "assistant", "content": "[1"}], "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_json_object_mode_writes_an_object(client):
    r = client.post("/v1/chat/completions", json={**ASK, "temperature": 0, "max_tokens": 120,
                                                  "response_format": {"type": "json_object"}})
    content, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
    assert content.lstrip().startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(content), dict)


BAD = [
    ("unknown-keyword", "/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "patternProperties": {"a": {}}}}}}, "response_format"),
    ("bad-type", "/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("schema-without-type", "/v1/chat/completions", {"response_format": {"type": "json_object", "json_schema": {
        "name": "x", "schema": {}}}}, "response_format"),
    ("responses-bad-schema", "/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "text"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_formats_are_refused_by_name(model, tok, path, body, param):
    app = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))
    base = {"messages": ASK["messages"]} if path != "/v1/responses" else {"input": "x"}
    r = app.post(path, json={"model": NAME, **base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_backend_that_cannot_constrain_refuses_formats(tok):
    app = TestClient(create_app(Slow(tok.vocab_size), tok, model_name=NAME, max_total_tokens=LIMIT))
    r = app.post("/v1/chat/completions", json={**ASK, "response_format": FORMAT})
    assert r.status_code == 400 and "structured outputs" in r.json()["error"]["message"]
    r = app.post("/v1/messages", json={"model": NAME, "max_tokens": 5, "messages": ASK["messages"],
                                       "output_format": {"type": "json_schema", "schema": SCHEMA}})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_vllm_guided_fields(client, model, tok):
    """(The chat answers here come from a server without the reasoning parser: with it, a random model may open a
    think block, where the grammar does not apply, and never close it.)"""
    choices = ["yes", "no", "maybe so"]
    plain = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT,
                                  reasoning_parser="none"))
    for field in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        r = plain.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "seed": 2, "n": 3, **field})
        assert r.status_code == 200, r.text
        assert all(c["message"]["content"] in choices and c["finish_reason"] == "stop" for c in r.json()["choices"])
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "Answer:", "max_tokens": 10, "temperature": 0,
                                             "structured_outputs": {"choice": choices}})
    assert r.json()["choices"][0]["text"] in choices
    for field in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        r = plain.post("/v1/chat/completions", json={**ASK, "temperature": 0.9, "seed": 5, **field})
        valid(r.json()["choices"][0]["message"]["content"])
    pattern = r"[0-9]{3}-[a-c]{2,4}( ok)?"
    for field in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        r = plain.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "top_p": 0.9, "seed": 3, "n": 3,
                                                     **field})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert re.fullmatch(pattern, c["message"]["content"]) and c["finish_reason"] == "stop", c
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "Id:", "max_tokens": 12, "temperature": 0,
                                             "guided_regex": pattern})
    assert re.fullmatch(pattern, r.json()["choices"][0]["text"])
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "Id:", "guided_regex": "[a-"})
    assert r.status_code == 400 and "does not compile" in r.json()["error"]["message"]
    keyed = {"type": "object", "required": ["id"], "additionalProperties": False,
             "properties": {"id": {"type": "string", "pattern": "^[a-c]{2}-[0-9]é?$"}}}  # a JSON string's pattern
    r = plain.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "seed": 4, "n": 3, "guided_json": keyed})
    for c in r.json()["choices"]:  # as JSON Schema's Python checkers read a pattern: `$` takes a final newline too
        assert re.search(keyed["properties"]["id"]["pattern"], json.loads(c["message"]["content"])["id"]), c


def test_vllm_guided_grammar(model, tok):
    """`guided_grammar` / `structured_outputs.grammar` (Lark's EBNF, GBNF): every sampled answer is a sentence
    Lark parses; a grammar that cannot be followed is a 400 naming the problem."""
    import lark

    lark_text = 'start: "SELECT " col ("," col)? " FROM " tab\ncol: "a" | "b" | "id"\ntab: "t1" | "t2"'
    gbnf = 'root ::= "SELECT " col ("," col)? " FROM " tab\ncol ::= "a" | "b" | "id"\ntab ::= "t1" | "t2"'
    parser = lark.Lark(lark_text, parser="earley", lexer="dynamic")
    plain = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT,
                                  reasoning_parser="none"))
    for field in ({"guided_grammar": lark_text}, {"structured_outputs": {"grammar": gbnf}}):
        r = plain.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "seed": 3, "n": 3, **field})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            parser.parse(c["message"]["content"])  # raises unless a sentence
            assert c["finish_reason"] == "stop"
    r = plain.post("/v1/completions", json={"model": NAME, "prompt": "Q:",
                                            "guided_grammar": 'start: a\na: b a "x" | "y"\nb: "z"?'})
    assert r.status_code == 400 and "left-recursive" in r.json()["error"]["message"]
    answers = [plain.post("/v1/chat/completions", json={**ASK, "temperature": 0, "max_tokens": 40, **field}).json()
               ["choices"][0]["message"]["content"] for field in ({"structured_outputs": {"json_object": True}},
                                                                  {"response_format": {"type": "json_object"}})]
    assert answers[0] == answers[1] and answers[0].lstrip().startswith("{")  # vLLM's json_object: any object
    r = plain.post("/v1/chat/completions", json={**ASK, "structured_outputs": {"structural_tag": {"type": "x"}}})
    assert r.status_code == 400 and "structural_tag" in r.json()["error"]["message"]


def test_two_output_constraints_are_refused(model, tok):
    app = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))
    r = app.post("/v1/chat/completions", json={**ASK, "response_format": FORMAT, "guided_choice": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "response_format, guided_choice" in r.json()["error"]["message"]


TOOL_SCHEMA = {"type": "object", "required": ["on"], "additionalProperties": False,
               "properties": {"on": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}}}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "set_flag", "parameters": TOOL_SCHEMA}},
                {"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
                                                                                 "properties": {}}}}]


def called(arguments: dict) -> dict:
    jsonschema.validate(arguments, TOOL_SCHEMA)
    return arguments


@pytest.fixture(scope="module", params=["model", "batched"])
def tools_client(request, tok):
    """A model with room for the tools' descriptions in its prompts (their JSON takes ~340 tokens here), served
    without the reasoning parser (with it, a random model may open a think block first and never close it)."""
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=tok.vocab_size, num_hidden_layers=2,
                                    layer_types=["full_attention", "minimax_m3_sparse"],
                                    mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                    max_position_embeddings=1024)
    model = M3TextModel(config).eval()
    if request.param == "model":
        yield TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=1024,
                                    reasoning_parser="none"))
        return
    backend = BatchedGenerator(model, token_budget=4096, max_batch=4, chunk_size=256)
    yield TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=1024, reasoning_parser="none"))
    backend.close()


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_bounds_a_forced_call(tok, parallel):
    """`parallel_tool_calls: false` on a forced call: its grammar takes one call and then only the block's end."""
    req = ChatCompletionRequest(**ASK, tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    constraint = StructuredOutputs(tok).factory(req.output_spec())()
    ping = b'<invoke name="ping">\n</invoke>\n'
    constraint.read(START + b"\n" + ping)
    if parallel:
        constraint.read(ping + END)
    else:
        with pytest.raises(ValueError, match="not the beginning"):
            constraint.read(ping)
        constraint.read(END)
    assert constraint.complete
    flat = [{"type": "function", **t["function"]} for t in OPENAI_TOOLS]
    responses_req = ResponsesRequest(model=NAME, input="x", tools=flat, tool_choice="required",
                                     parallel_tool_calls=parallel)
    assert _output_spec(responses_req) == req.output_spec()


def test_forced_tool_calls_through_every_api(tools_client):
    """A random model forced to call a tool writes a well-formed call: parsed into each API's tool-call form,
    with arguments that follow the tool's schema."""
    client = tools_client
    named = {"type": "function", "function": {"name": "set_flag"}}
    for stream in (False, True):
        body = {**ASK, "temperature": 0, "tools": OPENAI_TOOLS, "tool_choice": named, "stream": stream}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            chunks = events(r)
            calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = r.json()["choices"][0]
            calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        assert finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["set_flag"]
        called(json.loads(calls[0]["function"]["arguments"]))
    r = client.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "seed": 7, "n": 2, "tools": OPENAI_TOOLS,
                                                  "tool_choice": "required"})
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "tool_calls":  # several calls may run past max_tokens
            for call in choice["message"]["tool_calls"]:
                if call["function"]["name"] == "set_flag":
                    called(json.loads(call["function"]["arguments"]))
                else:
                    assert json.loads(call["function"]["arguments"]) == {}

    # parallel_tool_calls false: the grammar allows one call (the sampled answers end after it)
    r = client.post("/v1/chat/completions", json={**ASK, "temperature": 1.0, "seed": 3, "n": 4, "tools": OPENAI_TOOLS,
                                                  "tool_choice": "required", "parallel_tool_calls": False})
    finished = [c for c in r.json()["choices"] if c["finish_reason"] == "tool_calls"]
    assert finished and all(len(c["message"]["tool_calls"]) == 1 for c in finished)

    flat = [{"type": "function", **t["function"]} for t in OPENAI_TOOLS]
    r = client.post("/v1/responses", json={"model": NAME, "input": "x", "max_output_tokens": 200, "temperature": 0,
                                           "tools": flat, "tool_choice": {"type": "function", "name": "set_flag"}})
    items = [i for i in r.json()["output"] if i["type"] == "function_call"]
    assert [i["name"] for i in items] == ["set_flag"]
    called(json.loads(items[0]["arguments"]))

    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                       for t in OPENAI_TOOLS]
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 200, "temperature": 0,
                                          "messages": ASK["messages"], "tools": anthropic_tools,
                                          "tool_choice": {"type": "tool", "name": "set_flag"}})
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "tool_use"
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["set_flag"]
    called(uses[0]["input"])


def test_forced_call_string_values_keep_their_max_length(tools_client):
    """A sampled forced call with a `maxLength` string parameter ends with the call, its value UTF-8 of at most
    maxLength characters (the raw value once took stray UTF-8 continuation bytes past its length until
    max_tokens)."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 10}}}}}]
    r = tools_client.post("/v1/chat/completions", json={**ASK, "max_tokens": 120, "temperature": 1.0, "seed": 1,
                                                         "n": 4, "tools": tools, "tool_choice": "required",
                                                         "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice["message"]
        [call] = choice["message"]["tool_calls"]
        city = json.loads(call["function"]["arguments"])["city"]
        assert len(city) <= 10 and "\ufffd" not in city, city


FORCED_BAD = [
    ("no-tools", "/v1/chat/completions", {"messages": ASK["messages"], "tool_choice": "required"}, "tool_choice"),
    ("unknown-name", "/v1/chat/completions", {"messages": ASK["messages"], "tools": OPENAI_TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("with-a-format", "/v1/chat/completions", {"messages": ASK["messages"], "tools": OPENAI_TOOLS,
                                               "tool_choice": "required", "response_format": FORMAT}, "tool_choice"),
    ("responses-no-tools", "/v1/responses", {"input": "x", "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in FORCED_BAD], ids=[b[0] for b in FORCED_BAD])
def test_bad_forced_calls_name_the_field(model, tok, path, body, param):
    app = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=1024))  # refused first
    r = app.post(path, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_model_wider_than_the_tokenizer_is_constrained(tok):
    """m3-small's 32768 logits over the 4096-token trained tokenizer (what `openm3 serve --preset m3-small` runs):
    constrained picks stay among the tokenizer's ids (they crashed on the width), in JSON answers and in forced
    tool calls, on the batching backend too."""
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=tok.vocab_size + 200, num_hidden_layers=2,
                                    layer_types=["full_attention", "minimax_m3_sparse"],
                                    mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                    max_position_embeddings=1024)
    wide = M3TextModel(config).eval()
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"enum": ["Oslo", "Rome"]}}}}}]
    calls = 0
    for backend in (ModelBackend(wide), BatchedGenerator(wide, token_budget=4096, max_batch=4, chunk_size=64)):
        app = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=1024))
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 2, "n": 2}):
            r = app.post("/v1/chat/completions", json={**ASK, **sampling, "response_format": FORMAT})
            assert r.status_code == 200, r.text
            for choice in r.json()["choices"]:
                valid(choice["message"]["content"])
            r = app.post("/v1/chat/completions", json={**ASK, **sampling, "max_tokens": 120, "tools": tools,
                                                       "tool_choice": "required", "parallel_tool_calls": False})
            assert r.status_code == 200, r.text
            for choice in r.json()["choices"]:
                if choice["finish_reason"] == "length":  # a random model may think (free text) until max_tokens
                    assert choice["message"]["reasoning_content"] and not choice["message"]["content"], choice
                    continue
                assert choice["finish_reason"] == "tool_calls", choice
                [call] = choice["message"]["tool_calls"]
                assert json.loads(call["function"]["arguments"])["city"] in ("Oslo", "Rome")
                calls += 1
        if isinstance(backend, BatchedGenerator):
            backend.close()
    assert calls >= 3  # of 6 answers
