"""Requests that passed validation and then failed inside the server (500s, an unended stream), or that held the
engine's thread for every client, or that were taken and quietly ignored or read loosely: each is a 400 naming
its field now, or is served. (Found by feeding the server odd requests; `tests/test_serve*.py` covers the ordinary
ones.)"""

import json
import math

import pytest
import torch
from fastapi.testclient import TestClient
from test_serve import NAME, Scripted, client, model, named_events, tok  # noqa: F401 - fixtures

from openm3.data.tokenizer import EOS
from openm3.engine.penalties import PenalizedPicker, Penalties
from openm3.engine.sampling import SamplingParams, sample
from openm3.serve import create_app
from openm3.serve.anthropic import MessagesRequest
from openm3.serve.responses import ResponsesRequest
from openm3.serve.schemas import MAX_BAD_WORDS, MAX_STOP_SEQUENCES, ChatCompletionRequest, CompletionRequest
from openm3.serve.tokens import DetokenizeRequest

LONE = '"a\\ud800b"'  # raw JSON: a lone high surrogate, which json.loads takes into a str


@pytest.fixture(scope="module")
def scripted(tok):  # noqa: F811
    return TestClient(create_app(Scripted(tok.encode("fine" + EOS), tok.vocab_size), tok, model_name=NAME,
                                 max_total_tokens=4096))


def chat(**fields) -> dict:
    return {"model": NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    return body


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"model":"tiny","max_tokens":3,"messages":[{"role":"user","content":%s}]}'),
    ("/v1/completions", '{"model":"tiny","max_tokens":3,"prompt":%s}'),
    ("/v1/messages", '{"model":"tiny","max_tokens":3,"messages":[{"role":"user","content":%s}]}'),
    ("/v1/responses", '{"model":"tiny","max_output_tokens":3,"input":%s}'),
    ("/tokenize", '{"model":"tiny","prompt":%s}'),
], ids=["chat", "completions", "messages", "responses", "tokenize"])
def test_a_lone_surrogate_in_the_text_is_a_400(scripted, path, body):
    r = scripted.post(path, content=(body % LONE).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "holds a lone surrogate '\\\\ud800', which is not valid Unicode" in r.text
    assert scripted.post("/v1/chat/completions", json=chat()).status_code == 200  # the server goes on


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat()),
    ("/v1/completions", {"model": NAME, "max_tokens": 3, "prompt": "hi"}),
    ("/v1/messages", chat()),
    ("/v1/responses", {"model": NAME, "max_output_tokens": 3, "input": "hi"}),
], ids=["chat", "completions", "messages", "responses"])
@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_outside_int64_is_a_400_naming_it(scripted, path, body, seed):
    r = scripted.post(path, json={**body, "seed": seed})
    assert r.status_code == 400 and "seed" in r.text, r.text


def test_the_largest_seed_with_several_choices_is_served(client):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, "n": 2,
                                             "temperature": 1.0, "seed": 2**63 - 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 9e-6])
def test_a_tiny_temperature_samples_greedily(client, temperature):
    """logits / 1e-40 overflowed to inf and the softmax to NaN (a 500): below 1e-5 a temperature is greedy, as in
    vLLM."""
    greedy = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 4,
                                                  "temperature": 0}).json()["choices"][0]["text"]
    for path, body in (("/v1/completions", {"model": NAME, "prompt": "hello", "max_tokens": 4}),
                       ("/v1/messages", {"model": NAME, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hello"}]})):
        r = client.post(path, json={**body, "temperature": temperature})
        assert r.status_code == 200, r.text
    assert r.status_code == 200
    again = client.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 4,
                                                 "temperature": temperature}).json()["choices"][0]["text"]
    assert again == greedy
    assert SamplingParams(temperature).greedy and not SamplingParams(1e-5).greedy


@pytest.mark.parametrize("penalty", [1e-300, 1e-30, 1e30])
def test_an_extreme_repetition_penalty_keeps_the_row_finite(penalty):
    """A positive logit divided by 1e-300 was inf, and the softmax of a row with infs NaN; masked tokens stay
    masked."""
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -math.inf])
    picker = PenalizedPicker(Penalties(repetition=penalty), prompt=[0, 1, 3, 4])
    out = picker.adjust(row, SamplingParams(1.0))
    assert torch.isfinite(out[:4]).all() and out[4] == -math.inf
    probs = out.softmax(-1)
    assert not probs.isnan().any()
    token = int(sample(out[None], SamplingParams(1.0), torch.Generator().manual_seed(0))[0])
    assert 0 <= token < 4


