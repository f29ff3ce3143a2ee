"""DeepSeek-V3-format checkpoints: the writer's exact format, the loaders fill the exact bytes (FP8),
quantize bf16 on load, read only a rank's slice (TP / EP), and refuse mismatches clearly; Qwen3-MoE's
checkpoints in the same format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from moe_fp8 import quant
from moe_fp8.layers import (
    CheckpointReader,
    Fp8FusedMoE,
    Fp8Linear,
    Fp8MLP,
    deepseek_v3_tensor_specs,
    expert_map_for_rank,
    glm4_moe_tensor_specs,
    load_fp8_linear,
    load_fp8_mlp,
    load_fused_moe,
    minimax_m2_tensor_specs,
    qwen3_moe_tensor_specs,
    shard_moe_weights,
    tiny_deepseek_v3_config,
    tiny_glm4_moe_config,
    tiny_kimi_k2_config,
    tiny_minimax_m2_config,
    tiny_qwen3_moe_config,
    write_checkpoint,
    write_deepseek_v3_checkpoint,
    write_qwen3_moe_checkpoint,
)
from moe_fp8.layers.checkpoint import MOE_NAMES, is_moe_layer, model_family

CFG = tiny_deepseek_v3_config(num_hidden_layers=2, n_routed_experts=8, n_group=4, topk_group=2,
                              moe_intermediate_size=256, intermediate_size=384)
MOE = "model.layers.1.mlp"


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("fp8"), CFG, seed=3, num_shards=3)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("bf16"), CFG, seed=4, fp8=False, num_shards=1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _moe(expert_map=None, inter=256, ue8m0=False):
    return Fp8FusedMoE(8, 256, inter, 4, scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       use_correction_bias=True, num_shared_experts=1, shared_intermediate_size=inter,
                       expert_map=expert_map, ue8m0=ue8m0)


def test_writer_format(fp8_ckpt):
    files = sorted(p.name for p in fp8_ckpt.iterdir())
    assert files == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    config = json.loads((fp8_ckpt / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    index = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())
    stored, total = {}, 0
    for file in set(index["weight_map"].values()):
        with safe_open(str(fp8_ckpt / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                t = f.get_tensor(name)
                stored[name] = t
                total += t.numel() * t.element_size()
                assert index["weight_map"][name] == file
    assert index["metadata"]["total_size"] == total
    specs = deepseek_v3_tensor_specs(config)
    fp8_names = {n for n, s in specs.items() if s.fp8}
    assert set(stored) == set(specs) | {n + "_scale_inv" for n in fp8_names}
    for name, spec in specs.items():
        assert tuple(stored[name].shape) == spec.shape
        if spec.fp8:
            assert stored[name].dtype == torch.float8_e4m3fn
            n, k = spec.shape
            assert stored[name + "_scale_inv"].dtype == torch.float32
            assert stored[name + "_scale_inv"].shape == ((n + 127) // 128, (k + 127) // 128)
        else:
            assert stored[name].dtype == spec.dtype
    # DeepSeek-V3 names (spot checks) and what stays unquantized
    for name in (f"{MOE}.experts.7.down_proj.weight", f"{MOE}.shared_experts.gate_proj.weight",
                 "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert specs[name].fp8
    for name in (f"{MOE}.gate.weight", f"{MOE}.gate.e_score_correction_bias", "model.embed_tokens.weight",
                 "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"):
        assert not specs[name].fp8
    assert specs[f"{MOE}.gate.e_score_correction_bias"].dtype == torch.float32
    # same seed, same bytes
    again = write_deepseek_v3_checkpoint(fp8_ckpt.parent / "again", CFG, seed=3, num_shards=3)
    for file in set(index["weight_map"].values()):
        assert (again / file).read_bytes() == (fp8_ckpt / file).read_bytes()


def test_qwen3_moe_writer_and_moe_loader(tmp_path):
    """Qwen3-MoE: its module names (per-head q / k norms, no shared experts, no correction bias), its MoE layer
    placement (``mlp_only_layers``, ``decoder_sparse_step``), and a MoE layer loaded byte for byte."""
    config = tiny_qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=2)
    assert [is_moe_layer(config, i) for i in range(4)] == [False, False, False, True]
    assert [is_moe_layer(tiny_qwen3_moe_config(), i) for i in range(3)] == [False, True, True]
    specs = qwen3_moe_tensor_specs(tiny_qwen3_moe_config())
    attn = "model.layers.1.self_attn"
    assert specs[f"{attn}.k_proj.weight"].shape == (128, 256) and specs[f"{attn}.o_proj.weight"].shape == (256, 256)
    assert specs[f"{attn}.q_norm.weight"].shape == (64,) and not specs[f"{attn}.q_norm.weight"].fp8
    assert specs["model.layers.1.mlp.gate.weight"].shape == (16, 256)
    assert specs["model.layers.1.mlp.experts.15.down_proj.weight"].shape == (256, 128)
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256)
    assert not any("shared_expert" in n or "correction_bias" in n or "kv_" in n for n in specs)
    path = write_qwen3_moe_checkpoint(tmp_path / "q3", seed=1, num_shards=1)
    assert (path / "model-00001-of-00001.safetensors").read_bytes() == (
        write_checkpoint(tmp_path / "again", tiny_qwen3_moe_config(), seed=1, num_shards=1)
        / "model-00001-of-00001.safetensors").read_bytes()
    moe = Fp8FusedMoE(16, 256, 128, 4, scoring_func="softmax")
    with CheckpointReader(path) as reader:
        load_fused_moe(moe, reader, "model.layers.2.mlp")
        gate = reader.get("model.layers.2.mlp.experts.9.gate_proj.weight")
        up_scale = reader.get("model.layers.2.mlp.experts.9.up_proj.weight_scale_inv")
    assert torch.equal(_bytes(moe.w13_weight[9, :128]), _bytes(gate))
    assert torch.equal(moe.w13_weight_scale_inv[9, 1:], up_scale)
    with pytest.raises(ValueError, match="model_type 'llama'"):
        write_checkpoint(tmp_path / "x", {"model_type": "llama"})


def test_glm4_moe_writer(tmp_path):
    """GLM-4.5: grouped-query attention with q / k / v biases (none on o_proj) and per-head norms where
    ``use_qk_norm``, under DeepSeek-V3's MoE block names (router with its correction bias, shared expert), the first
    ``first_k_dense_replace`` layers dense; every written tensor is in the specs."""
    config = tiny_glm4_moe_config()
    assert model_family(config) == "glm4_moe" and [is_moe_layer(config, i) for i in range(3)] == [False, True, True]
    specs = glm4_moe_tensor_specs(config)
    attn = "model.layers.1.self_attn"
    assert specs[f"{attn}.k_proj.weight"].shape == (128, 256) and specs[f"{attn}.k_proj.bias"].shape == (128,)
    assert f"{attn}.o_proj.bias" not in specs and specs[f"{attn}.q_norm.weight"].shape == (64,)
    assert specs["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["model.layers.2.mlp.shared_experts.down_proj.weight"].shape == (256, 128)
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256) and not any("kv_" in n for n in specs)
    assert not any(n.endswith("_norm.weight") and "self_attn" in n
                   for n in glm4_moe_tensor_specs(tiny_glm4_moe_config(use_qk_norm=False)))
    path = write_checkpoint(tmp_path / "glm", config, seed=3, num_shards=1)
    with CheckpointReader(path) as reader:
        assert {n for n in reader if not n.endswith("_scale_inv")} == set(specs)
        assert f"{attn}.q_proj.weight_scale_inv" in reader and f"{attn}.q_proj.bias_scale_inv" not in reader
    assert json.loads((path / "config.json").read_text())["model_type"] == "glm4_moe"


def test_minimax_m2_writer_and_moe_loader(tmp_path):
    """MiniMax-M2: Mixtral's MoE names (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``, the correction bias on
    the block, an fp32 router) in every layer, q / k norms over all heads; ``load_fused_moe`` with its
    ``MOE_NAMES`` reads a block byte for byte (w13 = [w1 | w3])."""
    config = tiny_minimax_m2_config()
    assert model_family(config) == "minimax_m2" and [is_moe_layer(config, i) for i in range(2)] == [True, True]
    specs = minimax_m2_tensor_specs(config)
    block, attn = "model.layers.1.block_sparse_moe", "model.layers.1.self_attn"
    assert specs[f"{block}.gate.weight"].dtype == torch.float32 and not specs[f"{block}.gate.weight"].fp8
    assert specs[f"{block}.e_score_correction_bias"].shape == (16,)
    assert specs[f"{block}.experts.15.w2.weight"].shape == (256, 128) and specs[f"{block}.experts.0.w3.weight"].fp8
    assert specs[f"{attn}.q_norm.weight"].shape == (256,) and specs[f"{attn}.k_norm.weight"].shape == (128,)
    assert not any(".mlp." in n or n.endswith(".bias") for n in specs)
    path = write_checkpoint(tmp_path / "mm", config, seed=4, num_shards=1)
    moe = Fp8FusedMoE(16, 256, 128, 4, scoring_func="sigmoid", use_correction_bias=True)
    with CheckpointReader(path) as reader:
        assert {n for n in reader if not n.endswith("_scale_inv")} == set(specs)
        load_fused_moe(moe, reader, block, names=MOE_NAMES["minimax_m2"])
        up = reader.get(f"{block}.experts.9.w3.weight")
        bias = reader.get(f"{block}.e_score_correction_bias")
        with pytest.raises(KeyError):
            load_fused_moe(moe, reader, block)  # DeepSeek-V3's names are not there
    assert torch.equal(_bytes(moe.w13_weight[9, 128:]), _bytes(up))
    assert torch.equal(moe.e_score_correction_bias, bias)


def test_kimi_k2_is_written_as_deepseek_v3(tmp_path):
    """Kimi-K2 (``model_type = "kimi_k2"``) is DeepSeek-V3's family: the same tensor names, with 384 experts, and
    ``config.json`` keeps its own model type and ``auto_map``."""
    config = tiny_kimi_k2_config()
    assert model_family(config) == "deepseek_v3" and model_family(tiny_qwen3_moe_config()) == "qwen3_moe"
    assert [is_moe_layer(config, i) for i in range(2)] == [False, True]
    path = write_checkpoint(tmp_path / "kimi", config, seed=2, num_shards=1)
    written = json.loads((path / "config.json").read_text())
    assert written["model_type"] == "kimi_k2" and "AutoConfig" in written["auto_map"]
    assert written["quantization_config"]["weight_block_size"] == [128, 128]
    specs = deepseek_v3_tensor_specs(config)
    with CheckpointReader(path) as reader:
        assert {n for n in reader if not n.endswith("_scale_inv")} == set(specs)
        assert reader.shape("model.layers.1.mlp.gate.weight") == (384, 256)
        assert reader.shape("model.layers.1.mlp.experts.383.down_proj.weight_scale_inv") == (2, 1)
    with pytest.raises(ValueError, match="model_type 'mixtral': moe_fp8 knows"):
        model_family({"model_type": "mixtral"})


def test_reader(fp8_ckpt):
    with CheckpointReader(fp8_ckpt) as reader:
        assert reader.config["n_routed_experts"] == 8
        name = f"{MOE}.experts.3.gate_proj.weight"
        assert name in reader and reader.shape(name) == (256, 256)
        full = reader.get(name)
        assert torch.equal(_bytes(reader.get_slice(name, rows=(128, 256))), _bytes(full[128:]))
        assert torch.equal(_bytes(reader.get_slice(name, cols=(0, 128))), _bytes(full[:, :128]))
        with pytest.raises(KeyError, match="not in the checkpoint"):
            reader.get("model.layers.9.mlp.gate.weight")
    single = CheckpointReader(fp8_ckpt / "model-00002-of-00003.safetensors")
    assert set(single.keys()) < set(CheckpointReader(fp8_ckpt).keys())


def test_load_fused_moe_copies_exact_bytes(fp8_ckpt):
    reader = CheckpointReader(fp8_ckpt)
    moe = _moe()
    load_fused_moe(moe, reader, MOE)
    for e in range(8):
        p = f"{MOE}.experts.{e}"
        gate, up, down = (reader.get(f"{p}.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(_bytes(moe.w13_weight[e]), _bytes(torch.cat([gate, up])))
        assert torch.equal(_bytes(moe.w2_weight[e]), _bytes(down))
        assert torch.equal(moe.w13_weight_scale_inv[e], torch.cat([reader.get(f"{p}.gate_proj.weight_scale_inv"),
                                                                     reader.get(f"{p}.up_proj.weight_scale_inv")]))
        assert torch.equal(moe.w2_weight_scale_inv[e], reader.get(f"{p}.down_proj.weight_scale_inv"))
    assert torch.equal(moe.e_score_correction_bias, reader.get(f"{MOE}.gate.e_score_correction_bias"))
    sh = f"{MOE}.shared_experts"
    assert torch.equal(_bytes(moe.shared_experts.gate_up_proj.weight),
                       _bytes(torch.cat([reader.get(f"{sh}.gate_proj.weight"), reader.get(f"{sh}.up_proj.weight")])))
    assert torch.equal(_bytes(moe.shared_experts.down_proj.weight), _bytes(reader.get(f"{sh}.down_proj.weight")))
    assert torch.equal(moe.shared_experts.down_proj.weight_scale_inv, reader.get(f"{sh}.down_proj.weight_scale_inv"))


def test_load_fused_moe_expert_and_tensor_parallel(fp8_ckpt):
    """A rank reads only its experts (EP) and its slice of I (TP): the same tensors as sharding the full layer."""
    reader = CheckpointReader(fp8_ckpt)
    full = _moe()
    load_fused_moe(full, reader, MOE)
    for rank in range(2):
        ep = _moe(expert_map=expert_map_for_rank(8, rank, 2))
        reader.used.clear()
        load_fused_moe(ep, reader, MOE)
        assert torch.equal(_bytes(ep.w13_weight), _bytes(full.w13_weight[rank * 4:(rank + 1) * 4]))
        assert torch.equal(ep.w2_weight_scale_inv, full.w2_weight_scale_inv[rank * 4:(rank + 1) * 4])
        read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n in reader.used if ".experts." in n}
        assert read_experts == set(range(rank * 4, rank * 4 + 4))

        tp = _moe(inter=128)
        load_fused_moe(tp, reader, MOE, tp_rank=rank, tp_size=2)
        w13, s13, w2, s2 = shard_moe_weights(full.w13_weight, full.w13_weight_scale_inv, full.w2_weight,
                                             full.w2_weight_scale_inv, rank, 2)
        assert torch.equal(_bytes(tp.w13_weight), _bytes(w13)) and torch.equal(tp.w13_weight_scale_inv, s13)
        assert torch.equal(_bytes(tp.w2_weight), _bytes(w2)) and torch.equal(tp.w2_weight_scale_inv, s2)
        half = slice(rank * 128, (rank + 1) * 128)
        assert torch.equal(_bytes(tp.shared_experts.down_proj.weight),
                           _bytes(full.shared_experts.down_proj.weight[:, half]))


def test_load_linear_and_mlp(fp8_ckpt):
    reader = CheckpointReader(fp8_ckpt)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa"  # ragged N = 160
    lin = Fp8Linear(256, 160)
    load_fp8_linear(lin, reader, name)
    assert torch.equal(_bytes(lin.weight), _bytes(reader.get(f"{name}.weight")))
    assert torch.equal(lin.weight_scale_inv, reader.get(f"{name}.weight_scale_inv"))
    mlp = Fp8MLP(256, 384)
    load_fp8_mlp(mlp, reader, "model.layers.0.mlp")
    gate, up = reader.get("model.layers.0.mlp.gate_proj.weight"), reader.get("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(_bytes(mlp.gate_up_proj.weight), _bytes(torch.cat([gate, up])))


def test_bf16_checkpoint_is_quantized_on_load(bf16_ckpt):
    reader = CheckpointReader(bf16_ckpt)
    assert "quantization_config" not in reader.config
    assert not any(n.endswith("_scale_inv") for n in reader)
    moe = _moe()
    load_fused_moe(moe, reader, MOE)
    gate = reader.get(f"{MOE}.experts.2.gate_proj.weight")
    up = reader.get(f"{MOE}.experts.2.up_proj.weight")
    assert gate.dtype == torch.bfloat16
    w, s = quant.per_block(torch.cat([gate, up]))
    assert torch.equal(_bytes(moe.w13_weight[2]), _bytes(w)) and torch.equal(moe.w13_weight_scale_inv[2], s)
    tp = _moe(inter=128)
    load_fused_moe(tp, reader, MOE, tp_rank=1, tp_size=2)
    w, s = quant.per_block(reader.get(f"{MOE}.experts.2.down_proj.weight")[:, 128:].contiguous())
    assert torch.equal(_bytes(tp.w2_weight[2]), _bytes(w)) and torch.equal(tp.w2_weight_scale_inv[2], s)


def test_loaders_refuse_mismatches(fp8_ckpt, tmp_path):
    reader = CheckpointReader(fp8_ckpt)
    with pytest.raises(ValueError, match="expects"):
        load_fused_moe(Fp8FusedMoE(8, 256, 128, 4, scoring_func="sigmoid"), reader, MOE)  # wrong I
    with pytest.raises(ValueError, match="multiple of 128"):
        load_fused_moe(_moe(inter=128), reader, MOE, tp_rank=0, tp_size=4)  # 256 / 4 = 64
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.0"):
        load_fused_moe(_moe(), reader, "model.layers.0.mlp")  # a dense layer has no experts
    with pytest.raises(ValueError, match="rows"):
        load_fp8_linear(Fp8Linear(256, 256), reader, "model.layers.0.self_attn.kv_a_proj_with_mqa")
    bad = dict(CFG, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [1, 32]})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="weight_block_size"):
        CheckpointReader(tmp_path)
    with pytest.raises(FileNotFoundError):
        CheckpointReader(tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------------
# UE8M0 (DeepSeek-V3.1: quantization_config.scale_fmt = "ue8m0", power-of-two scales)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ue8m0_ckpt(tmp_path_factory):
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("ue8m0"), CFG, seed=7, scale_fmt="ue8m0")


def test_ue8m0_checkpoint_loads_into_ue8m0_layers(ue8m0_ckpt):
    config = json.loads((ue8m0_ckpt / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    reader = CheckpointReader(ue8m0_ckpt)
    assert reader.ue8m0
    scale = reader.get(f"{MOE}.experts.0.gate_proj.weight_scale_inv")
    assert scale.dtype == torch.float32 and torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    moe = _moe(ue8m0=True)
    load_fused_moe(moe, reader, MOE)
    gate = reader.get(f"{MOE}.experts.5.gate_proj.weight")
    assert torch.equal(_bytes(moe.w13_weight[5, :256]), _bytes(gate))
    assert torch.equal(moe.w2_weight_scale_inv[5], reader.get(f"{MOE}.experts.5.down_proj.weight_scale_inv"))
    load_fp8_mlp(Fp8MLP(256, 384, ue8m0=True), reader, "model.layers.0.mlp")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert moe(x, torch.randn(5, 8, generator=torch.Generator().manual_seed(1))).isfinite().all()


def test_ue8m0_mismatches_are_refused(fp8_ckpt, ue8m0_ckpt, bf16_ckpt, tmp_path):
    # a V3.1 checkpoint into a layer that would quantize activations with fp32 scales
    with pytest.raises(ValueError, match=r"scale_fmt = 'ue8m0'.*built with ue8m0=False"):
        load_fused_moe(_moe(), CheckpointReader(ue8m0_ckpt), MOE)
    with pytest.raises(ValueError, match="built with ue8m0=False"):
        load_fp8_linear(Fp8Linear(256, 160), ue8m0_ckpt, "model.layers.0.self_attn.kv_a_proj_with_mqa")
    # fp32-scale weights into a UE8M0 layer: the scales are checked, the tensor named
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight_scale_inv: scale_fmt 'ue8m0' needs "
                                         r"positive power-of-two scales"):
        load_fused_moe(_moe(ue8m0=True), CheckpointReader(fp8_ckpt), MOE)
    # a bf16 checkpoint into a UE8M0 layer is quantized with power-of-two scales
    mlp = Fp8MLP(256, 384, ue8m0=True)
    load_fp8_mlp(mlp, bf16_ckpt, "model.layers.0.mlp")
    w, s = quant.per_block(CheckpointReader(bf16_ckpt).get("model.layers.0.mlp.down_proj.weight"), ue8m0=True)
    assert torch.equal(_bytes(mlp.down_proj.weight), _bytes(w)) and torch.equal(mlp.down_proj.weight_scale_inv, s)
    # scale formats moe_fp8 does not read
    bad = dict(CFG, quantization_config={**json.loads((ue8m0_ckpt / "config.json").read_text())[
        "quantization_config"], "scale_fmt": "fp16"})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match=r"config\.json: moe_fp8: quantization_config\.scale_fmt .* got 'fp16'"):
        CheckpointReader(tmp_path)
    # the other rules are the engines' (moe_fp8.layers.quant_config), with the file named
    (tmp_path / "config.json").write_text(json.dumps(dict(CFG, quantization_config={"quant_method": "fp8"})))
    with pytest.raises(ValueError, match=r"config\.json: .*weight_block_size is missing"):
        CheckpointReader(tmp_path)
    with pytest.raises(ValueError, match="scale_fmt"):
        write_deepseek_v3_checkpoint(tmp_path / "x", CFG, scale_fmt="ue8m0", fp8=False)


def _edited(fp8_ckpt, path, edit):
    """A one-file copy of ``fp8_ckpt`` with ``edit(tensors)`` applied (a dict of name -> tensor)."""
    from safetensors.torch import save_file

    reader = CheckpointReader(fp8_ckpt)
    names = reader.keys()
    tensors = {name: reader.get(name).contiguous() for name in names if name.startswith("model.layers.")}
    edit(tensors)
    save_file(tensors, str(path))
    return CheckpointReader(path)


def test_loaders_refuse_damaged_or_unplaced_tensors(fp8_ckpt, tmp_path):
    up = f"{MOE}.experts.0.up_proj"

    def bigger_up(t):  # an up projection with more rows than the gate's: was cut to the gate's I without a word
        t[f"{up}.weight"] = torch.cat([t[f"{up}.weight"]] * 2)
        t[f"{up}.weight_scale_inv"] = torch.cat([t[f"{up}.weight_scale_inv"]] * 2)

    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \(512, 256\), which disagrees"):
        load_fused_moe(_moe(), _edited(fp8_ckpt, tmp_path / "a.safetensors", bigger_up), MOE)

    def wider_down(t):
        down = f"{MOE}.experts.1.down_proj"
        t[f"{down}.weight"] = torch.cat([t[f"{down}.weight"]] * 2, dim=1)
        t[f"{down}.weight_scale_inv"] = torch.cat([t[f"{down}.weight_scale_inv"]] * 2, dim=1)

    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.weight has shape \(256, 512\)"):
        load_fused_moe(_moe(), _edited(fp8_ckpt, tmp_path / "b.safetensors", wider_down), MOE)

    scale = f"{MOE}.experts.2.gate_proj.weight_scale_inv"
    for value, exc, pattern in ((float("nan"), ValueError, "finite and >= 0"), (-1.0, ValueError, "finite and >= 0"),
                                (float("inf"), ValueError, "finite and >= 0"), (None, TypeError, "not a scale tensor")):
        def damage(t, value=value):
            if value is None:
                t[scale] = t[scale].to(torch.int32)
            else:
                t[scale][1, 0] = value

        with pytest.raises(exc, match=f"{scale}.*{pattern}" if exc is ValueError else pattern):
            load_fused_moe(_moe(), _edited(fp8_ckpt, tmp_path / f"c{value}.safetensors", damage), MOE)

    # tensors the module has no place for: dropping them would change what the layer computes
    reader = CheckpointReader(fp8_ckpt)
    no_bias = Fp8FusedMoE(8, 256, 256, 4, scoring_func="sigmoid", n_group=4, topk_group=2, num_shared_experts=1,
                          shared_intermediate_size=256)
    with pytest.raises(ValueError, match="use_correction_bias=True"):
        load_fused_moe(no_bias, reader, MOE)
    no_shared = Fp8FusedMoE(8, 256, 256, 4, scoring_func="sigmoid", n_group=4, topk_group=2, use_correction_bias=True)
    with pytest.raises(ValueError, match="no shared experts"):
        load_fused_moe(no_shared, reader, MOE)

    def with_bias(t):
        t[f"{MOE}.shared_experts.down_proj.bias"] = torch.zeros(256)

    with pytest.raises(ValueError, match="has no bias"):
        load_fp8_linear(Fp8Linear(256, 256), _edited(fp8_ckpt, tmp_path / "d.safetensors", with_bias),
                        f"{MOE}.shared_experts.down_proj")
    # a module on the meta device has no storage: copy_ would do nothing and the load would "succeed"
    with pytest.raises(ValueError, match="meta device"):
        load_fused_moe(Fp8FusedMoE(8, 256, 256, 4, scoring_func="sigmoid", n_group=4, topk_group=2,
                                   use_correction_bias=True, num_shared_experts=1, shared_intermediate_size=256,
                                   device="meta"), reader, MOE)


def test_load_fp8_checks_everything_before_copying():
    layer = Fp8Linear(256, 128)
    w = torch.randn(128, 256).to(torch.float8_e4m3fn)
    s = torch.full((1, 2), 0.5)
    for bad_scale in (s[:, :1], torch.tensor([[0.5, float("nan")]]), torch.tensor([[0.5, -2.0]])):
        with pytest.raises(ValueError, match="weight_scale_inv"):
            layer.load_fp8_(w, bad_scale)
        assert layer.weight.view(torch.uint8).eq(0).all() and layer.weight_scale_inv.eq(1).all()  # untouched
    with pytest.raises(ValueError, match="bias given"):
        layer.load_fp8_(w, s, torch.zeros(128))
    assert layer.weight.view(torch.uint8).eq(0).all()
    layer.load_fp8_(w, s)
    assert torch.equal(layer.weight.view(torch.uint8), w.view(torch.uint8)) and layer.weight_scale_inv.eq(0.5).all()
    with pytest.raises(ValueError, match="meta device"):
        Fp8Linear(256, 128, device="meta").load_fp8_(w, s)
