"""Log probabilities of an answer's tokens in OpenAI's two formats (Chat Completions' `logprobs.content`, and the
legacy Completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, with `echo` the prompt's tokens
first: its first token has none, null).

The values are the model's own (log-softmax of its logits before temperature, top-k, top-p, penalties or logit
bias, as vLLM returns by default: `openm3.engine.sampling.token_logprobs`), one entry per sampled token of the
answer (the end-of-turn token and stop token ids excluded), up to and including the token that completed a stop
string. A token's text is its own decoding, so a character split over two tokens shows as U+FFFD in each (its
`bytes` in the chat format are those of that text).

The chat formats hold the tokens of the message text alone, as OpenAI's reference does: when the answer's think
block is split off (its `reasoning_content` / `reasoning` item) or its tool calls are parsed out, the tokens that
wrote them are left out. Each entry keeps where its text ends in the decoded answer, and a *span* (start, end) of
that text (`TextStream.content_span`) picks the entries whose text reaches into it; a token that holds both the
last of the format and the first of the text (`\n\nHello`) counts as text.
"""

from __future__ import annotations

from typing import Container


class TokenLogprobs:
    """Collects (token, logprob, top) from a backend's `on_logprobs(logprob, top)` and the token's `on_token`; for
    streaming, `take()` returns the entries not returned before."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top = tokenizer, top
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.ends: list[int] = []  # characters of the decoded answer up to and including each entry's token
        self.prompt_entries: list = []  # PromptLogprob of the prompt's tokens after the first (echo)
        self._pending: tuple[float, list] | None = None
        self._sent = 0
        self._offset = 0  # characters of the completion text before the next entry (Completions' text_offset)

    def on_logprobs(self, logprob: float, top: list[tuple[int, float]]) -> None:
        self._pending = (logprob, top)

    def on_prompt(self, entries: list) -> None:
        self.prompt_entries = entries

    def on_token(self, token: int, hidden: Container[int], end: int = 0) -> None:
        """hidden: the tokens that are not text (end-of-turn, stop token ids: no entry); `end`: the decoded answer's
        length with this token (`TextStream.decoded`)."""
        if self._pending is not None and token not in hidden:
            self.entries.append((token, *self._pending))
            self.ends.append(end)
        self._pending = None

    def echoed(self, prompt: list[int]) -> list:
        """Entries for an echoed prompt, to go before the answer's in `completion`: its first token has no log
        probability (null), the others those `on_prompt` received."""
        return [(prompt[0], None, None)] + [(t, e.logprob, e.top[:self.top])
                                            for t, e in zip(prompt[1:], self.prompt_entries)]

    def take(self, span: tuple[int | None, int | None] = (0, None)) -> list:
        """The entries not returned before that are in `span` (start, end) of the answer's text: a start of None
        (not known yet) returns none and keeps them; an entry wholly before the start is dropped; one that begins
        at or after the end (None: no end) is kept for a later call, whose span may reach further."""
        start, end = span
        if start is None:
            return []
        new = []
        while self._sent < len(self.entries):
            i = self._sent
            if end is not None and self._begin(i) >= end:
                break
            if self._reaches(i, start):
                new.append(self.entries[i])
            self._sent += 1
        return new

    def select(self, span: tuple[int, int | None]) -> list:
        """All entries in `span` (see `take`), whatever was returned before."""
        start, end = span
        return [e for i, e in enumerate(self.entries)
                if self._reaches(i, start) and (end is None or self._begin(i) < end)]

    def _begin(self, i: int) -> int:
        return self.ends[i - 1] if i else 0

    def _reaches(self, i: int, start: int) -> bool:
        """Entry i's text reaches past `start` (a token that decodes to nothing: it is at or after it)."""
        return self.ends[i] > start or self.ends[i] == self._begin(i) >= start

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def chat(self, entries: list) -> dict:
        """Chat Completions' `logprobs` of a choice (or a streamed chunk's choice)."""
        def item(token: int, logprob: float) -> dict:
            text = self._text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]}

    def completion(self, entries: list) -> dict:
        """The legacy Completions' `logprobs` of a choice (entries [(token, logprob, top)]; a None top stays null);
        text offsets continue from the previous call's."""
        tokens = [self._text(t) for t, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        tops = [None if top is None else self._top_dict(top) for _, _, top in entries]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops if self.top else None, "text_offset": offsets}


    def _top_dict(self, top: list) -> dict[str, float]:
        """{text: logprob} of the alternatives, most likely first. Keys must differ: an id past the tokenizer (a
        model may have more logits than it has tokens) is keyed `token_id:N` (vLLM's form), and of alternatives
        that decode alike (e.g. two halves of a character, both U+FFFD) the most likely keeps the key."""
        out: dict[str, float] = {}
        for i, v in top:
            out.setdefault(self._text(i) if i < self.tokenizer.vocab_size else f"token_id:{i}", v)
        return out


class PromptEntries:
    """Collects a request's prompt-token entries (the engine's `PromptLogprob`s, `top` alternatives each) from a
    backend's `on_prompt_logprobs`, and hands them on to a `TokenLogprobs` that echoes the prompt, if any."""

    def __init__(self, top: int, echo: TokenLogprobs | None = None):
        self.top, self.echo, self.entries = top, echo, []

    def on_prompt(self, entries: list) -> None:
        self.entries = entries
        if self.echo is not None:
            self.echo.on_prompt(entries)


def vllm_prompt_logprobs(tokenizer, prompt: list[int], entries: list, top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: null for the prompt's first token, then for each token a dict keyed by token
    id (a string in JSON) of {"logprob", "rank", "decoded_token"}, holding the prompt's token (rank in the whole
    vocabulary) and the `top` most likely tokens there (ranks 1..top). entries: the engine's `PromptLogprob`s of
    tokens 1..L-1."""
    out: list[dict | None] = [None]
    for token, entry in zip(prompt[1:], entries):
        position = {str(token): {"logprob": entry.logprob, "rank": entry.rank,
                                 "decoded_token": tokenizer.decode([token])}}
        for rank, (alternative, logprob) in enumerate(entry.top[:top], start=1):
            position.setdefault(str(alternative), {"logprob": logprob, "rank": rank,
                                                   "decoded_token": tokenizer.decode([alternative])})
        out.append(position)
    return out
