"""The engine over a vision-language model (`M3ForConditionalGeneration`) on CPU: prompts with images are embedded
once, prefilled in chunks of their embeddings (chunk boundaries inside an image's placeholder run included) and
decoded as text, and all of it equals one full forward of the VL model; `generate` and continuous batching carry
the images; a text-only model refuses them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from openm3.engine import BatchedGenerator, generate
from openm3.engine.cache import CacheLayout, PagedCache, page_keys, plan_cache
from openm3.engine.scheduler import PromptImages, check_images, decode_step, prefill
from openm3.models import M3ForConditionalGeneration, M3TextConfig, M3TextModel, M3VLConfig
from openm3.models.processor import M3ImageProcessor, M3VideoProcessor

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

IMG, VID, START, END = 5, 6, 7, 8
TEXT = dict(index_topk_blocks=2, num_hidden_layers=3, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 2,
            mlp_layer_types=["dense", "sparse", "sparse"])  # as tests/test_engine.py's tiny_model


@pytest.fixture(scope="module")
def vl():
    """m3-tiny text (dense layer 0, MSA + MoE layers 1-2, 2 of 16-token blocks selected) + the m3-tiny tower."""
    torch.manual_seed(0)
    return M3ForConditionalGeneration(M3VLConfig.from_name("m3-tiny", image_token_index=IMG,
                                                           video_token_index=VID, **TEXT)).eval()


def _images(sizes, seed=0) -> PromptImages:
    rng = np.random.default_rng(seed)
    return PromptImages(*M3ImageProcessor()([rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]))


def _text(n, gen) -> list[int]:
    return torch.randint(10, 4096, (n,), generator=gen).tolist()


def _image_prompt(images: PromptImages, seed=1) -> list[int]:
    """text 9, image 0's run, text 12, image 1's run, ..., text 20 (placeholders wrapped in START / END)."""
    gen = torch.Generator().manual_seed(seed)
    ids = _text(9, gen)
    for t, h, w in images.grid_thw.tolist():
        ids += [START] + [IMG] * (t * h * w // 4) + [END] + _text(12, gen)
    return ids + _text(8, gen)


def _full(vl, seqs, images):
    """One VL forward over the packed sequences (their images concatenated) -> per-sequence logits."""
    lens = [len(s) for s in seqs]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    with_images = [im for im in images if im is not None]
    pixels = torch.cat([im.pixel_values for im in with_images]) if with_images else None
    grid = torch.cat([im.grid_thw for im in with_images]) if with_images else None
    with torch.no_grad():
        return list(vl(torch.tensor(sum(seqs, [])), pixels, grid, cu_seqlens=cu).logits.split(lens))


CASES = [  # chunk size, decode steps, with a text prompt beside the image prompt
    (16, 4, False),   # boundary at 16: inside image 0's 16-token run (positions 10-25)
    (7, 3, False),    # boundaries at 14, 21 (image 0) and 42 (image 1, positions 39-44)
    (128, 4, False),  # one chunk
    (40, 3, True),    # the two prompts share a forward: an embeddings piece beside an ids piece
]


@pytest.mark.parametrize("chunk,steps,pair", CASES, ids=[f"chunk{c}-N{n}" + ("-pair" if p else "")
                                                          for c, n, p in CASES])
def test_prefill_and_decode_with_images_equal_the_full_forward(vl, chunk, steps, pair):
    images = _images([(112, 112), (28, 56)])  # 16 and 6 visual tokens
    assert images.grid_thw.tolist() == [[1, 8, 8], [1, 4, 6]]
    gen = torch.Generator().manual_seed(2)
    prompts = [_image_prompt(images)] + ([_text(29, gen)] if pair else [])
    per_prompt = [images] + [None] * pair
    seqs = [p + _text(steps, gen) for p in prompts]
    layout = CacheLayout.from_config(vl.config.text_config)
    cache = PagedCache(plan_cache(layout, 256, kv_dtype=torch.float32))
    ids = list(range(len(prompts)))
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    chunks = []
    got = [[lg] for lg in prefill(vl, cache, ids, [torch.tensor(p) for p in prompts], chunk_size=chunk,
                                  images=per_prompt, on_chunk=chunks.append)]
    assert sum(chunks) == sum(map(len, prompts)) and max(chunks) <= chunk
    for s in range(steps):
        feed = torch.tensor([seqs[b][len(prompts[b]) + s] for b in ids])
        for b, lg in enumerate(decode_step(vl, cache, ids, feed)):
            got[b].append(lg)
    for b, full in enumerate(_full(vl, seqs, per_prompt)):
        want = full[len(prompts[b]) - 1: len(seqs[b])]
        assert (torch.stack(got[b]) - want).abs().max().item() < 1e-4, f"sequence {b}"
    with torch.no_grad():  # the images matter: the placeholders' own embeddings give other logits
        blind = vl.language_model(torch.tensor(seqs[0])).logits[len(prompts[0]) - 1:]
    assert (blind - _full(vl, seqs[:1], per_prompt[:1])[0][len(prompts[0]) - 1:]).abs().max() > 1e-3


def test_prefill_and_decode_with_a_video_and_an_image_equal_the_full_forward(vl):
    """A prompt with a video (5 temporal patches, in clips of 4 and 1 as M3VideoProcessor splits them) before an
    image: the visual tokens of both kinds go in prompt order, through chunk boundaries, as in the full forward."""
    prompt, both, gen = _video_image_prompt()
    image = PromptImages(both.pixel_values, both.grid_thw)
    video_pixels, video_grid = both.pixel_values_videos, both.video_grid_thw
    seq = prompt + _text(3, gen)
    cache = PagedCache(plan_cache(CacheLayout.from_config(vl.config.text_config), 128, kv_dtype=torch.float32))
    cache.admit({0: len(seq)})
    got = list(prefill(vl, cache, [0], [torch.tensor(prompt)], chunk_size=11, images=[both]))
    for s in range(3):
        got += list(decode_step(vl, cache, [0], torch.tensor([seq[len(prompt) + s]])))
    with torch.no_grad():
        full = vl(torch.tensor(seq), image.pixel_values, image.grid_thw, video_pixels, video_grid,
                  cu_seqlens=torch.tensor([0, len(seq)], dtype=torch.int32)).logits
    assert (torch.stack(got) - full[len(prompt) - 1: len(seq)]).abs().max().item() < 1e-4
    # a video-only request, and the counts checked per kind
    video_only = PromptImages(None, None, video_pixels, video_grid)
    no_image = prompt[:prompt.index(IMG) - 1] + prompt[prompt.index(END, prompt.index(IMG)) + 1:]
    assert check_images(vl, [torch.tensor(no_image)], [video_only])[0].video_grid_thw.tolist() == video_grid.tolist()
    with pytest.raises(ValueError, match="prompt 0: input_ids: 10 video placeholder tokens but the videos give 20"):
        check_images(vl, [torch.tensor(no_image[:20])], [video_only])
    with pytest.raises(ValueError, match=r"images\[0\]\.pixel_values_videos: expected a float tensor \[80, 1176\]"):
        check_images(vl, [torch.tensor(no_image)], [PromptImages(None, None, video_pixels[:-1], video_grid)])


def _video_image_prompt() -> tuple[list[int], PromptImages, torch.Generator]:
    """text 5, a video's 5 runs of 4 placeholders (clips of 4 and 1 temporal patches: grid rows [4, 4, 4] and
    [1, 4, 4]), text 6, an image's run of 6, text 4; its PromptImages; the generator for more text."""
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, (10, 56, 56, 3), dtype=np.uint8)  # 5 temporal patches of 2 frames
    video_pixels, video_grid, counts = M3VideoProcessor()([frames])
    assert counts == [2] and video_grid.tolist() == [[4, 4, 4], [1, 4, 4]]  # 5 runs of 4 video tokens
    image = _images([(28, 56)])
    gen = torch.Generator().manual_seed(6)
    prompt = _text(5, gen)
    for _ in range(5):
        prompt += [START] + [VID] * 4 + [END]
    prompt += _text(6, gen) + [START] + [IMG] * 6 + [END] + _text(4, gen)
    return prompt, PromptImages(image.pixel_values, image.grid_thw, video_pixels, video_grid), gen


