"""`openm3 train`: train a preset with a recipe on the bundled data; one process or several through torchrun.

    openm3 train --recipe native --steps 2000 --out runs/native
    openm3 train --config run.json --resume --export runs/native/model
    openm3 train --recipe native --video-frames-per-clip all --out runs/native_whole_videos
    torchrun --nproc_per_node=2 -m openm3.train.cli --recipe native --out runs/native

`--config` is a JSON object of `TrainConfig` fields; flags override it. `extra` may hold `weights` (source ->
weight, see `openm3.train.data`), `image_size`, `video_size`, and `eval` (`windows`, `qa`: task -> samples).
Every run writes its settings to `train_config.json` in its folder (`--config` takes that file back).
Bad settings (unknown recipe, decay before warmup, a global batch the world size does not divide, a context longer
than the model's, a missing `data` extra) fail before anything is built.

Before the model is built it prints its memory estimate per rank (`openm3.train.memory`; `-v`: every part) and
refuses a run whose estimate exceeds the GPU's memory (on a CPU: the host's memory and swap, shared by its ranks) by
more than 10%, saying what to change (`--skip-memory-check` runs it anyway).

`--resume` continues the run in `--out` from its latest checkpoint, with the settings that run was made with (its
checkpoint holds them): flags may change how it runs (`config.RESUMABLE`: steps, decay start, checkpoint and
evaluation cadence, micro-batch, device, memory and speed options) but not what it trains (model, recipe, data,
context, batch, learning rate, seed, ...), which fails naming each such setting; a folder without a checkpoint is
an error too.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path

from .config import TrainConfig, known_fields, resume_conflicts


# (TrainConfig field, type, help) of the plain value flags; defaults are TrainConfig's
_FLAGS = (
    ("model", str, "preset: m3-tiny (CPU, default), m3-small (one GPU), m3"),
    ("layers", int, "the preset at N decoder layers (its pattern kept: the first dense, the rest MSA with MoE); "
                    "default: the preset's"),
    ("recipe", str, "text-only | native (vision from step 0, default) | mid (vision from --vision-start-step) | "
                    "cpt (vision for --cpt-steps after the decay)"),
    ("steps", int, "optimizer steps (default 100)"),
    ("seq_len", int, "tokens per packed row (default 256)"),
    ("text_rows", int, "text rows per optimizer step, all ranks together (default 4); vision rows follow the "
                       "recipe's mixture"),
    ("micro_batch", int, "rows per forward on each rank; gradients accumulate over the rest (default 2)"),
    ("lr", float, "peak learning rate (default 3e-3)"),
    ("warmup_steps", int, "linear warm-up steps (default 10; half the steps of a run shorter than 20)"),
    ("decay_start", int, "step where the LR decay starts (default 80%% of --steps)"),
    ("msa_switch_step", int, "steps before it are the dense warm-up of the MSA layers (default 0)"),
    ("kl_weight", float, "weight of the indexer KL loss (default 1.0; 0 turns it off)"),
    ("seed", int, "seed of the model init, data order and sampling (default 0)"),
    ("ckpt_every", int, "checkpoint every N steps (default 0: only at the end)"),
    ("print_every", int, "print a plain line (step, loss, tokens/s, learning rate) every N steps, e.g. for logs "
                         "without the progress bar (default 0: never)"),
    ("eval_every", int, "evaluate every N steps (default 0: only at the end)"),
    ("vision_start_step", int, "recipe mid: step where vision rows start"),
    ("cpt_steps", int, "recipe cpt: vision steps after the decay"),
    ("device", str, "auto (cuda if available, default) | cpu | cuda"),
    ("param_dtype", lambda text: {"bf16": "bfloat16", "fp32": "float32"}.get(text, text),
     "auto (bf16 on CUDA, fp32 on CPU, default) | float32 (fp32) | bfloat16 (bf16)"),
    ("init_from", str, "start from the weights of this checkpoint directory (an --export, save_pretrained, a "
                       "release; either layout, fp8 too): its config.json decides the model (not --model) and its "
                       "tokenizer.json, if any, tokenizes the data"),
    ("residual_dtype", str, "auto (the compute dtype, default) | float32 (fp32 hidden states between layers "
                            "under the single-process bf16 autocast)"),
)


def build_parser() -> argparse.ArgumentParser:
    from ..cli import ArgumentParser

    p = ArgumentParser(prog="openm3 train", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, help="JSON file of TrainConfig fields (flags override it)")
    for name, kind, text in _FLAGS:
        aliases = ["--preset"] if name == "model" else []  # generate's and serve's name for it
        p.add_argument(f"--{name.replace('_', '-')}", *aliases, dest=name, type=kind, default=None, help=text)
    p.add_argument("--video-frames-per-clip", dest="video_frames_per_clip", type=_clip_length, default=None,
                   metavar="N|all", help="temporal patches (2 frames each) per video clip, the span of the vision "
                   "tower's attention (default 4, as M3, or --init-from's recorded one; all: each video one "
                   "clip); the export records it")
    p.add_argument("--out", dest="out_dir", default=None, help="run folder: logs, TensorBoard, checkpoints "
                   "(default runs/train)")
    p.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="recompute each decoder layer in the backward (long contexts)")
    p.add_argument("--no-ac-reuse-msa", dest="ac_reuse_msa", action="store_false", default=None,
                   help="with --activation-checkpointing, recompute MSA layers' block selection and indexer KL too "
                        "(by default the recomputation reuses the forward's: faster, ~160 MB more per MSA layer "
                        "at 64K tokens on m3-small)")
    p.add_argument("--ac-keep-attention", dest="ac_keep_attention", action="store_true", default=None,
                   help="with --activation-checkpointing, keep each layer's attention (its q, k, v, output and "
                        "softmax statistics, ~0.6 GB per m3-small layer at 64K tokens) instead of recomputing it in "
                        "the backward: a selective checkpoint, faster where memory allows")
    p.add_argument("--no-kl-in-backward", dest="kl_in_backward", action="store_false", default=None,
                   help="run the indexer KL in the forward, as a separate pass (by default it runs in the "
                        "attention's backward, which computes its teacher anyway; with --activation-checkpointing "
                        "only while the recomputation reuses the forward's selection, i.e. without "
                        "--no-ac-reuse-msa)")
    p.add_argument("--no-warmup-kl-to-backbone", dest="warmup_kl_to_backbone", action="store_false", default=None,
                   help="in the dense warm-up, the indexer KL trains the index branch only (its input detached, as "
                        "in the sparse stage); by default its gradient also reaches the backbone there")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile each decoder layer (the attention ops stay eager inside it)")
    p.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false", default=None,
                   help="read each step's logged values before queueing the next (by default the next step is "
                        "queued first, so the GPU does not wait for the host between steps)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--export", type=Path, help="write a consolidated checkpoint (published M3 layout) here at the end")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="run even when the memory estimate exceeds the GPU (by default a run whose estimate is over "
                        "110%% of the GPU's memory is refused before the model is built)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every part of the memory estimate (parameters, gradients, optimizer, activations, "
                        "...), not only the total")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def clip_length_arg(text: str) -> int | None:
    """argparse type of a video clip length: a positive number of temporal patches, or 'all' (None)."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of temporal patches or 'all', got {text!r}")
    return int(text)


