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

import logging

from moe_fp8.backends import ENV_STRICT
from moe_fp8.integrations.vllm.config import QUANT_METHOD_NAME
from moe_fp8.utils import env, truthy

__all__ = ["QUANT_METHOD_NAME", "TESTED_VLLM_VERSION", "register"]

logger = logging.getLogger("moe_fp8")

# The release `moe-fp8[vllm]` pins and scripts/engine_check.sh vllm tests (docs/engines/vllm-cpu-check.md).
TESTED_VLLM_VERSION = "0.32.0"

_registered = False


def register() -> bool:
    """Register the ``moe_fp8`` quantization method with vLLM; returns whether it is registered. Idempotent
    (vLLM loads plugins in every process, and may call this more than once in one).

    vLLM calls this for every command (``vllm serve``, ``vllm bench``, ...), before it knows the quantization
    asked for, and an exception here would stop them all. So when the installed vLLM lacks the interfaces the
    method is built on (a release other than ``TESTED_VLLM_VERSION``), this logs a warning naming both
    versions and the missing piece, leaves ``--quantization moe_fp8`` unregistered and returns ``False``;
    ``MOE_FP8_STRICT=1`` raises instead. Without vLLM at all it raises ``ImportError``.
    """
    global _registered
    if _registered:
        return True
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("moe_fp8.integrations.vllm needs vLLM: pip install 'moe-fp8[vllm]'") from exc
    version = getattr(vllm, "__version__", "unknown")
    try:
        from vllm.model_executor.layers.quantization import register_quantization_config

        from moe_fp8.integrations.vllm.methods import MoeFp8Config
    except (ImportError, AttributeError) as exc:
        why = (f"vLLM {version} lacks an interface moe_fp8's quantization method uses ({type(exc).__name__}: "
               f"{exc}); it is written for vLLM {TESTED_VLLM_VERSION} (pip install 'moe-fp8[vllm]')")
        if truthy(env(ENV_STRICT)):
            raise ImportError(f"{ENV_STRICT}=1: {why}") from exc
        logger.warning("moe_fp8: --quantization %s is not registered: %s", QUANT_METHOD_NAME, why)
        return False
    if version != TESTED_VLLM_VERSION:
        logger.warning("moe_fp8: vLLM %s is not the tested %s; registering --quantization %s anyway",
                       version, TESTED_VLLM_VERSION, QUANT_METHOD_NAME)
    register_quantization_config(QUANT_METHOD_NAME)(MoeFp8Config)
    _registered = True
    return True
