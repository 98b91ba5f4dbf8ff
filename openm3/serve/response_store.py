"""Stored responses for OpenAI's Responses API (`store`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`), in the server's memory.

A stored response keeps the input items it was answered from (those of every turn before it, then its own input)
and its response object, whose output items (messages, reasoning, function calls) follow them in the
conversation: a request naming it as `previous_response_id` continues that conversation with its own `input`
appended, as OpenAI's API does (the earlier `instructions` are not carried over). The store holds the `capacity` responses used last (least
recently used dropped first); nothing survives a restart.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

__all__ = ["ResponseStore"]


class ResponseStore:
    """Responses by id: `put(rid, items, response)`, `items(rid)` (its input items, a copy), `conversation(rid)`
    (its input items then its output items: what a follow-up continues), `get(rid)` (the response object, a
    copy), `delete(rid)`. Thread-safe."""

    def __init__(self, capacity: int = 1024):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[list, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, rid: str, items: list, response: dict) -> None:
        """Keeps response `rid`: the input `items` it answered and its response object (deep copies)."""
        if self.capacity == 0:
            return
        kept = (copy.deepcopy(items), copy.deepcopy(response))
        with self._lock:
            self._kept[rid] = kept
            self._kept.move_to_end(rid)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def _take(self, rid: str) -> tuple[list, dict] | None:
        with self._lock:
            kept = self._kept.get(rid)
            if kept is not None:
                self._kept.move_to_end(rid)
            return kept

    def items(self, rid: str) -> list | None:
        kept = self._take(rid)
        return None if kept is None else copy.deepcopy(kept[0])

    def conversation(self, rid: str) -> list | None:
        kept = self._take(rid)
        return None if kept is None else copy.deepcopy(kept[0] + kept[1]["output"])

    def get(self, rid: str) -> dict | None:
        kept = self._take(rid)
        return None if kept is None else copy.deepcopy(kept[1])

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._kept.pop(rid, None) is not None
