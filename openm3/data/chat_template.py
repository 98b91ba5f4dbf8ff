"""A checkpoint's own chat template (Jinja), rendered as transformers' `apply_chat_template` renders it.

A model is trained on one rendering of conversations; served with another, it answers worse. openm3's built-in
renderer (`openm3.data.chat.render_chat`) is the template of the models openm3 trains, whose exports carry the same
template as `chat_template.jinja`. A released checkpoint carries its own, as `chat_template.jinja` or under
`chat_template` in `tokenizer_config.json` beside its `tokenizer.json`; `openm3 serve` and `openm3 generate` render
prompts with it when there is one (`--chat-template`).

The environment is transformers' (needs `jinja2`, in the `serve` extra): a sandbox, `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}` tag, `tojson` without HTML escaping,
`raise_exception` and `strftime_now`, and the tokenizer config's special tokens (`bos_token`, `eos_token`, ...) as
variables. Messages are the OpenAI-style dicts `render_chat` takes (image and video parts included: the template
writes their markers, which the prompt builder then expands into placeholder runs).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """A Jinja chat template. `ChatTemplate(source)(messages, tools, add_generation_prompt=True)` -> the prompt
    text. `special_tokens`: template variables such as `bos_token` (transformers passes the tokenizer's)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str = "template"):
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{origin}: a chat template must be a non-empty string")
        self.origin, self.source = origin, source
        self.special_tokens = dict(special_tokens or {})
        jinja2 = _jinja2()
        try:
            self._template = _environment(jinja2).from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"{origin}: not a valid Jinja template (line {err.lineno}: {err.message})") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> "ChatTemplate | None":
        """The template stored in `directory` (see `read_template`), or None when it has none."""
        found = read_template(directory)
        return None if found is None else cls(found[0], found[1], origin=found[2])

    def __call__(self, messages: list[dict], tools: list[dict] | None = None, *,
                 add_generation_prompt: bool = True, variables: dict[str, Any] | None = None) -> str:
        """variables: more template variables (vLLM's `chat_template_kwargs`, transformers' extra keyword
        arguments of `apply_chat_template`: `enable_thinking`, `reasoning_effort`, ...); see
        `check_template_variables`."""
        jinja2 = _jinja2()
        extra = check_template_variables(variables, self.special_tokens)
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens,
                                         **extra)
        except jinja2.TemplateError as err:  # raise_exception() of the template, or an error in it
            raise ValueError(f"messages: the chat template ({self.origin}) refused them: {err}") from None


RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception",
                                "strftime_now"})


def check_template_variables(variables: dict[str, Any] | None,
                             special_tokens: dict[str, str] | None = None) -> dict[str, Any]:
    """`variables` (None: none) checked as extra template variables: a dict whose keys are identifiers other than
    the ones the renderer sets itself (`RESERVED_VARIABLES`, the special tokens). Returns it; ValueError naming
    `chat_template_kwargs` otherwise."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise ValueError(f"chat_template_kwargs: expected an object of template variables, got "
                         f"{type(variables).__name__}")
    taken = RESERVED_VARIABLES | set(special_tokens or ()) | set(_SPECIAL)
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in taken:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the renderer itself (messages, tools and "
                             f"add_generation_prompt come from the conversation and the request's own fields)")
    return variables


def parse_json_option(text: str, option: str) -> Any:
    """A command-line option's JSON value; ValueError naming `option` and where the JSON breaks."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}: not valid JSON ({e.msg} at character {e.pos})") from None


def parse_template_variables(text: str | None, option: str) -> dict[str, Any] | None:
    """A command line's template variables (`--chat-template-kwargs`, `--default-chat-template-kwargs`): a JSON
    object, checked as `check_template_variables` checks them; None for None. ValueError naming `option`."""
    if text is None:
        return None
    variables = parse_json_option(text, option)
    try:
        return check_template_variables(variables)
    except ValueError as e:
        raise ValueError(f"{option}: {str(e).removeprefix('chat_template_kwargs: ')}") from None


def _jinja2():
    try:
        import jinja2
    except ImportError:
        raise ImportError("a checkpoint's chat template needs the PyPI package 'jinja2' (in the serve extra: "
                          "pip install 'openm3[serve]'), or --chat-template builtin") from None
    return jinja2


def _environment(jinja2):
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens for training masks in
        transformers; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def read_template(directory: str | Path) -> tuple[str, dict[str, str], str] | None:
    """(source, special tokens, where it was found) of the chat template stored in `directory`:
    `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates,
    of which 'default'); the special tokens come from `tokenizer_config.json`. None when there is none."""
    root = Path(directory)
    config: dict = {}
    if (root / TOKENIZER_CONFIG).is_file():
        try:
            config = json.loads((root / TOKENIZER_CONFIG).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{root / TOKENIZER_CONFIG}: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{root / TOKENIZER_CONFIG}: expected a JSON object")
    special = {}
    for name in _SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    if (root / TEMPLATE_FILE).is_file():
        return (root / TEMPLATE_FILE).read_text(), special, str(root / TEMPLATE_FILE)
    source = config.get("chat_template")
    origin = f"{root / TOKENIZER_CONFIG}: chat_template"
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{origin}: a list of templates needs one named 'default', got {sorted(map(str, named))}")
        source = named["default"]
    return None if source is None else (source, special, origin)
