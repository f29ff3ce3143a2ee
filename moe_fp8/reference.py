"""Pure-PyTorch definitions of every moe_fp8 op: the oracle for kernel tests and the `reference` backend.

Each function states the op's meaning in the plainest PyTorch we could write; speed is not a goal.
All arithmetic is float32 after dequantization (real = fp8 · scale), tensors may live on CPU or CUDA.
Transcendentals (SiLU, softmax, sigmoid) are evaluated in float64 and rounded once to float32, and
every division is tensor / tensor (correctly rounded), so quantization, routing and dispatch give
the same bits on CPU and CUDA; matmuls are true FP32 on CUDA (never TF32) and float64 sums rounded once to
float32 on the CPU (the same bits whatever the shape or batch).

Conventions (DESIGN.md §2):
- FP8 is ``torch.float8_e4m3fn`` (max 448); scales are FP32 multipliers.
- Activation scales ``[M, ceil(K/128)]`` (``[G, M, KG]``) are returned in the TMA layout of
  ``moe_fp8.utils.empty_scale_tma``; functions that *read* scales accept any layout.
- Weight scales ``[ceil(N/128), ceil(K/128)]`` (``[G, ...]``) are contiguous.

Non-finite inputs are never turned into finite garbage: a quantization group whose amax is NaN or
±Inf gets a NaN (or Inf) scale and all-NaN FP8 values, so NaN reaches every consumer.

Padding/unused rows: the kernels leave them *unspecified* (contiguous padding rows) or
*untouched* (masked rows past ``masked_m``); this reference writes well-defined values instead
(0 outputs, FP8 zeros with scale 1.0) so tests can compare bit-for-bit where it matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_fp8.utils import FP8_DTYPE, FP8_MAX, GROUP_K, align, ceil_div, empty_scale_tma

__all__ = [
    "combine",
    "dequant_per_block",
    "dequant_per_token_group",
    "dispatch_contiguous",
    "dispatch_masked",
    "fp8_gemm",
    "fp8_grouped_gemm_contiguous",
    "fp8_grouped_gemm_masked",
    "fp8_grouped_gemm_silu_mul_quant",
    "per_block_quant",
    "per_token_group_quant",
    "select_experts",
    "silu_mul",
    "silu_mul_per_token_group_quant",
]

DEFAULT_EPS = 1e-10


# ----------------------------------------------------------------------------------------------
# Scales
# ----------------------------------------------------------------------------------------------
def _round_up_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ≥ ``scale`` (exact, via frexp); NaN/Inf pass through unchanged."""
    # frexp: scale = mantissa · 2**exponent with mantissa in [0.5, 1). A mantissa of exactly 0.5
    # means scale already is 2**(exponent-1); anything above rounds up to 2**exponent.
    # NOTE: not 2**ceil(log2(s)): float log2 can round a value just above a power of two down to
    # an integer, which would make the scale *smaller* than amax/448 and saturate the FP8 value.
    mantissa, exponent = torch.frexp(scale)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    pow2 = torch.ldexp(torch.ones_like(scale), exponent)
    return torch.where(torch.isfinite(scale), pow2, scale)


def _scale_from_amax(amax: torch.Tensor, eps: float, ue8m0: bool) -> torch.Tensor:
    """``max(amax, eps) / 448`` in float32 (rounded up to a power of two with ``ue8m0``).

    NaN amax stays NaN (``clamp`` would too, but we do not rely on it); +Inf stays +Inf.
    The division is IEEE correctly rounded; a kernel computing ``amax * (1/448)`` can be 1 ulp off.
    """
    amax = amax.float()
    clamped = torch.where(torch.isnan(amax), amax, amax.clamp_min(eps))
    # NOTE: divide by a *tensor*: PyTorch's CUDA division by a Python scalar multiplies by the
    # rounded reciprocal, which is 1 ulp off for some inputs, so CPU and CUDA would disagree (and an
    # FP8 value sitting on a rounding tie would flip). Tensor / tensor is correctly rounded on both.
    scale = clamped / torch.full_like(clamped, FP8_MAX)
    return _round_up_pow2(scale) if ue8m0 else scale


