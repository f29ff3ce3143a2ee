"""moe_fp8's SGLang integration inside the real SGLang (CPU: layers, loaders, routing; reference backend).

Skipped where SGLang is not installed (CI). `bash scripts/engine_check.sh sglang` installs the pinned
SGLang in a virtualenv and runs this file; its latest output is docs/engines/sglang-cpu-check.md.

What runs for real on CPU: plugin discovery and registration, `--quantization moe_fp8` through SGLang's
argument parser and ModelConfig, SGLang's linear / FusedMoE layers built with our methods (world size 1
over gloo; tensor / expert parallel ranks simulated with SGLang's own parallel-state overrides), SGLang's
weight loaders filling them from a DeepSeek-V3-format checkpoint, SGLang's TopK router, and the layers'
forward through SGLang's dispatcher into our apply (moe_fp8's reference backend, since there is no GPU).
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

import moe_fp8  # noqa: E402
from moe_fp8.integrations import sglang as integration  # noqa: E402
from moe_fp8.layers import (  # noqa: E402
    CheckpointReader,
    Fp8FusedMoE,
    Fp8Linear,
    expert_map_for_rank,
    load_fused_moe,
    shard_fp8_linear,
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
from moe_fp8.layers.checkpoint import MOE_NAMES  # noqa: E402
from moe_fp8.quant import dequant_per_block, per_block  # noqa: E402

DEEPSEEK_V3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MOE_PREFIX = "model.layers.1.mlp"  # first MoE layer of tiny_deepseek_v3_config (layer 0 is dense)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sgl():
    """SGLang's distributed state (world size 1, gloo) and our method registered; yields the config class."""
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=_free_port(), backend="gloo")
    config_cls = integration.enable()
    # Everything here is on CPU: the ops must run on the reference backend (no silent other path).
    assert moe_fp8.backend("fp8_gemm", "cpu") == "reference"
    return config_cls


@pytest.fixture
def config(sgl):
    return sgl.from_config(dict(DEEPSEEK_V3))


@contextmanager
def simulated_rank(mode: str, rank: int, size: int = 2) -> Iterator[None]:
    """Build layers as rank ``rank`` of ``size`` would, in this one process (SGLang's own override of its
    parallel state; the groups are metadata only, no collective runs). ``mode``: ``"tp"`` (attention and
    MoE tensor parallel) or ``"ep"`` (attention TP, MoE expert parallel)."""
    from sglang.test.parallel_groups import parallel_scope

    values = {"tp_rank": rank, "tp_size": size, "attn_tp_rank": rank, "attn_tp_size": size}
    group = SimpleNamespace(rank_in_group=rank, world_size=size)
    if mode == "tp":
        values.update(moe_tp_rank=rank, moe_tp_size=size, moe_tp_group=group)
    elif mode == "ep":
        values.update(moe_ep_rank=rank, moe_ep_size=size, moe_tp_rank=0, moe_tp_size=1, moe_ep_group=group)
    else:
        raise AssertionError(mode)
    with parallel_scope(**values):
        yield


def _fp8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return per_block(torch.randn(n, k, generator=g) * 0.05)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------
def test_plugin_is_discovered_by_sglang(sgl):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert plugins["moe_fp8"][0] is integration.enable
    assert plugins["moe_fp8"][1] == "moe-fp8"


def test_enable_registers_the_quantization_method(sgl):
    from sglang.srt.layers import quantization
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.server_args import QUANTIZATION_CHOICES

    assert sgl.__name__ == "MoeFp8Config" and sgl is integration.MoeFp8Config
    assert quantization.QUANTIZATION_METHODS["moe_fp8"] is sgl
    assert get_quantization_config("moe_fp8") is sgl
    assert integration.is_enabled()
    assert integration.enable() is sgl  # idempotent
    assert QUANTIZATION_CHOICES.count("moe_fp8") == 1
    # Another class under our name is refused, never silently replaced.
    quantization.QUANTIZATION_METHODS["moe_fp8"] = quantization.QUANTIZATION_METHODS["fp8"]
    try:
        with pytest.raises(RuntimeError, match="already maps 'moe_fp8'"):
            integration.enable()
    finally:
        quantization.QUANTIZATION_METHODS["moe_fp8"] = sgl


@pytest.mark.parametrize("write", [write_deepseek_v3_checkpoint, write_qwen3_moe_checkpoint],
                         ids=["deepseek_v3", "qwen3_moe"])
