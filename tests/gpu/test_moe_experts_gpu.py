"""`openm3.ops.moe_experts` on the GPU in bf16 (the CPU interpreter's `tl.dot` does not take bf16 operands:
the CPU tests run fp32); m3-small's decode-size MoE layer through it: tests/gpu/test_moe_routing_gpu.py.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_moe_experts_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openm3.layers.mlp import swiglu_oai
from openm3.ops.moe_experts import expert_linear

pytestmark = pytest.mark.gpu

ALPHA, LIMIT = 1.702, 7.0


def _groups(counts: list[int], hidden: int, out: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), hidden, generator=gen)
    weight = torch.randn(len(counts), out, hidden, generator=gen) * 4.0 / hidden ** 0.5
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return rows.cuda(), weight.cuda(), offs.cuda()


def _per_expert(rows, weight, offs, fn=F.linear):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(fn(rows[start:end], weight[e]))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("counts", [[2, 0, 5, 1, 19, 3], [1] * 16, [0] * 15 + [16]])
@pytest.mark.parametrize("hidden, inter", [(160, 48), (2048, 512)])
@pytest.mark.parametrize("splits", [1, 4])
def test_bf16_error_within_twice_torch_bf16(counts, hidden, inter, splits):
    """bf16 operands (fp32 accumulation, the SwiGLU in fp32 before one rounding): error against the fp32
    computation at most twice that of torch's bf16 linear + swiglu, for both projections; with fp32 operands
    (no tf32) against an fp64 computation at most twice torch's fp32."""
    rows, weight, offs = _groups(counts, hidden, 2 * inter, seed=hidden + len(counts))
    down = (weight[:, :inter, :].transpose(1, 2) / 4.0).contiguous()  # [E, hidden, inter]
    rb, wb, db = rows.bfloat16(), weight.bfloat16(), down.bfloat16()
    exact = swiglu_oai(_per_expert(rb.float(), wb.float(), offs), ALPHA, LIMIT)
    torch_bf16 = swiglu_oai(_per_expert(rb, wb, offs), ALPHA, LIMIT)
    got = expert_linear(rb, wb, offs, swiglu=(ALPHA, LIMIT), splits=splits)
    assert got.dtype == torch.bfloat16
    err, base = (got.float() - exact).abs().max().item(), (torch_bf16.float() - exact).abs().max().item()
    assert err <= 2 * base, (err, base)
    h = torch_bf16
    exact_down = _per_expert(h.float(), db.float(), offs)
    err = (expert_linear(h, db, offs, splits=splits).float() - exact_down).abs().max().item()
    base = (_per_expert(h, db, offs).float() - exact_down).abs().max().item()
    assert err <= 2 * base, (err, base)
    exact64 = swiglu_oai(_per_expert(rb.double(), wb.double(), offs), ALPHA, LIMIT)
    got32 = expert_linear(rb.float(), wb.float(), offs, swiglu=(ALPHA, LIMIT), splits=splits)
    err = (got32.double() - exact64).abs().max().item()
    base = (exact.double() - exact64).abs().max().item()  # torch's fp32 (cuBLAS, no tf32) against fp64
    assert err <= 2 * base, (err, base)
    exact64 = _per_expert(h.double(), db.double(), offs)
    err = (expert_linear(h.float(), db.float(), offs, splits=splits).double() - exact64).abs().max().item()
    base = (exact_down.double() - exact64).abs().max().item()
    assert err <= 2 * base, (err, base)



@pytest.mark.parametrize("splits", [1, 4])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(splits):
    """bf16, m3-small's gate/up shape: each row alone gives the bits it gets among 40 others, and a graph replay
    (the split sums added by whichever program finishes last, in split order) gives them again."""
    counts = [3, 0, 17, 1, 16, 3]
    rows, weight, offs = _groups(counts, 2048, 1024, seed=9)
    rows, weight = rows.bfloat16(), weight.bfloat16()
    together = expert_linear(rows, weight, offs, swiglu=(ALPHA, LIMIT), splits=splits)
    expert_of = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    for r in (0, 3, 4, 20, 21, 39):
        alone = torch.zeros(len(counts), dtype=torch.int32, device="cuda")
        alone[expert_of[r]:] = 1
        got = expert_linear(rows[r:r + 1], weight, alone, swiglu=(ALPHA, LIMIT), splits=splits)
        assert torch.equal(got[0], together[r]), r
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = expert_linear(rows, weight, offs, swiglu=(ALPHA, LIMIT), splits=splits)
    for _ in range(3):
        graph.replay()
        assert torch.equal(replayed, together)
