"""The few-rows GEMM (kernels/few_rows.py) against the wgmma kernel on decode batches, in one process.

GEMMs: a model rank's masked GEMMs with the rows ``tokens`` decode tokens route there (top-k of the global
experts, counted on the rank's local ones, seeded), ``fp8_grouped_gemm_masked`` with the path off and on timed
alternately (``bench_us``: L2 flushed, median), with the touched experts' weights read per µs; ``path`` says
which kernel it takes when on (``wgmma``: the same kernel both times). Layers: one forward of each token count captured in a
CUDA graph with the path off (``few_rows.MAX_ROWS = 0``, ``CHUNKED_MAX_EXPECTED = 0``) and on, the replays
timed alternately. Normal: the linears of decode batches (M = tokens), ``fp8_gemm_hopper`` against the few-rows
kernel. ``--chunked``: past 16 tokens the path on takes every small group's GEMM whatever its expected rows (the
chunked regime, to measure where it pays), once per ``--chunk-tiles`` value. ``--fused-waves``: each path on once
per value of ``few_rows.CHUNKED_FUSED_MAX_WAVES`` (where the fused gate-up GEMM takes the chunked regime too).
``--defines``: each path on (and the normal rows' few-rows kernel) once per ``$MOE_FP8_GEMM_DEFINES`` value, the
kernel's measurement switches (``""``: as shipped), each value's kernels built and cached apart. ``--narrow``: the
same per value of ``few_rows.NARROW_MAX_EXPECTED`` (groups of 9-16 rows in chunks of one token tile).

    python scripts/ab_few_rows.py [--tokens 1 2 4 8 16] [--rounds 3] [--parts gemms layers normal]
                                  [--ranks NAME ...] [--chunked] [--chunk-tiles 1 2] [--fused-waves none 2.5 0]
                                  [--defines "" "MOE_FP8_FEW_ROWS_UNROLL_2T=2"] [--narrow 0 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from moe_fp8.benchmarks.harness import alternated_us
from moe_fp8.benchmarks.moe import build_model_layer, capture_forward
from moe_fp8.kernels import few_rows
from moe_fp8.kernels.gemm import ENV_DEFINES, fp8_grouped_gemm_masked_hopper
from moe_fp8.testing import make_masked_inputs
from moe_fp8.utils import ceil_div
from moe_fp8.warmup import model_gemms

MODELS = Path(__file__).resolve().parent / "models"
# (name, config, ep, tp): DeepSeek-V3 and Kimi-K2 at EP 8 and TP 8, Qwen3-235B-A22B at EP 8 (the default set);
# --ranks also takes Qwen3-30B-A3B, GLM-4.5 and MiniMax-M2 at EP 8
RANKS = [("DeepSeek-V3 EP8", "deepseek-v3.json", 8, 1), ("Kimi-K2 EP8", "kimi-k2.json", 8, 1),
         ("DeepSeek-V3 TP8", "deepseek-v3.json", 1, 8), ("Qwen3-235B EP8", "qwen3-235b-a22b.json", 8, 1)]
MORE_RANKS = [("Qwen3-30B EP8", "qwen3-30b-a3b.json", 8, 1), ("GLM-4.5 EP8", "glm-4.5.json", 8, 1),
              ("MiniMax-M2 EP8", "minimax-m2.json", 8, 1)]


def rank_shapes(cfg: dict, ep: int, tp: int) -> tuple[int, int, int, int, int]:
    """(global experts, local experts, top-k, hidden, intermediate per rank), from the rank's expert GEMMs as
    ``moe-fp8 warmup`` derives them."""
    w13 = next(g for g in model_gemms(cfg, tp=tp, ep=ep) if g.name == "experts.w13")
    return w13.num_groups * ep, w13.num_groups, int(cfg["num_experts_per_tok"]), w13.k, w13.n // 2


def counts(tokens: int, experts: int, local: int, top_k: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    hits = torch.zeros(experts, dtype=torch.int64)
    for _ in range(tokens):
        hits[torch.randperm(experts, generator=gen)[:top_k]] += 1
    return hits[:local].tolist()


# few_rows.MAX_ROWS, CHUNKED_MAX_EXPECTED, CHUNK_TOKEN_TILES, CHUNKED_FUSED_MAX_WAVES, $MOE_FP8_GEMM_DEFINES,
# NARROW_MAX_EXPECTED
Setting = tuple[int, int, int, float | None, str, int]
SHIPPED: Setting = (few_rows.MAX_ROWS, few_rows.CHUNKED_MAX_EXPECTED, few_rows.CHUNK_TOKEN_TILES,
                    few_rows.CHUNKED_FUSED_MAX_WAVES, os.environ.get(ENV_DEFINES, ""), few_rows.NARROW_MAX_EXPECTED)
OFF: Setting = (0, 0, few_rows.CHUNK_TOKEN_TILES, few_rows.CHUNKED_FUSED_MAX_WAVES, *SHIPPED[4:])
ON: dict[str, Setting] = {"on": SHIPPED}  # the path's settings timed against OFF (main() may change them)
_PLANS: dict[str, Callable] = {}  # few_rows._launch_plan of each defines value: kernels built under it, cached apart


def set_path(setting: Setting) -> None:
    few_rows.MAX_ROWS, few_rows.CHUNKED_MAX_EXPECTED, few_rows.CHUNK_TOKEN_TILES, few_rows.CHUNKED_FUSED_MAX_WAVES = setting[:4]
    few_rows.NARROW_MAX_EXPECTED = setting[5]
    os.environ[ENV_DEFINES] = setting[4]  # read when a plan builds its kernel (once per shape and value)
    if setting[4] not in _PLANS:
        _PLANS[setting[4]] = functools.cache(few_rows._launch_plan.__wrapped__)
    few_rows._launch_plan = _PLANS[setting[4]]


def with_path(setting: Setting, call: Callable[[], None]) -> None:
    """``call()`` under the few-rows path's ``setting``."""
    set_path(setting)
    call()


