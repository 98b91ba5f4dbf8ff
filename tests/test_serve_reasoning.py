"""M3's think block split off the answers (`openm3/serve/reasoning.py`): the splitter against whole-text splits
for every way of cutting a text into deltas, and the three chat APIs (streamed and not) with a scripted backend
that writes a think block, a text and a tool call; reasoning a client sends back is rendered into the prompt."""

import json
import random

import pytest
from fastapi.testclient import TestClient

from openm3.data.chat import render_chat
from openm3.data.tokenizer import EOS, THINK_END, THINK_START
from openm3.serve import create_app
from openm3.serve.reasoning import ReasoningSplitter, split_reasoning
import test_serve
from test_serve import CALL_TEXT, NAME, TOOLS, Scripted, events, named_events

tok, model = test_serve.tok, test_serve.model  # module-scoped fixtures, shared

THOUGHT = "The user wants a file.\n\nRead it first."
TEXTS = [  # (text, started, reasoning, answer)
    (f"{THINK_START}\n{THOUGHT}\n{THINK_END}\n\nHere it is.", False, THOUGHT, "Here it is."),
    (f"  {THINK_START}\n{THOUGHT}\n{THINK_END}\n\n", False, THOUGHT, ""),
    (f"{THINK_START}\nunfinished thought\n", False, "unfinished thought", ""),
    (f"{THINK_START}\n\n{THINK_END}\n\nok", False, "", "ok"),
    ("No thinking here.\n", False, None, "No thinking here.\n"),
    (f"\n{THOUGHT}\n{THINK_END}\n\nDone.", True, THOUGHT, "Done."),
    (f"a {THINK_START} b", False, None, f"a {THINK_START} b"),
]


@pytest.mark.parametrize("text,started,reasoning,answer", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_streamed_pieces_add_up_to_the_whole_split(text, started, reasoning, answer):
    assert split_reasoning(text, started) == (reasoning, answer)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        splitter = ReasoningSplitter(started)
        pieces, starts = [], []
        for d in deltas:
            new = splitter.feed(d)
            pieces += new
            starts.append(splitter.content_start)
            assert starts[-1] is not None or all(k == "reasoning" for k, _ in new)  # known once content flows
        pieces += splitter.finish()
        got = {kind: "".join(t for k, t in pieces if k == kind) for kind in ("reasoning", "content")}
        assert got["reasoning"] == (reasoning or "") and got["content"] == answer, deltas
        assert all(t for _k, t in pieces)  # no empty pieces
        # the answer's offset, once known, is the whole split's
        known = [s for s in starts if s is not None] + [splitter.content_start]
        assert set(known) == {len(text) - len(answer)}, (deltas, starts)


ANSWER = f"{THINK_START}\n{THOUGHT}\n{THINK_END}\n\n{CALL_TEXT}"


def _client(backend, tokenizer, **kw):
    return TestClient(create_app(backend, tokenizer, model_name=NAME, max_total_tokens=4096, **kw))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_completions_reasoning_content(tok, stream):
    backend = Scripted(tok.encode(ANSWER + EOS), tok.vocab_size)
    req = {"model": NAME, "messages": [{"role": "user", "content": "Show src/a.py"}], "tools": TOOLS,
           "stream": stream}
    r = _client(backend, tok).post("/v1/chat/completions", json=req)
    if stream:
        deltas = [c["choices"][0]["delta"] for c in events(r) if c["choices"]]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
    else:
        message = r.json()["choices"][0]["message"]
        reasoning, content, calls = message["reasoning_content"], message["content"], message["tool_calls"]
    assert reasoning == THOUGHT and content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"path": "src/a.py", "lines": 20}]
    plain = _client(backend, tok, reasoning_parser="none").post("/v1/chat/completions", json={**req, "stream": False})
    assert plain.json()["choices"][0]["message"]["content"].startswith(THINK_START)  # left in the text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_messages_thinking_block(tok, stream):
    backend = Scripted(tok.encode(f"{THINK_START}\n{THOUGHT}\n{THINK_END}\n\nHello there." + EOS), tok.vocab_size)
    req = {"model": NAME, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], "stream": stream}
    r = _client(backend, tok).post("/v1/messages", json=req)
    if stream:
        chunks = named_events(r)
        starts = [c for c in chunks if c["type"] == "content_block_start"]
        assert [(c["index"], c["content_block"]["type"]) for c in starts] == [(0, "thinking"), (1, "text")]
        stops = [c["index"] for c in chunks if c["type"] == "content_block_stop"]
        assert stops == [0, 1]
        deltas = [c for c in chunks if c["type"] == "content_block_delta"]
        thinking = "".join(c["delta"]["thinking"] for c in deltas if c["delta"]["type"] == "thinking_delta")
        text = "".join(c["delta"]["text"] for c in deltas if c["delta"]["type"] == "text_delta")
        assert {c["index"] for c in deltas if c["delta"]["type"] == "thinking_delta"} == {0}
    else:
        content = r.json()["content"]
        assert [b["type"] for b in content] == ["thinking", "text"]
        thinking, text = content[0]["thinking"], content[1]["text"]
        assert content[0]["signature"] == ""
    assert thinking == THOUGHT and text == "Hello there."


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_responses_reasoning_item(tok, stream):
    backend = Scripted(tok.encode(ANSWER + EOS), tok.vocab_size)
    req = {"model": NAME, "input": "Show src/a.py", "stream": stream,
           "tools": [{"type": "function", **{k: v for k, v in TOOLS[0]["function"].items()}}]}
    r = _client(backend, tok).post("/v1/responses", json=req)
    if stream:
        chunks = named_events(r)
        added = [(c["output_index"], c["item"]["type"]) for c in chunks if c["type"] == "response.output_item.added"]
        assert added == [(0, "reasoning"), (1, "message"), (2, "function_call")]
        thought = "".join(c["delta"] for c in chunks if c["type"] == "response.reasoning_text.delta")
        assert thought == THOUGHT
        done = [c["item"]["type"] for c in chunks if c["type"] == "response.output_item.done"]
        assert done == ["reasoning", "message", "function_call"]
        output = chunks[-1]["response"]["output"]
    else:
        output = r.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert output[1]["content"][0]["text"] == "Let me look."


