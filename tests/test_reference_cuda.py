"""The PyTorch oracle on CUDA: same results as on CPU, no host sync where promised, graph-capturable
decode path, and full FP32 matmuls even when the process allows TF32. Skipped without a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_fp8 import reference as ref
from moe_fp8.testing import make_contiguous_inputs, make_dispatch_inputs, make_masked_inputs, randn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@contextlib.contextmanager
def no_host_sync():
    """Raise on any device → host synchronization inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def to_cuda(*tensors):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in tensors]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a.cpu(), b.cpu())


def test_quant_cuda_matches_cpu_without_sync():
    x = randn((37, 600), seed=1)
    w = randn((300, 600), seed=2)
    h = randn((3, 9, 512), seed=3)
    masked_m = torch.tensor([0, 9, 4], dtype=torch.int32)
    xc, wc, hc, mc = to_cuda(x, w, h, masked_m)
    with no_host_sync():
        gpu = [*ref.per_token_group_quant(xc, ue8m0=True), *ref.per_block_quant(wc),
               *ref.silu_mul_per_token_group_quant(hc, masked_m=mc)]
    cpu = [*ref.per_token_group_quant(x, ue8m0=True), *ref.per_block_quant(w),
           *ref.silu_mul_per_token_group_quant(h, masked_m=masked_m)]
    names = ["x_fp8", "x_scale", "w_fp8", "w_scale", "y_fp8", "y_scale"]
    for name, a, b in zip(names, gpu, cpu, strict=True):
        assert same_bytes(a, b), name
    assert gpu[1].stride() == cpu[1].stride()


def test_gemms_cuda_full_fp32_and_no_sync():
    prev = torch.get_float32_matmul_precision()
    masked = make_masked_inputs(4, 24, 12, 256, 1024, seed=4, masked_m=[0, 24, 5, 12])
    contig = make_contiguous_inputs(3, 20, 256, 1024, seed=5, num_empty=1)
    cpu_masked = ref.fp8_grouped_gemm_masked(masked.x_fp8, masked.x_scale, masked.w_fp8, masked.w_scale,
                                             masked.masked_m)
    cpu_contig = ref.fp8_grouped_gemm_contiguous(contig.x_fp8, contig.x_scale, contig.w_fp8, contig.w_scale,
                                                 contig.m_indices)
    torch.set_float32_matmul_precision("high")  # TF32 allowed: the oracle must not use it
    try:
        m_args = to_cuda(masked.x_fp8, masked.x_scale, masked.w_fp8, masked.w_scale, masked.masked_m)
        c_args = to_cuda(contig.x_fp8, contig.x_scale, contig.w_fp8, contig.w_scale, contig.m_indices)
        with no_host_sync():
            gpu_masked = ref.fp8_grouped_gemm_masked(*m_args)
            gpu_contig = ref.fp8_grouped_gemm_contiguous(*c_args)
    finally:
        torch.set_float32_matmul_precision(prev)
    # FP32 sums in another order differ by ~1e-7 of Σ|x·w|, which may flip a bf16 rounding.
    x64 = ref.dequant_per_token_group(masked.x_fp8, masked.x_scale).double()
    w64 = ref.dequant_per_block(masked.w_fp8, masked.w_scale).double()
    mag_masked = x64.abs() @ w64.abs().transpose(1, 2)
    x64 = ref.dequant_per_token_group(contig.x_fp8, contig.x_scale).double()
    w64 = ref.dequant_per_block(contig.w_fp8, contig.w_scale).double()
    ids = contig.m_indices.long().clamp_min(0)
    mag_contig = torch.einsum("mk,mnk->mn", x64.abs(), w64.abs()[ids])
    for gpu, cpu, mag in ((gpu_masked, cpu_masked, mag_masked), (gpu_contig, cpu_contig, mag_contig)):
        g, c = gpu.cpu().double(), cpu.double()
        excess = (g - c).abs() - (2.0**-7 * c.abs() + 1e-5 * mag)
        assert bool((excess <= 0).all()), f"max excess {excess.max().item()}"


