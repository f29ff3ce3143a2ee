"""vLLM integration: ``vllm serve CKPT --quantization moe_fp8`` runs DeepSeek-V3-format block-FP8 checkpoints
on moe_fp8's kernels.

Installing moe-fp8 next to vLLM registers the entry point ``moe_fp8 = moe_fp8.integrations.vllm:register``
in the group ``vllm.general_plugins``; vLLM calls ``register()`` in every process it starts, which adds the
quantization method ``moe_fp8`` (``methods.MoeFp8Config``) with vLLM's ``register_quantization_config``.

Importing this package does not import vLLM (``register`` imports it when called), so ``import moe_fp8``
stays light and CI without vLLM can test ``config`` (the pure-Python parsing and shard rules).

Modules: ``config`` (no vLLM), ``methods`` (``MoeFp8Config``, linear and fused-MoE methods), ``experts``
(moe_fp8's experts as vLLM modular-kernel experts). See README "Use with vLLM / SGLang".
"""

from __future__ import annotations

from moe_fp8.integrations.vllm.config import QUANT_METHOD_NAME

__all__ = ["QUANT_METHOD_NAME", "register"]

_registered = False


def register() -> None:
    """Register the ``moe_fp8`` quantization method with vLLM. Idempotent (vLLM loads plugins in every
    process, and may call this more than once in one)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from moe_fp8.integrations.vllm.methods import MoeFp8Config

    register_quantization_config(QUANT_METHOD_NAME)(MoeFp8Config)
    _registered = True
