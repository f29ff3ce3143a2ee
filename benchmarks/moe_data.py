"""MoE data path bench: quantization, SiLU·mul+quant, routing, dispatch (contiguous / masked), combine,
and one DeepSeek-V3 decode step of all of them — our Triton kernels against a device copy of the same
bytes (``torch_copy``, the bandwidth ceiling) and against ``moe_fp8.reference`` on the GPU
(``torch_reference``: what plain PyTorch gives).

``python -m moe_fp8.benchmarks.moe_data --out-dir DIR`` writes ``DIR/<device>-moe-data.json`` (DESIGN §7
rows; ``gbps`` counts the bytes the op must read and write once) and ``DIR/<device>-moe-data.md``.
Every row of ours is also checked against the reference once (bit for bit; SiLU·mul+quant within its
documented tolerance); a mismatch is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .harness import REPO, bench_us, device_slug, git_commit, measure_ceilings, ratio_table, row, write_record

KIND = "moe-data"
BASELINES = ("torch_copy", "torch_reference")

# DeepSeek-V3: hidden 7168, 256 routed experts, top-8 in 8 groups (4 kept), expert intermediate 2048.
HIDDEN, EXPERTS, TOP_K, INTER, N_GROUP, TOPK_GROUP, SCALING = 7168, 256, 8, 2048, 8, 4, 2.5
QUANT_SHAPES = [(16384, 7168), (4096, 7168), (128, 7168), (16384, 2048)]
SILU_SHAPES = [(16384, 2 * INTER), (4096, 2 * INTER), (1024, 2 * INTER)]
SILU_MASKED = [(EXPERTS, 128, 2 * INTER, 128 * TOP_K), (32, 1024, 2 * INTER, 8192)]  # G, max_m, 2I, pairs
ROUTING_TOKENS = [16384, 4096, 128]
DISPATCH_TOKENS = [16384, 4096]
DISPATCH_MASKED = [(128, EXPERTS, 128), (4096, 32, 2048)]  # tokens, local experts, max_m (EP 8 for 32)
COMBINE_TOKENS = [16384, 4096, 128]
DECODE = {"t": 128, "e": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inter": INTER, "max_m": 128}

# --smoke: tiny shapes, any device, one untimed-quality call per row (checks the driver, not speed).
DEV = "cuda"
_bench: Callable[[Callable[[], Any]], float] = bench_us


def _smoke_setup() -> None:
    global DEV, _bench, HIDDEN, EXPERTS, INTER, N_GROUP, TOPK_GROUP, DECODE
    global QUANT_SHAPES, SILU_SHAPES, SILU_MASKED, ROUTING_TOKENS, DISPATCH_TOKENS, DISPATCH_MASKED, COMBINE_TOKENS
    DEV = "cuda" if torch.cuda.is_available() else "cpu"

    def once(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e6
    _bench = once
    HIDDEN, EXPERTS, INTER, N_GROUP, TOPK_GROUP = 256, 16, 128, 4, 2
    QUANT_SHAPES, SILU_SHAPES = [(8, 256)], [(8, 2 * INTER)]
    SILU_MASKED = [(EXPERTS, 4, 2 * INTER, 32)]
    ROUTING_TOKENS, DISPATCH_TOKENS, DISPATCH_MASKED, COMBINE_TOKENS = [8], [8], [(8, EXPERTS, 4)], [8]
    DECODE = {"t": 8, "e": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "inter": INTER, "max_m": 4}


class Case:
    """One benchmark row: our callable, the reference's, the bytes moved, a correctness check."""

    def __init__(self, kind: str, shape: dict[str, int], nbytes: int, ours: Callable[[], Any],
                 reference: Callable[[], Any] | None, check: Callable[[Any, Any], str | None] | None = None):
        self.kind, self.shape, self.nbytes = kind, shape, nbytes
        self.ours, self.reference, self.check = ours, reference, check


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
# Cases
# ============================================================================================

def quant_cases() -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import randn

    cases = []
    for m, k in QUANT_SHAPES:
        x = randn((m, k), seed=m + k, device=DEV)
        cases.append(Case("quant", {"m": m, "k": k}, m * k * 3 + _scale_bytes(m, k),
                          lambda x=x: moe_fp8.quant.per_token_group(x), lambda x=x: ref.per_token_group_quant(x),
                          _check_all()))
    return cases


