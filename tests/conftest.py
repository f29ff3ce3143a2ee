"""Shared pytest fixtures and skip rules.

GPU tests are marked ``gpu`` (any CUDA device) or ``hopper`` (sm_90) and skipped, with the reason,
where no such device is visible; on the GPU machine they run by default.
"""

from __future__ import annotations

import pytest
import torch


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
