"""Launch wrapper of the few-rows FP8 GEMM (impls/fp8_gemm_few_rows.cuh): the Hopper path of decode GEMMs in
place of the wgmma kernel, whose tiles leave one touched expert on a few SMs and walk long K serially
(docs/kernels/gemm.md, session 51): masked GEMMs whose groups hold at most ``max_rows`` rows (decode batches
of that many tokens: the layer's masked layout has ``max_m`` = tokens), masked GEMMs of small groups expected to
hold few rows whatever ``max_m`` (groups past a chunk's rows walked in chunks: session 53), and normal GEMMs of a
few rows at long K (more of them next to few-rows GEMMs: ``beside_few_rows``, session 60).

Arguments are validated by the public API before they get here; ``applies`` says which calls it takes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator

import torch

from ..utils import ceil_div, get_num_sms
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/fp8_gemm_few_rows.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::few_rows::fp8_gemm_few_rows_kernel<
        /*SHAPE_N=*/{n}, /*SHAPE_K=*/{k}, /*kTokenTiles=*/{token_tiles}, /*kSplitK=*/{split_k}, /*kOutF32=*/{out_f32},
        /*kChunked=*/{chunked}>;
}}
"""

# Rows a group may hold (mma.sync's 8 columns per token tile, two tiles); 0 turns the path off (A/B runs).
# Groups of more than SMALL_GROUP_BYTES of weights take it up to WIDE_MAX_ROWS: with 9-16 decode tokens an EP-8
# rank of DeepSeek-V3 / Kimi-K2 touches 13-14 of its experts, whose 64-row wgmma tiles then stream the weights
# 2-8% faster; the smaller experts of Qwen3-235B (12.6 / 6.3 MB) and of TP-8 shards (3.7 / 1.8 MB) run 0-37%
# faster here at 16 tokens (H200; docs/benchmarks/h100-few-rows.md).
MAX_ROWS = 16
WIDE_MAX_ROWS = 8
SMALL_GROUP_BYTES = 13 << 20
# Normal GEMMs (decode linears) of up to NORMAL_MAX_ROWS rows and K of NORMAL_MIN_K or more: there a wgmma
# tile's serial walk over K is what bounds it (H100, DeepSeek-V3's linears, M = 1-8: q_a + kv_a 2112 x 7168
# 1.40-1.82x, o_proj 7168 x 16384 1.10-1.22x, the shared experts' 4096 x 7168 1.17-1.23x, 36864 x 7168 even);
# with shorter K the wgmma kernel is as fast or takes up to 21% less time (kv_b_proj 4096 x 512)
# (docs/benchmarks/h100-few-rows.md).
NORMAL_MAX_ROWS = 8
NORMAL_MIN_K = 4096
# ... and up to MAX_ROWS rows at K of NORMAL_WIDE_MIN_K or more where the kernel's 16-row tiles fit one wave of its
# grid (``items`` at most CTAS_PER_SM per SM): past one wave the last items run as a second, near-empty round
# (TP 8's gate-up 4608 x 7168: 288 items on 264 CTAs, 0.88-0.91x the wgmma kernel at 12-16 rows on the H200, 0.89x
# on the H100). 12 / 16 rows, x the wgmma kernel, H200 (session 61) / H100 (session 51, 16 rows): q_a + kv_a
# 2112 x 7168 1.25 / 1.24, 1.13; the shared experts' 4096 x 7168 1.11 / 1.15, 1.10; their TP-8 512 x 7168 1.15 /
# 1.15, 1.18. At K = 4096 it broke even (Qwen3-235B's TP-4 qkv 2304 x 4096: 1.02 / 1.01, 0.99); past one wave it
# gained on the H200 only (o_proj 7168 x 16384: 1.14 / 1.09, 1.02 on the H100) or lost (36864 x 7168: 0.90 / 0.90,
# 0.94) (docs/benchmarks/calibration/s61-few-rows-unroll-2t-h200.txt, its 'shipped' column).
NORMAL_WIDE_MIN_K = 7168
# Normal GEMMs next to few-rows ones (``beside_few_rows``: a MoE layer's shared experts, in line before its routed
# GEMMs or beside them on a side stream) run here up to MAX_ROWS rows at any K, and up to NORMAL_CHUNKED_MAX_ROWS
# (in chunks) of weights of at most SMALL_GROUP_BYTES: a wgmma kernel right before a few-rows one (a PDL dependent,
# or beside it on another stream) leaves the few-rows kernel 1.5-1.7x slower for its whole run. H200, DeepSeek-V3's
# layer with its shared expert replayed in line, µs, the rule above -> this one: TP 8 at 1 / 8 / 16 / 32 / 64
# tokens 49.4 / 175.9 / 295.9 / 425.1 / 427.8 -> 42.0 / 128.6 / 205.1 / 276.6 / 388.1; EP 8 at 1 / 8 tokens 106.6 /
# 130.6 -> 75.3 / 95.0 (its 29 MB gate-up weights in chunks at 32 tokens: 297.7 -> 332.7, hence the size bound).
# Alone, the other linears mostly ran faster on the wgmma kernel past 8 rows (TP 8's q_b_proj 3072 x 1536 at 16-64
# rows 0.50-0.73x here, H200), hence the scope (docs/kernels/datapath.md, session 60).
NORMAL_CHUNKED_MAX_ROWS = 64
_BESIDE_FEW_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_fp8_beside_few_rows", default=False)
# Masked GEMMs of any max_m whose groups (of at most SMALL_GROUP_BYTES) are expected to hold at most
# CHUNKED_MAX_EXPECTED rows (the callers' expected_m hint; 0 turns this off): TP-sharded and small experts at decode
# batches past 16 tokens, and engines' batched layouts (max_m: the dispatch's capacity). Their rows run in chunks
# of 8 * CHUNK_TOKEN_TILES, a group of more (a hot expert) in several. H100, one rank's layer replayed against the
# wgmma kernel at 24-64 tokens: DeepSeek-V3 TP 8 1.08-1.18x, Qwen3-235B-A22B EP 8 1.01-1.06x (H200: 1.10-1.18x,
# 1.04-1.12x); the down projections gain most (TP 8's 7168 x 256 GEMM 1.16-1.26x), the gate-up ones at long K
# about break even alone (512 x 7168 0.98-1.05x; the layer was as fast or faster with them on). With 8 rows
# expected it lost, and chunks of 16 rows were no faster at 1-4 (docs/kernels/gemm.md, session 53).
CHUNKED_MAX_EXPECTED = 4
CHUNK_TOKEN_TILES = 1
# Masked GEMMs of 9-16 rows a group (max_m) expected to hold at most NARROW_MAX_EXPECTED rows (the hint) take
# CHUNK_TOKEN_TILES token tiles a warp in chunks of rows too, instead of two: a warp of one tile keeps two K blocks of
# loads in flight, one of two tiles one; a group of more rows (rare at decode) is two chunks and reads its weights
# twice. H200, 9 / 12 / 16 decode tokens (hint 1), µs, two tiles -> chunks: DeepSeek-V3 TP 8's 7168 x 256 GEMM 41.3 /
# 50.4 / 59.5 -> 38.8 / 46.8 / 56.4, its 512 x 7168 even; Qwen3-235B-A22B EP 8's 4096 x 1536 26.8 / 26.9 / 29.6 ->
# 25.2 / 25.2 / 28.5, 3072 x 4096 2-5% faster; those ranks' layers 0-2% (docs/kernels/gemm.md, session 62). Larger
# hints were not measured. 0: two tiles (A/B runs).
NARROW_MAX_EXPECTED = 1
# The gate-up GEMM with the fused SiLU·mul + quant epilogue takes the chunked regime only where the wgmma kernel's
# 256-wide tiles over the experts expected to be touched fill at most CHUNKED_FUSED_MAX_WAVES waves
# (``fused_waves``): here it writes an FP32 h of [G, max_m, 2I] and runs SiLU·mul + quant apart, where the wgmma
# kernel does both in one pass and, with enough tiles, streams the weights as fast. H200, one rank's layer
# replayed, chunked gate-up GEMM on / off (the down projection chunked in both; docs/kernels/gemm.md, session 55):
# on paid where the tiles fill few waves (Qwen3-30B-A3B EP 8, 0.7 waves: 1.10-1.18x against 1.06-1.08x at 24-64
# tokens; Qwen3-235B-A22B, <= 1.5: 1.03-1.11x against 1.01-1.05x; MiniMax-M2 EP 8 at 24-48 tokens, 1.8-2.5:
# 1.09-1.16x against 1.02-1.05x) and lost past them (DeepSeek-V3 TP 8 at 48-128 tokens, 3.4-3.9 waves: 1.04-1.12x
# against 1.12-1.15x; MiniMax-M2 at 96-128, 2.8: 0.98-0.99x against 1.00-1.01x); DeepSeek-V3 TP 8 at 24-32
# tokens (2.45) was even. With the bound, that rank 4-7% faster at 48-128 tokens, MiniMax-M2's 1-3% at 96-128, the
# others unchanged. None: the fused GEMM takes it wherever the unfused one would (A/B runs).
CHUNKED_FUSED_MAX_WAVES: float | None = 2.6
FUSED_TILE_N = 256  # the wgmma kernel's gate-up tiles under the fused epilogue (a gate and an up block)
# ... and never where that FP32 h would pass FUSED_H_MAX_BYTES: an engine's batched layout sizes max_m by its
# dispatch capacity (DeepSeek-V3 at TP 8, 256 experts x 768 rows x 512 columns: a 403 MB transient per call, which an
# engine's memory profile would reserve). The wgmma kernel needs no h; decode batches of our own layer (max_m = the
# tokens) stay far under it (DeepSeek-V3 TP 8 at 32 tokens: 17 MB).
FUSED_H_MAX_BYTES = 64 << 20
MAX_GROUPS = 1024  # compacted in shared memory (few_rows::kMaxGroups)
WARPS = 8
TILE_N = 16
CTAS_PER_SM = 2
# K blocks one warp walks at least: K splits into at most WARPS pieces of this many blocks or more.
MIN_SPLIT_K_BLOCKS = 4


