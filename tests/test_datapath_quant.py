"""Triton per-token-group quantization and fused SiLU·mul+quant vs ``moe_fp8.reference``.

``per_token_group_quant``: FP8 bytes and FP32 scales identical (NaN = NaN). ``silu_mul``: the default
FP32 path within tolerance (``check_silu_close``: scales to 2**-18 relative, FP8 codes equal but for a
bounded count of one-step differences, dequantized diff per DESIGN §6, NaN / Inf groups identical);
``precise=True`` (float64) bit for bit. Scales in the TMA layout, masked rows untouched. Unmarked tests
run on CPU (Triton interpreter) and on the GPU; ``gpu`` tests use model sizes.
"""

from __future__ import annotations

import pytest
import torch
from datapath_util import DEVICE, assert_same_bits, check_silu_close, require_kernels

from moe_fp8 import reference as ref
from moe_fp8.testing import randn
from moe_fp8.utils import empty_scale_tma, is_scale_tma_layout

triton = pytest.importorskip("triton")
tl = triton.language

from moe_fp8.kernels.triton import common, quant  # noqa: E402  (after the importorskip)

pytestmark = [pytest.mark.datapath, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture(autouse=True)
def _kernels_run_here():
    require_kernels()


def check_quant(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                rows_mask: torch.Tensor | None = None) -> None:
    q, s = got
    rq, rs = want
    assert is_scale_tma_layout(s) and s.stride() == rs.stride()
    if rows_mask is not None:
        q, rq, s, rs = q[rows_mask], rq[rows_mask], s[rows_mask], rs[rows_mask]
    assert_same_bits(q, rq, "fp8 bytes")
    assert_same_bits(s, rs, "scales")


# ----------------------------------------------------------------------------------------------
# FP8 encoder and scale rounding
# ----------------------------------------------------------------------------------------------
@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, common.fp8_e4m3_code(x, NATIVE), mask=i < n)


@triton.jit
def _pow2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, common.round_up_pow2(tl.load(x_ptr + i, mask=i < n, other=1.0)), mask=i < n)


