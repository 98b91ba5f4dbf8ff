"""Chunked prefill and batched decode steps over a `PagedCache`.

Prefill packs at most `chunk_size` prompt tokens per forward (a long prompt takes several forwards, short prompts
share one), so activation memory is bounded by the chunk and a 1M-token prompt runs in chunks; every chunk attends
to everything cached before it through the cache (MSA selection for MSA layers), which makes chunked prefill equal
to one forward over the whole prompt. Decode feeds one new token per running sequence per forward.

Vision-language models (`M3ForConditionalGeneration`): the cache serves the text decoder (`language_model`). For
a prompt with images the vision tower runs once, before its first chunk (`prompt_visual`: the visual tokens and
the placeholder positions they replace), and each chunk embeds its ids and puts in the visual tokens that fall
inside it; positions stay 1-D, so nothing else changes, and decode feeds token ids as for a text model. Images
inside a prefix the cache holds already (an agent's earlier screenshots) are not encoded again.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Collection, Iterator, NamedTuple, Sequence

import torch

from ..models.processor import VisionBatch
from .cache import PagedCache
from .sampling import check_count


class PromptImages(NamedTuple):
    """The images and videos of one prompt. Images as `openm3.models.processor.M3ImageProcessor` returns them (its
    tuple converts): `pixel_values` float [N, C*2*14*14] packed patches and `grid_thw` int [I, 3], one row per
    image in the order of the prompt's image placeholder runs. Videos as `M3VideoProcessor` returns them:
    `pixel_values_videos` [M, C*2*14*14] and `video_grid_thw` [K, 3], one row per clip. Either kind may be None."""

    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def digest(self) -> bytes:
        """A digest of every pixel and grid (shapes and dtypes included): equal for equal inputs. The prefix
        cache's salt for the prompt's pages (`openm3.engine.cache.page_keys`)."""
        h = hashlib.blake2b(digest_size=16)
        for t in self:
            h.update(b"-" if t is None else f"{t.dtype}{tuple(t.shape)}".encode())
            if t is not None:
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.digest()


def is_vision_language(model) -> bool:
    """Whether `model` is a vision-language model (a text decoder `language_model` + an `embed` for images)."""
    return hasattr(model, "language_model") and hasattr(model, "embed")


def text_model(model):
    """The text decoder the cache serves: `model` itself, or a VL model's `language_model`."""
    return model.language_model if is_vision_language(model) else model


def check_inference_model(model) -> None:
    """ValueError when `model` (or a VL model's text decoder) is in training mode: the engine runs models in eval
    mode, as `openm3.engine.for_inference` and the checkpoint loaders leave them. (A freshly built
    `M3TextModel(config)` is in training mode, where its forward computes the indexer KL, which a cached forward
    cannot.)"""
    if model.training or text_model(model).training:
        raise ValueError(f"model is in training mode: call model.eval() (or openm3.engine.for_inference(model)) "
                         f"before generating with this {type(model).__name__}")


def _on_host(grid) -> torch.Tensor | None:
    return None if grid is None else torch.as_tensor(grid).cpu()


