"""generate(), sampling, and the `openm3 generate` command: behaviour and fast failures on bad requests."""

import json

import pytest
import torch

from openm3.engine.cache import CacheFullError
from openm3.engine.generate import build_parser, device_and_dtype, generate, load_model, main
from openm3.engine.sampling import SamplingParams, filter_logits, sample
from openm3.models import M3TextConfig, M3TextModel


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", num_hidden_layers=2, layer_types=["full_attention",
                                    "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"], index_topk_blocks=2,
                                    max_position_embeddings=256)
    return M3TextModel(config).eval()


def test_greedy_generation_is_the_argmax_of_the_full_forward(model):
    prompts = [[5, 17, 300, 42] * 5, [7, 8, 9]]
    streamed = []
    results, stats = generate(model, prompts, max_new_tokens=4, chunk_size=8,
                              on_token=lambda b, t: streamed.append((b, t)))
    for p, r in zip(prompts, results):
        assert len(r.tokens) == 4 and r.finish_reason == "length"
        with torch.no_grad():
            logits = model(torch.tensor(p + r.tokens)).logits
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == r.tokens
    assert sorted(streamed) == sorted((b, t) for b, r in enumerate(results) for t in r.tokens)
    assert stats.prompt_tokens == 23 and stats.decode_tokens == 6 and stats.ttft_s > 0
    assert "time to first token" in stats.summary() and "tokens/s" in stats.summary()
    assert 0 < stats.first_step_s <= stats.decode_s and stats.first_step_tokens == 2  # both sequences
    assert stats.steady_decode_tokens_per_s > 0 and "after it" in stats.summary()
    assert "cache plan: 3 pages x 16 tokens" in stats.summary()  # 24 + 7 reserved tokens -> 2 + 1 pages


def test_the_workspace_estimate_follows_the_prompts_not_the_model_limits(model):
    """The memory plan's workspace is that of the chunk the prompts fill and of their context, not of a whole
    `chunk_size` chunk over `max_position_embeddings` keys (m3-small's estimate for a 200-token prompt was ~2 GiB,
    1 GiB of it block scores for 1M keys)."""
    from openm3.engine.generate import workspace_estimate
    from openm3.models.config import M3TextConfig

    small = M3TextConfig.from_name("m3-small", num_hidden_layers=2)
    short = workspace_estimate(small, 200, torch.float32, 1, context=200 + 16)
    assert short < 0.05 * 2**30 < 1.5 * 2**30 < workspace_estimate(small, 8192, torch.float32, 1)
    assert workspace_estimate(small, 200, torch.float32, 1, context=1 << 20) - short == 200 * 4 * 4 * (8192 - 2)
    _, stats = generate(model, [[5, 6, 7] * 7, [1, 2]], max_new_tokens=4, chunk_size=64)
    assert stats.workspace_bytes == workspace_estimate(model.config, 23, torch.float32, 2, context=21 + 4)


def test_stop_token_ends_a_sequence(model):
    first, _ = generate(model, [[1, 2, 3]], max_new_tokens=3)
    stop = first[0].tokens[1]
    results, _ = generate(model, [[1, 2, 3]], max_new_tokens=3, stop_tokens=[stop])
    want = first[0].tokens[:first[0].tokens.index(stop) + 1]
    assert results[0].tokens == want and results[0].finish_reason == "stop"


def test_sampling_with_top_k_1_or_tiny_top_p_is_greedy(model):
    greedy, _ = generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=3)
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)):
        sampled, _ = generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=3, sampling=params, seed=5)
        assert sampled[0].tokens == greedy[0].tokens


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.81)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits.expand(4000, -1), SamplingParams(temperature=1.0), gen)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(temperature=True), "temperature .* got True"),
    (dict(top_p=True), "top_p .* got True")],
    ids=["temp-neg", "top_p-0", "top_p-1.5", "top_k-neg", "temp-bool", "top_p-bool"])
