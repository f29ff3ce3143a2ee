"""JIT runtime: compilers, disk cache, symbol lookup, argument packing, TMA validation, SASS helper.

Everything except the ``gpu``-marked tests runs without a GPU or CUDA driver (compiling needs nvcc or
the NVRTC wheel; a compiler that is not installed is skipped with its reason).  The GPU tests reuse the
self-checking kernels of ``scripts/jit_smoke.py``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8.kernels import sass
from moe_fp8.kernels.jit import (
    NO_GPU_REASON,
    Arg,
    CudaUnavailableError,
    JitCompileError,
    JitKernel,
    build,
    cache_info,
    cache_key,
    clear_memory_cache,
    cubin_entry_functions,
    driver_available,
    find_compilers,
    get_compiler,
    parse_ptxas_report,
)
from moe_fp8.kernels.jit import cache as cache_mod
from moe_fp8.kernels.jit import compiler as compiler_mod
from moe_fp8.kernels.jit import runtime as runtime_mod
from moe_fp8.kernels.jit import tma as tma_mod

ROOT = Path(__file__).resolve().parent.parent
COMPILERS = {c.name: c for c in find_compilers()}
# the quicker one for tests that only need *a* compiler
FAST_COMPILER = "nvrtc" if COMPILERS["nvrtc"].available else "nvcc"


def _need(name: str) -> None:
    info = COMPILERS[name]
    if not info.available:
        pytest.skip(f"{name} not installed: {info.reason}")


@pytest.fixture(params=["nvcc", "nvrtc"])
def compiler(request: pytest.FixtureRequest) -> str:
    _need(request.param)
    return request.param


@pytest.fixture
def fast_compiler() -> str:
    _need(FAST_COMPILER)
    return FAST_COMPILER


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache and header tree per test (the package's tree may be edited while tests run);
    the in-process memo is cleared around each test."""
    d = tmp_path / "cache"
    (tmp_path / "include").mkdir()
    monkeypatch.setattr(cache_mod, "include_dir", lambda: tmp_path / "include")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(d))
    monkeypatch.delenv("MOE_FP8_JIT_COMPILER", raising=False)
    monkeypatch.delenv("MOE_FP8_JIT_DEBUG", raising=False)
    clear_memory_cache()
    yield d
    clear_memory_cache()


def _journal_lines(d: Path, key: str | None = None) -> list[str]:
    p = d / cache_mod.JOURNAL_FILE
    lines = p.read_text().splitlines() if p.exists() else []
    return [ln for ln in lines if key is None or f"key={key}" in ln]


# sm_90a-only instructions: setmaxnreg, wgmma (fence + an FP8 e4m3 MMA → SASS QGMMA)
SM90A_SRC = textwrap.dedent(r"""
    #include <cstdint>
    extern "C" __global__ void __launch_bounds__(128, 1) qgmma_probe(const uint64_t* __restrict__ descs,
                                                                      float* __restrict__ out) {
      float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
      const uint64_t desc_a = descs[0], desc_b = descs[1];
      asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
                   : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "l"(desc_a), "l"(desc_b), "r"(1));
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      float* o = out + threadIdx.x * 4;
      o[0] = d0; o[1] = d1; o[2] = d2; o[3] = d3;
    }
""")

SIMPLE_SRC = textwrap.dedent(r"""
    #include <cstdint>
    extern "C" __global__ void simple(float* x, uint32_t n) {
      const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
      if (i < n) x[i] += 1.0f;
    }
""")


# ---------------------------------------------------------------- compilers


def test_find_compilers_reports_both_with_reasons() -> None:
    infos = find_compilers()
    assert [i.name for i in infos] == ["nvcc", "nvrtc"]
    for i in infos:
        if i.available:
            assert i.version and i.path and not i.reason
        else:
            assert i.reason and not i.version


