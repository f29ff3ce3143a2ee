"""bf16 Hugging Face checkpoint → DeepSeek-style block-FP8 checkpoint (``moe-fp8 quantize``).

Every 2-D linear weight ``W [N, K]`` named ``*.weight`` becomes ``*.weight`` FP8 e4m3 plus
``*.weight_scale_inv`` FP32 ``[ceil(N/128), ceil(K/128)]`` (``moe_fp8.quant.per_block``: one scale per
128×128 block, ``real = fp8 · scale``, exactly the tensors DeepSeek-V3 ships and ``Fp8Linear`` /
``Fp8FusedMoE`` load). ``config.json`` gets
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``.

What stays as it is (bytes unchanged), and why:

- anything not named ``*.weight`` — biases, ``e_score_correction_bias``, buffers;
- tensors that are not 2-D — norms (1-D) and stacked 3-D expert tensors (their layout, ``[E, N, K]``
  or ``[E, K, N]``, differs between model families; DeepSeek-format checkpoints store experts 2-D);
- non-floating tensors;
- embeddings (``embed_tokens``, ``wte``, ``word_embeddings``) and ``lm_head``: a table lookup and the
  logits, both accuracy-sensitive and not GEMMs of the MoE path (DeepSeek keeps both bf16);
- MoE routers (``*.gate.weight``, ``shared_expert_gate``): tiny, and routing decisions flip on small
  errors (DeepSeek keeps ``mlp.gate`` bf16);
- anything with ``norm`` in its name;
- weights the kernels cannot run: N not a multiple of 8 or K not a multiple of 16. Other ragged
  shapes *are* quantized with partial edge blocks, as DeepSeek does for its 576-row
  ``kv_a_proj_with_mqa`` (an engine that shards such a weight over TP ranks needs the shard
  boundaries on multiples of 128);
- whatever matches a ``--skip`` regular expression (searched anywhere in the tensor name).

Linear weights kept in bf16 by ``--skip`` or the shape rule are listed in
``quantization_config.ignored_layers`` (module names), which vLLM's FP8 config reads to leave them
unquantized; the default-skipped kinds above are never FP8 layers there, so they are not listed.

Streaming: one shard at a time, one tensor at a time, and large weights in slabs of whole 128-row
blocks, so memory stays about one output shard plus one slab, whatever the model size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moe_fp8.utils import GROUP_K, ceil_div

__all__ = ["CheckpointError", "QuantizeResult", "TensorReport", "plan_tensor", "quantize_checkpoint",
           "quantize_weight"]

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [GROUP_K, GROUP_K]}
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
# The GEMM kernels' alignment rules (moe_fp8.validation): 16-byte bf16 output rows, 16-byte FP8 rows.
N_ALIGN = 8
K_ALIGN = 16
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Weights in formats this tool does not read: not copied (they would be bf16 duplicates of the model).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
SKIP_DIRS = (".git", ".cache", ".huggingface")
# Elements per quantization slab: 8 M elements keep the float64 error sums under ~70 MB each.
SLAB_ELEMS = 1 << 23

DEFAULT_SKIPS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)(embed_tokens|embeddings|wte|word_embeddings)\."), "embedding"),
    (re.compile(r"(^|\.)lm_head\."), "lm_head"),
    (re.compile(r"(^|\.)gate\.weight$"), "MoE router"),
    (re.compile(r"shared_expert_gate\."), "MoE shared-expert gate"),
    (re.compile(r"norm"), "norm"),
)


class CheckpointError(ValueError):
    """The source or destination cannot be converted (the message says why and what to do)."""


@dataclasses.dataclass
class TensorReport:
    """One source tensor: what was done and, for FP8 weights, the error of the dequantized copy."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    quantized: bool
    reason: str = ""  # why it was kept
    diff: float | None = None  # moe_fp8.calc_diff(dequantized, original)
    bytes_in: int = 0
    bytes_out: int = 0
    shard: str = ""


@dataclasses.dataclass
class QuantizeResult:
    tensors: list[TensorReport]
    shards: list[str]
    copied: list[str]
    not_copied: list[str]
    seconds: float
    ignored_layers: list[str]

    @property
    def quantized(self) -> list[TensorReport]:
        return [t for t in self.tensors if t.quantized]

    @property
    def kept(self) -> list[TensorReport]:
        return [t for t in self.tensors if not t.quantized]


