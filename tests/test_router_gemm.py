"""``router_gemm`` (router logits ``x · wᵀ`` in float32): the Hopper kernel (impls/router_gemm.cuh) and its cuBLAS
fallback against a float64 product, within the float32 error bound; the kernel's plan and its compiled form.

The GPU tests run only on an sm_90 GPU; the CPU ones check the plan, that the variants compile without local
memory, the reference and the validation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datapath_util import poison_empty

from moe_fp8 import layers
from moe_fp8.kernels import router_gemm as rg
from moe_fp8.kernels.jit import find_compilers
from moe_fp8.testing import randn

F32, BF16 = torch.float32, torch.bfloat16
COMPILERS = [c.name for c in find_compilers() if c.available]
# (H, E): DeepSeek-V3 / Kimi-K2, Qwen3-235B, GLM-4.5, MiniMax-M2, and a ragged one (E off the CTA's experts, the
# last K split partial)
MODEL_SHAPES = [(7168, 256), (7168, 384), (4096, 128), (5120, 160), (3072, 256), (1000, 72)]


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 error allowed on each logit: 64 roundings of Σ|x||w| (a lane's chain of at most 32 products, the
    warp's 5 folds and at most 8 splits: 45 in the kernel)."""
    return 64 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())


def check_logits(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert got.dtype == F32 and got.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().t()
    err = (got.double() - exact).abs()
    assert torch.isfinite(got).all()
    assert (err <= bound(x, w)).all(), f"max error {err.max().item():.3g}, bound {bound(x, w).min().item():.3g}"


def test_plan():
    # (T, H, E, weight) -> (token tile, experts a warp, chunks a lane, K splits)
    assert rg.plan(1, 7168, 256, BF16, 132) == (1, 2, 4, 7)  # DeepSeek-V3: 7 x 32 CTAs
    assert rg.plan(3, 7168, 256, BF16, 132) == (4, 2, 4, 7)
    assert rg.plan(8, 7168, 256, F32, 132) == (8, 2, 4, 7)
    assert rg.plan(1, 4096, 128, BF16, 132) == (1, 1, 2, 8)  # Qwen3: 8 splits of 512, a warp an expert
    assert rg.plan(1, 7168, 384, BF16, 132) == (1, 4, 4, 7)  # Kimi-K2: 7 x 24 CTAs of 16 experts
    assert rg.plan(1, 7168, 384, F32, 132) == (1, 2, 4, 7)  # (float32: 8 weight vectors a lane and expert)
    assert rg.plan(2, 1000, 72, BF16, 132) == (2, 1, 1, 4)
    assert rg.plan(9, 7168, 256, BF16, 132) is None  # past the token tiles: cuBLAS
    assert rg.plan(1, 7164, 256, BF16, 132) is None  # rows of whole 16-byte chunks only
    assert rg.plan(1, 7168, 256, torch.float16, 132) is None
    assert [rg.token_tile(t) for t in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


def kernel_plans() -> set[tuple[torch.dtype, int, int, int]]:
    out = set()
    for h, e in MODEL_SHAPES:
        for t in (1, 2, 4, 8):
            for dtype in (BF16, F32):
                tokens, experts, chunks, _ = rg.plan(t, h, e, dtype, 132)
                out.add((dtype, tokens, experts, chunks))
    return out


@pytest.mark.parametrize("compiler", COMPILERS)  # (test_kernel_sources asserts that one is available)
def test_variants_compile_without_local_memory(compiler, tmp_path: Path):
    from moe_fp8.kernels.jit import get_compiler
    from moe_fp8.kernels.jit.cache import include_dir
    from moe_fp8.kernels.sass import count_instructions, dump_sass
    for dtype, tokens, experts, chunks in sorted(kernel_plans(), key=str):
        name, source = rg.kernel_variant(dtype, tokens, experts, chunks)
        sass = dump_sass(get_compiler(compiler).compile_ex(source, name, [include_dir()], tmp_path).cubin)
        assert count_instructions(sass, "LDL") == 0 and count_instructions(sass, "STL") == 0, name
        # every product an FFMA: chunks x 8 elements x tokens x experts a lane
        assert count_instructions(sass, "FFMA") == chunks * 8 * tokens * experts, name


def test_reference_is_float32_linear():
    x, w = randn((5, 96), seed=1), randn((12, 96), seed=2)
    got = layers.router_gemm(x, w)
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float()))
    assert layers.router_gemm(x[:0], w).shape == (0, 12)
    assert torch.equal(layers.router_gemm(x, w.float()), got)