def silu_cases() -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import draw_group_sizes, randn

    cases = []
    for m, two_i in SILU_SHAPES:
        h = randn((m, two_i), seed=m, device=DEV, dtype=torch.float32).mul(2).bfloat16()
        cases.append(Case("silu_mul_quant", {"m": m, "two_i": two_i, "groups": 1, "max_m": m},
                          m * two_i * 2 + m * two_i // 2 + _scale_bytes(m, two_i // 2),
                          lambda h=h: moe_fp8.quant.silu_mul_per_token_group(h),
                          lambda h=h: ref.silu_mul_per_token_group_quant(h), _silu_close()))
    for g, max_m, two_i, pairs in SILU_MASKED:
        sizes = [min(s, max_m) for s in draw_group_sizes(g, pairs // g, seed=g)]
        masked_m = torch.tensor(sizes, dtype=torch.int32, device=DEV)
        h = randn((g, max_m, two_i), seed=g, device=DEV)
        rows = sum(sizes)
        valid = torch.arange(max_m, device=DEV)[None, :] < masked_m[:, None]
        cases.append(Case("silu_mul_quant", {"m": rows, "two_i": two_i, "groups": g, "max_m": max_m},
                          rows * two_i * 2 + rows * two_i // 2 + _scale_bytes(rows, two_i // 2),
                          lambda h=h, mm=masked_m: moe_fp8.quant.silu_mul_per_token_group(h, masked_m=mm),
                          lambda h=h, mm=masked_m: ref.silu_mul_per_token_group_quant(h, masked_m=mm),
                          _silu_close({0: valid})))
    return cases


def routing_cases() -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_routing_inputs

    kw = dict(scoring_func="sigmoid", n_group=N_GROUP, topk_group=TOPK_GROUP, routed_scaling_factor=SCALING)
    cases = []
    for t in ROUTING_TOKENS:
        logits, bias = make_routing_inputs(t, EXPERTS, seed=t, device=DEV, with_bias=True)

        def ids_only(got: Any, want: Any) -> str | None:  # renormalized weights: sum order (see tests)
            return None if torch.equal(got[1], want[1]) else "topk_ids differ from the reference"
        cases.append(Case("routing", {"t": t, "e": EXPERTS, "top_k": TOP_K}, t * EXPERTS * 4 + t * TOP_K * 8,
                          lambda lg=logits, b=bias: moe_fp8.layers.select_experts(lg, TOP_K, e_score_correction_bias=b,
                                                                                   **kw),
                          lambda lg=logits, b=bias: ref.select_experts(lg, TOP_K, e_score_correction_bias=b, **kw),
                          ids_only))
    return cases


def _dispatch_bytes(t: int, kept: int) -> int:
    """Read each token row (FP8 + scales) once, write each kept copy, ids in, row map out."""
    return t * HIDDEN + _scale_bytes(t, HIDDEN) + kept * HIDDEN + _scale_bytes(kept, HIDDEN) + t * TOP_K * 12


def dispatch_cases() -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_dispatch_inputs

    cases = []
    for t in DISPATCH_TOKENS:
        d = make_dispatch_inputs(t, HIDDEN, EXPERTS, TOP_K, seed=t, device=DEV)
        want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS)
        rows = want[2] >= 0
        cases.append(Case("dispatch_contiguous", {"t": t, "hidden": HIDDEN, "e": EXPERTS, "top_k": TOP_K},
                          _dispatch_bytes(t, t * TOP_K) + want[2].numel() * 4,
                          lambda d=d: moe_fp8.layers.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS),
                          lambda d=d: ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS),
                          _check_all({0: rows, 1: rows})))
    for t, e, max_m in DISPATCH_MASKED:
        d = make_dispatch_inputs(t, HIDDEN, e, TOP_K, seed=t, device=DEV)
        want = ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m)
        valid = torch.arange(max_m, device=DEV)[None, :] < want[2][:, None]
        kept = int(want[2].sum())
        cases.append(Case("dispatch_masked", {"t": t, "hidden": HIDDEN, "e": e, "top_k": TOP_K, "max_m": max_m},
                          _dispatch_bytes(t, kept),
                          lambda d=d, e=e, mm=max_m: moe_fp8.layers.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids,
                                                                                    e, mm),
                          lambda d=d, e=e, mm=max_m: ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, mm),
                          _check_all({0: valid, 1: valid})))
    return cases


