"""Every ``torch.library`` registration of moe_fp8, and the public wrappers around them (STYLE practice 7).

Three layers per op:

1. **Public wrapper** (``fp8_gemm`` … here; re-exported by ``moe_fp8``, ``moe_fp8.quant``,
   ``moe_fp8.layers``): validates with ``moe_fp8.validation``, allocates ``out`` if None, then
   - eager (``torch.compiler.is_compiling()`` false): calls the dispatching implementation directly —
     the fast path, no dispatcher round trip (the eager launch budget is 10 µs);
   - compiling: calls ``torch.ops.moe_fp8.<op>`` so the graph holds one opaque op with a fake impl.
2. **Custom op** ``moe_fp8::<op>`` (``torch.library.custom_op``). GEMMs are destination-passing:
   ``mutates_args=("out",)``, return nothing, and their fake does nothing. Ops that create their
   outputs (quantization, routing, masked dispatch, combine) have fakes that allocate exactly what
   the real op returns — including the TMA scale strides, through ``moe_fp8.utils.empty_scale_tma``,
   the single definition of that layout.
3. **Dispatching implementation** (``_<op>_impl``): picks ``(backend, fn)`` with
   ``moe_fp8.backends.select`` (cached) and calls ``fn``. Backend calling conventions:

   ================================  ================================================================
   op                                backend fn
   ================================  ================================================================
   fp8_gemm                          fn(x_fp8, x_scale, w, w_scale, out) -> None
   fp8_grouped_gemm_contiguous       fn(x_fp8, x_scale, w, w_scale, m_indices, out, *, m_total=None,
                                        expected_m=None) -> None (each keyword passed only when given)
   fp8_grouped_gemm_masked           fn(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out) -> None
   fp8_grouped_gemm_silu_mul_quant   fn(x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, expected_m,
                                        ue8m0, out, out_scale, *, m_total=None) -> None (one of
                                        m_indices / masked_m; m_total passed only when given;
                                        expected_m 0: no hint, contiguous)
   per_token_group_quant             fn(x, group_size, ue8m0, eps) -> (x_fp8, x_scale[TMA layout])
   per_block_quant                   fn(w, block, ue8m0, eps) -> (w_fp8, w_scale)
   silu_mul_per_token_group_quant    fn(h, group_size, ue8m0, masked_m, eps, *, out=None, out_scale=None)
                                        -> (y_fp8, y_scale[TMA]); writes into out / out_scale when given
   select_experts                    fn(logits, top_k, scoring_func, renormalize, n_group,
                                        topk_group, e_score_correction_bias, routed_scaling_factor)
                                        -> (topk_weights f32, topk_ids i32)
   router_gemm                       fn(x, weight) -> logits f32 [T, E]
   dispatch_contiguous               fn(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m,
                                        *, sync=True, return_m_total=False)
                                        -> (out_fp8, out_scale[TMA], m_indices i32, row_map i64
                                            [, m_total i32 [1] on the device])
   dispatch_masked                   fn(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map, *,
                                        out=None, out_scale=None)
                                        -> (out_fp8, out_scale[TMA 3-D], masked_m i32, row_map i64)
   quant_dispatch_contiguous         fn(x, topk_ids, num_experts, expert_map, align_m, ue8m0, eps, *,
                                        sync=True, return_x=True, return_m_total=False)
                                        -> (x_fp8, x_scale[TMA], out_fp8, out_scale[TMA], m_indices,
                                            row_map[, m_total]): per_token_group_quant (group 128) then
                                            dispatch_contiguous; x_fp8 / x_scale None when not
                                            return_x
   quant_dispatch_masked             fn(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, *,
                                        out=None, out_scale=None)
                                        -> (x_fp8, x_scale[TMA], out_fp8, out_scale[TMA 3-D], masked_m,
                                            row_map): per_token_group_quant (group 128) then dispatch_masked
   combine                           fn(y, row_map, topk_weights, shared_output) -> bf16 [T, H]
   ================================  ================================================================

   Implementations receive validated arguments; empty problems (no rows) never reach them. The
   ``out`` / ``out_scale`` keywords are passed only when a caller gives destinations (so a backend
   that cannot take them still serves every call without them).

Destinations of the functional ops. ``silu_mul_per_token_group_quant``, ``dispatch_masked`` and
``quant_dispatch_masked`` also
take optional ``out=`` / ``out_scale=`` (the layer's persistent decode workspaces, so a captured CUDA
graph holds no per-call ``[E, max_m, ·]`` buffer); with either given, compiled code calls a separate
destination-passing op (``moe_fp8::<op>_out``, ``mutates_args=("out", "out_scale")``) whose fake
returns only the tensors it creates.

``dispatch_contiguous`` (and ``quant_dispatch_contiguous``) is deliberately *not* a custom op: its
output row count ``M_total = Σ_e align(count_e, 128)`` depends on the routing data, so a fake could
not give its shape from input shapes (it would need an unbacked SymInt, and eager needs a host sync to
size the buffers anyway). It is a plain function hidden from the compiler (``torch.compiler.disable``): under
``torch.compile`` it is a graph break, and ``fullgraph=True`` refuses it — use ``dispatch_masked``
(fixed size, no sync) inside compiled regions and CUDA graphs.
"""

from __future__ import annotations

import torch

from moe_fp8 import backends, reference
from moe_fp8 import validation as V
from moe_fp8.utils import GROUP_K, ceil_div, empty_scale_tma, get_align_m

Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn
_BF16 = torch.bfloat16
_DEFAULT_EPS = 1e-10

__all__ = [
    "combine",
    "dispatch_contiguous",
    "dispatch_masked",
    "fp8_gemm",
    "fp8_grouped_gemm_contiguous",
    "fp8_grouped_gemm_masked",
    "fp8_grouped_gemm_silu_mul_quant",
    "per_block_quant",
    "per_token_group_quant",
    "quant_dispatch_contiguous",
    "quant_dispatch_masked",
    "router_gemm",
    "select_experts",
    "silu_mul_per_token_group_quant",
]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


# ============================================================================================
# Output allocation shared by fakes and the empty-problem paths (one definition of each layout)
# ============================================================================================

def _alloc_act_quant(shape: tuple, group_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """FP8 ``shape`` contiguous + FP32 scales ``[..., M, ceil(K/group_size)]`` in the TMA layout."""
    kg = ceil_div(shape[-1], group_size)
    x_fp8 = torch.empty(shape, dtype=_FP8, device=device)
    if len(shape) == 2:
        return x_fp8, empty_scale_tma(shape[0], kg, device=device)
    return x_fp8, empty_scale_tma(shape[1], kg, groups=shape[0], device=device)


def _alloc_block_quant(shape: tuple, block: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor]:
    bn, bk = block
    n, k = shape[-2:]
    w_fp8 = torch.empty(shape, dtype=_FP8, device=device)
    w_scale = torch.empty((*shape[:-2], ceil_div(n, bn), ceil_div(k, bk)), dtype=torch.float32, device=device)
    return w_fp8, w_scale


# ============================================================================================
# Reference backend adapters (reference functions return new tensors; GEMM ops write into out)
# ============================================================================================

def _ref_fp8_gemm(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out: Tensor) -> None:
    out.copy_(reference.fp8_gemm(x_fp8, x_scale, w, w_scale))


def _ref_grouped_contiguous(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                            m_indices: Tensor, out: Tensor, *, m_total: Tensor | None = None,
                            expected_m: int | None = None) -> None:
    if m_total is not None:  # rows from m_total on are padding (on the device: no sync)
        rows = torch.arange(m_indices.shape[0], device=m_indices.device)
        m_indices = torch.where(rows < m_total, m_indices, -1)
    reference.fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out=out)


