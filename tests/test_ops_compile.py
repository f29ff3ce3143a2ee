"""torch.library registrations: torch.compile(fullgraph=True) over the public API, fakes, opcheck.

Compiled with backend "aot_eager" (dynamo + AOT autograd + functionalization, no codegen) so the
fakes and the mutation declarations are exercised while the file stays well under a minute on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_fp8
from moe_fp8 import layers, quant
from moe_fp8.layers import Fp8FusedMoE
from moe_fp8.testing import (
    make_contiguous_inputs,
    make_dispatch_inputs,
    make_gemm_inputs,
    make_masked_inputs,
    randn,
)
from moe_fp8.utils import get_tma_aligned_m

BF16 = torch.bfloat16
# SchemaCheckMode (opcheck's test_schema) compares every aten argument before/after each call with
# ops that have no CPU kernel for float8_e4m3fn ("mul_cpu_reduced_float" not implemented), so it
# cannot run over ops with FP8 inputs on CPU; the other three checks do.
NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


class RecordGraphs:
    """A dynamo backend that keeps the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _ops_in(graphs) -> set[str]:
    """Names of the moe_fp8 ops called in ``graphs`` (dynamo records the OpOverloadPacket)."""
    return {str(n.target).removeprefix("moe_fp8.").removesuffix(".default") for gm in graphs
            for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("moe_fp8.")}


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------

def linear(x, w_fp8, w_scale):
    x_fp8, x_scale = quant.per_token_group(x)
    return moe_fp8.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale)


def test_compile_fp8_gemm_fullgraph():
    g = make_gemm_inputs(37, 2112, 576, seed=1)
    eager = linear(g.x, g.w_fp8, g.w_scale)
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(g.x, g.w_fp8, g.w_scale), eager)
    # A second M recompiles with a dynamic M: fakes must give symbolic shapes and TMA strides.
    g2 = make_gemm_inputs(53, 2112, 576, seed=2)
    assert torch.equal(compiled(g2.x, g2.w_fp8, g2.w_scale), linear(g2.x, g2.w_fp8, g2.w_scale))

    rec = RecordGraphs()
    torch.compile(linear, fullgraph=True, backend=rec)(g.x, g.w_fp8, g.w_scale)
    assert {"per_token_group_quant", "fp8_gemm"} <= _ops_in(rec.graphs)


def test_compile_out_argument_is_mutated():
    g = make_gemm_inputs(16, 24, 176, seed=3)

    def f(x_fp8, x_scale, w, w_scale, out):
        moe_fp8.fp8_gemm(x_fp8, x_scale, w, w_scale, out=out)
        return out * 2

    out_c = torch.full((16, 24), float("nan"), dtype=BF16)
    res = torch.compile(f, fullgraph=True, backend="aot_eager")(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale, out_c)
    expected = moe_fp8.fp8_gemm(g.x_fp8, g.x_scale, g.w_fp8, g.w_scale)
    assert torch.equal(out_c, expected) and torch.equal(res, expected * 2)


def test_compile_grouped_contiguous_fullgraph():
    c = make_contiguous_inputs(3, 40, 24, 176, seed=4)

    def f(x_fp8, x_scale, w, w_scale, m_indices):
        return moe_fp8.fp8_grouped_gemm_contiguous(x_fp8, x_scale, w, w_scale, m_indices).float().relu()

    args = (c.x_fp8, c.x_scale, c.w_fp8, c.w_scale, c.m_indices)
    valid = c.m_indices >= 0
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(got[valid], f(*args)[valid])


