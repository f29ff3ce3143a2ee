"""``MoeFp8MoEMethod``: SGLang ``FusedMoE`` quant method running moe_fp8's block-FP8 expert pipeline.

Parameters (this rank's experts and TP shard, the layout of ``moe_fp8.layers.Fp8FusedMoE``):
``w13_weight`` fp8 ``[E_local, 2I, H]`` (rows ``[gate | up]``), ``w13_weight_scale_inv`` fp32
``[E_local, 2I/128, ceil(H/128)]``, ``w2_weight`` fp8 ``[E_local, H, I]``, ``w2_weight_scale_inv`` fp32
``[E_local, ceil(H/128), I/128]``. They carry SGLang's ``weight_loader`` and, on the scales,
``quant_method = "block"``, so ``FusedMoE.weight_loader`` fills them from per-expert checkpoint tensors
(``experts.{e}.{gate,up,down}_proj.weight`` / ``.weight_scale_inv``), mapping global to local experts
and slicing ``I`` for tensor parallelism.

Forward (``apply``): SGLang's router already chose experts (``StandardTopKOutput``: weights, *local*
ids, -1 = not computed on this rank or a padding token). Then ``per_token_group`` →
``moe_fp8.layers.moe.experts_contiguous`` / ``experts_masked`` (dispatch, grouped GEMM, fused SiLU·mul + quant,
grouped GEMM; masked layout for small batches and under CUDA graph capture, contiguous for large ones —
``choose_dispatch_path``) →
``combine`` with the top-k weights: the routed experts' output (the model adds shared experts and
all-reduces). It is scaled by ``routed_scaling_factor`` where SGLang's own MoE runners scale it, on CUDA;
elsewhere (the CPU the tests run on) SGLang's models multiply the experts' output themselves
(``deepseek_v2``: ``if not _is_cuda and ...: final_hidden_states *= routed_scaling_factor``), so scaling
here too would apply it twice. ``MoeFp8MoEMethod.applies_routed_scaling`` says which.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from moe_fp8.layers.linear import check_fp8_linear_shape
from moe_fp8.layers.moe import (
    PATHS,
    choose_dispatch_path,
    default_masked_max_tokens,
    experts_contiguous,
    experts_masked,
)
from moe_fp8.ops import combine
from moe_fp8.quant import per_token_group
from moe_fp8.utils import GROUP_K, ceil_div

__all__ = ["MoeFp8MoEMethod"]

_FP8 = torch.float8_e4m3fn


def _frozen(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


def sglang_expects_scaled_experts() -> bool:
    """Whether SGLang expects a MoE method's output already multiplied by ``routed_scaling_factor``: on CUDA its
    runners do it; off CUDA its models do it after the experts. (Other accelerators are refused by the config.)"""
    from sglang.srt.utils import is_cuda

    return bool(is_cuda())


class MoeFp8MoEMethod(FusedMoEMethodBase):
    """Block-FP8 experts on moe_fp8's grouped GEMMs, for SGLang's ``FusedMoE`` (standard dispatcher).

    ``path``: ``"auto"`` (default; see ``moe_fp8.layers.moe.choose_dispatch_path``), or force ``"contiguous"`` /
    ``"masked"`` (both give the same result). ``masked_max_tokens``: the auto crossover; default
    ``moe_fp8.layers.default_masked_max_tokens(E_local)``.
    """

    def __init__(self, quant_config: Any, path: str = "auto", masked_max_tokens: int | None = None) -> None:
        if path not in PATHS:
            raise ValueError(f"MoeFp8MoEMethod: path must be one of {PATHS}, got {path!r}")
        self.quant_config = quant_config
        self.weight_block_size = quant_config.weight_block_size
        self.block_quant = True
        self.path = path
        self.masked_max_tokens = masked_max_tokens
        self.moe_runner_config: Any = None
        self.runner = None  # no SGLang MoeRunner: apply runs our kernels directly
        self.applies_routed_scaling = sglang_expects_scaled_experts()

    # -- weights -------------------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       with_bias: bool = False, **extra_weight_attrs: Any) -> None:
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        if with_bias:
            raise ValueError("moe_fp8: MoE layers with expert biases are not supported")
        runner_config = getattr(layer, "moe_runner_config", None)
        if runner_config is not None and not runner_config.is_gated:
            raise ValueError("moe_fp8: only gated (SiLU·mul) MoE layers are supported, got is_gated=False")
        if i % GROUP_K != 0:
            raise ValueError(f"moe_fp8: the experts' intermediate size per TP rank must be a multiple of "
                             f"{GROUP_K} (gate and up each own whole scale blocks), got {i}; use a smaller "
                             "MoE tensor-parallel size or expert parallelism")
        check_fp8_linear_shape(h, 2 * i, name="moe_fp8 FusedMoE w13")
        check_fp8_linear_shape(i, h, name="moe_fp8 FusedMoE w2")

        extra_weight_attrs.pop("moe_intermediate_size", None)
        hb, ib = ceil_div(h, GROUP_K), i // GROUP_K
        w13 = _frozen(torch.empty(e, 2 * i, h, dtype=_FP8))
        w2 = _frozen(torch.empty(e, h, i, dtype=_FP8))
        # NaN until loaded, as for the linear layers (checked after loading).
        w13_scale = _frozen(torch.full((e, 2 * ib, hb), float("nan"), dtype=torch.float32))
        w2_scale = _frozen(torch.full((e, hb, ib), float("nan"), dtype=torch.float32))
        for name, param in (("w13_weight", w13), ("w2_weight", w2), ("w13_weight_scale_inv", w13_scale),
                            ("w2_weight_scale_inv", w2_scale)):
            layer.register_parameter(name, param)
            for key, value in extra_weight_attrs.items():  # weight_loader, ...
                setattr(param, key, value)
        for scale in (w13_scale, w2_scale):
            # FusedMoE.weight_loader loads "block" scales with the weights' sharding; SGLang's
            # DeepSeek code reads format_ue8m0.
            scale.quant_method = "block"
            scale.format_ue8m0 = False
        layer.w13_input_scale = None
        layer.w2_input_scale = None
        # id → local expert, with one extra id for SGLang's "-1" (another rank's expert, or a padding
        # token): apply maps -1 to it, so our dispatch skips those copies. Built here, on the device the
        # weights are created on, so forward allocates nothing for it.
        sentinel_map = torch.arange(e + 1, dtype=torch.int32)
        sentinel_map[e] = -1
        layer.register_buffer("moe_fp8_expert_map", sentinel_map, persistent=False)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
            if bool(torch.isnan(getattr(layer, name).data).any()):
                raise ValueError(f"moe_fp8: {name} of MoE layer {getattr(layer, 'layer_name', '?')!r} was not "
                                 "(fully) loaded: every local expert needs gate/up/down_proj.weight_scale_inv")

    # -- runner contract -------------------------------------------------------------------------
    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: Any) -> None:
        from sglang.srt.layers.moe import get_moe_a2a_backend

        if not get_moe_a2a_backend().is_none():
            raise ValueError(f"moe_fp8: --moe-a2a-backend {get_moe_a2a_backend().value} is not supported; the "
                             "moe_fp8 MoE method runs with SGLang's standard dispatcher (TP / EP without "
                             "all-to-all)")
        for field, ok in (("activation", moe_runner_config.activation == "silu"),
                          ("apply_router_weight_on_input", not moe_runner_config.apply_router_weight_on_input),
                          ("no_combine", not moe_runner_config.no_combine),
                          ("gemm1_alpha", moe_runner_config.gemm1_alpha is None),
                          ("gemm1_beta", moe_runner_config.gemm1_beta is None),
                          ("gemm1_clamp_limit", moe_runner_config.gemm1_clamp_limit is None),
                          ("swiglu_limit", moe_runner_config.swiglu_limit is None)):
            if not ok:
                raise ValueError(f"moe_fp8: MoE layers with {field}={getattr(moe_runner_config, field)!r} are not "
                                 "supported (SiLU·mul experts, router weights applied at combine)")
        self.moe_runner_config = moe_runner_config
        self.runner = None

    def get_moe_runner_backend(self, layer: torch.nn.Module) -> None:
        # None = "a direct kernel consuming standard TopK with local IDs" (FusedMoEMethodBase's contract):
        # the standard dispatcher then maps global ids to local ones (-1 elsewhere) before apply.
        return None

    # -- forward ---------------------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, dispatch_output: Any) -> Any:
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        hidden = dispatch_output.hidden_states
        topk_output = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk_output):
            topk_output = topk_output.to_standard()
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise ValueError(f"moe_fp8: expected SGLang's standard top-k output, got {type(topk_output).__name__}")
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        out = self.forward_experts(layer, hidden, topk_weights, topk_ids)
        return StandardCombineInput(hidden_states=out)

    def forward_experts(self, layer: torch.nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``topk_weights [T, top_k]``, local ``topk_ids [T, top_k]`` (-1 = skip) →
        ``s · Σ_j w[t, j] · expert_j(hidden[t])`` as ``[T, H]`` in ``hidden``'s dtype, ``s`` the runner config's
        ``routed_scaling_factor`` if ``applies_routed_scaling``, else 1."""
        num_local = layer.w13_weight.shape[0]
        t = hidden.shape[0]
        x_fp8, x_scale = per_token_group(hidden.contiguous())
        # -1 → the sentinel id num_local, which moe_fp8_expert_map sends to -1 (skipped by dispatch).
        ids = torch.where(topk_ids < 0, num_local, topk_ids)
        config = self.moe_runner_config
        num_global = getattr(config, "num_experts", None) or num_local
        max_tokens = (self.masked_max_tokens if self.masked_max_tokens is not None
                      else default_masked_max_tokens(num_local))
        weights_ = (layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv)
        if choose_dispatch_path(t, max_tokens, hidden, self.path) == "contiguous":
            y, row_map = experts_contiguous(x_fp8, x_scale, ids, *weights_, num_local, layer.moe_fp8_expert_map,
                                            num_experts=num_global)
        else:  # (both paths' expected_m hint counts copies per global expert)
            y, row_map = experts_masked(x_fp8, x_scale, ids, *weights_, num_local, num_global,
                                        layer.moe_fp8_expert_map)
        scale = getattr(config, "routed_scaling_factor", None) if self.applies_routed_scaling else None
        weights = topk_weights if scale is None or scale == 1.0 else topk_weights * scale
        return combine(y, row_map, weights).to(hidden.dtype)
