"""Kernel configuration heuristics (pure host code: runs on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8.kernels.gemm import generate_source, variant_name
from moe_fp8.kernels.heuristics import (
    BLOCK_MS,
    BLOCK_NS,
    MAX_SMEM_BYTES,
    STRADDLE_128_BLOCK_NS,
    TWO_WG_STAGES,
    WAVE_BLOCK_NS,
    GemmConfig,
    GemmDesc,
    estimate_ns,
    get_config,
    make_config,
    max_stages,
    num_tiles,
    smem_bytes,
    straddle_ok,
)
from moe_fp8.utils import get_align_m


def _valid(cfg, k: int, one_wave: bool = False) -> None:
    """``one_wave``: a normal GEMM whose tiles fit in one wave (every stage that fits, as with 64-row tiles)."""
    assert cfg.block_m in BLOCK_MS
    assert cfg.block_n in BLOCK_NS
    assert straddle_ok(cfg.block_n)
    full = max_stages(cfg.block_m, cfg.block_n, k)
    assert 2 <= cfg.num_stages == (min(TWO_WG_STAGES, full) if cfg.block_m == 128 and not one_wave else full)
    assert cfg.smem_bytes == smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, k) <= MAX_SMEM_BYTES
    assert cfg.num_threads == cfg.block_m // 64 * 128 + 128


def test_k_split_where_it_applies() -> None:
    """The K-split last wave: a launch option of tail-split kernels (refused elsewhere), which the heuristic
    turns on for masked two-wave tiles at K of two 12-block pieces (the fused epilogue included: its only
    split), never at K = 2048 (8-block pieces lost to halves), with 9+ groups of 128-row tiles (not counted)
    or on other layouts; 64-row tiles of any group count (the decode tiles) split too."""
    assert make_config(128, 256, 132, k=7168, k_split=True).k_split
    with pytest.raises(ValueError, match="needs tail_split"):
        make_config(128, 256, 132, k=7168, k_split=True, tail_split=False)
    with pytest.raises(ValueError, match="192 / 256-wide tiles"):
        make_config(128, 128, 132, k=7168, k_split=True)

    def cfg(**kw) -> GemmConfig:
        return get_config(GemmDesc(**{"m": 4096, "n": 4096, "k": 7168, "num_groups": 2, "layout": "masked",
                                      "expected_m": 512, **kw}))
    assert cfg().k_split and cfg().block_n in WAVE_BLOCK_NS
    assert cfg(k=3072).k_split == (cfg(k=3072).block_n in WAVE_BLOCK_NS)
    assert not cfg(k=2048).k_split
    assert not cfg(num_groups=9).k_split and cfg(num_groups=9).block_m == 128
    assert cfg(act_quant=1).k_split
    decode = cfg(num_groups=32, m=256, expected_m=1, act_quant=1)
    assert decode.k_split and decode.block_m == 64
    assert cfg(num_groups=32, m=256, expected_m=64).k_split == (cfg(num_groups=32, m=256, expected_m=64).block_n
                                                                in WAVE_BLOCK_NS)
    assert not get_config(GemmDesc(4096, 4096, 7168)).k_split
    assert not get_config(GemmDesc(8192, 4096, 7168, num_groups=8, layout="contiguous")).k_split
    for layout in ("normal", "contiguous"):
        with pytest.raises(ValueError, match="only compiled into the masked layout"):
            generate_source(layout, 4096, 7168, make_config(128, 256, 132, k=7168, k_split=True))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 4096).map(lambda v: v * 8), k=st.integers(1, 1024).map(lambda v: v * 16),
       layout=st.sampled_from(["normal", "contiguous", "masked"]), groups=st.integers(1, 256),
       num_sms=st.sampled_from([132, 114, 78, 20]))
def test_every_config_is_valid(m, n, k, layout, groups, num_sms) -> None:
    desc = GemmDesc(m, n, k, num_groups=groups if layout != "normal" else 1, layout=layout, num_sms=num_sms,
                    expected_m=max(1, m // 3) if layout == "masked" else None)
    cfg = get_config(desc)
    _valid(cfg, k, layout == "normal" and num_tiles(desc, cfg.block_m, cfg.block_n, cfg.multicast) <= num_sms)
    if layout == "contiguous":
        assert get_align_m() % cfg.block_m == 0, "a tile must not straddle two expert segments"
    if layout != "normal":
        assert cfg.multicast == 1, "multicast pairs could span two experts"
    assert cfg.multicast == 1, "multicast measured no gain: never chosen"
    if cfg.block_m == 128:  # two math warpgroups straddle scale blocks only at measured widths, normal layout
        assert (128 % cfg.block_n == 0 or cfg.block_n in WAVE_BLOCK_NS
                or (layout == "normal" and cfg.block_n in STRADDLE_128_BLOCK_NS))


def _pick(m: int, n: int, k: int, **kw) -> tuple[int, int, int]:
    cfg = get_config(GemmDesc(m, n, k, **kw))
    return cfg.block_m, cfg.block_n, cfg.num_stages


def test_straddling_128_row_tiles_where_they_fit_the_waves() -> None:
    """Normal GEMMs take 128x144 / 128x160 tiles where their count fits the waves better than 128x192's (session 45
    sweep, heuristics.STRADDLE_128_BLOCK_NS); grouped layouts and the bench's 4096-row shapes keep their tiles."""
    assert _pick(1280, 4096, 7168) == (128, 160, TWO_WG_STAGES)  # 260 tiles in two waves (128x192: 220)
    assert _pick(640, 4096, 7168) == (128, 160, max_stages(128, 160, 7168))  # 130 tiles: one wave, every stage
    assert _pick(1536, 1536, 7168)[:2] == (128, 144)  # 132 tiles (128x192: 96)
    assert _pick(1280, 4096, 7168, num_groups=2, layout="contiguous")[1] not in STRADDLE_128_BLOCK_NS
    assert _pick(4096, 4096, 7168, num_groups=2, layout="masked", expected_m=640)[1] not in STRADDLE_128_BLOCK_NS
    for n, k in ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)):
        assert _pick(4096, n, k)[1] not in STRADDLE_128_BLOCK_NS


