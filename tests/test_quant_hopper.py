"""Hopper ``per_token_group_quant`` kernel (impls/token_group_quant.cuh), plain and fused with SiLU·mul, vs the
reference, and which calls it covers.

The GPU tests run only on an sm_90 GPU, outputs poisoned before each launch: the quantization's FP8 bytes and FP32
scales identical to the reference (NaN = NaN); SiLU·mul + quant within the FP32 path's tolerance
(``check_silu_close``, as the Triton kernel's). The CPU ones check which calls the kernel takes (the rest go to the
Triton kernel) and that every variant compiles without local memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_util import assert_same_bits, check_silu_close

from moe_fp8 import reference as ref
from moe_fp8.kernels import quant
from moe_fp8.testing import randn
from moe_fp8.utils import empty_scale_tma, is_scale_tma_layout

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def test_covers_16_bit_inputs_in_groups_of_128():
    assert quant.covers((4096, 7168), BF16, 128, 1e-10)
    assert quant.covers((8, 0, 2048), F16, 128, 1e-10)  # [G, M, K], M = 0
    assert not quant.covers((4096, 7168), F32, 128, 1e-10)  # the Triton kernel's
    assert not quant.covers((16, 576 + 32), BF16, 128, 1e-10)  # a partial last group
    assert not quant.covers((16, 512), BF16, 64, 1e-10)  # another group size
    assert not quant.covers((16, 512), BF16, 128, quant.MIN_EPS / 2)  # scales too small for the exact division
    assert not quant.covers((4, 4, 4, 128), BF16, 128, 1e-10)  # neither [M, K] nor [G, M, K]


def test_grid_spreads_small_inputs_and_caps_large_ones(monkeypatch):
    monkeypatch.setattr(quant, "get_num_sms", lambda: 132)
    shipped = quant.launch_shape(silu=False)
    assert shipped == (8, 1024, 1)
    assert quant.grid(16384 * 56, *shipped) == (132, 1024)  # one block of 32 warps an SM
    assert quant.grid(128 * 56, *shipped) == (128, 448)  # 1792 units of 4 groups: 14 warps a block, one unit a warp
    assert quant.grid(1, *shipped) == (1, 32)
    assert quant.grid(16384 * 56, lanes=4, threads=512, blocks_per_sm=2) == (264, 512)
    assert quant.launch_shape(silu=True) == (8, 512, 1) and quant.launch_shape(True, threads=256) == (8, 256, 1)


def test_silu_takes_many_rows_of_groups_not_a_power_of_two():
    assert quant.silu_takes(4096, 12) and quant.silu_takes(16384, 144)  # GLM-4.5's shared expert, a dense MLP
    assert not quant.silu_takes(16384, 16)  # DeepSeek-V3's shared expert: the Triton kernel is as fast
    assert not quant.silu_takes(4095, 18)  # fewer rows: the Triton kernel's


def test_runs_only_on_the_gpus_it_was_measured_on(monkeypatch):
    """The H100 keeps the Triton kernel (its tiles were swept there; this kernel was timed on the H200 only)."""
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    quant.measured_here.cache_clear()
    try:
        assert quant.measured_here(0) and not quant.measured_here(1) and not quant.measured_here(None)
    finally:
        quant.measured_here.cache_clear()


@pytest.mark.parametrize(("dtype", "ue8m0", "lanes", "threads", "silu"), [
    (BF16, False, quant.LANES_PER_GROUP, quant.THREADS, False), (F16, True, 4, 1024, False),
    (BF16, True, 16, 512, False),
    (BF16, False, quant.SILU_LANES_PER_GROUP, quant.SILU_THREADS, True), (BF16, True, 16, 1024, True)])
def test_kernel_compiles_without_local_memory(dtype, ue8m0, lanes, threads, silu, tmp_path: Path):
    from moe_fp8.kernels.jit import get_compiler
    from moe_fp8.kernels.jit.cache import include_dir
    from moe_fp8.kernels.jit.compiler import find_compilers
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    # every compiler found (CI has both); none is a failure, as in tests/test_routing_hopper.py, not a skip
    compilers = [c.name for c in find_compilers() if c.available]
    assert compilers, "no CUDA compiler (nvcc or NVRTC): the kernel sources must compile on every machine"
    for compiler in compilers:
        name, source = quant.kernel_variant(dtype, ue8m0, lanes, threads, silu)
        sass = dump_sass(get_compiler(compiler).compile_ex(source, name, [include_dir()], tmp_path / compiler).cubin)
        assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, "local memory"
        assert count_instructions(sass, "F2FP") > 0  # the packed e4m3 conversions


def test_refuses_host_tensors_before_any_launch():
    x = torch.zeros(4, 256, dtype=BF16)
    with pytest.raises(ValueError, match="CUDA tensor"):
        quant.per_token_group_quant_hopper(x, 128, False, 1e-10)
    with pytest.raises(ValueError, match="CUDA tensor"):
        quant.silu_mul_per_token_group_quant_hopper(x, 128, False, None, 1e-10)


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------
def poisoned(shape: tuple[int, ...], kg: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full(shape, 0x5A, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    groups = shape[0] if len(shape) == 3 else None
    out_scale = empty_scale_tma(shape[-2], kg, groups=groups, device="cuda")
    out_scale.fill_(-7.0)
    return out, out_scale


def check(x: torch.Tensor, ue8m0: bool, eps: float = 1e-10, **knobs) -> None:
    out, out_scale = poisoned(tuple(x.shape), x.shape[-1] // 128)
    q, s = quant.per_token_group_quant_hopper(x, 128, ue8m0, eps, out=out, out_scale=out_scale, force=True, **knobs)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == out_scale.data_ptr() and is_scale_tma_layout(s)
    rq, rs = ref.per_token_group_quant(x, 128, ue8m0, eps)
    assert_same_bits(q, rq, f"fp8 bytes {tuple(x.shape)} {knobs}")
    assert_same_bits(s, rs, f"scales {tuple(x.shape)} {knobs}")


SHAPES = [(1, 128), (3, 256), (127, 7168), (128, 7168), (1000, 2048), (4096, 1536), (4, 33, 512), (2, 1, 7168),
          (16384, 7168)]


@pytest.mark.hopper
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, ue8m0):
    x = randn(shape, seed=sum(shape), device="cuda", dtype=F32).mul(3).to(dtype)
    check(x, ue8m0)


@pytest.mark.hopper
@pytest.mark.parametrize("knobs", [dict(lanes=4, threads=512, blocks_per_sm=1), dict(lanes=8, threads=256,
                                   blocks_per_sm=1), dict(lanes=16, threads=1024, blocks_per_sm=1),
                                   dict(lanes=4, threads=32, blocks_per_sm=1)])
@pytest.mark.parametrize("rows", [1, 95, 4099])
def test_every_launch_shape_covers_every_group(rows, knobs):
    """Few warps: each walks many units (odd and even counts, a partial last unit), every group written."""
    x = randn((rows, 2176), seed=rows, device="cuda", dtype=F32).mul(5).to(BF16)  # 17 groups a row
    check(x, False, **knobs)


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_non_finite_zero_and_extreme_groups(dtype):
    x = randn((9, 768), seed=3, device="cuda", dtype=F32).to(dtype)
    x[0, 5] = float("nan")  # NaN group: NaN scale, all NaN codes
    x[1, 130] = float("inf")  # Inf group: +Inf scale, all NaN codes
    x[2, 300] = -float("inf")
    x[2, 301] = float("nan")  # NaN beside Inf: NaN
    x[3, :] = 0.0  # zero group: scale eps/448, zero codes
    x[4, 128:256] = -0.0  # negative zeros keep their sign bit
    x[4, 256:384] = torch.tensor([-0.0, 0.0] * 64, dtype=dtype)
    x[5, 384:512] *= 1e-4 if dtype == F16 else 1e-30  # tiny group (bf16: subnormal codes' range)
    x[6, 512:640] *= 1000.0 if dtype == F16 else 1e30  # huge group
    x[7, 640:] = 1e-3  # a group of equal values: every code 448
    x[8, :128] = torch.linspace(-448, 448, 128)  # values on FP8 rounding ties under a unit scale
    for ue8m0 in (False, True):
        check(x, ue8m0)
        check(x, ue8m0, eps=1.0)  # an eps that sets most scales


@pytest.mark.hopper
def test_falls_back_to_the_triton_kernel_outside_its_cases():
    for x, eps in [(randn((5, 640), seed=1, device="cuda", dtype=F32), 1e-10),  # float32
                   (randn((5, 200), seed=2, device="cuda", dtype=BF16), 1e-10),  # a partial group
                   (randn((5, 256), seed=3, device="cuda", dtype=BF16) * 1e-30, 1e-40)]:  # tiny eps
        q, s = quant.per_token_group_quant_hopper(x, 128, False, eps, force=True)
        rq, rs = ref.per_token_group_quant(x, 128, False, eps)
        assert_same_bits(q, rq, "fp8 bytes")
        assert_same_bits(s, rs, "scales")


@pytest.mark.hopper
def test_public_op_runs_it_and_checks_buffers():
    import moe_fp8
    from moe_fp8 import backends

    name, impl = backends.select("per_token_group_quant", torch.device("cuda", torch.cuda.current_device()))
    assert name == "hopper" and impl is quant.per_token_group_quant_hopper
    x = randn((64, 7168), seed=0, device="cuda")
    q, s = moe_fp8.quant.per_token_group(x)
    rq, rs = ref.per_token_group_quant(x)
    assert_same_bits(q, rq, "fp8 bytes")
    assert_same_bits(s, rs, "scales")
    with pytest.raises(ValueError, match="out_scale"):
        quant.per_token_group_quant_hopper(x, 128, False, 1e-10, out_scale=torch.empty(64, 56, device="cuda"))
    q, s = quant.per_token_group_quant_hopper(x[:0], 128, False, 1e-10)
    assert q.shape == (0, 7168) and s.shape == (0, 56)


# ----------------------------------------------------------------------------------------------
# SiLU·mul + quant
# ----------------------------------------------------------------------------------------------
def check_silu(h: torch.Tensor, ue8m0: bool, eps: float = 1e-10, **knobs) -> None:
    shape = (*h.shape[:-1], h.shape[-1] // 2)
    out, out_scale = poisoned(shape, shape[-1] // 128)
    q, s = quant.silu_mul_per_token_group_quant_hopper(h, 128, ue8m0, None, eps, out=out, out_scale=out_scale,
                                                       force=True, **knobs)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == out_scale.data_ptr()
    check_silu_close((q, s), ref.silu_mul_per_token_group_quant(h, 128, ue8m0, eps=eps))


@pytest.mark.hopper
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("shape", [(1, 256), (127, 4096), (4099, 2 * 2048), (2, 33, 2 * 768), (1000, 2 * 1408 + 128),
                                   (4096, 2 * 1536)])
def test_silu_matches_reference(shape, dtype, ue8m0):
    if shape[-1] % 256 or dtype == F16:  # the Triton kernel's (checked against the reference too)
        h = randn(shape, seed=1, device="cuda", dtype=F32).to(dtype)
        got = quant.silu_mul_per_token_group_quant_hopper(h, 128, ue8m0, None, 1e-10)
        check_silu_close(got, ref.silu_mul_per_token_group_quant(h, 128, ue8m0))
        return
    h = randn(shape, seed=sum(shape), device="cuda", dtype=F32).mul(2.5).to(dtype)
    check_silu(h, ue8m0)


@pytest.mark.hopper
@pytest.mark.parametrize("knobs", [dict(lanes=8, threads=512, blocks_per_sm=1), dict(lanes=16, threads=32,
                                   blocks_per_sm=1)])
def test_silu_every_launch_shape_covers_every_group(knobs):
    check_silu(randn((777, 2 * 2176), seed=3, device="cuda", dtype=F32).mul(2).to(BF16), False, **knobs)


@pytest.mark.hopper
def test_silu_non_finite_zero_and_extreme_groups():
    h = randn((8, 2 * 512), seed=4, device="cuda", dtype=F32).to(BF16)
    h[0, 5] = float("nan")  # a NaN gate: NaN group
    h[1, 512 + 130] = float("inf")  # an Inf up: Inf group
    h[2, 300] = -float("inf")  # silu(-inf) · u = NaN, as the reference
    h[3, :128] = 0.0  # zero gates: zero codes, scale eps / 448
    h[4, 512:640] = -0.0  # negative-zero ups: codes keep their sign bit
    h[5, 128:256] = -100.0  # silu underflows: tiny values below eps
    h[6, 256:384] = 60.0  # silu(g) = g
    h[7, 512 + 384:] *= 1e30  # huge ups
    for ue8m0 in (False, True):
        check_silu(h, ue8m0)
        check_silu(h, ue8m0, eps=1.0)


@pytest.mark.hopper
def test_silu_masked_and_precise_calls_take_the_triton_kernel():
    from moe_fp8.kernels.triton import quant as triton_quant

    h = randn((3, 8, 2 * 256), seed=5, device="cuda", dtype=BF16)
    mm = torch.tensor([8, 0, 5], dtype=torch.int32, device="cuda")
    for kwargs in (dict(masked_m=mm), dict(masked_m=None, precise=True)):
        got = quant.silu_mul_per_token_group_quant_hopper(h, 128, False, eps=1e-10, force=True, **kwargs)
        want = triton_quant.silu_mul_per_token_group_quant(h, 128, False, eps=1e-10, **kwargs)
        valid = (torch.arange(8, device="cuda")[None, :] < mm[:, None] if kwargs["masked_m"] is not None
                 else torch.ones(3, 8, dtype=torch.bool, device="cuda"))
        assert_same_bits(got[0][valid], want[0][valid], "fp8 bytes")
        assert_same_bits(got[1][valid], want[1][valid], "scales")


@pytest.mark.hopper
def test_silu_runs_the_kernel_where_silu_takes_the_rows(monkeypatch):
    launched = []
    real = quant._launch
    monkeypatch.setattr(quant, "_launch", lambda *args: launched.append(args[0].shape) or real(*args))
    monkeypatch.setattr(quant, "measured_here", lambda index: True)  # as on the H200, whatever this GPU is
    for shape, dtype in [((4096, 2 * 1536), BF16), ((4096, 2 * 2048), BF16), ((4096, 2 * 1536), F16),
                         ((1024, 2 * 1536), BF16)]:
        h = randn(shape, seed=6, device="cuda", dtype=F32).to(dtype)
        check_silu_close(quant.silu_mul_per_token_group_quant_hopper(h, 128, False, None, 1e-10),
                         ref.silu_mul_per_token_group_quant(h, 128, False))
    assert launched == [(4096, 2 * 1536)]
