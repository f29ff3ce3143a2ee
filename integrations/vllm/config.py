"""Pure-Python half of the vLLM integration: the checkpoint's ``quantization_config`` and the shard rules.

Nothing here imports vLLM, so CI (which has no vLLM) tests it, and ``import moe_fp8`` stays free of it.

A DeepSeek-V3-format checkpoint says, in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

``parse_quantization_config`` turns that into ``MoeFp8QuantSettings`` or raises ``ValueError`` naming the
field it cannot run: another block size, static activation scales, a format other than e4m3, a per-tensor
FP8 checkpoint (no ``weight_block_size``), or another ``quant_method``.

The shard rules (``check_linear_partition``, ``check_moe_partition``) say which tensor-parallel splits a
block-FP8 weight can take: a split may only cut at 128-element scale-block boundaries (one
``weight_scale_inv`` entry per 128×128 block), and what is left must suit the GEMM kernels (DESIGN §2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from moe_fp8.utils import GROUP_K
from moe_fp8.validation import K_ALIGN, N_ALIGN

__all__ = [
    "ACCEPTED_QUANT_METHODS",
    "QUANT_METHOD_NAME",
    "MoeFp8QuantSettings",
    "accepts_checkpoint",
    "check_linear_partition",
    "check_moe_partition",
    "parse_quantization_config",
]

# The name users pass: `vllm serve CKPT --quantization moe_fp8`.
QUANT_METHOD_NAME = "moe_fp8"
# `quant_method` values of checkpoints we run: DeepSeek's own "fp8", or our name written into a config.
ACCEPTED_QUANT_METHODS = ("fp8", QUANT_METHOD_NAME)
_BLOCK = (GROUP_K, GROUP_K)
# Formats meaning FP8 e4m3 (torch.float8_e4m3fn): DeepSeek writes "e4m3"; some exporters the dtype name.
_E4M3_NAMES = ("e4m3", "float8_e4m3fn")
# DeepSeek-V3.1 adds "scale_fmt": "ue8m0" (power-of-two weight scales). They are still FP32 multipliers to
# us, so the weights load as they are; activations keep FP32 scales, as vLLM's own Hopper path does.
_SCALE_FMTS = (None, "ue8m0", "float32")


@dataclasses.dataclass(frozen=True)
class MoeFp8QuantSettings:
    """What moe_fp8 takes from a checkpoint's ``quantization_config``.

    ``ignored_layers``: module names kept unquantized (``ignored_layers`` or, as vLLM's fp8 reads it,
    ``modules_to_not_convert``); ``weight_block_size`` is always ``(128, 128)`` and activations are
    always dynamic per token per 128 columns (anything else is refused by the parser).
    """

    ignored_layers: tuple[str, ...] = ()
    weight_block_size: tuple[int, int] = _BLOCK
    activation_scheme: str = "dynamic"
    fmt: str = "e4m3"
    scale_fmt: str | None = None


def accepts_checkpoint(hf_quant_cfg: Mapping[str, Any] | None) -> bool:
    """True when ``hf_quant_cfg`` names a quant_method moe_fp8 takes over (``"fp8"`` or ``"moe_fp8"``).

    Used by vLLM's method-compatibility check (``override_quantization_method``): only the method name is
    looked at here; ``parse_quantization_config`` then refuses, with a reason, what we cannot run.
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


def parse_quantization_config(cfg: Mapping[str, Any]) -> MoeFp8QuantSettings:
    """Validate a checkpoint's ``quantization_config`` dict and return the settings (``ValueError`` if unsupported).

    Required: ``quant_method`` in ``("fp8", "moe_fp8")`` and ``weight_block_size == [128, 128]``.
    Optional: ``fmt`` (default ``"e4m3"``; only e4m3), ``activation_scheme`` (default ``"dynamic"``; only
    dynamic), ``scale_fmt`` (absent, ``"ue8m0"`` or ``"float32"``), ``ignored_layers`` /
    ``modules_to_not_convert`` (lists of module names). Other keys are ignored.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"moe_fp8: quantization_config must be a dict, got {type(cfg).__name__}")
    method = cfg.get("quant_method")
    if not (isinstance(method, str) and method.lower() in ACCEPTED_QUANT_METHODS):
        raise ValueError(f"moe_fp8: quantization_config.quant_method must be one of {ACCEPTED_QUANT_METHODS} "
                         f"(a block-FP8 checkpoint in the DeepSeek-V3 format), got {method!r}")

    fmt = cfg.get("fmt", "e4m3")
    if not isinstance(fmt, str) or fmt.lower() not in _E4M3_NAMES:
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
                         f"checkpoints with weight_block_size = {list(_BLOCK)} (one FP32 weight_scale_inv per "
                         "128x128 block); per-tensor / per-channel FP8 checkpoints are not supported, use "
                         "vLLM's --quantization fp8 for them")
    if (not isinstance(block, Sequence) or isinstance(block, str) or len(block) != 2
            or tuple(block) != _BLOCK or any(isinstance(b, bool) for b in block)):
        raise ValueError(f"moe_fp8: quantization_config.weight_block_size must be {list(_BLOCK)}, got {block!r}")

    scale_fmt = cfg.get("scale_fmt")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"moe_fp8: quantization_config.scale_fmt must be absent or one of "
                         f"{[f for f in _SCALE_FMTS if f]}, got {scale_fmt!r}")

    ignored = _str_list("ignored_layers", cfg.get("ignored_layers"))
    if not ignored:
        ignored = _str_list("modules_to_not_convert", cfg.get("modules_to_not_convert"))
    return MoeFp8QuantSettings(ignored_layers=ignored, fmt="e4m3", scale_fmt=scale_fmt)


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
