"""Placeholder expansion, loss masks, packing into fixed-length sequences, sharding."""

import numpy as np
import pytest

from openm3.data.chat import Segment, render_segments
from openm3.data.packing import (
    Example,
    TokenizedExample,
    Video,
    collate,
    default_layout,
    pack,
    shard,
    tokenize_example,
)
from openm3.data.tokenizer import TokenizerSettings, get_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    settings = TokenizerSettings(vocab_size=700, chars_per_corpus=30_000, corpora=("topics",))
    return get_tokenizer(settings, tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize(
    "kind, shape, expected",
    [
        ("image", (112, 112, 3), [(0, 16)]),
        ("image", (56, 84, 3), [(0, 6)]),
        ("image", (30, 30, 3), [(0, 4)]),  # grown to the 56x56 minimum area
        ("image", (2000, 3000, 3), [(0, 29 * 43)]),  # shrunk under 1280 merged tokens: 812x1204
        ("video", (8, 56, 56, 3), [(0, 4), (2, 4), (4, 4), (6, 4)]),
        ("video", (5, 56, 56, 3), [(0, 4), (2, 4), (4, 4)]),
    ],
    ids=["H112-W112", "H56-W84", "H30-W30", "H2000-W3000", "T8-H56-W56", "T5-H56-W56"],
)
def test_default_layout(kind, shape, expected):
    assert default_layout(kind, shape) == expected


def test_default_layout_bad_input():
    with pytest.raises(ValueError, match="kind"):
        default_layout("audio", (1, 2, 3))
    with pytest.raises(ValueError, match="shape"):
        default_layout("video", (56, 56, 3))
    with pytest.raises(ValueError, match="multiples of 28"):
        default_layout("video", (4, 56, 60, 3))


def _image(h=56, w=56, value=0):
    return np.full((h, w, 3), value, dtype=np.uint8)


def _example(images=1, videos=1, frames=6):
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": "What?"}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "That."}]
    vids = [Video(np.zeros((frames, 56, 56, 3), np.uint8), fps=2.0) for _ in range(videos)]
    return Example(render_segments(messages), [_image(value=i) for i in range(images)], vids, "test")


def test_placeholders_and_loss_mask(tok):
    ex = tokenize_example(_example(images=2, videos=1, frames=6), tok)
    ids, mask = ex.input_ids, ex.loss_mask
    assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
    assert (ids == tok.image_id).sum() == 2 * 4
    assert (ids == tok.video_id).sum() == 3 * 4  # 6 frames -> 3 temporal groups of 2x2 merged tokens
    assert (ids == tok.vision_start_id).sum() == (ids == tok.vision_end_id).sum() == 2 + 3
    visual = np.isin(ids, [tok.image_id, tok.video_id, tok.vision_start_id, tok.vision_end_id])
    assert not mask[visual].any()
    assert tok.decode(ids[mask]) == "That.[e~["
    text = tok.decode(ids)
    for seconds in ("0.0", "1.0", "2.0"):  # groups start at frames 0, 2, 4 at 2 fps
        assert f"]<]{seconds} seconds[>[]<]start of image[>[" in text
    assert "]<]3.0 seconds[>[" not in text
    # Images come before the video, in the order of their placeholders.
    first_image, first_video = np.argmax(ids == tok.image_id), np.argmax(ids == tok.video_id)
    assert first_image < first_video


def test_custom_layout_sets_the_counts(tok):
    calls = []

    def layout(kind, shape):
        calls.append((kind, shape))
        return [(0, 3)] if kind == "image" else [(0, 2), (4, 2)]

    ex = tokenize_example(_example(images=1, videos=1, frames=8), tok, layout)
    assert calls == [("image", (56, 56, 3)), ("video", (8, 56, 56, 3))]
    assert (ex.input_ids == tok.image_id).sum() == 3 and (ex.input_ids == tok.video_id).sum() == 4
    assert "]<]2.0 seconds[>[" in tok.decode(ex.input_ids)
    with pytest.raises(ValueError, match="layout"):
        tokenize_example(_example(), tok, lambda kind, shape: [(0, 0)])


def test_media_count_mismatch_and_bad_pixels(tok):
    ex = _example(images=1, videos=0)
    with pytest.raises(ValueError, match="segments"):
        tokenize_example(Example(ex.segments, [], []), tok)
    with pytest.raises(ValueError, match="2 images given but the segments place 1"):
        tokenize_example(Example(ex.segments, [_image(), _image()], []), tok)
    with pytest.raises(ValueError, match="fps"):
        Video(np.zeros((4, 56, 56, 3), np.uint8), fps=0)
    with pytest.raises(ValueError, match=r"images\[0\].*channels"):
        tokenize_example(Example(ex.segments, [np.zeros((56, 56, 4), np.uint8)], []), tok)


def _text(n, start=0, source="text"):
    ids = np.arange(start, start + n, dtype=np.int32) % 500 + 20
    return TokenizedExample(ids, np.ones(n, dtype=bool), [], [], source)


def _media(n, source="media"):
    ids = np.full(n, 7, dtype=np.int32)
    return TokenizedExample(ids, np.zeros(n, dtype=bool), [_image()], [], source)


@pytest.mark.parametrize("seq_len", [64, 100], ids=["L64", "L100"])
def test_pack_text_splits_and_reassembles(seq_len):
    examples = [_text(30, 0), _text(150, 1000), _text(5, 2000), _text(70, 3000)]
    samples = list(pack(examples, seq_len, pad_id=0, min_chunk=8))
    for s in samples:
        assert s.input_ids.shape == s.loss_mask.shape == (seq_len,)
        assert s.cu_seqlens[0] == 0 and s.cu_seqlens[-1] == seq_len
        assert not s.loss_mask[s.cu_seqlens[:-1]].any()  # no document's first token is a target
    real = [s.input_ids[a:b] for s in samples for a, b, src in zip(s.cu_seqlens[:-1], s.cu_seqlens[1:], s.sources)
            if src != "pad"]  # fmt: skip
    assert np.array_equal(np.concatenate(real), np.concatenate([e.input_ids for e in examples]))
    for s in samples[:-1]:  # earlier sequences are padded only when fewer than min_chunk tokens were left
        assert s.sources[-1] != "pad" or s.cu_seqlens[-1] - s.cu_seqlens[-2] < 8


def test_position_ids_restart_per_document():
    s = next(pack([_text(5), _text(3)], 10, pad_id=0, min_chunk=2))
    assert s.cu_seqlens.tolist() == [0, 5, 8, 10]
    assert s.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]