def gemm_rows(rounds: int, token_counts: list[int]) -> None:
    ons = "".join(f" {label + ' us':>9} {'x':>5} {'TB/s':>5}" for label in ON)
    print(f"{'rank':>16} {'N x K':>12} {'tokens':>6} {'exp':>3} {'max':>3} {'touched':>7} {'path':>5} {'off us':>8} "
          f"{'TB/s':>5}{ons}")
    for name, file, ep, tp in RANKS:
        experts, local, top_k, hidden, inter = rank_shapes(json.loads((MODELS / file).read_text()), ep, tp)
        for n, k in ((2 * inter, hidden), (hidden, inter)):
            for tokens in token_counts:
                rows = counts(tokens, experts, local, top_k, seed=tokens)
                inp = make_masked_inputs(local, tokens, 1, n, k, seed=tokens, device="cuda", masked_m=rows)
                out = torch.empty((local, tokens, n), dtype=torch.bfloat16, device="cuda")
                expected = max(1, ceil_div(tokens * top_k, experts))  # as the layer's hint
                call = partial(fp8_grouped_gemm_masked_hopper, inp.x_fp8, inp.x_scale, inp.w_fp8, inp.w_scale,
                               inp.masked_m, expected, out)
                times = alternated_us([partial(with_path, s, call) for s in (OFF, *ON.values())], rounds)
                touched = sum(r > 0 for r in rows)
                mb = touched * n * k / 1e6
                set_path(SHIPPED)
                path = "few" if few_rows.applies(tokens, n, k, local, expected) else "wgmma"  # as shipped
                cols = "".join(f" {t:9.1f} {times[0] / t:5.2f} {mb / t:5.2f}" for t in times[1:])
                print(f"{name:>16} {n:>5}x{k:<6} {tokens:>6} {expected:>3} {max(rows):>3} {touched:>7} {path:>5} "
                      f"{times[0]:8.1f} {mb / times[0]:5.2f}{cols}", flush=True)
    set_path(SHIPPED)


def normal_rows(rounds: int, token_counts: list[int]) -> None:
    """DeepSeek-V3's linears at TP 1 and TP 8 (and Qwen3-235B-A22B's attention at TP 4) at M = decode tokens:
    the wgmma kernel with the config ``get_config`` picks (this GPU's tuned table included) against the few-rows
    kernel, and which of them ``fp8_gemm`` takes."""
    from moe_fp8.kernels.gemm import fp8_gemm_hopper
    from moe_fp8.kernels.heuristics import GemmDesc, get_config
    from moe_fp8.utils import get_num_sms

    shapes: dict[tuple[int, int], str] = {}
    for file, tp in (("deepseek-v3.json", 1), ("deepseek-v3.json", 8), ("qwen3-235b-a22b.json", 4)):
        for g in model_gemms(json.loads((MODELS / file).read_text()), tp=tp):
            if "normal" in g.layouts:
                shapes.setdefault((g.n, g.k), f"{g.name} tp{tp}")
    settings = {label: s for label, s in ON.items() if label != "on"} or {"few": SHIPPED}
    cols = "".join(f" {label + ' us':>9} {'x':>6} {'TB/s':>5}" for label in settings)
    print(f"{'linear':>36} {'N x K':>12} {'M':>3} {'wgmma us':>9}{cols} {'takes':>5}")
    for (n, k), name in shapes.items():
        for m in token_counts:
            inp = make_masked_inputs(1, m, 1, n, k, seed=m, device="cuda", masked_m=[m])
            x, xs, w, ws = inp.x_fp8[0], inp.x_scale[0], inp.w_fp8[0], inp.w_scale[0]
            out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            cfg = get_config(GemmDesc(m, n, k, num_sms=get_num_sms()))
            few = partial(few_rows.launch, x, xs, w, ws, out, None)
            off_us, *on_us = alternated_us([partial(fp8_gemm_hopper, x, xs, w, ws, out, config=cfg)]
                                           + [partial(with_path, s, few) for s in settings.values()], rounds)
            set_path(SHIPPED)
            takes = "few" if few_rows.applies_normal(m, n, k) else "wgmma"
            cols = "".join(f" {t:9.1f} {off_us / t:6.2f} {n * k / 1e6 / t:5.2f}" for t in on_us)
            print(f"{name:>36} {n:>5}x{k:<6} {m:>3} {off_us:9.1f}{cols} {takes:>5}", flush=True)


