"""`openm3 serve`: the OpenAI-compatible API over a random m3-tiny model and the locally trained tokenizer.

Tool calls: a random model does not write a tool call, so `test_tool_call_round_trip` uses a scripted backend that
emits the tokens of a known tool call; everything after generation (text, parsing, the response, re-rendering the
call in the next prompt) is the server's real path.
"""

import json
import re
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient  # the `serve` extra, and httpx2 for the test client

from openm3.data.chat import render_chat
from openm3.data.tokenizer import EOS, TokenizerSettings, get_tokenizer
from openm3.engine.generate import generate
from openm3.models import M3TextConfig, M3TextModel
from openm3.serve import ModelBackend, TextStream, create_app
from openm3.serve.cli import build_app, build_parser

SMALL = TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000)
NAME = "tiny"
LIMIT = 96


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return get_tokenizer(SMALL, tmp_path_factory.mktemp("tok-cache"))


def tiny_model(tok, positions: int = 256) -> M3TextModel:
    """A random two-layer m3-tiny (a dense and an MSA layer, a dense and an MoE MLP), seeded."""
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=tok.vocab_size, num_hidden_layers=2,
                                    layer_types=["full_attention", "minimax_m3_sparse"],
                                    mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                    max_position_embeddings=positions)
    return M3TextModel(config).eval()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok)


@pytest.fixture(scope="module")
def client(model, tok):
    return TestClient(create_app(ModelBackend(model), tok, model_name=NAME, max_total_tokens=LIMIT))


def events(response) -> list:
    """The JSON chunks of an SSE body; checks the framing and the closing [DONE]."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def named_events(response) -> list[dict]:
    """The JSON events of an SSE body whose events are named (Anthropic's Messages, OpenAI's Responses): checks the
    framing and that each `event:` name is its data's `type`."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        chunk = json.loads(data[len("data: "):])
        assert chunk["type"] == name[len("event: "):]
        out.append(chunk)
    return out


def greedy_ids(model, tok, prompt: list[int], n: int) -> list[int]:
    results, _ = generate(model, [prompt], max_new_tokens=n, stop_tokens=[tok.eos_id])
    return [t for t in results[0].tokens if t != tok.eos_id]


