"""How many frames should the vision tower attend over at once? Video clip lengths compared at one budget.

    python -m experiments.clips --out reports/clips                # the tower probe: clips of 1, 2, 4, all; 3 seeds
    python -m experiments.clips --out reports/clips_model --part model      # the whole VL model (m3-tiny, CPU)
    python -m experiments.clips --out reports/clips --clips 1 all --seeds 0 --steps 100 --jobs 1   # a quick look

M3's vision tower attends jointly over all patches of a *clip* of consecutive frames ("3D attention"); MiniMax
reported 4 per clip as the best trade-off, and transformers' M3 video processor cuts videos into clips of 4
temporal patches (8 frames; `vision_segment_max_frames`). A clip length changes only which patches attend to
which: the visual tokens, the prompt and the parameters are the same, so every run of a part trains on the same
data. The videos are `video_qa`'s (direction of motion, first mover, number of flashes, forward or reversed
playback: answers that need several frames, 4-16 frames of 56 pixels).

`--part probe` (default): m3-tiny's vision tower, trained from scratch with one linear head per kind of question
on its mean-pooled output (pooling mixes clips without their order, so only the tower relates frames to each
other; `--readout ordered` reads one pooled vector per temporal patch, in time order, through a GRU instead, as the
language model can read the clips in order). Scored on held-out videos per kind, next to the best accuracy from
the question alone.
`--part model`: the README demo's native recipe (m3-tiny VL model, MSA, 256-token rows) with more video rows per
step (`--video-rows`, `--steps`), scored as the demo is (video QA per kind, image QA, held-out bits per byte).
At m3-tiny scale the whole model does not learn video QA (docs/experiments.md), so this part is for larger runs.
Both time the tower's forward and backward on the evaluation's videos with their clips.

Cost at M3's scale needs no training: per patch and layer the tower's linear layers take a fixed number of FLOPs
and attention `4 * clip_patches * hidden`, so `summary.md` also lists both for M3's tower over a few video sizes
(from `openm3.models.vision.attention_plan`).

Writes to `--out`: `runs/<part>_clip<N|all>_s<seed>.json` (atomically, as each finishes; a rerun skips those made
with the same settings and refuses others), `summary.json`, `summary.md`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path

from experiments.recipes import fmt_mean_sd, mean_sd, over_seeds, pending_runs, train_all, write_json
from openm3.train.cli import clip_length_arg

PARTS = ("probe", "model")
DEFAULT_CLIPS = ("1", "2", "4", "all")
VIDEO_KINDS = ("direction", "first_mover", "flashes", "playback")
VIDEO_SIZE = 56
DEFAULT_STEPS = {"probe": 1500, "model": 720}
# (frames, height, width) of the videos whose cost at M3's scale summary.md lists
COST_VIDEOS = ((16, 448, 448), (64, 448, 448), (64, 672, 672))


def clip_name(clip: int | None) -> str:
    return "all" if clip is None else str(clip)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.clips", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reports/clips", help="results folder (default: reports/clips)")
    p.add_argument("--part", choices=PARTS, default="probe",
                   help="probe: the vision tower with linear heads (default); model: the whole VL model")
    p.add_argument("--clips", nargs="+", type=clip_length_arg,
                   default=[clip_length_arg(c) for c in DEFAULT_CLIPS], metavar="N|all",
                   help="clip lengths in temporal patches of 2 frames (default: 1 2 4 all; the tasks' videos have "
                        "4-16 frames, so 8 equals all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per run (default: probe {DEFAULT_STEPS['probe']}, "
                        f"model {DEFAULT_STEPS['model']})")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: probe 1e-3 with AdamW, model the demo's 3e-3)")
    p.add_argument("--batch", type=int, default=16, help="probe: videos per step (default 16)")
    p.add_argument("--readout", choices=("pooled", "ordered"), default="pooled",
                   help="probe: heads on the tower's output mean-pooled over the video (default), or on a GRU over "
                        "its temporal patches in order")
    p.add_argument("--vision-lr-scale", type=float, default=0.1,
                   help="model: learning rate of the vision tower and projector relative to --lr (default: the "
                        "demo's 0.1)")
    p.add_argument("--image-rows", type=int, default=1, help="model: image rows per text row (default 1)")
    p.add_argument("--video-rows", type=int, default=4, help="model: video rows per text row (default 4)")
    p.add_argument("--windows", type=int, default=2, help="model: held-out documents per corpus for bits per byte")
    p.add_argument("--image-qa", type=int, default=24, help="model: image questions scored per run")
    p.add_argument("--video-qa", type=int, default=400, help="video questions scored per run (default 400)")
    p.add_argument("--timing-videos", type=int, default=16, help="evaluation videos the tower is timed on")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel")
    args = p.parse_args(argv)
    args.steps = DEFAULT_STEPS[args.part] if args.steps is None else args.steps
    args.lr = (1e-3 if args.part == "probe" else 3e-3) if args.lr is None else args.lr
    for name in ("steps", "lr", "batch", "vision_lr_scale", "image_rows", "video_rows", "windows", "video_qa",
                 "timing_videos", "jobs"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.image_qa < 0:
        p.error("--image-qa must be >= 0")
    if len(set(args.clips)) < len(args.clips):
        p.error(f"--clips: each length once, got {[clip_name(c) for c in args.clips]}")
    return args


def run_name(part: str, clip: int | None, seed: int) -> str:
    return f"{part}_clip{clip_name(clip)}_s{seed}"


# ---------------------------------------------------------------------------------------------- probe
def probe_settings(args: argparse.Namespace, clip: int | None, seed: int) -> dict:
    """What decides a probe run's numbers (JSON-normalised)."""
    tower = _tiny_tower_config()
    settings = {"part": "probe", "clip": clip, "seed": seed, "steps": args.steps, "lr": args.lr,
                "batch": args.batch, "video_size": VIDEO_SIZE, "tower": {
                    k: getattr(tower, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers")},
                "evaluation": {"video_qa": args.video_qa, "timing_videos": args.timing_videos}}
    if args.readout != "pooled":  # absent for the default, so earlier runs still match
        settings["readout"] = args.readout
    return json.loads(json.dumps(settings))


def _tiny_tower_config():
    from openm3.models import M3VLConfig

    return M3VLConfig.from_name("m3-tiny", image_token_index=1, video_token_index=2).vision_config


class Probe:
    """m3-tiny's vision tower and one linear head per kind of video question, reading the tower's output either
    mean-pooled over the whole video (`pooled`: clips mixed without their order) or as one mean-pooled vector per
    temporal patch, in time order, through a one-layer GRU (`ordered`: the order of the clips is there to read, as
    it is for the language model)."""

    def __init__(self, seed: int, readout: str = "pooled"):
        import torch

        from openm3.models.vision import M3VisionModel

        torch.manual_seed(seed)
        self.tower = M3VisionModel(_tiny_tower_config())
        hidden = self.tower.config.hidden_size
        counts = {"direction": 4, "first_mover": 2, "flashes": 8, "playback": 2}  # candidates per kind
        self.heads = torch.nn.ModuleDict({k: torch.nn.Linear(hidden, counts[k]) for k in VIDEO_KINDS})
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True) if readout == "ordered" else None

    def parameters(self):
        extra = [] if self.gru is None else list(self.gru.parameters())
        return [*self.tower.parameters(), *self.heads.parameters(), *extra]

    def _read(self, clips: list, grid):
        """One video's features from its clips' tower outputs ([t * h * w, hidden] each, frame after frame)."""
        import torch

        if self.gru is None:
            return torch.cat(clips).mean(0)
        steps = torch.cat([c.view(int(t), int(h * w), -1).mean(1) for c, (t, h, w) in zip(clips, grid.tolist())])
        return self.gru(steps[None])[1][0, 0]

    def logits(self, samples, clip: int | None):
        """[(logits over the sample's candidates, index of its answer, kind)] for a batch of `video_qa` samples."""
        import torch

        from openm3.models.processor import M3VideoProcessor

        pixels, grid, counts = M3VideoProcessor(frames_per_clip=clip)([s.videos[0].frames for s in samples])
        per_clip = torch.split(self.tower(pixels, grid), grid.prod(-1).tolist())
        out, k = [], 0
        for s, n in zip(samples, counts):
            features = self._read(list(per_clip[k:k + n]), grid[k:k + n])
            k += n
            kind = s.task.split(":", 1)[1]
            out.append((self.heads[kind](features), s.candidates.index(s.answer), kind))
        return out


def run_probe(args: argparse.Namespace, clip: int | None, seed: int, out: Path) -> dict:
    """Train the tower probe on `video_qa` samples in clips of `clip`, score it per kind; returns its record."""
    import numpy as np
    import torch

    from openm3.train.eval import BASELINE_SAMPLES, baseline_train_samples
    from openm3.train.tasks import TASKS, qa_samples, text_only_baseline

    torch.set_num_threads(1)
    probe, task = Probe(seed, args.readout), TASKS["video_qa"]
    opt = torch.optim.AdamW(probe.parameters(), lr=args.lr, weight_decay=0.01)
    t0 = time.perf_counter()
    losses = []
    for step in range(args.steps):
        rng = np.random.default_rng([seed, 31, step])
        samples = [task.sample(rng, video_size=VIDEO_SIZE) for _ in range(args.batch)]
        loss = sum(torch.nn.functional.cross_entropy(z[None], torch.tensor([y])) for z, y, _ in
                   probe.logits(samples, clip)) / args.batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    t_train = time.perf_counter() - t0
    test = qa_samples("video_qa", args.video_qa, 10_000, video_size=VIDEO_SIZE)  # the Evaluator's held-out stream
    right: dict[str, list[bool]] = {k: [] for k in VIDEO_KINDS}
    probe.tower.eval()
    with torch.no_grad():
        for i in range(0, len(test), 32):
            for z, y, kind in probe.logits(test[i:i + 32], clip):
                right[kind].append(int(z.argmax()) == y)
    probe.tower.train()
    train = baseline_train_samples("video_qa", BASELINE_SAMPLES["video_qa"], video_size=VIDEO_SIZE)
    baseline = {k: text_only_baseline([s for s in train if s.task.endswith(k)], [s for s in test if s.task.endswith(k)])
                for k in VIDEO_KINDS}
    record = {"part": "probe", "clip": clip_name(clip), "seed": seed, "steps": args.steps,
              "video_qa_accuracy": sum(sum(v) for v in right.values()) / len(test),
              "video_qa_text_only_baseline": text_only_baseline(train, test),
              **{f"video_qa/{k}": (sum(v) / len(v) if v else None) for k, v in right.items()},
              **{f"baseline/{k}": baseline[k] for k in VIDEO_KINDS},
              "train_loss_last_100": statistics.fmean(losses[-100:]),
              "tower_ms": 1000 * tower_seconds(probe.tower, [s.videos[0].frames for s in test[:args.timing_videos]],
                                               clip),
              "seconds": {"train": t_train, "total": time.perf_counter() - t0},
              "settings": probe_settings(args, clip, seed)}
    write_json(out / "runs" / f"{run_name('probe', clip, seed)}.json", record)
    return record


def tower_seconds(tower, videos: list, clip: int | None, repeats: int = 5) -> float:
    """Median seconds of `tower`'s forward and backward (to its input's grads) over `videos` (uint8 frames),
    packed as one batch in clips of `clip`."""
    from openm3.models.processor import M3VideoProcessor

    pixels, grid, _ = M3VideoProcessor(frames_per_clip=clip)(videos)
    times = []
    for _ in range(repeats):
        x = pixels.clone().requires_grad_(True)
        t0 = time.perf_counter()
        tower(x, grid).float().square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- model
def run_config(args: argparse.Namespace, clip: int | None, seed: int, out_dir: Path):
    """The demo's training settings with `--steps` and this part's vision rows, clips of `clip`."""
    import dataclasses

    from openm3.demo import demo_config

    demo_args = argparse.Namespace(steps=args.steps, seq_len=256, lr=args.lr, vision_lr_scale=args.vision_lr_scale,
                                   image_rows=args.image_rows, video_rows=args.video_rows, seed=seed,
                                   out=str(out_dir), no_progress=True)
    return dataclasses.replace(demo_config(demo_args), tensorboard=False, video_frames_per_clip=clip)


def model_settings(args: argparse.Namespace, clip: int | None, seed: int, out: Path) -> dict:
    cfg = run_config(args, clip, seed, out / "train" / run_name("model", clip, seed))
    evaluation = {k: getattr(args, k) for k in ("windows", "image_qa", "video_qa", "timing_videos")}
    return json.loads(json.dumps({"part": "model", "config": cfg.to_dict(), "evaluation": evaluation}))


def run_model(args: argparse.Namespace, clip: int | None, seed: int, out: Path) -> dict:
    """Train and evaluate the whole VL model with clips of `clip`; returns its record (also written to runs/)."""
    import torch

    torch.set_num_threads(1)
    from openm3.data import get_tokenizer
    from openm3.demo import DEMO_WEIGHTS
    from openm3.train.data import MixtureRows
    from openm3.train.eval import BASELINE_SAMPLES, Evaluator
    from openm3.train.factory import model_builder
    from openm3.train.trainer import Trainer

    tokenizer = get_tokenizer()
    cfg = run_config(args, clip, seed, out / "train" / run_name("model", clip, seed))
    source = MixtureRows(tokenizer, cfg.seq_len, seed=seed, weights=DEMO_WEIGHTS, image_size=84,
                         video_size=VIDEO_SIZE, frames_per_clip=clip)
    evaluator = Evaluator(tokenizer, seq_len=cfg.seq_len, windows=args.windows,
                          qa={k: n for k, n in (("colour_qa", args.image_qa), ("video_qa", args.video_qa)) if n},
                          image_size=84, video_size=VIDEO_SIZE, baseline_samples=BASELINE_SAMPLES,
                          frames_per_clip=clip)
    shutil.rmtree(cfg.out_dir, ignore_errors=True)  # a run cut short before its record trains again from scratch
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model_builder("m3-tiny", tokenizer), source)
    history = trainer.fit()
    t_train = time.perf_counter() - t0
    result = evaluator.evaluate(trainer.model)
    videos = [qa.sample.videos[0].frames for qa in evaluator.qa["video_qa"][:args.timing_videos]]
    tower = tower_seconds(trainer.model.vision_tower, videos, clip)
    trainer.close()
    bpb = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith("bpb/")}
    video_losses = [r["loss/video"] for r in history if r.get("loss/video") is not None]
    record = {
        "part": "model", "clip": clip_name(clip), "seed": seed, "steps": cfg.steps,
        "video_qa_accuracy": result["video_qa/accuracy"],
        "video_qa_text_only_baseline": result["video_qa/text_only_baseline"],
        **{f"video_qa/{k}": result.get(f"video_qa/{k}/accuracy") for k in VIDEO_KINDS},
        "colour_qa_accuracy": result.get("colour_qa/accuracy"),
        "bpb_mean": sum(bpb.values()) / len(bpb), "bpb": bpb,
        "train_loss_last_100": statistics.fmean(video_losses[-100:]) if video_losses else None,
        "tower_ms": 1000 * tower,
        "seconds": {"train": t_train, "total": time.perf_counter() - t0},
        "settings": model_settings(args, clip, seed, out),
    }
    write_json(out / "runs" / f"{run_name('model', clip, seed)}.json", record)
    return record


