"""Triton ``select_experts`` vs ``moe_fp8.reference.select_experts``.

Ids must be identical (ties to the lower index, NaN above everything). Weights are identical without
``renormalize``; with it, the reference divides by a torch sum whose order is unspecified, so they
may differ by a couple of float32 ulps (checked to 4 ulps, and in aggregate to be nearly all equal).
"""

from __future__ import annotations

import pytest
import torch
from datapath_util import DEVICE, check_routing, require_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8 import reference as ref
from moe_fp8.testing import make_routing_inputs

triton = pytest.importorskip("triton")

from moe_fp8.kernels.triton import routing  # noqa: E402  (after the importorskip)

pytestmark = [pytest.mark.datapath, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture(autouse=True)
def _kernels_run_here():
    require_kernels()


def route(logits, top_k, scoring_func="softmax", renormalize=True, n_group=None, topk_group=None, bias=None,
          scale=1.0):
    got = routing.select_experts(logits, top_k, scoring_func, renormalize, n_group, topk_group, bias, scale)
    want = ref.select_experts(logits, top_k, scoring_func=scoring_func, renormalize=renormalize, n_group=n_group,
                              topk_group=topk_group, e_score_correction_bias=bias, routed_scaling_factor=scale)
    return got, want


CASES = [  # T, E, top_k, scoring, renormalize, n_group, topk_group, bias, scale, logits dtype
    (5, 16, 4, "softmax", True, None, None, False, 1.0, torch.float32),
    (7, 256, 8, "sigmoid", True, 8, 4, True, 2.5, torch.bfloat16),  # DeepSeek-V3
    (5, 384, 8, "sigmoid", True, 1, 1, True, 2.827, torch.bfloat16),  # Kimi K2: 384 experts, one group
    (3, 12, 5, "sigmoid", False, 4, 2, True, 1.0, torch.float32),  # groups of 3 (not a power of two)
    (4, 12, 3, "softmax", False, 4, 2, False, 1.0, torch.float16),  # grouped softmax: group max
    (9, 6, 2, "sigmoid", True, 6, 3, False, 1.0, torch.float32),  # one expert per group
    (3, 512, 8, "softmax", True, None, None, True, 1.0, torch.bfloat16),
    (2, 160, 6, "softmax", True, 8, 3, False, 16.0, torch.bfloat16),  # DeepSeek-V2 style
    (6, 1, 1, "sigmoid", False, None, None, False, 1.0, torch.float32),
]


@pytest.mark.parametrize(("t", "e", "k", "scoring", "renorm", "n_group", "topk_group", "with_bias", "scale", "dtype"),
                         CASES)
def test_select_experts_matches_reference(t, e, k, scoring, renorm, n_group, topk_group, with_bias, scale, dtype):
    logits, bias = make_routing_inputs(t, e, seed=t * e, device=DEVICE, dtype=dtype, with_bias=with_bias)
    got, want = route(logits, k, scoring, renorm, n_group, topk_group, bias, scale)
    check_routing(got, want, renorm)


def test_select_experts_ties_nan_and_strided_logits():
    logits = torch.zeros(6, 24, device=DEVICE)
    logits[1, ::3] = 1.0  # eight-way ties
    logits[2, 5] = float("nan")  # NaN row
    logits[3, :] = -float("inf")
    logits[3, 7] = 0.0
    logits[4, 10] = float("inf")
    wide = torch.randn(6, 48, device=DEVICE)
    wide[:, ::2] = logits
    strided = wide[:, ::2]  # row stride 48, column stride 2
    bias = torch.zeros(24, device=DEVICE)
    bias[::4] = 0.5
    for scoring in ("softmax", "sigmoid"):
        for n_group, topk_group in ((None, None), (4, 2), (6, 6)):
            for b in (None, bias):
                got, want = route(strided, 4, scoring, True, n_group, topk_group, b)
                check_routing(got, want, True)


@pytest.mark.parametrize(("scoring", "n_group", "topk_group", "with_bias"),
                         [("sigmoid", 4, 2, True), ("softmax", None, None, True), ("sigmoid", None, None, False)])
def test_select_experts_tiny_score_sums(scoring, n_group, topk_group, with_bias):
    """Rows whose picks' scores sum below the smallest normal float (underflowed or subnormal sigmoid scores,
    softmax picks a bias pushed off the top) take the reference's softmax of their logits, beside ordinary rows."""
    logits, bias = make_routing_inputs(12, 16, seed=5, device=DEVICE, with_bias=with_bias)
    logits[0::3] -= 150.0
    logits[1::3] -= 95.0
    if scoring == "softmax":  # the top expert out of every row's picks, the rest far below it
        logits[:, 0] = 0.0
        logits[:, 1:] -= 200.0
        bias = torch.zeros(16, device=DEVICE)
        bias[0] = -2.0
    got, want = route(logits, 4, scoring, True, n_group, topk_group, bias, 2.5)
    check_routing(got, want, True)
    assert bool(got[0].isfinite().all())
    torch.testing.assert_close(got[0].sum(-1), torch.full((12,), 2.5, device=DEVICE))


@st.composite
def routing_cases(draw):
    n_group = draw(st.sampled_from([None, 1, 2, 4]))
    per_group = draw(st.integers(1, 5)) if n_group else None
    num_experts = n_group * per_group if n_group else draw(st.integers(1, 20))
    topk_group = draw(st.integers(1, n_group)) if n_group else None
    max_k = topk_group * per_group if n_group else num_experts
    top_k = draw(st.integers(1, max_k))
    num_tokens = draw(st.integers(1, 5))
    # Small integer logits make exact ties (of experts and of groups) common.
    values = draw(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]) | st.floats(-4, 4, width=32),
                           min_size=num_tokens * num_experts, max_size=num_tokens * num_experts))
    logits = torch.tensor(values, dtype=torch.float32).reshape(num_tokens, num_experts).to(DEVICE)
    bias = None
    if draw(st.booleans()):
        bias = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.25, -0.5]), min_size=num_experts,
                                          max_size=num_experts)), dtype=torch.float32).to(DEVICE)
    return dict(logits=logits, top_k=top_k, scoring_func=draw(st.sampled_from(["softmax", "sigmoid"])),
                renormalize=draw(st.booleans()), n_group=n_group, topk_group=topk_group, bias=bias,
                scale=draw(st.sampled_from([1.0, 2.5])))


