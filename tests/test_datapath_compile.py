"""Every data-path Triton kernel compiles for sm_90 — on CPU, ahead of time, no GPU needed.

The other data-path tests run the kernels in Triton's interpreter, which accepts programs the real
compiler rejects (the contiguous dispatch once reached the GPU with a loop variable typed int32 in
one branch and int64 in the other: ``CompilationError`` on every call). ``scripts/datapath_aot.py``
drives the public launch wrappers over shapes / flags / configs that reach every constexpr branch,
captures each launch and compiles every distinct specialization to a cubin for
``GPUTarget("cuda", 90, 32)``. It runs in a subprocess because this test session has
``TRITON_INTERPRET=1`` on (set by conftest before the kernels were decorated).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def test_every_datapath_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, not from a stale cache
    report = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "datapath_aot.py"), "--json", str(report)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), f"datapath_aot.py crashed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads(report.read_text())
    failed = [f"{r['kernel']} {r['constexprs']} warps={r['num_warps']}:\n{r['error'][:1500]}"
              for r in summary["results"] if r["error"]]
    assert not failed, "kernels that do not compile for sm_90:\n\n" + "\n\n".join(failed)
    assert not summary["missing"], f"kernels no launch reached: {summary['missing']}"
    assert proc.returncode == 0, proc.stdout[-4000:]
    kernels = {r["kernel"] for r in summary["results"]}
    assert {"_act_quant_kernel", "_select_experts_kernel", "_dispatch_fused_kernel", "_count_kernel", "_scan_kernel",
            "_scatter_kernel", "_scatter_sparse_kernel", "_scale_rows_kernel", "_combine_kernel"} <= kernels
    # the branches that matter at decode and at prefill were compiled, hardware conversions included
    quant = [r["constexprs"] for r in summary["results"] if r["kernel"] == "_act_quant_kernel"]
    assert {(c["FLAT"], c["HAS_MASK"]) for c in quant} >= {("True", "True"), ("False", "True"), ("False", "False")}
    assert all(c["NATIVE_FP8"] == "True" for c in quant)
    routing = [r for r in summary["results"] if r["kernel"] == "_select_experts_kernel"]
    assert any(r["constexprs"]["BLOCK_T"] == "2" and r["num_warps"] == 2 for r in routing)
    # every kernel is compiled with the programmatic-dependent-launch prologue (as a Hopper GPU runs it),
    # and the contiguous scatter's in-kernel quantization with and without writing x_fp8
    assert all(r["constexprs"]["PDL"] == "True" for r in summary["results"])
    scatter = [r["constexprs"] for r in summary["results"] if r["kernel"] == "_scatter_kernel"]
    assert {(c["QUANT"], c["WRITE_X"]) for c in scatter} >= {("True", "True"), ("True", "False"), ("False", "False")}
    assert {(c["QUANT"], c["SCALES_APART"]) for c in scatter} >= {("True", "True"), ("False", "True"), ("False", "False")}
    scale_rows = [r["constexprs"] for r in summary["results"] if r["kernel"] == "_scale_rows_kernel"]
    assert {c["ROWS_ON_DEVICE"] for c in scale_rows} == {"True", "False"}
    count = [r["constexprs"] for r in summary["results"] if r["kernel"] == "_count_kernel"]
    assert {c["RANK_SUB"] for c in count} >= {"0", "32"}, "ranks from column prefixes and from comparisons"
    sparse = [r["constexprs"] for r in summary["results"] if r["kernel"] == "_scatter_sparse_kernel"]
    assert {(c["QUANT"], c["WRITE_X"], c["MASKED"]) for c in sparse} >= {
        ("True", "True", "False"), ("True", "False", "False"), ("False", "False", "False"), ("False", "False", "True")}


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """Programmatic dependent launch only for compiled kernels on a GPU (never on CPU tensors or in the
    interpreter); ``MOE_FP8_PDL=0`` turns it off."""
    import torch

    from moe_fp8.kernels.triton import common

    assert common.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(common, "interpreting", lambda: False)
    assert not common.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(common, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(common, "_pdl_available", lambda: True)
    cuda = torch.device("cuda", 0)
    assert common.pdl_args(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("MOE_FP8_PDL", "0")
    assert common.pdl_args(cuda) == {"PDL": False}
    monkeypatch.setenv("MOE_FP8_PDL", "1")
    monkeypatch.setattr(common, "_capability", lambda index: (8, 0))  # Ampere: no griddepcontrol
    assert not common.use_pdl(cuda)
