"""`--threads`: the one check and setter of torch's CPU thread count that every command taking it shares (smoke,
generate, serve, eval, train, demo), so each refuses a bad value with the same message."""

from __future__ import annotations


def check_threads(threads: int | None) -> None:
    """ValueError naming `--threads` for a count below 1 (None: torch's default, allowed)."""
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


def set_threads(threads: int | None) -> None:
    """Sets torch's CPU threads to `threads` (None: leaves torch's default) after `check_threads`."""
    check_threads(threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
