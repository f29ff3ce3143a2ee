"""Hopper ``select_experts`` kernel (impls/routing.cuh) vs the reference, and which calls it covers.

The GPU tests run only on an sm_90 GPU; the CPU ones check the plan (which calls the kernel takes, the
rest going to the Triton kernel) and that every lane layout compiles without local memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_util import assert_same_bits, check_routing

from moe_fp8 import reference as ref
from moe_fp8.kernels.routing import KERNEL_TEMPLATE, plan, split_smem_bytes
from moe_fp8.testing import make_routing_inputs

F32, BF16 = torch.float32, torch.bfloat16


def test_plan_covers_sigmoid_routing_of_whole_lanes():
    covered = {  # (E, top_k, n_group, topk_group, logits, bias) -> (experts a lane, lanes a group, picks, groups)
        (256, 8, 8, 4, BF16, F32): (8, 4, 8, 4),  # DeepSeek-V3
        (256, 8, None, None, F32, None): (8, 0, 8, 1),
        (160, 6, 8, 3, F32, BF16): (5, 4, 6, 3),
        (32, 4, 32, 32, F32, None): (1, 1, 4, 32),
        (512, 32, 2, 1, F32, None): (16, 16, 32, 1),
        (96, 2, 16, 2, F32, None): (3, 2, 2, 2),
    }
    for (e, k, n_group, topk_group, dtype, bias), want in covered.items():
        assert plan(e, k, "sigmoid", n_group, topk_group, dtype, bias) == want
    assert plan(256, 8, "softmax", 8, 4, F32, None) is None  # softmax: the Triton kernel's
    assert plan(48, 2, "sigmoid", None, None, F32, None) is None  # not a multiple of 32 experts
    assert plan(1024, 8, "sigmoid", None, None, F32, None) is None  # more than 16 per lane
    assert plan(256, 33, "sigmoid", None, None, F32, None) is None  # more picks than lanes
    assert plan(256, 8, "sigmoid", None, None, torch.float16, None) is None
    assert plan(256, 8, "sigmoid", 64, 8, F32, None) is None  # groups of 4 experts split a lane of 8


def test_split_layout_takes_shared_memory_only_where_the_kernel_splits():
    """512 bytes a warp for the header's kSplit layout (8 experts a lane, the kept groups half the lanes), none
    elsewhere: the kernel indexes its dynamic shared memory by warp only there."""
    assert split_smem_bytes(8, 4, 4, 1024) == 32 * 512  # DeepSeek-V3: 4 of 8 groups of 4 lanes
    assert split_smem_bytes(8, 4, 4, 32) == 512  # decode: one warp a block
    assert split_smem_bytes(8, 2, 8, 1024) == 32 * 512  # 8 of 16 groups of 2 lanes
    assert split_smem_bytes(8, 4, 3, 1024) == 0  # 3 of 8 groups kept
    assert split_smem_bytes(8, 0, 1, 1024) == 0  # no groups
    assert split_smem_bytes(5, 4, 4, 1024) == 0  # 5 experts a lane


@pytest.mark.parametrize(("logit", "bias", "v", "lpg", "top_k", "topk_group", "has_bias"),
                         [("uint16_t", "float", 8, 4, 8, 4, "true"), ("float", "uint16_t", 16, 0, 32, 1, "true"),
                          ("float", "float", 1, 1, 4, 3, "false"), ("float", "float", 5, 4, 6, 3, "true")])
def test_kernel_compiles_without_local_memory(logit, bias, v, lpg, top_k, topk_group, has_bias, tmp_path: Path):
    from moe_fp8.kernels.jit import get_compiler
    from moe_fp8.kernels.jit.cache import include_dir
    from moe_fp8.kernels.sass import count_instructions, dump_sass

    src = KERNEL_TEMPLATE.format(logit=logit, bias=bias, v=v, lpg=lpg, top_k=top_k, topk_group=topk_group,
                                 has_bias=has_bias)
    res = get_compiler().compile_ex(src, "routing", [include_dir()], tmp_path)
    for report in res.ptxas.values():  # the kernel and its out-of-line exact path
        assert report.get("spill_stores", 0) == 0 and report.get("stack", 0) == 0, report
    sass = dump_sass(res.cubin)
    assert count_instructions(sass, "REDUX") >= 2  # a pick: two 32-bit warp reductions
    assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0


def test_refuses_host_tensors_before_any_launch():
    """A call the kernel covers, on CPU tensors (the backends never route them here): a clear error, not a
    launch on host pointers."""
    from moe_fp8.kernels.routing import select_experts_hopper

    logits, bias = make_routing_inputs(4, 256, seed=0, with_bias=True)
    with pytest.raises(ValueError, match=r"logits on cpu, bias on cpu; both must be on one CUDA device"):
        select_experts_hopper(logits, 8, "sigmoid", True, 8, 4, bias, 2.5)


# ---- GPU: the kernel itself

CASES = [  # T, E, top_k, renormalize, n_group, topk_group, bias dtype, scale, logits dtype
    (7, 256, 8, True, 8, 4, F32, 2.5, BF16),  # DeepSeek-V3
    (4096, 256, 8, True, 8, 4, F32, 2.5, F32),
    (16384, 256, 8, True, 8, 4, BF16, 2.5, BF16),
    (33, 256, 8, False, None, None, None, 1.0, F32),
    (9, 160, 6, True, 8, 3, F32, 16.0, F32),  # 5 experts per lane
    (257, 384, 8, True, 1, 1, F32, 2.827, BF16),  # Kimi K2 (DeepSeek-V3's format): 12 experts per lane, one group
    (333, 160, 8, True, None, None, F32, 2.5, BF16),  # GLM-4.5 as its layer routes (one group: plain top-k), V = 5
    (200, 256, 8, True, None, None, F32, 1.0, BF16),  # MiniMax-M2: top-8 of all with the bias, no scaling
    (5, 32, 4, False, 32, 16, F32, 1.0, F32),  # one expert per group
    (5, 32, 32, True, None, None, None, 1.0, F32),  # every expert picked
    (3, 512, 32, True, 2, 1, BF16, 1.0, BF16),  # 16 per lane, picks from one group of 256
    (11, 96, 3, False, 4, 2, None, 1.0, F32),  # 3 experts per lane, groups of 8 lanes
    # the kept groups half the lanes (kSplit), other than DeepSeek-V3's 4 of 8 groups of 4 lanes
    (1000, 256, 8, True, 16, 8, F32, 1.0, F32),  # 8 of 16 groups of 2 lanes
    (300, 256, 6, False, 32, 16, F32, 1.0, F32),  # 16 of 32 one-lane groups; passes of 5 tokens (odd)
    (200, 256, 8, True, 4, 2, BF16, 2.5, BF16),  # 2 of 4 groups of 8 lanes
    (50, 256, 4, True, 2, 1, None, 1.0, F32),  # 1 of 2 groups of 16 lanes
]


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize(("t", "e", "k", "renorm", "n_group", "topk_group", "bias_dtype", "scale", "dtype"), CASES)
def test_matches_reference(t, e, k, renorm, n_group, topk_group, bias_dtype, scale, dtype):
    from moe_fp8.kernels.routing import select_experts_hopper

    assert plan(e, k, "sigmoid", n_group, topk_group, dtype, bias_dtype) is not None
    logits, bias = make_routing_inputs(t, e, seed=t + e, device="cuda", dtype=dtype, with_bias=bias_dtype is not None)
    if bias is not None:
        bias = bias.to(bias_dtype)
    got = select_experts_hopper(logits, k, "sigmoid", renorm, n_group, topk_group, bias, scale)
    want = ref.select_experts(logits, k, scoring_func="sigmoid", renormalize=renorm, n_group=n_group,
                              topk_group=topk_group, e_score_correction_bias=bias, routed_scaling_factor=scale)
    check_routing(got, want, renorm)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_ties_nan_inf_and_strided_logits(seed):
    """Small-integer logits (ties between experts and between groups), NaN / ±Inf rows, strided views of
    the logits and of the bias, a misaligned bias."""
    from moe_fp8.kernels.routing import select_experts_hopper

    g = torch.Generator().manual_seed(seed)
    logits = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])[torch.randint(0, 6, (64, 256), generator=g)]
    logits[1, 17] = float("nan")
    logits[2, :] = float("nan")
    logits[3, :] = -float("inf")
    logits[3, 200] = 0.0
    logits[4, 10] = float("inf")
    logits[5, :] = 0.0  # every expert and group tied
    wide = torch.zeros(64, 512)
    wide[:, 1::2] = logits
    strided = wide.cuda()[:, 1::2]  # column stride 2
    bias = torch.tensor([0.0, 0.25, -0.5])[torch.randint(0, 3, (256,), generator=g)].cuda()
    strided_bias = torch.stack([bias, -bias], 1).flatten()[::2]  # stride 2 (the kernel reads vectors: copied)
    misaligned_bias = torch.cat([bias[:1], bias])[1:]  # 4 bytes past a 16-byte boundary (copied too)
    assert strided_bias.stride(0) == 2 and misaligned_bias.data_ptr() % 16 == 4
    for n_group, topk_group in ((8, 4), (None, None), (8, 8), (32, 3)):
        for b in (None, bias, strided_bias, misaligned_bias):
            for renorm in (True, False):
                got = select_experts_hopper(strided, 8, "sigmoid", renorm, n_group, topk_group, b, 2.5)
                want = ref.select_experts(strided, 8, scoring_func="sigmoid", renormalize=renorm, n_group=n_group,
                                          topk_group=topk_group, e_score_correction_bias=b, routed_scaling_factor=2.5)
                check_routing(got, want, renorm)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tiny_score_sums_take_the_softmax_of_their_logits(dtype):
    """Tokens whose picks' scores sum below the smallest normal float (underflowed or subnormal sigmoid
    scores, and all -inf) beside ordinary ones in the same warps: the reference's softmax of their logits."""
    from moe_fp8.kernels.routing import select_experts_hopper

    logits, bias = make_routing_inputs(64, 256, seed=9, device="cuda", dtype=dtype, with_bias=True)
    logits[0::4] -= 150.0
    logits[1::4] -= 95.0
    logits[2::8] = -float("inf")
    for n_group, topk_group in ((8, 4), (None, None)):
        got = select_experts_hopper(logits, 8, "sigmoid", True, n_group, topk_group, bias, 2.5)
        want = ref.select_experts(logits, 8, scoring_func="sigmoid", n_group=n_group, topk_group=topk_group,
                                  e_score_correction_bias=bias, routed_scaling_factor=2.5)
        check_routing(got, want, True)
        assert bool(got[0].isfinite().all())
        torch.testing.assert_close(got[0].sum(-1), torch.full((64,), 2.5, device="cuda"))


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_near_ties_below_the_estimates_resolution(seed):
    """Choices 2^-24 apart, closer than a float32 evaluation of the sigmoid can order them: only the float64
    scores (rounded once) agree with the reference, in groups, at the group cut and at the top-k cut. Rows
    range from none to all of their experts in the narrow band (a guard for any faster score path)."""
    from moe_fp8.kernels.routing import select_experts_hopper

    g = torch.Generator().manual_seed(seed)
    t, e = 512, 256
    steps = torch.randint(-40, 40, (t, e), generator=g).float() * 2.0**-22  # sigmoid' ~1/4: 2^-24 apart
    spread = torch.randn(t, e, generator=g)
    narrow = torch.rand(t, e, generator=g) < torch.linspace(0.0, 1.0, t)[:, None]  # from no row to all of it
    logits = torch.where(narrow, 0.3 + steps, spread)
    logits[: t // 4] = 0.3 + steps[: t // 4]  # a quarter: every expert within the margin
    bias = (torch.randint(-2, 3, (e,), generator=g).float() * 2.0**-23).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).cuda()
        for n_group, topk_group, k in ((8, 4, 8), (8, 8, 8), (32, 3, 6), (4, 2, 8), (8, 1, 8)):
            for b in (None, bias):
                got = select_experts_hopper(x, k, "sigmoid", True, n_group, topk_group, b, 2.5)
                want = ref.select_experts(x, k, scoring_func="sigmoid", renormalize=True, n_group=n_group,
                                          topk_group=topk_group, e_score_correction_bias=b, routed_scaling_factor=2.5)
                check_routing(got, want, True)


