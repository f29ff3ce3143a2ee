#!/usr/bin/env python
"""Self-checking smoke test + timings of the JIT runtime (``moe_fp8.kernels.jit``) on a Hopper GPU.

Checks (each against torch): vector add (fp32 ``extern "C"`` kernel and a bf16 template instance found
by its mangled name), TMA tile copy through shared memory (``cp.async.bulk.tensor`` + mbarrier) for
every swizzle mode and a column-major scale layout, cluster launch (``%cluster_ctarank``), >48 KiB
dynamic shared memory (and 48 KiB beside static shared memory), CUDA-graph capture and replay, argument validation.

Timings: cold compile per compiler (fresh cache dir), warm load in a fresh process (cache hit: key +
cubin load + function lookup), host time per eager launch of an empty 6-argument kernel (with a TMA
descriptor) against torch's own launch and cuda.bindings' tuple-marshalled launch, TMA encode costs.

    python scripts/jit_smoke.py --json out/jit_smoke.json          # on the H100 (well under 2 min)
    python scripts/jit_smoke.py --compile-only                     # anywhere with a compiler

Exit status: 0 all checks passed, 1 a check failed, 2 no GPU (and no ``--compile-only``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_fp8.kernels import jit  # noqa: E402
from moe_fp8.kernels.jit import Arg, build  # noqa: E402

TARGET_COLD_COMPILE_S = 10.0
TARGET_WARM_LOAD_MS = 50.0
TARGET_LAUNCH_US = 10.0

# ---------------------------------------------------------------- kernel sources

COMMON = r"""
#include <cstdint>
// CUtensorMap passed by value: 128 bytes, 64-byte aligned (<cuda.h> does not compile under NVRTC).
struct alignas(64) TmaDescriptor { uint64_t raw[16]; };
"""

VADD_F32 = COMMON + r"""
extern "C" __global__ void vadd_f32(const float* __restrict__ a, const float* __restrict__ b,
                                    float* __restrict__ c, uint32_t n, float alpha) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + alpha * b[i];
}
"""

# A template instance: the runtime finds its mangled name in the cubin.
VADD_BF16 = COMMON + r"""
#include <cuda_bf16.h>
template <typename T, int kUnroll>
__global__ void vadd(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, uint64_t n, float alpha) {
  const uint64_t base = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kUnroll;
  #pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const uint64_t i = base + u;
    if (i < n) c[i] = __float2bfloat16(__bfloat162float(a[i]) + alpha * __bfloat162float(b[i]));
  }
}
template __global__ void vadd<__nv_bfloat16, 4>(const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                                                uint64_t, float);
"""

# One block copies one TMA box into shared memory, then undoes the swizzle while writing it out.
# Swizzle (TMA / CUTLASS Swizzle<B,4,3>): 16-byte chunk bits [4, 4+B) ^= bits [7, 7+B) of the smem
# offset from a 1024-byte aligned base; mask = 7 (128B), 3 (64B), 1 (32B), 0 (none).
TMA_COPY = COMMON + r"""
extern "C" __global__ void __launch_bounds__(128) tma_copy_2d(
    const __grid_constant__ TmaDescriptor desc, uint8_t* __restrict__ out, uint32_t gmem_inner,
    uint32_t gmem_outer, uint32_t elem_bytes, uint32_t box_inner, uint32_t box_outer, uint32_t swizzle_mask) {
  extern __shared__ uint8_t smem_raw[];
  // align the tile to 1024 bytes (the 128B swizzle atom); the host adds 1024 + 8 bytes of slack
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = ((raw_addr + 1023u) & ~1023u) - raw_addr;
  uint8_t* tile = smem_raw + pad;
  const uint32_t tile_bytes = box_inner * box_outer * elem_bytes;
  const uint32_t tile_addr = raw_addr + pad;
  const uint32_t bar_addr = tile_addr + ((tile_bytes + 7u) & ~7u);
  const int32_t c0 = static_cast<int32_t>(blockIdx.x * box_inner);
  const int32_t c1 = static_cast<int32_t>(blockIdx.y * box_outer);

  // ---- init barrier (one arrival + the TMA's transaction bytes)
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // ---- issue TMA
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_addr), "r"(tile_bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        :: "r"(tile_addr), "l"(reinterpret_cast<uint64_t>(&desc)), "r"(c0), "r"(c1), "r"(bar_addr) : "memory");
  }
  // ---- wait phase 0
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar_addr) : "memory");
  }
  // ---- un-swizzle to global (in-bounds elements only; TMA zero-fills the rest of the box)
  const uint32_t row_bytes = box_inner * elem_bytes;
  const uint64_t out_pitch = uint64_t(gmem_inner) * elem_bytes;
  for (uint32_t i = threadIdx.x; i < tile_bytes; i += blockDim.x) {
    const uint32_t r = i / row_bytes, cb = i % row_bytes;
    const uint32_t gr = c1 + r, gcb = c0 * elem_bytes + cb;
    if (gr < gmem_outer && gcb < gmem_inner * elem_bytes)
      out[gr * out_pitch + gcb] = tile[i ^ (((i >> 7) & swizzle_mask) << 4)];
  }
}
"""

CLUSTER_IDS = COMMON + r"""
extern "C" __global__ void cluster_ids(uint32_t* out) {
  uint32_t rank, cid;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
  if (threadIdx.x == 0) { out[2 * blockIdx.x] = rank; out[2 * blockIdx.x + 1] = cid; }
}
"""

# Static and dynamic shared memory together: each thread writes its index into both, reads a neighbour's back.
STATIC_DYNAMIC_SMEM = COMMON + r"""
extern "C" __global__ void static_dynamic_smem(uint32_t* out, uint32_t dynamic_words) {
  __shared__ uint32_t fixed[256];
  extern __shared__ uint32_t dynamic[];
  fixed[threadIdx.x] = threadIdx.x;
  for (uint32_t i = threadIdx.x; i < dynamic_words; i += blockDim.x) dynamic[i] = i;
  __syncthreads();
  const uint32_t last = dynamic_words - 1 - threadIdx.x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = fixed[255 - threadIdx.x] + dynamic[last] * 256;
}
"""

EMPTY6 = COMMON + r"""
extern "C" __global__ void empty6(const __grid_constant__ TmaDescriptor desc, const float* a, float* b,
                                  uint32_t n, int32_t m, float alpha) {}
