"""The data path as a whole: which backend runs it, and a CUDA graph of the decode step.

- Backend wiring (CPU, simulated GPUs): the seven data-path ops resolve to the Triton kernels on Hopper
  (``hopper`` backend) and on other GPUs (``portable``), never to the reference.
- CUDA graph (GPU): quant → route → dispatch_masked → SiLU·mul+quant (masked) → combine captured
  once, replayed with new inputs (new routing, so new ``masked_m``), every output checked against the
  reference each time — a graph that baked in the first replay's counts would fail.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch
from datapath_util import assert_same_bits, check_silu_close

import moe_fp8
from moe_fp8 import backends
from moe_fp8 import reference as ref
from moe_fp8.testing import make_routing_inputs, randn

DATA_OPS = ("per_token_group_quant", "silu_mul_per_token_group_quant", "select_experts", "dispatch_contiguous",
            "dispatch_masked", "quant_dispatch_contiguous", "quant_dispatch_masked", "combine")


@dataclass
class _Compiler:
    name: str = "nvrtc"
    version: str = "12.8"
    available: bool = True
    reason: str = ""


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend cuda:0 exists with a given capability and a JIT compiler (as tests/test_backends.py)."""
    pytest.importorskip("triton")

    def make(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
        fake = types.ModuleType("moe_fp8.kernels.jit.compiler")
        fake.find_compilers = lambda: [_Compiler()]
        monkeypatch.setitem(sys.modules, "moe_fp8.kernels.jit.compiler", fake)
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
        monkeypatch.setenv(backends.ENV_STRICT, "1")  # any fallback raises
        backends.clear_cache()
        return torch.device("cuda", 0)

    yield make
    backends.clear_cache()


@pytest.mark.parametrize(("capability", "backend"), [((9, 0), "hopper"), ((8, 9), "portable"), ((10, 0), "portable")])
def test_data_path_ops_select_their_kernels(fake_gpu, capability, backend):
    """The Triton kernels everywhere, but on Hopper the quantization, routing and the dispatches: their CUDA kernels
    (which hand the calls they do not cover to the Triton ones; the quantizing dispatches keep the Triton scatter,
    routed by a CUDA kernel)."""
    from moe_fp8.kernels.dispatch import (
        dispatch_contiguous_hopper,
        dispatch_masked_hopper,
        quant_dispatch_contiguous_hopper,
        quant_dispatch_masked_hopper,
    )
    from moe_fp8.kernels.quant import per_token_group_quant_hopper, silu_mul_per_token_group_quant_hopper
    from moe_fp8.kernels.routing import select_experts_hopper
    from moe_fp8.kernels.triton import dispatch, quant, routing

    kernels = {"per_token_group_quant": quant.per_token_group_quant,
               "silu_mul_per_token_group_quant": quant.silu_mul_per_token_group_quant,
               "select_experts": routing.select_experts, "dispatch_contiguous": dispatch.dispatch_contiguous,
               "dispatch_masked": dispatch.dispatch_masked,
               "quant_dispatch_contiguous": dispatch.quant_dispatch_contiguous,
               "quant_dispatch_masked": dispatch.quant_dispatch_masked, "combine": dispatch.combine}
    dev = fake_gpu(capability)
    for op in DATA_OPS:
        assert backends.implementations(op) == ("hopper", "portable", "reference")
        hopper = {"select_experts": select_experts_hopper, "dispatch_contiguous": dispatch_contiguous_hopper,
                  "dispatch_masked": dispatch_masked_hopper, "per_token_group_quant": per_token_group_quant_hopper,
                  "silu_mul_per_token_group_quant": silu_mul_per_token_group_quant_hopper,
                  "quant_dispatch_contiguous": quant_dispatch_contiguous_hopper,
                  "quant_dispatch_masked": quant_dispatch_masked_hopper}
        want = hopper.get(op, kernels[op]) if backend == "hopper" else kernels[op]
        assert backends.select(op, dev) == (backend, want), op
        assert moe_fp8.backend(op, dev) == backend


def test_data_path_ops_stay_on_the_reference_for_cpu_tensors():
    for op in DATA_OPS:
        assert moe_fp8.backend(op, "cpu") == "reference"


# ----------------------------------------------------------------------------------------------
# CUDA graph of the decode data path
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_decode_data_path_cuda_graph_replays_with_new_routing():
    torch.manual_seed(0)
    t, hidden, e, top_k, inter, max_m = 96, 2048, 64, 8, 512, 64
    dev = "cuda"
    x = torch.empty(t, hidden, device=dev, dtype=torch.bfloat16)
    logits = torch.empty(t, e, device=dev)
    bias = torch.empty(e, device=dev)
    h = torch.empty(e, max_m, 2 * inter, device=dev, dtype=torch.bfloat16)  # stands in for GEMM 1's output
    y = torch.empty(e, max_m, hidden, device=dev, dtype=torch.bfloat16)  # stands in for GEMM 2's output
    shared = torch.empty(t, hidden, device=dev, dtype=torch.bfloat16)

    def fill(seed: int) -> None:
        x.copy_(randn((t, hidden), seed=seed, device=dev))
        r = make_routing_inputs(t, e, seed=seed + 1, device=dev, with_bias=True)
        # a skew that changes per replay: different experts are hot, different masked_m
        logits.copy_(r.router_logits + 3 * torch.linspace(-1, 1, e, device=dev).roll(7 * seed))
        bias.copy_(r.e_score_correction_bias)
        h.copy_(randn(h.shape, seed=seed + 2, device=dev))
        y.copy_(randn(y.shape, seed=seed + 3, device=dev))
        shared.copy_(randn((t, hidden), seed=seed + 4, device=dev))

    def step():
        x_fp8, x_scale = moe_fp8.quant.per_token_group(x)
        weights, ids = moe_fp8.layers.select_experts(logits, top_k, scoring_func="sigmoid", n_group=8, topk_group=4,
                                                     e_score_correction_bias=bias, routed_scaling_factor=2.5)
        d_fp8, d_scale, masked_m, row_map = moe_fp8.layers.dispatch_masked(x_fp8, x_scale, ids, e, max_m)
        a_fp8, a_scale = moe_fp8.quant.silu_mul_per_token_group(h, masked_m=masked_m)
        out = moe_fp8.layers.combine(y, row_map, weights, shared)
        return x_fp8, x_scale, weights, ids, d_fp8, d_scale, masked_m, row_map, a_fp8, a_scale, out

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile every kernel outside the capture
        step()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    counts = set()
    for seed in (10, 20, 30):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        x_fp8, x_scale, weights, ids, d_fp8, d_scale, masked_m, row_map, a_fp8, a_scale, out = outs
        r_fp8, r_scale = ref.per_token_group_quant(x)
        assert_same_bits(x_fp8, r_fp8, "quant bytes")
        assert_same_bits(x_scale, r_scale, "quant scales")
        r_w, r_ids = ref.select_experts(logits, top_k, scoring_func="sigmoid", n_group=8, topk_group=4,
                                        e_score_correction_bias=bias, routed_scaling_factor=2.5)
        assert_same_bits(ids, r_ids, "topk_ids")
        torch.testing.assert_close(weights, r_w, rtol=2.0**-21, atol=0)  # sum order: a few ulps
        r_d = ref.dispatch_masked(r_fp8, r_scale, r_ids, e, max_m)
        assert_same_bits(masked_m, r_d[2], "masked_m")
        assert_same_bits(row_map, r_d[3], "row_map")
        valid = torch.arange(max_m, device=dev)[None, :] < r_d[2][:, None]
        assert_same_bits(d_fp8[valid], r_d[0][valid], "dispatched bytes")
        assert_same_bits(d_scale[valid], r_d[1][valid], "dispatched scales")
        r_a = ref.silu_mul_per_token_group_quant(h, masked_m=r_d[2])
        check_silu_close((a_fp8, a_scale), r_a, rows_mask=valid)  # FP32 SiLU: tolerance (datapath.md)
        assert_same_bits(out, ref.combine(y, r_d[3], weights, shared), "combine")
        counts.add(tuple(masked_m.tolist()))
    assert len(counts) == 3, "the replays should have routed differently"
