"""Images that ship with installed packages, and the checks every image passes before it is used.

Images are ``uint8`` arrays ``[H, W, 3]`` (RGB); videos are ``uint8`` arrays ``[T, H, W, 3]``.
Real photographs come from the files inside ``scikit-image`` (``skimage/data``, read directly so nothing is ever
downloaded); handwritten digits from scikit-learn's bundled 8x8 ``load_digits`` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np

from .corpora import require

MIN_SIZE = 28  # one 2x2 merge of 14-pixel patches


def check_image(image, *, name: str = "image", min_size: int = MIN_SIZE) -> np.ndarray:
    """Validate and return an RGB image as a ``uint8`` array ``[H, W, 3]``.

    Accepts a ``uint8`` array ``[H, W, 3]`` or a PIL image (converted to RGB). Wrong rank, channel count or
    dtype, and images smaller than ``min_size`` on a side, raise ``ValueError`` naming ``name``.
    """
    if hasattr(image, "convert") and hasattr(image, "mode"):  # a PIL image
        image = np.asarray(image.convert("RGB"))
    if not isinstance(image, np.ndarray):
        raise ValueError(f"{name}: expected a uint8 array [H, W, 3] or a PIL image, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[-1] != 3:
        channels = image.shape[-1] if image.ndim == 3 else "no channel axis"
        raise ValueError(f"{name}: expected shape [H, W, 3] (RGB), got {list(image.shape)} ({channels} channels)")
    if image.dtype != np.uint8:
        raise ValueError(f"{name}: expected dtype uint8, got {image.dtype}")
    h, w = image.shape[:2]
    if min(h, w) < min_size:
        raise ValueError(f"{name}: expected at least {min_size}x{min_size} pixels, got {h}x{w}")
    return np.ascontiguousarray(image)


def check_video(frames, *, name: str = "video", min_size: int = MIN_SIZE, min_frames: int = 1) -> np.ndarray:
    """Validate and return a clip as a ``uint8`` array ``[T, H, W, 3]`` with ``T >= min_frames``."""
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"{name}: expected a uint8 array [T, H, W, 3], got {type(frames).__name__}")
    if frames.ndim != 4:
        raise ValueError(f"{name}: expected shape [T, H, W, 3], got {list(frames.shape)}")
    if frames.shape[0] < min_frames:
        raise ValueError(f"{name}: expected at least {min_frames} frames, got {frames.shape[0]}")
    for t in range(frames.shape[0]):
        check_image(frames[t], name=f"{name}[{t}]", min_size=min_size)
    return np.ascontiguousarray(frames)


# 8-bit modes whose conversion to RGB keeps the picture's meaning; 16-bit and float images ("I;16", "I", "F") do not.
_CONVERTIBLE_MODES = {"RGB", "RGBA", "RGBX", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr"}


def load_image(path: str | Path, *, min_size: int = MIN_SIZE) -> np.ndarray:
    """Read an image file as RGB ``uint8 [H, W, 3]`` (grey, palette, alpha and CMYK files are converted).

    Missing, unreadable or corrupt files, files whose channels are not 8-bit, and pictures smaller than
    ``min_size`` raise ``ValueError``.
    """
    pil = require("PIL.Image", "pillow")

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"path: expected an image file, got {str(path)!r} (no such file)")
    try:
        with pil.open(path) as im:
            im.load()
            mode = im.mode
            rgb = im.convert("RGB") if mode in _CONVERTIBLE_MODES else None
    except (pil.UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"path: {str(path)!r} is not a readable image file ({type(e).__name__}: {e})") from None
    if rgb is None:
        raise ValueError(f"path: {str(path)!r} has channels of mode {mode!r}; expected 8-bit RGB, grey or palette")
    return check_image(rgb, name=f"image {path.name}", min_size=min_size)


def resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of ``[H, W, 3]`` to ``size = (height, width)`` (deterministic: PIL)."""
    pil = require("PIL.Image", "pillow")
    h, w = size
    return np.asarray(pil.fromarray(check_image(image, min_size=1)).resize((w, h), pil.BILINEAR))


