"""Host time per eager call of every public op and of an ``Fp8FusedMoE`` forward, on a Hopper GPU, as a table
(DESIGN §7 budget: <= 10 us per launch), then a profile of where the GEMM's goes.

Each call is timed alone while a sleep kernel keeps the GPU busy, so no launch waits for the GPU: what is left
is Python, allocations and the launches themselves. Medians of ``--calls`` calls; the host's speed varies
between machines and processes (up to 2x on the device machine), so compare within one run.

    python scripts/host_overhead.py              # the table, then the GEMM profile
    python scripts/host_overhead.py --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

import moe_fp8
from moe_fp8 import reference as ref
from moe_fp8.kernels.gemm import fp8_gemm_hopper
from moe_fp8.kernels.quant import per_token_group_quant_hopper
from moe_fp8.kernels.triton import quant as triton_quant


def host_us(fn: Callable[[], object], calls: int) -> float:
    """Median host µs of one ``fn()`` with the GPU busy (a sleep queued before each call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda._sleep(1_000_000)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def cases() -> list[tuple[str, Callable[[], object]]]:
    dev = "cuda"
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    x_fp8, x_scale = ref.per_token_group_quant(x)
    w_fp8, w_scale = ref.per_block_quant(w)
    out = torch.empty(64, 256, device=dev, dtype=torch.bfloat16)
    # DeepSeek-V3 sizes, one expert-parallel rank (32 of 256 experts), 512 tokens
    t, hidden, experts, local = 512, 7168, 256, 32
    h = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(t, experts, device=dev)
    bias = torch.randn(experts, device=dev) * 0.01
    weights, ids = moe_fp8.layers.select_experts(logits, 8, scoring_func="sigmoid", n_group=8, topk_group=4,
                                                 e_score_correction_bias=bias, routed_scaling_factor=2.5)
    expert_map = torch.tensor([e if e < local else -1 for e in range(experts)], device=dev, dtype=torch.int32)
    act = torch.randn(t, 4096, device=dev, dtype=torch.bfloat16)
    y = torch.randn(t * 8, hidden, device=dev, dtype=torch.bfloat16)
    row_map = torch.randint(0, t * 8, (t, 8), device=dev)
    return [
        ("fp8_gemm kernel wrapper (64×256×256)", lambda: fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)),
        ("public moe_fp8.fp8_gemm (64×256×256)", lambda: moe_fp8.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, out=out)),
        ("layers.select_experts (512 tokens, grouped top-8 of 256)", lambda: moe_fp8.layers.select_experts(
            logits, 8, scoring_func="sigmoid", n_group=8, topk_group=4, e_score_correction_bias=bias,
            routed_scaling_factor=2.5)),
        ("quant.per_token_group (512×7168)", lambda: moe_fp8.quant.per_token_group(h)),
        ("  its CUDA kernel's wrapper, forced", lambda: per_token_group_quant_hopper(h, 128, False, 1e-10, force=True)),
        ("  its Triton kernel's wrapper", lambda: triton_quant.per_token_group_quant(h, 128, False, 1e-10)),
        ("quant.silu_mul_per_token_group (512×4096)", lambda: moe_fp8.quant.silu_mul_per_token_group(act)),
        ("layers.quant_dispatch_contiguous (512 tokens, 32 of 256 local, no sync)", lambda: moe_fp8.layers.quant_dispatch_contiguous(
            h, ids, local, expert_map, sync=False, return_x=False, return_m_total=True)),
        ("layers.quant_dispatch_masked (512 tokens, 32 of 256 local)", lambda: moe_fp8.layers.quant_dispatch_masked(
            h, ids, local, t, expert_map)),
        ("layers.combine (512 tokens × 8 slots × 7168)", lambda: moe_fp8.layers.combine(y, row_map, weights)),
    ]


def layer_cases() -> list[tuple[str, Callable[[], object]]]:
    from moe_fp8.benchmarks.moe import HIDDEN, NUM_EXPERTS, build_layer

    layer, _ = build_layer()
    out = []
    for tokens, path in ((2048, "contiguous"), (64, "masked")):
        hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, NUM_EXPERTS, device="cuda")
        out.append((f"Fp8FusedMoE forward ({tokens} tokens, {path}; one EP rank of DeepSeek-V3)",
                    lambda hidden=hidden, logits=logits, path=path: layer(hidden, logits, path=path)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="timed calls per op")
    ap.add_argument("--no-layer", action="store_true", help="skip the layer forward (builds 32 experts' weights)")
    ap.add_argument("--no-profile", action="store_true", help="skip the GEMM's profile")
    ap.add_argument("--profile-forward", action="store_true",
                    help="also profile the layer's contiguous forward at 2048 tokens (top functions by own time)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = cases() + ([] if args.no_layer else layer_cases())
    print("| eager call | host µs (median, GPU busy) |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {host_us(fn, args.calls if 'forward' not in name else 40):.1f} |", flush=True)
    if not args.no_profile:
        gemm = dict(rows)["public moe_fp8.fp8_gemm (64×256×256)"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            gemm()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
    if args.profile_forward and not args.no_layer:
        forward = rows[-2][1]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            torch.cuda._sleep(1_000_000)
            forward()
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats("moe_fp8", 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
