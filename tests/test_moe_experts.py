"""`openm3.ops.moe_experts`: a decode step's expert projections (and the SwiGLU between them) in one Triton kernel
each, against the layer's torch code (`grouped_linear`, `swiglu_oai`: their spec), under TRITON_INTERPRET=1 on
CPU tensors (conftest sets it without a GPU); the MoE layer takes them for a decode step's few pairs without
gradients; the kernel compiles for sm_90."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hopper_compile import run_compile_script
from openm3.layers import moe
from openm3.layers.mlp import swiglu_oai
from openm3.ops.moe_experts import EXPERT_LINEAR_BASE_PAIRS, expert_linear, expert_linear_max_pairs
from openm3.ops.msa import use_backend
from test_moe import ALPHA, LIMIT, make_moe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter tests (tests/gpu on a GPU)")


def _groups(counts: list[int], hidden: int, out: int, seed: int, dtype=torch.float32, gate_up: bool = False):
    """rows sorted by expert (counts[e] rows for expert e), weight [E, out, hidden], offs int32 [E]; gate/up
    weights scaled so the SwiGLU clamp is reached."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    weight = (torch.randn(len(counts), out, hidden, generator=gen) * (4.0 if gate_up else 1.0) / hidden ** 0.5)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return rows, weight.to(dtype), offs


def _per_expert(rows, weight, offs, fn):
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(fn(rows[start:end], weight[e]))
        start = end
    return torch.cat(out)