def max_rows(n: int, k: int) -> int:
    """The most rows a group of N × K weights may hold to run here."""
    return MAX_ROWS if n * k <= SMALL_GROUP_BYTES else min(MAX_ROWS, WIDE_MAX_ROWS)


def fused_waves(n: int, num_groups: int, expected_m: int, num_sms: int) -> float:
    """Waves of the wgmma kernel's ``FUSED_TILE_N``-wide gate-up tiles (one 64-row block a group) over the groups
    a masked batch is expected to touch, each group's rows taken as Poisson(``expected_m``): a fraction
    ``1 - exp(-expected_m)`` of the groups hold any."""
    touched = num_groups * -math.expm1(-expected_m)
    return touched * ceil_div(n, FUSED_TILE_N) / num_sms


def applies(max_m: int, n: int, k: int, num_groups: int, expected_m: int | None = None, *,
            fused: bool = False, num_sms: int | None = None) -> bool:
    """Whether a masked GEMM of ``num_groups`` groups of up to ``max_m`` rows at N × K runs here: groups of at
    most ``max_rows``, or small groups expected (``expected_m``, a hint) to hold at most ``CHUNKED_MAX_EXPECTED``.
    ``fused``: the gate-up GEMM of the fused SiLU·mul + quant epilogue, whose FP32 h must fit
    ``FUSED_H_MAX_BYTES``, chunked only where the wgmma kernel's tiles would fill at most
    ``CHUNKED_FUSED_MAX_WAVES`` waves of ``num_sms`` (default ``get_num_sms()``)."""
    if not (max_m > 0 and n % 8 == 0 and k % 16 == 0 and 0 < num_groups <= MAX_GROUPS):
        return False
    if fused and num_groups * max_m * n * 4 > FUSED_H_MAX_BYTES:
        return False
    if max_m <= max_rows(n, k):
        return True
    if not (expected_m is not None and 0 < expected_m <= CHUNKED_MAX_EXPECTED and n * k <= SMALL_GROUP_BYTES
            and max_m < 1 << 24):
        return False
    return (not fused or CHUNKED_FUSED_MAX_WAVES is None
            or fused_waves(n, num_groups, expected_m, num_sms or get_num_sms()) <= CHUNKED_FUSED_MAX_WAVES)


