"""Times formulations of the MoE router's skinny GEMM (logits = x @ W.T, W [experts, hidden]) on one GPU.

    python -m benchmarks.moe_router --out benchmarks/results/

m3-small: x [16384, 2048] bf16 (two 8K rows per micro-batch), 16 experts. A training profile showed this GEMM as
cuBLAS `gemv2N` at ~170 GB/s (~0.37 ms forward, ~0.14 ms of its backward per layer call) where reading x takes
~15 us at HBM speed. Variants (each forward and forward + backward, dx and dW):
  linear     F.linear(x, W)                                  (what `Router` ran)
  pad<N>     F.linear(x, W padded with zero rows to N)[:, :E] (a wider output steers cuBLAS to a GEMM kernel)
  t_mm       x @ Wt with Wt = W.T stored [hidden, E] contiguous
  flip       (W @ x.T).T: the token dimension as the GEMM's wide output (a [E, N] result, returned transposed)
and the kernels cuBLAS ran for each (torch.profiler), at every --tokens count.
"""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch
import torch.nn.functional as F

from benchmarks._timing import event_time_ms, write_result

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it


def variants(experts: int, hidden: int):
    def linear(x, w):
        return F.linear(x, w)

    def padded(n):
        def fn(x, w):
            return F.linear(x, F.pad(w, (0, 0, 0, n - experts)))[:, :experts]
        return fn

    def t_mm(x, w):
        return x @ w.t().contiguous()

    def flip(x, w):
        return (w @ x.t()).t()

    from openm3.layers.moe import Router

    module = Router(hidden, experts, 2).cuda()

    def router_bf16(x, w):  # the whole Router forward (logits, sigmoid, top-k) with bf16 weights
        module.weight.data = w.detach()
        return module(x)[0]

    def router_autocast(x, w):  # as the trainer runs it: fp32 master weights, bf16 autocast
        module.weight.data = w.detach().float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return module(x)[0]

    out = {"linear": linear, "t_mm": t_mm, "flip": flip, "router_bf16": router_bf16,
           "router_autocast": router_autocast}
    for n in (32, 64, 128):
        if n > experts:
            out[f"pad{n}"] = padded(n)
    return out


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    return statistics.median(event_time_ms(fn) for _ in range(reps))


def kernels_of(fn) -> list[str]:
    """Names of the CUDA kernels one call of fn launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def run_shape(tokens: int, hidden: int, experts: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    g = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    floor_us = (x.numel() * 2) / 4.8e12 * 1e6
    print(f"x [{tokens}, {hidden}] bf16 @ W.T [{hidden}, {experts}]; reading x once at 4.8 TB/s: {floor_us:.1f} us")
    out = {}
    for name, fn in variants(experts, hidden).items():
        err = (fn(x, w).float() - ref).abs().max().item()

        def fwd_bwd():
            x.grad = w.grad = None
            fn(x, w).backward(g)

        with torch.no_grad():
            fwd = time_ms(lambda: fn(x, w))
            names = kernels_of(lambda: fn(x, w))
        fb = time_ms(fwd_bwd)
        out[name] = dict(fwd_ms=fwd, fwd_bwd_ms=fb, max_abs_err_vs_fp32=err, fwd_kernels=names)
        print(f"  {name:8s} fwd {fwd * 1e3:8.1f} us   fwd+bwd {fb * 1e3:8.1f} us   max |err| vs fp32 {err:.2e}   "
              f"{'; '.join(n[:40] for n in names)}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_router needs a CUDA GPU")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "hidden": args.hidden, "experts": args.experts, "tokens": {}}
    for tokens in args.tokens:
        res["tokens"][tokens] = run_shape(tokens, args.hidden, args.experts)
    if args.out:
        print(f"wrote {write_result(args.out, 'moe_router', res)}")


if __name__ == "__main__":
    main()
