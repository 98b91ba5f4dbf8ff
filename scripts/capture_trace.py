"""Where a decode step's CUDA-graph capture fails: `DecodeGraphs` catches the error and decodes eagerly (with a
one-line warning); this runs a short generate through `BatchedGenerator` with the capture's traceback printed.

    python scripts/capture_trace.py --dtype fp32 [--preset m3-tiny]      (CUDA only)
"""

from __future__ import annotations

import argparse
import traceback

import torch

from openm3.engine import graphs
from openm3.engine.batching import BatchedGenerator
from openm3.models import M3TextConfig, M3TextModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--preset", default="m3-tiny")
    args = p.parse_args()
    capture = graphs.DecodeGraphs._capture

    def traced(self, *a, **k):
        try:
            return capture(self, *a, **k)
        except Exception:
            traceback.print_exc()
            raise

    graphs.DecodeGraphs._capture = traced
    torch.manual_seed(0)
    model = M3TextModel(M3TextConfig.from_name(args.preset)).to("cuda", DTYPES[args.dtype]).eval()
    prompt = torch.randint(0, model.config.vocab_size, (300,)).tolist()
    batcher = BatchedGenerator(model, token_budget=4096, max_batch=2)
    out: list[int] = []
    batcher(prompt, max_new_tokens=8, on_token=out.append)
    batcher.close()
    g = batcher.graphs
    print(f"{args.dtype}: {len(out)} tokens, graph replays {g.replays}, captures {g.captures}")


if __name__ == "__main__":
    main()
