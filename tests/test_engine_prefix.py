"""Prefix caching (`PagedCache(prefix_caching=True)`, `BatchedGenerator`'s default): page keys, shared pages and
their bookkeeping, eviction, and on a tiny random model (dense + MSA + MoE, CPU) that a prompt prefilled on top of
cached pages gives the logits and tokens of a prefill from scratch."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from openm3.engine.batching import BatchedGenerator  # noqa: E402
from openm3.engine.cache import CacheFullError, CacheLayout, PagedCache, page_keys, plan_cache  # noqa: E402
from openm3.engine.scheduler import PromptImages, prefill  # noqa: E402
from openm3.models import M3TextConfig, M3TextModel  # noqa: E402

from batching_utils import hold_until_queued  # noqa: E402


@pytest.fixture(params=[False, True], ids=["plain-steps", "overlapped-steps"])
def overlap(request):
    """Decode steps launched ahead of the host or not (`BatchedGenerator(overlap=...)`): a request that ends has
    its pages registered while the step after its last token may still be running."""
    return request.param

LAYOUT = CacheLayout(sparse=(False, True), num_kv_heads=2, head_dim=8, index_head_dim=4, page_size=4)


def _cache(pages: int) -> PagedCache:
    return PagedCache(plan_cache(LAYOUT, pages * 4, kv_dtype=torch.float32), prefix_caching=True)


def _filed(cache: PagedCache, seq_id: int, tokens: int, prompt: list[int], written: int | None = None) -> list:
    """Admits a sequence reserving `tokens`, pretends its first `written` (default: all of `prompt`) were written,
    as a forward under `cache.step` would, and registers its full pages; returns the prompt's page keys."""
    keys = page_keys(prompt, 4)
    cache.admit({seq_id: tokens})
    cache._seqs[seq_id].length = len(prompt) if written is None else written
    cache.register(seq_id, keys)
    return keys


def test_page_keys_name_prefixes():
    a = list(range(10))
    keys = page_keys(a, 4)
    assert len(keys) == 2 and len(set(keys)) == 2  # full pages only
    assert page_keys(a[:8] + [99, 98], 4) == keys  # the partial page does not count
    b = [5] + a[1:]
    assert all(x != y for x, y in zip(page_keys(b, 4), keys))  # a change in page 0 changes every later key
    assert page_keys(a[:4] + [7] + a[5:], 4)[0] == keys[0] and page_keys(a[:4] + [7] + a[5:], 4)[1] != keys[1]
    assert all(x != y for x, y in zip(page_keys(a, 4, salt=b"image"), keys))
    longer = list(range(17))
    assert page_keys(longer, 4, keys=keys) == page_keys(longer, 4)  # continued from known keys


def test_shared_pages_are_held_counted_and_kept_after_release():
    cache = _cache(6)
    keys = _filed(cache, 0, 12, list(range(11)))
    assert cache.cached_pages == 2  # pages 0-1 full, page 2 partial
    first = cache.page_table(0)
    assert cache.admit({1: 14}, prefixes={1: keys}) == {1: 8}
    assert cache.page_table(1)[:2] == first[:2] and cache.length(1) == 8
    assert cache.free_pages == 6 - 3 - 2  # the shared pages are reserved once
    cache.release(0)
    assert cache.free_pages == 6 - 4 and cache.cached_pages == 2  # page 2 freed; 0-1 held by sequence 1
    cache.release(1)
    assert cache.free_pages == 6 and cache.cached_pages == 2  # idle: free to take, still cached
    assert cache.admit({2: 9}, prefixes={2: keys}) == {2: 8}
    assert cache.page_table(2)[:2] == first[:2]


def test_idle_pages_are_evicted_least_recently_used_first():
    cache = _cache(4)
    for seq_id, start in ((0, 0), (1, 100)):
        _filed(cache, seq_id, 8, list(range(start, start + 8)))
    cache.release(0)
    cache.release(1)
    assert cache.free_pages == 4 and cache.cached_pages == 4
    cache.admit({2: 4})  # takes sequence 0's last page: released first, the last page first
    keys0, keys1 = page_keys(list(range(8)), 4), page_keys(list(range(100, 108)), 4)
    assert cache.admit({3: 12}, prefixes={3: keys1}) == {3: 8}  # its new page was sequence 0's first
    assert cache.cached_pages == 2
    with pytest.raises(CacheFullError):
        cache.admit({4: 12}, prefixes={4: keys0})  # nothing of sequence 0 is left, and no page is free
    assert cache.cached_pages == 2  # a refused admission changes nothing


