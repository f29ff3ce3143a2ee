"""Triton dispatch (contiguous / masked) and combine vs ``moe_fp8.reference``, exactly.

Dispatch: ``row_map``, ``m_indices``, ``masked_m`` and every copied FP8 byte and scale identical;
padding rows (contiguous) and rows past ``masked_m`` (masked) are not compared — kernels leave them
unspecified / untouched (checked on poisoned buffers). Combine: identical bf16 bits.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from datapath_util import DEVICE, assert_same_bits, make_expert_map, require_kernels

from moe_fp8 import reference as ref
from moe_fp8.testing import make_dispatch_inputs, randn
from moe_fp8.utils import empty_scale_tma, is_scale_tma_layout

triton = pytest.importorskip("triton")

from moe_fp8.kernels.triton import dispatch  # noqa: E402  (after the importorskip)
from moe_fp8.kernels.triton.configs import CombineConfig, combine_config, dispatch_config  # noqa: E402

pytestmark = pytest.mark.datapath


@pytest.fixture(autouse=True)
def _kernels_run_here():
    require_kernels()


def check_masked(got, want, max_m: int) -> None:
    out, out_scale, masked_m, row_map = got
    r_out, r_scale, r_masked_m, r_row_map = want
    assert out_scale.stride() == r_scale.stride() and is_scale_tma_layout(out_scale)
    assert_same_bits(masked_m, r_masked_m, "masked_m")
    assert_same_bits(row_map, r_row_map, "row_map")
    valid = torch.arange(max_m, device=out.device)[None, :] < r_masked_m[:, None]
    assert_same_bits(out[valid], r_out[valid], "dispatched fp8 rows")
    assert_same_bits(out_scale[valid], r_scale[valid], "dispatched scales")


def check_contiguous(got, want) -> None:
    out, out_scale, m_indices, row_map = got
    r_out, r_scale, r_m_indices, r_row_map = want
    assert out.shape == r_out.shape and out_scale.stride() == r_scale.stride()
    assert_same_bits(m_indices, r_m_indices, "m_indices")
    assert_same_bits(row_map, r_row_map, "row_map")
    rows = r_m_indices >= 0
    assert_same_bits(out[rows], r_out[rows], "dispatched fp8 rows")
    assert_same_bits(out_scale[rows], r_scale[rows], "dispatched scales")


DISPATCH_CASES = [  # tokens, hidden, global experts, local experts (None: no map), top_k, max_m, skew
    (37, 256, 8, None, 2, 16, 0.0),
    (50, 384, 24, 12, 4, 12, 3.0),  # expert map, hot experts overflow max_m
    (5, 128, 4, None, 4, 2, 0.0),  # every expert overflows
    (20, 272, 16, None, 3, 20, 0.0),  # hidden not a multiple of 128: partial scale group
    (1, 128, 64, 8, 8, 4, 0.0),  # most pairs not local, most experts empty
    (40, 128, 96, None, 2, 8, 0.0),  # > 32 experts: several one-hot slices in the count kernel
    (0, 128, 4, None, 2, 3, 0.0),  # no tokens
    (6, 128, 4, None, 2, 0, 0.0),  # max_m = 0
    (24, 128, 40, None, 10, 12, 0.0),  # top_k past 8: 16 slots a token (K_P2)
]


def check_contiguous_bound(got, want, align_m: int) -> None:
    """``sync=False``: the exact layout in the first ``M_total`` rows, padding (-1) after them."""
    out, out_scale, m_indices, row_map = got
    m_total = want[2].shape[0]
    assert out.shape[0] == m_indices.shape[0] >= m_total and out.shape[0] % align_m == 0
    assert is_scale_tma_layout(out_scale) and out_scale.shape[0] == out.shape[0]
    assert (m_indices[m_total:] == -1).all()
    r_out, r_scale, r_m_indices, r_row_map = want
    assert_same_bits(m_indices[:m_total], r_m_indices, "m_indices")
    assert_same_bits(row_map, r_row_map, "row_map")
    rows = r_m_indices >= 0
    assert_same_bits(out[:m_total][rows], r_out[rows], "dispatched fp8 rows")
    assert_same_bits(out_scale[:m_total][rows], r_scale[rows], "dispatched scales")


def check_m_total(m_total: torch.Tensor, want, device: torch.device) -> None:
    """``return_m_total``: the reference layout's row count, as int32 [1] on the data's device."""
    assert m_total.dtype == torch.int32 and m_total.shape == (1,) and m_total.device == device
    assert int(m_total) == want[2].shape[0]


@pytest.mark.parametrize(("fused", "sparse"), [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize(("t", "h", "e_global", "e_local", "k", "max_m", "skew"), DISPATCH_CASES)
def test_dispatch_matches_reference(t, h, e_global, e_local, k, max_m, skew, fused, sparse):
    d = make_dispatch_inputs(t, h, e_global, k, seed=t + h, device=DEVICE, skew=skew)
    emap = make_expert_map(e_global, e_local, seed=t) if e_local else None
    e = e_local or e_global
    cfg = dispatch_config(t, k, h, e, fused=fused, block_t=1 if sparse else 2, block_k=128, sparse=sparse)
    assert cfg.sparse == sparse
    got = dispatch.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap, config=cfg)
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap), max_m)
    # the dense scatter also with its scales in a pass of their own (scales_apart)
    for align_m, apart in ((128, False), (16, False), *(() if sparse else ((128, True),))):
        cfg_c = dataclasses.replace(cfg, scales_apart=apart)
        want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, align_m)
        got = dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, align_m, config=cfg_c)
        check_contiguous(got, want)
        *got, m_total = dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, align_m, sync=False,
                                                     return_m_total=True, config=cfg_c)
        assert got[0].shape[0] == dispatch.contiguous_rows_bound(t, k, e, align_m)
        check_contiguous_bound(got, want, align_m)
        check_m_total(m_total, want, d.x_fp8.device)


@pytest.mark.parametrize("block_t", [1, 4])
def test_dispatch_fused_ranks_across_chunks_and_programs(block_t):
    """Fused masked dispatch with more earlier pairs than one rank chunk, several column blocks and
    more expert slices (masked_m) than token programs."""
    d = make_dispatch_inputs(300, 384, 64, 4, seed=9, device=DEVICE, skew=2.0)
    cfg = dispatch_config(300, 4, 384, 64, fused=True, block_t=block_t, block_k=128)
    assert cfg.fused and cfg.rank_chunk < 300 * 4 and cfg.e_block < 64
    got = dispatch.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 64, 40, None, config=cfg)
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 64, 40), 40)
    d = make_dispatch_inputs(2, 128, 512, 8, seed=3, device=DEVICE)  # 1 program of pairs, 512 experts
    cfg = dispatch_config(2, 8, 128, 512, fused=True)
    got = dispatch.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 512, 4, None, config=cfg)
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 512, 4), 4)


@pytest.mark.parametrize(("t", "h", "e_global", "e_local", "k", "max_m", "skew"), DISPATCH_CASES)
@pytest.mark.parametrize(("block_t", "block_k", "fused"), [(1, None, True), (2, 128, True), (1, 128, False)])
def test_quant_dispatch_masked_matches_quant_then_dispatch(t, h, e_global, e_local, k, max_m, skew, block_t,
                                                           block_k, fused):
    """The fused quant + masked dispatch equals ``per_token_group_quant`` then ``dispatch_masked`` of the
    reference, bit for bit (x_fp8 / x_scale too); several column blocks, 2-token blocks, and the
    unfused fallback."""
    d = make_dispatch_inputs(t, h, e_global, k, seed=t + h, device=DEVICE, skew=skew)
    emap = make_expert_map(e_global, e_local, seed=t) if e_local else None
    e = e_local or e_global
    cfg = dispatch_config(t, k, h, e, fused=fused, block_t=block_t, block_k=block_k)
    x_fp8, x_scale, *got = dispatch.quant_dispatch_masked(d.x, d.topk_ids, e, max_m, emap, config=cfg)
    r_fp8, r_scale = ref.per_token_group_quant(d.x)
    assert x_scale.stride() == r_scale.stride()
    assert_same_bits(x_fp8, r_fp8, "x_fp8")
    assert_same_bits(x_scale, r_scale, "x_scale")
    check_masked(tuple(got), ref.dispatch_masked(r_fp8, r_scale, d.topk_ids, e, max_m, emap), max_m)


def test_quant_dispatch_masked_ue8m0_non_finite_and_persistent_buffers():
    t, h, e, k, max_m = 9, 384, 6, 3, 5
    d = make_dispatch_inputs(t, h, e, k, seed=4, device=DEVICE)
    x = d.x.clone()
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    x[3, :128] = 0.0
    x[4, 130] = 3e38  # overflows bf16: Inf
    out = torch.full((e, max_m, h), 0x5A, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    out_scale = empty_scale_tma(max_m, 3, groups=e, device=DEVICE)
    out_scale.fill_(-7.0)
    for ue8m0 in (False, True):
        x_fp8, x_scale, o, s, masked_m, row_map = dispatch.quant_dispatch_masked(
            x, d.topk_ids, e, max_m, None, ue8m0, 1e-10, out=out, out_scale=out_scale)
        assert o is out and s is out_scale
        r_fp8, r_scale = ref.per_token_group_quant(x, ue8m0=ue8m0)
        assert_same_bits(x_fp8, r_fp8, "x_fp8")
        assert_same_bits(x_scale, r_scale, "x_scale")
        check_masked((o, s, masked_m, row_map), ref.dispatch_masked(r_fp8, r_scale, d.topk_ids, e, max_m), max_m)
        invalid = torch.arange(max_m, device=DEVICE)[None, :] >= masked_m[:, None]
        assert (o.view(torch.uint8)[invalid] == 0x5A).all() and (s[invalid] == -7.0).all()
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.quant_dispatch_masked(x.t(), d.topk_ids, e, max_m, None)


@pytest.mark.parametrize(("t", "h", "e_global", "e_local", "k", "max_m", "skew"), DISPATCH_CASES)
def test_quant_dispatch_contiguous_matches_quant_then_dispatch(t, h, e_global, e_local, k, max_m, skew):
    """``quant_dispatch_contiguous`` equals the reference's ``per_token_group_quant`` then
    ``dispatch_contiguous`` bit for bit, with the sync (exact rows) and without it (the bound), with
    and without the quantized input (``return_x=False``: with a map, idle tokens' rows are not read), by
    the dense scatter (2 tokens per program; under a map: the quant kernel, then the FP8 scatter; its
    scales inline or in a pass of their own) and the sparse one (a branch per slot)."""
    d = make_dispatch_inputs(t, h, e_global, k, seed=t + h, device=DEVICE, skew=skew)
    emap = make_expert_map(e_global, e_local, seed=t) if e_local else None
    e = e_local or e_global
    r_fp8, r_scale = ref.per_token_group_quant(d.x)
    for (align_m, sync, return_x), (sparse, apart) in itertools.product(
            ((128, True, True), (16, True, False), (128, False, True), (128, False, False)),
            ((False, False), (False, True), (True, False))):
        cfg = dispatch_config(t, k, h, e, block_t=1 if sparse else 2, block_k=128, quant=True, sparse=sparse,
                              scales_apart=apart)
        x_fp8, x_scale, *got = dispatch.quant_dispatch_contiguous(d.x, d.topk_ids, e, emap, align_m, sync=sync,
                                                                  return_x=return_x, config=cfg)
        if not return_x:
            assert x_fp8 is None and x_scale is None
        else:
            assert x_scale.stride() == r_scale.stride()
            assert_same_bits(x_fp8, r_fp8, "x_fp8")
            assert_same_bits(x_scale, r_scale, "x_scale")
        want = ref.dispatch_contiguous(r_fp8, r_scale, d.topk_ids, e, emap, align_m)
        if sync:
            check_contiguous(tuple(got), want)
        else:
            assert got[0].shape[0] == dispatch.contiguous_rows_bound(t, k, e, align_m)
            check_contiguous_bound(tuple(got), want, align_m)


def test_quant_dispatch_contiguous_raises_the_reference_errors_and_ue8m0():
    t, h, e, k = 9, 384, 6, 3
    d = make_dispatch_inputs(t, h, e, k, seed=5, device=DEVICE)
    x = d.x.clone()
    x[1, 5] = float("nan")
    x[2, 200] = float("inf")
    x_fp8, x_scale, *got = dispatch.quant_dispatch_contiguous(x, d.topk_ids, e, None, 128, True, 1e-10)
    r_fp8, r_scale = ref.per_token_group_quant(x, ue8m0=True)
    assert_same_bits(x_fp8, r_fp8, "x_fp8")
    assert_same_bits(x_scale, r_scale, "x_scale")
    check_contiguous(tuple(got), ref.dispatch_contiguous(r_fp8, r_scale, d.topk_ids, e, None, 128))
    bad = d.topk_ids.clone()
    bad[3, 1] = e  # outside [0, E): the reference's error, from the one sync
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 6\)"):
        dispatch.quant_dispatch_contiguous(x, bad, e, None, 128)
    with pytest.raises(ValueError, match="contiguous"):
        dispatch.quant_dispatch_contiguous(x.t(), d.topk_ids, e, None, 128)


def _select_triton_kernel(monkeypatch, op: str, kernel) -> list[str]:
    """Make ``backends.select`` give ``kernel`` for ``op`` (as on a GPU); returns the list of its selections."""
    from moe_fp8 import backends

    real_select, calls = backends.select, []

    def select(name, device):
        if name == op:
            calls.append(name)
            return "portable", kernel
        return real_select(name, device)

    monkeypatch.setattr(backends, "select", select)
    return calls


@pytest.mark.parametrize("t", [11, 0])
def test_public_quant_dispatch_contiguous_through_the_triton_kernel(monkeypatch, t):
    """``moe_fp8.ops.quant_dispatch_contiguous`` with the Triton kernel as its backend (as on a GPU): the
    calling convention reaches the kernel (sync=False by keyword), results equal the reference's two ops."""
    import moe_fp8.ops

    calls = _select_triton_kernel(monkeypatch, "quant_dispatch_contiguous", dispatch.quant_dispatch_contiguous)
    h, e_global, e_local, k = 272, 16, 6, 4
    d = make_dispatch_inputs(t, h, e_global, k, seed=13, device=DEVICE, skew=2.0)
    emap = make_expert_map(e_global, e_local, seed=4)
    for ue8m0, sync, return_x in ((False, True, True), (True, False, True), (False, True, False), (False, False, False)):
        r_fp8, r_scale = ref.per_token_group_quant(d.x, ue8m0=ue8m0)
        want = ref.dispatch_contiguous(r_fp8, r_scale, d.topk_ids, e_local, emap, 128)
        x_fp8, x_scale, *got, m_total = moe_fp8.ops.quant_dispatch_contiguous(
            d.x, d.topk_ids, e_local, emap, ue8m0=ue8m0, sync=sync, return_x=return_x, return_m_total=True)
        check_m_total(m_total, want, d.x.device)
        if return_x:
            assert_same_bits(x_fp8, r_fp8, "x_fp8")
            assert_same_bits(x_scale, r_scale, "x_scale")
        else:
            assert x_fp8 is None and x_scale is None
        if sync:
            check_contiguous(tuple(got), want)
        else:
            check_contiguous_bound(tuple(got), want, 128)
    assert calls == (["quant_dispatch_contiguous"] * 4 if t else [])  # no tokens: the two ops' own paths


@pytest.mark.parametrize("t", [11, 0])
def test_public_quant_dispatch_masked_through_the_triton_kernel(monkeypatch, t):
    """``moe_fp8.ops.quant_dispatch_masked`` with the Triton kernel as its backend (selected as on a GPU):
    the public op's calling convention (positional ue8m0 / eps, keyword destinations) reaches the kernel,
    and the result is the reference's ``per_token_group_quant`` then ``dispatch_masked``, bit for bit;
    allocating and into given destinations (rows past ``masked_m`` untouched); no tokens."""
    import moe_fp8.ops

    calls = _select_triton_kernel(monkeypatch, "quant_dispatch_masked", dispatch.quant_dispatch_masked)
    h, e_global, e_local, k, max_m = 272, 16, 6, 4, 8  # partial last scale group, an expert map
    d = make_dispatch_inputs(t, h, e_global, k, seed=12, device=DEVICE, skew=2.0)
    emap = make_expert_map(e_global, e_local, seed=3)
    for ue8m0 in (False, True):
        r_fp8, r_scale = ref.per_token_group_quant(d.x, ue8m0=ue8m0)
        want = ref.dispatch_masked(r_fp8, r_scale, d.topk_ids, e_local, max_m, emap)
        x_fp8, x_scale, *got = moe_fp8.ops.quant_dispatch_masked(d.x, d.topk_ids, e_local, max_m, emap, ue8m0=ue8m0)
        assert x_scale.stride() == r_scale.stride()
        assert_same_bits(x_fp8, r_fp8, "x_fp8")
        assert_same_bits(x_scale, r_scale, "x_scale")
        check_masked(tuple(got), want, max_m)
        out = torch.full((e_local, max_m, h), 0x5A, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
        out_scale = empty_scale_tma(max_m, 3, groups=e_local, device=DEVICE).fill_(-7.0)
        x_fp8, x_scale, o, s, masked_m, row_map = moe_fp8.ops.quant_dispatch_masked(
            d.x, d.topk_ids, e_local, max_m, emap, ue8m0=ue8m0, out=out, out_scale=out_scale)
        assert o is out and s is out_scale
        assert_same_bits(x_fp8, r_fp8, "x_fp8 (destinations given)")
        check_masked((o, s, masked_m, row_map), want, max_m)
        if t:  # (no tokens: the dispatch of this device's backend runs, the CPU reference rewrites every row)
            invalid = torch.arange(max_m, device=DEVICE)[None, :] >= masked_m[:, None]
            assert (o.view(torch.uint8)[invalid] == 0x5A).all() and (s[invalid] == -7.0).all()
    assert len(calls) == (4 if t else 0)  # no tokens: the two ops' empty-problem paths, no kernel


def test_dispatch_contiguous_m_indices_many_segments():
    """m_indices from segment starts: several row blocks, experts in more than one E chunk, empty
    experts between full ones, and the sync=False padding tail."""
    d = make_dispatch_inputs(200, 128, 300, 2, seed=5, device=DEVICE, skew=3.0)
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 300, None, 16)
    check_contiguous(dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 300, None, 16), want)
    got = dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 300, None, 16, sync=False)
    check_contiguous_bound(got, want, 16)


