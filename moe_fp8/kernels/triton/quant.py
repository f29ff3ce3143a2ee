"""Per-token-group FP8 quantization, plain and fused with SiLU·mul, writing scales in the TMA layout.

One kernel, ``_act_quant_kernel``, serves both ops (``SILU`` constexpr) and all three layouts:
``[M, K]``, ``[G, M, K]`` and the masked ``[G, max_m, K]`` (``HAS_MASK``: only rows below
``masked_m[g]`` are read or written; the rest of the output stays untouched). A program owns one
column block of ``BLOCK_G`` scale groups of one leading group and walks row blocks of ``BLOCK_R``
rows: ``pid_r, pid_r + num_programs(0), …`` up to the group's row count, which for the masked
layout is read on device (no host sync, CUDA-graph safe: the grid depends on shapes only).

Scales go straight to their TMA-layout address ``g·KG·M_pad + kg·M_pad + m`` (column-major, rows
padded to 4; the padding entries are not written, as in the reference).

Bit-exactness (see ``moe_fp8.reference``):

- ``per_token_group_quant`` computes exactly what the reference computes: FP32 amax, correctly
  rounded ``max(amax, eps) / 448`` (``ue8m0``: next power of two), correctly rounded ``x / scale``,
  clamp, round-to-nearest-even FP8. NaN groups: NaN scale, all codes NaN; ±Inf groups: +Inf scale,
  all codes NaN.
- The reference's SiLU·mul is evaluated in float64 and rounded once to float32. Doing that for every
  element would make the fused kernel compute-bound (FP64 runs at 1/2 to 1/64 of FP32 rate), so the
  kernel evaluates ``y = g·u / (1 + exp(-g))`` in FP32 with a proven relative error below
  ``2**-20.2`` (against the reference's FP32 value) and then *certifies* every output:

  * the group's amax: every element whose estimate is within ``2**-17`` of the estimated max is
    recomputed in float64 (usually one per group) and the exact max taken;
  * every FP8 code: the estimate ``y/scale`` is widened by ``±DQ`` (``2**-18``, 2.6× the bound); if
    both ends encode to the same FP8 value the code is exact, else the element is recomputed in
    float64 (about 1 element in 10**4).

  A tile holding anything outside the bound's domain (NaN, Inf, ``|gate| > 64``, results below
  ``2**-120``) is recomputed wholly in float64. ``FAST=False`` forces the float64 path everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp8.kernels.triton.common import (
    check_launch_device,
    fp8_e4m3_code,
    native_fp8,
    quantize_exact,
    scale_from_amax,
)
from moe_fp8.kernels.triton.configs import MAX_GRID_YZ, quant_config
from moe_fp8.utils import FP8_DTYPE, ceil_div, empty_scale_tma, get_tma_aligned_m, is_scale_tma_layout

__all__ = ["per_token_group_quant", "silu_mul_per_token_group_quant"]

# Relative half-width of the certification bracket of the fast SiLU path (see module doc).
DEFAULT_DQ = 2.0**-18


@triton.jit
def _silu_mul_f64(g, u):
    """The reference's ``(silu(g) · u)`` in float64, rounded once to float32 (torch's formula)."""
    g64 = g.to(tl.float64)
    y = g64 / (1.0 + tl.exp(-g64)) * u.to(tl.float64)
    return y.to(tl.float32)


@triton.jit
def _silu_mul_f64_cols(in_ptr, row, kg, seg_ok, in_row_stride, N, ch,
                       GROUP_SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """``_silu_mul_f64`` of columns ``[ch, ch + CHUNK)`` of every segment; also the column mask."""
    cc = ch + tl.arange(0, CHUNK)
    col = kg[:, None] * GROUP_SIZE + cc[None, :]
    m = seg_ok[:, None] & (cc[None, :] < GROUP_SIZE) & (col < N)
    offs = row[:, None] * in_row_stride + col
    g = tl.load(in_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(in_ptr + offs + N, mask=m, other=0.0).to(tl.float32)
    return _silu_mul_f64(g, u), m


@triton.jit
def _silu_mul_f64_at(gate_ptrs, N, mask):
    """``_silu_mul_f64`` of one element per segment, gate at ``gate_ptrs``, up ``N`` further."""
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    return _silu_mul_f64(g, u)


@triton.jit
def _act_quant_kernel(
    in_ptr, q_ptr, s_ptr, masked_m_ptr, stats_ptr,
    M, N, in_row_stride, KG, m_pad, s_group_stride, row_programs, eps, dq,
    GROUP_SIZE: tl.constexpr, GS_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    SILU: tl.constexpr, HAS_MASK: tl.constexpr, FAST: tl.constexpr, UE8M0: tl.constexpr,
    NATIVE_FP8: tl.constexpr, COUNT_STATS: tl.constexpr, F64_CHUNK: tl.constexpr,
):
    # N: output columns (K for quant, I for SiLU); the input row is N (quant) or 2N (SiLU) wide.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    grp = tl.program_id(2).to(tl.int64)
    n_rows = M
    if HAS_MASK:  # clamp: a bad masked_m must never move an access out of the group
        n_rows = tl.minimum(tl.maximum(tl.load(masked_m_ptr + grp), 0), M)
    num_row_blocks = tl.cdiv(n_rows, BLOCK_R)

    seg = tl.arange(0, BLOCK_R * BLOCK_G)  # one segment = one (row, scale group)
    c = tl.arange(0, GS_P2)
    kg = pid_c * BLOCK_G + seg % BLOCK_G
    col = kg[:, None] * GROUP_SIZE + c[None, :]
    col_ok = (kg[:, None] < KG) & (c[None, :] < GROUP_SIZE) & (col < N)

    for rb in range(pid_r, num_row_blocks, row_programs):  # row_programs == tl.num_programs(0)
        r = rb * BLOCK_R + seg // BLOCK_G
        seg_ok = (r < n_rows) & (kg < KG)
        mask = col_ok & (r < n_rows)[:, None]
        row = grp * M + r
        in_offs = row[:, None] * in_row_stride + col
        out_offs = row[:, None] * N + col
        x = tl.load(in_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)

        if SILU:
            u = tl.load(in_ptr + in_offs + N, mask=mask, other=0.0).to(tl.float32)
            if FAST:
                # ---- FP32 estimate: exp(-g) = 2**n · 2**f with an accurately reduced f ----
                ag = tl.abs(x)
                gc = tl.where(ag <= 64.0, x, 0.0)  # the bound's domain; others take the f64 path
                n = tl.floor(gc * -1.4426950408889634 + 0.5)
                f = tl.fma(gc, -1.4426950216293335, -n) + gc * -1.925963033500011e-08
                p2n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
                a = gc * u
                y = a / (1.0 + tl.exp2(f) * p2n)
                ay = tl.abs(y)
                exact_zero = (x == 0.0) | (u == 0.0)
                fast_ok = (ag <= 64.0) & (exact_zero | ((ay >= 7.52316384526264e-37) & (tl.abs(a) < float("inf"))))
                # NOTE: gate and up are not used below this line on the common path; the rare
                # paths reload what they need (L1/L2 hits), which keeps the register footprint of
                # the tile near that of the plain float64 path.
                seg_in = in_ptr + row * in_row_stride + kg * GROUP_SIZE  # first column of each segment
                stored = tl.full([], 0, tl.int32)
                if tl.min(fast_ok.to(tl.int32)) == 0:
                    # ---- outside the bound's domain somewhere in the tile: all of it in float64,
                    # F64_CHUNK columns at a time (a whole tile of float64 temporaries would set the
                    # register budget of the kernel), codes stored here ----
                    amax = tl.zeros([BLOCK_R * BLOCK_G], dtype=tl.float32)
                    has_nan = amax != 0.0
                    for ch in tl.static_range(0, GS_P2, F64_CHUNK):
                        y_ch, _ = _silu_mul_f64_cols(in_ptr, row, kg, seg_ok, in_row_stride, N, ch,
                                                     GROUP_SIZE, F64_CHUNK)
                        amax = tl.maximum(amax, tl.max(tl.abs(y_ch), axis=1))
                        has_nan = has_nan | (tl.max((y_ch != y_ch).to(tl.int32), axis=1) > 0)
                    scale = scale_from_amax(amax, has_nan, eps, UE8M0)
                    for ch in tl.static_range(0, GS_P2, F64_CHUNK):
                        y_ch, m_ch = _silu_mul_f64_cols(in_ptr, row, kg, seg_ok, in_row_stride, N, ch,
                                                        GROUP_SIZE, F64_CHUNK)
                        code_ch = quantize_exact(y_ch, scale[:, None], NATIVE_FP8)
                        col_ch = kg[:, None] * GROUP_SIZE + ch + tl.arange(0, F64_CHUNK)[None, :]
                        tl.store(q_ptr + row[:, None] * N + col_ch, code_ch, mask=m_ch)
                    code = tl.zeros_like(y).to(tl.uint8)
                    stored = tl.full([], 1, tl.int32)
                    if COUNT_STATS:
                        tl.atomic_add(stats_ptr + 1, 1)
                else:
                    # ---- exact amax: recompute every candidate for the max in float64 ----
                    amax_est = tl.max(ay, axis=1)
                    cand = (ay >= amax_est[:, None] * (1.0 - 2.0**-17)) & (ay > 0.0)
                    amax = tl.zeros_like(amax_est)
                    while tl.max(cand.to(tl.int32)) > 0:
                        first = tl.min(tl.where(cand, c[None, :], GS_P2), axis=1)
                        y_sel = _silu_mul_f64_at(seg_in + first, N, seg_ok & (first < GS_P2))
                        amax = tl.maximum(amax, tl.abs(y_sel))
                        cand = cand & (c[None, :] != first[:, None])
                    scale = scale_from_amax(amax, amax != amax, eps, UE8M0)
                    # ---- certified codes: both ends of the error bracket must agree ----
                    q = y * (1.0 / scale)[:, None]
                    lo = tl.minimum(tl.maximum(q * (1.0 - dq), -448.0), 448.0)
                    hi = tl.minimum(tl.maximum(q * (1.0 + dq), -448.0), 448.0)
                    code = fp8_e4m3_code(lo, NATIVE_FP8)
                    fix = code != fp8_e4m3_code(hi, NATIVE_FP8)
                    while tl.max(fix.to(tl.int32)) > 0:
                        first = tl.min(tl.where(fix, c[None, :], GS_P2), axis=1)
                        y_sel = _silu_mul_f64_at(seg_in + first, N, seg_ok & (first < GS_P2))
                        code_sel = quantize_exact(y_sel, scale, NATIVE_FP8)
                        sel = c[None, :] == first[:, None]
                        code = tl.where(sel, code_sel[:, None], code)
                        fix = fix & (~sel)
                        if COUNT_STATS:
                            tl.atomic_add(stats_ptr + 2, tl.sum(sel.to(tl.int32)))
            else:
                y = _silu_mul_f64(x, u)
                amax = tl.max(tl.abs(y), axis=1)
                has_nan = tl.max((y != y).to(tl.int32), axis=1) > 0
                scale = scale_from_amax(amax, has_nan, eps, UE8M0)
                code = quantize_exact(y, scale[:, None], NATIVE_FP8)
        else:
            amax = tl.max(tl.abs(x), axis=1)
            has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
            scale = scale_from_amax(amax, has_nan, eps, UE8M0)
            code = quantize_exact(x, scale[:, None], NATIVE_FP8)

        if COUNT_STATS:
            tl.atomic_add(stats_ptr, 1)
        if SILU and FAST:
            mask = mask & (tl.zeros_like(mask.to(tl.int32)) + stored == 0)  # f64 tile: codes stored
        tl.store(q_ptr + out_offs, code, mask=mask)
        tl.store(s_ptr + grp * s_group_stride + kg.to(tl.int64) * m_pad + r, scale, mask=seg_ok)


# ============================================================================================
# Launch wrappers
# ============================================================================================

def _outputs(shape: tuple[int, ...], kg: int, device: torch.device, out: torch.Tensor | None,
             out_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate (or check) FP8 ``shape`` and its TMA-layout scales ``[..., M, kg]``."""
    scale_shape = (*shape[:-1], kg)
    if out is None:
        out = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    elif out.shape != shape or out.dtype != FP8_DTYPE or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous float8_e4m3fn {shape} on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if out_scale is None:
        groups = shape[0] if len(shape) == 3 else None
        out_scale = empty_scale_tma(shape[-2], kg, groups=groups, device=device)
    elif (tuple(out_scale.shape) != scale_shape or out_scale.dtype != torch.float32
          or not is_scale_tma_layout(out_scale) or out_scale.device != device):
        raise ValueError(f"out_scale must be float32 {scale_shape} in the TMA layout (empty_scale_tma) "
                         f"on {device}, got {out_scale.dtype} {tuple(out_scale.shape)} strides "
                         f"{out_scale.stride()} on {out_scale.device}")
    return out, out_scale


