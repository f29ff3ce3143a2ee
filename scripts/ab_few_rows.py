"""The few-rows GEMM (kernels/few_rows.py) against the wgmma kernel on decode batches, in one process.

GEMMs: a model rank's masked GEMMs with the rows ``tokens`` decode tokens route there (top-k of the global
experts, counted on the rank's local ones, seeded), both kernels timed alternately (``bench_us``: L2 flushed,
median), with the touched experts' weights read per µs. Layers: one forward of each token count captured in a
CUDA graph with the path off (``few_rows.MAX_ROWS = 0``) and on, the replays timed alternately.

    python scripts/ab_few_rows.py [--tokens 1 2 4 8 16] [--rounds 3] [--gemms-only | --layers-only]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from moe_fp8.benchmarks.harness import bench_us
from moe_fp8.benchmarks.moe import build_model_layer, capture_forward
from moe_fp8.kernels import few_rows
from moe_fp8.kernels.gemm import fp8_grouped_gemm_masked_hopper
from moe_fp8.testing import make_masked_inputs

MODELS = Path(__file__).resolve().parent / "models"
# (name, config, ep, tp): DeepSeek-V3 and Kimi-K2 at EP 8 and TP 8, Qwen3-235B-A22B at EP 8
RANKS = [("DeepSeek-V3 EP8", "deepseek-v3.json", 8, 1), ("Kimi-K2 EP8", "kimi-k2.json", 8, 1),
         ("DeepSeek-V3 TP8", "deepseek-v3.json", 1, 8), ("Qwen3-235B EP8", "qwen3-235b-a22b.json", 8, 1)]


def rank_shapes(cfg: dict, ep: int, tp: int) -> tuple[int, int, int, int, int]:
    """(global experts, local experts, top-k, hidden, intermediate per rank)."""
    experts = int(cfg.get("n_routed_experts") or cfg["num_experts"])
    top_k = int(cfg.get("num_experts_per_tok"))
    return experts, experts // ep, top_k, int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"]) // tp


def counts(tokens: int, experts: int, local: int, top_k: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    hits = torch.zeros(experts, dtype=torch.int64)
    for _ in range(tokens):
        hits[torch.randperm(experts, generator=gen)[:top_k]] += 1
    return hits[:local].tolist()


def gemm_rows(rounds: int, token_counts: list[int]) -> None:
    print(f"{'rank':>16} {'N x K':>12} {'tokens':>6} {'touched':>7} {'wgmma us':>9} {'few us':>8} {'x':>6} "
          f"{'wgmma TB/s':>10} {'few TB/s':>8}")
    for name, file, ep, tp in RANKS:
        experts, local, top_k, hidden, inter = rank_shapes(json.loads((MODELS / file).read_text()), ep, tp)
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            for tokens in token_counts:
                rows = counts(tokens, experts, local, top_k, seed=tokens)
                inp = make_masked_inputs(local, tokens, 1, n, k, seed=tokens, device="cuda", masked_m=rows)
                out = torch.empty((local, tokens, n), dtype=torch.bfloat16, device="cuda")
                hint = max(1, tokens * top_k // experts)
                times: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(rounds):
                    for on in (False, True):
                        few_rows.MAX_ROWS = 16 if on else 0
                        times[on].append(bench_us(partial(fp8_grouped_gemm_masked_hopper, inp.x_fp8, inp.x_scale,
                                                          inp.w_fp8, inp.w_scale, inp.masked_m, hint, out)))
                off_us, on_us = (sorted(times[on])[rounds // 2] for on in (False, True))
                touched = sum(r > 0 for r in rows)
                mb = touched * n * k / 1e6
                print(f"{name:>16} {n:>5}x{k:<6} {tokens:>6} {touched:>7} {off_us:9.1f} {on_us:8.1f} "
                      f"{off_us / on_us:6.2f} {mb / off_us:10.2f} {mb / on_us:8.2f}", flush=True)
    few_rows.MAX_ROWS = 16


def layer_rows(rounds: int, token_counts: list[int]) -> None:
    print(f"{'rank':>16} {'tokens':>6} {'off us':>8} {'on us':>8} {'x':>6}")
    for name, file, ep, tp in RANKS:
        layer, _ = build_model_layer(json.loads((MODELS / file).read_text()), ep, tp=tp)
        for tokens in token_counts:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            hidden = torch.randn(tokens, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(tokens, layer.num_experts, device="cuda", dtype=torch.float32, generator=gen)
            graphs = {}
            for on in (False, True):
                few_rows.MAX_ROWS = 16 if on else 0
                graphs[on] = capture_forward(layer, hidden, logits, "masked")
            few_rows.MAX_ROWS = 16
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for on, g in graphs.items():
                    times[on].append(bench_us(g.replay))
            off_us, on_us = (sorted(times[on])[rounds // 2] for on in (False, True))
            print(f"{name:>16} {tokens:>6} {off_us:8.1f} {on_us:8.1f} {off_us / on_us:6.2f}", flush=True)
        del layer
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemms-only", action="store_true")
    p.add_argument("--layers-only", action="store_true")
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    if not args.layers_only:
        gemm_rows(args.rounds, args.tokens)
    if not args.gemms_only:
        layer_rows(args.rounds, args.tokens)


if __name__ == "__main__":
    main()
