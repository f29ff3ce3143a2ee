"""Benchmark records (DESIGN §7) after the fact: load, group by shape, ratios, CSV, roofline class.

Pure Python (no torch, no GPU): ``moe-fp8 bench plot`` and the tests use it on committed records.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

__all__ = ["OURS", "chilled_view", "device_slug", "geomean", "group_by_shape", "load_record", "memory_bound",
           "merge_records", "shape_label", "speedups", "write_csv"]

OURS = "moe_fp8"
Row = dict[str, Any]


def load_record(path: Path) -> dict[str, Any]:
    """Read a record and check the fields every consumer relies on (``ValueError`` says what is wrong)."""
    try:
        record = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read benchmark record {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise ValueError(f"{path} is not a benchmark record (DESIGN §7: an object with a 'rows' list)")
    for i, r in enumerate(record["rows"]):
        if not isinstance(r, dict) or not {"kind", "shape", "impl", "us"} <= set(r):
            raise ValueError(f"{path}: row {i} lacks kind / shape / impl / us")
    record.setdefault("ceilings", {})
    return record


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200' (file names of docs/benchmarks)."""
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower())).lower()


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of several (e.g. gemm + grouped): rows concatenated, header fields from the first."""
    if not records:
        raise ValueError("no records to merge")
    merged = {k: v for k, v in records[0].items() if k != "rows"}
    merged["rows"] = [r for rec in records for r in rec["rows"]]
    return merged


def shape_label(shape: dict[str, int]) -> str:
    """``{'m': 64, 'n': 2112, 'k': 7168}`` → ``'64×2112×7168'`` (the ratio tables' spelling)."""
    return "×".join(str(v) for v in shape.values())


def group_by_shape(rows: list[Row], kind: str | None = None) -> dict[str, dict[str, Row]]:
    """``{shape key: {impl: row}}`` in first-seen order, for one row kind (or all)."""
    out: dict[str, dict[str, Row]] = {}
    for r in rows:
        if kind is None or r["kind"] == kind:
            out.setdefault(r["kind"] + json.dumps(r["shape"]), {})[r["impl"]] = r
    return out


def speedups(rows: list[Row], ours: str = OURS) -> list[float | None]:
    """Per row: baseline time / our time on the same kind and shape (>1: we are faster); None for
    our own rows and for rows without a matching ``ours`` row."""
    ours_us = {(r["kind"], json.dumps(r["shape"])): r["us"] for r in rows if r["impl"] == ours}
    out: list[float | None] = []
    for r in rows:
        mine = ours_us.get((r["kind"], json.dumps(r["shape"])))
        out.append(None if r["impl"] == ours or not mine or not r["us"] else round(r["us"] / mine, 3))
    return out


def write_csv(rows: list[Row], path: Path, ours: str = OURS) -> Path:
    """One line per row: kind, every shape key (union over rows), impl, us, tflops, gbps and
    ``moe_fp8_speedup`` (this baseline's time / ours: how many times faster moe_fp8 is)."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["shape"] if k not in keys]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", *keys, "impl", "us", "tflops", "gbps", f"{ours}_speedup"])
        for r, x in zip(rows, speedups(rows, ours), strict=True):
            w.writerow([r["kind"], *(r["shape"].get(k, "") for k in keys), r["impl"], r["us"],
                        "" if r.get("tflops") is None else r["tflops"],
                        "" if r.get("gbps") is None else r["gbps"], "" if x is None else x])
    return path


def memory_bound(row: Row, ceilings: dict[str, float]) -> bool:
    """Roofline class of a shape: its arithmetic intensity (FLOP per byte moved, from the row's own
    TFLOPS / GB/s) below the ridge point of the measured ceilings (FP8 per-tensor TFLOPS / copy GB/s,
    ~410 FLOP/B on an H100) means memory-bound. Rows without FLOPs (copies, routing) are memory-bound."""
    tflops, gbps = row.get("tflops"), row.get("gbps")
    if not tflops or not gbps:
        return True
    peak, bw = ceilings.get("fp8_pertensor_tflops"), ceilings.get("copy_gbps")
    ridge = peak * 1e3 / bw if peak and bw else 400.0  # FLOP/B; 400 when the record has no ceilings
    return tflops * 1e3 / gbps < ridge


def chilled_view(rows: list[Row]) -> list[Row]:
    """The rows that carry a chilled timing (``harness.bench_chilled_us``), with it as their
    ``us`` / ``tflops`` / ``gbps``: the ratio tables and speed-ups of DeepGEMM's timing method."""
    return [{**{k: v for k, v in r.items() if not k.startswith("chilled_")},
             "us": r["chilled_us"], "tflops": r.get("chilled_tflops"), "gbps": r.get("chilled_gbps")}
            for r in rows if r.get("chilled_us") is not None]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
