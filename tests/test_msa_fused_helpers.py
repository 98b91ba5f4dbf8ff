"""The torch bookkeeping around the MSA kernels (`fused_on_cuda` functions: query positions, block starts, tile
unions, the inverse indices of the key-block-outer kernels) compiled by torch.compile equals the eager code.

On CUDA these functions run compiled (one fused graph instead of ~20-35 launches each); here the same compile
(inductor's CPU backend, dynamic shapes as on the GPU) is checked against the plain functions on two shapes each.
"""

from __future__ import annotations

import pytest
import torch

from openm3.ops.msa import triton_common, triton_kl
from openm3.ops.msa.triton_common import absolute_block_starts, query_positions


def _selection(lens, heads=2, topk=3, block=16, seed=0):
    """Causal random selections of packed sequences: block_idx int32 [heads, T, topk] (-1 padded), cu int32."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    idx = torch.full((heads, t, topk), -1, dtype=torch.int32)
    row = 0
    for n in lens:
        for p in range(n):
            own = p // block
            for h in range(heads):
                rest = torch.randperm(own, generator=gen)[:topk - 1] if own else torch.empty(0, dtype=torch.int64)
                picks = [own] + rest.tolist()
                idx[h, row, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
            row += 1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return idx, cu


def _equal(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    fns = {"query_positions": query_positions, "absolute_block_starts": absolute_block_starts,
           "tile_union": triton_common._tile_union, "key_block_tensors": triton_common._key_block_tensors,
           "entry_tensors": triton_kl._entry_tensors}
    return {name: (f.__wrapped__, torch.compile(f.__wrapped__, dynamic=True, fullgraph=True))
            for name, f in fns.items()}


@pytest.mark.parametrize("lens", [[40, 23], [70, 5, 33]], ids=["2seq", "3seq"])
def test_compiled_bookkeeping_equals_eager(compiled, lens):
    block, max_tokens = 16, 7
    idx, cu = _selection(lens, block=block)
    t = idx.shape[1]
    for name in ("query_positions",):
        plain, fast = compiled[name]
        _equal(fast(cu, cu, t), plain(cu, cu, t))
    seq, _ = query_positions(cu, cu, t)
    plain, fast = compiled["absolute_block_starts"]
    starts = plain(idx, seq, cu, block)
    _equal(fast(idx, seq, cu, block), starts)
    plain, fast = compiled["tile_union"]
    for tokens in (4, 16):
        _equal(fast(starts, tokens), plain(starts, tokens))
    for name in ("key_block_tensors", "entry_tensors"):
        plain, fast = compiled[name]
        _equal(fast(idx, seq, cu, t, block, max_tokens), plain(idx, seq, cu, t, block, max_tokens))
