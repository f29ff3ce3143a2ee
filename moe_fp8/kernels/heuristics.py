"""Kernel configuration: a pure function from a problem descriptor to a launch configuration.

Runs on the CPU (CI tests it without a GPU). ``MOE_FP8_JIT_DEBUG=1`` prints each descriptor and
the configuration chosen for it, once.

The cost model, in nanoseconds on one H100 SXM SM (calibration in docs/kernels/gemm.md):
- tensor-core time of a tile: BLOCK_M·BLOCK_N·K MACs at ~5.7k FP8 MAC/ns/SM (≈1500 TFLOPS chip-wide,
  the power-limited rate DeepGEMM reaches), derated for narrow wgmma (N < 64 issue overhead);
- load time of a tile: (BLOCK_M + BLOCK_N)·K bytes through one SM's share of L2 bandwidth (~50 B/ns,
  the plateau measured at M = 4096: every block shape stalled near 6.6 TB/s aggregate); a 2-CTA
  multicast halves the shared operand's part;
- DRAM time of a wave: the distinct A rows and B columns its tiles touch (the swizzled order keeps
  them to a band of ``swizzle_group_m`` m-blocks) at ~3 TB/s;
- each wave costs the largest of the three plus a fixed epilogue/drain cost.
Ties go to fewer tiles, then to the larger BLOCK_N.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Literal

from ..utils import align, ceil_div

Layout = Literal["normal", "contiguous", "masked"]

BLOCK_K = 128
MAX_SMEM_BYTES = 232448  # 227 KiB of opt-in dynamic shared memory per block on sm_90
BARRIER_BYTES = 8
MMA_MACS_PER_NS = 5700.0
L2_BYTES_PER_NS_PER_SM = 50.0
DRAM_BYTES_PER_NS = 3000.0
TILE_FIXED_NS = 150.0
SWIZZLE_GROUP_M = 16
BLOCK_MS = (64, 128)
BLOCK_NS = tuple(range(16, 161, 8))


@dataclasses.dataclass(frozen=True)
class GemmDesc:
    """What the heuristic knows about one call: rows (total, or per group when masked), N, K, groups."""

    m: int
    n: int
    k: int
    num_groups: int = 1
    layout: Layout = "normal"
    num_sms: int = 132
    expected_m: int | None = None  # masked only: rows per group the caller expects


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Everything a kernel variant bakes in or is launched with (one source for host and device)."""

    block_m: int
    block_n: int
    num_stages: int
    swizzle_group_m: int
    num_sms: int
    smem_bytes: int
    multicast: int = 1  # CTAs per cluster sharing one TMA load (normal layout only)
    multicast_on_a: bool = False  # share A (same m-block, n-block pair) instead of B

    @property
    def num_math_threads(self) -> int:
        return self.block_m // 64 * 128

    @property
    def num_threads(self) -> int:
        return self.num_math_threads + 128  # + one producer warpgroup


def staging_tile_bytes(block_m: int, block_n: int) -> int:
    """Epilogue staging tile: bf16 rows padded by 16 bytes (mirrors epi::StagingTile)."""
    return block_m * (block_n * 2 + 16)


def smem_bytes(block_m: int, block_n: int, num_stages: int) -> int:
    """Dynamic shared memory of one variant (mirrors GemmSmem in impls/fp8_gemm.cuh, which
    static_asserts that the value passed here covers its layout)."""
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4
    return num_stages * per_stage + staging_tile_bytes(block_m, block_n) + 2 * num_stages * BARRIER_BYTES


def straddle_ok(block_n: int) -> bool:
    """A tile may touch at most two 128-column weight-scale blocks."""
    return block_n <= 128 + math.gcd(block_n, 128)


def max_stages(block_m: int, block_n: int) -> int:
    fixed = staging_tile_bytes(block_m, block_n)
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4 + 2 * BARRIER_BYTES
    return (MAX_SMEM_BYTES - fixed) // per_stage


def _wave_ns(block_m: int, block_n: int, k: int, active: int, m_blocks: int, multicast: int = 1,
             on_a: bool = False) -> float:
    mma = block_m * block_n * k / MMA_MACS_PER_NS * max(1.0, 64 / block_n) ** 0.5
    shared = block_m if on_a else block_n
    l2 = (block_m + block_n - shared * (1 - 1 / multicast)) * k / L2_BYTES_PER_NS_PER_SM
    band = min(m_blocks, SWIZZLE_GROUP_M, active)
    dram = (band * block_m + ceil_div(active, band) * block_n) * k / DRAM_BYTES_PER_NS
    return max(mma, l2, dram) + TILE_FIXED_NS


def _rows_per_group(desc: GemmDesc) -> int:
    return desc.expected_m if desc.layout == "masked" and desc.expected_m else desc.m


