"""Launch configurations of the Triton data-path kernels (pure Python: no GPU, no Triton needed)."""

from __future__ import annotations

import pytest

from moe_fp8.kernels.triton import configs as C


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
    assert 1 <= cfg.row_programs <= row_blocks
    if not masked:
        assert cfg.row_programs == row_blocks  # one row block per program: no loop
    else:  # a fixed number of programs per (column block, group), about 8 per SM in all
        col_blocks = -(-k_groups // cfg.block_g)
        assert cfg.row_programs * col_blocks * groups <= max(8 * 132, col_blocks * groups)


def test_quant_config_decode_buffer_launches_few_programs():
    """[256 experts, max_m 128, I 2048]: ~1 program per (expert, column block), not one per row block."""
    cfg = C.quant_config(128, 16, 128, 256, masked=True, num_sms=132)
    col_blocks = -(-16 // cfg.block_g)
    assert cfg.row_programs * col_blocks * 256 <= 2048


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
    assert d.e_p2 == 256 and d.block_k == 2048 and d.block_k % 128 == 0
    assert C.dispatch_config(3, 2, 16, 5).block_k == 16  # small rows: one column block
    c = C.combine_config(128, 7168)
    assert c.block_h == 1024 and is_pow2(c.block_t)


def test_dispatch_routes_decode_in_one_program_and_prefill_in_chunks():
    assert C.dispatch_config(128, 8, 7168, 256).single_program  # DeepSeek-V3 decode step: one launch
    assert not C.dispatch_config(16384, 8, 7168, 256).single_program
    assert not C.dispatch_config(128, 8, 7168, 256, single_program=False).single_program


def test_routing_config_keeps_a_decode_token_in_one_warp():
    cfg = C.routing_config(128, 256, 8, 8, num_sms=132)
    assert cfg.block_t == 1 and cfg.num_warps == 1
    assert C.routing_config(128, 256, 8, 8, num_sms=132, block_t=4, num_warps=4) == C.RoutingConfig(4, 8, 32, 8, 4)
