"""Structured outputs through `openm3 serve`: Chat Completions' and Completions' `response_format`, the Responses
API's `text.format` and Anthropic's `output_format` / `output_config.format` make a random model's answers JSON
that follows the schema (checked with `jsonschema`), greedy and sampled, streamed and not, on the one-request and
the batching backends; a bad schema or a backend that cannot constrain is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from openm3.engine.batching import BatchedGenerator
from openm3.serve import ModelBackend, create_app

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


def test_two_output_constraints_are_refused(model, tok):
    app = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))
    r = app.post("/v1/chat/completions", json={**ASK, "response_format": FORMAT, "guided_choice": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "response_format, guided_choice" in r.json()["error"]["message"]
