"""M3's reasoning, split off its answers: the model writes `<think>\\n{reasoning}\\n</think>\\n\\n{answer}` (the
format `openm3.data.chat.render_chat` writes for an assistant message's `reasoning_content`), and each API carries
the reasoning in its own field, as vLLM's reasoning parsers do: Chat Completions' `reasoning_content`, a Messages
`thinking` block, a Responses `reasoning` item. A client that sends the reasoning back gets it rendered into the
prompt again (M3 keeps its thinking in the conversation).

`split_reasoning` splits a whole answer; `ReasoningSplitter` routes a stream's text deltas so that the reasoning
deltas and the answer deltas add up to exactly what `split_reasoning` gives for the whole text. A prompt whose
template opens the think block itself (its generation prompt ends with `<think>`) starts inside the reasoning
(`started=True`).
"""

from __future__ import annotations

from ..data.tokenizer import THINK_END, THINK_START


def _trim(reasoning: str) -> str:
    """The reasoning without the newlines the format puts after `<think>` and before `</think>`."""
    return reasoning.removeprefix("\n").removesuffix("\n")


def split_reasoning(text: str, started: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated text; reasoning is None when the text has no think block. A block that
    is never closed (generation stopped inside it) is all reasoning."""
    if not started:
        if not text.lstrip().startswith(THINK_START):
            return None, text
        text = text.lstrip()[len(THINK_START):]
    end = text.find(THINK_END)
    if end < 0:
        return _trim(text), ""
    return _trim(text[:end]), text[end + len(THINK_END):].lstrip("\n")


class ReasoningSplitter:
    """Routes the text deltas of one answer, in order: `feed(delta)` and, at the end, `finish()` return
    [("reasoning" | "content", text), ...]. Text that may still turn out to be format (leading whitespace before
    `<think>`, a newline that may precede `</think>`, the newlines after it) is held until it is known.
    `content_start`: the answer's first character's offset in the text fed, once known (at the latest after
    `finish()`), as `split_reasoning` puts it: its answer is the whole text's end from there."""

    def __init__(self, started: bool = False):
        self.started = started
        self._state = "reasoning" if started else "start"  # start -> (reasoning -> after ->) content
        self._buf = ""
        self._first = True  # the reasoning's first text: its leading newline is format
        self._fed = 0  # characters fed so far
        self.content_start: int | None = None  # where the answer begins in the fed text, once known

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += delta
        self._fed += len(delta)
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if not head or THINK_START.startswith(head):
                    return out  # only whitespace, or a beginning of `<think>`, so far
                if head.startswith(THINK_START):
                    self._buf, self._state = head[len(THINK_START):], "reasoning"
                else:
                    self._to_content()
            elif self._state == "reasoning":
                end = self._buf.find(THINK_END)
                if end >= 0:
                    self._emit_reasoning(out, self._buf[:end].removesuffix("\n"))
                    self._buf, self._state = self._buf[end + len(THINK_END):], "after"
                    continue
                keep = next((n for n in range(min(len(THINK_END), len(self._buf)), 0, -1)
                             if self._buf.endswith(THINK_END[:n])), 0)
                if self._buf[:len(self._buf) - keep].endswith("\n"):
                    keep += 1  # a newline that may be the one before `</think>`
                self._emit_reasoning(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            elif self._state == "after":
                self._buf = self._buf.lstrip("\n")
                if self._buf:
                    self._to_content()
            else:
                out.append(("content", self._buf))
                self._buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end of the answer."""
        out: list[tuple[str, str]] = []
        if self._state == "reasoning":
            self._emit_reasoning(out, self._buf.removesuffix("\n"))
        elif self._state == "start" and self._buf:
            out.append(("content", self._buf))
        if self.content_start is None:  # an answer that is empty, or only what was held at the start
            self.content_start = self._fed - len(self._buf) if self._state == "start" else self._fed
        self._buf = ""
        return out

    def _to_content(self) -> None:
        self._state, self.content_start = "content", self._fed - len(self._buf)

    def _emit_reasoning(self, out: list, text: str) -> None:
        if self._first and text:
            text, self._first = text.removeprefix("\n"), False
        if text:
            out.append(("reasoning", text))
