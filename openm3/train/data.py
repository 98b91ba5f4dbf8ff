"""The trainer's data source over `openm3.data`: text, image and video rows for each optimizer step.

`MixtureRows.rows(kind, step, count)` packs `count` rows of `seq_len` tokens from a stream of examples of that kind
that depends only on `(seed, kind, step)`: example j of the step is drawn with
`numpy.random.default_rng([seed, kind, step, j])`, which picks a source by weight and a fresh example index.
So the data position of a run is its step counter, every rank builds the same global rows, and a resumed run
sees exactly the rows it would have seen.

Sources are the names of `openm3.data.DEFAULT_WEIGHTS` (`text:<corpus>`, `scene_qa`, `video`, ...) plus the
training tasks of `openm3.train.tasks` (`colour_qa`, ...). Images and videos go through the M3 processors
(`openm3.models.processor`) and their placeholder counts come from the same resize rule.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Callable

import numpy as np
import torch

from ..models.vision import DEFAULT_FRAMES_PER_CLIP, check_frames_per_clip
from .batches import IGNORE, Row

KIND_IDS = {"text": 0, "image": 1, "video": 2}
DATA_EXTRA_MODULES = {"tokenizers": "tokenizers", "PIL": "pillow", "skimage": "scikit-image",
                      "sklearn": "scikit-learn"}


def check_data_extra() -> None:
    """Fail fast (before any compute) when a package of the `data` extra is missing."""
    missing = [dist for module, dist in DATA_EXTRA_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"training data needs the 'data' extra, missing packages {missing}: "
                         f"pip install 'openm3[data]'")


def processor_layout(kind: str, shape: tuple) -> list[tuple[int, int]]:
    """Placeholder groups `[(first_frame, tokens)]` exactly as the M3 processors will produce them."""
    from ..models.processor import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, smart_resize

    if kind == "image":
        h, w = smart_resize(shape[0], shape[1], 28, IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS)
        return [(0, (h // 28) * (w // 28))]
    h, w = smart_resize(shape[1], shape[2], 28, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    return [(2 * g, (h // 28) * (w // 28)) for g in range(math.ceil(shape[0] / 2))]


def vision_inputs(images: list[np.ndarray], videos: list,
                  frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP) -> dict[str, torch.Tensor]:
    """Model inputs for a row's images (`pixel_values [N, 1176]`, `image_grid_thw [I, 3]`) and videos
    (`pixel_values_videos [M, 1176]`, `video_grid_thw [K, 3]`, one row per clip of `frames_per_clip` temporal
    patches, None: one per video; the tower attends within a clip; the placeholders do not depend on it)."""
    from ..models.processor import M3ImageProcessor, M3VideoProcessor

    out = {}
    if images:
        out["pixel_values"], out["image_grid_thw"] = M3ImageProcessor()(images)
    if videos:
        out["pixel_values_videos"], out["video_grid_thw"], _ = M3VideoProcessor(frames_per_clip=frames_per_clip)(
            [v.frames for v in videos])
    return out


def row_from_packed(sample, kind: str, frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP) -> Row:
    """`openm3.data.PackedSample` -> Row: `labels[t] = input_ids[t+1]` where that token is a target (videos in
    clips of `frames_per_clip`, see `vision_inputs`)."""
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    mask = torch.from_numpy(sample.loss_mask)
    labels = torch.full_like(ids, IGNORE)
    labels[:-1] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], IGNORE))
    doc_lens = np.diff(sample.cu_seqlens).tolist()
    corpus = next((s for s in sample.sources if s != "pad"), "pad")
    return Row(ids, labels, doc_lens, kind=kind, corpus=corpus,
               vision=vision_inputs(sample.images, sample.videos, frames_per_clip))


def _without_media(example):
    """The example's text alone: its image and video segments (placeholders, markers) and pixels dropped."""
    from ..data.packing import Example

    return Example([seg for seg in example.segments if seg.kind == "text"], source=example.source)


def _with_other_pixels(example, pool: dict):
    """The example with each image and video replaced by the last one of the same shape seen before it in the
    stream (`pool`: shape -> pixels, updated with this example's own): its pixels no longer match its text. None
    when one of them has no earlier match yet (the example only fills the pool, so no pair stays matched)."""
    from ..data.packing import Example

    def swap(media, key):
        earlier = pool.get(key)
        pool[key] = media
        return earlier

    images = [swap(im, ("image", im.shape)) for im in example.images]
    videos = [swap(v, ("video", v.frames.shape, v.fps)) for v in example.videos]
    if any(m is None for m in images + videos):
        return None
    return Example(example.segments, images, videos, source=example.source)


