"""The ``moe-fp8`` command.

Subcommands live in ``COMMANDS`` (name → ``Command``); adding one is one function to fill its
argparse sub-parser, one function to run it, and one entry in the dict.

``moe-fp8 info`` reports the environment the kernels would run in. It never raises on a machine
without a GPU, driver, compiler or half-written package: every probe is wrapped and a failure is
shown as ``unavailable: <error>`` in its own section.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

# Environment variables moe_fp8 reads (meanings: README "Environment variables").
ENV_VARS = (
    "MOE_FP8_BACKEND",
    "MOE_FP8_STRICT",
    "MOE_FP8_CACHE_DIR",
    "MOE_FP8_JIT_COMPILER",
    "MOE_FP8_JIT_DEBUG",
    "MOE_FP8_NUM_SMS",
    "CUDA_HOME",
)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------------------------
# info: probes (each returns a JSON-able dict and never raises)
# --------------------------------------------------------------------------------------------

def _probe_moe_fp8() -> dict[str, Any]:
    import moe_fp8

    version = getattr(moe_fp8, "__version__", None) or _dist_version("moe-fp8")
    # moe_fp8.__path__ also works while the package has no __init__.py (a namespace package).
    return {"version": version, "path": os.path.abspath(next(iter(moe_fp8.__path__)))}


def _probe_python() -> dict[str, Any]:
    return {"version": platform.python_version(), "executable": sys.executable}


def _probe_torch() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        return {"version": None, "cuda": None, "error": _error(exc)}
    return {"version": torch.__version__, "cuda": torch.version.cuda}


def _probe_triton() -> dict[str, Any]:
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:
        return {"version": None, "error": _error(exc)}
    return {"version": getattr(triton, "__version__", None) or _dist_version("triton")}


def _driver_query() -> dict[str, Any]:
    """Driver version and devices seen through ``cuda.bindings`` (independent of torch's build)."""
    info: dict[str, Any] = {"version": _dist_version("cuda-bindings"), "driver_version": None,
                            "devices": [], "error": None}
    try:
        from cuda.bindings import driver as cu

        def check(result):
            err, *rest = result
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(getattr(err, "name", str(err)))
            return rest[0] if len(rest) == 1 else rest

        check(cu.cuInit(0))
        ver = check(cu.cuDriverGetVersion())
        info["driver_version"] = f"{ver // 1000}.{ver % 1000 // 10}"
        attr = cu.CUdevice_attribute
        for i in range(check(cu.cuDeviceGetCount())):
            dev = check(cu.cuDeviceGet(i))
            name = check(cu.cuDeviceGetName(256, dev))
            major = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
            minor = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            sms = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
            mem = check(cu.cuDeviceTotalMem(dev))
            info["devices"].append({
                "index": i,
                "name": name.split(b"\0", 1)[0].decode(errors="replace"),
                "capability": f"{major}.{minor}",
                "sm_count": int(sms),
                "memory_bytes": int(mem),
            })
    except Exception as exc:
        info["error"] = _error(exc)
    return info


def _probe_gpus(driver: dict[str, Any]) -> dict[str, Any]:
    """GPUs as torch sees them; if torch sees none, say why and list what the driver sees."""
    out: dict[str, Any] = {"source": "torch", "devices": [], "reason": None}
    try:
        import torch

        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} was built without CUDA"
        elif not torch.cuda.is_available():
            reason = "torch.cuda.is_available() is False"
            try:
                torch.cuda.init()
            except Exception as exc:
                reason = _error(exc)
        else:
            reason = None
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out["devices"].append({
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "sm_count": p.multi_processor_count,
                    "memory_bytes": p.total_memory,
                })
            if not out["devices"]:
                reason = "torch.cuda.device_count() is 0"
    except Exception as exc:
        reason = _error(exc)
    if reason is not None:
        if driver["error"]:
            reason += "; CUDA driver unavailable"
        elif driver["devices"]:
            out["source"] = "cuda.bindings"
            out["devices"] = driver["devices"]
            reason += f" (the driver sees {len(driver['devices'])} device(s), listed below)"
        else:
            reason += "; the CUDA driver sees no device"
    out["reason"] = reason
    return out


def _probe_compilers() -> dict[str, Any]:
    try:
        from moe_fp8.kernels.jit.compiler import find_compilers

        return {"compilers": [
            {"name": getattr(c, "name", str(c)), "version": getattr(c, "version", None),
             "available": bool(getattr(c, "available", False)), "reason": getattr(c, "reason", None)}
            for c in find_compilers()
        ]}
    except Exception as exc:
        return {"error": _error(exc)}


def _probe_cache() -> dict[str, Any]:
    try:
        from moe_fp8.kernels.jit.cache import cache_info

        info = dict(cache_info())
        return {"dir": str(info["dir"]), "entries": int(info["entries"]), "bytes": int(info["bytes"])}
    except Exception as exc:
        return {"error": _error(exc)}


def _probe_backends() -> dict[str, Any]:
    try:
        from moe_fp8.backends import available_backends

        return {"backends": {name: {"available": bool(ok), "reason": reason}
                             for name, (ok, reason) in available_backends().items()}}
    except Exception as exc:
        return {"error": _error(exc)}


