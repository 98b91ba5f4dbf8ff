"""`openm3 demo`: train m3-tiny natively multimodal on CPU in a few minutes and write a report folder.

    openm3 demo [--out reports/demo] [--steps N]

From step zero every optimizer step mixes held-out-split-free text of the bundled corpora (Python stdlib,
pydoc topics, two public-domain Bibles) with image question answering (`colour_qa`: "What colour is the
circle?") and rendered video clips whose answer needs several frames (`video_qa`). The MSA layers start in the
dense warm-up (index branch trained by the dense KL) and switch to sparse attention. The vision tower and projector
train at a tenth of the learning rate (at the full rate their outputs collapse to one direction). The report folder
holds:

- `metrics.json`: settings, timings, final losses, held-out bits per byte per corpus, image and video QA accuracy
  next to the best accuracy a model that sees only the question can reach, indexer recall per MSA layer;
- `loss_curve.png`, `attention_map.png` (text-to-image attention on an image question), `indexer_blocks.png`
  (the key blocks the indexer chose for every query of a long held-out text);
- `samples.md`: generations, including answers about an image and a video;
- `metrics.jsonl` (every step), `model/` (consolidated checkpoint in the published M3 layout), and the training
  run's own files: `train_config.json`, `checkpoints/` (the last one, ~36 MB: `openm3 train --out DIR --resume`
  continues it), `tensorboard/`.

A run checks its settings, then removes the last run's files from the folder, so one that stops early never leaves
an earlier run's report there as its own; `metrics.json` and `samples.md` are written whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from .threads import set_threads

REPORT_FILES = ("metrics.json", "samples.md", "loss_curve.png", "attention_map.png", "indexer_blocks.png")
DEMO_WEIGHTS = {"text:stdlib": 1.0, "text:topics": 0.5, "text:bible_web": 0.75, "text:bible_kjv": 0.75,
                "colour_qa": 1.0, "video_qa": 1.0}


def build_parser() -> argparse.ArgumentParser:
    from .cli import ArgumentParser

    p = ArgumentParser(prog="openm3 demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reports/demo", help="report folder (default: reports/demo)")
    p.add_argument("--steps", type=int, default=240, help="optimizer steps (default: 240)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed row (default: 256)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--image-rows", type=int, default=2, help="image rows per text row in each step (default: 2)")
    p.add_argument("--video-rows", type=int, default=1, help="video rows per text row in each step (default: 1)")
    p.add_argument("--vision-lr-scale", type=float, default=0.1,
                   help="learning rate of the vision tower and projector relative to --lr (default: 0.1; at 1.0 "
                        "the projector's outputs grow until every image maps to one direction, which the "
                        "language model's RMSNorm cannot tell apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-qa", type=int, default=70, help="image questions to evaluate (default: 70)")
    p.add_argument("--video-qa", type=int, default=24, help="video questions to evaluate (default: 24)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; the tiny model's ops gain nothing from more, and "
                        "oversubscribed threads spin)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "image_qa", "video_qa", "image_rows"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.video_rows < 0:  # (0: no video rows) the mixture's own check would name the mixture, not the flag
        p.error("--video-rows must be >= 0")
    return args


def demo_config(args):
    from .train.config import TrainConfig

    return TrainConfig(model="m3-tiny", recipe="native", steps=args.steps, seq_len=args.seq_len, text_rows=1,
                       micro_batch=4, lr=args.lr, vision_lr_scale=args.vision_lr_scale,
                       mixture={"text": 1.0, "image": float(args.image_rows), "video": float(args.video_rows)},
                       warmup_steps=max(1, args.steps // 12),  # the decay starts after it, even at --steps 1
                       decay_start=max(max(1, args.steps // 12), int(args.steps * 0.75)),
                       msa_switch_step=max(1, args.steps // 6), kl_weight=1.0, aux_loss_weight=0.01,
                       seed=args.seed, out_dir=str(args.out), ckpt_every=0, eval_every=0,
                       progress=not args.no_progress, tensorboard=True, device="cpu")


def check_demo_extras() -> None:
    import importlib.util

    from .train.data import check_data_extra

    check_data_extra()
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("openm3 demo draws its figures with matplotlib: pip install 'openm3[demo]'")


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)  # ValueError naming --threads below 1, before any work
    check_demo_extras()
    from .data import get_tokenizer
    from .train.checkpoint import write_text_atomic
    from .train.data import MixtureRows
    from .train.eval import BASELINE_SAMPLES, Evaluator
    from .train.factory import model_builder
    from .train.trainer import Trainer

    out = Path(args.out)
    cfg = demo_config(args)  # bad settings fail here, before the last report's files are deleted
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file there, or on the way there
        raise ValueError(f"--out: cannot make the report folder {str(out)!r} ({err.strerror or err})") from None
    # a fresh run, not a resume: the last run's files go (its metrics.json first), so that a run that stops early
    # never leaves the folder showing the last run's report as its own
    for stale in (*REPORT_FILES, "metrics.jsonl", "checkpoints", "model", "tensorboard"):
        path = out / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    t_start = time.perf_counter()
    tokenizer = get_tokenizer()
    source = MixtureRows(tokenizer, cfg.seq_len, seed=cfg.seed, weights=DEMO_WEIGHTS, image_size=84,
                         video_size=56, frames_per_clip=cfg.video_frames_per_clip)
    evaluator = Evaluator(tokenizer, seq_len=cfg.seq_len, windows=2,
                          qa={"colour_qa": args.image_qa, "video_qa": args.video_qa}, image_size=84, video_size=56,
                          baseline_samples=BASELINE_SAMPLES, frames_per_clip=cfg.video_frames_per_clip)
    t_setup = time.perf_counter() - t_start
    threads = torch.get_num_threads()
    print(f"openm3 demo: training m3-tiny (native multimodal, MSA) for {cfg.steps} steps on CPU "
          f"({threads} thread{'s' if threads > 1 else ''}); report -> {out}", flush=True)
    trainer = Trainer(cfg, model_builder("m3-tiny", tokenizer), source)
    t0 = time.perf_counter()
    history = trainer.fit()
    t_train = time.perf_counter() - t0
    model = trainer.model.eval()

    t0 = time.perf_counter()
    results = evaluator.evaluate(model)
    t_eval = time.perf_counter() - t0
    t0 = time.perf_counter()
    report_figures(model, tokenizer, evaluator, history, out)
    samples = write_samples(model, tokenizer, evaluator, out)
    trainer.export(out / "model", tokenizer)
    t_report = time.perf_counter() - t0

    n_params = sum(p.numel() for p in model.parameters())
    tail = history[-max(1, len(history) // 10):]
    metrics = {
        "model": "m3-tiny", "parameters": n_params, "recipe": cfg.recipe, "steps": cfg.steps,
        "tokens_trained": sum(r["tokens"] for r in history),
        "text_tokens_trained": cfg.plan().text_token_budget(cfg.seq_len),
        "loss_first": history[0]["loss"], "loss_last_10pct": sum(r["loss"] for r in tail) / len(tail),
        "msa_switch_step": cfg.msa_switch_step,
        "image_qa_accuracy": results["colour_qa/accuracy"],
        "image_qa_text_only_accuracy": results["colour_qa/text_only_baseline"],
        "image_qa_chance": 1 / 7,
        "video_qa_accuracy": results["video_qa/accuracy"],
        "video_qa_text_only_accuracy": results["video_qa/text_only_baseline"],
        "indexer_recall": results.get("indexer_recall"),
        "eval": results,
        "samples": samples,
        "seconds": {"setup": t_setup, "train": t_train, "eval": t_eval, "report": t_report,
                    "total": time.perf_counter() - t_start},
        "config": cfg.to_dict(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1))  # never half-written
    trainer.close()
    beats = metrics["image_qa_accuracy"] > metrics["image_qa_text_only_accuracy"]
    print(f"image QA accuracy {metrics['image_qa_accuracy']:.2f} vs text-only "
          f"{metrics['image_qa_text_only_accuracy']:.2f} ({'beats' if beats else 'does NOT beat'} the text-only "
          f"model); video QA {metrics['video_qa_accuracy']:.2f} vs text-only "
          f"{metrics['video_qa_text_only_accuracy']:.2f}"
          f"; indexer recall {metrics['indexer_recall']:.2f}; {metrics['seconds']['total']:.0f} s in total")
    print(f"report written to {out.resolve()}")
    return 0


def _token_labels(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]).replace("\n", "\\n")[:14] for i in ids]


@torch.no_grad()
def report_figures(model, tokenizer, evaluator, history: list[dict], out: Path) -> None:
    from .analysis import plots
    from .analysis.attention import capture_attention, dense_probs, indexer_recall, sparse_probs
    from .train.eval import heldout_windows, model_logits

    plots.loss_curve(history, out / "loss_curve.png", title="openm3 demo: m3-tiny, native multimodal")

    # text-to-image attention on the first image question, with the model's own answer appended
    qa = evaluator.qa["colour_qa"][0]
    answer = greedy(model, tokenizer, qa.prompt, qa.vision, max_new_tokens=4)
    ids = qa.prompt + answer
    with capture_attention(model) as layers:
        out_ = model_logits(model, [torch.tensor(ids)], qa.vision, return_block_idx=True)[0]
    maps = []
    for rec, block_idx in zip(layers, out_.block_idx):
        if rec.is_sparse:
            block_size = next(m.block_size for m in model.modules() if getattr(m, "is_sparse", False))
            maps.append(sparse_probs(rec.q, rec.k, block_idx, block_size).mean(0))
        else:
            maps.append(dense_probs(rec.q, rec.k).mean(0))
    attn = torch.stack(maps).mean(0)  # [T, T]
    ids_t = torch.tensor(ids)
    image_pos = (ids_t == tokenizer.image_id).nonzero()[:, 0]
    text_pos = torch.arange(int(image_pos[-1]) + 1, len(ids))
    text_pos = text_pos[(ids_t[text_pos] != tokenizer.vision_end_id)]
    grid = qa.vision["image_grid_thw"][0].tolist()
    sub = attn[text_pos][:, image_pos].numpy()
    focus = int((text_pos == len(qa.prompt) - 1).nonzero()[0, 0])  # the position that predicts the answer
    plots.text_to_image_attention(qa.sample.images[0], sub, (grid[1] // 2, grid[2] // 2),
                                  _token_labels(tokenizer, ids_t[text_pos].tolist()), out / "attention_map.png",
                                  focus_row=focus, focus_note=" (predicts the answer)",
                                  title=f"{qa.sample.question} -> model: {tokenizer.decode(answer)!r}")

    # the blocks the indexer chose on a long held-out text (4x the training rows)
    window = heldout_windows(tokenizer, ["stdlib"], 1, 4 * len(evaluator.windows[0].ids))[0]
    with capture_attention(model) as layers:
        out_ = model_logits(model, [window.ids], None, return_block_idx=True)[0]
    last = [i for i, b in enumerate(out_.block_idx) if b is not None][-1]
    block_size = next(m.block_size for m in model.modules() if getattr(m, "is_sparse", False))
    rec = layers[last]
    recall_sum, n = indexer_recall(rec.q, rec.k, out_.block_idx[last], rec.cu_seqlens, block_size)
    title = (f"blocks chosen by the indexer: layer {last}, index head 0\n{len(window.ids)} held-out "
             f"{window.corpus} tokens (4x the training rows), indexer recall here {recall_sum / n:.2f}")
    plots.indexer_blocks(out_.block_idx[last][0].numpy(), block_size, out / "indexer_blocks.png", title=title)


@torch.no_grad()
def greedy(model, tokenizer, prompt: list[int], vision: dict | None, max_new_tokens: int = 24) -> list[int]:
    """Greedy continuation of `prompt` (stops at end-of-turn); recomputes the whole sequence each token."""
    from .train.eval import model_logits

    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model_logits(model, [torch.tensor(ids)], vision)[0].logits
        nxt = int(logits[-1].argmax())
        new.append(nxt)
        if nxt == tokenizer.eos_id:
            break
        ids.append(nxt)
    return new


@torch.no_grad()
def write_samples(model, tokenizer, evaluator, out: Path) -> list[dict]:
    from .data.tokenizer import BOS
    from .train.checkpoint import write_text_atomic

    samples = []
    for task, n in (("colour_qa", 4), ("video_qa", 2)):
        for qa in evaluator.qa[task][:n]:
            answer = tokenizer.decode(greedy(model, tokenizer, qa.prompt, qa.vision, 6), skip_special_tokens=True)
            samples.append({"kind": task, "question": qa.sample.question, "expected": qa.sample.answer,
                            "model": answer.strip()})
    for text in ("def main(", "In the beginning God", "The try statement"):
        prompt = tokenizer.encode(BOS + text)
        cont = tokenizer.decode(greedy(model, tokenizer, prompt, None, 24), skip_special_tokens=True)
        samples.append({"kind": "text", "prompt": text, "model": cont})
    lines = ["# openm3 demo: sample generations (greedy)", ""]
    for s in samples:
        if s["kind"] == "text":
            lines += [f"- **text** `{s['prompt']}` -> `{s['model']!r}`"]
        else:
            lines += [f"- **{s['kind']}** {s['question']} -> model: `{s['model']}` (expected: `{s['expected']}`)"]
    write_text_atomic(out / "samples.md", "\n".join(lines) + "\n")  # never half-written, as metrics.json
    return samples


if __name__ == "__main__":
    raise SystemExit(main())