def test_nvrtc_probe_is_kept_until_what_it_depends_on_changes(cache_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm process takes NVRTC's version from the memo (no libnvrtc load); a changed library file, search
    environment or a damaged memo probes again."""
    probes = []
    lib = tmp_path / "libnvrtc.so.13"
    lib.write_bytes(b"x" * 10)

    def probe() -> compiler_mod.CompilerInfo:
        probes.append(1)
        return compiler_mod.CompilerInfo("nvrtc", f"13.0 (lib size {lib.stat().st_size})", str(lib), True, "")

    monkeypatch.setattr(compiler_mod, "_probe_nvrtc", probe)
    first = compiler_mod._nvrtc_info()
    assert (cache_dir / compiler_mod.NVRTC_MEMO_FILE).is_file() and len(probes) == 1
    assert compiler_mod._nvrtc_info() == first and len(probes) == 1  # from the memo
    lib.write_bytes(b"x" * 12)  # another build of the library at the same path
    assert compiler_mod._nvrtc_info().version == "13.0 (lib size 12)" and len(probes) == 2
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # another search path
    compiler_mod._nvrtc_info()
    assert len(probes) == 3
    (cache_dir / compiler_mod.NVRTC_MEMO_FILE).write_text("{not json")
    assert compiler_mod._nvrtc_info().version == "13.0 (lib size 12)" and len(probes) == 4
    lib.unlink()  # the library is gone: never trusted from the memo
    with pytest.raises(FileNotFoundError):
        compiler_mod._nvrtc_info()
    # an unavailable NVRTC is kept too (its reason), and an unwritable cache only costs the probe
    monkeypatch.setattr(compiler_mod, "_probe_nvrtc", lambda: (probes.append(1), compiler_mod.CompilerInfo(
        "nvrtc", "", "", False, "libnvrtc not loadable: test"))[1])
    (cache_dir / compiler_mod.NVRTC_MEMO_FILE).unlink()
    assert compiler_mod._nvrtc_info().reason == "libnvrtc not loadable: test" and len(probes) == 6
    assert compiler_mod._nvrtc_info().reason == "libnvrtc not loadable: test" and len(probes) == 6
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(lib / "not-a-dir"))
    assert not compiler_mod._nvrtc_info().available and len(probes) == 7

    def broken_metadata() -> list:
        raise RuntimeError("metadata unreadable (test)")

    monkeypatch.setattr(compiler_mod, "_nvrtc_memo_signature", broken_metadata)
    assert not compiler_mod._nvrtc_info().available and len(probes) == 8  # probed; the memo is not in the way


def test_get_compiler_default_prefers_nvcc_and_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler_mod, "_instances", {})
    default = get_compiler()
    assert default.name == ("nvcc" if COMPILERS["nvcc"].available else "nvrtc")
    if COMPILERS["nvrtc"].available:
        monkeypatch.setenv("MOE_FP8_JIT_COMPILER", "nvrtc")
        assert get_compiler().name == "nvrtc"
    monkeypatch.setenv("MOE_FP8_JIT_COMPILER", "clang")
    with pytest.raises(ValueError, match="unknown JIT compiler 'clang'"):
        get_compiler()


def test_requested_compiler_missing_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler_mod, "_instances", {})
    monkeypatch.setattr(compiler_mod, "_find_nvcc", lambda: (None, "nvcc not found (test)"))
    monkeypatch.setenv("MOE_FP8_JIT_COMPILER", "nvcc")
    with pytest.raises(RuntimeError, match="nvcc not found \\(test\\)"):
        get_compiler()
    monkeypatch.delenv("MOE_FP8_JIT_COMPILER")
    if COMPILERS["nvrtc"].available:
        assert get_compiler().name == "nvrtc"  # default order: nvcc, else NVRTC


def test_compiles_sm90a_cubin(compiler: str) -> None:
    k = build("sm90a_probe", SM90A_SRC, compiler=compiler)
    data = k.cubin_path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert cubin_entry_functions(data) == ["qgmma_probe"]
    assert k.symbol == "qgmma_probe"
    assert k.meta["compiler"] == compiler
    assert k.ptxas["registers"] > 0 and k.ptxas["spill_stores"] == 0


def test_fp8_wgmma_becomes_qgmma_in_sass(compiler: str) -> None:
    if sass.cuobjdump_path() is None and sass.nvdisasm_path() is None:
        pytest.skip("neither cuobjdump nor nvdisasm installed")
    k = build("sm90a_probe", SM90A_SRC, compiler=compiler)
    text = sass.dump_sass(k.cubin_path)
    assert "sm_90a" in text
    assert sass.count_instructions(text, "QGMMA") == 1
    assert sass.count_instructions(text, "QGMMA.64x8x32.F32.E4M3.E4M3") == 1
    assert sass.count_instructions(text, "USETMAXREG") == 1
    assert sass.count_instructions(text, "WARPGROUP.ARRIVE") >= 1
    assert sass.count_instructions(text, "LDL") == 0 and sass.count_instructions(text, "STL") == 0


def test_compile_error_raises_with_saved_source_and_log(compiler: str, cache_dir: Path) -> None:
    src = 'extern "C" __global__ void broken(float* x) { x[0] = this_is_not_declared; }\n'
    with pytest.raises(JitCompileError) as ei:
        build("broken", src, compiler=compiler)
    e = ei.value
    assert e.path is not None and e.path.is_dir()
    assert e.path.parent == cache_dir / "failed"
    assert str(e.path) in str(e)
    assert (e.path / "kernel.cu").read_text() == src
    log = (e.path / "compile.log").read_text()
    assert "this_is_not_declared" in log and log == e.log
    assert "this_is_not_declared" in str(e)
    assert cache_info()["entries"] == 0  # nothing half-built was published


def test_nvrtc_shims_agree_with_cccl_and_both_compilers_build_it(compiler: str) -> None:
    """<cstdint>/<cstddef> work under NVRTC (shims) and nvcc alike, with the same types as <cuda/std/...>."""
    src = textwrap.dedent(r"""
        #include <cstdint>
        #include <cstddef>
        #include <cuda_bf16.h>
        #include <cuda/std/cstdint>
        #include <cuda/std/type_traits>
        static_assert(sizeof(int64_t) == 8 && sizeof(uint32_t) == 4 && sizeof(size_t) == 8, "sizes");
        static_assert(cuda::std::is_same<std::uint64_t, uint64_t>::value, "std:: aliases");
        static_assert(cuda::std::is_same<cuda::std::int64_t, int64_t>::value, "CCCL agrees");
        static_assert(UINT32_MAX == 4294967295u && INT64_MIN < 0, "limits");
        template <typename T>
        __global__ void typed(T* out, int64_t a, uint64_t b, size_t c, std::int32_t d) { out[0] = T(a + b + c + d); }
        template __global__ void typed<__nv_bfloat16>(__nv_bfloat16*, int64_t, uint64_t, size_t, std::int32_t);
    """)
    k = build("typed", src, compiler=compiler)
    assert k.symbol.startswith("_Z5typedI13__nv_bfloat16EvPT_")
    assert build("typed", src, compiler=compiler, kernel_name="typed").symbol == k.symbol


def test_nvrtc_without_ptxas_options_still_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    _need("nvrtc")
    flags = tuple(f.replace("--ptxas-options=", "--ptxas-options-unknown=") for f in compiler_mod.NVRTC_FLAGS)
    monkeypatch.setattr(compiler_mod, "NVRTC_FLAGS", flags)
    k = build("noptxas", SIMPLE_SRC, compiler="nvrtc")
    assert k.symbol == "simple" and k.ptxas == {}
    log = (k.cubin_path.parent / "compile.log").read_text()
    assert "no ptxas register/spill report" in log


def test_kernel_name_resolution(fast_compiler: str) -> None:
    src = SIMPLE_SRC + textwrap.dedent(r"""
        template <int N> __global__ void tmpl(float* x) { x[0] = N; }
        template __global__ void tmpl<3>(float*);
    """)
    with pytest.raises(ValueError, match="2 kernel entries"):
        build("two", src, compiler=fast_compiler)
    assert build("two", src, compiler=fast_compiler, kernel_name="simple").symbol == "simple"
    mangled = build("two", src, compiler=fast_compiler, kernel_name="tmpl").symbol
    assert mangled.startswith("_Z4tmplILi3EEvPf")
    assert build("two", src, compiler=fast_compiler, kernel_name=mangled).symbol == mangled
    with pytest.raises(ValueError, match="matches 0"):
        build("two", src, compiler=fast_compiler, kernel_name="nope")


def test_bad_kernel_names_rejected() -> None:
    for bad in ("", "a/b", "../x", ".hidden", "sp ace", "x" * 101):
        with pytest.raises(ValueError, match="kernel name"):
            build(bad, SIMPLE_SRC)


def test_debug_prints_compile_summary(fast_compiler: str, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOE_FP8_JIT_DEBUG", "1")
    build("dbg", SIMPLE_SRC, compiler=fast_compiler)
    err = capsys.readouterr().err
    assert f"compiled dbg with {fast_compiler}" in err
    assert "simple:" in err and "regs" in err and "spill" in err
    assert "extern" not in err  # the source itself only at level 2
    monkeypatch.setenv("MOE_FP8_JIT_DEBUG", "2")
    build("dbg2", SIMPLE_SRC, compiler=fast_compiler)
    assert 'extern "C" __global__ void simple' in capsys.readouterr().err


def test_parse_ptxas_report_both_formats() -> None:
    nvcc_log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Compiling entry function '_Z4gemmILi128EEvPf' for 'sm_90a'
        ptxas info    : Function properties for _Z4gemmILi128EEvPf
            8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 168 registers, used 1 barriers, 16 bytes smem, 920 bytes cmem[0]
        """)
    nvrtc_log = textwrap.dedent("""\
        ptxas info    : Compiling entry function 'k' for 'sm_90a'
        ptxas info    : Function properties for k
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 10 registers, used 0 barriers
        """)
    assert parse_ptxas_report(nvcc_log) == {"_Z4gemmILi128EEvPf": {
        "stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 168, "smem": 16}}
    assert parse_ptxas_report(nvrtc_log) == {"k": {"stack": 0, "spill_stores": 0, "spill_loads": 0,
                                                   "registers": 10}}


# ---------------------------------------------------------------- cache


def test_cache_key_changes_with_every_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            fast_compiler: str) -> None:
    inc = tmp_path / "include"
    (inc / "moe_fp8").mkdir(parents=True)
    header = inc / "moe_fp8" / "common.cuh"
    header.write_text("#pragma once\nconstexpr int kA = 1;\n")
    monkeypatch.setattr(cache_mod, "include_dir", lambda: inc)
    base = cache_key("k", SIMPLE_SRC, compiler=fast_compiler)
    assert base == cache_key("k", SIMPLE_SRC, compiler=fast_compiler)  # deterministic
    assert len(base) == 64
    keys = {
        "name": cache_key("k2", SIMPLE_SRC, compiler=fast_compiler),
        "source": cache_key("k", SIMPLE_SRC + "\n// v2\n", compiler=fast_compiler),
        "flags": cache_key("k", SIMPLE_SRC, compiler=fast_compiler, flags=["-DFOO=1"]),
        "flag value": cache_key("k", SIMPLE_SRC, compiler=fast_compiler, flags=["-DFOO=2"]),
    }
    header.write_text("#pragma once\nconstexpr int kA = 2;\n")  # same size: content hash, not metadata
    keys["header content"] = cache_key("k", SIMPLE_SRC, compiler=fast_compiler)
    (inc / "moe_fp8" / "extra.cuh").write_text("#pragma once\n")
    keys["new header"] = cache_key("k", SIMPLE_SRC, compiler=fast_compiler)
    (inc / "moe_fp8" / "extra.cuh").rename(inc / "moe_fp8" / "renamed.cuh")
    keys["renamed header"] = cache_key("k", SIMPLE_SRC, compiler=fast_compiler)
    if COMPILERS["nvcc"].available and COMPILERS["nvrtc"].available:
        other = "nvcc" if fast_compiler == "nvrtc" else "nvrtc"
        keys["compiler"] = cache_key("k", SIMPLE_SRC, compiler=other)
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys), keys


