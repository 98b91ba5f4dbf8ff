"""Chat template: exact rendering, tool calls, media markers and which spans are trained."""

import pytest

from openm3.data.chat import Segment, parse_tool_calls, render_chat, render_segments, render_tool_calls


def test_plain_conversation_renders_exactly():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    expected = "]~!b[]~b]system\nBe brief.[e~[\n]~b]user\nHi[e~[\n]~b]ai\nHello.[e~[\n]~b]user\nBye[e~[\n]~b]ai\n"
    assert render_chat(messages, add_generation_prompt=True) == expected
    assert render_chat(messages) == expected[: -len("]~b]ai\n")]


def test_only_assistant_answers_are_trained():
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    segs = render_segments(messages)
    trained = [s.text for s in segs if s.loss]
    assert trained == ["<think>\nadd\n</think>\n\n4[e~[", "6[e~["]
    prompt = "".join(s.text for s in segs if not s.loss)
    assert "2+2?" in prompt and "]~b]ai\n" in prompt and "4" not in prompt


def test_media_markers_in_order():
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"},
                                     {"type": "image"}]},
        {"role": "assistant", "content": "ok"},
    ]  # fmt: skip
    segs = render_segments(messages)
    media = [(s.kind, s.index) for s in segs if s.kind != "text"]
    assert media == [("image", 0), ("video", 0), ("image", 1)]
    assert render_chat(messages) == "]~!b[]~b]user\n]<]image[>[and]<]video[>[]<]image[>[[e~[\n]~b]ai\nok[e~[\n"


def test_tool_calls_render_and_parse_back():
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
             {"function": {"name": "now", "arguments": "{}"}}]  # fmt: skip
    block = render_tool_calls(calls)
    assert block == (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>'
    )
    assert parse_tool_calls("thinking... " + block) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "now", "arguments": {}},
    ]


def test_tools_go_into_the_system_turn_and_results_into_tool_turns():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    text = render_chat(messages, tools=[tool])
    assert text.startswith("]~!b[]~b]system\n\n\n# Tools\n")
    assert '<tool>{"function": {"name": "add"' in text
    assert "]~b]tool\n<response>3</response>[e~[\n" in text
    trained = [s.text for s in render_segments(messages, tools=[tool]) if s.loss]
    assert trained[0].startswith("<minimax:tool_call>") and trained[-1] == "3[e~["


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], r"content\[0\]"),
        ([{"role": "assistant", "content": [{"type": "image"}]}], "assistant messages cannot hold images"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], "tool_calls"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            "arguments",
        ),
        ([], "messages"),
    ],
    ids=["role", "content-type", "part-type", "image-in-answer", "tool-no-name", "tool-bad-json", "empty"],
)
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        render_segments(messages)


def test_segment_validation():
    with pytest.raises(ValueError, match="kind"):
        Segment("audio")
    with pytest.raises(ValueError, match="index"):
        Segment("image", loss=True, index=0)
