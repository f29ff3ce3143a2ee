"""``select_experts``: softmax top-k and DeepSeek-V3 grouped top-k, one program per ``BLOCK_T`` tokens.

A token's scores live in registers as a ``[NG_P2, PG_P2]`` tile (groups × experts per group; one
group without ``n_group``), so up to ``configs.MAX_ROUTING_EXPERTS`` experts fit one program.

Exactness against ``moe_fp8.reference.select_experts``:

- Scores are evaluated in float64 and rounded once to float32, as the reference does (softmax as
  ``exp(x - max) / Σ``, sigmoid as ``1 / (1 + exp(-x))``); the float64 results agree with torch's to
  an ulp of float64, so the float32 scores are the same bits (barring a float64 ulp straddling a
  float32 rounding boundary, ~2**-29 per score).
- Selection compares ``(sort_key(value) << 32) | (MAX - 1 - index)``: one int64 max per pick gives
  the largest value and, among equals, the lowest index — ``torch.sort(stable=True)``'s order, NaN
  above everything. Group scores (top-2 sum for sigmoid, max for softmax) use the same picks.
- Weights are the float32 scores of the chosen experts, recomputed after the top-k loop from their
  logits with the same float64 formula (so the loop is one int64 max per pick); with
  ``renormalize`` they are divided (correctly rounded) by their float32 sum (a tree reduction). The
  reference's sum is a torch reduction whose order is unspecified too, so renormalized weights can
  differ from it by an ulp or two. A sum below float32's smallest normal takes the reference's softmax of
  the picks' logits instead.
- Warps (``configs.routing_config``): with several tokens per program one per 256 score slots, so a
  DeepSeek-V3 token's selection (256 experts) runs inside one warp (shuffle reductions, no
  shared-memory barriers); with one token per program (decode) 4 warps, measured faster there.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from moe_fp8 import reference
from moe_fp8.kernels.triton.common import check_launch_device, launch, pdl_args, pdl_start, sort_key
from moe_fp8.kernels.triton.configs import MAX_ROUTING_EXPERTS, RoutingConfig, routing_config
from moe_fp8.utils import get_num_sms

__all__ = ["select_experts"]

logger = logging.getLogger("moe_fp8")
_INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _select_experts_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr,
    T, stride_t, stride_e, stride_bias, per_group, n_group, topk_group, top_k, routed_scaling_factor,
    BLOCK_T: tl.constexpr, NG_P2: tl.constexpr, PG_P2: tl.constexpr, K_P2: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    gi = tl.arange(0, NG_P2)
    pj = tl.arange(0, PG_P2)
    expert = gi[None, :, None] * per_group + pj[None, None, :]  # [1, NG_P2, PG_P2]
    tok_ok = tok < T
    valid = tok_ok[:, None, None] & (gi[None, :, None] < n_group) & (pj[None, None, :] < per_group)

    # ---- scores: float64, rounded once to float32 ----
    x = tl.load(logits_ptr + tok.to(tl.int64)[:, None, None] * stride_t + expert * stride_e, mask=valid,
                other=float("-inf")).to(tl.float64)
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-x))
    else:
        row_max = tl.max(tl.max(x, axis=2), axis=1)
        ex = tl.where(valid, tl.exp(x - row_max[:, None, None]), 0.0)
        total = tl.sum(tl.sum(ex, axis=2), axis=1)
        total = tl.where(tok_ok, total, 1.0)  # padding tokens: avoid 0/0 (never stored)
        p = ex / total[:, None, None]
    scores = p.to(tl.float32)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert * stride_bias, mask=valid, other=0.0).to(tl.float32)

    # ---- grouped top-k: keep the topk_group best groups ----
    if GROUPED:
        member = (sort_key(choice).to(tl.int64) << 32) | (PG_P2 - 1 - pj[None, None, :])
        member = tl.where(valid, member, _INT64_MIN)
        member_max = tl.max(member, axis=2)
        first = member == member_max[:, :, None]
        group_score = tl.sum(tl.where(first, choice, 0.0), axis=2)  # one term: exact
        if SIGMOID and PG_P2 >= 2:  # top-2 sum (the reference's min(2, E/n_group) values)
            member = tl.where(first, _INT64_MIN, member)
            second = member == tl.max(member, axis=2)[:, :, None]
            group_score = group_score + tl.sum(tl.where(second, choice, 0.0), axis=2)
        group_ok = tok_ok[:, None] & (gi[None, :] < n_group)
        gkey = (sort_key(group_score).to(tl.int64) << 32) | (NG_P2 - 1 - gi[None, :])
        gkey = tl.where(group_ok, gkey, _INT64_MIN)
        kept = (tok[:, None] < 0) & (gi[None, :] < 0)  # [BLOCK_T, NG_P2], all False
        for _ in range(topk_group):
            gpick = gkey == tl.max(gkey, axis=1)[:, None]
            kept = kept | gpick
            gkey = tl.where(gpick, _INT64_MIN, gkey)
        choice = tl.where(kept[:, :, None], choice, float("-inf"))

    # ---- top-k experts, largest choice first, ties to the lower id ----
    # Keys stay in the [BLOCK_T, NG_P2, PG_P2] tile: a pick is a max over axis 2 then axis 1 (the
    # expert id rides in the low bits). NOTE: an earlier version flattened the tile with tl.reshape
    # to [BLOCK_T, E_MAX] for a single max; on the H100 BLOCK_T=2 with 2 warps then picked wrong ids
    # (the reshape's layout change is not trusted since). Weights are gathered after the loop.
    E_MAX: tl.constexpr = NG_P2 * PG_P2
    key = (sort_key(choice).to(tl.int64) << 32) | (E_MAX - 1 - expert)
    key = tl.where(valid, key, _INT64_MIN)
    kcol = tl.arange(0, K_P2)
    out_id = tl.zeros([BLOCK_T, K_P2], dtype=tl.int32)
    for j in range(top_k):
        best = tl.max(tl.max(key, axis=2), axis=1)
        key = tl.where(key == best[:, None, None], _INT64_MIN, key)
        eid = (E_MAX - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
        out_id = tl.where(kcol[None, :] == j, eid[:, None], out_id)

    # ---- weights: the picked experts' scores, recomputed from their logits by the same float64
    # formula as the tile above (bit-identical values, no per-pick sum reduction) ----
    out_mask = tok_ok[:, None] & (kcol[None, :] < top_k)
    x_sel = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * stride_t + out_id * stride_e, mask=out_mask,
                    other=0.0).to(tl.float64)
    if SIGMOID:
        p_sel = 1.0 / (1.0 + tl.exp(-x_sel))
    else:
        p_sel = tl.exp(x_sel - row_max[:, None]) / total[:, None]
    out_w = tl.where(out_mask, p_sel.to(tl.float32), 0.0)
    weight_sum = tl.sum(out_w, axis=1)
    if RENORMALIZE:
        out_w = tl.div_rn(out_w, tl.where(tok_ok, weight_sum, 1.0)[:, None])
        # sums below float32's smallest normal: the softmax of the picks' logits (reference._renormalize)
        tiny = tok_ok & (weight_sum < 1.1754943508222875e-38)
        if tl.max(tiny.to(tl.int32), axis=0) > 0:
            x_max = tl.max(tl.where(out_mask, x_sel, float("-inf")), axis=1)
            e = tl.where(out_mask, tl.exp(tl.where(x_sel == x_max[:, None], 0.0, x_sel - x_max[:, None])), 0.0)
            soft = (e / tl.sum(e, axis=1)[:, None]).to(tl.float32)
            out_w = tl.where(tiny[:, None], soft, out_w)
    out_w = out_w * routed_scaling_factor

    out_offs = tok.to(tl.int64)[:, None] * top_k + kcol[None, :]
    tl.store(w_ptr + out_offs, out_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, out_id, mask=out_mask)


_warned_large: set[int] = set()


def select_experts(router_logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool,
                   n_group: int | None, topk_group: int | None, e_score_correction_bias: torch.Tensor | None,
                   routed_scaling_factor: float, *, config: RoutingConfig | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend entry of ``moe_fp8::select_experts`` (see ``moe_fp8.ops``): ``(weights f32, ids i32)``,
    both ``[T, top_k]``. Expert counts above ``MAX_ROUTING_EXPERTS`` go to the reference (logged once).
    ``config``: a ``RoutingConfig`` instead of ``configs.routing_config``'s (tuning)."""
    device = check_launch_device(router_logits, e_score_correction_bias)
    t, e = router_logits.shape
    if e > MAX_ROUTING_EXPERTS:
        if e not in _warned_large:
            _warned_large.add(e)
            logger.warning("moe_fp8: select_experts with %d experts (> %d) runs the reference on %s",
                           e, MAX_ROUTING_EXPERTS, device)
        return reference.select_experts(
            router_logits, top_k, scoring_func=scoring_func, renormalize=renormalize, n_group=n_group,
            topk_group=topk_group, e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=routed_scaling_factor)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    if t == 0:
        return weights, ids
    grouped = n_group is not None
    ng = n_group if grouped else 1
    cfg = config or routing_config(t, e, top_k, n_group, get_num_sms())
    bias = e_score_correction_bias
    grid = (triton.cdiv(t, cfg.block_t),)
    launch(_select_experts_kernel, grid,
        router_logits, bias if bias is not None else router_logits, weights, ids,
        t, router_logits.stride(0), router_logits.stride(1), bias.stride(0) if bias is not None else 0,
        e // ng, ng, topk_group if grouped else 1, top_k, float(routed_scaling_factor),
        BLOCK_T=cfg.block_t, NG_P2=cfg.ng_p2, PG_P2=cfg.pg_p2, K_P2=cfg.k_p2,
        SIGMOID=scoring_func == "sigmoid", HAS_BIAS=bias is not None, GROUPED=grouped,
        RENORMALIZE=bool(renormalize), num_warps=cfg.num_warps, **pdl_args(device),
    )
    return weights, ids
