"""Errors a user can act on end `moe-fp8` with one message and exit status 1; bugs keep their traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_fp8 import cli
from moe_fp8.backends import BackendError
from moe_fp8.kernels.jit import CompilerNotFoundError, CudaUnavailableError, JitCacheError, JitCompileError


def _failing(monkeypatch, exc: BaseException) -> None:
    def run(args):
        raise exc
    monkeypatch.setitem(cli.COMMANDS, "info", cli.Command("x", cli._add_info_args, run))


@pytest.mark.parametrize("exc,expected", [
    (JitCompileError("nvcc 13.0 failed to compile kernel 'k'; source and full log saved in /c/failed/k-1\n"
                     "kernel.cu(3): error: identifier \"x\" is undefined\n(60 lines of log)",
                     log="$ nvcc ...\nkernel.cu(3): error: identifier \"x\" is undefined\n1 error detected\n",
                     path=Path("/c/failed/k-1")),
     ["nvcc 13.0 failed to compile kernel 'k'; source and full log saved in /c/failed/k-1",
      "  kernel.cu(3): error: identifier \"x\" is undefined", "  source and full log: /c/failed/k-1",
      "  please report it with the output of `moe-fp8 info`"]),
    (CompilerNotFoundError("no CUDA compiler usable: a; b"),
     ["no CUDA compiler usable: a; b", "  fix: pip install nvidia-cuda-nvrtc (no CUDA toolkit needed), or install "
      "the CUDA toolkit and set CUDA_HOME; `moe-fp8 info` lists what was found"]),
    (CudaUnavailableError("no CUDA driver/GPU"),
     ["no CUDA driver/GPU: this needs an NVIDIA GPU and driver; `moe-fp8 info` shows what is visible"]),
    (JitCacheError("JIT cache directory /x is not writable (...); set MOE_FP8_CACHE_DIR to a writable directory"),
     ["JIT cache directory /x is not writable (...); set MOE_FP8_CACHE_DIR to a writable directory"]),
    (BackendError("MOE_FP8_STRICT=1: fp8_gemm on cuda:0 would fall back"),
     ["MOE_FP8_STRICT=1: fp8_gemm on cuda:0 would fall back",
      "  fix: unset MOE_FP8_BACKEND / MOE_FP8_STRICT, or see `moe-fp8 info` for why a backend is missing"]),
])
def test_user_errors_are_one_message(exc, expected, monkeypatch, capsys):
    _failing(monkeypatch, exc)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"moe-fp8 info: error: {expected[0]}", *expected[1:]]


def test_bugs_keep_their_traceback(monkeypatch):
    _failing(monkeypatch, ZeroDivisionError("a bug"))
    with pytest.raises(ZeroDivisionError):
        cli.main(["info"])
    _failing(monkeypatch, ValueError("also a bug"))  # a plain ValueError is not a user error
    with pytest.raises(ValueError):
        cli.main(["info"])


def test_interrupt_exits_130(monkeypatch, capsys):
    _failing(monkeypatch, KeyboardInterrupt())
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "moe-fp8 info: interrupted\n"


def test_build_into_unwritable_cache_raises_jit_cache_error(tmp_path, monkeypatch):
    from moe_fp8.kernels.jit import build, find_compilers

    if not any(c.available for c in find_compilers()):
        pytest.skip("no JIT compiler")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(blocker / "cache"))  # root ignores chmod; a file does not
    with pytest.raises(JitCacheError, match=r"is not writable .* set MOE_FP8_CACHE_DIR to a writable directory"):
        build("cache_probe", 'extern "C" __global__ void k() {}\n')


def test_forced_backend_that_cannot_run_is_one_message(monkeypatch, capsys):
    """MOE_FP8_BACKEND=hopper on a machine where it cannot run: the command fails with the cause and the fix
    (unset, the same machine falls back with one warning instead: test_backends.py)."""
    from moe_fp8 import backends

    monkeypatch.setenv("MOE_FP8_BACKEND", "hopper")
    backends.clear_cache()
    assert cli.main(["demo", "--device", "cpu", "--layers", "1", "--tokens", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "moe-fp8 demo: error: MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run per_block_quant on cpu: "
        "needs a CUDA device, got cpu",
        "  fix: unset MOE_FP8_BACKEND / MOE_FP8_STRICT, or see `moe-fp8 info` for why a backend is missing"]
