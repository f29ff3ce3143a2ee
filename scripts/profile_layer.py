"""Where one ``Fp8FusedMoE`` forward spends its time on the GPU (the bench's DeepSeek-V3 EP-rank layer).

For each token count: one forward under ``torch.profiler`` (L2 flushed first) — every kernel's device
time in launch order, the sum, and the forward's span from first kernel start to last kernel end (the
difference is the GPU idle time: host syncs and launch gaps; the profiler inflates the gaps) — plus
the host time of the layer's ops. Other modes, one per flag:

    python scripts/profile_layer.py [--tokens 512 8192] [--path contiguous] [--sync] [--combine-sweep]
      --host-ops       host microseconds per call of each op (and of a bare Triton launch)
      --host-profile   cProfile of 200 forwards
      --dispatch       kernel timeline of dispatch_contiguous (all 256 experts local), and of the prefill's
                       quant_dispatch_contiguous (bf16 rows, no sync, x_fp8 returned) with 256 / 384 local
      --scatter        the contiguous dispatch's scatter kernel alone, per block shape (FP8 rows, and
                       quantizing bf16 rows on the way as quant_dispatch_contiguous does without a map)
      --routing        select_experts alone, per block shape
      --fused-gemm1    GEMM1 + SiLU·mul+quant as two kernels vs the fused epilogue (--path masked too)
      --graph-timeline kernels of one CUDA-graph replay of the forward (--path auto by default here), the router
                       GEMM in the graph, after a clean and a dirty flush; --model config.json [--ep N | --tp N]
                       for another model's rank (default: the moe bench's DeepSeek-V3 EP rank)
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moe_fp8.benchmarks.harness import bench_us, flushed_events, span_us
from moe_fp8.benchmarks.moe import LOCAL_EXPERTS, NUM_EXPERTS, build_layer, build_model_layer, capture_forward
from moe_fp8.kernels.triton import dispatch as triton_dispatch
from moe_fp8.kernels.triton.configs import CombineConfig
from moe_fp8.kernels.triton.dispatch import combine as triton_combine
from moe_fp8.layers import dispatch_contiguous
from moe_fp8.quant import per_token_group


def host_us(fn, calls: int = 20) -> float:
    """Median wall time of ``fn`` with a sync after each call (what the GPU waits on, host included)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graph_us(fn, calls: int = 10) -> float:
    """Microseconds per ``fn()`` from a CUDA graph of ``calls`` calls (L2 flushed before each replay): the
    GPU time without the host's launch cost, which on the device machine exceeds a short kernel's."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return bench_us(graph.replay) / calls


def kernel_timeline(fn) -> tuple[list[tuple[str, float, float]], float]:
    """``[(name, start_us, dur_us)]`` of the GPU kernels (and memsets/copies) of one ``fn()``, and its span."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    flush.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.time_range.start)
    if not events:
        return [], 0.0
    t0 = events[0].time_range.start
    span = max(e.time_range.end for e in events) - t0
    return [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in events], span


