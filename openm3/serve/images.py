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

import torch

from ..data.chat import render_chat
from ..engine.scheduler import PromptImages
from ..models.processor import IMAGE_TOKEN, VIDEO_TOKEN, M3ImageProcessor, expand_prompt

# Decoded images larger than this are refused before their pixels are read (the processor shrinks every image to
# at most 451,584 pixels anyway; Pillow's own bomb check only starts at 89M).
MAX_IMAGE_PIXELS = 40_000_000
_DATA_URL = "data:image/png;base64,..."


def data_url_part(url: Any, where: str, field: str) -> dict:
    """The template's image part for an OpenAI image URL, which must be a base64 data URL; `where.field` names it
    in errors."""
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


def decode_image(part: dict):
    """The part's image, decoded by Pillow (RGB conversion is the processor's); ValueError naming the part."""
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
        pixels = image.width * image.height
        if pixels <= MAX_IMAGE_PIXELS:
            image.load()
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: the data is not an image Pillow can read ({type(e).__name__}: {e})") from None
    if pixels > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: the image has {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS} "
                         f"are accepted")
    return image


def image_parts(messages: Sequence[dict]) -> list[dict]:
    """The image parts of OpenAI-style messages, in the order the chat template numbers them."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == "image"]


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
    pixels, grids = [], []
    for part in image_parts(messages):
        image = decode_image(part)
        try:
            patches, grid = processor([image])
        except ValueError as e:
            raise ValueError(f"{part['where']}: {e}") from None
        pixels.append(patches)
        grids.append(grid)
    grid_thw = torch.cat(grids) if grids else None
    try:  # with no images this still checks that the text holds no image or video marker of its own
        text = expand_prompt(text, grid_thw, merge_size=vision.spatial_merge_size,
                             temporal_patch_size=vision.temporal_patch_size)
    except ValueError as e:
        raise ValueError(f"content: the text may not contain the marker strings {IMAGE_TOKEN!r} or "
                         f"{VIDEO_TOKEN!r} ({e})") from None
    return tokenizer.encode(text), PromptImages(torch.cat(pixels), grid_thw) if grids else None
