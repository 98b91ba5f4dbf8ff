"""Images and videos for a chat prompt: encoded files -> Pillow -> the M3 processors' patches, and the prompt ids.

A media part is the chat template's `{"type": "image"}` or `{"type": "video"}` part plus where its bytes are:
`"data"` (base64, as the serving APIs carry them; `openm3.serve.images` parses their wire formats) or `"path"` (a
local file, `openm3 generate --image/--video`), and `"where"`, which names the part in errors. `chat_prompt`
renders the conversation with `render_chat`, decodes the media with Pillow, runs `M3ImageProcessor` /
`M3VideoProcessor` on them and expands each marker into its placeholder run with `expand_prompt`: the template,
processors and placeholder layout (`]<]start of image[>[`, one `]<]image[>[` per visual token, `]<]end of
image[>[`; a video's runs per temporal patch, each after its timestamp) that training uses, so the placeholders
match the visual tokens the engine scatters over them.

Videos are animated GIF, WebP or PNG files (Pillow decodes them, timed by the file's frame duration) or, with PyAV
installed (the `video` extra: FFmpeg's decoders in a wheel), any container and codec FFmpeg reads (MP4, WebM,
MOV, MKV, ...; H.264, HEVC, VP9, AV1, ...), timed by the stream's average frame rate. Either way at most
MAX_VIDEO_FRAMES frames are kept, sampled evenly. Every error is a ValueError naming the part. Pillow (the `data`
extra) is imported when the first medium is decoded, PyAV when the first video Pillow cannot read is.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from typing import Sequence

import numpy as np
import torch

from ..data.chat import render_chat
from ..data.chat_template import check_template_variables
from ..models.processor import IMAGE_TOKEN, VIDEO_TOKEN, M3ImageProcessor, M3VideoProcessor, VideoMeta, expand_prompt
from ..models.vision import DEFAULT_FRAMES_PER_CLIP
from .scheduler import PromptImages

# Decoded images larger than this are refused before their pixels are read (the processor shrinks every image to
# at most 451,584 pixels anyway; Pillow's own bomb check only starts at 89M).
MAX_IMAGE_PIXELS = 40_000_000
# Videos longer than MAX_VIDEO_FRAMES frames are sampled evenly down to it; each frame is bounded like an image.
MAX_VIDEO_FRAMES = 64
MAX_VIDEO_FRAME_PIXELS = 2_100_000  # 1920 x 1080 (the decoded frames of one video stay under ~400 MB)
DEFAULT_FRAME_MS = 100  # a frame without a duration (Pillow's `info["duration"]`) lasts 100 ms
# A coded video is decoded whole to pick its frames (its header's frame count is not always right): longer ones are
# refused (10 minutes at 30 frames per second; an H.264 decoder on one CPU core reads ~300-1000 such frames a second).
MAX_VIDEO_SOURCE_FRAMES = 18_000


def _raw(part: dict) -> bytes:
    """The part's encoded bytes: its base64 `data` or its file `path`."""
    where = part["where"]
    if "path" in part:
        try:
            with open(part["path"], "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{where}: cannot read {part['path']!r} ({e.strerror or e})") from None
    try:
        return base64.b64decode("".join(part["data"].split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the image data is not valid base64") from None


_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)


def _open(part: dict, raw: bytes | None = None):
    """The part's data (or `raw`, its bytes read already) opened by Pillow (not yet decoded) and the Image module;
    ValueError naming the part."""
    where = part["where"]
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"{where}: cannot decode images: Pillow is not installed (pip install 'openm3[data]')"
                         ) from None
    raw = _raw(part) if raw is None else raw
    try:
        image = Image.open(io.BytesIO(raw))
    except (*_PIL_ERRORS, Image.DecompressionBombError) as e:
        raise _NotAnImage(f"{where}: the data is not an image Pillow can read ({type(e).__name__}: {e})") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} "
                         f"are accepted")
    return image, Image


class _NotAnImage(ValueError):
    """Pillow cannot identify the data (a video may still be a coded one)."""


