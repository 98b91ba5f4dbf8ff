"""Inputs shared by the MSA benchmark scripts: one layer of M3's attention, one sequence of T tokens."""

from __future__ import annotations

import torch

HQ, HKV, D, HI, DI = 64, 4, 128, 4, 128  # query heads, KV heads, head dim; index heads (1 key head), index dim
REGIMES = ("drift", "iid")


def m3_inputs(t: int, device: str = "cuda", dtype=torch.bfloat16, seed: int = 0, regime: str = "drift",
              main: bool = True, hq: int = HQ, seq_len: int | None = None) -> dict:
    """qi [T,4,128], ki [T,128] and, if `main`, q [T,hq,128] (M3: 64 heads), k, v [T,4,128] (all `dtype`);
    cu_seqlens `cu`: [0, T], or packed sequences of `seq_len` tokens (T a multiple of it).

    regime "drift": index queries drift slowly along the sequence (linear interpolation between random anchors
    every 512 tokens, plus noise), as a trained indexer's do, so neighbouring queries pick overlapping blocks;
    the headline numbers use it. regime "iid": independent random index queries, so neighbouring queries share
    almost nothing but the local block: the worst case for kernels that share K/V loads between tokens.
    The index tensors are drawn first, so `main=False` gives the same qi, ki.
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    if regime == "drift":
        anchors = randn(t // 512 + 2, HI, DI)
        pos = torch.arange(t, device=device, dtype=torch.float32) / 512
        lo = pos.floor().long()
        w = (pos - lo).view(t, 1, 1)
        qi = anchors[lo] * (1 - w) + anchors[lo + 1] * w + 0.3 * randn(t, HI, DI)
    else:
        qi = randn(t, HI, DI)
    seq_len = seq_len or t
    if t % seq_len:
        raise ValueError(f"t={t} must be a multiple of seq_len={seq_len}")
    cu = torch.arange(0, t + 1, seq_len, device=device, dtype=torch.int32)
    x = dict(qi=qi.to(dtype), ki=randn(t, DI).to(dtype), cu=cu)
    if main:
        x.update(q=randn(t, hq, D).to(dtype), k=randn(t, HKV, D).to(dtype), v=randn(t, HKV, D).to(dtype))
    return x


def random_text_model(preset: str, device: str | None = None):
    """A seeded random `M3TextModel` of a preset for the engine benchmarks: bf16 on CUDA (the default device when
    there is one), fp32 on a CPU, in eval mode and the inference layout (`for_inference`, as `openm3 generate` and
    `serve` load models). Returns (model, device)."""
    from openm3.engine.generate import for_inference
    from openm3.models import M3TextConfig, M3TextModel

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    with torch.device(device):
        model = M3TextModel(M3TextConfig.from_name(preset))
    return for_inference(model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)), device


def engine_parser(doc: str):
    """The argument parser of an engine benchmark (described by its docstring's first line) with the options they
    all take: --preset, --device, --out (results folder)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--preset", default="m3-small")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, help="folder for the result's JSON (none: print only)")
    return p

