"""Chunked prefill and batched decode steps over a `PagedCache`.

Prefill packs at most `chunk_size` prompt tokens per forward (a long prompt takes several forwards, short prompts
share one), so activation memory is bounded by the chunk and a 1M-token prompt runs in chunks; every chunk attends
to everything cached before it through the cache (MSA selection for MSA layers), which makes chunked prefill equal
to one forward over the whole prompt. Decode feeds one new token per running sequence per forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .cache import PagedCache


def _forward(model, cache: PagedCache, seq_ids: list[int], pieces: list[torch.Tensor], starts: list[int],
             logit_rows: list[int]) -> torch.Tensor:
    """One forward over `pieces[b]` (new token ids of sequence seq_ids[b], first at position starts[b]);
    returns logits for the packed rows `logit_rows` -> [len(logit_rows), V]."""
    device = cache.device
    lens = [p.numel() for p in pieces]
    ids = torch.cat(pieces).to(device)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    rows = torch.tensor(logit_rows, dtype=torch.int64, device=device)
    with cache.step(seq_ids, lens):
        return model(ids, position_ids=pos, cu_seqlens=cu.to(device), logits_index=rows, cache=cache).logits


@torch.no_grad()
def prefill(model, cache: PagedCache, seq_ids: Sequence[int], prompts: Sequence[torch.Tensor], *,
            chunk_size: int = 8192, on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
    """Runs the prompts through the model in chunks; returns the last prompt token's logits [B, V] (fp32).

    seq_ids: admitted cache sequences (empty so far); prompts: int64 [L_b] each; on_chunk(n) is called after
    each forward with the number of prompt tokens it consumed (for progress bars).
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if len(seq_ids) != len(prompts):
        raise ValueError(f"seq_ids ({len(seq_ids)}) and prompts ({len(prompts)}) must match")
    done = [0] * len(prompts)
    last: list[torch.Tensor | None] = [None] * len(prompts)
    while any(d < p.numel() for d, p in zip(done, prompts)):
        batch, pieces, starts, rows, owners = [], [], [], [], []
        budget, row = chunk_size, 0
        for b, prompt in enumerate(prompts):
            n = min(prompt.numel() - done[b], budget)
            if n <= 0:
                continue
            batch.append(seq_ids[b])
            pieces.append(prompt[done[b]:done[b] + n])
            starts.append(done[b])
            row += n
            if done[b] + n == prompt.numel():
                rows.append(row - 1)
                owners.append(b)
            done[b] += n
            budget -= n
            if budget == 0:
                break
        logits = _forward(model, cache, batch, pieces, starts, rows)
        for b, lg in zip(owners, logits):
            last[b] = lg.float()
        if on_chunk is not None:
            on_chunk(sum(p.numel() for p in pieces))
    return torch.stack(last)


@torch.no_grad()
def decode_step(model, cache: PagedCache, seq_ids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
    """Feeds one token per sequence (tokens int64 [B], at position = the sequence's cached length);
    returns next-token logits [B, V] (fp32)."""
    seq_ids = list(seq_ids)
    if tokens.shape != (len(seq_ids),):
        raise ValueError(f"tokens must be [B={len(seq_ids)}], got {tuple(tokens.shape)}")
    starts = [cache.length(s) for s in seq_ids]
    pieces = list(tokens.reshape(-1, 1).cpu())
    return _forward(model, cache, seq_ids, pieces, starts, list(range(len(seq_ids)))).float()
