"""Launch wrapper of the Hopper block-scaled FP8 GEMM (impls/fp8_gemm.cuh).

Order of work in each call: descriptor → config (heuristics) → JIT variant (cached) → TMA
descriptors → launch. Arguments are validated by the public API (moe_fp8.fp8_gemm) before they get
here; this module only checks what the kernel itself relies on.
"""

from __future__ import annotations

import functools
import os

import torch

from ..utils import ceil_div, get_num_sms, get_tma_aligned_m, truthy
from . import few_rows
from .heuristics import (
    BLOCK_K,
    SWIZZLE_GROUP_M,
    GemmConfig,
    GemmDesc,
    Layout,
    get_config,
    k_pieces_fit,
    num_tiles,
    tail_split_ok,
)
from .jit import build, make_tma_2d
from .jit.runtime import _current_stream

KERNEL_TEMPLATE = """#include "moe_fp8/impls/fp8_gemm.cuh"

// One variant: shapes a model fixes (N, K) and the tile configuration are compile-time constants;
// taking the kernel's address instantiates it.
__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::fp8_gemm_kernel<
        /*SHAPE_N=*/{n}, /*SHAPE_K=*/{k}, /*BLOCK_M=*/{block_m}, /*BLOCK_N=*/{block_n},
        /*kNumStages=*/{num_stages}, /*kSmemBytes=*/{smem_bytes}, /*kActQuant=*/{act_quant}, /*kABoxRows=*/{a_box},
        moe_fp8::sched::{scheduler}<{block_m}, {block_n}, {n}, {k}, {swizzle_group_m}{sched_args}>>;
}}
"""

SCHEDULERS: dict[Layout, str] = {
    "normal": "NormalScheduler",
    "contiguous": "ContiguousScheduler",
    "masked": "MaskedScheduler",
}


def _tail_split(cfg: GemmConfig, act_quant: int) -> bool:
    """Whether the variant splits a short last wave: as configured, except that under the fused SiLU·mul +
    quant epilogue, which needs both halves of a tile, it splits only into K pieces (``k_split``)."""
    return cfg.tail_split and (not act_quant or cfg.k_split)


# K-split workspace (epilogue/k_split.cuh), one per stream: flags (a word per CTA, zero between launches) and slots
# (one FP32 tile, up to 128 x 256, per CTA). The flags come from a per-device pool zeroed outside any capture, so a
# CUDA graph captured on a stream without a workspace yet needs no zeroing node: that node ran before the GEMM at
# every replay and cut its programmatic (early) launch: the bench layer's one-token decode replay read 66.4 us as the
# process's first capture against 63.7 for a later one (session 46, H100; docs/kernels/gemm.md).
K_SPLIT_FLAG_WORDS = 1024
K_SPLIT_SLOT_WORDS = 128 * 256
K_SPLIT_FLAG_POOL = 64  # streams' flags zeroed at once per device
_K_SPLIT_FLAG_POOLS: dict[int, list[torch.Tensor]] = {}  # device -> zeroed flags no stream has taken
_K_SPLIT_WORKSPACES: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (device, stream) -> flags, slots
_K_SPLIT_OUTGROWN: list[torch.Tensor] = []  # slots replaced by larger ones; a captured graph may still use them

# L2 warm-up before a masked GEMM's first loads (impls/fp8_gemm.cuh): the weights' first WARM_K_BLOCKS K blocks,
# for at most WARM_MAX_GROUPS groups (with more, which weights the first tiles need is not known before the counts;
# four groups of ~230 rows measured 0.9 us slower). Measured (H100, kernel durations, docs/kernels/gemm.md,
# sessions 28-29): 0.7-1.2 us faster for 1-2 groups of 1-120 rows (10.7 -> 9.9 us: one row at 7168x2048), 0.2-1.1
# us for single groups of 700-1839 rows, even at 1300 and 4096 rows of 7168x2048. Five K blocks, or the activation
# rows' first K blocks as well, were no better anywhere.
WARM_K_BLOCKS, WARM_MAX_GROUPS = 2, 2


def warm_k_blocks(layout: Layout, num_groups: int) -> int:
    """K blocks of the weights a launch prefetches into L2 before reading its counts (0: none)."""
    return WARM_K_BLOCKS if layout == "masked" and num_groups <= WARM_MAX_GROUPS else 0


