"""``moe_fp8.fp8_grouped_gemm_silu_mul_quant``: an expert's first GEMM and its SiLU·mul + quant.

CPU (reference backend): the op is the grouped GEMM and ``silu_mul_per_token_group`` in turn, bit for
bit, in both layouts and into given destinations; bad arguments are refused before any work; it
compiles to its custom op. The fused Hopper kernel is checked against the unrounded oracle
(``reference.fp8_grouped_gemm_silu_mul_quant``) in tests/test_grouped_hopper.py.
"""

from __future__ import annotations

import pytest
import torch

import moe_fp8
from moe_fp8 import quant
from moe_fp8.testing import make_contiguous_inputs, make_masked_inputs
from moe_fp8.utils import empty_scale_tma, is_scale_tma_layout

FP8 = torch.float8_e4m3fn


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8 else torch.equal(a, b)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_contiguous_is_gemm_then_silu_mul_quant(ue8m0):
    inp = make_contiguous_inputs(3, 40, 512, 384, seed=3, num_empty=1)
    act, scale = moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                         m_indices=inp.m_indices, ue8m0=ue8m0)
    h = moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices)
    want = quant.silu_mul_per_token_group(h, ue8m0=ue8m0)
    assert act.shape == (inp.x_fp8.shape[0], 256) and is_scale_tma_layout(scale)
    assert _same(act, want[0]) and _same(scale, want[1])


def test_contiguous_m_total_ends_the_layout():
    """``m_total`` (a sync-free dispatch's device row count): rows below it as without it; rows from it on
    are never written although ``m_indices`` names real groups there. Also through the custom op."""
    inp = make_contiguous_inputs(3, 40, 512, 384, seed=4)
    full = moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                   m_indices=inp.m_indices)
    cut = inp.group_starts[2]
    m_total = torch.tensor([cut], dtype=torch.int32)
    for call in ("public", "custom_op"):
        out = torch.full((inp.x_fp8.shape[0], 256), 0x3C, dtype=torch.uint8).view(FP8)
        out_scale = empty_scale_tma(inp.x_fp8.shape[0], 2).fill_(float("nan"))
        if call == "public":
            got = moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                          m_indices=inp.m_indices, m_total=m_total, out=out,
                                                          out_scale=out_scale)
            assert got[0] is out and got[1] is out_scale
        else:
            torch.ops.moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                              inp.m_indices, None, 0, False, out, out_scale, m_total)
        assert _same(out[:cut], full[0][:cut]) and _same(out_scale[:cut], full[1][:cut])
        assert (out[cut:].view(torch.uint8) == 0x3C).all() and out_scale[cut:].isnan().all()
    with pytest.raises(ValueError, match="m_total ends a contiguous layout"):
        m = make_masked_inputs(2, 8, 4, 256, 256, seed=8)
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(m.x_fp8, m.x_scale, m.w_fp8, m.w_scale, masked_m=m.masked_m,
                                                expected_m=4, m_total=m_total)
    with pytest.raises(TypeError, match=r"m_total must be torch\.int32"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                m_indices=inp.m_indices, m_total=m_total.long())


def test_masked_into_destinations():
    inp = make_masked_inputs(4, 24, 10, 256, 512, seed=5, num_empty=1)
    out = torch.zeros(4, 24, 128, dtype=FP8)
    out_scale = empty_scale_tma(24, 1, groups=4).fill_(float("nan"))
    got = moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                  masked_m=inp.masked_m, expected_m=10, out=out, out_scale=out_scale)
    assert got[0] is out and got[1] is out_scale
    h = moe_fp8.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 10)
    want = quant.silu_mul_per_token_group(h, masked_m=inp.masked_m)
    for g, m in enumerate(inp.masked_m.tolist()):
        assert _same(out[g, :m], want[0][g, :m]) and _same(out_scale[g, :m], want[1][g, :m])
        assert (out[g, m:].view(torch.uint8) == 0).all() and out_scale[g, m:].isnan().all()  # left as given


def test_rejects_bad_arguments():
    inp = make_contiguous_inputs(2, 20, 512, 256, seed=7)
    args = (inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
    with pytest.raises(ValueError, match="exactly one of m_indices"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(*args)
    with pytest.raises(ValueError, match="exactly one of m_indices"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(*args, m_indices=inp.m_indices, masked_m=inp.m_indices)
    odd = make_contiguous_inputs(2, 20, 384, 256, seed=7)
    with pytest.raises(ValueError, match="multiple of 256"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(odd.x_fp8, odd.x_scale, odd.w_fp8, odd.w_scale,
                                                m_indices=odd.m_indices)
    with pytest.raises(TypeError, match="out"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(*args, m_indices=inp.m_indices,
                                                out=torch.empty(inp.x_fp8.shape[0], 256, dtype=torch.bfloat16))
    m = make_masked_inputs(2, 8, 4, 256, 256, seed=8)
    with pytest.raises(TypeError, match="expected_m must be an int"):
        moe_fp8.fp8_grouped_gemm_silu_mul_quant(m.x_fp8, m.x_scale, m.w_fp8, m.w_scale, masked_m=m.masked_m)


def test_compiles_to_the_custom_op():
    inp = make_masked_inputs(2, 8, 4, 256, 256, seed=9)

    def f(x_fp8, x_scale, w, w_scale, masked_m):
        return moe_fp8.fp8_grouped_gemm_silu_mul_quant(x_fp8, x_scale, w, w_scale, masked_m=masked_m, expected_m=4)

    eager = f(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                                     inp.masked_m)
    for g, m in enumerate(inp.masked_m.tolist()):
        assert _same(eager[0][g, :m], compiled[0][g, :m]) and _same(eager[1][g, :m], compiled[1][g, :m])
