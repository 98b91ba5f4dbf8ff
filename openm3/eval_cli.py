"""`openm3 eval`: evaluate a checkpoint on held-out text, image / video QA and the MSA indexer, without code.

    openm3 eval --checkpoint DIR [--tokenizer DIR] [--device cpu|cuda] [--seq-len 512] [--windows 2]
                [--corpora stdlib topics ...] [--image-qa N] [--video-qa N] [--image-size 84] [--video-size 56]
                [--seed 10000] [--no-recall] [--out FILE.json] [--threads N]

It measures what `openm3 demo` and the trainer's periodic evaluation measure (`openm3.train.eval.Evaluator`):

- **bits per byte** per corpus: next-token cross-entropy over `--windows` held-out documents of `--seq-len` tokens,
  in bits per UTF-8 byte of the text (comparable across tokenizers; lower is better);
- **QA accuracy** (vision-language checkpoints): the share of rendered image (`colour_qa`) and video (`video_qa`)
  questions whose right answer the model scores most likely among the candidates, next to the accuracy of the best
  predictor that sees only the question (the text-only baseline: above it, the model reads the pixels);
- **indexer recall** (models with MSA layers): the share of dense attention mass inside the key blocks the indexer
  selects, averaged over the held-out windows, per MSA layer and over them.

The tokenizer is `--tokenizer`, else the checkpoint's tokenizer.json (`openm3 train --export` writes it), else the
bundled default. Errors in the arguments fail before any compute, naming the argument.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .threads import check_threads

TASKS = {"image_qa": "colour_qa", "video_qa": "video_qa"}  # option -> QA task of openm3.train.tasks


def build_parser() -> argparse.ArgumentParser:
    from .cli import ArgumentParser
    from .engine.generate import DTYPES

    p = ArgumentParser(prog="openm3 eval", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="checkpoint directory (config.json + "
                   "safetensors, e.g. what `openm3 train --export DIR` or `openm3 demo` writes)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory holding one (default: the "
                   "checkpoint's tokenizer.json, else the bundled tokenizer)")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), metavar="bf16|fp16|fp32",
                   help="parameter dtype (also bfloat16, float16, float32; default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N", help="tokens per held-out window (default: 512)")
    p.add_argument("--windows", type=int, default=2, metavar="N", help="held-out documents per corpus (default: 2)")
    p.add_argument("--corpora", nargs="+", metavar="NAME",
                   help="text corpora to score (default: all of stdlib topics bible_web bible_kjv)")
    p.add_argument("--image-qa", type=int, metavar="N",
                   help="image questions (default: 70 for a vision-language checkpoint, else 0)")
    p.add_argument("--video-qa", type=int, metavar="N",
                   help="video questions (default: 24 for a vision-language checkpoint, else 0)")
    p.add_argument("--image-size", type=int, default=84, metavar="N", help="QA image side in pixels (default: 84)")
    p.add_argument("--video-size", type=int, default=56, metavar="N", help="QA video frame side (default: 56)")
    p.add_argument("--seed", type=int, default=10_000, help="seed of the QA questions (default: 10000)")
    p.add_argument("--no-recall", action="store_true", help="skip the indexer recall")
    p.add_argument("--out", metavar="FILE.json", help="also write the results and settings to this JSON file")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the argument for a bad value that needs no checkpoint to tell."""
    from .data.corpora import CORPORA

    check_threads(args.threads)  # (set with the device: `device_and_dtype`)
    for name in ("seq_len", "windows", "image_size", "video_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    for name in TASKS:
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    unknown = [c for c in args.corpora or () if c not in CORPORA]
    if unknown:
        raise ValueError(f"--corpora: unknown corpus {', '.join(map(repr, unknown))}; expected some of "
                         f"{' '.join(CORPORA)}")
    if args.out is not None and os.path.isdir(args.out):
        raise ValueError(f"--out: {args.out!r} is a directory; give a JSON file name")
    if args.out is not None:  # found now, not after the evaluation has run
        folder = Path(args.out).resolve().parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(f"--out: cannot write {args.out!r}: {str(folder)!r} is a file, not a directory")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--out: cannot write {args.out!r}: {str(folder)!r} is not writable")


def read_checkpoint(path: str):
    """(VL config or None, text config) of checkpoint `path`, read without the weights; ValueError naming it."""
    from .models.checkpoint import CheckpointError, read_configs

    if not os.path.isdir(path):
        raise ValueError(f"--checkpoint: directory {path!r} does not exist")
    try:
        return read_configs(path)
    except CheckpointError as err:
        raise ValueError(f"--checkpoint: {err}") from None


def qa_counts(args: argparse.Namespace, vl, tokenizer) -> dict[str, int]:
    """Questions per QA task: the options, by default 70 image and 24 video questions for a VL checkpoint (as the
    demo) and none for a text-only one, which refuses QA."""
    default = {"image_qa": 70, "video_qa": 24} if vl else {"image_qa": 0, "video_qa": 0}
    counts = {o: default[o] if getattr(args, o) is None else getattr(args, o) for o in TASKS}
    asked = " / ".join(f"--{o.replace('_', '-')} {n}" for o, n in counts.items() if n > 0)
    if asked and vl is None:
        raise ValueError(f"{asked}: {args.checkpoint} is a text-only checkpoint (its config.json has no "
                         "vision_config); QA needs a vision-language one")
    if asked and (tokenizer.image_id, tokenizer.video_id) != (vl.image_token_index, vl.video_token_index):
        raise ValueError(f"--tokenizer: its image / video ids {tokenizer.image_id} / {tokenizer.video_id} differ "
                         f"from the checkpoint's {vl.image_token_index} / {vl.video_token_index}")
    return {TASKS[o]: n for o, n in counts.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    import torch

    from .data.corpora import CORPORA, MissingDataError
    from .data.tokenizer import M3Tokenizer, get_tokenizer
    from .engine.generate import device_and_dtype, tokenizer_path
    from .models import load_pretrained
    from .models.processor import video_frames_per_clip
    from .train.eval import BASELINE_SAMPLES, Evaluator

    vl, text_config = read_checkpoint(args.checkpoint)
    device, dtype = device_and_dtype(args)
    source = tokenizer_path(args.tokenizer, args.checkpoint)
    tokenizer = M3Tokenizer.from_file(source) if source else get_tokenizer()
    if tokenizer.vocab_size > text_config.vocab_size:
        raise ValueError(f"--tokenizer: {tokenizer.vocab_size} tokens, more than the checkpoint's vocab_size="
                         f"{text_config.vocab_size} (use the tokenizer the model was trained with)")
    if args.seq_len > text_config.max_position_embeddings:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings="
                         f"{text_config.max_position_embeddings}")
    qa = qa_counts(args, vl, tokenizer)

    t0 = time.perf_counter()
    corpora = list(args.corpora or CORPORA)
    try:
        evaluator = Evaluator(tokenizer, seq_len=args.seq_len, corpora=corpora, windows=args.windows,
                              qa={task: n for task, n in qa.items() if n > 0}, seed=args.seed,
                              image_size=args.image_size, video_size=args.video_size,
                              baseline_samples=BASELINE_SAMPLES, recall=not args.no_recall,
                              frames_per_clip=video_frames_per_clip(args.checkpoint))
    except MissingDataError as err:
        raise ValueError(f"--corpora: {err}") from None
    model = load_pretrained(args.checkpoint, dtype=dtype, device=device)
    t1 = time.perf_counter()
    results = evaluator.evaluate(model, device)
    seconds = {"setup": t1 - t0, "eval": time.perf_counter() - t1}
    n_params = sum(p.numel() for p in model.parameters())
    print(report(args, vl is not None, n_params, dtype, device, source, qa, results, seconds))
    if args.out is not None:
        from datetime import datetime, timezone

        write_json(args.out, {
            "checkpoint": str(Path(args.checkpoint).resolve()), "tokenizer": source or "bundled (get_tokenizer())",
            "vision_language": vl is not None, "parameters": n_params, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": {"seq_len": args.seq_len, "windows": args.windows, "corpora": corpora, "qa": qa,
                         "image_size": args.image_size, "video_size": args.video_size, "seed": args.seed,
                         "recall": not args.no_recall, "baseline_samples": BASELINE_SAMPLES},
            "seconds": seconds, "results": results})
        print(f"results written to {args.out}")
    return 0