def test_a_non_finite_repetition_penalty_is_a_400_naming_it(scripted):
    r = scripted.post("/v1/chat/completions", content=b'{"model":"tiny","messages":[{"role":"user","content":"x"}],'
                      b'"repetition_penalty":Infinity}', headers={"content-type": "application/json"})
    assert error_of(r)["param"] == "repetition_penalty"


def test_min_tokens_with_only_stop_tokens_allowed_is_a_400(client, tok):  # noqa: F811
    """Every logit masked made the softmax NaN (a 500)."""
    for fields in ({"stop_token_ids": [5, 6], "allowed_token_ids": [5, 6, tok.eos_id]},
                   {"stop_token_ids": list(range(tok.vocab_size))}):
        r = client.post("/v1/chat/completions", json=chat(min_tokens=2, **fields))
        assert error_of(r)["param"] == "min_tokens" and "every token this request allows is a stop token" in r.text
    r = client.post("/v1/chat/completions", json=chat(min_tokens=2, stop_token_ids=[5], allowed_token_ids=[5, 7]))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 2


def test_stop_sequences_and_bad_words_are_bounded(scripted):
    """Each is matched at every token on the engine's one thread: 20,000 of them slowed every client's decoding
    ~80x."""
    r = scripted.post("/v1/messages", json=chat(stop_sequences=[f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]))
    assert r.status_code == 400 and f"at most {MAX_STOP_SEQUENCES}" in r.text
    assert scripted.post("/v1/messages", json=chat(stop_sequences=["s"] * MAX_STOP_SEQUENCES)).status_code == 200
    r = scripted.post("/v1/chat/completions", json=chat(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)]))
    assert error_of(r)["param"] == "bad_words"


def test_a_reasoning_items_summary_that_is_not_a_list_is_a_400(scripted):
    for summary in (5, True, "text"):
        r = scripted.post("/v1/responses", json={"model": NAME, "input": [
            {"type": "reasoning", "summary": summary}, {"type": "message", "role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "input[0].summary: expected a list of parts" in r.text, r.text


def test_a_negative_starting_after_is_a_400(tok):  # noqa: F811
    client = TestClient(create_app(Scripted(tok.encode("a b" + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=4096))
    with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "x", "background": True,
                                                      "stream": True}) as r:
        rid = next(e for e in named_events_of(r) if e["type"] == "response.created")["response"]["id"]
    r = client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": -3})
    assert error_of(r)["param"] == "starting_after"
    numbers = [e["sequence_number"] for e in named_events(client.get(
        f"/v1/responses/{rid}", params={"stream": "true", "starting_after": -1}))]
    assert numbers == list(range(len(numbers)))  # -1: from the first event, each once


def test_a_stored_responses_query_parameters_are_read_strictly(tok):  # noqa: F811
    """`GET /v1/responses/{id}` took `stream=1`, `yes` or `True` as true and `starting_after=+5`, ` 5`, `5.0` or
    `1_0` as integers (FastAPI's lax bool and int): `stream` is `true` or `false` and an integer its digits, as in
    OpenAI's API; anything else is a 400 naming the parameter."""
    client = TestClient(create_app(Scripted(tok.encode("a b" + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=4096))
    with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "x", "background": True,
                                                      "stream": True}) as r:
        rid = next(e for e in named_events_of(r) if e["type"] == "response.created")["response"]["id"]
    path = f"/v1/responses/{rid}"
    _refused(client, path, {"stream": "@"}, ("1", "0", "yes", "True", "on", ""), "true or false", "stream", "stream",
             method="GET")
    _refused(client, path, {"stream": "true", "starting_after": "@"}, ("+5", " 5", "5.0", "1_0", "1e1", "", "\u0663"),
             "an integer", "starting_after", "starting_after", method="GET")
    assert client.get(path, params={"stream": "false"}).json()["id"] == rid
    events = named_events(client.get(path, params={"stream": "true"}))
    assert named_events(client.get(path, params={"stream": "true", "starting_after": "02"})) == events[3:]


def named_events_of(response) -> list[dict]:
    """A streamed response's events read whole (the stream's context open)."""
    response.read()
    return named_events(response)


@pytest.mark.parametrize("background", [False, True], ids=["plain", "background"])
def test_a_streamed_response_whose_generation_fails_ends_failed_and_is_stored(tok, background):  # noqa: F811
    def broken(prompt, **_):
        raise RuntimeError("out of memory")

    client = TestClient(create_app(broken, tok, model_name=NAME, max_total_tokens=4096),
                        raise_server_exceptions=False)
    with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "x", "stream": True,
                                                      "background": background}) as r:
        events = named_events_of(r)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "out of memory"}
    stored = client.get(f"/v1/responses/{failed['id']}").json()
    assert stored["status"] == "failed" and stored["error"] == failed["error"]


def _tools(api: str, names: list[str]) -> list[dict]:
    if api == "anthropic":
        return [{"name": n, "input_schema": {"type": "object"}} for n in names]
    if api == "responses":
        return [{"type": "function", "name": n, "parameters": {"type": "object"}} for n in names]
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in names]


