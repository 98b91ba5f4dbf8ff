"""The varlen dense attention's GQA operands: on CUDA an fp32 sequence, or one with a mask, gets K / V repeated to
the query heads instead of SDPA's `enable_gqa`, which only flash / cuDNN take there (the others fall back to the
math kernel, which holds and saves every [Hq, q_len, k_len] score: an m3-tiny fp32 run on an H100 in session 51
peaked 0.57 GiB over the estimate, ~ two 4,096-token sequences' fp32 scores at 4 heads). Same values and
gradients either way (checked here on the CPU with the repetition forced)."""

from __future__ import annotations

import pytest
import torch

from openm3.ops.attention import dense_attention, varlen


@pytest.mark.parametrize("device, dtype, masked, want", [
    ("cuda", torch.float32, False, True), ("cuda", torch.bfloat16, False, False), ("cuda", torch.float16, False, False),
    ("cuda", torch.bfloat16, True, True), ("cpu", torch.float32, False, False), ("cpu", torch.float32, True, False),
])
def test_which_sequences_get_repeated_heads(device, dtype, masked, want):
    assert varlen.expand_kv_heads(device, dtype, masked) is want


@pytest.mark.parametrize("q_lens, k_lens", [([37, 64], None), ([5, 1, 9], [20, 7, 9])])
def test_repeated_heads_give_the_gqa_values_and_gradients(monkeypatch, q_lens, k_lens):
    """Causal sequences, a decode query and chunks after a cached prefix (masked), with 8 query heads over 2."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = None if k_lens is None else torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    t, tk = sum(q_lens), sum(k_lens or q_lens)
    q = torch.randn(t, 8, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(tk, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    do = torch.randn(t, 8, 16, generator=gen, dtype=torch.float64)

    def run():
        o = dense_attention(q, k, v, cu, scale=0.3, cu_seqlens_k=cu_k)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    want = run()
    calls = []
    monkeypatch.setattr(varlen, "expand_kv_heads", lambda *a: calls.append(a) or True)
    got = run()
    assert calls and all(len(a) == 3 for a in calls)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
