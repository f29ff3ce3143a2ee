"""Hopper M-grouped GEMMs (contiguous and masked) vs the reference on the same FP8 inputs."""

from __future__ import annotations

import pytest
import torch
from test_gemm_hopper import tail_split_sms

from moe_fp8 import reference as ref
from moe_fp8.kernels.gemm import (
    _K_SPLIT_WORKSPACES,
    fp8_grouped_gemm_contiguous_hopper,
    fp8_grouped_gemm_masked_hopper,
)
from moe_fp8.kernels.heuristics import make_config
from moe_fp8.testing import make_contiguous_inputs, make_masked_inputs
from moe_fp8.utils import align, calc_diff, get_align_m, get_num_sms, rel_error

pytestmark = [pytest.mark.hopper, pytest.mark.gpu]

# DeepSeek-V3 expert shapes (gate+up, down) and TP/EP shards, plus a ragged N/K.
EXPERT_NK = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (2112, 576)]


def _assert_close(out: torch.Tensor, expect: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} valid outputs unwritten"
    assert calc_diff(out, expect) < 1e-5, calc_diff(out, expect)
    assert rel_error(out, expect) < 1e-2, rel_error(out, expect)


def _check_contiguous(inp, out: torch.Tensor) -> None:
    expect = ref.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices)
    valid = inp.m_indices >= 0
    _assert_close(out[valid], expect[valid])
    # every 128-row block that is all padding is skipped: never stored
    blocks = inp.m_indices.view(-1, 128)
    all_pad = (blocks < 0).all(dim=1)
    assert out.view(-1, 128, out.shape[-1])[all_pad].isnan().all(), "an all-padding block was written"


