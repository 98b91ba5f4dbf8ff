"""Times a MoE layer's routed experts at decode sizes on one GPU: the grouped GEMMs (`torch._grouped_mm`, a SwiGLU
kernel between them) against `openm3.ops.moe_experts` (one kernel per projection, the SwiGLU inside the first).

    python -m benchmarks.moe_decode --out benchmarks/results/

m3-small's shape (hidden 2048, 16 experts of 512, top-2; `--preset m3`: hidden 6144, 128 experts of 3072, top-4,
14.5 GB of bf16 weights per layer, so `--layers 1`), no gradients, each case a CUDA graph of `--layers` layers
with their own weights (so no layer finds another's weights in L2), timed per layer:
  experts   `Experts.forward` as the decode step runs it: sort_pairs, the two projections, the mix with routed
            scaling, shared expert output and residual added
  gemms     the two projections alone (for the chosen experts' weight bytes: TB/s); with `--splits`, the kernels
            also with each projection's input features over that many programs (`expert_linear(splits=)`)
  dense     (`--dense`) the shared expert's and the dense layers' MLP (`DenseMLP`: two cuBLAS GEMMs, the fused
            SwiGLU between) against the same MLP as one expert through `expert_linear`, at 1 and `--splits`
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._timing import write_result
from benchmarks.msa_decode import graph_time_ms

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it


def _graph_us(fn, layers: int, reps: int) -> float:
    """Median us per layer of `fn()` (which runs all layers), 10 calls captured in one CUDA graph."""
    return graph_time_ms(fn, steps=10, reps=reps) * 1e3 / layers


def cases(preset: str, tokens: int, layers: int, reps: int, splits: list[int]) -> dict:
    from openm3.layers import moe
    from openm3.layers.mlp import fused_swiglu_oai
    from openm3.models import M3TextConfig
    from openm3.ops.moe_experts import expert_linear
    from openm3.ops.moe_routing import sort_pairs

    c = M3TextConfig.from_name(preset)
    h, i, e, k = c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    with torch.device("cuda"):  # built on the GPU: M3's fp32 experts would take 29 GB of host memory a layer
        stack = [moe.Experts(e, h, i, c.swiglu_alpha, c.swiglu_limit).to(torch.bfloat16) for _ in range(layers)]
    for ex in stack:
        with torch.no_grad():
            for p in ex.parameters():
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5, generator=gen)
        ex.impl = "grouped"
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    rows, offs, _ = sort_pairs(ids, x, e)
    used = ids.unique().numel()
    weight_bytes = used * (2 * i * h + h * i) * 2  # the chosen experts' gate_up and down, bf16

    def experts_run():
        for ex in stack:
            ex(x, ids, weights, scale=2.0, add=x, residual=x)

    def gemms_grouped():
        for ex in stack:
            hh = fused_swiglu_oai(moe.grouped_linear(rows, ex.gate_up_proj, offs), ex.alpha, ex.limit)
            moe.grouped_linear(hh, ex.down_proj, offs)

    def gemms_kernel(n: int = 1):
        def run():
            for ex in stack:
                hh = expert_linear(rows, ex.gate_up_proj, offs, swiglu=(ex.alpha, ex.limit), splits=n)
                expert_linear(hh, ex.down_proj, offs, splits=n)
        return run

    out = {"tokens": tokens, "pairs": tokens * k, "experts_used": used, "weight_mb": weight_bytes / 1e6}

    def experts_us(max_pairs: int) -> float:  # the layer's own switch, set while its graph is captured
        saved = moe.expert_linear_max_pairs
        moe.expert_linear_max_pairs = lambda _num_experts: max_pairs
        try:
            return _graph_us(experts_run, layers, reps)
        finally:
            moe.expert_linear_max_pairs = saved

    with torch.no_grad():
        out["experts_grouped_us"] = experts_us(0)
        out["experts_kernel_us"] = experts_us(1 << 30)
        out["gemms_grouped_us"] = _graph_us(gemms_grouped, layers, reps)
        out["gemms_kernel_us"] = _graph_us(gemms_kernel(), layers, reps)
        for n in splits:
            out[f"gemms_kernel_splits{n}_us"] = _graph_us(gemms_kernel(n), layers, reps)
        out["experts_grouped_again_us"] = experts_us(0)
    for name in ("gemms_grouped", "gemms_kernel", *(f"gemms_kernel_splits{n}" for n in splits)):
        out[name + "_tb_per_s"] = weight_bytes / (out[name + "_us"] * 1e-6) / 1e12
    return out


def dense_cases(preset: str, tokens: int, layers: int, reps: int, splits: list[int]) -> dict:
    """`DenseMLP.forward` against the MLP as one expert (`expert_linear` with E = 1), both MLP sizes of `preset`."""
    from openm3.layers.mlp import DenseMLP
    from openm3.models import M3TextConfig
    from openm3.ops.moe_experts import expert_linear

    c = M3TextConfig.from_name(preset)
    h = c.hidden_size
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    out = {"tokens": tokens}
    for name, inter in (("shared", c.shared_intermediate_size), ("dense", c.dense_intermediate_size)):
        with torch.device("cuda"):
            stack = [DenseMLP(h, inter, c.swiglu_alpha, c.swiglu_limit).to(torch.bfloat16) for _ in range(layers)]
        weights = [(m.gate_up_proj.weight.unsqueeze(0), m.down_proj.weight.unsqueeze(0)) for m in stack]

        def torch_run():
            for m in stack:
                m(x)

        def kernel(n: int):
            def run():
                for (gu, dn), m in zip(weights, stack):
                    expert_linear(expert_linear(x, gu, offs, swiglu=(m.alpha, m.limit), splits=n), dn, offs, splits=n)
            return run

        mb = 3 * h * inter * 2 / 1e6
        with torch.no_grad():
            out[f"{name}_mb"] = mb
            out[f"{name}_torch_us"] = _graph_us(torch_run, layers, reps)
            for n in (1, *splits):
                out[f"{name}_kernel_splits{n}_us"] = _graph_us(kernel(n), layers, reps)
            out[f"{name}_torch_again_us"] = _graph_us(torch_run, layers, reps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the JSON result")
    p.add_argument("--preset", default="m3-small", help="the model shape (m3-small, m3)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    p.add_argument("--layers", type=int, default=4, help="layers with their own weights in each graph")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--splits", type=int, nargs="*", default=[2, 4], help="expert_linear splits to time beside 1")
    p.add_argument("--dense", action="store_true", help="time the shared expert's and dense layers' MLP instead")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_decode needs a CUDA GPU")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
              "layers": args.layers, "cases": []}
    for tokens in args.tokens if args.dense else ():
        r = dense_cases(args.preset, tokens, args.layers, args.reps, args.splits)
        result["cases"].append(r)
        print(f"tokens {tokens:4d}: " + "; ".join(
            f"{n} ({r[f'{n}_mb']:.0f} MB) torch {r[f'{n}_torch_us']:.1f} / {r[f'{n}_torch_again_us']:.1f} us, "
            f"kernel " + " / ".join(f"{r[f'{n}_kernel_splits{s}_us']:.1f}" for s in (1, *args.splits))
            + f" (splits 1 / {' / '.join(map(str, args.splits))})" for n in ("shared", "dense")), flush=True)
    for tokens in () if args.dense else args.tokens:
        r = cases(args.preset, tokens, args.layers, args.reps, args.splits)
        result["cases"].append(r)
        print(f"tokens {tokens:4d} pairs {r['pairs']:4d} experts {r['experts_used']:3d} ({r['weight_mb']:.0f} MB): "
              f"experts {r['experts_grouped_us']:.1f} / {r['experts_grouped_again_us']:.1f} -> "
              f"{r['experts_kernel_us']:.1f} us; gemms {r['gemms_grouped_us']:.1f} "
              f"({r['gemms_grouped_tb_per_s']:.2f} TB/s) -> {r['gemms_kernel_us']:.1f} us "
              f"({r['gemms_kernel_tb_per_s']:.2f} TB/s)"
              + "".join(f"; splits {n} {r[f'gemms_kernel_splits{n}_us']:.1f} us" for n in args.splits), flush=True)
    if args.out:
        print("wrote", write_result(args.out, "moe_decode_dense" if args.dense else "moe_decode", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