def encoder_inputs(device: str) -> torch.Tensor:
    """Every FP8 value, every rounding midpoint, one FP32 ulp either side of each, zeros and subnormals."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # drop the two NaN codes
    values = codes.view(torch.float8_e4m3fn).float().sort().values
    mids = (values[1:] + values[:-1]) / 2  # exact in float32
    bits = mids.view(torch.int32)
    around = torch.cat([(bits - 1).view(torch.float32), (bits + 1).view(torch.float32)])
    around = around[torch.isfinite(around)]  # the midpoint between -0 and +0 is 0: bits - 1 is a NaN
    tiny = torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-11, 1e-30, -1e-30, 2.0**-126, 1e-45])
    rnd = torch.empty(4096).uniform_(-448, 448, generator=torch.Generator().manual_seed(0))
    x = torch.cat([values, mids, around, tiny, rnd]).clamp(-448, 448)
    return x.to(device)


@pytest.mark.parametrize("native", [False, True])
def test_fp8_encoder_matches_torch(native):
    if native and not common.native_fp8(torch.device(DEVICE)):
        pytest.skip("the hardware FP8 conversion needs a compiled kernel on sm_89+")
    x = encoder_inputs(DEVICE)
    out = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), NATIVE=native, BLOCK=1024)
    assert_same_bits(out, x.to(torch.float8_e4m3fn).view(torch.uint8), "fp8 codes")


def test_round_up_pow2_matches_reference():
    s = torch.tensor([2.0**-149, 3 * 2.0**-140, 2.0**-127, 1.1754942e-38, 2.0**-126, 1.0, 1.5, 2.0, 3.0,
                      0.75, 448.0 / 448.0, 5e-13, 1e-10 / 448, 3.4e38, float("inf")]).to(DEVICE)
    out = torch.empty_like(s)
    _pow2_kernel[(1,)](s, out, s.numel(), BLOCK=16)
    assert_same_bits(out, ref._round_up_pow2(s), "powers of two")


# ----------------------------------------------------------------------------------------------
# per_token_group_quant
# ----------------------------------------------------------------------------------------------
QUANT_CASES = [  # shape, group_size, dtype
    ((1, 128), 128, torch.bfloat16),
    ((7, 256), 128, torch.bfloat16),
    ((5, 576), 128, torch.bfloat16),  # partial last group (576 = 4.5 × 128)
    ((3, 4, 272), 128, torch.bfloat16),  # [G, M, K], partial group
    ((6, 192), 64, torch.float16),
    ((4, 96), 48, torch.float32),  # group size not a power of two
    ((9, 16), 128, torch.bfloat16),  # K smaller than one group
]


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(("shape", "group_size", "dtype"), QUANT_CASES)
def test_per_token_group_quant_matches_reference(shape, group_size, dtype, ue8m0):
    x = randn(shape, seed=sum(shape) + group_size, device=DEVICE, dtype=dtype) * 3
    got = quant.per_token_group_quant(x, group_size, ue8m0, 1e-10)
    check_quant(got, ref.per_token_group_quant(x, group_size, ue8m0))


def test_per_token_group_quant_non_finite_and_tiny_groups():
    x = randn((6, 384), seed=3, device=DEVICE)
    x[0, 5] = float("nan")  # NaN group: NaN scale, all NaN codes
    x[1, 130] = float("inf")  # Inf group: +Inf scale, all NaN codes
    x[2, 300] = -float("inf")
    x[3, :] = 0.0  # zero group: scale eps/448, zero codes
    x[4, 128:256] = -0.0  # negative zeros keep their sign bit
    x[5, 256:] = 1e-20  # below eps
    for ue8m0 in (False, True):
        got = quant.per_token_group_quant(x, 128, ue8m0, 1e-10)
        check_quant(got, ref.per_token_group_quant(x, 128, ue8m0))
    got = quant.per_token_group_quant(x, 128, False, 1e-30)  # a different eps reaches the scale
    check_quant(got, ref.per_token_group_quant(x, 128, False, eps=1e-30))


def test_per_token_group_quant_tiny_scales():
    """Scales below 2**-64 (a tiny eps) divide lifted values (common.quantize_exact): codes still exact, also
    for elements far below the group's amax and subnormal ones (FP32: the interpreter widens subnormal bf16
    wrongly)."""
    x = randn((5, 512), seed=5, device=DEVICE, dtype=torch.float32)
    for i, mag in enumerate((1e-12, 1e-19, 1e-25, 1e-33, 1e-37)):
        x[i] *= mag
    x[:, ::7] *= 1e-6
    for ue8m0 in (False, True):
        got = quant.per_token_group_quant(x, 128, ue8m0, 1e-44)
        check_quant(got, ref.per_token_group_quant(x, 128, ue8m0, eps=1e-44))


def test_per_token_group_quant_writes_into_given_buffers_and_handles_m0():
    x = randn((5, 256), seed=1, device=DEVICE)
    out = torch.empty((5, 256), dtype=torch.float8_e4m3fn, device=DEVICE)
    out_scale = empty_scale_tma(5, 2, device=DEVICE)
    q, s = quant.per_token_group_quant(x, 128, False, 1e-10, out=out, out_scale=out_scale)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == out_scale.data_ptr()
    check_quant((q, s), ref.per_token_group_quant(x))
    with pytest.raises(ValueError, match="out_scale must be float32"):
        quant.per_token_group_quant(x, 128, False, 1e-10, out_scale=torch.empty(5, 2, device=DEVICE))
    q, s = quant.per_token_group_quant(x[:0], 128, False, 1e-10)
    assert q.shape == (0, 256) and s.shape == (0, 2) and is_scale_tma_layout(s)


# ----------------------------------------------------------------------------------------------
# silu_mul_per_token_group_quant
# ----------------------------------------------------------------------------------------------
def silu_inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return randn(shape, seed=seed, device=DEVICE, dtype=torch.float32).mul(2).to(dtype)


@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize(("shape", "ue8m0", "dtype"), [
    ((16, 512), False, torch.bfloat16),
    ((9, 640), True, torch.bfloat16),  # I = 320: partial last group
    ((2, 5, 256), False, torch.float16),  # [G, max_m, 2I] without a mask
    ((6, 256), False, torch.float32),
])
def test_silu_mul_quant_matches_reference(shape, ue8m0, dtype, precise):
    h = silu_inputs(shape, seed=sum(shape), dtype=dtype)
    got = quant.silu_mul_per_token_group_quant(h, 128, ue8m0, None, 1e-10, precise=precise)
    want = ref.silu_mul_per_token_group_quant(h, 128, ue8m0)
    if precise:
        check_quant(got, want)
    else:
        check_silu_close(got, want)


@pytest.mark.parametrize("precise", [False, True])
def test_silu_mul_quant_non_finite_and_extreme_inputs(precise):
    """NaN / Inf groups as the reference, |gate| beyond exp's range, zeros, tiny values."""
    h = silu_inputs((12, 512), seed=12)
    h[0, 3] = float("nan")
    h[1, 300] = float("inf")  # up = +Inf
    h[2, 7] = -float("inf")  # gate = -Inf: silu = NaN
    h[3, 20] = 70.0
    h[4, 21] = -90.0  # exp(90) overflows FP32: silu -> -0.0 (reference: a tiny value, also code 0)
    h[5, :] = 0.0
    h[6, 100] = -0.0
    h[7, 10] = 1e-38
    h[8, 256:] = 0.0  # up = 0: exact zeros
    h[9, 128:256] = 1e-30  # a group far below eps
    for ue8m0 in (False, True):
        got = quant.silu_mul_per_token_group_quant(h, 128, ue8m0, None, 1e-10, precise=precise)
        want = ref.silu_mul_per_token_group_quant(h, 128, ue8m0)
        if precise:
            check_quant(got, want)
        else:
            check_silu_close(got, want)


