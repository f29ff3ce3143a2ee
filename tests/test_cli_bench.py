"""`moe-fp8 bench`: kind registry, shape parsing, the report pipeline (tables, JSON, CSV, plot) on a
fake kind, plots of the committed records, and the clear refusals without a (Hopper) GPU.

The real drivers need a GPU; everything around them runs here on the CPU.
"""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from moe_fp8 import backends, cli
from moe_fp8 import benchmarks as B
from moe_fp8.benchmarks import harness, report

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
RECORDS = [DOCS / "h100-gemm.json", DOCS / "h100-grouped.json"]
needs_matplotlib = pytest.mark.skipif(
    __import__("importlib").util.find_spec("matplotlib") is None, reason="matplotlib not installed (extra 'plots')")


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --------------------------------------------------------------------------------------------
# registry and shapes
# --------------------------------------------------------------------------------------------

def test_every_registered_kind_loads_and_parses_its_own_shapes():
    assert list(B.KINDS)[:2] == ["gemm", "grouped"]
    for name in B.KINDS:
        kind = B.load_kind(name)
        assert kind.name == name and kind.tables and kind.help
        for shape in kind.default_shapes():
            assert kind.parse_shape(",".join(map(str, shape))) == tuple(shape)


@pytest.mark.parametrize("argv,message", [
    (["bench", "gemm", "--shapes", "64,100,7168"], "unsupported shape: shape '64,100,7168': N must be a multiple of 8"),
    (["bench", "gemm", "--shapes", "64,2112"], "is not M,N,K"),
    (["bench", "grouped", "--shapes", "4,64,128,4096,7168"], "expected M (128) exceeds MAX_M (64)"),
    (["bench", "grouped", "--shapes", "4,8192"], "is not G,M,N,K (contiguous) or G,MAX_M,M,N,K (masked)"),
    (["bench", "all", "--shapes", "64,2112,7168"], "unrecognized arguments: --shapes"),
])
def test_bad_shapes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_grouped_shapes_by_arity():
    kind = B.load_kind("grouped")
    assert kind.parse_shape("4,8192,4096,7168") == (4, 8192, 4096, 7168)
    assert kind.parse_shape("32x256x8x4096x7168") == (32, 256, 8, 4096, 7168)


# --------------------------------------------------------------------------------------------
# records: ratios, CSV, roofline class, plots
# --------------------------------------------------------------------------------------------

def test_csv_and_speedups_from_committed_record(tmp_path):
    rec = report.load_record(RECORDS[0])
    path = report.write_csv(rec["rows"], tmp_path / "out.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(rec["rows"]) and list(rows[0])[:4] == ["kind", "m", "n", "k"]
    ours = {(r["m"], r["n"], r["k"]): float(r["us"]) for r in rows if r["impl"] == "moe_fp8"}
    for r in rows:
        if r["impl"] == "moe_fp8":
            assert r["moe_fp8_speedup"] == ""
        else:
            want = float(r["us"]) / ours[(r["m"], r["n"], r["k"])]
            assert float(r["moe_fp8_speedup"]) == pytest.approx(want, abs=1e-3)


def test_roofline_class_of_committed_shapes():
    gemm = report.load_record(RECORDS[0])
    ours = [r for r in gemm["rows"] if r["impl"] == "moe_fp8"]
    mem = {r["shape"]["m"] for r in ours if report.memory_bound(r, gemm["ceilings"])}
    comp = {r["shape"]["m"] for r in ours if not report.memory_bound(r, gemm["ceilings"])}
    assert mem == {64, 128} and comp == {4096}  # ridge ≈ 1233 TFLOPS / 3 TB/s ≈ 410 FLOP/B
    grouped = report.load_record(RECORDS[1])
    decode = [r for r in grouped["rows"] if r["impl"] == "moe_fp8" and r["shape"].get("max_m") == 256]
    assert decode and all(report.memory_bound(r, grouped["ceilings"]) for r in decode)


@needs_matplotlib
def test_plot_committed_records(tmp_path, capsys):
    from moe_fp8.benchmarks.plot import _panels

    # drawing costs ~1 s per panel on a small CPU: plot the GEMM record (2 panels) and check how the
    # merged records would be laid out without drawing them
    out = tmp_path / "plots" / "h100.png"
    assert cli.main(["bench", "plot", str(RECORDS[0]), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    _png(out)
    record = report.merge_records([report.load_record(p) for p in RECORDS])
    panels = [(kind, mem, len(shapes)) for kind, mem, shapes in _panels(record)]
    assert panels[:2] == [("gemm", True, 12), ("gemm", False, 6)]
    assert {k for k, _, _ in panels} == {"gemm", "grouped_contiguous", "grouped_masked"}


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"kind": "gemm"}]}')
    if __import__("importlib").util.find_spec("matplotlib") is not None:
        assert cli.main(["bench", "plot", str(bad), "--out", str(tmp_path / "x.png")]) == 1
        assert "row 0 lacks kind / shape / impl / us" in capsys.readouterr().err
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "plot", str(RECORDS[0]), "--out", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert "plotting needs matplotlib: pip install 'moe-fp8[plots]'" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# the whole bench pipeline on a fake kind (CPU)
# --------------------------------------------------------------------------------------------

