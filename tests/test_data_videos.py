"""Video tasks: answers need several frames (checked by construction), renderers agree with answers, determinism."""

from dataclasses import replace

import numpy as np
import pytest

from openm3.data.scenes import BACKGROUNDS, COLOURS
from openm3.data.videos import MAX_FRAMES, MIN_FRAMES, TASKS, Direction, frames_answerable_alone, make_clip

SEEDS = range(25)


@pytest.mark.parametrize("size", [28, 56, 84], ids=["H28-W28", "H56-W56", "H84-W84"])
@pytest.mark.parametrize("task", sorted(TASKS))
def test_no_single_frame_gives_the_answer(task, size):
    answers = set()
    for seed in SEEDS:
        clip = make_clip(np.random.default_rng(seed), task, size=size)
        assert frames_answerable_alone(TASKS[task], clip.params) == []
        assert MIN_FRAMES <= clip.frames.shape[0] <= MAX_FRAMES
        assert clip.frames.shape[1:] == (size, size, 3) and clip.frames.dtype == np.uint8
        answers.add(clip.answer)
    assert len(answers) >= 2  # the task really has several answers


class _ColourTask(Direction):
    """A broken task whose answer (the colour) is visible in every frame: the check must catch it."""

    def answer(self, p):
        return p.colour

    def witness(self, p, frame):
        return replace(p, colour="red" if p.colour != "red" else "blue"), frame


def test_check_flags_answers_visible_in_one_frame():
    task = _ColourTask()
    params = task.sample(np.random.default_rng(0), 56)
    assert frames_answerable_alone(task, params) == list(range(params.num_frames))


def test_check_flags_invalid_or_same_answer_witnesses(monkeypatch):
    task = Direction()
    params = task.sample(np.random.default_rng(0), 56)
    monkeypatch.setattr(task, "witness", lambda p, i: (p, i))  # same clip: same answer
    assert frames_answerable_alone(task, params) == list(range(params.num_frames))
    monkeypatch.setattr(task, "witness", lambda p, i: (replace(p, x0=-100), i))  # outside the generator's support
    assert frames_answerable_alone(task, params) == list(range(params.num_frames))


def _mask(frames, colour):
    return (frames == np.array(colour, dtype=np.uint8)).all(-1)  # [T, H, W]


def _centroid(mask):
    ys, xs = np.nonzero(mask)
    return xs.mean(), ys.mean()


@pytest.mark.parametrize("seed", SEEDS)
def test_direction_pixels_agree(seed):
    clip = make_clip(np.random.default_rng(seed), "direction")
    m = _mask(clip.frames, COLOURS[clip.params.colour])
    (x0, y0), (x1, y1) = _centroid(m[0]), _centroid(m[-1])
    dx, dy = x1 - x0, y1 - y0
    expected = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
    assert clip.answer == expected


@pytest.mark.parametrize("seed", SEEDS)
def test_first_mover_pixels_agree(seed):
    clip = make_clip(np.random.default_rng(seed), "first_mover")

    def first_change(colour):
        m = _mask(clip.frames, COLOURS[colour])
        return next(t for t in range(1, len(m)) if not np.array_equal(m[t], m[0]))

    a, b = clip.params.colours
    assert clip.answer == (a if first_change(a) < first_change(b) else b)
    assert a in clip.question and b in clip.question


@pytest.mark.parametrize("seed", SEEDS)
def test_flash_count_pixels_agree(seed):
    clip = make_clip(np.random.default_rng(seed), "flashes")
    lit = _mask(clip.frames, COLOURS[clip.params.colour]).any((1, 2)).astype(int)
    flashes = int(lit[0]) + int((np.diff(lit) == 1).sum())
    assert clip.answer == str(flashes)


@pytest.mark.parametrize("seed", SEEDS)
def test_playback_pixels_agree(seed):
    clip = make_clip(np.random.default_rng(seed), "playback")
    background = np.array(BACKGROUNDS[clip.params.background], dtype=np.uint8)
    filled = (clip.frames != background).any(-1).sum((1, 2))
    steps = np.diff(filled)
    assert (steps > 0).all() or (steps < 0).all()
    assert clip.answer == ("forward" if steps[0] > 0 else "reverse")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_clips_are_deterministic(task):
    a = make_clip(np.random.default_rng(7), task)
    b = make_clip(np.random.default_rng(7), task)
    assert a.frames.tobytes() == b.frames.tobytes() and (a.question, a.answer) == (b.question, b.answer)
    c = make_clip(np.random.default_rng(8), task)
    assert c.frames.tobytes() != a.frames.tobytes()


def test_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="task"):
        make_clip(rng, "juggling")
    with pytest.raises(ValueError, match="size"):
        make_clip(rng, "direction", size=16)
    with pytest.raises(ValueError, match="fps"):
        make_clip(rng, "direction", fps=0)
    params = TASKS["flashes"].sample(rng, 56)
    with pytest.raises(ValueError, match="num_frames"):
        TASKS["flashes"].validate(replace(params, pattern=(1, 0)))
    with pytest.raises(ValueError, match="flash count"):
        TASKS["flashes"].validate(replace(params, pattern=(0, 0, 0, 0)))