# Bulk-copied tile stores (epilogue/store.cuh) for 128-row tiles where a launch's CTAs run ASYNC_STORE_MIN_TILES
# tiles each or more: every tile but a CTA's last leaves shared memory as one cp.async.bulk a row, so the store
# warps issue a few instructions a tile instead of ~40 each beside the math. Session 29 (H100, kernel durations,
# docs/kernels/gemm.md), same process: normal 4096x7168x2048 / 4096x32768x512 / 4096x7168x16384 2.7 / 6.9 / 1.9%
# faster, contiguous 8 x 4096 rows at 7168x2048 4.0%, 4 x 8192 at 4096x7168 1.6%. With fewer tiles a CTA they
# cost (1 x 1206 masked rows at 4096x7168, 1.2 tiles a CTA: 2% slower; 805 at 7168x2048, 3.0: 0.5%), and 64-row
# tiles gained nothing (decode GEMMs even) or lost (128x32768x512 on 64x128 tiles, 3.9 a CTA: 13.0 -> 14.2 us in
# the record of ca3585e, which bulk-copied them).
ASYNC_STORE_MIN_TILES = 3.5


def async_stores(num_tiles: int, num_ctas: int, block_m: int) -> bool:
    """Whether a launch of ``num_tiles`` tiles of ``block_m`` rows (an upper bound when masked) on ``num_ctas``
    persistent CTAs stores its tiles by bulk copies."""
    return block_m == 128 and num_tiles >= ASYNC_STORE_MIN_TILES * num_ctas


def _reserve_k_split_flags(device_index: int) -> None:
    """Zero the device's pool of K-split flags, once, unless the current stream is capturing a CUDA graph
    (then the zeroing would be a node of the graph). Every launch with new arguments calls it, so an engine's
    eager runs (a profile run, a warm-up) fill it before it captures its decode graphs."""
    if device_index in _K_SPLIT_FLAG_POOLS or torch.cuda.is_current_stream_capturing():
        return
    pool = torch.zeros((K_SPLIT_FLAG_POOL, K_SPLIT_FLAG_WORDS), dtype=torch.int32,
                       device=torch.device("cuda", device_index))
    # other streams take these flags: the zeros must land before any of them runs a launch
    torch.cuda.current_stream(device_index).synchronize()
    _K_SPLIT_FLAG_POOLS[device_index] = list(pool.unbind(0))


