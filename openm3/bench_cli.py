"""`openm3 bench`: the benchmarks of a source checkout (`benchmarks/`, one script per question) from the CLI.

    openm3 bench                   # each benchmark with the question it answers
    openm3 bench NAME [ARGS ...]   # runs `python -m benchmarks.NAME ARGS ...` in this process; `NAME --help`: its flags

The benchmarks are not part of the installed package (a wheel carries `openm3` only), so the command looks for
`benchmarks/` beside the package's directory (a clone installed with `pip install -e .`, as `scripts/setup.sh`
does), then in the working directory. Most of them time Triton kernels or CUDA graphs and need a GPU (the list says
where each runs: its `RUNS_ON`); each writes its figures as JSON under `--out` where it takes one (the checkout's
`benchmarks/results/` holds the recorded ones, and is where those that write by default write, whatever the working
directory).
"""

from __future__ import annotations

import argparse
import ast
import os
import runpy
import sys
import textwrap
from pathlib import Path

from .cli import NEGATIVE_NUMBER

USAGE = "usage: openm3 bench [NAME [ARGS ...]]   (no NAME: the list)"


def benchmarks_dir() -> Path:
    """The checkout's `benchmarks/` folder; FileNotFoundError (saying where it looked) when there is none."""
    package_root = Path(__file__).resolve().parents[1]
    tried = []
    for root in (package_root, Path.cwd()):
        folder = root / "benchmarks"
        if (folder / "__init__.py").is_file():
            return folder
        tried.append(str(folder))
    raise FileNotFoundError("openm3 bench runs the benchmarks of a source checkout and found none (looked in "
                            + ", ".join(dict.fromkeys(tried)) + "): clone the repository and run it from there")


def _runs_on(tree: ast.Module) -> str | None:
    """A benchmark's module-level `RUNS_ON = "..."` (where it runs: "GPU", "CPU", ...), None when it has none."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["RUNS_ON"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return None


def available(folder: Path) -> dict[str, tuple[str, str]]:
    """{name: (first sentence of its docstring, where it runs: its `RUNS_ON` or "?")} for each benchmark script
    (modules starting with '_' are helpers), read without importing them (an import may need CUDA or the
    benchmark's own dependencies)."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        paragraph = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split())
        end = paragraph.find(". ")
        out[path.stem] = (paragraph if end < 0 else paragraph[:end + 1], _runs_on(tree) or "?")
    return out


def _listing(found: dict[str, tuple[str, str]], width: int = 118) -> str:
    """The names and where each runs in columns, each question wrapped beside them."""
    pad = max(map(len, found), default=0) + 2
    pad_where = max((len(where) for _, where in found.values()), default=0) + 2
    lines = []
    for name, (question, where) in found.items():
        wrapped = textwrap.wrap(question, width - pad - pad_where) or [""]
        lines += [name.ljust(pad) + where.ljust(pad_where) + wrapped[0],
                  *(" " * (pad + pad_where) + rest for rest in wrapped[1:])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    try:
        folder = benchmarks_dir()
    except FileNotFoundError as err:
        print(f"openm3 bench: error: {err}", file=sys.stderr)
        return 2
    found = available(folder)
    if not argv:
        print(f"benchmarks in {folder}, where each runs and what it answers (openm3 bench NAME --help: its flags):\n")
        print(_listing(found))
        return 0
    name, rest = argv[0], argv[1:]
    name = name[:-3] if name.endswith(".py") else name
    if name not in found:
        raise ValueError(f"no benchmark named {argv[0]!r}; expected one of: {', '.join(found)}\n{USAGE}")
    root = str(folder.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    # and for the processes a benchmark starts (`python -m benchmarks.NAME` under torchrun) from another directory
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [saved_path])])
    saved, saved_parser = sys.argv, argparse.ArgumentParser.__init__
    sys.argv = [f"openm3 bench {name}", *rest]

    def named(self, *args, **kwargs):  # runpy's alter_sys sets argv[0] to the script's path: name the command
        if not args and kwargs.get("prog") is None:  # (a parser given its own prog keeps it)
            kwargs["prog"] = f"openm3 bench {name}"
        saved_parser(self, *args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # `--flag -1e-3` as a value, as every openm3 command's

    argparse.ArgumentParser.__init__ = named
    try:
        runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # argparse's --help and errors, or the benchmark's own exit status
        code = done.code
        if isinstance(code, int) or code is None:
            return code or 0
        print(code, file=sys.stderr)  # a message (`raise SystemExit("... needs a CUDA GPU")`): say it, as Python would
        return 1
    finally:
        sys.argv, argparse.ArgumentParser.__init__ = saved, saved_parser
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path
    return 0
