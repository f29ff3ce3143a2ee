"""The router GEMM (``layers.router_gemm``: float32 logits of bf16 hidden states) against what models run instead,
per token count, as CUDA-graph replays (``bench_us``, L2 flushed), in one process:

- ``ours_bf16`` / ``ours_f32``: ``router_gemm`` on a bf16 / float32 weight (the kernel up to 16 tokens, then cuBLAS);
- ``torch_f32_linear``: ``F.linear(x.float(), w_f32)``, transformers' DeepSeek-V3 router (what the layer benches
  captured before ``router_gemm``);
- ``torch_mm_f32_out``: ``torch.mm(x, w_bf16ᵀ, out_dtype=float32)`` (cuBLAS bf16, float32 output);
- ``torch_bf16_linear``: ``F.linear(x, w_bf16)``, bf16 logits (a bf16 engine gate; less precise).

``--experts-per-warp`` adds kernel variants of the given experts a warp (the heuristic's pick is ``ours_bf16``), and
``--layer MODEL.json --tp N`` times a layer rank's replay with the router in its graph, the float32 linear against
``router_gemm`` on each weight dtype, alternated rounds.

    python3 scripts/bench_router_gemm.py --tokens 1 2 4 8 16 32 64 128 --experts-per-warp 1 2 4 \\
        --layer scripts/models/deepseek-v3.json --tp 8 --layer-tokens 1 8 128
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from moe_fp8.benchmarks.harness import bench_us
from moe_fp8.benchmarks.moe import build_model_layer
from moe_fp8.benchmarks.moe_data import _graph_replay
from moe_fp8.kernels import router_gemm as rg
from moe_fp8.layers import router_gemm


def with_experts_per_warp(experts: int):
    """``rg.plan`` with ``experts`` experts a warp instead of its pick (for the kernel's cases)."""
    real = rg.plan

    def plan(*args):
        got = real(*args)
        return None if got is None else (got[0], experts, *got[2:])
    return plan


def kernel_rows(tokens: list[int], hidden: int, experts: int, experts_per_warp: list[int]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w32 = torch.randn(experts, hidden, device="cuda", generator=gen) / hidden**0.5
    w16 = w32.to(torch.bfloat16)
    w32 = w16.float()  # the exact upcast, as transformers keeps it
    print(f"# {torch.cuda.get_device_name()}; router GEMM [T, {hidden}] x [{experts}, {hidden}]^T, CUDA-graph replays, "
          "bench_us (L2 flushed), us")
    for t in tokens:
        token_row(torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, generator=gen), w16, w32,
                  experts_per_warp)


def token_row(x: torch.Tensor, w16: torch.Tensor, w32: torch.Tensor, experts_per_warp: list[int]) -> None:
    t, (experts, hidden) = x.shape[0], w16.shape
    want = F.linear(x.float(), w32)
    calls = {"ours_bf16": lambda: router_gemm(x, w16), "ours_f32": lambda: router_gemm(x, w32),
             "torch_f32_linear": lambda: F.linear(x.float(), w32),
             "torch_mm_f32_out": lambda: torch.mm(x, w16.t(), out_dtype=torch.float32),
             "torch_bf16_linear": lambda: F.linear(x, w16)}
    variants = {}
    if rg.plan(t, hidden, experts, torch.bfloat16, 132) is not None:
        for e in experts_per_warp:
            real, rg.plan = rg.plan, with_experts_per_warp(e)
            try:
                variants[f"ours_bf16_epw{e}"] = _graph_replay(lambda: router_gemm(x, w16))
                err = (router_gemm(x, w16) - want).abs().max().item()
            finally:
                rg.plan = real
            print(f"  t={t} epw{e}: max |ours - f32 linear| {err:.3g}")
    replays = {name: _graph_replay(fn) for name, fn in calls.items()} | variants
    for name in ("ours_bf16", "ours_f32", "torch_mm_f32_out"):
        err = (calls[name]() - want).abs().max().item()
        print(f"  t={t} {name}: max |x - f32 linear| {err:.3g}")
    times = {name: [] for name in replays}
    for _ in range(3):
        for name, replay in replays.items():
            times[name].append(bench_us(replay))
    line = "  ".join(f"{name} {min(ts):6.2f}" for name, ts in times.items())
    print(f"T={t:4d}  {line}")


def layer_rows(model: str, ep: int, tp: int, tokens: list[int], rounds: int) -> None:
    from moe_fp8.benchmarks.moe import capture_forward

    with open(model) as f:
        layer = build_model_layer(json.load(f), ep, tp=tp)[0]
    print(f"\n# {model} ep {ep} tp {tp}: layer replay with the router in the graph, {rounds} rounds alternated, us")
    for t in tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        w32 = (torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)
               / layer.hidden_size**0.5).to(torch.bfloat16).float()
        path = layer.choose_path(t)
        graphs = {"f32_linear": capture_forward(layer, hidden, None, path, router_weight=w32,  # (before)
                                                router_fn=lambda h, w: F.linear(h.float(), w)),
                  "router_gemm_f32": capture_forward(layer, hidden, None, path, router_weight=w32),
                  "router_gemm_bf16": capture_forward(layer, hidden, None, path, router_weight=w32.bfloat16())}
        times = {name: [] for name in graphs}
        for _ in range(rounds):
            for name, graph in graphs.items():
                times[name].append(bench_us(graph.replay))
        base = min(times["f32_linear"])
        print(f"## {t} tokens, {path}")
        for name, ts in times.items():
            print(f"  {name:18s} {min(ts):8.1f} us  x {base / min(ts):5.3f}  [{' '.join(f'{v:.1f}' for v in ts)}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--experts-per-warp", type=int, nargs="*", default=[])
    p.add_argument("--layer", default=None, help="a model's config.json: also time a layer rank's replay")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    kernel_rows(args.tokens, args.hidden, args.experts, args.experts_per_warp)
    if args.layer:
        layer_rows(args.layer, args.ep, args.tp, args.layer_tokens, args.rounds)


if __name__ == "__main__":
    main()
