"""`openm3 serve`'s Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`).

The same conversation sent through the OpenAI endpoint and through this one renders the same prompt, so the
answers are checked against the OpenAI endpoint's (already tested against `generate`); tool calls use the
scripted backend of `test_serve.py`, since a random model never writes one.
"""

import json
import re

import pytest
from fastapi.testclient import TestClient

from openm3.data.chat import render_chat
from openm3.data.tokenizer import EOS
from openm3.serve import create_app
import test_serve
from test_serve import CALL_TEXT, NAME, TOOLS, Scripted, named_events

tok, model, client = test_serve.tok, test_serve.model, test_serve.client  # module-scoped fixtures, shared

ANTHROPIC_TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": TOOLS[0]["function"][
    "parameters"]}]


def streamed(chunks: list[dict]) -> tuple[str, list[dict], str, str | None, int]:
    """(text, tool_use blocks, stop_reason, stop_sequence, output_tokens) rebuilt from a stream's events, checking
    their order: message_start, blocks (start, deltas, stop, by index), message_delta, message_stop."""
    assert chunks[0]["type"] == "message_start" and chunks[0]["message"]["content"] == []
    assert [c["type"] for c in chunks[-2:]] == ["message_delta", "message_stop"]
    text, tools, open_index, next_index = "", [], None, 0
    for c in chunks[1:-2]:
        if c["type"] == "content_block_start":
            assert open_index is None and c["index"] == next_index
            open_index, block = c["index"], dict(c["content_block"])
            if block["type"] == "tool_use":
                block["partial"] = ""
                tools.append(block)
        elif c["type"] == "content_block_delta":
            assert c["index"] == open_index
            if c["delta"]["type"] == "text_delta":
                text += c["delta"]["text"]
            else:
                tools[-1]["partial"] += c["delta"]["partial_json"]
        else:
            assert c["type"] == "content_block_stop" and c["index"] == open_index
            open_index, next_index = None, next_index + 1
    for block in tools:
        block["input"] = json.loads(block.pop("partial"))
    delta = chunks[-2]
    return text, tools, delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"], delta["usage"]["output_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_answer_equals_the_chat_endpoint(client, tok, stream):
    system = "You are terse."
    req = {"model": NAME, "max_tokens": 6, "temperature": 0,
           "system": [{"type": "text", "text": system}],
           "messages": [{"role": "user", "content": [{"type": "text", "text": "Say something"}]}]}
    chat = client.post("/v1/chat/completions", json={
        "model": NAME, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say something"}]}).json()
    want_text = chat["choices"][0]["message"]["content"]
    want_reason = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    prompt_tokens = chat["usage"]["prompt_tokens"]
    r = client.post("/v1/messages", json={**req, "stream": stream})
    if stream:
        text, tools, reason, stop_seq, output = streamed(named_events(r))
        assert named_events(r)[0]["message"]["usage"]["input_tokens"] == prompt_tokens
    else:
        body = r.json()
        assert r.status_code == 200 and body["type"] == "message" and body["role"] == "assistant"
        assert body["id"].startswith("msg_") and body["model"] == NAME
        assert [b["type"] for b in body["content"]] == ["text"]
        text, reason, stop_seq = body["content"][0]["text"], body["stop_reason"], body["stop_sequence"]
        output, tools = body["usage"]["output_tokens"], []
        assert body["usage"]["input_tokens"] == prompt_tokens
    assert text == want_text and reason == want_reason and stop_seq is None and tools == []
    assert output == chat["usage"]["completion_tokens"]
    count = client.post("/v1/messages/count_tokens", json={k: v for k, v in req.items() if k != "max_tokens"})
    assert count.json() == {"input_tokens": prompt_tokens}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_use_round_trip_renders_like_the_openai_endpoint(tok, stream):
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    question = {"role": "user", "content": "What is in src/a.py?"}
    req = {"model": NAME, "max_tokens": 200, "messages": [question], "tools": ANTHROPIC_TOOLS, "stream": stream}
    r = client.post("/v1/messages", json=req)
    if stream:
        text, tools, reason, _, _ = streamed(named_events(r))
    else:
        body = r.json()
        assert [b["type"] for b in body["content"]] == ["text", "tool_use"]
        text, tools, reason = body["content"][0]["text"], body["content"][1:], body["stop_reason"]
    assert reason == "tool_use" and text == "Let me look."
    assert len(tools) == 1 and tools[0]["id"].startswith("toolu_") and tools[0]["name"] == "read_file"
    assert tools[0]["input"] == {"path": "src/a.py", "lines": 20}
    assert tok.decode(backend.prompts[0]) == render_chat([question], TOOLS, add_generation_prompt=True)

    # The agent runs the tool and sends the result back: the prompt is the one the OpenAI endpoint builds.
    follow = [question, {"role": "assistant", "content": [{"type": "text", "text": text}, tools[0]]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tools[0]["id"],
                                            "content": [{"type": "text", "text": "print('hi')"}]},
                                           {"type": "text", "text": "And now?"}]}]
    assert client.post("/v1/messages", json={**req, "messages": follow, "stream": False}).status_code == 200
    openai_follow = [question, {"role": "assistant", "content": text, "tool_calls": [
        {"id": tools[0]["id"], "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps(tools[0]["input"])}}]},
        {"role": "tool", "tool_call_id": tools[0]["id"], "content": "print('hi')"},
        {"role": "user", "content": "And now?"}]
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": openai_follow, "tools": TOOLS})
    assert r.status_code == 200 and backend.prompts[1] == backend.prompts[2]


def test_tool_choice_none_keeps_the_call_as_text(tok):
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    body = client.post("/v1/messages", json={"model": NAME, "max_tokens": 200, "tools": ANTHROPIC_TOOLS,
                                              "tool_choice": {"type": "none"},
                                              "messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["content"] == [{"type": "text", "text": CALL_TEXT}] and body["stop_reason"] == "end_turn"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_sequence_is_reported(tok, stream):
    backend = Scripted(tok.encode("alpha beta STOP gamma" + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    req = {"model": NAME, "max_tokens": 100, "stop_sequences": ["never", "STOP"], "stream": stream,
           "messages": [{"role": "user", "content": "go"}]}
    r = client.post("/v1/messages", json=req)
    if stream:
        text, _, reason, stop_seq, _ = streamed(named_events(r))
    else:
        body = r.json()
        text, reason, stop_seq = body["content"][0]["text"], body["stop_reason"], body["stop_sequence"]
    assert (text, reason, stop_seq) == ("alpha beta ", "stop_sequence", "STOP")


@pytest.mark.parametrize("body, status, kind, match", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "not_found_error", "'claude-x' does not exist"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", r"messages\[0\].content\[0\]: image blocks are not supported"),
    ({"max_tokens": 4, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "forcing a tool call"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 200}]}, 400, "invalid_request_error",
     "configured maximum"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]}, 400,
     "invalid_request_error", r"unsupported block 'tool_result' in a assistant message"),
], ids=["no-max-tokens", "no-messages", "unknown-model", "image", "forced-tool", "temperature", "too-long",
        "misplaced-block"])
def test_bad_requests_get_anthropic_errors(client, body, status, kind, match):
    r = client.post("/v1/messages", json={"model": NAME, **body})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind
    assert re.search(match, err["error"]["message"]), err


def test_a_failing_backend_gives_an_api_error(tok):
    def broken(prompt, **_):
        raise RuntimeError("out of memory")

    client = TestClient(create_app(broken, tok, model_name=NAME, max_total_tokens=64), raise_server_exceptions=False)
    req = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = client.post("/v1/messages", json=req)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    assert "out of memory" in r.json()["error"]["message"]
    chunks = named_events(client.post("/v1/messages", json={**req, "stream": True}))
    assert chunks[-1]["type"] == "error" and chunks[-1]["error"]["type"] == "api_error"


def test_models_list_in_anthropic_form_when_asked(client):
    body = client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert body["data"][0]["type"] == "model" and body["data"][0]["id"] == NAME and body["has_more"] is False
    assert client.get("/v1/models").json()["data"][0]["object"] == "model"  # OpenAI's form otherwise


def test_a_final_assistant_message_is_continued(tok):
    """Anthropic's prefill: the prompt ends with the assistant's text (no end of turn), the answer is the rest."""
    backend = Scripted(tok.encode(" 42." + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    question = {"role": "user", "content": "What is six times seven?"}
    body = client.post("/v1/messages", json={"model": NAME, "max_tokens": 20, "messages": [
        question, {"role": "assistant", "content": "The answer is"}]}).json()
    assert body["content"] == [{"type": "text", "text": " 42."}] and body["stop_reason"] == "end_turn"
    assert tok.decode(backend.prompts[0]) == render_chat([question], add_generation_prompt=True) + "The answer is"


def test_text_documents_reach_the_prompt_and_urls_are_refused(client, tok):
    """A document block of type `text` or `content` renders as its title, context and text, paragraphs apart, the
    same prompt as that text sent plainly; a URL source is a 400 that says what the server reads (PDFs:
    `test_serve_documents.py`)."""
    doc = {"type": "document", "title": "Notes", "context": "From the wiki.",
           "source": {"type": "text", "media_type": "text/plain", "data": "MSA keeps 16 blocks."}}
    plain = "Notes\n\nFrom the wiki.\n\nMSA keeps 16 blocks.\n\nSummarise."
    as_content = {**doc, "source": {"type": "content", "content": [{"type": "text", "text": "MSA keeps "},
                                                                   {"type": "text", "text": "16 blocks."}]}}

    def count(content) -> int:
        r = client.post("/v1/messages/count_tokens", json={"model": NAME, "messages": [
            {"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    from openm3.serve.anthropic import CountTokensRequest, chat_messages

    for d in (doc, as_content):
        content = [d, {"type": "text", "text": "Summarise."}]
        req = CountTokensRequest(model=NAME, messages=[{"role": "user", "content": content}])
        assert chat_messages(req) == [{"role": "user", "content": plain}]
        assert count(content) == count(plain)
    pdf = {"type": "document", "source": {"type": "url", "url": "https://example.org/a.pdf"}}
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": [pdf]}]})
    assert r.status_code == 400 and "messages[0].content[0].source" in r.json()["error"]["message"]
    assert "send the document inline" in r.json()["error"]["message"]


def test_a_tool_result_may_hold_documents_and_search_results():
    """A retrieval tool's result: its document and search_result blocks render as text (title and source lines,
    then the text); a document inside a document's content is refused, naming where."""
    from openm3.serve.anthropic import CountTokensRequest, chat_messages

    hit = {"type": "search_result", "source": "https://example.org/msa", "title": "MSA",
           "content": [{"type": "text", "text": "top-16 blocks"}]}
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "block size 128"}}
    turns = [{"role": "user", "content": "find it"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [hit, doc]}]}]
    out = chat_messages(CountTokensRequest(model=NAME, messages=turns))
    assert out[-1] == {"role": "tool", "tool_call_id": "t1",
                       "content": "MSA\nhttps://example.org/msa\ntop-16 blocks\n\nblock size 128\n\n"}
    nested = {**doc, "source": {"type": "content", "content": [doc]}}
    turns[-1]["content"][0]["content"] = [nested]
    with pytest.raises(ValueError, match=r"content\[0\]\.content\[0\]\.source\.content\[0\]: expected a text block"):
        chat_messages(CountTokensRequest(model=NAME, messages=turns))
