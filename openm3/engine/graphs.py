"""CUDA-graph decode steps: the forward of a decode step captured once per shape and replayed every step.

An eager decode step of a small model is bound by launching kernels from Python, not by the GPU: m3-small at a
128K-token prompt took ~41 ms per step on an H200 (24 tokens/s) for a few ms of kernel time. `DecodeGraphs`
records the whole forward of one decode step (embedding, every layer with its cache writes and MSA decode
kernels, the logits) as one CUDA graph and replays it, after writing the step's inputs (token ids, positions,
cache slots, sequence lengths) into fixed device buffers (`PagedCache.step(..., buffers=)`).

A graph serves a shape, not a batch: R rows of q_len tokens each (one token, or a token and its speculative
drafts) whose page tables fit in W columns. R is the batch's size B rounded up to 1, 2, 4, 8 or a multiple of 8
(`padded_rows`; the R - B padding rows write into the cache's scratch page and their logits are dropped). For two
or more sequences W is the batch's widest table rounded up to one of 16 widths per octave (`padded_width`: at
most 1/16 more columns, which the kernels skip past each sequence's length), so batches of similar reservations
share it; a lone sequence keeps its exact width (its long-context step works on every column's segments: padded,
it measured ~2% slower at a 128K prompt, and a batch of one changes rarely).

The first step of a new shape runs eagerly through the buffers (kernels compile, per-tensor host caches fill),
the second captures the graph and replays it, and every later step of that shape only replays, whichever
sequences it holds: when the batch changes (a sequence finished, another joined) to a shape seen before, the new
batch's page table is written into that graph's buffers and the graph replays at once. Graphs share one memory
pool (they never run at the same time; each step's logits are copied out before the next replay) and the
`max_graphs` shapes used last are kept. If a capture fails, the remaining steps run eagerly, with a warning.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import OrderedDict
from typing import Sequence

import torch

from ..ops.host import copy_from_host
from .cache import PagedCache, StepBuffers
from .scheduler import decode_step
from .sampling import check_count

__all__ = ["DecodeGraphs", "padded_rows", "padded_width"]


def padded_rows(batch: int) -> int:
    """The rows of the graph that serves a batch of `batch` sequences: 1, 2, 4, 8, then multiples of 8."""
    return batch if batch <= 2 else 4 if batch <= 4 else -(-batch // 8) * 8


def padded_width(pages: int) -> int:
    """A page-table width of at least `pages` columns from a coarse set (exact up to 16; then 16 widths per
    octave: multiples of 2^(floor(log2(pages)) - 4)), so batches of similar reservations share a graph."""
    if pages <= 16:
        return max(pages, 1)
    step = 1 << (pages.bit_length() - 5)
    return -(-pages // step) * step


class _Batch:
    """Buffers, graph and output of one decode shape: `rows` rows of q_len tokens, page tables of `width` columns."""

    def __init__(self, cache: PagedCache, seq_ids: Sequence[int], q_len: int, width: int, rows: int):
        self.buffers = StepBuffers(cache, seq_ids, q_len=q_len, width=width, rows=rows)
        self.q_len = q_len
        self.ids = torch.zeros(rows * q_len, dtype=torch.int64, device=cache.device)
        self.positions = torch.zeros(rows * q_len, dtype=torch.int64, device=cache.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # the graph's output, overwritten by each replay
        self.warm = False

    def forward(self, model, cache: PagedCache) -> torch.Tensor:
        # The embedding is looked up here rather than by the model, whose input-id range check reads the ids on
        # the host (not allowed while capturing); `DecodeGraphs.step` checks them before they reach the buffer.
        x = model.embed_tokens(self.ids)
        return model(inputs_embeds=x, position_ids=self.positions, cu_seqlens=self.buffers.cu_seqlens,
                     cache=cache).logits


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../openm3


def _where(error: BaseException, frames: int = 2) -> str:
    """`, at openm3/PATH:LINE (CODE) <- ...` for the innermost `frames` frames of `error`'s traceback inside this
    package (the op a capture refused, usually a host read, and its caller), or ``""``."""
    ours = []
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE + os.sep) and len(ours) < frames:
            name = os.path.relpath(path, os.path.dirname(_PACKAGE)).replace(os.sep, "/")
            ours.append(f"{name}:{frame.lineno} ({(frame.line or '').strip()})")
    return f", at {' <- '.join(ours)}" if ours else ""


class DecodeGraphs:
    """Decode steps of `model` over `cache` through CUDA graphs (see the module docstring).

    `step(seq_ids, tokens)` is a drop-in for `scheduler.decode_step(model, cache, seq_ids, tokens)`. Counters:
    `captures` (graphs recorded), `replays` (steps that ran a graph), `eager_steps`, `rebinds` (steps that
    replayed a graph recorded for other sequences). max_graphs: shapes whose graphs are kept (least recently used
    dropped first).
    """

    def __init__(self, model, cache: PagedCache, *, max_graphs: int = 32):
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a cache on a CUDA device, got {cache.device}")
        check_count("max_graphs", max_graphs)
        self.model = model
        self.cache = cache
        self.max_graphs = max_graphs
        self.enabled = True
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        self.rebinds = 0
        self._batches: OrderedDict[tuple[int, int, int], _Batch] = OrderedDict()  # by (rows, q_len, width)
        self._pool = None  # the graphs' shared memory pool, made at the first capture

    @torch.no_grad()
    def step(self, seq_ids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """Feeds one token per sequence (tokens int [B], at position = the sequence's cached length) -> next-token
        logits [B, V]; or q per sequence (tokens [B, q]) -> [B, q, V] (fp32, a fresh tensor). Host tokens are
        range-checked and uploaded into the graph's input; CUDA tokens (sampled on the device: `generate(...,
        overlap=True)`) are copied there on the device, unchecked and without waiting for them."""
        seq_ids = list(seq_ids)
        if tokens.dim() not in (1, 2) or tokens.shape[0] != len(seq_ids) or tokens.numel() == 0 \
                or tokens.dtype.is_floating_point:
            raise ValueError(f"tokens must be an int tensor [B={len(seq_ids)}] or [B, q], got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        if not self.enabled:
            self.eager_steps += 1
            return decode_step(self.model, self.cache, seq_ids, tokens)
        q_len = 1 if tokens.dim() == 1 else tokens.shape[1]
        width = self.cache.table_width(seq_ids)
        key = (padded_rows(len(seq_ids)), q_len, padded_width(width) if len(seq_ids) > 1 else width)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = _Batch(self.cache, seq_ids, q_len, key[2], key[0])
            while len(self._batches) > self.max_graphs:
                self._batches.popitem(last=False)
        else:
            self._batches.move_to_end(key)
            if batch.buffers.seq_ids != tuple(seq_ids):
                self.rebinds += batch.graph is not None
            batch.buffers.bind(self.cache, seq_ids)
        self._set_inputs(batch, seq_ids, tokens)
        if batch.warm and batch.graph is None:
            try:
                self._capture(batch, seq_ids)
            except RuntimeError as e:
                warnings.warn(f"capturing the decode step as a CUDA graph failed ({e}{_where(e)}); decoding eagerly "
                              f"from now on")
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
        logits = logits[:len(seq_ids) * q_len].to(torch.float32, copy=True)  # without the padding rows'
        return logits if tokens.dim() == 1 else logits.view(len(seq_ids), q_len, -1)

    def _set_inputs(self, batch: _Batch, seq_ids: list[int], tokens: torch.Tensor) -> None:
        vocab = self.model.config.vocab_size
        if not tokens.is_cuda:  # tokens on the device (sampled there) are not read back: that would wait for them
            host = tokens.reshape(-1).tolist()
            if any(not 0 <= t < vocab for t in host):
                raise ValueError(f"tokens must lie in [0, vocab_size={vocab}), got {host}")
        pads = batch.buffers.rows - len(seq_ids)  # padding rows: token 0 at positions 0..q_len-1
        ids = tokens.reshape(-1)  # padded where it is (on the host: one upload, no kernels)
        copy_from_host(batch.ids, torch.cat([ids, ids.new_zeros(pads * batch.q_len)]) if pads else ids)
        starts = torch.tensor([self.cache.length(s) for s in seq_ids] + [0] * pads, dtype=torch.int64)
        positions = (starts[:, None] + torch.arange(batch.q_len)).reshape(-1)
        copy_from_host(batch.positions, positions)

    def _capture(self, batch: _Batch, seq_ids: list[int]) -> None:
        graph = torch.cuda.CUDAGraph()
        # recorded, not run: the cache's lengths stay; the replay below is the step itself
        with self.cache.step(seq_ids, [batch.q_len] * len(seq_ids), buffers=batch.buffers, advance=False):
            with torch.cuda.device(self.cache.device):  # on the cache's GPU
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(graph, pool=self._pool):
                    batch.logits = batch.forward(self.model, self.cache)
        batch.graph = graph
        self.captures += 1
