"""When should vision arrive? The four recipes of the talk's comparison, trained at one text-token budget.

    python -m experiments.recipes --out reports/recipes                      # m3-tiny on CPU, 3 seeds, ~10 min
    python -m experiments.recipes --out reports/recipes --seeds 0 --steps 60 --jobs 1     # a quick look

M3 trains on text and vision together from step zero ("native"). The baselines add vision later: before the
learning-rate decay ("mid") or after it, as continued pre-training ("cpt"); "text-only" never sees vision. Every
recipe trains on the same text rows in the same order (`openm3.train.recipes`), so held-out text quality compares
fairly; vision rows come on top while vision is on. Each run uses the README demo's settings (m3-tiny with MSA
layers, 256-token rows, one text row plus `--image-rows` image rows and `--video-rows` video rows per step while
vision is on) and is then evaluated as the demo is, on more data (`--windows`, `--video-qa`): held-out bits per
byte per corpus, image and video QA accuracy next to the best accuracy a model that sees only the question can
reach, indexer recall.

`--set FIELD=VALUE` changes a TrainConfig field in every run, for ablations (`--set aux_loss_weight=0`).
`--blind` keeps the vision rows' text (questions, answers, captions) and drops their pixels: a control for what
the images add beyond that text. `--mismatched` keeps the pixels but gives each vision example those of another
example (same shape): a control for whether what the images show matters, or only that visual tokens pass.
`--noise` gives them uniform noise of the same shape: do natural images matter at all?

Writes to `--out`: `runs/<recipe>_s<seed>.json` (one per run, written atomically as it finishes: a rerun skips
the runs already there, and refuses ones made with other settings), `summary.json` (every run, plus mean and
spread per recipe), `summary.md` (the table) and `text_loss.png` (text-row loss per step, mean over seeds). Runs
go to `--jobs` processes of one thread each (`--jobs 1`: in this process).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

RECIPES = ("text-only", "native", "mid", "cpt")
QA_TASKS = ("colour_qa", "video_qa")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.recipes", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reports/recipes", help="results folder (default: reports/recipes)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=240, help="optimizer steps per run (default: the demo's 240)")
    p.add_argument("--mid-start", type=float, default=0.5,
                   help="mid: vision from this fraction of the steps (default 0.5; the decay starts at 0.75)")
    p.add_argument("--cpt-fraction", type=float, default=0.25,
                   help="cpt: the last fraction of the steps with vision, after the text-only decay (default 0.25)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: the demo's 3e-3)")
    p.add_argument("--image-rows", type=int, default=2, help="image rows per text row while vision is on")
    p.add_argument("--video-rows", type=int, default=1, help="video rows per text row while vision is on")
    p.add_argument("--windows", type=int, default=4,
                   help="held-out documents per corpus for bits per byte (default 4; the demo: 2)")
    p.add_argument("--image-qa", type=int, default=70, help="image questions scored per run (default 70)")
    p.add_argument("--video-qa", type=int, default=48,
                   help="video questions scored per run (default 48; the demo: 24)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="runs in parallel (default: 2, or 1 on one core)")
    p.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                   help="TrainConfig fields for every run, for ablations (e.g. aux_loss_weight=0 kl_weight=0); "
                        "values are JSON, else strings")
    control = p.add_mutually_exclusive_group()
    control.add_argument("--blind", action="store_true",
                         help="vision rows without their pixels (their text only): what do the images add?")
    control.add_argument("--mismatched", action="store_true",
                         help="vision rows with another example's pixels: does what the images show matter?")
    control.add_argument("--noise", action="store_true",
                         help="vision rows with uniform-noise pixels: do natural images matter at all?")
    args = p.parse_args(argv)
    args.overrides = _overrides(p, args.set)
    for name in ("steps", "windows", "jobs", "image_rows", "lr"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < args.mid_start < 0.75:
        p.error(f"--mid-start must be in (0, 0.75) (before the decay, which starts at 0.75), got {args.mid_start}")
    if not 0 < args.cpt_fraction < 1:
        p.error(f"--cpt-fraction must be in (0, 1), got {args.cpt_fraction}")
    return args


def _overrides(p: argparse.ArgumentParser, items: list[str]) -> dict:
    """`--set FIELD=VALUE ...` -> {field: value}; an unknown field or a recipe setting is an error."""
    from openm3.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    reserved = {"recipe", "steps", "seed", "vision_start_step", "cpt_steps", "out_dir", "lr", "mixture"}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields or name in reserved:
            p.error(f"--set {item!r}: expected FIELD=VALUE with a TrainConfig field other than "
                    f"{sorted(reserved)} (those have their own options or belong to the recipe)")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def run_config(args: argparse.Namespace, recipe: str, seed: int, out_dir: Path):
    """The demo's training settings with `recipe`'s vision timing."""
    from openm3.demo import demo_config

    demo_args = argparse.Namespace(steps=args.steps, seq_len=256, lr=args.lr, vision_lr_scale=0.1,
                                   image_rows=args.image_rows, video_rows=args.video_rows, seed=seed,
                                   out=str(out_dir), no_progress=True)
    cfg = demo_config(demo_args)
    timing = {"mid": dict(vision_start_step=int(args.steps * args.mid_start)),
              "cpt": dict(cpt_steps=max(1, int(args.steps * args.cpt_fraction)))}.get(recipe, {})
    return dataclasses.replace(cfg, recipe=recipe, tensorboard=False, **timing, **args.overrides)


def run_one(args: argparse.Namespace, recipe: str, seed: int, out: Path) -> dict:
    """Train and evaluate one (recipe, seed); returns its record (also written to runs/)."""
    import torch

    torch.set_num_threads(1)
    from openm3.data import get_tokenizer
    from openm3.demo import DEMO_WEIGHTS
    from openm3.train.data import MixtureRows
    from openm3.train.eval import BASELINE_SAMPLES, Evaluator
    from openm3.train.factory import model_builder
    from openm3.train.trainer import Trainer

    name = f"{recipe}_s{seed}"
    tokenizer = get_tokenizer()
    cfg = run_config(args, recipe, seed, out / "train" / name)
    source = MixtureRows(tokenizer, cfg.seq_len, seed=seed, weights=DEMO_WEIGHTS, image_size=84, video_size=56,
                         control=_control(args), frames_per_clip=cfg.video_frames_per_clip)
    shutil.rmtree(cfg.out_dir, ignore_errors=True)  # a run cut short before its record trains again from scratch
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model_builder("m3-tiny", tokenizer), source)
    history = trainer.fit()
    t_train = time.perf_counter() - t0
    evaluator = Evaluator(tokenizer, seq_len=cfg.seq_len, windows=args.windows,
                          qa={"colour_qa": args.image_qa, "video_qa": args.video_qa}, image_size=84, video_size=56,
                          baseline_samples=BASELINE_SAMPLES, frames_per_clip=cfg.video_frames_per_clip)
    result = evaluator.evaluate(trainer.model)
    trainer.close()
    plan = cfg.plan()
    bpb = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith("bpb/")}
    record = {
        "recipe": recipe, "seed": seed, "steps": cfg.steps,
        "vision_steps": sum(plan.vision_on(s) for s in range(cfg.steps)),
        "text_tokens": plan.text_token_budget(cfg.seq_len),
        "tokens": sum(r["tokens"] for r in history),
        "bpb": bpb, "bpb_mean": sum(bpb.values()) / len(bpb),
        **{f"{task}_accuracy": result[f"{task}/accuracy"] for task in QA_TASKS},
        **{f"{task}_text_only_baseline": result[f"{task}/text_only_baseline"] for task in QA_TASKS},
        "indexer_recall": result.get("indexer_recall"),
        "text_loss": [r.get("loss/text") for r in history],
        "seconds": {"train": t_train, "total": time.perf_counter() - t0},
        **_settings(args, cfg),
    }
    write_json(out / "runs" / f"{name}.json", record)
    return record


def _control(args: argparse.Namespace) -> str | None:
    return next((c for c in ("blind", "mismatched", "noise") if getattr(args, c)), None)


def _settings(args: argparse.Namespace, cfg) -> dict:
    """What decides a run's numbers: its training config and the evaluation's sizes (JSON-normalised)."""
    evaluation = {"windows": args.windows, "image_qa": args.image_qa, "video_qa": args.video_qa}
    control = _control(args)
    data = {control: True} if control else {}  # absent for the default, so earlier runs still match
    return json.loads(json.dumps({"config": cfg.to_dict(), "evaluation": evaluation, **data}))


def write_json(path: Path, obj) -> None:
    from openm3.train.checkpoint import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(obj, indent=1))


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value: one seed has no spread)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt_mean_sd(ms: tuple[float, float | None] | None, digits: int) -> str:
    """A table cell: '-' for no value, the mean alone for one seed, else 'mean ± sd'."""
    if ms is None:
        return "-"
    return f"{ms[0]:.{digits}f}" if ms[1] is None else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def over_seeds(seeds: list[int]) -> str:
    """The table's note on what its cells are."""
    if len(seeds) == 1:
        return f"One seed ({seeds[0]}): no spread to show (more seeds: --seeds 0 1 2)."
    return f"Mean ± sample standard deviation over seeds {seeds}."


