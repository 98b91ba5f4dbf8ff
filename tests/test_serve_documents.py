"""Documents agents send (`openm3.serve.documents`): a PDF's text layer or a text file reaches the prompt as text
through each API (Anthropic document blocks, Chat Completions `file` parts, Responses `input_file` parts), the same
prompt as that text sent plainly; what the server cannot read is a 400 naming the field."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient

from openm3.data.tokenizer import EOS
from openm3.serve import create_app
from openm3.serve.documents import data_url_text, file_text, pdf_text

from test_serve import NAME, Scripted, tok  # noqa: F401 - the fixture

PAGES = ["MSA keeps 16 blocks per query.", "", "Each block holds 128 keys."]
TEXT = "MSA keeps 16 blocks per query.\n\nEach block holds 128 keys."


def make_pdf(pages: list[str]) -> bytes:
    """A minimal PDF: one line of Helvetica text per page ('' gives a page without text)."""
    objs = ["<< /Type /Catalog /Pages 2 0 R >>", "", "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        body = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET" if text else ""
        objs.append(f"<< /Length {len(body)} >>\nstream\n{body}\nendstream")
        objs.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
                    f"/Contents {len(objs)} 0 R >>")
        kids.append(f"{len(objs)} 0 R")
    objs[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = b"%PDF-1.4\n", []
    for n, obj in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n{obj}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += "".join(f"{o:010d} 00000 n \n" for o in offsets).encode()
    out += f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


PDF = make_pdf(PAGES)
B64 = base64.b64encode(PDF).decode()
DATA_URL = "data:application/pdf;base64," + B64


def test_pdf_text_reads_the_pages_and_refuses_what_it_cannot_read():
    assert pdf_text(PDF, "f") == TEXT
    with pytest.raises(ValueError, match=r"^f: the PDF's 2 page\(s\) hold no text \(a scanned document\?\)"):
        pdf_text(make_pdf(["", ""]), "f")
    with pytest.raises(ValueError, match=r"^f: could not read the PDF \("):
        pdf_text(PDF[:200], "f")
    import pypdf

    writer = pypdf.PdfWriter(clone_from=io.BytesIO(PDF))
    writer.encrypt("secret", algorithm="RC4-128")
    locked = io.BytesIO()
    writer.write(locked)
    with pytest.raises(ValueError, match=r"^f: the PDF is encrypted with a password"):
        pdf_text(locked.getvalue(), "f")
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(PDF))
    writer.encrypt("", owner_password="owner", algorithm="RC4-128")  # opens without a password: read
    opened = io.BytesIO()
    writer.write(opened)
    assert pdf_text(opened.getvalue(), "f") == TEXT


def test_text_files_and_data_urls():
    assert file_text("héllo".encode(), "text/markdown", "f") == "héllo"
    assert file_text(b'{"a": 1}', "application/json", "f") == '{"a": 1}'
    assert file_text(PDF, "", "f") == TEXT  # no media type: a PDF by its magic bytes
    assert data_url_text(DATA_URL, "f") == TEXT
    for bad, match in (("héllo".encode("latin-1"), "a text/plain file must be UTF-8"),
                       (b"\x89PNG", "this server reads PDFs")):
        with pytest.raises(ValueError, match=match):
            file_text(bad, "text/plain" if bad[0] == 104 else "image/png", "f")
    for url, match in (("https://x/a.pdf", "expected a base64 data URL"), ("data:application/pdf,abc",
                       "expected base64 data"), ("data:application/pdf;base64,@@", "not valid base64")):
        with pytest.raises(ValueError, match=match):
            data_url_text(url, "f")


@pytest.fixture
def setup(tok):
    """A client over a scripted backend and `prompt(path, body)`: the prompt ids a request fed the backend."""
    backend = Scripted(tok.encode("ok" + EOS), tok.vocab_size)
    client = TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096))

    def prompt(path: str, body: dict) -> list[int]:
        r = client.post(path, json={"model": NAME, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        return backend.prompts[-1]
    return client, prompt


def test_each_api_shows_a_pdf_as_its_text(setup):
    client, prompt = setup
    ask = "What does it say?"
    # Anthropic: a base64 PDF document block, with a title and context, as Claude Code's Read tool sends one
    doc = {"type": "document", "title": "notes.pdf", "context": "From the wiki.",
           "source": {"type": "base64", "media_type": "application/pdf", "data": B64}}
    plain = f"notes.pdf\n\nFrom the wiki.\n\n{TEXT}\n\n{ask}"
    want = prompt("/v1/messages", {"messages": [{"role": "user", "content": plain}]})
    assert prompt("/v1/messages", {"messages": [{"role": "user", "content": [doc, {"type": "text", "text": ask}]}]}) \
        == want
    # Chat Completions: a `file` part (file_data as a data URL, the filename as its heading)
    plain = f"notes.pdf\n\n{TEXT}\n\n{ask}"
    want = prompt("/v1/chat/completions", {"messages": [{"role": "user", "content": plain}]})
    part = {"type": "file", "file": {"file_data": DATA_URL, "filename": "notes.pdf"}}
    assert prompt("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        part, {"type": "text", "text": ask}]}]}) == want
    count = client.post("/tokenize", json={"messages": [{"role": "user", "content": [
        part, {"type": "text", "text": ask}]}]}).json()["count"]
    assert count == len(want)
    # Responses: an input_file part, as a data URL and as bare base64
    want = prompt("/v1/responses", {"input": plain})
    for data in (DATA_URL, B64):
        item = {"type": "input_file", "file_data": data, "filename": "notes.pdf"}
        got = prompt("/v1/responses", {"input": [{"role": "user", "content": [
            item, {"type": "input_text", "text": ask}]}]})
        assert got == want


def test_documents_the_server_cannot_read_are_400s_naming_the_field(setup):
    client, _ = setup
    user = [{"role": "user", "content": None}]
    for path, content, where, says in (
            ("/v1/messages", [{"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}],
             "messages[0].content[0].source", "fetches nothing"),
            ("/v1/messages", [{"type": "document", "source": {"type": "file", "file_id": "f1"}}],
             "messages[0].content[0].source", "keeps no files"),
            ("/v1/messages", [{"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                              "data": base64.b64encode(make_pdf([""])).decode()}}],
             "messages[0].content[0].source", "hold no text"),
            ("/v1/chat/completions", [{"type": "file", "file": {"file_id": "file-1"}}],
             "messages[0].content[0].file.file_id", "keeps no files"),
            ("/v1/chat/completions", [{"type": "file", "file": {"file_data": "data:image/png;base64,AAAA"}}],
             "messages[0].content[0].file.file_data", "this server reads PDFs"),
            ("/v1/responses", [{"type": "input_file", "file_url": "https://x/a.pdf"}],
             "input[0].content[0].file_url", "fetches nothing")):
        key = "input" if path == "/v1/responses" else "messages"
        r = client.post(path, json={"model": NAME, "max_tokens": 2, key: [{**user[0], "content": content}]})
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(where + ":") and says in message, (path, message)
