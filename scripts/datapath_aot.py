"""Compile every MoE data-path Triton kernel ahead of time for sm_90 — no GPU needed.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run the kernels) accepts programs the
real compiler rejects (e.g. a loop variable that is int32 in one branch and int64 in the other), so
the CPU tests alone let a kernel that cannot compile reach the GPU. This script runs the public launch
wrappers of ``moe_fp8.kernels.triton`` on CPU tensors over a set of shapes, dtypes, flags and configs
that reaches every constexpr branch, captures each launch instead of running it (``kernel[grid](...)``),
binds the arguments exactly as Triton's launcher does (signature, specialization, constexprs,
options) and compiles each distinct specialization for ``GPUTarget("cuda", 90, 32)`` down to a cubin
(Triton ships ptxas). Hardware paths the interpreter never takes (``NATIVE_FP8`` / ``NATIVE_CVT``,
and ``PDL`` with ``launch_pdl``) are compiled too.

    python scripts/datapath_aot.py [--json FILE] [--arch 90]

Exit status 1 if any kernel fails to compile (each failure's first lines are printed). Must run
without ``TRITON_INTERPRET`` (it is removed from the environment before Triton is imported).
``tests/test_datapath_compile.py`` runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: kernels must be JITFunctions

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from moe_fp8.kernels.triton import configs as C  # noqa: E402
from moe_fp8.kernels.triton import dispatch as D  # noqa: E402
from moe_fp8.kernels.triton import quant as Q  # noqa: E402
from moe_fp8.kernels.triton import routing as R  # noqa: E402
from moe_fp8.utils import FP8_DTYPE, empty_scale_tma  # noqa: E402

MODULES = (Q, R, D)
# one launch, bound as Triton's launcher binds it: (kernel, signature, constexprs, attrs, options)
Launch = tuple[JITFunction, dict, dict, dict, Any]


def _bind(kernel: JITFunction, backend: Any, args: tuple, kwargs: dict) -> Launch:
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return kernel, signature, constexprs, attrs, options


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel in its module: ``kernel[grid](*args)`` is bound and recorded
    at once, so the (zero-filled, model-sized) argument tensors die with the call: holding them for the
    compile phase took 18 GB."""

    def __init__(self, kernel: JITFunction, backend: Any, sink: list[Launch]) -> None:
        self.kernel, self.backend, self.sink = kernel, backend, sink

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.sink.append(_bind(self.kernel, self.backend, args, kwargs))


def kernels() -> dict[str, JITFunction]:
    """Every ``*_kernel`` JIT function of the data-path modules (what the launches must cover)."""
    out = {}
    for mod in MODULES:
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                out[f"{mod.__name__.rsplit('.', 1)[1]}.{name}"] = obj
    return out


