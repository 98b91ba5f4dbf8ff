"""A MoE layer's routing bookkeeping for inference in two Triton kernels (`openm3.layers.moe` calls them).

Without gradients, after the router's matmul a MoE layer picks each token's experts and sorts its (token, slot)
pairs by expert for the grouped GEMMs. Written out that is ~11 small kernels per layer: the router's sigmoid /
top-k / normalisation (four even when compiled), the ids' cast, a radix sort, two `arange`, a `searchsorted`, the
row gather and its index. In a CUDA-graph decode step of m3-small that was ~165 of ~550 nodes, each a tiny kernel.
Here:

- `route_topk(logits, bias, k)`: the mixing weights and expert ids of `openm3.layers.moe.route` (sigmoid scores,
  top-k of scores + bias, ties to the lower expert as torch's argmax, the picked scores normalised) in one kernel.
- `sort_pairs(experts, x, num_experts)`: each pair's place in a stable sort by expert, its token's row of x copied
  there, and the per-expert row ends, in one kernel; each program counts its pairs' places against all pairs,
  so it is for the few pairs of a decode step (`SORT_PAIRS_MAX`), not for prefill chunks; the row copy is
  spread over programs of 256 columns each.

Both in one kernel (each program routing every token again to count its pairs' places) was written in session 40
and timed in session 41: no gain in the m3-small 8 x 16K decode step on an H100 (CUDA-graph replay 1.836-1.936 ms
with it and without, drifting alike; docs/perf_notes.md "Session 41"), so it was removed.

The layer's torch code is the spec (`tests/test_moe_routing.py`); `openm3.ops.norm_rope.inference_kernels` says
when these run. Set `TRITON_INTERPRET=1` before importing Triton to run them on CPU tensors.
"""

from __future__ import annotations

import torch

from .msa.triton_common import check_triton_inputs

__all__ = ["SORT_PAIRS_MAX", "route_topk", "sort_pairs"]

# sort_pairs's work grows with pairs squared (every program counts its pairs' places against all pairs, once per
# column block): up to this many, a decode step of 256 tokens at M3's top-4 (more take the radix sort)
SORT_PAIRS_MAX = 1024


def route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (any float dtype), bias [E] -> (weights fp32 [N, k], expert ids int64 [N, k])."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, E], got shape {tuple(logits.shape)}")
    n, e = logits.shape
    if bias.shape != (e,) or bias.device != logits.device:
        raise ValueError(f"bias must be [{e}] on {logits.device}, got {tuple(bias.shape)} on {bias.device}")
    if not 1 <= k <= e:
        raise ValueError(f"k must be in [1, {e}], got {k}")
    check_triton_inputs("the Triton route_topk kernel", dots=False, logits=logits)
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n:
        from . import _moe_routing_kernels as kern

        kern.launch_route(logits if logits.stride(-1) == 1 else logits.contiguous(), bias, weights, ids, k)
    return weights, ids


def sort_pairs(experts: torch.Tensor, x: torch.Tensor, num_experts: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts int64 [N, k] ids in [0, num_experts), x [N, hidden] -> (rows [N*k, hidden]: x[p // k] for the pairs
    p in stable expert order, offs int32 [num_experts]: end of each expert's rows, pos int64 [N*k]: the place of
    pair p in that order). N * k <= SORT_PAIRS_MAX."""
    if experts.dim() != 2 or experts.dtype != torch.int64:
        raise ValueError(f"experts must be int64 [N, k], got {experts.dtype} {tuple(experts.shape)}")
    n, k = experts.shape
    if x.dim() != 2 or x.shape[0] != n or x.device != experts.device:
        raise ValueError(f"x must be [N={n}, hidden] on {experts.device}, got {tuple(x.shape)} on {x.device}")
    if n * k > SORT_PAIRS_MAX:
        raise ValueError(f"sort_pairs takes at most SORT_PAIRS_MAX = {SORT_PAIRS_MAX} pairs, got {n * k}")
    check_triton_inputs("the Triton sort_pairs kernel", dots=False, x=x)
    rows = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    pos = torch.empty(n * k, dtype=torch.int64, device=x.device)
    offs = (torch.empty if n else torch.zeros)(num_experts, dtype=torch.int32, device=x.device)  # kernel: all
    if n:
        from . import _moe_routing_kernels as kern

        kern.launch_sort_pairs(experts.contiguous(), x if x.stride(-1) == 1 else x.contiguous(), rows, pos, offs, k)
    return rows, offs, pos
