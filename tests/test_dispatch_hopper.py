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