@pytest.mark.parametrize("api,path,body", [
    ("chat", "/v1/chat/completions", chat()),
    ("anthropic", "/v1/messages", chat()),
    ("responses", "/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 3}),
], ids=["chat", "messages", "responses"])
def test_tool_names_that_break_the_markup_or_repeat_are_400s(scripted, api, path, body):
    """A name is written into `<invoke name="...">` as it is: a quote or a newline broke the call's markup, and
    two tools of one name could not be told apart."""
    for names in (['say"hi'], ["a\nb"], ["<tag>"], ["ok", "ok"]):
        r = scripted.post(path, json={**body, "tools": _tools(api, names)})
        assert r.status_code == 400, (names, r.text)
    assert "is tools[0]'s name too" in r.text
    r = scripted.post(path, json={**body, "tools": _tools(api, ["read_file", "mcp__git__log", "ns.tool:v2"])})
    assert r.status_code == 200, r.text


def test_misleading_messages_and_loose_types(scripted):
    r = scripted.post("/tokenize", json={"model": NAME})
    assert error_of(r)["message"] == "body: give prompt or messages, not both or neither"
    r = scripted.post("/v1/completions", json={"model": NAME, "prompt": [True, 2], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"  # true is not token id 1
    r = scripted.post("/v1/messages", json={"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": None}]}]})
    assert r.status_code == 400 and "messages[0].content[0].text: expected a string, got NoneType" in r.text


class Constraining(Scripted):
    """A scripted backend that takes constraints (and ignores them): the checks before generation run in full."""

    supports_constraints = True

    def __call__(self, prompt, *, constraint=None, **kw):
        return super().__call__(prompt, **kw)


def constraining_client(tok, **options) -> TestClient:
    return TestClient(create_app(Constraining(tok.encode("fine" + EOS), tok.vocab_size), tok, model_name=NAME,
                                 max_total_tokens=4096, reasoning_parser="none", **options))


BAD_PARAMETERS = {"type": "object", "properties": 5}  # `properties` must be an object
FORCED = [  # (id, path, body): a malformed tool schema under each forced choice, and unforced (constrain_tool_calls)
    ("chat-required", "/v1/chat/completions", chat(tools=_tools("chat", ["f"]), tool_choice="required")),
    ("chat-named", "/v1/chat/completions", chat(tools=_tools("chat", ["f"]), tool_choice={
        "type": "function", "function": {"name": "f"}})),
    ("chat-allowed", "/v1/chat/completions", chat(tools=_tools("chat", ["f"]), tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "f"}}]}})),
    ("chat-auto", "/v1/chat/completions", chat(tools=_tools("chat", ["f"]))),
    ("responses-required", "/v1/responses", {"model": NAME, "input": "hi", "tools": _tools("responses", ["f"]),
                                             "tool_choice": "required"}),
    ("responses-named", "/v1/responses", {"model": NAME, "input": "hi", "tools": _tools("responses", ["f"]),
                                          "tool_choice": {"type": "function", "name": "f"}}),
    ("responses-auto", "/v1/responses", {"model": NAME, "input": "hi", "tools": _tools("responses", ["f"])}),
    ("messages-any", "/v1/messages", chat(tools=_tools("anthropic", ["f"]), tool_choice={"type": "any"})),
    ("messages-tool", "/v1/messages", chat(tools=_tools("anthropic", ["f"]), tool_choice={"type": "tool",
                                                                                           "name": "f"})),
    ("messages-auto", "/v1/messages", chat(tools=_tools("anthropic", ["f"]))),
]