def _k_split_workspace(device_index: int, num_ctas: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(flags, slots)``, the K-split workspace of the current stream on ``device_index``, or None (run the tail
    as halves).

    One per stream: launches on one stream run in order and share it; two streams could run at once, so they
    never do. Its flags start at zero (from the device's pool, or zeroed here on the stream when the pool is
    used up or was never filled) and every launch leaves them at zero; its slots need no zeroing. Made during a
    CUDA-graph capture, its slots come from the graph's pool; later launches and captures on that stream reuse
    it. (Replays run on the replaying stream: a graph that shares a workspace must not be replayed beside other
    launches on its capture stream.)
    """
    if num_ctas > K_SPLIT_FLAG_WORDS:
        return None
    key = (device_index, _current_stream(device_index))
    workspace = _K_SPLIT_WORKSPACES.get(key)
    if workspace is None or workspace[1].numel() < num_ctas * K_SPLIT_SLOT_WORDS:
        device = torch.device("cuda", device_index)
        if workspace is not None:
            flags = workspace[0]
            _K_SPLIT_OUTGROWN.append(workspace[1])
        else:
            pool = _K_SPLIT_FLAG_POOLS.get(device_index)
            flags = pool.pop() if pool else torch.zeros(K_SPLIT_FLAG_WORDS, dtype=torch.int32, device=device)
        slots = torch.empty(num_ctas * K_SPLIT_SLOT_WORDS, dtype=torch.float32, device=device)
        workspace = _K_SPLIT_WORKSPACES[key] = (flags, slots)
    return workspace


def a_box_rows(cfg: GemmConfig) -> int:
    """Rows of one TMA box of A: ``cfg.a_box_rows`` where set (grouped layouts), else a tile's (a multicast half's)."""
    if cfg.a_box_rows:
        return cfg.a_box_rows
    return cfg.block_m // (cfg.multicast if cfg.multicast_on_a else 1)


def generate_source(layout: Layout, n: int, k: int, cfg: GemmConfig, act_quant: int = 0) -> str:
    """The tiny generated .cu of one variant (named fields from the config, nothing positional);
    ``act_quant`` 1 / 2 selects the fused SiLU·mul + quant epilogue (FP32 / UE8M0 scales)."""
    if act_quant not in (0, 1, 2) or (act_quant and (cfg.block_n != 256 or n % 256 or cfg.multicast > 1
                                                     or cfg.split_k > 1)):
        raise ValueError(f"the SiLU·mul + quant epilogue needs 256-wide tiles, N a multiple of 256, no "
                         f"multicast and no split-K, got act_quant={act_quant}, N={n}, {cfg}")
    if (cfg.multicast > 1 or cfg.split_k > 1) and layout != "normal":
        raise ValueError(f"multicast and split-K are only implemented for the normal layout, not {layout}")
    if cfg.a_box_rows and not (layout == "contiguous" or (layout == "masked" and cfg.block_m == 64)):
        raise ValueError(f"A boxes of a tile's rows are compiled into the contiguous layout and 64-row masked tiles, "
                         f"not {layout} with {cfg.block_m}-row tiles")
    if cfg.k_split and layout != "masked":
        raise ValueError(f"a K-split last wave is only compiled into the masked layout, not {layout}")
    sched_args = f", /*kTailSplit=*/{str(_tail_split(cfg, act_quant)).lower()}"
    if act_quant and _tail_split(cfg, act_quant):
        sched_args += ", /*kTailHalves=*/false"
    if cfg.multicast > 1 or cfg.split_k > 1:
        sched_args += f", /*kMulticast=*/{cfg.multicast}, /*kMulticastOnA=*/{str(cfg.multicast_on_a).lower()}"
    if cfg.split_k > 1:
        sched_args += f", /*kSplitK=*/{cfg.split_k}"
    return KERNEL_TEMPLATE.format(n=n, k=k, scheduler=SCHEDULERS[layout], sched_args=sched_args,
                                  act_quant=act_quant, a_box=a_box_rows(cfg), **{
        f: getattr(cfg, f) for f in ("block_m", "block_n", "num_stages", "smem_bytes", "swizzle_group_m")})


@functools.cache
def _pdl() -> bool:
    """Launch the GEMMs as programmatic dependents (the CTAs become resident, set up their barriers and wait
    in the kernel while the previous kernel ends; see impls/fp8_gemm.cuh). ``MOE_FP8_PDL=0`` turns it off,
    with the data-path kernels' (read once per process)."""
    return truthy(os.environ.get("MOE_FP8_PDL", "1"))


# Measurement switches of the kernel headers (e.g. "MOE_FP8_SERPENTINE_K=0"),
# read once per process; for A/B timing runs only, never needed in use.
ENV_DEFINES = "MOE_FP8_GEMM_DEFINES"


def env_defines() -> str:
    """``#define`` lines of ``$MOE_FP8_GEMM_DEFINES`` (both GEMM kernels' measurement switches)."""
    return "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in os.environ.get(ENV_DEFINES, "").split())


def _source(layout: Layout, n: int, k: int, cfg: GemmConfig, act_quant: int = 0) -> str:
    return env_defines() + generate_source(layout, n, k, cfg, act_quant)


def variant_name(layout: Layout, n: int, k: int, cfg: GemmConfig, act_quant: int = 0) -> str:
    """Cache-entry name of one variant (readable; the cache key hashes the full source anyway)."""
    mc = f"_mc{cfg.multicast}{'a' if cfg.multicast_on_a else 'b'}" if cfg.multicast > 1 else ""
    sk = f"_sk{cfg.split_k}" if cfg.split_k > 1 else ""
    ts = "_ts" if _tail_split(cfg, act_quant) else ""
    act = ("", "_silu_quant", "_silu_quant_ue8m0")[act_quant]
    order = f"_g{cfg.swizzle_group_m}" if cfg.swizzle_group_m != SWIZZLE_GROUP_M else ""
    boxes = f"_a{cfg.a_box_rows}" if cfg.a_box_rows else ""
    return f"fp8_gemm_{layout}_n{n}_k{k}_m{cfg.block_m}n{cfg.block_n}s{cfg.num_stages}{mc}{sk}{ts}{order}{boxes}{act}"