def test_routing_dispatch_combine_cuda_matches_cpu_without_sync():
    inp = make_dispatch_inputs(50, 256, 16, 4, seed=6, skew=1.0)
    logits = randn((50, 16), seed=7, dtype=torch.float32)
    bias = 0.1 * randn((16,), seed=8, dtype=torch.float32)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3, 4, 5, -1, 6, 7, 8, 9, -1, 10, 11], dtype=torch.int32)
    route = dict(top_k=4, scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)

    cpu_w, cpu_ids = ref.select_experts(logits, e_score_correction_bias=bias, **route)
    cpu_disp = ref.dispatch_masked(inp.x_fp8, inp.x_scale, cpu_ids, 12, 8, expert_map)
    cpu_y = ref.dequant_per_token_group(cpu_disp[0], cpu_disp[1]).to(torch.bfloat16)
    cpu_out = ref.combine(cpu_y, cpu_disp[3], cpu_w)

    x_fp8, x_scale, lc, bc, mc = to_cuda(inp.x_fp8, inp.x_scale, logits, bias, expert_map)
    with no_host_sync():
        w, ids = ref.select_experts(lc, e_score_correction_bias=bc, **route)
        disp = ref.dispatch_masked(x_fp8, x_scale, ids, 12, 8, mc)
        y = ref.dequant_per_token_group(disp[0], disp[1]).to(torch.bfloat16)
        out = ref.combine(y, disp[3], w)
    assert torch.equal(ids.cpu(), cpu_ids)
    torch.testing.assert_close(w.cpu(), cpu_w)
    for a, b in zip(disp, cpu_disp, strict=True):
        assert same_bytes(a, b)
    torch.testing.assert_close(out.cpu().float(), cpu_out.float(), rtol=2**-7, atol=1e-3)

    # contiguous dispatch (host sync allowed there) agrees with the CPU too
    gpu_c = ref.dispatch_contiguous(x_fp8, x_scale, ids, 12, mc)
    cpu_c = ref.dispatch_contiguous(inp.x_fp8, inp.x_scale, cpu_ids, 12, expert_map)
    for a, b in zip(gpu_c, cpu_c, strict=True):
        assert same_bytes(a, b)


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_routing_special_rows_cuda_matches_cpu(scoring_func):
    """Ties, NaN, -inf and +inf logits: the same ids and weights on both devices (a row holding +inf
    once picked other ids on CUDA: its softmax is NaN with the sign bit set, which CUDA's sort put last)."""
    logits = torch.zeros(6, 24)
    logits[1, ::3] = 1.0
    logits[2, 5] = float("nan")
    logits[3, :] = -float("inf")
    logits[3, 7] = 0.0
    logits[4, 10] = float("inf")
    logits[5] = randn((24,), seed=3, dtype=torch.float32)
    logits[5, 3::4] = -0.0
    for n_group, topk_group in ((None, None), (4, 2)):
        route = dict(top_k=4, scoring_func=scoring_func, n_group=n_group, topk_group=topk_group)
        cpu_w, cpu_ids = ref.select_experts(logits, **route)
        w, ids = ref.select_experts(logits.cuda(), **route)
        assert torch.equal(ids.cpu(), cpu_ids)
        torch.testing.assert_close(w.cpu(), cpu_w, equal_nan=True)


def test_masked_decode_path_is_graph_capturable():
    """dispatch_masked → masked GEMM → combine captured once, replayed with other routings."""
    num_tokens, hidden, num_experts, top_k, max_m = 16, 256, 8, 2, 8
    weights = make_masked_inputs(num_experts, max_m, 4, hidden, hidden, seed=9, device="cuda")
    first = make_dispatch_inputs(num_tokens, hidden, num_experts, top_k, seed=10, device="cuda")
    static = [t.clone() for t in (first.x_fp8, first.x_scale, first.topk_ids, first.topk_weights)]

    def step(x_fp8, x_scale, topk_ids, topk_weights):
        a_fp8, a_scale, masked_m, row_map = ref.dispatch_masked(x_fp8, x_scale, topk_ids, num_experts, max_m)
        y = ref.fp8_grouped_gemm_masked(a_fp8, a_scale, weights.w_fp8, weights.w_scale, masked_m)
        return ref.combine(y, row_map, topk_weights)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(*static)

    for seed, skew in ((11, 0.0), (12, 3.0)):  # skew 3 overflows max_m on hot experts
        new = make_dispatch_inputs(num_tokens, hidden, num_experts, top_k, seed=seed, device="cuda", skew=skew)
        for dst, src in zip(static, (new.x_fp8, new.x_scale, new.topk_ids, new.topk_weights), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, step(new.x_fp8, new.x_scale, new.topk_ids, new.topk_weights))