def _malformed(body: dict) -> dict:
    """`body` with its one tool's parameters (input_schema) malformed."""
    tool = dict(body["tools"][0])
    if "function" in tool:
        tool["function"] = {**tool["function"], "parameters": BAD_PARAMETERS}
    else:
        tool["input_schema" if "input_schema" in tool else "parameters"] = BAD_PARAMETERS
    return {**body, "tools": [tool]}


@pytest.mark.parametrize("path,body", [f[1:] for f in FORCED], ids=[f[0] for f in FORCED])
def test_a_malformed_tool_schema_names_tools_whatever_asked_for_its_grammar(tok, path, body):  # noqa: F811
    """A forced call named `tool_choice` for what is the tool definition's fault; the unforced case under
    --constrain-tool-calls named `tools`: both name the tool in `tools` now."""
    r = constraining_client(tok, constrain_tool_calls=True).post(path, json=_malformed(body))
    assert r.status_code == 400, r.text
    if path == "/v1/messages":  # (Anthropic's tools hold their parameters' schema in `input_schema`)
        message = r.json()["error"]["message"]
        assert message.startswith("tools: the input_schema of tool 'f': "), message
    else:
        message = error_of(r)["message"]
        assert error_of(r)["param"] == "tools", r.text
        assert message.startswith("tools: the parameters of tool 'f': "), message
    assert constraining_client(tok, constrain_tool_calls=True).post(path, json=body).status_code == 200


def test_a_forced_call_of_an_unknown_tool_names_tool_choice_once(tok):  # noqa: F811
    client = constraining_client(tok)
    r = client.post("/v1/messages", json=chat(tools=_tools("anthropic", ["f"]), tool_choice={"type": "tool",
                                                                                             "name": "g"}))
    assert r.status_code == 400 and r.json()["error"]["message"] == "tool_choice: 'g' is not among the tools (['f'])"
    r = client.post("/v1/chat/completions", json=chat(tools=_tools("chat", ["f"]), tool_choice={
        "type": "function", "function": {"name": "g"}}))
    assert error_of(r) == {"message": "tool_choice: 'g' is not among the tools (['f'])",
                           "type": "invalid_request_error", "param": "tool_choice", "code": None}


EFFORTS = "'none', 'minimal', 'low', 'medium', 'high' or 'xhigh'"


@pytest.mark.parametrize("effort", [5, "turbo", "HIGH", True])
def test_a_reasoning_effort_outside_openais_is_a_400_listing_them(tok, effort):  # noqa: F811
    """`reasoning: {"effort": 5}` was taken and unused (and any string reached the template as it was)."""
    client = constraining_client(tok)
    r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "reasoning": {"effort": effort}})
    error = error_of(r)
    assert error["param"] == "reasoning" and error["message"].startswith(
        f"reasoning.effort: expected {EFFORTS}, got "), error
    error = error_of(client.post("/v1/chat/completions", json=chat(reasoning_effort=effort)))
    assert error["param"] == "reasoning_effort" and error["message"].startswith(
        f"reasoning_effort: expected {EFFORTS}, got "), error


def test_each_of_openais_reasoning_efforts_is_served(tok):  # noqa: F811
    client = constraining_client(tok)
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", None):
        r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "max_output_tokens": 3,
                                               "reasoning": {"effort": effort, "summary": "auto"}})
        assert r.status_code == 200, r.text
        assert client.post("/v1/chat/completions", json=chat(reasoning_effort=effort)).status_code == 200


UNUSED_SETTINGS = [  # (id, path, body, what the message opens with, the good values): checked, though not used
    ("responses-verbosity", "/v1/responses", {"text": {"verbosity": "ultra"}}, "text.verbosity: expected 'low'",
     [{"text": {"verbosity": v}} for v in ("low", "medium", "high", None)]),
    ("responses-summary", "/v1/responses", {"reasoning": {"summary": 5}}, "reasoning.summary: expected 'auto'",
     [{"reasoning": {"summary": v}} for v in ("auto", "concise", "detailed")]),
    ("responses-generate-summary", "/v1/responses", {"reasoning": {"generate_summary": True}},
     "reasoning.generate_summary: expected 'auto'", [{"reasoning": {"generate_summary": "concise"}}]),
    ("messages-effort", "/v1/messages", {"output_config": {"effort": 5}}, "output_config.effort: expected 'low'",
     [{"output_config": {"effort": v}} for v in ("low", "medium", "high", "xhigh", "max")]),
    ("messages-effort-word", "/v1/messages", {"output_config": {"effort": "huge"}}, "output_config.effort: expected",
     []),
    ("messages-thinking-type", "/v1/messages", {"thinking": {"type": "bogus"}}, "thinking.type: expected 'enabled'",
     [{"thinking": {"type": "adaptive"}}, {"thinking": {"type": "disabled"}}]),
    ("messages-adaptive-budget", "/v1/messages", {"thinking": {"type": "adaptive", "budget_tokens": 2048}},
     "thinking.budget_tokens: thinking of type adaptive takes no budget_tokens", []),
]


