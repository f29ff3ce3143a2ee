"""``moe-fp8 bench grouped``: M-grouped contiguous (prefill) and masked (decode) GEMMs against a
per-group loop of torch's block-scaled ``_scaled_mm`` (what a user has without us)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from . import BenchKind, Step, parse_ints
from .harness import bench_chilled_us, bench_us, row
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
    def ours():
        moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out=out)
    loop = _blockwise_loop(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                           list(zip(range(g), inp.group_starts, inp.group_sizes, strict=True)))
    return [row("grouped_contiguous", shape, impl, bench_us(fn), flops, nbytes, bench_chilled_us(fn))
            for impl, fn in (("moe_fp8", ours), ("torch_blockwise_loop", loop))]


def bench_masked(g: int, max_m: int, m: int, n: int, k: int, seed: int) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8.testing import make_masked_inputs

    inp = make_masked_inputs(g, max_m, m, n, k, seed=seed, device="cuda")
    out = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)
    counts = inp.masked_m.tolist()
    rows = sum(counts)
    shape = {"groups": g, "max_m": max_m, "expected_m": m, "n": n, "k": k}
    flops, nbytes = 2 * rows * n * k, _bytes(rows, sum(1 for c in counts if c), n, k)
    def ours():
        moe_fp8.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, m, out=out)
    x2 = inp.x_fp8.view(g * max_m, k)
    s2 = torch.cat([inp.x_scale[i] for i in range(g)])  # loop baseline takes any layout; built once
    loop = _blockwise_loop(x2, s2, inp.w_fp8, inp.w_scale, [(i, i * max_m, c) for i, c in enumerate(counts)])
    return [row("grouped_masked", shape, impl, bench_us(fn), flops, nbytes, bench_chilled_us(fn))
            for impl, fn in (("moe_fp8", ours), ("torch_blockwise_loop", loop))]


def default_shapes() -> list[tuple[int, ...]]:
    """The ANCHORS.md rows: contiguous (G, M, N, K), then masked (G, max_m, expected_m, N, K)."""
    return [*CONTIGUOUS_SHAPES, *MASKED_SHAPES, *MASKED_DECODE_GBPS]


def parse_shape(text: str) -> tuple[int, ...]:
    """``G,M,N,K`` (contiguous, M rows per group) or ``G,MAX_M,M,N,K`` (masked, expected M per group)."""
    shape = parse_ints(text, (4, 5), "G,M,N,K (contiguous) or G,MAX_M,M,N,K (masked)")
    n, k = shape[-2:]
    if n % 8 or k % 16:
        raise ValueError(f"shape {text!r}: N must be a multiple of 8 and K of 16 (got N={n}, K={k})")
    if len(shape) == 5 and shape[2] > shape[1]:
        raise ValueError(f"shape {text!r}: expected M ({shape[2]}) exceeds MAX_M ({shape[1]})")
    return shape


def run(shapes: list[tuple[int, ...]], args: argparse.Namespace | None = None,
        step: Step | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Time both layouts on every shape (4 numbers: contiguous, 5: masked); rows and DeepGEMM notes."""
    rows: list[dict[str, Any]] = []
    notes = []
    for shape in shapes:
        if len(shape) == 4:
            g, m, n, k = shape
            rows += bench_contiguous(g, m, n, k, seed=g + n)
            dg = CONTIGUOUS_SHAPES.get(shape)
            notes.append(f"contiguous {g}x{m} {n}x{k}: ours {rows[-2]['tflops']} TF"
                         f" ({rows[-2]['chilled_tflops']} TF chilled)" + (f", DeepGEMM {dg} TF" if dg else ""))
            label = f"contiguous {g}x{m} {n}x{k}"
        else:
            rows += bench_masked(*shape, seed=sum(shape))
            decode = shape in MASKED_DECODE_GBPS
            unit, metric = ("GB/s", "gbps") if decode else ("TF", "tflops")
            dg = MASKED_DECODE_GBPS.get(shape) if decode else MASKED_SHAPES.get(shape)
            notes.append(f"masked {shape}: ours {rows[-2][metric]} {unit} ({rows[-2]['chilled_' + metric]} {unit}"
                         " chilled)" + (f", DeepGEMM {dg} {unit}" if dg else ""))
            label = f"masked {'x'.join(map(str, shape))}"
        if step is not None:
            step(label)
    return rows, notes


KIND = BenchKind(
    name="grouped",
    help="grouped contiguous (prefill) and masked (decode) GEMMs vs a per-group _scaled_mm loop",
    tables={"grouped_contiguous": ("torch_blockwise_loop",), "grouped_masked": ("torch_blockwise_loop",)},
    default_shapes=default_shapes,
    parse_shape=parse_shape,
    shape_help="G,M,N,K or G,MAX_M,M,N,K",
    run=run,
    op="fp8_grouped_gemm_masked",
)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_fp8.benchmarks.grouped ARGS`` = ``moe-fp8 bench grouped ARGS``."""
    from moe_fp8.cli import main as cli_main

    return cli_main(["bench", "grouped", *(argv or [])])


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
