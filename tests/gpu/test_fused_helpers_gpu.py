"""The MSA bookkeeping compiled on CUDA (`fused_on_cuda`) equals the plain torch code, at m3-small's training shape.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_fused_helpers_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_compiled_bookkeeping_equals_eager_on_cuda():
    from openm3.ops import fused, msa
    from openm3.ops.msa import triton_common, triton_kl

    torch.manual_seed(0)
    t, hi, di, block, topk = 16384, 4, 128, 128, 16
    cu = torch.tensor([0, 8192, 16384], dtype=torch.int32, device="cuda")
    qi = torch.randn(t, hi, di, device="cuda", dtype=torch.bfloat16)
    ki = torch.randn(t, di, device="cuda", dtype=torch.bfloat16)
    idx = msa.select_blocks(qi, ki, cu, block_size=block, topk=topk, local_blocks=1)
    seq, qpos = triton_common.query_positions(cu, cu, t)  # compiled
    seq0, qpos0 = triton_common.query_positions.__wrapped__(cu, cu, t)
    assert torch.equal(seq, seq0) and torch.equal(qpos, qpos0)
    starts = triton_common.absolute_block_starts(idx, seq, cu, block)
    assert torch.equal(starts, triton_common.absolute_block_starts.__wrapped__(idx, seq, cu, block))
    for tokens, num_keys in ((4, t), (16, t), (16, None)):  # int32 and int64 sort keys
        got = triton_common._tile_union(starts, tokens, num_keys)
        fused.COMPILE = False
        try:
            want = triton_common._tile_union(starts, tokens, num_keys)
        finally:
            fused.COMPILE = True
        assert all(torch.equal(a, b) for a, b in zip(got, want)), tokens
    for fn, cap in ((triton_common._key_block_tensors, 256), (triton_kl._entry_tensors, 512)):
        got = fn(idx, seq, cu, t, block, cap)
        want = fn.__wrapped__(idx, seq, cu, t, block, cap)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want)), fn.__name__
    for fn in (triton_common.query_positions, triton_common.absolute_block_starts, triton_common._union_keys,
               triton_common._union_runs, triton_common._key_block_tensors, triton_kl._entry_tensors):
        assert fn.fallback is None, (fn.__name__, fn.fallback)  # really compiled, not the eager fallback



def test_recompile_limit_runs_eagerly_and_keeps_the_compiled_graphs():
    """More specialisations than Dynamo's recompile limit (the full GPU suite in one process hit it): the calls that
    fit no compiled graph run eagerly, with one warning, and results stay exact; no error escapes."""
    import warnings

    from openm3.ops.fused import fused_on_cuda

    def affine(x):
        return x * 2 + 1

    fused = fused_on_cuda(affine, grad=False)
    x = torch.arange(64, device="cuda")
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.float32)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in dtypes:  # each dtype is a new guard: a recompilation
            assert torch.equal(fused(x.to(dtype)), affine(x.to(dtype)))
    assert fused.fallback is None
    assert sum("recompile limit" in str(w.message) for w in caught) == 1
