"""Engine end to end on tiny random models: chunked prefill + decode through the paged cache equal one full forward,
on the reference path and with the Triton decode kernels (TRITON_INTERPRET=1 on CPU)."""

import contextlib
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from openm3.engine.cache import CacheLayout, PagedCache, plan_cache  # noqa: E402
from openm3.engine.scheduler import _forward, decode_step, prefill  # noqa: E402
from openm3.models import M3TextConfig, M3TextModel  # noqa: E402
from openm3.ops.msa import use_backend  # noqa: E402


def tiny_model(seed=0, **overrides) -> M3TextModel:
    """m3-tiny (dense layer 0 with a dense MLP, MSA layers 1-3 with MoE; blocks of 16) with few blocks chosen, so
    selection is really sparse at these lengths."""
    torch.manual_seed(seed)
    config = M3TextConfig.from_name("m3-tiny", **{"index_topk_blocks": 2, "num_hidden_layers": 3,
                                                  "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 2,
                                                  "mlp_layer_types": ["dense", "sparse", "sparse"], **overrides})
    return M3TextModel(config).eval()


def full_logits(model, seqs):
    """One forward over the packed full sequences -> per-sequence logits [L_b, V]."""
    lens = [len(s) for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    with torch.no_grad():
        logits = model(torch.tensor(sum(seqs, [])), cu_seqlens=cu).logits
    return list(logits.split(lens))


CASES = [
    # prompt lengths, chunk size, decode steps, overrides
    ([50], 16, 4, {}),
    ([37, 9, 16], 20, 5, {}),
    ([33, 18], 64, 3, {"index_local_blocks": 2, "index_topk_blocks": 3}),
]


def _case_id(c):
    extra = "-".join(f"{k.split('_')[-2]}{v}" for k, v in c[3].items())
    return f"L{'-'.join(map(str, c[0]))}-chunk{c[1]}-N{c[2]}" + (f"-{extra}" if extra else "")


def _run(model, prompts, chunk, steps, seqs, decode_backend=None, index_dtype=None):
    """Prefill + `steps` decode steps feeding the tokens of `seqs`; returns per-sequence logits
    [steps + 1, V] (last prompt token, then each decode step)."""
    layout = CacheLayout.from_config(model.config)
    cache = PagedCache(plan_cache(layout, sum(len(s) for s in seqs) + 16 * len(seqs), kv_dtype=torch.float32,
                                  index_dtype=index_dtype))
    ids = list(range(len(prompts)))
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    out = [[lg] for lg in prefill(model, cache, ids, [torch.tensor(p) for p in prompts], chunk_size=chunk)]
    with use_backend(decode_backend):
        for s in range(steps):
            feed = torch.tensor([seqs[b][len(prompts[b]) + s] for b in ids])
            for b, lg in enumerate(decode_step(model, cache, ids, feed)):
                out[b].append(lg)
    return [torch.stack(o) for o in out], cache


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_prefill_and_decode_equal_full_forward(case):
    lens, chunk, steps, overrides = case
    model = tiny_model(**overrides)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    prompts = [s[:n] for s, n in zip(seqs, lens)]
    got, cache = _run(model, prompts, chunk, steps, seqs)
    for b, (g, full) in enumerate(zip(got, full_logits(model, seqs))):
        want = full[lens[b] - 1: lens[b] + steps]
        assert (g - want).abs().max().item() < 1e-4, f"sequence {b}"
        assert cache.length(b) == lens[b] + steps


@pytest.mark.parametrize("q_len", [1, 2], ids=["Q1", "Q2-mtp"])
def test_triton_decode_kernels_in_the_engine_equal_full_forward(q_len):
    """Decode steps (one or two new tokens per sequence, as for MTP drafts) through the Triton decode kernels;
    sequences of unequal lengths crossing page boundaries in one launch."""
    model = tiny_model()
    lens, steps = [30, 47], 2
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps * q_len,), generator=gen).tolist() for n in lens]
    prompts = [s[:n] for s, n in zip(seqs, lens)]
    layout = CacheLayout.from_config(model.config)
    cache = PagedCache(plan_cache(layout, 160, kv_dtype=torch.float32))
    cache.admit({0: len(seqs[0]), 1: len(seqs[1])})
    prefill(model, cache, [0, 1], [torch.tensor(p) for p in prompts], chunk_size=32)
    full = full_logits(model, seqs)
    with use_backend("triton"), torch.no_grad():
        for s in range(steps):
            starts = [n + s * q_len for n in lens]
            pieces = [torch.tensor(seqs[b][starts[b]:starts[b] + q_len]) for b in (0, 1)]
            logits = _forward(model, cache, [0, 1], pieces, starts, list(range(2 * q_len)))
            for b in (0, 1):
                want = full[b][starts[b]:starts[b] + q_len]
                assert (logits[b * q_len:(b + 1) * q_len] - want).abs().max().item() < 1e-4


