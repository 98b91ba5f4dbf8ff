"""How much a prefill's logits move when the index keys written to the cache carry one bf16 ulp of noise (30% of
the values), with bf16 and with fp8 index keys: the CPU experiment behind session 39's rewrite of
tests/gpu/test_engine_prefix_gpu.py (random m3-tiny, top-2 blocks).

    .venv/bin/python scripts/fp8_index_noise.py

Session 39 (CPU): bf16 keys 0.0068 of the logits' scale, fp8 keys 0.26 (e4m3 steps of ~6% flip near-tied block
selections), against 0.12 seen on the H100 between a fresh prefill and one over cached pages with fp8 keys.
"""

from __future__ import annotations

import torch

from openm3.engine import cache as cache_mod
from openm3.engine.cache import CacheLayout, PagedCache, plan_cache
from openm3.engine.scheduler import prefill
from openm3.models import M3TextConfig, M3TextModel


def prefill_logits(model: M3TextModel, prompt: torch.Tensor, index_dtype: str | None, noise: bool) -> torch.Tensor:
    """The prompt's prefill logits over a fresh cache; with `noise`, one bf16 ulp added to 30% of the index-key
    values as they are written (seeded by the first slot, so the same chunks get the same noise)."""
    real = cache_mod.write_paged

    def noisy_write(slots, k, v, kp, vp, ki, kip, *args, **kwargs):
        if ki is not None:
            flip = torch.rand(ki.shape, generator=torch.Generator().manual_seed(int(slots[0]) + 7)) < 0.3
            bits = ki.contiguous().view(torch.int16)
            ki = torch.where(flip, bits + 1, bits).view(torch.bfloat16)
        return real(slots, k, v, kp, vp, ki, kip, *args, **kwargs)

    ps = model.config.index_block_size
    cache = PagedCache(plan_cache(CacheLayout.from_config(model.config), 128 * ps, kv_dtype=torch.bfloat16,
                                  index_dtype=index_dtype), "cpu")
    cache.admit({1: prompt.numel() + 1})
    if noise:
        cache_mod.write_paged = noisy_write
    try:
        return prefill(model, cache, [1], [prompt], chunk_size=4 * ps)
    finally:
        cache_mod.write_paged = real


def main() -> None:
    torch.manual_seed(0)
    config = M3TextConfig.from_name("m3-tiny", index_topk_blocks=2)
    model = M3TextModel(config).to("cpu", torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (29 * config.index_block_size + 8,),
                           generator=torch.Generator().manual_seed(1))
    for index_dtype in (None, "fp8"):
        a = prefill_logits(model, prompt, index_dtype, noise=False)
        b = prefill_logits(model, prompt, index_dtype, noise=True)
        print(f"index keys {index_dtype or 'bf16'}: logits moved by {((a - b).abs().max() / a.abs().max()).item():.4f}"
              " of their scale by one-ulp index-key noise")


if __name__ == "__main__":
    main()
