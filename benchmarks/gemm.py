"""``moe-fp8 bench gemm``: our FP8 GEMM against torch's block-scaled and per-tensor ``_scaled_mm``
and bf16 matmul, in one process, on the DeepSeek-V3 shape table (or given shapes)."""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import torch

from . import BenchKind, Step, parse_ints
from .harness import bench_chilled_us, bench_us, row
from .shapes import DEEPGEMM_GEMM_TFLOPS, GEMM_SHAPES

BASELINES = ("torch_blockwise", "torch_fp8_pertensor", "torch_bf16")


def make_inputs(m: int, n: int, k: int) -> dict[str, torch.Tensor]:
    """Random bf16 ``x [M, K]`` and ``w [N, K]`` and their FP8 forms, as every GEMM bench row uses them."""
    from moe_fp8 import reference as ref

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = ref.per_token_group_quant(x)
    w_fp8, w_scale = ref.per_block_quant(w)
    return {"x": x, "w": w, "x_fp8": x_fp8, "x_scale": x_scale, "w_fp8": w_fp8, "w_scale": w_scale}


def impls(t: dict[str, torch.Tensor], out: torch.Tensor) -> dict[str, Any]:
    """Our GEMM and the baselines on ``make_inputs``' tensors, as zero-argument callables by name."""
    import moe_fp8

    one = torch.ones((), device="cuda")
    # cuBLASLt block scaling wants scale_a column-major with stride (1, M) exactly (no TMA padding).
    x_scale_cm = t["x_scale"].t().contiguous().t()
    w_scale_t = t["w_scale"].t()
    return {
        "moe_fp8": lambda: moe_fp8.fp8_gemm(t["x_fp8"], t["x_scale"], t["w_fp8"], t["w_scale"], out=out),
        "torch_blockwise": lambda: torch._scaled_mm(t["x_fp8"], t["w_fp8"].t(), scale_a=x_scale_cm,
                                                    scale_b=w_scale_t, out_dtype=torch.bfloat16),
        "torch_fp8_pertensor": lambda: torch._scaled_mm(t["x_fp8"], t["w_fp8"].t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16),
        "torch_bf16": lambda: t["x"] @ t["w"].t(),
    }


class Block(NamedTuple):
    block_m: int
    block_n: int
    multicast: int
    multicast_on_a: bool
    num_stages: int | None  # None: as many as fit
    split_k: int


def parse_block(spec: str) -> Block:
    """'128x160' -> Block(128, 160, 1, False, None, 1); suffix 'b' / 'a': 2-CTA multicast of B / A;
    'k4': K split over a cluster of 4 CTAs; 's4': 4 pipeline stages (default: as many as fit)."""
    spec, _, stages = spec.lower().partition("s")
    spec, _, split = spec.partition("k")
    on = spec[-1] if spec[-1] in "ab" else ""
    bm, bn = (int(v) for v in spec.rstrip("ab").split("x"))
    return Block(bm, bn, 2 if on else 1, on == "a", int(stages) if stages else None, int(split) if split else 1)