def test_admission_counts_matched_idle_pages_as_taken():
    cache = _cache(3)
    keys = _filed(cache, 0, 8, list(range(8)))
    cache.release(0)
    with pytest.raises(CacheFullError, match="needs 2 pages"):
        cache.admit({1: 16}, prefixes={1: keys})  # 2 matched + 2 new: only 1 page is free besides the matched
    assert cache.admit({1: 12}, prefixes={1: keys}) == {1: 8}


def test_truncate_keeps_shared_pages_intact():
    cache = _cache(6)
    keys = _filed(cache, 0, 12, list(range(8)), written=10)
    cache.truncate(0, 6)  # page 1 is rewritten: it is unregistered, page 0 stays
    assert cache.cached_pages == 1
    cache.admit({1: 12}, prefixes={1: keys})
    assert cache.length(1) == 4
    with pytest.raises(ValueError, match="other sequences share"):
        cache.truncate(1, 2)
    with pytest.raises(ValueError, match="last token must be left"):
        cache.admit({2: 8}, prefixes={2: keys})
    plain = PagedCache(plan_cache(LAYOUT, 16, kv_dtype=torch.float32))
    with pytest.raises(ValueError, match="without prefix_caching"):
        plain.admit({0: 12}, prefixes={0: keys})


def test_image_digest_tells_images_apart():
    pixels = torch.rand(4, 6)
    grid = torch.tensor([[1, 2, 2]])
    same = PromptImages(pixels.clone(), grid.clone()).digest()
    assert PromptImages(pixels, grid).digest() == same
    assert PromptImages(pixels + 1e-3, grid).digest() != same
    assert PromptImages(pixels, torch.tensor([[1, 4, 1]])).digest() != same
    assert PromptImages(None, None, pixels, grid).digest() != same  # a video is not an image


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)  # 16-token pages; dense + MSA layers, MoE
    return M3TextModel(config).eval()


def test_prefill_on_cached_pages_equals_full_forward(model):
    ps = model.config.index_block_size
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, model.config.vocab_size, (5 * ps + 3,), generator=gen)
    first = torch.cat([shared, torch.randint(0, model.config.vocab_size, (7,), generator=gen)])
    second = torch.cat([shared, torch.randint(0, model.config.vocab_size, (2 * ps + 5,), generator=gen)])
    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 4096, kv_dtype=torch.float32),
                       prefix_caching=True)
    cache.admit({0: first.numel() + 1})
    prefill(model, cache, [0], [first], chunk_size=3 * ps)
    assert cache.register(0, page_keys(first, ps)) == first.numel() // ps
    cache.release(0)
    keys = page_keys(second, ps)[:(second.numel() - 1) // ps]
    assert cache.admit({1: second.numel() + 1}, prefixes={1: keys}) == {1: 5 * ps}
    got = prefill(model, cache, [1], [second], chunk_size=ps + 1)
    with torch.no_grad():
        cu = torch.tensor([0, second.numel()], dtype=torch.int32)
        want = model(second, position_ids=torch.arange(second.numel()), cu_seqlens=cu).logits[-1]
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="must have more"):
        prefill(model, cache, [1], [second[:5 * ps]])


