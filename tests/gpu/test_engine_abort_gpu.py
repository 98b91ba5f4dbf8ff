"""Aborting requests of `BatchedGenerator` on the GPU, where decode steps replay CUDA graphs and are launched ahead
of the host (`overlap`): a request aborted mid-decode ends before its next token (no row of a step launched ahead
reaches it), the one beside it runs to its end, and every page comes back. (Token equality with a run alone is not
asserted: in bf16 a batch's composition changes the rounding; the CPU tests check it in fp32.)

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_abort_gpu.py
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_request_aborted_mid_decode_under_graphs_leaves_the_other_untouched(overlap):
    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.generate import for_inference
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    model = for_inference(M3TextModel(M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)).to("cuda",
                                                                                                torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (150, 90)]
    batcher = BatchedGenerator(model, token_budget=2048, max_batch=2, overlap=overlap)
    abort, got, results = threading.Event(), [[], []], [None, None]

    def first(tok):
        got[0].append(tok)
        if len(got[0]) == 6:
            abort.set()

    def run(i, **kw):
        results[i] = batcher(prompts[i], max_new_tokens=24, **kw)

    threads = [threading.Thread(target=run, args=(0,), kwargs=dict(on_token=first, abort=abort)),
               threading.Thread(target=run, args=(1,), kwargs=dict(on_token=got[1].append))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    batcher.close()
    assert results == ["abort", "length"]
    assert len(got[0]) == 6 and len(got[1]) == 24
    assert batcher.graphs is not None and batcher.graphs.replays > 0
    assert batcher.cache.free_pages == batcher.plan.num_pages
