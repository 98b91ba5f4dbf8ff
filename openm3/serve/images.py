"""Images and videos in chat requests: the three APIs' wire formats -> the chat template's media parts.

OpenAI's Chat Completions carries an image as `{"type": "image_url", "image_url": {"url": "data:image/png;base64,
..."}}` (and vLLM's extension a video as `{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}`:
a `video/*` file PyAV decodes, or an animated GIF, WebP or PNG), OpenAI's Responses as `{"type": "input_image",
"image_url": "data:..."}`, Anthropic's Messages as `{"type": "image", "source": {"type": "base64", "media_type":
"image/png", "data": ...}}`. Each endpoint turns its parts into the template's `{"type": "image"}` / `{"type":
"video"}` parts (`data_url_part`, `base64_part`: they keep the base64 data and where the part was, for errors);
`openm3.engine.media.chat_prompt` then decodes them and builds the prompt exactly as training writes it.

Only inline data is accepted: the server fetches nothing, so an http(s) URL is refused. Every error is a
ValueError naming the part or field; the endpoints answer it with a 400.
"""

from __future__ import annotations

from typing import Any, Sequence

_DATA_URL = "data:image/png;base64,..."
# Videos come as coded video files (any `video/*` type: MP4, WebM, ...; decoded by PyAV, the `video` extra) or as
# animated images Pillow decodes (`openm3.engine.media`).
ANIMATION_MEDIA_TYPES = ("image/gif", "image/webp", "image/png", "image/apng")


def data_url_part(url: Any, where: str, field: str, video: bool = False) -> dict:
    """The template's image part for an OpenAI image URL (its video part for vLLM's `video_url`: a `video/*` file
    or an animated GIF, WebP or PNG), which must be a base64 data URL; `where.field` names it in errors."""
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
        if not (media_type.startswith("video/") or media_type in ANIMATION_MEDIA_TYPES):
            raise ValueError(f"{name}: videos are accepted as data URLs of a video/* type (MP4, WebM, ...) or of an "
                             f"animated {', '.join(ANIMATION_MEDIA_TYPES)}, got {media_type or 'no media type'!r}")
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
