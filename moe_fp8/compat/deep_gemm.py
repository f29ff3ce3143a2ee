"""DeepGEMM-named shims over the moe_fp8 API, for drop-in use (``import moe_fp8.compat.deep_gemm as deep_gemm``).

Names and argument orders follow DeepGEMM (``fp8_gemm_nt(a, b, d)`` with ``a = (x_fp8, x_scale)``,
``b = (w, w_scale)``, ``d`` the bf16 output), plus the v1 names (``gemm_fp8_fp8_bf16_nt`` …).

Differences from DeepGEMM, all explicit errors rather than silent work:

- Activation scales must already be in the TMA layout (column-major, M padded to 4). DeepGEMM
  transposes other layouts internally with extra copies; here the call raises ``ValueError`` —
  convert once with ``get_col_major_tma_aligned_tensor`` (or quantize with ``moe_fp8.quant``).
- Only the SM90 recipe ``(1, 128, 128)`` with FP32 scales, bf16 ``d`` and no ``c`` accumulator.
- ``compiled_dims`` and ``disable_ue8m0_cast`` are accepted and ignored (no effect on SM90).
"""

from __future__ import annotations

import torch

from moe_fp8.ops import fp8_gemm, fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked
from moe_fp8.utils import (
    align,
    ceil_div,
    get_align_m,
    get_num_sms,
    is_scale_tma_layout,
    set_num_sms,
    to_scale_tma_layout,
)

__all__ = [
    "ceil_div",
    "fp8_gemm_nt",
    "fp8_m_grouped_gemm_nt_masked",
    "gemm_fp8_fp8_bf16_nt",
    "get_col_major_tma_aligned_tensor",
    "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout",
    "get_num_sms",
    "get_tma_aligned_size",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    "set_num_sms",
]

Pair = tuple[torch.Tensor, torch.Tensor]
_RECIPE = (1, 128, 128)


def _unpack(name: str, pair: object) -> Pair:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name} must be a (fp8 tensor, fp32 scale) pair, got {type(pair).__name__}")
    return pair[0], pair[1]


def _check_extras(recipe: object, c: object = None) -> None:
    if c is not None:
        raise NotImplementedError("c (FP32 accumulator input) is not supported by moe_fp8; pass c=None")
    if recipe is not None and tuple(recipe) != _RECIPE:
        raise ValueError(f"recipe must be None or {_RECIPE} (1x128 activation, 128x128 weight blocks), got {recipe!r}")


def fp8_gemm_nt(a: Pair, b: Pair, d: torch.Tensor, c: torch.Tensor | None = None,
                recipe: tuple[int, int, int] | None = None, compiled_dims: str = "nk",
                disable_ue8m0_cast: bool = False) -> None:
    """``d[M, N] (bf16) = a @ bᵀ``: ``a = (x_fp8 [M, K], x_scale [M, ceil(K/128)] TMA layout)``,
    ``b = (w [N, K], w_scale [ceil(N/128), ceil(K/128)])``. See ``moe_fp8.fp8_gemm``."""
    _check_extras(recipe, c)
    x_fp8, x_scale = _unpack("a", a)
    w, w_scale = _unpack("b", b)
    fp8_gemm(x_fp8, x_scale, w, w_scale, out=d)


def m_grouped_fp8_gemm_nt_contiguous(a: Pair, b: Pair, d: torch.Tensor, m_indices: torch.Tensor,
                                     recipe: tuple[int, int, int] | None = None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False) -> None:
    """Contiguous grouped GEMM: ``a`` rows ``[M_total, K]`` (M_total % 128 == 0), ``b = (w [G, N, K],
    w_scale [G, N/128, K/128])``, ``m_indices int32 [M_total]`` (-1 = padding), ``d bf16 [M_total, N]``.
    See ``moe_fp8.fp8_grouped_gemm_contiguous``."""
    _check_extras(recipe)
    x_fp8, x_scale = _unpack("a", a)
    w, w_scale = _unpack("b", b)
    fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out=d)


def m_grouped_fp8_gemm_nt_masked(a: Pair, b: Pair, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                 recipe: tuple[int, int, int] | None = None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False) -> None:
    """Masked grouped GEMM: ``a = (x_fp8 [G, max_m, K], x_scale [G, max_m, K/128] TMA layout)``,
    ``masked_m int32 [G]`` on device, ``expected_m`` host hint, ``d bf16 [G, max_m, N]``.
    See ``moe_fp8.fp8_grouped_gemm_masked``."""
    _check_extras(recipe)
    x_fp8, x_scale = _unpack("a", a)
    w, w_scale = _unpack("b", b)
    fp8_grouped_gemm_masked(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out=d)


# Alternative spelling used in some DeepGEMM-era code.
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


# DeepGEMM v1 names.
def gemm_fp8_fp8_bf16_nt(lhs: Pair, rhs: Pair, out: torch.Tensor) -> None:
    """DeepGEMM v1 name of ``fp8_gemm_nt``."""
    fp8_gemm_nt(lhs, rhs, out)


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs: Pair, rhs: Pair, out: torch.Tensor,
                                              m_indices: torch.Tensor) -> None:
    """DeepGEMM v1 name of ``m_grouped_fp8_gemm_nt_contiguous``."""
    m_grouped_fp8_gemm_nt_contiguous(lhs, rhs, out, m_indices)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs: Pair, rhs: Pair, out: torch.Tensor, masked_m: torch.Tensor,
                                          expected_m: int) -> None:
    """DeepGEMM v1 name of ``m_grouped_fp8_gemm_nt_masked``."""
    m_grouped_fp8_gemm_nt_masked(lhs, rhs, out, masked_m, expected_m)


def get_m_alignment_for_contiguous_layout() -> int:
    """Row alignment of each group's segment in the contiguous layout (128)."""
    return get_align_m()


get_mk_alignment_for_contiguous_layout = get_m_alignment_for_contiguous_layout


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """``x`` rounded up so that ``x * element_size`` is a multiple of 16 bytes."""
    if element_size <= 0 or 16 % element_size != 0:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    return align(x, 16 // element_size)


def get_col_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` (FP32 ``[M, KG]`` or ``[G, M, KG]``) in the TMA layout: returned as is when it already is,
    else copied (an explicit, visible copy — call it once, outside hot loops)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be torch.float32, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D [M, KG] or 3-D [G, M, KG], got shape {tuple(x.shape)}")
    return x if is_scale_tma_layout(x) else to_scale_tma_layout(x)

