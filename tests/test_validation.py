"""Every validation rule of the public ops: exception type, and a message naming the argument.

Each case starts from valid arguments and breaks exactly one rule. The GEMM checkers try a flat
fast-path predicate first (moe_fp8.validation NOTE), so these cases also prove that predicate
never accepts an invalid call.
"""

from __future__ import annotations

import pytest
import torch

import moe_fp8
from moe_fp8 import layers, quant
from moe_fp8 import reference as ref
from moe_fp8 import validation as V
from moe_fp8.compat import deep_gemm
from moe_fp8.utils import empty_scale_tma

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
META = torch.device("meta")

# Small ragged shapes: K = 176 is a multiple of 16 but not of 128 (2 scale groups, the last partial),
# N = 24 is not a multiple of 128.
M, N, K = 5, 24, 176
G, MAX_M, ALIGNED_M = 2, 6, 128


def _q(shape, seed=0):
    torch.manual_seed(seed)
    return ref.per_token_group_quant(torch.randn(shape))


def _w(shape, seed=1):
    torch.manual_seed(seed)
    return ref.per_block_quant(torch.randn(shape))


def gemm_args() -> dict:
    x_fp8, x_scale = _q((M, K))
    w, w_scale = _w((N, K))
    return dict(x_fp8=x_fp8, x_scale=x_scale, w=w, w_scale=w_scale, out=torch.empty(M, N, dtype=BF16))


def contiguous_args() -> dict:
    x_fp8, x_scale = _q((ALIGNED_M, K))
    w, w_scale = _w((G, N, K))
    m_indices = torch.zeros(ALIGNED_M, dtype=torch.int32)
    return dict(x_fp8=x_fp8, x_scale=x_scale, w=w, w_scale=w_scale, m_indices=m_indices,
                out=torch.empty(ALIGNED_M, N, dtype=BF16))


def masked_args() -> dict:
    x_fp8, x_scale = _q((G, MAX_M, K))
    w, w_scale = _w((G, N, K))
    return dict(x_fp8=x_fp8, x_scale=x_scale, w=w, w_scale=w_scale,
                masked_m=torch.tensor([3, 0], dtype=torch.int32), expected_m=2,
                out=torch.empty(G, MAX_M, N, dtype=BF16))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype, contiguous, but starting one element after a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    return flat[1:].view(t.shape)