def test_fp8_index_cache_runs_and_stays_close():
    """With fp8 index keys the engine may pick other blocks on near-ties; logits stay close to the full forward."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, model.config.vocab_size, (45,), generator=gen).tolist()]
    got, _ = _run(model, [seqs[0][:40]], 16, 5, seqs, index_dtype="fp8")
    want = full_logits(model, seqs)[0][39:45]
    assert got[0].shape == want.shape
    assert (got[0].argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_rejected_draft_tokens_are_truncated():
    """Speculative / MTP use: verify 3 draft tokens in one step (the decode kernels with q_len=3), reject the last
    two, continue from the accepted one: logits still equal the full forward of the accepted sequence."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=gen).tolist()
    drafts = torch.randint(0, model.config.vocab_size, (3,), generator=gen).tolist()
    after = torch.randint(0, model.config.vocab_size, (2,), generator=gen).tolist()
    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 64, kv_dtype=torch.float32))
    cache.admit({0: 48})
    prefill(model, cache, [0], [torch.tensor(prompt)], chunk_size=16)
    with use_backend("triton"), torch.no_grad():
        verify = _forward(model, cache, [0], [torch.tensor(drafts)], [37], [0, 1, 2])
        cache.truncate(0, 38)  # keep the first draft token
        with pytest.raises(ValueError, match="length must be"):
            cache.truncate(0, 39)
        cont = [decode_step(model, cache, [0], torch.tensor([t]))[0] for t in after]
    full = full_logits(model, [prompt + drafts])[0]
    assert (verify - full[37:40]).abs().max().item() < 1e-4
    accepted = full_logits(model, [prompt + drafts[:1] + after])[0]
    assert (torch.stack(cont) - accepted[38:40]).abs().max().item() < 1e-4
    assert cache.length(0) == 40


def test_step_buffers_give_the_same_logits_and_are_reused():
    """`cache.step(..., buffers=)` (what CUDA-graph decode replays read) fills the same device tensors every step
    and gives the same logits as fresh tensors; `advance=False` leaves the lengths where they were."""
    from openm3.engine.cache import StepBuffers
    from openm3.engine.graphs import DecodeGraphs

    model = tiny_model()
    lens, steps = [21, 40], 3
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    prompts = [s[:n] for s, n in zip(seqs, lens)]
    want, _ = _run(model, prompts, 16, steps, seqs)
    layout = CacheLayout.from_config(model.config)
    cache = PagedCache(plan_cache(layout, 128, kv_dtype=torch.float32))
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    prefill(model, cache, [0, 1], [torch.tensor(p) for p in prompts], chunk_size=16)
    bufs = StepBuffers(cache, [0, 1], q_len=1)
    seen = (bufs.slots.data_ptr(), bufs.seq_lens.data_ptr(), bufs.cu_seqlens.data_ptr(), bufs.block_table.data_ptr())
    cu_version = bufs.cu_seqlens._version
    for s in range(steps):
        feed = torch.tensor([seqs[b][lens[b] + s] for b in (0, 1)])
        pos = torch.tensor([cache.length(b) for b in (0, 1)])
        with cache.step([0, 1], [1, 1], buffers=bufs, advance=False):  # recorded, not run: lengths stay
            pass
        assert [cache.length(b) for b in (0, 1)] == [lens[0] + s, lens[1] + s]
        with torch.no_grad(), cache.step([0, 1], [1, 1], buffers=bufs):
            st = cache._step
            assert (st.slots, st.seq_lens, st.cu_seqlens_q, st.block_table) == (bufs.slots, bufs.seq_lens,
                                                                               bufs.cu_seqlens, bufs.block_table)
            assert bufs.seq_lens.tolist() == [lens[0] + s + 1, lens[1] + s + 1]
            logits = model(inputs_embeds=model.embed_tokens(feed), position_ids=pos, cu_seqlens=bufs.cu_seqlens,
                           cache=cache).logits
        for b in (0, 1):
            assert (logits[b] - want[b][s + 1]).abs().max().item() < 1e-5
    assert (bufs.slots.data_ptr(), bufs.seq_lens.data_ptr(), bufs.cu_seqlens.data_ptr(),
            bufs.block_table.data_ptr()) == seen
    assert bufs.cu_seqlens._version == cu_version  # never rewritten: host reads cached per version stay valid
    with pytest.raises(ValueError, match="buffers were made for sequences"):
        with cache.step([1, 0], [1, 1], buffers=bufs):
            pass
    with pytest.raises(ValueError, match="buffers were made for sequences"):
        with cache.step([0, 1], [2, 1], buffers=bufs):
            pass
    # a release elsewhere leaves the batch's table as it was; a reused sequence id with other pages is refused
    cache.admit({7: 8})
    cache.release(7)
    with cache.step([0, 1], [1, 1], buffers=bufs, advance=False):
        pass
    cache.release(1)
    cache.admit({5: 8})  # takes the lowest free pages, which were sequence 1's
    cache.admit({1: len(seqs[1])})
    with pytest.raises(ValueError, match="page table changed"):
        with cache.step([0, 1], [1, 1], buffers=bufs, advance=False):
            pass
    with pytest.raises(ValueError, match="CUDA graphs need a cache on a CUDA device"):
        DecodeGraphs(model, cache)


