"""Turn the archive of one `scripts/gpu_check.sh` run into the committed records in docs/benchmarks/.

    python scripts/record_gpu_check.py RUN_DIR --commit SHA [--no-plots]

RUN_DIR is the unpacked `gpu_check/` folder. Writes `<device>-<kind>.{json,md,png}` for each bench kind
the run contains (gemm, grouped, moe-data, moe; the PNG is `moe-fp8 bench plot` of the record, linked
from the .md; `--no-plots` skips it, matplotlib is needed otherwise) and `<device>-gpu-check.md`
(environment, GPU test summary, JIT timings), each naming the commit and device measured.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks"


sys.path.insert(0, str(REPO))  # benchmarks/report.py: pure Python, no install needed
from benchmarks.report import device_slug  # noqa: E402


def _device(run: Path) -> str:
    for line in (run / "info.txt").read_text().splitlines():
        if line.startswith("NVIDIA") or line.startswith("AMD"):
            return line.split(",")[0].strip()
    raise SystemExit("info.txt names no device")


def _strip_progress(text: str) -> str:
    """The bench's table text without its progress lines and the profiler's warning (printed to stderr)."""
    noise = re.compile(r"^\[\d+/\d+\] |^\S*profiler\.py:\d+: UserWarning|^\s+_warn_once\(")
    return "\n".join(ln for ln in text.splitlines() if not noise.match(ln)).strip() + "\n"


def _header(title: str, device: str, commit: str, date: str, command: str, timing: str = "") -> str:
    return f"# {title}\n\n- device: {device}\n- commit: `{commit}`\n- date: {date}\n- command: `{command}`{timing}\n\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    p.add_argument("--commit", required=True)
    p.add_argument("--no-plots", action="store_true", help="do not (re)draw <device>-<kind>.png")
    p.add_argument("--docs", type=Path, default=DOCS, help=argparse.SUPPRESS)  # tests write elsewhere
    args = p.parse_args(argv)
    run, commit, docs = args.run, args.commit, args.docs
    plot_record = None
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401  (plot_record imports it only when drawing)

            from moe_fp8.benchmarks.plot import plot_record
        except ImportError as e:
            raise SystemExit(f"plots need moe_fp8 and matplotlib ({e}): pip install -e '.[plots]', "
                             "or pass --no-plots") from None
    device = _device(run)
    slug = device_slug(device)  # as the benches name their records
    docs.mkdir(parents=True, exist_ok=True)
    date = "unknown"
    titles = {"gemm": "FP8 block-scaled GEMM", "grouped": "Grouped FP8 GEMMs (contiguous, masked)",
              "moe-data": "MoE data path (quant, SiLU·mul+quant, router GEMM, routing, dispatch, combine)",
              "moe": "DeepSeek-V3 MoE layer (one expert-parallel rank of 8)"}
    for kind, title in titles.items():
        src = run / f"{slug}-{kind}.json"
        if not src.exists():
            continue
        record = json.loads(src.read_text())
        record["commit"] = commit
        date = record["date"]
        (docs / src.name).write_text(json.dumps(record, indent=1) + "\n")
        figure = ""
        if plot_record is not None:
            png = plot_record(record, docs / f"{slug}-{kind}.png")
            figure = f"![{title}: throughput per shape, ours vs baselines, under the measured ceilings]({png.name})\n\n"
            print("wrote", png)
        table = _strip_progress((run / f"bench_{kind}.txt").read_text())
        (docs / f"{slug}-{kind}.md").write_text(
            _header(title, device, commit, date, f"bash scripts/gpu_check.sh {kind}",
                    " (timings: `triton.testing.do_bench` medians, L2 flushed"
                    + ("; the *chilled* tables time each call as DeepGEMM's `bench_kineto`, the method of "
                       "ANCHORS.md's DeepGEMM figures: an 8 GB memset before every call and the stream synchronised, the "
                       "kernels' own durations from the profiler, median of 30"
                       if kind in ("gemm", "grouped") else "") + ")") + figure + table)
        print("wrote", docs / f"{slug}-{kind}.md")
    parts = [_header("GPU check: tests and JIT timings", device, commit, date,
                     "bash scripts/gpu_check.sh tests smoke demo"),
             "## Environment\n\n```\n" + re.sub(r"^# commit .*", f"# commit {commit}", (run / "info.txt").read_text().strip())
             + "\n```\n"]
    if (run / "gpu_tests.txt").exists():
        tail = [ln for ln in (run / "gpu_tests.txt").read_text().splitlines() if ln.strip()][-1]
        parts.append(f"## GPU tests\n\n`python -m pytest -m \"gpu or hopper or datapath\" tests/`: **{tail.strip('= ')}**\n")
    if (run / "jit_smoke.txt").exists():
        parts.append("## JIT runtime\n" + (run / "jit_smoke.txt").read_text().split("\n", 2)[-1].strip() + "\n")
    if (run / "demo.txt").exists():
        parts.append("## `moe-fp8 demo` on the GPU\n\n```\n" + _strip_progress((run / "demo.txt").read_text()).strip()
                     + "\n```\n")
    (docs / f"{slug}-gpu-check.md").write_text("\n".join(parts))
    print("wrote", docs / f"{slug}-gpu-check.md")


if __name__ == "__main__":
    main()