# (name, mutation, exception, message regex)
GEMM_CASES = [
    ("x_fp8 not a tensor", lambda a: a.update(x_fp8=[[1.0]]), TypeError, r"x_fp8 must be a torch\.Tensor, got list"),
    ("x_fp8 dtype", lambda a: a.update(x_fp8=a["x_fp8"].to(BF16)), TypeError,
     r"x_fp8 must be torch\.float8_e4m3fn, got torch\.bfloat16"),
    ("x_fp8 3-D", lambda a: a.update(x_fp8=a["x_fp8"][None]), ValueError, r"x_fp8 must be 2-D \[M, K\], got 3-D"),
    ("x_fp8 non-contiguous", lambda a: a.update(x_fp8=a["x_fp8"].t().contiguous().t()), ValueError,
     r"x_fp8 must be contiguous .*strides \(176, 1\).*got strides \(1, 5\)"),
    ("x_fp8 misaligned", lambda a: a.update(x_fp8=_misaligned(a["x_fp8"])), ValueError,
     r"x_fp8 must start on a 16-byte boundary"),
    ("K not multiple of 16", lambda a: a.update(x_fp8=a["x_fp8"][:, :40].contiguous()), ValueError,
     r"x_fp8 K .* multiple of 16.*got 40"),
    ("w not a tensor", lambda a: a.update(w=None), TypeError, r"w must be a torch\.Tensor, got NoneType"),
    ("w dtype", lambda a: a.update(w=a["w"].float()), TypeError, r"w must be torch\.float8_e4m3fn, got torch\.float32"),
    ("w 3-D", lambda a: a.update(w=a["w"][None]), ValueError, r"w must be 2-D \[N, K\]"),
    ("w K mismatch", lambda a: a.update(w=_w((N, 64))[0]), ValueError, r"w must have shape \[N, K\] with K = .*176"),
    ("N not multiple of 8", lambda a: a.update(w=_w((20, K))[0], w_scale=_w((20, K))[1]), ValueError,
     r"w N .* multiple of 8.*got 20"),
    ("w non-contiguous", lambda a: a.update(w=a["w"].t().contiguous().t()), ValueError, r"w must be contiguous"),
    ("w on another device", lambda a: a.update(w=a["w"].to(META)), ValueError,
     r"w must be on the same device as x_fp8 \(cpu\), got meta"),
    ("x_scale dtype", lambda a: a.update(x_scale=a["x_scale"].double()), TypeError,
     r"x_scale must be torch\.float32, got torch\.float64"),
    ("x_scale shape", lambda a: a.update(x_scale=empty_scale_tma(M, 3)), ValueError,
     r"x_scale must have shape \(5, 2\) = \[M, ceil\(K/128\)\], got \(5, 3\)"),
    ("x_scale row-major", lambda a: a.update(x_scale=a["x_scale"].contiguous()), ValueError,
     r"x_scale must be column-major with M padded to a multiple of 4 \(strides \(1, 8\) for shape \(5, 2\)\); "
     r"got strides \(2, 1\) — use moe_fp8\.utils\.to_scale_tma_layout\(x_scale\)"),
    ("x_scale M not padded", lambda a: a.update(x_scale=torch.ones(2, M).t()), ValueError,
     r"x_scale must be column-major .*got strides \(1, 5\)"),
    ("x_scale misaligned", lambda a: a.update(x_scale=torch.ones(17)[1:].view(2, 8)[:, :M].t()), ValueError,
     r"x_scale must start on a 16-byte boundary"),
    ("x_scale on another device", lambda a: a.update(x_scale=empty_scale_tma(M, 2, device=META)), ValueError,
     r"x_scale must be on the same device as x_fp8"),
    ("w_scale dtype", lambda a: a.update(w_scale=a["w_scale"].half()), TypeError, r"w_scale must be torch\.float32"),
    ("w_scale shape", lambda a: a.update(w_scale=torch.ones(2, 2)), ValueError,
     r"w_scale must have shape \(1, 2\) = \[ceil\(N/128\), ceil\(K/128\)\], got \(2, 2\)"),
    ("out dtype", lambda a: a.update(out=torch.empty(M, N)), TypeError, r"out must be torch\.bfloat16, got torch\.float32"),
    ("out shape", lambda a: a.update(out=torch.empty(M, N + 8, dtype=BF16)), ValueError,
     r"out must have shape \(5, 24\) = \[M, N\], got \(5, 32\)"),
    ("out non-contiguous", lambda a: a.update(out=torch.empty(N, M, dtype=BF16).t()), ValueError,
     r"out must be contiguous"),
    ("out on another device", lambda a: a.update(out=torch.empty(M, N, dtype=BF16, device=META)), ValueError,
     r"out must be on the same device as x_fp8"),
]


@pytest.mark.parametrize("name,mutate,exc,pattern", GEMM_CASES, ids=[c[0] for c in GEMM_CASES])
def test_fp8_gemm_rejects(name, mutate, exc, pattern):
    args = gemm_args()
    mutate(args)
    with pytest.raises(exc, match=pattern):
        moe_fp8.fp8_gemm(**args)


def test_fp8_gemm_rejects_noncontiguous_w_scale():
    args = gemm_args()
    args["w_scale"] = torch.ones(1, 4)[:, ::2]  # shape (1, 2), strides (4, 2): not contiguous
    args["out"] = None
    with pytest.raises(ValueError, match=r"w_scale must be contiguous"):
        moe_fp8.fp8_gemm(**args)


def test_fp8_gemm_accepts_valid_edge_layouts():
    """Valid but unusual inputs pass (they miss the fast path and go through the step-by-step checks)."""
    args = gemm_args()
    # KG == 1: the scale's column stride is irrelevant (a single column), so any stride(1) is valid.
    x1, s1 = _q((M, 48))
    w1, ws1 = _w((N, 48))
    out = torch.empty(M, N, dtype=BF16)
    assert moe_fp8.fp8_gemm(x1, s1.contiguous(), w1, ws1, out) is out
    # M == 0.
    x0, s0 = _q((0, K))
    assert moe_fp8.fp8_gemm(x0, s0, args["w"], args["w_scale"]).shape == (0, N)


