"""``moe-fp8 bench moe-data``: the MoE data path — quantization, SiLU·mul+quant, routing, dispatch
(contiguous / masked), combine, and one decode step of all of them — our Triton kernels against a
device copy of the same bytes (``torch_copy``, the bandwidth ceiling: ``x torch_copy`` is our fraction
of it) and against ``moe_fp8.reference`` on the GPU (``torch_reference``: what plain PyTorch gives).

Shapes are token counts T (``--shapes 4096 128``); each T runs every op at DeepSeek-V3 sizes (hidden
7168, 256 experts, top-8 in 8 groups of which 4 are kept, expert intermediate 2048):

- quant ``[T, 7168]``; SiLU·mul+quant ``[T, 4096]`` contiguous; the router GEMM ``[T, 7168] · [256, 7168]ᵀ`` (bf16,
  float32 logits; with the default shapes also at ``ROUTER_DECODE_TOKENS``), whose ``torch_reference`` is
  transformers' float32 router; routing ``T × 256`` (with the default shapes also at ``ROUTING_LARGE_TOKENS``);
  dispatch_contiguous and combine of ``T × 8`` token copies; quant_dispatch_contiguous, the same dispatch of bf16
  rows quantized inside it (the prefill's call under TP, every pair local, the quantized input returned);
- masked forms (SiLU·mul+quant and dispatch_masked): a decode batch (T ≤ 256) over all 256 experts
  with ``max_m = T``; a small prefill (T ≤ 4096) on one expert-parallel rank of 8 (32 local experts, all
  T × 8 copies local, ``max_m = T / 2``); none above (the layer uses the contiguous path there);
- the decode step (T ≤ 256), as ``Fp8FusedMoE`` runs it: route → quant_dispatch_masked (quantization
  inside the dispatch) → SiLU·mul+quant on ``[E, max_m, 2I]`` → combine, under a CUDA graph (``moe_fp8``)
  and eagerly (``moe_fp8_eager``).

Each op's ``moe_fp8`` row is an eager call (launches and host work included); the ops with no host sync
(``GRAPH_KINDS``) also get a ``moe_fp8_graph`` row, the same call replayed from a CUDA graph;
``dispatch_contiguous``'s (and ``quant_dispatch_contiguous``'s) is its sync-free form (``sync=False``: the
upper-bound layout, same copies).

``gbps`` counts the bytes the op must read and write once. Every row of ours is also checked against
the reference once (bit for bit; SiLU·mul+quant within its documented tolerance); a mismatch is a
note under the tables.
``python -m moe_fp8.benchmarks.moe_data ARGS`` = ``moe-fp8 bench moe-data ARGS``; ``--smoke`` (tiny
sizes, one untimed call per row, CPU allowed) checks the driver without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import BenchKind, Step, parse_ints
from .harness import REPO, bench_us, git_commit, ratio_table, row

NAME = "moe-data"
OPS = ("quant", "silu_mul_quant", "router", "routing", "dispatch", "combine", "decode")
DEFAULT_TOKENS = (16384, 4096, 1024, 128)
# Routing's logits at 16384 tokens are 16.8 MB, where even the copy reaches only about half its bandwidth: with
# the default shapes routing also runs at this count (67 MB), its large input.
ROUTING_LARGE_TOKENS = 65536
# The router GEMM's decode sizes, which the default token counts miss: with the default shapes it also runs at these
ROUTER_DECODE_TOKENS = (1, 8, 16)
DECODE_MAX_TOKENS = 256  # token counts up to this are decode batches (masked over all experts, decode step)
MASKED_MAX_TOKENS = 4096  # above this the layer never takes the masked path
EP = 8  # expert-parallel ranks of the small-prefill masked cases


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int
    experts: int
    inter: int
    top_k: int
    n_group: int
    topk_group: int
    scaling: float = 2.5


DSV3 = Sizes(hidden=7168, experts=256, inter=2048, top_k=8, n_group=8, topk_group=4)
SMOKE = Sizes(hidden=256, experts=16, inter=128, top_k=8, n_group=4, topk_group=2)
SMOKE_TOKENS = (8,)


class Bench:
    """Where and how to time: ``device``, ``time_us(fn)`` and the model ``sizes``."""

    def __init__(self, sizes: Sizes, smoke: bool) -> None:
        self.sizes = sizes
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.smoke = smoke

    def time_us(self, fn: Callable[[], Any]) -> float:
        if not self.smoke and self.device == "cuda":
            return bench_us(fn)
        start = time.perf_counter()  # --smoke or no GPU: one call, wall clock
        fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6


class Case:
    """One benchmark row: our callable, the reference's, the bytes moved, a correctness check."""

    def __init__(self, kind: str, shape: dict[str, int], nbytes: int, ours: Callable[[], Any],
                 reference: Callable[[], Any] | None, check: Callable[[Any, Any], str | None] | None = None,
                 graph: Callable[[], Any] | None = None):
        """``graph``: the call a CUDA graph replays, where ``ours`` cannot be captured (default ``ours``)."""
        self.kind, self.shape, self.nbytes = kind, shape, nbytes
        self.ours, self.reference, self.check = ours, reference, check
        self.graph = graph or ours


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _check_all(masks: dict[int, torch.Tensor] | None = None) -> Callable[[Any, Any], str | None]:
    """Compare tuples output by output; ``masks[i]`` restricts output i (valid rows only)."""
    def check(got: Any, want: Any) -> str | None:
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            m = (masks or {}).get(i)
            if g.shape != w.shape or not _same(g[m] if m is not None else g, w[m] if m is not None else w):
                return f"output {i} differs from the reference"
        return None
    return check


