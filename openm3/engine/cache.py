"""Paged KV and index-key caches for inference, planned up front from a token budget.

Memory is one pool of `num_pages` pages shared by all layers: page p of sequence s holds the same 128 (=
`index_block_size`) token positions in every layer, so one page table per sequence serves the whole model and a
page is exactly one MSA key block. Per layer the pool holds

- `k, v [num_pages, page_size, Hkv, D]` in the KV dtype (every layer), and
- for MSA layers, the index keys `[num_pages, page_size, Di]` in the model dtype / bf16, or fp8 e4m3 with one
  power-of-two scale per token `[num_pages, page_size]`, stored as its uint8 e8m0 exponent (the decode kernels
  read ~129 B per token instead of 256 B).

A request reserves the pages for its whole length (prompt + new tokens) when it is admitted, so a batch that does
not fit is refused before any work and an admitted one never runs out half way.

**Prefix caching** (`PagedCache(..., prefix_caching=True)`, as vLLM's automatic prefix caching): a full page's
keys and values depend only on the tokens up to its end, so a page written for one sequence serves any later
sequence with the same leading tokens. `page_keys` names each full page of a prompt by a digest chained over
every token before its end (and a salt for inputs beyond the ids: a prompt's images); `register` files a
sequence's written full pages under their keys, `admit(..., prefixes=)` starts a new sequence on the longest run
of registered pages its keys match (shared, counted per page) and returns how many tokens it finds cached, and a
released sequence's registered pages stay cached (idle) until a reservation needs their memory, least recently
used first. A registered page is never written again: `truncate` into one another sequence holds is refused.

The model drives the cache through the protocol documented in `openm3/layers/attention.py`:

    cache.admit({seq_id: prompt_len + max_new_tokens, ...})
    with cache.step(seq_ids, q_lens):             # the new tokens of each sequence, in packed order
        logits = model(input_ids, position_ids=..., cu_seqlens=..., cache=cache)
    # inside, every attention layer calls cache.attend(layer_idx, q, k, v, qi, ki, ...) once

`attend` appends the new keys to the pages and attends the new queries to everything cached. Backends: the
reference path (`openm3.ops.msa.decode`, any batch shape, CPU) or, with the `triton` backend, the Triton decode
kernels for decode steps (every sequence has the same small number of new tokens) and the MSA prefill ops of
`openm3.ops.msa` over each sequence's cached tokens for prefill chunks. The decode kernels tile a whole page, so they
need a power-of-two page size >= 16; with another page size the prefill ops (a multiple of 16) serve decode steps
too (slower, and not capturable in a CUDA graph: `graphs.DecodeGraphs` then runs the steps eagerly).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from ..ops import msa
from ..ops.attention import dense_attention
from ..ops.msa import decode
from ..ops.msa.backend import pick_backend
from ..ops.host import copy_from_host
from ..ops.paged_write import write_paged

FP8 = decode.FP8_DTYPE
_INDEX_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": FP8}
MAX_DECODE_QUERIES = 8  # new tokens per sequence up to which a step runs the decode kernels


class CacheFullError(ValueError):
    """A request (or batch) needs more pages than the cache has free."""


@dataclass(frozen=True)
class CacheLayout:
    """What the cache stores for a model: per-layer flags and the head shapes.

    sparse[l]: layer l is an MSA layer (stores index keys); page_size: tokens per page (= MSA block size).
    """

    sparse: tuple[bool, ...]
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    page_size: int

    @classmethod
    def from_config(cls, config) -> "CacheLayout":
        """From an `M3TextConfig` (or anything with its field names)."""
        return cls(sparse=tuple(t == "minimax_m3_sparse" for t in config.layer_types),
                   num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                   index_head_dim=config.index_head_dim, page_size=config.index_block_size)

    @property
    def num_layers(self) -> int:
        return len(self.sparse)


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CachePlan:
    """How much memory the cache takes: `num_pages` pages of `layout.page_size` tokens in every layer."""

    layout: CacheLayout
    num_pages: int
    kv_dtype: torch.dtype
    index_dtype: torch.dtype

    @property
    def token_capacity(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def physical_pages(self) -> int:
        """Pages in memory: `num_pages` for sequences and one scratch page no sequence holds (the padding rows
        of a CUDA-graph decode batch write their keys there; `PagedCache.scratch_page`)."""
        return self.num_pages + 1

    @property
    def kv_bytes(self) -> int:
        lay = self.layout
        tokens = self.physical_pages * lay.page_size
        return 2 * tokens * lay.num_kv_heads * lay.head_dim * _dtype_size(self.kv_dtype) * lay.num_layers

    @property
    def index_bytes(self) -> int:
        scale = 1 if self.index_dtype == FP8 else 0  # fp8 keys: + one e8m0 scale byte per token
        per_token = self.layout.index_head_dim * _dtype_size(self.index_dtype) + scale
        return per_token * self.physical_pages * self.layout.page_size * sum(self.layout.sparse)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.index_bytes

    def summary(self) -> str:
        gib = 2.0 ** 30
        return (f"cache plan: {self.num_pages} pages x {self.layout.page_size} tokens = {self.token_capacity} tokens, "
                f"{self.layout.num_layers} layers ({sum(self.layout.sparse)} MSA); "
                f"KV {self.kv_bytes / gib:.3f} GiB ({self.kv_dtype}), "
                f"index keys {self.index_bytes / gib:.3f} GiB ({self.index_dtype}), "
                f"total {self.total_bytes / gib:.3f} GiB")


def resolve_index_dtype(index_dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """`None` -> the KV dtype; 'bf16' | 'fp16' | 'fp32' | 'fp8' or a torch dtype -> that dtype."""
    if index_dtype is None:
        return kv_dtype
    if isinstance(index_dtype, str):
        if index_dtype not in _INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {sorted(_INDEX_DTYPES)}, got {index_dtype!r}")
        return _INDEX_DTYPES[index_dtype]
    if index_dtype not in _INDEX_DTYPES.values():
        raise ValueError(f"index_dtype must be one of {sorted(_INDEX_DTYPES)}, got {index_dtype}")
    return index_dtype


def plan_cache(layout: CacheLayout, token_budget: int, *, kv_dtype: torch.dtype = torch.bfloat16,
               index_dtype=None) -> CachePlan:
    """Enough pages for `token_budget` cached tokens (rounded up to whole pages).

    Every sequence rounds its own length up to whole pages, so a batch of B sequences fits in a budget of
    sum(ceil(len_b / page_size)) * page_size tokens.
    """
    if not isinstance(token_budget, int) or token_budget <= 0:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if kv_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"kv_dtype must be torch.bfloat16, torch.float16 or torch.float32 (the model's dtype), got "
                         f"{kv_dtype!r}")
    num_pages = -(-token_budget // layout.page_size)
    return CachePlan(layout, num_pages, kv_dtype, resolve_index_dtype(index_dtype, kv_dtype))


def page_keys(tokens, page_size: int, salt: bytes = b"", *, keys: Sequence[bytes] = ()) -> list[bytes]:
    """One key per full page of `tokens` (ids), each a digest of its page's ids chained to the previous page's key:
    two sequences' page i have equal keys exactly when their first (i + 1) * page_size ids (and salts) are equal.

    salt: what else decides the pages' contents (a digest of a prompt's images; b"" for text). keys: the keys of
    the first pages of `tokens`, known already: only the pages after them are hashed, chained to the last one.
    """
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    out = list(keys)
    prev = out[-1] if out else hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(len(out), ids.numel() // page_size):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].numpy().tobytes(),
                               digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class _PrefixIndex:
    """Registered full pages by key, and those no sequence holds (idle: evictable, least recently used first)."""

    page: dict = field(default_factory=dict)  # key -> page id
    key: dict = field(default_factory=dict)  # page id -> key
    idle: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # page id -> None

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of leading `keys` that are registered."""
        pages = []
        for k in keys:
            if k not in self.page:
                break
            pages.append(self.page[k])
        return pages

    def forget(self, page: int) -> None:
        del self.page[self.key.pop(page)]
        self.idle.pop(page, None)


