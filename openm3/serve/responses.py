"""OpenAI's Responses API over the same engine: `POST /v1/responses` (what OpenAI's newer agents, Codex CLI among
them, speak instead of Chat Completions).

The request's `instructions` and `input` items (messages, `function_call` and `function_call_output` items) are
translated into the chat format `render_chat` writes for `/v1/chat/completions`, so a conversation renders to the
same prompt through either endpoint; the answer comes back as `output` items (a `message` with `output_text`, then
one `function_call` per call the model wrote), streamed as the API's `response.*` events when asked. Responses are
stored (`store`, true by default as in OpenAI's API; in memory, the last `--stored-responses`, `response_store.py`):
`previous_response_id` continues a stored one's conversation, `GET /v1/responses/{id}` returns it, `GET
/v1/responses/{id}/input_items` its input items and `DELETE` drops it. Files, images by URL or file id, and any
image when the model is text-only are refused; a forced tool call
(`tool_choice` 'required' or a named function) constrains decoding to a tool-call block;
`input_image` parts with a base64 data URL go to a vision-language model (`images.py`). The model's think block
comes back as a `reasoning` item (its `reasoning_text`) before the message, streamed as `response.reasoning_text.*`
events; reasoning items a client sends back are rendered into the prompt as the next assistant turn's reasoning.
Errors are OpenAI's error bodies, as on the other endpoints.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
import uuid
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, field_validator, model_validator

from ..data.chat import parse_tool_calls
from ..data.tokenizer import TOOL_CALL_START
from .disconnect import client_gone
from .documents import openai_file_parts
from .images import content_of, data_url_part
from .response_store import ResponseStore
from .schemas import (CUSTOM_INPUT, SEED, ClientTool, CustomToolSpec, Integer, JsonSchemaSpec, OutputSpec,
                      ReasoningEffort, ResponseFormat, ToolName, allowed_tools_spec, client_tools, custom_input,
                      custom_names)
from .validation import described

RESPONSES_PATH = "/v1/responses"
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class FunctionTool(ClientTool):
    type: Literal["function"] = "function"
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def template_tool(self) -> dict:
        """The tool as the chat template takes it."""
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"type"})}

    def call_tool(self) -> dict:
        """The tool as a forced call's grammar takes it ({"name", "parameters"})."""
        return {"name": self.name, "parameters": self.parameters}


class CustomTool(CustomToolSpec):
    """OpenAI's custom tool in the Responses API's flat form (`CustomToolSpec`)."""

    type: Literal["custom"]


