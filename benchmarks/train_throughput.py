"""Training throughput of the openm3 trainer on one GPU: model FLOPs utilisation and MSA vs dense tokens/s.

    python -m benchmarks.train_throughput --out benchmarks/results/        # under 5 minutes on one H200

Runs `openm3.train.Trainer` (bf16 autocast, fused AdamW, the real step: LM loss + indexer KL + MoE load-balancing
loss; `torch.compile` of every decoder layer unless `--no-compile`) on random tokens, one sequence per row, and
times optimizer steps after warm-up (medians; the warm-up steps include compilation):

- `mfu_<preset>_<ctx>`: `m3-small` at 8K context; MFU = model FLOPs per token x tokens/s / peak bf16 FLOP/s.
  Model FLOPs per token = 6 x active matmul parameters (attention projections, index branch, dense MLP or the
  shared + top-k experts + router, lm_head; embeddings excluded) + attention: 6 x 2 x Hq x D x (keys per query)
  per layer for QK^T and PV, forward + backward, where keys per query is the mean over positions of the causal
  keys (ctx/2 + 1/2) for dense layers and of the selected causal keys for MSA layers (`mean_keys_per_query`:
  every causal key while fewer than topk blocks exist, then topk - 1 full blocks plus the query's own block up to
  it; at 8K 1,744 keys, not topk x block_size = 2,048 as sessions 1-7 counted, which overstated their MFU by ~3%
  of itself); MSA layers add the block-selection scores over every causal key (2 x Hi x Di x causal keys, forward
  only) and the indexer KL over the selected keys.
- `vl_<preset>_<ctx>` (only with `--only vl`): the vision-language model trained natively at 8K, half the rows text
  and half with 8 random 448 x 448 images each; tokens/s and the profiled step (with its host-sync census), no MFU.
- `msa_vs_dense_<ctx>`: the same model at 64K context with MSA layers, then with every layer dense
  (`layer_types` all `full_attention`, no index branch); ratio of tokens/s. Activation checkpointing is on for
  both (`--long-ckpt on`, the default: the setting of contexts whose activations do not fit); `--long-ckpt off`
  runs both without it and `both` runs all four cases (`_noac` names the cases without), reporting each pairing
  and the ratio of each model's faster way (`msa_over_dense_best_tokens_per_s`). On an H200 both fit at 64K
  without checkpointing (session 23: MSA 90.8 GiB, dense 105.1 GiB peak), and both are fastest so: MSA / dense
  2.37x there against 2.49x with both checkpointed. A case that runs out of memory is recorded as such, not
  retried. Both are profiled too (since session 10: a 13% slower MSA step at 64K had no kernel breakdown to
  explain it). `--ab 'cfg.ac_keep_attention=1'` times the selective checkpoint that keeps the attention.
Targets (issue "Training system"): MFU >= 35% at 8K; MSA >= 4x dense tokens/s at 64K.

The 8K case takes `--rows` rows per optimizer step (default 8: 64K tokens) in micro-batches of `--micro-batch`
rows (default 8: the whole step in one forward, 92 GiB peak on an H200). A one-row step would mostly time AdamW over
all 1.2B parameters, experts included, for 8K tokens; micro-batches of 2 rows left the step host-bound (the GPU busy
83-95% of it, session 5: 65.5K tokens/s at 4 rows in 2 micro-batches against 72.7K at 4 rows in 1 and 73.4K at 8
rows in 2 of 4, all in one H200 call; session 6: 76.8K at 8 rows in 2 of 4, 78.6K in 1 of 8, consecutive calls).
Then the same number of steps run back to back as `Trainer.fit` runs them (each next step queued before this one's
logged values are read: `overlapped_step_s`, `overlapped_tokens_per_s`, `overlapped_mfu`; not with `--ab`): the
synced medians include the GPU's idle start of every step, which training does not have since session 11.
One more step of each case runs under
`torch.profiler`: its CUDA kernel time by category (`breakdown`: attention/MSA kernels, MoE grouped GEMMs, other
matmuls, optimizer incl. gradient clipping, elementwise and everything else; top kernels by time) explains a missed
target. The MSA ops' value checks of `block_idx` (a host sync and a few sorts per call) are off unless
`--validate-block-idx`: the indices come from the tested selection kernel.
`--ab 'VAR=VALUE[;VAR=VALUE]'` times an interleaved A/B in one process: the timed steps alternate between the
current environment and these variables (the MSA launch configs, `OPENM3_*_LAUNCH`, are read at every call), so
both sides share the compiled graphs, the warm allocator and the machine's state; each case then reports `ab`
(both sides' step times and medians; the profiled `breakdown` is A's, `ab.b_breakdown` B's). Separate runs moved
by 1-3% between calls (session 8), more than some of the effects being compared. Items `cfg.FIELD=VALUE` set a
`TrainConfig` field for B's steps instead (those the trainer reads at every step: `cfg.residual_dtype=float32`,
`cfg.ac_reuse_msa=0`).
Each case runs in its own try/except (a compiled case that fails is retried eagerly, both recorded); results go to
`<out>/train_throughput.json` with hardware, versions, date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import RESULTS
from benchmarks._timing import idle_gaps, profiled_times, top_host_ops

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it

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


def mean_keys_per_query(ctx: int, block_size: int | None = None, topk: int | None = None) -> float:
    """Keys one query of a `ctx`-token sequence attends to, averaged over its positions t = 0 .. ctx - 1: t + 1
    (causal) for dense attention; for MSA with `topk` blocks of `block_size`, every causal key while the query's
    block is among the first `topk`, else `topk - 1` full earlier blocks plus the keys of its own block up to t."""
    t = torch.arange(ctx, dtype=torch.float64)
    if block_size is None:
        return float((t + 1).mean())
    own = torch.remainder(t, block_size) + 1
    sparse = torch.where(t < topk * block_size, t + 1, (topk - 1) * block_size + own)
    return float(sparse.mean())


def flops_per_token(cfg, ctx: int) -> float:
    """Training FLOPs per token (see the module docstring)."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    params = cfg.vocab_size * h  # lm_head
    attn = 0.0
    for i in range(cfg.num_hidden_layers):
        params += h * d * (2 * hq + 2 * hkv)
        if cfg.layer_types[i] == "minimax_m3_sparse":
            params += h * cfg.index_head_dim * (cfg.index_n_heads + 1)
            keys = mean_keys_per_query(ctx, cfg.index_block_size, cfg.index_topk_blocks)
            # block selection scores every causal key once (forward only; the KL then uses the selected keys)
            attn += 2 * cfg.index_n_heads * cfg.index_head_dim * mean_keys_per_query(ctx)
            attn += 6 * 2 * cfg.index_n_heads * cfg.index_head_dim * keys  # indexer KL over the selected keys
        else:
            keys = mean_keys_per_query(ctx)
        attn += 6 * 2 * hq * d * keys
        if cfg.mlp_layer_types[i] == "sparse":
            params += 3 * h * (cfg.intermediate_size * cfg.num_experts_per_tok + cfg.shared_intermediate_size)
            params += h * cfg.num_local_experts
        else:
            params += 3 * h * cfg.dense_intermediate_size
    return 6 * params + attn