CONTIGUOUS_CASES = [
    ("M_total not aligned", lambda a: a.update(x_fp8=_q((100, K))[0], x_scale=_q((100, K))[1],
                                               m_indices=torch.zeros(100, dtype=torch.int32), out=None),
     ValueError, r"x_fp8 rows \(M_total = 100\) must be a multiple of get_align_m\(\) = 128"),
    ("w 2-D", lambda a: a.update(w=a["w"][0]), ValueError, r"w must be 3-D \[G, N, K\], got 2-D"),
    ("w zero groups", lambda a: a.update(w=a["w"][:0], w_scale=a["w_scale"][:0]), ValueError,
     r"w must have at least one group"),
    ("w_scale groups", lambda a: a.update(w_scale=a["w_scale"][:1]), ValueError,
     r"w_scale must have shape \(2, 1, 2\) = \[G, ceil\(N/128\), ceil\(K/128\)\], got \(1, 1, 2\)"),
    ("x_scale row-major", lambda a: a.update(x_scale=a["x_scale"].contiguous()), ValueError,
     r"x_scale must be column-major .*strides \(1, 128\) for shape \(128, 2\)"),
    ("m_indices not a tensor", lambda a: a.update(m_indices=[0] * 128), TypeError,
     r"m_indices must be a torch\.Tensor, got list"),
    ("m_indices int64", lambda a: a.update(m_indices=a["m_indices"].long()), TypeError,
     r"m_indices must be torch\.int32, got torch\.int64"),
    ("m_indices shape", lambda a: a.update(m_indices=a["m_indices"][:64]), ValueError,
     r"m_indices must have shape \(128,\) = \[M_total\], got \(64,\)"),
    ("m_indices non-contiguous", lambda a: a.update(m_indices=torch.zeros(256, dtype=torch.int32)[::2]), ValueError,
     r"m_indices must be contiguous"),
    ("m_indices device", lambda a: a.update(m_indices=a["m_indices"].to(META)), ValueError,
     r"m_indices must be on the same device as x_fp8"),
    ("out shape", lambda a: a.update(out=torch.empty(128, 8, dtype=BF16)), ValueError,
     r"out must have shape \(128, 24\) = \[M_total, N\]"),
    ("m_total int64", lambda a: a.update(m_total=torch.zeros(1, dtype=torch.int64)), TypeError,
     r"m_total must be torch\.int32, got torch\.int64"),
    ("m_total shape", lambda a: a.update(m_total=torch.zeros(2, dtype=torch.int32)), ValueError,
     r"m_total must have shape \(1,\) = \[1\], got \(2,\)"),
    ("m_total device", lambda a: a.update(m_total=torch.zeros(1, dtype=torch.int32, device=META)), ValueError,
     r"m_total must be on the same device as the data"),
    ("m_total not a tensor", lambda a: a.update(m_total=128), TypeError, r"m_total must be a torch\.Tensor, got int"),
    ("expected_m zero", lambda a: a.update(expected_m=0), ValueError, r"expected_m must be >= 1, got 0"),
    ("expected_m float", lambda a: a.update(expected_m=8.0), TypeError, r"expected_m must be an int .*got float"),
]


@pytest.mark.parametrize("name,mutate,exc,pattern", CONTIGUOUS_CASES, ids=[c[0] for c in CONTIGUOUS_CASES])
def test_grouped_contiguous_rejects(name, mutate, exc, pattern):
    args = contiguous_args()
    mutate(args)
    with pytest.raises(exc, match=pattern):
        moe_fp8.fp8_grouped_gemm_contiguous(**args)


def _scale3d_wrong_layout() -> torch.Tensor:
    return torch.ones(G, MAX_M, 2)  # row-major per group