class TextFormat(BaseModel):
    """`text.format`: the Responses API's flat form of Chat Completions' `response_format`. Type `json_schema`
    needs its `schema` (as OpenAI's API does; `true`: any JSON), which no other type takes; `name` defaults to
    "response" (OpenAI requires it; nothing here reads it)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        # (".schema: ..." names the field below `format`, which the request may lack)
        if self.schema_ is None and self.type == "json_schema":
            raise ValueError(".schema: type 'json_schema' needs the schema the answer follows (a JSON Schema "
                             "object; true: any JSON)")
        if self.schema_ is not None and self.type != "json_schema":
            raise ValueError(f".schema: a schema is given only with type 'json_schema', not {self.type!r}")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaSpec(
            name=self.name, description=self.description, schema=self.schema_, strict=self.strict))


class ResponsesText(BaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # OpenAI's values; checked, not used


class Reasoning(BaseModel):
    """`reasoning`: its `effort` (`ReasoningEffort`); `summary` (and its deprecated `generate_summary`) take
    OpenAI's values and are not used: the reasoning comes back whole."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. max_output_tokens defaults to what the context limit leaves after the prompt; `top_k` and
    `seed` are extensions; `text.format` asks for JSON (structured outputs); `include` with
    "message.output_text.logprobs" returns the message text's log probabilities (each token's, with `top_logprobs`
    alternatives); `store` keeps the response for `previous_response_id` (which continues a stored response's
    conversation); `reasoning.effort` (one of OpenAI's, `ReasoningEffort`) "none" keeps the think block shut (other
    efforts leave it unbounded) and any effort is the chat template's `reasoning_effort`; `truncation: "auto"` drops
    the conversation's earliest turns where it would not fit the context limit (`fitted`); `background` answers at
    once with the stored response (status "queued", then "in_progress"), generates in a thread and stores the
    result, which `GET` polls and `POST /v1/responses/{id}/cancel` stops; unknown fields and other `include` values
    (reasoning.encrypted_content: the reasoning comes back as plain text) are ignored."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Integer | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    top_k: Integer = Field(default=0, ge=0)
    seed: SEED | None = None
    priority: Integer = 0  # vLLM's extension: with --scheduling-policy priority, lower values are admitted first
    stream: StrictBool = False
    tools: list[FunctionTool | CustomTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True  # false: at most one function_call (as on Chat Completions)
    previous_response_id: str | None = None
    store: StrictBool = True
    background: StrictBool = False  # answered at once (status "queued"); GET polls it, POST .../cancel stops it
    text: ResponsesText | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is honoured; others are ignored
    truncation: Literal["auto", "disabled"] = "disabled"  # auto: the earliest turns dropped to fit the context
    top_logprobs: Integer | None = Field(default=None, ge=0, le=20)
    reasoning: Reasoning | None = None  # {"effort": "none"}: no think block; other efforts: unbounded

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_models(cls, v: Any) -> Any:
        return client_tools(v, FunctionTool, CustomTool)

    @property
    def thinking_budget(self) -> int | None:
        """Think-block tokens allowed: 0 for reasoning.effort "none", else None (no bound)."""
        return 0 if self.reasoning is not None and self.reasoning.effort == "none" else None

    thinking_param: ClassVar[str] = "reasoning"  # the field that asks for a thinking budget (errors name it)

    def template_variables(self) -> dict[str, Any] | None:
        """reasoning.effort as the chat template's `reasoning_effort` (as Chat Completions passes its own)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return None if effort is None else {"reasoning_effort": effort}

    @property
    def logprobs(self) -> int | None:
        """Alternatives per token when the message text's log probabilities are asked for (None: not asked)."""
        return (self.top_logprobs or 0) if LOGPROBS_INCLUDE in (self.include or []) else None

    @property
    def max_tokens(self) -> int | None:  # the name `check` reads
        return self.max_output_tokens


def _content(content: Any, where: str, images: bool) -> str | list[dict]:
    """A message's content for `render_chat`: its text, or text and image parts when it holds images (`images`:
    the model takes them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and images:
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise ValueError(f"{where}[{j}].file_id: this server keeps no files; send image_url as a base64 "
                                 f"data URL")
            parts.append(data_url_part(part.get("image_url"), f"{where}[{j}]", "image_url"))
        elif kind == "input_image":
            raise ValueError(f"{where}[{j}]: input_image parts are not supported by this server (text-only model)")
        elif kind == "input_file":  # a PDF's text layer or a text file (`documents.py`)
            parts += openai_file_parts(part, f"{where}[{j}]")
        elif kind != "refusal":
            raise ValueError(f"{where}[{j}]: expected an input_text, input_image, input_file or output_text part, got "
                             f"{part!r}")
    return content_of(parts)


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string input: one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def chat_messages(req: ResponsesRequest, images: bool = False) -> list[dict]:
    """The request as the OpenAI-style messages `render_chat` takes (`images`: input_image parts become image
    parts; the model takes them). Raises ValueError naming the bad item."""
    out: list[dict] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    pending = None  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role: expected user, system, developer or assistant, got {role!r}")
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content", images)})
            if role == "assistant" and pending:
                out[-1]["reasoning_content"], pending = pending, None
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("name"), str) or not item["name"]:
                raise ValueError(f"{where}.name: a {kind} item needs a non-empty name")
            if kind == "custom_tool_call" and not isinstance(item.get("input"), str):
                raise ValueError(f"{where}.input: a custom_tool_call item needs its input text")
            arguments = item.get("arguments") or "{}" if kind == "function_call" else {CUSTOM_INPUT: item["input"]}
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":  # calls after (or beside) the assistant's text
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if pending:
                out[-1]["reasoning_content"], pending = pending, None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else _content(output, f"{where}.output", images)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise ValueError(f"{where}.{'content' if item.get('content') else 'summary'}: expected a list of "
                                 f"parts, got {type(parts).__name__}")
            texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
            pending = "\n".join(t for t in texts if isinstance(t, str) and t) or None
        else:
            raise ValueError(f"{where}.type: expected message, function_call, function_call_output, custom_tool_call, "
                             f"custom_tool_call_output or reasoning, got {kind!r}")
    return out


def _parse_calls(req: ResponsesRequest) -> bool:
    """Whether tool calls in the answer become function_call items ('none': they stay text)."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        if choice.get("type") == "allowed_tools":
            _allowed_names(choice)
            return True
        if choice.get("type") not in ("function", "custom") or not isinstance(choice.get("name"), str) \
                or not choice["name"]:
            raise ValueError('tool_choice: expected "auto", "none", "required", {"type": "function" | "custom", '
                             '"name": ...} or {"type": "allowed_tools", "mode", "tools"}')
        return True
    if choice not in ("auto", "none", "required"):
        raise ValueError(f'tool_choice: expected "auto", "none", "required" or a named function, got {choice!r}')
    return choice != "none"


def _output_spec(req: ResponsesRequest) -> OutputSpec | None:
    """What the answer must be: `text.format`, or a forced tool call (`tool_choice` 'required' or a named
    function); ValueError for both, or for a forced call without tools."""
    fmt = req.text.format if req.text is not None else None
    spec = fmt.response_format().grammar_spec() if fmt is not None else None
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return spec
    if spec is not None:
        raise ValueError("give a forced tool call (tool_choice) or text.format, not both")
    tools = [t.call_tool() for t in req.tools or []]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return allowed_tools_spec(tools, _allowed_names(choice), choice["mode"], req.parallel_tool_calls)
    return OutputSpec.forced_call(tools, choice["name"] if isinstance(choice, dict) else None,
                                  req.parallel_tool_calls)


def _allowed_names(choice: dict) -> list[str]:
    """The tool names of a Responses `{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type":
    "function" | "custom", "name"}]}` choice; ValueError for another shape."""
    tools = choice.get("tools")
    if choice.get("mode") not in ("auto", "required") or not isinstance(tools, list) or not tools or any(
            not isinstance(t, dict) or t.get("type") not in ("function", "custom")
            or not isinstance(t.get("name"), str) or not t["name"] for t in tools):
        raise ValueError('tool_choice: an allowed_tools choice is {"type": "allowed_tools", "mode": "auto" | '
                         '"required", "tools": [{"type": "function" | "custom", "name": ...}, ...]}')
    return [t["name"] for t in tools]


CANCEL_WAIT_S = 10.0  # how long a cancel request waits for the generation to stop
UNFINISHED = ("queued", "in_progress")  # a background response's statuses before it ends


REPLAYS = 64  # finished streamed background responses whose events `GET ...?stream=true` can still replay


def _error_event(message: str, param: str | None = None, refused: bool = False) -> dict:
    """A stream's `error` event: the request's error (`refused`, naming `param`), or the server's."""
    return {"type": "error", "code": "invalid_request_error" if refused else "server_error", "message": message,
            "param": param}


class EventLog:
    """A streamed background response's events, appended by the thread generating it and read, from any position
    and by any number of readers, until it is closed."""

    def __init__(self):
        self.events: list[dict] = []
        self.closed = False
        self._cond = threading.Condition()

    def put(self, event: dict) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def replay(self, put: Callable[[dict], None], start: int, stop: threading.Event) -> None:
        """`put`s the events from index `start` on as they come, until the log is closed and read to its end or
        `stop` is set (the reader went away; the generation goes on)."""
        i = start
        while not stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: len(self.events) > i or self.closed, timeout=0.5)
                new, done = self.events[i:], self.closed
            for event in new:
                put(event)
            i += len(new)
            if done and not new:
                return


