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


def test_torch_grouped_baselines_take_each_group_as_its_segment():
    """The bf16 grouped baseline computes group g's rows with expert g's weights, empty groups included (the FP8
    one, ``_scaled_grouped_mm``, has no CPU kernel: its GPU run checks the same offsets)."""
    from moe_fp8.benchmarks.grouped import BASELINES, _torch_grouped

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(4, 32, 64, generator=gen).to(torch.bfloat16)
    segments = [5, 0, 16, 0]
    fns = _torch_grouped(x.to(torch.float8_e4m3fn), x, w.to(torch.float8_e4m3fn), w, segments)
    assert set(fns) | {"torch_blockwise_loop"} == set(BASELINES)
    out = fns["torch_bf16_grouped"]()
    assert out.shape == (21, 32)
    torch.testing.assert_close(out[:5], x[:5] @ w[0].t())
    torch.testing.assert_close(out[5:], x[5:] @ w[2].t())


def test_grouped_bench_records_a_missing_baseline_and_checks_ours(monkeypatch):
    """A baseline this torch build or GPU lacks becomes a note, not a failed bench; ours is checked against the bf16
    product first, and a wrong result is named in the notes (it is still timed: the record shows both)."""
    from moe_fp8.benchmarks import grouped

    monkeypatch.setattr(grouped, "bench_us", lambda fn: 10.0)
    monkeypatch.setattr(grouped, "bench_chilled_us", lambda fn: 8.0)

    def missing():
        raise NotImplementedError("Could not run 'aten::_scaled_grouped_mm' with arguments from the 'CPU' backend")
    notes: list[str] = []
    fns = {"moe_fp8": lambda: torch.ones(4), "torch_blockwise_loop": lambda: None,
           "torch_fp8_rowwise_grouped": missing, "torch_bf16_grouped": lambda: torch.ones(4)}
    rows = grouped._time("grouped_masked", {"groups": 1, "n": 8}, fns, 100, 10, lambda res: float(res[0] - 1), notes)
    assert [r["impl"] for r in rows] == ["moe_fp8", "torch_blockwise_loop", "torch_bf16_grouped"]
    assert rows[0]["us"] == 10.0 and rows[0]["chilled_us"] == 8.0
    assert notes == ["torch_fp8_rowwise_grouped grouped_masked 1x8: NotImplementedError: Could not run "
                     "'aten::_scaled_grouped_mm' with arguments from the 'CPU' backend"]
    fns["moe_fp8"] = lambda: torch.full((4,), 2.0)
    notes.clear()
    grouped._time("grouped_masked", {"groups": 1, "n": 8}, fns, 100, 10, lambda res: float(res[0] - 1), notes)
    assert notes[0] == "moe_fp8 grouped_masked 1x8: diff vs the bf16 product 1.00e+00 (> 1e-3)"


# --------------------------------------------------------------------------------------------
# records: ratios, CSV, roofline class, plots
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [0, 3])
def test_model_layer_refuses_a_tp_that_does_not_divide_the_experts(tp):
    """``benchmarks.moe.build_model_layer`` (scripts/bench_model_layer.py, ab_tuned_layer.py) refuses before any GPU
    work a ``tp`` that would silently truncate each expert's intermediate size."""
    from moe_fp8.benchmarks.moe import build_model_layer

    cfg = json.loads((Path(__file__).parents[1] / "scripts" / "models" / "deepseek-v3.json").read_text())
    with pytest.raises(ValueError, match=f"tp={tp} must be >= 1 and divide the experts' moe_intermediate_size 2048"):
        build_model_layer(cfg, tp=tp)


def test_model_layer_with_shared_experts_needs_a_model_that_has_them():
    """``build_model_layer(..., shared=True)`` refuses, before any GPU work, a model without shared experts."""
    from moe_fp8.benchmarks.moe import build_model_layer

    cfg = json.loads((Path(__file__).parents[1] / "scripts" / "models" / "qwen3-30b-a3b.json").read_text())
    with pytest.raises(ValueError, match="qwen3_moe has no shared experts"):
        build_model_layer(cfg, ep=8, shared=True)


