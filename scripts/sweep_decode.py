"""GPU sweep of the masked decode GEMMs of an expert-parallel rank: weights streamed per second by config.

    python scripts/sweep_decode.py [--shapes G,MAX_M,EXPECTED,N,K[,F] ...] [--configs 64x256s4 64x256s4k ...]
                                   [--spans] [--seed 0]

A shape is G local experts, MAX_M rows each (the tokens), EXPECTED rows drawn 0.7-1.3x per expert, N x K weights;
F=1 runs the fused gate-up GEMM (SiLU·mul + quant epilogue: N = 2I, 256-wide tiles only). Configs as
``parse_block`` reads them, plus a trailing 'k' for K pieces in the last wave (masked 256-wide tiles), '-ts' for no
tail split. Prints, per shape, the heuristic's config and each config's kernel time (``bench_chilled_us``: kernel
durations after an 8 GB memset) with the weights' TB/s (every touched expert's N x K bytes / time); ``--spans``: the
kernel's time after do_bench's flush, whose dirty lines the kernel writes back, and after a clean L2
(``flushed_spans_us``), "dirty/clean". (``scripts/sweep_grouped.py``: block shapes of compute-bound grouped GEMMs,
in TFLOPS.)
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8.benchmarks.gemm import parse_block
from moe_fp8.benchmarks.harness import bench_chilled_us, flushed_spans_us

# (G, max_m, expected, N, K, fused): GLM-4.5 / MiniMax-M2 / DeepSeek-V3 ranks at EP 8, 128 tokens
DEFAULT_SHAPES = [
    (20, 128, 7, 3072, 5120, 1), (20, 128, 7, 5120, 1536, 0),
    (32, 128, 4, 3072, 3072, 1), (32, 128, 4, 3072, 1536, 0),
    (32, 128, 4, 4096, 7168, 1), (32, 128, 4, 7168, 2048, 0),
]


def parse_shape(spec: str) -> tuple[int, ...]:
    v = tuple(int(x) for x in spec.split(","))
    if len(v) not in (5, 6):
        raise argparse.ArgumentTypeError(f"shape G,MAX_M,EXPECTED,N,K[,F], got {spec!r}")
    return v if len(v) == 6 else (*v, 0)


def main() -> None:
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_masked_hopper, fp8_grouped_gemm_silu_mul_quant_hopper
    from moe_fp8.kernels.heuristics import GemmDesc, get_config, make_config
    from moe_fp8.testing import make_masked_inputs
    from moe_fp8.utils import FP8_DTYPE, empty_scale_tma, get_num_sms

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=DEFAULT_SHAPES)
    p.add_argument("--configs", nargs="+", default=["64x256s4", "64x256s4k", "64x256s3k", "128x256s3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spans", action="store_true", help="time after a dirty and after a clean L2 (flushed_spans_us)")
    args = p.parse_args()

    def timed(fn) -> str:
        """``"us TB/s"`` (chilled), or with ``--spans`` ``"dirty/clean us dirty/clean TB/s"``."""
        if not args.spans:
            us = bench_chilled_us(fn)
            return f"{us:.1f} {wbytes / us / 1e6:.2f}"
        dirty, clean = flushed_spans_us(fn)
        return f"{dirty:.1f}/{clean:.1f} {wbytes / dirty / 1e6:.2f}/{wbytes / clean / 1e6:.2f}"

    sms = get_num_sms()
    for g, max_m, expected, n, k, fused in args.shapes:
        inp = make_masked_inputs(g, max_m, expected, n, k, seed=args.seed, device="cuda")
        touched = int((inp.masked_m > 0).sum())
        wbytes = touched * n * k
        desc = GemmDesc(max_m, n, k, num_groups=g, layout="masked", num_sms=sms, expected_m=expected,
                        act_quant=int(fused))
        if fused:
            y = torch.empty(g, max_m, n // 2, device="cuda", dtype=FP8_DTYPE)
            y_scale = empty_scale_tma(max_m, n // 256, groups=g, device="cuda")

            def fn(c, inp=inp, y=y, y_scale=y_scale, expected=expected):
                fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, None,
                                                       inp.masked_m, expected, False, y, y_scale, config=c)
        else:
            out = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)

            def fn(c, inp=inp, out=out, expected=expected):
                fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                               expected, out, config=c)
        cfg = get_config(desc)
        line = [f"G{g} max_m {max_m} exp {expected} {n}x{k}{' fused' if fused else ''} ({int(inp.masked_m.sum())} "
                f"rows, {touched} touched): heuristic {cfg.block_m}x{cfg.block_n}s{cfg.num_stages}"
                f"{'k' if cfg.k_split else ''} {timed(lambda cfg=cfg: fn(cfg))} |"]
        for spec in args.configs:
            no_tail = spec.endswith("-ts")
            spec = spec.removesuffix("-ts")
            k_split = spec.endswith("k")
            bm, bn, _mc, _on_a, st, _sk = parse_block(spec.removesuffix("k"))
            try:
                c = make_config(bm, bn, sms, k=k, num_stages=st, tail_split=False if no_tail else None,
                                k_split=k_split, a_box_rows=32 if bm == 64 else 0)
                line.append(f"{spec}{'-ts' if no_tail else ''} {timed(lambda c=c: fn(c))}")
            except Exception as e:  # record and go on: a sweep is calibration data
                line.append(f"{spec}: {type(e).__name__}: {e}"[:120])
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
