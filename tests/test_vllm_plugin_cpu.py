"""The vLLM integration's pure-Python part (no vLLM needed): config parsing, shard rules, lazy import.

tests/test_vllm_plugin.py covers the rest with the real vLLM (skipped where it is not installed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from moe_fp8.integrations.vllm.config import (
    BlockFp8Settings,
    accepts_checkpoint,
    check_linear_partition,
    check_moe_partition,
    parse_quantization_config,
)

ROOT = Path(__file__).resolve().parents[1]
DSV3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_deepseek_v3_config_parses() -> None:
    settings = parse_quantization_config(DSV3)
    assert settings == BlockFp8Settings()
    assert settings.weight_block_size == (128, 128) and settings.ignored_layers == ()


def test_optional_fields() -> None:
    # fmt / activation_scheme may be absent; ignored layers from either key; DeepSeek-V3.1's scale_fmt.
    s = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["lm_head"], "scale_fmt": "ue8m0"})
    assert s.ignored_layers == ("lm_head",) and s.scale_fmt == "ue8m0"
    s = parse_quantization_config({**DSV3, "quant_method": "moe_fp8", "ignored_layers": ["a.b"],
                                   "modules_to_not_convert": ["c"]})
    assert s.ignored_layers == ("a.b",)


@pytest.mark.parametrize(("change", "field"), [
    ({"weight_block_size": [64, 128]}, "weight_block_size"),
    ({"weight_block_size": [128, 128, 1]}, "weight_block_size"),
    ({"weight_block_size": "128"}, "weight_block_size"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"fmt": "hybrid"}, "fmt"),
    ({"quant_method": "awq"}, "quant_method"),
    ({"quant_method": None}, "quant_method"),
    ({"scale_fmt": "e8m0fnu"}, "scale_fmt"),
    ({"ignored_layers": "lm_head"}, "ignored_layers"),
])
def test_refused_configs_name_the_field(change: dict, field: str) -> None:
    cfg = {**DSV3, **change}
    if change.get("weight_block_size", 0) is None:
        del cfg["weight_block_size"]
    with pytest.raises(ValueError, match=field):
        parse_quantization_config(cfg)


def test_not_a_dict() -> None:
    with pytest.raises(ValueError, match="dict"):
        parse_quantization_config([("quant_method", "fp8")])  # type: ignore[arg-type]


def test_accepts_checkpoint() -> None:
    assert accepts_checkpoint(DSV3)
    assert accepts_checkpoint({"quant_method": "moe_fp8"})
    assert not accepts_checkpoint({"quant_method": "gptq"})
    assert not accepts_checkpoint(None)


def test_linear_partitions() -> None:
    # DeepSeek-V3 shapes: fused_qkv_a_proj [1536 | 576] unsplit (last part ragged: allowed) ...
    check_linear_partition("q_a", 7168, 2112, 7168, [1536, 576])
    # ... o_proj row-split over 8 (16384 / 8 = 2048), gate_up column-split over 8 (18432 / 8 per part).
    check_linear_partition("o_proj", 16384, 7168, 2048, [7168])
    check_linear_partition("gate_up", 7168, 2 * 18432, 7168, [2304, 2304])
    # An unsplit ragged linear (N = 576) runs with a partial last block.
    check_linear_partition("kv_a", 7168, 576, 7168, [576])


@pytest.mark.parametrize(("args", "match"), [
    (("o", 1024, 256, 64, [256]), "input features"),          # row split 1024 / 16 = 64: cuts a block
    (("col", 256, 1024, 256, [64]), "output features"),       # column split to 64 rows
    (("m", 256, 576, 256, [192, 384]), "fused parts"),        # merged, first part not a block multiple
    (("k", 200, 256, 200, [256]), "in_features % 16"),        # GEMM alignment
    (("n", 256, 260, 256, [260]), "out_features % 8"),
])
def test_linear_partitions_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_linear_partition(*args)


def test_moe_partitions() -> None:
    check_moe_partition("experts", 7168, 2048 // 8)      # DeepSeek-V3 I = 2048 over TP 8: 256 per rank
    with pytest.raises(ValueError, match="multiple of 128"):
        check_moe_partition("experts", 7168, 2048 // 32)  # 64 per rank cuts a scale block
    with pytest.raises(ValueError, match="hidden_size"):
        check_moe_partition("experts", 7160, 256)


def test_entry_point_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"moe_fp8": "moe_fp8.integrations.vllm:register"}
    assert project["optional-dependencies"]["vllm"][0].startswith("vllm==")


def test_importing_the_package_does_not_import_vllm() -> None:
    code = ("import sys, moe_fp8, moe_fp8.integrations.vllm, moe_fp8.integrations.vllm.config; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.fixture
def unregistered(monkeypatch: pytest.MonkeyPatch):
    import moe_fp8.integrations.vllm as plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("MOE_FP8_STRICT", raising=False)
    return plugin


def test_register_without_vllm_raises(unregistered, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"moe-fp8\[vllm\]"):
        unregistered.register()


def test_register_with_a_mismatched_vllm_warns_and_does_not_raise(
        unregistered, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # vLLM calls the plugin for every command: a release without the interfaces we build on must not
    # break `vllm serve` for other quantizations. This fake vLLM has none of its submodules.
    import types

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.1.0"
    # (where the real vLLM is installed and imported, hide its modules, and ours built on them)
    for name in [m for m in sys.modules if m.startswith(("vllm.", "moe_fp8.integrations.vllm."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    with caplog.at_level("WARNING", logger="moe_fp8"):
        assert unregistered.register() is False
    assert "not registered" in caplog.text and "vLLM 0.1.0" in caplog.text
    assert unregistered.TESTED_VLLM_VERSION in caplog.text
    assert unregistered._registered is False

    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    with pytest.raises(ImportError, match=r"MOE_FP8_STRICT=1: vLLM 0\.1\.0 lacks"):
        unregistered.register()


def test_tested_vllm_version_is_the_pinned_one() -> None:
    from moe_fp8.integrations.vllm import TESTED_VLLM_VERSION

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"vllm=={TESTED_VLLM_VERSION}"]


def test_engines_refuse_other_platforms(monkeypatch: pytest.MonkeyPatch) -> None:
    # MI300 reports capability 9.4, which passes MIN_CAPABILITY; both engines' configs call check_platform.
    import torch

    from moe_fp8.integrations import MIN_CAPABILITY, check_platform

    assert MIN_CAPABILITY == 90
    check_platform("vLLM")  # this machine: CPU only
    with monkeypatch.context() as patch:
        patch.setattr(torch.version, "hip", "6.4.1", raising=False)
        with pytest.raises(ValueError, match=r"NVIDIA GPUs .* ROCm build of torch \(HIP 6\.4\.1\)"):
            check_platform("vLLM")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    with pytest.raises(ValueError, match="SGLang runs torch on xpu devices"):
        check_platform("SGLang")