# Kernel-name patterns, first match wins. MSA kernels are openm3's Triton kernels (ops/msa/triton_*.py); dense
# attention is SDPA (flash / cuDNN / memory-efficient); torch._grouped_mm is a CUTLASS grouped GEMM on Hopper.
CATEGORIES = [
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("msa_select", r"_select_kernel"),
    ("msa_attention", r"_attn_fwd_kernel|_attn_dq_kernel|_attn_dkdv_kernel|_delta_kernel"),
    ("msa_indexer_kl", r"_kl_stats_kernel|_kl_main_kernel|_teacher_kernel"),
    ("dense_attention", r"flash|fmha|cudnn|sdpa|attention|mha_"),
    ("moe_grouped_gemm", r"groupproblemshape|grouped|group_gemm"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|gemv|splitk|triton_tem_fused_mm|_mm_"),
]


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, low):
            return category
    return "elementwise_other"


def kernel_breakdown(kernels: dict[str, tuple[float, int]], wall_ms: float, top: int = 150) -> dict:
    """`kernels`: name -> (total ms, launches) over one step. Returns ms per category, the share of the step's
    wall time the GPU ran kernels, and the top kernels."""
    by_cat: dict[str, float] = defaultdict(float)
    for name, (ms, _) in kernels.items():
        by_cat[kernel_category(name)] += ms
    busy = sum(by_cat.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"step_wall_ms": wall_ms, "kernel_ms": busy, "gpu_busy_share": busy / wall_ms if wall_ms else None,
            "ms_by_category": {k: round(v, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "share_by_category": {k: round(v / busy, 4) for k, v in by_cat.items()} if busy else {},
            "top_kernels": [{"name": n[:160], "ms": round(ms, 3), "launches": c, "category": kernel_category(n)}
                            for n, (ms, c) in ranked]}


def guarded_profile(trainer) -> dict:
    """`profile_step`, or the error it raised (the timings stand without it)."""
    try:
        return profile_step(trainer)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:1000]}