@pytest.mark.parametrize("path,body,message,good", [u[1:] for u in UNUSED_SETTINGS],
                         ids=[u[0] for u in UNUSED_SETTINGS])
def test_settings_taken_but_unused_are_still_checked(tok, path, body, message, good):  # noqa: F811
    """Responses' `text.verbosity` and `reasoning.summary`, Anthropic's `output_config.effort` and `thinking.type`
    were taken with any value (`effort: 5`, a thinking type no API has) and unused: a 400 naming the field, as the
    APIs they come from answer, while their own values are served."""
    client = constraining_client(tok)
    base = {"model": NAME, "input": "hi", "max_output_tokens": 3} if path == "/v1/responses" else chat()
    r = client.post(path, json={**base, **body})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith(message), r.text
    if path == "/v1/responses":
        assert r.json()["error"]["param"] == next(iter(body))
    for fields in good:
        assert client.post(path, json={**base, **fields}).status_code == 200, fields


def test_a_json_schema_format_without_its_schema_is_a_400(tok):  # noqa: F811
    """Responses' `text.format` of type json_schema without `schema` was served as any JSON (OpenAI requires the
    schema there); a schema beside another type was ignored."""
    client = constraining_client(tok)
    ask = {"model": NAME, "input": "hi", "max_output_tokens": 3}
    for fmt in ({"type": "json_schema"}, {"type": "json_schema", "name": "answer"}):
        error = error_of(client.post("/v1/responses", json={**ask, "text": {"format": fmt}}))
        assert error["param"] == "text" and error["message"].startswith(
            "text.format.schema: type 'json_schema' needs the schema"), error
    error = error_of(client.post("/v1/responses", json={**ask, "text": {"format": {"type": "text", "schema": {}}}}))
    assert error["message"] == "text.format.schema: a schema is given only with type 'json_schema', not 'text'"
    for fmt in ({"type": "json_schema", "name": "a", "schema": {"type": "object"}}, {"type": "json_object"},
                {"type": "json_schema", "schema": True}, {"type": "text"}):
        assert client.post("/v1/responses", json={**ask, "text": {"format": fmt}}).status_code == 200, fmt
    # Chat Completions: json_schema's object is required (its schema is optional there, as in OpenAI's API)
    error = error_of(client.post("/v1/chat/completions", json=chat(response_format={"type": "json_schema"})))
    assert error["param"] == "response_format" and "needs a json_schema object" in error["message"], error


INTEGERS = [  # (id, path, body, the integer field, its param)
    ("chat-max_tokens", "/v1/chat/completions", chat(), "max_tokens", "max_tokens"),
    ("chat-max_completion_tokens", "/v1/chat/completions", chat(), "max_completion_tokens", "max_completion_tokens"),
    ("chat-n", "/v1/chat/completions", chat(), "n", "n"),
    ("chat-top_logprobs", "/v1/chat/completions", chat(logprobs=True), "top_logprobs", "top_logprobs"),
    ("chat-seed", "/v1/chat/completions", chat(), "seed", "seed"),
    ("completions-max_tokens", "/v1/completions", {"model": NAME, "prompt": "hi"}, "max_tokens", "max_tokens"),
    ("completions-logprobs", "/v1/completions", {"model": NAME, "prompt": "hi"}, "logprobs", "logprobs"),
    ("completions-top_k", "/v1/completions", {"model": NAME, "prompt": "hi"}, "top_k", "top_k"),
    ("responses-max_output_tokens", "/v1/responses", {"model": NAME, "input": "hi"}, "max_output_tokens",
     "max_output_tokens"),
    ("responses-top_logprobs", "/v1/responses", {"model": NAME, "input": "hi"}, "top_logprobs", "top_logprobs"),
    ("messages-max_tokens", "/v1/messages", chat(), "max_tokens", None),
    ("messages-top_k", "/v1/messages", chat(), "top_k", None),
]


