"""Launch configurations of the Triton data-path kernels: plain Python over shapes, no GPU needed.

This module is the single place the data path's tuning choices live. Each kernel family has a frozen
config dataclass and a heuristic ``*_config(shape..., **knobs)``; the knobs (tile size, warps, rows
per program, ...) default to the module constants below, and ``scripts/datapath_sweep.py`` times
candidate values of exactly those knobs on a GPU. To adopt a winner, change the constant (or the
rule that uses it) here — nothing else in the package picks a block size.

Every kernel here is memory-bound; a configuration only has to (a) move 16-byte vectors per thread,
(b) keep a tile small enough to stay in registers (no spills), (c) launch enough programs to cover
the SMs several times over, while (d) never letting a program idle on rows that do not exist
(masked layouts). Sizes are powers of two (Triton tensor shapes). ``repr`` of a config is its
debug print. The heuristics are cached: they run on every eager call (host time counts at decode).
"""

from __future__ import annotations

import dataclasses
import functools

from moe_fp8.utils import get_num_sms

# Triton grid limits: axis 0 up to 2**31 - 1, axes 1 and 2 up to 65535.
MAX_GRID_YZ = 65535

# ---- quantization (per_token_group_quant, silu_mul_per_token_group_quant) ----
# Elements of one tile: 1024 = one row of 8 scale groups. H100 sweep (gpu6): quant is best at 1024
# elements with 2 warps from 4096 rows up (16384×7168: 139.4 vs 146.7 us at 2048/4 warps, 4096×7168
# 40.5 vs 42.8, 16384×2048 45.3 vs 47.7); SiLU·mul+quant at 1024 with 4 warps (it loads two inputs).
QUANT_TILE_ELEMS = 1024
QUANT_SILU_TILE_ELEMS = 1024
# Small inputs (decode): halve the rows of a tile while fewer than this many tiles per SM exist
# (128×7168 quant: 896 one-row tiles beat 448 two-row ones, 7.2 vs 7.7 us).
QUANT_MIN_TILES_PER_SM = 8
# Warps: one thread per QUANT_LOADS_PER_THREAD loaded elements (SiLU loads gate and up: twice the
# tile). Every sweep winner loads 16 per thread (1024/2 warps quant, 1024/4 warps SiLU, the old
# 2048/4 warps); small grids (< QUANT_MIN_TILES_PER_SM tiles per SM) take twice the threads instead
# (128×7168: 1024/4 warps 7.3 us vs 1024/2 warps 7.7).
QUANT_LOADS_PER_THREAD = 16
QUANT_SMALL_LOADS_PER_THREAD = 8
# GPUs whose memory outruns those tiles (docs/kernels/datapath.md, session 54): twice
# the loads per thread, and quant tiles of 2048 elements (2 warps). H200, CUDA-graph replays alternated, default ->
# wide (docs/benchmarks/calibration/s54-quant-wide-ab-h200.txt): quant 16384×7168 142.3 -> 116.9 µs (2.50 -> 3.05
# TB/s), 4096×7168 39.2 -> 34.6, 1024×7168 13.9 -> 13.7, 16384×2048 44.2 -> 38.1; SiLU·mul+quant (1024-element tiles,
# 4 -> 2 warps) 16384 rows 62.2 -> 54.8, 4096 rows 20.1 -> 18.8. Not measured on the H100 (whose picks above stay),
# so only the device names listed here take it; nor masked layouts, nor grids of fewer than
# QUANT_WIDE_MIN_TILES_PER_SM default tiles an SM (SiLU·mul+quant of 1024 rows: 9.6 -> 10.0 µs in the sweep).
QUANT_WIDE_DEVICES = ("NVIDIA H200",)  # torch.cuda.get_device_name, exactly (the SXM part)
QUANT_WIDE_MIN_TILES_PER_SM = 32
QUANT_WIDE_TILE_ELEMS = 2048
QUANT_WIDE_LOADS_PER_THREAD = 32
# Scale groups side by side in one tile row (8 × 128 = 1024 columns): the rest of the tile is rows.
QUANT_MAX_BLOCK_G = 8
# Masked layouts: the valid rows of all groups are one flat list of row blocks (prefix of masked_m
# on device), strided over by this many programs per SM and column block. Sweep (gpu6): the decode
# buffer (256 groups × max_m 128, ~900 valid rows) is best at 8 (15.9 vs 16.4 us at 16: every program
# pays the prefix of 256 counts, idle or not); 32 groups × 1024 (7417 rows) at 32 (47.3 vs 50.0).
PROGRAMS_PER_SM = 32
# ... and with at least this many groups (the per-program prefix grows with the group count):
PROGRAMS_PER_SM_MANY_GROUPS = 8
QUANT_MANY_GROUPS = 128
# Flat masked rows need the prefix of masked_m in registers: up to this many groups, else one loop
# per group as before (grid axis 2 = groups).
QUANT_FLAT_MAX_GROUPS = 4096