def run_one(args: argparse.Namespace, clip: int | None, seed: int, out: Path) -> dict:
    return (run_probe if args.part == "probe" else run_model)(args, clip, seed, out)


def expected_settings(args: argparse.Namespace, clip: int | None, seed: int, out: Path) -> dict:
    return probe_settings(args, clip, seed) if args.part == "probe" else model_settings(args, clip, seed, out)


# ---------------------------------------------------------------------------------------------- summary
SUMMARY_KEYS = ("video_qa_accuracy", *(f"video_qa/{k}" for k in VIDEO_KINDS), "colour_qa_accuracy", "bpb_mean",
                "train_loss_last_100", "tower_ms")


def summarise(records: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of each clip length's scores, in the records' clip order."""
    out = {}
    for clip in dict.fromkeys(r["clip"] for r in records):
        rs = [r for r in records if r["clip"] == clip]
        row = {"seeds": sorted(r["seed"] for r in rs),
               **{k: v for k, v in rs[0].items() if k.startswith("baseline/") or k.endswith("text_only_baseline")}}
        for key in SUMMARY_KEYS:
            vals = [r.get(key) for r in rs]
            if all(v is not None for v in vals):
                row[key] = mean_sd(vals)
        out[clip] = row
    return out


def m3_costs(clips: list[int | None]) -> list[dict]:
    """Per video of COST_VIDEOS and clip length: M3's tower (its default `M3VisionConfig`) attention and linear
    GFLOP per layer for the whole video (forward), from `attention_plan`; linear: 2 x the block's weights."""
    import torch

    from openm3.models.processor import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, smart_resize
    from openm3.models.vision import M3VisionConfig, attention_plan

    vc = M3VisionConfig()
    per_patch_linear = 2 * (4 * vc.hidden_size ** 2 + 2 * vc.hidden_size * vc.intermediate_size)
    rows = []
    for frames, height, width in COST_VIDEOS:
        h, w = smart_resize(height, width, 28, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
        grid = torch.tensor([[frames // 2, h // 14, w // 14]])
        patches = int(grid.prod())
        for clip in clips:
            plan = attention_plan(grid, clip, hidden_size=vc.hidden_size)
            attention = sum(c.flops for c in plan)
            rows.append({"video": f"{frames} frames {height}x{width}", "clip": clip_name(clip),
                         "clip_patches": plan[0].patches, "attention_gflop": attention / 1e9,
                         "linear_gflop": patches * per_patch_linear / 1e9,
                         "attention_share": attention / (attention + patches * per_patch_linear)})
    return rows


def summary_table(part: str, summary: dict, costs: list[dict]) -> str:
    fmt = lambda ms, d=2: fmt_mean_sd(ms, d)  # noqa: E731
    extra = ["image QA", "bpb mean", "video loss (last 100 steps)"] if part == "model" else ["loss (last 100 steps)"]
    head = ["clip (temporal patches)", "frames", "video QA", *VIDEO_KINDS, *extra, "tower fwd+bwd ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for clip, row in summary.items():
        frames = "all" if clip == "all" else str(2 * int(clip))
        cells = [clip, frames, fmt(row.get("video_qa_accuracy")), *(fmt(row.get(f"video_qa/{k}")) for k in VIDEO_KINDS)]
        if part == "model":
            cells += [fmt(row.get("colour_qa_accuracy")), fmt(row.get("bpb_mean"), 3)]
        cells += [fmt(row.get("train_loss_last_100"), 3), fmt(row.get("tower_ms"), 1)]
        lines.append("| " + " | ".join(cells) + " |")
    first = next(iter(summary.values()))
    seeds = sorted({s for row in summary.values() for s in row["seeds"]})
    kinds = ", ".join(f"{k} {first[f'baseline/{k}']:.2f}" for k in VIDEO_KINDS if f"baseline/{k}" in first)
    lines += ["", f"{over_seeds(seeds)} Best accuracy from the question alone: "
                  f"video QA {first['video_qa_text_only_baseline']:.2f}" + (f" ({kinds})" if kinds else "") + ".",
              "", "M3's tower (hidden 1280, intermediate 5120), forward GFLOP per layer for one video:", "",
              "| video | clip | patches per clip | attention | linear layers | attention share |",
              "|---|---|---|---|---|---|"]
    for c in costs:
        lines.append(f"| {c['video']} | {c['clip']} | {c['clip_patches']:,} | {c['attention_gflop']:,.0f} | "
                     f"{c['linear_gflop']:,.0f} | {c['attention_share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    from openm3.demo import check_demo_extras

    check_demo_extras()
    out = Path(args.out)
    todo, records = pending_runs(
        "experiments.clips", [(c, s) for s in args.seeds for c in args.clips],
        lambda clip, seed: out / "runs" / f"{run_name(args.part, clip, seed)}.json",
        lambda record, clip, seed: record.get("settings") == expected_settings(args, clip, seed, out))
    print(f"experiments.clips ({args.part}): {len(todo)} runs to train ({len(records)} already in "
          f"{out / 'runs'}), {args.jobs} at a time", flush=True)
    t0 = time.perf_counter()
    for i, r in enumerate(train_all(args, todo, out, run=run_one), 1):
        records.append(r)
        print(f"[{i}/{len(todo)} {time.perf_counter() - t0:5.0f} s] clip {r['clip']:>3} seed {r['seed']}: video QA "
              f"{r['video_qa_accuracy']:.2f}, tower {r['tower_ms']:.1f} ms, {r['seconds']['total']:.0f} s", flush=True)
    order = [clip_name(c) for c in args.clips]
    records = [r for r in records if r["clip"] in order and r["seed"] in args.seeds]
    records.sort(key=lambda r: (order.index(r["clip"]), r["seed"]))
    summary, costs = summarise(records), m3_costs(args.clips)
    import torch

    write_json(out / "summary.json", {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "settings": vars(args), "summary": summary, "m3_costs": costs,
        "runs": records})
    table = summary_table(args.part, summary, costs)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"results in {out.resolve()}")
    return 0 if all(math.isfinite(r["train_loss_last_100"] or 0.0) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