class _Background:
    """A background response in flight: the event that stops it, the thread generating it and, for a streamed
    one, the log of its events."""

    def __init__(self):
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None
        self.log: EventLog | None = None


def add_responses_routes(app, *, tokenizer, model_name: str, check: Callable, check_model: Callable, run: Callable,
                         sse: Callable, text_stream: Callable, api_error: Callable, prompt_of: Callable,
                         takes_images: bool, constraint_maker: Callable, logprobs_for: Callable,
                         store: ResponseStore) -> None:
    """Registers `POST /v1/responses` (and `GET` / `DELETE /v1/responses/{id}`, `GET .../input_items`, `POST
    /v1/responses/input_tokens`) on `app`, sharing `create_app`'s validation, prompt building (input_image parts
    are accepted when `takes_images`), generation, log probabilities and streaming; stored responses go to
    `store`."""
    running: dict[str, _Background] = {}  # background responses in flight, by id
    replays: collections.OrderedDict[str, EventLog] = collections.OrderedDict()  # finished streamed ones' events

    def missing(response_id: str) -> Exception:
        return api_error(f"response_id: no stored response {response_id!r} (this server keeps the last "
                         f"{store.capacity} responses made with store: true, in memory)", "response_id", 404)

    def stored(response_id: str, what: Callable):
        found = what(response_id)
        if found is None:
            raise missing(response_id)
        return found

    def boolean(name: str, text: str | None) -> bool:
        """A boolean URL parameter as OpenAI's API reads one: `true` or `false` (absent: false); 1, yes, True, on
        are a 400 (FastAPI's bool took them)."""
        if text not in (None, "true", "false"):
            raise api_error(f"{name}: expected true or false, got {described(text)}", name)
        return text == "true"

    def integer(name: str, text: str | None, least: int) -> int | None:
        """An integer URL parameter: its digits, with a '-' for a negative one (absent: None); ' 5', '+5', '5.0'
        and '1_0' are a 400 (FastAPI's int took them)."""
        if text is None:
            return None
        if re.fullmatch(r"-?[0-9]+", text) is None:
            raise api_error(f"{name}: expected an integer, got {described(text)}", name)
        if int(text) < least:
            raise api_error(f"{name}: expected an integer >= {least}, got {int(text)}", name)
        return int(text)

    @app.get(RESPONSES_PATH + "/{response_id}")
    def get_response(response_id: str, stream: str | None = None, starting_after: str | None = None):
        """The stored response; with `stream=true` a background response made with `stream: true` is streamed
        again, from its first event or the one after sequence number `starting_after` (a client that lost its
        connection resumes there; -1: from the first), live while it generates. The parameters are read as
        OpenAI's API reads them (see `boolean`, `integer`); others (`include`) are ignored."""
        streamed, after = boolean("stream", stream), integer("starting_after", starting_after, -1)
        if not streamed:
            return stored(response_id, store.get)
        job = running.get(response_id)
        log = job.log if job is not None else replays.get(response_id)
        if log is None:
            stored(response_id, store.get)  # a 404 when there is no such response at all
            raise api_error(f"stream: only a background response made with stream: true can be streamed again "
                            f"(this server keeps the events of the last {REPLAYS} such responses)", "stream")
        start = 0 if after is None else after + 1
        return sse(lambda put, stop: log.replay(put, start, stop), named_events=True, error_chunk=_error_event)

    @app.get(RESPONSES_PATH + "/{response_id}/input_items")
    def get_input_items(response_id: str):
        items = stored(response_id, store.items)
        return {"object": "list", "data": items, "first_id": None, "last_id": None, "has_more": False}

    @app.delete(RESPONSES_PATH + "/{response_id}")
    def delete_response(response_id: str):
        job = running.pop(response_id, None)
        if job is not None:  # deleting a background response in flight stops it (and it is not stored again)
            job.cancel.set()
        if not store.delete(response_id):
            raise missing(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post(RESPONSES_PATH + "/{response_id}/cancel")
    def cancel_response(response_id: str):
        """Stops a background response in flight: it ends at its next token, stored with status "cancelled" and
        the output made so far (waited for up to `CANCEL_WAIT_S`; the reply says "cancelled" either way). A
        finished one is returned as it is; a response made without `background` is a 400, as in OpenAI's API."""
        job = running.get(response_id)
        if job is not None:
            job.cancel.set()
            job.thread.join(CANCEL_WAIT_S)
        found = stored(response_id, store.get)
        if not found.get("background"):
            raise api_error(f"response_id: {response_id!r} was not made with background: true; only background "
                            f"responses can be cancelled", "response_id")
        if found["status"] in UNFINISHED:  # still winding down: it will be stored as cancelled
            found["status"] = "cancelled"
        return found

    def fits(req: ResponsesRequest, prompt: list[int]) -> bool:
        try:
            check(req, prompt, "input")
        except Exception:  # noqa: BLE001 - too long (or another fault, which the final check reports)
            return False
        return True

    def fitted(req: ResponsesRequest, items: list[dict], tools, prompt: list[int], images):
        """`truncation: auto`: where the conversation and max_output_tokens do not fit the context limit, its
        earliest turns are dropped: the input from the first user message after the leading system / developer
        items that makes it fit (found by bisection; the leading items and instructions stay). When even the last
        turn alone does not fit, the prompt is returned whole for the usual 400."""
        if fits(req, prompt):
            return prompt, images
        lead = 0
        while lead < len(items) and items[lead].get("type", "message") == "message" \
                and items[lead].get("role") in ("system", "developer"):
            lead += 1
        starts = [i for i in range(lead + 1, len(items))
                  if items[i].get("type", "message") == "message" and items[i].get("role") == "user"]
        best, lo, hi = None, 0, len(starts) - 1
        while lo <= hi:  # the smallest start that fits (fewer items fit no worse)
            mid = (lo + hi) // 2
            kept = req.model_copy(update={"input": items[:lead] + items[starts[mid]:]})
            candidate = prompt_of(chat_messages(kept, takes_images), tools, "input",
                                  variables=req.template_variables())
            if fits(req, candidate[0]):
                best, hi = candidate, mid - 1
            else:
                lo = mid + 1
        return best if best is not None else (prompt, images)

    def prompt_for(req: ResponsesRequest):
        """(prompt, images, the conversation's items with the stored earlier turns, this turn's own items,
        whether tool calls are parsed, the tools as the chat template takes them) of a Responses request, after
        `truncation: auto` where asked."""
        items = input_items(req)
        try:
            parse_calls = _parse_calls(req)
            messages = chat_messages(req, takes_images)  # the new input checked on its own (its own indices)
        except ValueError as e:
            raise api_error(str(e), "tool_choice" if str(e).startswith("tool_choice") else "input") from None
        own = items  # what this turn stores: its own input (the earlier turns are stored already)
        if req.previous_response_id is not None:
            if req.previous_response_id in running:
                raise api_error(f"previous_response_id: the background response {req.previous_response_id!r} has "
                                f"not finished; poll GET {RESPONSES_PATH}/{{id}} until its status is completed",
                                "previous_response_id")
            earlier = store.conversation(req.previous_response_id)
            if earlier is None:
                raise api_error(f"previous_response_id: no stored response {req.previous_response_id!r}, or an "
                                f"earlier turn of its conversation is gone (this server keeps the last "
                                f"{store.capacity} responses made with store: true, in memory; or send the whole "
                                f"conversation in input)", "previous_response_id")
            items = earlier + items
            try:
                messages = chat_messages(req.model_copy(update={"input": items}), takes_images)
            except ValueError as e:
                raise api_error(f"previous_response_id: {e}", "previous_response_id") from None
        tools = [t.template_tool() for t in req.tools] if req.tools else None
        prompt, images = prompt_of(messages, tools, "input", variables=req.template_variables())
        if req.truncation == "auto":
            prompt, images = fitted(req, items, tools, prompt, images)
        return prompt, images, items, own, parse_calls, tools

    def launch(rid: str, generate: Callable, keep: Callable[[dict], dict], response: Callable, streamed: bool) -> Any:
        """Starts a background response: stored as "queued", generated in a thread by `generate` (`complete(cancel,
        on_start)`, or `produce(put, cancel, settle)` for a streamed one, whose events also go to an `EventLog` that
        this request and later `GET ...?stream=true` calls read), its final state stored unless it was deleted
        meanwhile. Returns the queued response, or the stream of its events."""
        job = _Background()
        if streamed:
            job.log = EventLog()

        def settle(final: dict) -> dict:
            if running.get(rid) is job:  # not deleted meanwhile
                keep(final)
            return final

        def work() -> None:
            try:
                if streamed:
                    settle(response("in_progress", []))
                    generate(job.log.put, job.cancel, settle)
                else:
                    settle(generate(job.cancel, lambda: settle(response("in_progress", []))))
            except Exception as e:  # noqa: BLE001 - the stored response (and the stream) say what went wrong
                settle({**response("failed", []), "error": {"code": "server_error", "message": str(e)}})
                if streamed:
                    job.log.put(_error_event(f"generation failed: {e}"))
            if running.pop(rid, None) is not job:  # deleted meanwhile: not even its in-progress state may stay
                store.delete(rid)
            if streamed:
                replays[rid] = job.log
                while len(replays) > REPLAYS:
                    replays.popitem(last=False)
                job.log.close()

        queued = keep(response("queued", []))
        running[rid] = job
        job.thread = threading.Thread(target=work, name=f"openm3-{rid}", daemon=True)
        job.thread.start()
        if streamed:
            return sse(lambda put, stop: job.log.replay(put, 0, stop), named_events=True, error_chunk=_error_event)
        return queued

    @app.post(RESPONSES_PATH + "/input_tokens")
    def input_tokens(req: ResponsesRequest):
        """OpenAI's input token count: the prompt a Responses request with this body would run on (stored earlier
        turns and `truncation: auto` included), not generated and not checked against the context limit."""
        check_model(req.model)
        return {"object": "response.input_tokens", "input_tokens": len(prompt_for(req)[0])}

    @app.post(RESPONSES_PATH)
    def responses(req: ResponsesRequest):
        if req.background and not req.store:
            raise api_error("background: a background response must be stored (store: true), since GET is how its "
                            "result is read", "background")
        if req.background and store.capacity == 0:
            raise api_error("background: this server stores no responses (--stored-responses 0), so a background "
                            "response could not be read back", "background")
        prompt, images, items, own, parse_calls, tools = prompt_for(req)
        max_new = check(req, prompt, "input")
        forced = req.tool_choice not in (None, "auto", "none")
        auto = ([t.call_tool() for t in req.tools], req.parallel_tool_calls) \
            if req.tools and req.tool_choice in (None, "auto") else None
        constraint = constraint_maker(lambda: _output_spec(req), "tool_choice" if forced else "text", prompt,
                                      auto_calls=auto)()
        stream = text_stream([], [TOOL_CALL_START] if parse_calls else [], prompt)
        lp = logprobs_for(req.logprobs, "include")

        def logprobs(entries: list) -> list[dict]:
            """An output_text part's `logprobs` (the chat format's items); none when not asked for."""
            return lp.chat(entries)["content"] if lp is not None else []
        custom = custom_names(req.tools)
        rid, mid, rsid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex[:24]}", f"rs_{uuid.uuid4().hex[:24]}"
        created = int(time.time())

        def response(status: str, output: list[dict], finish: str | None = None) -> dict:
            n = stream.sampled
            return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model_name,
                    "output": output, "error": None, "instructions": req.instructions, "truncation": req.truncation,
                    "previous_response_id": req.previous_response_id, "store": req.store, "background": req.background,
                    "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                    "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                    "usage": {"input_tokens": len(prompt), "output_tokens": n, "total_tokens": len(prompt) + n,
                              "input_tokens_details": {"cached_tokens": stream.cached}}}

        def text_part(text_: str, entries: list) -> dict:
            return {"type": "output_text", "text": text_, "annotations": [], "logprobs": logprobs(entries)}

        def message(text_: str, status: str = "completed", entries: list = ()) -> dict:
            return {"type": "message", "id": mid, "status": status, "role": "assistant",
                    "content": [text_part(text_, list(entries))]}

        def message_entries() -> list:
            """The log-probability entries of the message text (once `answer` settled the stream)."""
            return lp.select(stream.content_span()) if lp is not None else []

        def reasoning_item(text_: str) -> dict:
            return {"type": "reasoning", "id": rsid, "summary": [], "content": [{"type": "reasoning_text",
                                                                               "text": text_}]}

        def call_item(call: dict) -> dict:
            """A parsed call as its output item: a function_call, or a custom_tool_call holding the input text."""
            if call["name"] not in custom:
                return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}",
                        "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": call["name"],
                        "arguments": json.dumps(call["arguments"]), "status": "completed"}
            return {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex[:24]}",
                    "call_id": f"call_{uuid.uuid4().hex[:24]}", "name": call["name"],
                    "input": custom_input(call["arguments"]), "status": "completed"}

        def answer(finish: str) -> tuple[str, list[dict]]:
            """(the answer's whole text, function_call / custom_tool_call items) of the finished generation."""
            calls = parse_tool_calls(stream.text[len(stream.visible()):], custom) if parse_calls else []
            calls = calls if req.parallel_tool_calls else calls[:1]
            items = [call_item(c) for c in calls]
            whole = stream.visible() if items else stream.text
            stream.settle(whole, bool(items))
            return whole, items

        def status_of(finish: str) -> str:
            return "incomplete" if finish == "length" else "completed"

        def item_status(finish: str, cancelled: bool) -> str:
            """The message item's status: "incomplete" where its text was cut (max_output_tokens, a cancel), as
            OpenAI marks it."""
            return "incomplete" if cancelled else status_of(finish)

        def keep(final: dict) -> dict:
            """The finished response, stored first when the request asked (`store`)."""
            if req.store:
                store.put(rid, own, final, req.previous_response_id)
            return final

        def complete(cancel: threading.Event | None = None, on_start: Callable[[], None] | None = None) -> dict:
            """The finished response of an unstreamed generation (status "cancelled" where `cancel` stopped it, or
            its client disconnected first)."""
            cancel = cancel if cancel is not None else client_gone()
            finish = run(req, prompt, max_new, stream, lambda _k, _t: None, cancel, images=images,
                         constraint=constraint, logprobs=lp, on_start=on_start)
            whole, calls = answer(finish)
            reasoning, text_ = stream.split(whole)
            output = [reasoning_item(reasoning)] if reasoning is not None else []
            cancelled = cancel is not None and cancel.is_set()
            output += ([message(text_, item_status(finish, cancelled), message_entries())] if text_ or not calls
                       else []) + calls
            if cancelled:  # no items where it was cancelled before its first token
                return response("cancelled", output if stream.sampled else [])
            return response(status_of(finish), output, finish)

        if not req.stream and not req.background:
            return keep(complete())

        def produce(put, cancelled, settle: Callable[[dict], dict] = keep) -> None:
            """Streams the response's events through `put`, stopping when `cancelled` is set (a background
            response's cancel: stored as "cancelled"); `settle` stores the final response."""
            seq = iter(range(1 << 62))

            def emit(kind: str, **fields) -> None:
                put({"type": kind, "sequence_number": next(seq), **fields})

            emit("response.created", response=response("in_progress", []))
            emit("response.in_progress", response=response("in_progress", []))
            opened: list[str] = []  # the items opened so far, in order: "reasoning", "message"
            thought: list[str] = []  # the reasoning's deltas

            def close_reasoning() -> None:
                text_ = "".join(thought)
                part = {"type": "reasoning_text", "text": text_}
                emit("response.reasoning_text.done", item_id=rsid, output_index=0, content_index=0, text=text_)
                emit("response.content_part.done", item_id=rsid, output_index=0, content_index=0, part=part)
                emit("response.output_item.done", output_index=0, item=reasoning_item(text_))

            def open_item(kind: str) -> None:
                if opened and opened[-1] == kind:
                    return
                if opened:  # the reasoning comes first: the message closes it
                    close_reasoning()
                opened.append(kind)
                index, iid = len(opened) - 1, (rsid if kind == "reasoning" else mid)
                item = {**reasoning_item(""), "content": []} if kind == "reasoning" else \
                    {**message("", "in_progress"), "content": []}
                emit("response.output_item.added", output_index=index, item=item)
                emit("response.content_part.added", item_id=iid, output_index=index, content_index=0,
                     part={"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("", []))

            def delta(kind: str, d: str) -> None:
                if kind == "reasoning":
                    open_item("reasoning")
                    thought.append(d)
                    emit("response.reasoning_text.delta", item_id=rsid, output_index=0, content_index=0, delta=d)
                else:
                    open_item("message")
                    emit("response.output_text.delta", item_id=mid, output_index=len(opened) - 1, content_index=0,
                         delta=d, logprobs=logprobs(lp.take(stream.content_span()) if lp is not None else []))

            try:
                finish = run(req, prompt, max_new, stream, delta, cancelled, images=images, constraint=constraint,
                             logprobs=lp)
            except Exception as e:  # noqa: BLE001 - stored as failed; the stream ends as OpenAI's do then
                failed = settle({**response("failed", []), "error": {"code": "server_error", "message": str(e)}})
                emit("response.failed", response=failed)
                return
            whole, calls = answer(finish)
            for kind, d in stream.end_parts(whole):
                delta(kind, d)
            reasoning, text_ = stream.split(whole)
            if "message" not in opened and not calls:
                open_item("message")  # an answer without text or calls still has its (empty) message
            elif opened == ["reasoning"]:
                close_reasoning()
            output = [reasoning_item(reasoning or "")] if "reasoning" in opened else []
            if "message" in opened:
                index, entries = len(output), message_entries()
                part = text_part(text_, entries)
                emit("response.output_text.done", item_id=mid, output_index=index, content_index=0, text=text_,
                     logprobs=part["logprobs"])
                emit("response.content_part.done", item_id=mid, output_index=index, content_index=0, part=part)
                item = message(text_, item_status(finish, req.background and cancelled.is_set()), entries)
                emit("response.output_item.done", output_index=index, item=item)
                output.append(item)
            for item in calls:
                index = len(output)
                field, kind = ("input", "custom_tool_call_input") if item["type"] == "custom_tool_call" else \
                    ("arguments", "function_call_arguments")
                emit("response.output_item.added", output_index=index,
                     item={**item, field: "", "status": "in_progress"})
                emit(f"response.{kind}.delta", item_id=item["id"], output_index=index, delta=item[field])
                emit(f"response.{kind}.done", item_id=item["id"], output_index=index, **{field: item[field]})
                emit("response.output_item.done", output_index=index, item=item)
                output.append(item)
            final = settle(response("cancelled", output) if req.background and cancelled.is_set() else
                           response(status_of(finish), output, finish))
            emit("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)

        if req.background:
            return launch(rid, produce if req.stream else complete, keep, response, req.stream)
        return sse(produce, named_events=True, error_chunk=_error_event)
