"""Stored responses for OpenAI's Responses API (`store`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`), in the server's memory.

A stored response keeps its own input items, the id of the response it continued (`previous_response_id`) and its
response object, whose output items (messages, reasoning, function calls) follow the input in the conversation.
A request naming it as `previous_response_id` continues that conversation (the chain of earlier turns, each
turn's input then output) with its own `input` appended, as OpenAI's API does (the earlier `instructions` are not
carried over). Each turn is kept once, so a long conversation takes memory in proportion to its length. The store
holds the `capacity` responses used last (least recently used dropped first; continuing a conversation uses every
turn of it); nothing survives a restart.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

__all__ = ["ResponseStore"]


class ResponseStore:
    """Responses by id: `put(rid, items, response, previous)`, `items(rid)` (every input item it answered: the
    earlier turns', then its own), `conversation(rid)` (those, then its output items: what a follow-up
    continues), `get(rid)` (the response object), `delete(rid)`; copies, None where a response (or an earlier turn
    of its conversation) is not stored. Thread-safe."""

    def __init__(self, capacity: int = 1024):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._kept: OrderedDict[str, tuple[list, dict, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, rid: str, items: list, response: dict, previous: str | None = None) -> None:
        """Keeps response `rid`: its own input `items`, its response object (deep copies) and the id of the
        response it continued."""
        if self.capacity == 0:
            return
        kept = (copy.deepcopy(items), copy.deepcopy(response), previous)
        with self._lock:
            self._kept[rid] = kept
            self._kept.move_to_end(rid)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

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
        return copy.deepcopy(kept[1])

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._kept.pop(rid, None) is not None
