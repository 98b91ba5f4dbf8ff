"""An inference layout the layers share: projection weights that read the same input made consecutive row blocks of
one matrix, so that one GEMM computes them all (`Attention.fuse_projections`, `MoE.fuse_projections`).

The parameters keep their names, shapes and values (each becomes a view of the matrix; no memory is added), so
checkpoints load into them as before. Moving a module (`.to`) or replacing a weight gives the weights their own
tensors again, which `rows_intact` notices (the layer then runs its separate ops).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["join_rows", "joint_matrix", "rows_intact"]


def join_rows(weights: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """Makes the 2-D `weights` consecutive row blocks of one new matrix (each weight's `.data` a view of it) and
    returns their row counts; None, with nothing changed, when they differ in width, dtype or device."""
    if any(w.dim() != 2 for w in weights) or len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        return None
    with torch.no_grad():
        whole = torch.cat([w.detach() for w in weights])
        start = 0
        for w in weights:
            w.data = whole[start:start + w.shape[0]]
            start += w.shape[0]
    return tuple(w.shape[0] for w in weights)


def rows_intact(weights: Sequence[torch.Tensor], rows: tuple[int, ...] | None) -> bool:
    """Whether `weights` still lie back to back in one storage with these row counts, as `join_rows` left them."""
    if rows is None or len(rows) != len(weights):
        return False
    first = weights[0]
    offset, base, width = first.storage_offset(), first.untyped_storage().data_ptr(), first.shape[1]
    for w, n in zip(weights, rows):
        if w.shape[0] != n or w.storage_offset() != offset or w.stride() != (width, 1) \
                or w.untyped_storage().data_ptr() != base:
            return False
        offset += n * width
    return True


def joint_matrix(first: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """The [sum(rows), in] matrix whose first row block is `first` (the weights' joint matrix; check
    `rows_intact` first)."""
    return first.as_strided((sum(rows), first.shape[1]), first.stride(), first.storage_offset())