@pytest.mark.parametrize(("x", "w", "exc", "pattern"), [
    (torch.zeros(4, 64, dtype=BF16), torch.zeros(8, 32, dtype=BF16), ValueError, "weight must be"),
    (torch.zeros(4, 64, dtype=torch.int32), torch.zeros(8, 64, dtype=BF16), TypeError, "x"),
    (torch.zeros(4, 64, dtype=BF16), torch.zeros(8, 64, dtype=torch.float8_e4m3fn), TypeError, "weight"),
    (torch.zeros(64, dtype=BF16), torch.zeros(8, 64, dtype=BF16), ValueError, r"\[T, H\]"),
    (torch.zeros(4, 64, dtype=BF16), "w", TypeError, "weight"),
])
def test_rejects(x, w, exc, pattern):
    with pytest.raises(exc, match=pattern):
        layers.router_gemm(x, w)


@pytest.mark.hopper
@pytest.mark.parametrize("h,e", MODEL_SHAPES)
@pytest.mark.parametrize("weight_dtype", [BF16, F32])
def test_kernel_matches_float64(h, e, weight_dtype, monkeypatch):
    def no_cublas(*args):
        raise AssertionError("the kernel's case went to cuBLAS")

    monkeypatch.setattr(rg, "router_gemm_cublas", no_cublas)
    poison_empty(monkeypatch, 0xFF)  # float32 NaN
    w = (0.02 * randn((e, h), seed=e, device="cuda")).to(weight_dtype)
    if weight_dtype == F32:
        w = w + 1e-3 * torch.randn_like(w)  # not bf16 values
    for t in (1, 2, 3, 5, 7, 8):
        x = randn((t, h), seed=100 + t, device="cuda")
        got = layers.router_gemm(x, w)
        check_logits(got, x, w)
        assert torch.equal(got, layers.router_gemm(x, w))  # the same bits every call


@pytest.mark.hopper
def test_strided_and_misaligned_rows():
    w = randn((256, 7168), seed=3, device="cuda")
    wide = randn((8, 7168 + 64), seed=4, device="cuda")
    x = wide[:, 8:7176]  # strided rows
    check_logits(layers.router_gemm(x, w), x, w)
    flat = randn((4 * 7168 + 4,), seed=5, device="cuda")
    x = flat[4:].view(4, 7168)  # 8-byte aligned
    check_logits(layers.router_gemm(x, w), x, w)
    w_view = randn((256, 7168 + 8), seed=6, device="cuda")[:, :7168]
    check_logits(layers.router_gemm(x, w_view), x, w_view)


@pytest.mark.hopper
@pytest.mark.parametrize("t", [9, 16, 64, 300])
@pytest.mark.parametrize("x_dtype,w_dtype", [(BF16, BF16), (BF16, F32), (torch.float16, torch.float16), (F32, F32)])
def test_beyond_the_kernel(t, x_dtype, w_dtype):
    """More tokens than the kernel's tiles, or other dtypes: cuBLAS, within the same bound."""
    w = (0.02 * randn((256, 7168), seed=7, device="cuda")).to(w_dtype)
    x = randn((t, 7168), seed=8, device="cuda").to(x_dtype)
    check_logits(layers.router_gemm(x, w), x, w)


@pytest.mark.hopper
def test_cuda_graph_replays_new_inputs():
    w = randn((256, 7168), seed=9, device="cuda")
    x = randn((4, 7168), seed=10, device="cuda")
    layers.router_gemm(x, w)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = layers.router_gemm(x, w)
    for seed in (11, 12):
        x.copy_(randn((4, 7168), seed=seed, device="cuda"))
        logits.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_logits(logits, x, w)
