"""Training throughput of the openm3 trainer on one GPU: model FLOPs utilisation and MSA vs dense tokens/s.

    python -m benchmarks.train_throughput --out benchmarks/results/        # a few minutes on one H200

Runs `openm3.train.Trainer` (bf16 autocast, AdamW, the real step: LM loss + indexer KL + MoE load-balancing loss)
on random tokens, one sequence per row, and times optimizer steps after warm-up (medians):

- `mfu_<preset>_<ctx>`: `m3-small` at 8K context; MFU = model FLOPs per token x tokens/s / peak bf16 FLOP/s.
  Model FLOPs per token = 6 x active matmul parameters (attention projections, index branch, dense MLP or the
  shared + top-k experts + router, lm_head; embeddings excluded) + attention: 6 x 2 x Hq x D x (keys per query)
  per layer for QK^T and PV, forward + backward, where keys per query is ctx/2 for dense layers (causal) and
  topk x block_size for MSA layers (what MSA computes); MSA layers add the block-selection scores over every causal
  key (2 x Hi x Di x ctx/2, forward only) and the indexer KL over the selected keys.
- `msa_vs_dense_<ctx>`: the same model at 64K context with MSA layers, then with every layer dense
  (`layer_types` all `full_attention`, no index branch); ratio of tokens/s. Activation checkpointing is on for
  both at 64K so the dense model fits.
Targets (issue "Training system"): MFU >= 35% at 8K; MSA >= 4x dense tokens/s at 64K.
Each case runs in its own try/except; results go to `<out>/train_throughput.json` with hardware, versions, date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import traceback
from pathlib import Path

import torch

PEAK_BF16 = {"H200": 989.5e12, "H100": 989.5e12}


class RandomRows:
    """Rows of uniformly random tokens (one document per row), deterministic per (kind, step)."""

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len

    def rows(self, kind, step, count):
        from openm3.train.batches import Row

        g = torch.Generator().manual_seed(step * 7 + len(kind))
        out = []
        for _ in range(count):
            ids = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
            out.append(Row(ids[:-1].clone(), ids[1:].clone(), [self.seq_len], kind=kind))
        return out


def flops_per_token(cfg, ctx: int) -> float:
    """Training FLOPs per token (see the module docstring)."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    params = cfg.vocab_size * h  # lm_head
    attn = 0.0
    for i in range(cfg.num_hidden_layers):
        params += h * d * (2 * hq + 2 * hkv)
        if cfg.layer_types[i] == "minimax_m3_sparse":
            params += h * cfg.index_head_dim * (cfg.index_n_heads + 1)
            keys = min(ctx / 2, cfg.index_topk_blocks * cfg.index_block_size)
            # block selection scores every causal key once (forward only; the KL then uses the selected keys)
            attn += 2 * cfg.index_n_heads * cfg.index_head_dim * ctx / 2
            attn += 6 * 2 * cfg.index_n_heads * cfg.index_head_dim * keys  # indexer KL over the selected keys
        else:
            keys = ctx / 2
        attn += 6 * 2 * hq * d * keys
        if cfg.mlp_layer_types[i] == "sparse":
            params += 3 * h * (cfg.intermediate_size * cfg.num_experts_per_tok + cfg.shared_intermediate_size)
            params += h * cfg.num_local_experts
        else:
            params += 3 * h * cfg.dense_intermediate_size
    return 6 * params + attn


def time_steps(preset: str, ctx: int, steps: int, warmup: int, *, dense: bool = False, ckpt: bool = False,
               rows: int = 1) -> dict:
    from openm3.models.config import M3TextConfig
    from openm3.models.text import M3TextModel
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import Trainer

    overrides = {"layer_types": ["full_attention"] * M3TextConfig.from_name(preset).num_hidden_layers} if dense else {}
    mcfg = M3TextConfig.from_name(preset, **overrides)
    cfg = TrainConfig(model=preset, recipe="text-only", steps=steps + warmup, seq_len=ctx, text_rows=rows,
                      micro_batch=rows, warmup_steps=1, msa_switch_step=0, out_dir="/tmp/openm3_bench_train",
                      progress=False, tensorboard=False, activation_checkpointing=ckpt, param_dtype="bfloat16")
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, lambda: M3TextModel(mcfg), RandomRows(mcfg.vocab_size, ctx))
    times = []
    for i in range(steps + warmup):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        record = trainer.train_step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = ctx * rows
    out = {"preset": preset, "ctx": ctx, "dense_attention": dense, "activation_checkpointing": ckpt,
           "step_s": step_s, "tokens_per_s": tokens / step_s, "loss_last": record["loss"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "flops_per_token": flops_per_token(mcfg, ctx)}
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    if peak:
        out["mfu"] = out["flops_per_token"] * out["tokens_per_s"] / peak
    del trainer
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--preset", default="m3-small")
    p.add_argument("--mfu-ctx", type=int, default=8192)
    p.add_argument("--long-ctx", type=int, default=65536)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.train_throughput needs a CUDA GPU")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "cases": {}}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    cases = {
        f"mfu_{args.preset}_{args.mfu_ctx}": dict(ctx=args.mfu_ctx),
        f"msa_{args.preset}_{args.long_ctx}": dict(ctx=args.long_ctx, ckpt=True),
        f"dense_{args.preset}_{args.long_ctx}": dict(ctx=args.long_ctx, ckpt=True, dense=True),
    }
    for name, kw in cases.items():
        try:
            result["cases"][name] = time_steps(args.preset, steps=args.steps, warmup=args.warmup, **kw)
        except Exception as e:  # report and go on
            result["cases"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(name, json.dumps(result["cases"][name], indent=None)[:400], flush=True)
    msa, dense = (result["cases"].get(f"{k}_{args.preset}_{args.long_ctx}", {}) for k in ("msa", "dense"))
    if "tokens_per_s" in msa and "tokens_per_s" in dense:
        result["msa_over_dense_tokens_per_s"] = msa["tokens_per_s"] / dense["tokens_per_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "train_throughput.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