@dataclass
class _Sequence:
    pages: list[int]
    length: int = 0

    def __post_init__(self):
        self.page_ids = torch.tensor(self.pages, dtype=torch.int32)

    def capacity(self, page_size: int) -> int:
        return len(self.pages) * page_size


@dataclass
class _Step:
    """Per-forward state shared by all layers: which sequences, where the new tokens go."""

    seq_ids: list[int]
    q_lens: list[int]  # per row: seq_ids' sequences, then any padding rows of the step's buffers
    lens: list[int]  # cached tokens after this step, per row
    slots: torch.Tensor  # int64 [T_new]: flat pool position of each new token
    block_table: torch.Tensor  # int32 [B, max reserved pages] on the cache device
    seq_lens: torch.Tensor  # int32 [B] on the cache device
    cu_seqlens_q: torch.Tensor  # int32 [B+1] on the cache device
    written: set


class StepBuffers:
    """Device tensors that `PagedCache.step(..., buffers=)` fills in place for one batch of sequences with a fixed
    number of new tokens each: slots int64 [T], seq_lens int32 [R], cu_seqlens int32 [R+1], block_table int32 [R, W]
    for R rows: the batch's sequences, then `rows - B` padding rows (a CUDA graph recorded for R rows serves a
    batch of fewer sequences). A padding row's tokens are written into the cache's scratch page and attend to
    themselves alone; its outputs are left out by the caller.

    cu_seqlens depends only on the shape (R rows of q_len tokens) and is written once, when the buffers are made, so
    host reads of it cached per tensor version (`openm3.ops.host.host_list`) stay valid and no step needs a device
    sync. The page table is written when the buffers are made and again by `bind`, which hands them to another
    batch of at most R sequences whose pages fit in W columns (a CUDA graph recorded over these buffers then serves
    that batch too); between binds a step whose table would change is refused. width: W (at least the batch's
    widest table; the columns past a sequence's pages are zero, and the kernels never read past its length).
    """

    def __init__(self, cache: "PagedCache", seq_ids: Sequence[int], q_len: int, width: int | None = None,
                 rows: int | None = None):
        dev = cache.device
        self.q_len = q_len
        self.rows = len(seq_ids) if rows is None else rows
        if self.rows < len(seq_ids) or q_len > cache.layout.page_size:
            raise ValueError(f"rows must be at least the batch's {len(seq_ids)} sequences and q_len at most a page "
                             f"({cache.layout.page_size}), got rows={rows}, q_len={q_len}")
        self.slots = torch.zeros(self.rows * q_len, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(self.rows, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(0, self.rows * q_len + 1, q_len, dtype=torch.int32, device=dev)
        self.width = cache.table_width(seq_ids) if width is None else width
        self._table_host = self._host_table(cache, seq_ids)
        self.block_table = self._table_host.to(dev)
        self.seq_ids = tuple(seq_ids)
        self._releases = cache.releases  # the table can only change after a release (a reused sequence id)

    @property
    def padding(self) -> int:
        """Padding rows after the bound batch's sequences."""
        return self.rows - len(self.seq_ids)

    def _host_table(self, cache: "PagedCache", seq_ids: Sequence[int]) -> torch.Tensor:
        table = torch.zeros(self.rows, self.width, dtype=torch.int32)
        table[:len(seq_ids)] = cache.host_table(seq_ids, self.width)
        table[len(seq_ids):, 0] = cache.scratch_page
        return table

    def bind(self, cache: "PagedCache", seq_ids: Sequence[int]) -> None:
        """Hands the buffers to another batch of at most `rows` sequences (same q_len, pages within `width`):
        writes its page table into `block_table` in place (ordered after the work already queued on the device)."""
        if not 0 < len(seq_ids) <= self.rows:
            raise ValueError(f"buffers were made for at most {self.rows} sequences, got {len(seq_ids)}")
        if tuple(seq_ids) == self.seq_ids and cache.releases == self._releases:
            return
        table = self._host_table(cache, seq_ids)
        copy_from_host(self.block_table, table)
        self._table_host, self.seq_ids, self._releases = table, tuple(seq_ids), cache.releases

    def fill(self, cache: "PagedCache", seq_ids: Sequence[int], q_lens: Sequence[int], slots: torch.Tensor,
             seq_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Writes one step's values (the padding rows' too) -> (slots, block_table, seq_lens, cu_seqlens), the
        buffers themselves."""
        if tuple(seq_ids) != self.seq_ids or any(n != self.q_len for n in q_lens):
            raise ValueError(f"buffers were made for sequences {list(self.seq_ids)} with {self.q_len} new tokens "
                             f"each, got sequences {list(seq_ids)} with {list(q_lens)}")
        if cache.releases != self._releases:  # a sequence id may have been released and reused: compare once
            if not torch.equal(self._host_table(cache, seq_ids), self._table_host):
                raise ValueError("the batch's page table changed since its buffers were made")
            self._releases = cache.releases
        if self.padding:
            pad = cache.scratch_page * cache.layout.page_size + torch.arange(self.q_len)
            slots = torch.cat([slots, pad.repeat(self.padding)])
            seq_lens = torch.cat([seq_lens, torch.full((self.padding,), self.q_len, dtype=seq_lens.dtype)])
        copy_from_host(self.slots, slots)
        copy_from_host(self.seq_lens, seq_lens)
        return self.slots, self.block_table, self.seq_lens, self.cu_seqlens


class PagedCache:
    """The caches of every layer plus one page table per sequence (see the module docstring)."""

    def __init__(self, plan: CachePlan, device: torch.device | str = "cpu", *, prefix_caching: bool = False):
        self.plan = plan
        self.layout = lay = plan.layout
        self.device = torch.device(device)
        shape = (plan.physical_pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
        self.k = [torch.zeros(shape, dtype=plan.kv_dtype, device=self.device) for _ in lay.sparse]
        self.v = [torch.zeros(shape, dtype=plan.kv_dtype, device=self.device) for _ in lay.sparse]
        ishape = (plan.physical_pages, lay.page_size, lay.index_head_dim)
        self.ki = [torch.zeros(ishape, dtype=plan.index_dtype, device=self.device) if s else None for s in lay.sparse]
        fp8 = plan.index_dtype == FP8
        self.ki_scale = [torch.zeros(ishape[:2], dtype=decode.SCALE_E8M0, device=self.device) if s and fp8
                         else None for s in lay.sparse]
        self._free = list(range(plan.num_pages))  # kept sorted: allocation takes the lowest ids
        self.scratch_page = plan.num_pages  # never allocated: padding rows of graph batches write here
        self._holders = [0] * plan.num_pages  # sequences holding each page (more than one: a shared prefix)
        self.prefix_caching = prefix_caching
        self._prefix = _PrefixIndex()
        self._seqs: dict[int, _Sequence] = {}
        self._step: _Step | None = None
        self._table_key: tuple | None = None  # batch whose page table is on the device
        self._table: torch.Tensor | None = None
        self.releases = 0  # sequences released so far: a page table built before a release may be stale

    # ------------------------------------------------------------------ sequences and pages

    @property
    def free_pages(self) -> int:
        """Pages a reservation can take: the free ones and the cached ones no sequence holds."""
        return len(self._free) + len(self._prefix.idle)

    @property
    def cached_pages(self) -> int:
        """Registered pages (prefix caching), held or idle."""
        return len(self._prefix.key)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.layout.page_size)

    def admit(self, requests: Mapping[int, int], *, prefixes: Mapping[int, Sequence[bytes]] | None = None
              ) -> dict[int, int]:
        """Reserve pages for new sequences, all or nothing: {seq_id: tokens to reserve (prompt + new tokens)}.

        prefixes: {seq_id: `page_keys` of the prompt's pages that may come from the cache} (prefix caching; leave
        the page holding the prompt's last token out, which must be computed for its logits). A sequence starts
        on the registered pages its leading keys match and its length is theirs. Returns {seq_id: tokens found
        cached}. Raises CacheFullError (nothing reserved) when the batch needs more pages than are free.
        """
        prefixes = prefixes or {}
        if prefixes and not self.prefix_caching:
            raise ValueError("prefixes: this cache was made without prefix_caching")
        need, matched = 0, {}
        for seq_id, tokens in requests.items():
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id} is already in the cache")
            if not isinstance(tokens, int) or tokens <= 0:
                raise ValueError(f"tokens to reserve for sequence {seq_id} must be a positive int, got {tokens!r}")
            keys = prefixes.get(seq_id, ())
            if len(keys) * self.layout.page_size >= tokens:
                raise ValueError(f"prefixes[{seq_id}]: {len(keys)} pages cover all {tokens} reserved tokens; the "
                                 f"prompt's last token must be left to compute")
            matched[seq_id] = self._prefix.match(keys)
            need += self.pages_for(tokens) - len(matched[seq_id])
        pinned = {p for pages in matched.values() for p in pages if p in self._prefix.idle}  # idle, about to be held
        if need > self.free_pages - len(pinned):
            raise CacheFullError(
                f"batch needs {need} pages ({need * self.layout.page_size} tokens) but only "
                f"{self.free_pages - len(pinned)} of {self.plan.num_pages} are free "
                f"({self.plan.token_capacity} tokens planned); raise the token budget or send fewer/shorter requests")
        for page in pinned:
            del self._prefix.idle[page]
        cached = {}
        for seq_id, tokens in requests.items():
            shared = matched[seq_id]
            pages = shared + self._allocate(self.pages_for(tokens) - len(shared))
            for page in pages:
                self._holders[page] += 1
            self._seqs[seq_id] = _Sequence(pages, length=len(shared) * self.layout.page_size)
            cached[seq_id] = self._seqs[seq_id].length
        return cached

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of `keys` (`page_keys`) are registered: what `admit` would start a sequence on."""
        return len(self._prefix.match(keys))

    def register(self, seq_id: int, keys: Sequence[bytes]) -> int:
        """Files a sequence's written full pages under their `page_keys` (prefix caching), so later sequences with
        the same leading tokens reuse them; pages whose key is filed already (another sequence wrote the same
        tokens) stay private. Returns how many pages were newly registered."""
        if not self.prefix_caching:
            raise ValueError("register: this cache was made without prefix_caching")
        seq = self._get(seq_id)
        ps, added = self.layout.page_size, 0
        for i, key in enumerate(keys[:seq.length // ps]):
            page = seq.pages[i]
            if page in self._prefix.key or key in self._prefix.page:
                continue
            self._prefix.page[key], self._prefix.key[page] = page, key
            added += 1
        return added

    def _get(self, seq_id: int) -> _Sequence:
        if seq_id not in self._seqs:
            raise ValueError(f"sequence {seq_id} is not in the cache")
        return self._seqs[seq_id]

    def _allocate(self, n: int) -> list[int]:
        """n page ids: free ones first (one contiguous run when the free list has one, so prefill can read a
        zero-copy view), then idle cached pages, least recently used first (they are unregistered)."""
        if n > len(self._free):
            evict = list(self._prefix.idle)[:n - len(self._free)]
            for page in evict:
                self._prefix.forget(page)
            self._free = sorted(self._free + evict)
        free = self._free
        run_start = 0
        for i in range(1, len(free) + 1):
            if i - run_start == n:
                pages = free[run_start:i]
                del free[run_start:i]
                return pages
            if i < len(free) and free[i] != free[i - 1] + 1:
                run_start = i
        pages = free[:n]
        del free[:n]
        return pages

    def release(self, seq_id: int) -> None:
        """Return a sequence's pages to the pool. Registered pages no other sequence holds stay cached (idle) until
        a reservation needs them; the sequence's last pages are the first to go."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        self._table_key = None
        self.releases += 1
        freed = []
        for page in reversed(seq.pages):
            self._holders[page] -= 1
            if self._holders[page]:
                continue
            if page in self._prefix.key:
                self._prefix.idle[page] = None
            else:
                freed.append(page)
        self._free = sorted(self._free + freed)

    def length(self, seq_id: int) -> int:
        """Tokens cached for a sequence."""
        return self._get(seq_id).length

    def capacity(self, seq_id: int) -> int:
        """Tokens a sequence's reservation holds (whole pages)."""
        return self._get(seq_id).capacity(self.layout.page_size)

    def page_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].pages)

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget the cached tokens of a sequence from position `length` on (rejected speculative / MTP draft
        tokens); their pages stay reserved and are overwritten by the next tokens. A registered page among them is
        unregistered first (prefix caching); one that other sequences hold too cannot be rewritten: ValueError."""
        seq = self._get(seq_id)
        if not isinstance(length, int) or not 0 <= length <= seq.length:
            raise ValueError(f"length must be an int in [0, {seq.length}] for sequence {seq_id}, got {length!r}")
        rewritten = seq.pages[length // self.layout.page_size:self.pages_for(seq.length)]
        shared = [p for p in rewritten if self._holders[p] > 1]
        if shared:
            raise ValueError(f"sequence {seq_id}: cannot truncate to {length} tokens: pages {shared} hold a prefix "
                             f"other sequences share")
        for page in rewritten:
            if page in self._prefix.key:
                self._prefix.forget(page)
        seq.length = length

    # ------------------------------------------------------------------ one forward pass

    @contextlib.contextmanager
    def step(self, seq_ids: Sequence[int], q_lens: Sequence[int], *, buffers: "StepBuffers | None" = None,
             advance: bool = True) -> Iterator["PagedCache"]:
        """Scope of one model forward over `q_lens[b]` new tokens of sequence `seq_ids[b]` (packed in that order).

        The lengths advance when the block exits without an exception (and `advance`; `advance=False` is for a
        forward that is recorded, not run: a CUDA-graph capture). buffers: device tensors the step's slots,
        lengths, cu_seqlens and page table are written into in place instead of new tensors, so a captured graph
        that read them reads each later step's values (`openm3.engine.graphs`).
        """
        if self._step is not None:
            raise RuntimeError("cache.step() is already open")
        if len(seq_ids) == 0 or len(seq_ids) != len(q_lens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct and match q_lens one to one, got {seq_ids} and {q_lens}")
        ps = self.layout.page_size
        lens, slots = [], []
        for seq_id, n in zip(seq_ids, q_lens):
            if seq_id not in self._seqs:
                raise ValueError(f"sequence {seq_id} was not admitted to the cache")
            seq = self._seqs[seq_id]
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"q_lens entries must be positive ints, got {n!r} for sequence {seq_id}")
            if seq.length + n > seq.capacity(ps):
                raise CacheFullError(f"sequence {seq_id}: {seq.length} cached + {n} new tokens exceed its "
                                     f"reservation of {seq.capacity(ps)} tokens")
            pos = torch.arange(seq.length, seq.length + n)
            slots.append(seq.page_ids[pos // ps].long() * ps + pos % ps)
            lens.append(seq.length + n)
        slots, lens_t = torch.cat(slots), torch.tensor(lens, dtype=torch.int32)
        if buffers is None:
            dev = self.device
            cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(q_lens).cumsum(0)
            step = _Step(list(seq_ids), list(q_lens), lens, slots.to(dev), self._batch_table(seq_ids), lens_t.to(dev),
                         cu.to(dev), set())
        else:  # the buffers' padding rows join q_lens and lens (seq_ids holds the real sequences alone)
            pads = buffers.rows - len(seq_ids)
            step = _Step(list(seq_ids), list(q_lens) + [buffers.q_len] * pads, lens + [buffers.q_len] * pads,
                         *buffers.fill(self, seq_ids, q_lens, slots, lens_t), set())
        self._step = step
        try:
            yield self
            if advance:
                for seq_id, n in zip(seq_ids, lens):
                    self._seqs[seq_id].length = n
        finally:
            self._step = None

    def _batch_table(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """int32 [B, max reserved pages] page table of a batch on the cache device (kept while the batch is)."""
        key = tuple(seq_ids)
        if self._table_key != key:  # pages are reserved up front, so a batch's table only changes with the batch
            self._table, self._table_key = self.host_table(seq_ids).to(self.device), key
        return self._table

    def host_table(self, seq_ids: Sequence[int], width: int | None = None) -> torch.Tensor:
        """int32 [B, width] page table of a batch on the host (zero-padded); width: at least the most pages any of
        the sequences holds (the default)."""
        need = self.table_width(seq_ids)
        if width is None:
            width = need
        elif width < need:
            raise ValueError(f"width must be at least the batch's {need} pages, got {width}")
        table = torch.zeros(len(seq_ids), width, dtype=torch.int32)
        for b, seq_id in enumerate(seq_ids):
            table[b, :len(self._seqs[seq_id].pages)] = self._seqs[seq_id].page_ids
        return table

    def table_width(self, seq_ids: Sequence[int]) -> int:
        """The most pages any of the sequences holds: the batch's page-table width."""
        return max(len(self._seqs[s].pages) for s in seq_ids)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qi: torch.Tensor | None,
               ki: torch.Tensor | None, *, cu_seqlens: torch.Tensor, scale: float, block_size: int | None = None,
               topk: int | None = None, local_blocks: int | None = None) -> torch.Tensor:
        """Store the new tokens' keys in layer `layer_idx` and attend the new queries to the cache.

        q: [T_new, Hq, D]; k, v: [T_new, Hkv, D]; qi: [T_new, Hi, Di] and ki: [T_new, Di] for MSA layers (None for
        dense ones); cu_seqlens: int32 [B+1] over the new tokens, as opened by `step`. Returns o [T_new, Hq, D].
        """
        st = self._step
        if st is None:
            raise RuntimeError("cache.attend() called outside cache.step()")
        if not 0 <= layer_idx < self.layout.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.layout.num_layers}), got {layer_idx}")
        if layer_idx in st.written:
            raise RuntimeError(f"layer {layer_idx} attended twice in one step")
        sparse = self.layout.sparse[layer_idx]
        total = st.slots.numel()
        mismatch = q.shape[0] != total or k.shape[0] != total or cu_seqlens.numel() != len(st.q_lens) + 1
        if not mismatch and cu_seqlens.device.type == "cpu":  # values too, where reading them costs no sync
            mismatch = not torch.equal(cu_seqlens.to(torch.int64), st.cu_seqlens_q.cpu().to(torch.int64))
        if mismatch:
            raise ValueError(f"the forward's tokens ({q.shape[0]}, cu_seqlens {cu_seqlens.tolist()}) do not match "
                             f"cache.step: new tokens per sequence {st.q_lens}")
        if sparse != (qi is not None and ki is not None):
            raise ValueError(f"layer {layer_idx} is {'an MSA' if sparse else 'a dense'} layer in the cache layout: "
                             f"qi and ki must {'' if sparse else 'not '}be given")
        if sparse and block_size != self.layout.page_size:
            raise ValueError(f"block_size {block_size} of layer {layer_idx} must equal the page size "
                             f"{self.layout.page_size}")
        st.written.add(layer_idx)
        self._write(layer_idx, k, v, ki, st.slots)

        backend = pick_backend(q)
        uniform = len(set(st.q_lens)) == 1 and st.q_lens[0] <= MAX_DECODE_QUERIES
        if backend == "triton" and uniform and decode_kernels_tile(self.layout.page_size):
            return self._attend_decode_kernels(layer_idx, q, qi, st, scale=scale, topk=topk, local_blocks=local_blocks)
        if backend == "triton":
            return self._attend_prefill(layer_idx, q, qi, st, scale=scale, topk=topk, local_blocks=local_blocks)
        return self._attend_reference(layer_idx, q, qi, st, scale=scale, topk=topk, local_blocks=local_blocks)

    # ------------------------------------------------------------------ internals

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, ki: torch.Tensor | None, slots: torch.Tensor):
        fp8 = ki is not None and self.ki[layer].dtype == FP8
        write_paged(slots, k, v, self.k[layer], self.v[layer], ki, None if ki is None else self.ki[layer],
                    self.ki_scale[layer] if fp8 else None)

    def _attend_reference(self, layer, q, qi, st: _Step, *, scale, topk, local_blocks):
        ps = self.layout.page_size
        if qi is None:  # dense layers: the model's own dense op (SDPA) over each sequence's cached tokens; the
            # paged reference (`decode.paged_dense_attention`, every block selected) gathers each query's keys
            k, v = (decode.gather_pages(pool, st.block_table, st.lens, ps).to(q.dtype)
                    for pool in (self.k[layer], self.v[layer]))
            return dense_attention(q, k, v, st.cu_seqlens_q, scale=scale, cu_seqlens_k=decode._cu(st.lens, q.device))
        idx = decode.paged_select_blocks(qi, self.ki[layer], st.block_table, st.cu_seqlens_q, st.lens,
                                         block_size=ps, topk=topk, local_blocks=local_blocks,
                                         ki_scale=self.ki_scale[layer])
        o, _ = decode.paged_sparse_attention(q, self.k[layer], self.v[layer], st.block_table, idx, st.cu_seqlens_q,
                                             st.lens, block_size=ps, scale=scale)
        return o

    def _attend_decode_kernels(self, layer, q, qi, st: _Step, *, scale, topk, local_blocks):
        from ..ops.msa import triton_decode

        q_len = st.q_lens[0]
        if qi is None:
            o, _ = triton_decode.decode_attention(q.contiguous(), self.k[layer], self.v[layer], st.block_table,
                                                  st.seq_lens, None, q_len=q_len, scale=scale)
            return o
        # one step = index scores, attention that merges each row's candidates itself, combine (3 launches)
        o, _, _ = triton_decode.decode_msa(q.contiguous(), qi.contiguous(), self.k[layer], self.v[layer],
                                           self.ki[layer], st.block_table, st.seq_lens, q_len=q_len, topk=topk,
                                           local_blocks=local_blocks, ki_scale=self.ki_scale[layer], scale=scale)
        return o

    def _tokens(self, pool: torch.Tensor, seq_id: int, length: int) -> torch.Tensor:
        """The first `length` cached tokens of a sequence: [length, ...]; a view when its pages are contiguous."""
        ps = self.layout.page_size
        pages = self._seqs[seq_id].pages[:self.pages_for(length)]
        flat = pool.flatten(0, 1)
        if pages == list(range(pages[0], pages[0] + len(pages))):
            return flat[pages[0] * ps: pages[0] * ps + length]
        ids = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        return pool.index_select(0, ids).flatten(0, 1)[:length]

    def _attend_prefill(self, layer, q, qi, st: _Step, *, scale, topk, local_blocks):
        """Prefill chunks on the fast path: per sequence, the MSA ops (or SDPA) over its cached tokens."""
        ps = self.layout.page_size
        outs, start = [], 0
        for seq_id, n_q, n_k in zip(st.seq_ids, st.q_lens, st.lens):
            qb = q[start:start + n_q]
            k = self._tokens(self.k[layer], seq_id, n_k).to(q.dtype)
            v = self._tokens(self.v[layer], seq_id, n_k).to(q.dtype)
            if qi is None:
                outs.append(dense_lower_right(qb, k, v, scale=scale))
            else:
                ki = self._tokens(self.ki[layer], seq_id, n_k)
                if self.ki_scale[layer] is not None:
                    ki = decode.dequantize_index_keys(ki, self._tokens(self.ki_scale[layer], seq_id, n_k))
                ki = ki.to(qi.dtype)
                cu_q = torch.tensor([0, n_q], dtype=torch.int32, device=q.device)
                cu_k = torch.tensor([0, n_k], dtype=torch.int32, device=q.device)
                idx = msa.select_blocks(qi[start:start + n_q].contiguous(), ki, cu_q, block_size=ps, topk=topk,
                                        local_blocks=local_blocks, cu_seqlens_k=cu_k)
                o, _ = msa.sparse_attention(qb.contiguous(), k, v, idx, cu_q, block_size=ps, scale=scale,
                                            cu_seqlens_k=cu_k)
                outs.append(o)
            start += n_q
        return torch.cat(outs, dim=0)