def _ref_grouped_masked(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, masked_m: Tensor,
                        expected_m: int, out: Tensor) -> None:
    reference.fp8_grouped_gemm_masked(x_fp8, x_scale, w, w_scale, masked_m, out=out)


def _ref_per_block_quant(w: Tensor, block: tuple[int, int], ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    return reference.per_block_quant(w, tuple(block), ue8m0=ue8m0, eps=eps)


def _into(res: tuple[Tensor, ...], out: Tensor | None, out_scale: Tensor | None) -> tuple[Tensor, ...]:
    """Reference results copied into caller-given destinations (the reference computes new tensors)."""
    if out is not None:
        out.copy_(res[0])
    if out_scale is not None:
        out_scale.copy_(res[1])
    return (res[0] if out is None else out, res[1] if out_scale is None else out_scale, *res[2:])


def _ref_silu_mul_quant(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None, eps: float, *,
                        out: Tensor | None = None, out_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    res = reference.silu_mul_per_token_group_quant(h, group_size, ue8m0, masked_m, eps=eps)
    if masked_m is not None:
        # rows from masked_m on keep what the caller's destinations hold (selected on the device: no sync)
        valid = (torch.arange(h.shape[-2], device=h.device) < masked_m[:, None]).view(*h.shape[:-2], -1, 1)

        def keep_past(r: Tensor, dst: Tensor | None) -> Tensor:
            if dst is None:
                return r
            bits = torch.uint8 if r.dtype == _FP8 else r.dtype  # (no torch.where on FP8)
            return torch.where(valid, r.view(bits), dst.view(bits)).view(r.dtype)

        res = (keep_past(res[0], out), keep_past(res[1], out_scale))
    return _into(res, out, out_scale)


def _ref_select_experts(router_logits: Tensor, top_k: int, scoring_func: str, renormalize: bool,
                        n_group: int | None, topk_group: int | None, e_score_correction_bias: Tensor | None,
                        routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return reference.select_experts(
        router_logits, top_k, scoring_func=scoring_func, renormalize=renormalize, n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
        routed_scaling_factor=routed_scaling_factor)


def _ref_dispatch_masked(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                         expert_map: Tensor | None, *, out: Tensor | None = None,
                         out_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _into(reference.dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map), out,
                 out_scale)


def _ref_quant_dispatch_masked(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                               expert_map: Tensor | None, ue8m0: bool, eps: float, *, out: Tensor | None = None,
                               out_scale: Tensor | None = None) -> tuple[Tensor, ...]:
    # no fused reference: the definition is the two ops one after the other
    x_fp8, x_scale = reference.per_token_group_quant(x, GROUP_K, ue8m0, eps)
    return (x_fp8, x_scale, *_ref_dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map,
                                                  out=out, out_scale=out_scale))


def _ref_dispatch_contiguous(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int,
                             expert_map: Tensor | None, align_m: int, *, sync: bool = True,
                             return_m_total: bool = False) -> tuple[Tensor, ...]:
    if not sync:  # invalid ids are not local (the reference would raise): route them to a sentinel expert
        local = reference._local_expert_ids(topk_ids, num_experts, expert_map).view(topk_ids.shape)
        topk_ids = torch.where(local >= 0, local, num_experts)
        expert_map = torch.arange(-1, num_experts, dtype=torch.int32, device=x_fp8.device).roll(-1)
    out = reference.dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m)
    if return_m_total:
        out = (*out, torch.tensor([out[0].shape[0]], dtype=torch.int32, device=x_fp8.device))
    if sync:
        return out
    # sync=False: the same layout padded to the documented upper bound (padding rows m_indices = -1)
    t, top_k = topk_ids.shape
    rows = ceil_div(t * top_k + num_experts * (align_m - 1), align_m) * align_m
    a, a_scale, m_indices, row_map = out[:4]
    extra = rows - a.shape[0]
    a = torch.cat([a, torch.zeros((extra, a.shape[1]), dtype=a.dtype, device=a.device)])
    scale = empty_scale_tma(rows, a_scale.shape[1], device=a.device)
    scale.fill_(1.0)
    scale[: a_scale.shape[0]] = a_scale
    m_indices = torch.cat([m_indices, m_indices.new_full((extra,), -1)])
    return a, scale, m_indices, row_map, *out[4:]


def _ref_quant_dispatch_contiguous(x: Tensor, topk_ids: Tensor, num_experts: int, expert_map: Tensor | None,
                                   align_m: int, ue8m0: bool, eps: float, *, sync: bool = True,
                                   return_x: bool = True, return_m_total: bool = False) -> tuple[Tensor | None, ...]:
    x_fp8, x_scale = reference.per_token_group_quant(x, GROUP_K, ue8m0, eps)
    routed = _ref_dispatch_contiguous(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync=sync,
                                      return_m_total=return_m_total)
    return (x_fp8, x_scale, *routed) if return_x else (None, None, *routed)


def _composed_grouped_silu_quant(x_fp8: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor,
                                 m_indices: Tensor | None, masked_m: Tensor | None, expected_m: int, ue8m0: bool,
                                 out: Tensor, out_scale: Tensor, *, m_total: Tensor | None = None) -> None:
    # no fused kernel: the grouped GEMM (bf16 h) then SiLU·mul + quant, each on its own backend
    if masked_m is None:
        h = fp8_grouped_gemm_contiguous(x_fp8, x_scale, w13, w13_scale, m_indices, m_total=m_total,
                                        expected_m=expected_m or None)
        masked_m = m_total  # (None, or the 2-D row count: rows from it on stay untouched)
    else:
        h = fp8_grouped_gemm_masked(x_fp8, x_scale, w13, w13_scale, masked_m, expected_m)
    silu_mul_per_token_group_quant(h, GROUP_K, ue8m0, masked_m, out=out, out_scale=out_scale)


_REFERENCE_IMPLS = {
    "fp8_gemm": _ref_fp8_gemm,
    "fp8_grouped_gemm_contiguous": _ref_grouped_contiguous,
    "fp8_grouped_gemm_masked": _ref_grouped_masked,
    "per_token_group_quant": reference.per_token_group_quant,
    "per_block_quant": _ref_per_block_quant,
    "silu_mul_per_token_group_quant": _ref_silu_mul_quant,
    "select_experts": _ref_select_experts,
    "router_gemm": reference.router_gemm,
    "dispatch_contiguous": _ref_dispatch_contiguous,
    "dispatch_masked": _ref_dispatch_masked,
    "quant_dispatch_contiguous": _ref_quant_dispatch_contiguous,
    "quant_dispatch_masked": _ref_quant_dispatch_masked,
    "combine": reference.combine,
    "fp8_grouped_gemm_silu_mul_quant": _composed_grouped_silu_quant,
}
# Hopper kernels, imported lazily (only once a CUDA sm_90 device and a compiler are present). Add a
# line here when a kernel lands; ops without one fall back (logged; an error under MOE_FP8_STRICT=1).
_HOPPER_IMPLS = {
    "fp8_gemm": "moe_fp8.kernels.gemm:fp8_gemm_hopper",
    "fp8_grouped_gemm_contiguous": "moe_fp8.kernels.gemm:fp8_grouped_gemm_contiguous_hopper",
    "fp8_grouped_gemm_masked": "moe_fp8.kernels.gemm:fp8_grouped_gemm_masked_hopper",
    "fp8_grouped_gemm_silu_mul_quant": "moe_fp8.kernels.gemm:fp8_grouped_gemm_silu_mul_quant_hopper",
    "select_experts": "moe_fp8.kernels.routing:select_experts_hopper",  # (the Triton kernel outside its cases)
    "router_gemm": "moe_fp8.kernels.router_gemm:router_gemm_hopper",  # (cuBLAS outside its cases)
    "dispatch_contiguous": "moe_fp8.kernels.dispatch:dispatch_contiguous_hopper",  # (Triton routing + a CUDA mover)
    "dispatch_masked": "moe_fp8.kernels.dispatch:dispatch_masked_hopper",
    "quant_dispatch_contiguous": "moe_fp8.kernels.dispatch:quant_dispatch_contiguous_hopper",  # (Triton + our routing)
    "quant_dispatch_masked": "moe_fp8.kernels.dispatch:quant_dispatch_masked_hopper",
    "per_token_group_quant": "moe_fp8.kernels.quant:per_token_group_quant_hopper",  # (Triton outside its cases)
    "silu_mul_per_token_group_quant": "moe_fp8.kernels.quant:silu_mul_per_token_group_quant_hopper",  # (the same)
}
# Triton kernels of the MoE data path (moe_fp8.kernels.triton): the portable backend's implementation
# and, on Hopper, the hopper backend's too where it has no CUDA-C kernel (these memory-bound ops reach
# the same bandwidth in Triton; routing does not). Lazy, so a CPU-only machine never imports Triton.
_TRITON_IMPLS = {
    "per_token_group_quant": "moe_fp8.kernels.triton.quant:per_token_group_quant",
    "silu_mul_per_token_group_quant": "moe_fp8.kernels.triton.quant:silu_mul_per_token_group_quant",
    "select_experts": "moe_fp8.kernels.triton.routing:select_experts",
    "dispatch_contiguous": "moe_fp8.kernels.triton.dispatch:dispatch_contiguous",
    "dispatch_masked": "moe_fp8.kernels.triton.dispatch:dispatch_masked",
    "quant_dispatch_contiguous": "moe_fp8.kernels.triton.dispatch:quant_dispatch_contiguous",
    "quant_dispatch_masked": "moe_fp8.kernels.triton.dispatch:quant_dispatch_masked",
    "combine": "moe_fp8.kernels.triton.dispatch:combine",
    "router_gemm": "moe_fp8.kernels.router_gemm:router_gemm_cublas",  # (not Triton: cuBLAS)
}
for _op, _fn in _REFERENCE_IMPLS.items():
    backends.register(_op, "reference", _fn)
for _op, _fn in _HOPPER_IMPLS.items():
    backends.register(_op, "hopper", _fn)
for _op, _fn in _TRITON_IMPLS.items():
    backends.register(_op, "portable", _fn)
    if _op not in _HOPPER_IMPLS:
        backends.register(_op, "hopper", _fn)
backends.register("fp8_grouped_gemm_silu_mul_quant", "portable", _composed_grouped_silu_quant)
del _op, _fn


# ============================================================================================
# GEMMs (destination passing)
# ============================================================================================

def _fp8_gemm_impl(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out: Tensor) -> None:
    if out.numel() == 0:
        return
    backends.select("fp8_gemm", x_fp8.device)[1](x_fp8, x_scale, w, w_scale, out)


@torch.library.custom_op("moe_fp8::fp8_gemm", mutates_args=("out",))
def _fp8_gemm_op(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out: Tensor) -> None:
    _fp8_gemm_impl(x_fp8, x_scale, w, w_scale, out)


@_fp8_gemm_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out: Tensor) -> None:
    return None