def test_dispatch_int64_ids_strided_scales_and_persistent_buffers():
    d = make_dispatch_inputs(40, 256, 8, 3, seed=4, device=DEVICE)
    ids = d.topk_ids.long()
    scale_rows = d.x_scale.contiguous()  # row-major scales: any layout is accepted
    e, max_m = 8, 24
    out = torch.full((e, max_m, 256), 0x5A, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    out_scale = empty_scale_tma(max_m, 2, groups=e, device=DEVICE)
    out_scale.fill_(-7.0)
    got = dispatch.dispatch_masked(d.x_fp8, scale_rows, ids, e, max_m, None, out=out, out_scale=out_scale)
    assert got[0].data_ptr() == out.data_ptr()
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m), max_m)
    valid = torch.arange(max_m, device=DEVICE)[None, :] < got[2][:, None]
    assert (out.view(torch.uint8)[~valid] == 0x5A).all() and (out_scale[~valid] == -7.0).all()
    got = dispatch.dispatch_contiguous(d.x_fp8, scale_rows, ids, e, None, 128)
    check_contiguous(got, ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, None, 128))


def test_dispatch_contiguous_rejects_bad_ids_like_the_reference():
    d = make_dispatch_inputs(6, 128, 4, 2, seed=0, device=DEVICE)
    bad = d.topk_ids.clone()
    bad[2, 1] = 4
    for ids, emap, e in [(bad, None, 4), (-bad, None, 4), (d.topk_ids, torch.tensor([0, 1, 5, -1], device=DEVICE), 4)]:
        with pytest.raises(ValueError) as want:
            ref.dispatch_contiguous(d.x_fp8, d.x_scale, ids, e, emap)
        with pytest.raises(ValueError) as got:
            dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, ids, e, emap, 128)
        assert str(got.value) == str(want.value)


