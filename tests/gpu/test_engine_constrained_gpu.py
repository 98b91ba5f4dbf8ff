"""Constrained decoding on the GPU: `BatchedGenerator` (CUDA graphs) and `generate` with bf16 logits on the device,
the request's CUDA generator and the full-mask draw on the device.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_constrained_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from batching_utils import run_concurrently  # tests/: the shared helper, not a test module

pytestmark = pytest.mark.gpu

EOS = 2
ALPHABET = [b"0", b"1", b"2", b"34", b"5", b"a", b"b", b" ", b"x9", b"\"", b"99"]


class Digits:
    """1 to 12 ASCII digits. State: how many were read."""

    start = 0

    def advance(self, state, data):
        n = state + len(data)
        return n if data.isdigit() and n <= 12 else None

    def complete(self, state):
        return state >= 1

    def can_continue(self, state):
        return state < 12


def _setup():
    from openm3.engine.constrained import TokenBytes, TransitionCache
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)).to("cuda", torch.bfloat16).eval()
    pieces = [None] * 16 + [ALPHABET[t % len(ALPHABET)] for t in range(16, model.config.vocab_size)]
    return model, TransitionCache(Digits(), TokenBytes(pieces))


def _digits(tokens, transitions) -> str:
    assert tokens[-1] == EOS, tokens
    text = b"".join(transitions.vocab.pieces[t] for t in tokens[:-1])
    assert text.isdigit() and 1 <= len(text) <= 12, text
    return text.decode()


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("lazy_checks", [512, 1], ids=["lazy", "full-mask"])
def test_batched_constrained_requests_on_cuda(lazy_checks, speculate, monkeypatch):
    """Constrained requests beside a plain one in CUDA-graph steps, also with n-gram speculation (prompts of
    repeated runs; where a lookup finds nothing the last token is drafted again, so every step speculates
    whatever a random model writes; the constrained requests' drafts are verified against their picks)."""
    import openm3.engine.speculative as speculative
    from openm3.engine import generate
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.constrained import GrammarConstraint
    from openm3.engine.sampling import SamplingParams
    from openm3.engine.speculative import SpeculativeConfig

    model, transitions = _setup()
    prompts = [list(range(20, 90)), list(range(40, 75)), list(range(100, 230))]
    spec = None
    if speculate:
        lookup = speculative.ngram_drafts
        monkeypatch.setattr(speculative, "ngram_drafts",
                            lambda tokens, k, config: lookup(tokens, k, config) or [int(tokens[-1])] * k)
        prompts = [p * 3 for p in prompts]
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    batcher = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=64, speculative=spec)
    outs = [[] for _ in prompts]
    asks = [dict(constraint=GrammarConstraint(transitions, [EOS], lazy_checks=lazy_checks)), {},
            dict(constraint=GrammarConstraint(transitions, [EOS], lazy_checks=lazy_checks), seed=3,
                 sampling=SamplingParams(1.0, top_p=0.9))]
    finishes = run_concurrently([
        lambda p=p, out=out, ask=ask: batcher(p, max_new_tokens=20 if ask else 10, stop_tokens=[EOS],
                                              on_token=out.append, **ask)
        for p, out, ask in zip(prompts, outs, asks)])
    assert all(f in ("stop", "length") for f in finishes), finishes
    batcher.close()
    _digits(outs[0], transitions)
    _digits(outs[2], transitions)
    assert len(outs[1]) == 10 or outs[1][-1] == EOS  # the plain request beside them ran as usual
    assert batcher.graphs is not None and batcher.graphs.replays > 0
    assert batcher.spec_steps > 0 if speculate else batcher.spec_steps == 0

    results, _ = generate(model, prompts, max_new_tokens=20, stop_tokens=[EOS], sampling=SamplingParams(0.8, top_k=5),
                          constraints=[GrammarConstraint(transitions, [EOS], lazy_checks=lazy_checks) for _ in prompts])
    for r in results:
        _digits(r.tokens, transitions)


def test_think_block_refuses_a_stop_on_cuda():
    """Inside a think block a stop token is masked on the logits' own device while the grammar owes a document."""
    from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache
    from openm3.engine.sampling import SamplingParams

    pieces = [None] * 16 + [ALPHABET[t % len(ALPHABET)] for t in range(16, 300)]
    c = GrammarConstraint(TransitionCache(Digits(), TokenBytes(pieces)), [EOS], think=(3, 4), thinking=True)
    gen = torch.Generator("cuda").manual_seed(0)
    for sampling in (SamplingParams(), SamplingParams(1.0), SamplingParams(1.0, top_k=3)):
        logits = torch.zeros(len(pieces), device="cuda", dtype=torch.bfloat16)
        logits[EOS], logits[20] = 30.0, 4.0
        assert c.pick(logits, sampling, gen) != EOS and c.phase == "thinking"
    logits[4] = 40.0  # the block's end: the grammar applies, digits only
    assert c.pick(logits, SamplingParams(), gen) == 4 and c.phase == "grammar"
