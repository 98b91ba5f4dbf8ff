"""Request bodies of the OpenAI-compatible API (pydantic), and the error body.

Only the fields the server honours are declared; unknown fields are ignored, as OpenAI clients send many
(`user`, `metadata`, ...). Asking for what it cannot give (`best_of`, ...) is refused with a 400 naming the field
rather than answered without it. Responses are plain dicts built in `app.py`: their shapes are OpenAI's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt,
                      ValidationError, ValidationInfo, field_validator, model_validator)

from ..data.chat_template import check_template_variables
from ..engine.cfg_grammar import CfgGrammar
from ..engine.penalties import MAX_BIAS, Penalties
from ..engine.regex_grammar import RegexGrammar
from .validation import explain

Role = Literal["system", "developer", "user", "assistant", "tool"]


def _integral(value: Any) -> Any:
    """A float without a fractional part as its int (5.0 -> 5); any other value as it came."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A request's integers are JSON Schema's `integer`: an int or a float without a fractional part (5.0 is 5, as vLLM
# and OpenAI's clients may send it); a boolean (`true` is not token id 1), a string ("5") or 5.5 is refused. Its
# booleans are strict too (StrictBool: 1 and "true" are refused), and its other numbers (StrictFloat: ints and
# floats; a boolean or "0.5" is refused).
Integer = Annotated[StrictInt, BeforeValidator(_integral)]
SEED = Annotated[Integer, Field(ge=-2**63, le=2**63 - 1, description="the sampler's seed (an int64, as vLLM takes)")]
MAX_STOP_SEQUENCES = 64  # Anthropic's stop_sequences (OpenAI's stop: 4): every one is matched at every token
MAX_BAD_WORDS = 256  # vLLM's bad_words: each is matched at every token on the engine's thread
# A tool's name goes into the model's markup as written (`<invoke name="NAME">`): OpenAI and Anthropic take
# [a-zA-Z0-9_-]{1,64}; this server refuses only what would break the markup (quotes, angle brackets, whitespace)
ToolName = Annotated[str, Field(min_length=1, max_length=256, pattern=r'^[^"<>&\s]+$')]
MAX_CHOICES = 128  # choices of one request (n, times the prompts of a Completions batch): each is a generation
# OpenAI's reasoning efforts (Chat Completions' `reasoning_effort`, Responses' `reasoning.effort`): "none" keeps the
# think block shut; every one reaches the chat template as its `reasoning_effort`
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the request's usage; vLLM's continuous_usage_stats (with include_usage):
    every chunk also carries the usage so far."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """What an answer must be: JSON following `schema` (None: any object; `strict`: OpenAI's strict mode), exactly
    one of `choices` (vLLM's guided choice), text that `regex` matches whole (vLLM's guided regex), text that the
    context-free `grammar` derives (vLLM's guided grammar: Lark's EBNF or GBNF, `cfg_grammar.py`), or a tool-call
    block (`tools`: the tools as JSON, [{"name", "parameters"}], Anthropic's with "input_schema" for "parameters";
    `tool_name`: that one tool, else any; `max_calls`: most calls in it, None: no bound; `triggered`: the text is
    free and the block's grammar holds only from each tool-call start the model writes: `openm3 serve
    --constrain-tool-calls`). `field`: the request field that asked for it, named in errors (None: the caller's
    default)."""

    schema: Any = None
    strict: bool = False
    choices: tuple[str, ...] | None = None
    regex: str | None = None
    grammar: str | None = None
    tools: str | None = None
    tool_name: str | None = None
    max_calls: int | None = None
    triggered: bool = False
    field: str | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def forced_call(cls, tools: list[dict] | None, name: str | None, parallel: bool = True) -> "OutputSpec":
        """A forced tool call over `tools` ([{"name", "parameters"}]), one call unless `parallel`; ValueError
        without tools."""
        if not tools:
            raise ValueError("forcing a tool call needs tools")
        return cls(tools=json.dumps(tools, sort_keys=True), tool_name=name, max_calls=None if parallel else 1)

    @classmethod
    def auto_calls(cls, tools: list[dict], parallel: bool = True) -> "OutputSpec":
        """The calls the model chooses to write under `tool_choice: auto`: free text, and every tool-call block it
        opens a well-formed one over `tools` (at most one call in a block unless `parallel`)."""
        return cls(tools=json.dumps(tools, sort_keys=True), max_calls=None if parallel else 1, triggered=True,
                   field="tools")


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: the schema the answer must follow (`openm3.engine.json_grammar` lists the
    keywords it enforces); strict: objects take no keys beyond their `properties` unless they say otherwise."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | StrictBool = Field(default=True, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: plain text (the default), any JSON object (`json_object`) or JSON that follows a schema
    (`json_schema`); the JSON kinds constrain decoding, as vLLM's structured outputs do."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, v: JsonSchemaSpec | None, info) -> JsonSchemaSpec | None:
        if v is not None and info.data.get("type") != "json_schema":
            raise ValueError("json_schema is given only with type 'json_schema'")
        return v

    def grammar_spec(self) -> OutputSpec | None:
        """The answer's `OutputSpec` (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return OutputSpec()
        if self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object holding the schema")
        return OutputSpec(self.json_schema.schema_, bool(self.json_schema.strict))


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field (the parts this server honours: `json`, `choice`, `regex`,
    `grammar`, `json_object`; a `structural_tag` is refused rather than ignored; vLLM's backend options are
    ignored)."""

    json_: dict[str, Any] | StrictBool | None = Field(default=None, alias="json")
    choice: list[str] | None = Field(default=None, min_length=1)
    regex: str | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("structural_tag is not supported by this server (json, choice, regex, grammar and "
                             "json_object are)")
        return v


class SamplingFields(BaseModel):
    """What both endpoints share. `top_k` is an extension (0 = off); temperature 0 = greedy. OpenAI's
    `presence_penalty`, `frequency_penalty` and `logit_bias` (token id -> bias) and vLLM's `repetition_penalty`,
    `min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids` and `allowed_token_ids` adjust the sampling as there
    (`openm3.engine.penalties`). vLLM's `include_stop_str_in_output` keeps the stop string that ended the text;
    `truncate_prompt_tokens` k keeps the prompt's last k tokens (-1: as many as the context limit leaves beside
    max_tokens, or one new token); `bad_words`: words the answer may not write (`Penalties.bad_words`);
    `prompt_logprobs` k: each prompt token's log probability, rank and k alternatives (not with `stream`);
    `priority`: a request's place in the queue under `--scheduling-policy priority` (lower first)."""

    model: str
    max_tokens: Integer | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat = Field(default=1.0, gt=0, le=1)
    top_k: Integer = Field(default=0, ge=0)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: SEED | None = None
    n: Integer = Field(default=1, ge=1, le=MAX_CHOICES, description="choices per prompt")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extension
    guided_json: dict[str, Any] | StrictBool | None = None  # vLLM's older names for the same
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_regex: str | None = None
    guided_grammar: str | None = None
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0, allow_inf_nan=False)  # vLLM's extensions from here on
    min_p: StrictFloat = Field(default=0.0, ge=0, le=1)
    min_tokens: Integer = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[Integer, Field(ge=0)]] | None = None
    allowed_token_ids: list[Annotated[Integer, Field(ge=0)]] | None = Field(default=None, min_length=1)
    include_stop_str_in_output: StrictBool = False
    truncate_prompt_tokens: Integer | None = Field(default=None, ge=-1)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    prompt_logprobs: Integer | None = Field(default=None, ge=0, le=20, description="vLLM's: each prompt token's "
                                              "log probability and rank, with this many alternatives (not with "
                                              "stream)")
    priority: Integer = 0  # vLLM's: with --scheduling-policy priority, lower values are admitted first

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available with stream: true (as in vLLM)")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (as many as the context limit leaves) or >= 1")
        return v

    def penalties(self, encode: Callable[[str], list[int]] | None = None) -> Penalties:
        """The logits adjustments asked for (`Penalties.active` false when none); ValueError for a logit_bias key
        that is not a token id. encode: the tokenizer's, for `bad_words`: each word's tokens as written (leading
        spaces dropped) and after one space, as vLLM takes them (None: bad words left out)."""
        bias = []
        for key, value in (self.logit_bias or {}).items():
            try:
                bias.append((int(key), value))
            except ValueError:
                raise ValueError(f"logit_bias: keys are token ids, got {key!r}") from None
        return Penalties(presence=self.presence_penalty, frequency=self.frequency_penalty,
                         repetition=self.repetition_penalty, logit_bias=tuple(bias), min_tokens=self.min_tokens,
                         min_p=self.min_p,
                         allowed=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                         bad_words=_bad_word_ids(self.bad_words or [], encode) if encode is not None else ())

    def output_spec(self) -> OutputSpec | None:
        """The answer's constraint from whichever of response_format, structured_outputs, guided_json,
        guided_choice, guided_regex or guided_grammar the request gives (ValueError for more than one)."""
        so = self.structured_outputs
        given = {"response_format": self.response_format.grammar_spec() if self.response_format else None,
                 "structured_outputs.json": None if so is None or so.json_ is None else OutputSpec(so.json_),
                 "structured_outputs.choice": None if so is None or not so.choice else OutputSpec(
                     choices=tuple(so.choice)),
                 "guided_json": None if self.guided_json is None else OutputSpec(self.guided_json),
                 "structured_outputs.regex": None if so is None or so.regex is None else OutputSpec(regex=so.regex),
                 "guided_choice": None if not self.guided_choice else OutputSpec(choices=tuple(self.guided_choice)),
                 "guided_regex": None if self.guided_regex is None else OutputSpec(regex=self.guided_regex),
                 "structured_outputs.grammar": None if so is None or so.grammar is None else OutputSpec(
                     grammar=so.grammar),
                 "structured_outputs.json_object": OutputSpec() if so is not None and so.json_object else None,
                 "guided_grammar": None if self.guided_grammar is None else OutputSpec(grammar=self.guided_grammar)}
        named = [k for k, v in given.items() if v is not None]
        if len(named) > 1:
            raise ValueError(f"give one output constraint, got {', '.join(named)}")
        return dataclasses.replace(given[named[0]], field=named[0]) if named else None
    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise ValueError("stop must be a non-empty string or a list of at most 4 non-empty strings")
        return stops


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: prompt is text or token ids, or a batch of them (a list of texts or of id lists, as
    lm-evaluation-harness sends it); each prompt gets `n` choices, indexed prompt by prompt (choice `i * n + j` is
    prompt i's j-th). echo: each choice starts with its prompt (and, with logprobs, the prompt tokens' log
    probabilities: a scoring request); with `max_tokens: 0` (OpenAI's legacy scoring form) nothing follows it."""

    prompt: str | list[Integer] | list[str] | list[list[Integer]]  # (`true` is not token id 1)
    max_tokens: Integer | None = Field(default=16, ge=0, description="0 with echo: the prompt scored, nothing "
                                         "generated")
    logprobs: Integer | None = Field(default=None, ge=0, le=20, description="top alternatives per token (0: "
                                       "the sampled token's alone); null: no log probabilities")
    echo: StrictBool = False
    best_of: Integer | None = Field(default=None, ge=1, le=1, description="candidates ranked per choice: not "
                                      "supported beyond 1 (use n)")

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, v: str | list) -> str | list:
        prompts = _batch(v)
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError("prompt must not be empty" if len(prompts) == 1 else f"prompt {i} is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one unless it sent a batch."""
        return _batch(self.prompt)


def _bad_word_ids(words: list[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences: as written (leading spaces dropped) and after one space, once each."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text)) if text.strip() else ()
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def _batch(prompt: str | list) -> list:
    return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str  # a base64 data URL (`openm3.serve.images`: the server fetches nothing)
    detail: Literal["auto", "low", "high"] | None = None  # accepted and ignored: the processor decides the size


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    url: str  # a base64 data URL of a video/* file or an animated GIF / WebP / PNG (`openm3.serve.images`)


class VideoURLPart(BaseModel):  # vLLM's extension of the OpenAI format
    type: Literal["video_url"]
    video_url: VideoURL


class FileData(BaseModel):
    file_data: str | None = None  # a base64 data URL: a PDF (its text layer) or a text file (`openm3.serve.documents`)
    file_id: str | None = None  # refused with a message: the server keeps no files
    filename: str | None = None


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileData


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | FilePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str = "{}"  # a JSON object, as a string (OpenAI's format)


class CustomCall(BaseModel):
    name: str = Field(min_length=1)
    input: str  # the free-form text a custom tool was called with


class _FunctionOrCustom(BaseModel):
    """OpenAI's shape of a tool reference: `type` ("function" or "custom") names the field that holds it."""

    kind: ClassVar[str] = "tool reference"  # errors name it

    type: Literal["function", "custom"] = "function"

    @model_validator(mode="after")
    def _its_object(self):
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.kind} of type {self.type!r} needs its {self.type!r} object")
        return self


class ToolCall(_FunctionOrCustom):
    """An assistant message's tool call: a function's (`function`) or a custom tool's (`type: "custom"`,
    `custom`)."""

    kind: ClassVar[str] = "tool call"

    id: str | None = None
    function: FunctionCall | None = None
    custom: CustomCall | None = None

    def template_call(self) -> dict:
        """The call as the chat template takes it (a custom tool's text as its one argument)."""
        head = {} if self.id is None else {"id": self.id}
        if self.type == "function":
            return {**head, "type": "function", "function": self.function.model_dump()}
        return {**head, "type": "function",
                "function": {"name": self.custom.name, "arguments": {CUSTOM_INPUT: self.custom.input}}}


class ChatMessage(BaseModel):
    role: Role
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, v: Any) -> Any:
        # Checked before the union is tried, so the error names the part instead of "should be a valid string".
        # Whether the served model takes the image parts is the endpoint's question (a 400 naming the part).
        if isinstance(v, list):
            for j, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("text", "image_url", "video_url", "file"):
                    raise ValueError(f"content[{j}]: {kind!r} parts are not supported (text, image_url, video_url "
                                     f"and file parts only: the served engine has no audio input)")
        return v


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Chat Completions messages as the chat template takes them (custom tool calls in their function form)."""
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        if message.tool_calls:
            entry["tool_calls"] = [call.template_call() for call in message.tool_calls]
        out.append(entry)
    return out


class FunctionDef(BaseModel):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None


# the tool types OpenAI's own servers run (its hosted tools) and Anthropic's (its server tools, by type prefix)
OPENAI_HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                       "computer_use", "image_generation", "mcp", "local_shell", "shell")
ANTHROPIC_SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def check_tool_type(data: Any, client_types: tuple[str | None, ...], api: str) -> Any:
    """A tool entry's `type` before the tool model reads it (a `mode="before"` validator): only tools the client
    runs from a JSON schema it gives are served; a hosted / server tool (its provider's servers run it) or a
    provider-defined tool (whose schema its own models know and this model does not) is refused with a message
    saying why and what to send instead, rather than shown to the model as a tool without a schema."""
    if not isinstance(data, dict) or data.get("type") in client_types:
        return data
    kind = data.get("type")
    described = "function tools (name, description, JSON-schema parameters) or custom tools (a free-form input)" \
        if api == "openai" else "custom tools (name, description, input_schema)"
    if api == "openai" and kind in OPENAI_HOSTED_TOOLS or api == "anthropic" and isinstance(kind, str) \
            and kind.startswith(ANTHROPIC_SERVER_TOOLS):
        owner = "OpenAI's" if api == "openai" else "Anthropic's"
        raise ValueError(f"type {kind!r} is a tool that {owner} servers run; this server runs none, only {described} "
                         "that the client executes")
    raise ValueError(f"type {kind!r} is not served: give {described}")


class ClientTool(BaseModel):
    """A tool entry of a request, its `type` checked by `check_tool_type` first: `client_types` are the types
    this API's client-run tools carry (None: no type given), `api` names the API ("openai" / "anthropic")."""

    client_types: ClassVar[tuple[str | None, ...]] = ("function", None)
    api: ClassVar[str] = "openai"

    @model_validator(mode="before")
    @classmethod
    def _served_type(cls, data: Any) -> Any:
        return check_tool_type(data, cls.client_types, cls.api)


class Tool(ClientTool):
    type: Literal["function"] = "function"
    function: FunctionDef

    def template_tool(self) -> dict:
        """The tool as the chat template takes it."""
        return self.model_dump(exclude_none=True)

    def call_tool(self) -> dict:
        """The tool as a forced call's grammar takes it ({"name", "parameters"})."""
        return {"name": self.function.name, "parameters": self.function.parameters}


CUSTOM_INPUT = "input"  # the parameter a custom tool's free-form text is written in


class CustomToolSpec(BaseModel):
    """OpenAI's custom tool: a free-form text input (`format` `text`, the default) or one a grammar derives
    (Responses: `{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}`; Chat Completions nests the
    last two under `grammar`). The model sees it as a function with one string parameter, `CUSTOM_INPUT` (the
    grammar in its description), and its calls come back holding that text as written. A forced call
    (`tool_choice`) follows the grammar (`openm3.engine.tool_grammar`); an unforced one is parsed as written."""

    name: ToolName
    description: str | None = None
    format: dict[str, Any] | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # messages that start with "." name a field below `format` (`explain` joins them to the path)
        if v is None or v.get("type") == "text":
            return v
        if v.get("type") != "grammar":
            raise ValueError(f".type: expected 'text' or 'grammar', got {v.get('type')!r}")
        nested = isinstance(v.get("grammar"), dict)  # Chat Completions' form
        grammar, at = (v["grammar"], ".grammar") if nested else (v, "")
        if grammar.get("syntax") not in ("lark", "regex"):
            raise ValueError(f"{at}.syntax: expected 'lark' or 'regex', got {grammar.get('syntax')!r}")
        if not isinstance(grammar.get("definition"), str) or not grammar["definition"].strip():
            raise ValueError(f"{at}.definition: expected the grammar's text")
        try:  # compiled once here, so a grammar this server cannot follow fails the request, not a later call
            (CfgGrammar if grammar["syntax"] == "lark" else RegexGrammar)(grammar["definition"])
        except ValueError as e:
            raise ValueError(f"{at}.definition: {e}") from None
        return v

    @property
    def grammar(self) -> dict[str, Any] | None:
        """{"syntax", "definition"} of a grammar format (None: free text)."""
        if self.format is None or self.format.get("type") != "grammar":
            return None
        grammar = self.format["grammar"] if isinstance(self.format.get("grammar"), dict) else self.format
        return {"syntax": grammar["syntax"], "definition": grammar["definition"]}

    def template_tool(self) -> dict:
        about = "Free-form text input (not JSON)."
        if self.grammar is not None:
            about += f" It must follow this {self.grammar['syntax']} grammar:\n{self.grammar['definition']}"
        parameters = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": about}},
                      "required": [CUSTOM_INPUT]}
        function = {"name": self.name, "parameters": parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def call_tool(self) -> dict:
        tool = {"name": self.name, "parameters": self.template_tool()["function"]["parameters"]}
        if self.grammar is not None:
            tool["text_grammar"] = {"parameter": CUSTOM_INPUT, **self.grammar}
        return tool


class ChatCustomTool(BaseModel):
    """A custom tool in Chat Completions' form: `{"type": "custom", "custom": {name, description, format}}`."""

    type: Literal["custom"]
    custom: CustomToolSpec

    @property
    def name(self) -> str:
        return self.custom.name

    def template_tool(self) -> dict:
        return self.custom.template_tool()

    def call_tool(self) -> dict:
        return self.custom.call_tool()


def client_tools(v: Any, function_model: type[BaseModel], custom_model: type[BaseModel]) -> Any:
    """A request's `tools` list as models (a `mode="before"` validator): entries of type "custom" as
    `custom_model`, every other one as `function_model` (whose check refuses hosted tools); a ValueError naming
    the entry and field."""
    if not isinstance(v, list):
        return v
    out = []
    for i, entry in enumerate(v):
        if isinstance(entry, (function_model, custom_model)):
            out.append(entry)
            continue
        model = custom_model if isinstance(entry, dict) and entry.get("type") == "custom" else function_model
        try:
            out.append(model.model_validate(entry))
        except ValidationError as e:
            where, message = explain(e.errors(), entry)
            raise ValueError(f"tools[{i}]{where}: {message}") from None
    check_unique_names([tool_name(t) for t in out])
    return out


def tool_name(tool: BaseModel) -> str:
    """The name of a validated tool entry (a chat `Tool` nests it under `function`)."""
    return tool.function.name if hasattr(tool, "function") else tool.name


def check_unique_names(names: list[str]) -> None:
    """ValueError naming the first tool whose name an earlier one has (a call could not tell them apart)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise ValueError(f"tools[{i}].name: {name!r} is tools[{seen[name]}]'s name too; tool names must differ")
        seen[name] = i


def custom_input(arguments: dict) -> str:
    """A custom tool call's input text from its parsed arguments (`CUSTOM_INPUT`'s value, or the one value the
    model wrote under another name)."""
    value = arguments[CUSTOM_INPUT] if CUSTOM_INPUT in arguments else next(iter(arguments.values()), "")
    return value if isinstance(value, str) else json.dumps(value)


def custom_names(tools: list | None) -> frozenset[str]:
    """The names of a request's custom tools (their calls' inputs stay text)."""
    return frozenset(t.name for t in tools or [] if isinstance(t, (CustomToolSpec, ChatCustomTool)))


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(_FunctionOrCustom):
    """A named tool to call: `{"type": "function", "function": {"name"}}` or `{"type": "custom", "custom":
    {"name"}}`."""

    kind: ClassVar[str] = "tool_choice"

    function: NamedFunction | None = None
    custom: NamedFunction | None = None

    @property
    def name(self) -> str:
        return getattr(self, self.type).name


class AllowedTools(BaseModel):
    """OpenAI's allowed tools (Chat Completions' `{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`):
    the model may call only these of the request's tools, which all stay in the prompt (so its cached prefix stays
    the same while the allowed set changes); mode "required": it must call one or more of them."""

    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)

    def names(self) -> list[str]:
        return [t.name for t in self.tools]


class AllowedToolsChoice(BaseModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def allowed_tools_spec(tools: list[dict], names: list[str], mode: str, parallel: bool) -> OutputSpec:
    """The grammar of an `allowed_tools` choice over `tools` (the call forms, [{"name", "parameters"}]): a forced
    call among the allowed ones ("required"), or free text whose every tool-call block calls one of them ("auto":
    only the grammar can keep that, so it applies whatever `--constrain-tool-calls` says). ValueError naming a
    tool the request does not define."""
    known = {t["name"] for t in tools}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"tool_choice: allowed tools {missing} are not among the request's tools")
    subset = [t for t in tools if t["name"] in set(names)]
    if mode == "required":
        return OutputSpec.forced_call(subset, None, parallel)
    return OutputSpec.auto_calls(subset, parallel)


class Prediction(BaseModel):
    """OpenAI's predicted output (`{"type": "content", "content": ...}`): text the answer is expected to largely
    repeat (a file being edited). A server running speculative decoding looks its drafts up in it too, so the
    answer's tokens that follow it are confirmed several per step; the answer is the same either way."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class TemplateVariables(BaseModel):
    """vLLM's `chat_template_kwargs`: more variables for the chat template (a checkpoint's own template reads
    them, e.g. `enable_thinking`; openm3's built-in template reads none). `enable_thinking: false` also keeps the
    think block shut (a thinking budget of 0), whatever the template makes of it."""

    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            return check_template_variables(v)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("chat_template_kwargs: ")) from None

    def template_variables(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs


class ChatCompletionRequest(SamplingFields, TemplateVariables):
    """`POST /v1/chat/completions`; max_tokens (or its newer name max_completion_tokens) defaults to what the
    context limit leaves after the prompt. tool_choice: 'auto' (default) lets the model decide; 'none' returns
    any tool call the model writes as plain content; 'required' (one or more calls) and a named function (one call
    of it) constrain decoding to a tool-call block (`openm3.engine.tool_grammar`); `AllowedToolsChoice` restricts
    the calls to some of the tools (`allowed_tools_spec`). parallel_tool_calls false: at
    most one call (a forced call's grammar allows one; with 'auto' the calls after the first are dropped).
    prediction: a predicted output, a draft source for speculative decoding (`Prediction`). vLLM's
    add_generation_prompt false leaves the assistant's opening off the prompt; continue_final_message true
    (with add_generation_prompt false, as vLLM asks) makes the final assistant message's text the start of the
    answer, which holds only what follows it."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True  # vLLM's: the assistant's opening after the conversation
    continue_final_message: StrictBool = False  # vLLM's: the answer continues the final (assistant) message
    prediction: Prediction | None = None
    tools: list[Tool | ChatCustomTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_completion_tokens: Integer | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: Integer | None = Field(default=None, ge=0, le=20)
    reasoning_effort: ReasoningEffort | None = None  # "none": no think block (a thinking budget of 0)

    @property
    def thinking_budget(self) -> int | None:
        """Think-block tokens allowed: 0 for reasoning_effort "none" or chat_template_kwargs' enable_thinking
        false, else None (no bound)."""
        off = (self.chat_template_kwargs or {}).get("enable_thinking") is False
        return 0 if self.reasoning_effort == "none" or off else None

    @property
    def thinking_param(self) -> str:
        """The field that asked for the thinking budget (errors name it)."""
        return "reasoning_effort" if self.reasoning_effort == "none" else "chat_template_kwargs"

    def template_variables(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort when given (as
        transformers and vLLM pass it; a template that does not read it ignores it)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables or None

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_models(cls, v: Any) -> Any:
        return client_tools(v, Tool, ChatCustomTool)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def output_spec(self) -> OutputSpec | None:
        """As `SamplingFields.output_spec`, and a forced tool call for tool_choice 'required' or a named function
        (ValueError beside another output constraint, or without tools)."""
        spec = super().output_spec()
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return spec
        if spec is not None:
            raise ValueError("give a forced tool call (tool_choice) or an output format, not both")
        tools = [t.call_tool() for t in self.tools or []]
        if isinstance(choice, AllowedToolsChoice):
            allowed = choice.allowed_tools
            return allowed_tools_spec(tools, allowed.names(), allowed.mode, self.parallel_tool_calls)
        return OutputSpec.forced_call(tools, None if choice == "required" else choice.name,
                                      self.parallel_tool_calls)


def error_body(message: str, param: str | None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
