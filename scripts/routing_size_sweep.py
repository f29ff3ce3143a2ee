"""Routing against a copy of the same bytes, and against a read-only torch kernel of the same logits, over a range of
token counts (DeepSeek-V3: 256 experts, top-8 of 4 of 8 groups, bias; the ``moe-data`` bench's inputs), in one process.

Per token count: ``bench_us`` (do_bench, L2 flushed by a 256 MB memset) of routing, the copy and ``logits.amax(1)``
(reads the logits, writes a float a token: what a kernel that only reads routing's input reaches under the same
flush), eager and as CUDA-graph replays, rounds alternated, the minimum of the rounds; then the GPU span of one call
after the dirty and the clean flush (``flushed_spans_us``). ``ratio``: the copy's time / routing's (the bench's
``x torch_copy``); ``marginal``: the same for the time each adds from one token count to the next, which leaves out
what every call pays once (launch, first loads, the last ones' tail).

    python scripts/routing_size_sweep.py [--tokens 4096 8192 ...] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from moe_fp8.benchmarks.harness import bench_us, flushed_spans_us
from moe_fp8.benchmarks.moe_data import DSV3, _graph_replay, _routing_kwargs
from moe_fp8.layers import select_experts
from moe_fp8.testing import make_routing_inputs

IMPLS = ("routing", "copy", "amax")


def marginal(now: dict, before: dict, ours: str) -> float:
    """The time the copy adds from one token count to the next, over the time ``ours`` adds."""
    return (now["copy"] - before["copy"]) / (now[ours] - before[ours])


def impls(t: int) -> tuple[dict, int]:
    """The three calls at ``t`` tokens and routing's bytes (the bench's: logits read, weights and ids written)."""
    logits, bias = make_routing_inputs(t, DSV3.experts, seed=t, device="cuda", with_bias=True)
    kw = _routing_kwargs(DSV3)
    nbytes = t * DSV3.experts * 4 + t * DSV3.top_k * 8
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return {"routing": lambda: select_experts(logits, DSV3.top_k, e_score_correction_bias=bias, **kw),
            "copy": lambda: dst.copy_(src),
            "amax": lambda: logits.amax(1)}, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; do_bench us, min of {args.rounds} alternated rounds; "
          "span: GPU us after the dirty / clean flush")
    rows = []
    for t in args.tokens:
        fns, nbytes = impls(t)
        graphs = {n: _graph_replay(fn) for n, fn in fns.items()}
        eager = {n: [] for n in IMPLS}
        replay = {n: [] for n in IMPLS}
        for _ in range(args.rounds):
            for n in IMPLS:
                eager[n].append(bench_us(fns[n]))
                replay[n].append(bench_us(graphs[n]))
        spans = {n: flushed_spans_us(fns[n]) for n in IMPLS}
        e, r = ({n: min(v) for n, v in times.items()} for times in (eager, replay))  # min of the rounds
        rows.append((t, nbytes, e, r))
        print(f"{t:7d} tokens {nbytes / 1e6:6.1f} MB | eager " + "  ".join(f"{n} {e[n]:7.2f}" for n in IMPLS)
              + " | replay " + "  ".join(f"{n} {r[n]:7.2f}" for n in IMPLS)
              + " | span " + "  ".join(f"{n} {spans[n][0]:.2f}/{spans[n][1]:.2f}" for n in IMPLS), flush=True)
    print("\n| tokens | MB | copy GB/s | routing / copy (eager, replay) | amax / copy (eager) | amax's time / routing's (eager) "
          "| marginal routing / copy (eager, replay) | marginal amax / copy |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (t, nbytes, e, r) in enumerate(rows):
        marg = "— | —"
        if i:
            _, _, pe, pr = rows[i - 1]
            marg = (f"{marginal(e, pe, 'routing'):.3f}, {marginal(r, pr, 'routing'):.3f} | "
                    f"{marginal(e, pe, 'amax'):.3f}")
        print(f"| {t} | {nbytes / 1e6:.1f} | {nbytes / e['copy'] / 1e3:.0f} | {e['copy'] / e['routing']:.3f}, "
              f"{r['copy'] / r['routing']:.3f} | {e['copy'] / e['amax']:.3f} | {e['amax'] / e['routing']:.3f} | {marg} |")


if __name__ == "__main__":
    main()