# ---- routing (select_experts) ----
# Largest expert count one program holds (the whole row of scores lives in registers).
MAX_ROUTING_EXPERTS = 1024
# Score slots (tokens × experts) per warp: a warp-sized token tile keeps every top-k reduction
# inside the warp (shuffles, no shared-memory round trip) — the top-k loop is latency-bound.
ROUTING_SLOTS_PER_WARP = 256
ROUTING_MAX_WARPS = 4
ROUTING_MAX_BLOCK_T = 4
# ... except with one token per program (decode: a program per SM, no other work to hide latency
# behind), where 4 warps share the token's 256+ slots. Session 10, H100, DeepSeek-V3 decode step under
# a CUDA graph (routing, quant + dispatch, SiLU·mul+quant, combine; one process, 4 alternating repeats):
# 39.6-40.2 us against 40.3-40.7 with one warp (datapath_sweep: routing alone 8.7 vs 9.1 us replayed).
ROUTING_DECODE_WARPS = 4

# ---- dispatch ----
# Masked dispatch up to this many (token, slot) pairs: ONE fused launch in which every scatter
# program ranks its own pairs against all earlier ones (an O(pairs) comparison per program, from L2)
# and a slice of programs writes masked_m — no routing kernel, no intermediate buffers. The old
# single-program router (one program walking every pair serially) took 95 us at 128×top-8×256 on an
# H100; count/scan/row-map/scatter in 4 launches 31 us. Total comparisons grow as pairs², so above
# the threshold the chunked 4-launch path (bandwidth-bound at prefill sizes) takes over.
DISPATCH_FUSED_MAX_PAIRS = 2048
# Fused kernel: elements of one rank-comparison tile ([block_t, top_k, chunk]).
DISPATCH_RANK_TILE = 4096
# Fused kernel: experts per counting program (masked_m), in programs of their own ahead of the token
# programs. Session 12, H100, DeepSeek-V3 decode (128 tokens, top-8 of 256), routing + quant_dispatch_masked
# under a CUDA graph: 20.85 us when 16 of the token programs also counted, 18.34 without any counting,
# 18.8-19.3 counting apart (with the row prefetch); 8 or 32 experts per program were slower.
DISPATCH_COUNT_EXPERTS = 16
# Fused kernel scatter: one token per program and its whole row (7168 bytes: one column block, so
# the pairs are ranked once per token, not once per column block). Sweep (gpu6, 128×7168 decode):
# block_k 8192 / 8 warps 11.7 us vs 14.4 at 2048 / 4 warps.
DISPATCH_FUSED_BLOCK_K = 8192
DISPATCH_FUSED_WARPS = 8
# Up to DISPATCH_FUSED_SMALL_TOKENS tokens the row goes in slices of 2048 / 4 warps: a whole row left one program per
# token to load, quantize and store 7168 elements alone, on the decode step's critical path. Session 58, H200, the
# layer's CUDA-graph replay with the router GEMM in it (scripts/ab_layer_constants.py, 3-5 rounds alternated), µs:
# DeepSeek-V3 TP 8 at 1 / 2 / 4 / 16 tokens 44.8 -> 41.3, 66.1 -> 65.4, 89.2 -> 88.6, 212.0 -> 211.4, at 32 288.5
# -> 289.8 (worse); Kimi-K2 EP 8 at 1 / 4 tokens 70.2 -> 69.1, 64.7 -> 62.3, at 32 322.4 -> 323.2. 4096 columns (4 or 8
# warps) gained less; 1024 / 2 warps as much up to 16 tokens, less at 64.
DISPATCH_FUSED_SMALL_TOKENS = 16
DISPATCH_FUSED_SMALL_BLOCK_K = 2048
DISPATCH_FUSED_SMALL_WARPS = 4
# Chunked path's scatter: each program computes its pairs' destinations from the routing state (4
# dependent gathers per pair). Session 10 sweep (H100, scripts/profile_layer.py --scatter, 7168 columns,
# top-8 of 256, after the local ids moved ahead of the row load), one token per program:
# - under an expert_map (EP rank, 32 local experts: ~1 copy per token, a third of the rows unread), a
#   whole row with 4 warps: 51.4 us at 8192 tokens (95.4 at 16384) against 75.9 (144.0) at 8192 / 8
#   warps, 75.7 (142.7) at 4096 / 4 and 126.4 (247.6) at 2048 / 4;
# - every expert local (top_k copies per token), 2048 / 4 warps: 242.9 us at 8192 tokens (484.5 at
#   16384) against 249.7 (504.3) at 4096 / 4 and 269.4 (539.1) at 8192 / 8.
# Under an expert_map the sparse scatter (a branch per slot) takes over, same block (session 15, CUDA-graph
# timed, 8192 / 16384 tokens): 43.9 / 83.8 us against the dense kernel's 47.9 / 92.3; 4096 / 4 took
# 52.0 / 101.0, 8192 / 8 45.4 / 87.1.
DISPATCH_BLOCK_T = 1
DISPATCH_BLOCK_K = 2048
DISPATCH_WARPS = 4
DISPATCH_MAP_BLOCK_K = 8192
DISPATCH_MAP_WARPS = 4
# The same scatter quantizing bf16 rows on the way (quant_dispatch_contiguous without an expert_map):
# half rows, 4 warps. Session 10 (H100, 16384 tokens x 7168, top-8 of 256 all local, kernel alone):
# 538.5 us at 4096 / 4 without x_fp8 (591.7 with it) against 578.2 (633.0) at 8192 / 8 and 560.3 (603.5)
# at 2048 / 4, and 628 us for the quant kernel plus the FP8 scatter (2048 / 4).
DISPATCH_QUANT_BLOCK_K = 4096
DISPATCH_QUANT_WARPS = 4
# The sparse scatter quantizing on the way (quant_dispatch_contiguous under an expert_map; with x_fp8 since session 18).
# Session 15 (H100, 32 of 256 experts local, CUDA-graph timed), 8192 / 16384 tokens: 98.2 / 190.1 us at
# 4096 / 4 against 105.6 / 206.0 at 4096 / 8, 109.6 / 212.6 at 8192 / 8 and 125.4 / 254.7 at 2048 / 4; the
# quant kernel plus the sparse FP8 scatter took 70.9 + 43.9 / 139.8 + 83.8.
# Session 18, after the quantization lost its per-element division (common.quantize_exact): 70.6 / 137.7 us
# at 4096 / 4 against 67.7 / 131.1 at 8192 / 8 and 96.0 / 195.6 at 2048 / 4 (same process, 3 rounds).
DISPATCH_SPARSE_QUANT_BLOCK_K = 8192
DISPATCH_SPARSE_QUANT_WARPS = 8
# Contiguous m_indices rows (in the scatter's column block 0): segment starts compared E_CHUNK at a time
# ([128, E_CHUNK] tiles; a 256-wide tile spilled at 256 experts).
M_INDICES_E_CHUNK = 32
# The dense contiguous scatter quantizing its rows (``quant_dispatch_contiguous`` without an expert map, the
# quantized input returned) writes the output scales in a pass of its own from this many pairs on: written
# a token at a time each 4-byte scale lands in a 32-byte sector that other tokens fill later. Session 19
# (H100, 7168 columns, top-8 of 256, CUDA-graph timed): 16384 / 8192 / 4096 tokens 617.7 -> 568.8, 313.2 ->
# 295.1, 161.9 -> 157.3 us; 1024 tokens 46.8 -> 49.9 (the extra launch). The FP8 scatter gains nothing
# (16384 tokens 505.2 -> 497.4 us, 4096 tokens 134.8 -> 137.7): it stays as it is.
DISPATCH_SCALES_APART_MIN_PAIRS = 32768
# Since session 58 that pass gathers the quantizing scatter's token-major copy of the scales (a token's scales in 7
# sectors), not the TMA layout of x_scale (56 sectors a token), so it pays from fewer pairs. H200, CUDA-graph timed
# (scripts/ab_quant_dispatch.py, 7168 columns, top-8 of 256 all local, x_fp8 returned), inline -> apart, us: 16384
# / 8192 / 4096 / 2048 tokens 490.1 -> 406.9, 249.1 -> 213.6, 132.7 -> 116.7, 74.6 -> 67.0 (the gather from x_scale:
# 445.5, 235.3, 129.8, 74.1); 1024 tokens 42.7 -> 42.1, 512 30.3 -> 32.8, 256 26.1 -> 29.1. Without x_fp8 2048 tokens
# 69.2 -> 64.7, 512 28.7 -> 31.7.
DISPATCH_QUANT_SCALES_APART_MIN_PAIRS = 16384
# _scale_rows_kernel: output rows and scale groups per program (a [64, 128] FP32 tile: 128 rows = 512 bytes
# of each group's column, whole sectors)
SCALE_ROWS_BLOCK_R = 128
SCALE_ROWS_BLOCK_G = 64
# Routing kernels of the chunked path (count / scan).
DISPATCH_ROUTE_WARPS = 4
DISPATCH_RANK_SUB = 32  # (16: 29.8 us where 32 took 24.5)

