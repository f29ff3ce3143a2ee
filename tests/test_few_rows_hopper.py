"""The few-rows GEMM (impls/fp8_gemm_few_rows.cuh): masked GEMMs of at most 16 rows a group, small groups of any
count in chunks, and the normal layout, vs the reference on fresh inputs; what the public masked ops route to it;
CUDA-graph replays."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_grouped_hopper import _check_act, _check_masked, _clone_operands, _poisoned_act, _replay_masked

from moe_fp8 import reference as ref
from moe_fp8.kernels import few_rows
from moe_fp8.kernels.gemm import fp8_grouped_gemm_masked_hopper, fp8_grouped_gemm_silu_mul_quant_hopper
from moe_fp8.testing import make_masked_inputs
from moe_fp8.utils import calc_diff

pytestmark = [pytest.mark.hopper, pytest.mark.gpu]

# DeepSeek-V3's experts and their TP-8 shards, Qwen3-MoE's, ragged N (a half 16-row tile) and K (a 16-byte tail)
SHAPES = [(4096, 7168), (7168, 2048), (512, 7168), (7168, 256), (3072, 4096), (1032, 1040), (24, 144)]


def _counts(pattern: str, groups: int, max_m: int) -> list[int]:
    return {"one": [0] * (groups - 1) + [max_m],  # a decode token on one expert (the last: walked past the rest)
            "ragged": [(5 * g + 3) % (max_m + 1) for g in range(groups)],  # 0 .. max_m, empty groups among them
            "empty": [0] * groups,
            "full": [max_m] * groups}[pattern]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per few_rows.launch call made through the public ops' routing."""
    calls: list[int] = []
    monkeypatch.setattr(few_rows, "launch", lambda *a, _f=few_rows.launch: (calls.append(1), _f(*a)))
    return calls


def _run(inp, out: torch.Tensor) -> None:
    few_rows.launch(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, out, inp.masked_m)
    torch.cuda.synchronize()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("groups,max_m", [(1, 1), (32, 3), (8, 8), (32, 9), (4, 16)])
@pytest.mark.parametrize("pattern", ["one", "ragged", "full"])
def test_masked(n: int, k: int, groups: int, max_m: int, pattern: str) -> None:
    inp = make_masked_inputs(groups, max_m, 1, n, k, seed=n + k + max_m, device="cuda",
                             masked_m=_counts(pattern, groups, max_m))
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(inp, out)
    _check_masked(inp, out)  # rows past masked_m stay NaN