def profile_step(trainer) -> dict:
    """One optimizer step under torch.profiler; CUDA kernel time by category."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.train_step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernels, host = profiled_times(prof)
    out = kernel_breakdown(kernels, wall_ms)
    # where the host's time goes (a step whose GPU idles is bound by it): self CPU time per operator / CUDA API call
    out["host_self_ms"] = top_host_ops(host)
    out["idle"] = idle_gaps(prof)  # where in the step the GPU waited for the host
    return out


def sync_sites(step, top: int = 25) -> list[dict]:
    """One call of `step` (e.g. a trainer's `train_step`) under `torch.cuda.set_sync_debug_mode("warn")`: each host
    sync (a `.tolist()`, `.item()`,
    a blocking copy) and the innermost openm3 / benchmarks frames that caused it, counted per call site. A sync
    drains the launch queue, so the GPU idles while Python issues the next kernels."""
    import traceback as tb
    import warnings

    sites: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in tb.extract_stack()[:-1] if "/openm3/" in f.filename or "/benchmarks/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[::-1][:4]) or filename
        sites[f"{where} | {str(message)[:60]}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    return [{"site": k, "count": v} for k, v in ranked[:top]] + [{"total": sum(sites.values())}]


class RandomImageRows(RandomRows):
    """`RandomRows` whose image rows hold `images` random 448 x 448 images (32 x 32 patches, 256 visual tokens each
    after the 2 x 2 merge) as placeholder runs between random text tokens; loss on the text tokens only."""

    GRID = (1, 32, 32)
    PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x 14 x 14

    def __init__(self, vocab: int, seq_len: int, image_id: int, images: int):
        super().__init__(vocab - 2, seq_len)  # the two top ids are the placeholders, never drawn
        self.image_id, self.images = image_id, images

    def rows(self, kind, step, count):
        from openm3.train.batches import Row

        if kind != "image":
            return super().rows(kind, step, count)
        t, h, w = self.GRID
        per_image = t * h * w // 4
        if self.images * per_image >= self.seq_len:
            raise ValueError(f"images: {self.images} images of {per_image} tokens do not fit rows of {self.seq_len}")
        g = torch.Generator().manual_seed(step * 7 + 3)
        out = []
        for _ in range(count):
            ids = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
            gap = (self.seq_len - self.images * per_image) // (self.images + 1)
            for i in range(self.images):  # placeholder runs spread over the row
                start = gap * (i + 1) + per_image * i
                ids[start:start + per_image] = self.image_id
            labels = ids[1:].clone()
            labels[labels == self.image_id] = -100
            vision = {"pixel_values": torch.randn(self.images * t * h * w, self.PATCH, generator=g),
                      "image_grid_thw": torch.tensor([list(self.GRID)] * self.images)}
            out.append(Row(ids[:-1].clone(), labels, [self.seq_len], kind="image", vision=vision))
        return out


def ab_variant_step(i: int, warmup: int) -> bool:
    """Whether step i of an A/B run (the first `warmup` steps untimed) runs the variant: the last warm-up step (its
    kernels compile there), then every other timed step, starting with A."""
    return i == warmup - 1 or (i >= warmup and (i - warmup) % 2 == 1)


def _field_value(current, text: str):
    """`text` as the type of a TrainConfig field's current value (bool: 1/0/true/false)."""
    if isinstance(current, bool):
        if text.lower() not in ("1", "0", "true", "false"):
            raise ValueError(f"--ab: a bool field takes 1/0/true/false, got {text!r}")
        return text.lower() in ("1", "true")
    return type(current)(text) if isinstance(current, (int, float)) else text


@contextlib.contextmanager
def environment(env: dict[str, str], cfg=None):
    """Set environment variables inside the block (the MSA launch configs read theirs at every call); items named
    `cfg.FIELD` set that field of `cfg` (a `TrainConfig`) instead."""
    fields = {k[len("cfg."):]: v for k, v in env.items() if k.startswith("cfg.")}
    env = {k: v for k, v in env.items() if not k.startswith("cfg.")}
    if fields and cfg is None:
        raise ValueError(f"environment: cfg.* items {sorted(fields)} need the TrainConfig")
    before = {k: os.environ.get(k) for k in env}
    saved = {k: getattr(cfg, k) for k in fields}
    values = {k: _field_value(saved[k], v) for k, v in fields.items()}  # may raise: before anything is set
    os.environ.update(env)
    for k, v in values.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in saved.items():
            setattr(cfg, k, v)


def time_overlapped(trainer, steps: int) -> float:
    """Seconds per step over `steps` optimizer steps queued as `Trainer.fit` queues them (each next step before
    this one's logged values are read, so the GPU does not idle while the host starts a step), between two device
    syncs (on a GPU)."""
    sync = torch.cuda.synchronize if trainer.info.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):
        queued = trainer.launch_step()
        if pending is not None:
            pending.record()
        pending = queued
    pending.record()
    sync()
    return (time.perf_counter() - t0) / steps