def test_dispatch_masked_drops_invalid_ids():
    """The masked dispatch never reads the ids on the host: ids outside the map (or mapped outside
    [0, E)) are simply not local, instead of an out-of-bounds access."""
    d = make_dispatch_inputs(8, 128, 4, 2, seed=1, device=DEVICE)
    ids = d.topk_ids.clone()
    ids[0, 0], ids[1, 1] = 4, -3
    out, out_scale, masked_m, row_map = dispatch.dispatch_masked(d.x_fp8, d.x_scale, ids, 4, 8, None)
    assert row_map[0, 0] == -1 and row_map[1, 1] == -1
    keep = ids.clone()
    keep[0, 0] = keep[1, 1] = -1  # the reference treats negative ids as not local
    check_masked((out, out_scale, masked_m, row_map), ref.dispatch_masked(d.x_fp8, d.x_scale, keep, 4, 8), 8)


def test_bad_ids_are_not_local_on_every_backend():
    """The reference agrees with the kernel on ids the masked and the sync-free contiguous dispatch do not
    check: a negative id (which must not wrap around an expert map), an id past the map or past E, and a map
    target past E are not local."""
    import moe_fp8

    d = make_dispatch_inputs(6, 128, 8, 2, seed=2, device=DEVICE)
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, 7], dtype=torch.int32, device=DEVICE)  # 7: past E = 4
    ids = d.topk_ids.clone()
    ids[0, 0], ids[1, 1], ids[2, 0] = -4, 8, 7  # emap[-4] would be 2; past the map; maps past E
    got = dispatch.dispatch_masked(d.x_fp8, d.x_scale, ids, 4, 8, emap)
    want = ref.dispatch_masked(d.x_fp8, d.x_scale, ids, 4, 8, emap)
    check_masked(got, want, 8)
    assert want[3][0, 0] == want[3][1, 1] == want[3][2, 0] == -1
    plain = d.topk_ids % 4
    plain[0, 0], plain[3, 1] = 4, 7  # past E, no map
    check_masked(dispatch.dispatch_masked(d.x_fp8, d.x_scale, plain, 4, 8, None),
                 ref.dispatch_masked(d.x_fp8, d.x_scale, plain, 4, 8), 8)
    # the public sync-free contiguous dispatch (the reference backend on CPU) drops them alike
    fixed = torch.where((ids < 0) | (ids >= 8), 0, ids)  # emap[0] = -1: not local either
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, fixed, 4, torch.where(emap >= 4, -1, emap), 128)
    got = moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, ids, 4, emap, sync=False)
    check_contiguous_bound(got, want, 128)


