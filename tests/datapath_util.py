"""Shared by the data-path kernel tests (tests/test_datapath_*.py): device, interpreter probe, comparisons.

``DEVICE`` is ``cuda`` where a GPU is visible (compiled kernels) and ``cpu`` elsewhere, where
``tests/conftest.py`` has switched Triton's interpreter on. Tests without the ``gpu`` marker run on
both (keep them small: the interpreter runs a program in ~1 ms per small op); tests marked ``gpu``
use realistic sizes and run on the GPU machine only.
"""

from __future__ import annotations

import functools

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def interpreter_problem() -> str | None:
    """Why the kernels cannot run on CPU here (None when they can, or when a GPU runs them)."""
    if DEVICE == "cuda":
        return None
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # pragma: no cover - triton is in the test extra
        return f"triton is not importable ({exc})"
    from moe_fp8.kernels.triton.common import interpreting

    if not interpreting():
        return "TRITON_INTERPRET was not on when Triton kernels were imported"

    @triton.jit
    def probe(x_ptr, n):
        acc = tl.zeros([16], dtype=tl.float64)
        for _ in range(0, n):  # runtime-bounded loop: what old interpreters + numpy >= 2.4 break
            acc += tl.exp(tl.load(x_ptr + tl.arange(0, 16)).to(tl.float64))
        tl.store(x_ptr + tl.arange(0, 16), acc.to(tl.float32))

    try:
        probe[(1,)](torch.zeros(16), 2)
    except Exception as exc:
        return (f"Triton {triton.__version__}'s interpreter cannot run the kernels here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    return None


def require_kernels() -> None:
    """Skip the calling test (module-level: ``pytestmark``-like use) when the kernels cannot run."""
    why = interpreter_problem()
    if why:
        pytest.skip(why)


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality, except that any NaN equals any NaN (torch and the kernels may pick different
    NaN payloads). FP8 tensors are compared as raw bytes (their NaN is the single code 0x7F/0xFF)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = fp8_bytes(got), fp8_bytes(want)
        bad = got != want
    elif got.is_floating_point():
        g, w = got.float(), want.float()
        both_nan = torch.isnan(g) & torch.isnan(w)
        same = (g.view(torch.int32) == w.view(torch.int32)) if got.dtype == torch.float32 else (g == w) & (
            torch.signbit(g) == torch.signbit(w))
        bad = ~(same | both_nan)
    else:
        bad = got != want
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {idx}: "
                             f"got {got[bad][:5].tolist()}, want {want[bad][:5].tolist()}")
