"""End to end: a tiny random DeepSeek-V3 saved as a real block-FP8 checkpoint, loaded into transformers'
``DeepseekV3ForCausalLM`` running on moe_fp8 layers, against transformers' own model with the weights
dequantized to fp32 (DESIGN §6: ``calc_diff < 2e-3``), plus ``generate``; then the same for Qwen3-MoE
(``Qwen3MoeForCausalLM``: grouped-query attention, softmax routing, no shared experts), the other family of
block-FP8 MoE checkpoints in this format, for Kimi-K2 (DeepSeek-V3 under ``model_type = "kimi_k2"``, 384
experts in one group), for GLM-4.5 (``Glm4MoeForCausalLM``: DeepSeek-V3's MoE block under grouped-query attention
with q / k / v biases) and for MiniMax-M2 (``MiniMaxM2ForCausalLM``: Mixtral's tensor names, every layer MoE).

Routing and numerics are checked separately, because a quantized model legitimately routes a few
near-tie tokens differently from the fp32 model (its hidden states differ by the FP8 activation
rounding), and one flipped expert moves a token's logits far more than the FP8 error does:

1. routing: transformers' own router, applied to the hidden states *our* model feeds its MoE blocks,
   must choose exactly the experts our layers chose (every token, every MoE layer);
2. numerics: the fp32 model run with that same routing must give our logits within ``calc_diff < 2e-3``
   — and zeroing its MoE outputs must move them far more, so the bound is not vacuous.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import transformers

from moe_fp8 import calc_diff, quant
from moe_fp8.integrations import transformers as hf
from moe_fp8.layers import (
    CheckpointReader,
    Fp8FusedMoE,
    Fp8Linear,
    Fp8MLP,
    tiny_deepseek_v3_config,
    tiny_glm4_moe_config,
    tiny_kimi_k2_config,
    tiny_minimax_m2_config,
    tiny_qwen3_moe_config,
    write_checkpoint,
    write_deepseek_v3_checkpoint,
    write_qwen3_moe_checkpoint,
)
from moe_fp8.layers import moe as moe_module

MODEL_DIFF = 2e-3
CROSSOVER = 8  # masked path for <= 8 tokens: prefill (2 × 16 tokens) is contiguous, decode (2 tokens) masked


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # hidden 256, 3 layers (first dense), 16 experts top-4 of 2 of 4 groups, 1 shared expert, MLA ranks 128
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"), tiny_deepseek_v3_config(), seed=0)


@pytest.fixture(scope="module")
def ours(ckpt):
    return hf.load_model(ckpt, dtype=torch.bfloat16, masked_max_tokens=CROSSOVER)


@pytest.fixture(scope="module")
def reference(ckpt):
    return hf.load_reference_model(ckpt, dtype=torch.float32)


class RoutingRecorder:
    """Records, per call of our MoE layers, the router input and the experts chosen (via select_experts)."""

    def __init__(self, model, monkeypatch) -> None:
        self.inputs, self.ids, self.paths = [], [], []
        real = moe_module.select_experts

        def select(*args, **kwargs):
            weights, ids = real(*args, **kwargs)
            self.ids.append(ids)
            return weights, ids

        monkeypatch.setattr(moe_module, "select_experts", select)
        for name in ("_experts_contiguous", "_experts_masked"):
            real_path = getattr(Fp8FusedMoE, name)

            def spy(module, *args, _real=real_path, _name=name, **kwargs):
                self.paths.append(_name.removeprefix("_experts_"))
                return _real(module, *args, **kwargs)

            monkeypatch.setattr(Fp8FusedMoE, name, spy)
        self.moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, hf.Fp8MoEBlock)]
        for i in self.moe_layers:
            model.model.layers[i].mlp.register_forward_pre_hook(
                lambda mod, args: self.inputs.append(args[0].detach().reshape(-1, args[0].shape[-1])))

    def clear(self) -> None:
        self.inputs.clear(), self.ids.clear(), self.paths.clear()


def _sorted(ids: torch.Tensor) -> torch.Tensor:
    return ids.long().sort(dim=-1).values


@torch.no_grad()
def check_against_reference(ours, reference, input_ids, recorder) -> float:
    recorder.clear()
    logits = ours(input_ids.to(ours.device)).logits.float().cpu()
    assert logits.isfinite().all()
    assert len(recorder.ids) == len(recorder.moe_layers) and recorder.moe_layers
    # 1. routing: transformers' router on our hidden states picks our experts
    for i, x, ids in zip(recorder.moe_layers, recorder.inputs, recorder.ids, strict=True):
        _, _, ref_ids = hf.reference_route(reference.model.layers[i].mlp, x.float().cpu())
        assert torch.equal(_sorted(ref_ids), _sorted(ids.cpu())), f"layer {i}: routing differs from transformers' router"
    # 2. numerics with the same routing
    ref_logits = hf.reference_logits(reference, input_ids, recorder.ids)
    diff = calc_diff(logits, ref_logits)
    assert diff < MODEL_DIFF, f"logits calc_diff {diff:.2e} vs fp32 transformers model"
    without_moe = hf.reference_logits(reference, input_ids, recorder.ids, zero_moe=True)
    assert calc_diff(without_moe, ref_logits) > 10 * MODEL_DIFF  # the MoE layers matter to the logits
    return diff


def test_model_is_patched_with_fp8_layers(ours, ckpt):
    report = ours.moe_fp8_report
    layers = ours.model.layers
    assert isinstance(layers[0].mlp, Fp8MLP)  # first_k_dense_replace = 1
    for i in (1, 2):
        assert isinstance(layers[i].mlp, hf.Fp8DeepseekV3MoE)
        assert layers[i].mlp.experts.w13_weight.shape == (16, 256, 256)
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert all(isinstance(getattr(layer.self_attn, proj), Fp8Linear) for layer in layers)
    assert report.moe_layers == ["model.layers.1.mlp", "model.layers.2.mlp"]
    assert report.unused == [] and report.kept_unquantized == [] and report.quantized_on_load == []
    assert not report.ue8m0 and not any(getattr(m, "ue8m0", False) for m in ours.modules())
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16 for m in ours.modules())
    assert ours.lm_head.weight.dtype == torch.bfloat16 and not ours.lm_head.weight.is_meta


def test_logits_match_fp32_transformers_model(ours, reference, monkeypatch):
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    check_against_reference(ours, reference, input_ids, recorder)
    assert recorder.paths == ["contiguous", "contiguous"]  # 32 tokens > CROSSOVER
    single = input_ids[:1, :6]  # 6 tokens: the masked (decode) path through the whole model
    check_against_reference(ours, reference, single, recorder)
    assert recorder.paths == ["masked", "masked"]


def test_compare_logits_matches_the_step_by_step_check(ours, reference, monkeypatch):
    """``compare_logits`` (what ``moe-fp8 demo`` reports) agrees with the checks above on the same input."""
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    want = check_against_reference(ours, reference, input_ids, recorder)
    report = hf.compare_logits(ours, reference, input_ids)
    assert report.routing_choices == 2 * 16 * 4 * 2  # tokens x top-4 x 2 MoE layers
    assert report.router_disagrees == 0 and 0 <= report.routing_differs <= report.routing_choices
    assert report.diff_same_routing == pytest.approx(want, rel=1e-6)
    assert report.diff == pytest.approx(calc_diff(ours(input_ids).logits.float(), reference(input_ids).logits))


@torch.no_grad()
def test_generate(ours, monkeypatch):
    recorder = RoutingRecorder(ours, monkeypatch)
    prompt = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    out = ours.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                        output_logits=True, pad_token_id=0)
    seq = out.sequences
    assert seq.shape == (2, 14) and torch.equal(seq[:, :10], prompt)
    assert recorder.paths[:2] == ["contiguous", "contiguous"]  # prefill: 20 tokens
    assert set(recorder.paths[2:]) == {"masked"} and len(recorder.paths) == 8  # 3 decode steps of 2 tokens
    # KV-cached decode through the masked path agrees with a full forward (contiguous path) of the sequence.
    full = ours(seq).logits.float()
    for step, step_logits in enumerate(out.logits):
        pos = 9 + step
        assert step_logits.isfinite().all()
        assert calc_diff(step_logits.float(), full[:, pos]) < 1e-3
        assert torch.equal(seq[:, pos + 1], step_logits.argmax(-1))


def test_bf16_checkpoint_and_unquantizable_projection(tmp_path, monkeypatch):
    """A bf16 checkpoint is quantized on load; a projection the FP8 GEMM cannot take (kv_b_proj with
    K = kv_lora_rank = 120, not a multiple of 16) stays an nn.Linear, and the model still matches.
    Also the config variants without q LoRA (one q_proj) and with tied embeddings."""
    config = tiny_deepseek_v3_config(num_hidden_layers=2, kv_lora_rank=120, q_lora_rank=None,
                                     tie_word_embeddings=True)
    path = write_deepseek_v3_checkpoint(tmp_path / "bf16", config, seed=5, fp8=False, num_shards=1)
    ours = hf.load_model(path)
    report = ours.moe_fp8_report
    assert report.kept_unquantized == ["model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj"]
    kv_b = ours.model.layers[0].self_attn.kv_b_proj
    assert type(kv_b) is torch.nn.Linear and kv_b.weight.dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in report.quantized_on_load
    assert "model.layers.0.self_attn.q_proj.weight" in report.quantized_on_load
    q = ours.model.layers[0].self_attn.q_proj
    w, s = quant.per_block(CheckpointReader(path).get("model.layers.0.self_attn.q_proj.weight"))
    assert torch.equal(q.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(q.weight_scale_inv, s)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # still tied after loading
    reference = hf.load_reference_model(path)
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    check_against_reference(ours, reference, input_ids, recorder)


def test_ue8m0_checkpoint(tmp_path, monkeypatch):
    """A DeepSeek-V3.1-style checkpoint (scale_fmt "ue8m0"): every FP8 layer is built with ue8m0=True and
    the model still matches the fp32 transformers model."""
    path = write_deepseek_v3_checkpoint(tmp_path / "v31", tiny_deepseek_v3_config(num_hidden_layers=2), seed=8,
                                        scale_fmt="ue8m0")
    ours = hf.load_model(path, masked_max_tokens=CROSSOVER)
    assert ours.moe_fp8_report.ue8m0
    fp8_modules = [m for m in ours.modules() if isinstance(m, (Fp8Linear, Fp8MLP, Fp8FusedMoE))]
    assert len(fp8_modules) > 10 and all(m.ue8m0 for m in fp8_modules)
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    check_against_reference(ours, hf.load_reference_model(path), input_ids, recorder)


def test_ignored_layers_stay_unquantized(ckpt, tmp_path, monkeypatch):
    """quantization_config.ignored_layers (full names, as `moe-fp8 quantize --skip` writes them) and
    modules_to_not_convert-style short names keep those projections bf16 nn.Linear; experts cannot be listed."""
    path = tmp_path / "ignored"
    shutil.copytree(ckpt, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
                                                       "kv_b_proj"]
    (path / "config.json").write_text(json.dumps(config))
    ours = hf.load_model(path, masked_max_tokens=CROSSOVER)
    layer0 = ours.model.layers[0]
    kept = [layer0.self_attn.o_proj, layer0.mlp.down_proj] + [layer.self_attn.kv_b_proj for layer in ours.model.layers]
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in kept)
    assert isinstance(layer0.mlp.gate_proj, Fp8Linear) and isinstance(ours.model.layers[1].self_attn.o_proj, Fp8Linear)
    assert sorted(ours.moe_fp8_report.kept_unquantized) == sorted(
        ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
        + [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(3)])
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(9))
    check_against_reference(ours, hf.load_reference_model(path), input_ids, recorder)
    for entry in ("model.layers.1.mlp.experts.3", "shared_experts"):
        config["quantization_config"]["ignored_layers"] = [entry]
        (path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=r"keeps model\.layers\.1\.mlp\..* unquantized: moe_fp8 runs MoE experts"):
            hf.load_model(path)


def test_scales_stored_as_e8m0_in_unquantized_projections(tmp_path):
    """A DeepSeek-V3.1-style checkpoint may store its scales as float8_e8m0fnu: a projection kept unquantized
    (kv_b_proj, K = 120) and the reference model dequantize them like the FP8 layers read them."""
    from safetensors.torch import load_file, save_file

    config = tiny_deepseek_v3_config(num_hidden_layers=2, kv_lora_rank=120)
    path = write_deepseek_v3_checkpoint(tmp_path / "v31", config, seed=0, scale_fmt="ue8m0", num_shards=1)
    shard = path / "model-00001-of-00001.safetensors"
    fp32 = load_file(str(shard))
    save_file({k: v.to(torch.float8_e8m0fnu) if k.endswith("_scale_inv") else v for k, v in fp32.items()},
              str(shard), metadata={"format": "pt"})
    ours, reference = hf.load_model(path), hf.load_reference_model(path)
    kv_b = ours.model.layers[0].self_attn.kv_b_proj
    assert type(kv_b) is torch.nn.Linear
    name = "model.layers.0.self_attn.kv_b_proj"
    want = quant.dequant_per_block(fp32[f"{name}.weight"], fp32[f"{name}.weight_scale_inv"])
    assert torch.equal(kv_b.weight, want.to(torch.bfloat16))
    assert torch.equal(reference.model.layers[0].self_attn.kv_b_proj.weight, want)


@torch.no_grad()
def test_dtype_casts_and_router_logits(ckpt):
    """model.to(bf16) / .half() change the activation dtype only (FP8 weights, scales and the bf16 router stay);
    output_router_logits=True returns the logits each MoE block routed on, as transformers' model does."""
    ours = hf.load_model(ckpt, masked_max_tokens=CROSSOVER)
    input_ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(10))
    inputs: list[torch.Tensor] = []
    blocks = [m for m in ours.modules() if isinstance(m, hf.Fp8DeepseekV3MoE)]
    handles = [b.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for b in blocks]
    out = ours(input_ids, output_router_logits=True)
    for h in handles:
        h.remove()
    # (transformers before 5.2x returns no router logits from DeepseekV3ForCausalLM: nothing to compare there)
    router_logits = getattr(out, "router_logits", None) or [b.router_logits(x.reshape(-1, x.shape[-1]))
                                                             for b, x in zip(blocks, inputs, strict=True)]
    assert len(router_logits) == len(blocks) == 2
    for logits, block, x in zip(router_logits, blocks, inputs, strict=True):
        assert logits.dtype == torch.float32 and logits.shape == (18, 16)
        assert torch.equal(logits, block.router_logits(x.reshape(-1, x.shape[-1])))
    before = out.logits

    def dtypes() -> dict[str, torch.dtype]:
        return {n: t.dtype for n, t in [*ours.named_parameters(), *ours.named_buffers()]}

    start = dtypes()
    ours.to(torch.bfloat16)  # the model is bf16 already: only transformers' fp32 rotary tables are rounded
    assert {n for n, dt in dtypes().items() if dt != start[n]} <= {"model.rotary_emb.inv_freq",
                                                                   "model.rotary_emb.original_inv_freq"}
    ours.half()
    ours_tensors = {n for n in start if ".mlp." in n and not n.endswith("layernorm.weight")} | {
        n for n, m in ours.named_modules() if isinstance(m, Fp8Linear) for n in (f"{n}.weight", f"{n}.weight_scale_inv")}
    assert all(dtypes()[n] == start[n] for n in ours_tensors)
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16  # the checkpoint's
    logits16 = ours(input_ids).logits
    assert logits16.dtype == torch.float16 and calc_diff(logits16.float(), before.float()) < 2e-2