def kernel_variant(desc: GemmDesc, config: GemmConfig | None = None) -> tuple[str, str]:
    """``(name, source)`` that a call described by ``desc`` compiles: pure host code, no GPU.

    ``moe-fp8 warmup`` enumerates a model's descriptors through this, so it precompiles exactly what
    ``launch_fp8_gemm`` will ask ``build`` for (same heuristic, same name, same generated source)."""
    cfg = get_config(desc) if config is None else config
    return (variant_name(desc.layout, desc.n, desc.k, cfg, desc.act_quant),
            _source(desc.layout, desc.n, desc.k, cfg, desc.act_quant))


@functools.cache
def get_kernel(layout: Layout, n: int, k: int, cfg: GemmConfig, act_quant: int = 0):
    """Compile (or fetch from the disk cache) and return the variant for (layout, N, K, config)."""
    return build(variant_name(layout, n, k, cfg, act_quant), _source(layout, n, k, cfg, act_quant))


def _tma_scale(x_scale: torch.Tensor, rows: int, kb_rows: int, block_m: int):
    """x_scale (column-major, M padded to 4) viewed as [kb_rows, rows] FP32 with a BLOCK_M x 1 box."""
    outer_stride = x_scale.stride(-1) if x_scale.shape[-1] > 1 else get_tma_aligned_m(rows)
    return make_tma_2d(x_scale, rows, kb_rows, block_m, 1, swizzle="none", outer_stride_elems=outer_stride)


# NOTE: the eager launch budget is 10 us of host time. Choosing the config, fetching the variant and
# encoding three TMA descriptors cost ~60 us in Python, so a call's prepared launch is cached under
# everything those depend on (pointers, shapes, strides, SM count, config); a repeat call is one dict
# lookup plus the driver launch. Descriptors embed pointers, so the pointers are part of the key.
_PREPARED: dict[tuple, tuple] = {}
_PREPARED_MAX = 4096


