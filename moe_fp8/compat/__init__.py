"""Drop-in shims with other libraries' names (``moe_fp8.compat.deep_gemm``)."""

from __future__ import annotations

from moe_fp8.compat import deep_gemm

__all__ = ["deep_gemm"]
