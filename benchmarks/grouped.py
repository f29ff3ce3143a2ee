"""``moe-fp8 bench grouped``: M-grouped contiguous (prefill) and masked (decode) GEMMs against a
per-group loop of torch's block-scaled ``_scaled_mm`` (what a user has without us)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from .harness import REPO, bench_us, measure_ceilings, ratio_table, row, write_record
from .shapes import CONTIGUOUS_SHAPES, MASKED_DECODE_GBPS, MASKED_SHAPES


def _blockwise_loop(x_fp8, x_scale, w_fp8, w_scale, segments):
    """One ``_scaled_mm`` per non-empty group; ``segments`` = [(g, row0, rows)] known on the host.

    cuBLASLt's block-scaled mode refuses row counts that are not multiples of 16, so each slice is
    rounded up to 16 rows (the segment's padding rows, always there in both layouts)."""
    def rows16(n: int) -> int:
        return (n + 15) // 16 * 16
    scales = [(g, r0, rows16(n), x_scale[r0:r0 + rows16(n)].t().contiguous().t(), w_scale[g].t())
              for g, r0, n in segments if n]

    def run():
        for g, r0, n, sa, sb in scales:
            torch._scaled_mm(x_fp8[r0:r0 + n], w_fp8[g].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return run


def _bytes(rows: int, groups_used: int, n: int, k: int) -> int:
    return rows * k + groups_used * n * k + rows * n * 2 + rows * (k // 128) * 4


def bench_contiguous(g: int, m: int, n: int, k: int, seed: int) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8.testing import make_contiguous_inputs

    inp = make_contiguous_inputs(g, m, n, k, seed=seed, device="cuda")
    out = torch.empty(inp.x_fp8.shape[0], n, device="cuda", dtype=torch.bfloat16)
    rows = sum(inp.group_sizes)
    shape = {"groups": g, "m_per_group": m, "n": n, "k": k}
    flops, nbytes = 2 * rows * n * k, _bytes(rows, sum(1 for s in inp.group_sizes if s), n, k)
    ours = bench_us(lambda: moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                                 inp.m_indices, out=out))
    loop = _blockwise_loop(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                           list(zip(range(g), inp.group_starts, inp.group_sizes, strict=True)))
    return [row("grouped_contiguous", shape, "moe_fp8", ours, flops, nbytes),
            row("grouped_contiguous", shape, "torch_blockwise_loop", bench_us(loop), flops, nbytes)]


def bench_masked(g: int, max_m: int, m: int, n: int, k: int, seed: int) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8.testing import make_masked_inputs

    inp = make_masked_inputs(g, max_m, m, n, k, seed=seed, device="cuda")
    out = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)
    counts = inp.masked_m.tolist()
    rows = sum(counts)
    shape = {"groups": g, "max_m": max_m, "expected_m": m, "n": n, "k": k}
    flops, nbytes = 2 * rows * n * k, _bytes(rows, sum(1 for c in counts if c), n, k)
    ours = bench_us(lambda: moe_fp8.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                             inp.masked_m, m, out=out))
    x2 = inp.x_fp8.view(g * max_m, k)
    s2 = torch.cat([inp.x_scale[i] for i in range(g)])  # loop baseline takes any layout; built once
    loop = _blockwise_loop(x2, s2, inp.w_fp8, inp.w_scale, [(i, i * max_m, c) for i, c in enumerate(counts)])
    return [row("grouped_masked", shape, "moe_fp8", ours, flops, nbytes),
            row("grouped_masked", shape, "torch_blockwise_loop", bench_us(loop), flops, nbytes)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-fp8 bench grouped")
    p.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks")
    args = p.parse_args(argv)
    ceilings = measure_ceilings()
    rows: list[dict[str, Any]] = []
    notes = []
    for (g, m, n, k), dg in CONTIGUOUS_SHAPES.items():
        rows += bench_contiguous(g, m, n, k, seed=g + n)
        notes.append(f"contiguous {g}x{m} {n}x{k}: ours {rows[-2]['tflops']} TF, DeepGEMM {dg} TF")
        print(notes[-1], flush=True)
    for shape, dg in {**MASKED_SHAPES, **MASKED_DECODE_GBPS}.items():
        rows += bench_masked(*shape, seed=sum(shape))
        unit = "GB/s" if shape in MASKED_DECODE_GBPS else "TF"
        mine = rows[-2]["gbps"] if unit == "GB/s" else rows[-2]["tflops"]
        notes.append(f"masked {shape}: ours {mine} {unit}, DeepGEMM {dg} {unit}")
        print(notes[-1], flush=True)
    path = write_record("grouped", rows, ceilings, args.out_dir)
    print(f"\nceilings: {ceilings}\n")
    for kind in ("grouped_contiguous", "grouped_masked"):
        print(f"\n## {kind}\n")
        print(ratio_table([r for r in rows if r["kind"] == kind], "moe_fp8", ["torch_blockwise_loop"]))
    print("\n" + "\n".join(notes))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
