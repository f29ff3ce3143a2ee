"""Fp8FusedMoE's persistent decode workspace (MaskedWorkspace), the ``out=`` destinations of the ops it
feeds (dispatch_masked, quant_dispatch_masked, silu_mul_per_token_group), and the per-stage timing hook.

CPU: the reuse logic itself (one allocation per (device, dtype, max_m), views per batch size, the
ping-pong aliasing, every op writing into it, results equal to the allocating path). GPU (Hopper): two
CUDA graphs of different batch sizes captured over one workspace replay to the eager result, capture
allocates none of the ``[E, T, ·]`` buffers, and replay allocates nothing.
"""

from __future__ import annotations

import pytest
import torch
from test_layers import ROUTINGS, MoEWeights

from moe_fp8 import layers, quant
from moe_fp8.layers import Fp8FusedMoE
from moe_fp8.layers import moe as moe_module
from moe_fp8.layers.moe import STAGES, MaskedWorkspace, StageTimer
from moe_fp8.testing import make_dispatch_inputs, randn
from moe_fp8.utils import empty_scale_tma, is_scale_tma_layout

FP8 = torch.float8_e4m3fn


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------------------------
# ops: out= / out_scale=
# ----------------------------------------------------------------------------------------------
def test_silu_mul_writes_into_given_destinations():
    h = randn((3, 5, 512), seed=1)
    masked_m = torch.tensor([5, 0, 2], dtype=torch.int32)
    y_ref, s_ref = quant.silu_mul_per_token_group(h, masked_m=masked_m, ue8m0=True)
    out = torch.full((3, 5, 256), float("nan")).to(FP8)
    out_scale = empty_scale_tma(5, 2, groups=3).fill_(-1.0)
    y, s = quant.silu_mul_per_token_group(h, masked_m=masked_m, ue8m0=True, out=out, out_scale=out_scale)
    assert y is out and s is out_scale
    for g, m in enumerate(masked_m.tolist()):  # the valid rows are the allocating call's, bit for bit
        assert torch.equal(y[g, :m].view(torch.uint8), y_ref[g, :m].view(torch.uint8))
        assert torch.equal(s[g, :m], s_ref[g, :m])
    # one destination alone: the other is allocated
    y2, s2 = quant.silu_mul_per_token_group(h[0], ue8m0=True, out_scale=empty_scale_tma(5, 2))
    assert y2.shape == (5, 256) and is_scale_tma_layout(s2) and torch.equal(s2, s_ref[0])
    with pytest.raises(ValueError, match=r"out must have shape \(3, 5, 256\)"):
        quant.silu_mul_per_token_group(h, out=torch.empty(3, 5, 128, dtype=FP8))
    with pytest.raises(TypeError, match="out"):
        quant.silu_mul_per_token_group(h, out=torch.empty(3, 5, 256))
    with pytest.raises(ValueError, match="out_scale must be column-major"):
        quant.silu_mul_per_token_group(h, out_scale=torch.empty(3, 5, 2))


