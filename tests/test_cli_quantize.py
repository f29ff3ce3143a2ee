"""`moe-fp8 quantize`: a tiny sharded bf16 checkpoint → DeepSeek-style block FP8, checked tensor by tensor."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moe_fp8
from moe_fp8 import cli
from moe_fp8.convert import QUANTIZATION_CONFIG, plan_tensor, quantize_weight
from moe_fp8.quant import dequant_per_block

BF16 = torch.bfloat16
H, INTER, E = 256, 384, 4  # hidden, expert intermediate (3 blocks), experts
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _tensors(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    shard1 = {
        "model.embed_tokens.weight": randn(512, H),
        "model.layers.0.input_layernorm.weight": randn(H),
        "model.layers.0.self_attn.q_proj.weight": randn(384, H),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": randn(192, H),  # ragged N: partial block
        "model.layers.0.self_attn.o_proj.weight": randn(H, 384),
        "model.layers.0.self_attn.o_proj.bias": randn(H),
        "model.layers.0.mlp.gate.weight": randn(E, H),
        "model.layers.0.mlp.gate.e_score_correction_bias": randn(E, dtype=torch.float32),
    }
    shard2 = {"lm_head.weight": randn(512, H), "model.norm.weight": randn(H),
              "model.layers.0.mlp.odd_proj.weight": randn(100, H),  # N % 8 != 0: the kernels cannot run it
              "model.layers.0.mlp.stacked.weight": randn(E, 128, H)}  # 3-D: left alone
    for e in range(E):
        shard2[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = randn(INTER, H)
        shard2[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = randn(INTER, H)
        shard2[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = randn(H, INTER)
    return shard1, shard2


def _checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = root / "src"
    src.mkdir()
    s1, s2 = _tensors()
    save_file(s1, src / SHARD1, metadata={"format": "pt"})
    save_file(s2, src / SHARD2, metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(s1, SHARD1), **dict.fromkeys(s2, SHARD2)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1},
                                                                  "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"model_type": "toy_moe", "hidden_size": H,
                                                 "torch_dtype": "bfloat16"}))
    (src / "tokenizer.json").write_text('{"toy": true}')
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("kept")
    (src / "pytorch_model.bin").write_bytes(b"old weights")  # another format: not copied
    return src, {**s1, **s2}


def _load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        names = f.keys()
        return {k: f.get_tensor(k) for k in names}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


QUANTIZED = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
             *(f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj",
                                                                                      "down_proj"))}


def test_quantize_sharded_checkpoint(tmp_path, capsys):
    src, original = _checkpoint(tmp_path)
    dst = tmp_path / "dst"
    report = tmp_path / "report.csv"
    rc = cli.main(["quantize", str(src), str(dst), "--skip", r"o_proj\.weight$", "--device", "cpu",
                   "--report", str(report)])
    out, err = capsys.readouterr()
    assert rc == 0, err

    # shards, names, dtypes, shapes
    out_tensors = {**_load(dst / SHARD1), **_load(dst / SHARD2)}
    assert set(out_tensors) == set(original) | {n + "_scale_inv" for n in QUANTIZED}
    for name, w in original.items():
        got = out_tensors[name]
        if name in QUANTIZED:
            n, k = w.shape
            assert got.dtype == torch.float8_e4m3fn and got.shape == w.shape
            scale = out_tensors[name + "_scale_inv"]
            assert scale.dtype == torch.float32 and scale.shape == ((n + 127) // 128, (k + 127) // 128)
            deq = dequant_per_block(got, scale)
            # FP8 e4m3 rounding of N(0, 1) data: ~3.5e-4; DESIGN §6 bounds a GEMM at 1e-3
            assert moe_fp8.calc_diff(deq, w.float()) < 1e-3, name
            assert torch.isfinite(deq).all()
        else:  # everything else byte-identical, dtype and shape included
            assert got.dtype == w.dtype and got.shape == w.shape, name
            assert _raw(got) == _raw(w), name
    # each output tensor is in the shard its source tensor was in
    assert set(_load(dst / SHARD1)) >= {"model.layers.0.self_attn.q_proj.weight_scale_inv"}

    # config and index
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "toy_moe" and config["torch_dtype"] == "bfloat16"
    qc = config["quantization_config"]
    assert {k: qc[k] for k in QUANTIZATION_CONFIG} == QUANTIZATION_CONFIG
    assert qc["ignored_layers"] == ["model.layers.0.mlp.odd_proj", "model.layers.0.self_attn.o_proj"]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out_tensors)
    assert index["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale_inv"] == SHARD1
    assert index["weight_map"]["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"] == SHARD2
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out_tensors.values())

    # other files copied (subfolders too), other weight formats not
    assert (dst / "tokenizer.json").read_text() == '{"toy": true}'
    assert (dst / "sub" / "notes.txt").read_text() == "kept"
    assert not (dst / "pytorch_model.bin").exists()

    # the summary: one line per tensor (few tensors), reasons, totals
    lines = out.splitlines()
    assert any("self_attn.o_proj.weight" in ln and r"(--skip o_proj\.weight$)" in ln for ln in lines)
    assert any("mlp.gate.weight" in ln and "(MoE router)" in ln for ln in lines)
    assert any("lm_head.weight" in ln and "(lm_head)" in ln for ln in lines)
    assert any("odd_proj.weight" in ln and "N % 8 == 0" in ln for ln in lines)
    assert any("stacked.weight" in ln and "(3-D)" in ln for ln in lines)
    assert any(ln.startswith(f"FP8       {len(QUANTIZED)} tensors; diff max ") for ln in lines)
    assert "not copied (other weight formats): pytorch_model.bin" in out
    rows = list(csv.DictReader(report.open()))
    assert len(rows) == len(original)
    assert {r["name"] for r in rows if r["action"] == "fp8"} == QUANTIZED
    assert max(float(r["diff"]) for r in rows if r["action"] == "fp8") < 1e-3
    assert f"[{len(original)}/{len(original)}] quantize: " in err  # plain progress lines off a TTY


def test_single_file_checkpoint_without_index(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    w = torch.randn(256, 512).to(BF16)
    save_file({"layer.proj.weight": w, "layer.norm.weight": torch.ones(512, dtype=BF16)}, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    assert cli.main(["quantize", str(src), str(tmp_path / "dst"), "--no-progress"]) == 0
    capsys.readouterr()
    out = _load(tmp_path / "dst" / "model.safetensors")
    assert set(out) == {"layer.proj.weight", "layer.proj.weight_scale_inv", "layer.norm.weight"}
    assert not (tmp_path / "dst" / "model.safetensors.index.json").exists()
    assert "ignored_layers" not in json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]


def test_slabs_give_the_whole_tensor_result():
    """Slab-wise quantization (bounded memory) equals per_block on the whole tensor, and its diff is
    calc_diff's value over the whole tensor."""
    w = (torch.randn(640, 384) * torch.linspace(0.1, 10, 640)[:, None]).to(BF16)
    q, s, diff = quantize_weight(w, slab_elems=128 * 384)  # 5 slabs of one block row
    q_ref, s_ref = moe_fp8.quant.per_block(w)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert diff == pytest.approx(moe_fp8.calc_diff(dequant_per_block(q, s), w.float()), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name,shape,dtype,want", [
    ("model.layers.3.mlp.experts.7.down_proj.weight", (7168, 2048), BF16, (True, "")),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), BF16, (True, "")),
    ("model.layers.3.mlp.gate.weight", (256, 7168), BF16, (False, "MoE router")),
    ("model.layers.3.mlp.gate_proj.weight", (18432, 7168), BF16, (True, "")),
    ("model.layers.3.mlp.shared_expert_gate.weight", (1, 2048), BF16, (False, "MoE shared-expert gate")),
    ("model.layers.3.mlp.gate.e_score_correction_bias", (256,), torch.float32, (False, "not a weight")),
    ("model.embed_tokens.weight", (129280, 7168), BF16, (False, "embedding")),
    ("lm_head.weight", (129280, 7168), BF16, (False, "lm_head")),
    # DeepSeek-V3's multi-token-prediction layer: its own projection and head stay bf16 (the engines' MTP modules
    # load them unquantized), its decoder layer is quantized as any other
    ("model.layers.61.eh_proj.weight", (7168, 14336), BF16, (False, "MTP projection")),
    ("model.layers.61.shared_head.head.weight", (129280, 7168), BF16, (False, "MTP head")),
    ("model.layers.61.shared_head.norm.weight", (7168,), BF16, (False, "1-D")),
    ("model.layers.61.embed_tokens.weight", (129280, 7168), BF16, (False, "embedding")),
    ("model.layers.61.mlp.experts.3.up_proj.weight", (2048, 7168), BF16, (True, "")),
    ("model.layers.61.self_attn.o_proj.weight", (7168, 16384), BF16, (True, "")),
    ("model.layers.3.post_attention_layernorm.weight", (7168,), BF16, (False, "1-D")),
    ("model.layers.3.q_a_layernorm.weight", (1, 1536), BF16, (False, "norm")),
    ("model.layers.3.mlp.proj.weight", (64, 100), BF16, (False, "64×100: kernels need N % 8 == 0 and K % 16 == 0")),
    ("model.layers.3.mlp.proj.weight", (64, 128), torch.int8, (False, "dtype int8")),
])
def test_plan_tensor(name, shape, dtype, want):
    assert plan_tensor(name, dtype, shape) == want


