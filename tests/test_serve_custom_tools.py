"""OpenAI's custom tools (Responses API and Chat Completions): free-form text inputs (Codex's `apply_patch` among
them), shown to the model as a function with one string parameter and returned as `custom_tool_call` items (custom
`tool_calls`) holding the text as written; sent back, they render the prompt the equivalent function call renders;
a forced call follows the tool's grammar (Lark or regex), also inside M3's tool-call markup
(`openm3.engine.tool_grammar`)."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from openm3.data.tokenizer import EOS
from openm3.engine.tool_grammar import END, START, ToolCallGrammar
from openm3.serve import ModelBackend, create_app
from openm3.serve.responses import ResponsesRequest, _output_spec

from test_serve import NAME, Scripted, named_events, tiny_model, tok  # noqa: F401 - the fixture

PATCH_GRAMMAR = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
"""  # Codex's apply_patch grammar (its `format.definition`), as agents send it
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
PATCH = "*** Begin Patch\n*** Update File: src/a.py\n@@ def f():\n-    if a<b: return 1\n+    return 2\n*** End Patch\n"


def patching(tok) -> tuple[Scripted, TestClient]:
    """A scripted backend that answers with text and an apply_patch call, and a client over it."""
    backend = Scripted(tok.encode("Patching." + markup("apply_patch", PATCH) + EOS), tok.vocab_size)
    return backend, TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))


def markup(name: str, value: str) -> str:
    return (f'<minimax:tool_call>\n<invoke name="{name}">\n<parameter name="input">{value}</parameter>\n</invoke>\n'
            f'</minimax:tool_call>')


