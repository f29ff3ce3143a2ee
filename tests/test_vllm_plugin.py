"""The vLLM integration against the real vLLM (``pip install -e '.[vllm]'``), on CPU.

vLLM's PyPI wheel is CUDA-built; without a GPU it runs on its ``UnspecifiedPlatform``, where its config
classes, distributed groups (gloo, one process), linear / fused-MoE layer construction, weight loaders,
router and modular-kernel MoE forward all work, and moe_fp8's ops run on their PyTorch reference backend.
What needs a GPU (vLLM's own CUDA / Triton kernels, DeepEP, CUDA graphs) is not exercised here:
``scripts/engine_check.sh vllm`` records what ran.

Tensor-parallel ranks are simulated in one process: vLLM's layers take ``tp_size`` / ``tp_rank`` (or read
them from ``vllm.distributed``, patched here), so each rank's layer is built and loaded as that rank
would; the ranks' outputs must sum to the unsplit output (the all-reduce vLLM does between them).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import socket
from collections.abc import Iterator

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers import linear as vllm_linear  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, fused_moe_make_expert_params_mapping  # noqa: E402
from vllm.model_executor.layers.fused_moe import config as vllm_moe_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG  # noqa: E402
from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize  # noqa: E402
from vllm.model_executor.layers.quantization import (  # noqa: E402
    QUANTIZATION_METHODS,
    get_quantization_config,
)
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter  # noqa: E402
from vllm.v1.worker import workspace as vllm_workspace  # noqa: E402

import moe_fp8  # noqa: E402
from moe_fp8 import calc_diff, quant  # noqa: E402
from moe_fp8.integrations.vllm import register  # noqa: E402
from moe_fp8.integrations.vllm.experts import MoeFp8BatchedExperts, MoeFp8Experts  # noqa: E402
from moe_fp8.integrations.vllm.methods import MoeFp8Config, MoeFp8LinearMethod, MoeFp8MoEMethod  # noqa: E402
from moe_fp8.layers import (  # noqa: E402
    Fp8FusedMoE,
    Fp8Linear,
    shard_fp8_linear,
    shard_moe_weights,
    tiny_glm4_moe_config,
    tiny_kimi_k2_config,
    tiny_minimax_m2_config,
    tiny_qwen3_moe_config,
    write_checkpoint,
    write_deepseek_v3_checkpoint,
    write_qwen3_moe_checkpoint,
)
from moe_fp8.layers.checkpoint import MOE_NAMES, CheckpointReader, load_fused_moe, read_block_fp8  # noqa: E402
from moe_fp8.testing import randn  # noqa: E402
from moe_fp8.utils import rel_error  # noqa: E402

DSV3 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8 = torch.float8_e4m3fn
# DESIGN §6: same FP8 inputs as the reference (kernel vs reference) and the layer vs a dequantized bf16 layer.
SAME_INPUT_DIFF, SAME_INPUT_REL, LAYER_DIFF = 1e-5, 1e-2, 2e-3
# DeepSeek-V3 routing, scaled down: sigmoid scores + correction bias, grouped top-k.
E, H, INTER, TOP_K = 8, 256, 256, 2
ROUTING = {"use_grouped_topk": True, "num_expert_group": 4, "topk_group": 2, "scoring_func": "sigmoid",
           "routed_scaling_factor": 2.5, "renormalize": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[VllmConfig]:
    """One process = one rank: gloo groups of size 1, a CPU workspace, ``moe_fp8`` registered."""
    register()
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)
        if not vllm_workspace.is_workspace_manager_initialized():
            vllm_workspace.init_workspace_manager(torch.device("cpu"))
    yield cfg


@pytest.fixture
def quant_config() -> MoeFp8Config:
    return MoeFp8Config.from_config(dict(DSV3))


_layer_ids = iter(range(10_000))


def _prefix(kind: str) -> str:
    # vLLM registers every MoE layer by name in the config's forward context: names must be unique.
    return f"model.layers.{next(_layer_ids)}.{kind}"


@contextlib.contextmanager
def _tp_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> Iterator[None]:
    """Make layers built inside see tensor-parallel rank ``rank`` of ``size`` (one process simulates it)."""
    with monkeypatch.context() as m:
        for module in (vllm_linear, vllm_moe_config):
            if hasattr(module, "get_tensor_model_parallel_rank"):
                m.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
        m.setattr(vllm_linear, "get_tensor_model_parallel_world_size", lambda: size)
        yield


def _fp8(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.per_block(randn(shape, seed=seed) * shape[-1] ** -0.5)


def _dq(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return quant.dequant_per_block(w, s)


# ----------------------------------------------------------------------------------------------
# Registration and config
# ----------------------------------------------------------------------------------------------
def test_entry_point_is_discoverable_and_registers(vllm_config: VllmConfig) -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps["moe_fp8"].value == "moe_fp8.integrations.vllm:register"
    assert eps["moe_fp8"].load() is register
    # vLLM's own plugin loader calls it (again): still one registration.
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    register()
    assert QUANTIZATION_METHODS.count("moe_fp8") == 1
    assert get_quantization_config("moe_fp8") is MoeFp8Config


def test_config_accepts_deepseek_v3_checkpoint(vllm_config: VllmConfig, tmp_path) -> None:
    cfg = MoeFp8Config.from_config(dict(DSV3, ignored_layers=["model.layers.0.mlp.gate_up_proj"]))
    assert cfg.get_name() == "moe_fp8" and cfg.weight_block_size == [128, 128]
    assert MoeFp8Config.override_quantization_method(DSV3, "moe_fp8") == "moe_fp8"
    assert MoeFp8Config.override_quantization_method(DSV3, None) is None        # plain fp8 stays vLLM's
    assert MoeFp8Config.override_quantization_method({"quant_method": "awq"}, "moe_fp8") is None
    # vLLM's own method-compatibility check on a real DeepSeek-V3-format checkpoint directory.
    from vllm.config import ModelConfig
    path = write_deepseek_v3_checkpoint(tmp_path / "dsv3")
    assert ModelConfig(model=str(path), quantization="moe_fp8", skip_tokenizer_init=True).quantization == "moe_fp8"
    assert ModelConfig(model=str(path), skip_tokenizer_init=True).quantization == "fp8"


@pytest.mark.parametrize(("change", "field"), [({"weight_block_size": [128, 64]}, "weight_block_size"),
                                               ({"activation_scheme": "static"}, "activation_scheme"),
                                               ({"fmt": "e5m2"}, "fmt")])
def test_config_refuses_unsupported(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MoeFp8Config.from_config({**DSV3, **change})


def test_config_refuses_a_checkpoint_without_quantization_config() -> None:
    # vLLM builds quant_cls() when config.json has none: a bf16 checkpoint would otherwise load into FP8
    # parameters and fail only after the whole load
    with pytest.raises(ValueError, match="no quantization_config"):
        MoeFp8Config()


def test_quant_method_per_layer(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    quant_config.ignored_layers = ["model.layers.0.self_attn.o_proj"]
    with set_current_vllm_config(vllm_config):
        skipped = vllm_linear.RowParallelLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                                                quant_config=quant_config, prefix="model.layers.0.self_attn.o_proj")
        quantized = vllm_linear.RowParallelLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                                                  quant_config=quant_config, prefix="model.layers.1.self_attn.o_proj")
    assert isinstance(skipped.quant_method, vllm_linear.UnquantizedLinearMethod)
    assert skipped.weight.dtype == torch.bfloat16
    assert isinstance(quantized.quant_method, MoeFp8LinearMethod)
    assert quant_config.get_quant_method(torch.nn.LayerNorm(4), "model.norm") is None


# ----------------------------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------------------------
def test_linear_weights_tp1(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    with set_current_vllm_config(vllm_config):
        merged = vllm_linear.MergedColumnParallelLinear(256, [1536, 576], bias=False, params_dtype=torch.bfloat16,
                                                        quant_config=quant_config, prefix="q_a")
        qkv = vllm_linear.QKVParallelLinear(256, 128, 4, 2, bias=False, params_dtype=torch.bfloat16,
                                            quant_config=quant_config, prefix="qkv")
        row = vllm_linear.RowParallelLinear(640, 384, bias=False, params_dtype=torch.bfloat16,
                                            quant_config=quant_config, prefix="o")
    for layer, (n, k) in ((merged, (2112, 256)), (qkv, (1024, 256)), (row, (384, 640))):
        assert isinstance(layer.weight, ModelWeightParameter) and layer.weight.dtype == FP8
        assert tuple(layer.weight.shape) == (n, k)
        assert isinstance(layer.weight_scale_inv, BlockQuantScaleParameter)
        assert layer.weight_scale_inv.dtype == torch.float32
        assert tuple(layer.weight_scale_inv.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        assert layer.weight_block_size == [128, 128]


def _load_merged(layer: torch.nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for shard_id, (w, s) in enumerate(parts):
        layer.weight.weight_loader(layer.weight, w, shard_id)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, shard_id)


def test_merged_linear_loads_and_matches_reference(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    # DeepSeek's fused_qkv_a_proj: [q_a 1536 | kv_a 576] over K; the ragged last part has a partial block.
    k, sizes = 512, [1536, 576]
    parts = [_fp8((n, k), seed=i) for i, n in enumerate(sizes)]
    with set_current_vllm_config(vllm_config):
        layer = vllm_linear.MergedColumnParallelLinear(k, sizes, bias=False, params_dtype=torch.bfloat16,
                                                       quant_config=quant_config, prefix="q_a")
    _load_merged(layer, parts)
    layer.quant_method.process_weights_after_loading(layer)
    w_full, s_full = torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])
    assert torch.equal(layer.weight.view(torch.uint8), w_full.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, s_full)

    x = randn((3, 7, k), seed=5)                   # leading dims are kept
    out, _ = layer(x)
    assert out.shape == (3, 7, sum(sizes)) and out.dtype == torch.bfloat16 and out.isfinite().all()
    ours = Fp8Linear.from_fp8(w_full, s_full)(x)   # the same op path outside vLLM: bit-equal
    assert torch.equal(out, ours)
    x_fp8, x_scale = quant.per_token_group(x.reshape(-1, k))
    same_input = quant.dequant_per_token_group(x_fp8, x_scale) @ _dq(w_full, s_full).t()
    assert calc_diff(out.reshape(-1, sum(sizes)), same_input) < SAME_INPUT_DIFF
    assert rel_error(out.reshape(-1, sum(sizes)), same_input) < SAME_INPUT_REL
    assert calc_diff(out, x.float() @ _dq(w_full, s_full).t()) < LAYER_DIFF


def test_linear_bias_and_unloaded_scales(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    w, s = _fp8((256, 384), seed=3)
    bias = randn((256,), seed=4)
    with set_current_vllm_config(vllm_config):
        layer = vllm_linear.ColumnParallelLinear(384, 256, bias=True, params_dtype=torch.bfloat16,
                                                 quant_config=quant_config, prefix="col")
        unloaded = vllm_linear.ColumnParallelLinear(384, 256, bias=False, params_dtype=torch.bfloat16,
                                                    quant_config=quant_config, prefix="col2")
    for param, value in ((layer.weight, w), (layer.weight_scale_inv, s), (layer.bias, bias)):
        param.weight_loader(param, value)
    layer.quant_method.process_weights_after_loading(layer)
    x = randn((9, 384), seed=6)
    out, _ = layer(x)
    assert calc_diff(out, x.float() @ _dq(w, s).t() + bias.float()) < LAYER_DIFF
    assert layer(torch.empty((0, 384), dtype=torch.bfloat16))[0].shape == (0, 256)   # empty batch
    # MLA reads kv_b_proj's weights back through vLLM's generic path (apply() on an identity matrix):
    # exact up to the GEMM's bf16 output rounding.
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights
    w_back = get_and_maybe_dequant_weights(layer)
    assert w_back.shape == (256, 384) and calc_diff(w_back, _dq(w, s)) < SAME_INPUT_DIFF
    unloaded.weight.weight_loader(unloaded.weight, w)   # scale never loaded: refused, named
    with pytest.raises(ValueError, match="weight_scale_inv of linear layer 'col2'"):
        unloaded.quant_method.process_weights_after_loading(unloaded)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_linear_tp_shards_match_shard_helpers(vllm_config: VllmConfig, quant_config: MoeFp8Config,
                                              monkeypatch: pytest.MonkeyPatch, tp_rank: int) -> None:
    n, k, tp = 512, 768, 2
    w, s = _fp8((n, k), seed=7)
    gate, up = _fp8((n, k), seed=8), _fp8((n, k), seed=9)
    with set_current_vllm_config(vllm_config):
        col = vllm_linear.ColumnParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16, quant_config=quant_config,
                                               prefix="col", tp_rank=tp_rank, tp_size=tp)
        with _tp_rank(monkeypatch, tp_rank, tp):
            row = vllm_linear.RowParallelLinear(k, n, bias=False, params_dtype=torch.bfloat16,
                                                quant_config=quant_config, prefix="row")
            merged = vllm_linear.MergedColumnParallelLinear(k, [n, n], bias=False, params_dtype=torch.bfloat16,
                                                            quant_config=quant_config, prefix="gate_up")
    for layer in (col, row):
        layer.weight.weight_loader(layer.weight, w)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s)
    _load_merged(merged, [gate, up])
    expected = {
        "col": shard_fp8_linear(w, s, tp_rank, tp, mode="column")[:2],
        "row": shard_fp8_linear(w, s, tp_rank, tp, mode="row")[:2],
        "merged": shard_fp8_linear(torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]]), tp_rank, tp,
                                   mode="column", num_fused=2)[:2],
    }
    for name, layer in (("col", col), ("row", row), ("merged", merged)):
        ew, es = expected[name]
        assert torch.equal(layer.weight.view(torch.uint8), ew.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, es), name


def test_linear_refuses_shards_that_cut_scale_blocks(vllm_config: VllmConfig, quant_config: MoeFp8Config,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with set_current_vllm_config(vllm_config):
        with pytest.raises(ValueError, match="output features"):   # 256 rows over 4 ranks: 64 per rank
            vllm_linear.ColumnParallelLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                                             quant_config=quant_config, prefix="c", tp_rank=0, tp_size=4)
        with _tp_rank(monkeypatch, 1, 4), pytest.raises(ValueError, match="input features"):  # K 256 over 4
            vllm_linear.RowParallelLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                                          quant_config=quant_config, prefix="r")
        with _tp_rank(monkeypatch, 0, 2), pytest.raises(ValueError, match="output features"):
            vllm_linear.MergedColumnParallelLinear(256, [384, 384], bias=False, params_dtype=torch.bfloat16,
                                                   quant_config=quant_config, prefix="m")


def test_linear_under_torch_compile(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    w, s = _fp8((256, 256), seed=12)
    with set_current_vllm_config(vllm_config):
        layer = vllm_linear.ReplicatedLinear(256, 256, bias=False, params_dtype=torch.bfloat16,
                                             quant_config=quant_config, prefix="rep")
    layer.weight.weight_loader(layer.weight, w)
    layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s)
    layer.quant_method.process_weights_after_loading(layer)
    fn = torch.compile(lambda x: layer.quant_method.apply(layer, x), fullgraph=True, backend="aot_eager")
    x = randn((5, 256), seed=13)
    assert torch.equal(fn(x), layer.quant_method.apply(layer, x))


# ----------------------------------------------------------------------------------------------
# Fused MoE
# ----------------------------------------------------------------------------------------------
def _make_moe(quant_config: MoeFp8Config, *, num_experts: int = E, inter: int = INTER, **kwargs):
    bias = torch.zeros(num_experts, dtype=torch.float32)
    return FusedMoEFactory(num_experts=num_experts, top_k=TOP_K, hidden_size=H, intermediate_size=inter,
                           params_dtype=torch.bfloat16, quant_config=quant_config,
                           prefix=_prefix("mlp.experts"), e_score_correction_bias=bias,
                           **{**ROUTING, **kwargs})


def load_experts_through_vllm(runner: torch.nn.Module, tensors: dict[str, torch.Tensor], layer: int,
                              num_experts: int, family: str = "deepseek_v3") -> set[str]:
    """Load experts through vLLM's own path, as ``DeepseekV2ForCausalLM.load_weights`` and
    ``Qwen3MoeModel.load_weights`` do: the model's expert params mapping, then each parameter's ``weight_loader``
    with ``shard_id`` / ``expert_id``; ``family``'s checkpoint names (``MOE_NAMES``). Returns the checkpoint names
    loaded."""
    names = MOE_NAMES[family]
    model = torch.nn.Module()
    model.experts = runner
    mapping = fused_moe_make_expert_params_mapping(model, ckpt_gate_proj_name=names.gate,
                                                   ckpt_down_proj_name=names.down,
                                                   ckpt_up_proj_name=names.up, num_experts=num_experts)
    params = dict(model.named_parameters())
    loaded = set()
    for ckpt_name, tensor in tensors.items():
        name = ckpt_name.removeprefix(f"model.layers.{layer}.{names.block}.")  # the model's own prefix
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            mapped = name.replace(weight_name, param_name)
            param = params[mapped]
            if param.weight_loader(param, tensor, mapped, shard_id=shard_id, expert_id=expert_id,
                                   return_success=True):
                loaded.add(ckpt_name)
                break
    return loaded


class Checkpoint:
    """A synthetic DeepSeek-V3 MoE layer: ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,
    weight_scale_inv}`` (fp8 e4m3 + fp32), plus its stacked form for moe_fp8's own layers."""

    def __init__(self, layer: int, num_experts: int = E, inter: int = INTER, seed: int = 0) -> None:
        self.layer, self.num_experts = layer, num_experts
        self.tensors: dict[str, torch.Tensor] = {}
        w13, s13, w2, s2 = [], [], [], []
        for e in range(num_experts):
            gate, up, down = (_fp8((inter, H), seed + 3 * e), _fp8((inter, H), seed + 3 * e + 1),
                              _fp8((H, inter), seed + 3 * e + 2))
            for name, (w, s) in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                self.tensors[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"] = w
                self.tensors[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight_scale_inv"] = s
            w13.append(torch.cat([gate[0], up[0]]))
            s13.append(torch.cat([gate[1], up[1]]))
            w2.append(down[0])
            s2.append(down[1])
        self.w13, self.s13 = torch.stack(w13), torch.stack(s13)
        self.w2, self.s2 = torch.stack(w2), torch.stack(s2)
        self.bias = 0.1 * randn((num_experts,), seed=seed + 999, dtype=torch.float32)

    def load_into(self, runner: torch.nn.Module) -> set[str]:
        loaded = load_experts_through_vllm(runner, self.tensors, self.layer, self.num_experts)
        runner.routed_experts.e_score_correction_bias.copy_(self.bias)
        return loaded

    def fp8_fused_moe(self, **kwargs) -> Fp8FusedMoE:
        moe = Fp8FusedMoE(self.num_experts, H, self.w13.shape[1] // 2, TOP_K, scoring_func="sigmoid",
                          renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          use_correction_bias=True, **kwargs)
        local = moe.local_expert_ids()
        with torch.no_grad():
            for name, full in (("w13_weight", self.w13), ("w13_weight_scale_inv", self.s13),
                               ("w2_weight", self.w2), ("w2_weight_scale_inv", self.s2)):
                getattr(moe, name).copy_(full[local])
            moe.e_score_correction_bias.copy_(self.bias)
        return moe

    def loop_reference(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return loop_reference(x, topk_weights, topk_ids, _dq(self.w13, self.s13), _dq(self.w2, self.s2))


def loop_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """Plain FP32 MoE on dequantized weights and unquantized activations (DESIGN §6 'bf16 layer')."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = x[t].float() @ w13[e].t()
            out[t] += topk_weights[t, j] * ((torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w2[e].t())
    return out


def _forward(vllm_config: VllmConfig, runner: torch.nn.Module, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    with set_forward_context(None, vllm_config):
        return runner(x, logits)


def test_moe_weights_tp1(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    with set_current_vllm_config(vllm_config):
        runner = _make_moe(quant_config)
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, MoeFp8MoEMethod)
    want = {"w13_weight": ((E, 2 * INTER, H), FP8), "w2_weight": ((E, H, INTER), FP8),
            "w13_weight_scale_inv": ((E, 2 * INTER // 128, H // 128), torch.float32),
            "w2_weight_scale_inv": ((E, H // 128, INTER // 128), torch.float32)}
    got = {n: (tuple(p.shape), p.dtype) for n, p in experts.named_parameters()}
    assert got == want
    assert experts.w13_weight_scale_inv.quant_method == "block" and experts.w2_weight_scale_inv.quant_method == "block"


def test_moe_checkpoint_loads_through_vllm_and_matches_reference(vllm_config: VllmConfig,
                                                                 quant_config: MoeFp8Config) -> None:
    ckpt = Checkpoint(layer=3, seed=20)
    with set_current_vllm_config(vllm_config):
        runner = _make_moe(quant_config)
    assert ckpt.load_into(runner) == set(ckpt.tensors)
    experts = runner.routed_experts
    for name, full in (("w13_weight", ckpt.w13), ("w2_weight", ckpt.w2)):
        assert torch.equal(getattr(experts, name).view(torch.uint8), full.view(torch.uint8)), name
    assert torch.equal(experts.w13_weight_scale_inv, ckpt.s13) and torch.equal(experts.w2_weight_scale_inv, ckpt.s2)
    experts.quant_method.process_weights_after_loading(experts)
    kernel = experts.quant_method.moe_kernel
    assert isinstance(kernel.fused_experts, MoeFp8Experts)
    assert type(kernel.prepare_finalize).__name__ == "MoEPrepareAndFinalizeNoDPEPModular"

    ours = ckpt.fp8_fused_moe()
    for t, path in ((5, "masked"), (40, "contiguous")):   # both layouts of moe_fp8's experts
        kernel.fused_experts.masked_max_tokens = 8
        x, logits = randn((t, H), seed=t), randn((t, E), seed=t + 1, dtype=torch.float32)
        out = _forward(vllm_config, runner, x, logits)          # vLLM router → modular kernel → our experts
        assert out.shape == (t, H) and out.dtype == torch.bfloat16 and out.isfinite().all()
        expected = ours(x, logits, path=path)
        assert calc_diff(out, expected) < SAME_INPUT_DIFF and rel_error(out, expected) < SAME_INPUT_REL
        topk_weights, topk_ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
        assert calc_diff(out, ckpt.loop_reference(x, topk_weights, topk_ids)) < LAYER_DIFF


def _torch_topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor, token_expert_indices: torch.Tensor,
                        gating_output: torch.Tensor, renormalize: bool = False) -> tuple[torch.Tensor, ...]:
    """vLLM's ``topk_softmax`` (a CUDA op of ``vllm._moe_C``) in torch, for CPU: softmax in fp32, top-k, optionally
    renormalized, written into the caller's buffers."""
    weights, ids = torch.topk(gating_output.float().softmax(-1), topk_weights.shape[1])
    topk_weights.copy_(weights / weights.sum(-1, keepdim=True) if renormalize else weights)
    topk_ids.copy_(ids)
    return topk_weights, topk_ids


def test_qwen3_moe_block_through_vllm_matches_ours(vllm_config: VllmConfig, tmp_path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own Qwen3-MoE block (``Qwen3MoeSparseMoeBlock``: its gate, softmax top-k renormalized, no shared
    experts) on a block-FP8 Qwen3-MoE checkpoint under ``--quantization moe_fp8``: the config is accepted, the
    experts run moe_fp8's method, and the block's output matches ``Fp8FusedMoE`` and a plain FP32 loop.
    vLLM's softmax top-k is a CUDA op: on CPU the test runs its torch equivalent in its place."""
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.fused_moe.router import fused_topk_router
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setattr(fused_topk_router, "vllm_topk_softmax", _torch_topk_softmax)

    path = write_qwen3_moe_checkpoint(tmp_path / "qwen3", tiny_qwen3_moe_config(), seed=3, num_shards=1)
    model_config = ModelConfig(model=str(path), tokenizer=str(path), skip_tokenizer_init=True,
                               quantization="moe_fp8", dtype="bfloat16")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=model_config)
    assert isinstance(cfg.quant_config, MoeFp8Config)
    prefix = _prefix("mlp")
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):  # as vLLM's model loader builds
        block = Qwen3MoeSparseMoeBlock(cfg, prefix=prefix)
    experts = block.experts.routed_experts
    assert isinstance(experts.quant_method, MoeFp8MoEMethod)
    assert isinstance(block.gate.quant_method, vllm_linear.UnquantizedLinearMethod)  # listed in modules_to_not_convert
    reader = CheckpointReader(path)
    tensors = {n: reader.get(n) for n in reader if n.startswith("model.layers.1.mlp.experts.")}
    assert load_experts_through_vllm(block.experts, tensors, 1, 16) == set(tensors)
    block.gate.weight.data.copy_(reader.get("model.layers.1.mlp.gate.weight"))
    experts.quant_method.process_weights_after_loading(experts)

    ours = Fp8FusedMoE(16, 256, 128, 4, scoring_func="softmax", renormalize=True)
    load_fused_moe(ours, reader, "model.layers.1.mlp")
    for t in (3, 40):  # vLLM's decode-sized and prefill-sized calls
        x = randn((t, 256), seed=t)
        with set_forward_context(None, cfg):
            out = block(x)
        logits = block.gate(x)[0]
        expected = ours(x, logits)
        assert out.shape == (t, 256) and calc_diff(out, expected) < SAME_INPUT_DIFF
        weights, ids = torch.topk(logits.float().softmax(-1), 4)
        loop = loop_reference(x, weights / weights.sum(-1, keepdim=True), ids,
                              _dq(ours.w13_weight, ours.w13_weight_scale_inv), _dq(ours.w2_weight, ours.w2_weight_scale_inv))
        assert calc_diff(out, loop) < LAYER_DIFF


def test_kimi_k2_block_through_vllm_matches_ours(vllm_config: VllmConfig, tmp_path) -> None:
    """vLLM's own DeepSeek MoE block (``DeepseekV2MoE``) built from a Kimi-K2 checkpoint under ``--quantization
    moe_fp8``: vLLM reads ``model_type = "kimi_k2"`` as DeepSeek-V3's config, and the block (384 experts, sigmoid
    top-8 of one group with correction bias, ``routed_scaling_factor`` 2.827, a shared expert on our linear method),
    loaded as vLLM's DeepSeek loader does, gives ``Fp8FusedMoE``'s output."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    prefix = "model.layers.1.mlp"  # the tiny model's MoE layer

    def build(hf_config, cfg, quant_config):
        assert type(hf_config).__name__ == "DeepseekV3Config" and hf_config.n_routed_experts == 384
        return DeepseekV2MoE(hf_config, cfg.parallel_config, quant_config=quant_config, prefix=prefix)

    cfg, reader, block = _block_through_vllm(tmp_path, tiny_kimi_k2_config(), build)
    _load_deepseek_style_block(block, reader, prefix, 384)
    ours = Fp8FusedMoE(384, 256, 128, 8, scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.827,
                       use_correction_bias=True, num_shared_experts=1)
    load_fused_moe(ours, reader, prefix)
    for t in (3, 40):  # vLLM's decode-sized and prefill-sized calls
        x = randn((t, 256), seed=t)
        with set_forward_context(None, cfg):
            out, shared_out = block(x), block.shared_experts(x)
        logits = block.gate(x)[0]
        # vLLM's shared MLP (DeepseekV2MLP) rounds SiLU·mul to bf16 before our down projection quantizes it; our
        # Fp8MLP quantizes the fp32 product. With that rounding the two are equal, and the block is within 1e-4.
        gate_up = ours.shared_experts.gate_up_proj(x).float()
        h = (torch.nn.functional.silu(gate_up[:, :128]) * gate_up[:, 128:]).to(torch.bfloat16)
        assert torch.equal(shared_out, ours.shared_experts.down_proj(h))
        assert out.shape == (t, 256) and calc_diff(out, ours(x, logits.float())) < 1e-4


def _block_through_vllm(tmp_path, config: dict, build) -> tuple[VllmConfig, CheckpointReader, torch.nn.Module]:
    """A random checkpoint of ``config`` read by vLLM under ``--quantization moe_fp8``, and ``build(hf_config,
    vllm_config, quant_config)``'s MoE block of its layer 1, on the default dtype vLLM's loader sets."""
    from vllm.config import ModelConfig
    from vllm.utils.torch_utils import set_default_torch_dtype

    path = write_checkpoint(tmp_path / config["model_type"], config, seed=5, num_shards=1)
    model_config = ModelConfig(model=str(path), tokenizer=str(path), skip_tokenizer_init=True,
                               quantization="moe_fp8", dtype="bfloat16")
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=model_config)
    assert isinstance(cfg.quant_config, MoeFp8Config)
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.bfloat16):
        block = build(model_config.hf_config, cfg, cfg.quant_config)
    assert isinstance(block.experts.routed_experts.quant_method, MoeFp8MoEMethod)
    return cfg, CheckpointReader(path), block


def _process_after_loading(block: torch.nn.Module) -> None:
    for module in block.modules():
        if hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            module.quant_method.process_weights_after_loading(module)


def _load_deepseek_style_block(block: torch.nn.Module, reader: CheckpointReader, prefix: str, num_experts: int) -> None:
    """Fill a DeepSeek-style vLLM MoE block (``DeepseekV2MoE``, ``Glm4MoE``) as vLLM's loaders do: the experts, the
    shared MLP (gate / up stacked into ``gate_up_proj``), the gate and its correction bias; then process them."""
    assert isinstance(block.shared_experts.gate_up_proj.quant_method, MoeFp8LinearMethod)
    tensors = {n: reader.get(n) for n in reader if n.startswith(f"{prefix}.experts.")}
    assert load_experts_through_vllm(block.experts, tensors, 1, num_experts) == set(tensors)
    shared = block.shared_experts
    _load_merged(shared.gate_up_proj, [read_block_fp8(reader, f"{prefix}.shared_experts.{proj}")
                                       for proj in ("gate_proj", "up_proj")])
    for name in ("weight", "weight_scale_inv"):
        param = getattr(shared.down_proj, name)
        param.weight_loader(param, reader.get(f"{prefix}.shared_experts.down_proj.{name}"))
    block.gate.weight.data.copy_(reader.get(f"{prefix}.gate.weight"))
    block.gate.e_score_correction_bias.data.copy_(reader.get(f"{prefix}.gate.e_score_correction_bias"))
    _process_after_loading(block)


def test_glm4_moe_block_through_vllm_matches_ours(vllm_config: VllmConfig, tmp_path) -> None:
    """vLLM's own GLM-4.5 MoE block (``Glm4MoE``: sigmoid top-4 of one group with the gate's correction bias,
    ``routed_scaling_factor`` 2.5, a shared expert on our linear method) on a GLM-4.5 checkpoint under
    ``--quantization moe_fp8``, loaded as vLLM's loader does, gives ``Fp8FusedMoE``'s output."""
    from vllm.model_executor.models.glm4_moe import Glm4MoE

    prefix = "model.layers.1.mlp"  # the tiny model's first MoE layer
    cfg, reader, block = _block_through_vllm(tmp_path, tiny_glm4_moe_config(),
                                             lambda hf, _cfg, qc: Glm4MoE(hf, quant_config=qc, prefix=prefix))
    _load_deepseek_style_block(block, reader, prefix, 16)

    ours = Fp8FusedMoE(16, 256, 128, 4, scoring_func="sigmoid", renormalize=True, routed_scaling_factor=2.5,
                       use_correction_bias=True, num_shared_experts=1)
    load_fused_moe(ours, reader, prefix)
    # (vLLM's shared MLP rounds SiLU·mul to bf16 before its down projection: within 1e-4, as for Kimi-K2)
    _assert_block_matches(block, ours, cfg, 1e-4)


def _assert_block_matches(block: torch.nn.Module, ours: Fp8FusedMoE, cfg: VllmConfig, bound: float) -> None:
    """vLLM's block and ``ours`` on the block's own router logits, at vLLM's decode- and prefill-sized calls."""
    for t in (3, 40):
        x = randn((t, 256), seed=t)
        with set_forward_context(None, cfg):
            out = block(x)
        logits = block.gate(x)[0]
        assert out.shape == (t, 256) and calc_diff(out, ours(x, logits.float())) < bound


def _torch_topk_sigmoid(topk_weights: torch.Tensor, topk_ids: torch.Tensor, token_expert_indices: torch.Tensor,
                        gating_output: torch.Tensor, renormalize: bool = False,
                        e_score_correction_bias: torch.Tensor | None = None,
                        routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, ...]:
    """vLLM's ``topk_sigmoid`` (a CUDA op of ``vllm._moe_C``) in torch, for CPU: sigmoid scores in fp32, the top-k
    of score + bias, their scores optionally renormalized, scaled, written into the caller's buffers."""
    scores = gating_output.float().sigmoid()
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    ids = torch.topk(choice, topk_weights.shape[1]).indices
    weights = scores.gather(1, ids)
    topk_weights.copy_((weights / weights.sum(-1, keepdim=True) if renormalize else weights) * routed_scaling_factor)
    topk_ids.copy_(ids)
    return topk_weights, topk_ids


def test_minimax_m2_block_through_vllm_matches_ours(vllm_config: VllmConfig, tmp_path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own MiniMax-M2 MoE block (``MiniMaxM2MoE``: sigmoid top-4 of all experts with the block's correction
    bias, renormalized, its checkpoint's ``w1`` / ``w3`` / ``w2`` names) on a MiniMax-M2 checkpoint under
    ``--quantization moe_fp8`` gives ``Fp8FusedMoE``'s output (loaded with ``MOE_NAMES["minimax_m2"]``). vLLM's
    sigmoid top-k is a CUDA op: on CPU the test runs its torch equivalent in its place."""
    from vllm.model_executor.layers.fused_moe.router import fused_topk_bias_router
    from vllm.model_executor.models.minimax_m2 import MiniMaxM2MoE

    monkeypatch.setattr(fused_topk_bias_router, "vllm_topk_sigmoid", _torch_topk_sigmoid)

    names = MOE_NAMES["minimax_m2"]
    prefix = f"model.layers.1.{names.block}"
    cfg, reader, block = _block_through_vllm(tmp_path, tiny_minimax_m2_config(),
                                             lambda hf, _cfg, qc: MiniMaxM2MoE(hf, quant_config=qc, prefix=prefix))
    tensors = {n: reader.get(n) for n in reader if n.startswith(f"{prefix}.experts.")}
    assert load_experts_through_vllm(block.experts, tensors, 1, 16, family="minimax_m2") == set(tensors)
    block.gate.weight.data.copy_(reader.get(f"{prefix}.gate.weight"))
    block.e_score_correction_bias.data.copy_(reader.get(f"{prefix}.{names.bias}"))
    _process_after_loading(block)

    ours = Fp8FusedMoE(16, 256, 128, 4, scoring_func="sigmoid", renormalize=True, use_correction_bias=True)
    load_fused_moe(ours, reader, prefix, names=names)
    _assert_block_matches(block, ours, cfg, SAME_INPUT_DIFF)


def test_moe_unloaded_scales_are_refused(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    with set_current_vllm_config(vllm_config):
        runner = _make_moe(quant_config)
    experts = runner.routed_experts
    with pytest.raises(ValueError, match="w13_weight_scale_inv of MoE layer"):
        experts.quant_method.process_weights_after_loading(experts)


@pytest.mark.parametrize("mode", ["tp", "ep_linear", "ep_round_robin"])
def test_moe_parallel_ranks_sum_to_full_output(vllm_config: VllmConfig, quant_config: MoeFp8Config,
                                               monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    ranks = 2
    ckpt = Checkpoint(layer=5, seed=40)
    x, logits = randn((11, H), seed=41), randn((11, E), seed=42, dtype=torch.float32)
    cfg = vllm_config
    if mode.startswith("ep"):
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(
            enable_expert_parallel=True, expert_placement_strategy=mode.removeprefix("ep_")))
    outs = []
    for rank in range(ranks):
        with set_current_vllm_config(cfg), _tp_rank(monkeypatch, rank, ranks):
            runner = _make_moe(quant_config, tp_size=ranks)
        experts = runner.routed_experts
        assert ckpt.load_into(runner)
        if mode == "tp":
            assert experts.moe_config.tp_size == ranks and experts.moe_config.tp_rank == rank
            w13, s13, w2, s2 = shard_moe_weights(ckpt.w13, ckpt.s13, ckpt.w2, ckpt.s2, rank, ranks)
            assert experts.w13_weight.shape == (E, 2 * INTER // ranks, H)
        else:
            assert experts.moe_config.ep_size == ranks and experts.moe_config.ep_rank == rank
            _, vllm_map, _ = determine_expert_map(ranks, rank, E, mode.removeprefix("ep_"))
            assert torch.equal(experts.expert_map.cpu(), vllm_map)
            local = [g for g in range(E) if int(vllm_map[g]) >= 0]
            local.sort(key=lambda g: int(vllm_map[g]))
            w13, s13, w2, s2 = ckpt.w13[local], ckpt.s13[local], ckpt.w2[local], ckpt.s2[local]
            assert experts.w13_weight.shape == (E // ranks, 2 * INTER, H)
        assert torch.equal(experts.w13_weight.view(torch.uint8), w13.view(torch.uint8))
        assert torch.equal(experts.w2_weight_scale_inv, s2) and torch.equal(experts.w13_weight_scale_inv, s13)
        assert torch.equal(experts.w2_weight.view(torch.uint8), w2.view(torch.uint8))
        experts.quant_method.process_weights_after_loading(experts)
        outs.append(_forward(cfg, runner, x, logits).float())
    full = ckpt.fp8_fused_moe()(x, logits)
    total = sum(outs)
    assert calc_diff(total, full) < SAME_INPUT_DIFF and rel_error(total, full) < SAME_INPUT_REL


def test_moe_refuses_unsupported(vllm_config: VllmConfig, quant_config: MoeFp8Config,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with set_current_vllm_config(vllm_config):
        with _tp_rank(monkeypatch, 0, 4), pytest.raises(ValueError, match="multiple of 128"):
            _make_moe(quant_config, tp_size=4)        # INTER = 256 over 4 ranks: 64, cuts a scale block
        with pytest.raises(NotImplementedError, match="expert biases"):
            _make_moe(quant_config, has_bias=True)
        with pytest.raises(NotImplementedError, match="SwiGLU"):
            _make_moe(quant_config, swiglu_limit=7.0)


def _batched_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """vLLM's reference batched dispatch ([E, max_tokens, H] + per-expert counts), then moe_fp8's quantization
    (vLLM's own FP8 quantization kernel needs Triton on a GPU)."""
    t = x.shape[0]
    prepare_finalize = BatchedPrepareAndFinalize(max_num_tokens=t, num_local_experts=num_experts,
                                                 num_dispatchers=1, rank=0)
    b_x, b_scale, meta, _, _ = prepare_finalize.prepare(x, topk_weights, topk_ids, num_experts, None, False,
                                                        FUSED_MOE_UNQUANTIZED_CONFIG)
    assert b_scale is None and b_x.shape == (num_experts, t, H)
    x_fp8, x_scale = quant.per_token_group(b_x.reshape(-1, H))
    # A [E·T, KG] column-major scale viewed per expert: not the 3-D TMA layout (the experts must convert it).
    return prepare_finalize, x_fp8.view(num_experts, t, H), x_scale.view(num_experts, t, -1), meta


def test_batched_experts_match_reference(vllm_config: VllmConfig, quant_config: MoeFp8Config,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = Checkpoint(layer=7, seed=60)
    with set_current_vllm_config(vllm_config):
        runner = _make_moe(quant_config)
    ckpt.load_into(runner)
    experts_layer = runner.routed_experts
    method = experts_layer.quant_method
    qc = method.get_fused_moe_quant_config(experts_layer)
    t = 6
    x, logits = randn((t, H), seed=61), randn((t, E), seed=62, dtype=torch.float32)
    topk_weights, topk_ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
    prepare_finalize, a, a_scale, meta = _batched_inputs(x, topk_weights, topk_ids, E)
    experts = MoeFp8BatchedExperts(experts_layer.moe_config, qc, max_num_tokens=t, num_dispatchers=1)
    assert experts.activation_format() == mk.FusedMoEActivationFormat.BatchedExperts
    # the GEMMs' expected_m hint: copies per global expert of a batch of this call's tokens from each dispatcher
    # (capped by the capacity), so a small decode batch in a large buffer looks small (few-rows GEMM)
    wide = MoeFp8BatchedExperts(experts_layer.moe_config, qc, max_num_tokens=256, num_dispatchers=8)
    assert wide._expected_m(2048, 1, TOP_K) == max(1, -(-8 * TOP_K // E))
    assert wide._expected_m(2048, 512, TOP_K) == -(-256 * 8 * TOP_K // E)
    _, _, out_shape = experts.workspace_shapes(t, 2 * INTER, H, TOP_K, E, E, meta, experts_layer.activation)
    fused_out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16)   # poisoned: rows past counts stay
    experts.apply(fused_out, a, experts_layer.w13_weight, experts_layer.w2_weight, topk_weights, topk_ids,
                  experts_layer.activation, E, None, a_scale, None, torch.empty(0), torch.empty(0), meta, False)
    out = torch.empty((t, H), dtype=torch.bfloat16)
    prepare_finalize.finalize(out, fused_out, topk_weights, topk_ids, False,
                              experts.finalize_weight_and_reduce_impl())  # vLLM's batched combine
    expected = ckpt.fp8_fused_moe()(x, logits)
    assert calc_diff(out, expected) < SAME_INPUT_DIFF and rel_error(out, expected) < SAME_INPUT_REL
    assert calc_diff(out, ckpt.loop_reference(x, topk_weights, topk_ids)) < LAYER_DIFF
    # Strict mode refuses the silent scale-layout copy.
    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    with pytest.raises(ValueError, match="TMA layout"):
        experts.apply(fused_out, a, experts_layer.w13_weight, experts_layer.w2_weight, topk_weights, topk_ids,
                      experts_layer.activation, E, None, a_scale, None, torch.empty(0), torch.empty(0), meta, False)


def test_masked_experts_compile_fullgraph(vllm_config: VllmConfig, quant_config: MoeFp8Config) -> None:
    """The decode path (masked layout) traces into one graph: no host sync, no data-dependent shape."""
    ckpt = Checkpoint(layer=9, seed=80)
    with set_current_vllm_config(vllm_config):
        runner = _make_moe(quant_config)
    ckpt.load_into(runner)
    layer = runner.routed_experts
    layer.quant_method.process_weights_after_loading(layer)
    experts = layer.quant_method.moe_kernel.fused_experts
    x, logits = randn((4, H), seed=81), randn((4, E), seed=82, dtype=torch.float32)
    topk_weights, topk_ids = runner.router.select_experts(hidden_states=x, router_logits=logits)

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        experts.apply(out, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.activation, E,
                      None, None, None, torch.empty(0), torch.empty(0), None, False)
        return out

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    assert calc_diff(compiled(x, topk_weights, topk_ids), run(x, topk_weights, topk_ids)) < SAME_INPUT_DIFF
    assert moe_fp8.backend("fp8_grouped_gemm_masked", "cpu") == "reference"
