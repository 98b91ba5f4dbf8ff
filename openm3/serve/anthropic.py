"""Anthropic's Messages API over the same engine: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Coding agents built on Anthropic's SDK (Claude Code among them: `ANTHROPIC_BASE_URL=http://host:8000`) speak this
API rather than OpenAI's. A request is translated into the chat format `render_chat` writes for the OpenAI
endpoint (system prompt, user text, `tool_use` blocks as tool calls, `tool_result` blocks as tool messages), so a
conversation renders to the same prompt whichever API carried it; the answer comes back as Anthropic content
blocks (`text`, then one `tool_use` per call the model wrote) with Anthropic's stop reasons, usage and, when
streamed, its named server-sent events. Errors use Anthropic's body, `{"type": "error", "error": {"type",
"message"}}`, with the field named in the message. Image blocks with a base64 source go to a vision-language model
(`images.py`), in user messages and inside `tool_result` content (a screenshot a tool returned); what the server
cannot do is refused with a 400 naming the block: image blocks for a text-only model, images and documents by URL
or file id. Document blocks (PDFs as their text layer, `documents.py`; text; content) reach the prompt as text.
A forced tool call (`tool_choice` `any` / `tool`) constrains decoding to a tool-call block
(`openm3.engine.tool_grammar`), and `output_config.format` to JSON (`structured.py`). The model's think
block comes back as a `thinking` block before the text (streamed as `thinking_delta` events; its `signature` is
empty: nothing is signed here), and thinking blocks a client sends back are rendered into the prompt as that
turn's reasoning (redacted ones are dropped). A final assistant message of text is continued (Anthropic's
prefill).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, field_validator

from ..data.chat import parse_tool_calls
from ..data.tokenizer import TOOL_CALL_START
from .documents import decode_base64, file_text, heading, titled
from .images import base64_part, content_of
from .schemas import MAX_STOP_SEQUENCES, SEED, ClientTool, Integer, OutputSpec, ToolName, check_unique_names
from .validation import described

MESSAGES_PATH = "/v1/messages"


class AnthropicTool(ClientTool):
    client_types: ClassVar[tuple[str | None, ...]] = ("custom", None)
    api: ClassVar[str] = "anthropic"

    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ThinkingConfig(BaseModel):
    """Anthropic's `thinking`: enabled with `budget_tokens` (the think block holds at most that many tokens; this
    server takes any budget >= 1, Anthropic asks >= 1024), disabled (no think block), or adaptive (the model's
    own choice: unbounded); budget_tokens goes with enabled alone, as Anthropic's API asks."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Integer | None = Field(default=None, ge=1, validate_default=True)

    @field_validator("budget_tokens")
    @classmethod
    def _budget(cls, v: int | None, info) -> int | None:
        kind = info.data.get("type")
        if kind == "enabled" and v is None:
            raise ValueError("thinking of type enabled needs budget_tokens")
        if kind is not None and kind != "enabled" and v is not None:
            raise ValueError(f"thinking of type {kind} takes no budget_tokens (enabled does)")
        return v


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: a Messages request without generation settings. `thinking` enabled or
    disabled is the chat template's `enable_thinking` (true / false), so a template that reads it (Qwen-style)
    renders the turn as the client asked."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("tools")
    @classmethod
    def _distinct(cls, v: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
        check_unique_names([t.name for t in v or []])
        return v

    def template_variables(self) -> dict[str, Any] | None:
        if self.thinking is None or self.thinking.type not in ("enabled", "disabled"):
            return None
        return {"enable_thinking": self.thinking.type == "enabled"}


class OutputFormat(BaseModel):
    """Structured outputs: the answer's text is JSON following `schema`."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] | StrictBool = Field(alias="schema")


class OutputConfig(BaseModel):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # Anthropic's values; checked, not used


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. max_tokens is required, as in Anthropic's API; temperature lies in [0, 1] (0 =
    greedy); `seed` is an extension. Structured outputs: `output_config.format` (or the beta's `output_format`)
    `{"type": "json_schema", "schema": ...}`. `thinking` bounds the model's think block (`thinking_budget`).
    Unknown fields (metadata, ...) are ignored."""

    max_tokens: Integer = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, validate_default=True)
    stream: StrictBool = False
    temperature: StrictFloat = Field(default=1.0, ge=0, le=1)
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    top_k: Integer = Field(default=0, ge=0)
    seed: SEED | None = None
    output_format: OutputFormat | None = None
    output_config: OutputConfig | None = None

    @property
    def thinking_budget(self) -> int | None:
        """Think-block tokens allowed (0: no thinking), None: no bound (`thinking` not given, or adaptive)."""
        if self.thinking is None or self.thinking.type not in ("enabled", "disabled"):
            return None
        return self.thinking.budget_tokens if self.thinking.type == "enabled" else 0

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str]:
        if any(not s for s in v or []):
            raise ValueError("stop_sequences must be non-empty strings")
        if len(v or []) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop_sequences: at most {MAX_STOP_SEQUENCES} on this server, got {len(v)}")
        return list(v or [])


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    """Anthropic's error JSON."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (system prompts, tool results)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks or []):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError(f"{where}[{j}]: expected a text block {{'type': 'text', 'text': str}}, got {block!r}")
        parts.append(block["text"])
    return "".join(parts)


def _image_part(block: dict, where: str, images: bool) -> dict:
    """The template's image part of an image block at `where` (`images`: the model takes them)."""
    if not images:
        raise ValueError(f"{where}: image blocks are not supported by this server (text-only model)")
    return base64_part(block.get("source"), f"{where}.source")


