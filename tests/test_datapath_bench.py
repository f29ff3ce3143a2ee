"""The data-path bench driver runs end to end (``--smoke``: tiny shapes; on CPU the ops are the reference's).
The same driver behind ``moe-fp8 bench moe-data`` is tested through the command line in test_cli_bench.py."""

from __future__ import annotations

import json

import pytest


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_moe_data_bench_smoke(tmp_path, capsys):
    from moe_fp8.benchmarks import moe_data

    assert moe_data.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    (record,) = list(tmp_path.glob("*-moe-data.json"))
    data = json.loads(record.read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == {"quant", "silu_mul_quant", "router", "routing", "dispatch_contiguous",
                     "quant_dispatch_contiguous", "dispatch_masked", "combine", "decode_step"}
    for r in data["rows"]:
        assert r["impl"] in ("moe_fp8", "torch_copy", "torch_reference", "moe_fp8_eager") and r["us"] > 0
    assert set(data["backends"]) >= {"per_token_group_quant", "combine"}
    out = capsys.readouterr().out
    assert "differs" not in out and "Error" not in out and "off the bound" not in out, out
