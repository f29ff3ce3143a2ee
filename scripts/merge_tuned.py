"""Add a confirmed table's picks (``scripts/check_tuned.py --confirmed``) to a shipped one
(``moe_fp8/kernels/tuned/<device>.json``): only keys the shipped table does not hold yet, and only between tables
of the same device, SM count and kernel sources (a pick timed on other kernels means nothing for these).

    python scripts/merge_tuned.py SHIPPED.json CONFIRMED.json
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from moe_fp8.kernels import tuning


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shipped", type=Path)
    p.add_argument("confirmed", type=Path)
    args = p.parse_args()
    shipped, confirmed = tuning.TunedTable.load(args.shipped), tuning.TunedTable.load(args.confirmed)
    for what in ("device", "num_sms", "kernels"):
        if getattr(shipped, what) != getattr(confirmed, what):
            raise SystemExit(f"{what}: {getattr(confirmed, what)!r} in {args.confirmed}, {getattr(shipped, what)!r} "
                             f"in {args.shipped}")
    new = [r for key, r in confirmed.results.items() if key not in shipped.results]
    shipped.update(new)
    shipped.save(args.shipped)
    sets = Counter((r.key.layout, r.key.num_groups, r.key.n, r.key.k) for r in new)
    for (layout, groups, n, k), count in sorted(sets.items()):
        print(f"  {layout:<10} {groups:>3}g {n}x{k}: {count}")
    print(f"added {len(new)} of {len(confirmed.results)} picks ({len(confirmed.results) - len(new)} keys held "
          f"already); {args.shipped} holds {len(shipped.results)}")


if __name__ == "__main__":
    main()