def _result_parts(content: Any, where: str, images: bool, sources: bool = True) -> list[dict]:
    """A tool_result's content (a string, or text and image blocks: a screenshot a tool took; with `sources`
    also document and search_result blocks, a retrieval tool's findings) as template parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for k, block in enumerate(content if isinstance(content, list) else [content]):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, f"{where}[{k}]", images))
        elif kind == "document" and sources:
            parts += _document_parts(block, f"{where}[{k}]", images)
        elif kind == "search_result" and sources:  # its title and source, each a line, then its text blocks
            head = [{"type": "text", "text": block[key] + "\n"} for key in ("title", "source")
                    if isinstance(block.get(key), str) and block[key]]
            parts += head + _result_parts(block.get("content") or "", f"{where}[{k}].content", images, False) + \
                [{"type": "text", "text": "\n\n"}]
        else:
            also = ", a document or a search_result block" if sources else ""
            raise ValueError(f"{where}[{k}]: expected a text block {{'type': 'text', 'text': str}}, an image "
                             f"block{also}, got {block!r}")
    return parts


def _document_parts(block: dict, where: str, images: bool) -> list[dict]:
    """A document block as template parts: its title and context, then its text (`source` of type `text`, of type
    `content`: text and image blocks, or of type `base64`: a PDF's text layer, `documents.py`), each a paragraph
    (blank lines between and after, as the message's blocks are joined without a separator). URL and file sources
    are refused: the server fetches nothing and keeps no files."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    titles = (block.get("title"), block.get("context"))
    if kind == "text" and isinstance(source.get("data"), str):
        return titled(source["data"], *titles)
    if kind == "content":
        content = _result_parts(source.get("content") or "", f"{where}.source.content", images, False)
        return heading(*titles) + content + [{"type": "text", "text": "\n\n"}]
    if kind == "base64":
        raw = decode_base64(source.get("data"), f"{where}.source.data")
        return titled(file_text(raw, source.get("media_type") or "", f"{where}.source"), *titles)
    if kind in ("url", "file"):
        why = "fetches nothing" if kind == "url" else "keeps no files"
        raise ValueError(f"{where}.source: this server {why}; send the document inline (a base64 PDF, or its text "
                         f"as a 'text' source)")
    raise ValueError(f"{where}.source: expected a document source of type 'base64' (a PDF), 'text' (data: the "
                     f"text) or 'content' (text and image blocks), got {kind!r}")


def chat_messages(req: CountTokensRequest, images: bool = False) -> list[dict]:
    """The request's conversation in the OpenAI-style form `render_chat` takes; image blocks become image parts
    when `images` (the model takes them). Raises ValueError naming the offending block."""
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict] = []
        calls: list[dict] = []
        thinking: list[str] = []
        for j, block in enumerate(message.content):
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise ValueError(f"{where}[{j}].text: expected a string, got {type(block.get('text')).__name__}")
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "thinking" and message.role == "assistant" and isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])  # rendered back as the turn's reasoning
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("name"), str) or not block["name"]:
                    raise ValueError(f"{where}[{j}]: a tool_use block needs a non-empty name")
                if not isinstance(block.get("input", {}), dict):
                    raise ValueError(f"{where}[{j}].input: expected an object")
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input", {})}})
            elif kind == "tool_result" and message.role == "user":
                if parts:  # keep the order: text written before the result goes first
                    out.append({"role": "user", "content": content_of(parts)})
                    parts = []
                result = _result_parts(block.get("content") or "", f"{where}[{j}].content", images)
                failed = block.get("is_error", False)
                if not isinstance(failed, bool):
                    raise ValueError(f"{where}[{j}].is_error: expected a boolean, got {described(failed)}")
                if failed:
                    result.insert(0, {"type": "text", "text": "Error: "})
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content_of(result)})
            elif kind == "image":
                parts.append(_image_part(block, f"{where}[{j}]", images))
            elif kind == "document":
                parts += _document_parts(block, f"{where}[{j}]", images)
            else:
                raise ValueError(f"{where}[{j}]: unsupported block {kind!r} in a {message.role} message")
        if message.role == "assistant":
            entry: dict = {"role": "assistant", "content": content_of(parts)}
            if thinking:
                entry["reasoning_content"] = "\n".join(thinking)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif parts:
            out.append({"role": "user", "content": content_of(parts)})
    return out


