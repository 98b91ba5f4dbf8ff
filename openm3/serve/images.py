"""Images in chat requests: inline base64 data -> Pillow images -> the M3 processor's patches, and the prompt.

The three chat APIs carry an image differently: OpenAI's Chat Completions as `{"type": "image_url", "image_url":
{"url": "data:image/png;base64,..."}}`, OpenAI's Responses as `{"type": "input_image", "image_url": "data:..."}`,
Anthropic's Messages as `{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ...}}`.
Each endpoint turns its parts into the chat template's `{"type": "image"}` parts (`data_url_part`, `base64_part`:
they keep the data and where the part was, for errors). `chat_prompt` then renders the conversation with
`render_chat`, decodes the images with Pillow, runs `M3ImageProcessor` on them and expands each image marker into
its placeholder run with `expand_prompt`: the template, processor and placeholder layout (`]<]start of image[>[`,
one `]<]image[>[` per visual token, `]<]end of image[>[`) that training uses, so the placeholders match the visual
tokens the engine scatters over them.

Chat Completions also takes vLLM's `{"type": "video_url", "video_url": {"url": "data:image/gif;base64,..."}}`
parts: an animated GIF, WebP or PNG (Pillow decodes them; there is no video codec among the dependencies), whose
frames (at most MAX_VIDEO_FRAMES, sampled evenly) and frame times go through `M3VideoProcessor` and the video
placeholder layout (one run per temporal patch, each after its timestamp), as training writes them.

Only inline data is accepted: the server fetches nothing, so an http(s) URL is refused. Every error is a
ValueError naming the part or field; the endpoints answer it with a 400. Pillow (the `data` extra) is imported
when the first image is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from typing import Any, Sequence

import numpy as np
import torch

from ..data.chat import render_chat
from ..engine.scheduler import PromptImages
from ..models.processor import IMAGE_TOKEN, VIDEO_TOKEN, M3ImageProcessor, M3VideoProcessor, VideoMeta, expand_prompt

# Decoded images larger than this are refused before their pixels are read (the processor shrinks every image to
# at most 451,584 pixels anyway; Pillow's own bomb check only starts at 89M).
MAX_IMAGE_PIXELS = 40_000_000
_DATA_URL = "data:image/png;base64,..."
# Videos come as animated images Pillow decodes (no video codec among the dependencies). Longer ones are sampled
# evenly down to MAX_VIDEO_FRAMES frames; each frame is bounded like an image.
VIDEO_MEDIA_TYPES = ("image/gif", "image/webp", "image/png", "image/apng")
MAX_VIDEO_FRAMES = 64
DEFAULT_FRAME_MS = 100  # a frame without a duration (Pillow's `info["duration"]`) lasts 100 ms


def data_url_part(url: Any, where: str, field: str, video: bool = False) -> dict:
    """The template's image part for an OpenAI image URL (its video part for vLLM's `video_url`: an animated GIF,
    WebP or PNG), which must be a base64 data URL; `where.field` names it in errors."""
    name = f"{where}.{field}"
    if not isinstance(url, str) or not url:
        raise ValueError(f"{name}: expected a data URL string ({_DATA_URL}), got {type(url).__name__}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url[:12] else "a path"
        raise ValueError(f"{name}: only data URLs ({_DATA_URL}) are accepted; this server fetches nothing, "
                         f"got {scheme!r}")
    header, comma, data = url[len("data:"):].partition(",")
    media_type, *params = header.split(";")
    if not comma or "base64" not in params:
        raise ValueError(f"{name}: expected base64 data in the data URL ({_DATA_URL}), got 'data:{header[:40]}'")
    if video:
        if media_type not in VIDEO_MEDIA_TYPES:
            raise ValueError(f"{name}: videos are accepted as animated {', '.join(VIDEO_MEDIA_TYPES)} data URLs "
                             f"(this server has no video decoder), got {media_type or 'no media type'!r}")
        return {"type": "video", "data": data, "where": where}
    return _part(media_type, data, where, name)


def base64_part(source: Any, where: str) -> dict:
    """The template's image part for an Anthropic image `source` (at `where`), which must be a base64 source."""
    if not isinstance(source, dict):
        raise ValueError(f"{where}: expected {{'type': 'base64', 'media_type': 'image/png', 'data': ...}}, got "
                         f"{type(source).__name__}")
    if source.get("type") != "base64":
        raise ValueError(f"{where}.type: only base64 sources are accepted (this server fetches nothing), got "
                         f"{source.get('type')!r}")
    if not isinstance(source.get("data"), str):
        raise ValueError(f"{where}.data: expected the image as a base64 string")
    return _part(source.get("media_type") or "", source["data"], where, f"{where}.media_type")


def _part(media_type: str, data: str, where: str, name: str) -> dict:
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"{name}: expected an image media type (image/png, image/jpeg, ...), got {media_type!r}")
    return {"type": "image", "data": data, "where": where}


def content_of(parts: Sequence[dict]) -> str | list[dict]:
    """A message's content from template parts: the joined text when all are text (exactly what a text-only
    conversation renders), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return list(parts)


_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)


def _open(part: dict):
    """The part's data opened by Pillow (not yet decoded) and the Image module; ValueError naming the part."""
    where = part["where"]
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"{where}: this server cannot decode images: Pillow is not installed (pip install "
                         f"'openm3[data]')") from None
    try:
        raw = base64.b64decode("".join(part["data"].split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the image data is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw))
    except (*_PIL_ERRORS, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: the data is not an image Pillow can read ({type(e).__name__}: {e})") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} "
                         f"are accepted")
    return image, Image


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
    """The frames (uint8 [F, H, W, 3]) of the part's animated image and their times (`VideoMeta`: fps from the
    first frame's duration, source index of each kept frame); at most MAX_VIDEO_FRAMES, sampled evenly."""
    image, pil = _open(part)
    total = getattr(image, "n_frames", 1)
    keep = np.linspace(0, total - 1, min(total, MAX_VIDEO_FRAMES)).round().astype(int).tolist()
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


def image_parts(messages: Sequence[dict], kind: str = "image") -> list[dict]:
    """The image (or video) parts of OpenAI-style messages, in the order the chat template numbers them."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == kind]


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, prefill: str = "",
                vl_config=None) -> tuple[list[int], PromptImages | None]:
    """(prompt token ids, images or None) of a conversation with the generation prompt, then `prefill` text.

    vl_config: the served VL model's `M3VLConfig` (its vision config sizes the patches and placeholder runs);
    None for a text model, whose prompt is the rendered text, encoded. Raises ValueError naming the bad part."""
    text = render_chat(messages, tools, add_generation_prompt=True) + prefill
    if vl_config is None:
        return tokenizer.encode(text), None
    vision = vl_config.vision_config
    processor = M3ImageProcessor(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                 merge_size=vision.spatial_merge_size)
    videos = M3VideoProcessor(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                              merge_size=vision.spatial_merge_size)
    pixels, grids, video_pixels, video_grids, clips, metas = [], [], [], [], [], []
    for part in image_parts(messages):
        image = decode_image(part)
        try:
            patches, grid = processor([image])
        except ValueError as e:
            raise ValueError(f"{part['where']}: {e}") from None
        pixels.append(patches)
        grids.append(grid)
    for part in image_parts(messages, "video"):
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
