"""The HTTP app: `GET /health`, `/version` and `/metrics` (Prometheus), OpenAI's `GET /v1/models`,
`POST /v1/completions`, `/v1/chat/completions` and `/v1/responses` (`responses.py`), Anthropic's
`POST /v1/messages` (+ `/count_tokens`; `anthropic.py`) and vLLM's `POST /tokenize` / `/detokenize`
(`tokens.py`), over one engine.

    app = create_app(ModelBackend(model), tokenizer, model_name="m3-tiny", max_total_tokens=4096)

The app never touches the model itself: a *backend* is any callable `backend(prompt_ids, *, max_new_tokens,
sampling, stop_tokens, seed, on_token) -> finish_reason` that calls `on_token(token_id)` for each sampled token,
so the same server runs the CPU reference or the Triton kernels (whatever the engine picks for the model's device)
or a scripted backend in tests. A backend with `concurrent = True` (`openm3.engine.batching.BatchedGenerator`,
continuous batching: what `openm3 serve` uses unless `--max-batch 1`) is called from every request's thread at
once; any other backend (`ModelBackend`: one `generate` per request) runs one request at a time under a lock.

A backend whose `prefix_caching` is true (`BatchedGenerator`'s default) also takes `on_cached(n)`, the prompt
tokens it found cached: the usage reports them as OpenAI's `cached_tokens` and Anthropic's
`cache_read_input_tokens`.

A backend whose `supports_logprobs` is true (both of openm3's) also takes `logprobs=n` and
`on_logprobs(logprob, top)`, called before each `on_token`, and `prompt_logprobs=n` with
`on_prompt_logprobs(entries)` for the prompt's tokens: Chat Completions' `logprobs` / `top_logprobs`,
Completions' `logprobs` (and `echo`) and vLLM's `prompt_logprobs` on both return them (`logprobs.py`); for any
other backend asking for them is a 400.

A backend whose `supports_abort` is true (both of openm3's) also takes `abort=`, an event the server sets when
nobody waits for the answer any more (its client disconnected, streamed or not: `disconnect.py`; a background
response cancelled; another choice of the request failed): the request then ends where it is, without waiting for
its next token, so a long prompt whose client left is not prefilled to the end.

A backend whose `vl_config` is set (`ModelBackend` or `BatchedGenerator` over an `M3ForConditionalGeneration`) takes
images: the chat endpoints accept image parts as base64 data (`images.py`: decoded, processed and expanded into
placeholder runs as in training), Chat Completions also vLLM's `video_url` parts (coded videos, animated images),
and call it with `images=PromptImages(...)`; for any other backend an image or video part is a 400 naming the part.

Text is produced incrementally by `TextStream` (`stream.py`), for streamed and non-streamed responses alike, so
the concatenated deltas of a stream equal the non-streamed text. Stop strings end generation (raising from
`on_token` is the only way to end `generate` early) and are cut from the text, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import random
import threading
import time
import uuid
from typing import AsyncIterator, Callable, Protocol, Sequence

from ..data.chat import parse_tool_calls
from ..data.chat_template import check_template_variables
from ..data.tokenizer import THINK_END, THINK_START, TOOL_CALL_START, NotUnicode
from ..engine.constrained import GrammarConstraint, GrammarDeadEnd
from ..engine.media import chat_prompt
from ..engine.penalties import Penalties, PenalizedPicker
from ..engine.sampling import SamplingParams, check_count
from ..engine.scheduler import PromptImages, is_vision_language, text_model
from ..models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip
from . import anthropic, responses, tokens
from .generation_config import sampling_defaults
from .disconnect import DisconnectWatch, client_gone
from .documents import openai_file_parts
from .images import data_url_part
from .logprobs import PromptEntries, TokenLogprobs, vllm_prompt_logprobs
from .metrics import RequestLatency, prometheus_text
from .stats_log import StatsLog
from .reasoning import ReasoningSplitter
from .schemas import (MAX_CHOICES, ChatCompletionRequest, CompletionRequest, OutputSpec, SamplingFields,
                      custom_input, custom_names, error_body, template_messages)
from .stream import TextStream, prediction_tokens
from .structured import StructuredOutputs
from .validation import describe_invalid


class Backend(Protocol):
    """Generates from token ids, calling `on_token(id)` per sampled token; returns 'stop' | 'length'.

    Optional: `vl_config` (an `M3VLConfig`) when it takes images, passed as `images=` (only to requests that
    have some); `supports_abort = True` when it takes `abort=` (a `threading.Event` the server sets when nobody
    waits for the answer any more; the backend then ends the request where it is and returns 'abort')."""

    def __call__(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_tokens: Sequence[int], seed: int, on_token: Callable[[int], None]) -> str: ...


class ModelBackend:
    """Runs `openm3.engine.generate` on one model (its device and dtype pick the kernels): a text model, or a VL
    model (`vl_config` set) that also takes images. chunk_size: prefill tokens per forward; an `abort` set
    meanwhile ends the request after the chunk in flight (or before its next token); cuda_graphs: as `generate`'s
    (False: decode steps run eagerly)."""

    supports_logprobs = True
    supports_constraints = True
    supports_abort = True

    takes_predictions = True  # `draft_context=`: a predicted output's tokens (`generate`'s draft_contexts)

    def __init__(self, model, speculative=None, chunk_size: int = 8192, cuda_graphs: bool | None = None):
        check_count("chunk_size", chunk_size)
        self.model, self.chunk_size = model, chunk_size
        self.cuda_graphs = cuda_graphs  # as `generate`'s (None: graphs on a CUDA device)
        self.speculative = speculative  # a SpeculativeConfig, or None
        self.vocab_size = text_model(model).config.vocab_size
        self.vl_config = model.config if is_vision_language(model) else None

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token,
                 images: PromptImages | None = None, logprobs: int | None = None,
                 on_logprobs: Callable[[float, list], None] | None = None, prompt_logprobs: int | None = None,
                 on_prompt_logprobs: Callable[[list], None] | None = None,
                 constraint: GrammarConstraint | None = None, draft_context: list[int] | None = None,
                 abort: threading.Event | None = None) -> str:
        from ..engine.generate import generate

        def check(_consumed: int = 0) -> None:
            if abort is not None and abort.is_set():
                raise _Aborted

        def token(_b: int, tok: int) -> None:
            check()
            on_token(tok)

        report = None if on_logprobs is None else (lambda _b, lp, top: on_logprobs(lp, top))
        report_prompt = None if on_prompt_logprobs is None else (lambda _b, entries: on_prompt_logprobs(entries))
        try:
            check()
            results, _ = generate(self.model, [prompt], max_new_tokens=max_new_tokens, sampling=sampling,
                                  stop_tokens=stop_tokens, seed=seed, on_token=token, chunk_size=self.chunk_size,
                                  cuda_graphs=self.cuda_graphs,
                                  on_prefill=None if abort is None else check,
                                  max_total_tokens=len(prompt) + max_new_tokens,
                                  images=None if images is None else [images], speculative=self.speculative,
                                  logprobs=logprobs, on_logprobs=report, prompt_logprobs=prompt_logprobs,
                                  on_prompt_logprobs=report_prompt, constraints=[constraint],
                                  draft_contexts=[draft_context])
        except _Aborted:
            return "abort"
        return results[0].finish_reason


def _openai_error_chunk(message: str, param: str | None, refused: bool) -> dict:
    """A stream's error event in OpenAI's form (`sse`): the request's error, or the server's."""
    return error_body(message, param, kind="invalid_request_error" if refused else "server_error")


class _Aborted(Exception):
    """Raised from `ModelBackend`'s callbacks to end `generate` once its request's abort is set."""


class APIError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error JSON naming `param`."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


REQUEST_ID_CHARS = 128  # a client's X-Request-Id longer than this is cut


class _Stop(Exception):
    """Raised from on_token to end a generation (a stop string was found, or the client went away)."""


def _think_ids(tokenizer) -> tuple[int, int] | None:
    """The think block's (start, end) token ids, None where the tokenizer has no single tokens for them."""
    try:
        return tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END)
    except (AttributeError, ValueError):
        return None