def test_flag_selects_moe_fp8_for_a_block_fp8_checkpoint(sgl, tmp_path, write):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.server_args import prepare_server_args

    path = write(tmp_path / "ckpt", num_shards=1)
    args = prepare_server_args(["--model-path", str(path), "--quantization", "moe_fp8", "--device", "cpu"])
    model_config = ModelConfig.from_server_args(args)
    assert model_config.quantization == "moe_fp8"  # the checkpoint says "fp8"; the flag wins
    quant_config = get_quant_config(model_config, LoadConfig(), {})
    assert isinstance(quant_config, sgl) and quant_config.get_name() == "moe_fp8"

    # Without the flag the checkpoint keeps SGLang's own fp8 method: we claim nothing unasked.
    plain = ModelConfig.from_server_args(prepare_server_args(["--model-path", str(path), "--device", "cpu"]))
    assert plain.quantization == "fp8"


def test_flag_on_an_unsupported_checkpoint_names_the_field(sgl, tmp_path):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.server_args import prepare_server_args

    cfg = tiny_deepseek_v3_config(quantization_config={**DEEPSEEK_V3, "weight_block_size": [1, 128]})
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    args = prepare_server_args(["--model-path", str(path), "--quantization", "moe_fp8", "--device", "cpu"])
    model_config = ModelConfig.from_server_args(args)
    with pytest.raises(ValueError, match=r"quantization_config\.weight_block_size must be \[128, 128\]"):
        get_quant_config(model_config, LoadConfig(), {})


def test_config_accepts_deepseek_v3_and_refuses_bad_ones(sgl):
    config = sgl.from_config(dict(DEEPSEEK_V3))
    assert config.get_name() == "moe_fp8"
    assert config.weight_block_size == [128, 128] and config.activation_scheme == "dynamic"
    for change, field in (({"weight_block_size": [128, 64]}, "weight_block_size"),
                          ({"activation_scheme": "static"}, "activation_scheme"),
                          ({"quant_method": "gptq"}, "quant_method")):
        with pytest.raises(ValueError, match=rf"quantization_config\.{field}"):
            sgl.from_config({**DEEPSEEK_V3, **change})
    assert sgl.override_quantization_method(dict(DEEPSEEK_V3), "moe_fp8") == "moe_fp8"
    assert sgl.override_quantization_method(dict(DEEPSEEK_V3), None) is None
    assert sgl.override_quantization_method(dict(DEEPSEEK_V3), "fp8") is None
    assert sgl.override_quantization_method({"quant_method": "awq"}, "moe_fp8") is None
    with pytest.raises(ValueError, match="no quantization_config"):  # SGLang builds quant_cls() for a checkpoint
        sgl()                                                       # without one


# ----------------------------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------------------------
def _linear(kind: str, config, prefix: str = "model.layers.0.self_attn.x_proj"):
    from sglang.srt.layers import linear as L

    common = {"bias": False, "params_dtype": torch.bfloat16, "quant_config": config, "prefix": prefix}
    if kind == "replicated":  # DeepSeek's fused_qkv_a_proj_with_mqa shape class: ragged N (not % 128)
        return L.ReplicatedLinear(256, 576, **common)
    if kind == "column":
        return L.ColumnParallelLinear(256, 384, **common)
    if kind == "merged":
        return L.MergedColumnParallelLinear(256, [256, 256], **common)
    if kind == "qkv":
        return L.QKVParallelLinear(256, 64, 4, 2, **common)
    if kind == "row":
        return L.RowParallelLinear(512, 256, **common)
    raise AssertionError(kind)


# checkpoint tensors (name → (N, K)) and the shard id the layer's loader takes for each
LINEAR_PARTS = {
    "replicated": [(None, 576, 256)],
    "column": [(None, 384, 256)],
    "merged": [(0, 256, 256), (1, 256, 256)],
    "qkv": [("q", 256, 256), ("k", 128, 256), ("v", 128, 256)],
    "row": [(None, 256, 512)],
}


