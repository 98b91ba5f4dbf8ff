"""Speculative decoding with n-gram (prompt lookup) drafts: several tokens per decode step, the same outputs.

A decode step of a long-context model reads the whole cache and every weight for one new token per sequence;
feeding a few more tokens costs little more (the MSA decode kernels take up to 8 queries per sequence). An agent's
answers repeat their context: code being edited, file names, tool arguments. So before a step each sequence
looks for the latest earlier occurrence of its last few tokens (an n-gram of `prompt_lookup_max` down to
`prompt_lookup_min` tokens) in its prompt and output, and takes the tokens that followed it there as drafts
(`ngram_drafts`). One forward feeds the last sampled token and the drafts; the model's logits at each position
verify them (`verify`):

- greedy: the drafts are kept while each equals the argmax of the logits before it, and the first argmax that
  differs (or the one after the last draft) comes with them: the tokens plain greedy decoding gives, up to the
  float rounding of a multi-token forward;
- sampling: draft d at a position whose (temperature / top-k / top-p filtered) distribution is p is kept with
  probability p(d); the first one rejected is replaced by a draw from p with d removed (renormalised), and when
  all are kept one more token is drawn from the last position. A draft is one token with probability 1, so this
  is the speculative-sampling rule with q = delta(d): every output token has exactly the distribution plain
  sampling gives (a different random stream, so not the same tokens for a seed);
- a constrained sequence (structured outputs): each position's token is the constraint's pick from its row, and
  the drafts are kept while the picks equal them (`verify_constrained`): greedy, the tokens of plain constrained
  decoding up to the float rounding of the forward; sampled, its distribution, and with a generator of the
  sequence's own (`BatchedGenerator`) its random stream too.

The keys and values the rejected drafts wrote are dropped with `PagedCache.truncate`. A batch's step feeds every
sequence the same number of tokens (what the decode kernels and one CUDA graph take), so a sequence without a
match is padded with its last token, verified like any draft.

The configuration follows vLLM's `--speculative-config` JSON (`{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}`); `SpeculativeConfig.parse` reads it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np
import torch

from .cache import MAX_DECODE_QUERIES
from .sampling import SamplingParams, filter_logits

__all__ = ["SpeculativeConfig", "TokenHistory", "ngram_drafts", "step_drafts", "verify", "verify_constrained",
           "cut_at_end", "keep_verified", "PREDICTION_DRAFTS"]


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method: 'ngram' (prompt lookup, the only one); num_speculative_tokens: drafts per step, 1 ..
    MAX_DECODE_QUERIES - 1 (a step feeds them and the last token); prompt_lookup_max / _min: the longest and
    shortest suffix of a sequence's tokens looked up (the longest that occurs earlier wins); adaptive (this
    project's key, not vLLM's): a step speculates only when the drafts it is expected to keep pay for its longer
    step (`spec_gate.SpeculationGate`: kept-draft rate and step times measured as it decodes)."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative method: only 'ngram' (prompt lookup) is supported, got {self.method!r}")
        most = MAX_DECODE_QUERIES - 1
        for name, low, high in (("num_speculative_tokens", 1, most), ("prompt_lookup_min", 1, None),
                                ("prompt_lookup_max", self.prompt_lookup_min, None)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
                bound = f"in [{low}, {high}]" if high else f">= {low}"
                raise ValueError(f"{name} must be an int {bound}, got {value!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, text: str | dict) -> "SpeculativeConfig":
        """From vLLM's `--speculative-config` JSON (or its dict): 'method', 'num_speculative_tokens',
        'prompt_lookup_max', 'prompt_lookup_min' (the lookup bounds default to 4 and 2, or to each other when
        only one is given), and this project's 'adaptive'. ValueError naming what is wrong."""
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config: not valid JSON ({e})") from None
        if not isinstance(text, dict):
            raise ValueError(f"speculative config: expected a JSON object, got {type(text).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(text) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown} (known: {sorted(known)})")
        if "num_speculative_tokens" not in text:
            raise ValueError("speculative config: 'num_speculative_tokens' is required")
        args = dict(text)
        if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
            args["prompt_lookup_min"] = min(args["prompt_lookup_max"], cls.prompt_lookup_min) \
                if isinstance(args["prompt_lookup_max"], int) else args["prompt_lookup_max"]
        if "prompt_lookup_min" in args and "prompt_lookup_max" not in args:
            args["prompt_lookup_max"] = max(args["prompt_lookup_min"], cls.prompt_lookup_max) \
                if isinstance(args["prompt_lookup_min"], int) else args["prompt_lookup_min"]
        return cls(**args)

    def describe(self) -> str:
        return (f"ngram speculation: {self.num_speculative_tokens} draft tokens per step, lookup of "
                f"{self.prompt_lookup_max}..{self.prompt_lookup_min} tokens" + (", adaptive" if self.adaptive else ""))


