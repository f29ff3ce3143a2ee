"""The wheel must contain every package folder and the kernel headers (JIT compiles at run time)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapped = {v: k for k, v in cfg["package-dir"].items()}
    found = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("tests", "build") or any(p.startswith(".") for p in rel.parts):
            continue
        top = rel.parts[0]
        prefix = mapped.get(top, top)
        found.add(".".join([prefix, *rel.parts[1:]]))
    assert found == listed, f"missing {sorted(found - listed)}, stale {sorted(listed - found)}"


def test_headers_are_package_data() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "include/**/*.cuh" in cfg["moe_fp8.kernels"]
    assert list((ROOT / "moe_fp8" / "kernels" / "include").glob("**/*.cuh"))