def _prepare(layout: Layout, x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, rows_per_group: int,
             num_groups: int, expected_m: int | None, config: GemmConfig | None, act_quant: int) -> tuple:
    k = x_fp8.shape[-1]
    n = w.shape[-2]
    total_rows = x_fp8.numel() // k
    desc = GemmDesc(m=rows_per_group, n=n, k=k, num_groups=num_groups, layout=layout,
                    num_sms=get_num_sms(), expected_m=expected_m, act_quant=act_quant)
    cfg = get_config(desc) if config is None else config
    kernel = get_kernel(layout, n, k, cfg, act_quant)
    kb = ceil_div(k, BLOCK_K)
    # with multicast each CTA of the pair loads half of the shared operand's box (a_box_rows); two-wave tiles (192 / 256
    # wide) of single CTAs load B as two 96 / 128-row boxes (one per wave: the gate and up blocks with act_quant)
    two_box_b = tail_split_ok(cfg.block_n, cfg.multicast, cfg.split_k)  # the same tiles: two waves, one CTA
    half_b = 2 if two_box_b else 1 if cfg.multicast_on_a else cfg.multicast
    tmaps = (
        make_tma_2d(x_fp8, k, total_rows, BLOCK_K, a_box_rows(cfg), swizzle="128B"),
        make_tma_2d(w, k, num_groups * n, BLOCK_K, cfg.block_n // half_b, swizzle="128B"),
        _tma_scale(x_scale, rows_per_group, (num_groups if layout == "masked" else 1) * kb, cfg.block_m),
    )
    # masked: an upper bound (the device-side counts may skip tiles)
    tiles = num_tiles(desc, cfg.block_m, cfg.block_n, cfg.multicast, cfg.multicast_on_a)
    if cfg.split_k > 1:  # one cluster of split_k CTAs per tile, not persistent
        grid, cluster = tiles * cfg.split_k, cfg.split_k
    else:
        # tail halves: under half a wave of tiles, every tile runs as two halves on two CTAs
        units = 2 * tiles if _tail_split(cfg, act_quant) else tiles
        grid, cluster = max(cfg.multicast, min(cfg.num_sms // cfg.multicast * cfg.multicast, units)), cfg.multicast
    # K-split last wave: its tiles' K pieces may take every CTA (under one wave, too), so it launches
    # num_sms CTAs; the grid above is the fallback when no workspace can be had (_k_split_workspace).
    # Under two pieces of K the kernel has no K pieces compiled (sched::TailSplit) and runs halves.
    k_split = cfg.k_split and _tail_split(cfg, act_quant) and k_pieces_fit(k)
    return (kernel, (grid, 1, 1), k_split, (cfg.num_threads, 1, 1), cfg.smem_bytes, (cluster, 1, 1), tmaps, cfg,
            warm_k_blocks(layout, num_groups), async_stores(tiles, grid, cfg.block_m))


def launch_fp8_gemm(layout: Layout, x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                    w_scale: torch.Tensor, out: torch.Tensor, grouped_layout: torch.Tensor | None,
                    rows_per_group: int, num_groups: int, expected_m: int | None = None,
                    config: GemmConfig | None = None, act_quant: int = 0,
                    out_scale: torch.Tensor | None = None, m_rows: torch.Tensor | None = None) -> GemmConfig:
    """Shared launch path of the three layouts.

    ``x_fp8`` is viewed as [rows, K] (rows = M, M_total or G·max_m), ``w`` as [G·N, K], ``x_scale`` as
    [G·Kb, rows_per_group], ``out`` as [rows, N]; with ``act_quant`` (the fused SiLU·mul + quant
    epilogue) ``out`` is FP8 [rows, N/2] and ``out_scale`` its scales in the TMA layout. ``m_rows``
    (contiguous only): int32 [1] on the device, the rows from it on are padding. ``config``
    overrides the heuristic (tests and benchmark sweeps). Returns the config used.
    """
    key = (layout, x_fp8.data_ptr(), x_fp8.shape, x_scale.data_ptr(), x_scale.stride(), w.data_ptr(), w.shape,
           rows_per_group, num_groups, expected_m, get_num_sms(), config, x_fp8.get_device(), act_quant)
    prep = _PREPARED.get(key)
    if prep is None:
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        prep = _PREPARED[key] = _prepare(layout, x_fp8, x_scale, w, rows_per_group, num_groups, expected_m, config,
                                         act_quant)
        _reserve_k_split_flags(x_fp8.get_device())
    kernel, grid, k_split, block, smem, cluster, (tmap_a, tmap_b, tmap_sa), cfg, warm, bulk = prep
    workspace = _k_split_workspace(x_fp8.get_device(), cfg.num_sms) if k_split else None
    if workspace is not None:
        grid = (cfg.num_sms, 1, 1)
    flags, slots = workspace or (None, None)
    kernel.launch(grid, block, [tmap_a, tmap_b, tmap_sa, w_scale, out, grouped_layout, m_rows, rows_per_group,
                                num_groups, out_scale, get_tma_aligned_m(rows_per_group), flags, slots, warm, bulk],
                  smem_bytes=smem, cluster=cluster, pdl=_pdl())
    return cfg


def fp8_gemm_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    out: torch.Tensor, config: GemmConfig | None = None) -> None:
    """out[M, N] (bf16) = (x_fp8·x_scale) @ (w·w_scale)ᵀ on sm_90a. Inputs already validated."""
    m = x_fp8.shape[0]
    if m == 0:
        return
    if config is None and few_rows.applies_normal(m, w.shape[0], w.shape[1]):
        few_rows.launch(x_fp8, x_scale, w, w_scale, out, None)
        return
    launch_fp8_gemm("normal", x_fp8, x_scale, w, w_scale, out, None, m, 1, config=config)


def fp8_grouped_gemm_contiguous_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                                       w_scale: torch.Tensor, m_indices: torch.Tensor, out: torch.Tensor,
                                       m_total: torch.Tensor | None = None, expected_m: int | None = None,
                                       config: GemmConfig | None = None) -> None:
    """Contiguous M-grouped GEMM: row r of out = x[r] @ w[m_indices[r]]ᵀ; all-padding tiles skipped, and
    with ``m_total`` (int32 [1] on the device) every row from ``m_total[0]`` on, unread and unwritten.
    ``expected_m``: rows per group the caller expects (a hint for the block shape only)."""
    rows = x_fp8.shape[0]
    if rows == 0:
        return
    launch_fp8_gemm("contiguous", x_fp8, x_scale, w, w_scale, out, m_indices, rows, w.shape[0],
                    expected_m=expected_m, config=config, m_rows=m_total)


def fp8_grouped_gemm_masked_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor,
                                   w_scale: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                   out: torch.Tensor, config: GemmConfig | None = None) -> None:
    """Masked M-grouped GEMM over [G, max_m, K]; rows >= masked_m[g] are neither read for output nor
    written. ``expected_m`` only picks the block shape: every config is valid for any masked_m."""
    num_groups, max_m = x_fp8.shape[0], x_fp8.shape[1]
    if max_m == 0 or num_groups == 0:
        return
    if config is None and few_rows.applies(max_m, w.shape[1], w.shape[2], num_groups, expected_m):
        few_rows.launch(x_fp8, x_scale, w, w_scale, out, masked_m, expected_m)
        return
    launch_fp8_gemm("masked", x_fp8, x_scale, w, w_scale, out, masked_m, max_m, num_groups,
                    expected_m=expected_m, config=config)


