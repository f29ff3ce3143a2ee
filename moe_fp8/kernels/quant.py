"""Launch wrappers of the Hopper ``per_token_group_quant`` kernel (impls/token_group_quant.cuh), plain and fused with
SiLU·mul: 16-bit activations in groups of 128 columns, one persistent grid whose warps keep their next groups' loads
in flight.

It covers bf16 / fp16 inputs, contiguous, 16-byte aligned, with K a multiple of 128 and ``eps`` of at least
``MIN_EPS``, on the GPUs it was measured faster on (``DEVICES``); every other call goes to the Triton kernel, which
computes the same function (the quantization bit for bit; SiLU·mul up to the activation's last FP32 ulps).
"""

from __future__ import annotations

import functools

import torch

from ..utils import FP8_DTYPE, ceil_div, empty_scale_tma, get_num_sms, get_tma_aligned_m, is_scale_tma_layout
from .gemm import _pdl  # (MOE_FP8_PDL: the GEMMs' switch)
from .jit import build

KERNEL_TEMPLATE = """#include "moe_fp8/impls/token_group_quant.cuh"

__attribute__((unused)) static void instantiate() {{
    (void)&moe_fp8::quant::per_token_group_quant_kernel</*kBf16=*/{bf16}, /*kUe8m0=*/{ue8m0},
                                                        /*kLanesPerGroup=*/{lanes}, /*kThreads=*/{threads},
                                                        /*kSilu=*/{silu}>;
}}
"""
GROUP_SIZE = 128
# The kernel's exact division needs every residual that decides a code to be a normal float: scales of at
# least 2^-93, i.e. eps >= 2^-84 (the default is 1e-10).
MIN_EPS = 2.0**-84
# Lanes a group (a lane loads 256 / LANES_PER_GROUP bytes of it), threads a block, blocks an SM: the best launch of
# the H200 sweeps (scripts/ab_quant.py; docs/benchmarks/calibration/s56-quant-*.txt).
LANES_PER_GROUP = 8
THREADS = 1024
BLOCKS_PER_SM = 1
# SiLU·mul + quant: a lane holds its group's gate and up vectors (twice the registers: 8 lanes a group spill at
# 1024 threads, and their fp16 variant at 512, so fp16 stays on Triton). On the H200 it beat the Triton kernel's
# wide tiles by 9-33% from 4096 rows where a row's groups are not a power of two (I = 1536, 2304, 18432: GLM-4.5's
# shared expert, DeepSeek-V3's dense MLP and its TP-8 shard) and ran 0.88-1.02x as fast below; with a power of two
# (I = 2048: DeepSeek-V3's shared expert) within -4 / +1% (docs/benchmarks/calibration/s56-silu-h200.txt). Hence
# silu_takes.
SILU_LANES_PER_GROUP = 8
SILU_THREADS = 512
SILU_BLOCKS_PER_SM = 1
SILU_MIN_ROWS = 4096
# GPUs (torch.cuda.get_device_name, exactly) where the kernel was measured faster than the Triton one; elsewhere the
# Triton kernel runs (the H100's own picks, QUANT_TILE_ELEMS, came from its sweep; this kernel was not timed there).
DEVICES = ("NVIDIA H200",)


def launch_shape(silu: bool, lanes: int | None = None, threads: int | None = None,
                 blocks_per_sm: int | None = None) -> tuple[int, int, int]:
    """``(lanes a group, threads a block, blocks an SM)`` of a launch: the plain or the SiLU·mul form's shipped ones
    where a knob is None."""
    shipped = (SILU_LANES_PER_GROUP, SILU_THREADS, SILU_BLOCKS_PER_SM) if silu else (LANES_PER_GROUP, THREADS,
                                                                                     BLOCKS_PER_SM)
    return tuple(knob or default for knob, default in zip((lanes, threads, blocks_per_sm), shipped, strict=True))