def test_refusals_are_one_line_errors(tmp_path, capsys):
    src, _ = _checkpoint(tmp_path)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "something").write_text("x")
    assert cli.main(["quantize", str(src), str(dst)]) == 1
    assert "exists and is not empty; remove it or pass --overwrite" in capsys.readouterr().err
    assert cli.main(["quantize", str(src), str(src)]) == 1
    assert "DST must differ from SRC" in capsys.readouterr().err
    assert cli.main(["quantize", str(tmp_path / "nope"), str(tmp_path / "d2")]) == 1
    assert "has no config.json" in capsys.readouterr().err
    assert cli.main(["quantize", str(src), str(tmp_path / "d3"), "--skip", "(["]) == 1
    assert "is not a regular expression" in capsys.readouterr().err

    # an already-quantized checkpoint is refused
    fp8 = tmp_path / "fp8"
    assert cli.main(["quantize", str(src), str(fp8), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["quantize", str(fp8), str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err
    assert "is already quantized (quantization_config.quant_method = fp8)" in err and "Traceback" not in err


def test_large_summary_shows_worst_and_counts(tmp_path, capsys):
    src, _ = _checkpoint(tmp_path)
    assert cli.main(["quantize", str(src), str(tmp_path / "dst"), "--top", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    fp8 = len(QUANTIZED) + 1  # o_proj too: no --skip here
    assert f"... {fp8 - 2} more FP8 tensors (--report CSV lists every tensor)" in out
    assert "  kept: 1 × MoE router" in out and "  kept: 2 × 1-D" in out
    assert sum(" fp8   " in ln for ln in out.splitlines()) == 2


# --------------------------------------------------------------------------------------------
# bad input, failures half way, unsafe destinations: one error line, DST untouched
# --------------------------------------------------------------------------------------------

def _single(root: Path, name: str = "src", weight: torch.Tensor | None = None, config: str = "{}") -> Path:
    """A one-file bf16 checkpoint: one 256×512 linear weight (or ``weight``) and a norm."""
    src = root / name
    src.mkdir()
    w = torch.randn(256, 512).to(BF16) if weight is None else weight
    save_file({"layer.proj.weight": w, "layer.norm.weight": torch.ones(512, dtype=BF16)}, src / "model.safetensors")
    (src / "config.json").write_text(config)
    return src


def _one_line_error(capsys, rc: int, *parts: str) -> str:
    """``rc`` is 1 and stderr is exactly one ``moe-fp8 quantize: error:`` line containing every part."""
    err = capsys.readouterr().err
    assert rc == 1, err
    assert len(err.splitlines()) == 1 and err.startswith("moe-fp8 quantize: error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in err, (part, err)
    return err


def _siblings(path: Path) -> list[str]:
    """What a run left next to ``path`` besides itself and the source (temporary folders would show here)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + "."))


def _break_config(src: Path, text: str) -> Path:
    (src / "config.json").write_text(text)
    return src / "config.json"


def _break_index(src: Path, text: str) -> Path:
    (src / "model.safetensors.index.json").write_text(text)
    return src / "model.safetensors.index.json"


def _break_shard(src: Path, data: bytes) -> Path:
    (src / "model.safetensors").write_bytes(data)
    return src / "model.safetensors"


@pytest.mark.parametrize("breaks,problem", [
    (lambda s: _break_config(s, "{not json"), "is not valid JSON"),
    (lambda s: _break_config(s, "[1, 2]"), "is not a JSON object"),
    (lambda s: _break_config(s, '{"quantization_config": "fp8"}').parent, "is already quantized"),
    (lambda s: _break_index(s, "{not json"), "is not valid JSON"),
    (lambda s: _break_index(s, '{"weight_map": ["model.safetensors"]}'), "weight_map is not an object"),
    (lambda s: _break_index(s, '{"weight_map": {"a": 3}}'), "is not a file name"),
    (lambda s: _break_index(s, '{"weight_map": {"a": "../model.safetensors"}}'), "outside"),
    (lambda s: _break_shard(s, b"garbage" * 10), "is not a readable safetensors file"),
    (lambda s: _break_shard(s, (s / "model.safetensors").read_bytes()[:-10]), "is not a readable safetensors file"),
])
def test_bad_checkpoints_are_one_line_errors(tmp_path, capsys, breaks, problem):
    src = _single(tmp_path)
    bad_file = breaks(src)
    dst = tmp_path / "dst"
    rc = cli.main(["quantize", str(src), str(dst), "--no-progress"])
    _one_line_error(capsys, rc, str(bad_file), problem)
    assert not dst.exists() and _siblings(dst) == []


def test_index_may_name_shards_in_subfolders(tmp_path, capsys):
    src = _single(tmp_path)
    (src / "part").mkdir()
    (src / "model.safetensors").rename(src / "part" / "model.safetensors")
    _break_index(src, json.dumps({"weight_map": {"layer.proj.weight": "part/model.safetensors",
                                                 "layer.norm.weight": "part/model.safetensors"}}))
    dst = tmp_path / "dst"
    assert cli.main(["quantize", str(src), str(dst), "--no-progress"]) == 0, capsys.readouterr().err
    assert set(_load(dst / "part" / "model.safetensors")) == {"layer.proj.weight", "layer.proj.weight_scale_inv",
                                                              "layer.norm.weight"}
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"part/model.safetensors"}
    assert not (dst / "model.safetensors").exists()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weight_is_refused_by_name(tmp_path, capsys, bad):
    w = torch.randn(256, 512).to(BF16)
    w[3, 5] = bad
    src = _single(tmp_path, weight=w)
    dst = tmp_path / "dst"
    rc = cli.main(["quantize", str(src), str(dst), "--no-progress"])
    _one_line_error(capsys, rc, "layer.proj.weight", str(src / "model.safetensors"), "not finite", "--skip")
    assert not dst.exists() and _siblings(dst) == []


def test_failure_in_a_later_shard_leaves_no_output(tmp_path, capsys):
    """Shard 1 converts, shard 2 fails: nothing of the run remains, and the rerun is not refused."""
    src, _ = _checkpoint(tmp_path)
    s2 = _load(src / SHARD2)
    good = s2["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    s2["model.layers.0.mlp.experts.0.up_proj.weight"][0, 0] = float("inf")
    save_file(s2, src / SHARD2, metadata={"format": "pt"})
    dst = tmp_path / "dst"
    rc = cli.main(["quantize", str(src), str(dst), "--no-progress"])
    _one_line_error(capsys, rc, "model.layers.0.mlp.experts.0.up_proj.weight")
    assert not dst.exists() and _siblings(dst) == []

    # the same into an existing DST with --overwrite: its old contents stay as they were
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    rc = cli.main(["quantize", str(src), str(dst), "--no-progress", "--overwrite"])
    _one_line_error(capsys, rc, "not finite")
    assert sorted(p.name for p in dst.iterdir()) == ["old.txt"] and _siblings(dst) == []

    s2["model.layers.0.mlp.experts.0.up_proj.weight"] = good
    save_file(s2, src / SHARD2, metadata={"format": "pt"})
    assert cli.main(["quantize", str(src), str(tmp_path / "dst2"), "--no-progress"]) == 0


def test_already_fp8_shard_is_refused_before_writing(tmp_path, capsys):
    src, _ = _checkpoint(tmp_path)
    s2 = _load(src / SHARD2)
    s2["model.layers.0.mlp.experts.0.up_proj.weight"] = s2["model.layers.0.mlp.experts.0.up_proj.weight"].to(
        torch.float8_e4m3fn)
    save_file(s2, src / SHARD2, metadata={"format": "pt"})
    dst = tmp_path / "dst"
    rc = cli.main(["quantize", str(src), str(dst)])
    _one_line_error(capsys, rc, "model.layers.0.mlp.experts.0.up_proj.weight", "float8_e4m3fn", str(src / SHARD2))
    assert not dst.exists() and _siblings(dst) == []


def test_overwrite_replaces_every_old_file(tmp_path, capsys):
    """--overwrite of a sharded model by a one-file model: no stale index or shard of the old one remains."""
    sharded, _ = _checkpoint(tmp_path)
    dst = tmp_path / "dst"
    assert cli.main(["quantize", str(sharded), str(dst), "--no-progress"]) == 0
    single = _single(tmp_path, "single")
    assert cli.main(["quantize", str(single), str(dst), "--no-progress", "--overwrite"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert set(_load(dst / "model.safetensors")) == {"layer.proj.weight", "layer.proj.weight_scale_inv",
                                                     "layer.norm.weight"}
    assert _siblings(dst) == []


def test_nested_source_and_destination_are_refused(tmp_path, capsys):
    src = _single(tmp_path)
    rc = cli.main(["quantize", str(src), str(src / "fp8"), "--no-progress"])
    _one_line_error(capsys, rc, "is inside SRC")
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.safetensors"]

    outer = tmp_path / "outer"
    outer.mkdir()
    inner = _single(outer, "inner")
    rc = cli.main(["quantize", str(inner), str(outer), "--no-progress", "--overwrite"])
    _one_line_error(capsys, rc, "is inside DST")
    assert (inner / "model.safetensors").is_file()


def test_report_path_is_checked_before_converting(tmp_path, capsys):
    src = _single(tmp_path)
    # a missing folder is created (as bench --json does) ...
    report = tmp_path / "no" / "dir" / "r.csv"
    assert cli.main(["quantize", str(src), str(tmp_path / "dst"), "--no-progress", "--report", str(report)]) == 0
    assert "wrote " + str(report) in capsys.readouterr().out
    assert len(list(csv.DictReader(report.open()))) == 2
    # ... a folder, or a path under a file, is refused before any work
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad in (tmp_path, blocker / "r.csv"):
        dst = tmp_path / "dst2"
        rc = cli.main(["quantize", str(src), str(dst), "--no-progress", "--report", str(bad)])
        _one_line_error(capsys, rc, "--report", str(bad))
        assert not dst.exists()


def test_top_must_not_be_negative(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["quantize", "--top", "-1", str(tmp_path / "a"), str(tmp_path / "b")])
    assert e.value.code == 2 and "argument --top: must be >= 0, got -1" in capsys.readouterr().err


def test_skip_is_one_pattern_per_flag_and_repeatable(tmp_path, capsys):
    src, _ = _checkpoint(tmp_path)
    dst = tmp_path / "dst"
    # --skip before the positionals takes one pattern, not SRC and DST as well
    assert cli.main(["quantize", "--skip", r"o_proj\.weight$", "--skip", r"experts\.3\.", str(src), str(dst),
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert r"(--skip o_proj\.weight$)" in out and r"(--skip experts\.3\.)" in out
    ignored = json.loads((dst / "config.json").read_text())["quantization_config"]["ignored_layers"]
    assert "model.layers.0.self_attn.o_proj" in ignored and "model.layers.0.mlp.experts.3.up_proj" in ignored
