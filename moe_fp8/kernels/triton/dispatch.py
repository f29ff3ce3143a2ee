"""Dispatch (contiguous and masked layouts) and combine.

Both dispatches place the (token, slot) pairs of each local expert in (token, slot) row-major order,
as ``moe_fp8.reference`` does, so ``row_map``, ``m_indices`` and the copied rows match it exactly.
The order is made deterministic without atomics on positions. Both paths end with ``row_map`` (the
destination row of every pair, or -1), written by the programs that copy the rows:

- Masked layout, few pairs (``<= configs.DISPATCH_FUSED_MAX_PAIRS``: every decode step) —
  ``_dispatch_fused_kernel``, **one launch**, no routing kernel: each scatter program (``BLOCK_T``
  tokens × ``BLOCK_K`` bytes) ranks its own pairs against every earlier pair (a comparison over the
  id list, from L2), writes its rows' slices and (column block 0) ``row_map``; programs of their own,
  first in the grid, count ``E_BLOCK`` experts each for ``masked_m``. Token programs hint their row
  slice into L2 before the PDL wait (``common.prefetch_l2``), so it arrives while routing finishes.
- Large problems — parallel over chunks of ``CHUNK`` pairs, three launches:
  1. ``_count_kernel``: local expert of each pair (``expert_map`` applied; ids outside the map or
     mapped outside ``[0, E)`` are "not local"), its rank among the chunk's earlier pairs of the
     same expert and the chunk's histogram (both from ``[CHUNK, 32]`` one-hot tiles, the rank their
     column prefix; beyond 32 experts the rank from comparing the chunk's pairs ``RANK_SUB`` at a time;
     the histogram written in full; contiguous layout: also added atomically to the zero-filled
     per-expert totals — integer sums, so the order of the additions does not matter).
  2. ``_scan_kernel``: per expert slice, exclusive prefix of the histograms over chunks (masked:
     ``masked_m = min(count, max_m)``); contiguous: the slice's aligned segment starts (from the
     totals), and a program of its own writes ``M_total`` and the id range (for the reference's errors).
  3. ``_scatter_kernel`` — one program per ``BLOCK_T`` tokens × ``BLOCK_K`` bytes: computes its pairs'
     destinations (rank + earlier chunks' count + segment start), reads each token row once and
     stores it to each of its ``top_k`` destinations (FP8 bytes and scales, scales into the TMA
     layout). Column block 0 writes ``row_map`` and (contiguous) 128 rows of ``m_indices``: each row's
     segment from the segment starts (expert id, or -1 for padding and rows past ``M_total``; only the
     token blocks below ``M_total`` hold such rows). ``quant_dispatch_contiguous`` (``QUANT``): the rows
     are bf16/fp16/fp32 and each program quantizes its slice before storing it (``WRITE_X``: also to
     ``x_fp8`` / ``x_scale``, for the shared experts); under an ``expert_map`` the sparse variant
     (``_scatter_sparse_kernel``, a branch per slot) does the same.
     Under an ``expert_map`` (``DispatchConfig.sparse``) ``_scatter_sparse_kernel`` does the same for one
     token per program with a branch per slot: idle slots issue no stores and idle tokens read nothing,
     so ``quant_dispatch_contiguous(return_x=False)`` quantizes inside it there too.
     ``DispatchConfig.scales_apart`` (contiguous, the quantizing dense scatter from 2048 tokens × top-8):
     column block 0 records each destination row's token instead, and a fourth launch,
     ``_scale_rows_kernel``, writes the scales row by row (whole sectors, not a 4-byte store per token),
     gathering them from a token-major copy the quantizing scatter writes (a token's scales in 7 sectors,
     where the TMA layout of ``x_scale`` spreads them over 56).
     On Hopper ``dispatch_contiguous`` and ``dispatch_masked`` (FP8 rows) pass a ``RowMover``
     (``kernels/dispatch.py``, CUDA) that replaces this scatter: the same outputs, the rows moved by bulk
     copies.
     On Hopper every dispatch also passes a ``Router`` (``kernels/dispatch.py``: ``route_pairs``, CUDA) that
     replaces the count and scan kernels: the same routing state in one launch.

Every data-path kernel starts with ``common.pdl_start`` (programmatic dependent launch on sm_90+).

Host launches cost more than these kernels at prefill (15–150 µs each, depending on the host), so
the routing is as few launches as its two global dependencies allow (totals before segment starts,
every chunk's histogram before any position).

The contiguous layout's ``M_total`` is data-dependent. ``sync=True`` (default, the reference's API):
the host reads it (with the id range, to raise the reference's errors) in one sync, a copy to pinned
memory and an event. The scatter is launched before that sync, into upper-bound buffers, and reads
``M_total`` on the device (the outputs are ``M_total``-row views of those buffers), so the GPU copies
rows (``quant_dispatch_contiguous``: quantizes and copies) while the host waits and then prepares
the next launches. ``sync=False``: no host sync — the outputs get the upper bound
``M_bound = align(T·top_k + E·(align_m − 1), align_m)`` rows, the rows past ``M_total`` are padding
(``m_indices = -1``, bytes and scales unwritten), and invalid ids are not local (as in the masked
dispatch) instead of an error.

Padding rows (contiguous) and rows past ``masked_m`` (masked) are not written, which the layouts
allow (DESIGN §2; the reference fills them with zeros and scale 1.0 for its own tests).

``combine`` — one program per ``BLOCK_T`` tokens × ``BLOCK_H`` columns: gathers the ``top_k`` rows of
each token (at decode in one tile load), ``acc = acc + w·y`` in float32 in slot order (separate multiply and add, as torch: the
kernel is compiled without FMA contraction so it rounds exactly as the reference), adds the shared
output, rounds to bf16. A ``row_map`` entry past the end of ``y`` contributes NaN (an invalid map is a
bug; the reference raises an indexing error there).
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from moe_fp8.kernels.triton.common import (
    check_launch_device,
    launch,
    native_cvt,
    native_fp8,
    pdl_args,
    pdl_start,
    prefetch_l2,
    quantize_groups,
    to_bf16,
)
from moe_fp8.kernels.triton.configs import (
    M_INDICES_E_CHUNK,
    MAX_GRID_YZ,
    SCALE_ROWS_BLOCK_G,
    SCALE_ROWS_BLOCK_R,
    CombineConfig,
    DispatchConfig,
    combine_config,
    dispatch_config,
    mover_scales_apart,
)
from moe_fp8.utils import FP8_DTYPE, SCALE_M_ALIGN, ceil_div, empty_scale_tma, get_tma_aligned_m

__all__ = [
    "combine",
    "contiguous_rows_bound",
    "dispatch_contiguous",
    "dispatch_masked",
    "quant_dispatch_contiguous",
    "quant_dispatch_masked",
]


# ============================================================================================
# Masked layout, few pairs: routing fused into the scatter
# ============================================================================================

@triton.jit
def _local_ids(ids_ptr, map_ptr, i, in_range, num_experts, num_global, HAS_MAP: tl.constexpr):
    """``(ids, local)`` of pairs ``i``: local expert id in ``[0, E)`` or -1 (not local / invalid)."""
    ids = tl.load(ids_ptr + i, mask=in_range, other=0).to(tl.int64)
    if HAS_MAP:
        id_ok = in_range & (ids >= 0) & (ids < num_global)
        mapped = tl.load(map_ptr + ids, mask=id_ok, other=-1).to(tl.int64)
    else:
        id_ok = in_range & (ids >= 0) & (ids < num_experts)
        mapped = tl.where(id_ok, ids, -1)
    local = tl.where((mapped >= 0) & (mapped < num_experts), mapped, -1)
    return ids, mapped, local


@triton.jit
def _rank_own_pairs(ids_ptr, map_ptr, pid_t, t, t_ok, T, num_experts, num_global, max_m,
                    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                    RANK_CHUNK: tl.constexpr, HAS_MAP: tl.constexpr):
    """``(p, p_ok, dest)`` of the program's own pairs ``[BLOCK_T, K_P2]``: flat pair index, valid,
    destination row ``e·max_m + rank`` (rank among ALL earlier pairs of expert ``e``) or -1."""
    num_pairs = T * TOP_K
    j = tl.arange(0, K_P2)
    p = t[:, None] * TOP_K + j[None, :]
    p_ok = t_ok[:, None] & (j[None, :] < TOP_K)
    # (distinct names per loop: a name assigned before a loop and in it is loop-carried, so its type
    # must not change — the interpreter does not check this, the compiler does)
    _ids_p, _mapped_p, loc = _local_ids(ids_ptr, map_ptr, p, p_ok, num_experts, num_global, HAS_MAP)
    loc = loc.to(tl.int32)
    rank = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    qi = tl.arange(0, RANK_CHUNK)
    # pairs after ours never count (a program past the last token, the one of an empty batch: none at all)
    last = tl.where(pid_t * BLOCK_T < T, tl.minimum((pid_t + 1) * BLOCK_T * TOP_K, num_pairs), 0)
    for q0 in range(0, last, RANK_CHUNK):
        q = q0 + qi
        _ids_q, _mapped_q, lq = _local_ids(ids_ptr, map_ptr, q, q < last, num_experts, num_global, HAS_MAP)
        same = (lq.to(tl.int32)[None, None, :] == loc[:, :, None]) & (q[None, None, :] < p[:, :, None])
        rank += tl.sum(same.to(tl.int32), axis=2)
    keep = p_ok & (loc >= 0) & (rank < max_m)
    dest = tl.where(keep, loc.to(tl.int64) * max_m + rank, -1)
    return p, p_ok, dest


@triton.jit
def _write_masked_m(ids_ptr, map_ptr, masked_m_ptr, f, T, num_experts, num_global, max_m,
                    TOP_K: tl.constexpr, RANK_CHUNK: tl.constexpr, E_BLOCK: tl.constexpr,
                    HAS_MAP: tl.constexpr):
    """``masked_m`` of experts ``[f·E_BLOCK, (f+1)·E_BLOCK)`` for flat program index ``f``."""
    num_pairs = T * TOP_K
    qi = tl.arange(0, RANK_CHUNK)
    e = f * E_BLOCK + tl.arange(0, E_BLOCK)
    e_ok = e < num_experts
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    n_hist = tl.where(f * E_BLOCK < num_experts, num_pairs, 0)
    for q0 in range(0, n_hist, RANK_CHUNK):
        qh = q0 + qi
        _ids_h, _mapped_h, lh = _local_ids(ids_ptr, map_ptr, qh, qh < num_pairs, num_experts, num_global, HAS_MAP)
        counts += tl.sum((lh.to(tl.int32)[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(masked_m_ptr + e, tl.minimum(counts, max_m), mask=e_ok)


@triton.jit
def _route_own_pairs(ids_ptr, map_ptr, row_map_ptr, pid_t, pid_k, t, t_ok, T, num_experts, num_global, max_m,
                     TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, RANK_CHUNK: tl.constexpr,
                     HAS_MAP: tl.constexpr):
    """The routing part of a fused token program: ranks its own pairs, writes their ``row_map`` (column
    block 0); returns ``dest [BLOCK_T, K_P2]``."""
    p, p_ok, dest = _rank_own_pairs(ids_ptr, map_ptr, pid_t, t, t_ok, T, num_experts, num_global, max_m,
                                    TOP_K, K_P2, BLOCK_T, RANK_CHUNK, HAS_MAP)
    tl.store(row_map_ptr + p, dest, mask=p_ok & (p * 0 + pid_k == 0))
    return dest


@triton.jit
def _fused_program(num_experts, E_BLOCK: tl.constexpr):
    """``(counting, index, pid_k)`` of a fused masked-dispatch program. The grid's first rows count
    ``E_BLOCK`` experts each for ``masked_m`` (``index``: the expert slice); the rest are token programs
    (``index``: the token block). Counting apart keeps the counts off the token programs' path
    (DeepSeek-V3 decode: 2.5 us of the dispatch when 16 token programs also counted), and first in the
    grid starts them first: ``masked_m`` is what the next kernels wait for."""
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    count_rows = tl.cdiv(tl.cdiv(num_experts, E_BLOCK), tl.num_programs(1))
    counting = pid_t < count_rows
    index = tl.where(counting, pid_t * tl.num_programs(1) + pid_k, pid_t - count_rows)
    return counting, index, pid_k


@triton.jit
def _dispatch_fused_kernel(
    x_ptr, xs_ptr, ids_ptr, map_ptr, out_ptr, out_s_ptr, row_map_ptr, masked_m_ptr,
    T, K, KG, num_experts, num_global, max_m, m_pad, xs_stride_t, xs_stride_g,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Masked dispatch in one launch (few pairs). Token program ``(pid_t, pid_k)``: ``BLOCK_T`` tokens ×
    ``BLOCK_K`` bytes. Each ranks its own pairs against every earlier pair (positions need no other
    program), copies its slice of the rows and writes ``row_map`` (``pid_k == 0``); counting programs
    write ``masked_m`` (``_fused_program``)."""
    counting, index, pid_k = _fused_program(num_experts, E_BLOCK)
    if counting:
        pdl_start(PDL)
        _write_masked_m(ids_ptr, map_ptr, masked_m_ptr, index, T, num_experts, num_global, max_m,
                        TOP_K, RANK_CHUNK, E_BLOCK, HAS_MAP)
    else:
        t = index * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        t64 = t.to(tl.int64)
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        c_ok = cols < K
        SG: tl.constexpr = (BLOCK_K + 127) // 128  # scale groups = 128-byte lines of the FP8 slice
        line = tl.minimum(pid_k * BLOCK_K + tl.arange(0, SG) * 128, K - 1)
        prefetch_l2(x_ptr + tl.where(t_ok, t64, 0)[:, None] * K + line[None, :], PDL)
        pdl_start(PDL)
        # the row slice first: its load is in flight while the pairs are ranked
        row = tl.load(x_ptr + t64[:, None] * K + cols[None, :], mask=t_ok[:, None] & c_ok[None, :])
        g = pid_k * SG + tl.arange(0, SG)
        g_ok = (g < KG) & (g * 128 < (pid_k + 1) * BLOCK_K)
        sc = tl.load(xs_ptr + t64[:, None] * xs_stride_t + g[None, :] * xs_stride_g,
                     mask=t_ok[:, None] & g_ok[None, :])

        j = tl.arange(0, K_P2)
        dest = _route_own_pairs(ids_ptr, map_ptr, row_map_ptr, index, pid_k, t, t_ok, T, num_experts, num_global,
                                max_m, TOP_K, K_P2, BLOCK_T, RANK_CHUNK, HAS_MAP)

        # ---- scatter: each kept pair's slice of the row and its scales ----
        for jj in tl.static_range(TOP_K):
            d = tl.sum(tl.where(j[None, :] == jj, dest, 0), axis=1)  # column jj of dest
            ok = d >= 0
            d = tl.where(ok, d, 0)
            mdiv = tl.maximum(max_m, 1)  # max_m = 0: nothing is kept, but never divide by 0
            s_offs = (d // mdiv) * KG * m_pad + d % mdiv  # scales: 3-D TMA layout [E, max_m, KG]
            tl.store(out_ptr + d[:, None] * K + cols[None, :], row, mask=ok[:, None] & c_ok[None, :])
            tl.store(out_s_ptr + s_offs[:, None] + g[None, :].to(tl.int64) * m_pad, sc,
                     mask=ok[:, None] & g_ok[None, :])


@triton.jit
def _quant_dispatch_fused_kernel(
    x_ptr, ids_ptr, map_ptr, xq_ptr, xqs_ptr, out_ptr, out_s_ptr, row_map_ptr, masked_m_ptr,
    T, K, KG, num_experts, num_global, max_m, m_pad, t_pad, eps,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, HAS_MAP: tl.constexpr,
    UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """``per_token_group_quant`` (group 128) fused into the masked dispatch above: a token program loads
    its ``BLOCK_T`` × ``BLOCK_K`` slice of the bf16/fp16/fp32 rows as ``(token, scale group)``
    segments, quantizes them exactly as the quant kernel does, writes ``x_fp8`` / ``x_scale`` (TMA
    layout ``[T, KG]``, ``t_pad`` rows) and copies the codes and scales to each kept destination.
    Ranking, ``row_map`` and ``masked_m`` as in ``_dispatch_fused_kernel``."""
    counting, index, pid_k = _fused_program(num_experts, E_BLOCK)
    if counting:
        pdl_start(PDL)
        _write_masked_m(ids_ptr, map_ptr, masked_m_ptr, index, T, num_experts, num_global, max_m,
                        TOP_K, RANK_CHUNK, E_BLOCK, HAS_MAP)
    else:
        t = index * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < T
        SG: tl.constexpr = BLOCK_K // 128
        seg = tl.arange(0, BLOCK_T * SG)  # segment = (token seg // SG, scale group seg % SG)
        c = tl.arange(0, 128)
        ts = index * BLOCK_T + seg // SG
        g = pid_k * SG + seg % SG
        seg_ok = (ts < T) & (g < KG)
        col = g[:, None] * 128 + c[None, :]
        mask = seg_ok[:, None] & (col < K)
        ts64 = ts.to(tl.int64)
        # 32 elements apart: every 128-byte line of a bf16 / fp16 / fp32 segment (within the row: K may
        # end inside the last segment)
        line = tl.minimum(g[:, None] * 128 + tl.arange(0, 4)[None, :] * 32, K - 1)
        prefetch_l2(x_ptr + tl.where(seg_ok, ts64, 0)[:, None] * K + line, PDL)
        pdl_start(PDL)
        # the slice first: its load is in flight while the pairs are ranked
        xv = tl.load(x_ptr + ts64[:, None] * K + col, mask=mask, other=0.0).to(tl.float32)

        j = tl.arange(0, K_P2)
        dest = _route_own_pairs(ids_ptr, map_ptr, row_map_ptr, index, pid_k, t, t_ok, T, num_experts, num_global,
                                max_m, TOP_K, K_P2, BLOCK_T, RANK_CHUNK, HAS_MAP)

        code, scale = quantize_groups(xv, eps, UE8M0, NATIVE_FP8)  # masked-off lanes hold 0
        tl.store(xq_ptr + ts64[:, None] * K + col, code, mask=mask)
        tl.store(xqs_ptr + ts64 + g.to(tl.int64) * t_pad, scale, mask=seg_ok)

        # ---- scatter: each kept pair's codes and scales ----
        tt = tl.arange(0, BLOCK_T)
        for jj in tl.static_range(TOP_K):
            d_t = tl.sum(tl.where(j[None, :] == jj, dest, 0), axis=1)  # column jj of dest: [BLOCK_T]
            if BLOCK_T == 1:
                d = d_t + seg * 0
            else:  # segment s belongs to token s // SG of the block
                d = tl.sum(tl.where((seg // SG)[:, None] == tt[None, :], d_t[None, :], 0), axis=1)
            ok = seg_ok & (d >= 0)
            d = tl.where(ok, d, 0)
            mdiv = tl.maximum(max_m, 1)  # max_m = 0: nothing is kept, but never divide by 0
            tl.store(out_ptr + d[:, None] * K + col, code, mask=ok[:, None] & (col < K))
            # scales: 3-D TMA layout [E, max_m, KG]
            tl.store(out_s_ptr + (d // mdiv) * KG * m_pad + d % mdiv + g.to(tl.int64) * m_pad, scale, mask=ok)


# ============================================================================================
# Large problems. 1. Local ids, ranks within a chunk, chunk histograms
# ============================================================================================

@triton.jit
def _count_kernel(
    ids_ptr, map_ptr, local_ptr, rank_ptr, hist_ptr, stats_ptr, count_ptr,
    num_pairs, num_experts, num_global,
    CHUNK: tl.constexpr, E_P2: tl.constexpr, HIST_E: tl.constexpr, HAS_MAP: tl.constexpr,
    ADD_COUNT: tl.constexpr, RANK_SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    chunk = tl.program_id(0)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    in_range = i < num_pairs
    ids, mapped, local = _local_ids(ids_ptr, map_ptr, i, in_range, num_experts, num_global, HAS_MAP)
    # Validation data for the contiguous dispatch (the reference raises on these): id range over the
    # chunk, and the largest mapped id.
    tl.store(stats_ptr + chunk * 3, tl.min(tl.where(in_range, ids, 2**62)))
    tl.store(stats_ptr + chunk * 3 + 1, tl.max(tl.where(in_range, ids, -(2**62))))
    tl.store(stats_ptr + chunk * 3 + 2, tl.max(tl.where(in_range, mapped, -1)))
    local = local.to(tl.int32)
    tl.store(local_ptr + i, local, mask=in_range)

    # Per slice of HIST_E experts, from one [CHUNK, HIST_E] one-hot tile: the chunk's histogram (zeros
    # included: nothing needs a memset) and each local pair's rank_i = #{j < i in the chunk : local_j ==
    # local_i} (its column's inclusive prefix - 1; a non-local pair's rank is never read). NOTE: the rank was
    # a [CHUNK, CHUNK] comparison: 252 registers a thread, 1/8 occupancy, 12-17 us at 8192 tokens.
    # With more than one slice the column prefixes cost more than comparing the pairs RANK_SUB at a time
    # ([CHUNK, RANK_SUB] tiles, the earlier pairs' ids reloaded; RANK_SUB 0: prefixes).
    # The contiguous layout also adds the histogram to the zero-filled totals, so the scan knows every
    # segment's start at once.
    rank = tl.zeros([CHUNK], dtype=tl.int32)
    if RANK_SUB > 0:
        ii = tl.arange(0, CHUNK)
        for j0 in tl.static_range(0, CHUNK, RANK_SUB):
            jj = j0 + tl.arange(0, RANK_SUB)
            j = chunk * CHUNK + jj
            local_j = _local_ids(ids_ptr, map_ptr, j, j < num_pairs, num_experts, num_global, HAS_MAP)[2]
            earlier = (local[:, None] == local_j.to(tl.int32)[None, :]) & (jj[None, :] < ii[:, None])
            rank += tl.sum(earlier.to(tl.int32), axis=1)
    for e0 in tl.static_range(0, E_P2, HIST_E):
        e = e0 + tl.arange(0, HIST_E)
        onehot = (local[:, None] == e[None, :]).to(tl.int32)
        hist = tl.sum(onehot, axis=0)
        if RANK_SUB == 0:
            rank += tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1), axis=1)
        tl.store(hist_ptr + chunk.to(tl.int64) * num_experts + e, hist, mask=e < num_experts)
        if ADD_COUNT:
            tl.atomic_add(count_ptr + e, hist.to(tl.int64), mask=(e < num_experts) & (hist > 0), sem="relaxed")
    tl.store(rank_ptr + i, rank, mask=in_range)


# ============================================================================================
# 2. Prefix over chunks and segment starts; destinations of pairs and m_indices rows
# ============================================================================================

@triton.jit
def _scan_kernel(
    hist_ptr, base_ptr, count_ptr, seg_ptr, stats_ptr, status_ptr, masked_m_ptr,
    num_chunks, num_experts, max_m, align_m,
    E_P2: tl.constexpr, SCAN_C: tl.constexpr, SCAN_E: tl.constexpr, STAT_C: tl.constexpr,
    MASKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per slice of ``SCAN_E`` experts: exclusive prefix of the chunk histograms (``base``). Masked:
    ``masked_m`` of the slice. Contiguous: the slice's aligned segment starts from every expert's total
    (the count kernel's atomic sums), and one more program, after the slices', writes ``status =
    [M_total, min id, max id, max mapped id]`` — so the layout needs no separate segments launch. (Small
    slices and a program of its own for the status: the kernel is a chain of dependent loads, ~6 us in
    two programs of 16 experts with the status in the first.)"""
    pdl_start(PDL)
    pid = tl.program_id(0)
    num_slices = tl.cdiv(num_experts, SCAN_E)
    e = pid * SCAN_E + tl.arange(0, SCAN_E)
    e_ok = e < num_experts
    carry = tl.zeros([SCAN_E], dtype=tl.int32)
    for c0 in range(0, tl.where(pid < num_slices, num_chunks, 0), SCAN_C):
        c = c0 + tl.arange(0, SCAN_C)
        offs = c.to(tl.int64)[:, None] * num_experts + e[None, :]
        m = (c[:, None] < num_chunks) & e_ok[None, :]
        h = tl.load(hist_ptr + offs, mask=m, other=0)
        tl.store(base_ptr + offs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry = carry + tl.sum(h, axis=0)
    if MASKED:
        tl.store(masked_m_ptr + e, tl.minimum(carry, max_m), mask=e_ok)
    else:
        ea = tl.arange(0, E_P2)
        count = tl.load(count_ptr + ea, mask=ea < num_experts, other=0)
        seg_len = (count + align_m - 1) // align_m * align_m
        seg_start = tl.cumsum(seg_len, axis=0) - seg_len
        tl.store(seg_ptr + ea, seg_start, mask=(ea < num_experts) & (ea // SCAN_E == pid))
        if pid == num_slices:
            lo = tl.full([STAT_C], 2**62, tl.int64)
            hi = tl.full([STAT_C], -(2**62), tl.int64)
            top = tl.full([STAT_C], -1, tl.int64)
            for s0 in range(0, num_chunks, STAT_C):
                s = s0 + tl.arange(0, STAT_C)
                sm = s < num_chunks
                lo = tl.minimum(lo, tl.load(stats_ptr + s * 3, mask=sm, other=2**62))
                hi = tl.maximum(hi, tl.load(stats_ptr + s * 3 + 1, mask=sm, other=-(2**62)))
                top = tl.maximum(top, tl.load(stats_ptr + s * 3 + 2, mask=sm, other=-1))
            tl.store(status_ptr, tl.sum(seg_len))
            tl.store(status_ptr + 1, tl.min(lo))
            tl.store(status_ptr + 2, tl.max(hi))
            tl.store(status_ptr + 3, tl.max(top))


@triton.jit
def _pair_dests(local, rank_ptr, base_ptr, seg_ptr, p, p_ok, num_experts, max_m,
                CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """Destination rows of pairs ``p`` with local ids ``local`` (-1: not local, or past ``max_m`` in the
    masked layout): the pair's rank in its chunk + its expert's count in the earlier chunks (+ the
    segment start)."""
    is_local = p_ok & (local >= 0)
    lc = tl.where(is_local, local, 0)
    pos = tl.load(rank_ptr + p, mask=is_local, other=0) + tl.load(
        base_ptr + (p // CHUNK).to(tl.int64) * num_experts + lc, mask=is_local, other=0)
    if MASKED:
        keep = is_local & (pos < max_m)
        dest = lc.to(tl.int64) * max_m + pos
    else:
        keep = is_local
        dest = tl.load(seg_ptr + lc, mask=is_local, other=0) + pos
    return tl.where(keep, dest, -1)


@triton.jit
def _m_indices_rows(m_idx_ptr, count_ptr, seg_ptr, r, num_experts, m_rows, BLOCK: tl.constexpr,
                    E_CHUNK: tl.constexpr):
    """``m_indices`` of rows ``r``: a row's expert is the last ``e`` with ``seg_start[e] <= row`` (empty
    segments share their start with the next one, so the last wins); the row is that expert's if it
    lies below ``seg_start[e] + count[e]``, else padding (-1) — also every row past ``M_total``."""
    last = tl.full([BLOCK], -1, tl.int32)
    for e0 in range(0, num_experts, E_CHUNK):
        e = e0 + tl.arange(0, E_CHUNK)
        start = tl.load(seg_ptr + e, mask=e < num_experts, other=2**62)
        last += tl.sum((start[None, :] <= r[:, None]).to(tl.int32), axis=1)
    e_row = tl.maximum(last, 0)
    start = tl.load(seg_ptr + e_row)
    count = tl.load(count_ptr + e_row)
    inside = (last >= 0) & (r - start < count)
    tl.store(m_idx_ptr + r, tl.where(inside, e_row, -1), mask=r < m_rows)


# ============================================================================================
# 3. Scatter of rows and scales (+ row_map, m_indices)
# ============================================================================================

@triton.jit
def _layout_rows(status_ptr, M_ALIGN: tl.constexpr):
    """``(M_total, its TMA-aligned row count)``: the contiguous layout of a scatter launched before the
    host knows ``M_total`` (``utils.get_tma_aligned_m``)."""
    m_rows = tl.load(status_ptr).to(tl.int32)
    return m_rows, (m_rows + M_ALIGN - 1) // M_ALIGN * M_ALIGN


@triton.jit
def _publish(row_map_ptr, m_idx_ptr, count_ptr, seg_ptr, p, p_ok, dests, pid_t, num_experts, m_rows,
             M_BLOCK: tl.constexpr, E_CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """Column block 0's share: ``row_map`` of the program's pairs and (contiguous) ``M_BLOCK`` rows of
    ``m_indices`` per token block (blocks past ``M_total`` skip it; the compile-time test stays apart
    from the run-time one)."""
    tl.store(row_map_ptr + p, dests, mask=p_ok)
    if not MASKED:  # noqa: SIM102
        if pid_t * M_BLOCK < m_rows:
            r = pid_t.to(tl.int64) * M_BLOCK + tl.arange(0, M_BLOCK)
            _m_indices_rows(m_idx_ptr, count_ptr, seg_ptr, r, num_experts, m_rows, M_BLOCK, E_CHUNK)


@triton.jit
def _scale_offsets(dest, max_m, KG, m_pad, MASKED: tl.constexpr):
    """Offset of row ``dest``'s scale column in the TMA-layout scales (masked: ``dest = e·max_m + position``
    into the 3-D layout ``[E, max_m, KG]``); add ``g·m_pad`` for group ``g``."""
    if MASKED:
        return (dest // tl.maximum(max_m, 1)) * KG * m_pad + dest % tl.maximum(max_m, 1)
    return dest


@triton.jit
def _scatter_kernel(
    x_ptr, xs_ptr, local_ptr, rank_ptr, base_ptr, seg_ptr, count_ptr, status_ptr, row_map_ptr, m_idx_ptr, out_ptr,
    out_s_ptr, xq_ptr, xqs_ptr, src_ptr, tok_s_ptr, T, K, KG, num_experts, max_m, m_pad, m_rows, xs_stride_t,
    xs_stride_g, t_pad, eps,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, M_BLOCK: tl.constexpr, E_CHUNK: tl.constexpr, MASKED: tl.constexpr,
    SKIP_IDLE: tl.constexpr, ROWS_ON_DEVICE: tl.constexpr, M_ALIGN: tl.constexpr, QUANT: tl.constexpr,
    WRITE_X: tl.constexpr, UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, SCALES_APART: tl.constexpr,
    PDL: tl.constexpr,
):
    # SCALES_APART (contiguous): no scales here; column block 0 writes each destination row's token to
    # ``src`` and ``_scale_rows_kernel`` copies the scales after (from ``xs``, or under QUANT from the token-major
    # ``tok_s`` [T, KG] written here: gathered from the TMA layout of ``xqs`` that pass took 36 against 11 us,
    # H200, 8192 tokens x 7168, top-8 of 256)
    pdl_start(PDL)
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROWS_ON_DEVICE:  # contiguous, launched before the host knows M_total: the layout of M_total rows
        m_rows, m_pad = _layout_rows(status_ptr, M_ALIGN)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    # the block's SG = BLOCK_K / 128 scale groups (GROUP_K = 128) as [1, SG, 128] columns
    SG: tl.constexpr = BLOCK_K // 128
    g = pid_k * SG + tl.arange(0, SG)
    g_ok = g < KG
    col = g[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    col_ok = col < K
    jk = tl.arange(0, K_P2)
    p = t64[:, None] * TOP_K + jk[None, :]
    p_ok = t_ok[:, None] & (jk[None, :] < TOP_K)
    local = tl.load(local_ptr + p, mask=p_ok, other=-1)
    use = t_ok
    if SKIP_IDLE:  # expert parallelism: a third of the tokens have no local expert; their rows stay unread
        use = t_ok & (tl.max(local, axis=1) >= 0)
    # the rows first: their loads overlap the routing-state gathers
    offs = t64[:, None, None] * K + col
    mask = use[:, None, None] & col_ok
    s_mask = use[:, None] & g_ok[None, :]
    if QUANT:  # bf16/fp16/fp32 rows, masked lanes 0 (as quantize_groups needs)
        xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        row = tl.load(x_ptr + offs, mask=mask)
        if not SCALES_APART:
            sc = tl.load(xs_ptr + t64[:, None] * xs_stride_t + g[None, :] * xs_stride_g, mask=s_mask)
    # every destination of the block's pairs, from the routing state (column block 0 publishes them)
    dests = _pair_dests(local, rank_ptr, base_ptr, seg_ptr, p, p_ok, num_experts, max_m, CHUNK, MASKED)
    if QUANT:  # exactly as the quant kernel; WRITE_X: also the quantized input (TMA-layout scales, t_pad rows)
        row, sc = quantize_groups(xv, eps, UE8M0, NATIVE_FP8)
        if WRITE_X:
            tl.store(xq_ptr + offs, row, mask=mask)
            tl.store(xqs_ptr + t64[:, None] + g[None, :].to(tl.int64) * t_pad, sc, mask=s_mask)
        if SCALES_APART:
            tl.store(tok_s_ptr + t64[:, None] * KG + g[None, :], sc, mask=s_mask)
    if pid_k == 0:
        _publish(row_map_ptr, m_idx_ptr, count_ptr, seg_ptr, p, p_ok, dests, pid_t, num_experts, m_rows, M_BLOCK,
                 E_CHUNK, MASKED)
    for j in tl.static_range(TOP_K):
        dest = tl.sum(tl.where(jk[None, :] == j, dests, 0), axis=1)  # column j (register work)
        keep = dest >= 0
        # clamped, not tl.where(keep, dest, 0): with K_P2 = 16 (top_k 9-16) Triton 3.6's layout pass gives that
        # select's condition and result different layouts and fails ("PassManager::run failed")
        dest = tl.maximum(dest, 0)
        tl.store(out_ptr + dest[:, None, None] * K + col, row, mask=keep[:, None, None] & col_ok)
        if SCALES_APART:
            if pid_k == 0:
                tl.store(src_ptr + dest, t, mask=keep)
        else:
            s_offs = _scale_offsets(dest, max_m, KG, m_pad, MASKED)
            tl.store(out_s_ptr + s_offs[:, None] + g[None, :].to(tl.int64) * m_pad, sc,
                     mask=keep[:, None] & g_ok[None, :])


@triton.jit
def _scale_rows_kernel(
    src_ptr, m_idx_ptr, xs_ptr, out_s_ptr, status_ptr, m_rows, m_pad, max_m, KG, xs_stride_t, xs_stride_g,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, ROWS_ON_DEVICE: tl.constexpr, M_ALIGN: tl.constexpr,
    MASKED: tl.constexpr, PDL: tl.constexpr,
):
    """The scales, row by row (``SCALES_APART``): contiguous, row ``r`` of expert ``m_indices[r] >= 0`` takes
    token ``src[r]``'s scales, padding rows stay unwritten; masked (``m_idx_ptr`` is ``masked_m``; ``m_rows``
    unused), row ``r = e·max_m + position`` where the position is below ``masked_m[e]``. A [BLOCK_G, BLOCK_R]
    tile per program (masked: within one expert), its stores along the rows (whole sectors: the offsets must
    stay visibly contiguous, so no run-time division per row)."""
    pdl_start(PDL)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    if MASKED:
        blocks = tl.cdiv(max_m, BLOCK_R)  # programs per expert
        e = tl.program_id(0) // blocks
        pos = (tl.program_id(0) % blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = pos < tl.minimum(tl.load(m_idx_ptr + e), max_m)
        r = e.to(tl.int64) * max_m + pos
        out_row = e.to(tl.int64) * KG * m_pad + pos
    else:
        if ROWS_ON_DEVICE:
            m_rows, m_pad = _layout_rows(status_ptr, M_ALIGN)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < m_rows
        ok = r_ok & (tl.load(m_idx_ptr + r, mask=r_ok, other=-1) >= 0)
        out_row = r
    tok = tl.load(src_ptr + r, mask=ok, other=0).to(tl.int64)
    m = ok[None, :] & (g < KG)[:, None]
    v = tl.load(xs_ptr + tok[None, :] * xs_stride_t + g[:, None].to(tl.int64) * xs_stride_g, mask=m)
    tl.store(out_s_ptr + out_row[None, :] + g[:, None].to(tl.int64) * m_pad, v, mask=m)


@triton.jit
def _scatter_sparse_kernel(
    x_ptr, xs_ptr, local_ptr, rank_ptr, base_ptr, seg_ptr, count_ptr, status_ptr, row_map_ptr, m_idx_ptr, out_ptr,
    out_s_ptr, xq_ptr, xqs_ptr, T, K, KG, num_experts, max_m, m_pad, m_rows, xs_stride_t, xs_stride_g, t_pad, eps,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, M_BLOCK: tl.constexpr,
    E_CHUNK: tl.constexpr, MASKED: tl.constexpr, ROWS_ON_DEVICE: tl.constexpr, M_ALIGN: tl.constexpr,
    QUANT: tl.constexpr, WRITE_X: tl.constexpr, UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, PDL: tl.constexpr,
):
    """``_scatter_kernel`` for one token per program with its destinations as scalars and a branch per
    slot: an idle slot issues no stores, and a token without a local slot reads nothing (unless it writes
    ``x_fp8``). Under an ``expert_map`` about one slot in ``top_k`` is local, so the dense kernel's
    predicated stores of the idle slots cost more than its copying (as in the sparse combine)."""
    pdl_start(PDL)
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROWS_ON_DEVICE:
        m_rows, m_pad = _layout_rows(status_ptr, M_ALIGN)
    t64 = pid_t.to(tl.int64)
    jk = tl.arange(0, K_P2)
    p = t64 * TOP_K + jk
    p_ok = jk < tl.where(pid_t < T, TOP_K, 0)  # (programs past T only write m_indices)
    local = tl.load(local_ptr + p, mask=p_ok, other=-1)
    used = tl.max(local, axis=0) >= 0
    if WRITE_X:
        used = pid_t < T
    if used:  # (reading every row, its load issued first, was slower: 114.8 vs 98.2 us, session 15)
        SG: tl.constexpr = BLOCK_K // 128
        g = pid_k * SG + tl.arange(0, SG)
        g_ok = g < KG
        col = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        col_ok = col < K
        offs = t64 * K + col
        # the row's loads go out before the destinations' dependent gathers, which they then overlap
        # (session 18: 98.7 -> 94.7 us at 8192 tokens, EP rank)
        if QUANT:
            xv = tl.load(x_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)
        else:
            row = tl.load(x_ptr + offs, mask=col_ok)
            sc = tl.load(xs_ptr + t64 * xs_stride_t + g * xs_stride_g, mask=g_ok)
        dests = _pair_dests(local, rank_ptr, base_ptr, seg_ptr, p, p_ok, num_experts, max_m, CHUNK, MASKED)
        if QUANT:
            row, sc = quantize_groups(xv, eps, UE8M0, NATIVE_FP8)
            if WRITE_X:
                tl.store(xq_ptr + offs, row, mask=col_ok)
                tl.store(xqs_ptr + t64 + g.to(tl.int64) * t_pad, sc, mask=g_ok)
        for j in tl.static_range(TOP_K):
            dest = tl.max(tl.where(jk == j, dests, -1), axis=0)
            if dest >= 0:
                tl.store(out_ptr + dest * K + col, row, mask=col_ok)
                tl.store(out_s_ptr + _scale_offsets(dest, max_m, KG, m_pad, MASKED) + g.to(tl.int64) * m_pad, sc,
                         mask=g_ok)
    else:  # no local slot: every destination is -1
        dests = tl.full([K_P2], -1, tl.int64)
    if pid_k == 0:
        _publish(row_map_ptr, m_idx_ptr, count_ptr, seg_ptr, p, p_ok, dests, pid_t, num_experts, m_rows, M_BLOCK,
                 E_CHUNK, MASKED)


# ============================================================================================
# combine
# ============================================================================================

@triton.jit
def _combine_kernel(
    y_ptr, row_map_ptr, w_ptr, shared_ptr, out_ptr,
    T, H, num_rows, y_stride, rm_stride_t, rm_stride_k, w_stride_t, w_stride_k, sh_stride,
    TOP_K: tl.constexpr, K_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    GATHER_ALL: tl.constexpr, SPARSE: tl.constexpr, HAS_SHARED: tl.constexpr, NATIVE_CVT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = h < H
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    if GATHER_ALL:
        # Few programs (decode): every load first, the top_k gathered rows as ONE [BLOCK_T, K_P2, BLOCK_H]
        # load so all are in flight together (a load per slot compiled to ~3 rows in flight, then a
        # stall: three DRAM round trips per program). It costs K_P2 selects per element, which many
        # programs per SM (large batches) or mostly skipped slots (expert parallelism) do not repay.
        k = tl.arange(0, K_P2)
        if HAS_SHARED:  # independent of the row map: issued first
            sh = tl.load(shared_ptr + t64[:, None] * sh_stride + h[None, :], mask=t_ok[:, None] & h_ok[None, :],
                         other=0.0).to(tl.float32)
        pk_ok = t_ok[:, None] & (k[None, :] < TOP_K)
        r = tl.load(row_map_ptr + t64[:, None] * rm_stride_t + k[None, :] * rm_stride_k, mask=pk_ok,
                    other=-1).to(tl.int64)
        w = tl.load(w_ptr + t64[:, None] * w_stride_t + k[None, :] * w_stride_k, mask=pk_ok, other=0.0).to(tl.float32)
        use = pk_ok & (r >= 0)
        inside = r < num_rows
        v = tl.load(y_ptr + r[:, :, None] * y_stride + h[None, None, :],
                    mask=(use & inside)[:, :, None] & h_ok[None, None, :], other=0.0).to(tl.float32)
        v = tl.where(inside[:, :, None], v, float("nan"))
        prod = tl.where(use[:, :, None], w[:, :, None] * v, 0.0)  # skipped slots add +0.0, as the reference
        # Slot order, as the reference: acc = acc + w_j·y_j from acc = +0.0. Slot j of ``prod`` is taken
        # by a sum with zeros: exact (a -0.0 read as +0.0 cannot change an accumulator that starts at
        # +0.0), and register work (the slot axis lies inside each thread: the tile's vectors run along h).
        for j in tl.static_range(TOP_K):
            acc = acc + tl.sum(tl.where(k[None, :, None] == j, prod, 0.0), axis=1)
        if HAS_SHARED:
            acc = acc + sh
    else:
        if SPARSE:  # BLOCK_T == 1: a branch per slot, so a slot that is not local costs no load and no math
            tok = tl.program_id(0).to(tl.int64)
            for j in tl.static_range(TOP_K):
                r = tl.load(row_map_ptr + tok * rm_stride_t + j * rm_stride_k).to(tl.int64)
                if r >= 0:
                    w = tl.load(w_ptr + tok * w_stride_t + j * w_stride_k).to(tl.float32)
                    inside = h * 0 + r < num_rows  # [BLOCK_H]: a bad row id poisons the token, never reads
                    v = tl.load(y_ptr + r * y_stride + h, mask=h_ok & inside, other=0.0).to(tl.float32)
                    v = tl.where(inside, v, float("nan"))
                    acc = acc + w * v[None, :]
        else:
            acc = _combine_slots(y_ptr, row_map_ptr, w_ptr, acc, t64, t_ok, h, h_ok, num_rows, y_stride, rm_stride_t,
                                 rm_stride_k, w_stride_t, w_stride_k, TOP_K)
        if HAS_SHARED:
            acc = acc + tl.load(shared_ptr + t64[:, None] * sh_stride + h[None, :],
                                mask=t_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + t64[:, None] * H + h[None, :], to_bf16(acc, NATIVE_CVT), mask=t_ok[:, None] & h_ok[None, :])


@triton.jit
def _combine_slots(y_ptr, row_map_ptr, w_ptr, acc, t64, t_ok, h, h_ok, num_rows, y_stride, rm_stride_t, rm_stride_k,
                   w_stride_t, w_stride_k, TOP_K: tl.constexpr):
    """``acc + Σ_j w_j·y_j`` of a ``[BLOCK_T, BLOCK_H]`` tile, one masked load per slot (no branches: the
    loads of several slots can be in flight together)."""
    for j in tl.static_range(TOP_K):
        r = tl.load(row_map_ptr + t64 * rm_stride_t + j * rm_stride_k, mask=t_ok, other=-1).to(tl.int64)
        w = tl.load(w_ptr + t64 * w_stride_t + j * w_stride_k, mask=t_ok, other=0.0).to(tl.float32)
        use = t_ok & (r >= 0)
        inside = r < num_rows
        v = tl.load(y_ptr + r[:, None] * y_stride + h[None, :], mask=(use & inside)[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)
        v = tl.where(inside[:, None], v, float("nan"))
        acc = tl.where(use[:, None], acc + w[:, None] * v, acc)
    return acc


# ============================================================================================
# Launch wrappers
# ============================================================================================

class _Routing(NamedTuple):
    """The chunked routing's device state: what the scatter needs to place every pair (``local``,
    ``rank``, ``base``; contiguous also ``seg_start`` and ``count``), and the contiguous layout's
    ``status = [M_total, min id, max id, max mapped id]`` for the host. ``has_map``: an ``expert_map``
    was given (tokens without a local expert exist)."""
    local: torch.Tensor
    rank: torch.Tensor
    base: torch.Tensor
    seg_start: torch.Tensor
    count: torch.Tensor
    status: torch.Tensor
    has_map: bool
    masked_m: torch.Tensor | None = None  # masked layout: the rows of each expert


class Router(Protocol):
    """A kernel that computes the chunked routing state (``_Routing``) as ``_count_kernel`` then ``_scan_kernel``
    do (the Hopper backend's, ``kernels/dispatch.py``), or returns None where it does not take the call."""

    def __call__(self, topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, max_m: int,
                 align_m: int, masked_m: torch.Tensor | None, chunk: int) -> _Routing | None: ...


def _route(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, max_m: int,
           align_m: int, masked_m: torch.Tensor | None, cfg: DispatchConfig, router: Router | None = None) -> _Routing:
    """Route the flat (token, slot) pairs in two launches: ``_count_kernel`` then ``_scan_kernel``
    (``masked_m`` is written when given: masked layout), or by ``router`` where it takes the call. The scatter
    turns the result into ``row_map``."""
    if router is not None:
        routing = router(topk_ids, num_experts, expert_map, max_m, align_m, masked_m, cfg.chunk)
        if routing is not None:
            return routing
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    masked = masked_m is not None
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    emap = None if expert_map is None else (expert_map if expert_map.is_contiguous() else expert_map.contiguous())
    num_global = emap.shape[0] if emap is not None else num_experts
    num_chunks = ceil_div(num_pairs, cfg.chunk)
    # two allocations (host time per launch counts here): int32 [local | rank | hist | base] and int64
    # [count | seg_start | status | stats], zero-filled for the contiguous layout's atomic counts
    hist_size = num_chunks * num_experts
    i32 = torch.empty(2 * num_pairs + 2 * hist_size, dtype=torch.int32, device=device)
    local, rank, hist, base = i32.split([num_pairs, num_pairs, hist_size, hist_size])
    i64 = (torch.empty if masked else torch.zeros)(2 * num_experts + 4 + 3 * num_chunks, dtype=torch.int64,
                                                   device=device)
    count, seg_start, status, stats = i64.split([num_experts, num_experts, 4, 3 * num_chunks])
    if num_chunks > 0:
        launch(_count_kernel, (num_chunks,),
            ids, emap if emap is not None else ids, local, rank, hist, stats, count, num_pairs, num_experts,
            num_global, CHUNK=cfg.chunk, E_P2=cfg.e_p2, HIST_E=cfg.hist_experts, HAS_MAP=emap is not None,
            ADD_COUNT=not masked, RANK_SUB=cfg.rank_sub, num_warps=cfg.route_warps, **pdl_args(device))
    launch(_scan_kernel, (ceil_div(num_experts, cfg.scan_experts) + (0 if masked else 1),),
        hist, base, count, seg_start, stats, status, masked_m if masked else count, num_chunks, num_experts,
        max_m, align_m, E_P2=cfg.e_p2,
        SCAN_C=cfg.scan_chunks if num_chunks > 64 else max(triton.next_power_of_2(num_chunks), 16),
        SCAN_E=cfg.scan_experts, STAT_C=cfg.scan_chunks, MASKED=masked, num_warps=cfg.route_warps,
        **pdl_args(device))
    return _Routing(local, rank, base, seg_start, count, status, emap is not None, masked_m)


class _Quant(NamedTuple):
    """Quantization inside the scatter (``quant_dispatch_contiguous``): its arguments, and where the
    quantized input goes (``x_fp8`` / ``x_scale``; None: not written)."""
    ue8m0: bool
    eps: float
    x_fp8: torch.Tensor | None
    x_scale: torch.Tensor | None


def _scatter(x: torch.Tensor, x_scale: torch.Tensor | None, routing: _Routing, out: torch.Tensor,
             out_scale: torch.Tensor, row_map: torch.Tensor, m_indices: torch.Tensor | None, max_m: int,
             m_pad: int, cfg: DispatchConfig, rows_on_device: bool = False, quant: _Quant | None = None,
             mover: RowMover | None = None) -> None:
    """Copy every token row (and its scales) to its destinations; column block 0 also writes
    ``row_map`` and, contiguous layout (``m_indices`` given), ``M_BLOCK`` rows of ``m_indices`` per
    token block (the grid covers both). ``x``: FP8 rows with their ``x_scale``, or with ``quant`` the
    bf16/fp16/fp32 rows, quantized on the way (``x_scale`` None). ``rows_on_device``: the contiguous
    layout has ``M_total`` rows (read from ``routing.status``) and its scales the TMA layout of
    ``M_total`` rows; ``out``, ``out_scale`` (flat) and ``m_indices`` are upper-bound buffers. ``mover``: the
    FP8 rows by that kernel instead (see ``RowMover``)."""
    num_tokens, k = x.shape
    masked = m_indices is None
    if mover is not None and quant is None:
        _move_rows(mover, x, x_scale, routing, out, out_scale, row_map, m_indices, max_m, m_pad, cfg, rows_on_device)
        return
    m_rows = 0 if masked else m_indices.shape[0]
    m_block = 128
    t_blocks = max(ceil_div(num_tokens, cfg.block_t), ceil_div(m_rows, m_block))
    if t_blocks == 0:
        return
    block_k = max(triton.next_power_of_2(cfg.block_k), 128)  # whole scale groups
    col_blocks = max(ceil_div(k, block_k), 1)
    if col_blocks > MAX_GRID_YZ:
        raise ValueError(f"hidden size {k} needs {col_blocks} column blocks (> {MAX_GRID_YZ})")
    num_experts = routing.count.shape[0]
    write_x = quant is not None and quant.x_fp8 is not None
    # pointers a variant never dereferences get a stand-in: x_scale when quantizing, x_fp8 / x_scale unwritten
    src, src_scale, xs_strides = (x.view(torch.uint8), x_scale, x_scale.stride()) if quant is None else \
        (x, out_scale, (0, 0))
    x_dst, x_dst_scale = (quant.x_fp8, quant.x_scale) if write_x else (out, out_scale)
    head = (src, src_scale, routing.local, routing.rank, routing.base, routing.seg_start, routing.count,
            routing.status, row_map, row_map if masked else m_indices, out.view(torch.uint8), out_scale,
            x_dst.view(torch.uint8), x_dst_scale)
    kg = ceil_div(k, 128)
    tail = (num_tokens, k, kg, num_experts, max_m, m_pad, m_rows, *xs_strides,
            get_tma_aligned_m(num_tokens), float(quant.eps) if quant is not None else 0.0)
    meta = dict(TOP_K=row_map.shape[1], K_P2=triton.next_power_of_2(row_map.shape[1]), BLOCK_K=block_k,
                CHUNK=cfg.chunk, M_BLOCK=m_block,
                E_CHUNK=min(triton.next_power_of_2(max(num_experts, 1)), M_INDICES_E_CHUNK), MASKED=masked,
                ROWS_ON_DEVICE=rows_on_device, M_ALIGN=SCALE_M_ALIGN, QUANT=quant is not None, WRITE_X=write_x,
                UE8M0=quant is not None and bool(quant.ue8m0), NATIVE_FP8=quant is not None and native_fp8(x.device),
                num_warps=cfg.num_warps, **pdl_args(x.device))
    if cfg.sparse:
        launch(_scatter_sparse_kernel, (t_blocks, col_blocks), *head, *tail, **meta)
        return
    # scales in a pass of their own (contiguous; from x_scale, or from the quantized input's scales token-major)
    apart = cfg.scales_apart and not masked and m_rows > 0
    # (row_map / out_scale stand in where nothing is recorded: no pointer of an empty tensor reaches the launch)
    src_rows = torch.empty(m_rows, dtype=torch.int32, device=x.device) if apart else row_map
    token_scales = torch.empty((num_tokens, kg), dtype=torch.float32, device=x.device) if apart and quant else None
    launch(_scatter_kernel, (t_blocks, col_blocks), *head, src_rows,
           token_scales if token_scales is not None else out_scale, *tail, BLOCK_T=cfg.block_t,
           SKIP_IDLE=routing.has_map and not write_x, SCALES_APART=apart, **meta)
    if apart:
        _scale_rows(src_rows, m_indices, x_scale if quant is None else token_scales, out_scale, routing, m_pad,
                    rows_on_device)


def _scale_rows(src_rows: torch.Tensor, m_indices: torch.Tensor | None, scales: torch.Tensor,
                out_scale: torch.Tensor, routing: _Routing, m_pad: int, rows_on_device: bool, max_m: int = 0) -> None:
    """``_scale_rows_kernel`` over the ``m_indices.shape[0]`` rows (``m_indices`` None: the masked layout's
    ``E·max_m``, valid below ``routing.masked_m``): each row's scales from ``scales[src_rows]`` (``[T, KG]``,
    any strides)."""
    masked = m_indices is None
    kg = scales.shape[1]
    block_g = min(triton.next_power_of_2(kg), SCALE_ROWS_BLOCK_G)
    # masked: each program within one expert
    m_rows = 0 if masked else m_indices.shape[0]
    programs = routing.masked_m.shape[0] * ceil_div(max_m, SCALE_ROWS_BLOCK_R) if masked else \
        ceil_div(m_rows, SCALE_ROWS_BLOCK_R)
    launch(_scale_rows_kernel, (programs, ceil_div(kg, block_g)),
        src_rows, routing.masked_m if masked else m_indices, scales, out_scale, routing.status, m_rows, m_pad, max_m,
        kg, *scales.stride(), BLOCK_R=SCALE_ROWS_BLOCK_R, BLOCK_G=block_g, ROWS_ON_DEVICE=rows_on_device,
        M_ALIGN=SCALE_M_ALIGN, MASKED=masked, num_warps=4, **pdl_args(scales.device))


class RowMover(Protocol):
    """A kernel that does the chunked scatter of FP8 rows from the routing state (the Hopper backend's,
    ``kernels/dispatch.py``): ``row_map``, every local pair's row and (contiguous, ``m_indices`` given)
    ``m_indices``, else the masked layout of ``max_m`` rows per expert; the scales either to ``out_scale``
    directly or, given ``src_rows`` / ``token_scales``, each destination row's token and the tokens' scales
    token-major (``[T, KG]``), from which ``_scale_rows_kernel`` then writes them."""

    def __call__(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, local: torch.Tensor, rank: torch.Tensor,
                 base: torch.Tensor, seg_start: torch.Tensor, count: torch.Tensor, status: torch.Tensor, chunk: int,
                 out: torch.Tensor, out_scale: torch.Tensor, row_map: torch.Tensor, m_indices: torch.Tensor | None,
                 max_m: int, m_pad: int, rows_on_device: bool, src_rows: torch.Tensor | None,
                 token_scales: torch.Tensor | None) -> None: ...


def _move_rows(mover: RowMover, x_fp8: torch.Tensor, x_scale: torch.Tensor, routing: _Routing, out: torch.Tensor,
               out_scale: torch.Tensor, row_map: torch.Tensor, m_indices: torch.Tensor | None, max_m: int,
               m_pad: int, cfg: DispatchConfig, rows_on_device: bool) -> None:
    """The FP8 scatter by ``mover`` (``m_indices`` None: masked layout), its scales in a pass of their own
    where ``mover_scales_apart`` says so."""
    masked = m_indices is None
    m_rows = routing.masked_m.shape[0] * max_m if masked else m_indices.shape[0]
    apart = m_rows > 0 and mover_scales_apart(row_map.numel(), routing.has_map)
    src_rows = torch.empty(m_rows, dtype=torch.int32, device=x_fp8.device) if apart else None
    token_scales = torch.empty((x_fp8.shape[0], x_scale.shape[1]), dtype=torch.float32,
                               device=x_fp8.device) if apart else None
    mover(x_fp8, x_scale, routing.local, routing.rank, routing.base, routing.seg_start, routing.count, routing.status,
          cfg.chunk, out, out_scale, row_map, m_indices, max_m, m_pad, rows_on_device, src_rows, token_scales)
    if apart:
        _scale_rows(src_rows, m_indices, token_scales, out_scale, routing, m_pad, rows_on_device, max_m)


def _fused_grid(num_tokens: int, num_experts: int, col_blocks: int, cfg: DispatchConfig) -> tuple[int, int]:
    """Grid of a fused masked dispatch: counting rows (``e_block`` experts per program), then token rows."""
    rows = ceil_div(ceil_div(num_experts, cfg.e_block), col_blocks) + ceil_div(num_tokens, cfg.block_t)
    return max(rows, 1), col_blocks


def _fused(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
           num_experts: int, max_m: int, m_pad: int, out: torch.Tensor, out_scale: torch.Tensor,
           row_map: torch.Tensor, masked_m: torch.Tensor, cfg: DispatchConfig) -> None:
    num_tokens, k = x_fp8.shape
    top_k = topk_ids.shape[1]
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    emap = None if expert_map is None else (expert_map if expert_map.is_contiguous() else expert_map.contiguous())
    col_blocks = max(ceil_div(k, cfg.block_k), 1)
    if col_blocks > MAX_GRID_YZ:
        raise ValueError(f"hidden size {k} needs {col_blocks} column blocks (> {MAX_GRID_YZ})")
    launch(_dispatch_fused_kernel, _fused_grid(num_tokens, num_experts, col_blocks, cfg),
        x_fp8.view(torch.uint8), x_scale, ids, emap if emap is not None else ids, out.view(torch.uint8),
        out_scale, row_map, masked_m, num_tokens, k, x_scale.shape[1], num_experts,
        emap.shape[0] if emap is not None else num_experts, max_m, m_pad,
        x_scale.stride(0), x_scale.stride(1),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k,
        RANK_CHUNK=cfg.rank_chunk, E_BLOCK=cfg.e_block, HAS_MAP=emap is not None, num_warps=cfg.num_warps,
        **pdl_args(x_fp8.device))


def _masked_destinations(out: torch.Tensor | None, out_scale: torch.Tensor | None, num_experts: int, max_m: int,
                         k: int, kg: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked layout's ``[E, max_m, K]`` codes and 3-D TMA-layout scales: the given ones, checked, or new."""
    m_pad = get_tma_aligned_m(max_m)
    if out is None:
        out = torch.empty((num_experts, max_m, k), dtype=FP8_DTYPE, device=device)
    elif out.shape != (num_experts, max_m, k) or out.dtype != FP8_DTYPE or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float8_e4m3fn [{num_experts}, {max_m}, {k}]")
    if out_scale is None:
        out_scale = empty_scale_tma(max_m, kg, groups=num_experts, device=device)
    elif (out_scale.shape != (num_experts, max_m, kg) or out_scale.dtype != torch.float32
          or out_scale.stride() != (kg * m_pad, 1, m_pad)):
        raise ValueError(f"out_scale must be float32 [{num_experts}, {max_m}, {kg}] in the 3-D TMA layout")
    return out, out_scale


def dispatch_masked(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    max_m: int, expert_map: torch.Tensor | None, *, out: torch.Tensor | None = None,
                    out_scale: torch.Tensor | None = None, config: DispatchConfig | None = None,
                    mover: RowMover | None = None, router: Router | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::dispatch_masked`` (see ``moe_fp8.ops``); no host sync. ``mover``: the
    chunked path's rows by that kernel (see ``RowMover``; the fused path has no routing state to give it);
    ``router``: its routing state by that kernel (see ``Router``).

    Returns ``(out_fp8 [E, max_m, K], out_scale [E, max_m, KG] (3-D TMA layout), masked_m int32 [E],
    row_map int64 [T, top_k])``. Rows past ``masked_m[e]`` are not written: pass persistent ``out`` /
    ``out_scale`` to keep their contents. Ids outside ``[0, E)`` (or outside ``expert_map``) and
    experts mapped outside ``[0, E)`` count as not local (the reference does not validate them).
    ``config``: a ``DispatchConfig`` instead of ``configs.dispatch_config``'s (tuning).
    """
    device = check_launch_device(x_fp8, x_scale, topk_ids, expert_map, out, out_scale)
    num_tokens, k = x_fp8.shape
    top_k = topk_ids.shape[1]
    kg = x_scale.shape[1]
    m_pad = get_tma_aligned_m(max_m)
    out, out_scale = _masked_destinations(out, out_scale, num_experts, max_m, k, kg, device)
    masked_m = torch.empty(num_experts, dtype=torch.int32, device=device)
    cfg = config or dispatch_config(num_tokens, top_k, k, num_experts, has_map=expert_map is not None)
    if cfg.fused:
        row_map = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
        _fused(x_fp8, x_scale, topk_ids, expert_map, num_experts, max_m, m_pad, out, out_scale, row_map,
               masked_m, cfg)
        return out, out_scale, masked_m, row_map
    routing = _route(topk_ids, num_experts, expert_map, max_m, 1, masked_m, cfg, router)
    row_map = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    _scatter(x_fp8, x_scale, routing, out, out_scale, row_map, None, max_m, m_pad, cfg, mover=mover)
    return out, out_scale, masked_m, row_map


def quant_dispatch_masked(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, max_m: int,
                          expert_map: torch.Tensor | None, ue8m0: bool = False, eps: float = 1e-10, *,
                          out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                          config: DispatchConfig | None = None, router: Router | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor]:
    """``per_token_group_quant(x, 128, ue8m0, eps)`` then ``dispatch_masked`` — one launch at decode.

    Returns ``(x_fp8 [T, K], x_scale [T, KG] (TMA layout), out_fp8, out_scale, masked_m, row_map)``,
    bit-identical to the two calls (``x_fp8`` / ``x_scale`` for the shared experts). With few pairs
    (``configs.dispatch_config(...).fused``) each dispatch program quantizes its own slice of the
    rows and copies the codes to every destination, so the decode step has no quantization launch
    and never reads ``x_fp8`` back; otherwise the two ops run one after the other.
    ``x``: contiguous ``[T, K]`` bf16 / fp16 / fp32; ``out`` / ``out_scale`` / ``router`` as ``dispatch_masked``.
    """
    device = check_launch_device(x, topk_ids, expert_map, out, out_scale)
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, K] tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, k = x.shape
    top_k = topk_ids.shape[1]
    cfg = config or dispatch_config(num_tokens, top_k, k, num_experts, has_map=expert_map is not None)
    if not cfg.fused or num_tokens == 0:
        x_fp8, x_scale = _quantize(x, ue8m0, eps)
        return (x_fp8, x_scale, *dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map,
                                                 out=out, out_scale=out_scale, config=cfg, router=router))
    kg = ceil_div(k, 128)
    m_pad = get_tma_aligned_m(max_m)
    out, out_scale = _masked_destinations(out, out_scale, num_experts, max_m, k, kg, device)
    x_fp8 = torch.empty((num_tokens, k), dtype=FP8_DTYPE, device=device)
    x_scale = empty_scale_tma(num_tokens, kg, device=device)
    masked_m = torch.empty(num_experts, dtype=torch.int32, device=device)
    row_map = torch.empty((num_tokens, top_k), dtype=torch.int64, device=device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    emap = None if expert_map is None else (expert_map if expert_map.is_contiguous() else expert_map.contiguous())
    block_k = max(cfg.block_k, 128)  # whole scale groups per program
    col_blocks = max(ceil_div(k, block_k), 1)
    if col_blocks > MAX_GRID_YZ:
        raise ValueError(f"hidden size {k} needs {col_blocks} column blocks (> {MAX_GRID_YZ})")
    launch(_quant_dispatch_fused_kernel, _fused_grid(num_tokens, num_experts, col_blocks, cfg),
        x, ids, emap if emap is not None else ids, x_fp8.view(torch.uint8), x_scale, out.view(torch.uint8),
        out_scale, row_map, masked_m, num_tokens, k, kg, num_experts,
        emap.shape[0] if emap is not None else num_experts, max_m, m_pad, get_tma_aligned_m(num_tokens), float(eps),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_T=cfg.block_t, BLOCK_K=block_k,
        RANK_CHUNK=cfg.rank_chunk, E_BLOCK=cfg.e_block, HAS_MAP=emap is not None, UE8M0=bool(ue8m0),
        NATIVE_FP8=native_fp8(device), num_warps=cfg.num_warps, **pdl_args(device))
    return x_fp8, x_scale, out, out_scale, masked_m, row_map


def contiguous_rows_bound(num_tokens: int, top_k: int, num_experts: int, align_m: int) -> int:
    """Rows of ``dispatch_contiguous(sync=False)``'s outputs: ``M_total <= T·top_k + E·(align_m − 1)``
    (each expert's segment pads fewer than ``align_m`` rows), rounded up to a multiple of ``align_m``."""
    return ceil_div(num_tokens * top_k + num_experts * (align_m - 1), align_m) * align_m


_PINNED = threading.local()  # per thread: {device index: (pinned status buffer, event)}


def _status_to_host(status: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``status`` (4 int64) to pinned host memory; ``(host, done)`` — wait on ``done``
    (None: on the host already) before reading ``host``. Unlike ``.tolist()``, the GPU work enqueued
    after this keeps the GPU busy while the host waits and then prepares the launches that need it.
    The buffer and event are reused per thread and device (creating them costs ~20 us of host time on
    the H100 machine): every caller reads the buffer before its thread can start another copy."""
    if status.device.type != "cuda":  # Triton's interpreter
        return status, None
    cache = getattr(_PINNED, "by_device", None)
    if cache is None:
        cache = _PINNED.by_device = {}
    entry = cache.get(status.device.index)
    if entry is None:
        entry = cache[status.device.index] = (torch.empty(4, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
    host, done = entry
    host.copy_(status, non_blocking=True)
    done.record()
    return host, done


def _contiguous_rows(status: tuple[torch.Tensor, torch.cuda.Event | None], topk_ids: torch.Tensor,
                     num_experts: int, expert_map: torch.Tensor | None, align_m: int, sync: bool) -> int:
    """Rows of the contiguous outputs: ``M_total`` read from ``status`` (the one host sync; raises the
    reference's errors on invalid ids), or the upper bound without a sync."""
    num_tokens, top_k = topk_ids.shape
    if not sync:
        return contiguous_rows_bound(num_tokens, top_k, num_experts, align_m)
    host, done = status
    if done is not None:
        done.synchronize()
    m_total, lo, hi, top = host.tolist()
    if topk_ids.numel() > 0:
        num_ids = num_experts if expert_map is None else expert_map.shape[0]
        if lo < 0 or hi >= num_ids:
            raise ValueError(f"topk_ids must lie in [0, {num_ids}), got range [{lo}, {hi}]")
        if top >= num_experts:
            raise ValueError(f"expert_map maps to local id {top} >= num_experts={num_experts}")
    return m_total


def _contiguous_plan(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None, align_m: int,
                     sync: bool, cfg: DispatchConfig, router: Router | None = None) -> tuple[_Routing, tuple]:
    """Everything of the contiguous dispatch that needs no ``M_total``: ``(routing, pending status)`` —
    ``_contiguous_rows(pending, ...)`` then gives the rows."""
    routing = _route(topk_ids, num_experts, expert_map, 0, align_m, None, cfg, router)
    return routing, (_status_to_host(routing.status) if sync else (routing.status, None))


def _contiguous_scatter(x: torch.Tensor, x_scale: torch.Tensor | None, topk_ids: torch.Tensor, routing: _Routing,
                        m_rows: int, cfg: DispatchConfig, rows_on_device: bool = False, quant: _Quant | None = None,
                        mover: RowMover | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate an ``m_rows``-row contiguous layout and scatter the rows into it (one launch, which also
    writes ``m_indices`` and ``row_map``; ``x`` / ``x_scale`` / ``quant`` as ``_scatter``). ``rows_on_device``:
    ``m_rows`` is the upper bound and the kernel lays out the ``M_total`` rows of ``routing.status`` (the
    scales come back flat: ``_contiguous_views``)."""
    device = x.device
    kg = ceil_div(x.shape[1], 128)
    out = torch.empty((m_rows, x.shape[1]), dtype=FP8_DTYPE, device=device)
    if rows_on_device:
        out_scale = torch.empty(kg * get_tma_aligned_m(m_rows), dtype=torch.float32, device=device)
    else:
        out_scale = empty_scale_tma(m_rows, kg, device=device)
    m_indices = torch.empty(m_rows, dtype=torch.int32, device=device)
    row_map = torch.empty(topk_ids.shape, dtype=torch.int64, device=device)
    _scatter(x, x_scale, routing, out, out_scale, row_map, m_indices, 0, get_tma_aligned_m(m_rows), cfg,
             rows_on_device, quant, mover)
    return out, out_scale, m_indices, row_map


def _contiguous_views(bufs: tuple[torch.Tensor, ...], m_total: int, kg: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``m_total`` rows of ``_contiguous_scatter(rows_on_device=True)``'s buffers, the scales
    in the TMA layout of ``m_total`` rows (as the kernel wrote them)."""
    out, out_scale_flat, m_indices, row_map = bufs
    m_pad = get_tma_aligned_m(m_total)
    out_scale = out_scale_flat[:kg * m_pad].view(kg, m_pad)[:, :m_total].t()
    return out[:m_total], out_scale, m_indices[:m_total], row_map


def _dispatch_contiguous(x: torch.Tensor, x_scale: torch.Tensor | None, topk_ids: torch.Tensor, num_experts: int,
                         expert_map: torch.Tensor | None, align_m: int, sync: bool, cfg: DispatchConfig,
                         plan: tuple[_Routing, tuple], quant: _Quant | None = None, mover: RowMover | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scatter of a planned contiguous dispatch (``x`` / ``x_scale`` / ``quant`` as ``_scatter``).
    ``sync=True``: launched before the host sync into upper-bound buffers (the kernel reads ``M_total``
    on the device), so the GPU copies rows while the host waits for ``M_total`` and prepares GEMM1; the
    results are views of those buffers."""
    routing, pending = plan
    num_tokens, top_k = topk_ids.shape
    bound = contiguous_rows_bound(num_tokens, top_k, num_experts, align_m)
    if not sync:
        return _contiguous_scatter(x, x_scale, topk_ids, routing, bound, cfg, quant=quant, mover=mover)
    bufs = _contiguous_scatter(x, x_scale, topk_ids, routing, bound, cfg, rows_on_device=True, quant=quant,
                               mover=mover)
    m_total = _contiguous_rows(pending, topk_ids, num_experts, expert_map, align_m, sync)
    return _contiguous_views(bufs, m_total, ceil_div(x.shape[1], 128))


def _m_total(plan: tuple[_Routing, tuple]) -> torch.Tensor:
    """``M_total`` as an int32 ``[1]`` device tensor: a view of the routing's status (int64, little-endian;
    ``M_total < 2**31``), so returning it costs no launch."""
    return plan[0].status.view(torch.int32)[:1]


def dispatch_contiguous(x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                        expert_map: torch.Tensor | None, align_m: int, *, sync: bool = True,
                        return_m_total: bool = False, config: DispatchConfig | None = None,
                        mover: RowMover | None = None, router: Router | None = None) -> tuple[torch.Tensor, ...]:
    """Backend entry of ``dispatch_contiguous`` (see ``moe_fp8.ops``) on the portable backend, and on Hopper
    with the ``mover`` and ``router`` of ``kernels/dispatch.py`` (see ``RowMover``, ``Router``).

    ``sync=True``: one host sync (``M_total``); raises ``ValueError`` exactly where the reference does
    (ids outside ``[0, num_ids)``, a map to a local id ``>= num_experts``), from the same sync. The
    outputs are ``M_total``-row views of buffers sized ``contiguous_rows_bound(...)`` (the scatter runs
    before the sync; the buffers live as long as the views).
    ``sync=False``: no sync; outputs have ``contiguous_rows_bound(...)`` rows, the rows past
    ``M_total`` are padding (``m_indices = -1``), invalid ids are not local. Padding rows' FP8 bytes
    and scales are not written. ``return_m_total``: also return ``M_total`` as an int32 ``[1]`` device
    tensor (for the GEMMs' ``m_total``). ``config``: a ``DispatchConfig`` (tuning).
    """
    check_launch_device(x_fp8, x_scale, topk_ids, expert_map)
    cfg = config or dispatch_config(x_fp8.shape[0], topk_ids.shape[1], x_fp8.shape[1], num_experts,
                                    has_map=expert_map is not None)
    plan = _contiguous_plan(topk_ids, num_experts, expert_map, align_m, sync, cfg, router)
    routed = _dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync, cfg, plan,
                                  mover=mover)
    return (*routed, _m_total(plan)) if return_m_total else routed


def quant_dispatch_contiguous(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                              expert_map: torch.Tensor | None, align_m: int, ue8m0: bool = False,
                              eps: float = 1e-10, *, sync: bool = True, return_x: bool = True,
                              return_m_total: bool = False, config: DispatchConfig | None = None,
                              router: Router | None = None) -> tuple[torch.Tensor | None, ...]:
    """``per_token_group_quant(x, 128, ue8m0, eps)`` then ``dispatch_contiguous``, ordered so the host
    sync costs no GPU idle time: the routing kernels run first and ``M_total`` goes to pinned host
    memory before the copying is enqueued, so the host waits only for the routing and returns while the
    GPU is still quantizing and copying rows.

    The scatter quantizes each row itself and stores the codes to every destination, so the FP8 input is
    never read back (nor written, without ``return_x``). Without an ``expert_map`` (every pair local:
    ``top_k`` copies per token) that is the dense scatter; with one (expert parallelism: about one copy
    per token, a third of the tokens idle) the sparse scatter, which without ``return_x`` reads only the
    rows it stores. Session 18 (H100, 16384 tokens, 32 of 256 experts local, CUDA-graph timed, after the
    quantization lost its division): sparse 133.5 us without ``x_fp8``, 186.1 with it, against 138.8 +
    82.5 for the quant kernel then the FP8 scatter (session 15, before: the two kernels won with
    ``x_fp8``). A dense config under a map (``config.sparse`` False) takes the two kernels.

    Returns ``(x_fp8 [T, K], x_scale [T, KG] (TMA layout), out_fp8, out_scale, m_indices, row_map)``,
    bit-identical to the two calls; ``return_x=False``: ``(None, None, ...)``; ``return_m_total``: and
    ``M_total`` (int32 ``[1]``, device). ``x``: contiguous ``[T, K]`` bf16 / fp16 / fp32; the rest (``router``
    too) as ``dispatch_contiguous``.
    """
    device = check_launch_device(x, topk_ids, expert_map)
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [T, K] tensor, got shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, k = x.shape
    has_map = expert_map is not None
    cfg = config or dispatch_config(num_tokens, topk_ids.shape[1], k, num_experts, has_map=has_map, quant=True)
    plan = _contiguous_plan(topk_ids, num_experts, expert_map, align_m, sync, cfg, router)
    if has_map and not cfg.sparse:
        x_fp8, x_scale = _quantize(x, ue8m0, eps)
        routed = _dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync, cfg, plan)
        if not return_x:
            x_fp8 = x_scale = None
    else:
        x_fp8 = torch.empty((num_tokens, k), dtype=FP8_DTYPE, device=device) if return_x else None
        x_scale = empty_scale_tma(num_tokens, ceil_div(k, 128), device=device) if return_x else None
        quant = _Quant(ue8m0, eps, x_fp8, x_scale)
        routed = _dispatch_contiguous(x, None, topk_ids, num_experts, expert_map, align_m, sync, cfg, plan, quant)
    return (x_fp8, x_scale, *routed, *((_m_total(plan),) if return_m_total else ()))


def _quantize(x: torch.Tensor, ue8m0: bool, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant(x, 128, ue8m0, eps)`` where the dispatch does not fuse it: on a GPU by the backend
    the op itself takes there (on Hopper the CUDA kernel, kernels/quant.py), else by the Triton kernel."""
    from moe_fp8.kernels.triton.quant import per_token_group_quant

    if x.is_cuda:
        from moe_fp8 import backends

        return backends.select("per_token_group_quant", x.device)[1](x, 128, ue8m0, eps)
    return per_token_group_quant(x, 128, ue8m0, eps)


def combine(y: torch.Tensor, row_map: torch.Tensor, topk_weights: torch.Tensor,
            shared_output: torch.Tensor | None, *, config: CombineConfig | None = None) -> torch.Tensor:
    """Backend entry of ``moe_fp8::combine`` (see ``moe_fp8.ops``): bf16 ``[T, H]``. ``config``: a
    ``CombineConfig`` instead of ``configs.combine_config``'s (tuning)."""
    device = check_launch_device(y, row_map, topk_weights, shared_output)
    h = y.shape[-1]
    rows = y.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_tokens, top_k = row_map.shape
    out = torch.empty((num_tokens, h), dtype=torch.bfloat16, device=device)
    if num_tokens == 0 or h == 0:
        return out
    shared = shared_output
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    cfg = config or combine_config(num_tokens, h)
    if cfg.sparse and (cfg.block_t != 1 or cfg.gather_all):
        raise ValueError(f"a sparse combine needs block_t 1 and no gather_all, got {cfg}")
    col_blocks = ceil_div(h, cfg.block_h)
    if col_blocks > MAX_GRID_YZ:
        raise ValueError(f"hidden size {h} needs {col_blocks} column blocks (> {MAX_GRID_YZ})")
    launch(_combine_kernel, (ceil_div(num_tokens, cfg.block_t), col_blocks),
        rows, row_map, topk_weights, shared if shared is not None else rows, out,
        num_tokens, h, rows.shape[0], rows.stride(0), row_map.stride(0), row_map.stride(1),
        topk_weights.stride(0), topk_weights.stride(1), shared.stride(0) if shared is not None else 0,
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
        GATHER_ALL=cfg.gather_all, SPARSE=cfg.sparse, HAS_SHARED=shared is not None,
        NATIVE_CVT=native_cvt(device), num_warps=cfg.num_warps, enable_fp_fusion=False, **pdl_args(device),
    )
    return out
