"""What a checkpointed layer's forward hands to its recomputation, so the backward does not redo it.

Activation checkpointing (`torch.utils.checkpoint`, non-reentrant) runs a layer's forward again in the backward
to rebuild the tensors its autograd nodes saved. An MSA layer's forward also runs two things that only feed the
loss: the block selection (integers, no gradient) and the indexer KL (whose Triton kernel computes the loss and
its gradients in one pass and saves the gradients). Recomputing them is wasted work: on m3-small at 64K they were
13% of the step (session 10). With `reuse_contexts` as the checkpoint's `context_fn`:

- the forward records the selection (`put`) and runs the KL with its saved tensors kept as they are
  (`keep_saved`: identity saved-tensor hooks, so the checkpoint neither drops nor expects them);
- the recomputation takes the recorded selection back (`take`) and skips the KL (its node already holds its
  tensors), returning the recorded loss value in its place so the rest of the layer sees the same types.

The price is memory held from the forward to the backward: per MSA layer the selection (`[Hi, T, topk]` int32)
and the KL's fp32 gradients (`[T, Hi, Di]` and `[Tk, Di]`): 2.4 GB over m3-small's 15 MSA layers at 64K.

`reuse_contexts(keep_attention=True)` also keeps every layer's attention (`kept_attention`: dense and MSA decoder
layers, vision blocks): the forward's attention node keeps its saved tensors and the recomputation gets the
forward's output back instead of running the attention again (a selective checkpoint: at long contexts the
attention is the costliest part of a layer to recompute).
On CUDA the kernels save q, k, v, the output and the softmax statistics (and the MSA ops their index
bookkeeping): m3-small at 64K tokens on an H200, 9 GB more over its 16 layers for a 6.9% faster MSA step and a 17%
faster dense one (session 23). On CPU the PyTorch paths save their whole graph (the dense math path its [T, T]
probabilities), so it is meant for the GPU.
Outside a checkpoint with these contexts (`current()` is None) nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

_ACTIVE: contextvars.ContextVar["CheckpointReuse | None"] = contextvars.ContextVar("openm3_checkpoint_reuse",
                                                                                   default=None)


class CheckpointReuse:
    """The values one checkpointed call's forward records for its recomputation, in order."""

    def __init__(self, keep_attention: bool = False, reuse_msa: bool = True):
        self.keep_attention = keep_attention  # the layers' attention runs once too (`kept`)
        self.reuse_msa = reuse_msa  # MSA layers' selection and indexer KL run once
        self.replaying = False
        self._values: list[Any] = []
        self._next = 0

    def put(self, value: Any) -> None:
        if self.replaying:
            raise RuntimeError("CheckpointReuse.put during the recomputation (use take)")
        self._values.append(value)

    def take(self) -> Any:
        if not self.replaying or self._next >= len(self._values):
            raise RuntimeError(f"CheckpointReuse.take: the forward recorded {len(self._values)} values, "
                               f"{self._next} taken (replaying={self.replaying})")
        value = self._values[self._next]
        self._next += 1
        return value

    def kept(self, run):
        """`run()` (a tuple of tensors and None) once: in the forward under `keep_saved`, recording detached
        outputs; in the recomputation those again, each requiring grad as the forward's did (so the layer's
        later ops save what they saved in the forward)."""
        if self.replaying:
            return tuple(None if t is None else t.detach().requires_grad_(grad) for t, grad in self.take())
        with self.keep_saved():
            out = run()
        self.put(tuple((None, False) if t is None else (t.detach(), t.requires_grad) for t in out))
        return out

    @staticmethod
    def keep_saved():
        """Autograd nodes created inside keep their saved tensors (no checkpoint placeholder to refill)."""
        return torch.autograd.graph.saved_tensors_hooks(_same, _same)

    @contextlib.contextmanager
    def _active(self, replaying: bool) -> Iterator[None]:
        self.replaying, self._next = replaying, 0
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def reuse_contexts(keep_attention: bool = False, reuse_msa: bool = True
                   ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint` (and `checkpoint_wrapper`): a fresh `CheckpointReuse`
    per checkpointed call, recording in the forward and replaying in the recomputation (`functools.partial` it
    for other flags than the defaults)."""
    reuse = CheckpointReuse(keep_attention, reuse_msa)
    return reuse._active(False), reuse._active(True)


def current() -> CheckpointReuse | None:
    """The `CheckpointReuse` of the checkpointed call running now, or None."""
    return _ACTIVE.get()


def kept_attention(run):
    """`run()` (an attention: a tuple of tensors and None) through the running checkpointed call's `kept` when
    it keeps the attention (`keep_attention`), else as it is."""
    reuse = _ACTIVE.get()
    return reuse.kept(run) if reuse is not None and reuse.keep_attention else run()


def current_msa() -> CheckpointReuse | None:
    """`current()` when it reuses MSA layers' selection and KL (`reuse_msa`), else None."""
    reuse = _ACTIVE.get()
    return reuse if reuse is not None and reuse.reuse_msa else None


class CheckpointSwitch:
    """`gradient_checkpointing_enable` / `gradient_checkpointing_disable` (transformers' names) for a model whose
    forward checkpoints its blocks while training, with `checkpoint_contexts` as the checkpoints' `context_fn`."""

    gradient_checkpointing = False
    checkpoint_keep_attention = False

    def gradient_checkpointing_enable(self, keep_attention: bool = False) -> None:
        """Recompute each block in the backward while training (non-reentrant checkpoints). MSA layers hand
        their block selection and indexer KL to the recomputation; with `keep_attention` every block's attention
        is kept too and not recomputed (a selective checkpoint: more memory, less time)."""
        self.gradient_checkpointing, self.checkpoint_keep_attention = True, keep_attention

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = self.checkpoint_keep_attention = False

    def checkpoint_contexts(self):
        return reuse_contexts(keep_attention=self.checkpoint_keep_attention)
