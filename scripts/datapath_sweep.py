"""Sweep the launch configs of the MoE data-path Triton kernels on one GPU (one call, about 2-3 minutes).

For every kernel and every shape of the ``moe_data`` bench table, times a few candidate configs (the
knobs of ``moe_fp8/kernels/triton/configs.py``; the first candidate of each shape is the current
default, marked ``(default)``), checks each result against ``moe_fp8.reference`` once, prints a
compact table and writes JSON. Columns:

- ``us``       ``triton.testing.do_bench`` median of an eager call, L2 flushed (what moe_data reports).
- ``graph_us`` the same call captured in a CUDA graph and replayed: GPU time without the Python
               launch cost. ``us`` far above ``graph_us`` means the eager number is host-bound.
- ``host_us``  host time of one eager call (launch + Python), back to back without syncs.
- ``%copy``    bytes the op must move / ``graph_us`` against the measured copy bandwidth.
- ``check``    ``ok`` or what differs from the reference.

Then the DeepSeek-V3 decode step (routing + quant with masked dispatch + SiLU·mul+quant + combine, 128
tokens, top-8 of 256) under a CUDA graph with the default configs (target <= 40 us).

    python scripts/datapath_sweep.py [--out FILE.json] [--budget-s 150] [--kinds quant silu ...] [--decode-shapes]
    TRITON_INTERPRET=1 python scripts/datapath_sweep.py --smoke   # CPU: tiny shapes, logic only

To adopt a winner, edit the constant / rule in configs.py that produced it (the JSON row holds the
full config and the knobs that built it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.moe_data import _check_all, _silu_close  # noqa: E402
from moe_fp8 import reference as ref  # noqa: E402
from moe_fp8.kernels.triton import configs as C  # noqa: E402
from moe_fp8.kernels.triton import dispatch as D  # noqa: E402
from moe_fp8.kernels.triton import quant as Q  # noqa: E402
from moe_fp8.kernels.triton import routing as R  # noqa: E402
from moe_fp8.testing import draw_group_sizes, make_dispatch_inputs, make_routing_inputs, randn  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER, N_GROUP, TOPK_GROUP, SCALING = 7168, 256, 8, 2048, 8, 4, 2.5
SHAPES: dict[str, list[Any]] = {
    "quant": [(16384, 7168), (4096, 7168), (128, 7168), (16384, 2048)],
    "silu": [(16384, 1, 16384), (4096, 1, 4096), (1024, 1, 1024), (895, 256, 128), (7780, 32, 1024)],
    "routing": [16384, 4096, 128],
    "dispatch_contiguous": [16384, 4096],
    "dispatch_masked": [(128, 256, 128), (4096, 32, 2048)],
    "combine": [16384, 4096, 128],
}
DEV = "cuda"
SMOKE = False


# ============================================================================================
# Timing
# ============================================================================================

def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def time_eager(fn: Callable[[], Any]) -> float:
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median")) * 1e3


def time_graph(fn: Callable[[], Any]) -> float | None:
    """do_bench of a CUDA graph replay of one ``fn()`` (None where ``fn`` cannot be captured)."""
    if SMOKE:
        return None
    from triton.testing import do_bench

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return float(do_bench(graph.replay, warmup=5, rep=25, return_mode="median")) * 1e3
    except Exception:  # e.g. a host sync inside the op
        torch.cuda.synchronize()
        return None


def time_host(fn: Callable[[], Any], calls: int = 30) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) * 1e6 / calls
    _sync()
    return host


# ============================================================================================
# Checks
# ============================================================================================

exact = _check_all  # outputs bit-identical to the reference (NaN alike), valid rows only where masked


# ============================================================================================
# Cases: (kind, shape, nbytes, reference thunk, check, [(label, knobs, config, fn)])
# ============================================================================================

@dataclasses.dataclass
class Case:
    kind: str
    shape: dict[str, int]
    nbytes: int
    reference: Callable[[], Any]
    check: Callable[[Any, Any], str | None]
    candidates: list[tuple[dict[str, Any], Any, Callable[[], Any]]]


def _scale_bytes(rows: int, cols: int) -> int:
    return rows * ((cols + 127) // 128) * 4


def _dedup(cands: list[tuple[dict[str, Any], Any, Callable[[], Any]]]) -> list:
    seen, out = set(), []
    for knobs, cfg, fn in cands:
        if cfg not in seen:
            seen.add(cfg)
            out.append((knobs, cfg, fn))
    return out


QUANT_KNOBS = [{}, {"tile_elems": 4096, "num_warps": 8}, {"tile_elems": 1024, "num_warps": 4},
               {"tile_elems": 1024, "num_warps": 2}, {"tile_elems": 2048, "num_warps": 8}]


def quant_cases() -> list[Case]:
    cases = []
    for m, k in SHAPES["quant"]:
        x = randn((m, k), seed=m + k, device=DEV)
        cands = []
        for knobs in QUANT_KNOBS:
            cfg = C.quant_config(m, -(-k // 128), 128, 1, False, wide=C.quant_wide(DEV, None), **knobs)
            cands.append((knobs, cfg, lambda x=x, cfg=cfg: Q.per_token_group_quant(x, 128, False, 1e-10, config=cfg)))
        cases.append(Case("quant", {"m": m, "k": k}, m * k * 3 + _scale_bytes(m, k),
                          lambda x=x: ref.per_token_group_quant(x), exact(), _dedup(cands)))
    return cases


SILU_KNOBS = [{}, {"tile_elems": 2048, "num_warps": 4}, {"tile_elems": 4096, "num_warps": 8},
              {"tile_elems": 1024, "num_warps": 2}, {"tile_elems": 2048, "num_warps": 8}]
SILU_MASKED_KNOBS = [{}, {"programs_per_sm": 8}, {"programs_per_sm": 32}, {"programs_per_sm": 64},
                     {"tile_elems": 2048, "num_warps": 4}, {"tile_elems": 4096, "num_warps": 8, "max_block_g": 16},
                     {"tile_elems": 1024, "num_warps": 2, "max_block_g": 4}]


def silu_cases() -> list[Case]:
    cases = []
    two_i = 2 * INTER
    for rows, groups, max_m in SHAPES["silu"]:
        if groups == 1:
            h = randn((rows, two_i), seed=rows, device=DEV, dtype=torch.float32).mul(2).bfloat16()
            masked_m, check, knob_list = None, _silu_close(), SILU_KNOBS
        else:
            sizes = [min(s, max_m) for s in draw_group_sizes(groups, (rows + groups - 1) // groups, seed=groups)]
            masked_m = torch.tensor(sizes, dtype=torch.int32, device=DEV)
            h = randn((groups, max_m, two_i), seed=groups, device=DEV)
            rows = sum(sizes)
            valid = torch.arange(max_m, device=DEV)[None, :] < masked_m[:, None]
            check, knob_list = _silu_close({0: valid}), SILU_MASKED_KNOBS
        cands = []
        for knobs in knob_list:
            cfg = C.quant_config(max_m, INTER // 128, 128, groups, masked_m is not None, None, silu=True,
                                 wide=C.quant_wide(DEV, None), **knobs)  # (default): as the op picks it
            cands.append((knobs, cfg, lambda h=h, mm=masked_m, cfg=cfg: Q.silu_mul_per_token_group_quant(
                h, 128, False, mm, 1e-10, config=cfg)))
        cases.append(Case("silu_mul_quant", {"m": rows, "two_i": two_i, "groups": groups, "max_m": max_m},
                          rows * two_i * 2 + rows * two_i // 2 + _scale_bytes(rows, two_i // 2),
                          lambda h=h, mm=masked_m: ref.silu_mul_per_token_group_quant(h, masked_m=mm), check,
                          _dedup(cands)))
    return cases


ROUTING_KNOBS = [{}, {"block_t": 1, "num_warps": 1}, {"block_t": 1, "num_warps": 2}, {"block_t": 1, "num_warps": 4},
                 {"block_t": 2, "num_warps": 2}, {"block_t": 2, "num_warps": 1}, {"block_t": 4, "num_warps": 4},
                 {"block_t": 8, "num_warps": 8}]


def routing_cases() -> list[Case]:
    cases = []
    kw = dict(scoring_func="sigmoid", n_group=N_GROUP, topk_group=TOPK_GROUP, routed_scaling_factor=SCALING)
    for t in SHAPES["routing"]:
        logits, bias = make_routing_inputs(t, EXPERTS, seed=t, device=DEV, with_bias=True)
        cands = []
        for knobs in ROUTING_KNOBS:
            cfg = C.routing_config(t, EXPERTS, TOP_K, N_GROUP, **knobs)
            cands.append((knobs, cfg, lambda lg=logits, b=bias, cfg=cfg: R.select_experts(
                lg, TOP_K, "sigmoid", True, N_GROUP, TOPK_GROUP, b, SCALING, config=cfg)))

        def ids_only(got: Any, want: Any) -> str | None:  # renormalized weights: sum order (see tests)
            return None if torch.equal(got[1], want[1]) else "topk_ids differ"
        cases.append(Case("routing", {"t": t, "e": EXPERTS, "top_k": TOP_K}, t * EXPERTS * 4 + t * TOP_K * 8,
                          lambda lg=logits, b=bias: ref.select_experts(lg, TOP_K, e_score_correction_bias=b, **kw),
                          ids_only, _dedup(cands)))
    return cases


DISPATCH_KNOBS = [{}, {"block_t": 1}, {"block_t": 4}, {"block_t": 2, "block_k": 2048, "num_warps": 4},
                  {"block_k": 1024}, {"block_k": 8192, "num_warps": 8}, {"block_t": 1, "block_k": 4096, "num_warps": 8},
                  {"block_t": 1, "block_k": 1024, "num_warps": 2}]


def _dispatch_bytes(t: int, kept: int) -> int:
    return t * HIDDEN + _scale_bytes(t, HIDDEN) + kept * HIDDEN + _scale_bytes(kept, HIDDEN) + t * TOP_K * 12


def dispatch_cases() -> list[Case]:
    cases = []
    for t in SHAPES["dispatch_contiguous"]:
        d = make_dispatch_inputs(t, HIDDEN, EXPERTS, TOP_K, seed=t, device=DEV)
        want = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS)
        m_total = want[2].shape[0]
        rows = want[2] >= 0
        cands = []
        for sync, knobs in [(True, {}), (False, {})] + [(True, k) for k in DISPATCH_KNOBS[1:]]:
            cfg = C.dispatch_config(t, TOP_K, HIDDEN, EXPERTS, **knobs)

            def fn(d=d, cfg=cfg, sync=sync, m_total=m_total):
                out = D.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS, None, 128, sync=sync,
                                            config=cfg)
                return out if sync else (out[0][:m_total], out[1][:m_total], out[2][:m_total], out[3])
            cands.append(({**knobs, "sync": sync}, (cfg, sync), fn))
        cases.append(Case("dispatch_contiguous", {"t": t, "hidden": HIDDEN, "e": EXPERTS, "top_k": TOP_K},
                          _dispatch_bytes(t, t * TOP_K) + m_total * 4, lambda w=want: w,
                          exact({0: rows, 1: rows}), _dedup(cands)))
    for t, e, max_m in SHAPES["dispatch_masked"]:
        d = make_dispatch_inputs(t, HIDDEN, e, TOP_K, seed=t, device=DEV)
        want = ref.dispatch_masked(d.x_fp8, d.x_scale, d.topk_ids, e, max_m)
        valid = torch.arange(max_m, device=DEV)[None, :] < want[2][:, None]
        cands = []
        for knobs in [{}, {"fused": True}, {"fused": False}, *DISPATCH_KNOBS[1:]]:
            cfg = C.dispatch_config(t, TOP_K, HIDDEN, e, **knobs)
            cands.append((knobs, cfg, lambda d=d, e=e, mm=max_m, cfg=cfg: D.dispatch_masked(
                d.x_fp8, d.x_scale, d.topk_ids, e, mm, None, config=cfg)))
        cases.append(Case("dispatch_masked", {"t": t, "hidden": HIDDEN, "e": e, "top_k": TOP_K, "max_m": max_m},
                          _dispatch_bytes(t, int(want[2].sum())), lambda w=want: w, exact({0: valid, 1: valid}),
                          _dedup(cands)))
    return cases


COMBINE_KNOBS = [{}, {"block_t": 2}, {"block_t": 4}, {"block_h": 2048}, {"block_h": 512},
                 {"block_h": 2048, "num_warps": 8}, {"block_h": 512, "num_warps": 2}]


def combine_cases() -> list[Case]:
    cases = []
    for t in SHAPES["combine"]:
        d = make_dispatch_inputs(t, 128, EXPERTS, TOP_K, seed=t, device=DEV)
        row_map = ref.dispatch_contiguous(d.x_fp8, d.x_scale, d.topk_ids, EXPERTS)[3]
        y = randn((int(row_map.max()) + 1, HIDDEN), seed=t, device=DEV)
        shared = randn((t, HIDDEN), seed=t + 1, device=DEV)
        cands = []
        for knobs in COMBINE_KNOBS:
            cfg = C.combine_config(t, HIDDEN, **knobs)
            cands.append((knobs, cfg, lambda y=y, rm=row_map, w=d.topk_weights, s=shared, cfg=cfg: D.combine(
                y, rm, w, s, config=cfg)))
        cases.append(Case("combine", {"t": t, "hidden": HIDDEN, "top_k": TOP_K},
                          t * TOP_K * HIDDEN * 2 + 2 * t * HIDDEN * 2 + t * TOP_K * 12,
                          lambda y=y, rm=row_map, w=d.topk_weights, s=shared: ref.combine(y, rm, w, s), exact(),
                          _dedup(cands)))
    return cases


MAKERS = {"quant": quant_cases, "silu": silu_cases, "routing": routing_cases, "dispatch": dispatch_cases,
          "combine": combine_cases}


# ============================================================================================
# Decode step (default configs) under a CUDA graph
# ============================================================================================

def decode_step() -> dict[str, Any]:
    t, e, max_m = 128, EXPERTS, 128
    if SMOKE:
        t, e, max_m = 8, 16, 4
    x = randn((t, HIDDEN), seed=0, device=DEV)
    logits, bias = make_routing_inputs(t, e, seed=1, device=DEV, with_bias=True)
    h = randn((e, max_m, 2 * INTER), seed=2, device=DEV)
    y = randn((e, max_m, HIDDEN), seed=3, device=DEV)
    shared = randn((t, HIDDEN), seed=4, device=DEV)
    n_group, topk_group = (N_GROUP, TOPK_GROUP) if not SMOKE else (4, 2)

    def step():  # as Fp8FusedMoE's decode path (quantization inside the dispatch op)
        w, ids = R.select_experts(logits, TOP_K, "sigmoid", True, n_group, topk_group, bias, SCALING)
        _, _, _, _, masked_m, row_map = D.quant_dispatch_masked(x, ids, e, max_m, None)
        Q.silu_mul_per_token_group_quant(h, 128, False, masked_m, 1e-10)
        return D.combine(y, row_map, w, shared)

    return {"graph_us": time_graph(step), "eager_us": time_eager(step), "host_us": time_host(step, 10)}


# ============================================================================================
# Driver
# ============================================================================================

def _cfg_json(cfg: Any) -> Any:
    if isinstance(cfg, tuple):
        return [_cfg_json(c) for c in cfg]
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg


def _error_line(exc: BaseException) -> str:
    """``Type: message``, whole first meaningful line. A Triton ``CompilationError`` starts with
    ``at L:C:`` and the source; its cause (e.g. ``AssertionError('Mismatched type ...')``) is on the
    last line, so both are kept."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1 and text.startswith("at ") and text.endswith(":"):
        text = f"{text} {lines[-1]}"
    return f"{type(exc).__name__}: {text}"


