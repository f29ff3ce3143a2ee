"""``moe-fp8 bench moe``: one DeepSeek-V3 MoE layer as one expert-parallel rank of 8 holds it (32 of
256 experts, top-8 grouped routing, hidden 7168, expert intermediate 2048), prefill and decode.

Impls per token count (kind ``moe_layer``):
- ``moe_fp8``: ``Fp8FusedMoE`` (contiguous path above the crossover, masked path at and below it;
  decode rows also under a CUDA graph, ``moe_fp8_graph``);
- ``torch_blockwise_loop``: the same layer with each grouped GEMM replaced by one torch block-scaled
  ``_scaled_mm`` per expert (what a user has without our kernels);
- ``torch_bf16``: a bf16 PyTorch MoE looping over the local experts (dequantized weights).
Plus, per path (``moe_layer_path`` rows: the whole layer; the masked-vs-contiguous crossover),
``moe_layer_stage`` rows: the time of each stage of our layer (``moe_fp8.layers.STAGES``: routing, quant,
dispatch, GEMM1, SiLU·mul + quant, GEMM2, combine; on the masked path the quantization is fused into the
dispatch, so "quant" is ~0 there and "dispatch" holds both) measured inside one forward — CUDA events recorded
between the stages by ``Fp8FusedMoE.stage_hook`` (``StageTimer``), L2 flushed before each forward,
medians over ``SPLIT_REPS`` forwards — so the stages add up to the forward and a host sync the GPU waits
on counts in the stage that causes it (timing each step alone would hide it). The GPU sleeps before each
forward (``SPLIT_HEAD_START_CYCLES``) so that the host has enqueued it by the time the GPU gets there: a
launch gap of this host (~600 us of Python per forward) is not the layer's GPU time.
The notes also give each grouped GEMM's kernel alone (``bench_us``) beside its stage, and the GEMMs'
share of the forward. Prefill sizes also run from a captured CUDA graph (the contiguous path has no host
sync): ``moe_layer_path`` rows with path ``contiguous_graph``, the GEMM kernels' share of a profiled
replay, and the same layer with ``contiguous_sync=True`` (one host sync, exact layout) for comparison.

Routing logits are random, except at one token: under DeepSeek-V3's grouped routing a token's copies land
on this rank (expert group 0) or not at all, and a random one may not, which would time no GEMM. The
one-token row routes its token here: two of its eight experts local, the others elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from . import BenchKind, Step, parse_ints
from .harness import bench_us, flushed_events, flushed_spans_us, measure_ceilings, row, span_us

NUM_EXPERTS, LOCAL_EXPERTS, HIDDEN, INTER, TOP_K = 256, 32, 7168, 2048, 8
N_GROUP, TOPK_GROUP, SCALING = 8, 4, 2.5
PREFILL_TOKENS = (512, 2048, 8192, 16384)
DECODE_TOKENS = (1, 8, 64, 128, 256)
SPLIT_REPS = 20  # forwards whose per-stage events give the split's medians
SPLIT_HEAD_START_CYCLES = 3_000_000  # GPU sleep before each split forward (~1.7 ms at H100 clocks)


def build_layer(seed: int = 0):
    """Rank 0's layer with random block-FP8 experts (and the bf16 copies the baseline needs)."""
    from moe_fp8.layers import Fp8FusedMoE

    gen = torch.Generator(device="cuda").manual_seed(seed)
    expert_map = [i if i < LOCAL_EXPERTS else -1 for i in range(NUM_EXPERTS)]
    layer = Fp8FusedMoE(NUM_EXPERTS, HIDDEN, INTER, TOP_K, scoring_func="sigmoid", renormalize=True,
                        n_group=N_GROUP, topk_group=TOPK_GROUP, routed_scaling_factor=SCALING,
                        use_correction_bias=True, expert_map=expert_map, device="cuda")
    bf16 = fill_random_experts(layer, gen)
    layer.e_score_correction_bias.copy_(torch.randn(NUM_EXPERTS, device="cuda", generator=gen) * 0.01)
    return layer, bf16


