"""Tests of the PyTorch oracle (moe_fp8.reference): routing, dispatch (contiguous / masked), combine.

Routing is checked against a per-token brute force in plain Python; dispatch against an explicit
loop that builds the layout pair by pair.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_fp8 import reference as ref
from moe_fp8.testing import make_dispatch_inputs, make_routing_inputs, randn
from moe_fp8.utils import is_scale_tma_layout

SETTINGS = settings(max_examples=30, deadline=None)


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------
def brute_force_route(router_logits, top_k, scoring_func, renormalize, n_group, topk_group, bias, scale):
    """One token at a time in plain Python. Scores (and choice = scores + bias) come from torch as
    float32 — the elementwise math is not under test — everything after is written out by hand."""
    logits = router_logits.double()
    scores = (torch.softmax(logits, -1) if scoring_func == "softmax" else torch.sigmoid(logits)).float()
    choice = scores if bias is None else scores + bias.float()
    num_experts = logits.shape[1]
    all_ids, all_weights = [], []
    for t in range(logits.shape[0]):
        s = scores[t].tolist()
        c = choice[t].tolist()
        eligible = list(range(num_experts))
        if n_group is not None:
            size = num_experts // n_group
            group_score = []
            for g in range(n_group):
                members = sorted(c[g * size:(g + 1) * size], reverse=True)
                if scoring_func == "sigmoid":  # float32 sum of the top two, as the model does
                    top = members[:2]
                    group_score.append(float(np.float32(top[0]) + np.float32(top[1])) if len(top) == 2
                                       else top[0])
                else:
                    group_score.append(members[0])
            best_groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
            eligible = [e for e in range(num_experts) if e // size in best_groups]
        ids = sorted(eligible, key=lambda e: (-c[e], e))[:top_k]
        weights = [s[e] for e in ids]
        if renormalize:
            total = sum(weights)
            if total < 2.0**-126:  # the picks' logits under ~-87: the exact ratios are their logits' softmax
                x = [float(logits[t, e]) for e in ids]
                ex = [1.0 if v == max(x) else math.exp(v - max(x)) for v in x]
                weights = [v / sum(ex) for v in ex]
            else:
                weights = [w / total for w in weights]
        all_ids.append(ids)
        all_weights.append([w * scale for w in weights])
    return (torch.tensor(all_weights, dtype=torch.float64).reshape(-1, top_k),
            torch.tensor(all_ids, dtype=torch.int32).reshape(-1, top_k))


@st.composite
def routing_cases(draw):
    n_group = draw(st.sampled_from([None, 1, 2, 4]))
    per_group = draw(st.integers(1, 4)) if n_group else None
    num_experts = n_group * per_group if n_group else draw(st.integers(1, 12))
    topk_group = draw(st.integers(1, n_group)) if n_group else None
    max_k = topk_group * per_group if n_group else num_experts
    top_k = draw(st.integers(1, max_k))
    num_tokens = draw(st.integers(0, 6))
    # Small integer logits make exact ties common.
    values = draw(st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0]) | st.floats(-4, 4, width=32),
                           min_size=num_tokens * num_experts, max_size=num_tokens * num_experts))
    logits = torch.tensor(values, dtype=torch.float32).reshape(num_tokens, num_experts)
    # some tokens far below zero: sigmoid scores subnormal (-95) or underflowed (-150), renormalized by logits
    logits += torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.0, -95.0, -150.0]), min_size=num_tokens,
                                         max_size=num_tokens)), dtype=torch.float32).reshape(-1, 1)
    bias = None
    if draw(st.booleans()):
        bias = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.25, -0.5]), min_size=num_experts,
                                          max_size=num_experts)), dtype=torch.float32)
    return dict(router_logits=logits, top_k=top_k, scoring_func=draw(st.sampled_from(["softmax", "sigmoid"])),
                renormalize=draw(st.booleans()), n_group=n_group, topk_group=topk_group,
                e_score_correction_bias=bias, routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])))


@SETTINGS
@given(case=routing_cases())
def test_select_experts_matches_brute_force(case):
    weights, ids = ref.select_experts(**case)
    t, k = case["router_logits"].shape[0], case["top_k"]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (t, k)
    exp_w, exp_ids = brute_force_route(case["router_logits"], k, case["scoring_func"], case["renormalize"],
                                       case["n_group"], case["topk_group"], case["e_score_correction_bias"],
                                       case["routed_scaling_factor"])
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights.double(), exp_w, rtol=1e-6, atol=1e-7)


def test_select_experts_ties_go_to_lower_index():
    logits = torch.zeros(3, 8)
    logits[1, [5, 2, 7]] = 1.0  # three-way tie at the top
    w, ids = ref.select_experts(logits, 4, scoring_func="softmax", renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [2, 5, 7, 0], [0, 1, 2, 3]]
    torch.testing.assert_close(w[0], torch.full((4,), 1 / 8))
    # Tied groups: all 4 groups score alike → the first two groups win.
    _, ids = ref.select_experts(torch.zeros(2, 8), 3, scoring_func="sigmoid", n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2]] * 2
    # Exact tie of top-2 sums: choice = 0.5 + bias gives group 0 = 0.75 + 0.25 and group 1 =
    # 0.5 + 0.5 (both exactly 1.0), groups 2-3 lower; the lower group must win.
    bias = torch.tensor([0.25, -0.25, 0.0, 0.0, -1.0, -1.0, -1.0, -1.0])
    _, ids = ref.select_experts(torch.zeros(1, 8), 2, scoring_func="sigmoid", n_group=4, topk_group=1,
                                e_score_correction_bias=bias)
    assert ids.tolist() == [[0, 1]]


def test_select_experts_deepseek_v3_config():
    inp = make_routing_inputs(33, 256, seed=4, with_bias=True)
    kwargs = dict(scoring_func="sigmoid", renormalize=True, n_group=8, topk_group=4,
                  e_score_correction_bias=inp.e_score_correction_bias, routed_scaling_factor=2.5)
    w, ids = ref.select_experts(inp.router_logits, 8, **kwargs)
    exp_w, exp_ids = brute_force_route(inp.router_logits, 8, "sigmoid", True, 8, 4,
                                       inp.e_score_correction_bias, 2.5)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(w.double(), exp_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(-1), torch.full((33,), 2.5))
    for row in ids.tolist():
        assert len(set(row)) == 8 and len({e // 32 for e in row}) <= 4
    # weights are the unbiased sigmoid scores, renormalized
    sig = torch.sigmoid(inp.router_logits.double()).float().gather(1, ids.long())
    torch.testing.assert_close(w, 2.5 * sig / sig.sum(-1, keepdim=True))


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_select_experts_empty_and_large(scoring_func):
    w, ids = ref.select_experts(torch.empty(0, 512), 8, scoring_func=scoring_func, n_group=8, topk_group=4)
    assert w.shape == ids.shape == (0, 8)
    inp = make_routing_inputs(4, 512, seed=1, dtype=torch.bfloat16)
    w, ids = ref.select_experts(inp.router_logits, 8, scoring_func=scoring_func)
    exp_w, exp_ids = brute_force_route(inp.router_logits, 8, scoring_func, True, None, None, None, 1.0)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(w.double(), exp_w, rtol=1e-6, atol=1e-7)


def test_select_experts_nan_propagates():
    logits = torch.randn(2, 8)
    logits[1, 3] = float("nan")
    w, _ = ref.select_experts(logits, 2)
    assert bool(w[0].isfinite().all()) and bool(w[1].isnan().any())


def test_select_experts_renormalizes_tiny_scores_by_their_logits():
    """Picks whose float32 scores sum below the smallest normal float (logits under ~-87) take the softmax of
    their logits: the exact ratios of their scores, where dividing the rounded scores loses precision (and
    gives 0 / 0 once they underflow, below ~-104). All -inf: equal weights; ordinary rows keep the quotient."""
    # row 0: every score underflows to 0, so the picks are ties (the lower experts) and their weights still differ
    logits = torch.tensor([[-110.0, -130.0, -115.0, -120.0, -140.0, -135.0],
                           [-90.0, -99.0, -92.5, -150.0, -96.0, -200.0],  # subnormal float32 scores
                           [-float("inf")] * 6,
                           [0.5, -1.0, 2.0, -3.0, 1.0, 0.0]])
    w, ids = ref.select_experts(logits, 3, scoring_func="sigmoid", routed_scaling_factor=2.5)
    assert ids.tolist() == [[0, 1, 2], [0, 2, 4], [0, 1, 2], [2, 4, 0]]
    x = logits.double().gather(1, ids.long())
    exact = torch.sigmoid(x[:2]) / torch.sigmoid(x[:2]).sum(-1, keepdim=True)  # float64 keeps every digit
    torch.testing.assert_close(w[:2].double(), 2.5 * exact, rtol=1e-6, atol=0)
    assert torch.equal(w[2], torch.full((3,), 1 / 3) * 2.5)
    sig = torch.sigmoid(x[3]).float()
    assert torch.equal(w[3], 2.5 * (sig / sig.sum()))
    # softmax: a bias can push the largest score out of the picks, leaving underflowed ones
    logits = torch.tensor([[0.0, -200.0, -210.0, -220.0]])
    w, ids = ref.select_experts(logits, 2, e_score_correction_bias=torch.tensor([-10.0, 0.0, 0.0, 0.0]))
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(-10.0)]]) / (1 + math.exp(-10.0)))
    # NaN still propagates (a NaN sum is not tiny)
    w, _ = ref.select_experts(torch.tensor([[float("nan"), -120.0, -130.0]]), 2, scoring_func="sigmoid")
    assert bool(w.isnan().all())


def test_select_experts_rejects_bad_config():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="top_k"):
        ref.select_experts(logits, 9)
    with pytest.raises(ValueError, match="n_group"):
        ref.select_experts(logits, 2, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="topk_group"):
        ref.select_experts(logits, 5, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="scoring_func"):
        ref.select_experts(logits, 2, scoring_func="relu")


# ----------------------------------------------------------------------------------------------
# Dispatch / combine
# ----------------------------------------------------------------------------------------------
def local_id(e_global: int, expert_map: torch.Tensor | None) -> int:
    return e_global if expert_map is None else int(expert_map[e_global])


def brute_force_contiguous(topk_ids, num_experts, expert_map, align_m):
    """Row of each (token, slot) pair and m_indices, built by walking the experts in order."""
    t, k = topk_ids.shape
    row_map = [[-1] * k for _ in range(t)]
    m_indices = []
    for e in range(num_experts):
        pairs = [(i, j) for i in range(t) for j in range(k) if local_id(int(topk_ids[i, j]), expert_map) == e]
        for i, j in pairs:
            row_map[i][j] = len(m_indices)
            m_indices.append(e)
        while len(m_indices) % align_m:
            m_indices.append(-1)
    return torch.tensor(row_map, dtype=torch.int64).reshape(t, k), torch.tensor(m_indices, dtype=torch.int32)


def expected_combine(x_fp8, x_scale, topk_weights, kept):
    """Σ_j w[t, j] · dequant(x[t]) over kept slots, float64."""
    x = ref.dequant_per_token_group(x_fp8, x_scale).double()
    w = torch.where(kept, topk_weights.double(), 0.0)
    return w.sum(-1, keepdim=True) * x


@st.composite
def dispatch_cases(draw):
    num_global = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, num_global))
    num_tokens = draw(st.integers(0, 20))
    hidden = draw(st.sampled_from([128, 200]))
    expert_map, num_local = None, num_global
    if draw(st.booleans()):
        local = draw(st.lists(st.booleans(), min_size=num_global, max_size=num_global))
        num_local = sum(local)
        expert_map, nxt = [], 0
        for is_local in local:
            expert_map.append(nxt if is_local else -1)
            nxt += is_local
        expert_map = torch.tensor(expert_map, dtype=torch.int32)
    skew = draw(st.sampled_from([0.0, 0.0, 3.0]))
    seed = draw(st.integers(0, 2**16))
    return num_tokens, hidden, num_global, top_k, num_local, expert_map, skew, seed


@SETTINGS
@given(case=dispatch_cases(), align_m=st.sampled_from([1, 4, 128]))
def test_dispatch_contiguous_and_combine(case, align_m):
    num_tokens, hidden, num_global, top_k, num_local, expert_map, skew, seed = case
    inp = make_dispatch_inputs(num_tokens, hidden, num_global, top_k, seed, skew=skew)
    out_fp8, out_scale, m_indices, row_map = ref.dispatch_contiguous(
        inp.x_fp8, inp.x_scale, inp.topk_ids, num_local, expert_map, align_m)

    exp_row_map, exp_m_indices = brute_force_contiguous(inp.topk_ids, num_local, expert_map, align_m)
    assert row_map.dtype == torch.int64 and torch.equal(row_map, exp_row_map)
    assert m_indices.dtype == torch.int32 and torch.equal(m_indices, exp_m_indices)
    m_total = exp_m_indices.numel()
    assert m_total % align_m == 0 and out_fp8.shape == (m_total, hidden) and out_scale.shape[0] == m_total
    assert m_total == 0 or is_scale_tma_layout(out_scale)
    # segments start on multiples of align_m
    starts = [r for r in range(m_total) if m_indices[r] >= 0 and (r == 0 or m_indices[r - 1] != m_indices[r])]
    assert all(r % align_m == 0 for r in starts)
    # rows carry their token's bytes and scales; padding is FP8 zeros with scale 1.0
    for t in range(num_tokens):
        for j in range(top_k):
            r = int(row_map[t, j])
            if r >= 0:
                assert torch.equal(out_fp8[r].view(torch.uint8), inp.x_fp8[t].view(torch.uint8))
                assert torch.equal(out_scale[r], inp.x_scale[t])
    padding = m_indices == -1
    assert bool((out_fp8.view(torch.uint8)[padding] == 0).all()) and bool((out_scale[padding] == 1.0).all())

    # identity expert, then combine
    y = ref.dequant_per_token_group(out_fp8, out_scale).to(torch.bfloat16)
    y[padding] = float("nan")  # padding rows must never be read
    combined = ref.combine(y, row_map, inp.topk_weights)
    assert combined.dtype == torch.bfloat16 and combined.shape == (num_tokens, hidden)
    expected = expected_combine(inp.x_fp8, inp.x_scale, inp.topk_weights, row_map >= 0)
    # y went through bf16: compare with one bf16 rounding per slot plus the final one
    torch.testing.assert_close(combined.double(), expected, rtol=2**-6, atol=1e-3)


def brute_force_masked(topk_ids, num_experts, max_m, expert_map):
    t, k = topk_ids.shape
    row_map = [[-1] * k for _ in range(t)]
    filled = [0] * num_experts
    for i in range(t):
        for j in range(k):
            e = local_id(int(topk_ids[i, j]), expert_map)
            if e >= 0 and filled[e] < max_m:
                row_map[i][j] = e * max_m + filled[e]
                filled[e] += 1
    return torch.tensor(row_map, dtype=torch.int64).reshape(t, k), torch.tensor(filled, dtype=torch.int32)


@SETTINGS
@given(case=dispatch_cases(), max_m=st.integers(0, 9))
def test_dispatch_masked_and_combine(case, max_m):
    num_tokens, hidden, num_global, top_k, num_local, expert_map, skew, seed = case
    inp = make_dispatch_inputs(num_tokens, hidden, num_global, top_k, seed, skew=skew)
    out_fp8, out_scale, masked_m, row_map = ref.dispatch_masked(
        inp.x_fp8, inp.x_scale, inp.topk_ids, num_local, max_m, expert_map)

    exp_row_map, exp_masked_m = brute_force_masked(inp.topk_ids, num_local, max_m, expert_map)
    assert torch.equal(row_map, exp_row_map) and row_map.dtype == torch.int64
    assert torch.equal(masked_m, exp_masked_m) and masked_m.dtype == torch.int32
    assert out_fp8.shape == (num_local, max_m, hidden) and out_scale.shape == (num_local, max_m, 2 - (hidden <= 128))
    assert max_m == 0 or is_scale_tma_layout(out_scale)
    flat_fp8 = out_fp8.reshape(-1, hidden).view(torch.uint8)
    flat_scale = out_scale.reshape(-1, out_scale.shape[-1])
    for t in range(num_tokens):
        for j in range(top_k):
            r = int(row_map[t, j])
            if r >= 0:
                assert torch.equal(flat_fp8[r], inp.x_fp8[t].view(torch.uint8))
                assert torch.equal(flat_scale[r], inp.x_scale[t])
    unused = ~(torch.arange(max_m)[None, :] < masked_m[:, None]).reshape(-1)
    assert bool((flat_fp8[unused] == 0).all()) and bool((flat_scale[unused] == 1.0).all())

    y = ref.dequant_per_token_group(out_fp8, out_scale).to(torch.bfloat16)
    y.reshape(-1, hidden)[unused] = float("inf")  # never read
    shared = randn((num_tokens, hidden), seed=seed + 5)
    combined = ref.combine(y, row_map, inp.topk_weights, shared_output=shared)
    expected = expected_combine(inp.x_fp8, inp.x_scale, inp.topk_weights, row_map >= 0) + shared.double()
    torch.testing.assert_close(combined.double(), expected, rtol=2**-6, atol=1e-2)


def test_dispatch_masked_overflow_keeps_first_pairs():
    # 5 tokens all routed to expert 1 (slot 0) and expert 0 (slot 1); max_m = 3.
    x_fp8, x_scale = ref.per_token_group_quant(randn((5, 128), seed=8))
    topk_ids = torch.tensor([[1, 0]] * 5, dtype=torch.int32)
    out_fp8, out_scale, masked_m, row_map = ref.dispatch_masked(x_fp8, x_scale, topk_ids, 2, 3)
    assert masked_m.tolist() == [3, 3]
    assert row_map.tolist() == [[3, 0], [4, 1], [5, 2], [-1, -1], [-1, -1]]
    assert torch.equal(out_fp8[1].view(torch.uint8), x_fp8[:3].view(torch.uint8))
    # dropped pairs contribute nothing
    y = ref.dequant_per_token_group(out_fp8, out_scale).to(torch.bfloat16)
    out = ref.combine(y, row_map, torch.ones(5, 2))
    assert bool((out[3:] == 0).all())


def test_dispatch_contiguous_absent_experts_and_empty():
    inp = make_dispatch_inputs(6, 256, 8, 2, seed=3)
    expert_map = torch.full((8,), -1, dtype=torch.int32)  # nothing local
    out_fp8, _, m_indices, row_map = ref.dispatch_contiguous(
        inp.x_fp8, inp.x_scale, inp.topk_ids, 0, expert_map)
    assert out_fp8.shape == (0, 256) and m_indices.numel() == 0 and bool((row_map == -1).all())
    combined = ref.combine(torch.empty(0, 256, dtype=torch.bfloat16), row_map, inp.topk_weights)
    assert bool((combined == 0).all()) and combined.shape == (6, 256)
    with pytest.raises(ValueError, match="topk_ids"):
        ref.dispatch_contiguous(inp.x_fp8, inp.x_scale, inp.topk_ids, 4)


def test_combine_weights_and_order():
    y = torch.tensor([[1.0, 2.0], [10.0, 20.0], [float("nan"), float("nan")]], dtype=torch.bfloat16)
    row_map = torch.tensor([[1, 0], [-1, 0], [2, -1]])
    weights = torch.tensor([[0.5, 2.0], [7.0, 1.0], [0.0, 3.0]])
    out = ref.combine(y, row_map, weights, shared_output=torch.ones(3, 2))
    assert out[0].tolist() == [8.0, 15.0]
    assert out[1].tolist() == [2.0, 3.0]
    assert bool(out[2].isnan().all())  # a used row with NaN propagates, even with weight 0