def _tools(req: CountTokensRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                              **({"description": t.description} if t.description else {})}}
            for t in req.tools]


def _parse_calls(req: CountTokensRequest) -> bool:
    """Whether tool calls in the answer become tool_use blocks (False: they stay text); a ValueError naming the
    field of `tool_choice` at fault."""
    kind = (req.tool_choice or {}).get("type", "auto")
    if kind == "tool" and not isinstance(req.tool_choice.get("name"), str):
        raise ValueError("tool_choice.name: a 'tool' choice names the tool")
    if kind not in ("auto", "none", "any", "tool"):
        raise ValueError(f"tool_choice.type: expected 'auto', 'none', 'any' or 'tool', got {kind!r}")
    single = (req.tool_choice or {}).get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):  # (a boolean, as every other: "false" is not false)
        raise ValueError(f"tool_choice.disable_parallel_tool_use: expected a boolean, got {described(single)}")
    return kind != "none"


def _one_call(req: CountTokensRequest) -> bool:
    """`tool_choice.disable_parallel_tool_use` (a boolean, `_parse_calls` checks): at most one tool_use block (a
    forced call's grammar allows one; otherwise the calls after the first are dropped)."""
    return (req.tool_choice or {}).get("disable_parallel_tool_use") is True


def add_messages_routes(app, *, tokenizer, model_name: str, check_model: Callable, check: Callable, run: Callable,
                        sse: Callable,
                        text_stream: Callable, api_error: Callable, prompt_of: Callable, takes_images: bool,
                        constraint_maker: Callable) -> None:
    """Registers the Messages endpoints on `app`, sharing `create_app`'s validation (`check`), generation
    (`run`), streaming (`sse`), `TextStream` factory, error type and prompt building (`prompt_of`; image blocks
    are accepted when `takes_images`)."""

    def prompt_and_images(req: CountTokensRequest):
        """The prompt's token ids, its images and the prefill. A conversation ending with an assistant message of
        plain text is a prefill: the answer continues that text (and holds only the continuation), as in
        Anthropic's API."""
        try:
            messages = chat_messages(req, takes_images)
        except ValueError as e:
            raise api_error(str(e), "messages") from None
        prefill = ""
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant" and not last.get("tool_calls") and isinstance(last["content"], str):
            prefill = messages.pop()["content"]
        return *prompt_of(messages, _tools(req), "messages", prefill, variables=req.template_variables()), prefill

    @app.post(MESSAGES_PATH + "/count_tokens")
    def count_tokens(req: CountTokensRequest):
        check_model(req.model)
        return {"input_tokens": len(prompt_and_images(req)[0])}

    def output_constraint(req: MessagesRequest, prompt: list[int], prefill: str):
        """The answer's constraint for a structured-output request (None without one); a prefill is JSON the
        answer continues, so the grammar reads it first."""
        if req.output_format is not None and req.output_config is not None and req.output_config.format:
            raise api_error("give output_config.format or output_format, not both", "output_format")
        fmt = req.output_format or (req.output_config.format if req.output_config else None)
        kind = (req.tool_choice or {}).get("type", "auto")
        tools = [{"name": t.name, "input_schema": t.input_schema} for t in req.tools or []]  # (errors name it so)
        if kind in ("any", "tool"):
            if fmt is not None:
                raise api_error("give a forced tool call (tool_choice) or an output format, not both", "tool_choice")
            def spec() -> OutputSpec:
                return OutputSpec.forced_call(tools, req.tool_choice.get("name") if kind == "tool" else None,
                                              parallel=not _one_call(req))

            return constraint_maker(spec, "tool_choice", prompt, prefill)()
        auto = (tools, not _one_call(req)) if tools and kind == "auto" else None
        field = "output_format" if req.output_format is not None else "output_config.format"
        return constraint_maker(lambda: None if fmt is None else OutputSpec(fmt.schema_), field, prompt, prefill,
                                auto)()

    @app.post(MESSAGES_PATH)
    def messages(req: MessagesRequest):
        try:
            parse_calls = _parse_calls(req)
        except ValueError as e:
            raise api_error(str(e), "tool_choice") from None
        single = _one_call(req)
        prompt, images, prefill = prompt_and_images(req)
        max_new = check(req, prompt, "messages")
        constraint = output_constraint(req, prompt, prefill)
        stream = text_stream(req.stop_sequences, [TOOL_CALL_START] if parse_calls else [], prompt)
        mid = f"msg_{uuid.uuid4().hex[:24]}"

        def answer(finish: str) -> tuple[str, list[dict], str, str | None]:
            """(the answer's whole text, tool_use blocks, stop_reason, stop_sequence) of the finished generation."""
            calls = []
            if parse_calls and not stream.stopped:
                calls = parse_tool_calls(stream.text[len(stream.visible()):])[:1 if single else None]
            if calls:
                blocks = [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c["name"],
                           "input": c["arguments"]} for c in calls]
                return stream.visible(), blocks, "tool_use", None
            if stream.stopped:
                return stream.text, [], "stop_sequence", stream.stop_found
            return stream.text, [], "max_tokens" if finish == "length" else "end_turn", None

        def usage(output: int) -> dict:
            """Anthropic's accounting: input_tokens are the prompt tokens not read from the cache."""
            return {"input_tokens": len(prompt) - stream.cached, "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": stream.cached, "output_tokens": output}

        if not req.stream:
            whole, tool_uses, reason, stop_seq = answer(run(req, prompt, max_new, stream, lambda _k, _t: None,
                                                            images=images, constraint=constraint))
            reasoning, text = stream.split(whole)
            content = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning is not None else [])
            content += ([{"type": "text", "text": text}] if text or not tool_uses else []) + tool_uses
            return {"id": mid, "type": "message", "role": "assistant", "model": model_name, "content": content,
                    "stop_reason": reason, "stop_sequence": stop_seq, "usage": usage(stream.sampled)}

        def produce(put, cancelled) -> None:
            def start() -> None:  # once the prompt is admitted: its usage then says what the cache held
                put({"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage(0)}})
            opened: list[str] = []  # the blocks opened so far, in order: "thinking", "text"

            def open_block(kind: str) -> None:
                if opened and opened[-1] == kind:
                    return
                if opened:
                    put({"type": "content_block_stop", "index": len(opened) - 1})
                opened.append(kind)
                start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""}
                put({"type": "content_block_start", "index": len(opened) - 1, "content_block": start})

            def part(kind: str, delta: str) -> None:
                open_block("thinking" if kind == "reasoning" else "text")
                body = {"type": "thinking_delta", "thinking": delta} if kind == "reasoning" else \
                    {"type": "text_delta", "text": delta}
                put({"type": "content_block_delta", "index": len(opened) - 1, "delta": body})

            finish = run(req, prompt, max_new, stream, part, cancelled, images=images, on_start=start,
                         constraint=constraint)
            whole, tool_uses, reason, stop_seq = answer(finish)
            for kind, delta in stream.end_parts(whole):
                part(kind, delta)
            if "text" not in opened and not tool_uses:
                open_block("text")  # an answer without text or calls still has its (empty) text block
            index = len(opened)
            if opened:
                put({"type": "content_block_stop", "index": index - 1})
            for block in tool_uses:
                put({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
                put({"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                put({"type": "content_block_stop", "index": index})
                index += 1
            put({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                 "usage": usage(stream.sampled)})
            put({"type": "message_stop"})

        return sse(produce, named_events=True,
                   error_chunk=lambda m, _param, refused: error_body(m, "invalid_request_error" if refused else
                                                                   "api_error"))