@settings(max_examples=25, deadline=None)
@given(routing_cases())
def test_select_experts_matches_reference_on_ties(case):
    got, want = route(**case)
    check_routing(got, want, case["renormalize"])


def test_select_experts_many_experts_uses_reference(caplog):
    logits = torch.randn(2, 2048, device=DEVICE)
    got, want = route(logits, 4)
    check_routing(got, want, True)
    assert "runs the reference" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 128, 4096, 16384])
def test_select_experts_model_sizes(num_tokens):
    logits, bias = make_routing_inputs(num_tokens, 256, seed=num_tokens, device="cuda", with_bias=True)
    got, want = route(logits, 8, "sigmoid", True, 8, 4, bias, 2.5)
    check_routing(got, want, True)
    logits = make_routing_inputs(num_tokens, 64, seed=1, device="cuda", dtype=torch.bfloat16).router_logits
    check_routing(*route(logits, 6, "softmax", False), False)


@pytest.mark.gpu
def test_public_select_experts_runs_the_backend_kernel(monkeypatch):
    import moe_fp8
    from moe_fp8 import backends

    monkeypatch.setenv("MOE_FP8_STRICT", "1")
    name, impl = backends.select("select_experts", torch.device("cuda", torch.cuda.current_device()))
    from moe_fp8.kernels.routing import select_experts_hopper

    assert (name, impl) in (("hopper", select_experts_hopper), ("portable", routing.select_experts))
    logits, bias = make_routing_inputs(128, 256, seed=0, device="cuda", with_bias=True)
    got = moe_fp8.layers.select_experts(logits, 8, scoring_func="sigmoid", n_group=8, topk_group=4,
                                        e_score_correction_bias=bias, routed_scaling_factor=2.5)
    want = ref.select_experts(logits, 8, scoring_func="sigmoid", n_group=8, topk_group=4,
                              e_score_correction_bias=bias, routed_scaling_factor=2.5)
    check_routing(got, want, True)


@pytest.mark.parametrize(("block_t", "num_warps"), [(2, 2), (2, 1), (4, 4)])
def test_select_experts_multi_token_programs(block_t, num_warps):
    """Several tokens per program (the sweep's configs; block_t=2 with 2 warps once picked wrong ids on
    an H100 when the key tile was flattened with tl.reshape — the picks now reduce the 3-D tile)."""
    from moe_fp8.kernels.triton.configs import routing_config

    logits, bias = make_routing_inputs(7, 256, seed=11, device=DEVICE, with_bias=True)
    cfg = routing_config(7, 256, 8, 8, block_t=block_t, num_warps=num_warps)
    got = routing.select_experts(logits, 8, "sigmoid", True, 8, 4, bias, 2.5, config=cfg)
    want = ref.select_experts(logits, 8, scoring_func="sigmoid", renormalize=True, n_group=8, topk_group=4,
                              e_score_correction_bias=bias, routed_scaling_factor=2.5)
    check_routing(got, want, True)
