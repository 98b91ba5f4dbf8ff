"""The torch bookkeeping around the MSA kernels (`fused_on_cuda` functions: query positions, block starts, tile
unions, the inverse indices of the key-block-outer kernels) compiled by torch.compile equals the eager code.

On CUDA these functions run compiled (one fused graph instead of ~20-35 launches each); here the same compile
(inductor's CPU backend, dynamic shapes as on the GPU) is checked against the plain functions on two shapes each.
Also: the arrival counters the kernels' last-program-finishes steps share (`arrival_counters`).
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
           "union_keys": triton_common._union_keys,
           "union_runs": triton_common._union_runs, "key_block_tensors": triton_common._key_block_tensors,
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
    plain, fast = compiled["union_keys"]
    run_plain, run_fast = compiled["union_runs"]
    for tokens, narrow in ((4, True), (16, False)):
        keys = plain(starts, tokens, narrow)
        _equal(fast(starts, tokens, narrow), keys)
        keys = keys.sort(dim=-1).values
        _equal(run_fast(keys), run_plain(keys))
    for name in ("key_block_tensors", "entry_tensors"):
        plain, fast = compiled[name]
        _equal(fast(idx, seq, cu, t, block, max_tokens), plain(idx, seq, cu, t, block, max_tokens))


@pytest.fixture
def wrapper_on_cpu(monkeypatch):
    """`fused_on_cuda`'s compiled path taken for CPU tensors, with Dynamo's eager backend (no compiler needed)."""
    from openm3.ops import fused

    monkeypatch.setattr(fused, "_compiles", lambda x: isinstance(x, torch.Tensor))
    monkeypatch.setattr(fused, "BACKEND", "eager")
    torch._dynamo.reset()
    yield fused
    torch._dynamo.reset()


def test_fused_wrapper_past_the_recompile_limit_runs_eagerly(wrapper_on_cpu):
    """More specialisations than Dynamo's recompile limit (the whole GPU suite in one process hit it, session 5):
    calls that fit no compiled graph run eagerly with one warning, exact results, and no error escapes."""
    import warnings

    def affine(x):
        return x * 2 + 1

    fused = wrapper_on_cpu.fused_on_cuda(affine, grad=False)
    x = torch.arange(64)
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.float32)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in dtypes:  # each dtype is a new guard: a recompilation
            assert torch.equal(fused(x.to(dtype)), affine(x.to(dtype)))
    assert fused.fallback is None  # not switched off for good: the compiled graphs still serve their calls
    assert sum("recompile limit" in str(w.message) for w in caught) == 1


def test_fused_wrapper_grad_false_shares_one_graph_across_grad_modes(wrapper_on_cpu):
    """With grad=False a call under autograd and one under no_grad (a forward and a backward pass) use one graph;
    with grad=True the second needs a recompilation, which a recompile limit of 1 turns into the eager fallback."""
    import warnings

    def double(x):
        return x * 2

    limit_warnings = {}
    for grad in (True, False):
        fused = wrapper_on_cpu.fused_on_cuda(double, grad=grad)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = torch.ones(8)
            assert torch.equal(fused(x), double(x))
            with torch.no_grad():
                assert torch.equal(fused(x), double(x))
        limit_warnings[grad] = sum("recompile limit" in str(w.message) for w in caught)
    assert limit_warnings == {True: 1, False: 0}


def test_arrival_counters_grow_and_keep_the_outgrown_ones():
    """One zeroed buffer per (device, kind), reused while big enough; a larger request replaces it, and the old
    one stays alive (a CUDA graph captured with it keeps counting there)."""
    from openm3.ops.msa import triton_common as tc

    kind = "test_kind"
    first = tc.arrival_counters(10, torch.device("cpu"), kind)
    assert first.numel() >= 4096 and first.dtype == torch.int32 and not first.any()
    assert tc.arrival_counters(4096, torch.device("cpu"), kind) is first
    assert tc.arrival_counters(10, torch.device("cpu"), "other_kind") is not first
    bigger = tc.arrival_counters(5000, torch.device("cpu"), kind)
    assert bigger.numel() >= 5000 and not bigger.any()
    assert any(t is first for t in tc._OUTGROWN)
    assert tc.arrival_counters(10, torch.device("cpu"), kind) is bigger