def test_nvcc_key_covers_the_environment_flags_nvcc_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    _need("nvcc")
    # nvcc adds NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS (and NVCC_CCBIN) to every compile: a cubin built under them
    # must not be served to a process without them
    for var in compiler_mod.NVCC_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    base = cache_key("k", SIMPLE_SRC, compiler="nvcc")
    keys = set()
    for var in compiler_mod.NVCC_ENV_VARS:
        monkeypatch.setenv(var, "-DPOISON")
        keys.add(cache_key("k", SIMPLE_SRC, compiler="nvcc"))
        monkeypatch.delenv(var)
    assert base not in keys and len(keys) == len(compiler_mod.NVCC_ENV_VARS)
    assert cache_key("k", SIMPLE_SRC, compiler="nvcc") == base


def test_nvcc_timeout_is_a_compile_error_with_a_text_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _need("nvcc")
    monkeypatch.setattr(compiler_mod, "COMPILE_TIMEOUT_S", 0.01)
    with pytest.raises(JitCompileError, match=r"timed out after 0\.01 s") as ei:
        get_compiler("nvcc").compile(SIMPLE_SRC, "k", [], tmp_path)
    assert "b'" not in ei.value.log


def test_nvrtc_bad_option_is_not_blamed_on_ptxas_options(tmp_path: Path) -> None:
    _need("nvrtc")
    # the log's command line always names --ptxas-options: only the compiler's own message may trigger the retry
    with pytest.raises(JitCompileError) as ei:
        get_compiler("nvrtc").compile(SIMPLE_SRC, "k", [], tmp_path, extra_flags=["--no-such-option"])
    assert "no-such-option" in str(ei.value) and "rejects --ptxas-options" not in ei.value.log


