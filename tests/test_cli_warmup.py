"""`moe-fp8 warmup`: model config → weight shapes → the exact kernel variants → compiled into the cache.

Everything runs on the CPU: the heuristics are host code and NVRTC / nvcc compile sm_90a without a
GPU. The compile test uses a tiny dense model (3 variants) and the faster compiler that is present.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_fp8 import cli
from moe_fp8 import warmup as W
from moe_fp8.kernels.gemm import kernel_variant
from moe_fp8.kernels.heuristics import GemmDesc, get_config, representative_rows
from moe_fp8.kernels.jit import compiler as compiler_mod
from moe_fp8.kernels.jit import find_compilers

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "num_attention_heads": 128, "vocab_size": 129280, "first_k_dense_replace": 3, "num_hidden_layers": 61,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
# Dense, standard attention: qkv 384×128, o_proj = gate_up 128×128, down 128×64 → 3 variants at M ≤ 8.
TINY_DENSE = {"model_type": "tiny", "hidden_size": 128, "intermediate_size": 64, "num_attention_heads": 1,
              "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 256}
COMPILERS = [c.name for c in find_compilers() if c.available]


def _model(tmp_path: Path, cfg: dict, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _shapes(gemms: list[W.GemmShape]) -> dict[str, tuple]:
    return {g.name: (g.n, g.k, g.layouts, g.num_groups) for g in gemms}


def test_deepseek_v3_shapes_per_rank():
    tp1 = _shapes(W.model_gemms(DEEPSEEK_V3))
    # the DeepSeek-V3 rows of the goal table (DESIGN §7 / shapes.GEMM_NK) are all there
    assert tp1["q_a_proj+kv_a_proj_with_mqa"][:2] == (2112, 7168)
    assert tp1["q_b_proj"][:2] == (24576, 1536)
    assert tp1["kv_b_proj"][:2] == (32768, 512)
    assert tp1["o_proj"][:2] == (7168, 16384)
    assert tp1["shared_experts.gate_up_proj"][:2] == (4096, 7168)
    assert tp1["shared_experts.down_proj"][:2] == (7168, 2048)
    assert tp1["experts.w13"] == (4096, 7168, ("contiguous", "masked"), 256)
    assert tp1["experts.w2"] == (7168, 2048, ("contiguous", "masked"), 256)
    assert tp1["mlp.gate_up_proj"][:2] == (36864, 7168) and tp1["mlp.down_proj"][:2] == (7168, 18432)
    assert "lm_head" not in tp1  # bf16 in DeepSeek's checkpoints

    tp8 = _shapes(W.model_gemms(DEEPSEEK_V3, tp=8, ep=1))
    assert tp8["q_a_proj+kv_a_proj_with_mqa"][:2] == (2112, 7168)  # replicated
    assert tp8["q_b_proj"][:2] == (3072, 1536)
    assert tp8["o_proj"][:2] == (7168, 2048)
    assert tp8["experts.w13"] == (512, 7168, ("contiguous", "masked"), 256)
    act = {g.name: g.act_quant for g in W.model_gemms(DEEPSEEK_V3, tp=8)}
    assert act["experts.w13"] == 1 and act["experts.w2"] == 0  # GEMM1 with the SiLU·mul + quant epilogue
    v31 = {**DEEPSEEK_V3, "quantization_config": {**DEEPSEEK_V3.get("quantization_config", {}), "scale_fmt": "ue8m0"}}
    assert {g.name: g.act_quant for g in W.model_gemms(v31)}["experts.w13"] == 2
    assert tp8["experts.w2"] == (7168, 256, ("contiguous", "masked"), 256)
    ep8 = _shapes(W.model_gemms(DEEPSEEK_V3, tp=1, ep=8))
    assert ep8["experts.w13"] == (4096, 7168, ("contiguous", "masked"), 32)
    with_head = _shapes(W.model_gemms(DEEPSEEK_V3, fp8_lm_head=True))
    assert with_head["lm_head"][:2] == (129280, 7168)


def test_kimi_k2_shapes_per_rank():
    """Kimi-K2 (scripts/models/kimi-k2.json: DeepSeek-V3's shapes with 64 heads and 384 experts): its attention
    shards at TP 8 differ from DeepSeek-V3's, its experts are DeepSeek-V3's, 48 per EP-8 rank, 24 per EP-16 rank."""
    kimi = json.loads((Path(__file__).parents[1] / "scripts" / "models" / "kimi-k2.json").read_text())
    tp8 = _shapes(W.model_gemms(kimi, tp=8))
    assert {name: tp8[name][:2] for name in ("q_b_proj", "kv_b_proj", "o_proj")} == {
        "q_b_proj": (1536, 1536), "kv_b_proj": (2048, 512), "o_proj": (7168, 1024)}
    for ep, local in ((8, 48), (16, 24)):
        shapes = _shapes(W.model_gemms(kimi, ep=ep))
        assert shapes["experts.w13"] == (4096, 7168, ("contiguous", "masked"), local)
        assert shapes["experts.w2"] == (7168, 2048, ("contiguous", "masked"), local)


def test_glm4_moe_shapes_per_rank():
    """GLM-4.5 (scripts/models/glm-4.5.json): fused q/k/v of grouped-query attention, DeepSeek-V3's MoE block (a
    shared expert, the first three layers dense), 160 experts: 20 per EP-8 rank, I / 8 = 192 per TP-8 rank refused
    (off the 128-wide scale blocks), as for Qwen3-30B-A3B at TP 4."""
    glm = json.loads((Path(__file__).parents[1] / "scripts" / "models" / "glm-4.5.json").read_text())
    tp1 = _shapes(W.model_gemms(glm))
    assert tp1["qkv_proj"][:2] == (14336, 5120) and tp1["o_proj, mlp.down_proj"][:2] == (5120, 12288)  # one shape
    assert tp1["mlp.gate_up_proj"][:2] == (24576, 5120) and tp1["shared_experts.gate_up_proj"][:2] == (3072, 5120)
    assert tp1["experts.w13"] == (3072, 5120, ("contiguous", "masked"), 160)
    ep8 = _shapes(W.model_gemms(glm, ep=8))
    assert ep8["experts.w2"] == (5120, 1536, ("contiguous", "masked"), 20)
    assert _shapes(W.model_gemms(glm, tp=4))["experts.w13"][:2] == (768, 5120)
    with pytest.raises(W.ModelConfigError, match=r"1536/8 = 192 is not a multiple of 128"):
        W.model_gemms(glm, tp=8)


def test_minimax_m2_shapes_per_rank():
    """MiniMax-M2 (scripts/models/minimax-m2.json): every layer MoE (no dense MLP), the experts' size under
    ``intermediate_size``, 256 experts: 32 per EP-8 rank, I / 8 = 192 per TP-8 rank refused."""
    mm = json.loads((Path(__file__).parents[1] / "scripts" / "models" / "minimax-m2.json").read_text())
    tp1 = _shapes(W.model_gemms(mm))
    assert tp1 == {"qkv_proj": (8192, 3072, ("normal",), 1), "o_proj": (3072, 6144, ("normal",), 1),
                   "experts.w13": (3072, 3072, ("contiguous", "masked"), 256),
                   "experts.w2": (3072, 1536, ("contiguous", "masked"), 256)}
    assert _shapes(W.model_gemms(mm, ep=8))["experts.w2"] == (3072, 1536, ("contiguous", "masked"), 32)
    with pytest.raises(W.ModelConfigError, match=r"1536/8 = 192 is not a multiple of 128"):
        W.model_gemms(mm, tp=8)


def test_qwen3_moe_shapes_per_rank():
    """Qwen3-MoE (Qwen3-30B-A3B's sizes): fused q/k/v of grouped-query attention, no shared experts, and a dense MLP
    only where mlp_only_layers / decoder_sparse_step leave one."""
    from moe_fp8.layers import tiny_qwen3_moe_config

    qwen3 = tiny_qwen3_moe_config(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                  moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                  intermediate_size=6144, num_hidden_layers=48, mlp_only_layers=[])
    tp1 = _shapes(W.model_gemms(qwen3))
    assert tp1 == {"qkv_proj": (5120, 2048, ("normal",), 1), "o_proj": (2048, 4096, ("normal",), 1),
                   "experts.w13": (1536, 2048, ("contiguous", "masked"), 128),
                   "experts.w2": (2048, 768, ("contiguous", "masked"), 128)}
    tp2 = _shapes(W.model_gemms(qwen3, tp=2))
    assert tp2["qkv_proj"][:2] == (2560, 2048) and tp2["experts.w2"][:2] == (2048, 384)
    with pytest.raises(W.ModelConfigError, match=r"768/4 = 192 is not a multiple of 128"):
        W.model_gemms(qwen3, tp=4)  # as in vLLM's and SGLang's own block-FP8 methods
    for dense in ({"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}):
        assert _shapes(W.model_gemms({**qwen3, **dense}))["mlp.gate_up_proj"][:2] == (12288, 2048)


@pytest.mark.parametrize("cfg,tp,ep,match", [
    (DEEPSEEK_V3, 3, 1, r"num_attention_heads = 128 does not split over --tp 3"),
    (DEEPSEEK_V3, 32, 1, r"moe_intermediate_size/tp = 2048/32 = 64 is not a multiple of 128"),
    ({**DEEPSEEK_V3, "moe_intermediate_size": 100}, 1, 1,
     r"moe_intermediate_size = 100 is not a multiple of 128: Fp8FusedMoE .* cannot run this model's experts"),
    (DEEPSEEK_V3, 1, 3, r"routed expert count = 256 does not split over --ep 3"),
    ({**DEEPSEEK_V3, "quantization_config": {"weight_block_size": [1, 128]}}, 1, 1, r"\[128, 128\] blocks only"),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "hidden_size"}, 1, 1, r"config.json has no hidden_size"),
    ({**TINY_DENSE, "intermediate_size": 100}, 1, 1, r"mlp.down_proj: shard 128×100 .* not supported"),
])
def test_unsupported_configs_are_clear_errors(cfg, tp, ep, match):
    with pytest.raises(W.ModelConfigError, match=match):
        W.model_gemms(cfg, tp, ep)


@pytest.mark.parametrize("layout,n,k,groups", [
    ("normal", 2112, 7168, 1), ("normal", 7168, 2048, 1), ("normal", 512, 7168, 1),
    ("masked", 4096, 7168, 32), ("masked", 7168, 256, 256),
])
def test_representative_rows_cover_every_row_count(layout, n, k, groups):
    """The claim warmup relies on: rows in one interval of representative_rows share a config."""
    reps = representative_rows(1100)
    assert reps[-1] == 1100 and reps[:5] == [48, 64, 96, 128, 192]  # 48, 96: the decode tiles' bounds

    def cfg(m: int):
        if layout == "masked":
            return get_config(GemmDesc(1100, n, k, groups, "masked", 132, expected_m=m))
        return get_config(GemmDesc(m, n, k, num_sms=132))

    lo = 1
    for hi in reps:
        want = cfg(hi)
        for m in range(lo, hi + 1):
            assert cfg(m) == want, (layout, n, k, m, hi)
        lo = hi + 1


def test_enumerated_variants_are_what_calls_compile():
    gemms = W.model_gemms(DEEPSEEK_V3, tp=8)
    variants = W.enumerate_variants(gemms, max_tokens=4096, num_sms=132, top_k=8)
    names = {v.name for v in variants}
    assert len(names) == len(variants)
    # spot checks: the call a rank makes at some token count maps onto an enumerated variant
    for desc in (GemmDesc(1, 3072, 1536), GemmDesc(4096, 7168, 2048), GemmDesc(333, 2112, 7168),
                 GemmDesc(4096, 512, 7168, 256, "masked", 132, expected_m=17, act_quant=1),  # w13: fused act
                 GemmDesc(128 * 37, 7168, 256, 256, "contiguous", 132)):
        name, source = kernel_variant(desc)
        assert name in names, desc
        assert next(v for v in variants if v.name == name).source == source
    by_name = {v.name: v for v in variants}
    masked = [v for v in variants if v.layout == "masked"]
    assert masked and all(v.users[0].startswith("experts.") for v in masked)
    assert all(v.rows[0] <= v.rows[1] for v in by_name.values())


def test_few_rows_variants_are_what_decode_batches_compile():
    """Decode batches run the few-rows GEMM: masked ones of up to 16 tokens (8 for DeepSeek-V3's whole experts),
    one variant per token tile and expert weight, FP32 out for the fused GEMM1, and past 16 tokens small groups'
    chunked variant; normal ones of up to 8 rows at K >= 4096 (16 at K >= 7168 in one wave of items), the shared
    experts' of up to 16 rows, and of up to 64 in chunks for small weights (kernels/few_rows.py)."""
    from moe_fp8.kernels import few_rows

    for tp, ep, tiles in ((8, 1, (8, 16)), (1, 8, (8,))):
        gemms = W.model_gemms(DEEPSEEK_V3, tp=tp, ep=ep)
        variants = W.enumerate_variants(gemms, max_tokens=4096, num_sms=132)
        few = {v.name: v for v in variants if v.config is None}
        i = 2048 // tp
        # past 16 tokens the TP-8 shards (small groups) take the chunked variant, one for every larger batch
        masked = {few_rows.kernel_variant(n, k, rows, out_f32)
                  for rows in (*tiles, *((17,) if tp == 8 else ())) for n, k, out_f32 in ((2 * i, 7168, True),
                                                                                       (7168, i, False))}
        normal = {few_rows.kernel_variant(g.n, g.k, 8) for g in gemms if "normal" in g.layouts and g.k >= 4096}
        normal.add(few_rows.kernel_variant(2112, 7168, 16))  # q_a + kv_a: 132 items (the others: K < 7168 or > 264)
        shared = [g for g in gemms if g.beside_few_rows]
        assert [g.name.split(".")[0] for g in shared] == ["shared_experts"] * 2
        normal |= {few_rows.kernel_variant(g.n, g.k, rows) for g in shared
                   for rows in (8, 16, *((64,) if g.n * g.k <= few_rows.SMALL_GROUP_BYTES else ()))}
        assert len(normal) >= 3 and {(v.name, v.source) for v in few.values()} == masked | normal
        for v in few.values():
            assert v.users[0].startswith("experts.") == (v.layout == "masked"), v
        assert max(v.rows[1] for v in few.values() if v.layout == "masked") == (4096 if tp == 8 else 8)
        if tp == 1:  # whole experts: 8 rows at most; shared experts of 29 and 15 MB: no chunks
            assert {W.describe_rows(v) for v in few.values() if v.layout == "masked"} == {"tokens 1..8"}
            assert {W.describe_rows(v) for v in few.values() if "shared_experts.down_proj" in v.users} \
                == {"tokens 1..8", "tokens 9..16"}  # the first one the experts' w2 variant as well
    small = W.enumerate_variants(W.model_gemms(DEEPSEEK_V3, tp=8), max_tokens=3, num_sms=132)
    assert {W.describe_rows(v) for v in small if v.config is None} == {"tokens 1..3"}
    # up to 16 tokens (no chunked variant past them): 9-16 rows in chunks of one token tile as well (the layer's hint)
    decode = {v.name for v in W.enumerate_variants(W.model_gemms(DEEPSEEK_V3, tp=8), max_tokens=16, num_sms=132)}
    for n, k, out_f32 in ((512, 7168, True), (7168, 256, False)):
        assert {few_rows.kernel_variant(n, k, 16, out_f32, hint)[0] for hint in (None, 1)} <= decode


def test_dry_run_lists_variants(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(tmp_path, DEEPSEEK_V3)
    assert cli.main(["warmup", "--model", str(model), "--tp", "8", "--max-tokens", "256", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tp 8, ep 1, up to 256 tokens, 132 SMs" in out
    assert "experts.w13                        512×7168  contiguous/masked, 256 experts" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("fp8_gemm_")]
    assert lines and all("to compile" in ln for ln in lines)
    assert not (tmp_path / "cache").exists()  # a dry run writes nothing


def test_routing_variants_are_what_select_experts_builds(tmp_path, capsys, monkeypatch):
    """DeepSeek-V3's router (sigmoid, 8 groups, correction bias): the two kernels the Hopper routing wrapper
    builds for float32 and bfloat16 logits; routers the CUDA kernel does not cover add none."""
    import torch

    from moe_fp8.kernels import routing

    got = W.routing_variants(DEEPSEEK_V3)
    want = [routing.kernel_variant(dt, torch.float32, *routing.plan(256, 8, "sigmoid", 8, 4, dt, torch.float32))
            for dt in (torch.float32, torch.bfloat16)]
    assert [(v.name, v.source) for v in got] == want
    assert [v.logits_dtype for v in got] == ["float32", "bfloat16"]
    assert W.routing_variants({**DEEPSEEK_V3, "scoring_func": "softmax"}) == []  # the Triton kernel's
    assert W.routing_variants({**DEEPSEEK_V3, "n_routed_experts": 48}) == []
    assert W.routing_variants(TINY_DENSE) == []
    no_bias = W.routing_variants({**DEEPSEEK_V3, "topk_method": "greedy"})
    assert len(no_bias) == 2 and all("nobias" in v.name for v in no_bias)
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(tmp_path, DEEPSEEK_V3)
    assert cli.main(["warmup", "--model", str(model), "--tp", "8", "--max-tokens", "64", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "+ 2 routing kernels, + 2 quantization kernels" in out
    assert f"  {got[1].name:<48} bfloat16 logits" in out


def test_router_gemm_variants_are_what_router_gemm_builds(tmp_path, capsys, monkeypatch):
    """DeepSeek-V3's router (256 x 7168): the kernel of each token tile up to MAX_TOKENS, for bf16 and float32
    weights, as router_gemm_hopper plans them; none for a dense model."""
    import torch

    from moe_fp8.kernels import router_gemm as rg

    got = W.router_gemm_variants(DEEPSEEK_V3, 132)
    want = [rg.kernel_variant(dt, *rg.plan(t, 7168, 256, dt, 132)[:3])
            for dt in (torch.bfloat16, torch.float32) for t in (1, 2, 4, 8)]
    assert [(v.name, v.source) for v in got] == want
    assert [(v.weight_dtype, v.tokens) for v in got][:2] == [("bfloat16", 1), ("bfloat16", 2)]
    assert W.router_gemm_variants(TINY_DENSE, 132) == []
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(tmp_path, DEEPSEEK_V3)
    assert cli.main(["warmup", "--model", str(model), "--tp", "8", "--max-tokens", "64", "--dry-run",
                     "--num-sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "+ 2 quantization kernels, + 2 dispatch routing kernels, + 8 router GEMM kernels" in out
    assert f"  {got[0].name:<48} bfloat16 weight, 1 tokens" in out


def test_dispatch_variants_are_what_route_pairs_builds(tmp_path, capsys, monkeypatch):
    """DeepSeek-V3's prefill dispatches: the routing kernel of int32 ids over the rank's experts (under an int32 map
    at EP), contiguous and masked; none for a dense model or past the kernel's expert count."""
    import torch

    from moe_fp8.kernels import dispatch

    tp8 = W.dispatch_variants(DEEPSEEK_V3)
    assert [(v.name, v.source) for v in tp8] == [dispatch.route_variant(torch.int32, None, m, 256)
                                                 for m in (False, True)]
    assert [v.layout for v in tp8] == ["contiguous", "masked"]
    ep8 = W.dispatch_variants(DEEPSEEK_V3, ep=8)
    assert [(v.name, v.source) for v in ep8] == [dispatch.route_variant(torch.int32, torch.int32, m, 32)
                                                 for m in (False, True)]
    assert W.dispatch_variants(TINY_DENSE) == []
    assert W.dispatch_variants({**DEEPSEEK_V3, "n_routed_experts": dispatch.ROUTE_MAX_EXPERTS + 1}) == []
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(tmp_path, DEEPSEEK_V3)
    assert cli.main(["warmup", "--model", str(model), "--ep", "8", "--max-tokens", "64", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"  {ep8[1].name:<48} masked dispatch" in out


def test_quant_variants_are_what_the_quantization_builds():
    """Every model's bf16 activations: the kernels kernels/quant.py builds (plain, and SiLU·mul for Fp8MLP), with
    UE8M0 scales for DeepSeek-V3.1."""
    import torch

    from moe_fp8.kernels import quant

    def built(ue8m0: bool) -> list[tuple[str, str]]:
        return [quant.kernel_variant(torch.bfloat16, ue8m0, *quant.launch_shape(False)[:2]),
                quant.kernel_variant(torch.bfloat16, ue8m0, *quant.launch_shape(True)[:2], silu=True)]

    got = W.quant_variants(DEEPSEEK_V3)
    assert [(v.name, v.source) for v in got] == built(False) and {v.scales for v in got} == {"float32"}
    v31 = {**DEEPSEEK_V3, "quantization_config": {**DEEPSEEK_V3["quantization_config"], "scale_fmt": "ue8m0"}}
    got = W.quant_variants(v31)
    assert [(v.name, v.source) for v in got] == built(True) and {v.scales for v in got} == {"ue8m0"}


@pytest.mark.skipif(not COMPILERS, reason="no JIT compiler")
def test_warmup_compiles_once_then_hits(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(cache))
    model = _model(tmp_path, TINY_DENSE)
    compiler = "nvrtc" if "nvrtc" in COMPILERS else COMPILERS[0]  # NVRTC: ~0.4 s a variant here
    argv = ["warmup", "--model", str(model), "--max-tokens", "8", "--jobs", "2", "--compiler", compiler]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert "3 GEMM shapes per rank → 3 kernel variants, + 2 quantization kernels" in first.out
    assert "compiled  5 in" in first.out and "0 already cached; 0 failed" in first.out
    assert "cache     " + str(cache) + ": 5 entries" in first.out
    assert "[5/5] warmup: " in first.err  # plain progress lines: stderr is not a TTY
    assert "warmup: fp8_gemm_normal_n" in first.err and "warmup: token_group_quant_silu_bf16_l8" in first.err
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    assert "compiled  0 in" in second.out and "5 already cached; 0 failed" in second.out
    assert "[5/5] warmup: 5 already cached" in second.err
    journal = (cache / "compile-journal.log").read_text().splitlines()
    assert len(journal) == 5  # the second run compiled nothing


def test_compile_failure_names_the_log(tmp_path, capsys, monkeypatch):
    if not COMPILERS:
        pytest.skip("no JIT compiler")
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MOE_FP8_JIT_COMPILER", "nvrtc" if "nvrtc" in COMPILERS else COMPILERS[0])
    model = _model(tmp_path, TINY_DENSE)
    real = W.enumerate_variants

    def broken(*args, **kwargs):
        v = real(*args, **kwargs)[0]
        v.source = v.source.replace("moe_fp8::fp8_gemm_kernel<", "moe_fp8::no_such_kernel<")
        return [v]
    monkeypatch.setattr(W, "enumerate_variants", broken)
    assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8", "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "moe-fp8 warmup: error: 1 of 3 variants failed to compile" in err  # (the quantization kernels compiled)
    assert "JitCompileError:" in err and str(tmp_path / "cache" / "failed") in err


def test_missing_model_and_compiler_and_cache_are_one_line_errors(tmp_path, capsys, monkeypatch):
    assert cli.main(["warmup", "--model", str(tmp_path / "nope")]) == 1
    assert "moe-fp8 warmup: error: " in capsys.readouterr().err

    model = _model(tmp_path, TINY_DENSE)
    monkeypatch.delenv("MOE_FP8_JIT_COMPILER", raising=False)  # no compiler asked for: both are tried
    monkeypatch.setattr(compiler_mod, "_instances", {})
    monkeypatch.setattr(compiler_mod, "_find_nvcc", lambda: (None, "nvcc not found (test)"))
    monkeypatch.setattr(compiler_mod, "_nvrtc_info", lambda: compiler_mod.CompilerInfo(
        "nvrtc", "", "", False, "libnvrtc not loadable (test)"))
    assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA compiler usable: nvcc not found (test); libnvrtc not loadable (test)" in err
    assert "fix: pip install nvidia-cuda-nvrtc" in err and "Traceback" not in err


@pytest.mark.skipif(not COMPILERS, reason="no JIT compiler")
def test_unwritable_cache_is_one_line_error(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # a path under a regular file cannot be created, even by root (chmod would not stop root)
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(blocker / "cache"))
    model = _model(tmp_path, TINY_DENSE)
    assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8"]) == 1
    err = capsys.readouterr().err
    assert f"JIT cache directory {blocker / 'cache'} is not writable" in err
    assert "set MOE_FP8_CACHE_DIR to a writable directory" in err and "Traceback" not in err


def test_fp8_lm_head_is_detected_from_the_index(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(tmp_path, TINY_DENSE)
    assert not W.fp8_lm_head_in_checkpoint(model)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "lm_head.weight": "model.safetensors", "lm_head.weight_scale_inv": "model.safetensors"}}))
    assert W.fp8_lm_head_in_checkpoint(model)
    assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8", "--dry-run"]) == 0
    assert "  lm_head                            256×128  normal" in capsys.readouterr().out


@pytest.mark.parametrize("env,value,message", [
    ("MOE_FP8_NUM_SMS", "0", "MOE_FP8_NUM_SMS=0 must be >= 1"),
    ("MOE_FP8_NUM_SMS", "-4", "MOE_FP8_NUM_SMS=-4 must be >= 1"),
    ("MOE_FP8_NUM_SMS", "abc", "MOE_FP8_NUM_SMS='abc' is not an integer"),
    ("MOE_FP8_JIT_COMPILER", "nvrt", "unknown JIT compiler 'nvrt' (from MOE_FP8_JIT_COMPILER)"),
])
def test_bad_environment_values_are_one_line_errors(tmp_path, capsys, monkeypatch, env, value, message):
    import torch

    from moe_fp8 import utils

    # the SM count comes from the environment only without a GPU and without set_num_sms
    monkeypatch.setattr(utils, "_num_sms", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MOE_FP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(env, value)
    model = _model(tmp_path, TINY_DENSE)
    assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8", "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("moe-fp8 warmup: error: ") and "Traceback" not in err
    assert message in err and out == ""
    if env == "MOE_FP8_NUM_SMS":  # the library refuses it too, naming the variable
        with pytest.raises(ValueError, match="MOE_FP8_NUM_SMS"):
            utils.get_num_sms()
        # --num-sms overrides the environment
        assert cli.main(["warmup", "--model", str(model), "--max-tokens", "8", "--dry-run", "--num-sms", "8"]) == 0
        assert ", 8 SMs, " in capsys.readouterr().out
