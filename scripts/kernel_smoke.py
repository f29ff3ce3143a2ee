"""Quick first check of the Hopper GEMM on a few shapes (prints diff and timing); exits non-zero
on a mismatch. Used before the full GPU suite so a broken kernel fails fast."""

from __future__ import annotations

import sys
import time

import torch

from moe_fp8 import reference as ref
from moe_fp8.kernels.gemm import fp8_gemm_hopper
from moe_fp8.utils import calc_diff

ok = True
for m, n, k in [(128, 256, 128), (64, 2112, 576), (300, 7168, 2048), (4096, 7168, 16384)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = ref.per_token_group_quant(x)
    w_fp8, w_scale = ref.per_block_quant(w)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    expect = ref.fp8_gemm(x_fp8, x_scale, w_fp8, w_scale)
    nan = int(out.isnan().sum())
    diff = calc_diff(out, expect) if not nan else float("nan")
    good = nan == 0 and diff < 1e-5
    ok &= good
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out)
    ev[1].record()
    torch.cuda.synchronize()
    us = ev[0].elapsed_time(ev[1]) / 20 * 1e3
    print(f"{m}x{n}x{k}: nan={nan} diff={diff:.2e} first_call={first:.2f}s {us:.1f}us "
          f"{2 * m * n * k / us / 1e6:.0f}TF {'OK' if good else 'FAIL'}", flush=True)
sys.exit(0 if ok else 1)