def test_the_patch_grammar_inside_the_call_markup():
    tool = {"name": "apply_patch", "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
            "text_grammar": {"parameter": "input", "syntax": "lark", "definition": PATCH_GRAMMAR}}
    grammar = ToolCallGrammar([tool], "apply_patch")
    head = START + b'\n<invoke name="apply_patch">\n<parameter name="input">'
    tail = b"</parameter>\n</invoke>\n" + END
    whole = grammar.advance(grammar.start, head + PATCH.encode() + tail)
    assert whole is not None and grammar.complete(whole)
    # a value the grammar does not derive cannot be closed; one it does not begin cannot be written at all
    assert grammar.advance(grammar.start, head + PATCH.encode()[:-15] + tail) is None
    assert grammar.advance(grammar.start, head + b"hello") is None
    # `<` inside the text is text until `</parameter>` is whole; a token may end inside a character the grammar
    # takes there
    assert grammar.advance(grammar.start, head + b"*** Begin Patch\n*** Add File: a</p") is not None
    assert grammar.advance(grammar.start, head + "*** Begin Patch\n*** Add File: é".encode()[:-1]) is not None
    regex = ToolCallGrammar([{**tool, "text_grammar": {"parameter": "input", "syntax": "regex",
                                                       "definition": r"\d+(<\d+)?"}}], "apply_patch")
    for value, ok in ((b"12", True), (b"12<3", True), (b"12<", False), (b"x", False)):
        assert (regex.advance(regex.start, head + value + tail) is not None) is ok, value
    with pytest.raises(ValueError, match="not among its parameters"):
        ToolCallGrammar([{**tool, "text_grammar": {"parameter": "patch", "syntax": "lark", "definition": "x"}}])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_custom_tool_call_comes_back_as_written_and_renders_back_like_a_function_call(tok, stream):
    """The input text is kept as written (a number stays text, `<` and newlines too); sent back with its output, the
    conversation renders as the same call made through a function tool with an `input` string parameter."""
    backend, client = patching(tok)
    question = {"role": "user", "content": "Fix f."}
    req = {"model": NAME, "input": [question], "tools": [APPLY_PATCH], "stream": stream}
    r = client.post("/v1/responses", json=req)
    if stream:
        events = named_events(r)
        body = events[-1]["response"]
        deltas = [e for e in events if e["type"] == "response.custom_tool_call_input.delta"]
        done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert "".join(d["delta"] for d in deltas) == done[0]["input"] == PATCH
        assert added[-1]["type"] == "custom_tool_call" and added[-1]["input"] == ""
        assert not [e for e in events if e["type"].startswith("response.function_call")]
    else:
        body = r.json()
    assert [item["type"] for item in body["output"]] == ["message", "custom_tool_call"]
    call = body["output"][1]
    assert call["name"] == "apply_patch" and call["input"] == PATCH and call["call_id"].startswith("call_")
    assert body["tools"] == [APPLY_PATCH]
    prompt = tok.decode(backend.prompts[0])
    assert '"name": "apply_patch"' in prompt and "Free-form text input" in prompt and "begin_patch" in prompt

    follow = [question, body["output"][0], call,
              {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done."}]
    assert client.post("/v1/responses", json={**req, "input": follow, "stream": False}).status_code == 200
    as_function = [question, body["output"][0],
                   {"type": "function_call", "call_id": call["call_id"], "name": "apply_patch",
                    "arguments": json.dumps({"input": PATCH})},
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "Done."}]
    assert client.post("/v1/responses", json={**req, "input": as_function, "stream": False}).status_code == 200
    assert backend.prompts[1] == backend.prompts[2]

    number = Scripted(tok.encode(markup("apply_patch", "42") + EOS), tok.vocab_size)
    body = TestClient(create_app(number, tok, model_name=NAME, max_total_tokens=4096)).post(
        "/v1/responses", json={**req, "stream": False}).json()
    assert body["output"][-1]["input"] == "42"  # a function's argument would have become the number 42


CHAT_PATCH = {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files with a patch.", "format": {
    "type": "grammar", "grammar": {"syntax": "lark", "definition": PATCH_GRAMMAR}}}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_completions_custom_tool_calls_and_their_round_trip(tok, stream):
    """Chat Completions' form: the call comes back as `{"type": "custom", "custom": {"name", "input"}}`, and an
    assistant message holding one renders the prompt the Responses API's custom_tool_call item renders."""
    backend, client = patching(tok)
    question = {"role": "user", "content": "Fix f."}
    req = {"model": NAME, "messages": [question], "tools": [CHAT_PATCH], "stream": stream}
    r = client.post("/v1/chat/completions", json=req)
    if stream:
        chunks = [json.loads(b[len("data: "):]) for b in r.text.split("\n\n") if b.startswith("data: {")]
        calls = [c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls", [])]
        finish = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]][-1]
        text = "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])
    else:
        choice = r.json()["choices"][0]
        calls, finish, text = choice["message"]["tool_calls"], choice["finish_reason"], choice["message"]["content"]
    assert finish == "tool_calls" and text == "Patching." and len(calls) == 1
    call = calls[0]
    assert call["type"] == "custom" and call["custom"] == {"name": "apply_patch", "input": PATCH}
    follow = [question, {"role": "assistant", "content": "Patching.", "tool_calls": [
        {k: v for k, v in call.items() if k != "index"}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Done."}]
    assert client.post("/v1/chat/completions", json={**req, "messages": follow, "stream": False}).status_code == 200
    counted = client.post("/tokenize", json={"messages": follow, "tools": [CHAT_PATCH]}).json()
    assert counted["tokens"] == backend.prompts[1]
    items = [question, {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                              "text": "Patching."}]},
             {"type": "custom_tool_call", "call_id": call["id"], "name": "apply_patch", "input": PATCH},
             {"type": "custom_tool_call_output", "call_id": call["id"], "output": "Done."}]
    flat = {"type": "custom", **CHAT_PATCH["custom"], "format": {"type": "grammar", **CHAT_PATCH["custom"]["format"][
        "grammar"]}}
    assert client.post("/v1/responses", json={"model": NAME, "input": items, "tools": [flat]}).status_code == 200
    assert backend.prompts[1] == backend.prompts[2]
    bad = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "custom"}]}
    r = client.post("/v1/chat/completions", json={**req, "messages": [question, bad], "stream": False})
    assert r.status_code == 400 and "needs its 'custom' object" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def model_client(tok):
    return TestClient(create_app(ModelBackend(tiny_model(tok, 2048)), tok, model_name=NAME, max_total_tokens=2048,
                                 reasoning_parser="none"))


@pytest.mark.parametrize("syntax, definition, pattern", [
    ("regex", r"[0-9]{3}-[a-z]{2}", r"[0-9]{3}-[a-z]{2}"),
    ("lark", 'start: COLOR ("," COLOR)~0..2\nCOLOR: "red" | "green" | "blue"',
     r"(red|green|blue)(,(red|green|blue)){0,2}")])
