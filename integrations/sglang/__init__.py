"""SGLang: serve block-FP8 (DeepSeek-V3-format) checkpoints on moe_fp8's GEMM and MoE kernels.

Installed as ``moe_fp8.integrations.sglang``. With ``moe-fp8`` installed next to SGLang::

    python -m sglang.launch_server --model-path /path/to/DeepSeek-V3 --quantization moe_fp8

SGLang loads its general plugins (entry-point group ``sglang.srt.plugins``) in every process it starts
(launcher, schedulers, engine) before it parses arguments; ``moe-fp8`` declares ``enable`` there, so the
flag needs no code. In a process that skips plugins (``SGLANG_PLUGINS`` set without ``moe_fp8``), call
``moe_fp8.integrations.sglang.enable()`` first — before SGLang starts its worker processes, which then
load the plugin themselves only if it is allowed, so prefer allowing it.

``enable()`` registers a quantization method ``moe_fp8`` through SGLang's own extension points, and patches
nothing:

- ``sglang.srt.layers.quantization.QUANTIZATION_METHODS["moe_fp8"] = MoeFp8Config`` — the registry that
  ``get_quantization_config`` and ``ModelConfig`` read (SGLang 0.5 has no registration function for it);
- ``sglang.srt.server_args.add_quantization_method_choices(["moe_fp8"])`` — SGLang's hook for plugins to
  extend the ``--quantization`` choices.

``MoeFp8Config`` accepts the checkpoint's ``quantization_config`` (``quant_method: "fp8"``, e4m3, dynamic
activations, ``weight_block_size: [128, 128]``; ``moe_fp8.integrations.sglang.spec`` has the rules) and
gives every linear layer ``MoeFp8LinearMethod`` (``weight`` fp8 + ``weight_scale_inv`` fp32 blocks, SGLang's
parameter classes so its TP loaders shard them; forward ``quant.per_token_group`` + ``fp8_gemm``) and every
``FusedMoE`` ``MoeFp8MoEMethod`` (``w13_weight`` / ``w2_weight`` + ``_scale_inv``, filled by SGLang's
``FusedMoE.weight_loader``; forward: SGLang's top-k routing, then ``moe_fp8.layers.moe.experts_contiguous`` / ``experts_masked`` —
dispatch, grouped GEMM, fused SiLU·mul + quant, grouped GEMM — and ``combine``).

Importing this module does not import SGLang; ``enable()`` and the classes (loaded on first use) do.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from moe_fp8.integrations.sglang.spec import QUANT_METHOD_NAME, BlockFp8Settings, parse_quantization_config

__all__ = [
    "MIN_SGLANG_VERSION",
    "QUANT_METHOD_NAME",
    "TESTED_SGLANG_VERSION",
    "BlockFp8Settings",
    "check_sglang_version",
    "enable",
    "is_enabled",
    "parse_quantization_config",
]

logger = logging.getLogger("moe_fp8")

# The release this integration was written against and tested with (tests/test_sglang_plugin.py,
# docs/engines/sglang-cpu-check.md). Older releases lack the interfaces it uses (scheme-driven
# weight_loader_v2, FusedMoEMethodBase.create_moe_runner / get_moe_runner_backend, the plugin group);
# newer ones are tried with a warning.
TESTED_SGLANG_VERSION = "0.5.23"
MIN_SGLANG_VERSION = (0, 5, 23)

_LAZY = {
    "MoeFp8Config": "moe_fp8.integrations.sglang.config",
    "MoeFp8LinearMethod": "moe_fp8.integrations.sglang.linear",
    "MoeFp8LinearScheme": "moe_fp8.integrations.sglang.linear",
    "MoeFp8MoEMethod": "moe_fp8.integrations.sglang.moe",
}
_warned_untested = False


def _version_tuple(version: str) -> tuple[int, int, int]:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"cannot read SGLang's version {version!r}")
    return tuple(int(v) for v in match.groups())  # type: ignore[return-value]


def check_sglang_version(version: str) -> None:
    """Raise ``RuntimeError`` for an SGLang older than ``MIN_SGLANG_VERSION``; warn once for a newer,
    untested release than ``TESTED_SGLANG_VERSION``."""
    global _warned_untested
    found = _version_tuple(version)
    if found < MIN_SGLANG_VERSION:
        raise RuntimeError(
            f"moe_fp8's SGLang integration needs sglang >= {'.'.join(map(str, MIN_SGLANG_VERSION))} "
            f"(tested with {TESTED_SGLANG_VERSION}), found {version}: pip install 'moe-fp8[sglang]'")
    if found > _version_tuple(TESTED_SGLANG_VERSION) and not _warned_untested:
        _warned_untested = True
        logger.warning("moe_fp8: SGLang %s is newer than the tested %s; registering the moe_fp8 "
                       "quantization method anyway", version, TESTED_SGLANG_VERSION)


def enable() -> Any:
    """Register the ``moe_fp8`` quantization method with SGLang (idempotent); returns ``MoeFp8Config``.

    Raises ``ImportError`` without SGLang, ``RuntimeError`` for an SGLang older than the tested interface or
    when another package already registered a different class under ``moe_fp8``.
    """
    try:
        import sglang
    except ImportError as exc:
        raise ImportError("moe_fp8.integrations.sglang needs SGLang: pip install 'moe-fp8[sglang]'") from exc
    check_sglang_version(getattr(sglang, "__version__", "0.0.0"))

    from sglang.srt.layers import quantization as sglang_quantization
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from moe_fp8.integrations.sglang.config import MoeFp8Config

    registry = sglang_quantization.QUANTIZATION_METHODS
    current = registry.get(QUANT_METHOD_NAME)
    if current is not None and current is not MoeFp8Config:
        raise RuntimeError(f"SGLang's quantization registry already maps {QUANT_METHOD_NAME!r} to "
                           f"{current.__module__}.{current.__qualname__}; refusing to replace it")
    registry[QUANT_METHOD_NAME] = MoeFp8Config
    if QUANT_METHOD_NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANT_METHOD_NAME])
    return MoeFp8Config


def is_enabled() -> bool:
    """Whether SGLang's registry (in this process) maps ``moe_fp8`` to our config. Imports SGLang only if
    it is already imported."""
    import sys

    module = sys.modules.get("sglang.srt.layers.quantization")
    if module is None:
        return False
    config = sys.modules.get("moe_fp8.integrations.sglang.config")
    return config is not None and module.QUANTIZATION_METHODS.get(QUANT_METHOD_NAME) is config.MoeFp8Config


def __getattr__(name: str) -> Any:
    # The SGLang-facing classes import SGLang: load them on first use only.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