def test_transformers_own_loader_reads_our_checkpoint(tmp_path, monkeypatch):
    """transformers' ``from_pretrained`` (its FP8 quantizer, dequantizing on a CPU machine) reads the synthetic
    checkpoint into exactly the weights of ``load_reference_model``: the format is the one it expects.

    NOTE: kv_lora_rank = 96 makes every FP8 weight's scale grid regular for transformers 5's dequantizer,
    which derives the block size as rows // scale_rows and so mis-scales a ragged N such as
    kv_a_proj_with_mqa's (DeepSeek-V3: 576 rows, 5 scale rows) — its limitation, not the format's."""
    config = tiny_deepseek_v3_config(num_hidden_layers=2, kv_lora_rank=96)
    path = write_deepseek_v3_checkpoint(tmp_path / "ckpt", config, seed=6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # where a GPU is visible it would keep FP8
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    mine = hf.load_reference_model(path)
    a, b = theirs.state_dict(), mine.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_errors(ckpt, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="already patched"):
        hf.patch_model(hf.load_model(ckpt), ckpt)
    config = transformers.AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        meta_model = transformers.DeepseekV3ForCausalLM(config)
    with pytest.raises(ValueError, match="device="):
        hf.patch_model(meta_model, ckpt)
    llama = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                     num_attention_heads=2, vocab_size=64)
    with torch.device("meta"):
        other = transformers.LlamaForCausalLM(llama)
    with pytest.raises(ValueError, match="'deepseek_v3', 'qwen3_moe', 'glm4_moe', 'minimax_m2' models"):
        hf.patch_model(other, ckpt, device="cpu")
    # config fields transformers' DeepseekV3 ignores but our layers would not honour
    for field, value, match in (("hidden_act", "gelu", "SiLU-gated"), ("scoring_func", "softmax", "sigmoid")):
        changed = transformers.AutoConfig.from_pretrained(ckpt, **{field: value})
        with torch.device("meta"):
            model = transformers.DeepseekV3ForCausalLM(changed)
        with pytest.raises(ValueError, match=match):
            hf.patch_model(model, ckpt, device="cpu")
    # a checkpoint that lacks a tensor the model needs
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.post_attention_layernorm.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="post_attention_layernorm"):
        hf.load_model(broken)
    # transformers missing: a clear ImportError naming the extra
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"moe-fp8\[transformers\]"):
        hf.load_model(ckpt)


