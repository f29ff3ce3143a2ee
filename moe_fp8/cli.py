"""The ``moe-fp8`` command.

Subcommands live in ``COMMANDS`` (name → ``Command``); adding one is one function to fill its
argparse sub-parser, one function to run it, and one entry in the dict.

- ``info``: the environment the kernels would run in — one paste is a complete bug report. It never
  raises on a machine without a GPU, driver, compiler or half-written package: every probe is
  wrapped and a failure is shown as ``unavailable: <error>`` in its own section.
- ``demo``: a small DeepSeek-V3, Kimi-K2, Qwen3-MoE, GLM-4.5 or MiniMax-M2 (random block-FP8 weights) run through transformers on our layers:
  tokens/s, the backend, and the logit error against the bf16 model (``moe_fp8.demo``).
- ``bench {gemm,grouped,moe-data,moe,all,plot}``: time our kernels against torch baselines (kinds
  registered in ``moe_fp8.benchmarks.KINDS``); tables, DESIGN §7 JSON, CSV and a roofline plot.
- ``warmup --model DIR``: precompile every kernel variant a model needs (``moe_fp8.warmup``).
- ``tune --model DIR | --shape SPEC``: time the best kernel configurations of a model's GEMMs on this GPU and keep
  the fastest in its table (``moe_fp8.kernels.tuning``).
- ``quantize SRC DST``: bf16 checkpoint → DeepSeek-style block FP8 (``moe_fp8.convert``).

Errors a user can cause or fix (no GPU, not Hopper, no compiler, a failed compile, an unsupported
shape, an unwritable cache, a bad checkpoint) end the command with one ``moe-fp8 <cmd>: error: ...``
message that says what to do, and exit status 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Environment variables worth seeing in a bug report: moe_fp8's own (README "Environment
# variables") and the CUDA ones that change what it finds.
ENV_VARS = (
    "MOE_FP8_BACKEND",
    "MOE_FP8_STRICT",
    "MOE_FP8_CACHE_DIR",
    "MOE_FP8_JIT_COMPILER",
    "MOE_FP8_JIT_DEBUG",
    "MOE_FP8_NUM_SMS",
    "MOE_FP8_GEMM_DEFINES",
    "MOE_FP8_PDL",
    "MOE_FP8_TUNED_CONFIGS",
    "MOE_FP8_ROUTING_EXACT",
    "MOE_FP8_CUDA_ROUTE",
    "MOE_FP8_TRITON_FAST_LAUNCH",
    "MOE_FP8_COMMIT",
    "TRITON_INTERPRET",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_VISIBLE_DEVICES",
)
# Other distributions whose versions matter for a report (installed or not).
PACKAGES = ("numpy", "safetensors", "filelock", "nvidia-cuda-nvrtc", "matplotlib", "transformers", "vllm",
            "sglang")


class CliError(Exception):
    """A failure the user can fix: printed as one message (no traceback), exit status 1."""


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

def _git_commit(path: str) -> str | None:
    """The source checkout's commit (``-dirty`` with local changes), or None for an installed wheel."""
    root = Path(path).parent
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "") if sha else None


def _probe_moe_fp8() -> dict[str, Any]:
    import moe_fp8

    version = getattr(moe_fp8, "__version__", None) or _dist_version("moe-fp8")
    # moe_fp8.__path__ also works while the package has no __init__.py (a namespace package).
    path = os.path.abspath(next(iter(moe_fp8.__path__)))
    return {"version": version, "path": path, "commit": _git_commit(path)}


def _probe_python() -> dict[str, Any]:
    return {"version": platform.python_version(), "executable": sys.executable}


def _probe_system() -> dict[str, Any]:
    libc = " ".join(v for v in platform.libc_ver() if v) or None
    return {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(), "libc": libc}


def _probe_torch() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        return {"version": None, "cuda": None, "error": _error(exc)}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "git_version": getattr(torch.version, "git_version", None)}
    if torch.version.cuda is not None:
        with contextlib.suppress(Exception):  # a CUDA build without a driver may refuse this
            out["arch_list"] = torch.cuda.get_arch_list()
    return out


def _probe_triton() -> dict[str, Any]:
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:
        return {"version": None, "error": _error(exc)}
    return {"version": getattr(triton, "__version__", None) or _dist_version("triton")}


def _probe_packages() -> dict[str, Any]:
    return {name: _dist_version(name) for name in PACKAGES}


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
        jit_compiler = importlib.import_module("moe_fp8.kernels.jit.compiler")
        out: dict[str, Any] = {"compilers": [
            {"name": getattr(c, "name", str(c)), "version": getattr(c, "version", None),
             "available": bool(getattr(c, "available", False)), "reason": getattr(c, "reason", None)}
            for c in jit_compiler.find_compilers()
        ]}
    except Exception as exc:
        return {"error": _error(exc)}
    # The one a kernel build would use now (honours MOE_FP8_JIT_COMPILER), or why there is none.
    try:
        chosen = jit_compiler.get_compiler()
        out["selected"] = f"{chosen.name} {chosen.version}"
    except Exception as exc:
        out["selected"] = None
        out["selected_error"] = _error(exc)
    return out


def _probe_cache() -> dict[str, Any]:
    try:
        from moe_fp8.kernels.jit.cache import cache_info

        info = dict(cache_info())
        root = Path(info["dir"])
        failed = root / "failed"
        # the nearest existing ancestor decides whether the directory can be created and written
        probe = root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        from moe_fp8.kernels.tuning import describe_active

        return {"dir": str(info["dir"]), "entries": int(info["entries"]), "bytes": int(info["bytes"]),
                "failed": sum(1 for _ in failed.iterdir()) if failed.is_dir() else 0,
                "writable": probe.is_dir() and os.access(probe, os.W_OK | os.X_OK), "tuned": describe_active()}
    except Exception as exc:
        return {"error": _error(exc)}