def profile_tokens(layer, t: int, path: str, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t)
    hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32, generator=gen)

    def forward():
        return layer(hidden, logits, path=path)

    for _ in range(3):
        forward()
    timeline, span = kernel_timeline(forward)
    busy = sum(d for _, _, d in timeline)
    print(f"\n## tokens {t} {path}: GPU span {span:.1f} us, kernels {busy:.1f} us, idle {span - busy:.1f} us; "
          f"bench_us {bench_us(forward):.1f} us")
    prev_end = 0.0
    for name, start, dur in timeline:
        print(f"  {start:8.1f} +{dur:7.1f}  (gap {start - prev_end:6.1f})  {name[:110]}")
        prev_end = start + dur
    weights, ids = layer.route(logits)
    x_fp8, x_scale = per_token_group(hidden)

    def dispatch():
        return dispatch_contiguous(x_fp8, x_scale, ids, LOCAL_EXPERTS, layer.expert_map)

    print(f"  host+GPU per op: route {host_us(lambda: layer.route(logits)):.1f}, "
          f"quant {host_us(lambda: per_token_group(hidden)):.1f}, dispatch_contiguous {host_us(dispatch):.1f}, "
          f"forward {host_us(forward):.1f} us")
    enqueue = enqueue_us(forward, 20)
    graph = f"{graph_us(forward, 3):.1f} us" if not layer.contiguous_sync else "- (host sync)"
    print(f"  host enqueue {enqueue:.1f} us per forward (no sync between); CUDA graph {graph}")
    if not sweep:
        return
    a, _, _, row_map = dispatch()
    y = torch.randn(a.shape[0], layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    combine_sweep(y, row_map, weights, t)
    # every slot local (a single-GPU layer): each row read once, as the moe-data bench
    dense = torch.randperm(t * layer.top_k, device="cuda").view(t, layer.top_k)
    combine_sweep(torch.randn(t * layer.top_k, layer.hidden_size, device="cuda", dtype=torch.bfloat16), dense,
                  weights, t)


def combine_sweep(y: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor, t: int) -> None:
    local = int((row_map >= 0).sum())
    nbytes = 2 * y.shape[1] * (local + t)
    results = []
    for bt, bh, nw, mode in itertools.product((1, 2), (2048, 4096, 8192), (4, 8, 16), ("per slot", "gather", "sparse")):
        if mode == "sparse" and bt != 1:
            continue
        cfg = CombineConfig(bt, bh, nw, mode == "gather", mode == "sparse")
        try:
            us = bench_us(lambda cfg=cfg: triton_combine(y, row_map, weights, None, config=cfg))
        except Exception as exc:  # a config that does not compile is skipped
            print(f"  combine {cfg}: {type(exc).__name__}")
            continue
        results.append((us, cfg))
    results.sort(key=lambda r: r[0])
    print(f"  combine sweep ({local} local rows of {row_map.numel()} pairs, {nbytes / 1e6:.0f} MB moved):")
    for us, cfg in results[:8]:
        print(f"    {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s  {cfg}")
    print(f"    default: {bench_us(lambda: triton_combine(y, row_map, weights, None)):.1f} us")


def host_profile(layer, t: int, path: str, calls: int = 200) -> None:
    """Where the host time of a forward goes (cProfile; the GPU is far from limiting at small ``t``)."""
    hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32)
    for _ in range(5):
        layer(hidden, logits, path=path)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        layer(hidden, logits, path=path)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\n## host profile, tokens {t} {path}, {calls} forwards")
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)