def test_a_forced_custom_call_follows_its_grammar(model_client, syntax, definition, pattern):
    """A random model forced to call a custom tool writes an input its grammar derives, whatever it would sample
    (Responses and Chat Completions)."""
    tool = {"type": "custom", "name": "emit", "format": {"type": "grammar", "syntax": syntax,
                                                         "definition": definition}}
    chat_tool = {"type": "custom", "custom": {"name": "emit", "format": {"type": "grammar", "grammar": {
        "syntax": syntax, "definition": definition}}}}
    for seed in range(3):
        body = model_client.post("/v1/responses", json={
            "model": NAME, "input": "Call it.", "tools": [tool], "tool_choice": {"type": "custom", "name": "emit"},
            "max_output_tokens": 120, "seed": seed}).json()
        calls = [item for item in body["output"] if item["type"] == "custom_tool_call"]
        assert body["status"] == "completed" and len(calls) == 1, body
        assert re.fullmatch(pattern, calls[0]["input"]), calls[0]["input"]
        choice = model_client.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "Call it."}], "tools": [chat_tool],
            "tool_choice": {"type": "custom", "custom": {"name": "emit"}}, "max_tokens": 120,
            "seed": seed}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert re.fullmatch(pattern, choice["message"]["tool_calls"][0]["custom"]["input"])


@pytest.mark.parametrize("tool, where", [
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
     "tools[0].format"),
    ({"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}},
     "tools[0].format"),
    ({"type": "custom", "name": ""}, "tools[0].name"),
    ({"type": "web_search"}, "tools[0]")])
def test_bad_custom_tools_are_400s_naming_the_entry(tok, tool, where):
    client = TestClient(create_app(Scripted(tok.encode("ok" + EOS), tok.vocab_size), tok, model_name=NAME,
                                   max_total_tokens=4096))
    r = client.post("/v1/responses", json={"model": NAME, "input": "x", "tools": [tool]})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert where in message and "Value error" not in message, message


def test_a_codex_shaped_turn_and_its_follow_up(tok):
    """The body an agent like Codex sends to the Responses API (a strict function, a custom apply_patch with its
    Lark grammar, reasoning settings, store false, encrypted reasoning asked for, a prompt cache key, verbosity),
    streamed; then the next turn with everything sent back: reasoning, message, custom call and output, function
    call and output."""
    backend, client = patching(tok)
    shell = {"type": "function", "name": "shell", "description": "Runs a command.", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {
                 "type": "string"}}, "workdir": {"type": "string"}}, "required": ["command"],
                 "additionalProperties": False}}
    body = {"model": NAME, "instructions": "You are a coding agent.", "tools": [shell, APPLY_PATCH],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
            "text": {"verbosity": "medium"},
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix f."}]}]}
    events = named_events(client.post("/v1/responses", json=body))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["store"] is False
    call = final["output"][-1]
    assert call["type"] == "custom_tool_call" and call["input"] == PATCH
    assert client.get(f"/v1/responses/{final['id']}").status_code == 404  # store: false
    follow = body["input"] + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}],
         "encrypted_content": None},
        {**final["output"][0]}, {**call},
        {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done!"},
        {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": '{"command": ["pytest"]}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "1 passed"}]
    events = named_events(client.post("/v1/responses", json={**body, "input": follow}))
    assert events[-1]["type"] == "response.completed"
    prompt = tok.decode(backend.prompts[-1])
    for text in ("Look.", "*** Begin Patch", "Done!", "pytest", "1 passed"):
        assert text in prompt, text


def test_constrain_tool_calls_makes_every_unforced_call_well_formed(tok):
    """`constrain_tool_calls` (`openm3 serve --constrain-tool-calls`): under tool_choice auto, a random model pushed
    to open tool-call blocks (a logit bias on the block's start token) writes well-formed calls whose custom input
    follows its grammar; without it the same request writes none that parse."""
    from openm3.data.tokenizer import TOOL_CALL_START

    tool = {"type": "custom", "custom": {"name": "emit", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "[0-9]{3}"}}}}
    start = tok.special_ids[TOOL_CALL_START]
    body = {"model": NAME, "messages": [{"role": "user", "content": "Call it."}], "tools": [tool], "max_tokens": 160,
            "logit_bias": {str(start): 100}, "reasoning_effort": "none"}
    found = {}
    for on in (True, False):
        client = TestClient(create_app(ModelBackend(tiny_model(tok, 2048)), tok, model_name=NAME,
                                       max_total_tokens=2048, constrain_tool_calls=on))
        found[on] = [client.post("/v1/chat/completions", json={**body, "seed": seed}).json()["choices"][0]
                     for seed in range(2)]
    for choice in found[True]:
        calls = choice["message"].get("tool_calls") or []
        assert calls and all(re.fullmatch("[0-9]{3}", c["custom"]["input"]) for c in calls), choice
    assert not any(choice["message"].get("tool_calls") for choice in found[False])


