"""A MoE layer's expert projections for the few (token, slot) pairs of a decode step, in one Triton kernel each.

`openm3.layers.moe` runs a step's experts as two grouped GEMMs over the pairs sorted by expert
(`torch._grouped_mm`), with the SwiGLU between them. At a decode step's size (m3-small, 8 sequences: 16 pairs
over 16 experts, 1-3 rows each) the GEMMs only stream the chosen experts' weights, and each grouped GEMM also
launches a kernel that writes its per-group arguments: with the SwiGLU, 5 kernels per layer. Here:

- `expert_linear(rows, weight, offs)`: `grouped_linear`'s result; one program per (expert, block of output
  columns) streams that block of the expert's weights once for up to 16 of its rows (an expert with none exits).
- `expert_linear(rows, gate_up, offs, swiglu=(alpha, limit))`: the gate and up columns of a block in the same
  program, the SwiGLU-OAI applied before the store (fp32 until then), so the [M, 2I] projection never lands.

The layer's torch code is the spec (`tests/test_moe_experts.py`); `openm3.ops.norm_rope.inference_kernels` says
when these run. Set `TRITON_INTERPRET=1` before importing Triton to run them on CPU tensors.
"""

from __future__ import annotations

import torch

from .msa.triton_common import check_triton_inputs

__all__ = ["EXPERT_LINEAR_BASE_PAIRS", "EXPERT_LINEAR_PAIRS_PER_EXPERT", "expert_linear",
           "expert_linear_max_pairs"]

# up to `expert_linear_max_pairs(E)` (token, slot) pairs a layer of E experts takes these kernels; more (larger
# batches, prefill) keep the grouped GEMMs, whose tiles reuse each weight for many rows (each pass here re-reads an
# expert's block per 16 rows). Measured on an H100 (benchmarks/moe_decode.py, one layer's routed experts, grouped
# -> kernels): m3-small's shape (16 experts) at 2 to 128 pairs (41.6 -> 35.3 us at 2, 66.7 -> 48.7 at 16, 71.8 ->
# 57.4 at 128), more untimed; M3's (128 experts of 3072 x 6144, top-4) at 4 to 1024 pairs, 8 per expert (220.7 ->
# 181.3 us at 4, 3215 -> 2932 at 128, 4582 -> 4191 at 256, 5196 -> 4862 at 512, 5277 -> 5148 at 1024: the gain
# shrinks as experts get more rows), more untimed (and past the sort kernel's SORT_PAIRS_MAX).
EXPERT_LINEAR_BASE_PAIRS = 128  # the switch's floor (m3-small's measured range), whatever the expert count
EXPERT_LINEAR_PAIRS_PER_EXPERT = 8


def expert_linear_max_pairs(num_experts: int) -> int:
    """Up to how many (token, slot) pairs a MoE layer of `num_experts` experts runs them through `expert_linear`
    (the measured range above: at least `EXPERT_LINEAR_BASE_PAIRS`, `EXPERT_LINEAR_PAIRS_PER_EXPERT` per expert)."""
    return max(EXPERT_LINEAR_BASE_PAIRS, EXPERT_LINEAR_PAIRS_PER_EXPERT * num_experts)


def expert_linear(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, *,
                  swiglu: tuple[float, float] | None = None, splits: int = 1) -> torch.Tensor:
    """rows [M, in] sorted by expert, weight [E, out, in], offs int32 [E] (offs[e]: end of expert e's rows,
    non-decreasing, offs[-1] == M) -> [M, out] = per expert `rows @ weight[e].T`; with swiglu=(alpha, limit)
    -> [M, out / 2], `swiglu_oai` of that (gate columns first, then up). Rows past offs[-1] are not written.

    splits: programs per (expert, column block), each over a share of the input features (whole steps of 128),
    their fp32 sums added in a fixed order by the last to finish: more programs stream an expert's weights when a
    step uses few experts (batch 1: 2 of m3-small's 16). A row's result never depends on the other rows."""
    if rows.dim() != 2 or weight.dim() != 3 or weight.shape[2] != rows.shape[1]:
        raise ValueError(f"rows must be [M, in] and weight [E, out, in={rows.shape[1] if rows.dim() == 2 else '?'}]"
                         f", got {tuple(rows.shape)} and {tuple(weight.shape)}")
    if weight.dtype != rows.dtype or weight.device != rows.device:
        raise ValueError(f"weight must have rows' dtype {rows.dtype} on {rows.device}, got {weight.dtype} on "
                         f"{weight.device}")
    num_experts, out_features, _ = weight.shape
    if offs.shape != (num_experts,) or offs.dtype != torch.int32 or offs.device != rows.device:
        raise ValueError(f"offs must be int32 [{num_experts}] on {rows.device}, got {offs.dtype} "
                         f"{tuple(offs.shape)} on {offs.device}")
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1, got {splits!r}")
    if swiglu is not None and out_features % 2:
        raise ValueError(f"swiglu needs an even number of output features (gate, then up), got {out_features}")
    check_triton_inputs("the Triton expert_linear kernel", rows=rows, weight=weight)  # CPU without the interpreter
    n_out = out_features // 2 if swiglu is not None else out_features
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 and weight.stride(1) == weight.shape[2] else weight.contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        from . import _moe_expert_kernels as kern

        kern.launch(rows, weight, offs, out, n_out, _block_n(n_out, num_experts, rows.device), splits, swiglu)
    return out


def _block_n(n_out: int, num_experts: int, device: torch.device) -> int:
    """Output columns per program: 64 down to 16 until the experts give ~4 programs per SM (a program streams its
    block of weights; fewer, larger blocks would leave SMs idle). Not from the row count, so a row's result does
    not depend on the rows beside it (a step with drafts rounds as one-token steps do)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    block = 64
    while block > 16 and num_experts * -(-n_out // block) < 4 * sms:
        block //= 2
    return block
