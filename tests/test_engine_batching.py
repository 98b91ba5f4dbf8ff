"""Continuous batching (`openm3.engine.batching.BatchedGenerator`) on a tiny random model on CPU: concurrent
requests give the tokens `generate` gives each alone, are decoded together, wait for pages when the cache is
full, and end alone when their callback raises."""

from __future__ import annotations

import threading

import pytest
import torch

from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.sampling import SamplingParams
from openm3.models import M3TextConfig, M3TextModel

from batching_utils import random_prompts, tiny_model, hold_until_queued, run_concurrently


@pytest.fixture(scope="module")
def model():
    return tiny_model()


_prompts = random_prompts


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_concurrent_requests_equal_generate_alone(model, overlap):
    prompts = _prompts(model, [40, 9, 75])
    new = [12, 5, 9]
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0, top_k=20)]
    want = []
    for p, n, s, seed in zip(prompts, new, sampling, (0, 1, 2)):
        res, _ = generate(model, [p], max_new_tokens=n, sampling=s, seed=seed)
        want.append(res[0].tokens)
    gen = BatchedGenerator(model, token_budget=1024, max_batch=4, chunk_size=32, overlap=overlap)
    got = [[] for _ in prompts]
    results = run_concurrently([
        (lambda i=i: gen(prompts[i], max_new_tokens=new[i], sampling=sampling[i], seed=i, on_token=got[i].append))
        for i in range(3)])
    gen.close()
    assert results == ["length"] * 3
    assert got == want
    assert max(gen.batch_sizes) >= 2  # decoded together at least once
    assert gen.cache.free_pages == gen.plan.num_pages  # every page came back


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_stop_token_and_a_raising_callback_end_only_their_request(model, overlap):
    prompts = _prompts(model, [30, 30, 30], seed=3)
    ref, _ = generate(model, [prompts[0]], max_new_tokens=8)
    stop = ref[0].tokens[2]
    gen = BatchedGenerator(model, token_budget=1024, max_batch=4, overlap=overlap)

    class Enough(Exception):
        pass

    def bail(token, seen=[]):  # noqa: B006 - ends its request after two tokens
        seen.append(token)
        if len(seen) == 2:
            raise Enough

    got = []
    results = run_concurrently([
        lambda: gen(prompts[0], max_new_tokens=8, stop_tokens=[stop], on_token=got.append),
        lambda: gen(prompts[1], max_new_tokens=8, on_token=bail),
        lambda: gen(prompts[2], max_new_tokens=6)])
    gen.close()
    assert results[0] == "stop" and got == ref[0].tokens[:ref[0].tokens.index(stop) + 1]
    assert isinstance(results[1], Enough)
    assert results[2] == "length"
    assert gen.cache.free_pages == gen.plan.num_pages


def test_requests_wait_for_pages_and_oversized_ones_fail_at_once(model):
    prompts = _prompts(model, [50, 60], seed=4)
    # room for one request at a time: 64 tokens = 4 pages of 16
    gen = BatchedGenerator(model, token_budget=64, max_batch=4)
    with pytest.raises(ValueError, match="raise the token budget"):
        gen(prompts[0], max_new_tokens=40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen(prompts[0], max_new_tokens=0)
    want = [generate(model, [p], max_new_tokens=4)[0][0].tokens for p in prompts]
    got = [[], []]
    results = run_concurrently([(lambda i=i: gen(prompts[i], max_new_tokens=4, on_token=got[i].append))
                                 for i in range(2)])
    gen.close()
    assert results == ["length", "length"] and got == want
    assert max(gen.batch_sizes) == 1  # never both in the cache
    with pytest.raises(RuntimeError, match="closed"):
        gen(prompts[0], max_new_tokens=2)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "whole-prefill"])