"""

SWIZZLE_MASK = {"none": 0, "32B": 1, "64B": 3, "128B": 7}
# (dtype, gmem_inner, gmem_outer, box_inner, box_outer, swizzle): ragged shapes included
TMA_CASES: list[tuple[torch.dtype, int, int, int, int, str]] = [
    (torch.float8_e4m3fn, 512, 256, 128, 64, "128B"),
    (torch.bfloat16, 384, 200, 64, 32, "128B"),
    (torch.bfloat16, 384, 128, 32, 16, "64B"),
    (torch.float32, 204, 100, 8, 8, "32B"),
    (torch.float32, 96, 64, 32, 32, "none"),
    (torch.int32, 100, 37, 16, 8, "64B"),
]


# ---------------------------------------------------------------- checks (also used by tests/test_jit.py)

def _kernel(name: str, src: str, compiler: str | None = None) -> jit.JitKernel:
    return build(f"smoke_{name}", src, compiler=compiler)


def check_vadd_f32(compiler: str | None = None, n: int = 100_003) -> str:
    k = _kernel("vadd_f32", VADD_F32, compiler)
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    c = torch.full_like(a, float("nan"))
    k.launch(((n + 255) // 256, 1, 1), (256, 1, 1), [a, b, c, n, 0.5])
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a + 0.5 * b)
    return f"n={n}, symbol {k.symbol}"


def check_vadd_bf16(compiler: str | None = None, n: int = 65_537) -> str:
    k = _kernel("vadd_bf16", VADD_BF16, compiler)
    if not k.symbol.startswith("_Z4vadd"):
        raise AssertionError(f"expected a mangled vadd<> symbol, got {k.symbol}")
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    c = torch.full_like(a, float("nan"))
    threads = 128
    k.launch(((n + threads * 4 - 1) // (threads * 4), 1, 1), (threads, 1, 1), [a, b, c, Arg(n, "u64"), 2.0])
    torch.cuda.synchronize()
    ref = (a.float() + 2.0 * b.float()).bfloat16()
    torch.testing.assert_close(c, ref, rtol=0, atol=0)
    return f"n={n}, symbol {k.symbol}"


def tma_copy(inp: torch.Tensor, gmem_inner: int, gmem_outer: int, box_inner: int, box_outer: int,
             swizzle: str, *, compiler: str | None = None, extra_smem: int = 0,
             outer_stride_elems: int | None = None) -> torch.Tensor:
    """Copy ``inp`` (viewed as [gmem_outer, gmem_inner]) through TMA; returns a dense uint8 [outer, inner*elem]."""
    from moe_fp8.kernels.jit import make_tma_2d

    k = _kernel("tma_copy_2d", TMA_COPY, compiler)
    elem = inp.element_size()
    desc = make_tma_2d(inp, gmem_inner, gmem_outer, box_inner, box_outer, swizzle=swizzle,
                       outer_stride_elems=outer_stride_elems)
    out = torch.full((gmem_outer, gmem_inner * elem), 0xA5, dtype=torch.uint8, device=inp.device)
    grid = ((gmem_inner + box_inner - 1) // box_inner, (gmem_outer + box_outer - 1) // box_outer, 1)
    smem = box_inner * box_outer * elem + 1024 + 8 + extra_smem
    k.launch(grid, (128, 1, 1), [desc, out, gmem_inner, gmem_outer, elem, box_inner, box_outer,
                                 SWIZZLE_MASK[swizzle]], smem_bytes=smem)
    torch.cuda.synchronize()
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def check_tma_cases(compiler: str | None = None) -> str:
    done = []
    for dtype, inner, outer, bi, bo, sw in TMA_CASES:
        src = torch.randn(outer, inner, device="cuda").mul(50)
        inp = src.to(dtype) if dtype != torch.int32 else src.to(torch.int32)
        out = tma_copy(inp, inner, outer, bi, bo, sw, compiler=compiler)
        if not torch.equal(out, _as_bytes(inp)):
            bad = (out != _as_bytes(inp)).nonzero()[:5].tolist()
            raise AssertionError(f"TMA copy mismatch for {dtype} {outer}x{inner} box {bo}x{bi} {sw}: first bad {bad}")
        done.append(f"{str(dtype).split('.')[-1]}:{sw}")
    return ", ".join(done)


def check_tma_col_major_scale(compiler: str | None = None) -> str:
    """FP32 scales [M, KG] with strides (1, M_pad): the layout the GEMM kernels read (DESIGN §2)."""
    m, kg, m_pad = 98, 7, 100
    buf = torch.randn(kg, m_pad, device="cuda")
    scale = buf[:, :m].t()  # [M, KG], stride (1, M_pad)
    out = tma_copy(scale, m, kg, 32, 1, "none", compiler=compiler)  # strides inferred from the layout
    if not torch.equal(out, _as_bytes(scale.t())):
        raise AssertionError("column-major scale TMA copy mismatch")
    return f"[M={m}, KG={kg}] stride (1, {m_pad})"


def check_big_smem(compiler: str | None = None) -> str:
    inp = torch.randn(64, 256, device="cuda")
    out = tma_copy(inp, 256, 64, 32, 32, "none", compiler=compiler, extra_smem=150 * 1024)
    if not torch.equal(out, _as_bytes(inp)):
        raise AssertionError("TMA copy with 150 KiB extra dynamic smem mismatch")
    return "dynamic smem ≈ 155 KiB"


def check_static_plus_dynamic_smem(compiler: str | None = None) -> str:
    """1 KiB static + exactly 48 KiB dynamic: over the un-opted 48 KiB in all, so the launch must raise the limit."""
    k = _kernel("static_dynamic_smem", STATIC_DYNAMIC_SMEM, compiler)
    words = 48 * 1024 // 4
    out = torch.full((2 * 256,), -1, dtype=torch.int32, device="cuda")
    k.launch((2, 1, 1), (256, 1, 1), [out, words], smem_bytes=4 * words)
    torch.cuda.synchronize()
    t = torch.arange(256, dtype=torch.int64)
    want = ((255 - t) + (words - 1 - t) * 256).to(torch.int32).repeat(2)
    if not torch.equal(out.cpu(), want):
        raise AssertionError("static + 48 KiB dynamic shared memory: wrong values")
    return "1 KiB static + 48 KiB dynamic"


def check_cluster(compiler: str | None = None) -> str:
    k = _kernel("cluster_ids", CLUSTER_IDS, compiler)
    res = []
    for cx in (2, 4):
        blocks = 16
        out = torch.full((blocks * 2,), -1, dtype=torch.int32, device="cuda")
        k.launch((blocks, 1, 1), (32, 1, 1), [out], cluster=(cx, 1, 1))
        torch.cuda.synchronize()
        got = out.view(blocks, 2).cpu()
        bx = torch.arange(blocks, dtype=torch.int32)
        if not (torch.equal(got[:, 0], bx % cx) and torch.equal(got[:, 1], bx // cx)):
            raise AssertionError(f"cluster ({cx},1,1): got rank/cluster ids {got.tolist()}")
        res.append(f"cluster {cx}")
    return ", ".join(res)


def check_graph_capture(compiler: str | None = None) -> str:
    k = _kernel("vadd_f32", VADD_F32, compiler)
    n = 4096
    a = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda")
    c = torch.zeros_like(a)
    k.launch((n // 256, 1, 1), (256, 1, 1), [a, b, c, n, 1.0])  # warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # captures on torch's side stream, which launch() picks up as current
        k.launch((n // 256, 1, 1), (256, 1, 1), [a, b, c, n, 3.0])
    a.copy_(torch.randn(n, device="cuda"))
    c.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(c, a + 3.0 * b)
    return "captured, replayed with new inputs"


def check_arg_validation(compiler: str | None = None) -> str:
    k = _kernel("vadd_f32", VADD_F32, compiler)
    a = torch.randn(16, device="cuda")
    cases: list[tuple[str, list[Any], type[Exception]]] = [
        ("too few", [a, a, a, 16], TypeError),
        ("cpu tensor", [a, a.cpu(), a, 16, 1.0], TypeError),
        ("overflow", [a, a, a, 1 << 32, 1.0], OverflowError),
        ("wrong size Arg", [a, a, a, Arg(16, "u64"), 1.0], TypeError),
    ]
    for what, args, exc in cases:
        try:
            k.launch((1, 1, 1), (32, 1, 1), args)
        except exc:
            continue
        raise AssertionError(f"launch with {what} args did not raise {exc.__name__}")
    if k.param_layout != ((0, 8), (8, 8), (16, 8), (24, 4), (28, 4)):
        raise AssertionError(f"unexpected param layout {k.param_layout}")
    return f"{len(cases)} bad calls rejected; layout {list(k.param_layout)}"


GPU_CHECKS: list[tuple[str, Callable[[str | None], str]]] = [
    ("vadd fp32 (extern C)", check_vadd_f32),
    ("vadd bf16 (template, mangled)", check_vadd_bf16),
    ("TMA copy, all swizzles", check_tma_cases),
    ("TMA col-major scales", check_tma_col_major_scale),
    ("dynamic smem > 48 KiB", check_big_smem),
    ("static + 48 KiB dynamic smem", check_static_plus_dynamic_smem),
    ("cluster launch", check_cluster),
    ("CUDA graph capture", check_graph_capture),
    ("argument validation", check_arg_validation),
]

# ---------------------------------------------------------------- timings


def _fresh_cache_compile(compiler: str) -> float:
    """Cold compile of the TMA kernel into an empty cache dir (in process); seconds."""
    with tempfile.TemporaryDirectory(prefix="moe_fp8_cold_") as d:
        old = os.environ.get("MOE_FP8_CACHE_DIR")
        os.environ["MOE_FP8_CACHE_DIR"] = d
        try:
            jit.clear_memory_cache()
            t0 = time.perf_counter()
            build("smoke_cold_tma_copy_2d", TMA_COPY, compiler=compiler)
            return time.perf_counter() - t0
        finally:
            jit.clear_memory_cache()
            if old is None:
                os.environ.pop("MOE_FP8_CACHE_DIR", None)
            else:
                os.environ["MOE_FP8_CACHE_DIR"] = old


def _warm_child(compiler: str) -> dict:
    """Run this script in a fresh process that times cache hits (keys + load + function lookup)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-warm", compiler]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"warm-load child failed (rc={res.returncode}):\n{res.stdout}\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def child_warm(compiler: str) -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        torch.zeros(1, device="cuda")  # create the context outside the timed region
    out: dict[str, float] = {}
    for label, name, src in (("first_ms", "tma_copy_2d", TMA_COPY), ("second_ms", "empty6", EMPTY6)):
        t0 = time.perf_counter()
        k = build(f"smoke_{name}", src, compiler=compiler)
        if gpu:
            k.function_handle()  # cuLibraryLoadData + cuLibraryGetKernel + cuKernelGetFunction
        out[label] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(out))


