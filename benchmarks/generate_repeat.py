"""The same plain `generate` run again and again in one process, with the GPU's clocks, power and temperature,
the garbage collector's pauses and Dynamo's counters beside each run: why a process's first decodes run faster
than its later ones.

    python -m benchmarks.generate_repeat --preset m3-small --prompt 16384 --batch 8 --out DIR
    python -m benchmarks.generate_repeat --steps plain,plain,plain,plain,freeze,plain,copy,plain --out DIR
    python -m benchmarks.generate_repeat --preset m3-tiny --device cpu --prompt 256 --new 8 --batch 2   # smoke

`--steps` says what runs, in order (see its help): plain runs, plain runs of fewer sequences, speculative runs,
profiled runs, and between them garbage collection, `gc.freeze()`, `torch._dynamo.reset()`, a fresh copy of the
model, device memory held (so that later tensors land elsewhere), torch's cuBLAS workspaces freed, idle seconds,
a probe of the GPU alone (a 1 GiB copy and a matmul), short generate calls without CUDA graphs (a call and a
cache but no capture), one memory pool for every later capture, runs whose graphs stay alive and are timed again
later, a kept graph of 3000 tiny kernels timed between runs, and the layers under `torch.compile`. Each run
reports decode tokens/s after its first step
(`steady_decode_tokens_per_s`), the median GPU time of its CUDA-graph replays (events around each) and what
`nvidia-smi` reads right after it, so a drop that follows the clocks is the GPU's and one that does not is the
process's.

Session 31 saw plain decoding at 200.1 tokens/s as a benchmark's first setting and 180-182 when run again after
the speculative settings. Session 32 (m3-small, 8 x 16K prompts, 128 new tokens; H100 and H200,
`benchmarks/results/generate_repeat_*20261205T1*`): the first three `generate` calls of a process decode at
1455-1530 tokens/s and every later one at 1150-1340, whatever ran before (the same batch, other batch sizes,
speculative runs): the CUDA graph's replay itself takes 5.15 ms in the first three calls and 5.88 ms from the
fourth on (H100, CUDA events around each replay). Unchanged meanwhile: SM clock (1980 MHz), temperature, throttle
reasons, reserved memory, the GPU alone (copy, matmul), Dynamo's counters; and none of these brings it back: 45 s
idle, `gc.collect()` + `torch.cuda.empty_cache()`, `gc.freeze()` (no collection runs during a later run anyway),
`torch._dynamo.reset()`, expandable segments, a fresh deep copy of the model, 2 GiB held to move later tensors,
freeing torch's cuBLAS workspaces. Session 33 (H100): it is the process's fourth graph *capture*, not call (three
graph-less calls first do not count; any graph captured before counts, a one-node one too), it is process-wide
(graphs captured earlier and kept alive replay slow too once it flips), and the kernels inside take the same GPU
time: the idle time between the graph's nodes grows from ~0.09 to ~0.44 us each (`kprof`). Under `compile` the
step has fewer nodes: 5.14 -> 2.99 ms, 3.23 in the slow state. Cause not found.
"""

from __future__ import annotations

import copy
import cProfile
import gc
import importlib
import io
import pstats
import subprocess
import time

import torch

from benchmarks._inputs import engine_parser, random_text_model
from benchmarks._timing import write_result
from benchmarks.msa_decode import capture_graph, replay_time_ms

RUNS_ON = "GPU (CPU: smoke)"  # what `openm3 bench` lists beside it

DEFAULT_STEPS = "plain,plain,plain,spec,spec,spec,spec,plain,plain,plain,clean,plain,plain,reset,plain,plain,plain"
SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


PLAIN_STEPS = ("plain", "spec", "prof", "kprof", "clean", "reset", "copy", "freeze", "unhog", "cublas", "probe",
               "eager", "sharedpool", "keep", "retime", "gprof", "chain", "compile", "overlap", "fp8idx", "fusemoe")


def _known_step(step: str) -> bool:
    if step in PLAIN_STEPS:
        return True
    return any(step.startswith(p) and step[len(p):].isdigit() and int(step[len(p):]) > 0
               for p in ("b", "hog", "sleep"))


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


def kernel_gaps(events, tail: float = 0.5) -> dict:
    """kernel name -> [count, summed idle GPU time before it (us)] over the last `tail` of a run's GPU kernels
    (the decode steps; the prefill comes first): where a graph's replay waits between its nodes."""
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    gpu = gpu[int(len(gpu) * (1 - tail)):]
    out: dict = {}
    for prev, e in zip(gpu, gpu[1:]):
        row = out.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += max(0.0, e.time_range.start - prev.time_range.end)
    return out


