"""`openm3 serve`'s OpenAI Responses API (`POST /v1/responses`).

The same conversation sent through `/v1/chat/completions` and through this endpoint renders the same prompt, so
answers are checked against the chat endpoint's; function calls use the scripted backend of `test_serve.py`.
"""

import json
import re

import pytest
from fastapi.testclient import TestClient

import test_serve
from openm3.data.tokenizer import EOS
from openm3.serve import create_app
from test_files import dead_pid
from test_serve import CALL_TEXT, NAME, TOOLS, Scripted, named_events

tok, model, client = test_serve.tok, test_serve.model, test_serve.client  # module-scoped fixtures, shared
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def sequenced(response) -> list[dict]:
    """`named_events`, checking the Responses API's sequence numbers 0, 1, ... (an error event carries none)."""
    out = named_events(response)
    if out[-1]["type"] != "error":
        assert [c["sequence_number"] for c in out] == list(range(len(out)))
    return out


def streamed(chunks: list[dict]) -> tuple[str, dict]:
    """(text from the deltas, the final response), checking the event order."""
    assert [c["type"] for c in chunks[:2]] == ["response.created", "response.in_progress"]
    assert chunks[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(c["delta"] for c in chunks if c["type"] == "response.output_text.delta")
    done = [c["text"] for c in chunks if c["type"] == "response.output_text.done"]
    assert done in ([text], [])
    final = chunks[-1]["response"]
    assert [c["item"] for c in chunks if c["type"] == "response.output_item.done"] == final["output"]
    return text, final


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("form", ["string", "items"])
def test_responses_answer_equals_the_chat_endpoint(client, stream, form):
    chat = client.post("/v1/chat/completions", json={
        "model": NAME, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say something"}]}).json()
    want = chat["choices"][0]["message"]["content"]
    user = "Say something" if form == "string" else [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say something"}]}]
    req = {"model": NAME, "instructions": "Be terse.", "input": user, "max_output_tokens": 6, "temperature": 0,
           "stream": stream}
    r = client.post("/v1/responses", json=req)
    if stream:
        text, body = streamed(sequenced(r))
        assert text == want
    else:
        body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == NAME
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": want, "annotations": [], "logprobs": []}
    finish = chat["choices"][0]["finish_reason"]
    assert body["status"] == ("incomplete" if finish == "length" else "completed")
    assert body["output"][0]["status"] == body["status"]  # the message item is incomplete too where it was cut
    assert body["incomplete_details"] == ({"reason": "max_output_tokens"} if finish == "length" else None)
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert body["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_function_call_round_trip_renders_like_the_chat_endpoint(tok, stream):
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    question = {"role": "user", "content": "What is in src/a.py?"}
    req = {"model": NAME, "input": [question], "tools": RESPONSE_TOOLS, "stream": stream}
    r = client.post("/v1/responses", json=req)
    body = streamed(sequenced(r))[1] if stream else r.json()
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["message", "function_call"] and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "Let me look."
    call = body["output"][1]
    assert call["name"] == "read_file" and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"path": "src/a.py", "lines": 20}

    # Codex-style follow-up: the whole conversation again, with the call and its output as items.
    follow = [question, body["output"][0], call,
              {"type": "function_call_output", "call_id": call["call_id"], "output": "print('hi')"}]
    assert client.post("/v1/responses", json={**req, "input": follow, "stream": False}).status_code == 200
    chat_follow = [question, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call["call_id"], "type": "function",
         "function": {"name": "read_file", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "print('hi')"}]
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": chat_follow, "tools": TOOLS})
    assert r.status_code == 200 and backend.prompts[1] == backend.prompts[2]


@pytest.mark.parametrize("body, param, match", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "no stored response 'resp_1'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     r"input\[0\]\.content\[0\]: input_image parts are not supported"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "forcing a tool call"),
    ({"input": [{"type": "web_search_call"}]}, "input", r"input\[0\]\.type"),
    ({}, "input", "a required field is missing"),
    ({"input": 5}, "input", r"^input: expected a string or a list of objects, got an integer \(5\)$"),
    ({"input": "hi", "max_output_tokens": 200}, "max_output_tokens",
     r"^max_output_tokens=200 exceeds the \d+ tokens left of the configured maximum of 96 after the \d+ tokens of "
     r"input$"),
    ({"input": "hi", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": "word " * 200}, "input", "configured maximum"),
], ids=["previous-response", "image", "forced-tool", "unknown-item", "no-input", "input-not-a-string-or-list",
        "too-many-output-tokens", "temperature", "too-long"])
def test_bad_requests_name_the_field(client, body, param, match):
    r = client.post("/v1/responses", json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert re.search(match, err["message"]), err


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_previous_response_id_continues_a_stored_conversation(tok, stream):
    """Turn 1 answers with text and a function call; turn 2 names it as `previous_response_id` and sends only the
    call's output: the prompt equals sending the whole conversation (turn 1's input and output items, then the
    output) without the first turn's instructions, as OpenAI's API does; turn 3 continues turn 2. The stored
    responses come back from GET (equal to what the POST answered), with their input items; DELETE drops one."""
    backend = Scripted(tok.encode(CALL_TEXT + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))
    question = {"type": "message", "role": "user", "content": "What is in src/a.py?"}
    base = {"model": NAME, "tools": RESPONSE_TOOLS, "stream": stream}

    def post(**fields) -> dict:
        r = client.post("/v1/responses", json={**base, **fields})
        assert r.status_code == 200, r.text
        return streamed(sequenced(r))[1] if stream else r.json()

    first = post(input=[question], instructions="Be terse.")
    assert first["store"] is True and first["previous_response_id"] is None
    call = first["output"][1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "print('hi')"}
    second = post(input=[output], previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    whole = post(input=[question, *first["output"], output], store=False)
    assert backend.prompts[1] == backend.prompts[2]  # continued == sent whole (no earlier instructions)
    third = post(input="Thanks.", previous_response_id=second["id"], instructions="Be brief.")
    sent = post(input=[question, *first["output"], output, *second["output"],
                       {"type": "message", "role": "user", "content": "Thanks."}], instructions="Be brief.")
    assert backend.prompts[3] == backend.prompts[4]
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    assert client.get(f"/v1/responses/{third['id']}").json() == third
    items = client.get(f"/v1/responses/{second['id']}/input_items").json()
    assert items["object"] == "list" and items["data"] == [question, *first["output"], output]
    assert client.get(f"/v1/responses/{whole['id']}").status_code == 404  # store: false
    r = client.post("/v1/responses", json={**base, "input": "x", "previous_response_id": whole["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response",
                                                                     "deleted": True}
    r = client.get(f"/v1/responses/{first['id']}")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert client.delete(f"/v1/responses/{first['id']}").status_code == 404
    assert client.get(f"/v1/responses/{sent['id']}").status_code == 200


def test_stored_responses_keep_the_last_ones(tok):
    """`stored_responses=2`: a third stored response drops the least recently used (continuing a conversation
    uses each of its turns); 0 keeps none."""
    backend = Scripted(tok.encode("Hi." + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096, stored_responses=2))
    ids = [client.post("/v1/responses", json={"model": NAME, "input": f"q{k}"}).json()["id"] for k in range(2)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 200  # used: the second is now the oldest
    ids.append(client.post("/v1/responses", json={"model": NAME, "input": "q2"}).json()["id"])
    assert [client.get(f"/v1/responses/{i}").status_code for i in ids] == [200, 404, 200]
    # each turn is kept once and a conversation is its chain of turns: one longer than the store breaks
    r1 = client.post("/v1/responses", json={"model": NAME, "input": "a"}).json()["id"]
    r2 = client.post("/v1/responses", json={"model": NAME, "input": "b", "previous_response_id": r1}).json()["id"]
    r3 = client.post("/v1/responses", json={"model": NAME, "input": "c", "previous_response_id": r2}).json()["id"]
    r = client.post("/v1/responses", json={"model": NAME, "input": "d", "previous_response_id": r3})
    assert r.status_code == 400 and "earlier turn" in r.json()["error"]["message"]  # r1 made room for r3
    assert client.get(f"/v1/responses/{r3}").status_code == 200
    none = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096, stored_responses=0))
    rid = none.post("/v1/responses", json={"model": NAME, "input": "q"}).json()["id"]
    assert none.get(f"/v1/responses/{rid}").status_code == 404
    with pytest.raises(ValueError, match="stored_responses"):
        create_app(backend, tok, model_name=NAME, max_total_tokens=4096, stored_responses=-1)


def test_stored_responses_survive_a_restart_with_a_directory(tok, tmp_path):
    """`responses_dir`: a conversation stored by one server is continued by the next one over the same directory
    (the same prompt as sending it whole); a deleted or evicted response's file goes; a half-written temporary
    file (removed) and a corrupt file left by a crash are skipped."""
    backend = Scripted(tok.encode("Hi." + EOS), tok.vocab_size)

    def server(**kw):
        return TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096,
                                     responses_dir=str(tmp_path), **kw))

    first = server()
    r1 = first.post("/v1/responses", json={"model": NAME, "input": "a"}).json()
    gone = first.post("/v1/responses", json={"model": NAME, "input": "x"}).json()["id"]
    assert first.delete(f"/v1/responses/{gone}").status_code == 200
    assert sorted(p.name for p in tmp_path.iterdir()) == [r1["id"] + ".json"]
    cut_short = tmp_path / f"{r1['id']}.json.{dead_pid()}.140234.tmp"  # a write a crash cut short
    cut_short.write_text('{"items": [')
    (tmp_path / "resp_0123456789abcdef0123456789abcdef.json").write_text("{not json")

    second = server()
    assert not cut_short.exists()  # removed at start
    assert second.get(f"/v1/responses/{r1['id']}").json() == r1
    second.post("/v1/responses", json={"model": NAME, "input": "b", "previous_response_id": r1["id"]})
    whole = [{"type": "message", "role": "user", "content": "a"}] + r1["output"] + \
        [{"type": "message", "role": "user", "content": "b"}]
    second.post("/v1/responses", json={"model": NAME, "input": whole, "store": False})
    assert backend.prompts[-2] == backend.prompts[-1]  # continued after the restart == sent whole

    stored = {p.name for p in tmp_path.glob("resp_*.json")} - {"resp_0123456789abcdef0123456789abcdef.json"}
    assert len(stored) == 2
    small = server(stored_responses=1)  # starts with the most recently used one (the older one's file goes)
    assert len({p.name for p in tmp_path.glob("resp_*.json")} - {"resp_0123456789abcdef0123456789abcdef.json"}) == 1
    newest = small.post("/v1/responses", json={"model": NAME, "input": "c"}).json()["id"]
    assert {p.name for p in tmp_path.glob("resp_*.json")} - {"resp_0123456789abcdef0123456789abcdef.json"} == \
        {newest + ".json"}


def test_a_failing_backend_reports_in_the_stream(tok):
    def broken(prompt, **_):
        raise RuntimeError("out of memory")

    client = TestClient(create_app(broken, tok, model_name=NAME, max_total_tokens=64), raise_server_exceptions=False)
    req = {"model": NAME, "input": "x"}
    r = client.post("/v1/responses", json=req)
    assert r.status_code == 500 and "out of memory" in r.json()["error"]["message"]
    chunks = sequenced(client.post("/v1/responses", json={**req, "stream": True}))  # (and stored: odd_requests)
    assert chunks[-1]["type"] == "response.failed" and "out of memory" in chunks[-1]["response"]["error"]["message"]


def test_truncation_auto_drops_the_earliest_turns_to_fit(client, tok):
    """A conversation over the 96-token limit: `truncation: disabled` (the default) is a 400; `auto` answers from
    the earliest user turn (after the leading system item) from which the rendered prompt and max_output_tokens
    fit, found here by trying each turn in order, and gives the chat endpoint's answer to those turns."""
    from openm3.data.chat import render_chat

    system = {"type": "message", "role": "system", "content": "Be brief."}
    turns = []
    for k in range(6):
        turns += [{"type": "message", "role": "user", "content": f"Question {k}: tell me about the number {k}."},
                  {"type": "message", "role": "assistant", "content": f"The number {k} is a number."}]
    items = [system] + turns + [{"type": "message", "role": "user", "content": "And the last one?"}]
    body = {"model": NAME, "input": items, "max_output_tokens": 6, "temperature": 0}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"

    def messages(kept):
        return [{"role": i["role"], "content": i["content"]} for i in kept]

    users = [i for i, item in enumerate(items) if item["role"] == "user"]
    start = next(i for i in users if len(tok.encode(render_chat(messages([system] + items[i:]),
                                                                add_generation_prompt=True))) + 6 <= 96)
    assert start > users[0]  # something was dropped
    want = client.post("/v1/chat/completions", json={"model": NAME, "messages": messages([system] + items[start:]),
                                                     "max_tokens": 6, "temperature": 0}).json()
    r = client.post("/v1/responses", json={**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto" and out["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert out["output"][-1]["content"][0]["text"] == want["choices"][0]["message"]["content"]
    alone = client.post("/v1/responses", json={**body, "input": [system, {"type": "message", "role": "user",
                                                                           "content": "word " * 200}],
                                               "truncation": "auto"})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "input"  # the last turn alone is too long