MASKED_CASES = [
    ("x_fp8 2-D", lambda a: a.update(x_fp8=a["x_fp8"][0]), ValueError, r"x_fp8 must be 3-D \[G, max_m, K\]"),
    ("group mismatch", lambda a: a.update(w=_w((3, N, K))[0], w_scale=_w((3, N, K))[1]), ValueError,
     r"x_fp8 must have G = w\.shape\[0\] = 3 groups, got shape \(2, 6, 176\)"),
    ("x_scale 3-D layout", lambda a: a.update(x_scale=_scale3d_wrong_layout()), ValueError,
     r"x_scale must be column-major with M padded to a multiple of 4 \(strides \(16, 1, 8\) for shape \(2, 6, 2\)\); "
     r"got strides \(12, 2, 1\)"),
    ("masked_m int64", lambda a: a.update(masked_m=a["masked_m"].long()), TypeError,
     r"masked_m must be torch\.int32, got torch\.int64"),
    ("masked_m list", lambda a: a.update(masked_m=[3, 0]), TypeError, r"masked_m must be a torch\.Tensor"),
    ("masked_m shape", lambda a: a.update(masked_m=torch.zeros(3, dtype=torch.int32)), ValueError,
     r"masked_m must have shape \(2,\) = \[G\], got \(3,\)"),
    ("masked_m device", lambda a: a.update(masked_m=a["masked_m"].to(META)), ValueError,
     r"masked_m must be on the same device as the data \(cpu; no host sync"),
    ("expected_m zero", lambda a: a.update(expected_m=0), ValueError, r"expected_m must be >= 1, got 0"),
    ("expected_m float", lambda a: a.update(expected_m=2.0), TypeError, r"expected_m must be an int .*got float"),
    ("expected_m tensor", lambda a: a.update(expected_m=torch.tensor(2)), TypeError,
     r"expected_m must be an int \(a host value, not a tensor\), got Tensor"),
    ("expected_m bool", lambda a: a.update(expected_m=True), TypeError, r"expected_m must be an int .*got bool"),
    ("out shape", lambda a: a.update(out=torch.empty(G, MAX_M + 1, N, dtype=BF16)), ValueError,
     r"out must have shape \(2, 6, 24\) = \[G, max_m, N\]"),
    ("out dtype", lambda a: a.update(out=torch.empty(G, MAX_M, N, dtype=torch.float16)), TypeError,
     r"out must be torch\.bfloat16, got torch\.float16"),
]