def _short(knobs: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items()) or "(default)"


def main(argv: list[str] | None = None) -> int:
    global DEV, SMOKE, HIDDEN, EXPERTS, INTER, SHAPES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out_default = Path(os.environ["OUT"]) / "datapath-sweep.json" if os.environ.get("OUT") else \
        REPO / "docs" / "benchmarks" / "datapath-sweep.json"
    p.add_argument("--out", type=Path, default=out_default)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop adding candidates after this many seconds")
    p.add_argument("--kinds", nargs="*", default=[*MAKERS, "decode"])
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny shapes, logic only")
    p.add_argument("--decode-shapes", action="store_true", help="only the shapes of the 128-token decode step")
    args = p.parse_args(argv)
    if args.decode_shapes:
        SHAPES = {"quant": [(128, HIDDEN)], "silu": [(895, 256, 128)], "routing": [128], "dispatch_contiguous": [],
                  "dispatch_masked": [(128, 256, 128)], "combine": [128]}
    t_start = time.perf_counter()
    if args.smoke:
        SMOKE, DEV = True, ("cuda" if torch.cuda.is_available() else "cpu")
        HIDDEN, EXPERTS, INTER = 256, 16, 128
        SHAPES = {"quant": [(4, 256)], "silu": [(4, 1, 4), (6, 4, 4)], "routing": [5], "dispatch_contiguous": [6],
                  "dispatch_masked": [(6, 16, 4)], "combine": [5]}
    copy_gbps = 3000.0
    if not SMOKE:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / time_eager(lambda: dst.copy_(src)) / 1e3
        del src, dst
    device = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"# data-path sweep on {device}, copy {copy_gbps:.0f} GB/s", flush=True)
    # the decode step first, so the time budget never drops it
    decode = decode_step() if "decode" in args.kinds else None
    if decode:
        graph = f"{decode['graph_us']:.1f}" if decode["graph_us"] else "-"
        print(f"decode step (default configs): graph {graph} us (target <= 40), "
              f"eager {decode['eager_us']:.1f} us, host {decode['host_us']:.1f} us", flush=True)
    rows: list[dict[str, Any]] = []
    skipped = 0
    header = f"{'kind':<20} {'shape':<26} {'config':<44} {'us':>8} {'graph_us':>8} {'host_us':>7} {'%copy':>6} check"
    print(header)
    for kind in args.kinds:
        if kind == "decode":
            continue
        for case in MAKERS[kind]():
            want = case.reference()
            shape = "×".join(str(v) for v in case.shape.values())
            case_rows = []
            for knobs, cfg, fn in case.candidates:
                if case_rows and time.perf_counter() - t_start > args.budget_s:
                    skipped += 1
                    continue
                try:
                    got = fn()
                    _sync()
                    problem = case.check(got, want) or "ok"
                    us, graph_us, host_us = time_eager(fn), time_graph(fn), time_host(fn)
                except Exception as exc:  # record, do not hide
                    problem = _error_line(exc)
                    us = graph_us = host_us = None
                gpu = graph_us or us
                r = {"kind": case.kind, "shape": case.shape, "knobs": knobs, "config": _cfg_json(cfg), "us": us,
                     "graph_us": graph_us, "host_us": host_us, "check": problem,
                     "of_copy": (case.nbytes / gpu / 1e3 / copy_gbps) if gpu else None}
                case_rows.append(r)
                def fmt(v: float | None, w: int = 8) -> str:
                    return f"{v:{w}.1f}" if v is not None else "-".rjust(w)
                pct = f"{r['of_copy']:6.0%}" if r["of_copy"] is not None else "     -"
                print(f"{case.kind:<20} {shape:<26} {_short(knobs)[:44]:<44} {fmt(us)} {fmt(graph_us)} "
                      f"{fmt(host_us, 7)} {pct} {problem}", flush=True)
            ok = [r for r in case_rows if r["check"] == "ok" and (r["graph_us"] or r["us"])]
            if ok:
                best = min(ok, key=lambda r: r["graph_us"] or r["us"])
                best["best"] = True
                print(f"{'':<20} {'':<26} best: {_short(best['knobs'])}")
            rows += case_rows
            del want
            if DEV == "cuda":
                torch.cuda.empty_cache()
    notes = []
    if skipped:
        notes.append(f"time budget reached: {skipped} candidates skipped (rerun with --kinds ...)")
    for n in notes:
        print("NOTE:", n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "copy_gbps": copy_gbps, "rows": rows, "decode_step": decode,
                                    "notes": notes, "seconds": time.perf_counter() - t_start}, indent=1) + "\n")
    print(f"wrote {args.out} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
