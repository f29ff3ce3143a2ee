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
"""

from __future__ import annotations

import functools

import torch

from ..utils import SCALE_M_ALIGN, ceil_div
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
    """Backend entry of ``dispatch_contiguous`` on Hopper (see ``moe_fp8.ops``): the Triton backend's, its FP8
    rows moved by ``move_rows`` where ``mover_applies``. Arguments are validated by the public wrapper."""
    from .triton.dispatch import dispatch_contiguous

    mover = move_rows if mover_applies(x_fp8, topk_ids) else None
    return dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync=sync,
                               return_m_total=return_m_total, mover=mover)


def dispatch_masked_hopper(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                           max_m: int, expert_map: torch.Tensor | None, *, out: torch.Tensor | None = None,
                           out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Backend entry of ``moe_fp8::dispatch_masked`` on Hopper: the Triton backend's, the rows of its chunked
    path (beyond ``configs.DISPATCH_FUSED_MAX_PAIRS``) moved by ``move_rows`` where ``mover_applies``."""
    from .triton.dispatch import dispatch_masked

    mover = move_rows if mover_applies(x_fp8, topk_ids) else None
    return dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map, out=out, out_scale=out_scale,
                           mover=mover)
