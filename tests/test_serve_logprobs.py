"""Log probabilities through `openm3 serve` and the engine: each answer token's log probability and top
alternatives equal the model's log-softmax at that position (a full forward over prompt + answer), in the
Chat Completions, Completions and Responses formats, streamed and not, through `generate`, `BatchedGenerator` and
its speculative steps; the chat formats hold the message text's tokens alone (not the think block's or the tool
calls' markup); a backend without them gets a 400."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

import openm3.engine.speculative as speculative
from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.sampling import SamplingParams
from openm3.engine.speculative import SpeculativeConfig
from openm3.data.tokenizer import EOS, THINK_END, THINK_START
from openm3.serve import ModelBackend, create_app

from test_serve import CALL_TEXT, TOOLS, Scripted, events, named_events, model, tok  # noqa: F401 - fixtures too

NAME = "tiny"


def model_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log-softmax [len(answer), V] of the positions that predicted each answer token (one full forward)."""
    ids = prompt + answer
    with torch.no_grad():
        logits = model(torch.tensor(ids), cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32)).logits
    return logits[len(prompt) - 1:len(ids) - 1].float().log_softmax(-1)


def check_entries(model, prompt, entries, top: int):
    """entries: [(token, logprob, [(id, logprob)])] against the full forward."""
    want = model_logprobs(model, prompt, [t for t, _, _ in entries])
    for j, (token, logprob, alternatives) in enumerate(entries):
        assert abs(logprob - want[j, token].item()) < 1e-4
        values, ids = want[j].topk(top)
        assert [i for i, _ in alternatives] == ids.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(alternatives, values.tolist()))


def test_engine_logprobs_equal_the_model(model, monkeypatch):
    """`generate` and `BatchedGenerator`, sampled, plain and with speculative steps (drafts of the plain answer,
    partly right): every token's log probability and its top 3 equal the full forward's."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=gen).tolist()
    got = []
    res, _ = generate(model, [prompt], max_new_tokens=12, logprobs=3, seed=1,
                      sampling=SamplingParams(temperature=0.9),
                      on_logprobs=lambda b, lp, top: got.append((lp, top)))
    check_entries(model, prompt, [(t, lp, top) for t, (lp, top) in zip(res[0].tokens, got)], 3)
    plain, _ = generate(model, [prompt], max_new_tokens=12)
    answer = plain[0].tokens

    def drafts(tokens, k, _config):
        done = len(tokens) - len(prompt)
        d = answer[done:done + k] + [5] * max(0, k - len(answer[done:]))
        d[-1] = (d[-1] + 1) % model.config.vocab_size  # the last draft of each step is wrong
        return d

    monkeypatch.setattr(speculative, "ngram_drafts", drafts)
    for spec in (None, SpeculativeConfig(num_speculative_tokens=3)):
        got, tokens = [], []
        res, stats = generate(model, [prompt], max_new_tokens=12, logprobs=2, speculative=spec,
                              on_logprobs=lambda b, lp, top: got.append((lp, top)))
        assert res[0].tokens == answer and (spec is None or stats.accepted_tokens > 0)
        check_entries(model, prompt, [(t, lp, top) for t, (lp, top) in zip(answer, got)], 2)
        batcher = BatchedGenerator(model, token_budget=256, speculative=spec)
        got = []
        batcher(prompt, max_new_tokens=12, logprobs=0, on_token=tokens.append,
                on_logprobs=lambda lp, top: got.append((lp, top)))
        batcher.close()
        assert tokens == answer and (spec is None or batcher.accepted_tokens > 0)
        check_entries(model, prompt, [(t, lp, top) for t, (lp, top) in zip(answer, got)], 0)
    with pytest.raises(ValueError, match="logprobs must be an int in \\[0, 20\\]"):
        generate(model, [prompt], logprobs=21, on_logprobs=lambda *a: None)
    with pytest.raises(ValueError, match="^prompt_logprobs must be an int .* given with on_prompt_logprobs"):
        generate(model, [prompt], prompt_logprobs=1)  # (the prompt's pair is named, not logprobs / on_logprobs)


def test_chat_and_completion_logprobs(model, tok):
    """Greedy answers (the chosen token is the top one): the Completions format (tokens, token_logprobs,
    top_logprobs, text_offset) and the Chat format (token, logprob, bytes, top_logprobs), streamed and not, hold
    one entry per answer token (the end-of-turn token left out) with the model's values."""
    client = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=96))
    body = {"model": NAME, "prompt": "hello world", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = len(lp["tokens"])
    assert n == r.json()["usage"]["completion_tokens"] == 10
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(n)]
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v, abs=1e-5)
               for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"]]
    assert sum((p["tokens"] for p in parts), []) == lp["tokens"]
    assert sum((p["token_logprobs"] for p in parts), []) == lp["token_logprobs"]
    assert sum((p["text_offset"] for p in parts), []) == lp["text_offset"]

    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"] - (r.json()["choices"][0]["finish_reason"] == "stop")
    for item in content:
        assert item["bytes"] == list(item["token"].encode()) and len(item["top_logprobs"]) == 3
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-5)
    streamed = events(client.post("/v1/chat/completions", json={**chat, "stream": True}))
    items = sum((c["choices"][0]["logprobs"]["content"] for c in streamed if c["choices"]), [])
    assert [i["token"] for i in items] == [i["token"] for i in content]
    assert [i["logprob"] for i in items] == pytest.approx([i["logprob"] for i in content], abs=1e-6)
    plain = client.post("/v1/chat/completions", json={**chat, "logprobs": False, "top_logprobs": None})
    assert "logprobs" not in plain.json()["choices"][0]
    # the Responses API: the same conversation's message text, the same items
    r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "max_output_tokens": 8, "temperature": 0,
                                           "include": ["message.output_text.logprobs"], "top_logprobs": 3})
    message = [item for item in r.json()["output"] if item["type"] == "message"][0]
    items = message["content"][0]["logprobs"]
    assert [i["token"] for i in items] == [i["token"] for i in content]
    assert [i["logprob"] for i in items] == pytest.approx([i["logprob"] for i in content], abs=1e-6)
    assert [len(i["top_logprobs"]) for i in items] == [3] * len(items)