def _check_default_against_exact(monkeypatch, x, renorm, n_group, topk_group, bias) -> None:
    """Top-8 of ``x`` (scale 2.5) by the default path, then by MOE_FP8_ROUTING_EXACT=1 (every token exact): each
    against the reference, and the two bit-identical."""
    from moe_fp8.kernels import routing

    want = ref.select_experts(x, 8, scoring_func="sigmoid", renormalize=renorm, n_group=n_group, topk_group=topk_group,
                              e_score_correction_bias=bias, routed_scaling_factor=2.5)
    got = []
    for exact in ("0", "1"):
        monkeypatch.setenv("MOE_FP8_ROUTING_EXACT", exact)
        got.append(routing.select_experts_hopper(x, 8, "sigmoid", renorm, n_group, topk_group, bias, 2.5))
        check_routing(got[-1], want, renorm)
    assert_same_bits(got[0][1], got[1][1], "topk_ids")
    assert_same_bits(got[0][0], got[1][0], "topk_weights")


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_near_tied_picks_of_a_clear_set(seed, monkeypatch):
    """2 to 8 picks within the estimates' margin of each other (many tied exactly), all far above the experts
    left, their groups kept: the certified path keeps the set and leaves the order to the float64 scores
    (order_picks). Ids and weights bit-identical to every token on the exact path, and ids to the reference."""
    g = torch.Generator().manual_seed(seed)
    t, e = 2048, 256
    logits = torch.randn(t, e, generator=g) - 2.0
    steps = torch.randint(-40, 40, (t, e), generator=g).float() * 2.0**-22
    for row in range(t):
        groups = torch.randperm(8, generator=g)[:4]  # the kept groups hold the band (two each at most)
        slots = (groups[:, None] * 32 + torch.randperm(32, generator=g)[:2]).flatten()
        band = slots[torch.randperm(8, generator=g)[: 2 + row % 7]]
        logits[row, band] = 3.0 + steps[row, band]
    bias = (torch.randint(-2, 3, (e,), generator=g).float() * 2.0**-23).cuda()
    x = logits.cuda()
    for b in (None, bias):
        for renorm in (True, False):
            _check_default_against_exact(monkeypatch, x, renorm, 8, 4, b)