def fp8_gemm(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, out: Tensor | None = None) -> Tensor:
    """Block-scaled FP8 GEMM: ``out[M, N] (bf16) = (x_fp8·x_scale) @ (w·w_scale)ᵀ``, FP32 accumulation.

    Args:
        x_fp8: ``float8_e4m3fn [M, K]``, contiguous (row-major). ``K`` a positive multiple of 16
            (need not be a multiple of 128: the last scale group is partial). ``M`` may be 0.
        x_scale: ``float32 [M, ceil(K/128)]``, one scale per token per 128 columns, in the TMA layout
            (column-major, M padded to a multiple of 4: ``moe_fp8.utils.empty_scale_tma``; as returned
            by ``moe_fp8.quant.per_token_group``). Other layouts are refused, never copied silently:
            convert with ``moe_fp8.utils.to_scale_tma_layout``.
        w: ``float8_e4m3fn [N, K]`` contiguous ("NT": the weight as stored, ``y = x @ wᵀ``);
            ``N`` a positive multiple of 8 on every backend (16-byte bf16 output rows).
        w_scale: ``float32 [ceil(N/128), ceil(K/128)]`` contiguous (DeepSeek's ``weight_scale_inv``).
        out: optional ``bfloat16 [M, N]`` contiguous to write into; allocated when None.

    All tensors on one device; FP8 / output tensors start 16-byte aligned. Returns ``out``.
    Raises ``TypeError`` (types, dtypes) or ``ValueError`` (shapes, strides, alignment, device).
    """
    m, n, _ = V.check_fp8_gemm(x_fp8, x_scale, w, w_scale, out)
    if out is None:
        out = torch.empty((m, n), dtype=_BF16, device=x_fp8.device)
    if _compiling():
        torch.ops.moe_fp8.fp8_gemm(x_fp8, x_scale, w, w_scale, out)
    else:
        _fp8_gemm_impl(x_fp8, x_scale, w, w_scale, out)
    return out


def _changed(**values: tuple[object, object]) -> dict[str, object]:
    """The keywords whose value differs from its default (``name=(value, default)``; a None default: any
    value given): a backend that does not know an option still serves every call that leaves it alone."""
    return {k: v for k, (v, default) in values.items()
            if not (v is default or (default is not None and v == default))}


def _grouped_contiguous_impl(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, m_indices: Tensor,
                             out: Tensor, m_total: Tensor | None = None, expected_m: int = 0) -> None:
    if out.numel() == 0:
        return
    backends.select("fp8_grouped_gemm_contiguous", x_fp8.device)[1](
        x_fp8, x_scale, w, w_scale, m_indices, out,
        **_changed(m_total=(m_total, None), expected_m=(expected_m or None, None)))


@torch.library.custom_op("moe_fp8::fp8_grouped_gemm_contiguous", mutates_args=("out",))
def _grouped_contiguous_op(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, m_indices: Tensor,
                           out: Tensor, m_total: Tensor | None = None, expected_m: int = 0) -> None:
    _grouped_contiguous_impl(x_fp8, x_scale, w, w_scale, m_indices, out, m_total, expected_m)


@_grouped_contiguous_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, m_indices: Tensor, out: Tensor,
      m_total: Tensor | None = None, expected_m: int = 0) -> None:
    return None


def fp8_grouped_gemm_contiguous(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor,
                                m_indices: Tensor, out: Tensor | None = None, *,
                                m_total: Tensor | None = None, expected_m: int | None = None) -> Tensor:
    """Grouped FP8 GEMM, contiguous layout (prefill): row ``r`` uses group ``m_indices[r]``.

    Args:
        x_fp8: ``float8_e4m3fn [M_total, K]`` contiguous; each group's rows form one segment padded to a
            multiple of ``moe_fp8.get_align_m()`` (128), so ``M_total % 128 == 0``
            (``moe_fp8.layers.dispatch_contiguous`` builds this layout). ``K % 16 == 0``.
        x_scale: ``float32 [M_total, ceil(K/128)]`` in the TMA layout.
        w: ``float8_e4m3fn [G, N, K]`` contiguous, ``N % 8 == 0``.
        w_scale: ``float32 [G, ceil(N/128), ceil(K/128)]`` contiguous.
        m_indices: ``int32 [M_total]`` on x's device: group id per row, ``-1`` for padding rows
            (their output rows are unspecified).
        out: optional ``bfloat16 [M_total, N]`` contiguous.
        m_total: optional ``int32 [1]`` on x's device (never read on the host): every row from
            ``m_total[0]`` on is padding, whatever ``m_indices`` says there. The row count of a
            sync-free dispatch (``dispatch_contiguous(sync=False, return_m_total=True)``), whose layout
            is sized by an upper bound: the kernel reads it on the device and never visits those rows.
        expected_m: optional positive host int, the rows per group the caller expects (a sync-free
            prefill's ``T·top_k / E``): a hint for the kernel configuration, where ``M_total`` (an upper
            bound there) says little; it may change speed, never the result.

    Returns ``out``.
    """
    _, m, n, _ = V.check_fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out, m_total,
                                                     expected_m)
    if out is None:
        out = torch.empty((m, n), dtype=_BF16, device=x_fp8.device)
    hint = 0 if expected_m is None else expected_m
    if _compiling():
        torch.ops.moe_fp8.fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices, out, m_total, hint)
    else:
        _grouped_contiguous_impl(x_fp8, x_scale, w, w_scale, m_indices, out, m_total, hint)
    return out


