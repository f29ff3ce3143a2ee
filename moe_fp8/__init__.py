"""moe_fp8: block-FP8 GEMM and mixture-of-experts ops for NVIDIA Hopper (DeepSeek-V3 format).

Public API (DESIGN §3)::

    moe_fp8.fp8_gemm(x_fp8, x_scale, w, w_scale, out=None) -> out
    moe_fp8.fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out=None) -> out
    moe_fp8.fp8_grouped_gemm_masked(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out=None) -> out
    moe_fp8.fp8_grouped_gemm_silu_mul_quant(x_fp8, x_scale, w13, w13_scale, *, m_indices | masked_m, ...)
        -> (act_fp8, act_scale)     # an expert's first GEMM with SiLU·mul + quant (fused on Hopper)
    moe_fp8.quant.per_token_group / per_block / silu_mul_per_token_group / dequant_*
    moe_fp8.layers.router_gemm / select_experts / dispatch_contiguous / dispatch_masked / combine
    moe_fp8.set_num_sms / get_num_sms / get_align_m / backend / calc_diff
    moe_fp8.compat.deep_gemm            # DeepGEMM-named shims

Every op is a ``torch.library`` custom op (``torch.ops.moe_fp8.*``, registered in ``moe_fp8.ops``)
that runs on the best available backend (``moe_fp8.backends``: hopper → portable → reference;
``MOE_FP8_BACKEND`` forces one, ``MOE_FP8_STRICT=1`` turns fallbacks into errors).
"""

from __future__ import annotations

import torch

from moe_fp8 import backends, compat, layers, quant
from moe_fp8.ops import (
    fp8_gemm,
    fp8_grouped_gemm_contiguous,
    fp8_grouped_gemm_masked,
    fp8_grouped_gemm_silu_mul_quant,
)
from moe_fp8.utils import calc_diff, get_align_m, get_num_sms, set_num_sms

# NOTE: keep equal to [project].version in pyproject.toml.
__version__ = "0.1.0"

__all__ = [
    "__version__",
    "backend",
    "backends",
    "calc_diff",
    "compat",
    "fp8_gemm",
    "fp8_grouped_gemm_contiguous",
    "fp8_grouped_gemm_masked",
    "fp8_grouped_gemm_silu_mul_quant",
    "get_align_m",
    "get_num_sms",
    "layers",
    "quant",
    "set_num_sms",
]


def backend(op: str = "fp8_gemm", device: torch.device | str | int | None = None) -> str:
    """Name of the backend (``"hopper"``, ``"portable"`` or ``"reference"``) that runs ``op`` on ``device``.

    ``op`` is a ``torch.ops.moe_fp8`` op name (``"fp8_gemm"``, ``"fp8_grouped_gemm_masked"``,
    ``"per_token_group_quant"``, …; ``moe_fp8.backends.known_ops()`` lists them). ``device`` defaults to
    the current CUDA device, else CPU; an int means that CUDA device. Honours ``MOE_FP8_BACKEND`` and
    ``MOE_FP8_STRICT`` exactly as a call would (so it raises ``moe_fp8.backends.BackendError`` where
    the call would). ``moe_fp8.backends.explain(op, device)`` gives every backend's reason.
    """
    return backends.selected(op, backends._normalize_device(device))
