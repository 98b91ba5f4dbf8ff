"""Procedurally rendered clips (4-16 frames) whose answer needs several frames.

Four tasks: ``direction`` (which way an object moves), ``first_mover`` (which of two objects starts moving
first), ``flashes`` (how many times a lamp flashes) and ``playback`` (is a tower being built, i.e. forward, or
taken apart, i.e. reversed). Each task is a small class with explicit parameters, so a clip is a pure function of
its parameters and the support of the generator is written down in ``validate``.

**Single frames do not give the answer, by construction.** For every frame of a clip, the task names a *witness*:
another valid clip (``validate`` accepts it) with the same question and a different answer, one of whose frames is
pixel-for-pixel the same. :func:`frames_answerable_alone` renders both and returns the frames for which that fails;
generation asserts it is empty. (For ``direction`` and ``playback`` the witness is the time-reversed clip, which the
generator draws with the same probability, so even the distribution of a single frame is the same for both answers.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .scenes import BACKGROUNDS, COLOURS

MIN_FRAMES, MAX_FRAMES = 4, 16
_PALETTE = ("red", "green", "blue", "yellow", "purple", "orange", "white")


def _draw(frame: np.ndarray, shape: str, colour: tuple[int, int, int], x: int, y: int, size: int) -> None:
    """Draw a ``size``-pixel circle or square with top-left corner ``(x, y)`` into ``frame [H, W, 3]``."""
    if shape == "square":
        frame[y : y + size, x : x + size] = colour
        return
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    r = size / 2
    disk = (xx - r) ** 2 + (yy - r) ** 2 <= r * r
    frame[y : y + size, x : x + size][disk] = colour


def _blank(n: int, size: int, background: tuple[int, int, int]) -> np.ndarray:
    frames = np.empty((n, size, size, 3), dtype=np.uint8)
    frames[:] = background
    return frames


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"params: {what}")


def _frames_ok(n: int) -> None:
    _check(MIN_FRAMES <= n <= MAX_FRAMES, f"num_frames expected in [{MIN_FRAMES}, {MAX_FRAMES}], got {n}")


def _inside(x: int, y: int, obj: int, size: int) -> bool:
    return 0 <= x and 0 <= y and x + obj <= size and y + obj <= size


# --------------------------------------------------------------------------------------------------- direction
@dataclass(frozen=True)
class DirectionParams:
    num_frames: int
    size: int
    background: int  # index into BACKGROUNDS
    shape: str
    colour: str
    obj: int  # object side in pixels
    x0: int
    y0: int
    vx: int  # pixels per frame; exactly one of vx, vy is non-zero
    vy: int


class Direction:
    name = "direction"
    question_text = "In which direction does the {colour} {shape} move: left, right, up or down?"

    def sample(self, rng: np.random.Generator, size: int) -> DirectionParams:
        n = int(rng.integers(MIN_FRAMES, MAX_FRAMES + 1))
        obj = max(4, size // 6)
        speed = int(rng.integers(1, max(1, min(4, (size - obj) // (n - 1))) + 1))
        axis = int(rng.integers(2))
        sign = 1 if rng.integers(2) else -1
        span = speed * (n - 1)
        along = int(rng.integers(0, size - obj - span + 1)) + (span if sign < 0 else 0)
        across = int(rng.integers(0, size - obj + 1))
        x0, y0 = (along, across) if axis == 0 else (across, along)
        vx, vy = (sign * speed, 0) if axis == 0 else (0, sign * speed)
        shape = ("circle", "square")[int(rng.integers(2))]
        colour = _PALETTE[int(rng.integers(len(_PALETTE)))]
        return DirectionParams(n, size, int(rng.integers(len(BACKGROUNDS))), shape, colour, obj, x0, y0, vx, vy)

    def validate(self, p: DirectionParams) -> None:
        _frames_ok(p.num_frames)
        _check((p.vx == 0) != (p.vy == 0), f"exactly one of vx, vy must be non-zero, got {p.vx}, {p.vy}")
        for t in (0, p.num_frames - 1):
            _check(_inside(p.x0 + p.vx * t, p.y0 + p.vy * t, p.obj, p.size), f"object leaves the frame at t={t}")

    def render(self, p: DirectionParams) -> np.ndarray:
        frames = _blank(p.num_frames, p.size, BACKGROUNDS[p.background])
        for t in range(p.num_frames):
            _draw(frames[t], p.shape, COLOURS[p.colour], p.x0 + p.vx * t, p.y0 + p.vy * t, p.obj)
        return frames

    def question(self, p: DirectionParams) -> str:
        return self.question_text.format(colour=p.colour, shape=p.shape)

    def answer(self, p: DirectionParams) -> str:
        if p.vx:
            return "right" if p.vx > 0 else "left"
        return "down" if p.vy > 0 else "up"

    def witness(self, p: DirectionParams, frame: int) -> tuple[DirectionParams, int]:
        last = p.num_frames - 1
        rev = replace(p, x0=p.x0 + p.vx * last, y0=p.y0 + p.vy * last, vx=-p.vx, vy=-p.vy)
        return rev, last - frame


# ------------------------------------------------------------------------------------------------- first mover
@dataclass(frozen=True)
class FirstMoverParams:
    num_frames: int
    size: int
    background: int
    colours: tuple[str, str]
    obj: int
    starts: tuple[tuple[int, int], tuple[int, int]]  # (x, y) of each object at frame 0
    velocities: tuple[tuple[int, int], tuple[int, int]]  # (vx, vy) once moving
    move_at: tuple[int, int]  # first frame at which each object has moved
    mention_order: tuple[int, int]  # which colour the question names first


class FirstMover:
    name = "first_mover"

    def position(self, p: FirstMoverParams, i: int, t: int) -> tuple[int, int]:
        steps = max(0, t - p.move_at[i] + 1)
        (x, y), (vx, vy) = p.starts[i], p.velocities[i]
        return x + vx * steps, y + vy * steps

    def sample(self, rng: np.random.Generator, size: int) -> FirstMoverParams:
        n = int(rng.integers(MIN_FRAMES, MAX_FRAMES + 1))
        obj = max(4, size // 7)
        first, second = sorted(rng.choice(np.arange(1, n), size=2, replace=False).tolist())
        move_at = (first, second) if rng.integers(2) else (second, first)
        c = rng.choice(len(_PALETTE), size=2, replace=False)
        colours = (_PALETTE[int(c[0])], _PALETTE[int(c[1])])
        starts, velocities = [], []
        half = size // 2
        for i in range(2):  # object 0 in the top half, object 1 in the bottom half: they never overlap
            steps = n - move_at[i]
            # Fastest speed (at most 3 px a frame) that keeps the object in its half along each axis.
            room_x, room_y = min(3, (size - obj) // steps), min(3, (half - obj) // steps)
            sx, sy = (int(v) for v in rng.choice([-1, 0, 1], size=2))
            sy = sy if room_y else 0
            sx = sx if sx or sy else (1 if rng.integers(2) else -1)
            speed = min(room_x if sx else 3, room_y if sy else 3)
            vx, vy = sx * speed, sy * speed
            lo_x, hi_x = max(0, -vx * steps), size - obj - max(0, vx * steps)
            lo_y, hi_y = max(0, -vy * steps), half - obj - max(0, vy * steps)
            x = int(rng.integers(lo_x, hi_x + 1))
            y = int(rng.integers(lo_y, hi_y + 1)) + i * half
            starts.append((x, y))
            velocities.append((vx, vy))
        order = (0, 1) if rng.integers(2) else (1, 0)
        return FirstMoverParams(
            n, size, int(rng.integers(len(BACKGROUNDS))), colours, obj, tuple(starts), tuple(velocities),
            move_at, order,
        )  # fmt: skip

    def validate(self, p: FirstMoverParams) -> None:
        _frames_ok(p.num_frames)
        _check(p.colours[0] != p.colours[1], "the two objects need different colours")
        _check(p.move_at[0] != p.move_at[1], "the objects must start moving at different frames")
        _check(all(1 <= m < p.num_frames for m in p.move_at), f"move_at expected in [1, num_frames), got {p.move_at}")
        _check(all(v != (0, 0) for v in p.velocities), "each object needs a non-zero velocity")
        for i in range(2):
            for t in (0, p.num_frames - 1):
                _check(_inside(*self.position(p, i, t), p.obj, p.size), f"object {i} leaves the frame at t={t}")

    def render(self, p: FirstMoverParams) -> np.ndarray:
        frames = _blank(p.num_frames, p.size, BACKGROUNDS[p.background])
        for t in range(p.num_frames):
            for i in range(2):
                _draw(frames[t], "square", COLOURS[p.colours[i]], *self.position(p, i, t), p.obj)
        return frames

    def question(self, p: FirstMoverParams) -> str:
        a, b = (p.colours[i] for i in p.mention_order)
        return f"Which square starts moving first, the {a} one or the {b} one?"

    def answer(self, p: FirstMoverParams) -> str:
        return p.colours[0] if p.move_at[0] < p.move_at[1] else p.colours[1]

    def witness(self, p: FirstMoverParams, frame: int) -> tuple[FirstMoverParams, int]:
        # Both objects rest where they are in `frame`; the one that moved second in `p` now moves first, one pixel
        # a step towards the centre, so a 4-frame clip stays in the picture.
        starts = (self.position(p, 0, frame), self.position(p, 1, frame))
        centre = (p.size - p.obj) / 2

        def towards(x: int, y: int) -> tuple[int, int]:
            return (1 if x < centre else -1), (1 if y < centre else -1)

        late = 0 if p.move_at[0] > p.move_at[1] else 1
        move_at = (1, 2) if late == 0 else (2, 1)
        w = replace(p, num_frames=MIN_FRAMES, starts=starts, velocities=(towards(*starts[0]), towards(*starts[1])),
                    move_at=move_at)  # fmt: skip
        return w, 0


# ----------------------------------------------------------------------------------------------------- flashes
@dataclass(frozen=True)
class FlashParams:
    size: int
    background: int
    colour: str
    obj: int
    x: int
    y: int
    pattern: tuple[int, ...]  # 1 = lamp on in that frame


def count_runs(pattern: tuple[int, ...]) -> int:
    """Number of maximal runs of 1s (flashes) in a 0/1 pattern."""
    return sum(1 for i, v in enumerate(pattern) if v and (i == 0 or not pattern[i - 1]))


class Flashes:
    name = "flashes"
    max_flashes = 4

    def sample(self, rng: np.random.Generator, size: int) -> FlashParams:
        n = int(rng.integers(MIN_FRAMES + 2, MAX_FRAMES + 1))
        k = int(rng.integers(1, min(self.max_flashes, n // 2) + 1))
        # Flash j is on for frames [b[2j], b[2j+1]) with b strictly increasing in [0, n], so flashes are
        # non-empty and separated by at least one dark frame; one flash filling the whole clip is redrawn.
        while True:
            b = sorted(rng.choice(n + 1, size=2 * k, replace=False).tolist())
            pattern = tuple(int(any(b[2 * j] <= t < b[2 * j + 1] for j in range(k))) for t in range(n))
            if 0 in pattern:
                break
        obj = max(6, size // 3)
        x, y = (int(v) for v in rng.integers(0, size - obj + 1, size=2))
        colour = _PALETTE[int(rng.integers(len(_PALETTE) - 1))]  # not white: the unlit lamp is a dim version
        return FlashParams(size, int(rng.integers(len(BACKGROUNDS))), colour, obj, x, y, pattern)

    def validate(self, p: FlashParams) -> None:
        _frames_ok(len(p.pattern))
        _check(set(p.pattern) <= {0, 1}, "pattern must hold 0s and 1s")
        _check(1 <= count_runs(p.pattern) <= self.max_flashes, f"flash count expected in 1..{self.max_flashes}")
        _check(_inside(p.x, p.y, p.obj, p.size), "lamp outside the frame")

    def render(self, p: FlashParams) -> np.ndarray:
        frames = _blank(len(p.pattern), p.size, BACKGROUNDS[p.background])
        lit = COLOURS[p.colour]
        dim = tuple(c // 4 + 30 for c in lit)
        for t, on in enumerate(p.pattern):
            _draw(frames[t], "circle", lit if on else dim, p.x, p.y, p.obj)
        return frames

    def question(self, p: FlashParams) -> str:
        return "How many times does the lamp flash?"

    def answer(self, p: FlashParams) -> str:
        return str(count_runs(p.pattern))

    def witness(self, p: FlashParams, frame: int) -> tuple[FlashParams, int]:
        other = (0, 1, 0, 0, 0) if count_runs(p.pattern) != 1 else (1, 0, 1, 0, 0)
        w = replace(p, pattern=other)
        return w, other.index(p.pattern[frame])


# ---------------------------------------------------------------------------------------------------- playback
@dataclass(frozen=True)
class PlaybackParams:
    size: int
    background: int
    colour: str
    block: int  # block height in pixels
    x: int
    heights: tuple[int, ...]  # blocks in the tower at each frame; +1 or -1 per frame


class Playback:
    name = "playback"
    question_text = "A tower is built one block at a time. Is this clip playing forward or in reverse?"

    def max_height(self, size: int, block: int) -> int:
        return size // block

    def sample(self, rng: np.random.Generator, size: int) -> PlaybackParams:
        block = max(3, size // 12)
        top = self.max_height(size, block)
        n = int(rng.integers(MIN_FRAMES, min(MAX_FRAMES, top + 1) + 1))
        h0 = int(rng.integers(0, top - (n - 1) + 1))
        heights = tuple(range(h0, h0 + n))
        if rng.integers(2):
            heights = heights[::-1]
        x = int(rng.integers(0, size - 2 * block + 1))
        colour = _PALETTE[int(rng.integers(len(_PALETTE)))]
        return PlaybackParams(size, int(rng.integers(len(BACKGROUNDS))), colour, block, x, heights)

    def validate(self, p: PlaybackParams) -> None:
        _frames_ok(len(p.heights))
        steps = {b - a for a, b in zip(p.heights, p.heights[1:])}
        _check(steps in ({1}, {-1}), "heights must change by +1 every frame, or by -1 every frame")
        top = self.max_height(p.size, p.block)
        _check(all(0 <= h <= top for h in p.heights), f"heights expected in [0, {top}]")

    def render(self, p: PlaybackParams) -> np.ndarray:
        frames = _blank(len(p.heights), p.size, BACKGROUNDS[p.background])
        colour = np.array(COLOURS[p.colour])
        for t, h in enumerate(p.heights):
            for b in range(h):
                y1 = p.size - b * p.block
                # A darker line on top of each block shows where one block ends and the next begins.
                frames[t, y1 - p.block : y1, p.x : p.x + 2 * p.block] = colour
                frames[t, y1 - p.block, p.x : p.x + 2 * p.block] = colour // 2
        return frames

    def question(self, p: PlaybackParams) -> str:
        return self.question_text

    def answer(self, p: PlaybackParams) -> str:
        return "forward" if p.heights[-1] > p.heights[0] else "reverse"

    def witness(self, p: PlaybackParams, frame: int) -> tuple[PlaybackParams, int]:
        return replace(p, heights=p.heights[::-1]), len(p.heights) - 1 - frame


TASKS = {task.name: task for task in (Direction(), FirstMover(), Flashes(), Playback())}


# ------------------------------------------------------------------------------------------------------- clips
@dataclass(frozen=True)
class Clip:
    """A rendered clip: ``frames uint8 [T, H, W, 3]`` at ``fps`` frames per second, its question and answer."""

    task: str
    params: object
    frames: np.ndarray
    fps: float
    question: str
    answer: str


def frames_answerable_alone(task, params) -> list[int]:
    """Indices of the frames of ``task.render(params)`` that are *not* shown to fit a second answer.

    Frame ``i`` passes when the task's witness clip is valid, asks the same question, has a different answer and
    contains a frame equal (every byte) to frame ``i``. An empty list means no single frame gives the answer away.
    """
    task.validate(params)
    frames = task.render(params)
    bad = []
    for i in range(len(frames)):
        other, j = task.witness(params, i)
        try:
            task.validate(other)
        except ValueError:
            bad.append(i)
            continue
        same_question = task.question(other) == task.question(params)
        if not same_question or task.answer(other) == task.answer(params):
            bad.append(i)
            continue
        if not np.array_equal(task.render(other)[j], frames[i]):
            bad.append(i)
    return bad


def make_clip(rng: np.random.Generator, task: str | None = None, size: int = 56, fps: float = 2.0) -> Clip:
    """A random clip of ``task`` (default: one of TASKS at random), ``size x size`` pixels, 4-16 frames.

    Raises ``AssertionError`` if some single frame would give the answer (never, for the tasks here).
    """
    if task is None:
        task = sorted(TASKS)[int(rng.integers(len(TASKS)))]
    if task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {task!r}")
    if size < 28:
        raise ValueError(f"size: expected at least 28 pixels, got {size}")
    if fps <= 0:
        raise ValueError(f"fps: expected a positive number, got {fps}")
    t = TASKS[task]
    params = t.sample(rng, size)
    t.validate(params)
    bad = frames_answerable_alone(t, params)
    assert not bad, f"{task}: frames {bad} give the answer away"
    return Clip(task, params, t.render(params), fps, t.question(params), t.answer(params))