def test_dispatch_masked_writes_into_given_destinations():
    d = make_dispatch_inputs(7, 256, 4, 2, seed=2)
    ref = layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 4, 7)
    out, out_scale = torch.empty(4, 7, 256, dtype=FP8), empty_scale_tma(7, 2, groups=4)
    got = layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 4, 7, out=out, out_scale=out_scale)
    assert got[0] is out and got[1] is out_scale
    assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[3])
    for e, m in enumerate(ref[2].tolist()):
        assert torch.equal(out[e, :m].view(torch.uint8), ref[0][e, :m].view(torch.uint8))
        assert torch.equal(out_scale[e, :m], ref[1][e, :m])
    with pytest.raises(ValueError, match=r"out must have shape \(4, 7, 256\)"):
        layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 4, 7, out=torch.empty(4, 6, 256, dtype=FP8))
    with pytest.raises(ValueError, match="out_scale must be on the same device"):
        layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, 4, 7,
                               out_scale=empty_scale_tma(7, 2, groups=4, device="meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_dispatch_masked_equals_quant_then_dispatch(dtype):
    """The fused op is ``per_token_group`` then ``dispatch_masked`` (same bits), allocating or into given
    destinations (either alone), with an expert map, ue8m0, and no tokens."""
    d = make_dispatch_inputs(7, 272, 6, 2, seed=6)  # 272: a partial last scale group
    x = d.x.to(dtype)
    emap = torch.tensor([2, -1, 0, 3, -1, 1], dtype=torch.int32)
    for ue8m0 in (False, True):
        x_fp8, x_scale = quant.per_token_group(x, ue8m0=ue8m0)
        want = layers.dispatch_masked(x_fp8, x_scale, d.topk_ids, 4, 5, emap)
        got = layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, emap, ue8m0=ue8m0)
        assert len(got) == 6 and got[1].stride() == x_scale.stride() and got[3].stride() == want[1].stride()
        for g, w in zip(got, (x_fp8, x_scale, *want), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g, w.view(torch.uint8) if w.dtype == FP8 else w)
        out, out_scale = torch.empty(4, 5, 272, dtype=FP8), empty_scale_tma(5, 3, groups=4)
        res = layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, emap, ue8m0=ue8m0, out=out, out_scale=out_scale)
        assert res[2] is out and res[3] is out_scale
        assert torch.equal(res[4], want[2]) and torch.equal(res[5], want[3])
        for e, m in enumerate(want[2].tolist()):
            assert torch.equal(out[e, :m].view(torch.uint8), want[0][e, :m].view(torch.uint8))
            assert torch.equal(out_scale[e, :m], want[1][e, :m])
        alone = layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, emap, ue8m0=ue8m0, out_scale=out_scale)
        assert alone[3] is out_scale and alone[2].shape == (4, 5, 272) and torch.equal(alone[5], want[3])
    empty = layers.quant_dispatch_masked(x[:0], d.topk_ids[:0], 4, 0)
    assert [tuple(t.shape) for t in empty] == [(0, 272), (0, 3), (4, 0, 272), (4, 0, 3), (4,), (0, 2)]
    assert (empty[4] == 0).all()
    with pytest.raises(ValueError, match=r"out must have shape \(4, 5, 272\)"):
        layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, out=torch.empty(4, 6, 272, dtype=FP8))
    with pytest.raises(ValueError, match="out_scale must be column-major"):
        layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, out_scale=torch.empty(4, 5, 3))
    with pytest.raises(ValueError, match="out_scale must be on the same device as x"):
        layers.quant_dispatch_masked(x, d.topk_ids, 4, 5, out_scale=empty_scale_tma(5, 3, groups=4, device="meta"))


def test_out_variants_compile_fullgraph():
    """Under torch.compile the destinations go through the mutating ``*_out`` custom ops."""
    d = make_dispatch_inputs(6, 256, 4, 2, seed=3)

    def f(x_fp8, x_scale, ids, a, a_scale, y, y_scale):
        _, _, masked_m, row_map = layers.dispatch_masked(x_fp8, x_scale, ids, 4, 6, out=a, out_scale=a_scale)
        h = a[:, :, :].float().repeat(1, 1, 2)  # [E, 6, 512] stand-in for GEMM1's output
        quant.silu_mul_per_token_group(h, masked_m=masked_m, out=y, out_scale=y_scale)
        return masked_m, row_map

    def fresh():
        return (torch.zeros(4, 6, 256, dtype=FP8), empty_scale_tma(6, 2, groups=4).zero_(),
                torch.zeros(4, 6, 256, dtype=FP8), empty_scale_tma(6, 2, groups=4).zero_())

    eager_bufs, compiled_bufs = fresh(), fresh()
    eager = f(d.x_fp8, d.x_scale, d.topk_ids, *eager_bufs)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(d.x_fp8, d.x_scale, d.topk_ids, *compiled_bufs)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    for a, b in zip(eager_bufs, compiled_bufs, strict=True):  # the mutations reached the caller's tensors
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    assert eager_bufs[0].view(torch.uint8).any()


