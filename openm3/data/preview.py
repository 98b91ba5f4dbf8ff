"""Write sample images (PNG) and clips (GIF) with their captions and questions, so a person can look at them.

    python -m openm3.data.cli preview --out /tmp/openm3-preview      (also `openm3 data preview`)

Writes ``scene_*.png`` (rendered scenes), ``photo_*.png`` (skimage photographs), ``digit_*.png`` (sklearn
digits), ``video_<task>.gif`` (one clip per video task) and ``index.json`` / ``index.md`` with every caption,
question and answer. ``--image PATH`` also checks and includes your own image file (a corrupt file, channels that are
not 8-bit or a picture under 28 pixels is reported as an error, exit status 2). Pixels are scaled up by ``--scale``
(nearest neighbour) so small pictures are easy to see.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from . import images as img
from .corpora import require
from .packing import default_layout
from .scenes import caption, questions, render_scene, sample_scene
from .videos import TASKS, frames_answerable_alone, make_clip


def _scaled(image: np.ndarray, scale: int) -> np.ndarray:
    return np.kron(image, np.ones((scale, scale, 1), dtype=np.uint8)) if scale > 1 else image


def _png(path: Path, image: np.ndarray, scale: int) -> None:
    require("PIL.Image", "pillow").fromarray(_scaled(image, scale)).save(path)


def _gif(path: Path, frames: np.ndarray, fps: float, scale: int) -> None:
    pil = require("PIL.Image", "pillow")
    pics = [pil.fromarray(_scaled(f, scale)) for f in frames]
    pics[0].save(path, save_all=True, append_images=pics[1:], duration=int(1000 / fps), loop=0)


def write_preview(
    out: str | Path, seed: int = 0, count: int = 4, scale: int = 3, images: list[str | Path] = ()
) -> list[dict]:
    """Write the preview files into ``out`` and return the index entries (one dict per file).

    ``images``: extra image files to check and include (``input_<i>.png`` with their placeholder count); a bad file
    (corrupt, wrong channels, smaller than 28 pixels) raises ``ValueError`` before anything is written.
    """
    if count < 1:
        raise ValueError(f"count: expected >= 1, got {count}")
    if scale < 1:
        raise ValueError(f"scale: expected >= 1, got {scale}")
    inputs = [img.load_image(path) for path in images]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries = []
    for i, (path, pixels) in enumerate(zip(images, inputs)):
        _png(out / f"input_{i}.png", pixels, 1)
        tokens = sum(n for _, n in default_layout("image", pixels.shape))
        entries.append({"file": f"input_{i}.png", "source": str(path), "placeholder_tokens": tokens})
    for i in range(count):
        scene = sample_scene(rng)
        _png(out / f"scene_{i}.png", render_scene(scene), scale)
        qa = [{"question": q, "answer": a} for q, a in questions(scene, rng, k=4)]
        entries.append({"file": f"scene_{i}.png", "caption": caption(scene), "qa": qa})
    names = sorted(img.PHOTO_CAPTIONS)
    for i in range(count):
        photo = img.load_photo(names[int(rng.integers(len(names)))])
        _png(out / f"photo_{i}.png", img.photo_crop(photo, rng, 112), 1)
        entries.append({"file": f"photo_{i}.png", "caption": photo.caption, "source": f"skimage.data {photo.name}"})
    for i in range(count):
        pixels, label = img.digit_image(int(rng.integers(img.num_digits())), size=56)
        _png(out / f"digit_{i}.png", pixels, scale)
        entries.append({"file": f"digit_{i}.png", "qa": [{"question": "Which digit is written here?",
                                                          "answer": str(label)}]})  # fmt: skip
    for task in sorted(TASKS):
        clip = make_clip(rng, task)
        _gif(out / f"video_{task}.gif", clip.frames, clip.fps, scale)
        entries.append({
            "file": f"video_{task}.gif", "frames": int(clip.frames.shape[0]), "fps": clip.fps,
            "qa": [{"question": clip.question, "answer": clip.answer}],
            "frames_answerable_alone": frames_answerable_alone(TASKS[task], clip.params),
        })  # fmt: skip
    (out / "index.json").write_text(json.dumps(entries, indent=1))
    lines = ["# openm3 data preview", "", f"seed {seed}", ""]
    for e in entries:
        lines.append(f"## {e['file']}")
        if "caption" in e:
            lines.append(e["caption"])
        lines += [f"- Q: {qa['question']}  A: {qa['answer']}" for qa in e.get("qa", [])]
        lines.append("")
    (out / "index.md").write_text("\n".join(lines))
    return entries


def main(argv: list[str] | None = None) -> int:
    from ..cli import ArgumentParser

    parser = ArgumentParser(prog="openm3 data preview", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the PNG/GIF files and index into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=4, help="scenes, photos and digits to write (each)")
    parser.add_argument("--scale", type=int, default=3, help="nearest-neighbour upscaling of the small pictures")
    parser.add_argument("--image", action="append", default=[], help="also check and include this image file")
    args = parser.parse_args(argv)
    try:
        entries = write_preview(args.out, args.seed, args.count, args.scale, args.image)
    except ValueError as e:
        print(f"openm3 data preview: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(entries)} files and index.md to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