def _grouped_masked_impl(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, masked_m: Tensor,
                         expected_m: int, out: Tensor) -> None:
    if out.numel() == 0:
        return
    backends.select("fp8_grouped_gemm_masked", x_fp8.device)[1](
        x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)


@torch.library.custom_op("moe_fp8::fp8_grouped_gemm_masked", mutates_args=("out",))
def _grouped_masked_op(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, masked_m: Tensor,
                       expected_m: int, out: Tensor) -> None:
    _grouped_masked_impl(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)


@_grouped_masked_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, masked_m: Tensor, expected_m: int,
      out: Tensor) -> None:
    return None


def fp8_grouped_gemm_masked(x_fp8: Tensor, x_scale: Tensor, w: Tensor, w_scale: Tensor, masked_m: Tensor,
                            expected_m: int, out: Tensor | None = None) -> Tensor:
    """Grouped FP8 GEMM, masked layout (decode; CUDA-graph safe, no host sync).

    Args:
        x_fp8: ``float8_e4m3fn [G, max_m, K]`` contiguous, ``K % 16 == 0``.
        x_scale: ``float32 [G, max_m, ceil(K/128)]`` in the 3-D TMA layout
            (``empty_scale_tma(max_m, KG, groups=G)``).
        w: ``float8_e4m3fn [G, N, K]`` contiguous, ``N % 8 == 0``; w_scale ``float32 [G, ceil(N/128), ceil(K/128)]``.
        masked_m: ``int32 [G]`` on x's device: valid rows of each group. Never read on the host, so it is
            not range-checked here: values must lie in ``[0, max_m]``.
        expected_m: positive host int, the rows per group the caller expects: a hint for the kernel and its
            configuration (small groups expected to hold a few rows take the few-rows GEMM whatever ``max_m``);
            it may change speed, never the result.
        out: optional ``bfloat16 [G, max_m, N]`` contiguous. Rows ``r >= masked_m[g]`` are not written
            (when ``out`` is None they hold whatever ``torch.empty`` gave).

    Returns ``out``.
    """
    g, max_m, n, _ = V.check_fp8_grouped_gemm_masked(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)
    if out is None:
        out = torch.empty((g, max_m, n), dtype=_BF16, device=x_fp8.device)
    if _compiling():
        torch.ops.moe_fp8.fp8_grouped_gemm_masked(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)
    else:
        _grouped_masked_impl(x_fp8, x_scale, w, w_scale, masked_m, expected_m, out)
    return out


def _grouped_silu_quant_impl(x_fp8: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor,
                             m_indices: Tensor | None, masked_m: Tensor | None, expected_m: int, ue8m0: bool,
                             out: Tensor, out_scale: Tensor, m_total: Tensor | None = None) -> None:
    if out.numel() == 0:
        return
    backends.select("fp8_grouped_gemm_silu_mul_quant", x_fp8.device)[1](
        x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, expected_m, ue8m0, out, out_scale,
        **_changed(m_total=(m_total, None)))


@torch.library.custom_op("moe_fp8::fp8_grouped_gemm_silu_mul_quant", mutates_args=("out", "out_scale"))
def _grouped_silu_quant_op(x_fp8: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor,
                           m_indices: Tensor | None, masked_m: Tensor | None, expected_m: int, ue8m0: bool,
                           out: Tensor, out_scale: Tensor, m_total: Tensor | None = None) -> None:
    _grouped_silu_quant_impl(x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, expected_m, ue8m0, out, out_scale,
                             m_total)


@_grouped_silu_quant_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor, m_indices: Tensor | None,
      masked_m: Tensor | None, expected_m: int, ue8m0: bool, out: Tensor, out_scale: Tensor,
      m_total: Tensor | None = None) -> None:
    return None


