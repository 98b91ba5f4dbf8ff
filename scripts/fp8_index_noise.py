"""How much a prefill's logits move when the index keys written to the cache carry one bf16 ulp of noise (30% of
the values), with bf16 and with fp8 index keys: the CPU experiment behind session 39's rewrite of
tests/gpu/test_engine_prefix_gpu.py (random m3-tiny, top-2 blocks).

    .venv/bin/python scripts/fp8_index_noise.py

Session 39 (CPU): bf16 keys 0.0068 of the logits' scale, fp8 keys 0.26 (e4m3 steps of ~6% flip near-tied block
selections), against 0.12 seen on the H100 between a fresh prefill and one over cached pages with fp8 keys.
"""
import torch
from openm3.models import M3TextConfig, M3TextModel
from openm3.engine import cache as cache_mod
from openm3.engine.cache import CacheLayout, PagedCache, plan_cache
from openm3.engine.scheduler import prefill
torch.manual_seed(0)
config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)
model = M3TextModel(config).to("cpu", torch.bfloat16).eval()
ps = config.index_block_size
gen = torch.Generator().manual_seed(1)
second = torch.randint(0, config.vocab_size, (29 * ps + 8,), generator=gen)
real = cache_mod.write_paged
def run(idx, perturb):
    def wp(slots, k, v, kp, vp, ki, kip, *a, **kw):
        if perturb and ki is not None:
            g = torch.Generator().manual_seed(int(slots[0]) + 7)
            flip = (torch.rand(ki.shape, generator=g) < 0.3)
            bits = ki.contiguous().view(torch.int16)
            ki = torch.where(flip, bits + 1, bits).view(torch.bfloat16)  # one bf16 ulp on 30% of values
        return real(slots, k, v, kp, vp, ki, kip, *a, **kw)
    cache_mod.write_paged = wp
    c = PagedCache(plan_cache(CacheLayout.from_config(config), 128 * ps, kv_dtype=torch.bfloat16, index_dtype=idx), "cpu")
    c.admit({1: second.numel() + 1})
    out = prefill(model, c, [1], [second], chunk_size=4 * ps)
    cache_mod.write_paged = real
    return out
for idx in (None, "fp8"):
    a, b = run(idx, False), run(idx, True)
    print(idx, "rel diff from one-ulp index-key noise:", ((a - b).abs().max() / a.abs().max()).item())
