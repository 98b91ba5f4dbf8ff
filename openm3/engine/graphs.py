"""CUDA-graph decode steps: the forward of a decode step captured once per batch and replayed every step.

An eager decode step of a small model is bound by launching kernels from Python, not by the GPU: m3-small at a
128K-token prompt took ~41 ms per step on an H200 (24 tokens/s) for a few ms of kernel time. `DecodeGraphs`
records the whole forward of one decode step (embedding, every layer with its cache writes and MSA decode
kernels, the logits) as one CUDA graph and replays it, after writing the step's inputs (token ids, positions,
cache slots, sequence lengths) into fixed device buffers (`PagedCache.step(..., buffers=)`).

Per batch of running sequences and tokens per sequence (a graph's shapes are theirs: one token, or a token and
its speculative drafts): the first step runs eagerly through the buffers (kernels compile, per-tensor host caches
fill), the second captures the graph and replays it, and every later step only replays. A batch keeps a graph per
shape, so speculative and plain steps alternate without new captures; when the batch changes (a sequence
finished) its graphs are dropped and the new batch starts over. If a capture fails, the remaining steps run
eagerly, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from .cache import PagedCache, StepBuffers
from .scheduler import decode_step

__all__ = ["DecodeGraphs"]


class _Batch:
    """Buffers, graph and output of one decode batch and shape (q_len tokens per sequence)."""

    def __init__(self, cache: PagedCache, seq_ids: Sequence[int], q_len: int):
        self.buffers = StepBuffers(cache, seq_ids, q_len=q_len)
        self.q_len = q_len
        self.ids = torch.zeros(len(seq_ids) * q_len, dtype=torch.int64, device=cache.device)
        self.positions = torch.zeros(len(seq_ids) * q_len, dtype=torch.int64, device=cache.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, overwritten by each replay
        self.warm = False

    def forward(self, model, cache: PagedCache) -> torch.Tensor:
        # The embedding is looked up here rather than by the model, whose input-id range check reads the ids on
        # the host (not allowed while capturing); `DecodeGraphs.step` checks them before they reach the buffer.
        x = model.embed_tokens(self.ids)
        return model(inputs_embeds=x, position_ids=self.positions, cu_seqlens=self.buffers.cu_seqlens,
                     cache=cache).logits


class DecodeGraphs:
    """Decode steps of `model` over `cache` through CUDA graphs (see the module docstring).

    `step(seq_ids, tokens)` is a drop-in for `scheduler.decode_step(model, cache, seq_ids, tokens)`. Counters:
    `captures` (graphs recorded), `replays` (steps that ran a graph), `eager_steps`.
    """

    def __init__(self, model, cache: PagedCache):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cache on a CUDA device, got {cache.device}")
        self.model = model
        self.cache = cache
        self.enabled = True
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        self._batches: dict[int, _Batch] = {}  # by q_len, all for the same sequences

    @torch.no_grad()
    def step(self, seq_ids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per sequence (tokens int [B], at position = the sequence's cached length) -> next-token
        logits [B, V]; or q per sequence (tokens [B, q]) -> [B, q, V] (fp32, a fresh tensor)."""
        seq_ids = list(seq_ids)
        if tokens.dim() not in (1, 2) or tokens.shape[0] != len(seq_ids) or tokens.numel() == 0 \
                or tokens.dtype.is_floating_point:
            raise ValueError(f"tokens must be an int tensor [B={len(seq_ids)}] or [B, q], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        if not self.enabled:
            self.eager_steps += 1
            return decode_step(self.model, self.cache, seq_ids, tokens)
        q_len = 1 if tokens.dim() == 1 else tokens.shape[1]
        batch = self._batches.get(q_len)
        if batch is None or batch.buffers.seq_ids != tuple(seq_ids):
            if batch is not None or any(b.buffers.seq_ids != tuple(seq_ids) for b in self._batches.values()):
                self._batches.clear()  # frees the previous batch's graphs before the next one is recorded
            batch = self._batches[q_len] = _Batch(self.cache, seq_ids, q_len)
        self._set_inputs(batch, seq_ids, tokens)
        if batch.warm and batch.graph is None:
            try:
                self._capture(batch, seq_ids)
            except RuntimeError as e:
                warnings.warn(f"capturing the decode step as a CUDA graph failed ({e}); decoding eagerly from now on")
                self.enabled = False
                self._batches.clear()
                self.eager_steps += 1
                return decode_step(self.model, self.cache, seq_ids, tokens)
        with self.cache.step(seq_ids, [q_len] * len(seq_ids), buffers=batch.buffers):
            if batch.graph is None:  # the batch's first step: eager, through the same buffers
                logits = batch.forward(self.model, self.cache)
                batch.warm = True
                self.eager_steps += 1
            else:
                batch.graph.replay()
                logits = batch.logits
                self.replays += 1
        logits = logits.to(torch.float32, copy=True)
        return logits if tokens.dim() == 1 else logits.view(len(seq_ids), q_len, -1)

    def _set_inputs(self, batch: _Batch, seq_ids: list[int], tokens: torch.Tensor) -> None:
        vocab = self.model.config.vocab_size
        host = tokens.reshape(-1).tolist()
        if any(not 0 <= t < vocab for t in host):
            raise ValueError(f"tokens must lie in [0, vocab_size={vocab}), got {host}")
        batch.ids.copy_(tokens.reshape(-1), non_blocking=True)
        starts = torch.tensor([self.cache.length(s) for s in seq_ids], dtype=torch.int64)
        positions = (starts[:, None] + torch.arange(batch.q_len)).reshape(-1)
        batch.positions.copy_(positions, non_blocking=True)

    def _capture(self, batch: _Batch, seq_ids: list[int]) -> None:
        graph = torch.cuda.CUDAGraph()
        # recorded, not run: the cache's lengths stay; the replay below is the step itself
        with self.cache.step(seq_ids, [batch.q_len] * len(seq_ids), buffers=batch.buffers, advance=False):
            with torch.cuda.device(self.cache.device), torch.cuda.graph(graph):  # on the cache's GPU
                batch.logits = batch.forward(self.model, self.cache)
        batch.graph = graph
        self.captures += 1
