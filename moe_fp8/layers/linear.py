"""Block-FP8 linear layers: ``Fp8Linear`` and the gated MLP ``Fp8MLP`` built from two of them (DESIGN §5).

Parameters are stored exactly as DeepSeek-V3 checkpoints store them, so safetensors load as they are:

- ``weight``: ``float8_e4m3fn [N, K]`` (out_features × in_features, row-major, "NT");
- ``weight_scale_inv``: ``float32 [ceil(N/128), ceil(K/128)]``, one multiplier per 128×128 block
  (``real = weight · weight_scale_inv``, despite the name);
- ``bias`` (optional): ``bfloat16 [N]``.

Forward quantizes the activations per token per 128 columns (``moe_fp8.quant.per_token_group``) and
calls ``moe_fp8.fp8_gemm``, so it runs on whichever backend the ops pick (Hopper kernels on sm_90,
the PyTorch reference on CPU).

Shapes the GEMM kernels take (and hence the layer): ``K % 16 == 0`` and ``N % 8 == 0`` (16-byte rows);
N and K need not be multiples of 128 (the last scale block is partial). Anything else is refused at
construction with a ``ValueError``.

UE8M0 (DeepSeek-V3.1, ``quantization_config.scale_fmt = "ue8m0"``): ``ue8m0=True`` quantizes the
activations with power-of-two scales, and ``load_fp8_`` (like the checkpoint loaders) refuses weight scales
that are not positive powers of two (``check_ue8m0_scales``); the scales stay fp32 tensors either way.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_fp8.ops import fp8_gemm
from moe_fp8.quant import per_block, per_token_group, silu_mul_per_token_group
from moe_fp8.utils import GROUP_K, ceil_div
from moe_fp8.validation import K_ALIGN, N_ALIGN

__all__ = ["Fp8Linear", "Fp8MLP", "check_fp8_linear_shape", "check_ue8m0_scales", "check_weight_scales"]

Tensor = torch.Tensor
_FP8 = torch.float8_e4m3fn


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fp8_linear_shape(in_features: int, out_features: int, name: str = "Fp8Linear") -> None:
    """Raise ``ValueError`` unless the FP8 GEMM kernels can run ``[*, in_features] @ [out_features, in_features]ᵀ``:
    ``in_features`` (K) a positive multiple of 16, ``out_features`` (N) a positive multiple of 8."""
    if not _is_int(in_features) or in_features <= 0 or in_features % K_ALIGN != 0:
        raise ValueError(f"{name}: in_features (K) must be a positive multiple of {K_ALIGN} for the FP8 GEMM "
                         f"(FP8 rows of 16-byte multiples), got {in_features!r}")
    if not _is_int(out_features) or out_features <= 0 or out_features % N_ALIGN != 0:
        raise ValueError(f"{name}: out_features (N) must be a positive multiple of {N_ALIGN} for the FP8 GEMM "
                         f"(bf16 output rows of 16-byte multiples), got {out_features!r}")


def check_ue8m0_scales(scale: Tensor, name: str) -> None:
    """Raise ``ValueError`` unless every entry of ``scale`` is a positive, finite power of two (a UE8M0
    value): what ``quantization_config.scale_fmt = "ue8m0"`` promises for ``weight_scale_inv``."""
    s = scale.detach().float()
    mantissa, _ = torch.frexp(s)
    bad = ~((mantissa == 0.5) & (s > 0) & s.isfinite())
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: scale_fmt 'ue8m0' needs positive power-of-two scales, but {int(bad.sum())} of "
                         f"{s.numel()} are not (e.g. {name}{list(idx)} = {s[idx].item()!r}): these are not UE8M0 "
                         "scales; use a layer built with ue8m0=False for them")


def check_weight_scales(scale: Tensor, name: str, *, ue8m0: bool = False) -> None:
    """Raise ``ValueError`` unless every entry of ``scale`` is finite and non-negative (a NaN, infinite or negative
    block scale comes from a damaged or mislabelled checkpoint: it turns its block's outputs into NaN or flips
    them) and, with ``ue8m0``, a positive power of two (``check_ue8m0_scales``)."""
    if not isinstance(scale, Tensor) or not scale.is_floating_point():
        raise TypeError(f"{name}: weight scales must be a floating-point tensor, got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    s = scale.detach()
    bad = ~(s.isfinite() & (s >= 0))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: weight scales must be finite and >= 0, but {int(bad.sum())} of {s.numel()} are "
                         f"not (e.g. {name}{list(idx)} = {s[idx].item()!r})")
    if ue8m0:
        check_ue8m0_scales(scale, name)


def _bool_arg(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be a bool, got {value!r}")
    return value


def _frozen(t: Tensor) -> nn.Parameter:
    # FP8 weights are inference-only: no autograd through the kernels.
    return nn.Parameter(t, requires_grad=False)


def _flatten_tokens(x: Tensor, features: int, name: str) -> Tensor:
    """``x [..., features]`` as a contiguous ``[M, features]`` view (a copy only if x is strided)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != features:
        raise ValueError(f"{name}: input must be [..., {features}], got shape {tuple(x.shape)}")
    # NOTE: activations often arrive as views (attention's transpose/reshape); the quantization op
    # wants contiguous rows, so the layer (not the op) makes that one explicit copy when needed.
    return x.reshape(-1, features).contiguous()