# the top_k rows in one load (decode), one load per slot, one branch per slot (expert parallelism)
COMBINE_MODES = ["gather_all", "per_slot", "sparse"]


def combine_mode_config(t: int, h: int, mode: str):
    cfg = combine_config(t, h, gather_all=mode == "gather_all", sparse=mode == "sparse")
    assert cfg.sparse == (mode == "sparse")
    return cfg


@pytest.mark.parametrize("mode", COMBINE_MODES)
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize(("y_dtype", "w_dtype", "shared", "map_dtype"), [
    (torch.bfloat16, torch.float32, True, torch.int64),
    (torch.bfloat16, torch.float32, False, torch.int32),
    (torch.float32, torch.bfloat16, True, torch.int64),
    (torch.float16, torch.float16, False, torch.int64),
])
def test_combine_matches_reference(layout, y_dtype, w_dtype, shared, map_dtype, mode):
    t, h, e, k, max_m = 30, 320, 8, 4, 12
    d = make_dispatch_inputs(t, h, e, k, seed=2, device=DEVICE, skew=2.0)
    if layout == "masked":
        row_map = ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m)[3]
        y = randn((e, max_m, h), seed=3, device=DEVICE, dtype=y_dtype)
    else:
        m_indices, row_map = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e)[2:]
        y = randn((m_indices.shape[0], h), seed=3, device=DEVICE, dtype=y_dtype)
        y[m_indices < 0] = float("nan")  # padding rows are never read
    row_map = row_map.clone()
    row_map[::7, 1] = -1  # skipped copies contribute nothing, whatever their weight (NaN here)
    weights_nan = d.topk_weights.clone()
    weights_nan[::7, 1] = float("nan")
    weights = weights_nan.to(w_dtype)
    sh = randn((t, h), seed=4, device=DEVICE) if shared else None
    got = dispatch.combine(y, row_map.to(map_dtype), weights, sh, config=combine_mode_config(t, h, mode))
    assert_same_bits(got, ref.combine(y, row_map, weights, sh), "combine")


