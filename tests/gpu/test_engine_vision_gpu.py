"""The engine over a vision-language model on the GPU: a prompt with a video and an image, prefilled in chunks
(Triton MSA kernels, CUDA tensors) and decoded, equals one full forward of the VL model.

    .venv/bin/python -m pytest -q -m gpu tests/gpu/test_engine_vision_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

IMG, VID, START, END = 5, 6, 7, 8


def test_video_and_image_prompt_prefill_and_decode_equal_the_full_forward():
    """fp32 on CUDA (the kernels' IEEE dots), so the chunked path and the full forward differ by reduction order
    only; written in session 9 after its device budget (the CPU twin in tests/test_engine_vision.py passed)."""
    from openm3.engine.cache import CacheLayout, PagedCache, plan_cache
    from openm3.engine.scheduler import PromptImages, decode_step, prefill
    from openm3.models import M3ForConditionalGeneration, M3VLConfig
    from openm3.models.processor import M3ImageProcessor, M3VideoProcessor

    torch.manual_seed(0)
    config = M3VLConfig.from_name("m3-tiny", image_token_index=IMG, video_token_index=VID, index_topk_blocks=2,
                                  num_hidden_layers=3, layer_types=["full_attention"] + ["minimax_m3_sparse"] * 2,
                                  mlp_layer_types=["dense", "sparse", "sparse"])
    vl = M3ForConditionalGeneration(config).to("cuda").eval()
    rng = np.random.default_rng(5)
    video_pixels, video_grid, _ = M3VideoProcessor()([rng.integers(0, 256, (10, 56, 56, 3), dtype=np.uint8)])
    image_pixels, image_grid = M3ImageProcessor()([rng.integers(0, 256, (28, 56, 3), dtype=np.uint8)])
    gen = torch.Generator().manual_seed(6)

    def text(n):
        return torch.randint(10, 4096, (n,), generator=gen).tolist()

    prompt = text(5)
    for _ in range(5):  # 5 temporal patches of 2 x 2 merged patches
        prompt += [START] + [VID] * 4 + [END]
    prompt += text(6) + [START] + [IMG] * 6 + [END] + text(40)
    seq = prompt + text(3)
    cache = PagedCache(plan_cache(CacheLayout.from_config(config.text_config), 128, kv_dtype=torch.float32), "cuda")
    cache.admit({0: len(seq)})
    images = PromptImages(image_pixels, image_grid, video_pixels, video_grid)
    got = list(prefill(vl, cache, [0], [torch.tensor(prompt)], chunk_size=16, images=[images]))
    for s in range(3):
        got += list(decode_step(vl, cache, [0], torch.tensor([seq[len(prompt) + s]])))
    with torch.no_grad():
        full = vl(torch.tensor(seq, device="cuda"), image_pixels.cuda(), image_grid, video_pixels.cuda(), video_grid,
                  cu_seqlens=torch.tensor([0, len(seq)], dtype=torch.int32, device="cuda")).logits
    err = (torch.stack(got).float() - full[len(prompt) - 1: len(seq)].float()).abs().max().item()
    assert err < 1e-3, err
