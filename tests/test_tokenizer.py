"""Tokenizer: special tokens, byte-exact round trips, caching and deterministic training."""

import json
import os

import pytest
from test_files import dead_pid

from openm3.data import tokenizer as tokenizer_module
from openm3.data.chat import render_chat
from openm3.data.corpora import load_corpus
from openm3.data.tokenizer import (
    BOS,
    EOS,
    IMAGE,
    SPECIAL_TOKENS,
    VIDEO,
    M3Tokenizer,
    TokenizerSettings,
    get_tokenizer,
    train_tokenizer,
)

SMALL = TokenizerSettings(vocab_size=1024, chars_per_corpus=150_000)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return get_tokenizer(SMALL, tmp_path_factory.mktemp("tok-cache"))


def test_special_tokens_have_fixed_ids_and_are_single_tokens(tok):
    assert tok.vocab_size == SMALL.vocab_size
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_id(special) == i
        assert tok.encode(special) == [i]
    assert (tok.bos_id, tok.eos_id, tok.image_id, tok.video_id) == tuple(
        map(SPECIAL_TOKENS.index, (BOS, EOS, IMAGE, VIDEO))
    )
    # Special strings inside text are matched whole, wherever they appear.
    ids = tok.encode(f"x{IMAGE}{IMAGE}y{VIDEO}")
    assert ids.count(tok.image_id) == 2 and ids.count(tok.video_id) == 1


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn x ** 2  # square\n",
        "In the beginning God created the heavens and the earth.",
        "unicode: ünïcödé, 日本語, emoji 🚀🧪, nul-free control \x07 and trailing spaces   ",
        f"{BOS}]~b]user\nhi {IMAGE} there{EOS}\n",
        "",
        "    \n\n\r\n  ",
    ],
    ids=["code", "prose", "unicode", "specials", "empty", "whitespace"],
)
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_round_trip(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat.", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
    ]
    text = render_chat(messages, add_generation_prompt=True)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.bos_id and ids.count(tok.image_id) == 1
    assert tok.token_id("<minimax:tool_call>") in ids and tok.token_id("</minimax:tool_call>") in ids


def test_bpe_learned_merges_on_heldout_text(tok):
    # A byte-level model with no merges gives 1 token per byte; the trained one must compress held-out text.
    text = "".join(d.text for d in load_corpus("bible_kjv", "heldout")[:5])
    assert len(text.encode()) / len(tok.encode(text)) > 2.5


def test_cache_hit_and_key(tmp_path):
    settings = TokenizerSettings(vocab_size=600, chars_per_corpus=20_000, corpora=("topics",))
    first = get_tokenizer(settings, tmp_path)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].name == f"tokenizer-{settings.key()}"
    saved = json.loads((entries[0] / "settings.json").read_text())
    assert saved["vocab_size"] == 600
    again = get_tokenizer(settings, tmp_path)
    assert again.backend.to_str() == first.backend.to_str()
    other = TokenizerSettings(vocab_size=700, chars_per_corpus=20_000, corpora=("topics",))
    assert other.key() != settings.key()
    get_tokenizer(other, tmp_path)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_cached_tokenizer_cut_short_is_trained_again(tmp_path):
    """A cache file a power loss or a full disk left empty or cut short is trained again (with a warning), not a
    raw parse error on every later run."""
    settings = TokenizerSettings(vocab_size=600, chars_per_corpus=20_000, corpora=("topics",))
    first = get_tokenizer(settings, tmp_path)
    path = tmp_path / f"tokenizer-{settings.key()}" / "tokenizer.json"
    for broken in ("", path.read_text()[:100]):
        path.write_text(broken)
        with pytest.warns(UserWarning, match="is unreadable .* training it again"):
            again = get_tokenizer(settings, tmp_path)
        assert again.backend.to_str() == first.backend.to_str()
        assert get_tokenizer(settings, tmp_path).backend.to_str() == first.backend.to_str()  # cached again