def test_silu_close_checker_catches_errors():
    """The tolerance check must fail on a wrong scale, a code two steps off, or many one-step flips."""
    h = silu_inputs((8, 512), seed=3)
    q, s = ref.silu_mul_per_token_group_quant(h)
    check_silu_close((q, s), (q, s))
    bad_s = s.clone()
    bad_s[2, 1] *= 1 + 2.0**-16
    with pytest.raises(AssertionError, match="scales"):
        check_silu_close((q, bad_s), (q, s))
    codes = q.view(torch.uint8).clone()
    codes[1, 5] = (codes[1, 5] & 0x80) | ((codes[1, 5] & 0x7F) ^ 0x02)
    with pytest.raises(AssertionError, match=r"more than one step|differ"):
        check_silu_close((codes.view(torch.float8_e4m3fn), s), (q, s))
    many = q.view(torch.uint8).clone()
    many[:, ::3] = (many[:, ::3] & 0x80) | ((many[:, ::3] & 0x7F) ^ 0x01)
    with pytest.raises(AssertionError, match="FP8 codes differ"):
        check_silu_close((many.view(torch.float8_e4m3fn), s), (q, s))


def test_silu_mul_quant_masked_rows_untouched():
    g, max_m, two_i = 5, 6, 512
    h = silu_inputs((g, max_m, two_i), seed=5)
    masked_m = torch.tensor([0, 3, 6, 1, 2], dtype=torch.int32, device=DEVICE)
    poison_q = torch.full((g, max_m, two_i // 2), 0x5A, dtype=torch.uint8, device=DEVICE)
    out = poison_q.clone().view(torch.float8_e4m3fn)
    out_scale = empty_scale_tma(max_m, 2, groups=g, device=DEVICE)
    out_scale.fill_(-7.0)
    q, s = quant.silu_mul_per_token_group_quant(h, 128, False, masked_m, 1e-10, out=out, out_scale=out_scale)
    valid = torch.arange(max_m, device=DEVICE)[None, :] < masked_m[:, None]
    check_silu_close((q, s), ref.silu_mul_per_token_group_quant(h, 128, False, masked_m), rows_mask=valid)
    assert (q.view(torch.uint8)[~valid] == 0x5A).all(), "rows past masked_m were written"
    assert (s[~valid] == -7.0).all(), "scales past masked_m were written"
    # a config whose programs loop over several row blocks (what a large masked buffer does)
    from moe_fp8.kernels.triton.configs import QuantConfig

    out2 = poison_q.clone().view(torch.float8_e4m3fn)
    cfg = QuantConfig(block_r=1, block_g=1, gs_p2=128, num_warps=4, row_programs=2)
    q2, s2 = quant.silu_mul_per_token_group_quant(h, 128, False, masked_m, 1e-10, out=out2, config=cfg)
    assert_same_bits(q2.view(torch.uint8)[valid], q.view(torch.uint8)[valid], "looped config")
    assert_same_bits(s2[valid], s[valid], "looped config scales")
    assert (q2.view(torch.uint8)[~valid] == 0x5A).all()
    # several rows per block: a block's rows span group boundaries (flat rows 0-3 are in groups 1 and 2)
    out3 = poison_q.clone().view(torch.float8_e4m3fn)
    cfg = QuantConfig(block_r=4, block_g=2, gs_p2=128, num_warps=4, row_programs=2)
    q3, s3 = quant.silu_mul_per_token_group_quant(h, 128, False, masked_m, 1e-10, out=out3, config=cfg)
    assert_same_bits(q3.view(torch.uint8)[valid], q.view(torch.uint8)[valid], "4-row blocks")
    assert_same_bits(s3[valid], s[valid], "4-row blocks scales")
    assert (q3.view(torch.uint8)[~valid] == 0x5A).all()
    # max_m = 0 and all-empty groups
    empty = torch.zeros(g, dtype=torch.int32, device=DEVICE)
    q, s = quant.silu_mul_per_token_group_quant(h, 128, False, empty, 1e-10, out=out, out_scale=out_scale)
    assert (q.view(torch.uint8)[~valid] == 0x5A).all()


def test_silu_mul_quant_2d_row_count():
    """A 2-D ``h`` with ``masked_m [1]`` (a sync-free contiguous layout's device row count): rows below it
    as the reference, rows from it on untouched; 0 and every row too."""
    m, two_i = 37, 512
    h = silu_inputs((m, two_i), seed=8)
    for rows in (0, 1, 20, m):
        count = torch.tensor([rows], dtype=torch.int32, device=DEVICE)
        out = torch.full((m, two_i // 2), 0x5A, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
        out_scale = empty_scale_tma(m, 2, device=DEVICE)
        out_scale.fill_(-7.0)
        q, s = quant.silu_mul_per_token_group_quant(h, 128, False, count, 1e-10, out=out, out_scale=out_scale)
        want = ref.silu_mul_per_token_group_quant(h, 128, False, count)
        assert want[1].stride() == s.stride()
        valid = torch.arange(m, device=DEVICE) < rows
        check_silu_close((q, s), want, rows_mask=valid)
        assert (q.view(torch.uint8)[rows:] == 0x5A).all() and (s[rows:] == -7.0).all(), rows


# ----------------------------------------------------------------------------------------------
# GPU: model sizes and the backend wiring
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(4096, 7168), (333, 7168), (2, 64, 2048), (1, 576)])
def test_per_token_group_quant_model_sizes(shape, ue8m0):
    for seed in (0, 1):
        x = randn(shape, seed=seed, device="cuda") * (1 + seed)
        check_quant(quant.per_token_group_quant(x, 128, ue8m0, 1e-10), ref.per_token_group_quant(x, 128, ue8m0))


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(4096, 4096), (777, 2 * 2048), (3000, 2 * 1408)])
def test_silu_mul_quant_model_sizes(shape, ue8m0):
    h = randn(shape, seed=7, device="cuda", dtype=torch.float32).mul(2.5).bfloat16()
    want = ref.silu_mul_per_token_group_quant(h, 128, ue8m0)
    check_silu_close(quant.silu_mul_per_token_group_quant(h, 128, ue8m0, None, 1e-10), want)
    check_quant(quant.silu_mul_per_token_group_quant(h, 128, ue8m0, None, 1e-10, precise=True), want)