def test_running_requests_decode_between_a_long_prompts_chunks(model, interleave):
    """A long prompt arriving while a request decodes: with interleaving the running request gets a token after
    each of the new prompt's chunks but the last (its first token comes in that chunk's forward), without it none
    until the prefill is done; both requests' tokens equal `generate`'s."""
    short, long = _prompts(model, [10, 7 * 16 + 5], seed=6)  # the long prompt: 8 chunks of 16
    want = [generate(model, [p], max_new_tokens=n)[0][0].tokens for p, n in ((short, 24), (long, 3))]
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, chunk_size=16, interleave_prefill=interleave)
    events = []
    started = threading.Event()
    got = [[], []]

    def on_short(tok):
        got[0].append(tok)
        events.append("short")
        if len(got[0]) == 2:  # the long prompt is sent once this one decodes
            started.set()

    def run_long():
        started.wait(60)
        return gen(long, max_new_tokens=3, on_token=lambda t: got[1].append(t) or events.append("long"),
                   on_cached=lambda _n: events.append("admitted"))

    results = run_concurrently([lambda: gen(short, max_new_tokens=24, on_token=on_short), run_long])
    gen.close()
    assert results == ["length", "length"] and got == want
    window = events[events.index("admitted"):events.index("long")]
    assert window.count("short") == (7 if interleave else 0), events


def test_a_prefill_group_joins_the_running_batch_at_once(model):
    """Three requests admitted together, one prefill chunk each: each samples its first token when its chunk is
    done, but they join the running request's decode batch together, so the batch (and its CUDA graph on a GPU)
    changes once, not after every chunk; the running request decodes between the chunks."""
    prompts = _prompts(model, [16, 16, 16, 9], seed=7)
    gen = BatchedGenerator(model, token_budget=1024, max_batch=4, chunk_size=16)
    admitted = threading.Event()

    def ask(i):
        admitted.wait(60)
        gen(prompts[i], max_new_tokens=3)

    results = run_concurrently([lambda: gen(prompts[3], max_new_tokens=12, on_token=hold_until_queued(gen, 3),
                                             on_cached=lambda _n: admitted.set())]
                                + [(lambda i=i: ask(i)) for i in range(3)])
    gen.close()
    assert results == ["length"] + [None] * 3
    assert set(gen.batch_sizes) == {1, 4}, gen.batch_sizes  # never 2 or 3: the group joined at once
    assert gen.batch_sizes[4] == 2  # each group request: its first token from prefill, two decode steps


def test_a_short_prompt_does_not_wait_for_a_long_ones_prefill(model):
    """A short request arriving while a long prompt prefills forms its own group and prefills beside it: its first
    token comes before the long prompt's. Both give `generate`'s tokens."""
    long, short = _prompts(model, [7 * 16 + 5, 9], seed=8)  # 8 chunks of 16; 1
    want = [generate(model, [p], max_new_tokens=3)[0][0].tokens for p in (long, short)]
    gen = BatchedGenerator(model, token_budget=1024, max_batch=4, chunk_size=16)
    admitted, events, got = threading.Event(), [], [[], []]
    hold = hold_until_queued(gen, 1)

    def on_long_admitted(n):
        admitted.set()
        hold(n)  # the worker goes on once the short request is queued

    def ask_short():
        admitted.wait(60)
        return gen(short, max_new_tokens=3, on_token=lambda t: got[1].append(t) or events.append("short"))

    results = run_concurrently([lambda: gen(long, max_new_tokens=3, on_cached=on_long_admitted,
                                             on_token=lambda t: got[0].append(t) or events.append("long")),
                                 ask_short])
    gen.close()
    assert results == ["length", "length"] and got == want
    assert events.index("short") < events.index("long"), events


def test_max_batch_is_respected(model):
    prompts = _prompts(model, [20] * 5, seed=5)
    gen = BatchedGenerator(model, token_budget=2048, max_batch=2)
    results = run_concurrently([(lambda p=p: gen(p, max_new_tokens=3)) for p in prompts])
    gen.close()
    assert results == ["length"] * 5
    assert max(gen.batch_sizes) <= 2


def test_bad_arguments():
    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name("m3-tiny")).eval()
    with pytest.raises(ValueError, match="max_batch"):
        BatchedGenerator(model, token_budget=64, max_batch=0)
    with pytest.raises(ValueError, match="chunk_size"):
        BatchedGenerator(model, token_budget=64, chunk_size=0)


