"""A/B of the chunked dispatch's routing on the GPU: the Triton count and scan kernels against ``route_pairs``
(impls/route_pairs.cuh, one launch), alone and inside the prefill's ``quant_dispatch_contiguous`` (no sync, the
quantized input returned, as the layer calls it), outputs checked equal. GPU µs as CUDA-graph replays after
do_bench's L2 flush, rounds alternated; host µs of an eager call with the GPU kept busy (as
scripts/host_overhead.py).

    python3 scripts/ab_route_pairs.py [--tokens 128 512 2048 ...] [--local 256 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ab_quant import time_rounds  # (scripts/, on sys.path as the script's folder)
from ab_quant_dispatch import NUM_EXPERTS, TOP_K, dispatch_inputs
from host_overhead import host_us

from moe_fp8.kernels import dispatch as cuda_dispatch
from moe_fp8.kernels.triton import dispatch as triton_dispatch
from moe_fp8.kernels.triton.configs import dispatch_config
from moe_fp8.utils import get_num_sms

HIDDEN = 7168
ROUTERS = {"triton": None, "route_pairs": cuda_dispatch.route_pairs}


def run_case(tokens: int, local: int, rounds: int) -> None:
    x, ids, emap = dispatch_inputs(tokens, HIDDEN, local)
    cfg = dispatch_config(tokens, TOP_K, HIDDEN, local, has_map=emap is not None, quant=True)
    routes = {f"routing {name}": (lambda r=r: triton_dispatch._route(ids, local, emap, 0, 128, None, cfg, r))
              for name, r in ROUTERS.items()}
    dispatches = {f"quant_dispatch {name}": (lambda r=r: triton_dispatch.quant_dispatch_contiguous(
        x, ids, local, emap, 128, sync=False, return_m_total=True, router=r)) for name, r in ROUTERS.items()}
    a, b = (fn() for fn in routes.values())
    same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("local", "base", "seg_start", "count", "status"))
    same = same and torch.equal(a.rank[a.local >= 0], b.rank[b.local >= 0])
    da, db = (fn() for fn in dispatches.values())
    rows = da[4] >= 0
    same = same and all(torch.equal(da[i], db[i]) for i in (4, 5, 6)) and torch.equal(
        da[2][rows].view(torch.uint8), db[2][rows].view(torch.uint8)) and torch.equal(da[3][rows], db[3][rows])
    cands = {**routes, **dispatches}
    times = time_rounds(cands, rounds)
    print(f"\n## {tokens} tokens, {local} of {NUM_EXPERTS} experts local ({tokens * TOP_K} pairs)"
          f"{'' if same else '; OUTPUTS DIFFER'}")
    print(f"{'':28s} {'GPU us':>8s}  rounds{'':14s} {'host us':>8s}")
    for name, fn in cands.items():
        ts = times[name]
        print(f"{name:28s} {min(ts):8.2f}  [{' '.join(f'{t:.2f}' for t in ts)}]  {host_us(fn, 100):8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[128, 512, 2048, 8192, 16384])
    ap.add_argument("--local", type=int, nargs="*", default=[NUM_EXPERTS, 32], help="experts on the rank")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, {get_num_sms()} SMs, top-{TOP_K} of {NUM_EXPERTS}, hidden {HIDDEN}")
    for local in args.local:
        for tokens in args.tokens:
            run_case(tokens, local, args.rounds)


if __name__ == "__main__":
    main()
