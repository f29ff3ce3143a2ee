"""``MoeFp8Config``: SGLang ``QuantizationConfig`` for block-FP8 (DeepSeek-V3-format) checkpoints.

Imports SGLang; reached through ``moe_fp8.integrations.sglang.enable()``.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from sglang.srt.layers.quantization.utils import is_layer_skipped

from moe_fp8.integrations import MIN_CAPABILITY, check_platform, no_quantization_config_message
from moe_fp8.integrations.sglang.spec import QUANT_METHOD_NAME, BlockFp8Settings, parse_quantization_config
from moe_fp8.layers.quant_config import accepts_checkpoint

__all__ = ["MoeFp8Config"]


class MoeFp8Config(QuantizationConfig):
    """Block-FP8 weights (128×128 FP32 scales), dynamic per-token-group FP8 activations, moe_fp8 kernels.

    Built by SGLang from the checkpoint's ``quantization_config`` (``from_config``) when the server runs with
    ``--quantization moe_fp8``. Attributes SGLang's model code reads from FP8 configs keep their meaning:
    ``weight_block_size = [128, 128]``, ``activation_scheme = "dynamic"``, ``is_checkpoint_fp8_serialized``.
    """

    activation_scheme = "dynamic"
    is_checkpoint_fp8_serialized = True
    use_mxfp8 = False
    # None even for a checkpoint with scale_fmt "ue8m0" (accepted): its power-of-two weight scales load as
    # FP32 and activations get FP32 scales, so SGLang's UE8M0 requantization paths must stay off.
    scale_fmt = None

    def __init__(self, spec: BlockFp8Settings | None = None) -> None:
        if spec is None:  # SGLang builds `quant_cls()` for a checkpoint without a quantization_config
            raise ValueError(no_quantization_config_message("SGLang"))
        check_platform("SGLang")
        super().__init__()
        self.spec = spec
        # Read by SGLang's linear loaders (block-scale shard offsets) and by DeepSeek's model code, which
        # compare it with the list [128, 128].
        self.weight_block_size = list(self.spec.weight_block_size)
        self.ignored_layers = list(self.spec.ignored_layers)
        self.packed_modules_mapping = dict(self.spec.packed_modules_mapping)

    # -- QuantizationConfig interface ----------------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeFp8Config:
        """Parse and validate the checkpoint's ``quantization_config`` (``ValueError`` naming the field)."""
        return cls(parse_quantization_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: str | None) -> str | None:
        # `--quantization moe_fp8` on a checkpoint that says quant_method "fp8": SGLang would call that a
        # mismatch; claim it here (as its own humming / moe_wna16 methods do) so the user's choice wins.
        # Only on request: without the flag the checkpoint keeps SGLang's own fp8 method.
        if user_quant == QUANT_METHOD_NAME and accepts_checkpoint(hf_quant_cfg):
            return QUANT_METHOD_NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
        from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

        skipped = is_layer_skipped(prefix, self.ignored_layers, fused_mapping=self.packed_modules_mapping)
        if isinstance(layer, LinearBase):
            if skipped:
                return UnquantizedLinearMethod()
            from moe_fp8.integrations.sglang.linear import MoeFp8LinearMethod, MoeFp8LinearScheme

            # NOTE: the scheme is set here, before create_weights, because LinearBase picks the loader
            # there: a scheme with requires_weight_loader_v2 routes our ModelWeightParameter /
            # BlockQuantScaleParameter through weight_loader_v2 (the TP-sharding loader), which SGLang
            # otherwise grants only to method classes named in its WEIGHT_LOADER_V2_SUPPORTED list.
            layer.scheme = MoeFp8LinearScheme(self)
            return MoeFp8LinearMethod(self)
        if isinstance(layer, FusedMoE):
            if skipped:
                return UnquantizedFusedMoEMethod(layer.use_triton_kernels, layer.use_flashinfer_trtllm_moe)
            from moe_fp8.integrations.sglang.moe import MoeFp8MoEMethod

            return MoeFp8MoEMethod(self)
        # Attention (no FP8 KV-cache scales in this format), embeddings, lm_head: SGLang's defaults.
        return None

    def get_scaled_act_names(self) -> list[str]:
        return []

    def apply_weight_name_mapper(self, hf_to_sglang_mapper: Any) -> None:
        if self.ignored_layers:
            self.ignored_layers = list(dict.fromkeys(hf_to_sglang_mapper.apply_list(self.ignored_layers)))

    def __repr__(self) -> str:
        return (f"MoeFp8Config(weight_block_size={self.weight_block_size}, "
                f"ignored_layers={len(self.ignored_layers)})")
