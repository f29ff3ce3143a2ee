"""Hopper backend of ``dispatch_contiguous`` and ``dispatch_masked`` (its chunked path, beyond the fused
kernel's 2048 pairs): the Triton routing kernels, then the row mover of impls/dispatch_rows.cuh (one warp
per token, the row moved by bulk copies) in place of the Triton scatter.

Session 22 (H100, 7168 columns, top-8 of 256, CUDA-graph timed, bit-equal outputs), the scatter alone,
Triton → mover: 16384 tokens 482.2 → 415.8 µs (0.73 → 0.84× a copy of the same bytes), 8192 241.8 →
210.1, 4096 123.2 → 108.5, 1024 33.3 → 29.8, 128 9.6 → 7.8; 8192 tokens with 32 of the experts local
43.8 → 41.1. The whole ``dispatch_contiguous`` (routing included, ``sync=False``): 16384 tokens 505.1 →
438.3, 4096 135.6 → 119.7, 2048 74.3 → 64.3, 1024 41.4 → 38.0. ``dispatch_masked``: docs/kernels/datapath.md.

Rows of a multiple of 16 bytes (bulk copies) up to the shared memory of one CTA, at most 32 slots per token;
other calls run the Triton scatter.

The routing state both scatters read (local ids, ranks in 128-pair chunks, the chunks' bases, segment starts)
comes from ``route_pairs`` (impls/route_pairs.cuh): one launch in place of the Triton count and scan kernels,
the same outputs. Eager calls pay one launch of ours (~6 µs of host time) instead of two Triton launches
(~25-40 µs each, session 33).
"""

from __future__ import annotations

import functools

import torch

from ..utils import SCALE_M_ALIGN, ceil_div, env, truthy
from .gemm import _pdl
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/dispatch_rows.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::dispatch::dispatch_rows_kernel<{top_k}, /*kMasked=*/{masked}, /*kRowsOnDevice=*/{on_device},
                                                   /*kScalesApart=*/{apart}, /*kScaleAlignM=*/{m_align}>;
}}
"""
MAX_TOP_K = 32  # one lane per slot
MAX_ROW_BYTES = 200 * 1024  # one row in shared memory (227 KB a CTA on sm_90)


def kernel_variant(top_k: int, masked: bool, rows_on_device: bool, scales_apart: bool) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them."""
    source = KERNEL_TEMPLATE.format(top_k=top_k, masked=str(masked).lower(), on_device=str(rows_on_device).lower(),
                                    apart=str(scales_apart).lower(), m_align=SCALE_M_ALIGN)
    flags = f"{'_masked' if masked else ''}{'_dev' if rows_on_device else ''}{'_apart' if scales_apart else ''}"
    return f"dispatch_rows_k{top_k}{flags}", source


@functools.cache
def get_kernel(top_k: int, masked: bool, rows_on_device: bool, scales_apart: bool):
    return build(*kernel_variant(top_k, masked, rows_on_device, scales_apart))


ROUTE_TEMPLATE = """#include "moe_fp8/impls/route_pairs.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::dispatch::route_pairs_kernel<{ids}, {map}, /*kHasMap=*/{has_map}, /*kMasked=*/{masked},
                                                 /*kV=*/{v}>;
}}
"""
ROUTE_CHUNK = 128  # the header's kRouteChunk: pairs a chunk (DispatchConfig.chunk)
ROUTE_CHUNKS_PER_CTA = 16  # kRouteChunksPerCta
ROUTE_THREADS = 256  # kRouteThreads
ROUTE_MAX_EXPERTS = 2 * ROUTE_THREADS  # kV <= 2 experts a thread (at 4, ptxas spilled)
ROUTE_SMEM_MAP_ENTRIES = 2048  # expert maps up to this many global experts are staged in shared memory
_ROUTE_CTYPES = {torch.int32: "int32_t", torch.int64: "int64_t"}


def route_variant(ids_dtype: torch.dtype, map_dtype: torch.dtype | None, masked: bool, num_experts: int
                  ) -> tuple[str, str]:
    """``(name, source)`` of the routing kernel for these id / map dtypes (None: no map), layout and expert count
    (it sets ``kV``, the experts a thread: 1 or 2)."""
    v = 1 if num_experts <= ROUTE_THREADS else 2
    has_map = map_dtype is not None
    source = ROUTE_TEMPLATE.format(ids=_ROUTE_CTYPES[ids_dtype], map=_ROUTE_CTYPES[map_dtype or ids_dtype],
                                   has_map=str(has_map).lower(), masked=str(masked).lower(), v=v)
    name = (f"route_pairs_{str(ids_dtype)[6:]}_{str(map_dtype)[6:] if has_map else 'nomap'}"
            f"{'_masked' if masked else ''}_v{v}")
    return name, source


