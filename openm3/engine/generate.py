"""Text generation over the paged cache, and the `openm3 generate` command.

    python -m openm3.engine.generate --preset m3-tiny --prompt-ids 1,2,3 --max-new-tokens 16
    python -m openm3.engine.generate --checkpoint ckpt/ --tokenizer tok/tokenizer.json --prompt "def f(" --top-p 0.9
    python -m openm3.engine.generate --preset m3-small --random-prompt 1048576 --max-new-tokens 32   # on a GPU

`generate(model, prompts, ...)` admits the whole batch to a cache planned from its token budget (refused before
any work if it does not fit), prefills the prompts in chunks (a VL model's prompts with their images: the vision
tower runs once per prompt), then decodes one token per running sequence per step until each hits a stop token or
`max_new_tokens` (or several per step with `speculative=`: n-gram drafts verified by the model,
`openm3.engine.speculative`). It reports time to first token, prefill and decode throughput, and on CUDA the peak
memory against the plan (weights + cache + an estimate of the chunk's workspace).
"""

from __future__ import annotations

import argparse
import numbers
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from ..ops.host import to_device
from ..threads import set_threads
from .cache import CacheFullError, CacheLayout, PagedCache, plan_cache
from .constrained import GrammarConstraint
from .graphs import DecodeGraphs
from .sampling import (SamplingParams, check_count, check_logprobs, check_run, plain_int, prompt_rows_logprobs,
                       sample, token_logprobs)
from .scheduler import check_images, check_inference_model, decode_step, is_vision_language, prefill, text_model
from .penalties import Penalties, PenalizedPicker
from .spec_gate import SpeculationGate
from .speculative import PREDICTION_DRAFTS, SpeculativeConfig, TokenHistory, keep_verified, step_drafts

# --dtype names of the CLIs (generate, serve, eval, convert): the short ones and torch's own
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class GenerationResult:
    """tokens: the generated ids (a stop token, when hit, is the last one); finish_reason: 'stop' | 'length'."""

    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"