def _with_noise_pixels(example, rng: np.random.Generator):
    """The example with each image and video replaced by uniform noise of its shape (seeded by the stream)."""
    from ..data.packing import Example, Video

    images = [rng.integers(0, 256, im.shape, dtype=np.uint8) for im in example.images]
    videos = [Video(rng.integers(0, 256, v.frames.shape, dtype=np.uint8), v.fps) for v in example.videos]
    return Example(example.segments, images, videos, source=example.source)


CONTROLS = ("blind", "mismatched", "noise")


def source_kind(name: str) -> str:
    from .tasks import TASKS

    if name.startswith("text:"):
        return "text"
    if name == "video" or (name in TASKS and TASKS[name].kind == "video"):
        return "video"
    return "image"


class MixtureRows:
    """A `RowSource` over `openm3.data` (see the module docstring).

    `weights`: source name -> relative weight (all kinds together; each kind draws among its own sources).
    `control` (experiments; the rows keep their kind), for image and video examples:
    - 'blind': they keep their text (questions, answers, captions) but lose their pixels and placeholders: what do
      the pixels add beyond that text?
    - 'mismatched': they keep everything but carry the pixels of an earlier example of the same shape, so visual
      tokens pass through the model but say nothing about the text: does what the images show matter?
    - 'noise': their pixels are uniform noise of the same shape: do natural images matter at all?
    `frames_per_clip`: temporal patches per video clip, the span of the vision tower's attention (None: whole
    videos; `TrainConfig.video_frames_per_clip`).
    """

    def __init__(self, tokenizer, seq_len: int, *, seed: int = 0, weights: dict[str, float] | None = None,
                 split: str = "train", image_size: int = 112, video_size: int = 56, control: str | None = None,
                 frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP):
        from ..data import DEFAULT_WEIGHTS, MixtureConfig, Mixture
        from .tasks import TASKS

        check_data_extra()
        weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = sorted(k for k in weights if k not in DEFAULT_WEIGHTS and k not in TASKS)
        if unknown:
            raise ValueError(f"weights: unknown sources {unknown}; expected names from "
                             f"{sorted(DEFAULT_WEIGHTS) + sorted(TASKS)}")
        self.tokenizer, self.seq_len, self.seed, self.split = tokenizer, seq_len, seed, split
        if control is not None and control not in CONTROLS:
            raise ValueError(f"control: expected None or one of {CONTROLS}, got {control!r}")
        self.control = control
        self.frames_per_clip = check_frames_per_clip(frames_per_clip)
        self.builders: dict[str, list[tuple[str, float, Callable[[np.random.Generator], object]]]] = {
            k: [] for k in KIND_IDS}
        for name, w in weights.items():
            if w <= 0:
                continue
            if name in TASKS:
                task = TASKS[name]
                build = (lambda t: lambda rng: t.example(rng, image_size=image_size, video_size=video_size))(task)
            else:
                mix = Mixture(MixtureConfig(seed=seed, seq_len=max(64, seq_len), split=split,
                                            text_chars=4 * seq_len, image_size=image_size, video_size=video_size,
                                            weights={name: 1.0}), tokenizer, processor_layout)
                build = (lambda m: lambda rng: m.example(int(rng.integers(2**62))))(mix)
            self.builders[source_kind(name)].append((name, w, build))

    def kinds(self) -> list[str]:
        return [k for k, b in self.builders.items() if b]

    def examples(self, kind: str, step: int):
        """The example stream of `kind` for `step` (infinite, deterministic)."""
        builders = self.builders[kind]
        if not builders:
            raise ValueError(f"the data mixture has no {kind!r} sources, but the recipe asks for {kind} rows")
        w = np.array([b[1] for b in builders], dtype=np.float64)
        cdf = np.cumsum(w / w.sum())
        j = 0
        pool: dict = {}  # mismatched: earlier pixels by shape, for this stream only (deterministic per step)
        while True:
            rng = np.random.default_rng([self.seed, KIND_IDS[kind], step, j])
            name, _, build = builders[min(int(np.searchsorted(cdf, rng.random(), side="right")), len(builders) - 1)]
            example = build(rng)
            example.source = name
            j += 1
            if kind != "text" and self.control == "blind":
                example = _without_media(example)
            elif kind != "text" and self.control == "mismatched":
                example = _with_other_pixels(example, pool)
                if example is None:
                    continue
            elif kind != "text" and self.control == "noise":
                example = _with_noise_pixels(example, rng)
            yield example

    def rows(self, kind: str, step: int, count: int) -> list[Row]:
        from ..data.packing import pack, tokenize_example

        tokenized = (tokenize_example(ex, self.tokenizer, processor_layout) for ex in self.examples(kind, step))
        out = []
        for sample in pack(tokenized, self.seq_len, self.tokenizer.pad_id):
            out.append(row_from_packed(sample, kind, self.frames_per_clip))
            if len(out) == count:
                break
        return out