def combine_cases() -> list[Case]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_dispatch_inputs, randn

    cases = []
    for t in COMBINE_TOKENS:
        d = make_dispatch_inputs(t, 128, EXPERTS, TOP_K, seed=t, device=DEV)
        row_map = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS)[3]
        y = randn((int(row_map.max()) + 1, HIDDEN), seed=t, device=DEV)
        shared = randn((t, HIDDEN), seed=t + 1, device=DEV)
        cases.append(Case("combine", {"t": t, "hidden": HIDDEN, "top_k": TOP_K},
                          t * TOP_K * HIDDEN * 2 + 2 * t * HIDDEN * 2 + t * TOP_K * 12,
                          lambda y=y, rm=row_map, w=d.topk_weights, s=shared: moe_fp8.layers.combine(y, rm, w, s),
                          lambda y=y, rm=row_map, w=d.topk_weights, s=shared: ref.combine(y, rm, w, s),
                          _check_all()))
    return cases


# ============================================================================================
# Decode step: quant + route + dispatch_masked + SiLU·mul+quant on [E, max_m, 2I] + combine
# ============================================================================================

def decode_step_rows(notes: list[str]) -> list[dict[str, Any]]:
    import moe_fp8
    from moe_fp8 import reference as ref
    from moe_fp8.testing import make_routing_inputs, randn

    t, e, max_m, inter = DECODE["t"], DECODE["e"], DECODE["max_m"], DECODE["inter"]
    x = randn((t, HIDDEN), seed=0, device=DEV)
    logits, bias = make_routing_inputs(t, e, seed=1, device=DEV, with_bias=True)
    h = randn((e, max_m, 2 * inter), seed=2, device=DEV)  # stands in for GEMM 1's output
    y = randn((e, max_m, HIDDEN), seed=3, device=DEV)  # stands in for GEMM 2's output
    shared = randn((t, HIDDEN), seed=4, device=DEV)
    kw = dict(scoring_func="sigmoid", n_group=N_GROUP, topk_group=TOPK_GROUP, e_score_correction_bias=bias,
              routed_scaling_factor=SCALING)

    def ours():
        x_fp8, x_scale = moe_fp8.quant.per_token_group(x)
        w, ids = moe_fp8.layers.select_experts(logits, TOP_K, **kw)
        _, _, masked_m, row_map = moe_fp8.layers.dispatch_masked(x_fp8, x_scale, ids, e, max_m)
        moe_fp8.quant.silu_mul_per_token_group(h, masked_m=masked_m)
        return w, ids, masked_m, row_map, moe_fp8.layers.combine(y, row_map, w, shared)

    def reference():
        x_fp8, x_scale = ref.per_token_group_quant(x)
        w, ids = ref.select_experts(logits, TOP_K, **kw)
        _, _, masked_m, row_map = ref.dispatch_masked(x_fp8, x_scale, ids, e, max_m)
        ref.silu_mul_per_token_group_quant(h, masked_m=masked_m)
        return w, ids, masked_m, row_map, ref.combine(y, row_map, w, shared)

    w, ids, masked_m, row_map, out = ours()
    _, r_ids, r_masked_m, r_row_map, _ = reference()
    # (combine is compared on our weights: renormalized weights may differ from torch's by an ulp)
    same = (_same(ids, r_ids) and _same(masked_m, r_masked_m) and _same(row_map, r_row_map)
            and _same(out, ref.combine(y, r_row_map, w, shared)))
    if not same:
        notes.append("decode step: an output differs from the reference")
    replay = ours  # without a GPU (--smoke on CPU) there is no graph to capture
    if DEV == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile everything outside the capture
            ours()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours()
        replay = graph.replay
    rows_used = int(r_masked_m.sum())
    nbytes = (t * HIDDEN * 3 + t * e * 4 + _dispatch_bytes(t, rows_used)
              + rows_used * (2 * inter * 2 + inter) + rows_used * HIDDEN * 2 + 2 * t * HIDDEN * 2)
    shape = dict(DECODE)
    result = [row("decode_step", shape, "moe_fp8", _bench(replay), 0, nbytes),
              row("decode_step", shape, "moe_fp8_eager", _bench(ours), 0, nbytes),
              row("decode_step", shape, "torch_reference", _bench(reference), 0, nbytes)]
    notes.append(f"decode step (CUDA graph): {result[0]['us']} us (target <= 40 us), eager {result[1]['us']} us, "
                 f"reference {result[2]['us']} us")
    return result


# ============================================================================================
# Driver
# ============================================================================================

