"""Session 31's engine features on the GPU: the adaptive speculation gate through CUDA graphs (it times only
replayed steps), a request's predicted output speculating alone without a speculative config, a thinking budget
and bad words in `BatchedGenerator` with CUDA graphs.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_session31_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    return M3TextModel(M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)).to("cuda", torch.bfloat16).eval()


def _prompts(model, lens, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(16, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]


def test_the_gate_and_predicted_outputs_keep_the_greedy_tokens(model):
    """With CUDA graphs: a prediction equal to the plain answer speculates without a speculative config and
    gives the plain tokens in fewer steps; an adaptive config whose lookups are never right (a random model's)
    gives them without speculating much, and its gate has timed replayed steps."""
    from openm3.engine import generate
    from openm3.engine.speculative import SpeculativeConfig

    prompts = _prompts(model, [600, 200])
    plain, plain_stats = generate(model, prompts, max_new_tokens=48)
    answers = [r.tokens for r in plain]
    told, stats = generate(model, prompts, max_new_tokens=48, draft_contexts=[answers[0], None])
    assert [r.tokens for r in told] == answers
    assert stats.accepted_tokens >= 20
    alone, alone_stats = generate(model, prompts[:1], max_new_tokens=48, draft_contexts=[answers[0]])
    assert alone[0].tokens == answers[0] and alone_stats.decode_steps < plain_stats.decode_steps
    gated, gate_stats = generate(model, prompts, max_new_tokens=48,
                                 speculative=SpeculativeConfig(num_speculative_tokens=4, adaptive=True))
    assert [r.tokens for r in gated] == answers
    assert "step times" in gate_stats.spec_gate and gate_stats.spec_steps <= gate_stats.decode_steps // 4


def test_thinking_budget_and_bad_words_in_the_batcher(model):
    """Two requests at once through `BatchedGenerator` (graphs): a thinking budget of 4 inside a block the prompt
    opens ends it with the end token at the 5th pick and keeps it shut; a bad word (two tokens the plain answer
    writes) is never completed."""
    from batching_utils import run_concurrently
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.penalties import Penalties, PenalizedPicker

    start, end, stop = 20, 21, 11
    prompts = _prompts(model, [300, 120])
    think_prompt = prompts[0] + [start]
    batcher = BatchedGenerator(model, token_budget=4096, max_batch=4)
    outputs: list[list[int]] = [[], []]
    budget = PenalizedPicker(Penalties(think=(start, end), think_budget=4), think_prompt, [stop])
    plain_first = []
    assert batcher(think_prompt, max_new_tokens=4, on_token=plain_first.append) == "length"
    bad = (plain_first[1], plain_first[2])
    banned = PenalizedPicker(Penalties(bad_words=(bad,)), think_prompt, [stop])

    def job(k, prompt, picker):
        return lambda: batcher(prompt, max_new_tokens=16, stop_tokens=[stop], on_token=outputs[k].append,
                               constraint=picker)

    run_concurrently([job(0, think_prompt, budget), job(1, think_prompt, banned)])
    batcher.close()
    assert outputs[0][4] == end and start not in outputs[0][5:]
    assert all((a, b) != bad for a, b in zip(outputs[1], outputs[1][1:]))