@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("n,k", [(512, 7168), (7168, 256), (1032, 1040), (24, 144)])
@pytest.mark.parametrize("groups,max_m", [(1, 17), (32, 64), (256, 40), (3, 300)])
@pytest.mark.parametrize("pattern", ["one", "ragged", "full"])
def test_masked_chunks(n: int, k: int, groups: int, max_m: int, pattern: str, tiles: int,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 16 rows a group is walked in chunks of 8 * CHUNK_TOKEN_TILES rows (a hot expert in an engine's batched
    layout: up to max_m rows, a last chunk partial); every row below masked_m right, none past it written."""
    monkeypatch.setattr(few_rows, "CHUNK_TOKEN_TILES", tiles)
    inp = make_masked_inputs(groups, max_m, 1, n, k, seed=n + k + max_m + tiles, device="cuda",
                             masked_m=_counts(pattern, groups, max_m))
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(inp, out)
    _check_masked(inp, out)


@pytest.mark.parametrize("n,k", [(512, 7168), (7168, 256), (4096, 7168), (1032, 1040)])
@pytest.mark.parametrize("groups,max_m", [(32, 9), (8, 12), (4, 16)])
@pytest.mark.parametrize("pattern", ["one", "ragged", "full"])
def test_masked_narrow(n: int, k: int, groups: int, max_m: int, pattern: str) -> None:
    """9-16 rows a group expected to hold few (the hint at most NARROW_MAX_EXPECTED): one token tile a warp, in
    chunks of 8 rows (a group of more, in two); every row below masked_m right, none past it written."""
    assert few_rows.token_tiles(max_m, 1) == few_rows.CHUNK_TOKEN_TILES < few_rows.token_tiles(max_m)
    inp = make_masked_inputs(groups, max_m, 1, n, k, seed=n + k + max_m, device="cuda",
                             masked_m=_counts(pattern, groups, max_m))
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    few_rows.launch(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, out, inp.masked_m, expected_m=1)
    torch.cuda.synchronize()
    _check_masked(inp, out)


def test_public_masked_op_hands_its_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_grouped_gemm_masked gives the few-rows launch its expected_m (the narrow rule reads it)."""
    hints: list[int | None] = []
    monkeypatch.setattr(few_rows, "launch", lambda *a, _f=few_rows.launch: (hints.append(a[6]), _f(*a)))
    inp = make_masked_inputs(32, 12, 1, 7168, 256, seed=3, device="cuda", masked_m=_counts("ragged", 32, 12))
    out = torch.full((32, 12, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m, 1, out)
    torch.cuda.synchronize()
    assert hints == [1]
    _check_masked(inp, out)


@pytest.mark.parametrize("groups", [256, 384, 1024])
def test_masked_many_groups(groups: int) -> None:
    """A TP-8 rank's experts (every routed expert at I / 8) with a few touched, up to the kernel's 1024 groups."""
    counts = [0] * groups
    for i, g in enumerate((3, groups // 2, groups // 2 + 1, groups - 1)):
        counts[g] = i + 1
    inp = make_masked_inputs(groups, 4, 1, 512, 256, seed=groups, device="cuda", masked_m=counts)
    out = torch.full((groups, 4, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(inp, out)
    _check_masked(inp, out)


def test_masked_empty_writes_nothing() -> None:
    inp = make_masked_inputs(32, 8, 1, 4096, 7168, seed=2, device="cuda", masked_m=_counts("empty", 32, 8))
    out = torch.full((32, 8, 4096), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(inp, out)
    assert out.isnan().all()


def test_counts_out_of_range_are_clamped() -> None:
    """masked_m past [0, max_m] (a caller's bug) reads and writes within the group: clamped as the wgmma kernel's."""
    inp = make_masked_inputs(3, 8, 1, 512, 1024, seed=4, device="cuda", masked_m=[0, 8, 2])
    inp.masked_m.copy_(torch.tensor([-5, 1000, 2], dtype=torch.int32))
    out = torch.full((3, 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    _run(inp, out)
    _check_masked(inp._replace(masked_m=torch.tensor([0, 8, 2], dtype=torch.int32, device="cuda")), out)


def test_float32_out_and_deterministic() -> None:
    inp = make_masked_inputs(8, 16, 1, 4096, 7168, seed=6, device="cuda", masked_m=_counts("ragged", 8, 16))
    outs = [torch.full((8, 16, 4096), float("nan"), dtype=torch.float32, device="cuda") for _ in range(2)]
    for out in outs:
        _run(inp, out)
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0)), "split-K partial sums in a fixed order"
    expect = ref.fp8_grouped_gemm_masked(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m)
    valid = torch.arange(16, device="cuda")[None, :] < inp.masked_m[:, None]
    assert calc_diff(outs[0][valid], expect[valid].float()) < 1e-5
    assert outs[0][~valid].isnan().all()


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("n,k", [(7168, 2048), (2112, 576), (24, 144)])
def test_normal_layout(m: int, n: int, k: int) -> None:
    """masked_m None: out [M, N] of x [M, K] (the normal GEMM's layout; past 16 rows in chunks)."""
    inp = make_masked_inputs(1, m, 1, n, k, seed=m + n, device="cuda", masked_m=[m])
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    few_rows.launch(inp.x_fp8[0], inp.x_scale[0], inp.w_fp8[0], inp.w_scale[0], out, None)
    torch.cuda.synchronize()
    _check_masked(inp, out[None])


@pytest.mark.parametrize("max_m,n,k,routed", [(16, 512, 7168, True), (17, 512, 7168, False), (8, 4096, 7168, True),
                                               (9, 4096, 7168, False)])
def test_public_masked_op_routes_by_rows(max_m: int, n: int, k: int, routed: bool, launches: list[int]) -> None:
    """fp8_grouped_gemm_masked takes the few-rows kernel up to few_rows.max_rows rows a group (no config given),
    the wgmma kernel beyond (expected_m past the chunked rule's) or with a config; both right."""
    inp = make_masked_inputs(32, max_m, 1, n, k, seed=max_m, device="cuda", masked_m=_counts("ragged", 32, max_m))
    out = torch.full((32, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                   few_rows.CHUNKED_MAX_EXPECTED + 1, out)
    torch.cuda.synchronize()
    assert bool(launches) == routed
    _check_masked(inp, out)


@pytest.mark.parametrize("groups,max_m,n,k,above,routed", [(32, 64, 7168, 256, 0, True), (32, 64, 7168, 256, 1, False),
                                                            (4, 2048, 4096, 1536, 0, True), (32, 64, 512, 7168, 0, True),
                                                            (8, 64, 4096, 7168, 0, False)])
def test_public_masked_op_routes_by_expected_rows(groups: int, max_m: int, n: int, k: int, above: int, routed: bool,
                                                  launches: list[int]) -> None:
    """Past max_rows, fp8_grouped_gemm_masked takes the few-rows kernel for small groups whose expected_m is at most
    CHUNKED_MAX_EXPECTED (``above`` more: not), never for DeepSeek-V3's whole experts; both right."""
    inp = make_masked_inputs(groups, max_m, 1, n, k, seed=max_m + above, device="cuda",
                             masked_m=_counts("ragged", groups, max_m))
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_gemm_masked_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, inp.masked_m,
                                   few_rows.CHUNKED_MAX_EXPECTED + above, out)
    torch.cuda.synchronize()
    assert bool(launches) == routed
    _check_masked(inp, out)


@pytest.mark.parametrize("beside,m,n,k,routed", [
    (False, 8, 2112, 7168, True), (False, 16, 2112, 7168, True), (False, 17, 2112, 7168, False),
    (False, 16, 4608, 7168, False), (False, 9, 2304, 4096, False), (False, 4, 4096, 2048, False),
    (False, 1, 7168, 16384, True), (True, 16, 2112, 7168, True), (True, 17, 2112, 7168, False),
    (True, 4, 4096, 2048, True), (True, 64, 7168, 256, True), (True, 33, 512, 7168, True),
    (True, 65, 512, 7168, False), (True, 17, 4096, 7168, False)])
def test_public_normal_op_routes_by_rows_and_k(beside: bool, m: int, n: int, k: int, routed: bool,
                                               launches: list[int]) -> None:
    """fp8_gemm takes the few-rows kernel for up to 8 rows at K >= 4096 (no config given), up to 16 at K >= 7168
    where its tiles fit one wave (132 SMs: not 4608 x 7168); inside ``beside_few_rows`` for up to 16 rows, and up
    to 64 for weights of at most 13 MB; both paths right."""
    from moe_fp8.kernels.gemm import fp8_gemm_hopper

    inp = make_masked_inputs(1, m, 1, n, k, seed=m + k, device="cuda", masked_m=[m])
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    with few_rows.beside_few_rows() if beside else contextlib.nullcontext():
        fp8_gemm_hopper(inp.x_fp8[0], inp.x_scale[0], inp.w_fp8[0], inp.w_scale[0], out)
    torch.cuda.synchronize()
    assert bool(launches) == routed
    _check_masked(inp, out[None])


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("max_m,pattern,n,k", [(1, "one", 4096, 7168), (8, "ragged", 4096, 7168), (16, "full", 512, 7168),
                                               (48, "ragged", 1536, 2048)])
def test_silu_mul_quant_on_few_rows(max_m: int, pattern: str, n: int, k: int, ue8m0: bool) -> None:
    """The fused GEMM1 op at decode (48 rows of Qwen3-30B-A3B's experts: in chunks): the few-rows GEMM's FP32 h,
    then SiLU·mul + quant; checked as the fused epilogue is, rows past masked_m untouched."""
    groups = 32
    assert few_rows.applies(max_m, n, k, groups, 1, fused=True)
    inp = make_masked_inputs(groups, max_m, 1, n, k, seed=max_m, device="cuda",
                             masked_m=_counts(pattern, groups, max_m))
    act, scale = _poisoned_act((groups, max_m, n // 2), groups=groups)
    fp8_grouped_gemm_silu_mul_quant_hopper(inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale, None, inp.masked_m, 1,
                                           ue8m0, act, scale)
    torch.cuda.synchronize()
    valid = torch.arange(max_m, device="cuda")[None, :] < inp.masked_m[:, None]
    _check_act(inp, act, scale, valid, ue8m0, masked_m=inp.masked_m)


@pytest.mark.parametrize("groups,max_m,n,k", [(32, 8, 7168, 2048), (64, 96, 7168, 256)])
def test_cuda_graph_replays(groups: int, max_m: int, n: int, k: int, launches: list[int]) -> None:
    """Captured once, replayed with other counts (one expert holding every row, all full, none, ragged) and data:
    every replay right. 8 rows: one token tile; 96 rows of small groups expected to hold one each: the chunked
    path (an engine's batched layout: max_m the capacity)."""
    buf = _clone_operands(make_masked_inputs(groups, max_m, 1, n, k, seed=1, device="cuda",
                                             masked_m=_counts("ragged", groups, max_m)))
    out = torch.empty((groups, max_m, n), dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        fp8_grouped_gemm_masked_hopper(buf.x_fp8, buf.x_scale, buf.w_fp8, buf.w_scale, buf.masked_m, 1, out)
    run()
    assert launches, "takes the few-rows kernel"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed, pattern in [(2, "one"), (3, "full"), (4, "empty"), (5, "ragged")]:
        _replay_masked(graph, buf, out, make_masked_inputs(groups, max_m, 1, n, k, seed=seed, device="cuda",
                                                           masked_m=_counts(pattern, groups, max_m)))