def token_tiles(max_m: int, expected_m: int | None = None) -> int:
    """8-row token tiles of a warp's MMAs: enough for ``max_m`` up to ``MAX_ROWS`` (unless groups are expected to
    hold at most ``NARROW_MAX_EXPECTED``), else a chunk's."""
    if max_m <= 8:
        return 1
    narrow = expected_m is not None and 0 < expected_m <= NARROW_MAX_EXPECTED
    return ceil_div(max_m, 8) if max_m <= MAX_ROWS and not narrow else CHUNK_TOKEN_TILES


@contextlib.contextmanager
def beside_few_rows() -> Iterator[None]:
    """Normal GEMMs enqueued inside (on this thread) take the wider rule of ``applies_normal``: for GEMMs that run
    right before few-rows ones, or beside them on another stream (a MoE layer's shared experts)."""
    token = _BESIDE_FEW_ROWS.set(True)
    try:
        yield
    finally:
        _BESIDE_FEW_ROWS.reset(token)


def applies_normal(m: int, n: int, k: int, beside: bool | None = None, num_sms: int | None = None) -> bool:
    """Whether a normal GEMM of M × N × K runs here: up to ``NORMAL_MAX_ROWS`` rows at K of ``NORMAL_MIN_K`` or
    more, up to ``MAX_ROWS`` at K of ``NORMAL_WIDE_MIN_K`` or more where its items fit one wave of ``num_sms``
    (default ``get_num_sms()``); ``beside`` (default: inside ``beside_few_rows``) up to ``MAX_ROWS`` rows at any K,
    and up to ``NORMAL_CHUNKED_MAX_ROWS`` of weights of at most ``SMALL_GROUP_BYTES``."""
    if not (m > 0 and n % 8 == 0 and k % 16 == 0):
        return False
    if not (_BESIDE_FEW_ROWS.get() if beside is None else beside):
        if m <= NORMAL_MAX_ROWS:
            return k >= NORMAL_MIN_K
        return (m <= MAX_ROWS and k >= NORMAL_WIDE_MIN_K
                and items(n, k, 1, m) <= CTAS_PER_SM * (num_sms or get_num_sms()))
    return m <= MAX_ROWS or (m <= NORMAL_CHUNKED_MAX_ROWS and n * k <= SMALL_GROUP_BYTES)


