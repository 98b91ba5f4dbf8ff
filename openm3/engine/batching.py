"""Continuous batching: generation requests from many threads, decoded together.

`BatchedGenerator(model, token_budget=...)` owns one paged cache and a worker thread. Each call

    finish_reason = gen(prompt_ids, max_new_tokens=..., sampling=..., stop_tokens=..., seed=..., on_token=fn,
                        images=None)

blocks its caller until that request ends, while the worker runs all admitted requests together: it admits waiting
requests whose pages fit (first come, first served, or by priority; a request waits while the cache is full and
fails at once if it could never fit), prefills them in chunks, and decodes one token for every running request per
step (one forward for the whole batch; CUDA graphs on a GPU, as in `generate`). Prefill chunks and decode steps
alternate, so a long prompt that arrives delays the running requests' next tokens by one chunk's forward at a
time, not by its whole prefill (`interleave_prefill=False` runs each prefill whole first). Requests admitted
together form a prefill group, which joins the decode batch when its last prompt is done; groups admitted later
prefill beside earlier ones, taking turns, so a short prompt does not wait for a long one. While requests decode,
at most `prefill_chunks_per_step` chunk forwards (default 1) run between two decode steps, however many groups
prefill, so a running request's longest gap is one chunk's forward. A request leaves the
batch after a stop token or `max_new_tokens`, or when its `on_token` raises (the exception is re-raised in its
caller), and its pages go back to the pool at once. A caller that gives up on a request (a client gone, a
cancelled job) sets its `abort` event: the request ends with finish reason 'abort' wherever it is, before its
admission if it still waits, between two prefill chunks (its prompt leaves its group's next forwards) or before
its next token, so a prompt nobody waits for any more is not prefilled.

Prefix caching (on by default, `prefix_caching=False` turns it off; `openm3.engine.cache`): every full page a
request wrote, its prompt's and its answer's, stays cached after it ends until the memory is needed, and a later
request whose prompt starts with the same tokens (and the same images) prefills only the rest. An agent's
conversation resends its whole history each turn; with the cache each turn computes only what is new.
`on_cached(n)` tells a caller how many prompt tokens came from the cache.

Speculative decoding (`speculative=SpeculativeConfig(...)`, off by default; `openm3.engine.speculative`): before a
decode step each request looks up n-gram drafts in its own tokens, and a step that has some feeds every request
its last token and `num_speculative_tokens` drafts, keeping those the model's logits confirm: greedy requests get
the tokens plain decoding gives, sampled ones tokens of the same distribution.

Overlapped steps (`overlap`, on by default on a GPU): where no request of the batch speculates or has a constraint,
each decode step is launched with the last step's tokens still on the device (sampled there with each request's
own generator) and the host reads that step's tokens back and hands them over while the GPU runs the next one. The
tokens are the same as without it; a request that stops on a token has a row in the step launched before the host
saw it, which is dropped. (m3-small, 8 requests of 2K-token prompts and 256 new tokens on an H100: +4% to +11%
tokens/s with the prefill included.)

Each request samples with its own generator seeded by `seed`, so its tokens equal `generate(model, [prompt],
seed=seed, ...)`'s up to the float rounding of a batched forward (sampled requests: without speculation). Over a
VL model (`M3ForConditionalGeneration`) a request may carry its images (`images=(pixel_values, grid_thw)`); its
prompt is embedded once when its prefill starts, and it decodes beside text requests as one of them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from ..ops.host import to_device
from .cache import CacheFullError, CacheLayout, PagedCache, page_keys, plan_cache
from .constrained import GrammarConstraint
from .penalties import PenalizedPicker
from .generate import LaunchedStep, check_constraints, check_prompts, check_stop_tokens
from .graphs import DecodeGraphs
from .sampling import (SamplingParams, check_count, check_logprobs, check_run, plain_int, prompt_rows_logprobs,
                       sample, token_logprobs)
from .spec_gate import SpeculationGate
from .speculative import PREDICTION_DRAFTS, SpeculativeConfig, TokenHistory, keep_verified, step_drafts
from .scheduler import (PromptImages, check_images, check_inference_model, decode_step, is_vision_language,
                        prefill_chunks, text_model)

__all__ = ["BatchedGenerator"]


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: torch.Tensor
    max_new_tokens: int
    sampling: SamplingParams
    stop_tokens: frozenset
    on_token: Callable[[int], None]
    gen: torch.Generator
    images: PromptImages | None = None
    salt: bytes = b""  # what besides the ids decides its pages (its images' digest)
    keys: list = dataclasses.field(default_factory=list)  # page_keys of its prompt's full pages (prefix caching)
    on_cached: Callable[[int], None] | None = None
    logprobs: int | None = None  # top alternatives per token for on_logprobs (None: no log probabilities)
    on_logprobs: Callable[[float, list], None] | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt token for on_prompt_logprobs
    on_prompt_logprobs: Callable[[list], None] | None = None
    prompt_entries: list = dataclasses.field(default_factory=list)  # PromptLogprob of prompt tokens 1..L-1
    constraint: GrammarConstraint | PenalizedPicker | None = None  # picks its tokens (grammar, penalties)
    abort: threading.Event | None = None  # set by the caller: end the request where it is (finish 'abort')
    priority: int = 0  # with scheduling='priority': lower values are admitted first
    arrival: int = 0  # order of arrival (ties of priority)
    outputs: list = dataclasses.field(default_factory=list)  # sampled tokens
    history: TokenHistory | None = None  # prompt + outputs, where speculative drafts are looked up
    prefilled: bool = False
    id: int = -1
    produced: int = 0
    last: int = -1
    finish: str | None = None
    error: BaseException | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(eq=False)
class _Group:
    """Requests admitted together and their prefill's `prefill_chunks` iterator (one forward per `next`); the
    positions of those aborted mid-prefill, which its next forwards leave out."""

    requests: list
    chunks: Iterator
    dropped: set = dataclasses.field(default_factory=set)

    def prefilled(self) -> bool:
        """Every request's prompt is done or left out."""
        return all(req.prefilled or b in self.dropped for b, req in enumerate(self.requests))


