"""Coded videos (MP4, WebM, MKV, ...) through `openm3.engine.media.decode_video`, which hands what Pillow cannot read
to PyAV: the frames kept are the evenly spread ones of a whole decode, timed by the stream's rate; a container whose
header miscounts its frames is picked again from the frames there are; and what cannot be taken (no video stream,
frames too large or too many, undecodable data, PyAV missing) is a ValueError naming the part."""

import base64
import io
import sys

import av
import numpy as np
import pytest

from openm3.engine import media

W, H = 64, 48


def moving_bar(n: int) -> np.ndarray:
    """n frames [n, H, W, 3] of a white bar 6 pixels wide moving right 3 pixels a frame (wrapping)."""
    frames = np.zeros((n, H, W, 3), np.uint8)
    for i in range(n):
        left = (3 * i) % (W - 6)
        frames[i, :, left:left + 6] = 255
    return frames


def encode(frames: np.ndarray, fmt: str = "mp4", codec: str = "mpeg4", rate: int = 8, path=None,
           options: dict | None = None) -> bytes:
    """The frames coded by FFmpeg (through PyAV) in a `fmt` container, in memory or through the file `path` (for
    muxer options that rewrite the file)."""
    target = io.BytesIO() if path is None else str(path)
    with av.open(target, "w", format=fmt, options=options or {}) as out:
        stream = out.add_stream(codec, rate=rate, options={"qscale": "2"} if codec == "mpeg4" else {})
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return target.getvalue() if path is None else path.read_bytes()


def part(data: bytes) -> dict:
    return {"data": base64.b64encode(data).decode(), "where": "v"}


def whole_decode(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def bar_left(frame: np.ndarray) -> int:
    """Where the bar starts: the first column brighter than half."""
    return int(np.argmax(frame.mean(axis=(0, 2)) > 128))


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("mp4", "libx264"), ("webm", "libvpx-vp9"),
                                       ("matroska", "mpeg4")])
def test_a_coded_video_decodes_to_its_frames_and_rate(fmt, codec):
    """20 frames at 8 fps in four container / codec pairs (WebM and MKV headers carry no frame count): every frame
    comes back, in order, at the stream's rate, with the bar where it was drawn."""
    frames = moving_bar(20)
    got, meta = media.decode_video(part(encode(frames, fmt, codec)))
    assert got.shape == (20, H, W, 3) and got.dtype == np.uint8
    assert meta.fps == 8.0 and list(meta.frames_indices) == list(range(20))
    assert [bar_left(f) for f in got] == [bar_left(f) for f in frames]
    assert np.abs(got.astype(int) - frames).mean() < 8  # lossy, but the same pictures


@pytest.mark.parametrize("fmt,codec", [("mp4", "libx264"), ("webm", "libvpx-vp9")])
def test_long_coded_videos_keep_evenly_spread_frames_of_a_whole_decode(fmt, codec):
    total = media.MAX_VIDEO_FRAMES + 36
    data = encode(moving_bar(total), fmt, codec)
    got, meta = media.decode_video(part(data))
    keep = np.linspace(0, total - 1, media.MAX_VIDEO_FRAMES).round().astype(int).tolist()
    assert list(meta.frames_indices) == keep and meta.frames_indices[-1] == total - 1
    every = whole_decode(data)
    assert got.shape[0] == media.MAX_VIDEO_FRAMES and all(np.array_equal(got[i], every[j]) for i, j in enumerate(keep))


def test_a_header_that_miscounts_is_picked_again_from_the_frames_there_are(tmp_path, monkeypatch):
    """An MP4 with its index first (`faststart`), cut short: its header still counts 100 frames and the decoder
    gives fewer; the second pass spreads the kept frames over those."""
    data = encode(moving_bar(100), path=tmp_path / "clip.mp4", options={"movflags": "faststart"})
    cut = data[:len(data) * 6 // 10]
    with av.open(io.BytesIO(cut)) as container:
        assert container.streams.video[0].frames == 100
    decoded = len(whole_decode(cut))
    assert 0 < decoded < media.MAX_VIDEO_FRAMES  # so the second pass keeps every frame there is
    passes = []
    pick = media._pick_frames
    monkeypatch.setattr(media, "_pick_frames", lambda *a: passes.append(len(a[3])) or pick(*a))
    got, meta = media.decode_video(part(cut))
    assert passes == [media.MAX_VIDEO_FRAMES, decoded]
    assert got.shape[0] == decoded and list(meta.frames_indices) == list(range(decoded))


def test_videos_pillow_reads_stay_with_pillow(monkeypatch):
    """An animated PNG does not need PyAV (nor touch it)."""
    from PIL import Image

    monkeypatch.setitem(sys.modules, "av", None)
    buf = io.BytesIO()
    first, *rest = [Image.fromarray(f) for f in moving_bar(3)]
    first.save(buf, format="PNG", save_all=True, append_images=rest, duration=250, loop=0)
    got, meta = media.decode_video(part(buf.getvalue()))
    assert np.array_equal(got, moving_bar(3)) and meta.fps == 4.0


def test_what_cannot_be_taken_is_a_value_error_naming_the_part(monkeypatch):
    data = encode(moving_bar(12))
    with pytest.raises(ValueError, match=r"^v: the data is neither an animation Pillow can read nor a video PyAV "
                                         r"can decode \(InvalidDataError"):
        media.decode_video(part(b"not a video at all" * 8))
    audio = io.BytesIO()
    with av.open(audio, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    with pytest.raises(ValueError, match=r"^v: the data holds no video stream \(a mov,mp4"):
        media.decode_video(part(audio.getvalue()))
    monkeypatch.setattr(media, "MAX_VIDEO_FRAME_PIXELS", W * H - 1)
    with pytest.raises(ValueError, match=f"^v: the video's frames have {W}x{H} pixels; at most {W * H - 1}"):
        media.decode_video(part(data))
    monkeypatch.setattr(media, "MAX_VIDEO_FRAME_PIXELS", W * H)
    monkeypatch.setattr(media, "MAX_VIDEO_SOURCE_FRAMES", 11)
    with pytest.raises(ValueError, match="^v: the video has 12 frames; at most 11 are accepted"):
        media.decode_video(part(data))
    monkeypatch.setattr(media, "MAX_VIDEO_SOURCE_FRAMES", 12)
    assert media.decode_video(part(data))[0].shape[0] == 12
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ValueError, match=r"^v: the data is not an image Pillow can read .*; other videos \(MP4, "
                                         r"WebM, \.\.\.\) need PyAV, which is not installed \(pip install "
                                         r"'openm3\[video\]'\)"):
        media.decode_video(part(data))
