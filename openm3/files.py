"""Temporary files that a crashed writer left: each atomic write here goes through `NAME.PID[.THREAD].tmp` beside
its target, renamed over it when whole; a process killed before the rename leaves the temporary file behind."""

from __future__ import annotations

import os
import re


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
    no longer runs; those of live processes (a writer at work) stay. Returns the removed names."""
    form = re.compile(rf"(?:{target})\.(\d+)(?:\.\d+)?\.tmp")
    removed = []
    for name in os.listdir(folder):
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
