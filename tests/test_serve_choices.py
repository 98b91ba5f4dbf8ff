"""Several choices per request in `openm3 serve`: `n` on Chat Completions and Completions, and Completions batches
(a list of prompts, as lm-evaluation-harness and other batching clients send). Choice `i * n + j` is prompt i's
j-th; each equals the single request that asks for it alone (same prompt, seed + its index); on the batching
backend the choices run together; the usage counts each prompt once and every choice's tokens."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from openm3.engine.batching import BatchedGenerator
from openm3.serve import ModelBackend, create_app

from test_serve import NAME, LIMIT, Slow, events, greedy_ids, model, tok  # noqa: F401 - fixtures and helpers


@pytest.fixture(scope="module")
def batched(model):
    backend = BatchedGenerator(model, token_budget=8 * LIMIT, max_batch=8, chunk_size=32)
    yield backend
    backend.close()


@pytest.fixture(scope="module", params=["model", "batched"])
def client(request, model, tok, batched):
    backend = ModelBackend(model) if request.param == "model" else batched
    return TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT))


def test_a_batch_of_prompts_with_n_choices_each(client, model, tok):
    prompts = [[5, 300, 17, 42], [9, 8, 7]]
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompts, "n": 2, "max_tokens": 5,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = prompts
    want = [tok.decode(greedy_ids(model, tok, p, 5)) for p in ids]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [want[0], want[0], want[1], want[1]]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids[0]) + len(ids[1])  # each prompt once, not once per choice
    assert usage["completion_tokens"] == 4 * 5 and usage["total_tokens"] == usage["prompt_tokens"] + 20


def test_sampled_choices_are_the_single_requests_with_seed_plus_index(client):
    ask = {"model": NAME, "prompt": "In the beginning", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    choices = client.post("/v1/completions", json={**ask, "n": 3}).json()["choices"]
    texts = [c["text"] for c in choices]
    alone = [client.post("/v1/completions", json={**ask, "seed": 11 + k}).json()["choices"][0]["text"]
             for k in range(3)]
    assert texts == alone and len(set(texts)) > 1  # a random model at temperature 1: the choices differ
    again = client.post("/v1/completions", json={**ask, "n": 3}).json()["choices"]
    assert [c["text"] for c in again] == texts


def test_chat_n_choices_streamed_and_not(client, model, tok):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.8,
            "seed": 3, "n": 3, "logprobs": True, "top_logprobs": 1}
    plain = client.post("/v1/chat/completions", json=chat)
    assert plain.status_code == 200, plain.text
    choices = plain.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    one = client.post("/v1/chat/completions", json={**chat, "n": 1, "seed": 5}).json()["choices"][0]
    assert one["message"] == choices[2]["message"]
    mine = choices[2]["logprobs"]["content"]  # the same values up to a batched forward's rounding
    assert [i["token"] for i in one["logprobs"]["content"]] == [i["token"] for i in mine]
    assert [i["logprob"] for i in one["logprobs"]["content"]] == pytest.approx([i["logprob"] for i in mine], abs=1e-4)
    assert all(len(c["logprobs"]["content"]) >= 1 for c in choices)

    chunks = events(client.post("/v1/chat/completions", json={**chat, "stream": True,
                                                              "stream_options": {"include_usage": True}}))
    for k, choice in enumerate(choices):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") or "" for c in mine)
        reasoning = "".join(c["delta"].get("reasoning_content", "") for c in mine)
        assert text == (choice["message"]["content"] or "")
        assert reasoning == choice["message"].get("reasoning_content", "")
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        tokens = [i["token"] for c in mine for i in (c.get("logprobs") or {"content": []})["content"]]
        assert tokens == [i["token"] for i in choice["logprobs"]["content"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain.json()["usage"]


def test_a_scoring_batch_equals_one_request_per_prompt(client, tok):
    """lm-evaluation-harness's loglikelihood request at batch size 2: echo, one new token, the prompt tokens' log
    probabilities."""
    ask = {"model": NAME, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    prompts = ["The quick brown fox jumps", "over the lazy dog"]
    batch = client.post("/v1/completions", json={**ask, "prompt": prompts}).json()["choices"]
    for prompt, choice in zip(prompts, batch):
        alone = client.post("/v1/completions", json={**ask, "prompt": [prompt]}).json()["choices"][0]
        assert choice["text"] == alone["text"] and choice["text"].startswith(prompt)
        assert choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-4)


def test_streamed_batch_chunks_carry_their_choice_index(client):
    ask = {"model": NAME, "prompt": ["a b c", "x y z"], "n": 2, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=ask).json()
    chunks = events(client.post("/v1/completions", json={**ask, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
    assert chunks[-1]["usage"] == plain["usage"]


def test_choices_run_together_on_a_concurrent_backend_and_fail_together(tok):
    slow = Slow(tok.vocab_size)
    slow.concurrent = True
    app = TestClient(create_app(slow, tok, model_name=NAME, max_total_tokens=4096))
    r = app.post("/v1/completions", json={"model": NAME, "prompt": "x", "n": 4, "max_tokens": 100})
    assert r.status_code == 200 and slow.peak == 4 and slow.sampled == 400

    calls, sampled = [], []

    def one_fails(prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token):
        calls.append(seed)
        if len(calls) == 2:
            raise RuntimeError("choice failed")
        for _ in range(max_new_tokens):  # the others stop when the failure cancels them
            threading.Event().wait(0.002)
            sampled.append(seed)
            on_token(300)
        return "length"

    one_fails.concurrent = True
    app = TestClient(create_app(one_fails, tok, model_name=NAME, max_total_tokens=4096),
                     raise_server_exceptions=False)
    r = app.post("/v1/completions", json={"model": NAME, "prompt": "x", "n": 3, "max_tokens": 3000, "seed": 7})
    assert r.status_code == 500 and "choice failed" in r.json()["error"]["message"]
    # 6,000 tokens (~6 s) had they run on; a choice not started yet when another failed does not start at all
    assert set(calls) <= {7, 8, 9} and len(set(calls)) == len(calls) >= 2 and len(sampled) < 1000


BAD = [
    ("n-0", {"prompt": "x", "n": 0}, "n"),
    ("n-129", {"prompt": "x", "n": 129}, "n"),
    ("batch-times-n-over-128", {"prompt": ["x"] * 3, "n": 50}, "n"),
    ("empty-prompt-in-batch", {"prompt": ["x", ""]}, "prompt"),
    ("second-prompt-over-limit", {"prompt": [[7], [7] * 200]}, "prompt[1]"),
    ("best_of-2", {"prompt": "x", "best_of": 2}, "best_of"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_choice_requests_name_the_field(tok, body, param):
    app = TestClient(create_app(Slow(tok.vocab_size), tok, model_name=NAME, max_total_tokens=LIMIT))
    r = app.post("/v1/completions", json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_shared_prompt_is_computed_once_for_its_choices(batched, tok):
    """n choices of one prompt arrive together: one prefills the prompt's full pages, the others read them."""
    app = TestClient(create_app(batched, tok, model_name=NAME, max_total_tokens=LIMIT))
    prompt = list(range(20, 70))  # 50 tokens: three full pages of 16
    before = batched.cached_tokens
    r = app.post("/v1/completions", json={"model": NAME, "prompt": prompt, "n": 3, "max_tokens": 2,
                                           "temperature": 0})
    page = batched.cache.layout.page_size
    full = (len(prompt) - 1) // page * page
    assert batched.cached_tokens - before == 2 * full > 0
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full
