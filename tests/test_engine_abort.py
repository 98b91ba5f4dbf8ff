"""Aborting requests of `BatchedGenerator` (`abort=`, an event its caller sets when nobody waits for the answer any
more): a waiting request ends without being admitted, a prefill ends between two chunks, a running request before
its next token; each returns 'abort', its pages go back, and the requests beside it are not disturbed. Also the
order waiting requests are admitted in (`scheduling='priority'`)."""

from __future__ import annotations

import threading

import pytest

from openm3.engine import generate
from openm3.engine.batching import BatchedGenerator
from openm3.engine.sampling import SamplingParams

from batching_utils import random_prompts, tiny_model, hold_until_queued, run_concurrently


@pytest.fixture(scope="module")
def model():
    return tiny_model()


_prompts = random_prompts


def _counting_chunks(monkeypatch, on_chunk):
    """Makes the batcher's prefill call `on_chunk(n)` after its n-th chunk forward (in the worker thread); returns
    the list of the chunks' prompt tokens, filled as they run."""
    import openm3.engine.batching as batching

    real, consumed = batching.prefill_chunks, []  # the prompt tokens of each chunk

    def counted(*args, **kwargs):
        for item in real(*args, **kwargs):
            consumed.append(item.consumed)
            on_chunk(len(consumed))
            yield item

    monkeypatch.setattr(batching, "prefill_chunks", counted)
    return consumed


def test_a_waiting_request_aborted_is_never_admitted(model):
    first, second = _prompts(model, [20, 30], seed=2)
    want = generate(model, [first], max_new_tokens=30)[0][0].tokens
    gen = BatchedGenerator(model, token_budget=1024, max_batch=1)  # the second request waits for the first
    abort, ended_while_running, got = threading.Event(), [], []
    sender = []

    def send_second():
        return gen(second, max_new_tokens=5, abort=abort)

    def on_first(tok):
        got.append(tok)
        if len(got) == 2:
            sender.append(run_in_thread(send_second))
            hold_until_queued(gen, 1)(tok)  # it is in the inbox: the worker moves it to the waiting queue
        elif len(got) == 4:
            abort.set()
        elif len(got) == 25:
            ended_while_running.append(sender[0].done.is_set())

    assert gen(first, max_new_tokens=30, on_token=on_first) == "length"
    sender[0].join()
    gen.close()
    assert sender[0].result == "abort"
    assert ended_while_running == [True]  # it did not wait for the first request to end
    assert got == want
    assert gen.prompt_tokens == len(first)  # never admitted: its prompt was not prefilled
    assert gen.finished == {"length": 1, "abort": 1}
    assert gen.cache.free_pages == gen.plan.num_pages


def test_a_prefill_aborted_between_chunks_stops_and_files_what_it_computed(model, monkeypatch):
    """An 8-chunk prompt aborted after its third chunk: no fourth chunk runs, and with prefix caching the pages
    it computed serve a later request with the same prompt (whose tokens are `generate`'s)."""
    (prompt,) = _prompts(model, [7 * 16 + 5], seed=3)
    abort = threading.Event()
    chunks = _counting_chunks(monkeypatch, lambda n: n == 3 and abort.set())
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, chunk_size=16)
    got = []
    assert gen(prompt, max_new_tokens=4, on_token=got.append, abort=abort) == "abort"
    assert len(chunks) == 3 and got == []
    assert gen.cache.free_pages == gen.plan.num_pages
    cached = []
    again = []
    assert gen(prompt, max_new_tokens=4, on_token=again.append, on_cached=cached.append) == "length"
    gen.close()
    assert cached == [48]  # the three chunks' full pages
    assert again == generate(model, [prompt], max_new_tokens=4)[0][0].tokens


def test_one_aborted_request_of_a_prefill_group_leaves_it_and_the_others_finish(model, monkeypatch):
    lead, a, b = _prompts(model, [9, 40, 45], seed=4)
    want_b = generate(model, [b], max_new_tokens=6)[0][0].tokens
    abort = threading.Event()
    # chunk 1 is the lead's prompt; then a and b prefill as one group, 32 tokens per chunk; a is aborted after
    # chunk 2: the group's later chunks hold b's prompt alone
    chunks = _counting_chunks(monkeypatch, lambda n: n == 2 and abort.set())
    gen = BatchedGenerator(model, token_budget=2048, max_batch=4, chunk_size=32)
    got_a, got_b = [], []
    results = []

    def on_lead(tok, held=hold_until_queued(gen, 2)):
        if not results:
            results.append(None)
            threads = [run_in_thread(lambda: gen(a, max_new_tokens=6, on_token=got_a.append, abort=abort)),
                       run_in_thread(lambda: gen(b, max_new_tokens=6, on_token=got_b.append))]
            results[0] = threads
            held(tok)

    assert gen(lead, max_new_tokens=12, on_token=on_lead) == "length"
    for t in results[0]:
        t.join()
    gen.close()
    assert [t.result for t in results[0]] == ["abort", "length"]
    assert got_a == [] and got_b == want_b
    # b's prompt ran whole, a's only in part (chunk 2 holds the first 32 tokens of whichever came first)
    assert len(lead) + len(b) <= sum(chunks) < len(lead) + len(b) + len(a)
    assert gen.cache.free_pages == gen.plan.num_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_running_request_aborted_ends_before_its_next_token(model, overlap):
    prompts = _prompts(model, [25, 30], seed=5)
    want = [generate(model, [p], max_new_tokens=20)[0][0].tokens for p in prompts]
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2, overlap=overlap)
    abort, got = threading.Event(), [[], []]

    def on_first(tok):
        got[0].append(tok)
        if len(got[0]) == 5:
            abort.set()

    results = run_concurrently([
        lambda: gen(prompts[0], max_new_tokens=20, on_token=on_first, abort=abort),
        lambda: gen(prompts[1], max_new_tokens=20, on_token=got[1].append)])
    gen.close()
    assert results == ["abort", "length"]
    assert got[0] == want[0][:5] and got[1] == want[1]
    assert gen.cache.free_pages == gen.plan.num_pages


