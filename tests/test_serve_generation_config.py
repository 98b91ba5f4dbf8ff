"""A checkpoint's generation_config.json as the server's sampling defaults (vLLM's `--generation-config auto` and
`--override-generation-config`): the keys vLLM reads, for the fields a request leaves unset, on every API."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_serve import EOS, NAME, Scripted, tok  # noqa: F401 - a fixture

from openm3.serve import create_app
from openm3.serve.generation_config import load_generation_config, sampling_defaults


class Recording(Scripted):
    """A scripted backend that also records each request's sampling, max_new_tokens and constraint."""

    supports_constraints = True

    def __init__(self, tokens, vocab_size):
        super().__init__(tokens, vocab_size)
        self.calls = []

    def __call__(self, prompt, *, max_new_tokens, sampling, constraint=None, **kw):
        self.calls.append((sampling, max_new_tokens, constraint))
        return super().__call__(prompt, max_new_tokens=max_new_tokens, sampling=sampling, **kw)


HF_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "bos_token_id": 1,
             "eos_token_id": [2, 3], "max_new_tokens": 3, "transformers_version": "5.24.0"}


def test_the_keys_vllm_reads_with_overrides_on_top():
    assert sampling_defaults(HF_CONFIG) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3}
    assert sampling_defaults(HF_CONFIG, {"temperature": 0.0, "top_k": None, "min_p": 0.05}) == {
        "temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "min_p": 0.05}
    assert sampling_defaults({"top_k": -1, "repetition_penalty": 1.05}) == {"top_k": 0, "repetition_penalty": 1.05}
    for config, override, message in (
            ({"temperature": 3.0}, None, "generation config: temperature must be >= 0.0 and <= 2.0"),
            ({"top_p": 0}, None, "top_p must be > 0.0"), ({"top_k": 2.5}, None, "top_k must be an integer"),
            ({"max_new_tokens": 0}, None, "max_new_tokens must be >= 1"),
            ({}, {"temperature": True}, "--override-generation-config: temperature must be a number"),
            ({}, {"temprature": 0.5}, r"--override-generation-config: unknown keys \['temprature'\]"),
            ({}, [1], "--override-generation-config: expected a JSON object")):
        with pytest.raises(ValueError, match=message):
            sampling_defaults(config, override)


def test_finding_the_generation_config(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert load_generation_config("auto", str(tmp_path / "ckpt")) == {}  # none there
    assert load_generation_config("auto", None) == {}  # a preset
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(HF_CONFIG))
    assert load_generation_config("auto", str(tmp_path / "ckpt")) == HF_CONFIG
    assert load_generation_config("vllm", str(tmp_path / "ckpt")) == {}
    assert load_generation_config(str(tmp_path / "ckpt"), None) == HF_CONFIG
    with pytest.raises(ValueError, match="--generation-config: expected auto, vllm or a directory"):
        load_generation_config(str(tmp_path / "nowhere"), None)
    (tmp_path / "ckpt" / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_generation_config("auto", str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_generation_config("auto", str(tmp_path / "ckpt"))


def test_requests_take_the_defaults_for_fields_they_leave_unset(tok):
    """Chat Completions, Completions, Responses and Messages: unset temperature / top_p / top_k take the
    defaults, set ones (0 included) stay; max_new_tokens is the default max_tokens where the API leaves it unset,
    within the context limit's room; a repetition_penalty default adjusts the logits of requests that do not set
    theirs."""
    from openm3.engine.penalties import PenalizedPicker

    backend = Recording(tok.encode("a b c d e f" + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096, default_sampling=dict(
        temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=3, repetition_penalty=1.3)))
    hi = [{"role": "user", "content": "Hi"}]
    for path, body in (("/v1/chat/completions", {"messages": hi}),
                       ("/v1/chat/completions", {"messages": hi, "temperature": 0, "max_tokens": 5, "top_k": 0,
                                                 "repetition_penalty": 1.0}),
                       ("/v1/completions", {"prompt": "Hi", "top_p": 0.5}),
                       ("/v1/responses", {"input": "Hi"}),
                       ("/v1/messages", {"messages": hi, "max_tokens": 4})):
        r = client.post(path, json={"model": NAME, **body})
        assert r.status_code == 200, r.text
    got = [(s.temperature, s.top_p, s.top_k, n) for s, n, _ in backend.calls]
    # Completions' max_tokens defaults to 16 (OpenAI's legacy default, vLLM's too): the field is never unset there
    assert got == [(0.6, 0.9, 20, 3), (0.0, 0.9, 0, 5), (0.6, 0.5, 20, 16), (0.6, 0.9, 20, 3), (0.6, 0.9, 20, 4)]
    pickers = [c for _, _, c in backend.calls]
    assert isinstance(pickers[0], PenalizedPicker) and pickers[0].penalties.repetition == 1.3
    assert pickers[1] is None and pickers[2].penalties.repetition == 1.3
    limit = len(backend.prompts[0]) + 3  # the first chat request's prompt and 3 new tokens
    small = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=limit,
                                  default_sampling={"max_new_tokens": 100}))
    assert small.post("/v1/chat/completions", json={"model": NAME, "messages": hi}).status_code == 200
    assert backend.calls[-1][1] == 3  # the room left, not the default
    with pytest.raises(ValueError, match="default_sampling: this backend does not adjust logits"):
        create_app(Scripted([], tok.vocab_size), tok, model_name=NAME, max_total_tokens=64,
                   default_sampling={"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="default_sampling: top_p must be"):
        create_app(backend, tok, model_name=NAME, max_total_tokens=64, default_sampling={"top_p": 2})


def test_serve_options(tok, tmp_path, capsys):
    """--generation-config auto reads the --checkpoint's file; --override-generation-config replaces keys; bad
    values fail before the model loads, naming the option."""
    from openm3.serve.cli import build_parser, default_sampling

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "generation_config.json").write_text(json.dumps(HF_CONFIG))
    args = build_parser().parse_args(["--checkpoint", str(ckpt), "--override-generation-config", '{"top_k": 5}'])
    assert default_sampling(args) == {"temperature": 0.6, "top_p": 0.9, "top_k": 5, "max_new_tokens": 3}
    assert "default sampling" in capsys.readouterr().err
    args = build_parser().parse_args(["--checkpoint", str(ckpt), "--generation-config", "vllm"])
    assert default_sampling(args) == {}
    for extra, message in ((["--override-generation-config", "{"], "--override-generation-config: not valid JSON"),
                           (["--override-generation-config", '{"top_p": 5}'], "--override-generation-config: top_p"),
                           (["--generation-config", str(tmp_path)], "--generation-config: expected auto")):
        with pytest.raises(ValueError, match=message):
            default_sampling(build_parser().parse_args(["--checkpoint", str(ckpt)] + extra))
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="--generation-config auto: temperature must be"):
        default_sampling(build_parser().parse_args(["--checkpoint", str(ckpt)]))
