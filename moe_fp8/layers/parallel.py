"""Tensor- and expert-parallel helpers for block-FP8 weights (DESIGN §5).

A block-FP8 weight ``w [N, K]`` carries one scale per 128×128 block (``w_scale [ceil(N/128),
ceil(K/128)]``), so a shard can only cut the weight at block boundaries: every shard's extent along the
split dimension must be a multiple of 128. The functions here refuse any other split rather than
re-quantizing (which would change the numbers).

- ``tp_shard_range(size, tp_rank, tp_size)``: the ``[start, stop)`` a rank owns; the single definition
  every splitter and the checkpoint loader use.
- ``shard_fp8_linear``: column split (of N, the output features; optionally of each part of a fused
  ``[gate | up]`` weight) or row split (of K, the input features) of an ``Fp8Linear``'s tensors.
- ``shard_moe_weights``: split the expert intermediate size ``I`` of ``w13 [E, 2I, H]`` (column split
  of gate and of up) and ``w2 [E, H, I]`` (row split).
- ``expert_map_for_rank``: a contiguous expert-parallel partition as a global → local ``expert_map``.

With either split, each rank computes a partial output; summing the ranks' outputs (an all-reduce,
left to the caller) gives the unsharded result.
"""

from __future__ import annotations

import torch

from moe_fp8.utils import GROUP_K

__all__ = ["expert_map_for_rank", "shard_fp8_linear", "shard_moe_weights", "tp_shard_range"]

Tensor = torch.Tensor


def _check_rank(tp_rank: object, tp_size: object, rank_name: str = "tp_rank", size_name: str = "tp_size") -> None:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"{size_name} must be a positive int, got {tp_size!r}")
    if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"{rank_name} must be an int in [0, {size_name} = {tp_size}), got {tp_rank!r}")