def test_models_list(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [NAME]
    assert body["data"][0]["max_model_len"] == LIMIT  # vLLM's field: clients size their requests by it


def test_api_key(model, tok):
    """With an API key, requests under /v1 need it as a Bearer token or Anthropic's x-api-key (401 in each API's
    error format otherwise); /health and /metrics stay open, as vLLM's do."""
    client = TestClient(create_app(Scripted(tok.encode("hi" + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=LIMIT, api_key="s3cret"))
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"x-api-key": "s3cre"}):
        r = client.post("/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    assert client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    r = client.post("/v1/messages", json={**chat, "max_tokens": 2}, headers={"X-Request-Id": "t" * 300})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["request-id"] == r.headers["x-request-id"] == "t" * 128  # named, and cut to 128 characters
    assert client.post("/v1/messages", json=chat, headers={"x-api-key": "s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    with pytest.raises(ValueError, match="api_key"):
        create_app(Scripted([], tok.vocab_size), tok, model_name=NAME, max_total_tokens=LIMIT, api_key="")


def test_health_and_version(client):
    import openm3

    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert client.get("/version").json() == {"version": openm3.__version__, "model": NAME}
    before = client.get("/metrics").text  # a backend without figures of its own: the request counts only
    assert "# TYPE openm3:http_requests_total counter" in before and "openm3:requests_running" not in before
    client.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1, "top_p": 0})  # a 400
    client.post("/v1/no/such/path", json={})
    after = client.get("/metrics").text
    assert 'openm3:http_requests_total{path="/v1/completions",status="400"}' in after
    assert 'path="other",status="404"' in after and "/v1/no/such/path" not in after


@pytest.mark.parametrize("prompt", ["def f(x):\n    return", [5, 300, 17, 42]], ids=["text", "ids-T4"])
def test_completion_is_the_engines_greedy_text(client, model, tok, prompt):
    r = client.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    want = greedy_ids(model, tok, ids, 6)
    assert body["choices"][0]["text"] == tok.decode(want)
    assert body["object"] == "text_completion" and body["model"] == NAME
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["total_tokens"] == len(ids) + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] == ("length" if usage["completion_tokens"] == 6 else "stop")


def test_streamed_completion_equals_the_plain_one(client):
    req = {"model": NAME, "prompt": "In the beginning", "max_tokens": 10, "temperature": 0}
    plain = client.post("/v1/completions", json=req).json()
    chunks = events(client.post("/v1/completions", json={**req, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["choices"][0]["text"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_chat_completion_renders_the_template_and_streams_the_same_text(client, model, tok):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "Sort a list."}]}]
    req = {"model": NAME, "messages": messages, "max_completion_tokens": 8, "temperature": 0}
    body = client.post("/v1/chat/completions", json=req).json()
    prompt = tok.encode(render_chat(messages, add_generation_prompt=True))
    want = tok.decode(greedy_ids(model, tok, prompt, 8))
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want}

    chunks = events(client.post("/v1/chat/completions", json={**req, "stream": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_stop_string_cuts_the_text_and_ends_generation(client):
    req = {"model": NAME, "prompt": "The LORD said", "max_tokens": 16, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert len(full) >= 6, f"the random model's text is too short to pick a stop string from: {full!r}"
    stop = full[3:5]
    want = full[:full.find(stop)]
    body = client.post("/v1/completions", json={**req, "stop": ["\x00never", stop]}).json()
    assert body["choices"][0]["text"] == want and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == stop  # vLLM's field: the stop string found
    assert body["usage"]["completion_tokens"] < 16
    chunks = events(client.post("/v1/completions", json={**req, "stop": stop, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_text_stream_holds_partial_characters_and_stop_prefixes(tok):
    text = "naïve café → ok STOP here"
    ids = tok.encode(text)
    stream = TextStream(tok, stop=["STOP"])
    deltas = [stream.push(t) for t in ids]
    deltas.append(stream.finish())
    assert "".join(deltas) == "naïve café → ok " and stream.stopped
    assert not any("\ufffd" in d or "S" in d for d in deltas)
    assert len(ids) > len("naïve café → ok STOP") // 4  # several tokens, so the holding was exercised


def test_incremental_text_is_the_whole_decode_token_by_token(tok):
    """`IncrementalText` (what `TextStream` decodes with: a few tokens per push) gives `tok.decode(tokens[:i])`
    after every token: text with multi-byte characters split across tokens (an unfinished one shows as U+FFFD,
    as in the whole decode), random ids (invalid byte runs), chat special tokens; the window it decodes stays a
    few tokens long. A decoder that strips a sequence's leading space (Metaspace) is followed too."""
    import random

    from tokenizers import Tokenizer, decoders, models

    from openm3.data.tokenizer import IncrementalText

    rng = random.Random(0)
    text = "naïve café → ok 你好，世界 🙂🚀 <think>x</think> def f(a):\n    return a  # ok\n" * 6
    vocab = tok.vocab_size
    seqs = [tok.encode(text), [rng.randrange(vocab) for _ in range(600)],
            tok.encode(render_chat([{"role": "user", "content": "hi 🙂"}]))]
    for ids in seqs:
        inc = IncrementalText(tok)
        for i, t in enumerate(ids):
            assert inc.push(t) == tok.decode(ids[:i + 1]), i
        assert len(inc.tokens) - inc._prefix <= 8  # the window, not the whole answer
    words = ["\u2581Hello", "\u2581world", "!", "\u2581again", "\u2581\u2581x"]
    meta = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="!"))
    meta.decoder = decoders.Metaspace()
    ids = [rng.randrange(len(words)) for _ in range(40)]
    inc = IncrementalText(meta)
    for i, t in enumerate(ids):
        assert inc.push(t) == meta.decode(ids[:i + 1]), i


def test_text_stream_decodes_long_answers_in_linear_time(tok):
    """Decoding the whole answer at every token took 4.7 s for 8K tokens on the 2-core machine (O(n^2)); the
    windowed decode keeps a 16K-token answer well under a second, with the same text."""
    ids = (tok.encode("def f(a):\n    return a  # naïve → ok\n") * 2000)[:16000]
    stream = TextStream(tok, stop=["STOP"], hold=["<minimax:tool_call>"])
    start = time.perf_counter()
    for t in ids:
        stream.push(t)
    assert time.perf_counter() - start < 3.0
    assert stream.text == tok.decode(ids) and not stream.stopped


def test_min_tokens_ignores_the_stop_strings_its_tokens_complete(tok):
    """vLLM's rule: a stop string completed by one of the first min_tokens - 1 tokens ends nothing; one completed
    later does, the first after that point (and an earlier one does not come back)."""
    text = "ab STOP cd STOP ef"
    ids = tok.encode(text)
    first = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))  # token k completes it
    for min_tokens, want in ((0, "ab "), (first, "ab "), (first + 1, "ab STOP cd ")):
        stream = TextStream(tok, stop=["STOP"], min_tokens=min_tokens)
        deltas = [stream.push(t) for t in ids]
        assert "".join(deltas) + stream.finish() == want and stream.text == want and stream.stopped


class Scripted:
    """A backend that 'samples' fixed tokens and records the prompts it was given."""

    def __init__(self, tokens: list[int], vocab_size: int):
        self.tokens, self.vocab_size, self.prompts = tokens, vocab_size, []

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token):
        self.prompts.append(list(prompt))
        for tok in self.tokens[:max_new_tokens]:
            on_token(tok)
            if tok in stop_tokens:
                return "stop"
        return "length"


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}}]
CALL_TEXT = ('Let me look.<minimax:tool_call>\n<invoke name="read_file">\n<parameter name="path">src/a.py'
             '</parameter>\n<parameter name="lines">20</parameter>\n</invoke>\n</minimax:tool_call>')


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_parallel_tool_calls_false_keeps_the_first_call(tok, stream):
    """An answer with two calls: every API returns both by default, the first alone with OpenAI's
    `parallel_tool_calls: false` or Anthropic's `disable_parallel_tool_use`."""
    second = '<invoke name="read_file">\n<parameter name="path">b.py</parameter>\n</invoke>\n'
    text = CALL_TEXT.replace("</minimax:tool_call>", second + "</minimax:tool_call>")
    client = TestClient(create_app(Scripted(tok.encode(text + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=4096))
    messages = [{"role": "user", "content": "Read two files."}]
    for parallel, want in ((True, ["src/a.py", "b.py"]), (False, ["src/a.py"])):
        r = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "tools": TOOLS,
                                                      "stream": stream, "parallel_tool_calls": parallel})
        if stream:
            calls = [tc for c in events(r) for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        else:
            calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["path"] for c in calls] == want
        flat = [{"type": "function", **t["function"]} for t in TOOLS]
        body = {"model": NAME, "input": "Read two files.", "tools": flat, "stream": stream,
                "parallel_tool_calls": parallel}
        r = client.post("/v1/responses", json=body)
        output = [e["response"] for e in named_events(r) if e["type"] == "response.completed"][0]["output"] \
            if stream else r.json()["output"]
        assert [json.loads(i["arguments"])["path"] for i in output if i["type"] == "function_call"] == want
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        body = {"model": NAME, "max_tokens": 500, "messages": messages, "tools": tools,
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": not parallel}}
        r = client.post("/v1/messages", json=body)
        assert [b["input"]["path"] for b in r.json()["content"] if b["type"] == "tool_use"] == want


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_call_round_trip(tok, stream):
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    messages = [{"role": "user", "content": "What is in src/a.py?"}]
    req = {"model": NAME, "messages": messages, "tools": TOOLS, "stream": stream}
    r = client.post("/v1/chat/completions", json=req)
    if stream:
        chunks = events(r)
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        assert [tc.pop("index") for tc in calls] == [0]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        content, calls, finish = choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls" and content == "Let me look."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "read_file"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "src/a.py", "lines": 20}
    assert tok.decode(backend.prompts[0]) == render_chat(messages, TOOLS, add_generation_prompt=True)

    # The client sends the call back with the tool's answer: the next prompt holds the call as the model wrote it.
    follow = messages + [{"role": "assistant", "content": content, "tool_calls": calls},
                         {"role": "tool", "tool_call_id": calls[0]["id"], "content": "print('hi')"}]
    r = client.post("/v1/chat/completions", json={**req, "messages": follow, "stream": False})
    assert r.status_code == 200, r.text
    prompt = tok.decode(backend.prompts[1])
    assert CALL_TEXT + EOS + "\n]~b]tool\n<response>print('hi')</response>" in prompt
    assert prompt.endswith("]~b]ai\n")


def test_tool_choice_none_returns_the_call_as_text(tok):
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    req = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "none"}
    choice = client.post("/v1/chat/completions", json=req).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL_TEXT} and choice["finish_reason"] == "stop"


