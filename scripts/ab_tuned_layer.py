"""The MoE layer bench's DeepSeek-V3 rank (benchmarks/moe.py), or rank 0 of ``--ep`` of another model's layer
(``--model``, as ``scripts/bench_model_layer.py`` builds it), with tuned tables off and on, in one process: one
forward of each token count captured in a CUDA graph twice (tables off, then this GPU's tables as ``get_config``
reads them), the replays timed alternately (``bench_us``, median of rounds). What the shipped table gives a layer.

    python scripts/ab_tuned_layer.py [--tokens 64 256 512 1024 2048] [--path contiguous|masked|auto] [--rounds 3]
                                     [--model scripts/models/kimi-k2.json --ep 8 | --tp 8]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moe_fp8.benchmarks.harness import alternated_us
from moe_fp8.benchmarks.moe import build_layer, build_model_layer, capture_forward
from moe_fp8.kernels import tuning


def capture(layer, hidden: torch.Tensor, logits: torch.Tensor, path: str, table: str | None) -> torch.cuda.CUDAGraph:
    """``capture_forward`` under ``table`` (``$MOE_FP8_TUNED_CONFIGS``; None: the GPU's own tables)."""
    if table is None:
        os.environ.pop(tuning.ENV_TABLE, None)
    else:
        os.environ[tuning.ENV_TABLE] = table
    tuning.reset()
    return capture_forward(layer, hidden, logits, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512, 1024, 2048])
    p.add_argument("--path", choices=("contiguous", "masked", "auto"), default="contiguous",
                   help="auto: the path the layer picks for the token count")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", help="a model's config.json (default: the moe bench's DeepSeek-V3 rank)")
    p.add_argument("--ep", type=int, default=1, help="with --model: expert-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="with --model: ranks splitting every expert's intermediate size")
    args = p.parse_args()
    if args.model:
        with open(args.model) as f:
            layer, _ = build_model_layer(json.load(f), args.ep, tp=args.tp)
    else:
        layer, _ = build_layer()
    print(f"tables: {tuning.describe_active()}")
    print(f"{'tokens':>6} {'path':>10} {'off us':>9} {'on us':>9}  x")
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(t, layer.num_experts, device="cuda", dtype=torch.float32, generator=gen)
        path = layer.choose_path(t) if args.path == "auto" else args.path
        graphs = {"off": capture(layer, hidden, logits, path, "off"),
                  "on": capture(layer, hidden, logits, path, None)}
        off, on = alternated_us([graphs["off"].replay, graphs["on"].replay], args.rounds)
        print(f"{t:>6} {path:>10} {off:9.1f} {on:9.1f}  {off / on:.3f}", flush=True)


if __name__ == "__main__":
    main()
