"""vLLM's `/tokenize` and `/detokenize`: a chat's count is the prompt length `/v1/chat/completions` feeds the model
(the usage's prompt_tokens), a text's ids are the Completions prompt's, ids decode back, and bad requests get a 400
naming the field."""

from __future__ import annotations

from fastapi.testclient import TestClient

from openm3.data.chat import render_chat
from openm3.data.tokenizer import EOS
from openm3.serve import create_app

from test_serve import CALL_TEXT, NAME, TOOLS, Scripted, tok  # noqa: F401 - the fixture

LIMIT = 4096


def _client(tok):
    return TestClient(create_app(Scripted(tok.encode("ok" + EOS), tok.vocab_size), tok, model_name=NAME,
                                 max_total_tokens=LIMIT))


def test_tokenize_counts_what_a_request_feeds(tok):
    client = _client(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read src/a.py"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "read_file", "arguments": '{"path": "src/a.py"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    body = client.post("/tokenize", json={"model": NAME, "messages": messages, "tools": TOOLS}).json()
    usage = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages, "tools": TOOLS,
                                                      "max_tokens": 4}).json()["usage"]
    assert body["count"] == len(body["tokens"]) == usage["prompt_tokens"] and body["max_model_len"] == LIMIT
    assert body["token_strs"] is None
    bare = client.post("/tokenize", json={"messages": messages, "tools": TOOLS, "add_generation_prompt": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(render_chat(messages, TOOLS, add_generation_prompt=False))
    assert body["tokens"][:bare["count"]] == bare["tokens"] and body["count"] > bare["count"]
    assert "".join(bare["token_strs"]) == tok.decode(bare["tokens"])
    text = client.post("/tokenize", json={"prompt": CALL_TEXT}).json()
    assert text["tokens"] == tok.encode(CALL_TEXT)
    assert client.post("/detokenize", json={"model": NAME, "tokens": text["tokens"]}).json() == {"prompt": CALL_TEXT}


def test_bad_token_requests_name_the_field(tok):
    client = _client(tok)
    for path, body, param, status in (
            ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None, 400),
            ("/tokenize", {}, None, 400),
            ("/tokenize", {"model": "other", "prompt": "x"}, "model", 404),
            ("/tokenize", {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "messages", 400),
            ("/detokenize", {"tokens": [1, tok.vocab_size]}, "tokens", 400)):
        r = client.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