@dataclass
class GenerationStats:
    """Timings of one `generate` call; memory figures are bytes (peak only on CUDA)."""

    prompt_tokens: int = 0
    ttft_s: float = 0.0  # start -> first token of every sequence sampled (prefill + first sample)
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (the first token of each sequence is prefill's)
    first_step_s: float = 0.0  # the first decode step alone (in a fresh process it compiles the decode kernels)
    first_step_tokens: int = 0
    capture_s: float = 0.0  # later steps that recorded a CUDA graph (and then ran it), for each new batch
    capture_tokens: int = 0
    graph_captures: int | None = None  # None: decode steps ran eagerly
    graph_replays: int = 0
    decode_steps: int = 0
    overlapped: bool = False  # each decode step launched before the host read the last one's tokens (`overlap`)
    spec_steps: int = 0  # decode steps that verified speculative drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    speculative: str = ""  # the speculative config, when on
    spec_gate: str = ""  # what an adaptive config's gate did (`SpeculationGate.describe`)
    cache_bytes: int = 0
    weight_bytes: int = 0
    workspace_bytes: int = 0  # planned estimate
    peak_bytes: int | None = None
    plan: str = ""  # the cache plan's summary

    @property
    def planned_bytes(self) -> int:
        return self.cache_bytes + self.weight_bytes + self.workspace_bytes

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def steady_decode_tokens_per_s(self) -> float:
        """Decode rate after the first step (which pays one-off kernel compilation in a fresh process), without
        the steps that recorded a CUDA graph."""
        rest = self.decode_s - self.first_step_s - self.capture_s
        tokens = self.decode_tokens - self.first_step_tokens - self.capture_tokens
        return tokens / rest if rest > 0 and tokens > 0 else float("nan")

    def _decode_line(self) -> str:
        if self.decode_tokens == 0:  # max_new_tokens 1, or a stop token first
            return "decode: no decode steps (each sequence ended with the token sampled after prefill)"
        steady = self.steady_decode_tokens_per_s
        after = "no later steps to time" if steady != steady else f"after it {steady:.2f} tokens/s"  # nan: none
        return (f"decode: {self.decode_tokens} token{'s' if self.decode_tokens != 1 else ''} in "
                f"{self.decode_s:.3f} s = {self.decode_tokens_per_s:.2f} tokens/s (first step "
                f"{self.first_step_s:.3f} s; {after})")

    def _graph_line(self) -> str:
        ahead = ", each launched ahead of the host" if self.overlapped else ""
        if self.graph_captures is None:
            return f"decode steps: eager{ahead}"
        return (f"decode steps: CUDA graphs ({self.graph_captures} captured in {self.capture_s:.3f} s, "
                f"{self.graph_replays} replays){ahead}")

    def _speculative_line(self) -> str:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        per_step = self.decode_tokens / self.decode_steps if self.decode_steps else float("nan")
        return (f"{self.speculative}: {self.accepted_tokens} of {self.draft_tokens} drafts kept ({rate:.1%}) in "
                f"{self.spec_steps} of {self.decode_steps} steps; {per_step:.2f} tokens per sequence per step"
                + (f" ({self.spec_gate})" if self.spec_gate else ""))

    def summary(self) -> str:
        gib = 2.0 ** 30
        lines = [f"prompt tokens {self.prompt_tokens}, time to first token {self.ttft_s:.3f} s "
                 f"({self.prefill_tokens_per_s:.1f} prefill tokens/s)",
                 self._decode_line(),
                 self._graph_line(),
                 *([self._speculative_line()] if self.speculative else []),
                 self.plan,
                 f"memory plan: weights {self.weight_bytes / gib:.3f} GiB + cache {self.cache_bytes / gib:.3f} GiB + "
                 f"workspace (est.) {self.workspace_bytes / gib:.3f} GiB = {self.planned_bytes / gib:.3f} GiB"]
        if self.peak_bytes is not None:
            ratio = self.peak_bytes / self.planned_bytes
            lines.append(f"peak GPU memory {self.peak_bytes / gib:.3f} GiB = {ratio:.3f} x plan")
        return "\n".join(lines)


def workspace_estimate(config, chunk_size: int, dtype: torch.dtype, vocab_rows: int,
                       context: int | None = None) -> int:
    """Rough peak activation bytes of one prefill chunk (`chunk_size` tokens: pass the chunk the prompts fill):
    the residual stream and its temporaries, q/k/v and the index projections, the widest MLP/MoE intermediate,
    fp32 MSA selection scores over the blocks of `context` keys (default: the model's whole context), and the
    logits rows."""
    el = torch.empty((), dtype=dtype).element_size()
    c = config
    per_token = (6 * c.hidden_size
                 + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * 2
                 + (c.index_n_heads + 1) * c.index_head_dim
                 + 3 * max(c.dense_intermediate_size, c.intermediate_size * c.num_experts_per_tok,
                           c.shared_intermediate_size)) * el
    keys = c.max_position_embeddings if context is None else min(context, c.max_position_embeddings)
    selection = 4 * c.index_n_heads * -(-keys // c.index_block_size)  # fp32 block scores
    return chunk_size * (per_token + selection) + vocab_rows * c.vocab_size * 4


def check_prompts(prompts, vocab_size: int, max_new_tokens: int, max_total_tokens: int) -> list[torch.Tensor]:
    """Validates token-id prompts (a list of prompts, each a list or 1-D int tensor of ids; or a 2-D tensor's rows);
    returns them as int64 tensors. A flat list of ids or a 1-D tensor is refused: one prompt is `[ids]`, not `ids`."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    batch = isinstance(prompts, torch.Tensor) and prompts.dim() == 2
    if not batch and (isinstance(prompts, (str, torch.Tensor)) or not hasattr(prompts, "__len__")
                      or any(_is_token_id(p) for p in prompts)):
        got = ("text: tokenize it first" if isinstance(prompts, str) else
               f"a {prompts.dim()}-D tensor" if isinstance(prompts, torch.Tensor) else
               "a flat list of ints" if hasattr(prompts, "__len__") else type(prompts).__name__)
        raise ValueError(f"prompts: expected a list of prompts, each a list / 1-D tensor of token ids; got {got}"
                         + ("" if isinstance(prompts, str) else ": wrap it as [ids]"))
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise ValueError(f"prompt {i}: expected token ids, got text: tokenize it first")
        ids = torch.as_tensor(p)
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"prompt {i}: expected a list / 1-D tensor of int token ids, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        ids = ids.to(torch.int64)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab_size})")
        if ids.numel() + max_new_tokens > max_total_tokens:
            raise ValueError(f"prompt {i} has {ids.numel()} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                             f"the configured maximum of {max_total_tokens} tokens")
        out.append(ids)
    return out


def _is_token_id(x) -> bool:
    """An int (Python, numpy) or a 0-d tensor: an element of a flat prompt."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_stop_tokens(stop_tokens) -> set[int]:
    """The stop tokens as a set: an int is one stop token, None none, else an iterable of ints (a list, a tuple, a
    1-D tensor). ValueError naming stop_tokens for anything else."""
    if stop_tokens is None:
        return set()
    if _is_token_id(stop_tokens):
        return {int(stop_tokens)}
    if isinstance(stop_tokens, (str, bytes)) or not hasattr(stop_tokens, "__iter__") \
            or not all(_is_token_id(t) for t in stop_tokens):
        raise ValueError(f"stop_tokens: expected a token id or a sequence of token ids, got {stop_tokens!r:.80}")
    return {int(t) for t in stop_tokens}


_DEFAULT_OF = {"token_budget": "what the batch needs", "max_total_tokens": "the model's max_position_embeddings"}


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             sampling: SamplingParams = SamplingParams(), stop_tokens: int | Sequence[int] = (),
             chunk_size: int = 8192, token_budget: int | None = None, index_dtype=None,
             max_total_tokens: int | None = None, seed: int = 0, on_token: Callable[[int, int], None] | None = None,
             on_prefill: Callable[[int], None] | None = None, cuda_graphs: bool | None = None,
             images: Sequence | None = None, speculative: SpeculativeConfig | None = None,
             logprobs: int | None = None, on_logprobs: Callable[[int, float, list], None] | None = None,
             prompt_logprobs: int | None = None, on_prompt_logprobs: Callable[[int, list], None] | None = None,
             constraints: Sequence | None = None, draft_contexts: Sequence | None = None,
             overlap: bool | None = None) -> tuple[list[GenerationResult], GenerationStats]:
    """Generates continuations of a batch of token-id prompts.

    model: an `M3TextModel`, or an `M3ForConditionalGeneration` (its text decoder's dtype and device are the
    cache's), in eval mode (`model.eval()` or `for_inference(model)`; the checkpoint loaders return it so; a
    model in training mode is refused); prompts: B lists (or 1-D tensors) of token ids, `[ids]` for one prompt (a
    flat list of ints is refused); images: None, or one entry per prompt, None or `(pixel_values [N, 1176],
    grid_thw [I, 3])` as `M3ImageProcessor` returns them, a `PromptImages` that also carries videos, or the
    `VisionBatch` of `M3Processor` (VL models only: the prompt's image and video placeholders take the visual
    tokens, see `openm3.engine.scheduler.check_images`);
    stop_tokens: a token id or several: generation of a sequence ends after any of them (none by default: unlike
    transformers' `generate`, the config's `eos_token_id` stops nothing unless passed here, as the CLIs and the
    server do); seed: of the one `torch.Generator` that samples the whole batch, so a prompt's sampled tokens
    depend on the prompts sampled beside it (`BatchedGenerator` gives each request its own); token_budget: tokens the
    cache is planned for (default: exactly what the batch reserves; a batch beyond it raises CacheFullError before
    any work); index_dtype: index-key cache dtype (None = model dtype, 'bf16', 'fp8'); max_total_tokens: prompt +
    max_new_tokens limit per sequence (default: config.max_position_embeddings); on_token(b, token) streams
    each sampled token; on_prefill(n) reports prefill progress in tokens. cuda_graphs: decode steps replay one
    CUDA graph per batch (`openm3.engine.graphs`; default: on when the model is on a CUDA device).
    speculative: n-gram speculative decoding (`openm3.engine.speculative`): greedy outputs equal plain decoding's
    (up to float rounding), sampled ones have its distribution but other draws. logprobs (0-20) and
    on_logprobs(b, logprob, top): before each `on_token`, the token's log probability under the model and the
    `logprobs` most likely tokens as [(id, logprob)] (`openm3.engine.sampling.token_logprobs`). prompt_logprobs
    and on_prompt_logprobs(b, entries): after the prefill, `sampling.PromptLogprob` (logprob, top, rank) of every
    prompt token after the first.
    constraints: None, or one entry per prompt, None or a `GrammarConstraint` (`openm3.engine.constrained`) or a
    `PenalizedPicker` (`openm3.engine.penalties`: logit bias, penalties, min_tokens, min_p) that picks that
    sequence's tokens (structured outputs; with `speculative`, its drafts are kept while they equal its picks).
    draft_contexts: None, or one entry per prompt, token ids the speculative drafts may also be looked up in (a
    predicted output: OpenAI's `prediction`); not the model's input. Without `speculative`, the sequences with
    a context look drafts up with `speculative.PREDICTION_DRAFTS` (adaptive: where they pay) and the others do not.
    overlap: each decode step is launched before the host reads the previous step's tokens (fed from the device),
    so the host's sampling read-back and bookkeeping overlap the GPU's step; a sequence that stops on a token is
    seen one step late and that step's row is dropped (greedy outputs equal plain decoding's; sampled ones draw
    differently once a sequence has stopped). Not with `speculative`, `draft_contexts` or `constraints`. None
    (default): on for a model on a CUDA device where none of those is given (m3-small, 8 x 16K prompts, H100:
    +15% decode tokens/s), off elsewhere.
    Returns one GenerationResult per prompt and the run's GenerationStats.
    """
    check_inference_model(model)
    max_new_tokens, chunk_size, token_budget, max_total_tokens, seed, logprobs, prompt_logprobs = map(
        plain_int, (max_new_tokens, chunk_size, token_budget, max_total_tokens, seed, logprobs, prompt_logprobs))
    for name, value in (("token_budget", token_budget), ("max_total_tokens", max_total_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None (None: {_DEFAULT_OF[name]}), got {value!r}")
    check_count("chunk_size", chunk_size)
    lm = text_model(model)
    config = lm.config
    limit = max_total_tokens or config.max_position_embeddings
    ids = check_prompts(prompts, config.vocab_size, max_new_tokens, limit)
    stop = check_stop_tokens(stop_tokens)
    check_run(sampling, seed, {"on_token": on_token, "on_prefill": on_prefill})
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise ValueError(f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__}")
    check_logprobs(logprobs, on_logprobs)
    check_logprobs(prompt_logprobs, on_prompt_logprobs, ("prompt_logprobs", "on_prompt_logprobs"))
    check_constraints(constraints, len(ids), stop)
    if constraints is not None and not any(constraints):
        constraints = None
    if overlap and (speculative is not None or constraints is not None or draft_contexts is not None):
        raise ValueError("overlap=True decodes without drafts or constraints: pass speculative=None, "
                         "constraints=None and draft_contexts=None with it")
    vision = check_images(model, ids, images)
    param = next(lm.parameters())
    device, dtype = param.device, param.dtype
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a model on a CUDA device, got one on {device}")
    if overlap is None:
        overlap = device.type == "cuda" and speculative is None and constraints is None and draft_contexts is None
    layout = CacheLayout.from_config(config)
    reserve = {b: p.numel() + max_new_tokens for b, p in enumerate(ids)}
    needed = sum(-(-n // layout.page_size) for n in reserve.values()) * layout.page_size
    plan = plan_cache(layout, token_budget or needed, kv_dtype=dtype, index_dtype=index_dtype)
    if needed > plan.token_capacity:  # refuse before allocating anything
        raise CacheFullError(f"the batch reserves {needed} tokens (whole pages of {layout.page_size}: prompt + "
                             f"max_new_tokens per sequence) but the token budget is {token_budget}")
    stats = GenerationStats(prompt_tokens=sum(p.numel() for p in ids), cache_bytes=plan.total_bytes,
                            weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                            workspace_bytes=workspace_estimate(config, min(chunk_size, sum(p.numel() for p in ids)),
                                                               dtype, len(ids), max(reserve.values())),
                            plan=plan.summary(), speculative=speculative.describe() if speculative else "")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    cache = PagedCache(plan, device)
    cache.admit(reserve)  # all or nothing, before any work
    gen = torch.Generator(device=device).manual_seed(seed)
    results = [GenerationResult(prompt_len=p.numel()) for p in ids]
    if draft_contexts is not None and len(draft_contexts) != len(ids):
        raise ValueError(f"draft_contexts: expected one entry per prompt ({len(ids)}), got {len(draft_contexts)}")
    contexts = draft_contexts if draft_contexts is not None else [()] * len(ids)
    if speculative is None and any(contexts):  # predicted outputs without a configured speculation: they look up
        speculative, stats.speculative = PREDICTION_DRAFTS, PREDICTION_DRAFTS.describe() + " (predicted outputs)"
        histories = [TokenHistory(p, max_new_tokens, c) if c else None for p, c in zip(ids, contexts)]
    else:
        histories = [TokenHistory(p, max_new_tokens, c or ()) for p, c in zip(ids, contexts)] if speculative else None

    t0 = time.perf_counter()
    entries: list[list] = [[] for _ in ids]

    def on_rows(b: int, position: int, rows: torch.Tensor) -> None:  # row i predicts token position + i + 1
        targets = ids[b][position + 1:position + 1 + rows.shape[0]]
        entries[b] += prompt_rows_logprobs(rows[:targets.numel()], targets, prompt_logprobs)

    every = [on_prompt_logprobs is not None] * len(ids)
    logits = prefill(model, cache, list(range(len(ids))), ids, chunk_size=chunk_size, on_chunk=on_prefill,
                     images=vision, on_rows=on_rows, all_logits=every)
    if on_prompt_logprobs is not None:
        for b, e in enumerate(entries):
            on_prompt_logprobs(b, e)
    tokens = _constrained(sample(logits, sampling, gen).tolist(), list(range(len(ids))), logits, constraints, sampling,
                          gen)
    report = None if on_logprobs is None else (logprobs, on_logprobs)
    running = _emit(results, list(range(len(ids))), [[t] for t in tokens], stop, max_new_tokens, on_token,
                    histories, logits[:, None], report)
    stats.ttft_s = time.perf_counter() - t0

    graphs = DecodeGraphs(lm, cache) if (cuda if cuda_graphs is None else cuda_graphs) else None
    gate = SpeculationGate() if speculative is not None and speculative.adaptive else None
    t1 = time.perf_counter()
    live = set(range(len(ids)))
    stats.overlapped = bool(overlap)
    if overlap:  # the loop below without drafts or constraints, launched one step ahead of the host
        running = _decode_overlapped(graphs, lm, cache, running, results, sampling, gen, stop, max_new_tokens,
                                     on_token, report, stats)
    while running:
        for b in live - set(running):  # finished sequences give their pages back
            cache.release(b)
        live = set(running)
        drafts = None
        if speculative is not None:
            rooms = [cache.capacity(b) - cache.length(b) - 1 for b in running]
            drafts = step_drafts([histories[b] for b in running], rooms, speculative, gate, running,
                                 [results[b].tokens[-1] for b in running])
        fed = [[results[b].tokens[-1]] + (drafts[i] if drafts else []) for i, b in enumerate(running)]
        # on the host: both step paths read the tokens there (made on the device, they cost a copy there and a
        # sync to read them back every step)
        feed = torch.tensor(fed if drafts else [f[0] for f in fed], dtype=torch.int64)
        lengths = [cache.length(b) for b in running]
        t_step, captures = time.perf_counter(), graphs.captures if graphs else 0
        eager = graphs.eager_steps if graphs else 0
        logits = graphs.step(running, feed) if graphs else decode_step(lm, cache, running, feed)
        rows = logits[:, None] if drafts is None else logits  # [B, tokens fed, V]
        if drafts is None:
            tokens = sample(logits, sampling, gen).tolist()  # a host read: the step is complete
            tokens = [[t] for t in _constrained(tokens, running, logits, constraints, sampling, gen)]
        else:
            tokens, accepted = keep_verified(cache, running, lengths, logits, drafts,
                                             [(sampling, gen, stop, max_new_tokens - len(results[b].tokens),
                                               constraints[b] if constraints is not None else None)
                                              for b in running])
            stats.draft_tokens += sum(len(d) for d in drafts)
            stats.accepted_tokens += accepted
            stats.spec_steps += 1
        if gate is not None:  # a step that ran eagerly or captured a graph tells nothing of the step's cost
            timed = graphs is None or (graphs.captures == captures and graphs.eager_steps == eager)
            gate.record(running, tokens, time.perf_counter() - t_step if timed else None,
                        speculative=drafts is not None, accepted=accepted if drafts is not None else 0)
        produced = sum(len(t) for t in tokens)
        if stats.decode_tokens == 0:
            stats.first_step_s, stats.first_step_tokens = time.perf_counter() - t1, produced
        elif graphs and graphs.captures > captures:
            stats.capture_s += time.perf_counter() - t_step
            stats.capture_tokens += produced
        stats.decode_tokens += produced
        stats.decode_steps += 1
        running = _emit(results, running, tokens, stop, max_new_tokens, on_token, histories, rows, report)
    if cuda:
        torch.cuda.synchronize(device)
        stats.peak_bytes = torch.cuda.max_memory_allocated(device)
    stats.decode_s = time.perf_counter() - t1
    if graphs is not None:
        stats.graph_captures, stats.graph_replays = graphs.captures, graphs.replays
    if gate is not None:
        stats.spec_gate = gate.describe()
    return results, stats


def check_constraints(constraints, batch: int, stop_tokens) -> None:
    """constraints: None, or `batch` entries, each None, a `GrammarConstraint` or a `PenalizedPicker`
    (`openm3.engine.penalties`) whose stop tokens (what it ends a document with) are among the generation's
    `stop_tokens`."""
    if constraints is None:
        return
    if len(constraints) != batch or any(c is not None and not isinstance(c, (GrammarConstraint, PenalizedPicker))
                                        for c in constraints):
        raise ValueError(f"constraints: expected None or {batch} entries, each None, a GrammarConstraint or a "
                         f"PenalizedPicker, got {[type(c).__name__ for c in constraints]}")
    stop = {int(t) for t in stop_tokens}
    for c in constraints:
        if c is not None and not set(c.stop_tokens) <= stop:
            raise ValueError(f"constraints: a constraint ends its documents with tokens {c.stop_tokens}, which "
                             f"must be among stop_tokens {sorted(stop)}")


class LaunchedStep(NamedTuple):
    """A decode step launched ahead of the host (`overlap`; here and in `openm3.engine.batching`): its sequences
    (or requests), their sampled tokens on the device, the host copy filled behind the step, the event after that
    copy (None off CUDA), the step's logits and whether it recorded a CUDA graph."""

    batch: list
    tokens: torch.Tensor
    host: torch.Tensor
    event: "torch.cuda.Event | None"
    logits: torch.Tensor
    captured: bool

    @classmethod
    def of(cls, batch: list, tokens: torch.Tensor, logits: torch.Tensor, captured: bool) -> "LaunchedStep":
        """The step whose sampled `tokens` are still being computed: their host copy is queued behind it."""
        cuda = tokens.is_cuda
        host = tokens.to("cpu", non_blocking=cuda)  # pinned when from the device, filled behind the step
        event = torch.cuda.Event() if cuda else None
        if event is not None:
            event.record()
        return cls(batch, tokens, host, event, logits, captured)

    def host_tokens(self) -> list[int]:
        """The sampled tokens, once the step and their copy have run (waits for this step alone)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def _decode_overlapped(graphs, lm, cache, running, results, sampling, gen, stop, max_new_tokens, on_token, report,
                       stats) -> list[int]:
    """generate's decode loop for `overlap=True`: step t + 1 is launched with step t's tokens still on the device
    (sampled there), then the host waits for step t's tokens alone (copied back behind it) and emits them while
    the GPU runs step t + 1. Sequences that reach max_new_tokens leave the batch in time; one that samples a stop
    token is in the step after it, whose row is dropped. Returns [] (every sequence done).
    Timing: a step's time runs from the last emission to its own, which covers launching the step after it; so
    the first interval holds the first step and the next step's launch (a CUDA-graph capture, for a new batch),
    and an interval counts as a capture's when the step launched inside it recorded a graph."""
    alive = set(running)
    batch, feed = list(running), torch.tensor([results[b].tokens[-1] for b in running], dtype=torch.int64)
    pending = None  # the step launched last time, its tokens not read yet
    t_emitted = time.perf_counter()  # when the last step's tokens were emitted (or the loop started)
    while batch or pending is not None:
        launched = None
        if batch:
            captures = graphs.captures if graphs else 0
            logits = graphs.step(batch, feed) if graphs else decode_step(lm, cache, batch, feed)
            stats.decode_steps += 1
            launched = LaunchedStep.of(batch, sample(logits, sampling, gen), logits,
                                       graphs is not None and graphs.captures > captures)
        if pending is not None:
            done, rows = pending.batch, pending.logits
            # the rows of sequences that stopped the step before are dropped; every live sequence is in `done`
            picked = [(i, b, tok) for i, (b, tok) in enumerate(zip(done, pending.host_tokens())) if b in alive]
            if report is not None:
                rows = rows[[i for i, _, _ in picked]][:, None]
            alive = set(_emit(results, [b for _, b, _ in picked], [[tok] for _, _, tok in picked], stop,
                              max_new_tokens, on_token, rows=rows, report=report))
            produced, now = len(picked), time.perf_counter()
            if stats.decode_tokens == 0:
                stats.first_step_s, stats.first_step_tokens = now - t_emitted, produced
            elif launched is not None and launched.captured:  # this interval launched (captured) a graph
                stats.capture_s += now - t_emitted
                stats.capture_tokens += produced
            stats.decode_tokens += produced
            t_emitted = now
        pending = launched
        batch = []
        if launched is not None:  # the next step: who is alive and still short of max_new_tokens after `launched`
            keep = [i for i, b in enumerate(launched.batch)
                    if b in alive and len(results[b].tokens) + 1 < max_new_tokens]
            batch = [launched.batch[i] for i in keep]
            tokens = launched.tokens
            if len(keep) < tokens.numel():
                tokens = tokens[to_device(torch.tensor(keep, dtype=torch.int64), tokens.device)]
            feed = tokens
            for b in set(launched.batch) - set(batch) - alive:  # finished, and in no step still to run: pages back
                cache.release(b)
    return []


def _constrained(tokens: list[int], seqs: list[int], logits, constraints, sampling, gen) -> list[int]:
    """tokens (one per sequence of `seqs`, sampled from logits [len(seqs), V]) with each constrained sequence's
    replaced by its constraint's pick from the same row."""
    if constraints is None:
        return tokens
    return [constraints[b].pick(logits[i], sampling, gen) if constraints[b] is not None else t
            for i, (b, t) in enumerate(zip(seqs, tokens))]


def _emit(results, seqs, tokens, stop, max_new_tokens, on_token, histories=None, rows=None, report=None
          ) -> list[int]:
    """Appends each sequence's new tokens (a list per sequence, already cut at a stop token or the length);
    returns the sequences still running. rows[i, j]: the logits token j of sequence i was sampled from, for
    `report` = (logprobs, on_logprobs)."""
    running = []
    for i, (b, new) in enumerate(zip(seqs, tokens)):
        for j, tok in enumerate(new):
            results[b].tokens.append(tok)
            if histories is not None and histories[b] is not None:
                histories[b].append(tok)
            if report is not None:
                report[1](b, *token_logprobs(rows[i, j], tok, report[0]))
            if on_token is not None:
                on_token(b, tok)
        if new[-1] in stop:
            results[b].finish_reason = "stop"
        elif len(results[b].tokens) < max_new_tokens:
            running.append(b)
    return running


# ---------------------------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    from ..cli import ArgumentParser

    p = ArgumentParser(prog="openm3 generate", description="Generate text with an M3 model over the "
                                "paged MSA cache (chunked prefill, Triton decode kernels on CUDA).")
    add_model_arguments(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, tokenized by --tokenizer, else the --checkpoint directory's "
                        "tokenizer.json, else (with --preset) openm3's own tokenizer")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    prompt.add_argument("--random-prompt", type=int, metavar="N", help="N random token ids (long-context runs)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file for a vision-language --checkpoint (repeatable): --prompt becomes a user "
                   "turn of the chat template holding the images, then the videos, then the text")
    p.add_argument("--video", action="append", default=[], metavar="PATH",
                   help="a video file: MP4, WebM, ... (with PyAV) or an animated GIF / WebP / PNG (repeatable; at "
                   "most 64 frames are kept)")
    p.add_argument("--chat", action="store_true",
                   help="--prompt is a user turn of the chat template (as `openm3 serve` renders a conversation), "
                   "followed by the assistant's generation prompt; generation stops at the end of the turn. "
                   "Implied by --image, --video and --system")
    p.add_argument("--system", default=None, help="a system turn before the --chat user turn")
    p.add_argument("--tokenizer", help="a tokenizer.json or a directory holding one, for --prompt and to print "
                   "text (default: the --checkpoint directory's, if it has one)")
    add_chat_template_argument(p)
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: "
                   "%(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to "
                   "this total probability, in (0, 1]; 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 = off (default: "
                   "%(default)s)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the top one")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides (multiplies when negative) the logits of the prompt's and the output's tokens; 1 = "
                   "off (openm3.engine.penalties)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from output tokens' logits")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="times each token's count in the output, subtracted from its logit")
    p.add_argument("--stop", default="", help="comma-separated stop token ids (e.g. 2,7); --chat also stops at the "
                   "end of the assistant's turn")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling, the --preset's random weights and "
                   "--random-prompt (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=8192, help="prefill tokens per forward (default: %(default)s)")
    p.add_argument("--token-budget", type=int, default=None, help="tokens to plan the cache for")
    p.add_argument("--max-total-tokens", type=int, default=None, help="prompt + new tokens limit")
    p.add_argument("--index-dtype", default=None, choices=["bf16", "fp16", "fp32", "fp8"],
                   help="index-key cache dtype (default: the model dtype)")
    p.add_argument("--no-stream", action="store_true", help="print the output only at the end")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every decoder layer (fewer, fused kernels per decode step; the first prefill "
                        "chunk and the first decode step pay for compilation)")
    add_speculative_argument(p)
    p.add_argument("--eager", action="store_true",
                   help="run every decode step eagerly (default on CUDA: each batch's decode step is captured as a "
                        "CUDA graph at its second step and replayed)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before reading the last one's token back (default: on a GPU without "
                        "speculation or penalties; the host's work overlaps "
                        "the GPU's; greedy output unchanged; not with --speculative-config or penalties)")
    return p


def add_speculative_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding with n-gram (prompt lookup) drafts, as vLLM\'s option: '
                   '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                   '"prompt_lookup_min": 2}\' (drafts per step 1-7), plus this project\'s "adaptive": true '
                   '(speculate only where the drafts are expected to pay for the longer step). Greedy outputs are '
                   'unchanged; sampled ones keep their distribution. Default: off')