class BatchedGenerator:
    """Continuous batching over one model and one paged cache (see the module docstring).

    token_budget: tokens the cache is planned for (all running requests' prompt + max_new_tokens together);
    max_batch: most requests decoded together; chunk_size: prefill tokens per forward; index_dtype: as in
    `generate`; cuda_graphs: decode steps through CUDA graphs (default: on when the model is on a CUDA device);
    prefix_caching: reuse cached pages of earlier requests' prompts and answers; interleave_prefill: decode steps
    between prefill chunks; prefill_chunks_per_step: prefill forwards between two decode steps while requests decode
    (groups take turns); speculative: n-gram speculative decoding (see the module docstring);
    prediction_speculative: where `speculative` is None, the speculation of requests with a predicted output
    (`draft_context`; default `speculative.PREDICTION_DRAFTS`, adaptive), None: such requests decode plainly.
    scheduling: 'fcfs' (default) admits waiting requests in their order of arrival; 'priority' (vLLM's
    `--scheduling-policy priority`) by their `priority` (lower first), then arrival; running requests are not
    preempted.
    model: an `M3TextModel` or an `M3ForConditionalGeneration` (`vl_config` is then its config, else None).
    The signature of a call is the `Backend` protocol of `openm3.serve`, `concurrent = True` tells the server not
    to serialise calls, `supports_logprobs` that it takes `logprobs=` / `on_logprobs=`, and `takes_predictions`
    that it takes `draft_context=`. overlap: launch each decode step before the host reads the last one's tokens
    (see the module docstring; None: on where the model is on a CUDA device).
    """

    concurrent = True
    takes_predictions = True  # `draft_context=`: a predicted output's tokens
    supports_abort = True  # `abort=`: an event that ends the request where it is
    supports_logprobs = True
    supports_constraints = True

    def __init__(self, model, *, token_budget: int, max_batch: int = 8, chunk_size: int = 8192, index_dtype=None,
                 cuda_graphs: bool | None = None, prefix_caching: bool = True, interleave_prefill: bool = True,
                 prefill_chunks_per_step: int = 1, speculative: SpeculativeConfig | None = None,
                 prediction_speculative: SpeculativeConfig | None = PREDICTION_DRAFTS, overlap: bool | None = None,
                 scheduling: str = "fcfs"):
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"scheduling must be 'fcfs' or 'priority', got {scheduling!r}")
        self.scheduling = scheduling
        token_budget, max_batch, chunk_size, prefill_chunks_per_step = map(
            plain_int, (token_budget, max_batch, chunk_size, prefill_chunks_per_step))  # numpy ints as ints
        for name, value in (("max_batch", max_batch), ("chunk_size", chunk_size),
                            ("prefill_chunks_per_step", prefill_chunks_per_step)):
            check_count(name, value)
        for name, value in (("speculative", speculative), ("prediction_speculative", prediction_speculative)):
            if value is not None and not isinstance(value, SpeculativeConfig):
                raise ValueError(f"{name} must be a SpeculativeConfig or None, got {type(value).__name__}")
        check_inference_model(model)  # a model in training mode would compute its indexer KL at every forward
        self.model = model
        self.text = text_model(model)
        self.config = self.text.config
        self.vl_config = model.config if is_vision_language(model) else None
        param = next(self.text.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.plan = plan_cache(CacheLayout.from_config(self.config), token_budget, kv_dtype=self.dtype,
                               index_dtype=index_dtype)
        self.prefix_caching = prefix_caching
        self.interleave_prefill = interleave_prefill
        self.prefill_chunks_per_step = prefill_chunks_per_step
        self.speculative = speculative
        self.gate = SpeculationGate() if speculative is not None and speculative.adaptive else None
        self.prediction_speculative = None if speculative is not None else prediction_speculative
        self.prediction_gate = SpeculationGate() if self.prediction_speculative is not None and \
            self.prediction_speculative.adaptive else None
        self.cache = PagedCache(self.plan, self.device, prefix_caching=prefix_caching)
        self.max_batch, self.chunk_size = max_batch, chunk_size
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self._launched: LaunchedStep | None = None  # the step launched ahead whose tokens are not handed over yet
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs = DecodeGraphs(self.text, self.cache) if use_graphs else None
        self.vocab_size = self.config.vocab_size
        self.steps = 0  # decode steps run
        self.batch_sizes: collections.Counter = collections.Counter()  # decode steps per batch size
        self.prompt_tokens = 0  # prompt tokens of admitted requests
        self.cached_tokens = 0  # of them, read from the prefix cache instead of computed
        self.generated_tokens = 0
        self.spec_steps = 0  # decode steps that verified drafts
        self.draft_tokens = 0  # drafts fed (a padded request's included)
        self.accepted_tokens = 0  # of them, confirmed by the model and kept
        self.finished: collections.Counter = collections.Counter()  # ended requests by reason (or 'error')
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque = collections.deque()
        self._running: list[_Request] = []
        self._groups: list[_Group] = []  # admitted requests whose prefill is under way, oldest first
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ callers' side

    def __call__(self, prompt: Sequence[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_tokens: Sequence[int] = (), seed: int = 0, on_token: Callable[[int], None] = lambda _t: None,
                 images: PromptImages | tuple | None = None, on_cached: Callable[[int], None] | None = None,
                 logprobs: int | None = None, on_logprobs: Callable[[float, list], None] | None = None,
                 prompt_logprobs: int | None = None, on_prompt_logprobs: Callable[[list], None] | None = None,
                 constraint: GrammarConstraint | PenalizedPicker | None = None,
                 draft_context: Sequence[int] | None = None, abort: threading.Event | None = None,
                 priority: int = 0) -> str:
        """Generates for one prompt (token ids), calling `on_token(id)` per sampled token in this request's order;
        returns 'stop' or 'length' when it ends, 'abort' when `abort` was set first (see the module docstring: the
        worker checks it before admitting the request, between prefill chunks and before each token). images:
        `(pixel_values, grid_thw)` of the prompt's image placeholders (VL models only). on_cached(n): called once,
        before the first token, with the number of prompt tokens the prefix cache held. logprobs (0-20) and
        on_logprobs(logprob, top): before each `on_token`, the token's log probability under the model and the
        `logprobs` most likely tokens as [(id, logprob)] (`sampling.token_logprobs`). prompt_logprobs (0-20) and
        on_prompt_logprobs(entries): once, before the first token, `sampling.PromptLogprob` (logprob, top, rank) of
        every prompt token after the first (the whole prompt is then computed, not read from the prefix cache).
        constraint: a `GrammarConstraint` (`openm3.engine.constrained`) or a `PenalizedPicker`
        (`openm3.engine.penalties`) that picks this request's tokens (structured outputs, logit bias and penalties;
        speculative drafts are kept while they equal its picks). draft_context: token ids the speculative drafts may
        also be looked up in (a predicted output; without `speculative`, this request looks drafts up with
        `prediction_speculative`, the others beside it do not).
        ValueError for a bad request or one that can never fit the cache; an exception raised by a callback ends
        the request and is re-raised here."""
        max_new_tokens, seed, logprobs, prompt_logprobs, priority = map(
            plain_int, (max_new_tokens, seed, logprobs, prompt_logprobs, priority))  # numpy ints as ints
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        check_run(sampling, seed, {"on_token": on_token, "on_cached": on_cached})
        if priority and self.scheduling != "priority":
            raise ValueError(f"priority: this generator admits first come, first served (scheduling='fcfs'); "
                             f"priority {priority} needs scheduling='priority'")
        (ids,) = check_prompts([prompt], self.vocab_size, max_new_tokens, self.config.max_position_embeddings)
        check_logprobs(logprobs, on_logprobs)
        check_logprobs(prompt_logprobs, on_prompt_logprobs, ("prompt_logprobs", "on_prompt_logprobs"))
        stop_tokens = check_stop_tokens(stop_tokens)
        check_constraints([constraint], 1, stop_tokens)
        (vision,) = check_images(self.model, [ids], None if images is None else [images])
        pages = self.cache.pages_for(ids.numel() + max_new_tokens)
        if pages > self.plan.num_pages:
            raise ValueError(f"a prompt of {ids.numel()} tokens + max_new_tokens={max_new_tokens} needs {pages} "
                             f"pages but the cache holds {self.plan.num_pages} "
                             f"({self.plan.token_capacity} tokens); raise the token budget")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        req = _Request(ids, max_new_tokens, sampling, frozenset(int(t) for t in stop_tokens), on_token, gen, vision,
                       on_cached=on_cached, logprobs=logprobs, on_logprobs=on_logprobs,
                       prompt_logprobs=prompt_logprobs, on_prompt_logprobs=on_prompt_logprobs,
                       constraint=constraint, abort=abort, priority=priority, arrival=next(self._arrivals))
        if self.prefix_caching:  # hashed here, in the caller's thread, not in the worker's
            req.salt = b"" if vision is None else vision.digest()
            req.keys = page_keys(ids, self.cache.layout.page_size, req.salt)
        if self.speculative is not None or (draft_context and self.prediction_speculative is not None):
            req.history = TokenHistory(ids, max_new_tokens, draft_context or ())
        self._start()
        self._inbox.put(req)
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.finish

    _COUNTERS = ("steps", "prompt_tokens", "cached_tokens", "generated_tokens", "spec_steps", "draft_tokens",
                 "accepted_tokens", "batch_sizes", "finished")

    def counters(self) -> dict:
        """A copy of the request counters that `metrics` reports (for `restore_counters`)."""
        return {name: getattr(self, name).copy() if isinstance(getattr(self, name), collections.Counter)
                else getattr(self, name) for name in self._COUNTERS}

    def restore_counters(self, saved: dict) -> None:
        """Puts the request counters back to `saved` (`counters()`) and forgets what the speculation gates
        measured since: after a warm-up, /metrics counts only real requests and the gates time only real
        steps (a warm-up's first steps include compilation)."""
        for name in self._COUNTERS:
            value = saved[name]
            setattr(self, name, value.copy() if isinstance(value, collections.Counter) else value)
        if self.gate is not None:
            self.gate = SpeculationGate()
        if self.prediction_gate is not None:
            self.prediction_gate = SpeculationGate()

    def close(self) -> None:
        """Stops the worker after the requests it holds have ended."""
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._inbox.put(None)
                self._thread.join()
                self._thread = None

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this BatchedGenerator was closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="openm3-batching", daemon=True)
                self._thread.start()

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        if self.device.type == "cuda":  # a new thread starts on device 0; graphs capture on the current device
            torch.cuda.set_device(self.device)
        stopping = False
        while True:
            idle = not self._running and not self._waiting and not self._groups
            if idle and stopping:
                return
            try:
                item = self._inbox.get(block=idle)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        self._waiting.append(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            try:
                self._drop_aborted()
                with torch.no_grad():
                    self._admit()
                    self._prefill_round()
                    if self._running or self._launched is not None:
                        self._decode()
            except Exception as e:  # noqa: BLE001 - unforeseen: fail what is in flight, keep serving
                self._fail_in_flight(e)

    def _fail_in_flight(self, error: BaseException) -> None:
        """Ends every admitted request with `error` (a failure no narrower handler caught), so no caller waits
        forever on a worker that died; the waiting requests stay queued and the worker goes on."""
        self._launched = None
        admitted = list(self._running) + [r for g in self._groups for r in g.requests]
        self._groups.clear()
        for req in admitted:
            if req.done.is_set():
                continue
            try:
                self._end(req, error=error)
            except Exception:  # noqa: BLE001 - its pages may be in an odd state: its caller still hears
                req.finish, req.error = None, error
                req.done.set()
        self._running.clear()

    def _drop_aborted(self) -> None:
        """Ends the waiting and running requests whose `abort` is set (prefill groups check theirs in `_prefill`,
        which also leaves their prompts out of the group's next forwards)."""
        kept, aborted = collections.deque(), []
        for req in self._waiting:  # one read of each event: one set meanwhile is seen next round, not lost
            (aborted if _aborted(req) else kept).append(req)
        if aborted:
            self._waiting = kept
            for req in aborted:
                self._end(req, finish="abort")
        for req in [r for r in self._running if _aborted(r)]:
            self._end(req, finish="abort")  # a row of it in a step launched ahead is dropped at hand-over

    def _admit(self) -> None:
        """Admits the waiting requests that fit as a new prefill group. With prefix caching, a request whose next
        uncached page a request being prefilled will compute waits until that page is cached: requests that share
        a long context and arrive together prefill it once."""
        new, deferred = [], []
        computing = {k for g in self._groups for req in g.requests if not req.prefilled for k in req.keys}
        room = self.max_batch - len(self._running) - sum(len(g.requests) for g in self._groups)
        page_size = self.cache.layout.page_size
        if self.scheduling == "priority" and len(self._waiting) > 1:
            self._waiting = collections.deque(sorted(self._waiting, key=lambda r: (r.priority, r.arrival)))
        while self._waiting and len(new) < room:
            req = self._waiting.popleft()
            length = req.prompt.numel()
            # the page of the prompt's last token is computed; all of it when its log probabilities are asked for
            reusable = [] if req.on_prompt_logprobs else req.keys[:(length - 1) // page_size]
            hit = self.cache.cached_prefix(reusable) if reusable else 0
            if hit < len(reusable) and reusable[hit] in computing:
                deferred.append(req)
                continue
            seq_id = next(self._ids)
            try:
                cached = self.cache.admit({seq_id: length + req.max_new_tokens},
                                          prefixes={seq_id: reusable} if reusable else None)[seq_id]
            except CacheFullError:
                self._waiting.appendleft(req)
                break  # first come, first served: it waits for pages
            req.id = seq_id
            computing.update(req.keys)
            self.prompt_tokens += length
            self.cached_tokens += cached
            new.append(req)
            if req.on_cached is not None:
                try:
                    req.on_cached(cached)
                except BaseException as e:  # noqa: BLE001 - as for on_token: the request ends, its caller sees it
                    new.remove(req)
                    self._end(req, error=e)
        self._waiting.extendleft(reversed(deferred))
        if new:
            dropped: set[int] = set()
            self._groups.append(_Group(new, prefill_chunks(
                self.model, self.cache, [r.id for r in new], [r.prompt for r in new], chunk_size=self.chunk_size,
                images=[r.images for r in new], all_logits=[r.on_prompt_logprobs is not None for r in new],
                dropped=dropped), dropped))

    def _prefill_round(self) -> None:
        """The prefill work before the next decode step: with requests decoding (and interleaving), at most
        `prefill_chunks_per_step` chunks, the groups taking turns; with none, a chunk of every group."""
        if not self._running or not self.interleave_prefill:
            for group in list(self._groups):
                self._prefill(group)
            return
        for _ in range(min(self.prefill_chunks_per_step, len(self._groups))):
            if not self._groups:
                break
            group = self._groups.pop(0)
            self._groups.append(group)  # its turn is taken: the next group's chunk comes next
            self._prefill(group)

    def _prefill(self, group: "_Group") -> None:
        """Runs a prefill group's next chunk (all of them without `interleave_prefill`). A request whose prompt is
        done samples its first token at once; the group joins the running batch when its last prompt is done, so
        the batch (and its CUDA graph) changes once per group while the running requests decode between chunks."""
        while True:
            for b, req in enumerate(group.requests):
                if _aborted(req) and not req.done.is_set():
                    self._end(req, finish="abort")
                if req.done.is_set():  # ended (its pages are gone): its prompt's next chunks are not run
                    group.dropped.add(b)
            if group.prefilled():  # the rest were dropped
                break
            try:
                chunk = next(group.chunks)
            except Exception as e:  # noqa: BLE001 - the group's unfinished requests fail, the worker goes on
                for req in group.requests:
                    if not req.prefilled:
                        self._end(req, error=e)
                break
            for b, (position, rows) in chunk.rows.items():  # row i predicts prompt token position + i + 1
                req = group.requests[b]
                targets = req.prompt[position + 1:position + 1 + rows.shape[0]]
                req.prompt_entries += prompt_rows_logprobs(rows[:targets.numel()], targets, req.prompt_logprobs)
            done = [group.requests[b] for b in chunk.finished]
            for req in done:
                req.prefilled, req.images = True, None  # embedded: the pixels are not needed any more
                if self.prefix_caching:
                    self.cache.register(req.id, req.keys)
            self._emit(done, chunk.logits)
            if group.prefilled():
                break
            if self.interleave_prefill:
                return
        self._running.extend(req for req in group.requests if req.prefilled and not req.done.is_set())
        self._groups.remove(group)

    def _decode(self) -> None:
        if self.overlap and self.speculative is None and all(
                r.constraint is None and r.history is None for r in self._running):
            self._decode_ahead()
            return
        self._hand_over_launched()
        if not self._running:
            return
        batch = list(self._running)
        ids = [r.id for r in batch]
        drafts, config, gate = None, self.speculative, self.gate
        if config is None and self.prediction_speculative is not None and any(r.history is not None for r in batch):
            config, gate = self.prediction_speculative, self.prediction_gate  # requests with a predicted output
        if config is not None:
            rooms = [self.cache.capacity(r.id) - self.cache.length(r.id) - 1 for r in batch]
            drafts = step_drafts([r.history for r in batch], rooms, config, gate, ids, [r.last for r in batch])
        fed = [[r.last] + (drafts[i] if drafts else []) for i, r in enumerate(batch)]
        # on the host: both step paths read the tokens there (made on the device, they cost a copy there and a
        # sync to read them back every step)
        feed = torch.tensor(fed if drafts else [f[0] for f in fed], dtype=torch.int64)
        lengths = [self.cache.length(i) for i in ids]
        t_step, had = time.perf_counter(), [len(r.outputs) for r in batch]
        warm = (self.graphs.captures, self.graphs.eager_steps) if self.graphs else None
        try:
            logits = self.graphs.step(ids, feed) if self.graphs else decode_step(self.text, self.cache, ids, feed)
        except Exception as e:  # noqa: BLE001
            for req in batch:
                self._end(req, error=e)
            return
        self.steps += 1
        self.batch_sizes[len(batch)] += 1
        accepted = 0
        if drafts is None:
            self._emit(batch, logits)
        else:
            self.spec_steps += 1
            kept_lists, accepted = keep_verified(self.cache, ids, lengths, logits, drafts,
                                                 [(r.sampling, r.gen, r.stop_tokens, r.max_new_tokens - r.produced,
                                                   r.constraint) for r in batch])
            self.draft_tokens += sum(len(d) for d in drafts)
            self.accepted_tokens += accepted
            for i, (req, kept) in enumerate(zip(batch, kept_lists)):
                for j, token in enumerate(kept):
                    if not self._give(req, token, logits[i, j]):
                        break
        if gate is not None:  # a step that ran eagerly or captured a graph tells nothing of the step's cost
            timed = warm is None or warm == (self.graphs.captures, self.graphs.eager_steps)
            gate.record(ids, [r.outputs[n:] for r, n in zip(batch, had)],
                        time.perf_counter() - t_step if timed else None, speculative=drafts is not None,
                        accepted=accepted)

    def _decode_ahead(self) -> None:
        """`_decode` for `overlap`: launches this step with the last launched step's tokens still on the device,
        then hands that step's tokens over (one host wait, behind this step) and keeps this one as launched. A
        request that the last step brings to max_new_tokens is left out of this step; one that it brings to a stop
        token is in it, and its row is dropped when handed over (the request has ended by then)."""
        last = self._launched
        row_of = {} if last is None else {req: i for i, req in enumerate(last.batch)}
        batch = [r for r in self._running if not (r in row_of and r.produced + 1 >= r.max_new_tokens)]
        launched = None
        if batch:
            ids = [r.id for r in batch]
            feed = self._ahead_feed(batch, last, row_of)
            captures = self.graphs.captures if self.graphs else 0
            try:
                logits = self.graphs.step(ids, feed) if self.graphs else decode_step(self.text, self.cache, ids, feed)
            except Exception as e:  # noqa: BLE001
                for req in batch:
                    self._end(req, error=e)
            else:
                self.steps += 1
                self.batch_sizes[len(batch)] += 1
                tokens = logits.argmax(dim=-1)
                for i, req in enumerate(batch):  # each with its own generator: the draws `_emit` makes
                    if not req.sampling.greedy:
                        tokens[i:i + 1] = sample(logits[i:i + 1], req.sampling, req.gen)
                launched = LaunchedStep.of(batch, tokens, logits,
                                           self.graphs is not None and self.graphs.captures > captures)
        self._hand_over_launched()
        self._launched = launched

    def _ahead_feed(self, batch: list[_Request], last: LaunchedStep | None, row_of: dict) -> torch.Tensor:
        """The tokens fed to `batch`: a request in the last launched step is fed the token sampled there (still
        on the device), one that joined since (prefilled) its `last` token, from the host."""
        if last is not None and all(r in row_of for r in batch):
            rows = [row_of[r] for r in batch]
            if rows == list(range(len(last.batch))):
                return last.tokens
            return last.tokens[to_device(torch.tensor(rows, dtype=torch.int64), last.tokens.device)]
        host = torch.tensor([r.last for r in batch], dtype=torch.int64)
        if last is None or not any(r in row_of for r in batch):
            return host
        device = last.tokens.device
        table = to_device(torch.tensor([[row_of.get(r, 0) for r in batch], [r in row_of for r in batch],
                                        host.tolist()], dtype=torch.int64), device)
        return torch.where(table[1].bool(), last.tokens[table[0]], table[2])

    def _hand_over_launched(self) -> None:
        """Waits for the step launched ahead (if any) and hands its tokens to its requests still running."""
        last, self._launched = self._launched, None
        if last is None:
            return
        for i, (req, token) in enumerate(zip(last.batch, last.host_tokens())):
            if not req.done.is_set():  # else it ended on its token of the step before: this row is dropped
                self._give(req, token, last.logits[i])

    def _emit(self, batch: list[_Request], logits: torch.Tensor) -> None:
        """Samples one token per request of `batch` from its logits row and hands it over (after its prompt's log
        probabilities, at its first token, when it asked for them)."""
        for req in [r for r in batch if r.on_prompt_logprobs is not None and not r.outputs]:
            try:
                req.on_prompt_logprobs(req.prompt_entries)
            except BaseException as e:  # noqa: BLE001 - as for on_token
                self._end(req, error=e)
                logits = logits[[i for i, r in enumerate(batch) if r is not req]]
                batch = [r for r in batch if r is not req]
        tokens: list[int | None] = [None] * len(batch)
        greedy = [i for i, req in enumerate(batch) if req.sampling.greedy and req.constraint is None]
        if greedy:  # one argmax and one host read for all greedy rows
            rows = torch.tensor(greedy, device=logits.device)
            for i, token in zip(greedy, logits.index_select(0, rows).argmax(dim=-1).tolist()):
                tokens[i] = token
        for req, row, token in zip(batch, logits, tokens):
            try:
                if req.constraint is not None:
                    token = req.constraint.pick(row, req.sampling, req.gen)
                elif token is None:  # its own generator: the draws `generate` would make for it alone
                    token = int(sample(row[None], req.sampling, req.gen)[0])
            except Exception as e:  # noqa: BLE001 - e.g. a row of non-finite logits: this request fails alone
                self._end(req, error=e)
                continue
            self._give(req, token, row)

    def _give(self, req: _Request, token: int, row: torch.Tensor) -> bool:
        """Hands one sampled token (sampled from logits `row` [V]) to its request; False when the request ended
        with it."""
        if _aborted(req):
            self._end(req, finish="abort")
            return False
        req.last, req.produced = token, req.produced + 1
        self.generated_tokens += 1
        req.outputs.append(token)
        if req.history is not None:
            req.history.append(token)
        try:
            if req.on_logprobs is not None:
                req.on_logprobs(*token_logprobs(row, token, req.logprobs))
            req.on_token(token)
        except BaseException as e:  # noqa: BLE001 - the caller decides what its exception means
            self._end(req, error=e)
            return False
        if token in req.stop_tokens:
            self._end(req, finish="stop")
        elif req.produced >= req.max_new_tokens:
            self._end(req, finish="length")
        else:
            return True
        return False

    def _end(self, req: _Request, *, finish: str | None = None, error: BaseException | None = None) -> None:
        if req in self._running:
            self._running.remove(req)
        if req.id >= 0:
            if self.prefix_caching:  # the answer's full pages too: a conversation's next turn starts with them
                fed = torch.cat([req.prompt, torch.tensor(req.outputs, dtype=torch.int64)])[:self.cache.length(req.id)]
                self.cache.register(req.id, page_keys(fed, self.cache.layout.page_size, req.salt, keys=req.keys))
            self.cache.release(req.id)
        req.finish, req.error = finish, error
        self.finished[finish or "error"] += 1
        req.done.set()

    def metrics(self) -> list[tuple[str, str, str, float | dict]]:
        """The generator's state and counters for a metrics endpoint: (name, 'gauge' | 'counter', help, value or
        {label value: value}). Read without a lock from any thread: each figure is consistent on its own."""
        cache = self.cache
        return [
            ("requests_running", "gauge", "requests being decoded", len(self._running)),
            ("requests_prefilling", "gauge", "admitted requests whose prompt is being prefilled",
             sum(not req.prefilled for g in list(self._groups) for req in g.requests)),
            ("requests_waiting", "gauge", "requests waiting for a place in the batch or for pages",
             len(self._waiting) + self._inbox.qsize()),
            ("requests_finished_total", "counter", "ended requests by reason", dict(self.finished)),
            ("prompt_tokens_total", "counter", "prompt tokens of admitted requests", self.prompt_tokens),
            ("prefix_cache_hit_tokens_total", "counter", "prompt tokens read from the prefix cache",
             self.cached_tokens),
            ("generation_tokens_total", "counter", "sampled tokens", self.generated_tokens),
            ("decode_steps_total", "counter", "decode forwards", self.steps),
            ("spec_decode_steps_total", "counter", "decode forwards that verified speculative drafts",
             self.spec_steps),
            ("spec_decode_draft_tokens_total", "counter", "speculative draft tokens fed", self.draft_tokens),
            ("spec_decode_accepted_tokens_total", "counter", "speculative draft tokens kept", self.accepted_tokens),
            ("cache_pages", "gauge", "pages of the paged cache", cache.plan.num_pages),
            ("cache_pages_used", "gauge", "pages held by admitted requests", cache.plan.num_pages - cache.free_pages),
            ("cache_pages_cached", "gauge", "pages filed in the prefix cache (held or idle)", cache.cached_pages),
        ] + ([] if self.graphs is None else [
            ("cuda_graph_captures_total", "counter", "decode-step CUDA graphs recorded (one per new step shape)",
             self.graphs.captures),
            ("cuda_graph_replays_total", "counter", "decode steps that replayed a CUDA graph", self.graphs.replays),
            ("cuda_graph_rebinds_total", "counter", "replays of a graph recorded for other sequences (a batch "
             "change to a shape seen before)", self.graphs.rebinds),
            ("cuda_graph_eager_steps_total", "counter", "decode steps run eagerly (a new shape's first step)",
             self.graphs.eager_steps),
        ]) + ([] if self.gate is None and self.prediction_gate is None else [
            ("spec_decode_gate_declined_total", "counter", "decode steps with drafts that the adaptive gate ran "
             "plainly (their drafts not expected to pay for a speculative step)",
             sum(g.said_no for g in (self.gate, self.prediction_gate) if g is not None)),
        ])


def _aborted(req: _Request) -> bool:
    return req.abort is not None and req.abort.is_set()
