"""Parse a checkpoint's ``quantization_config`` for the SGLang integration, without importing SGLang.

Kept apart from the SGLang classes so the rules (and their error messages) are testable where SGLang is
not installed, and so ``moe_fp8.integrations.sglang`` imports nothing heavy until ``enable()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["ACCEPTED_QUANT_METHODS", "QUANT_METHOD_NAME", "BlockFp8Spec", "parse_quantization_config"]

# The name users pass as `--quantization`, and the one SGLang's registry holds our config under.
QUANT_METHOD_NAME = "moe_fp8"
# `quant_method` values of checkpoints we can serve: DeepSeek-V3 format says "fp8".
ACCEPTED_QUANT_METHODS = ("fp8", QUANT_METHOD_NAME)
BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True)
class BlockFp8Spec:
    """What the integration needs from a DeepSeek-V3-style block-FP8 ``quantization_config``.

    ``ignored_layers``: module prefixes kept unquantized (``ignored_layers`` / ``modules_to_not_convert``),
    each with and without a leading ``model.`` (SGLang's module names and HF names differ there).
    ``packed_modules_mapping``: fused module → checkpoint shards, if the checkpoint gives one.
    """

    ignored_layers: tuple[str, ...] = ()
    packed_modules_mapping: Mapping[str, list[str]] = dataclasses.field(default_factory=dict)
    weight_block_size: tuple[int, int] = BLOCK


def _field(config: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in config:
            return config[key]
    return None


def parse_quantization_config(config: Mapping[str, Any]) -> BlockFp8Spec:
    """Validate a ``quantization_config`` dict and return its ``BlockFp8Spec``.

    Accepted: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128]}`` (DeepSeek-V3; ``fmt`` and ``activation_scheme`` may be absent), plus
    optional ``ignored_layers`` / ``modules_to_not_convert`` and ``packed_modules_mapping``.

    Raises ``ValueError`` naming the offending field for anything the kernels cannot serve: another
    ``quant_method``, ``fmt`` other than e4m3, static activation scales, a missing or non-[128, 128]
    ``weight_block_size`` (per-tensor / per-channel FP8, MXFP8), or a ``scale_fmt`` (UE8M0 activation
    scales, DeepSeek-V3.1) — the integration quantizes activations with FP32 scales only.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"quantization_config must be a dict, got {type(config).__name__}")
    quant_method = str(config.get("quant_method", "")).lower()
    if quant_method not in ACCEPTED_QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method must be one of {ACCEPTED_QUANT_METHODS} for "
                         f"{QUANT_METHOD_NAME} (a block-FP8 checkpoint), got {config.get('quant_method')!r}")
    fmt = config.get("fmt")
    if fmt is not None and str(fmt).lower() != "e4m3":
        raise ValueError(f"quantization_config.fmt must be 'e4m3' (float8_e4m3fn weights), got {fmt!r}")
    activation_scheme = config.get("activation_scheme", "dynamic")
    if activation_scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme must be 'dynamic': {QUANT_METHOD_NAME} "
                         "quantizes activations per token per 128 columns at run time and has no use for "
                         f"static activation scales; got {activation_scheme!r}")
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(f"quantization_config.weight_block_size is missing: {QUANT_METHOD_NAME} serves "
                         "block-FP8 checkpoints with weight_block_size [128, 128] (DeepSeek-V3 format), not "
                         "per-tensor or per-channel FP8")
    if not isinstance(block, (list, tuple)) or [type(v) for v in block] != [int, int] or tuple(block) != BLOCK:
        raise ValueError(f"quantization_config.weight_block_size must be [128, 128] (the kernels' scale "
                         f"block), got {block!r}")
    scale_fmt = config.get("scale_fmt")
    if scale_fmt is not None:
        raise ValueError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported: the SGLang "
                         f"integration quantizes activations with FP32 scales only (remove scale_fmt, or "
                         "serve this checkpoint with SGLang's own fp8 method)")

    ignored = _field(config, "ignored_layers", "modules_to_not_convert") or []
    if not isinstance(ignored, (list, tuple)) or not all(isinstance(v, str) for v in ignored):
        raise ValueError(f"quantization_config.ignored_layers must be a list of module names, got {ignored!r}")
    normalized: list[str] = []
    for name in ignored:
        base = name.removeprefix("model.")
        normalized += [base, f"model.{base}"]
    packed = config.get("packed_modules_mapping") or {}
    if not isinstance(packed, Mapping):
        raise ValueError(f"quantization_config.packed_modules_mapping must be a dict, got {packed!r}")
    return BlockFp8Spec(ignored_layers=tuple(dict.fromkeys(normalized)), packed_modules_mapping=dict(packed))
