"""GPU sweep of explicit block shapes for the M-grouped GEMMs (the heuristic's calibration data).

    python scripts/sweep_grouped.py --blocks 128x128 128x256 64x128 [--shapes G,M,N,K ... G,MAX_M,M,N,K ...]
        [--seeds 0 1 2]

Prints, per shape and seed (the group sizes drawn), the heuristic's choice and the time of every swept
block shape (do_bench medians); two-wave blocks (192 / 256 wide) also without the tail split ("-ts").
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8.benchmarks.gemm import parse_block
from moe_fp8.benchmarks.grouped import default_shapes, parse_shape
from moe_fp8.benchmarks.harness import bench_us


def main() -> None:
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_contiguous_hopper, fp8_grouped_gemm_masked_hopper
    from moe_fp8.kernels.heuristics import WAVE_BLOCK_NS, GemmDesc, get_config, make_config
    from moe_fp8.testing import make_contiguous_inputs, make_masked_inputs
    from moe_fp8.utils import get_num_sms

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", nargs="+", type=parse_block, required=True)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=default_shapes())
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    args = p.parse_args()
    sms = get_num_sms()
    for shape, seed in ((shape, seed) for shape in args.shapes for seed in args.seeds):
        if len(shape) == 4:
            g, m, n, k = shape
            inp = make_contiguous_inputs(g, m, n, k, seed=seed, device="cuda")
            out = torch.empty(inp.x_fp8.shape[0], n, device="cuda", dtype=torch.bfloat16)
            rows = sum(inp.group_sizes)
            desc = GemmDesc(inp.x_fp8.shape[0], n, k, num_groups=g, layout="contiguous", num_sms=sms)

            def fn(c, inp=inp, out=out):
                fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices,
                                                   out, config=c)
        else:
            g, max_m, m, n, k = shape
            inp = make_masked_inputs(g, max_m, m, n, k, seed=seed, device="cuda")
            out = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)
            rows = int(inp.masked_m.sum())
            desc = GemmDesc(max_m, n, k, num_groups=g, layout="masked", num_sms=sms, expected_m=m)

            def fn(c, inp=inp, out=out, m=m):
                fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, m,
                                               out, config=c)
        flops = 2 * rows * n * k
        cfg = get_config(desc)
        us = bench_us(lambda cfg=cfg: fn(cfg))
        line = [f"{shape} seed {seed} ({rows} rows): heuristic {cfg.block_m}x{cfg.block_n}s{cfg.num_stages} "
                f"{flops / us / 1e6:.0f} TF |"]
        for bm, bn, _multicast, _on_a, st, _split_k in args.blocks:  # grouped layouts never multicast
            # two-wave tiles twice: with the tail split (the default) and without ("-ts")
            for tail_split in ((True, False) if bn in WAVE_BLOCK_NS else (None,)):
                try:
                    c = make_config(bm, bn, sms, k=k, num_stages=st, tail_split=tail_split)
                    name = f"{bm}x{bn}s{c.num_stages}{'-ts' if tail_split is False else ''}"
                    line.append(f"{name} {flops / bench_us(lambda c=c: fn(c)) / 1e6:.0f}")
                except Exception as e:  # record and go on: a sweep is calibration data
                    line.append(f"{bm}x{bn}: {type(e).__name__}")
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