def test_padded_widths_are_coarse_and_never_narrower():
    from openm3.engine.graphs import padded_width

    widths = [padded_width(n) for n in range(1, 5000)]
    assert all(w >= n for n, w in zip(range(1, 5000), widths)) and widths[:16] == list(range(1, 17))
    assert all(w - n < max(1, n / 16) for n, w in zip(range(1, 5000), widths))  # at most 1/16 more columns
    assert widths == sorted(widths) and len(set(widths[16:])) <= 16 * 9  # 16 per octave from 17 to 4999
    assert padded_width(65) == padded_width(68) == 68 and padded_width(7813) == 7936


def test_padded_rows_are_few_and_never_fewer():
    from openm3.engine.graphs import padded_rows

    rows = [padded_rows(b) for b in range(1, 130)]
    assert all(r >= b for b, r in zip(range(1, 130), rows)) and rows[:8] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert sorted(set(rows)) == [1, 2, 4] + list(range(8, 137, 8))


@pytest.mark.parametrize("backend,q_len", [(None, 1), ("triton", 1), ("triton", 2)],
                         ids=["reference", "triton-Q1", "triton-Q2"])
def test_step_buffers_with_padding_rows_touch_only_the_scratch_page(backend, q_len):
    """Buffers of 4 rows serving batches of 2, 3 and 1 sequences (q_len new tokens each; the reference path and
    the Triton decode kernels, which CUDA graphs run): the real rows' logits equal the full forward's, the padding
    rows write only into the scratch page, and every other page holds what the same steps without padding leave
    there."""
    from openm3.engine.cache import StepBuffers

    model = tiny_model()
    lens, steps = [21, 40, 33], 2 * q_len
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    full = full_logits(model, seqs)
    caches = []
    for _ in range(2):
        cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 256, kv_dtype=torch.float32))
        cache.admit({b: len(s) for b, s in enumerate(seqs)})
        prefill(model, cache, [0, 1, 2], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=16)
        caches.append(cache)
    padded, plain = caches
    scratch = padded.scratch_page
    assert scratch == padded.plan.num_pages and padded.k[0].shape[0] == padded.plan.num_pages + 1
    bufs = StepBuffers(padded, [0, 1], q_len=q_len, rows=4)
    assert bufs.padding == 2 and bufs.block_table[2:, 0].tolist() == [scratch, scratch]
    done = {0: 0, 1: 0, 2: 0}
    for batch in ([0, 1], [2, 0, 1], [2]):
        bufs.bind(padded, batch)
        assert bufs.padding == 4 - len(batch)
        feed = torch.tensor([seqs[b][lens[b] + done[b]:lens[b] + done[b] + q_len] for b in batch]).flatten()
        pos = (torch.tensor([padded.length(b) for b in batch])[:, None] + torch.arange(q_len)).flatten()
        pad = bufs.padding * q_len  # padding rows: token 0 at positions 0..q_len-1, as DecodeGraphs feeds them
        with use_backend(backend), torch.no_grad():
            with padded.step(batch, [q_len] * len(batch), buffers=bufs):
                logits = model(inputs_embeds=model.embed_tokens(torch.cat([feed, feed.new_zeros(pad)])),
                               position_ids=torch.cat([pos, torch.arange(q_len).repeat(bufs.padding)]),
                               cu_seqlens=bufs.cu_seqlens, cache=padded).logits
            with plain.step(batch, [q_len] * len(batch)):
                cu = torch.arange(0, len(batch) * q_len + 1, q_len, dtype=torch.int32)
                model(feed, position_ids=pos, cu_seqlens=cu, cache=plain)
        assert logits.shape[0] == 4 * q_len
        for rows, b in zip(logits.view(4, q_len, -1), batch):
            want = full[b][lens[b] + done[b]:lens[b] + done[b] + q_len]
            done[b] += q_len
            assert (rows - want).abs().max().item() < 1e-4, (batch, b)
        assert [padded.length(b) for b in range(3)] == [lens[b] + done[b] for b in range(3)]
    for mine, theirs in zip(padded.k + padded.v, plain.k + plain.v):
        # every sequence page as without padding (to fp32 rounding: a batch of 4 rows rounds apart from one of 3)
        assert (mine[:scratch] - theirs[:scratch]).abs().max().item() < 1e-5
    assert padded.k[0][scratch].abs().sum() > 0  # the padding rows wrote there
    with pytest.raises(ValueError, match="at most 4 sequences"):
        bufs.bind(padded, [0, 1, 2, 3, 4])