def test_capture_forward_takes_logits_or_router_weight():
    """``benchmarks.moe.capture_forward`` captures a forward on the given logits or on logits computed in the graph
    from ``router_weight``: given both or neither, it refuses before running anything."""
    import torch

    from moe_fp8.benchmarks.moe import capture_forward

    def layer(*args, **kwargs):
        raise AssertionError("ran the layer")

    x = torch.zeros(2, 8)
    for logits, router_weight in ((None, None), (x, x)):
        with pytest.raises(ValueError, match="give the router logits or the router_weight, not both nor neither"):
            capture_forward(layer, x, logits, "masked", router_weight=router_weight)


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
    ceilings = gemm["ceilings"]
    ridge = ceilings["fp8_pertensor_tflops"] * 1e3 / ceilings["copy_gbps"]  # ≈ 400-480 FLOP/B on an H100
    assert all(report.memory_bound(r, ceilings) for r in ours if r["shape"]["m"] <= 128)
    # M = 4096: compute-bound clear of the ridge (4096×32768×512, ~480 FLOP/B, sits on it and goes either way)
    large = [r for r in ours if r["shape"]["m"] == 4096 and r["tflops"] * 1e3 / r["gbps"] > 1.1 * ridge]
    assert len(large) >= 5 and not any(report.memory_bound(r, ceilings) for r in large)
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
    gemm = report.load_record(RECORDS[0])
    ours = [r for r in gemm["rows"] if r["impl"] == "moe_fp8"]
    n_mem = sum(report.memory_bound(r, gemm["ceilings"]) for r in ours)  # 12, or 13 (a shape on the ridge)
    assert panels[:2] == [("gemm", True, n_mem), ("gemm", False, 18 - n_mem)] and n_mem in (12, 13)
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

def _fake_kind(monkeypatch, chilled: dict[str, float] | None = None) -> list[tuple]:
    """Register kind 'fake' (two row kinds, two baselines) and make the GPU-only parts CPU-safe;
    ``chilled``: impl -> its chilled time (``harness.bench_chilled_us``) at M = 64."""
    seen: list[tuple] = []

    def run(shapes, args, step):
        rows = []
        for m, n in shapes:
            seen.append((m, n))
            shape = {"m": m, "n": n}
            for impl, us in (("moe_fp8", 10.0), ("torch_a", 20.0), ("torch_b", 5.0)):
                cold = chilled[impl] * m / 64 if chilled else None
                rows.append(harness.row("fake_compute" if m > 1000 else "fake_memory", shape, impl, us * m / 64,
                                        flops=2 * m * n * 4096, nbytes=n * 4096, chilled_us=cold))
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
    assert "chilled" not in out  # no chilled timings, no chilled table
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