def test_a_crashed_writers_temporary_file_is_removed(tmp_path):
    settings = TokenizerSettings(vocab_size=600, chars_per_corpus=20_000, corpora=("topics",))
    entry = tmp_path / f"tokenizer-{settings.key()}"
    entry.mkdir()
    orphan = entry / f"tokenizer.json.{dead_pid()}.tmp"
    kept = [f"tokenizer.json.{os.getppid()}.tmp",  # a writer at work (this process's own is the one renamed)
            f"tokenizer.json.{2**40}.tmp", "tokenizer.json.tmp", "notes.tmp"]  # not temporaries of this form
    for name in (orphan.name, *kept):
        (entry / name).write_text('{"version"')
    get_tokenizer(settings, tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == sorted(["settings.json", "tokenizer.json", *kept])


def test_temporaries_are_swept_when_the_cache_is_read_and_a_failed_write_leaves_none(tmp_path, monkeypatch):
    """A dead writer's temporary beside a cached tokenizer.json stayed until that entry was trained again; a write
    that failed (here: its sync to disk) left its own."""
    settings = TokenizerSettings(vocab_size=600, chars_per_corpus=20_000, corpora=("topics",))
    entry = tmp_path / f"tokenizer-{settings.key()}"
    get_tokenizer(settings, tmp_path)
    orphan, live = entry / f"tokenizer.json.{dead_pid()}.tmp", entry / f"tokenizer.json.{os.getppid()}.tmp"
    for stale in (orphan, live):
        stale.write_text('{"version"')
    get_tokenizer(settings, tmp_path)  # a cache hit
    assert not orphan.exists() and live.exists()

    def unwritable(_fd):
        raise OSError("No space left on device")

    other = TokenizerSettings(vocab_size=700, chars_per_corpus=20_000, corpora=("topics",))
    monkeypatch.setattr(tokenizer_module.os, "fsync", unwritable)
    with pytest.raises(OSError, match="No space left"):
        get_tokenizer(other, tmp_path)
    assert list((tmp_path / f"tokenizer-{other.key()}").iterdir()) == []


def test_training_is_deterministic():
    settings = TokenizerSettings(vocab_size=800, chars_per_corpus=30_000, corpora=("topics", "bible_web"))
    assert train_tokenizer(settings).backend.to_str() == train_tokenizer(settings).backend.to_str()


def test_save_and_load(tok, tmp_path):
    path = tok.save(tmp_path / "out")
    loaded = M3Tokenizer.from_file(path.parent)
    assert loaded.encode("hello world") == tok.encode("hello world")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"corpora": ("nope",)}, "corpora"),
        ({"corpora": ()}, "corpora"),
        ({"chars_per_corpus": 0}, "chars_per_corpus"),
        ({"min_frequency": 0}, "min_frequency"),
    ],
    ids=["vocab-too-small", "unknown-corpus", "no-corpus", "no-chars", "min-frequency"],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenizerSettings(**kwargs)


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(ValueError, match="path"):
        M3Tokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="token"):
        tok.token_id("not one token at all")


def test_transformers_loads_it_and_renders_the_same_chat(tok, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from openm3.data.chat import CHAT_TEMPLATE

    tok.save(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert hf.convert_tokens_to_ids(IMAGE) == tok.image_id and hf.convert_tokens_to_ids(VIDEO) == tok.video_id
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    conversations = [
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünï 🚀"},
          {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}], None),
        ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]},
          {"role": "assistant", "content": "ok"}], None),
        ([{"role": "user", "content": "1+2?"},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add",
                                                                          "arguments": {"a": 1, "b": "x"}}}]},
          {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}], [tool]),
        ([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], [tool]),
    ]  # fmt: skip
    for messages, tools in conversations:
        for gen in (False, True):
            ours = render_chat(messages, tools, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert theirs == ours
            assert hf(ours, add_special_tokens=False)["input_ids"] == tok.encode(ours)


def test_cli_exports(tmp_path, capsys):
    from openm3.data.tokenizer import main

    args = ["--vocab-size", "600", "--chars-per-corpus", "5000", "--cache-dir", str(tmp_path / "c"),
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(args) == 0
    assert "600 tokens" in capsys.readouterr().out
    assert M3Tokenizer.from_file(tmp_path / "o").vocab_size == 600
