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
- the multi-token-prediction layer's own projection and head (DeepSeek-V3's ``model.layers.61.eh_proj`` and
  ``.shared_head.head``): DeepSeek ships both bf16, and vLLM's and SGLang's MTP modules load them into plain
  linears and an unquantized LM head, which refuse FP8 tensors (its attention and MoE are quantized as any layer's);
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
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

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
    (re.compile(r"(^|\.)shared_head\.head\."), "MTP head"),
    (re.compile(r"(^|\.)eh_proj\."), "MTP projection"),
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

def _read_json(path: Path, what: str) -> dict:
    """``path`` parsed as a JSON object; ``CheckpointError`` naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise CheckpointError(f"{path} is not valid JSON ({e}); {what}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object (got {type(data).__name__}); {what}")
    return data


def _shard_name(index: Path, value: object) -> str:
    """A shard name of the index as a normalized relative path inside the checkpoint folder."""
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"{index}: weight_map value {value!r} is not a file name")
    path = PurePosixPath(value)
    # the output shard is written under DST at the same relative path: it must stay inside DST
    if path.is_absolute() or ".." in path.parts:
        raise CheckpointError(f"{index} names shard {value!r}, outside the checkpoint folder")
    return path.as_posix()


def _shards(src: Path) -> tuple[list[str], bool]:
    """Shard file names in order (relative paths), and whether the source has an index."""
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "expected a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a safetensors index: its weight_map is not an object "
                                  f"(got {type(weight_map).__name__})")
        shards = list(dict.fromkeys(_shard_name(index, v) for v in weight_map.values()))
        if not shards:
            raise CheckpointError(f"{index} is not a safetensors index: its weight_map is empty")
        missing = [s for s in shards if not (src / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing[:5])}")
        return shards, True
    shards = sorted(p.name for p in src.glob("*.safetensors") if p.is_file())
    if not shards:
        raise CheckpointError(f"no *.safetensors in {src}; convert a .bin checkpoint to safetensors first "
                              f"(transformers: model.save_pretrained(dir, safe_serialization=True))")
    return shards, len(shards) > 1


def _check_dirs(src: Path, dst: Path, overwrite: bool) -> None:
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} has no config.json: SRC must be a Hugging Face model directory")
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r:
        raise CheckpointError("DST must differ from SRC (the source is read while the output is written)")
    # DST inside SRC would copy the output into itself; SRC inside DST would be deleted by --overwrite
    if dst_r.is_relative_to(src_r):
        raise CheckpointError(f"DST {dst} is inside SRC {src}; write the output somewhere else")
    if src_r.is_relative_to(dst_r):
        raise CheckpointError(f"SRC {src} is inside DST {dst}; write the output somewhere else")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} exists and is not a directory; remove it or choose another DST")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"{dst} exists and is not empty; remove it or pass --overwrite")


def _open_error(path: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable safetensors file ({e})")


def _scan_shards(src: Path, shards: list[str]) -> int:
    """Check every shard before anything is written; returns the tensor count.

    Reads the headers only: a corrupt or truncated file, a tensor in two shards, and a checkpoint that
    is already quantized (scale tensors, FP8 weights) are refused here rather than half way through.
    """
    from safetensors import safe_open

    seen: dict[str, str] = {}
    for shard in shards:
        path = src / shard
        try:
            with safe_open(path, framework="pt") as f:
                for name in list(f.keys()):
                    if name in seen:
                        raise CheckpointError(f"tensor {name} is in both {src / seen[name]} and {path}")
                    seen[name] = shard
                    if name.endswith(SCALE_SUFFIX) or name.endswith(".weight_scale"):
                        raise CheckpointError(f"{path} already has scale tensor {name}: the checkpoint is "
                                              f"quantized; moe-fp8 quantize takes a bf16 checkpoint")
                    dtype = f.get_slice(name).get_dtype()
                    if dtype.startswith("F8"):
                        torch_dtype = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(dtype, dtype)
                        raise CheckpointError(f"{name} in {path} is already torch.{torch_dtype}; moe-fp8 "
                                              f"quantize takes a bf16 checkpoint")
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (no public base) or OSError
            raise _open_error(path, e) from None
    return len(seen)


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


def _new_sibling(path: Path, tag: str) -> Path:
    """A new, empty folder next to ``path`` named ``<name>.<tag>-<pid>[-i]`` (same filesystem: renames
    from it are atomic)."""
    for i in range(1000):
        candidate = path.with_name(f"{path.name}.{tag}-{os.getpid()}" + (f"-{i}" if i else ""))
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise CheckpointError(f"cannot create a temporary folder next to {path}: too many {path.name}.{tag}-* exist")


def _publish(tmp: Path, dst: Path) -> None:
    """Move the finished output ``tmp`` to ``dst``; an existing ``dst`` (--overwrite) is removed only after."""
    old = None
    if dst.is_dir():
        if any(dst.iterdir()):
            old = _new_sibling(dst, "old")
            os.replace(dst, old)  # onto the new empty folder: a rename, nothing is copied
        else:
            dst.rmdir()
    try:
        os.replace(tmp, dst)
    except OSError:
        if old is not None:
            os.replace(old, dst)  # the previous output stays as it was
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def quantize_checkpoint(src: str | Path, dst: str | Path, skip: Iterable[str] = (), *,
                        device: torch.device | str = "cpu", overwrite: bool = False,
                        on_tensor: Callable[[TensorReport], None] | None = None,
                        on_total: Callable[[int], None] | None = None) -> QuantizeResult:
    """Convert the bf16 checkpoint in ``src`` into a block-FP8 one in ``dst`` (module docstring).

    ``skip``: regular expressions; a tensor whose name matches any stays as it is. ``device``: where
    the quantization math runs (``cuda`` is much faster for large models). ``on_total(n)`` is called
    once with the tensor count, ``on_tensor(report)`` after each tensor (progress). Raises
    ``CheckpointError`` for unusable input or output directories.

    Atomic: the output is written into a new folder next to ``dst`` (``<dst>.partial-<pid>``) and renamed
    to ``dst`` once complete, so a failure leaves ``dst`` as it was (absent, or with ``overwrite`` its old
    contents) and no file of an older output can survive an overwrite.
    """
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if dst.is_symlink():  # write where the link points, as writing into it did
        dst = dst.resolve()
    try:
        patterns = [re.compile(p) for p in skip]
    except re.error as e:
        raise CheckpointError(f"--skip pattern {e.pattern!r} is not a regular expression: {e}") from None
    _check_dirs(src, dst, overwrite)
    config = _read_json(src / "config.json", "SRC must be a Hugging Face model directory")
    qc = config.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else repr(qc)
        raise CheckpointError(f"{src} is already quantized (quantization_config.quant_method = {method}); "
                              f"moe-fp8 quantize takes a bf16 / fp16 / fp32 checkpoint")
    shards, write_index = _shards(src)
    total = _scan_shards(src, shards)
    if on_total is not None:
        on_total(total)

    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_sibling(dst, "partial")
    except OSError as e:
        raise CheckpointError(f"cannot create the output next to {dst}: {e.strerror or e}") from None
    try:
        result = _convert(src, tmp, config, shards, write_index, patterns, device, on_tensor)
        _publish(tmp, dst)
    except OSError as e:  # disk full, permissions: the user's to fix, the output is gone either way
        raise CheckpointError(f"cannot write {dst}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def _convert(src: Path, out_dir: Path, config: dict, shards: list[str], write_index: bool,
             patterns: list[re.Pattern[str]], device: torch.device | str,
             on_tensor: Callable[[TensorReport], None] | None) -> QuantizeResult:
    """Write the whole output into the empty folder ``out_dir`` (inputs checked by the caller)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    reports: list[TensorReport] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in shards:
        out: dict[str, torch.Tensor] = {}
        path = src / shard
        try:
            f = safe_open(path, framework="pt")
        except Exception as e:  # changed since it was scanned
            raise _open_error(path, e) from None
        with f:
            metadata = f.metadata() or {"format": "pt"}
            for name in list(f.keys()):
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise _open_error(path, e) from None
                quantize, reason = plan_tensor(name, t.dtype, t.shape, patterns)
                rep = TensorReport(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), quantize, reason,
                                   bytes_in=t.numel() * t.element_size(), shard=shard)
                if quantize:
                    w_fp8, w_scale, rep.diff = quantize_weight(t, device)
                    # an inf / NaN weight gives an inf / NaN block scale, which loaders refuse: stop here,
                    # naming the tensor, instead of writing a checkpoint that cannot be loaded
                    if not (math.isfinite(rep.diff) and bool(torch.isfinite(w_scale).all())):
                        raise CheckpointError(
                            f"{name} in {path} has values that are not finite (inf or NaN), which block FP8 "
                            f"cannot represent; fix the weight, or keep it as it is with --skip "
                            f"'{re.escape(name)}$'")
                    out[name], out[name + SCALE_SUFFIX] = w_fp8, w_scale
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
        (out_dir / shard).parent.mkdir(parents=True, exist_ok=True)  # an index may name shards in subfolders
        save_file(out, out_dir / shard, metadata=metadata)
        del out

    ignored = sorted({r.name.removesuffix(".weight") for r in reports if _is_linear_kept_by_choice(r)})
    qcfg = dict(QUANTIZATION_CONFIG)
    if ignored:
        qcfg["ignored_layers"] = ignored
    config = {**config, "quantization_config": qcfg}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if write_index:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    copied, not_copied = _copy_other_files(src, out_dir, shards)
    return QuantizeResult(reports, shards, copied, not_copied, 0.0, ignored)