def test_allowed_tools_keep_calls_to_the_allowed_ones(tok):
    """OpenAI's `allowed_tools` choice (both APIs): every tool stays in the prompt, and the model calls only the
    allowed ones; "auto" needs no --constrain-tool-calls (only the grammar can keep the restriction), "required"
    forces a call among them. A random model pushed to open tool-call blocks, allowed only `emit` of two tools."""
    from openm3.data.tokenizer import TOOL_CALL_START

    def tool(name, pattern):
        return {"name": name, "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": pattern}}}

    chat_tools = [{"type": "custom", "custom": tool("emit", "[0-9]{3}")},
                  {"type": "custom", "custom": tool("other", "[a-z]{3}")}]
    flat_tools = [{"type": "custom", **tool("emit", "[0-9]{3}")}, {"type": "custom", **tool("other", "[a-z]{3}")}]
    start = tok.special_ids[TOOL_CALL_START]
    client = TestClient(create_app(ModelBackend(tiny_model(tok, 2048)), tok, model_name=NAME, max_total_tokens=2048))
    for mode, bias in (("auto", {str(start): 100}), ("required", {})):
        chat_choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "custom", "custom": {"name": "emit"}}]}}
        for seed in range(2):
            r = client.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "Call it."}], "tools": chat_tools,
                "tool_choice": chat_choice, "max_tokens": 160, "logit_bias": bias, "reasoning_effort": "none",
                "seed": seed})
            assert r.status_code == 200, r.text
            calls = r.json()["choices"][0]["message"].get("tool_calls") or []
            assert calls and all(c["custom"]["name"] == "emit" and re.fullmatch("[0-9]{3}", c["custom"]["input"])
                                 for c in calls), calls
            flat_choice = {"type": "allowed_tools", "mode": mode, "tools": [{"type": "custom", "name": "emit"}]}
            req = ResponsesRequest(model=NAME, input="x", tools=flat_tools, tool_choice=flat_choice)
            spec = _output_spec(req)  # the Responses API has no logit_bias to push the model into a call
            assert [t["name"] for t in json.loads(spec.tools)] == ["emit"] and spec.triggered == (mode == "auto")
            if mode == "auto":
                continue
            r = client.post("/v1/responses", json={
                "model": NAME, "input": "Call it.", "tools": flat_tools, "max_output_tokens": 160, "seed": seed,
                "tool_choice": flat_choice, "reasoning": {"effort": "none"}})
            assert r.status_code == 200, r.text
            items = [i for i in r.json()["output"] if i["type"] == "custom_tool_call"]
            assert items and all(i["name"] == "emit" and re.fullmatch("[0-9]{3}", i["input"]) for i in items), items
    ask = [{"role": "user", "content": "x"}]
    chat_bad = [{"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]},
                {"mode": "any", "tools": []}]
    flat_bad = [{"mode": "auto", "tools": "emit"}, {"mode": "required", "tools": [{"type": "custom", "name": "nope"}]}]
    bad = [("/v1/chat/completions", {"messages": ask, "tools": chat_tools,
                                     "tool_choice": {"type": "allowed_tools", "allowed_tools": c}}) for c in chat_bad]
    bad += [("/v1/responses", {"input": "x", "tools": flat_tools, "tool_choice": {"type": "allowed_tools", **c}})
            for c in flat_bad]
    for path, body in bad:
        r = client.post(path, json={"model": NAME, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