def moe_decode(x, router_logits, w13_fp8, w13_scale, w2_fp8, w2_scale, max_m: int):
    """The whole decode MoE path: fixed sizes, no host sync, so one graph."""
    weights, ids = layers.select_experts(router_logits, 2, scoring_func="sigmoid", n_group=2, topk_group=1)
    x_fp8, x_scale = quant.per_token_group(x)
    a, a_scale, masked_m, row_map = layers.dispatch_masked(x_fp8, x_scale, ids, w13_fp8.shape[0], max_m)
    h = moe_fp8.fp8_grouped_gemm_masked(a, a_scale, w13_fp8, w13_scale, masked_m, 4)
    y_fp8, y_scale = quant.silu_mul_per_token_group(h, masked_m=masked_m)
    y = moe_fp8.fp8_grouped_gemm_masked(y_fp8, y_scale, w2_fp8, w2_scale, masked_m, 4)
    return layers.combine(y, row_map, weights)


def test_compile_moe_decode_fullgraph():
    experts, hidden, inter = 4, 256, 128
    w13_fp8, w13_scale = quant.per_block(0.05 * randn((experts, 2 * inter, hidden), seed=5))
    w2_fp8, w2_scale = quant.per_block(0.05 * randn((experts, hidden, inter), seed=6))
    rec = RecordGraphs()
    compiled = torch.compile(moe_decode, fullgraph=True, backend="aot_eager")
    for t, seed in ((9, 7), (13, 8)):
        x = randn((t, hidden), seed=seed)
        logits = randn((t, experts), seed=seed + 100, dtype=torch.float32)
        args = (x, logits, w13_fp8, w13_scale, w2_fp8, w2_scale, 16)
        eager = moe_decode(*args)
        assert not eager.isnan().any()
        assert torch.equal(compiled(*args), eager)
    torch.compile(moe_decode, fullgraph=True, backend=rec)(*args)
    assert {"select_experts", "dispatch_masked", "fp8_grouped_gemm_masked", "silu_mul_per_token_group_quant",
            "combine"} <= _ops_in(rec.graphs)


