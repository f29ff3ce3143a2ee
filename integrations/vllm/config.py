"""Pure-Python half of the vLLM integration: the checkpoint's ``quantization_config`` and the shard rules.

Nothing here imports vLLM, so CI (which has no vLLM) tests it, and ``import moe_fp8`` stays free of it.

The ``quantization_config`` is read by ``moe_fp8.layers.quant_config`` (shared with SGLang; re-exported
here). The shard rules (``check_linear_partition``, ``check_moe_partition``) say which tensor-parallel splits
a block-FP8 weight can take: a split may only cut at 128-element scale-block boundaries (one
``weight_scale_inv`` entry per 128×128 block), and what is left must suit the GEMM kernels (DESIGN §2).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_fp8.layers.quant_config import (
    ACCEPTED_QUANT_METHODS,
    QUANT_METHOD_NAME,
    BlockFp8Settings,
    accepts_checkpoint,
    parse_quantization_config,
)
from moe_fp8.utils import GROUP_K
from moe_fp8.validation import K_ALIGN, N_ALIGN

__all__ = [
    "ACCEPTED_QUANT_METHODS",
    "QUANT_METHOD_NAME",
    "BlockFp8Settings",
    "accepts_checkpoint",
    "check_linear_partition",
    "check_moe_partition",
    "parse_quantization_config",
]


def check_linear_partition(prefix: str, input_size: int, output_size: int, input_size_per_partition: int,
                           output_partition_sizes: Sequence[int]) -> None:
    """Raise ``ValueError`` unless one rank's block-FP8 linear shard can be loaded and run exactly.

    ``output_partition_sizes`` are this rank's rows of each logical weight fused into the layer (one entry
    for a plain linear; ``[gate, up]`` or ``[q, k, v]`` for merged ones), as vLLM's ``create_weights`` gets
    them. Rules:

    - a split of the input features (row parallel: ``input_size_per_partition != input_size``) must be a
      multiple of 128, so that each rank owns whole scale columns;
    - a split of the output features (column parallel: the partitions sum to less than ``output_size``)
      needs every partition to be a multiple of 128; a merged layer needs it for every partition but the
      last even without a split (each logical weight starts on a scale-row boundary);
    - the shard must suit the GEMM: ``K % 16 == 0`` and ``N % 8 == 0``.
    """
    sizes = [int(s) for s in output_partition_sizes]
    n, k = sum(sizes), int(input_size_per_partition)
    where = f"moe_fp8: linear layer {prefix or '<unnamed>'!r}"
    if k != input_size and k % GROUP_K != 0:
        raise ValueError(f"{where}: its tensor-parallel shard of the input features ({input_size} split into "
                         f"{k} per rank) must be a multiple of {GROUP_K}, or it would cut a "
                         f"{GROUP_K}x{GROUP_K} weight_scale_inv block; use a smaller tensor-parallel size")
    column_split = n != output_size
    to_check = sizes if column_split else sizes[:-1]
    bad = [s for s in to_check if s % GROUP_K != 0]
    if bad:
        what = (f"its tensor-parallel shard of the output features ({output_size} split into {sizes} per rank)"
                if column_split else f"its fused parts {sizes}")
        raise ValueError(f"{where}: {what} must be multiples of {GROUP_K} (each part owns whole "
                         f"{GROUP_K}x{GROUP_K} weight_scale_inv blocks); got {bad}")
    if k % K_ALIGN != 0 or n % N_ALIGN != 0:
        raise ValueError(f"{where}: the FP8 GEMM needs in_features % {K_ALIGN} == 0 and out_features % "
                         f"{N_ALIGN} == 0 per rank, got in_features {k}, out_features {n}")


def check_moe_partition(prefix: str, hidden_size: int, intermediate_size_per_partition: int) -> None:
    """Raise ``ValueError`` unless the routed experts' shard can run: ``I`` per rank a positive multiple of 128
    (gate and up each own whole scale blocks of ``w13``, and a tensor-parallel split of ``I`` cuts at block
    boundaries) and ``H`` a positive multiple of 16 (FP8 GEMM rows)."""
    where = f"moe_fp8: MoE layer {prefix or '<unnamed>'!r}"
    if intermediate_size_per_partition <= 0 or intermediate_size_per_partition % GROUP_K != 0:
        raise ValueError(f"{where}: the expert intermediate size per tensor-parallel rank must be a positive "
                         f"multiple of {GROUP_K} (whole weight_scale_inv blocks), got "
                         f"{intermediate_size_per_partition}; use a smaller tensor-parallel size or expert "
                         "parallelism (--enable-expert-parallel)")
    if hidden_size <= 0 or hidden_size % K_ALIGN != 0:
        raise ValueError(f"{where}: hidden_size must be a positive multiple of {K_ALIGN} for the FP8 GEMM, got "
                         f"{hidden_size}")
