"""``moe-fp8 bench grouped``: M-grouped contiguous (prefill) and masked (decode) GEMMs against the normal GEMM's
baselines in grouped form, in one process:

- ``torch_blockwise_loop``: one block-scaled ``_scaled_mm`` (cuBLASLt) per non-empty group, the same numbers as
  ours: what a user has without us;
- ``torch_fp8_rowwise_grouped``: torch's FP8 grouped GEMM (``_scaled_grouped_mm``, row-wise scales, one launch).
  Unit scales: a speed reference, as the per-tensor FP8 row of the normal GEMM (its values are unscaled);
- ``torch_bf16_grouped``: torch's bf16 grouped GEMM (``_grouped_mm``, one launch) on the unquantized operands.

The two grouped ops take each group's rows as one segment (``offs``): the contiguous layout's aligned segments as
they are, the masked layout's valid rows gathered once outside the timing (as the loop's host-known segments)."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch

from . import BenchKind, Step, parse_ints
from .harness import bench_chilled_us, bench_us, row
from .shapes import CONTIGUOUS_SHAPES, MASKED_DECODE_GBPS, MASKED_SHAPES

BASELINES = ("torch_blockwise_loop", "torch_fp8_rowwise_grouped", "torch_bf16_grouped")


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


def _torch_grouped(x_fp8: torch.Tensor, x: torch.Tensor, w_fp8: torch.Tensor, w: torch.Tensor,
                   segment_rows: list[int]) -> dict[str, Callable[[], torch.Tensor]]:
    """torch's grouped GEMMs over ``x [rows, K]`` whose group g is the next ``segment_rows[g]`` rows, by name."""
    offs = torch.tensor(list(itertools.accumulate(segment_rows)), dtype=torch.int32, device=x.device)
    scale_a = torch.ones(x_fp8.shape[0], dtype=torch.float32, device=x.device)
    scale_b = torch.ones(w_fp8.shape[:2], dtype=torch.float32, device=x.device)
    w_fp8_t, w_t = w_fp8.transpose(-2, -1), w.transpose(-2, -1)  # [G, K, N] views: the layout both ops read
    return {
        "torch_fp8_rowwise_grouped": lambda: torch._scaled_grouped_mm(x_fp8, w_fp8_t, scale_a, scale_b, offs=offs,
                                                                      out_dtype=torch.bfloat16),
        "torch_bf16_grouped": lambda: torch._grouped_mm(x, w_t, offs=offs, out_dtype=torch.bfloat16),
    }


