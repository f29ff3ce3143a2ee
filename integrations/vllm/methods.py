"""vLLM quantization method ``moe_fp8``: ``MoeFp8Config`` and its linear / fused-MoE methods.

Imported only by ``moe_fp8.integrations.vllm.register`` (vLLM's plugin hook) and by code that already
runs inside vLLM: importing it imports vLLM.

- ``MoeFp8Config`` (``QuantizationConfig``) reads a DeepSeek-V3-format ``quantization_config``
  (``moe_fp8.integrations.vllm.config.parse_quantization_config``) and, through
  ``override_quantization_method``, takes over checkpoints whose config says ``"fp8"`` when the user asks
  for ``--quantization moe_fp8``.
- ``MoeFp8LinearMethod`` (``LinearMethodBase``): ``weight`` fp8 ``[N_rank, K_rank]`` and
  ``weight_scale_inv`` fp32 ``[ceil(N_rank/128), ceil(K_rank/128)]`` as vLLM's own ``ModelWeightParameter``
  / ``BlockQuantScaleParameter``, so vLLM's column / row / merged / QKV loaders shard them;
  ``apply`` = ``moe_fp8.quant.per_token_group`` + ``moe_fp8.fp8_gemm`` (+ bias).
- ``MoeFp8MoEMethod`` (``FusedMoEMethodBase``): ``w13_weight [E_local, 2·I_rank, H]``, ``w2_weight
  [E_local, H, I_rank]`` and their ``*_weight_scale_inv`` block scales, loaded by vLLM's ``RoutedExperts``
  weight loader (block-scale attribute ``quant_method="block"``); ``apply`` runs a vLLM modular kernel made
  of vLLM's prepare/finalize for the deployment and moe_fp8's experts (``experts.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import (
    FusedMoEMethodBase,
    FusedMoeWeightScaleSupported,
    RoutedExperts,
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig, fp8_w8a8_moe_quant_config
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from moe_fp8.integrations import MIN_CAPABILITY, check_platform, no_quantization_config_message
from moe_fp8.integrations.vllm.config import (
    QUANT_METHOD_NAME,
    BlockFp8Settings,
    accepts_checkpoint,
    check_linear_partition,
    check_moe_partition,
    parse_quantization_config,
)
from moe_fp8.integrations.vllm.experts import MoeFp8BatchedExperts, MoeFp8Experts
from moe_fp8.ops import fp8_gemm
from moe_fp8.quant import per_token_group
from moe_fp8.utils import GROUP_K, ceil_div

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.moe_output import UnfinalizedMoEOutput
    from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts
    from vllm.model_executor.models.utils import WeightsMapper

__all__ = ["MoeFp8Config", "MoeFp8LinearMethod", "MoeFp8MoEMethod"]

logger = logging.getLogger("moe_fp8")
Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn
_BLOCK = [GROUP_K, GROUP_K]


class MoeFp8Config(QuantizationConfig):
    """``--quantization moe_fp8``: DeepSeek-V3-format block-FP8 checkpoints on moe_fp8's kernels."""

    def __init__(self, settings: BlockFp8Settings | None = None) -> None:
        if settings is None:
            # vLLM builds `quant_cls()` when the checkpoint's config.json has no quantization_config (our
            # get_config_filenames() is empty): defaults would give a bf16 checkpoint FP8 parameters, cast its
            # weights into them and fail only after the whole load, on unfilled scales
            raise ValueError(no_quantization_config_message("vLLM"))
        check_platform("vLLM")
        super().__init__()
        self.settings = settings
        # Attribute names vLLM's own code reads off a quant config (linear loaders, model code).
        self.weight_block_size = list(self.settings.weight_block_size)
        self.activation_scheme = self.settings.activation_scheme
        self.ignored_layers = list(self.settings.ignored_layers)

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
        return []  # the settings live in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoeFp8Config:
        return cls(parse_quantization_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        # vLLM compares the checkpoint's quant_method ("fp8") with --quantization; returning our name makes
        # it take this config for the checkpoint. Only when asked for: a plain `vllm serve` of an FP8
        # checkpoint keeps vLLM's own fp8 method.
        if user_quant == QUANT_METHOD_NAME and accepts_checkpoint(hf_quant_cfg):
            return QUANT_METHOD_NAME
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        if self.ignored_layers:
            self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)

    def _skipped(self, prefix: str) -> bool:
        return is_layer_skipped(prefix=prefix, ignored_layers=self.ignored_layers,
                                fused_mapping=self.packed_modules_mapping)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if self._skipped(prefix) else MoeFp8LinearMethod(self)
        if isinstance(layer, RoutedExperts):
            if self._skipped(prefix):
                return UnquantizedFusedMoEMethod(layer.moe_config)
            return MoeFp8MoEMethod(self, layer)
        if isinstance(layer, Attention):
            return None  # no FP8 KV-cache scales in these checkpoints; the KV cache follows --kv-cache-dtype
        return None


