"""Hopper FP8 GEMM kernel vs the reference on the same FP8 inputs (DESIGN §6).

Runs only on an sm_90 GPU (skipped elsewhere, see conftest.py); the kernel's compilation and SASS
are checked on every machine by tests/test_kernel_sources.py.
"""

from __future__ import annotations

import pytest
import torch

from moe_fp8 import reference as ref
from moe_fp8.kernels.gemm import fp8_gemm_hopper
from moe_fp8.kernels.heuristics import make_config
from moe_fp8.testing import make_gemm_inputs
from moe_fp8.utils import calc_diff, get_num_sms, rel_error, to_scale_tma_layout

pytestmark = [pytest.mark.hopper, pytest.mark.gpu]

# DeepSeek-V3 shapes (N, K) from the goal table plus ragged ones: N not a multiple of 128 (2112)
# or of the block, K a multiple of 16 but not of 128 (576, 16, 272, 2064).
DEEPSEEK_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
RAGGED_NK = [(2112, 576), (7168, 576), (256, 128), (8, 16), (136, 4096), (1000, 272), (24, 2064)]
MS = [1, 7, 64, 100, 128, 129, 257, 1000]


def _run(m: int, n: int, k: int, seed: int, config=None) -> tuple[torch.Tensor, object]:
    inp = make_gemm_inputs(m, n, k, seed=seed, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
    fp8_gemm_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, out, config=config)
    torch.cuda.synchronize()
    return out, inp


def _check(out: torch.Tensor, inp, k: int) -> None:
    expect = ref.fp8_gemm(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale)
    assert not out.isnan().any(), f"{int(out.isnan().sum())} outputs unwritten or NaN"
    assert calc_diff(out, expect) < 1e-5, calc_diff(out, expect)
    assert rel_error(out, expect) < 1e-2, rel_error(out, expect)
    if k >= 128:
        bf16 = inp.x.float() @ inp.w.float().t()
        assert calc_diff(out, bf16) < 1e-3


@pytest.mark.parametrize("n,k", DEEPSEEK_NK + RAGGED_NK)
@pytest.mark.parametrize("m", MS)
def test_gemm_matches_reference(m: int, n: int, k: int) -> None:
    out, inp = _run(m, n, k, seed=m * 7 + n)
    _check(out, inp, k)


@pytest.mark.parametrize("m", [64, 4096])
@pytest.mark.parametrize("n,k", [(7168, 2048), (2112, 7168)])
def test_gemm_several_seeds(m: int, n: int, k: int) -> None:
    for seed in range(3):
        out, inp = _run(m, n, k, seed=100 + seed)
        _check(out, inp, k)


# Every block shape the heuristic may choose, including the ones whose tiles straddle two
# weight-scale blocks (BLOCK_N not dividing 128), on a ragged N and a ragged M.
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("block_n", [16, 24, 56, 64, 72, 80, 88, 96, 112, 128, 136, 144, 160, 192, 256])
def test_gemm_every_block_shape(block_m: int, block_n: int) -> None:
    cfg = make_config(block_m, block_n, get_num_sms(), k=1152)
    out, inp = _run(300, 2112, 1152, seed=block_n, config=cfg)
    _check(out, inp, 1152)


# 64-row tiles up to 96 wide run their K blocks in unrolled chunks with two accumulator sets (impls/fp8_gemm.cuh):
# 1 and 5 blocks (one chunk, odd), 9 (a chunk of 8 and one block without overlap), 12 (two of 6), 58 (seven of
# 8 and two more).
@pytest.mark.parametrize("k", [128, 576, 1152, 1536, 7424])
@pytest.mark.parametrize("block_n", [16, 48, 64, 72, 88, 96])
def test_gemm_overlap_chunks(k: int, block_n: int) -> None:
    out, inp = _run(100, 2112, k, seed=k + block_n, config=make_config(64, block_n, get_num_sms(), k=k))
    _check(out, inp, k)


# 2-CTA multicast: odd block counts leave one CTA of a pair past the matrix (must store nothing).
@pytest.mark.parametrize("m,n,k", [(300, 2112, 1152), (128, 7168, 576), (4096, 4096, 512), (1, 200, 256)])
@pytest.mark.parametrize("block_m,block_n,on_a", [(128, 128, False), (128, 144, True), (64, 64, True),
                                                  (64, 112, False), (128, 160, False),
                                                  (128, 256, False), (64, 256, True), (128, 192, False)])
