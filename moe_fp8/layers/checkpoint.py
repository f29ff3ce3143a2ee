"""DeepSeek-V3-format safetensors checkpoints: read them into the FP8 layers, and write random ones.

Format (as published by DeepSeek for V3 / R1 and read by vLLM, SGLang and transformers):

- ``config.json``: the Hugging Face config (``model_type = "deepseek_v3"``), with, for FP8 weights,
  ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}``;
- ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``
  (``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}``), or one
  ``model.safetensors``;
- every linear weight of the decoder layers is ``<module>.weight`` (``float8_e4m3fn [N, K]``) plus
  ``<module>.weight_scale_inv`` (``float32 [ceil(N/128), ceil(K/128)]``, a multiplier despite the name);
  embeddings, norms, the router (``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``) and
  ``lm_head`` stay bf16 / fp32. Routed experts are separate tensors per expert:
  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
- DeepSeek-V3.1 adds ``"scale_fmt": "ue8m0"`` to ``quantization_config``: every ``weight_scale_inv`` is a
  power of two (stored as fp32, or ``float8_e8m0fnu``) and activations are quantized with power-of-two
  scales too. The loaders then require layers built with ``ue8m0=True`` and check the scales.

Loading (``load_fp8_linear`` / ``load_fp8_mlp`` / ``load_fused_moe``) copies FP8 bytes and scales
straight from the memory-mapped files into the (stacked) parameters, reading only the slice a rank
needs (``safe_open(...).get_slice``): no bf16 copy of an FP8 weight is ever made. A weight stored
without ``weight_scale_inv`` (a bf16 checkpoint) is quantized on load (``moe_fp8.quant.per_block``) on
the parameter's device.

Writing (``write_deepseek_v3_checkpoint``) builds a random checkpoint of any DeepSeek-V3 config in this
exact format, for tests, demos and kernel warm-up; ``tiny_deepseek_v3_config`` gives a small valid config.
Qwen3-MoE's block-FP8 releases (``model_type = "qwen3_moe"``) use the same format (``quantization_config``,
``weight`` + ``weight_scale_inv``, per-expert tensors) with their own module names: ``write_qwen3_moe_checkpoint``
/ ``tiny_qwen3_moe_config``. Kimi-K2's (``model_type = "kimi_k2"``, ``architectures = ["DeepseekV3ForCausalLM"]``)
are DeepSeek-V3 checkpoints with 384 routed experts in one group (``tiny_kimi_k2_config``). GLM-4.5's
(``model_type = "glm4_moe"``) store DeepSeek-V3's MoE block under grouped-query attention (``tiny_glm4_moe_config``).
``MODEL_FAMILIES`` maps each ``model_type`` to the family whose module names it uses; ``write_checkpoint`` takes any
of their configs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moe_fp8.layers.linear import Fp8Linear, Fp8MLP, check_weight_scales
from moe_fp8.layers.moe import Fp8FusedMoE
from moe_fp8.layers.parallel import tp_shard_range
from moe_fp8.layers.quant_config import BlockFp8Settings, parse_quantization_config
from moe_fp8.quant import per_block
from moe_fp8.utils import GROUP_K, ceil_div

__all__ = [
    "FP8_QUANTIZATION_CONFIG",
    "MODEL_FAMILIES",
    "MOE_NAMES",
    "SCALE_FMTS",
    "TENSOR_SPECS",
    "CheckpointReader",
    "MoeNames",
    "TensorSpec",
    "deepseek_v3_tensor_specs",
    "glm4_moe_tensor_specs",
    "is_moe_layer",
    "load_fp8_linear",
    "load_fp8_mlp",
    "load_fused_moe",
    "minimax_m2_tensor_specs",
    "model_family",
    "qwen3_moe_tensor_specs",
    "read_block_fp8",
    "tiny_deepseek_v3_config",
    "tiny_glm4_moe_config",
    "tiny_kimi_k2_config",
    "tiny_minimax_m2_config",
    "tiny_qwen3_moe_config",
    "write_checkpoint",
    "write_deepseek_v3_checkpoint",
    "write_qwen3_moe_checkpoint",
]

Tensor = torch.Tensor
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"

# The quantization_config of DeepSeek-V3's config.json (block FP8, dynamic per-token-group activations).
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [GROUP_K, GROUP_K],
}
# model_type -> the family whose module and tensor names it uses. Kimi-K2's releases are DeepSeek-V3 under their
# own model_type (with DeepSeek's remote code); vLLM reads them with DeepseekV3Config too.
MODEL_FAMILIES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "qwen3_moe": "qwen3_moe",
                  "glm4_moe": "glm4_moe", "minimax_m2": "minimax_m2"}


class MoeNames(NamedTuple):
    """Where a family's checkpoint keeps a MoE block's tensors: the block under the decoder layer, each expert's
    gate / up / down projections under ``{block}.experts.{e}``, and the correction bias under the block."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    bias: str = "gate.e_score_correction_bias"


# family -> its MoE names (MiniMax-M2 keeps Mixtral's: block_sparse_moe, w1 / w3 / w2, the bias on the block)
MOE_NAMES = {"deepseek_v3": MoeNames(), "qwen3_moe": MoeNames(), "glm4_moe": MoeNames(),
             "minimax_m2": MoeNames("block_sparse_moe", "w1", "w3", "w2", "e_score_correction_bias")}