def test_step_buffers_rebound_to_another_batch_give_the_full_forward():
    """Buffers made for one batch (a page table wider than it needs) and then `bind`-ed to another batch of as
    many sequences: each step's logits equal the full forward's, through the same device tensors."""
    from openm3.engine.cache import StepBuffers

    model = tiny_model()
    lens, steps = [21, 40, 33], 3
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    full = full_logits(model, seqs)
    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 256, kv_dtype=torch.float32))
    cache.admit({b: len(s) for b, s in enumerate(seqs)})
    prefill(model, cache, [0, 1, 2], [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=16)
    width = cache.table_width([0, 1]) + 3
    bufs = StepBuffers(cache, [0, 1], q_len=1, width=width)
    assert bufs.block_table.shape == (2, width) and bufs.width == width
    seen = (bufs.block_table.data_ptr(), bufs.cu_seqlens.data_ptr(), bufs.cu_seqlens._version)
    done = {0: 0, 1: 0, 2: 0}
    for batch in ([0, 1], [2, 0], [2, 0], [1, 2]):
        bufs.bind(cache, batch)
        assert bufs.seq_ids == tuple(batch)
        assert bufs.block_table.tolist() == cache.host_table(batch, width).tolist()
        feed = torch.tensor([seqs[b][lens[b] + done[b]] for b in batch])
        pos = torch.tensor([cache.length(b) for b in batch])
        with torch.no_grad(), cache.step(batch, [1] * len(batch), buffers=bufs):
            logits = model(inputs_embeds=model.embed_tokens(feed), position_ids=pos, cu_seqlens=bufs.cu_seqlens,
                           cache=cache).logits
        for row, b in zip(logits, batch):
            done[b] += 1
            assert (row - full[b][lens[b] + done[b] - 1]).abs().max().item() < 1e-4, (batch, b)
    assert (bufs.block_table.data_ptr(), bufs.cu_seqlens.data_ptr(), bufs.cu_seqlens._version) == seen
    with pytest.raises(ValueError, match="at most 2 sequences"):
        bufs.bind(cache, [0, 1, 2])
    with pytest.raises(ValueError, match="width must be at least"):
        StepBuffers(cache, [0, 1], q_len=1, width=1)


class _FakeGraph:
    """A stand-in for `torch.cuda.CUDAGraph` on the CPU: `replay` runs again the forward recorded at capture,
    into the same output tensor (what a CUDA graph's replay does to its captured output)."""

    capturing = None

    def __init__(self):
        self.forward = None

    def replay(self):
        out, forward = self.forward
        out.copy_(forward())


@contextlib.contextmanager
def _fake_capture(graph, pool=None):
    _FakeGraph.capturing = graph
    try:
        yield
    finally:
        _FakeGraph.capturing = None


def _fake_cuda_graphs(monkeypatch) -> None:
    """torch.cuda's graph API replaced by `_FakeGraph` / `_fake_capture` (no device switch, no pool)."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda _d: contextlib.nullcontext())


@pytest.mark.parametrize("backend", [None, "triton"], ids=["reference", "triton"])
def test_decode_graphs_serve_shapes_on_the_cpu(monkeypatch, backend):
    """`DecodeGraphs`' bookkeeping with graphs faked on the CPU (a replay reruns the captured forward through the
    same buffers): batches [0, 1, 2] (a graph of 4 rows), [0, 2], then [3, 0, 2, 4] and [2, 0] replay the graphs
    of their shapes from their first step with their own page tables; every step's logits equal eager steps on a
    twin cache, and the counters say two captures, two eager steps, two rebinds."""
    from openm3.engine import graphs as graphs_module
    from openm3.engine.graphs import DecodeGraphs
    from openm3.engine.scheduler import decode_step

    forward = graphs_module._Batch.forward

    def recorded_forward(batch, model, cache):
        out = forward(batch, model, cache)
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.forward = (out, lambda: forward(batch, model, cache))
        return out

    _fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(graphs_module._Batch, "forward", recorded_forward)
    model = tiny_model()
    lens, steps = [40, 17, 70, 45, 30], 12
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist() for n in lens]
    caches = []
    for _ in range(2):
        cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 512, kv_dtype=torch.float32))
        cache.admit({b: len(s) for b, s in enumerate(seqs)})
        prefill(model, cache, list(range(5)), [torch.tensor(s[:n]) for s, n in zip(seqs, lens)], chunk_size=32)
        caches.append(cache)
    device = caches[1].device
    caches[1].device = types.SimpleNamespace(type="cuda")  # DecodeGraphs checks for a CUDA cache
    graphs = DecodeGraphs(model, caches[1])
    caches[1].device = device
    done = [0] * 5
    plan = [[0, 1, 2]] * 3 + [[0, 2]] * 2 + [[3, 0, 2, 4]] * 3 + [[2, 0]] * 2
    with use_backend(backend):
        for s, running in enumerate(plan):
            if s == 3:
                for cache in caches:
                    cache.release(1)
            feed = torch.tensor([seqs[b][lens[b] + done[b]] for b in running])
            want = decode_step(model, caches[0], running, feed)
            got = graphs.step(running, feed)
            for b in running:
                done[b] += 1
            assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4, s
    assert (graphs.captures, graphs.eager_steps, graphs.replays, graphs.rebinds) == (2, 2, len(plan) - 2, 2)
    width = caches[1].table_width([2])  # the widest sequence in every batch (at most 16 pages: exact)
    assert sorted(graphs._batches) == [(2, 1, width), (4, 1, width)]  # (rows, tokens per sequence, width)
    for b in (0, 2, 3, 4):
        assert caches[1].length(b) == caches[0].length(b) == lens[b] + done[b]


def test_a_failed_capture_warns_with_the_line_that_refused_and_decodes_eagerly(monkeypatch):
    """A capture that fails (here: every `.tolist()` refused while capturing, as CUDA refuses a host read) leaves
    a warning that names the error and the innermost line of openm3 that raised it, and the steps go on eagerly
    with the eager step's logits."""
    from openm3.engine import graphs as graphs_module
    from openm3.engine.graphs import DecodeGraphs

    tolist = torch.Tensor.tolist

    def refusing_tolist(self):
        if _FakeGraph.capturing is not None:
            raise RuntimeError("no host reads while capturing")
        return tolist(self)

    _fake_cuda_graphs(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "tolist", refusing_tolist)
    model = tiny_model()
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    caches = []
    for _ in range(2):
        cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 128, kv_dtype=torch.float32))
        cache.admit({0: 48})
        prefill(model, cache, [0], [prompt], chunk_size=32)
        caches.append(cache)
    device = caches[1].device
    caches[1].device = types.SimpleNamespace(type="cuda")  # DecodeGraphs checks for a CUDA cache
    graphs = DecodeGraphs(model, caches[1])
    caches[1].device = device
    assert graphs_module._where(RuntimeError()) == ""
    for s in range(3):
        feed = torch.tensor([7 + s])
        want = decode_step(model, caches[0], [0], feed)
        if s == 1:  # the second step captures
            with pytest.warns(UserWarning, match=r"failed \(no host reads while capturing, at openm3/[\w/]+\.py:\d+ "
                                                 r"\(.*\.tolist\(\).*\)\); decoding eagerly"):
                got = graphs.step([0], feed)
        else:
            got = graphs.step([0], feed)
        assert (got - want).abs().max().item() < 1e-4, s
    assert (graphs.enabled, graphs.captures, graphs.replays, graphs.eager_steps) == (False, 0, 0, 3)