def test_the_vision_tower_runs_once_per_prompt(vl, monkeypatch):
    calls = []
    original = vl.visual_tokens
    monkeypatch.setattr(vl, "visual_tokens", lambda *a, **k: calls.append(1) or original(*a, **k))
    images = _images([(112, 112), (28, 56)])
    generate(vl, [_image_prompt(images)], max_new_tokens=2, chunk_size=8, images=[images])
    assert len(calls) == 1  # 9 chunks, one tower call


def test_greedy_generate_with_images_follows_the_full_forward(vl):
    images = _images([(56, 84)], seed=3)
    prompt = _image_prompt(images, seed=4)
    results, stats = generate(vl, [prompt], max_new_tokens=6, chunk_size=16, images=[images])
    seq = prompt + results[0].tokens
    full = _full(vl, [seq], [images])[0]
    assert results[0].tokens == full[len(prompt) - 1: len(seq) - 1].argmax(-1).tolist()
    assert stats.prompt_tokens == len(prompt)


def test_batched_image_request_beside_a_text_request_equals_generate_alone(vl):
    images = _images([(112, 112), (28, 56)], seed=5)
    gen = torch.Generator().manual_seed(6)
    prompts, per_prompt, new = [_image_prompt(images, seed=7), _text(23, gen)], [images, None], [7, 9]
    want = [generate(vl, [p], max_new_tokens=n, images=[im])[0][0].tokens for p, im, n in zip(prompts, per_prompt, new)]
    batcher = BatchedGenerator(vl, token_budget=512, max_batch=4, chunk_size=32)
    assert batcher.vl_config is vl.config
    got: list[list[int]] = [[], []]
    start = threading.Barrier(2)

    def call(i):
        start.wait()
        return batcher(prompts[i], max_new_tokens=new[i], on_token=got[i].append,
                       **({"images": per_prompt[i]} if per_prompt[i] is not None else {}))

    out = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, call(i))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    batcher.close()
    assert out == ["length", "length"] and got == want
    assert max(batcher.batch_sizes) == 2  # decoded together
    assert batcher.cache.free_pages == batcher.plan.num_pages