def summarise(records: list[dict]) -> dict:
    """Mean and sample standard deviation over seeds of each recipe's scores."""
    out = {}
    for recipe in RECIPES:
        rs = [r for r in records if r["recipe"] == recipe]
        if not rs:
            continue
        row = {"seeds": sorted(r["seed"] for r in rs), "vision_steps": rs[0]["vision_steps"],
               "text_tokens": rs[0]["text_tokens"]}
        keys = ["bpb_mean", *(f"bpb/{c}" for c in rs[0]["bpb"]), "colour_qa_accuracy", "video_qa_accuracy",
                "indexer_recall"]
        for key in keys:
            vals = [r["bpb"][key[4:]] if key.startswith("bpb/") else r[key] for r in rs]
            if all(v is not None for v in vals):
                row[key] = mean_sd(vals)
        row["colour_qa_text_only_baseline"] = rs[0]["colour_qa_text_only_baseline"]
        row["video_qa_text_only_baseline"] = rs[0]["video_qa_text_only_baseline"]
        out[recipe] = row
    return out


def summary_table(summary: dict) -> str:
    corpora = sorted(k[4:] for k in next(iter(summary.values())) if k.startswith("bpb/"))
    head = ["recipe", "vision steps", "bpb mean", *(f"bpb {c}" for c in corpora), "image QA", "video QA",
            "indexer recall"]
    fmt = lambda ms, d=3: fmt_mean_sd(ms, d)  # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for recipe, row in summary.items():
        cells = [recipe, str(row["vision_steps"]), fmt(row.get("bpb_mean")),
                 *(fmt(row.get(f"bpb/{c}")) for c in corpora), fmt(row.get("colour_qa_accuracy"), 2),
                 fmt(row.get("video_qa_accuracy"), 2), fmt(row.get("indexer_recall"), 2)]
        lines.append("| " + " | ".join(cells) + " |")
    first = next(iter(summary.values()))
    lines.append("")
    seeds = sorted({seed for row in summary.values() for seed in row["seeds"]})
    lines.append(f"{over_seeds(seeds)} QA accuracy of the best model that "
                 f"sees only the question: image {first['colour_qa_text_only_baseline']:.2f}, video "
                 f"{first['video_qa_text_only_baseline']:.2f}. Every recipe: {first['text_tokens']:,} text tokens.")
    return "\n".join(lines) + "\n"


