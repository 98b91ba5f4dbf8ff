"""Constrained decoding: sampling only tokens that keep the output inside a byte-level grammar.

A grammar (`openm3.engine.json_grammar.JsonGrammar`, or anything with the same four members: `start`,
`advance(state, data) -> state | None`, `complete(state)`, `can_continue(state)`) says which byte strings may come
next. `GrammarConstraint(grammar, vocab, stop_tokens)` turns it into a per-request token constraint:

    token = constraint.pick(logits_row, sampling, generator)   # sampled under the constraint; the state advances

The semantics are vLLM's structured outputs: the tokens the grammar does not allow are masked out of the logits
*before* temperature, top-k and top-p, so a constrained request samples from `sample(masked_logits, sampling)`;
a stop token is allowed exactly when the output so far is a whole document, and is the only choice once nothing
may follow.

Checking every token of a 200K vocabulary against the grammar at every step would cost seconds in Python, so
`pick` checks lazily, in the order the sampler would consider tokens, and stops as soon as the answer is known:
- tokens whose first byte the grammar refuses are masked at once (256 byte checks and one gather over the vocab);
- greedy: the most likely token that the grammar accepts;
- temperature alone: the first accepted token in the order of logits / temperature + Gumbel noise (the Gumbel-max
  trick: exactly a sample of the masked distribution);
- top-k: the k most likely accepted tokens, then `sample` over them;
- top-p: accepted tokens in order until the nucleus over all accepted tokens is settled (the mass not yet
  checked could no longer change it), then `sample` over them.
Each (state, token) transition is memoised in the grammar's `TransitionCache`, shared by every request with the
same grammar, so a step inside a long string costs a few dictionary reads. When a pick has checked `lazy_checks`
tokens (512) without an answer (a flat distribution under top-p, or a state that refuses most likely tokens), the
state's full mask decides it: every candidate checked once, the mask kept for the state (strings and whitespace
revisit the same states), then the plain sampler over the masked row.

An answer may start with a reasoning block (`think=(start_id, end_id)`): the grammar then applies after its end
token, as vLLM applies it after the reasoning parser's end. The block itself is free text, except that it cannot
end the output: a stop token is refused inside it while the grammar still owes a document, so a forced tool call or
a schema's JSON always follows the reasoning unless the token limit cuts it (vLLM lets a stop end the output there,
an answer the request asked for then missing; a random model does that often).

With a `trigger` token the grammar applies only from that token on, and again each time it is sampled: the text
around is free, and each stretch from the trigger to the grammar's whole document follows the grammar (tool calls
under `tool_choice: auto`: free text, but every call the model opens is well formed).

Where no token the grammar allows has a finite logit: a whole document ends there, on a stop token (the request's
own adjustments held the stops back, `min_tokens`: vLLM, too, lets a finished grammar stop under it); otherwise
`pick` raises `GrammarDeadEnd`. A grammar whose every state can be completed reaches one only where the logits rule
out all it allows (`allowed_token_ids`, `bad_words`); a pattern left to the `regex` package's partial matching
(lookaround: `a(?=b)` takes `a`, which no match continues) also where its states cannot be completed.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Iterator, Sequence

import torch

from .sampling import SamplingParams, sample

__all__ = ["ChoiceGrammar", "GrammarConstraint", "GrammarDeadEnd", "TokenBytes", "TransitionCache", "draw"]

_NO_BYTES = 256  # first-byte slot of tokens with no bytes (special tokens): never allowed by the grammar
_QUOTE = 0x22  # `"`: a grammar's `quote_free_twin` answers for the tokens without it
_NOT_UTF8 = 0xF8  # bytes from here on occur in no UTF-8 text: the byte tokens holding them are never allowed
_SPLIT = 2  # `_walk`'s mode for a state that takes split characters: a character per edge where a token holds it


class TokenBytes:
    """Each token's bytes in the output (None for special tokens, which a grammar never allows, and for the byte
    tokens of bytes 0xF8-0xFF, which no UTF-8 text holds) and its first byte as a tensor for masking (256 for
    None)."""

    def __init__(self, pieces: Sequence[bytes | None]):
        self.pieces = list(pieces)
        first = [piece[0] if piece else _NO_BYTES for piece in self.pieces]
        self.first_byte = torch.tensor(first, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.pieces)

    @classmethod
    def from_tokenizer(cls, tokenizer, markers: dict[int, bytes] | None = None) -> "TokenBytes":
        """The bytes of an `M3Tokenizer`'s tokens (a byte-level BPE: each token's string maps back to bytes
        through the byte-to-character table of its pre-tokenizer); special tokens get None, except those in
        `markers` ({id: bytes}, bytes no text holds, e.g. `tool_grammar.START`), which a grammar may then take.
        A model may have more logits than the tokenizer has tokens: `GrammarConstraint` never allows those."""
        backend = tokenizer.backend
        markers = markers or {}
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        table = _byte_decoder()
        pieces: list[bytes | None] = []
        for i in range(tokenizer.vocab_size):
            token = backend.id_to_token(i)
            if i in markers:
                pieces.append(markers[i])
            elif i in special or token is None:
                pieces.append(None)
            elif all(c in table for c in token):
                piece = bytes(table[c] for c in token)
                pieces.append(None if max(piece) >= _NOT_UTF8 else piece)  # no text holds them (marker bytes)
            else:  # not a byte-level token (an added plain-text token): its decoding
                pieces.append(tokenizer.decode([i]).encode("utf-8"))
        return cls(pieces)


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for code points from 256."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ChoiceGrammar:
    """A byte grammar whose documents are exactly the given strings (vLLM's guided choice). State: the bytes read.
    The strings are kept sorted, so those that start with the bytes read lie side by side from the first one not
    below them (a set of every prefix would take memory quadratic in their lengths)."""

    def __init__(self, choices: Sequence[str]):
        if not choices or any(not isinstance(c, str) or not c for c in choices):
            raise ValueError(f"choices: expected non-empty strings, got {list(choices)!r}")
        self.choices = frozenset(c.encode("utf-8") for c in choices)
        self._sorted = sorted(self.choices)
        self.start = b""

    def _first_from(self, state: bytes, longer: bool) -> bytes:
        """The least choice that starts with `state` (and is longer, where asked), or b""."""
        k = bisect.bisect_right(self._sorted, state) if longer else bisect.bisect_left(self._sorted, state)
        return self._sorted[k] if k < len(self._sorted) and self._sorted[k].startswith(state) else b""

    def advance(self, state: bytes, data: bytes) -> bytes | None:
        after = state + data
        return after if self._first_from(after, False) else None

    def complete(self, state: bytes) -> bool:
        return state in self.choices

    def can_continue(self, state: bytes) -> bool:
        return bool(self._first_from(state, True))


class TransitionCache:
    """A grammar with memoised transitions: `next(state, token)` is the state after the token's bytes (None: not
    allowed), computed once per (state, token) and shared by every request over this grammar. Holds at most
    `max_entries` transitions (cleared when full: a cache, not a record; ~120 bytes each, measured, so the default
    bounds it near 25 MB) and `max_masks` full masks (V bools each), and as many of quote-free twins' masks.

    A grammar's state may lie inside a multi-byte character (regexes, Lark grammars and JSON pattern strings hold
    its first bytes, `openm3.engine.utf8`): a byte-level tokenizer splits rare characters over byte tokens. One
    whose states (some of them) take whole characters only says where (`whole_characters_at`, with
    `character_length`): its tokens are walked a character per trie edge there, and a token that ends inside one
    is refused. One that takes split characters in every state may say so (`character_steps`, with
    `character_length`): its tokens are walked a character per edge where they hold it whole, the first bytes of
    one per edge where they end inside it (fewer edges than a byte each)."""

    def __init__(self, grammar, vocab: TokenBytes, max_entries: int = 200_000, max_masks: int = 64):
        self.grammar, self.vocab, self.max_entries, self.max_masks = grammar, vocab, max_entries, max_masks
        self._next: dict = {}
        self._first: dict = {}
        self._full: dict = {}
        self._twin_masks: dict = {}  # quote-free twin state -> its mask over the tokens without a `"`
        self._close_masks: dict = {}  # `quote_close` state -> its mask over the closing tokens (`_Closing`)
        self._order: dict = {}  # sorted token bytes for `full_mask`
        self._twins = hasattr(grammar, "quote_free_twin")
        # grammars whose states (some of them) lie between whole characters: walked a character per trie edge
        self._chars_at = getattr(grammar, "whole_characters_at", None)
        self._char_length = getattr(grammar, "character_length", None)
        if getattr(grammar, "character_steps", False):  # states that take split characters, walked by characters
            self._chars_at = _split_characters
        self._closes = hasattr(grammar, "quote_close")
        self._length_twins = hasattr(grammar, "length_twin")  # bounded pattern strings: see `full_mask`
        self._by_length: tuple | None = None  # (token ids longest first, minus their byte lengths), made when needed
        self._closing: _Closing | None = None
        self.plain: torch.Tensor | None = None  # bool [V]: tokens of plain string text (grammars that tell them)
        if hasattr(grammar, "takes_plain_text"):
            self.plain = torch.tensor([bool(p) and grammar.is_plain_text(p) for p in vocab.pieces])

    def takes_plain_text(self, state) -> bool:
        """Whether every plain-text token is allowed from `state` (a string's body: no check needed)."""
        return self.plain is not None and self.grammar.takes_plain_text(state)

    def next(self, state, token: int):
        key = (state, token)
        try:
            return self._next[key]
        except KeyError:
            pass
        piece = self.vocab.pieces[token] if token < len(self.vocab) else None  # past the table: never allowed
        after = None if piece is None else self.grammar.advance(state, piece)
        if len(self._next) >= self.max_entries:
            self._next.clear()
        self._next[key] = after
        return after

    def full_mask(self, state) -> torch.Tensor:
        """bool [V]: the tokens whose bytes the grammar accepts from `state`, kept for the last `max_masks` states
        (strings and whitespace revisit the same ones). The tokens are walked as a trie (sorted bytes), so a
        refused prefix rules out every token that starts with it at once; in a string's body the plain-text tokens
        are taken whole and only the others are walked. Where the grammar names a quote-free twin of the state
        (`quote_free_twin`: inside a string or key, what lies outside it matters only once a `"` byte closes it),
        the tokens without a `"` take the twin's mask, computed once for every string sharing it, and only the
        tokens holding a `"` are walked from the state itself. Where it also names what a closing quote leads to
        (`quote_close`), the tokens written as plain text, `"`, then bytes without a `"` take that state's mask of
        what may follow the quote (one per key's or string's position, shared by all its steps), and only the
        other tokens with a `"` are walked. Where it names a length twin (`length_twin`: inside a bounded pattern
        string, a state that agrees on every token of at most `room` bytes), the state takes the twin's mask and
        only the longer tokens are checked from the state itself (when they are few)."""
        mask = self._full.get(state)
        if mask is None and self._length_twins:
            mask = self._from_length_twin(state)
        if mask is None:
            twin = self.grammar.quote_free_twin(state) if self._twins else None
            if twin is None:
                mask = self._walked(state, "all")
            else:
                mask = self._twin_masks.get(twin)
                if mask is None:
                    mask = self._walked(twin, "free")
                    self._keep(self._twin_masks, twin, mask)
                mask = mask.clone()
                close = self.grammar.quote_close(state) if self._closes else None
                if close is None:
                    pieces, ids = self._sorted("quote")
                else:
                    closing = self._closing_tokens()
                    after, tails = close
                    if after is not None:
                        mask |= self._closed(after)
                    for tail in tails:  # names the shared rule does not stand for: checked one by one
                        for t in closing.by_head.get(tail, ()):
                            mask[t] = self.grammar.advance(state, self.vocab.pieces[t]) is not None
                    pieces, ids = closing.others
                accepted: list[int] = []
                _walk(self.grammar.advance, state, pieces, ids, 0, len(pieces), 0, accepted, self._chars_at,
                      self._char_length)
                mask[accepted] = True
            self._keep(self._full, state, mask)
        return mask

    def _from_length_twin(self, state) -> torch.Tensor | None:
        """`state`'s full mask from its length twin's, the tokens longer than the twin's room checked one by one;
        None where the grammar names no twin or more than 1/8 of the tokens are longer than its room."""
        found = self.grammar.length_twin(state)
        if found is None:
            return None
        twin, room = found
        if self._by_length is None:
            lengths = torch.tensor([len(p) if p else 0 for p in self.vocab.pieces])
            order = torch.argsort(lengths, descending=True, stable=True)
            self._by_length = (order.tolist(), (-lengths[order]).tolist())
        order, negated = self._by_length
        longer = bisect.bisect_left(negated, -room)  # tokens longer than room bytes (they come first)
        if longer > len(order) // 8:
            return None
        mask = self.full_mask(twin).clone()
        for t in order[:longer]:
            mask[t] = self.next(state, t) is not None
        self._keep(self._full, state, mask)
        return mask

    def _closing_tokens(self) -> "_Closing":
        if self._closing is None:
            self._closing = _Closing(self.vocab, self.grammar.is_plain_text)
        return self._closing

    def _closed(self, after) -> torch.Tensor:
        """bool [V]: the closing tokens (`_Closing`) whose bytes after their `"` the grammar accepts from `after`,
        kept for the last `max_masks` such states."""
        mask = self._close_masks.get(after)
        if mask is None:
            closing = self._closing_tokens()
            accepted: list[int] = []
            _walk(self.grammar.advance, after, closing.tails, list(range(len(closing.tails))), 0,
                  len(closing.tails), 0, accepted, self._chars_at, self._char_length)
            tail_ok = torch.zeros(len(closing.tails), dtype=torch.bool)
            tail_ok[accepted] = True
            mask = torch.zeros(len(self.vocab), dtype=torch.bool)
            mask[closing.ids[tail_ok[closing.tail_of]]] = True
            self._keep(self._close_masks, after, mask)
        return mask

    def _walked(self, state, tokens: str) -> torch.Tensor:
        """bool [V]: which of the tokens in the set `tokens` ("all", or "free": those without a `"`) the grammar
        accepts from `state`; plain-text tokens are taken whole where the state takes plain text."""
        mask = torch.zeros(len(self.vocab), dtype=torch.bool)
        plain = self.takes_plain_text(state)
        if plain:
            mask |= self.plain
        pieces, ids = self._sorted(tokens + ("-rest" if plain else ""))
        accepted: list[int] = []
        _walk(self.grammar.advance, state, pieces, ids, 0, len(pieces), 0, accepted, self._chars_at,
              self._char_length)
        mask[accepted] = True
        return mask

    def _keep(self, masks: dict, key, mask: torch.Tensor) -> None:
        if len(masks) >= self.max_masks:
            masks.pop(next(iter(masks)))
        masks[key] = mask

    def _sorted(self, tokens: str) -> tuple[list[bytes], list[int]]:
        """The tokens of a set, sorted by their bytes, and their ids. Sets: "all" (every token with bytes),
        "free" (no `"` byte), "quote" (a `"` byte); "-rest" appended leaves out the plain-text tokens."""
        if tokens not in self._order:
            kind, _, rest = tokens.partition("-")
            keep = [(p, t) for t, p in enumerate(self.vocab.pieces)
                    if p and not (rest and bool(self.plain[t]))
                    and (kind == "all" or (_QUOTE in p) == (kind == "quote"))]
            keep.sort()
            self._order[tokens] = ([p for p, _ in keep], [t for _, t in keep])
        return self._order[tokens]

    def first_bytes(self, state) -> torch.Tensor:
        """bool [257]: which first bytes the grammar accepts from `state` (slot 256, special tokens: never). Where
        the state lies between whole characters (`whole_characters_at`), the bytes that start a character of
        several bytes (lead bytes, the backslash of an escape) all pass: a pre-filter, the token's own check
        decides."""
        mask = self._first.get(state)
        if mask is None:
            mask = torch.zeros(_NO_BYTES + 1, dtype=torch.bool)
            mode = self._chars_at(state) if self._chars_at is not None else False
            whole = bool(mode) and mode != _SPLIT
            for b in range(256):
                mask[b] = (whole and (0xC2 <= b <= 0xF4 or b == 0x5C)) or \
                    self.grammar.advance(state, bytes((b,))) is not None
            if len(self._first) >= 65536:
                self._first.clear()
            self._first[state] = mask
        return mask


class _Closing:
    """The tokens with a `"` split as head `"` tail: those whose head is plain string text (`is_plain`) and whose
    tail holds no `"` (`ids`, each with its tail's index in the sorted distinct `tails`: `tail_of`; `by_head`: head
    bytes -> their ids), and the others, sorted by their bytes with their ids (`others`, for `_walk`)."""

    def __init__(self, vocab: TokenBytes, is_plain):
        rows, others = [], []
        for t, piece in enumerate(vocab.pieces):
            if not piece or _QUOTE not in piece:
                continue
            head, _, tail = piece.partition(b'"')
            if b'"' not in tail and is_plain(head):
                rows.append((head, tail, t))
            else:
                others.append((piece, t))
        self.tails = sorted({tail for _, tail, _ in rows})
        index = {tail: k for k, tail in enumerate(self.tails)}
        self.ids = torch.tensor([t for _, _, t in rows], dtype=torch.long)
        self.tail_of = torch.tensor([index[tail] for _, tail, _ in rows], dtype=torch.long)
        self.by_head: dict[bytes, list[int]] = {}
        for head, _, t in rows:
            self.by_head.setdefault(head, []).append(t)
        others.sort()
        self.others = ([p for p, _ in others], [t for _, t in others])


def _walk(advance, state, pieces: list[bytes], ids: list[int], lo: int, hi: int, depth: int, out: list[int],
          chars_at=None, char_length=None) -> None:
    """Appends to `out` the ids of pieces[lo:hi] (sorted; all share their first `depth` bytes, read into `state`)
    that the grammar accepts, advancing one byte per trie edge and skipping the subtree of a refused edge. Where
    `chars_at(state)` says the state lies between whole characters (True), an edge is one character
    (`char_length(piece, depth)`, 0 for a piece that ends inside it: refused); where it says `_SPLIT` (a grammar
    that takes split characters: `character_steps`), an edge is one character too, or the first bytes of one
    that a piece ends inside (fewer edges than a byte each, the answers the same)."""
    i = lo
    while i < hi and len(pieces[i]) == depth:  # the shared prefix itself is a token
        out.append(ids[i])
        i += 1
    mode = chars_at(state) if chars_at is not None else False
    while i < hi:
        step = char_length(pieces[i], depth) if mode else 1
        if step == 0:  # ends inside a character (the shorter pieces of a group sort first)
            if mode != _SPLIT:
                i += 1
                continue
            step = len(pieces[i]) - depth
        head = pieces[i][:depth + step]
        b = head[-1]
        j = hi if b == 255 else bisect.bisect_left(pieces, head[:-1] + bytes((b + 1,)), i, hi)
        after = advance(state, head[depth:])
        if after is not None:
            _walk(advance, after, pieces, ids, i, j, depth + step, out, chars_at, char_length)
        i = j


def _split_characters(state) -> int:
    return _SPLIT


class GrammarConstraint:
    """One request's constraint: its grammar state, advanced by each token `pick` returns.

    transitions: the grammar with its memo (`TransitionCache`); stop_tokens: the request's stop tokens, allowed
    once the output is a whole document; think: (start, end) token ids of a reasoning block the answer may open
    with before the grammar applies (None: the grammar applies from the first token); thinking: the prompt has
    opened that block already (the grammar applies after its end token); lazy_checks: tokens checked one by
    one in a pick before the state's full mask decides it instead; trigger: a token from which on the grammar
    applies, once per time it is sampled (None: from the first token, once; see the module docstring); field:
    what asked for the grammar (the server: the request's field), named in a `GrammarDeadEnd`."""

    def __init__(self, transitions: TransitionCache, stop_tokens: Sequence[int],
                 think: tuple[int, int] | None = None, thinking: bool = False, lazy_checks: int = 512,
                 trigger: int | None = None, field: str | None = None):
        self.transitions = transitions
        self.field = field
        self.lazy_checks = lazy_checks
        self.full_masks = 0  # picks that the full mask decided
        self._plain_now = False  # the state takes every plain-text token (set by each pick)
        self.grammar = transitions.grammar
        self.stop_tokens = sorted(set(int(t) for t in stop_tokens))
        self.think = think
        self._stops: torch.Tensor | None = None  # `_stops_on`'s tensor
        self.state = self.grammar.start
        self.phase = "start" if think is not None else "grammar"  # 'start' -> ('thinking' ->) 'grammar'
        self.trigger = trigger
        if trigger is not None:  # 'free' -> (the trigger) 'grammar' -> (a whole document) 'free' ...
            self.phase = "thinking" if thinking else "free"
        if not self.stop_tokens:
            raise ValueError("stop_tokens: a constrained request needs a stop token to end on")
        if thinking:
            if think is None:
                raise ValueError("thinking: a prompt that opened a think block needs think=(start, end) ids")
            self.phase = "thinking"

    def read(self, data: bytes) -> None:
        """Advances over text the output already holds (an assistant prefill the answer continues); ValueError
        when the grammar refuses it."""
        if not data or self.phase == "free":  # free text: nothing to check
            return
        if self.phase == "thinking":
            raise ValueError("cannot be read inside a think block")
        after = self.grammar.advance(self.state, data)
        if after is None:
            raise ValueError(f"is not the beginning of a document the grammar allows: {data[:80]!r}")
        self.state, self.phase = after, "grammar"

    @property
    def complete(self) -> bool:
        """The output so far is a whole document (reasoning aside; with a trigger: no document is open)."""
        if self.trigger is not None:
            return self.phase != "grammar"
        return self.phase != "thinking" and self.grammar.complete(self.state)

    def pick(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None,
             min_p: float = 0.0) -> int:
        """Samples the next token from logits [V] under the constraint (see the module docstring) and advances.
        min_p (vLLM's, after the grammar's mask as vLLM applies it): of the allowed tokens, those less likely than
        min_p times the most likely allowed one are dropped before top-k / top-p (sampled picks only)."""
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {min_p!r}")
        if self.phase in ("thinking", "free"):
            if self.trigger is None and not self.grammar.complete(self.state):  # the answer is still owed: no
                logits = logits.index_fill(0, self._stops_on(logits.device), float("-inf"))  # stop in the block
            if min_p and not sampling.greedy:  # no grammar in free text: over the whole row
                logits = logits.masked_fill(logits < logits.max() + sampling.temperature * math.log(min_p),
                                            float("-inf"))
            token = int(sample(logits[None], sampling, generator)[0])
            if self.phase == "thinking" and token == self.think[1]:
                self.phase = "grammar" if self.trigger is None else "free"
            elif self.phase == "free" and self.think is not None and token == self.think[0]:
                self.phase = "thinking"  # a trigger inside the think block is the model's reasoning
            elif self.phase == "free" and token == self.trigger:
                self.state, self.phase = self.transitions.next(self.grammar.start, token), "grammar"
                if self.state is None:
                    raise ValueError(f"trigger: the grammar does not begin with token {token}")
            return token
        width = len(self.transitions.vocab)
        if logits.shape[-1] != width:  # a model wider than its tokenizer: the ids past the table are never allowed
            if logits.shape[-1] < width:
                raise ValueError(f"logits: {logits.shape[-1]} of them, fewer than the vocabulary's {width} tokens")
            logits = logits[:width]
        row = logits.float().cpu().masked_fill(~self._allowed_first(), float("-inf"))  # one host copy per step
        self._plain_now = self.transitions.takes_plain_text(self.state)
        token = self._choose(logits, row, sampling, generator, min_p if not sampling.greedy else 0.0)
        if token is None:
            token = self._no_token_left()
        if self.phase == "start" and token == self.think[0]:
            self.phase = "thinking"
            return token
        self.phase = "grammar"
        if token not in self.stop_tokens:
            self.state = self.transitions.next(self.state, token)
            if self.trigger is not None and self.grammar.complete(self.state):  # the document is whole: free again
                self.state, self.phase = self.grammar.start, "free"
        return token

    # ------------------------------------------------------------------ internals

    def _no_token_left(self) -> int:
        """The pick where no allowed token has a finite logit: a stop token where the output is a whole document
        (the logits held the stops back: `min_tokens`), else `GrammarDeadEnd` (module docstring)."""
        if self.grammar.complete(self.state):
            return self.stop_tokens[0]
        if self.grammar.can_continue(self.state) and bool(self.transitions.full_mask(self.state).any()):
            why = ("every token the grammar allows next has a logit of -inf (the request's own settings, such as "
                   "allowed_token_ids or bad_words, rule them all out)")
        else:  # (the grammar's own dead end: a pattern left to `regex`, or a tokenizer without some byte's token)
            why = ("no token continues the text so far, which is not a whole answer (a pattern with lookaround or "
                   "other syntax the automaton lacks is checked by the `regex` package a prefix at a time, and can "
                   "take a start that no match continues)")
        raise GrammarDeadEnd(f"{self.field or 'constrained decoding'}: the answer cannot be finished: {why}",
                             self.field)

    def _stops_on(self, device: torch.device) -> torch.Tensor:
        """The stop token ids as an int64 tensor on `device` (made once per device)."""
        if self._stops is None or self._stops.device != device:
            self._stops = torch.tensor(self.stop_tokens, dtype=torch.long, device=device)
        return self._stops

    def _allowed_first(self) -> torch.Tensor:
        """bool [V]: the tokens that may be allowed (first byte accepted, or a stop / think token that is)."""
        vocab = self.transitions.vocab
        if self.grammar.can_continue(self.state):
            ok = self.transitions.first_bytes(self.state)[vocab.first_byte]
        else:
            ok = torch.zeros(len(vocab), dtype=torch.bool)
        if self.grammar.complete(self.state):
            ok[self.stop_tokens] = True
        if self.phase == "start":
            ok[self.think[0]] = True
        return ok

    def _accepts(self, token: int) -> bool:
        if self._plain_now and self.transitions.plain[token]:
            return True
        if token in self.stop_tokens:
            return self.grammar.complete(self.state)
        if self.phase == "start" and token == self.think[0]:
            return True
        return self.transitions.next(self.state, token) is not None

    def _full_mask(self) -> torch.Tensor:
        """bool [V]: every token allowed now (the grammar's full mask for this state, cached), with the stop and
        think tokens that are."""
        ok = self.transitions.full_mask(self.state) if self.grammar.can_continue(self.state) else \
            torch.zeros(len(self.transitions.vocab), dtype=torch.bool)
        ok = ok.clone()
        if self.grammar.complete(self.state):
            ok[self.stop_tokens] = True
        if self.phase == "start":
            ok[self.think[0]] = True
        return ok

    def _checked(self, order: Iterator[int]) -> Iterator[tuple[int, bool]]:
        """(token, accepted) along `order`; raises _OverBudget after `lazy_checks` tokens."""
        for n, token in enumerate(order):
            if n == self.lazy_checks:
                raise _OverBudget
            yield token, self._accepts(token)

    def _choose(self, logits: torch.Tensor, row: torch.Tensor, sampling: SamplingParams, generator,
                min_p: float = 0.0) -> int | None:
        """The pick: lazily over `row` (the logits on the host, first-byte candidates only; module docstring), or
        over the full mask once `lazy_checks` tokens were checked (then a filtered sample is drawn on the logits'
        own device, where the sort of a 200K-token row is cheap). min_p: the allowed tokens below the most likely
        allowed one's logit + temperature x log(min_p) are left out (found lazily too: the first accepted token
        in the row's order is the most likely allowed one)."""
        filtered = sampling.top_k or sampling.top_p < 1
        scores = row
        if not sampling.greedy and not filtered:  # Gumbel-max over the accepted tokens
            u = torch.rand(row.shape, generator=_cpu(generator)).clamp_(1e-20, 1.0)
            scores = row / sampling.temperature - torch.log(-torch.log(u))
        floor = None  # min_p's lowest kept logit
        try:
            if min_p:
                best = next((t for t, ok in self._checked(_descending(row)) if ok), None)
                if best is None:
                    return None
                floor = float(row[best]) + sampling.temperature * math.log(min_p)
            if not filtered:
                order = _descending(scores)
                if floor is not None:
                    order = (t for t in order if row[t] >= floor)
                return next((t for t, ok in self._checked(order) if ok), None)
            kept = self._filter_set(row, sampling, floor)
        except _OverBudget:
            self.full_masks += 1
            mask = self._full_mask()
            if not bool((mask & (row > float("-inf"))).any()):
                return None
            if min_p:
                allowed = row.masked_fill(~mask, float("-inf"))
                mask &= row >= float(allowed.max()) + sampling.temperature * math.log(min_p)
            if not filtered:
                return int(scores.masked_fill(~mask, float("-inf")).argmax())
            index = mask.nonzero()[:, 0].to(logits.device)  # the allowed tokens alone, in id order
            return int(index[draw(logits[index], sampling, generator)])
        if not kept:
            return None
        index = torch.tensor(kept)  # a draw among the kept tokens alone: no sort of the whole row
        return int(index[draw(row[index], sampling, generator)])

    def _filter_set(self, row: torch.Tensor, sampling: SamplingParams, floor: float | None = None) -> list[int]:
        """Accepted tokens, most likely first, enough of them that top-k / top-p over them equals top-k / top-p
        over every accepted token (at least `floor`: min_p's threshold)."""
        kept: list[int] = []
        order = _descending(row)
        if floor is not None:  # past the floor no token counts: the scan ends there
            order = itertools.takewhile(lambda t: row[t] >= floor, order)
        if sampling.top_k:
            for t, ok in self._checked(order):
                if ok:
                    kept.append(t)
                    if len(kept) == sampling.top_k:
                        break
            return kept
        probs = (row / sampling.temperature).softmax(-1)  # over the first-byte candidates
        if floor is None and float(probs.topk(min(self.lazy_checks, probs.numel())).values.sum()) < sampling.top_p:
            raise _OverBudget  # a flat row: even all of the budget's tokens accepted could not settle the nucleus
        seen, found, masses = 0.0, 0.0, []
        for t, ok in self._checked(order):
            mass = float(probs[t])
            seen += mass
            if ok:
                kept.append(t)
                masses.append(mass)
                found += mass
                unseen = max(0.0, 1.0 - seen)
                if _nucleus_settled(masses, found, unseen, sampling.top_p):
                    break
        return kept


def draw(row: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    """A sample from logits row [n] after temperature, top-k and top-p (as `filter_logits` applies them, ties at
    the k-th value aside), by inverse CDF over the tokens most likely first with one uniform draw: the same token
    whether the row holds every allowed token or only the most likely ones that hold the filtered set (which
    `torch.multinomial` does not promise). One sort of the row."""
    values, order = (row.float() / sampling.temperature).sort(descending=True, stable=True)
    if sampling.top_k and sampling.top_k < values.numel():
        values[sampling.top_k:] = float("-inf")
    probs = values.softmax(0)
    if sampling.top_p < 1:  # drop a token when the tokens strictly more likely than it already reach top_p
        drop = (probs.cumsum(0) - probs) >= sampling.top_p
        drop[0] = False
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(0)
    u = float(torch.rand(1, generator=_cpu(generator)))
    k = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], device=cdf.device, dtype=cdf.dtype)))
    return int(order[min(k, order.numel() - 1)])