@pytest.mark.parametrize("path,body,field,param", [i[1:] for i in INTEGERS], ids=[i[0] for i in INTEGERS])
@pytest.mark.parametrize("value", [True, 3.5, "3"], ids=["true", "fraction", "string"])
def test_integer_fields_take_integers_alone(scripted, path, body, field, param, value):
    """Counts took `true` as 1 and "3" as 3 (token ids were strict): an integer is JSON Schema's now, an int or a
    number without a fractional part, on every API."""
    r = scripted.post(path, json={**body, field: value})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: expected an integer, got "), message
    if param is not None:
        assert r.json()["error"]["param"] == param
    for taken in (3, 3.0):  # (this backend computes no log probabilities)
        r = scripted.post(path, json={**body, field: taken})
        assert r.status_code == 200 or "does not return log probabilities" in r.text, r.text


@pytest.mark.parametrize("model,fields", [
    (ChatCompletionRequest, chat(max_tokens=3.0, n=2.0, seed=-7.0, top_k=40.0, stop_token_ids=[1.0, 2],
                                 allowed_token_ids=[5.0], priority=-1.0)),
    (CompletionRequest, {"model": NAME, "prompt": [[1.0, 2.0], [3]], "max_tokens": 0.0, "logprobs": 2.0}),
    (ResponsesRequest, {"model": NAME, "input": "hi", "max_output_tokens": 1e3, "top_logprobs": 4.0}),
    (MessagesRequest, chat(max_tokens=3.0, thinking={"type": "enabled", "budget_tokens": 8.0})),
    (DetokenizeRequest, {"tokens": [7.0, 8]}),
], ids=["chat", "completions", "responses", "messages", "detokenize"])
def test_an_integral_number_is_that_integer(model, fields):
    """5.0 is the integer 5 (JSON Schema's `integer`; vLLM takes it so), down to the token ids."""
    taken = model.model_validate(fields).model_dump(include=set(fields) - {"model", "messages", "input"})

    def integral(value):
        if isinstance(value, float):
            return int(value)
        if isinstance(value, list):
            return [integral(v) for v in value]
        return {k: integral(v) for k, v in value.items()} if isinstance(value, dict) else value

    want = {k: integral(v) for k, v in fields.items() if k in taken}
    assert json.dumps(taken, sort_keys=True) == json.dumps(want, sort_keys=True)  # (3, not 3.0)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_token_id_lists_take_integers_alone(client, field):  # noqa: F811
    """As the prompt's token ids: `[true]` was token id 1."""
    for value in ([True], [1.5], ["1"]):
        error = error_of(client.post("/v1/chat/completions", json=chat(**{field: value})))
        assert error["param"] == field and error["message"].startswith(f"{field}[0]: expected an integer"), error
    assert client.post("/v1/chat/completions", json=chat(**{field: [1.0, 2]})).status_code == 200
    r = client.post("/v1/messages", json=chat(thinking={"type": "enabled", "budget_tokens": 8.5}))
    assert r.status_code == 400 and "thinking.budget_tokens: expected an integer, got a number (8.5)" in r.text
    r = client.post("/v1/messages", json=chat(thinking={"type": "enabled", "budget_tokens": 8.0}))
    assert r.status_code == 200, r.text


def test_token_ids_as_integral_numbers_are_the_same_tokens(scripted, tok):  # noqa: F811
    ids = tok.encode("hello there")
    floats = [float(t) for t in ids]
    assert scripted.post("/detokenize", json={"tokens": floats}).json() == {"prompt": "hello there"}
    for bad in ([ids[0] + 0.5], [True]):
        error = error_of(scripted.post("/detokenize", json={"tokens": bad}))
        assert error["param"] == "tokens" and error["message"].startswith("tokens[0]: expected an integer"), error
    echo = {"model": NAME, "max_tokens": 0, "echo": True}
    same = [scripted.post("/v1/completions", json={**echo, "prompt": prompt}).json()["choices"][0]["text"]
            for prompt in (ids, floats)]
    assert same == ["hello there"] * 2
    error = error_of(scripted.post("/v1/completions", json={**echo, "prompt": [ids[0], 1.5]}))
    assert error["param"] == "prompt", error


ANSWERED = "/v1/messages", chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
    {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "done", "is_error": "@"}]}], tools=_tools("anthropic",
                                                                                                       ["f"]))