def test_journal_failure_does_not_fail_a_published_build(cache_dir: Path, fast_compiler: str) -> None:
    (cache_dir / cache_mod.JOURNAL_FILE).mkdir(parents=True)  # a journal that cannot be opened for appending
    k = build("journal_k", SIMPLE_SRC, compiler=fast_compiler)
    assert k.cubin_path.is_file() and k.cubin_path.parent.parent == cache_dir  # published, no error


def test_include_dir_is_the_package_header_tree() -> None:
    from moe_fp8.kernels.jit import include_dir

    assert include_dir() == ROOT / "moe_fp8" / "kernels" / "include"
    assert include_dir().is_dir()


def test_include_tree_headers_are_used_and_invalidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      fast_compiler: str, cache_dir: Path) -> None:
    inc = tmp_path / "include"
    (inc / "moe_fp8").mkdir(parents=True)
    (inc / "moe_fp8" / "consts.cuh").write_text("#pragma once\nconstexpr unsigned kBlock = 64;\n")
    monkeypatch.setattr(cache_mod, "include_dir", lambda: inc)
    src = '#include <moe_fp8/consts.cuh>\nextern "C" __global__ void k(unsigned* x) { x[0] = kBlock; }\n'
    k1 = build("inc", src, compiler=fast_compiler)
    (inc / "moe_fp8" / "consts.cuh").write_text("#pragma once\nconstexpr unsigned kBlock = 128;\n")
    clear_memory_cache()
    k2 = build("inc", src, compiler=fast_compiler)
    assert k1.cubin_path != k2.cubin_path
    assert k1.meta["cubin_sha256"] != k2.meta["cubin_sha256"]
    assert len(_journal_lines(cache_dir)) == 2


def test_cache_layout_meta_and_hits(fast_compiler: str, cache_dir: Path) -> None:
    k = build("layout", SIMPLE_SRC, compiler=fast_compiler)
    key = cache_key("layout", SIMPLE_SRC, compiler=fast_compiler)
    entry = cache_dir / f"layout-{key[:16]}"
    assert k.cubin_path == entry / "kernel.cubin"
    assert sorted(p.name for p in entry.iterdir()) == ["compile.log", "kernel.cu", "kernel.cubin", "meta.json"]
    meta = json.loads((entry / "meta.json").read_text())
    data = (entry / "kernel.cubin").read_bytes()
    assert meta["key"] == key and meta["cubin_size"] == len(data)
    assert meta["cubin_sha256"] == __import__("hashlib").sha256(data).hexdigest()
    assert meta["ptxas"]["simple"]["registers"] > 0
    assert (entry / "kernel.cu").read_text() == SIMPLE_SRC
    assert build("layout", SIMPLE_SRC, compiler=fast_compiler) is k  # in-process memo
    clear_memory_cache()
    k2 = build("layout", SIMPLE_SRC, compiler=fast_compiler)  # disk hit
    assert k2 is not k and k2.meta == k.meta
    assert len(_journal_lines(cache_dir, key)) == 1
    info = cache_info()
    assert info["dir"] == str(cache_dir) and info["entries"] == 1 and info["bytes"] >= len(data)
    assert not list(cache_dir.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "delete_meta", "garbage_meta", "delete_cubin"])