def check_images(model, prompts: Sequence[torch.Tensor], images) -> list[PromptImages | None]:
    """Validates the per-prompt `images` (None, or one entry per prompt: None, `(pixel_values, grid_thw)`, a
    `PromptImages` or the `VisionBatch` that `openm3.models.M3Processor` returns) against the host prompts (int64
    [L_b]); returns them as `PromptImages` (grids on the host). Images need a VL model, and each prompt's image
    and video placeholders must match its images' and videos' visual tokens (a VL model's prompt without images
    may hold none). Reads nothing from the device."""
    if images is None:
        images = [None] * len(prompts)
    elif not isinstance(images, (list, tuple)) or len(images) != len(prompts):
        got = f"{len(images)} entries" if isinstance(images, (list, tuple)) else type(images).__name__
        raise ValueError(f"images: expected a list with one entry per prompt ({len(prompts)}; None for a prompt "
                         f"without images), got {got}")
    vl = is_vision_language(model)
    if not vl and any(im is not None for im in images):
        raise ValueError(f"images: the model is a text-only {type(model).__name__}; images need a vision-language "
                         f"model (M3ForConditionalGeneration, from a checkpoint with a vision_config)")
    if not vl:
        return [None] * len(prompts)
    vision = model.config.vision_config
    width = vision.num_channels * vision.temporal_patch_size * vision.patch_size ** 2
    out: list[PromptImages | None] = []
    for b, (prompt, im) in enumerate(zip(prompts, images)):
        where = f"images[{b}]"
        if isinstance(im, VisionBatch):  # the processor's: its clip counts and metadata only shaped the prompt
            im = None if im.pixel_values is None and im.pixel_values_videos is None else \
                (im.pixel_values, im.image_grid_thw, im.pixel_values_videos, im.video_grid_thw)
        if im is not None:
            if not isinstance(im, (tuple, list)) or len(im) not in (2, 4):
                raise ValueError(f"{where}: expected (pixel_values [N, {width}], grid_thw [I, 3]), a PromptImages "
                                 f"(with videos), a VisionBatch or None, got {type(im).__name__}")
            pixels, grid, video_pixels, video_grid = (*im, None, None)[:4]
            im = PromptImages(pixels, _on_host(grid), video_pixels, _on_host(video_grid))
        try:
            model.check_visual_placeholders(prompt, None if im is None else im.grid_thw,
                                            None if im is None else im.video_grid_thw)
        except ValueError as e:
            raise ValueError(f"prompt {b}: {e}") from None
        if im is not None:
            for name, pixels, grid in (("pixel_values", im.pixel_values, im.grid_thw),
                                       ("pixel_values_videos", im.pixel_values_videos, im.video_grid_thw)):
                patches = 0 if grid is None else int(grid.prod(dim=-1).sum())
                if pixels is None and grid is None:
                    continue
                if not isinstance(pixels, torch.Tensor) or not pixels.dtype.is_floating_point \
                        or tuple(pixels.shape) != (patches, width):
                    raise ValueError(f"{where}.{name}: expected a float tensor [{patches}, {width}] (the patches "
                                     f"its grid describes), got {getattr(pixels, 'dtype', type(pixels).__name__)} "
                                     f"{tuple(getattr(pixels, 'shape', ()))}")
        out.append(im)
    return out