def split_k(k: int) -> int:
    """Warps sharing one 16-row tile's K: the most (a power of two, at most ``WARPS``) that leave each
    ``MIN_SPLIT_K_BLOCKS`` K blocks, so one expert's tiles fill the GPU with loads in flight."""
    blocks, split = ceil_div(k, 128), 1
    while split < WARPS and blocks // (2 * split) >= MIN_SPLIT_K_BLOCKS:
        split *= 2
    return split


def kernel_variant(n: int, k: int, max_m: int, out_f32: bool = False, expected_m: int | None = None
                   ) -> tuple[str, str]:
    """``(name, source)`` of the variant a call compiles: pure host code (``moe-fp8 warmup`` uses it)."""
    from .gemm import env_defines

    tiles, sk = token_tiles(max_m, expected_m), split_k(k)
    chunked = max_m > 8 * tiles
    source = env_defines() + KERNEL_TEMPLATE.format(n=n, k=k, token_tiles=tiles, split_k=sk,
                                                    out_f32=str(out_f32).lower(), chunked=str(chunked).lower())
    return f"fp8_gemm_few_rows_n{n}_k{k}_t{tiles}_s{sk}{'_f32' if out_f32 else ''}{'_c' if chunked else ''}", source


def items(n: int, k: int, num_groups: int, max_m: int = 1, expected_m: int | None = None) -> int:
    """Work items of a launch where every group has ``max_m`` rows (the kernel walks only the chunks of rows
    there are)."""
    rows = 8 * token_tiles(max_m, expected_m)
    return num_groups * ceil_div(max_m, rows) * ceil_div(n, TILE_N * (WARPS // split_k(k)))


@functools.cache
def _launch_plan(n: int, k: int, num_groups: int, max_m: int, expected_m: int | None, tiles: int, out_f32: bool,
                 num_sms: int):
    """``(kernel, grid, pdl)`` of a launch, built once (decode calls repeat the same few shapes); ``tiles``:
    ``token_tiles(max_m, expected_m)``, part of the key only (A/B runs change ``CHUNK_TOKEN_TILES``)."""
    from .gemm import _pdl

    kernel = build(*kernel_variant(n, k, max_m, out_f32, expected_m))
    return kernel, min(items(n, k, num_groups, max_m, expected_m), CTAS_PER_SM * num_sms), _pdl()


def launch(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
           masked_m: torch.Tensor | None, expected_m: int | None = None) -> None:
    """``out [G, max_m, N]`` (bf16 or FP32) of the masked GEMM over ``x_fp8 [G, max_m, K]``, rows past
    ``masked_m[g]`` untouched, ``expected_m`` the callers' hint; with ``masked_m`` None, the normal GEMM of
    ``x_fp8 [M, K]`` (``out [M, N]``). Inputs validated, ``applies`` true."""
    masked = masked_m is not None
    num_groups, max_m = (x_fp8.shape[0], x_fp8.shape[1]) if masked else (1, x_fp8.shape[0])
    expected_m = expected_m if masked else None
    n, k = w.shape[-2], w.shape[-1]
    kernel, grid, pdl = _launch_plan(n, k, num_groups, max_m, expected_m, token_tiles(max_m, expected_m),
                                     out.dtype == torch.float32, get_num_sms())
    # x_scale: token-major columns (stride 1 along M), one per 128-K block, one block per group
    xs_group = x_scale.stride(0) if masked else 0
    xs_k = x_scale.stride(-1) if x_scale.shape[-1] > 1 else 0
    kernel.launch(grid, 32 * WARPS, [x_fp8, x_scale, w, w_scale, out, masked_m, num_groups, max_m, xs_group, xs_k],
                  pdl=pdl)
