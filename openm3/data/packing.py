"""Turn examples (rendered chat segments + pixels) into token ids with placeholders, loss masks and packed sequences.

The number of placeholder tokens per image or video is not decided here: the caller passes a *layout* function
``layout(kind, shape) -> [(first_frame, num_tokens), ...]`` with one entry per group of placeholders, where
``kind`` is ``"image"`` or ``"video"`` and ``shape`` the pixel array's shape (``[H, W, 3]`` or ``[T, H, W, 3]``).
An image is one group; a video has one group per temporal patch, and each group is preceded by a
``]<]{seconds:.1f} seconds[>[`` timestamp (``first_frame / fps``) as in M3's processor. Each group is written as
``]<]start of image[>[`` + placeholder * num_tokens + ``]<]end of image[>[``. :func:`default_layout` follows the M3
processor's defaults (14-pixel patches, temporal patch 2, 2x2 merge, its image resize rule); the vision processor
can pass its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .chat import Segment
from .images import check_image, check_video
from .tokenizer import M3Tokenizer

Layout = Callable[[str, tuple], list]


@dataclass(frozen=True)
class Video:
    """A clip ``frames uint8 [T, H, W, 3]`` sampled at ``fps`` frames per second."""

    frames: np.ndarray
    fps: float = 2.0

    def __post_init__(self):
        if not self.fps > 0:
            raise ValueError(f"fps: expected a positive frame rate, got {self.fps}")


@dataclass
class Example:
    """One training example before tokenization: chat segments plus the pixels its media segments point to."""

    segments: list[Segment]
    images: list[np.ndarray] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)
    source: str = ""


@dataclass
class TokenizedExample:
    """``input_ids int32 [L]`` with placeholders expanded, ``loss_mask bool [L]`` (True: a training target)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    images: list[np.ndarray]
    videos: list[Video]
    source: str = ""

    @property
    def has_media(self) -> bool:
        return bool(self.images or self.videos)


@dataclass
class PackedSample:
    """One training sequence of exactly ``seq_len`` tokens.

    - ``input_ids int32 [seq_len]``: tokens, image/video placeholders included, padded with the pad id.
    - ``loss_mask bool [seq_len]``: True where ``input_ids[t]`` is a target (predicted from positions ``< t``);
      False on prompts, visual placeholders and their brackets, timestamps, padding and each document's first token.
      With next-token logits, the loss is ``CE(logits[:-1], input_ids[1:])`` weighted by ``loss_mask[1:]``.
    - ``cu_seqlens int32 [n + 1]``: document boundaries (0, ..., seq_len); padding, if any, is the last document.
    - ``images``: ``uint8 [H, W, 3]`` arrays, in the order of their placeholders in ``input_ids``.
    - ``videos``: :class:`Video` clips, in the order of their placeholders.
    - ``sources``: the source name of each document (``"pad"`` for padding).
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray
    images: list[np.ndarray]
    videos: list[Video]
    sources: list[str]

    @property
    def position_ids(self) -> np.ndarray:
        """``int32 [seq_len]``: positions restarting at 0 at every document boundary."""
        lens = np.diff(self.cu_seqlens)
        return (np.arange(len(self.input_ids)) - np.repeat(self.cu_seqlens[:-1], lens)).astype(np.int32)


def _resized_side_lengths(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """M3's image resize rule: sides to multiples of ``factor``, area kept within ``[min_pixels, max_pixels]``."""
    rh, rw = round(h / factor) * factor, round(w / factor) * factor
    if rh * rw > max_pixels:
        shrink = math.sqrt(h * w / max_pixels)
        rh, rw = (max(factor, math.floor(s / shrink / factor) * factor) for s in (h, w))
    elif rh * rw < min_pixels:
        grow = math.sqrt(min_pixels / (h * w))
        rh, rw = (math.ceil(s * grow / factor) * factor for s in (h, w))
    return rh, rw


