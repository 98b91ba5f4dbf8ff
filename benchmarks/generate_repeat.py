"""The same plain `generate` run again and again in one process, with the GPU's clocks, power and temperature,
the garbage collector's pauses and Dynamo's counters beside each run: why a process's first decodes run faster
than its later ones.

    python -m benchmarks.generate_repeat --preset m3-small --prompt 16384 --batch 8 --out DIR
    python -m benchmarks.generate_repeat --steps plain,plain,plain,plain,freeze,plain,copy,plain --out DIR
    python -m benchmarks.generate_repeat --preset m3-tiny --device cpu --prompt 256 --new 8 --batch 2   # smoke

`--steps` says what runs, in order (see its help): plain runs, plain runs of fewer sequences, speculative runs,
profiled runs, and between them garbage collection, `gc.freeze()`, `torch._dynamo.reset()`, a fresh copy of the
model, idle seconds, and a probe of the GPU alone (a 1 GiB copy and a matmul). Each run reports decode tokens/s
after its first step (`steady_decode_tokens_per_s`) and what `nvidia-smi` reads right after it, so a drop that
follows the clocks is the GPU's and one that does not is the process's.

Session 31 saw plain decoding at 200.1 tokens/s as a benchmark's first setting and 180-182 when run again after
the speculative settings. Session 32 (m3-small, 8 x 16K prompts, 128 new tokens; H100 and H200): the first three
runs of a process decode at 1455-1530 tokens/s, every later one at 1240-1340, with or without speculative runs in
between; SM clock (1980 MHz), temperature, throttle reasons, reserved memory and the GPU probe stay the same, a
45 s idle, `gc.collect()` + `torch.cuda.empty_cache()`, `torch._dynamo.reset()` and expandable segments do not
bring it back. Under cProfile the host functions' own times are unchanged and the wait for the step's tokens
(`tolist`) grows by ~0.7 ms per step: the GPU's part of the step grows.
"""

from __future__ import annotations

import copy
import cProfile
import gc
import io
import pstats
import subprocess
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result

DEFAULT_STEPS = "plain,plain,plain,spec,spec,spec,spec,plain,plain,plain,clean,plain,plain,reset,plain,plain,plain"
SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state() -> dict:
    """What nvidia-smi reads now ({} without it)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if not out:
        return {}
    return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in out[0].split(","))))


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--prompt", type=int, default=16384, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    p.add_argument("--steps", default=DEFAULT_STEPS, help="what runs, in order: plain (a plain run), bN (plain, "
                   "the first N prompts), spec (speculative, 4 drafts), prof (plain under cProfile), clean "
                   "(gc.collect() and torch.cuda.empty_cache()), reset (torch._dynamo.reset()), copy (a deep copy of the model replaces it), freeze (gc.collect(), gc.freeze()), probe (a copy and a matmul alone), sleepN (N seconds idle)")
    p.add_argument("--kernels", action="store_true", help="prof also lists the GPU kernels (torch.profiler; it "
                   "stays attached, so later runs are slower)")
    args = p.parse_args(argv)

    from openm3.engine.generate import generate
    from openm3.engine.speculative import SpeculativeConfig

    model, device = random_text_model(args.preset, args.device)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt,), generator=gen).tolist()
               for _ in range(args.batch)]
    res = {"preset": args.preset, "prompt": args.prompt, "batch": args.batch, "new": args.new, "runs": []}
    t0 = time.perf_counter()

    pauses: list = []  # (generation, seconds) of each garbage collection during a run

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            on_gc.t = time.perf_counter()
        elif hasattr(on_gc, "t"):
            pauses.append((info["generation"], time.perf_counter() - on_gc.t))

    gc.callbacks.append(on_gc)

    def one(phase: str, spec=None, profile: bool = False, batch: int | None = None) -> None:
        pauses.clear()
        prof = cProfile.Profile() if profile else None
        if prof is not None:
            prof.enable()
        kernels = None
        if profile and args.kernels and device.type == "cuda":
            kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            kernels.__enter__()
        _, stats = generate(model, prompts[:batch], max_new_tokens=args.new, speculative=spec)
        if kernels is not None:
            kernels.__exit__(None, None, None)
            table = kernels.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
            res.setdefault("kernels", {})[phase] = table
            print(f"--- GPU kernels of a {phase} run (prefill included) ---\n{table}", flush=True)
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            res.setdefault("profiles", {})[phase] = text.getvalue()
            print(f"--- profile of a {phase} run (cProfile slows it) ---\n{text.getvalue()}", flush=True)
        fig = dict(phase=phase, tokens_per_s=stats.steady_decode_tokens_per_s, decode_s=stats.decode_s,
                   graph_captures=stats.graph_captures, at_s=time.perf_counter() - t0, **gpu_state())
        fig["gc"] = {f"gen{g}": [sum(1 for q, _ in pauses if q == g), round(sum(t for q, t in pauses if q == g), 4)]
                     for g in range(3)}
        counters = torch._dynamo.utils.counters
        fig["dynamo"] = {k: dict(counters[k]) for k in ("stats", "frames", "recompiles") if counters.get(k)}
        if device.type == "cuda":
            fig["reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
        res["runs"].append(fig)
        smi = " ".join(f"{k.split('.')[-1]}={fig[k]}" for k in SMI_FIELDS.split(",") if k in fig)
        print(f"{phase:12s} {fig['tokens_per_s']:8.1f} tokens/s at {fig['at_s']:6.1f} s, "
              f"{fig['graph_captures']} captures {smi} gc (count, s) {fig['gc']} dynamo {fig['dynamo']}", flush=True)

    def probe() -> None:
        """The GPU alone: a 1 GiB device copy and a 4096^3 bf16 matmul, CUDA events, medians of 10."""
        if device.type != "cuda":
            return
        src = torch.empty(2**29, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)

        def timed(fn) -> float:
            times = []
            for _ in range(11):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times[1:])[5]

        fig = dict(phase="probe", copy_ms=timed(lambda: dst.copy_(src)), matmul_ms=timed(lambda: a @ a),
                   at_s=time.perf_counter() - t0)
        res["runs"].append(fig)
        print(f"probe        copy 1 GiB {fig['copy_ms']:.3f} ms, matmul {fig['matmul_ms']:.3f} ms", flush=True)

    for step in args.steps.split(","):
        if step == "clean":
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        elif step.startswith("sleep") and step[5:].isdigit():
            time.sleep(int(step[5:]))  # the GPU idles (cools) meanwhile
        elif step == "freeze":  # every object alive now leaves the collector's generations
            gc.collect()
            gc.freeze()
        elif step == "copy":  # the model's weights and modules anew (the old ones freed)
            model = copy.deepcopy(model)
            gc.collect()
        elif step == "probe":
            probe()
        elif step == "reset":
            torch._dynamo.reset()  # the compiled helpers' graphs and guards (the next run compiles again)
        elif step == "spec":
            one(step, spec=SpeculativeConfig(num_speculative_tokens=4))
        elif step == "prof":
            one(step, profile=True)
        elif step == "plain" or (step[:1] == "b" and step[1:].isdigit()):
            one(step, batch=int(step[1:]) if step != "plain" else None)
        else:
            raise SystemExit(f"error: --steps: unknown step {step!r} (plain, bN, spec, prof, clean, reset, copy, freeze, probe, sleepN)")
    if args.out:
        print(f"wrote {write_result(args.out, f'generate_repeat_b{args.batch}', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
