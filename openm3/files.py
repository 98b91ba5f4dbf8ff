"""Temporary files that a crashed writer left: each atomic write here goes through `NAME.PID[.THREAD].tmp` beside
its target, renamed over it when whole; a process killed before the rename leaves the temporary file behind."""

from __future__ import annotations

import os
import re


def process_alive(pid: int) -> bool:
    """Whether a process with id `pid` runs on this machine (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphaned_temporaries(folder, target: str = r"[^/]+") -> list[str]:
    """Removes the `TARGET.PID.tmp` / `TARGET.PID.THREAD.tmp` files in `folder` (`target`: a regex for the target
    names) whose writing process no longer runs; those of live processes (a writer at work) stay. Returns the
    removed names."""
    form = re.compile(rf"(?:{target})\.(\d+)(?:\.\d+)?\.tmp")
    removed = []
    for name in os.listdir(folder):
        found = form.fullmatch(name)
        if found and int(found.group(1)) != os.getpid() and not process_alive(int(found.group(1))):
            try:
                os.remove(os.path.join(folder, name))
                removed.append(name)
            except OSError:  # another process removed it first
                pass
    return removed