def speculative_option(text: str | None) -> SpeculativeConfig | None:
    """--speculative-config parsed; ValueError naming the option."""
    if text is None:
        return None
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None


def add_chat_template_argument(p: argparse.ArgumentParser, variables_flag: str = "--chat-template-kwargs") -> None:
    """--chat-template, and `variables_flag` (JSON: more variables for the template)."""
    p.add_argument("--chat-template", default="auto", metavar="auto|builtin|PATH",
                   help="how chat prompts are rendered: auto (default) = the checkpoint's own template when the "
                   "tokenizer's directory has one (chat_template.jinja or tokenizer_config.json's chat_template), "
                   "else openm3's built-in M3 template; builtin; or a .jinja file")
    p.add_argument(variables_flag, default=None, metavar="JSON",
                   help="more variables for a checkpoint's chat template, a JSON object such as "
                   "'{\"enable_thinking\": false}' (as transformers' apply_chat_template takes them; the built-in "
                   "template reads none)")


def chat_template(option: str, tokenizer_file: str | None):
    """The `ChatTemplate` that --chat-template names, or None for the built-in renderer (`render_chat`, which also
    checks the messages): for 'builtin', and for openm3's own template (what `openm3 train --export` saves, which
    renders the same). ValueError naming the option for a file that is missing or not a valid template."""
    import os

    from ..data.chat import CHAT_TEMPLATE
    from ..data.chat_template import ChatTemplate, read_template

    if option == "builtin":
        return None
    if option == "auto":
        found = read_template(os.path.dirname(tokenizer_file)) if tokenizer_file else None
    elif not os.path.isfile(option):
        raise ValueError(f"--chat-template: expected auto, builtin or a template file, got {option!r} (no such file)")
    else:
        with open(option, encoding="utf-8") as f:
            found = f.read(), {}, f"--chat-template {option}"
    if found is None or found[0].strip() == CHAT_TEMPLATE:
        return None
    return ChatTemplate(*found[:2], origin=found[2])


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--checkpoint | --preset, --dtype, --device: the model options shared by `generate` and `serve`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="local checkpoint directory (config.json + safetensors)")
    src.add_argument("--preset", help="model preset with random weights: m3 | m3-small | m3-tiny")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="with --preset: N decoder layers instead of the preset's (its pattern kept: the first "
                        "dense, the rest MSA with MoE), e.g. m3-small's shapes at 2 layers on a CPU")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), metavar="bf16|fp16|fp32",
                   help="parameter dtype (also bfloat16, float16, float32; default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's, one per core; on a shared or busy machine fewer can "
                        "be much faster)")


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """--device / --dtype with their defaults: CUDA in bf16 when there is a GPU, else CPU in fp32 (ValueError naming
    --device for one this machine does not have: `check_device`); sets torch's CPU threads to --threads if given."""
    device = check_device(args.device)
    set_threads(getattr(args, "threads", None))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def check_device(name: str | None, flag: str = "--device") -> torch.device:
    """The torch device `name` (None: cuda if available, else cpu); ValueError naming `flag` for a name torch does
    not read, or a CUDA device this machine does not have (before anything is built on it)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{flag}: expected a torch device such as cpu, cuda or cuda:1, got {name!r}") from None
    if device.type == "meta":  # shapes without values: nothing runs on it
        raise ValueError(f"{flag} {name}: a meta device holds no values to compute with; use --device cpu or cuda")
    backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu, ...
    if device.type not in ("cpu", "cuda") and not getattr(backend, "is_available", lambda: False)():
        raise ValueError(f"{flag} {name}: {device.type} is not available on this machine; use --device cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"{flag} {name}: CUDA is not available on this machine ({why}); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return device


def stop_token_ids(text: str) -> list[int]:
    """`--stop`: comma-separated token ids (ValueError naming the option for anything else)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    bad = [part for part in parts if not part.isdigit()]
    if bad:
        raise ValueError(f"--stop: expected comma-separated token ids (e.g. --stop 2,7), got {text!r}; stop "
                         "strings are the server's `stop` field")
    return [int(part) for part in parts]