def text_loss_plot(records: list[dict], path: Path, args: argparse.Namespace) -> None:
    from openm3.analysis.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    colours = {"text-only": "#444", "native": "#c33", "mid": "#36c", "cpt": "#a7a"}
    k = max(1, args.steps // 20)
    for recipe in RECIPES:
        curves = [r["text_loss"] for r in records if r["recipe"] == recipe]
        if not curves:
            continue
        mean = [statistics.fmean(v for v in col if v is not None) for col in zip(*curves)]
        smooth = [statistics.fmean(mean[max(0, i - k + 1):i + 1]) for i in range(len(mean))]
        ax.plot(range(len(smooth)), smooth, color=colours[recipe], lw=1.5, label=recipe)
    ax.axvline(int(args.steps * args.mid_start), color="#36c", ls=":", lw=1, label="mid: vision on")
    ax.axvline(args.steps - max(1, int(args.steps * args.cpt_fraction)), color="#a7a", ls=":", lw=1,
               label="cpt: vision on")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"text-row cross-entropy ({k}-step mean)")
    seeds = f"mean of {len(args.seeds)} seeds" if len(args.seeds) > 1 else f"seed {args.seeds[0]}"
    ax.set_title(f"m3-tiny, one text-token budget, {seeds}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def train_all(args: argparse.Namespace, todo: list[tuple], out: Path, run=None):
    """Yield each run's record as it finishes, `run(args, *item, out)` for each item of `todo` (default
    `run_one(args, recipe, seed, out)`): in this process with `args.jobs == 1`, else in spawned processes."""
    run = run or run_one
    if args.jobs == 1:
        for item in todo:
            yield run(args, *item, out)
        return
    import multiprocessing

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run, args, *item, out) for item in todo]
        for fut in as_completed(futures):
            yield fut.result()


