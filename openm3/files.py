"""Files written whole or not at all: each atomic write here goes through `NAME.PID[.THREAD].tmp` beside its target
(`atomic_write`), renamed over it when whole and removed when the write fails; a process killed before the rename
leaves the temporary file behind, which `remove_orphaned_temporaries` sweeps once that process is gone."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import Iterator


@contextlib.contextmanager
def atomic_write(path, per_thread: bool = False) -> Iterator[str]:
    """Yields the temporary name beside `path` (`PATH.PID.tmp`; per_thread: `PATH.PID.THREAD.tmp`, for threads of
    one process that may write the same target) for the block to write whole; renamed over `path` when the block
    ends, removed where the block or the rename fails (a full disk, a value that cannot be written), so readers of
    `path` see the old file or the new one and a failed write leaves nothing behind."""
    tmp = f"{path}.{os.getpid()}" + (f".{threading.get_ident()}" if per_thread else "") + ".tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def process_alive(pid: int) -> bool:
    """Whether a process with id `pid` runs on this machine (one of another user counts as running). On Windows
    every pid counts as running: there `os.kill(pid, 0)` would send the process a Ctrl-C, not test it."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_temporaries(folder, target: str = r"[^/]+?") -> list[str]:
    """Removes the `TARGET.PID.tmp` / `TARGET.PID.THREAD.tmp` files in `folder` (`target`: a regex for the target
    names; the default, lazy, reads `a.json.PID.THREAD.tmp` as a.json's, not `a.json.PID`'s) whose writing process
    no longer runs; those of live processes (a writer at work) stay. Returns the removed names (none where the
    folder cannot be listed: the sweep is a courtesy, not the caller's work)."""
    form = re.compile(rf"(?:{target})\.(\d+)(?:\.\d+)?\.tmp")
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        found = form.fullmatch(name)
        pid = int(found.group(1)) if found else 0
        # (a number past a pid_t, which os.kill cannot take, names no process: not one of these files, kept)
        if 0 < pid < 2**31 and pid != os.getpid() and not process_alive(pid):
            try:
                os.remove(os.path.join(folder, name))
                removed.append(name)
            except OSError:  # another process removed it first
                pass
    return removed
