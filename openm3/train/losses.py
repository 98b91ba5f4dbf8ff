"""Loss terms of a training step."""

from __future__ import annotations

import torch

from ..ops.losses import cross_entropy


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per token in fp32 (0 where ignored). `logits: [T, V]`, `labels: [T]` (aligned,
    -100 ignored) -> `[T]`: `openm3.ops.losses.cross_entropy`, one fused kernel on CUDA, which the models'
    `labels=` loss shares."""
    return cross_entropy(logits, labels)


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32. `logits: [T, V]`, `labels: [T]` (aligned, -100 ignored)."""
    return token_losses(logits, labels).sum()


def load_balancing_loss(router_probs: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """Switch-style MoE load-balancing loss: `E * sum_e f_e * P_e`, 1.0 when perfectly balanced.

    `router_probs: [T, E]` routing probabilities (normalised over experts); `expert_idx: [T, k]` the chosen experts.
    `f_e` is the share of the T*k assignments that went to expert e, `P_e` the mean probability of expert e.
    """
    if router_probs.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != router_probs.shape[0]:
        raise ValueError(f"router_probs must be [T, E] and expert_idx [T, k], got {tuple(router_probs.shape)} and "
                         f"{tuple(expert_idx.shape)}")
    n_experts = router_probs.shape[1]
    counts = torch.zeros(n_experts, device=router_probs.device, dtype=torch.float32)
    counts.scatter_add_(0, expert_idx.reshape(-1), torch.ones(expert_idx.numel(), device=counts.device))
    f = counts / expert_idx.numel()
    p = router_probs.float().mean(0)
    return n_experts * (f * p).sum()