def time_steps(preset: str, ctx: int, steps: int, warmup: int, *, dense: bool = False, ckpt: bool = False,
               rows: int = 1, micro_batch: int | None = None, compile: bool = True, profile: bool = False,
               images: int = 0, ab_env: dict[str, str] | None = None) -> dict:
    """`images` > 0: the vision-language model, trained natively (recipe `native`) on text rows and as many rows
    with that many random images each (m3-small's vision tower); tokens/s counts both kinds, and no MFU is given
    (the FLOP count covers the text model only)."""
    from openm3.models.config import M3TextConfig
    from openm3.models.text import M3TextModel
    from openm3.train.config import TrainConfig
    from openm3.train.trainer import Trainer

    if ab_env:  # one more warm-up step, under the variant's launch configs (its kernels compile there)
        warmup += 1
    overrides = {"layer_types": ["full_attention"] * M3TextConfig.from_name(preset).num_hidden_layers} if dense else {}
    mcfg = M3TextConfig.from_name(preset, **overrides)
    micro_batch = micro_batch or rows
    vl = dict(recipe="native", mixture={"text": 1.0, "image": 1.0}) if images else dict(recipe="text-only")
    overlap = steps if not ab_env else 0  # the back-to-back steps timed after the synced ones
    cfg = TrainConfig(model=preset, steps=steps + warmup + overlap + 2 * int(profile), seq_len=ctx,
                      text_rows=rows // 2 if images else rows, micro_batch=micro_batch, warmup_steps=1,
                      msa_switch_step=0, out_dir="/tmp/openm3_bench_train", progress=False, tensorboard=False,
                      activation_checkpointing=ckpt, compile=compile, param_dtype="bfloat16", **vl)
    torch.cuda.reset_peak_memory_stats()
    if images:
        from openm3.models.multimodal import M3ForConditionalGeneration, M3VLConfig

        vcfg = M3VLConfig.from_name(preset, image_token_index=mcfg.vocab_size - 2,
                                    video_token_index=mcfg.vocab_size - 1, **overrides)
        source = RandomImageRows(mcfg.vocab_size, ctx, vcfg.image_token_index, images)
        trainer = Trainer(cfg, lambda: M3ForConditionalGeneration(vcfg), source)
    else:
        trainer = Trainer(cfg, lambda: M3TextModel(mcfg), RandomRows(mcfg.vocab_size, ctx))
    times, t_start, warmup_s = [], time.perf_counter(), 0.0
    b_times: list[float] = []
    for i in range(steps + warmup):
        variant = bool(ab_env) and ab_variant_step(i, warmup)
        with environment(ab_env if variant else {}, trainer.cfg):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            record = trainer.train_step()
            torch.cuda.synchronize()
        if i >= warmup:
            (b_times if variant else times).append(time.perf_counter() - t0)
        else:
            warmup_s = time.perf_counter() - t_start
    step_s = statistics.median(times)
    tokens = ctx * rows
    out = {"preset": preset, "ctx": ctx, "rows": rows, "micro_batch": micro_batch, "compile": compile,
           "images_per_image_row": images, "dense_attention": dense, "activation_checkpointing": ckpt,
           "warmup_s": warmup_s,
           "step_s": step_s, "step_s_all": times, "tokens_per_s": tokens / step_s, "loss_last": record["loss"],
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "flops_per_token": flops_per_token(mcfg, ctx)}
    if overlap:
        o_step = time_overlapped(trainer, overlap)
        out.update(overlapped_step_s=o_step, overlapped_tokens_per_s=tokens / o_step,
                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)  # the peak over both ways
    if ab_env:
        b_step = statistics.median(b_times)
        out["ab"] = {"env": ab_env, "a_step_s_all": times, "b_step_s_all": b_times, "a_step_s": step_s,
                     "b_step_s": b_step, "b_tokens_per_s": tokens / b_step, "b_over_a_tokens_per_s": step_s / b_step}
    name = torch.cuda.get_device_name()
    peak = None if images else next((v for k, v in PEAK_BF16.items() if k in name), None)
    if peak:
        out["mfu"] = out["flops_per_token"] * out["tokens_per_s"] / peak
        if overlap:
            out["overlapped_mfu"] = out["flops_per_token"] * out["overlapped_tokens_per_s"] / peak
    if profile:
        out["breakdown"] = guarded_profile(trainer)  # the defaults (A)
        if ab_env:  # and the variant, so an A/B compares kernels too
            with environment(ab_env, trainer.cfg):
                out["ab"]["b_breakdown"] = guarded_profile(trainer)
        try:
            out["breakdown"]["sync_sites"] = sync_sites(trainer.train_step)
        except Exception as e:
            out["breakdown"]["sync_sites"] = [{"error": f"{type(e).__name__}: {e}"[:1000]}]
        if peak:  # the step's model FLOPs at peak, to compare with the measured kernel ms
            out["breakdown"]["model_ms_at_peak"] = out["flops_per_token"] * tokens / peak * 1e3
    del trainer
    torch.cuda.empty_cache()
    return out


