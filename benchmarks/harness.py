"""Timing, ceilings and the DESIGN §7 JSON record shared by every bench driver.

Timing follows shared/ANCHORS.md: ``triton.testing.do_bench`` medians with the L2 flushed before
every run (the same method for our kernels and every baseline, in one process). Without Triton a
CUDA-event loop with the same flush is used.

The GEMM benches also time each impl the way ANCHORS.md's DeepGEMM figures were taken
(``bench_chilled_us``: DeepGEMM's ``bench_kineto`` puts an 8 GB memset before every call and reads the
kernels' own durations from the profiler; we also synchronise after the memset, so no PDL-launched kernel
overlaps it). The two differ for long FP8 GEMMs: back to back, they hold an H100 at its 700 W cap, which
lowers the SM clock (1.2–1.5 GHz against 1.98 in our runs); a memset between calls keeps it near the top.
For short ones the kernel durations leave out the ~2–4 µs of launch latency that CUDA events around a call
include.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .report import device_slug

REPO = Path(__file__).resolve().parents[1]


def bench_us(fn: Callable[[], Any], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median microseconds of one ``fn()`` call, L2 flushed before each call."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _bench_events_us(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3


def alternated_us(fns: Sequence[Callable[[], Any]], rounds: int = 3) -> list[float]:
    """``bench_us`` of each of ``fns`` over ``rounds`` rounds, taken in turn within each round so that drift falls on
    all alike (A/B runs in one process): the median of each."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, t in zip(fns, times, strict=True):
            t.append(bench_us(fn))
    return [sorted(t)[rounds // 2] for t in times]


def _bench_events_us(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est_ms))):
        fn()
    times = []
    for _ in range(max(5, int(rep_ms / est_ms))):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2] * 1e3


_FLUSH_BUFFERS: list[torch.Tensor] = []


def flushed_events(fn: Callable[[], Any], clean: bool = False) -> list[tuple[str, float, float]]:
    """The GPU activities of one ``fn()`` call (``gpu_events``), the stream synchronised before it, after
    do_bench's flush (a 256 MB memset, which leaves the L2 full of dirty lines) or, ``clean``, after that flush
    and a 96 MB read, which leaves clean lines as a model's previous layer does (weights streamed, small
    activations written). A kernel whose reads evict dirty lines pays their write-back to DRAM as well
    (docs/kernels/gemm.md, session 32)."""
    from torch.profiler import ProfilerActivity, profile

    if not _FLUSH_BUFFERS:
        _FLUSH_BUFFERS.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
        _FLUSH_BUFFERS.append(torch.zeros(24 << 20, dtype=torch.float32, device="cuda"))  # 96 MB
    flush, lines = _FLUSH_BUFFERS
    flush.zero_()
    if clean:
        lines.sum()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return gpu_events(prof)


def span_us(events: Iterable[tuple[str, float, float]]) -> float:
    """From the first activity's start to the last one's end (a CUDA-graph replay's GPU time, launch left out)."""
    events = list(events)
    if not events:
        raise ValueError("span_us: no GPU activity was recorded (did the call launch anything on the GPU?)")
    return max(end for _, _, end in events) - min(start for _, start, _ in events)


