"""Launch wrapper of the Hopper router-logits kernel (impls/router_gemm.cuh): ``x [T, H] bf16 · w [E, H]ᵀ``
(bf16 or float32) → float32 ``[T, E]``, products and sums in float32, for up to ``MAX_TOKENS`` tokens.

Above that, or for other dtypes, ``router_gemm_hopper`` hands the call to cuBLAS: a bf16 GEMM with a float32
output where both operands are bf16 (tensor cores, float32 accumulation), else ``F.linear`` on float32 copies.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..utils import ceil_div, get_num_sms
from .gemm import _pdl
from .jit import build
from .routing import _aligned_rows  # (16-byte vector loads of each row)

KERNEL_TEMPLATE = """#include "moe_fp8/impls/router_gemm.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::router_gemm::router_gemm_kernel<{weight}, /*kTokens=*/{tokens}, /*kExpertsPerWarp=*/{experts},
                                                    /*kWarps=*/{warps}, /*kChunksPerLane=*/{chunks}>;
}}
"""
_CTYPES = {torch.bfloat16: "uint16_t", torch.float32: "float"}  # bf16 passed as its bits

# The kernel's largest token tile; more tokens go to cuBLAS. H200, DeepSeek-V3's router, CUDA-graph replays (L2
# flushed): 8 tokens 9.2 us against cuBLAS's 10.8, 16 tokens 12.2 against 10.7 (the FMAs' turn to bound it)
MAX_TOKENS = 8
WARPS = 4
CHUNK = 8  # elements a lane loads at once
MAX_SPLITS = 8  # CTAs a cluster (K splits), the portable cluster size
# 16-byte weight vectors a lane holds across the wait, at most: float32 weights take two a chunk
MAX_WEIGHT_VECTORS = 16


def token_tile(num_tokens: int) -> int:
    """The kernel's token count (a power of two, 1 to MAX_TOKENS) for ``num_tokens`` tokens."""
    return 1 << max(0, num_tokens - 1).bit_length()


def plan(num_tokens: int, hidden: int, num_experts: int, weight_dtype: torch.dtype,
         num_sms: int) -> tuple[int, int, int, int] | None:
    """``(tokens, experts_per_warp, chunks_per_lane, splits)`` of the launch, or None outside the kernel's cases.

    A CTA takes ``32 · chunks_per_lane`` chunks of 8 elements of K: the fewest chunks a lane that keep a row in at
    most MAX_SPLITS CTAs (one cluster). Experts a warp: the most (x read by fewer CTAs) that still give every SM a
    CTA, at most 64 partial sums a lane and MAX_WEIGHT_VECTORS weight vectors a lane."""
    if not 1 <= num_tokens <= MAX_TOKENS or hidden % CHUNK or weight_dtype not in _CTYPES:
        return None
    tokens = token_tile(num_tokens)
    chunks = ceil_div(ceil_div(hidden // CHUNK, 32), MAX_SPLITS)
    splits = ceil_div(hidden // CHUNK, 32 * chunks)
    vectors = chunks * (2 if weight_dtype == torch.float32 else 1)
    best = 1
    for experts in (2, 4):
        if (tokens * experts <= 64 and vectors * experts <= MAX_WEIGHT_VECTORS
                and splits * ceil_div(num_experts, WARPS * experts) >= num_sms):
            best = experts
    if vectors * best > 2 * MAX_WEIGHT_VECTORS:
        return None  # (rows past ~16k elements: cuBLAS)
    return tokens, best, chunks, splits


def kernel_variant(weight_dtype: torch.dtype, tokens: int, experts_per_warp: int, chunks: int) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them (``moe-fp8 warmup`` too)."""
    source = KERNEL_TEMPLATE.format(weight=_CTYPES[weight_dtype], tokens=tokens, experts=experts_per_warp,
                                    warps=WARPS, chunks=chunks)
    return f"router_gemm_{str(weight_dtype)[6:]}_t{tokens}_e{experts_per_warp}_c{chunks}", source


@functools.cache
def get_kernel(weight_dtype: torch.dtype, tokens: int, experts_per_warp: int, chunks: int):
    return build(*kernel_variant(weight_dtype, tokens, experts_per_warp, chunks))


def router_gemm_hopper(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Backend entry of ``moe_fp8::router_gemm`` on Hopper (see ``moe_fp8.ops``): float32 ``[T, E]``.
    Arguments are validated by the public wrapper."""
    t, h = x.shape
    e = weight.shape[0]
    shape = plan(t, h, e, weight.dtype, get_num_sms()) if x.dtype == torch.bfloat16 else None
    if shape is None:
        return router_gemm_cublas(x, weight)
    x, weight = _aligned_rows(x), _aligned_rows(weight)
    tokens, experts, chunks, splits = shape
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    get_kernel(weight.dtype, tokens, experts, chunks).launch(
        (splits, ceil_div(e, WARPS * experts), 1), WARPS * 32,
        [x, weight, logits, t, h, e, x.stride(0), weight.stride(0)], cluster=(splits, 1, 1), pdl=_pdl())
    return logits


def router_gemm_cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same function through cuBLAS (the portable backend's, and the Hopper one's outside the kernel)."""
    if x.dtype == weight.dtype == torch.bfloat16 and x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())