def _load_linear(layer, parts: list[tuple[object, torch.Tensor, torch.Tensor]]) -> None:
    for shard_id, w, s in parts:
        for param, tensor in ((layer.weight, w), (layer.weight_scale_inv, s)):
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("kind", list(LINEAR_PARTS))
def test_linear_weights_load_and_forward(config, kind):
    from sglang.srt.layers.parameter import BlockQuantScaleParameter, ModelWeightParameter

    layer = _linear(kind, config)
    from moe_fp8.integrations.sglang.linear import MoeFp8LinearMethod

    assert isinstance(layer.quant_method, MoeFp8LinearMethod)
    n = sum(p[1] for p in LINEAR_PARTS[kind])
    k = LINEAR_PARTS[kind][0][2]
    params = dict(layer.named_parameters())
    assert set(params) == {"weight", "weight_scale_inv"}
    assert isinstance(layer.weight, ModelWeightParameter) and isinstance(layer.weight_scale_inv, BlockQuantScaleParameter)
    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight.shape) == (n, k)
    assert layer.weight_scale_inv.dtype == torch.float32
    assert tuple(layer.weight_scale_inv.shape) == (math.ceil(n / 128), math.ceil(k / 128))
    if kind != "replicated":  # the TP-aware loader, routed by our scheme
        assert layer.weight.weight_loader == layer.weight_loader_v2

    parts = [(sid, *_fp8(pn, pk, seed)) for seed, (sid, pn, pk) in enumerate(LINEAR_PARTS[kind])]
    _load_linear(layer, parts)
    w_full = torch.cat([p[1] for p in parts])
    s_full = torch.cat([p[2] for p in parts])
    assert torch.equal(layer.weight.view(torch.uint8), w_full.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.data, s_full)

    x = torch.randn(2, 5, k, dtype=torch.bfloat16)
    out = layer(x)[0]
    assert out.shape == (2, 5, n) and out.dtype == torch.bfloat16
    # Same computation as our own layer on the same weights (bit for bit on the reference backend) ...
    assert torch.equal(out, Fp8Linear.from_fp8(w_full, s_full)(x))
    # ... and a faithful linear: DESIGN §6 layer threshold against the dequantized weights in fp32.
    ref = x.float() @ dequant_per_block(w_full, s_full).t()
    assert moe_fp8.calc_diff(out, ref) < 2e-3
    assert torch.isfinite(out).all()
    assert layer(x[:0, :0])[0].shape == (0, 0, n)  # empty batch (idle DP rank)


def test_linear_bias_and_missing_scale(config):
    from sglang.srt.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(256, 256, bias=True, params_dtype=torch.bfloat16, quant_config=config, prefix="p")
    w, s = _fp8(256, 256, 3)
    layer.weight.weight_loader(layer.weight, w)
    with pytest.raises(ValueError, match=r"weight_scale_inv .* was not"):
        layer.quant_method.process_weights_after_loading(layer)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s)
    layer.bias.data.copy_(torch.randn(256))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ours = Fp8Linear.from_fp8(w, s, bias=layer.bias.data.to(torch.bfloat16))
    assert torch.equal(layer(x)[0], ours(x))


def test_linear_refuses_what_the_gemm_cannot_run(config):
    from sglang.srt.layers.linear import ReplicatedLinear

    with pytest.raises(ValueError, match=r"in_features \(K\) must be a positive multiple of 16"):
        ReplicatedLinear(200, 256, bias=False, params_dtype=torch.bfloat16, quant_config=config, prefix="p")


def test_ignored_layers_stay_unquantized(sgl):
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    config = sgl.from_config({**DEEPSEEK_V3, "ignored_layers": ["model.layers.0.mlp.down_proj"]})
    layer = ReplicatedLinear(256, 256, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                             prefix="model.layers.0.mlp.down_proj")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("rank", [0, 1])
