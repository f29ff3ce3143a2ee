"""Activation / weight quantization to block FP8 and the scale layouts the GEMMs read (DESIGN §2).

- ``per_token_group(x, group_size=128, ue8m0=False)`` → ``(x_fp8, x_scale)``, scales in the TMA layout.
- ``per_block(w, block=(128, 128))`` → ``(w_fp8, w_scale)`` (DeepSeek ``weight`` / ``weight_scale_inv``).
- ``silu_mul_per_token_group(h, group_size=128, ue8m0=False, masked_m=None)``: fused SiLU·mul + quant,
  contiguous ``[M, 2I]`` and masked ``[G, max_m, 2I]`` forms.
- ``dequant_per_token_group`` / ``dequant_per_block``: back to float32 (reference math, any device).
- ``to_scale_tma_layout`` / ``empty_scale_tma``: explicit conversion / allocation of the TMA scale layout.
"""

from __future__ import annotations

import torch

from moe_fp8 import reference
from moe_fp8 import validation as V
from moe_fp8.ops import per_block_quant as per_block
from moe_fp8.ops import per_token_group_quant as per_token_group
from moe_fp8.ops import silu_mul_per_token_group_quant as silu_mul_per_token_group
from moe_fp8.utils import GROUP_K, empty_scale_tma, is_scale_tma_layout, to_scale_tma_layout

__all__ = [
    "dequant_per_block",
    "dequant_per_token_group",
    "empty_scale_tma",
    "is_scale_tma_layout",
    "per_block",
    "per_token_group",
    "silu_mul_per_token_group",
    "to_scale_tma_layout",
]


def dequant_per_token_group(x_fp8: torch.Tensor, x_scale: torch.Tensor, group_size: int = GROUP_K) -> torch.Tensor:
    """``x_fp8 · x_scale`` as float32 of ``x_fp8``'s shape.

    ``x_fp8``: ``float8_e4m3fn [M, K]`` or ``[G, M, K]``; ``x_scale``: ``float32 [..., M, ceil(K/group_size)]``
    in any layout, same device.
    """
    V.check_dequant_per_token_group(x_fp8, x_scale)
    V.check_int("group_size", group_size, min_value=1)
    return reference.dequant_per_token_group(x_fp8, x_scale, group_size)


def dequant_per_block(w_fp8: torch.Tensor, w_scale: torch.Tensor,
                      block: tuple[int, int] = (GROUP_K, GROUP_K)) -> torch.Tensor:
    """``w_fp8 · w_scale`` as float32 of ``w_fp8``'s shape.

    ``w_fp8``: ``float8_e4m3fn [N, K]`` or ``[G, N, K]``; ``w_scale``: ``float32 [..., ceil(N/bn), ceil(K/bk)]``.
    """
    V.check_dequant_per_block(w_fp8, w_scale)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be a pair of ints (block_n, block_k), got {block!r}")
    V.check_int("block[0]", block[0], min_value=1)
    V.check_int("block[1]", block[1], min_value=1)
    return reference.dequant_per_block(w_fp8, w_scale, tuple(block))