@pytest.mark.gpu
def test_silu_mul_quant_masked_decode_buffer():
    """DeepSeek-V3 decode: 256 experts × max_m 128 × 2I = 4096, a few rows each, poisoned outputs."""
    g, max_m, two_i = 256, 128, 4096
    h = randn((g, max_m, two_i), seed=3, device="cuda")
    counts = torch.randint(0, 9, (g,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    counts[:3] = torch.tensor([0, max_m, 1])
    masked_m = counts.cuda()
    out = torch.full((g, max_m, two_i // 2), 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    out_scale = empty_scale_tma(max_m, two_i // 256, groups=g, device="cuda")
    out_scale.fill_(-7.0)
    q, s = quant.silu_mul_per_token_group_quant(h, 128, False, masked_m, 1e-10, out=out, out_scale=out_scale)
    valid = torch.arange(max_m, device="cuda")[None, :] < masked_m[:, None]
    check_silu_close((q, s), ref.silu_mul_per_token_group_quant(h, 128, False, masked_m), rows_mask=valid)
    assert (q.view(torch.uint8)[~valid] == 0x5A).all() and (s[~valid] == -7.0).all()


@pytest.mark.gpu
def test_public_quant_ops_run_the_gpu_kernels(monkeypatch):
    import moe_fp8
    from moe_fp8 import backends

    monkeypatch.setenv("MOE_FP8_STRICT", "1")  # a fallback to the reference would raise
    from moe_fp8.kernels import quant as hopper_quant

    for op, fn in [("per_token_group_quant", quant.per_token_group_quant),
                   ("silu_mul_per_token_group_quant", quant.silu_mul_per_token_group_quant)]:
        name, impl = backends.select(op, torch.device("cuda", torch.cuda.current_device()))
        if name == "hopper":  # the CUDA kernels' wrappers (tests/test_quant_hopper.py), Triton outside their cases
            fn = getattr(hopper_quant, f"{op}_hopper")
        assert name in ("hopper", "portable") and impl is fn, (op, name, impl)
    x = randn((64, 7168), seed=0, device="cuda")
    check_quant(moe_fp8.quant.per_token_group(x), ref.per_token_group_quant(x))
    h = randn((3, 8, 4096), seed=1, device="cuda")
    mm = torch.tensor([8, 0, 5], dtype=torch.int32, device="cuda")
    valid = torch.arange(8, device="cuda")[None, :] < mm[:, None]
    check_silu_close(moe_fp8.quant.silu_mul_per_token_group(h, masked_m=mm),
                     ref.silu_mul_per_token_group_quant(h, masked_m=mm), rows_mask=valid)
