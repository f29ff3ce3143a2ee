"""One MoE layer of any supported model (its config.json: DeepSeek-V3, Kimi-K2, Qwen3-MoE, GLM-4.5 or MiniMax-M2) as rank 0 of ``--ep`` holds
it, on random block-FP8 experts: ``Fp8FusedMoE``'s forward replayed from a CUDA graph (the path the layer picks
for the token count) against the usual PyTorch MoE (route, then a bf16 loop over the local experts on the
dequantized weights), both timed with ``bench_us`` (L2 flushed). Also the rate at which our replay reads the
weights of the experts it touches. ``--shared``: with the model's shared experts (on a side stream at decode,
``Fp8FusedMoE.shared_overlap``; the loop adds their bf16 MLP, the rate their weights). ``--split`` adds each
stage's median time inside an eager forward (the ``moe`` bench's split: ``StageTimer`` events, L2 flushed).
``moe-fp8 bench moe`` is the DeepSeek-V3 bench; this script is for the others.

    python scripts/bench_model_layer.py --model scripts/models/qwen3-30b-a3b.json --ep 8 [--tp N] [--tokens 1 8 64 ...]
        [--shared] [--split]
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_fp8 import calc_diff
from moe_fp8.benchmarks.harness import bench_us
from moe_fp8.benchmarks.moe import _stage_split, bf16_loop, build_model_layer, capture_forward, local_ids
from moe_fp8.kernels import tuning


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="config.json (or a folder holding one)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="split every expert's intermediate size over this many ranks")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 512, 2048, 8192])
    p.add_argument("--shared", action="store_true", help="with the model's shared experts")
    p.add_argument("--split", action="store_true", help="also each stage's time inside a forward")
    args = p.parse_args()
    path = args.model if args.model.endswith(".json") else f"{args.model}/config.json"
    with open(path) as f:
        cfg = json.load(f)
    layer, bf16 = build_model_layer(cfg, args.ep, tp=args.tp, shared=args.shared)
    local = bf16["w13"].shape[0]
    per_expert = (layer.w13_weight[0].numel() + layer.w2_weight[0].numel()
                  + 4 * (layer.w13_weight_scale_inv[0].numel() + layer.w2_weight_scale_inv[0].numel()))
    shared_bytes = 0
    if layer.shared_experts is not None:
        shared_bytes = sum(lin.weight.numel() + 4 * lin.weight_scale_inv.numel()
                           for lin in (layer.shared_experts.gate_up_proj, layer.shared_experts.down_proj))
    shared_note = f", shared I {layer.shared_experts.intermediate_size}" if shared_bytes else ""
    print(f"model {cfg['model_type']} hidden {cfg['hidden_size']}, {local} of {layer.num_experts} experts (ep "
          f"{args.ep}), I {layer.intermediate_size * args.tp} (tp {args.tp}: {layer.intermediate_size} a rank)"
          f"{shared_note}, top-{layer.top_k}; tables: {tuning.describe_active()}")
    print(f"{'tokens':>6} {'path':>10} {'ours us':>9} {'torch us':>9} {'x':>6} {'touched':>7} {'TB/s':>5}")
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        hidden = torch.randn(t, int(cfg["hidden_size"]), device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(t, layer.num_experts, device="cuda", dtype=torch.float32, generator=gen)
        path = layer.choose_path(t)
        graph = capture_forward(layer, hidden, logits, path)
        ours = bench_us(graph.replay)
        theirs = bench_us(lambda h=hidden, lg=logits: bf16_loop(layer, bf16, h, lg))
        want = bf16_loop(layer, bf16, hidden, logits)
        assert calc_diff(layer(hidden, logits), want) < 2e-3, "the layer differs from the bf16 loop"  # DESIGN §6
        touched = int((local_ids(layer, layer.route(logits)[1]).unique() >= 0).sum())
        print(f"{t:>6} {path:>10} {ours:9.1f} {theirs:9.1f} {theirs / ours:6.2f} {touched:>7} "
              f"{(touched * per_expert + shared_bytes) / ours / 1e6:5.2f}", flush=True)
        if args.split:
            stages, total = _stage_split(layer, hidden, logits, path)
            print("       split: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()) + f"; forward {total:.1f} us")


if __name__ == "__main__":
    main()
