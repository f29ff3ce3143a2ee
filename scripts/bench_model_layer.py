"""One MoE layer of any supported model (its config.json: DeepSeek-V3, Kimi-K2 or Qwen3-MoE) as rank 0 of ``--ep`` holds
it, on random block-FP8 experts: ``Fp8FusedMoE``'s forward replayed from a CUDA graph (the path the layer picks
for the token count) against the usual PyTorch MoE (route, then a bf16 loop over the local experts on the
dequantized weights), both timed with ``bench_us`` (L2 flushed). Also the rate at which our replay reads the
weights of the experts it touches. ``--split`` adds each stage's median time inside an eager forward (the ``moe``
bench's split: ``StageTimer`` events, L2 flushed). ``moe-fp8 bench moe`` is the DeepSeek-V3 bench; this script is for
the others.

    python scripts/bench_model_layer.py --model scripts/models/qwen3-30b-a3b.json --ep 8 [--tokens 1 8 64 ...] [--split]
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from moe_fp8 import calc_diff
from moe_fp8.benchmarks.harness import bench_us
from moe_fp8.benchmarks.moe import _stage_split, bf16_loop, capture_forward, fill_random_experts, local_ids
from moe_fp8.integrations.transformers import ARCHITECTURES, MOE_BLOCKS
from moe_fp8.kernels import tuning
from moe_fp8.layers import Fp8FusedMoE, expert_map_for_rank
from moe_fp8.layers.checkpoint import model_family


def build(cfg: dict, ep: int, seed: int = 0) -> tuple[Fp8FusedMoE, dict[str, torch.Tensor]]:
    """Rank 0's layer (routing as the model's transformers block sets it, no shared experts) and the bf16 copies
    of its experts."""
    arch = ARCHITECTURES[model_family(cfg)]
    experts, hidden, inter = int(cfg[arch.num_experts_key]), int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
    routing = {k: v for k, v in MOE_BLOCKS[arch.model_type].routing(SimpleNamespace(**cfg)).items()
               if k != "num_shared_experts"}
    layer = Fp8FusedMoE(experts, hidden, inter, int(cfg["num_experts_per_tok"]), device="cuda",
                        expert_map=expert_map_for_rank(experts, 0, ep) if ep > 1 else None, **routing)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = fill_random_experts(layer, gen)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.copy_(torch.randn(experts, device="cuda", generator=gen) * 0.01)
    return layer, bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="config.json (or a folder holding one)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 512, 2048, 8192])
    p.add_argument("--split", action="store_true", help="also each stage's time inside a forward")
    args = p.parse_args()
    path = args.model if args.model.endswith(".json") else f"{args.model}/config.json"
    with open(path) as f:
        cfg = json.load(f)
    layer, bf16 = build(cfg, args.ep)
    local = bf16["w13"].shape[0]
    per_expert = (layer.w13_weight[0].numel() + layer.w2_weight[0].numel()
                  + 4 * (layer.w13_weight_scale_inv[0].numel() + layer.w2_weight_scale_inv[0].numel()))
    print(f"model {cfg['model_type']} hidden {cfg['hidden_size']}, {local} of {layer.num_experts} experts (ep "
          f"{args.ep}), I {cfg['moe_intermediate_size']}, top-{layer.top_k}; tables: {tuning.describe_active()}")
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
              f"{touched * per_expert / ours / 1e6:5.2f}", flush=True)
        if args.split:
            stages, total = _stage_split(layer, hidden, logits, path)
            print("       split: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()) + f"; forward {total:.1f} us")


if __name__ == "__main__":
    main()
