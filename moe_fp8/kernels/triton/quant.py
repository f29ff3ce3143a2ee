"""Per-token-group FP8 quantization, plain and fused with SiLU·mul, writing scales in the TMA layout.

One kernel, ``_act_quant_kernel``, serves both ops (``SILU`` constexpr) and all three layouts:
``[M, K]``, ``[G, M, K]`` and the masked ``[G, max_m, K]`` (``HAS_MASK``: only rows below
``masked_m[g]`` are read or written; the rest of the output stays untouched). A program owns one
column block of ``BLOCK_G`` scale groups and walks row blocks of ``BLOCK_R`` rows: ``pid_r, pid_r +
num_programs(0), …``. Unmasked: of one leading group (one row block per program). Masked (``FLAT``,
up to ``configs.QUANT_FLAT_MAX_GROUPS`` groups): of the flat list of every group's valid rows —
each program takes the prefix of ``masked_m`` on device and finds a row's group from it, so work is
balanced whatever the group sizes (a hot expert is no serial tail) and no program idles on an empty
group; no host sync, CUDA-graph safe (the grid depends on shapes only). More groups: one row loop
per (group, column block) up to that group's ``masked_m``.

Scales go straight to their TMA-layout address ``g·KG·M_pad + kg·M_pad + m`` (column-major, rows
padded to 4; the padding entries are not written, as in the reference).

Numerics (see ``moe_fp8.reference`` and docs/kernels/datapath.md):

- ``per_token_group_quant`` is bit-exact: FP32 amax, correctly rounded ``max(amax, eps) / 448``
  (``ue8m0``: next power of two), correctly rounded ``x / scale``, clamp, round-to-nearest-even FP8.
  NaN groups: NaN scale, all codes NaN; ±Inf groups: +Inf scale, all codes NaN.
- ``silu_mul_per_token_group_quant`` evaluates ``y = silu(g)·u`` in plain FP32 (``g / (1 + exp(-g))``,
  then ``· u``) and quantizes ``y`` exactly as above. The reference evaluates ``y`` in float64 and
  rounds once, so our ``y`` differs from it by a few FP32 ulps (``exp`` and ``/`` are approximate on
  NVIDIA GPUs): scales agree to ~1e-6 relative and an FP8 code differs by one step only when ``y``
  lies within those ulps of a rounding boundary (~1e-5 of the codes). Non-finite inputs give the
  reference's NaN / Inf groups. ``precise=True`` evaluates ``y`` in float64 instead (bit-exact with
  the reference, compute-bound: for tests and debugging only).
  NOTE: an earlier version certified every code against float64 with data-dependent while loops;
  that made the kernel latency-bound (29% of copy BW at 16384×4096, ~90 µs for a decode buffer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_fp8.kernels.triton.common import (
    check_launch_device,
    launch,
    native_fp8,
    pdl_args,
    pdl_start,
    quantize_groups,
)
from moe_fp8.kernels.triton.configs import (
    MAX_GRID_YZ,
    QUANT_FLAT_MAX_GROUPS,
    QuantConfig,
    quant_config,
    quant_wide,
)
from moe_fp8.utils import (
    FP8_DTYPE,
    ceil_div,
    empty_scale_tma,
    get_num_sms,
    get_tma_aligned_m,
    is_scale_tma_layout,
)

__all__ = ["per_token_group_quant", "silu_mul_per_token_group_quant"]


@triton.jit
def _silu_mul(g, u, PRECISE: tl.constexpr):
    """``silu(g) · u`` of float32 tiles: FP32 (default), or float64 rounded once (the reference's value)."""
    if PRECISE:
        g64 = g.to(tl.float64)
        y = (g64 / (1.0 + tl.exp(-g64)) * u.to(tl.float64)).to(tl.float32)
    else:
        # g / (1 + exp(-g)): exp(-g) = +Inf for g < -88.7 gives -0.0, never NaN (the reference's
        # tiny value quantizes to 0 as well); g = -Inf gives NaN, as in the reference.
        y = g / (1.0 + tl.exp(-g)) * u
    return y


@triton.jit
def _act_quant_kernel(
    in_ptr, q_ptr, s_ptr, masked_m_ptr,
    M, N, in_row_stride, KG, m_pad, s_group_stride, row_programs, num_groups, eps,
    GROUP_SIZE: tl.constexpr, GS_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
    SILU: tl.constexpr, HAS_MASK: tl.constexpr, FLAT: tl.constexpr, G_P2: tl.constexpr,
    PRECISE: tl.constexpr, UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    # N: output columns (K for quant, I for SiLU); the input row is N (quant) or 2N (SiLU) wide.
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    seg = tl.arange(0, BLOCK_R * BLOCK_G)  # one segment = one (row, scale group)
    c = tl.arange(0, GS_P2)
    kg = pid_c * BLOCK_G + seg % BLOCK_G
    col = kg[:, None] * GROUP_SIZE + c[None, :]
    col_ok = (kg[:, None] < KG) & (c[None, :] < GROUP_SIZE) & (col < N)
    if FLAT:
        # Masked, flat: the valid rows of all groups as one list (group g's rows start at the
        # exclusive prefix of clamp(masked_m, 0, M)); programs stride over its row blocks.
        gi = tl.arange(0, G_P2)
        mm = tl.load(masked_m_ptr + gi, mask=gi < num_groups, other=0)
        mm = tl.minimum(tl.maximum(mm, 0), M)  # a bad masked_m must never move an access out of a group
        ends = tl.cumsum(mm, axis=0)  # inclusive prefix
        total = tl.sum(mm)
        rr = tl.arange(0, BLOCK_R)
        for rb in range(pid_r, tl.cdiv(total, BLOCK_R), row_programs):
            # Group of each ROW of the block ([BLOCK_R, G_P2] compares, not one per segment: at
            # BLOCK_R = 1 a single 256-wide reduction): the number of inclusive ends <= f, and the
            # row's start = the largest such end (ends are nondecreasing).
            f_r = rb * BLOCK_R + rr
            below = ends[None, :] <= f_r[:, None]
            grp_r = tl.sum(below.to(tl.int32), axis=1)
            loc_r = f_r - tl.max(tl.where(below, ends[None, :], 0), axis=1)  # row inside its group
            if BLOCK_R == 1:  # shape [1]: broadcasts over the segments
                grp_s = grp_r
                loc_s = loc_r
                r_ok = f_r < total
            else:  # segment s belongs to row s // BLOCK_G
                own = (seg // BLOCK_G)[:, None] == rr[None, :]
                grp_s = tl.sum(tl.where(own, grp_r[None, :], 0), axis=1)
                loc_s = tl.sum(tl.where(own, loc_r[None, :], 0), axis=1)
                r_ok = rb * BLOCK_R + seg // BLOCK_G < total
            grp_s = grp_s.to(tl.int64) + seg * 0  # [BLOCK_R * BLOCK_G]
            loc_s = loc_s.to(tl.int64) + seg * 0
            r_ok = r_ok & (seg >= 0)
            _quant_tile(in_ptr, q_ptr, s_ptr, grp_s * M + loc_s, grp_s * s_group_stride + loc_s, r_ok, kg,
                        col, col_ok, N, in_row_stride, KG, m_pad, eps, SILU, PRECISE, UE8M0, NATIVE_FP8)
    else:
        grp = tl.program_id(2).to(tl.int64)
        n_rows = M
        if HAS_MASK:  # clamp: a bad masked_m must never move an access out of the group
            n_rows = tl.minimum(tl.maximum(tl.load(masked_m_ptr + grp), 0), M)
        for rb in range(pid_r, tl.cdiv(n_rows, BLOCK_R), row_programs):  # row_programs == num_programs(0)
            r = rb * BLOCK_R + seg // BLOCK_G
            _quant_tile(in_ptr, q_ptr, s_ptr, grp * M + r, grp * s_group_stride + r, r < n_rows, kg, col, col_ok,
                        N, in_row_stride, KG, m_pad, eps, SILU, PRECISE, UE8M0, NATIVE_FP8)


@triton.jit
def _quant_tile(in_ptr, q_ptr, s_ptr, row, s_row, r_ok, kg, col, col_ok, N, in_row_stride, KG, m_pad, eps,
                SILU: tl.constexpr, PRECISE: tl.constexpr, UE8M0: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """One tile of (row, scale group) segments: ``row`` (input/output row, int64), ``s_row`` (the
    segment's offset in the scale tensor before ``kg · m_pad``), ``r_ok`` (row valid)."""
    seg_ok = r_ok & (kg < KG)
    mask = col_ok & r_ok[:, None]
    in_offs = row[:, None] * in_row_stride + col
    x = tl.load(in_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        u = tl.load(in_ptr + in_offs + N, mask=mask, other=0.0).to(tl.float32)
        x = _silu_mul(x, u, PRECISE)
    code, scale = quantize_groups(x, eps, UE8M0, NATIVE_FP8)  # masked-off lanes hold 0 (or silu(0)·0 = 0)
    tl.store(q_ptr + row[:, None] * N + col, code, mask=mask)
    tl.store(s_ptr + s_row + kg.to(tl.int64) * m_pad, scale, mask=seg_ok)


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
            out_scale: torch.Tensor | None, precise: bool,
            config: QuantConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    device = check_launch_device(inp, masked_m, out, out_scale)
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
    if inp.numel() == 0:
        return out, out_scale
    masked = masked_m is not None
    cfg = config or quant_config(rows, kg, group_size, groups, masked, get_num_sms() if masked else None,
                                 silu=silu, wide=quant_wide(device.type, device.index))
    col_blocks = ceil_div(kg, cfg.block_g)
    if groups > MAX_GRID_YZ or col_blocks > MAX_GRID_YZ:
        raise ValueError(f"too many groups ({groups}) or column blocks ({col_blocks}) for one launch")
    # Without a mask, the row loop of a program must cover every row block (one each by default).
    row_programs = cfg.row_programs if masked else ceil_div(rows, cfg.block_r)
    flat = masked and groups <= QUANT_FLAT_MAX_GROUPS
    m_pad = get_tma_aligned_m(rows)
    launch(_act_quant_kernel, (row_programs, col_blocks, 1 if flat else groups),
        inp, out.view(torch.uint8), out_scale, masked_m if masked else out_scale,
        rows, n_out, inp.shape[-1], kg, m_pad, kg * m_pad, row_programs, groups, float(eps),
        GROUP_SIZE=group_size, GS_P2=cfg.gs_p2, BLOCK_R=cfg.block_r, BLOCK_G=cfg.block_g,
        SILU=silu, HAS_MASK=masked, FLAT=flat, G_P2=triton.next_power_of_2(groups) if flat else 1,
        PRECISE=bool(precise), UE8M0=bool(ue8m0), NATIVE_FP8=native_fp8(device),
        num_warps=cfg.num_warps, **pdl_args(device),
    )
    return out, out_scale


def per_token_group_quant(x: torch.Tensor, group_size: int, ue8m0: bool, eps: float, *,
                          out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                          config: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::per_token_group_quant`` (see ``moe_fp8.ops``).

    ``x``: contiguous ``[M, K]`` / ``[G, M, K]`` bf16/fp16/fp32. Returns ``(x_fp8, x_scale)`` with
    ``x_scale`` in the TMA layout; ``out`` / ``out_scale`` (optional, same shapes and layout) are
    written in place instead of allocating. ``config``: a ``QuantConfig`` to use instead of
    ``configs.quant_config``'s (tuning).
    """
    return _launch(x, x.shape[-1], group_size, ue8m0, eps, None, False, out, out_scale, False, config)


def silu_mul_per_token_group_quant(h: torch.Tensor, group_size: int, ue8m0: bool,
                                   masked_m: torch.Tensor | None, eps: float, *,
                                   out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                                   precise: bool = False, config: QuantConfig | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::silu_mul_per_token_group_quant`` (see ``moe_fp8.ops``).

    ``h``: contiguous ``[M, 2I]`` / ``[G, max_m, 2I]``, ``[gate | up]``. With ``masked_m`` (int32
    ``[G]``), rows ``r >= masked_m[g]`` of the outputs are not written (pass ``out`` / ``out_scale``
    to keep a persistent buffer, e.g. under a CUDA graph).

    ``precise=True`` evaluates ``silu(g)·u`` in float64 (bit-exact with the reference; slow — tests
    and debugging). ``config``: a ``QuantConfig`` instead of ``configs.quant_config``'s (tuning).
    """
    return _launch(h, h.shape[-1] // 2, group_size, ue8m0, eps, masked_m, True, out, out_scale, precise,
                   config)
