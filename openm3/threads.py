"""`--threads`: the one check and setter of torch's CPU thread count that the commands taking it share."""

from __future__ import annotations


def set_threads(threads: int | None) -> None:
    """Sets torch's CPU threads to `threads` (None: leaves torch's default); ValueError naming `--threads` below 1."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
