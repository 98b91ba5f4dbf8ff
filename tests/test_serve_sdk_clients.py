"""`openm3 serve` through the official `openai` and `anthropic` Python SDKs (the clients coding agents are built
on), in process: the SDKs' own parsing, stream accumulators and error classes read the server's bodies and events
(a random m3-tiny model; forced tool calls and a pydantic schema keep the structured answers checkable)."""

import json
import re
from typing import Literal

import anthropic  # the `test` extra pins both SDKs
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel

from openm3.data.tokenizer import TokenizerSettings, get_tokenizer
from openm3.models import M3TextConfig, M3TextModel
from openm3.serve import ModelBackend, create_app

NAME = "tiny"
CITIES = ["Paris", "Rome"]
SCHEMA = {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"]}
USER = [{"role": "user", "content": "hi"}]


class City(BaseModel):
    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    tok = get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000),
                        tmp_path_factory.mktemp("tok-cache"))
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", vocab_size=tok.vocab_size, num_hidden_layers=2,
                                    layer_types=["full_attention", "minimax_m3_sparse"],
                                    mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                    max_position_embeddings=1024)
    app = create_app(ModelBackend(M3TextModel(config).eval()), tok, model_name=NAME, max_total_tokens=640)
    with TestClient(app) as client:
        yield client


@pytest.fixture(scope="module")
def oai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def claude(http):
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)


def test_models_listed_and_retrieved_in_each_dialect(oai, claude):
    assert [m.id for m in oai.models.list()] == [NAME]
    card = oai.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.owned_by == "openm3"
    info = claude.models.retrieve(NAME)
    assert [m.id for m in claude.models.list()] == [NAME] and info.id == NAME and info.type == "model"
    assert info.max_input_tokens == info.max_tokens == 639  # max_total_tokens 640 leaves room for one new token
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.models.retrieve("no-such-model")
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        claude.models.retrieve("no-such-model")