def _silu_close(masks: dict[int, torch.Tensor] | None = None) -> Callable[[Any, Any], str | None]:
    """The FP32 SiLU·mul+quant against the float64 reference (docs/kernels/datapath.md): NaN scales
    alike, finite scales to 2**-18 relative, at most 1e-4 of the FP8 codes different."""
    def check(got: Any, want: Any) -> str | None:
        (q, s), (rq, rs) = got, want
        m = (masks or {}).get(0)
        if m is not None:
            q, s, rq, rs = q[m], s[m], rq[m], rs[m]
        if not torch.equal(torch.isnan(s), torch.isnan(rs)):
            return "NaN scales differ from the reference"
        fin = torch.isfinite(rs)
        if fin.any() and not bool(((s[fin] - rs[fin]).abs() <= 2.0**-18 * rs[fin]).all()):
            return "scales differ from the reference beyond 2**-18 relative"
        bad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
        if bad > max(2, q.numel() // 10000):
            return f"{bad} of {q.numel()} FP8 codes differ from the reference"
        return None
    return check


def _scale_bytes(rows: int, cols: int) -> int:
    return rows * ((cols + 127) // 128) * 4


# ============================================================================================
# Cases of one token count
# ============================================================================================

def _masked_layouts(t: int, sz: Sizes) -> list[tuple[int, int]]:
    """``(experts, max_m)`` of the masked cases at ``t`` tokens (see the module docstring)."""
    if t <= DECODE_MAX_TOKENS:
        return [(sz.experts, t)]
    if t <= MASKED_MAX_TOKENS:
        return [(sz.experts // EP, t // 2)]
    return []


def quant_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import randn

    k = b.sizes.hidden
    x = randn((t, k), seed=t + k, device=b.device)
    return [Case("quant", {"m": t, "k": k}, t * k * 3 + _scale_bytes(t, k),
                 lambda: moe_fp8.quant.per_token_group(x), lambda: ref.per_token_group_quant(x), _check_all())]


def silu_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import draw_group_sizes, randn

    two_i, dev = 2 * b.sizes.inter, b.device
    h = randn((t, two_i), seed=t, device=dev, dtype=torch.float32).mul(2).bfloat16()
    cases = [Case("silu_mul_quant", {"m": t, "two_i": two_i, "groups": 1, "max_m": t},
                  t * two_i * 2 + t * two_i // 2 + _scale_bytes(t, two_i // 2),
                  lambda: moe_fp8.quant.silu_mul_per_token_group(h),
                  lambda: ref.silu_mul_per_token_group_quant(h), _silu_close())]
    for g, max_m in _masked_layouts(t, b.sizes):
        # t · top_k token copies spread over the g experts, each capped at max_m
        sizes = [min(s, max_m) for s in draw_group_sizes(g, max(1, t * b.sizes.top_k // g), seed=g)]
        masked_m = torch.tensor(sizes, dtype=torch.int32, device=dev)
        hm = randn((g, max_m, two_i), seed=g, device=dev)
        rows = sum(sizes)
        valid = torch.arange(max_m, device=dev)[None, :] < masked_m[:, None]
        cases.append(Case("silu_mul_quant", {"m": rows, "two_i": two_i, "groups": g, "max_m": max_m},
                          rows * two_i * 2 + rows * two_i // 2 + _scale_bytes(rows, two_i // 2),
                          lambda hm=hm, mm=masked_m: moe_fp8.quant.silu_mul_per_token_group(hm, masked_m=mm),
                          lambda hm=hm, mm=masked_m: ref.silu_mul_per_token_group_quant(hm, masked_m=mm),
                          _silu_close({0: valid})))
    return cases


def _routing_kwargs(sz: Sizes) -> dict[str, Any]:
    return dict(scoring_func="sigmoid", n_group=sz.n_group, topk_group=sz.topk_group,
                routed_scaling_factor=sz.scaling)


def routing_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_routing_inputs

    sz = b.sizes
    kw = _routing_kwargs(sz)
    logits, bias = make_routing_inputs(t, sz.experts, seed=t, device=b.device, with_bias=True)

    def ids_only(got: Any, want: Any) -> str | None:  # renormalized weights: sum order (see tests)
        return None if torch.equal(got[1], want[1]) else "topk_ids differ from the reference"
    return [Case("routing", {"t": t, "e": sz.experts, "top_k": sz.top_k}, t * sz.experts * 4 + t * sz.top_k * 8,
                 lambda: moe_fp8.layers.select_experts(logits, sz.top_k, e_score_correction_bias=bias, **kw),
                 lambda: ref.select_experts(logits, sz.top_k, e_score_correction_bias=bias, **kw), ids_only)]


def router_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import randn

    sz = b.sizes
    x = randn((t, sz.hidden), seed=t, device=b.device)
    w = 0.02 * randn((sz.experts, sz.hidden), seed=t + 1, device=b.device)

    def within_float32(got: Any, want: Any) -> str | None:  # (the sum order is the backend's: tests' bound)
        bound = 64 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
        return None if bool(((got.double() - want.double()).abs() <= 2 * bound).all()) else "logits off the bound"
    return [Case("router", {"t": t, "h": sz.hidden, "e": sz.experts},
                 sz.experts * sz.hidden * 2 + t * sz.hidden * 2 + t * sz.experts * 4,
                 lambda: moe_fp8.layers.router_gemm(x, w), lambda: ref.router_gemm(x, w), within_float32)]


def _dispatch_bytes(t: int, kept: int, sz: Sizes) -> int:
    """Read each token row (FP8 + scales) once, write each kept copy, ids in, row map out."""
    h = sz.hidden
    return t * h + _scale_bytes(t, h) + kept * h + _scale_bytes(kept, h) + t * sz.top_k * 12


def dispatch_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_dispatch_inputs

    sz, dev = b.sizes, b.device
    d = make_dispatch_inputs(t, sz.hidden, sz.experts, sz.top_k, seed=t, device=dev)
    want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, sz.experts)
    rows = want[2] >= 0
    cases = [Case("dispatch_contiguous", {"t": t, "hidden": sz.hidden, "e": sz.experts, "top_k": sz.top_k},
                  _dispatch_bytes(t, t * sz.top_k, sz) + want[2].numel() * 4,
                  lambda: moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, sz.experts),
                  lambda: ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, sz.experts),
                  _check_all({0: rows, 1: rows}),
                  graph=lambda: moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, sz.experts,
                                                                   sync=False))]
    # the prefill's call under TP (every pair local): bf16 rows quantized inside the dispatch, x_fp8 returned for the
    # shared experts; bytes as the FP8 dispatch's, plus the bf16 rows read and x_fp8 written
    cases.append(Case("quant_dispatch_contiguous", {"t": t, "hidden": sz.hidden, "e": sz.experts, "top_k": sz.top_k},
                      _dispatch_bytes(t, t * sz.top_k, sz) + want[2].numel() * 4 + t * sz.hidden * 2,
                      lambda: moe_fp8.layers.quant_dispatch_contiguous(d.x, d.topk_ids, sz.experts)[2:],
                      lambda: ref.dispatch_contiguous(*ref.per_token_group_quant(d.x), d.topk_ids, sz.experts),
                      _check_all({0: rows, 1: rows}),
                      graph=lambda: moe_fp8.layers.quant_dispatch_contiguous(d.x, d.topk_ids, sz.experts, sync=False)))
    for e, max_m in _masked_layouts(t, sz):
        dm = make_dispatch_inputs(t, sz.hidden, e, sz.top_k, seed=t, device=dev)
        want = ref.dispatch_masked(dm.x_fp8, dm.x_scale, dm.topk_ids, e, max_m)
        valid = torch.arange(max_m, device=dev)[None, :] < want[2][:, None]
        cases.append(Case("dispatch_masked",
                          {"t": t, "hidden": sz.hidden, "e": e, "top_k": sz.top_k, "max_m": max_m},
                          _dispatch_bytes(t, int(want[2].sum()), sz),
                          lambda dm=dm, e=e, mm=max_m: moe_fp8.layers.dispatch_masked(dm.x_fp8, dm.x_scale,
                                                                                      dm.topk_ids, e, mm),
                          lambda dm=dm, e=e, mm=max_m: ref.dispatch_masked(dm.x_fp8, dm.x_scale, dm.topk_ids, e, mm),
                          _check_all({0: valid, 1: valid})))
    return cases


def combine_cases(t: int, b: Bench) -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_dispatch_inputs, randn

    sz, dev = b.sizes, b.device
    d = make_dispatch_inputs(t, 128, sz.experts, sz.top_k, seed=t, device=dev)
    row_map = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, sz.experts)[3]
    y = randn((int(row_map.max()) + 1, sz.hidden), seed=t, device=dev)
    shared = randn((t, sz.hidden), seed=t + 1, device=dev)
    return [Case("combine", {"t": t, "hidden": sz.hidden, "top_k": sz.top_k},
                 t * sz.top_k * sz.hidden * 2 + 2 * t * sz.hidden * 2 + t * sz.top_k * 12,
                 lambda: moe_fp8.layers.combine(y, row_map, d.topk_weights, shared),
                 lambda: ref.combine(y, row_map, d.topk_weights, shared), _check_all())]


CASES: dict[str, Callable[[int, Bench], list[Case]]] = {
    "quant": quant_cases, "silu_mul_quant": silu_cases, "router": router_cases, "routing": routing_cases,
    "dispatch": dispatch_cases,
    "combine": combine_cases,
}


# ============================================================================================
# Decode step (as Fp8FusedMoE runs it): route + quant_dispatch_masked + SiLU·mul+quant on [E, max_m, 2I] + combine
# ============================================================================================

def decode_step_rows(t: int, b: Bench, notes: list[str]) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_routing_inputs, randn

    sz, dev = b.sizes, b.device
    e, max_m, inter, hidden, top_k = sz.experts, t, sz.inter, sz.hidden, sz.top_k
    x = randn((t, hidden), seed=0, device=dev)
    logits, bias = make_routing_inputs(t, e, seed=1, device=dev, with_bias=True)
    h = randn((e, max_m, 2 * inter), seed=2, device=dev)  # stands in for GEMM 1's output
    y = randn((e, max_m, hidden), seed=3, device=dev)  # stands in for GEMM 2's output
    shared = randn((t, hidden), seed=4, device=dev)
    kw = dict(_routing_kwargs(sz), e_score_correction_bias=bias)

    def ours():  # the quantization inside the dispatch op, as the layer runs it
        w, ids = moe_fp8.layers.select_experts(logits, top_k, **kw)
        _, _, _, _, masked_m, row_map = moe_fp8.layers.quant_dispatch_masked(x, ids, e, max_m)
        moe_fp8.quant.silu_mul_per_token_group(h, masked_m=masked_m)
        return w, ids, masked_m, row_map, moe_fp8.layers.combine(y, row_map, w, shared)

    def reference():
        x_fp8, x_scale = ref.per_token_group_quant(x)
        w, ids = ref.select_experts(logits, top_k, **kw)
        _, _, masked_m, row_map = ref.dispatch_masked(x_fp8, x_scale, ids, e, max_m)
        ref.silu_mul_per_token_group_quant(h, masked_m=masked_m)
        return w, ids, masked_m, row_map, ref.combine(y, row_map, w, shared)

    w, ids, masked_m, row_map, out = ours()
    _, r_ids, r_masked_m, r_row_map, _ = reference()
    # (combine is compared on our weights: renormalized weights may differ from torch's by an ulp)
    same = (_same(ids, r_ids) and _same(masked_m, r_masked_m) and _same(row_map, r_row_map)
            and _same(out, ref.combine(y, r_row_map, w, shared)))
    if not same:
        notes.append(f"decode step {t} tokens: an output differs from the reference")
    replay = _graph_replay(ours) if dev == "cuda" else ours  # without a GPU (--smoke on CPU): no graph
    rows_used = int(r_masked_m.sum())
    nbytes = (t * hidden * 3 + t * e * 4 + _dispatch_bytes(t, rows_used, sz)
              + rows_used * (2 * inter * 2 + inter) + rows_used * hidden * 2 + 2 * t * hidden * 2)
    shape = {"t": t, "e": e, "top_k": top_k, "hidden": hidden, "inter": inter, "max_m": max_m}
    result = [row("decode_step", shape, "moe_fp8", b.time_us(replay), 0, nbytes),
              row("decode_step", shape, "moe_fp8_eager", b.time_us(ours), 0, nbytes),
              row("decode_step", shape, "torch_reference", b.time_us(reference), 0, nbytes)]
    how = "CUDA graph" if dev == "cuda" else "no GPU: no graph"
    notes.append(f"decode step {t} tokens ({how}): {result[0]['us']} us (target <= 40 us at 128 tokens), "
                 f"eager {result[1]['us']} us, reference {result[2]['us']} us")
    return result


# ============================================================================================
# Driver
# ============================================================================================

# Ops without a host sync: their rows also run under a CUDA graph (``moe_fp8_graph``), the kernels'
# own time without the eager launches' host overhead (~15 us per launch on the H100 machines we get).
GRAPH_KINDS = ("quant", "silu_mul_quant", "router", "routing", "dispatch_contiguous", "quant_dispatch_contiguous",
               "dispatch_masked", "combine")


def _graph_replay(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured once in a CUDA graph (compiled and warmed on a side stream first); its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile everything outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_case(case: Case, b: Bench, notes: list[str]) -> list[dict[str, Any]]:
    label = f"{case.kind} {case.shape}"
    try:
        got = case.ours()
        if case.check is not None and case.reference is not None:
            problem = case.check(got, case.reference())
            if problem:
                notes.append(f"{label}: {problem}")
        ours_us = b.time_us(case.ours)
    except Exception as exc:  # record, do not hide
        notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return []
    # A copy with the same total traffic: nbytes/2 read + nbytes/2 written.
    src = torch.empty(max(case.nbytes // 2, 1), dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    rows = [row(case.kind, case.shape, "moe_fp8", ours_us, 0, case.nbytes),
            row(case.kind, case.shape, "torch_copy", b.time_us(lambda: dst.copy_(src)), 0, case.nbytes)]
    if case.kind in GRAPH_KINDS and b.device == "cuda" and not b.smoke:
        try:
            rows.append(row(case.kind, case.shape, "moe_fp8_graph", b.time_us(_graph_replay(case.graph)), 0,
                            case.nbytes))
        except Exception as exc:  # record, do not hide
            notes.append(f"{label} under a CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    if case.reference is not None:
        try:
            rows.append(row(case.kind, case.shape, "torch_reference", b.time_us(case.reference), 0, case.nbytes))
        except Exception as exc:
            notes.append(f"{label} reference: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return rows


def backends_used(device: str) -> dict[str, str]:
    import moe_fp8

    ops = ("per_token_group_quant", "silu_mul_per_token_group_quant", "router_gemm", "select_experts",
           "dispatch_contiguous",
           "dispatch_masked", "combine")
    return {op: moe_fp8.backend(op, device) for op in ops}


def run(shapes: list[tuple[int, ...]], args: argparse.Namespace | None = None,
        step: Step | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every op of ``--ops`` (default all) at every token count; rows and notes (mismatches, decode step)."""
    smoke = bool(getattr(args, "smoke", False))
    ops = list(getattr(args, "ops", None) or OPS)
    if getattr(args, "quant_tile", None):
        from moe_fp8.kernels.triton import configs

        configs.QUANT_TILE_ELEMS = configs.QUANT_SILU_TILE_ELEMS = args.quant_tile
        configs.quant_config.cache_clear()
    if smoke and getattr(args, "shapes", None) is None:
        shapes = [(t,) for t in SMOKE_TOKENS]
    b = Bench(SMOKE if smoke else DSV3, smoke)
    used = backends_used(b.device)
    distinct = set(used.values())
    notes = [f"backends: {distinct.pop()} for every op" if len(distinct) == 1 else f"backends: {used}"]
    rows: list[dict[str, Any]] = []
    if not smoke and getattr(args, "shapes", None) is None and "routing" in ops:
        for case in routing_cases(ROUTING_LARGE_TOKENS, b):
            rows += run_case(case, b, notes)
    if not smoke and getattr(args, "shapes", None) is None and "router" in ops:
        for t in ROUTER_DECODE_TOKENS:
            for case in router_cases(t, b):
                rows += run_case(case, b, notes)
    for (t,) in shapes:
        for op in ops:
            if op == "decode":
                if t <= DECODE_MAX_TOKENS:
                    rows += decode_step_rows(t, b, notes)
                continue
            for case in CASES[op](t, b):
                rows += run_case(case, b, notes)
            if b.device == "cuda":
                torch.cuda.empty_cache()
        if step is not None:
            step(f"{t} tokens")
    return rows, notes


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny model sizes (default {SMOKE_TOKENS[0]} tokens), one untimed call per row: checks the "
                        "driver, not speed")
    p.add_argument("--ops", nargs="+", choices=OPS, default=None, metavar="OP",
                   help=f"subset of ops to time: {', '.join(OPS)} (default: all)")
    p.add_argument("--quant-tile", type=int, default=None, metavar="ELEMS",
                   help="override configs.QUANT_TILE_ELEMS (elements per quantization tile) to tune it")


TABLES = {kind: ("torch_copy", "torch_reference") for kind in GRAPH_KINDS}
for _kind in GRAPH_KINDS:
    TABLES[_kind] = ("moe_fp8_graph", *TABLES[_kind])
TABLES["decode_step"] = ("moe_fp8_eager", "torch_reference")

KIND = BenchKind(
    name=NAME,
    help="MoE data path (quant, SiLU·mul+quant, router GEMM, routing, dispatch, combine, decode step) vs copy and "
         "PyTorch",
    tables=TABLES,
    default_shapes=lambda: [(t,) for t in DEFAULT_TOKENS],
    parse_shape=lambda text: parse_ints(text, 1, "T"),
    shape_help="T (tokens)",
    run=run,
    metric="gbps",
    op="per_token_group_quant",
    add_args=_add_args,
)


def smoke(out_dir: Path, shapes: list[tuple[int, ...]] | None = None, ops: list[str] | None = None) -> Path:
    """``--smoke``: run the driver at tiny sizes on whatever device there is (CPU: the reference ops), one
    untimed call per row; print the tables and write ``<device>-moe-data.json`` to ``out_dir``."""
    args = argparse.Namespace(smoke=True, ops=ops, quant_tile=None, shapes=shapes)
    rows, notes = run(shapes or [(t,) for t in SMOKE_TOKENS], args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for kind, baselines in TABLES.items():
        kind_rows = [r for r in rows if r["kind"] == kind]
        if kind_rows:
            print(f"\n## {kind}\n\n{ratio_table(kind_rows, 'moe_fp8', baselines, metric='gbps')}")
    print("\n" + "\n".join(notes))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{'cpu' if device == 'cpu' else 'smoke'}-{NAME}.json"
    path.write_text(json.dumps({"device": device, "commit": git_commit(), "date": datetime.date.today().isoformat(),
                                "ceilings": {}, "rows": rows, "backends": backends_used(Bench(SMOKE, True).device),
                                "smoke": True}, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_fp8.benchmarks.moe_data ARGS`` = ``moe-fp8 bench moe-data ARGS``; with ``--smoke``
    (and optionally ``--out-dir DIR``, ``--ops``), the driver check of ``smoke()``."""
    argv = list(argv or [])
    if "--smoke" in argv:
        p = argparse.ArgumentParser(prog="python -m moe_fp8.benchmarks.moe_data --smoke")
        p.add_argument("--smoke", action="store_true")
        p.add_argument("--out-dir", type=Path, default=REPO / "out")
        p.add_argument("--ops", nargs="+", choices=OPS, default=None)
        a = p.parse_args(argv)
        smoke(a.out_dir, ops=a.ops)
        return 0
    from moe_fp8.cli import main as cli_main

    return cli_main(["bench", NAME, *argv])


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
