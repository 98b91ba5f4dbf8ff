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

    def __init__(self):
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


def reuse_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """`context_fn` for `torch.utils.checkpoint.checkpoint` (and `checkpoint_wrapper`): a fresh `CheckpointReuse`
    per checkpointed call, recording in the forward and replaying in the recomputation."""
    reuse = CheckpointReuse()
    return reuse._active(False), reuse._active(True)


def current() -> CheckpointReuse | None:
    """The `CheckpointReuse` of the checkpointed call running now, or None."""
    return _ACTIVE.get()
