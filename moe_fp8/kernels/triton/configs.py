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
# Elements of one tile: 2048 fp32 values is 16 per thread at 4 warps, which keeps the SiLU variant
# (gate, up, y and a few masks live at once) within 128 registers. Measured at 2048 on an H100
# (81% of copy BW at 16384×7168); the sweep tries 4096 / 8192 at 8 warps for the mid sizes.
QUANT_TILE_ELEMS = 2048
QUANT_SILU_TILE_ELEMS = 2048
# Warps per program: tiles of >= QUANT_WARPS_8_FROM elements use 8, smaller ones 4.
QUANT_WARPS_8_FROM = 4096
# Scale groups side by side in one tile row (8 × 128 = 1024 columns): the rest of the tile is rows.
QUANT_MAX_BLOCK_G = 8
# Masked layouts: programs per SM we aim for when the row loop's program count is a free choice.
PROGRAMS_PER_SM = 8

# ---- routing (select_experts) ----
# Largest expert count one program holds (the whole row of scores lives in registers).
MAX_ROUTING_EXPERTS = 1024
# Score slots (tokens × experts) per warp: a warp-sized token tile keeps every top-k reduction
# inside the warp (shuffles, no shared-memory round trip) — the top-k loop is latency-bound.
ROUTING_SLOTS_PER_WARP = 256
ROUTING_MAX_WARPS = 4
ROUTING_MAX_BLOCK_T = 4

# ---- dispatch ----
# Pairs (token, slot) × local experts up to which one program routes every pair (ranks, counts,
# masked_m / segment starts) in a single launch; above it, count + scan kernels over chunks.
DISPATCH_SINGLE_PROGRAM_WORK = 1 << 19
DISPATCH_SINGLE_PROGRAM_WARPS = 8
# Scatter: bytes of a row per program (16-byte vectors) and token rows per program.
DISPATCH_BLOCK_K = 2048
DISPATCH_BLOCK_T = 4
DISPATCH_WARPS = 4

# ---- combine ----
COMBINE_BLOCK_H = 1024
COMBINE_BLOCK_T = 4
COMBINE_WARPS = 4


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
                 max_block_g: int | None = None, programs_per_sm: int | None = None) -> QuantConfig:
    """Config of ``per_token_group_quant`` / ``silu_mul_per_token_group_quant``.

    ``rows`` per leading group (``M`` or ``max_m``), ``k_groups`` scale groups per row, ``num_groups``
    leading groups (1 for 2-D inputs). Without a mask every row block gets its own program; with one,
    ``row_programs`` programs per (column block, group) stride over the valid row blocks only, so a
    mostly empty ``[G, max_m, ·]`` buffer costs no idle programs beyond that fixed count.
    Keyword knobs override the module constants (``scripts/datapath_sweep.py``).
    """
    tile = tile_elems or (QUANT_SILU_TILE_ELEMS if silu else QUANT_TILE_ELEMS)
    gs_p2 = _pow2_ceil(group_size)
    per_row = max(tile // gs_p2, 1)
    block_g = min(_pow2_ceil(k_groups), per_row, max_block_g or QUANT_MAX_BLOCK_G)
    block_r = max(min(per_row // block_g, _pow2_ceil(rows)), 1)
    row_blocks = -(-max(rows, 1) // block_r)
    col_blocks = -(-k_groups // block_g)
    if masked:
        sms = num_sms or get_num_sms()
        target = max(1, ((programs_per_sm or PROGRAMS_PER_SM) * sms) // max(col_blocks * num_groups, 1))
        row_programs = max(1, min(row_blocks, target))
    else:
        row_programs = row_blocks
    elems = block_r * block_g * gs_p2
    warps = num_warps or (8 if elems >= QUANT_WARPS_8_FROM else 4)
    return QuantConfig(block_r, block_g, gs_p2, warps, row_programs)


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

    Few tokens (decode): one token per program, so 128 tokens spread over 128 SMs; many tokens: up to
    ``ROUTING_MAX_BLOCK_T`` per program. Warps: one per ``ROUTING_SLOTS_PER_WARP`` score slots (one
    warp for DeepSeek-V3's 256 experts and a token), so the serial top-k reductions stay in a warp.
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
    return RoutingConfig(block_t, ng_p2, pg_p2, _pow2_ceil(top_k), num_warps)


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Routing of the pairs: ``single_program`` (one launch) or count/scan over ``chunk``-pair chunks;
    scatter: ``block_t`` tokens × ``block_k`` bytes per program."""

    single_program: bool
    chunk: int
    e_p2: int
    hist_experts: int
    scan_chunks: int
    scan_experts: int
    route_warps: int
    block_t: int
    block_k: int
    num_warps: int


@functools.lru_cache(maxsize=1024)
def dispatch_config(num_tokens: int, top_k: int, hidden: int, num_experts: int, *,
                    single_program: bool | None = None, block_t: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None) -> DispatchConfig:
    e_p2 = _pow2_ceil(num_experts)
    pairs = num_tokens * top_k
    if single_program is None:
        single_program = pairs * e_p2 <= DISPATCH_SINGLE_PROGRAM_WORK
    # Single program: chunks of pairs × every expert as a one-hot tile (a cumsum gives ranks), 16K
    # slots per step. Chunked path: 128 pairs per chunk, the within-chunk rank a 128 × 128 comparison
    # and the chunk histogram built 32 experts at a time (128 × 32 one-hot tiles).
    chunk = max(16, min(128, (1 << 14) // e_p2)) if single_program else 128
    hist_experts = min(e_p2, 32)
    scan_experts = min(e_p2, 16)
    scan_chunks = 256
    block_k = block_k or min(_pow2_ceil(hidden), DISPATCH_BLOCK_K)
    block_t = block_t or max(1, min(DISPATCH_BLOCK_T, _pow2_floor(max(num_tokens, 1))))
    return DispatchConfig(single_program, chunk, e_p2, hist_experts, scan_chunks, scan_experts,
                          DISPATCH_SINGLE_PROGRAM_WARPS, block_t, block_k, num_warps or DISPATCH_WARPS)


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    block_t: int
    block_h: int
    num_warps: int


@functools.lru_cache(maxsize=1024)
def combine_config(num_tokens: int, hidden: int, *, block_t: int | None = None, block_h: int | None = None,
                   num_warps: int | None = None) -> CombineConfig:
    # bf16 rows: 1024 columns = 2 KiB per gathered row, 8 columns (16 bytes) per thread at 4 warps.
    block_h = block_h or min(_pow2_ceil(hidden), COMBINE_BLOCK_H)
    block_t = block_t or max(1, min(COMBINE_BLOCK_T, _pow2_floor(max(num_tokens, 1))))
    return CombineConfig(block_t, block_h, num_warps or COMBINE_WARPS)
