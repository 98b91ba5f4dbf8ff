"""Speculative decoding on the GPU: multi-token decode steps through CUDA graphs, and `generate` with drafts in
bf16 (Triton decode kernels with q_len > 1).

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_speculative_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _model():
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)
    return M3TextModel(config).to("cuda", torch.bfloat16).eval()


def _cache(model, seqs, dtype=torch.bfloat16):
    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache

    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 64 * 16, kv_dtype=dtype), "cuda")
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    return cache


def test_graph_steps_of_several_tokens_equal_eager_steps():
    """3 sequences: steps of 4 tokens (a token and 3 drafts, 2 rejected each time) and of 1 token alternate. Graph
    steps equal eager steps (the same kernels), a batch captures one graph per shape and keeps both, and a
    4-token step's logits match 4 one-token steps within bf16 rounding."""
    from openm3.engine.graphs import DecodeGraphs
    from openm3.engine.scheduler import decode_step, prefill

    model = _model()
    lens = [70, 33, 150]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n + 40,), generator=gen).tolist() for n in lens]
    caches = [_cache(model, seqs) for _ in range(3)]
    for cache in caches:
        prefill(model, cache, [0, 1, 2], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=64)
    graphs = DecodeGraphs(model, caches[1])
    pos = list(lens)
    for step in range(8):
        q = 4 if step % 2 == 0 else 1
        feed = torch.tensor([seqs[b][pos[b]:pos[b] + q] for b in range(3)], device="cuda")
        if q == 1:
            feed = feed[:, 0]
        start = [caches[0].length(b) for b in range(3)]
        want = decode_step(model, caches[0], [0, 1, 2], feed)
        got = graphs.step([0, 1, 2], feed)
        assert got.shape == want.shape == ((3, q, model.config.vocab_size) if q > 1 else (3, model.config.vocab_size))
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item(), step
        one = [decode_step(model, caches[2], [0, 1, 2], feed.reshape(3, -1)[:, i]) for i in range(q)]
        one = torch.stack(one, dim=1).reshape(got.shape)
        assert (got - one).abs().max().item() <= 3e-2 * one.abs().max().item(), step
        keep = 2 if q > 1 else 1  # the token and its first draft
        for cache in caches:
            for b in range(3):
                cache.truncate(b, start[b] + keep)
        pos = [p + keep for p in pos]
    assert graphs.captures == 2 and graphs.replays == 8 - 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_step_with_drafts_equals_one_token_steps_exactly(dtype):
    """A decode step of 4 tokens per sequence (3 sequences: 12 query rows) gives each token the logits of a
    one-token step over the same cache. In bf16 bit for bit: no kernel's split or summation order depends on the
    drafts riding beside a token (session 36's attention split followed the query rows and broke this). In fp32
    only to rounding: cuBLAS picks its fp32 GEMM by row count (H100: a 12-row `F.linear` differs from a 3-row one
    by up to 1.5e-5 from the first projection on; bf16 GEMMs of both heights agree exactly)."""
    from openm3.engine.scheduler import decode_step, prefill

    model = _model().to(dtype)
    lens, q = [70, 33, 150], 4
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n + q,), generator=gen).tolist() for n in lens]
    caches = [_cache(model, seqs, dtype) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            prefill(model, cache, [0, 1, 2], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=64)
        feed = torch.tensor([s[n:n + q] for s, n in zip(seqs, lens)], device="cuda")
        several = decode_step(model, caches[0], [0, 1, 2], feed)
        one = torch.stack([decode_step(model, caches[1], [0, 1, 2], feed[:, i]) for i in range(q)], dim=1)
    if dtype == torch.bfloat16:
        assert torch.equal(several, one)
    else:
        assert (several - one).abs().max().item() <= 2e-4 * one.abs().max().item()
        assert torch.equal(several.argmax(-1), one.argmax(-1))


def test_generate_with_scripted_drafts_gives_plain_greedy_tokens(monkeypatch):
    """`generate` in bf16 with 5 drafts per step from the plain run's own answer (a wrong one every third step):
    the same greedy tokens, fewer steps, through CUDA graphs."""
    import openm3.engine.speculative as speculative
    from openm3.engine.generate import generate
    from openm3.engine.speculative import SpeculativeConfig

    model = _model()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (300, 41)]
    plain, _ = generate(model, prompts, max_new_tokens=24)
    answers = {tuple(p): r.tokens for p, r in zip(prompts, plain)}
    calls = []

    def drafts(tokens, k, _config):
        for prompt, answer in answers.items():
            if tuple(tokens[:len(prompt)].tolist()) == prompt:
                done = len(tokens) - len(prompt)
                d = answer[done:done + k] + [1] * max(0, k - len(answer[done:]))
                calls.append(0)
                if len(calls) % 3 == 0:
                    d[2] = (d[2] + 1) % model.config.vocab_size
                return d
        return []

    monkeypatch.setattr(speculative, "ngram_drafts", drafts)
    got, stats = generate(model, prompts, max_new_tokens=24, speculative=SpeculativeConfig(num_speculative_tokens=5))
    assert [r.tokens for r in got] == [r.tokens for r in plain]
    # one graph per batch (the shorter answer may end first: a second batch)
    assert 1 <= stats.graph_captures <= 2 and stats.spec_steps == stats.decode_steps < 23
    assert 0 < stats.accepted_tokens < stats.draft_tokens
