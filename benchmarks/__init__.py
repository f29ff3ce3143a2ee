"""Benchmark drivers behind ``moe-fp8 bench`` (installed as ``moe_fp8.benchmarks``).

Each kind of benchmark is one module that defines ``KIND = BenchKind(...)`` and one line in
``KINDS`` below; ``moe-fp8 bench <kind>`` then gets its own sub-command with the shared options
(``--shapes``, ``--json``, ``--csv``, ``--plot``, ``--out-dir``), a progress bar, ratio tables and
the DESIGN §7 record, and ``moe-fp8 bench all`` runs it with the others. Adding a kind::

    # benchmarks/quant.py
    KIND = BenchKind(
        name="quant", help="activation quantization vs a copy of the same bytes",
        tables={"quant": ("torch_copy",)},   # row kind -> baselines
        default_shapes=lambda: [(4096, 7168), (64, 7168)],
        parse_shape=lambda text: parse_ints(text, 2, "T,H"), shape_help="T,H",
        run=run,   # run(shapes, args, step) -> (rows, notes); call step(label) after each shape
        metric="gbps", op="per_token_group_quant",
    )
    # benchmarks/__init__.py
    KINDS["quant"] = "moe_fp8.benchmarks.quant:KIND"

This module imports nothing heavy: the kind modules load when a benchmark runs (or its parser is
built), so a broken driver cannot take ``moe-fp8 info`` down with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["KINDS", "BenchKind", "Shape", "Step", "load_kind", "parse_ints"]

Shape = tuple[int, ...]
Step = Callable[[str], None]
Rows = list[dict[str, Any]]

# name -> "module:attribute" of its BenchKind, in the order `bench all` runs them.
KINDS: dict[str, str] = {
    "gemm": "moe_fp8.benchmarks.gemm:KIND",
    "grouped": "moe_fp8.benchmarks.grouped:KIND",
    "moe-data": "moe_fp8.benchmarks.moe_data:KIND",
    "moe": "moe_fp8.benchmarks.moe:KIND",
}


@dataclasses.dataclass(frozen=True)
class BenchKind:
    """One ``moe-fp8 bench`` kind.

    ``run(shapes, args, step)`` times every implementation on every shape and returns
    ``(rows, notes)``: DESIGN §7 rows (``harness.row``) and free-text lines printed after the
    tables; it calls ``step(label)`` once per shape (the progress bar). ``tables`` maps each row
    ``kind`` the driver emits to the baselines shown as ratio columns (ours is ``moe_fp8``);
    ``metric`` is the throughput column of those tables. ``op`` names the public op whose backend
    must not be the PyTorch reference for the numbers to mean anything. ``add_args`` adds the kind's
    own options (they arrive in ``args``).
    """

    name: str
    help: str
    tables: dict[str, tuple[str, ...]]
    default_shapes: Callable[[], list[Shape]]
    parse_shape: Callable[[str], Shape]
    shape_help: str
    run: Callable[[list[Shape], argparse.Namespace, Step], tuple[Rows, list[str]]]
    metric: str = "tflops"
    op: str = "fp8_gemm"
    add_args: Callable[[argparse.ArgumentParser], None] | None = None


def load_kind(name: str) -> BenchKind:
    """Import and return the ``BenchKind`` registered as ``name``."""
    module, _, attr = KINDS[name].partition(":")
    kind = getattr(importlib.import_module(module), attr)
    if not isinstance(kind, BenchKind):
        raise TypeError(f"{KINDS[name]} is not a BenchKind")
    return kind


def parse_ints(text: str, counts: int | tuple[int, ...], spec: str) -> Shape:
    """``'64,2112,7168'`` → ``(64, 2112, 7168)``; the count must be one of ``counts`` (``spec`` names them)."""
    allowed = (counts,) if isinstance(counts, int) else counts
    try:
        values = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise ValueError(f"shape {text!r} is not {spec} (comma-separated integers)") from None
    if len(values) not in allowed or any(v <= 0 for v in values):
        raise ValueError(f"shape {text!r} is not {spec} (positive integers)")
    return values
