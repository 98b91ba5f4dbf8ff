"""`openm3 bench`: the checkout's benchmarks listed with their questions, one run by name with its own flags, and
errors that name what was expected."""

import ast
import json
from pathlib import Path

from openm3 import bench_cli
from openm3.cli import main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_listing_names_every_benchmark_with_its_question(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert scripts and list(bench_cli.available(BENCHMARKS)) == scripts
    listed = [line.split()[0] for line in out.splitlines()[2:] if line and not line.startswith(" ")]
    assert listed == scripts
    where = {name: w for name, (_, w) in bench_cli.available(BENCHMARKS).items()}
    assert "?" not in where.values(), where  # every benchmark says where it runs (its RUNS_ON)
    assert where["msa_decode"] == "GPU" and where["ngram_acceptance"] == "CPU"
    assert any(line.split()[:2] == ["msa_decode", "GPU"] for line in out.splitlines())
    assert "vs dense attention" in " ".join(out.split())  # msa_decode's docstring, wrapped beside its name
    assert all(len(line) <= 118 for line in out.splitlines()[1:])


def test_unknown_benchmark_is_an_error_naming_the_choices(capsys):
    assert main(["bench", "msa_decod"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark named 'msa_decod'" in err and "msa_decode" in err


def test_runs_a_benchmark_with_its_flags(capsys, tmp_path):
    assert main(["bench", "ngram_acceptance", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--lookup-min" in out and out.startswith("usage: openm3 bench ngram_acceptance ")  # not the file's name
    assert main(["bench", "ngram_acceptance.py", "--bogus"]) == 2  # its own argparse error, passed on
    args = ["--docs", "1", "--max-tokens", "600", "--start", "100", "--corpora", "topics", "--drafts", "2",
            "--lookup-min", "2", "--out", str(tmp_path)]
    assert main(["bench", "ngram_acceptance", *args]) == 0
    written = list(tmp_path.glob("ngram_acceptance_continue_*.json"))
    assert len(written) == 1
    result = json.loads(written[0].read_text())
    assert result["corpora"]["topics"] and result["start"] == 100


def test_outside_a_checkout_it_says_where_it_looked(monkeypatch, tmp_path, capsys):
    fake = tmp_path / "site-packages" / "openm3" / "bench_cli.py"
    monkeypatch.setattr(bench_cli, "__file__", str(fake))
    monkeypatch.chdir(tmp_path)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and str(tmp_path / "site-packages" / "benchmarks") in err


def test_a_benchmarks_exit_message_is_printed(capsys, monkeypatch):
    """A benchmark that stops with a message (`raise SystemExit("... needs a CUDA GPU")`) says it through `openm3
    bench` too, as `python -m benchmarks.NAME` would."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("moe_decode", "prefill_profile", "moe_router"):
        assert main(["bench", name]) == 1
        assert capsys.readouterr().err.strip() == f"{name} needs a CUDA GPU"


def test_train_distributed_writes_under_the_checkouts_results_from_any_directory(tmp_path, monkeypatch):
    """Run from another directory, `train_distributed` wrote `benchmarks/results/` under it: its runs and result go
    to the checkout's `benchmarks/results/` (or `--out`), as the other benchmarks' that write by default."""
    import subprocess

    started = []

    def torchrun(cmd, **_):
        started.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped here")

    monkeypatch.setattr(subprocess, "run", torchrun)
    monkeypatch.chdir(tmp_path)
    for flags, out in (([], BENCHMARKS / "results"), (["--out", str(tmp_path / "mine")], tmp_path / "mine")):
        assert main(["bench", "train_distributed", *flags]) == 1  # (torchrun "failed")
        cmd = started.pop()
        assert Path(cmd[cmd.index("--worker") + 1]) == out / "train_distributed_runs" / "two"
    assert list(tmp_path.iterdir()) == []


def test_no_benchmark_writes_under_the_working_directory_by_default():
    """An `--out` default of "benchmarks/results" is relative to wherever the benchmark runs: each is None (print
    only) or the checkout's `benchmarks.RESULTS`."""
    import benchmarks

    assert benchmarks.RESULTS == BENCHMARKS / "results"
    defaults = {}
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and getattr(node.args[0], "value", None) == "--out"):
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
                defaults[path.stem] = "None" if default is None else ast.unparse(default)
    assert "train_distributed" in defaults and set(defaults.values()) == {"None", "RESULTS"}, defaults


def test_a_benchmarks_parser_takes_negative_numbers_in_scientific_notation(monkeypatch):
    """As every openm3 command's parser (tests/test_cli_errors.py): `--flag -1e-3` is a value, not an option."""
    import argparse
    import runpy

    parsed = []

    def benchmark(*_, **__):
        p = argparse.ArgumentParser()
        p.add_argument("--confidence", type=float)
        parsed.append(p.parse_args().confidence)

    monkeypatch.setattr(runpy, "run_module", benchmark)
    assert main(["bench", "structured_decode", "--confidence", "-1e-3"]) == 0 and parsed == [-1e-3]