def decode_image(part: dict):
    """The part's image, decoded by Pillow (RGB conversion is the processor's); ValueError naming the part."""
    image, pil = _open(part)
    try:
        image.load()
    except (*_PIL_ERRORS, pil.DecompressionBombError) as e:
        raise ValueError(f"{part['where']}: the data is not an image Pillow can read ({type(e).__name__}: {e})") \
            from None
    return image


def decode_video(part: dict) -> tuple[np.ndarray, VideoMeta]:
    """The frames (uint8 [F, H, W, 3]) of the part's video and their times (`VideoMeta`: the source's frames per
    second and the source index of each kept frame); at most MAX_VIDEO_FRAMES, sampled evenly. An animation Pillow
    reads is decoded by Pillow; anything else by PyAV (MP4, WebM, ...), when it is installed."""
    raw = _raw(part)
    try:
        image, pil = _open(part, raw)
    except _NotAnImage as e:
        return _decode_coded_video(raw, part["where"], str(e))
    _check_frame_size(part["where"], image.width, image.height)
    total = getattr(image, "n_frames", 1)
    keep = _evenly(total)
    frames = []
    try:
        for index in keep:
            image.seek(index)
            frames.append(np.asarray(image.convert("RGB")))
        image.seek(0)
    except (*_PIL_ERRORS, pil.DecompressionBombError) as e:
        raise ValueError(f"{part['where']}: the data is not an animation Pillow can read ({type(e).__name__}: {e})"
                         ) from None
    frame_ms = image.info.get("duration") or DEFAULT_FRAME_MS
    return np.stack(frames), VideoMeta(fps=1000.0 / frame_ms, frames_indices=keep)


def _evenly(total: int) -> list[int]:
    """The source indices of the frames kept from `total`: all, or MAX_VIDEO_FRAMES spread evenly, first and last
    included."""
    return np.linspace(0, total - 1, min(total, MAX_VIDEO_FRAMES)).round().astype(int).tolist()


def _check_frame_size(where: str, width: int, height: int, error: type[Exception] = ValueError) -> None:
    if width * height > MAX_VIDEO_FRAME_PIXELS:
        raise error(f"{where}: the video's frames have {width}x{height} pixels; at most "
                         f"{MAX_VIDEO_FRAME_PIXELS} are accepted (the video processor keeps far fewer)")


def _decode_coded_video(raw: bytes, where: str, pillow_error: str) -> tuple[np.ndarray, VideoMeta]:
    """`decode_video` for a container PyAV reads: its first video stream, decoded whole (frames in presentation
    order), the evenly spread frames kept as RGB at the first frame's size; timed by the stream's average rate.
    The frame count comes from the container (or a count of its packets), and a second pass picks again when the
    decoder gave another count."""
    try:
        import av
    except ImportError:
        raise ValueError(f"{pillow_error}; other videos (MP4, WebM, ...) need PyAV, which is not installed "
                         f"(pip install 'openm3[video]')") from None
    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if not container.streams.video:
                raise _Refused(f"{where}: the data holds no video stream (a {container.format.name} container)")
            stream = container.streams.video[0]
            _check_frame_size(where, stream.codec_context.width, stream.codec_context.height, _Refused)
            rate = stream.average_rate or stream.guessed_rate
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        fps = float(rate) if rate else 1000.0 / DEFAULT_FRAME_MS
        for _ in range(2):
            if total > MAX_VIDEO_SOURCE_FRAMES:
                raise _Refused(f"{where}: the video has {total} frames; at most {MAX_VIDEO_SOURCE_FRAMES} are "
                               f"accepted (it is decoded whole to sample {MAX_VIDEO_FRAMES} of them)")
            keep = _evenly(total)
            frames, decoded = _pick_frames(av, raw, where, set(keep))
            if decoded == total:
                break
            total = decoded  # the container's count was wrong: pick from the frames there are
        else:
            raise _Refused(f"{where}: the decoder gave a different number of frames on each pass")
    except _Refused as e:
        raise ValueError(str(e)) from None
    except (av.FFmpegError, OSError, ValueError, EOFError) as e:
        raise ValueError(f"{where}: the data is neither an animation Pillow can read nor a video PyAV can decode "
                         f"({type(e).__name__}: {e})") from None
    if not frames:
        raise ValueError(f"{where}: the video stream holds no frames")
    return np.stack(frames), VideoMeta(fps=fps, frames_indices=keep)


