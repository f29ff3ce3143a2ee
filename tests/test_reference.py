"""Tests of the PyTorch oracle (moe_fp8.reference): quantization, GEMMs, SiLU·mul.

Each op is checked against an independent formulation (Python loops over groups, float64
products, explicit index arithmetic), so a bug in the oracle cannot hide behind itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8 import reference as ref
from moe_fp8.testing import make_contiguous_inputs, make_gemm_inputs, make_masked_inputs, randn
from moe_fp8.utils import FP8_DTYPE, FP8_MAX, calc_diff, ceil_div, get_tma_aligned_m, is_scale_tma_layout

EPS = 1e-10
# e4m3: 3 mantissa bits → round-to-nearest relative error ≤ 2^-4 for normals; subnormals (below
# 2^-6 in FP8 units) have a fixed spacing of 2^-9, i.e. an absolute error ≤ 2^-10 · scale.
FP8_REL = 2.0**-4
FP8_SUBNORMAL_ABS = 2.0**-10

SETTINGS = settings(max_examples=25, deadline=None)


# ----------------------------------------------------------------------------------------------
# Independent helpers (loops / index arithmetic, unlike the repeat_interleave in the reference)
# ----------------------------------------------------------------------------------------------
def loop_token_scales(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``max(amax, eps)/448`` per row per K group, with a Python loop over groups; x is [..., M, K]."""
    k = x.shape[-1]
    cols = []
    for start in range(0, k, group_size):
        amax = x[..., start:start + group_size].float().abs().amax(dim=-1)
        cols.append(torch.clamp(amax, min=EPS) / FP8_MAX)
    return torch.stack(cols, dim=-1)


def loop_block_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(ceil_div(n, bn), ceil_div(k, bk))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            out[i, j] = max(block.abs().max().item(), EPS) / FP8_MAX
    return out


