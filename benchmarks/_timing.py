"""Timing helper shared by the benchmark scripts."""

from __future__ import annotations

import torch


def event_time_ms(fn) -> float:
    """Milliseconds of one call of `fn`, between CUDA events, with the device synchronised before and after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)
