"""Question-answer tasks used to train and to score vision: each sample has a closed set of candidate answers.

- `colour_qa` (image): one large shape on a plain background, "What colour is the circle?" -> one of 7 colours. A small
  model learns it in minutes (colour is a direct function of a few pixels), while a model that sees only the
  question can do no better than 1 in 7: the demo's evidence that the model reads the image.
- `video_qa` (video): the rendered clips of `openm3.data.videos` (direction of motion, which square moved first,
  number of flashes, forward or reversed playback), whose answers need several frames.

A sample renders to a training `openm3.data.Example` (prompt + trained answer) or to a scoring prompt whose
candidates are compared by the log-likelihood of `answer + end-of-turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class QASample:
    """`question` asked about `images` / `videos` (numpy frames), with `answer` among `candidates`."""

    task: str
    question: str
    answer: str
    candidates: tuple[str, ...]
    images: list[np.ndarray] = field(default_factory=list)
    videos: list = field(default_factory=list)  # openm3.data.packing.Video

    def messages(self, with_media: bool = True) -> list[dict]:
        media = [{"type": "image"}] * len(self.images) + [{"type": "video"}] * len(self.videos)
        content = (media if with_media else []) + [{"type": "text", "text": self.question}]
        return [{"role": "user", "content": content}]

    def example(self):
        """The training example: the user turn, then the assistant's answer (trained)."""
        from ..data.chat import render_segments
        from ..data.packing import Example

        segments = render_segments(self.messages() + [{"role": "assistant", "content": self.answer}])
        return Example(segments, list(self.images), list(self.videos), source=self.task)


def render_shape(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int], size: int,
                 rng: np.random.Generator) -> np.ndarray:
    """One large shape (radius ~0.3-0.4 of the side, jittered centre) on a plain background: `uint8 [S, S, 3]`."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = background
    r = size * rng.uniform(0.28, 0.4)
    cx, cy = (size / 2 + rng.uniform(-0.08, 0.08, size=2) * size)
    y, x = np.mgrid[0:size, 0:size] + 0.5
    if shape == "circle":
        mask = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif shape == "square":
        mask = (np.abs(x - cx) <= 0.85 * r) & (np.abs(y - cy) <= 0.85 * r)
    else:  # triangle, apex up
        rel = (y - (cy - r)) / (2 * r)
        mask = (rel >= 0) & (rel <= 1) & (np.abs(x - cx) <= rel * r)
    image[mask] = colour
    return image


class ColourQA:
    name, kind = "colour_qa", "image"
    shapes = ("circle", "square", "triangle")

    def sample(self, rng: np.random.Generator, image_size: int = 56, **_) -> QASample:
        from ..data.scenes import BACKGROUNDS, COLOURS

        shape = self.shapes[int(rng.integers(len(self.shapes)))]
        colour = sorted(COLOURS)[int(rng.integers(len(COLOURS)))]
        background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
        image = render_shape(shape, COLOURS[colour], background, image_size, rng)
        return QASample(self.name, f"What colour is the {shape}?", colour, tuple(sorted(COLOURS)), images=[image])

    def example(self, rng: np.random.Generator, image_size: int = 56, **_):
        return self.sample(rng, image_size=image_size).example()


class VideoQA:
    name, kind = "video_qa", "video"
    _FIXED = {"direction": ("left", "right", "up", "down"), "playback": ("forward", "reverse"),
              "flashes": tuple(str(i) for i in range(1, 9))}

    def sample(self, rng: np.random.Generator, video_size: int = 56, **_) -> QASample:
        from ..data.packing import Video
        from ..data.videos import make_clip

        clip = make_clip(rng, size=video_size)
        if clip.task == "first_mover":
            candidates = tuple(clip.params.colours)
        else:
            candidates = self._FIXED[clip.task]
        if clip.answer not in candidates:
            raise ValueError(f"video task {clip.task!r}: answer {clip.answer!r} not among candidates {candidates}")
        return QASample(f"{self.name}:{clip.task}", clip.question, clip.answer, candidates,
                        videos=[Video(clip.frames, clip.fps)])

    def example(self, rng: np.random.Generator, video_size: int = 56, **_):
        return self.sample(rng, video_size=video_size).example()


TASKS = {task.name: task for task in (ColourQA(), VideoQA())}


def qa_samples(task: str, n: int, seed: int, **sizes) -> list[QASample]:
    """`n` samples of `task` from a seed stream disjoint from training (which seeds with [seed, kind, step, j])."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    return [TASKS[task].sample(np.random.default_rng([seed, 7919, i]), **sizes) for i in range(n)]


def text_only_baseline(train: list[QASample], test: list[QASample]) -> float:
    """Accuracy of the best predictor that sees only the question: the most frequent training answer for that
    exact question (ties and unseen questions: the most frequent training answer among the candidates)."""
    from collections import Counter

    by_question: dict[str, Counter] = {}
    overall: Counter = Counter()
    for s in train:
        by_question.setdefault(s.question, Counter())[s.answer] += 1
        overall[s.answer] += 1
    correct = 0
    for s in test:
        counts = by_question.get(s.question, Counter())
        pick = max(s.candidates, key=lambda c: (counts[c], overall[c], c))
        correct += pick == s.answer
    return correct / max(1, len(test))