def test_conversation_turns_reuse_prompt_and_answer(model, overlap):
    """Turn 2 resends turn 1's prompt and answer: with the cache it computes only the rest, and every request's
    tokens equal those of a generator without the cache."""
    ps = model.config.index_block_size
    gen = torch.Generator().manual_seed(2)
    turn1 = torch.randint(0, model.config.vocab_size, (3 * ps + 5,), generator=gen).tolist()
    follow = torch.randint(0, model.config.vocab_size, (ps + 2,), generator=gen).tolist()

    def conversation(batcher):
        seen = []
        answer = []
        batcher(turn1, max_new_tokens=2 * ps, on_token=answer.append, on_cached=seen.append)
        turn2 = turn1 + answer + follow
        answer2 = []
        batcher(turn2, max_new_tokens=5, on_token=answer2.append, on_cached=seen.append)
        batcher.close()
        return answer, answer2, seen, len(turn2)

    cached = BatchedGenerator(model, token_budget=1024, max_batch=2, overlap=overlap)
    plain = BatchedGenerator(model, token_budget=1024, max_batch=2, prefix_caching=False,
                             overlap=overlap)
    a1, a2, seen, n2 = conversation(cached)
    b1, b2, _, _ = conversation(plain)
    assert (a1, a2) == (b1, b2)
    fed = len(turn1) + len(a1) - 1  # turn 1's last answer token was sampled, never fed
    assert seen == [0, fed // ps * ps]  # every full page turn 1 wrote, the answer's too
    assert cached.cached_tokens == fed // ps * ps and cached.prompt_tokens == len(turn1) + n2
    assert cached.cache.free_pages == cached.plan.num_pages  # idle cached pages count as free
    assert plain.cached_tokens == 0


def test_cached_pages_give_way_to_new_requests(model, overlap):
    """A cache full of idle pages still admits a request that needs them; a sequence's last pages go first, so
    the evicted prompt keeps its first page, and runs again with the same tokens."""
    ps = model.config.index_block_size
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (4 * ps, 6 * ps)]
    batcher = BatchedGenerator(model, token_budget=8 * ps, max_batch=1, overlap=overlap)
    seen = []
    out = [[] for _ in range(3)]
    for i, p in enumerate([prompts[0], prompts[1], prompts[0]]):
        batcher(p, max_new_tokens=ps, on_token=out[i].append, on_cached=seen.append)
    batcher.close()
    assert seen == [0, 0, ps]  # the second request took 3 of the first one's 4 cached pages, its last ones
    assert out[2] == out[0]


def test_requests_sharing_a_context_that_arrive_together_prefill_it_once(model, overlap):
    """Three requests with one long context (sub-agents over the same repository) wait together: the first
    prefills the context, the other two wait for the next group and read it from the cache, with the same tokens."""
    import threading

    from openm3.engine import generate

    ps = model.config.index_block_size
    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, model.config.vocab_size, (6 * ps + 3,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, model.config.vocab_size, (5 + i,), generator=gen).tolist() for i in range(3)]
    blocker = torch.randint(0, model.config.vocab_size, (9,), generator=gen).tolist()
    want = [generate(model, [p], max_new_tokens=3)[0][0].tokens for p in prompts]
    batcher = BatchedGenerator(model, token_budget=2048, max_batch=4, overlap=overlap)
    admitted = threading.Event()
    got, cached = [[] for _ in prompts], [[] for _ in prompts]

    def ask(i):
        admitted.wait(60)
        batcher(prompts[i], max_new_tokens=3, on_token=got[i].append, on_cached=cached[i].append)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    batcher(blocker, max_new_tokens=4, on_token=hold_until_queued(batcher, 3), on_cached=lambda _n: admitted.set())
    for t in threads:
        t.join(120)
    batcher.close()
    assert got == want
    assert sorted(c[0] for c in cached) == [0, 6 * ps, 6 * ps]



def test_random_arrivals_with_shared_prefixes_under_memory_pressure(model, overlap):
    """Everything at once: requests with shared prefixes of several lengths arrive at random moments into a cache
    too small for all of them (they wait, idle pages are evicted), prefill in small interleaved chunks beside each
    other and decode together. Every request's greedy tokens equal `generate`'s alone, every page comes back, and
    the cache served part of the prompts."""
    import random
    import threading
    import time

    from openm3.engine import generate

    ps = model.config.index_block_size
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    trunks = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (3 * ps + 2, 5 * ps)]
    prompts = []
    for i in range(8):
        trunk = trunks[i % 2][:rng.choice([ps, 2 * ps + 3, len(trunks[i % 2])])]
        prompts.append(trunk + torch.randint(0, model.config.vocab_size, (rng.randint(1, ps),), generator=gen).tolist())
    new = [rng.randint(1, 6) for _ in prompts]
    want = [generate(model, [p], max_new_tokens=n)[0][0].tokens for p, n in zip(prompts, new)]
    batcher = BatchedGenerator(model, token_budget=16 * ps, max_batch=3, chunk_size=ps + 5, overlap=overlap)
    got, cached = [[] for _ in prompts], [[] for _ in prompts]
    delays = [rng.uniform(0, 0.3) for _ in prompts]

    def ask(i):
        time.sleep(delays[i])
        batcher(prompts[i], max_new_tokens=new[i], on_token=got[i].append, on_cached=cached[i].append)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    batcher.close()
    assert got == want
    assert all(len(c) == 1 and 0 <= c[0] < len(p) and c[0] % ps == 0 for c, p in zip(cached, prompts))
    assert batcher.cached_tokens == sum(c[0] for c in cached) > 0
    assert batcher.cache.free_pages == batcher.plan.num_pages and max(batcher.batch_sizes) <= 3