# ----------------------------------------------------------------------------------------------
# Qwen3-MoE
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    # hidden 256, 3 layers (mlp_only_layers [0]), 16 experts top-4 renormalized, 4 query / 2 KV heads of 64
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("qwen3"), tiny_qwen3_moe_config(), seed=0)


@pytest.fixture(scope="module")
def qwen3_ours(qwen3_ckpt):
    return hf.load_model(qwen3_ckpt, dtype=torch.bfloat16, masked_max_tokens=CROSSOVER)


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_ckpt):
    return hf.load_reference_model(qwen3_ckpt, dtype=torch.float32)


def test_qwen3_model_is_patched_with_fp8_layers(qwen3_ours):
    layers = qwen3_ours.model.layers
    assert isinstance(qwen3_ours, transformers.Qwen3MoeForCausalLM)
    assert isinstance(layers[0].mlp, Fp8MLP)  # mlp_only_layers = [0]
    for i in (1, 2):
        block = layers[i].mlp
        assert isinstance(block, hf.Fp8Qwen3MoeSparseMoeBlock)
        assert block.experts.w13_weight.shape == (16, 256, 256) and block.experts.shared_experts is None
        assert block.experts.scoring_func == "softmax" and block.experts.renormalize
        assert block.gate.weight.dtype == torch.bfloat16  # the checkpoint's
    for layer in layers:
        assert all(isinstance(getattr(layer.self_attn, p), Fp8Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert layer.self_attn.k_proj.weight.shape == (128, 256)  # 2 KV heads of 64
        assert not layer.self_attn.q_norm.weight.is_meta  # per-head norms stay transformers'
    report = qwen3_ours.moe_fp8_report
    assert report.moe_layers == ["model.layers.1.mlp", "model.layers.2.mlp"] and len(report.fp8_linears) == 13
    assert report.unused == [] and report.kept_unquantized == [] and report.quantized_on_load == []


@torch.no_grad()
def test_qwen3_generate_and_router_logits(qwen3_ours, monkeypatch):
    recorder = RoutingRecorder(qwen3_ours, monkeypatch)
    prompt = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    out = qwen3_ours.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                              output_logits=True, pad_token_id=0)
    assert out.sequences.shape == (2, 14) and recorder.paths[:2] == ["contiguous", "contiguous"]
    assert set(recorder.paths[2:]) == {"masked"} and len(recorder.paths) == 8
    full = qwen3_ours(out.sequences).logits.float()
    for step, step_logits in enumerate(out.logits):  # KV-cached masked decode = full contiguous forward
        assert calc_diff(step_logits.float(), full[:, 9 + step]) < 1e-3
    routed = qwen3_ours(prompt, output_router_logits=True).router_logits  # recorded as transformers records them
    assert len(routed) == 2 and all(r.dtype == torch.float32 and r.shape == (20, 16) for r in routed)


def test_qwen3_config_variants_from_bf16(tmp_path, monkeypatch):
    """A bf16 Qwen3-MoE checkpoint quantized on load, with attention biases, every layer MoE, tied embeddings and
    unnormalized top-k weights (``norm_topk_prob`` false, as Qwen1.5-MoE-style configs have it)."""
    config = tiny_qwen3_moe_config(num_hidden_layers=2, mlp_only_layers=[], attention_bias=True,
                                   tie_word_embeddings=True, norm_topk_prob=False)
    path = write_qwen3_moe_checkpoint(tmp_path / "bf16", config, seed=5, fp8=False, num_shards=1)
    ours = hf.load_model(path, masked_max_tokens=CROSSOVER)
    report = ours.moe_fp8_report
    assert report.moe_layers == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert "model.layers.0.self_attn.k_proj.weight" in report.quantized_on_load
    q = ours.model.layers[0].self_attn.q_proj
    assert isinstance(q, Fp8Linear) and q.bias is not None and not ours.model.layers[0].mlp.experts.renormalize
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    check_against_reference(ours, hf.load_reference_model(path), input_ids, recorder)


def test_qwen3_transformers_own_loader_reads_our_checkpoint(tmp_path, monkeypatch):
    """transformers' ``from_pretrained`` (its FP8 quantizer dequantizing on CPU, its expert fusion) reads the
    synthetic Qwen3-MoE checkpoint into exactly the weights of ``load_reference_model``."""
    path = write_qwen3_moe_checkpoint(tmp_path / "ckpt", tiny_qwen3_moe_config(num_hidden_layers=2), seed=6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    a, b = theirs.state_dict(), hf.load_reference_model(path).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_qwen3_errors(qwen3_ckpt, tmp_path):
    with pytest.raises(TypeError, match="abstract"):  # the base block has no routing of its own
        hf.Fp8MoEBlock(transformers.AutoConfig.from_pretrained(qwen3_ckpt))
    changed = transformers.AutoConfig.from_pretrained(qwen3_ckpt, hidden_act="gelu")
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(changed)
    with pytest.raises(ValueError, match="SiLU-gated"):
        hf.patch_model(model, qwen3_ckpt, device="cpu")
    path = tmp_path / "listed"
    shutil.copytree(qwen3_ckpt, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["model.layers.2.mlp.experts.15.up_proj"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"keeps model\.layers\.2\.mlp\.experts\.15\.up_proj"):
        hf.load_model(path)


# ----------------------------------------------------------------------------------------------
# Kimi-K2: DeepSeek-V3's modules under model_type "kimi_k2", 384 experts in one group, YaRN
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kimi_ckpt(tmp_path_factory):
    # hidden 256, 2 layers (first dense), 384 experts top-8 of one group, 1 shared expert, auto_map of remote code
    return write_checkpoint(tmp_path_factory.mktemp("kimi"), tiny_kimi_k2_config(), seed=0)


@pytest.fixture(scope="module")
def kimi_ours(kimi_ckpt):
    return hf.load_model(kimi_ckpt, dtype=torch.bfloat16, masked_max_tokens=CROSSOVER)


@pytest.fixture(scope="module")
def kimi_reference(kimi_ckpt):
    return hf.load_reference_model(kimi_ckpt, dtype=torch.float32)


def test_kimi_k2_loads_as_deepseek_v3(kimi_ckpt, kimi_ours, kimi_reference):
    """A ``kimi_k2`` config (with an ``auto_map`` to remote code that is not there) is read as DeepSeek-V3's, as
    vLLM reads it, and its MoE layer routes over all 384 experts with Kimi-K2's settings."""
    assert json.loads((kimi_ckpt / "config.json").read_text())["model_type"] == "kimi_k2"
    assert isinstance(kimi_ours, transformers.DeepseekV3ForCausalLM)
    assert isinstance(kimi_reference, transformers.DeepseekV3ForCausalLM)
    assert kimi_ours.config.rope_parameters["rope_type"] == "yarn"
    block = kimi_ours.model.layers[1].mlp
    assert isinstance(block, hf.Fp8DeepseekV3MoE) and isinstance(kimi_ours.model.layers[0].mlp, Fp8MLP)
    experts = block.experts
    assert experts.w13_weight.shape == (384, 256, 256) and experts.top_k == 8
    # one group is plain top-k over all experts (sigmoid, correction bias, renormalized, scaled)
    assert (experts.n_group, experts.topk_group, experts.routed_scaling_factor) == (None, None, 2.827)
    assert experts.scoring_func == "sigmoid" and experts.e_score_correction_bias.shape == (384,)
    report = kimi_ours.moe_fp8_report
    assert report.moe_layers == ["model.layers.1.mlp"] and report.unused == [] and report.kept_unquantized == []


def test_kimi_k2_logits_match_fp32_transformers_model(kimi_ours, kimi_reference, monkeypatch):
    recorder = RoutingRecorder(kimi_ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    check_against_reference(kimi_ours, kimi_reference, input_ids, recorder)
    assert recorder.paths == ["contiguous"] and len(recorder.ids[0].unique()) > 100  # 32 tokens × 8 of 384 experts
    check_against_reference(kimi_ours, kimi_reference, input_ids[:1, :6], recorder)
    assert recorder.paths == ["masked"]


# ----------------------------------------------------------------------------------------------
# On Hopper: every family
# ----------------------------------------------------------------------------------------------
FAMILY_FIXTURES = {"deepseek_v3": ("ckpt", "reference"), "qwen3_moe": ("qwen3_ckpt", "qwen3_reference"),
                   "kimi_k2": ("kimi_ckpt", "kimi_reference"), "glm4_moe": ("glm_ckpt", "glm_reference"),
                   "minimax_m2": ("minimax_ckpt", "minimax_reference")}


@pytest.mark.hopper
@pytest.mark.parametrize("family", list(FAMILY_FIXTURES))
def test_logits_match_on_hopper(family, request, monkeypatch):
    """The end-to-end check with the model on an sm_90 GPU (Hopper GEMM kernels; the routing kernels: grouped
    sigmoid, softmax for Qwen3-MoE, 384 experts for Kimi-K2, one group for GLM-4.5 and MiniMax-M2; dispatch and
    both grouped GEMMs; GLM-4.5's attention biases): the prompt on the
    contiguous path, six tokens on the masked one, then ``generate``."""
    ckpt, reference = (request.getfixturevalue(name) for name in FAMILY_FIXTURES[family])
    ours_gpu = hf.load_model(ckpt, device="cuda", masked_max_tokens=CROSSOVER)
    assert ours_gpu.model.layers[-1].mlp.experts.w13_weight.is_cuda
    recorder = RoutingRecorder(ours_gpu, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    check_against_reference(ours_gpu, reference, input_ids, recorder)
    assert recorder.paths == ["contiguous"] * len(recorder.moe_layers)
    check_against_reference(ours_gpu, reference, input_ids[:1, :6], recorder)
    assert recorder.paths == ["masked"] * len(recorder.moe_layers)
    out = ours_gpu.generate(input_ids[:, :8].cuda(), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)


# ----------------------------------------------------------------------------------------------
# GLM-4.5
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory):
    # hidden 256, 3 layers (first dense), 16 experts top-4 of one group, a shared expert, 4 query / 2 KV heads of 64
    return write_checkpoint(tmp_path_factory.mktemp("glm"), tiny_glm4_moe_config(), seed=0)


@pytest.fixture(scope="module")
def glm_ours(glm_ckpt):
    return hf.load_model(glm_ckpt, dtype=torch.bfloat16, masked_max_tokens=CROSSOVER)


@pytest.fixture(scope="module")
def glm_reference(glm_ckpt):
    return hf.load_reference_model(glm_ckpt, dtype=torch.float32)


def test_glm4_moe_model_is_patched_with_fp8_layers(glm_ours):
    layers = glm_ours.model.layers
    assert isinstance(glm_ours, transformers.Glm4MoeForCausalLM)
    assert isinstance(layers[0].mlp, Fp8MLP)  # first_k_dense_replace = 1
    for i in (1, 2):
        experts = layers[i].mlp.experts
        assert isinstance(layers[i].mlp, hf.Fp8Glm4MoeMoE) and experts.w13_weight.shape == (16, 256, 256)
        assert experts.scoring_func == "sigmoid" and experts.n_group is None and experts.routed_scaling_factor == 2.5
        assert experts.e_score_correction_bias is not None and experts.shared_experts is not None
    for layer in layers:
        attn = layer.self_attn
        assert all(isinstance(getattr(attn, p), Fp8Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None and not attn.k_norm.weight.is_meta
    report = glm_ours.moe_fp8_report
    assert report.moe_layers == ["model.layers.1.mlp", "model.layers.2.mlp"] and len(report.fp8_linears) == 13
    assert report.unused == [] and report.kept_unquantized == [] and report.quantized_on_load == []


# ----------------------------------------------------------------------------------------------
# MiniMax-M2
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minimax_ckpt(tmp_path_factory):
    # hidden 256, 2 layers (both MoE), 16 experts top-4 (sigmoid, correction bias), 4 query / 2 KV heads of 64
    return write_checkpoint(tmp_path_factory.mktemp("minimax"), tiny_minimax_m2_config(), seed=0)


@pytest.fixture(scope="module")
def minimax_ours(minimax_ckpt):
    return hf.load_model(minimax_ckpt, dtype=torch.bfloat16, masked_max_tokens=CROSSOVER)


@pytest.fixture(scope="module")
def minimax_reference(minimax_ckpt):
    return hf.load_reference_model(minimax_ckpt, dtype=torch.float32)


def test_minimax_m2_model_is_patched_with_fp8_layers(minimax_ours):
    """The checkpoint's ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` and block-level correction bias land in
    transformers' ``mlp`` as an ``Fp8MiniMaxM2SparseMoeBlock``."""
    assert isinstance(minimax_ours, transformers.MiniMaxM2ForCausalLM)
    for layer in minimax_ours.model.layers:
        block = layer.mlp
        assert isinstance(block, hf.Fp8MiniMaxM2SparseMoeBlock) and block.experts.w13_weight.shape == (16, 256, 256)
        assert block.experts.scoring_func == "sigmoid" and block.experts.renormalize
        assert block.experts.routed_scaling_factor == 1.0 and block.experts.shared_experts is None
        assert block.experts.e_score_correction_bias.abs().sum() > 0  # loaded from the block, not left zero
        assert all(isinstance(getattr(layer.self_attn, p), Fp8Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    report = minimax_ours.moe_fp8_report
    assert report.moe_layers == ["model.layers.0.mlp", "model.layers.1.mlp"] and len(report.fp8_linears) == 8
    assert report.unused == [] and report.kept_unquantized == [] and report.quantized_on_load == []


def test_minimax_m2_refuses_another_scoring_function(minimax_ckpt):
    """transformers' MiniMax-M2 router always scores with a sigmoid; a config naming another would run a different
    model under our layers, so patching refuses it."""
    changed = transformers.AutoConfig.from_pretrained(minimax_ckpt, scoring_func="softmax")
    with torch.device("meta"):
        model = transformers.MiniMaxM2ForCausalLM(changed)
    with pytest.raises(ValueError, match=r"scoring_func 'softmax'.*MiniMax-M2 router scores experts with a sigmoid"):
        hf.patch_model(model, minimax_ckpt, device="cpu")


@pytest.mark.parametrize("family", ["qwen3", "glm", "minimax"])
def test_gqa_family_logits_match_fp32_transformers_model(family, request, monkeypatch):
    """Qwen3-MoE, GLM-4.5 and MiniMax-M2 (grouped-query attention, two MoE layers of 16 experts top-4): transformers'
    router picks our experts, and the logits are within the bound, on the contiguous path (2 × 16 tokens) and the
    masked one (6 tokens); ``compare_logits`` agrees with the step-by-step check."""
    ours, reference = (request.getfixturevalue(f"{family}_{kind}") for kind in ("ours", "reference"))
    recorder = RoutingRecorder(ours, monkeypatch)
    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    want = check_against_reference(ours, reference, input_ids, recorder)
    assert recorder.paths == ["contiguous", "contiguous"]
    report = hf.compare_logits(ours, reference, input_ids)
    assert report.routing_choices == 2 * 16 * 4 * 2 and report.router_disagrees == 0
    assert report.diff_same_routing == pytest.approx(want, rel=1e-6)
    check_against_reference(ours, reference, input_ids[:1, :6], recorder)
    assert recorder.paths == ["masked", "masked"]