def test_a_failing_backend_gives_a_server_error(tok):
    def broken(prompt, **_):
        raise RuntimeError("out of memory")

    client = TestClient(create_app(broken, tok, model_name=NAME, max_total_tokens=64), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "out of memory" in r.json()["error"]["message"]
    chunks = events(client.post("/v1/completions", json={"model": NAME, "prompt": "x", "stream": True}))
    assert chunks[-1]["error"]["type"] == "server_error"


class Slow:
    """A backend that samples token 300 every few ms and records its peak concurrency and its token count."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.running, self.peak, self.sampled = vocab_size, 0, 0, 0
        self.done = threading.Event()

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            for _ in range(max_new_tokens):
                time.sleep(0.002)
                self.sampled += 1
                on_token(300)
            return "length"
        finally:
            self.running -= 1
            self.done.set()


def test_a_client_that_disconnects_stops_its_generation(tok):
    backend = Slow(tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    req = {"model": NAME, "prompt": "x", "max_tokens": 2000, "stream": True}
    with client.stream("POST", "/v1/completions", json=req) as r:
        first = next(r.iter_lines())
    assert first.startswith("data: {") and backend.done.wait(10)
    assert backend.sampled < 100  # 2000 would take ~4 s


def _post_three_at_once(backend, tok, max_tokens: int) -> list[int]:
    """Three concurrent completions through the app over `backend`; their HTTP status codes."""
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    req = {"model": NAME, "prompt": "x", "max_tokens": max_tokens}
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(client.post("/v1/completions", json=req).status_code))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return codes


def test_requests_run_one_at_a_time(tok):
    backend = Slow(tok.vocab_size)
    assert _post_three_at_once(backend, tok, 20) == [200] * 3
    assert backend.sampled == 60 and backend.peak == 1


def test_concurrent_backends_are_not_serialised(tok):
    backend = Slow(tok.vocab_size)
    backend.concurrent = True
    assert _post_three_at_once(backend, tok, 200) == [200] * 3
    assert backend.sampled == 600 and backend.peak > 1


def test_batched_server_answers_concurrent_requests_as_the_engine_does_alone(model, tok):
    """The default `openm3 serve` backend (continuous batching): concurrent greedy completions, one with a stop
    string, equal the engine's greedy text for each prompt alone."""
    from openm3.engine.batching import BatchedGenerator

    backend = BatchedGenerator(model, token_budget=4 * LIMIT, max_batch=4, chunk_size=32)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT))
    prompts = ["def f(x):\n    return", "In the beginning", "The quick brown fox"]
    bodies = [None] * 3

    def ask(i):
        bodies[i] = client.post("/v1/completions", json={"model": NAME, "prompt": prompts[i], "max_tokens": 8,
                                                           "temperature": 0}).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    backend.close()
    for prompt, body in zip(prompts, bodies):
        assert body["choices"][0]["text"] == tok.decode(greedy_ids(model, tok, tok.encode(prompt), 8))
    assert backend.cache.free_pages == backend.plan.num_pages