@pytest.mark.hopper
@pytest.mark.gpu
def test_uncovered_calls_run_the_triton_kernel():
    from moe_fp8.kernels.routing import select_experts_hopper

    logits = make_routing_inputs(9, 64, seed=3, device="cuda", dtype=torch.float16).router_logits
    for scoring in ("softmax", "sigmoid"):  # softmax, and float16 logits: not the kernel's
        got = select_experts_hopper(logits, 6, scoring, True, None, None, None, 1.0)
        check_routing(got, ref.select_experts(logits, 6, scoring_func=scoring), True)
    assert [x.shape for x in select_experts_hopper(logits[:0], 6, "sigmoid", True, None, None, None, 1.0)] == [
        (0, 6), (0, 6)]


SIGMOID_CHECK = r'''#include "moe_fp8/impls/routing.cuh"
// Over every float x but NaN: the largest |sigmoid_estimate(x) - sigmoid_f32(x)|, and how many x give
// sigmoid_f32(x) != (float)(1.0 / (1.0 + exp(-x))) (the reference's formula, IEEE division).
extern "C" __global__ void sigmoid_check(unsigned* worst_error, unsigned* mismatches) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    float worst = 0.0f;
    unsigned wrong = 0;
    for (unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; b < (1ull << 32); b += stride) {
        const float x = __uint_as_float((unsigned)b);
        if (x != x) continue;
        const float exact = moe_fp8::routing::sigmoid_f32(x);
        worst = fmaxf(worst, fabsf(moe_fp8::routing::sigmoid_estimate(x) - exact));
        wrong += __float_as_uint(exact) != __float_as_uint((float)(1.0 / (1.0 + exp(-(double)x))));
    }
    atomicMax(worst_error, __float_as_uint(worst));
    atomicAdd(mismatches, wrong);
}
'''