# ---- combine ----
# Sweep: one token per program wins at every size (16384: 97% of copy BW; 128 tokens 14.5 vs 22.6 us).
# Up to COMBINE_GATHER_MAX_TOKENS tokens the kernel gathers the top_k rows of a column block in one
# 2-D load (all in flight at once); beyond, one load per slot: the gather's per-element selects cost
# more than they hide there, most of all when most slots are skipped (H100, DeepSeek-V3 EP rank of
# 32 experts, 7 of 8 slots skipped, the layer's combine stage: one-load 221 / 439 us at 8192 / 16384
# tokens, per-slot 168 / 369; all slots used: 98% / 95% of copy BW at 16384 / 4096, 13.4 us at 128).
COMBINE_GATHER_MAX_TOKENS = 512
# Large batches: a token's whole row (8192 columns) / 4 warps, one branch per slot (``sparse``). Session
# 13 sweep (scripts/profile_layer.py --combine-sweep, H100, 54 configs): an EP rank's combine (~7 of 8
# slots skipped) 93.7 / 168.8 us at 8192 / 16384 tokens (best sparse 89.5 / 168.8) against 127.9 / 244.3
# for session 9's per-slot 4096 / 4 warps, whose masked-off slots still issued their loads and math;
# every slot local 366.5 / 718.4 us (2.88 / 2.94 TB/s, the best config) against 386.3 / 755.6. Fewer
# tokens keep 1024 / 4 warps (more programs).
# Session 18 (H100, CUDA-graph timed, 1024-4096 tokens x 7168, top-8): a branch per slot is as fast as the
# per-slot loads when every slot is used (1024 / 2048 / 3072 tokens: 39.6 / 71.5 / 107.1 us against 39.3 /
# 71.0 / 106.6) and much faster when 7 of 8 are idle (11.1 / 23.4 / 33.8 against 19.8 / 37.5 / 54.6). It had
# been taken below 4096 tokens only on the caller's hint (rows < half the pairs), which the layer's
# sync-free layout (upper-bound rows) never gave.
COMBINE_SPARSE = True
COMBINE_BLOCK_H = 1024
COMBINE_BLOCK_T = 1
COMBINE_WARPS = 4
COMBINE_LARGE_FROM = 4096
COMBINE_LARGE_BLOCK_H = 8192
COMBINE_LARGE_WARPS = 4


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Tile of ``block_r`` rows × ``block_g`` scale groups (each ``gs_p2`` wide) per loop step."""

    block_r: int
    block_g: int
    gs_p2: int
    num_warps: int
    row_programs: int  # grid axis 0: programs striding over row blocks (masked: a loop per program)


@functools.lru_cache(maxsize=1024)
def quant_config(rows: int, k_groups: int, group_size: int, num_groups: int = 1,
                 masked: bool = False, num_sms: int | None = None, *, silu: bool = False,
                 tile_elems: int | None = None, num_warps: int | None = None,
                 max_block_g: int | None = None, programs_per_sm: int | None = None,
                 wide: bool = False) -> QuantConfig:
    """Config of ``per_token_group_quant`` / ``silu_mul_per_token_group_quant``.

    ``rows`` per leading group (``M`` or ``max_m``), ``k_groups`` scale groups per row, ``num_groups``
    leading groups (1 for 2-D inputs). Without a mask every row block gets its own program; with one
    (up to ``QUANT_FLAT_MAX_GROUPS`` groups), ``row_programs`` programs per column block stride over
    the flat list of valid rows of all groups (the kernel finds a row's group from the prefix of
    ``masked_m``), so a mostly empty ``[G, max_m, ·]`` buffer costs no idle programs and a hot group
    no serial tail; more groups: ``row_programs`` per (column block, group) loop over that group.
    Keyword knobs override the module constants (``scripts/datapath_sweep.py``); ``wide``: the tiles of
    ``QUANT_WIDE_DEVICES`` (``quant_wide``).
    """
    sms = num_sms or get_num_sms()
    gs_p2 = _pow2_ceil(group_size)
    default_tiles = max(rows, 1) * -(-k_groups // min(_pow2_ceil(k_groups), QUANT_MAX_BLOCK_G))  # one-row tiles
    wide = wide and not masked and tile_elems is None and default_tiles >= QUANT_WIDE_MIN_TILES_PER_SM * sms
    tile = tile_elems or (QUANT_SILU_TILE_ELEMS if silu else QUANT_WIDE_TILE_ELEMS if wide else QUANT_TILE_ELEMS)
    per_row = max(tile // gs_p2, 1)
    block_g = min(_pow2_ceil(k_groups), per_row, max_block_g or QUANT_MAX_BLOCK_G)
    block_r = max(min(per_row // block_g, _pow2_ceil(rows)), 1)
    col_blocks = -(-k_groups // block_g)
    total_rows = max(rows, 1) * (num_groups if masked else 1)
    if tile_elems is None:  # small inputs: more, smaller tiles (latency-bound: fill the SMs)
        while block_r > 1 and -(-total_rows // block_r) * col_blocks < QUANT_MIN_TILES_PER_SM * sms:
            block_r //= 2
    small = -(-total_rows // block_r) * col_blocks < QUANT_MIN_TILES_PER_SM * sms
    row_blocks = -(-max(rows, 1) // block_r)
    if masked:
        per_sm = programs_per_sm or (PROGRAMS_PER_SM_MANY_GROUPS if num_groups >= QUANT_MANY_GROUPS
                                     else PROGRAMS_PER_SM)
        target = max(1, (per_sm * sms) // col_blocks)
        if num_groups <= QUANT_FLAT_MAX_GROUPS:  # flat list of the valid rows of every group
            row_programs = max(1, min(-(-total_rows // block_r), target))
        else:  # per-group loops
            row_programs = max(1, min(row_blocks, target // max(num_groups, 1)))
    else:
        row_programs = row_blocks
    loads = block_r * block_g * gs_p2 * (2 if silu else 1)
    per_thread = (QUANT_SMALL_LOADS_PER_THREAD if small else
                  QUANT_WIDE_LOADS_PER_THREAD if wide else QUANT_LOADS_PER_THREAD)
    warps = num_warps or min(max(_pow2_floor(loads // (per_thread * 32)), 1), 8)
    return QuantConfig(block_r, block_g, gs_p2, warps, row_programs)


def is_quant_wide(device_name: str) -> bool:
    """Whether a GPU of this name takes the quantization kernels' wide tiles (``QUANT_WIDE_DEVICES``)."""
    return device_name in QUANT_WIDE_DEVICES


