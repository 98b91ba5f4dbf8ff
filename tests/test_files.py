"""`openm3.files.remove_orphaned_temporaries`: the temporary files of writers that died before their rename go;
those of running processes, this one's and other names stay."""

import os
import subprocess
import sys

from openm3.files import process_alive, remove_orphaned_temporaries


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