class PromptVisual(NamedTuple):
    """What a prompt's images put into its embeddings: the image placeholders' positions in the prompt (int64
    [n], ascending, host) and the visual tokens that replace their embeddings ([n, hidden], on the model's device,
    in the text embeddings' dtype)."""

    positions: torch.Tensor
    tokens: torch.Tensor

    def chunk(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The placeholders inside prompt positions [start, stop): (positions relative to start, host; their
        visual tokens, device). No device read (the positions are on the host)."""
        lo, hi = (int(torch.searchsorted(self.positions, x)) for x in (start, stop))
        return self.positions[lo:hi] - start, self.tokens[lo:hi]


@torch.no_grad()
def prompt_visual(model, prompt: torch.Tensor, images: PromptImages, start: int = 0) -> PromptVisual | None:
    """The visual tokens of one prompt's images and videos (the vision tower and projector, run once per request)
    and the positions of the placeholders they replace (`prompt`: int64 [L] on the host), in prompt order. Only
    these stay in memory during the prompt's prefill, not the whole prompt's embeddings: each chunk embeds its ids
    and scatters its share (`_forward`), as `M3ForConditionalGeneration.embed` does for the whole prompt. The
    counts are `check_images`'s (host) business.

    start: prompt positions before it are cached already (a prefix cache's pages): the tower runs only for the
    images and video clips with a placeholder at or after it (a grid row's tokens do not depend on the other
    rows), and None is returned when there are none."""
    tower = next(model.vision_tower.parameters())
    dtype = model.language_model.embed_tokens.weight.dtype
    merge = model.config.vision_config.spatial_merge_size
    positions, tokens = [], []
    for pixels, grid, token in ((images.pixel_values, images.grid_thw, model.config.image_token_index),
                                (images.pixel_values_videos, images.video_grid_thw, model.config.video_token_index)):
        if pixels is None:
            continue
        where = (prompt == token).nonzero().flatten()  # one run per grid row, in row order
        patches = grid.prod(dim=-1)  # a host grid: its values are read without a sync
        ends = (patches // merge ** 2).cumsum(0)
        first = int((where[ends - 1] < start).sum())  # rows whose runs end before `start` are cached whole
        if first == len(grid):
            continue
        skip_tokens = int(ends[first - 1]) if first else 0
        rows = pixels[int(patches[:first].sum()):].to(device=tower.device, dtype=tower.dtype)
        tokens.append(model.visual_tokens(rows, grid[first:]).to(dtype))
        positions.append(where[skip_tokens:])
    if not positions:
        return None
    positions = torch.cat(positions)
    order = torch.argsort(positions)  # host: images' and videos' placeholders interleave in the prompt
    return PromptVisual(positions[order], torch.cat(tokens)[order.to(tower.device)])


def _forward(model, cache: PagedCache, seq_ids: list[int], pieces: list[torch.Tensor], starts: list[int],
             logit_rows: list[int], visual: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
             ) -> torch.Tensor:
    """One forward over `pieces[b]` (new token ids of sequence seq_ids[b], first at position starts[b]);
    returns logits for the packed rows `logit_rows` -> [len(logit_rows), V]. `visual[b]` (`PromptVisual.chunk`'s
    piece-relative positions and visual tokens, or None) replaces those rows of piece b's embeddings."""
    device = cache.device
    lens = [p.numel() for p in pieces]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(device)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    rows = torch.tensor(logit_rows, dtype=torch.int64, device=device)
    if visual is None or all(v is None for v in visual):
        inputs = {"input_ids": torch.cat(pieces).to(device)}
    else:  # embedded here (an exact gather, as the model would; the ids were checked on the host), visual rows put in
        x = model.embed_tokens(torch.cat(pieces).to(device))
        for off, v in zip(cu.tolist(), visual):  # piece b starts at packed row cu[b]
            if v is not None and v[0].numel():
                x.index_copy_(0, (v[0] + off).to(device), v[1])
        inputs = {"inputs_embeds": x}
    with cache.step(seq_ids, lens):
        return model(**inputs, position_ids=pos, cu_seqlens=cu.to(device), logits_index=rows, cache=cache).logits


class Chunk(NamedTuple):
    """What one prefill forward gives (`prefill_chunks`): `finished` indices b of the prompts whose last token it
    held, their next-token logits [len(finished), V] fp32, the prompt tokens it `consumed`, and for the prompts
    asked for every row (`all_logits`), `rows[b] = (position of the piece's first token, its rows' logits [n, V]
    fp32)`: row i predicts the token after position + i."""

    finished: list[int]
    logits: torch.Tensor
    consumed: int
    rows: dict


def all_logits_rows(vocab_size: int, budget_bytes: int = 1 << 30) -> int:
    """Tokens of a prompt whose every logits row is kept that one forward takes (fp32 rows in `budget_bytes`)."""
    return max(1, budget_bytes // (4 * vocab_size))


@torch.no_grad()
def prefill(model, cache: PagedCache, seq_ids: Sequence[int], prompts: Sequence[torch.Tensor], *,
            chunk_size: int = 8192, on_chunk: Callable[[int], None] | None = None,
            images: Sequence[PromptImages | None] | None = None,
            on_rows: Callable[[int, int, torch.Tensor], None] | None = None,
            all_logits: Sequence[bool] | None = None) -> torch.Tensor:
    """Runs the prompts through the model in chunks; returns the last prompt token's logits [B, V] (fp32).

    model: an `M3TextModel` or a VL `M3ForConditionalGeneration`; seq_ids: admitted cache sequences, each holding
    fewer tokens than its prompt (the first `cache.length` tokens of a prompt are taken as cached, e.g. a prefix
    cache's pages, and the rest is computed); prompts: int64 [L_b] each; images: None, or per prompt None or
    `PromptImages` (VL models only; see `check_images`): such a prompt's visual tokens are computed once
    (`prompt_visual`) and each chunk scatters its share of them over its ids' embeddings.
    on_chunk(n) is called after each forward with the number of prompt tokens it consumed (for progress bars).
    all_logits[b]: keep every logits row of prompt b, handed to on_rows(b, position, rows) after each forward
    (`Chunk.rows`; prompt log probabilities).
    """
    if all_logits is not None and any(all_logits) and on_rows is None:
        raise ValueError("all_logits: the kept rows need an on_rows callback")
    last: list[torch.Tensor | None] = [None] * len(prompts)
    for chunk in prefill_chunks(model, cache, seq_ids, prompts, chunk_size=chunk_size, images=images,
                                all_logits=all_logits):
        for b, lg in zip(chunk.finished, chunk.logits):
            last[b] = lg
        for b, (position, rows) in chunk.rows.items():
            on_rows(b, position, rows)
        if on_chunk is not None:
            on_chunk(chunk.consumed)
    return torch.stack(last)


def prefill_chunks(model, cache: PagedCache, seq_ids: Sequence[int], prompts: Sequence[torch.Tensor], *,
                   chunk_size: int = 8192, images: Sequence[PromptImages | None] | None = None,
                   all_logits: Sequence[bool] | None = None, dropped: Collection[int] = ()) -> Iterator[Chunk]:
    """`prefill` one forward at a time (a server decodes its running requests between them): checks the arguments
    and embeds the images when first advanced, then yields a `Chunk` after each forward. Arguments as `prefill`'s;
    a prompt with `all_logits[b]` takes at most `all_logits_rows` tokens per forward (its rows' memory).
    dropped: indices of prompts to leave out from the next forward on (read before each one: a caller may add to
    it between two chunks, e.g. for a request nobody waits for any more)."""
    check_count("chunk_size", chunk_size)
    check_inference_model(model)
    if len(seq_ids) != len(prompts):
        raise ValueError(f"seq_ids ({len(seq_ids)}) and prompts ({len(prompts)}) must match")
    host = [p.cpu() for p in prompts]
    done = [cache.length(s) for s in seq_ids]
    for b, (d, p) in enumerate(zip(done, prompts)):
        if d >= p.numel():
            raise ValueError(f"sequence {seq_ids[b]} holds {d} cached tokens; its prompt ({p.numel()} tokens) must "
                             f"have more, to compute the last one's logits")
    with torch.no_grad():
        visual = [None if im is None else prompt_visual(model, p, im, start=d)
                  for p, im, d in zip(host, check_images(model, host, images), done)]
    lm = text_model(model)
    every = list(all_logits) if all_logits is not None else [False] * len(prompts)
    if len(every) != len(prompts):
        raise ValueError(f"all_logits ({len(every)}) and prompts ({len(prompts)}) must match")
    cap = all_logits_rows(lm.config.vocab_size)
    while any(d < p.numel() for b, (d, p) in enumerate(zip(done, prompts)) if b not in dropped):
        batch, pieces, starts, rows, owners, slices = [], [], [], [], [], []
        kept: dict[int, tuple[int, int, int]] = {}  # b -> (position, first row, rows) of the kept rows
        last: list[int] = []  # the finished prompts' next-token rows, as indices into `rows`
        budget, row = chunk_size, 0
        for b, prompt in enumerate(prompts):
            n = min(prompt.numel() - done[b], budget, cap if every[b] else budget)
            if n <= 0 or b in dropped:
                continue
            if every[b]:
                kept[b] = (done[b], len(rows), n)
                rows.extend(range(row, row + n))
            batch.append(seq_ids[b])
            pieces.append(prompt[done[b]:done[b] + n])
            slices.append(None if visual[b] is None else visual[b].chunk(done[b], done[b] + n))
            starts.append(done[b])
            row += n
            if done[b] + n == prompt.numel():  # its next-token row: the last of its kept rows, or its own
                if not every[b]:
                    rows.append(row - 1)
                owners.append(b)
                last.append(len(rows) - 1 if not every[b] else kept[b][1] + n - 1)
            done[b] += n
            budget -= n
            if budget == 0:
                break
        with torch.no_grad():
            logits = _forward(lm, cache, batch, pieces, starts, rows, slices).float()
        yield Chunk(owners, logits[last], sum(p.numel() for p in pieces),
                    {b: (pos, logits[first:first + n]) for b, (pos, first, n) in kept.items()})


@torch.no_grad()
def decode_step(model, cache: PagedCache, seq_ids: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
    """Feeds one token per sequence (tokens int64 [B], at position = the sequence's cached length) -> next-token
    logits [B, V] (fp32); or q tokens per sequence (tokens [B, q]: a token and its speculative drafts) -> logits
    after each of them [B, q, V]. model: a text model or a VL model (its text decoder runs)."""
    seq_ids = list(seq_ids)
    if tokens.dim() not in (1, 2) or tokens.shape[0] != len(seq_ids) or tokens.numel() == 0:
        raise ValueError(f"tokens must be [B={len(seq_ids)}] or [B, q], got {tuple(tokens.shape)}")
    rows = tokens.reshape(len(seq_ids), -1)
    starts = [cache.length(s) for s in seq_ids]
    logits = _forward(text_model(model), cache, seq_ids, list(rows.cpu()), starts, list(range(rows.numel()))).float()
    return logits if tokens.dim() == 1 else logits.view(*rows.shape, -1)
