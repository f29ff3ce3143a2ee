"""Shared experts beside the routed ones at decode (``Fp8FusedMoE.shared_overlap``), one model's rank with its shared
experts, the router GEMM in the CUDA graph before the layer as in a model. Per token count, in one process and in
alternated rounds (``alternated_us``, L2 flushed), the replay of a forward (the path the layer picks) with the
shared experts:

- ``inline``: after the dispatch, on the forward's stream (``shared_overlap = False``);
- ``overlap``: on a side stream from the forward's start (their own quantization of ``hidden``) while routing, the
  dispatch and the routed GEMMs run, joined before the combine (the default);
- ``fused`` (``--fused``): as one more local expert of the routed GEMMs (SGLang's shared-expert fusion; each token
  routed to it with weight 1, the layer's weights copied into a stack of ``E_local + n_shared`` experts; a shared
  intermediate of ``n · I`` as ``n`` experts);

and the same layer without shared experts (``none``: what the layer benches time). ``overlap``'s output is checked
bit for bit against ``inline``'s, ``inline``'s and ``fused``'s against the bf16 loop; ``--timeline`` prints each
mode's kernels in one replay after a clean flush.

    python scripts/ab_shared_overlap.py --model scripts/models/deepseek-v3.json --tp 8 [--ep N] [--tokens 1 8 ...]
        [--fused] [--paths masked contiguous] [--timeline 8 ...]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

import torch

from moe_fp8 import calc_diff
from moe_fp8.benchmarks.harness import alternated_us, flushed_events
from moe_fp8.benchmarks.moe import bf16_loop, build_model_layer, capture_forward
from moe_fp8.layers import Fp8FusedMoE, combine, moe, router_gemm
from moe_fp8.utils import GROUP_K

MODES = {"inline": False, "overlap": True}


def shared_as_experts(layer: Fp8FusedMoE) -> Fp8FusedMoE:
    """A layer whose local experts are ``layer``'s followed by its shared experts, ``I`` rows of them each (global
    ids ``E ..``, local ``E_local ..``), for ``fused_forward``; routing options unused."""
    shared, e, el, i = layer.shared_experts, layer.num_experts, layer.num_local_experts, layer.intermediate_size
    n, rem = divmod(shared.intermediate_size, i)
    if rem:
        raise ValueError(f"shared intermediate {shared.intermediate_size} is not a multiple of the experts' {i}")
    dev = layer.w13_weight.device
    expert_map = None
    if layer.expert_map is not None:
        expert_map = torch.cat([layer.expert_map, torch.arange(el, el + n, dtype=layer.expert_map.dtype, device=dev)])
    ext = Fp8FusedMoE(e + n, layer.hidden_size, i, layer.top_k, expert_map=expert_map, ue8m0=layer.ue8m0,
                      masked_max_tokens=layer.masked_max_tokens, device=dev)
    gate_up, gate_up_s = shared.gate_up_proj.weight, shared.gate_up_proj.weight_scale_inv  # [gate | up]
    down, down_s = shared.down_proj.weight, shared.down_proj.weight_scale_inv
    ib, si = i // GROUP_K, shared.intermediate_size
    for name, routed in (("w13_weight", layer.w13_weight), ("w13_weight_scale_inv", layer.w13_weight_scale_inv),
                         ("w2_weight", layer.w2_weight), ("w2_weight_scale_inv", layer.w2_weight_scale_inv)):
        getattr(ext, name)[:el].copy_(routed)
    for j in range(n):  # expert j of the shared MLP: its gate rows, its up rows, its down columns
        ext.w13_weight[el + j].copy_(torch.cat([gate_up[j * i:(j + 1) * i], gate_up[si + j * i:si + (j + 1) * i]]))
        up0 = si // GROUP_K + j * ib  # the up half's scale rows start at si / 128
        ext.w13_weight_scale_inv[el + j].copy_(torch.cat([gate_up_s[j * ib:(j + 1) * ib], gate_up_s[up0:up0 + ib]]))
        ext.w2_weight[el + j].copy_(down[:, j * i:(j + 1) * i])
        ext.w2_weight_scale_inv[el + j].copy_(down_s[:, j * ib:(j + 1) * ib])
    return ext


def fused_forward(layer: Fp8FusedMoE, ext: Fp8FusedMoE, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``layer``'s forward with its shared experts as ``ext``'s last local experts: ``layer``'s routing, each token
    also sent to them with weight 1, ``ext``'s dispatch and grouped GEMMs on the path ``layer`` picks, one combine."""
    weights, ids = layer.route(logits)
    t, n = hidden.shape[0], ext.num_experts - layer.num_experts
    shared_ids = torch.arange(layer.num_experts, ext.num_experts, dtype=ids.dtype, device=ids.device)
    ids = torch.cat([ids, shared_ids.expand(t, n)], dim=1)
    weights = torch.cat([weights, weights.new_ones(t, n)], dim=1)
    experts = ext._experts_contiguous if layer.choose_path(t, hidden) == "contiguous" else ext._experts_masked
    y, row_map, _ = experts(hidden, ids)
    out = combine(y, row_map, weights, None)
    return out if out.dtype == hidden.dtype else out.to(hidden.dtype)


def capture(layer, hidden: torch.Tensor, router: torch.Tensor,
            fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
            ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``capture_forward``'s graph of the router GEMM and one forward (``fn``, default ``layer``'s; the path the
    layer picks), and the output the graph writes (the captured call's)."""
    fn = fn or layer
    last: list[torch.Tensor] = []

    def forward(h: torch.Tensor, logits: torch.Tensor, path: str) -> torch.Tensor:
        last[:] = [fn(h, logits)]
        return last[0]
    graph = capture_forward(forward, hidden, None, layer.choose_path(hidden.shape[0]), router_weight=router)
    return graph, last[0]


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
    p.add_argument("--fused", action="store_true", help="also the shared experts as more routed experts")
    args = p.parse_args()
    moe.SHARED_OVERLAP_PATHS = tuple(args.paths)
    with open(args.model) as f:
        cfg = json.load(f)
    layer, bf16 = build_model_layer(cfg, args.ep, tp=args.tp, shared=True)
    shared = layer.shared_experts
    print(f"{cfg['model_type']} ep {args.ep} tp {args.tp}: {layer.num_local_experts} local experts, I "
          f"{layer.intermediate_size}, shared I {shared.intermediate_size}")
    ext = shared_as_experts(layer) if args.fused else None
    columns = (*MODES, *(("fused",) if ext is not None else ()), "none")
    print(f"{'tokens':>6} {'path':>10} " + " ".join(f"{m:>9}" for m in columns) + "  (us, CUDA-graph replay)")
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        router = (torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)
                  / layer.hidden_size**0.5).bfloat16()
        graphs, outs = {}, {}
        for name, mode in MODES.items():
            layer.shared_overlap = mode
            graphs[name], outs[name] = capture(layer, hidden, router)
        if ext is not None:
            graphs["fused"], outs["fused"] = capture(layer, hidden, router, partial(fused_forward, layer, ext))
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
        for name in ("inline", "fused") if ext is not None else ("inline",):
            diff = calc_diff(results[name], want)
            assert diff < 2e-3, f"{name} differs from the bf16 loop at {t} tokens: {diff}"
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