@pytest.mark.parametrize("per_step", [1, 8])
def test_prefill_chunks_per_step_bounds_a_running_requests_gaps(model, monkeypatch, per_step):
    """Three long prompts arriving one after another (three prefill groups) while a request decodes: with one
    prefill chunk per decode step (the default) the groups take turns and the running request never waits for
    two chunk forwards in a row; with 8 per step every group runs a chunk before each decode step. All requests
    give `generate`'s tokens."""
    import openm3.engine.batching as batching

    short = _prompts(model, [9], seed=11)[0]
    longs = _prompts(model, [60, 61, 62], seed=12)  # 4 chunks of 16 each
    want_short = generate(model, [short], max_new_tokens=30)[0][0].tokens
    want_long = [generate(model, [p], max_new_tokens=2)[0][0].tokens for p in longs]
    events = []
    real = batching.prefill_chunks

    def counted(*args, **kwargs):
        for item in real(*args, **kwargs):
            events.append("chunk")
            yield item

    monkeypatch.setattr(batching, "prefill_chunks", counted)
    gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=16, prefill_chunks_per_step=per_step)
    got_short, got_long, senders, finished = [], [[], [], []], [], []

    def send(i):
        finished.append(gen(longs[i], max_new_tokens=2, on_token=got_long[i].append))

    def on_short(tok):
        got_short.append(tok)
        events.append("token")
        if 2 <= len(got_short) <= 4:  # one long prompt per round: each is admitted as its own group
            senders.append(threading.Thread(target=send, args=(len(got_short) - 2,)))
            senders[-1].start()
            hold_until_queued(gen, 1)(tok)

    assert gen(short, max_new_tokens=30, on_token=on_short) == "length"
    for t in senders:
        t.join(60)
    gen.close()
    assert finished == ["length"] * 3
    assert got_short == want_short and got_long == want_long
    running = events[:len(events) - events[::-1].index("token")]  # until the short request's last token
    runs = [len(r) for r in "".join("c" if e == "chunk" else " " for e in running).split()]
    if per_step == 1:
        assert max(runs) == 1, events
    else:
        assert max(runs) >= 2, events


def test_metrics_carry_the_decode_graphs_counters(model):
    """With decode graphs (CUDA) the metrics carry their counters; without them (CPU) no graph metric shows."""
    from types import SimpleNamespace

    gen = BatchedGenerator(model, token_budget=256, max_batch=2)
    try:
        assert gen.graphs is None and not any(m[0].startswith("cuda_graph") for m in gen.metrics())
        gen.graphs = SimpleNamespace(captures=2, replays=30, rebinds=5, eager_steps=3)  # what DecodeGraphs counts
        got = {name: value for name, _, _, value in gen.metrics() if name.startswith("cuda_graph")}
        assert got == {"cuda_graph_captures_total": 2, "cuda_graph_replays_total": 30,
                       "cuda_graph_rebinds_total": 5, "cuda_graph_eager_steps_total": 3}
    finally:
        gen.graphs = None
        gen.close()


