"""Warmup-stable-decay (WSD) learning-rate schedule.

The learning rate rises linearly over `warmup_steps`, stays at the peak until `decay_start`, then falls to
`min_lr_ratio * peak` by `total_steps` (linear, cosine or 1-sqrt shape). A recipe that switches vision on "before
the decay" or "after the decay" refers to `decay_start`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_SHAPES = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class WSDSchedule:
    """Multiplier on the peak learning rate as a function of the optimizer step (0-based)."""

    total_steps: int
    warmup_steps: int
    decay_start: int
    min_lr_ratio: float = 0.1
    decay_shape: str = "linear"

    def __post_init__(self):
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_start < self.warmup_steps:
            raise ValueError(f"decay_start ({self.decay_start}) must not come before the end of the warmup "
                             f"(warmup_steps={self.warmup_steps})")
        if self.decay_start > self.total_steps:
            raise ValueError(f"decay_start ({self.decay_start}) must be <= total_steps ({self.total_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.decay_shape not in DECAY_SHAPES:
            raise ValueError(f"decay_shape must be one of {DECAY_SHAPES}, got {self.decay_shape!r}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step < self.decay_start:
            return 1.0
        decay_steps = self.total_steps - self.decay_start
        progress = min(1.0, (step - self.decay_start + 1) / max(1, decay_steps))
        if self.decay_shape == "linear":
            frac = 1.0 - progress
        elif self.decay_shape == "cosine":
            frac = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # "sqrt": the 1 - sqrt(progress) cooldown
            frac = 1.0 - math.sqrt(progress)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * frac