@functools.cache
def get_route_kernel(ids_dtype: torch.dtype, map_dtype: torch.dtype | None, masked: bool, num_experts: int):
    return build(*route_variant(ids_dtype, map_dtype, masked, num_experts))


def route_applies(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, chunk: int) -> bool:
    """The kernel takes int32 / int64 ids and maps, up to ``ROUTE_MAX_EXPERTS`` local experts, 128-pair chunks and
    fewer than 2^31 pairs; ``MOE_FP8_CUDA_ROUTE=0`` turns it off (the Triton kernels, for A/B runs)."""
    return (chunk == ROUTE_CHUNK and 1 <= num_experts <= ROUTE_MAX_EXPERTS and topk_ids.dtype in _ROUTE_CTYPES
            and (expert_map is None or expert_map.dtype in _ROUTE_CTYPES) and topk_ids.numel() < 2**31
            and truthy(env("MOE_FP8_CUDA_ROUTE") or "1"))


def route_pairs(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, max_m: int, align_m: int,
                masked_m: torch.Tensor | None, chunk: int):
    """The ``Router`` of ``kernels/triton/dispatch.py``: the chunked dispatch's routing state (``_Routing``) in one
    launch, or None where ``route_applies`` does not hold (the Triton kernels then). ``masked_m`` given: the masked
    layout, written here; else the contiguous layout's segment starts (aligned to ``align_m``) and status."""
    from .triton.dispatch import _Routing

    if not route_applies(topk_ids, num_experts, expert_map, chunk):
        return None
    device = topk_ids.device
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    emap = None if expert_map is None else (expert_map if expert_map.is_contiguous() else expert_map.contiguous())
    num_pairs = ids.numel()
    num_chunks = ceil_div(num_pairs, ROUTE_CHUNK)
    ctas = max(ceil_div(num_chunks, ROUTE_CHUNKS_PER_CTA), 1)
    i32 = torch.empty(2 * num_pairs + num_chunks * num_experts, dtype=torch.int32, device=device)
    local, rank, base = i32.split([num_pairs, num_pairs, num_chunks * num_experts])
    # more than one CTA: the look-back flags and the id range's words must start at 0 (a memset launch; the rest
    # is written before it is read)
    num_flags = ctas * num_experts if ctas > 1 else 0
    i64 = (torch.zeros if ctas > 1 else torch.empty)(2 * num_experts + 7 + num_flags, dtype=torch.int64, device=device)
    count, seg_start, status, stat_words, flags = i64.split([num_experts, num_experts, 4, 3, num_flags])
    masked = masked_m is not None
    num_global = emap.shape[0] if emap is not None else num_experts
    map_entries = num_global if emap is not None and num_global <= ROUTE_SMEM_MAP_ENTRIES else 0
    smem = ceil_div(map_entries * (emap.element_size() if emap is not None else 0), 16) * 16
    kernel = get_route_kernel(ids.dtype, None if emap is None else emap.dtype, masked, num_experts)
    kernel.launch(ctas, ROUTE_THREADS, [
        ids, emap if emap is not None else ids, local, rank, base, count, seg_start, status,
        masked_m if masked else local, flags, stat_words, num_pairs, num_experts, num_global, map_entries, max_m,
        align_m], smem_bytes=smem + 4 * ROUTE_CHUNKS_PER_CTA * num_experts, pdl=_pdl())
    return _Routing(local, rank, base, seg_start, count, status, emap is not None, masked_m)


