"""Rows, micro-batches and the data contract between the trainer and a data source.

A *row* is one packed training sequence: several documents (or vision samples) back to back, `labels` already
aligned with `input_ids` (`labels[i]` is the token to predict at position i, -100 where there is no loss: prompts,
visual placeholder tokens, the last token of a document). A *micro-batch* is a few rows concatenated in the packed
varlen layout the models take (`input_ids [T]`, `position_ids [T]` restarting at 0 per document,
`cu_seqlens int32 [B+1]` over documents).

A data source is any object with `rows(kind, step, count) -> list[Row]` that returns the same rows for the same
arguments; the trainer's data position is therefore just the step counter, which makes resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..ops.host import to_device

IGNORE = -100


@dataclass
class Row:
    """One packed sequence. `input_ids, labels: [L]` int64, labels aligned with the inputs: `labels[i]` is the token
    that follows position i (`input_ids[i + 1]` inside a document), IGNORE (-100) where nothing is to be predicted
    (a document's last token, prompts, placeholders); a transformers habit, labels equal to the inputs (models
    there shift inside), is refused. `doc_lens`: lengths of the documents in it (sum L); `vision`: model inputs for
    its images/videos (e.g. `pixel_values [N, P]`, `image_grid_thw [n, 3]`), concatenated along dim 0 when rows
    are batched; `corpus`: name of the text corpus or vision task."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_lens: list[int]
    kind: str = "text"
    corpus: str = ""
    vision: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.input_ids.dim() != 1 or self.labels.shape != self.input_ids.shape:
            raise ValueError(f"Row.input_ids and Row.labels must be 1-D of equal length, got "
                             f"{tuple(self.input_ids.shape)} and {tuple(self.labels.shape)}")
        if sum(self.doc_lens) != self.input_ids.numel() or any(n <= 0 for n in self.doc_lens):
            raise ValueError(f"Row.doc_lens must be positive and sum to {self.input_ids.numel()}, "
                             f"got {self.doc_lens}")
        kept = self.labels != IGNORE
        if (int(kept.sum()) > 1 and torch.equal(self.labels[kept], self.input_ids[kept])
                and self.input_ids[kept].unique().numel() > 1):
            raise ValueError("Row.labels equal Row.input_ids at every labelled position: labels[i] must be the next "
                             "token, input_ids[i + 1] (IGNORE = -100 at a document's last token); openm3 does not "
                             "shift them inside the model as transformers does")


class RowSource(Protocol):
    def rows(self, kind: str, step: int, count: int) -> list[Row]:
        """`count` rows of data kind `kind` ("text" | "image" | "video") for optimizer step `step`;
        deterministic in its arguments."""


@dataclass
class Batch:
    """A micro-batch in the packed varlen layout. `input_ids, labels, position_ids: [T]`,
    `cu_seqlens: int32 [B+1]` (B documents), `vision`: concatenated vision inputs."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    vision: dict[str, torch.Tensor]
    kinds: list[str]  # data kind of each row
    row_lens: list[int]  # tokens of each row

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`. Host tensors go to a GPU through pinned memory without blocking: a copy from
        pageable memory waits for the stream's queued work first (the previous micro-batch's backward), so the
        GPU would idle while Python issues the next forward. The host values of `cu_seqlens` and of the vision grids
        go with the copy (`remember_host_list`), so the model's host-side reads of them do not wait for the device
        (a sync each)."""
        # the model reads cu_seqlens and the vision grids on the host: hand it the values we have
        vision = {k: to_device(v, device, remember=k.endswith("grid_thw")) for k, v in self.vision.items()}
        return Batch(to_device(self.input_ids, device), to_device(self.labels, device),
                     to_device(self.position_ids, device), to_device(self.cu_seqlens, device, remember=True),
                     vision, self.kinds, self.row_lens)


def collate(rows: list[Row]) -> Batch:
    """Concatenate rows into one packed micro-batch."""
    if not rows:
        raise ValueError("collate needs at least one row")
    doc_lens = [n for r in rows for n in r.doc_lens]
    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lens), 0)
    position_ids = torch.cat([torch.arange(n) for n in doc_lens])
    keys = sorted({k for r in rows for k in r.vision})
    vision = {k: torch.cat([r.vision[k] for r in rows if k in r.vision]) for k in keys}
    return Batch(torch.cat([r.input_ids for r in rows]), torch.cat([r.labels for r in rows]), position_ids, cu,
                 vision, [r.kind for r in rows], [r.input_ids.numel() for r in rows])


def step_rows(source: RowSource, counts: dict[str, int], step: int) -> list[Row]:
    """All rows of an optimizer step in a fixed order (text, image, video)."""
    out: list[Row] = []
    for kind in ("text", "image", "video"):
        if counts.get(kind, 0):
            got = source.rows(kind, step, counts[kind])
            if len(got) != counts[kind]:
                raise ValueError(f"data source returned {len(got)} {kind} rows for step {step}, "
                                 f"expected {counts[kind]}")
            out.extend(got)
    return out


def shard_micro_batches(rows: list[Row], rank: int, world_size: int, micro_batch: int) -> list[Batch]:
    """Rank `rank`'s rows (every world_size-th, so kinds spread evenly) in micro-batches of `micro_batch` rows
    (the last may be smaller)."""
    if len(rows) % world_size:
        raise ValueError(f"{len(rows)} rows do not split evenly over world_size={world_size} ranks")
    mine = rows[rank::world_size]
    return [collate(mine[i:i + micro_batch]) for i in range(0, len(mine), micro_batch)]
