"""Hugging Face transformers: run ``DeepseekV3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM`` and
``MiniMaxM2ForCausalLM`` on moe_fp8's block-FP8 layers.

Installed as ``moe_fp8.integrations.transformers``; needs ``transformers >= 5`` (``pip install
'moe-fp8[transformers]'``), imported only when a function here is called.

    from moe_fp8.integrations.transformers import load_model
    model = load_model("/path/to/DeepSeek-V3", device="cuda")          # FP8 checkpoint, bf16 activations
    out = model.generate(input_ids, max_new_tokens=32)

``load_model`` builds transformers' own model for the checkpoint's ``model_type`` (``ARCHITECTURES``:
``deepseek_v3``, ``qwen3_moe``, ``glm4_moe``, ``minimax_m2``; Kimi-K2's ``kimi_k2`` is read as ``deepseek_v3``, see
``MODEL_FAMILIES``) on the meta device (no memory), then ``patch_model`` swaps its modules for ours and fills
everything from the checkpoint:

- each MoE block (``DeepseekV3MoE`` / ``Qwen3MoeSparseMoeBlock`` / ``Glm4MoeMoE`` / ``MiniMaxM2SparseMoeBlock``) →
  ``Fp8DeepseekV3MoE`` / ``Fp8Qwen3MoeSparseMoeBlock`` / ``Fp8Glm4MoeMoE`` / ``Fp8MiniMaxM2SparseMoeBlock``
  (``Fp8MoEBlock``): the router weight (logits in fp32) + ``Fp8FusedMoE`` (routed experts stacked as ``w13`` /
  ``w2``; DeepSeek-V3 and GLM-4.5: sigmoid grouped top-k, correction bias, shared experts; Qwen3-MoE: softmax
  top-k, renormalized when ``norm_topk_prob``; MiniMax-M2: sigmoid top-k with the correction bias, read from the
  checkpoint's Mixtral names, ``Architecture.moe_names``);
- each dense MLP (``DeepseekV3MLP`` / ``Qwen3MoeMLP`` / ``Glm4MoeMLP``) → ``Fp8MLP`` (gate and up fused);
- each attention projection (DeepSeek-V3: ``q_proj`` or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj``, ``o_proj``; the others: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, their biases kept) →
  ``Fp8Linear``;
- embeddings, norms (the per-head ``q_norm`` / ``k_norm`` too), ``lm_head`` and the rotary tables stay in
  transformers' modules, in ``dtype``.

FP8 weights are copied as stored (never through bf16); a bf16 checkpoint is quantized on load per
128×128 block. A DeepSeek-V3.1-style checkpoint (``quantization_config.scale_fmt = "ue8m0"``) gets layers
built with ``ue8m0=True`` (power-of-two activation scales; weight scales checked to be powers of two). A projection
listed in ``quantization_config.ignored_layers`` / ``modules_to_not_convert`` (as ``moe-fp8 quantize --skip``
writes it, and as Qwen's FP8 releases list their bf16 modules; listing MoE experts is refused), or one the FP8 GEMM
cannot take (``K % 16`` or ``N % 8`` not 0), stays an ``nn.Linear`` in ``dtype`` (dequantized if stored as FP8);
``LoadReport.kept_unquantized`` names those (none for DeepSeek-V3 and for ``tiny_deepseek_v3_config``: the ragged
``kv_a_proj_with_mqa``, N = 576 or 160, runs in FP8 with a partial last scale block). Single process: no tensor /
expert parallelism here.

The config must be one of transformers' models above with SiLU MLPs (DeepSeek-V3: a sigmoid router). Router
logits are recorded as transformers records them (``output_router_logits=True``), and ``model.to(dtype)`` /
``.half()`` change the activation dtype only: FP8 weights, their scales and the router weight keep theirs.

``load_reference_model`` builds the same model with plain transformers modules and weights dequantized
to ``dtype`` (fp32 by default): the baseline the tests compare logits against. ``compare_logits`` does that
comparison (DESIGN §6 ``calc_diff``) end to end and with the reference forced onto the experts our layers
chose (``reference_logits``): a quantized model legitimately routes a few near-tie tokens differently,
and one flipped expert moves a token's logits far more than the FP8 error does.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import os
from typing import Any

import torch
from torch import nn

from moe_fp8.layers.checkpoint import (
    MODEL_FAMILIES,
    MOE_NAMES,
    SCALE_SUFFIX,
    CheckpointReader,
    MoeNames,
    load_fp8_linear,
    load_fp8_mlp,
    read_block_fp8,
)
from moe_fp8.layers.checkpoint import load_fused_moe as _load_fused_moe
from moe_fp8.layers.linear import FixedDtypeModule, Fp8Linear, Fp8MLP, check_fp8_linear_shape
from moe_fp8.layers.moe import Fp8FusedMoE
from moe_fp8.layers.routing import router_gemm
from moe_fp8.quant import dequant_per_block
from moe_fp8.utils import GROUP_K

__all__ = [
    "ARCHITECTURES",
    "MOE_BLOCKS",
    "Architecture",
    "Fp8DeepseekV3MoE",
    "Fp8Glm4MoeMoE",
    "Fp8MiniMaxM2SparseMoeBlock",
    "Fp8MoEBlock",
    "Fp8Qwen3MoeSparseMoeBlock",
    "LoadReport",
    "LogitComparison",
    "architecture",
    "compare_logits",
    "load_model",
    "load_reference_model",
    "patch_model",
    "reference_logits",
    "reference_route",
]

logger = logging.getLogger("moe_fp8")
Tensor = torch.Tensor

_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A transformers MoE model family ``patch_model`` runs on moe_fp8: its ``model_type``, the names of its
    classes in ``transformers.models.<module>.modeling_<module>`` and its attention projections."""

    model_type: str
    causal_lm: str
    moe_block: str
    mlp: str  # the dense MLP ("": none, every layer MoE)
    router: str
    attention: tuple[str, ...]
    num_experts_key: str
    moe_inter_key: str = "moe_intermediate_size"

    def cls(self, name: str) -> type[nn.Module]:
        module = getattr(_transformers().models, self.model_type)
        return getattr(getattr(module, f"modeling_{self.model_type}"), name)

    @property
    def moe_names(self) -> MoeNames:
        """Where the checkpoint keeps a MoE block's tensors (transformers' module is always ``mlp``)."""
        return MOE_NAMES[self.model_type]

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of transformers' parameter or buffer ``name`` outside the stacked experts: a MoE
        block's ``.mlp.`` becomes its checkpoint block (MiniMax-M2: ``.block_sparse_moe.``; it has no dense MLP,
        so every ``.mlp.`` is a MoE block's)."""
        block = self.moe_names.block
        return name if block == "mlp" else name.replace(".mlp.", f".{block}.", 1)


