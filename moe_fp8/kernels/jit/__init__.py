"""JIT runtime for the Hopper kernels: compile (nvcc / NVRTC) → disk cache → load → launch.

Typical use by a kernel wrapper::

    from moe_fp8.kernels.jit import build, make_tma_2d

    kernel = build("fp8_gemm_n7168_k2048_bm128", generated_source)      # cached sm_90a cubin
    desc = make_tma_2d(x_fp8, k, m, 128, block_m, swizzle="128B")       # by-value CUtensorMap
    kernel.launch((num_sms, 1, 1), (384, 1, 1), [desc, out, m], smem_bytes=smem, cluster=(2, 1, 1))

Importing this package needs neither a GPU nor the CUDA driver (nor torch, until TMA names are used).
Environment: ``MOE_FP8_JIT_COMPILER`` (nvcc | nvrtc), ``MOE_FP8_CACHE_DIR``, ``MOE_FP8_JIT_DEBUG`` (1 | 2).
"""

from __future__ import annotations

from typing import Any

from .cache import (
    JitCacheError,
    build,
    cache_dir,
    cache_info,
    cache_key,
    clear_memory_cache,
    include_closure_hash,
    include_dir,
    include_tree_hash,
    is_cached,
)
from .compiler import (
    Compiler,
    CompilerInfo,
    CompilerNotFoundError,
    JitCompileError,
    find_compilers,
    get_compiler,
    parse_ptxas_report,
)
from .runtime import (
    NO_GPU_REASON,
    Arg,
    CudaError,
    CudaUnavailableError,
    JitKernel,
    cubin_entry_functions,
    driver_available,
)

_TMA_NAMES = ("TmaDesc", "make_tma", "make_tma_2d", "make_tma_3d", "clear_tma_cache")


def __getattr__(name: str) -> Any:
    # TMA helpers import torch; load them on first use so a bare import stays light.
    if name in _TMA_NAMES:
        from . import tma

        return getattr(tma, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NO_GPU_REASON",
    "Arg",
    "Compiler",
    "CompilerInfo",
    "CompilerNotFoundError",
    "CudaError",
    "CudaUnavailableError",
    "JitCacheError",
    "JitCompileError",
    "JitKernel",
    "TmaDesc",
    "build",
    "cache_dir",
    "cache_info",
    "cache_key",
    "clear_memory_cache",
    "clear_tma_cache",
    "cubin_entry_functions",
    "driver_available",
    "find_compilers",
    "get_compiler",
    "include_closure_hash",
    "include_dir",
    "include_tree_hash",
    "is_cached",
    "make_tma",
    "make_tma_2d",
    "make_tma_3d",
    "parse_ptxas_report",
]
