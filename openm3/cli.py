"""`openm3 <command>`: the command-line entry point.

Each subcommand is one function decorated with `@command(name, help, *arguments)`, where every argument is
`arg("--flag", ...)` with `argparse.add_argument`'s parameters. Heavy imports happen inside the functions, so
`openm3 --help` stays fast and a command's optional dependencies are needed only when it runs.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Callable

# A flag's value that is a negative number: argparse's own matcher (before Python 3.13) takes -1 and -.5 but not
# -1e-3, which it reads as an unknown option ("--lr -1e-3": "expected one argument").
NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser taking a negative number in scientific notation as a flag's value (`--lr -1e-3`, not only
    `--lr=-1e-3`). Every openm3 command's parser is one (`openm3 bench` gives the benchmarks' parsers the same
    matcher); a subparser is of its parser's class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # (argparse's attribute, read where it tells values apart)


_COMMANDS: dict[str, tuple[str, tuple[tuple[tuple, dict], ...], Callable[[argparse.Namespace], int | None]]] = {}


def arg(*flags, **kwargs) -> tuple[tuple, dict]:
    """One `add_argument(*flags, **kwargs)` call for `@command`."""
    return flags, kwargs


def command(name: str, help: str, *arguments: tuple[tuple, dict]):
    """Register `fn(args) -> exit code | None` as the subcommand `name`."""
    def register(fn):
        if name in _COMMANDS:
            raise ValueError(f"command {name!r} is registered twice")
        _COMMANDS[name] = (help, arguments, fn)
        return fn
    return register


@command(
    "smoke", "build a random M3 model, run one forward pass over a prompt, print the next-token top-k",
    arg("--prompt", default="def fibonacci(n):\n    return", help="text to run (byte-level token ids, or the "
        "--checkpoint's tokenizer.json when it has one)"),
    arg("--preset", "--config", dest="config", default="m3-tiny", help="model preset (m3-tiny, m3-small, m3)"),
    arg("--checkpoint", default=None, help="load this checkpoint directory instead of a random --preset model"),
    arg("--layers", type=int, default=None, metavar="N", help="the preset at N decoder layers (its pattern kept)"),
    arg("--seed", type=int, default=0, help="random init seed (default: %(default)s)"),
    arg("--device", default="cpu", help="torch device (default: %(default)s)"),
    arg("--topk", type=int, default=5, help="number of next-token predictions to print (default: %(default)s)"),
    arg("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's, one per core; "
        "on a shared or busy machine fewer can be much faster)"),
)
def smoke(args: argparse.Namespace) -> int:
    import torch

    from .engine.generate import check_device, preset_depth
    from .threads import set_threads
    from .models import M3TextConfig, M3TextModel, load_text_model

    if args.topk < 1:
        raise ValueError(f"--topk must be >= 1, got {args.topk}")
    check_device(args.device)  # ValueError naming --device for one this machine lacks
    set_threads(args.threads)
    depth = preset_depth(args)  # ValueError for --layers with --checkpoint
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    tokenizer = None
    if args.checkpoint:
        model = load_text_model(args.checkpoint, device=args.device)
        source = f"checkpoint {args.checkpoint}" + (" (its text decoder)" if _has_vision(args.checkpoint) else "")
        tokenizer = _checkpoint_tokenizer(args.checkpoint)
    else:
        with torch.device(args.device):
            model = M3TextModel(M3TextConfig.from_name(args.config, **depth)).eval()
        source = f"{args.config}, random init, seed {args.seed}"
    built = time.perf_counter() - start
    config = model.config
    if args.topk > config.vocab_size:
        raise ValueError(f"--topk must be at most the model's vocab_size={config.vocab_size}, got {args.topk}")
    if tokenizer is None and config.vocab_size < 256:
        raise ValueError(f"vocab_size {config.vocab_size} < 256 cannot hold byte ids")
    # a random model's ids are byte values (0-255); a checkpoint's are its tokenizer's when it has one
    ids = tokenizer.encode(args.prompt).ids if tokenizer is not None else list(args.prompt.encode("utf-8"))
    ids = torch.tensor(ids, dtype=torch.long, device=args.device)
    if ids.numel() == 0:
        raise ValueError("--prompt must not be empty")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, logits_index=torch.tensor([ids.numel() - 1], device=args.device), return_block_idx=True)
    elapsed = time.perf_counter() - start
    probs = torch.softmax(out.logits[0].float(), dim=-1)
    top = torch.topk(probs, args.topk)

    kinds = ", ".join(f"{config.layer_types.count(t)} {t}" for t in dict.fromkeys(config.layer_types))
    mlps = ", ".join(f"{config.mlp_layer_types.count(t)} {t}" for t in dict.fromkeys(config.mlp_layer_types))
    print(f"openm3 smoke: {source}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{config.num_hidden_layers} layers ({kinds}; MLP: {mlps}), ready in {built:.2f}s on {args.device}")
    kind = "byte-level token ids" if tokenizer is None else "token ids of its tokenizer.json"
    print(f"prompt: {args.prompt!r} -> {ids.numel()} {kind}; forward {elapsed * 1000:.1f} ms")
    print(f"next-token top-{args.topk}:")
    for rank, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        if tokenizer is not None:
            label = repr(tokenizer.decode([i], skip_special_tokens=False))
        else:
            label = repr(bytes([i]))[1:] if i < 256 else f"<id {i}>"
        print(f"  {rank}. id {i:5d} {label:10s} p={p:.4f}")
    return 0


def _has_vision(checkpoint: str) -> bool:
    from .models.checkpoint import config_json

    return config_json(checkpoint).get("vision_config") is not None


def _checkpoint_tokenizer(checkpoint: str):
    """The checkpoint's tokenizer.json (found as `generate` finds it) as a `tokenizers.Tokenizer`, or None (none
    there, or the `data` extra's tokenizers package missing: byte-level ids then)."""
    from .engine.generate import tokenizer_path

    path = tokenizer_path(None, checkpoint)
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