def fp8_grouped_gemm_silu_mul_quant(x_fp8: Tensor, x_scale: Tensor, w13: Tensor, w13_scale: Tensor, *,
                                    m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                                    expected_m: int | None = None, ue8m0: bool = False,
                                    out: Tensor | None = None, out_scale: Tensor | None = None,
                                    m_total: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """An expert's first GEMM and its activation: ``silu_mul_per_token_group_quant`` of the grouped GEMM
    ``h = x @ w13[g]ᵀ``, fused on Hopper (the quantisation runs in the GEMM's epilogue on the FP32
    product; ``h`` is never written, nor rounded to bf16 first); elsewhere the two ops in turn. Masked
    batches of a few rows a group (decode, or small groups expected to hold few; ``kernels/few_rows.py``) run
    the few-rows GEMM, which writes ``h`` in FP32 (not rounded either), then the SiLU·mul + quant kernel on it.

    Args:
        x_fp8, x_scale, m_indices (and the optional hint expected_m): as ``fp8_grouped_gemm_contiguous``
            (contiguous layout), or x_fp8, x_scale, masked_m, expected_m as ``fp8_grouped_gemm_masked``
            (masked layout): exactly one of ``m_indices`` / ``masked_m``.
        w13: ``float8_e4m3fn [G, 2I, K]`` = ``[gate; up]`` (DeepSeek-V3's fused ``gate_up_proj``),
            ``2I`` a multiple of 256; ``w13_scale`` ``float32 [G, 2I/128, ceil(K/128)]``.
        ue8m0: power-of-two activation scales.
        out, out_scale: optional destinations, ``float8_e4m3fn [..., I]`` contiguous and ``float32
            [..., I/128]`` in the TMA layout.
        m_total: contiguous layout only, as ``fp8_grouped_gemm_contiguous``'s: every row from ``m_total[0]``
            on is padding (the row count of a sync-free dispatch, read on the device); those output rows
            are not written.

    Returns ``(act_fp8 [..., I], act_scale [..., I/128])`` (``out`` / ``out_scale`` when given): what the
    second GEMM reads. Padding rows (contiguous) and rows past ``masked_m`` are unspecified.
    """
    _, i = V.check_fp8_grouped_gemm_silu_mul_quant(x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, expected_m,
                                                   ue8m0, out, out_scale, m_total)
    shape = (*x_fp8.shape[:-1], i)
    if out is None or out_scale is None:
        alloc = _alloc_act_quant(shape, GROUP_K, x_fp8.device)
        out, out_scale = (alloc[0] if out is None else out), (alloc[1] if out_scale is None else out_scale)
    hint = 0 if expected_m is None else expected_m
    if _compiling():
        torch.ops.moe_fp8.fp8_grouped_gemm_silu_mul_quant(x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, hint,
                                                          ue8m0, out, out_scale, m_total)
    else:
        _grouped_silu_quant_impl(x_fp8, x_scale, w13, w13_scale, m_indices, masked_m, hint, ue8m0, out, out_scale,
                                 m_total)
    return out, out_scale


# ============================================================================================
# Quantization (functional: returns new tensors)
# ============================================================================================

def _per_token_group_quant_impl(x: Tensor, group_size: int, ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        return _alloc_act_quant(tuple(x.shape), group_size, x.device)
    return backends.select("per_token_group_quant", x.device)[1](x, group_size, ue8m0, eps)


@torch.library.custom_op("moe_fp8::per_token_group_quant", mutates_args=())
def _per_token_group_quant_op(x: Tensor, group_size: int, ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    return _per_token_group_quant_impl(x, group_size, ue8m0, eps)


@_per_token_group_quant_op.register_fake
def _(x: Tensor, group_size: int, ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    return _alloc_act_quant(tuple(x.shape), group_size, x.device)


def per_token_group_quant(x: Tensor, group_size: int = GROUP_K, ue8m0: bool = False,
                          eps: float = _DEFAULT_EPS) -> tuple[Tensor, Tensor]:
    """Quantize activations per token per ``group_size`` columns: ``scale = max(amax, eps) / 448``.

    Args:
        x: ``[M, K]`` or ``[G, M, K]`` bf16/fp16/fp32, contiguous; ``K`` a positive multiple of 16.
        group_size: columns per scale, a positive multiple of 16 (the GEMMs consume 128); the last
            group may be partial.
        ue8m0: round each scale up to a power of two.
        eps: lower bound on a group's amax (> 0).

    Returns ``(x_fp8, x_scale)``: ``float8_e4m3fn`` of ``x``'s shape (contiguous) and ``float32
    [..., M, ceil(K/group_size)]`` in the TMA layout the GEMMs read.
    """
    V.check_per_token_group(x, group_size, ue8m0, eps)
    if _compiling():
        return torch.ops.moe_fp8.per_token_group_quant(x, group_size, ue8m0, eps)
    return _per_token_group_quant_impl(x, group_size, ue8m0, eps)


def _per_block_quant_impl(w: Tensor, block: tuple[int, int], ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    if w.numel() == 0:
        return _alloc_block_quant(tuple(w.shape), block, w.device)
    return backends.select("per_block_quant", w.device)[1](w, block, ue8m0, eps)


@torch.library.custom_op("moe_fp8::per_block_quant", mutates_args=())
def _per_block_quant_op(w: Tensor, block: list[int], ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    return _per_block_quant_impl(w, (block[0], block[1]), ue8m0, eps)


@_per_block_quant_op.register_fake
def _(w: Tensor, block: list[int], ue8m0: bool, eps: float) -> tuple[Tensor, Tensor]:
    return _alloc_block_quant(tuple(w.shape), (block[0], block[1]), w.device)


def per_block_quant(w: Tensor, block: tuple[int, int] = (GROUP_K, GROUP_K), ue8m0: bool = False,
                    eps: float = _DEFAULT_EPS) -> tuple[Tensor, Tensor]:
    """Quantize weights per ``block = (bn, bk)`` tile (DeepSeek ``weight`` + ``weight_scale_inv``).

    Args:
        w: ``[N, K]`` or ``[G, N, K]`` bf16/fp16/fp32, contiguous; N, K may be ragged.
        block: two positive ints; ``(128, 128)`` is what the GEMMs read.
        ue8m0: round each scale up to a power of two. eps: lower bound on a block's amax.

    Returns ``(w_fp8, w_scale)``: ``float8_e4m3fn`` of ``w``'s shape and ``float32
    [..., ceil(N/bn), ceil(K/bk)]``, both contiguous.
    """
    block = V.check_per_block(w, block)
    V.check_bool("ue8m0", ue8m0)
    V.check_eps(eps)
    if _compiling():
        return torch.ops.moe_fp8.per_block_quant(w, list(block), ue8m0, eps)
    return _per_block_quant_impl(w, block, ue8m0, eps)


def _silu_mul_quant_impl(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None, eps: float,
                         out: Tensor | None = None, out_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if h.numel() == 0:
        alloc = _alloc_act_quant((*h.shape[:-1], h.shape[-1] // 2), group_size, h.device)
        return (alloc[0] if out is None else out, alloc[1] if out_scale is None else out_scale)
    fn = backends.select("silu_mul_per_token_group_quant", h.device)[1]
    if out is None and out_scale is None:
        return fn(h, group_size, ue8m0, masked_m, eps)
    return fn(h, group_size, ue8m0, masked_m, eps, out=out, out_scale=out_scale)


@torch.library.custom_op("moe_fp8::silu_mul_per_token_group_quant", mutates_args=())
def _silu_mul_quant_op(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None,
                       eps: float) -> tuple[Tensor, Tensor]:
    return _silu_mul_quant_impl(h, group_size, ue8m0, masked_m, eps)


@_silu_mul_quant_op.register_fake
def _(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    return _alloc_act_quant((*h.shape[:-1], h.shape[-1] // 2), group_size, h.device)


@torch.library.custom_op("moe_fp8::silu_mul_per_token_group_quant_out", mutates_args=("out", "out_scale"))
def _silu_mul_quant_out_op(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None, eps: float,
                           out: Tensor, out_scale: Tensor) -> None:
    _silu_mul_quant_impl(h, group_size, ue8m0, masked_m, eps, out, out_scale)


@_silu_mul_quant_out_op.register_fake
def _(h: Tensor, group_size: int, ue8m0: bool, masked_m: Tensor | None, eps: float, out: Tensor,
      out_scale: Tensor) -> None:
    return None


def silu_mul_per_token_group_quant(h: Tensor, group_size: int = GROUP_K, ue8m0: bool = False,
                                   masked_m: Tensor | None = None, eps: float = _DEFAULT_EPS, *,
                                   out: Tensor | None = None,
                                   out_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fused ``per_token_group_quant(silu(gate) · up)`` between the two expert GEMMs.

    Args:
        h: ``[M, 2I]`` (contiguous layout) or ``[G, max_m, 2I]`` (masked layout), bf16/fp16/fp32,
            contiguous, ``[gate | up]`` (gate = first I columns); ``I`` a positive multiple of 16.
        group_size, ue8m0, eps: as ``per_token_group_quant``.
        masked_m: optional ``int32 [G]`` on h's device: rows ``r >= masked_m[g]`` are not meaningful in
            the result (kernels leave them untouched). With a 2-D h, ``int32 [1]``: the rows holding data
            (the ``m_total`` of a sync-free contiguous dispatch).
        out, out_scale: optional destinations (e.g. persistent decode buffers): ``float8_e4m3fn [..., I]``
            contiguous and ``float32 [..., ceil(I/group_size)]`` in the TMA layout (``empty_scale_tma``),
            on h's device. Either may be given alone; the other is then allocated.

    Returns ``(y_fp8 [..., I], y_scale [..., ceil(I/group_size)])``, scales in the TMA layout (``out`` /
    ``out_scale`` themselves when given).
    """
    V.check_silu_mul(h, group_size, ue8m0, masked_m)
    V.check_eps(eps)
    if out is None and out_scale is None:
        if _compiling():
            return torch.ops.moe_fp8.silu_mul_per_token_group_quant(h, group_size, ue8m0, masked_m, eps)
        return _silu_mul_quant_impl(h, group_size, ue8m0, masked_m, eps)
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    V.check_act_quant_out(out, out_scale, shape, group_size, h.device, "h")
    if out is None or out_scale is None:
        alloc = _alloc_act_quant(shape, group_size, h.device)
        out, out_scale = (alloc[0] if out is None else out), (alloc[1] if out_scale is None else out_scale)
    if _compiling():
        torch.ops.moe_fp8.silu_mul_per_token_group_quant_out(h, group_size, ue8m0, masked_m, eps, out, out_scale)
    else:
        _silu_mul_quant_impl(h, group_size, ue8m0, masked_m, eps, out, out_scale)
    return out, out_scale


# ============================================================================================
# Routing
# ============================================================================================

def _router_gemm_impl(x: Tensor, weight: Tensor) -> Tensor:
    if x.shape[0] == 0:
        return torch.empty((0, weight.shape[0]), dtype=torch.float32, device=x.device)
    return backends.select("router_gemm", x.device)[1](x, weight)


@torch.library.custom_op("moe_fp8::router_gemm", mutates_args=())
def _router_gemm_op(x: Tensor, weight: Tensor) -> Tensor:
    return _router_gemm_impl(x, weight)


@_router_gemm_op.register_fake
def _(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def router_gemm(x: Tensor, weight: Tensor) -> Tensor:
    """Router logits ``x · weightᵀ`` in float32: ``F.linear(x.float(), weight.float())``, the router of
    transformers' DeepSeek-V3.

    Args:
        x: ``[T, H]`` bf16/fp16/fp32 hidden states; ``T`` may be 0.
        weight: ``[E, H]`` bf16/fp16/fp32 router weight (a checkpoint's ``mlp.gate.weight``), on x's device.

    Returns float32 ``[T, E]``: every product and sum in float32 (a bf16 product is exact there), in the backend's
    order. On Hopper a CUDA kernel reads the weight once for up to 8 bf16 tokens, adding in a fixed order (the same
    bits on every call). DeepSeek-V3's 256 × 7168 on an H200, replayed after an L2 flush: 7.6-9.2 µs, where cuBLAS's
    float32 GEMM on upcast operands takes 14.8-30.4 and its bf16 one 10.5-10.8. More tokens, with a bf16 weight, take
    cuBLAS's bf16 GEMM with float32 output; with a float32 weight, ``F.linear`` on float32 copies, 2-3x slower: keep
    router weights in bf16.
    """
    V.check_router_gemm(x, weight)
    if _compiling():
        return torch.ops.moe_fp8.router_gemm(x, weight)
    return _router_gemm_impl(x, weight)


def _alloc_select_experts(t: int, top_k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    return (torch.empty((t, top_k), dtype=torch.float32, device=device),
            torch.empty((t, top_k), dtype=torch.int32, device=device))


def _select_experts_impl(router_logits: Tensor, top_k: int, scoring_func: str, renormalize: bool,
                         n_group: int | None, topk_group: int | None, e_score_correction_bias: Tensor | None,
                         routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    if router_logits.shape[0] == 0:
        return _alloc_select_experts(0, top_k, router_logits.device)
    return backends.select("select_experts", router_logits.device)[1](
        router_logits, top_k, scoring_func, renormalize, n_group, topk_group, e_score_correction_bias,
        routed_scaling_factor)


@torch.library.custom_op("moe_fp8::select_experts", mutates_args=())
def _select_experts_op(router_logits: Tensor, top_k: int, scoring_func: str, renormalize: bool,
                       n_group: int | None, topk_group: int | None, e_score_correction_bias: Tensor | None,
                       routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _select_experts_impl(router_logits, top_k, scoring_func, renormalize, n_group, topk_group,
                                e_score_correction_bias, routed_scaling_factor)


@_select_experts_op.register_fake
def _(router_logits: Tensor, top_k: int, scoring_func: str, renormalize: bool, n_group: int | None,
      topk_group: int | None, e_score_correction_bias: Tensor | None,
      routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    return _alloc_select_experts(router_logits.shape[0], top_k, router_logits.device)


def select_experts(router_logits: Tensor, top_k: int, *, scoring_func: str = "softmax",
                   renormalize: bool = True, n_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """Pick ``top_k`` experts per token (softmax top-k, or DeepSeek-V3 grouped top-k).

    Args:
        router_logits: ``[T, E]`` bf16/fp16/fp32 (scored in float32); ``T`` may be 0.
        top_k: ``1 <= top_k <= E``.
        scoring_func: ``"softmax"`` (over E) or ``"sigmoid"`` (per expert).
        renormalize: divide the selected weights by their sum (a sum below float32's smallest normal,
            from logits under about -87, takes the softmax of their logits: the same ratios, no 0 / 0).
        n_group, topk_group: grouped top-k, both or neither: ``E % n_group == 0``,
            ``1 <= topk_group <= n_group``, ``top_k <= topk_group·E/n_group``.
        e_score_correction_bias: optional ``[E]`` added to the scores for selection only.
        routed_scaling_factor: multiplies the final weights.

    Returns ``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])`` ordered by descending
    choice, ties to the lower index (``moe_fp8.reference.select_experts`` is the definition).
    """
    V.check_select_experts(router_logits, top_k, scoring_func, renormalize, n_group, topk_group,
                           e_score_correction_bias, routed_scaling_factor)
    routed_scaling_factor = float(routed_scaling_factor)
    if _compiling():
        return torch.ops.moe_fp8.select_experts(router_logits, top_k, scoring_func, renormalize, n_group,
                                                topk_group, e_score_correction_bias, routed_scaling_factor)
    return _select_experts_impl(router_logits, top_k, scoring_func, renormalize, n_group, topk_group,
                                e_score_correction_bias, routed_scaling_factor)


# ============================================================================================
# Dispatch / combine
# ============================================================================================

def _dispatch_contiguous_eager_only(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int,
                                    expert_map: Tensor | None, align_m: int, sync: bool = True,
                                    return_m_total: bool = False) -> tuple[Tensor, ...]:
    fn = backends.select("dispatch_contiguous", x_fp8.device)[1]
    return fn(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m,
              **_changed(sync=(sync, True), return_m_total=(return_m_total, False)))


# Hidden from dynamo: a graph break under torch.compile, an error naming this function under
# fullgraph=True. NOTE: torch._disable_dynamo (not torch.compiler.disable) because it imports
# torch._dynamo on first call instead of at `import moe_fp8` (measured: +6 s of import time here).
_dispatch_contiguous_impl = getattr(torch, "_disable_dynamo", lambda fn: fn)(_dispatch_contiguous_eager_only)


def dispatch_contiguous(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int,
                        expert_map: Tensor | None = None,
                        align_m: int | None = None, *, sync: bool = True,
                        return_m_total: bool = False) -> tuple[Tensor, ...]:
    """Scatter token copies into the contiguous grouped layout (prefill). Not a custom op (see module doc).

    Args:
        x_fp8: ``float8_e4m3fn [T, K]`` contiguous; x_scale: ``float32 [T, ceil(K/128)]`` (any layout).
        topk_ids: ``int32/int64 [T, top_k]`` expert ids (global ids when ``expert_map`` is given).
        num_experts: local expert count ``E`` (>= 1).
        expert_map: optional ``int32/int64 [num_global_experts]``: global → local id, -1 = not on this rank.
        align_m: segment alignment, default (and normally) ``moe_fp8.get_align_m()``.

    Returns ``(out_fp8 [M_total, K], out_scale [M_total, KG] (TMA layout), m_indices int32 [M_total],
    row_map int64 [T, top_k])``; ``M_total`` is data-dependent (this op syncs with the host to size its
    outputs), each expert's segment padded to ``align_m`` rows, padding rows ``m_indices = -1``.
    ``row_map[t, j]`` = row of token t's j-th copy, -1 if not local. Inputs feed
    ``fp8_grouped_gemm_contiguous``; ``row_map`` feeds ``combine``. On the GPU the copy runs before the
    host waits for ``M_total``: the three layout outputs are ``M_total``-row views of buffers sized by the
    upper bound below (their memory is held as long as the views).

    ``sync=False``: no host sync. ``M_total`` is replaced by the upper bound
    ``align(T·top_k + E·(align_m − 1), align_m)`` (each segment pads fewer than ``align_m`` rows); the
    rows past the real ``M_total`` are padding (``m_indices = -1``, contents unspecified), so the
    results still feed ``fp8_grouped_gemm_contiguous`` and ``combine`` unchanged. Invalid ids are then
    not local (as in ``dispatch_masked``) instead of a ``ValueError``.

    ``return_m_total``: also return ``M_total`` as an ``int32 [1]`` tensor on x's device (last). Under
    ``sync=False`` pass it to the GEMMs (``m_total=``) and to ``silu_mul_per_token_group_quant``
    (``masked_m=``): they then skip the padding tail on the device instead of walking the upper bound.
    """
    V.check_dispatch(x_fp8, x_scale, topk_ids, num_experts, expert_map)
    if align_m is None:
        align_m = get_align_m()
    V.check_int("align_m", align_m, min_value=1)
    V.check_bool("sync", sync)
    V.check_bool("return_m_total", return_m_total)
    if _compiling():
        return _dispatch_contiguous_impl(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync,
                                         return_m_total)
    return _dispatch_contiguous_eager_only(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync,
                                           return_m_total)


def _quant_dispatch_contiguous_eager_only(x: Tensor, topk_ids: Tensor, num_experts: int, expert_map: Tensor | None,
                                          align_m: int, ue8m0: bool, eps: float, sync: bool = True,
                                          return_x: bool = True, return_m_total: bool = False
                                          ) -> tuple[Tensor | None, ...]:
    if x.shape[0] == 0:  # no rows: the two ops' own empty-problem paths (no backend sees an empty x)
        x_fp8, x_scale = _per_token_group_quant_impl(x, GROUP_K, ue8m0, eps)
        routed = _dispatch_contiguous_eager_only(x_fp8, x_scale, topk_ids, num_experts, expert_map, align_m, sync,
                                                 return_m_total)
        return (x_fp8, x_scale, *routed) if return_x else (None, None, *routed)
    fn = backends.select("quant_dispatch_contiguous", x.device)[1]
    return fn(x, topk_ids, num_experts, expert_map, align_m, ue8m0, eps,
              **_changed(sync=(sync, True), return_x=(return_x, True), return_m_total=(return_m_total, False)))


_quant_dispatch_contiguous_impl = getattr(torch, "_disable_dynamo", lambda fn: fn)(
    _quant_dispatch_contiguous_eager_only)


def quant_dispatch_contiguous(x: Tensor, topk_ids: Tensor, num_experts: int, expert_map: Tensor | None = None,
                              align_m: int | None = None, *, ue8m0: bool = False, eps: float = _DEFAULT_EPS,
                              sync: bool = True, return_x: bool = True, return_m_total: bool = False
                              ) -> tuple[Tensor | None, ...]:
    """``per_token_group_quant(x, 128, ue8m0, eps)`` then ``dispatch_contiguous`` in one op (prefill).

    Bit-identical to the two ops. On the Triton backends the routing runs first and its ``M_total``
    travels to the host while the GPU quantizes and copies the rows (without an ``expert_map`` in one
    scatter kernel that never reads the FP8 input back), so the host sync leaves no GPU idle gap behind
    it. Eager only, like ``dispatch_contiguous``.

    Args:
        x: ``[T, K]`` bf16/fp16/fp32, contiguous; ``K`` a positive multiple of 16; ``T`` may be 0.
        topk_ids, num_experts, expert_map, align_m, sync: as ``dispatch_contiguous`` (on x's device).
        ue8m0, eps: as ``per_token_group_quant``.
        return_x: also return the quantized input; False when nothing else reads it (no shared
            experts): without an ``expert_map`` it is then never written.
        return_m_total: as ``dispatch_contiguous``.

    Returns ``(x_fp8 [T, K], x_scale [T, ceil(K/128)] (TMA layout), out_fp8 [M_total, K], out_scale
    (TMA layout), m_indices int32 [M_total], row_map int64 [T, top_k])``: the quantized input (for the
    shared experts; None, None without ``return_x``) and what ``dispatch_contiguous`` returns (with
    ``m_total`` last under ``return_m_total``).
    """
    V.check_quant_dispatch(x, topk_ids, num_experts, expert_map, None, ue8m0, eps)
    if align_m is None:
        align_m = get_align_m()
    V.check_int("align_m", align_m, min_value=1)
    V.check_bool("sync", sync)
    V.check_bool("return_x", return_x)
    V.check_bool("return_m_total", return_m_total)
    if _compiling():
        return _quant_dispatch_contiguous_impl(x, topk_ids, num_experts, expert_map, align_m, ue8m0, eps, sync,
                                               return_x, return_m_total)
    return _quant_dispatch_contiguous_eager_only(x, topk_ids, num_experts, expert_map, align_m, ue8m0, eps, sync,
                                                 return_x, return_m_total)


def _alloc_masked_maps(t: int, top_k: int, num_experts: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``masked_m int32 [E]`` and ``row_map int64 [T, top_k]`` of a masked dispatch."""
    return (torch.empty((num_experts,), dtype=torch.int32, device=device),
            torch.empty((t, top_k), dtype=torch.int64, device=device))


def _alloc_dispatch_masked(t: int, top_k: int, k: int, num_experts: int, max_m: int, device: torch.device
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_alloc_act_quant((num_experts, max_m, k), GROUP_K, device),
            *_alloc_masked_maps(t, top_k, num_experts, device))


def _dispatch_masked_impl(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                          expert_map: Tensor | None, out: Tensor | None = None,
                          out_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = backends.select("dispatch_masked", x_fp8.device)[1]
    if out is None and out_scale is None:
        return fn(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map)
    return fn(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map, out=out, out_scale=out_scale)


@torch.library.custom_op("moe_fp8::dispatch_masked", mutates_args=())
def _dispatch_masked_op(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                        expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _dispatch_masked_impl(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map)


@_dispatch_masked_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
      expert_map: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _alloc_dispatch_masked(topk_ids.shape[0], topk_ids.shape[1], x_fp8.shape[1], num_experts, max_m,
                                  x_fp8.device)


@torch.library.custom_op("moe_fp8::dispatch_masked_out", mutates_args=("out", "out_scale"))
def _dispatch_masked_out_op(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                            expert_map: Tensor | None, out: Tensor, out_scale: Tensor) -> tuple[Tensor, Tensor]:
    _, _, masked_m, row_map = _dispatch_masked_impl(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map,
                                                    out, out_scale)
    return masked_m, row_map


@_dispatch_masked_out_op.register_fake
def _(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int, expert_map: Tensor | None,
      out: Tensor, out_scale: Tensor) -> tuple[Tensor, Tensor]:
    return _alloc_masked_maps(topk_ids.shape[0], topk_ids.shape[1], num_experts, x_fp8.device)


def _masked_out(out: Tensor | None, out_scale: Tensor | None, x: Tensor, num_experts: int, max_m: int,
                name: str) -> tuple[Tensor, Tensor]:
    """The masked dispatch destinations for ``out=`` / ``out_scale=`` (either may be None): checked, the
    missing one allocated."""
    shape = (num_experts, max_m, x.shape[1])
    V.check_act_quant_out(out, out_scale, shape, GROUP_K, x.device, name)
    if out is None or out_scale is None:
        alloc = _alloc_act_quant(shape, GROUP_K, x.device)
        out, out_scale = (alloc[0] if out is None else out), (alloc[1] if out_scale is None else out_scale)
    return out, out_scale


def dispatch_masked(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                    expert_map: Tensor | None = None, *, out: Tensor | None = None,
                    out_scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Scatter token copies into the masked grouped layout (decode); fixed size, no host sync.

    Args: as ``dispatch_contiguous``, plus ``max_m`` (host int >= 0) rows per expert. An expert that
    receives more than ``max_m`` copies keeps the first ``max_m`` in (token, slot) order; the rest are
    dropped (``row_map = -1``). ``out`` / ``out_scale``: optional destinations (e.g. persistent decode
    buffers), ``float8_e4m3fn [E, max_m, K]`` contiguous and ``float32 [E, max_m, ceil(K/128)]`` in the
    3-D TMA layout (``empty_scale_tma(max_m, KG, groups=E)``) on x's device; either may be given alone.
    Rows past ``masked_m`` of a given destination keep what they held.

    Returns ``(out_fp8 [E, max_m, K], out_scale [E, max_m, KG] (3-D TMA layout), masked_m int32 [E],
    row_map int64 [T, top_k])`` with ``row_map = e·max_m + position`` or -1 — the inputs of
    ``fp8_grouped_gemm_masked`` and ``combine``.
    """
    V.check_dispatch(x_fp8, x_scale, topk_ids, num_experts, expert_map)
    V.check_int("max_m", max_m, min_value=0)
    if out is None and out_scale is None:
        if _compiling():
            return torch.ops.moe_fp8.dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map)
        return _dispatch_masked_impl(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map)
    out, out_scale = _masked_out(out, out_scale, x_fp8, num_experts, max_m, "x_fp8")
    if _compiling():
        masked_m, row_map = torch.ops.moe_fp8.dispatch_masked_out(x_fp8, x_scale, topk_ids, num_experts, max_m,
                                                                  expert_map, out, out_scale)
        return out, out_scale, masked_m, row_map
    return _dispatch_masked_impl(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map, out, out_scale)


def _alloc_quant_dispatch_masked(t: int, top_k: int, k: int, num_experts: int, max_m: int, device: torch.device
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (*_alloc_act_quant((t, k), GROUP_K, device),
            *_alloc_dispatch_masked(t, top_k, k, num_experts, max_m, device))


def _quant_dispatch_masked_impl(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                                expert_map: Tensor | None, ue8m0: bool, eps: float, out: Tensor | None = None,
                                out_scale: Tensor | None = None) -> tuple[Tensor, ...]:
    if x.shape[0] == 0:  # no rows: the two ops' own empty-problem paths (no backend sees an empty x)
        x_fp8, x_scale = _per_token_group_quant_impl(x, GROUP_K, ue8m0, eps)
        return (x_fp8, x_scale, *_dispatch_masked_impl(x_fp8, x_scale, topk_ids, num_experts, max_m, expert_map,
                                                       out, out_scale))
    fn = backends.select("quant_dispatch_masked", x.device)[1]
    if out is None and out_scale is None:
        return fn(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps)
    return fn(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, out=out, out_scale=out_scale)


@torch.library.custom_op("moe_fp8::quant_dispatch_masked", mutates_args=())
def _quant_dispatch_masked_op(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int, expert_map: Tensor | None,
                              ue8m0: bool, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _quant_dispatch_masked_impl(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps)


@_quant_dispatch_masked_op.register_fake
def _(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int, expert_map: Tensor | None, ue8m0: bool,
      eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _alloc_quant_dispatch_masked(x.shape[0], topk_ids.shape[1], x.shape[1], num_experts, max_m, x.device)


@torch.library.custom_op("moe_fp8::quant_dispatch_masked_out", mutates_args=("out", "out_scale"))
def _quant_dispatch_masked_out_op(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                                  expert_map: Tensor | None, ue8m0: bool, eps: float, out: Tensor,
                                  out_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x_fp8, x_scale, _, _, masked_m, row_map = _quant_dispatch_masked_impl(
        x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, out, out_scale)
    return x_fp8, x_scale, masked_m, row_map


@_quant_dispatch_masked_out_op.register_fake
def _(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int, expert_map: Tensor | None, ue8m0: bool,
      eps: float, out: Tensor, out_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_alloc_act_quant(tuple(x.shape), GROUP_K, x.device),
            *_alloc_masked_maps(x.shape[0], topk_ids.shape[1], num_experts, x.device))


def quant_dispatch_masked(x: Tensor, topk_ids: Tensor, num_experts: int, max_m: int,
                          expert_map: Tensor | None = None, *, ue8m0: bool = False, eps: float = _DEFAULT_EPS,
                          out: Tensor | None = None, out_scale: Tensor | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``per_token_group_quant(x, 128, ue8m0, eps)`` then ``dispatch_masked`` in one op (decode).

    On the Triton backends a decode-sized problem is one launch: each dispatch program quantizes its
    own slice of the rows and copies the codes straight to their destinations (no separate
    quantization launch, ``x_fp8`` never read back). Bit-identical to the two ops.

    Args:
        x: ``[T, K]`` bf16/fp16/fp32, contiguous; ``K`` a positive multiple of 16 (the last scale
            group may be partial); ``T`` may be 0.
        topk_ids, num_experts, max_m, expert_map: as ``dispatch_masked`` (on x's device).
        ue8m0, eps: as ``per_token_group_quant``.
        out, out_scale: optional destinations of the dispatched rows, as ``dispatch_masked``'s.

    Returns ``(x_fp8 [T, K], x_scale [T, ceil(K/128)] (TMA layout), out_fp8 [E, max_m, K], out_scale
    [E, max_m, ceil(K/128)] (3-D TMA layout), masked_m int32 [E], row_map int64 [T, top_k])``: the
    quantized input (for the shared experts) and what ``dispatch_masked`` returns.
    """
    V.check_quant_dispatch(x, topk_ids, num_experts, expert_map, max_m, ue8m0, eps)
    if out is None and out_scale is None:
        if _compiling():
            return torch.ops.moe_fp8.quant_dispatch_masked(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps)
        return _quant_dispatch_masked_impl(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps)
    out, out_scale = _masked_out(out, out_scale, x, num_experts, max_m, "x")
    if _compiling():
        x_fp8, x_scale, masked_m, row_map = torch.ops.moe_fp8.quant_dispatch_masked_out(
            x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, out, out_scale)
        return x_fp8, x_scale, out, out_scale, masked_m, row_map
    return _quant_dispatch_masked_impl(x, topk_ids, num_experts, max_m, expert_map, ue8m0, eps, out, out_scale)


def _combine_impl(y: Tensor, row_map: Tensor, topk_weights: Tensor, shared_output: Tensor | None) -> Tensor:
    if row_map.shape[0] == 0 or y.shape[-1] == 0:
        return torch.zeros((row_map.shape[0], y.shape[-1]), dtype=_BF16, device=y.device)
    return backends.select("combine", y.device)[1](y, row_map, topk_weights, shared_output)


@torch.library.custom_op("moe_fp8::combine", mutates_args=())
def _combine_op(y: Tensor, row_map: Tensor, topk_weights: Tensor, shared_output: Tensor | None) -> Tensor:
    return _combine_impl(y, row_map, topk_weights, shared_output)


@_combine_op.register_fake
def _(y: Tensor, row_map: Tensor, topk_weights: Tensor, shared_output: Tensor | None) -> Tensor:
    return torch.empty((row_map.shape[0], y.shape[-1]), dtype=_BF16, device=y.device)


def combine(y: Tensor, row_map: Tensor, topk_weights: Tensor, shared_output: Tensor | None = None) -> Tensor:
    """Weighted sum of each token's expert outputs: ``out[t] = Σ_j w[t, j]·y[row_map[t, j]] (+ shared)``.

    Args:
        y: expert outputs ``[M_total, H]`` (contiguous layout) or ``[E, max_m, H]`` (masked layout, rows
            read flat), bf16/fp16/fp32.
        row_map: ``int32/int64 [T, top_k]`` from a dispatch; -1 = skip the slot.
        topk_weights: ``[T, top_k]`` float. shared_output: optional ``[T, H]`` added (shared experts).

    Returns ``bfloat16 [T, H]`` (sums in float32).
    """
    V.check_combine(y, row_map, topk_weights, shared_output)
    if _compiling():
        return torch.ops.moe_fp8.combine(y, row_map, topk_weights, shared_output)
    return _combine_impl(y, row_map, topk_weights, shared_output)
