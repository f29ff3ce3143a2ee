"""Hopper ``dispatch_contiguous`` / ``dispatch_masked`` (the Triton routing, then the row mover of
impls/dispatch_rows.cuh) vs the reference, bit for bit, on poisoned buffers; which calls the mover takes;
its compiled code.

The GPU tests run only on an sm_90 GPU; the CPU ones compile the kernel and check ``mover_applies``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_util import assert_same_bits, make_expert_map, poison_empty

from moe_fp8 import reference as ref
from moe_fp8.kernels.dispatch import KERNEL_TEMPLATE, mover_applies
from moe_fp8.testing import make_dispatch_inputs

POISON = 0x5A  # every byte of every buffer the call allocates: no valid id, row_map entry or -1


@pytest.mark.parametrize(("top_k", "masked", "on_device", "apart"), [
    (8, "false", "false", "false"), (8, "false", "true", "true"), (1, "false", "false", "true"),
    (32, "false", "true", "false"), (8, "true", "false", "false"), (32, "true", "false", "false"),
    (8, "true", "false", "true")])
def test_kernel_compiles_to_bulk_copies_without_local_memory(top_k, masked, on_device, apart, tmp_path: Path):
    from moe_fp8.kernels.jit import get_compiler
    from moe_fp8.kernels.jit.cache import include_dir
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    src = KERNEL_TEMPLATE.format(top_k=top_k, masked=masked, on_device=on_device, apart=apart, m_align=4)
    res = get_compiler().compile_ex(src, "dispatch_rows", [include_dir()], tmp_path)
    (report,) = res.ptxas.values()
    assert report.get("spill_stores", 0) == 0 and report.get("stack", 0) == 0, report
    sass = dump_sass(res.cubin)
    assert count_instructions(sass, "UBLKCP") >= 2  # the row in, the row out
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0


def test_mover_applies_to_bulk_copyable_rows():
    ids = torch.zeros(4, 8, dtype=torch.int32)
    rows = torch.empty(4, 7168, dtype=torch.float8_e4m3fn)
    assert mover_applies(rows, ids)
    assert not mover_applies(torch.empty(4, 200, dtype=torch.float8_e4m3fn), ids)  # 200 bytes: not 16-byte rows
    assert not mover_applies(torch.empty(4, 7184, dtype=torch.float8_e4m3fn)[:, 8:7176], ids)  # not contiguous
    assert not mover_applies(torch.empty(4 * 7168 + 8, dtype=torch.float8_e4m3fn)[8:].view(4, 7168), ids)
    assert not mover_applies(rows, torch.zeros(4, 33, dtype=torch.int32))  # more slots than lanes


def _check(got, want, bound: int | None) -> None:
    from moe_fp8.utils import is_scale_tma_layout

    out, out_scale, m_indices, row_map = got
    r_out, r_scale, r_m_indices, r_row_map = want
    m_total = r_m_indices.shape[0]
    assert out.shape[0] == m_indices.shape[0] == (m_total if bound is None else bound)
    assert is_scale_tma_layout(out_scale) and out_scale.shape == (out.shape[0], r_scale.shape[1])
    assert (m_indices[m_total:] == -1).all()
    assert_same_bits(m_indices[:m_total], r_m_indices, "m_indices")
    assert_same_bits(row_map, r_row_map, "row_map")
    rows = r_m_indices >= 0
    assert_same_bits(out[:m_total][rows], r_out[rows], "dispatched fp8 rows")
    assert_same_bits(out_scale[:m_total][rows], r_scale[rows], "dispatched scales")


CASES = [  # tokens, hidden, global experts, local experts (None: no map), top_k
    (1, 128, 4, None, 1),
    (37, 256, 8, None, 2),
    (50, 384, 24, 12, 4),  # expert map
    (20, 272, 16, None, 3),  # hidden not a multiple of 128: a partial scale group
    (1, 128, 64, 8, 8),  # most pairs not local, most experts empty
    (3, 7168, 256, 32, 8),  # tokens without a local expert
    (5, 128, 32, None, 32),  # every expert picked
    (0, 128, 4, None, 2),  # no tokens: m_indices alone
    (1000, 7168, 256, None, 8),  # scales inline
    (4100, 512, 16, None, 8),  # 32800 pairs: scales apart
    (8192, 7168, 256, 32, 8),  # expert parallelism at prefill
]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "h", "e_global", "e_local", "k"), CASES)
@pytest.mark.parametrize("sync", [True, False])
def test_matches_reference(monkeypatch, t, h, e_global, e_local, k, sync):
    from moe_fp8.kernels.dispatch import dispatch_contiguous_hopper
    from moe_fp8.kernels.triton.dispatch import contiguous_rows_bound

    d = make_dispatch_inputs(t, h, e_global, k, seed=t + h, device="cuda")
    e = e_local or e_global
    emap = make_expert_map(e_global, e_local, t).int() if e_local else None  # (int32 maps here)
    assert mover_applies(d.x_fp8, d.topk_ids)
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, 128)
    poison_empty(monkeypatch, POISON)
    *got, m_total = dispatch_contiguous_hopper(d.x_fp8, d.x_scale, d.topk_ids, e, emap, 128, sync=sync,
                                               return_m_total=True)
    _check(got, want, None if sync else contiguous_rows_bound(t, k, e, 128))
    assert int(m_total) == want[2].shape[0]


@pytest.mark.hopper
@pytest.mark.gpu
def test_strided_scales_int64_ids_and_the_public_op(monkeypatch):
    """Token-major scales (not the TMA layout) and int64 ids, through ``moe_fp8.layers.dispatch_contiguous``
    (the hopper backend's entry); rows the mover cannot take (200 bytes) still dispatch, by the Triton scatter."""
    import moe_fp8
    from moe_fp8 import backends
    from moe_fp8.kernels.dispatch import dispatch_contiguous_hopper

    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    assert backends.select("dispatch_contiguous", torch.device("cuda"))[1] is dispatch_contiguous_hopper
    for t, h in ((5000, 7168), (33, 200)):
        d = make_dispatch_inputs(t, h, 64, 6, seed=h, device="cuda")
        scales = d.x_scale.contiguous()
        ids = d.topk_ids.long()
        want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 64, None, 128)
        with monkeypatch.context() as m:
            poison_empty(m, POISON)
            got = moe_fp8.layers.dispatch_contiguous(d.x_fp8, scales, ids, 64)
        _check(got, want, None)


