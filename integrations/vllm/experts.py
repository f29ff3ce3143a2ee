"""moe_fp8's routed experts as vLLM modular-kernel experts (``FusedMoEExpertsModular``).

vLLM splits a fused MoE into ``[router] → [prepare: quantize + dispatch] → [experts] → [finalize: combine]``
(``vllm.model_executor.layers.fused_moe.modular_kernel``). vLLM's prepare/finalize classes do the
communication; these two classes are the ``[experts]`` step, on moe_fp8's grouped GEMMs:

- ``MoeFp8Experts`` (standard format: tokens ``[T, H]`` + ``topk_ids``; no all-to-all, or vLLM's
  all-gather / reduce-scatter one): takes the activations unquantized (``expects_unquantized_inputs``),
  quantizes them once with ``moe_fp8.quant.per_token_group``, then runs the same path as
  ``moe_fp8.layers.Fp8FusedMoE``: ``experts_contiguous`` (prefill) or ``experts_masked`` (decode, CUDA
  graphs, no host sync), and ``combine`` weighted by ``topk_weights`` — so its output is already reduced
  over the top-k (``TopKWeightAndReduceNoOP``).
- ``MoeFp8BatchedExperts`` (batched format ``[E_local, max_tokens, H]`` + per-expert counts, as DeepEP
  low-latency dispatch delivers it): the tokens are already FP8 and grouped by expert, so it is
  ``grouped_experts_masked`` (masked grouped GEMM → fused SiLU·mul + quant → masked grouped GEMM) with
  the counts as ``masked_m``; no host sync. The combine kernel applies the weights
  (``TopKWeightAndReduceDelegate``).

Both only support what block-FP8 DeepSeek-style experts need: SiLU-gated MLP, FP8 e4m3 weights with
128×128 block scales, dynamic per-token-group (1×128) activation scales, no biases, no LoRA.
"""

from __future__ import annotations

import logging

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)

from moe_fp8.backends import ENV_STRICT
from moe_fp8.layers.dispatch import combine
from moe_fp8.layers.moe import (
    choose_dispatch_path,
    default_masked_max_tokens,
    experts_contiguous,
    experts_masked,
    grouped_experts_masked,
)
from moe_fp8.quant import is_scale_tma_layout, per_token_group, to_scale_tma_layout
from moe_fp8.utils import ceil_div, env, truthy

__all__ = ["MoeFp8BatchedExperts", "MoeFp8Experts"]

logger = logging.getLogger("moe_fp8")
Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn


def _check_call(activation: MoEActivation, apply_router_weight_on_input: bool) -> None:
    # The oracle checks (is_supported_config) run only when vLLM picks a kernel; these are the per-call
    # facts that a caller could still get wrong.
    if activation != MoEActivation.SILU:
        raise NotImplementedError(f"moe_fp8 experts run the SiLU-gated MLP only, got activation {activation}")
    if apply_router_weight_on_input:
        raise NotImplementedError("moe_fp8 experts apply the router weights in the combine step; "
                                  "apply_router_weight_on_input=True is not supported")


class _MoeFp8ExpertsBase(mk.FusedMoEExpertsModular):
    """What both formats declare to vLLM's kernel oracle."""

    @staticmethod
    def _supports_current_device() -> bool:
        # moe_fp8 picks its backend per call (Hopper kernels, Triton, or the PyTorch reference).
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    def workspace_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        # The grouped GEMMs write bf16; the output buffer vLLM hands to apply() is in this dtype.
        return torch.bfloat16


class MoeFp8Experts(_MoeFp8ExpertsBase):
    """Standard-format experts: ``hidden [T, H]`` (unquantized) + ``topk_ids [T, top_k]`` → reduced ``[T, H]``.

    ``masked_max_tokens``: batches up to this size take the masked (decode) path, larger ones the contiguous
    (prefill) path, as in ``Fp8FusedMoE`` (default ``default_masked_max_tokens(E_local)``), during CUDA-graph
    capture too (the contiguous path is sync-free).
    """

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 masked_max_tokens: int | None = None) -> None:
        super().__init__(moe_config=moe_config, quant_config=quant_config)
        self.masked_max_tokens = (default_masked_max_tokens(moe_config.num_local_experts)
                                  if masked_max_tokens is None else masked_max_tokens)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @property
    def expects_unquantized_inputs(self) -> bool:
        # Quantize here with moe_fp8's own kernel: its scales come out in the layout our GEMMs read.
        return True

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        # No all-to-all (TP, or EP inside one DP rank), or the all-gather / reduce-scatter one.
        return not moe_parallel_config.use_all2all_kernels or moe_parallel_config.use_ag_rs_all2all_kernels

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # combine() already weighted and summed the top-k outputs

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: mk.ExpertTokensMetadata | None,
                         activation: MoEActivation) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # moe_fp8's ops allocate their own intermediates; only the reduced [M, K] output comes from vLLM.
        return (0,), (0,), (M, K)

    def apply(self, output: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: MoEActivation, global_num_experts: int, expert_map: Tensor | None,
              a1q_scale: Tensor | None, a2_scale: Tensor | None, workspace13: Tensor, workspace2: Tensor,
              expert_tokens_meta: mk.ExpertTokensMetadata | None, apply_router_weight_on_input: bool) -> None:
        _check_call(activation, apply_router_weight_on_input)
        if hidden_states.dtype == _FP8 or a1q_scale is not None:
            raise ValueError("MoeFp8Experts expects unquantized activations (expects_unquantized_inputs); the "
                             f"prepare step passed {hidden_states.dtype} with scales: {a1q_scale is not None}")
        num_local_experts = w1.shape[0]
        if global_num_experts == -1:
            global_num_experts = num_local_experts
        x_fp8, x_scale = per_token_group(hidden_states.contiguous())
        path = choose_dispatch_path(hidden_states.shape[0], self.masked_max_tokens, hidden_states)
        if path == "contiguous":
            y, row_map = experts_contiguous(x_fp8, x_scale, topk_ids, w1, self.w1_scale, w2, self.w2_scale,
                                            num_local_experts, expert_map, num_experts=global_num_experts)
        else:
            y, row_map = experts_masked(x_fp8, x_scale, topk_ids, w1, self.w1_scale, w2, self.w2_scale,
                                        num_local_experts, global_num_experts, expert_map)
        output.copy_(combine(y, row_map, topk_weights))


