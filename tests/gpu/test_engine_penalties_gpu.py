"""Logit bias and penalties on the GPU (`openm3.engine.penalties`): the pickers adjust bf16 logits rows on the
device; greedy answers through `generate` with CUDA graphs equal those of eager steps and of speculative steps,
`BatchedGenerator`'s (graphs, beside a plain request) equal them up to a bf16 near-tie, and min_tokens holds a biased
stop token back.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_penalties_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from batching_utils import run_concurrently  # tests/: the shared helper, not a test module

pytestmark = pytest.mark.gpu

STOP = 11


def test_penalized_greedy_answers_agree_on_every_path():
    from openm3.engine import generate
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.penalties import Penalties, PenalizedPicker
    from openm3.engine.speculative import SpeculativeConfig
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(16, model.config.vocab_size, (n,), generator=gen).tolist() for n in (300, 70)]
    cases = [Penalties(repetition=1.6, frequency=0.4, logit_bias=((5, 1.5),)),
             Penalties(presence=1.2, logit_bias=((STOP, 60.0),), min_tokens=5)]

    def pickers():
        return [PenalizedPicker(c, p, [STOP]) for p, c in zip(prompts, cases)]

    runs = {}
    for name, kw in (("graphs", {}), ("eager", {"cuda_graphs": False}),
                     ("speculative", {"speculative": SpeculativeConfig(num_speculative_tokens=3,
                                                                      prompt_lookup_min=1)})):
        got, _ = generate(model, prompts, max_new_tokens=24, stop_tokens=[STOP], constraints=pickers(), **kw)
        runs[name] = [r.tokens for r in got]
    plain, _ = generate(model, prompts, max_new_tokens=24, stop_tokens=[STOP])
    assert runs["graphs"] == runs["eager"] == runs["speculative"]
    assert runs["graphs"][0] != plain[0].tokens
    assert runs["graphs"][1] == runs["graphs"][1][:5] + [STOP]  # held back 5 tokens, then the bias wins

    batcher = BatchedGenerator(model, token_budget=4096, max_batch=3)
    outputs: list[list[int]] = [[], [], []]

    def job(k, prompt, picker):
        return lambda: batcher(prompt, max_new_tokens=24, stop_tokens=[STOP], on_token=outputs[k].append,
                               constraint=picker)

    run_concurrently([job(k, p, c) for k, (p, c) in enumerate(zip(prompts, pickers()))] + [job(2, prompts[0], None)])
    batcher.close()
    # A batch of three rounds its matmuls differently from generate's two rows: each answer equals the
    # unbatched one up to where they part, and they may part only at a near-tie of the adjusted row there.
    for got, want, prompt, case in zip(outputs, runs["graphs"] + [plain[0].tokens], prompts + prompts[:1],
                                       cases + [None]):
        _agree_up_to_a_near_tie(model, prompt, got, want, case)


def _agree_up_to_a_near_tie(model, prompt, got, want, penalties, tol=0.1):
    """got == want, or they part at a step where both tokens' (adjusted) logits from a full forward over
    prompt + the common answer lie within tol of that row's best (bf16 rounding can pick either; a wrong
    computation parts at a clear winner)."""
    from openm3.engine.penalties import PenalizedPicker

    common = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if common is None:
        assert len(got) == len(want), (got, want)
        return
    ids = torch.tensor(prompt + want[:common], device="cuda")
    with torch.no_grad():
        row = model(ids, cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32, device="cuda")).logits[-1]
    if penalties is not None:
        picker = PenalizedPicker(penalties, prompt, [STOP])
        picker.adjust(row)  # makes the per-sequence tensors, then counts the common answer
        for token in want[:common]:
            picker._count(token)
        row = picker.adjust(row)
    row = row.float()
    best = float(row.max())
    gaps = [best - float(row[t]) for t in (got[common], want[common])]
    assert max(gaps) <= tol, f"answers part at step {common} with logit gaps {gaps} to the best"
