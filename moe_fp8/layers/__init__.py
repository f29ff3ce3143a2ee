"""MoE building blocks and layers (DESIGN §5).

- ``router_gemm`` (router logits), ``select_experts`` (routing), ``dispatch_contiguous`` / ``dispatch_masked`` /
  ``combine`` (layouts), ``quant_dispatch_contiguous`` / ``quant_dispatch_masked`` (activation quantization + dispatch in one op);
- ``Fp8Linear``, ``Fp8MLP``, ``Fp8FusedMoE``: block-FP8 layers with DeepSeek-V3 parameter layouts
  (``ue8m0=True`` for DeepSeek-V3.1's power-of-two scales, checked by ``check_ue8m0_scales``);
- ``MaskedWorkspace``: the persistent decode buffers ``Fp8FusedMoE`` owns; ``StageTimer``: per-stage times;
- ``shard_fp8_linear``, ``shard_moe_weights``, ``expert_map_for_rank``, ``tp_shard_range``: TP / EP splits;
- ``CheckpointReader``, ``load_fp8_linear``, ``load_fp8_mlp``, ``load_fused_moe``: fill the layers from a
  DeepSeek-V3-format safetensors checkpoint; ``write_deepseek_v3_checkpoint`` /
  ``tiny_deepseek_v3_config`` build a random one (tests, demos), ``write_qwen3_moe_checkpoint`` /
  ``tiny_qwen3_moe_config`` a Qwen3-MoE one in the same block-FP8 format, ``tiny_kimi_k2_config`` a Kimi-K2 one
  (DeepSeek-V3's modules, 384 experts), ``tiny_glm4_moe_config`` a GLM-4.5 one, ``tiny_minimax_m2_config`` a MiniMax-M2
  one; ``write_checkpoint`` writes any of them.
"""

from __future__ import annotations

from moe_fp8.layers.checkpoint import (
    CheckpointReader,
    deepseek_v3_tensor_specs,
    glm4_moe_tensor_specs,
    load_fp8_linear,
    load_fp8_mlp,
    load_fused_moe,
    minimax_m2_tensor_specs,
    qwen3_moe_tensor_specs,
    tiny_deepseek_v3_config,
    tiny_glm4_moe_config,
    tiny_kimi_k2_config,
    tiny_minimax_m2_config,
    tiny_qwen3_moe_config,
    write_checkpoint,
    write_deepseek_v3_checkpoint,
    write_qwen3_moe_checkpoint,
)
from moe_fp8.layers.dispatch import (
    combine,
    dispatch_contiguous,
    dispatch_masked,
    quant_dispatch_contiguous,
    quant_dispatch_masked,
)
from moe_fp8.layers.linear import (
    Fp8Linear,
    Fp8MLP,
    check_fp8_linear_shape,
    check_ue8m0_scales,
    check_weight_scales,
)
from moe_fp8.layers.moe import (
    MASKED_MAX_ROWS,
    STAGES,
    Fp8FusedMoE,
    MaskedWorkspace,
    StageTimer,
    default_masked_max_tokens,
)
from moe_fp8.layers.parallel import expert_map_for_rank, shard_fp8_linear, shard_moe_weights, tp_shard_range
from moe_fp8.layers.routing import router_gemm, select_experts

__all__ = [
    "MASKED_MAX_ROWS",
    "STAGES",
    "CheckpointReader",
    "Fp8FusedMoE",
    "Fp8Linear",
    "Fp8MLP",
    "MaskedWorkspace",
    "StageTimer",
    "check_fp8_linear_shape",
    "check_ue8m0_scales",
    "check_weight_scales",
    "combine",
    "deepseek_v3_tensor_specs",
    "default_masked_max_tokens",
    "dispatch_contiguous",
    "dispatch_masked",
    "expert_map_for_rank",
    "glm4_moe_tensor_specs",
    "load_fp8_linear",
    "load_fp8_mlp",
    "load_fused_moe",
    "minimax_m2_tensor_specs",
    "quant_dispatch_contiguous",
    "quant_dispatch_masked",
    "qwen3_moe_tensor_specs",
    "router_gemm",
    "select_experts",
    "shard_fp8_linear",
    "shard_moe_weights",
    "tiny_deepseek_v3_config",
    "tiny_glm4_moe_config",
    "tiny_kimi_k2_config",
    "tiny_minimax_m2_config",
    "tiny_qwen3_moe_config",
    "tp_shard_range",
    "write_checkpoint",
    "write_deepseek_v3_checkpoint",
    "write_qwen3_moe_checkpoint",
]