def enqueue_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of ``fn`` without syncs (the GPU work is small: only the host shows)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def host_ops(layer, t: int) -> None:
    """Host time per call of each op of the layer at ``t`` tokens, and of a bare Triton launch."""
    import triton
    import triton.language as tl

    from moe_fp8 import fp8_grouped_gemm_contiguous
    from moe_fp8.ops import quant_dispatch_contiguous, quant_dispatch_masked
    from moe_fp8.quant import silu_mul_per_token_group

    @triton.jit
    def _noop(a_ptr, b_ptr, c_ptr, n, m, k, s0, s1, s2, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(a_ptr + i, tl.load(b_ptr + i) + n + m + k + s0 + s1 + s2, mask=i < n)

    a = torch.zeros(1024, device="cuda", dtype=torch.int32)
    hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32)
    weights, ids = layer.route(logits)
    h = torch.randn(t, 2 * layer.intermediate_size, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    row_map = torch.arange(t * layer.top_k, device="cuda").view(t, -1) % t
    _, _, a_fp8, a_scale, m_indices, _ = quant_dispatch_contiguous(hidden, ids, LOCAL_EXPERTS, layer.expert_map)
    ops = {
        "bare triton launch (11 args)": lambda: _noop[(1,)](a, a, a, 7, 8, 9, 10, 11, 12, BLOCK=1024, FLAG=True),
        "torch.empty x4": lambda: [torch.empty(t, 128, device="cuda") for _ in range(4)],
        "route": lambda: layer.route(logits),
        "per_token_group": lambda: per_token_group(hidden),
        "quant_dispatch_masked": lambda: quant_dispatch_masked(hidden, ids, LOCAL_EXPERTS, t, layer.expert_map),
        "silu_mul_per_token_group": lambda: silu_mul_per_token_group(h),
        "combine": lambda: triton_combine(y, row_map, weights, None),
        "quant_dispatch_contiguous": lambda: quant_dispatch_contiguous(hidden, ids, LOCAL_EXPERTS, layer.expert_map),
        "fp8_grouped_gemm_contiguous (GEMM1)": lambda: fp8_grouped_gemm_contiguous(
            a_fp8, a_scale, layer.w13_weight, layer.w13_weight_scale_inv, m_indices),
        "forward masked": lambda: layer(hidden, logits, path="masked"),
    }
    print(f"\n## host us per call, tokens {t} (no sync between calls)")
    for name, fn in ops.items():
        print(f"  {name:32s} {enqueue_us(fn):7.1f}")


def dispatch_timeline(t: int, hidden_size: int = 7168, experts: int = 256, top_k: int = 8) -> None:
    """Kernels of one ``dispatch_contiguous`` (all experts local, uniform random ids), as the moe-data bench."""
    x = torch.randn(t, hidden_size, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = per_token_group(x)
    ids = torch.rand(t, experts, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    timeline, span = kernel_timeline(lambda: dispatch_contiguous(x_fp8, x_scale, ids, experts))
    print(f"\n## dispatch_contiguous {t}x{hidden_size}, {experts} experts, top-{top_k}: GPU span {span:.1f} us, "
          f"bench_us {bench_us(lambda: dispatch_contiguous(x_fp8, x_scale, ids, experts)):.1f} us")
    for name, start, dur in timeline:
        print(f"  {start:8.1f} +{dur:7.1f}  {name[:100]}")
    for num in (experts, 384):  # the layer's prefill call under TP (every pair local): DeepSeek-V3, Kimi-K2
        ids = torch.rand(t, num, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)

        def quant_dispatch(ids=ids, num=num):
            return triton_dispatch.quant_dispatch_contiguous(x, ids, num, None, 128, sync=False, return_x=True)

        timeline, span = kernel_timeline(quant_dispatch)
        print(f"\n## quant_dispatch_contiguous {t}x{hidden_size}, {num} experts local, top-{top_k}: GPU span "
              f"{span:.1f} us, graph_us {graph_us(quant_dispatch):.1f} us")
        for name, start, dur in timeline:
            print(f"  {start:8.1f} +{dur:7.1f}  {name[:100]}")


def scatter_sweep(t: int, hidden_size: int = 7168, experts: int = 256, top_k: int = 8) -> None:
    """The contiguous dispatch's scatter kernel alone, per block shape (CUDA-graph timed): every expert local
    (the moe-data bench) and one expert-parallel rank (the layer bench: 32 of 256 experts, via ``expert_map``)."""
    from moe_fp8.kernels.triton import dispatch as D
    from moe_fp8.kernels.triton.configs import dispatch_config
    from moe_fp8.utils import empty_scale_tma

    x = torch.randn(t, hidden_size, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = per_token_group(x)
    ids = torch.rand(t, experts, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
    ep_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
    ep_map[:LOCAL_EXPERTS] = torch.arange(LOCAL_EXPERTS, dtype=torch.int32, device="cuda")
    for name, num_local, emap in (("all local", experts, None), ("EP rank", LOCAL_EXPERTS, ep_map)):
        cfg0 = dispatch_config(t, top_k, hidden_size, num_local)
        routing, pending = D._contiguous_plan(ids, num_local, emap, 128, True, cfg0)
        m_rows = D._contiguous_rows(pending, ids, num_local, emap, 128, True)  # exact rows, scatter after the sync
        local = D._contiguous_scatter(x_fp8, x_scale, ids, routing, m_rows, cfg0)[3] >= 0
        local_pairs, used = int(local.sum()), int(local.any(1).sum())
        nbytes = (hidden_size + hidden_size // 32) * (local_pairs + (used if emap is not None else t))
        print(f"\n## scatter {t}x{hidden_size}, {name}: {local_pairs} local pairs, {m_rows} rows "
              f"({nbytes / 1e6:.0f} MB moved)")
        variants = [(bt, bk, nw, False) for bt, bk, nw in ((1, 8192, 8), (1, 8192, 4), (2, 8192, 8), (1, 4096, 4),
                                                           (1, 2048, 4))]
        variants += [(1, bk, nw, True) for bk, nw in ((8192, 4), (8192, 8), (4096, 4), (2048, 4))]
        for bt, bk, nw, sparse in variants:
            cfg = dispatch_config(t, top_k, hidden_size, num_local, block_t=bt, block_k=bk, num_warps=nw, sparse=sparse)
            us = graph_us(lambda cfg=cfg, r=routing, m=m_rows: D._contiguous_scatter(x_fp8, x_scale, ids, r, m, cfg))
            print(f"  {'sparse' if sparse else 'dense '} block_t {bt} block_k {bk} warps {nw}: {us:7.1f} us "
                  f"{nbytes / us / 1e3:6.0f} GB/s")
        # the same scatter quantizing the bf16 rows on the way (quant_dispatch_contiguous), with / without x_fp8,
        # against the quant kernel it replaces
        print(f"  quant kernel alone: {graph_us(lambda: per_token_group(x)):7.1f} us")
        x_out = (torch.empty_like(x_fp8), empty_scale_tma(t, x_scale.shape[1], device="cuda"))
        quant_variants = [(bk, nw, False) for bk, nw in ((8192, 8), (4096, 4), (2048, 4))]
        quant_variants += [(bk, nw, True) for bk, nw in ((8192, 8), (4096, 4), (4096, 8), (2048, 4))]
        for (bk, nw, sparse), write_x in itertools.product(quant_variants, (True, False)):
            cfg = dispatch_config(t, top_k, hidden_size, num_local, block_t=1 if sparse else None, block_k=bk,
                                  num_warps=nw, quant=True, sparse=sparse)
            quant = D._Quant(False, 1e-10, *(x_out if write_x else (None, None)))
            us = graph_us(lambda cfg=cfg, r=routing, m=m_rows, q=quant: D._contiguous_scatter(x, None, ids, r, m, cfg,
                                                                                             quant=q))
            print(f"  quantizing, {'sparse' if sparse else 'dense '} block_k {bk} warps {nw}, "
                  f"{'with' if write_x else 'without'} x_fp8: {us:7.1f} us")


def graph_timeline(layer, t: int, path: str) -> None:
    """Each kernel of one replay of a captured forward (router GEMM included) after a clean / dirty flush: start
    and duration from the replay's first kernel, and the gap before it (the decode step's fixed costs)."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    router = (torch.randn(layer.num_experts, layer.hidden_size, device="cuda", generator=gen)
              / layer.hidden_size**0.5).bfloat16()  # (a checkpoint's dtype)
    graph = capture_forward(layer, hidden, None, path, router_weight=router)
    for _ in range(3):
        graph.replay()
    print(f"\n## tokens {t} {path}, CUDA-graph replay: bench_us {bench_us(graph.replay):.1f} us")
    for clean in (True, False):
        events = flushed_events(graph.replay, clean)
        t0, prev_end = events[0][1], events[0][1]
        print(f"  after a {'clean' if clean else 'dirty'} flush: span {span_us(events):.1f} us")
        for name, start, end in events:
            print(f"  {start - t0:8.1f} +{end - start:6.1f}  (gap {start - prev_end:5.1f})  {name[:100]}")
            prev_end = max(prev_end, end)


def routing_sweep(layer, t: int) -> None:
    """``select_experts`` of the layer's routing (DeepSeek-V3 grouped sigmoid top-8 of 256) per config."""
    from moe_fp8.kernels.triton.configs import routing_config
    from moe_fp8.kernels.triton.routing import select_experts

    logits = torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32)
    args = (layer.top_k, layer.scoring_func, layer.renormalize, layer.n_group, layer.topk_group,
            layer.e_score_correction_bias, layer.routed_scaling_factor)
    default = routing_config(t, NUM_EXPERTS, layer.top_k, layer.n_group)
    ref = select_experts(logits, *args)
    print(f"\n## select_experts {t} x {NUM_EXPERTS}: default {default}")
    for bt, nw in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        cfg = routing_config(t, NUM_EXPERTS, layer.top_k, layer.n_group, block_t=bt, num_warps=nw)
        same = all(torch.equal(a, b) for a, b in zip(select_experts(logits, *args, config=cfg), ref, strict=True))
        us = bench_us(lambda cfg=cfg: select_experts(logits, *args, config=cfg))
        print(f"  block_t {bt} warps {nw}: {us:7.1f} us{'' if same else '  (DIFFERENT RESULT)'}")


def fused_gemm1(layer, t: int, path: str) -> None:
    """GEMM1 then the SiLU·mul + quant kernel against ``fp8_grouped_gemm_silu_mul_quant`` (the fused epilogue)
    on the layer's own dispatched batch, CUDA-graph timed."""
    from moe_fp8 import fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked, fp8_grouped_gemm_silu_mul_quant
    from moe_fp8.layers import dispatch_masked
    from moe_fp8.layers.moe import masked_expected_m
    from moe_fp8.quant import silu_mul_per_token_group

    hidden = torch.randn(t, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    _, ids = layer.route(torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32))
    x_fp8, x_scale = per_token_group(hidden)
    w13, w13_scale = layer.w13_weight, layer.w13_weight_scale_inv
    expected_m = masked_expected_m(t, layer.top_k, NUM_EXPERTS)  # the layer's hint on both paths
    if path == "contiguous":
        a, a_scale, m_indices, _ = dispatch_contiguous(x_fp8, x_scale, ids, LOCAL_EXPERTS, layer.expert_map)
        grouping = {"m_indices": m_indices, "expected_m": expected_m}
        plain = lambda: fp8_grouped_gemm_contiguous(a, a_scale, w13, w13_scale, m_indices,  # noqa: E731
                                                    expected_m=expected_m)
    else:
        a, a_scale, masked_m, _ = dispatch_masked(x_fp8, x_scale, ids, LOCAL_EXPERTS, t, layer.expert_map)
        grouping = {"masked_m": masked_m, "expected_m": expected_m}
        plain = lambda: fp8_grouped_gemm_masked(a, a_scale, w13, w13_scale, masked_m, expected_m)  # noqa: E731
    h = plain()
    silu_us = graph_us(lambda: silu_mul_per_token_group(h, masked_m=grouping.get("masked_m")), 5)
    fused_us = graph_us(lambda: fp8_grouped_gemm_silu_mul_quant(a, a_scale, w13, w13_scale, **grouping), 5)
    print(f"## GEMM1 {path}, {t} tokens ({a.shape[0]} rows): plain {graph_us(plain, 5):.1f} + SiLU·mul+quant "
          f"{silu_us:.1f} us, fused {fused_us:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="*", default=[512, 8192])
    p.add_argument("--path", default="contiguous")
    p.add_argument("--sync", action="store_true", help="the layer with contiguous_sync=True (one host sync)")
    p.add_argument("--combine-sweep", action="store_true")
    p.add_argument("--host-profile", action="store_true", help="cProfile of 200 forwards instead")
    p.add_argument("--host-ops", action="store_true", help="host time per call of each op instead")
    p.add_argument("--dispatch", action="store_true", help="dispatch_contiguous kernel timelines instead")
    p.add_argument("--scatter", action="store_true", help="scatter kernel variants instead")
    p.add_argument("--routing", action="store_true", help="select_experts configs instead")
    p.add_argument("--fused-gemm1", action="store_true", help="GEMM1 + SiLU·mul+quant, plain vs fused, instead")
    p.add_argument("--graph-timeline", action="store_true", help="kernels of a CUDA-graph replay instead")
    p.add_argument("--model", help="with --graph-timeline: a model's config.json")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    if args.graph_timeline:
        if args.model:
            with open(args.model) as f:
                layer = build_model_layer(json.load(f), args.ep, tp=args.tp)[0]
        else:
            layer = build_layer()[0]
        for t in args.tokens:
            graph_timeline(layer, t, "auto" if args.path == "contiguous" else args.path)
        return
    layer, _ = build_layer()
    layer.contiguous_sync = args.sync
    for t in args.tokens:
        if args.scatter:
            scatter_sweep(t)
        elif args.routing:
            routing_sweep(layer, t)
        elif args.fused_gemm1:
            fused_gemm1(layer, t, args.path)
        elif args.dispatch:
            dispatch_timeline(t)
        elif args.host_ops:
            host_ops(layer, t)
        elif args.host_profile:
            host_profile(layer, t, args.path)
        else:
            profile_tokens(layer, t, args.path, args.combine_sweep)


if __name__ == "__main__":
    main()