def layer_rows(rounds: int, token_counts: list[int], shared: bool = False) -> None:
    print(f"{'rank':>16} {'tokens':>6} {'off us':>8}" + "".join(f" {label + ' us':>9} {'x':>5}" for label in ON))
    for name, file, ep, tp in RANKS:
        cfg = json.loads((MODELS / file).read_text())
        with_shared = shared and bool(cfg.get("n_shared_experts"))
        layer, _ = build_model_layer(cfg, ep, tp=tp, shared=with_shared)
        name += " +shared" if with_shared else ""
        for tokens in token_counts:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            hidden = torch.randn(tokens, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(tokens, layer.num_experts, device="cuda", dtype=torch.float32, generator=gen)
            graphs = []
            for setting in (OFF, *ON.values()):
                set_path(setting)
                graphs.append(capture_forward(layer, hidden, logits, "masked"))
            set_path(SHIPPED)
            times = alternated_us([g.replay for g in graphs], rounds)
            print(f"{name:>16} {tokens:>6} {times[0]:8.1f}" + "".join(f" {t:9.1f} {times[0] / t:5.2f}" for t in times[1:]),
                  flush=True)
        del layer, graphs
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", nargs="+", choices=("gemms", "layers", "normal"), default=["gemms", "layers"])
    p.add_argument("--ctas-per-sm", type=int, default=few_rows.CTAS_PER_SM, help="the few-rows kernel's grid")
    p.add_argument("--ranks", nargs="+", choices=[r[0] for r in RANKS + MORE_RANKS],
                   help="these ranks (default: the first four)")
    p.add_argument("--chunked", action="store_true", help="the path on takes small groups whatever their expected rows")
    p.add_argument("--chunk-tiles", type=int, nargs="+", choices=(1, 2), default=[few_rows.CHUNK_TOKEN_TILES])
    p.add_argument("--fused-waves", nargs="+", type=lambda v: None if v == "none" else float(v),
                   help="each path on once per value of few_rows.CHUNKED_FUSED_MAX_WAVES ('none': the fused gate-up "
                        "GEMM chunked wherever the unfused one is; 0: never)")
    p.add_argument("--wide-max-rows", type=int, default=few_rows.WIDE_MAX_ROWS,
                   help="few_rows.WIDE_MAX_ROWS (rows of groups of over SMALL_GROUP_BYTES) wherever the path is on")
    p.add_argument("--shared", action="store_true", help="the layers with their shared experts (if the model has them)")
    p.add_argument("--defines", nargs="+", help="each path on once per $MOE_FP8_GEMM_DEFINES value ('': as shipped)")
    p.add_argument("--narrow", nargs="+", type=int,
                   help="each path on once per few_rows.NARROW_MAX_EXPECTED value (0: two token tiles at 9-16 rows)")
    args = p.parse_args()
    few_rows.CTAS_PER_SM, few_rows.WIDE_MAX_ROWS = args.ctas_per_sm, args.wide_max_rows
    if args.ranks:
        RANKS[:] = [r for r in RANKS + MORE_RANKS if r[0] in args.ranks]
    if args.chunked or args.chunk_tiles != [few_rows.CHUNK_TOKEN_TILES]:
        ON.clear()
        chunked = 1 << 30 if args.chunked else few_rows.CHUNKED_MAX_EXPECTED
        ON.update({f"t{t}": (few_rows.MAX_ROWS, chunked, t, few_rows.CHUNKED_FUSED_MAX_WAVES, *SHIPPED[4:])
                   for t in args.chunk_tiles})
    if args.fused_waves:
        base = dict(ON)
        ON.clear()
        ON.update({f"{label} w{waves}": (*setting[:3], waves, *setting[4:]) for label, setting in base.items()
                   for waves in args.fused_waves})
    if args.defines:
        base = dict(ON)
        ON.clear()
        ON.update({f"{label} {d or 'shipped'}" if len(base) > 1 else d or "shipped": (*setting[:4], d, setting[5])
                   for label, setting in base.items() for d in args.defines})
    if args.narrow:
        base = dict(ON)
        ON.clear()
        ON.update({f"{label} n{v}" if len(base) > 1 else f"narrow {v}": (*setting[:5], v)
                   for label, setting in base.items() for v in args.narrow})
    print(f"device: {torch.cuda.get_device_name()}")
    for part in args.parts:
        if part == "layers":
            layer_rows(args.rounds, args.tokens, args.shared)
        else:
            {"gemms": gemm_rows, "normal": normal_rows}[part](args.rounds, args.tokens)


if __name__ == "__main__":
    main()