def test_gemm_multicast(m: int, n: int, k: int, block_m: int, block_n: int, on_a: bool) -> None:
    cfg = make_config(block_m, block_n, get_num_sms(), k=k, multicast=2, multicast_on_a=on_a)
    out, inp = _run(m, n, k, seed=block_n + m, config=cfg)
    _check(out, inp, k)


# Split-K over a cluster: uneven K shares (K blocks not divisible by the split, a partial last
# block), ragged M and N, and a single token; the DSMEM reduction sums partials in rank order, so the
# result is also bit-identical between runs.
@pytest.mark.parametrize("m,n,k", [(300, 2112, 1152), (1, 200, 256), (128, 7168, 576), (64, 4096, 7168),
                                   (129, 1000, 2064)])
@pytest.mark.parametrize("block_m,block_n,split_k", [(64, 128, 2), (64, 64, 4), (64, 256, 2), (128, 128, 2),
                                                     (64, 32, 4), (128, 256, 2)])
def test_gemm_split_k(m: int, n: int, k: int, block_m: int, block_n: int, split_k: int) -> None:
    if -(-k // 128) < split_k:
        pytest.skip("fewer K blocks than splits: make_config refuses it (tests/test_heuristics.py)")
    cfg = make_config(block_m, block_n, get_num_sms(), k=k, split_k=split_k)
    out, inp = _run(m, n, k, seed=block_n + m + split_k, config=cfg)
    _check(out, inp, k)
    again = torch.full_like(out, float("nan"))
    fp8_gemm_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, again, config=cfg)
    assert torch.equal(again, out), "split-K reduction is not deterministic"


def tail_split_sms(tiles: int) -> int:
    """A grid size whose last wave holds 1 .. half as many tiles as CTAs, after a full wave (so the
    tail runs as halves: sched::TailSplit)."""
    return next(s for s in range(3, tiles) if 0 < tiles % s <= s // 2)


@pytest.mark.parametrize("m,n,k", [(300, 2112, 1152), (1000, 7168, 576), (129, 4096, 2064), (64, 512, 256)])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("block_n", [192, 256])
def test_gemm_tail_split(m: int, n: int, k: int, block_m: int, block_n: int) -> None:
    """Two-wave tiles whose last wave runs as tile halves (forced by a small grid; under half a wave of
    tiles, 64x512, every tile runs as halves): right vs the reference, and bit-identical to the same
    tiles run whole (a half sums the same products in the same order). N = 4096 and 7168 leave the
    last 192-wide tile's second wave wholly past N."""
    tiles = -(-m // block_m) * -(-n // block_n)
    sms = tail_split_sms(tiles) if tiles >= 4 else get_num_sms()
    out, inp = _run(m, n, k, seed=m + block_m, config=make_config(block_m, block_n, sms, k=k))
    _check(out, inp, k)
    whole = torch.full_like(out, float("nan"))
    fp8_gemm_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, whole,
                    config=make_config(block_m, block_n, sms, k=k, tail_split=False))
    assert torch.equal(whole, out)


def test_gemm_m_zero() -> None:
    out, _ = _run(0, 256, 256, seed=0)
    assert out.shape == (0, 256)


def test_gemm_cuda_graph_replay() -> None:
    """Captured once, replayed on new data written into the same buffers."""
    m, n, k = 96, 2112, 1536
    inp = make_gemm_inputs(m, n, k, seed=1, device="cuda")
    x_fp8, w_fp8, w_scale = (t.clone() for t in (inp.x_fp8, inp.w_fp8, inp.w_scale))
    x_scale = to_scale_tma_layout(inp.x_scale)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)  # compile + load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)
    for seed in (2, 3):
        new = make_gemm_inputs(m, n, k, seed=seed, device="cuda")
        x_fp8.copy_(new.x_fp8)
        x_scale.copy_(new.x_scale)
        w_fp8.copy_(new.w_fp8)
        w_scale.copy_(new.w_scale)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, new, k)
