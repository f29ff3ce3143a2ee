"""When the routing kernel lets the dispatch after it launch (impls/routing.cuh: kEarlyDependents), in one process.

Each rank's decode forward is captured in a CUDA graph with the router GEMM before it (as in a model: routing then
starts when that GEMM ends) three times: routing built with its rule (early for V <= 8, at exit above), with
``MOE_FP8_ROUTING_EARLY_DEPENDENTS=1`` (early always) and ``=0`` (at exit always). Per variant: the replay's
``bench_us`` (L2 flushed by a memset), and after a clean flush (``flushed_events``: as after a model's previous
layer) the median and largest gap from routing's end to the dispatch's end, and the median kernel span. ``touched``:
the rank's local experts that the batch reaches (0: the rank still routes, dispatches and combines).

    python scripts/ab_routing_dependents.py [--ranks 'Kimi-K2 EP8' ...] [--tokens 1 2 4 16] [--rounds 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe_fp8.benchmarks.harness import alternated_us, flushed_events
from moe_fp8.benchmarks.moe import build_model_layer, capture_forward, local_ids
from moe_fp8.kernels import routing
from moe_fp8.kernels.jit import build
from moe_fp8.layers import router_gemm

MODELS = Path(__file__).resolve().parent / "models"
RANKS = [("Kimi-K2 EP8", "kimi-k2.json", 8, 1), ("DeepSeek-V3 EP8", "deepseek-v3.json", 8, 1),
         ("DeepSeek-V3 TP8", "deepseek-v3.json", 1, 8)]
VARIANTS = {"rule": None, "early": 1, "at exit": 0}


def routing_kernels(define: int | None):
    """``routing.get_kernel`` building its variants with the switch ``define`` (None: the header's rule)."""
    def get_kernel(*args):
        name, source = routing.kernel_variant(*args)
        if define is None:
            return build(name, source)
        return build(f"{name}_early{define}", f"#define MOE_FP8_ROUTING_EARLY_DEPENDENTS {define}\n{source}")
    return get_kernel


def touched(layer, hidden: torch.Tensor, router_w: torch.Tensor) -> int:
    """Local experts of the rank that the batch's routing reaches."""
    ids = layer.route(router_gemm(hidden, router_w))[1]
    return int((local_ids(layer, ids).unique() >= 0).sum())


def clean_gaps(graph: torch.cuda.CUDAGraph, reps: int = 9) -> str:
    """``gap median / largest, span median`` (µs) over ``reps`` replays after a clean flush."""
    runs = [flushed_events(graph.replay, clean=True) for _ in range(reps)]
    i = next(j for j, event in enumerate(runs[0]) if "dispatch" in event[0])
    gaps = sorted(r[i][2] - r[i - 1][2] for r in runs)
    spans = sorted(r[-1][2] - r[0][1] for r in runs)
    return f"{gaps[reps // 2]:.1f}/{gaps[-1]:.1f} {spans[reps // 2]:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16])
    p.add_argument("--ranks", nargs="+", default=[r[0] for r in RANKS], help="of: " + ", ".join(r[0] for r in RANKS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="of the router's weights and the hidden states")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    print("per variant: bench_us [clean flush: dispatch end - routing end, median/largest; span median] (us)")
    print(f"{'rank':>16} {'tokens':>6} {'touched':>7}  " + " | ".join(f"{v:>26}" for v in VARIANTS))
    original = routing.get_kernel
    for name, file, ep, tp in RANKS:
        if name not in args.ranks:
            continue
        layer, _ = build_model_layer(json.loads((MODELS / file).read_text()), ep, tp=tp)
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        router_w = (0.02 * torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)).bfloat16()
        for tokens in args.tokens:
            hidden = torch.randn(tokens, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            graphs = []
            for define in VARIANTS.values():
                routing.get_kernel = routing_kernels(define)
                graphs.append(capture_forward(layer, hidden, None, "masked", router_weight=router_w))
            routing.get_kernel = original
            cols = [clean_gaps(g) for g in graphs]
            us = alternated_us([g.replay for g in graphs], args.rounds)
            row = " | ".join(f"{u:6.1f} [{c:>17}]" for u, c in zip(us, cols, strict=True))
            print(f"{name:>16} {tokens:>6} {touched(layer, hidden, router_w):>7}  {row}", flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