def run(shapes: list[tuple[int, int, int]], sweep: list[Block] | None = None,
        step: Step | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Time every impl on every shape; returns JSON rows and notes (failures, sweep results).
    ``step(label)`` is called after each shape (progress)."""
    from moe_fp8.kernels.gemm import fp8_gemm_hopper
    from moe_fp8.kernels.heuristics import GemmDesc, get_config, make_config
    from moe_fp8.utils import calc_diff, get_num_sms

    rows, notes = [], []
    for m, n, k in shapes:
        t = make_inputs(m, n, k)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        shape = {"m": m, "n": n, "k": k}
        flops = 2 * m * n * k
        nbytes = m * k + n * k + 2 * m * n + 4 * (m * k // 128 + n * k // 16384)
        cfg = get_config(GemmDesc(m, n, k, num_sms=get_num_sms()))
        for impl, fn in impls(t, out).items():
            try:
                res = fn()
                if impl == "moe_fp8":
                    res = out
                # per-tensor FP8 with unit scales is a speed reference only (its values are unscaled)
                if impl not in ("torch_bf16", "torch_fp8_pertensor"):
                    diff = calc_diff(res.float(), (t["x"].float() @ t["w"].float().t()))
                    if diff > 1e-3:
                        notes.append(f"{impl} {m}x{n}x{k}: diff vs bf16 {diff:.2e} (> 1e-3)")
                us, chilled_us = bench_us(fn), bench_chilled_us(fn)
            except Exception as e:  # a baseline torch build may lack a mode; record, do not hide
                notes.append(f"{impl} {m}x{n}x{k}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            rows.append(row("gemm", shape, impl, us, flops, nbytes, chilled_us))
        mc = "" if cfg.multicast == 1 else f", multicast {'A' if cfg.multicast_on_a else 'B'}"
        mc += "" if cfg.split_k == 1 else f", K split over {cfg.split_k} CTAs"
        note = f"{m}x{n}x{k}: config block {cfg.block_m}x{cfg.block_n}, {cfg.num_stages} stages{mc}"
        if (m, n, k) in DEEPGEMM_GEMM_TFLOPS:
            ours = next(r for r in rows[::-1] if r["impl"] == "moe_fp8" and r["shape"] == shape)
            note += (f"; DeepGEMM {DEEPGEMM_GEMM_TFLOPS[(m, n, k)]} TF, ours {ours['tflops']} TF"
                     f" ({ours['chilled_tflops']} TF chilled, DeepGEMM's timing)")
        notes.append(note)
        for bm, bn, mc, on_a, st, sk in sweep or []:
            tag = f"{bm}x{bn}" + ("" if mc == 1 else "a" if on_a else "b") + ("" if sk == 1 else f"k{sk}")
            try:
                c = make_config(bm, bn, get_num_sms(), k=k, num_stages=st, multicast=mc, multicast_on_a=on_a,
                                split_k=sk)
                us = bench_us(lambda c=c, t=t, out=out: fp8_gemm_hopper(
                    t["x_fp8"], t["x_scale"], t["w_fp8"], t["w_scale"], out, config=c))
                notes.append(f"  sweep {m}x{n}x{k} block {tag} s{c.num_stages}: {us:.1f} us "
                             f"{flops / us / 1e6:.0f} TF")
            except Exception as e:
                notes.append(f"  sweep {tag}: {type(e).__name__}: {e}")
        if step is not None:
            step(f"{m}x{n}x{k}")
    return rows, notes


def parse_shape(text: str) -> tuple[int, int, int]:
    """``'M,N,K'``, refused up front where the kernels' alignment rules (moe_fp8.validation) fail."""
    m, n, k = parse_ints(text, 3, "M,N,K")
    if n % 8 or k % 16:
        raise ValueError(f"shape {text!r}: N must be a multiple of 8 and K of 16 (got N={n}, K={k})")
    return m, n, k


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", nargs="+", default=[], type=parse_block, metavar="BMxBN[a|b][kK][sS]",
                   help="block shapes to time as well: BMxBN, suffix a/b for 2-CTA multicast of A/B, "
                        "kK to split K over K CTAs, sS stages")


def _run(shapes: list[tuple[int, ...]], args: argparse.Namespace, step: Step) -> tuple[list[dict[str, Any]], list[str]]:
    return run(shapes, getattr(args, "sweep", None), step)  # type: ignore[arg-type]


KIND = BenchKind(
    name="gemm",
    help="fp8_gemm vs torch block-scaled / per-tensor _scaled_mm and bf16 matmul",
    tables={"gemm": BASELINES},
    default_shapes=lambda: list(GEMM_SHAPES),
    parse_shape=parse_shape,
    shape_help="M,N,K",
    run=_run,
    add_args=_add_args,
)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_fp8.benchmarks.gemm ARGS`` = ``moe-fp8 bench gemm ARGS``."""
    from moe_fp8.cli import main as cli_main

    return cli_main(["bench", "gemm", *(argv or [])])


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