def _clip_length(text: str):
    value = clip_length_arg(text)
    return ALL_FRAMES if value is None else value  # None would read as "not given"


ALL_FRAMES = "all"  # --video-frames-per-clip all: TrainConfig.video_frames_per_clip = None


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's `TrainConfig`: `--config`'s fields, then the flags given; with `--resume`, the run's own settings
    first (`resumed_config`)."""
    given = _given_settings(args)
    if getattr(args, "resume", False):
        return resumed_config(given)
    if given.get("init_from") and "video_frames_per_clip" not in given:  # the checkpoint's, unless given
        from ..models.processor import video_frames_per_clip

        given["video_frames_per_clip"] = video_frames_per_clip(given["init_from"])
    cfg = TrainConfig.from_dict(given)
    from .checkpoint import latest_checkpoint

    done = latest_checkpoint(Path(cfg.out_dir) / "checkpoints")
    if done is not None:  # a new run there would prune them as it saves, and a later --resume find theirs
        raise ValueError(f"--out {cfg.out_dir} holds another run's checkpoints (latest: {done.name}): --resume "
                         "continues that run; a new run needs another --out (or that folder deleted)")
    return cfg


def _given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of `--config` (a JSON file) with the flags given on top."""
    base = {}
    if args.config:
        try:
            base = json.loads(args.config.read_text())
        except OSError as e:
            raise ValueError(f"--config: cannot read {str(args.config)!r} ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: {str(args.config)!r} is not valid JSON ({e})") from None
        if not isinstance(base, dict):
            raise ValueError(f"--config must hold a JSON object of TrainConfig fields, got {type(base).__name__}")
    skip = {"config", "resume", "export", "threads", "skip_memory_check", "verbose"}
    overrides = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    if overrides.get("video_frames_per_clip") == ALL_FRAMES:
        overrides["video_frames_per_clip"] = None
    return {**base, **overrides}


