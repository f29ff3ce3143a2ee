"""Launch configurations of the Triton data-path kernels (pure Python: no GPU, no Triton needed)."""

from __future__ import annotations

import pytest

from moe_fp8.kernels.triton import configs as C
from moe_fp8.kernels.triton import dispatch as D


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize(("rows", "k_groups", "group_size", "groups", "masked"), [
    (1, 1, 128, 1, False), (16384, 56, 128, 1, False), (7, 3, 48, 1, False), (5, 1, 16, 1, False),
    (128, 16, 128, 256, True), (4096, 16, 128, 32, True), (0, 4, 128, 1, False), (3, 200, 128, 1, False),
])
def test_quant_config(rows, k_groups, group_size, groups, masked):
    cfg = C.quant_config(rows, k_groups, group_size, groups, masked=masked, num_sms=132)
    assert all(is_pow2(v) for v in (cfg.block_r, cfg.block_g, cfg.gs_p2, cfg.num_warps))
    assert cfg.gs_p2 >= group_size and cfg.block_g <= max(1, k_groups * 2)
    assert cfg.block_r * cfg.block_g * cfg.gs_p2 <= max(C.QUANT_TILE_ELEMS, cfg.gs_p2)
    row_blocks = -(-max(rows, 1) // cfg.block_r)
    if not masked:
        assert cfg.row_programs == row_blocks  # one row block per program: no loop
    else:  # flat valid rows of all groups: a fixed number of programs per column block
        col_blocks = -(-k_groups // cfg.block_g)
        assert 1 <= cfg.row_programs <= -(-max(rows, 1) * groups // cfg.block_r)
        assert cfg.row_programs * col_blocks <= max(C.PROGRAMS_PER_SM * 132, col_blocks)


def test_quant_config_decode_buffer_launches_a_fixed_grid():
    """[256 experts, max_m 128, I 2048]: PROGRAMS_PER_SM_MANY_GROUPS per SM and column block stride
    over the flat valid rows — neither one program per (expert, row block) nor one per expert."""
    cfg = C.quant_config(128, 16, 128, 256, masked=True, num_sms=132, silu=True)
    col_blocks = -(-16 // cfg.block_g)
    assert cfg.row_programs == C.PROGRAMS_PER_SM_MANY_GROUPS * 132 // col_blocks
    assert cfg.block_r * cfg.block_g * cfg.gs_p2 == C.QUANT_SILU_TILE_ELEMS
    assert cfg.num_warps == 4  # gate and up: 16 loads per thread
    few = C.quant_config(1024, 16, 128, 32, masked=True, num_sms=132, silu=True)
    assert few.row_programs == C.PROGRAMS_PER_SM * 132 // col_blocks


def test_quant_config_small_inputs_use_more_smaller_tiles():
    # decode: 896 one-row tiles, 8 elements per thread (gpu6: 7.3 us vs 7.7 at 2 warps)
    assert (C.quant_config(128, 56, 128, num_sms=132).block_r, C.quant_config(128, 56, 128, num_sms=132).num_warps) \
        == (1, 4)
    # prefill: one-row 1024-element tiles, 16 elements per thread (gpu6 sweep winner at 4096 rows and up)
    for rows, k_groups in [(16384, 56), (4096, 56), (16384, 16)]:
        cfg = C.quant_config(rows, k_groups, 128, num_sms=132)
        assert (cfg.block_r, cfg.block_g, cfg.num_warps) == (1, 8, 2)


def test_quant_config_wide_tiles_on_the_devices_measured():
    """``QUANT_WIDE_DEVICES`` (the H200): 32 loads a thread at prefill sizes, quant tiles of 2048 elements; the H100's
    picks, masked layouts and grids under ``QUANT_WIDE_MIN_TILES_PER_SM`` tiles an SM unchanged."""
    assert C.is_quant_wide("NVIDIA H200")
    assert not any(map(C.is_quant_wide, ("NVIDIA H100 80GB HBM3", "NVIDIA H20", "NVIDIA H200 NVL")))  # not measured
    assert not C.quant_wide("cpu", None)  # the interpreter: no device name to read
    for rows, k_groups in [(16384, 56), (4096, 56), (1024, 56), (16384, 16)]:
        cfg = C.quant_config(rows, k_groups, 128, num_sms=132, wide=True)
        assert (cfg.block_r, cfg.block_g, cfg.num_warps) == (2, 8, 2)
        assert cfg.row_programs == -(-rows // 2)
    for rows in (16384, 4096):
        cfg = C.quant_config(rows, 16, 128, num_sms=132, silu=True, wide=True)
        assert (cfg.block_r, cfg.block_g, cfg.num_warps) == (1, 8, 2)  # gate and up: 32 loads a thread
    unchanged = [((128, 56, 128), {}), ((1024, 16, 128), {"silu": True}), ((128, 16, 128, 256, True), {"silu": True}),
                 ((4096, 16, 128, 32, True), {"silu": True}), ((16384, 56, 128), {"tile_elems": 4096, "num_warps": 8})]
    for args, knobs in unchanged:
        assert C.quant_config(*args, num_sms=132, wide=True, **knobs) == C.quant_config(*args, num_sms=132, **knobs)


@pytest.mark.parametrize(("t", "e", "k", "n_group"), [(1, 256, 8, 8), (128, 256, 8, 8), (16384, 256, 8, 8),
                                                      (5, 12, 3, 4), (3, 512, 8, None), (1000, 1024, 8, None)])
def test_routing_config(t, e, k, n_group):
    cfg = C.routing_config(t, e, k, n_group, num_sms=132)
    assert cfg.ng_p2 >= (n_group or 1) and cfg.pg_p2 * (n_group or 1) >= e and cfg.k_p2 >= k
    assert cfg.block_t * cfg.ng_p2 * cfg.pg_p2 <= max(1024, cfg.ng_p2 * cfg.pg_p2)
    if t <= 264:
        assert cfg.block_t == 1  # decode: spread tokens over SMs


def test_dispatch_and_combine_configs():
    d = C.dispatch_config(128, 8, 7168, 256)
    assert d.e_p2 == 256 and d.block_k == 8192 and d.block_k % 128 == 0
    # decode: 16 programs count 16 experts each for masked_m, apart from the 128 token programs
    assert d.fused and d.e_block == 16 and D._fused_grid(128, 256, 1, d) == (16 + 128, 1)
    assert D._fused_grid(0, 0, 2, d) == (1, 2)  # never an empty grid
    assert C.dispatch_config(3, 2, 16, 5).block_k == 16  # small rows: one column block
    c = C.combine_config(128, 7168)
    assert c.block_h == 1024 and c.num_warps == 4 and is_pow2(c.block_t)
    assert c.gather_all  # decode: the top_k rows in one load
    c = C.combine_config(16384, 7168)
    assert (c.block_h, c.num_warps, c.gather_all, c.sparse) == (8192, 4, False, True)
    # a branch per slot beyond decode (session 18), per-slot loads on request
    assert C.combine_config(2048, 7168).sparse and not C.combine_config(2048, 7168, sparse=False).sparse
    assert not C.combine_config(128, 7168, sparse=True).sparse  # gather_all: no branches


def test_dispatch_fuses_decode_and_chunks_prefill():
    d = C.dispatch_config(128, 8, 7168, 256)  # DeepSeek-V3 decode step: one launch, a program per token
    assert d.fused and d.block_t == 1 and d.block_k == 8192 and d.num_warps == 8
    # a few decode tokens: each row in slices over several programs (session 58)
    for t in (1, 16):
        d = C.dispatch_config(t, 8, 7168, 256)
        assert d.fused and (d.block_k, d.num_warps) == (2048, 4)
    assert C.dispatch_config(17, 8, 7168, 256).block_k == 8192
    assert C.dispatch_config(1, 8, 1024, 256).block_k == 1024  # never wider than the row
    assert not C.dispatch_config(16384, 8, 7168, 256).fused
    assert not C.dispatch_config(128, 8, 7168, 256, fused=False).fused
    # chunked scatter (session 10 sweep): all local 2048 columns / 4 warps; under an expert_map a token's
    # whole row / 4 warps; quantizing bf16 rows 4096 / 4
    p = C.dispatch_config(4096, 8, 7168, 32)
    assert (p.block_t, p.block_k, p.num_warps) == (1, 2048, 4)
    p = C.dispatch_config(4096, 8, 7168, 32, has_map=True)
    assert (p.block_t, p.block_k, p.num_warps) == (1, 8192, 4)
    p = C.dispatch_config(4096, 8, 7168, 256, quant=True)
    assert (p.block_t, p.block_k, p.num_warps) == (1, 4096, 4)
    # under an expert_map the scatter branches per slot (session 15): copying a whole row / 4 warps,
    # quantizing a whole row / 8 warps (session 18)
    assert not p.sparse and C.dispatch_config(4096, 8, 7168, 32, has_map=True).sparse
    p = C.dispatch_config(4096, 8, 7168, 32, has_map=True, quant=True)
    assert (p.sparse, p.block_t, p.block_k, p.num_warps) == (True, 1, 8192, 8)
    p = C.dispatch_config(4096, 8, 7168, 32, has_map=True, quant=True, sparse=False)  # quant kernel + FP8 copy
    assert (p.sparse, p.block_k, p.num_warps) == (False, 8192, 4)
    assert not C.dispatch_config(4096, 8, 7168, 32, has_map=True, block_t=2).sparse
    # count kernel ranks (session 18): one-hot column prefixes for one slice of 32 experts, comparisons above
    assert C.dispatch_config(4096, 8, 7168, 32).rank_sub == 0
    assert C.dispatch_config(4096, 8, 7168, 64).rank_sub == C.dispatch_config(4096, 8, 7168, 256).rank_sub == 32
    # the quantizing dense scatter writes its scales in a pass of their own from 2048 tokens x top-8 (sessions 19, 58)
    assert C.dispatch_config(2048, 8, 7168, 256, quant=True).scales_apart
    assert not C.dispatch_config(1024, 8, 7168, 256, quant=True).scales_apart
    assert not C.dispatch_config(16384, 8, 7168, 256).scales_apart  # the FP8 scatter: no gain
    assert C.dispatch_config(1024, 8, 7168, 256, scales_apart=True).scales_apart
    assert not C.dispatch_config(128, 8, 7168, 256, sparse=True).sparse  # the fused decode launch
    with pytest.raises(ValueError, match="one token per program"):
        C.dispatch_config(4096, 8, 7168, 32, sparse=True, block_t=2)
    assert C.combine_config(16384, 7168).block_t == 1  # sweep winner at every size


def test_routing_config_spreads_decode_tokens():
    cfg = C.routing_config(128, 256, 8, 8, num_sms=132)  # a token per program, 4 warps (session 10 A/B)
    assert cfg.block_t == 1 and cfg.num_warps == C.ROUTING_DECODE_WARPS == 4
    assert C.routing_config(128, 16, 2, None, num_sms=132).num_warps == 1  # 16 experts: one warp is plenty
    assert C.routing_config(16384, 256, 8, 8, num_sms=132).num_warps == 4  # 4 tokens x 256 slots
    assert C.routing_config(128, 256, 8, 8, num_sms=132, block_t=4, num_warps=4) == C.RoutingConfig(4, 8, 32, 8, 4)
