"""`moe-fp8 demo` on CPU at small settings: the model it builds, the report (JSON and text), the
numbers it checks, and its errors. The numerics themselves are tested in test_layers_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch

from moe_fp8 import cli, demo

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU run through the command line: 2 layers (1 dense + 1 MoE), batch 2, 6-token prompt, 3 new tokens."""
    save = tmp_path_factory.mktemp("demo") / "ckpt"
    capsys_out: dict[str, str] = {}

    def go(capsys):
        if not capsys_out:
            argv = ["demo", "--layers", "2", "--tokens", "3", "--batch", "2", "--prompt-len", "6", "--device", "cpu",
                    "--seed", "1", "--save", str(save), "--json"]
            assert cli.main(argv) == 0
            capsys_out["out"], capsys_out["err"] = capsys.readouterr()
        return json.loads(capsys_out["out"]), capsys_out["err"], save
    return go


def test_demo_report(run, capsys):
    report, err, save = run(capsys)
    assert err.splitlines() == ["[1/5] demo: write checkpoint", "[2/5] demo: load model",
                                "[3/5] demo: compare logits with the bf16 model",
                                "[4/5] demo: warm-up (JIT compile on Hopper)", "[5/5] demo: generate 3 tokens"]
    m = report["model"]
    assert (m["layers"], m["moe_layers"], m["moe_blocks"], m["routed_experts"], m["top_k"]) == (2, 1, 1, 16, 4)
    assert m["checkpoint"] == str(save) and (save / "config.json").is_file()
    assert json.loads((save / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    # CPU: every op on the PyTorch reference, named as such
    assert report["device"] == "cpu" and set(report["backends"]) == set(demo.OPS)
    assert set(report["backends"].values()) == {"reference"} and report["backend"] == "reference for every op"
    lg = report["logits"]
    assert 0 < lg["diff_same_routing"] < demo.DIFF_BOUND == lg["bound"]
    assert lg["router_disagrees"] == 0 and lg["routing_choices"] == 2 * 6 * 4
    assert lg["diff"] >= 0 and 0 <= lg["routing_differs"] <= lg["routing_choices"]
    g = report["generate"]
    assert (g["batch"], g["prompt_tokens"], g["new_tokens"]) == (2, 6, 3)
    assert len(g["sample"]) == 3 and all(0 <= t < m["vocab"] for t in g["sample"])
    assert g["tokens_per_s"] == pytest.approx(6 / report["seconds"]["generate"])
    assert report["moe_path"] == {"prompt": "masked", "decode": "masked"}


def test_demo_text(run, capsys):
    report, _, _ = run(capsys)
    text = demo.format_report(report)
    lines = text.splitlines()
    assert lines[0].startswith("model     DeepSeek-V3 architecture, random block-FP8 weights: 2 layers (1 dense, 1 MoE")
    assert "device    cpu; backend: reference for every op" in lines
    assert any(ln.startswith("logits    calc_diff vs the bf16 model on the dequantized weights: ") and "bound 0.002" in ln
               for ln in lines)
    assert any(ln.startswith("generate  2 × 3 tokens after 6 prompt tokens in ") and "tokens/s" in ln for ln in lines)


def test_summarize_backends():
    assert demo.summarize_backends({"a": "hopper", "b": "hopper"}) == "hopper for every op"
    assert (demo.summarize_backends({"fp8_gemm": "reference", "combine": "portable", "fp8_grouped_gemm_masked": "reference"})
            == "reference (fp8_gemm, fp8_grouped_gemm_masked); portable (combine)")


def test_one_layer_is_a_moe_layer(tmp_path, capsys):
    """--layers 1: the single layer is MoE (no dense layer first), still within the bound."""
    report = demo.run_demo(layers=1, tokens=1, batch=1, prompt_len=4, device="cpu", seed=2)
    assert report["model"]["moe_layers"] == 1 and report["generate"]["new_tokens"] == 1
    assert report["logits"]["diff_same_routing"] < demo.DIFF_BOUND


@pytest.mark.parametrize("arch,name,counts", [("glm4_moe", "GLM-4.5", (1, 16, 4, 1, 9)),
                                             ("minimax_m2", "MiniMax-M2", (2, 16, 4, 0, 8))])
def test_more_families_demo(arch, name, counts, capsys):
    """--arch glm4_moe (DeepSeek-V3's MoE block, grouped-query attention with biases) and --arch minimax_m2
    (Mixtral's tensor names, every layer MoE, no shared expert) through the same checks; ``counts``: MoE layers,
    routed experts, top-k, shared experts, FP8 linears."""
    from moe_fp8.integrations.transformers import ARCHITECTURES

    assert cli.main(["demo", "--arch", arch, "--layers", "2", "--tokens", "2", "--prompt-len", "5",
                     "--device", "cpu", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert m["arch"] == arch and m["architecture"].startswith(ARCHITECTURES[arch].causal_lm)
    assert (m["moe_layers"], m["routed_experts"], m["top_k"], m["shared_experts"], m["fp8_linears"]) == counts
    assert report["logits"]["diff_same_routing"] < demo.DIFF_BOUND and report["logits"]["router_disagrees"] == 0
    assert demo.format_report(report).startswith(f"model     {name} architecture, random block-FP8 weights: 2 layers")


def test_qwen3_moe_demo(capsys):
    """--arch qwen3_moe: a Qwen3-MoE checkpoint (softmax routing, no shared expert) through the same checks."""
    assert cli.main(["demo", "--arch", "qwen3_moe", "--layers", "2", "--tokens", "2", "--prompt-len", "5",
                     "--device", "cpu", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert m["arch"] == "qwen3_moe" and m["architecture"].startswith("Qwen3MoeForCausalLM")
    assert (m["moe_layers"], m["routed_experts"], m["top_k"], m["shared_experts"], m["fp8_linears"]) == (1, 16, 4, 0, 9)
    assert report["logits"]["diff_same_routing"] < demo.DIFF_BOUND and report["logits"]["router_disagrees"] == 0
    text = demo.format_report(report).splitlines()
    assert text[0].startswith("model     Qwen3-MoE architecture, random block-FP8 weights: 2 layers (1 dense, 1 MoE: "
                              "16 experts top-4), ")
    assert text[1].startswith("          transformers Qwen3MoeForCausalLM with 9 Fp8Linear/Fp8MLP")
    with pytest.raises(ValueError, match="arch must be one of"):
        demo.run_demo(arch="llama")
    from moe_fp8.integrations.transformers import ARCHITECTURES
    from moe_fp8.layers.checkpoint import MODEL_FAMILIES

    # every model type the integration reads, and the command's --arch choices
    assert sorted(MODEL_FAMILIES) == sorted(demo.ARCHS)
    assert set(MODEL_FAMILIES.values()) == set(ARCHITECTURES)
    parser = cli.build_parser()
    demo_parser = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" demo"))
    assert tuple(next(a for a in demo_parser._actions if a.dest == "arch").choices) == demo.ARCHS


def test_kimi_k2_demo(capsys):
    """--arch kimi_k2: a Kimi-K2 checkpoint (model_type kimi_k2, 384 experts top-8 in one group) read as
    DeepSeek-V3, through the same checks."""
    assert cli.main(["demo", "--arch", "kimi_k2", "--layers", "2", "--tokens", "2", "--prompt-len", "5",
                     "--device", "cpu", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    m = report["model"]
    assert m["arch"] == "kimi_k2" and m["architecture"].startswith("DeepseekV3ForCausalLM")
    assert (m["moe_layers"], m["routed_experts"], m["top_k"], m["shared_experts"]) == (1, 384, 8, 1)
    assert report["logits"]["diff_same_routing"] < demo.DIFF_BOUND and report["logits"]["router_disagrees"] == 0
    assert demo.format_report(report).startswith("model     Kimi-K2 architecture, random block-FP8 weights: 2 layers "
                                                 "(1 dense, 1 MoE: 384 experts top-8 + 1 shared), ")


@pytest.mark.parametrize("argv,message", [
    (["demo", "--arch", "llama"], "argument --arch: invalid choice: 'llama'"),
    (["demo", "--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["demo", "--device", "tpu"], "argument --device: 'tpu' is not a torch device (cpu, cuda, cuda:N)"),
    (["demo", "--device", "meta"], "argument --device: must be cpu, cuda or cuda:N, not meta"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_errors_are_one_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "--device", "cuda", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moe-fp8 demo: error: --device cuda: no CUDA GPU is visible; use --device cpu")
    assert "Traceback" not in err

    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    assert cli.main(["demo", "--no-progress"]) == 1
    assert ("error: the demo runs a transformers model (DeepseekV3ForCausalLM / Qwen3MoeForCausalLM / "
            "Glm4MoeForCausalLM / MiniMaxM2ForCausalLM): pip install 'moe-fp8[transformers]'" in capsys.readouterr().err)
    monkeypatch.setattr(cli.importlib.util, "find_spec", real)

    def wrong(**kwargs):
        raise demo.DemoError("logits differ from the bf16 model by calc_diff 5.0e-02 with the same experts")
    monkeypatch.setattr(demo, "run_demo", wrong)
    assert cli.main(["demo", "--no-progress"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "moe-fp8 demo: error: logits differ from the bf16 model by calc_diff 5.0e-02 with the same experts",
        "  this is a bug: please report it with the output of `moe-fp8 info`"]


def test_save_refuses_a_non_empty_folder_or_a_file(tmp_path, capsys):
    """--save writes a whole checkpoint: into a folder with files it would mix or overwrite them, and a file
    cannot hold it; both are refused before any work, like quantize's DST."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path, why in ((mine, "exists and is not empty"), (afile, "exists and is not a directory")):
        assert cli.main(["demo", "--device", "cpu", "--layers", "1", "--tokens", "1", "--save", str(path),
                         "--no-progress"]) == 1
        out, err = capsys.readouterr()
        assert err.splitlines() == [f"moe-fp8 demo: error: --save {path} {why}; "
                                    f"{'remove it or ' if 'empty' in why else ''}give a new or empty folder"]
        assert out == ""
    assert [p.name for p in mine.iterdir()] == ["config.json"] and (mine / "config.json").read_text() == '{"mine": 1}'
    assert afile.read_text() == "x"
    with pytest.raises(ValueError, match="exists and is not empty"):
        demo.run_demo(layers=1, tokens=1, batch=1, prompt_len=2, device="cpu", save=mine)