def test_combine_refuses_a_sparse_config_it_cannot_run():
    y = randn((6, 128), seed=0, device=DEVICE)
    row_map = torch.tensor([[0, -1], [5, 2]], device=DEVICE)
    w = torch.ones(2, 2, device=DEVICE)
    for cfg in (CombineConfig(2, 128, 4, False, True), CombineConfig(1, 128, 4, True, True)):
        with pytest.raises(ValueError, match="a sparse combine needs block_t 1 and no gather_all"):
            dispatch.combine(y, row_map, w, None, config=cfg)


@pytest.mark.parametrize("mode", COMBINE_MODES)
def test_combine_edge_cases(mode):
    y = randn((6, 128), seed=0, device=DEVICE)
    row_map = torch.tensor([[0, -1], [5, 5], [-1, -1], [6, 1]], device=DEVICE)  # 6 is past the end
    w = torch.tensor([[0.5, float("nan")], [1.0, 2.0], [1.0, 1.0], [1.0, 1.0]], device=DEVICE)
    out = dispatch.combine(y, row_map, w, None, config=combine_mode_config(4, 128, mode))
    assert_same_bits(out[:3], ref.combine(y, row_map[:3], w[:3]), "combine")
    assert torch.isnan(out[3]).all(), "an out-of-range row must poison the token, not read memory"
    assert torch.isnan(ref.combine(y, row_map, w)[3]).all()  # the reference too (it read a zero row: a silent 0)
    y_t = randn((128, 6), seed=1, device=DEVICE).t()  # non-contiguous y
    assert_same_bits(dispatch.combine(y_t, row_map[:3], w[:3], None), ref.combine(y_t, row_map[:3], w[:3]),
                     "strided y")
    empty = dispatch.combine(y, row_map[:0], w[:0], None)
    assert empty.shape == (0, 128)
    only_shared = dispatch.combine(y[:0], torch.full((2, 3), -1, device=DEVICE), torch.ones(2, 3, device=DEVICE),
                                   y[:2])
    assert_same_bits(only_shared, y[:2].bfloat16(), "shared only")


