"""OpenAI's presence / frequency penalties and logit_bias, and vLLM's repetition_penalty, min_p, min_tokens,
ignore_eos and stop_token_ids through `openm3 serve` (Completions and Chat Completions, over `generate` and
`BatchedGenerator`): the answers equal the engine's under the same `PenalizedPicker`, the stop rules end answers
where vLLM's do, and bad values get a 400 naming the field."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from openm3.engine import generate
from openm3.engine.penalties import Penalties, PenalizedPicker
from openm3.serve import ModelBackend, create_app

from test_serve import NAME, Scripted, model, tok  # noqa: F401 - the fixtures
from test_serve_structured import LIMIT, client  # noqa: F401 - served by generate and by BatchedGenerator


def complete(client, prompt: list[int], **fields) -> dict:
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_penalized_answers_equal_the_engine(client, model, tok):
    """Greedy answers under penalties and a bias equal `generate` with the same picker, and differ from the plain
    answer (the random model repeats itself)."""
    prompt = tok.encode("the cat sat on the mat and the cat")
    fields = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5, logit_bias={"17": 3.0})
    penalties = Penalties(presence=1.0, frequency=0.5, repetition=1.5, logit_bias=((17, 3.0),))
    picker = PenalizedPicker(penalties, prompt, [tok.eos_id])
    want = generate(model, [prompt], max_new_tokens=12, stop_tokens=[tok.eos_id], constraints=[picker])[0][0].tokens
    plain = generate(model, [prompt], max_new_tokens=12, stop_tokens=[tok.eos_id])[0][0].tokens
    assert want != plain
    body = complete(client, prompt, max_tokens=12, logprobs=0, **fields)
    assert body["choices"][0]["text"] == tok.decode([t for t in want if t != tok.eos_id])
    messages = [{"role": "user", "content": "hello"}]
    chat = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 8,
                                                     "temperature": 0, "logit_bias": {"17": 100}}).json()
    assert chat["choices"][0]["message"]["content"] == tok.decode([17] * 8)


def test_stop_rules(client, tok):
    """min_tokens holds the end token back, ignore_eos generates past it (not decoded), stop_token_ids end an
    answer with a token of the request's choosing."""
    prompt, eos = tok.encode("hello there"), str(tok.eos_id)
    body = complete(client, prompt, max_tokens=10, logit_bias={eos: 100}, min_tokens=3)
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "stop"
    body = complete(client, prompt, max_tokens=5, logit_bias={eos: 100}, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == ""
    body = complete(client, prompt, max_tokens=5, logit_bias={"17": 100}, stop_token_ids=[17])
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == "" and body["choices"][0]["stop_reason"] == 17  # vLLM's field
    body = complete(client, prompt, max_tokens=10, logit_bias={eos: 100}, min_tokens=3)
    assert body["choices"][0]["stop_reason"] is None  # the end token
    allowed = tok.encode(" cat dog")
    body = complete(client, prompt, max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=allowed, logprobs=0)
    assert body["usage"]["completion_tokens"] == 6
    assert set(body["choices"][0]["logprobs"]["tokens"]) <= {tok.decode([t]) for t in allowed}


BAD = [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [5000]}, "stop_token_ids"),
    ({"allowed_token_ids": [5, 5000]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"ignore_eos": True, "guided_choice": ["yes", "no"]}, "ignore_eos"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_values_name_the_field(model, tok, fields, param):
    client = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_backend_that_cannot_adjust_refuses(tok):
    client = TestClient(create_app(Scripted(tok.encode("hi"), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=LIMIT))
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                  "frequency_penalty": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                  "frequency_penalty": 0.0, "stop_token_ids": [5]})
    assert r.status_code == 200


def test_min_p_beside_a_grammar(client):
    """min_p beside structured outputs (vLLM applies it after the grammar's mask): a sampled choice is one of the
    choices, whatever min_p leaves."""
    for min_p in (0.05, 0.9):
        r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 8, "temperature": 1.0,
                                                 "seed": 3, "min_p": min_p, "guided_choice": ["yes", "no", "maybe"]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe")
