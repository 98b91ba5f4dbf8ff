"""The M3 chat template as a Python function: messages with text, images, video and tool calls.

A conversation renders to ``]~!b[`` followed by one turn per message::

    ]~b]system\n{system prompt}{tools block}[e~[\n
    ]~b]user\n{text, ]<]image[>[ and ]<]video[>[ markers}[e~[\n
    ]~b]ai\n{<think>\n...\n</think>\n\n}{answer}{<minimax:tool_call>\n<invoke name="f">...</minimax:tool_call>}[e~[\n
    ]~b]tool\n<response>{tool output}</response>[e~[\n

and, with ``add_generation_prompt=True``, a final ``]~b]ai\n``. ``render_segments`` returns the same text as a list
of :class:`Segment` that also says which spans are trained (the assistant's answers and their closing ``[e~[``;
never the prompts) and where each image or video goes, which is what packing needs. ``render_chat`` joins them into
the string the ``transformers`` processor expects (one ``]<]image[>[`` / ``]<]video[>[`` marker per item).

Messages are dicts in the OpenAI style: ``{"role": "system"|"developer"|"user"|"assistant"|"tool",
"content": str | [{"type": "text", "text": ...} | {"type": "image"} | {"type": "video"}, ...]}``; an assistant
message may carry ``"reasoning_content": str`` and ``"tool_calls": [{"function": {"name": str, "arguments":
dict | json str}}]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from .tokenizer import BOS, EOS, IMAGE, ROLE, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START, VIDEO

ROLE_NAMES = {"system": "system", "developer": "developer", "user": "user", "assistant": "ai", "tool": "tool"}
_MEDIA = ("image", "video")


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered conversation.

    ``kind="text"``: ``text`` is literal template text and ``loss`` says whether its tokens are training targets.
    ``kind="image"`` / ``"video"``: the ``index``-th image / video of the conversation goes here (never trained).
    """

    kind: str
    text: str = ""
    loss: bool = False
    index: int = -1

    def __post_init__(self):
        if self.kind not in ("text",) + _MEDIA:
            raise ValueError(f"kind: expected 'text', 'image' or 'video', got {self.kind!r}")
        if self.kind != "text" and (self.index < 0 or self.loss or self.text):
            raise ValueError(f"index: a {self.kind} segment needs index >= 0, no text and loss=False")


_TOOLS_INTRO = "\n\n# Tools\nYou can call the tools below; their JSON schemas are listed one per line.\n<tools>\n"
_TOOLS_OUTRO = (
    "</tools>\n\nTo call tools, answer with:\n"
    f'{TOOL_CALL_START}\n<invoke name="tool-name">\n<parameter name="argument-name">value</parameter>\n'
    f"</invoke>\n{TOOL_CALL_END}"
)


def _tools_block(tools: Sequence[dict]) -> str:
    lines = [json.dumps(tool, ensure_ascii=False, sort_keys=True) for tool in tools]
    return _TOOLS_INTRO + "".join(f"<tool>{line}</tool>\n" for line in lines) + _TOOLS_OUTRO


def _argument_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


def render_tool_calls(tool_calls: Sequence[dict]) -> str:
    """``<minimax:tool_call>`` block for a list of ``{"function": {"name": str, "arguments": dict | str}}``."""
    parts = [f"{TOOL_CALL_START}\n"]
    for i, call in enumerate(tool_calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool_calls[{i}]: expected {{'function': {{'name': str, 'arguments': ...}}}}")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ValueError(f"tool_calls[{i}].arguments: expected a JSON object string ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"tool_calls[{i}].arguments: expected a dict, got {type(args).__name__}")
        parts.append(f'<invoke name="{fn["name"]}">\n')
        parts += [f'<parameter name="{k}">{_argument_text(v)}</parameter>\n' for k, v in args.items()]
        parts.append("</invoke>\n")
    parts.append(TOOL_CALL_END)
    return "".join(parts)


_INVOKE = re.compile(r'<invoke name="([^"]+)">\n?(.*?)</invoke>', re.DOTALL)
_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def parse_tool_calls(text: str, raw: Container[str] = ()) -> list[dict]:
    """Inverse of :func:`render_tool_calls` on model output: ``[{"name": str, "arguments": dict}]``.

    Values that parse as JSON are decoded (numbers, lists, objects); others stay strings, so a string argument
    that looks like a number (``"42"``) comes back as a number: the format cannot tell them apart. The values of
    the tools named in `raw` stay the text as written (free-form inputs: OpenAI's custom tools).
    """
    calls = []
    for block in re.findall(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), text, re.DOTALL):
        for name, body in _INVOKE.findall(block):
            args = {}
            for key, value in _PARAM.findall(body):
                try:
                    args[key] = value if name in raw else json.loads(value)
                except json.JSONDecodeError:
                    args[key] = value
            calls.append({"name": name, "arguments": args})
    return calls


def _content_segments(content: Any, where: str, counts: dict[str, int], loss: bool) -> list[Segment]:
    if isinstance(content, str):
        return [Segment("text", content, loss)]
    if content is None:
        return []
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}.content: expected str or a list of parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(Segment("text", part["text"], loss))
        elif kind in _MEDIA:
            if loss:
                raise ValueError(f"{where}.content[{j}]: assistant messages cannot hold {kind}s")
            out.append(Segment(kind, index=counts[kind]))
            counts[kind] += 1
        else:
            raise ValueError(f"{where}.content[{j}]: expected {{'type': 'text'|'image'|'video'}}, got {part!r}")
    return out