@register_weight_loader_v2_supported_method
class MoeFp8LinearMethod(LinearMethodBase):
    """Block-FP8 linear layer: ``y = x @ dequant(weight)ᵀ (+ bias)`` via ``moe_fp8.fp8_gemm``."""

    def __init__(self, quant_config: MoeFp8Config) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        check_linear_partition(getattr(layer, "prefix", ""), input_size, output_size, input_size_per_partition,
                               output_partition_sizes)
        weight_loader = extra_weight_attrs.get("weight_loader")
        n, k = sum(output_partition_sizes), input_size_per_partition
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = k
        layer.output_size_per_partition = n
        layer.orig_dtype = params_dtype
        # vLLM's merged / QKV loaders read this to place each part's scales at ceil(offset / 128).
        layer.weight_block_size = list(_BLOCK)

        weight = ModelWeightParameter(data=torch.empty(n, k, dtype=_FP8), input_dim=1, output_dim=0,
                                      weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        # NaN until loaded: a scale the checkpoint did not fill shows up at load time, not as garbage output.
        scale = BlockQuantScaleParameter(
            data=torch.full((ceil_div(n, GROUP_K), ceil_div(k, GROUP_K)), float("nan"), dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        set_weight_attrs(scale, {"scale_type": "weight_scale"})
        layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The checkpoint layout is the kernels' layout: nothing to convert, only check it arrived.
        scale = layer.weight_scale_inv
        if not bool(torch.isfinite(scale).all()):
            raise ValueError(f"moe_fp8: weight_scale_inv of linear layer {getattr(layer, 'prefix', '')!r} has "
                             "entries the checkpoint did not fill (NaN) or that are not finite")

    def apply(self, layer: torch.nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        n, k = layer.weight.shape
        x2 = x.reshape(-1, k).contiguous()
        x_fp8, x_scale = per_token_group(x2)
        out = fp8_gemm(x_fp8, x_scale, layer.weight, layer.weight_scale_inv)
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], n).to(x.dtype)


class MoeFp8MoEMethod(FusedMoEMethodBase):
    """Routed experts in block FP8 on moe_fp8's grouped GEMMs, inside vLLM's modular MoE kernel.

    Supported: TP (each rank's ``I`` a multiple of 128), EP (``expert_map``), DP + EP with the
    all-gather / reduce-scatter all-to-all (standard format) or DeepEP low-latency (batched format),
    CUDA graphs and ``torch.compile``. Refused with an error: other activations than SiLU, expert biases,
    LoRA, EPLB, ``apply_router_weight_on_input``, SwiGLU clamps, padded TP shards and other all-to-all
    backends.
    """

    def __init__(self, quant_config: MoeFp8Config, layer: RoutedExperts) -> None:
        super().__init__(layer.moe_config)
        self.quant_config = quant_config
        self.weight_block_size = list(_BLOCK)
        self._check_supported(layer)

    def _check_supported(self, layer: RoutedExperts) -> None:
        moe, name = self.moe, getattr(layer, "layer_name", "")
        unsupported = []
        if moe.activation != MoEActivation.SILU:
            unsupported.append(f"activation {moe.activation.value!r} (only 'silu')")
        if moe.has_bias:
            unsupported.append("expert biases")
        if moe.is_lora_enabled:
            unsupported.append("LoRA")
        if getattr(layer, "apply_router_weight_on_input", False):
            unsupported.append("apply_router_weight_on_input")
        if any(getattr(moe, a, None) is not None for a in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
            unsupported.append("SwiGLU limit / alpha / beta")
        if moe.tp_shard_with_padding:
            unsupported.append("padded tensor-parallel shards of I")
        pc = moe.moe_parallel_config
        if pc.use_passthrough_all2all or (pc.use_all2all_kernels
                                          and not (pc.use_ag_rs_all2all_kernels or pc.use_deepep_ll_kernels)):
            unsupported.append(f"all-to-all backend {pc.all2all_backend!r} (use 'allgather_reducescatter' or "
                               "'deepep_low_latency')")
        if unsupported:
            raise NotImplementedError(f"moe_fp8: MoE layer {name!r}: not supported: {'; '.join(unsupported)}")

    def create_weights(self, layer: RoutedExperts, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs: Any) -> None:
        check_moe_partition(getattr(layer, "layer_name", ""), hidden_size, intermediate_size_per_partition)
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        hb, ib = ceil_div(h, GROUP_K), i // GROUP_K
        layer.orig_dtype = params_dtype
        layer.weight_block_size = list(_BLOCK)

        def add(name: str, data: Tensor, **attrs: Any) -> None:
            param = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, **attrs})

        # Rows of w13 are [gate | up] per expert, as Fp8FusedMoE; the loader puts w1 (gate) first, w3 second.
        add("w13_weight", torch.empty(e, 2 * i, h, dtype=_FP8))
        add("w2_weight", torch.empty(e, h, i, dtype=_FP8))
        block = {"quant_method": FusedMoeWeightScaleSupported.BLOCK.value}
        add("w13_weight_scale_inv", torch.full((e, 2 * ib, hb), float("nan"), dtype=torch.float32), **block)
        add("w2_weight_scale_inv", torch.full((e, hb, ib), float("nan"), dtype=torch.float32), **block)
        # Dynamic activation scales: no input_scale tensors (vLLM's kernels look for these attributes).
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def get_fused_moe_quant_config(self, layer: RoutedExperts) -> FusedMoEQuantConfig:
        return fp8_w8a8_moe_quant_config(w1_scale=layer.w13_weight_scale_inv, w2_scale=layer.w2_weight_scale_inv,
                                         block_shape=list(_BLOCK))

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
            if not bool(torch.isfinite(getattr(layer, name)).all()):
                raise ValueError(f"moe_fp8: {name} of MoE layer {getattr(layer, 'layer_name', '')!r} has entries "
                                 "the checkpoint did not fill (NaN) or that are not finite")
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = self.make_kernel(layer)

    def make_kernel(self, layer: RoutedExperts) -> mk.FusedMoEKernel:
        """vLLM's prepare/finalize for this deployment + the matching moe_fp8 experts."""
        assert self.moe_quant_config is not None  # set by process_weights_after_loading
        prepare_finalize = maybe_make_prepare_finalize(
            moe=self.moe, quant_config=self.moe_quant_config, routing_tables=layer._expert_routing_tables(),
            allow_new_interface=True)
        if prepare_finalize is None or not isinstance(prepare_finalize, mk.FusedMoEPrepareAndFinalizeModular):
            raise NotImplementedError(f"moe_fp8: no usable prepare/finalize for this deployment, got "
                                      f"{type(prepare_finalize).__name__}")
        experts: mk.FusedMoEExpertsModular
        if prepare_finalize.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
            max_num_tokens = prepare_finalize.max_num_tokens_per_rank()
            if max_num_tokens is None:
                raise NotImplementedError(f"moe_fp8: batched dispatch {type(prepare_finalize).__name__} gives no "
                                          "max tokens per rank")
            experts = MoeFp8BatchedExperts(self.moe, self.moe_quant_config, max_num_tokens=max_num_tokens,
                                           num_dispatchers=prepare_finalize.num_dispatchers())
        else:
            experts = MoeFp8Experts(self.moe, self.moe_quant_config)
        logger.info("moe_fp8: MoE layer %s: %s + %s", getattr(layer, "layer_name", ""),
                    type(prepare_finalize).__name__, type(experts).__name__)
        return mk.FusedMoEKernel(prepare_finalize, experts)

    def apply(self, layer: RoutedExperts, x: Tensor, topk_weights: Tensor, topk_ids: Tensor,
              shared_experts: SharedExperts | None, shared_experts_input: Tensor | None
              ) -> Tensor | UnfinalizedMoEOutput:
        if self.moe_kernel is None:
            raise RuntimeError("moe_fp8: MoE apply() before process_weights_after_loading()")
        return self.moe_kernel.apply(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=layer.activation,
            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input, shared_experts=shared_experts,
            shared_experts_input=shared_experts_input)
