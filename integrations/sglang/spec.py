"""Parse a checkpoint's ``quantization_config`` for the SGLang integration, without importing SGLang.

The rules are ``moe_fp8.layers.quant_config``'s (shared with vLLM); SGLang's module names may or may
not start with ``model.``, so each ignored layer is listed both ways. Kept apart from the SGLang classes so
``moe_fp8.integrations.sglang`` imports nothing heavy until ``enable()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moe_fp8.layers.quant_config import ACCEPTED_QUANT_METHODS, QUANT_METHOD_NAME, BlockFp8Settings
from moe_fp8.layers.quant_config import parse_quantization_config as _parse

__all__ = ["ACCEPTED_QUANT_METHODS", "QUANT_METHOD_NAME", "BlockFp8Settings", "parse_quantization_config"]


def parse_quantization_config(config: Mapping[str, Any]) -> BlockFp8Settings:
    """``moe_fp8.layers.quant_config.parse_quantization_config`` (``ValueError`` naming the field it
    cannot serve), with every ignored layer listed with and without a leading ``model.``."""
    settings = _parse(config)
    names: list[str] = []
    for name in settings.ignored_layers:
        base = name.removeprefix("model.")
        names += [base, f"model.{base}"]
    return dataclasses.replace(settings, ignored_layers=tuple(dict.fromkeys(names)))