class GrammarDeadEnd(RuntimeError):
    """A constrained pick found no token to go on with and no whole document to end (module docstring); `field`:
    the constraint's (what asked for the grammar), None where it names none."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class _OverBudget(Exception):
    """The lazy checks reached their budget: the full mask decides."""


def _nucleus_settled(masses: list[float], found: float, unseen: float, top_p: float) -> bool:
    """Whether the top-p nucleus over all accepted tokens is known from the accepted masses so far (most likely
    first; `found` their sum) when at most `unseen` mass is left unchecked: the same tokens are kept whether that
    mass is accepted or not, and none of it would be."""
    if found < top_p * (found + unseen):
        return False  # an unchecked token could still belong to the nucleus

    def kept(total: float) -> int:
        before = 0.0
        for j, m in enumerate(masses):
            if before >= top_p * total:
                return j
            before += m
        return len(masses)

    return kept(found) == kept(found + unseen)


def _descending(scores: torch.Tensor) -> Iterator[int]:
    """Token ids in descending order of `scores` [V], stopping at the first -inf; sorts only as far as it is read
    (top-k of growing sizes)."""
    size, done = 32, 0
    total = scores.numel()
    while done < total:
        size = min(size, total)
        values, ids = scores.topk(size)
        for v, t in zip(values[done:].tolist(), ids[done:].tolist()):
            if v == -math.inf:
                return
            yield t
        done, size = size, size * 8


def _cpu(generator: torch.Generator | None) -> torch.Generator | None:
    """The generator for draws made on the host: the request's own when it is a CPU generator; for a CUDA one, a
    CPU generator seeded from it (one draw), so a request's tokens still follow from its seed."""
    if generator is None or generator.device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), device=generator.device, generator=generator))
    return torch.Generator().manual_seed(seed)