def _launch(inp: torch.Tensor, n_out: int, group_size: int, ue8m0: bool, eps: float,
            masked_m: torch.Tensor | None, silu: bool, out: torch.Tensor | None,
            out_scale: torch.Tensor | None, fast: bool, dq: float,
            stats: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_launch_device(inp, masked_m, out, out_scale, stats)
    if not inp.is_contiguous():
        raise ValueError("input must be contiguous")
    shape = (*inp.shape[:-1], n_out)
    kg = ceil_div(n_out, group_size)
    out, out_scale = _outputs(shape, kg, device, out, out_scale)
    if inp.dim() == 2:
        groups, rows = 1, inp.shape[0]
    else:
        groups, rows = inp.shape[0], inp.shape[1]
    if masked_m is not None and (masked_m.shape != (groups,) or masked_m.dtype != torch.int32):
        raise ValueError(f"masked_m must be int32 [{groups}], got {masked_m.dtype} {tuple(masked_m.shape)}")
    if stats is not None and (stats.dtype != torch.int32 or stats.numel() < 3):
        raise ValueError("stats must be an int32 tensor of at least 3 entries")
    if inp.numel() == 0:
        return out, out_scale
    cfg = quant_config(rows, kg, group_size, groups, masked=masked_m is not None)
    col_blocks = ceil_div(kg, cfg.block_g)
    if groups > MAX_GRID_YZ or col_blocks > MAX_GRID_YZ:
        raise ValueError(f"too many groups ({groups}) or column blocks ({col_blocks}) for one launch")
    m_pad = get_tma_aligned_m(rows)
    _act_quant_kernel[(cfg.row_programs, col_blocks, groups)](
        inp, out.view(torch.uint8), out_scale, masked_m if masked_m is not None else out_scale,
        stats if stats is not None else out_scale,
        rows, n_out, inp.shape[-1], kg, m_pad, kg * m_pad, cfg.row_programs, float(eps), float(dq),
        GROUP_SIZE=group_size, GS_P2=cfg.gs_p2, BLOCK_R=cfg.block_r, BLOCK_G=cfg.block_g,
        SILU=silu, HAS_MASK=masked_m is not None, FAST=fast, UE8M0=bool(ue8m0),
        NATIVE_FP8=native_fp8(device), COUNT_STATS=stats is not None,
        F64_CHUNK=min(cfg.gs_p2, 32), num_warps=cfg.num_warps,
    )
    return out, out_scale


def per_token_group_quant(x: torch.Tensor, group_size: int, ue8m0: bool, eps: float, *,
                          out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::per_token_group_quant`` (see ``moe_fp8.ops``).

    ``x``: contiguous ``[M, K]`` / ``[G, M, K]`` bf16/fp16/fp32. Returns ``(x_fp8, x_scale)`` with
    ``x_scale`` in the TMA layout; ``out`` / ``out_scale`` (optional, same shapes and layout) are
    written in place instead of allocating.
    """
    return _launch(x, x.shape[-1], group_size, ue8m0, eps, None, False, out, out_scale, True,
                   DEFAULT_DQ, None)


def silu_mul_per_token_group_quant(h: torch.Tensor, group_size: int, ue8m0: bool,
                                   masked_m: torch.Tensor | None, eps: float, *,
                                   out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                                   fast: bool = True, dq: float = DEFAULT_DQ,
                                   stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::silu_mul_per_token_group_quant`` (see ``moe_fp8.ops``).

    ``h``: contiguous ``[M, 2I]`` / ``[G, max_m, 2I]``, ``[gate | up]``. With ``masked_m`` (int32
    ``[G]``), rows ``r >= masked_m[g]`` of the outputs are not written (pass ``out`` / ``out_scale``
    to keep a persistent buffer, e.g. under a CUDA graph).

    Testing knobs: ``fast=False`` takes the float64 path everywhere; a larger ``dq`` makes the
    certification recompute more elements; ``stats`` (int32 ``[3]``, zeroed by the caller) counts
    tiles, tiles recomputed wholly in float64, and single elements recomputed.
    """
    return _launch(h, h.shape[-1] // 2, group_size, ue8m0, eps, masked_m, True, out, out_scale, fast,
                   dq, stats)
