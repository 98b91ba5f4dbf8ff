"""Requests that passed validation and then failed inside the server (500s, an unended stream), or that held the
engine's thread for every client: each is a 400 naming its field now, or is served. (Found by feeding the
server odd requests; `tests/test_serve*.py` covers the ordinary ones.)"""

import math

import pytest
import torch
from fastapi.testclient import TestClient
from test_serve import NAME, Scripted, client, model, named_events, tok  # noqa: F401 - fixtures

from openm3.data.tokenizer import EOS
from openm3.engine.penalties import PenalizedPicker, Penalties
from openm3.engine.sampling import SamplingParams, sample
from openm3.serve import create_app
from openm3.serve.schemas import MAX_BAD_WORDS, MAX_STOP_SEQUENCES

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