# ----------------------------------------------------------------------------------------------
# GPU: model sizes, the public ops
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "e_global", "e_local", "k", "max_m"), [
    (128, 256, None, 8, 128),  # DeepSeek-V3 decode step
    (4096, 256, 32, 8, 1024),  # one EP rank of 8
    (16384, 256, None, 8, 1024),  # prefill, some experts overflow the masked buffer
])
def test_dispatch_model_sizes(t, e_global, e_local, k, max_m):
    d = make_dispatch_inputs(t, 7168, e_global, k, seed=t, device="cuda", skew=1.0)
    emap = make_expert_map(e_global, e_local, seed=1) if e_local else None
    e = e_local or e_global
    got = dispatch.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap)
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m, emap), max_m)
    got = dispatch.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, 128)
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, e, emap, 128)
    check_contiguous(got, want)
    # quantization + dispatch (without a map: in one scatter kernel, hardware FP8 conversion)
    for return_x in (True, False):
        x_fp8, x_scale, *got = dispatch.quant_dispatch_contiguous(d.x, d.topk_ids, e, emap, 128, return_x=return_x)
        check_contiguous(tuple(got), want)
        if return_x:
            assert_same_bits(x_fp8, d.x_fp8, "x_fp8")
            assert_same_bits(x_scale, d.x_scale, "x_scale")
        else:
            assert x_fp8 is None and x_scale is None
    y = randn((want[2].shape[0], 7168), seed=5, device="cuda")
    sh = randn((t, 7168), seed=6, device="cuda")
    assert_same_bits(dispatch.combine(y, got[3], d.topk_weights, sh), ref.combine(y, want[3], d.topk_weights, sh),
                     "combine")


