"""Launch wrapper of the Hopper ``select_experts`` kernel (impls/routing.cuh): sigmoid scores, grouped
(DeepSeek-V3) or plain top-k, one warp per token at a time, picks from certified float32 estimates.

It covers what its lane layout can hold — 32·V experts (V ≤ 16), groups of whole lanes (a power of
two of them), top_k ≤ 32, float32 / bfloat16 logits and bias — and hands every other call (softmax
scoring, other expert counts, float16) to the Triton kernel, which computes the same function.
"""

from __future__ import annotations

import functools
import os

import torch

from ..utils import ceil_div, get_num_sms, truthy
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/routing.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::routing::select_experts_kernel<{logit}, {bias}, /*V=*/{v}, /*LPG=*/{lpg}, /*kHasBias=*/{has_bias}>;
}}
"""
_CTYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}  # bf16 passed as its bits
NUM_THREADS = 256  # 8 warps, one token each at a time
# Warps per SM the grid holds at most (all resident: at up to 64 registers four blocks of 8 warps fit an SM):
# beyond that many tokens, each warp routes T / (SMs · this) consecutive ones, loading the next token's logits
# while it picks.
WARPS_PER_SM = 32


def plan(num_experts: int, top_k: int, scoring_func: str, n_group: int | None, logits_dtype: torch.dtype,
         bias_dtype: torch.dtype | None) -> tuple[int, int] | None:
    """``(V, LPG)`` (experts per lane, lanes per group, 0 without groups) when the kernel covers the call,
    else None."""
    if (scoring_func != "sigmoid" or num_experts % 32 or not 32 <= num_experts <= 512 or not 1 <= top_k <= 32
            or logits_dtype not in _CTYPES or (bias_dtype is not None and bias_dtype not in _CTYPES)):
        return None
    v = num_experts // 32
    if not n_group:
        return v, 0
    per_group = num_experts // n_group
    if num_experts % n_group or per_group % v:  # a group must be whole lanes (then n_group divides 32)
        return None
    return v, per_group // v


def kernel_variant(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None, v: int, lpg: int) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them (``moe-fp8 warmup`` too)."""
    source = KERNEL_TEMPLATE.format(logit=_CTYPES[logits_dtype], bias=_CTYPES[bias_dtype or torch.float32], v=v,
                                    lpg=lpg, has_bias=str(bias_dtype is not None).lower())
    name = f"select_experts_{str(logits_dtype)[6:]}_{str(bias_dtype)[6:] if bias_dtype else 'nobias'}_v{v}_g{lpg}"
    return name, source


@functools.cache
def get_kernel(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None, v: int, lpg: int):
    return build(*kernel_variant(logits_dtype, bias_dtype, v, lpg))


def select_experts_hopper(router_logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
                          n_group: int | None, topk_group: int | None, e_score_correction_bias: torch.Tensor | None,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::select_experts`` on Hopper (see ``moe_fp8.ops``): ``(weights f32, ids i32)``,
    both ``[T, top_k]``. Arguments are validated by the public wrapper."""
    bias = e_score_correction_bias
    t, e = router_logits.shape
    shape = plan(e, top_k, scoring_func, n_group, router_logits.dtype, None if bias is None else bias.dtype)
    if shape is None:
        from .triton.routing import select_experts

        return select_experts(router_logits, top_k, scoring_func, renormalize, n_group, topk_group, bias,
                              routed_scaling_factor)
    if not router_logits.is_cuda or (bias is not None and bias.device != router_logits.device):
        raise ValueError(f"select_experts_hopper: logits on {router_logits.device}, bias on "
                         f"{None if bias is None else bias.device}; both must be on one CUDA device")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    v, lpg = shape
    kernel = get_kernel(router_logits.dtype, None if bias is None else bias.dtype, v, lpg)
    logits = _aligned_rows(router_logits)
    num_warps = min(t, get_num_sms() * WARPS_PER_SM)
    kernel.launch(ceil_div(num_warps, NUM_THREADS // 32), NUM_THREADS,
                  [logits, bias, weights, ids, t, logits.stride(0), bias.stride(0) if bias is not None else 0,
                   topk_group or 1, top_k, int(bool(renormalize)), float(routed_scaling_factor), num_warps,
                   int(exact_only())])
    return weights, ids


def _aligned_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits``, or a contiguous copy where a row is strided or not 16-byte aligned: the kernel loads each
    lane's logits as vectors."""
    if (logits.stride(1) == 1 and logits.data_ptr() % 16 == 0
            and logits.stride(0) * logits.element_size() % 16 == 0):
        return logits
    return logits.clone(memory_format=torch.contiguous_format)


def exact_only() -> bool:
    """``MOE_FP8_ROUTING_EXACT=1``: every token takes the kernel's exact path (float64 scores for every expert)
    instead of the certified float32 estimate; the results are the same. For A/B measurements and tests."""
    return truthy(os.environ.get("MOE_FP8_ROUTING_EXACT", "0"))