def test_overlapped_steps_give_plain_steps_tokens_and_logprobs(model):
    """overlap=True: requests joining a running batch at different steps (the fed tokens partly on the device,
    partly from the host), greedy and sampled ones, log probabilities, a stop token seen one step late (that row
    dropped) and a constrained request beside (its steps run plainly): the tokens, log probabilities and finish
    reasons of overlap=False, and every page back."""
    from openm3.engine.constrained import GrammarConstraint, TokenBytes, TransitionCache

    class Short:  # 1 to 3 tokens of any bytes, then the stop token
        start = 0

        def advance(self, state, data):
            return state + 1 if state < 3 else None

        def complete(self, state):
            return state >= 1

        def can_continue(self, state):
            return state < 3

    prompts = _prompts(model, [70, 9, 40, 25], seed=7)
    stop = generate(model, [prompts[1]], max_new_tokens=6)[0][0].tokens[3]
    vocab = TokenBytes([bytes([65 + t % 26]) for t in range(model.config.vocab_size)])
    runs = []
    for overlap in (False, True):
        gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=16, overlap=overlap)
        tokens, logprobs = [[] for _ in prompts], [[] for _ in prompts]
        asks = [dict(max_new_tokens=10, logprobs=2), dict(max_new_tokens=9, stop_tokens=[stop]),
                dict(max_new_tokens=7, sampling=SamplingParams(temperature=0.9, top_k=30), seed=5, logprobs=0),
                dict(max_new_tokens=6)]
        finishes = run_concurrently([
            (lambda i=i: gen(prompts[i], on_token=tokens[i].append,
                             **({"on_logprobs": lambda lp, top, i=i: logprobs[i].append(
                                 (lp, [t for t, _ in top]))} if "logprobs" in asks[i] else {}),
                             **asks[i])) for i in range(4)])
        gen.close()
        assert gen.cache.free_pages == gen.plan.num_pages
        constrained = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=16, overlap=overlap)
        both = [[], []]
        pair = run_concurrently([
            lambda: constrained(prompts[0], max_new_tokens=8, on_token=both[0].append),
            lambda: constrained(prompts[2], max_new_tokens=8, stop_tokens=[stop], on_token=both[1].append,
                                constraint=GrammarConstraint(TransitionCache(Short(), vocab), [stop]))])
        constrained.close()
        runs.append((finishes, tokens, logprobs, pair, both, gen.steps))
    (f0, t0, l0, p0, b0, s0), (f1, t1, l1, p1, b1, s1) = runs
    assert f1 == f0 and "stop" in f0 and "length" in f0
    assert t1 == t0 and all(l0[i] for i in (0, 2))
    # a batch's rows may round differently as the batch forms at other steps: values within fp32 rounding
    assert [[top for _, top in r] for r in l1] == [[top for _, top in r] for r in l0]
    assert [lp for r in l1 for lp, _ in r] == pytest.approx([lp for r in l0 for lp, _ in r], abs=1e-4)
    assert p1 == p0 and b1 == b0 and b0[1][-1] == stop
    assert s0 > 0 and s1 > 0  # (how many steps depends on when the requests joined: not compared)


def test_overlap_defaults_follow_the_device(model):
    """Overlapped steps are on by default where the model is on a CUDA device (CPU: off); `--overlap` /
    `--no-overlap` of `openm3 generate` and `openm3 serve` override the default, which they leave as None."""
    from openm3.engine.generate import build_parser as generate_parser
    from openm3.serve.cli import build_parser as serve_parser

    assert BatchedGenerator(model, token_budget=64).overlap is False
    assert BatchedGenerator(model, token_budget=64, overlap=True).overlap is True
    for parser, base in ((generate_parser(), ["--preset", "m3-tiny", "--random-prompt", "8"]),
                         (serve_parser(), ["--preset", "m3-tiny"])):
        assert parser.parse_args(base).overlap is None
        assert parser.parse_args(base + ["--overlap"]).overlap is True
        assert parser.parse_args(base + ["--no-overlap"]).overlap is False


def test_a_request_whose_pick_fails_fails_alone_and_an_unforeseen_failure_ends_all_in_flight(model):
    """A sampling failure (here a picker that raises, as `torch.multinomial` does on non-finite logits) fails its
    own request; a failure outside every narrower handler fails the admitted requests instead of leaving their
    callers waiting on a dead worker, and the worker serves the next request."""
    from openm3.engine.penalties import Penalties, PenalizedPicker

    class Exploding(PenalizedPicker):
        def pick(self, row, sampling, gen):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    prompts = _prompts(model, [20, 24], seed=9)
    want = generate(model, [prompts[1]], max_new_tokens=6)[0][0].tokens
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2)
    got = []
    results = run_concurrently([
        lambda: gen(prompts[0], max_new_tokens=6, constraint=Exploding(Penalties(presence=0.5), prompts[0])),
        lambda: gen(prompts[1], max_new_tokens=6, on_token=got.append)])
    assert isinstance(results[0], RuntimeError) and "inf, nan" in str(results[0])
    assert results[1] == "length" and got == want

    real, calls = gen._decode, []

    def broken():  # fails once, at the first step that decodes both requests
        if len(gen._running) == 2 and not calls:
            calls.append(1)
            raise RuntimeError("a bug in the step")
        real()

    gen._decode = broken
    results = run_concurrently([lambda: gen(prompts[0], max_new_tokens=40), lambda: gen(prompts[1], max_new_tokens=40)])
    assert [str(r) for r in results] == ["a bug in the step"] * 2
    assert gen(prompts[1], max_new_tokens=6, on_token=(again := []).append) == "length" and again == want
    gen.close()
    assert gen.cache.free_pages == gen.plan.num_pages
