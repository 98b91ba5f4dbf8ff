"""The training loop: one process or `torchrun --nproc_per_node=N`.

    torchrun --nproc_per_node=2 -m openm3.train.cli --config run.json

Per optimizer step: fetch the recipe's rows for the step (the data position is the step counter), take this
rank's share in micro-batches, forward each (MSA dense warm-up or sparse stage), backward the step loss
`sum(token CE) / global loss tokens + kl_weight * KL + aux_loss_weight * load-balancing loss`, clip, AdamW, WSD LR.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import distributed as D
from ..layers.attention import kl_in_backward
from ..layers.recompute import reuse_contexts
from ..models.text import check_input_ids, input_ids_checked_by_caller, residual_stream_dtype
from .batches import IGNORE, Batch, RowSource, shard_micro_batches, step_rows
from .checkpoint import CheckpointManager, export_consolidated, is_complete, latest_checkpoint, write_text_atomic
from .config import TrainConfig, resume_conflicts
from .losses import token_losses
from .memory import MemoryEstimate, estimate_training_memory, memory_advice
from .metrics import MetricsLogger, Progress, read_jsonl

KINDS = ("text", "image", "video")


@dataclass
class ForwardOutputs:
    """What the trainer needs from a model forward. `logits: [T, V]`; `indexer_kl`, `aux_loss`: scalars or None."""

    logits: torch.Tensor
    indexer_kl: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def model_forward(model: nn.Module, batch: Batch, *, msa_stage: str, kl: bool = True, aux: bool = True,
                  index_input_grad: bool | None = None) -> ForwardOutputs:
    """Run an openm3 model (text or vision-language) on a packed micro-batch in training mode.

    The model contract: `model(input_ids=, position_ids=, cu_seqlens=, msa_stage="dense"|"sparse",
    return_kl=, return_aux=, **vision_inputs)` returning an object with `logits` and optional `indexer_kl` and
    `aux_loss`, and `index_input_grad=` where it is not None. A loss whose weight is zero is not asked for (the
    indexer KL is a large share of the step cost).
    """
    extra = {} if index_input_grad is None else {"index_input_grad": index_input_grad}
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                msa_stage=msa_stage, return_kl=kl, return_aux=aux, **extra, **batch.vision)
    return ForwardOutputs(out.logits, getattr(out, "indexer_kl", None), getattr(out, "aux_loss", None))


VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def _param_groups(model: nn.Module, weight_decay: float, lr: float, vision_lr_scale: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases, or 1-D gains); the vision tower and projector at
    `vision_lr_scale * lr`."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            vision = any(prefix in name for prefix in VISION_PREFIXES)
            groups.setdefault((vision, p.dim() >= 2), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0,
             "lr": lr * (vision_lr_scale if vision else 1.0)}
            for (vision, decay), params in sorted(groups.items())]


class PendingStep:
    """An optimizer step queued on the device (`Trainer.launch_step`). Its logged values travel to the host behind
    the step's kernels (into pinned memory, then an event on CUDA); `record()` waits for them and builds the step's
    record (once; later calls return the same dict)."""

    def __init__(self, values: torch.Tensor, meta: dict, t0: float, trainer: "Trainer"):
        self.meta, self.t0, self._trainer = meta, t0, trainer
        self._record: dict | None = None
        self._done = None
        self._ready_at: float | None = None  # host-computed values are ready now, not when `record()` reads them
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = values
            self._ready_at = time.perf_counter()

    @property
    def step(self) -> int:
        return self.meta["step"]

    def record(self) -> dict:
        if self._record is not None:
            return self._record
        if self._done is not None:
            self._done.synchronize()
        values = self._host.tolist()
        # the step's time: from its start, or from when the previous step's values arrived if it was queued
        # before that (then the interval is one step of the device's time, not of the host's queueing). A step
        # computed on the host (CPU) had its values at the end of `launch_step`: reading them later, after the
        # next step ran, must not move its end (the last step of a CPU run would take ~0 s)
        now = time.perf_counter() if self._ready_at is None else self._ready_at
        dt = max(now - max(self.t0, self._trainer._values_read_at), 1e-9)
        self._trainer._values_read_at = now
        m = self.meta
        ce_sum, kl, aux = values[:3]
        kind_ce, kind_tok, norm = values[3:3 + len(KINDS)], values[3 + len(KINDS):-1], values[-1]
        record = {"step": m["step"], "loss": ce_sum / m["n_loss"], "lr": m["lr"], "grad_norm": norm,
                  "tokens": int(m["n_tok"]), "tokens_per_s": m["n_tok"] / dt, "msa_stage": m["msa_stage"],
                  "vision": m["vision"]}
        for i, kind in enumerate(KINDS):
            if kind_tok[i] > 0:
                record[f"loss/{kind}"] = kind_ce[i] / kind_tok[i]
        if m["has_kl"]:
            record["indexer_kl"] = kl
        if m["has_aux"]:
            record["aux_loss"] = aux
        self._record = record
        return record


class Trainer:
    """Builds the (sharded) model, optimizer and schedule; trains, checkpoints, evaluates and logs.

    `build_model()` must return the same freshly initialised model on every call (seeded by the trainer).
    `evaluator(trainer, step) -> dict` (optional) runs at eval points on every rank; its dict is logged as `eval/*`.
    """

    def __init__(self, cfg: TrainConfig, build_model: Callable[[], nn.Module], source: RowSource, *,
                 evaluator: Callable[["Trainer", int], dict] | None = None):
        cfg.check_world(D.world_size_from_env())  # bad batch split fails before any compute
        for what, part in (("source", source), ("evaluator", evaluator)):
            clip = getattr(part, "frames_per_clip", cfg.video_frames_per_clip)
            if clip != cfg.video_frames_per_clip:
                raise ValueError(f"{what} cuts videos into clips of {clip} temporal patches but "
                                 f"cfg.video_frames_per_clip is {cfg.video_frames_per_clip}: give it the config's")
        self.cfg = cfg
        self.plan = cfg.plan()
        self.info = D.init_distributed(cfg.device)
        self.source = source
        self.evaluator = evaluator
        self.build_model = self._seeded(build_model)
        self.out_dir = Path(cfg.out_dir)

        dtype = {"auto": torch.bfloat16 if self.info.device.type == "cuda" else None,
                 "float32": None, "bfloat16": torch.bfloat16}[cfg.param_dtype]
        self.autocast_dtype = dtype if (dtype is not None and not self.info.distributed) else None
        if cfg.residual_dtype == "float32" and self.info.distributed and dtype is not None:
            raise ValueError("residual_dtype='float32' applies to the single-process trainer's autocast; under FSDP "
                             f"the parameters (param_dtype={cfg.param_dtype!r}) set the activations' dtype")
        model = self.build_model().to(self.info.device)
        if cfg.activation_checkpointing:
            D.apply_activation_checkpointing(model, context_fn=self._checkpoint_contexts)
        if cfg.compile:
            D.apply_compile(model, backend=cfg.compile_backend)
        if self.info.distributed:
            D.apply_fsdp(model, self.info, dtype)
        self.model = model
        # fused: one kernel per parameter group on CUDA instead of the foreach path's several passes over
        # parameters and moments (the optimizer touches every expert, so it is a large share of a short step)
        self.optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay, cfg.lr, cfg.vision_lr_scale),
                                           lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           fused=True if self.info.device.type == "cuda" else None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.plan.lr_multiplier)
        self.step = 0
        self.checkpoints = CheckpointManager(self.out_dir / "checkpoints", self.info, cfg.keep_checkpoints)
        self.logger = MetricsLogger(self.out_dir, enabled=self.info.is_main, tensorboard=cfg.tensorboard)
        self.history: list[dict] = []
        self.last_eval: dict = {}  # the latest `evaluate` result
        self._resumed = False  # resume() restored a checkpoint
        self._evaluation_owed = False  # the resumed checkpoint's step evaluates, and its record is missing
        on_gpu = self.info.device.type == "cuda"
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="openm3-rows") \
            if cfg.prefetch == "on" or (cfg.prefetch == "auto" and on_gpu) else None
        self._ahead: tuple[int, Future] | None = None  # (step, its rows being built)
        self._values_read_at = -math.inf  # when the last step's logged values reached the host

    def _seeded(self, build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        if isinstance(build, nn.Module) or not callable(build):
            raise ValueError(f"build_model must be a zero-argument callable returning a fresh model (e.g. "
                             f"`lambda: M3TextModel(config)`: the trainer seeds and builds it, again for exports), "
                             f"got {type(build).__name__}")

        def wrapped() -> nn.Module:
            torch.manual_seed(self.cfg.seed)
            return build()
        wrapped.skeleton = getattr(build, "skeleton", None)  # see export_consolidated
        return wrapped

    def _checkpoint_contexts(self):
        """Activation checkpointing's context managers for one checkpointed call (`cfg.ac_reuse_msa`,
        `cfg.ac_keep_attention`)."""
        if not (self.cfg.ac_reuse_msa or self.cfg.ac_keep_attention):
            return nullcontext(), nullcontext()
        return reuse_contexts(keep_attention=self.cfg.ac_keep_attention, reuse_msa=self.cfg.ac_reuse_msa)

    # ---- checkpoints -------------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "config": self.cfg.to_dict(),
                "data_position": {"step": self.step}}

    def save_checkpoint(self, **kwargs) -> Path:
        return self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(), **kwargs)

    def resume(self, path: str | Path | None = None) -> bool:
        """Restore the latest (or the given) checkpoint; returns False when there is none. ValueError, before
        anything is loaded, naming each setting of `cfg` that differs from the run's where a resumed run must keep
        it (what it trains: `config.RESUMABLE` lists what may change)."""
        path = latest_checkpoint(self.checkpoints.root) if path is None else Path(path)
        if path is None:
            return False
        if not is_complete(path):
            raise ValueError(f"checkpoint {path} is not a complete checkpoint directory (no meta.json)")
        saved = torch.load(path / "trainer_state.pt", weights_only=False)["config"]
        conflicts = resume_conflicts(saved, self.cfg)
        if conflicts:
            raise ValueError(f"resume: {path} is a run made with " + ", ".join(
                f"{k}={was!r} (this trainer's {now!r})" for k, was, now in conflicts) + "; a resumed run keeps "
                "what it trains: build the Trainer with the run's settings (its train_config.json)")
        state = self.checkpoints.load(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["data_position"]["step"]
        self.logger.truncate_after(self.step)
        self._resumed = True
        # the checkpoint is written before its step's evaluation: one the run did not live to log runs first in fit
        records = read_jsonl(self.logger.path)
        self._evaluation_owed = self.evaluator is not None and self._evaluates_at(self.step) and not any(
            r.get("step") == self.step - 1 and any(k.startswith("eval/") for k in r) for r in records)
        return True

    def _evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates after `step` completed steps (its `eval_every`, and its last step)."""
        return bool(self.cfg.eval_every and step % self.cfg.eval_every == 0) or step == self.plan.steps

    def export(self, out: str | Path, tokenizer=None) -> Path | None:
        """Consolidated checkpoint in the published M3 layout (+ `tokenizer.json` of an `M3Tokenizer`; a VL model's
        video clip length, `cfg.video_frames_per_clip`, as its video processor config)."""
        return export_consolidated(self.model, self.build_model, out, self.info, tokenizer,
                                   video_frames_per_clip=self.cfg.video_frames_per_clip)

    # ---- one optimizer step ------------------------------------------------------------------------------
    @contextmanager
    def _autocast(self):
        """The single-process trainer's mixed precision: bf16 autocast over fp32 parameters, and the residual
        stream in bf16 too unless `residual_dtype='float32'` (read at every call)."""
        if self.autocast_dtype is None:
            with torch.autocast(self.info.device.type, enabled=False):
                yield
            return
        residual = None if self.cfg.residual_dtype == "float32" else self.autocast_dtype
        with torch.autocast(self.info.device.type, dtype=self.autocast_dtype), \
                residual_stream_dtype(self.model, residual):
            yield

    def train_step(self) -> dict:
        """One optimizer step; returns its record (waits for the device to finish the step)."""
        return self.launch_step().record()

    def launch_step(self) -> "PendingStep":
        """Queue one optimizer step on the device and return it without waiting: `PendingStep.record()` reads the
        logged values (one device sync). `fit` queues step N+1 before reading step N's values, so the GPU never
        idles while the host prepares the next step."""
        cfg, info, step = self.cfg, self.info, self.step
        t0 = time.perf_counter()
        rows = self._rows(step)
        micro = shard_micro_batches(rows, info.rank, info.world_size, cfg.micro_batch)
        # every rank holds the whole step's rows: the global counts need no all-reduce (a device sync)
        n_loss = sum(int((r.labels != IGNORE).sum()) for r in rows)
        n_tok = sum(r.input_ids.numel() for r in rows)
        if n_loss == 0:
            raise ValueError(f"step {step} has no loss tokens (every label is ignored)")
        stage = cfg.msa_stage(step)
        self.model.train()
        sums, by_kind, has_kl, has_aux = self._forward_backward(micro, stage, n_tok, n_loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        D.all_reduce_sum(sums, info)
        D.all_reduce_sum(by_kind, info)
        self.step += 1
        values = torch.cat([sums, by_kind.reshape(-1), grad_norm.detach().double().reshape(1)])
        meta = {"step": step, "lr": lr, "n_tok": n_tok, "n_loss": n_loss, "msa_stage": stage,
                "vision": int(self.plan.vision_on(step)), "has_kl": has_kl, "has_aux": has_aux}
        return PendingStep(values, meta, t0, self)

    def _rows(self, step: int) -> list:
        """The rows of `step` (from the background thread when it built them ahead), and the next step's rows
        started in the background. Rows depend on the step alone (`RowSource` contract), so building them early
        changes nothing, resumes included."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            rows = ahead[1].result()  # re-raises the background thread's error here
        else:
            if ahead is not None:
                ahead[1].cancel()
            rows = step_rows(self.source, self.plan.rows(step), step)
        if self._prefetcher is not None and step + 1 < self.plan.steps:
            self._ahead = (step + 1, self._prefetcher.submit(step_rows, self.source, self.plan.rows(step + 1),
                                                             step + 1))
        return rows

    def _forward_backward(self, micro: list[Batch], stage: str, n_tok: float, n_loss: float):
        """Forward and backward of every micro-batch (gradients accumulate). Returns the device sums (lm CE,
        token-weighted KL, aux), per-kind (CE sum, loss tokens), and whether a KL and an aux loss were seen.
        The ids (and a VL model's placeholder counts) are checked on the host, so the model does not read them back
        from the GPU (a sync each per forward)."""
        info = self.info
        sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # lm CE sum, token-weighted kl, aux
        by_kind = torch.zeros(2, len(KINDS), dtype=torch.float64, device=info.device)  # CE sum, loss tokens
        has_kl = has_aux = False
        check_visual = getattr(self.model, "check_visual_placeholders", None)
        with input_ids_checked_by_caller(self.model) as vocab:
            for i, batch in enumerate(micro):
                if vocab is not None:
                    check_input_ids(batch.input_ids, vocab)  # host tensors: no device sync
                    if check_visual is not None:  # the VL model's placeholder counts, on the host too
                        check_visual(batch.input_ids, batch.vision.get("image_grid_thw"),
                                     batch.vision.get("video_grid_thw"))
                if info.distributed:  # reduce-scatter gradients once, after the last micro-batch
                    self.model.set_requires_gradient_sync(i == len(micro) - 1)
                kl, aux = self._micro_step(batch.to(info.device), stage, batch.num_tokens / n_tok, n_loss, sums,
                                           by_kind)
                has_kl, has_aux = has_kl or kl, has_aux or aux
        return sums, by_kind, has_kl, has_aux

    def _micro_step(self, batch: Batch, stage: str, share: float, n_loss: float, sums: torch.Tensor,
                    by_kind: torch.Tensor) -> tuple[bool, bool]:
        """Forward and backward of one micro-batch holding `share` of the step's tokens; adds into `sums` and
        `by_kind`. Returns whether it produced a KL and an aux loss."""
        cfg, info = self.cfg, self.info
        # the KL in the attention's backward; with checkpointing only through the reuse contexts, which replay the
        # forward's choice in the recomputation (plain checkpointing would recompute the other path)
        defer_kl = cfg.kl_in_backward and (not cfg.activation_checkpointing or cfg.ac_reuse_msa)
        with self._autocast(), (kl_in_backward() if defer_kl else nullcontext([])) as kl_values:
            out = model_forward(self.model, batch, msa_stage=stage, kl=cfg.kl_weight > 0,
                                aux=cfg.aux_loss_weight > 0,
                                index_input_grad=None if cfg.warmup_kl_to_backbone or stage != "dense" else False)
        per_token = token_losses(out.logits, batch.labels)
        ce = per_token.sum()
        with torch.no_grad():
            for kind, row_ce, row_labels in zip(batch.kinds, per_token.split(batch.row_lens),
                                                batch.labels.split(batch.row_lens)):
                by_kind[0, KINDS.index(kind)] += row_ce.sum().double()
                by_kind[1, KINDS.index(kind)] += (row_labels != IGNORE).sum()
        loss = ce / n_loss
        if out.indexer_kl is not None:
            loss = loss + cfg.kl_weight * share * out.indexer_kl
        if out.aux_loss is not None:
            loss = loss + cfg.aux_loss_weight * share * out.aux_loss
            sums[2] += share * out.aux_loss.detach().double()
        # FSDP averages gradients over ranks; scaling by world size turns that into the global sum.
        (loss * info.world_size).backward()
        sums[0] += ce.detach().double()
        if out.indexer_kl is not None:  # after the backward, which writes the values of KLs it computed
            kl = torch.stack(kl_values).mean() if kl_values else out.indexer_kl.detach()
            sums[1] += share * kl.double()
        return out.indexer_kl is not None, out.aux_loss is not None

    # ---- the loop ----------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        if self.evaluator is None:
            return {}
        self.model.eval()
        with torch.no_grad(), self._autocast():
            result = self.evaluator(self, self.step)
        record = {"step": self.step - 1, **{f"eval/{k}": v for k, v in result.items()}}
        self.logger.log(record)
        self.last_eval = result
        return result

    def fit(self, until: int | None = None) -> list[dict]:
        """Train from the current step to `until` (default: the recipe's last step). Returns the step records.

        With `cfg.overlap_steps` the host queues step N+1 before it reads step N's logged values, so a non-finite
        loss stops the run one step later (the checkpoints stay clean: a step's values are read before any
        evaluation or checkpoint after it)."""
        cfg = self.cfg
        until = self.plan.steps if until is None else min(until, self.plan.steps)
        if self.step == 0 and not self._resumed:
            done = latest_checkpoint(self.checkpoints.root)
            if done is not None:  # a new run would prune them as it saves its own, and --resume then find theirs
                raise ValueError(f"out_dir {self.out_dir} holds checkpoints of another run (latest: {done.name}): "
                                 "resume() continues it (`openm3 train --resume`); a new run needs another out_dir")
            self.logger.truncate_after(0)  # records of an attempt that crashed before its first checkpoint
        if self.info.is_main:  # the run's settings, readable (`openm3 train --config` takes the file back)
            write_text_atomic(self.out_dir / "train_config.json", json.dumps(cfg.settings(), indent=1, default=str))
        progress = Progress(self.plan.steps, self.step, enabled=self.info.is_main and cfg.progress)

        def finish(pending: PendingStep) -> None:
            record = pending.record()
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"loss is {record['loss']} at step {record['step']}")
            self.history.append(record)
            if record["step"] % cfg.log_every == 0 or record["step"] + 1 == until:
                self.logger.log(record)
            progress.update(record["loss"], record["tokens_per_s"])
            done = record["step"] + 1
            if self.info.is_main and cfg.print_every and (done % cfg.print_every == 0 or done == until):
                progress.write(f"step {done}/{self.plan.steps}: loss {record['loss']:.4f}, "
                               f"{record['tokens_per_s']:,.0f} tokens/s, lr {record['lr']:.3g}")

        pending: PendingStep | None = None
        try:
            with self._memory_advice():
                if self._evaluation_owed:
                    self._evaluation_owed = False
                    self.evaluate()
                while self.step < until:
                    queued = self.launch_step()
                    if pending is not None:
                        finish(pending)
                    pending = queued
                    last = self.step == self.plan.steps
                    evaluate = self._evaluates_at(self.step)
                    save = cfg.ckpt_every and (self.step % cfg.ckpt_every == 0) or last
                    if not cfg.overlap_steps or evaluate or save or self.step == until:
                        finish(pending)
                        pending = None
                    if save:  # before the evaluation: an evaluation that fails loses no training
                        self.save_checkpoint()
                    if evaluate:
                        self.evaluate()
        finally:
            progress.close()
        return self.history

    @contextmanager
    def _memory_advice(self):
        """Running out of device memory (CUDA's OutOfMemoryError, the CPU allocator's error) re-raised as
        torch.OutOfMemoryError saying what to change; the original error stays chained below it."""
        try:
            yield
        except RuntimeError as err:
            on_cpu = "can't allocate memory" in str(err)
            if not (isinstance(err, torch.OutOfMemoryError) or on_cpu):
                raise
            raise torch.OutOfMemoryError(self._memory_hint(on_cpu)) from err

    def _memory_hint(self, on_cpu: bool) -> str:
        cfg, info = self.cfg, self.info
        if on_cpu:
            where = "host memory"
        elif info.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(info.device) / 2**30
            total = torch.cuda.get_device_properties(info.device).total_memory / 2**30
            try:
                need = f"; estimated need {self.memory_estimate().total / 2**30:.1f} GiB"
            except ValueError:  # not an openm3 model: no estimate
                need = ""
            where = f"GPU memory ({peak:.1f} GiB peak allocated of {total:.1f} GiB{need})"
        else:
            where = f"{info.device.type} memory"
        return (f"training ran out of {where} after {self.step} completed steps, {cfg.micro_batch} rows of "
                f"{cfg.seq_len} tokens per forward on each rank: "
                + memory_advice(cfg, info.world_size, gpu=not on_cpu))

    def memory_estimate(self, **kwargs) -> MemoryEstimate:
        """The device memory this trainer's steps need per rank, estimated from its model's shapes and its config
        (`openm3.train.memory.estimate_training_memory`; `kwargs` go to it). ValueError for a model that is not an
        openm3 model."""
        device = "cuda" if self.info.device.type == "cuda" else "cpu"
        return estimate_training_memory(self.model, self.cfg, self.info.world_size, device, **kwargs)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self.logger.close()
