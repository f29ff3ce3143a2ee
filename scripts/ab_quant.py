"""A/B of ``per_token_group_quant`` on the GPU: the CUDA kernel (kernels/quant.py) by launch knobs against the
Triton kernel (its default tiles and the H200's wide ones), each checked bit for bit against the Triton kernel's
output, and a copy of the same bytes in the same process. CUDA-graph replays, L2 flushed (``do_bench``), rounds
alternated; µs and the copy's time over ours. ``--silu``: ``silu_mul_per_token_group_quant`` of ``[M, 2I]`` inputs
(shapes ``MxI2``) instead, its CUDA outputs checked against the Triton kernel's within one code step.

    python3 scripts/ab_quant.py [--silu] [--shapes 16384x7168 ...] [--knobs 8,1024,1 16,1024,1 ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe_data import _graph_replay
from moe_fp8.kernels import quant as cuda_quant
from moe_fp8.kernels.triton import quant as triton_quant
from moe_fp8.kernels.triton.configs import quant_config
from moe_fp8.utils import get_num_sms

SHAPES = ["16384x7168", "4096x7168", "1024x7168", "128x7168", "16384x2048", "8192x16384", "4096x1536"]
KNOBS = ["8,1024,1", "8,512,2", "8,1024,2", "4,1024,1", "4,512,2", "16,1024,1", "16,512,2"]


def graph_us(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(_graph_replay(fn), warmup=5, rep=40, return_mode="median")) * 1e3


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor], silu: bool) -> bool:
    """Bit for bit (NaN = NaN); ``silu``: scales within 2^-18 and codes within one step, as check_silu_close."""
    qa, sa = a
    qb, sb = b
    ca, cb = qa.view(torch.uint8).int(), qb.view(torch.uint8).int()
    nan = sa.isnan() & sb.isnan()
    if silu:
        codes = bool((((ca & 0x80) == (cb & 0x80)) & ((ca & 0x7F) - (cb & 0x7F)).abs().le(1)).all())
        return codes and bool(((sa - sb).abs() <= 2.0**-18 * sb.abs()).logical_or(nan).logical_or(sa == sb).all())
    return torch.equal(ca, cb) and bool(((sa == sb) | nan).all())


def run_shape(shape: str, dtype: torch.dtype, ue8m0: bool, knobs: list[str], rounds: int, silu: bool) -> None:
    m, k = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    x[0, :7] = float("nan") if m > 2 else 0.0
    x[min(1, m - 1), 200:203] = float("inf")
    x[-1, 130:140] = -0.0
    n_out = k // 2 if silu else k
    kg = n_out // 128
    default = quant_config(m, kg, 128, silu=silu, wide=False)
    wide = quant_config(m, kg, 128, silu=silu, wide=True)
    if silu:
        cands = {
            "triton": lambda: triton_quant.silu_mul_per_token_group_quant(x, 128, ue8m0, None, 1e-10, config=default),
            "triton_wide": lambda: triton_quant.silu_mul_per_token_group_quant(x, 128, ue8m0, None, 1e-10,
                                                                               config=wide),
        }
    else:
        cands = {
            "triton": lambda: triton_quant.per_token_group_quant(x, 128, ue8m0, 1e-10, config=default),
            "triton_wide": lambda: triton_quant.per_token_group_quant(x, 128, ue8m0, 1e-10, config=wide),
        }
    cuda = cuda_quant.silu_mul_per_token_group_quant_hopper if silu else cuda_quant.per_token_group_quant_hopper
    for knob in knobs:
        lanes, threads, bps = (int(v) for v in knob.split(","))
        args = (x, 128, ue8m0, None, 1e-10) if silu else (x, 128, ue8m0, 1e-10)
        cands[f"cuda l{lanes} t{threads} b{bps}"] = (
            lambda args=args, kw=dict(lanes=lanes, threads=threads, blocks_per_sm=bps): cuda(*args, force=True, **kw))
    want = cands["triton"]()
    for name, fn in cands.items():
        if not same(fn(), want, silu):
            print(f"{shape} {name}: OUTPUT DIFFERS from the Triton kernel's")
    nbytes = m * k * dtype.itemsize + m * n_out + m * kg * 4
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float16)  # the same bytes moved (read + write)
    dst = torch.empty_like(src)
    cands["copy"] = lambda: dst.copy_(src)
    times = time_rounds(cands, rounds)
    copy = min(times["copy"])
    print(f"\n## {shape}: {nbytes / 1e6:.1f} MB, copy {copy:.2f} us ({nbytes / copy / 1e3:.0f} GB/s)")
    report(times, nbytes, 34)


def time_rounds(cands: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """``graph_us`` of every candidate, ``rounds`` times, the candidates alternated within a round."""
    times: dict[str, list[float]] = {n: [] for n in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            times[name].append(graph_us(fn))
    return times


def report(times: dict[str, list[float]], nbytes: int, width: int) -> None:
    """A line a candidate: its best µs, every round's, GB/s and the ``copy`` candidate's time over its."""
    copy = min(times["copy"])
    for name, ts in times.items():
        best = min(ts)
        print(f"{name:{width}s} {best:8.2f} us  [{' '.join(f'{t:.2f}' for t in ts)}]  {nbytes / best / 1e3:6.0f} GB/s"
              f"  of copy {copy / best:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--knobs", nargs="*", default=KNOBS, help="lanes,threads,blocks_per_sm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ue8m0", action="store_true")
    ap.add_argument("--silu", action="store_true", help="SiLU·mul + quant of [M, 2I] (shapes MxI2)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"# {torch.cuda.get_device_name()}, {get_num_sms()} SMs, {args.dtype}, ue8m0={args.ue8m0}, silu={args.silu}")
    for shape in args.shapes:
        run_shape(shape, dtype, args.ue8m0, args.knobs, args.rounds, args.silu)


if __name__ == "__main__":
    main()