def fp8_grouped_gemm_silu_mul_quant_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, w13: torch.Tensor,
                                           w13_scale: torch.Tensor, m_indices: torch.Tensor | None,
                                           masked_m: torch.Tensor | None, expected_m: int, ue8m0: bool,
                                           out_fp8: torch.Tensor, out_scale: torch.Tensor,
                                           m_total: torch.Tensor | None = None,
                                           config: GemmConfig | None = None) -> None:
    """An expert's first GEMM with SiLU·mul + FP8 quantisation in its epilogue: with
    ``h = x @ w13[g]ᵀ`` in FP32 and ``w13 [G, 2I, K] = [gate; up]``, ``out_fp8 [..., I]`` /
    ``out_scale`` (TMA layout) get ``per_token_group_quant(silu(h[:, :I]) · h[:, I:])``; the bf16 ``h``
    is never written. Contiguous (``m_indices``, x ``[M_total, K]``; ``expected_m`` a hint, 0 for none) or
    masked (``masked_m`` and ``expected_m``, x ``[G, max_m, K]``: rows past masked_m are not written);
    contiguous with ``m_total`` (int32 [1] on the device): rows from ``m_total[0]`` on are not visited.
    Inputs already validated.
    """
    act_quant = 2 if ue8m0 else 1
    if masked_m is None:
        if x_fp8.shape[0]:
            launch_fp8_gemm("contiguous", x_fp8, x_scale, w13, w13_scale, out_fp8, m_indices, x_fp8.shape[0],
                            w13.shape[0], expected_m=expected_m or None, config=config, act_quant=act_quant,
                            out_scale=out_scale, m_rows=m_total)
    elif x_fp8.shape[0] and x_fp8.shape[1]:
        if config is None and few_rows.applies(x_fp8.shape[1], w13.shape[1], w13.shape[2], x_fp8.shape[0],
                                                expected_m, fused=True):
            # few rows a group (decode): the few-rows GEMM's FP32 h, then SiLU·mul + quant on it (as the fused
            # epilogue, h is not rounded to bf16); only h's rows below masked_m are written and read
            from ..ops import silu_mul_per_token_group_quant

            h = torch.empty((*x_fp8.shape[:2], w13.shape[1]), dtype=torch.float32, device=x_fp8.device)
            few_rows.launch(x_fp8, x_scale, w13, w13_scale, h, masked_m, expected_m)
            silu_mul_per_token_group_quant(h, BLOCK_K, ue8m0, masked_m, out=out_fp8, out_scale=out_scale)
            return
        launch_fp8_gemm("masked", x_fp8, x_scale, w13, w13_scale, out_fp8, masked_m, x_fp8.shape[1], x_fp8.shape[0],
                        expected_m=expected_m, config=config, act_quant=act_quant, out_scale=out_scale)
