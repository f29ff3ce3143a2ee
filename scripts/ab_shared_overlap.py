"""Shared experts beside the routed ones at decode (``Fp8FusedMoE.shared_overlap``), one model's rank with its shared
experts, the router GEMM in the CUDA graph before the layer as in a model. Per token count, in one process and in
alternated rounds (``alternated_us``, L2 flushed), the replay of a forward (the path the layer picks) with the
shared experts:

- ``inline``: after the dispatch, on the forward's stream (``shared_overlap = False``);
- ``overlap``: on a side stream from the forward's start (their own quantization of ``hidden``) while routing, the
  dispatch and the routed GEMMs run, joined before the combine (the default);

and the same layer without shared experts (``none``: what the layer benches time). ``overlap``'s output is checked
bit for bit against ``inline``'s, and ``inline``'s against the bf16 loop; ``--timeline`` prints each mode's kernels
in one replay after a clean flush.

    python scripts/ab_shared_overlap.py --model scripts/models/deepseek-v3.json --tp 8 [--ep N] [--tokens 1 8 ...]
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_fp8 import calc_diff
from moe_fp8.benchmarks.harness import alternated_us, flushed_events
from moe_fp8.benchmarks.moe import bf16_loop, build_model_layer
from moe_fp8.layers import moe, router_gemm

MODES = {"inline": False, "overlap": True}


def capture(layer, hidden: torch.Tensor, router: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of the router GEMM and one forward (after two eager ones; the path the layer picks), and the
    output it writes."""
    def forward():
        return layer(hidden, router_gemm(hidden, router))
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeline", type=int, nargs="*", default=[], help="token counts whose timelines to print")
    p.add_argument("--paths", nargs="+", choices=("masked", "contiguous"), default=list(moe.SHARED_OVERLAP_PATHS),
                   help="the paths that overlap (moe.SHARED_OVERLAP_PATHS)")
    args = p.parse_args()
    moe.SHARED_OVERLAP_PATHS = tuple(args.paths)
    with open(args.model) as f:
        cfg = json.load(f)
    layer, bf16 = build_model_layer(cfg, args.ep, tp=args.tp, shared=True)
    shared = layer.shared_experts
    print(f"{cfg['model_type']} ep {args.ep} tp {args.tp}: {layer.num_local_experts} local experts, I "
          f"{layer.intermediate_size}, shared I {shared.intermediate_size}")
    print(f"{'tokens':>6} {'path':>10} " + " ".join(f"{m:>9}" for m in (*MODES, "none")) + "  (us, CUDA-graph replay)")
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        router = (torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)
                  / layer.hidden_size**0.5).bfloat16()
        graphs, outs = {}, {}
        for name, mode in MODES.items():
            layer.shared_overlap = mode
            graphs[name], outs[name] = capture(layer, hidden, router)
        layer.shared_experts = None
        graphs["none"], _ = capture(layer, hidden, router)
        layer.shared_experts, layer.shared_overlap = shared, True
        results = {}
        for name, graph in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            results[name] = outs.get(name, torch.empty(0)).clone()
        for name in MODES:
            assert torch.equal(results[name], results["inline"]), f"{name} differs from inline at {t} tokens"
        want = bf16_loop(layer, bf16, hidden, router_gemm(hidden, router))
        diff = calc_diff(results["inline"], want)
        assert diff < 2e-3, f"inline differs from the bf16 loop at {t} tokens: {diff}"
        times = alternated_us([g.replay for g in graphs.values()], rounds=args.rounds)
        print(f"{t:>6} {layer.choose_path(t):>10} " + " ".join(f"{us:9.1f}" for us in times), flush=True)
        if t in args.timeline:
            for name, graph in graphs.items():
                events = flushed_events(graph.replay, clean=True)
                t0 = min(start for _, start, _ in events)
                print(f"  {name}, clean flush: span {max(end for _, _, end in events) - t0:.1f} us")
                for kernel, start, end in sorted(events, key=lambda e: e[1]):
                    print(f"    {start - t0:7.1f} +{end - start:6.1f}  {kernel[:90]}")


if __name__ == "__main__":
    main()
