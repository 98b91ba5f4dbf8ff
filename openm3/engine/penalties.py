"""Logits adjustments per request, as OpenAI's and vLLM's sampling parameters define them: `logit_bias`,
`presence_penalty`, `frequency_penalty`, vLLM's `repetition_penalty`, `min_tokens`, `min_p` and `bad_words`, and a
budget of thinking tokens (Anthropic's `thinking`).

`Penalties` holds a request's settings; `PenalizedPicker(penalties, prompt, hold, inner)` picks that
request's tokens from raw logits rows, in order, the way a `GrammarConstraint` does (the engine takes either as a
sequence's `constraint`), so every decoding path (`generate`, `BatchedGenerator`, speculative verification, which
keeps drafts while they equal the picks) applies them, each token seeing the tokens picked before it. A row goes
through, in vLLM's order:
1. `logit_bias` added to its tokens, every token outside vLLM's `allowed_token_ids` (when given) masked, the
   stop tokens masked while fewer than `min_tokens` were picked, and each bad word's last token masked where the
   output so far ends with the rest of it (vLLM's `bad_words`, as token sequences: a one-token word always);
   with a thinking budget, every token but the think block's end masked once the block has held `think_budget`
   tokens (the output's blocks together), and its start masked once the budget is spent (budget 0: no
   thinking; a prompt that opens the block is closed at once);
2. `repetition_penalty` on the tokens of the prompt and the output so far (a positive logit divided by it, a
   negative one multiplied), then `frequency_penalty` times each token's count in the output and
   `presence_penalty` for each token present in it subtracted;
3. `min_p`: after temperature, the tokens less likely than `min_p` times the most likely one are dropped (with
   an `inner` grammar constraint, of the tokens it allows: it applies min_p itself, after its mask, as vLLM does);
then the plain sampler (temperature, top-k, top-p), or the `inner` grammar constraint's pick. Log probabilities
stay the model's own (the raw rows: vLLM's default).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from .sampling import SamplingParams, sample

__all__ = ["Penalties", "PenalizedPicker"]

MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value


@dataclasses.dataclass(frozen=True)
class Penalties:
    """presence / frequency: in [-2, 2] (OpenAI's bounds), 0 = off; repetition > 0, 1 = off; logit_bias: (token
    id, bias in [-100, 100]) pairs; min_tokens >= 0; min_p in [0, 1], 0 = off; allowed: the only token ids that may
    be picked (None: any); bad_words: token sequences the output may not complete; think: the (start, end) token
    ids of the think block and think_budget the tokens it may hold (None: no budget)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    allowed: tuple[int, ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    think: tuple[int, int] | None = None
    think_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} penalty must be a number in [-2, 2], got {value!r}")
        if not _number(self.repetition) or not 0 < self.repetition < math.inf:
            raise ValueError(f"repetition penalty must be a number > 0 (1 = off), got {self.repetition!r}")
        for pair in self.logit_bias:
            if len(pair) != 2 or not isinstance(pair[0], int) or pair[0] < 0 or not _number(pair[1]) \
                    or not -MAX_BIAS <= pair[1] <= MAX_BIAS:
                raise ValueError(f"logit_bias: expected (token id >= 0, bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}]) "
                                 f"pairs, got {pair!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.allowed is not None and (not self.allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed)):
            raise ValueError(f"allowed_token_ids: expected a non-empty list of token ids >= 0, got {self.allowed!r}")
        for word in self.bad_words:
            if not word or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in word):
                raise ValueError(f"bad_words: expected non-empty token id sequences, got {word!r}")
        if self.think_budget is not None:
            if not isinstance(self.think_budget, int) or isinstance(self.think_budget, bool) or self.think_budget < 0:
                raise ValueError(f"think_budget must be an int >= 0 or None, got {self.think_budget!r}")
            if self.think is None or len(self.think) != 2 or any(not isinstance(t, int) or t < 0 for t in self.think):
                raise ValueError(f"think_budget needs think: the (start, end) token ids, got {self.think!r}")

    @property
    def active(self) -> bool:
        """Whether any setting changes a row."""
        return bool(self.presence or self.frequency or self.repetition != 1 or self.logit_bias or self.min_tokens
                    or self.min_p or self.allowed is not None or self.bad_words or self.think_budget is not None)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class PenalizedPicker:
    """One sequence's token picks under `penalties` (see the module docstring): `pick(row, sampling, generator)`
    adjusts the raw logits row [V], picks a token (the plain sampler, or `inner`'s pick: a `GrammarConstraint`)
    and counts it. prompt: the sequence's prompt ids (for `repetition`); hold: the stop tokens `min_tokens` holds
    back (with `inner`, its own too). A constraint for one request, as a `GrammarConstraint` is; `stop_tokens`
    (the tokens it ends a document with) are `inner`'s, none without one."""

    def __init__(self, penalties: Penalties, prompt: Sequence[int] | torch.Tensor, hold: Sequence[int] = (),
                 inner=None):
        if not isinstance(penalties, Penalties):
            raise ValueError(f"penalties must be a Penalties, got {type(penalties).__name__}")
        self.penalties, self.inner = penalties, inner
        self.stop_tokens = list(inner.stop_tokens) if inner is not None else []
        self._held = sorted({int(t) for t in hold} | set(self.stop_tokens))
        self._prompt = torch.as_tensor(prompt, dtype=torch.int64).flatten().cpu()
        self.picked = 0
        self._output: list[int] = []  # the tokens picked (bad words' prefixes are matched against its end)
        self._thought = 0  # tokens picked inside think blocks
        self._inside = False  # in a think block: one the prompt left open, or the output opened
        if penalties.think is not None:
            start, end = penalties.think
            marks = torch.nonzero((self._prompt == start) | (self._prompt == end)).flatten()
            self._inside = marks.numel() > 0 and int(self._prompt[marks[-1]]) == start
        self._counts: torch.Tensor | None = None  # float [V] on the rows' device: each token's count in the output
        self._seen: torch.Tensor | None = None  # bool [V]: in the prompt or the output (repetition)

    def pick(self, row: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None) -> int:
        adjusted = self.adjust(row, sampling)
        if self.inner is not None:
            token = self.inner.pick(adjusted, sampling, generator, min_p=self.penalties.min_p)
        else:
            token = int(sample(adjusted[None], sampling, generator)[0])
        self._count(token)
        return token

    def adjust(self, row: torch.Tensor, sampling: SamplingParams = SamplingParams()) -> torch.Tensor:
        """The row [V] (fp32) with the adjustments for the next token (nothing is counted)."""
        p = self.penalties
        out = row.float().clone()
        vocab = out.shape[-1]
        if self._counts is None:  # the per-sequence tensors, on the rows' device, made once
            device = out.device
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._seen[self._prompt[self._prompt < vocab].to(device)] = True
            pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
            self._bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device)
            self._bias = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=device)
            self._held_ids = torch.tensor([t for t in self._held if t < vocab], dtype=torch.int64, device=device)
            if p.allowed is not None:
                self._refused = torch.ones(vocab, dtype=torch.bool, device=device)
                allowed = [t for t in p.allowed if t < vocab]
                self._refused[torch.tensor(allowed, dtype=torch.int64, device=device)] = False
        if p.logit_bias:
            out.index_add_(0, self._bias_ids, self._bias)
        if p.allowed is not None:
            out.masked_fill_(self._refused, -math.inf)
        if self.picked < p.min_tokens:
            out[self._held_ids] = -math.inf
        if p.think_budget is not None and self._thought >= p.think_budget:
            start, end = p.think
            if self._inside:  # the block is full: it ends here
                kept = out[end].item() if end < vocab else None
                out.fill_(-math.inf)
                if kept is not None:
                    out[end] = kept if math.isfinite(kept) else 0.0
            elif start < vocab:
                out[start] = -math.inf
        for word in p.bad_words:
            head = len(word) - 1
            if word[-1] < vocab and (head == 0 or (len(self._output) >= head
                                                    and self._output[-head:] == list(word[:-1]))):
                out[word[-1]] = -math.inf
        if p.repetition != 1:  # finite logits stay finite (a tiny or huge penalty saturates; masked stay -inf)
            big = torch.finfo(out.dtype).max
            scaled = torch.where(out > 0, out / p.repetition, out * p.repetition).clamp(-big, big)
            out = torch.where(self._seen & (out > -math.inf), scaled, out)
        if p.frequency:
            out -= p.frequency * self._counts
        if p.presence:
            out -= p.presence * (self._counts > 0).float()
        if p.min_p and not sampling.greedy and self.inner is None:  # (a grammar applies it after its mask)
            # p_i < min_p * p_max  <=>  logit_i < max + temperature * log(min_p)
            out = out.masked_fill(out < out.max() + sampling.temperature * math.log(p.min_p), -math.inf)
        return out

    def _count(self, token: int) -> None:
        self.picked += 1
        if self.penalties.bad_words:
            self._output.append(token)
        if self.penalties.think is not None:
            start, end = self.penalties.think
            if token == start:
                self._inside = True
            elif token == end:
                self._inside = False
            elif self._inside:
                self._thought += 1
        if 0 <= token < self._counts.numel():
            self._counts[token] += 1
            self._seen[token] = True
