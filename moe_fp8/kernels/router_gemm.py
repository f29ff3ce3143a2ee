"""Launch wrapper of the Hopper router-logits kernels (impls/router_gemm.cuh): ``x [T, H] bf16 · w [E, H]ᵀ``
→ float32 ``[T, E]``, products and sums in float32: with tensor cores for bf16 weights up to ``MMA_MAX_TOKENS``
tokens, with CUDA cores for float32 weights up to ``MAX_TOKENS``.

Above that, or for other dtypes, ``router_gemm_hopper`` hands the call to cuBLAS: a bf16 GEMM with a float32
output where both operands are bf16 (tensor cores, float32 accumulation), else ``F.linear`` on float32 copies.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..utils import ceil_div, get_num_sms
from .gemm import _pdl
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/router_gemm.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::router_gemm::{kernel}<{params}>;
}}
"""
_CTYPES = {torch.bfloat16: "uint16_t", torch.float32: "float"}  # bf16 passed as its bits

WARPS = 4
CHUNK = 8  # elements a lane loads at once
MAX_SPLITS = 8  # CTAs a cluster (K splits), the portable cluster size
# The token counts each form serves; more tokens go to cuBLAS. H200, DeepSeek-V3's router, CUDA-graph replays (L2
# flushed), session 59: the CUDA-core form 9.2 us at 8 tokens against cuBLAS's bf16 GEMM's 10.8, 12.2 against 10.7 at
# 16 (its FMAs' turn to bound it); the tensor-core form (bf16 weights) ...
MAX_TOKENS = 8  # the CUDA-core form (float32 weights)
MMA_MAX_TOKENS = 64  # the tensor-core form (bf16 weights)
# 16-byte weight vectors a lane of the CUDA-core form holds, at most: float32 weights take two a chunk
MAX_WEIGHT_VECTORS = 16


@dataclasses.dataclass(frozen=True)
class Launch:
    """One specialization and its grid: ``kernel`` (``router_gemm_kernel``: CUDA cores; ``router_gemm_mma_kernel``:
    tensor cores), its template ``params``, the experts a CTA covers and the K splits (the cluster's CTAs)."""
    kernel: str
    params: tuple
    experts_per_cta: int
    splits: int


def token_tile(num_tokens: int, tile: int = 1) -> int:
    """The kernel's token count for ``num_tokens`` tokens: a power of two, at least ``tile``."""
    return max(tile, 1 << max(0, num_tokens - 1).bit_length())


def _splits(hidden: int, k_per_cta_unit: int) -> tuple[int, int]:
    """``(units, splits)``: the fewest units of ``k_per_cta_unit`` elements a CTA that keep a row within MAX_SPLITS
    CTAs, and the CTAs a row then takes."""
    units = ceil_div(ceil_div(hidden, k_per_cta_unit), MAX_SPLITS)
    return units, ceil_div(hidden, k_per_cta_unit * units)


def plan(num_tokens: int, hidden: int, num_experts: int, weight_dtype: torch.dtype, num_sms: int) -> Launch | None:
    """The launch for the call, or None outside the kernels' cases (then cuBLAS): bf16 weights take the tensor-core
    form (``plan_mma``), float32 ones the CUDA-core form (``plan_fma``)."""
    if num_tokens < 1 or hidden % CHUNK:
        return None
    if weight_dtype == torch.bfloat16:
        return plan_mma(num_tokens, hidden)
    return plan_fma(num_tokens, hidden, num_experts, weight_dtype, num_sms) if weight_dtype == torch.float32 else None


def plan_mma(num_tokens: int, hidden: int) -> Launch | None:
    """Up to MMA_MAX_TOKENS tokens: tiles of 16 tokens and 8 experts, a CTA's warps on consecutive K ranges of
    32-element steps (the fewest steps that keep a row within MAX_SPLITS CTAs); 16 experts a CTA above 16 tokens, so
    that half as many CTAs read x."""
    if not 1 <= num_tokens <= MMA_MAX_TOKENS:
        return None
    n_tiles = 2 if num_tokens > 16 else 1
    iters, splits = _splits(hidden, WARPS * 32)
    return Launch("router_gemm_mma_kernel", (token_tile(num_tokens, 16) // 16, n_tiles, WARPS, iters), 8 * n_tiles,
                  splits)


def plan_fma(num_tokens: int, hidden: int, num_experts: int, weight_dtype: torch.dtype, num_sms: int) -> Launch | None:
    """Up to MAX_TOKENS tokens: a CTA takes ``32 · chunks`` chunks of 8 elements of K (the fewest that keep a row
    within MAX_SPLITS CTAs); experts a warp: the most that still give every SM a CTA, at most 64 partial sums a lane
    and MAX_WEIGHT_VECTORS weight vectors a lane."""
    if not 1 <= num_tokens <= MAX_TOKENS:
        return None
    tokens = token_tile(num_tokens)
    chunks, splits = _splits(hidden, 32 * CHUNK)
    vectors = chunks * (2 if weight_dtype == torch.float32 else 1)
    best = 1
    for experts in (2, 4):
        if (tokens * experts <= 64 and vectors * experts <= MAX_WEIGHT_VECTORS
                and splits * ceil_div(num_experts, WARPS * experts) >= num_sms):
            best = experts
    if vectors * best > MAX_WEIGHT_VECTORS:
        return None  # (rows past ~16k elements: cuBLAS)
    return Launch("router_gemm_kernel", (_CTYPES[weight_dtype], tokens, best, WARPS, chunks), WARPS * best, splits)


def kernel_variant(launch: Launch) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them (``moe-fp8 warmup`` too)."""
    params = ", ".join(str(p) for p in launch.params)
    tag = "mma" if launch.kernel == "router_gemm_mma_kernel" else "fma"
    name = f"router_gemm_{tag}_" + "_".join(str(p) for p in launch.params)
    return name, KERNEL_TEMPLATE.format(kernel=launch.kernel, params=params)


@functools.cache
def get_kernel(launch: Launch):
    return build(*kernel_variant(launch))


def router_gemm_hopper(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Backend entry of ``moe_fp8::router_gemm`` on Hopper (see ``moe_fp8.ops``): float32 ``[T, E]``.
    Arguments are validated by the public wrapper."""
    t, h = x.shape
    e = weight.shape[0]
    launch = plan(t, h, e, weight.dtype, get_num_sms()) if x.dtype == torch.bfloat16 else None
    if launch is None:
        return router_gemm_cublas(x, weight)
    x, weight = _aligned_rows(x), _aligned_rows(weight)
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    get_kernel(launch).launch(
        (launch.splits, ceil_div(e, launch.experts_per_cta), 1), WARPS * 32,
        [x, weight, logits, t, h, e, x.stride(0), weight.stride(0)], cluster=(launch.splits, 1, 1), pdl=_pdl())
    return logits


def router_gemm_cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same function through cuBLAS (the portable backend's, and the Hopper one's outside the kernel)."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def _aligned_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` or a contiguous copy where its rows are strided or not 16-byte aligned (16-byte vector loads)."""
    if rows.stride(1) == 1 and rows.data_ptr() % 16 == 0 and rows.stride(0) * rows.element_size() % 16 == 0:
        return rows
    return rows.contiguous() if not rows.is_contiguous() else rows.clone()