def test_an_abort_set_before_the_call_returns_at_once(model):
    gen = BatchedGenerator(model, token_budget=1024, max_batch=2)
    abort = threading.Event()
    abort.set()
    got = []
    assert gen(_prompts(model, [30])[0], max_new_tokens=5, on_token=got.append, abort=abort) == "abort"
    gen.close()
    assert got == [] and gen.prompt_tokens == 0 and gen.steps == 0


class _Thread(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.done = fn, None, threading.Event()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001
            self.result = e
        self.done.set()

    def join(self, timeout=120):
        super().join(timeout)


def run_in_thread(fn) -> _Thread:
    t = _Thread(fn)
    t.start()
    return t


def test_the_one_request_backend_aborts_between_prefill_chunks_and_tokens(model, monkeypatch):
    """`openm3 serve --max-batch 1`'s backend (`ModelBackend`, one `generate` per request) takes `abort` too."""
    from openm3.serve.app import ModelBackend

    import openm3.engine.scheduler as scheduler

    (prompt,) = _prompts(model, [7 * 16 + 5], seed=7)
    backend = ModelBackend(model, chunk_size=16)
    forwards, abort = [], threading.Event()
    real = scheduler._forward

    def counted(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 3:
            abort.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler, "_forward", counted)
    got = []
    common = dict(sampling=SamplingParams(), stop_tokens=[], seed=0)
    assert backend(prompt, max_new_tokens=4, on_token=got.append, abort=abort, **common) == "abort"
    assert len(forwards) == 3 and got == []  # the prompt's 8 chunks stopped after the third
    monkeypatch.setattr(scheduler, "_forward", real)
    abort.clear()

    def stop_after_two(tok):
        got.append(tok)
        if len(got) == 2:
            abort.set()

    assert backend(prompt, max_new_tokens=6, on_token=stop_after_two, abort=abort, **common) == "abort"
    assert got == generate(model, [prompt], max_new_tokens=6)[0][0].tokens[:2]
    assert backend(prompt, max_new_tokens=2, on_token=got.append, abort=abort, **common) == "abort"  # set before
    with pytest.raises(ValueError, match="chunk_size"):
        ModelBackend(model, chunk_size=0)


def test_priority_scheduling_admits_lower_values_first(model):
    """scheduling='priority' (vLLM's --scheduling-policy priority): with one place in the batch, of two waiting
    requests the one with the lower `priority` runs first though it came second; 'fcfs' refuses priorities."""
    lead, late, urgent = _prompts(model, [12, 14, 16], seed=11)
    gen = BatchedGenerator(model, token_budget=1024, max_batch=1, scheduling="priority")
    order, threads = [], []

    def on_lead(tok, held=[]):  # noqa: B006 - queues the two others while the lead decodes
        if not held:
            held.append(1)
            threads.append(run_in_thread(lambda: gen(late, max_new_tokens=2, priority=5,
                                                     on_token=lambda t: order.append("late"))))
            hold_until_queued(gen, 1)(tok)
            threads.append(run_in_thread(lambda: gen(urgent, max_new_tokens=2, priority=-1,
                                                     on_token=lambda t: order.append("urgent"))))
            hold_until_queued(gen, 2)(tok)  # both in the inbox before the worker goes on

    assert gen(lead, max_new_tokens=4, on_token=on_lead) == "length"
    for t in threads:
        t.join()
    gen.close()
    assert [t.result for t in threads] == ["length", "length"]
    assert order == ["urgent", "urgent", "late", "late"]
    fcfs = BatchedGenerator(model, token_budget=1024, max_batch=1)
    with pytest.raises(ValueError, match="priority"):
        fcfs(lead, max_new_tokens=2, priority=1)
    with pytest.raises(ValueError, match="scheduling"):
        BatchedGenerator(model, token_budget=1024, scheduling="lifo")