@pytest.mark.hopper
@pytest.mark.gpu
def test_sigmoids_over_every_float():
    """The certified path's margins assume |estimate - score| <= 2^-23 (the file comment of impls/routing.cuh),
    and the exact path's float64 sigmoid (a reciprocal without __drcp_rn's out-of-range branch) must round
    as 1.0 / (1.0 + exp(-x)) does: both checked on all 2^32 float inputs (bf16 logits are among them)."""
    from moe_fp8.kernels.jit import build

    out = torch.zeros(2, dtype=torch.int32, device="cuda")
    build("routing_sigmoid_check", SIGMOID_CHECK).launch(132 * 16, 256, [out, out[1:]])
    worst, mismatches = out[0].view(torch.float32).item(), out[1].item()
    assert 0 < worst <= 2.0**-23 and mismatches == 0, (worst, mismatches)


@pytest.mark.hopper
@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks", [1, None, 10**6])  # every token in one block, one block an SM, one token each
def test_certified_path_matches_exact_path(max_blocks, monkeypatch):
    """Random DeepSeek-V3 routing at 16384 tokens, where ~0.01% of tokens fall back to the exact path: the
    default path gives bit-identical weights and ids to MOE_FP8_ROUTING_EXACT=1 (every token exact), and both
    match the reference, with biases of several widths (the certified window grows with them, and the exact
    path's 32-bit keys reach farther down), narrow ones far from 0 (the window covers the choices' magnitude,
    not only their span), and with a NaN bias (every token takes the wide exact path)."""
    from moe_fp8.kernels import routing

    monkeypatch.setattr(routing, "MAX_BLOCKS", max_blocks)
    logits, bias = make_routing_inputs(16384, 256, seed=max_blocks or 7, device="cuda", with_bias=True)
    nan_bias = bias.clone()
    nan_bias[17] = float("nan")
    for b in (bias, 40.0 * bias, 1e4 * bias + 3.0, bias + 100.0, 0.01 * bias - 6.0, nan_bias, None):
        for x in (logits, logits.bfloat16()):
            for n_group, topk_group in ((8, 4), (None, None)):
                _check_default_against_exact(monkeypatch, x, True, n_group, topk_group, b)
