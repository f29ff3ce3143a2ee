"""Re-time a tuned table's picks against the cost model's, DeepGEMM's way and do_bench's (benchmarks.harness),
in one process: the independent check of what `moe-fp8 tune` kept (it timed them with CUDA events after an L2
flush). One line per key whose pick differs from the default. ``--confirmed OUT`` writes the picks that both
re-timings found at least as fast as the default: what moe_fp8 ships for this device (moe_fp8/kernels/tuned/).

    python scripts/check_tuned.py TABLE.json [--all] [--confirmed OUT.json] [--except-in OLD.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from moe_fp8.benchmarks.harness import bench_chilled_us, bench_us
from moe_fp8.benchmarks.report import geomean
from moe_fp8.kernels import tuning


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("table")
    p.add_argument("--all", action="store_true", help="also the keys where the default was kept")
    p.add_argument("--confirmed", type=Path, help="write the picks both re-timings confirm as a table here")
    p.add_argument("--except-in", type=Path, metavar="OLD", help="skip the keys this table holds (checked before)")
    args = p.parse_args()
    table = tuning.TunedTable.load(args.table)
    if table.device != torch.cuda.get_device_name():
        raise SystemExit(f"{args.table} is {table.device}'s, this is {torch.cuda.get_device_name()}")
    device = torch.device("cuda", torch.cuda.current_device())
    ratios: dict[str, list[float]] = {"chilled": [], "do_bench": []}
    confirmed = dataclasses.replace(table, results={})
    print(f"{'key':<60} {'default':<14} {'tuned':<14} {'chilled us':>17} {'do_bench us':>17}  x chilled / do_bench")
    skip = set(tuning.TunedTable.load(args.except_in).results) if args.except_in else set()
    for r in table.results.values():
        if (r.config == r.default and not args.all) or r.key in skip:
            continue
        run = tuning.make_runner(r.key, device)
        chilled = [bench_chilled_us(lambda c=c, run=run: run(c)) for c in (r.default, r.config)]
        plain = [bench_us(lambda c=c, run=run: run(c)) for c in (r.default, r.config)]
        x = chilled[0] / chilled[1], plain[0] / plain[1]
        ratios["chilled"].append(x[0])
        ratios["do_bench"].append(x[1])
        if r.config != r.default and min(x) >= 1.0:
            confirmed.results[r.key] = r
        k = r.key
        name = f"{k.layout} m{k.m} {k.num_groups}g {k.n}x{k.k}" + (f" e{k.expected_m}" if k.expected_m else "")
        tile = [f"{c.block_m}x{c.block_n}s{c.num_stages}" for c in (r.default, r.config)]
        print(f"{name:<60} {tile[0]:<14} {tile[1]:<14} {chilled[0]:8.1f} {chilled[1]:8.1f} {plain[0]:8.1f} "
              f"{plain[1]:8.1f}  {x[0]:.3f} / {x[1]:.3f}")
    for what, xs in ratios.items():
        if xs:
            print(f"{what}: geomean {geomean(xs):.3f} over {len(xs)} keys, {sum(v < 1 for v in xs)} slower than the default")
    if args.confirmed:
        confirmed.save(args.confirmed)
        print(f"confirmed: {len(confirmed.results)} picks written to {args.confirmed}")


if __name__ == "__main__":
    main()
