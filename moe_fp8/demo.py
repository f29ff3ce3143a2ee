"""``moe-fp8 demo``: a small DeepSeek-V3 (or Kimi-K2, Qwen3-MoE, GLM-4.5, MiniMax-M2) end to end on moe_fp8's layers, checked against bf16.

1. write a random DeepSeek-V3 checkpoint in block FP8 (``layers.write_deepseek_v3_checkpoint`` of
   ``tiny_deepseek_v3_config``: MLA attention, 16 routed experts top-4 in grouped routing, a shared
   expert, the first layer dense) — the format of the published DeepSeek-V3 / R1 weights; with
   ``arch="qwen3_moe"`` a Qwen3-MoE one (``tiny_qwen3_moe_config``: grouped-query attention, 16 experts top-4
   with softmax routing, no shared expert), the format of Qwen's FP8 releases; with ``arch="kimi_k2"`` a Kimi-K2
   one (``tiny_kimi_k2_config``: DeepSeek-V3's modules under ``model_type = "kimi_k2"``, 384 experts top-8 in one
   group, YaRN), read as DeepSeek-V3; with ``arch="glm4_moe"`` a GLM-4.5 one (``tiny_glm4_moe_config``: DeepSeek-V3's
   MoE block under grouped-query attention with q / k / v biases); with ``arch="minimax_m2"`` a MiniMax-M2 one
   (``tiny_minimax_m2_config``: every layer MoE, sigmoid top-k with a correction bias, Mixtral's tensor names);
2. load it into transformers' ``DeepseekV3ForCausalLM`` (``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM``,
   ``MiniMaxM2ForCausalLM``) with its
   MoE blocks, MLPs and attention
   projections replaced by ours (``integrations.transformers.load_model``), and into the same model
   with plain transformers modules and the weights dequantized to bf16 (``load_reference_model``);
3. compare their logits on a prompt (``compare_logits``: DESIGN §6 ``calc_diff``, end to end and with the
   reference on the experts our layers chose, whose bound is the layer bound 2e-3);
4. generate greedily (one warm-up call first: on Hopper it JIT-compiles the kernels) and time it.

CPU runs the PyTorch reference ops (about half a minute on 2 cores with the defaults); a Hopper GPU runs the
JIT-compiled kernels and the Triton data path. ``run_demo`` returns everything as one JSON-able dict.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCHS", "DIFF_BOUND", "DemoError", "check_save_dir", "run_demo"]

# the model types of ``layers.MODEL_FAMILIES`` (Kimi-K2: DeepSeek-V3's modules, 384 experts in one group), named
FAMILY_NAMES = {"deepseek_v3": "DeepSeek-V3", "kimi_k2": "Kimi-K2", "qwen3_moe": "Qwen3-MoE", "glm4_moe": "GLM-4.5",
                "minimax_m2": "MiniMax-M2"}
ARCHS = tuple(FAMILY_NAMES)

DIFF_BOUND = 2e-3  # DESIGN §6: layer vs bf16 layer on dequantized weights
# The ops a forward of the model calls (GEMMs of every projection and expert, the MoE data path).
OPS = ("fp8_gemm", "fp8_grouped_gemm_contiguous", "fp8_grouped_gemm_masked", "per_token_group_quant",
       "silu_mul_per_token_group_quant", "select_experts", "dispatch_contiguous", "dispatch_masked",
       "quant_dispatch_masked", "combine")


class DemoError(RuntimeError):
    """The demo ran but its numbers are wrong (non-finite logits, error above the bound): a bug to report."""


def summarize_backends(backends: dict[str, str]) -> str:
    """``{op: backend}`` → ``'hopper'`` when one backend runs every op, else ``'hopper (fp8_gemm, ...); ...'``."""
    by_backend: dict[str, list[str]] = {}
    for op, name in backends.items():
        by_backend.setdefault(name, []).append(op)
    if len(by_backend) == 1:
        return f"{next(iter(by_backend))} for every op"
    return "; ".join(f"{name} ({', '.join(ops)})" for name, ops in by_backend.items())


def check_save_dir(save: str | Path) -> None:
    """``ValueError`` unless ``save`` is missing or an empty folder: the demo writes a whole checkpoint there
    and must not mix it with (or overwrite) files that are already in it."""
    path = Path(save)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; give a new or empty folder")
    if path.is_dir() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not empty; remove it or give a new or empty folder")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_demo(*, layers: int = 3, tokens: int = 16, batch: int = 2, prompt_len: int = 16,
             device: str | torch.device | None = None, seed: int = 0, save: Path | None = None,
             on_phase: Callable[[str], None] | None = None, arch: str = "deepseek_v3") -> dict[str, Any]:
    """Run the demo (see the module docstring) and return its report.

    Args:
        arch: ``"deepseek_v3"``, ``"kimi_k2"``, ``"qwen3_moe"``, ``"glm4_moe"`` or ``"minimax_m2"`` (``ARCHS``).
        layers: decoder layers (the first is dense when there are two or more, but for MiniMax-M2, whose layers
            are all MoE; the others MoE).
        tokens: new tokens to generate per sequence; batch: sequences; prompt_len: prompt tokens each.
        device: ``"cpu"`` / ``"cuda[:N]"`` (default: the current GPU if one is visible, else CPU).
        seed: weights and prompt. save: keep the checkpoint in this directory, which must be missing or
            empty (default: a temporary one).
        on_phase: called with the name of each phase as it starts (progress).

    Raises ``ValueError`` for bad sizes or a ``save`` folder that is a file or not empty, ``ImportError`` without transformers, ``DemoError`` when the model's
    logits are not finite or differ from the bf16 model's by more than ``DIFF_BOUND`` under the same routing.
    """
    from moe_fp8.backends import _normalize_device
    from moe_fp8.integrations.transformers import compare_logits, load_model, load_reference_model
    from moe_fp8.layers import (
        tiny_deepseek_v3_config,
        tiny_glm4_moe_config,
        tiny_kimi_k2_config,
        tiny_minimax_m2_config,
        tiny_qwen3_moe_config,
        write_checkpoint,
    )

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    for name, value in (("layers", layers), ("tokens", tokens), ("batch", batch), ("prompt_len", prompt_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if save is not None:
        check_save_dir(save)
    dev = _normalize_device(device)
    phase = on_phase or (lambda name: None)
    positions = max(256, prompt_len + tokens)
    if arch in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        tiny = {"deepseek_v3": tiny_deepseek_v3_config, "kimi_k2": tiny_kimi_k2_config,
                "glm4_moe": tiny_glm4_moe_config}[arch]
        config = tiny(num_hidden_layers=layers, first_k_dense_replace=1 if layers > 1 else 0,
                      max_position_embeddings=positions)
    elif arch == "minimax_m2":
        config = tiny_minimax_m2_config(num_hidden_layers=layers, max_position_embeddings=positions)
    else:
        config = tiny_qwen3_moe_config(num_hidden_layers=layers, mlp_only_layers=[0] if layers > 1 else [],
                                       max_position_embeddings=positions)
    report: dict[str, Any] = {"device": str(dev), "device_name": torch.cuda.get_device_name(dev)
                              if dev.type == "cuda" else "cpu", "seconds": {}}
    seconds = report["seconds"]

    with contextlib.ExitStack() as stack:
        if save is None:
            path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe_fp8_demo_")))
        else:
            path = Path(save)
        phase("write checkpoint")
        start = time.perf_counter()
        write_checkpoint(path, config, seed=seed)
        seconds["write_checkpoint"] = time.perf_counter() - start

        phase("load model")
        start = time.perf_counter()
        model = load_model(path, device=dev, dtype=torch.bfloat16)
        reference = load_reference_model(path, device=dev, dtype=torch.bfloat16)
        seconds["load"] = time.perf_counter() - start

    moe_blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    report["model"] = {
        "architecture": f"{type(model).__name__} (transformers), random block-FP8 weights", "arch": arch,
        "layers": layers, "moe_layers": len(moe_blocks), "hidden": config["hidden_size"],
        "routed_experts": config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts"),
        "top_k": config["num_experts_per_tok"], "shared_experts": config.get("n_shared_experts", 0),
        "vocab": config["vocab_size"],
        "checkpoint": None if save is None else str(path),
        "fp8_linears": len(model.moe_fp8_report.fp8_linears), "moe_blocks": len(model.moe_fp8_report.moe_layers),
    }
    import moe_fp8

    report["backends"] = {op: moe_fp8.backend(op, dev) for op in OPS}
    report["backend"] = summarize_backends(report["backends"])
    if moe_blocks:
        experts = moe_blocks[0].experts
        report["moe_path"] = {"prompt": experts.choose_path(batch * prompt_len), "decode": experts.choose_path(batch)}

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, config["vocab_size"], (batch, prompt_len), generator=gen)  # 0 / 1 are bos / eos

    phase("compare logits with the bf16 model")
    start = time.perf_counter()
    cmp = compare_logits(model, reference, prompt)
    seconds["compare"] = time.perf_counter() - start
    report["logits"] = {"diff_same_routing": cmp.diff_same_routing, "bound": DIFF_BOUND, "diff": cmp.diff,
                        "routing_choices": cmp.routing_choices, "routing_differs": cmp.routing_differs,
                        "router_disagrees": cmp.router_disagrees}
    del reference

    prompt = prompt.to(dev)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    phase("warm-up (JIT compile on Hopper)")
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kwargs)
    _sync(dev)
    seconds["warmup"] = time.perf_counter() - start

    phase(f"generate {tokens} tokens")
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
    _sync(dev)
    elapsed = time.perf_counter() - start
    seconds["generate"] = elapsed
    new = out[:, prompt_len:].cpu()
    report["generate"] = {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": int(new.shape[1]),
                          "tokens_per_s": batch * int(new.shape[1]) / elapsed,
                          "ms_per_step": 1e3 * elapsed / max(int(new.shape[1]), 1),
                          "sample": new[0].tolist()}

    if not all(math.isfinite(v) for v in (cmp.diff, cmp.diff_same_routing)):
        raise DemoError(f"the model's logits are not finite (calc_diff {cmp.diff}) on backend {report['backend']}")
    if cmp.router_disagrees:
        raise DemoError(f"transformers' router, given our hidden states, picks other experts than our layers for "
                        f"{cmp.router_disagrees} of {cmp.routing_choices} choices (backend {report['backend']})")
    if cmp.diff_same_routing > DIFF_BOUND:
        raise DemoError(f"logits differ from the bf16 model by calc_diff {cmp.diff_same_routing:.2e} with the same "
                        f"experts, above the bound {DIFF_BOUND:g} (backend {report['backend']})")
    return report


def format_report(r: dict[str, Any]) -> str:
    """The text ``moe-fp8 demo`` prints."""
    m, g, lg, s = r["model"], r["generate"], r["logits"], r["seconds"]
    dense = m["layers"] - m["moe_layers"]
    family = FAMILY_NAMES[m.get("arch", "deepseek_v3")]
    shared = f" + {m['shared_experts']} shared" if m["shared_experts"] else ""
    lines = [
        f"model     {family} architecture, random block-FP8 weights: {m['layers']} layers ({dense} dense, "
        f"{m['moe_layers']} MoE: {m['routed_experts']} experts top-{m['top_k']}{shared}), "
        f"hidden {m['hidden']}, vocab {m['vocab']}",
        f"          transformers {m['architecture'].split()[0]} with {m['fp8_linears']} Fp8Linear/Fp8MLP and "
        f"{m['moe_blocks']} Fp8FusedMoE blocks from moe_fp8" + (f"; checkpoint kept in {m['checkpoint']}"
                                                                  if m["checkpoint"] else ""),
        f"device    {r['device']}" + (f" ({r['device_name']})" if r["device_name"] != r["device"] else "")
        + f"; backend: {r['backend']}",
    ]
    if "moe_path" in r:
        lines.append(f"MoE path  {r['moe_path']['prompt']} for the prompt ({g['batch'] * g['prompt_tokens']} tokens), "
                     f"{r['moe_path']['decode']} for decode ({g['batch']} tokens per step)")
    lines += [
        f"logits    calc_diff vs the bf16 model on the dequantized weights: {lg['diff_same_routing']:.1e} with the "
        f"same experts (bound {lg['bound']:g}); {lg['diff']:.1e} end to end, where the bf16 model picks "
        f"another expert for {lg['routing_differs']} of {lg['routing_choices']} choices (near ties)",
        f"generate  {g['batch']} × {g['new_tokens']} tokens after {g['prompt_tokens']} prompt tokens in "
        f"{s['generate']:.2f} s: {g['tokens_per_s']:.1f} tokens/s ({g['ms_per_step']:.1f} ms per step); "
        f"warm-up {s['warmup']:.2f} s",
        f"tokens    {g['sample']}",
    ]
    return "\n".join(lines)
