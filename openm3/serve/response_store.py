"""Stored responses for OpenAI's Responses API (`store`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`), in the server's memory.

A stored response keeps its own input items, the id of the response it continued (`previous_response_id`) and its
response object, whose output items (messages, reasoning, function calls) follow the input in the conversation.
A request naming it as `previous_response_id` continues that conversation (the chain of earlier turns, each
turn's input then output) with its own `input` appended, as OpenAI's API does (the earlier `instructions` are not
carried over). Each turn is kept once, so a long conversation takes memory in proportion to its length. The store
holds the `capacity` responses used last (least recently used dropped first; continuing a conversation uses every
turn of it). With a `directory` each stored response is also written there (one JSON file per response, written to
a temporary name and renamed, so a crash leaves the file whole or absent; a failed write removes its temporary
file and leaves the response unstored, its error raised) and the store starts with the files it
finds (the latest `capacity` by the time they were last used; older ones are evicted, their files removed; a
background response the last run left queued or in progress reads as failed); without one nothing survives a
restart.
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from collections import OrderedDict

from ..files import atomic_write, remove_orphaned_temporaries

__all__ = ["ResponseStore"]


class ResponseStore:
    """Responses by id: `put(rid, items, response, previous)`, `items(rid)` (every input item it answered: the
    earlier turns', then its own), `conversation(rid)` (those, then its output items: what a follow-up
    continues), `get(rid)` (the response object), `delete(rid)`; copies, None where a response (or an earlier turn
    of its conversation) is not stored. Thread-safe. directory: where responses are kept on disk too (see the
    module docstring); None: memory only."""

    def __init__(self, capacity: int = 1024, directory: str | None = None):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.directory = directory
        self._kept: OrderedDict[str, tuple[list, dict, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            self._load()

    def _path(self, rid: str) -> str:
        if not _ID.fullmatch(rid):  # ids become file names: only the server's own form
            raise ValueError(f"response id {rid!r} is not a stored response's")
        return os.path.join(self.directory, rid + ".json")

    def _load(self) -> None:
        """The responses found in `directory`, least recently used first (past `capacity`: removed); unreadable
        files are skipped."""
        remove_orphaned_temporaries(self.directory, _ID.pattern + r"\.json")  # writes a crashed server cut short
        found = []
        for name in os.listdir(self.directory):
            rid, ext = os.path.splitext(name)
            if ext != ".json" or not _ID.fullmatch(rid):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    kept = json.load(f)
                found.append((os.path.getmtime(path), rid, (kept["items"], kept["response"], kept["previous"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        found.sort()
        keep = len(found) - min(self.capacity, len(found))
        for _, rid, _ in found[:keep]:  # beyond the capacity: evicted, as they would have been
            self._forget(rid)
        for _, rid, kept in found[keep:]:
            response = kept[1]
            if isinstance(response, dict) and response.get("status") in ("queued", "in_progress"):
                response["status"] = "failed"  # a background response the last run did not finish
                response["error"] = {"code": "server_error",
                                     "message": "the server stopped before this background response finished"}
            self._kept[rid] = kept

    def _write(self, rid: str, kept: tuple) -> None:
        with atomic_write(self._path(rid), per_thread=True) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump({"items": kept[0], "response": kept[1], "previous": kept[2]}, f)

    def _touch(self, rid: str) -> None:
        """Marks a response used (its file's time orders the next start's store)."""
        self._on_file(os.utime, rid)

    def _forget(self, rid: str) -> None:
        self._on_file(os.remove, rid)

    def _on_file(self, action, rid: str) -> None:
        """`action(path)` on a response's file, where there is a directory; a file already gone is no error."""
        if self.directory is not None:
            try:
                action(self._path(rid))
            except OSError:
                pass

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, rid: str, items: list, response: dict, previous: str | None = None) -> None:
        """Keeps response `rid`: its own input `items`, its response object (deep copies) and the id of the
        response it continued."""
        if self.capacity == 0:
            return
        kept = (copy.deepcopy(items), copy.deepcopy(response), previous)
        with self._lock:
            if self.directory is not None:
                self._write(rid, kept)
            self._kept[rid] = kept
            self._kept.move_to_end(rid)
            while len(self._kept) > self.capacity:
                self._forget(self._kept.popitem(last=False)[0])

    def _chain(self, rid: str) -> list | None:
        """The turns from the conversation's first to `rid` (each used), or None where one is not stored."""
        turns, seen = [], set()
        with self._lock:
            while rid is not None:
                kept = self._kept.get(rid)
                if kept is None or rid in seen:
                    return None
                seen.add(rid)
                self._kept.move_to_end(rid)
                self._touch(rid)
                turns.append(kept)
                rid = kept[2]
        return turns[::-1]

    def items(self, rid: str) -> list | None:
        turns = self._chain(rid)
        if turns is None:
            return None
        out = [item for items, response, _ in turns[:-1] for item in items + response["output"]]
        return copy.deepcopy(out + turns[-1][0])

    def conversation(self, rid: str) -> list | None:
        turns = self._chain(rid)
        if turns is None:
            return None
        return copy.deepcopy([item for items, response, _ in turns for item in items + response["output"]])

    def get(self, rid: str) -> dict | None:
        with self._lock:
            kept = self._kept.get(rid)
            if kept is None:
                return None
            self._kept.move_to_end(rid)
            self._touch(rid)
        return copy.deepcopy(kept[1])

    def delete(self, rid: str) -> bool:
        with self._lock:
            found = self._kept.pop(rid, None) is not None
            if found:
                self._forget(rid)
            return found


_ID = re.compile(r"resp_[0-9a-f]{32}")  # the ids `responses.py` gives
