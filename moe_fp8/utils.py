"""Small shared helpers: shape arithmetic, scale layouts, SM count, error metric.

Every other module takes these from here so a layout rule is written once.
"""

from __future__ import annotations

import functools
import os

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Scale granularity along K for activations and weights (DeepSeek-V3 block FP8).
GROUP_K = 128
# Every expert segment of the contiguous grouped layout starts on a multiple of this.
ALIGN_M = 128
# TMA needs 16-byte aligned strides: a column-major FP32 scale column is padded to 4 rows.
SCALE_M_ALIGN = 4


# NOTE: os.environ.get costs ~1.7 µs per *unset* variable on the CI machine (Mapping.get raises and
# catches KeyError inside), and the eager launch paths read their switches on every call. os.environ keeps
# its raw items in the dict ``os.environ._data`` (keys via ``os.environ.encodekey``; CPython on POSIX and
# Windows), which a plain dict lookup reads in ~60 ns and which os.environ[...] = ... / monkeypatch.setenv
# update. Fall back to os.environ.get if that ever changes.
try:
    _ENV_DATA = os.environ._data
    _ENV_ENCODE = os.environ.encodekey
    _ENV_DECODE = os.environ.decodevalue
    if not isinstance(_ENV_DATA, dict):
        raise AttributeError("os.environ._data is not a dict")
except AttributeError:  # pragma: no cover - non-CPython os.environ
    _ENV_DATA = None
_ENV_KEYS: dict[str, object] = {}


def env(name: str) -> str | None:
    """``os.environ.get(name)``, in a fraction of its time (see the note above)."""
    if _ENV_DATA is None:  # pragma: no cover
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = _ENV_ENCODE(name)
    raw = _ENV_DATA.get(key)
    return None if raw is None else _ENV_DECODE(raw)


def truthy(text: str | None) -> bool:
    """An environment switch's value read as on / off: 1, true, yes, on (any case, spaces ignored) are on."""
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def align(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def get_align_m() -> int:
    """Row alignment of each group's segment in the contiguous grouped layout."""
    return ALIGN_M


def get_tma_aligned_m(m: int) -> int:
    """Padded row count of a column-major FP32 scale tensor (a multiple of 4)."""
    return align(m, SCALE_M_ALIGN)


def empty_scale_tma(m: int, k_groups: int, *, groups: int | None = None,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Allocate FP32 activation scales in the layout the GEMM kernels read.

    2-D: shape ``[m, k_groups]``, strides ``(1, m_pad)``.
    3-D (``groups`` given): shape ``[groups, m, k_groups]``, strides ``(k_groups*m_pad, 1, m_pad)``.
    ``m_pad = get_tma_aligned_m(m)``; padding entries are never read for output.
    """
    m_pad = get_tma_aligned_m(m)
    if groups is None:
        buf = torch.empty((k_groups, m_pad), dtype=torch.float32, device=device)
        return buf[:, :m].t()
    buf = torch.empty((groups, k_groups, m_pad), dtype=torch.float32, device=device)
    return buf[:, :, :m].transpose(1, 2)


def is_scale_tma_layout(scale: torch.Tensor) -> bool:
    """True when ``scale`` has the column-major, 4-row-padded layout of ``empty_scale_tma``."""
    if scale.numel() == 0:
        return True  # nothing is read (torch gives empty dimensions arbitrary strides)
    if scale.dim() == 2:
        m, kg = scale.shape
        return scale.stride(0) == 1 and (kg <= 1 or scale.stride(1) == get_tma_aligned_m(m))
    if scale.dim() == 3:
        g, m, kg = scale.shape
        m_pad = get_tma_aligned_m(m)
        return (scale.stride(1) == 1 and (kg <= 1 or scale.stride(2) == m_pad)
                and (g <= 1 or scale.stride(0) == kg * m_pad))
    return False


def to_scale_tma_layout(scale: torch.Tensor) -> torch.Tensor:
    """Copy any ``[M, KG]`` / ``[G, M, KG]`` floating-point scale into the kernels' FP32 layout (explicit, never
    implicit). ``TypeError`` for a non-tensor, or an integer or FP8-data tensor (their values are not scales;
    UE8M0 ``float8_e8m0fnu`` scales are)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if not scale.dtype.is_floating_point or (scale.dtype.itemsize == 1 and scale.dtype != torch.float8_e8m0fnu):
        raise TypeError(f"scale must be a floating-point scale tensor (float32, bf16, fp16, fp64 or "
                        f"float8_e8m0fnu), got {scale.dtype}")
    if scale.dim() == 2:
        out = empty_scale_tma(scale.shape[0], scale.shape[1], device=scale.device)
    elif scale.dim() == 3:
        out = empty_scale_tma(scale.shape[1], scale.shape[2], groups=scale.shape[0], device=scale.device)
    else:
        raise ValueError(f"scale must be 2-D or 3-D, got shape {tuple(scale.shape)}")
    out.copy_(scale)
    return out


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DESIGN §6 similarity metric: ``1 - 2·Σxy / Σ(x² + y²)`` in float64 (0 = identical)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64."""
    out, ref = out.double(), ref.double()
    n = ref.norm()
    return float((out - ref).norm() / n) if n > 0 else float((out - ref).norm())


_num_sms: int | None = None


def set_num_sms(num_sms: int) -> None:
    """Cap the number of SMs the persistent kernels use (e.g. to leave room for communication)."""
    global _num_sms
    if not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
    if torch.cuda.is_available():
        avail = _device_sm_count()
        if num_sms > avail:
            raise ValueError(f"num_sms={num_sms} exceeds the device's {avail} SMs")
    _num_sms = num_sms


def get_num_sms() -> int:
    """SMs the persistent kernels use: ``set_num_sms`` value, else the current device's count (132 on H100 SXM)."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_initialized():  # the launch path: no availability probe (an environment read) per call
        return _device_sm_count_of(torch._C._cuda_getDevice())
    if torch.cuda.is_available():
        return _device_sm_count()
    return _env_num_sms()


def _env_num_sms() -> int:
    """``$MOE_FP8_NUM_SMS`` (default 132); ``ValueError`` naming the variable unless a positive int, since
    0 would divide by zero in the heuristics and a negative count would plan no work."""
    text = os.environ.get("MOE_FP8_NUM_SMS", "").strip() or "132"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"MOE_FP8_NUM_SMS={text!r} is not an integer; set it to the serving GPU's SM count "
                         f"(132 on H100 SXM) or unset it") from None
    if value < 1:
        raise ValueError(f"MOE_FP8_NUM_SMS={value} must be >= 1; set it to the serving GPU's SM count "
                         f"(132 on H100 SXM) or unset it")
    return value


@functools.cache
def _device_sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sm_count() -> int:
    return _device_sm_count_of(torch.cuda.current_device())
