"""GPU sweep of explicit block shapes for the normal FP8 GEMM (the heuristic's calibration data).

    python scripts/sweep_gemm.py --compile-only [--jobs 16]     # precompile every variant (no GPU needed)
    python scripts/sweep_gemm.py [--shapes N,K ...] [--rows 256 512 ...] [--blocks 128x144s5 64x96 ...]
        [--rounds 3] [--top 4]

For every (N, K) and row count: each block shape once (do_bench, L2 flushed; outputs checked against the
float32 product first), then the heuristic's pick, the ``--top`` fastest others and torch's block-scaled
``_scaled_mm`` in ``--rounds`` alternated rounds. One JSON line per shape: ``heuristic``, ``first`` (µs of
every block once) and ``median`` (µs over the rounds). Session 45's mid-M sweep (docs/kernels/gemm.md) ran
the defaults of then, without 128x96 and 64x72 / 80 / 88 (session 47's additions); raw outputs are kept in
docs/benchmarks/calibration/.
"""

from __future__ import annotations

import argparse
import json
import statistics

from moe_fp8.benchmarks import parse_ints
from moe_fp8.benchmarks.gemm import parse_block
from moe_fp8.benchmarks.shapes import GEMM_NK

# DeepSeek-V3's linears beyond the bench's table: q_a_proj and kv_a_proj_with_mqa unfused, the dense MLP
MID_M_NK = [(1536, 7168), (576, 7168), (36864, 7168), (7168, 18432)]
ROWS = [256, 384, 512, 640, 768, 1024, 1280, 1536, 2048]
BLOCKS = ([f"128x{bn}s{st}" for bn in (64, 96, 128, 144, 160) for st in (4, "")] + ["128x192", "128x256"]
          + [f"64x{bn}" for bn in (64, 72, 80, 88, 96, 112, 128, 144, 160, 192, 256)])
SMS = 132  # the H100 SXM the tables were measured on; --compile-only needs no GPU to know it


def _nk(text: str) -> tuple[int, ...]:
    try:
        return parse_ints(text, 2, "N,K")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _configs(n: int, k: int, blocks, rows: list[int]) -> dict:
    """``tag -> GemmConfig``: the blocks that fit (N, K), and the heuristic's pick at every row count."""
    from moe_fp8.kernels.heuristics import GemmDesc, get_config, make_config

    out = {}
    for bm, bn, multicast, on_a, stages, split_k in blocks:
        if bn - 8 >= n:  # only zero columns past N
            continue
        try:
            c = make_config(bm, bn, SMS, k=k, num_stages=stages, multicast=multicast, multicast_on_a=on_a,
                            split_k=split_k)
        except ValueError:
            continue
        out[_tag(c)] = c
    for m in rows:
        c = get_config(GemmDesc(m, n, k, num_sms=SMS))
        out[_tag(c)] = c
    return out


def _tag(c) -> str:
    extra = ("" if c.multicast == 1 else "a" if c.multicast_on_a else "b") + ("" if c.split_k == 1 else f"k{c.split_k}")
    return f"{c.block_m}x{c.block_n}{extra}s{c.num_stages}"


def compile_only(args: argparse.Namespace) -> None:
    from moe_fp8.kernels.gemm import kernel_variant
    from moe_fp8.kernels.heuristics import GemmDesc
    from moe_fp8.warmup import Variant, compile_variants

    variants = {}
    for n, k in args.shapes:
        for c in _configs(n, k, args.blocks, args.rows).values():
            name, source = kernel_variant(GemmDesc(args.rows[0], n, k, num_sms=SMS), c)
            variants[name] = Variant(name, source, "normal", n, k, c)
    print(compile_variants(list(variants.values()), jobs=args.jobs))


def _time_shape(m: int, n: int, k: int, configs: dict, args: argparse.Namespace) -> dict:
    import torch

    from moe_fp8.benchmarks.gemm import impls, make_inputs
    from moe_fp8.benchmarks.harness import bench_us
    from moe_fp8.kernels.gemm import fp8_gemm_hopper
    from moe_fp8.kernels.heuristics import GemmDesc, get_config
    from moe_fp8.utils import calc_diff, get_num_sms

    inp = make_inputs(m, n, k)
    operands = (inp["x_fp8"], inp["x_scale"], inp["w_fp8"], inp["w_scale"])
    want = inp["x"].float() @ inp["w"].float().t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fns = {"torch_blockwise": impls(inp, out)["torch_blockwise"]}
    wrong = {}
    for tag, c in configs.items():
        out.fill_(float("nan"))  # unwritten rows show
        fp8_gemm_hopper(*operands, out, config=c)
        diff = calc_diff(out.float(), want)
        if not diff < 1e-3:
            wrong[tag] = diff
            continue
        fns[tag] = lambda c=c: fp8_gemm_hopper(*operands, out, config=c)
    first = {tag: bench_us(fn, 10, 40) for tag, fn in fns.items()}
    heuristic = _tag(get_config(GemmDesc(m, n, k, num_sms=get_num_sms())))
    fastest = sorted((us, tag) for tag, us in first.items() if tag != "torch_blockwise")
    runs = {tag: [] for tag in dict.fromkeys(["torch_blockwise", heuristic, *(t for _, t in fastest[:args.top])])
            if tag in fns}
    for _ in range(args.rounds):
        for tag in runs:
            runs[tag].append(bench_us(fns[tag], 10, 60))
    return {"m": m, "n": n, "k": k, "heuristic": heuristic, "wrong": wrong,
            "median": {tag: round(statistics.median(v), 2) for tag, v in runs.items()},
            "first": {tag: round(us, 2) for tag, us in first.items()}}


def sweep(args: argparse.Namespace) -> None:
    from moe_fp8.utils import get_num_sms

    if get_num_sms() != SMS:
        print(f"note: {get_num_sms()} SMs, the configs are built for {SMS}")
    for n, k in args.shapes:
        configs = _configs(n, k, args.blocks, args.rows)
        for m in args.rows:
            print(json.dumps(_time_shape(m, n, k, configs, args)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=_nk, default=[*GEMM_NK, *MID_M_NK], metavar="N,K")
    p.add_argument("--rows", nargs="+", type=int, default=ROWS)
    p.add_argument("--blocks", nargs="+", type=parse_block, default=[parse_block(b) for b in BLOCKS])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--top", type=int, default=4, help="fastest blocks of the first pass timed again")
    p.add_argument("--compile-only", action="store_true", help="precompile every variant (no GPU needed)")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (--compile-only)")
    args = p.parse_args()
    compile_only(args) if args.compile_only else sweep(args)


if __name__ == "__main__":
    main()
