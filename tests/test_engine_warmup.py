"""`openm3.engine.warmup`: compiling a served model's step shapes before its first requests (CPU; Dynamo's
counters tell when a compiled layer compiles again)."""

import threading

import pytest
import torch

from openm3.engine.batching import BatchedGenerator
from openm3.engine.warmup import warm_up
from openm3.models import M3TextConfig, M3TextModel



def _compiled_tiny():
    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    for layer in model.layers:  # as `compile_layers`, with Dynamo's eager backend: the same guards, no codegen
        layer.compile(dynamic=True, backend="eager")
    return model


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _traffic(gen, vocab: int) -> None:
    """Rounds of 1 to 4 requests at once, prompts of unequal lengths: decode batches of every size 1-4."""
    g = torch.Generator().manual_seed(1)
    for lengths in ([9], [5, 20, 33], [40, 3, 8, 15], [21, 6]):
        threads = [threading.Thread(target=gen, args=(torch.randint(0, vocab, (n,), generator=g).tolist(),),
                                    kwargs={"max_new_tokens": 2 + n % 3}) for n in lengths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_after_the_warm_up_traffic_compiles_nothing_and_metrics_count_only_it():
    torch._dynamo.reset()
    model = _compiled_tiny()
    vocab = model.config.vocab_size
    gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=32)
    try:
        before = _graphs()
        seconds = warm_up(gen, vocab, max_batch=4)
        warmed = _graphs()
        assert seconds > 0 and warmed > before  # the warm-up compiled the layers
        metrics = {name: value for name, _, _, value in gen.metrics()}
        assert metrics["decode_steps_total"] == 0 and metrics["generation_tokens_total"] == 0
        assert metrics["requests_finished_total"] == {} and metrics["prompt_tokens_total"] == 0
        _traffic(gen, vocab)
        assert _graphs() == warmed  # no shape of the traffic compiled again
        assert 1 in gen.batch_sizes and max(gen.batch_sizes) >= 2  # single and batched steps (which sizes: timing)
        metrics = {name: value for name, _, _, value in gen.metrics()}
        assert metrics["requests_finished_total"] == {"length": 10}
    finally:
        gen.close()


def test_the_warm_up_steps_one_row_and_several(monkeypatch):
    """torch.compile specializes size 1: the warm-up must run decode steps of one row and of more than one."""
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=32)
    seen = []
    real = gen.restore_counters
    monkeypatch.setattr(gen, "restore_counters", lambda saved: seen.append(dict(gen.batch_sizes)) or real(saved))
    try:
        warm_up(gen, model.config.vocab_size, max_batch=4)
    finally:
        gen.close()
    (sizes,) = seen
    assert 1 in sizes and max(sizes) >= 2 and gen.batch_sizes == {}


@pytest.mark.parametrize("name", ["max_batch", "chunk_size", "prefill_chunks_per_step"])
def test_batched_generator_refuses_a_bool_for_a_count(name):
    """True is no count (an int subclass, it would mean 1): refused before the cache is planned."""
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    with pytest.raises(ValueError, match=f"^{name} must be a positive int, got True"):
        BatchedGenerator(model, token_budget=256, **{name: True})


def test_warm_up_checks_its_arguments_and_reports_a_failed_request():
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        warm_up(lambda *a, **k: "stop", 100, max_batch=0)
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        warm_up(lambda *a, **k: "stop", 100, max_batch=1, new_tokens=0)
    with pytest.raises(ValueError, match="max_batch must be a positive int, got True"):  # (engine.check_count)
        warm_up(lambda *a, **k: "stop", 100, max_batch=True)
    with pytest.raises(ValueError, match="max_total_tokens must be an int >= 2"):
        warm_up(lambda *a, **k: "stop", 100, max_batch=1, max_total_tokens=1)

    def broken(prompt, **kwargs):
        raise ValueError("no room")

    with pytest.raises(RuntimeError, match="the warm-up request failed: no room"):
        warm_up(broken, 100, max_batch=2)
    calls = []
    warm_up(lambda prompt, **kwargs: calls.append((len(prompt), kwargs["max_new_tokens"])) or "length", 100,
            max_batch=1)
    assert calls == [(7, 3)]  # max_batch 1: the request alone only
    calls.clear()  # a server's small max_total_tokens: every warm-up request fits it
    warm_up(lambda prompt, **kwargs: calls.append((len(prompt), kwargs["max_new_tokens"])) or "length", 100,
            max_batch=4, max_total_tokens=12)
    assert sorted(calls) == [(7, 3), (9, 3), (9, 3), (9, 3)]
    calls.clear()
    warm_up(lambda prompt, **kwargs: calls.append((len(prompt), kwargs["max_new_tokens"])) or "length", 100,
            max_batch=2, max_total_tokens=2)
    assert calls == [(1, 1)] * 3  # the request alone, then two together