def _first_adjustment(req: SamplingFields) -> str:
    """The name of the first logits-adjusting field a request sets (for an error naming it)."""
    defaults = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "repetition_penalty": 1,
                "min_p": 0, "min_tokens": 0, "allowed_token_ids": None, "bad_words": None}
    return next(name for name, off in defaults.items() if getattr(req, name) not in (off, {}))


def create_app(backend: Backend, tokenizer, *, model_name: str, max_total_tokens: int, chat_template=None,
               model_aliases: Sequence[str] = (), default_template_variables: dict | None = None,
               default_sampling: dict | None = None,
               reasoning_parser: str = "m3", api_key: str | None = None, stored_responses: int = 1024,
               responses_dir: str | None = None, constrain_tool_calls: bool = False,
               video_frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP):
    """The FastAPI app serving `backend` under `model_name`; prompt + max_tokens may not exceed max_total_tokens.
    chat_template: the checkpoint's own template (`openm3.data.chat_template.ChatTemplate`) for the chat endpoints;
    None renders with openm3's built-in M3 template. model_aliases: more names requests may give the model (vLLM's
    several `--served-model-name`s; answers carry `model_name`), e.g. the fast model name an agent sends for its
    background requests; an unknown name is a 404. default_template_variables: vLLM's
    `--default-chat-template-kwargs`, the template's extra variables for every chat request (a request's own
    `chat_template_kwargs` and `reasoning_effort` override them; on Chat Completions `enable_thinking: false`
    among them keeps the think block shut, as the request's own would). default_sampling: the sampling a request
    gets for the fields it does not set (`generation_config.sampling_defaults`: a checkpoint's
    generation_config.json, as vLLM takes it; `max_new_tokens` is the default max_tokens). reasoning_parser: 'm3'
    splits the think block off the chat endpoints' answers (`reasoning.py`), 'none' leaves it in the text.
    api_key: as vLLM's `--api-key`, requests under `/v1` must carry it (`Authorization: Bearer KEY`, or
    Anthropic's `x-api-key: KEY`), else a 401.
    stored_responses: Responses API responses kept in memory for `previous_response_id` (the last ones; 0: none);
    responses_dir: a directory where they are kept on disk too, and read back at start (None: memory only).
    constrain_tool_calls: under `tool_choice` auto, every tool-call block the model opens follows the tools' call
    grammar (a custom tool's input its grammar), the text around stays free; each such request then picks its
    tokens on the host, as structured outputs do (slower steps; off by default, as vLLM leaves auto calls free).
    video_frames_per_clip: temporal patches per video clip for a VL backend, the span its vision tower was trained to
    attend over (a checkpoint's `video_preprocessor_config.json`; None: whole videos)."""
    from fastapi import FastAPI, Header, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    names = (model_name, *model_aliases)
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
        raise ValueError(f"model_name and model_aliases: expected distinct non-empty names, got {list(names)}")
    if reasoning_parser not in ("m3", "none"):
        raise ValueError(f"reasoning_parser: expected 'm3' or 'none', got {reasoning_parser!r}")
    try:
        default_template_variables = dict(check_template_variables(default_template_variables))
    except ValueError as e:
        raise ValueError(f"default_template_variables: {str(e).removeprefix('chat_template_kwargs: ')}") from None
    default_sampling = sampling_defaults(default_sampling or {}, where="default_sampling")
    if (default_sampling.get("repetition_penalty", 1.0) != 1.0 or default_sampling.get("min_p", 0.0) > 0) \
            and not getattr(backend, "supports_constraints", False):
        raise ValueError(f"default_sampling: this backend does not adjust logits, so it cannot apply "
                         f"repetition_penalty / min_p defaults ({default_sampling})")
    if not isinstance(max_total_tokens, int) or max_total_tokens < 2:
        raise ValueError(f"max_total_tokens must be an int >= 2, got {max_total_tokens!r}")
    if api_key is not None and not (isinstance(api_key, str) and api_key):
        raise ValueError("api_key: expected a non-empty string or None")
    if not isinstance(stored_responses, int) or isinstance(stored_responses, bool) or stored_responses < 0:
        raise ValueError(f"stored_responses: expected an int >= 0, got {stored_responses!r}")
    vocab = getattr(backend, "vocab_size", tokenizer.vocab_size)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    vl_config = getattr(backend, "vl_config", None)
    check_frames_per_clip(video_frames_per_clip, "video_frames_per_clip")
    think_ids = _think_ids(tokenizer)
    if vl_config is not None and vl_config.image_token_index != tokenizer.image_id:
        raise ValueError(f"tokenizer: its image placeholder ]<]image[>[ is token {tokenizer.image_id} but the "
                         f"model's image_token_index is {vl_config.image_token_index}")
    app = FastAPI(title="openm3", description="OpenAI- and Anthropic-compatible APIs over the openm3 engine")
    lock = threading.Lock()
    created = int(time.time())

    def _anthropic(request: Request) -> bool:
        """Answer in Anthropic's error form: its endpoints, and any request from its SDKs (which send
        `anthropic-version` with every call, e.g. `models.retrieve`)."""
        return request.url.path.startswith(anthropic.MESSAGES_PATH) or "anthropic-version" in request.headers

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if _anthropic(request):
            kind = "not_found_error" if exc.code == "model_not_found" else "invalid_request_error"
            return JSONResponse(anthropic.error_body(exc.message, kind),
                                status_code=404 if exc.code == "model_not_found" else exc.status)
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(NotUnicode)
    async def _not_unicode(request: Request, exc: NotUnicode):
        """A request string with a lone surrogate ("\\ud800" in its JSON) that reached the tokenizer outside a
        check naming its field: a 400 all the same."""
        return await _api_error(request, APIError(f"a string in the request is not valid Unicode: {exc}", None))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception):
        message = f"{type(exc).__name__}: {exc}"
        if _anthropic(request):
            return JSONResponse(anthropic.error_body(message, "api_error"), status_code=500)
        return JSONResponse(error_body(message, None, kind="server_error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """An unknown path or method in the API's own error form (not FastAPI's `{"detail": ...}`), naming it."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if _anthropic(request):
            body = anthropic.error_body(message, "not_found_error" if exc.status_code == 404 else
                                        "invalid_request_error")
        else:  # OpenAI's 404s are invalid_request_error too
            body = error_body(message, None)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = describe_invalid(exc.errors(), exc.body, request.headers.get("content-type"))
        if _anthropic(request):
            return JSONResponse(anthropic.error_body(message), status_code=400)
        return JSONResponse(error_body(message, param), status_code=400)

    @app.middleware("http")
    async def _authorized(request: Request, call_next):
        if api_key is None or request.method == "OPTIONS" or not request.url.path.startswith("/v1"):
            return await call_next(request)
        bearer = request.headers.get("authorization", "")
        given = bearer[len("Bearer "):] if bearer.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if hmac.compare_digest(given.encode(), api_key.encode()):
            return await call_next(request)
        message = "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"
        if _anthropic(request):
            return JSONResponse(anthropic.error_body(message, "authentication_error"), status_code=401)
        return JSONResponse(error_body(message, None, "invalid_api_key"), status_code=401)

    @app.get("/health")
    def health():
        """Liveness for load balancers and orchestrators (vLLM's route): 200 once the app serves requests."""
        return {"status": "ok"}

    served = collections.Counter()  # POST requests answered, by (path, status); unknown paths as "other"
    latency = RequestLatency(max_total_tokens)  # per-generation histograms for /metrics (vLLM's names)
    app.state.stats_log = StatsLog(latency, getattr(backend, "metrics", None))  # `openm3 serve` starts its thread

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        if request.method == "POST":
            routes = {r.path for r in app.routes if "POST" in getattr(r, "methods", ())}
            path = request.url.path if request.url.path in routes else "other"  # bounded label values
            served[(path, response.status_code)] += 1
        return response

    @app.middleware("http")  # outside the other HTTP middlewares: a 401 or a validation error carries it too
    async def _request_id(request: Request, call_next):
        """Every answer names its request, as OpenAI's (`x-request-id`, which its SDKs expose as `_request_id`) and
        Anthropic's (`request-id`) do: the client's `X-Request-Id` when it sent one (vLLM's
        `--enable-request-id-headers`), else a new `req_...` id, so a client's log line and the server's meet."""
        rid = request.headers.get("x-request-id", "")[:REQUEST_ID_CHARS] or f"req_{uuid.uuid4().hex}"
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        response.headers["request-id"] = rid
        return response

    @app.get("/metrics")
    def metrics():
        """Prometheus' text format (as vLLM's `/metrics`, names prefixed `openm3:`): requests by path and status,
        and the backend's own figures when it keeps some (`BatchedGenerator.metrics`: batch, tokens, prefix-cache
        hits, cache pages)."""
        from fastapi.responses import PlainTextResponse

        rows = [("http_requests_total", "counter", "POST requests answered, by path and status",
                 {f'path="{path}",status="{status}"': n for (path, status), n in sorted(served.items())})]
        rows += latency.rows()
        rows += backend.metrics() if hasattr(backend, "metrics") else []
        return PlainTextResponse(prometheus_text(rows), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    def version():
        from .. import __version__

        return {"version": __version__, "model": model_name}

    def model_card(name: str, anthropic_form: bool) -> dict:
        """One served name as OpenAI's model object, or as Anthropic's (whose SDKs send `anthropic-version`)."""
        if anthropic_form:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
            return {"type": "model", "id": name, "display_name": name, "created_at": stamp,
                    "max_input_tokens": max_total_tokens - 1, "max_tokens": max_total_tokens - 1}  # >= 1 new token
        return {"id": name, "object": "model", "created": created, "owned_by": "openm3", "root": model_name,
                "parent": None, "max_model_len": max_total_tokens}

    @app.get("/v1/models")
    def models(anthropic_version: str | None = Header(default=None)):
        cards = [model_card(n, anthropic_version is not None) for n in names]
        if anthropic_version is not None:
            return {"data": cards, "has_more": False, "first_id": names[0], "last_id": names[-1]}
        return {"object": "list", "data": cards}

    def check_model(name: str | None) -> None:
        """A 404 naming `model` for a name the server does not serve (None: not given, where that is allowed)."""
        if name is not None and name not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(f"model {name!r} does not exist; this server serves {served}", "model", status=404,
                           code="model_not_found")

    @app.get("/v1/models/{model_id:path}")  # `path`: a served name may hold a '/' (an org/model spelling)
    def model(model_id: str, anthropic_version: str | None = Header(default=None)):
        check_model(model_id)
        return model_card(model_id, anthropic_version is not None)

    def check(req: SamplingFields, prompt: list[int], prompt_param: str) -> int:
        """Validates the model name and the lengths; returns max_new_tokens (default: all the room left, or
        default_sampling's max_new_tokens where that is less). The request's unset sampling fields take
        default_sampling's values first."""
        for key, value in default_sampling.items():
            if key in type(req).model_fields and key not in req.model_fields_set:
                setattr(req, key, value)
        check_model(req.model)
        if len(prompt) >= max_total_tokens:
            raise APIError(f"{prompt_param} has {len(prompt)} tokens; the configured maximum is {max_total_tokens} "
                           f"tokens including at least one new token", prompt_param)
        room = max_total_tokens - len(prompt)
        max_new = req.max_tokens
        if max_new is None:
            max_new = min(room, default_sampling.get("max_new_tokens", room))
        if max_new > room:
            name = next((f for f in ("max_output_tokens", "max_completion_tokens") if f in req.model_fields_set),
                        "max_tokens")  # the field the request set
            raise APIError(f"{name}={max_new} exceeds the {room} tokens left of the configured maximum of "
                           f"{max_total_tokens} after the {len(prompt)} tokens of {prompt_param}", name)
        if isinstance(req, SamplingFields):
            check_adjustments(req)
        if getattr(req, "priority", 0) and getattr(backend, "scheduling", "fcfs") != "priority":
            raise APIError(f"priority: this server admits requests first come, first served; start it with "
                           f"--scheduling-policy priority to take priorities (got {req.priority})", "priority")
        if getattr(req, "thinking_budget", None) is not None:
            param = getattr(req, "thinking_param", "thinking")  # the field that asked for the budget
            if think_ids is None:
                raise APIError(f"this tokenizer has no single {THINK_START} / {THINK_END} tokens, so a thinking "
                               f"budget cannot be kept", param)
            if not getattr(backend, "supports_constraints", False):
                raise APIError("this server's backend does not adjust logits (a thinking budget)", param)
        return max_new

    def check_adjustments(req: SamplingFields) -> None:
        """A 400 naming the field for logit_bias / stop_token_ids ids outside the vocabulary, adjustments a
        backend cannot make, and ignore_eos beside a grammar (structured outputs, a forced call)."""
        try:
            penalties = req.penalties(tokenizer.encode)
        except ValueError as e:
            raise APIError(str(e), "logit_bias") from None
        for param, ids in (("logit_bias", [t for t, _ in penalties.logit_bias]),
                           ("stop_token_ids", req.stop_token_ids or []),
                           ("allowed_token_ids", penalties.allowed or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(f"{param}: token ids {bad} are outside the vocabulary (0..{vocab - 1})", param)
        held = {tokenizer.eos_id} | set(req.stop_token_ids or [])
        if req.min_tokens and (all(t in held for t in penalties.allowed) if penalties.allowed is not None
                               else len(held) >= vocab):
            raise APIError("min_tokens: every token this request allows is a stop token (the end-of-turn token and "
                           "stop_token_ids), so none could be picked before min_tokens", "min_tokens")
        if penalties.active and not getattr(backend, "supports_constraints", False):
            raise APIError("this server's backend does not adjust logits (penalties, logit_bias, min_tokens, "
                           "min_p, bad_words)", _first_adjustment(req))
        if req.ignore_eos:
            try:
                spec = req.output_spec()
            except ValueError:
                spec = None  # the constraint's own 400 names it
            if spec is not None:
                raise APIError("ignore_eos cannot be combined with structured outputs or a forced tool call (the "
                               "grammar decides where the answer ends)", "ignore_eos")

    def prompt_of(messages: list[dict], tools: list[dict] | None, param: str, prefill: str = "",
                  generation_prompt: bool = True, variables: dict | None = None
                  ) -> tuple[list[int], PromptImages | None]:
        """The conversation's prompt ids and images (`openm3.engine.media.chat_prompt`; variables: the template's
        extra ones); a 400 naming `param` if it is bad."""
        try:
            return chat_prompt(tokenizer, messages, tools, prefill=prefill, vl_config=vl_config,
                               template=chat_template, generation_prompt=generation_prompt,
                               frames_per_clip=video_frames_per_clip,
                               template_variables={**default_template_variables, **(variables or {})} or None)
        except ValueError as e:
            raise APIError(str(e), param) from None

    def chat_media(messages: list[dict]) -> None:
        """Chat Completions' image and video parts as the chat template's, in place; a 400 naming messages for a
        bad one or for any when the model takes none."""
        try:
            _media_parts(messages, vl_config is not None)
        except ValueError as e:
            raise APIError(str(e), "messages") from None

    def run(req: SamplingFields, prompt: list[int], max_new: int, stream: TextStream,
            on_part: Callable[[str, str], None], cancelled: threading.Event | None = None, *,
            images: PromptImages | None = None, on_start: Callable[[], None] | None = None,
            logprobs: TokenLogprobs | None = None, prompt_entries: PromptEntries | None = None,
            seed: int | None = None,
            constraint: GrammarConstraint | None = None, prediction: list[int] | None = None) -> str:
        """Generates (under the lock unless the backend is concurrent), feeding `stream` and calling
        `on_part(kind, text)` with its routed deltas (`TextStream.parts`); returns the finish reason ('stop' |
        'length'); an `APIError` (a 400) naming the field where the constraint finds no token to go on with
        (`GrammarDeadEnd`: a stream reports it as its error event). `images` go to the backend only when there
        are some. on_start(): called once, when the request's prompt is known to be admitted (`stream.cached` is
        then set) or at its first token, whichever the backend reports first. logprobs: collects each token's log
        probabilities (`logprobs_for` made it); prompt_entries: those of the prompt's tokens
        (`prompt_entries_for`). seed: the sampler's (default: the request's, else a random one). constraint: picks
        the tokens (structured outputs, `constraint_maker`).
        prediction: a predicted output's token ids (OpenAI's `prediction`), where a backend that
        `takes_predictions` looks speculative drafts up too (with a speculative config of its own or, if none,
        just for this request).

        The end-of-turn token `[e~[` is the stop token of every endpoint (not with `ignore_eos`), and so are a
        request's `stop_token_ids`; they are counted but not decoded. A request's logits adjustments
        (`SamplingFields.penalties`) pick its tokens around its constraint, if any (`PenalizedPicker`)."""
        sampling = SamplingParams(req.temperature, req.top_p, req.top_k)
        if cancelled is None:  # a non-streamed request: stopped when its client disconnects
            cancelled = client_gone()
        if seed is None:
            seed = req.seed if req.seed is not None else random.getrandbits(31)
        eos = tokenizer.eos_id
        stop_ids = [] if getattr(req, "ignore_eos", False) else [eos]
        stop_ids += [t for t in getattr(req, "stop_token_ids", None) or [] if t not in stop_ids]
        hidden = set(stop_ids) | {eos}
        penalties = req.penalties(tokenizer.encode) if isinstance(req, SamplingFields) else None
        budget = getattr(req, "thinking_budget", None)  # thinking / reasoning_effort "none" (checked by `check`)
        if budget is not None:
            penalties = dataclasses.replace(penalties or Penalties(), think=think_ids, think_budget=budget)
        if penalties is not None and penalties.active:
            constraint = PenalizedPicker(penalties, prompt, sorted(hidden), inner=constraint)

        started: list[bool] = []
        timer = latency.start(len(prompt))

        def start() -> None:
            if on_start is not None and not started:
                started.append(True)
                on_start()

        def on_cached(n: int) -> None:
            stream.cached = n
            timer.admitted()
            start()

        def on_token(tok: int) -> None:
            timer.token()
            start()
            stream.sampled += 1
            if tok in hidden and tok != eos:
                stream.stop_token = tok
            pieces = stream.parts(stream.push(tok)) if tok not in hidden else []
            if logprobs is not None:  # before the pieces go out: a streamed chunk takes the token's entry
                logprobs.on_token(tok, hidden, stream.decoded)
            for kind, text in pieces:
                on_part(kind, text)
            if stream.stopped or (cancelled is not None and cancelled.is_set()):
                raise _Stop

        extra = {} if images is None else {"images": images}
        if getattr(backend, "prefix_caching", False):
            extra["on_cached"] = on_cached
        if constraint is not None:
            extra["constraint"] = constraint
        if prediction and getattr(backend, "takes_predictions", False):
            extra["draft_context"] = prediction
        if logprobs is not None:
            extra.update(logprobs=logprobs.top, on_logprobs=logprobs.on_logprobs)
        if prompt_entries is not None:
            extra.update(prompt_logprobs=prompt_entries.top, on_prompt_logprobs=prompt_entries.on_prompt)
        if getattr(req, "priority", 0):  # `check` refused it unless the backend schedules by priority
            extra["priority"] = req.priority
        if cancelled is not None and getattr(backend, "supports_abort", False):
            extra["abort"] = cancelled  # ends it while it waits or prefills too, not only at its next token
        concurrent_ = getattr(backend, "concurrent", False)
        with contextlib.nullcontext() if concurrent_ else lock:
            try:
                if not concurrent_:  # one request at a time: the lock was its place in the queue
                    timer.admitted()
                if cancelled is not None and cancelled.is_set():  # given up on while it waited for the lock
                    return "stop"
                finish = backend(prompt, max_new_tokens=max_new, sampling=sampling, stop_tokens=stop_ids,
                                 seed=seed, on_token=on_token, **extra)
                return "stop" if finish == "abort" else finish
            except _Stop:
                return "stop"
            except GrammarDeadEnd as e:  # the request's grammar (or its masks) cannot be honoured: its 400 after all
                raise APIError(f"{e}; the answer so far: {stream.text[-200:]!r}",
                               e.field.split(".")[0] if e.field else None) from None
            finally:
                timer.end()
                start()

    def logprobs_for(top: int | None, param: str) -> TokenLogprobs | None:
        """A collector of `top` alternatives per token (None: none asked for); a 400 naming `param` when the
        backend computes no log probabilities."""
        if top is None:
            return None
        need_logprobs(param)
        return TokenLogprobs(tokenizer, top)

    def need_logprobs(param: str) -> None:
        """A 400 naming `param` when the backend computes no log probabilities."""
        if not getattr(backend, "supports_logprobs", False):
            raise APIError("this server's backend does not return log probabilities", param)

    def prompt_entries_for(req: SamplingFields, echo: TokenLogprobs | None = None) -> PromptEntries | None:
        """A collector of the prompt tokens' entries, for vLLM's `prompt_logprobs` and an echoed prompt's
        logprobs (`echo`, which has its own number of alternatives); None when neither is asked for."""
        tops = [t for t in (req.prompt_logprobs, echo.top if echo is not None else None) if t is not None]
        if not tops:
            return None
        if echo is None:
            need_logprobs("prompt_logprobs")
        return PromptEntries(max(tops), echo)

    structured = StructuredOutputs(tokenizer)

    def constraint_maker(spec_of: Callable[[], OutputSpec | None], param: str,
                         chat_prompt_ids: list[int] | None = None, prefill: str = "",
                         auto_calls: tuple[list[dict], bool] | None = None
                         ) -> Callable[[], GrammarConstraint | None]:
        """Makes each choice's constraint for what the answer must be (`structured.py`): `spec_of()` gives the
        `OutputSpec` (its ValueError becomes the 400; None: plain text, no constraint). A chat answer
        (`chat_prompt_ids` given) may open with its think block when the reasoning parser is on. prefill: the
        answer's given start (a continued final message, Anthropic's prefill), which each constraint reads first
        (no think block then); a 400 naming messages if the grammar refuses it. A 400 naming `param` for a spec
        the grammar cannot honour or a backend that cannot constrain; a tool definition the grammar refuses (its
        message starts "tools:") names `tools` instead, whichever field asked for the grammar (a forced call, an
        allowed_tools choice or `constrain_tool_calls`). auto_calls: (the tools as a forced call's grammar takes
        them, parallel calls allowed) of a request whose model may call them (`tool_choice` auto): with
        `constrain_tool_calls` (and a backend that constrains) each call block it opens follows their grammar, the
        text around stays free."""
        field = param  # named in errors: the field that gave the spec where it says (`guided_regex`), else param
        try:
            spec = spec_of()
            if spec is None and auto_calls is not None and auto_calls[0] and constrain_tool_calls \
                    and getattr(backend, "supports_constraints", False):
                spec = OutputSpec.auto_calls(*auto_calls)
            if spec is None:
                return lambda: None
            field = spec.field or param
            if not getattr(backend, "supports_constraints", False):
                raise ValueError("this server's backend does not constrain decoding (structured outputs)")
            think = reasoning_parser == "m3" and chat_prompt_ids is not None and not prefill
            make = structured.factory(spec, think=think, thinking=think and opens_think(chat_prompt_ids),
                                      field=field)
        except ValueError as e:
            message = str(e)
            if message.startswith("tools:"):  # the tools' definitions are at fault, not the field that used them
                field = "tools"
            raise APIError(message if message.startswith(f"{field}:") else f"{field}: {message}",
                           field.split(".")[0]) from None
        if not prefill:
            return make
        try:
            make().read(prefill.encode("utf-8"))
        except ValueError as e:
            raise APIError(f"messages: the answer's given start {e}", "messages") from None

        def made() -> GrammarConstraint:
            constraint = make()
            constraint.read(prefill.encode("utf-8"))
            return constraint

        return made

    def opens_think(prompt: list[int]) -> bool:
        """The prompt's generation prompt opens the think block (a checkpoint's template may)."""
        return tokenizer.decode(prompt[-3:]).rstrip().endswith(THINK_START)

    def text_stream(stop: Sequence[str], hold: Sequence[str], prompt: list[int], min_tokens: int = 0,
                    include_stop: bool = False) -> TextStream:
        """A chat answer's stream: its think block split off unless `reasoning_parser` is 'none'; a prompt whose
        generation prompt opens the block (a checkpoint's template may) starts inside it."""
        splitter = None
        if reasoning_parser == "m3":
            splitter = ReasoningSplitter(started=opens_think(prompt))
        return TextStream(tokenizer, stop, hold=hold, reasoning=splitter, min_tokens=min_tokens,
                          include_stop=include_stop)

    def truncated(req: SamplingFields, prompt: list[int], images: PromptImages | None = None) -> list[int]:
        """The prompt cut to its last `truncate_prompt_tokens` tokens (-1: as many as the configured maximum
        leaves beside max_tokens, or one new token); a 400 where the cut would drop part of a prompt with images
        (their placeholders must stay whole)."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == -1:
            keep = max(1, max_total_tokens - (req.max_tokens or 1))
        if keep >= len(prompt):
            return prompt
        if images is not None:
            raise APIError(f"truncate_prompt_tokens={req.truncate_prompt_tokens} would cut a {len(prompt)}-token "
                           f"prompt with images; send it without them or uncut", "truncate_prompt_tokens")
        return prompt[len(prompt) - keep:]

    def final_message_prefill(req: ChatCompletionRequest, messages: list[dict]) -> str:
        """vLLM's continue_final_message: the final message (an assistant's text, taken off `messages`) the answer
        continues; '' without it. A 400 naming the field for a final message of another kind, or beside an
        explicit add_generation_prompt: true (vLLM refuses both)."""
        if not req.continue_final_message:
            return ""
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                           "continue_final_message")
        last = messages[-1]
        content = last.get("content")
        if isinstance(content, list) and all(part.get("type") == "text" for part in content):
            content = "".join(part["text"] for part in content)
        if last["role"] != "assistant" or last.get("tool_calls") or not isinstance(content, str):
            raise APIError("continue_final_message needs the final message to be an assistant's text",
                           "continue_final_message")
        messages.pop()
        return content

    def usage(prompts: list[list[int]], streams: list[TextStream], prediction: list[int] | None = None) -> dict:
        """OpenAI's usage of a request whose prompts got `len(streams) // len(prompts)` choices each (prompt i's are
        streams i*n .. i*n+n-1): each prompt counts once, every choice's tokens count; a prompt's cached tokens are
        its choices' most. prediction: a predicted output's tokens, whose accepted and rejected tokens
        (`prediction_tokens`, against each choice's text encoded again, so sampled tokens that spell the same text
        differently still match) are summed over the choices; unlike OpenAI, rejected ones are not billed as
        completion tokens (they were never generated)."""
        n = len(streams) // len(prompts)
        sampled = sum(stream.sampled for stream in streams)
        given = sum(len(prompt) for prompt in prompts)
        cached = sum(max(stream.cached for stream in streams[i * n:(i + 1) * n]) for i in range(len(prompts)))
        counts = {"prompt_tokens": given, "completion_tokens": sampled, "total_tokens": given + sampled,
                  "prompt_tokens_details": {"cached_tokens": cached}}
        if prediction is not None:
            kept = [prediction_tokens(prediction, tokenizer.encode(stream.text)) for stream in streams]
            counts["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in kept),
                                                   "rejected_prediction_tokens": sum(r for _, r in kept)}
        return counts

    def usage_chunks(req: SamplingFields, put: Callable[[dict], None], prompts: list[list[int]],
                     streams: list[TextStream]) -> Callable[[dict], None]:
        """`put` for a stream's chunks: with vLLM's `stream_options.continuous_usage_stats` each chunk also
        carries the usage so far (prompt, completion and total tokens), else `put` itself."""
        if not (req.stream_options and req.stream_options.continuous):
            return put

        def put_with_usage(body: dict) -> None:
            counts = usage(prompts, streams)
            put({**body, "usage": {k: counts[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}})

        return put_with_usage

    def choice_seeds(req: SamplingFields, count: int) -> list[int]:
        """Each choice's sampler seed: the request's seed plus the choice's index (so choices differ, and the
        same request with its seed gets the same choices again), else random ones."""
        if req.seed is None:
            return [random.getrandbits(31) for _ in range(count)]
        return [req.seed + k for k in range(count)]

    def each_choice(jobs: list[Callable[[threading.Event], str]], cancelled: threading.Event | None = None) -> list:
        """Runs one job per choice, `job(cancelled)`: all at once on a concurrent backend (the engine decodes them
        together), one after another otherwise; returns their results in order. When one fails the others are
        cancelled, and its exception is raised once they have ended."""
        if cancelled is None:  # a non-streamed request's: set when its client disconnects, or by a failed choice
            cancelled = client_gone() or threading.Event()

        def guarded(job):
            try:
                return job(cancelled)
            except BaseException:
                cancelled.set()
                raise

        if len(jobs) == 1 or not getattr(backend, "concurrent", False):
            return [guarded(job) for job in jobs]
        with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="openm3-choice") as pool:
            futures = [pool.submit(guarded, job) for job in jobs]
        return [future.result() for future in futures]

    def sse(produce: Callable[[Callable[[dict], None], threading.Event], None], named_events: bool = False,
            error_chunk: Callable[[str, str | None, bool], dict] | None = None) -> StreamingResponse:
        """Streams the chunks `produce(put, cancelled)` puts (it runs in a worker thread) as SSE events: Chat
        Completions' `data:` lines closed by `[DONE]`, or events named by each chunk's `type` (Anthropic's
        Messages, OpenAI's Responses). A failure after the status line is sent is reported in the stream as
        `error_chunk(message, param, refused)` (default: OpenAI's error body): refused, an `APIError` that would
        have been the request's 400 (a grammar's dead end, `run`), else the server's error.

        The events are read on the server's event loop (no thread waits on them), so a client that disconnects
        is noticed at once, while its request still waits for a place or prefills, not only at its next chunk:
        `cancelled` is set, which ends the generation wherever it is (`run` passes it on as the backend's
        `abort`)."""
        cancelled = threading.Event()

        async def events() -> AsyncIterator[str]:
            loop = asyncio.get_running_loop()
            chunks: asyncio.Queue = asyncio.Queue()

            def put(chunk: dict | None) -> None:  # from the generating threads
                try:
                    loop.call_soon_threadsafe(chunks.put_nowait, chunk)
                except RuntimeError:  # the event loop is closed (the server stopped): nobody reads this stream
                    cancelled.set()

            def work() -> None:
                try:
                    produce(put, cancelled)
                except Exception as e:  # the status line is sent already: report in the stream
                    refused = isinstance(e, APIError)
                    message, param = (e.message, e.param) if refused else (f"generation failed: {e}", None)
                    put((error_chunk or _openai_error_chunk)(message, param, refused))
                finally:
                    put(None)

            threading.Thread(target=work, daemon=True).start()
            try:
                while (chunk := await chunks.get()) is not None:
                    if named_events:
                        yield f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n"
                    else:
                        yield f"data: {json.dumps(chunk)}\n\n"
                if not named_events:
                    yield "data: [DONE]\n\n"
            finally:
                cancelled.set()  # the client disconnected or the stream ended: stop generating

        return StreamingResponse(events(), media_type="text/event-stream")

    def completion_ids(prompt: str | list[int], param: str) -> list[int]:
        """A Completions prompt's ids (text is encoded); a 400 naming `param` for ids outside the vocabulary."""
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise APIError(f"{param}: token ids must lie in [0, {vocab})", param)
        return list(prompt)

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        batch = len(req.prompts)
        if req.n * batch > MAX_CHOICES:
            raise APIError(f"n={req.n} choices for each of {batch} prompts make {req.n * batch} generations; at "
                           f"most {MAX_CHOICES} per request", "n")
        scoring = req.max_tokens == 0  # the prompt scored, nothing generated (OpenAI's legacy form)
        if scoring and not req.echo:
            raise APIError("max_tokens: 0 scores the prompt alone and needs echo: true", "max_tokens")
        given = [completion_ids(p, "prompt" if batch == 1 else f"prompt[{i}]") for i, p in enumerate(req.prompts)]
        prompts = [truncated(req, ids) for ids in given]
        sent = [text if len(ids) == len(kept) else kept for text, ids, kept in zip(req.prompts, given, prompts)]
        max_news = [check(req, prompt, "prompt" if batch == 1 else f"prompt[{i}]") for i, prompt in enumerate(prompts)]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_name}
        def choice(k: int) -> CompletionChoice:
            lp = logprobs_for(req.logprobs, "logprobs")
            stream = TextStream(tokenizer, req.stop, min_tokens=req.min_tokens,
                                include_stop=req.include_stop_str_in_output)
            return CompletionChoice(k, prompts[k // req.n], sent[k // req.n], stream, lp, req.echo,
                                    req.prompt_logprobs, prompt_entries_for(req, lp if req.echo else None))

        choices = [choice(k) for k in range(req.n * batch)]
        seeds = choice_seeds(req, len(choices))
        constrain = constraint_maker(req.output_spec, "response_format")

        def job(c: CompletionChoice, on_part: Callable[[str, str], None]) -> Callable[[threading.Event], str]:
            def go(cancelled: threading.Event) -> str:
                finish = run(req, c.prompt, max(1, max_news[c.index // req.n]), c.stream,
                             (lambda _k, _t: None) if scoring else on_part, cancelled, logprobs=c.logprobs,
                             prompt_entries=c.prompt_entries, seed=seeds[c.index], constraint=constrain())
                if not scoring:
                    return finish
                c.drop_answer()  # the engine's one new token is not part of a scoring answer
                return "length"
            return go

        if not req.stream:
            finishes = each_choice([job(c, lambda _k, _t: None) for c in choices])
            return {**head, "choices": [c.body(c.stream.text, finish) for c, finish in zip(choices, finishes)],
                    "usage": usage(prompts, [c.stream for c in choices])}

        def produce(put, cancelled) -> None:
            last_put, put = put, usage_chunks(req, put, prompts, [c.stream for c in choices])

            def streamed(c: CompletionChoice) -> Callable[[threading.Event], str]:
                run_it = job(c, lambda _k, delta: put({**head, "choices": [c.body(delta, None)]}))

                def whole(cancelled: threading.Event) -> str:
                    finish = run_it(cancelled)
                    put({**head, "choices": [c.body(c.stream.finish(), finish)]})
                    return finish

                return whole

            each_choice([streamed(c) for c in choices], cancelled)
            if req.stream_options and req.stream_options.include_usage:
                last_put({**head, "choices": [], "usage": usage(prompts, [c.stream for c in choices])})

        return sse(produce)

    @app.post("/v1/chat/completions")
    def chat_completions(req: ChatCompletionRequest):
        if default_template_variables:  # under the request's own (its thinking budget sees both)
            defaults = {k: v for k, v in default_template_variables.items()
                        if k != "reasoning_effort" or req.reasoning_effort is None}
            req.chat_template_kwargs = {**defaults, **(req.chat_template_kwargs or {})}
        if req.max_completion_tokens is not None:
            if req.max_tokens not in (None, req.max_completion_tokens):
                raise APIError("give max_tokens or max_completion_tokens, not two different values",
                               "max_completion_tokens")
            req.max_tokens = req.max_completion_tokens
        messages = template_messages(req.messages)
        tools = [t.template_tool() for t in req.tools] if req.tools else None
        chat_media(messages)
        prefill = final_message_prefill(req, messages)
        prompt, images = prompt_of(messages, tools, "messages", prefill,
                                   generation_prompt=req.add_generation_prompt or req.continue_final_message,
                                   variables=req.template_variables())
        prompt = truncated(req, prompt, images)
        max_new = check(req, prompt, "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name}
        parse_calls = req.tool_choice != "none"
        custom = custom_names(req.tools)
        streams = [text_stream(req.stop, [TOOL_CALL_START] if parse_calls else [], prompt, req.min_tokens,
                               req.include_stop_str_in_output) for _ in range(req.n)]
        lps = [logprobs_for((req.top_logprobs or 0) if req.logprobs else None, "logprobs") for _ in range(req.n)]
        seeds = choice_seeds(req, req.n)
        constraint_param = "tool_choice" if req.tool_choice not in (None, "auto", "none") else "response_format"
        auto = ([t.call_tool() for t in req.tools], req.parallel_tool_calls) \
            if req.tools and req.tool_choice in (None, "auto") else None
        constrain = constraint_maker(req.output_spec, constraint_param, prompt, prefill, auto)
        prediction = tokenizer.encode(req.prediction.text()) if req.prediction is not None else None
        if prediction is not None and len(prediction) > max_total_tokens:
            raise APIError(f"prediction has {len(prediction)} tokens; at most the configured maximum of "
                           f"{max_total_tokens} tokens can be predicted", "prediction")

        def answer(k: int, finish: str) -> tuple[str, list[dict], str]:
            """(choice k's whole text, OpenAI tool_calls, finish_reason) once its generation has finished."""
            stream = streams[k]
            tail = stream.text[len(stream.visible()):]
            calls = parse_tool_calls(tail, custom) if parse_calls and not stream.stopped else []
            calls = calls if req.parallel_tool_calls else calls[:1]
            if not calls:
                return stream.text, [], finish
            return stream.visible(), [chat_tool_call(c, custom) for c in calls], "tool_calls"

        scored = prompt_entries_for(req)  # vLLM's prompt_logprobs: computed with the first choice

        def job(k: int, on_part: Callable[[str, str], None]) -> Callable[[threading.Event], str]:
            return lambda cancelled: run(req, prompt, max_new, streams[k], on_part, cancelled, images=images,
                                         logprobs=lps[k], prompt_entries=scored if k == 0 else None, seed=seeds[k],
                                         constraint=constrain(), prediction=prediction)

        def message_choice(k: int, finish: str) -> dict:
            whole, tool_calls, finish = answer(k, finish)
            reasoning, content = streams[k].split(whole)
            message = {"role": "assistant", "content": content or (None if tool_calls else "")}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": k, "message": message, "finish_reason": finish,
                      "stop_reason": None if tool_calls else streams[k].stop_reason}
            if lps[k] is not None:  # the message text's tokens (not the reasoning's or the calls' markup)
                choice["logprobs"] = lps[k].chat(lps[k].take(streams[k].settle(whole, bool(tool_calls))))
            return choice

        if not req.stream:
            finishes = each_choice([job(k, lambda _k, _t: None) for k in range(req.n)])
            body = {**head, "choices": [message_choice(k, finish) for k, finish in enumerate(finishes)],
                    "usage": usage([prompt], streams, prediction)}
            if scored is not None:  # top level, as vLLM puts it for chat
                body["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, prompt, scored.entries,
                                                               req.prompt_logprobs)
            return body

        head = {**head, "object": "chat.completion.chunk"}

        def chunk(k: int, delta: dict, finish: str | None = None) -> dict:
            choice = {"index": k, "delta": delta, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None if finish == "tool_calls" else streams[k].stop_reason
            if lps[k] is not None:  # the message text's tokens sampled since the choice's last chunk
                choice["logprobs"] = lps[k].chat(lps[k].take(streams[k].content_span()))
            return {**head, "choices": [choice]}

        def produce(put, cancelled) -> None:
            last_put, put = put, usage_chunks(req, put, [prompt], streams)

            def streamed(k: int) -> Callable[[threading.Event], str]:
                def part(kind: str, text: str) -> None:
                    put(chunk(k, {"reasoning_content" if kind == "reasoning" else "content": text}))

                run_it = job(k, part)

                def whole(cancelled: threading.Event) -> str:
                    put(chunk(k, {"role": "assistant", "content": ""}))
                    text, tool_calls, finish = answer(k, run_it(cancelled))
                    streams[k].settle(text, bool(tool_calls))
                    for kind, piece in streams[k].end_parts(text):
                        part(kind, piece)
                    if tool_calls:
                        put(chunk(k, {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}))
                    put(chunk(k, {}, finish))
                    return finish

                return whole

            each_choice([streamed(k) for k in range(req.n)], cancelled)
            if req.stream_options and req.stream_options.include_usage:
                last_put({**head, "choices": [], "usage": usage([prompt], streams, prediction)})

        return sse(produce)

    shared = dict(tokenizer=tokenizer, model_name=model_name, check=check, run=run, sse=sse, api_error=APIError,
                  text_stream=text_stream, prompt_of=prompt_of, constraint_maker=constraint_maker,
                  takes_images=vl_config is not None)
    anthropic.add_messages_routes(app, **shared, check_model=check_model)
    responses.add_responses_routes(app, **shared, check_model=check_model, logprobs_for=logprobs_for,
                                   store=responses.ResponseStore(stored_responses, responses_dir))
    tokens.add_token_routes(app, tokenizer=tokenizer, check_model=check_model, max_total_tokens=max_total_tokens,
                            vocab=vocab, prompt_of=prompt_of, api_error=APIError, check_images=chat_media)
    app.add_middleware(DisconnectWatch)  # outermost: the endpoints below it see client_gone()
    return app


class CompletionChoice:
    """One choice of a Completions request: its index, prompt (ids, and as sent), text stream, log probabilities
    (None: not asked for) and, with echo, the prompt text still to be sent before its first text."""

    def __init__(self, index: int, prompt: list[int], sent: str | list[int], stream: TextStream,
                 logprobs: TokenLogprobs | None, echo: bool, prompt_logprobs: int | None = None,
                 prompt_entries: PromptEntries | None = None):
        self.index, self.prompt, self.stream, self.logprobs = index, prompt, stream, logprobs
        self.echo = [sent if isinstance(sent, str) else stream.tokenizer.decode(prompt)] if echo else []
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: alternatives per prompt token (None: not asked)
        self.prompt_entries = prompt_entries  # what the backend reports of the prompt's tokens (echo and that field)

    def drop_answer(self) -> None:
        """Forgets what was generated (a scoring request, `max_tokens: 0`): no text, no entries, no tokens counted."""
        self.stream = TextStream(self.stream.tokenizer)
        if self.logprobs is not None:
            self.logprobs.take()

    def body(self, text: str, finish: str | None) -> dict:
        """The choice (or a streamed chunk's) with `text`, after the echoed prompt if it is not sent yet."""
        lp = self.logprobs
        logprobs = lp.completion((lp.echoed(self.prompt) if self.echo else []) + lp.take()) if lp else None
        if self.echo:
            text = self.echo.pop() + text
        out = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = self.stream.stop_reason
            if self.prompt_logprobs is not None:  # never streamed (refused with stream), so on the whole choice
                out["prompt_logprobs"] = vllm_prompt_logprobs(self.stream.tokenizer, self.prompt,
                                                              self.prompt_entries.entries, self.prompt_logprobs)
        return out


def chat_tool_call(call: dict, custom: frozenset[str]) -> dict:
    """A parsed call (`parse_tool_calls`) as a Chat Completions tool call: a function's, or a custom tool's
    (`type: "custom"`) holding its input text."""
    head = {"id": f"call_{uuid.uuid4().hex[:24]}"}
    if call["name"] not in custom:
        return {**head, "type": "function", "function": {"name": call["name"],
                                                         "arguments": json.dumps(call["arguments"])}}
    return {**head, "type": "custom", "custom": {"name": call["name"], "input": custom_input(call["arguments"])}}


def _media_parts(messages: list[dict], takes_images: bool) -> None:
    """Turns Chat Completions' `image_url` (and vLLM's `video_url`) parts into the chat template's image (video)
    parts, refusing them by name when the model takes no images, and `file` parts into their text (a PDF's text
    layer, a text file: `documents.py`), in place."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part["type"]
            where = f"messages[{i}].content[{j}]"
            if kind == "file":
                parts += openai_file_parts(part["file"], f"{where}.file")
            elif kind in ("image_url", "video_url"):
                if not takes_images:
                    raise ValueError(f"{where}: {kind!r} parts are not supported by this server (text-only model)")
                parts.append(data_url_part(part[kind]["url"], where, f"{kind}.url", video=kind == "video_url"))
            else:
                parts.append(part)
        content[:] = parts
