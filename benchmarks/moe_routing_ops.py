"""Times the MoE routing bookkeeping, before and after session 13's changes, on one GPU.

    python -m benchmarks.moe_routing_ops --out benchmarks/results/

At the 8K MFU case's shape (65,536 tokens per micro-batch, m3-small: 16 experts, top-2):
  router_topk   one layer's expert choice: sigmoid scores + bias, then torch.topk (before) or `top_k_ids`'s
                argmax passes (after), both in one compiled function as inside a compiled layer
  expert_sort   one layer's stable sort of the (token, slot) expert ids in the grouped path and the per-expert
                offsets: int32 ids (before) or uint8 ids (after)
  balance       the load-balancing loss over all 15 MoE layers (`--layers`), forward + backward: per layer a
                softmax, torch.topk and an index_add count, eager (before), or `load_balancing_loss` (after: the
                layers' logits concatenated, one compiled `_balance_terms` call)
The training profile of session 12's call 1 had 3.9 ms of top-k, 1.75 ms of index_add and ~2 ms of int32 sorts
per step in these (15 MoE layers).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks._timing import event_time_ms, write_result

RUNS_ON = "GPU"  # what `openm3 bench` lists beside it


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(event_time_ms(fn) for _ in range(reps))


def cases(tokens: int, experts: int, top_k: int, layers: int):
    from openm3.layers import moe
    from openm3.ops.fused import fused_on_cuda

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    bias = 0.1 * torch.randn(experts, device="cuda", generator=gen)

    def choose_topk(x, b):
        return torch.topk(torch.sigmoid(x) + b, top_k, dim=-1, sorted=False).indices

    def choose_passes(x, b):
        return moe.top_k_ids(torch.sigmoid(x) + b, top_k)

    before_choose, after_choose = fused_on_cuda(choose_topk), fused_on_cuda(choose_passes)

    leaves = [torch.randn(tokens, experts, device="cuda", generator=gen).requires_grad_() for _ in range(layers)]

    def balance_before():
        counts = torch.zeros(experts, device="cuda")
        prob_sum = torch.zeros_like(counts)
        for leaf in leaves:
            probs = torch.softmax(leaf, dim=-1)
            chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
            counts = counts.index_add(0, chosen, torch.ones(chosen.numel(), device="cuda"))
            prob_sum = prob_sum + probs.sum(dim=0)
        (experts * torch.sum(counts * prob_sum) / (tokens * layers) ** 2).backward()

    def balance_after():
        moe.load_balancing_loss(leaves, experts, top_k).backward()

    ids = choose_topk(logits, bias).reshape(-1)

    def sort_ids(dtype):
        def run():
            s, _ = torch.sort(ids.to(dtype), stable=True)
            torch.searchsorted(s, torch.arange(experts, device="cuda", dtype=dtype), right=True, out_int32=True)
        return run

    return {
        "router_topk": (lambda: before_choose(logits, bias), lambda: after_choose(logits, bias)),
        "balance": (balance_before, balance_after),
        "expert_sort": (sort_ids(torch.int32), sort_ids(moe._id_dtype(experts))),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the JSON result")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=15, help="MoE layers (the balance case)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_routing_ops needs a CUDA GPU")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
              "experts": args.experts, "top_k": args.top_k, "layers": args.layers, "ms": {}}
    for name, (before, after) in cases(args.tokens, args.experts, args.top_k, args.layers).items():
        b, a = _median_ms(before, args.reps), _median_ms(after, args.reps)
        result["ms"][name] = {"before": b, "after": a}
        print(f"{name:12s} before {b * 1e3:8.1f} us  after {a * 1e3:8.1f} us  ({a / b:.2f}x)", flush=True)
    if args.out:
        print("wrote", write_result(args.out, "moe_routing_ops", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
