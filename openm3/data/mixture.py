"""The default training mixture: text, images and video interleaved, deterministic by (seed, example index).

Example ``i`` is built from ``numpy.random.default_rng([seed, split, i])`` alone, so it is the same bytes whatever
the number of ranks, and ranks take disjoint examples (``i % world_size == rank``) before packing. Sources:

========================  =======================================================================================
``text:<corpus>``         a window of a document of that corpus's split; every token trained (pre-training style)
``scene_caption``         a rendered scene; the assistant describes it from the scene graph
``scene_qa``              a rendered scene; 1-3 question/answer turns from the scene graph
``multi_image``           two scenes interleaved with text; which has more objects
``photo``                 a crop of a ``skimage.data`` photograph and its description
``digit``                 a scikit-learn handwritten digit; which digit it is
``video``                 a rendered clip whose answer needs several frames (``videos.TASKS``)
``tool``                  a calculator tool call, its result, and the final answer (exercises the tool format)
========================  =======================================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from . import images as img
from .chat import Segment, render_segments
from .corpora import CORPORA, SPLITS, is_heldout, load_corpus
from .packing import Example, Layout, PackedSample, Video, default_layout, pack, tokenize_example
from .scenes import caption, questions, render_scene, sample_scene
from .tokenizer import BOS, EOS, M3Tokenizer, TokenizerSettings, get_tokenizer
from .videos import make_clip

DEFAULT_WEIGHTS = {
    "text:stdlib": 0.20,
    "text:topics": 0.05,
    "text:bible_web": 0.15,
    "text:bible_kjv": 0.15,
    "scene_caption": 0.08,
    "scene_qa": 0.10,
    "multi_image": 0.03,
    "photo": 0.04,
    "digit": 0.05,
    "video": 0.12,
    "tool": 0.03,
}
# The `text-only` recipe's mixture: the same text sources with the same relative weights, no vision.
TEXT_ONLY_WEIGHTS = {k: (w if k.startswith("text:") else 0.0) for k, w in DEFAULT_WEIGHTS.items()}
_CAPTION_PROMPTS = ("Describe the picture.", "What is in this image?", "List the objects you see and where they are.")


@dataclass(frozen=True)
class MixtureConfig:
    """Settings of a mixture. ``weights`` maps source names (see the module docstring) to relative weights."""

    seed: int = 0
    seq_len: int = 2048
    split: str = "train"
    heldout_fraction: float = 0.05
    text_chars: int = 6000  # longest text window per example, in characters
    image_size: int = 112
    video_size: int = 56
    video_fps: float = 2.0
    weights: dict = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")
        if self.seq_len < 64:
            raise ValueError(f"seq_len: expected >= 64, got {self.seq_len}")
        if self.text_chars < 1:
            raise ValueError(f"text_chars: expected >= 1, got {self.text_chars}")
        known = set(DEFAULT_WEIGHTS)
        bad = [k for k in self.weights if k not in known]
        if bad:
            raise ValueError(f"weights: unknown sources {bad}; expected names from {sorted(known)}")
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"weights: expected non-negative weights with a positive sum, got {self.weights}")


class Mixture:
    """Deterministic stream of examples and packed samples (see the module docstring)."""

    def __init__(self, config: MixtureConfig, tokenizer: M3Tokenizer, layout: Layout = default_layout):
        self.config = config
        self.tokenizer = tokenizer
        self.layout = layout
        names = [k for k, w in config.weights.items() if w > 0]
        w = np.array([config.weights[k] for k in names], dtype=np.float64)
        self.sources = names
        self.cdf = np.cumsum(w / w.sum())
        self._docs = {}
        for name in names:  # load text now so a missing data extra fails at construction
            if name.startswith("text:"):
                self._text_pool(name[5:])

    def _text_pool(self, corpus: str):
        if corpus not in self._docs:
            docs = load_corpus(corpus, self.config.split, self.config.heldout_fraction)
            if not docs:
                raise ValueError(f"corpus {corpus!r} has no documents in split {self.config.split!r}")
            self._docs[corpus] = docs
        return self._docs[corpus]

    def rng(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, SPLITS.index(self.config.split), index])

    def example(self, index: int) -> Example:
        """Example ``index`` of the stream (a pure function of the config and ``index``)."""
        if index < 0:
            raise ValueError(f"index: expected >= 0, got {index}")
        rng = self.rng(index)
        source = self.sources[min(int(np.searchsorted(self.cdf, rng.random(), side="right")), len(self.sources) - 1)]
        build = _text if source.startswith("text:") else _BUILDERS[source]
        ex = build(self, rng, source)
        ex.source = source
        return ex

    def examples(self, rank: int = 0, world_size: int = 1, start: int = 0) -> Iterator[Example]:
        """Examples ``start + rank, start + rank + world_size, ...`` forever."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got {rank}, {world_size}")
        i = start + rank
        while True:
            yield self.example(i)
            i += world_size

    def samples(self, rank: int = 0, world_size: int = 1, num_samples: int | None = None) -> Iterator[PackedSample]:
        """Packed sequences of ``seq_len`` tokens from this rank's examples; ``num_samples=None`` runs forever."""
        tokenized = (tokenize_example(ex, self.tokenizer, self.layout) for ex in self.examples(rank, world_size))
        for n, sample in enumerate(pack(tokenized, self.config.seq_len, self.tokenizer.pad_id)):
            if num_samples is not None and n >= num_samples:
                return
            yield sample