def default_layout(
    kind: str,
    shape: tuple,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    temporal_patch_size: int = 2,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> list[tuple[int, int]]:
    """Placeholder groups for an image ``[H, W, 3]`` or video ``[T, H, W, 3]`` under M3's processor defaults.

    An image is resized as M3's image processor does (sides rounded to multiples of ``patch_size * merge_size``,
    area clamped to ``[min_pixels, max_pixels]``) and gives one group of ``(H'/14)(W'/14)/4`` tokens. Video frames
    are not resized (M3's processor passes ``do_resize=False`` for video), so their sides must be multiples of 28;
    a video gives ``ceil(T/2)`` groups starting at frames 0, 2, 4, ...
    """
    factor = patch_size * merge_size
    if kind == "image":
        if len(shape) != 3:
            raise ValueError(f"shape: expected [H, W, 3] for an image, got {list(shape)}")
        h, w = _resized_side_lengths(shape[0], shape[1], factor, min_pixels, max_pixels)
        return [(0, (h // factor) * (w // factor))]
    if kind != "video":
        raise ValueError(f"kind: expected 'image' or 'video', got {kind!r}")
    if len(shape) != 4:
        raise ValueError(f"shape: expected [T, H, W, 3] for a video, got {list(shape)}")
    t, h, w = shape[:3]
    if h % factor or w % factor:
        raise ValueError(f"shape: video frames must have sides that are multiples of {factor}, got {h}x{w}")
    per_group = (h // factor) * (w // factor)
    return [(g * temporal_patch_size, per_group) for g in range(math.ceil(t / temporal_patch_size))]


def _timestamp(seconds: float) -> str:
    return f"]<]{seconds:.1f} seconds[>["


def tokenize_example(example: Example, tokenizer: M3Tokenizer, layout: Layout = default_layout) -> TokenizedExample:
    """Tokenize the segments, expanding each image/video into its placeholder groups (never trained)."""
    ids: list[int] = []
    mask: list[bool] = []
    used = {"image": 0, "video": 0}
    pools = {"image": example.images, "video": example.videos}
    for i, seg in enumerate(example.segments):
        if seg.kind == "text":
            toks = tokenizer.encode(seg.text)
            ids += toks
            mask += [seg.loss] * len(toks)
            continue
        if seg.index != used[seg.kind] or seg.index >= len(pools[seg.kind]):
            raise ValueError(
                f"segments[{i}]: {seg.kind} index {seg.index} out of order or beyond the "
                f"{len(pools[seg.kind])} {seg.kind}s of the example"
            )
        used[seg.kind] += 1
        if seg.kind == "image":
            shape = check_image(example.images[seg.index], name=f"images[{seg.index}]").shape
            placeholder, fps = tokenizer.image_id, None
        else:
            video = example.videos[seg.index]
            shape = check_video(video.frames, name=f"videos[{seg.index}]").shape
            placeholder, fps = tokenizer.video_id, video.fps
        for first_frame, n in layout(seg.kind, tuple(shape)):
            if n < 1:
                raise ValueError(f"layout: expected a positive token count, got {n} for {seg.kind} {list(shape)}")
            group = tokenizer.encode(_timestamp(first_frame / fps)) if fps else []
            group += [tokenizer.vision_start_id] + [placeholder] * n + [tokenizer.vision_end_id]
            ids += group
            mask += [False] * len(group)
    for kind, pool in pools.items():
        if used[kind] != len(pool):
            raise ValueError(f"example: {len(pool)} {kind}s given but the segments place {used[kind]}")
    return TokenizedExample(
        np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool), list(example.images), list(example.videos),
        example.source,
    )  # fmt: skip


class _Builder:
    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.reset()

    def reset(self):
        self.ids, self.mask, self.lens, self.images, self.videos, self.sources = [], [], [], [], [], []

    @property
    def free(self) -> int:
        return self.seq_len - sum(self.lens)

    def add(self, ex: TokenizedExample, start: int, stop: int) -> None:
        mask = ex.loss_mask[start:stop].copy()
        mask[0] = False  # a document's first token has nothing to be predicted from
        self.ids.append(ex.input_ids[start:stop])
        self.mask.append(mask)
        self.lens.append(stop - start)
        self.sources.append(ex.source)
        self.images += ex.images
        self.videos += ex.videos

    def finish(self) -> PackedSample:
        pad = self.free
        if pad:
            self.ids.append(np.full(pad, self.pad_id, dtype=np.int32))
            self.mask.append(np.zeros(pad, dtype=bool))
            self.lens.append(pad)
            self.sources.append("pad")
        out = PackedSample(
            np.concatenate(self.ids).astype(np.int32), np.concatenate(self.mask),
            np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int32), self.images, self.videos, self.sources,
        )  # fmt: skip
        self.reset()
        return out


def pack(
    examples: Iterable[TokenizedExample], seq_len: int, pad_id: int, min_chunk: int = 32
) -> Iterator[PackedSample]:
    """Greedily pack examples, in order, into sequences of ``seq_len`` tokens.

    Text-only examples are split across sequences when they do not fit (pieces shorter than ``min_chunk`` are not
    started at the end of a sequence); examples with images or videos are never split: they go whole into the next
    sequence, and ones longer than ``seq_len`` raise ``ValueError``. The last partial sequence is padded and yielded.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
    if min_chunk < 2:
        raise ValueError(f"min_chunk: expected >= 2, got {min_chunk}")
    b = _Builder(seq_len, pad_id)
    for ex in examples:
        n = len(ex.input_ids)
        if n == 0:
            continue
        if ex.has_media:
            if n > seq_len:
                raise ValueError(f"examples: a {ex.source or 'media'} example of {n} tokens exceeds seq_len={seq_len}")
            if n > b.free:
                yield b.finish()
            b.add(ex, 0, n)
            continue
        start = 0
        while start < n:
            if b.free < min(min_chunk, n - start):
                yield b.finish()
            stop = min(n, start + b.free)
            b.add(ex, start, stop)
            start = stop
            if b.free == 0:
                yield b.finish()
    if b.lens:
        yield b.finish()


def shard(items: Iterable, rank: int, world_size: int) -> Iterator:
    """Every ``world_size``-th item starting at ``rank``: disjoint shards whose union is ``items``."""
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    for i, item in enumerate(items):
        if i % world_size == rank:
            yield item


def collate(samples: Sequence[PackedSample]) -> dict:
    """Stack packed samples into a batch: ``input_ids int32 [B, L]``, ``loss_mask bool [B, L]``, and flat lists."""
    if not samples:
        raise ValueError("samples: expected at least one PackedSample")
    lengths = {len(s.input_ids) for s in samples}
    if len(lengths) != 1:
        raise ValueError(f"samples: expected equal lengths, got {sorted(lengths)}")
    return {
        "input_ids": np.stack([s.input_ids for s in samples]),
        "loss_mask": np.stack([s.loss_mask for s in samples]),
        "cu_seqlens": [s.cu_seqlens for s in samples],
        "images": [im for s in samples for im in s.images],
        "videos": [v for s in samples for v in s.videos],
    }