class FixedDtypeModule(nn.Module):
    """A module whose tensors named in ``fixed_dtype_tensors`` keep their dtype under module-wide casts.

    ``model.to(torch.bfloat16)``, ``.half()`` or ``.float()`` would otherwise turn FP8 weights into bf16 ones
    the GEMMs refuse and round FP32 scales: such a cast only moves these tensors (to the cast's device, if it
    names one). Any other ``_apply`` (``.cuda()``, ``to_empty``, ...) reaches them unchanged.
    """

    fixed_dtype_tensors: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):  # (torch.nn.Module._apply's signature)
        fixed = {id(t) for name in self.fixed_dtype_tensors if (t := getattr(self, name, None)) is not None}

        def keep_dtype(t: Tensor) -> Tensor:
            if id(t) in fixed:
                # what fn does to an empty tensor of this dtype tells a cast from a move, at no cost
                probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                if probe.dtype != t.dtype:
                    return t.to(device=probe.device)
            return fn(t)

        return super()._apply(keep_dtype if fixed else fn, recurse)


class Fp8Linear(FixedDtypeModule):
    """``y = x @ dequant(weight)ᵀ (+ bias)`` with block-FP8 weights and per-token-group FP8 activations.

    Args:
        in_features: K, a positive multiple of 16. out_features: N, a positive multiple of 8.
        bias: add a ``bfloat16 [N]`` bias.
        ue8m0: power-of-two activation scales, and power-of-two weight scales required (DeepSeek-V3.1).
        device: where to allocate the parameters (``"meta"`` to allocate nothing).

    Parameters start as zeros with unit scales; fill them from a checkpoint
    (``moe_fp8.layers.load_fp8_linear``), ``from_float`` or ``copy_``.

    ``forward(x [..., K])`` (bf16, fp16 or fp32) returns ``[..., N]`` in ``x.dtype``; the GEMM writes
    bf16 (FP32 accumulation) and other dtypes are cast from it. Module-wide casts (``model.half()``) leave
    the weight, its scales and the bias in their dtypes (``FixedDtypeModule``).
    """

    fixed_dtype_tensors = ("weight", "weight_scale_inv", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, ue8m0: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        check_fp8_linear_shape(in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.ue8m0 = _bool_arg("Fp8Linear", "ue8m0", ue8m0)
        self.weight = _frozen(torch.zeros((out_features, in_features), dtype=_FP8, device=device))
        self.weight_scale_inv = _frozen(torch.ones(
            (ceil_div(out_features, GROUP_K), ceil_div(in_features, GROUP_K)), dtype=torch.float32, device=device))
        if bias:
            self.bias = _frozen(torch.zeros(out_features, dtype=torch.bfloat16, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_float(cls, linear: nn.Linear, *, ue8m0: bool = False) -> Fp8Linear:
        """Quantize a bf16 / fp16 / fp32 ``nn.Linear`` per 128×128 block (``moe_fp8.quant.per_block``,
        power-of-two scales with ``ue8m0``), on the linear's device. The bias (if any) is kept in bf16."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float expects a torch.nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, ue8m0=ue8m0,
                     device=w.device)
        w_fp8, w_scale = per_block(w.contiguous(), ue8m0=ue8m0)
        with torch.no_grad():
            module.weight.copy_(w_fp8)
            module.weight_scale_inv.copy_(w_scale)
            if linear.bias is not None:
                module.bias.copy_(linear.bias.detach())
        return module

    @classmethod
    def from_fp8(cls, weight: Tensor, weight_scale_inv: Tensor, bias: Tensor | None = None, *,
                 ue8m0: bool = False) -> Fp8Linear:
        """Wrap existing block-FP8 tensors (e.g. a ``shard_fp8_linear`` shard); they are copied."""
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D tensor [N, K], got {getattr(weight, 'shape', weight)!r}")
        n, k = weight.shape
        module = cls(k, n, bias=bias is not None, ue8m0=ue8m0, device=weight.device)
        module.load_fp8_(weight, weight_scale_inv, bias)
        return module

    @torch.no_grad()
    def load_fp8_(self, weight: Tensor, weight_scale_inv: Tensor, bias: Tensor | None = None) -> None:
        """Copy ``weight`` (fp8 [N, K]), ``weight_scale_inv`` (fp32 [ceil(N/128), ceil(K/128)]) and ``bias``
        into the parameters; shapes and dtypes must match exactly (no conversion). The scales must be finite
        and non-negative, and with ``ue8m0`` powers of two (``check_weight_scales``). Everything is checked
        before anything is copied: a refused call leaves the layer as it was."""
        pairs = (("weight", weight, self.weight), ("weight_scale_inv", weight_scale_inv, self.weight_scale_inv))
        for name, src, dst in pairs:
            if not isinstance(src, Tensor) or src.dtype != dst.dtype or src.shape != dst.shape:
                raise ValueError(f"{name} must be {dst.dtype} {tuple(dst.shape)}, got "
                                 f"{getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}")
        if self.weight.is_meta:
            raise ValueError("load_fp8_: the layer was built on the meta device (no storage to fill): "
                             "materialise it first (module.to_empty(device=...))")
        check_weight_scales(weight_scale_inv, "weight_scale_inv", ue8m0=self.ue8m0)
        if (bias is None) != (self.bias is None):
            raise ValueError(f"bias given: {bias is not None}, but the layer has bias: {self.bias is not None}")
        if bias is not None and (not isinstance(bias, Tensor) or bias.shape != self.bias.shape):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(getattr(bias, 'shape', ()))}")
        for _, src, dst in pairs:
            dst.copy_(src)
        if bias is not None:
            self.bias.copy_(bias)

    def forward_fp8(self, x_fp8: Tensor, x_scale: Tensor, out: Tensor | None = None) -> Tensor:
        """GEMM on already quantized activations: ``x_fp8 [M, K]``, ``x_scale [M, ceil(K/128)]`` (TMA layout,
        as ``per_token_group`` returns it) → ``bfloat16 [M, N]`` (+ bias)."""
        out = fp8_gemm(x_fp8, x_scale, self.weight, self.weight_scale_inv, out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flatten_tokens(x, self.in_features, "Fp8Linear")
        x_fp8, x_scale = per_token_group(x2, ue8m0=self.ue8m0)
        out = self.forward_fp8(x_fp8, x_scale)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block=({GROUP_K}, {GROUP_K})" + (", ue8m0=True" if self.ue8m0 else ""))


class Fp8MLP(nn.Module):
    """Gated MLP ``down(silu(gate(x)) · up(x))`` with gate and up fused: DeepSeek's dense MLP and shared experts.

    Args:
        hidden_size: H (a positive multiple of 16). intermediate_size: I (a positive multiple of 128, so the
            fused ``[gate | up]`` weight's halves each own whole scale blocks and can be loaded / split separately).
        ue8m0: power-of-two activation (and weight) scales, as ``Fp8Linear``.

    Parameters: ``gate_up_proj`` (``Fp8Linear`` H → 2I, rows ``[gate | up]``) and ``down_proj`` (I → H).
    Forward: one quantization of x, GEMM → fused SiLU·mul + quantization → GEMM.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, device: torch.device | str | None = None, *,
                 ue8m0: bool = False) -> None:
        super().__init__()
        if not _is_int(intermediate_size) or intermediate_size <= 0 or intermediate_size % GROUP_K != 0:
            raise ValueError(f"Fp8MLP: intermediate_size must be a positive multiple of {GROUP_K} (gate and up "
                             f"halves on scale-block boundaries), got {intermediate_size!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.ue8m0 = _bool_arg("Fp8MLP", "ue8m0", ue8m0)
        self.gate_up_proj = Fp8Linear(hidden_size, 2 * intermediate_size, ue8m0=ue8m0, device=device)
        self.down_proj = Fp8Linear(intermediate_size, hidden_size, ue8m0=ue8m0, device=device)

    def forward_fp8(self, x_fp8: Tensor, x_scale: Tensor) -> Tensor:
        """``x_fp8 [M, H]``, ``x_scale [M, ceil(H/128)]`` → ``bfloat16 [M, H]``."""
        h = self.gate_up_proj.forward_fp8(x_fp8, x_scale)  # [M, 2I] bf16
        y_fp8, y_scale = silu_mul_per_token_group(h, ue8m0=self.ue8m0)
        return self.down_proj.forward_fp8(y_fp8, y_scale)

    def forward(self, x: Tensor) -> Tensor:
        x2 = _flatten_tokens(x, self.hidden_size, "Fp8MLP")
        x_fp8, x_scale = per_token_group(x2, ue8m0=self.ue8m0)
        return self.forward_fp8(x_fp8, x_scale).view(x.shape).to(x.dtype)