def report(args, vision: bool, n_params: int, dtype, device, source, qa: dict, results: dict, seconds: dict) -> str:
    """The readable table: bits per byte per corpus, QA accuracy against the text-only baseline, indexer recall."""
    lines = [f"openm3 eval: {args.checkpoint} ({'vision-language' if vision else 'text-only'}, "
             f"{n_params / 1e6:.2f}M parameters, {str(dtype).removeprefix('torch.')} on {device}); "
             f"tokenizer: {source or 'bundled'}",
             f"held-out bits per byte (lower is better; {args.windows} document{'s' * (args.windows > 1)} per "
             f"corpus, first {args.seq_len} tokens of each):"]
    lines += [f"  {k.removeprefix('bpb/'):<12}{v:7.4f}" for k, v in results.items() if k.startswith("bpb/")]
    if any(qa.values()):
        lines.append("QA accuracy (text-only: the best accuracy from the question alone):")
        for task, n in qa.items():
            if not n:
                continue
            lines.append(f"  {task:<12}{results[f'{task}/accuracy']:7.3f}   text-only "
                         f"{results[f'{task}/text_only_baseline']:.3f}   ({n} question{'s' * (n > 1)})")
            lines += [f"    {k.split('/')[1]:<12}{v:5.3f}" for k, v in results.items()
                      if k.startswith(f"{task}/") and k.count("/") == 2]
    if "indexer_recall" in results:
        layers = [(k.removeprefix("indexer_recall/layer"), v) for k, v in results.items()
                  if k.startswith("indexer_recall/")]
        lines.append(f"indexer recall (dense attention mass inside the selected blocks): mean "
                     f"{results['indexer_recall']:.3f}; " + ", ".join(f"layer {i} {v:.3f}" for i, v in layers))
    elif not args.no_recall:
        lines.append("indexer recall: none (the model has no MSA layer)")
    lines.append(f"{seconds['setup']:.1f} s to prepare and load, {seconds['eval']:.1f} s to evaluate")
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    """Write `data` as JSON atomically (a crash leaves no half-written file)."""
    from .train.checkpoint import write_text_atomic

    Path(path).resolve().parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(path), json.dumps(data, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
