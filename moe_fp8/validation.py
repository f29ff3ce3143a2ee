"""Argument checks for every public op (STYLE practice 6).

Each check raises at the API boundary with a message that names the argument, the rule and the
actual value, e.g. ``x_fp8 must be torch.float8_e4m3fn, got torch.bfloat16``:

- ``TypeError``  — wrong Python type or wrong tensor dtype;
- ``ValueError`` — wrong shape, stride / layout, alignment, device, or value range.

The rules are the same for every backend (a tensor the reference accepts is one the Hopper kernel
accepts), so switching backend never changes which calls are valid. Checks only read tensor
metadata (dtype, shape, strides, storage offset, device): they never read device memory, never
synchronize, and work on fake tensors under ``torch.compile``. Messages are built only on failure;
the GEMM checks' fast path costs about one ``torch.empty`` (measured 4.3 µs each on the H100 test
host, 2026-11-22; ``backends.select`` adds 0.6 µs).

The op-level checkers (``check_fp8_gemm`` …) return the problem sizes they derived so wrappers do
not recompute them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moe_fp8.utils import (
    FP8_DTYPE,
    GROUP_K,
    ceil_div,
    get_align_m,
    get_tma_aligned_m,
    is_scale_tma_layout,
)

# TMA needs every global address and every row pitch to be a multiple of 16 bytes.
TMA_ALIGN_BYTES = 16
# A bf16 output row of N elements is 2·N bytes: N % 8 == 0 keeps it 16-byte aligned for the TMA store
# epilogue. Required for every backend so the reference never accepts what the kernel refuses.
N_ALIGN = 8
# An FP8 row of K elements is K bytes: K % 16 == 0 keeps it 16-byte aligned for the TMA loads.
K_ALIGN = 16
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCORING_FUNCS = ("softmax", "sigmoid")

_HINT_TMA = "use moe_fp8.utils.to_scale_tma_layout({name})"


# --------------------------------------------------------------------------------------------
# generic checks
# --------------------------------------------------------------------------------------------

def _typename(v: object) -> str:
    return type(v).__name__


def check_tensor(name: str, t: object) -> None:
    """``t`` must be a ``torch.Tensor`` (TypeError)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_typename(t)}")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...]) -> None:
    """``t.dtype`` must be ``dtype`` (or one of a tuple of dtypes) (TypeError)."""
    ok = t.dtype in dtype if isinstance(dtype, tuple) else t.dtype == dtype
    if not ok:
        want = " or ".join(str(d) for d in dtype) if isinstance(dtype, tuple) else str(dtype)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")


