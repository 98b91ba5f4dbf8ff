"""Documents in chat requests: PDFs and text files -> the text the chat template shows the model.

Agents send a file they read as a document: Anthropic's Messages as `{"type": "document", "source": {"type":
"base64", "media_type": "application/pdf", "data": ...}}` (also inside a `tool_result`), OpenAI's Chat
Completions as `{"type": "file", "file": {"file_data": "data:application/pdf;base64,...", "filename": ...}}` and
its Responses API as `{"type": "input_file", "file_data": ..., "filename": ...}`. A PDF's text layer is read with
pypdf (the `serve` extra), page by page; plain-text files (`text/*`, JSON, XML, ...) are decoded as UTF-8. The
model sees the text only: a page's images are not rendered (no PDF rasteriser among the dependencies), so a scanned
PDF without a text layer is refused rather than shown as nothing.

As with images, only inline data is taken (the server fetches nothing and keeps no files). Every error is a
ValueError naming the part or field; the endpoints answer it with a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

PDF = "application/pdf"
_TEXT_TYPES = ("application/json", "application/xml", "application/x-yaml", "application/yaml",
               "application/javascript", "application/x-sh", "application/x-python", "application/sql")
_FILE_DATA = "data:application/pdf;base64,..."


def decode_base64(data: Any, name: str) -> bytes:
    """The bytes of a base64 string at `name` (ValueError naming it when it is not one)."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"{name}: expected the file's bytes as a non-empty base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name}: not valid base64") from None


def pdf_text(raw: bytes, name: str) -> str:
    """A PDF's text, its pages' extracted text joined by blank lines (`name` in errors: the field it came in)."""
    try:
        from pypdf import PdfReader
    except ImportError:
        raise ValueError(f"{name}: reading PDFs needs pypdf on the server (pip install 'openm3[serve]')") from None
    try:
        reader = PdfReader(io.BytesIO(raw))
        locked = reader.is_encrypted and not reader.decrypt("")
        pages = [] if locked else [(page.extract_text() or "").strip() for page in reader.pages]
    except Exception as e:  # a sent file can break a parser in many ways; each is the request's fault
        raise ValueError(f"{name}: could not read the PDF ({type(e).__name__}: {e})") from None
    if locked:
        raise ValueError(f"{name}: the PDF is encrypted with a password; send it decrypted or as text")
    text = "\n\n".join(p for p in pages if p)
    if not text:
        raise ValueError(f"{name}: the PDF's {len(pages)} page(s) hold no text (a scanned document?); this server "
                         f"reads a PDF's text layer only: send the pages as images or the text")
    return text


def file_text(raw: bytes, media_type: str, name: str) -> str:
    """The text of a file of `media_type`: a PDF's text layer, a text file decoded as UTF-8."""
    media_type = media_type.lower()
    if media_type == PDF or (not media_type and raw[:5] == b"%PDF-"):
        return pdf_text(raw, name)
    if media_type.startswith("text/") or media_type in _TEXT_TYPES or media_type.endswith(("+json", "+xml")):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: a {media_type} file must be UTF-8 text") from None
    raise ValueError(f"{name}: this server reads PDFs ({PDF}) and text files (text/*, application/json, ...), got "
                     f"{media_type or 'no media type'!r}")


def data_url_text(url: Any, name: str) -> str:
    """The text of a file sent as a base64 data URL (OpenAI's `file_data`)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        got = type(url).__name__ if not isinstance(url, str) else repr(url[:24])
        raise ValueError(f"{name}: expected a base64 data URL ({_FILE_DATA}), got {got}")
    header, comma, data = url[len("data:"):].partition(",")
    media_type, *params = header.split(";")
    if not comma or "base64" not in params:
        raise ValueError(f"{name}: expected base64 data in the data URL ({_FILE_DATA}), got 'data:{header[:40]}'")
    return file_text(decode_base64(data, name), media_type, name)


def heading(*titles: Any) -> list[dict]:
    """Template text parts of a document's non-empty titles (a file name, a title, a context), a paragraph each."""
    return [{"type": "text", "text": t + "\n\n"} for t in titles if isinstance(t, str) and t]


def titled(text: str, *titles: Any) -> list[dict]:
    """A document as template text parts: its heading, its text, then a blank line (a message's parts are joined
    without a separator)."""
    return heading(*titles) + [{"type": "text", "text": text}, {"type": "text", "text": "\n\n"}]


def openai_file_parts(part: dict, where: str) -> list[dict]:
    """OpenAI's file part (Chat Completions' `file` object or a Responses `input_file` part, given as the dict
    holding `file_data` / `file_id` / `file_url` / `filename`) as template text parts."""
    data = part.get("file_data")
    if data is None:
        if part.get("file_id") is not None:
            raise ValueError(f"{where}.file_id: this server keeps no files; send file_data as a base64 data URL "
                             f"({_FILE_DATA})")
        if part.get("file_url") is not None:
            raise ValueError(f"{where}.file_url: this server fetches nothing; send file_data as a base64 data URL")
        raise ValueError(f"{where}.file_data: expected the file as a base64 data URL ({_FILE_DATA})")
    name = f"{where}.file_data"
    if isinstance(data, str) and not data.startswith("data:"):  # bare base64: a PDF or text by its bytes
        filename = part.get("filename") if isinstance(part.get("filename"), str) else ""
        raw = decode_base64(data, name)
        text = file_text(raw, PDF if raw[:5] == b"%PDF-" or filename.lower().endswith(".pdf") else "text/plain", name)
    else:
        text = data_url_text(data, name)
    return titled(text, part.get("filename"))