def main(argv=None) -> int:
    p = engine_parser(__doc__)
    p.add_argument("--prompt", type=int, default=16384, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    p.add_argument("--steps", default=DEFAULT_STEPS, help="what runs, in order: plain (a plain run), bN (plain, "
                   "the first N prompts), spec (speculative, 4 drafts), prof (plain under cProfile), kprof (plain, "
                   "every GPU kernel's count and time kept), clean "
                   "(gc.collect() and torch.cuda.empty_cache()), reset (torch._dynamo.reset()), copy (a deep copy "
                   "of the model replaces it), freeze (gc.collect(), gc.freeze()), hogN (N GiB of device memory held "
                   "from then on), unhog, cublas (torch's cuBLAS workspaces freed), probe (a copy and a matmul "
                   "alone), sleepN (N seconds idle), eager (a generate call of 2 new tokens without CUDA graphs: "
                   "a call and a cache, no capture), sharedpool (every later capture draws on one memory pool), keep "
                   "(every later run's graphs stay alive), retime (each kept graph's replay timed again), gprof "
                   "(the newest kept graph's replays under torch.profiler: one decode step's kernels, count and GPU "
                   "time per step), chain (the "
                   "time per node of a 3000-node graph of tiny kernels), compile (the layers under torch.compile), "
                   "overlap (plain with generate(overlap=True): each step launched before the host reads the last), "
                   "fp8idx (plain with fp8 index keys in the cache: index_dtype='fp8'), fusemoe (from then on the "
                   "MoE layers' shared gate_up and router weights as one GEMM: openm3.layers.moe.fuse_moe_projections)")
    p.add_argument("--kernels", action="store_true", help="prof also lists the GPU kernels (torch.profiler; it "
                   "stays attached, so later runs are slower)")
    args = p.parse_args(argv)
    steps = args.steps.split(",")
    bad = [step for step in steps if not _known_step(step)]
    if bad:  # before the model is built
        p.error(f"--steps: unknown steps {bad} (known: {', '.join(PLAIN_STEPS)}, bN, hogN, sleepN)")

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
    replays: list = []  # (start, end) CUDA events around each CUDA-graph replay of a run
    if device.type == "cuda":
        plain_replay = torch.cuda.CUDAGraph.replay

        def timed_replay(graph):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            plain_replay(graph)
            end.record()
            replays.append((start, end))

        torch.cuda.CUDAGraph.replay = timed_replay

    def one(phase: str, spec=None, profile: bool = False, batch: int | None = None, eager: bool = False,
            gpu_kernels: bool = False, overlap: bool = False, index_dtype: str | None = None) -> None:
        pauses.clear()
        replays.clear()
        prof = cProfile.Profile() if profile else None
        if prof is not None:
            prof.enable()
        kernels = None
        if (gpu_kernels or profile and args.kernels) and device.type == "cuda":
            kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            kernels.__enter__()
        _, stats = generate(model, prompts[:batch], max_new_tokens=2 if eager else args.new, speculative=spec,
                            cuda_graphs=False if eager else None, overlap=overlap, index_dtype=index_dtype)
        if kernels is not None:
            kernels.__exit__(None, None, None)
            table = kernels.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
            res.setdefault("kernels", {})[phase] = table
            rows = res.setdefault("kernel_rows", [])  # every kernel's count and GPU time, to diff runs by name
            rows.append({"phase": phase, "run": len(res["runs"]), "kernels": {
                e.key: [e.count, getattr(e, "device_time_total", 0.0)] for e in kernels.key_averages()},
                "gaps_before": kernel_gaps(kernels.events())})
            print(f"--- GPU kernels of a {phase} run (prefill included) ---\n{table}", flush=True)
        if prof is not None:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            res.setdefault("profiles", {})[phase] = text.getvalue()
            print(f"--- profile of a {phase} run (cProfile slows it) ---\n{text.getvalue()}", flush=True)
        fig = dict(phase=phase, tokens_per_s=stats.steady_decode_tokens_per_s, decode_s=stats.decode_s,
                   graph_captures=stats.graph_captures, at_s=time.perf_counter() - t0, **gpu_state())
        if replays:
            torch.cuda.synchronize(device)
            fig["replay_ms_median"] = sorted(a.elapsed_time(b) for a, b in replays)[len(replays) // 2]
        fig["gc"] = {f"gen{g}": [sum(1 for q, _ in pauses if q == g), round(sum(t for q, t in pauses if q == g), 4)]
                     for g in range(3)}
        counters = torch._dynamo.utils.counters
        fig["dynamo"] = {k: dict(counters[k]) for k in ("stats", "frames", "recompiles") if counters.get(k)}
        if device.type == "cuda":
            fig["reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
            fig["live_graphs"] = sum(issubclass(type(o), torch.cuda.CUDAGraph) for o in gc.get_objects())
        res["runs"].append(fig)
        smi = " ".join(f"{k.split('.')[-1]}={fig[k]}" for k in SMI_FIELDS.split(",") if k in fig)
        replay = fig.get("replay_ms_median", float("nan"))
        print(f"{phase:12s} {fig['tokens_per_s']:8.1f} tokens/s at {fig['at_s']:6.1f} s, "
              f"{fig['graph_captures']} captures ({fig.get('live_graphs')} live), replay {replay:.3f} ms {smi} "
              f"gc (count, s) {fig['gc']} dynamo {fig['dynamo']}", flush=True)

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

    hogs: list = []
    holders: list = []  # graphs that keep a shared pool alive
    chain_graph = None
    for step in steps:
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
        elif step.startswith("hog") and step[3:].isdigit():  # N GiB held from now on: later tensors land elsewhere
            hogs.append(torch.empty(int(step[3:]) << 30, dtype=torch.uint8, device=device))
        elif step == "unhog":
            hogs.clear()
        elif step == "cublas":  # torch's cuBLAS workspaces (one per handle and stream, graph captures' too) freed
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
        elif step == "probe":
            probe()
        elif step == "reset":
            torch._dynamo.reset()  # the compiled helpers' graphs and guards (the next run compiles again)
        elif step == "spec":
            one(step, spec=SpeculativeConfig(num_speculative_tokens=4))
        elif step == "eager":
            one(step, eager=True)
        elif step == "sharedpool":  # from now on every capture draws on one memory pool (not one per DecodeGraphs)
            shared = torch.cuda.graph_pool_handle()
            holder = torch.cuda.CUDAGraph()  # keeps the pool alive when a run's graphs are freed (PyTorch frees a
            with torch.cuda.graph(holder, pool=shared):  # pool with its last graph; capturing into it then asserts)
                torch.zeros(1, device="cuda").add_(1)
            holders.append(holder)
            torch.cuda.graph_pool_handle = lambda: shared
        elif step == "prof":
            one(step, profile=True)
        elif step == "keep":  # from now on every run's decode graphs stay alive after it
            gen_module = importlib.import_module("openm3.engine.generate")
            made = gen_module.DecodeGraphs

            def keeping(*a, _made=made, **k):
                graphs = _made(*a, **k)
                holders.append(graphs)
                return graphs

            gen_module.DecodeGraphs = keeping
        elif step == "retime":  # every kept run's decode graphs replayed again now (needs keep before those runs)
            times = []
            for graphs in (h for h in holders if hasattr(h, "_batches")):
                for batch in graphs._batches.values():
                    if batch.graph is not None:
                        times.append(round(replay_time_ms(batch.graph, steps=1, reps=21, warm_ms=0.0), 3))
            res["runs"].append({"phase": step, "replay_ms_by_graph": times, "at_s": time.perf_counter() - t0})
            print(f"retime       replay ms of every kept graph, oldest first: {times}", flush=True)
        elif step == "gprof":  # one decode step's kernels: the newest kept graph replayed under torch.profiler
            graphs = [b.graph for h in holders if hasattr(h, "_batches") for b in h._batches.values()
                      if b.graph is not None]
            if not graphs:
                raise SystemExit("--steps: gprof needs a run with `keep` before it (no kept decode graph)")
            replays_n = 20
            graphs[-1].replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kprof:
                for _ in range(replays_n):
                    graphs[-1].replay()
                torch.cuda.synchronize()
            per_step = sorted(((e.key, e.count / replays_n, getattr(e, "device_time_total", 0.0) / replays_n)
                               for e in kprof.key_averages() if getattr(e, "device_time_total", 0.0) > 0),
                              key=lambda r: -r[2])
            res["runs"].append({"phase": step, "kernels_per_step": [list(r) for r in per_step],
                                "nodes_per_step": sum(r[1] for r in per_step),
                                "kernel_us_per_step": sum(r[2] for r in per_step), "at_s": time.perf_counter() - t0})
            print(f"gprof        one step: {sum(r[1] for r in per_step):.0f} kernels, "
                  f"{sum(r[2] for r in per_step):.1f} us of kernel time", flush=True)
            for name, count, us in per_step[:30]:
                print(f"  {count:6.1f} x {us / count:7.2f} us = {us:8.1f} us  {name[:90]}", flush=True)
        elif step == "chain":  # a graph of 3000 tiny kernels (captured at the first chain step, kept): per node
            if chain_graph is None:
                from benchmarks.graph_repeat import launch_chain
                chain_graph = capture_graph(launch_chain(), steps=20)
            us = replay_time_ms(chain_graph, steps=3000, reps=21, warm_ms=0.0) * 1e3
            res["runs"].append({"phase": step, "chain_us_per_node": us, "at_s": time.perf_counter() - t0})
            print(f"chain        {us:.3f} us per node of a kept 3000-node graph", flush=True)
        elif step == "compile":  # the decoder layers under torch.compile from now on (as `generate --compile`)
            from openm3.engine.generate import compile_layers
            compile_layers(model)
        elif step == "kprof":  # plain, with every GPU kernel's count and time (torch.profiler, no cProfile)
            one(step, gpu_kernels=True)
        elif step == "overlap":  # plain, each decode step launched before the host reads the last one's tokens
            one(step, overlap=True)
        elif step == "fp8idx":  # plain, the MSA layers' index keys cached in fp8 (e4m3 + an e8m0 scale per token)
            one(step, index_dtype="fp8")
        elif step == "fusemoe":  # from now on each MoE layer's shared gate_up and router weights as one GEMM
            from openm3.layers.moe import fuse_moe_projections
            print(f"fusemoe      {fuse_moe_projections(model)} MoE layers fused", flush=True)
        else:  # plain or bN
            one(step, batch=int(step[1:]) if step != "plain" else None)
    if args.out:
        print(f"wrote {write_result(args.out, f'generate_repeat_b{args.batch}', res)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