def check_ndim(name: str, t: torch.Tensor, ndim: int | tuple[int, ...], what: str = "") -> None:
    """``t.dim()`` must be ``ndim`` (or one of a tuple) (ValueError); ``what`` names the dims."""
    ok = t.dim() in ndim if isinstance(ndim, tuple) else t.dim() == ndim
    if not ok:
        want = " or ".join(f"{d}-D" for d in ndim) if isinstance(ndim, tuple) else f"{ndim}-D"
        dims = f" {what}" if what else ""
        raise ValueError(f"{name} must be {want}{dims}, got {t.dim()}-D with shape {tuple(t.shape)}")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int], what: str = "") -> None:
    """``t.shape`` must equal ``shape`` (ValueError); ``what`` explains it, e.g. ``"[M, ceil(K/128)]"``."""
    if tuple(t.shape) != tuple(shape):
        dims = f" = {what}" if what else ""
        raise ValueError(f"{name} must have shape {tuple(int(s) for s in shape)}{dims}, got {tuple(t.shape)}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """``t`` must be contiguous (row-major, innermost stride 1) (ValueError)."""
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major, strides {_contig_strides(t.shape)} for shape "
            f"{tuple(t.shape)}); got strides {t.stride()} — call {name}.contiguous()")


def _contig_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def _offsets_unknown() -> bool:
    # Dynamo cannot trace Tensor.storage_offset() of graph intermediates (it graph-breaks), so the
    # alignment rule is checked in eager mode only; tensors a compiled graph allocates are aligned,
    # and the kernels' TMA descriptor encoding rejects a misaligned address in any case.
    return torch.compiler.is_compiling()


def check_tma_aligned(name: str, t: torch.Tensor) -> None:
    """``t``'s first element must sit on a 16-byte boundary (ValueError). Eager mode only.

    Checked through ``storage_offset`` (allocations themselves are ≥ 256-byte aligned), so it never
    touches the data pointer.
    """
    if _offsets_unknown():
        return
    if (t.storage_offset() * t.element_size()) % TMA_ALIGN_BYTES != 0:
        raise ValueError(
            f"{name} must start on a {TMA_ALIGN_BYTES}-byte boundary for TMA; got storage_offset "
            f"{t.storage_offset()} × {t.element_size()} bytes — pass a fresh copy ("
            + ("moe_fp8.quant.to_scale_tma_layout(...) for scales: .clone() drops their column-major layout)"
               if t.dtype == torch.float32 else ".clone())"))


def check_same_device(name: str, t: torch.Tensor, ref_name: str, device: torch.device) -> None:
    """``t`` must be on ``device`` (the device of argument ``ref_name``) (ValueError)."""
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({device}), got {t.device}")


def expected_scale_tma_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of ``moe_fp8.utils.empty_scale_tma`` for a ``[M, KG]`` or ``[G, M, KG]`` scale."""
    if len(shape) == 2:
        m, _ = shape
        return (1, get_tma_aligned_m(m))
    _, m, kg = shape
    m_pad = get_tma_aligned_m(m)
    return (kg * m_pad, 1, m_pad)


def check_scale_tma(name: str, t: torch.Tensor) -> None:
    """``t`` (FP32 ``[M, KG]`` or ``[G, M, KG]``) must be in the kernels' TMA layout (ValueError).

    Column-major per group with M padded to a multiple of 4, as ``moe_fp8.utils.empty_scale_tma``
    allocates and ``moe_fp8.quant.per_token_group`` returns. Never converted silently (STYLE pitfall 5).
    """
    # An empty scale has no layout to get wrong (utils.empty_scale_tma(0, KG) itself has strides (1, 1)).
    if t.numel() != 0 and not is_scale_tma_layout(t):
        raise ValueError(
            f"{name} must be column-major with M padded to a multiple of 4 (strides "
            f"{expected_scale_tma_strides(t.shape)} for shape {tuple(t.shape)}); got strides {t.stride()} "
            f"— {_HINT_TMA.format(name=name)}")
    check_tma_aligned(name, t)


def _is_int(v: object) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or isinstance(v, torch.SymInt)


def check_int(name: str, v: object, *, min_value: int | None = None, max_value: int | None = None) -> None:
    """``v`` must be a host ``int`` (not bool, not a tensor) within ``[min_value, max_value]``."""
    if not _is_int(v):
        raise TypeError(f"{name} must be an int (a host value, not a tensor), got {_typename(v)}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name} must be <= {max_value}, got {v}")


def check_bool(name: str, v: object) -> None:
    """``v`` must be a Python ``bool`` (TypeError)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {_typename(v)}")


def check_float(name: str, v: object) -> None:
    """``v`` must be a host real number (int or float, not bool) (TypeError)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a float, got {_typename(v)}")


# --------------------------------------------------------------------------------------------
# composite checks shared by the GEMMs
# --------------------------------------------------------------------------------------------

def _check_fp8_operand(name: str, t: object, ndim: int, what: str) -> None:
    check_tensor(name, t)
    check_dtype(name, t, FP8_DTYPE)
    check_ndim(name, t, ndim, what)
    check_contiguous(name, t)
    check_tma_aligned(name, t)


def _check_k(k: int) -> None:
    if k <= 0 or k % K_ALIGN != 0:
        raise ValueError(
            f"x_fp8 K (last dim) must be a positive multiple of {K_ALIGN} (16-byte FP8 rows for TMA), got {k}")


def _check_n(n: int) -> None:
    if n <= 0 or n % N_ALIGN != 0:
        raise ValueError(
            f"w N (rows per group) must be a positive multiple of {N_ALIGN} (16-byte bf16 output rows; "
            f"required by every backend), got {n}")


def _check_w_scale(w_scale: object, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    check_tensor("w_scale", w_scale)
    check_dtype("w_scale", w_scale, torch.float32)
    check_shape("w_scale", w_scale, shape, what)
    check_contiguous("w_scale", w_scale)
    check_same_device("w_scale", w_scale, "x_fp8", device)


def _check_x_scale(x_scale: object, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    check_tensor("x_scale", x_scale)
    check_dtype("x_scale", x_scale, torch.float32)
    check_shape("x_scale", x_scale, shape, what)
    check_scale_tma("x_scale", x_scale)
    check_same_device("x_scale", x_scale, "x_fp8", device)


def _check_out(out: object, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if out is None:
        return
    check_tensor("out", out)
    check_dtype("out", out, torch.bfloat16)
    check_shape("out", out, shape, what)
    check_contiguous("out", out)
    check_tma_aligned("out", out)
    check_same_device("out", out, "x_fp8", device)


def check_fp8_gemm(x_fp8: object, x_scale: object, w: object, w_scale: object,
                   out: object = None) -> tuple[int, int, int]:
    """Validate ``fp8_gemm`` arguments; returns ``(M, N, K)``.

    x_fp8 FP8 [M, K] contiguous; w FP8 [N, K] contiguous; K % 16 == 0, N % 8 == 0;
    x_scale FP32 [M, ceil(K/128)] in the TMA layout; w_scale FP32 [ceil(N/128), ceil(K/128)]
    contiguous; out (optional) bf16 [M, N] contiguous; everything on x_fp8's device. M = 0 is allowed.
    """
    fast = _fast_fp8_gemm(x_fp8, x_scale, w, w_scale, out)
    if fast is not None:
        return fast
    _check_fp8_operand("x_fp8", x_fp8, 2, "[M, K]")
    m, k = x_fp8.shape
    _check_k(k)
    dev = x_fp8.device
    _check_fp8_operand("w", w, 2, "[N, K]")
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"w must have shape [N, K] with K = x_fp8.shape[1] = {k}, got {tuple(w.shape)}")
    _check_n(n)
    check_same_device("w", w, "x_fp8", dev)
    kg = ceil_div(k, GROUP_K)
    _check_x_scale(x_scale, (m, kg), "[M, ceil(K/128)]", dev)
    _check_w_scale(w_scale, (ceil_div(n, GROUP_K), kg), "[ceil(N/128), ceil(K/128)]", dev)
    _check_out(out, (m, n), "[M, N]", dev)
    return m, n, k


# --------------------------------------------------------------------------------------------
# GEMM fast paths
#
# NOTE: the eager launch budget is 10 µs and the step-by-step checks below cost over 10 µs on the CI
# machine because every tensor attribute is a Python→C++ call (~100-250 ns each). Each GEMM
# checker therefore first evaluates one flat predicate over the same rules; only when it fails do
# the step-by-step checks run to find the first violated rule and raise. The predicate only ever
# *accepts*: the step-by-step checks stay the definition, and every invalid case in
# tests/test_validation.py goes through the predicate first, so a predicate that accepted too much
# would make those tests fail.
# --------------------------------------------------------------------------------------------

_F32 = torch.float32
_BF16 = torch.bfloat16
_I32 = torch.int32


def _fast_fp8_gemm(x, xs, w, ws, out):  # untyped on purpose: any input is probed
    try:
        m, k = x.shape
        n, wk = w.shape
        kg = (k + GROUP_K - 1) // GROUP_K
        dev = x.device
        if (x.dtype is FP8_DTYPE and w.dtype is FP8_DTYPE and xs.dtype is _F32 and ws.dtype is _F32
                and wk == k and k > 0 and k % K_ALIGN == 0 and n > 0 and n % N_ALIGN == 0
                and x.is_contiguous() and w.is_contiguous() and ws.is_contiguous()
                and (_offsets_unknown() or (x.storage_offset() % 16 == 0 and w.storage_offset() % 16 == 0
                                            and xs.storage_offset() % 4 == 0
                                            and (out is None or out.storage_offset() % 8 == 0)))
                and xs.shape == (m, kg) and xs.stride() == (1, (m + 3) // 4 * 4)
                and ws.shape == ((n + GROUP_K - 1) // GROUP_K, kg)
                and xs.device == dev and w.device == dev and ws.device == dev
                and (out is None or (out.dtype is _BF16 and out.shape == (m, n) and out.is_contiguous()
                                     and out.device == dev))):
            return m, n, k
    except Exception:  # anything odd: let the step-by-step checks name it
        pass
    return None


def _fast_grouped_contiguous(x, xs, w, ws, mi, out):
    try:
        m, k = x.shape
        g, n, wk = w.shape
        kg = (k + GROUP_K - 1) // GROUP_K
        dev = x.device
        if (x.dtype is FP8_DTYPE and w.dtype is FP8_DTYPE and xs.dtype is _F32 and ws.dtype is _F32
                and mi.dtype is _I32
                and wk == k and k > 0 and k % K_ALIGN == 0 and n > 0 and n % N_ALIGN == 0 and g > 0
                and m % get_align_m() == 0
                and x.is_contiguous() and w.is_contiguous() and ws.is_contiguous() and mi.is_contiguous()
                and (_offsets_unknown() or (x.storage_offset() % 16 == 0 and w.storage_offset() % 16 == 0
                                            and xs.storage_offset() % 4 == 0
                                            and (out is None or out.storage_offset() % 8 == 0)))
                and xs.shape == (m, kg) and xs.stride() == (1, (m + 3) // 4 * 4)
                and ws.shape == (g, (n + GROUP_K - 1) // GROUP_K, kg) and mi.shape == (m,)
                and xs.device == dev and w.device == dev and ws.device == dev and mi.device == dev
                and (out is None or (out.dtype is _BF16 and out.shape == (m, n) and out.is_contiguous()
                                     and out.device == dev))):
            return g, m, n, k
    except Exception:
        pass
    return None


def _fast_grouped_masked(x, xs, w, ws, mm, expected_m, out):
    try:
        g, max_m, k = x.shape
        wg, n, wk = w.shape
        kg = (k + GROUP_K - 1) // GROUP_K
        m_pad = (max_m + 3) // 4 * 4
        dev = x.device
        if (x.dtype is FP8_DTYPE and w.dtype is FP8_DTYPE and xs.dtype is _F32 and ws.dtype is _F32
                and mm.dtype is _I32 and type(expected_m) is int and expected_m > 0
                and wg == g and wk == k and k > 0 and k % K_ALIGN == 0 and n > 0 and n % N_ALIGN == 0 and g > 0
                and x.is_contiguous() and w.is_contiguous() and ws.is_contiguous() and mm.is_contiguous()
                and (_offsets_unknown() or (x.storage_offset() % 16 == 0 and w.storage_offset() % 16 == 0
                                            and xs.storage_offset() % 4 == 0
                                            and (out is None or out.storage_offset() % 8 == 0)))
                and xs.shape == (g, max_m, kg) and xs.stride() == (kg * m_pad, 1, m_pad)
                and ws.shape == (g, (n + GROUP_K - 1) // GROUP_K, kg) and mm.shape == (g,)
                and xs.device == dev and w.device == dev and ws.device == dev and mm.device == dev
                and (out is None or (out.dtype is _BF16 and out.shape == (g, max_m, n) and out.is_contiguous()
                                     and out.device == dev))):
            return g, max_m, n, k
    except Exception:
        pass
    return None


def _check_grouped_w(w: object, k: int, dev: torch.device) -> tuple[int, int]:
    _check_fp8_operand("w", w, 3, "[G, N, K]")
    g, n, wk = w.shape
    if wk != k:
        raise ValueError(f"w must have shape [G, N, K] with K = x_fp8.shape[-1] = {k}, got {tuple(w.shape)}")
    if g <= 0:
        raise ValueError(f"w must have at least one group (G = w.shape[0] > 0), got shape {tuple(w.shape)}")
    _check_n(n)
    check_same_device("w", w, "x_fp8", dev)
    return g, n


def check_fp8_grouped_gemm_contiguous(x_fp8: object, x_scale: object, w: object, w_scale: object,
                                      m_indices: object, out: object = None,
                                      m_total: object = None, expected_m: object = None) -> tuple[int, int, int, int]:
    """Validate the contiguous grouped GEMM; returns ``(G, M_total, N, K)``.

    As ``check_fp8_gemm`` with w FP8 [G, N, K], w_scale FP32 [G, ceil(N/128), ceil(K/128)],
    m_indices int32 [M_total] contiguous on x_fp8's device, and M_total % get_align_m() == 0; the
    optional m_total int32 [1] on x_fp8's device (its value is not read); expected_m None or a positive
    host int (a speed hint only).
    """
    if expected_m is not None:
        check_int("expected_m", expected_m, min_value=1)
    fast = _fast_grouped_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out)
    if fast is not None:
        if m_total is not None:
            check_masked_m("m_total", m_total, 1, x_fp8.device, "[1]")
        return fast
    _check_fp8_operand("x_fp8", x_fp8, 2, "[M_total, K]")
    m, k = x_fp8.shape
    _check_k(k)
    align_m = get_align_m()
    if m % align_m != 0:
        raise ValueError(
            f"x_fp8 rows (M_total = {m}) must be a multiple of get_align_m() = {align_m} in the contiguous "
            f"grouped layout (each group's segment is padded; see moe_fp8.layers.dispatch_contiguous)")
    dev = x_fp8.device
    g, n = _check_grouped_w(w, k, dev)
    kg = ceil_div(k, GROUP_K)
    _check_x_scale(x_scale, (m, kg), "[M_total, ceil(K/128)]", dev)
    _check_w_scale(w_scale, (g, ceil_div(n, GROUP_K), kg), "[G, ceil(N/128), ceil(K/128)]", dev)
    check_tensor("m_indices", m_indices)
    check_dtype("m_indices", m_indices, torch.int32)
    check_shape("m_indices", m_indices, (m,), "[M_total]")
    check_contiguous("m_indices", m_indices)
    check_same_device("m_indices", m_indices, "x_fp8", dev)
    _check_out(out, (m, n), "[M_total, N]", dev)
    if m_total is not None:
        check_masked_m("m_total", m_total, 1, dev, "[1]")
    return g, m, n, k


def check_fp8_grouped_gemm_masked(x_fp8: object, x_scale: object, w: object, w_scale: object,
                                  masked_m: object, expected_m: object,
                                  out: object = None) -> tuple[int, int, int, int]:
    """Validate the masked grouped GEMM; returns ``(G, max_m, N, K)``.

    x_fp8 FP8 [G, max_m, K] contiguous; x_scale FP32 [G, max_m, ceil(K/128)] in the 3-D TMA layout;
    w / w_scale as the contiguous form; masked_m int32 [G] on x_fp8's device (never read on the host);
    expected_m a positive host int (a speed hint only); out bf16 [G, max_m, N].
    """
    fast = _fast_grouped_masked(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)
    if fast is not None:
        return fast
    _check_fp8_operand("x_fp8", x_fp8, 3, "[G, max_m, K]")
    gx, max_m, k = x_fp8.shape
    _check_k(k)
    dev = x_fp8.device
    g, n = _check_grouped_w(w, k, dev)
    if gx != g:
        raise ValueError(f"x_fp8 must have G = w.shape[0] = {g} groups, got shape {tuple(x_fp8.shape)}")
    kg = ceil_div(k, GROUP_K)
    _check_x_scale(x_scale, (g, max_m, kg), "[G, max_m, ceil(K/128)]", dev)
    _check_w_scale(w_scale, (g, ceil_div(n, GROUP_K), kg), "[G, ceil(N/128), ceil(K/128)]", dev)
    check_masked_m("masked_m", masked_m, g, dev)
    check_int("expected_m", expected_m, min_value=1)
    _check_out(out, (g, max_m, n), "[G, max_m, N]", dev)
    return g, max_m, n, k


def check_fp8_grouped_gemm_silu_mul_quant(x_fp8: object, x_scale: object, w13: object, w13_scale: object,
                                          m_indices: object, masked_m: object, expected_m: object, ue8m0: object,
                                          out: object, out_scale: object, m_total: object = None) -> tuple[int, int]:
    """Validate ``ops.fp8_grouped_gemm_silu_mul_quant``; returns ``(G, I)``.

    The contiguous (``m_indices``, optional ``m_total`` and ``expected_m``) or masked (``masked_m``,
    ``expected_m``) grouped GEMM's operands with ``w13 [G, 2I, K] = [gate; up]``, ``2I`` a multiple of 256
    (each output block of 128 columns pairs a gate block with its up block); ``out`` / ``out_scale`` as
    ``check_act_quant_out`` for ``[..., I]``.
    """
    if (m_indices is None) == (masked_m is None):
        raise ValueError("give exactly one of m_indices (contiguous layout) and masked_m (masked layout)")
    if masked_m is None:
        g, m, n, _ = check_fp8_grouped_gemm_contiguous(x_fp8, x_scale, w13, w13_scale, m_indices, m_total=m_total,
                                                       expected_m=expected_m)
        rows: tuple[int, ...] = (m,)
    elif m_total is not None:
        raise ValueError("m_total ends a contiguous layout (with m_indices); the masked layout has masked_m")
    else:
        g, max_m, n, _ = check_fp8_grouped_gemm_masked(x_fp8, x_scale, w13, w13_scale, masked_m, expected_m)
        rows = (g, max_m)
    if n % 256:
        raise ValueError(f"w13 rows (2*I = {n}) must be a multiple of 256: each 128-column block of the "
                         f"output pairs a gate block of w13 with its up block")
    check_bool("ue8m0", ue8m0)
    check_act_quant_out(out, out_scale, (*rows, n // 2), GROUP_K, x_fp8.device, "x_fp8")
    return g, n // 2


def check_masked_m(name: str, masked_m: object, groups: int, device: torch.device, desc: str = "[G]") -> None:
    """``masked_m`` must be an int32 [G] tensor on the data's device (values are not read)."""
    check_tensor(name, masked_m)
    check_dtype(name, masked_m, torch.int32)
    check_shape(name, masked_m, (groups,), desc)
    check_contiguous(name, masked_m)
    if masked_m.device != device:
        raise ValueError(
            f"{name} must be on the same device as the data ({device}; no host sync on the decode path), "
            f"got {masked_m.device}")


# --------------------------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------------------------

def check_group_size(group_size: object) -> None:
    """``group_size`` must be a positive multiple of 16 (GEMMs consume 128)."""
    check_int("group_size", group_size, min_value=1)
    if group_size % K_ALIGN != 0:
        raise ValueError(f"group_size must be a multiple of {K_ALIGN}, got {group_size}")


def check_per_token_group(x: object, group_size: object, ue8m0: object, eps: object) -> tuple[int, int]:
    """Validate ``quant.per_token_group``: x bf16/fp16/fp32 [M, K] or [G, M, K] contiguous, K % 16 == 0.

    Returns ``(rows, K)`` with ``rows`` the product of the leading dims.
    """
    check_tensor("x", x)
    check_dtype("x", x, ACT_DTYPES)
    check_ndim("x", x, (2, 3), "[M, K] or [G, M, K]")
    check_contiguous("x", x)
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if k <= 0 or k % K_ALIGN != 0:
        raise ValueError(f"x K (last dim) must be a positive multiple of {K_ALIGN}, got {k}")
    check_group_size(group_size)
    check_bool("ue8m0", ue8m0)
    check_eps(eps)
    return m, k


def check_eps(eps: object) -> None:
    """``eps`` (lower bound on a group's amax) must be a finite positive host float (inf would make every
    scale infinite and every output NaN)."""
    check_float("eps", eps)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if eps == float("inf"):
        raise ValueError(f"eps must be finite, got {eps}")


def check_per_block(w: object, block: object) -> tuple[int, int]:
    """Validate ``quant.per_block``: w bf16/fp16/fp32 [N, K] or [G, N, K] contiguous; block two positive ints."""
    check_tensor("w", w)
    check_dtype("w", w, ACT_DTYPES)
    check_ndim("w", w, (2, 3), "[N, K] or [G, N, K]")
    check_contiguous("w", w)
    if not isinstance(block, (tuple, list)) or len(block) != 2 or not all(_is_int(b) for b in block):
        raise TypeError(f"block must be a pair of ints (block_n, block_k), got {block!r}")
    if block[0] <= 0 or block[1] <= 0:
        raise ValueError(f"block must be positive, got {tuple(block)}")
    return int(block[0]), int(block[1])


def check_silu_mul(h: object, group_size: object, ue8m0: object, masked_m: object) -> None:
    """Validate ``quant.silu_mul_per_token_group``.

    h bf16/fp16/fp32 contiguous, [M, 2·I] (contiguous form) or [G, max_m, 2·I] (masked form) with
    ``I`` (gate half = first I columns, up half = last I) a positive multiple of 16; masked_m (optional)
    int32 [G] on h's device, [1] with a 2-D h (its row count).
    """
    check_tensor("h", h)
    check_dtype("h", h, ACT_DTYPES)
    check_ndim("h", h, (2, 3), "[M, 2*I] or [G, max_m, 2*I]")
    check_contiguous("h", h)
    two_i = h.shape[-1]
    if two_i <= 0 or two_i % (2 * K_ALIGN) != 0:
        raise ValueError(
            f"h last dim (2*I) must be a positive multiple of {2 * K_ALIGN} (I % {K_ALIGN} == 0), got {two_i}")
    check_group_size(group_size)
    check_bool("ue8m0", ue8m0)
    if masked_m is not None:
        if h.dim() == 3:
            check_masked_m("masked_m", masked_m, h.shape[0], h.device)
        else:
            check_masked_m("masked_m", masked_m, 1, h.device, "[1] for a 2-D h")


def check_act_quant_out(out: object, out_scale: object, shape: Sequence[int], group_size: int,
                        device: torch.device, ref_name: str) -> None:
    """Destination tensors of an activation quantization (``out=`` / ``out_scale=`` of ``silu_mul`` and
    ``dispatch_masked``), each optional: ``out`` float8_e4m3fn ``shape`` contiguous, 16-byte aligned;
    ``out_scale`` float32 ``[..., M, ceil(K/group_size)]`` in the TMA layout; both on ``device``."""
    if out is not None:
        check_tensor("out", out)
        check_dtype("out", out, FP8_DTYPE)
        check_shape("out", out, shape)
        check_contiguous("out", out)
        check_tma_aligned("out", out)
        check_same_device("out", out, ref_name, device)
    if out_scale is not None:
        check_tensor("out_scale", out_scale)
        check_dtype("out_scale", out_scale, torch.float32)
        check_shape("out_scale", out_scale, (*shape[:-1], ceil_div(shape[-1], group_size)))
        check_scale_tma("out_scale", out_scale)
        check_same_device("out_scale", out_scale, ref_name, device)


def check_dequant_per_token_group(x_fp8: object, x_scale: object) -> None:
    """x_fp8 FP8 [..., M, K]; x_scale FP32 [..., M, ceil(K/group)] (any layout) on the same device."""
    check_tensor("x_fp8", x_fp8)
    check_dtype("x_fp8", x_fp8, FP8_DTYPE)
    check_ndim("x_fp8", x_fp8, (2, 3), "[M, K] or [G, M, K]")
    check_tensor("x_scale", x_scale)
    check_dtype("x_scale", x_scale, torch.float32)
    check_ndim("x_scale", x_scale, x_fp8.dim(), "matching x_fp8")
    if tuple(x_scale.shape[:-1]) != tuple(x_fp8.shape[:-1]):
        raise ValueError(f"x_scale must match x_fp8 in all but the last dim ({tuple(x_fp8.shape)}), "
                         f"got {tuple(x_scale.shape)}")
    check_same_device("x_scale", x_scale, "x_fp8", x_fp8.device)


def check_dequant_per_block(w_fp8: object, w_scale: object) -> None:
    """w_fp8 FP8 [N, K] or [G, N, K]; w_scale FP32 with the same number of dims on the same device."""
    check_tensor("w_fp8", w_fp8)
    check_dtype("w_fp8", w_fp8, FP8_DTYPE)
    check_ndim("w_fp8", w_fp8, (2, 3), "[N, K] or [G, N, K]")
    check_tensor("w_scale", w_scale)
    check_dtype("w_scale", w_scale, torch.float32)
    check_ndim("w_scale", w_scale, w_fp8.dim(), "matching w_fp8")
    check_same_device("w_scale", w_scale, "w_fp8", w_fp8.device)


# --------------------------------------------------------------------------------------------
# routing, dispatch, combine
# --------------------------------------------------------------------------------------------

def check_select_experts(router_logits: object, top_k: object, scoring_func: object, renormalize: object,
                         n_group: object, topk_group: object, e_score_correction_bias: object,
                         routed_scaling_factor: object) -> tuple[int, int]:
    """Validate ``layers.select_experts``; returns ``(T, E)``.

    router_logits float [T, E]; 1 <= top_k <= E; scoring_func "softmax" or "sigmoid"; n_group and
    topk_group both None or both ints with E % n_group == 0, 1 <= topk_group <= n_group and
    top_k <= topk_group·E/n_group; e_score_correction_bias None or float [E] on the same device.
    """
    check_tensor("router_logits", router_logits)
    check_dtype("router_logits", router_logits, ACT_DTYPES)
    check_ndim("router_logits", router_logits, 2, "[T, E]")
    t, e = router_logits.shape
    check_routing_options(e, top_k, scoring_func, renormalize, n_group, topk_group, routed_scaling_factor)
    if e_score_correction_bias is not None:
        check_tensor("e_score_correction_bias", e_score_correction_bias)
        check_dtype("e_score_correction_bias", e_score_correction_bias, ACT_DTYPES)
        check_shape("e_score_correction_bias", e_score_correction_bias, (e,), "[E]")
        check_same_device("e_score_correction_bias", e_score_correction_bias, "router_logits",
                          router_logits.device)
    return t, e


def check_router_gemm(x: object, weight: object) -> tuple[int, int, int]:
    """Validate ``layers.router_gemm``; returns ``(T, H, E)``: x float [T, H], weight float [E, H] on x's device."""
    check_tensor("x", x)
    check_dtype("x", x, ACT_DTYPES)
    check_ndim("x", x, 2, "[T, H]")
    check_tensor("weight", weight)
    check_dtype("weight", weight, ACT_DTYPES)
    check_ndim("weight", weight, 2, "[E, H]")
    t, h = x.shape
    if weight.shape[1] != h:
        raise ValueError(f"weight must be [E, H] with H = {h} (x's last dim), got {tuple(weight.shape)}")
    check_same_device("weight", weight, "x", x.device)
    return t, h, weight.shape[0]


def check_routing_options(num_experts: int, top_k: object, scoring_func: object, renormalize: object,
                          n_group: object, topk_group: object, routed_scaling_factor: object) -> None:
    """The routing options of ``select_experts`` (and ``Fp8FusedMoE``) for ``num_experts`` experts: see
    ``check_select_experts``; ``routed_scaling_factor`` must be finite (a NaN would make every weight NaN)."""
    e = num_experts
    check_int("top_k", top_k, min_value=1, max_value=e)
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func must be a str, got {_typename(scoring_func)}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    check_bool("renormalize", renormalize)
    if (n_group is None) != (topk_group is None):
        raise ValueError(f"n_group and topk_group must be given together, got n_group={n_group!r}, "
                         f"topk_group={topk_group!r}")
    if n_group is not None:
        check_int("n_group", n_group, min_value=1)
        if e % n_group != 0:
            raise ValueError(f"n_group must divide the number of experts E = {e}, got {n_group}")
        check_int("topk_group", topk_group, min_value=1, max_value=n_group)
        if top_k > topk_group * (e // n_group):
            raise ValueError(f"top_k must be <= topk_group * E / n_group = {topk_group * (e // n_group)}, "
                             f"got {top_k}")
    check_float("routed_scaling_factor", routed_scaling_factor)
    # (eager only: under torch.compile(dynamic=True) the float is symbolic, and math.isfinite does not trace;
    # Fp8FusedMoE checked its own factor at construction)
    if (not torch.compiler.is_compiling() and isinstance(routed_scaling_factor, (int, float))
            and not math.isfinite(routed_scaling_factor)):
        raise ValueError(f"routed_scaling_factor must be finite, got {routed_scaling_factor}")


def check_topk_ids(topk_ids: object, tokens: int, device: torch.device, ref_name: str = "x_fp8") -> int:
    """topk_ids int32/int64 [T, top_k] on ``device`` (``ref_name``'s, the tensor giving T); returns top_k
    (values are not read)."""
    check_tensor("topk_ids", topk_ids)
    check_dtype("topk_ids", topk_ids, (torch.int32, torch.int64))
    check_ndim("topk_ids", topk_ids, 2, "[T, top_k]")
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must have T = {ref_name}.shape[0] = {tokens} rows, got shape "
                         f"{tuple(topk_ids.shape)}")
    check_same_device("topk_ids", topk_ids, ref_name, device)
    return topk_ids.shape[1]


def _check_experts(num_experts: object, expert_map: object, device: torch.device, ref_name: str) -> None:
    check_int("num_experts", num_experts, min_value=1)
    if expert_map is not None:
        check_tensor("expert_map", expert_map)
        check_dtype("expert_map", expert_map, (torch.int32, torch.int64))
        check_ndim("expert_map", expert_map, 1, "[num_global_experts]")
        check_same_device("expert_map", expert_map, ref_name, device)


def check_dispatch(x_fp8: object, x_scale: object, topk_ids: object, num_experts: object,
                   expert_map: object) -> tuple[int, int]:
    """Validate the dispatch inputs; returns ``(T, K)``.

    x_fp8 FP8 [T, K] contiguous; x_scale FP32 [T, ceil(K/128)] (any layout); topk_ids int [T, top_k];
    num_experts a positive int (*local* expert count E); expert_map None or int32/int64
    [num_global_experts] (global → local id in [0, E), -1 = not on this rank), all on x_fp8's device.
    Id values are not read (no host sync).
    """
    check_tensor("x_fp8", x_fp8)
    check_dtype("x_fp8", x_fp8, FP8_DTYPE)
    check_ndim("x_fp8", x_fp8, 2, "[T, K]")
    check_contiguous("x_fp8", x_fp8)
    t, k = x_fp8.shape
    dev = x_fp8.device
    check_tensor("x_scale", x_scale)
    check_dtype("x_scale", x_scale, torch.float32)
    check_shape("x_scale", x_scale, (t, ceil_div(k, GROUP_K)), "[T, ceil(K/128)]")
    check_same_device("x_scale", x_scale, "x_fp8", dev)
    check_topk_ids(topk_ids, t, dev)
    _check_experts(num_experts, expert_map, dev, "x_fp8")
    return t, k


def check_quant_dispatch(x: object, topk_ids: object, num_experts: object, expert_map: object, max_m: object,
                         ue8m0: object, eps: object) -> tuple[int, int]:
    """Validate ``quant_dispatch_masked`` / ``quant_dispatch_contiguous`` (``per_token_group`` then the
    dispatch); returns ``(T, K)``.

    x bf16/fp16/fp32 [T, K] contiguous, K a positive multiple of 16 (as ``per_token_group``);
    topk_ids, num_experts, expert_map as ``check_dispatch`` (on x's device); max_m a host int >= 0
    (None: the contiguous layout, which has none); ue8m0 a bool; eps a positive float.
    """
    check_tensor("x", x)
    check_dtype("x", x, ACT_DTYPES)
    check_ndim("x", x, 2, "[T, K]")
    check_contiguous("x", x)
    t, k = x.shape
    if k <= 0 or k % K_ALIGN != 0:
        raise ValueError(f"x K (last dim) must be a positive multiple of {K_ALIGN}, got {k}")
    check_topk_ids(topk_ids, t, x.device, "x")
    _check_experts(num_experts, expert_map, x.device, "x")
    if max_m is not None:
        check_int("max_m", max_m, min_value=0)
    check_bool("ue8m0", ue8m0)
    check_eps(eps)
    return t, k


def check_combine(y: object, row_map: object, topk_weights: object, shared_output: object) -> tuple[int, int]:
    """Validate ``layers.combine``; returns ``(T, H)``.

    y bf16 [M_total, H] (contiguous layout) or [G, max_m, H] (masked layout); row_map int [T, top_k];
    topk_weights float [T, top_k]; shared_output None or bf16 [T, H]; all on y's device.
    """
    check_tensor("y", y)
    check_dtype("y", y, ACT_DTYPES)
    check_ndim("y", y, (2, 3), "[M_total, H] or [G, max_m, H]")
    dev = y.device
    h = y.shape[-1]
    check_tensor("row_map", row_map)
    check_dtype("row_map", row_map, (torch.int32, torch.int64))
    check_ndim("row_map", row_map, 2, "[T, top_k]")
    check_same_device("row_map", row_map, "y", dev)
    t = row_map.shape[0]
    check_tensor("topk_weights", topk_weights)
    check_dtype("topk_weights", topk_weights, ACT_DTYPES)
    check_shape("topk_weights", topk_weights, tuple(row_map.shape), "row_map.shape [T, top_k]")
    check_same_device("topk_weights", topk_weights, "y", dev)
    if shared_output is not None:
        check_tensor("shared_output", shared_output)
        check_dtype("shared_output", shared_output, ACT_DTYPES)
        check_shape("shared_output", shared_output, (t, h), "[T, H]")
        check_same_device("shared_output", shared_output, "y", dev)
    return t, h