def test_narrow_tiles_where_they_fit_one_wave() -> None:
    """GEMMs whose narrower tiles still fit one wave take them (session 47 sweep and A/B, heuristics
    OVERLAP_STRADDLE_NS and STRADDLE_128_BLOCK_NS[96]): 64-row tiles of at most 96 columns hide their scale
    select behind the overlapped wgmmas (normal and contiguous layouts), and 128x96 walks a block faster than
    128x128 over a long K (normal layout only)."""
    assert _pick(384, 1536, 7168)[:2] == (64, 72)  # 132 tiles (64x128: 72)
    assert _pick(512, 1536, 7168)[:2] == (64, 96)  # 128 tiles (64x72: 176, two waves)
    assert _pick(1280, 576, 7168)[:2] == (64, 96)  # 120 tiles (128x64: 90)
    assert _pick(768, 2112, 7168) == (128, 96, max_stages(128, 96, 7168))  # 132 tiles, every stage (128x128: 102)
    assert _pick(2048, 576, 7168)[:2] == (128, 96)  # 96 tiles (128x128: 80)
    assert _pick(1536, 1536, 7168)[:2] == (128, 144)  # two waves of 128x96: 128x144's one stays
    assert _pick(768, 1536, 1024)[:2] == (128, 128)  # 128x96 from STRADDLE_128_MIN_K_BLOCKS only
    assert _pick(768, 768, 5120)[:2] == (64, 72)  # the 64-row rule holds at any K
    assert _pick(384, 1536, 7168, num_groups=3, layout="contiguous")[:2] == (64, 72)  # measured 9% faster
    assert _pick(768, 2112, 7168, num_groups=2, layout="contiguous")[1] == 128  # 128x96: normal layout only
    assert _pick(12 * 768, 2112, 7168, num_groups=12, layout="masked", expected_m=640)[1] != 96