def run_case(case: Case, notes: list[str]) -> list[dict[str, Any]]:
    label = f"{case.kind} {case.shape}"
    try:
        got = case.ours()
        if case.check is not None and case.reference is not None:
            problem = case.check(got, case.reference())
            if problem:
                notes.append(f"{label}: {problem}")
        ours_us = _bench(case.ours)
    except Exception as exc:  # record, do not hide
        notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return []
    # A copy with the same total traffic: nbytes/2 read + nbytes/2 written.
    src = torch.empty(max(case.nbytes // 2, 1), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    rows = [row(case.kind, case.shape, "moe_fp8", ours_us, 0, case.nbytes),
            row(case.kind, case.shape, "torch_copy", _bench(lambda: dst.copy_(src)), 0, case.nbytes)]
    if case.reference is not None:
        try:
            rows.append(row(case.kind, case.shape, "torch_reference", _bench(case.reference), 0, case.nbytes))
        except Exception as exc:
            notes.append(f"{label} reference: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return rows


def backends_used() -> dict[str, str]:
    import moe_fp8

    ops = ("per_token_group_quant", "silu_mul_per_token_group_quant", "select_experts", "dispatch_contiguous",
           "dispatch_masked", "combine")
    return {op: moe_fp8.backend(op) for op in ops}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_fp8.benchmarks.moe_data")
    p.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks")
    p.add_argument("--kinds", nargs="*", default=["quant", "silu_mul_quant", "routing", "dispatch", "combine", "decode"],
                   help="subset to run")
    p.add_argument("--quant-tile", type=int, default=None,
                   help="override configs.QUANT_TILE_ELEMS (elements per quantization tile) to tune")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one call per row, CPU allowed (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        _smoke_setup()
    if args.quant_tile:
        from moe_fp8.kernels.triton import configs

        configs.QUANT_TILE_ELEMS = configs.QUANT_SILU_TILE_ELEMS = args.quant_tile
        configs.quant_config.cache_clear()
    used = backends_used()
    ceilings = measure_ceilings() if not args.smoke else {"copy_gbps": 1.0}
    makers = {"quant": quant_cases, "silu_mul_quant": silu_cases, "routing": routing_cases,
              "dispatch": dispatch_cases, "combine": combine_cases}
    rows: list[dict[str, Any]] = []
    notes: list[str] = [f"backends: {used}"]
    for kind in args.kinds:
        if kind == "decode":
            rows += decode_step_rows(notes)
            print(notes[-1], flush=True)
            continue
        for case in makers[kind]():
            rows += run_case(case, notes)
            print(f"{case.kind} {case.shape} done", flush=True)
            torch.cuda.empty_cache()
    extra = {"backends": used, "quant_tile_elems": args.quant_tile}
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    if DEV == "cuda":
        path = write_record(KIND, rows, ceilings, args.out_dir, extra=extra)
    else:  # --smoke without a GPU: same record, device "cpu"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"{DEV}-{KIND}.json"
        path.write_text(json.dumps({"device": DEV, "commit": git_commit(), "date": datetime.date.today().isoformat(),
                                    "ceilings": ceilings, "rows": rows, **extra}, indent=1) + "\n")
    copy = ceilings["copy_gbps"]
    tables = []
    for kind in ("quant", "silu_mul_quant", "routing", "dispatch_contiguous", "dispatch_masked", "combine",
                 "decode_step"):
        kind_rows = [r for r in rows if r["kind"] == kind]
        if kind_rows:
            base = ["moe_fp8_eager", "torch_reference"] if kind == "decode_step" else list(BASELINES)
            table = ratio_table(kind_rows, "moe_fp8", base, metric="gbps",
                                extra_cols={"of copy BW": lambda r: f"{r['gbps'] / copy:.0%}"})
            tables.append(f"## {kind}\n\n{table}")
    md = "\n".join([
        "# MoE data path (quant, SiLU·mul+quant, routing, dispatch, combine)", "",
        f"- device: {name}", f"- commit: `{git_commit()}`", f"- date: {datetime.date.today().isoformat()}",
        "- command: `python -m moe_fp8.benchmarks.moe_data`"
        " (timings: `triton.testing.do_bench` medians, L2 flushed; GB/s = bytes the op must move once)",
        f"- ceilings: {ceilings}", "", *[f"- {n}" for n in notes], "", *tables, ""])
    md_path = args.out_dir / f"{device_slug(name) if DEV == 'cuda' else DEV}-{KIND}.md"
    md_path.write_text(md)
    print("\n" + md)
    print(f"wrote {path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