def build_model_layer(cfg: dict[str, Any], ep: int = 1, seed: int = 0, tp: int = 1, shared: bool = False):
    """Rank 0 of ``ep`` of any supported model's MoE layer (its ``config.json`` dict; routing as the model's
    transformers block sets it) with random block-FP8 experts, and their bf16 copies; with ``tp > 1`` every
    expert's intermediate size is split over ``tp`` ranks instead (TP-sharded experts). ``shared``: with the
    model's shared experts (split over ``tp`` as the routed ones, whole under expert parallelism), their bf16
    copies under ``"shared"``; without, none."""
    from types import SimpleNamespace

    from moe_fp8.integrations.transformers import ARCHITECTURES, MOE_BLOCKS
    from moe_fp8.layers import Fp8FusedMoE, expert_map_for_rank
    from moe_fp8.layers.checkpoint import model_family

    arch = ARCHITECTURES[model_family(cfg)]
    experts, hidden, full_inter = int(cfg[arch.num_experts_key]), int(cfg["hidden_size"]), int(cfg[arch.moe_inter_key])
    if tp < 1 or full_inter % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide the experts' {arch.moe_inter_key} {full_inter}")
    inter = full_inter // tp
    routing = MOE_BLOCKS[arch.model_type].routing(SimpleNamespace(**cfg))
    num_shared = routing.pop("num_shared_experts", 0)
    if shared and not num_shared:
        raise ValueError(f"{cfg['model_type']} has no shared experts")
    num_shared = num_shared if shared else 0
    layer = Fp8FusedMoE(experts, hidden, inter, int(cfg["num_experts_per_tok"]), device="cuda",
                        expert_map=expert_map_for_rank(experts, 0, ep) if ep > 1 else None,
                        num_shared_experts=num_shared,
                        shared_intermediate_size=num_shared * full_inter // tp if num_shared else None, **routing)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = fill_random_experts(layer, gen)
    if num_shared:
        bf16["shared"] = fill_random_mlp(layer.shared_experts, gen)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.copy_(torch.randn(experts, device="cuda", generator=gen) * 0.01)
    return layer, bf16


def fill_random_experts(layer, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fill ``layer``'s local experts with random block-FP8 weights (``N(0, 0.02²)`` quantized per 128×128 block);
    returns their dequantized bf16 copies ``{"w13": [E_local, 2I, H], "w2": [E_local, H, I]}`` for the baselines."""
    return {name: _fill_random_fp8(getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale_inv"), gen)
            for name in ("w13", "w2")}


def fill_random_mlp(mlp, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fill an ``Fp8MLP`` as ``fill_random_experts`` fills experts; returns the dequantized bf16 copies
    ``{"gate_up": [2I, H], "down": [H, I]}``."""
    return {name: _fill_random_fp8(linear.weight, linear.weight_scale_inv, gen)
            for name, linear in (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))}


def _fill_random_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill ``weight`` (FP8 ``[G, N, K]`` or ``[N, K]``) and its block scales with ``N(0, 0.02²)`` quantized per
    128×128 block; returns the dequantized bf16 copy, shaped as ``weight``."""
    from moe_fp8.reference import dequant_per_block
    from moe_fp8.testing import _per_block_quant_grouped

    w = torch.randn(weight.shape, device=weight.device, dtype=torch.bfloat16, generator=gen) * 0.02
    w_fp8, w_scale = _per_block_quant_grouped(w.view(-1, *w.shape[-2:]))
    del w
    weight.copy_(w_fp8.view(weight.shape))
    weight_scale.copy_(w_scale.view(weight_scale.shape))
    return torch.stack([dequant_per_block(w_fp8[e], w_scale[e]).to(torch.bfloat16)
                        for e in range(w_fp8.shape[0])]).view(weight.shape)


def local_ids(layer, topk_ids: torch.Tensor) -> torch.Tensor:
    """``topk_ids``' local expert ids on ``layer``'s rank (-1: another rank's expert)."""
    return topk_ids if layer.expert_map is None else layer.expert_map[topk_ids.long()]


def bf16_loop(layer, bf16: dict[str, torch.Tensor], hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The usual PyTorch MoE: route (``layer``'s routing), then for each local expert gather its tokens and run its
    MLP on the bf16 copies of ``fill_random_experts``."""
    weights, ids = layer.route(logits)
    ids = local_ids(layer, ids)
    out = torch.zeros_like(hidden)
    for e in range(bf16["w13"].shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        x = hidden[tok]
        gate, up = (x @ bf16["w13"][e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ bf16["w2"][e].t()
        out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
    if "shared" in bf16:
        gate, up = (hidden @ bf16["shared"]["gate_up"].t()).chunk(2, dim=-1)
        out += (torch.nn.functional.silu(gate) * up) @ bf16["shared"]["down"].t()
    return out


def _blockwise_grouped(a, a_scale, w, w_scale, m_indices):
    """Contiguous grouped GEMM as one torch block-scaled ``_scaled_mm`` per non-empty expert segment."""
    counts = torch.bincount(m_indices[m_indices >= 0].long(), minlength=w.shape[0]).tolist()  # host sync
    out = torch.empty(a.shape[0], w.shape[1], device=a.device, dtype=torch.bfloat16)
    row0 = 0
    for g, c in enumerate(counts):
        if c:
            rows = (c + 127) // 128 * 128  # segments are 128-aligned: the padding rows are there
            sa = a_scale[row0:row0 + rows].t().contiguous().t()
            out[row0:row0 + rows] = torch._scaled_mm(a[row0:row0 + rows], w[g].t(), scale_a=sa,
                                                     scale_b=w_scale[g].t(), out_dtype=torch.bfloat16)
            row0 += rows
    return out


def _blockwise_layer(layer, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Our layer's contiguous path with torch's block-scaled GEMMs in place of ours."""
    from moe_fp8.layers import combine, dispatch_contiguous, select_experts
    from moe_fp8.quant import per_token_group, silu_mul_per_token_group

    weights, ids = select_experts(logits, TOP_K, scoring_func="sigmoid", renormalize=True, n_group=N_GROUP,
                                  topk_group=TOPK_GROUP, e_score_correction_bias=layer.e_score_correction_bias,
                                  routed_scaling_factor=SCALING)
    x_fp8, x_scale = per_token_group(hidden)
    a, a_scale, m_indices, row_map = dispatch_contiguous(x_fp8, x_scale, ids, LOCAL_EXPERTS, layer.expert_map)
    h = _blockwise_grouped(a, a_scale, layer.w13_weight, layer.w13_weight_scale_inv, m_indices)
    y_fp8, y_scale = silu_mul_per_token_group(h)
    y = _blockwise_grouped(y_fp8, y_scale, layer.w2_weight, layer.w2_weight_scale_inv, m_indices)
    return combine(y, row_map, weights, None)


def _stage_split(layer, hidden: torch.Tensor, logits: torch.Tensor, path: str) -> tuple[dict[str, float], float]:
    """Median microseconds of each stage of one forward of our layer's ``path`` (events between the stages),
    and the median forward (first event to last). The L2 is flushed before each forward, as bench_us does."""
    from moe_fp8.layers import StageTimer

    flush = torch.empty(256 << 20, dtype=torch.int8, device=hidden.device) if hidden.is_cuda else None
    for _ in range(3):
        layer(hidden, logits, path=path)
    timer = StageTimer(hidden.device)
    layer.stage_hook = timer
    try:
        for _ in range(SPLIT_REPS):
            if flush is not None:
                flush.zero_()  # enqueued before the forward's first event: not timed
                torch.cuda._sleep(SPLIT_HEAD_START_CYCLES)  # the host's head start
            layer(hidden, logits, path=path)
    finally:
        layer.stage_hook = None
    forwards = timer.stages_us()
    stages = {name: statistics.median(f[name] for f in forwards) for name in forwards[0]}
    return stages, statistics.median(sum(f.values()) for f in forwards)


def _gemm_kernels_us(layer, hidden: torch.Tensor, logits: torch.Tensor, path: str) -> tuple[float, float]:
    """Each grouped GEMM of ``path`` alone, as the layer runs it (GEMM1 with SiLU·mul + quant fused where
    the layer fuses it), timed with bench_us on the layer's own intermediates: the kernels' time, to set
    beside their stages (a stage adds whatever launch gap the GPU waited on before it)."""
    from moe_fp8 import fp8_grouped_gemm_contiguous, fp8_grouped_gemm_masked, fp8_grouped_gemm_silu_mul_quant
    from moe_fp8.layers import dispatch_contiguous, dispatch_masked, select_experts
    from moe_fp8.layers.moe import _fused_gemm1, masked_expected_m
    from moe_fp8.quant import per_token_group, silu_mul_per_token_group

    _, ids = select_experts(logits, TOP_K, scoring_func="sigmoid", renormalize=True, n_group=N_GROUP,
                            topk_group=TOPK_GROUP, e_score_correction_bias=layer.e_score_correction_bias,
                            routed_scaling_factor=SCALING)
    x_fp8, x_scale = per_token_group(hidden)
    t = hidden.shape[0]
    w13, w13_scale = layer.w13_weight, layer.w13_weight_scale_inv
    expected_m = masked_expected_m(t, TOP_K, NUM_EXPERTS)  # the layer's hint on both paths
    if path == "contiguous":
        a, a_scale, groups, _ = dispatch_contiguous(x_fp8, x_scale, ids, LOCAL_EXPERTS, layer.expert_map)
        grouping = {"m_indices": groups, "expected_m": expected_m}

        def gemm(x, s, w, ws):
            return fp8_grouped_gemm_contiguous(x, s, w, ws, groups, expected_m=expected_m)
    else:
        a, a_scale, groups, _ = dispatch_masked(x_fp8, x_scale, ids, LOCAL_EXPERTS, t, layer.expert_map)
        grouping = {"masked_m": groups, "expected_m": expected_m}

        def gemm(x, s, w, ws):
            return fp8_grouped_gemm_masked(x, s, w, ws, groups, expected_m)
    if _fused_gemm1(w13):
        def gemm1():
            return fp8_grouped_gemm_silu_mul_quant(a, a_scale, w13, w13_scale, **grouping)
        y_fp8, y_scale = gemm1()
    else:
        def gemm1():
            return gemm(a, a_scale, w13, w13_scale)
        y_fp8, y_scale = silu_mul_per_token_group(gemm1(), masked_m=grouping.get("masked_m"))
    return (bench_us(gemm1), bench_us(lambda: gemm(y_fp8, y_scale, layer.w2_weight, layer.w2_weight_scale_inv)))


def capture_forward(layer, hidden: torch.Tensor, logits: torch.Tensor | None, path: str, *,
                    router_weight: torch.Tensor | None = None, router_fn: Any = None) -> torch.cuda.CUDAGraph:
    """One forward of ``layer`` captured in a CUDA graph (after two eager ones) on ``logits``, or, with
    ``router_weight`` (``[E, H]``) instead, on logits computed in the graph from ``hidden`` first by
    ``router_fn(hidden, router_weight)`` (default ``layers.router_gemm``): the router GEMM before routing, as in a
    model."""
    from moe_fp8.layers import router_gemm

    if (logits is None) == (router_weight is None):
        raise ValueError("capture_forward: give the router logits or the router_weight, not both nor neither")
    router_fn = router_fn or router_gemm

    def forward():
        return layer(hidden, logits if router_weight is None else router_fn(hidden, router_weight), path=path)
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph


def _graph_us(layer, hidden: torch.Tensor, logits: torch.Tensor) -> tuple[float, tuple[float, float]]:
    """One decode forward (the masked path, what an engine replays every step) replayed from a captured CUDA
    graph: the GPU's time alone, without the host's launches (``bench_us``), and its profiled spans after a
    dirty and a clean flush (``flushed_spans_us``)."""
    graph = capture_forward(layer, hidden, logits, "masked")
    return bench_us(graph.replay), flushed_spans_us(graph.replay)


def _graph_gemm_share(graph: torch.cuda.CUDAGraph, reps: int = 5) -> float:
    """The grouped GEMM kernels' share of the kernel span of one replay of ``graph`` (a captured forward), as
    the profiler sees them (L2 flushed before each replay; median over ``reps``): the GEMMs in place, with
    no host gap anywhere."""
    shares = []
    for _ in range(reps):
        kernels = flushed_events(graph.replay)
        gemm = sum(end - start for name, start, end in kernels if "fp8_gemm_kernel" in name)
        shares.append(gemm / span_us(kernels))
    return statistics.median(shares)


def _bench_tokens(layer, bf16: dict[str, torch.Tensor], t: int, is_decode: bool,
                  copy_gbps: float) -> tuple[list[dict[str, Any]], list[str]]:
    from moe_fp8 import calc_diff
    from moe_fp8.layers import select_experts

    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) + 4 * (2 * INTER * HIDDEN + HIDDEN * INTER) // 16384
    rows, notes = [], []
    gen = torch.Generator(device="cuda").manual_seed(t)
    hidden = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(t, NUM_EXPERTS, device="cuda", dtype=torch.float32, generator=gen)
    if t == 1:  # see the module doc: two local experts far ahead of the rest of their group
        logits[0, :2] += 6.0
        logits[0, 2:LOCAL_EXPERTS] -= 6.0
    # work of the local experts actually used: 3 GEMMs of H x I per routed token copy on this rank
    _, ids = select_experts(logits, TOP_K, scoring_func="sigmoid", renormalize=True, n_group=N_GROUP,
                            topk_group=TOPK_GROUP, e_score_correction_bias=layer.e_score_correction_bias,
                            routed_scaling_factor=SCALING)
    local = ids[ids < LOCAL_EXPERTS]
    copies, touched = int(local.numel()), int(torch.unique(local).numel())
    flops = 2 * copies * 3 * HIDDEN * INTER
    nbytes = touched * expert_bytes + 2 * t * HIDDEN * 2
    shape = {"tokens": t, "experts": NUM_EXPERTS, "local_experts": LOCAL_EXPERTS, "top_k": TOP_K,
             "hidden": HIDDEN, "intermediate": INTER}
    d = calc_diff(layer(hidden, logits).float(), bf16_loop(layer, bf16, hidden, logits).float())
    if d > 2e-3:
        notes.append(f"tokens {t}: moe_fp8 vs bf16 loop diff {d:.2e} > 2e-3")
    rows.append(row("moe_layer", shape, "moe_fp8", bench_us(lambda: layer(hidden, logits)), flops, nbytes))
    if is_decode:
        g_us, (dirty_us, clean_us) = _graph_us(layer, hidden, logits)
        rows.append(row("moe_layer", shape, "moe_fp8_graph", g_us, flops, nbytes))
        floor_us = touched * expert_bytes / copy_gbps / 1e3
        notes.append(f"decode {t} tokens (CUDA graph): {g_us:.1f} us; reading the {touched} touched local experts' "
                     f"FP8 weights at {copy_gbps:.0f} GB/s takes {floor_us:.1f} us"
                     + (f" -> {g_us / floor_us:.2f}x" if touched else " (no local expert touched)")
                     + f"; profiled replay {dirty_us:.1f} us after do_bench's flush, {clean_us:.1f} us with the L2 "
                     f"holding clean lines (as after a model's previous layer)")
    rows.append(row("moe_layer", shape, "torch_blockwise_loop",
                    bench_us(lambda: _blockwise_layer(layer, hidden, logits)), flops, nbytes))
    rows.append(row("moe_layer", shape, "torch_bf16", bench_us(lambda: bf16_loop(layer, bf16, hidden, logits)),
                    flops, nbytes))
    for path in ("contiguous", "masked"):
        if path == "masked" and t > 2048:
            continue  # the masked buffer is E_local x T rows: meant for small batches
        full = bench_us(lambda path=path: layer(hidden, logits, path=path))
        stages, forward = _stage_split(layer, hidden, logits, path)
        kernels = _gemm_kernels_us(layer, hidden, logits, path)
        rows.append(row("moe_layer_path", {**shape, "path": path}, "moe_fp8", full, flops, nbytes))
        for name, us in (*stages.items(), ("forward", forward)):
            rows.append(row("moe_layer_stage", {**shape, "path": path, "stage": name}, "moe_fp8", us, 0, 0))
        gemm = stages["gemm1"] + stages["gemm2"]
        if path == "contiguous":  # the same layer with the exact layout and its host sync, same process
            layer.contiguous_sync = True
            try:
                synced = bench_us(lambda: layer(hidden, logits, path="contiguous"))
            finally:
                layer.contiguous_sync = False
            graph = capture_forward(layer, hidden, logits, "contiguous")  # one capture (its pool) for both figures
            g_us, share = bench_us(graph.replay), _graph_gemm_share(graph)
            del graph
            rows.append(row("moe_layer_path", {**shape, "path": "contiguous_graph"}, "moe_fp8", g_us, flops, nbytes))
            notes.append(f"tokens {t} contiguous: layer {full:.1f} us without a host sync (upper-bound layout), "
                         f"{synced:.1f} us with one (contiguous_sync=True); replayed from a CUDA graph (GPU time "
                         f"alone) {g_us:.1f} us: the GEMM kernels alone take {100 * sum(kernels) / g_us:.0f}% of "
                         f"it, and {100 * share:.1f}% of its kernel span in place (profiled replay)")
        notes.append(f"tokens {t} {path}: layer {full:.1f} us; one forward by stage ({forward:.1f} us): "
                     + ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
                     + f"; GEMM stages {100 * gemm / forward:.0f}% of the forward (GEMM kernels alone "
                     f"{kernels[0]:.1f} + {kernels[1]:.1f} us = {100 * sum(kernels) / forward:.0f}%)")
    return rows, notes


def default_shapes() -> list[tuple[int, ...]]:
    return [(t,) for t in sorted(set(PREFILL_TOKENS) | set(DECODE_TOKENS))]


def parse_shape(text: str) -> tuple[int, ...]:
    return parse_ints(text, 1, "T")


def run(shapes: list[tuple[int, ...]], args: argparse.Namespace | None = None,
        step: Step | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every token count: the layer, its baselines, its step split; counts <= 256 also as decode."""
    layer, bf16 = build_layer()
    copy_gbps = measure_ceilings()["copy_gbps"]
    rows, notes = [], []
    for (t,) in shapes:
        r, n = _bench_tokens(layer, bf16, t, t <= max(DECODE_TOKENS), copy_gbps)
        rows += r
        notes += n
        if step is not None:
            step(f"{t} tokens")
    return rows, notes


KIND = BenchKind(
    name="moe",
    help="one DeepSeek-V3 MoE layer (EP rank of 8) vs torch blockwise and bf16 expert loops",
    tables={"moe_layer": ("torch_blockwise_loop", "torch_bf16")},
    default_shapes=default_shapes,
    parse_shape=parse_shape,
    shape_help="T (tokens)",
    run=run,
    op="fp8_grouped_gemm_contiguous",
)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_fp8.benchmarks.moe ARGS`` = ``moe-fp8 bench moe ARGS``."""
    from moe_fp8.cli import main as cli_main

    return cli_main(["bench", "moe", *(argv or [])])


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