def parse_ab(spec: str) -> dict[str, str]:
    """`--ab`'s 'VAR=VALUE;cfg.FIELD=VALUE' -> {VAR: VALUE} (the values may hold '=' and ','); a `cfg.` field must
    be a `TrainConfig` field."""
    from openm3.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    env = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        name, eq, value = item.partition("=")
        name = name.strip()
        field = name[len("cfg."):] if name.startswith("cfg.") else None
        if not eq or not (name.isidentifier() or field in fields):
            raise SystemExit(f"--ab: expected VAR=VALUE or cfg.FIELD=VALUE (a TrainConfig field) [;...], got {item!r}")
        env[name] = value
    return env


def run_case(args, name: str, kw: dict) -> dict:
    """One case; a compiled run that fails is retried eagerly (the compile error is kept); errors never escape."""
    def attempt(compile: bool) -> dict:
        try:
            return time_steps(args.preset, steps=args.steps, warmup=args.warmup, compile=compile,
                              ab_env=args.ab_env, **kw)
        except Exception as e:  # report and go on
            torch.cuda.empty_cache()
            return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}

    out = attempt(args.compile)
    if out.get("error", "").startswith("OutOfMemoryError"):
        out["out_of_memory"] = True  # an eager retry needs more memory, not less
    elif args.compile and "error" in out:
        print(name, "compiled run failed, retrying eagerly:", out["error"][:300], flush=True)
        torch._dynamo.reset()
        out = attempt(False) | {"compile_error": out["error"], "compile_traceback": out["traceback"]}
    return out


