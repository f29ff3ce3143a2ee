"""Host time per eager launch of the GEMM (tiny shape, so the GPU never limits), with a profile of
where it goes. DESIGN §7 budget: <= 10 us per launch."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import moe_fp8
from moe_fp8 import reference as ref
from moe_fp8.kernels.gemm import fp8_gemm_hopper

x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
x_fp8, x_scale = ref.per_token_group_quant(x)
w_fp8, w_scale = ref.per_block_quant(w)
out = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
for name, fn in [("kernel wrapper", lambda: fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)),
                 ("public moe_fp8.fp8_gemm", lambda: moe_fp8.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, out=out))]:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name}: {host:.1f} us host time per launch")
prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    moe_fp8.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale, out=out)
prof.disable()
pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
