"""The SGLang integration's parts that need no SGLang: checkpoint-config rules, lazy import, packaging.

(tests/test_sglang_plugin.py runs the integration inside a real SGLang; CI has none.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from moe_fp8.integrations.sglang import spec
from moe_fp8.integrations.sglang.spec import parse_quantization_config

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK_V3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_accepts_deepseek_v3_config() -> None:
    parsed = parse_quantization_config(DEEPSEEK_V3)
    assert parsed.weight_block_size == (128, 128)
    assert parsed.ignored_layers == ()
    # fmt / activation_scheme may be absent; extra keys SGLang injects (hf_config, packed mapping) are fine.
    parsed = parse_quantization_config({"quant_method": "FP8", "weight_block_size": (128, 128),
                                        "hf_config": object(), "packed_modules_mapping": {"qkv_proj": ["q", "k"]}})
    assert parsed.packed_modules_mapping == {"qkv_proj": ["q", "k"]}


def test_ignored_layers_get_both_prefixes() -> None:
    parsed = parse_quantization_config({**DEEPSEEK_V3, "ignored_layers": ["model.layers.0.mlp.down_proj", "lm_head"]})
    assert set(parsed.ignored_layers) == {"layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj", "lm_head",
                                          "model.lm_head"}
    parsed = parse_quantization_config({**DEEPSEEK_V3, "modules_to_not_convert": ["layers.1.self_attn.o_proj"]})
    assert "model.layers.1.self_attn.o_proj" in parsed.ignored_layers


@pytest.mark.parametrize(("change", "field"), [
    ({"weight_block_size": [64, 64]}, "weight_block_size"),
    ({"weight_block_size": [128, 64]}, "weight_block_size"),
    ({"weight_block_size": [1, 32]}, "weight_block_size"),
    ({"weight_block_size": [128.0, 128.0]}, "weight_block_size"),
    ({"weight_block_size": None}, "weight_block_size"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"fmt": "e5m2"}, "fmt"),
    ({"quant_method": "awq"}, "quant_method"),
    ({"scale_fmt": "e8m0fnu"}, "scale_fmt"),
    ({"fmt": None, "quant_method": 8}, "quant_method"),
    ({"ignored_layers": "lm_head"}, "ignored_layers"),
])
def test_refuses_what_the_kernels_cannot_serve(change: dict, field: str) -> None:
    config = {**DEEPSEEK_V3, **change}
    with pytest.raises(ValueError, match=rf"quantization_config\.{field}"):
        parse_quantization_config(config)


def test_refuses_missing_block_size_and_non_dict() -> None:
    config = dict(DEEPSEEK_V3)
    del config["weight_block_size"]
    with pytest.raises(ValueError, match=r"weight_block_size is missing"):
        parse_quantization_config(config)
    with pytest.raises(ValueError, match="must be a dict"):
        parse_quantization_config([("quant_method", "fp8")])  # type: ignore[arg-type]


def test_version_guard() -> None:
    from moe_fp8.integrations import sglang as integration

    integration.check_sglang_version(integration.TESTED_SGLANG_VERSION)
    integration.check_sglang_version("0.5.23.post1")
    with pytest.raises(RuntimeError, match=r"needs sglang >= 0\.5\.23"):
        integration.check_sglang_version("0.5.22")
    with pytest.raises(RuntimeError, match="cannot read"):
        integration.check_sglang_version("dev")


def test_import_does_not_import_sglang() -> None:
    code = ("import sys, moe_fp8, moe_fp8.integrations.sglang as m; "
            "assert 'sglang' not in sys.modules, 'sglang imported'; assert m.QUANT_METHOD_NAME == 'moe_fp8'; "
            "assert not m.is_enabled()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_entry_point_and_extra_are_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["sglang.srt.plugins"] == {"moe_fp8": "moe_fp8.integrations.sglang:enable"}
    from moe_fp8.integrations import sglang as integration

    assert project["optional-dependencies"]["sglang"] == [f"sglang=={integration.TESTED_SGLANG_VERSION}"]
    assert spec.QUANT_METHOD_NAME == "moe_fp8"
