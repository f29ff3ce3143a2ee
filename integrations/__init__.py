"""Serving-engine integrations (installed as ``moe_fp8.integrations``): ``vllm``, ``sglang``, ``transformers``."""

from __future__ import annotations


def no_quantization_config_message(engine: str) -> str:
    """Why ``--quantization moe_fp8`` refuses a checkpoint without a ``quantization_config`` (both engines then
    build the method's config with no arguments)."""
    return (f"--quantization moe_fp8: the checkpoint's config.json has no quantization_config, so {engine} would "
            "build moe_fp8's config with defaults; moe_fp8 serves block-FP8 checkpoints (DeepSeek-V3 format: "
            "quant_method 'fp8', weight_block_size [128, 128]). Quantize this checkpoint first "
            "(`moe-fp8 quantize`) or serve it without --quantization moe_fp8")
