"""``Fp8FusedMoE``: a block-FP8 mixture-of-experts layer in the DeepSeek-V3 layout (DESIGN §5).

Forward of ``hidden [T, H]`` with ``router_logits [T, E]``::

    x_fp8, x_scale = quant.per_token_group(hidden)               # one quantization, shared by all experts
    topk_weights, topk_ids = layers.select_experts(router_logits, ...)
    contiguous (prefill)                       | masked (decode, CUDA-graph safe)
      dispatch_contiguous → [M_total, H]       |   dispatch_masked → [E_local, T, H], masked_m
      fp8_grouped_gemm_contiguous (w13)        |   fp8_grouped_gemm_masked (w13)
      silu_mul_per_token_group                 |   silu_mul_per_token_group(masked_m=...)
      fp8_grouped_gemm_contiguous (w2)         |   fp8_grouped_gemm_masked (w2)
    combine(y, row_map, topk_weights, shared_output)             # + shared experts (Fp8MLP on x_fp8)

Every step is a public ``moe_fp8`` op, so the layer runs on the Hopper kernels where they exist and on
the PyTorch reference elsewhere (CPU included).

Parallelism. Expert parallel: ``expert_map`` (global id → local id, -1 = not on this rank) selects the
experts a rank holds; token copies routed elsewhere contribute nothing here. Tensor parallel: the
weights hold a shard of ``I`` (``shard_moe_weights``). Either way the output of one rank is a partial
sum and the caller all-reduces over ranks. Shared experts are added on every rank that has them, so
shard them too (``shard_fp8_linear``) or give them to one rank only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moe_fp8.layers.dispatch import combine, dispatch_contiguous, dispatch_masked
from moe_fp8.layers.linear import Fp8MLP, _frozen, _is_int
from moe_fp8.layers.routing import select_experts
from moe_fp8.ops import fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked
from moe_fp8.quant import per_token_group, silu_mul_per_token_group
from moe_fp8.utils import GROUP_K, ceil_div
from moe_fp8.validation import K_ALIGN, SCORING_FUNCS

__all__ = ["MASKED_MAX_ROWS", "PATHS", "Fp8FusedMoE", "choose_path", "default_masked_max_tokens", "run_experts"]

Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn

# Crossover between the two dispatch layouts, as a bound on the masked buffer's rows (E_local x T):
# batches of at most max(64, MASKED_MAX_ROWS // E_local) tokens take the masked (decode) path, larger
# ones the contiguous (prefill) path.
# Measured on an H100 (`moe-fp8 bench moe`, DeepSeek-V3 EP rank: 32 of 256 experts, H 7168, I 2048,
# docs/benchmarks/h100-moe.md): the masked path was faster at every batch tried up to 2048 tokens
# (512: 636 vs 918 us; 2048: 700 vs 986 us), because contiguous dispatch syncs with the host and its
# scatter is slower. But the masked buffers grow as E_local x T rows (FP8 activations plus a bf16 GEMM
# output of 2I columns per row), so the switch bounds them: 16384 rows is 512 tokens at 32 local experts
# (the measured case), 64 tokens with all 256 experts on one GPU.
MASKED_MAX_ROWS = 16384


def default_masked_max_tokens(num_local_experts: int) -> int:
    """Largest batch ``path="auto"`` sends down the masked path when ``masked_max_tokens`` is not given."""
    return max(64, MASKED_MAX_ROWS // max(num_local_experts, 1))

PATHS = ("auto", "contiguous", "masked")


def _stream_capturing(t: Tensor) -> bool:
    # torch.cuda.is_current_stream_capturing raises on CPU-only builds: ask only for CUDA tensors.
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def choose_path(num_tokens: int, masked_max_tokens: int, hidden: Tensor | None = None, path: str = "auto") -> str:
    """The dispatch layout for a batch of ``num_tokens`` tokens: ``"contiguous"`` or ``"masked"``.

    ``"auto"``: masked while a CUDA graph is being captured (on ``hidden``'s stream) or under
    ``torch.compile`` (the contiguous layout's size is data-dependent and needs a host sync), else masked
    for ``num_tokens <= masked_max_tokens`` and contiguous above. An explicit ``"contiguous"`` during
    capture raises. Shared by ``Fp8FusedMoE`` and the engine integrations.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    capturing = hidden is not None and _stream_capturing(hidden)
    if path == "contiguous" and capturing:
        raise ValueError("path='contiguous' cannot run inside CUDA graph capture (it syncs with the host "
                         "to size its layout); use path='masked' or 'auto'")
    if path != "auto":
        return path
    if capturing or torch.compiler.is_compiling() or num_tokens <= masked_max_tokens:
        return "masked"
    return "contiguous"


def run_experts(x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor, w13_weight: Tensor,
                w13_weight_scale_inv: Tensor, w2_weight: Tensor, w2_weight_scale_inv: Tensor, *,
                path: str, expert_map: Tensor | None = None,
                expected_m: int | None = None) -> tuple[Tensor, Tensor]:
    """The routed-expert part of the MoE forward, on already quantized tokens; ``combine`` finishes it.

    Args:
        x_fp8, x_scale: ``per_token_group(hidden)``: fp8 ``[T, H]``, fp32 ``[T, ceil(H/128)]``.
        topk_ids: int ``[T, top_k]``: local expert ids, or global ids mapped through ``expert_map``.
        w13_weight, w13_weight_scale_inv, w2_weight, w2_weight_scale_inv: the stacked local experts, in
            ``Fp8FusedMoE``'s layout (``E_local`` = ``w13_weight.shape[0]``).
        path: ``"contiguous"`` (prefill) or ``"masked"`` (decode, CUDA-graph safe); see ``choose_path``.
        expert_map: optional int ``[num_ids]``: id → local id, -1 = the copy is not computed here.
        expected_m: masked path's host hint (copies per expert); default ``ceil(T·top_k / num_ids)``.
            It may change speed, never the result.

    Returns ``(y, row_map)``: expert outputs (``[M_total, H]`` or ``[E_local, T, H]``, bf16) and the
    ``[T, top_k]`` row of each token copy (-1 = not computed here), the inputs of ``combine``.
    """
    num_local_experts = w13_weight.shape[0]
    if path == "contiguous":
        a, a_scale, m_indices, row_map = dispatch_contiguous(x_fp8, x_scale, topk_ids, num_local_experts,
                                                             expert_map)
        h = fp8_grouped_gemm_contiguous(a, a_scale, w13_weight, w13_weight_scale_inv, m_indices)
        y_fp8, y_scale = silu_mul_per_token_group(h)
        y = fp8_grouped_gemm_contiguous(y_fp8, y_scale, w2_weight, w2_weight_scale_inv, m_indices)
        return y, row_map
    if path != "masked":
        raise ValueError(f"run_experts: path must be 'contiguous' or 'masked', got {path!r}")
    t, top_k = topk_ids.shape
    # max_m = T: a token picks distinct experts, so no expert can receive more than T copies and the
    # masked layout never drops one (the result equals the contiguous path's).
    max_m = t
    if expected_m is None:
        num_ids = num_local_experts if expert_map is None else expert_map.shape[0]
        expected_m = max(1, ceil_div(t * top_k, num_ids))
    a, a_scale, masked_m, row_map = dispatch_masked(x_fp8, x_scale, topk_ids, num_local_experts, max_m,
                                                    expert_map)
    h = fp8_grouped_gemm_masked(a, a_scale, w13_weight, w13_weight_scale_inv, masked_m, expected_m)
    y_fp8, y_scale = silu_mul_per_token_group(h, masked_m=masked_m)
    y = fp8_grouped_gemm_masked(y_fp8, y_scale, w2_weight, w2_weight_scale_inv, masked_m, expected_m)
    return y, row_map


def _parse_expert_map(expert_map: Tensor | Sequence[int] | None, num_experts: int) -> list[int] | None:
    """Validate a global → local map on the host; returns it as a list (None = all experts local)."""
    if expert_map is None:
        return None
    values = expert_map.tolist() if isinstance(expert_map, Tensor) else list(expert_map)
    if isinstance(expert_map, Tensor) and (expert_map.dim() != 1 or expert_map.is_floating_point()):
        raise ValueError(f"expert_map must be a 1-D integer tensor [num_experts], got {expert_map.dtype} "
                         f"{tuple(expert_map.shape)}")
    if len(values) != num_experts or not all(_is_int(v) for v in values):
        raise ValueError(f"expert_map must hold {num_experts} ints (global → local id, -1 = absent), got "
                         f"{len(values)} values")
    local = sorted(v for v in values if v >= 0)
    if local != list(range(len(local))) or any(v < -1 for v in values):
        raise ValueError("expert_map must map the experts of this rank onto local ids 0..E_local-1, each once, "
                         f"and every other expert to -1; got {values}")
    if not local:
        raise ValueError("expert_map gives this rank no experts (all -1)")
    return values


class Fp8FusedMoE(nn.Module):
    """Block-FP8 MoE layer: routing, dispatch, two grouped GEMMs with fused SiLU·mul, combine, shared experts.

    Args:
        num_experts: global routed expert count E (width of ``router_logits``).
        hidden_size: H, a positive multiple of 16.
        intermediate_size: I held by this module (per rank under tensor parallelism), a positive multiple
            of 128 (gate and up each own whole scale blocks of the fused ``w13``).
        top_k: experts per token.
        scoring_func, renormalize, n_group, topk_group, routed_scaling_factor: routing, as
            ``moe_fp8.layers.select_experts`` (DeepSeek-V3: ``"sigmoid"``, True, 8, 4, 2.5).
        use_correction_bias: hold ``e_score_correction_bias [E]`` (fp32), added to the scores for selection.
        num_shared_experts: 0 or more shared experts, fused into one ``Fp8MLP`` (``shared_experts``) of
            intermediate size ``shared_intermediate_size`` (default ``num_shared_experts · intermediate_size``;
            give it explicitly when the shared experts are sharded differently).
        expert_map: optional global → local map ``[E]`` (tensor or ints): the experts of this rank get local
            ids ``0..E_local-1``, the others -1.
        masked_max_tokens: batches of at most this many tokens take the masked path under ``path="auto"``
            (default ``default_masked_max_tokens(E_local)``, measured; see ``MASKED_MAX_ROWS``).
        device: where to allocate the parameters (``"meta"`` allocates nothing).

    Parameters (DeepSeek-V3 names, stacked over local experts):
        ``w13_weight`` fp8 ``[E_local, 2I, H]`` (rows ``[gate | up]``), ``w13_weight_scale_inv`` fp32
        ``[E_local, 2I/128, ceil(H/128)]``, ``w2_weight`` fp8 ``[E_local, H, I]``, ``w2_weight_scale_inv``
        fp32 ``[E_local, ceil(H/128), I/128]``, ``e_score_correction_bias`` fp32 ``[E]`` when used, and
        ``shared_experts.{gate_up_proj, down_proj}`` (``Fp8Linear``) when there are shared experts.
        They start as zeros with unit scales: fill them with ``moe_fp8.layers.load_fused_moe`` or ``copy_``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, *,
                 scoring_func: str = "softmax", renormalize: bool = True, n_group: int | None = None,
                 topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                 use_correction_bias: bool = False, num_shared_experts: int = 0,
                 shared_intermediate_size: int | None = None,
                 expert_map: Tensor | Sequence[int] | None = None,
                 masked_max_tokens: int | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        for name, value, minimum in (("num_experts", num_experts, 1), ("hidden_size", hidden_size, 1),
                                     ("intermediate_size", intermediate_size, 1), ("top_k", top_k, 1),
                                     ("num_shared_experts", num_shared_experts, 0),
                                     ("masked_max_tokens", 0 if masked_max_tokens is None else masked_max_tokens, 0)):
            if not _is_int(value) or value < minimum:
                raise ValueError(f"Fp8FusedMoE: {name} must be an int >= {minimum}, got {value!r}")
        if hidden_size % K_ALIGN != 0:
            raise ValueError(f"Fp8FusedMoE: hidden_size must be a multiple of {K_ALIGN} (FP8 GEMM rows), "
                             f"got {hidden_size}")
        if intermediate_size % GROUP_K != 0:
            raise ValueError(f"Fp8FusedMoE: intermediate_size must be a multiple of {GROUP_K} (gate and up each "
                             f"own whole scale blocks of w13; shard I in multiples of {GROUP_K}), got "
                             f"{intermediate_size}")
        if top_k > num_experts:
            raise ValueError(f"Fp8FusedMoE: top_k must be <= num_experts = {num_experts}, got {top_k}")
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"Fp8FusedMoE: scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
        if (n_group is None) != (topk_group is None):
            raise ValueError(f"Fp8FusedMoE: n_group and topk_group go together, got {n_group!r}, {topk_group!r}")
        if n_group is not None and (not _is_int(n_group) or n_group < 1 or num_experts % n_group != 0):
            raise ValueError(f"Fp8FusedMoE: n_group must divide num_experts = {num_experts}, got {n_group!r}")

        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.renormalize = bool(renormalize)
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)

        self._expert_map_host = _parse_expert_map(expert_map, num_experts)
        if self._expert_map_host is None:
            self.num_local_experts = num_experts
            self.register_buffer("expert_map", None)
        else:
            self.num_local_experts = sum(v >= 0 for v in self._expert_map_host)
            self.register_buffer("expert_map", torch.tensor(self._expert_map_host, dtype=torch.int32,
                                                            device=device), persistent=False)
        self.masked_max_tokens = (default_masked_max_tokens(self.num_local_experts) if masked_max_tokens is None
                                  else masked_max_tokens)

        e, h, i = self.num_local_experts, hidden_size, intermediate_size
        hb, ib = ceil_div(h, GROUP_K), i // GROUP_K
        self.w13_weight = _frozen(torch.zeros((e, 2 * i, h), dtype=_FP8, device=device))
        self.w13_weight_scale_inv = _frozen(torch.ones((e, 2 * ib, hb), dtype=torch.float32, device=device))
        self.w2_weight = _frozen(torch.zeros((e, h, i), dtype=_FP8, device=device))
        self.w2_weight_scale_inv = _frozen(torch.ones((e, hb, ib), dtype=torch.float32, device=device))
        if use_correction_bias:
            self.e_score_correction_bias = _frozen(torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.register_parameter("e_score_correction_bias", None)

        if num_shared_experts > 0:
            shared_i = shared_intermediate_size or num_shared_experts * intermediate_size
            self.shared_experts: Fp8MLP | None = Fp8MLP(hidden_size, shared_i, device=device)
        elif shared_intermediate_size:
            raise ValueError("Fp8FusedMoE: shared_intermediate_size given without num_shared_experts")
        else:
            self.shared_experts = None

    # ------------------------------------------------------------------------------------------
    def local_expert_ids(self) -> list[int]:
        """Global id of each local expert, in local order (``[0..E-1]`` without an expert map)."""
        if self._expert_map_host is None:
            return list(range(self.num_experts))
        ids = [0] * self.num_local_experts
        for global_id, local_id in enumerate(self._expert_map_host):
            if local_id >= 0:
                ids[local_id] = global_id
        return ids

    def choose_path(self, num_tokens: int, hidden: Tensor | None = None, path: str = "auto") -> str:
        """The dispatch layout a forward of ``num_tokens`` tokens uses: ``"contiguous"`` or ``"masked"``
        (module-level ``choose_path`` with this layer's ``masked_max_tokens``)."""
        return choose_path(num_tokens, self.masked_max_tokens, hidden, path)

    def forward(self, hidden: Tensor, router_logits: Tensor, *, path: str = "auto") -> Tensor:
        """``hidden [T, H]`` (bf16/fp16/fp32, contiguous) and ``router_logits [T, E]`` → ``[T, H]`` in hidden's dtype.

        ``path``: ``"auto"`` (see ``choose_path``), or force ``"contiguous"`` / ``"masked"`` (both give the
        same result; tests compare them). Under expert / tensor parallelism the result is this rank's
        partial sum.
        """
        if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"Fp8FusedMoE: hidden must be [T, {self.hidden_size}], got "
                             f"{tuple(getattr(hidden, 'shape', ()))}")
        t = hidden.shape[0]
        if (not isinstance(router_logits, Tensor) or router_logits.dim() != 2
                or tuple(router_logits.shape) != (t, self.num_experts)):
            raise ValueError(f"Fp8FusedMoE: router_logits must be [T, E] = [{t}, {self.num_experts}], got "
                             f"{tuple(getattr(router_logits, 'shape', ()))}")
        if router_logits.device != hidden.device:
            raise ValueError(f"Fp8FusedMoE: router_logits on {router_logits.device}, hidden on {hidden.device}")
        chosen = self.choose_path(t, hidden, path)

        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, scoring_func=self.scoring_func, renormalize=self.renormalize,
            n_group=self.n_group, topk_group=self.topk_group,
            e_score_correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=self.routed_scaling_factor)
        x_fp8, x_scale = per_token_group(hidden)
        shared = None if self.shared_experts is None else self.shared_experts.forward_fp8(x_fp8, x_scale)
        if chosen == "contiguous":
            y, row_map = self._experts_contiguous(x_fp8, x_scale, topk_ids)
        else:
            y, row_map = self._experts_masked(x_fp8, x_scale, topk_ids)
        out = combine(y, row_map, topk_weights, shared)
        return out.to(hidden.dtype)

    def _experts_contiguous(self, x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor]:
        return run_experts(x_fp8, x_scale, topk_ids, self.w13_weight, self.w13_weight_scale_inv, self.w2_weight,
                           self.w2_weight_scale_inv, path="contiguous", expert_map=self.expert_map)

    def _experts_masked(self, x_fp8: Tensor, x_scale: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor]:
        # Host-side hint only (mean copies per global expert): it may change speed, never the result.
        expected_m = max(1, ceil_div(x_fp8.shape[0] * self.top_k, self.num_experts))
        return run_experts(x_fp8, x_scale, topk_ids, self.w13_weight, self.w13_weight_scale_inv, self.w2_weight,
                           self.w2_weight_scale_inv, path="masked", expert_map=self.expert_map,
                           expected_m=expected_m)

    def extra_repr(self) -> str:
        parts = [f"num_experts={self.num_experts}", f"local={self.num_local_experts}",
                 f"hidden_size={self.hidden_size}", f"intermediate_size={self.intermediate_size}",
                 f"top_k={self.top_k}", f"scoring_func={self.scoring_func!r}"]
        if self.n_group is not None:
            parts.append(f"n_group={self.n_group}, topk_group={self.topk_group}")
        return ", ".join(parts)
