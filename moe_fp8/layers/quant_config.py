"""A checkpoint's ``quantization_config``, read the same way by the loaders (``CheckpointReader``) and every engine.

A DeepSeek-V3-format checkpoint says, in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

``parse_quantization_config`` turns that into ``BlockFp8Settings`` or raises ``ValueError`` naming the field
it cannot run: another block size, static activation scales, a format other than e4m3, a per-tensor FP8
checkpoint (no ``weight_block_size``), an unknown ``scale_fmt`` or another ``quant_method``. The checkpoint
reader and the vLLM, SGLang and transformers integrations all use it, so a checkpoint is accepted or refused
alike by each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from moe_fp8.utils import GROUP_K

__all__ = [
    "ACCEPTED_QUANT_METHODS",
    "QUANT_METHOD_NAME",
    "BlockFp8Settings",
    "accepts_checkpoint",
    "parse_quantization_config",
]

# The name users pass: `--quantization moe_fp8`, in vLLM and SGLang alike.
QUANT_METHOD_NAME = "moe_fp8"
# `quant_method` values of checkpoints we run: DeepSeek's own "fp8", or our name written into a config.
ACCEPTED_QUANT_METHODS = ("fp8", QUANT_METHOD_NAME)
BLOCK = (GROUP_K, GROUP_K)
# Formats meaning FP8 e4m3 (torch.float8_e4m3fn): DeepSeek writes "e4m3"; some exporters the dtype name.
_E4M3_NAMES = ("e4m3", "float8_e4m3fn")
# DeepSeek-V3.1 adds "scale_fmt": "ue8m0" (power-of-two weight scales, and UE8M0 activation scales in its
# own kernels). The weight scales are still FP32 multipliers to us, so the weights load as they are;
# activations keep FP32 scales (finer than powers of two), as vLLM's and SGLang's own Hopper paths do.
_SCALE_FMTS = (None, "ue8m0", "float32")


@dataclasses.dataclass(frozen=True)
class BlockFp8Settings:
    """What moe_fp8 takes from a block-FP8 ``quantization_config``.

    ``ignored_layers``: module names kept unquantized, as the checkpoint lists them (``ignored_layers`` or,
    as vLLM's fp8 reads it, ``modules_to_not_convert``); ``packed_modules_mapping``: fused module →
    checkpoint shards, if the config gives one. ``weight_block_size`` is always ``(128, 128)`` and
    activations are always dynamic per token per 128 columns (anything else is refused by the parser).
    """

    ignored_layers: tuple[str, ...] = ()
    packed_modules_mapping: Mapping[str, list[str]] = dataclasses.field(default_factory=dict)
    weight_block_size: tuple[int, int] = BLOCK
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    scale_fmt: str | None = None


def accepts_checkpoint(hf_quant_cfg: Mapping[str, Any] | None) -> bool:
    """True when ``hf_quant_cfg`` names a quant_method moe_fp8 takes over (``"fp8"`` or ``"moe_fp8"``).

    For the engines' method-compatibility hooks (``override_quantization_method``): only the method name is
    looked at; ``parse_quantization_config`` then refuses, with a reason, what we cannot run.
    """
    if not isinstance(hf_quant_cfg, Mapping):
        return False
    method = hf_quant_cfg.get("quant_method")
    return isinstance(method, str) and method.lower() in ACCEPTED_QUANT_METHODS


def _str_list(name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"moe_fp8: quantization_config.{name} must be a list of module names, got {value!r}")
    return tuple(value)


def parse_quantization_config(cfg: Mapping[str, Any]) -> BlockFp8Settings:
    """Validate a checkpoint's ``quantization_config`` dict and return the settings (``ValueError`` if unsupported).

    Required: ``quant_method`` in ``("fp8", "moe_fp8")`` (any case) and ``weight_block_size == [128, 128]``
    (two ints). Optional: ``fmt`` (default ``"e4m3"``; only e4m3), ``activation_scheme`` (default
    ``"dynamic"``; only dynamic), ``scale_fmt`` (absent, ``"ue8m0"`` or ``"float32"``), ``ignored_layers`` /
    ``modules_to_not_convert`` (lists of module names), ``packed_modules_mapping`` (a dict). Other keys are
    ignored.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"moe_fp8: quantization_config must be a dict, got {type(cfg).__name__}")
    if not accepts_checkpoint(cfg):
        raise ValueError(f"moe_fp8: quantization_config.quant_method must be one of {ACCEPTED_QUANT_METHODS} "
                         f"(a block-FP8 checkpoint in the DeepSeek-V3 format), got {cfg.get('quant_method')!r}")

    fmt = cfg.get("fmt")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in _E4M3_NAMES):
        raise ValueError(f"moe_fp8: quantization_config.fmt must be 'e4m3' (torch.float8_e4m3fn weights), got "
                         f"{fmt!r}; e5m2 and hybrid formats are not supported")

    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"moe_fp8: quantization_config.activation_scheme must be 'dynamic' (activations are "
                         f"quantized per token per {GROUP_K} columns at run time), got {scheme!r}; static "
                         "activation scales (input_scale tensors) are not supported")

    block = cfg.get("weight_block_size")
    if block is None:
        raise ValueError(f"moe_fp8: quantization_config.weight_block_size is missing: moe_fp8 runs block-FP8 "
                         f"checkpoints with weight_block_size = {list(BLOCK)} (one FP32 weight_scale_inv per "
                         "128x128 block); per-tensor / per-channel FP8 checkpoints are not supported, use the "
                         "engine's own fp8 method for them")
    if (not isinstance(block, Sequence) or isinstance(block, str) or [type(b) for b in block] != [int, int]
            or tuple(block) != BLOCK):
        raise ValueError(f"moe_fp8: quantization_config.weight_block_size must be {list(BLOCK)} (the kernels' "
                         f"scale block), got {block!r}")

    scale_fmt = cfg.get("scale_fmt")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"moe_fp8: quantization_config.scale_fmt must be absent or one of "
                         f"{[f for f in _SCALE_FMTS if f]}, got {scale_fmt!r}")

    ignored = _str_list("ignored_layers", cfg.get("ignored_layers"))
    if not ignored:
        ignored = _str_list("modules_to_not_convert", cfg.get("modules_to_not_convert"))
    packed = cfg.get("packed_modules_mapping") or {}
    if not isinstance(packed, Mapping):
        raise ValueError(f"moe_fp8: quantization_config.packed_modules_mapping must be a dict, got {packed!r}")
    return BlockFp8Settings(ignored_layers=ignored, packed_modules_mapping=dict(packed), scale_fmt=scale_fmt)