def _probe_backends() -> dict[str, Any]:
    try:
        from moe_fp8.backends import available_backends

        return {"backends": {name: {"available": bool(ok), "reason": reason}
                             for name, (ok, reason) in available_backends().items()}}
    except Exception as exc:
        return {"error": _error(exc)}


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    old = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = old


def _probe_ops() -> dict[str, Any]:
    """The backend every registered op would run on now (default device), or the error a call would raise."""
    try:
        from moe_fp8 import backends

        device = backends._normalize_device(None)
        ops: dict[str, Any] = {}
        # selection logs a fallback once per process; the report states it here instead
        with _quiet_logger("moe_fp8"):
            for op in backends.known_ops():
                try:
                    ops[op] = {"backend": backends.select(op, device)[0], "error": None}
                except Exception as exc:
                    ops[op] = {"backend": None, "error": _error(exc)}
        return {"device": str(device), "ops": ops}
    except Exception as exc:
        return {"error": _error(exc)}


def collect_info() -> dict[str, Any]:
    """Everything ``moe-fp8 info`` reports, as a JSON-able dict (keys are the JSON output's keys)."""
    driver = _driver_query()
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "moe_fp8": _probe_moe_fp8,
        "python": _probe_python,
        "system": _probe_system,
        "torch": _probe_torch,
        "triton": _probe_triton,
        "cuda_bindings": lambda: {k: driver[k] for k in ("version", "driver_version", "error")},
        "packages": _probe_packages,
        "gpus": lambda: _probe_gpus(driver),
        "jit_compilers": _probe_compilers,
        "cache": _probe_cache,
        "backends": _probe_backends,
        "ops": _probe_ops,
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

    def section(title: str, data: dict[str, Any]) -> bool:
        """Start a section; False (after an 'unavailable' line) when collecting it failed."""
        add("")
        add(title)
        if data.get("error"):
            add(f"  unavailable: {data['error']}")
            return False
        return True

    pkg, py, tch, tri, cb = (info[k] for k in ("moe_fp8", "python", "torch", "triton", "cuda_bindings"))
    commit = f", commit {pkg['commit']}" if pkg.get("commit") else ""
    versions = {
        "moe_fp8": _or_error(pkg, "{} ({}{})".format(pkg.get("version") or "unknown version", pkg.get("path"), commit)),
        "python": _or_error(py, "{} ({})".format(py.get("version"), py.get("executable"))),
        "torch": _or_error(tch, "{} ({})".format(tch.get("version"), f"built with CUDA {tch['cuda']}" if tch.get("cuda") else "CPU-only build")),
        "triton": _or_error(tri, str(tri.get("version"))),
        "cuda-bindings": cb.get("version") or "not installed",
    }
    packages = info.get("packages") or {}
    if packages.get("error"):
        versions["packages"] = f"unavailable: {packages['error']}"
    else:
        versions.update({name: v or "not installed" for name, v in packages.items()})
    add("Versions")
    for name, text in versions.items():
        add(f"  {name:<18} {text}")

    system = info.get("system") or {}
    if section("System", system):
        add(f"  os                 {system.get('platform')}")
        add(f"  cpu                {system.get('machine')}, {system.get('cpus')} cores"
            + (f", {system['libc']}" if system.get("libc") else ""))

    gpus = info["gpus"]
    if section("GPUs", gpus):
        add(f"  driver         {cb.get('driver_version') or 'unavailable: {}'.format(cb.get('error'))}")
        if gpus.get("reason"):
            add(f"  no CUDA GPU visible: {gpus['reason']}")
        for d in gpus.get("devices", []):
            add(f"  [{d['index']}] {d['name']}  sm_{d['capability'].replace('.', '')}  "
                f"{d['sm_count']} SMs  {_fmt_bytes(d['memory_bytes'])}")
        if tch.get("arch_list"):
            add(f"  torch archs    {' '.join(tch['arch_list'])}")

    comp = info["jit_compilers"]
    if section("JIT compilers", comp):
        compilers = comp.get("compilers") or []
        if not compilers:
            add("  none found")
        width = max((len(c["version"] or "-") for c in compilers), default=1)
        for c in compilers:
            state = "available" if c["available"] else f"not available: {c['reason']}"
            add(f"  {c['name']:<10} {c['version'] or '-':<{width}}  {state}")
        if compilers and "selected" in comp:
            add(f"  selected   {comp['selected'] or 'none: ' + str(comp.get('selected_error'))}")

    cache = info["cache"]
    if section("JIT cache", cache):
        add(f"  dir            {cache['dir']}" + ("" if cache.get("writable", True) else "  (NOT WRITABLE)"))
        add(f"  entries        {cache['entries']} ({_fmt_bytes(cache['bytes'])})")
        if cache.get("failed"):
            add(f"  failed         {cache['failed']} (sources and logs in {Path(cache['dir']) / 'failed'})")
        add(f"  tuned configs  {cache.get('tuned')}")

    be = info["backends"]
    if section("Backends", be):
        for name, b in be["backends"].items():
            state = "available" if b["available"] else "not available"
            add(f"  {name:<10} {state}" + (f": {b['reason']}" if b["reason"] else ""))

    ops = info.get("ops") or {}
    if section(f"Ops (device {ops.get('device', '?')})", ops):
        for op, o in ops.get("ops", {}).items():
            add(f"  {op:<32} {o['backend'] or 'error: ' + str(o['error'])}")

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


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------

def _default_bench_dir() -> Path | None:
    """``docs/benchmarks`` of a source checkout (where records are committed); None when installed."""
    here = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    return here if here.is_dir() else None


def _shape_type(parse: Callable[[str], tuple[int, ...]]) -> Callable[[str], tuple[int, ...]]:
    # argparse hides a type function's ValueError text ("invalid value"); say what is wrong instead
    def convert(text: str) -> tuple[int, ...]:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"unsupported shape: {e}") from None
    convert.__name__ = "shape"
    return convert


def _add_bench_outputs(p: argparse.ArgumentParser, shape_help: str | None = None,
                       parse_shape: Callable[[str], tuple[int, ...]] | None = None) -> None:
    if shape_help is not None and parse_shape is not None:
        p.add_argument("--shapes", nargs="+", type=_shape_type(parse_shape), metavar=shape_help.split(" ")[0],
                       help=f"custom shapes, each {shape_help} (default: the DeepSeek-V3 table)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the DESIGN §7 record (all kinds) here")
    p.add_argument("--csv", type=Path, metavar="PATH", help="write one CSV line per row, with our speed-up")
    p.add_argument("--plot", type=Path, metavar="PNG", help="plot throughput per shape vs the ceilings "
                   "(needs matplotlib: pip install 'moe-fp8[plots]')")
    default = _default_bench_dir()
    p.add_argument("--out-dir", type=Path, default=default, metavar="DIR",
                   help="write <device>-<kind>.json records here (default: "
                        f"{'docs/benchmarks of this checkout' if default else 'none: installed package'})")
    p.add_argument("--no-record", action="store_true", help="do not write the per-kind records")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    try:
        from moe_fp8.benchmarks import KINDS, load_kind
    except Exception as exc:  # e.g. installed without the benchmarks folder: `info` must still work
        p.set_defaults(bench_broken=_error(exc), bench_kind="")
        return
    sub = p.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    for name in KINDS:
        try:
            kind = load_kind(name)
        except Exception as exc:  # a broken driver must not break the other commands' parser
            sp = sub.add_parser(name, help=f"(unavailable: {_error(exc)})")
            sp.set_defaults(bench_broken=_error(exc))
            continue
        sp = sub.add_parser(name, help=kind.help, description=kind.help)
        _add_bench_outputs(sp, kind.shape_help, kind.parse_shape)
        if kind.add_args is not None:
            kind.add_args(sp)
    sp = sub.add_parser("all", help=f"every kind ({', '.join(KINDS)}), default shapes, one record",
                        description="run every registered kind with its default shapes")
    _add_bench_outputs(sp)
    sp = sub.add_parser("plot", help="plot committed records (DESIGN §7 JSON) as a PNG",
                        description="plot one or more benchmark records (rows concatenated) without a GPU")
    sp.add_argument("records", nargs="+", type=Path, metavar="RECORD.json")
    sp.add_argument("--out", type=Path, required=True, metavar="PNG")
    sp.add_argument("--title", help="figure title (default: device · commit · date of the first record)")


def _check_creatable(path: Path, option: str, shown: Path) -> None:
    """``CliError`` unless the nearest existing ancestor of ``path`` is a writable folder (the writers create
    the missing folders below it)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise CliError(f"{option} {shown}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise CliError(f"{option} {shown}: {probe} is not writable")


def _check_output_file(path: Path, option: str) -> None:
    """``CliError`` when ``path`` cannot be written as a file; run it before the work whose result goes there."""
    if path.is_dir():
        raise CliError(f"{option} {path} is a directory; give a file path")
    _check_creatable(path.parent, option, path)


def _check_output_dir(path: Path, option: str) -> None:
    """``CliError`` when ``path`` cannot be (created as) a writable folder."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{option} {path} is not a directory")
    _check_creatable(path, option, path)


def _need_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("plotting needs matplotlib: pip install 'moe-fp8[plots]' (or pip install matplotlib)")


def _check_bench_device(op: str) -> str:
    """The backend that will run ``op``; ``CliError`` when there is no GPU or only the reference would."""
    import torch

    from moe_fp8 import backends

    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else "torch.cuda.is_available() is False")
        raise CliError(f"needs a CUDA GPU and none is visible ({why}); `moe-fp8 info` shows what torch and "
                       f"the driver see")
    device = backends._normalize_device(None)
    with _quiet_logger("moe_fp8"):
        name = backends.select(op, device)[0]  # BackendError when MOE_FP8_BACKEND forces one that cannot
    if name == "reference":
        gpu = torch.cuda.get_device_name(device)
        why = "; ".join(f"{b}: {r}" for b, ok, r in backends.explain(op, device) if b != "reference")
        raise CliError(f"moe_fp8's kernels cannot run {op} on {gpu} ({why}); the numbers would time the "
                       f"PyTorch reference. The hopper backend needs an sm_90 GPU (H100 / H200 / H20).")
    return name


def _bench_plot(args: argparse.Namespace) -> int:
    from moe_fp8.benchmarks.plot import plot_record
    from moe_fp8.benchmarks.report import load_record, merge_records

    _need_matplotlib()
    _check_output_file(args.out, "--out")
    try:
        record = merge_records([load_record(p) for p in args.records])
    except ValueError as e:
        raise CliError(str(e)) from None
    if not record.get("rows"):
        raise CliError(f"nothing to plot: {', '.join(map(str, args.records))} "
                       f"{'has' if len(args.records) == 1 else 'have'} no rows")
    print(f"wrote {plot_record(record, args.out, title=args.title)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_broken", None):
        what = " ".join(filter(None, ("bench", args.bench_kind)))
        raise CliError(f"{what} is unavailable: {args.bench_broken}")
    if args.bench_kind == "plot":
        return _bench_plot(args)

    from moe_fp8.benchmarks import KINDS, load_kind
    from moe_fp8.progress import Progress

    if args.plot is not None:
        _need_matplotlib()  # before the minutes of measuring, not after
    # every output path too: a typo must not cost the measurement
    for option, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path is not None:
            _check_output_file(path, option)
    if args.out_dir is not None and not args.no_record:
        _check_output_dir(args.out_dir, "--out-dir")
    kinds = [load_kind(n) for n in (KINDS if args.bench_kind == "all" else [args.bench_kind])]
    backend = {k.name: _check_bench_device(k.op) for k in kinds}

    from moe_fp8.benchmarks.harness import make_record, measure_ceilings, ratio_table, write_record
    from moe_fp8.benchmarks.report import chilled_view, write_csv

    plan = [(k, list(getattr(args, "shapes", None) or k.default_shapes())) for k in kinds]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    written: list[Path] = []
    with Progress(1 + sum(len(s) for _, s in plan), "bench", enabled=not args.no_progress) as progress:
        ceilings = measure_ceilings()
        progress.update(1, "ceilings (copy, FP8 and bf16 matmul)")
        for kind, shapes in plan:
            kind_rows, kind_notes = kind.run(shapes, args,
                                             lambda label, kind=kind: progress.update(1, f"{kind.name} {label}"))
            rows += kind_rows
            notes += kind_notes
            if args.out_dir is not None and not args.no_record:
                written.append(write_record(kind.name, kind_rows, ceilings, args.out_dir,
                                            extra={"backend": backend[kind.name]}))

    print(f"ceilings: {', '.join(f'{k} {v:g}' for k, v in ceilings.items())}")
    for kind in kinds:
        for row_kind, baselines in kind.tables.items():
            kind_rows = [r for r in rows if r["kind"] == row_kind]
            if kind_rows:
                print(f"\n## {row_kind} ({backend[kind.name]} backend; x B = B's time / ours)\n")
                print(ratio_table(kind_rows, "moe_fp8", baselines, metric=kind.metric))
                chilled = chilled_view(kind_rows)
                if chilled:
                    print(f"\n## {row_kind}, chilled (DeepGEMM's timing: an 8 GB memset before each call, kernel "
                          "durations from the profiler; x B = B's time / ours)\n")
                    print(ratio_table(chilled, "moe_fp8", baselines, metric=kind.metric))
    if notes:
        print("\n" + "\n".join(notes))
    record = make_record(rows, ceilings, extra={"backend": backend if len(backend) > 1 else backend[kinds[0].name]})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        written.append(args.json)
    if args.csv is not None:
        written.append(write_csv(rows, args.csv))
    if args.plot is not None:
        from moe_fp8.benchmarks.plot import plot_record

        written.append(plot_record(record, args.plot))
    for path in written:
        print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------

def _add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=("deepseek_v3", "kimi_k2", "qwen3_moe", "glm4_moe", "minimax_m2"),
                   default="deepseek_v3",
                   help="model type of the random checkpoint (default deepseek_v3)")
    p.add_argument("--layers", type=_positive_int, default=3, metavar="N",
                   help="decoder layers, the first dense and the others MoE (default 3)")
    p.add_argument("--tokens", type=_positive_int, default=16, metavar="N",
                   help="new tokens to generate per sequence (default 16)")
    p.add_argument("--batch", type=_positive_int, default=2, metavar="B", help="sequences (default 2)")
    p.add_argument("--prompt-len", type=_positive_int, default=16, metavar="N", help="prompt tokens (default 16)")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt (default 0)")
    p.add_argument("--save", type=Path, metavar="DIR",
                   help="keep the generated FP8 checkpoint in DIR (a new or empty folder)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from moe_fp8 import demo
    from moe_fp8.progress import Progress

    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {args.device}: no CUDA GPU is visible; use --device cpu (the PyTorch reference "
                       f"ops: slower, same numbers); `moe-fp8 info` shows what torch and the driver see")
    if args.save is not None:
        try:
            demo.check_save_dir(args.save)
        except ValueError as e:
            raise CliError(f"--save {e}") from None
    if importlib.util.find_spec("transformers") is None:
        raise CliError("the demo runs a transformers model (DeepseekV3ForCausalLM / Qwen3MoeForCausalLM / "
                       "Glm4MoeForCausalLM / MiniMaxM2ForCausalLM): "
                       "pip install 'moe-fp8[transformers]'")
    with Progress(5, "demo", enabled=not args.no_progress) as progress:
        report = demo.run_demo(layers=args.layers, tokens=args.tokens, batch=args.batch, prompt_len=args.prompt_len,
                               device=args.device, seed=args.seed, save=args.save, arch=args.arch,
                               on_phase=lambda name: progress.update(1, name))
    print(json.dumps(report, indent=2) if args.json else demo.format_report(report))
    return 0


# --------------------------------------------------------------------------------------------
# warmup
# --------------------------------------------------------------------------------------------

def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _add_warmup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, metavar="DIR",
                   help="Hugging Face model directory (its config.json; index for an FP8 lm_head)")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N", help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=_positive_int, default=1, metavar="N", help="expert-parallel ranks (default 1)")
    p.add_argument("--max-tokens", type=_positive_int, default=8192, metavar="T",
                   help="largest batch in tokens the engine sends (default 8192)")
    p.add_argument("--jobs", "-j", type=_positive_int, default=None, metavar="J",
                   help="compile processes (default: CPU count)")
    p.add_argument("--num-sms", type=_positive_int, default=None, metavar="N",
                   help="SMs the kernels will use (default: the visible GPU's, else $MOE_FP8_NUM_SMS, else 132)")
    p.add_argument("--compiler", choices=("nvcc", "nvrtc"), default=None,
                   help="JIT compiler (default: $MOE_FP8_JIT_COMPILER, else nvcc if found, else NVRTC); "
                        "must be the one the serving process uses, as it is part of the cache key")
    p.add_argument("--dry-run", action="store_true", help="list the variants (and which are cached); compile nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def cmd_warmup(args: argparse.Namespace) -> int:
    from moe_fp8 import warmup as W
    from moe_fp8.kernels.jit import cache_info, get_compiler, is_cached
    from moe_fp8.progress import Progress, format_seconds
    from moe_fp8.utils import get_num_sms

    cfg = W.load_model_config(args.model)
    gemms = W.model_gemms(cfg, args.tp, args.ep, fp8_lm_head=W.fp8_lm_head_in_checkpoint(args.model))
    try:
        # both read the environment (MOE_FP8_NUM_SMS, MOE_FP8_JIT_COMPILER) and raise ValueError naming it
        num_sms = args.num_sms or get_num_sms()
        comp = get_compiler(args.compiler)  # workers get its name: the same compiler, hence the same cache keys
    except ValueError as e:
        raise CliError(str(e)) from None
    tables = W.warmup_tables(num_sms)
    variants = W.enumerate_variants(gemms, args.max_tokens, num_sms, top_k=int(cfg.get("num_experts_per_tok") or 1),
                                    tables=tables)
    routing = W.routing_variants(cfg)
    quant = W.quant_variants(cfg)
    dispatch = W.dispatch_variants(cfg, args.ep)
    router = W.router_gemm_variants(cfg, num_sms)
    print(f"model     {args.model} ({cfg.get('model_type', 'unknown type')}): tp {args.tp}, ep {args.ep}, "
          f"up to {args.max_tokens} tokens, {num_sms} SMs, {comp.name} {comp.version}")
    if tables:
        print(f"tuned     with the picks of the tables shipped for {', '.join(t.device for t in tables)} (no GPU "
              f"visible to choose one; $MOE_FP8_TUNED_CONFIGS names one)")
    print(f"weights   {len(gemms)} GEMM shapes per rank → {len(variants)} kernel variants"
          f"{f', + {len(routing)} routing kernels' if routing else ''}, + {len(quant)} quantization kernels"
          f"{f', + {len(dispatch)} dispatch routing kernels' if dispatch else ''}"
          f"{f', + {len(router)} router GEMM kernels' if router else ''}")
    if args.dry_run:
        def state(v) -> str:
            return "cached" if is_cached(v.name, v.source, compiler=comp) else "to compile"

        for g in gemms:
            groups = f", {g.num_groups} experts" if g.num_groups > 1 else ""
            print(f"  {g.name:<34} {g.n}×{g.k}  {'/'.join(g.layouts)}{groups}")
        for v in variants:
            c = v.config
            tile = "few rows" if c is None else f"{c.block_m}x{c.block_n} s{c.num_stages}"
            print(f"  {v.name:<48} {tile:<11} {W.describe_rows(v):<22} "
                  f"{state(v):<10}  {', '.join(v.users)}")
        for r in routing:
            print(f"  {r.name:<48} {r.logits_dtype + ' logits':<33} {state(r):<10}  mlp.gate")
        for q in quant:
            print(f"  {q.name:<48} {'bfloat16, ' + q.scales + ' scales':<33} {state(q):<10}  {q.users}")
        for d in dispatch:
            print(f"  {d.name:<48} {d.layout + ' dispatch':<33} {state(d):<10}  mlp.experts")
        for r in router:
            print(f"  {r.name:<48} {f'{r.weight_dtype} weight, {r.tokens} tokens':<33} {state(r):<10}  mlp.gate")
        return 0
    variants = [*variants, *routing, *quant, *dispatch, *router]

    with Progress(len(variants), "warmup", enabled=not args.no_progress) as progress:
        def cached(n: int) -> None:
            if n:
                progress.update(n, f"{n} already cached")

        def done(name: str, error: str | None) -> None:
            progress.update(1, name if error is None else f"{name} FAILED")

        result = W.compile_variants(variants, args.jobs, comp.name, on_done=done, on_cached=cached)
    print(f"compiled  {result.compiled} in {format_seconds(result.wall_seconds)} wall "
          f"({result.jobs} jobs, {format_seconds(result.compile_seconds)} compile time); "
          f"{result.cached} already cached; {len(result.failed)} failed")
    info = cache_info()
    print(f"cache     {info['dir']}: {info['entries']} entries, {_fmt_bytes(info['bytes'])}")
    if result.failed:
        for name, message in result.failed:
            print(f"  {name}: {message.splitlines()[0]}", file=sys.stderr)
        raise CliError(f"{len(result.failed)} of {len(variants)} variants failed to compile (sources and logs "
                       f"are kept in the cache's failed/ folder named above); please report it with `moe-fp8 info`")
    return 0


# --------------------------------------------------------------------------------------------
# tune
# --------------------------------------------------------------------------------------------

_TUNE_SHAPES = {"normal": ("M", "N", "K"), "contiguous": ("G", "M_TOTAL", "N", "K"),
                "masked": ("G", "EXPECTED_M", "N", "K")}


def _tune_shape(text: str) -> tuple[str, tuple[int, ...]]:
    layout, _, rest = text.partition(":")
    fields = _TUNE_SHAPES.get(layout)
    values = rest.split(":")
    if fields is None or len(values) != len(fields) or not all(v.isdigit() and int(v) > 0 for v in values):
        forms = ", ".join(f"{name}:{':'.join(f)}" for name, f in _TUNE_SHAPES.items())
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {forms} (positive integers)")
    return layout, tuple(map(int, values))


def _layouts(text: str) -> tuple[str, ...]:
    names = tuple(t for t in text.split(",") if t)
    if not names or any(n not in _TUNE_SHAPES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(_TUNE_SHAPES)}")
    return names


def _add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, metavar="DIR", help="tune every GEMM of this model (its config.json)")
    p.add_argument("--shape", type=_tune_shape, action="append", default=[], metavar="SPEC",
                   help="tune one GEMM: normal:M:N:K, contiguous:G:M_TOTAL:N:K or masked:G:EXPECTED_M:N:K "
                        "(repeat for more; with --model, added to its GEMMs)")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N", help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=_positive_int, default=1, metavar="N", help="expert-parallel ranks (default 1)")
    p.add_argument("--max-tokens", type=_positive_int, default=4096, metavar="T",
                   help="largest batch in tokens the engine sends (default 4096)")
    p.add_argument("--layouts", type=_layouts, default=tuple(_TUNE_SHAPES), metavar="L,..",
                   help="with --model: which of normal, contiguous, masked to tune (default all)")
    p.add_argument("--limit", type=_positive_int, default=6, metavar="N",
                   help="the cost model's N cheapest tiles are timed besides the default (default 6)")
    p.add_argument("--reps", type=_positive_int, default=20, metavar="R",
                   help="timed calls per candidate (L2 flushed before each; default 20)")
    p.add_argument("--min-gain", type=float, default=None, metavar="F",
                   help="keep a tuned pick only if it beats the default by this fraction when re-timed "
                        "(default 0.02)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="table to update (default: this GPU's table in the JIT cache, which the kernels read "
                        "unless $MOE_FP8_TUNED_CONFIGS names another)")
    p.add_argument("--jobs", "-j", type=_positive_int, default=None, metavar="J",
                   help="compile processes (default: CPU count)")
    p.add_argument("--compiler", choices=("nvcc", "nvrtc"), default=None,
                   help="JIT compiler (default: $MOE_FP8_JIT_COMPILER, else nvcc if found, else NVRTC)")
    p.add_argument("--retune", action="store_true",
                   help="measure keys the table already holds again (default: skip them, so a run resumes)")
    p.add_argument("--dry-run", action="store_true", help="list what would be timed; no GPU needed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _tile(cfg: Any) -> str:
    extra = "".join(f" {flag}" for flag, on in (("tail-split", cfg.tail_split), ("k-split", cfg.k_split),
                                                 (f"a{cfg.a_box_rows}", cfg.a_box_rows)) if on)
    return f"{cfg.block_m}x{cfg.block_n} s{cfg.num_stages}{extra}"


def _describe_key(key: Any) -> str:
    if key.layout == "normal":
        return f"normal     M {key.m:>6}          {key.n}x{key.k}"
    if key.layout == "contiguous":
        hint = " 1-block" if key.expected_m else ""
        return f"contiguous M_total {key.m:>6} {key.num_groups:>3}g {key.n}x{key.k}{hint}"
    return f"masked     expected {key.expected_m:>5} {key.num_groups:>3}g {key.n}x{key.k}"


def cmd_tune(args: argparse.Namespace) -> int:
    import time

    from moe_fp8 import warmup as W
    from moe_fp8.benchmarks.report import geomean
    from moe_fp8.kernels import tuning
    from moe_fp8.kernels.heuristics import GemmDesc
    from moe_fp8.progress import Progress, format_seconds
    from moe_fp8.utils import get_num_sms

    if args.model is None and not args.shape:
        raise CliError("nothing to tune: give --model DIR and / or --shape SPEC")
    if args.min_gain is not None and not 0 <= args.min_gain < 1:
        raise CliError(f"--min-gain must be in [0, 1), got {args.min_gain}")
    try:
        num_sms = get_num_sms()
    except ValueError as e:
        raise CliError(str(e)) from None
    descs: list[GemmDesc] = []
    if args.model is not None:
        cfg = W.load_model_config(args.model)
        gemms = W.model_gemms(cfg, args.tp, args.ep, fp8_lm_head=W.fp8_lm_head_in_checkpoint(args.model))
        descs += tuning.model_descs(gemms, args.max_tokens, int(cfg.get("num_experts_per_tok") or 1), num_sms,
                                    args.layouts)
    for layout, v in args.shape:
        if layout == "normal":
            descs.append(GemmDesc(v[0], v[1], v[2], num_sms=num_sms))
        else:
            descs.append(GemmDesc(v[1], v[2], v[3], v[0], layout, num_sms, expected_m=v[1] if layout == "masked" else None))
    plan = tuning.plan(descs, args.limit)
    timed = sum(len(c) for c in plan.values())
    print(f"tune      {len(plan)} GEMM keys, {timed} configurations to time ({num_sms} SMs)")
    if args.dry_run:
        for key, configs in plan.items():
            print(f"  {_describe_key(key):<52} default {_tile(configs[0]):<22} {len(configs)} candidates")
        return 0

    import torch

    if not torch.cuda.is_available():
        raise CliError("tuning times kernels on the GPU: no CUDA device is visible (--dry-run lists the work)")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        raise CliError(f"tuning times the Hopper (sm_90a) kernels; this GPU is sm_{major}{minor}")
    device = torch.cuda.get_device_name()
    path = args.out or tuning.default_path(device)
    try:
        table = tuning.TunedTable.load(path) if path.exists() else tuning.new_table()
    except tuning.TunedTableError as e:
        raise CliError(f"{e}\n  fix: remove it, or pass another --out") from None
    if (table.device, table.num_sms) != (device, num_sms):
        raise CliError(f"{path} holds {table.device} ({table.num_sms} SMs), this is {device} ({num_sms} SMs): "
                       f"pass another --out")
    done_keys = set() if args.retune else set(plan) & set(table.results)
    plan = {key: configs for key, configs in plan.items() if key not in done_keys}
    print(f"device    {device}; table {path} ({len(table.results)} keys already"
          + (f"; {len(done_keys)} of them skipped, --retune measures them again" if done_keys else "") + ")")
    print("compiling the candidates, then timing them (a key's line when all of its are timed)", flush=True)
    improved: list[float] = []
    lines: list[str] = []
    t0 = time.perf_counter()
    with Progress(len(plan), "tune", enabled=not args.no_progress) as progress:
        def done(r: tuning.TuneResult) -> None:
            table.update([r])
            table.save(path)  # an interrupted run keeps what it measured
            what = "kept"
            if r.config != r.default:
                improved.append(r.gain)
                what = f"{_tile(r.config)} {r.us:.1f} us ({r.gain:+.1%})"
            lines.append(f"  {_describe_key(r.key):<52} {_tile(r.default):<22} {r.default_us:8.1f} us  {what}")
            progress.update(1, _describe_key(r.key))

        tuning.tune(plan, reps=args.reps,
                    min_gain=tuning.MIN_GAIN if args.min_gain is None else args.min_gain, jobs=args.jobs,
                    compiler=args.compiler, on_result=done)
    print(f"  {'GEMM':<52} {'default':<22} {'time':>11}  tuned")
    print("\n".join(lines))
    tuning.reset()
    gain = f"; geomean gain on those {geomean([1 + g for g in improved]) - 1:+.1%}" if improved else ""
    print(f"tuned     {len(plan)} keys in {format_seconds(time.perf_counter() - t0)}: {len(improved)} faster than "
          f"the cost model's pick{gain}")
    env = os.environ.get(tuning.ENV_TABLE)
    if args.out is None and env is None:
        print(f"table     {path}: read by every process on this GPU (${tuning.ENV_TABLE}=off to ignore it)")
    else:
        print(f"table     {path}: export {tuning.ENV_TABLE}={path} to use it")
    return 0


# --------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------

def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, not {device.type}")
    return text


def _add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", type=Path, metavar="SRC", help="bf16 Hugging Face checkpoint directory (safetensors)")
    p.add_argument("dst", type=Path, metavar="DST",
                   help="output directory (created; must be missing or empty, unless --overwrite)")
    # one pattern per flag: nargs="+" would swallow SRC and DST after `--skip PATTERN`
    p.add_argument("--skip", action="append", default=None, metavar="PATTERN",
                   help="keep tensors whose name matches this regular expression as they are; one pattern per "
                        "--skip, repeat it for more (--skip 'o_proj' --skip 'experts\\.0\\.')")
    p.add_argument("--device", type=_device, default=None,
                   help="where to quantize: cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty DST (its old contents are removed once the new output is complete)")
    p.add_argument("--report", type=Path, metavar="CSV", help="write the per-tensor table (all tensors) as CSV")
    p.add_argument("--top", type=_non_negative_int, default=30, metavar="N",
                   help="with more than 2N tensors, show the N largest errors and a count per kept reason "
                        "(default 30)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _format_quantize(result: Any, top: int) -> str:
    from moe_fp8.convert import TensorReport

    def line(t: TensorReport) -> str:
        shape = "×".join(map(str, t.shape)) or "scalar"
        state = f"fp8   {t.diff:.2e}" if t.quantized else f"kept  {t.dtype} ({t.reason})"
        return f"  {t.name:<60} {shape:>14}  {state}"

    lines = [f"  {'tensor':<60} {'shape':>14}  action / diff (calc_diff of dequantized vs original)"]
    fp8 = result.quantized
    if len(result.tensors) <= 2 * top:
        lines += [line(t) for t in result.tensors]
    else:
        worst = sorted(fp8, key=lambda t: -(t.diff or 0))[:top]
        lines += [line(t) for t in worst]
        lines.append(f"  ... {len(fp8) - len(worst)} more FP8 tensors (--report CSV lists every tensor)")
        reasons: dict[str, int] = {}
        for t in result.kept:
            reasons[t.reason] = reasons.get(t.reason, 0) + 1
        lines += [f"  kept: {n} × {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    diffs = [t.diff for t in fp8 if t.diff is not None]
    bytes_in = sum(t.bytes_in for t in result.tensors)
    bytes_out = sum(t.bytes_out for t in result.tensors)
    weighted = (sum(t.diff * t.bytes_in for t in fp8) / sum(t.bytes_in for t in fp8)) if fp8 else 0.0
    lines.append("")
    lines.append(f"FP8       {len(fp8)} tensors; diff max {max(diffs, default=0):.2e}, "
                 f"mean {sum(diffs) / len(diffs) if diffs else 0:.2e}, size-weighted {weighted:.2e}")
    lines.append(f"kept      {len(result.kept)} tensors as they were")
    lines.append(f"size      {_fmt_bytes(bytes_in)} → {_fmt_bytes(bytes_out)} in {len(result.shards)} shard(s), "
                 f"{result.seconds:.1f} s")
    if result.ignored_layers:
        lines.append(f"bf16 linears listed in quantization_config.ignored_layers: {len(result.ignored_layers)}")
    lines.append(f"copied    {len(result.copied)} other file(s)"
                 + (f"; not copied (other weight formats): {', '.join(result.not_copied)}" if result.not_copied else ""))
    return "\n".join(lines)


def cmd_quantize(args: argparse.Namespace) -> int:
    import csv

    import torch

    from moe_fp8.convert import quantize_checkpoint
    from moe_fp8.progress import Progress

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CliError(f"--device {device}: no CUDA GPU is visible; use --device cpu (slower, same result)")
    if args.report is not None:
        _check_output_file(args.report, "--report")  # before the conversion, not after it
    progress = Progress(0, "quantize", enabled=not args.no_progress)

    def total(n: int) -> None:
        progress.total = n

    with progress:
        result = quantize_checkpoint(args.src, args.dst, args.skip or [], device=device, overwrite=args.overwrite,
                                     on_total=total, on_tensor=lambda t: progress.update(1, t.name))
    print(_format_quantize(result, args.top))
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        with args.report.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["name", "shard", "shape", "dtype", "action", "diff", "reason", "bytes_in", "bytes_out"])
            for t in result.tensors:
                w.writerow([t.name, t.shard, "x".join(map(str, t.shape)), t.dtype, "fp8" if t.quantized else "kept",
                            "" if t.diff is None else f"{t.diff:.3e}", t.reason, t.bytes_in, t.bytes_out])
        print(f"wrote {args.report}")
    print(f"wrote {args.dst}")
    return 0


# --------------------------------------------------------------------------------------------
# errors → one message with the fix
# --------------------------------------------------------------------------------------------

def explain_error(exc: BaseException) -> str | None:
    """The message for an error the user can act on, or None for a bug (which keeps its traceback)."""
    if isinstance(exc, CliError):
        return str(exc)
    try:
        from moe_fp8.backends import BackendError
        from moe_fp8.convert import CheckpointError
        from moe_fp8.kernels.jit import (
            CompilerNotFoundError,
            CudaError,
            CudaUnavailableError,
            JitCacheError,
            JitCompileError,
        )
        from moe_fp8.kernels.tuning import TunedTableError, TuneError
        from moe_fp8.warmup import ModelConfigError
    except Exception:  # a half-written package: nothing more specific to say
        return None
    if isinstance(exc, JitCompileError):
        first = str(exc).splitlines()[0]
        # compiler diagnostics ("kernel.cu(3): error: ...", "ptxas error   : ..."), not the summary lines
        errors = [ln.strip() for ln in (exc.log or "").splitlines()
                  if re.search(r"\b(error|fatal)\s*:", ln, re.IGNORECASE)][:5]
        detail = "".join(f"\n  {ln}" for ln in errors)
        where = f"\n  source and full log: {exc.path}" if exc.path else ""
        return f"{first}{detail}{where}\n  please report it with the output of `moe-fp8 info`"
    if isinstance(exc, CompilerNotFoundError):
        return (f"{exc}\n  fix: pip install nvidia-cuda-nvrtc (no CUDA toolkit needed), or install the CUDA "
                f"toolkit and set CUDA_HOME; `moe-fp8 info` lists what was found")
    if isinstance(exc, CudaUnavailableError):
        return f"{exc}: this needs an NVIDIA GPU and driver; `moe-fp8 info` shows what is visible"
    if isinstance(exc, BackendError):
        return f"{exc}\n  fix: unset MOE_FP8_BACKEND / MOE_FP8_STRICT, or see `moe-fp8 info` for why a backend is missing"
    if isinstance(exc, (JitCacheError, CheckpointError, ModelConfigError, CudaError, TunedTableError, TuneError)):
        return str(exc)
    from moe_fp8.demo import DemoError

    if isinstance(exc, DemoError):
        return f"{exc}\n  this is a bug: please report it with the output of `moe-fp8 info`"
    return None


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "info": Command("versions, GPUs, JIT compilers, cache and backends (paste into bug reports)",
                    _add_info_args, cmd_info),
    "demo": Command("run a small DeepSeek-V3 (Kimi-K2, Qwen3-MoE, GLM-4.5, MiniMax-M2) on moe_fp8's layers: tokens/s, backend, logit error "
                    "vs bf16",
                    _add_demo_args, cmd_demo),
    "bench": Command("time our kernels against torch baselines; tables, JSON / CSV records, plots",
                     _add_bench_args, cmd_bench),
    "warmup": Command("precompile every kernel variant a model needs into the JIT cache (no GPU needed)",
                      _add_warmup_args, cmd_warmup),
    "tune": Command("time the best kernel configurations of a model's GEMMs on this GPU; keep the fastest",
                    _add_tune_args, cmd_tune),
    "quantize": Command("convert a bf16 Hugging Face checkpoint to DeepSeek-style block FP8",
                        _add_quantize_args, cmd_quantize),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-fp8", description="block-FP8 GEMM / MoE kernels for Hopper")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.add_args(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print(f"moe-fp8 {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `moe-fp8 warmup --dry-run | head`: the reader is gone; without this, Python reports the
        # pipe again while flushing stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        message = explain_error(exc)
        if message is None:
            raise
        print(f"moe-fp8 {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