def index_dequant_tokens(x_fp8: torch.Tensor, x_scale: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """Exact (float64) dequantization by explicit column → group index; ``.float()`` of it is what
    one correctly rounded FP32 multiply gives (an FP8 × FP32 product has ≤ 28 significant bits)."""
    groups = torch.arange(x_fp8.shape[-1]) // group_size
    return x_fp8.double() * x_scale.double()[..., groups]


def index_dequant_blocks(w_fp8: torch.Tensor, w_scale: torch.Tensor, bn: int = 128, bk: int = 128) -> torch.Tensor:
    rows = torch.arange(w_fp8.shape[-2]) // bn
    cols = torch.arange(w_fp8.shape[-1]) // bk
    return w_fp8.double() * w_scale.double()[..., rows[:, None], cols[None, :]]


def assert_fp8_round_trip(x: torch.Tensor, x_fp8: torch.Tensor, scale_full: torch.Tensor) -> None:
    """|dequant − x| within the e4m3 rounding bound, element by element."""
    err = (x_fp8.double() * scale_full.double() - x.double()).abs()
    bound = FP8_REL * x.double().abs() + FP8_SUBNORMAL_ABS * scale_full.double() + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def is_pow2(t: torch.Tensor) -> bool:
    mantissa, _ = torch.frexp(t)
    return bool((mantissa == 0.5).all())


def assert_bf16_close(out: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor,
                      rel: float = 2.0**-8) -> None:
    """``out`` (bf16) within ``rel`` of ``expected`` plus FP32-accumulation slack of ``magnitude``.

    ``rel = 2^-8`` is one bf16 rounding of an exact value; comparing two bf16 results that were
    rounded from slightly different FP32 sums needs one ulp, ``2^-7``.
    """
    err = (out.double() - expected.double()).abs()
    bound = rel * expected.double().abs() + 1e-5 * magnitude.double() + 1e-30
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


# ----------------------------------------------------------------------------------------------
# per_token_group_quant
# ----------------------------------------------------------------------------------------------
@SETTINGS
@given(
    m=st.sampled_from([0, 1, 5, 130]),
    k=st.sampled_from([1, 16, 128, 200, 576]) | st.integers(1, 300),
    groups=st.sampled_from([None, 1, 3]),
    group_size=st.sampled_from([128, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    ue8m0=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_per_token_group_quant(m, k, groups, group_size, dtype, ue8m0, seed):
    shape = (m, k) if groups is None else (groups, m, k)
    x = randn(shape, seed=seed, dtype=dtype) * 3.0
    x_fp8, x_scale = ref.per_token_group_quant(x, group_size=group_size, ue8m0=ue8m0)

    kg = ceil_div(k, group_size)
    assert x_fp8.dtype == FP8_DTYPE and x_fp8.shape == x.shape and x_fp8.is_contiguous()
    assert x_scale.dtype == torch.float32 and x_scale.shape == (*shape[:-1], kg)
    # NOTE: utils.is_scale_tma_layout is False for M = 0 (torch gives empty tensors unit strides).
    assert m == 0 or is_scale_tma_layout(x_scale)
    if m > 1 and kg > 1:  # strides of size-0/1 dims are meaningless
        assert x_scale.stride()[-2:] == (1, get_tma_aligned_m(m))

    plain = loop_token_scales(x, group_size)
    if ue8m0:
        assert is_pow2(x_scale)
        assert bool((x_scale >= plain).all()) and bool((x_scale < 2 * plain).all())
    else:
        assert torch.equal(x_scale, plain)  # exactly the definition
        # The group's amax element lands exactly on ±448.
        q_amax = loop_token_scales(x_fp8.float(), group_size) * FP8_MAX
        assert bool((q_amax == FP8_MAX).all())
    groups_of_col = torch.arange(k) // group_size
    assert_fp8_round_trip(x, x_fp8, x_scale[..., groups_of_col])
    # dequant is the same product
    deq = ref.dequant_per_token_group(x_fp8, x_scale, group_size)
    assert deq.dtype == torch.float32
    assert torch.equal(deq, index_dequant_tokens(x_fp8, x_scale, group_size).float())


def test_per_token_group_quant_3d_matches_2d():
    x = randn((3, 5, 200), seed=1)
    x_fp8, x_scale = ref.per_token_group_quant(x)
    assert x_scale.stride() == (2 * 8, 1, 8)  # [G, M, KG] with M padded 5 → 8
    for g in range(3):
        q2, s2 = ref.per_token_group_quant(x[g])
        assert torch.equal(x_fp8[g].view(torch.uint8), q2.view(torch.uint8))
        assert torch.equal(x_scale[g], s2)


def test_per_token_group_quant_exact_values():
    # amax 448 → scale exactly 1 → representable values survive unchanged.
    row = torch.tensor([448.0, -2.0, 0.5, 3.0, -448.0, 1.125, 0.0, 6.0])
    x_fp8, x_scale = ref.per_token_group_quant(row[None], group_size=8)
    assert x_scale.item() == 1.0
    assert torch.equal(x_fp8.float()[0], row)
    # amax 7 → scale 7/448 = 1/64, ue8m0 keeps it (already a power of two); 7.5 → rounds up to 1/32.
    _, s = ref.per_token_group_quant(torch.tensor([[7.0, 1.0]]), ue8m0=True)
    assert s.item() == 2.0**-6
    _, s = ref.per_token_group_quant(torch.tensor([[7.5, 1.0]]), ue8m0=True)
    assert s.item() == 2.0**-5


def test_per_token_group_quant_zero_group_uses_eps():
    x = torch.zeros(2, 256)
    x[1, 200] = 1.0
    x_fp8, x_scale = ref.per_token_group_quant(x)
    expected = torch.tensor([[EPS, EPS], [EPS, 1.0]], dtype=torch.float32) / FP8_MAX
    assert torch.equal(x_scale, expected)
    assert torch.equal(x_fp8.float()[0], torch.zeros(256))
    assert x_fp8.float()[1, 200].item() == FP8_MAX


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_group_quant_non_finite(bad, ue8m0):
    x = randn((4, 300), seed=3)
    poisoned = x.clone()
    poisoned[2, 150] = bad  # group 1 of row 2
    x_fp8, x_scale = ref.per_token_group_quant(poisoned, ue8m0=ue8m0)
    clean_fp8, clean_scale = ref.per_token_group_quant(x, ue8m0=ue8m0)

    bad_scale = x_scale[2, 1].item()
    if math.isnan(bad):
        assert math.isnan(bad_scale)
    else:
        assert bad_scale == math.inf
    assert bool(x_fp8.float()[2, 128:256].isnan().all())  # the whole group, never finite garbage
    # every other group is untouched
    keep = torch.ones(4, 300, dtype=torch.bool)
    keep[2, 128:256] = False
    assert torch.equal(x_fp8.view(torch.uint8)[keep], clean_fp8.view(torch.uint8)[keep])
    scale_keep = torch.ones(4, 3, dtype=torch.bool)
    scale_keep[2, 1] = False
    assert torch.equal(x_scale[scale_keep], clean_scale[scale_keep])
    # NaN reaches the product
    w_fp8, w_scale = ref.per_block_quant(randn((64, 300), seed=4))
    out = ref.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale)
    assert bool(out[2].isnan().all()) and bool(out[[0, 1, 3]].isfinite().all())


def test_per_token_group_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be"):
        ref.per_token_group_quant(torch.randn(2, 3, 4, 5))
    with pytest.raises(ValueError, match="group_size"):
        ref.per_token_group_quant(torch.randn(2, 8), group_size=0)
    x_fp8, x_scale = ref.per_token_group_quant(torch.randn(3, 200))
    with pytest.raises(ValueError, match="x_scale must have shape"):
        ref.dequant_per_token_group(x_fp8, x_scale[:, :1])


# ----------------------------------------------------------------------------------------------
# per_block_quant
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_block_quant_ragged_deepseek_shape(ue8m0):
    w = randn((2112, 576), seed=5)
    w_fp8, w_scale = ref.per_block_quant(w, ue8m0=ue8m0)
    assert w_fp8.dtype == FP8_DTYPE and w_fp8.shape == w.shape
    assert w_scale.shape == (17, 5) and w_scale.is_contiguous() and w_scale.dtype == torch.float32
    plain = loop_block_scales(w, 128, 128)
    if ue8m0:
        assert is_pow2(w_scale) and bool((w_scale >= plain).all()) and bool((w_scale < 2 * plain).all())
    else:
        assert torch.equal(w_scale, plain)
    rows, cols = torch.arange(2112) // 128, torch.arange(576) // 128
    assert_fp8_round_trip(w, w_fp8, w_scale[rows[:, None], cols[None, :]])
    assert torch.equal(ref.dequant_per_block(w_fp8, w_scale), index_dequant_blocks(w_fp8, w_scale).float())


@SETTINGS
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 300),
    groups=st.sampled_from([None, 1, 2]),
    block=st.sampled_from([(128, 128), (64, 32)]),
    seed=st.integers(0, 2**16),
)
def test_per_block_quant_shapes(n, k, groups, block, seed):
    shape = (n, k) if groups is None else (groups, n, k)
    w = randn(shape, seed=seed)
    w_fp8, w_scale = ref.per_block_quant(w, block)
    bn, bk = block
    assert w_scale.shape == (*shape[:-2], ceil_div(n, bn), ceil_div(k, bk)) and w_scale.is_contiguous()
    slices = [(w, w_fp8, w_scale)] if groups is None else list(zip(w, w_fp8, w_scale, strict=True))
    for w2, q2, s2 in slices:
        assert torch.equal(s2, loop_block_scales(w2, bn, bk))
        rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
        assert_fp8_round_trip(w2, q2, s2[rows[:, None], cols[None, :]])
    deq = ref.dequant_per_block(w_fp8, w_scale, block)
    assert torch.equal(deq, index_dequant_blocks(w_fp8, w_scale, bn, bk).float())


def test_per_block_quant_nan_block():
    w = randn((256, 256), seed=6)
    w[200, 10] = float("nan")
    w_fp8, w_scale = ref.per_block_quant(w)
    assert math.isnan(w_scale[1, 0].item()) and bool(w_scale.flatten()[[0, 1, 3]].isfinite().all())
    assert bool(w_fp8.float()[128:, :128].isnan().all())
    assert not bool(w_fp8.float()[:128].isnan().any())


# ----------------------------------------------------------------------------------------------
# fp8_gemm
# ----------------------------------------------------------------------------------------------
@SETTINGS
@given(
    m=st.sampled_from([0, 1, 7, 130]),
    n=st.sampled_from([1, 64, 200, 2112]),
    k=st.sampled_from([16, 128, 200, 576]),
    seed=st.integers(0, 2**16),
)
def test_fp8_gemm_vs_float64(m, n, k, seed):
    inp = make_gemm_inputs(m, n, k, seed)
    out = ref.fp8_gemm(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    x64 = index_dequant_tokens(inp.x_fp8, inp.x_scale)
    w64 = index_dequant_blocks(inp.w_fp8, inp.w_scale)
    assert_bf16_close(out, x64 @ w64.T, x64.abs() @ w64.abs().T)
    if m * n >= 2000 and k >= 128:
        # Against the unquantized bf16 product (DESIGN §6). Random-normal FP8 products sit near
        # diff ≈ 6e-4, so only enough outputs make the estimate stable enough for 1e-3.
        assert calc_diff(out, inp.x.double() @ inp.w.double().T) < 1e-3


def test_fp8_gemm_detects_wrong_scale_layout_reading():
    # If the reference read the TMA scale buffer as if it were row-major, M=5 (padded to 8) would
    # mix rows: this test would catch it.
    inp = make_gemm_inputs(5, 64, 384, seed=9)
    contiguous_scale = inp.x_scale.contiguous()
    assert not torch.equal(torch.as_strided(inp.x_scale, (5, 3), (3, 1)), contiguous_scale)
    out_tma = ref.fp8_gemm(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
    out_rm = ref.fp8_gemm(inp.x_fp8, contiguous_scale, inp.w_fp8, inp.w_scale)
    assert torch.equal(out_tma, out_rm)


def test_fp8_gemm_rejects_k_mismatch():
    a = make_gemm_inputs(4, 64, 256, seed=1)
    b = make_gemm_inputs(4, 64, 128, seed=2)
    with pytest.raises(ValueError, match="K mismatch"):
        ref.fp8_gemm(a.x_fp8, a.x_scale, b.w_fp8, b.w_scale)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------
@SETTINGS
@given(
    num_groups=st.integers(1, 8),
    expected_m=st.integers(1, 40),
    n=st.sampled_from([64, 200]),
    k=st.sampled_from([128, 200]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_grouped_contiguous_matches_per_group_gemm(num_groups, expected_m, n, k, data, seed):
    num_empty = data.draw(st.integers(0, num_groups - 1))
    align_m = data.draw(st.sampled_from([128, 16]))
    inp = make_contiguous_inputs(num_groups, expected_m, n, k, seed, num_empty=num_empty, align_m=align_m)
    out = torch.full((inp.x.shape[0], n), float("nan"), dtype=torch.bfloat16)
    ret = ref.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out=out)
    assert ret is out
    assert torch.equal(ref.fp8_grouped_gemm_contiguous(
        inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices), out)
    for g, (start, size) in enumerate(zip(inp.group_starts, inp.group_sizes, strict=True)):
        rows = slice(start, start + size)
        expected = ref.fp8_gemm(inp.x_fp8[rows], inp.x_scale[rows], inp.w_fp8[g], inp.w_scale[g])
        x64 = index_dequant_tokens(inp.x_fp8[rows], inp.x_scale[rows])
        w64 = index_dequant_blocks(inp.w_fp8[g], inp.w_scale[g])
        assert_bf16_close(out[rows], x64 @ w64.T, x64.abs() @ w64.abs().T)
        assert_bf16_close(out[rows], expected, x64.abs() @ w64.abs().T, rel=2.0**-7)
    padding = inp.m_indices == -1
    assert int(padding.sum()) == inp.x.shape[0] - sum(inp.group_sizes)
    assert bool((out[padding] == 0).all())


def test_grouped_contiguous_invalid_ids_are_nan():
    inp = make_contiguous_inputs(2, 4, 64, 128, seed=3, align_m=4, group_sizes=[4, 4])
    ids = inp.m_indices.clone()
    ids[1], ids[6] = 2, -5
    out = ref.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, ids)
    assert bool(out[[1, 6]].isnan().all())
    assert bool(out[[0, 2, 3, 4, 5, 7]].isfinite().all())


@SETTINGS
@given(
    num_groups=st.integers(1, 6),
    max_m=st.integers(1, 40),
    n=st.sampled_from([64, 200]),
    k=st.sampled_from([128, 200]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_grouped_masked_matches_per_group_gemm(num_groups, max_m, n, k, data, seed):
    counts = data.draw(st.lists(st.integers(0, max_m), min_size=num_groups, max_size=num_groups))
    counts[0] = data.draw(st.sampled_from([0, max_m]))  # always exercise an edge
    inp = make_masked_inputs(num_groups, max_m, max(1, max_m // 2), n, k, seed, masked_m=counts)
    out = torch.full((num_groups, max_m, n), float("nan"), dtype=torch.bfloat16)
    ret = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, out=out)
    assert ret is out
    fresh = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m)
    for g, m in enumerate(counts):
        expected = ref.fp8_gemm(inp.x_fp8[g, :m], inp.x_scale[g, :m], inp.w_fp8[g], inp.w_scale[g])
        x64 = index_dequant_tokens(inp.x_fp8[g, :m], inp.x_scale[g, :m])
        w64 = index_dequant_blocks(inp.w_fp8[g], inp.w_scale[g])
        assert_bf16_close(out[g, :m], x64 @ w64.T, x64.abs() @ w64.abs().T)
        assert_bf16_close(out[g, :m], expected, x64.abs() @ w64.abs().T, rel=2.0**-7)
        assert torch.equal(fresh[g, :m], out[g, :m])
        assert bool(out[g, m:].isnan().all())  # poisoned rows untouched
        assert bool((fresh[g, m:] == 0).all())


def test_grouped_masked_clamps_masked_m():
    inp = make_masked_inputs(2, 8, 4, 64, 128, seed=2, masked_m=[8, 3])
    over = torch.tensor([50, 3], dtype=torch.int32)
    a = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m)
    b = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, over)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# SiLU·mul (+ quant)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 256), (5, 256), (3, 7, 400), (2, 2)])
def test_silu_mul(shape):
    h = randn(shape, seed=11) * 4
    y = ref.silu_mul(h)
    i = shape[-1] // 2
    gate, up = h[..., :i].double(), h[..., i:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], i)
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-6)


def test_silu_mul_rejects_odd():
    with pytest.raises(ValueError, match="even"):
        ref.silu_mul(torch.randn(3, 5))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_silu_mul_quant_2d(ue8m0):
    h = randn((9, 2 * 200), seed=12)
    y_fp8, y_scale = ref.silu_mul_per_token_group_quant(h, ue8m0=ue8m0)
    e_fp8, e_scale = ref.per_token_group_quant(ref.silu_mul(h), ue8m0=ue8m0)
    assert is_scale_tma_layout(y_scale) and y_scale.shape == (9, 2)
    assert torch.equal(y_fp8.view(torch.uint8), e_fp8.view(torch.uint8))
    assert torch.equal(y_scale, e_scale)


def test_silu_mul_quant_masked():
    g, max_m, i = 4, 6, 256
    h = randn((g, max_m, 2 * i), seed=13)
    masked_m = torch.tensor([0, 6, 3, 1], dtype=torch.int32)
    for e, m in enumerate(masked_m.tolist()):
        h[e, m:] = float("nan")  # garbage past masked_m must not leak
    y_fp8, y_scale = ref.silu_mul_per_token_group_quant(h, masked_m=masked_m)
    assert is_scale_tma_layout(y_scale) and y_scale.shape == (g, max_m, 2)
    for e, m in enumerate(masked_m.tolist()):
        e_fp8, e_scale = ref.per_token_group_quant(ref.silu_mul(h[e, :m]))
        assert torch.equal(y_fp8[e, :m].view(torch.uint8), e_fp8.view(torch.uint8))
        assert torch.equal(y_scale[e, :m], e_scale)
        assert torch.equal(y_fp8[e, m:].view(torch.uint8), torch.zeros(max_m - m, i, dtype=torch.uint8))
        assert bool((y_scale[e, m:] == 1.0).all())
    with pytest.raises(ValueError, match="masked_m"):
        ref.silu_mul_per_token_group_quant(h[0], masked_m=masked_m)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_grouped_gemm_silu_mul_quant_is_the_unrounded_composition(ue8m0):
    """The fused GEMM1 + activation oracle: the grouped GEMM's FP32 product, not rounded to bf16, through
    silu_mul_per_token_group_quant; contiguous and masked agree row for row."""
    inp = make_contiguous_inputs(3, 20, 512, 384, seed=21, num_empty=1)
    act, scale = ref.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                     m_indices=inp.m_indices, ue8m0=ue8m0)
    assert act.shape == (inp.x_fp8.shape[0], 256) and is_scale_tma_layout(scale) and scale.shape[-1] == 2
    x = ref.dequant_per_token_group(inp.x_fp8, inp.x_scale)
    valid = inp.m_indices >= 0
    for g in range(3):
        rows = inp.m_indices == g
        # the product as the oracle's matmuls take it on the CPU: float64 sums rounded once to float32
        h = (x[rows].double() @ ref.dequant_per_block(inp.w_fp8[g], inp.w_scale[g]).double().t()).float()
        e_fp8, e_scale = ref.silu_mul_per_token_group_quant(h, ue8m0=ue8m0)
        # (a product over other rows may still round an ulp apart: scales to 1e-6, codes nearly all equal)
        assert torch.allclose(scale[rows], e_scale, rtol=1e-6, atol=0)
        assert int((act[rows].view(torch.uint8) != e_fp8.view(torch.uint8)).sum()) <= 0.005 * e_fp8.numel()
        # the same rows in the masked layout
        mx = torch.zeros(1, 32, inp.x_fp8.shape[1], dtype=inp.x_fp8.dtype)
        mx[0, :int(rows.sum())] = inp.x_fp8[rows]
        ms = ref.per_token_group_quant(torch.zeros(1, 32, inp.x_fp8.shape[1]))[1]
        ms[0, :int(rows.sum())] = inp.x_scale[rows]
        m_act, m_scale = ref.fp8_grouped_gemm_silu_mul_quant(mx, ms, inp.w_fp8[g:g + 1], inp.w_scale[g:g + 1],
                                                             masked_m=rows.sum().view(1).int(), ue8m0=ue8m0)
        n = int(rows.sum())
        assert int((m_act[0, :n].view(torch.uint8) != e_fp8.view(torch.uint8)).sum()) <= 0.005 * e_fp8.numel()
        assert torch.allclose(m_scale[0, :n], e_scale, rtol=1e-6, atol=0)
    assert bool(valid.any()) and bool((~valid).any())
    with pytest.raises(ValueError, match="exactly one"):
        ref.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