def _drive() -> None:
    """Call the launch wrappers over the shapes / flags / configs that reach every kernel branch."""
    def quant_inputs(shape, dtype=torch.bfloat16):
        return torch.zeros(shape, dtype=dtype)

    # ---- quant: dtypes, ue8m0, partial groups, tile sizes (decode / prefill), sweep knobs ----
    for shape, dtype, ue8m0, gs in [((128, 7168), torch.bfloat16, False, 128), ((2048, 7168), torch.bfloat16, True, 128),
                                    ((3, 200), torch.float32, False, 128), ((5, 96), torch.float16, False, 64),
                                    ((4, 128, 512), torch.bfloat16, False, 128)]:
        Q.per_token_group_quant(quant_inputs(shape, dtype), gs, ue8m0, 1e-10)
    for knobs in [{"tile_elems": 4096, "num_warps": 8}, {"tile_elems": 8192, "num_warps": 8},
                  {"tile_elems": 1024, "num_warps": 4}, {"tile_elems": 2048, "num_warps": 4},
                  {"tile_elems": 4096, "num_warps": 8, "max_block_g": 16}]:
        cfg = C.quant_config(2048, 56, 128, **knobs)
        Q.per_token_group_quant(quant_inputs((2048, 7168)), 128, False, 1e-10, config=cfg)
    # ---- SiLU·mul+quant: unmasked, masked flat (decode buffer), masked per-group, precise ----
    Q.silu_mul_per_token_group_quant(quant_inputs((2048, 4096)), 128, False, None, 1e-10)
    Q.silu_mul_per_token_group_quant(quant_inputs((128, 4096)), 128, True, None, 1e-10, precise=True)
    for groups, max_m in [(256, 128), (32, 256), (C.QUANT_FLAT_MAX_GROUPS + 1, 1)]:
        mm = torch.zeros(groups, dtype=torch.int32)
        h = quant_inputs((groups, max_m, 512 if groups > 256 else 4096))  # shapes only: keep them small
        Q.silu_mul_per_token_group_quant(h, 128, False, mm, 1e-10)
        if groups <= 256:
            for knobs in [{"programs_per_sm": 32}, {"tile_elems": 2048, "num_warps": 4},
                          {"tile_elems": 4096, "num_warps": 8, "max_block_g": 16}]:
                cfg = C.quant_config(max_m, 16, 128, groups, True, silu=True, **knobs)
                Q.silu_mul_per_token_group_quant(h, 128, False, mm, 1e-10, config=cfg)

    # ---- routing: scoring, groups, bias, renormalize; decode / prefill configs and sweep knobs ----
    logits = torch.zeros(128, 256)
    bias = torch.zeros(256)
    for scoring, n_group, topk_group, b, renorm in [("sigmoid", 8, 4, bias, True), ("softmax", None, None, None, False),
                                                    ("softmax", 8, 4, None, True), ("sigmoid", None, None, bias, False)]:
        for t in (128, 16384):
            R.select_experts(logits[:1].expand(t, 256), 8, scoring, renorm, n_group, topk_group, b, 2.5)
        for bt, nw in [(1, 1), (1, 4), (2, 2), (4, 4), (8, 8)]:
            cfg = C.routing_config(4096, 256, 8, n_group, block_t=bt, num_warps=nw)
            R.select_experts(logits, 8, scoring, renorm, n_group, topk_group, b, 2.5, config=cfg)
    R.select_experts(torch.zeros(7, 1024), 6, "softmax", True, None, None, None, 1.0)

    # ---- dispatch (fused / chunked, expert map, contiguous sync / bound) and combine ----
    emap = torch.full((512,), -1, dtype=torch.int64)
    emap[:256] = torch.arange(256)
    # (top-10 of 512: K_P2 = 16, whose slot selects Triton 3.6 once failed to lay out)
    for t, e, top_k in [(1, 256, 8), (128, 256, 8), (512, 32, 8), (1024, 256, 8), (37, 12, 3), (2048, 512, 10)]:
        x, xs = torch.zeros(t, 7168, dtype=FP8_DTYPE), empty_scale_tma(t, 56)
        ids = torch.zeros(t, top_k, dtype=torch.int32)
        for m in (None, emap[: max(e, 12) * 2]):
            D.dispatch_masked(x, xs, ids, e, 128, m)
            D.dispatch_contiguous(x, xs, ids, e, m, 128, sync=True)
            D.dispatch_contiguous(x, xs, ids, e, m, 128, sync=False)
        for knobs in [{"fused": False}, {"fused": True}, {"block_t": 2, "block_k": 4096, "num_warps": 8},
                      {"block_t": 1, "block_k": 8192, "num_warps": 8}, {"block_k": 1024}, {"block_t": 8},
                      {"fused": False, "sparse": True}, {"fused": False, "sparse": True, "block_k": 8192, "num_warps": 8},
                      {"fused": False, "scales_apart": True}]:
            cfg = C.dispatch_config(t, top_k, 7168, e, **knobs)
            if cfg.fused and t > 256:
                continue  # the fused path's cost grows as pairs²: the sweep never tries it there
            D.dispatch_masked(x, xs, ids.long(), e, 128, None, config=cfg)
            D.dispatch_contiguous(x, xs, ids, e, None, 128, sync=False, config=cfg)
            if cfg.fused:
                D.quant_dispatch_masked(torch.zeros(t, 7168, dtype=torch.bfloat16), ids, e, 128, None, config=cfg)
        xb = torch.zeros(t, 7168, dtype=torch.bfloat16)
        for m, ue8m0 in ((None, False), (emap[: max(e, 12) * 2], True)):
            D.quant_dispatch_masked(xb, ids, e, 128, m, ue8m0)
        D.quant_dispatch_masked(torch.zeros(t, 200, dtype=torch.float32), ids, e, 16, None)
        for m, ue8m0, sync, return_x in ((None, False, True, True), (emap[: max(e, 12) * 2], False, True, False),
                                         (emap[: max(e, 12) * 2], True, False, True), (None, True, True, False)):
            D.quant_dispatch_contiguous(xb, ids, e, m, 128, ue8m0, sync=sync, return_x=return_x)
            # under a map: the quant kernel then the dense FP8 scatter; without one: the sparse scatter
            # quantizing (and writing x_fp8)
            cfg = C.dispatch_config(t, top_k, 7168, e, has_map=m is not None, quant=True, sparse=m is None)
            D.quant_dispatch_contiguous(xb, ids, e, m, 128, ue8m0, sync=sync, return_x=return_x, config=cfg)
        D.quant_dispatch_contiguous(torch.zeros(t, 200, dtype=torch.float32), ids, e, None, 16)
        # the dense quantizing scatter with its scales in a pass of their own (the default from 4096 tokens)
        for sync in (True, False):
            D.quant_dispatch_contiguous(xb, ids, e, None, 128, False, sync=sync,
                                        config=C.dispatch_config(t, top_k, 7168, e, quant=True, scales_apart=True))
        y = torch.zeros(t * top_k, 7168, dtype=torch.bfloat16)
        row_map = torch.zeros(t, top_k, dtype=torch.int64)
        # Hopper's dispatches: the routing kernels, then a CUDA row mover (stubbed: not Triton) and, from 32768
        # pairs on, the scale pass over token-major scales
        for tokens in (t, 4096):
            xt, xst = torch.zeros(tokens, 7168, dtype=FP8_DTYPE), empty_scale_tma(tokens, 56)
            idt = torch.zeros(tokens, top_k, dtype=torch.int32)
            for sync in (True, False):
                D.dispatch_contiguous(xt, xst, idt, e, None, 128, sync=sync, mover=lambda *args: None)
            D.dispatch_masked(xt, xst, idt, e, 128, None, mover=lambda *args: None)
        w = torch.zeros(t, top_k)
        for shared in (None, torch.zeros(t, 7168, dtype=torch.bfloat16)):
            D.combine(y, row_map, w, shared)
            for knobs in [{"block_t": 4}, {"block_h": 2048, "num_warps": 8}, {"block_h": 512}, {"gather_all": False},
                          {"gather_all": True, "block_h": 2048, "num_warps": 8}, {"sparse": True},
                          {"sparse": True, "block_h": 4096}]:
                D.combine(y, row_map, w, shared, config=C.combine_config(t, 7168, **knobs))