def _to_fp8(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, ±448)`` cast to FP8; elements whose scale is not finite become NaN."""
    q = (x.float() / scale_full).clamp(-FP8_MAX, FP8_MAX)
    # An Inf scale would give x/Inf = 0 (finite garbage) and a NaN scale already gives NaN: make
    # both explicitly NaN so a non-finite input group is NaN end to end.
    q = torch.where(torch.isfinite(scale_full), q, torch.full_like(q, float("nan")))
    return q.to(FP8_DTYPE)


def _expand_last(scale: torch.Tensor, size: int, group: int) -> torch.Tensor:
    """Repeat each entry of the last dim ``group`` times and cut to ``size`` (ragged last group)."""
    return scale.repeat_interleave(group, dim=-1)[..., :size]


def _check_group_size(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------------------------
# 1. Activation quantization, per token per K group
# ----------------------------------------------------------------------------------------------
def per_token_group_quant(
    x: torch.Tensor, group_size: int = GROUP_K, ue8m0: bool = False, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to FP8 with one FP32 scale per token per ``group_size`` columns.

    Args:
        x: ``[M, K]`` or ``[G, M, K]``, bf16/fp16/fp32. ``K`` may be any positive size; the last
            group may be partial. ``M`` (and ``G``) may be 0.
        group_size: columns per scale (128 in DeepSeek-V3).
        ue8m0: round every scale up to a power of two (UE8M0-representable).
        eps: lower bound on a group's amax (an all-zero group gets scale ``eps/448``).

    Returns:
        ``x_fp8``: same shape as ``x``, ``float8_e4m3fn``, contiguous row-major.
        ``x_scale``: FP32 ``[M, KG]`` / ``[G, M, KG]`` with ``KG = ceil(K/group_size)`` in the TMA
        layout of ``empty_scale_tma`` (column-major, M padded to 4).

    ``scale = max(amax|group|, eps) / 448``; ``x_fp8 = fp8(clamp(x / scale, ±448))``.
    NaN/Inf: a group containing NaN has NaN amax → NaN scale → all its FP8 values NaN; a group
    containing ±Inf (and no NaN) has scale +Inf and all its FP8 values NaN.
    """
    _check_group_size("group_size", group_size)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [M, K] or [G, M, K], got shape {tuple(x.shape)}")
    if x.shape[-1] == 0:
        raise ValueError("x must have K > 0 columns")
    k = x.shape[-1]
    kg = ceil_div(k, group_size)
    xf = x.float()
    # Zero padding of the last group cannot change amax (|x| >= 0; NaN still wins).
    padded = F.pad(xf, (0, kg * group_size - k))
    amax = padded.unflatten(-1, (kg, group_size)).abs().amax(dim=-1)  # [..., M, KG]
    scale = _scale_from_amax(amax, eps, ue8m0)
    x_fp8 = _to_fp8(xf, _expand_last(scale, k, group_size)).contiguous()

    if x.dim() == 2:
        x_scale = empty_scale_tma(x.shape[0], kg, device=x.device)
    else:
        x_scale = empty_scale_tma(x.shape[1], kg, groups=x.shape[0], device=x.device)
    x_scale.copy_(scale)
    return x_fp8, x_scale


def dequant_per_token_group(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, group_size: int = GROUP_K
) -> torch.Tensor:
    """``x_fp8 · x_scale`` in float32.

    ``x_fp8``: ``[M, K]`` or ``[G, M, K]`` FP8; ``x_scale``: FP32 ``[M, KG]`` / ``[G, M, KG]`` in any
    layout, ``KG = ceil(K/group_size)``. Returns float32 of ``x_fp8``'s shape.
    """
    _check_group_size("group_size", group_size)
    k = x_fp8.shape[-1]
    expected = (*x_fp8.shape[:-1], ceil_div(k, group_size))
    if tuple(x_scale.shape) != expected:
        raise ValueError(
            f"x_scale must have shape {expected} for x_fp8 {tuple(x_fp8.shape)} and "
            f"group_size={group_size}, got {tuple(x_scale.shape)}"
        )
    return x_fp8.float() * _expand_last(x_scale.float(), k, group_size)


