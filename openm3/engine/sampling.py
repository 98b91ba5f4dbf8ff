"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus); the log probabilities of sampled tokens."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch


GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's too): logits / 1e-40 overflow to inf


def plain_int(x):
    """`x` as a Python int when it is an integer scalar of another type (numpy's, which prompts may hold too:
    `operator.index`); anything else (None, bools, floats, text) unchanged, for the argument's own check."""
    return operator.index(x) if isinstance(x, numbers.Integral) and not isinstance(x, (int, bool)) else x


def check_count(name: str, value) -> None:
    """ValueError naming `name` unless `value` is an int >= 1 (not a bool: True is no count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _number(x) -> bool:
    """An int or a float, not a bool (True is no temperature)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax), and so is any below `GREEDY_BELOW`; top_k 0 = off; top_p in (0, 1], 1 = off.

    With temperature > 0, logits are divided by it, then only the top_k most likely tokens are kept, then the
    smallest set of the most likely tokens whose probability reaches top_p (the most likely token always stays).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # numpy floats (np.float32 is no float) as floats; bools refused
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
                object.__setattr__(self, name, float(value))
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "top_k", plain_int(self.top_k))
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def check_run(sampling, seed, callbacks: dict) -> None:
    """ValueError naming the argument for a `sampling` that is not a `SamplingParams`, a `seed` that is not an int,
    or a callback (name -> value) that is neither None nor callable: before any work (in `BatchedGenerator` a bad
    one reached the worker and failed every request decoding with it)."""
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be an openm3.engine.SamplingParams(temperature, top_p, top_k), got "
                         f"{type(sampling).__name__}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must be an int (int64 or uint64), got {seed!r}")
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be callable or None, got {type(fn).__name__}")


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits [B, V] (fp32); removed tokens get -inf."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens strictly more likely than it already reach top_p
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop[..., 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens from logits [B, V] -> int64 [B]."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


MAX_TOP_LOGPROBS = 20


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log probability of `token` under one logits row [V] (log-softmax of the raw logits, before
    temperature, top-k or top-p: what vLLM returns by default), and the `top` most likely tokens with theirs
    (most likely first; [] for top = 0). One host read."""
    return rows_logprobs(logits[None], [token], top)[0]


def rows_logprobs(logits: torch.Tensor, tokens, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """`token_logprobs` for each row of logits [n, V] and its token (tokens: n ids), in two host reads."""
    lp = logits.float().log_softmax(dim=-1)
    index = torch.as_tensor(tokens, dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, index[:, None])[:, 0].tolist()
    if not top:
        return [(v, []) for v in chosen]
    values, ids = lp.topk(top, dim=-1)
    return [(v, list(zip(i, w))) for v, i, w in zip(chosen, ids.tolist(), values.tolist())]


class PromptLogprob(NamedTuple):
    """A prompt token's entry: its log probability given the tokens before it, the `top` most likely tokens there
    [(id, logprob)], and its rank in the whole vocabulary (1: the most likely; ties share the better rank), as
    vLLM's `prompt_logprobs` reports it."""
    logprob: float
    top: list[tuple[int, float]]
    rank: int


def prompt_rows_logprobs(logits: torch.Tensor, tokens, top: int) -> list[PromptLogprob]:
    """`rows_logprobs` with each token's rank (the count of strictly more likely tokens, plus one)."""
    rows = rows_logprobs(logits, tokens, top)
    index = torch.as_tensor(tokens, dtype=torch.int64, device=logits.device)
    own = logits.gather(1, index[:, None])  # compared as raw logits: log-softmax keeps their order
    ranks = ((logits > own).sum(dim=-1) + 1).tolist()
    return [PromptLogprob(v, alternatives, r) for (v, alternatives), r in zip(rows, ranks)]


def check_logprobs(logprobs, on_logprobs, names: tuple[str, str] = ("logprobs", "on_logprobs")) -> None:
    """logprobs: None, or the number of top alternatives (0-20) reported with each token to `on_logprobs`; `names`:
    the two arguments' names in the error (`prompt_logprobs` / `on_prompt_logprobs` for the prompt's)."""
    if logprobs is None and on_logprobs is None:
        return
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS \
            or on_logprobs is None:
        raise ValueError(f"{names[0]} must be an int in [0, {MAX_TOP_LOGPROBS}] given with {names[1]}, got "
                         f"{logprobs!r} and {'a callback' if on_logprobs else 'no callback'}")