def test_completion_logprobs_match_the_model(model, tok):
    """The served values are the engine's: those of a full forward over the prompt and the greedy answer."""
    client = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=96))
    ids = tok.encode("the cat sat")
    r = client.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 6, "temperature": 0,
                                             "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    answer = generate(model, [ids], max_new_tokens=6)[0][0].tokens
    want = model_logprobs(model, ids, answer)
    assert lp["token_logprobs"] == pytest.approx([want[j, t].item() for j, t in enumerate(answer)], abs=1e-4)


def test_a_backend_without_logprobs_gets_a_400(tok):
    def scripted(prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token):
        on_token(5)
        return "length"

    client = TestClient(create_app(scripted, tok, model_name=NAME, max_total_tokens=96))
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                                  "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "does not return log probabilities" in r.json()["error"]["message"]
    for path, where in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = client.post(path, json={"model": NAME, "prompt_logprobs": 1, **where})  # vLLM's field
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_engine_prompt_logprobs_equal_the_model(model, monkeypatch):
    """Every prompt token's log probability (after the first) from `generate` and `BatchedGenerator`, with the
    rows kept at most 7 per forward (so a prompt's rows span several chunks, beside a prompt without them): the
    full forward's values; a prompt the prefix cache holds is computed again for them."""
    import openm3.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "all_logits_rows", lambda _vocab: 7)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (30, 19)]
    want = [model_logprobs(model, p[:1], p[1:]) for p in prompts]
    got = {}
    res, _ = generate(model, prompts, max_new_tokens=3, chunk_size=16, prompt_logprobs=2,
                      on_prompt_logprobs=lambda b, entries: got.setdefault(b, entries))
    plain, _ = generate(model, prompts, max_new_tokens=3, chunk_size=16)
    assert [r.tokens for r in res] == [r.tokens for r in plain]
    for b, p in enumerate(prompts):
        check_entries(model, p[:1], [(t, e.logprob, e.top) for t, e in zip(p[1:], got[b])], 2)
        assert len(got[b]) == len(p) - 1
        # each token's rank in the whole vocabulary (vLLM's prompt_logprobs): 1 + the tokens more likely than it,
        # up to those within the forwards' rounding of it (the chunked prefill against one full forward)
        for j, (e, t) in enumerate(zip(got[b], p[1:])):
            own = want[b][j, t]
            assert 1 + (want[b][j] > own + 1e-4).sum() <= e.rank <= (want[b][j] > own - 1e-4).sum(), j  # t counted
        assert max(e.rank for e in got[b]) > 10  # random prompt tokens: mostly far from the top
    batcher = BatchedGenerator(model, token_budget=512, chunk_size=16)
    for _ in range(2):  # the second time the prompt's pages are cached
        entries = []
        batcher(prompts[0], max_new_tokens=2, prompt_logprobs=0, on_prompt_logprobs=entries.extend)
        assert len(entries) == len(prompts[0]) - 1
        assert max(abs(e.logprob - want[0][j, t].item()) for j, (e, t) in enumerate(zip(entries, prompts[0][1:]))) \
            < 1e-4
    batcher.close()