def _fake_kind(monkeypatch) -> list[tuple]:
    """Register kind 'fake' (two row kinds, two baselines) and make the GPU-only parts CPU-safe."""
    seen: list[tuple] = []

    def run(shapes, args, step):
        rows = []
        for m, n in shapes:
            seen.append((m, n))
            shape = {"m": m, "n": n}
            for impl, us in (("moe_fp8", 10.0), ("torch_a", 20.0), ("torch_b", 5.0)):
                rows.append(harness.row("fake_compute" if m > 1000 else "fake_memory", shape, impl, us * m / 64,
                                        flops=2 * m * n * 4096, nbytes=n * 4096))
            step(f"{m}x{n}")
        return rows, [f"note {len(shapes)}"]

    mod = types.ModuleType("fake_bench_kind")
    mod.KIND = B.BenchKind(
        name="fake", help="a fake kind", tables={"fake_memory": ("torch_a", "torch_b"), "fake_compute": ("torch_a",)},
        default_shapes=lambda: [(64, 4096), (4096, 4096)], parse_shape=lambda t: B.parse_ints(t, 2, "M,N"),
        shape_help="M,N", run=run)
    monkeypatch.setitem(sys.modules, "fake_bench_kind", mod)
    monkeypatch.setattr(B, "KINDS", {"fake": "fake_bench_kind:KIND"})
    monkeypatch.setattr(cli, "_check_bench_device", lambda op: "hopper")
    monkeypatch.setattr(harness, "measure_ceilings",
                        lambda: {"copy_gbps": 3000.0, "fp8_pertensor_tflops": 1250.0, "bf16_tflops": 700.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("MOE_FP8_COMMIT", "abc1234")
    return seen


def test_bench_pipeline_writes_tables_json_csv_plot(tmp_path, capsys, monkeypatch):
    seen = _fake_kind(monkeypatch)
    argv = ["bench", "fake", "--shapes", "64,4096", "128x4096", "--json", str(tmp_path / "all.json"),
            "--csv", str(tmp_path / "all.csv"), "--out-dir", str(tmp_path / "records")]
    if __import__("importlib").util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(tmp_path / "all.png")]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert seen == [(64, 4096), (128, 4096)]
    assert "ceilings: copy_gbps 3000, fp8_pertensor_tflops 1250, bf16_tflops 700" in out
    assert "## fake_memory (hopper backend; x B = B's time / ours)" in out
    assert "| 64×4096 | 10.0 |" in out and "| 2.00 |" in out and "| 0.50 |" in out  # x torch_a, x torch_b
    assert "## fake_compute" not in out  # no rows of that kind for these shapes
    assert "note 2" in out
    # progress on stderr, one plain line per step (stderr is not a TTY here)
    assert err.splitlines() == ["[1/3] bench: ceilings (copy, FP8 and bf16 matmul)", "[2/3] bench: fake 64x4096",
                                "[3/3] bench: fake 128x4096"]

    record = json.loads((tmp_path / "all.json").read_text())
    assert {"device", "commit", "date", "ceilings", "rows"} <= set(record)
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["commit"] == "abc1234"
    assert record["backend"] == "hopper" and len(record["rows"]) == 6
    per_kind = json.loads((tmp_path / "records" / "h100-fake.json").read_text())
    assert per_kind["rows"] == record["rows"]
    rows = list(csv.DictReader((tmp_path / "all.csv").open()))
    assert [r["moe_fp8_speedup"] for r in rows[:3]] == ["", "2.0", "0.5"]
    if "--plot" in argv:
        _png(tmp_path / "all.png")


def test_bench_all_runs_every_kind_with_default_shapes(tmp_path, capsys, monkeypatch):
    seen = _fake_kind(monkeypatch)
    assert cli.main(["bench", "all", "--no-record", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert seen == [(64, 4096), (4096, 4096)] and err == ""
    assert "## fake_memory" in out and "## fake_compute" in out
    assert not (tmp_path / "records").exists()


def test_bench_refuses_a_gpu_without_our_kernels(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(backends, "select", lambda op, device: ("reference", None))
    monkeypatch.setattr(backends, "explain", lambda op, device=None: [
        ("hopper", False, "needs compute capability (9, 0) (sm_90a); NVIDIA L4 has (8, 9)"),
        ("portable", False, "not implemented yet"), ("reference", True, "pure PyTorch")])
    assert cli.main(["bench", "gemm"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-fp8 bench: error: moe_fp8's kernels cannot run fp8_gemm on NVIDIA L4 (hopper: "
                          "needs compute capability (9, 0) (sm_90a); NVIDIA L4 has (8, 9); portable: not implemented yet)")
    assert "Traceback" not in err


def test_forced_backend_error_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def forced(op, device):
        raise backends.BackendError("MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run fp8_gemm on cuda:0: x")
    monkeypatch.setattr(backends, "select", forced)
    assert cli.main(["bench", "gemm"]) == 1
    err = capsys.readouterr().err
    assert "error: MOE_FP8_BACKEND=hopper but backend 'hopper' cannot run fp8_gemm" in err
    assert "fix: unset MOE_FP8_BACKEND" in err and "Traceback" not in err


def test_broken_kind_does_not_break_other_commands(capsys, monkeypatch):
    monkeypatch.setattr(B, "KINDS", {**B.KINDS, "broken": "no_such_module_xyz:KIND"})
    assert cli.main(["info", "--json"]) == 0
    capsys.readouterr()
    assert cli.main(["bench", "broken"]) == 1
    assert "bench broken is unavailable: ModuleNotFoundError" in capsys.readouterr().err