# --------------------------------------------------------------------------------------------
# decisions
# --------------------------------------------------------------------------------------------

def plan_tensor(name: str, dtype: torch.dtype, shape: Iterable[int],
                skip: Iterable[re.Pattern[str]] = ()) -> tuple[bool, str]:
    """``(quantize?, reason it is kept)`` for one tensor (rules: module docstring, in that order)."""
    shape = tuple(shape)
    if not name.endswith(".weight"):
        return False, "not a weight"
    if dtype not in FLOAT_DTYPES:
        return False, f"dtype {str(dtype).removeprefix('torch.')}"
    if len(shape) != 2:
        return False, f"{len(shape)}-D"
    for pattern in skip:
        if pattern.search(name):
            return False, f"--skip {pattern.pattern}"
    for pattern, what in DEFAULT_SKIPS:
        if pattern.search(name):
            return False, what
    n, k = shape
    if n % N_ALIGN or k % K_ALIGN:
        return False, f"{n}×{k}: kernels need N % {N_ALIGN} == 0 and K % {K_ALIGN} == 0"
    return True, ""


def _is_linear_kept_by_choice(report: TensorReport) -> bool:
    """A 2-D weight kept bf16 by --skip or the shape rule (an engine would otherwise expect FP8)."""
    return (not report.quantized and report.name.endswith(".weight") and len(report.shape) == 2
            and (report.reason.startswith("--skip") or "kernels need" in report.reason))


# --------------------------------------------------------------------------------------------
# one weight
# --------------------------------------------------------------------------------------------