def test_pack_never_splits_media():
    examples = [_text(50), _media(30), _text(10), _media(60)]
    samples = list(pack(examples, 64, pad_id=0, min_chunk=8))
    for s in samples:
        media_docs = [(a, b) for a, b, src in zip(s.cu_seqlens[:-1], s.cu_seqlens[1:], s.sources) if src == "media"]
        assert all(b - a in (30, 60) for a, b in media_docs)
        assert len(s.images) == len(media_docs)
    assert sum(len(s.images) for s in samples) == 2
    with pytest.raises(ValueError, match="exceeds seq_len"):
        list(pack([_media(65)], 64, pad_id=0))
    with pytest.raises(ValueError, match="seq_len"):
        list(pack([], 1, pad_id=0))


def test_shard_is_a_partition():
    items = list(range(23))
    shards = [list(shard(items, r, 4)) for r in range(4)]
    assert sorted(x for s in shards for x in s) == items
    assert all(not set(a) & set(b) for i, a in enumerate(shards) for b in shards[i + 1 :])
    with pytest.raises(ValueError, match="rank"):
        list(shard(items, 4, 4))
    with pytest.raises(ValueError, match="world_size"):
        list(shard(items, 0, 0))


def test_collate():
    samples = list(pack([_text(50), _media(30)], 64, pad_id=0))
    batch = collate(samples)
    assert batch["input_ids"].shape == (2, 64) and batch["loss_mask"].shape == (2, 64)
    assert len(batch["images"]) == 1
    with pytest.raises(ValueError, match="samples"):
        collate([])


def test_text_segment_loss_flags(tok):
    ex = Example([Segment("text", "]~!b["), Segment("text", "hello world", True)])
    t = tokenize_example(ex, tok)
    assert not t.loss_mask[0] and t.loss_mask[1:].all()