def test_bad_sampling_params(kwargs, match):  # (a bool is an int: True was temperature 1, top_p 1)
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts,kwargs,match", [
    ([[]], {}, "prompt 0 is empty"),
    ([], {}, "at least one prompt"),
    ([[1] * 250], dict(max_new_tokens=10), "configured maximum of 256"),
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
    ([[1, 99999]], {}, "vocab_size"),
    ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),  # (was one token)
    ([[1, 2]], dict(chunk_size=True), "chunk_size must be a positive int, got True"),  # (was one-token chunks)
    ([[1, 2]], dict(chunk_size=None), "chunk_size must be a positive int, got None"),  # (was a TypeError)
], ids=["empty-prompt", "no-prompts", "too-long", "no-new-tokens", "bad-id", "max_new-bool", "chunk-bool",
        "chunk-none"])
def test_bad_requests_fail_fast(model, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, **kwargs)


def test_over_budget_batch_is_refused_before_any_work(model):
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(CacheFullError, match="token budget is 64"):
            generate(model, [[1] * 40, [2] * 40], max_new_tokens=8, token_budget=64)
    finally:
        handle.remove()
    assert calls == []


def test_cli_preset_prompt_ids(capsys):
    assert main(["--preset", "m3-tiny", "--prompt-ids", "1,2,3,4", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert len([t for t in out.strip().split(",") if t]) == 3
    assert "time to first token" in err and "decode:" in err and "cache plan" not in out


def test_cli_penalties(capsys):
    """--repetition-penalty and --presence-penalty: the tokens of `generate` with the same picker (the preset's
    random weights come from the CLI's own seeding: its plain answer is read first)."""
    from openm3.engine.penalties import Penalties, PenalizedPicker

    base = ["--preset", "m3-tiny", "--prompt-ids", "5,6,7,5,6,7", "--max-new-tokens", "8", "--device", "cpu",
            "--no-stream"]
    outputs = []
    for extra in ([], ["--repetition-penalty", "1.8", "--presence-penalty", "1.0"]):
        assert main(base + extra) == 0
        outputs.append([int(t) for t in capsys.readouterr().out.strip().split(",")])
    assert outputs[0] != outputs[1]
    args = build_parser().parse_args(base)
    model = load_model(args, *device_and_dtype(args))
    prompt = [5, 6, 7, 5, 6, 7]
    picker = PenalizedPicker(Penalties(repetition=1.8, presence=1.0), prompt)
    assert generate(model, [prompt], max_new_tokens=8, constraints=[picker])[0][0].tokens == outputs[1]


def test_cli_text_prompt_with_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert json.loads(path.read_text())["model"]["type"] == "WordLevel"
    assert main(["--preset", "m3-tiny", "--tokenizer", str(path), "--prompt", "hello world", "--max-new-tokens",
                 "2", "--no-stream", "--device", "cpu"]) == 0
    assert "finish reason" in capsys.readouterr().err


def test_streamed_cli_output_keeps_characters_split_across_tokens(capsys):
    """`openm3 generate`'s streaming prints each character once it is whole: a byte-level tokenizer's pieces of
    "é", "→" and an emoji are not printed as replacement characters one token at a time."""
    from openm3.data.tokenizer import get_tokenizer
    from openm3.engine.generate import _streamer

    tok = get_tokenizer().backend  # the tokenizers.Tokenizer `generate --tokenizer` loads
    text = "naïve café → ok 🙂 done"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some token is part of a character
    show = _streamer(tok)
    for i in ids:
        show(0, i)
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("argv,match", [
    (["--preset", "m3-huge", "--prompt-ids", "1"], "unknown config name"),
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1"], "does not exist"),
    (["--preset", "m3-tiny", "--prompt-ids", "1", "--top-p", "1.5"], "top_p"),
    (["--preset", "m3-tiny", "--prompt-ids", ""], "prompt 0 is empty"),
    (["--preset", "m3-tiny", "--prompt-ids", "1,x"], "comma-separated ints"),
    (["--preset", "m3-tiny", "--random-prompt", "9000"], "configured maximum"),
    (["--preset", "m3-tiny", "--prompt-ids", "1", "--presence-penalty", "3"], "presence penalty"),
    (["--preset", "m3-tiny", "--prompt-ids", "1", "--stop", "2,zz"], "--stop: expected comma-separated token ids"),
    (["--preset", "m3-tiny", "--prompt-ids", "1", "--layers", "0"], "--layers must be >= 1"),
], ids=["unknown-preset", "missing-checkpoint", "top-p", "empty", "bad-ids", "too-long", "penalty", "stop",
        "layers"])
def test_cli_bad_requests(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv + ["--device", "cpu"])


def test_cli_local_checkpoint(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "ckpt")
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--device",
            "cpu", "--no-stream"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    want, _ = generate(model, [[5, 6, 7]], max_new_tokens=3)
    assert [int(t) for t in out.split(",")] == want[0].tokens


def test_cli_finds_the_checkpoint_tokenizer(model, tmp_path, capsys):
    """A checkpoint directory with a tokenizer.json (what `openm3 train --export` writes) takes --prompt text
    without --tokenizer; --tokenizer also takes a directory; a path that is neither fails with a clear message."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    base = ["--prompt", "hello world", "--max-new-tokens", "2", "--device", "cpu", "--no-stream"]
    assert main(["--checkpoint", str(ckpt), *base]) == 0
    assert main(["--preset", "m3-tiny", "--tokenizer", str(ckpt), *base]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit, match="neither a tokenizer.json file nor a directory"):
        main(["--preset", "m3-tiny", "--tokenizer", str(tmp_path / "missing"), *base])


def test_cli_compile_gives_the_same_greedy_tokens(capsys):
    """`--compile` (every decoder layer under torch.compile, the cache path eager inside) changes no token."""
    argv = ["--preset", "m3-tiny", "--prompt-ids", "5,9,2,7,1,3,8", "--max-new-tokens", "4", "--device", "cpu",
            "--no-stream"]
    assert main(argv) == 0
    eager = capsys.readouterr().out.strip().splitlines()[-1]
    torch._dynamo.reset()
    try:
        assert main(argv + ["--compile"]) == 0
    finally:
        torch._dynamo.reset()
    assert capsys.readouterr().out.strip().splitlines()[-1] == eager


def test_cli_chat_prompt(tmp_path, capsys, monkeypatch):
    """--chat: --prompt becomes a user turn of the chat template (after a --system turn), with the generation
    prompt, as `openm3 serve` renders a conversation; the end-of-turn token stops generation. Without a tokenizer
    holding M3's chat tokens it fails with a message saying so."""
    import importlib

    from openm3.data.chat import render_chat
    from openm3.data.tokenizer import TokenizerSettings, get_tokenizer

    tok = get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000), tmp_path / "cache")
    path = tok.save(tmp_path / "tok")
    module = importlib.import_module("openm3.engine.generate")  # (the package exports a function of that name)
    seen = []
    real = module.generate
    monkeypatch.setattr(module, "generate", lambda model, prompts, **kw: seen.append((prompts[0], kw["stop_tokens"]))
                        or real(model, prompts, **kw))
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--prompt", "hi there", "--max-new-tokens", "2",
            "--device", "cpu", "--no-stream", "--stop", "7"]
    assert main(base + ["--chat"]) == 0
    assert main(base + ["--system", "Be brief."]) == 0
    assert main(base) == 0
    user = {"role": "user", "content": [{"type": "text", "text": "hi there"}]}
    assert seen[0] == (tok.encode(render_chat([user], add_generation_prompt=True)), [7, tok.eos_id])
    system = {"role": "system", "content": "Be brief."}
    assert seen[1] == (tok.encode(render_chat([system, user], add_generation_prompt=True)), [7, tok.eos_id])
    assert seen[2] == (tok.encode("hi there"), [7])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--chat / --system need --prompt"):
        main(["--preset", "m3-tiny", "--prompt-ids", "1", "--chat", "--device", "cpu"])