def _time(kind: str, shape: dict[str, int], fns: dict[str, Callable[[], Any]], flops: int, nbytes: int,
          check: Callable[[torch.Tensor], float], notes: list[str]) -> list[dict[str, Any]]:
    """A row per impl of ``fns`` (ours first); a baseline this torch build or GPU lacks becomes a note, and
    ours and the bf16 grouped GEMM are checked (``check``: diff against the bf16 product) before timing."""
    rows = []
    label = f"{kind} {'x'.join(map(str, shape.values()))}"
    for impl, fn in fns.items():
        try:
            res = fn()
            if impl in ("moe_fp8", "torch_bf16_grouped"):
                diff = check(res)
                if not diff < 1e-3:
                    notes.append(f"{impl} {label}: diff vs the bf16 product {diff:.2e} (> 1e-3)")
            rows.append(row(kind, shape, impl, bench_us(fn), flops, nbytes, bench_chilled_us(fn)))
        except Exception as e:  # a torch build or GPU without a baseline: record it, do not hide it
            if impl == "moe_fp8":
                raise
            notes.append(f"{impl} {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return rows


def _bytes(rows: int, groups_used: int, n: int, k: int) -> int:
    return rows * k + groups_used * n * k + rows * n * 2 + rows * (k // 128) * 4


def bench_contiguous(g: int, m: int, n: int, k: int, seed: int, notes: list[str]) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8.testing import make_contiguous_inputs
    from moe_fp8.utils import calc_diff

    inp = make_contiguous_inputs(g, m, n, k, seed=seed, device="cuda")
    out = torch.empty(inp.x_fp8.shape[0], n, device="cuda", dtype=torch.bfloat16)
    rows = sum(inp.group_sizes)
    shape = {"groups": g, "m_per_group": m, "n": n, "k": k}
    flops, nbytes = 2 * rows * n * k, _bytes(rows, sum(1 for s in inp.group_sizes if s), n, k)
    segments = [end - start for start, end in zip(inp.group_starts, [*inp.group_starts[1:], out.shape[0]],
                                                  strict=True)]
    valid = inp.m_indices >= 0
    ref = torch.empty_like(out)
    for gi, (start, size) in enumerate(zip(inp.group_starts, inp.group_sizes, strict=True)):
        ref[start:start + size] = inp.x[start:start + size] @ inp.w[gi].t()

    def ours():
        return moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices,
                                                   out=out)
    fns = {"moe_fp8": ours,
           "torch_blockwise_loop": _blockwise_loop(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                   list(zip(range(g), inp.group_starts, inp.group_sizes,
                                                            strict=True))),
           **_torch_grouped(inp.x_fp8, inp.x, inp.w_fp8, inp.w, segments)}
    return _time("grouped_contiguous", shape, fns, flops, nbytes,
                 lambda res: calc_diff(res[valid].float(), ref[valid].float()), notes)


def bench_masked(g: int, max_m: int, m: int, n: int, k: int, seed: int, notes: list[str]) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8.testing import make_masked_inputs
    from moe_fp8.utils import calc_diff

    inp = make_masked_inputs(g, max_m, m, n, k, seed=seed, device="cuda")
    out = torch.empty(g, max_m, n, device="cuda", dtype=torch.bfloat16)
    counts = inp.masked_m.tolist()
    rows = sum(counts)
    shape = {"groups": g, "max_m": max_m, "expected_m": m, "n": n, "k": k}
    flops, nbytes = 2 * rows * n * k, _bytes(rows, sum(1 for c in counts if c), n, k)
    # the valid rows, gathered for torch's grouped GEMMs, and the bf16 product of each group's
    valid = torch.cat([torch.arange(c, device="cuda") + i * max_m for i, c in enumerate(counts)])
    ref = torch.cat([inp.x[i, :c] @ inp.w[i].t() for i, c in enumerate(counts)])

    def ours():
        return moe_fp8.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, m,
                                               out=out)
    x2 = inp.x_fp8.view(g * max_m, k)
    s2 = torch.cat([inp.x_scale[i] for i in range(g)])  # loop baseline takes any layout; built once
    fns = {"moe_fp8": ours,
           "torch_blockwise_loop": _blockwise_loop(x2, s2, inp.w_fp8, inp.w_scale,
                                                   [(i, i * max_m, c) for i, c in enumerate(counts)]),
           **_torch_grouped(x2.view(torch.uint8)[valid].view(x2.dtype), inp.x.view(g * max_m, k)[valid], inp.w_fp8,
                            inp.w, counts)}

    def check(res: torch.Tensor) -> float:
        return calc_diff((res.view(g * max_m, n)[valid] if res.dim() == 3 else res).float(), ref.float())
    return _time("grouped_masked", shape, fns, flops, nbytes, check, notes)


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
            shape_rows = bench_contiguous(g, m, n, k, seed=g + n, notes=notes)
            dg = CONTIGUOUS_SHAPES.get(shape)
            notes.append(f"contiguous {g}x{m} {n}x{k}: ours {shape_rows[0]['tflops']} TF"
                         f" ({shape_rows[0]['chilled_tflops']} TF chilled)" + (f", DeepGEMM {dg} TF" if dg else ""))
            label = f"contiguous {g}x{m} {n}x{k}"
        else:
            shape_rows = bench_masked(*shape, seed=sum(shape), notes=notes)
            decode = shape in MASKED_DECODE_GBPS
            unit, metric = ("GB/s", "gbps") if decode else ("TF", "tflops")
            dg = MASKED_DECODE_GBPS.get(shape) if decode else MASKED_SHAPES.get(shape)
            notes.append(f"masked {shape}: ours {shape_rows[0][metric]} {unit} ({shape_rows[0]['chilled_' + metric]}"
                         f" {unit} chilled)" + (f", DeepGEMM {dg} {unit}" if dg else ""))
            label = f"masked {'x'.join(map(str, shape))}"
        rows += shape_rows
        if step is not None:
            step(label)
    return rows, notes


KIND = BenchKind(
    name="grouped",
    help="grouped contiguous (prefill) and masked (decode) GEMMs vs a per-group _scaled_mm loop and torch's FP8 / "
         "bf16 grouped GEMMs",
    tables={"grouped_contiguous": BASELINES, "grouped_masked": BASELINES},
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
