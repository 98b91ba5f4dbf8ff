"""Images: validation of bad inputs, bundled photographs and digits, procedurally rendered scenes."""

import numpy as np
import pytest
from PIL import Image

from openm3.data import images as img
from openm3.data.scenes import CELLS, COLOURS, caption, questions, render_scene, sample_scene


@pytest.mark.parametrize(
    "array, match",
    [
        (np.zeros((64, 64), np.uint8), "channels"),
        (np.zeros((64, 64, 4), np.uint8), "4 channels"),
        (np.zeros((64, 64, 1), np.uint8), "1 channels"),
        (np.zeros((3, 64, 64), np.uint8), "64 channels"),
        (np.zeros((64, 64, 3), np.float32), "uint8"),
        (np.zeros((20, 64, 3), np.uint8), "at least 28x28"),
        ([[0, 0, 0]], "uint8 array"),
    ],
    ids=["H64-W64-gray", "H64-W64-C4", "H64-W64-C1", "C3-H64-W64", "float32", "H20-W64", "list"],
)
def test_check_image_rejects_bad_arrays(array, match):
    with pytest.raises(ValueError, match=match):
        img.check_image(array)


def test_check_video():
    assert img.check_video(np.zeros((4, 32, 32, 3), np.uint8)).shape == (4, 32, 32, 3)
    with pytest.raises(ValueError, match=r"video\[0\].*uint8"):
        img.check_video(np.zeros((3, 32, 32, 3), np.float32))
    with pytest.raises(ValueError, match=r"video\[0\].*4 channels"):
        img.check_video(np.zeros((3, 32, 32, 4), np.uint8))
    with pytest.raises(ValueError, match="T, H, W, 3"):
        img.check_video(np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="at least 4 frames"):
        img.check_video(np.zeros((2, 32, 32, 3), np.uint8), min_frames=4)


def test_load_image_files(tmp_path):
    rgba = np.random.default_rng(0).integers(0, 256, (40, 50, 4), dtype=np.uint8)
    Image.fromarray(rgba).save(tmp_path / "ok.png")
    loaded = img.load_image(tmp_path / "ok.png")
    assert loaded.shape == (40, 50, 3) and loaded.dtype == np.uint8
    assert np.array_equal(loaded, rgba[..., :3])  # RGBA -> RGB drops alpha

    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(200)))
    with pytest.raises(ValueError, match="not a readable image"):
        img.load_image(tmp_path / "corrupt.png")
    full = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match="not a readable image"):
        img.load_image(tmp_path / "truncated.png")
    (tmp_path / "text.jpg").write_text("not an image")
    with pytest.raises(ValueError, match="not a readable image"):
        img.load_image(tmp_path / "text.jpg")
    Image.fromarray(np.zeros((40, 40), np.uint16) + 300).save(tmp_path / "deep.png")  # 16-bit grey
    with pytest.raises(ValueError, match="expected 8-bit"):
        img.load_image(tmp_path / "deep.png")
    Image.fromarray(rgba[..., 0]).save(tmp_path / "grey.png")
    assert np.array_equal(img.load_image(tmp_path / "grey.png"), np.repeat(rgba[..., :1], 3, axis=2))
    Image.fromarray(rgba[:10, :10]).save(tmp_path / "tiny.png")
    with pytest.raises(ValueError, match="at least 28x28"):
        img.load_image(tmp_path / "tiny.png")
    with pytest.raises(ValueError, match="no such file"):
        img.load_image(tmp_path / "missing.png")


@pytest.mark.parametrize("name", sorted(img.PHOTO_CAPTIONS))
def test_photos_load_from_the_package(name):
    photo = img.load_photo(name)
    assert photo.pixels.dtype == np.uint8 and photo.pixels.shape[2] == 3 and min(photo.pixels.shape[:2]) >= 191
    assert photo.caption.endswith(".")


def test_photo_crop_is_deterministic():
    photo = img.load_photo("astronaut.png")
    a = img.photo_crop(photo, np.random.default_rng(1), 112)
    b = img.photo_crop(photo, np.random.default_rng(1), 112)
    c = img.photo_crop(photo, np.random.default_rng(2), 112)
    assert a.shape == (112, 112, 3) and a.tobytes() == b.tobytes() and a.tobytes() != c.tobytes()


def test_digits():
    assert img.num_digits() == 1797
    pixels, label = img.digit_image(0, size=56)
    assert pixels.shape == (56, 56, 3) and label == 0
    assert pixels.min() < 64 and pixels.max() == 255  # dark ink on white paper
    with pytest.raises(ValueError, match="index"):
        img.digit_image(5000)
    with pytest.raises(ValueError, match="size"):
        img.digit_image(0, size=30)


@pytest.mark.parametrize("seed", range(8))
def test_scene_render_matches_graph(seed):
    scene = sample_scene(np.random.default_rng(seed))
    image = render_scene(scene)
    assert image.shape == (112, 112, 3) and image.dtype == np.uint8
    assert render_scene(sample_scene(np.random.default_rng(seed))).tobytes() == image.tobytes()
    cell = 112 / 3
    for obj in scene.objects:
        # The object's colour is drawn inside its own cell.
        r, c = divmod(obj.cell, 3)
        patch = image[int(r * cell) : int((r + 1) * cell), int(c * cell) : int((c + 1) * cell)]
        assert (patch == COLOURS[obj.colour]).all(-1).sum() > 20
        if obj.shape in ("circle", "square"):
            cy, cx = int((r + 0.5) * cell + obj.dy), int((c + 0.5) * cell + obj.dx)
            assert tuple(image[cy, cx]) == COLOURS[obj.colour]
    text = caption(scene)
    assert all(f"{o.phrase()} at the {CELLS[o.cell]}" in text for o in scene.objects)


@pytest.mark.parametrize("seed", range(8))
def test_scene_answers_follow_the_graph(seed):
    rng = np.random.default_rng(seed)
    scene = sample_scene(rng)
    qa = dict(questions(scene, rng, k=20))
    assert qa["How many objects are there?"] == str(len(scene.objects))
    for q, a in qa.items():
        if q.startswith("What colour is the "):
            shape = q[len("What colour is the ") : -1]
            assert [o.colour for o in scene.objects if o.shape == shape] == [a]
        if q.startswith("What is at the "):
            cell = CELLS.index(q[len("What is at the ") : -1])
            at = [o.phrase() for o in scene.objects if o.cell == cell]
            assert a == (at[0] if at else "nothing")


def test_scene_bad_arguments():
    with pytest.raises(ValueError, match="size"):
        sample_scene(np.random.default_rng(0), size=20)
    with pytest.raises(ValueError, match="max_objects"):
        sample_scene(np.random.default_rng(0), max_objects=10)