def test_openai_models_and_a_seeded_chat_three_ways(oai):
    """A seeded request answers the same text plainly, as raw chunks (usage in the last) and through the SDK's
    stream helper."""
    assert [m.id for m in oai.models.list()] == [NAME]
    args = dict(model=NAME, messages=USER, max_tokens=8, seed=3)
    r = oai.chat.completions.create(**args)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    chunks = list(oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.completion_tokens == 8
    with oai.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot
    assert snapshot.choices[0].message.content == choice.message.content
    assert snapshot.choices[0].finish_reason == "length"


def test_openai_forced_tool_call_parses_and_goes_back_in(oai):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": SCHEMA}}]
    args = dict(model=NAME, max_tokens=200, tools=tools, reasoning_effort="none",
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = oai.chat.completions.create(messages=[{"role": "user", "content": "weather?"}], **args)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in CITIES
    history = [{"role": "user", "content": "weather?"}, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = oai.chat.completions.create(model=NAME, messages=history, tools=tools, max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + 4  # the call and its result are in the prompt


def test_openai_parse_fills_the_pydantic_model(oai):
    r = oai.chat.completions.parse(model=NAME, messages=USER, max_tokens=200, response_format=City,
                                   reasoning_effort="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.parsed.city in CITIES


def test_openai_responses_plain_and_streamed(oai):
    greedy = dict(model=NAME, input="hi", max_output_tokens=8, temperature=0)  # greedy: no stop within 8 tokens
    r = oai.responses.create(**greedy)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and isinstance(r.output_text, str)
    with oai.responses.stream(**greedy) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text == r.output_text and events[-1].response.usage.output_tokens == 8
    assert [e.sequence_number for e in events] == sorted({e.sequence_number for e in events})


def test_openai_responses_function_call_streamed_then_answered(oai):
    """A forced single call through the Responses stream helper, its output sent back by `previous_response_id`;
    `responses.parse` fills the pydantic model."""
    tools = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": SCHEMA}]
    args = dict(model=NAME, tools=tools, tool_choice="required", parallel_tool_calls=False,
                max_output_tokens=200, reasoning={"effort": "none"})
    with oai.responses.stream(input="weather?", **args) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_response()
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= kinds
    assert final.status == "completed" and [o.type for o in final.output] == ["function_call"]
    call = final.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in CITIES
    after = oai.responses.create(model=NAME, previous_response_id=final.id, tools=tools, max_output_tokens=4,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert after.usage.input_tokens > final.usage.input_tokens + 4  # the stored turn, the call and its output
    parsed = oai.responses.parse(model=NAME, input="hi", text_format=City, max_output_tokens=200,
                                 reasoning={"effort": "none"})
    assert parsed.output_parsed.city in CITIES


def test_openai_responses_input_token_count(oai):
    """`responses.input_tokens.count` is the prompt a create with the same body runs on, stored turns included."""
    first = oai.responses.create(model=NAME, input="hi", max_output_tokens=4, temperature=0)
    assert oai.responses.input_tokens.count(model=NAME, input="hi").input_tokens == first.usage.input_tokens
    follow = [{"role": "user", "content": "and then?"}]
    counted = oai.responses.input_tokens.count(model=NAME, input=follow, previous_response_id=first.id)
    second = oai.responses.create(model=NAME, input=follow, previous_response_id=first.id, max_output_tokens=4)
    assert counted.input_tokens == second.usage.input_tokens > first.usage.input_tokens + 4
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.responses.input_tokens.count(model="no-such-model", input="hi")


def test_openai_background_response_retrieved_and_cancelled(oai):
    """`background=True` comes back queued (or further); `retrieve` polls it to its end, `cancel` returns a
    finished one as it is, and a plain response's cancel is the SDK's BadRequestError; with `stream=True` too, and
    `retrieve(stream=True, starting_after=)` resumes its events."""
    import time

    first = oai.responses.create(model=NAME, input="hi", max_output_tokens=4, background=True, temperature=0)
    assert first.background is True and first.status in ("queued", "in_progress", "incomplete", "completed")
    deadline = time.monotonic() + 60
    while (done := oai.responses.retrieve(first.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    plain = oai.responses.create(model=NAME, input="hi", max_output_tokens=4, temperature=0)
    assert done.output_text == plain.output_text and done.status == plain.status
    assert oai.responses.cancel(first.id).status == done.status
    with pytest.raises(openai.BadRequestError, match="only background responses can be cancelled"):
        oai.responses.cancel(plain.id)
    # streamed: the SDK's event types, then the same events again from the server's log, resumed after the second
    events = list(oai.responses.create(model=NAME, input="hi", max_output_tokens=4, background=True, stream=True,
                                       temperature=0))
    assert events[0].type == "response.created" and events[-1].response.output_text == plain.output_text
    again = list(oai.responses.retrieve(events[0].response.id, stream=True, starting_after=1))
    assert [e.sequence_number for e in again] == [e.sequence_number for e in events[2:]]


def test_openai_custom_tools_forced_through_both_apis(oai):
    """A forced custom tool call with a regex grammar: the SDKs parse it into their custom-call types (Responses'
    `custom_tool_call`, Chat's custom `tool_calls`), the input follows the grammar, and the call goes back in."""
    fmt = {"type": "grammar", "syntax": "regex", "definition": "(Paris|Rome)-[0-9]{2}"}
    tool = {"type": "custom", "name": "book", "description": "Book a trip.", "format": fmt}
    r = oai.responses.create(model=NAME, input="Book it.", tools=[tool], tool_choice={"type": "custom", "name": "book"},
                             max_output_tokens=64, temperature=0, reasoning={"effort": "none"})  # no think block
    call = [item for item in r.output if item.type == "custom_tool_call"][0]
    assert call.name == "book" and re.fullmatch("(Paris|Rome)-[0-9]{2}", call.input)
    follow = oai.responses.create(model=NAME, tools=[tool], max_output_tokens=4, input=[
        {"role": "user", "content": "Book it."}, {"type": "custom_tool_call", "call_id": call.call_id, "name": "book",
                                                  "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "booked"}])
    assert follow.status in ("completed", "incomplete")
    chat_tool = {"type": "custom", "custom": {"name": "book", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": fmt["definition"]}}}}
    c = oai.chat.completions.create(model=NAME, messages=USER, tools=[chat_tool], max_tokens=64, temperature=0,
                                    tool_choice={"type": "custom", "custom": {"name": "book"}}, reasoning_effort="none")
    custom = c.choices[0].message.tool_calls[0]
    assert custom.type == "custom" and re.fullmatch("(Paris|Rome)-[0-9]{2}", custom.custom.input)


def test_a_pdf_through_each_sdk_counts_as_its_text(oai, claude):
    """A PDF sent the way each SDK types it (Chat `file` part, Responses `input_file`, Anthropic base64 document)
    feeds the model its text: the prompt is as long as the same text sent plainly."""
    from test_serve_documents import B64, DATA_URL, TEXT

    ask = {"type": "text", "text": "Summarise."}
    plain = [{"role": "user", "content": f"notes.pdf\n\n{TEXT}\n\nSummarise."}]
    chat = [{"role": "user", "content": [{"type": "file", "file": {"file_data": DATA_URL, "filename": "notes.pdf"}},
                                         ask]}]
    usage = [oai.chat.completions.create(model=NAME, messages=m, max_tokens=1).usage.prompt_tokens
             for m in (plain, chat)]
    assert usage[0] == usage[1]
    item = [{"role": "user", "content": [{"type": "input_file", "file_data": DATA_URL, "filename": "notes.pdf"},
                                         {"type": "input_text", "text": "Summarise."}]}]
    assert oai.responses.input_tokens.count(model=NAME, input=item).input_tokens == \
        oai.responses.input_tokens.count(model=NAME, input=plain).input_tokens
    doc = {"type": "document", "title": "notes.pdf",
           "source": {"type": "base64", "media_type": "application/pdf", "data": B64}}
    assert claude.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": [doc, ask]}]) \
        .input_tokens == claude.messages.count_tokens(model=NAME, messages=plain).input_tokens


def test_unknown_paths_answer_in_each_apis_error_form(http):
    r = http.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "POST /v1/embeddings: Not Found"
    r = http.get("/v1/files", headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"


def test_openai_sdk_raises_the_servers_errors(oai):
    with pytest.raises(openai.BadRequestError, match="maximum"):
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 800}], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=USER, max_tokens=4)


def test_anthropic_message_plain_and_streamed(claude):
    greedy = dict(model=NAME, max_tokens=8, messages=USER, extra_body={"temperature": 0})  # no stop within 8
    m = claude.messages.create(**greedy)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 8 and m.content[0].type == "text"
    assert claude.messages.count_tokens(model=NAME, messages=USER).input_tokens == m.usage.input_tokens
    with claude.messages.stream(**greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text == m.content[0].text


@pytest.mark.parametrize("thinking", [{"type": "disabled"}, {"type": "enabled", "budget_tokens": 24}],
                         ids=["no-thinking", "thinking"])
def test_anthropic_forced_tool_use_streamed(claude, thinking):
    """The SDK rebuilds the tool input from the streamed JSON deltas; with thinking on (a budget, so that a random
    model's block closes) a think block may come first."""
    tools = [{"name": "get_weather", "description": "weather", "input_schema": SCHEMA}]
    with claude.messages.stream(model=NAME, max_tokens=300, messages=USER, tools=tools, thinking=thinking,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    kinds = [b.type for b in final.content]
    assert kinds[-1] == "tool_use" and set(kinds[:-1]) <= ({"thinking"} if thinking["type"] == "enabled" else set())
    use = [b for b in final.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].input["city"] in CITIES


def test_anthropic_sdk_raises_the_servers_errors(claude):
    with pytest.raises(anthropic.BadRequestError, match="maximum"):
        claude.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": "word " * 800}])


@pytest.mark.parametrize("tool, why", [
    ({"type": "web_search"}, "OpenAI's servers run"), ({"type": "local_shell"}, "OpenAI's servers run"),
    ({"type": "image_generation"}, "OpenAI's servers run")])
def test_openai_tools_this_server_cannot_run_are_refused_with_why(oai, tool, why):
    with pytest.raises(openai.BadRequestError, match=why) as e:
        oai.responses.create(model=NAME, input="hi", tools=[tool], max_output_tokens=4)
    assert "Value error" not in str(e.value) and "function tools" in str(e.value)
    with pytest.raises(openai.BadRequestError, match=why):
        oai.chat.completions.create(model=NAME, messages=USER, max_tokens=4, tools=[tool])


@pytest.mark.parametrize("tool, why", [
    ({"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, "Anthropic's servers run"),
    ({"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}, "is not served")])
def test_anthropic_tools_this_server_cannot_run_are_refused_with_why(claude, tool, why):
    """A server tool is not shown to the model as a tool without a schema (whose calls no client would run)."""
    client_tool = {"name": "Bash", "description": "run", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match=why) as e:
        claude.messages.create(model=NAME, max_tokens=4, messages=USER, tools=[client_tool, tool])
    assert "tools[1]" in str(e.value) and "input_schema" in str(e.value)
    typed = {**client_tool, "type": "custom"}  # the explicit client-tool type is served
    assert claude.messages.create(model=NAME, max_tokens=4, messages=USER, tools=[typed]).type == "message"


def test_each_sdk_reads_the_request_id_of_its_answers(oai, claude):
    chat = oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat._request_id.startswith("req_")
    raw = oai.chat.completions.with_raw_response.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_headers={"X-Request-Id": "trace-42"})
    assert raw.request_id == "trace-42" and raw.parse().choices
    with oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                     stream=True) as stream:
        assert stream.response.headers["x-request-id"].startswith("req_")
        assert list(stream)
    message = claude.messages.with_raw_response.create(model=NAME, max_tokens=3,
                                                       messages=[{"role": "user", "content": "hi"}])
    assert message.request_id.startswith("req_") and message.parse().content is not None
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.request_id.startswith("req_")
