"""MoE building blocks and layers (DESIGN §5).

- ``select_experts`` (routing), ``dispatch_contiguous`` / ``dispatch_masked`` / ``combine`` (layouts);
- ``Fp8Linear``, ``Fp8MLP``, ``Fp8FusedMoE``: block-FP8 layers with DeepSeek-V3 parameter layouts;
  ``run_experts`` / ``choose_path``: the layer's expert pipeline and layout choice, for engine integrations;
- ``shard_fp8_linear``, ``shard_moe_weights``, ``expert_map_for_rank``, ``tp_shard_range``: TP / EP splits;
- ``CheckpointReader``, ``load_fp8_linear``, ``load_fp8_mlp``, ``load_fused_moe``: fill the layers from a
  DeepSeek-V3-format safetensors checkpoint; ``write_deepseek_v3_checkpoint`` /
  ``tiny_deepseek_v3_config`` build a random one (tests, demos).
"""

from __future__ import annotations

from moe_fp8.layers.checkpoint import (
    CheckpointReader,
    deepseek_v3_tensor_specs,
    load_fp8_linear,
    load_fp8_mlp,
    load_fused_moe,
    tiny_deepseek_v3_config,
    write_deepseek_v3_checkpoint,
)
from moe_fp8.layers.dispatch import combine, dispatch_contiguous, dispatch_masked
from moe_fp8.layers.linear import Fp8Linear, Fp8MLP, check_fp8_linear_shape
from moe_fp8.layers.moe import (
    MASKED_MAX_ROWS,
    Fp8FusedMoE,
    choose_path,
    default_masked_max_tokens,
    run_experts,
)
from moe_fp8.layers.parallel import expert_map_for_rank, shard_fp8_linear, shard_moe_weights, tp_shard_range
from moe_fp8.layers.routing import select_experts

__all__ = [
    "MASKED_MAX_ROWS",
    "CheckpointReader",
    "Fp8FusedMoE",
    "Fp8Linear",
    "Fp8MLP",
    "check_fp8_linear_shape",
    "choose_path",
    "combine",
    "deepseek_v3_tensor_specs",
    "default_masked_max_tokens",
    "dispatch_contiguous",
    "dispatch_masked",
    "expert_map_for_rank",
    "load_fp8_linear",
    "load_fp8_mlp",
    "load_fused_moe",
    "run_experts",
    "select_experts",
    "shard_fp8_linear",
    "shard_moe_weights",
    "tiny_deepseek_v3_config",
    "tp_shard_range",
    "write_deepseek_v3_checkpoint",
]