@pytest.mark.gpu
def test_public_dispatch_ops_run_the_triton_kernels(monkeypatch):
    import moe_fp8
    from moe_fp8 import backends

    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    dev = torch.device("cuda", torch.cuda.current_device())
    # (the dispatches: on sm_90 the Hopper backend's own entries around these kernels, test_dispatch_hopper.py)
    name, impl = backends.select("combine", dev)
    assert name in ("hopper", "portable") and impl is dispatch.combine, name
    d = make_dispatch_inputs(64, 7168, 32, 8, seed=0, device="cuda")
    got = moe_fp8.layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 32, 64)
    check_masked(got, ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 32, 64), 64)
    x_fp8, x_scale, *fused = moe_fp8.layers.quant_dispatch_masked(d.x, d.topk_ids, 32, 64)
    assert_same_bits(x_fp8, d.x_fp8, "x_fp8")
    assert_same_bits(x_scale, d.x_scale, "x_scale")
    check_masked(tuple(fused), ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 32, 64), 64)
    got_c = moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 32)
    check_contiguous(got_c, ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 32))
    x_fp8, x_scale, *fused_c = moe_fp8.layers.quant_dispatch_contiguous(d.x, d.topk_ids, 32)
    assert_same_bits(x_fp8, d.x_fp8, "x_fp8")
    check_contiguous(tuple(fused_c), ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 32))
    y = randn((32, 64, 7168), seed=1, device="cuda")
    assert_same_bits(moe_fp8.layers.combine(y, got[3], d.topk_weights), ref.combine(y, got[3], d.topk_weights),
                     "combine")


def test_public_dispatch_contiguous_without_sync():
    """``moe_fp8.layers.dispatch_contiguous(sync=False)``: the upper-bound row count on every backend
    (the reference pads its exact layout), the same rows as the synced call, padding after them."""
    import moe_fp8

    d = make_dispatch_inputs(20, 256, 8, 3, seed=5, device=DEVICE)
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 8, None, 128)
    got = moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 8, sync=False)
    assert got[0].shape[0] == dispatch.contiguous_rows_bound(20, 3, 8, 128)
    check_contiguous_bound(got, want, 128)
    for sync in (False, True):
        *got, m_total = moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, 8, sync=sync,
                                                           return_m_total=True)
        check_m_total(m_total, want, d.x_fp8.device)
        (check_contiguous if sync else lambda g, w: check_contiguous_bound(g, w, 128))(tuple(got), want)
