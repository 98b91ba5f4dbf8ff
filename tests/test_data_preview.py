"""`openm3 data preview`: PNG and GIF files a person can open, with captions and questions."""

import json

from PIL import Image

from openm3.data.preview import main
from openm3.data.videos import TASKS


def test_preview_writes_images_video_and_index(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--count", "2", "--seed", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    index = json.loads((tmp_path / "index.json").read_text())
    files = {e["file"]: e for e in index}
    for kind in ("scene", "photo", "digit"):
        for i in range(2):
            with Image.open(tmp_path / f"{kind}_{i}.png") as im:
                assert im.format == "PNG" and im.mode == "RGB" and min(im.size) >= 56
    assert files["scene_0.png"]["caption"] and files["scene_0.png"]["qa"]
    for task in TASKS:
        entry = files[f"video_{task}.gif"]
        with Image.open(tmp_path / entry["file"]) as gif:
            # Pillow merges identical neighbouring frames into one longer frame: compare total play time.
            assert gif.format == "GIF" and 2 <= gif.n_frames <= entry["frames"]
            total = 0
            for i in range(gif.n_frames):
                gif.seek(i)
                total += gif.info["duration"]
            assert total == entry["frames"] * int(1000 / entry["fps"])
        assert entry["frames_answerable_alone"] == [] and entry["qa"][0]["answer"]
    assert (tmp_path / "index.md").read_text().startswith("# openm3 data preview")


def test_preview_is_deterministic(tmp_path):
    main(["--out", str(tmp_path / "a"), "--count", "1"])
    main(["--out", str(tmp_path / "b"), "--count", "1"])
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_preview_checks_given_images(tmp_path, capsys):
    import numpy as np

    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((60, 90, 3), np.uint8)).save(good)
    assert main(["--out", str(tmp_path / "ok"), "--count", "1", "--image", str(good)]) == 0
    entry = json.loads((tmp_path / "ok" / "index.json").read_text())[0]
    assert entry["file"] == "input_0.png" and entry["placeholder_tokens"] == 2 * 3

    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    small = tmp_path / "small.png"
    Image.fromarray(np.zeros((10, 10, 3), np.uint8)).save(small)
    for path, message in ((bad, "not a readable image"), (small, "at least 28x28")):
        out = tmp_path / f"out_{path.stem}"
        assert main(["--out", str(out), "--image", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path.name) in err
        assert not out.exists()  # nothing written when an input is bad


def test_data_cli_dispatches(tmp_path, capsys):
    from openm3.data.cli import main as data_main

    assert data_main(["preview", "--out", str(tmp_path), "--count", "1"]) == 0
    assert (tmp_path / "index.md").is_file()
    capsys.readouterr()
    assert data_main(["nonsense"]) == 2 and "error: unknown command 'nonsense': one of preview, tokenizer" in \
        capsys.readouterr().err
    assert data_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: openm3 data {preview,tokenizer}") and "  tokenizer  train openm3's" in out