def kernel_variant(dtype: torch.dtype, ue8m0: bool, lanes: int | None = None, threads: int | None = None,
                   silu: bool = False) -> tuple[str, str]:
    """``(name, source)`` of one specialization, as ``build`` takes them (``moe-fp8 warmup`` too); ``silu``: the
    fused SiLU·mul + quantization; ``lanes`` / ``threads``: as ``launch_shape`` resolves them."""
    lanes, threads, _ = launch_shape(silu, lanes, threads)
    bf16 = dtype == torch.bfloat16
    source = KERNEL_TEMPLATE.format(bf16=str(bf16).lower(), ue8m0=str(bool(ue8m0)).lower(), lanes=lanes,
                                    threads=threads, silu=str(bool(silu)).lower())
    name = f"token_group_quant{'_silu' if silu else ''}_{'bf16' if bf16 else 'f16'}{'_ue8m0' if ue8m0 else ''}"
    return f"{name}_l{lanes}_t{threads}", source


@functools.cache
def get_kernel(dtype: torch.dtype, ue8m0: bool, lanes: int, threads: int, silu: bool):
    return build(*kernel_variant(dtype, ue8m0, lanes, threads, silu))


def covers(shape: tuple[int, ...], dtype: torch.dtype, group_size: int, eps: float) -> bool:
    """Whether the kernel computes this call's function: 16-bit ``[M, K]`` / ``[G, M, K]`` inputs, whole groups of
    128, ``eps >= MIN_EPS``, fewer than 2^31 groups."""
    return (dtype in (torch.bfloat16, torch.float16) and group_size == GROUP_SIZE and len(shape) in (2, 3)
            and shape[-1] % GROUP_SIZE == 0 and shape[-1] > 0 and eps >= MIN_EPS
            and torch.Size(shape).numel() // GROUP_SIZE < 2**31)


@functools.cache
def measured_here(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) is one of ``DEVICES``, looked up once."""
    return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index) in DEVICES


def applies(x: torch.Tensor, group_size: int, eps: float, force: bool = False,
            shape: tuple[int, ...] | None = None) -> bool:
    """Whether the CUDA kernel takes the call (else the Triton kernel does): ``covers`` it (``shape``: the output's,
    default ``x``'s), ``x`` is contiguous and 16-byte aligned (the kernel loads 16-byte vectors), on one of
    ``DEVICES`` unless ``force``."""
    return (covers(tuple(x.shape) if shape is None else shape, x.dtype, group_size, eps) and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and (force or measured_here(x.device.index)))


def silu_takes(rows: int, kg: int) -> bool:
    """Whether SiLU·mul + quant of ``rows`` rows (all of them: ``G·M``) of ``kg`` output groups each runs the CUDA
    kernel (``SILU_MIN_ROWS``; a row's groups not a power of two)."""
    return rows >= SILU_MIN_ROWS and kg & (kg - 1) != 0


def grid(num_groups: int, lanes: int, threads: int, blocks_per_sm: int) -> tuple[int, int]:
    """``(blocks, threads)``: up to ``blocks_per_sm`` blocks an SM; fewer warps a block where the units would
    not reach every SM (small inputs are latency-bound: one unit a warp, spread)."""
    units = ceil_div(num_groups, 32 // lanes)
    sms = get_num_sms()
    warps = max(1, min(threads // 32, ceil_div(units, sms)))
    return max(1, min(sms * blocks_per_sm, ceil_div(units, warps))), 32 * warps


def per_token_group_quant_hopper(x: torch.Tensor, group_size: int, ue8m0: bool, eps: float, *,
                                 out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                                 lanes: int | None = None, threads: int | None = None,
                                 blocks_per_sm: int | None = None, force: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::per_token_group_quant`` on Hopper (see ``moe_fp8.ops``): the CUDA kernel where
    ``applies``, else the Triton one. ``out`` / ``out_scale``: written in place (``out_scale`` in the TMA layout);
    ``lanes`` / ``threads`` / ``blocks_per_sm`` / ``force`` (on any Hopper GPU): for tests and sweeps."""
    _check_cuda(x, "per_token_group_quant_hopper")
    if not applies(x, group_size, eps, force):
        from .triton.quant import per_token_group_quant

        return per_token_group_quant(x, group_size, ue8m0, eps, out=out, out_scale=out_scale)
    return _launch(x, x.shape[-1], ue8m0, eps, False, out, out_scale, lanes, threads, blocks_per_sm)


def silu_mul_per_token_group_quant_hopper(h: torch.Tensor, group_size: int, ue8m0: bool,
                                          masked_m: torch.Tensor | None, eps: float, *,
                                          out: torch.Tensor | None = None, out_scale: torch.Tensor | None = None,
                                          precise: bool = False, lanes: int | None = None,
                                          threads: int | None = None, blocks_per_sm: int | None = None,
                                          force: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::silu_mul_per_token_group_quant`` on Hopper: the CUDA kernel for every row of a bf16
    ``h [M, 2I]`` / ``[G, M, 2I]`` (``[gate | up]``, I a multiple of 128) where ``applies`` to ``h``'s halves and
    ``silu_takes`` its rows (``force``: any shape, on any Hopper GPU); masked buffers (``masked_m``), ``precise``
    (float64) calls and the rest go to the Triton kernel. The activation is FP32 from the MUFU exp2 / reciprocal (as
    the fused GEMM epilogue's), so its codes may differ from the Triton kernel's by one step where ``silu(g)·u`` lies
    within a few ulps of a rounding boundary; its quantization is exact."""
    _check_cuda(h, "silu_mul_per_token_group_quant_hopper")
    half = h.shape[-1] // 2 if h.dim() in (2, 3) else 0
    if (masked_m is not None or precise or h.dtype != torch.bfloat16 or h.shape[-1] % (2 * GROUP_SIZE)
            or not applies(h, group_size, eps, force, shape=(*h.shape[:-1], half))
            or not (force or silu_takes(h.numel() // max(h.shape[-1], 1), half // GROUP_SIZE))):
        from .triton.quant import silu_mul_per_token_group_quant

        return silu_mul_per_token_group_quant(h, group_size, ue8m0, masked_m, eps, out=out, out_scale=out_scale,
                                              precise=precise)
    return _launch(h, half, ue8m0, eps, True, out, out_scale, lanes, threads, blocks_per_sm)


def _check_cuda(x: torch.Tensor, what: str) -> None:
    if not x.is_cuda:
        raise ValueError(f"{what}: the input must be a CUDA tensor, got one on {x.device}")


def _launch(x: torch.Tensor, n_out: int, ue8m0: bool, eps: float, silu: bool, out: torch.Tensor | None,
            out_scale: torch.Tensor | None, lanes: int | None, threads: int | None, blocks_per_sm: int | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over every ``n_out``-column output row of ``x`` (``[..., n_out]`` codes, or of ``silu``'s halves),
    into ``out`` / ``out_scale`` (allocated, or checked); the knobs as ``launch_shape`` resolves them."""
    lanes, threads, blocks_per_sm = launch_shape(silu, lanes, threads, blocks_per_sm)
    shape = (*x.shape[:-1], n_out)
    rows = x.shape[-2]
    kg = n_out // GROUP_SIZE
    if out is None:
        out = torch.empty(shape, dtype=FP8_DTYPE, device=x.device)
    elif out.shape != shape or out.dtype != FP8_DTYPE or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous float8_e4m3fn {shape} on {x.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if out_scale is None:
        out_scale = empty_scale_tma(rows, kg, groups=x.shape[0] if x.dim() == 3 else None, device=x.device)
    elif (tuple(out_scale.shape) != (*shape[:-1], kg) or out_scale.dtype != torch.float32
            or not is_scale_tma_layout(out_scale) or out_scale.device != x.device):
        raise ValueError(f"out_scale must be float32 {(*shape[:-1], kg)} in the TMA layout (empty_scale_tma) on "
                         f"{x.device}, got {out_scale.dtype} {tuple(out_scale.shape)} strides {out_scale.stride()}")
    num_groups = out.numel() // GROUP_SIZE
    if num_groups == 0:
        return out, out_scale
    blocks, block_threads = grid(num_groups, lanes, threads, blocks_per_sm)
    # (the tensors go as their pointers: the kernel reads x's and writes out's bytes)
    get_kernel(x.dtype, ue8m0, lanes, threads, silu).launch(
        blocks, block_threads, [x, out, out_scale, num_groups, kg, max(rows, 1), get_tma_aligned_m(rows), float(eps)],
        pdl=_pdl())
    return out, out_scale