def test_text_only_model_refuses_images_by_name():
    torch.manual_seed(0)
    text = M3TextModel(M3TextConfig.from_name("m3-tiny", **TEXT)).eval()
    images = _images([(28, 28)])
    prompt = [1, START] + [IMG] * 4 + [END]
    with pytest.raises(ValueError, match=r"images: the model is a text-only M3TextModel"):
        generate(text, [prompt], max_new_tokens=2, images=[images])
    batcher = BatchedGenerator(text, token_budget=64)
    assert batcher.vl_config is None
    with pytest.raises(ValueError, match=r"images: the model is a text-only"):
        batcher(prompt, max_new_tokens=2, images=images)
    batcher.close()
    assert check_images(text, [torch.tensor(prompt)], None) == [None]  # text prompts go on as before


ONE = [1, START] + [IMG] * 4 + [END]  # a 28 x 28 image is upscaled to 56 x 56: grid (1, 4, 4), 4 visual tokens


@pytest.mark.parametrize("prompt,images,match", [
    ([1, START] + [IMG] * 3 + [END], "one", r"prompt 0: input_ids: 3 image placeholder tokens but the images give 4"),
    (ONE, None, r"prompt 0: input_ids: 4 image placeholder tokens but no pixel_values"),
    ([1, 2, 3], "one", r"prompt 0: input_ids: 0 image placeholder tokens but the images give 4"),
    (ONE, "short", r"images\[0\]\.pixel_values: expected a float tensor \[16, 1176\]"),
    (ONE, "two-lists", r"images: expected a list with one entry per prompt \(1"),
    (ONE, "triple", r"images\[0\]: expected \(pixel_values"),
], ids=["too-few-placeholders", "placeholders-without-images", "images-without-placeholders", "pixel-rows",
        "entries", "not-a-pair"])