def collect_info() -> dict[str, Any]:
    """Everything ``moe-fp8 info`` reports, as a JSON-able dict (keys are the JSON output's keys)."""
    driver = _driver_query()
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "moe_fp8": _probe_moe_fp8,
        "python": _probe_python,
        "torch": _probe_torch,
        "triton": _probe_triton,
        "cuda_bindings": lambda: {k: driver[k] for k in ("version", "driver_version", "error")},
        "gpus": lambda: _probe_gpus(driver),
        "jit_compilers": _probe_compilers,
        "cache": _probe_cache,
        "backends": _probe_backends,
        "env": lambda: {name: os.environ.get(name) for name in ENV_VARS},
    }
    info: dict[str, Any] = {}
    for key, probe in probes.items():
        try:
            info[key] = probe()
        except Exception as exc:  # a probe's own bug must not take the report down
            info[key] = {"error": _error(exc)}
    return info


# --------------------------------------------------------------------------------------------
# info: text rendering
# --------------------------------------------------------------------------------------------

def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024**exp:.1f} {('KiB', 'MiB', 'GiB')[exp - 1]}"


def _or_error(section: dict[str, Any], value: str) -> str:
    return f"unavailable: {section['error']}" if section.get("error") else value


def format_info(info: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append

    pkg, py, tch, tri, cb = (info[k] for k in ("moe_fp8", "python", "torch", "triton", "cuda_bindings"))
    versions = {
        "moe_fp8": _or_error(pkg, "{} ({})".format(pkg.get("version") or "unknown version", pkg.get("path"))),
        "python": _or_error(py, "{} ({})".format(py.get("version"), py.get("executable"))),
        "torch": _or_error(tch, "{} ({})".format(tch.get("version"), f"built with CUDA {tch['cuda']}" if tch.get("cuda") else "CPU-only build")),
        "triton": _or_error(tri, str(tri.get("version"))),
        "cuda-bindings": cb.get("version") or "not installed",
    }
    add("Versions")
    for name, text in versions.items():
        add(f"  {name:<14} {text}")

    gpus = info["gpus"]
    add("")
    add("GPUs")
    if gpus.get("error"):
        add(f"  unavailable: {gpus['error']}")
    else:
        add(f"  driver         {cb.get('driver_version') or 'unavailable: {}'.format(cb.get('error'))}")
        if gpus.get("reason"):
            add(f"  no CUDA GPU visible: {gpus['reason']}")
        for d in gpus.get("devices", []):
            add(f"  [{d['index']}] {d['name']}  sm_{d['capability'].replace('.', '')}  "
                f"{d['sm_count']} SMs  {_fmt_bytes(d['memory_bytes'])}")

    comp = info["jit_compilers"]
    add("")
    add("JIT compilers")
    if comp.get("error"):
        add(f"  unavailable: {comp['error']}")
    elif not comp.get("compilers"):
        add("  none found")
    else:
        width = max(len(c["version"] or "-") for c in comp["compilers"])
        for c in comp["compilers"]:
            state = "available" if c["available"] else f"not available: {c['reason']}"
            add(f"  {c['name']:<10} {c['version'] or '-':<{width}}  {state}")

    cache = info["cache"]
    add("")
    add("JIT cache")
    if cache.get("error"):
        add(f"  unavailable: {cache['error']}")
    else:
        add(f"  dir            {cache['dir']}")
        add(f"  entries        {cache['entries']} ({_fmt_bytes(cache['bytes'])})")

    be = info["backends"]
    add("")
    add("Backends")
    if be.get("error"):
        add(f"  unavailable: {be['error']}")
    else:
        for name, b in be["backends"].items():
            state = "available" if b["available"] else "not available"
            add(f"  {name:<10} {state}" + (f": {b['reason']}" if b["reason"] else ""))

    add("")
    add("Environment")
    for name, value in info["env"].items():
        add(f"  {name:<22} {'(unset)' if value is None else value}")
    return "\n".join(lines)


def _add_info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


BENCH_KINDS = {"gemm": "moe_fp8.benchmarks.gemm", "grouped": "moe_fp8.benchmarks.grouped"}


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=sorted(BENCH_KINDS), help="what to benchmark")
    p.add_argument("bench_args", nargs=argparse.REMAINDER,
                   help="passed to the driver (e.g. --shapes M,N,K ..., --sweep 128x128s4, --out-dir DIR)")


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    import torch

    if not torch.cuda.is_available():
        print("moe-fp8 bench: needs a CUDA GPU (none visible); `moe-fp8 info` says why", file=sys.stderr)
        return 2
    return importlib.import_module(BENCH_KINDS[args.kind]).main(args.bench_args)


# --------------------------------------------------------------------------------------------
# command table and entry point
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "info": Command("versions, GPUs, JIT compilers, cache and backends", _add_info_args, cmd_info),
    "bench": Command("time our kernels against torch baselines; writes docs/benchmarks JSON",
                     _add_bench_args, cmd_bench),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-fp8", description="block-FP8 GEMM / MoE kernels for Hopper")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_args(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