def flushed_spans_us(fn: Callable[[], Any], reps: int = 9) -> tuple[float, float]:
    """``(dirty, clean)``: median ``span_us`` of one ``fn()`` call after each of ``flushed_events``' flushes, the
    two alternating."""
    fn()
    spans = [[span_us(flushed_events(fn, clean)) for clean in (False, True)] for _ in range(reps)]
    dirty, clean = (sorted(s[i] for s in spans)[reps // 2] for i in (0, 1))
    return dirty, clean


_CHILL: list[torch.Tensor] = []
_CHILL_KERNELS: set[str] = set()


def bench_chilled_us(fn: Callable[[], Any], calls: int = 30) -> float:
    """Median microseconds of GPU kernel time per ``fn()`` call, measured as DeepGEMM's ``bench_kineto``
    measures its kernels: ~8 GB of memset before every call (L2 flushed, and the GPU kept off its power
    cap), a round of ``calls`` calls to warm up, then ``calls`` profiled ones; a call's time is the sum of
    the profiler's (CUPTI) durations of the kernels it launched, so launch latency and host gaps between
    its kernels are left out, as they are from ANCHORS.md's DeepGEMM figures. The stream is synchronised
    after the memset: a kernel launched as a programmatic dependent (our GEMMs) would otherwise start
    during the memset's last blocks and wait there, and its duration would include that wait (~0.3 µs)."""
    from torch.profiler import ProfilerActivity, profile

    if not _CHILL:
        free, _ = torch.cuda.mem_get_info()
        _CHILL.append(torch.empty(min(1 << 30, free // 8), dtype=torch.uint8, device="cuda"))
    buf = _CHILL[0]
    memsets = -(-8_000_000_000 // buf.numel())

    def chill() -> None:
        for _ in range(memsets):
            buf.zero_()
        torch.cuda.synchronize()

    if not _CHILL_KERNELS:  # what the memset runs as, to tell it from fn's kernels in the trace
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            buf.zero_()
            torch.cuda.synchronize()
        _CHILL_KERNELS.update(name for name, _, _ in gpu_events(prof))
    for _ in range(calls):
        chill()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            chill()
            fn()
        torch.cuda.synchronize()
    per_call = kernel_us_per_call(gpu_events(prof), _CHILL_KERNELS)
    if len(per_call) != calls:
        raise RuntimeError(f"bench_chilled_us: found {len(per_call)} calls' kernels in the trace, expected {calls}")
    return sorted(per_call)[len(per_call) // 2]


def gpu_events(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) in µs of every GPU activity a ``torch.profiler.profile`` recorded, in start order."""
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[1])


def kernel_us_per_call(events: Iterable[tuple[str, float, float]], chill: set[str]) -> list[float]:
    """Summed durations of each run of GPU activities between the memsets (named in ``chill``) of
    ``bench_chilled_us``: one entry per timed call."""
    per_call: list[float] = []
    inside = False
    for name, start, end in events:
        if name in chill:
            inside = False
        elif inside:
            per_call[-1] += end - start
        else:
            per_call.append(end - start)
            inside = True
    return per_call


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (read + write), per-tensor FP8 and bf16 matmul rates at 8192³, measured now."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = bench_us(lambda: dst.copy_(src))
    s = 8192
    a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    bf16_us = bench_us(lambda: a @ b.t())
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8_us = bench_us(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return {"copy_gbps": round(2 * n / copy_us / 1e3, 1), "fp8_pertensor_tflops": round(2 * s**3 / fp8_us / 1e6, 1),
            "bf16_tflops": round(2 * s**3 / bf16_us / 1e6, 1)}


def git_commit() -> str:
    """The measured commit: ``MOE_FP8_COMMIT`` when set (a copied tree whose .git is stale), else git's."""
    if os.environ.get("MOE_FP8_COMMIT"):
        return os.environ["MOE_FP8_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def row(kind: str, shape: dict[str, int], impl: str, us: float, flops: float, nbytes: float,
        chilled_us: float | None = None) -> dict[str, Any]:
    """A DESIGN §7 row; with ``chilled_us`` (``bench_chilled_us``) also ``chilled_us`` /
    ``chilled_tflops`` / ``chilled_gbps``, the same call timed DeepGEMM's way."""
    out = {"kind": kind, "shape": shape, "impl": impl, "us": round(us, 2),
           "tflops": round(flops / us / 1e6, 1) if flops else None, "gbps": round(nbytes / us / 1e3, 1)}
    if chilled_us is not None:
        out.update(chilled_us=round(chilled_us, 2), chilled_tflops=round(flops / chilled_us / 1e6, 1) if flops else None,
                   chilled_gbps=round(nbytes / chilled_us / 1e3, 1))
    return out


def make_record(rows: list[dict[str, Any]], ceilings: dict[str, float],
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DESIGN §7 record of ``rows`` measured now on the current device."""
    return {"device": torch.cuda.get_device_name(), "commit": git_commit(),
            "date": datetime.date.today().isoformat(), "ceilings": ceilings, "rows": rows, **(extra or {})}


def write_record(kind: str, rows: list[dict[str, Any]], ceilings: dict[str, float], out_dir: Path,
                 extra: dict[str, Any] | None = None) -> Path:
    """Write ``<out_dir>/<device>-<kind>.json`` in the DESIGN §7 format."""
    record = make_record(rows, ceilings, extra)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{device_slug(record['device'])}-{kind}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def ratio_table(rows: list[dict[str, Any]], ours: str, baselines: Iterable[str], metric: str = "tflops",
                extra_cols: dict[str, Callable[[dict[str, Any]], str]] | None = None) -> str:
    """Markdown table: one line per shape, our metric, each baseline's and our ratio to it, and a geomean."""
    import math

    baselines = list(baselines)
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault(json.dumps(r["shape"]), {})[r["impl"]] = r
    unit = {"tflops": "TFLOPS", "gbps": "GB/s"}.get(metric, metric)
    with_gbps = metric != "gbps"  # else the GB/s column would be the metric column again
    head = ["shape", f"{ours} us", f"{ours} {unit}", *([f"{ours} GB/s"] if with_gbps else [])]
    for b in baselines:
        head += [f"{b} {unit}", f"x {b}"]
    head += list(extra_cols or {})
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    logs: dict[str, list[float]] = {b: [] for b in baselines}
    for key, impls in by_shape.items():
        if ours not in impls:
            continue
        o = impls[ours]
        shape = "×".join(str(v) for v in json.loads(key).values())
        cells = [shape, f"{o['us']:.1f}", f"{o[metric] or 0:.0f}", *([f"{o['gbps']:.0f}"] if with_gbps else [])]
        for b in baselines:
            if b in impls and impls[b]["us"]:
                ratio = impls[b]["us"] / o["us"]
                logs[b].append(math.log(ratio))
                cells += [f"{impls[b][metric] or 0:.0f}", f"{ratio:.2f}"]
            else:
                cells += ["-", "-"]
        cells += [fn(o) for fn in (extra_cols or {}).values()]
        lines.append("| " + " | ".join(cells) + " |")
    geo = ", ".join(f"x {b}: {math.exp(sum(v) / len(v)):.3f}" for b, v in logs.items() if v)
    lines.append(f"\ngeomean speed-up ({len(by_shape)} shapes) — {geo}")
    return "\n".join(lines)
