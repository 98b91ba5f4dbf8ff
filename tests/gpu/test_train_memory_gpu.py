"""The training memory estimate against a CUDA run: `torch.cuda.max_memory_allocated` over two optimizer steps of
the trainer (bf16 autocast over fp32 weights, the Triton MSA kernels, the grouped MoE, the fused losses; eager,
no --compile) within 0.7-1.3x of `MemoryEstimate.allocated` (the estimate less its CUDA-context allowance, which
the allocator does not see), for m3-tiny and m3-small shapes with and without activation checkpointing, fp32,
the dense warm-up, and vision rows.

Why that band: on CPU the estimate's activations match what the trainer holds within 0.3% and its total the step's
peak within 2% (tests/test_train_memory.py), but the CUDA kernels' saved tensors (cuDNN / flash SDPA, Triton MSA
and KL, fused RMSNorm, the Inductor-fused loss and SwiGLU) were read from the code, not measured; compiled runs of
m3-small in benchmarks/results (8K-64K tokens, with and without checkpointing) peaked at 0.83-0.92x of it.
"""

from __future__ import annotations

import gc

import pytest
import torch

from test_train_memory import Rows

pytestmark = pytest.mark.gpu

CASES = {  # name: (preset, decoder layers, TrainConfig fields, images per vision row)
    "tiny-2x8192": ("m3-tiny", None, dict(seq_len=8192), 0),
    "tiny-2x8192-ckpt": ("m3-tiny", None, dict(seq_len=8192, activation_checkpointing=True), 0),
    "tiny-2x4096-fp32": ("m3-tiny", None, dict(seq_len=4096, param_dtype="float32"), 0),  # no autocast
    "small4-2x8192": ("m3-small", 4, dict(seq_len=8192), 0),
    "small4-2x8192-warmup": ("m3-small", 4, dict(seq_len=8192, msa_switch_step=10), 0),
    "small4-2x16384-ckpt": ("m3-small", 4, dict(seq_len=16384, activation_checkpointing=True), 0),
    "small4-2x16384-ckpt-keep": ("m3-small", 4, dict(seq_len=16384, activation_checkpointing=True,
                                                     ac_keep_attention=True), 0),
    "small2-vl-2x4096-img64": ("m3-small", 2, dict(seq_len=4096), 64),  # 1 patch per token of an image row
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimate_brackets_the_cuda_peak(tmp_path, name):
    from openm3.models.config import M3TextConfig
    from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig
    from openm3.models.text import M3TextModel
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import Trainer

    preset, layers, fields, images = CASES[name]
    depth = {"num_hidden_layers": layers} if layers else {}
    text = M3TextConfig.from_name(preset, **depth)
    vocab = text.vocab_size
    vision = images > 0
    cfg = TrainConfig(model=preset, layers=layers, recipe="native" if vision else "text-only", steps=10,
                      text_rows=2 if vision else 4, micro_batch=2,
                      mixture={"text": 1.0, "image": 1.0, "video": 0.0} if vision else None,
                      out_dir=str(tmp_path / "run"), progress=False, tensorboard=False, device="cuda", **fields)
    build = (lambda: M3ForConditionalGeneration(M3VLConfig.from_name(preset, vocab - 2, vocab - 1, **depth))) \
        if vision else (lambda: M3TextModel(text))
    source = Rows(cfg.seq_len, images, vocab)

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, build, source)
    try:
        for _ in range(2):  # the second step's forwards run beside AdamW's state; no checkpoint written
            record = trainer.train_step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        est = trainer.memory_estimate(patches_per_token=source.patches_per_token())
    finally:
        trainer.close()
    ratio = peak / est.allocated
    print(f"\n{name} ({est.tokens} tokens per forward, {torch.cuda.get_device_name()}): peak allocated "
          f"{peak / 2**30:.3f} GiB, estimated {est.allocated / 2**30:.3f} GiB (x{ratio:.3f}); "
          f"loss {record['loss']:.3f}")
    print(est.table())
    # (or within 0.25 GiB: a tiny model's run is mostly fixed allowances, e.g. m3-tiny checkpointed measured 0.33
    # GiB against 0.50 on an H100 in session 51)
    assert 0.7 <= ratio <= 1.3 or abs(peak - est.allocated) <= 0.25 * 2**30