@command(
    "convert", "rewrite a checkpoint (transformers' or the published layout) in the published layout",
    arg("source", help="checkpoint directory to read"),
    arg("target", help="directory to write"),
    arg("--dtype", choices=("bf16", "fp16", "fp32", "bfloat16", "float16", "float32"), default=None,
        metavar="bf16|fp16|fp32", help="parameter dtype to write (also bfloat16, float16, float32; default: the "
        "source's)"),
    arg("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB or 500MB"),
    arg("--overwrite", action="store_true", help="write into a target directory that holds files already"),
)
def convert(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from .engine.generate import DTYPES
    from .models import load_pretrained
    from .models.checkpoint import parse_size, hidden_sibling, replace_directory

    source, target = Path(args.source), Path(args.target)
    # the target's folder and its hidden work folder beside it would be written into the source being read
    if target.resolve() == source.resolve():
        raise ValueError(f"target: {target} is the source directory {source} itself; write the conversion "
                         "elsewhere")
    if source.resolve() in target.resolve().parents:
        raise ValueError(f"target: {target} is inside the source directory {source}; write the conversion "
                         "elsewhere")
    if target.exists() and not target.is_dir():
        raise ValueError(f"target: {target} is a file, not a directory; name a directory to write")
    try:  # checked before the model loads
        parse_size(args.max_shard_size)
    except ValueError:
        raise ValueError(f"--max-shard-size: expected a positive size such as 5GB or 500MB, got "
                         f"{args.max_shard_size!r}") from None
    if target.is_dir() and any(target.iterdir()) and not args.overwrite:
        raise ValueError(f"target: {target} holds files already; pass --overwrite to write into it")
    dtype = DTYPES[args.dtype] if args.dtype else None
    model = load_pretrained(source, dtype=dtype)
    # the weights and the files they are used with (tokenizer, chat template, generation and processor configs)
    # written beside the target, then put in place at once: a crash never leaves weights without their tokenizer
    work = hidden_sibling(target, "partial")
    try:
        model.save_pretrained(work, max_shard_size=args.max_shard_size)
        side = [f for f in sorted(source.iterdir()) if f.is_file() and _travels_with_weights(f.name)]
        for f in side:
            shutil.copyfile(f, work / f.name)
        replace_directory(work, target, keep_other_files=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    print(f"openm3 convert: {source} -> {target} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{next(model.parameters()).dtype}; copied {', '.join(f.name for f in side) or 'no other files'})")
    return 0


def _travels_with_weights(name: str) -> bool:
    """Whether a checkpoint directory's file `name` is copied as it is by `convert`: everything but the weights,
    their index and config.json, which the conversion writes."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
    return not (name == "config.json" or name.endswith(weights) or name.endswith(".index.json")
                or name.startswith("."))


# Commands whose module parses its own arguments: `openm3 NAME ...` calls `module.function(argv)`; the third entry,
# where there is one, builds the command's parser, whose flags its error messages are told in (`flag_named`).
_DELEGATED: dict[str, tuple[str, str, str | None]] = {
    "data": ("openm3.data.cli:main", "offline data: preview samples, build the tokenizer", None),
    "generate": ("openm3.engine.generate:main", "generate text with a model from a checkpoint or a preset",
                 "openm3.engine.generate:build_parser"),
    "train": ("openm3.train.cli:main", "train a model with a recipe (single process or torchrun)",
              "openm3.train.cli:build_parser"),
    "eval": ("openm3.eval_cli:main", "evaluate a checkpoint: held-out bits per byte, image / video QA, indexer recall",
             "openm3.eval_cli:build_parser"),
    "demo": ("openm3.demo:main", "train m3-tiny natively multimodal on CPU, evaluate it, write a report",
             "openm3.demo:build_parser"),
    "serve": ("openm3.serve.cli:main", "serve a model behind the OpenAI / Anthropic HTTP APIs",
              "openm3.serve.cli:build_parser"),
    "bench": ("openm3.bench_cli:main", "list the benchmarks of a source checkout, or run one (most need a GPU)", None),
}


def _load(target: str) -> Callable:
    import importlib

    module_name, fn_name = target.split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def _run_delegated(name: str, argv: list[str]) -> int:
    target, _, parser = _DELEGATED[name]

    def failed(message: str) -> int:
        if parser is not None:
            message = flag_named(message, _load(parser)(), argv)
        print(f"openm3 {name}: error: {message}", file=sys.stderr)
        return 2

    try:
        return _load(target)(argv) or 0
    except ValueError as err:
        return failed(str(err))
    except KeyboardInterrupt:
        return _interrupted(name)
    except OSError as err:
        return _file_error(name, err)
    except SystemExit as exit_:  # a command's own "error: ..." exit (generate's): the status the others give
        if isinstance(exit_.code, str) and exit_.code.startswith("error: "):
            return failed(exit_.code.removeprefix("error: "))
        raise


def flag_named(message: str, parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """An error `message` of a library check that a command passed its flags' values to, with the library's
    argument names told as the command's flags: `top_p must be in (0, 1]` -> `--top-p must be in (0, 1]`, `lr and
    vision_lr_scale must be > 0` -> `--lr and --vision-lr-scale must be > 0`. An argument is a value flag's
    destination; one holding '_' is told anywhere (`with max_new_tokens=4`), a plain word (`lr`, `seed`) or the
    spelling with spaces (`presence penalty`) only in the names the message opens with, the subject of the check,
    so prose using the same word is left alone. With a settings file given (`--config`), a setting may come from
    it: only the flags given in `argv` are told then. The library's own messages are unchanged."""
    flags = {}  # destination -> (its flag, the flag's spellings)
    for action in parser._actions:
        spelled = [s for s in action.option_strings if s.startswith("--")]
        if spelled and action.nargs != 0 and action.dest != argparse.SUPPRESS:
            flags.setdefault(action.dest, (spelled[0], set(action.option_strings)))
    if not flags:
        return message
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    told = {dest: flag for dest, (flag, spellings) in flags.items() if "--config" not in given or spellings & given}
    told.update({dest.replace("_", " "): flag for dest, flag in list(told.items()) if "_" in dest})
    known = sorted({*flags, *(dest.replace("_", " ") for dest in flags)}, key=len, reverse=True)

    def tell(pattern: str, text: str) -> str:
        return re.sub(pattern, lambda m: told.get(m.group(), m.group()), text)

    names = "|".join(map(re.escape, known))
    subject = rf"(?:{names}|[a-z]\w*_\w+)"  # or an argument no flag sets: train's `lr and vision_lr_scale`
    opening = re.match(rf"{subject}(?:(?:, | and ){subject})*(?= must\b| needs\b|:|=| \()", message)
    cut = opening.end() if opening else 0
    identifiers = "|".join(re.escape(name) for name in known if "_" in name)
    tail = tell(rf"(?<![\w./\\-])(?:{identifiers})(?![\w/\\-])", message[cut:]) if identifiers else message[cut:]
    return tell(rf"(?<![\w-])(?:{names})(?!\w)", message[:cut]) + tail


def _interrupted(name: str) -> int:
    """Ctrl-C: one line instead of the traceback of wherever it landed; 130 = 128 + SIGINT, as a shell reports it."""
    print(f"\nopenm3 {name}: interrupted", file=sys.stderr)
    return 130


def _file_error(name: str, err: OSError) -> int:
    """A file the command cannot read or write (an --out path under a file, a read-only folder, a full disk): one
    line naming the path, exit status 1. An OSError that names no file is re-raised with its traceback."""
    if err.filename is None:
        raise err
    print(f"openm3 {name}: error: {err}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = ArgumentParser(prog="openm3", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"openm3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, arguments, fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        for flags, kwargs in arguments:
            p.add_argument(*flags, **kwargs)
        p.set_defaults(_run=fn)
    for name, (_, help_text, _) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _DELEGATED:
        return _run_delegated(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except ValueError as err:
        print(f"openm3 {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(args.command)
    except OSError as err:
        return _file_error(args.command, err)


if __name__ == "__main__":
    sys.exit(main())