RESPOND = {"model": NAME, "input": "hi", "max_output_tokens": 3}
BOOLEANS = [  # (id, path, body with "@" where the boolean goes, the field's place, its param)
    ("chat-stream", "/v1/chat/completions", chat(stream="@"), "stream", "stream"),
    ("chat-logprobs", "/v1/chat/completions", chat(logprobs="@"), "logprobs", "logprobs"),
    ("chat-parallel_tool_calls", "/v1/chat/completions", chat(tools=_tools("chat", ["f"]), parallel_tool_calls="@"),
     "parallel_tool_calls", "parallel_tool_calls"),
    ("chat-include_usage", "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "@"}),
     "stream_options.include_usage", "stream_options"),
    ("chat-continuous_usage_stats", "/v1/chat/completions", chat(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": "@"}), "stream_options.continuous_usage_stats",
     "stream_options"),
    ("chat-ignore_eos", "/v1/chat/completions", chat(ignore_eos="@"), "ignore_eos", "ignore_eos"),
    ("chat-include_stop_str_in_output", "/v1/chat/completions", chat(include_stop_str_in_output="@"),
     "include_stop_str_in_output", "include_stop_str_in_output"),
    ("chat-add_generation_prompt", "/v1/chat/completions", chat(add_generation_prompt="@"), "add_generation_prompt",
     "add_generation_prompt"),
    ("chat-continue_final_message", "/v1/chat/completions", chat(continue_final_message="@"),
     "continue_final_message", "continue_final_message"),
    ("chat-json_schema.strict", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "strict": "@"}}), "response_format.json_schema.strict",
     "response_format"),
    ("chat-json_object", "/v1/chat/completions", chat(structured_outputs={"json_object": "@"}),
     "structured_outputs.json_object", "structured_outputs"),
    ("completions-echo", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3, "echo": "@"}, "echo",
     "echo"),
    ("completions-stream", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3, "stream": "@"},
     "stream", "stream"),
    ("responses-stream", "/v1/responses", {**RESPOND, "stream": "@"}, "stream", "stream"),
    ("responses-store", "/v1/responses", {**RESPOND, "store": "@"}, "store", "store"),
    ("responses-background", "/v1/responses", {**RESPOND, "background": "@"}, "background", "background"),
    ("responses-parallel_tool_calls", "/v1/responses", {**RESPOND, "tools": _tools("responses", ["f"]),
                                                        "parallel_tool_calls": "@"}, "parallel_tool_calls",
     "parallel_tool_calls"),
    ("responses-format.strict", "/v1/responses", {**RESPOND, "text": {"format": {
        "type": "json_schema", "schema": {"type": "object"}, "strict": "@"}}}, "text.format.strict", "text"),
    ("tokenize-add_generation_prompt", "/tokenize", {"model": NAME, "prompt": "hi", "add_generation_prompt": "@"},
     "add_generation_prompt", "add_generation_prompt"),
    ("tokenize-add_special_tokens", "/tokenize", {"model": NAME, "prompt": "hi", "add_special_tokens": "@"},
     "add_special_tokens", "add_special_tokens"),
    ("tokenize-return_token_strs", "/tokenize", {"model": NAME, "prompt": "hi", "return_token_strs": "@"},
     "return_token_strs", "return_token_strs"),
    ("messages-stream", "/v1/messages", chat(stream="@"), "stream", None),
    ("messages-disable_parallel_tool_use", "/v1/messages", chat(tools=_tools("anthropic", ["f"]), tool_choice={
        "type": "auto", "disable_parallel_tool_use": "@"}), "tool_choice.disable_parallel_tool_use", None),
    ("messages-is_error", *ANSWERED, "messages[2].content[0].is_error", None),
]


def _with(body, value):
    """`body` with `value` where it holds "@"."""
    if body == "@":
        return value
    if isinstance(body, dict):
        return {k: _with(v, value) for k, v in body.items()}
    return [_with(v, value) for v in body] if isinstance(body, list) else body


def _refused(client, path, body, values, expected: str, place: str, param, method: str = "POST"):
    """Each of `values` put where `body` has "@" is a 400 whose message starts `{place}: expected {expected}, got`
    (and names `param`, where the API has one). With method GET, `body` is the URL's query parameters."""
    for value in values:
        sent = _with(body, value)
        r = client.post(path, json=sent) if method == "POST" else client.get(path, params=sent)
        assert r.status_code == 400, (value, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"{place}: expected {expected}, got "), message
        if param is not None:
            assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body,place,param", [b[1:] for b in BOOLEANS], ids=[b[0] for b in BOOLEANS])
