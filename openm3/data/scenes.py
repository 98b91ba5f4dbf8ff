"""Procedurally rendered scenes whose captions and question/answer pairs come from the scene graph.

A scene is a few objects on a 3x3 grid of cells; each object has a shape (circle, square, triangle or a digit
drawn in a blocky font), a colour and a cell. Rendering uses numpy masks only (no anti-aliasing, no fonts from
the system), so the same scene gives the same bytes everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 210, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
}
BACKGROUNDS = ((20, 20, 20), (60, 60, 60), (35, 45, 70))
SHAPES = ("circle", "square", "triangle", "digit")
CELLS = (
    "top left", "top middle", "top right",
    "middle left", "centre", "middle right",
    "bottom left", "bottom middle", "bottom right",
)  # fmt: skip
# 3x5 glyphs for the digits, one string per row, '#' = ink.
_GLYPHS = {
    0: ("###", "#.#", "#.#", "#.#", "###"),
    1: (".#.", "##.", ".#.", ".#.", "###"),
    2: ("###", "..#", "###", "#..", "###"),
    3: ("###", "..#", ".##", "..#", "###"),
    4: ("#.#", "#.#", "###", "..#", "..#"),
    5: ("###", "#..", "###", "..#", "###"),
    6: ("###", "#..", "###", "#.#", "###"),
    7: ("###", "..#", ".#.", ".#.", ".#."),
    8: ("###", "#.#", "###", "#.#", "###"),
    9: ("###", "#.#", "###", "..#", "###"),
}
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass(frozen=True)
class SceneObject:
    """One object: ``shape`` in SHAPES, ``colour`` in COLOURS, ``cell`` in 0..8 (index into CELLS).

    ``digit`` is the digit drawn when ``shape == "digit"`` (else -1); ``dx, dy`` jitter the object in its cell.
    """

    shape: str
    colour: str
    cell: int
    digit: int = -1
    dx: int = 0
    dy: int = 0

    def phrase(self) -> str:
        what = f"digit {self.digit}" if self.shape == "digit" else self.shape
        return f"{'an' if self.colour[0] in 'aeiou' else 'a'} {self.colour} {what}"

    def name(self) -> str:
        """The phrase without its article: ``"red circle"``."""
        return self.phrase().split(" ", 1)[1]


@dataclass(frozen=True)
class Scene:
    """Objects in distinct cells over a background; ``size`` is the side of the square image in pixels."""

    objects: tuple[SceneObject, ...]
    background: tuple[int, int, int]
    size: int = 112


def sample_scene(rng: np.random.Generator, size: int = 112, max_objects: int = 5) -> Scene:
    """A random scene of 1..``max_objects`` objects in distinct cells (at most 9)."""
    if size < 42:
        raise ValueError(f"size: expected at least 42 pixels (14 per cell), got {size}")
    if not 1 <= max_objects <= len(CELLS):
        raise ValueError(f"max_objects: expected 1..{len(CELLS)}, got {max_objects}")
    n = int(rng.integers(1, max_objects + 1))
    cells = sorted(rng.choice(len(CELLS), size=n, replace=False).tolist())
    jitter = max(1, size // 3 // 10)
    objects = []
    for cell in cells:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        digit = int(rng.integers(10)) if shape == "digit" else -1
        dx, dy = (int(v) for v in rng.integers(-jitter, jitter + 1, size=2))
        objects.append(SceneObject(shape, colour, cell, digit, dx, dy))
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    return Scene(tuple(objects), background, size)


def _mask(obj: SceneObject, size: int) -> np.ndarray:
    cell = size / 3
    cx = (obj.cell % 3 + 0.5) * cell + obj.dx
    cy = (obj.cell // 3 + 0.5) * cell + obj.dy
    r = cell * 0.35
    y, x = np.mgrid[0:size, 0:size] + 0.5
    if obj.shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if obj.shape == "square":
        return (np.abs(x - cx) <= 0.85 * r) & (np.abs(y - cy) <= 0.85 * r)
    if obj.shape == "triangle":  # apex up
        rel = (y - (cy - r)) / (2 * r)
        return (rel >= 0) & (rel <= 1) & (np.abs(x - cx) <= rel * r)
    glyph = np.array([[c == "#" for c in row] for row in _GLYPHS[obj.digit]])
    scale = max(1, int(2 * r / 5))
    ink = np.kron(glyph, np.ones((scale, scale), dtype=bool))
    out = np.zeros((size, size), dtype=bool)
    top, left = round(cy - ink.shape[0] / 2), round(cx - ink.shape[1] / 2)
    ys, xs = slice(max(top, 0), min(top + ink.shape[0], size)), slice(max(left, 0), min(left + ink.shape[1], size))
    out[ys, xs] = ink[ys.start - top : ys.stop - top, xs.start - left : xs.stop - left]
    return out


def render_scene(scene: Scene) -> np.ndarray:
    """The scene as ``uint8 [size, size, 3]``."""
    image = np.empty((scene.size, scene.size, 3), dtype=np.uint8)
    image[:] = scene.background
    for obj in scene.objects:
        image[_mask(obj, scene.size)] = COLOURS[obj.colour]
    return image


def caption(scene: Scene) -> str:
    """One sentence listing every object and its cell, in reading order."""
    parts = [f"{o.phrase()} at the {CELLS[o.cell]}" for o in scene.objects]
    lead = "There is " if len(parts) == 1 else f"There are {_NUMBER_WORDS[len(parts)]} objects: "
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return lead + body + "."


def _plural(shape: str) -> str:
    return "digits" if shape == "digit" else shape + "s"


def questions(scene: Scene, rng: np.random.Generator, k: int = 3) -> list[tuple[str, str]]:
    """``k`` (question, answer) pairs drawn from all the pairs the scene graph supports."""
    objs = scene.objects
    pairs = [("How many objects are there?", str(len(objs)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    pairs.append((f"How many {colour} objects are there?", str(sum(o.colour == colour for o in objs))))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    pairs.append((f"How many {_plural(shape)} are there?", str(sum(o.shape == shape for o in objs))))
    cell = int(rng.integers(len(CELLS)))
    at = [o for o in objs if o.cell == cell]
    pairs.append((f"What is at the {CELLS[cell]}?", at[0].phrase() if at else "nothing"))
    for shape in SHAPES[:3]:
        same = [o for o in objs if o.shape == shape]
        if len(same) == 1:
            pairs.append((f"What colour is the {shape}?", same[0].colour))
    unique = [o for o in objs if sum(p.phrase() == o.phrase() for p in objs) == 1]
    if unique:
        o = unique[int(rng.integers(len(unique)))]
        pairs.append((f"Where is the {o.name()}?", f"at the {CELLS[o.cell]}"))
    digits = [o.digit for o in objs if o.shape == "digit"]
    if digits:
        pairs.append(("What is the sum of the digits shown?", str(sum(digits))))
    if len(unique) >= 2:
        a, b = (unique[int(i)] for i in rng.choice(len(unique), size=2, replace=False))
        left = a.cell % 3 < b.cell % 3
        pairs.append((f"Is the {a.name()} to the left of the {b.name()}?", "yes" if left else "no"))
    order = rng.permutation(len(pairs))[: min(k, len(pairs))]
    return [pairs[int(i)] for i in order]
