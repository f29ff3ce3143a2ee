"""Turn the archive of one `scripts/gpu_check.sh` run into the committed records in docs/benchmarks/.

    python scripts/record_gpu_check.py RUN_DIR --commit SHA

RUN_DIR is the unpacked `gpu_check/` folder. Writes `<device>-gemm.{json,md}`,
`<device>-grouped.{json,md}` and `<device>-gpu-check.md` (environment, GPU test summary, JIT
timings) for whichever steps the run contains, each naming the commit and device measured.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def _device(run: Path) -> str:
    for line in (run / "info.txt").read_text().splitlines():
        if line.startswith("NVIDIA") or line.startswith("AMD"):
            return line.split(",")[0].strip()
    raise SystemExit("info.txt names no device")


def _strip_progress(text: str) -> str:
    return "\n".join(ln for ln in text.splitlines() if not re.match(r"^\[\d+/\d+\] ", ln)).strip() + "\n"


def _header(title: str, device: str, commit: str, date: str, command: str, timing: str = "") -> str:
    return f"# {title}\n\n- device: {device}\n- commit: `{commit}`\n- date: {date}\n- command: `{command}`{timing}\n\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run", type=Path)
    p.add_argument("--commit", required=True)
    args = p.parse_args()
    run, commit = args.run, args.commit
    device = _device(run)
    slug = "h100" if "H100" in device else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    DOCS.mkdir(parents=True, exist_ok=True)
    date = "unknown"
    titles = {"gemm": "FP8 block-scaled GEMM", "grouped": "Grouped FP8 GEMMs (contiguous, masked)",
              "moe-data": "MoE data path (quant, SiLU·mul+quant, routing, dispatch, combine)",
              "moe": "DeepSeek-V3 MoE layer (one expert-parallel rank of 8)"}
    for kind, title in titles.items():
        src = run / f"{slug}-{kind}.json"
        if not src.exists():
            continue
        record = json.loads(src.read_text())
        record["commit"] = commit
        date = record["date"]
        (DOCS / src.name).write_text(json.dumps(record, indent=1) + "\n")
        table = _strip_progress((run / f"bench_{kind}.txt").read_text())
        (DOCS / f"{slug}-{kind}.md").write_text(
            _header(title, device, commit, date, f"bash scripts/gpu_check.sh {kind}",
                    " (timings: `triton.testing.do_bench` medians, L2 flushed)") + table)
        print("wrote", DOCS / f"{slug}-{kind}.md")
    parts = [_header("GPU check: tests and JIT timings", device, commit, date,
                     "bash scripts/gpu_check.sh tests smoke"),
             "## Environment\n\n```\n" + re.sub(r"^# commit .*", f"# commit {commit}", (run / "info.txt").read_text().strip())
             + "\n```\n"]
    if (run / "gpu_tests.txt").exists():
        tail = [ln for ln in (run / "gpu_tests.txt").read_text().splitlines() if ln.strip()][-1]
        parts.append(f"## GPU tests\n\n`python -m pytest -m \"gpu or hopper\" tests/`: **{tail.strip('= ')}**\n")
    if (run / "jit_smoke.txt").exists():
        parts.append("## JIT runtime\n" + (run / "jit_smoke.txt").read_text().split("\n", 2)[-1].strip() + "\n")
    (DOCS / f"{slug}-gpu-check.md").write_text("\n".join(parts))
    print("wrote", DOCS / f"{slug}-gpu-check.md")


if __name__ == "__main__":
    main()
