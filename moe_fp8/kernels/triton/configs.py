"""Launch configurations of the Triton data-path kernels: plain Python over shapes, no GPU needed.

Every kernel here is memory-bound; a configuration only has to (a) move 16-byte vectors per thread,
(b) keep a tile small enough to stay in registers (no spills) and (c) launch enough programs to
cover 132 SMs several times over, while (d) never letting a program idle on rows that do not exist
(masked layouts). Sizes are powers of two (Triton tensor shapes). ``repr`` of a config is its
debug print.
"""

from __future__ import annotations

import dataclasses

from moe_fp8.utils import get_num_sms

# Elements of one quantization tile: 2048 fp32 values is 16 per thread at 4 warps, which keeps the
# fused SiLU kernel (gate, up, y and a few masks live at once) comfortably within 128 registers.
QUANT_TILE_ELEMS = 2048
# Programs per SM we aim for when a grid dimension is a free choice (masked row loops).
PROGRAMS_PER_SM = 8
# Triton grid limits: axis 0 up to 2**31 - 1, axes 1 and 2 up to 65535.
MAX_GRID_YZ = 65535


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


def quant_config(rows: int, k_groups: int, group_size: int, num_groups: int = 1,
                 masked: bool = False, num_sms: int | None = None) -> QuantConfig:
    """Config of ``per_token_group_quant`` / ``silu_mul_per_token_group_quant``.

    ``rows`` per leading group (``M`` or ``max_m``), ``k_groups`` scale groups per row, ``num_groups``
    leading groups (1 for 2-D inputs). Without a mask every row block gets its own program; with one,
    ``row_programs`` programs per (column block, group) stride over the valid row blocks only, so a
    mostly empty ``[G, max_m, ·]`` buffer costs no idle programs beyond that fixed count.
    """
    gs_p2 = _pow2_ceil(group_size)
    per_row = max(QUANT_TILE_ELEMS // gs_p2, 1)
    # Up to 8 groups (1024 columns at 128) side by side; the rest of the tile goes to rows.
    block_g = min(_pow2_ceil(k_groups), per_row, 8)
    block_r = max(min(per_row // block_g, _pow2_ceil(rows)), 1)
    row_blocks = -(-max(rows, 1) // block_r)
    col_blocks = -(-k_groups // block_g)
    if masked:
        sms = num_sms or get_num_sms()
        target = max(1, (PROGRAMS_PER_SM * sms) // max(col_blocks * num_groups, 1))
        row_programs = max(1, min(row_blocks, target))
    else:
        row_programs = row_blocks
    tile = block_r * block_g * gs_p2
    return QuantConfig(block_r, block_g, gs_p2, 8 if tile >= 4096 else 4, row_programs)


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """``block_t`` tokens per program, experts laid out as ``[ng_p2 groups, pg_p2 per group]``."""

    block_t: int
    ng_p2: int
    pg_p2: int
    k_p2: int
    num_warps: int


# Largest expert count one program holds (the whole row of scores lives in registers).
MAX_ROUTING_EXPERTS = 1024


def routing_config(num_tokens: int, num_experts: int, top_k: int, n_group: int | None,
                   num_sms: int | None = None) -> RoutingConfig:
    """Routing holds ``block_t × ng_p2 × pg_p2`` float64 scores and int64 keys per program.

    Few tokens (decode): one token per program, so 128 tokens still spread over 128 SMs; many tokens:
    up to 1024 slots per program.
    """
    ng = n_group or 1
    ng_p2, pg_p2 = _pow2_ceil(ng), _pow2_ceil(num_experts // ng)
    width = ng_p2 * pg_p2
    sms = num_sms or get_num_sms()
    by_regs = max(1024 // width, 1)
    by_spread = _pow2_floor(max(num_tokens // (2 * sms), 1))
    block_t = max(1, min(by_regs, by_spread))
    num_warps = 4 if block_t * width <= 512 else 8
    return RoutingConfig(block_t, ng_p2, pg_p2, _pow2_ceil(top_k), num_warps)


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Counting: ``chunk`` (token, slot) pairs per program; scan: ``scan_chunks × scan_experts`` tiles;
    scatter: ``block_t`` tokens × ``block_k`` bytes per program."""

    chunk: int
    e_p2: int
    hist_experts: int
    scan_chunks: int
    scan_experts: int
    block_t: int
    block_k: int
    num_warps: int


def dispatch_config(num_tokens: int, top_k: int, hidden: int, num_experts: int) -> DispatchConfig:
    # 128 pairs per chunk: the within-chunk rank is a 128 × 128 comparison (16K lanes of work), and
    # the chunk histogram is built 32 experts at a time (128 × 32 one-hot tiles).
    chunk = 128
    e_p2 = _pow2_ceil(num_experts)
    hist_experts = min(e_p2, 32)
    scan_experts = min(e_p2, 16)
    scan_chunks = 256
    # Scatter: 16-byte vectors, 2 KiB of a row per program, 4 rows, top_k stores of each.
    block_k = min(_pow2_ceil(hidden), 2048)
    block_t = max(1, min(4, _pow2_floor(max(num_tokens, 1))))
    return DispatchConfig(chunk, e_p2, hist_experts, scan_chunks, scan_experts, block_t, block_k, 4)


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    block_t: int
    block_h: int
    num_warps: int


def combine_config(num_tokens: int, hidden: int) -> CombineConfig:
    # bf16 rows: 1024 columns = 2 KiB per gathered row, 8 columns (16 bytes) per thread at 4 warps.
    block_h = min(_pow2_ceil(hidden), 1024)
    block_t = max(1, min(4, _pow2_floor(max(num_tokens, 1))))
    return CombineConfig(block_t, block_h, 4)
