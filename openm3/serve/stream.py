"""Sampled tokens -> the text an endpoint sends: stop strings cut (as OpenAI does), held markers (a tool call's
start) and unfinished characters held back, the think block routed apart (`reasoning.py`), and where the message
text lies for its log probabilities (`logprobs.py`). Streamed and whole responses read the same stream, so the
concatenated deltas of a stream equal the whole text.
"""

from __future__ import annotations

import difflib
from typing import Sequence

from ..data.tokenizer import IncrementalText
from .reasoning import ReasoningSplitter, split_reasoning


class TextStream:
    """Sampled tokens -> text deltas that never show a stop string or anything after a `hold` marker.

    `push(token)` returns the text safe to emit so far: it holds back an unfinished UTF-8 character (decoded as
    U+FFFD) and any tail that could begin a stop string or marker. `text` is the whole text, cut before the
    first stop string; `stopped` says whether one was found. `finish()` returns what is left to emit.
    `sampled` counts every sampled token, including the end token that is never decoded; `cached` the prompt
    tokens a prefix-caching backend read from its cache (the usage's `cached_tokens`). min_tokens: as vLLM, a stop
    string that the first `min_tokens - 1` tokens complete does not end the text (nor count later). include_stop:
    the text ends with the stop string that ended it (vLLM's `include_stop_str_in_output`).

    reasoning: a `ReasoningSplitter` when the answer's think block is split off (`reasoning.py`; None: it is
    text like the rest). `parts(delta)` and `end_parts(final)` route the deltas to ("reasoning" | "content",
    text) pieces, and `split(text)` splits a whole answer the same way. `content_span()` says which part of the
    decoded text is the message text (`TokenLogprobs.take`): as far as known while streaming, and exactly once
    `settle` has the final answer.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), hold: Sequence[str] = (),
                 reasoning: ReasoningSplitter | None = None, min_tokens: int = 0, include_stop: bool = False):
        self.tokenizer, self.stop, self.hold = tokenizer, list(stop), list(hold)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text keeps the stop string
        self.min_tokens = min_tokens  # vLLM's rule: no stop string ends the text before this many tokens
        self._stop_after = 0  # characters within which stop strings are ignored (those ending before min_tokens)
        self.reasoning = reasoning
        self._decoder = IncrementalText(tokenizer)  # holds the pushed tokens
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.stop_found: str | None = None  # the stop string that ended the text
        self.stop_token: int | None = None  # the stop token id (`stop_token_ids`, not end-of-turn) that ended it
        self.sampled = 0
        self.cached = 0
        self.decoded = 0  # characters of the decoded tokens, before any cut
        self._span: tuple[int, int | None] | None = None  # the message text's, once settled

    @property
    def tokens(self) -> list[int]:
        """The tokens pushed so far."""
        return self._decoder.tokens

    def push(self, token: int) -> str:
        before = self._decoder.settled  # no stop string lies wholly inside the text settled before this token
        text = self._decoder.push(token)
        self.decoded = len(text)
        if self.stopped:  # tokens after the stop string change nothing
            return ""
        settled = len(before) if text.startswith(before) else 0
        if len(self.tokens) < self.min_tokens:
            self._stop_after = len(text)
        found = [(i, s) for s in self.stop
                 if (i := text.find(s, max(0, self._stop_after - len(s) + 1, settled - len(s) + 1))) >= 0]
        if found:
            cut, self.stop_found = min(found)
            self.text, self.stopped = text[:cut + (len(self.stop_found) if self.include_stop else 0)], True
            return self._emit(len(self.text))
        self.text = text
        end = len(text) - max([_partial_suffix(text, s) for s in self.stop + self.hold] + [0])
        if text[:end].endswith("\ufffd"):
            end -= 1
        return self._emit(end)

    def visible(self) -> str:
        """The text before the first `hold` marker."""
        cuts = [i for i in (self.text.find(m) for m in self.hold) if i >= 0]
        return self.text[:min(cuts)] if cuts else self.text

    def finish(self, final: str | None = None) -> str:
        """The rest of `final` (default: `visible()`) not yet emitted."""
        final = self.visible() if final is None else final
        delta, self.sent = final[self.sent:], max(self.sent, len(final))
        return delta

    def parts(self, delta: str) -> list[tuple[str, str]]:
        """A delta routed into reasoning and answer pieces."""
        if self.reasoning is None:
            return [("content", delta)] if delta else []
        return self.reasoning.feed(delta)

    def end_parts(self, final: str | None = None) -> list[tuple[str, str]]:
        """The pieces left at the end: `finish(final)` routed, and what the splitter held."""
        return self.parts(self.finish(final)) + (self.reasoning.finish() if self.reasoning is not None else [])

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole text: reasoning is None without a think block (or without splitting),
        and an empty think block counts as none."""
        if self.reasoning is None:
            return None, text
        reasoning, answer = split_reasoning(text, self.reasoning.started)
        return reasoning or None, answer

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the answer (None: the end-of-turn
        token, the length, or a tool call)."""
        return self.stop_found if self.stopped else self.stop_token

    def content_span(self) -> tuple[int | None, int | None]:
        """(start, end) of the message text in the decoded answer: start None while a think block may still be
        running, end None while no tool call has begun (its markup is not message text)."""
        if self._span is not None:
            return self._span
        start = 0 if self.reasoning is None else self.reasoning.content_start
        held = len(self.visible())
        return start, (held if held < len(self.text) else None)

    def settle(self, whole: str, calls: bool) -> tuple[int, int | None]:
        """Fixes the message text's span once the answer is known: `whole` as the endpoint returns it (with or
        without its tool-call markup), `calls`: the markup was parsed into calls (so it ends the text)."""
        start = 0
        if self.reasoning is not None:
            start = len(whole) - len(split_reasoning(whole, self.reasoning.started)[1])
        self._span = (start, len(whole) if calls else None)
        return self._span

    def _emit(self, end: int) -> str:
        end = min(end, len(self.visible()))
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


def _partial_suffix(text: str, s: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `s`."""
    for n in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:n]):
            return n
    return 0


def prediction_tokens(prediction: Sequence[int], completion: Sequence[int]) -> tuple[int, int]:
    """OpenAI's (accepted_prediction_tokens, rejected_prediction_tokens) of an answer: the predicted output's
    tokens that appear in the completion, in order, and the rest of the prediction. The common head and tail
    count whole; between them, the matching blocks of a diff (difflib). Where both middles are over ~1K tokens,
    the diff skips tokens that fill over 1% of the completion's middle as match seeds (difflib's autojunk: it
    still extends matches through them) to stay near linear (~30 ms for 8K tokens against 8K, ~3 s for 100K;
    without it a code file's 8K took 16 s), so a middle made of a few repeated tokens may count low there."""
    a, b = list(prediction), list(completion)
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    a, b = a[head:len(a) - tail], b[head:len(b) - tail]
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=len(a) * len(b) > 1 << 20)
    accepted = head + tail + sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted
