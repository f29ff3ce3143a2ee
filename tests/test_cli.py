"""`moe-fp8` command: `info` runs everywhere (no GPU, no driver, half-built package) and exits 0."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import moe_fp8
from moe_fp8 import cli

SECTIONS = ("Versions", "System", "GPUs", "JIT compilers", "JIT cache", "Backends", "Environment")
JSON_KEYS = {"moe_fp8", "python", "system", "torch", "triton", "cuda_bindings", "packages", "gpus",
             "jit_compilers", "cache", "backends", "ops", "env"}
ENV_VARS = {"MOE_FP8_BACKEND", "MOE_FP8_STRICT", "MOE_FP8_CACHE_DIR", "MOE_FP8_JIT_COMPILER",
            "MOE_FP8_JIT_DEBUG", "MOE_FP8_NUM_SMS", "MOE_FP8_GEMM_DEFINES", "MOE_FP8_PDL", "MOE_FP8_TUNED_CONFIGS",
            "MOE_FP8_ROUTING_EXACT",
            "MOE_FP8_CUDA_ROUTE",
            "MOE_FP8_TRITON_FAST_LAUNCH", "MOE_FP8_COMMIT", "TRITON_INTERPRET",
            "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES"}
PACKAGE_DIR = os.path.abspath(next(iter(moe_fp8.__path__)))


def _run_info(capsys, *extra: str) -> str:
    rc = cli.main(["info", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out


def _check_json(info: dict) -> None:
    assert set(info) == JSON_KEYS
    assert info["python"]["version"] == platform.python_version()
    assert info["torch"]["version"] == torch.__version__
    assert info["torch"]["cuda"] == torch.version.cuda
    assert info["moe_fp8"]["path"] == PACKAGE_DIR
    assert set(info["env"]) == ENV_VARS
    gpus = info["gpus"]
    assert isinstance(gpus["devices"], list)
    # Either devices are listed or the report says why none is visible.
    assert gpus["devices"] or gpus["reason"]
    for d in gpus["devices"]:
        assert {"index", "name", "capability", "sm_count", "memory_bytes"} <= set(d)
    for key in ("jit_compilers", "cache", "backends"):
        assert isinstance(info[key], dict)
    if "error" not in info["jit_compilers"]:
        for c in info["jit_compilers"]["compilers"]:
            assert set(c) == {"name", "version", "available", "reason"}
    if "error" not in info["cache"]:
        assert set(info["cache"]) == {"dir", "entries", "bytes", "failed", "writable", "tuned"}
        assert info["cache"]["tuned"] == "off ($MOE_FP8_TUNED_CONFIGS=off)"  # tests run without tables
    if "error" not in info["backends"]:
        assert "reference" in info["backends"]["backends"]
    assert {"platform", "machine", "cpus", "libc"} <= set(info["system"])
    assert "safetensors" in info["packages"] and "nvidia-cuda-nvrtc" in info["packages"]
    if "error" not in info["ops"]:
        assert info["ops"]["ops"]["fp8_gemm"]["backend"] in ("hopper", "portable", "reference")


def test_info_text(capsys, monkeypatch):
    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    monkeypatch.delenv("MOE_FP8_CACHE_DIR", raising=False)
    out = _run_info(capsys)
    lines = out.splitlines()
    for title in SECTIONS:
        assert title in lines, f"section {title!r} missing from:\n{out}"
    for name in ENV_VARS:
        assert name in out
    assert any(line.split() == ["MOE_FP8_STRICT", "1"] for line in lines)
    assert any(line.split() == ["MOE_FP8_CACHE_DIR", "(unset)"] for line in lines)
    assert torch.__version__ in out
    assert PACKAGE_DIR in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU visible: " in out


def test_info_json(capsys, monkeypatch):
    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    info = json.loads(_run_info(capsys, "--json"))
    _check_json(info)
    assert info["env"]["MOE_FP8_STRICT"] == "1"
    if not torch.cuda.is_available():
        assert info["gpus"]["reason"]


def _fake_module(monkeypatch, name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)


def _fake_probes(monkeypatch) -> None:
    compilers = [
        types.SimpleNamespace(name="nvrtc", version="13.0", available=True, reason=None),
        types.SimpleNamespace(name="nvcc", version=None, available=False, reason="nvcc not found on PATH"),
    ]
    _fake_module(monkeypatch, "moe_fp8.kernels.jit.compiler", find_compilers=lambda: compilers)
    _fake_module(monkeypatch, "moe_fp8.kernels.jit.cache",
                 cache_info=lambda: {"dir": "/tmp/fake-cache", "entries": 3, "bytes": 3 * 2**20})
    _fake_module(monkeypatch, "moe_fp8.backends", available_backends=lambda: {
        "hopper": (False, "no sm_90 GPU"), "portable": (False, "triton not installed"),
        "reference": (True, "")})


def test_info_reports_probe_results(capsys, monkeypatch):
    _fake_probes(monkeypatch)
    out = _run_info(capsys)
    lines = [line.split() for line in out.splitlines()]
    assert ["nvrtc", "13.0", "available"] in lines
    assert ["nvcc", "-", "not", "available:", "nvcc", "not", "found", "on", "PATH"] in lines
    assert ["dir", "/tmp/fake-cache"] in lines
    assert ["entries", "3", "(3.0", "MiB)"] in lines
    assert ["hopper", "not", "available:", "no", "sm_90", "GPU"] in lines
    assert ["reference", "available"] in lines

    info = json.loads(_run_info(capsys, "--json"))
    _check_json(info)
    assert info["jit_compilers"]["compilers"][1] == {
        "name": "nvcc", "version": None, "available": False, "reason": "nvcc not found on PATH"}
    assert {k: info["cache"][k] for k in ("dir", "entries", "bytes")} == {
        "dir": "/tmp/fake-cache", "entries": 3, "bytes": 3 * 2**20}
    assert info["backends"]["backends"]["portable"] == {"available": False, "reason": "triton not installed"}


def test_info_survives_failing_probes(capsys, monkeypatch):
    def boom():
        raise RuntimeError("boom")

    _fake_module(monkeypatch, "moe_fp8.kernels.jit.compiler", find_compilers=boom)
    _fake_module(monkeypatch, "moe_fp8.kernels.jit.cache", cache_info=boom)
    _fake_module(monkeypatch, "moe_fp8.backends", available_backends=boom)
    monkeypatch.setattr(cli, "_probe_triton", boom)  # a bug in a probe itself
    out = _run_info(capsys)
    assert out.count("unavailable: RuntimeError: boom") == 4
    info = json.loads(_run_info(capsys, "--json"))
    for key in ("jit_compilers", "cache", "backends", "triton"):
        assert info[key] == {"error": "RuntimeError: boom"}


def test_info_lists_gpus(capsys, monkeypatch):
    _fake_probes(monkeypatch)
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0,
                                  multi_processor_count=132, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    out = _run_info(capsys)
    assert "  [0] NVIDIA H100 80GB HBM3  sm_90  132 SMs  80.0 GiB" in out.splitlines()
    assert "no CUDA GPU visible" not in out
    info = json.loads(_run_info(capsys, "--json"))
    assert info["gpus"]["reason"] is None
    assert info["gpus"]["devices"] == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
                                        "sm_count": 132, "memory_bytes": 80 * 2**30}]


def test_parser_rejects_bad_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def _subprocess_env() -> dict[str, str]:
    # Make the package importable the same way it is here, installed or not.
    env = dict(os.environ)
    root = str(Path(PACKAGE_DIR).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def test_console_script():
    # The script that belongs to this interpreter's environment (pip puts it beside python);
    # without an install, the module form runs the same main().
    script = shutil.which("moe-fp8", path=os.path.dirname(sys.executable))
    cmd = [script] if script else [sys.executable, "-m", "moe_fp8.cli"]
    proc = subprocess.run([*cmd, "info", "--json"], capture_output=True, text=True, timeout=300,
                          env=_subprocess_env())
    assert proc.returncode == 0, proc.stderr
    _check_json(json.loads(proc.stdout))


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "moe_fp8", "info"], capture_output=True, text=True,
                          timeout=300, env=_subprocess_env())
    assert proc.returncode == 0, proc.stderr
    for title in SECTIONS:
        assert title in proc.stdout.splitlines()


def test_bench_refuses_without_gpu(capsys, monkeypatch) -> None:
    import torch

    from moe_fp8 import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "gemm"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-fp8 bench: error: needs a CUDA GPU") and "Traceback" not in err


def test_bench_rejects_unknown_kind() -> None:
    import pytest

    from moe_fp8 import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "nonsense"])


def test_every_env_var_the_code_reads_is_reported_and_documented():
    """Each MOE_FP8_* name in the package's Python sources is in `moe-fp8 info` and in README's table."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = set()
    for folder in ("moe_fp8", "benchmarks", "integrations"):
        for path in (root / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](MOE_FP8_[A-Z0-9_]+)[\"']", path.read_text()))
    assert {"MOE_FP8_BACKEND", "MOE_FP8_CACHE_DIR", "MOE_FP8_GEMM_DEFINES"} <= names
    readme = (root / "README.md").read_text()
    table = readme[readme.index("## Environment variables"):]
    table = table[:table.index("\n## ", 1)]
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", table, re.MULTILINE))
    assert names <= set(cli.ENV_VARS), names - set(cli.ENV_VARS)
    assert names <= documented, names - documented
    assert documented <= set(cli.ENV_VARS), documented - set(cli.ENV_VARS)


def test_info_counts_only_published_kernel_entries(tmp_path, capsys, monkeypatch):
    """Only folders the cache published count as entries (and their bytes): not a virtualenv or anything else
    kept in the cache directory, not a half-built temporary folder; and the cache never deletes such folders."""
    from moe_fp8.kernels.jit import cache

    root = tmp_path / "cache"
    entry = root / "fp8_gemm_x-0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "kernel.cubin").write_bytes(b"\0" * 1000)
    (entry / "meta.json").write_text("{}")
    (root / "route_y-fedcba9876543210").mkdir()  # no meta.json: not published
    (root / ".tmp-fp8_gemm_z-0000000000000000-abc").mkdir()
    (root / "locks").mkdir()
    (root / "failed").mkdir()
    (root / "compile-journal.log").write_text("one line\n")
    venv = root / "engine-venvs" / "vllm-0.32.0"
    venv.mkdir(parents=True)
    (venv / "blob").write_bytes(b"\0" * 5_000_000)
    (venv / "meta.json").write_text("{}")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(root))

    info = cache.cache_info()
    assert info["entries"] == 1 and 1000 < info["bytes"] < 10_000
    out = _run_info(capsys)
    assert any(ln.split()[:2] == ["entries", "1"] for ln in out.splitlines())
    with pytest.raises(ValueError, match="not a JIT cache entry folder"):
        cache._remove_dir(root / "engine-venvs")
    assert (venv / "blob").is_file()


def test_engine_venvs_live_outside_the_jit_cache():
    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "engine_check.sh").read_text()
    assert "$HOME/.cache/moe_fp8-engine-venvs/$engine-$version" in script
    assert "moe_fp8/engine-venvs" not in script
