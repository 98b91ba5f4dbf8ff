"""M3 mixture of experts: sigmoid router with a selection-only correction bias, routed experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import DenseMLP, swiglu_oai


class Router(nn.Module):
    """Sigmoid top-k router.

    Scores are `sigmoid(x @ weight.T)`; `e_score_correction_bias` (a buffer that a load-balancing rule may move,
    never a gradient) is added only to choose the experts, and the chosen experts' plain sigmoid scores,
    normalised to sum to 1, are the mixing weights.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> (router_logits [N, E], weights fp32 [N, k], expert ids int64 [N, k])."""
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        scores = torch.sigmoid(logits.float())
        _, experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, experts)
        return logits, weights / weights.sum(dim=-1, keepdim=True), experts


class Experts(nn.Module):
    """Routed SwiGLU-OAI experts stored as stacked tensors.

    gate_up_proj: [E, 2I, hidden] (gate rows first, then up rows); down_proj: [E, hidden, I].
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden], experts: [N, k] ids, weights: [N, k] -> weighted sum of expert outputs [N, hidden]."""
        num_experts = self.gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        token = order // experts.shape[1]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start:start + n]
            tok = token[start:start + n]
            start += n
            h = swiglu_oai(F.linear(x[tok], self.gate_up_proj[e]), self.alpha, self.limit)
            h = F.linear(h, self.down_proj[e]) * weights.reshape(-1)[idx, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


class MoE(nn.Module):
    """x [N, hidden] -> (routed_scaling_factor * routed experts + shared expert, router logits [N, E])."""

    def __init__(self, hidden_size: int, intermediate_size: int, shared_intermediate_size: int, num_experts: int,
                 top_k: int, routed_scaling_factor: float, alpha: float, limit: float):
        super().__init__()
        self.routed_scaling_factor = routed_scaling_factor
        self.gate = Router(hidden_size, num_experts, top_k)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, alpha, limit)
        self.shared_experts = DenseMLP(hidden_size, shared_intermediate_size, alpha, limit)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shared = self.shared_experts(x)
        logits, weights, experts = self.gate(x)
        routed = self.experts(x, experts, weights)
        return routed * self.routed_scaling_factor + shared, logits


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all MoE layers, computed as transformers' M3 does.

    router_logits: per MoE layer [N, E]. With p = softmax(logits) and f_e the fraction of (token, slot) pairs whose
    top-k of p picks expert e (pooled over layers), loss = E * sum_e f_e * mean(p_e). A scalar fp32 tensor.
    """
    if len(router_logits) == 0:
        raise ValueError("router_logits must hold at least one MoE layer's [N, E] logits")
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        if logits.dim() != 2 or logits.shape[1] != num_experts:
            raise ValueError(f"router_logits entries must be [N, {num_experts}], got {tuple(logits.shape)}")
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        prob_sum = prob_sum + probs.sum(dim=0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))