class TokenHistory:
    """A sequence's tokens (prompt, then sampled), in a buffer sized once: what the drafts are looked up in.
    context: tokens the drafts may also be looked up in, placed before the prompt (a request's predicted output,
    OpenAI's `prediction`); they are not the model's input."""

    def __init__(self, prompt: torch.Tensor, max_new_tokens: int, context: Sequence[int] = ()):
        lead = len(context)
        self.tokens = np.empty(lead + prompt.numel() + max_new_tokens, dtype=np.int32)  # ids < 2**31: half the bytes
        self.tokens[:lead] = np.asarray(context, dtype=np.int32)
        self.tokens[lead:lead + prompt.numel()] = prompt.cpu().numpy()
        self.size = lead + prompt.numel()

    def append(self, token: int) -> None:
        self.tokens[self.size] = token
        self.size += 1

    def view(self) -> np.ndarray:
        return self.tokens[:self.size]


def ngram_drafts(tokens: np.ndarray, k: int, config: SpeculativeConfig) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (int [L]): the latest earlier occurrence of its longest
    suffix of `prompt_lookup_min` .. `prompt_lookup_max` tokens that occurs earlier, and the k tokens that followed
    it (continued through the drafts themselves when the match is less than k tokens back, as a repeating pattern
    would). [] when no suffix occurs earlier. One vectorised pass over the tokens (~0.3 ms per 1M int32 tokens),
    then work on the occurrences of the last token only."""
    size = len(tokens)
    if size - 1 < config.prompt_lookup_min:
        return []
    ends = np.flatnonzero(tokens[:size - 1] == tokens[-1]) + 1  # a match [e - n, e) with e < size
    longest = min(config.prompt_lookup_max, size - 1)
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, longest):  # do the match's j-th token from its end agree too?
        alive &= ends - 1 - j >= 0
        where = np.flatnonzero(alive)
        agree = tokens[ends[where] - 1 - j] == tokens[size - 1 - j]
        alive[where[~agree]] = False
        if not alive.any():
            break
        length[alive] += 1
    if not ends.size or length.max() < config.prompt_lookup_min:
        return []
    at = int(ends[np.flatnonzero(length == length.max())[-1]])
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(tokens[at]) if at < size else drafts[at - size])
        at += 1
    return drafts


def step_drafts(histories: Sequence[TokenHistory | None], rooms: Sequence[int], config: SpeculativeConfig,
                gate=None, keys: Sequence | None = None, lasts: Sequence[int] | None = None
                ) -> list[list[int]] | None:
    """One step's drafts for a batch: `num_speculative_tokens` per sequence, a sequence without a match padded
    with its last token; None (a plain step) when no sequence has a match or one has no room in its cache
    reservation for that many (`rooms`: tokens each can take beyond its last one), so a batch's steps take two
    shapes only, each captured once as a CUDA graph. A sequence whose history is None looks nothing up (one
    beside requests with a predicted output, where only they speculate; `lasts`: every sequence's last token,
    needed then). gate: a `SpeculationGate` (`spec_gate.py`) that may turn the step plain (keys: the sequences'
    keys for it)."""
    k = config.num_speculative_tokens
    if min(rooms) < k:
        return None
    drafts = [ngram_drafts(h.view(), k, config) if h is not None else [] for h in histories]
    if not any(drafts):
        return None
    if gate is not None and not gate.speculate(keys, drafts):
        return None
    if lasts is None:
        lasts = [int(h.view()[-1]) for h in histories]
    return [d or [int(last)] * k for d, last in zip(drafts, lasts)]


PREDICTION_DRAFTS = SpeculativeConfig(num_speculative_tokens=4, adaptive=True)
"""The speculation a request with a predicted output (OpenAI's `prediction`) gets where none is configured: the
lookup also searches the prediction, and the gate speculates only where its drafts pay."""


def verify(logits: torch.Tensor, drafts: Sequence[int], sampling: SamplingParams,
           generator: torch.Generator | None = None, argmax: Sequence[int] | None = None) -> list[int]:
    """The tokens one speculative step yields for one sequence (see the module docstring): the accepted drafts,
    then one token of the model's. logits: [len(drafts) + 1, V] fp32, row i after the last token and drafts[:i];
    argmax: its rows' argmax, when read already (greedy batches read all rows at once)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"logits must have len(drafts) + 1 = {len(drafts) + 1} rows, got {tuple(logits.shape)}")
    if sampling.greedy:
        best = logits.argmax(dim=-1).tolist() if argmax is None else list(argmax)
        kept = 0
        while kept < len(drafts) and best[kept] == drafts[kept]:
            kept += 1
        return best[:kept + 1]
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    d = torch.tensor(list(drafts), dtype=torch.int64, device=logits.device)
    n = len(drafts)
    if n:
        u = torch.rand(n, generator=generator, device=logits.device)
        p_draft = probs[:n].gather(1, d[:, None])[:, 0]
        rejected = (u >= p_draft).nonzero()
        kept = int(rejected[0]) if rejected.numel() else n
    else:
        kept = 0
    if kept < n:  # the rejected draft's position draws from p without the draft
        rest = probs[kept].clone()
        rest[d[kept]] = 0.0
        last = torch.multinomial(rest, 1, generator=generator)
    else:
        last = torch.multinomial(probs[n], 1, generator=generator)
    return list(drafts[:kept]) + [int(last)]


def verify_constrained(logits: torch.Tensor, drafts: Sequence[int], constraint, sampling: SamplingParams,
                       generator: torch.Generator | None, stop_tokens, room: int) -> list[int]:
    """`verify` for a constrained sequence (structured outputs: `openm3.engine.constrained.GrammarConstraint`):
    each position's token is the constraint's pick from its row, the token plain constrained decoding would give
    there, and the drafts are kept while the picks equal them. A pick is drawn from the masked distribution, so
    this is the point-mass rule of `verify` in the form "sample, then compare": every output token has the
    distribution (greedy: the token) plain constrained decoding gives, drawn with one pick per token as plain
    decoding draws it. Only tokens the sequence keeps are picked (the constraint's state advances with each): at most
    `room`, up to a stop token."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"logits must have len(drafts) + 1 = {len(drafts) + 1} rows, got {tuple(logits.shape)}")
    out: list[int] = []
    for j in range(min(len(drafts) + 1, room)):
        token = constraint.pick(logits[j], sampling, generator)
        out.append(token)
        if token in stop_tokens or j == len(drafts) or token != drafts[j]:
            break
    return out


def cut_at_end(tokens: Sequence[int], stop_tokens, room: int) -> tuple[list[int], str | None]:
    """The tokens of a step a sequence keeps, and why it ends ('stop', 'length' or None): at most `room` (its
    max_new_tokens left), up to and including the first stop token."""
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in stop_tokens:
            return out, "stop"
    return out, "length" if len(out) == room else None


def keep_verified(cache, seq_ids: Sequence[int], lengths: Sequence[int], logits: torch.Tensor,
                  drafts: Sequence[Sequence[int]], requests: Sequence[tuple]) -> tuple[list[list[int]], int]:
    """After a speculative step's forward: each sequence's kept tokens (`verify`, or `verify_constrained` for a
    constrained one, then `cut_at_end`), its cache truncated to the fed tokens those keep (`lengths`: cached
    tokens before the step), and the drafts confirmed in all. logits: [B, 1 + K, V]; requests: per sequence
    (SamplingParams, generator, stop tokens, tokens it may still take, GrammarConstraint or None). Plain greedy
    rows' argmax is read in one host read."""
    greedy = [i for i, r in enumerate(requests) if r[0].greedy and r[4] is None]
    best = dict(zip(greedy, logits[greedy].argmax(dim=-1).tolist())) if greedy else {}
    out, accepted = [], 0
    for i, (seq_id, (sampling, generator, stop, room, constraint)) in enumerate(zip(seq_ids, requests)):
        if constraint is not None:
            tokens = verify_constrained(logits[i], drafts[i], constraint, sampling, generator, stop, room)
        else:
            tokens = verify(logits[i], drafts[i], sampling, generator, argmax=best.get(i))
        accepted += len(tokens) - 1
        kept, _ = cut_at_end(tokens, stop, room)
        cache.truncate(seq_id, lengths[i] + len(kept))  # the last token and the drafts before the new one
        out.append(kept)
    return out, accepted
