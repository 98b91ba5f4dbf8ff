"""Holding `BatchedGenerator`'s worker at a known point, calls from several threads at once, and the tiny model
and prompts they run (shared by CPU tests; not a test module)."""

from __future__ import annotations

import threading
import time

import torch

from openm3.models import M3TextConfig, M3TextModel


def tiny_model() -> M3TextModel:
    """The tiny random text model the batching tests run (seed 0, two kept index blocks)."""
    torch.manual_seed(0)
    return M3TextModel(M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)).eval()


def random_prompts(model, lens, seed=1) -> list[list[int]]:
    """Random prompts of the given lengths over the model's vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]


def run_concurrently(calls):
    """Runs the zero-argument callables in threads; returns their results (or exceptions) in order."""
    out = [None] * len(calls)

    def run(i):
        try:
            out[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return out


def hold_until_queued(batcher, n: int):
    """An `on_token` (or `on_cached`) callback that, at its first call, keeps the worker (which calls it) waiting
    until `n` requests are queued in the batcher's inbox (at most 60 s): the worker's next round admits them
    together, as one prefill group."""
    held = []

    def on_token(_value: int) -> None:
        if not held:
            held.append(1)
            deadline = time.monotonic() + 60
            while batcher._inbox.qsize() < n and time.monotonic() < deadline:
                time.sleep(0.01)

    return on_token