def test_cli_chat_template_kwargs(tmp_path, capsys, monkeypatch):
    """--chat-template-kwargs: more variables for the chat template of a --chat prompt; bad JSON, a name the
    renderer sets, or no chat prompt fail before the model is built."""
    import importlib

    from openm3.data.tokenizer import TokenizerSettings, get_tokenizer

    tok = get_tokenizer(TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000), tmp_path / "cache")
    path = tok.save(tmp_path / "tok")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}"
                        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    module = importlib.import_module("openm3.engine.generate")  # (the package exports a function of that name)
    seen = []
    real = module.generate
    monkeypatch.setattr(module, "generate", lambda model, prompts, **kw: seen.append(prompts[0])
                        or real(model, prompts, **kw))
    base = ["--preset", "m3-tiny", "--tokenizer", str(path), "--prompt", "hi", "--max-new-tokens", "1",
            "--device", "cpu", "--no-stream", "--chat-template", str(template)]
    assert main(base + ["--chat"]) == 0
    assert main(base + ["--chat", "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    assert [tok.decode(p) for p in seen] == ["<user>", "<user><think></think>"]
    capsys.readouterr()
    for extra, message in ((["--chat", "--chat-template-kwargs", "{"], "--chat-template-kwargs: not valid JSON"),
                           (["--chat", "--chat-template-kwargs", '{"messages": 1}'], "set by the renderer"),
                           (["--chat-template-kwargs", "{}"], "needs a chat prompt")):
        with pytest.raises(SystemExit, match=message):
            main(base + extra)
    assert len(seen) == 2


def test_overlapped_decoding_gives_plain_decodings_greedy_tokens(model):
    """overlap=True (each step launched before the host reads the last one's tokens): the same greedy tokens,
    finish reasons, streamed tokens and logprobs as the plain loop, with a stop token one sequence samples early
    (its next step's row is dropped) and sequences ending at max_new_tokens."""
    prompts = [[5, 17, 300, 42] * 5, [7, 8, 9], [1, 2, 3, 4, 5, 6]]
    first, _ = generate(model, prompts, max_new_tokens=6)
    stop = [first[1].tokens[2]]
    runs = []
    for overlap in (False, True):
        streamed, reported = [], []
        results, stats = generate(model, prompts, max_new_tokens=6, stop_tokens=stop, overlap=overlap,
                                  on_token=lambda b, t, s=streamed: s.append((b, t)), logprobs=2,
                                  on_logprobs=lambda b, lp, top, r=reported: r.append((b, round(lp, 4))))
        runs.append((results, streamed, reported, stats))
    (plain, s0, r0, st0), (over, s1, r1, st1) = runs
    assert [r.tokens for r in over] == [r.tokens for r in plain]
    assert [r.finish_reason for r in over] == [r.finish_reason for r in plain]
    assert "stop" in [r.finish_reason for r in plain] and "length" in [r.finish_reason for r in plain]
    for b in range(3):  # per sequence, in order (the interleaving across sequences may differ)
        assert [t for c, t in s1 if c == b] == [t for c, t in s0 if c == b]
        assert [x for c, x in r1 if c == b] == [x for c, x in r0 if c == b]
    assert st1.decode_tokens == st0.decode_tokens == sum(len(r.tokens) for r in plain) - 3
    assert st1.decode_steps >= st0.decode_steps and st1.first_step_tokens > 0
    assert st1.first_step_s + st1.capture_s <= st1.decode_s
    assert st1.overlapped and not st0.overlapped and "launched ahead of the host" in st1.summary()
    one, _ = generate(model, prompts, max_new_tokens=1, overlap=True)  # prefill's token only: no decode step
    assert [r.tokens for r in one] == [r.tokens[:1] for r in first]


def test_overlapped_sampling_is_seeded_and_well_formed(model):
    params = SamplingParams(temperature=0.9, top_k=8)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    a, _ = generate(model, prompts, max_new_tokens=7, sampling=params, seed=3, stop_tokens=[11], overlap=True)
    b, _ = generate(model, prompts, max_new_tokens=7, sampling=params, seed=3, stop_tokens=[11], overlap=True)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for r in a:
        assert 1 <= len(r.tokens) <= 7 and all(0 <= t < model.config.vocab_size for t in r.tokens)
        assert (r.finish_reason == "stop") == (r.tokens[-1] == 11) and 11 not in r.tokens[:-1]
        assert r.finish_reason == "stop" or len(r.tokens) == 7
    with pytest.raises(ValueError, match="overlap=True decodes without drafts or constraints"):
        generate(model, prompts, max_new_tokens=2, overlap=True, draft_contexts=[[1], [2]])