def test_repeated_conversation_reports_cached_prompt_tokens(model, tok):
    """With the batching backend's prefix cache, a conversation sent again (as agents resend their history) reads
    its full pages from the cache: every API's usage says how many, in its own terms, and the answer is the same."""
    from openm3.engine.batching import BatchedGenerator

    backend = BatchedGenerator(model, token_budget=4 * LIMIT, max_batch=2)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=LIMIT))
    messages = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog, " * 2}]
    ask = {"model": NAME, "max_tokens": 4, "temperature": 0}
    first = client.post("/v1/chat/completions", json={**ask, "messages": messages}).json()
    again = client.post("/v1/chat/completions", json={**ask, "messages": messages}).json()
    prompt = first["usage"]["prompt_tokens"]
    page = model.config.index_block_size
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // page * page > 0
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    resp = client.post("/v1/responses", json={"model": NAME, "input": messages, "max_output_tokens": 4,
                                              "temperature": 0}).json()
    assert resp["usage"]["input_tokens"] == prompt
    assert resp["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // page * page
    anth = client.post("/v1/messages", json={**ask, "messages": messages}).json()["usage"]
    assert anth["cache_read_input_tokens"] == (prompt - 1) // page * page
    assert anth["input_tokens"] + anth["cache_read_input_tokens"] == prompt
    chunks = named_events(client.post("/v1/messages", json={**ask, "messages": messages, "stream": True}))
    start, end = chunks[0]["message"]["usage"], chunks[-2]["usage"]  # message_start is sent once admitted
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] == anth["cache_read_input_tokens"]
    metrics = client.get("/metrics")
    backend.close()
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    samples = dict(line.rsplit(" ", 1) for line in metrics.text.splitlines() if not line.startswith("#"))
    assert samples["openm3:prompt_tokens_total"] == str(5 * prompt)
    assert samples["openm3:prefix_cache_hit_tokens_total"] == str(4 * ((prompt - 1) // page * page))
    assert samples['openm3:requests_finished_total{reason="length"}'] == "5"
    assert samples["openm3:requests_running"] == samples["openm3:requests_prefilling"] == "0"
    assert int(samples["openm3:cache_pages_cached"]) > 0
    assert samples['openm3:http_requests_total{path="/v1/chat/completions",status="200"}'] == "2"
    assert "# TYPE openm3:generation_tokens_total counter" in metrics.text
    # vLLM's request histograms: 5 requests of 4 tokens, each admitted (prefix caching reports admissions)
    assert "# TYPE openm3:time_to_first_token_seconds histogram" in metrics.text
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert samples[f"openm3:{name}_count"] == samples[f'openm3:{name}_bucket{{le="+Inf"}}'] == "5", name
    assert samples["openm3:inter_token_latency_seconds_count"] == str(5 * 3)
    assert float(samples["openm3:request_generation_tokens_sum"]) == 20
    assert float(samples["openm3:request_prompt_tokens_sum"]) == 5 * prompt
    ttft = [int(v) for k, v in samples.items() if k.startswith("openm3:time_to_first_token_seconds_bucket")]
    assert ttft == sorted(ttft) and ttft[-1] == 5  # cumulative
    live = client.app.state.stats_log.latency.live()  # what the periodic stats line reads
    assert live == {"in_flight": 0, "waiting": 0, "prompt": 5 * prompt, "generated": 20}


BAD = [
    ("empty-prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("empty-ids", "/v1/completions", {"prompt": []}, "prompt"),
    ("top_p-0", "/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("top_p-1.5", "/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("negative-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("prompt-T200-over-limit", "/v1/completions", {"prompt": [7] * 200}, "prompt"),
    ("max_tokens-over-limit", "/v1/completions", {"prompt": [7] * 90, "max_tokens": 10}, "max_tokens"),
    ("id-outside-vocab", "/v1/completions", {"prompt": [1, 1 << 20]}, "prompt"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "gpt-4o"}, "model"),
    ("logprobs-21", "/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("top_logprobs-alone", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2}, "top_logprobs"),
    ("empty-stop", "/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("no-messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("forced-tool-call", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "tool_choice": "required"}, "tool_choice"),
    ("two-lengths", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                             "max_completion_tokens": 3}, "max_completion_tokens"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("chat-over-limit", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]},
     "messages"),
    ("bad-tool-arguments", "/v1/chat/completions", {"messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}]}, "messages"),
    ("image-part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_naming_the_field(client, path, body, param):
    r = client.post(path, json={"model": NAME, **body})
    assert r.status_code == (404 if param == "model" else 400), r.text  # an unknown model is OpenAI's 404
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


HI = [{"role": "user", "content": "hi"}]
BODY_ERRORS = [  # (id, path, how the body is sent, the message, the param)
    ("no-content-type", "/v1/chat/completions", {"content": json.dumps({"model": NAME, "messages": HI})},
     "body: expected a JSON object sent with content-type: application/json, got no content-type header", None),
    ("form-content-type", "/v1/chat/completions",
     {"content": "{}", "headers": {"content-type": "application/x-www-form-urlencoded"}},
     "body: expected a JSON object sent with content-type: application/json, got content-type "
     "application/x-www-form-urlencoded", None),
    ("not-json", "/v1/chat/completions", {"content": '{"model": ', "headers": {"content-type": "application/json"}},
     "body: not valid JSON (Expecting value at character 10)", None),
    ("not-an-object", "/v1/completions", {"json": [1, 2]}, "body: expected a JSON object, got a list", None),
    ("empty", "/v1/completions", {"content": b"", "headers": {"content-type": "application/json"}},
     "body: expected a JSON object, got an empty body", None),
    ("union", "/v1/chat/completions", {"json": {"model": NAME, "messages": HI, "stop": 5}},
     "stop: expected a string or a list of strings, got an integer (5)", "stop"),
    ("union-literals", "/v1/chat/completions", {"json": {"model": NAME, "messages": HI, "tool_choice": "any"}},
     "tool_choice: expected 'auto', 'none', 'required' or an object, got a string ('any')", "tool_choice"),
    ("union-branch", "/v1/completions", {"json": {"model": NAME, "prompt": [[1, "a"]]}},
     "prompt[0][1]: expected an integer, got a string ('a')", "prompt"),
    ("tagged-union", "/v1/chat/completions",
     {"json": {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}},
     "messages[0].content[0].text: expected a string, got an integer (5)", "messages"),
    ("literal", "/v1/chat/completions", {"json": {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}},
     "messages[0].role: expected 'system', 'developer', 'user', 'assistant' or 'tool', got a string ('robot')",
     "messages"),
    ("type", "/v1/chat/completions", {"json": {"model": NAME, "messages": HI, "max_tokens": "x"}},
     "max_tokens: expected an integer, got a string ('x')", "max_tokens"),
    ("missing", "/v1/chat/completions", {"json": {"messages": HI}}, "model: a required field is missing", "model"),
    ("tool-field", "/v1/chat/completions", {"json": {"model": NAME, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": 5}}]}},
     "tools[0].function.parameters: expected an object, got an integer (5)", "tools"),
]


@pytest.mark.parametrize("path,send,message,param", [b[1:] for b in BODY_ERRORS], ids=[b[0] for b in BODY_ERRORS])
def test_invalid_bodies_say_what_was_expected(client, path, send, message, param):
    """A body that is not a JSON object (sent without content-type: application/json, as `curl -d` does, or not JSON
    at all) and a field of the wrong type (a union's branches named in words, not pydantic's labels) get a message
    naming the place and what was expected, in OpenAI's form and, on /v1/messages, in Anthropic's."""
    r = client.post(path, **send)
    assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                                          "param": param, "code": None}
    if param is None:  # the same message in Anthropic's error form
        r = client.post("/v1/messages", **send)
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                                               "message": message}}


def test_invalid_query_parameters_name_the_parameter(client):
    r = client.get("/v1/responses/resp_1", params={"starting_after": "abc"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "starting_after: expected an integer, got a string ('abc')", "type": "invalid_request_error",
        "param": "starting_after", "code": None}


def test_image_part_error_names_the_part(client):
    body = {"model": NAME, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert "content[1]: 'image_url' parts are not supported" in r.json()["error"]["message"]


def test_cli_uses_the_checkpoint_tokenizer(tok, model, tmp_path):
    """A checkpoint directory holding a tokenizer (as `openm3 train --export` writes it) needs no --tokenizer."""
    model.save_pretrained(tmp_path / "ckpt")
    tok.save(tmp_path / "ckpt")
    client = TestClient(build_app(build_parser().parse_args(["--checkpoint", str(tmp_path / "ckpt")])))
    r = client.post("/v1/completions", json={"model": "ckpt", "prompt": "hello world", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode("hello world"))


def test_cli_compile_serves_the_same_tokens(tok, tmp_path, monkeypatch, capsys):
    """`--compile` compiles every decoder layer (torch.compile, as `openm3 generate --compile`) and warms them up
    before the app exists; the answers stay the eager model's."""
    import importlib

    engine_generate = importlib.import_module("openm3.engine.generate")  # (the package exports a function too)
    compiled = []
    real = engine_generate.compile_layers
    monkeypatch.setattr(engine_generate, "compile_layers", lambda m: compiled.append(m) or real(m))
    path = tok.save(tmp_path / "tok")
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64", "--max-batch", "1"]
    body = {"model": "m3-tiny", "prompt": "hello world", "max_tokens": 3, "temperature": 0}
    texts = []
    for extra in ([], ["--compile"]):
        app = build_app(build_parser().parse_args(base + extra))
        assert len(compiled) == len(extra)
        assert ("the decoder layers compiled for serving in" in capsys.readouterr().err) == bool(extra)
        r = TestClient(app).post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert all(layer._compiled_call_impl is not None for layer in compiled[0].layers)
    assert texts[0] == texts[1]


def test_cli_builds_a_preset_at_another_depth(tok, tmp_path):
    """`--layers N` builds the preset at N decoder layers (its pattern kept), with --preset only."""
    path = tok.save(tmp_path / "tok")
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64", "--max-batch", "1"]
    app = build_app(build_parser().parse_args(base + ["--layers", "3"]))
    assert "preset m3-tiny at 3 layers with random weights" in app.state.summary
    size = re.compile(r"([0-9.]+)M parameters")
    four = build_app(build_parser().parse_args(base)).state.summary
    assert float(size.search(app.state.summary)[1]) < float(size.search(four)[1])  # m3-tiny has 4
    r = TestClient(app).post("/v1/completions", json={"model": "m3-tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    with pytest.raises(ValueError, match="--layers must be >= 1"):
        build_app(build_parser().parse_args(base + ["--layers", "0"]))
    ckpt = tmp_path / "ckpt"
    tiny_model(tok).save_pretrained(ckpt)
    with pytest.raises(ValueError, match="--layers: only with --preset"):
        build_app(build_parser().parse_args(["--checkpoint", str(ckpt), "--tokenizer", str(path), "--layers", "2"]))


def test_cli_builds_an_app_from_a_preset(tok, tmp_path, monkeypatch):
    path = tok.save(tmp_path / "tok")
    args = build_parser().parse_args(["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64"])
    client = TestClient(build_app(args))
    assert client.get("/v1/models").json()["data"][0]["id"] == "m3-tiny"
    r = client.post("/v1/completions", json={"model": "m3-tiny", "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1
    for bad in ("0", "1000000"):
        with pytest.raises(ValueError, match="--max-total-tokens"):
            build_app(build_parser().parse_args(["--preset", "m3-tiny", "--tokenizer", str(path),
                                                 "--max-total-tokens", bad]))
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64"]
    with pytest.raises(ValueError, match="--max-batch"):
        build_app(build_parser().parse_args(base + ["--max-batch", "0"]))
    with pytest.raises(ValueError, match="--prefill-chunks-per-step: expected >= 1"):
        build_app(build_parser().parse_args(base + ["--prefill-chunks-per-step", "0"]))
    with pytest.raises(ValueError, match="--token-budget"):
        build_app(build_parser().parse_args(base + ["--token-budget", "32"]))
    serial = TestClient(build_app(build_parser().parse_args(base + ["--max-batch", "1"])))  # one at a time
    r = serial.post("/v1/completions", json={"model": "m3-tiny", "prompt": "x", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    monkeypatch.setenv("OPENM3_API_KEY", "k1")  # the option's default; the flag wins over it
    for extra, key in (([], "k1"), (["--api-key", "k2"], "k2")):
        keyed = TestClient(build_app(build_parser().parse_args(base + ["--max-batch", "1"] + extra)))
        assert keyed.get("/v1/models").status_code == 401
        assert keyed.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with pytest.raises(ValueError, match="--checkpoint"):
        build_app(build_parser().parse_args(["--checkpoint", str(tmp_path / "missing"), "--tokenizer", str(path)]))


def test_cli_speculative_config_serves_the_same_greedy_text(tok, tmp_path):
    """`--speculative-config` (vLLM's JSON; n-gram drafts): the served greedy answers equal those without it, in
    the batched server and one request at a time; the batched server counts its drafts in /metrics; a bad config
    fails naming the option."""
    path = tok.save(tmp_path / "tok")
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "96"]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']
    body = {"model": "m3-tiny", "prompt": "the cat sat on the mat, the cat sat on the mat, the cat", "max_tokens": 24,
            "temperature": 0}
    texts = []
    for extra in ([], spec, spec + ["--max-batch", "1"]):
        client = TestClient(build_app(build_parser().parse_args(base + extra)))
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        if extra == spec:
            assert "openm3:spec_decode_draft_tokens_total" in client.get("/metrics").text
    assert texts[0] == texts[1] == texts[2]
    with pytest.raises(ValueError, match="--speculative-config: speculative config: unknown keys"):
        build_app(build_parser().parse_args(base + ["--speculative-config", '{"num_speculative_tokens": 2, "k": 1}']))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_predicted_output_speeds_speculation_and_changes_nothing(model, tok, stream):
    """OpenAI's `prediction` on a server running speculative decoding: the drafts are looked up in it too, so
    an answer that repeats it keeps far more drafts per step; the greedy answer is the same as without it."""
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.speculative import SpeculativeConfig

    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, speculative=cfg)
    client = TestClient(create_app(gen, tok, model_name=NAME, max_total_tokens=LIMIT, reasoning_parser="none"))
    body = {"model": NAME, "messages": [{"role": "user", "content": "Edit the file."}], "max_tokens": 40,
            "temperature": 0}

    def answer(**extra) -> tuple[str, int, dict]:
        before = gen.accepted_tokens
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        r = client.post("/v1/chat/completions", json={**body, **extra, "stream": stream, **usage})
        assert r.status_code == 200, r.text
        if stream:
            chunks = events(r)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            used = chunks[-1]["usage"]
        else:
            text, used = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
        return text, gen.accepted_tokens - before, used

    plain, kept_alone, used = answer()
    told, kept, told_used = answer(prediction={"type": "content", "content": plain})
    parts, kept_parts, _ = answer(prediction={"type": "content", "content": [{"type": "text", "text": plain}]})
    assert told == parts == plain and kept >= kept_alone + 15 and kept_parts == kept
    # usage: the predicted tokens the answer repeats are accepted; a prediction half unlike it is half rejected
    predicted = len(tok.encode(plain))
    assert "completion_tokens_details" not in used
    assert told_used["completion_tokens_details"] == {"accepted_prediction_tokens": predicted,
                                                      "rejected_prediction_tokens": 0}
    assert told_used["completion_tokens"] == used["completion_tokens"]
    head, filler = tok.decode(tok.encode(plain)[:predicted // 2]), " zq" * (predicted // 8)
    _, _, half_used = answer(prediction={"type": "content", "content": head + filler})
    details = half_used["completion_tokens_details"]
    assert len(tok.encode(head)) - 1 <= details["accepted_prediction_tokens"] <= len(tok.encode(head)) + 1
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == \
        len(tok.encode(head + filler))
    r = client.post("/v1/chat/completions", json={**body, "prediction": {"type": "file", "content": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
    r = client.post("/v1/chat/completions", json={**body, "prediction": {"type": "content", "content": " zq" * LIMIT}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text
    gen.close()


def test_a_predicted_output_speeds_a_server_without_speculative_decoding(model, tok, monkeypatch):
    """A server run without `--speculative-config` still looks a request's predicted output up for drafts
    (adaptive `PREDICTION_DRAFTS`; its gate kept at the prior cost ratio, so the host's load does not decide),
    for that request only: the same greedy answer, drafts kept."""
    import openm3.engine.batching as batching
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.spec_gate import SpeculationGate

    monkeypatch.setattr(batching, "SpeculationGate", lambda: SpeculationGate(use_times=False))

    gen = BatchedGenerator(model, token_budget=1024, max_batch=2)
    client = TestClient(create_app(gen, tok, model_name=NAME, max_total_tokens=LIMIT, reasoning_parser="none"))
    body = {"model": NAME, "messages": [{"role": "user", "content": "Edit the file."}], "max_tokens": 40,
            "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert gen.spec_steps == 0
    r = client.post("/v1/chat/completions", json={**body, "prediction": {"type": "content", "content": plain}})
    assert r.json()["choices"][0]["message"]["content"] == plain and gen.accepted_tokens >= 5
    gen.close()


def test_prediction_tokens_are_the_predicted_tokens_the_answer_repeats_in_order():
    """`prediction_tokens` against hand-counted cases: the same text, one token changed, tokens inserted, an
    answer that repeats part of it, reordered blocks (only one of two swapped blocks is in order), none shared."""
    from openm3.serve.stream import prediction_tokens

    file = list(range(100, 400))
    assert prediction_tokens(file, file) == (300, 0)
    assert prediction_tokens(file, file[:150] + [7] + file[151:]) == (299, 1)
    assert prediction_tokens(file, file[:150] + [7, 8, 9] + file[150:] + [5]) == (300, 0)
    assert prediction_tokens(file, file[:40]) == (40, 260)
    assert prediction_tokens(file, file[200:] + file[:200]) == (200, 100)
    assert prediction_tokens(file, [1, 2, 3]) == (0, 300)
    assert prediction_tokens([], [1, 2]) == (0, 0)
    code = [1, 2, 1, 3] * 150  # tokens past difflib's 1% rule still count where a match runs through them
    assert prediction_tokens(code, code[:300] + [9] + code[301:]) == (599, 1)