def tokenizer_path(tokenizer: str | None, checkpoint: str | None) -> str | None:
    """The tokenizer.json to use (shared by `generate` and `serve`): `tokenizer` (a file, or a directory holding
    one; ValueError if neither), else the checkpoint directory's tokenizer.json when there is one (`openm3 train
    --export` writes it), else None."""
    import os

    if tokenizer is not None:
        path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer: {tokenizer!r} is neither a tokenizer.json file nor a directory "
                             f"holding one")
        return path
    if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        return os.path.join(checkpoint, "tokenizer.json")
    return None


def load_model(args, device: torch.device, dtype: torch.dtype, *, vision: bool = False):
    """The model named by --checkpoint or --preset (random weights, seeded), in eval mode and the inference layout
    (`for_inference`). vision: a VL checkpoint loads as `M3ForConditionalGeneration` (vision tower too); otherwise
    the text decoder alone."""
    from ..models import M3TextConfig, M3TextModel, load_pretrained, load_text_model

    if args.checkpoint is not None:
        load = load_pretrained if vision else load_text_model
        return for_inference(load(args.checkpoint, dtype=dtype, device=device))
    config = M3TextConfig.from_name(args.preset, **preset_depth(args))  # ValueError naming the presets
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = M3TextModel(config)
    return for_inference(model.to(dtype))


