"""Kernel configuration: a pure function from a problem descriptor to a launch configuration.

Runs on the CPU (CI tests it without a GPU). ``MOE_FP8_JIT_DEBUG=1`` prints each descriptor and
the configuration chosen for it, once.

Cost model, calibrated on one H100 SXM (docs/kernels/gemm.md has the measurements):
- every CTA walks its tiles' 128-K blocks at ~``250 + BLOCK_M + BLOCK_N`` ns per block — the load
  pipeline, not the tensor cores, sets this rate (the kernel with its wgmmas removed runs at the
  same speed), so small tiles are not much cheaper per block than large ones; only the 128x256
  tile is bound by its math (~870 ns per block: wgmma plus promotion of 2 x 128 x 256 x 128 FLOP),
  and the 128x192 one too, at 15% more per element than 128x256 (its two 96-column waves; 10% in masked
  GEMMs, where 15% measured mixed);
- but a wave is never faster than DRAM can deliver the distinct A rows and B columns its tiles
  touch per 128-K block (the swizzled order keeps them to a band of ``SWIZZLE_GROUP_M`` m-blocks) at
  ~2.9 TB/s — this is what decides memory-bound small-M shapes;
- a launch costs the sum of its waves (the last one usually partial), plus a fixed epilogue per tile;
- ties go to fewer tiles, then to the wider BLOCK_N.
Normal GEMMs of at most 128 rows, few-group masked ones at K = 2048 and many-group decode ones, on 132 SMs
whose tile was measured (``SMALL_M_BLOCK_N``, ``MASKED_MEASURED_TILES``, ``MASKED_DECODE_TILES``,
``MASKED_DECODE_WIDE_TILES``, ``CONTIGUOUS_ONE_BLOCK_TILES``), skip the model.
Where a table of ``moe-fp8 tune`` (``tuning``) has a measured configuration for a call, ``get_config`` takes that
instead; ``default_config`` is this module's own choice.
Measured, and therefore fixed rather than modelled: 4 pipeline stages with two math warpgroups
(5 was 4-5% slower: more loads in flight spread the CTAs over K and cost L2 hits) but where a normal
GEMM's tiles fit in one wave (then all that fit: 4-10% faster, see ``TWO_WG_STAGES``), all that fit
with one; no tile straddling two weight-scale blocks with two math warpgroups (the per-column
scale select costs as much as the promotion) but 128x96 / 128x144 / 128x160 in normal GEMMs, where their count
fits the waves (``STRADDLE_128_BLOCK_NS``); 2-CTA multicast off (measured no faster here).
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
K_BLOCK_BASE_NS = 250.0  # per 128-K block of one CTA: fixed part ...
K_BLOCK_NS_PER_ROW = 1.0  # ... plus this per row of A and B in the tile
MMA_NS_PER_ELEM = 870.0 / (128 * 256)  # ... but never below the tensor-core + promotion rate (128x256)
# 128x192 tiles run their math slower per element than 128x256 ones: by 10% in session 12 (measured ~730 ns per
# block on 4096x2112x7168; the model had 652), which a factor of 1.12 found (H100, same process, 23 shapes it moved
# off 192): normal 24576x1536, 32768x512, 7168x{16384, 2048, 256} and 4096x7168 at 1280-13696 rows 8-41% faster;
# N = 2112: 3840 rows (to 128x128) 0.98, 8192 rows 0.96, 14336 rows 1.05; contiguous 0.996 / 1.02; masked 1 x 1024
# at 4096x7168 +13-27% on 4 draws, 2 x 512 +17 / +5 / -3 / -3%. So masked GEMMs keep 1.10: in session 47 the 22
# masked GEMMs of 1-8 groups that 1.15 would move measured 10 slower by 3-14%, 9 faster by 2-20% (H100, chilled).
MMA_192_FACTOR_MASKED = 1.10
# Session 47 (H100, same process, alternated rounds, new / old time as do_bench / chilled geomean): at 1.15, 25
# normal GEMMs at 448-30720 rows that it moves off 128x192 0.956 / 0.951 (to 128x256 at 7168x{2048, 16384, 18432} x
# 2368-3072 rows 4-11% faster, 36864x7168 x 448-512 5-7%, 4608x4096x7168 9%, 1536x7168 x 11776-14336 4-7%,
# 24576x1536 x 704-896 1.5-4.4%, 2112x7168 x 8192-30720 +3.8% to -4.3%; to 128x144 at 576x7168 x 24064-29184 even to
# 3% faster; 9728x2112x7168 to 128x128 6% slower); 4 more at K = 3072-5120 6-10% faster; 21 contiguous ones of 2-16
# groups (the down projections 7168 x {256-2048} and gate-up ones 2048-4096 x 7168) 0.925 / 0.923, none slower. 1.2
# also moved 576 / 2112 x 7168 at 2688-30208 rows onto 128x128, up to 25% slower.
MMA_192_FACTOR = 1.15
TILE_FIXED_NS = 200.0  # epilogue and pipeline refill per tile
DRAM_BYTES_PER_NS = 2900.0
# CTAs of one wave reading the same A rows (small M: all of them) share L2 lines: together they are
# fed at ~3.9 KB/ns (64x56 tiles on 128 CTAs: 495 ns per block; 64x128 on 56 CTAs: 457 ns).
SHARED_A_BYTES_PER_NS = 3900.0
# A one-warpgroup tile straddling weight-scale blocks pays a column select in its promotion:
# ~100 ns per block (64x112: 533 vs 64x128: 464 ns), twice that when the split takes > 8 values.
STRADDLE_NS = 100.0
# ... but one of at most OVERLAP_MAX_BLOCK_N columns overlaps its promotion with the next block's wgmmas (two
# accumulator sets, impls/fp8_gemm.cuh kOverlap), which hides most of the select. Session 47 sweep (H200, one
# wave of 64-row tiles at 384-2048 rows, K = 7168, µs per 128-K block): 64x72 / 80 / 88 / 96 318-355 against
# 64x128's 345-350, not the 30-35% more that STRADDLE_NS charges; 64x96 was already so in session 45 (H100).
# H100 A/B (new / old pick, chilled): normal GEMMs at K = 7168 (13 shapes) 0.87-0.96, at K = 1024-5120 (12) 0.84-0.94;
# contiguous ones of 1-8 groups of 128-384 rows (9) 0.76-0.98 (8 x 128 rows at 576x7168: 30.3 -> 23.0 us). It moves
# no masked pick (their 64-row tiles are measured: MASKED_DECODE_TILES).
OVERLAP_MAX_BLOCK_N = 96
OVERLAP_STRADDLE_NS = 25.0
# Straddling widths of 128-row tiles the model may pick, for normal GEMMs only, and their charge per block.
# 144 / 160, session 45 sweep (H100, normal GEMMs of DeepSeek-V3's nine linears at 256-2048 rows,
# docs/kernels/gemm.md): where a wave count fits them better (1280x4096x7168: 260 tiles of 128x160 in two waves
# against 220 of 128x192), they ran up to 21% faster than the model's picks, and with them the model's picks came
# within 3% of the best of 18 tiles on 72 of 81 shapes (67 before); of 23 shapes off that grid whose pick it
# changed, 20 ran 2-23% faster and two 5-8% slower (the old 192 / 256-wide tiles' last wave ran as halves, which
# the model leaves out). 96, session 47 sweep (H200): one wave of 128x96 (N = 1536 / 2112 / 576 at 640-2048 rows:
# 96-132 tiles where 128x128 makes 72-102) walks a 128-K block in 420-457 ns against 128x128's 452-477; 128x80
# and 128x112 measured no faster than 128x128. Grouped layouts were not measured with them.
# The two session-47 rules, A/B on an H100 (26 shapes at K = 7168 whose pick they change, old and new tile
# alternated, chilled µs): 25 ran 3.8-13.4% faster (384x1536 18.9 -> 16.3, 768x2112 26.3 -> 24.2, 2048x576
# 26.1 -> 23.6), one 4% slower (2304x512: 128x96's six n-blocks against 128x128's four, 25.7 -> 26.7). At K = 1024-5120
# (7 shapes of 256-8192 columns) 128x96 measured +7% to -5% sustained, +5% to -5% chilled: its ~5% per block pays
# only over a long K, so it is offered from STRADDLE_128_MIN_K_BLOCKS blocks (the 64-row rule gained there too:
# 12 shapes 6-16% faster chilled).
STRADDLE_128_BLOCK_NS = {96: 25.0, 144: STRADDLE_NS, 160: STRADDLE_NS}
STRADDLE_128_MIN_K_BLOCKS = {96: 56}
# Masked layout: expected_m is typical, not exact. The estimate averages MASKED_DRAWS draws of every
# group's m-blocks, each group's an independent multiple in [lo, hi] of expected_m's (a fixed
# low-discrepancy set, so the choice is deterministic): with several groups the total tile count, which
# decides the waves, varies less than one group's.
MASKED_SPREAD = (0.7, 1.3)
MASKED_DRAWS = 8
SWIZZLE_GROUP_M = 16
TWO_WG_STAGES = 4
# Normal GEMMs of one wave of 128-row tiles take every stage that fits, not TWO_WG_STAGES: each CTA runs one tile, so
# no CTA drifts ahead over K, and more loads in flight shorten the start. Session 44 (H100, one process, 3 rounds,
# kernel durations after an 8 GB memset, 4 stages -> all): 512x4096x7168 on 128x128 30.1 -> 28.4 us,
# 256x7168x2048 12.9 -> 12.2, 256x7168x16384 64.2 -> 60.5, 805x2112x7168 27.6 -> 26.5, 512x2112x7168 on 128x64
# 21.4 -> 19.4 (7 of 8 stages 19.3). With three tiles a CTA the gain fades or turns: 805x7168x2048 24.6 -> 24.1,
# 805x7168x16384 196.6 -> 202-205.
BLOCK_MS = (64, 128)
BLOCK_NS = (*range(16, 161, 8), 192, 256)  # 192 / 256: two 96 / 128-column waves per smem stage
WAVE_BLOCK_NS = (192, 256)
# Split-K over a cluster: make_config builds it, the heuristic never picks it. On an H100 (session 7,
# docs/kernels/gemm.md) no split beat the best unsplit tile by more than 2%, and a cost model that
# offered it under one wave lost up to 41% (128x7168x2048 on 128x256k4).
SPLIT_KS = (1, 2, 4)
# A last wave split into K pieces (sched::TailSplit, epilogue/k_split.cuh): pieces per tile at most
# (kMaxPieces), 128-K blocks per piece at least (kMinPieceBlocks: at K = 2048, 8-block pieces ran 8% slower
# than tile halves, at K = 7168 14-block pieces up to 11% faster), and the cost of adding the FP32 partials
# through L2. The model counts whole-tile pieces, as calibrated in session 11; since session 27 the kernel
# splits tile halves instead where two pieces per half fit (1206 x 4096 x 7168 on an H100: 69.8 -> 66.6 us).
# With that kernel the model's picks stayed the best tile tried, or within 1% of it, on 5 small-M masked shapes,
# while two models of the halves' pieces moved 22-68 small-M choices and lost up to 8% on 2 of those 5
# (session 27, docs/kernels/gemm.md).
K_SPLIT_MAX_PIECES = 4
K_SPLIT_MIN_PIECE_BLOCKS = 12
K_SPLIT_FIXUP_NS = 3000.0
# The masked scheduler counts its tiles (which the last wave's split needs) for up to this many groups of
# 128-row tiles and for any number of 64-row ones (sched::MaskedScheduler::kMaxCountedGroups).
MASKED_COUNTED_GROUPS_128 = 8
# The cost model counts the K pieces where they were calibrated (session 11: up to 8 groups, plain epilogue);
# the kernels split wherever a last wave fits them (the fused epilogue and 64-row tiles of any group count
# too), leaving the tile choices elsewhere as measured.
K_SPLIT_MODEL_MAX_GROUPS = 8
# Measured small-M tiles, not modelled: normal layout, 132 SMs, keyed by (N, K) and then by m-blocks of 64
# rows (1: M <= 64, 2: M <= 128) -> BLOCK_N of a 64-row tile (as many stages as fit). Session 18 sweep (H100
# SXM, 64 x {16..256} and 128 x {128, 256} tiles, one process, do_bench, two rounds; docs/kernels/gemm.md):
# only the shapes where the model's pick ran > 3% behind the best tile. At small M every 64-row tile of one
# wave walks a 128-K block in ~270-320 ns whatever its width (the model charges 250 ns + 1 ns per row,
# + 100 ns when it straddles scale blocks), so the model cannot rank them; it stays in charge elsewhere.
# Session 24 re-swept them after the 64-row tiles of at most 96 columns stopped having their wgmmas serialised
# by ptxas (impls/fp8_gemm.cuh, kOverlapChunk), which had made them 10-30% slower: the model's own picks
# (64x32 for 2112x7168 at 128 rows, 64x64 for 4096x7168) now run best, and two entries are new.
SMALL_M_BLOCK_N: dict[tuple[int, int], dict[int, int]] = {
    (2112, 7168): {1: 16},  # the model's 64x32 15.5 us -> 14.8 (session 18's 64x48: 19.1)
    (24576, 1536): {1: 96, 2: 128},  # 64x256 24.9 -> 23.5; 128x256 26.2 -> 24.3
    (32768, 512): {1: 128, 2: 128},  # 64x256 15.1 / 16.1 -> 14.3 / 15.5
    (7168, 2048): {1: 64},  # the model's 64x128 13.8 us -> 12.5
}
SMALL_M_SMS = 132
# Measured masked tiles, not modelled: (N, K) -> (BLOCK_N, stages) of a 128-row tile for masked GEMMs of up to
# MASKED_MEASURED_MAX_GROUPS groups of MASKED_MEASURED_ROWS expected rows on 132 SMs. Session 19 sweep
# (H100 SXM, one process, do_bench best of 3 rounds, 4 draws each of 1 x 1024, 2 x 512 and 4 x 256 rows,
# docs/kernels/gemm.md): 128x128 with 5 stages took 1.6 / 2.2 / 5.3% less time over the draws than the
# model's 128x256 (128x192 at 4 x 256). At K = 2048 a few waves of 128x128 tiles run at ~440 ns per 128-K
# block, where the model, calibrated on long-running GEMMs, charges 506; at K = 7168 the model's 128x256
# stays ahead (measured too).
MASKED_MEASURED_TILES: dict[tuple[int, int], tuple[int, int]] = {(7168, 2048): (128, 5)}
MASKED_MEASURED_MAX_GROUPS = 4
MASKED_MEASURED_ROWS = (256, 1024)  # (at 4096 rows, many waves, 128x256 leads at K = 2048: session 18)
# Measured decode tiles: (N, K) -> (BLOCK_N, stages) of a 64-row tile for masked GEMMs of at least
# MASKED_DECODE_MIN_GROUPS groups of at most MASKED_DECODE_MAX_ROWS expected rows on 132 SMs (an EP rank's
# experts at decode). Session 20 sweeps (H100 SXM, one process, do_bench best of 5-7 rounds,
# docs/kernels/gemm.md): 64x128 with 4 stages streamed the weights 1.5-3.0% faster than the model's 64x256 at
# 4-48 expected rows of 32 groups, 1.1-3.1% at 4 and 32 rows of 64-256 groups. At 64 expected rows, where the
# draws (0.7-1.3x) put a third to two thirds of the groups over one 64-row block, it ran 0.5-2.7% slower on
# the bench's draws, and with 8-16 groups up to 8.6% slower: hence both bounds (48 keeps every draw within one
# block). With only 1-24 of 32 groups holding rows (sparse decode, which expected_m does not tell) it was up
# to 18% faster in 7 of 10 grids and 4.4% slower in one. Memory-bound tiles: the model cannot rank them.
MASKED_DECODE_TILES: dict[tuple[int, int], tuple[int, int]] = {(4096, 7168): (128, 4), (7168, 2048): (128, 4)}
MASKED_DECODE_MIN_GROUPS = 32
MASKED_DECODE_MAX_ROWS = 48  # a boundary of representative_rows: the rule reads expected_m before config_key
# Above that, up to MASKED_DECODE_WIDE_MAX_ROWS expected rows (most draws need two 64-row blocks), a 128-row tile
# reads each expert's weights once: (N, K) -> (BLOCK_N, stages) of a 128-row tile, same group bound. Session 24
# (H100 SXM, one process, kernel durations and do_bench, 3 rounds): 128x128 with 4 stages streamed the weights
# up to 4.0% faster than the model's 64x256 at 64 expected rows (32 groups: two draws each; 64 and 128 groups:
# -0.3% to +1.8%) and 1.3-3.6% faster than its 128x256 at 80-96 rows (32-128 groups), on both expert shapes.
MASKED_DECODE_WIDE_TILES: dict[tuple[int, int], tuple[int, int]] = {(4096, 7168): (128, 4), (7168, 2048): (128, 4)}
MASKED_DECODE_WIDE_MAX_ROWS = 96  # a boundary of representative_rows too
# Contiguous layout, groups the caller expects to hold about one 128-row block each (``expected_m`` at most
# CONTIGUOUS_ONE_BLOCK_MAX_ROWS: a sync-free prefill of an EP rank, ~T·top_k/E rows an expert, where M_total is only
# an upper bound): the tiles are walked N-fastest (swizzle_group_m 1), so the CTAs in flight stream adjacent weight
# rows of one expert rather than the same columns of 16 experts. Session 34 (H100, the bench layer's 32 local
# experts, kernel durations after a flush, 128x256 tiles, swizzle 16 -> 1): 512-2048 tokens (16-64 expected rows)
# the fused GEMM1 (4096x7168) 364-370 -> 348-351 us, GEMM2 (7168x2048) 205-207 -> 197 (2 / 4 / 8: in between); at
# 4096 tokens (128 rows, two blocks) 386.7 -> 391.6 and 221.2 -> 229.2, from 8192 on slower still, as on the grouped
# bench's shapes (32 x 256 rows 513.7 -> 566.3 at 4096x7168): there the swizzle's shared weight columns pay.
# 64-row tiles, which skip a short segment's padding half, ran GEMM2 6% faster on uniform loads (185 us) and GEMM1
# no faster; but an expert past 64 rows needs a second block, and with lognormal loads (one to five of 32 experts
# past 64 rows) they ran GEMM1 7-20% and GEMM2 up to 9% slower than 128-row tiles, which stayed within 1.5%.
CONTIGUOUS_ONE_BLOCK_MAX_ROWS = 64
# Measured tiles of that class, not modelled: (N, K) -> (BLOCK_N, stages) of a 128-row tile, walked N-fastest, on
# 132 SMs. Session 35 (H100, 32 experts, kernel durations after a flush, 16-64 expected rows, uniform and lognormal
# loads up to 171 rows an expert): 128x128 with 4 stages ran GEMM2 (7168x2048) in 191.7-197.5 us against 196.9-204.7
# for the model's 128x256 (3 stages), the best of 8 tiles and bands tried, as MASKED_DECODE_WIDE_TILES at decode;
# since the tiles store no padding rows, 177.7-193.3 against 181.7-200.0.
# Only where M_total holds a 128-row block a group or more, as measured: a layout of fewer blocks (an exact one of a
# few touched experts) keeps the model's tile, down to 64-row ones under a wave.
CONTIGUOUS_ONE_BLOCK_TILES: dict[tuple[int, int], tuple[int, int]] = {(7168, 2048): (128, 4)}

# Grouped layouts whose tiles are mostly padding: A is loaded as boxes of PARTIAL_A_BOX_ROWS, only those up to a
# group's last rows (the padding rows' results are never stored; the math runs them on stale shared memory). Contiguous:
# the one-block class (a tile's real rows are found by reading m_indices at 32-row steps) with K of PARTIAL_A_MIN_K or
# more; masked: 64-row tiles (the decode ones; masked_m gives the rows). Session 36 (H100, same process, chilled, us):
# - EP 8 (32 experts, 16 / 64 rows): fused GEMM1 343.1 -> 333.2 / 347.2 -> 341.0, GEMM2 177.6 -> 173.0 / 183.6 -> 181.2;
# - TP 8 / 4 / 2 (256 experts, 8 / 16 / 32 rows): fused GEMM1 (512 / 1024 / 2048 x 7168) 410.5 -> 351.1 / 755.7 ->
#   673.5 / 1432.5 -> 1343.4; down projection (7168 x 256 / 512 / 1024) 188.7 -> 195.0 / 363.5 -> 347.9 / 726.5 -> 704.9;
# - decode (32 experts, 8 rows): 7168x2048 170.9 -> 169.3, 4096x7168 327.7 -> 325.4.
# The m_indices reads cost each tile's producer time: at K = 256 (2 K blocks a tile) more than the rows save (with the
# reads but every box loaded, 197.6), and groups of 128-row tiles (32 x 256 and 8 x 4096 rows) ran up to 1.3% slower.
# 128-row masked tiles keep whole boxes: at most a group's last tile has padding, and the live box count spilled
# their producer warps (nvcc, K pieces).
PARTIAL_A_BOX_ROWS = 32
PARTIAL_A_MIN_K = 512


@dataclasses.dataclass(frozen=True)
class GemmDesc:
    """What the heuristic knows about one call: rows (total, or per group when masked), N, K, groups."""

    m: int
    n: int
    k: int
    num_groups: int = 1
    layout: Layout = "normal"
    num_sms: int = 132
    expected_m: int | None = None  # rows per group the caller expects (masked; contiguous: a hint of the order)
    # 1 / 2: the fused SiLU·mul + FP8 quant epilogue (FP32 / UE8M0 scales) on [gate; up] weights of
    # n rows: 256-wide tiles only (a gate and an up block each)
    act_quant: int = 0


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
    split_k: int = 1  # CTAs per cluster splitting one tile's K, reduced through DSMEM (normal layout only)
    # 256-wide tiles of single CTAs: a last wave of at most half as many tiles as CTAs runs as tile halves
    # (sched::TailSplit); with the fused SiLU·mul + quant epilogue (needs both halves) only as K pieces
    tail_split: bool = False
    # with tail_split: the last wave's tiles run as K pieces on up to 4 CTAs each instead of halves (FP32
    # partial tiles in a workspace, see epilogue/k_split.cuh). A launch option of the same kernel, not a
    # separate variant.
    k_split: bool = False
    # grouped layouts: A arrives as TMA boxes of this many rows, only those holding a group's rows (0: one box a
    # tile; see PARTIAL_A_BOX_ROWS)
    a_box_rows: int = 0

    @property
    def num_math_threads(self) -> int:
        return self.block_m // 64 * 128

    @property
    def num_threads(self) -> int:
        return self.num_math_threads + 128  # + one producer warpgroup


def staging_tile_bytes(block_m: int, block_n: int) -> int:
    """Epilogue staging tile: bf16 rows padded by 16 bytes (mirrors epi::StagingTile)."""
    return block_m * (block_n * 2 + 16)


def w_scale_bytes(k: int) -> int:
    """A tile's weight scales staged in shared memory: 2 buffers x 2 scale blocks x K blocks (rows
    padded to 4 floats; mirrors GemmSmem::kSBBytes)."""
    return 2 * 2 * align(ceil_div(k, BLOCK_K), 4) * 4


def smem_bytes(block_m: int, block_n: int, num_stages: int, k: int) -> int:
    """Dynamic shared memory of one variant (mirrors GemmSmem in impls/fp8_gemm.cuh, which
    static_asserts that the value passed here covers its layout)."""
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4
    return (num_stages * per_stage + staging_tile_bytes(block_m, block_n) + w_scale_bytes(k)
            + (2 * num_stages + 1) * BARRIER_BYTES)


def straddle_ok(block_n: int) -> bool:
    """A tile (or each 128-column wave of a 256-wide one) touches at most two weight-scale blocks."""
    return block_n <= 128 + math.gcd(block_n, 128)


def max_stages(block_m: int, block_n: int, k: int) -> int:
    fixed = staging_tile_bytes(block_m, block_n) + w_scale_bytes(k) + BARRIER_BYTES
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + block_m * 4 + 2 * BARRIER_BYTES
    return (MAX_SMEM_BYTES - fixed) // per_stage


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
    if desc.layout == "masked" and desc.expected_m:
        # drawn in whole m-blocks, so the choice depends on rows only via ceil(rows / block_m)
        # (what representative_rows relies on)
        m_blocks = ceil_div(desc.expected_m, block_m)
        n_blocks = ceil_div(desc.n, block_n)  # (masked tiles never multicast: pairs could span two groups)
        total = 0.0
        for draw in _masked_draws(desc.num_groups):
            blocks = [max(1, math.ceil(f * m_blocks)) for f in draw]
            total += _estimate_ns(desc, block_m, block_n, sum(blocks) * n_blocks, max(blocks), multicast)
        return total / MASKED_DRAWS, tiles
    return _estimate_ns(desc, block_m, block_n, tiles, ceil_div(desc.m, block_m), multicast), tiles


@functools.lru_cache(maxsize=512)
def _masked_draws(num_groups: int) -> tuple[tuple[float, ...], ...]:
    """``MASKED_DRAWS`` draws of per-group row multipliers in ``MASKED_SPREAD``: draw s, group g takes the
    fractional part of ``(s + 0.5) / MASKED_DRAWS + g·φ`` (φ the golden ratio's conjugate), so one group
    sweeps the range evenly and several groups decorrelate."""
    lo, hi = MASKED_SPREAD
    phi = (math.sqrt(5) - 1) / 2
    return tuple(tuple(lo + (hi - lo) * (((s + 0.5) / MASKED_DRAWS + g * phi) % 1.0) for g in range(num_groups))
                 for s in range(MASKED_DRAWS))


def _estimate_ns(desc: GemmDesc, block_m: int, block_n: int, tiles: int, m_blocks: int,
                 multicast: int = 1) -> float:
    """Model time of ``tiles`` tiles of ``block_m x block_n`` (``m_blocks``: a group's m-blocks, for the
    DRAM band)."""
    k_blocks = ceil_div(desc.k, BLOCK_K)

    def block_ns(active: int, bn: int) -> float:  # one 128-K block of every one of `active` CTAs
        factor_192 = MMA_192_FACTOR_MASKED if desc.layout == "masked" else MMA_192_FACTOR
        mma_ns = MMA_NS_PER_ELEM * block_m * bn * (factor_192 if bn == 192 else 1.0)
        k_block_ns = max(K_BLOCK_BASE_NS + K_BLOCK_NS_PER_ROW * (block_m + bn), mma_ns)
        if block_m == 64 and 128 % bn and bn % 128:
            k_block_ns += (OVERLAP_STRADDLE_NS if bn <= OVERLAP_MAX_BLOCK_N
                           else STRADDLE_NS * (1 if math.gcd(bn, 128) >= 16 else 2))
        elif block_m == 128 and bn in STRADDLE_128_BLOCK_NS:
            k_block_ns += STRADDLE_128_BLOCK_NS[bn]
        band = min(m_blocks, SWIZZLE_GROUP_M, active)
        dram_ns = (band * block_m + ceil_div(active, band) * bn) * BLOCK_K / DRAM_BYTES_PER_NS
        shared_a_ns = active / band * (block_m + bn) * BLOCK_K / SHARED_A_BYTES_PER_NS if band == 1 else 0.0
        return max(k_block_ns, dram_ns, shared_a_ns)

    def wave_ns(active: int, bn: int) -> float:
        return k_blocks * block_ns(active, bn) + TILE_FIXED_NS

    full, last = divmod(max(tiles, 1), desc.num_sms)
    # The last wave as K pieces (sched::TailSplit), counted for the masked layout only: there the tile count
    # depends on rows drawn at run time. Normal and contiguous kernels split their tail into halves and
    # their choices are left as calibrated.
    parts = min(K_SPLIT_MAX_PIECES, k_blocks // K_SPLIT_MIN_PIECE_BLOCKS, desc.num_sms // max(last, 1))
    if (desc.layout == "masked" and last and parts >= 2 and masked_k_split(desc, block_m, block_n, multicast)
            and desc.num_groups <= K_SPLIT_MODEL_MAX_GROUPS and not desc.act_quant):
        piece_ns = ceil_div(k_blocks, parts) * block_ns(parts * last, block_n) + TILE_FIXED_NS + K_SPLIT_FIXUP_NS
        return full * wave_ns(desc.num_sms, block_n) + piece_ns
    return full * wave_ns(desc.num_sms, block_n) + (wave_ns(last, block_n) if last else 0.0)


def masked_k_split(desc: GemmDesc, block_m: int, block_n: int, multicast: int = 1) -> bool:
    """Whether a masked GEMM may run its last wave as K pieces (``GemmConfig.k_split``): two-wave tiles of
    single CTAs, K long enough for two pieces, and a tile count the kernel counts (any number of groups with
    64-row tiles, up to ``MASKED_COUNTED_GROUPS_128`` with 128-row ones). Under the fused SiLU·mul + quant
    epilogue these are the only split of its last wave (a tile's gate and up halves belong together)."""
    return (desc.layout == "masked" and tail_split_ok(block_n, multicast) and k_pieces_fit(desc.k)
            and (block_m == 64 or desc.num_groups <= MASKED_COUNTED_GROUPS_128))


def k_pieces_fit(k: int) -> bool:
    """K holds two pieces of ``K_SPLIT_MIN_PIECE_BLOCKS``: only then does a masked kernel have K pieces
    compiled in (sched::TailSplit::kKPieces); below, a K-split launch runs halves."""
    return ceil_div(k, BLOCK_K) >= 2 * K_SPLIT_MIN_PIECE_BLOCKS


def _one_block_contiguous(desc: GemmDesc) -> bool:
    """A contiguous GEMM whose groups the caller expects to hold at most ``CONTIGUOUS_ONE_BLOCK_MAX_ROWS`` rows."""
    return (desc.layout == "contiguous" and desc.expected_m is not None
            and desc.expected_m <= CONTIGUOUS_ONE_BLOCK_MAX_ROWS)


def candidates(desc: GemmDesc) -> list[tuple[int, int, int, bool]]:
    """(block_m, block_n, multicast, multicast_on_a) valid for the descriptor; rejected ones, and why:
    - block_n must keep a tile within two weight-scale blocks (``straddle_ok``);
    - block_n beyond N adds only zero columns;
    - block_m 128 for fewer than 65 rows per group only adds zero rows;
    - block_m 128 with a block_n that straddles weight-scale blocks (neither divides the other's
      128): measured slow at large M (the select per column chunk competes with the promotion for
      registers), but ``STRADDLE_128_BLOCK_NS`` for normal GEMMs (measured where they fit the waves; 128x96
      from ``STRADDLE_128_MIN_K_BLOCKS`` K blocks);
    - contiguous layout: block_m must divide the 128-row segment alignment (both do);
    - multicast is never chosen (measured no gain; ``make_config`` still builds it, tests cover it);
    - split-K is never chosen (measured no gain; ``make_config`` still builds it, tests cover it);
    - the fused SiLU·mul + quant epilogue (``act_quant``) takes 256-wide tiles only.
    """
    rows = _rows_per_group(desc)
    out = []
    for bm in BLOCK_MS:
        if bm == 128 and rows <= 64:
            continue
        for bn in (256,) if desc.act_quant else BLOCK_NS:
            if not straddle_ok(bn):
                continue
            if bn > desc.n and bn != BLOCK_NS[0] and bn - 8 >= desc.n:
                continue
            if (bm == 128 and 128 % bn and bn not in WAVE_BLOCK_NS
                    and not (desc.layout == "normal" and bn in STRADDLE_128_BLOCK_NS
                             and ceil_div(desc.k, BLOCK_K) >= STRADDLE_128_MIN_K_BLOCKS.get(bn, 0))):
                continue
            out.append((bm, bn, 1, False))
    return out


def make_config(block_m: int, block_n: int, num_sms: int, *, k: int, num_stages: int | None = None,
                multicast: int = 1, multicast_on_a: bool = False, split_k: int = 1,
                swizzle_group_m: int = SWIZZLE_GROUP_M, tail_split: bool | None = None,
                k_split: bool = False, a_box_rows: int = 0) -> GemmConfig:
    """A configuration for an explicit block shape (tests and benchmark sweeps) of a GEMM with this
    K (the staged weight scales take shared memory); stages default to as many as fit. ``tail_split``
    defaults to where it applies (``tail_split_ok``); ``k_split`` splits the tail by K instead of halving it;
    ``a_box_rows`` loads A as boxes of that many rows (grouped layouts, see ``PARTIAL_A_BOX_ROWS``)."""
    if (block_m not in BLOCK_MS or block_n % 8 or not 8 <= block_n <= 256 or not straddle_ok(block_n)
            or (block_n > 160 and block_n not in WAVE_BLOCK_NS)):
        raise ValueError(f"unsupported block shape {block_m}x{block_n}")
    if multicast not in (1, 2) or (multicast == 2 and (block_m if multicast_on_a else block_n) % 16):
        raise ValueError(f"unsupported multicast {multicast} (on {'A' if multicast_on_a else 'B'}) "
                         f"for block {block_m}x{block_n}")
    if split_k not in SPLIT_KS or (split_k > 1 and (multicast > 1 or block_n % (8 * split_k)
                                                    or ceil_div(k, BLOCK_K) < split_k)):
        raise ValueError(f"unsupported split-K {split_k} for block {block_m}x{block_n}, K={k}, multicast {multicast}")
    if tail_split and not tail_split_ok(block_n, multicast, split_k):
        raise ValueError(f"tail halves need 192 / 256-wide tiles of single CTAs, got block {block_m}x{block_n}, "
                         f"multicast {multicast}, split-K {split_k}")
    if k_split and tail_split is False:
        raise ValueError("k_split runs the tail of a tail-split kernel: it needs tail_split")
    if k_split and not tail_split_ok(block_n, multicast, split_k):
        raise ValueError(f"k_split needs 192 / 256-wide tiles of single CTAs, got block {block_m}x{block_n}, "
                         f"multicast {multicast}, split-K {split_k}")
    if a_box_rows and (a_box_rows % 8 or block_m % a_box_rows or a_box_rows == block_m or multicast > 1):
        raise ValueError(f"A boxes of {a_box_rows} rows: whole 8-row swizzle atoms, fewer than a {block_m}-row tile "
                         f"of a single CTA")
    most = max_stages(block_m, block_n, k)
    stages = most if num_stages is None else num_stages
    if not 2 <= stages <= most:
        raise ValueError(f"block {block_m}x{block_n} at K={k} fits 2..{most} stages, got {stages}")
    return GemmConfig(block_m=block_m, block_n=block_n, num_stages=stages, swizzle_group_m=swizzle_group_m,
                      num_sms=num_sms, smem_bytes=smem_bytes(block_m, block_n, stages, k), multicast=multicast,
                      multicast_on_a=multicast_on_a and multicast > 1, split_k=split_k,
                      tail_split=tail_split_ok(block_n, multicast, split_k) if tail_split is None else tail_split,
                      k_split=k_split, a_box_rows=a_box_rows)


def tail_split_ok(block_n: int, multicast: int = 1, split_k: int = 1) -> bool:
    """Whether a last wave can run as tile halves: two-wave tiles (``WAVE_BLOCK_NS``: 192 / 256 wide,
    two 96 / 128-column waves) of single CTAs."""
    return block_n in WAVE_BLOCK_NS and multicast == 1 and split_k == 1


def representative_rows(max_rows: int) -> list[int]:
    """Row counts whose configurations are those of every count in ``1..max_rows``.

    ``get_config`` sees the rows (per group) only through ``ceil_div(rows, block_m)`` for each
    ``block_m`` in ``BLOCK_MS`` (tile counts, the DRAM band, and the ``rows <= 64`` filter, which is
    ``ceil_div(rows, 64) == 1``), and through ``rows <= MASKED_DECODE_MAX_ROWS`` and
    ``rows <= MASKED_DECODE_WIDE_MAX_ROWS`` (the decode tiles), so counts with equal quotients on the same
    side of those bounds share a config and the largest count of each such interval stands for it.
    ``moe-fp8 warmup`` enumerates a model's variants over these (a few hundred calls instead of one per
    token count); tests/test_cli_warmup.py checks the claim against an exhaustive scan, so a heuristic that
    starts to depend on rows otherwise fails there.
    """
    if max_rows < 1:
        return []
    reps = {max_rows}
    for bm in BLOCK_MS:
        reps.update(range(bm, max_rows + 1, bm))
    for bound in (MASKED_DECODE_MAX_ROWS, MASKED_DECODE_WIDE_MAX_ROWS):  # the decode tiles' bounds (_decode_config)
        if max_rows > bound:
            reps.add(bound)
    return sorted(reps)


# Large problems: with at least this many waves of the widest tile, wave quantization moves an estimate
# by under 1/8, so row counts are bucketed (16 buckets per octave of m-blocks). Prefill sends a new
# M_total nearly every batch; a model evaluation costs ~300 us of Python (1.3 ms masked), a cache hit
# a dict lookup.
BUCKET_MIN_WAVES = 8
BUCKETS_PER_OCTAVE = 16


def config_key(desc: GemmDesc) -> GemmDesc:
    """The descriptor ``get_config`` decides on: rows rounded up to a multiple of 64 (exact: the model
    sees rows only through ``ceil_div(rows, block_m)``, see ``representative_rows``), and for large
    normal / contiguous problems to a bucket of m-blocks (see ``BUCKET_MIN_WAVES``)."""
    if desc.layout == "masked":
        if desc.expected_m:
            return dataclasses.replace(desc, expected_m=64 * ceil_div(desc.expected_m, 64))
        return dataclasses.replace(desc, m=64 * ceil_div(desc.m, 64))
    # contiguous: the rows hint only says whether the groups hold about one block (the tile order)
    expected = CONTIGUOUS_ONE_BLOCK_MAX_ROWS if _one_block_contiguous(desc) else None
    m_blocks = ceil_div(desc.m, 128)
    if m_blocks * ceil_div(desc.n, 256) >= BUCKET_MIN_WAVES * desc.num_sms:
        step = max(1, (1 << (m_blocks.bit_length() - 1)) // BUCKETS_PER_OCTAVE)
        return dataclasses.replace(desc, m=128 * align(m_blocks, step), expected_m=expected)
    return dataclasses.replace(desc, m=64 * ceil_div(desc.m, 64), expected_m=expected)


@functools.lru_cache(maxsize=1 << 16)
def get_config(desc: GemmDesc) -> GemmConfig:
    """The tuned configuration of this call where the active table of ``moe-fp8 tune`` has one
    (``tuning.lookup``), else ``default_config``'s."""
    from .tuning import lookup  # (tuning imports this module)

    cfg = lookup(desc) or default_config(desc)
    if os.environ.get("MOE_FP8_JIT_DEBUG", "0") not in ("", "0"):
        print(f"[moe_fp8] {desc} -> {cfg}")
    return cfg


def default_config(desc: GemmDesc) -> GemmConfig:
    """A measured tile (``SMALL_M_BLOCK_N``, ``CONTIGUOUS_ONE_BLOCK_TILES``, ``MASKED_DECODE_TILES`` /
    ``_WIDE_TILES``, ``MASKED_MEASURED_TILES``) where one applies, else the cost model's pick."""
    return _with_partial_a(desc, _decode_config(desc) or _best_config(config_key(desc)))


def _with_partial_a(desc: GemmDesc, cfg: GemmConfig) -> GemmConfig:
    """``cfg`` loading A as ``PARTIAL_A_BOX_ROWS`` boxes where that applies (see there)."""
    if ((desc.layout == "masked" and cfg.block_m == 64)
            or (_one_block_contiguous(desc) and desc.k >= PARTIAL_A_MIN_K)):
        return dataclasses.replace(cfg, a_box_rows=PARTIAL_A_BOX_ROWS)
    return cfg


def _measured_config(desc: GemmDesc) -> GemmConfig | None:
    """The measured tile of this call on the machine it was measured on, if any: ``SMALL_M_BLOCK_N`` (normal
    small-M GEMMs), ``CONTIGUOUS_ONE_BLOCK_TILES`` or ``MASKED_MEASURED_TILES``."""
    if desc.num_sms != SMALL_M_SMS or desc.act_quant:
        return None
    if desc.layout == "normal":
        block_n = SMALL_M_BLOCK_N.get((desc.n, desc.k), {}).get(ceil_div(desc.m, 64))
        return None if block_n is None else make_config(64, block_n, desc.num_sms, k=desc.k)
    if _one_block_contiguous(desc) and ceil_div(desc.m, 128) >= desc.num_groups:
        tile = CONTIGUOUS_ONE_BLOCK_TILES.get((desc.n, desc.k))
        return None if tile is None else make_config(128, tile[0], desc.num_sms, k=desc.k, num_stages=tile[1],
                                                     swizzle_group_m=1)
    tile = MASKED_MEASURED_TILES.get((desc.n, desc.k))
    if (desc.layout != "masked" or tile is None or desc.num_groups > MASKED_MEASURED_MAX_GROUPS
            or not MASKED_MEASURED_ROWS[0] <= (desc.expected_m or desc.m) <= MASKED_MEASURED_ROWS[1]):
        return None
    return make_config(128, tile[0], desc.num_sms, k=desc.k, num_stages=tile[1])


def _decode_config(desc: GemmDesc) -> GemmConfig | None:
    """``MASKED_DECODE_TILES`` / ``MASKED_DECODE_WIDE_TILES`` where they apply. Decided on the caller's
    ``expected_m``, which ``config_key`` would round up to a multiple of 64 (past the rules' bounds)."""
    if (desc.layout != "masked" or desc.num_sms != SMALL_M_SMS or desc.act_quant
            or desc.num_groups < MASKED_DECODE_MIN_GROUPS):
        return None
    rows = desc.expected_m or desc.m
    if rows <= MASKED_DECODE_MAX_ROWS:
        block_m, tiles = 64, MASKED_DECODE_TILES
    elif rows <= MASKED_DECODE_WIDE_MAX_ROWS:
        block_m, tiles = 128, MASKED_DECODE_WIDE_TILES
    else:
        return None
    tile = tiles.get((desc.n, desc.k))
    return None if tile is None else make_config(block_m, tile[0], desc.num_sms, k=desc.k, num_stages=tile[1])


@functools.cache
def _best_config(desc: GemmDesc) -> GemmConfig:
    measured = _measured_config(desc)
    return modelled_config(desc) if measured is None else measured


def ranked_tiles(desc: GemmDesc) -> list[tuple[int, int, int, bool]]:
    """``candidates(desc)`` cheapest first by the cost model; ties to fewer tiles, then the wider BLOCK_N."""
    def key(cand: tuple[int, int, int, bool]) -> tuple:
        ns, tiles = estimate_ns(desc, *cand)
        return round(ns, 3), tiles, -cand[1], cand[2]

    return sorted(candidates(desc), key=key)


def _tile_config(desc: GemmDesc, tile: tuple[int, int, int, bool], num_stages: int | None = None) -> GemmConfig:
    """``tile`` as the model launches it: all pipeline stages that fit, but TWO_WG_STAGES for 128-row tiles
    unless a normal GEMM's tiles fit in one wave (``num_stages`` overrides)."""
    bm, bn, mc, on_a = tile
    if num_stages is None:
        one_wave = desc.layout == "normal" and num_tiles(desc, bm, bn, mc, on_a) <= desc.num_sms
        num_stages = min(TWO_WG_STAGES, max_stages(bm, bn, desc.k)) if bm == 128 and not one_wave else None
    swizzle = 1 if _one_block_contiguous(desc) else SWIZZLE_GROUP_M
    return make_config(bm, bn, desc.num_sms, k=desc.k, num_stages=num_stages, multicast=mc, multicast_on_a=on_a,
                       swizzle_group_m=swizzle, k_split=masked_k_split(desc, bm, bn, mc))


def modelled_config(desc: GemmDesc) -> GemmConfig:
    """The cost model's cheapest candidate (``ranked_tiles``), launched as ``_tile_config`` says."""
    ranked = ranked_tiles(desc)
    if not ranked:
        raise ValueError(f"no kernel configuration fits {desc}")
    return _tile_config(desc, ranked[0])


def tuning_candidates(desc: GemmDesc, limit: int = 6) -> list[GemmConfig]:
    """What ``moe-fp8 tune`` times for ``desc``: ``default_config`` first, then the model's ``limit`` cheapest
    tiles, each as the model launches it and, with 128 rows, also at the other stage count (TWO_WG_STAGES or all
    that fit: the model fixes one by rule, measured per family, not per shape). Distinct configs, in that order."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1 (tiles besides the default), got {limit}")
    key = config_key(desc)
    out = [default_config(desc)]
    for tile in ranked_tiles(key)[:limit]:
        stage_counts = [None]
        if tile[0] == 128:
            stage_counts += [min(TWO_WG_STAGES, max_stages(128, tile[1], desc.k)), max_stages(128, tile[1], desc.k)]
        for stages in stage_counts:
            cfg = _with_partial_a(desc, _tile_config(key, tile, stages))
            if cfg not in out:
                out.append(cfg)
    return out
