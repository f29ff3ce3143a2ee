"""CUDA C++ → sm_90a cubin, with nvcc (CUDA toolkit) or NVRTC (PyPI ``nvidia-cuda-nvrtc``).

Choice of compiler (``get_compiler``):
  1. ``MOE_FP8_JIT_COMPILER=nvcc|nvrtc`` forces one; if it is not usable that is an error, never a fallback.
  2. Otherwise nvcc when one is found (``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``, then ``PATH``):
     it is the compiler the kernels were written and tested with, and its flags are the reference.
  3. Otherwise NVRTC (no toolkit needed).  The choice is printed under ``MOE_FP8_JIT_DEBUG=1``.

Both compilers get C++17, line info and ptxas ``-v`` (nvcc also ``--expt-relaxed-constexpr``, which
NVRTC does not take), so the ptxas register/spill report is always available (stored in each cache entry's ``meta.json``).
NVRTC has no C library headers: ``<cstdint>``/``<stdint.h>``/``<cstddef>``/``<stddef.h>`` are supplied
as in-memory headers (see ``NVRTC_SHIM_HEADERS``) and the toolkit's ``include`` + ``include/cccl`` are
added when found, so kernels may use ``<cuda_bf16.h>``, ``<cuda_fp8.h>`` and ``<cuda/std/...>``.
``<cuda.h>`` does not compile under NVRTC (it needs ``<stdlib.h>``): declare TMA descriptor parameters
with a 64-byte aligned 128-byte struct instead of ``CUtensorMap``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ARCH = "sm_90a"
SOURCE_FILE = "kernel.cu"
CUBIN_FILE = "kernel.cubin"
LOG_FILE = "compile.log"
ENV_COMPILER = "MOE_FP8_JIT_COMPILER"
ENV_DEBUG = "MOE_FP8_JIT_DEBUG"
# nvcc and NVRTC build from the same source text; one compile may not take longer than this.
COMPILE_TIMEOUT_S = 900
# environment variables nvcc reads into every compile (part of the nvcc cache key when set)
NVCC_ENV_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")

NVCC_FLAGS: tuple[str, ...] = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-cubin",
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-Xptxas",
    "-v",
)
# NVRTC rejects -O3 (device code is optimized by default, like nvcc's ptxas -O3) and has no
# --expt-relaxed-constexpr (13.5): with -default-device unannotated constexpr functions are device
# functions already, and <cuda/std/...> functions are __host__ __device__.
NVRTC_FLAGS: tuple[str, ...] = (
    f"--gpu-architecture={ARCH}",
    "-std=c++17",
    "-default-device",
    "-lineinfo",
    "--ptxas-options=-v",
)

# NVRTC has no C library headers.  When the toolkit's CCCL (<cuda/std/...>) is on the include path
# the shims defer to it, since under NVRTC it defines the global fixed-width types itself; otherwise
# they define them the way CCCL does.  NOTE: 64-bit types are then `long long` (CCCL's NVRTC choice),
# `long` under nvcc (glibc): same size, but template instances over them mangle differently, so look
# kernels up by C++ name (build(kernel_name="fn")), not by a mangled string copied from one compiler.
_STDINT_SHIM = """#pragma once
// moe_fp8 NVRTC shim for <cstdint> / <stdint.h>
#if __has_include(<cuda/std/cstdint>)
#include <cuda/std/cstdint>
#else
typedef signed char int8_t;
typedef signed short int16_t;
typedef signed int int32_t;
typedef signed long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int64_t intptr_t;
typedef uint64_t uintptr_t;
#define INT8_MIN (-127 - 1)
#define INT16_MIN (-32767 - 1)
#define INT32_MIN (-2147483647 - 1)
#define INT64_MIN (-9223372036854775807LL - 1)
#define INT8_MAX 127
#define INT16_MAX 32767
#define INT32_MAX 2147483647
#define INT64_MAX 9223372036854775807LL
#define UINT8_MAX 255
#define UINT16_MAX 65535
#define UINT32_MAX 4294967295U
#define UINT64_MAX 18446744073709551615ULL
#endif
namespace std {
using ::int8_t; using ::int16_t; using ::int32_t; using ::int64_t;
using ::uint8_t; using ::uint16_t; using ::uint32_t; using ::uint64_t;
using ::intptr_t; using ::uintptr_t;
}
"""
_STDDEF_SHIM = """#pragma once
// moe_fp8 NVRTC shim for <cstddef> / <stddef.h>
#if __has_include(<cuda/std/cstddef>)
#include <cuda/std/cstddef>
#endif
typedef decltype(sizeof(0)) size_t;
typedef decltype((char*)0 - (char*)0) ptrdiff_t;
#ifndef NULL
#define NULL 0
#endif
namespace std {
using ::size_t; using ::ptrdiff_t;
typedef decltype(nullptr) nullptr_t;
}
"""
NVRTC_SHIM_HEADERS: dict[str, str] = {
    "cstdint": _STDINT_SHIM,
    "stdint.h": _STDINT_SHIM,
    "cstddef": _STDDEF_SHIM,
    "stddef.h": _STDDEF_SHIM,
}


class JitCompileError(RuntimeError):
    """A kernel failed to compile; ``log`` is the compiler output, ``path`` the saved source + log."""

    def __init__(self, message: str, *, log: str = "", path: Path | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.path = path


class CompilerNotFoundError(RuntimeError):
    """No usable CUDA compiler (or the one asked for by name / ``MOE_FP8_JIT_COMPILER`` is not usable).

    A ``RuntimeError`` subclass so existing handlers keep working; its own type lets the command line
    print the fix instead of a traceback."""


# ---------------------------------------------------------------- debug output

def debug_level() -> int:
    """``MOE_FP8_JIT_DEBUG``: 0 off, 1 compile/load summaries + ptxas report, 2 also generated sources."""
    raw = os.environ.get(ENV_DEBUG, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return 0
    try:
        return max(int(raw), 1)
    except ValueError:
        return 1


def debug_print(msg: str, level: int = 1) -> None:
    """Print ``msg`` to stderr when the debug level is at least ``level``."""
    if debug_level() >= level:
        print(f"[moe_fp8.jit] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- ptxas report

_RE_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_$][\w$]*)'?")
_RE_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Per-function resource usage from ptxas ``-v`` output.

    Returns ``{symbol: {"registers", "stack", "spill_stores", "spill_loads", "smem"}}`` (keys present
    only when ptxas printed them; non-entry device functions usually only get stack/spill lines).
    """
    out: dict[str, dict[str, int]] = {}
    cur: dict[str, int] | None = None
    for line in log.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = _RE_STACK.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(g) for g in m.groups())
        m = _RE_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            s = _RE_SMEM.search(line)
            if s:
                cur["smem"] = int(s.group(1))
    return out


