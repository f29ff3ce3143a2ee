"""The GEMM kernel sources compile on any machine (no GPU needed) to sm_90a code that uses the
FP8 tensor-core path (SASS QGMMA), without local-memory spills or wgmmas that ptxas serialises, under
both compilers; the generated wgmma header is what its generator writes; host and device agree on
shared memory. Also the routing kernel's launch of its dependents, per variant."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from moe_fp8.kernels.gemm import generate_source
from moe_fp8.kernels.heuristics import WAVE_BLOCK_NS, GemmDesc, get_config, make_config, smem_bytes
from moe_fp8.kernels.jit.cache import include_dir
from moe_fp8.kernels.jit.compiler import JitCompileError, find_compilers, get_compiler
from moe_fp8.kernels.tools import gen_wgmma

COMPILERS = [c.name for c in find_compilers() if c.available]


def assert_wgmma_pipelined(log: str) -> None:
    """ptxas reports it (C7511, C7514, C7515, ...) when it serialises wgmmas it cannot prove safe to overlap:
    it then waits for each one to finish (a 64x32 tile ran 25-30% slower so, session 24)."""
    serialized = [line for line in log.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serialized, serialized


VARIANTS = [
    ("normal", 7168, 16384, make_config(128, 128, 132, k=16384)),
    ("normal", 2112, 576, make_config(64, 136, 132, k=576)),  # ragged N and K, straddling scale blocks
    # two accumulator sets in unrolled chunks: one of 5 K blocks; 16 chunks of 8; 7 of 8 and 2 blocks more
    ("normal", 2112, 576, make_config(64, 48, 132, k=576)),
    ("normal", 7168, 16384, make_config(64, 32, 132, k=16384)),
    ("contiguous", 4096, 7424, make_config(64, 96, 132, k=7424)),
    ("contiguous", 4096, 7168, make_config(128, 160, 132, k=7168)),
    ("masked", 7168, 2048, make_config(64, 16, 132, k=2048)),
    ("normal", 24576, 1536, get_config(GemmDesc(4096, 24576, 1536))),
    ("normal", 7168, 2048, make_config(128, 128, 132, k=2048, multicast=2)),
    ("normal", 2112, 7168, make_config(64, 24, 132, k=7168, multicast=2, multicast_on_a=True)),
    ("normal", 4096, 7168, make_config(64, 128, 132, k=7168, split_k=4)),
    ("normal", 7168, 2048, make_config(128, 256, 132, k=2048, split_k=2)),
    # two-wave tiles with the tail split (the default there) on each layout, and one without; K pieces
    # (masked, K >= 24 blocks)
    ("masked", 7168, 2048, make_config(128, 256, 132, k=2048)),
    ("masked", 7168, 2048, make_config(128, 192, 132, k=2048)),
    ("masked", 4096, 7168, make_config(128, 256, 132, k=7168)),  # with the K pieces compiled in
    ("normal", 2112, 7168, make_config(64, 192, 132, k=7168)),
    ("contiguous", 4096, 7168, make_config(64, 256, 132, k=7168)),
    ("normal", 4096, 7168, make_config(128, 256, 132, k=7168, tail_split=False)),
    # A as 32-row boxes, only those holding a group's rows
    ("contiguous", 7168, 2048, make_config(128, 128, 132, k=2048, a_box_rows=32)),
    ("masked", 7168, 2048, make_config(64, 128, 132, k=2048, a_box_rows=32)),
]


def test_generated_wgmma_header_is_current() -> None:
    assert gen_wgmma.HEADER.read_text() == gen_wgmma.render(), (
        "run `python -m moe_fp8.kernels.tools.gen_wgmma` and commit the header")


def test_a_compiler_is_available() -> None:
    assert COMPILERS, f"no JIT compiler usable: {[(c.name, c.reason) for c in find_compilers()]}"


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("layout,n,k,cfg", VARIANTS, ids=lambda v: getattr(v, "block_n", v))
def test_variant_compiles_to_qgmma(compiler, layout, n, k, cfg, tmp_path) -> None:
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    res = get_compiler(compiler).compile_ex(generate_source(layout, n, k, cfg), "t", [include_dir()], tmp_path)
    sass = dump_sass(res.cubin)
    qgmma = re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", sass)
    wave_n = cfg.block_n // 2 if cfg.block_n in WAVE_BLOCK_NS else cfg.block_n  # two-wave tiles: per wave
    assert qgmma and {int(v) for v in qgmma} == {wave_n}, set(qgmma)
    assert len(qgmma) % 4 == 0, "one 128-K block = four K=32 wgmmas (the compiler may duplicate the loop)"
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, "local memory"
    assert count_instructions(sass, "UTMAPF") > 0, "the weights' L2 warm-up (a launch option)"
    # bulk-copied tile stores (a launch option; a split-K CTA runs one tile, which it stores directly)
    assert (count_instructions(sass, "UBLKCP") > 0) == (cfg.split_k == 1)
    for fn in res.ptxas.values():
        assert fn.get("spill_stores", 0) == 0 and fn.get("spill_loads", 0) == 0, res.ptxas
    assert_wgmma_pipelined(res.log)


@pytest.mark.parametrize("layout,act_quant", [("contiguous", 1), ("masked", 2)])
def test_silu_mul_quant_variant_compiles(layout, act_quant, tmp_path) -> None:
    """The fused SiLU·mul + quant epilogue: 64-column FP8 wgmmas of the two waves, no local memory; masked
    with the K pieces of a short last wave compiled in (the heuristic's default there)."""
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    compiler = get_compiler(COMPILERS[-1])
    for block_m in (64, 128):
        cfg = make_config(block_m, 256, 132, k=7168, k_split=layout == "masked")
        assert "kTailHalves=*/false" in generate_source(layout, 4096, 7168, cfg, act_quant) or layout != "masked"
        res = compiler.compile_ex(generate_source(layout, 4096, 7168, cfg, act_quant), "t", [include_dir()],
                                  tmp_path / str(block_m))
        sass = dump_sass(res.cubin)
        assert set(re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3", sass)) == {"128"}
        assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, "local memory"
        for fn in res.ptxas.values():
            assert fn.get("spill_stores", 0) == 0 and fn.get("stack", 0) == 0, (block_m, res.ptxas)
        assert_wgmma_pipelined(res.log)
    with pytest.raises(ValueError, match="256-wide tiles"):
        generate_source(layout, 4096, 7168, make_config(128, 128, 132, k=7168), act_quant)


def test_host_smem_size_matches_kernel_layout(tmp_path) -> None:
    """The kernel static_asserts kSmemBytes >= its own layout size: the host formula passes, and
    16 bytes less fails — so both sides compute the same layout."""
    compiler = get_compiler(COMPILERS[0])
    cfg = make_config(128, 112, 132, k=2048)
    compiler.compile(generate_source("normal", 7168, 2048, cfg), "ok", [include_dir()], tmp_path / "ok")
    short = dataclasses.replace(cfg, smem_bytes=smem_bytes(128, 112, cfg.num_stages, 2048) - 16)
    with pytest.raises(JitCompileError, match="shared-memory size disagrees"):
        compiler.compile(generate_source("normal", 7168, 2048, short), "short", [include_dir()], tmp_path / "bad")


@pytest.mark.parametrize("block_m", [64, 128])
def test_every_block_shape_is_spill_free(block_m, tmp_path) -> None:
    """Register pressure differs per BLOCK_N (one or two accumulator sets): no candidate may spill, nor have
    its wgmmas serialised."""
    from moe_fp8.kernels.heuristics import BLOCK_NS, straddle_ok

    compiler = get_compiler(COMPILERS[-1])  # NVRTC when present: the faster of the two
    for bn in (bn for bn in BLOCK_NS if straddle_ok(bn)):
        cfg = make_config(block_m, bn, 132, k=2048)
        res = compiler.compile_ex(generate_source("normal", 7168, 2048, cfg), f"b{bn}", [include_dir()],
                                  tmp_path / str(bn))
        for fn in res.ptxas.values():
            assert fn.get("spill_stores", 0) == 0 and fn.get("stack", 0) == 0, (block_m, bn, res.ptxas)
        assert_wgmma_pipelined(res.log)


# the few-rows GEMM (impls/fp8_gemm_few_rows.cuh): one and two token tiles, each K split, bf16 and FP32 out,
# ragged N and K
FEW_ROWS_VARIANTS = [(4096, 7168, 8, False), (7168, 2048, 16, False), (512, 7168, 3, True), (7168, 256, 1, False),
                     (1032, 1040, 16, True), (512, 7168, 64, True), (7168, 256, 40, False)]


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("n,k,max_m,out_f32", FEW_ROWS_VARIANTS)
def test_few_rows_variant_compiles(compiler, n, k, max_m, out_f32, tmp_path) -> None:
    """mma.sync on e4m3, which sm_90 runs as FP16 HMMAs after converting the codes (exactly: every e4m3
    value is an FP16 one); no local memory at two CTAs an SM."""
    from moe_fp8.kernels import few_rows
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    name, source = few_rows.kernel_variant(n, k, max_m, out_f32)
    res = get_compiler(compiler).compile_ex(source, name, [include_dir()], tmp_path)
    sass = dump_sass(res.cubin)
    assert count_instructions(sass, "HMMA.16816.F32") > 0 and count_instructions(sass, "QGMMA") == 0
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, "local memory"
    (fn,) = res.ptxas.values()
    assert fn.get("spill_stores", 0) == 0 and fn.get("stack", 0) == 0 and fn["registers"] <= 128, fn


def test_few_rows_host_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_fp8.kernels import few_rows
    from moe_fp8.utils import ceil_div

    # K split into pieces of 4 K blocks or more, at most 8 (the warps of a CTA)
    assert [few_rows.split_k(k) for k in (128, 512, 1024, 2048, 4096, 7168, 16384)] == [1, 1, 2, 4, 8, 8, 8]
    # up to 16 rows a group where its weights are small (TP-8 shards, Qwen3-MoE's), 8 for DeepSeek-V3's experts
    assert few_rows.applies(16, 512, 7168, 256) and few_rows.applies(16, 3072, 4096, 16)
    assert few_rows.applies(8, 4096, 7168, 32) and few_rows.applies(8, 7168, 2048, 32) and few_rows.applies(1, 8, 16, 1024)
    assert not few_rows.applies(9, 4096, 7168, 32) and not few_rows.applies(9, 7168, 2048, 32)
    assert not few_rows.applies(17, 512, 7168, 32) and not few_rows.applies(0, 512, 7168, 32)
    assert not few_rows.applies(8, 4100, 7168, 32) and not few_rows.applies(8, 4096, 7160, 32)
    assert not few_rows.applies(8, 4096, 7168, 1025)
    # normal GEMMs: up to 8 rows at K >= 4096, up to 16 at K >= 7168 where the 16-row tiles fit one wave (2 CTAs an SM)
    assert few_rows.applies_normal(8, 2112, 7168) and few_rows.applies_normal(1, 7168, 4096)
    assert few_rows.applies_normal(9, 2112, 7168, num_sms=132) and few_rows.applies_normal(16, 4096, 7168, num_sms=132)
    assert not few_rows.applies_normal(16, 4608, 7168, num_sms=132)  # 288 items
    assert few_rows.applies_normal(16, 4608, 7168, num_sms=144) and not few_rows.applies_normal(17, 2112, 7168)
    assert not few_rows.applies_normal(9, 2304, 4096) and not few_rows.applies_normal(8, 4096, 2048)
    assert not few_rows.applies_normal(0, 2112, 7168)
    # next to few-rows GEMMs (the shared experts): up to 16 rows at any K, up to 64 for weights of at most 13 MB
    with few_rows.beside_few_rows():
        assert few_rows.applies_normal(16, 7168, 2048) and few_rows.applies_normal(33, 7168, 256)
        assert few_rows.applies_normal(64, 512, 7168) and not few_rows.applies_normal(65, 512, 7168)
        assert not few_rows.applies_normal(17, 4096, 7168) and not few_rows.applies_normal(8, 4100, 7168)
        assert not few_rows.applies_normal(16, 7168, 2048, beside=False)
    assert not few_rows.applies_normal(16, 7168, 2048) and few_rows.applies_normal(16, 7168, 2048, beside=True)
    name, source = few_rows.kernel_variant(4096, 7168, 9, out_f32=True)
    assert name == "fp8_gemm_few_rows_n4096_k7168_t2_s8_f32" and "/*kTokenTiles=*/2" in source
    # any max_m for small groups expected to hold few rows (chunks of 8 * CHUNK_TOKEN_TILES), never for large ones
    few = few_rows.CHUNKED_MAX_EXPECTED
    assert few >= 1 and few_rows.applies(2048, 7168, 256, 32, few) and few_rows.applies(64, 512, 7168, 256, 1)
    assert not few_rows.applies(64, 7168, 256, 256, few + 1) and not few_rows.applies(64, 7168, 256, 256)
    assert not few_rows.applies(64, 4096, 7168, 32, 1) and not few_rows.applies(64, 7168, 2048, 32, 1)
    assert not few_rows.applies(64, 7168, 256, 1025, 1)
    # the fused gate-up GEMM in chunks only where the wgmma kernel's 256-wide tiles over the groups expected to be
    # touched (1 - exp(-expected_m) of them) fill at most CHUNKED_FUSED_MAX_WAVES waves; within max_rows always
    waves = few_rows.fused_waves(3072, 32, 4, 132)
    assert abs(waves - 32 * (1 - math.exp(-4)) * 12 / 132) < 1e-12 and waves > few_rows.CHUNKED_FUSED_MAX_WAVES
    assert few_rows.applies(64, 1536, 2048, 16, few, fused=True, num_sms=132)  # Qwen3-30B-A3B EP 8: 0.7 waves
    assert few_rows.applies(64, 3072, 3072, 32, 2, fused=True, num_sms=132)  # MiniMax-M2 EP 8, 2.5
    assert not few_rows.applies(128, 3072, 3072, 32, 4, fused=True, num_sms=132)  # 2.9
    assert few_rows.applies(128, 3072, 3072, 32, 4)  # (the same call unfused)
    assert not few_rows.applies(64, 512, 7168, 256, 2, fused=True, num_sms=132)  # DeepSeek-V3 TP 8, 3.4
    assert few_rows.applies(64, 512, 7168, 256, 2, fused=True, num_sms=264)  # (on twice the SMs, 1.7)
    assert few_rows.applies(16, 512, 7168, 256, 4, fused=True, num_sms=132)  # max_rows
    # never where the fused GEMM's FP32 h would pass FUSED_H_MAX_BYTES (an engine's batched layout: max_m its capacity)
    assert few_rows.applies(768, 512, 7168, 256, 1) and not few_rows.applies(768, 512, 7168, 256, 1, fused=True)
    assert 256 * 128 * 512 * 4 <= few_rows.FUSED_H_MAX_BYTES < 256 * 768 * 512 * 4
    monkeypatch.setattr(few_rows, "CHUNKED_FUSED_MAX_WAVES", None)  # as unfused
    assert few_rows.applies(128, 3072, 3072, 32, 4, fused=True, num_sms=132)
    assert few_rows.token_tiles(16) == 2 and few_rows.token_tiles(17) == few_rows.CHUNK_TOKEN_TILES
    # 9-16 rows expected to hold one a group: chunks of one token tile (two for a group of more)
    assert few_rows.token_tiles(16, 1) == few_rows.token_tiles(9, 1) == 1 and few_rows.token_tiles(8, 1) == 1
    assert few_rows.token_tiles(16, 2) == 2 and few_rows.token_tiles(16, 0) == 2
    assert few_rows.items(512, 7168, 32, 16, 1) == 2 * few_rows.items(512, 7168, 32, 16)
    assert few_rows.kernel_variant(7168, 256, 12, expected_m=1)[0] == "fp8_gemm_few_rows_n7168_k256_t1_s1_c"
    name, source = few_rows.kernel_variant(7168, 256, 64)
    assert name.endswith("_c") and "/*kChunked=*/true" in source
    assert "/*kChunked=*/false" in few_rows.kernel_variant(7168, 256, 16)[1]
    assert few_rows.items(512, 7168, 4, 64) == 4 * ceil_div(64, 8 * few_rows.CHUNK_TOKEN_TILES) * 32


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("v,lpg,topk_group,early", [(8, 4, 4, True), (8, 0, 1, True), (12, 0, 1, False),
                                                    (12, 4, 4, False), (16, 0, 1, False)])
def test_routing_dependents_launch(compiler, v, lpg, topk_group, early, tmp_path) -> None:
    """The routing kernel lets the dispatch after it launch at its start (`griddepcontrol.launch_dependents`,
    SASS `PREEXIT`) only in its variants of V <= 8; after the others (Kimi-K2's 384 experts: V = 12) an early
    launch delayed the dispatch by ~6 us (impls/routing.cuh: kEarlyDependents). No local memory either way."""
    import torch

    from moe_fp8.kernels import routing
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    name, source = routing.kernel_variant(torch.float32, torch.float32, v, lpg, 8, topk_group)
    res = get_compiler(compiler).compile_ex(source, name, [include_dir()], tmp_path)
    sass = dump_sass(res.cubin)
    assert (count_instructions(sass, "PREEXIT") > 0) == early
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, "local memory"