def test_boolean_fields_take_booleans_alone(tok, path, body, place, param):  # noqa: F811
    """1, "yes" and "true" were taken as true (and Anthropic's disable_parallel_tool_use "false" as well): a
    boolean of a request is `true` or `false` now, on every API."""
    client = constraining_client(tok)
    _refused(client, path, body, (1, 0, "yes", "true", "false"), "a boolean", place, param)
    r = client.post(path, json=_with(body, False))
    assert r.status_code == 200, r.text


def test_a_string_false_no_longer_disables_parallel_tool_use(tok):  # noqa: F811
    """`bool("false")` is true: the string limited the answer to one tool call."""
    second = '<invoke name="f">\n</invoke>\n'
    text = '<minimax:tool_call>\n<invoke name="f">\n</invoke>\n' + second + "</minimax:tool_call>"
    client = TestClient(create_app(Scripted(tok.encode(text + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=4096))
    ask = chat(max_tokens=200, tools=_tools("anthropic", ["f"]))
    for single, calls in ((False, 2), (True, 1)):
        r = client.post("/v1/messages", json={**ask, "tool_choice": {"type": "auto",
                                                                     "disable_parallel_tool_use": single}})
        assert [b["type"] for b in r.json()["content"]].count("tool_use") == calls, r.text
    r = client.post("/v1/messages", json={**ask, "tool_choice": {"type": "auto", "disable_parallel_tool_use": "false"}})
    assert r.status_code == 400 and "tool_choice.disable_parallel_tool_use: expected a boolean, got a string " \
        "('false')" in r.text, r.text


SCHEMAS = [  # (id, path, body with "@" where a schema goes (true: any JSON), the field's place, its param)
    ("chat-json_schema", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": "@"}}), "response_format.json_schema.schema", "response_format"),
    ("chat-guided_json", "/v1/chat/completions", chat(guided_json="@"), "guided_json", "guided_json"),
    ("chat-structured_outputs.json", "/v1/chat/completions", chat(structured_outputs={"json": "@"}),
     "structured_outputs.json", "structured_outputs"),
    ("responses-format", "/v1/responses", {**RESPOND, "text": {"format": {"type": "json_schema", "schema": "@"}}},
     "text.format.schema", "text"),
    ("messages-output_format", "/v1/messages", chat(output_config={"format": {"type": "json_schema", "schema": "@"}}),
     "output_config.format.schema", None),
]


@pytest.mark.parametrize("path,body,place,param", [s[1:] for s in SCHEMAS], ids=[s[0] for s in SCHEMAS])
def test_a_schema_is_an_object_or_a_boolean(tok, path, body, place, param):  # noqa: F811
    """A JSON Schema may be `true` (any JSON): `1` and "true" were taken as that boolean."""
    client = constraining_client(tok)
    _refused(client, path, body, (1, "true"), "an object or a boolean", place, param)
    for value in (True, {"type": "object"}):
        assert client.post(path, json=_with(body, value)).status_code == 200, value


FLOATS = [  # (id, path, body with "@" where the number goes, the field's place, its param)
    *[(f"chat-{f}", "/v1/chat/completions", chat(**{f: "@"}), f, f) for f in (
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")],
    ("chat-logit_bias", "/v1/chat/completions", chat(logit_bias={"5": "@"}), "logit_bias.5", "logit_bias"),
    ("completions-temperature", "/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3,
                                                    "temperature": "@"}, "temperature", "temperature"),
    *[(f"responses-{f}", "/v1/responses", {**RESPOND, f: "@"}, f, f) for f in ("temperature", "top_p")],
    *[(f"messages-{f}", "/v1/messages", chat(**{f: "@"}), f, None) for f in ("temperature", "top_p")],
]


@pytest.mark.parametrize("path,body,place,param", [f[1:] for f in FLOATS], ids=[f[0] for f in FLOATS])
def test_number_fields_take_numbers_alone(client, path, body, place, param):  # noqa: F811
    """`true` was taken as 1.0 and "0.5" as 0.5: a number is an int or a float now."""
    _refused(client, path, body, (True, "0.5"), "a number", place, param)
    for value in (1, 0.5):
        r = client.post(path, json=_with(body, value))
        assert r.status_code == 200, (value, r.text)