def _chat(messages, images=(), videos=(), tools=None) -> Example:
    return Example(render_segments(messages, tools), list(images), list(videos))


def _text(mix: Mixture, rng: np.random.Generator, source: str) -> Example:
    docs = mix._text_pool(source[5:])
    text = docs[int(rng.integers(len(docs)))].text
    if len(text) > mix.config.text_chars:
        start = int(rng.integers(0, len(text) - mix.config.text_chars + 1))
        line = text.rfind("\n", 0, start) + 1  # start at a line boundary when there is one nearby
        start = line if start - line < 200 else start
        text = text[start : start + mix.config.text_chars]
    return Example([Segment("text", BOS), Segment("text", text, True), Segment("text", EOS, True)])


def _user(*parts) -> dict:
    content = [{"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts]
    return {"role": "user", "content": content}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _scene_caption(mix: Mixture, rng, source) -> Example:
    scene = sample_scene(rng, mix.config.image_size)
    prompt = _CAPTION_PROMPTS[int(rng.integers(len(_CAPTION_PROMPTS)))]
    return _chat([_user("image", prompt), _assistant(caption(scene))], [render_scene(scene)])


def _scene_qa(mix: Mixture, rng, source) -> Example:
    scene = sample_scene(rng, mix.config.image_size)
    pairs = questions(scene, rng, k=int(rng.integers(1, 4)))
    messages = [_user("image", pairs[0][0]), _assistant(pairs[0][1])]
    for q, a in pairs[1:]:
        messages += [_user(q), _assistant(a)]
    return _chat(messages, [render_scene(scene)])


def _multi_image(mix: Mixture, rng, source) -> Example:
    a, b = sample_scene(rng, mix.config.image_size), sample_scene(rng, mix.config.image_size)
    na, nb = len(a.objects), len(b.objects)
    answer = "the first" if na > nb else "the second" if nb > na else "neither: they have the same number"
    msg = _user("Here is the first picture:", "image", "and the second:", "image", "Which one has more objects?")
    return _chat([msg, _assistant(f"{answer} ({na} against {nb}).")], [render_scene(a), render_scene(b)])


def _photo(mix: Mixture, rng, source) -> Example:
    names = sorted(img.PHOTO_CAPTIONS)
    photo = img.load_photo(names[int(rng.integers(len(names)))])
    pixels = img.photo_crop(photo, rng, mix.config.image_size)
    return _chat([_user("image", "What does this photograph show?"), _assistant(photo.caption)], [pixels])


@cache
def _digit_pool(split: str, heldout_fraction: float) -> tuple[int, ...]:
    """Indices of the sklearn digits in ``split`` (hashed by index, like the text corpora)."""
    want = split == "heldout"
    return tuple(i for i in range(img.num_digits()) if is_heldout("digits", str(i), heldout_fraction) == want)


def _digit(mix: Mixture, rng, source) -> Example:
    pool = _digit_pool(mix.config.split, mix.config.heldout_fraction)
    pixels, label = img.digit_image(pool[int(rng.integers(len(pool)))], size=56)
    return _chat([_user("image", "Which digit is written here?"), _assistant(str(label))], [pixels])


def _video(mix: Mixture, rng, source) -> Example:
    clip = make_clip(rng, size=mix.config.video_size, fps=mix.config.video_fps)
    video = Video(clip.frames, clip.fps)
    return _chat([_user("video", clip.question), _assistant(clip.answer)], videos=[video])


_CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers and + - *.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def _tool(mix: Mixture, rng, source) -> Example:
    a, b = (int(v) for v in rng.integers(2, 1000, size=2))
    op = "+-*"[int(rng.integers(3))]
    value = a + b if op == "+" else a - b if op == "-" else a * b
    expr = f"{a} {op} {b}"
    messages = [
        {"role": "user", "content": f"What is {expr}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator",
                                                                          "arguments": {"expression": expr}}}]},
        {"role": "tool", "content": str(value)},
        _assistant(f"{expr} = {value}."),
    ]  # fmt: skip
    return _chat(messages, tools=[_CALCULATOR])


_BUILDERS = {
    "scene_caption": _scene_caption,
    "scene_qa": _scene_qa,
    "multi_image": _multi_image,
    "photo": _photo,
    "digit": _digit,
    "video": _video,
    "tool": _tool,
}


def default_mixture(
    seed: int = 0,
    seq_len: int = 2048,
    *,
    split: str = "train",
    tokenizer: M3Tokenizer | None = None,
    layout: Layout = default_layout,
    cache_dir=None,
    **overrides,
) -> Mixture:
    """The default mixture (``DEFAULT_WEIGHTS``), with the cached default tokenizer unless one is given.

    ``overrides`` are other :class:`MixtureConfig` fields (``image_size``, ``weights``, ...). Raises
    :class:`~openm3.data.corpora.MissingDataError` naming the package when a corpus of the data extra is missing.
    """
    config = MixtureConfig(seed=seed, seq_len=seq_len, split=split, **overrides)
    if tokenizer is None:
        tokenizer = get_tokenizer(TokenizerSettings(heldout_fraction=config.heldout_fraction), cache_dir)
    return Mixture(config, tokenizer, layout)


__all__ = ["CORPORA", "DEFAULT_WEIGHTS", "TEXT_ONLY_WEIGHTS", "Mixture", "MixtureConfig", "default_mixture"]