@functools.cache
def quant_wide(device_type: str, index: int | None) -> bool:
    """``is_quant_wide`` of a device, looked up once (an eager launch must not pay for the name)."""
    if device_type != "cuda":  # the interpreter on the CPU (tests)
        return False
    import torch

    return is_quant_wide(torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index))


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """``block_t`` tokens per program, experts laid out as ``[ng_p2 groups, pg_p2 per group]``."""

    block_t: int
    ng_p2: int
    pg_p2: int
    k_p2: int
    num_warps: int


@functools.lru_cache(maxsize=1024)
def routing_config(num_tokens: int, num_experts: int, top_k: int, n_group: int | None,
                   num_sms: int | None = None, *, block_t: int | None = None,
                   num_warps: int | None = None) -> RoutingConfig:
    """Routing holds ``block_t × ng_p2 × pg_p2`` float64 scores and int64 keys per program.

    Few tokens (decode): one token per program, so 128 tokens spread over 128 SMs, with
    ``ROUTING_DECODE_WARPS`` warps; many tokens: up to ``ROUTING_MAX_BLOCK_T`` per program and one warp
    per ``ROUTING_SLOTS_PER_WARP`` score slots, so the serial top-k reductions stay in a warp.
    """
    ng = n_group or 1
    ng_p2, pg_p2 = _pow2_ceil(ng), _pow2_ceil(num_experts // ng)
    width = ng_p2 * pg_p2
    sms = num_sms or get_num_sms()
    if block_t is None:
        by_regs = max(1024 // width, 1)
        by_spread = _pow2_floor(max(num_tokens // (2 * sms), 1))
        block_t = max(1, min(by_regs, by_spread, ROUTING_MAX_BLOCK_T))
    if num_warps is None:
        num_warps = min(ROUTING_MAX_WARPS, _pow2_ceil(-(-block_t * width // ROUTING_SLOTS_PER_WARP)))
        if block_t == 1 and width >= ROUTING_SLOTS_PER_WARP:
            num_warps = max(num_warps, ROUTING_DECODE_WARPS)
    return RoutingConfig(block_t, ng_p2, pg_p2, _pow2_ceil(top_k), num_warps)


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """``fused`` (masked layout, few pairs): one launch, ``block_t`` tokens × ``block_k`` bytes per
    program, each ranking its pairs in ``rank_chunk``-pair steps, and programs of their own counting
    ``e_block`` experts each for ``masked_m``. Otherwise count/scan over ``chunk``-pair chunks, then the
    scatter (``block_t`` × ``block_k``). ``num_warps``: the scatter's; ``route_warps``: the routing kernels'."""

    fused: bool
    chunk: int
    e_p2: int
    hist_experts: int
    scan_chunks: int
    scan_experts: int
    route_warps: int
    block_t: int
    block_k: int
    num_warps: int
    rank_chunk: int
    e_block: int
    sparse: bool = False  # the chunked scatter: one token per program, a branch per slot (``_scatter_sparse_kernel``)
    # count kernel: pairs compared this many at a time for their ranks in the chunk (0: one-hot column prefixes)
    rank_sub: int = 0
    # the dense contiguous scatter leaves the scales to a pass of their own over the output rows
    # (``_scale_rows_kernel``, see DISPATCH_SCALES_APART_MIN_PAIRS)
    scales_apart: bool = False


def mover_scales_apart(num_pairs: int, has_map: bool) -> bool:
    """Whether the Hopper row mover (``kernels/dispatch.py``) leaves the scales to ``_scale_rows_kernel``.
    Session 22, CUDA-graph timed, 7168 columns, top-8 of 256 (scales inline / apart, µs): 16384 tokens
    515.6 / 415.8, 8192 229.3 / 210.1, 4096 108.0 / 108.5, 1024 29.8 / 33.9; under an expert map (32
    local, 8192 tokens: an eighth of the pairs local) 41.1 / 46.6. Inline scales stay in L2 only up to a
    few MB of them (see impls/dispatch_rows.cuh). The masked layout (session 23, whole ``dispatch_masked``,
    top-8, inline / apart, µs): 32 experts 16384 tokens 490.8 / 425.0, 4096 121.8 / 114.3, 2048 62.1 / 59.3,
    1024 32.5 / 33.4; 2048 tokens over 256 experts 64.1 / 65.0; 8192 tokens, 32 of 256 local 50.6 / 59.8."""
    return not has_map and num_pairs >= DISPATCH_SCALES_APART_MIN_PAIRS


@functools.lru_cache(maxsize=1024)
def dispatch_config(num_tokens: int, top_k: int, hidden: int, num_experts: int, *,
                    fused: bool | None = None, block_t: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None, has_map: bool = False,
                    quant: bool = False, sparse: bool | None = None,
                    scales_apart: bool | None = None) -> DispatchConfig:
    """``fused`` applies to ``dispatch_masked`` only (the contiguous layout needs every expert's count
    before any position: it always takes the chunked path). ``has_map``: an ``expert_map`` selects the
    local experts (the chunked scatter's own defaults; by default the sparse scatter). ``quant``: the
    chunked scatter quantizes the rows it copies (``quant_dispatch_contiguous``). ``sparse``: the chunked
    scatter branches per slot (one token per program, so ``block_t`` must be 1). ``scales_apart``: the dense
    contiguous scatter's scales in a pass of their own (default: quantizing, from
    ``DISPATCH_QUANT_SCALES_APART_MIN_PAIRS`` pairs on)."""
    e_p2 = _pow2_ceil(num_experts)
    pairs = num_tokens * top_k
    if fused is None:
        fused = pairs <= DISPATCH_FUSED_MAX_PAIRS
    # Chunked path: 128 pairs per chunk, the within-chunk rank and the chunk histogram built 32 experts
    # at a time (128 × 32 one-hot tiles); the scan in slices of 4 experts, 1024 chunks (131072 pairs) a step.
    chunk, hist_experts, scan_experts, scan_chunks = 128, min(e_p2, 32), min(e_p2, 4), 1024
    # With more than one slice of experts the ranks come from comparing the chunk's pairs 32 at a time
    # (session 18, H100, count + scan at 16384 tokens x top-8, CUDA-graph timed: 256 experts local 61.1 ->
    # 24.5 us; 32 local, one slice, 13.3 us with column prefixes against 15.6 comparing).
    rank_sub = DISPATCH_RANK_SUB if e_p2 > hist_experts else 0
    k_p2 = _pow2_ceil(top_k)
    if fused:
        block_t = block_t or 1
        small = num_tokens <= DISPATCH_FUSED_SMALL_TOKENS
        block_k = block_k or min(_pow2_ceil(hidden), DISPATCH_FUSED_SMALL_BLOCK_K if small else DISPATCH_FUSED_BLOCK_K)
        num_warps = num_warps or (DISPATCH_FUSED_SMALL_WARPS if small else DISPATCH_FUSED_WARPS)
    else:
        if sparse is None:
            sparse = has_map and block_t in (None, 1)
        if sparse and block_t not in (None, 1):
            raise ValueError(f"the sparse scatter runs one token per program, got block_t={block_t}")
        block_t = block_t or max(1, min(DISPATCH_BLOCK_T, _pow2_floor(max(num_tokens, 1))))
        # (quant under a map with the dense scatter: the quant kernel runs apart, the scatter copies FP8)
        default_k, default_warps = ((DISPATCH_SPARSE_QUANT_BLOCK_K, DISPATCH_SPARSE_QUANT_WARPS) if quant and sparse
                                    else (DISPATCH_MAP_BLOCK_K, DISPATCH_MAP_WARPS) if has_map else
                                    (DISPATCH_QUANT_BLOCK_K, DISPATCH_QUANT_WARPS) if quant else
                                    (DISPATCH_BLOCK_K, DISPATCH_WARPS))
        block_k = block_k or min(_pow2_ceil(hidden), default_k)
        num_warps = num_warps or default_warps
    rank_chunk = max(16, min(_pow2_ceil(pairs), DISPATCH_RANK_TILE // (block_t * k_p2)))
    e_block = min(e_p2, DISPATCH_COUNT_EXPERTS)
    if scales_apart is None:
        scales_apart = quant and pairs >= DISPATCH_QUANT_SCALES_APART_MIN_PAIRS
    return DispatchConfig(fused, chunk, e_p2, hist_experts, scan_chunks, scan_experts, DISPATCH_ROUTE_WARPS,
                          block_t, block_k, num_warps, rank_chunk, e_block, bool(sparse) and not fused, rank_sub,
                          scales_apart)


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    block_t: int
    block_h: int
    num_warps: int
    gather_all: bool = False  # the top_k rows in one load (decode), else one load per slot
    sparse: bool = False  # one branch per slot (block_t 1): idle slots cost nothing (expert parallelism)


@functools.lru_cache(maxsize=1024)
def combine_config(num_tokens: int, hidden: int, *, block_t: int | None = None, block_h: int | None = None,
                   num_warps: int | None = None, gather_all: bool | None = None,
                   sparse: bool | None = None) -> CombineConfig:
    """``sparse``: a branch per slot (default wherever the rows are not gathered in one load: see
    ``COMBINE_SPARSE``); False: one predicated load per slot."""
    # bf16 rows: 1024 columns = 2 KiB per gathered row, 8 columns (16 bytes) per thread at 4 warps.
    large = num_tokens >= COMBINE_LARGE_FROM and block_h is None and num_warps is None
    block_h = block_h or min(_pow2_ceil(hidden), COMBINE_LARGE_BLOCK_H if large else COMBINE_BLOCK_H)
    block_t = block_t or max(1, min(COMBINE_BLOCK_T, _pow2_floor(max(num_tokens, 1))))
    if gather_all is None:
        gather_all = num_tokens <= COMBINE_GATHER_MAX_TOKENS
    sparse = (COMBINE_SPARSE if sparse is None else sparse) and block_t == 1 and not gather_all
    return CombineConfig(block_t, block_h, num_warps or (COMBINE_LARGE_WARPS if large else COMBINE_WARPS), gather_all,
                         sparse)