def test_quant_dispatch_masked_compiles_fullgraph():
    """Both custom ops of the fused quant + dispatch (allocating, and ``*_out`` mutating the caller's
    destinations) under torch.compile(fullgraph=True): eager results, x_fp8 / x_scale for a consumer."""
    d = make_dispatch_inputs(6, 256, 4, 2, seed=7)

    def f(x, ids, a, a_scale):
        x_fp8, x_scale, _, _, masked_m, row_map = layers.quant_dispatch_masked(x, ids, 4, 6, ue8m0=True, out=a,
                                                                               out_scale=a_scale)
        _, _, b, b_scale, masked_m2, _ = layers.quant_dispatch_masked(x * 2, ids, 4, 6)
        return x_fp8.float() * x_scale.repeat_interleave(128, 1), masked_m, row_map, b.float(), b_scale, masked_m2

    def fresh():
        return torch.zeros(4, 6, 256, dtype=FP8), empty_scale_tma(6, 2, groups=4).zero_()

    eager_bufs, compiled_bufs = fresh(), fresh()
    eager = f(d.x, d.topk_ids, *eager_bufs)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(d.x, d.topk_ids, *compiled_bufs)
    m2 = eager[5]
    valid = torch.arange(6)[None, :] < m2[:, None]
    for i in (0, 1, 2, 5):
        assert torch.equal(eager[i], compiled[i])
    assert torch.equal(eager[3][valid], compiled[3][valid]) and torch.equal(eager[4][valid], compiled[4][valid])
    assert compiled[4].stride() == eager[4].stride()  # the fake's 3-D TMA layout
    for a, b in zip(eager_bufs, compiled_bufs, strict=True):  # the mutations reached the caller's tensors
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)
    assert eager_bufs[0].view(torch.uint8).any()


