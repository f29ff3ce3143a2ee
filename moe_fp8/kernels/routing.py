"""Launch wrapper of the Hopper ``select_experts`` kernel (impls/routing.cuh): sigmoid scores, grouped
(DeepSeek-V3) or plain top-k, one warp per token at a time, picks from certified float32 estimates.

It covers what its lane layout can hold — 32·V experts (V ≤ 16), groups of whole lanes (a power of
two of them), top_k ≤ 32, float32 / bfloat16 logits and bias — and hands every other call (softmax
scoring, other expert counts, float16) to the Triton kernel, which computes the same function.
"""

from __future__ import annotations

import functools

import torch

from ..utils import ceil_div, env, get_num_sms, truthy
from .gemm import _pdl
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/routing.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::routing::select_experts_kernel<{logit}, {bias}, /*V=*/{v}, /*LPG=*/{lpg}, /*kTopK=*/{top_k},
                                                   /*kTopKGroup=*/{topk_group}, /*kHasBias=*/{has_bias}>;
}}
"""
_CTYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}  # bf16 passed as its bits


# Launch as a PDL dependent of the kernel before (the router GEMM's CTAs let it launch at their start); False: a plain
# launch, for A/B runs (the kernel waits either way).
PDL = True

# Blocks at most (None: one per SM). Block b routes tokens [b·T / B, (b+1)·T / B), its warps taking them one
# at a time; tests set this to 1 (every token in one block) and to a large number (one token a block).
MAX_BLOCKS: int | None = None


def grid(num_tokens: int, v: int) -> tuple[int, int]:
    """``(blocks, threads)``: one block per SM (``MAX_BLOCKS`` at most), of the header's ``kThreads<V>`` (32 warps
    at up to 64 registers, 16 above V = 8), or of one warp a token where a block has fewer: at decode sizes the
    idle warps would hold their SM's registers, which the PDL-launched kernel after routing needs to start."""
    blocks = min(num_tokens, MAX_BLOCKS or get_num_sms())
    warps = min(32 if v <= 8 else 16, ceil_div(num_tokens, blocks))
    return blocks, 32 * warps


def split_smem_bytes(v: int, lpg: int, topk_group: int, threads: int) -> int:
    """Dynamic shared memory of a launch: 512 bytes a warp where the header's ``kSplit`` holds (8 experts a lane,
    the kept groups half the lanes: DeepSeek-V3), whose kept lanes hand half their keys to the dropped ones."""
    return 512 * (threads // 32) if v == 8 and lpg > 0 and topk_group * lpg * 2 == 32 else 0


def plan(num_experts: int, top_k: int, scoring_func: str, n_group: int | None, topk_group: int | None,
         logits_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> tuple[int, int, int, int] | None:
    """``(V, LPG, top_k, topk_group)`` (experts per lane; lanes per group, 0 without groups; the picks; the
    groups kept, 1 without groups) when the kernel covers the call, else None."""
    if (scoring_func != "sigmoid" or num_experts % 32 or not 32 <= num_experts <= 512 or not 1 <= top_k <= 32
            or logits_dtype not in _CTYPES or (bias_dtype is not None and bias_dtype not in _CTYPES)):
        return None
    v = num_experts // 32
    if not n_group:
        return v, 0, top_k, 1
    per_group = num_experts // n_group
    if num_experts % n_group or per_group % v:  # a group must be whole lanes (then n_group divides 32)
        return None
    return v, per_group // v, top_k, topk_group or 1


def kernel_variant(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None, v: int, lpg: int, top_k: int,
                   topk_group: int) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them (``moe-fp8 warmup`` too)."""
    source = KERNEL_TEMPLATE.format(logit=_CTYPES[logits_dtype], bias=_CTYPES[bias_dtype or torch.float32], v=v,
                                    lpg=lpg, top_k=top_k, topk_group=topk_group,
                                    has_bias=str(bias_dtype is not None).lower())
    bias_name = str(bias_dtype)[6:] if bias_dtype else "nobias"
    name = f"select_experts_{str(logits_dtype)[6:]}_{bias_name}_v{v}_g{lpg}_k{top_k}_{topk_group}"
    return name, source


@functools.cache
def get_kernel(logits_dtype: torch.dtype, bias_dtype: torch.dtype | None, v: int, lpg: int, top_k: int,
               topk_group: int):
    return build(*kernel_variant(logits_dtype, bias_dtype, v, lpg, top_k, topk_group))


def select_experts_hopper(router_logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
                          n_group: int | None, topk_group: int | None, e_score_correction_bias: torch.Tensor | None,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::select_experts`` on Hopper (see ``moe_fp8.ops``): ``(weights f32, ids i32)``,
    both ``[T, top_k]``. Arguments are validated by the public wrapper."""
    bias = e_score_correction_bias
    t, e = router_logits.shape
    shape = plan(e, top_k, scoring_func, n_group, topk_group, router_logits.dtype, None if bias is None else bias.dtype)
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
    kernel = get_kernel(router_logits.dtype, None if bias is None else bias.dtype, *shape)
    logits = _aligned_rows(router_logits)
    if bias is not None:
        bias = _aligned_rows(bias)
    blocks, threads = grid(t, shape[0])
    kernel.launch(blocks, threads,
                  [logits, bias, weights, ids, t, logits.stride(0), int(bool(renormalize)), float(routed_scaling_factor),
                   int(exact_only())], smem_bytes=split_smem_bytes(shape[0], shape[1], shape[3], threads),
                  pdl=PDL and _pdl())
    return weights, ids


def _aligned_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (the ``[T, E]`` logits, or the ``[E]`` bias), or a contiguous copy where a row is strided or
    not 16-byte aligned: the kernel loads each lane's logits (and bias) as vectors."""
    if (rows.stride(-1) == 1 and rows.data_ptr() % 16 == 0
            and (rows.dim() == 1 or rows.stride(0) * rows.element_size() % 16 == 0)):
        return rows
    return rows.clone(memory_format=torch.contiguous_format)


def exact_only() -> bool:
    """``MOE_FP8_ROUTING_EXACT=1``: every token takes the kernel's exact path (float64 scores for every expert)
    instead of the certified float32 estimate; the results are the same. For A/B measurements and tests."""
    return truthy(env("MOE_FP8_ROUTING_EXACT"))