def format_ptxas_report(report: dict[str, dict[str, int]]) -> str:
    """One line per function: registers, spills, stack, static smem."""
    lines = []
    for fn, r in report.items():
        if "registers" not in r and not r.get("spill_stores") and not r.get("spill_loads"):
            continue
        lines.append(
            f"  {fn}: {r.get('registers', '?')} regs, spill st/ld {r.get('spill_stores', 0)}/"
            f"{r.get('spill_loads', 0)} B, stack {r.get('stack', 0)} B, static smem {r.get('smem', 0)} B"
        )
    return "\n".join(lines) if lines else "  (no ptxas report)"


# ---------------------------------------------------------------- discovery

@dataclass(frozen=True)
class CompilerInfo:
    """What ``find_compilers`` found: ``path`` is the nvcc binary or the loaded libnvrtc."""

    name: str
    version: str
    path: str
    available: bool
    reason: str


def _candidate_cuda_roots() -> list[Path]:
    roots = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        val = os.environ.get(var)
        if val:
            roots.append(Path(val))
    roots.append(Path("/usr/local/cuda"))
    return roots


def _find_nvcc() -> tuple[Path | None, str]:
    tried = []
    for root in _candidate_cuda_roots():
        p = root / "bin" / "nvcc"
        tried.append(str(p))
        if p.is_file() and os.access(p, os.X_OK):
            return p, ""
    which = shutil.which("nvcc")
    if which:
        return Path(which), ""
    return None, f"nvcc not found (tried {', '.join(tried)} and PATH)"