def tp_shard_range(size: int, tp_rank: int, tp_size: int, what: str = "size") -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank`` when ``size`` is split evenly over ``tp_size`` ranks.

    Each shard must be a whole number of 128-wide scale blocks: ``size % (128 · tp_size) == 0``, else
    ``ValueError`` naming ``what`` (a shard that cuts a scale block cannot be represented exactly).
    ``tp_size == 1`` is no split: ``(0, size)`` for any size.
    """
    _check_rank(tp_rank, tp_size)
    if tp_size == 1:
        return 0, size
    if size % (GROUP_K * tp_size) != 0:
        raise ValueError(
            f"cannot split {what} = {size} over tp_size = {tp_size}: each shard ({size} / {tp_size}) must be a "
            f"multiple of {GROUP_K} (one FP8 scale per {GROUP_K}×{GROUP_K} block)")
    shard = size // tp_size
    return tp_rank * shard, (tp_rank + 1) * shard


def _check_fp8_pair(w_name: str, w: Tensor, s_name: str, s: Tensor, ndim: int) -> None:
    if not isinstance(w, Tensor) or w.dtype != torch.float8_e4m3fn or w.dim() != ndim:
        raise TypeError(f"{w_name} must be a {ndim}-D torch.float8_e4m3fn tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    n, k = w.shape[-2:]
    want = (*w.shape[:-2], -(-n // GROUP_K), -(-k // GROUP_K))
    if not isinstance(s, Tensor) or s.dtype != torch.float32 or tuple(s.shape) != want:
        raise ValueError(f"{s_name} must be float32 {want} for {w_name} {tuple(w.shape)}, got "
                         f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")


def shard_fp8_linear(weight: Tensor, weight_scale_inv: Tensor, tp_rank: int, tp_size: int, *, mode: str,
                     num_fused: int = 1, bias: Tensor | None = None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
    """One rank's shard of a block-FP8 linear ``y = x @ weightᵀ (+ bias)``.

    Args:
        weight: ``float8_e4m3fn [N, K]``; weight_scale_inv: ``float32 [ceil(N/128), ceil(K/128)]``.
        mode: ``"column"`` splits N (each rank produces a slice of the output features; concatenate) or
            ``"row"`` splits K (each rank takes a slice of the input features and produces a partial sum;
            all-reduce).
        num_fused: column mode only: ``weight`` is ``num_fused`` equal parts stacked along N (e.g. 2 for
            ``[gate | up]``); each part is split separately and the rank's pieces are re-stacked, so the
            shard is again ``[gate_r | up_r]``.
        bias: optional ``[N]``: split with the columns; in row mode it is kept whole on rank 0 only
            (so the sum over ranks adds it once) and None elsewhere.

    Returns contiguous ``(weight, weight_scale_inv, bias)`` shards. Every split extent must be a multiple
    of 128 (``ValueError`` otherwise).
    """
    _check_fp8_pair("weight", weight, "weight_scale_inv", weight_scale_inv, 2)
    _check_rank(tp_rank, tp_size)
    if mode not in ("column", "row"):
        raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")
    if tp_size == 1:
        return weight.contiguous(), weight_scale_inv.contiguous(), bias
    n, k = weight.shape
    if mode == "row":
        if num_fused != 1:
            raise ValueError(f"num_fused applies to mode='column' only, got num_fused={num_fused}")
        k0, k1 = tp_shard_range(k, tp_rank, tp_size, "in_features (K)")
        out_bias = bias if tp_rank == 0 else None
        return (weight[:, k0:k1].contiguous(), weight_scale_inv[:, k0 // GROUP_K:k1 // GROUP_K].contiguous(),
                out_bias)
    if not isinstance(num_fused, int) or num_fused < 1 or n % num_fused != 0:
        raise ValueError(f"num_fused must be a positive int dividing out_features N = {n}, got {num_fused!r}")
    part = n // num_fused
    p0, p1 = tp_shard_range(part, tp_rank, tp_size, "out_features (N) per fused part")
    rows = [slice(i * part + p0, i * part + p1) for i in range(num_fused)]
    w = torch.cat([weight[r] for r in rows]).contiguous()
    s = torch.cat([weight_scale_inv[r.start // GROUP_K:r.stop // GROUP_K] for r in rows]).contiguous()
    b = None if bias is None else torch.cat([bias[r] for r in rows]).contiguous()
    return w, s, b


def shard_moe_weights(w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, tp_rank: int,
                      tp_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One rank's tensor-parallel shard of the expert weights, split along the intermediate size ``I``.

    Args:
        w13: ``float8_e4m3fn [E, 2I, H]`` = ``[gate | up]`` per expert; w13_scale ``float32 [E, 2I/128, ceil(H/128)]``.
        w2: ``float8_e4m3fn [E, H, I]``; w2_scale ``float32 [E, ceil(H/128), I/128]``.

    Returns ``(w13 [E, 2I/tp, H], w13_scale, w2 [E, H, I/tp], w2_scale)`` (contiguous): rank r keeps
    ``gate[r·I/tp:(r+1)·I/tp]``, the same rows of ``up`` and the same columns of ``w2``, so summing the
    ranks' MoE outputs gives the unsharded output. ``I / tp_size`` must be a multiple of 128.
    """
    _check_fp8_pair("w13", w13, "w13_scale", w13_scale, 3)
    _check_fp8_pair("w2", w2, "w2_scale", w2_scale, 3)
    e, two_i, h = w13.shape
    if two_i % 2 != 0 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w13 [E, 2I, H] and w2 [E, H, I] disagree: {tuple(w13.shape)} and {tuple(w2.shape)}")
    inter = two_i // 2
    _check_rank(tp_rank, tp_size)
    if tp_size == 1:
        return w13.contiguous(), w13_scale.contiguous(), w2.contiguous(), w2_scale.contiguous()
    i0, i1 = tp_shard_range(inter, tp_rank, tp_size, "intermediate size I")
    b0, b1, bi = i0 // GROUP_K, i1 // GROUP_K, inter // GROUP_K
    w13_r = torch.cat([w13[:, i0:i1], w13[:, inter + i0:inter + i1]], dim=1).contiguous()
    s13_r = torch.cat([w13_scale[:, b0:b1], w13_scale[:, bi + b0:bi + b1]], dim=1).contiguous()
    return w13_r, s13_r, w2[:, :, i0:i1].contiguous(), w2_scale[:, :, b0:b1].contiguous()


def expert_map_for_rank(num_experts: int, ep_rank: int, ep_size: int) -> Tensor:
    """int32 ``[num_experts]`` global → local map of a contiguous partition: rank r owns experts
    ``[r·E/ep, (r+1)·E/ep)`` as local ids ``0..E/ep-1``; every other entry is -1. ``E % ep_size == 0``."""
    _check_rank(ep_rank, ep_size, "ep_rank", "ep_size")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size != 0:
        raise ValueError(f"num_experts ({num_experts!r}) must be a positive multiple of ep_size = {ep_size}")
    per_rank = num_experts // ep_size
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
    expert_map[ep_rank * per_rank:(ep_rank + 1) * per_rank] = torch.arange(per_rank, dtype=torch.int32)
    return expert_map