def test_masked_gemms_weigh_128x192_math_at_their_own_factor() -> None:
    """Normal and contiguous GEMMs charge 128x192's math MMA_192_FACTOR (session 47 A/B), masked ones
    MMA_192_FACTOR_MASKED (session 12): the same rows move to 128x256 only outside the masked layout."""
    assert _pick(2560, 7168, 16384)[1] == 256  # 128x192, the pick at 1.10, ran 8% slower
    assert _pick(4608, 4096, 7168)[1] == 256  # 9% slower
    assert _pick(8192, 2112, 7168)[1] == 256
    assert _pick(4 * 1152, 4096, 7168, num_groups=4, layout="contiguous")[1] == 256  # 10% slower
    assert _pick(8 * 4096, 2112, 7168, num_groups=8, layout="masked", expected_m=1024)[1] == 192


def test_one_wave_normal_gemms_take_every_stage() -> None:
    """128-row tiles run TWO_WG_STAGES stages, but a normal GEMM's single wave takes all that fit (measured
    faster, heuristics.TWO_WG_STAGES); three tiles a CTA, or grouped layouts, keep TWO_WG_STAGES."""
    one_wave = get_config(GemmDesc(512, 4096, 7168))
    assert (one_wave.block_m, one_wave.block_n, one_wave.num_stages) == (128, 128, max_stages(128, 128, 7168)) == (
        128, 128, 5)
    narrow = get_config(GemmDesc(512, 2112, 7168))  # 128x64: 8 stages
    assert narrow.block_m == 128 and narrow.num_stages == max_stages(128, narrow.block_n, 7168) > TWO_WG_STAGES
    three = get_config(GemmDesc(805, 7168, 2048))  # 392 tiles of 128x128
    assert (three.block_m, three.block_n, three.num_stages) == (128, 128, TWO_WG_STAGES)
    contiguous = get_config(GemmDesc(512, 4096, 7168, layout="contiguous"))
    assert contiguous.block_m == 128 and contiguous.num_stages <= TWO_WG_STAGES


def test_tail_split_only_on_two_wave_single_cta_tiles() -> None:
    """make_config turns the tail split on where it applies (192 / 256-wide tiles of one CTA) and refuses
    it elsewhere."""
    for bn in (192, 256):
        assert make_config(128, bn, 132, k=2048).tail_split
        assert make_config(64, bn, 132, k=2048).tail_split
        assert not make_config(128, bn, 132, k=2048, tail_split=False).tail_split
    assert not make_config(128, 128, 132, k=2048).tail_split
    for kw in ({"block_n": 128}, {"block_n": 160}, {"block_n": 192, "multicast": 2}, {"block_n": 256, "multicast": 2},
               {"block_n": 256, "split_k": 2}):
        with pytest.raises(ValueError, match="tail halves need 192 / 256-wide tiles of single CTAs"):
            make_config(128, k=2048, num_sms=132, tail_split=True, **kw)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20000), i=st.integers(1, 32).map(lambda v: v * 128), k=st.integers(1, 512).map(lambda v: v * 16),
       layout=st.sampled_from(["normal", "contiguous", "masked"]), groups=st.integers(1, 64), ue8m0=st.booleans())