def render_segments(
    messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
) -> list[Segment]:
    """Render a conversation as :class:`Segment` s (see the module docstring for the format)."""
    if not isinstance(messages, (list, tuple)) or not messages and not add_generation_prompt:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
    counts = {"image": 0, "video": 0}
    segs = [Segment("text", BOS)]
    messages = list(messages)
    if tools and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": ""})
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLE_NAMES:
            raise ValueError(f"{where}.role: expected one of {sorted(ROLE_NAMES)}, got {role!r}")
        segs.append(Segment("text", f"{ROLE}{ROLE_NAMES[role]}\n"))
        if role == "assistant":
            reasoning = msg.get("reasoning_content")
            if reasoning:
                segs.append(Segment("text", f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n", True))
            segs += _content_segments(msg.get("content"), where, counts, loss=True)
            if msg.get("tool_calls"):
                segs.append(Segment("text", render_tool_calls(msg["tool_calls"]), True))
            segs += [Segment("text", EOS, True), Segment("text", "\n")]
            continue
        if role == "tool":
            segs.append(Segment("text", "<response>"))
        segs += _content_segments(msg.get("content"), where, counts, loss=False)
        if role == "tool":
            segs.append(Segment("text", "</response>"))
        if role == "system" and i == 0 and tools:
            segs.append(Segment("text", _tools_block(tools)))
        segs.append(Segment("text", f"{EOS}\n"))
    if add_generation_prompt:
        segs.append(Segment("text", f"{ROLE}{ROLE_NAMES['assistant']}\n"))
    return _merge(segs)


def _merge(segs: list[Segment]) -> list[Segment]:
    """Join neighbouring text segments with the same loss flag; drop empty text."""
    out: list[Segment] = []
    for s in segs:
        if s.kind == "text" and not s.text:
            continue
        if out and s.kind == "text" and out[-1].kind == "text" and out[-1].loss == s.loss:
            out[-1] = Segment("text", out[-1].text + s.text, s.loss)
        else:
            out.append(s)
    return out


def render_chat(
    messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = False
) -> str:
    """The conversation as one string, one ``]<]image[>[`` / ``]<]video[>[`` marker per image / video."""
    marker = {"image": IMAGE, "video": VIDEO}
    segs = render_segments(messages, tools, add_generation_prompt)
    return "".join(s.text if s.kind == "text" else marker[s.kind] for s in segs)


# The same template in Jinja, for transformers' ``apply_chat_template`` (saved as chat_template.jinja). Whitespace
# between tags is stripped, so every character of output is an explicit expression. It renders exactly what
# render_chat renders for valid input (tool-call arguments as dicts; tests hold the two equal); it validates nothing.
CHAT_TEMPLATE = r"""
{%- macro content(c) -%}
  {%- if c is string -%}{{- c -}}
  {%- elif c is not none -%}
    {%- for part in c -%}
      {%- if part.type == "text" -%}{{- part.text -}}
      {%- elif part.type == "image" -%}{{- "]<]image[>[" -}}
      {%- elif part.type == "video" -%}{{- "]<]video[>[" -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro tools_block() -%}
  {{- "\n\n# Tools\nYou can call the tools below; their JSON schemas are listed one per line.\n<tools>\n" -}}
  {%- for tool in tools -%}{{- "<tool>" + (tool | tojson(sort_keys=true)) + "</tool>\n" -}}{%- endfor -%}
  {{- "</tools>\n\nTo call tools, answer with:\n<minimax:tool_call>\n<invoke name=\"tool-name\">\n" -}}
  {{- "<parameter name=\"argument-name\">value</parameter>\n</invoke>\n</minimax:tool_call>" -}}
{%- endmacro -%}

{%- set names = {"system": "system", "developer": "developer", "user": "user", "assistant": "ai", "tool": "tool"} -%}
{{- "]~!b[" -}}
{%- if tools and (messages | length == 0 or messages[0].role != "system") -%}
  {{- "]~b]system\n" -}}{{- tools_block() -}}{{- "[e~[\n" -}}
{%- endif -%}
{%- for m in messages -%}
  {{- "]~b]" + names[m.role] + "\n" -}}
  {%- if m.role == "assistant" -%}
    {%- if m.reasoning_content -%}{{- "<think>\n" + m.reasoning_content + "\n</think>\n\n" -}}{%- endif -%}
    {{- content(m.content) -}}
    {%- if m.tool_calls -%}
      {{- "<minimax:tool_call>\n" -}}
      {%- for call in m.tool_calls -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {{- "<invoke name=\"" + fn.name + "\">\n" -}}
        {%- for key, value in (fn.arguments or {}).items() -%}
          {{- "<parameter name=\"" + key + "\">" + (value if value is string else value | tojson(sort_keys=true)) -}}
          {{- "</parameter>\n" -}}
        {%- endfor -%}
        {{- "</invoke>\n" -}}
      {%- endfor -%}
      {{- "</minimax:tool_call>" -}}
    {%- endif -%}
    {{- "[e~[\n" -}}
  {%- else -%}
    {%- if m.role == "tool" -%}{{- "<response>" -}}{%- endif -%}
    {{- content(m.content) -}}
    {%- if m.role == "tool" -%}{{- "</response>" -}}{%- endif -%}
    {%- if loop.first and m.role == "system" and tools -%}{{- tools_block() -}}{%- endif -%}
    {{- "[e~[\n" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "]~b]ai\n" -}}{%- endif -%}
""".strip()