# quantization_config.scale_fmt values read: absent / None (fp32 scales, DeepSeek-V3) or "ue8m0" (V3.1).
SCALE_FMTS = (None, "ue8m0")


# ==============================================================================================
# Reading
# ==============================================================================================

class CheckpointReader:
    """Lazy, memory-mapped access to the tensors of a (sharded) safetensors checkpoint.

    Args:
        path: a checkpoint directory (with ``model.safetensors.index.json``, or a single
            ``*.safetensors`` file) or the path of one ``.safetensors`` file.

    ``config`` is ``config.json`` as a dict (``{}`` if absent); ``quant_settings`` its ``quantization_config`` as
    ``moe_fp8.layers.quant_config`` reads it (None if absent; an unsupported one raises ``ValueError`` naming the
    field), with ``ignored_layers`` and ``ue8m0`` (``scale_fmt`` ``"ue8m0"``, DeepSeek-V3.1: power-of-two scales)
    as properties. Tensors are read on CPU through
    ``safetensors.safe_open``; ``get_slice`` reads only the requested rows / columns. Names a loader
    consumed are collected in ``used`` (so callers can report what a model did not take). Use as a
    context manager or call ``close()`` to drop the file handles.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if path.is_file():
            root, files = path.parent, [path.name]
            self._weight_map = None
        elif (path / INDEX_FILE).is_file():
            root = path
            index = json.loads((path / INDEX_FILE).read_text())
            if not isinstance(index.get("weight_map"), dict):
                raise ValueError(f"{path / INDEX_FILE} has no 'weight_map' object")
            self._weight_map = dict(index["weight_map"])
            files = sorted(set(self._weight_map.values()))
        elif path.is_dir():
            root, files = path, sorted(p.name for p in path.glob("*.safetensors"))
            self._weight_map = None
            if not files:
                raise FileNotFoundError(f"no {INDEX_FILE} and no *.safetensors file in {path}")
        else:
            raise FileNotFoundError(f"checkpoint not found: {path}")
        self.path = root
        self._handles: dict[str, Any] = {}
        if self._weight_map is None:  # no index: list every file's tensors
            self._weight_map = {}
            for name in files:
                for key in self._handle(name).keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._weight_map[key] = name
        for name in files:
            if not (root / name).is_file():
                raise FileNotFoundError(f"shard {name} listed in {root / INDEX_FILE} is missing")
        config_file = root / "config.json"
        self.config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.used: set[str] = set()
        qc = self.config.get("quantization_config")
        try:
            self.quant_settings: BlockFp8Settings | None = None if qc is None else parse_quantization_config(qc)
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None

    @property
    def ignored_layers(self) -> tuple[str, ...]:
        """Module names ``quantization_config`` keeps unquantized (``ignored_layers`` / ``modules_to_not_convert``)."""
        return () if self.quant_settings is None else self.quant_settings.ignored_layers

    @property
    def ue8m0(self) -> bool:
        """Whether the checkpoint declares power-of-two (UE8M0) scales: ``quantization_config.scale_fmt``."""
        return self.quant_settings is not None and self.quant_settings.scale_fmt == "ue8m0"

    def _handle(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            # NOTE: safetensors is imported on first use (keeps ~25 ms off `import moe_fp8`).
            from safetensors import safe_open

            handle = safe_open(str(self.path / file), framework="pt", device="cpu")
            self._handles[file] = handle
        return handle

    def _file_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.path}") from None

    def keys(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file_of(name)).get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        """The whole tensor (CPU, stored dtype)."""
        tensor = self._handle(self._file_of(name)).get_tensor(name)
        self.used.add(name)
        return tensor

    def get_slice(self, name: str, rows: tuple[int, int] | None = None,
                  cols: tuple[int, int] | None = None) -> Tensor:
        """Rows ``[r0, r1)`` and / or columns ``[c0, c1)`` of a 2-D tensor, reading only those bytes."""
        if rows is None and cols is None:
            return self.get(name)
        sl = self._handle(self._file_of(name)).get_slice(name)
        r = slice(*rows) if rows is not None else slice(None)
        c = slice(*cols) if cols is not None else slice(None)
        self.used.add(name)
        return sl[r, c]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_reader(checkpoint: CheckpointReader | str | os.PathLike) -> CheckpointReader:
    return checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)


# dtypes a weight_scale_inv may be stored in (converted to fp32 on load; UE8M0 checkpoints may store float8_e8m0fnu)
_SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                  getattr(torch, "float8_e8m0fnu", None)) if d is not None)


def read_block_fp8(reader: CheckpointReader, prefix: str, *, rows: tuple[int, int] | None = None,
                   cols: tuple[int, int] | None = None, device: torch.device | str | None = None,
                   ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """``(weight fp8 [n, k], weight_scale_inv fp32 [ceil(n/128), ceil(k/128)])`` of ``{prefix}.weight``,
    restricted to ``rows`` / ``cols`` (each ``[start, stop)``; starts must be multiples of 128).

    A stored FP8 weight and its scales are sliced as stored (bytes unchanged). A weight without
    ``weight_scale_inv`` (bf16 / fp16 / fp32) is read (the slice only), moved to ``device`` and quantized
    per 128×128 block. Scales stored in another floating-point format (bf16, fp16, fp64, UE8M0
    ``float8_e8m0fnu``) are converted to fp32; any other dtype is refused (``TypeError``), and so are NaN,
    infinite and negative scales (``check_weight_scales``; ``ValueError`` naming the tensor).
    ``ue8m0``: the scales must be powers of two (``check_ue8m0_scales``), and a bf16 weight is quantized with
    power-of-two scales.
    """
    w_name, s_name = f"{prefix}.weight", f"{prefix}.weight{SCALE_SUFFIX}"
    shape = reader.shape(w_name)
    if len(shape) != 2:
        raise ValueError(f"{w_name} must be 2-D [N, K], the checkpoint has shape {shape}")
    for what, rng in (("rows", rows), ("cols", cols)):
        if rng is not None and rng[0] % GROUP_K != 0:
            raise ValueError(f"{w_name}: a {what} slice must start on a {GROUP_K} boundary, got {rng}")
    if s_name in reader:
        s_shape = reader.shape(s_name)
        want = (ceil_div(shape[0], GROUP_K), ceil_div(shape[1], GROUP_K))
        if s_shape != want:
            raise ValueError(f"{s_name} must have shape {want} (128×128 blocks of {w_name} {shape}), the "
                             f"checkpoint has {s_shape}")
        w = reader.get_slice(w_name, rows, cols)
        if w.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{w_name} has a {s_name} but is stored as {w.dtype}, not float8_e4m3fn")
        s_rows = None if rows is None else (rows[0] // GROUP_K, ceil_div(rows[1], GROUP_K))
        s_cols = None if cols is None else (cols[0] // GROUP_K, ceil_div(cols[1], GROUP_K))
        s = reader.get_slice(s_name, s_rows, s_cols)
        if s.dtype not in _SCALE_DTYPES:
            raise TypeError(f"{s_name} is stored as {s.dtype}: block scales are float32 (or another floating-point "
                            f"format: {', '.join(str(d)[6:] for d in _SCALE_DTYPES)}), so this is not a scale tensor")
        s = s if s.dtype == torch.float32 else s.to(torch.float32)
        check_weight_scales(s, s_name, ue8m0=ue8m0)
        return w, s
    w = reader.get_slice(w_name, rows, cols)
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{w_name} is stored as {w.dtype} without a {s_name}: cannot interpret it")
    return per_block(w.to(device).contiguous(), ue8m0=ue8m0)


def _check_scale_fmt(reader: CheckpointReader, module: torch.nn.Module, what: str) -> bool:
    """The module's ``ue8m0`` (refusing a UE8M0 checkpoint for a module built without it)."""
    ue8m0 = bool(getattr(module, "ue8m0", False))
    if reader.ue8m0 and not ue8m0:
        raise ValueError(f"{reader.path} declares quantization_config.scale_fmt = 'ue8m0' (power-of-two scales, "
                         f"DeepSeek-V3.1) but {what} was built with ue8m0=False: build it with ue8m0=True so its "
                         "activations are quantized as the checkpoint expects")
    return ue8m0


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.is_meta:  # copy_ into a meta tensor does nothing: the load would "succeed" with nothing loaded
        raise ValueError(f"{what}: the module was built on the meta device (no storage to fill): materialise it "
                         "first (module.to_empty(device=...))")
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: the checkpoint gives shape {tuple(src.shape)}, the module expects "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