def test_bench_prints_the_chilled_timings_as_a_table_of_their_own(tmp_path, capsys, monkeypatch):
    _fake_kind(monkeypatch, chilled={"moe_fp8": 8.0, "torch_a": 12.0, "torch_b": 4.0})
    assert cli.main(["bench", "fake", "--shapes", "64,4096", "--no-progress", "--no-record",
                     "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    sustained, _, chilled = out.partition("## fake_memory, chilled (DeepGEMM's timing")
    assert "| 64×4096 | 10.0 |" in sustained and "| 2.00 |" in sustained
    assert "| 64×4096 | 8.0 |" in chilled and "| 1.50 |" in chilled and "| 0.50 |" in chilled
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    ours = next(r for r in rows if r["impl"] == "moe_fp8")
    assert ours["us"] == 10.0 and ours["chilled_us"] == 8.0
    assert ours["chilled_tflops"] == round(2 * 64 * 4096 * 4096 / 8.0 / 1e6, 1)
    assert report.chilled_view(rows)[0] == {**{k: v for k, v in ours.items() if not k.startswith("chilled_")},
                                            "us": 8.0, "tflops": ours["chilled_tflops"], "gbps": ours["chilled_gbps"]}


def test_bench_all_runs_every_kind_with_default_shapes(tmp_path, capsys, monkeypatch):
    seen = _fake_kind(monkeypatch)
    assert cli.main(["bench", "all", "--no-record", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert seen == [(64, 4096), (4096, 4096)] and err == ""
    assert "## fake_memory" in out and "## fake_compute" in out
    assert not (tmp_path / "records").exists()


def _bench_error(capsys, argv: list[str], *parts: str) -> None:
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("moe-fp8 bench: error: ") and "Traceback" not in err, err
    for part in parts:
        assert part in err, (part, err)


def test_bad_output_paths_are_refused_before_measuring(tmp_path, capsys, monkeypatch):
    """A --json / --csv / --plot path that is a folder, or an --out-dir that is a file: one line, and nothing
    measured (not minutes of measuring and then a traceback)."""
    seen = _fake_kind(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["bench", "fake", "--no-progress", "--shapes", "64,4096"]
    _bench_error(capsys, [*base, "--no-record", "--json", str(tmp_path)], f"--json {tmp_path} is a directory")
    _bench_error(capsys, [*base, "--no-record", "--csv", str(tmp_path)], f"--csv {tmp_path} is a directory")
    _bench_error(capsys, [*base, "--no-record", "--json", str(afile / "r.json")], f"{afile} is not a directory")
    _bench_error(capsys, [*base, "--out-dir", str(afile)], f"--out-dir {afile} is not a directory")
    if __import__("importlib").util.find_spec("matplotlib") is not None:
        _bench_error(capsys, [*base, "--no-record", "--plot", str(tmp_path)], f"--plot {tmp_path} is a directory")
    assert seen == []
    # a missing folder is created
    assert cli.main([*base, "--no-record", "--json", str(tmp_path / "new" / "r.json")]) == 0
    assert (tmp_path / "new" / "r.json").is_file() and seen == [(64, 4096)]


@needs_matplotlib
def test_plot_of_a_record_without_rows_is_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text('{"rows": []}')
    out = tmp_path / "x.png"
    _bench_error(capsys, ["bench", "plot", str(empty), "--out", str(out)], f"nothing to plot: {empty} has no rows")
    _bench_error(capsys, ["bench", "plot", str(RECORDS[0]), "--out", str(tmp_path)], f"--out {tmp_path} is a directory")
    assert not out.exists()


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


# --------------------------------------------------------------------------------------------
# bench moe-data: the real driver through the command line (CPU: reference ops, one call per row)
# --------------------------------------------------------------------------------------------

def _cpu_as_gpu(monkeypatch) -> None:
    monkeypatch.setattr(cli, "_check_bench_device", lambda op: "reference")
    monkeypatch.setattr(harness, "measure_ceilings",
                        lambda: {"copy_gbps": 3000.0, "fp8_pertensor_tflops": 1250.0, "bf16_tflops": 700.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("MOE_FP8_COMMIT", "abc1234")


def test_moe_data_kind_shapes_and_layouts():
    from moe_fp8.benchmarks import moe_data

    kind = B.load_kind("moe-data")
    assert kind.metric == "gbps" and kind.op == "per_token_group_quant"
    assert kind.default_shapes() == [(16384,), (4096,), (1024,), (128,)]
    assert kind.parse_shape("4096") == (4096,)
    with pytest.raises(ValueError, match="is not T"):
        kind.parse_shape("4096,7168")
    # decode batches over all experts, small prefill on one EP rank, none for large prefill
    assert moe_data._masked_layouts(128, moe_data.DSV3) == [(256, 128)]
    assert moe_data._masked_layouts(4096, moe_data.DSV3) == [(32, 2048)]
    assert moe_data._masked_layouts(16384, moe_data.DSV3) == []


def test_moe_data_routing_large_input_with_default_shapes(monkeypatch):
    # with the default shapes routing also runs at ROUTING_LARGE_TOKENS (first); named shapes run alone
    import argparse

    from moe_fp8.benchmarks import moe_data

    monkeypatch.setattr(moe_data, "ROUTING_LARGE_TOKENS", 16)
    rows, notes = moe_data.run([(4,)], argparse.Namespace(smoke=False, shapes=None, ops=["routing"]))
    assert [r["shape"]["t"] for r in rows if r["impl"] == "moe_fp8"] == [16, 4]
    assert not [n for n in notes if "differ" in n or "Error" in n]
    rows, _ = moe_data.run([(4,)], argparse.Namespace(smoke=False, shapes=[(4,)], ops=["routing"]))
    assert [r["shape"]["t"] for r in rows if r["impl"] == "moe_fp8"] == [4]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bench_moe_data_through_the_cli(tmp_path, capsys, monkeypatch):
    _cpu_as_gpu(monkeypatch)
    argv = ["bench", "moe-data", "--smoke", "--shapes", "8", "--json", str(tmp_path / "all.json"),
            "--csv", str(tmp_path / "all.csv"), "--out-dir", str(tmp_path / "records")]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["[1/2] bench: ceilings (copy, FP8 and bf16 matmul)", "[2/2] bench: moe-data 8 tokens"]
    for kind in ("quant", "silu_mul_quant", "router", "routing", "dispatch_contiguous", "quant_dispatch_contiguous",
                 "dispatch_masked", "combine"):
        assert f"## {kind} (reference backend; x B = B's time / ours)" in out
        assert ("| moe_fp8 GB/s | moe_fp8_graph GB/s | x moe_fp8_graph | torch_copy GB/s | x torch_copy | "
                "torch_reference GB/s |") in out
    assert "## decode_step" in out and "| moe_fp8_eager GB/s | x moe_fp8_eager |" in out
    assert "backends: reference for every op" in out and "differs" not in out
    record = json.loads((tmp_path / "records" / "h100-moe-data.json").read_text())
    assert record["commit"] == "abc1234" and record["backend"] == "reference"
    kinds = {r["kind"] for r in record["rows"]}
    assert kinds == {"quant", "silu_mul_quant", "router", "routing", "dispatch_contiguous",
                     "quant_dispatch_contiguous", "dispatch_masked", "combine", "decode_step"}
    assert all(r["us"] > 0 and r["gbps"] is not None for r in record["rows"])
    assert json.loads((tmp_path / "all.json").read_text())["rows"] == record["rows"]
    assert len(list(csv.DictReader((tmp_path / "all.csv").open()))) == len(record["rows"])
    # --ops narrows the run
    assert cli.main(["bench", "moe-data", "--smoke", "--ops", "quant", "--no-record", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "## quant" in out and "## routing" not in out and "## decode_step" not in out
    # `python -m moe_fp8.benchmarks.moe_data ARGS` is `moe-fp8 bench moe-data ARGS` (gpu_check.sh used it)
    from moe_fp8.benchmarks import moe_data

    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    assert moe_data.main(["--out-dir", "x"]) == 0 and calls == [["bench", "moe-data", "--out-dir", "x"]]


def test_bench_all_includes_moe_data(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "_check_bench_device", lambda op: seen.append(op) or "hopper")
    monkeypatch.setattr(harness, "measure_ceilings", lambda: (_ for _ in ()).throw(RuntimeError("stop here")))
    with pytest.raises(RuntimeError, match="stop here"):
        cli.main(["bench", "all", "--no-record", "--no-progress"])
    assert "per_token_group_quant" in seen and len(seen) == len(B.KINDS) == 4


# --------------------------------------------------------------------------------------------
# plot layout rules
# --------------------------------------------------------------------------------------------

def test_plot_labels_show_only_varying_shape_keys():
    from moe_fp8.benchmarks.plot import _shape_labels

    moe = [{"tokens": t, "experts": 256, "hidden": 7168, "path": p} for t, p in ((8, "masked"), (8192, "contiguous"))]
    assert _shape_labels(moe) == (["8×masked", "8192×contiguous"], "tokens×path   (experts=256, hidden=7168)")
    gemm = [{"m": 4096, "n": 2112, "k": 7168}, {"m": 4096, "n": 7168, "k": 2048}]
    assert _shape_labels(gemm) == (["2112×7168", "7168×2048"], "n×k   (m=4096)")
    assert _shape_labels([{"t": 128, "e": 256}]) == (["128"], "t   (e=256)")


@needs_matplotlib
def test_plot_panel_log_axis_and_shapes_without_throughput():
    from matplotlib.figure import Figure

    from moe_fp8.benchmarks.plot import _colors, _draw

    def rows(t, gbps_ours, gbps_base):
        shape = {"tokens": t, "experts": 256}
        return {"moe_fp8": harness.row("moe_layer", shape, "moe_fp8", 10.0, 0, gbps_ours * 1e4),
                "moe_fp8_graph": harness.row("moe_layer", shape, "moe_fp8_graph", 5.0, 0, gbps_ours * 2e4),
                "torch_bf16": harness.row("moe_layer", shape, "torch_bf16", 20.0, 0, gbps_base * 2e4)}
    shapes = {"a": rows(1, 0, 0), "b": rows(8, 1000, 20), "c": rows(64, 2500, 1000)}
    impls = ["moe_fp8", "moe_fp8_graph", "torch_bf16"]
    colors = _colors(impls)
    assert colors["moe_fp8"] == "#d62728" and colors["moe_fp8_graph"] == "#ff7f0e" and colors["torch_bf16"] == "#1f77b4"
    ax = Figure().subplots()
    _draw(ax, "moe_layer", True, shapes, impls, colors, {"copy_gbps": 3000.0})
    assert ax.get_yscale() == "log"  # 20 .. 3000 GB/s
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "64"]
    assert ax.get_xlabel() == "tokens   (experts=256)\nnot shown (no GB/s counted): 1"
    assert ax.get_ylim()[1] > 3000


# --------------------------------------------------------------------------------------------
# scripts/record_gpu_check.py writes records, tables and plots
# --------------------------------------------------------------------------------------------

@needs_matplotlib
@pytest.mark.parametrize("device,slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200")])
def test_record_gpu_check_writes_json_md_and_png(tmp_path, device, slug):
    """Records named as the benches name them (``report.device_slug``): an H200 run's ``h200-*.json`` too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("record_gpu_check",
                                                  Path(__file__).resolve().parents[1] / "scripts" / "record_gpu_check.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run = tmp_path / "gpu_check"
    run.mkdir()
    (run / "info.txt").write_text(f"# commit deadbeef\nname, driver_version\n{device}, 570.1\n")
    rows = [harness.row("quant", {"m": m, "k": 7168}, impl, us, 0, m * 7168 * 3)
            for m in (128, 4096) for impl, us in (("moe_fp8", 20.0), ("torch_copy", 10.0))]
    (run / f"{slug}-moe-data.json").write_text(json.dumps({"device": device, "commit": "x", "date": "2026-11-23",
                                                          "ceilings": {"copy_gbps": 3000.0}, "rows": rows}))
    (run / "bench_moe-data.txt").write_text("[1/2] bench: ceilings\n## quant\n| table |\n")
    docs = tmp_path / "docs"
    script.main([str(run), "--commit", "abc1234", "--docs", str(docs)])
    assert json.loads((docs / f"{slug}-moe-data.json").read_text())["commit"] == "abc1234"
    md = (docs / f"{slug}-moe-data.md").read_text()
    assert f"]({slug}-moe-data.png)" in md and "## quant\n| table |" in md and "[1/2]" not in md
    _png(docs / f"{slug}-moe-data.png")
    assert (docs / f"{slug}-gpu-check.md").exists()
    (docs / f"{slug}-moe-data.png").unlink()
    script.main([str(run), "--commit", "abc1234", "--docs", str(docs), "--no-plots"])
    assert not (docs / f"{slug}-moe-data.png").exists() and ".png)" not in (docs / f"{slug}-moe-data.md").read_text()


def test_chilled_timing_sums_each_calls_kernels() -> None:
    """``bench_chilled_us`` splits the profiler's trace at the memsets between calls and sums the rest per call
    (a call of several kernels counts their durations, not the gaps between them)."""
    chill = {"fill<uchar>"}
    events = [("fill<uchar>", 0, 50), ("fill<uchar>", 50, 100), ("gemm", 103, 113), ("fill<uchar>", 120, 170),
              ("gemm_a", 172, 175), ("gemm_b", 180, 184), ("fill<uchar>", 190, 240), ("gemm", 241, 250)]
    assert harness.kernel_us_per_call(events, chill) == [10, 7, 9]
    assert harness.kernel_us_per_call([("fill<uchar>", 0, 1)], chill) == []


def test_span_covers_first_start_to_last_end() -> None:
    """``span_us``: from the earliest start to the latest end, overlaps and gaps included (a PDL-launched
    kernel starts before the previous one ends); no activity at all is an error, not a span of nothing."""
    assert harness.span_us([("a", 10.0, 20.0), ("b", 15.0, 40.0), ("c", 45.0, 50.0)]) == 40.0
    assert harness.span_us(iter([("a", 3.0, 4.5)])) == 1.5
    with pytest.raises(ValueError, match="no GPU activity"):
        harness.span_us([])


def test_alternated_us_takes_turns_and_medians(monkeypatch):
    """A/B timing: the callables are timed in turn within each round, and each gets its median over the rounds."""
    calls, times = [], {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    monkeypatch.setattr(harness, "bench_us", lambda fn: (calls.append(fn()), next(times[calls[-1]]))[1])
    assert harness.alternated_us([lambda: "a", lambda: "b"], rounds=3) == [3.0, 4.0]
    assert calls == ["a", "b"] * 3
