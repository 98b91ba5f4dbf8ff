"""`openm3.files`: `atomic_write` leaves the old file or the new one and, when the write fails, no temporary file;
`remove_orphaned_temporaries`: the temporary files of writers that died before their rename go; those of running
processes, this one's and other names stay."""

import os
import subprocess
import sys
import threading

import pytest

from openm3.files import atomic_write, process_alive, remove_orphaned_temporaries
from openm3.serve.response_store import ResponseStore


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not process_alive(child.pid)
    return child.pid


def test_only_dead_writers_temporaries_are_removed(tmp_path):
    dead, live = dead_pid(), os.getppid()
    names = [f"tokenizer.json.{dead}.tmp", f"a.json.{dead}.140234.tmp",  # orphans
             f"tokenizer.json.{live}.tmp", f"tokenizer.json.{os.getpid()}.tmp",  # writers at work
             "tokenizer.json", f"tokenizer.json.{dead}.tmp.bak", "notes.tmp"]  # not temporaries of this form
    for name in names:
        (tmp_path / name).write_text("x")
    assert sorted(remove_orphaned_temporaries(tmp_path)) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    (tmp_path / f"b.json.{dead}.tmp").write_text("x")
    assert remove_orphaned_temporaries(tmp_path, r"tokenizer\.json") == []  # another target's: kept


def test_a_writers_thread_id_is_not_read_as_its_process_id(tmp_path):
    """The stored responses' temporaries carry the thread's id (`threading.get_ident()`, past a pid_t) after the
    process's: the default target's match left it to be read as the process id, and os.kill overflowed."""
    orphan = tmp_path / f"a.json.{dead_pid()}.{threading.get_ident()}.tmp"
    orphan.write_text("x")
    assert remove_orphaned_temporaries(tmp_path) == [orphan.name]


def test_a_response_store_opening_its_directory_removes_only_dead_writers_temporaries(tmp_path):
    rid, thread = "resp_" + "a" * 32, threading.get_ident()
    orphan = f"{rid}.json.{dead_pid()}.{thread}.tmp"  # a write a crashed server cut short
    kept = [f"{rid}.json.{os.getpid()}.{thread}.tmp", f"{rid}.json.{os.getppid()}.{thread}.tmp",  # writers at work
            f"{rid}.json.{2**40}.{thread}.tmp",  # no process has that id: not a temporary of this form
            "notes.tmp", f"{rid}.json.tmp", f"tokenizer.json.{dead_pid()}.tmp", f"resp_x.json.{dead_pid()}.1.tmp"]
    for name in (orphan, *kept):
        (tmp_path / name).write_text('{"items": [')
    assert ResponseStore(4, str(tmp_path)).get(rid) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_an_atomic_write_leaves_the_old_file_or_the_new_one_and_no_temporary(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(ZeroDivisionError):
        with atomic_write(target) as tmp:
            assert tmp == f"{target}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write("half")
            1 / 0
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"] and target.read_text() == "old"
    with atomic_write(target, per_thread=True) as tmp:
        assert tmp.endswith(f".{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            f.write("new")
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"] and target.read_text() == "new"
    with pytest.raises(FileNotFoundError):  # the block wrote nothing: the rename fails, nothing is left
        with atomic_write(target):
            pass
    assert target.read_text() == "new"
    assert remove_orphaned_temporaries(tmp_path / "missing") == []  # a folder it cannot list: nothing to sweep


def test_a_response_stores_failed_write_leaves_no_temporary(tmp_path):
    """A response json cannot write (or a full disk) failed midway and left its `.tmp` until the next start."""
    store, rid = ResponseStore(4, str(tmp_path)), "resp_" + "b" * 32
    store.put(rid, [], {"output": [], "n": 1})
    with pytest.raises(TypeError):
        store.put(rid, [], {"output": [], "n": object()})  # half written when json meets the object
    assert [p.name for p in tmp_path.iterdir()] == [rid + ".json"]
    assert store.get(rid) == {"output": [], "n": 1} == ResponseStore(4, str(tmp_path)).get(rid)
