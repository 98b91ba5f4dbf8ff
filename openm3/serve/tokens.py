"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's or a conversation's token ids as the server would feed
them (a chat renders through the same template and image handling as `/v1/chat/completions`, so `count` is the
prompt length that request would have), and the text of token ids. Clients use them to count tokens against
`max_model_len` before sending a request.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, Field, StrictBool, field_validator, model_validator

from .schemas import (ChatCustomTool, ChatMessage, Integer, TemplateVariables, Tool, client_tools,
                      template_messages)


class TokenizeRequest(TemplateVariables):
    """Either `prompt` (text, encoded as Completions encodes it) or `messages` (with `tools` and
    `chat_template_kwargs`, rendered as Chat Completions renders them; `add_generation_prompt` false leaves the
    assistant's opening off).
    `return_token_strs`: each token's text too. `add_special_tokens` is accepted (openm3's tokenizer adds none)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool | ChatCustomTool] | None = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_models(cls, v: Any) -> Any:
        return client_tools(v, Tool, ChatCustomTool)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, not both or neither")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Integer]


def add_token_routes(app, *, tokenizer, check_model: Callable, max_total_tokens: int, vocab: int,
                     prompt_of: Callable, api_error: Callable, check_images: Callable) -> None:
    """Registers `/tokenize` and `/detokenize` on `app` (`check_model`, `prompt_of`, `check_images`:
    `create_app`'s model-name check, chat prompt building and image-part check)."""

    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if req.prompt is not None:
            ids = tokenizer.encode(req.prompt)
        else:
            messages = template_messages(req.messages)
            tools = [t.template_tool() for t in req.tools] if req.tools else None
            check_images(messages)
            ids, _ = prompt_of(messages, tools, "messages", generation_prompt=req.add_generation_prompt,
                               variables=req.template_variables())
        return {"count": len(ids), "max_model_len": max_total_tokens, "tokens": ids,
                "token_strs": [tokenizer.decode([t]) for t in ids] if req.return_token_strs else None}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise api_error(f"tokens: ids {bad[:8]} are outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}
