"""Shared pytest fixtures and skip rules.

GPU tests are marked ``gpu`` (any CUDA device) or ``hopper`` (sm_90) and skipped, with the reason,
where no such device is visible; on the GPU machine they run by default. Without a GPU, Triton's
interpreter is switched on (see below) so the data-path kernel tests run on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

# The Triton data-path kernels (moe_fp8.kernels.triton) run on CPU tensors in Triton's interpreter,
# which must be switched on before those modules are imported (Triton decides at decoration time).
# Only where no GPU is visible: on a GPU machine the same tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests see the cost model's picks, never a table `moe-fp8 tune` left on this machine (tests/test_tuning.py
# switches tables on where it tests them).
os.environ["MOE_FP8_TUNED_CONFIGS"] = "off"


def has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU visible")
    skip_hopper = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "hopper" in item.keywords and not has_hopper():
            item.add_marker(skip_hopper)
        elif "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