# an expert with no rows, one with more rows than a pass takes (16), sizes off the column and feature blocks
COUNTS = [[3, 0, 1, 2], [0, 0, 37, 1, 0, 5], [1], [2, 0, 0, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize("counts", COUNTS, ids=[f"E{len(c)}-M{sum(c)}" for c in COUNTS])
@pytest.mark.parametrize("hidden, out", [(72, 40), (200, 24), (384, 64)])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_fp32_equals_the_grouped_linear(counts, hidden, out, splits):
    rows, weight, offs = _groups(counts, hidden, out, seed=hidden + out)
    want = _per_expert(rows, weight, offs, F.linear)
    torch.testing.assert_close(expert_linear(rows, weight, offs, splits=splits), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(want, moe.grouped_linear(rows, weight, offs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("counts", COUNTS, ids=[f"E{len(c)}-M{sum(c)}" for c in COUNTS])
@pytest.mark.parametrize("splits", [1, 2])
def test_fp32_swiglu_equals_the_projection_then_swiglu(counts, splits):
    rows, weight, offs = _groups(counts, 256, 2 * 24, seed=len(counts), gate_up=True)
    want = swiglu_oai(_per_expert(rows, weight, offs, F.linear), ALPHA, LIMIT)
    assert (want.abs() > 0).all() and ((_per_expert(rows, weight, offs, F.linear)).abs() > LIMIT).any()
    torch.testing.assert_close(expert_linear(rows, weight, offs, swiglu=(ALPHA, LIMIT), splits=splits), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(splits):
    """Each row alone (its expert's only row) gives the bits it gets among 37 others: a decode step with drafts
    rounds as one-token steps do (the speculative GPU test checks the whole model the same way)."""
    counts = [3, 0, 17, 1, 16]
    rows, weight, offs = _groups(counts, 300, 2 * 40, seed=5, gate_up=True)
    together = expert_linear(rows, weight, offs, swiglu=(ALPHA, LIMIT), splits=splits)
    expert_of = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    for r in (0, 2, 3, 19, 20, 36):
        alone = torch.zeros(len(counts), dtype=torch.int32)
        alone[expert_of[r]:] = 1
        got = expert_linear(rows[r:r + 1], weight, alone, swiglu=(ALPHA, LIMIT), splits=splits)
        assert torch.equal(got[0], together[r]), r


def test_no_rows_and_bad_arguments():
    weight = torch.zeros(3, 8, 16)
    offs = torch.zeros(3, dtype=torch.int32)
    assert expert_linear(torch.zeros(0, 16), weight, offs).shape == (0, 8)
    assert expert_linear(torch.zeros(0, 16), weight, offs, swiglu=(1.0, 7.0)).shape == (0, 4)
    with pytest.raises(ValueError, match=r"weight \[E, out, in=16\]"):
        expert_linear(torch.zeros(2, 16), torch.zeros(3, 8, 12), offs)
    with pytest.raises(ValueError, match="weight must have rows' dtype"):
        expert_linear(torch.zeros(2, 16), weight.double(), offs)
    with pytest.raises(ValueError, match=r"offs must be int32 \[3\]"):
        expert_linear(torch.zeros(2, 16), weight, offs.long())
    with pytest.raises(ValueError, match="splits must be an int >= 1, got 0"):
        expert_linear(torch.zeros(2, 16), weight, offs, splits=0)
    with pytest.raises(ValueError, match="even number of output features"):
        expert_linear(torch.zeros(2, 16), torch.zeros(3, 7, 16), offs, swiglu=(1.0, 7.0))
    with pytest.raises(ValueError, match="bfloat16 is refused by the Triton expert_linear kernel under Triton's CPU"):
        expert_linear(torch.zeros(2, 16, dtype=torch.bfloat16), weight.bfloat16(), offs)  # the interpreter's bf16 dot


@pytest.mark.parametrize("experts, tokens", [(6, 1), (6, 5), (6, EXPERT_LINEAR_BASE_PAIRS // 2),
                                             (6, EXPERT_LINEAR_BASE_PAIRS // 2 + 1), (20, 80), (20, 81)])
def test_the_layer_takes_them_for_few_pairs_without_gradients(monkeypatch, experts, tokens):
    """Without gradients and with the Triton backend a MoE layer runs its experts through `expert_linear` up to
    `expert_linear_max_pairs(E)` (token, slot) pairs (128, or 8 per expert where that is more: 160 for 20
    experts), the grouped GEMMs above; the output agrees with the torch path's to fp32 rounding (other summation
    order) either way."""
    assert expert_linear_max_pairs(experts) == max(EXPERT_LINEAR_BASE_PAIRS, 8 * experts)
    layer = make_moe(32, 24, experts, 2, seed=tokens)
    layer.experts.impl = "grouped"
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    calls = []
    real = moe.expert_linear
    monkeypatch.setattr(moe, "expert_linear", lambda *a, **kw: calls.append(kw.get("swiglu")) or real(*a, **kw))
    with torch.no_grad():
        want, _ = layer(x)
        assert calls == []
        with use_backend("triton"):
            got, _ = layer(x)
    assert calls == ([(ALPHA, LIMIT), None] if 2 * tokens <= max(128, 8 * experts) else [])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)  # outputs up to ~80: a few fp32 ulps


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openm3.ops import _moe_expert_kernels as k

fn = k._expert_linear_kernel
names = list(fn.arg_names)
for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
    for swiglu, block_n, splits in ((True, 16, 1), (False, 32, 1), (False, 64, 1), (True, 16, 4), (False, 32, 2)):
        sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "offs_ptr": "*i32", "out_ptr": f"*{dtype}",
               "part_ptr": "*fp32", "count_ptr": "*i32",
               **{n: "i32" for n in ("n_out", "k_dim", "k_split", "n_rows", "stride_x", "stride_we", "stride_wn",
                                     "stride_o")},
               "alpha": "fp32", "limit": "fp32"}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
        consts = dict(SWIGLU=swiglu, SPLITS=splits, ROWS=k._ROWS, BLOCK_N=block_n, BLOCK_K=k._BLOCK_K,
                      PRECISION=precision)
        c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 4})
        assert "cubin" in c.asm
print("compiled")
"""


def test_the_kernel_compiles_for_hopper(tmp_path):
    run_compile_script(_COMPILE_SCRIPT, tmp_path)