ARCHITECTURES = {
    "deepseek_v3": Architecture("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3MoE", "DeepseekV3MLP",
                                "DeepseekV3TopkRouter",
                                ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
                                "n_routed_experts"),
    "qwen3_moe": Architecture("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP",
                              "Qwen3MoeTopKRouter", ("q_proj", "k_proj", "v_proj", "o_proj"), "num_experts"),
    "glm4_moe": Architecture("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeMoE", "Glm4MoeMLP", "Glm4MoeTopkRouter",
                             ("q_proj", "k_proj", "v_proj", "o_proj"), "n_routed_experts"),
    "minimax_m2": Architecture("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2SparseMoeBlock", "",
                               "MiniMaxM2TopKRouter", ("q_proj", "k_proj", "v_proj", "o_proj"), "num_local_experts",
                               "intermediate_size"),
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "moe_fp8.integrations.transformers needs Hugging Face transformers >= 5 with DeepseekV3ForCausalLM: "
            "pip install 'moe-fp8[transformers]'") from exc
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        raise ImportError(f"transformers {transformers.__version__} has no DeepseekV3ForCausalLM; "
                          "install transformers >= 5")
    return transformers


def architecture(config: Any) -> Architecture:
    """The ``Architecture`` of a transformers config, or ``ValueError`` for a model family moe_fp8 does not patch."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"moe_fp8 patches {', '.join(repr(t) for t in ARCHITECTURES)} models (model_type), got "
                         f"{model_type!r}")
    return ARCHITECTURES[model_type]


@dataclasses.dataclass
class LoadReport:
    """What ``patch_model`` did, by module / tensor name."""

    fp8_linears: list[str] = dataclasses.field(default_factory=list)  # Fp8Linear / Fp8MLP modules
    moe_layers: list[str] = dataclasses.field(default_factory=list)  # Fp8MoEBlock modules
    quantized_on_load: list[str] = dataclasses.field(default_factory=list)  # bf16 weights quantized by us
    kept_unquantized: list[str] = dataclasses.field(default_factory=list)  # projections the GEMM cannot take
    unused: list[str] = dataclasses.field(default_factory=list)  # checkpoint tensors the model did not take
    ue8m0: bool = False  # quantization_config.scale_fmt == "ue8m0": power-of-two scales throughout


@functools.cache
def _router_class(arch: Architecture) -> type[nn.Module]:
    """The router module class of ``arch``, built on first use (it subclasses transformers' router, imported
    lazily)."""
    base = arch.cls(arch.router)

    class Fp8Router(FixedDtypeModule, base):
        """Holds ``weight [E, H]`` under the checkpoint's name ``mlp.gate.weight``, in the checkpoint's dtype (bf16
        for DeepSeek-V3, float32 for MiniMax-M2; float32 until loaded); ``forward(x [T, H])`` returns the fp32 router
        logits ``[T, E]`` (``Fp8FusedMoE`` does the top-k).

        A subclass of transformers' router only so that transformers records its logits
        (``output_router_logits=True``); none of that class's own state or top-k is used.

        NOTE: transformers' DeepseekV3 computes the logits as ``F.linear(x.float(), weight.float())``.
        ``layers.router_gemm`` computes that function from the bf16 weight itself, every product and sum in float32
        (a bf16 product is exact there), with no float32 copy: on Hopper a kernel for up to 8 tokens, cuBLAS's bf16
        GEMM with float32 output beyond (3x faster than the float32 GEMM from 32 tokens on an H200). Module-wide
        casts leave the weight's dtype (``FixedDtypeModule``). Qwen3-MoE's router gets the same fp32 logits, where
        transformers computes them in the activation dtype before its fp32 softmax: a bf16 transformers model can
        pick another expert for a near-tie token.
        """

        fixed_dtype_tensors = ("weight",)

        def __init__(self, num_experts: int, hidden_size: int, device: torch.device | str | None) -> None:
            nn.Module.__init__(self)  # (not the base's: it would allocate its own router state)
            self.weight = nn.Parameter(torch.zeros((num_experts, hidden_size), device=device, dtype=torch.float32),
                                       requires_grad=False)

        def forward(self, x: Tensor) -> Tensor:
            return router_gemm(x, self.weight)

    return Fp8Router


class Fp8MoEBlock(nn.Module, abc.ABC):
    """Drop-in for a transformers MoE block: ``forward(hidden_states [..., H]) -> [..., H]``.

    ``gate.weight [E, H]`` gives fp32 router logits (``hidden.float() @ weight.float()ᵀ``); ``experts`` is an
    ``Fp8FusedMoE`` with the family's routing (``routing``) and shared experts. ``path`` is passed to its
    forward; ``ue8m0`` to ``Fp8FusedMoE`` (DeepSeek-V3.1 checkpoints). ``dtype`` is accepted for symmetry and
    unused (the router weight keeps the checkpoint's dtype, the experts are FP8).
    """

    architecture: Architecture

    def __init__(self, config: Any, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16, masked_max_tokens: int | None = None,
                 path: str = "auto", ue8m0: bool = False) -> None:
        super().__init__()
        num_experts = int(getattr(config, self.architecture.num_experts_key))
        hidden = int(config.hidden_size)
        self.gate = _router_class(self.architecture)(num_experts, hidden, device)
        self.experts = Fp8FusedMoE(num_experts, hidden, int(getattr(config, self.architecture.moe_inter_key)),
                                   int(config.num_experts_per_tok), masked_max_tokens=masked_max_tokens,
                                   ue8m0=ue8m0, device=device, **self.routing(config))
        self.path = path

    @staticmethod
    @abc.abstractmethod
    def routing(config: Any) -> dict[str, Any]:
        """``Fp8FusedMoE`` keyword arguments for the family's routing and shared experts."""

    def router_logits(self, x: Tensor) -> Tensor:
        """``x [T, H]`` → fp32 router logits ``[T, E]`` (what ``forward`` routes on)."""
        return self.gate(x)

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        return self.experts(x, self.router_logits(x), path=self.path).view(shape)


class Fp8DeepseekV3MoE(Fp8MoEBlock):
    """Drop-in for transformers' ``DeepseekV3MoE``: DeepSeek-V3 routing (sigmoid, grouped top-k, correction
    bias, ``routed_scaling_factor``) and the shared experts."""

    architecture = ARCHITECTURES["deepseek_v3"]

    @staticmethod
    def routing(config: Any) -> dict[str, Any]:
        n_group = getattr(config, "n_group", None)
        topk_group = getattr(config, "topk_group", None)
        if not n_group or n_group <= 1:
            n_group = topk_group = None  # one group: plain top-k
        return dict(scoring_func="sigmoid",  # transformers' DeepseekV3 router (_check_config refuses others)
                    renormalize=bool(getattr(config, "norm_topk_prob", True)),
                    n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
                    use_correction_bias=getattr(config, "topk_method", "noaux_tc") == "noaux_tc",
                    num_shared_experts=int(getattr(config, "n_shared_experts", 0) or 0))


class Fp8Glm4MoeMoE(Fp8DeepseekV3MoE):
    """Drop-in for transformers' ``Glm4MoeMoE`` (GLM-4.5): DeepSeek-V3's MoE block and routing (sigmoid, correction
    bias, ``routed_scaling_factor``, shared experts; GLM-4.5's configs have one group, so plain top-k)."""

    architecture = ARCHITECTURES["glm4_moe"]


class Fp8MiniMaxM2SparseMoeBlock(Fp8MoEBlock):
    """Drop-in for transformers' ``MiniMaxM2SparseMoeBlock``: sigmoid scores, the correction bias for the choice,
    top-k of all experts renormalized, no scaling and no shared expert (as transformers' router computes it)."""

    architecture = ARCHITECTURES["minimax_m2"]

    @staticmethod
    def routing(config: Any) -> dict[str, Any]:
        if getattr(config, "scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"scoring_func {config.scoring_func!r}: transformers' MiniMax-M2 router scores experts "
                             "with a sigmoid, as moe_fp8's does; another scoring function is not supported")
        return dict(scoring_func="sigmoid", renormalize=True, use_correction_bias=True)


class Fp8Qwen3MoeSparseMoeBlock(Fp8MoEBlock):
    """Drop-in for transformers' ``Qwen3MoeSparseMoeBlock``: softmax top-k, renormalized when
    ``norm_topk_prob``, no shared experts."""

    architecture = ARCHITECTURES["qwen3_moe"]

    @staticmethod
    def routing(config: Any) -> dict[str, Any]:
        return dict(scoring_func="softmax", renormalize=bool(getattr(config, "norm_topk_prob", False)))


# model_type -> the block patch_model puts in place of the family's MoE block
MOE_BLOCKS = {cls.architecture.model_type: cls for cls in (Fp8DeepseekV3MoE, Fp8Qwen3MoeSparseMoeBlock,
                                                           Fp8Glm4MoeMoE, Fp8MiniMaxM2SparseMoeBlock)}


# ==============================================================================================
# patching
# ==============================================================================================

def _check_config(config: Any) -> Architecture:
    arch = architecture(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"moe_fp8's MLPs and experts are SiLU-gated; hidden_act {config.hidden_act!r} is not "
                         "supported")
    if arch.model_type == "deepseek_v3":
        _check_deepseek_v3(config)
    return arch


def _check_deepseek_v3(config: Any) -> None:
    if int(getattr(config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError("moe_layer_freq != 1 is not supported (transformers' DeepseekV3 puts a MoE block in "
                         "every layer from first_k_dense_replace on)")
    # transformers' DeepseekV3 ignores scoring_func (its router always scores with a sigmoid) and takes
    # hidden_act in its MLPs; either off moe_fp8's would run a different model without a word
    if getattr(config, "scoring_func", None) not in (None, "sigmoid"):
        raise ValueError(f"scoring_func {config.scoring_func!r}: transformers' DeepseekV3 router scores experts "
                         "with a sigmoid, as moe_fp8's does; another scoring function is not supported")


def _check_moe_not_listed(prefix: str, config: Any, arch: Architecture, ignored: tuple[str, ...]) -> None:
    """Refuse ``ignored_layers`` entries naming a MoE block's experts: its routed and shared experts run only as
    ``Fp8FusedMoE`` (the router, never quantized, may be listed)."""
    if not ignored:
        return
    shared = [f"{prefix}.shared_experts.{p}" for p in _MLP_PROJECTIONS] if getattr(config, "n_shared_experts", 0) else []
    n = arch.moe_names
    names = [f"{prefix}.experts.{e}.{p}" for e in range(int(getattr(config, arch.num_experts_key)))
             for p in (n.gate, n.up, n.down)]
    listed = [n for n in names + shared if _listed(n, ignored)]
    if listed:
        raise ValueError(f"quantization_config.ignored_layers keeps {listed[0]} (and {len(listed) - 1} more) of the "
                         f"MoE block {prefix} unquantized: moe_fp8 runs MoE experts in FP8 only")


def _target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    devices = {p.device for p in model.parameters()}
    real = {d for d in devices if d.type != "meta"}
    if not real:
        raise ValueError("the model is on the meta device: pass device=... to patch_model")
    if len(real) > 1:
        raise ValueError(f"the model spans several devices {sorted(map(str, real))}: pass device=...")
    return real.pop()


def _dequantized(reader: CheckpointReader, prefix: str) -> Tensor:
    """``{prefix}.weight`` in fp32, dequantized when stored as block FP8."""
    if f"{prefix}.weight{SCALE_SUFFIX}" in reader:
        return dequant_per_block(*read_block_fp8(reader, prefix))  # (scales of any stored format, checked)
    return reader.get(f"{prefix}.weight").float()


def _listed(name: str, ignored: tuple[str, ...]) -> bool:
    """Whether module ``name`` is kept unquantized by ``quantization_config.ignored_layers`` /
    ``modules_to_not_convert``: an entry naming it or a module containing it, as a whole dotted path or its
    tail (``"model.layers.0.self_attn.o_proj"``, ``"layers.0.mlp"`` and ``"o_proj"`` all name
    ``model.layers.0.self_attn.o_proj``), as vLLM's full names and transformers' short ones do."""
    dotted = f".{name}."
    return any(f".{entry}." in dotted for entry in ignored)


def _swap_linear(owner: nn.Module, attr: str, prefix: str, reader: CheckpointReader, device: torch.device,
                 dtype: torch.dtype, report: LoadReport) -> None:
    """Replace ``owner.<attr>`` (an nn.Linear) by an Fp8Linear loaded from ``prefix``, or load it unquantized
    (listed in ``ignored_layers``, or a shape the FP8 GEMM cannot take)."""
    old = getattr(owner, attr)
    has_bias = old.bias is not None
    listed = _listed(prefix, reader.ignored_layers)
    try:
        if listed:
            raise ValueError("listed in quantization_config.ignored_layers")
        check_fp8_linear_shape(old.in_features, old.out_features, prefix)
    except ValueError as exc:  # (asked for by the checkpoint: info; forced by the shape: a warning)
        logger.log(logging.INFO if listed else logging.WARNING, "moe_fp8: %s stays an unquantized nn.Linear: %s",
                   prefix, exc)
        new = nn.Linear(old.in_features, old.out_features, bias=has_bias, device=device, dtype=dtype)
        with torch.no_grad():
            new.weight.copy_(_dequantized(reader, prefix))
            if has_bias:
                new.bias.copy_(reader.get(f"{prefix}.bias"))
        new.requires_grad_(False)
        setattr(owner, attr, new)
        report.kept_unquantized.append(prefix)
        return
    new = Fp8Linear(old.in_features, old.out_features, bias=has_bias, ue8m0=report.ue8m0, device=device)
    if f"{prefix}.weight{SCALE_SUFFIX}" not in reader:
        report.quantized_on_load.append(f"{prefix}.weight")
    load_fp8_linear(new, reader, prefix)
    setattr(owner, attr, new)
    report.fp8_linears.append(prefix)


def _swap_dense_mlp(layer: nn.Module, prefix: str, reader: CheckpointReader, device: torch.device,
                    dtype: torch.dtype, report: LoadReport) -> None:
    mlp = layer.mlp
    hidden, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    listed = any(_listed(f"{prefix}.{proj}", reader.ignored_layers) for proj in _MLP_PROJECTIONS)
    if inter % GROUP_K == 0 and hidden % 16 == 0 and not listed:
        for proj in _MLP_PROJECTIONS:
            if f"{prefix}.{proj}.weight{SCALE_SUFFIX}" not in reader:
                report.quantized_on_load.append(f"{prefix}.{proj}.weight")
        new = Fp8MLP(hidden, inter, device=device, ue8m0=report.ue8m0)
        load_fp8_mlp(new, reader, prefix)
        layer.mlp = new
        report.fp8_linears.append(prefix)
        return
    # An intermediate size off the 128 grid cannot fuse gate and up, and a listed projection stays unquantized:
    # keep transformers' MLP, swap each projection.
    for proj in _MLP_PROJECTIONS:
        _swap_linear(mlp, proj, f"{prefix}.{proj}", reader, device, dtype, report)


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Recompute non-persistent buffers left on the meta device (the rotary tables) on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise ValueError(f"buffers of {name} ({type(module).__name__}) are on the meta device and are not "
                             "in the checkpoint")
        with torch.device(device):
            rebuilt = type(module)(config=model.config)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, rebuilt)


@torch.no_grad()
def patch_model(model: nn.Module, checkpoint: CheckpointReader | str | os.PathLike, *,
                device: torch.device | str | None = None, masked_max_tokens: int | None = None,
                moe_path: str = "auto") -> LoadReport:
    """Swap a transformers model's (``ARCHITECTURES``) MoE blocks, MLPs and attention
    projections for moe_fp8 layers and load every weight from a checkpoint in the DeepSeek-V3 format (FP8 or bf16).

    Args:
        model: a model of ``ARCHITECTURES`` (on the meta device, or real: its weights are replaced).
            Modules that stay transformers' keep their parameter dtypes; the checkpoint's values are cast to them.
        checkpoint: directory (or ``CheckpointReader``).
        device: where the weights go (default: the model's device; required for a meta model).
        masked_max_tokens, moe_path: passed to every ``Fp8FusedMoE`` (dispatch crossover, forced path).

    Returns a ``LoadReport``. Raises ``KeyError`` for a parameter the checkpoint lacks and ``ValueError`` for
    a shape mismatch or an unsupported config; nothing is silently left uninitialised.
    """
    _transformers()
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    config = model.config
    arch = _check_config(config)
    dev = _target_device(model, device)
    dtype = model.get_input_embeddings().weight.dtype
    report = LoadReport(ue8m0=reader.ue8m0)
    base = model.get_submodule("model")
    for i, layer in enumerate(base.layers):
        prefix = f"model.layers.{i}"
        for proj in arch.attention:
            if isinstance(getattr(layer.self_attn, proj, None), nn.Linear):
                _swap_linear(layer.self_attn, proj, f"{prefix}.self_attn.{proj}", reader, dev, dtype, report)
        kind = type(layer.mlp).__name__
        if kind == arch.moe_block:
            names = arch.moe_names
            block = f"{prefix}.{names.block}"  # the checkpoint's name of the block (transformers': mlp)
            _check_moe_not_listed(block, config, arch, reader.ignored_layers)
            moe = MOE_BLOCKS[arch.model_type](config, device=dev, dtype=dtype, masked_max_tokens=masked_max_tokens,
                                           path=moe_path, ue8m0=report.ue8m0)
            _load_router_weight(moe.gate, reader.get(f"{block}.gate.weight"), f"{block}.gate.weight")
            for e in moe.experts.local_expert_ids():
                for proj in (names.gate, names.up, names.down):
                    if f"{block}.experts.{e}.{proj}.weight{SCALE_SUFFIX}" not in reader:
                        report.quantized_on_load.append(f"{block}.experts.{e}.{proj}.weight")
            _load_fused_moe(moe.experts, reader, block, names=names)
            layer.mlp = moe
            report.moe_layers.append(f"{prefix}.mlp")
        elif kind == arch.mlp:
            _swap_dense_mlp(layer, f"{prefix}.mlp", reader, dev, dtype, report)
        else:
            raise ValueError(f"{prefix}.mlp is a {kind}, not transformers' {arch.moe_block} / {arch.mlp} "
                             "(already patched?)")

    # Everything else keeps transformers' modules: load by name (transformers' module names are the
    # checkpoint's), replacing meta parameters by real ones (assign) in their current dtype.
    ours = (Fp8Linear, Fp8MLP, Fp8MoEBlock)
    skip = {f"{n}." for n, m in model.named_modules() if isinstance(m, ours)}
    state: dict[str, Tensor] = {}
    missing = []
    for name, param in model.named_parameters():
        if any(name.startswith(s) for s in skip):
            continue
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and f"{prefix}.weight{SCALE_SUFFIX}" in reader:
            value = _dequantized(reader, prefix)  # an FP8 tensor of a module that stays unquantized
        elif name in reader:
            value = reader.get(name)
        else:
            missing.append(name)
            continue
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: the checkpoint gives shape {tuple(value.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        state[name] = value.to(device=dev, dtype=param.dtype)
    if missing:
        raise KeyError(f"the checkpoint {reader.path} lacks {len(missing)} tensors of the model: {missing[:8]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # assign=True replaced the embedding: re-point a tied lm_head (tie_word_embeddings) at it
    for p in model.parameters():
        p.requires_grad_(False)
    _rebuild_rotary(model, dev)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"not filled from the checkpoint: {still_meta[:8]}")
    report.unused = [n for n in reader if n not in reader.used]
    return report


def _load_router_weight(router: nn.Module, src: Tensor, name: str) -> None:
    """The router's weight becomes the checkpoint's tensor, in its dtype (``router_gemm`` reads a bf16 weight
    without a float32 copy, at half the bytes)."""
    if tuple(router.weight.shape) != tuple(src.shape):
        raise ValueError(f"{name}: the checkpoint gives shape {tuple(src.shape)}, the model expects "
                         f"{tuple(router.weight.shape)}")
    router.weight = nn.Parameter(src.to(router.weight.device), requires_grad=False)


def _load_config(path: str | os.PathLike) -> Any:
    """transformers' config of ``path/config.json``. A ``model_type`` that is another family's model under its own
    name (``MODEL_FAMILIES``: Kimi-K2 is DeepSeek-V3) is read as that family's config, as vLLM does, without running
    the checkpoint's remote code (``auto_map``)."""
    transformers = _transformers()
    config_dict, _ = transformers.PretrainedConfig.get_config_dict(os.fspath(path))
    model_type = config_dict.get("model_type")
    family = MODEL_FAMILIES.get(model_type, model_type)
    if family == model_type:
        return transformers.AutoConfig.from_pretrained(path)
    config_dict = {k: v for k, v in config_dict.items() if k not in ("model_type", "auto_map")}
    return transformers.AutoConfig.for_model(family, **config_dict)


def _build_meta_model(path: str | os.PathLike, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    transformers = _transformers()
    config = _load_config(path)
    arch = _check_config(config)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = getattr(transformers, arch.causal_lm)(config)
    return model.to(dtype)


def load_model(path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               masked_max_tokens: int | None = None, moe_path: str = "auto",
               attn_implementation: str | None = None) -> nn.Module:
    """Build transformers' model of ``path/config.json`` (``DeepseekV3ForCausalLM``, ``Qwen3MoeForCausalLM`` or
    ``Glm4MoeForCausalLM``, by ``model_type``) and run it on moe_fp8 layers.

    Args:
        path: checkpoint directory in the DeepSeek-V3 format (FP8 with ``weight_scale_inv``, or bf16).
        device: where the model lives (``"cuda"`` for the Hopper kernels).
        dtype: activation dtype and dtype of the modules that stay transformers' (embeddings, norms, lm_head).
        masked_max_tokens, moe_path: see ``Fp8FusedMoE``.
        attn_implementation: transformers' attention backend (``"eager"``, ``"sdpa"``, ...); default: its choice.

    Returns the model in eval mode, with ``model.moe_fp8_report`` (a ``LoadReport``); ``model.generate`` works
    as usual. Construction happens on the meta device, so host memory holds no bf16 copy of the experts.
    """
    model = _build_meta_model(path, dtype, attn_implementation)
    with CheckpointReader(path) as reader:
        report = patch_model(model, reader, device=device, masked_max_tokens=masked_max_tokens, moe_path=moe_path)
    model.moe_fp8_report = report
    return model.eval()


@torch.no_grad()
def load_reference_model(path: str | os.PathLike, *, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> nn.Module:
    """transformers' plain model (of ``ARCHITECTURES``) with every weight dequantized
    to ``dtype`` (validation only: it materialises the whole model in ``dtype``). Routed experts are stacked as transformers stores them:
    ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``."""
    model = _build_meta_model(path, dtype, attn_implementation)
    dev = torch.device(device)
    state: dict[str, Tensor] = {}
    arch = architecture(model.config)
    names = arch.moe_names
    with CheckpointReader(path) as reader:
        for name, param in model.named_parameters():
            if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
                block = arch.checkpoint_name(name.rsplit(".", 1)[0])  # {layer}.{names.block}.experts
                num_experts = param.shape[0]
                if name.endswith("gate_up_proj"):
                    value = torch.stack([torch.cat([_dequantized(reader, f"{block}.{e}.{names.gate}"),
                                                    _dequantized(reader, f"{block}.{e}.{names.up}")])
                                         for e in range(num_experts)])
                else:
                    value = torch.stack([_dequantized(reader, f"{block}.{e}.{names.down}")
                                         for e in range(num_experts)])
            else:
                stored = arch.checkpoint_name(name)
                if stored.endswith(".weight") and f"{stored}{SCALE_SUFFIX}" in reader:
                    value = _dequantized(reader, stored[: -len(".weight")])
                else:
                    value = reader.get(stored)
            state[name] = value.to(device=dev, dtype=param.dtype)
        for name, _buf in model.named_buffers():
            stored = arch.checkpoint_name(name)
            if stored in reader:  # e_score_correction_bias (transformers keeps it a buffer, fp32)
                state[name] = reader.get(stored).to(device=dev, dtype=torch.float32)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _rebuild_rotary(model, dev)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"not filled from the checkpoint: {still_meta[:8]}")
    return model.eval()


# ==============================================================================================
# comparing with the reference model
# ==============================================================================================

def _reference_moe_blocks(reference: nn.Module) -> list[nn.Module]:
    arch = architecture(reference.config)
    moe_cls = arch.cls(arch.moe_block)
    return [layer.mlp for layer in reference.get_submodule("model").layers if isinstance(layer.mlp, moe_cls)]


def reference_route(block: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' router of a reference MoE ``block`` on ``x [T, H]``: ``(logits, weights, ids)`` (MiniMax-M2's
    takes the block's correction bias as an argument)."""
    bias = getattr(block, "e_score_correction_bias", None)
    return block.gate(x) if bias is None else block.gate(x, bias)


@torch.no_grad()
def reference_logits(reference: nn.Module, input_ids: Tensor, routed_ids: list[Tensor] | None = None, *,
                     zero_moe: bool = False) -> Tensor:
    """``reference(input_ids).logits`` (``reference`` from ``load_reference_model``), optionally with each MoE
    block's experts forced to ``routed_ids[i]`` (``[T, top_k]`` global ids, one per MoE block in layer order;
    the combine weights stay transformers' formula on its own router scores) and with ``zero_moe`` every MoE
    block's output zeroed (to show what the MoE layers contribute)."""
    config = reference.config
    routing = MOE_BLOCKS[architecture(config).model_type].routing(config)
    queue = list(routed_ids) if routed_ids is not None else None
    handles = []

    def force(mod: nn.Module, args: Any, out: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        logits, _, _ = out
        ids = queue.pop(0).long().to(logits.device)
        if routing["scoring_func"] == "sigmoid":  # DeepSeek-V3's, GLM-4.5's and MiniMax-M2's routers
            weights = logits.float().sigmoid().gather(1, ids)
            if routing["renormalize"]:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return logits, weights * routing.get("routed_scaling_factor", 1.0), ids
        weights = logits.softmax(-1, dtype=torch.float).gather(1, ids)  # Qwen3MoeTopKRouter's formula
        if config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids

    try:
        for block in _reference_moe_blocks(reference):
            if queue is not None:
                handles.append(block.gate.register_forward_hook(force))
            if zero_moe:
                handles.append(block.register_forward_hook(lambda mod, args, out: torch.zeros_like(out)))
        device = next(reference.parameters()).device
        return reference(input_ids.to(device)).logits
    finally:
        for h in handles:
            h.remove()


@dataclasses.dataclass
class LogitComparison:
    """``compare_logits``' result, over ``routing_choices`` token→expert choices of our MoE layers:

    - ``diff``: ``calc_diff`` of the logits, end to end;
    - ``diff_same_routing``: the same with the reference on the experts our layers chose — the FP8 error
      itself (DESIGN §6 bound 2e-3);
    - ``routing_differs``: our choices the reference model, on its own hidden states, did not make (near
      ties tipped by the FP8 rounding upstream: what separates ``diff`` from ``diff_same_routing``);
    - ``router_disagrees``: our choices transformers' router, given *our* hidden states, does not make
      (0 unless our routing is wrong).
    """

    diff: float
    diff_same_routing: float
    routing_choices: int
    routing_differs: int
    router_disagrees: int


def _not_chosen(ids: Tensor, other: Tensor) -> int:
    """How many entries of ``ids [T, k]`` are absent from the same token's row of ``other [T, k]``."""
    return int((ids.long().cpu()[:, :, None] != other.long().cpu()[:, None, :]).all(-1).sum())


@torch.no_grad()
def compare_logits(model: nn.Module, reference: nn.Module, input_ids: Tensor) -> LogitComparison:
    """Compare a patched model (``load_model``) with ``reference`` (``load_reference_model`` of the same
    checkpoint) on one forward of ``input_ids [B, S]``; see ``LogitComparison``."""
    from moe_fp8.utils import calc_diff

    blocks = [m for m in model.modules() if isinstance(m, Fp8MoEBlock)]
    ref_blocks = _reference_moe_blocks(reference)
    inputs: list[Tensor] = []
    handles = [b.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
               for b in blocks]
    try:
        ours = model(input_ids.to(next(model.parameters()).device)).logits.float().cpu()
    finally:
        for h in handles:
            h.remove()
    routed, disagrees = [], 0
    for block, ref_block, x in zip(blocks, ref_blocks, inputs, strict=True):
        ids = block.experts.route(block.router_logits(x.contiguous()))[1].long().cpu()
        weight = ref_block.gate.weight
        disagrees += _not_chosen(ids, reference_route(ref_block, x.to(weight.device, weight.dtype))[2])
        routed.append(ids)
    ref_ids: list[Tensor] = []  # the reference's own choices on its own forward
    handles = [b.gate.register_forward_hook(lambda mod, args, out: ref_ids.append(out[2])) for b in ref_blocks]
    try:
        plain = reference_logits(reference, input_ids).float().cpu()
    finally:
        for h in handles:
            h.remove()
    return LogitComparison(
        diff=calc_diff(ours, plain),
        diff_same_routing=calc_diff(ours, reference_logits(reference, input_ids, routed).float().cpu()),
        routing_choices=sum(ids.numel() for ids in routed),
        routing_differs=sum(_not_chosen(a, b) for a, b in zip(routed, ref_ids, strict=True)),
        router_disagrees=disagrees)