def summarise_long(result: dict, preset: str, long_ctx: int, long_ckpt: str) -> None:
    """The long-context ratios into `result` (MSA / dense tokens/s per checkpointing setting, each model's
    faster setting with `long_ckpt == "both"`, the FLOP ceiling), printed."""
    long = {(k, s): result["cases"].get(f"{k}_{preset}_{long_ctx}{s}", {})
            for k in ("msa", "dense") for s in ("", "_noac")}
    for s in ("", "_noac"):
        msa, dense = long["msa", s], long["dense", s]
        if "tokens_per_s" in msa and "tokens_per_s" in dense:
            result[f"msa_over_dense{s}_tokens_per_s"] = msa["tokens_per_s"] / dense["tokens_per_s"]
        if "overlapped_tokens_per_s" in msa and "overlapped_tokens_per_s" in dense:
            result[f"msa_over_dense{s}_overlapped_tokens_per_s"] = (msa["overlapped_tokens_per_s"]
                                                                   / dense["overlapped_tokens_per_s"])
    best = {k: max((c["tokens_per_s"] for (m, _), c in long.items() if m == k and "tokens_per_s" in c), default=None)
            for k in ("msa", "dense")}
    if long_ckpt == "both" and None not in best.values():  # each model its faster way of the two
        result["msa_over_dense_best_tokens_per_s"] = best["msa"] / best["dense"]
        print(f"{long_ctx} context, each model's faster checkpointing setting: MSA / dense tokens/s "
              f"{result['msa_over_dense_best_tokens_per_s']:.2f}x", flush=True)
    msa, dense = long["msa", ""] or long["msa", "_noac"], long["dense", ""] or long["dense", "_noac"]
    if "flops_per_token" in msa and "flops_per_token" in dense:
        # the ratio tokens/s could reach if both ran at the same FLOP/s (the target's ceiling for this preset)
        result["msa_over_dense_flop_ratio"] = dense["flops_per_token"] / msa["flops_per_token"]
        ratios = ", ".join(f"{result[f'msa_over_dense{s}_tokens_per_s']:.2f}x "
                           f"({'with' if not s else 'without'} checkpointing)"
                           for s in ("", "_noac") if f"msa_over_dense{s}_tokens_per_s" in result)
        print(f"{long_ctx} context: MSA / dense tokens/s {ratios or 'n/a'}; "
              f"model FLOPs per token dense / MSA {result['msa_over_dense_flop_ratio']:.2f}x", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--preset", default="m3-small")
    p.add_argument("--mfu-ctx", type=int, default=8192)
    p.add_argument("--long-ctx", type=int, default=65536)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--rows", type=int, default=8, help="rows of --mfu-ctx tokens per optimizer step (8K case)")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per forward in the 8K case")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each decoder layer (default on)")
    p.add_argument("--validate-block-idx", action="store_true",
                   help="keep the MSA ops' block_idx value checks (a host sync per call)")
    p.add_argument("--long-ckpt", choices=("on", "off", "both"), default="on",
                   help="activation checkpointing in the --long-ctx cases: on (default), off, or both ways (four "
                        "cases; the ones without are named *_noac)")
    p.add_argument("--only", default="mfu,msa,dense",
                   help="comma-separated case prefixes to run (mfu, msa, dense, vl: the vision-language model)")
    p.add_argument("--ab", default="", metavar="VAR=VALUE[;VAR=VALUE]",
                   help="interleaved A/B in one process: timed steps alternate between the current environment (A) "
                        "and these environment variables (B), e.g. 'OPENM3_KL_LAUNCH=teacher_pass=0' (the MSA launch "
                        "configs read theirs at every call), or TrainConfig fields the trainer reads at every step "
                        "('cfg.residual_dtype=float32'); the case reports both medians (`ab`)")
    p.add_argument("--nested-graph-breaks", action="store_true",
                   help="torch._dynamo.config.nested_graph_breaks: 2 compiled graphs per decoder layer instead of 4 "
                        "(the residual stream's adds and casts fuse across the attention call)")
    args = p.parse_args(argv)
    args.ab_env = parse_ab(args.ab)
    if args.ab_env and args.steps < 2:
        raise SystemExit(f"--ab: needs --steps >= 2 (the timed steps alternate A and B), got {args.steps}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.train_throughput needs a CUDA GPU")
    if args.nested_graph_breaks:
        if not hasattr(torch._dynamo.config, "nested_graph_breaks"):
            raise SystemExit(f"--nested-graph-breaks: torch {torch.__version__} has no "
                             f"torch._dynamo.config.nested_graph_breaks")
        torch._dynamo.config.nested_graph_breaks = True
    from openm3.ops.msa import triton_attention, triton_kl

    triton_attention.VALIDATE_BLOCK_IDX = triton_kl.VALIDATE_BLOCK_IDX = args.validate_block_idx
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "compile": args.compile,
              "validate_block_idx": args.validate_block_idx, "nested_graph_breaks": args.nested_graph_breaks,
              "cases": {}}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    cases = {
        f"mfu_{args.preset}_{args.mfu_ctx}": dict(ctx=args.mfu_ctx, rows=args.rows, micro_batch=args.micro_batch,
                                                  profile=True),
    }
    for ckpt in {"on": (True,), "off": (False,), "both": (True, False)}[args.long_ckpt]:
        suffix = "" if ckpt else "_noac"
        cases[f"msa_{args.preset}_{args.long_ctx}{suffix}"] = dict(ctx=args.long_ctx, ckpt=ckpt, profile=True)
        cases[f"dense_{args.preset}_{args.long_ctx}{suffix}"] = dict(ctx=args.long_ctx, ckpt=ckpt, dense=True,
                                                                     profile=True)
    cases |= {
        # native multimodal: half the rows text, half with 8 images each (2048 of 8192 tokens visual)
        f"vl_{args.preset}_{args.mfu_ctx}": dict(ctx=args.mfu_ctx, rows=args.rows, micro_batch=args.micro_batch,
                                                 profile=True, images=8),
    }
    if args.only:
        keep = tuple(args.only.split(","))
        cases = {k: v for k, v in cases.items() if k.startswith(keep)}
    t_all = time.perf_counter()
    for name, kw in cases.items():
        result["cases"][name] = run_case(args, name, kw)
        print(name, json.dumps(result["cases"][name], indent=None)[:1500], flush=True)
    result["total_s"] = time.perf_counter() - t_all
    summarise_long(result, args.preset, args.long_ctx, args.long_ckpt)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "train_throughput.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