MASKED_CASES = [  # tokens, hidden, global experts, local experts (None: no map), top_k, max_m
    (300, 256, 8, None, 8, 400),  # 2400 pairs: past the fused kernel
    (1000, 384, 24, 12, 4, 50),  # expert map, experts overflow max_m
    (600, 272, 16, None, 5, 300),  # hidden not a multiple of 128
    (4096, 7168, 256, 32, 8, 2048),  # an EP rank's small prefill
    (4096, 512, 32, None, 8, 1000),  # 32768 pairs: the scales apart; experts overflow max_m
    (4500, 640, 48, None, 8, 900),  # scales apart, max_m not a multiple of their pass's 128 rows
    (5, 128, 4, None, 2, 3),  # the fused kernel (no mover)
]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "h", "e_global", "e_local", "k", "max_m"), MASKED_CASES)
def test_masked_matches_reference(monkeypatch, t, h, e_global, e_local, k, max_m):
    """Fresh outputs, and persistent ones whose rows past ``masked_m`` keep their contents."""
    from moe_fp8.kernels.dispatch import dispatch_masked_hopper
    from moe_fp8.utils import empty_scale_tma

    d = make_dispatch_inputs(t, h, e_global, k, seed=t + h, device="cuda")
    e = e_local or e_global
    emap = make_expert_map(e_global, e_local, t) if e_local else None
    r_out, r_scale, r_masked_m, r_row_map = ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap)
    valid = torch.arange(max_m, device="cuda")[None, :] < r_masked_m[:, None]
    kg = d.x_scale.shape[1]
    out = torch.full((e, max_m, h), POISON, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_scale = empty_scale_tma(max_m, kg, groups=e, device="cuda")
    out_scale.fill_(-7.0)
    with monkeypatch.context() as m:
        poison_empty(m, POISON)
        fresh = dispatch_masked_hopper(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap)
        kept = dispatch_masked_hopper(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap, out=out, out_scale=out_scale)
    for got_out, got_scale, masked_m, row_map in (fresh, kept):
        assert_same_bits(masked_m, r_masked_m, "masked_m")
        assert_same_bits(row_map, r_row_map, "row_map")
        assert_same_bits(got_out[valid], r_out[valid], "dispatched fp8 rows")
        assert_same_bits(got_scale[valid], r_scale[valid], "dispatched scales")
    assert kept[0] is out and kept[1] is out_scale
    assert (out.view(torch.uint8)[~valid] == POISON).all() and (out_scale[~valid] == -7.0).all()



# ---- routing: impls/route_pairs.cuh against the Triton count and scan kernels ----

@pytest.mark.parametrize(("ids", "emap", "masked", "experts"), [
    (torch.int32, None, False, 256), (torch.int64, torch.int32, False, 384), (torch.int32, torch.int64, True, 32),
    (torch.int64, None, True, 512)])
def test_route_kernel_compiles_without_local_memory(ids, emap, masked, experts, tmp_path: Path):
    from moe_fp8.kernels.dispatch import route_variant
    from moe_fp8.kernels.jit import get_compiler
    from moe_fp8.kernels.jit.cache import include_dir
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    name, src = route_variant(ids, emap, masked, experts)
    res = get_compiler().compile_ex(src, name, [include_dir()], tmp_path)
    (report,) = res.ptxas.values()
    assert report.get("spill_stores", 0) == 0 and report.get("stack", 0) == 0, report
    sass = dump_sass(res.cubin)
    assert count_instructions(sass, "MATCH") >= 8  # a rank by match.any a round
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0


def test_route_applies_to_its_cases(monkeypatch):
    from moe_fp8.kernels.dispatch import ROUTE_MAX_EXPERTS, route_applies

    ids = torch.zeros(4, 8, dtype=torch.int32)
    assert route_applies(ids, 256, None, 128) and route_applies(ids.long(), ROUTE_MAX_EXPERTS, ids[0], 128)
    assert not route_applies(ids, ROUTE_MAX_EXPERTS + 1, None, 128)  # more experts than kV = 2 a thread
    assert not route_applies(ids, 256, None, 64)  # the kernel's chunks are 128 pairs
    assert not route_applies(ids.short(), 256, None, 128)
    assert not route_applies(ids, 256, ids[0].float(), 128)
    monkeypatch.setenv("MOE_FP8_CUDA_ROUTE", "0")
    assert not route_applies(ids, 256, None, 128)


ROUTE_CASES = [  # tokens, top_k, local experts, global experts (None: no map), ids / map dtype, id pattern
    (0, 8, 256, None, torch.int64, "random"),
    (1, 1, 1, None, torch.int32, "random"),
    (16, 8, 256, None, torch.int32, "random"),  # one chunk
    (16, 8, 256, 512, torch.int64, "invalid"),  # ids outside the map and mapped outside [0, E)
    (17, 8, 32, None, torch.int32, "invalid"),  # ids outside [0, E): not local
    (256, 8, 256, None, torch.int32, "random"),  # exactly one CTA (16 chunks)
    (257, 8, 300, None, torch.int64, "random"),  # a second CTA of one chunk; kV = 2
    (1000, 8, 7, None, torch.int32, "one"),  # every pair the same expert: ranks up to 127
    (4096 + 3, 8, 256, 2048, torch.int32, "random"),  # 17 CTAs: look-back past one batch of 16
    (16384, 8, 256, None, torch.int32, "random"),  # 64 CTAs
    (16384, 8, 32, 256, torch.int64, "random"),  # an EP rank: most pairs not local
    (40000, 6, 512, None, torch.int64, "random"),  # kV = 2, 118 CTAs
    (65536, 8, 256, None, torch.int32, "random"),  # 256 CTAs
]


def _route_ids(t: int, k: int, e_local: int, e_global: int | None, dtype: torch.dtype, pattern: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = e_global or e_local
    if pattern == "one":
        ids = torch.full((t, k), n // 2, dtype=torch.int64)
    else:
        ids = torch.randint(0, n, (t, k), generator=gen)
        if pattern == "invalid":
            ids[torch.rand(t, k, generator=gen) < 0.2] = -1
            ids[torch.rand(t, k, generator=gen) < 0.2] = n + 5
    emap = None
    if e_global is not None:
        emap = torch.full((e_global,), -1, dtype=dtype)
        emap[torch.randperm(e_global, generator=gen)[:e_local]] = torch.randperm(e_local, generator=gen).to(dtype)
        if pattern == "invalid":
            emap[:3] = e_local + 1  # mapped outside the local experts
        emap = emap.cuda()
    return ids.to(dtype).cuda(), emap


def _assert_same_routing(got, want, masked: bool) -> None:
    is_local = want.local >= 0
    assert_same_bits(got.local, want.local, "local")
    assert_same_bits(got.rank[is_local], want.rank[is_local], "rank")
    assert_same_bits(got.base, want.base, "base")
    assert got.has_map == want.has_map
    if masked:
        assert_same_bits(got.masked_m, want.masked_m, "masked_m")
    else:
        assert_same_bits(got.count, want.count, "count")
        assert_same_bits(got.seg_start, want.seg_start, "seg_start")
        assert_same_bits(got.status, want.status, "status")


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "k", "e_local", "e_global", "dtype", "pattern"), ROUTE_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_route_pairs_matches_the_triton_kernels(monkeypatch, t, k, e_local, e_global, dtype, pattern, masked):
    """Every output a scatter reads, bit for bit, on poisoned buffers; ranks of pairs that are not local are
    never read."""
    from moe_fp8.kernels.dispatch import route_pairs
    from moe_fp8.kernels.triton.configs import dispatch_config
    from moe_fp8.kernels.triton.dispatch import _route

    ids, emap = _route_ids(t, k, e_local, e_global, dtype, pattern, seed=t + e_local)
    cfg = dispatch_config(t, k, 7168, e_local, fused=False, has_map=emap is not None)
    max_m = max(t // 4, 1)
    want = _route(ids, e_local, emap, max_m, 128, torch.empty(e_local, dtype=torch.int32, device="cuda")
                  if masked else None, cfg)
    with monkeypatch.context() as m:
        poison_empty(m, POISON)
        masked_m = torch.empty(e_local, dtype=torch.int32, device="cuda") if masked else None
        got = route_pairs(ids, e_local, emap, max_m, 128, masked_m, cfg.chunk)
    assert got is not None
    _assert_same_routing(got, want, masked)


@pytest.mark.hopper
@pytest.mark.gpu
def test_route_pairs_repeats_and_replays():
    """The look-back's result does not depend on the CTAs' timing (200 launches of 256 CTAs agree), and a CUDA
    graph of the launch (its workspace's zero fill captured with it) replays other ids right."""
    from moe_fp8.kernels.dispatch import route_pairs
    from moe_fp8.kernels.triton.configs import dispatch_config
    from moe_fp8.kernels.triton.dispatch import _route

    t, k, e = 65536, 8, 256
    cfg = dispatch_config(t, k, 7168, e, fused=False)
    ids, _ = _route_ids(t, k, e, None, torch.int32, "random", seed=3)
    want = _route(ids, e, None, 0, 128, None, cfg)
    for _ in range(200):
        _assert_same_routing(route_pairs(ids, e, None, 0, 128, None, cfg.chunk), want, False)

    static = ids.clone()
    route_pairs(static, e, None, 0, 128, None, cfg.chunk)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_pairs(static, e, None, 0, 128, None, cfg.chunk)
    for seed in (4, 5, 6):
        new, _ = _route_ids(t, k, e, None, torch.int32, "random" if seed != 5 else "one", seed=seed)
        static.copy_(new)
        graph.replay()
        _assert_same_routing(captured, _route(new, e, None, 0, 128, None, cfg), False)
