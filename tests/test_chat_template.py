"""A checkpoint's own chat template: rendered as transformers 5.24.0's `apply_chat_template` renders it, found
beside the tokenizer, and used by `openm3 serve` / `openm3 generate` in place of the built-in renderer."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from openm3.data.chat import CHAT_TEMPLATE, render_chat
from openm3.data.chat_template import ChatTemplate, read_template
from openm3.data.tokenizer import BOS, TokenizerSettings, get_tokenizer
from openm3.engine.generate import chat_template

# A template in another family's style, using what released templates use: special-token variables, the
# `{% generation %}` tag, namespaces, loop controls, `tojson` with options, `raise_exception`.
CHATML = """{%- set ns = namespace(system=false) -%}
{{- bos_token -}}
{%- if tools %}<|tools|>{{ tools | tojson(indent=2) }}<|end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role not in ["system", "user", "assistant", "tool"] -%}
{{- raise_exception("unknown role " + m.role) -}}
{%- endif -%}
{%- if m.role == "system" %}{% set ns.system = true %}{% endif -%}
<|{{ m.role }}|>
{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}
{%- if p.type == "text" %}{{ p.text }}{% elif p.type == "image" %}]<]image[>[{% else %}{% continue %}{% endif %}
{%- endfor %}{% endif -%}
{%- if m.role == "assistant" %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% if not ns.system %}(no system){% endif %}{% endif -%}"""

TOOL = {"type": "function", "function": {"name": "add", "description": "Sum ünï.", "parameters": {"type": "object"}}}
CONVERSATIONS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünï 🚀 <b>"},
      {"role": "assistant", "content": "Hello."}], None),
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]}], None),
    ([{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}], [TOOL]),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000),
                         tmp_path_factory.mktemp("tok-cache"))


def _with_template(tok, path, template: str | None, *, in_config: bool = False):
    """`tok` saved to `path` (tokenizer.json, tokenizer_config.json, chat_template.jinja), its template replaced by
    `template` (in tokenizer_config.json with `in_config`; none at all for None)."""
    tok.save(path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None and in_config:
        config["chat_template"] = template
    elif template is not None:
        (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name", ["openm3", "chatml"])
def test_renders_as_transformers_renders(tok, tmp_path, name):
    from transformers import AutoTokenizer

    path = _with_template(tok, tmp_path / name, CHAT_TEMPLATE if name == "openm3" else CHATML)
    ours = ChatTemplate.from_dir(path)
    hf = AutoTokenizer.from_pretrained(str(path))
    for messages, tools in CONVERSATIONS:
        for gen in (False, True):
            want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert ours(messages, tools, add_generation_prompt=gen) == want
            if name == "openm3":
                assert want == render_chat(messages, tools, add_generation_prompt=gen)
    if name == "chatml":
        assert ours(*CONVERSATIONS[0]).startswith("]~!b[<|system|>Be brief.")  # bos_token from tokenizer_config
        with pytest.raises(ValueError, match="refused them: unknown role robot"):
            ours([{"role": "robot", "content": "x"}])


# A template that reads the variables released templates take from `apply_chat_template`'s keyword arguments
THINKING = """{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>
{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif -%}
{%- if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif -%}
{%- endif -%}"""


def test_template_variables_render_as_transformers_renders_them(tok, tmp_path):
    """Extra variables (transformers' keyword arguments, vLLM's chat_template_kwargs) reach the template as
    transformers passes them; names the renderer sets itself and non-names are refused."""
    from transformers import AutoTokenizer

    path = _with_template(tok, tmp_path / "thinking", THINKING)
    ours, hf = ChatTemplate.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "Hi"}]
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True, "reasoning_effort": "low"}):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
        assert ours(messages, variables=variables) == want
    assert ours(messages, variables={"enable_thinking": False}).endswith("<|assistant|><think></think>")
    for bad, why in (({"messages": []}, "set by the renderer"), ({"bos_token": "x"}, "set by the renderer"),
                     ({"add_generation_prompt": False}, "set by the renderer"), ({"a-b": 1}, "not a template variable"),
                     (["x"], "expected an object")):
        with pytest.raises(ValueError, match=f"chat_template_kwargs: .*{why}"):
            ours(messages, variables=bad)


def test_finding_the_template(tok, tmp_path):
    assert read_template(_with_template(tok, tmp_path / "none", None)) is None
    in_config = _with_template(tok, tmp_path / "config", CHATML, in_config=True)
    assert read_template(in_config)[0] == CHATML
    both = _with_template(tok, tmp_path / "both", "file wins", in_config=False)
    config = json.loads((both / "tokenizer_config.json").read_text())
    (both / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    assert read_template(both)[0] == "file wins"
    named = _with_template(tok, tmp_path / "named", [{"name": "tool_use", "template": "T"},
                                                     {"name": "default", "template": CHATML}], in_config=True)
    assert read_template(named)[0] == CHATML
    bad = _with_template(tok, tmp_path / "bad", [{"name": "tool_use", "template": "T"}], in_config=True)
    with pytest.raises(ValueError, match="needs one named 'default'"):
        read_template(bad)
    broken = _with_template(tok, tmp_path / "broken", "{% if %}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: not a valid Jinja template"):
        ChatTemplate.from_dir(broken)


def test_chat_template_option(tok, tmp_path):
    """--chat-template: auto takes the tokenizer directory's template, except openm3's own (the built-in renderer,
    which renders the same and checks the messages); builtin ignores it; a path names a file."""
    own = tok.save(tmp_path / "own")
    assert chat_template("auto", str(own)) is None
    foreign = _with_template(tok, tmp_path / "foreign", CHATML) / "tokenizer.json"
    assert chat_template("auto", str(foreign)).source == CHATML
    assert chat_template("builtin", str(foreign)) is None
    assert chat_template("auto", None) is None
    assert chat_template(str(foreign.parent / "chat_template.jinja"), None).source == CHATML
    with pytest.raises(ValueError, match="--chat-template: expected auto, builtin or a template file"):
        chat_template("chatml", str(foreign))


def test_serve_renders_prompts_with_the_checkpoint_template(tok, tmp_path):
    """The chat endpoints (OpenAI's and Anthropic's) prompt the model with the tokenizer directory's template; a
    request the template refuses is a 400."""
    from test_serve import Scripted

    from openm3.serve import create_app

    path = _with_template(tok, tmp_path / "tok", CHATML)
    backend = Scripted([tok.eos_id], tok.vocab_size)
    app = create_app(backend, tok, model_name="m", max_total_tokens=512,
                     chat_template=chat_template("auto", str(path / "tokenizer.json")))
    client = TestClient(app)
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = client.post("/v1/messages", json={"model": "m", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    want = tok.encode(ChatTemplate(CHATML, {"bos_token": BOS})(messages))
    assert backend.prompts == [want, want]
    assert tok.decode(want) == "]~!b[<|user|>Hi<|assistant|>(no system)"


def test_serve_passes_template_variables(tok, tmp_path):
    """chat_template_kwargs (Chat Completions, /tokenize) and reasoning_effort (Chat Completions; Responses'
    reasoning.effort) reach the checkpoint's template; a reserved or malformed name is a 400 naming
    chat_template_kwargs; with the built-in template they are checked the same and change nothing."""
    from test_serve import Scripted

    from openm3.serve import create_app

    path = _with_template(tok, tmp_path / "tok", THINKING)
    template = chat_template("auto", str(path / "tokenizer.json"))
    backend = Scripted([tok.eos_id], tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name="m", max_total_tokens=512, chat_template=template))
    messages = [{"role": "user", "content": "Hi"}]

    def chat(**fields):
        return client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2,
                                                         **fields})

    r = chat(chat_template_kwargs={"enable_thinking": False})  # a thinking budget of 0, which this backend lacks
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert chat(reasoning_effort="high").status_code == 200
    assert chat(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}).status_code == 200
    r = client.post("/v1/responses", json={"model": "m", "input": "Hi", "max_output_tokens": 2,
                                           "reasoning": {"effort": "medium"}})
    assert r.status_code == 200, r.text
    assert [tok.decode(p) for p in backend.prompts] == [
        "<|user|>Hi<|assistant|>[effort: high]",
        "<|user|>Hi<|assistant|>[effort: low]", "<|user|>Hi<|assistant|>[effort: medium]"]
    r = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.decode(r.json()["tokens"]) == "<|user|>Hi<|assistant|><think></think>"
    for bad in ({"messages": []}, {"1x": True}, ["enable_thinking"]):
        r = chat(chat_template_kwargs=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        r = client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    # Anthropic's thinking enabled / disabled is the template's enable_thinking (with a budget the backend keeps)
    class Adjusting(Scripted):
        supports_constraints = True

        def __call__(self, prompt, *, constraint=None, **kw):
            return super().__call__(prompt, **kw)

    adjusting = Adjusting([tok.eos_id], tok.vocab_size)
    anthropic = TestClient(create_app(adjusting, tok, model_name="m", max_total_tokens=512, chat_template=template))
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 8}):
        body = {"model": "m", "messages": messages, "max_tokens": 2, "thinking": thinking}
        assert anthropic.post("/v1/messages", json=body).status_code == 200
        count = anthropic.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        assert count == len(adjusting.prompts[-1])
    assert [tok.decode(p) for p in adjusting.prompts] == ["<|user|>Hi<|assistant|><think></think>",
                                                          "<|user|>Hi<|assistant|>"]
    builtin = TestClient(create_app(backend, tok, model_name="m", max_total_tokens=512))
    plain = builtin.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert builtin.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": True},
                                           }).json()["tokens"] == plain
    r = builtin.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and "set by the renderer" in r.json()["error"]["message"]


def test_server_default_template_variables(tok, tmp_path):
    """vLLM's --default-chat-template-kwargs: the template's variables for every chat API, under a request's own
    chat_template_kwargs and reasoning_effort; enable_thinking false among them sets Chat Completions' thinking
    budget unless the request turns it back on; bad defaults fail at start, naming the option."""
    from test_serve import Scripted

    from openm3.data.chat_template import parse_template_variables
    from openm3.serve import create_app
    from openm3.serve.cli import build_app, build_parser

    path = _with_template(tok, tmp_path / "tok", THINKING)
    template = chat_template("auto", str(path / "tokenizer.json"))
    backend = Scripted([tok.eos_id], tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name="m", max_total_tokens=512, chat_template=template,
                                   default_template_variables={"reasoning_effort": "low"}))
    hi = [{"role": "user", "content": "Hi"}]
    for path_, body in (("/v1/chat/completions", {"messages": hi}),
                        ("/v1/chat/completions", {"messages": hi, "reasoning_effort": "high"}),
                        ("/v1/chat/completions", {"messages": hi, "chat_template_kwargs": {"reasoning_effort": "x"}}),
                        ("/v1/responses", {"input": "Hi"}), ("/v1/messages", {"messages": hi})):
        r = client.post(path_, json={"model": "m", "max_tokens": 2, "max_output_tokens": 2, **body})
        assert r.status_code == 200, r.text
    assert [tok.decode(p)[len("<|user|>Hi<|assistant|>"):] for p in backend.prompts] == [
        "[effort: low]", "[effort: high]", "[effort: x]", "[effort: low]", "[effort: low]"]
    r = client.post("/tokenize", json={"messages": hi})
    assert tok.decode(r.json()["tokens"]).endswith("[effort: low]")

    client = TestClient(create_app(backend, tok, model_name="m", max_total_tokens=512, chat_template=template,
                                   default_template_variables={"enable_thinking": False}))
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": hi, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"  # a budget of 0
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": hi, "max_tokens": 2,
                                                  "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200 and tok.decode(backend.prompts[-1]).endswith("<|assistant|>")
    with pytest.raises(ValueError, match="default_template_variables: 'messages' is set by the renderer"):
        create_app(backend, tok, model_name="m", max_total_tokens=512, default_template_variables={"messages": 1})

    assert parse_template_variables('{"enable_thinking": false}', "--x") == {"enable_thinking": False}
    for text, why in (("{", "not valid JSON"), ("[1]", "expected an object"), ('{"tools": 1}', "set by the renderer")):
        with pytest.raises(ValueError, match=f"--x: .*{why}"):
            parse_template_variables(text, "--x")
    base = ["--preset", "m3-tiny", "--tokenizer", str(path / "tokenizer.json"), "--max-total-tokens", "64",
            "--max-batch", "1"]
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: not valid JSON"):
        build_app(build_parser().parse_args(base + ["--default-chat-template-kwargs", "{"]))
    app = build_app(build_parser().parse_args(base + ["--default-chat-template-kwargs", '{"reasoning_effort": "z"}']))
    r = TestClient(app).post("/tokenize", json={"messages": hi})
    assert tok.decode(r.json()["tokens"]) == "<|user|>Hi<|assistant|>[effort: z]"