@pytest.mark.parametrize("n,k", EXPERT_NK)
@pytest.mark.parametrize("num_groups,expected_m,num_empty", [(1, 300, 0), (4, 200, 1), (8, 64, 2), (32, 16, 5)])
def test_contiguous(num_groups: int, expected_m: int, num_empty: int, n: int, k: int) -> None:
    inp = make_contiguous_inputs(num_groups, expected_m, n, k, seed=num_groups + n, device="cuda",
                                 num_empty=num_empty)
    out = torch.full((inp.x_fp8.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out)
    torch.cuda.synchronize()
    _check_contiguous(inp, out)


@pytest.mark.parametrize("block_m,block_n", [(64, 136), (128, 112), (64, 16), (64, 72), (64, 88), (128, 160), (128, 256),
                                             (64, 256), (128, 192), (64, 192)])
def test_contiguous_block_shapes(block_m: int, block_n: int) -> None:
    inp = make_contiguous_inputs(6, 150, 2112, 1024, seed=block_n, device="cuda", num_empty=1)
    out = torch.full((inp.x_fp8.shape[0], 2112), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out,
                                       config=make_config(block_m, block_n, get_num_sms(), k=1024))
    torch.cuda.synchronize()
    _check_contiguous(inp, out)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("block_n", [192, 256])
def test_contiguous_tail_split(block_m: int, block_n: int) -> None:
    """Two-wave tiles with the last wave as tile halves (small grid forces it; the index space counts the
    padding blocks, which are skipped): right, padding unwritten, bit-identical to whole tiles."""
    inp = make_contiguous_inputs(6, 150, 2112, 1024, seed=block_m, device="cuda", num_empty=1)
    sms = tail_split_sms(-(-inp.x_fp8.shape[0] // block_m) * -(-2112 // block_n))
    outs = []
    for tail_split in (True, False):
        out = torch.full((inp.x_fp8.shape[0], 2112), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out,
                                           config=make_config(block_m, block_n, sms, k=1024, tail_split=tail_split))
        outs.append(out)
    torch.cuda.synchronize()
    _check_contiguous(inp, outs[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)  # unwritten rows: NaN in both


def _unstored_padding(inp, m_total: int) -> torch.Tensor:
    """The padding rows below ``m_total`` that no tile stores: a tile stores up to its last real row, rounded up
    to BLOCK_M / 32 rows (at most 4), so each segment's rows from there to its end."""
    mask = torch.zeros(inp.m_indices.shape[0], dtype=torch.bool, device=inp.m_indices.device)
    for start, size in zip(inp.group_starts, inp.group_sizes, strict=True):
        mask[start + align(size, 4):start + align(size, get_align_m())] = True
    mask[m_total:] = False
    return mask


def _check_m_total(inp, out: torch.Tensor, m_total: int) -> None:
    """Rows below ``m_total`` as ``_check_contiguous``, padding rows past a segment's real ones unwritten (NaN);
    every row from ``m_total`` on unwritten, although ``m_indices`` names real groups there (the kernel must
    never visit them)."""
    expect = ref.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices)
    valid = inp.m_indices >= 0
    valid[m_total:] = False
    _assert_close(out[valid], expect[valid])
    assert out[_unstored_padding(inp, m_total)].isnan().all(), "padding rows were stored"
    assert out[m_total:].isnan().all(), "rows past m_total were written"


@pytest.mark.parametrize("block_m,block_n,tail_split,a_box_rows", [
    (128, 256, True, 0), (128, 256, False, 0), (64, 192, True, 0), (128, 112, False, 0), (64, 16, False, 0),
    (128, 256, True, 32), (128, 128, False, 32), (64, 136, False, 32), (128, 160, False, 64)])
def test_contiguous_m_total(block_m: int, block_n: int, tail_split: bool, a_box_rows: int) -> None:
    """``m_total`` (device int32 [1]; a sync-free dispatch's row count) ends the layout early: 0, a cut
    inside the groups, and every row. The tail split then works on the tiles below it. With A boxes smaller than
    a tile, only those up to a segment's last rows are loaded (the others hold stale rows, never stored)."""
    inp = make_contiguous_inputs(6, 150, 2112, 1024, seed=block_n + a_box_rows, device="cuda", num_empty=1)
    rows = inp.x_fp8.shape[0]
    sms = tail_split_sms(-(-rows // 2 // block_m) * -(-2112 // block_n)) if tail_split else get_num_sms()
    cfg = make_config(block_m, block_n, sms, k=1024, tail_split=tail_split, a_box_rows=a_box_rows)
    for m_total in (0, inp.group_starts[3], rows // 2 // 128 * 128, rows):
        out = torch.full((rows, 2112), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out,
                                           m_total=torch.tensor([m_total], dtype=torch.int32, device="cuda"),
                                           config=cfg)
        torch.cuda.synchronize()
        _check_m_total(inp, out, m_total)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_partial_a_boxes_at_their_edges(layout: str) -> None:
    """A loaded as 32-row boxes, only up to a group's rows (``a_box_rows``): groups ending just before, on and past
    each box edge, whole tiles and tail halves (masked: K pieces too), against the reference; nothing stored past a
    group's rows (contiguous: rounded up to 4)."""
    sizes = [1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 0, 129, 160]
    if layout == "contiguous":
        inp = make_contiguous_inputs(len(sizes), 64, 1024, 1024, seed=11, device="cuda", group_sizes=sizes)
        rows = inp.x_fp8.shape[0]
        for cfg in (make_config(128, 128, get_num_sms(), k=1024, swizzle_group_m=1, a_box_rows=32),
                    make_config(64, 256, 7, k=1024, a_box_rows=32)):
            out = torch.full((rows, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
            fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out,
                                               config=cfg)
            torch.cuda.synchronize()
            _check_m_total(inp, out, rows)
        return
    inp = make_masked_inputs(len(sizes), 160, 64, 1024, 3072, seed=12, device="cuda", masked_m=sizes)
    for cfg in (make_config(64, 128, get_num_sms(), k=3072, a_box_rows=32),
                make_config(64, 256, 7, k=3072, k_split=True, a_box_rows=32)):
        out = torch.full((len(sizes), 160, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 64, out,
                                       config=cfg)
        torch.cuda.synchronize()
        _check_masked(inp, out)


def test_contiguous_m_total_graph_replays() -> None:
    """Captured once with the public op, replayed with new ``m_total`` contents: each replay stops there."""
    import moe_fp8

    inp = make_contiguous_inputs(4, 300, 4096, 7168, seed=11, device="cuda")
    rows = inp.x_fp8.shape[0]
    m_total = torch.tensor([rows], dtype=torch.int32, device="cuda")
    out = torch.full((rows, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    call = lambda: moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,  # noqa: E731
                                                       inp.m_indices, out, m_total=m_total)
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for value in (inp.group_starts[2], 0, rows, inp.group_starts[1] + 128):
        m_total.fill_(value)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_m_total(inp, out, value)


# the operands a captured masked GEMM reads, replaced in place between replays
_OPERANDS = ("x_fp8", "x_scale", "w_fp8", "w_scale", "masked_m")


def _clone_operands(inp):
    return inp._replace(**{f: getattr(inp, f).clone() for f in _OPERANDS})


def _replay_masked(graph: torch.cuda.CUDAGraph, buf, out: torch.Tensor, new) -> None:
    """Copy ``new``'s operands into the captured buffers, poison ``out``, replay, check against ``new``."""
    for f in _OPERANDS:
        getattr(buf, f).copy_(getattr(new, f))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_masked(new, out)


def _check_masked(inp, out: torch.Tensor) -> None:
    max_m = inp.x_fp8.shape[1]
    expect = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m)
    valid = torch.arange(max_m, device="cuda")[None, :] < inp.masked_m[:, None]
    _assert_close(out[valid], expect[valid])
    assert out[~valid].isnan().all(), "rows past masked_m were written"


@pytest.mark.parametrize("n,k", EXPERT_NK)
@pytest.mark.parametrize("num_groups,max_m,expected_m,num_empty",
                         [(1, 1024, 700, 0), (4, 256, 100, 1), (32, 256, 8, 4), (32, 128, 64, 0), (3, 100, 33, 1)])
def test_masked(num_groups: int, max_m: int, expected_m: int, num_empty: int, n: int, k: int) -> None:
    inp = make_masked_inputs(num_groups, max_m, expected_m, n, k, seed=n + max_m, device="cuda", num_empty=num_empty)
    out = torch.full((num_groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                   inp.expected_m, out)
    torch.cuda.synchronize()
    _check_masked(inp, out)


@pytest.mark.parametrize("block_m,block_n,sms", [(64, 128, 132), (64, 256, 132), (64, 256, 7), (128, 256, 132),
                                                 (128, 128, 5)])
@pytest.mark.parametrize("pattern", ["last", "sparse", "ones"])
def test_masked_many_groups_first_tiles(block_m: int, block_n: int, sms: int, pattern: str) -> None:
    """Each CTA starts at the group of its first tile (found from the tile counts: sched::MaskedScheduler::seek),
    over rounds of 32 groups: 200 groups (8 with 128-row tiles, the most whose tiles are counted), only the last
    touched, a sparse few, or a row in every one; whole tiles, tail halves and K pieces (K = 3072)."""
    g = 8 if block_m == 128 else 200
    counts = {"last": [0] * (g - 1) + [70], "sparse": [(37 * i) % 100 if i % 9 == 4 else 0 for i in range(g)],
              "ones": [1] * g}[pattern]
    inp = make_masked_inputs(g, 128, 8, 512, 3072, seed=g + block_n, device="cuda", masked_m=counts)
    out = torch.full((g, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = make_config(block_m, block_n, sms, k=3072, k_split=block_n == 256)
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 8, out, config=cfg)
    torch.cuda.synchronize()
    _check_masked(inp, out)


def test_masked_full_and_empty_groups() -> None:
    inp = make_masked_inputs(4, 192, 96, 1024, 512, seed=3, device="cuda", masked_m=[0, 192, 1, 0])
    out = torch.full((4, 192, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 96, out)
    torch.cuda.synchronize()
    _check_masked(inp, out)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("block_n", [192, 256])
@pytest.mark.parametrize("masked_m", [[200, 77, 0, 129], [256, 1, 90, 255, 3, 64, 128, 0, 17]])
def test_masked_tail_split(block_m: int, block_n: int, masked_m: list[int]) -> None:
    """Two-wave tiles with the last wave as tile halves: the scheduler counts the tiles on the device (of up
    to 8 groups of 128-row tiles, 9 groups: whole tiles only; any number of 64-row ones). Right, rows past
    masked_m unwritten, bit-identical to whole tiles. N = 7168 leaves the last 192-wide tile's second wave
    wholly past N (the next group's rows)."""
    g, max_m, n, k = len(masked_m), 256, 7168, 576
    inp = make_masked_inputs(g, max_m, 100, n, k, seed=block_m + g, device="cuda", masked_m=masked_m)
    sms = tail_split_sms(sum(-(-c // block_m) for c in masked_m) * -(-n // block_n))
    outs = []
    for tail_split in (True, False):
        out = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 100, out,
                                       config=make_config(block_m, block_n, sms, k=k, tail_split=tail_split))
        outs.append(out)
    torch.cuda.synchronize()
    _check_masked(inp, outs[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)  # unwritten rows: NaN in both


@pytest.mark.parametrize("block_n", [192, 256])
@pytest.mark.parametrize("masked_m", [[1206], [430, 379], [200, 77, 0, 129], [0, 0], [5, 0, 600, 1, 1, 300, 2, 90],
                                      [256, 1, 90, 255, 3, 64, 128, 0, 17]])
def test_masked_k_split(block_n: int, masked_m: list[int]) -> None:
    """A K-split last wave (the heuristic's default for masked two-wave tiles at long K): right, rows past
    masked_m unwritten, deterministic. 9 groups of 128-row tiles: the scheduler does not count their tiles
    and runs them whole."""
    g, max_m, n, k = len(masked_m), 1280, 4096, 3072
    inp = make_masked_inputs(g, max_m, 100, n, k, seed=block_n + g, device="cuda", masked_m=masked_m)
    cfg = make_config(128, block_n, get_num_sms(), k=k, k_split=True)
    outs = []
    for _ in range(2):
        out = torch.full((g, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 100, out,
                                       config=cfg)
        outs.append(out)
    torch.cuda.synchronize()
    _check_masked(inp, outs[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("m,n,k", [(300, 2112, 3200), (1000, 7168, 3088), (129, 4096, 4112), (64, 512, 3072),
                                   (1206, 4096, 7168), (768, 4096, 7168), (100, 2048, 7168), (300, 2112, 2048)])
@pytest.mark.parametrize("block_n", [192, 256])
@pytest.mark.parametrize("sms", [5, 13, 132])
def test_masked_k_split_grids(m: int, n: int, k: int, block_n: int, sms: int) -> None:
    """The last wave as 2-4 K pieces of each tile half (1206 rows on 132 SMs: 2 per half; 100 x 2048 on 132:
    4) or, where fewer than two per half fit, of each tile (1206 rows on 13 SMs: 3 per tile), also under one
    wave (every tile), ragged K included; K = 2048 is too short for two pieces and runs halves, and a last
    wave of over half the CTAs (768 rows on 132 SMs: 96 tiles) runs whole. One group of m rows: right vs the
    reference, deterministic (pieces are added in order, whichever finishes first), and a second launch
    finds the counters lowered."""
    inp = make_masked_inputs(1, m, m, n, k, seed=m + sms, device="cuda", masked_m=[m])
    cfg = make_config(128, block_n, sms, k=k, k_split=True)
    outs = []
    for _ in range(2):
        out = torch.full((1, m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, m, out,
                                       config=cfg)
        outs.append(out)
    torch.cuda.synchronize()
    _check_masked(inp, outs[0])
    assert torch.equal(outs[0], outs[1]), "K pieces are not deterministic"


def _graph_kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    """Names of the GPU activities of one replay of ``graph``, in start order."""
    from torch.profiler import ProfilerActivity, profile

    from moe_fp8.benchmarks.harness import gpu_events

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [name for name, _, _ in gpu_events(prof)]


@pytest.mark.parametrize("warm", [True, False])
def test_masked_k_split_cuda_graph(warm: bool) -> None:
    """Under a CUDA graph the K-split tail uses the workspace of an earlier launch on the capturing stream;
    without one the capture makes it, its flags taken from the device's pool (zeroed by the eager launch
    before): either way the graph holds the GEMM alone, no zeroing node before it. Both replay right with
    other counts."""
    g, max_m, n, k = 2, 1024, 4096, 3072
    buf = _clone_operands(make_masked_inputs(g, max_m, 512, n, k, seed=5, device="cuda"))
    out = torch.empty((g, max_m, n), dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        fp8_grouped_gemm_masked_hopper(buf.x_fp8, buf.x_scale, buf.w_fp8, buf.w_scale, buf.masked_m, 512, out)
    run()  # compiled, and a workspace made, on the current stream: not the one the graph captures
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if warm:
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    assert (stream.device.index, stream.cuda_stream) in _K_SPLIT_WORKSPACES
    kernels = _graph_kernels(graph)
    assert len(kernels) == 1 and "fp8_gemm_kernel" in kernels[0], kernels
    for seed, counts in [(6, [1024, 1023]), (7, [0, 700]), (8, [129, 3])]:
        _replay_masked(graph, buf, out, make_masked_inputs(g, max_m, 512, n, k, seed=seed, device="cuda",
                                                           masked_m=counts))


@pytest.mark.parametrize("expected_m", [1, 64, 256])
def test_masked_cuda_graph_replay(expected_m: int) -> None:
    """Captured once with one expected_m hint, replayed with other counts and data: the hint may
    change speed, never the result."""
    g, max_m, n, k = 8, 256, 2048, 1024
    buf = _clone_operands(make_masked_inputs(g, max_m, 32, n, k, seed=1, device="cuda"))
    out = torch.empty((g, max_m, n), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(buf.x_fp8, buf.x_scale, buf.w_fp8, buf.w_scale, buf.masked_m, expected_m, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_grouped_gemm_masked_hopper(buf.x_fp8, buf.x_scale, buf.w_fp8, buf.w_scale, buf.masked_m, expected_m,
                                       out)
    for seed, counts in [(2, [0, 256, 3, 17, 128, 129, 64, 255]), (3, [256] * 8), (4, [0] * 7 + [5])]:
        _replay_masked(graph, buf, out, make_masked_inputs(g, max_m, 32, n, k, seed=seed, device="cuda",
                                                           masked_m=counts))


# ---- the fused SiLU·mul + quant epilogue (GEMM1 of an expert: w13 = [gate; up]) ----
POISON_CODE = 0x3C  # an FP8 code the kernel writes only by chance; rows it must not write keep it


def _check_act(inp, act_fp8: torch.Tensor, act_scale: torch.Tensor, valid: torch.Tensor, ue8m0: bool,
               masked_m: torch.Tensor | None = None) -> None:
    """Valid rows vs the reference. The tensor cores accumulate each 128-K block in their own order and
    precision (~1e-4 relative on an H100), so an amax, hence a scale, moves by that much: scales to 1e-3
    relative, at most 2% of the codes one step apart; with masked_m, rows past it untouched."""
    kw = {"masked_m": masked_m} if masked_m is not None else {"m_indices": inp.m_indices}
    want_fp8, want_scale = ref.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                                                               ue8m0=ue8m0, **kw)
    got_s, want_s = act_scale[valid], want_scale[valid]
    assert not got_s.isnan().any(), f"{int(got_s.isnan().sum())} scales unwritten"
    close = ((got_s - want_s).abs() <= 1e-3 * want_s).double().mean().item()  # float32 mean rounds
    assert close > (0.99 if ue8m0 else 1 - 1e-9), f"scales differ: {close:.4f} within 1e-3"
    got, want = act_fp8[valid], want_fp8[valid]
    differ = (got.view(torch.uint8) != want.view(torch.uint8)).double().mean().item()
    assert differ < 0.02, f"{differ:.4f} of the codes differ"
    deq = ref.dequant_per_token_group(got, got_s)
    assert calc_diff(deq, ref.dequant_per_token_group(want, want_s)) < 1e-4
    if masked_m is not None:
        assert (act_fp8[~valid].view(torch.uint8) == POISON_CODE).all(), "rows past masked_m were written"
        assert act_scale[~valid].isnan().all(), "scales past masked_m were written"


def _poisoned_act(shape: tuple[int, ...], groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_fp8.utils import empty_scale_tma

    act = torch.full(shape, POISON_CODE, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    scale = empty_scale_tma(shape[-2], shape[-1] // 128, groups=groups, device="cuda")
    scale.fill_(float("nan"))
    return act, scale


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 7168), (512, 7168), (256, 576)])
@pytest.mark.parametrize("num_groups,expected_m,num_empty", [(1, 300, 0), (8, 64, 2), (32, 16, 5)])
def test_contiguous_silu_mul_quant(num_groups: int, expected_m: int, num_empty: int, n: int, k: int,
                                   ue8m0: bool) -> None:
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_silu_mul_quant_hopper

    inp = make_contiguous_inputs(num_groups, expected_m, n, k, seed=num_groups + n, device="cuda",
                                 num_empty=num_empty)
    act, scale = _poisoned_act((inp.x_fp8.shape[0], n // 2))
    fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, None, 0,
                                           ue8m0, act, scale)
    torch.cuda.synchronize()
    _check_act(inp, act, scale, inp.m_indices >= 0, ue8m0)


def test_contiguous_silu_mul_quant_m_total() -> None:
    """The fused GEMM1 with ``m_total`` (the layer's sync-free prefill): rows below it as the reference,
    every row from it on unwritten although ``m_indices`` names real groups there."""
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_silu_mul_quant_hopper

    inp = make_contiguous_inputs(6, 150, 512, 2048, seed=17, device="cuda", num_empty=1)
    rows = inp.x_fp8.shape[0]
    for m_total in (0, inp.group_starts[3], rows // 2 // 128 * 128, rows):
        act, scale = _poisoned_act((rows, 256))
        fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, None, 0,
                                               False, act, scale,
                                               m_total=torch.tensor([m_total], dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        valid = inp.m_indices >= 0
        valid[m_total:] = False
        if valid.any():
            _check_act(inp, act, scale, valid, False)
        assert (act[m_total:].view(torch.uint8) == POISON_CODE).all(), "rows past m_total were written"
        assert scale[m_total:].isnan().all(), "scales past m_total were written"


@pytest.mark.parametrize("hint", [16, 65])
@pytest.mark.parametrize("n,k", [(7168, 2048), (4096, 7168), (7168, 512)])
def test_contiguous_rows_hint(n: int, k: int, hint: int) -> None:
    """The layer's rows hint (``expected_m``; at most 64: tiles walked N-fastest, 128x128 ones for the down
    projection on 132 SMs, else the plain order) through the public ops, with ``m_total`` as a sync-free prefill
    gives it: groups of 0-300 rows, some past one 128-row block, against the reference; padding rows and rows past
    ``m_total`` unwritten."""
    import moe_fp8
    from moe_fp8.kernels.heuristics import CONTIGUOUS_ONE_BLOCK_TILES, GemmDesc, get_config

    sizes = [3, 300, 64, 65, 17, 200, 1, 128, 40, 0, 9, 63] * 3
    inp = make_contiguous_inputs(len(sizes), 16, n, k, seed=n + hint, device="cuda", group_sizes=sizes)
    rows = inp.x_fp8.shape[0]
    assert rows >= 128 * len(sizes)  # a block a group or more: the measured tile's class
    cut = inp.group_starts[30]
    m_total = torch.tensor([cut], dtype=torch.int32, device="cuda")
    for act_quant in (0, 1):
        cfg = get_config(GemmDesc(rows, n, k, len(sizes), "contiguous", get_num_sms(), expected_m=hint,
                                  act_quant=act_quant))
        assert (cfg.swizzle_group_m == 1) == (hint <= 64), cfg
        if hint <= 64 and not act_quant and (n, k) in CONTIGUOUS_ONE_BLOCK_TILES and get_num_sms() == 132:
            assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (128, *CONTIGUOUS_ONE_BLOCK_TILES[(n, k)]), cfg
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_fp8.fp8_grouped_gemm_contiguous(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices, out,
                                        m_total=m_total, expected_m=hint)
    act, scale = _poisoned_act((rows, n // 2))
    moe_fp8.fp8_grouped_gemm_silu_mul_quant(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, m_indices=inp.m_indices,
                                            m_total=m_total, expected_m=hint, out=act, out_scale=scale)
    torch.cuda.synchronize()
    _check_m_total(inp, out, cut)  # (padding rows, all-padding blocks among them, unwritten)
    valid = inp.m_indices >= 0
    valid[cut:] = False
    _check_act(inp, act, scale, valid, False)
    unstored = _unstored_padding(inp, cut)
    assert (act[unstored].view(torch.uint8) == POISON_CODE).all(), "padding rows were stored"
    assert scale[unstored].isnan().all(), "scales of unstored padding rows were written"
    assert (act[cut:].view(torch.uint8) == POISON_CODE).all() and scale[cut:].isnan().all(), \
        "rows past m_total were written"


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 7168), (512, 2048)])
@pytest.mark.parametrize("num_groups,max_m,expected_m,num_empty", [(4, 256, 100, 1), (32, 128, 8, 4), (3, 100, 33, 1)])
def test_masked_silu_mul_quant(num_groups: int, max_m: int, expected_m: int, num_empty: int, n: int, k: int,
                               ue8m0: bool) -> None:
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_silu_mul_quant_hopper

    inp = make_masked_inputs(num_groups, max_m, expected_m, n, k, seed=n + max_m, device="cuda", num_empty=num_empty)
    act, scale = _poisoned_act((num_groups, max_m, n // 2), groups=num_groups)
    fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, None, inp.masked_m,
                                           expected_m, ue8m0, act, scale)
    torch.cuda.synchronize()
    valid = torch.arange(max_m, device="cuda")[None, :] < inp.masked_m[:, None]
    _check_act(inp, act, scale, valid, ue8m0, masked_m=inp.masked_m)


# Sparse decode: a few of an EP rank's 32 experts hold a token or two, so 64 x 256 tiles leave most SMs idle
# unless each tile's K runs as pieces on several CTAs (the fused GEMM1's only split).
DECODE_COUNTS = [[0] * 31 + [1], [0] * 9 + [2] + [0] * 11 + [1, 3] + [0] * 9, [1, 0, 2, 4, 0, 1, 0, 0] * 4,
                 [64] * 32]


@pytest.mark.parametrize("block_m,sms,masked_m", [
    *((64, sms, counts) for counts in DECODE_COUNTS for sms in (132, 13)),
    (128, 132, [60, 0, 3, 0]), (128, 132, [64] * 8), (128, 132, DECODE_COUNTS[0])])
def test_masked_silu_mul_quant_k_pieces(masked_m: list[int], block_m: int, sms: int) -> None:
    """The fused GEMM1 with its last wave (under one wave: every tile) as K pieces where four fit (1 touched
    expert: 16 tiles on 132 CTAs; on 13, a wave and 3 tiles), whole tiles otherwise: right against the
    reference, rows past masked_m untouched, and deterministic (pieces added in order). 128-row tiles count
    the tiles of up to 8 groups only: with 32 they run whole."""
    from moe_fp8.kernels.gemm import fp8_grouped_gemm_silu_mul_quant_hopper

    g, max_m, n, k = len(masked_m), 64, 4096, 7168
    inp = make_masked_inputs(g, max_m, 2, n, k, seed=sum(masked_m) + sms, device="cuda", masked_m=masked_m)
    cfg = make_config(block_m, 256, sms, k=k, k_split=True)
    runs = []
    for _ in range(2):
        act, scale = _poisoned_act((g, max_m, n // 2), groups=g)
        fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, None, inp.masked_m,
                                               2, False, act, scale, config=cfg)
        runs.append((act, scale))
    torch.cuda.synchronize()
    valid = torch.arange(max_m, device="cuda")[None, :] < inp.masked_m[:, None]
    _check_act(inp, *runs[0], valid, False, masked_m=inp.masked_m)
    assert torch.equal(runs[0][0].view(torch.uint8), runs[1][0].view(torch.uint8)), "K pieces are not deterministic"
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("pooled", [True, False])
def test_masked_silu_mul_quant_k_pieces_cuda_graph(pooled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's decode GEMM1 captured on a fresh stream (no workspace yet: the capture makes it), its first
    launch in the process: its K-split flags from the device's pool (filled before), or, where no eager launch
    filled one, zeroed by a node of the graph. Then replayed with other counts, from one touched expert to all
    of them; every replay against the reference."""
    from moe_fp8.kernels import gemm

    if pooled:
        gemm._reserve_k_split_flags(torch.cuda.current_device())
    else:
        monkeypatch.setattr(gemm, "_K_SPLIT_FLAG_POOLS", {})
    monkeypatch.setattr(gemm, "_PREPARED", {})

    g, max_m, n, k = 32, 64, 4096, 7168
    buf = _clone_operands(make_masked_inputs(g, max_m, 2, n, k, seed=9, device="cuda", masked_m=DECODE_COUNTS[0]))
    act, scale = _poisoned_act((g, max_m, n // 2), groups=g)

    def run() -> None:
        gemm.fp8_grouped_gemm_silu_mul_quant_hopper(buf.x_fp8, buf.x_scale, buf.w_fp8, buf.w_scale, None,
                                                    buf.masked_m, 1, False, act, scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    assert (stream.device.index, stream.cuda_stream) in _K_SPLIT_WORKSPACES
    kernels = _graph_kernels(graph)
    assert "fp8_gemm_kernel" in kernels[-1] and len(kernels) == (1 if pooled else 2), kernels
    for seed, counts in enumerate(DECODE_COUNTS[1:] + DECODE_COUNTS[:1] + [[0] * 32]):
        new = make_masked_inputs(g, max_m, 2, n, k, seed=10 + seed, device="cuda", masked_m=counts)
        for f in _OPERANDS:
            getattr(buf, f).copy_(getattr(new, f))
        act.view(torch.uint8).fill_(POISON_CODE)
        scale.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        valid = torch.arange(max_m, device="cuda")[None, :] < new.masked_m[:, None]
        if valid.any():
            _check_act(new, act, scale, valid, False, masked_m=new.masked_m)
        else:
            assert (act.view(torch.uint8) == POISON_CODE).all() and scale.isnan().all()


def _async_case(case: str) -> tuple[object, ...]:
    """``(launch, outputs)`` of one store-path case on few CTAs (each runs many tiles): ``launch()`` writes
    ``outputs``, which the caller poisons first."""
    from moe_fp8.kernels.gemm import fp8_gemm_hopper, fp8_grouped_gemm_silu_mul_quant_hopper
    from moe_fp8.testing import make_gemm_inputs

    nan = float("nan")
    if case.startswith("normal"):  # whole, two-wave and (on 3 CTAs: a last wave of 1 tile) tail-half tiles
        inp = make_gemm_inputs(1000, 2112, 576, seed=5, device="cuda")
        block_n, sms = {"normal": (128, 7), "normal_two_wave": (256, 7), "normal_tail_halves": (192, 3)}[case]
        cfg = make_config(128, block_n, sms, k=576, tail_split=case == "normal_tail_halves")
        out = torch.full((1000, 2112), nan, dtype=torch.bfloat16, device="cuda")
        return lambda: fp8_gemm_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, out, config=cfg), (out,)
    if case.startswith("contiguous"):  # an empty group, and (m_total) the rows from the middle on unvisited
        inp = make_contiguous_inputs(6, 150, 2112, 1024, seed=6, device="cuda", num_empty=1)
        rows = inp.x_fp8.shape[0]
        m_total = torch.tensor([rows // 2 // 128 * 128], dtype=torch.int32, device="cuda") if case.endswith("total") else None
        out = torch.full((rows, 2112), nan, dtype=torch.bfloat16, device="cuda")
        return (lambda: fp8_grouped_gemm_contiguous_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.m_indices,
                                                           out, m_total=m_total, config=make_config(128, 128, 7, k=1024)),
                (out,))
    if case == "masked":
        inp = make_masked_inputs(4, 256, 150, 2112, 1024, seed=7, device="cuda", masked_m=[200, 77, 0, 129])
        out = torch.full((4, 256, 2112), nan, dtype=torch.bfloat16, device="cuda")
        return (lambda: fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                                       150, out, config=make_config(64, 128, 7, k=1024)), (out,))
    if case == "masked_k_pieces":  # 160 tiles on 13 CTAs: the last wave as K pieces storing a band of rows each
        inp = make_masked_inputs(1, 1206, 1206, 4096, 7168, seed=8, device="cuda", masked_m=[1206])
        out = torch.full((1, 1206, 4096), nan, dtype=torch.bfloat16, device="cuda")
        cfg = make_config(128, 256, 13, k=7168, k_split=True)
        return (lambda: fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                                       1206, out, config=cfg), (out,))
    # the fused SiLU·mul + quant epilogue: FP8 rows and their scales
    if case == "silu_contiguous":
        inp = make_contiguous_inputs(6, 150, 512, 2048, seed=9, device="cuda", num_empty=1)
        act, scale = _poisoned_act((inp.x_fp8.shape[0], 256))
        m_indices, masked_m, cfg = inp.m_indices, None, make_config(128, 256, 5, k=2048)
    else:
        inp = make_masked_inputs(4, 256, 100, 512, 2048, seed=10, device="cuda", masked_m=[200, 77, 0, 129])
        act, scale = _poisoned_act((4, 256, 256), groups=4)
        m_indices, masked_m, cfg = None, inp.masked_m, make_config(64, 256, 5, k=2048)
    return (lambda: fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, m_indices,
                                                           masked_m, 100, False, act, scale, config=cfg),
            (act, scale))


@pytest.mark.parametrize("case", ["normal", "normal_two_wave", "normal_tail_halves", "contiguous", "contiguous_m_total",
                                  "masked", "masked_k_pieces", "silu_contiguous", "silu_masked"])
def test_async_stores_write_the_same_bits(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Tiles stored by bulk copies (``gemm.async_stores``, forced on) against the same launch storing directly:
    the same bits in every output, the rows neither may write (past a group's rows, past m_total, all-padding
    blocks) left poisoned by both."""
    import moe_fp8.kernels.gemm as G

    launch, outputs = _async_case(case)
    # the outputs' bits as integers of their size (the scales' column-major view too); all ones is NaN
    bits = [t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]) for t in outputs]
    poison = [POISON_CODE if t.dtype == torch.float8_e4m3fn else -1 for t in outputs]
    results = []
    for bulk in (False, True):  # direct, then bulk-copied (a CTA's last tile: direct either way), any tile shape
        monkeypatch.setattr(G, "async_stores", lambda *_, bulk=bulk: bulk)
        G._PREPARED.clear()
        for b, p in zip(bits, poison, strict=True):
            b.fill_(p)
        launch()
        torch.cuda.synchronize()
        results.append([b.clone() for b in bits])
    G._PREPARED.clear()
    direct, bulk = results
    assert (direct[0] != poison[0]).any(), "nothing was written"
    for a, b in zip(direct, bulk, strict=True):
        assert torch.equal(a, b), f"{case}: {int((a != b).sum())} bytes differ"