def test_bad_images_fail_before_any_work(vl, prompt, images, match):
    one = _images([(28, 28)])
    arg = {"one": [one], None: None, "short": [(one.pixel_values[:2], one.grid_thw)], "two-lists": [one, one],
           "triple": [(one.pixel_values, one.grid_thw, None)]}[images]
    with pytest.raises(ValueError, match=match):
        generate(vl, [prompt], max_new_tokens=2, images=arg)



def test_cached_images_skip_the_vision_tower(vl, monkeypatch):
    """An agent's next turn resends its screenshots: the images wholly inside the cached prefix are not encoded
    again (the tower sees only the later grid rows), the one the cache boundary cuts is, and the logits equal a
    prefill from scratch."""
    rows = []
    original = vl.visual_tokens
    monkeypatch.setattr(vl, "visual_tokens", lambda p, g, *a, **k: rows.append(g.tolist()) or original(p, g, *a, **k))
    images = _images([(112, 112), (28, 56), (56, 56)], seed=4)  # 16, 6 and 4 visual tokens
    prompt = torch.tensor(_image_prompt(images, seed=5))
    starts = [int(i) for i in (prompt == START).nonzero().flatten()]
    assert starts == [9, 39, 59]  # runs at 10-25, 40-45, 60-63
    ps = vl.config.text_config.index_block_size
    cache = PagedCache(plan_cache(CacheLayout.from_config(vl.config.text_config), 512, kv_dtype=torch.float32),
                       prefix_caching=True)
    cache.admit({0: prompt.numel() + 1})
    want = prefill(vl, cache, [0], [prompt], chunk_size=12, images=[images])
    keys = page_keys(prompt, ps, images.digest())
    cache.register(0, keys)
    cache.release(0)
    for seq_id, pages in enumerate((1, 3), start=1):  # cached: 16 tokens (inside image 0's run), 48 (past image 1)
        assert cache.admit({seq_id: prompt.numel() + 1}, prefixes={seq_id: keys[:pages]}) == {seq_id: pages * ps}
        rows.clear()
        got = prefill(vl, cache, [seq_id], [prompt], chunk_size=12, images=[images])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        kept = [r for r, s in zip(images.grid_thw.tolist(), starts) if s + r[1] * r[2] // 4 >= pages * ps]
        assert rows == [kept] and len(kept) == 3 - 2 * (pages == 3)
        cache.release(seq_id)
    # a video's clips are rows alike: 32 cached tokens hold clip 0's placeholders (6-27), not clip 1's (30-33)
    prompt, both, _ = _video_image_prompt()
    prompt = torch.tensor(prompt)
    cache.admit({9: prompt.numel() + 1})
    want = prefill(vl, cache, [9], [prompt], images=[both])
    keys = page_keys(prompt, ps, both.digest())
    cache.register(9, keys)
    cache.release(9)
    assert cache.admit({10: prompt.numel() + 1}, prefixes={10: keys[:2]}) == {10: 32}
    rows.clear()
    torch.testing.assert_close(prefill(vl, cache, [10], [prompt], images=[both]), want, rtol=1e-4, atol=1e-4)
    assert rows == [[[1, 4, 6]], [[1, 4, 4]]]  # the image (28 x 56), then video clip 1 only