def num_tiles(desc: GemmDesc, block_m: int, block_n: int, multicast: int = 1, on_a: bool = False) -> int:
    """Tiles the kernel runs (a multicast pair past the matrix still runs; masked: from expected_m)."""
    m_blocks = ceil_div(_rows_per_group(desc), block_m)
    n_blocks = ceil_div(desc.n, block_n)
    if on_a:
        n_blocks = align(n_blocks, multicast)
    else:
        m_blocks = align(m_blocks, multicast)
    return (desc.num_groups if desc.layout == "masked" else 1) * m_blocks * n_blocks


def estimate_ns(desc: GemmDesc, block_m: int, block_n: int, multicast: int = 1,
                on_a: bool = False) -> tuple[float, int]:
    """Model time and tile count of one candidate (see the module docstring)."""
    tiles = num_tiles(desc, block_m, block_n, multicast, on_a)
    m_blocks = ceil_div(_rows_per_group(desc), block_m)
    full_waves, last = divmod(max(tiles, 1), desc.num_sms)
    ns = full_waves * _wave_ns(block_m, block_n, desc.k, desc.num_sms, m_blocks, multicast, on_a)
    if last:
        ns += _wave_ns(block_m, block_n, desc.k, last, m_blocks, multicast, on_a)
    return ns, tiles


def candidates(desc: GemmDesc) -> list[tuple[int, int, int, bool]]:
    """(block_m, block_n, multicast, multicast_on_a) valid for the descriptor; rejected ones, and why:
    - block_n must keep a tile within two weight-scale blocks (``straddle_ok``);
    - block_n beyond N adds only zero columns;
    - block_m 128 for fewer than 65 rows per group only adds zero rows;
    - contiguous layout: block_m must divide the 128-row segment alignment (both do);
    - multicast: normal layout only (a grouped pair could span two experts), at least two blocks
      along the paired dimension, and 16-row halves (1024-byte aligned in shared memory).
    """
    rows = _rows_per_group(desc)
    out = []
    for bm in BLOCK_MS:
        if bm == 128 and rows <= 64:
            continue
        for bn in BLOCK_NS:
            if not straddle_ok(bn):
                continue
            if bn > desc.n and bn != BLOCK_NS[0] and bn - 8 >= desc.n:
                continue
            out.append((bm, bn, 1, False))
            if desc.layout != "normal" or desc.num_sms % 2:
                continue
            if ceil_div(rows, bm) >= 2 and bn % 16 == 0:
                out.append((bm, bn, 2, False))
            if ceil_div(desc.n, bn) >= 2:
                out.append((bm, bn, 2, True))
    return out


def make_config(block_m: int, block_n: int, num_sms: int, num_stages: int | None = None, multicast: int = 1,
                multicast_on_a: bool = False, swizzle_group_m: int = SWIZZLE_GROUP_M) -> GemmConfig:
    """A configuration for an explicit block shape (tests and benchmark sweeps); stages default to
    as many as fit."""
    if block_m not in BLOCK_MS or block_n % 8 or not 8 <= block_n <= 256 or not straddle_ok(block_n):
        raise ValueError(f"unsupported block shape {block_m}x{block_n}")
    if multicast not in (1, 2) or (multicast == 2 and (block_m if multicast_on_a else block_n) % 16):
        raise ValueError(f"unsupported multicast {multicast} (on {'A' if multicast_on_a else 'B'}) "
                         f"for block {block_m}x{block_n}")
    stages = max_stages(block_m, block_n) if num_stages is None else num_stages
    if not 2 <= stages <= max_stages(block_m, block_n):
        raise ValueError(f"block {block_m}x{block_n} fits 2..{max_stages(block_m, block_n)} stages, got {stages}")
    return GemmConfig(block_m=block_m, block_n=block_n, num_stages=stages, swizzle_group_m=swizzle_group_m,
                      num_sms=num_sms, smem_bytes=smem_bytes(block_m, block_n, stages), multicast=multicast,
                      multicast_on_a=multicast_on_a and multicast > 1)


@functools.cache
def get_config(desc: GemmDesc) -> GemmConfig:
    """Pick the cheapest candidate under the cost model; then as many pipeline stages as fit."""
    best = None
    for cand in candidates(desc):
        ns, tiles = estimate_ns(desc, *cand)
        key = (round(ns, 3), tiles, -cand[1], cand[2])
        if best is None or key < best[0]:
            best = (key, cand)
    if best is None:
        raise ValueError(f"no kernel configuration fits {desc}")
    bm, bn, mc, on_a = best[1]
    cfg = make_config(bm, bn, desc.num_sms, multicast=mc, multicast_on_a=on_a)
    if os.environ.get("MOE_FP8_JIT_DEBUG", "0") not in ("", "0"):
        print(f"[moe_fp8] {desc} -> {cfg}")
    return cfg