def resumed_config(given: dict) -> TrainConfig:
    """The settings of the run in `given`'s out_dir, read from its latest checkpoint, with the `given` ones that
    may change on a resume (`RESUMABLE`) applied. ValueError when the folder holds no checkpoint, or naming every
    given setting that would change what the run trains."""
    from .checkpoint import saved_run

    out = Path(given.get("out_dir", TrainConfig.out_dir))
    found = saved_run(out / "checkpoints")
    if found is None:
        raise ValueError(f"--resume: no complete checkpoint under {out / 'checkpoints'} (is --out the run's "
                         f"folder? without --resume a new run starts there)")
    path, step, saved = found
    saved = known_fields(saved)
    cfg = TrainConfig.from_dict({**saved, **given})
    refused = resume_conflicts(saved, cfg)
    if refused:
        raise ValueError(f"--resume: the run in {out} was made with " + ", ".join(
            f"{k}={was!r} (given {now!r})" for k, was, now in refused) + "; a resumed run keeps what it trains "
            "(see its train_config.json), or start a new run in another --out")
    before, after = TrainConfig.from_dict(saved).to_dict(), cfg.to_dict()
    changed = [k for k in given if after[k] != before[k]]
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 says it
        return cfg
    print(f"resuming {out} from {path.name} (step {step} of {cfg.steps})"
          + (f"; settings changed: {', '.join(f'{k}={after[k]!r}' for k in changed)}" if changed else ""))
    if "steps" in changed and "decay_start" not in given:
        print(f"  the learning-rate decay still starts at step {cfg.decay_start} (--decay-start moves it)")
    return cfg


def check_context(cfg: TrainConfig, text_config) -> None:
    """Packed rows no longer than the model's context (`max_position_embeddings`): a longer run would train
    positions the model's config does not claim (and on a CPU likely run out of memory first)."""
    if cfg.seq_len > text_config.max_position_embeddings:
        source = f"init_from {cfg.init_from!r}" if cfg.init_from else f"model {cfg.model!r}"
        raise ValueError(f"seq_len={cfg.seq_len} is longer than the context of {source} (max_position_embeddings="
                         f"{text_config.max_position_embeddings}); pass --seq-len up to that, or a model made for "
                         f"longer contexts")