# ----------------------------------------------------------------------------------------------
# 2. Weight quantization, per (bn × bk) block
# ----------------------------------------------------------------------------------------------
def per_block_quant(
    w: torch.Tensor,
    block: tuple[int, int] = (GROUP_K, GROUP_K),
    *,
    ue8m0: bool = False,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights to FP8 with one FP32 scale per ``block = (bn, bk)`` tile.

    Args:
        w: ``[N, K]`` or ``[G, N, K]``, bf16/fp16/fp32; N and K may be ragged (partial edge blocks).
        block: ``(bn, bk)``, (128, 128) for DeepSeek-V3.
        ue8m0: round scales up to powers of two.

    Returns:
        ``w_fp8``: FP8, same shape, contiguous. ``w_scale``: FP32 ``[ceil(N/bn), ceil(K/bk)]``
        (``[G, ...]``), contiguous; ``scale = max(amax(block), eps) / 448``. NaN/Inf as in
        ``per_token_group_quant`` (per block).
    """
    bn, bk = block
    _check_group_size("block[0]", bn)
    _check_group_size("block[1]", bk)
    if w.dim() not in (2, 3):
        raise ValueError(f"w must be [N, K] or [G, N, K], got shape {tuple(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = ceil_div(n, bn), ceil_div(k, bk)
    wf = w.float()
    padded = F.pad(wf, (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    w_scale = _scale_from_amax(amax, eps, ue8m0).contiguous()
    w_fp8 = _to_fp8(wf, _expand_block(w_scale, n, k, block)).contiguous()
    return w_fp8, w_scale


def _expand_block(w_scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    return w_scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequant_per_block(
    w_fp8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] = (GROUP_K, GROUP_K)
) -> torch.Tensor:
    """``w_fp8 · w_scale`` in float32.

    ``w_fp8``: ``[N, K]`` / ``[G, N, K]`` FP8; ``w_scale``: FP32 ``[ceil(N/bn), ceil(K/bk)]`` (``[G, ...]``).
    """
    bn, bk = block
    n, k = w_fp8.shape[-2:]
    expected = (*w_fp8.shape[:-2], ceil_div(n, bn), ceil_div(k, bk))
    if tuple(w_scale.shape) != expected:
        raise ValueError(
            f"w_scale must have shape {expected} for w_fp8 {tuple(w_fp8.shape)} and block={block}, "
            f"got {tuple(w_scale.shape)}"
        )
    return w_fp8.float() * _expand_block(w_scale.float(), n, k, block)


# ----------------------------------------------------------------------------------------------
# 3. GEMMs
# ----------------------------------------------------------------------------------------------
def _matmul_nt_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.transpose(-1, -2)`` with at least FP32 precision.

    On the CPU, and where the process allows TF32 for FP32 CUDA matmuls (``torch.set_float32_matmul_precision``
    other than "highest"), the sums are float64, rounded once to float32: the oracle must never silently lose
    precision, and a CPU float32 sum's order follows the BLAS kernel a shape picks (MKL on AVX-512 gave a group's
    rows different last bits as 4 rows of a contiguous segment and as 9 of a masked one), whereas the products of
    two float32 are exact in float64 and the order of its sums shows at float32 only for a sum within ~2^-50 of a
    rounding midpoint.
    """
    if not a.is_cuda or torch.get_float32_matmul_precision() != "highest":
        return (a.double() @ b.double().transpose(-1, -2)).float()
    return a @ b.transpose(-1, -2)


def _check_gemm_operands(x_fp8: torch.Tensor, w_fp8: torch.Tensor, x_dims: int, w_dims: int) -> None:
    if x_fp8.dim() != x_dims or w_fp8.dim() != w_dims:
        raise ValueError(
            f"expected x_fp8 with {x_dims} dims and w_fp8 with {w_dims} dims, got "
            f"{tuple(x_fp8.shape)} and {tuple(w_fp8.shape)}"
        )
    if x_fp8.shape[-1] != w_fp8.shape[-1]:
        raise ValueError(f"K mismatch: x_fp8 {tuple(x_fp8.shape)} vs w_fp8 {tuple(w_fp8.shape)}")


def fp8_gemm(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """``bf16 [M, N] = dequant(x) @ dequant(w)ᵀ`` in float32.

    ``x_fp8 [M, K]`` FP8 with ``x_scale [M, ceil(K/128)]`` (any layout); ``w_fp8 [N, K]`` FP8 with
    ``w_scale [ceil(N/128), ceil(K/128)]``. ``M`` may be 0.
    """
    _check_gemm_operands(x_fp8, w_fp8, 2, 2)
    x = dequant_per_token_group(x_fp8, x_scale)
    w = dequant_per_block(w_fp8, w_scale)
    return _matmul_nt_f32(x, w).to(torch.bfloat16)


def fp8_grouped_gemm_contiguous(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    m_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Contiguous grouped GEMM: row ``r`` uses expert ``g = m_indices[r]``.

    Args:
        x_fp8: ``[M_total, K]`` FP8; ``x_scale``: ``[M_total, ceil(K/128)]`` FP32 (any layout).
        w_fp8: ``[G, N, K]`` FP8; ``w_scale``: ``[G, ceil(N/128), ceil(K/128)]`` FP32.
        m_indices: int ``[M_total]``, group id per row or -1 for padding rows.
        out: optional bf16 ``[M_total, N]`` to write into.

    Returns ``out`` (bf16 ``[M_total, N]``): ``dequant(x[r]) @ dequant(w[g])ᵀ`` for ``g >= 0``;
    padding rows (-1) are 0 here (unspecified for kernels); rows with an id outside
    ``[-1, G)`` are NaN (an invalid id is a bug; NaN makes any test see it without a host sync).

    Cost on a GPU: one full ``[M_total, N]`` product per group, selected by mask (no host sync, no Python
    loop over rows), i.e. ``O(G · M_total · N · K)``. On the CPU, where reading ``m_indices`` costs no
    sync, each group's product runs on its own rows only: ``O(M_total · N · K)`` (384 experts stay cheap).
    """
    _check_gemm_operands(x_fp8, w_fp8, 2, 3)
    m_total, num_groups, n = x_fp8.shape[0], w_fp8.shape[0], w_fp8.shape[1]
    if m_indices.shape != (m_total,):
        raise ValueError(f"m_indices must have shape ({m_total},), got {tuple(m_indices.shape)}")
    if out is not None and (out.shape != (m_total, n) or out.dtype != torch.bfloat16):
        raise ValueError(f"out must be bf16 [{m_total}, {n}], got {out.dtype} {tuple(out.shape)}")
    x = dequant_per_token_group(x_fp8, x_scale)
    ids = m_indices.long()
    result = torch.zeros((m_total, n), dtype=torch.float32, device=x_fp8.device)
    if x_fp8.device.type == "cpu":
        for g in ids.unique().tolist():
            if 0 <= g < num_groups:
                rows = (ids == g).nonzero().squeeze(1)
                result[rows] = _matmul_nt_f32(x[rows], dequant_per_block(w_fp8[g], w_scale[g]))
    else:
        for g in range(num_groups):
            w_g = dequant_per_block(w_fp8[g], w_scale[g])  # one group at a time: [N, K] float32
            row_is_g = (ids == g).unsqueeze(1)
            result = torch.where(row_is_g, _matmul_nt_f32(x, w_g), result)
    invalid = ((ids < -1) | (ids >= num_groups)).unsqueeze(1)
    result = torch.where(invalid, torch.full_like(result, float("nan")), result)
    if out is None:
        return result.to(torch.bfloat16)
    out.copy_(result)
    return out


def _valid_row_mask(masked_m: torch.Tensor, max_m: int) -> torch.Tensor:
    """bool ``[G, max_m]``: row ``r`` of group ``g`` is valid iff ``r < clamp(masked_m[g], 0, max_m)``."""
    rows = torch.arange(max_m, device=masked_m.device)
    return rows.unsqueeze(0) < masked_m.long().clamp(0, max_m).unsqueeze(1)


def fp8_grouped_gemm_masked(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked grouped GEMM (decode layout); no host sync.

    Args:
        x_fp8: ``[G, max_m, K]`` FP8; ``x_scale``: ``[G, max_m, ceil(K/128)]`` FP32 (any layout).
        w_fp8: ``[G, N, K]`` FP8; ``w_scale``: ``[G, ceil(N/128), ceil(K/128)]`` FP32.
        masked_m: int ``[G]`` on x's device: valid rows per group (clamped to ``[0, max_m]``, as the kernels
            do: the values are on the device and are not checked).
        out: optional bf16 ``[G, max_m, N]``; allocated as zeros when None.

    Returns ``out``: rows ``r < masked_m[g]`` hold ``dequant(x[g, r]) @ dequant(w[g])ᵀ``; rows
    ``r >= masked_m[g]`` keep whatever ``out`` held (the kernels do not write them either).
    """
    _check_gemm_operands(x_fp8, w_fp8, 3, 3)
    num_groups, max_m = x_fp8.shape[:2]
    n = w_fp8.shape[1]
    if w_fp8.shape[0] != num_groups or masked_m.shape != (num_groups,):
        raise ValueError(
            f"group count mismatch: x_fp8 {tuple(x_fp8.shape)}, w_fp8 {tuple(w_fp8.shape)}, "
            f"masked_m {tuple(masked_m.shape)}"
        )
    if out is None:
        out = torch.zeros((num_groups, max_m, n), dtype=torch.bfloat16, device=x_fp8.device)
    elif out.shape != (num_groups, max_m, n) or out.dtype != torch.bfloat16:
        raise ValueError(
            f"out must be bf16 [{num_groups}, {max_m}, {n}], got {out.dtype} {tuple(out.shape)}"
        )
    if w_scale.shape[0] != num_groups:
        raise ValueError(f"w_scale must have {num_groups} groups, got shape {tuple(w_scale.shape)}")
    x = dequant_per_token_group(x_fp8, x_scale)
    result = torch.empty((num_groups, max_m, n), dtype=torch.bfloat16, device=x_fp8.device)
    for g in range(num_groups):  # host loop over groups only: no host sync
        w_g = dequant_per_block(w_fp8[g], w_scale[g])
        result[g] = _matmul_nt_f32(x[g], w_g).to(torch.bfloat16)
    valid = _valid_row_mask(masked_m, max_m).unsqueeze(-1)
    out.copy_(torch.where(valid, result, out))
    return out


# ----------------------------------------------------------------------------------------------
# 4. SiLU·mul (+ quantization)
# ----------------------------------------------------------------------------------------------
def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` as float32, where ``h [..., 2I] = [gate | up]`` (gate first). Returns ``[..., I]``.

    Evaluated in float64 and rounded once to float32: float32 ``exp`` differs by an ulp between CPU
    and CUDA, and the oracle must give the same bits on both.
    """
    if h.shape[-1] % 2 != 0:
        raise ValueError(f"h's last dim must be even (gate | up), got {h.shape[-1]}")
    gate, up = h.double().chunk(2, dim=-1)
    return (F.silu(gate) * up).float()


def silu_mul_per_token_group_quant(
    h: torch.Tensor,
    group_size: int = GROUP_K,
    ue8m0: bool = False,
    masked_m: torch.Tensor | None = None,
    *,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant(silu_mul(h))``: the activation between the two expert GEMMs.

    Args:
        h: ``[M, 2I]`` or ``[G, max_m, 2I]`` (bf16/fp16/fp32), ``[gate | up]``.
        masked_m: optional int ``[G]`` (``[1]`` with a 2-D ``h``: one group). Rows ``r >= masked_m[g]`` are
            FP8 zeros with scale 1.0 here, whatever ``h`` holds there (kernels leave them untouched instead).

    Returns ``(y_fp8 [..., I], y_scale [..., ceil(I/group_size)])``, scales in the TMA layout.
    """
    if masked_m is not None and h.dim() == 2:
        y_fp8, y_scale = silu_mul_per_token_group_quant(h.unsqueeze(0), group_size, ue8m0, masked_m, eps=eps)
        return y_fp8[0], y_scale[0]
    y = silu_mul(h)
    if masked_m is None:
        return per_token_group_quant(y, group_size, ue8m0, eps)
    if h.dim() != 3 or masked_m.shape != (h.shape[0],):
        raise ValueError(
            f"masked_m needs h [G, max_m, 2I] and masked_m [G] (or h [M, 2I] and masked_m [1]), got "
            f"{tuple(h.shape)} and {tuple(masked_m.shape)}"
        )
    valid = _valid_row_mask(masked_m, h.shape[1]).unsqueeze(-1)
    y_fp8, y_scale = per_token_group_quant(torch.where(valid, y, 0.0), group_size, ue8m0, eps)
    y_scale.copy_(torch.where(valid, y_scale, 1.0))  # copy_ keeps the TMA layout
    return y_fp8, y_scale


def fp8_grouped_gemm_silu_mul_quant(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w13_fp8: torch.Tensor,
    w13_scale: torch.Tensor,
    *,
    m_indices: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    ue8m0: bool = False,
    eps: float = DEFAULT_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's first GEMM with its activation fused: ``silu_mul_per_token_group_quant(h)`` of the
    float32 product ``h = dequant(x) @ dequant(w13[g])ᵀ`` (the unfused path rounds ``h`` to bf16 first).

    Contiguous (``m_indices``, ``x_fp8 [M_total, K]``) or masked (``masked_m``, ``x_fp8 [G, max_m, K]``),
    as the grouped GEMMs; ``w13_fp8 [G, 2I, K] = [gate; up]``. Returns ``(act_fp8 [..., I],
    act_scale [..., ceil(I/128)])`` in the TMA layout. Padding rows (-1) quantize zeros here (kernels
    compute them from whatever those rows of ``x`` hold); rows past ``masked_m`` are FP8 zeros with
    scale 1.0 (kernels leave them untouched).
    """
    if (m_indices is None) == (masked_m is None):
        raise ValueError("give exactly one of m_indices (contiguous) and masked_m (masked)")
    _check_gemm_operands(x_fp8, w13_fp8, 2 if masked_m is None else 3, 3)
    if w13_fp8.shape[1] % 2:
        raise ValueError(f"w13 must stack [gate; up] halves, got {w13_fp8.shape[1]} rows")
    x = dequant_per_token_group(x_fp8, x_scale)
    h = torch.zeros((*x_fp8.shape[:-1], w13_fp8.shape[1]), dtype=torch.float32, device=x_fp8.device)
    for g in range(w13_fp8.shape[0]):
        w_g = dequant_per_block(w13_fp8[g], w13_scale[g])
        if masked_m is None:
            h = torch.where((m_indices.long() == g).unsqueeze(1), _matmul_nt_f32(x, w_g), h)
        else:
            h[g] = _matmul_nt_f32(x[g], w_g)
    return silu_mul_per_token_group_quant(h, ue8m0=ue8m0, masked_m=masked_m, eps=eps)


# ----------------------------------------------------------------------------------------------
# 5. Routing
# ----------------------------------------------------------------------------------------------
def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the last dim, descending; ties → lower index first.

    (``torch.topk`` does not promise any tie order.) NaN sorts above every number; -0.0 equals 0.0.
    """
    # one NaN, one zero: CUDA's radix sort orders floats by their bits (a NaN with the sign bit set,
    # as inf - inf makes, below -inf; -0.0 below 0.0), the CPU sort by value
    values = torch.where(torch.isnan(values), float("nan"), values) + 0.0
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _renormalize(topk_weights: torch.Tensor, topk_logits: torch.Tensor) -> torch.Tensor:
    """float32 picks' scores divided by their sum; where that sum is below float32's smallest normal (every
    pick's logit under about -87) the softmax of the picks' float64 logits instead: the rounded scores lose
    their precision there and are 0 / 0 once they underflow, while both sigmoid (e^x (1 - O(e^x))) and softmax
    scores are proportional to e^x. Picks whose logits are all -inf share the weight equally; NaN stays NaN."""
    sums = topk_weights.sum(dim=-1, keepdim=True)
    x_max = topk_logits.amax(dim=-1, keepdim=True)
    e = torch.exp(torch.where(topk_logits == x_max, 0.0, topk_logits - x_max))
    # computed for every row: a data-dependent branch would synchronise the host with a GPU
    return torch.where(sums < torch.finfo(torch.float32).tiny, (e / e.sum(dim=-1, keepdim=True)).float(),
                       topk_weights / sums)


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Router logits ``[T, E]`` float32 of ``x [T, H]`` and ``weight [E, H]``: ``F.linear`` on float32 copies
    (transformers' DeepSeek-V3 router)."""
    return F.linear(x.float(), weight.float())


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    n_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` (any float dtype). ``T`` may be 0. Scores are float32 (see below).
        top_k: experts per token.
        scoring_func: ``"softmax"`` (over E) or ``"sigmoid"`` (per expert).
        renormalize: divide the selected weights by their sum (below float32's smallest normal: the softmax
            of their logits, the same ratios without underflow; see ``_renormalize``).
        n_group, topk_group: grouped top-k (DeepSeek): the E experts form ``n_group`` equal groups,
            only the ``topk_group`` best groups are eligible. Group score: sum of the top-2
            ``choice`` values of the group for sigmoid, the max for softmax. (vLLM instead picks
            top-2-sum iff a bias is given; the two agree for DeepSeek-V2 and -V3.)
        e_score_correction_bias: optional ``[E]``, added to the scores for *selection only*
            (``choice = scores + bias``); the weights are the unbiased scores.
        routed_scaling_factor: multiplies the final weights (after renormalization).

    Returns:
        ``topk_weights`` float32 ``[T, top_k]`` and ``topk_ids`` int32 ``[T, top_k]``, ordered by
        descending choice; every tie (experts or groups) goes to the lower index.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    # Scores are evaluated in float64 and rounded once to float32 so CPU and CUDA agree bit for bit
    # (their float32 exp differ by an ulp, enough to reorder near-ties); equal logits stay equal.
    logits = router_logits.double()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1).float()
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits).float()
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")

    choice = scores
    if e_score_correction_bias is not None:
        if e_score_correction_bias.shape != (num_experts,):
            raise ValueError(
                f"e_score_correction_bias must be [{num_experts}], got {tuple(e_score_correction_bias.shape)}"
            )
        choice = scores + e_score_correction_bias.float()

    if n_group is not None:
        if topk_group is None:
            raise ValueError("topk_group is required with n_group")
        if n_group <= 0 or num_experts % n_group != 0:
            raise ValueError(f"n_group={n_group} must divide the expert count {num_experts}")
        per_group = num_experts // n_group
        if not 1 <= topk_group <= n_group or top_k > topk_group * per_group:
            raise ValueError(
                f"need 1 <= topk_group <= n_group and top_k <= topk_group * E/n_group; got "
                f"topk_group={topk_group}, n_group={n_group}, top_k={top_k}, E={num_experts}"
            )
        grouped = choice.unflatten(-1, (n_group, per_group))  # [T, n_group, per_group]
        if scoring_func == "sigmoid":
            top2 = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, per_group)]
            group_scores = top2.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        kept_groups = _stable_topk(group_scores, topk_group)  # [T, topk_group]
        group_kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept_groups, True)
        expert_kept = group_kept.repeat_interleave(per_group, dim=-1)  # [T, E]
        choice = torch.where(expert_kept, choice, float("-inf"))

    topk_ids = _stable_topk(choice, top_k)
    topk_weights = scores.gather(-1, topk_ids)
    if renormalize:
        topk_weights = _renormalize(topk_weights, logits.gather(-1, topk_ids))
    topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# 6. Dispatch / combine