def test_chosen_and_fused_act_configs_are_valid(m, i, k, layout, groups, ue8m0) -> None:
    """The heuristic never splits K; the fused SiLU·mul + quant epilogue (w13 of 2I rows) always runs on
    256-wide tiles without a cluster; both generate a source."""
    from moe_fp8.kernels.gemm import generate_source

    desc = GemmDesc(m, 2 * i, k, num_groups=groups if layout != "normal" else 1, layout=layout,
                    expected_m=max(1, m // 3) if layout == "masked" else None)
    cfg = get_config(desc)
    assert cfg.split_k == 1, "split-K measured no gain: never chosen"
    assert cfg.tail_split == (cfg.block_n in WAVE_BLOCK_NS), "two-wave tiles split their last wave, no other can"
    generate_source(layout, desc.n, k, cfg)
    if layout != "normal":
        act = dataclasses.replace(desc, act_quant=2 if ue8m0 else 1)
        fused = get_config(act)
        assert fused.block_n == 256 and fused.split_k == 1 and fused.multicast == 1
        assert "/*kActQuant=*/" + str(act.act_quant) in generate_source(layout, desc.n, k, fused, act.act_quant)


def test_straddle_rule() -> None:
    # a tile touches at most two 128-column weight-scale blocks
    for bn in range(8, 257, 8):
        worst = max((b * bn) % 128 for b in range(128)) + bn
        assert straddle_ok(bn) == (worst <= 256), bn


def _tile(cfg: GemmConfig) -> GemmConfig:
    """The tile choice of a config, apart from how A is loaded (``_with_partial_a``, tested on its own)."""
    return dataclasses.replace(cfg, a_box_rows=0)


def test_small_m_uses_one_math_warpgroup() -> None:
    for n, k in [(7168, 2048), (2112, 7168)]:
        assert get_config(GemmDesc(64, n, k)).block_m == 64


def test_measured_small_m_tiles_apply_only_where_measured() -> None:
    """SMALL_M_BLOCK_N decides normal GEMMs of up to 128 rows on 132 SMs (where the model picks another
    tile); other layouts, machines and row counts stay with the cost model."""
    from moe_fp8.kernels.heuristics import SMALL_M_BLOCK_N, candidates, config_key, modelled_config

    for (n, k), by_blocks in SMALL_M_BLOCK_N.items():
        for m_blocks, block_n in by_blocks.items():
            for m in range(64 * m_blocks - 63, 64 * m_blocks + 1, 21):
                desc = GemmDesc(m, n, k)
                cfg = get_config(desc)
                assert (cfg.block_m, cfg.block_n) == (64, block_n) and (64, block_n, 1, False) in candidates(desc)
                assert _tile(cfg) != modelled_config(config_key(desc)), "an entry the model agrees with is not needed"
        for desc in (GemmDesc(129, n, k), GemmDesc(64, n, k, num_sms=114),
                     GemmDesc(64, n, k, num_groups=2, layout="masked", expected_m=64)):
            assert _tile(get_config(desc)) == modelled_config(config_key(desc)), desc


def test_measured_masked_tiles_apply_only_where_measured() -> None:
    """MASKED_MEASURED_TILES decides masked GEMMs of up to 4 groups of 256-1024 expected rows on 132 SMs at
    the listed N x K (where the model picks another tile); more groups, fewer or more rows, other machines,
    the fused epilogue and other layouts stay with the cost model."""
    from moe_fp8.kernels.heuristics import (
        MASKED_MEASURED_MAX_GROUPS,
        MASKED_MEASURED_ROWS,
        MASKED_MEASURED_TILES,
        config_key,
        modelled_config,
    )

    for (n, k), (block_n, stages) in MASKED_MEASURED_TILES.items():
        lo, hi = MASKED_MEASURED_ROWS
        for g, m in ((1, hi), (2, 512), (MASKED_MEASURED_MAX_GROUPS, lo)):
            desc = GemmDesc(4096, n, k, num_groups=g, layout="masked", expected_m=m)
            cfg = get_config(desc)
            assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, block_n, stages), desc
            assert _tile(cfg) != modelled_config(config_key(desc)), "an entry the model agrees with is not needed"
        for desc in (GemmDesc(4096, n, k, num_groups=MASKED_MEASURED_MAX_GROUPS + 1, layout="masked", expected_m=512),
                     GemmDesc(4096, n, k, num_groups=2, layout="masked", expected_m=lo - 64),
                     GemmDesc(4096, n, k, num_groups=1, layout="masked", expected_m=hi + 64),
                     GemmDesc(4096, n, k, num_groups=2, layout="masked", expected_m=512, num_sms=114),
                     GemmDesc(4096, 2 * n, k, num_groups=2, layout="masked", expected_m=512, act_quant=1),
                     GemmDesc(1024, n, k)):
            assert _tile(get_config(desc)) == modelled_config(config_key(desc)), desc


def test_measured_decode_tiles_apply_only_where_measured() -> None:
    """MASKED_DECODE_TILES decides masked GEMMs of at least 32 groups of at most 48 expected rows on 132 SMs
    at the listed N x K (where the model picks another tile), MASKED_DECODE_WIDE_TILES those of 49-96 rows, on
    the caller's expected_m (config_key would round it up to 64 / 128); fewer groups, more rows, other
    machines, the fused epilogue and other layouts stay with the cost model."""
    from moe_fp8.kernels.heuristics import (
        MASKED_DECODE_MAX_ROWS,
        MASKED_DECODE_MIN_GROUPS,
        MASKED_DECODE_TILES,
        MASKED_DECODE_WIDE_MAX_ROWS,
        MASKED_DECODE_WIDE_TILES,
        config_key,
        modelled_config,
    )

    for (n, k), (block_n, stages) in MASKED_DECODE_TILES.items():
        for g, m in ((MASKED_DECODE_MIN_GROUPS, 4), (MASKED_DECODE_MIN_GROUPS, MASKED_DECODE_MAX_ROWS), (256, 32)):
            desc = GemmDesc(256, n, k, num_groups=g, layout="masked", expected_m=m)
            cfg = get_config(desc)
            assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (64, block_n, stages), desc
            assert _tile(cfg) != modelled_config(config_key(desc)), "an entry the model agrees with is not needed"
        wide_n, wide_stages = MASKED_DECODE_WIDE_TILES[(n, k)]
        for g, m in ((MASKED_DECODE_MIN_GROUPS, MASKED_DECODE_MAX_ROWS + 1), (128, 64),
                     (MASKED_DECODE_MIN_GROUPS, MASKED_DECODE_WIDE_MAX_ROWS)):
            desc = GemmDesc(256, n, k, num_groups=g, layout="masked", expected_m=m)
            cfg = get_config(desc)
            assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, wide_n, wide_stages), desc
            assert _tile(cfg) != modelled_config(config_key(desc)), "an entry the model agrees with is not needed"
        for desc in (GemmDesc(256, n, k, num_groups=MASKED_DECODE_MIN_GROUPS // 2, layout="masked", expected_m=8),
                     GemmDesc(256, n, k, num_groups=MASKED_DECODE_MIN_GROUPS // 2, layout="masked", expected_m=64),
                     GemmDesc(256, n, k, num_groups=32, layout="masked", expected_m=MASKED_DECODE_WIDE_MAX_ROWS + 1),
                     GemmDesc(256, n, k, num_groups=32, layout="masked", expected_m=8, num_sms=114),
                     GemmDesc(256, 2 * n, k, num_groups=32, layout="masked", expected_m=8, act_quant=1),
                     GemmDesc(256, n, k, num_groups=32, layout="contiguous")):
            assert _tile(get_config(desc)) == modelled_config(config_key(desc)), desc


def test_one_block_contiguous_groups_walk_expert_by_expert() -> None:
    """A contiguous GEMM whose groups are expected to hold at most CONTIGUOUS_ONE_BLOCK_MAX_ROWS rows (the layer's
    sync-free prefill: M_total is an upper bound) walks its tile N-fastest (a swizzle band of one m-block): the
    plain tile, or the measured one of CONTIGUOUS_ONE_BLOCK_TILES (DeepSeek-V3's down projection, 128x128) on the
    machine it was measured on, where M_total holds a block a group; a longer or no hint keeps the plain choice, and
    config_key keeps only the class of the hint."""
    from moe_fp8.kernels.heuristics import (
        CONTIGUOUS_ONE_BLOCK_MAX_ROWS,
        CONTIGUOUS_ONE_BLOCK_TILES,
        PARTIAL_A_BOX_ROWS,
        PARTIAL_A_MIN_K,
        config_key,
    )

    assert (7168, 2048) in CONTIGUOUS_ONE_BLOCK_TILES
    for m in (4096, 8192, 20480):
        for n, k, act_quant in ((4096, 7168, 1), (7168, 2048, 0), (512, 7168, 2), (7168, 256, 0)):
            plain = get_config(GemmDesc(m, n, k, 32, "contiguous", act_quant=act_quant))
            assert plain.swizzle_group_m > 1
            tile = CONTIGUOUS_ONE_BLOCK_TILES.get((n, k))
            one_block = (dataclasses.replace(plain, swizzle_group_m=1) if tile is None
                         else make_config(128, tile[0], 132, k=k, num_stages=tile[1], swizzle_group_m=1))
            one_block = dataclasses.replace(one_block, a_box_rows=PARTIAL_A_BOX_ROWS if k >= PARTIAL_A_MIN_K else 0)
            for hint in (1, 16, CONTIGUOUS_ONE_BLOCK_MAX_ROWS):
                desc = GemmDesc(m, n, k, 32, "contiguous", expected_m=hint, act_quant=act_quant)
                cfg = get_config(desc)
                assert cfg == one_block, desc
                # the measured tile is for the machine it was measured on; elsewhere the model's, in the same order
                other = get_config(dataclasses.replace(desc, num_sms=114))
                assert other.swizzle_group_m == 1 and other == dataclasses.replace(
                    get_config(GemmDesc(m, n, k, 32, "contiguous", 114, act_quant=act_quant)), swizzle_group_m=1,
                    a_box_rows=one_block.a_box_rows)
                _valid(cfg, k)
                assert config_key(desc).expected_m == CONTIGUOUS_ONE_BLOCK_MAX_ROWS
            for hint in (CONTIGUOUS_ONE_BLOCK_MAX_ROWS + 1, 512):
                desc = GemmDesc(m, n, k, 32, "contiguous", expected_m=hint, act_quant=act_quant)
                assert get_config(desc) == plain, desc
                assert config_key(desc).expected_m is None
    # fewer 128-row blocks than groups (an exact layout of a few touched experts): the model's tile, walked N-fastest
    for m in (128, 1024):
        plain = get_config(GemmDesc(m, 7168, 2048, 32, "contiguous"))
        assert get_config(GemmDesc(m, 7168, 2048, 32, "contiguous", expected_m=8)) == dataclasses.replace(
            plain, swizzle_group_m=1, a_box_rows=PARTIAL_A_BOX_ROWS)
    # the hint never changes the tiles a contiguous kernel's grid is sized for
    desc = GemmDesc(8192, 7168, 2048, 32, "contiguous")
    assert num_tiles(desc, 128, 256) == num_tiles(dataclasses.replace(desc, expected_m=8), 128, 256)


def test_partial_a_loads_only_where_tiles_are_mostly_padding() -> None:
    """A as PARTIAL_A_BOX_ROWS boxes: masked 64-row tiles (decode) and the one-block contiguous class at K of
    PARTIAL_A_MIN_K or more, whatever the tile; never the normal layout, 128-row masked tiles, a contiguous GEMM
    without the hint, or short K (the m_indices reads cost short tiles more than the rows save)."""
    from moe_fp8.kernels.heuristics import PARTIAL_A_BOX_ROWS, PARTIAL_A_MIN_K

    partial = [GemmDesc(256, 7168, 2048, 32, "masked", expected_m=8), GemmDesc(64, 2112, 7168, 2, "masked"),
               GemmDesc(4096, 4096, 7168, 32, "contiguous", expected_m=16, act_quant=1),
               GemmDesc(4096, 7168, PARTIAL_A_MIN_K, 32, "contiguous", expected_m=64),
               GemmDesc(32768, 512, 7168, 256, "contiguous", expected_m=8, act_quant=1),
               GemmDesc(4096, 7168, 2048, 32, "contiguous", 114, expected_m=1)]
    whole = [GemmDesc(4096, 7168, 2048, 4, "masked", expected_m=512), GemmDesc(64, 7168, 2048),
             GemmDesc(4096, 7168, 2048, 32, "contiguous"), GemmDesc(8192, 7168, 2048, 32, "contiguous", expected_m=256),
             GemmDesc(32768, 7168, 256, 256, "contiguous", expected_m=8)]
    for desc in partial:
        cfg = get_config(desc)
        assert cfg.a_box_rows == PARTIAL_A_BOX_ROWS and cfg.block_m > PARTIAL_A_BOX_ROWS, desc
        assert "_a32" in variant_name(desc.layout, desc.n, desc.k, cfg, desc.act_quant)
    for desc in whole:
        assert get_config(desc).a_box_rows == 0, desc
    with pytest.raises(ValueError, match="A boxes"):
        generate_source("masked", 7168, 2048, make_config(128, 128, 132, k=2048, a_box_rows=32))
    with pytest.raises(ValueError, match="A boxes"):
        generate_source("normal", 7168, 2048, make_config(64, 128, 132, k=2048, a_box_rows=32))
    for bad in (24, 128, 12):
        with pytest.raises(ValueError, match="A boxes"):
            make_config(128, 128, 132, k=2048, a_box_rows=bad)


def test_large_m_fills_the_machine() -> None:
    cfg = get_config(GemmDesc(4096, 7168, 16384))
    _, tiles = estimate_ns(GemmDesc(4096, 7168, 16384), cfg.block_m, cfg.block_n, cfg.multicast,
                           cfg.multicast_on_a)
    assert cfg.block_m == 128 and tiles >= 132


def test_make_config_rejects_bad_blocks() -> None:
    with pytest.raises(ValueError, match="unsupported block"):
        make_config(96, 128, 132, k=7168)
    with pytest.raises(ValueError, match="unsupported block"):
        make_config(128, 152, 132, k=7168)  # would straddle three scale blocks
    with pytest.raises(ValueError, match="stages"):
        make_config(128, 160, 132, k=7168, num_stages=50)
    with pytest.raises(ValueError, match="split-K"):
        make_config(64, 48, 132, k=7168, split_k=4)  # 6 column chunks do not split 4 ways
    with pytest.raises(ValueError, match="split-K"):
        make_config(64, 128, 132, k=256, split_k=4)  # 2 K blocks
    with pytest.raises(ValueError, match="split-K"):
        make_config(64, 128, 132, k=7168, split_k=2, multicast=2)
    with pytest.raises(ValueError, match="split-K"):
        make_config(64, 128, 132, k=7168, split_k=3)


def test_masked_hint_changes_speed_not_validity() -> None:
    """Any expected_m gives a config; the kernel itself handles every masked_m <= max_m."""
    for expected in (1, 8, 64, 256, 4096):
        _valid(get_config(GemmDesc(4096, 4096, 7168, num_groups=4, layout="masked", expected_m=expected)), 7168)


def test_large_row_counts_share_bucketed_configs() -> None:
    """Prefill sends a new M_total nearly every batch: large problems are decided per bucket of
    m-blocks (one model evaluation per bucket), and the bucket's choice stays within 5% of the
    modelled optimum of the exact row count."""
    from moe_fp8.kernels.heuristics import _best_config, candidates, config_key

    _best_config.cache_clear()
    n, k = 4096, 7168
    keys = set()
    for m in range(60_000, 70_000, 128):
        desc = GemmDesc(m, n, k, num_groups=32, layout="contiguous")
        keys.add(config_key(desc))
        cfg = get_config(desc)
        best = min(estimate_ns(desc, *c)[0] for c in candidates(desc))
        assert estimate_ns(desc, cfg.block_m, cfg.block_n)[0] <= 1.05 * best, (m, cfg)
    assert len(keys) <= 6 and _best_config.cache_info().currsize == len(keys)
    # small problems are never bucketed (wave quantization decides them)
    small = GemmDesc(1000, 2112, 7168)
    assert config_key(small).m == 1024


def test_weights_warm_up_only_for_masked_gemms_of_few_groups() -> None:
    """The L2 warm-up before a launch reads its counts: masked GEMMs of one or two groups."""
    from moe_fp8.kernels.gemm import WARM_K_BLOCKS, WARM_MAX_GROUPS, warm_k_blocks

    assert WARM_K_BLOCKS > 0
    assert warm_k_blocks("masked", 1) == warm_k_blocks("masked", WARM_MAX_GROUPS) == WARM_K_BLOCKS
    assert warm_k_blocks("masked", WARM_MAX_GROUPS + 1) == 0  # their weights are not known before the counts
    assert warm_k_blocks("contiguous", 1) == warm_k_blocks("normal", 1) == 0


def test_async_stores_only_where_ctas_run_several_128_row_tiles() -> None:
    """Bulk-copied tile stores: only for 128-row tiles, where a launch's CTAs run ASYNC_STORE_MIN_TILES each."""
    from moe_fp8.kernels.gemm import ASYNC_STORE_MIN_TILES, async_stores

    assert ASYNC_STORE_MIN_TILES > 1
    assert async_stores(896, 132, 128)  # 4096x7168x2048 on 128x256 tiles
    assert not async_stores(392, 132, 128)  # 805 masked rows at 7168x2048 on 128x128 tiles: 3 a CTA
    assert not async_stores(160, 132, 128) and not async_stores(0, 132, 128)
    assert not async_stores(512, 132, 64)  # 128x32768x512 on 64x128 tiles: measured slower