def check_memory(cfg: TrainConfig, build, *, skip: bool = False, verbose: bool = False):
    """Print the run's memory estimate (`openm3.train.memory`; rank 0) from the model's shapes (`build` called on
    the meta device: no weights) and refuse a run whose estimate exceeds the GPU's memory, or on a CPU the host's
    (`memory.check_fits`), unless `skip`. Returns the estimate."""
    import torch

    from . import distributed as D
    from .memory import check_fits, estimate_training_memory, host_memory

    device = D.pick_device(cfg.device)
    with torch.device("meta"):
        skeleton = (getattr(build, "skeleton", None) or build)()
    estimate = estimate_training_memory(skeleton, cfg, D.world_size_from_env(),
                                        "cuda" if device.type == "cuda" else "cpu")
    gpu = device.type == "cuda"
    total = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[1] if gpu else host_memory()
    main_rank = os.environ.get("RANK", "0") == "0"
    if main_rank:
        print(estimate.summary(total))
        if verbose:
            print(estimate.table())
    if total is not None and not skip:
        warning = check_fits(estimate, total, cfg, 1 if gpu else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if warning and main_rank:
            print(f"warning: {warning}")
    return estimate


def eval_questions(ev: dict, build) -> dict:
    """The evaluation's image / video question counts (`extra.eval.qa`): 50 image and 24 video questions for a
    vision-language model, none for a text-only one (`--init-from` a text checkpoint), which cannot take them."""
    if getattr(build, "multimodal", True):
        return ev.get("qa", {"colour_qa": 50, "video_qa": 24})
    asked = {task: n for task, n in ev.get("qa", {}).items() if n}
    if asked:
        raise ValueError(f"extra.eval.qa asks for {asked}, but the model is text-only (its checkpoint has no vision "
                         "tower): image and video questions need a vision-language model")
    return {}


def main(argv=None) -> int:
    from ..threads import set_threads
    from . import distributed as D
    from .data import check_data_extra

    args = parse_args(argv)
    cfg = build_config(args)  # validates recipe, schedule, mixture
    cfg.check_world(D.world_size_from_env())
    check_data_extra()
    set_threads(args.threads)

    from ..data import get_tokenizer
    from .data import MixtureRows
    from .eval import Evaluator
    from .factory import checkpoint_builder, checkpoint_tokenizer, model_builder
    from .trainer import Trainer

    saved = checkpoint_tokenizer(cfg.init_from) if cfg.init_from else None  # checks the directory first
    tokenizer = saved or get_tokenizer()
    extra = cfg.extra
    sizes = {"image_size": extra.get("image_size", 112), "video_size": extra.get("video_size", 56)}
    source = MixtureRows(tokenizer, cfg.seq_len, seed=cfg.seed, weights=extra.get("weights"),
                         frames_per_clip=cfg.video_frames_per_clip, **sizes)
    needed = {k for step in (0, cfg.steps - 1) for k, n in cfg.plan().rows(step).items() if n}
    missing = sorted(needed - set(source.kinds()))
    if missing:
        raise ValueError(f"recipe {cfg.recipe!r} needs {missing} rows but extra.weights has no such sources")
    if cfg.init_from:
        build = checkpoint_builder(cfg.init_from, tokenizer, multimodal=bool(needed & {"image", "video"}))
    else:
        build = model_builder(cfg.model, tokenizer, **({"num_hidden_layers": cfg.layers} if cfg.layers else {}))
    check_context(cfg, build.text_config)
    check_memory(cfg, build, skip=args.skip_memory_check, verbose=args.verbose)
    ev = extra.get("eval", {})
    evaluator = Evaluator(tokenizer, seq_len=cfg.seq_len, windows=ev.get("windows", 2), qa=eval_questions(ev, build),
                          frames_per_clip=cfg.video_frames_per_clip, **sizes)
    trainer = Trainer(cfg, build, source, evaluator=evaluator)
    if args.resume and not trainer.resume():  # resumed_config found one: it went while the model was built
        raise ValueError(f"--resume: the checkpoint under {trainer.checkpoints.root} is gone")
    trainer.fit()
    if args.export:
        trainer.export(args.export, tokenizer)
    if trainer.info.is_main:
        print(summary(trainer, args.export))
    trainer.close()
    D.shutdown_distributed()
    return 0


def summary(trainer, export: Path | None) -> str:
    """The lines `openm3 train` ends with: where the run stands, its last evaluation, where things are."""
    cfg = trainer.cfg
    if trainer.history:
        head = f"done: step {trainer.step}/{cfg.steps}, loss {trainer.history[-1]['loss']:.4f}"
    else:
        head = f"done: the run was at step {trainer.step} of {cfg.steps} already (--steps N trains it further)"
    lines = [head]
    if trainer.last_eval:
        lines += textwrap.wrap("eval: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in trainer.last_eval.items()), 116,
                               subsequent_indent="  ", break_on_hyphens=False)
    lines.append(f"logs in {cfg.out_dir} (metrics.jsonl, train_config.json)"
                 + (f"; exported to {export}" if export else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