@functools.lru_cache(maxsize=8)
def _nvcc_version(path: str, mtime_ns: int) -> str:
    res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False)
    m = re.search(r"release [\d.]+, V([\d.]+)", res.stdout)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"`{path} --version` failed (rc={res.returncode}): {res.stdout}{res.stderr}")
    return m.group(1)


def toolkit_include_dirs() -> list[Path]:
    """CUDA headers for NVRTC: ``<root>/include`` (+ ``include/cccl``) of the first toolkit that has
    ``cuda_bf16.h``, else the headers of the PyPI wheels (``nvidia/cu*/include``) when present."""
    cands: list[Path] = [r / "include" for r in _candidate_cuda_roots()]
    nvcc, _ = _find_nvcc()
    if nvcc is not None:
        cands.append(nvcc.resolve().parent.parent / "include")
    cands.extend(nvidia_wheel_dirs("include"))
    for inc in cands:
        if (inc / "cuda_bf16.h").is_file():
            dirs = [inc.resolve()]
            if (inc / "cccl" / "cuda" / "std").is_dir():
                dirs.append((inc / "cccl").resolve())
            return dirs
    return []


def nvidia_wheel_dirs(sub: str) -> list[Path]:
    """``nvidia/<pkg>/<sub>`` folders of the installed NVIDIA PyPI wheels (cu13 layout and older)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out = []
    for loc in spec.submodule_search_locations:
        base = Path(loc)
        if base.is_dir():
            out.extend(sorted(p for p in base.glob(f"*/{sub}") if p.is_dir()))
    return out


def _nvcc_info() -> CompilerInfo:
    path, why = _find_nvcc()
    if path is None:
        return CompilerInfo("nvcc", "", "", False, why)
    try:
        version = _nvcc_version(str(path), path.stat().st_mtime_ns)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return CompilerInfo("nvcc", "", str(path), False, f"nvcc at {path} unusable: {e}")
    return CompilerInfo("nvcc", version, str(path), True, "")


# The NVRTC probe loads libnvrtc (~60 ms on the H100 machine, the bulk of a warm process's first kernel load),
# although a warm cache needs only its version for the keys. Its result is kept in the cache directory
# under what decides which library cuda.bindings loads and what version that is: the packages providing it,
# the search environment and the library file itself (size, mtime). Any change there probes again.
NVRTC_MEMO_FILE = "nvrtc_probe.json"


def _nvrtc_memo_signature() -> list:
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    try:
        ld_cache = os.stat("/etc/ld.so.cache").st_mtime_ns
    except OSError:
        ld_cache = None
    return [sys.prefix, *(version(d) for d in ("cuda-bindings", "cuda-pathfinder", "nvidia-cuda-nvrtc",
                                                "nvidia-cuda-nvrtc-cu12")),
            *(os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "CONDA_PREFIX")), ld_cache]


def _file_identity(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _nvrtc_info() -> CompilerInfo:
    """``_probe_nvrtc()``, from the memo in the cache directory where it still applies."""
    import json

    from .cache import cache_dir

    memo_path = cache_dir() / NVRTC_MEMO_FILE
    try:
        signature = _nvrtc_memo_signature()
    except Exception:  # unreadable package metadata: probe, keep nothing (never lose the compiler over a memo)
        return _probe_nvrtc()
    try:
        memo = json.loads(memo_path.read_text())
        info = CompilerInfo(**memo["info"])
        library = _file_identity(info.path) if info.available else None
        if memo["signature"] == signature and memo["library"] == library and (library or not info.available):
            return info
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, unreadable or stale: probe
    info = _probe_nvrtc()
    library = _file_identity(info.path) if info.available else None
    if library is not None or not info.available:  # (a library at an unknown path: no memo)
        memo = {"signature": signature, "library": library, "info": dataclasses.asdict(info)}
        with contextlib.suppress(OSError):  # best effort: an unwritable cache only costs the probe
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)
    return info


def _probe_nvrtc() -> CompilerInfo:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        return CompilerInfo("nvrtc", "", "", False, f"cuda.bindings.nvrtc not importable: {e}")
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # the library itself is missing: cuda.bindings raises its own loader errors
        return CompilerInfo("nvrtc", "", "", False, f"libnvrtc not loadable: {e}")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return CompilerInfo("nvrtc", "", "", False, f"nvrtcVersion failed: {err}")
    where = _nvrtc_library_path()
    return CompilerInfo("nvrtc", f"{major}.{minor}{_nvrtc_build_tag(where)}", where or "libnvrtc", True, "")


def _nvrtc_library_path() -> str:
    try:
        import cuda.pathfinder as pf

        return pf.load_nvidia_dynamic_lib("nvrtc").abs_path or ""
    except Exception:  # older cuda-bindings without pathfinder, or an unusual install: location unknown
        return ""


def _nvrtc_build_tag(lib_path: str) -> str:
    """``nvrtcVersion`` gives major.minor only; pin the exact build for the cache key: the PyPI wheel's
    version when the loaded library belongs to it, else the library file's size."""
    if not lib_path:
        return ""
    try:
        import importlib.metadata as md

        for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
            try:
                files = md.files(dist) or []
            except md.PackageNotFoundError:
                continue
            for f in files:
                if "libnvrtc.so" in f.name and Path(str(f.locate())).resolve() == Path(lib_path).resolve():
                    return f" ({dist} {md.version(dist)})"
    except Exception:
        pass  # metadata is best effort; fall through to the size tag
    try:
        return f" (lib size {Path(lib_path).stat().st_size})"
    except OSError:
        return ""