class _Refused(Exception):
    """A video PyAV reads that this server will not take (the message names the part)."""


def _pick_frames(av, raw: bytes, where: str, keep: set[int]) -> tuple[list[np.ndarray], int]:
    """The frames at the `keep` indices of the first video stream (RGB, all at the first frame's size), and how many
    frames it decoded to."""
    frames, decoded, size = [], 0, None
    with av.open(io.BytesIO(raw), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if decoded >= MAX_VIDEO_SOURCE_FRAMES:
                raise _Refused(f"{where}: the video decodes to more than {MAX_VIDEO_SOURCE_FRAMES} frames; at most "
                               f"that many are accepted")
            if decoded in keep:
                size = size or (frame.width, frame.height)
                frames.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
            decoded += 1
    return frames, decoded


def media_parts(messages: Sequence[dict], kind: str) -> list[dict]:
    """The parts of one kind ("image" or "video") of OpenAI-style messages, in the order the chat template numbers
    them."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == kind]


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, prefill: str = "",
                vl_config=None, template=None, generation_prompt: bool = True,
                template_variables: dict | None = None, frames_per_clip: int | None = DEFAULT_FRAMES_PER_CLIP
                ) -> tuple[list[int], PromptImages | None]:
    """(prompt token ids, images or None) of a conversation with the generation prompt (unless
    `generation_prompt` is false), then `prefill` text.

    vl_config: the served VL model's `M3VLConfig` (its vision config sizes the patches and placeholder runs);
    None for a text model, whose prompt is the rendered text, encoded. template: a checkpoint's own chat template
    (`openm3.data.chat_template.ChatTemplate`) instead of the built-in `render_chat`. Raises ValueError naming
    the bad part. template_variables: more variables for a checkpoint's template (`ChatTemplate`'s `variables`);
    checked, and unused by the built-in template, which reads none. frames_per_clip: temporal patches per video
    clip, the span of the vision tower's attention (a checkpoint's `video_frames_per_clip`; None: whole videos)."""
    if template is not None:
        text = template(messages, tools, add_generation_prompt=generation_prompt, variables=template_variables)
    else:
        check_template_variables(template_variables)
        text = render_chat(messages, tools, add_generation_prompt=generation_prompt)
    text += prefill
    if vl_config is None:
        return tokenizer.encode(text), None
    vision = vl_config.vision_config
    processor = M3ImageProcessor(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                 merge_size=vision.spatial_merge_size)
    videos = M3VideoProcessor(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                              merge_size=vision.spatial_merge_size, frames_per_clip=frames_per_clip)
    pixels, grids, video_pixels, video_grids, clips, metas = [], [], [], [], [], []
    for part in media_parts(messages, "image"):
        image = decode_image(part)
        try:
            patches, grid = processor([image])
        except ValueError as e:
            raise ValueError(f"{part['where']}: {e}") from None
        pixels.append(patches)
        grids.append(grid)
    for part in media_parts(messages, "video"):
        frames, meta = decode_video(part)
        try:
            patches, grid, counts = videos([frames])
        except ValueError as e:
            raise ValueError(f"{part['where']}: {e}") from None
        video_pixels.append(patches)
        video_grids.append(grid)
        clips += counts
        metas.append(meta)
    grid_thw = torch.cat(grids) if grids else None
    video_grid_thw = torch.cat(video_grids) if video_grids else None
    try:  # with no images this still checks that the text holds no image or video marker of its own
        text = expand_prompt(text, grid_thw, video_grid_thw, clips if metas else None, metas if metas else None,
                             merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size)
    except ValueError as e:
        raise ValueError(f"content: the text may not contain the marker strings {IMAGE_TOKEN!r} or "
                         f"{VIDEO_TOKEN!r} ({e})") from None
    if not grids and not video_grids:
        return tokenizer.encode(text), None
    return tokenizer.encode(text), PromptImages(torch.cat(pixels) if pixels else None, grid_thw,
                                                torch.cat(video_pixels) if video_pixels else None, video_grid_thw)