def test_echo_scores_a_prompt_as_evaluation_harnesses_ask(model, tok):
    """lm-evaluation-harness's loglikelihood request: a one-element batch of token ids, echo, logprobs 1,
    max_tokens 1. The answer's tokens are the prompt's and one more; the first has no log probability, the
    others the model's; its text starts with the prompt; streamed chunks add up to the same. With max_tokens 0
    (the older form of the request) the prompt's part alone."""
    client = TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=96))
    ids = tok.encode("the cat sat on the mat")
    body = {"model": NAME, "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = model_logprobs(model, ids[:1], ids[1:])
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([want[j, t].item() for j, t in enumerate(ids[1:])],
                                                              abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert choice["text"].startswith(tok.decode(ids)) and lp["text_offset"][0] == 0
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    parts = [c["choices"][0] for c in streamed if c["choices"]]
    assert "".join(p["text"] for p in parts) == choice["text"]
    assert sum((p["logprobs"]["token_logprobs"] for p in parts), []) == lp["token_logprobs"]
    r = client.post("/v1/completions", json={**body, "logprobs": None, "prompt": "hello"})
    assert r.json()["choices"][0]["text"].startswith("hello") and r.json()["choices"][0]["logprobs"] is None
    r = client.post("/v1/completions", json={**body, "prompt": [ids, ids]})  # a batch: a choice per prompt
    assert [c["logprobs"]["token_logprobs"] for c in r.json()["choices"]] == [lp["token_logprobs"]] * 2
    # OpenAI's legacy scoring form, max_tokens 0: the prompt's entries alone, no text after it, no tokens counted
    for stream in (False, True):
        r = client.post("/v1/completions", json={**body, "max_tokens": 0, "stream": stream})
        if stream:
            parts = [c["choices"][0] for c in events(r) if c["choices"]]
            got = {"text": "".join(p["text"] for p in parts), "finish_reason": parts[-1]["finish_reason"],
                   "logprobs": {k: sum((p["logprobs"][k] for p in parts), []) for k in ("tokens", "token_logprobs")}}
        else:
            got = r.json()["choices"][0]
            assert r.json()["usage"]["completion_tokens"] == 0
        assert got["text"] == tok.decode(ids) and got["finish_reason"] == "length"
        assert got["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
        assert got["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    r = client.post("/v1/completions", json={**body, "max_tokens": 0, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


THOUGHT = "The user wants a file.\n\nRead it first."
SPLIT_ANSWERS = [  # (answer, the message text it returns, tools parsed)
    (f"{THINK_START}\n{THOUGHT}\n{THINK_END}\n\n{CALL_TEXT}", "Let me look.", True),
    (f"{THINK_START}\n{THOUGHT}\n{THINK_END}\n\nHere it is.", "Here it is.", False),
    (f"{THINK_START}\nan unfinished thought", "", False),
    ("No thinking here.", "No thinking here.", False),
    (CALL_TEXT, CALL_TEXT, False),  # tool_choice none: the markup is message text
]


class ScriptedLogprobs(Scripted):
    """`Scripted` with log probabilities: token j's is -(j + 1) / 100, its one alternative itself."""

    supports_logprobs = True

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token, logprobs=None,
                 on_logprobs=None):
        self.prompts.append(list(prompt))
        for j, token in enumerate(self.tokens[:max_new_tokens]):
            if on_logprobs is not None:
                on_logprobs(-(j + 1) / 100, [(token, -(j + 1) / 100)][:logprobs])
            on_token(token)
            if token in stop_tokens:
                return "stop"
        return "length"


def message_entries(tok, answer: str, text: str, calls: bool) -> list[tuple[str, float]]:
    """(token text, logprob) the message text should get: the answer's tokens whose text reaches into `text`
    (found in the answer), up to the end (or, with parsed calls, to the text's end)."""
    ids = tok.encode(answer)
    start = answer.rindex(text) if text else len(answer)
    stop = start + len(text) if calls else len(answer) + 1
    out, begin = [], 0
    for j, i in enumerate(ids):
        end = begin + len(tok.decode([i]))
        if end > start and begin < stop:
            out.append((tok.decode([i]), -(j + 1) / 100))
        begin = end
    return out


@pytest.mark.parametrize("case", range(len(SPLIT_ANSWERS)))
def test_logprobs_hold_the_message_text_alone(tok, case):
    """With the think block split off and the tool calls parsed out, Chat Completions' `logprobs.content` and the
    Responses API's output_text `logprobs` (streamed and not) hold the tokens of the message text alone, each
    with its own value; streamed chat chunks of reasoning carry none."""
    answer, text, calls = SPLIT_ANSWERS[case]
    want = message_entries(tok, answer, text, calls)
    assert "".join(t for t, _ in want) == text  # this tokenizer cuts at the format's edges
    client = TestClient(create_app(ScriptedLogprobs(tok.encode(answer + EOS), tok.vocab_size), tok,
                                   model_name=NAME, max_total_tokens=4096))
    choice = "none" if answer == CALL_TEXT else "auto"
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Show src/a.py"}], "tools": TOOLS,
            "tool_choice": choice, "logprobs": True, "top_logprobs": 1}
    body = client.post("/v1/chat/completions", json=chat).json()
    got = body["choices"][0]["logprobs"]["content"]
    assert [(i["token"], i["logprob"]) for i in got] == want
    assert all(i["top_logprobs"] == [{k: i[k] for k in ("token", "logprob", "bytes")}] for i in got)
    chunks = [c["choices"][0] for c in events(client.post("/v1/chat/completions", json={**chat, "stream": True}))]
    assert sum((c["logprobs"]["content"] for c in chunks), []) == got
    assert all(not c["logprobs"]["content"] for c in chunks if c["delta"].get("reasoning_content"))

    req = {"model": NAME, "input": "Show src/a.py", "tools": [t["function"] | {"type": "function"} for t in TOOLS],
           "tool_choice": choice, "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
           "top_logprobs": 1}
    out = client.post("/v1/responses", json=req).json()["output"]
    parts = [p for item in out if item["type"] == "message" for p in item["content"]]
    if parts:
        assert [p["logprobs"] for p in parts] == [got]
    else:  # an answer of calls alone has no message
        assert calls and not got
    evs = named_events(client.post("/v1/responses", json={**req, "stream": True}))
    assert sum((e["logprobs"] for e in evs if e["type"] == "response.output_text.delta"), []) == got
    assert [e["logprobs"] for e in evs if e["type"] == "response.output_text.done"] == ([got] if parts else [])
    plain = client.post("/v1/responses", json={**req, "include": None}).json()["output"]
    assert all(p["logprobs"] == [] for item in plain if item["type"] == "message" for p in item["content"])


def test_responses_logprobs_need_a_backend_with_them(tok):
    client = TestClient(create_app(Scripted(tok.encode("hi" + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=96))
    r = client.post("/v1/responses", json={"model": NAME, "input": "x", "include": ["message.output_text.logprobs"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include"
    r = client.post("/v1/responses", json={"model": NAME, "input": "x", "top_logprobs": 21})
    assert r.status_code == 400 and "top_logprobs" in r.text


def test_completion_top_logprobs_keep_every_alternative(tok):
    """Completions' `top_logprobs` is a dict keyed by text: ids past the tokenizer (a model with more logits than
    tokens, as m3-small over the trained tokenizer) are keyed `token_id:N`, and of alternatives that decode alike
    the most likely keeps the key (the last one used to overwrite it)."""
    from openm3.serve.logprobs import TokenLogprobs

    fffd = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"][:2]  # byte tokens of no whole char
    assert len(fffd) == 2
    word = tok.encode(" the")[0]
    top = [(word, -0.5), (tok.vocab_size + 7, -1.0), (fffd[0], -2.0), (tok.vocab_size + 9, -3.0), (fffd[1], -4.0)]
    entries = TokenLogprobs(tok, 5).completion([(word, -0.5, top)])
    assert entries["top_logprobs"] == [{" the": -0.5, f"token_id:{tok.vocab_size + 7}": -1.0, "\ufffd": -2.0,
                                        f"token_id:{tok.vocab_size + 9}": -3.0}]
    assert entries["tokens"] == [" the"]