# ----------------------------------------------------------------------------------------------
def _local_expert_ids(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """int64 ``[T·top_k]`` local expert id of each (token, slot) pair in row-major order, -1 = not here.

    An id outside ``[0, num_ids)`` (``num_experts``, or the map's length) and a map target outside
    ``[0, num_experts)`` are not here either, as in the kernels (a negative id must not wrap around the map).
    """
    flat = topk_ids.reshape(-1).long()
    num_ids = num_experts if expert_map is None else expert_map.shape[0]
    valid = (flat >= 0) & (flat < num_ids)
    if expert_map is not None:
        flat = expert_map.long()[flat.clamp(0, num_ids - 1)] if num_ids else flat
        valid &= (flat >= 0) & (flat < num_experts)
    return torch.where(valid, flat, -1)


def _rank_within_expert(local: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For pairs in (token, slot) order: ``(rank, counts)``.

    ``rank[i]`` = number of earlier pairs with the same expert (meaningless for ``local[i] < 0``);
    ``counts[e]`` = pairs of expert ``e`` (int64 ``[E]``). No host sync.
    """
    key = torch.where(local >= 0, local, num_experts)  # non-local pairs form a last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=local.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    bucket_start = torch.cumsum(counts, 0) - counts
    # A stable sort keeps (token, slot) order inside each expert's bucket; position in the sorted
    # list minus the bucket start is the rank.
    order = torch.argsort(key, stable=True)
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - bucket_start[key[order]]
    return rank, counts[:num_experts]


def _check_dispatch_args(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
    expert_map: torch.Tensor | None,
) -> None:
    if x_fp8.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x_fp8.shape[0]:
        raise ValueError(
            f"need x_fp8 [T, K] and topk_ids [T, top_k], got {tuple(x_fp8.shape)} and {tuple(topk_ids.shape)}"
        )
    if x_scale.shape[0] != x_fp8.shape[0] or x_scale.dim() != 2:
        raise ValueError(f"x_scale must be [T, KG], got {tuple(x_scale.shape)}")
    if num_experts < 0:
        raise ValueError(f"num_experts must be >= 0, got {num_experts}")
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [num_global_experts], got {tuple(expert_map.shape)}")


def _gather_rows_into(
    num_rows: int, x_fp8: torch.Tensor, x_scale: torch.Tensor, dest: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy token ``i // top_k`` to row ``dest[i]`` of fresh ``[num_rows, K]`` / ``[num_rows, KG]`` buffers.

    ``dest[i] == num_rows`` means "drop": it lands in one extra scratch row that is cut off.
    Unwritten rows: FP8 zeros, scale 1.0. Scales come back contiguous row-major.
    """
    device = x_fp8.device
    tokens = torch.arange(dest.numel(), device=device) // top_k
    # FP8 rows move as raw bytes: exact, and index_put on uint8 is supported everywhere.
    out_bytes = torch.zeros((num_rows + 1, x_fp8.shape[1]), dtype=torch.uint8, device=device)
    out_bytes[dest] = x_fp8.view(torch.uint8)[tokens]
    out_scale = torch.ones((num_rows + 1, x_scale.shape[1]), dtype=torch.float32, device=device)
    out_scale[dest] = x_scale.float()[tokens]
    return out_bytes[:num_rows].view(FP8_DTYPE), out_scale[:num_rows]


def dispatch_contiguous(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert_map: torch.Tensor | None = None,
    align_m: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter tokens into the contiguous grouped layout (prefill).

    Args:
        x_fp8: ``[T, K]`` FP8; ``x_scale``: ``[T, KG]`` FP32 (any layout).
        topk_ids: int ``[T, top_k]`` expert ids (global ids when ``expert_map`` is given).
        num_experts: local expert count ``E``.
        expert_map: optional int ``[num_global_experts]``: global → local id, -1 = not on this rank.
        align_m: segment alignment (``moe_fp8.utils.get_align_m()``).

    Layout: local expert ``e`` with ``c_e`` pairs owns a segment of ``align(c_e, align_m)`` rows
    (none when ``c_e == 0``); segments follow in expert order; inside a segment, pairs are in
    (token, slot) row-major order, then padding rows (FP8 zeros, scale 1.0, ``m_indices = -1``).

    Returns:
        ``out_fp8 [M_total, K]``, ``out_scale [M_total, KG]`` (TMA layout), ``m_indices`` int32
        ``[M_total]``, ``row_map`` int64 ``[T, top_k]`` (row of each pair, -1 if not local).

    Host syncs: reads ``M_total`` and validates the ids (this reference only).
    """
    _check_dispatch_args(x_fp8, x_scale, topk_ids, num_experts, expert_map)
    _check_group_size("align_m", align_m)
    num_tokens, top_k = topk_ids.shape
    device = x_fp8.device
    if topk_ids.numel() > 0:
        num_ids = num_experts if expert_map is None else expert_map.shape[0]
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_ids:
            raise ValueError(f"topk_ids must lie in [0, {num_ids}), got range [{lo}, {hi}]")
    if expert_map is not None and topk_ids.numel() > 0:
        targets = expert_map.long()[topk_ids.reshape(-1).long()]
        if int(targets.max()) >= num_experts:
            raise ValueError(f"expert_map maps to local id {int(targets.max())} >= num_experts={num_experts}")
    local = _local_expert_ids(topk_ids, num_experts, expert_map)

    rank, counts = _rank_within_expert(local, num_experts)
    seg_len = align(counts, align_m)  # elementwise on the int64 tensor; 0 stays 0
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    m_total = int(seg_len.sum())

    is_local = local >= 0
    key = torch.where(is_local, local, num_experts)
    row = torch.cat([seg_start, seg_start.new_zeros(1)])[key] + rank
    dest = torch.where(is_local, row, m_total)
    out_fp8, scale_rows = _gather_rows_into(m_total, x_fp8, x_scale, dest, top_k)
    out_scale = empty_scale_tma(m_total, x_scale.shape[1], device=device)
    out_scale.copy_(scale_rows)

    m_indices = torch.full((m_total + 1,), -1, dtype=torch.int32, device=device)
    m_indices[dest] = local.to(torch.int32)
    row_map = torch.where(is_local, row, -1).view(num_tokens, top_k)
    return out_fp8, out_scale, m_indices[:m_total], row_map


def dispatch_masked(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    max_m: int,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter tokens into the masked grouped layout (decode); no host sync.

    Args: as ``dispatch_contiguous``, plus ``max_m`` rows per expert. Ids are not validated.

    Overflow policy: an expert receiving more than ``max_m`` pairs keeps the first ``max_m`` in
    (token, slot) order; the rest are dropped (``row_map = -1``, they contribute nothing to
    ``combine``) and ``masked_m[e] = max_m``.

    Returns:
        ``out_fp8 [E, max_m, K]``, ``out_scale [E, max_m, KG]`` (3-D TMA layout), ``masked_m``
        int32 ``[E]``, ``row_map`` int64 ``[T, top_k]`` = ``e·max_m + position`` or -1 (not local,
        or dropped). Rows past ``masked_m[e]``: FP8 zeros, scale 1.0.
    """
    _check_dispatch_args(x_fp8, x_scale, topk_ids, num_experts, expert_map)
    if max_m < 0:
        raise ValueError(f"max_m must be >= 0, got {max_m}")
    num_tokens, top_k = topk_ids.shape
    kg = x_scale.shape[1]
    local = _local_expert_ids(topk_ids, num_experts, expert_map)
    rank, counts = _rank_within_expert(local, num_experts)

    num_rows = num_experts * max_m
    kept = (local >= 0) & (rank < max_m)
    row = local.clamp_min(0) * max_m + rank
    dest = torch.where(kept, row, num_rows)
    out_fp8, scale_rows = _gather_rows_into(num_rows, x_fp8, x_scale, dest, top_k)
    out_scale = empty_scale_tma(max_m, kg, groups=num_experts, device=x_fp8.device)
    out_scale.copy_(scale_rows.view(num_experts, max_m, kg))

    masked_m = counts.clamp_max(max_m).to(torch.int32)
    row_map = torch.where(kept, row, -1).view(num_tokens, top_k)
    return out_fp8.view(num_experts, max_m, x_fp8.shape[1]), out_scale, masked_m, row_map


def combine(
    y: torch.Tensor,
    row_map: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs.

    Args:
        y: expert outputs ``[M_total, H]`` or ``[E, max_m, H]`` (read as flat rows).
        row_map: int ``[T, top_k]`` from a dispatch; -1 = skip.
        topk_weights: ``[T, top_k]``.
        shared_output: optional ``[T, H]`` added in float32.

    Returns bf16 ``[T, H]``: ``Σ_j w[t, j] · y[row_map[t, j]]`` over ``row_map >= 0``, in float32
    (slots summed in order j = 0, 1, ...), plus ``shared_output``. Skipped slots contribute exactly
    0 even if ``y`` holds NaN/Inf elsewhere; a row past the end of ``y`` makes its token NaN (as the
    kernels do: never a read of other memory, never a silent 0).
    """
    h = y.shape[-1]
    rows = y.reshape(-1, h).float()
    num_rows = rows.shape[0]
    if row_map.shape != topk_weights.shape or row_map.dim() != 2:
        raise ValueError(
            f"row_map and topk_weights must both be [T, top_k], got {tuple(row_map.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    # One extra zero row serves the skipped slots (also when y has no rows at all), one NaN row the rows past
    # the end.
    rows = torch.cat([rows, rows.new_zeros(1, h), rows.new_full((1, h), float("nan"))])
    valid = row_map >= 0
    index = torch.where(valid, torch.where(row_map < num_rows, row_map.long(), num_rows + 1), num_rows)
    weights = torch.where(valid, topk_weights.float(), 0.0)
    out = torch.zeros((row_map.shape[0], h), dtype=torch.float32, device=y.device)
    for j in range(row_map.shape[1]):
        out = out + weights[:, j : j + 1] * rows[index[:, j]]
    if shared_output is not None:
        out = out + shared_output.float()
    return out.to(torch.bfloat16)
