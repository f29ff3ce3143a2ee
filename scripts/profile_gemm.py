"""Run one GEMM a few times, for a profiler to catch (``ncu -k regex:fp8_gemm ...``).

    python scripts/profile_gemm.py --shape 4096,7168,16384 [--impl ours|torch_blockwise] [--block 128x128b]
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8 import reference as ref
from moe_fp8.benchmarks.gemm import parse_block
from moe_fp8.kernels.gemm import fp8_gemm_hopper
from moe_fp8.kernels.heuristics import make_config
from moe_fp8.utils import get_num_sms

p = argparse.ArgumentParser()
p.add_argument("--shape", required=True)
p.add_argument("--impl", default="ours", choices=("ours", "torch_blockwise"))
p.add_argument("--block", default=None, help="BMxBN[a|b][kK][sS] (default: the heuristic's)")
p.add_argument("--iters", type=int, default=3)
args = p.parse_args()
m, n, k = (int(v) for v in args.shape.split(","))
x_fp8, x_scale = ref.per_token_group_quant(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
w_fp8, w_scale = ref.per_block_quant(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
cfg = None
if args.block:
    bm, bn, mc, on_a, st, sk = parse_block(args.block)
    cfg = make_config(bm, bn, get_num_sms(), k=k, num_stages=st, multicast=mc, multicast_on_a=on_a, split_k=sk)
x_scale_cm = x_scale.t().contiguous().t()
for _ in range(args.iters):
    if args.impl == "ours":
        fp8_gemm_hopper(x_fp8, x_scale, w_fp8, w_scale, out, config=cfg)
    else:
        torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale_cm, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
torch.cuda.synchronize()
print("done", args)
