"""A/B of the prefill's quantization + contiguous dispatch on the GPU: the fused Triton scatter
(``quant_dispatch_contiguous``: each token quantized in the scatter, its codes stored to every destination) against
two CUDA kernels (``per_token_group_quant`` on its Hopper backend, then ``dispatch_contiguous``'s row mover), checked
equal (codes, scales, ``m_indices``, ``row_map``), and a copy of the same bytes in the same process. CUDA-graph
replays, L2 flushed (``do_bench``), rounds alternated; µs and the copy's time over each. ``--knobs``: the fused
scatter under other launch configs too (``dispatch_config``'s knobs, e.g. ``block_t=2,block_k=4096,num_warps=8``).

    python3 scripts/ab_quant_dispatch.py [--tokens 512 2048 ...] [--hidden 7168] [--local 256 32] [--rounds 3]
        [--knobs block_k=2048 block_t=2,num_warps=8 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ab_quant import report, time_rounds  # (scripts/, on sys.path as the script's folder)

from moe_fp8 import backends
from moe_fp8.kernels import dispatch as cuda_dispatch
from moe_fp8.kernels.triton import dispatch as triton_dispatch
from moe_fp8.kernels.triton.configs import dispatch_config
from moe_fp8.utils import get_num_sms

NUM_EXPERTS = 256
TOP_K = 8


def two_kernels(x, ids, local, expert_map, return_x):
    x_fp8, x_scale = backends.select("per_token_group_quant", x.device)[1](x, 128, False, 1e-10)
    routed = cuda_dispatch.dispatch_contiguous_hopper(x_fp8, x_scale, ids, local, expert_map, 128, sync=False,
                                                      return_m_total=True)
    return (x_fp8, x_scale, *routed) if return_x else (None, None, *routed)


def fused(x, ids, local, expert_map, return_x, config=None):
    return triton_dispatch.quant_dispatch_contiguous(x, ids, local, expert_map, 128, sync=False, return_x=return_x,
                                                     return_m_total=True, config=config)


def differs(a, b) -> str | None:
    """Where two ``(x_fp8, x_scale, out, out_scale, m_indices, row_map, m_total)`` disagree (padding rows aside)."""
    if not torch.equal(a[4], b[4]) or not torch.equal(a[5], b[5]) or not torch.equal(a[6], b[6]):
        return "m_indices / row_map / M_total"
    rows = a[4] >= 0
    if not torch.equal(a[2][rows].view(torch.uint8), b[2][rows].view(torch.uint8)):
        return "codes"
    if not torch.equal(a[3][rows], b[3][rows]):
        return "scales"
    if a[0] is not None and not (torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                                 and torch.equal(a[1], b[1])):
        return "x_fp8 / x_scale"
    return None


def dispatch_inputs(tokens: int, hidden: int, local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(x bf16 [T, H], topk_ids int32 [T, TOP_K], expert_map)`` of rank 0 holding ``local`` of the NUM_EXPERTS
    (experts [0, local); no map when all are local), seeded by ``tokens``."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(tokens, NUM_EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=1).indices.int()
    expert_map = None
    if local < NUM_EXPERTS:
        expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32, device="cuda")
        expert_map[:local] = torch.arange(local, dtype=torch.int32, device="cuda")
    return x, ids, expert_map


def run_case(tokens: int, hidden: int, local: int, return_x: bool, rounds: int, knobs: list[str]) -> None:
    x, ids, expert_map = dispatch_inputs(tokens, hidden, local)
    cands = {"fused_triton": lambda: fused(x, ids, local, expert_map, return_x),
             "quant_then_mover": lambda: two_kernels(x, ids, local, expert_map, return_x)}
    for knob in knobs:
        kw = {k: int(v) for k, v in (item.split("=") for item in knob.split(","))}
        cfg = dispatch_config(tokens, TOP_K, hidden, local, has_map=expert_map is not None, quant=True, **kw)
        cands[f"fused {knob}"] = lambda cfg=cfg: fused(x, ids, local, expert_map, return_x, cfg)
    want = cands["fused_triton"]()
    problems = [f"{name}: {p}" for name, fn in cands.items() if (p := differs(want, fn()))]
    problem = "; ".join(problems) or None
    pairs = int((ids < local).sum())
    nbytes = tokens * hidden * 2 + pairs * (hidden + hidden // 32) + (tokens * hidden * 9 // 8 if return_x else 0)
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float16)  # the same bytes moved (read + write)
    dst = torch.empty_like(src)
    cands["copy"] = lambda: dst.copy_(src)
    times = time_rounds(cands, rounds)
    print(f"\n## {tokens} tokens x {hidden}, {local} of {NUM_EXPERTS} experts local ({pairs} pairs), return_x "
          f"{return_x}: {nbytes / 1e6:.1f} MB{'' if problem is None else f'; OUTPUTS DIFFER: {problem}'}")
    report(times, nbytes, 40)
    print(f"fused / two kernels: {min(times['fused_triton']) / min(times['quant_then_mover']):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--hidden", type=int, nargs="*", default=[7168])
    ap.add_argument("--local", type=int, nargs="*", default=[NUM_EXPERTS, 32], help="experts on the rank")
    ap.add_argument("--no-x", action="store_true", help="without the quantized input (no shared experts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--knobs", nargs="*", default=[], help="fused-scatter configs: k=v,k=v (dispatch_config)")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, {get_num_sms()} SMs, top-{TOP_K} of {NUM_EXPERTS}")
    for local in args.local:
        for hidden in args.hidden:
            for tokens in args.tokens:
                run_case(tokens, hidden, local, not args.no_x, args.rounds, args.knobs)


if __name__ == "__main__":
    main()
