"""Next-token cross-entropy over packed batches: the one loss kernel the trainer and the models' `labels=` share.

`cross_entropy` takes labels already aligned with the logits (`labels[i]` is the target of row i; the trainer's
batches are built so). `causal_lm_loss` takes them unshifted, as transformers' `ForCausalLMLoss` does, and shifts
them inside each packed sequence of `cu_seqlens` (`shift_labels`) before the same kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import fused_on_cuda

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "cross_entropy", "shift_labels"]

IGNORE_INDEX = -100  # a label with no target (transformers' and torch's ignore_index)


@fused_on_cuda
def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per row in fp32 (0 where ignored). `logits: [T, V]`, `labels: [T]` int64 (aligned, -100
    ignored) -> `[T]`.

    On CUDA the loss is one compiled (fused) kernel forward and backward (`fused_on_cuda`): eagerly it
    materialises fp32 copies of the [T, V] logits, their log-softmax and its gradient (several GB per step at 32K
    vocab and 16K tokens)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [T, V] and labels [T], got {tuple(logits.shape)} and {tuple(labels.shape)}")
    return _cross_entropy(logits, labels)


def shift_labels(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Unshifted `labels: [T]` -> the targets `[T]` int64 of each row: `labels[i + 1]` when token i + 1 belongs to
    the same sequence of `cu_seqlens: int32 [B+1]`, -100 at each sequence's last token (nothing follows it there).
    No host read of `cu_seqlens`."""
    # ends[j]: position j starts a sequence or is the end of the batch, so token j - 1 ends its sequence
    ends = torch.zeros(labels.shape[0] + 1, dtype=torch.bool, device=labels.device)
    ends[cu_seqlens.to(labels.device, torch.long)] = True
    following = F.pad(labels.long(), (0, 1), value=IGNORE_INDEX)[1:]
    return torch.where(ends[1:], IGNORE_INDEX, following)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                   num_items_in_batch: torch.Tensor | int | float | None = None) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` over a packed batch: scalar fp32 next-token cross-entropy.

    logits: [T, V] (upcast to fp32); labels: [T] token ids, unshifted (the target of row i is `labels[i + 1]` of
    the same sequence, see `shift_labels`), -100 ignored; cu_seqlens: int32 [B+1]. Reduction: the sum over the
    targets divided by `num_items_in_batch` when given (gradient accumulation: the targets of all micro-batches of
    the step), else the mean over the targets that are not ignored. With no target at all that mean is NaN, as
    torch's and transformers' mean cross-entropy is, while its gradient is 0 (not NaN), as theirs is.
    """
    targets = shift_labels(labels, cu_seqlens)
    total = cross_entropy(logits, targets).sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):  # (fp32 division, not a promotion to its dtype)
            num_items_in_batch = num_items_in_batch.to(total.device, torch.float32)
        return total / num_items_in_batch
    # No target: NaN, with a 0 gradient whatever the kernel's backward does with the 1 / 0 that 0 / 0 would pass it
    count = (targets != IGNORE_INDEX).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))