class MoeFp8BatchedExperts(_MoeFp8ExpertsBase):
    """Batched-format experts: FP8 ``[E_local, max_tokens, H]`` + scales + per-expert token counts → unreduced
    ``[E_local, max_tokens, H]`` (rows past each expert's count are unspecified; the combine reads only valid
    rows). This is the masked grouped layout, so the counts are ``masked_m`` as they are: no host sync."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig, max_num_tokens: int,
                 num_dispatchers: int) -> None:
        super().__init__(moe_config=moe_config, quant_config=quant_config, max_num_tokens=max_num_tokens,
                         num_dispatchers=num_dispatchers)
        self._warned_scale_layout = False

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return moe_parallel_config.use_deepep_ll_kernels

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceDelegate()  # the combine (all-to-all) applies the weights

    def _rows_per_expert(self, M: int) -> int:
        assert self.max_num_tokens is not None and self.num_dispatchers is not None  # set by __init__
        return self.max_num_tokens * self.num_dispatchers

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: mk.ExpertTokensMetadata | None,
                         activation: MoEActivation) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (local_num_experts, self._rows_per_expert(M), K)

    def _expected_m(self, max_m: int, num_tokens: int, top_k: int) -> int:
        # Host hint only (DESIGN §2): copies per global expert if every dispatcher sent a batch of this rank's
        # num_tokens (not of its capacity: a decode batch of few tokens then takes the few-rows GEMM).
        assert self.num_dispatchers is not None  # set by __init__
        rows = min(num_tokens, self.max_num_tokens or num_tokens) * self.num_dispatchers
        return max(1, min(max_m, ceil_div(rows * top_k, self.moe_config.num_experts)))

    def apply(self, output: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: MoEActivation, global_num_experts: int, expert_map: Tensor | None,
              a1q_scale: Tensor | None, a2_scale: Tensor | None, workspace13: Tensor, workspace2: Tensor,
              expert_tokens_meta: mk.ExpertTokensMetadata | None, apply_router_weight_on_input: bool) -> None:
        _check_call(activation, apply_router_weight_on_input)
        if hidden_states.dim() != 3 or hidden_states.dtype != _FP8 or a1q_scale is None:
            raise ValueError("MoeFp8BatchedExperts needs FP8 activations [E_local, max_tokens, H] with 1x128 "
                             f"scales from the dispatch; got {hidden_states.dtype} {tuple(hidden_states.shape)}, "
                             f"scales given: {a1q_scale is not None}")
        if expert_tokens_meta is None or expert_tokens_meta.expert_num_tokens is None:
            raise ValueError("MoeFp8BatchedExperts needs the per-expert token counts (expert_tokens_meta)")
        masked_m = expert_tokens_meta.expert_num_tokens
        if masked_m.dtype != torch.int32:
            masked_m = masked_m.to(torch.int32)
        a_scale = a1q_scale
        if not is_scale_tma_layout(a_scale):
            # DeepEP's FP8 dispatch writes scales column-major already (no copy); other dispatchers do not.
            if truthy(env(ENV_STRICT)):
                raise ValueError(f"{ENV_STRICT}=1: the dispatched activation scales (strides {a_scale.stride()}) "
                                 "are not in moe_fp8's TMA layout and would need a copy")
            if not self._warned_scale_layout:
                logger.warning("moe_fp8: copying dispatched activation scales %s (strides %s) into the TMA "
                               "layout on every call", tuple(a_scale.shape), a_scale.stride())
                self._warned_scale_layout = True
            a_scale = to_scale_tma_layout(a_scale.float())
        max_m = hidden_states.shape[1]
        tokens, top_k = (topk_ids.shape[0], topk_ids.shape[1]) if topk_ids.dim() == 2 else (max_m, 1)
        expected_m = self._expected_m(max_m, tokens, top_k)
        direct = output.dtype == torch.bfloat16 and output.is_contiguous()
        y = grouped_experts_masked(hidden_states, a_scale, masked_m, expected_m, w1, self.w1_scale, w2,
                                   self.w2_scale, out=output if direct else None)
        if not direct:
            output.copy_(y)