@torch.no_grad()
def load_fp8_linear(module: Fp8Linear, checkpoint: CheckpointReader | str | os.PathLike,
                    prefixes: str | Sequence[str], *, tp_rank: int = 0, tp_size: int = 1,
                    mode: str = "column") -> None:
    """Fill an ``Fp8Linear`` from ``{prefix}.weight`` (+ ``.weight_scale_inv``, ``.bias``).

    Args:
        prefixes: one module name (``"model.layers.0.self_attn.o_proj"``), or several whose weights are
            stacked along N into this one layer (``[".../gate_proj", ".../up_proj"]`` for a fused gate_up;
            every part but the last must be a multiple of 128 rows).
        tp_rank, tp_size, mode: load this rank's shard: ``"column"`` splits each part's N, ``"row"`` splits K
            (bias on rank 0 only); the same split as ``shard_fp8_linear``. Shards must be multiples of 128.
    """
    reader = _as_reader(checkpoint)
    parts = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    ue8m0 = _check_scale_fmt(reader, module, f"the Fp8Linear for {parts[0]}")
    if mode not in ("column", "row"):
        raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")
    if mode == "row" and len(parts) != 1:
        raise ValueError("mode='row' takes a single prefix")
    row_off = 0
    for idx, prefix in enumerate(parts):
        n, k = reader.shape(f"{prefix}.weight")
        if mode == "column":
            rows, cols = tp_shard_range(n, tp_rank, tp_size, f"{prefix}.weight N"), None
        else:
            rows, cols = None, tp_shard_range(k, tp_rank, tp_size, f"{prefix}.weight K")
        w, s = read_block_fp8(reader, prefix, rows=rows, cols=cols, device=module.weight.device, ue8m0=ue8m0)
        if idx < len(parts) - 1 and w.shape[0] % GROUP_K != 0:
            raise ValueError(f"{prefix}: a fused part must have a multiple of {GROUP_K} rows, got {w.shape[0]}")
        r0 = row_off
        _copy(module.weight[r0:r0 + w.shape[0]], w, f"{prefix}.weight -> rows {r0}: of {tuple(module.weight.shape)}")
        _copy(module.weight_scale_inv[r0 // GROUP_K:r0 // GROUP_K + s.shape[0]], s, f"{prefix}.weight{SCALE_SUFFIX}")
        b_name = f"{prefix}.bias"
        if module.bias is None and b_name in reader:
            raise ValueError(f"{b_name} is in the checkpoint but the Fp8Linear for {prefix} has no bias: build it with "
                             "bias=True (its output would miss the bias)")
        if module.bias is not None:
            if mode == "row":  # a row split adds the bias once: on rank 0
                bias = reader.get(b_name) if tp_rank == 0 else torch.zeros(w.shape[0])
            else:
                bias = reader.get(b_name)[rows[0]:rows[1]]
            _copy(module.bias[r0:r0 + w.shape[0]], bias, b_name)
        row_off += w.shape[0]
    if row_off != module.out_features:
        raise ValueError(f"{parts}: the checkpoint gives {row_off} output rows, the module has {module.out_features}")


def load_fp8_mlp(module: Fp8MLP, checkpoint: CheckpointReader | str | os.PathLike, prefix: str, *,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
    """Fill an ``Fp8MLP`` from ``{prefix}.{gate,up,down}_proj`` (dense MLP or ``mlp.shared_experts``):
    gate and up stacked into ``gate_up_proj``; under TP, column split of gate / up and row split of down."""
    reader = _as_reader(checkpoint)
    load_fp8_linear(module.gate_up_proj, reader, [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
                    tp_rank=tp_rank, tp_size=tp_size, mode="column")
    load_fp8_linear(module.down_proj, reader, f"{prefix}.down_proj", tp_rank=tp_rank, tp_size=tp_size, mode="row")


@torch.no_grad()
def load_fused_moe(module: Fp8FusedMoE, checkpoint: CheckpointReader | str | os.PathLike, prefix: str, *,
                   tp_rank: int = 0, tp_size: int = 1, names: MoeNames = MoeNames()) -> None:
    """Fill an ``Fp8FusedMoE`` from a DeepSeek-V3 MoE block ``prefix`` (e.g. ``"model.layers.3.mlp"``).

    Reads, for each expert of this rank (``module.local_expert_ids()``, from its ``expert_map``),
    ``{prefix}.experts.{e}.{gate,up,down}_proj.weight`` (+ scales) into ``w13_weight[local] = [gate | up]``
    and ``w2_weight[local] = down``; with ``tp_size > 1`` only rows / columns ``[r·I, (r+1)·I)`` of the
    expert intermediate size (``I = module.intermediate_size``). Also ``{prefix}.gate.e_score_correction_bias``
    when the module uses it and ``{prefix}.shared_experts.*`` when it has shared experts (split the same way).
    The router weight ``{prefix}.gate.weight`` is not part of the module (router logits are an input). ``names``:
    another family's projection and bias names (``MOE_NAMES``; ``prefix`` is then its block, e.g.
    ``"model.layers.3.block_sparse_moe"``).
    """
    reader = _as_reader(checkpoint)
    ue8m0 = _check_scale_fmt(reader, module, f"the Fp8FusedMoE for {prefix}")
    inter = module.intermediate_size
    ib = inter // GROUP_K
    dev = module.w13_weight.device
    for local, expert in enumerate(module.local_expert_ids()):
        base = f"{prefix}.experts.{expert}"
        gate_shape = reader.shape(f"{base}.{names.gate}.weight")
        full_i = gate_shape[0]
        # the shard below takes rows / columns [r·I, (r+1)·I) of each: the three must agree on the full I, or a
        # larger up or down projection would be cut without a word
        for proj, got, want in ((names.up, reader.shape(f"{base}.{names.up}.weight"), gate_shape),
                                (names.down, reader.shape(f"{base}.{names.down}.weight")[1:], (full_i,))):
            if tuple(got[:len(want)]) != tuple(want):
                raise ValueError(f"{base}.{proj}.weight has shape {reader.shape(f'{base}.{proj}.weight')}, which "
                                 f"disagrees with {base}.{names.gate}.weight {gate_shape} (up [I, H], down [H, I])")
        i_range = tp_shard_range(full_i, tp_rank, tp_size, f"{base} intermediate size")
        for half, proj in enumerate((names.gate, names.up)):
            w, s = read_block_fp8(reader, f"{base}.{proj}", rows=i_range, device=dev, ue8m0=ue8m0)
            _copy(module.w13_weight[local, half * inter:(half + 1) * inter], w, f"{base}.{proj}.weight")
            _copy(module.w13_weight_scale_inv[local, half * ib:(half + 1) * ib], s, f"{base}.{proj}.weight{SCALE_SUFFIX}")
        w, s = read_block_fp8(reader, f"{base}.{names.down}", cols=i_range, device=dev, ue8m0=ue8m0)
        _copy(module.w2_weight[local], w, f"{base}.{names.down}.weight")
        _copy(module.w2_weight_scale_inv[local], s, f"{base}.{names.down}.weight{SCALE_SUFFIX}")
    # a checkpoint tensor the module has no place for would be dropped, and the layer would compute something else
    # than the model: routing without the correction bias, an MoE without its shared experts
    bias_name = f"{prefix}.{names.bias}"
    if module.e_score_correction_bias is not None:
        _copy(module.e_score_correction_bias, reader.get(bias_name).to(torch.float32), bias_name)
    elif bias_name in reader:
        raise ValueError(f"{bias_name} is in the checkpoint but the Fp8FusedMoE for {prefix} was built without it: "
                         "build it with use_correction_bias=True (DeepSeek-V3's noaux_tc routing adds it)")
    shared = f"{prefix}.shared_experts"
    if module.shared_experts is not None:
        load_fp8_mlp(module.shared_experts, reader, shared, tp_rank=tp_rank, tp_size=tp_size)
    elif f"{shared}.gate_proj.weight" in reader:
        raise ValueError(f"{shared}.* is in the checkpoint but the Fp8FusedMoE for {prefix} has no shared experts: "
                         "build it with num_shared_experts (DeepSeek-V3: 1)")


# ==============================================================================================
# Writing random checkpoints
# ==============================================================================================

class TensorSpec(NamedTuple):
    """One tensor of a DeepSeek-V3 checkpoint: shape, stored dtype when not FP8, whether it is stored as
    block FP8 in an FP8 checkpoint, and the normal distribution random checkpoints draw it from."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fp8: bool
    mean: float
    std: float


def _tiny_common() -> dict[str, Any]:
    """The entries the tiny configs of both families share: hidden 256, 3 layers, 4 heads, 16-expert sizes, FP8."""
    return {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "quantization_config": dict(FP8_QUANTIZATION_CONFIG),
    }


def tiny_deepseek_v3_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete DeepSeek-V3 ``config.json`` dict (FP8 ``quantization_config`` included).

    Every GEMM dimension is a multiple of 128 except the MLA projections' natural sizes
    (``kv_a_proj_with_mqa``: N = kv_lora_rank + qk_rope_head_dim = 160), which the FP8 GEMM takes as
    ragged N. 3 layers, the first dense; 16 routed experts in 4 groups, top-4 of the best 2 groups,
    one shared expert. Keyword arguments override entries.
    """
    return {
        **_tiny_common(),
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "num_nextn_predict_layers": 0,
        **overrides,
    }


def tiny_kimi_k2_config(**overrides: Any) -> dict[str, Any]:
    """A small Kimi-K2 ``config.json`` dict: ``tiny_deepseek_v3_config`` under ``model_type = "kimi_k2"`` with what
    sets Kimi-K2 apart from DeepSeek-V3 kept at full size: 384 routed experts in one group (top-8 of all,
    ``n_group = topk_group = 1``), ``routed_scaling_factor = 2.827``, YaRN rope scaling, and the ``auto_map`` of its
    remote code (which moe_fp8 never runs). 2 layers, the first dense. Keyword arguments override entries."""
    return tiny_deepseek_v3_config(**{
        "model_type": "kimi_k2",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "num_hidden_layers": 2,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        **overrides,
    })


def tiny_glm4_moe_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete GLM-4.5 ``config.json`` dict (``model_type = "glm4_moe"``, the format of Zhipu's
    block-FP8 releases such as GLM-4.5-FP8: DeepSeek-V3's ``quantization_config``, per-expert tensors and MoE block —
    sigmoid scores with a correction bias, ``routed_scaling_factor``, a shared expert, the first layers dense — under
    grouped-query attention with q / k / v biases and half-rotary heads).

    3 layers, the first dense; 16 experts top-4 of one group, renormalized, scaled by 2.5; one shared expert; 4 query
    and 2 key-value heads of 64, per-head q / k norms. Keyword arguments override entries.
    """
    return {
        **_tiny_common(),
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0,
        **overrides,
    }


def model_family(config: Mapping[str, Any]) -> str:
    """The family (``"deepseek_v3"``, ``"qwen3_moe"`` or ``"glm4_moe"``) of a ``config.json`` dict by its ``model_type``
    (``MODEL_FAMILIES``), or ``ValueError`` for a model type moe_fp8 does not know."""
    model_type = config.get("model_type")
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {model_type!r}: moe_fp8 knows {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def is_moe_layer(config: Mapping[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` has a routed-expert MLP. DeepSeek-V3 (and GLM-4.5, which has no
    ``moe_layer_freq``): ``layer >= first_k_dense_replace`` and ``layer % moe_layer_freq == 0``; Qwen3-MoE
    (``model_type = "qwen3_moe"``): ``layer`` not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step ==
    0``, as transformers builds them; MiniMax-M2: every layer."""
    if config.get("model_type") == "minimax_m2":  # every layer
        return bool(config.get("num_local_experts"))
    if config.get("model_type") == "qwen3_moe":
        return (bool(config.get("num_experts")) and layer not in (config.get("mlp_only_layers") or ())
                and (layer + 1) % int(config.get("decoder_sparse_step") or 1) == 0)
    return (bool(config.get("n_routed_experts")) and layer >= int(config.get("first_k_dense_replace", 0))
            and layer % int(config.get("moe_layer_freq", 1)) == 0)


class _Specs:
    """Builds an ordered ``{name: TensorSpec}`` with the draws shared by every model family (see
    ``deepseek_v3_tensor_specs``)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.h = int(config["hidden_size"])
        self.specs: dict[str, TensorSpec] = {
            "model.embed_tokens.weight": TensorSpec((int(config["vocab_size"]), self.h), torch.bfloat16, False, 0.0,
                                                    1.0)}

    def layers(self) -> Iterator[tuple[int, str, str]]:
        """Each decoder layer's index, prefix and attention prefix, once its two norms are added."""
        for i in range(int(self.config["num_hidden_layers"])):
            prefix = f"model.layers.{i}"
            self.norm(f"{prefix}.input_layernorm", self.h)
            self.norm(f"{prefix}.post_attention_layernorm", self.h)
            yield i, prefix, f"{prefix}.self_attn"

    def linear(self, name: str, n: int, k: int, scale: float = 1.0) -> None:
        self.specs[f"{name}.weight"] = TensorSpec((n, k), torch.bfloat16, True, 0.0, scale / math.sqrt(k))

    def norm(self, name: str, size: int) -> None:
        self.specs[f"{name}.weight"] = TensorSpec((size,), torch.bfloat16, False, 1.0, 0.1)

    def mlp(self, name: str, inter: int, names: MoeNames = MoeNames()) -> None:
        """A gated MLP's gate / up / down projections (``names``: an expert's in another family's names)."""
        self.linear(f"{name}.{names.gate}", inter, self.h)
        self.linear(f"{name}.{names.up}", inter, self.h)
        self.linear(f"{name}.{names.down}", self.h, inter, 0.5)

    def router(self, prefix: str, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> None:
        """The router weight ``{prefix}.gate.weight`` (bf16 unless given, never quantized)."""
        self.specs[f"{prefix}.gate.weight"] = TensorSpec((num_experts, self.h), dtype, False, 0.0,
                                                         2.0 / math.sqrt(self.h))

    def experts(self, prefix: str, num_experts: int, inter: int, names: MoeNames = MoeNames()) -> None:
        for e in range(num_experts):
            self.mlp(f"{prefix}.experts.{e}", inter, names)

    def head(self) -> dict[str, TensorSpec]:
        self.norm("model.norm", self.h)
        if not self.config.get("tie_word_embeddings", False):
            self.specs["lm_head.weight"] = TensorSpec((int(self.config["vocab_size"]), self.h), torch.bfloat16,
                                                      False, 0.0, 1.0 / math.sqrt(self.h))
        return self.specs


def deepseek_v3_tensor_specs(config: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a DeepSeek-V3 checkpoint for ``config`` (weight names; FP8 ones also have a
    ``.weight_scale_inv`` in FP8 checkpoints), in a stable order.

    Random draws: linear weights ``N(0, 1/K)`` (unit-variance outputs for unit inputs), the attention
    output and MLP down projections at half that scale (the residual stream stays dominated by the
    embeddings, as in trained models), norms ``N(1, 0.1²)``, embeddings ``N(0, 1)``, router weight
    ``N(0, 4/H)`` (well separated expert scores), correction bias ``N(0, 0.05²)``.
    """
    b = _Specs(config)
    h, heads = b.h, int(config["num_attention_heads"])
    q_lora = config.get("q_lora_rank")
    kv_lora = int(config["kv_lora_rank"])
    rope, nope, v_dim = int(config["qk_rope_head_dim"]), int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
    for i, p, attn in b.layers():
        if q_lora:
            b.linear(f"{attn}.q_a_proj", int(q_lora), h)
            b.norm(f"{attn}.q_a_layernorm", int(q_lora))
            b.linear(f"{attn}.q_b_proj", heads * (nope + rope), int(q_lora))
        else:
            b.linear(f"{attn}.q_proj", heads * (nope + rope), h)
        b.linear(f"{attn}.kv_a_proj_with_mqa", kv_lora + rope, h)
        b.norm(f"{attn}.kv_a_layernorm", kv_lora)
        b.linear(f"{attn}.kv_b_proj", heads * (nope + v_dim), kv_lora)
        b.linear(f"{attn}.o_proj", h, heads * v_dim, 0.5)
        _deepseek_mlp(b, i, p, bias=config.get("topk_method", "noaux_tc") == "noaux_tc")
    return b.head()


def _deepseek_mlp(b: _Specs, i: int, p: str, *, bias: bool) -> None:
    """Layer ``i``'s MLP as DeepSeek-V3 (and GLM-4.5) store it: the MoE block (``mlp.gate`` with its
    ``e_score_correction_bias`` if ``bias``, ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``) or a dense ``mlp.*``."""
    config = b.config
    if not is_moe_layer(config, i):
        b.mlp(f"{p}.mlp", int(config["intermediate_size"]))
        return
    num_experts, moe_i = int(config["n_routed_experts"]), int(config["moe_intermediate_size"])
    b.router(f"{p}.mlp", num_experts)
    if bias:
        b.specs[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec((num_experts,), torch.float32, False, 0.0, 0.05)
    b.experts(f"{p}.mlp", num_experts, moe_i)
    if int(config.get("n_shared_experts") or 0) > 0:
        b.mlp(f"{p}.mlp.shared_experts", moe_i * int(config["n_shared_experts"]))


def tiny_qwen3_moe_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete Qwen3-MoE ``config.json`` dict (``model_type = "qwen3_moe"``, the format of
    Qwen's block-FP8 releases such as Qwen3-30B-A3B-FP8: DeepSeek-V3's ``quantization_config`` plus
    ``modules_to_not_convert`` naming every bf16 module (the writer fills it in, as those releases do: embeddings,
    norms, routers, ``lm_head``), per-expert tensors as DeepSeek-V3's, grouped-query attention with per-head q / k
    norms, softmax top-k routing, no shared experts).

    3 layers, the first dense (``mlp_only_layers = [0]``); 16 experts top-4, renormalized; 4 query and 2
    key-value heads of 64. Keyword arguments override entries.
    """
    return {
        **_tiny_common(),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "use_sliding_window": False,
        "sliding_window": None,
        **overrides,
    }


def _gqa_attention(b: _Specs, attn: str, *, o_bias: bool, qk_norm: str | None) -> None:
    """Grouped-query attention's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` (biases where
    ``attention_bias``: on ``o_proj`` too if ``o_bias``), and ``q_norm`` / ``k_norm``: per head (``qk_norm`` "head")
    or over all heads (``"layer"``, MiniMax-M2's)."""
    config, h = b.config, b.h
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    bias = bool(config.get("attention_bias", False))
    for proj, n, k, scale in (("q_proj", heads * head_dim, h, 1.0), ("k_proj", kv_heads * head_dim, h, 1.0),
                              ("v_proj", kv_heads * head_dim, h, 1.0), ("o_proj", h, heads * head_dim, 0.5)):
        b.linear(f"{attn}.{proj}", n, k, scale)
        if bias and (o_bias or proj != "o_proj"):
            b.specs[f"{attn}.{proj}.bias"] = TensorSpec((n,), torch.bfloat16, False, 0.0, 0.02)
    if qk_norm is not None:
        b.norm(f"{attn}.q_norm", head_dim * (heads if qk_norm == "layer" else 1))
        b.norm(f"{attn}.k_norm", head_dim * (kv_heads if qk_norm == "layer" else 1))


def qwen3_moe_tensor_specs(config: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a Qwen3-MoE checkpoint for ``config`` (``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``
    with ``q_norm`` / ``k_norm``; ``mlp.gate`` + ``mlp.experts.{e}.*`` or a dense ``mlp.*``), in a stable order,
    with the draws of ``deepseek_v3_tensor_specs`` (attention biases, where configured, ``N(0, 0.02²)``)."""
    b = _Specs(config)
    for i, p, attn in b.layers():
        _gqa_attention(b, attn, o_bias=True, qk_norm="head")
        if is_moe_layer(config, i):
            b.router(f"{p}.mlp", int(config["num_experts"]))
            b.experts(f"{p}.mlp", int(config["num_experts"]), int(config["moe_intermediate_size"]))
        else:
            b.mlp(f"{p}.mlp", int(config["intermediate_size"]))
    return b.head()


def glm4_moe_tensor_specs(config: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a GLM-4.5 checkpoint for ``config`` (grouped-query attention, q / k / v biases where
    ``attention_bias``, ``q_norm`` / ``k_norm`` where ``use_qk_norm``; DeepSeek-V3's MoE block: ``mlp.gate`` with its
    ``e_score_correction_bias``, ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``; dense ``mlp.*`` before
    ``first_k_dense_replace``), in a stable order, with the draws of ``deepseek_v3_tensor_specs``."""
    b = _Specs(config)
    for i, p, attn in b.layers():
        _gqa_attention(b, attn, o_bias=False, qk_norm="head" if config.get("use_qk_norm", False) else None)
        _deepseek_mlp(b, i, p, bias=True)  # (GLM-4.5's router always has the bias)
    return b.head()


def tiny_minimax_m2_config(**overrides: Any) -> dict[str, Any]:
    """A small but complete MiniMax-M2 ``config.json`` dict (``model_type = "minimax_m2"``, the format of its
    block-FP8 release: DeepSeek-V3's ``quantization_config`` and ``weight`` + ``weight_scale_inv``, under Mixtral's
    MoE names: ``block_sparse_moe.gate`` (fp32), ``block_sparse_moe.e_score_correction_bias``,
    ``block_sparse_moe.experts.{e}.w1 / w3 / w2``). Every layer MoE, sigmoid scores with the correction bias, top-k
    renormalized, no shared expert, no scaling; grouped-query attention with q / k norms over all heads and partial
    rotary (``rotary_dim``).

    2 layers; 16 experts of I = 128 (``intermediate_size``) top-4; 4 query and 2 key-value heads of 64. Keyword
    arguments override entries.
    """
    common = {k: v for k, v in _tiny_common().items() if k != "moe_intermediate_size"}
    return {
        **common,
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rotary_dim": 32,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        **overrides,
    }


def minimax_m2_tensor_specs(config: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of a MiniMax-M2 checkpoint for ``config`` (grouped-query attention without biases, ``q_norm`` /
    ``k_norm`` over all heads; in every layer the MoE block under ``MOE_NAMES["minimax_m2"]``: the fp32 router
    ``block_sparse_moe.gate``, ``block_sparse_moe.e_score_correction_bias``, ``block_sparse_moe.experts.{e}.w1 / w3 /
    w2``), in a stable order, with the draws of ``deepseek_v3_tensor_specs``."""
    b = _Specs(config)
    names = MOE_NAMES["minimax_m2"]
    num_experts = int(config["num_local_experts"])
    for _, p, attn in b.layers():
        _gqa_attention(b, attn, o_bias=False, qk_norm="layer" if config.get("use_qk_norm", True) else None)
        block = f"{p}.{names.block}"
        b.router(block, num_experts, torch.float32)
        b.specs[f"{block}.{names.bias}"] = TensorSpec((num_experts,), torch.float32, False, 0.0, 0.05)
        b.experts(block, num_experts, int(config["intermediate_size"]), names)
    return b.head()


TENSOR_SPECS = {"deepseek_v3": deepseek_v3_tensor_specs, "qwen3_moe": qwen3_moe_tensor_specs,
                "glm4_moe": glm4_moe_tensor_specs, "minimax_m2": minimax_m2_tensor_specs}


def write_checkpoint(path: str | os.PathLike, config: Mapping[str, Any], *, seed: int = 0, fp8: bool = True,
                     num_shards: int = 2, scale_fmt: str | None = None) -> Path:
    """Write a random checkpoint for ``config`` (any ``model_type`` of ``MODEL_FAMILIES``; ``TENSOR_SPECS`` by
    family) to ``path``; ``write_deepseek_v3_checkpoint`` documents the arguments and the format."""
    return _write(path, config, TENSOR_SPECS[model_family(config)], seed, fp8, num_shards, scale_fmt)


def _write(path: str | os.PathLike, config: Mapping[str, Any], specs_of: Any, seed: int, fp8: bool,
           num_shards: int, scale_fmt: str | None) -> Path:
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    if scale_fmt not in SCALE_FMTS or (scale_fmt is not None and not fp8):
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS} (and needs fp8=True), got {scale_fmt!r}")
    ue8m0 = scale_fmt == "ue8m0"
    config = dict(config)
    specs = specs_of(config)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        if ue8m0:
            config["quantization_config"]["scale_fmt"] = scale_fmt
        if config.get("model_type") == "qwen3_moe":  # Qwen's FP8 releases list every module left bf16
            config["quantization_config"]["modules_to_not_convert"] = [
                name.removesuffix(".weight") for name, spec in specs.items()
                if name.endswith(".weight") and not spec.fp8]
    else:
        config.pop("quantization_config", None)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Tensor] = {}
    for name, spec in specs.items():
        draw = torch.randn(spec.shape, generator=gen, dtype=torch.float32) * spec.std + spec.mean
        if fp8 and spec.fp8:
            w_fp8, w_scale = per_block(draw, ue8m0=ue8m0)
            tensors[name] = w_fp8
            tensors[name + SCALE_SUFFIX] = w_scale
        else:
            tensors[name] = draw.to(spec.dtype)

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, Tensor]] = [{} for _ in range(num_shards)]
    running = 0
    for name, t in tensors.items():  # contiguous runs of names, balanced by bytes
        shards[min(num_shards - 1, running * num_shards // max(total, 1))][name] = t
        running += t.numel() * t.element_size()
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    for idx, shard in enumerate(shards):
        file = f"model-{idx + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_deepseek_v3_checkpoint(path: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                                 seed: int = 0, fp8: bool = True, num_shards: int = 2,
                                 scale_fmt: str | None = None) -> Path:
    """Write a random DeepSeek-V3 checkpoint for ``config`` (default ``tiny_deepseek_v3_config()``) to ``path``.

    ``fp8=True``: the linear weights of the decoder layers are block FP8 (``weight`` + ``weight_scale_inv``,
    quantized from the random draw with ``moe_fp8.quant.per_block``) and ``config.json`` carries
    ``quantization_config``; ``fp8=False``: everything bf16 (fp32 correction bias), no ``quantization_config``.
    ``scale_fmt="ue8m0"`` (with ``fp8``) writes a DeepSeek-V3.1-style checkpoint: power-of-two fp32 scales
    (``per_block(..., ue8m0=True)``) and ``quantization_config.scale_fmt = "ue8m0"``. Tensors are spread over ``num_shards`` files ``model-0000i-of-0000n.safetensors`` in spec order, with
    ``model.safetensors.index.json``. Draws come from one CPU generator seeded with ``seed`` (same seed,
    same bytes). Returns the directory.
    """
    return _write(path, tiny_deepseek_v3_config() if config is None else config, deepseek_v3_tensor_specs, seed, fp8,
                  num_shards, scale_fmt)


def write_qwen3_moe_checkpoint(path: str | os.PathLike, config: Mapping[str, Any] | None = None, *,
                               seed: int = 0, fp8: bool = True, num_shards: int = 2) -> Path:
    """Write a random Qwen3-MoE checkpoint for ``config`` (default ``tiny_qwen3_moe_config()``) to ``path``, in
    the block-FP8 format of ``write_deepseek_v3_checkpoint``."""
    return _write(path, tiny_qwen3_moe_config() if config is None else config, qwen3_moe_tensor_specs, seed, fp8,
                  num_shards, None)