def mover_applies(x_fp8: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """The mover takes contiguous FP8 rows of a multiple of 16 bytes, 16-byte aligned (bulk copies), up to
    ``MAX_ROW_BYTES``, and up to ``MAX_TOP_K`` slots."""
    k = x_fp8.shape[1]
    return (x_fp8.is_contiguous() and k % 16 == 0 and 0 < k <= MAX_ROW_BYTES and x_fp8.data_ptr() % 16 == 0
            and 1 <= topk_ids.shape[1] <= MAX_TOP_K and x_fp8.shape[0] < 2**31)


def move_rows(x_fp8: torch.Tensor, x_scale: torch.Tensor, local: torch.Tensor, rank: torch.Tensor,
              base: torch.Tensor, seg_start: torch.Tensor, count: torch.Tensor, status: torch.Tensor, chunk: int,
              out: torch.Tensor, out_scale: torch.Tensor, row_map: torch.Tensor, m_indices: torch.Tensor | None,
              max_m: int, m_pad: int, rows_on_device: bool, src_rows: torch.Tensor | None,
              token_scales: torch.Tensor | None) -> None:
    """The ``RowMover`` of ``kernels/triton/dispatch.py``: one launch, a CTA per token (and per 32 rows of
    ``m_indices`` past them; ``m_indices`` None: the masked layout). A plain launch after the routing
    kernels: as a programmatic dependent (its CTAs resident while the scan runs) the whole dispatch took
    47.4 against 38.0 µs at 1024 tokens and 70.4 against 64.3 at 2048, the same from 4096 on (session 22,
    CUDA graphs)."""
    num_tokens, k = x_fp8.shape
    top_k = row_map.shape[1]
    masked = m_indices is None
    m_rows = 0 if masked else m_indices.shape[0]
    grid = max(num_tokens, ceil_div(m_rows, 32))
    if grid == 0:
        return
    apart = src_rows is not None
    kernel = get_kernel(top_k, masked, rows_on_device, apart)
    stand_in = row_map  # for pointers this variant never dereferences
    kernel.launch(grid, 32, [
        x_fp8.view(torch.uint8), x_scale, x_scale.stride(0), x_scale.stride(1), local, rank, base, seg_start, count,
        status, out.view(torch.uint8), out_scale, row_map, stand_in if masked else m_indices,
        src_rows if apart else stand_in, token_scales if apart else stand_in, num_tokens, k, x_scale.shape[1], chunk,
        count.shape[0], m_rows, m_pad, max_m], smem_bytes=k)


def dispatch_contiguous_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                               expert_map: torch.Tensor | None, align_m: int, *, sync: bool = True,
                               return_m_total: bool = False) -> tuple[torch.Tensor, ...]:
    """Backend entry of ``dispatch_contiguous`` on Hopper (see ``moe_fp8.ops``): the Triton backend's, routed by
    ``route_pairs`` and its FP8 rows moved by ``move_rows`` where ``mover_applies``. Arguments are validated by the
    public wrapper."""
    from .triton.dispatch import dispatch_contiguous

    mover = move_rows if mover_applies(x_fp8, topk_ids) else None
    return dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync=sync,
                               return_m_total=return_m_total, mover=mover, router=route_pairs)


def dispatch_masked_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                           max_m: int, expert_map: torch.Tensor | None, *, out: torch.Tensor | None = None,
                           out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Backend entry of ``moe_fp8::dispatch_masked`` on Hopper: the Triton backend's, its chunked path (beyond
    ``configs.DISPATCH_FUSED_MAX_PAIRS``) routed by ``route_pairs`` and its rows moved by ``move_rows`` where
    ``mover_applies``."""
    from .triton.dispatch import dispatch_masked

    mover = move_rows if mover_applies(x_fp8, topk_ids) else None
    return dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map, out=out, out_scale=out_scale,
                           mover=mover, router=route_pairs)


def quant_dispatch_contiguous_hopper(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                                     expert_map: torch.Tensor | None, align_m: int, ue8m0: bool = False,
                                     eps: float = 1e-10, *, sync: bool = True, return_x: bool = True,
                                     return_m_total: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Backend entry of ``quant_dispatch_contiguous`` on Hopper: the Triton backend's quantizing scatter, routed by
    ``route_pairs``."""
    from .triton.dispatch import quant_dispatch_contiguous

    return quant_dispatch_contiguous(x, topk_ids, num_experts, expert_map, align_m, ue8m0, eps, sync=sync,
                                     return_x=return_x, return_m_total=return_m_total, router=route_pairs)


def quant_dispatch_masked_hopper(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_m: int,
                                 expert_map: torch.Tensor | None, ue8m0: bool = False, eps: float = 1e-10, *,
                                 out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, ...]:
    """Backend entry of ``moe_fp8::quant_dispatch_masked`` on Hopper: the Triton backend's (one fused launch at
    decode), its chunked path routed by ``route_pairs``."""
    from .triton.dispatch import quant_dispatch_masked

    return quant_dispatch_masked(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, out=out,
                                 out_scale=out_scale, router=route_pairs)