def quantize_weight(w: torch.Tensor, device: torch.device | str = "cpu",
                    slab_elems: int = SLAB_ELEMS) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(w_fp8, w_scale, diff)`` of a 2-D weight on the CPU, computed in slabs of 128-row blocks.

    ``diff`` is ``moe_fp8.calc_diff(dequantized, w)`` over the whole tensor: the slabs' float64 sums
    ``Σxy`` and ``Σ(x² + y²)`` are accumulated and combined with calc_diff's formula (DESIGN §6), so the
    value is the same as calling it on the full tensors, without holding them in float64.
    """
    from moe_fp8.quant import dequant_per_block, per_block

    n, k = w.shape
    rows = max(GROUP_K, slab_elems // max(k, 1) // GROUP_K * GROUP_K)
    w_fp8 = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    w_scale = torch.empty((ceil_div(n, GROUP_K), ceil_div(k, GROUP_K)), dtype=torch.float32)
    sum_xy = torch.zeros((), dtype=torch.float64)
    sum_sq = torch.zeros((), dtype=torch.float64)
    for r0 in range(0, n, rows):
        part = w[r0:r0 + rows].to(device).contiguous()
        q, s = per_block(part)
        x, y = part.double(), dequant_per_block(q, s).double()
        sum_xy += (x * y).sum().cpu()
        sum_sq += (x * x + y * y).sum().cpu()
        w_fp8[r0:r0 + rows] = q.cpu()
        w_scale[r0 // GROUP_K:r0 // GROUP_K + s.shape[0]] = s.cpu()
    diff = 0.0 if sum_sq == 0 else float(1 - 2 * sum_xy / sum_sq)
    return w_fp8, w_scale, diff


# --------------------------------------------------------------------------------------------
# the checkpoint
# --------------------------------------------------------------------------------------------

def _shards(src: Path) -> tuple[list[str], bool]:
    """Shard file names in order, and whether the source has an index."""
    index = src / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (src / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing[:5])}")
        return shards, True
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no *.safetensors in {src}; convert a .bin checkpoint to safetensors first "
                              f"(transformers: model.save_pretrained(dir, safe_serialization=True))")
    return shards, len(shards) > 1


def _check_dirs(src: Path, dst: Path, overwrite: bool) -> None:
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} has no config.json: SRC must be a Hugging Face model directory")
    if dst.resolve() == src.resolve():
        raise CheckpointError("DST must differ from SRC (the source is read while the output is written)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"{dst} exists and is not empty; remove it or pass --overwrite")
    try:
        dst.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {dst}: {e.strerror or e}") from None


def _copy_other_files(src: Path, dst: Path, shards: list[str]) -> tuple[list[str], list[str]]:
    """Copy tokenizer files, generation config, code, ...; returns (copied, not copied) relative paths."""
    copied, skipped = [], []
    ours = {*shards, INDEX_FILE, "config.json"}
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        rel_root = Path(root).relative_to(src)
        for fn in sorted(files):
            rel = (rel_root / fn).as_posix()
            if rel in ours:
                continue
            if fn.endswith((".safetensors", *OTHER_WEIGHT_SUFFIXES)) or fn.endswith(".bin.index.json"):
                skipped.append(rel)
                continue
            (dst / rel_root).mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(root) / fn, dst / rel)
            copied.append(rel)
    return copied, skipped


def _count_tensors(src: Path, shards: list[str]) -> int:
    from safetensors import safe_open

    total = 0
    for shard in shards:
        with safe_open(src / shard, framework="pt") as f:
            total += len(list(f.keys()))
    return total


def quantize_checkpoint(src: str | Path, dst: str | Path, skip: Iterable[str] = (), *,
                        device: torch.device | str = "cpu", overwrite: bool = False,
                        on_tensor: Callable[[TensorReport], None] | None = None,
                        on_total: Callable[[int], None] | None = None) -> QuantizeResult:
    """Convert the bf16 checkpoint in ``src`` into a block-FP8 one in ``dst`` (module docstring).

    ``skip``: regular expressions; a tensor whose name matches any stays as it is. ``device``: where
    the quantization math runs (``cuda`` is much faster for large models). ``on_total(n)`` is called
    once with the tensor count, ``on_tensor(report)`` after each tensor (progress). Raises
    ``CheckpointError`` for unusable input or output directories.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    try:
        patterns = [re.compile(p) for p in skip]
    except re.error as e:
        raise CheckpointError(f"--skip pattern {e.pattern!r} is not a regular expression: {e}") from None
    _check_dirs(src, dst, overwrite)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{src} is already quantized (quantization_config.quant_method = {method}); "
                              f"moe-fp8 quantize takes a bf16 / fp16 / fp32 checkpoint")
    shards, write_index = _shards(src)
    if on_total is not None:
        on_total(_count_tensors(src, shards))

    reports: list[TensorReport] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        with safe_open(src / shard, framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            names = list(f.keys())
            for name in names:
                if name.endswith(SCALE_SUFFIX) or name.endswith(".weight_scale"):
                    raise CheckpointError(f"{src / shard} already has scale tensor {name}: the checkpoint is "
                                          f"quantized; moe-fp8 quantize takes a bf16 checkpoint")
                t = f.get_tensor(name)
                if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise CheckpointError(f"{name} in {src / shard} is already {t.dtype}; moe-fp8 quantize "
                                          f"takes a bf16 checkpoint")
                quantize, reason = plan_tensor(name, t.dtype, t.shape, patterns)
                rep = TensorReport(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), quantize, reason,
                                   bytes_in=t.numel() * t.element_size(), shard=shard)
                if quantize:
                    scale_name = name + SCALE_SUFFIX
                    if scale_name in names:
                        raise CheckpointError(f"{src / shard} has both {name} and {scale_name}")
                    w_fp8, w_scale, rep.diff = quantize_weight(t, device)
                    out[name], out[scale_name] = w_fp8, w_scale
                    rep.bytes_out = w_fp8.numel() + w_scale.numel() * 4
                else:
                    out[name] = t
                    rep.bytes_out = rep.bytes_in
                del t
                reports.append(rep)
                if on_tensor is not None:
                    on_tensor(rep)
        for key, value in out.items():
            weight_map[key] = shard
            total_size += value.numel() * value.element_size()
        save_file(out, dst / shard, metadata=metadata)
        del out

    ignored = sorted({r.name.removesuffix(".weight") for r in reports if _is_linear_kept_by_choice(r)})
    qcfg = dict(QUANTIZATION_CONFIG)
    if ignored:
        qcfg["ignored_layers"] = ignored
    config["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if write_index:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    copied, not_copied = _copy_other_files(src, dst, shards)
    return QuantizeResult(reports, shards, copied, not_copied, time.perf_counter() - t0, ignored)