@pytest.mark.slow
def test_opcheck_out_variants():
    d = make_dispatch_inputs(6, 48, 4, 2, seed=4)
    torch.library.opcheck(torch.ops.moe_fp8.dispatch_masked_out.default,
                          (d.x_fp8, d.x_scale, d.topk_ids, 4, 3, None, torch.empty(4, 3, 48, dtype=FP8),
                           empty_scale_tma(3, 1, groups=4)),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    h = randn((2, 3, 64), seed=5)
    torch.library.opcheck(torch.ops.moe_fp8.silu_mul_per_token_group_quant_out.default,
                          (h, 128, False, torch.tensor([1, 3], dtype=torch.int32), 1e-10,
                           torch.empty(2, 3, 32, dtype=FP8), empty_scale_tma(3, 1, groups=2)),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(torch.ops.moe_fp8.quant_dispatch_masked_out.default,
                          (d.x, d.topk_ids, 4, 3, None, True, 1e-10, torch.empty(4, 3, 48, dtype=FP8),
                           empty_scale_tma(3, 1, groups=4)),
                          test_utils=("test_autograd_registration", "test_faketensor"))


# ----------------------------------------------------------------------------------------------
# MaskedWorkspace
# ----------------------------------------------------------------------------------------------
def test_workspace_views_layout_and_ping_pong():
    e, h, i, max_m = 4, 384, 256, 10
    ws = MaskedWorkspace(e, h, i, max_m, "cpu")
    separate = e * max_m * (h + 2 * 2 * i + i + 2 * h)  # four [E, max_m, ·] buffers, scales aside
    assert ws.nbytes < separate
    for m in (max_m, 7, 1, 0):
        b = ws.views(m)
        assert ws.views(m) is b  # cached: the same tensors (pointers, shapes) every time m repeats
        assert b.a_fp8.shape == (e, m, h) and b.a_fp8.dtype == FP8 and b.a_fp8.is_contiguous()
        assert b.h.shape == (e, m, 2 * i) and b.h.dtype == torch.bfloat16 and b.h.is_contiguous()
        assert b.y_fp8.shape == (e, m, i) and b.y.shape == (e, m, h) and b.y.dtype == torch.bfloat16
        assert b.a_scale.shape == (e, m, 3) and b.y_scale.shape == (e, m, 2)
        assert is_scale_tma_layout(b.a_scale) and is_scale_tma_layout(b.y_scale)
        if m:
            # each step reads one region and writes the other: a -> h -> y_fp8 -> y
            assert b.a_fp8.data_ptr() == b.y_fp8.data_ptr() != b.h.data_ptr() == b.y.data_ptr()
            assert b.a_scale.data_ptr() == b.y_scale.data_ptr()
    with pytest.raises(ValueError, match="up to 10 tokens"):
        ws.views(11)


def test_workspace_for_the_fused_gemm1_never_aliases_its_input_and_output():
    """The fused GEMM1 reads a_fp8 / a_scale while it writes y_fp8 / y_scale: separate bytes; no h."""
    e, h, i, max_m = 4, 384, 256, 10
    ws = MaskedWorkspace(e, h, i, max_m, "cpu", fused_gemm1=True)
    assert ws.nbytes < MaskedWorkspace(e, h, i, max_m, "cpu").nbytes
    for m in (max_m, 7, 1):
        b = ws.views(m)
        assert b.h is None
        assert b.a_fp8.shape == (e, m, h) and b.y_fp8.shape == (e, m, i) and b.y_fp8.dtype == FP8
        assert b.y.shape == (e, m, h) and b.y.dtype == torch.bfloat16 and b.y.is_contiguous()
        assert is_scale_tma_layout(b.a_scale) and is_scale_tma_layout(b.y_scale)
        # a -> [GEMM1 + SiLU·mul + quant] -> y_fp8 -> [GEMM2] -> y: each step reads one region, writes another
        assert _storage(b.a_fp8) == _storage(b.y) != _storage(b.y_fp8)
        assert _storage(b.a_scale) != _storage(b.y_scale)


def test_grouped_experts_masked_refuses_a_workspace_of_the_other_gemm1_form():
    """On CPU GEMM1 is unfused: a fused-form workspace (no h, y aliasing a) must be refused, not used."""
    e, h, i, m = 2, 128, 128, 3
    bufs = MaskedWorkspace(e, h, i, m, "cpu", fused_gemm1=True).views(m)
    w13 = torch.zeros(e, 2 * i, h, dtype=FP8)
    w2 = torch.zeros(e, h, i, dtype=FP8)
    with pytest.raises(ValueError, match="built for fused_gemm1=True"):
        moe_module.grouped_experts_masked(bufs.a_fp8, bufs.a_scale, torch.zeros(e, dtype=torch.int32), 1, w13,
                                          torch.ones(e, 2, 1), w2, torch.ones(e, 1, 1), bufs=bufs)


def _spy_outs(monkeypatch) -> list[tuple[str, torch.Tensor]]:
    """Record every destination the layer passes to the masked path's ops."""
    seen: list[tuple[str, torch.Tensor]] = []
    for name in ("quant_dispatch_masked", "fp8_grouped_gemm_masked", "silu_mul_per_token_group"):
        real = getattr(moe_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.extend((_name, t) for key, t in kwargs.items() if key.startswith("out") and t is not None)
            return _real(*args, **kwargs)

        monkeypatch.setattr(moe_module, name, spy)
    return seen


@pytest.mark.parametrize("shared", [False, True])
def test_masked_path_reuses_one_workspace(monkeypatch, shared):
    num_experts, hidden, inter, top_k = 8, 256, 128, 3
    wts = MoEWeights(num_experts, hidden, inter, shared_inter=128 if shared else 0, seed=10)
    kwargs = dict(num_shared_experts=1 if shared else 0, **ROUTINGS["grouped_sigmoid"])
    moe = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, masked_max_tokens=12, **kwargs))
    # the allocating path: same weights, a workspace of 0 tokens (never used)
    fresh = wts.fill(Fp8FusedMoE(num_experts, hidden, inter, top_k, masked_max_tokens=0, **kwargs))
    seen = _spy_outs(monkeypatch)
    for t, seed in ((12, 11), (5, 12), (12, 13), (1, 14)):  # stale rows of a larger batch stay behind
        x, logits = randn((t, hidden), seed=seed), randn((t, num_experts), seed=seed + 50, dtype=torch.float32)
        out = moe(x, logits)
        assert torch.equal(out, fresh(x, logits, path="masked"))
        assert torch.equal(out, moe(x, logits, path="contiguous"))
    # (on CPU GEMM1 and SiLU·mul + quant are two ops: the unfused workspace)
    assert list(moe._workspaces) == [(torch.device("cpu"), torch.bfloat16, 12, False)]
    ws = moe._workspaces[(torch.device("cpu"), torch.bfloat16, 12, False)]
    regions = {_storage(ws._p), _storage(ws._q), _storage(ws._s)}
    # every masked forward (4 of them, with contiguous ones between) passed all six destinations, all
    # inside the workspace: dispatch (a, a_scale), GEMM1 (h), SiLU·mul (y_fp8, y_scale), GEMM2 (y)
    assert len(seen) == 4 * 6 and {_storage(t) for _, t in seen} == regions
    assert fresh._workspaces == {}


def test_masked_batch_above_capacity_allocates_and_release(monkeypatch):
    wts = MoEWeights(8, 128, 128, seed=20)
    moe = wts.fill(Fp8FusedMoE(8, 128, 128, 2, masked_max_tokens=4))
    seen = _spy_outs(monkeypatch)
    x, logits = randn((6, 128), seed=21), randn((6, 8), seed=22)
    # 6 > 4 tokens forced down the masked path: per-call buffers, no workspace created
    assert torch.equal(moe(x, logits, path="masked"), moe(x, logits, path="contiguous"))
    assert seen == [] and moe._workspaces == {}
    moe(x[:3], logits[:3])
    assert len(moe._workspaces) == 1 and len(seen) == 6
    moe.masked_max_tokens = 5  # another max_m on the same device: a second workspace, the first kept
    moe(x[:3], logits[:3])
    assert sorted(k[2] for k in moe._workspaces) == [4, 5]
    moe.release_workspaces()
    assert moe._workspaces == {}
    assert moe(torch.empty(0, 128, dtype=torch.bfloat16), torch.empty(0, 8)).shape == (0, 128)
    assert moe._workspaces == {}  # nothing to hold for an empty batch


# ----------------------------------------------------------------------------------------------
# stage hook
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
def test_stage_timer_marks_every_stage_in_order(shared):
    wts = MoEWeights(8, 128, 128, shared_inter=128 if shared else 0, seed=30)
    moe = wts.fill(Fp8FusedMoE(8, 128, 128, 2, num_shared_experts=1 if shared else 0))
    x, logits = randn((5, 128), seed=31), randn((5, 8), seed=32)
    expected = moe(x, logits)
    timer = StageTimer("cpu")
    moe.stage_hook = timer
    for path in ("contiguous", "masked"):
        assert torch.equal(moe(x, logits, path=path), expected)  # timing changes nothing
    moe.stage_hook = None
    want = [s for s in STAGES if shared or s != "shared"]
    split = timer.stages_us()
    assert [list(d) for d in split] == [want, want]
    assert all(v >= 0 for d in split for v in d.values())
    with pytest.raises(RuntimeError, match="before 'start'"):
        StageTimer("cpu")("routing")


# ----------------------------------------------------------------------------------------------
# GPU: CUDA graphs over one workspace
# ----------------------------------------------------------------------------------------------
def _capture(moe: Fp8FusedMoE, t: int, seed: int, path: str = "auto") -> tuple[
        torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Capture ``path`` for ``t`` tokens; returns (graph, x, logits, out, bytes allocated in capture)."""
    x = randn((t, moe.hidden_size), seed=seed, device="cuda")
    logits = randn((t, moe.num_experts), seed=seed + 1, device="cuda", dtype=torch.float32)
    moe(x, logits, path="masked")  # warm-up: backends, JIT variants, the workspace from the ordinary pool
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, logits, path=path)
    torch.cuda.synchronize()
    return graph, x, logits, out, torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - before


@pytest.mark.hopper
def test_two_cuda_graphs_share_the_workspace_and_replay_to_the_eager_result():
    e, hidden, inter, top_k = 16, 256, 128, 4
    wts = MoEWeights(e, hidden, inter, shared_inter=128, seed=40)
    kwargs = dict(num_shared_experts=1, masked_max_tokens=32, **ROUTINGS["grouped_sigmoid"])
    moe = wts.fill(Fp8FusedMoE(e, hidden, inter, top_k, **kwargs)).cuda()
    # the same layer without a usable workspace: its masked captures allocate the [E, T, ·] buffers
    plain = wts.fill(Fp8FusedMoE(e, hidden, inter, top_k, **{**kwargs, "masked_max_tokens": 0})).cuda()
    graphs = {t: _capture(moe, t, seed=41 + t) for t in (24, 9)}
    assert len(moe._workspaces) == 1  # both graphs, one workspace
    _, _, _, _, plain_bytes = _capture(plain, 24, seed=70, path="masked")
    # The intermediates of 24 tokens, which the plain capture allocates and ours must not: FP8 rows,
    # the activation and the bf16 GEMM2 output (on Hopper GEMM1's bf16 output is never materialised:
    # the SiLU·mul + quant runs in its epilogue).
    buffers = e * 24 * (hidden + inter + 2 * hidden)
    assert plain_bytes - graphs[24][4] >= buffers

    for rnd in range(2):
        inputs = {}
        for t in graphs:
            new_logits = randn((t, e), seed=100 * rnd + t + 1, device="cuda", dtype=torch.float32)
            new_logits[:, 3] += 6.0 * rnd  # a hot expert in the second round
            inputs[t] = (randn((t, hidden), seed=100 * rnd + t, device="cuda"), new_logits)
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
        results = {}
        for t, (graph, x, logits, out, _) in graphs.items():
            x.copy_(inputs[t][0])
            logits.copy_(inputs[t][1])
            graph.replay()
            results[t] = out.clone()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs + len(graphs)  # the clones only
        for t, (_, x, logits, _, _) in graphs.items():
            # each graph's output, after the other graph replayed over the same workspace, is the eager result
            assert torch.equal(results[t], plain(x, logits, path="masked"))
            assert torch.equal(results[t], moe(x, logits))


def test_bench_moe_stage_split_adds_up_on_cpu():
    """``moe-fp8 bench moe``'s split: stage medians of one forward and the forward they add up to."""
    from moe_fp8.benchmarks import moe as bench_moe

    moe = MoEWeights(8, 128, 128, seed=50).fill(Fp8FusedMoE(8, 128, 128, 2))
    x, logits = randn((6, 128), seed=51), randn((6, 8), seed=52)
    for path in ("contiguous", "masked"):
        stages, forward = bench_moe._stage_split(moe, x, logits, path)
        assert list(stages) == [s for s in STAGES if s != "shared"]
        assert forward > 0 and all(v >= 0 for v in stages.values())
        assert sum(stages.values()) <= forward * 1.5  # medians of parts vs median of sums: same order
    assert moe.stage_hook is None