def test_reasoning_sent_back_is_rendered_into_the_prompt(tok):
    """A turn's reasoning comes back in each API's own form; all three render the prompt that `render_chat` writes
    for the OpenAI-style conversation with `reasoning_content`."""
    backend = Scripted(tok.encode("ok" + EOS), tok.vocab_size)
    client = _client(backend, tok)
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
    want = render_chat([{"role": "user", "content": "Show a.py"},
                        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"}], TOOLS,
                       add_generation_prompt=True)
    client.post("/v1/chat/completions", json={"model": NAME, "tools": TOOLS, "messages": [
        {"role": "user", "content": "Show a.py"},
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
            {**call, "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x = 1"}]})
    client.post("/v1/messages", json={"model": NAME, "max_tokens": 8, "tools": [
        {"name": "read_file", "description": "Read a file.", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "messages": [
        {"role": "user", "content": "Show a.py"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                          {"type": "tool_use", "id": "call_1", "name": "read_file",
                                           "input": {"path": "a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "x = 1"}]}]})
    client.post("/v1/responses", json={"model": NAME, "tools": [{"type": "function", **TOOLS[0]["function"]}],
                                       "input": [
        {"role": "user", "content": "Show a.py"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": json.dumps({"path": "a.py"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "x = 1"}]})
    assert len(backend.prompts) == 3
    for prompt in backend.prompts:
        assert tok.decode(prompt) == want


def test_a_template_that_opens_the_think_block_starts_the_answer_inside_it(tok):
    """A checkpoint's template may end its generation prompt with `<think>\\n` (the model then writes only the
    block's rest): the answer is split as if it had opened the block itself."""
    from openm3.data.chat_template import ChatTemplate

    template = ChatTemplate("{% for m in messages %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endfor %}"
                            "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}")
    backend = Scripted(tok.encode(f"{THOUGHT}\n{THINK_END}\n\nHello." + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096, chat_template=template))
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}]})
    message = r.json()["choices"][0]["message"]
    assert tok.decode(backend.prompts[0]).endswith(f"ai\n{THINK_START}\n")
    assert message["reasoning_content"] == THOUGHT and message["content"] == "Hello."


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_thinking_budget_closes_the_think_block(tok, model, stream):
    """Anthropic's `thinking` over the real engine, with a template that opens the think block (the random model
    then thinks from its first token): enabled with budget_tokens 5, the answer is plain greedy decoding's first 5
    tokens, then the end token, then greedy decoding with the start token masked, split into a thinking block of
    those 5 tokens' text and a text block; disabled, the block is closed at once; enabled without a budget, a 400."""
    from openm3.data.chat_template import ChatTemplate
    from openm3.engine import generate
    from openm3.engine.penalties import Penalties, PenalizedPicker
    from openm3.serve import ModelBackend

    template = ChatTemplate("{% for m in messages %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endfor %}"
                            "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}")
    client = _client(ModelBackend(model), tok, chat_template=template)
    prompt = tok.encode(template([{"role": "user", "content": "Hi"}], None, add_generation_prompt=True))
    start, end, eos = tok.token_id(THINK_START), tok.token_id(THINK_END), tok.token_id(EOS)

    def expected(thought: int) -> tuple[str, str]:
        """(thinking, text): `thought` plain greedy tokens, the end token, then greedy with the start masked."""
        plain = generate(model, [prompt], max_new_tokens=thought)[0][0].tokens if thought else []
        after = generate(model, [prompt + plain + [end]], max_new_tokens=11 - thought, stop_tokens=[eos],
                         constraints=[PenalizedPicker(Penalties(bad_words=((start,),)), [], [eos])])[0][0].tokens
        reasoning, answer = split_reasoning(tok.decode(plain + [end] + [t for t in after if t != eos]), True)
        return reasoning or "", answer

    def answer(thinking: dict, stream: bool) -> tuple[str, str]:
        req = {"model": NAME, "max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
               "thinking": thinking, "stream": stream}
        r = client.post("/v1/messages", json=req)
        if stream:
            deltas = [c["delta"] for c in named_events(r) if c["type"] == "content_block_delta"]
            return ("".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta"),
                    "".join(d["text"] for d in deltas if d["type"] == "text_delta"))
        blocks = {b["type"]: b for b in r.json()["content"]}
        return blocks.get("thinking", {}).get("thinking", ""), blocks.get("text", {}).get("text", "")

    assert answer({"type": "enabled", "budget_tokens": 5}, stream) == expected(5)
    assert answer({"type": "disabled"}, stream) == expected(0)
    # OpenAI's reasoning_effort "none" (Chat Completions) and reasoning.effort "none" (Responses): the same
    chat = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 12, "temperature": 0,
                                                     "reasoning_effort": "none"}).json()["choices"][0]["message"]
    assert (chat.get("reasoning_content") or "", chat["content"]) == expected(0)
    # vLLM's chat_template_kwargs {"enable_thinking": false} (this template does not read it): the same budget
    chat = client.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 12, "temperature": 0, "chat_template_kwargs":
                                                     {"enable_thinking": False}}).json()["choices"][0]["message"]
    assert (chat.get("reasoning_content") or "", chat["content"]) == expected(0)
    items = client.post("/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 12,
                                               "temperature": 0, "reasoning": {"effort": "none"}}).json()["output"]
    text = [p["text"] for i in items if i["type"] == "message" for p in i["content"]]
    assert text == [expected(0)[1]]
    unbounded = [t for t in generate(model, [prompt], max_new_tokens=12, stop_tokens=[eos])[0][0].tokens if t != eos]
    reasoning, text = split_reasoning(tok.decode(unbounded), True)
    assert answer({"type": "adaptive"}, stream) == (reasoning or "", text)  # the model's own choice: no bound
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "thinking": {"type": "enabled"},
                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and "budget_tokens" in r.json()["error"]["message"]
