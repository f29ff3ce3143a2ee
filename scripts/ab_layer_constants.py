"""A/B of the data path's tuning constants inside one MoE layer rank's CUDA-graph replay, in one process: for each
variant (``NAME=value,...`` of ``moe_fp8.kernels.triton.configs``; ``base``: as shipped) the forward is captured
once with those constants, then the variants' replays are timed in alternated rounds (``bench_us``, L2 flushed);
each variant's output (an eager call under the same constants) is checked bit-identical to the base's. The router
GEMM runs in the graph before routing, as in a model.
Layer replays of one build differ by 1-2% between processes (docs/kernels/datapath.md, session 58); alternating in
one process is what separates smaller changes.

    python3 scripts/ab_layer_constants.py --model scripts/models/deepseek-v3.json --tp 8 --tokens 1 8 \\
        --variants COMBINE_BLOCK_H=256 COMBINE_BLOCK_H=512 [--rounds 5]
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_fp8.benchmarks.harness import bench_us
from moe_fp8.benchmarks.moe import build_model_layer, capture_forward
from moe_fp8.kernels.triton import configs
from moe_fp8.layers import router_gemm


def parse_variant(text: str) -> dict[str, int | float]:
    """``A=1,B=2.5`` -> ``{"A": 1, "B": 2.5}``; every name must be a constant of ``configs``."""
    out: dict[str, int | float] = {}
    for item in text.split(","):
        name, value = item.split("=")
        if not hasattr(configs, name):
            raise SystemExit(f"configs has no constant {name}")
        out[name] = float(value) if "." in value else int(value)
    return out


def with_constants(values: dict[str, int | float], fn):
    """``fn()`` with ``configs``' constants set to ``values`` (and its cached config functions cleared both ways)."""
    def clear() -> None:
        for obj in vars(configs).values():
            if hasattr(obj, "cache_clear"):  # the lru_cache'd config functions
                obj.cache_clear()

    saved = {name: getattr(configs, name) for name in values}
    try:
        for name, value in values.items():
            setattr(configs, name, value)
        clear()
        return fn()
    finally:
        for name, value in saved.items():
            setattr(configs, name, value)
        clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model's config.json")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--variants", nargs="+", required=True, help="NAME=value[,NAME=value] of kernels/triton/configs")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with open(args.model) as f:
        layer = build_model_layer(json.load(f), args.ep, tp=args.tp)[0]
    variants = {"base": {}} | {text: parse_variant(text) for text in args.variants}
    print(f"# {torch.cuda.get_device_name()}; {args.model} ep {args.ep} tp {args.tp}; {args.rounds} rounds alternated, "
          "CUDA-graph replays (router GEMM in the graph), bench_us after do_bench's flush")
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        router = (torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)
                  / layer.hidden_size**0.5).bfloat16()  # (a checkpoint's dtype)
        logits = router_gemm(hidden, router)  # what the captured router GEMM computes, bit for bit
        path = layer.choose_path(t)
        graphs, outs = {}, {}
        for name, values in variants.items():
            # each variant's eager output (its kernels are the graph's) against the base's, then its graph
            outs[name] = with_constants(values, lambda h=hidden, lg=logits, pa=path: layer(h, lg, path=pa))
            if not torch.equal(outs[name].view(torch.int16), outs["base"].view(torch.int16)):
                print(f"  {name}: OUTPUT DIFFERS from base")
            graphs[name] = with_constants(values, lambda h=hidden, r=router, pa=path: capture_forward(
                layer, h, None, pa, router_weight=r))
        times: dict[str, list[float]] = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                times[name].append(bench_us(graph.replay))
        print(f"\n## {t} tokens, {path}")
        base = min(times["base"])
        for name, ts in times.items():
            print(f"  {name:40s} {min(ts):8.1f} us  x {base / min(ts):5.3f}  [{' '.join(f'{v:.1f}' for v in ts)}]")


if __name__ == "__main__":
    main()