def test_corrupt_entry_is_detected_and_rebuilt(damage: str, fast_compiler: str, cache_dir: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    k = build("corrupt", SIMPLE_SRC, compiler=fast_compiler)
    good = k.cubin_path.read_bytes()
    entry = k.cubin_path.parent
    if damage == "truncate":
        k.cubin_path.write_bytes(good[: len(good) // 2])
    elif damage == "flip_byte":
        k.cubin_path.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "delete_meta":
        (entry / "meta.json").unlink()
    elif damage == "garbage_meta":
        (entry / "meta.json").write_text("{not json")
    else:
        k.cubin_path.unlink()
    clear_memory_cache()
    with caplog.at_level(logging.WARNING, logger="moe_fp8.jit"):
        k2 = build("corrupt", SIMPLE_SRC, compiler=fast_compiler)
    assert "corrupt or incomplete" in caplog.text and str(entry) in caplog.text
    assert k2.cubin_path.read_bytes() == k2._cubin and len(k2._cubin) == k2.meta["cubin_size"]
    assert k2.symbol == "simple"
    assert len(_journal_lines(cache_dir)) == 2  # built, then rebuilt
    assert not list(cache_dir.glob(".trash-*")) and not list(cache_dir.glob(".tmp-*"))


_CHILD = textwrap.dedent(r"""
    import json, sys, time
    from pathlib import Path
    from moe_fp8.kernels.jit import build, cache
    ready, go, compiler, src = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]).read_text()
    cache.include_dir = lambda: Path(sys.argv[5])
    ready.touch()
    deadline = time.time() + 120
    while not go.exists() and time.time() < deadline:
        time.sleep(0.002)
    k = build("concurrent", src, compiler=compiler)
    print(json.dumps({"symbol": k.symbol, "sha": k.meta["cubin_sha256"], "pid": k.meta["pid"]}))
""")


def test_processes_compiling_the_same_variant_compile_once(compiler: str, tmp_path: Path,
                                                           cache_dir: Path) -> None:
    src_file = tmp_path / "src.cu"
    src_file.write_text(SM90A_SRC)
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs, readies = [], []
    for i in range(2):
        ready = tmp_path / f"ready{i}"
        readies.append(ready)
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, str(ready), str(go), compiler, str(src_file),
                                       str(cache_mod.include_dir())],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    deadline = time.time() + 180
    while not all(r.exists() for r in readies):  # both imported and waiting: start together
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    res = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert res[0]["symbol"] == res[1]["symbol"] == "qgmma_probe"
    assert res[0]["sha"] == res[1]["sha"]
    assert res[0]["pid"] == res[1]["pid"]  # both got the one process's build
    key = cache_key("concurrent", SM90A_SRC, compiler=compiler)
    assert len(_journal_lines(cache_dir, key)) == 1


# ---------------------------------------------------------------- runtime (no driver needed)


def test_cubin_parser_rejects_non_elf_and_truncation(fast_compiler: str) -> None:
    data = build("simple", SIMPLE_SRC, compiler=fast_compiler).cubin_path.read_bytes()
    with pytest.raises(ValueError, match="not a 64-bit"):
        cubin_entry_functions(b"not an elf file at all" * 4)
    with pytest.raises(ValueError, match="truncated"):
        cubin_entry_functions(data[:200])


def test_without_driver_launch_raises_clear_error(fast_compiler: str) -> None:
    ok, why = driver_available()
    if ok:
        pytest.skip("a CUDA driver is present")
    assert why.startswith(NO_GPU_REASON)
    k = build("simple", SIMPLE_SRC, compiler=fast_compiler)  # compiling needs no driver
    with pytest.raises(CudaUnavailableError, match=NO_GPU_REASON):
        k.launch(1, 32, [None, 1])


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that claims to be on CUDA device 0, to exercise pointer packing without a GPU."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return 0


class _FakeCuda1Tensor(_FakeCudaTensor):
    def get_device(self) -> int:  # type: ignore[override]
        return 1


def _kernel_with_layout(layout: tuple[tuple[int, int], ...]) -> JitKernel:
    runtime_mod._bind_types()
    k = JitKernel("fake", Path("/nonexistent.cubin"), "fake")
    k._layout = layout
    k._params_size = max(o + s for o, s in layout)
    return k


def _packed(k: JitKernel) -> bytes:
    return bytes(k._tls.state[0])


# (TmaDescriptor, float* a, float* b, uint32_t n, int32_t m, float alpha, bool flag, uint64_t big)
LAYOUT = ((0, 128), (128, 8), (136, 8), (144, 4), (148, 4), (152, 4), (156, 1), (160, 8))


def _desc(fill: int) -> tma_mod.TmaDesc:
    return tma_mod.TmaDesc(bytes([fill]) * 128, data_ptr=0, dtype=torch.uint8, dims=(16,), strides_bytes=(1,),
                           box=(16,), swizzle="none")


def test_generic_and_specialized_packers_agree() -> None:
    k = _kernel_with_layout(LAYOUT)
    a = torch.zeros(4).as_subclass(_FakeCudaTensor)
    b = torch.zeros(8).as_subclass(_FakeCudaTensor)
    args = [_desc(7), a, b, 0xFFFFFFFF, -5, 0.25, True, 1 << 63]
    k._pack(args, 0)
    got = _packed(k)
    assert got[:128] == bytes([7]) * 128
    assert struct.unpack_from("<QQIif?", got, 128) == (a.data_ptr(), b.data_ptr(), 0xFFFFFFFF, -5, 0.25, True)
    assert struct.unpack_from("<Q", got, 160)[0] == 1 << 63
    assert k._fast is not None
    args2 = [_desc(9), b, a, 3, 4, -1.5, False, 12]
    buf, base = k._tls.state[0], k._tls.state[1]
    assert k._fast(args2, buf, base, 0) is True
    fast_bytes = _packed(k)
    k._pack_generic(args2, 0)
    assert _packed(k) == fast_bytes
    # a type the specialization did not see falls back (returns False), never packs wrongly
    assert k._fast([_desc(1), None, a, 1, 2, 3.0, True, 4], buf, base, 0) is False
    assert k._fast(args2[:-1], buf, base, 0) is False
    assert k._fast([*args2[:3], 1 << 32, *args2[4:]], buf, base, 0) is False


@settings(max_examples=60, deadline=None)
@given(n=st.integers(-(1 << 31), (1 << 32) - 1), m=st.integers(-(1 << 31), (1 << 32) - 1),
       big=st.integers(-(1 << 63), (1 << 64) - 1), alpha=st.floats(width=32, allow_nan=False))
def test_packers_agree_on_random_scalars(n: int, m: int, big: int, alpha: float) -> None:
    k = _kernel_with_layout(LAYOUT)
    a = torch.zeros(4).as_subclass(_FakeCudaTensor)
    args = [_desc(3), a, None, n, m, alpha, False, big]
    k._pack_generic(args, 0)
    generic = _packed(k)
    fast = runtime_mod._compile_packer(LAYOUT, args)
    assert fast(args, k._tls.state[0], k._tls.state[1], 0) is True
    assert _packed(k) == generic
    assert struct.unpack_from("<I", generic, 144)[0] == n & 0xFFFFFFFF
    assert struct.unpack_from("<Q", generic, 160)[0] == big & (2**64 - 1)


def test_primary_context_is_retained_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads without a current context (and launches retried after an invalid one) make the device's primary
    context current: retained once per device for the process, not once per call (a driver stub counts)."""
    class Driver:
        def __init__(self) -> None:
            self.current, self.retains = 0, []

        def cuCtxGetCurrent(self):
            return (0, self.current)

        def cuDeviceGet(self, dev: int):
            return (0, 100 + dev)

        def cuCtxGetDevice(self):
            return (0, self.current // 10)

        def cuDevicePrimaryCtxRetain(self, cu_dev: int):
            self.retains.append(cu_dev)
            return (0, cu_dev * 10)

        def cuCtxSetCurrent(self, ctx: int):
            self.current = ctx
            return (0,)

    drv = Driver()
    monkeypatch.setattr(runtime_mod, "_driver", lambda: drv)
    monkeypatch.setattr(runtime_mod, "_PRIMARY", {})
    for dev in (0, 0, 1, 0, 1):
        drv.current = 0  # a fresh thread
        assert runtime_mod._ensure_context(dev) is True
        assert drv.current == (100 + dev) * 10
        assert runtime_mod._ensure_context(dev) is False  # current already
        assert runtime_mod._ensure_context(dev, force=True) is False  # (a retry) the same primary context
    assert drv.retains == [100, 101]


def test_pack_rejects_bad_arguments() -> None:
    k = _kernel_with_layout(((0, 8), (8, 4), (12, 4)))
    a = torch.zeros(4).as_subclass(_FakeCudaTensor)
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        k._pack([a, 1], 0)
    with pytest.raises(TypeError, match="not a CUDA device"):
        k._pack([torch.zeros(4), 1, 2], 0)
    with pytest.raises(OverflowError, match="does not fit"):
        k._pack([a, 1 << 32, 2], 0)
    with pytest.raises(OverflowError, match="does not fit"):
        k._pack([a, -(1 << 31) - 1, 2], 0)
    with pytest.raises(TypeError, match="8 bytes, the kernel parameter is 4"):
        k._pack([a, Arg(1, "u64"), 2], 0)
    with pytest.raises(TypeError, match="tensor passed for a 4-byte"):
        k._pack([a, a, 2], 0)
    with pytest.raises(TypeError, match="TMA descriptor passed for a 4-byte"):
        k._pack([a, _desc(0), 2], 0)
    with pytest.raises(TypeError, match="unsupported type str"):
        k._pack([a, "x", 2], 0)
    with pytest.raises(ValueError, match="unknown argument type"):
        Arg(1, "u128")
    k._pack([None, (7, "i32"), Arg(2.5, "f32")], 0)
    assert struct.unpack_from("<Qif", _packed(k), 0) == (0, 7, 2.5)
    k._pack([Arg(a, "ptr"), Arg(-1, "i32"), (1, "u32")], 0)
    assert struct.unpack_from("<QiI", _packed(k), 0) == (a.data_ptr(), -1, 1)
    # an explicit C type is packed in its own range, not wrapped into it
    for bad in (Arg(1 << 31, "i32"), Arg(-1, "u32"), Arg(1.5, "i32")):
        with pytest.raises(TypeError, match=rf"argument 1: Arg\({bad.value!r}, '{bad.ctype}'\) cannot be packed"):
            k._pack([a, bad, 2], 0)
    with pytest.raises(TypeError, match="argument 0: ptr tensor is on cpu"):
        k._pack([Arg(torch.zeros(4), "ptr"), 1, 2], 0)
    # another GPU's tensor: refused by both packers (its pointer is meaningless in this launch's context)
    other = torch.zeros(4).as_subclass(_FakeCuda1Tensor)
    for args in ([other, 1, 2], [Arg(other, "ptr"), 1, 2]):
        with pytest.raises(TypeError, match=r"argument 0: .*tensor is on cuda:1, but the launch is on cuda:0"):
            k._pack(args, 0)
    k._pack([other, 1, 2], 1)  # launched on device 1: fine, and specializes the fast packer
    assert k._fast([other, 1, 2], k._tls.state[0], k._tls.state[1], 1) is True
    assert k._fast([a, 1, 2], k._tls.state[0], k._tls.state[1], 1) is False
    # a float past float32's range raises with its index on both paths (the generic one packed inf)
    kf = _kernel_with_layout(((0, 4), (4, 4)))
    kf._pack([0.5, 1.0], 0)  # specializes the fast packer to (float, float)
    buf, base = kf._tls.state[0], kf._tls.state[1]
    assert kf._fast([float("inf"), float("-inf")], buf, base, 0) is True
    assert struct.unpack_from("<ff", _packed(kf), 0) == (float("inf"), float("-inf"))
    assert kf._fast([1e40, 1.0], buf, base, 0) is False
    with pytest.raises(OverflowError, match="argument 0: float 1e\\+40 does not fit"):
        kf._pack([1e40, 1.0], 0)
    # an int for a TMA descriptor parameter
    kt = _kernel_with_layout(((0, 128), (128, 4)))
    with pytest.raises(TypeError, match="argument 0: int passed for a 128-byte parameter"):
        kt._pack([1, 2], 0)


# ---------------------------------------------------------------- TMA (validation runs on CPU)


def _validate(**kw: object) -> tuple[int, ...]:
    args: dict[str, object] = dict(data_ptr=0x1000, elem_bytes=1, dims=(512, 256), strides_elems=(1, 512),
                                   box=(128, 64), swizzle="128B")
    args.update(kw)
    return tma_mod.validate_tma(**args)  # type: ignore[arg-type]


def test_tma_validation_accepts_and_returns_byte_strides() -> None:
    assert _validate() == (1, 512)
    assert _validate(elem_bytes=2, box=(64, 64), strides_elems=(1, 512)) == (2, 1024)
    assert _validate(elem_bytes=4, swizzle="none", box=(256, 256)) == (4, 2048)


@pytest.mark.parametrize("kw, match", [
    (dict(data_ptr=0x1008), "not 16-byte aligned"),
    (dict(strides_elems=(1, 520)), "multiple of 16"),
    (dict(strides_elems=(1, 256)), "smaller than dim 0"),
    (dict(strides_elems=(2, 512)), "contiguous"),
    (dict(box=(128, 257)), "must be in 1..256"),
    (dict(box=(8, 64)), "multiple of 16"),
    (dict(elem_bytes=2, box=(128, 64)), "exceeds the 128B swizzle span"),
    (dict(swizzle="64B"), "exceeds the 64B swizzle span"),
    (dict(swizzle="256B"), "swizzle must be one of"),
    (dict(dims=(0, 256)), "TMA dim 0"),
    (dict(dims=(512,), strides_elems=(1,), box=(128, 64)), "same length"),
    (dict(tensor_extent_elems=512 * 256 - 1), "past the tensor"),
])
def test_tma_validation_errors(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _validate(**kw)


def test_tma_infer_strides() -> None:
    x = torch.empty(256, 576)  # row-major [M, K]
    assert tma_mod.infer_strides(x.shape, x.stride(), (576, 256)) == (1, 576)
    assert tma_mod.infer_strides(x.shape, x.stride(), (512, 100)) == (1, 576)  # sub-block of the tensor
    assert tma_mod.infer_strides(x.shape, x.stride(), (577, 256)) is None
    sub = x[:, :512]  # a column slice keeps the row pitch
    assert tma_mod.infer_strides(sub.shape, sub.stride(), (512, 256)) == (1, 576)
    w = torch.empty(4, 2112, 576)  # grouped weights [G, N, K]
    assert tma_mod.infer_strides(w.shape, w.stride(), (576, 2112, 4)) == (1, 576, 2112 * 576)
    assert tma_mod.infer_strides(w.shape, w.stride(), (576, 4 * 2112)) == (1, 576)  # G and N merged
    scale = torch.empty(7, 100)[:, :98].t()  # FP32 scales [M, KG] stride (1, M_pad)
    assert tma_mod.infer_strides(scale.shape, scale.stride(), (98, 7)) == (1, 100)
    one = torch.empty(1, 100)[:, :98].t()  # KG = 1
    assert tma_mod.infer_strides(one.shape, one.stride(), (98, 1)) == (1, 100)
    v = torch.empty(1024)
    assert tma_mod.infer_strides(v.shape, v.stride(), (1024, 1)) == (1, 1024)
    t = torch.empty(8, 16, 32).transpose(0, 1)  # not mergeable into 2-D
    assert tma_mod.infer_strides(t.shape, t.stride(), (32, 128)) is None


def test_make_tma_refuses_cpu_tensors_and_bad_dtypes() -> None:
    from moe_fp8.kernels.jit import make_tma_2d, make_tma_3d

    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        make_tma_2d(torch.zeros(64, 128, dtype=torch.bfloat16), 128, 64, 64, 64)
    with pytest.raises(ValueError, match="cannot infer TMA strides"):
        make_tma_2d(torch.zeros(64, 128), 100, 65, 32, 32, swizzle="none")
    with pytest.raises(ValueError, match="both mid_stride_elems and outer_stride_elems"):
        make_tma_3d(torch.zeros(2, 64, 128), 128, 64, 2, 32, 32, 1, mid_stride_elems=128)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        make_tma_2d([1, 2, 3], 3, 1, 16, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- SASS helper


def test_sass_tools_found() -> None:
    assert sass.cuobjdump_path() or sass.nvdisasm_path(), "install nvidia-cuda-cuobjdump (test extra)"


def test_count_instructions_parses_both_tool_formats() -> None:
    text = textwrap.dedent("""\
                code for sm_90a
                    Function : k
                /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                                   /* 0x000fe20000000800 */
                /*0010*/               @!P0 LDL.64 R2, [R1] ;
                /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0 ;
                /*0030*/               @P1 STL [R1+0x4], R0 ;
                /*0040*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        .L_x_1:
                /*0050*/                   EXIT ;
        """)
    assert sass.opcodes(text) == ["LDC", "LDL.64", "QGMMA.64x128x32.F32.E4M3.E4M3", "STL",
                                  "QGMMA.64x128x32.F32.E4M3.E4M3", "EXIT"]
    assert sass.count_instructions(text, "QGMMA") == 2
    assert sass.count_instructions(text, "LDL") == 1
    assert sass.count_instructions(text, "STL") == 1
    assert sass.count_instructions(text, "HGMMA") == 0


def test_dump_sass_missing_tool_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "x.cubin"
    f.write_bytes(b"\x7fELF")
    monkeypatch.setattr(sass, "cuobjdump_path", lambda: None)
    monkeypatch.setattr(sass, "nvdisasm_path", lambda: None)
    with pytest.raises(sass.SassToolNotFoundError, match="nvidia-cuda-cuobjdump"):
        sass.dump_sass(f)


def test_import_needs_no_gpu_or_driver() -> None:
    res = subprocess.run([sys.executable, "-c", "import moe_fp8.kernels.jit as j; print(j.driver_available()[0])"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- GPU (Hopper): the smoke script's checks

_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU_REASON)


def _smoke():
    spec = importlib.util.spec_from_file_location("jit_smoke", ROOT / "scripts" / "jit_smoke.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_SMOKE_CHECKS = ["check_vadd_f32", "check_vadd_bf16", "check_tma_cases", "check_tma_col_major_scale",
                 "check_big_smem", "check_static_plus_dynamic_smem", "check_cluster", "check_graph_capture",
                 "check_arg_validation"]


@_no_gpu
@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("check", _SMOKE_CHECKS)
def test_gpu_smoke_checks(check: str, compiler: str) -> None:
    getattr(_smoke(), check)(compiler)


@_no_gpu
@pytest.mark.gpu
@pytest.mark.hopper
def test_gpu_tma_descriptor_cache_and_launch_from_thread(fast_compiler: str) -> None:
    import threading

    from moe_fp8.kernels.jit import make_tma_2d

    x = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    d1 = make_tma_2d(x, 256, 128, 64, 32)
    assert make_tma_2d(x, 256, 128, 64, 32) is d1  # LRU hit
    assert make_tma_2d(x, 256, 128, 64, 16) is not d1
    smoke = _smoke()

    def in_fresh_thread(fn: Callable[[], object]) -> None:  # fails here if fn raised there
        errors: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert not errors, errors

    # A thread that launches before touching the CUDA runtime has no current context. Its cluster launch
    # (cuLaunchKernelEx) must make one current: the first ever of the kernel (loaded there: the parameter info
    # needs a context), and a later one (the kernel's state cached, the launch itself retried).
    cluster_k = smoke._kernel("cluster_ids", smoke.CLUSTER_IDS, fast_compiler)
    for _ in range(2):
        cluster_out = torch.full((16,), -1, dtype=torch.int32, device="cuda")
        torch.cuda.synchronize()
        in_fresh_thread(lambda out=cluster_out: cluster_k.launch((8, 1, 1), (32, 1, 1), [out], cluster=(2, 1, 1)))
        torch.cuda.synchronize()
        assert cluster_out.view(8, 2)[:, 0].tolist() == [0, 1] * 4
    in_fresh_thread(lambda: smoke.check_vadd_f32(fast_compiler))


def test_include_closure_hash_follows_quoted_includes(tmp_path) -> None:
    """The closure of one header: its own bytes and those of what it includes by quotes, transitively (cycles
    once); headers outside it leave the hash alone; a missing include is an error naming it."""
    from moe_fp8.kernels.jit.cache import include_closure_hash

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "top.cuh").write_text('#pragma once\n#include "../b/mid.cuh"\n#include <cstdint>\n')
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mid.cuh").write_text('#include "leaf.cuh"\n')
    (tmp_path / "b" / "leaf.cuh").write_text('#include "mid.cuh"\n// v1\n')
    (tmp_path / "b" / "other.cuh").write_text("// v1\n")
    first = include_closure_hash("a/top.cuh", tmp_path)
    (tmp_path / "b" / "other.cuh").write_text("// v2\n")
    assert include_closure_hash("a/top.cuh", tmp_path) == first
    (tmp_path / "b" / "leaf.cuh").write_text('#include "mid.cuh"\n// v2\n')
    assert include_closure_hash("a/top.cuh", tmp_path) != first
    (tmp_path / "b" / "mid.cuh").write_text('#include "gone.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"gone\.cuh"):
        include_closure_hash("a/top.cuh", tmp_path)