def _time_loop(fn: Callable[[], Any], n: int) -> float:
    for _ in range(min(n, 200)):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def launch_timings(n: int, compiler: str | None) -> dict[str, float]:
    from cuda.bindings import driver

    from moe_fp8.kernels.jit import clear_tma_cache, make_tma_2d

    k = _kernel("empty6", EMPTY6, compiler)
    a = torch.zeros(4096, device="cuda")
    b = torch.zeros(4096, device="cuda")
    x = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    desc = make_tma_2d(x, 256, 256, 64, 64, swizzle="128B")
    args = [desc, a, b, 4096, -3, 0.5]
    r: dict[str, float] = {}
    r["jit_launch_us"] = _time_loop(lambda: k.launch((1, 1, 1), (32, 1, 1), args), n)
    r["jit_launch_explicit_stream_us"] = _time_loop(
        lambda: k.launch((1, 1, 1), (32, 1, 1), args, stream=torch.cuda.current_stream()), n // 4)
    r["jit_launch_cluster2_us"] = _time_loop(
        lambda: k.launch((2, 1, 1), (32, 1, 1), args, cluster=(2, 1, 1)), n // 4)
    r["jit_launch_with_make_tma_us"] = _time_loop(
        lambda: k.launch((1, 1, 1), (32, 1, 1),
                         [make_tma_2d(x, 256, 256, 64, 64, swizzle="128B"), a, b, 4096, -3, 0.5]), n // 4)
    small = torch.zeros(16, device="cuda")
    r["torch_zero_us"] = _time_loop(small.zero_, n // 4)
    # cuda.bindings' own marshalling for comparison (what the ctypes buffer avoids)
    func = k.function_handle()
    stream = torch.cuda.current_stream().cuda_stream
    c_void_p, c_uint, c_int, c_float = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_float
    tmap = driver.CUtensorMap()
    ctypes.memmove(tmap.getPtr(), desc.address, 128)

    def tuple_launch() -> None:
        driver.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, stream,
                              ((tmap, a.data_ptr(), b.data_ptr(), 4096, -3, 0.5),
                               (None, c_void_p, c_void_p, c_uint, c_int, c_float)), 0)
    r["cuda_bindings_tuple_launch_us"] = _time_loop(tuple_launch, n // 4)
    r["make_tma_2d_cached_us"] = _time_loop(lambda: make_tma_2d(x, 256, 256, 64, 64, swizzle="128B"), n // 4)

    def encode() -> None:
        clear_tma_cache()
        make_tma_2d(x, 256, 256, 64, 64, swizzle="128B")
    r["make_tma_2d_encode_us"] = _time_loop(encode, 500)
    return r


# ---------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write results to this JSON file")
    ap.add_argument("--n-launch", type=int, default=10_000, help="eager launches to time")
    ap.add_argument("--compilers", default="nvcc,nvrtc", help="compilers to exercise (comma separated)")
    ap.add_argument("--compile-only", action="store_true", help="no GPU needed: compile checks and timings only")
    ap.add_argument("--cache-dir", type=Path,
                    help="JIT cache to use (default: a fresh temporary directory, removed at exit)")
    ap.add_argument("--child-warm", metavar="COMPILER", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_warm:
        child_warm(args.child_warm)
        return 0

    with tempfile.TemporaryDirectory(prefix="moe_fp8_smoke_") as tmp:
        # children (warm-load timing) inherit the cache through the environment
        os.environ["MOE_FP8_CACHE_DIR"] = str(args.cache_dir or tmp)
        return run(args)


def run(args: argparse.Namespace) -> int:
    """All checks and timings; returns the exit status."""
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []  # {"check", "compiler", "ok", "detail"}
    timings: list[dict[str, Any]] = []  # {"metric", "compiler", "value", "unit", "target"}
    infos = {c.name: c for c in jit.find_compilers()}
    compilers = []
    for name in [c.strip() for c in args.compilers.split(",") if c.strip()]:
        if infos.get(name) and infos[name].available:
            compilers.append(name)
        else:
            rows.append({"check": "compiler available", "compiler": name, "ok": None,
                         "detail": f"skipped: {infos[name].reason if name in infos else 'unknown compiler'}"})
    gpu_ok, why = jit.driver_available()
    gpu_ok = gpu_ok and torch.cuda.is_available()
    hopper = gpu_ok and torch.cuda.get_device_capability() == (9, 0)
    device = torch.cuda.get_device_name() if gpu_ok else "none"

    # all kernels compile with every compiler (fills the cache for the warm-load children)
    for comp in compilers:
        for name, src in (("vadd_f32", VADD_F32), ("vadd_bf16", VADD_BF16), ("tma_copy_2d", TMA_COPY),
                          ("cluster_ids", CLUSTER_IDS), ("empty6", EMPTY6)):
            try:
                k = _kernel(name, src, comp)
                rows.append({"check": f"compile {name}", "compiler": comp, "ok": True,
                             "detail": f"{k.ptxas.get('registers', '?')} regs, "
                                       f"spills {k.ptxas.get('spill_stores', 0)}/{k.ptxas.get('spill_loads', 0)}"})
            except Exception as e:
                rows.append({"check": f"compile {name}", "compiler": comp, "ok": False, "detail": str(e)[:300]})
        try:
            timings.append({"metric": "cold compile (TMA kernel, empty cache)", "compiler": comp,
                            "value": _fresh_cache_compile(comp), "unit": "s", "target": TARGET_COLD_COMPILE_S})
        except Exception as e:
            rows.append({"check": "cold compile", "compiler": comp, "ok": False, "detail": str(e)[:300]})

    if gpu_ok and hopper:
        for comp in compilers:
            for check_name, fn in GPU_CHECKS:
                try:
                    rows.append({"check": check_name, "compiler": comp, "ok": True, "detail": fn(comp)})
                except Exception as e:
                    traceback.print_exc()
                    rows.append({"check": check_name, "compiler": comp, "ok": False,
                                 "detail": f"{type(e).__name__}: {str(e)[:300]}"})
            try:
                w = _warm_child(comp)
                timings.append({"metric": "warm load, first variant in a fresh process", "compiler": comp,
                                "value": w["first_ms"], "unit": "ms", "target": TARGET_WARM_LOAD_MS})
                timings.append({"metric": "warm load, next variant", "compiler": comp,
                                "value": w["second_ms"], "unit": "ms", "target": TARGET_WARM_LOAD_MS})
            except Exception as e:
                rows.append({"check": "warm load child", "compiler": comp, "ok": False, "detail": str(e)[:500]})
        if compilers:
            try:
                for metric, v in launch_timings(args.n_launch, compilers[0]).items():
                    timings.append({"metric": metric, "compiler": compilers[0], "value": v, "unit": "us",
                                    "target": TARGET_LAUNCH_US if metric.startswith("jit_launch_us") else None})
            except Exception as e:
                traceback.print_exc()
                rows.append({"check": "launch timings", "compiler": compilers[0], "ok": False,
                             "detail": f"{type(e).__name__}: {str(e)[:300]}"})
    else:
        reason = why if not gpu_ok else f"needs sm_90 (Hopper), found {device}"
        rows.append({"check": "GPU checks", "compiler": "-", "ok": None, "detail": f"skipped: {reason}"})

    # ---- report
    print(f"\n## moe_fp8 JIT smoke — {device}, torch {torch.__version__}, {platform.node()}\n")
    print("| check | compiler | result | detail |\n|---|---|---|---|")
    for r in rows:
        status = "PASS" if r["ok"] else ("skip" if r["ok"] is None else "**FAIL**")
        print(f"| {r['check']} | {r['compiler']} | {status} | {r['detail']} |")
    print("\n| metric | compiler | value | target |\n|---|---|---|---|")
    for t in timings:
        tgt = f"≤ {t['target']:g} {t['unit']}" if t.get("target") else ""
        flag = " ⚠" if t.get("target") and t["value"] > t["target"] else ""
        print(f"| {t['metric']} | {t['compiler']} | {t['value']:.2f} {t['unit']}{flag} | {tgt} |")
    elapsed = time.perf_counter() - t_start
    print(f"\nwall time {elapsed:.1f} s; cache {jit.cache_dir()}; compilers: "
          + ", ".join(f"{c.name} {c.version or '-'} ({'ok' if c.available else c.reason})" for c in infos.values()))
    failed = [r for r in rows if r["ok"] is False]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": device, "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
            "compilers": [vars(c) for c in infos.values()], "checks": rows, "timings": timings,
            "failed": len(failed), "wall_s": elapsed,
        }, indent=1))
        print(f"wrote {args.json}")
    if failed:
        return 1
    if not (gpu_ok and hopper) and not args.compile_only:
        print("no Hopper GPU: only compile checks ran (use --compile-only to accept that)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
