"""Backend selection: CPU → reference, forcing, strict mode, fallbacks logged once, lazy imports.

A Hopper machine is simulated on CPU by patching ``torch.cuda`` queries and the JIT compiler probe,
so every selection rule is tested without a GPU.
"""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import moe_fp8
from moe_fp8 import backends
from moe_fp8.backends import ENV_BACKEND, ENV_STRICT, BackendError
from moe_fp8.testing import make_gemm_inputs

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


@dataclass
class FakeCompiler:
    name: str
    version: str
    available: bool
    reason: str = ""


@pytest.fixture(autouse=True)
def clean_backends(monkeypatch):
    saved = {op: dict(impls) for op, impls in backends._impls.items()}
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_STRICT, raising=False)
    backends.clear_cache()
    backends._resolve_errors.clear()
    yield
    backends._impls.clear()
    backends._impls.update(saved)
    backends.clear_cache()
    backends._resolve_errors.clear()


def fake_cuda(monkeypatch, capability=(9, 0), compilers=None):
    """Pretend cuda:0 exists with ``capability`` and the JIT probe finds ``compilers``."""
    if compilers is None:
        compilers = [FakeCompiler("nvcc", "12.8", False, "nvcc not found"), FakeCompiler("nvrtc", "12.8", True)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    fake = types.ModuleType("moe_fp8.kernels.jit.compiler")
    fake.find_compilers = lambda: list(compilers)
    monkeypatch.setitem(sys.modules, "moe_fp8.kernels.jit.compiler", fake)
    backends.clear_cache()


def spy(calls: list, tag: str):
    def fn(*args):
        calls.append(tag)
        args[-1].zero_()  # destination-passing: write out
    return fn


# --------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------

def test_cpu_uses_reference_for_every_op(caplog):
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        for op in backends.known_ops():
            assert moe_fp8.backend(op, "cpu") == "reference"
    assert not caplog.records  # the only backend for CPU: not a fallback


def test_known_ops_cover_the_public_ops():
    assert set(backends.known_ops()) == {
        "fp8_gemm", "fp8_grouped_gemm_contiguous", "fp8_grouped_gemm_masked", "per_token_group_quant",
        "per_block_quant", "silu_mul_per_token_group_quant", "select_experts", "dispatch_contiguous",
        "dispatch_masked", "quant_dispatch_contiguous", "quant_dispatch_masked", "combine",
        "fp8_grouped_gemm_silu_mul_quant", "router_gemm"}
    for op in backends.known_ops():
        assert "reference" in backends.implementations(op)
    assert backends.implementations("fp8_gemm") == ("hopper", "reference")
    # fused on Hopper; elsewhere the grouped GEMM and SiLU·mul + quant ops in turn, each on its backend
    assert backends.implementations("fp8_grouped_gemm_silu_mul_quant") == ("hopper", "portable", "reference")


def test_available_backends_on_cpu():
    av = backends.available_backends("cpu")
    assert list(av) == ["hopper", "portable", "reference"]
    assert av["reference"][0] is True
    assert av["portable"] == (False, "needs a CUDA device, got cpu")
    assert av["hopper"][0] is False and "CUDA" in av["hopper"][1]


def test_intended_backend_runs(monkeypatch):
    calls = []
    backends.register("fp8_gemm", "reference", spy(calls, "ref"))
    g = make_gemm_inputs(8, 16, 128)
    out = moe_fp8.fp8_gemm(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale)
    assert calls == ["ref"] and not out.any()
    torch.ops.moe_fp8.fp8_gemm(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale, out)  # the dispatcher path too
    assert calls == ["ref", "ref"]
    # M = 0 never reaches a backend.
    moe_fp8.fp8_gemm(g.x_fp8[:0], g.x_scale[:0], g.w_fp8, g.w_scale)
    assert calls == ["ref", "ref"]


# --------------------------------------------------------------------------------------------
# MOE_FP8_BACKEND
# --------------------------------------------------------------------------------------------

def test_force_reference(monkeypatch, caplog):
    fake_cuda(monkeypatch)
    backends.register("fp8_gemm", "hopper", spy([], "hopper"))
    assert moe_fp8.backend("fp8_gemm", CUDA0) == "hopper"
    monkeypatch.setenv(ENV_BACKEND, "reference")
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        assert moe_fp8.backend("fp8_gemm", CUDA0) == "reference"  # env read on every call
        assert moe_fp8.backend("per_token_group_quant", CUDA0) == "reference"
    assert not caplog.records  # forced: not a fallback
    monkeypatch.setenv(ENV_BACKEND, "auto")
    assert moe_fp8.backend("fp8_gemm", CUDA0) == "hopper"


def test_force_hopper_on_cpu_raises(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "hopper")
    with pytest.raises(BackendError, match=r"MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run fp8_gemm "
                                           r"on cpu: needs a CUDA device, got cpu"):
        moe_fp8.backend("fp8_gemm", "cpu")
    g = make_gemm_inputs(8, 16, 128)
    with pytest.raises(BackendError, match=r"MOE_FP8_BACKEND=hopper"):
        moe_fp8.fp8_gemm(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale)
    monkeypatch.delenv(ENV_BACKEND)
    assert moe_fp8.fp8_gemm(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale).shape == (8, 16)


def test_force_hopper_without_kernel_raises(monkeypatch):
    fake_cuda(monkeypatch)
    monkeypatch.setenv(ENV_BACKEND, "hopper")
    with pytest.raises(BackendError, match=r"cannot run per_block_quant on cuda:0: "
                                           r"no hopper implementation of per_block_quant"):
        moe_fp8.backend("per_block_quant", CUDA0)


def test_force_portable_raises(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "portable")
    with pytest.raises(BackendError, match=r"backend 'portable' cannot run combine on cpu: needs a CUDA device, got cpu"):
        moe_fp8.backend("combine", "cpu")


def test_force_unknown_backend_raises(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "cutlass")
    with pytest.raises(ValueError, match=r"MOE_FP8_BACKEND must be one of \('hopper', 'portable', 'reference', "
                                         r"'auto'\), got 'cutlass'"):
        moe_fp8.backend("fp8_gemm", "cpu")


# --------------------------------------------------------------------------------------------
# Fallbacks and MOE_FP8_STRICT
# --------------------------------------------------------------------------------------------

def test_fallback_logged_once(monkeypatch, caplog):
    fake_cuda(monkeypatch, capability=(8, 9))  # an Ada GPU: portable applies but has no GEMM kernel
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        assert backends.select("fp8_gemm", CUDA0)[0] == "reference"
        monkeypatch.setenv(ENV_STRICT, "0")  # new cache key: selection runs again, but logs no more
        assert backends.select("fp8_gemm", CUDA0)[0] == "reference"
        assert backends.select("fp8_gemm", CUDA0)[0] == "reference"
    records = [r for r in caplog.records if r.name == "moe_fp8"]
    assert len(records) == 1
    msg = records[0].getMessage()
    assert "fp8_gemm on cuda:0 falls back to backend 'reference'" in msg
    assert "portable: no portable implementation of fp8_gemm" in msg


def test_strict_turns_fallback_into_error(monkeypatch):
    fake_cuda(monkeypatch, capability=(8, 9))
    monkeypatch.setenv(ENV_STRICT, "1")
    with pytest.raises(BackendError, match=r"MOE_FP8_STRICT=1: fp8_gemm on cuda:0 would fall back to backend "
                                           r"'reference' \(portable: no portable implementation of fp8_gemm\)"):
        backends.select("fp8_gemm", CUDA0)
    # CPU has no fallback: reference is the backend for CPU tensors.
    assert moe_fp8.backend("fp8_gemm", "cpu") == "reference"
    # Forcing is explicit, so it is allowed under strict mode.
    monkeypatch.setenv(ENV_BACKEND, "reference")
    assert backends.select("fp8_gemm", CUDA0)[0] == "reference"


def test_hopper_selected_on_sm90(monkeypatch, caplog):
    fake_cuda(monkeypatch)
    calls = []
    backends.register("fp8_gemm", "hopper", spy(calls, "hopper"))
    name, fn = backends.select("fp8_gemm", CUDA0)
    assert name == "hopper"
    fn(torch.empty(1))
    assert calls == ["hopper"]
    assert backends.available_backends(0)["hopper"] == (True, "sm_90a via nvrtc 12.8")
    # An op without a Hopper kernel falls back, with both reasons, once; strict refuses.
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        assert moe_fp8.backend("per_block_quant", CUDA0) == "reference"
    (rec,) = caplog.records
    assert "hopper: no hopper implementation of per_block_quant" in rec.getMessage()
    monkeypatch.setenv(ENV_STRICT, "1")
    with pytest.raises(BackendError, match="would fall back"):
        moe_fp8.backend("per_block_quant", CUDA0)
    assert moe_fp8.backend("fp8_gemm", CUDA0) == "hopper"


def test_non_hopper_gpu_is_not_a_hopper_fallback(monkeypatch, caplog):
    fake_cuda(monkeypatch, capability=(8, 9))
    backends.register("fp8_gemm", "hopper", spy([], "hopper"))
    rows = dict((n, (ok, why)) for n, ok, why in backends.explain("fp8_gemm", CUDA0))
    assert rows["hopper"] == (False, "needs compute capability (9, 0) (sm_90a); Fake GPU has (8, 9)")
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        assert moe_fp8.backend("fp8_gemm", CUDA0) == "reference"
    (rec,) = caplog.records  # only the missing portable backend is a fallback on an Ada GPU
    assert "hopper" not in rec.getMessage() and "portable: no portable implementation of fp8_gemm" in rec.getMessage()


def test_no_compiler_is_a_fallback(monkeypatch):
    fake_cuda(monkeypatch, compilers=[FakeCompiler("nvcc", "", False, "not on PATH"),
                                      FakeCompiler("nvrtc", "", False, "libnvrtc not found")])
    backends.register("fp8_gemm", "hopper", spy([], "hopper"))
    ok, why = backends.available_backends(CUDA0)["hopper"]
    assert not ok and why == "no JIT compiler found (nvcc: not on PATH; nvrtc: libnvrtc not found)"
    monkeypatch.setenv(ENV_STRICT, "true")
    with pytest.raises(BackendError, match=r"hopper: no JIT compiler found"):
        backends.select("fp8_gemm", CUDA0)


def test_compiler_probe_failure_is_reported(monkeypatch):
    fake_cuda(monkeypatch)

    def broken():
        raise OSError("cannot load libnvrtc.so.12")
    sys.modules["moe_fp8.kernels.jit.compiler"].find_compilers = broken
    ok, why = backends.available_backends(CUDA0)["hopper"]
    assert not ok and why == "JIT compiler probe failed (OSError: cannot load libnvrtc.so.12)"


def test_lazy_import_failure_is_a_reason(monkeypatch, caplog):
    fake_cuda(monkeypatch)
    backends.register("fp8_gemm", "hopper", "moe_fp8.no_such_module:fp8_gemm_hopper")
    rows = {n: (ok, why) for n, ok, why in backends.explain("fp8_gemm", CUDA0)}
    assert rows["hopper"][0] is False
    assert rows["hopper"][1].startswith("moe_fp8.no_such_module.fp8_gemm_hopper is not importable "
                                        "(ModuleNotFoundError")
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        assert backends.select("fp8_gemm", CUDA0)[0] == "reference"
    assert "not importable" in caplog.records[0].getMessage()


def test_lazy_import_success(monkeypatch):
    fake_cuda(monkeypatch)
    mod = types.ModuleType("fake_kernels")
    mod.gemm = spy([], "lazy")
    monkeypatch.setitem(sys.modules, "fake_kernels", mod)
    backends.register("fp8_gemm", "hopper", "fake_kernels:gemm")
    assert backends.select("fp8_gemm", CUDA0) == ("hopper", mod.gemm)


# --------------------------------------------------------------------------------------------
# Registry errors
# --------------------------------------------------------------------------------------------

def test_register_and_select_errors():
    with pytest.raises(ValueError, match=r"backend must be one of \('hopper', 'portable', 'reference'\), got 'cuda'"):
        backends.register("fp8_gemm", "cuda", lambda *a: None)
    with pytest.raises(TypeError, match=r"fn must be a callable or a 'module:attr' string, got 'no_colon'"):
        backends.register("fp8_gemm", "hopper", "no_colon")
    with pytest.raises(ValueError, match=r"unknown op 'fp9_gemm'; known ops: combine, "):
        moe_fp8.backend("fp9_gemm", "cpu")


def test_missing_compiler_falls_back_once_unless_forced(monkeypatch, caplog):
    """Unset MOE_FP8_BACKEND: no JIT compiler on a Hopper GPU → reference, one warning naming the cause.
    MOE_FP8_BACKEND=hopper: the same machine is an error, never a silent fallback."""
    fake_cuda(monkeypatch, compilers=[FakeCompiler("nvcc", "", False, "not on PATH"),
                                      FakeCompiler("nvrtc", "", False, "libnvrtc not found")])
    backends.register("fp8_gemm", "hopper", spy([], "hopper"))
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        for _ in range(3):
            assert backends.select("fp8_gemm", CUDA0)[0] == "reference"
    (rec,) = [r for r in caplog.records if r.name == "moe_fp8"]
    assert "falls back to backend 'reference'" in rec.getMessage()
    assert "hopper: no JIT compiler found (nvcc: not on PATH; nvrtc: libnvrtc not found)" in rec.getMessage()
    monkeypatch.setenv(ENV_BACKEND, "hopper")
    with pytest.raises(BackendError, match=r"MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run fp8_gemm "
                                           r"on cuda:0: no JIT compiler found"):
        backends.select("fp8_gemm", CUDA0)


def test_missing_compiler_is_one_warning_for_all_ops(monkeypatch, caplog):
    """A Hopper GPU without a JIT compiler: every op falls back (GEMMs to reference, the data path to Triton),
    and the user reads one warning naming the cause, not one per op."""
    fake_cuda(monkeypatch, compilers=[FakeCompiler("nvcc", "", False, "not on PATH"),
                                      FakeCompiler("nvrtc", "", False, "libnvrtc not found")])
    with caplog.at_level(logging.WARNING, logger="moe_fp8"):
        chosen = {op: backends.select(op, CUDA0)[0] for op in backends.known_ops()}
    assert chosen["fp8_gemm"] == chosen["fp8_grouped_gemm_masked"] == "reference"
    assert chosen["per_token_group_quant"] == chosen["combine"] == "portable"
    (rec,) = [r for r in caplog.records if r.name == "moe_fp8"]
    msg = rec.getMessage()
    assert "hopper: no JIT compiler found (nvcc: not on PATH; nvrtc: libnvrtc not found)" in msg
    assert "every other op that hopper would run falls back too, without another warning" in msg
    assert "MOE_FP8_STRICT=1 makes it an error" in msg
    # forced: an error naming the cause, for a GEMM and for a data-path op alike
    monkeypatch.setenv(ENV_BACKEND, "hopper")
    for op in ("fp8_gemm", "per_token_group_quant"):
        with pytest.raises(BackendError, match=rf"MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run {op} "
                                               r"on cuda:0: no JIT compiler found"):
            backends.select(op, CUDA0)


@pytest.mark.parametrize("text,on", [("1", True), (" On ", True), ("TRUE", True), ("yes", True), ("0", False),
                                     ("", False), (None, False), ("off", False), ("2", False)])
def test_environment_switches_read_on_and_off(text, on):
    """MOE_FP8_STRICT, MOE_FP8_PDL and TRITON_INTERPRET share one reading of on / off."""
    from moe_fp8.utils import truthy

    assert truthy(text) is on


def test_env_reads_what_os_environ_holds(monkeypatch):
    """``utils.env`` (the launch paths' switch reader) follows setenv / delenv at once, as os.environ.get does."""
    from moe_fp8.utils import env

    monkeypatch.delenv("MOE_FP8_TEST_SWITCH", raising=False)
    assert env("MOE_FP8_TEST_SWITCH") is None
    monkeypatch.setenv("MOE_FP8_TEST_SWITCH", "on")
    assert env("MOE_FP8_TEST_SWITCH") == "on"
    monkeypatch.setenv("MOE_FP8_TEST_SWITCH", "é 0")
    assert env("MOE_FP8_TEST_SWITCH") == "é 0"
    monkeypatch.delenv("MOE_FP8_TEST_SWITCH")
    assert env("MOE_FP8_TEST_SWITCH") is None
