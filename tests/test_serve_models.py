"""The names a server answers to: one model id, or several (vLLM's `--served-model-name a b`: an agent sends its
main model's name and a fast model's for background work); answers carry the first; any other is a 404."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_serve import EOS, NAME, Scripted, tok  # noqa: F401 - a fixture

from openm3.serve import create_app


def test_aliases_are_served_and_other_names_are_404(tok):
    backend = Scripted(tok.encode("hi" + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, model_aliases=["claude-haiku-4-5"],
                                   max_total_tokens=512))
    hi = [{"role": "user", "content": "Hi"}]
    requests = [("/v1/chat/completions", {"messages": hi}), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                ("/v1/responses", {"input": "Hi"}), ("/v1/messages", {"messages": hi, "max_tokens": 2}),
                ("/v1/messages/count_tokens", {"messages": hi}), ("/tokenize", {"prompt": "Hi"})]
    for path, body in requests:
        for name in (NAME, "claude-haiku-4-5"):
            r = client.post(path, json={"model": name, **body})
            assert r.status_code == 200, (path, r.text)
            if "model" in r.json():
                assert r.json()["model"] == NAME  # answers carry the first name
        r = client.post(path, json={"model": "gpt-4o", **body})
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert "gpt-4o" in error["message"] and "claude-haiku-4-5" in error["message"]
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [NAME, "claude-haiku-4-5"]
    listed = client.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert [m["id"] for m in listed["data"]] == [NAME, "claude-haiku-4-5"] and listed["last_id"] == "claude-haiku-4-5"
    for name in (NAME, "claude-haiku-4-5"):  # one card each, in the dialect the headers ask for
        assert client.get(f"/v1/models/{name}").json()["object"] == "model"
        assert client.get(f"/v1/models/{name}", headers={"anthropic-version": "2023-06-01"}).json()["type"] == "model"
    assert client.get("/v1/models/gpt-4o").status_code == 404
    slashed = TestClient(create_app(backend, tok, model_name="org/m3-tiny", max_total_tokens=512))
    assert slashed.get("/v1/models/org/m3-tiny").json()["id"] == "org/m3-tiny"  # a name holding a '/'
    for aliases in ([NAME], [""]):
        with pytest.raises(ValueError, match="distinct non-empty names"):
            create_app(backend, tok, model_name=NAME, model_aliases=aliases, max_total_tokens=512)


def test_served_model_names_option(tok, tmp_path):
    from openm3.serve.cli import build_app, build_parser

    path = tok.save(tmp_path / "tok")
    args = build_parser().parse_args(["--preset", "m3-tiny", "--tokenizer", str(path), "--max-total-tokens", "64",
                                      "--max-batch", "1", "--served-model-name", "m3", "fast"])
    client = TestClient(build_app(args))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m3", "fast"]
    r = client.post("/v1/completions", json={"model": "fast", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "m3"


def test_vllm_option_names(monkeypatch):
    """vLLM's spellings of the same options, so its launch commands carry over: --served-model-name,
    --max-model-len, --max-num-seqs, --no-enable-prefix-caching, and the tool / reasoning parser switches of a
    MiniMax launch."""
    from openm3.serve.cli import build_parser

    ours = build_parser().parse_args(["--preset", "m3-tiny", "--model-name", "a", "b", "--max-total-tokens", "512",
                                      "--max-batch", "4", "--no-prefix-caching"])
    vllm = build_parser().parse_args(["--preset", "m3-tiny", "--served-model-name", "a", "b", "--max-model-len", "512",
                                      "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert vars(ours) == vars(vllm)
    assert (vllm.model_name, vllm.max_total_tokens, vllm.max_batch, vllm.no_prefix_caching) == (["a", "b"], 512, 4,
                                                                                                  True)
    # a vLLM launch command for MiniMax's models: its tool and reasoning parser names are taken as ours
    from openm3.serve.cli import build_app

    launch = build_parser().parse_args(["--preset", "m3-tiny", "--max-batch", "1", "--enable-auto-tool-choice",
                                        "--tool-call-parser", "minimax_m2", "--trust-remote-code",
                                        "--reasoning-parser", "minimax_m2_append_think"])
    import openm3.serve.app as app_module

    made, real = {}, app_module.create_app
    monkeypatch.setattr(app_module, "create_app", lambda *a, **kw: made.update(kw) or real(*a, **kw))
    assert TestClient(build_app(launch)).get("/v1/models").status_code == 200
    assert made["reasoning_parser"] == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--preset", "m3-tiny", "--tool-call-parser", "hermes"])


def test_more_of_a_vllm_launch_command_is_taken_or_refused_by_name(tok, tmp_path):
    """--max-num-batched-tokens (our --chunk-size), --enforce-eager, and switches whose behaviour is the default
    here are taken; a vLLM option whose value this server cannot honour is an error naming it, not ignored."""
    from openm3.serve.cli import build_app, build_parser

    path = str(tok.save(tmp_path / "tok"))
    base = ["--preset", "m3-tiny", "--tokenizer", path, "--max-total-tokens", "64"]
    launch = base + ["--max-num-batched-tokens", "32", "--enforce-eager", "--enable-prefix-caching",
                     "--enable-chunked-prefill", "--disable-log-requests", "-tp", "1", "--kv-cache-dtype", "auto"]
    for batch in ("2", "1"):  # the batching backend and the one-request one
        args = build_parser().parse_args(launch + ["--max-num-seqs", batch])
        client = TestClient(build_app(args))
        backend = client.app.state.stats_log.backend_metrics
        r = client.post("/v1/completions", json={"model": "m3-tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert args.chunk_size == 32 and args.enforce_eager
        if batch == "2":
            gen = backend.__self__
            assert gen.chunk_size == 32 and gen.graphs is None  # eager decode steps
            gen.close()
    refused = [(["-tp", "2"], "--tensor-parallel-size"),
               (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization.*--token-budget"),
               (["--kv-cache-dtype", "fp8"], "--index-dtype fp8"),
               (["--enable-prefix-caching", "--no-prefix-caching"], "contradict")]
    for extra, match in refused:
        with pytest.raises(ValueError, match=match):
            build_app(build_parser().parse_args(base + extra))


def test_request_priority_needs_the_priority_policy(tok, tmp_path):
    """vLLM's `priority` field: a 400 naming it on a first-come-first-served server; taken (all three OpenAI-style
    endpoints' bodies) under --scheduling-policy priority, which needs the batching engine."""
    from openm3.serve.cli import build_app, build_parser

    base = ["--preset", "m3-tiny", "--tokenizer", str(tok.save(tmp_path / "tok")), "--max-total-tokens", "64"]
    bodies = [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("/v1/responses", {"input": "hi", "max_output_tokens": 2})]
    for policy, status in (("fcfs", 400), ("priority", 200)):
        client = TestClient(build_app(build_parser().parse_args(base + ["--max-batch", "2", "--scheduling-policy",
                                                                        policy])))
        for path, body in bodies:
            r = client.post(path, json={"model": "m3-tiny", "priority": -3, **body})
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["param"] == "priority"
        client.app.state.stats_log.backend_metrics.__self__.close()
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        build_app(build_parser().parse_args(base + ["--max-batch", "1", "--scheduling-policy", "priority"]))
