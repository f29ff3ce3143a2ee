"""Block-FP8 linear layers for SGLang: ``MoeFp8LinearScheme`` (weights + forward) and ``MoeFp8LinearMethod``.

Parameters, per layer (SGLang's TP shard of it): ``weight`` ``float8_e4m3fn [N, K]`` as a
``ModelWeightParameter`` and ``weight_scale_inv`` ``float32 [ceil(N/128), ceil(K/128)]`` as a
``BlockQuantScaleParameter`` (``format_ue8m0 = False``), so SGLang's ``weight_loader_v2`` shards both for
column-, row-parallel, merged (gate/up) and QKV layers exactly as it does for its own ``fp8`` method.
Forward: ``moe_fp8.quant.per_token_group`` then ``moe_fp8.fp8_gemm`` (+ bias); the ops pick the Hopper
kernel on sm_90 and the PyTorch reference on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sglang.srt.layers.parameter import BlockQuantScaleParameter, ModelWeightParameter
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from sglang.srt.layers.quantization.base_scheme import BaseLinearScheme
from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

from moe_fp8.layers.linear import _flatten_tokens, check_fp8_linear_shape
from moe_fp8.ops import fp8_gemm
from moe_fp8.quant import per_token_group
from moe_fp8.utils import GROUP_K

__all__ = ["MoeFp8LinearMethod", "MoeFp8LinearScheme"]

_FP8 = torch.float8_e4m3fn


class MoeFp8LinearScheme(BaseLinearScheme):
    """Weight creation and forward of one block-FP8 linear layer (set as ``layer.scheme``)."""

    # LinearBase gives weight_loader_v2 (the loader that calls our parameters' TP-aware load_* methods)
    # to layers whose scheme asks for it.
    requires_weight_loader_v2 = True

    def __init__(self, quant_config: Any) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any = None, skip_block_quant_check: bool = False,
                       **_: Any) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        check_fp8_linear_shape(k, n, name=f"moe_fp8 {type(layer).__name__}")
        # SGLang's own rule for block-scale sharding (a TP shard or a merged part must not cut a
        # 128-block): the same check its fp8 method applies to the same parameters.
        Fp8LinearMethod.validate_block_quant_shapes(layer, self.quant_config, input_size, k, output_size, n,
                                                    output_partition_sizes, skip_block_quant_check)
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype

        weight = ModelWeightParameter(data=torch.empty(n, k, dtype=_FP8), input_dim=1, output_dim=0,
                                      weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        # NaN until loaded: process_weights_after_loading names a layer whose scales never arrived.
        scale = BlockQuantScaleParameter(
            data=torch.full((math.ceil(n / GROUP_K), math.ceil(k / GROUP_K)), math.nan, dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        scale.format_ue8m0 = False  # read by SGLang's DeepSeek code (kv_b_proj post-processing)
        layer.register_parameter("weight_scale_inv", scale)
        layer.register_parameter("input_scale", None)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # One host sync per layer at load time, never in forward.
        if bool(torch.isnan(layer.weight_scale_inv.data).any()):
            raise ValueError(f"moe_fp8: weight_scale_inv of {type(layer).__name__} "
                             f"[{layer.output_size_per_partition}, {layer.input_size_per_partition}] was not "
                             "(fully) loaded: the checkpoint must store every quantized linear as <name>.weight "
                             "(fp8) + <name>.weight_scale_inv (fp32 128x128 blocks)")

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        n = layer.output_size_per_partition
        x2 = _flatten_tokens(x, layer.input_size_per_partition, "moe_fp8 linear")
        x_fp8, x_scale = per_token_group(x2)
        out = fp8_gemm(x_fp8, x_scale, layer.weight, layer.weight_scale_inv)  # bf16 [M, N]
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], n).to(x.dtype)


class MoeFp8LinearMethod(LinearMethodBase):
    """The ``quant_method`` SGLang calls for each linear layer; delegates to the layer's scheme."""

    def __init__(self, quant_config: Any) -> None:
        self.quant_config = quant_config
        # Read by SGLang's linear loaders (via quant_config) and DeepSeek's kv_b_proj post-processing.
        self.weight_block_size = quant_config.weight_block_size
        self.block_quant = True

    @staticmethod
    def _scheme(layer: torch.nn.Module) -> MoeFp8LinearScheme:
        scheme = getattr(layer, "scheme", None)
        if not isinstance(scheme, MoeFp8LinearScheme):
            raise RuntimeError(f"moe_fp8: {type(layer).__name__} has scheme {scheme!r}, not MoeFp8LinearScheme "
                               "(MoeFp8Config.get_quant_method sets it; was the method attached by hand?)")
        return scheme

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        self._scheme(layer).create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                           output_size, params_dtype, **extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._scheme(layer).process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._scheme(layer).apply_weights(layer, x, bias)
