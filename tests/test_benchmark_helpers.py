"""The profiling and result-file helpers the GPU benchmarks share (`benchmarks/_timing.py`), on CPU."""

import json

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._timing import profiled_times, top_host_ops, write_result


def test_profiled_times_and_top_host_ops():
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a
        a.relu()
    kernels, host = profiled_times(prof)
    assert kernels == {}  # no CUDA activity on CPU
    assert host["aten::mm"][1] == 3 and host["aten::relu"][1] == 1
    rows = top_host_ops(host, top=2)
    assert len(rows) == 2 and rows[0]["ms"] >= rows[1]["ms"]
    assert set(rows[0]) == {"op", "ms", "calls"}


def test_write_result(tmp_path):
    path = write_result(tmp_path / "out", "bench", {"x": 1.5})
    assert path.endswith(".json") and "bench_" in path
    assert json.loads(open(path).read()) == {"x": 1.5}


def test_serve_batching_benchmark_runs_on_cpu(tmp_path, capsys):
    from benchmarks import serve_batching

    assert serve_batching.main(["--preset", "m3-tiny", "--device", "cpu", "--prompt-len", "32", "--new", "3",
                                "--batch", "1", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "max batch   1: 3 new tokens" in out and "max batch   2: 6 new tokens" in out
    (path,) = tmp_path.glob("serve_batching_*.json")
    rounds = json.loads(path.read_text())["rounds"]
    assert set(rounds) == {"1", "2"} and all(r["tokens_per_s"] > 0 for r in rounds.values())