@dataclass(frozen=True)
class Photo:
    """A photograph from ``skimage.data``: its file, what it shows, and its pixels ``[H, W, 3]``."""

    name: str
    caption: str
    pixels: np.ndarray


# File name -> a description written for this project by looking at each picture.
PHOTO_CAPTIONS = {
    "astronaut.png": "A portrait of an astronaut in a white spacesuit, with an American flag behind her.",
    "camera.png": "A black-and-white photograph of a man in a dark coat looking through a camera on a tripod.",
    "coffee.png": "A cup of coffee on a red saucer with a spoon, on a wooden table.",
    "chelsea.png": "A close-up of a tabby cat with green eyes.",
    "rocket.jpg": "A rocket standing on a launch pad at dusk, between lit towers.",
    "coins.png": "A greyscale photograph of many old coins laid out in rows on a dark background.",
    "moon.png": "A greyscale photograph of the cratered surface of the moon.",
    "hubble_deep_field.jpg": "A telescope image of many small distant galaxies on a black sky.",
    "retina.jpg": "A photograph of the back of a human eye, with red blood vessels spreading from a bright spot.",
    "motorcycle_left.png": "A red motorcycle parked in a storeroom with shelves and boxes behind it.",
    "ihc.png": "A microscope image of stained tissue in brown and pale blue.",
    "brick.png": "A greyscale close-up of a brick wall.",
    "grass.png": "A greyscale close-up of grass.",
    "gravel.png": "A greyscale close-up of gravel.",
}


@lru_cache(maxsize=1)
def _photo_dir() -> Path:
    return Path(require("skimage", "scikit-image").__file__).parent / "data"


@cache
def load_photo(name: str) -> Photo:
    """One photograph by file name (a key of ``PHOTO_CAPTIONS``), read from the installed scikit-image."""
    if name not in PHOTO_CAPTIONS:
        raise ValueError(f"name: expected one of {sorted(PHOTO_CAPTIONS)}, got {name!r}")
    pixels = load_image(_photo_dir() / name)
    pixels.setflags(write=False)
    return Photo(name, PHOTO_CAPTIONS[name], pixels)


def photo_crop(photo: Photo, rng: np.random.Generator, size: int) -> np.ndarray:
    """A random square crop (60-100% of the shorter side) of ``photo`` resized to ``[size, size, 3]``."""
    h, w = photo.pixels.shape[:2]
    side = int(min(h, w) * rng.uniform(0.6, 1.0))
    y = int(rng.integers(0, h - side + 1))
    x = int(rng.integers(0, w - side + 1))
    return resize(photo.pixels[y : y + side, x : x + side], (size, size))


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    data = require("sklearn.datasets", "scikit-learn").load_digits()
    images = data.images.astype(np.float64)  # [N, 8, 8], values 0..16, ink is high
    labels = data.target.astype(np.int64)
    return images, labels


def num_digits() -> int:
    """How many 8x8 digits scikit-learn ships (1797)."""
    return len(_digits()[1])


def digit_image(index: int, size: int = 56) -> tuple[np.ndarray, int]:
    """Digit ``index`` of scikit-learn's set as dark ink on white, ``[size, size, 3]`` (nearest upscaling), and its
    label."""
    images, labels = _digits()
    if not 0 <= index < len(labels):
        raise ValueError(f"index: expected 0 <= index < {len(labels)}, got {index}")
    if size < 8 or size % 8:
        raise ValueError(f"size: expected a positive multiple of 8, got {size}")
    gray = 255 - np.round(images[index] * (255 / 16)).astype(np.uint8)
    big = np.kron(gray, np.ones((size // 8, size // 8), dtype=np.uint8))
    return np.repeat(big[:, :, None], 3, axis=2), int(labels[index])
