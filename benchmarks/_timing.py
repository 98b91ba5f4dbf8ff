"""Timing helper shared by the benchmark scripts."""

from __future__ import annotations

import torch


def event_time_ms(fn) -> float:
    """Milliseconds of one call of `fn`, between CUDA events, with the device synchronised before and after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def profiled_times(prof) -> tuple[dict[str, tuple[float, int]], dict[str, tuple[float, int]]]:
    """From a finished `torch.profiler.profile`: (CUDA kernels, host operators) as name -> (total ms, count); host
    time is self CPU time (an operator's own, without its children). User annotations on the GPU timeline are left
    out (until session 10 the optimizer's, ~10 ms per 8K step, was counted beside its kernels)."""
    from collections import defaultdict

    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    host: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(evt, "is_user_annotation", False):  # a range over kernels (`Optimizer.step#AdamW.step`), no
                continue                                      # kernel of its own: it would count them twice
            kernels[evt.name][0] += evt.time_range.elapsed_us() / 1e3
            kernels[evt.name][1] += 1
        else:
            host[evt.name][0] += evt.self_cpu_time_total / 1e3
            host[evt.name][1] += 1
    return ({k: (v[0], v[1]) for k, v in kernels.items()}, {k: (v[0], v[1]) for k, v in host.items()})


def idle_gaps(prof, top: int = 12, min_us: float = 20.0) -> dict:
    """Where the GPU idled in a profiled region: the span from the first kernel's start to the last one's end, the
    kernel time inside it, and the `top` longest gaps of at least `min_us` between one kernel's end (the latest end
    so far) and the next start, each with the kernels on both sides and its offset into the span (a gap at a
    step's edges is the host preparing the step; one inside is a sync or a stretch of slow host code)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    if not spans:
        return {}
    first, end, before = spans[0][0], spans[0][1], spans[0][2]
    gaps, busy, cur_start = [], 0.0, first
    for start, stop, name in spans[1:]:
        if start > end:
            busy += end - cur_start
            if start - end >= min_us:
                gaps.append((start - end, end - first, before, name))
            cur_start = start
        if stop > end:
            end, before = stop, name
    busy += end - cur_start
    gaps.sort(reverse=True)
    return {"span_ms": round((end - first) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "gaps_ms_total": round(sum(g[0] for g in gaps) / 1e3, 3), "gaps_count": len(gaps),
            "largest": [{"ms": round(g / 1e3, 3), "at_ms": round(at / 1e3, 3), "after": a[:70], "before": b[:70]}
                        for g, at, a, b in gaps[:top]]}


def top_host_ops(host: dict[str, tuple[float, int]], top: int = 25) -> list[dict]:
    """The `top` host operators by self CPU time, as JSON-ready rows."""
    ranked = sorted(host.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": name[:120], "ms": round(ms, 2), "calls": calls} for name, (ms, calls) in ranked]


def environment() -> dict:
    """Where a result was measured: UTC date, torch / Triton / CUDA versions, the GPU and its driver."""
    import datetime
    import subprocess

    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def write_result(out_dir, stem: str, result: dict) -> str:
    """Writes `result`, with its `environment()` under "env" unless it has one, as
    `<out_dir>/<stem>_<UTC time>.json` (`..._2.json`, `_3`, ... when a file of that minute exists: two runs in one
    minute keep both); returns the path."""
    import datetime
    import json
    from pathlib import Path

    result = {**result, "env": result.get("env") or environment()}
    base = Path(out_dir) / f"{stem}_{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M}"
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base.with_name(base.name + ".json"), 1
    while True:
        try:
            with open(path, "x") as f:  # exclusive: another run of the same minute never overwrites this one
                f.write(json.dumps(result, indent=1))
            return str(path)
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}_{n}.json")