def find_compilers() -> list[CompilerInfo]:
    """Both compilers, usable or not (with the reason), in default-preference order (nvcc, nvrtc)."""
    return [_nvcc_info(), _nvrtc_info()]


# ---------------------------------------------------------------- compilers

@dataclass
class CompileResult:
    """Output of ``Compiler.compile_ex``."""

    cubin: Path
    log: str
    seconds: float
    ptxas: dict[str, dict[str, int]] = field(default_factory=dict)


class Compiler(ABC):
    """Compiles one generated ``.cu`` source to an sm_90a cubin."""

    name: str = ""

    def __init__(self, info: CompilerInfo) -> None:
        if not info.available:
            raise CompilerNotFoundError(f"{info.name} is not usable: {info.reason}")
        self.info = info

    @property
    def version(self) -> str:
        return self.info.version

    @abstractmethod
    def flags(self) -> list[str]:
        """Every flag that changes the output (part of the cache key), excluding the package include dir."""

    def identity(self) -> str:
        """Compiler name + version + flags, as hashed into the cache key."""
        return "\n".join([self.name, self.version, *self.flags()])

    def compile(self, source: str, name: str, include_dirs: Sequence[Path], out_dir: Path,
                extra_flags: Sequence[str] = ()) -> Path:
        """Compile ``source`` into ``out_dir/kernel.cubin`` and return its path (see ``compile_ex``)."""
        return self.compile_ex(source, name, include_dirs, out_dir, extra_flags).cubin

    def compile_ex(self, source: str, name: str, include_dirs: Sequence[Path], out_dir: Path,
                   extra_flags: Sequence[str] = ()) -> CompileResult:
        """Compile and return the cubin path, compiler log, wall time and parsed ptxas report.

        ``out_dir`` receives ``kernel.cu`` (always), ``kernel.cubin`` and ``compile.log``.  On failure
        raises ``JitCompileError`` whose ``path`` is ``out_dir`` (holding the source and the log).
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        src_path = out_dir / SOURCE_FILE
        src_path.write_text(source)
        debug_print(f"generated source of {name}:\n{source}", level=2)
        t0 = time.perf_counter()
        ok, log = self._run(source, src_path, [Path(d) for d in include_dirs], out_dir / CUBIN_FILE,
                            list(extra_flags))
        seconds = time.perf_counter() - t0
        (out_dir / LOG_FILE).write_text(log)
        if not ok:
            tail = "\n".join(log.strip().splitlines()[-60:])
            raise JitCompileError(
                f"{self.name} {self.version} failed to compile kernel '{name}'; source and full log saved "
                f"in {out_dir}\n{tail}",
                log=log, path=out_dir,
            )
        report = parse_ptxas_report(log)
        debug_print(f"compiled {name} with {self.name} {self.version} in {seconds:.2f} s\n"
                    f"{format_ptxas_report(report)}")
        return CompileResult(out_dir / CUBIN_FILE, log, seconds, report)

    @abstractmethod
    def _run(self, source: str, src_path: Path, include_dirs: list[Path], cubin_path: Path,
             extra_flags: list[str]) -> tuple[bool, str]:
        """Run the compiler; returns (success, log)."""


class NvccCompiler(Compiler):
    """``nvcc -cubin`` in a subprocess."""

    name = "nvcc"

    def flags(self) -> list[str]:
        # nvcc adds these environment variables' flags (and host compiler) to every command line: they change
        # the cubin, so they belong in the key (read at each build, like the environment nvcc sees)
        env = [f"#{var}={os.environ[var]}" for var in NVCC_ENV_VARS if os.environ.get(var)]
        return [*NVCC_FLAGS, *env]

    def _run(self, source: str, src_path: Path, include_dirs: list[Path], cubin_path: Path,
             extra_flags: list[str]) -> tuple[bool, str]:
        cmd = [self.info.path, *NVCC_FLAGS, *(f"-I{d}" for d in include_dirs), *extra_flags,
               "-o", str(cubin_path), str(src_path)]
        # a session of its own, so that a timeout kills nvcc's children (cicc, ptxas) with it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            return False, f"$ {' '.join(cmd)}\ntimed out after {COMPILE_TIMEOUT_S} s\n{out or ''}{err or ''}"
        log = f"$ {' '.join(cmd)}\n{out}{err}"
        ok = proc.returncode == 0 and cubin_path.is_file()
        if proc.returncode == 0 and not ok:
            log += "\nnvcc returned 0 but wrote no cubin"
        return ok, log


class NvrtcCompiler(Compiler):
    """NVRTC in process, through ``cuda.bindings.nvrtc``; cubin via ``nvrtcGetCUBIN``."""

    name = "nvrtc"

    def __init__(self, info: CompilerInfo) -> None:
        super().__init__(info)
        self._system_includes = toolkit_include_dirs()

    def flags(self) -> list[str]:
        shim_hash = hashlib.sha256("".join(f"{k}\0{v}" for k, v in sorted(NVRTC_SHIM_HEADERS.items()))
                                   .encode()).hexdigest()[:16]
        return [*NVRTC_FLAGS, *(f"-I{d}" for d in self._system_includes), f"#shim={shim_hash}"]

    def _run(self, source: str, src_path: Path, include_dirs: list[Path], cubin_path: Path,
             extra_flags: list[str]) -> tuple[bool, str]:
        opts = [*NVRTC_FLAGS, *(f"-I{d}" for d in include_dirs),
                *(f"-I{d}" for d in self._system_includes), *extra_flags]
        ok, log, invalid_option = self._compile(source, src_path, opts, cubin_path)
        # (the log's first line is the command, which always names --ptxas-options: look past it)
        if not ok and invalid_option and "ptxas-options" in log.partition("\n")[2]:
            # an NVRTC without --ptxas-options still compiles; only the register report is lost
            opts = [o for o in opts if not o.startswith("--ptxas-options")]
            ok, log, _ = self._compile(source, src_path, opts, cubin_path)
            log += "\n(this NVRTC rejects --ptxas-options: no ptxas register/spill report)"
        return ok, log

    @staticmethod
    def _compile(source: str, src_path: Path, opts: list[str], cubin_path: Path) -> tuple[bool, str, bool]:
        """(success, log, failed with NVRTC_ERROR_INVALID_OPTION)."""
        from cuda.bindings import nvrtc

        ok_code = nvrtc.nvrtcResult.NVRTC_SUCCESS
        names = list(NVRTC_SHIM_HEADERS)
        err, prog = nvrtc.nvrtcCreateProgram(
            source.encode(), str(src_path).encode(), len(names),
            [NVRTC_SHIM_HEADERS[n].encode() for n in names], [n.encode() for n in names],
        )
        if err != ok_code:
            return False, f"nvrtcCreateProgram failed: {err}", False
        header = "nvrtc " + " ".join(opts) + "\n"
        try:
            (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
            lerr, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = ""
            if lerr == ok_code and size > 1:
                buf = bytearray(size)
                nvrtc.nvrtcGetProgramLog(prog, buf)
                log = bytes(buf).rstrip(b"\0").decode(errors="replace")
            if err != ok_code:
                return False, f"{header}{log}\n{err.name}", err == nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            if err != ok_code or size == 0:
                return False, f"{header}{log}\nnvrtcGetCUBINSize failed: {err}", False
            cubin = bytearray(size)
            (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
            if err != ok_code:
                return False, f"{header}{log}\nnvrtcGetCUBIN failed: {err}", False
            cubin_path.write_bytes(bytes(cubin))
            return True, header + log, False
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


_COMPILERS: dict[str, type[Compiler]] = {"nvcc": NvccCompiler, "nvrtc": NvrtcCompiler}
_instances: dict[str, Compiler] = {}


def get_compiler(name: str | None = None) -> Compiler:
    """The compiler to use: ``name``, else ``$MOE_FP8_JIT_COMPILER``, else nvcc if found, else NVRTC.

    A compiler asked for by name or environment that is not usable raises ``CompilerNotFoundError`` (a
    ``RuntimeError``) with the reason (no silent fallback); so does finding none at all.  Instances are reused within the process.
    """
    requested = name or os.environ.get(ENV_COMPILER, "").strip().lower() or None
    if requested is not None and requested not in _COMPILERS:
        raise ValueError(f"unknown JIT compiler {requested!r} (from {'argument' if name else ENV_COMPILER}); "
                         f"expected one of {sorted(_COMPILERS)}")
    key = requested or "<default>"
    inst = _instances.get(key)
    if inst is not None:
        return inst
    if requested is not None:
        info = _nvcc_info() if requested == "nvcc" else _nvrtc_info()
        if not info.available:
            raise CompilerNotFoundError(f"JIT compiler {requested!r} requested but not usable: {info.reason}")
        inst = _COMPILERS[requested](info)
    else:
        nvcc = _nvcc_info()
        if nvcc.available:
            inst = NvccCompiler(nvcc)
        else:
            nvrtc = _nvrtc_info()
            if not nvrtc.available:
                raise CompilerNotFoundError(f"no CUDA compiler usable: {nvcc.reason}; {nvrtc.reason}")
            debug_print(f"nvcc not usable ({nvcc.reason}); using NVRTC {nvrtc.version}")
            inst = NvrtcCompiler(nvrtc)
    debug_print(f"JIT compiler: {inst.name} {inst.version} ({inst.info.path})")
    _instances[key] = inst
    return inst