def capture(arch: int = 90) -> list[Launch]:
    """The launches ``_drive`` makes (bound for ``cuda:arch``), with the kernels, device checks and
    hardware probes patched."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    launches: list[Launch] = []
    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for mod in MODULES:
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                    patch(mod, name, _Recorder(obj, backend, launches))
            patch(mod, "check_launch_device", lambda *t: torch.device("cpu"))
            for probe in ("native_fp8", "native_cvt"):  # compile the GPU's hardware-conversion paths
                if hasattr(mod, probe):
                    patch(mod, probe, lambda device: True)
            if hasattr(mod, "pdl_args"):  # and the programmatic-dependent-launch prologue
                patch(mod, "pdl_args", lambda device: {"PDL": True, "launch_pdl": True})
        # dispatch_contiguous(sync=True) reads its status tensor on the host: zeros (M_total = 0)
        patch(torch, "empty", torch.zeros)
        _drive()
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
    return launches


def compile_launches(launches: list[Launch], arch: int = 90, log: Callable[[str], None] = print
                     ) -> list[dict[str, Any]]:
    """Compile each distinct (kernel, signature, constexprs, options) for ``cuda:arch``."""
    target = GPUTarget("cuda", arch, 32)
    results, seen = [], set()
    for kernel, signature, constexprs, attrs, options in launches:
        names = [p.name for p in kernel.params]
        consts = {names[k[0]]: v for k, v in constexprs.items() if len(k) == 1 and signature[names[k[0]]] == "constexpr"}
        key = (kernel.__name__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
               repr(sorted(options.__dict__.items())))
        if key in seen:
            continue
        seen.add(key)
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            error = None if "cubin" in compiled.asm else "no cubin produced"
        except Exception as exc:  # record every failure, not just the first
            error = f"{type(exc).__name__}: {exc}"
        row = {"kernel": kernel.__name__, "constexprs": {k: repr(v) for k, v in consts.items()},
               "num_warps": options.num_warps, "seconds": round(time.perf_counter() - start, 2), "error": error}
        results.append(row)
        log(f"{'FAIL' if error else 'ok  '} {row['kernel']:<26} warps={row['num_warps']} {row['constexprs']}"
            + (f"\n{error}" if error else ""))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the per-specialization results here")
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args(argv)
    launches = capture(args.arch)
    results = compile_launches(launches, args.arch)
    covered = {r["kernel"] for r in results}
    missing = sorted(name for name, k in kernels().items() if k.__name__ not in covered)
    failed = [r for r in results if r["error"]]
    summary = {"triton": triton.__version__, "arch": args.arch, "compiled": len(results), "failed": len(failed),
               "missing": missing, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"# {len(results)} specializations for sm_{args.arch}, {len(failed)} failed, "
          f"kernels never launched: {missing or 'none'}")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