def _with_new_defaults(config: dict | None) -> dict | None:
    """A stored run's config with the TrainConfig fields added since it was made at their defaults, which is how
    it ran (a field is added with the default that keeps the earlier behaviour)."""
    from openm3.train.config import TrainConfig

    if not isinstance(config, dict):
        return config
    added = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(TrainConfig) if f.name not in config}
    return {**json.loads(json.dumps(added)), **config}


def pending_runs(script: str, items: list[tuple], path_of, matches) -> tuple[list[tuple], list[dict]]:
    """(items to train, records of those already trained): an item's run is done when `path_of(*item)` exists;
    SystemExit naming it when `matches(record, *item)` says it was made with other settings."""
    todo, records = [], []
    for item in items:
        done = path_of(*item)
        if not done.exists():
            todo.append(item)
            continue
        record = json.loads(done.read_text())
        if not matches(record, *item):
            raise SystemExit(f"{script}: {done} was made with other settings than these; give another --out (or "
                             "delete it to train it again)")
        records.append(record)
    return todo, records


def main(argv=None) -> int:
    args = parse_args(argv)
    from openm3.demo import check_demo_extras

    check_demo_extras()
    out = Path(args.out)

    def matches(record: dict, recipe: str, seed: int) -> bool:
        cfg = run_config(args, recipe, seed, out / "train" / f"{recipe}_s{seed}")
        stored = {"config": _with_new_defaults(record.get("config")), "evaluation": record.get("evaluation")}
        return stored == _settings(args, cfg)

    todo, records = pending_runs("experiments.recipes", [(r, s) for s in args.seeds for r in args.recipes],
                                 lambda recipe, seed: out / "runs" / f"{recipe}_s{seed}.json", matches)
    print(f"experiments.recipes: {len(todo)} runs to train ({len(records)} already in {out / 'runs'}), "
          f"{args.jobs} at a time", flush=True)
    t0 = time.perf_counter()
    for i, r in enumerate(train_all(args, todo, out), 1):
        records.append(r)
        print(f"[{i}/{len(todo)} {time.perf_counter() - t0:5.0f} s] {r['recipe']:9s} seed {r['seed']}: "
              f"bpb {r['bpb_mean']:.4f}, image QA {r['colour_qa_accuracy']:.2f}, video QA "
              f"{r['video_qa_accuracy']:.2f}, {r['seconds']['total']:.0f} s", flush=True)
    records = [r for r in records if r["recipe"] in args.recipes and r["seed"] in args.seeds]
    records.sort(key=lambda r: (RECIPES.index(r["recipe"]), r["seed"]))
    summary = summarise(records)
    import torch

    write_json(out / "summary.json", {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "settings": vars(args), "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "text_loss"} for r in records]})
    table = summary_table(summary)
    (out / "summary.md").write_text(table)
    text_loss_plot(records, out / "text_loss.png", args)
    print(table)
    print(f"results in {out.resolve()}")
    return 0 if all(math.isfinite(r["bpb_mean"]) for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