def decode_kernels_tile(page_size: int) -> bool:
    """Whether the Triton decode kernels take pages of `page_size` tokens (a power of two >= 16: their tiles span a
    page; `triton_common.check_block_size`)."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def dense_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention of the last q_len of k_len tokens without materialising a mask on CUDA.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Tk >= Tq. Returns [Tq, Hq, D]. SDPA with a lower-right causal bias
    runs the flash kernel (GQA native); if the kernel refuses GQA, each KV group runs on its own (the KV head
    expanded as a view).
    """
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv = q.shape[1], k.shape[1]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if q.shape[0] == k.shape[0]:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        return out[0].transpose(0, 1)
    bias = causal_lower_right(q.shape[0], k.shape[0])
    try:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale, enable_gqa=hq != hkv)
    except RuntimeError:  # a kernel that wants equal head counts: expand one KV group at a time (bounded memory)
        g = hq // hkv
        out = torch.cat([F.scaled_dot_product_attention(qh[:, j * g:(j + 1) * g], kh[:, j:j + 1].expand(-1, g, -1, -1),
                                                        vh[:, j:j + 1].expand(-1, g, -1, -1), attn_mask=bias,
                                                        scale=scale) for j in range(hkv)], dim=1)
    return out[0].transpose(0, 1)