def preset_depth(args) -> dict:
    """`--layers N` as a preset override ({"num_hidden_layers": N}; {} without it); ValueError naming the option
    for N < 1 or with --checkpoint (a checkpoint's depth is its weights')."""
    layers = getattr(args, "layers", None)
    if layers is None:
        return {}
    if getattr(args, "checkpoint", None) is not None:
        raise ValueError("--layers: only with --preset (a --checkpoint has the layers its weights hold)")
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    return {"num_hidden_layers": layers}


def for_inference(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with each attention layer's projections fused (`openm3.layers.attention.
    fuse_projections`: one GEMM and one norm-and-rotate kernel per layer where the inference kernels run; weights'
    names, values and memory unchanged). Call it after any `.to(...)`, which undoes the fusion."""
    from ..layers.attention import fuse_projections

    fuse_projections(model)
    return model.eval()


def compile_layers(model) -> int:
    """`torch.compile` each decoder layer in place (the attention ops and the cache stay eager inside them, see
    `openm3.models.text.DecoderLayer`); dynamic shapes, as prefill chunks and decode steps differ in length.
    Returns how many layers."""
    for layer in model.layers:
        layer.compile(dynamic=True)
    return len(model.layers)


def main(argv: Sequence[str] | None = None) -> int:
    """`openm3 generate ARGS` (see `build_parser`); bad requests exit with `error: ...`."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Runs a parsed `openm3 generate` request: streams the new tokens to stdout, the report to stderr."""
    import os

    if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
        raise SystemExit(f"error: checkpoint directory {args.checkpoint!r} does not exist")
    media = bool(args.image or args.video)
    if media and (args.prompt is None or args.checkpoint is None):
        raise SystemExit("error: --image / --video need --prompt text and a vision-language --checkpoint")
    chat = args.chat or media or args.system is not None
    if chat and args.prompt is None:
        raise SystemExit("error: --chat / --system need --prompt text (the user turn)")
    variables = None
    if args.chat_template_kwargs is not None:  # checked before the model loads
        from ..data.chat_template import parse_template_variables

        if not chat:
            raise SystemExit("error: --chat-template-kwargs needs a chat prompt (--chat, --system, --image or --video)")
        try:
            variables = parse_template_variables(args.chat_template_kwargs, "--chat-template-kwargs")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if args.max_new_tokens < 1:  # checked before the model loads (and a prefill progress bar is drawn)
        raise SystemExit(f"error: --max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.chunk_size < 1:
        raise SystemExit(f"error: --chunk-size: expected >= 1, got {args.chunk_size}")
    for flag, value in (("--token-budget", args.token_budget), ("--max-total-tokens", args.max_total_tokens)):
        if value is not None and value < 1:  # 0 would read as "not given" below
            raise SystemExit(f"error: {flag}: expected >= 1, got {value}")
    if args.random_prompt is not None and args.random_prompt <= 0:
        raise SystemExit(f"error: --random-prompt must be > 0, got {args.random_prompt}")
    try:
        preset_depth(args)  # --layers with --checkpoint is refused, not ignored
        device, dtype = device_and_dtype(args)
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
        penalties = Penalties(presence=args.presence_penalty, frequency=args.frequency_penalty,
                              repetition=args.repetition_penalty, min_p=args.min_p)
        stop = stop_token_ids(args.stop)
        speculative = speculative_option(args.speculative_config)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    tokenizer = None
    try:
        path = tokenizer_path(args.tokenizer, args.checkpoint)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if path is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
    if args.prompt is not None and tokenizer is None and args.checkpoint is None:
        from ..data.tokenizer import get_tokenizer

        tokenizer = get_tokenizer().backend  # a preset's, as `openm3 serve --preset` takes: openm3's own (cached)
    if args.prompt is not None and tokenizer is None:
        from ..models.checkpoint import CheckpointError, config_json

        try:  # a directory that is no checkpoint at all (a training run's folder, say) is the error to report
            config_json(args.checkpoint)
        except CheckpointError as e:
            raise SystemExit(f"error: --checkpoint: {e}") from None
        raise SystemExit(f"error: --prompt needs --tokenizer PATH: {args.checkpoint} holds no tokenizer.json (pass "
                         "a tokenizer.json or a directory holding one), or pass --prompt-ids")
    try:
        model = load_model(args, device, dtype, vision=media)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if media and not is_vision_language(model):
        raise SystemExit(f"error: --image / --video: {args.checkpoint} is a text-only checkpoint (its config.json "
                         f"has no vision_config)")
    if args.compile:
        compile_layers(text_model(model))
    images = None
    if chat:
        from ..data.tokenizer import M3Tokenizer

        try:
            prompt, visual = chat_turn_prompt(args, path, model.config if media else None, variables)
            stop = stop + [M3Tokenizer.from_file(path).eos_id]  # the end of the assistant's turn
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        images = [visual] if media else None
    elif args.prompt is not None:
        prompt = tokenizer.encode(args.prompt).ids
    elif args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"error: --prompt-ids must be comma-separated ints, got {args.prompt_ids!r}")
    else:
        gen = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, model.config.vocab_size, (args.random_prompt,), generator=gen).tolist()

    bar = _progress(len(prompt)) if len(prompt) > args.chunk_size else None
    stream = None if args.no_stream else _streamer(tokenizer)
    try:
        results, stats = generate(model, [prompt], max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  stop_tokens=stop, chunk_size=args.chunk_size, token_budget=args.token_budget,
                                  index_dtype=args.index_dtype, max_total_tokens=args.max_total_tokens,
                                  seed=args.seed, on_token=stream, on_prefill=bar.update if bar else None,
                                  cuda_graphs=False if args.eager else None, images=images,
                                  speculative=speculative, overlap=args.overlap,
                                  constraints=[PenalizedPicker(penalties, prompt)] if penalties.active else None)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    finally:
        if bar is not None:
            bar.close()
    out = results[0].tokens
    if args.no_stream:
        print(tokenizer.decode(out) if tokenizer else ",".join(map(str, out)))
    else:
        print()
    print(f"finish reason: {results[0].finish_reason}", file=sys.stderr)
    print(stats.summary(), file=sys.stderr)
    return 0


def chat_turn_prompt(args, tokenizer_file: str, vl_config, template_variables: dict | None = None):
    """(prompt ids, PromptImages or None) for a `--chat` `--prompt`: an optional `--system` turn, then one user turn
    of the chat template (the `--image` / `--video` files, then the text) and the generation prompt, built as
    training and `openm3 serve` build it (`openm3.engine.media.chat_prompt`; `vl_config` None for a text model;
    videos in clips of the `--checkpoint`'s recorded length).
    template_variables: the template's extra variables (`--chat-template-kwargs`, parsed). ValueError naming the
    file that cannot be read or decoded."""
    from ..data.tokenizer import M3Tokenizer
    from ..models.processor import video_frames_per_clip
    from .media import chat_prompt

    parts = [{"type": kind, "path": f, "where": f"--{kind} {f}"}
             for kind, files in (("image", args.image), ("video", args.video)) for f in files]
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": parts + [{"type": "text", "text": args.prompt}]})
    clip = {} if args.checkpoint is None else {"frames_per_clip": video_frames_per_clip(args.checkpoint)}
    return chat_prompt(M3Tokenizer.from_file(tokenizer_file), messages, vl_config=vl_config,
                       template=chat_template(args.chat_template, tokenizer_file),
                       template_variables=template_variables, **clip)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="prefill", file=sys.stderr)


def _streamer(tokenizer) -> Callable[[int, int], None]:
    """Prints each sequence's text as it settles (a character split across tokens once it is whole; token ids
    without a tokenizer)."""
    from ..data.tokenizer import IncrementalText

    texts: dict[int, IncrementalText] = {}

    def show(b: int, tok: int) -> None:
        if tokenizer is None:
            print(f"{tok},", end="", flush=True)
            return
        text = texts.setdefault(b, IncrementalText(tokenizer))
        shown = len(text.settled)
        text.push(tok)
        print(text.settled[shown:], end="", flush=True)

    return show


if __name__ == "__main__":
    raise SystemExit(main())
