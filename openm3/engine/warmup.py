"""Compiling ahead of the first requests: a server whose decoder layers run under `torch.compile` (`openm3 serve
--compile`) would otherwise compile while its first requests wait, and again at the first step with a new kind of
shape. `torch.compile(dynamic=True)` keeps one graph for every batch size but specializes size 1, so a batch of one
sequence (its decode steps have one row) compiles apart from the rest: session 33 measured a staggered round at max
batch 4 taking 11.6 s under `--compile` (90 tokens/s) against 3.9 s without, because batch 1 and the smaller
shapes compiled in it, while a max-batch-16 round ran 1.38x faster than without.

`warm_up(backend, vocab_size, max_batch)` runs a few short greedy requests of random tokens through the backend
before it serves: one alone (a one-sequence prefill and one-row decode steps), then up to three at once (the
general shapes); CUDA graphs for those step shapes are captured on the way. A `BatchedGenerator`'s request
counters and speculation gates are put back afterwards, so `/metrics` and the gates see only real requests.
"""

from __future__ import annotations

import threading
import time

import torch

from .sampling import SamplingParams, check_count

__all__ = ["warm_up"]

# prompt lengths: odd and unequal, so no size happens to equal another and get compiled as the same symbol
_ALONE = (7,)
_TOGETHER = (11, 13, 17)


def warm_up(backend, vocab_size: int, max_batch: int, *, max_total_tokens: int | None = None, new_tokens: int = 3,
            seed: int = 0) -> float:
    """Runs the warm-up requests through `backend` (a `BatchedGenerator`, or anything called like one, as
    `openm3.serve.app.ModelBackend`); returns the seconds it took. `max_batch` 1: only the request alone.
    max_total_tokens: the most a request may hold (prompt + new tokens); the warm-up's stay within it."""
    check_count("max_batch", max_batch)
    check_count("new_tokens", new_tokens)
    if max_total_tokens is not None:
        if not isinstance(max_total_tokens, int) or max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be an int >= 2, got {max_total_tokens!r}")
        new_tokens = min(new_tokens, max_total_tokens - 1)
    longest = None if max_total_tokens is None else max_total_tokens - new_tokens
    gen = torch.Generator().manual_seed(seed)
    saved = backend.counters() if hasattr(backend, "counters") else None
    start = time.perf_counter()
    rounds = [_ALONE] + ([_TOGETHER[:max_batch]] if max_batch > 1 else [])
    for lengths in rounds:
        prompts = [torch.randint(0, vocab_size, (min(n, longest or n),), generator=gen).tolist() for n in lengths]
        _run_together(backend, prompts, new_tokens)
    if saved is not None:
        backend.restore_counters(saved)
    return time.perf_counter() - start


def _run_together(backend, prompts: list[list[int]], new_tokens: int) -> None:
    """Each prompt's request from its own thread, started together; re-raises the first request's error."""
    errors: list[BaseException] = []

    def one(prompt: list[int]) -> None:
        try:
            backend(prompt, max_new_tokens=new_tokens, sampling=SamplingParams(), stop_tokens=(), seed=0,
                    on_token=lambda _t: None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,), name="openm3-warm-up") for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"the warm-up request failed: {errors[0]}") from errors[0]
