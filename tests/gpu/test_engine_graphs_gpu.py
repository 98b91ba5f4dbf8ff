"""CUDA-graph decode steps (`openm3.engine.graphs`) against eager decode steps on the GPU.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_graphs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _model(dtype):
    """m3-tiny as `openm3 generate` loads models (`for_inference`: fused attention projections)."""
    from openm3.engine.generate import for_inference
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)
    return for_inference(M3TextModel(config).to("cuda", dtype))


def _cache(model, seqs, index_dtype):
    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache

    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 64 * 16, kv_dtype=torch.bfloat16,
                                  index_dtype=index_dtype), "cuda")
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    return cache


@pytest.mark.parametrize("index_dtype", [None, "fp8"], ids=["idx-bf16", "idx-fp8"])
def test_graph_decode_steps_equal_eager_steps(index_dtype):
    """m3-tiny in bf16 (grouped MoE, Triton decode kernels): 3 sequences of unequal lengths for 5 steps, then one
    finishes and the other 2 go on for 4 steps. Every step's logits through CUDA graphs equal the eager step's
    (the same kernels on the same inputs), one graph is captured per batch, and the later steps only replay."""
    from openm3.engine.graphs import DecodeGraphs
    from openm3.engine.scheduler import decode_step, prefill

    model = _model(torch.bfloat16)
    lens, steps = [70, 33, 150], 9
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    caches = [_cache(model, seqs, index_dtype) for _ in range(2)]
    for cache in caches:
        prefill(model, cache, [0, 1, 2], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=64)
    graphs = DecodeGraphs(model, caches[1])
    running = [0, 1, 2]
    for s in range(steps):
        if s == 5:
            running = [0, 2]
            for cache in caches:
                cache.release(1)
        feed = torch.tensor([seqs[b][lens[b] + s] for b in running], device="cuda")
        want = decode_step(model, caches[0], running, feed)
        got = graphs.step(running, feed)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item(), s
        assert torch.equal(got.argmax(-1), want.argmax(-1)), s
    assert graphs.enabled and graphs.captures == 2  # one per batch
    assert graphs.eager_steps == 2 and graphs.replays == steps - 2
    for b in running:
        assert caches[1].length(b) == caches[0].length(b) == lens[b] + steps


def test_a_batch_of_a_shape_seen_before_replays_its_graph_at_once():
    """Graphs serve shapes: after batches [0, 1, 2] (3 sequences in a graph of 4 rows: eager step, capture,
    replays) and [0, 2], the batch [3, 0, 2, 4] (4 sequences, page tables of the same padded width) replays the
    first graph from its first step, with its own page table written into the graph's buffers and no padding row:
    no eager step, no capture, logits equal to eager steps on a twin cache; and [2, 0] replays [0, 2]'s graph."""
    from openm3.engine.graphs import DecodeGraphs
    from openm3.engine.scheduler import decode_step, prefill

    model = _model(torch.bfloat16)
    lens, steps = [70, 33, 150, 90, 60], 12
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    caches = [_cache(model, seqs, "fp8") for _ in range(2)]
    for cache in caches:
        prefill(model, cache, list(range(5)), [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=64)
    graphs = DecodeGraphs(model, caches[1])
    done = [0] * 5
    plan = [[0, 1, 2]] * 3 + [[0, 2]] * 2 + [[3, 0, 2, 4]] * 3 + [[2, 0]] * 2
    for s, running in enumerate(plan):
        if s == 3:
            for cache in caches:
                cache.release(1)
        feed = torch.tensor([seqs[b][lens[b] + done[b]] for b in running], device="cuda")
        want = decode_step(model, caches[0], running, feed)
        got = graphs.step(running, feed)
        for b in running:
            done[b] += 1
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item(), s
        assert torch.equal(got.argmax(-1), want.argmax(-1)), s
        if s == 5:  # [3, 0, 2, 4]'s first step
            assert graphs.captures == 2 and graphs.eager_steps == 2 and graphs.rebinds == 1
    assert graphs.captures == 2 and graphs.eager_steps == 2 and graphs.replays == len(plan) - 2
    assert graphs.rebinds == 2  # [3, 0, 2, 4] onto [0, 1, 2]'s graph, then [2, 0] onto [0, 2]'s
    for b in (0, 2, 3, 4):
        assert caches[1].length(b) == caches[0].length(b) == lens[b] + done[b]


def test_generate_with_and_without_graphs_gives_the_same_tokens():
    """`generate` (graphs on by default on CUDA) and `generate(..., cuda_graphs=False)`: the same greedy tokens,
    and the stats say which ran."""
    from openm3.engine.generate import generate

    model = _model(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (90, 17)]
    eager, eager_stats = generate(model, prompts, max_new_tokens=12, cuda_graphs=False)
    graphed, stats = generate(model, prompts, max_new_tokens=12)
    assert eager_stats.graph_captures is None and "eager" in eager_stats.summary()
    assert stats.graph_captures == 1 and stats.graph_replays == 12 - 2  # 11 decode steps, the first eager
    assert "CUDA graphs" in stats.summary()
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]