def test_compile_fused_moe_with_dynamic_shapes_and_floats():
    """dynamic=True makes Python floats symbolic (and a second routed_scaling_factor does too): the routing
    options' checks must still trace, for select_experts and for the whole Fp8FusedMoE decode forward."""
    def route(logits, factor: float):
        return layers.select_experts(logits, 2, scoring_func="sigmoid", routed_scaling_factor=factor)

    logits = randn((7, 8), seed=1, dtype=torch.float32)
    for dynamic in (True, None):  # None: the factor becomes symbolic when it changes
        torch._dynamo.reset()
        compiled = torch.compile(route, fullgraph=True, dynamic=dynamic, backend="eager")
        for factor in (1.0, 2.5):
            assert all(torch.equal(a, b) for a, b in zip(compiled(logits, factor), route(logits, factor), strict=True))
    moe = Fp8FusedMoE(4, 256, 128, 2, scoring_func="sigmoid", routed_scaling_factor=2.5)
    compiled = torch.compile(lambda x, lg: moe(x, lg, path="masked"), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    for t in (3, 9):
        x, lg = randn((t, 256), seed=t), randn((t, 4), seed=t + 1, dtype=torch.float32)
        assert torch.equal(compiled(x, lg), moe(x, lg, path="masked"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_moe_decode_traces_once_for_every_token_count(device):
    """One dynamic-shape graph serves every T (engines compile once and may skip dynamo's guards): no guard on
    T's value (multiples of 4 or not) and none on the backend selection's caches, which fill on first use."""
    torch._dynamo.reset()
    moe = Fp8FusedMoE(4, 256, 256, 2, scoring_func="sigmoid", routed_scaling_factor=2.5).to(device)
    rec = RecordGraphs()
    compiled = torch.compile(lambda x, lg: moe(x, lg, path="masked"), fullgraph=True, dynamic=True, backend=rec)
    for t in (3, 9, 4, 8, 5, 16, 2):  # (T = 1: dynamo specialises sizes 0 and 1 itself)
        x = randn((t, 256), seed=t).to(device)
        lg = randn((t, 4), seed=t + 1, dtype=torch.float32).to(device)
        assert torch.equal(compiled(x, lg), moe(x, lg, path="masked"))
    assert len(rec.graphs) == 1


def moe_decode_fused(x, router_logits, w13_fp8, w13_scale, w2_fp8, w2_scale, max_m: int):
    """``moe_decode`` with the quantization fused into the dispatch (what Fp8FusedMoE's masked path runs)."""
    weights, ids = layers.select_experts(router_logits, 2, scoring_func="sigmoid", n_group=2, topk_group=1)
    _, _, a, a_scale, masked_m, row_map = layers.quant_dispatch_masked(x, ids, w13_fp8.shape[0], max_m)
    h = moe_fp8.fp8_grouped_gemm_masked(a, a_scale, w13_fp8, w13_scale, masked_m, 4)
    y_fp8, y_scale = quant.silu_mul_per_token_group(h, masked_m=masked_m)
    y = moe_fp8.fp8_grouped_gemm_masked(y_fp8, y_scale, w2_fp8, w2_scale, masked_m, 4)
    return layers.combine(y, row_map, weights)


def test_compile_moe_decode_fused_quant_dispatch_fullgraph():
    experts, hidden, inter = 4, 256, 128
    w13_fp8, w13_scale = quant.per_block(0.05 * randn((experts, 2 * inter, hidden), seed=5))
    w2_fp8, w2_scale = quant.per_block(0.05 * randn((experts, hidden, inter), seed=6))
    compiled = torch.compile(moe_decode_fused, fullgraph=True, backend="aot_eager")
    for t, seed in ((9, 7), (13, 8)):  # the second size recompiles with a dynamic T
        x = randn((t, hidden), seed=seed)
        logits = randn((t, experts), seed=seed + 100, dtype=torch.float32)
        args = (x, logits, w13_fp8, w13_scale, w2_fp8, w2_scale, 16)
        eager = moe_decode_fused(*args)
        assert torch.equal(eager, moe_decode(*args))  # fused or not: the same bits
        assert torch.equal(compiled(*args), eager)
    rec = RecordGraphs()
    torch.compile(moe_decode_fused, fullgraph=True, backend=rec)(*args)
    assert "quant_dispatch_masked" in _ops_in(rec.graphs)
    assert not {"per_token_group_quant", "dispatch_masked"} & _ops_in(rec.graphs)


def test_dispatch_contiguous_is_not_capturable():
    d = make_dispatch_inputs(8, 128, 4, 2, seed=9)

    def f(x_fp8, x_scale, topk_ids):
        _, a_scale, _, row_map = layers.dispatch_contiguous(x_fp8, x_scale, topk_ids, 4)
        return a_scale.sum() + row_map.sum()

    args = (d.x_fp8, d.x_scale, d.topk_ids)
    with pytest.raises(Exception, match="_dispatch_contiguous_eager_only"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    # Without fullgraph it is a graph break and still correct.
    assert torch.equal(torch.compile(f, backend="aot_eager")(*args), f(*args))


def test_fakes_give_tma_scale_strides():
    with FakeTensorMode():
        x = torch.empty(37, 576, dtype=BF16)
        x_fp8, x_scale = torch.ops.moe_fp8.per_token_group_quant(x, 128, False, 1e-10)
        assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == (37, 576)
        assert x_scale.shape == (37, 5) and x_scale.stride() == (1, get_tma_aligned_m(37))
        h = torch.empty(3, 7, 512, dtype=BF16)
        y_fp8, y_scale = torch.ops.moe_fp8.silu_mul_per_token_group_quant(h, 128, False, None, 1e-10)
        assert y_fp8.shape == (3, 7, 256) and y_scale.shape == (3, 7, 2)
        assert y_scale.stride() == (2 * 8, 1, 8)


# --------------------------------------------------------------------------------------------
# opcheck (tiny shapes)
# --------------------------------------------------------------------------------------------

def _opcheck(op, args, test_utils=NO_SCHEMA):
    torch.library.opcheck(op, args, test_utils=test_utils)


@pytest.mark.slow
def test_opcheck_gemms():
    g = make_gemm_inputs(5, 16, 48, seed=10)
    _opcheck(torch.ops.moe_fp8.fp8_gemm.default,
             (g.x_fp8, g.x_scale, g.w_fp8, g.w_scale, torch.empty(5, 16, dtype=BF16)))
    c = make_contiguous_inputs(2, 20, 16, 48, seed=11)
    _opcheck(torch.ops.moe_fp8.fp8_grouped_gemm_contiguous.default,
             (c.x_fp8, c.x_scale, c.w_fp8, c.w_scale, c.m_indices, torch.zeros(c.x_fp8.shape[0], 16, dtype=BF16)))
    _opcheck(torch.ops.moe_fp8.fp8_grouped_gemm_contiguous.default,
             (c.x_fp8, c.x_scale, c.w_fp8, c.w_scale, c.m_indices, torch.zeros(c.x_fp8.shape[0], 16, dtype=BF16),
              torch.tensor([c.group_starts[1]], dtype=torch.int32)))
    mi = make_masked_inputs(2, 4, 2, 16, 48, seed=12)
    _opcheck(torch.ops.moe_fp8.fp8_grouped_gemm_masked.default,
             (mi.x_fp8, mi.x_scale, mi.w_fp8, mi.w_scale, mi.masked_m, mi.expected_m,
              torch.zeros(2, 4, 16, dtype=BF16)))


@pytest.mark.slow
def test_opcheck_quant():
    all_checks = ("test_schema", *NO_SCHEMA)
    _opcheck(torch.ops.moe_fp8.per_token_group_quant.default, (randn((5, 48), seed=13), 128, False, 1e-10),
             all_checks)
    _opcheck(torch.ops.moe_fp8.per_token_group_quant.default, (randn((2, 3, 32), seed=14), 16, True, 1e-10),
             all_checks)
    _opcheck(torch.ops.moe_fp8.per_block_quant.default, (randn((2, 24, 48), seed=15), [16, 32], False, 1e-10),
             all_checks)
    h = randn((2, 3, 64), seed=16)
    _opcheck(torch.ops.moe_fp8.silu_mul_per_token_group_quant.default,
             (h, 128, False, torch.tensor([1, 3], dtype=torch.int32), 1e-10), all_checks)
    _opcheck(torch.ops.moe_fp8.silu_mul_per_token_group_quant.default, (h[0], 16, True, None, 1e-10), all_checks)


@pytest.mark.slow
def test_opcheck_routing_dispatch_combine():
    all_checks = ("test_schema", *NO_SCHEMA)
    logits = randn((5, 8), seed=17, dtype=torch.float32)
    _opcheck(torch.ops.moe_fp8.router_gemm.default, (randn((5, 32), seed=20), randn((8, 32), seed=21)), all_checks)
    _opcheck(torch.ops.moe_fp8.select_experts.default,
             (logits, 2, "softmax", True, None, None, None, 1.0), all_checks)
    _opcheck(torch.ops.moe_fp8.select_experts.default,
             (logits, 3, "sigmoid", True, 4, 2, torch.zeros(8), 2.5), all_checks)
    d = make_dispatch_inputs(6, 48, 4, 2, seed=18)
    _opcheck(torch.ops.moe_fp8.dispatch_masked.default, (d.x_fp8, d.x_scale, d.topk_ids, 4, 3, None))
    emap = torch.tensor([1, -1, 0, 2], dtype=torch.int64)
    _opcheck(torch.ops.moe_fp8.quant_dispatch_masked.default, (d.x, d.topk_ids, 3, 3, emap, True, 1e-10),
             ("test_schema", *NO_SCHEMA))  # no FP8 input: every check runs
    y = randn((4, 3, 32), seed=19)
    row_map = torch.tensor([[0, 5], [-1, 7], [3, 11], [2, -1], [1, 4], [9, 10]])
    _opcheck(torch.ops.moe_fp8.combine.default, (y, row_map, d.topk_weights, None), all_checks)
    _opcheck(torch.ops.moe_fp8.combine.default, (y, row_map, d.topk_weights, randn((6, 32), seed=20)), all_checks)