def test_linear_tensor_parallel_shards_match_ours(config, rank):
    """SGLang's loaders, fed the full checkpoint tensors on simulated rank `rank` of 2, keep exactly the
    shards moe_fp8.layers.shard_fp8_linear defines (column: gate and up split separately; row: K split)."""
    gate, up, down = _fp8(512, 256, 10), _fp8(512, 256, 11), _fp8(256, 512, 12)
    from sglang.srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    merged_full = torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]])
    with simulated_rank("tp", rank):
        merged = MergedColumnParallelLinear(256, [512, 512], bias=False, params_dtype=torch.bfloat16,
                                            quant_config=config, prefix="model.layers.0.mlp.gate_up_proj")
        _load_linear(merged, [(0, *gate), (1, *up)])
        row = RowParallelLinear(512, 256, bias=False, params_dtype=torch.bfloat16, quant_config=config,
                                prefix="model.layers.0.mlp.down_proj")
        _load_linear(row, [(None, *down)])
    w, s, _ = shard_fp8_linear(*merged_full, rank, 2, mode="column", num_fused=2)
    assert torch.equal(merged.weight.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(merged.weight_scale_inv.data, s)
    w, s, _ = shard_fp8_linear(*down, rank, 2, mode="row")
    assert torch.equal(row.weight.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(row.weight_scale_inv.data, s)


# ----------------------------------------------------------------------------------------------
# Fused MoE
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny DeepSeek-V3 in block FP8, moe_intermediate_size 256 (so a TP-2 shard is 128)."""
    cfg = tiny_deepseek_v3_config(moe_intermediate_size=256)
    path = write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"), cfg, seed=1)
    return path, cfg


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    """A random tiny Kimi-K2 (DeepSeek-V3's modules, 384 experts top-8 in one group) in block FP8."""
    cfg = tiny_kimi_k2_config()
    return write_checkpoint(tmp_path_factory.mktemp("kimi"), cfg, seed=1), cfg


def _fused_moe(config, cfg: dict, **kwargs):
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    return FusedMoE(num_experts=cfg["n_routed_experts"], hidden_size=cfg["hidden_size"],
                    intermediate_size=cfg["moe_intermediate_size"], layer_id=1, top_k=cfg["num_experts_per_tok"],
                    params_dtype=torch.bfloat16, quant_config=config, prefix=f"{MOE_PREFIX}.experts",
                    routed_scaling_factor=cfg["routed_scaling_factor"], **kwargs)


def _load_moe_like_sglang(layer, path, num_experts: int) -> None:
    """What SGLang's model loaders do with per-expert checkpoint tensors: FusedMoE's own name mapping and
    weight_loader (global expert ids; the loader maps them to this rank's experts and TP slice)."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=num_experts)
    params = dict(layer.named_parameters(prefix=f"{MOE_PREFIX}.experts"))
    loaded = 0
    with CheckpointReader(path) as reader:
        for name in reader:
            if not name.startswith(f"{MOE_PREFIX}.experts."):
                continue
            for param_name, weight_name, expert_id, shard_id in mapping:
                if weight_name in name:
                    target = name.replace(weight_name, param_name)
                    param = params[target]
                    param.weight_loader(param, reader.get(name), target, shard_id=shard_id, expert_id=expert_id)
                    loaded += 1
                    break
            else:
                raise AssertionError(f"no FusedMoE parameter for {name}")
    assert loaded == num_experts * 6  # gate/up/down × weight + weight_scale_inv
    layer.quant_method.process_weights_after_loading(layer)


def _reference_moe(cfg: dict, path, *, with_shared: bool = False) -> Fp8FusedMoE:
    """Our layer on the checkpoint's MoE block; without ``with_shared`` its routed experts only (what a FusedMoE
    computes), the shared expert loaded and then dropped."""
    ours = Fp8FusedMoE(cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"],
                       cfg["num_experts_per_tok"], scoring_func="sigmoid", renormalize=True,
                       n_group=cfg["n_group"], topk_group=cfg["topk_group"],
                       routed_scaling_factor=cfg["routed_scaling_factor"], use_correction_bias=True,
                       num_shared_experts=cfg["n_shared_experts"])
    load_fused_moe(ours, path, MOE_PREFIX)
    if not with_shared:
        ours.shared_experts = None
    return ours


def test_moe_weights_on_a_real_fused_moe(config, checkpoint):
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatcher

    from moe_fp8.integrations.sglang.moe import MoeFp8MoEMethod

    _, cfg = checkpoint
    layer = _fused_moe(config, cfg)
    assert isinstance(layer.quant_method, MoeFp8MoEMethod)
    assert layer.runner_backend is None and isinstance(layer.dispatcher, StandardDispatcher)
    e, h, i = 16, 256, 256
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in layer.named_parameters()}
    assert shapes == {"w13_weight": ((e, 2 * i, h), torch.float8_e4m3fn),
                      "w13_weight_scale_inv": ((e, 2 * i // 128, h // 128), torch.float32),
                      "w2_weight": ((e, h, i), torch.float8_e4m3fn),
                      "w2_weight_scale_inv": ((e, h // 128, i // 128), torch.float32)}
    for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert getattr(layer, name).quant_method == "block"
        assert getattr(layer, name).weight_loader == layer.weight_loader
    with pytest.raises(ValueError, match=r"w13_weight_scale_inv .* was not"):
        layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("parallel", ["single", "tp2_rank0", "tp2_rank1", "ep2_rank0", "ep2_rank1"])
def test_moe_checkpoint_loads_through_sglang_weight_loader(config, checkpoint, parallel):
    """A DeepSeek-V3 checkpoint through FusedMoE.weight_loader gives exactly the tensors our own loader
    (moe_fp8.layers.load_fused_moe) reads, including the TP slices of I and the EP subset of experts."""
    path, cfg = checkpoint
    rank = int(parallel[-1]) if parallel != "single" else 0
    with simulated_rank(parallel[:2], rank) if parallel != "single" else nullcontext():
        layer = _fused_moe(config, cfg)
        _load_moe_like_sglang(layer, path, cfg["n_routed_experts"])

    ours = _reference_moe(cfg, path)
    w13, s13, w2, s2 = ours.w13_weight, ours.w13_weight_scale_inv, ours.w2_weight, ours.w2_weight_scale_inv
    if parallel.startswith("tp2"):
        w13, s13, w2, s2 = shard_moe_weights(w13, s13, w2, s2, rank, 2)
    if parallel.startswith("ep2"):
        local = expert_map_for_rank(cfg["n_routed_experts"], rank, 2) >= 0
        w13, s13, w2, s2 = w13[local], s13[local], w2[local], s2[local]
    assert torch.equal(layer.w13_weight.view(torch.uint8), w13.view(torch.uint8))
    assert torch.equal(layer.w2_weight.view(torch.uint8), w2.view(torch.uint8))
    assert torch.equal(layer.w13_weight_scale_inv.data, s13)
    assert torch.equal(layer.w2_weight_scale_inv.data, s2)


def _sglang_topk(cfg: dict, correction_bias: torch.Tensor, runner_backend):
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(cfg["num_experts_per_tok"], layer_id=1, use_grouped_topk=True, num_expert_group=cfg["n_group"],
                topk_group=cfg["topk_group"], renormalize=True, scoring_func="sigmoid",
                correction_bias=correction_bias, routed_scaling_factor=cfg["routed_scaling_factor"])
    topk.bind_runner_backend(runner_backend)
    return topk


def _dense_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer, scale: float):
    """fp32 experts with dequantized weights, one (token, expert) pair at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    i = layer.w2_weight.shape[2]
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            w13 = dequant_per_block(layer.w13_weight[e], layer.w13_weight_scale_inv[e])
            w2 = dequant_per_block(layer.w2_weight[e], layer.w2_weight_scale_inv[e])
            h = w13 @ x[t].float()
            y = w2 @ (torch.nn.functional.silu(h[:i]) * h[i:])
            out[t] += scale * w * y.double()
    return out


@pytest.mark.parametrize("path", ["auto", "masked", "contiguous"])
def test_moe_forward_through_sglang_matches_ours(config, checkpoint, path):
    """SGLang's TopK → FusedMoE.forward (standard dispatcher) → our apply: the same experts as our router
    picks, the output of Fp8FusedMoE on the same checkpoint (up to the order SGLang lists a token's experts
    in, which changes the float sum), and a dense fp32 MoE within DESIGN §6's 2e-3."""
    from moe_fp8.layers import select_experts

    ckpt, cfg = checkpoint
    layer = _fused_moe(config, cfg)
    _load_moe_like_sglang(layer, ckpt, cfg["n_routed_experts"])
    layer.quant_method.path = path
    ours = _reference_moe(cfg, ckpt)
    topk = _sglang_topk(cfg, ours.e_score_correction_bias.data.clone(), layer.runner_backend)

    g = torch.Generator().manual_seed(7)
    for t in (1, 9, 70):
        x = torch.randn(t, cfg["hidden_size"], generator=g).to(torch.bfloat16)
        logits = torch.randn(t, cfg["n_routed_experts"], generator=g)
        topk_output = topk.forward_native(x, logits)
        # Routing: SGLang's grouped sigmoid top-k with correction bias picks the experts ours picks, with
        # the same weights once our apply multiplies SGLang's by routed_scaling_factor.
        weights, ids = select_experts(logits, cfg["num_experts_per_tok"], scoring_func="sigmoid",
                                      renormalize=True, n_group=cfg["n_group"], topk_group=cfg["topk_group"],
                                      e_score_correction_bias=ours.e_score_correction_bias,
                                      routed_scaling_factor=cfg["routed_scaling_factor"])
        order_sgl, order_ours = topk_output.topk_ids.long().sort(-1), ids.long().sort(-1)
        assert torch.equal(order_sgl.values, order_ours.values)
        torch.testing.assert_close(topk_output.topk_weights.gather(1, order_sgl.indices) * cfg["routed_scaling_factor"],
                                   weights.gather(1, order_ours.indices), rtol=1e-6, atol=1e-6)

        out = layer(x, topk_output)
        assert out.shape == x.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        # The layer applies routed_scaling_factor where SGLang's runners would (CUDA); elsewhere, as here, the
        # model block does (test_deepseek_moe_block_through_sglang_matches_ours).
        in_layer = cfg["routed_scaling_factor"] if layer.quant_method.applies_routed_scaling else 1.0
        block_scale = cfg["routed_scaling_factor"] / in_layer
        assert moe_fp8.calc_diff(out.double() * block_scale, ours(x, logits)) < 1e-5
        ref = _dense_reference(x, topk_output.topk_weights, topk_output.topk_ids, layer, in_layer)
        assert moe_fp8.calc_diff(out, ref) < 2e-3


def test_moe_skips_minus_one_ids_and_empty_batch(config, checkpoint):
    """SGLang marks padding tokens and other ranks' experts with id -1: they must contribute nothing."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    ckpt, cfg = checkpoint
    layer = _fused_moe(config, cfg)
    _load_moe_like_sglang(layer, ckpt, cfg["n_routed_experts"])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, cfg["hidden_size"], generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 16, (6, 4), generator=g, dtype=torch.int32)
    ids[:, 1:] = torch.stack([(ids[:, 0] + d) % 16 for d in (1, 2, 3)], 1)  # distinct per token
    weights = torch.rand(6, 4, generator=g)
    masked_ids = ids.clone()
    masked_ids[2] = -1  # a padding token
    masked_ids[4, 1:] = -1  # three copies on other ranks
    keep = weights.clone()
    keep[2] = 0
    keep[4, 1:] = 0
    for path in ("masked", "contiguous"):
        layer.quant_method.path = path
        out = layer(x, StandardTopKOutput(weights, masked_ids, None))
        expected = layer(x, StandardTopKOutput(keep, ids, None))
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert moe_fp8.calc_diff(out, expected) < 1e-6
        assert layer(x[:0], StandardTopKOutput(weights[:0], ids[:0], None)).shape == (0, cfg["hidden_size"])


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_moe_parallel_ranks_sum_to_the_full_output(config, checkpoint, mode, monkeypatch):
    """Two simulated ranks, each loading its share through SGLang's loader and running SGLang's dispatcher
    (EP: global → local ids, -1 elsewhere), sum to the single-rank layer's output (the all-reduce)."""
    from sglang.srt.layers.moe.token_dispatcher import standard

    # The EP dispatcher allocates its id map on SGLang's accelerator device, which a CPU-only host lacks
    # (get_device() raises); the map itself is then built by SGLang's own code, here on CPU.
    monkeypatch.setattr(standard, "get_device", lambda: "cpu")
    ckpt, cfg = checkpoint
    full = _fused_moe(config, cfg)
    _load_moe_like_sglang(full, ckpt, cfg["n_routed_experts"])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, cfg["hidden_size"], generator=g).to(torch.bfloat16)
    logits = torch.randn(12, cfg["n_routed_experts"], generator=g)
    bias = torch.randn(cfg["n_routed_experts"], generator=g) * 0.1
    topk_output = _sglang_topk(cfg, bias, full.runner_backend).forward_native(x, logits)
    expected = full(x, topk_output)
    total = torch.zeros(x.shape, dtype=torch.float32)
    for rank in (0, 1):
        with simulated_rank(mode, rank):
            part = _fused_moe(config, cfg)
            _load_moe_like_sglang(part, ckpt, cfg["n_routed_experts"])
            total += part(x, topk_output).float()
    assert moe_fp8.calc_diff(total, expected) < 1e-5


def _deepseek_moe_block(config, cfg: dict, path, fused_shared: int):
    """SGLang's own DeepSeek-V3 MoE block (``DeepseekV2MoE``: router gate, TopK, FusedMoE with our method, shared
    experts as our linear layers or, with ``fused_shared``, as one more expert of the FusedMoE), loaded as
    SGLang's DeepSeek loader does (with fusion it renames ``mlp.shared_experts`` to ``mlp.experts.{E}``)."""
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.models.deepseek_v2 import DeepseekV2MoE
    from sglang.srt.runtime_context import get_model
    from transformers import DeepseekV3Config

    # (Kimi-K2's remote code has DeepSeek-V3's config class under model_type "kimi_k2": transformers' is the same)
    hf_config = DeepseekV3Config(**{k: v for k, v in cfg.items()
                                    if k not in ("quantization_config", "model_type", "auto_map")})
    with get_model().override(shared_experts=SharedExpertsConfig(num_fused_shared_experts=fused_shared)):
        block = DeepseekV2MoE(hf_config, layer_id=1, quant_config=config, prefix=MOE_PREFIX)
    assert block.num_fused_shared_experts == fused_shared
    return _load_moe_block(block, path, cfg["n_routed_experts"], fused_shared)


def _load_moe_block(block, path, num_experts: int, fused_shared: int = 0, family: str = "deepseek_v3"):
    """Fill a SGLang MoE block from the checkpoint's layer-1 MoE block (``MOE_PREFIX``, or ``family``'s
    ``MOE_NAMES``) as SGLang's loaders do: experts through ``FusedMoE.make_expert_params_mapping``, the shared MLP's
    gate / up into its merged ``gate_up_proj``, anything else (the router, the correction bias) by its own loader;
    then each method's ``process_weights_after_loading``."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    names = MOE_NAMES[family]
    prefix = f"model.layers.1.{names.block}"
    expert_mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=names.gate,
                                                         ckpt_down_proj_name=names.down, ckpt_up_proj_name=names.up,
                                                         num_experts=num_experts + fused_shared)
    params = dict(block.named_parameters(prefix=prefix))
    with CheckpointReader(path) as reader:
        for name in reader:
            if not name.startswith(f"{prefix}."):
                continue
            tensor = reader.get(name)
            if fused_shared:
                name = name.replace("mlp.shared_experts", f"mlp.experts.{num_experts}")
            for param_name, weight_name, expert_id, shard_id in expert_mapping:
                if weight_name in name:
                    target = name.replace(weight_name, param_name)
                    params[target].weight_loader(params[target], tensor, target, shard_id=shard_id,
                                                 expert_id=expert_id)
                    break
            else:
                for shard_id, proj in enumerate(("gate_proj", "up_proj")):  # the shared MLP's merged gate_up_proj
                    if f"shared_experts.{proj}." in name:
                        target = name.replace(proj, "gate_up_proj")
                        params[target].weight_loader(params[target], tensor, shard_id)
                        break
                else:
                    param = params[name]
                    getattr(param, "weight_loader", lambda p, t: p.data.copy_(t))(param, tensor)
    for module in block.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return block


@pytest.mark.parametrize("model", ["checkpoint", "kimi_checkpoint"], ids=["deepseek_v3", "kimi_k2"])
@pytest.mark.parametrize("fused_shared", [0, 1], ids=["shared_apart", "shared_fused"])
def test_deepseek_moe_block_through_sglang_matches_ours(config, model, fused_shared, request):
    """SGLang's DeepSeek MoE block on our methods gives Fp8FusedMoE's output (routed experts scaled by
    routed_scaling_factor exactly once, plus the shared expert), with the shared expert as its own MLP or
    fused into the routed FusedMoE as SGLang does for DeepSeek-V3 on GPUs of capability ≥ 8.0; for DeepSeek-V3
    and for Kimi-K2 (384 experts, top-8 of one group, routed_scaling_factor 2.827)."""
    ckpt, cfg = request.getfixturevalue(model)
    block = _deepseek_moe_block(config, cfg, ckpt, fused_shared)
    # Off CUDA SGLang's block multiplies the experts' output by the factor itself: our method must not.
    assert block.experts.quant_method.applies_routed_scaling is False
    ours = _reference_moe(cfg, ckpt, with_shared=True)
    g = torch.Generator().manual_seed(11)
    for t in (1, 9, 70):
        x = torch.randn(t, cfg["hidden_size"], generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            logits = block.gate(x)
            out = block(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        # (SGLang rounds the routed and the shared outputs to bf16 before their sum: hence 1e-4, not 1e-5)
        assert moe_fp8.calc_diff(out, ours(x, logits.float())) < 1e-4


def test_qwen3_moe_block_through_sglang_matches_ours(config, tmp_path):
    """SGLang's own Qwen3-MoE block (``Qwen3MoeSparseMoeBlock``: bf16 gate, softmax top-k renormalized, no shared
    experts) on a block-FP8 Qwen3-MoE checkpoint, its experts on our method, loaded as SGLang's Qwen3 loader does:
    the block's output is ``Fp8FusedMoE``'s with softmax routing (no routed scaling factor anywhere)."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers import Qwen3MoeConfig

    cfg = tiny_qwen3_moe_config()
    path = write_qwen3_moe_checkpoint(tmp_path / "qwen3", cfg, seed=2, num_shards=1)
    hf_config = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    with set_default_torch_dtype(torch.bfloat16):  # as SGLang's model loader builds it
        block = Qwen3MoeSparseMoeBlock(1, hf_config, quant_config=config, prefix=MOE_PREFIX)
    assert type(block.experts.quant_method).__module__.startswith("moe_fp8.")
    _load_moe_block(block, path, cfg["num_experts"])  # (the router gate, bf16, by its own loader)
    ours = Fp8FusedMoE(16, 256, 128, 4, scoring_func="softmax", renormalize=True)
    load_fused_moe(ours, path, MOE_PREFIX)
    g = torch.Generator().manual_seed(12)
    for t in (1, 9, 70):
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            logits, _ = block.gate(x)
            out = block(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert moe_fp8.calc_diff(out, ours(x, logits.float())) < 1e-5


def test_glm4_moe_block_through_sglang_matches_ours(config, tmp_path):
    """SGLang's own GLM-4.5 MoE block (``Glm4MoeSparseMoeBlock``: fp32 gate with the correction bias, DeepSeek-V3's
    top-k of one group, ``routed_scaling_factor`` 2.5, a shared expert on our linear method), loaded as SGLang's
    loaders do, gives ``Fp8FusedMoE``'s output."""
    from sglang.srt.models.glm4_moe import Glm4MoeSparseMoeBlock
    from transformers import Glm4MoeConfig

    cfg = tiny_glm4_moe_config()
    path = write_checkpoint(tmp_path / "glm", cfg, seed=6, num_shards=1)
    hf_config = Glm4MoeConfig(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    block = _load_moe_block(Glm4MoeSparseMoeBlock(hf_config, layer_id=1, quant_config=config, prefix=MOE_PREFIX),
                            path, cfg["n_routed_experts"])
    assert type(block.experts.quant_method).__module__.startswith("moe_fp8.")
    assert block.experts.quant_method.applies_routed_scaling is False  # SGLang's block applies it off CUDA
    ours = _reference_moe(cfg, path, with_shared=True)
    g = torch.Generator().manual_seed(13)
    for t in (1, 9, 70):
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            logits = block.gate(x)
            out = block(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert moe_fp8.calc_diff(out, ours(x, logits.float())) < 1e-4  # (bf16 sum of routed and shared, as above)


def test_minimax_m2_block_through_sglang_matches_ours(config, tmp_path):
    """SGLang's own MiniMax-M2 MoE block (``MiniMaxM2MoE``: fp32 gate, sigmoid top-k of all experts with the block's
    correction bias, renormalized, the checkpoint's ``w1`` / ``w3`` / ``w2``), loaded as SGLang's loaders do, gives
    ``Fp8FusedMoE``'s output (loaded with ``MOE_NAMES["minimax_m2"]``)."""
    from sglang.srt.models.minimax_m2 import MiniMaxM2MoE
    from transformers import MiniMaxM2Config

    cfg, names = tiny_minimax_m2_config(), MOE_NAMES["minimax_m2"]
    path = write_checkpoint(tmp_path / "minimax", cfg, seed=7, num_shards=1)
    hf_config = MiniMaxM2Config(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    block = MiniMaxM2MoE(hf_config, layer_id=1, quant_config=config, prefix=f"model.layers.1.{names.block}")
    _load_moe_block(block, path, cfg["num_local_experts"], family="minimax_m2")
    assert type(block.experts.quant_method).__module__.startswith("moe_fp8.")
    ours = Fp8FusedMoE(16, 256, 128, 4, scoring_func="sigmoid", renormalize=True, use_correction_bias=True)
    load_fused_moe(ours, path, f"model.layers.1.{names.block}", names=names)
    g = torch.Generator().manual_seed(14)
    for t in (1, 9, 70):
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            logits, _ = block.gate(x.float())
            out = block(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert moe_fp8.calc_diff(out, ours(x, logits.float())) < 1e-5


def test_moe_refuses_unsupported_layers(config, checkpoint):
    _, cfg = checkpoint
    # tiny config's I = 128 → 64 per TP rank: cuts a scale block
    with simulated_rank("tp", 0), pytest.raises(ValueError, match="intermediate size per TP rank must be a "
                                                                   "multiple of 128"):
        _fused_moe(config, {**cfg, "moe_intermediate_size": 128})
    with pytest.raises(ValueError, match="activation='gelu'"):
        _fused_moe(config, cfg, activation="gelu")