@pytest.mark.parametrize("name,mutate,exc,pattern", MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_grouped_masked_rejects(name, mutate, exc, pattern):
    args = masked_args()
    mutate(args)
    with pytest.raises(exc, match=pattern):
        moe_fp8.fp8_grouped_gemm_masked(**args)


def test_fast_predicates_reject_what_the_checks_reject():
    """Belt and braces for the NOTE in moe_fp8.validation: the fast predicates alone, on broken inputs."""
    a = gemm_args()
    assert V._fast_fp8_gemm(a["x_fp8"], a["x_scale"], a["w"], a["w_scale"], a["out"]) == (M, N, K)
    assert V._fast_fp8_gemm(a["x_fp8"], a["x_scale"].contiguous(), a["w"], a["w_scale"], a["out"]) is None
    assert V._fast_fp8_gemm(_misaligned(a["x_fp8"]), a["x_scale"], a["w"], a["w_scale"], a["out"]) is None
    c = contiguous_args()
    assert V._fast_grouped_contiguous(*c.values()) == (G, ALIGNED_M, N, K)
    c["m_indices"] = c["m_indices"].long()
    assert V._fast_grouped_contiguous(*c.values()) is None
    m = masked_args()
    assert V._fast_grouped_masked(*m.values()) == (G, MAX_M, N, K)
    m["expected_m"] = True
    assert V._fast_grouped_masked(*m.values()) is None


# --------------------------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------------------------

X = torch.randn(4, 64, dtype=BF16)

QUANT_CASES = [
    ("x not a tensor", dict(x=1.0), TypeError, r"x must be a torch\.Tensor, got float"),
    ("x int dtype", dict(x=torch.ones(4, 64, dtype=torch.int32)), TypeError,
     r"x must be torch\.bfloat16 or torch\.float16 or torch\.float32, got torch\.int32"),
    ("x 1-D", dict(x=torch.ones(64)), ValueError, r"x must be 2-D or 3-D \[M, K\] or \[G, M, K\], got 1-D"),
    ("x non-contiguous", dict(x=torch.ones(64, 4).t()), ValueError, r"x must be contiguous"),
    ("K not multiple of 16", dict(x=torch.ones(4, 40)), ValueError, r"x K \(last dim\) must be a positive multiple of 16, got 40"),
    ("group_size float", dict(group_size=128.0), TypeError, r"group_size must be an int"),
    ("group_size zero", dict(group_size=0), ValueError, r"group_size must be >= 1, got 0"),
    ("group_size not multiple of 16", dict(group_size=100), ValueError, r"group_size must be a multiple of 16, got 100"),
    ("ue8m0 int", dict(ue8m0=1), TypeError, r"ue8m0 must be a bool, got int"),
    ("eps negative", dict(eps=-1.0), ValueError, r"eps must be > 0, got -1\.0"),
    ("eps str", dict(eps="1e-10"), TypeError, r"eps must be a float, got str"),
]


@pytest.mark.parametrize("name,kwargs,exc,pattern", QUANT_CASES, ids=[c[0] for c in QUANT_CASES])
def test_per_token_group_rejects(name, kwargs, exc, pattern):
    args = dict(x=X)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        quant.per_token_group(**args)


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    ("w dtype", dict(w=torch.ones(8, 16, dtype=FP8)), TypeError, r"w must be torch\.bfloat16 or .*got torch\.float8_e4m3fn"),
    ("w 4-D", dict(w=torch.ones(1, 1, 8, 16)), ValueError, r"w must be 2-D or 3-D"),
    ("w non-contiguous", dict(w=torch.ones(16, 8).t()), ValueError, r"w must be contiguous"),
    ("block one int", dict(block=128), TypeError, r"block must be a pair of ints \(block_n, block_k\), got 128"),
    ("block zero", dict(block=(0, 128)), ValueError, r"block must be positive, got \(0, 128\)"),
    ("ue8m0 str", dict(ue8m0="yes"), TypeError, r"ue8m0 must be a bool"),
    ("eps zero", dict(eps=0.0), ValueError, r"eps must be > 0, got 0\.0"),
    ("eps inf", dict(eps=float("inf")), ValueError, r"eps must be finite, got inf"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_per_block_rejects(name, kwargs, exc, pattern):
    args = dict(w=torch.ones(8, 16))
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        quant.per_block(**args)


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    ("h dtype", dict(h=torch.ones(4, 64, dtype=torch.int64)), TypeError, r"h must be torch\.bfloat16"),
    ("h 1-D", dict(h=torch.ones(64)), ValueError, r"h must be 2-D or 3-D"),
    ("I not multiple of 16", dict(h=torch.ones(4, 48)), ValueError,
     r"h last dim \(2\*I\) must be a positive multiple of 32 \(I % 16 == 0\), got 48"),
    ("masked_m with 2-D h", dict(masked_m=torch.ones(4, dtype=torch.int32)), ValueError,
     r"masked_m must have shape \(1,\) = \[1\] for a 2-D h, got \(4,\)"),
    ("masked_m dtype", dict(h=torch.ones(2, 3, 64), masked_m=torch.ones(2)), TypeError,
     r"masked_m must be torch\.int32, got torch\.float32"),
    ("masked_m shape", dict(h=torch.ones(2, 3, 64), masked_m=torch.ones(3, dtype=torch.int32)), ValueError,
     r"masked_m must have shape \(2,\)"),
    ("group_size", dict(group_size=-16), ValueError, r"group_size must be >= 1, got -16"),
    ("eps", dict(eps=float("nan")), ValueError, r"eps must be > 0, got nan"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_silu_mul_rejects(name, kwargs, exc, pattern):
    args = dict(h=torch.ones(4, 64))
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        quant.silu_mul_per_token_group(**args)


def test_dequant_rejects():
    x_fp8, x_scale = _q((M, K))
    with pytest.raises(TypeError, match=r"x_fp8 must be torch\.float8_e4m3fn, got torch\.float32"):
        quant.dequant_per_token_group(x_fp8.float(), x_scale)
    with pytest.raises(ValueError, match=r"x_scale must match x_fp8 in all but the last dim"):
        quant.dequant_per_token_group(x_fp8, x_scale[:2])
    w, w_scale = _w((N, K))
    with pytest.raises(TypeError, match=r"w_scale must be torch\.float32, got torch\.float64"):
        quant.dequant_per_block(w, w_scale.double())
    with pytest.raises(TypeError, match=r"block must be a pair of ints"):
        quant.dequant_per_block(w, w_scale, block=128)


# --------------------------------------------------------------------------------------------
# routing, dispatch, combine
# --------------------------------------------------------------------------------------------

LOGITS = torch.randn(3, 8)


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    ("logits int", dict(router_logits=torch.ones(3, 8, dtype=torch.int64)), TypeError, r"router_logits must be torch\.bfloat16"),
    ("logits 1-D", dict(router_logits=torch.ones(8)), ValueError, r"router_logits must be 2-D \[T, E\]"),
    ("top_k too big", dict(top_k=9), ValueError, r"top_k must be <= 8, got 9"),
    ("top_k zero", dict(top_k=0), ValueError, r"top_k must be >= 1, got 0"),
    ("top_k float", dict(top_k=2.0), TypeError, r"top_k must be an int"),
    ("scoring_func", dict(scoring_func="relu"), ValueError, r"scoring_func must be one of \('softmax', 'sigmoid'\), got 'relu'"),
    ("scoring_func type", dict(scoring_func=None), TypeError, r"scoring_func must be a str, got NoneType"),
    ("renormalize", dict(renormalize=1), TypeError, r"renormalize must be a bool, got int"),
    ("n_group alone", dict(n_group=4), ValueError, r"n_group and topk_group must be given together"),
    ("n_group not dividing", dict(n_group=3, topk_group=1), ValueError,
     r"n_group must divide the number of experts E = 8, got 3"),
    ("topk_group > n_group", dict(n_group=4, topk_group=5), ValueError, r"topk_group must be <= 4, got 5"),
    ("top_k beyond groups", dict(top_k=5, n_group=4, topk_group=2), ValueError,
     r"top_k must be <= topk_group \* E / n_group = 4, got 5"),
    ("bias shape", dict(e_score_correction_bias=torch.zeros(7)), ValueError,
     r"e_score_correction_bias must have shape \(8,\) = \[E\], got \(7,\)"),
    ("bias device", dict(e_score_correction_bias=torch.zeros(8, device=META)), ValueError,
     r"e_score_correction_bias must be on the same device as router_logits"),
    ("scaling factor", dict(routed_scaling_factor="2"), TypeError, r"routed_scaling_factor must be a float"),
    ("scaling factor NaN", dict(routed_scaling_factor=float("nan")), ValueError,
     r"routed_scaling_factor must be finite, got nan"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_select_experts_rejects(name, kwargs, exc, pattern):
    args = dict(router_logits=LOGITS, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        layers.select_experts(**args)


def dispatch_args() -> dict:
    x_fp8, x_scale = _q((4, 48))
    return dict(x_fp8=x_fp8, x_scale=x_scale, topk_ids=torch.zeros(4, 2, dtype=torch.int32), num_experts=3)


DISPATCH_CASES = [
    ("x_fp8 dtype", dict(x_fp8=torch.ones(4, 48)), TypeError, r"x_fp8 must be torch\.float8_e4m3fn"),
    ("x_scale shape", dict(x_scale=torch.ones(4, 2)), ValueError, r"x_scale must have shape \(4, 1\) = \[T, ceil\(K/128\)\]"),
    ("topk_ids float", dict(topk_ids=torch.zeros(4, 2)), TypeError, r"topk_ids must be torch\.int32 or torch\.int64"),
    ("topk_ids rows", dict(topk_ids=torch.zeros(5, 2, dtype=torch.int32)), ValueError,
     r"topk_ids must have T = x_fp8\.shape\[0\] = 4 rows, got shape \(5, 2\)"),
    ("topk_ids device", dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32, device=META)), ValueError,
     r"topk_ids must be on the same device as x_fp8"),
    ("num_experts zero", dict(num_experts=0), ValueError, r"num_experts must be >= 1, got 0"),
    ("num_experts tensor", dict(num_experts=torch.tensor(3)), TypeError, r"num_experts must be an int"),
    ("expert_map float", dict(expert_map=torch.zeros(8)), TypeError, r"expert_map must be torch\.int32 or torch\.int64"),
    ("expert_map 2-D", dict(expert_map=torch.zeros(2, 4, dtype=torch.int32)), ValueError,
     r"expert_map must be 1-D \[num_global_experts\]"),
]


@pytest.mark.parametrize("name,kwargs,exc,pattern", DISPATCH_CASES, ids=[c[0] for c in DISPATCH_CASES])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_dispatch_rejects(layout, name, kwargs, exc, pattern):
    args = dispatch_args()
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        if layout == "contiguous":
            layers.dispatch_contiguous(**args)
        else:
            layers.dispatch_masked(**args, max_m=4)


def quant_dispatch_args() -> dict:
    return dict(x=torch.ones(4, 48, dtype=BF16), topk_ids=torch.zeros(4, 2, dtype=torch.int32), num_experts=3,
                max_m=4)


QUANT_DISPATCH_REJECTS = [  # both quant_dispatch ops: the quantized input and the dispatch arguments
    ("x fp8", dict(x=torch.ones(4, 48).to(torch.float8_e4m3fn)), TypeError,
     r"x must be torch\.bfloat16 or torch\.float16 or torch\.float32, got torch\.float8_e4m3fn"),
    ("x 3-D", dict(x=torch.ones(1, 4, 48, dtype=BF16)), ValueError, r"x must be 2-D \[T, K\]"),
    ("x strided", dict(x=torch.ones(48, 4, dtype=BF16).t()), ValueError, r"x must be contiguous"),
    ("x K", dict(x=torch.ones(4, 40, dtype=BF16)), ValueError, r"x K \(last dim\) must be a positive multiple of 16"),
    ("x list", dict(x=[[1.0]]), TypeError, r"x must be a torch\.Tensor"),
    ("topk_ids rows", dict(topk_ids=torch.zeros(5, 2, dtype=torch.int32)), ValueError,
     r"topk_ids must have T = x\.shape\[0\] = 4 rows, got shape \(5, 2\)"),
    ("topk_ids device", dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32, device=META)), ValueError,
     r"topk_ids must be on the same device as x\b"),
    ("num_experts zero", dict(num_experts=0), ValueError, r"num_experts must be >= 1, got 0"),
    ("expert_map float", dict(expert_map=torch.zeros(8)), TypeError, r"expert_map must be torch\.int32 or torch\.int64"),
    ("expert_map device", dict(expert_map=torch.zeros(8, dtype=torch.int32, device=META)), ValueError,
     r"expert_map must be on the same device as x\b"),
    ("ue8m0 int", dict(ue8m0=1), TypeError, r"ue8m0 must be a bool"),
    ("eps zero", dict(eps=0.0), ValueError, r"eps must be > 0"),
]


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    *QUANT_DISPATCH_REJECTS,
    ("max_m negative", dict(max_m=-1), ValueError, r"max_m must be >= 0, got -1"),
    ("max_m float", dict(max_m=4.0), TypeError, r"max_m must be an int"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_quant_dispatch_masked_rejects(name, kwargs, exc, pattern):
    args = quant_dispatch_args()
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        layers.quant_dispatch_masked(**args)
    assert moe_fp8.ops.quant_dispatch_masked is layers.quant_dispatch_masked


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    *QUANT_DISPATCH_REJECTS,
    ("align_m zero", dict(align_m=0), ValueError, r"align_m must be >= 1, got 0"),
    ("sync int", dict(sync=1), TypeError, r"sync must be a bool"),
    ("return_x None", dict(return_x=None), TypeError, r"return_x must be a bool"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_quant_dispatch_contiguous_rejects(name, kwargs, exc, pattern):
    args = quant_dispatch_args()
    del args["max_m"]  # the contiguous layout has none
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        layers.quant_dispatch_contiguous(**args)
    assert moe_fp8.ops.quant_dispatch_contiguous is layers.quant_dispatch_contiguous


def test_dispatch_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"max_m must be >= 0, got -1"):
        layers.dispatch_masked(**dispatch_args(), max_m=-1)
    with pytest.raises(TypeError, match=r"max_m must be an int"):
        layers.dispatch_masked(**dispatch_args(), max_m=4.0)
    with pytest.raises(ValueError, match=r"align_m must be >= 1, got 0"):
        layers.dispatch_contiguous(**dispatch_args(), align_m=0)


@pytest.mark.parametrize("name,kwargs,exc,pattern", [
    ("y int", dict(y=torch.ones(8, 16, dtype=torch.int32)), TypeError, r"y must be torch\.bfloat16"),
    ("y 1-D", dict(y=torch.ones(16)), ValueError, r"y must be 2-D or 3-D"),
    ("row_map float", dict(row_map=torch.zeros(4, 2)), TypeError, r"row_map must be torch\.int32 or torch\.int64"),
    ("row_map 1-D", dict(row_map=torch.zeros(4, dtype=torch.int64)), ValueError, r"row_map must be 2-D \[T, top_k\]"),
    ("weights shape", dict(topk_weights=torch.ones(4, 3)), ValueError,
     r"topk_weights must have shape \(4, 2\) = row_map\.shape \[T, top_k\], got \(4, 3\)"),
    ("shared shape", dict(shared_output=torch.ones(4, 8, dtype=BF16)), ValueError,
     r"shared_output must have shape \(4, 16\) = \[T, H\]"),
    ("row_map device", dict(row_map=torch.zeros(4, 2, dtype=torch.int64, device=META)), ValueError,
     r"row_map must be on the same device as y"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_combine_rejects(name, kwargs, exc, pattern):
    args = dict(y=torch.ones(8, 16, dtype=BF16), row_map=torch.zeros(4, 2, dtype=torch.int64),
                topk_weights=torch.ones(4, 2))
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        layers.combine(**args)


# --------------------------------------------------------------------------------------------
# compat shims and helpers
# --------------------------------------------------------------------------------------------

def test_deep_gemm_shims_reject():
    a = gemm_args()
    with pytest.raises(TypeError, match=r"a must be a \(fp8 tensor, fp32 scale\) pair, got Tensor"):
        deep_gemm.fp8_gemm_nt(a["x_fp8"], (a["w"], a["w_scale"]), a["out"])
    with pytest.raises(NotImplementedError, match=r"c \(FP32 accumulator input\)"):
        deep_gemm.fp8_gemm_nt((a["x_fp8"], a["x_scale"]), (a["w"], a["w_scale"]), a["out"], c=a["out"])
    with pytest.raises(ValueError, match=r"recipe must be None or \(1, 128, 128\)"):
        deep_gemm.fp8_gemm_nt((a["x_fp8"], a["x_scale"]), (a["w"], a["w_scale"]), a["out"], recipe=(1, 1, 128))
    # A row-major scale is refused by the GEMM (DeepGEMM would copy it silently) ...
    with pytest.raises(ValueError, match=r"x_scale must be column-major"):
        deep_gemm.fp8_gemm_nt((a["x_fp8"], torch.ones(M, 2)), (a["w"], a["w_scale"]), a["out"])
    with pytest.raises(TypeError, match=r"x must be torch\.float32"):
        deep_gemm.get_col_major_tma_aligned_tensor(torch.ones(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, KG\] or 3-D"):
        deep_gemm.get_col_major_tma_aligned_tensor(torch.ones(4))


def test_set_num_sms_rejects():
    with pytest.raises(ValueError, match=r"num_sms must be a positive int, got 0"):
        moe_fp8.set_num_sms(0)


def test_check_helpers_name_the_argument():
    t = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"foo must have shape \(3, 2\), got \(2, 3\)"):
        V.check_shape("foo", t, (3, 2))
    with pytest.raises(TypeError, match=r"bar must be torch\.int32, got torch\.float32"):
        V.check_dtype("bar", t, torch.int32)
    with pytest.raises(ValueError, match=r"baz must be <= 1, got 2"):
        V.check_int("baz", 2, max_value=1)


def test_to_scale_tma_layout_takes_scales_only():
    from moe_fp8.quant import to_scale_tma_layout

    e8m0 = torch.tensor([[1.0, 0.5], [4.0, 2.0]]).to(torch.float8_e8m0fnu)  # UE8M0 scales are scales
    assert torch.equal(to_scale_tma_layout(e8m0), torch.tensor([[1.0, 0.5], [4.0, 2.0]]))
    with pytest.raises(TypeError, match=r"scale must be a torch\.Tensor, got list"):
        to_scale_tma_layout([[1.0, 2.0]])
    for dtype in (torch.int32, torch.float8_e4m3fn):  # integers and FP8 data are not scales
        with pytest.raises(TypeError, match=f"floating-point scale tensor .* got {dtype}"):
            to_scale_tma_layout(torch.ones(4, 2).to(dtype))