def test_overlapped_generate_gives_the_same_greedy_tokens():
    """`generate(..., overlap=True)` through CUDA graphs (tokens fed from the device, read back one step late): the
    plain loop's greedy tokens and finish reasons, with a stop token one sequence samples early; no sync inside a
    step (the graph step is given device tokens)."""
    from openm3.engine.generate import generate

    model = _model(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (90, 17, 40)]
    plain, _ = generate(model, prompts, max_new_tokens=12, overlap=False)
    stop = [plain[1].tokens[4]]
    want, _ = generate(model, prompts, max_new_tokens=12, stop_tokens=stop, overlap=False)
    got, stats = generate(model, prompts, max_new_tokens=12, stop_tokens=stop, overlap=True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert stats.graph_captures >= 1 and stats.graph_replays > 0
    # each interval of the loop is counted once: the first step, captures and the steady rest add up to decode_s
    assert stats.first_step_s + stats.capture_s <= stats.decode_s
    assert stats.first_step_tokens + stats.capture_tokens < stats.decode_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_batched_generator_on_cuda_equals_generate_alone(overlap):
    """Continuous batching on the GPU (decode steps through CUDA graphs, a new capture at each batch change):
    three concurrent greedy requests of different lengths against each prompt's `generate` tokens (also with each
    step launched ahead of the host: `overlap=True`, tokens fed from the device). In bf16 a
    batched matmul may round differently from a single row's (another cuBLAS kernel), so a near-tie can flip a
    later token of a random model: the first two tokens of each request must match and 80% of all (a broken batch
    matches ~0%)."""
    import threading

    from openm3.engine.batching import BatchedGenerator
    from openm3.engine.generate import generate

    model = _model(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (90, 17, 40)]
    new = [10, 4, 7]
    want = [generate(model, [p], max_new_tokens=n)[0][0].tokens for p, n in zip(prompts, new)]
    batcher = BatchedGenerator(model, token_budget=512, max_batch=4, overlap=overlap)
    got = [[] for _ in prompts]
    threads = [threading.Thread(target=lambda i=i: batcher(prompts[i], max_new_tokens=new[i], on_token=got[i].append))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    batcher.close()
    assert [g[:2] for g in got] == [w[:2] for w in want]
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    assert [len(g) for g in got] == new and sum(a == b for a, b in pairs) >= 0.8 * len(pairs)
    assert batcher.graphs is not None and batcher.graphs.replays > 0
    metrics = {name: value for name, _, _, value in batcher.metrics()}
    assert metrics["cuda_graph_replays_total"] == batcher.graphs.replays > 0


def test_a_replayed_step_does_not_wait_for_queued_work():
    """A replayed decode step fed tokens on the device (as overlapped steps are) or on the host launches without
    waiting for the work queued before it: its inputs (tokens, positions, slots, lengths) go up through pinned
    memory, where a copy from pageable memory first waits for the stream (it held a step launched ahead of the
    host until the step before it had run)."""
    from openm3.engine.graphs import DecodeGraphs
    from openm3.engine.scheduler import prefill
    from openm3.ops.host import to_device

    model = _model(torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=gen).tolist() for n in (40, 90)]
    cache = _cache(model, seqs, None)
    prefill(model, cache, [0, 1], [torch.tensor(s[:-8]) for s in seqs], chunk_size=64)
    graphs = DecodeGraphs(model, cache)
    for step in range(2):  # eager, then captured
        graphs.step([0, 1], torch.tensor([s[-8 + step] for s in seqs]))
    busy = torch.randn(8192, 8192, device="cuda")
    for step, on_device in ((2, True), (3, False)):
        torch.cuda.synchronize()
        for _ in range(20):  # ~0.2-1 s of queued work
            busy = busy @ busy / 90
        queued = torch.cuda.Event()
        queued.record()
        tokens = torch.tensor([s[-8 + step] for s in seqs])
        logits = graphs.step([0, 1], to_device(tokens, "cuda") if on_device else tokens)
        assert not queued.query(), f"the step waited for the queued work (tokens on the device: {on_device})"
        assert logits.shape == (2, model.config.vocab_size)
    torch.cuda.synchronize()
    assert graphs.captures == 1 and graphs.replays == 3  # the capture step replays too


def test_pages_the_decode_kernels_cannot_tile_decode_through_the_prefill_ops():
    """m3-tiny with MSA blocks of 48 tokens (a multiple of 16: the prefill kernels take it; not a power of two: the
    decode kernels do not): `generate` decodes through the prefill ops instead of failing, with or without CUDA
    graphs (a step that cannot be captured runs eagerly), and every greedy token is the full forward's argmax
    wherever that argmax is clear (a bf16 near-tie may go either way)."""
    import warnings

    from openm3.engine.generate import for_inference, generate
    from openm3.models import M3TextConfig, M3TextModel

    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2, index_block_size=48)
    model = for_inference(M3TextModel(config).to("cuda", torch.bfloat16))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (170, 40)]
    eager, _ = generate(model, prompts, max_new_tokens=8, cuda_graphs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph capture of such steps may fail and fall back, with a warning
        graphed, _ = generate(model, prompts, max_new_tokens=8)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    for prompt, result in zip(prompts, eager):
        ids = torch.tensor(prompt + result.tokens[:-1], device="cuda")
        cu = torch.tensor([0, ids.numel()], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            logits = model(ids, cu_seqlens=cu).logits.float()[len(prompt) - 1:]
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.02 * top2[:, 0].abs().clamp_min(1.0)
        picked = torch.tensor(result.tokens, device="cuda")
        assert clear.any() and torch.equal(logits.argmax(-1)[clear], picked[clear])
