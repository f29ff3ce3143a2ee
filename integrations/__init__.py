"""Serving-engine integrations (installed as ``moe_fp8.integrations``): ``vllm``, ``sglang``, ``transformers``.

What the engine integrations share: the minimum compute capability and the platform check below, and the
message for a checkpoint without a config. They read a checkpoint's ``quantization_config`` with
``moe_fp8.layers.quant_config``, as the checkpoint loaders do.
"""

from __future__ import annotations

import torch

# Both engines compare this with the GPU's compute capability (major · 10 + minor) at start-up. The GEMMs,
# most of a layer's time, have Hopper (sm_90a) kernels only; below sm_90 they would run on the PyTorch
# reference, so such GPUs are better served by the engine's own fp8 method.
MIN_CAPABILITY = 90


def check_platform(engine: str) -> None:
    """Raise ``ValueError`` unless torch runs on CUDA (or on the CPU alone, where the engines' tests drive the
    integrations on moe_fp8's reference backend).

    moe_fp8's kernels are CUDA's. A ROCm build reports capabilities (9.4 for MI300) that pass
    ``MIN_CAPABILITY``, and the engines' model code differs off CUDA: SGLang's DeepSeek model, for one,
    applies ``routed_scaling_factor`` itself on some platforms and expects the MoE method to on others.
    """
    hip = getattr(torch.version, "hip", None)
    if hip:
        found = f"a ROCm build of torch (HIP {hip})"
    elif torch.cuda.is_available():
        return
    else:
        others = [name for name in _OTHER_ACCELERATORS if _available(getattr(torch, name, None))]
        if not others:
            return
        found = f"torch on {others[0]} devices"
    raise ValueError(f"--quantization moe_fp8 runs on NVIDIA GPUs (CUDA); this {engine} runs {found}. Serve "
                     f"this checkpoint with {engine}'s own fp8 method")


# torch's device modules of other accelerators (`torch.xpu`; `torch.npu`, `torch.musa` when their plugins
# are installed).
_OTHER_ACCELERATORS = ("xpu", "npu", "musa", "mlu")


def _available(module: object) -> bool:
    try:
        return bool(module is not None and module.is_available())  # type: ignore[attr-defined]
    except Exception:  # a device module that cannot even report: not usable either
        return False


def no_quantization_config_message(engine: str) -> str:
    """Why ``--quantization moe_fp8`` refuses a checkpoint without a ``quantization_config`` (both engines then
    build the method's config with no arguments)."""
    return (f"--quantization moe_fp8: the checkpoint's config.json has no quantization_config, so {engine} would "
            "build moe_fp8's config with defaults; moe_fp8 serves block-FP8 checkpoints (DeepSeek-V3 format: "
            "quant_method 'fp8', weight_block_size [128, 128]). Quantize this checkpoint first "
            "(`moe-fp8 quantize`) or serve it without --quantization moe_fp8")
